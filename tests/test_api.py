"""The Python API: `hsx.extract(...)` runs the job `hsx extract` runs (same rows, same bits) and returns its rows;
`hsx.plan(...)` returns the dict `hsx plan --json` prints; options are parsed as the CLI parses a recipe."""

from __future__ import annotations

import json
import subprocess
import sys

import datasets
import pytest

import hsx
from helpers import REPO, hsx_main, one_torch_thread
from hsx.config import HsxError

DEMO = REPO / "recipes/demo.yaml"
# recipes/demo.yaml's keys, spelled as keyword arguments (the recipe's paths are relative to recipes/)
DEMO_KEYS = dict(model=str(REPO / "hsx/demo/tiny-qwen3"), dataset=str(REPO / "hsx/demo/chat.jsonl"),
                 layers="dflash", final_hidden=True, max_length=512)


def api_extract(capsys, **options) -> tuple[datasets.Dataset, str]:
    with one_torch_thread():
        ds = hsx.extract(**options)
    return ds, capsys.readouterr().out


def assert_same_rows(got: datasets.Dataset, want: datasets.Dataset) -> None:
    assert got.column_names == want.column_names
    assert got["sample_id"] == want["sample_id"]
    for column in ("input_ids", "hidden_states", "final_hidden_state", "loss_mask"):
        # Arrow equality of the stored values: the bf16 states are kept as their 16-bit patterns, so equal is
        # bit for bit (no float comparison in between)
        assert got.data.column(column).equals(want.data.column(column)), column


@pytest.fixture(scope="module")
def cli_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("api") / "cli"
    rc, _, err = hsx_main(["extract", "--config", str(DEMO), "--output-dir", str(out), "--compile", "off"])
    assert rc == 0, err
    return out


def test_import_hsx_stays_light():
    code = "import sys, hsx; print([m for m in ('torch', 'datasets', 'transformers', 'yaml') if m in sys.modules])"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
    assert callable(hsx.extract) and callable(hsx.plan)


@pytest.mark.slow
def test_extract_from_keywords_equals_the_cli(cli_demo, tmp_path, capsys):
    out = tmp_path / "api"
    ds, printed = api_extract(capsys, **DEMO_KEYS, output_dir=str(out), compile="off")
    assert isinstance(ds, datasets.Dataset) and len(ds) == 96
    assert "wrote 96 rows" in printed
    assert_same_rows(ds, hsx.load(cli_demo))
    for name in sorted(p.name for p in (cli_demo / "data").glob("*.arrow")):  # the same files, byte for byte
        assert (out / "data" / name).read_bytes() == (cli_demo / "data" / name).read_bytes(), name


@pytest.mark.slow
def test_extract_again_is_a_no_op_returning_the_same_rows(tmp_path, capsys):
    out = tmp_path / "out"
    first, _ = api_extract(capsys, config=str(DEMO), output_dir=str(out), compile="off")
    files = {p: p.stat().st_mtime_ns for p in (out / "data").glob("*.arrow")}
    again, printed = api_extract(capsys, config=str(DEMO), output_dir=str(out), compile="off")
    assert "already complete (96 rows); nothing to do" in printed
    assert {p: p.stat().st_mtime_ns for p in (out / "data").glob("*.arrow")} == files  # nothing rewritten
    assert_same_rows(again, first)


@pytest.mark.slow
def test_recipe_plus_overrides(tmp_path, capsys):
    out = tmp_path / "out"  # a pathlib.Path for the recipe and the output dir, as a notebook passes them
    ds, printed = api_extract(capsys, config=DEMO, output_dir=out, layers=[1, -1], final_hidden=False, limit=20,
                              compile="off")
    info = json.loads((out / "hsx.json").read_text())
    assert info["layers"] == [1, 7] and info["final_hidden"] is False  # the overrides won over the recipe's dflash
    assert info["max_length"] == 512  # the recipe's own key kept
    assert "final_hidden_state" not in ds.column_names
    assert len(ds) == info["counts"]["rows_written"] and 0 < len(ds) <= 20
    assert f"wrote {len(ds)} rows" in printed


@pytest.mark.parametrize("options, needle", [
    ({"trust_remote_code": "false"}, "trust_remote_code must be true or false (unquoted)"),
    ({"layerz": [1]}, "unknown option(s) layerz"),
    ({"max_length": "512"}, "max_length must be an integer"),
    ({"layers": []}, "--layers is required"),
])
def test_bad_options_are_one_line_errors_before_anything_runs(tmp_path, options, needle):
    out = tmp_path / "out"
    for call in (hsx.extract, hsx.plan):
        with pytest.raises(HsxError) as e:
            call(**{**DEMO_KEYS, "output_dir": str(out), **options})
        assert needle in str(e.value) and "\n" not in str(e.value)
    assert not out.exists()


def test_config_must_be_a_path():
    with pytest.raises(HsxError, match="config must be the path of a YAML recipe, got dict"):
        hsx.extract(config={"model": "m"})


@pytest.mark.parametrize("cli, api", [
    (["--config", "recipes/demo.yaml", "--tokens", "1000"], dict(config="recipes/demo.yaml", tokens=1000)),
    (["--config", "recipes/demo.yaml"], dict(config="recipes/demo.yaml")),  # tokenizes the local rows
    (["--model", "Qwen/Qwen3-8B", "--layers", "1", "-1", "--tokens", "1000000", "--gpu-memory-gib", "40"],
     dict(model="Qwen/Qwen3-8B", layers=[1, -1], tokens=1_000_000, gpu_memory_gib=40)),
    (["--model", "Qwen/Qwen3-235B-A22B", "--layers", "eagle3", "--no-final-hidden", "--rate", "2000"],
     dict(model="Qwen/Qwen3-235B-A22B", layers="eagle3", final_hidden=False, rate=2000)),
    (["--shape", "tiny", "--layers", "1", "3", "--tokens", "5000"], dict(shape="tiny", layers=[1, 3], tokens=5000)),
])
def test_plan_returns_what_hsx_plan_json_prints(cli, api, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    rc, stdout, err = hsx_main(["plan", *cli, "--json"])
    assert rc == 0, err
    printed = json.loads(stdout)
    got = hsx.plan(**api)
    assert json.loads(json.dumps(got)) == printed
    assert printed["bytes_per_token"] > 0 and printed["gpus_per_copy"] >= 1


def test_plan_usage_errors_match_the_cli(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    rc, _, err = hsx_main(["plan", "--model", "Qwen/Qwen3-8B", "--layers", "1", "--max-length", "0"])
    assert rc == 2
    with pytest.raises(HsxError) as e:
        hsx.plan(model="Qwen/Qwen3-8B", layers=[1], max_length=0)
    assert err.strip() == f"hsx: error: {e.value}"
    with pytest.raises(HsxError, match="unknown gpu 'a100'"):
        hsx.plan(model="Qwen/Qwen3-8B", layers=[1], gpu="a100")


def test_a_rank_that_does_not_finalize_returns_none(tmp_path, monkeypatch):
    # what hsx.run.extract returns on a rank of several whose units are written while the others still run
    monkeypatch.setattr("hsx.run.extract", lambda cfg: {"complete": False, "rank": 1, "run": {}})
    assert hsx.extract(**DEMO_KEYS, output_dir=str(tmp_path / "out")) is None


def _hsx_threads() -> list[str]:
    import threading

    return sorted(t.name for t in threading.enumerate() if t.name.startswith("hsx"))


@pytest.mark.slow
def test_extract_leaves_no_thread_running(tmp_path, monkeypatch, capsys):
    """Every thread a job starts (GPU producer, compile worker, committer, writer and checksum threads) is joined
    before hsx.extract returns or raises: one left inside torch's C++ code when the interpreter exits aborts the
    process ("FATAL: exception not rethrown", exit -6, after the work is done). The compile worker is made slow
    (each compile takes 2 s) so that the job ends while it is still compiling."""
    import time

    import torch

    from helpers import write_jsonl
    from hsx.demo import chat_rows
    from hsx.sink import OutputDir

    def slow_compile(forward, **kwargs):
        def compiled(*args, **kw):
            if torch.compiler.is_compiling() is False and not getattr(compiled, "done", False):
                time.sleep(2.0)
                compiled.done = True
            return forward(*args, **kw)
        return compiled

    monkeypatch.setattr(torch, "compile", slow_compile)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8, seed=3))
    # (a small budget: the compile starts after a forward of half of it, CompileAhead's representative sample)
    keys = {**DEMO_KEYS, "dataset": str(data), "compile": "on", "max_length": 128, "token_budget": 256}
    assert _hsx_threads() == []
    with one_torch_thread():
        ds = hsx.extract(**keys, output_dir=str(tmp_path / "ok"))
    assert len(ds) > 0 and _hsx_threads() == []
    assert "waiting for torch.compile's worker" in capsys.readouterr().out  # the job did end mid-compile

    def broken_commit(self, *args, **kwargs):
        raise OSError("the disk went away")

    monkeypatch.setattr(OutputDir, "commit", broken_commit)
    with one_torch_thread(), pytest.raises(OSError, match="the disk went away"):
        hsx.extract(**keys, output_dir=str(tmp_path / "failed"))
    assert _hsx_threads() == []
