"""The output dir: claiming it for a job (and refusing dirs hsx did not write), finalizing, empty outputs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import hsx
from hsx.config import HsxError
from hsx.schema import OutputFormat
from hsx.sink import OutputDir, info_features, job_fingerprint

CARD = "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*.arrow\n---\n"
INFO = {"layers": [1, 3], "hidden_size": 64, "final_hidden": True, "complete": True, "model": "m",
        "num_model_layers": 4, "storage_dtype": "bfloat16", "max_length": 16, "config": {},
        "counts": {"rows_in": 0, "rows_written": 0, "tokens_written": 0, "truncated": 0, "skipped": {}}}


def job(**inputs):
    return job_fingerprint({"model": "m", "input": "a", **inputs})


def tree(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ---- locked: a dir hsx did not write is refused before anything is created in it --------------------------------

def test_locked_refuses_a_foreign_dir_and_creates_nothing(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    out = OutputDir(tmp_path)
    with pytest.raises(HsxError, match="not empty and was not written by hsx"):
        with out.locked():
            pass
    assert tree(tmp_path) == ["notes.txt"]


@pytest.mark.parametrize("setup", ["missing", "empty", "hsx-state-only"])
def test_locked_accepts_new_empty_and_hsx_dirs(tmp_path, setup):
    root = tmp_path / "out"
    if setup != "missing":
        root.mkdir()
    if setup == "hsx-state-only":  # a run that failed before claiming (a bad --model) left only its lock
        (root / ".hsx").mkdir()
        (root / ".hsx" / "lock").write_text("")
    out = OutputDir(root)
    with out.locked():
        assert out.claim(job(), overwrite=False) == "new"
    assert (root / ".hsx" / "job.json").exists()


def test_locked_refuses_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(HsxError, match="not a folder"):
        with OutputDir(tmp_path / "f").locked():
            pass


# ---- claim --------------------------------------------------------------------------------------------------

def test_same_job_resumes_or_is_complete(tmp_path):
    out = OutputDir(tmp_path / "out")
    with out.locked():
        assert out.claim(job(), False) == "new"
        assert out.claim(job(), False) == "resume"
        (out.root / "hsx.json").write_text(json.dumps(INFO))
        assert out.claim(job(), False) == "complete"


def test_a_dir_without_output_is_reclaimed_by_another_job(tmp_path):
    """A job that failed before committing a unit (--strict, no chat template, ...) leaves only .hsx state; the
    next job takes the dir over and the stale state goes."""
    out = OutputDir(tmp_path / "out")
    with out.locked():
        assert out.claim(job(input="a"), False) == "new"
        (out.state / "tokenized").mkdir()
        (out.state / "tokenized" / "tokens.arrow").write_bytes(b"stale")
        out.unit_tmp("000-00000").write_bytes(b"half a unit")
        (out.state / "manifest-00000.jsonl").write_text("")
        (out.data).mkdir()
        new = job(input="b")
        assert out.claim(new, False) == "new"
        assert json.loads((out.state / "job.json").read_text())["fingerprint"] == new["fingerprint"]
        assert tree(out.root) == [".hsx", ".hsx/busy", ".hsx/job.json", ".hsx/lock", "README.md"]
        assert out.claim(new, False) == "resume"


@pytest.mark.parametrize("output", ["manifest", "data_file", "hsx_json"])
def test_a_dir_with_output_of_another_job_is_refused(tmp_path, output):
    out = OutputDir(tmp_path / "out")
    with out.locked():
        out.claim(job(input="a"), False)
        if output == "manifest":
            (out.state / "manifest-00000.jsonl").write_text('{"unit": "000-00000"}\n')
        elif output == "data_file":
            out.data.mkdir()
            (out.data / "train-000-00000.arrow").write_bytes(b"x")
        else:
            (out.root / "hsx.json").write_text("{}")
        before = tree(out.root)
        with pytest.raises(HsxError, match=r"holds a different job \(differs in: input\)"):
            out.claim(job(input="b"), False)
        assert tree(out.root) == before
        assert out.claim(job(input="b"), overwrite=True) == "new"


# ---- finalize: a job without rows still gets a loadable data file -----------------------------------------------

def test_finalize_without_units_writes_an_empty_data_file(tmp_path):
    from datasets import Dataset, load_dataset

    out = OutputDir(tmp_path / "empty-output")  # a name of its own: datasets caches local dirs by folder name
    feats = OutputFormat(2, 64, True).features()
    with out.locked():
        out.claim(job(), False)
        out.unit_tmp("000-00000")  # finalize also clears .hsx/tmp
        out.finalize(INFO, CARD, features=feats)
    assert [p.name for p in out.data_files()] == ["train-000-00000.arrow"]
    assert tree(out.root) == [".hsx", ".hsx/busy", ".hsx/job.json", ".hsx/lock", "README.md", "data",
                              "data/train-000-00000.arrow", "hsx.json"]
    ds = Dataset.from_file(str(out.data_files()[0]))
    assert ds.num_rows == 0 and ds.features == feats
    loaded = hsx.load(str(out.root))
    assert len(loaded) == 0 and loaded.features == feats
    assert loaded.features["hidden_states"].feature.feature.id == "bfloat16"
    assert len(hsx.torch_view(str(out.root))) == 0
    streamed = load_dataset(str(out.root), split="train", streaming=True)
    assert list(streamed) == [] and streamed.features == feats


def test_finalize_empty_schema_defaults_to_the_info(tmp_path):
    out = OutputDir(tmp_path / "out")
    with out.locked():
        out.claim(job(), False)
        out.finalize({**INFO, "final_hidden": False}, CARD)
    assert hsx.load(str(out.root)).features == OutputFormat(2, 64, False).features()
    assert info_features({"layers": [1]}) is None


def test_finalize_with_units_adds_no_empty_file(tmp_path):
    out = OutputDir(tmp_path / "out")
    out.data.mkdir(parents=True)
    (out.data / "train-003-00000.arrow").write_bytes(b"a unit")
    out.finalize(INFO, CARD, features=OutputFormat(2, 64, True).features())
    assert [p.name for p in out.data_files()] == ["train-003-00000.arrow"]


# ---- load: the read-only warning is silenced where it happens, not for the whole program -------------------------

@pytest.mark.slow
def test_load_silences_the_read_only_warning_only_where_it_happens():
    code = (
        "import warnings, numpy as np\nfrom hsx.load import _tensor\n"
        "assert not any(f[1] is not None and 'not writable' in f[1].pattern for f in warnings.filters), "
        "'hsx.load installed a global warnings filter'\n"
        "warnings.simplefilter('error')\n"  # a warning that escapes _tensor raises here
        "a = np.arange(4, dtype=np.int16)\n"
        "a.setflags(write=False)\n"
        "t = _tensor(a)\n"
        "assert t.tolist() == [0, 1, 2, 3] and t.data_ptr() == a.ctypes.data\n"  # a view, no copy
        "print('ok')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ok"
