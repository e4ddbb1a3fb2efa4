"""--tp-size: each model copy sharded over --tp-size processes with transformers' tp_plan (gloo on CPU); several
copies split the units (data parallel across tensor-parallel copies). Each must equal the 1-process output."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    Child,
    assert_units_intact,
    child_env,
    committed_units,
    free_port,
    is_complete,
)

import hsx

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "recipes" / "demo.yaml"
COMMON = ["extract", "--config", str(DEMO), "--dtype", "float32", "--limit", "40"]


def command(args, nproc):
    if nproc == 1:
        return [sys.executable, "-m", "hsx", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), "-m", "hsx", *args]


def run(args, nproc):
    return subprocess.run(command(args, nproc), cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=600)


def failure(r) -> str:
    """Every rank's hsx lines (the launcher's traceback would push them out of a plain tail), then the tail."""
    return "\n".join([line for line in r.stderr.splitlines() if "hsx:" in line] + [r.stderr[-1500:]])


def states(out):
    col = hsx.load(str(out)).data.table.column("hidden_states").combine_chunks().flatten().flatten()
    return torch.from_numpy(col.to_numpy().copy()).view(torch.bfloat16).float()


def assert_equals(out: Path, ref: Path) -> None:
    a, b = hsx.load(str(ref)).data.table, hsx.load(str(out)).data.table
    for c in ("sample_id", "input_ids", "loss_mask"):
        assert a.column(c).combine_chunks().equals(b.column(c).combine_chunks()), c
    x, y = states(ref), states(out)
    assert ((x - y).norm() / x.norm()) < 1e-4  # sharded matmuls sum in another order; stored as bf16


def writers(out: Path) -> list[str]:
    return sorted(m.name for m in (out / ".hsx").glob("manifest-*.jsonl") if m.stat().st_size)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tp-ref") / "one"
    r = run(COMMON + ["--output-dir", str(out)], 1)
    assert r.returncode == 0, failure(r)
    return out


@pytest.mark.slow
def test_two_tensor_parallel_ranks_equal_one_process(tmp_path, reference):
    r = run(COMMON + ["--output-dir", str(tmp_path / "tp"), "--tp-size", "2"], 2)
    assert r.returncode == 0, failure(r)
    info = json.loads((tmp_path / "tp" / "hsx.json").read_text())
    assert (info["world_size"], info["config"]["tp_size"], info["run"]["model_copies"]) == (2, 2, 1)
    assert writers(tmp_path / "tp") == ["manifest-00000.jsonl"]
    assert_equals(tmp_path / "tp", reference)


@pytest.mark.slow
def test_two_copies_of_two_tensor_parallel_ranks_equal_one_process(tmp_path, reference):
    """4 processes, --tp-size 2: copies {0,1} and {2,3} split the units; ranks 0 and 2 write."""
    r = run(COMMON + ["--output-dir", str(tmp_path / "dptp"), "--tp-size", "2"], 4)
    assert r.returncode == 0, failure(r)
    info = json.loads((tmp_path / "dptp" / "hsx.json").read_text())
    assert (info["world_size"], info["config"]["tp_size"]) == (4, 2)
    assert (info["run"]["tp_size"], info["run"]["model_copies"]) == (2, 2)
    assert info["run"]["tokens"] > 0  # whichever rank finalized, a writer or not, counted its copy's tokens
    assert writers(tmp_path / "dptp") == ["manifest-00000.jsonl", "manifest-00002.jsonl"]
    assert r.stdout.count("hsx: wrote 40 rows") == 1  # exactly one process finalized
    assert_equals(tmp_path / "dptp", reference)


@pytest.mark.slow
def test_a_killed_dp_tp_run_resumes_with_one_copy(tmp_path, reference):
    """SIGKILL a 4-process --tp-size 2 job (launcher and workers) after its first units; 2 processes (one copy)
    finish it, equal to the 1-process output."""
    out = tmp_path / "out"
    argv = COMMON + ["--output-dir", str(out), "--tp-size", "2"]
    child = Child(command(argv, 4), tmp_path / "run", env=child_env(), cwd=ROOT)
    assert child.poll_until(lambda: committed_units(out) >= 2), child.stderr
    child.kill_tree(signal.SIGKILL)
    assert child.wait() != 0
    child.kill_tree(signal.SIGKILL)  # nothing of the job may outlive it
    done = len(assert_units_intact(out))
    units = len(json.loads((out / ".hsx" / "summary.json").read_text())["unit_names"])
    assert 2 <= done < units and not is_complete(out), (done, units)

    r = run(argv, 2)
    assert r.returncode == 0, failure(r)
    assert "continuing the job" in r.stdout
    info = json.loads((out / "hsx.json").read_text())
    assert info["complete"] and info["world_size"] == 2 and info["units"] == units
    assert_equals(out, reference)


@pytest.mark.slow
def test_tp_size_must_divide_the_processes(tmp_path):
    r = run(["extract", "--config", str(DEMO), "--output-dir", str(tmp_path / "x"), "--tp-size", "2"], 1)
    assert r.returncode == 1 and "--tp-size 2 with 1 processes" in r.stderr and "Traceback" not in r.stderr
    assert "launch a multiple of --tp-size processes" in r.stderr


def test_a_copy_may_not_span_machines(monkeypatch):
    """Copies are consecutive ranks: 2 processes per machine with --tp-size 4 would put a copy on two machines."""
    from hsx.config import HsxError
    from hsx.run import current_process

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(HsxError, match="--tp-size 4 with 2 processes per machine: a model copy would span two"):
        current_process(tp_size=4)
