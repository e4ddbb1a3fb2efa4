"""Notebooks: every notebook in notebooks/ executes top to bottom, offline and headless, so none can rot; and
none is committed with outputs."""

from __future__ import annotations

import json

import pytest

from helpers import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
SKIP = "needs the notebook extra: pip install -e '.[notebook]' (the test extra includes it)"
# per notebook: the figures it must draw at least, and the temporary dir its demo job writes
EXPECT = {"explore.ipynb": (4, "hsx-explore-*"), "train-drafter.ipynb": (2, "hsx-drafter-*")}


def test_there_is_a_notebook():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in code), \
        f"{path.name} has outputs: clear them before committing"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, tmp_path, monkeypatch):
    nbclient = pytest.importorskip("nbclient", reason=SKIP)
    nbformat = pytest.importorskip("nbformat", reason=SKIP)
    pytest.importorskip("ipykernel", reason=SKIP)
    pytest.importorskip("matplotlib", reason=SKIP)

    # The kernel inherits this environment: offline (conftest), headless, no output dir given (so the notebook
    # runs the demo job itself), its temporary files under tmp_path, and one torch thread: on a busy 2-core
    # machine two OpenMP threads spin against other processes and the demo job took 30 s instead of 1 s.
    monkeypatch.delenv("HSX_OUTPUT_DIR", raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    figures = [o for o in outputs if "image/png" in o.get("data", {})]
    want_figures, demo_dir = EXPECT[path.name]
    assert len(figures) >= want_figures, f"expected {want_figures}+ figures, got {len(figures)}"
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "wrote 96 rows" in printed, "the demo job wrote nothing"
    assert not list(tmp_path.glob(demo_dir)), "the notebook left its demo output behind"
    if path.name == "train-drafter.ipynb":
        assert_drafting_pays(printed)


def assert_drafting_pays(printed):
    """The head trained on the right states drafts clearly better on held-out prompts than the same head trained on
    other rows' states (1.36× to 1.84× measured across seeds and library builds: the target's greedy turns shift
    with the build), and well enough to pay. The wrong layers (1, 2, 3 of the 8-layer target) drafted from 0.93 to
    1.0 of the right ones': close, so not asserted."""
    line = next(ln for ln in printed.splitlines() if ln.startswith("mean acceptance length: "))
    got = {k: float(v) for k, v in (item.rsplit(" ", 1) for item in line.split(": ", 1)[1].split(", "))}
    assert got["right layers"] >= 1.25 * got["shuffled rows"], got
    assert got["right layers"] >= 2.5, got
