"""Several processes on this CPU machine: `accelerate launch --multi_gpu --num_processes 2` and `torchrun
--nproc_per_node 2` give two real ranks coordinating over gloo. Their output must equal the 1-process reference of
conftest.py's `fault_reference` (same sample_ids in the same order, same tokens and masks, bit-identical states),
with hsx.json's world_size 2 and each rank's own manifest; a run that loses a rank must resume, with any number of
processes, to the same output.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
from pathlib import Path

import pytest

import hsx
from hsx.errors import HsxError

from helpers import (
    Child,
    assert_equals_reference,
    assert_units_intact,
    child_env,
    committed_units,
    descendants,
    free_port,
    hsx_main,
    is_complete,
    manifest_records,
    torn_manifest_copy,
)

pytestmark = pytest.mark.slow


def accelerate_launch(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), "-m", "hsx", *argv]


def torchrun(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), "-m", "hsx", *argv]


def launch(cmd: list[str], logs: Path) -> Child:
    return Child(cmd, logs, env=child_env())


def rank_manifests(out: Path) -> dict[str, list[dict]]:
    recs = {}
    for m in sorted((out / ".hsx").glob("manifest-*.jsonl")):
        recs[m.name] = [json.loads(line) for line in m.read_text().splitlines()]
    return recs


def assert_two_ranks_shared_the_work(out: Path) -> None:
    """Both ranks committed units, from their own manifest; split by tokens (longest-processing-time first: the
    two loads differ by at most one unit)."""
    per_rank = rank_manifests(out)
    assert sorted(per_rank) == ["manifest-00000.jsonl", "manifest-00001.jsonl"], sorted(per_rank)
    assert all(per_rank.values()), {k: len(v) for k, v in per_rank.items()}
    tokens = [sum(r["tokens"] for r in recs) for recs in per_rank.values()]
    biggest = max(r["tokens"] for recs in per_rank.values() for r in recs)
    assert abs(tokens[0] - tokens[1]) <= biggest, tokens


@pytest.mark.parametrize("launcher", [accelerate_launch, torchrun], ids=["accelerate", "torchrun"])
def test_two_processes_equal_one(tmp_path, fault_reference, launcher):
    ref = fault_reference
    out = tmp_path / "out"
    child = launch(launcher(ref.argv(out)), tmp_path / "run")
    rc = child.wait()
    assert rc == 0, child.stderr
    assert "Traceback" not in child.stderr
    assert_equals_reference(out, ref, world_size=2)
    assert_two_ranks_shared_the_work(out)
    assert child.stdout.count("hsx: wrote 96 rows") == 1  # exactly one process finalized
    # hsx.json's throughput is the job's: both ranks' tokens over the slowest rank's time, each rank kept apart
    run = json.loads((out / "hsx.json").read_text())["run"]
    assert [r["rank"] for r in run["ranks"]] == [0, 1]
    per_rank = [sum(r["tokens"] for r in recs) for recs in rank_manifests(out).values()]
    assert [r["tokens"] for r in run["ranks"]] == per_rank and run["tokens"] == sum(per_rank)
    assert run["seconds"] == max(r["seconds"] for r in run["ranks"])
    # the second rank read rank 0's tokenized cache: one cache file
    assert [p.name for p in (out / ".hsx" / "tokenized").glob("*.arrow")] == ["tokens.arrow"]


def _rank_of(pid: int) -> int | None:
    try:
        env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"RANK="):
            return int(kv[5:])
    return None


def rank_pid(launcher_pid: int, rank: int) -> int:
    """The worker process of `rank` under the launcher (accelerate and torchrun start workers as children)."""
    for pid in descendants(launcher_pid):
        if _rank_of(pid) == rank:
            return pid
    raise AssertionError(f"no worker of rank {rank} under pid {launcher_pid}")


@pytest.mark.parametrize(("victim", "resumes"), [("rank1", ("1", "accelerate")), ("rank0", ("1",)),
                                                 ("launcher", ("torchrun",))], ids=["rank1", "rank0", "launcher"])
def test_a_killed_rank_resumes_with_one_or_two_processes(tmp_path, fault_reference, victim, resumes):
    """SIGKILL one rank (or the launcher and its workers at once) mid-run; then, from copies of what it left, resume
    with 1 process and/or with 2 processes (accelerate or torchrun): each equals the 1-process reference."""
    ref = fault_reference
    out = tmp_path / "out"
    k = random.Random(victim).randint(6, ref.units // 2)
    child = launch(accelerate_launch(ref.argv(out)), tmp_path / "run")
    assert child.poll_until(lambda: committed_units(out) >= k and all(rank_manifests_nonempty(out))), child.stderr
    if victim == "launcher":
        child.kill_tree(signal.SIGKILL)
    else:
        os.kill(rank_pid(child.proc.pid, int(victim[-1])), signal.SIGKILL)
    rc = child.wait()
    child.kill_tree(signal.SIGKILL)  # nothing of the job may outlive it
    assert rc != 0, child.stderr
    done = len(assert_units_intact(out))
    assert k <= done < ref.units and not is_complete(out), (done, ref.units)

    for how in resumes:
        resumed = tmp_path / f"resume-{how}"
        shutil.copytree(out, resumed)
        if how == "1":
            rc, stdout, stderr = hsx_main(ref.argv(resumed))
            assert rc == 0, stderr
            assert "continuing the job" in stdout
            assert_equals_reference(resumed, ref, world_size=1, verify=False)
        else:
            launcher = accelerate_launch if how == "accelerate" else torchrun
            child = launch(launcher(ref.argv(resumed)), tmp_path / f"run-{how}")
            rc = child.wait()
            assert rc == 0, child.stderr
            assert_equals_reference(resumed, ref, world_size=2, verify=False)
            before = {m: len(r) for m, r in rank_manifests(out).items()}
            after = {m: len(r) for m, r in rank_manifests(resumed).items()}
            assert all(after[m] > before.get(m, 0) for m in after), (before, after)  # both ranks did the rest


def rank_manifests_nonempty(out: Path) -> list[bool]:
    ms = [out / ".hsx" / f"manifest-{r:05d}.jsonl" for r in (0, 1)]
    return [m.exists() and m.stat().st_size > 0 for m in ms]


def test_two_processes_never_exit_0_with_an_incomplete_job(tmp_path, fault_reference):
    ref = fault_reference
    out = tmp_path / "out"
    torn_manifest_copy(ref, out)
    child = launch(accelerate_launch(ref.argv(out)), tmp_path / "run")
    rc = child.wait()
    assert is_complete(out) or rc != 0, (rc, child.stdout)


# ---- nodes without a shared disk: each writes its own dir, `hsx merge` joins them ---------------------------------

def node_launch(argv: list[str], machine_rank: int, machines: int, per_node: int, port: int) -> list[str]:
    """One node of a multi-node `accelerate launch` (every node runs this with its own --machine_rank); here all
    the "nodes" are this machine, each given its own output dir, as nodes with local disks would be."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", str(machines),
            "--num_processes", str(machines * per_node), "--machine_rank", str(machine_rank),
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--mixed_precision", "no",
            "--dynamo_backend", "no", "-m", "hsx", *argv]


def launch_nodes(ref, dirs: list[Path], per_node: int, logs: Path) -> list[Child]:
    port = free_port()
    return [launch(node_launch(ref.argv(d), rank, len(dirs), per_node, port), logs / f"node{rank}")
            for rank, d in enumerate(dirs)]


def units_of(out: Path) -> set[str]:
    return {r["unit"] for r in manifest_records(out)}


def test_two_nodes_with_their_own_dirs_merge_to_one_process(tmp_path, fault_reference):
    """2 nodes × 2 processes, each node with its own dir (gloo, --machine_rank): every node exits 0 with its share
    of the units in its dir, no dir claims to be the whole output, and `hsx merge` of the two equals one process bit
    for bit. Then node 1's dir is lost: one process on node 0's dir redoes exactly node 1's units."""
    ref = fault_reference
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    children = launch_nodes(ref, dirs, 2, tmp_path / "run")
    for child in children:
        rc = child.wait(timeout=300)
        assert rc == 0, child.stderr
        assert "Traceback" not in child.stderr
    shares = [units_of(d) for d in dirs]
    assert all(shares) and not shares[0] & shares[1], shares  # each node wrote its own units, none twice
    assert len(shares[0] | shares[1]) == ref.units
    for d, child in zip(dirs, children):
        assert_units_intact(d)
        assert not (d / "hsx.json").exists() and not is_complete(d)  # a node's share is not the dataset
        assert {m.name for m in (d / ".hsx").glob("manifest-*.jsonl")} == (  # its own ranks' manifests only
            {"manifest-00000.jsonl", "manifest-00001.jsonl"} if d.name == "node0" else
            {"manifest-00002.jsonl", "manifest-00003.jsonl"})
        assert f"holds {len(units_of(d))} of the job's {ref.units} units" in child.stdout
        with pytest.raises(HsxError) as e:  # reading it says the next step, the merge (not the same hsx extract)
            hsx.load(str(d))
        assert f"one node's finished share of a job ({len(units_of(d))} of its {ref.units} units" in str(e.value)
        assert "`hsx merge OUT NODE_DIR...`" in str(e.value) and "hsx extract" not in str(e.value)
    rc, stdout, stderr = hsx_main(["merge", str(tmp_path / "merged"), *map(str, dirs)])
    assert rc == 0, stderr
    assert_equals_reference(tmp_path / "merged", ref, world_size=0, verify=False)

    shutil.rmtree(dirs[1])  # node 1 and its disk are gone: node 0's dir alone, one process
    rc, stdout, stderr = hsx_main(ref.argv(dirs[0]))
    assert rc == 0, stderr
    assert_equals_reference(dirs[0], ref, world_size=1, verify=False)
    redone = [r["unit"] for r in manifest_records(dirs[0]) if r["unit"] not in shares[0]]
    assert sorted(redone) == sorted(shares[1])  # the lost node's units, each once, and nothing else


def test_eight_processes_killed_resume_on_four_with_a_node_replaced(tmp_path, fault_reference):
    """The 8-process job (2 nodes × 4, own dirs) killed mid-run; node 1 and its dir are lost. It resumes on 4
    processes: node 0 (its dir) and a new node with an empty dir. Every unit node 0 kept is kept, only the rest is
    done, and `hsx merge` of the two dirs equals one process bit for bit."""
    ref = fault_reference
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    children = launch_nodes(ref, dirs, 4, tmp_path / "run")
    k = ref.units // 3
    counts = lambda: [committed_units(d) for d in dirs]  # noqa: E731
    assert children[0].poll_until(lambda: min(counts()) >= 2 and sum(counts()) >= k, timeout=300), children[0].stderr
    for child in children:
        child.kill_tree(signal.SIGKILL)
    for child in children:
        child.wait()
        child.kill_tree(signal.SIGKILL)  # nothing of the job may outlive it
    kept = {r["unit"]: r for r in assert_units_intact(dirs[0])}
    assert 0 < len(kept) < ref.units and not is_complete(dirs[0])
    shutil.rmtree(dirs[1])

    replaced = [dirs[0], tmp_path / "node2"]
    for child in launch_nodes(ref, replaced, 2, tmp_path / "resume"):
        rc = child.wait(timeout=300)
        assert rc == 0, child.stderr
    after = {r["unit"]: r for r in assert_units_intact(dirs[0])}
    assert all(after[u] == rec for u, rec in kept.items())  # node 0's finished units were not redone
    new = units_of(replaced[1])
    assert new and not new & set(kept) and not new & set(after)  # the new node did only what no dir held
    rc, stdout, stderr = hsx_main(["merge", str(tmp_path / "merged"), *map(str, replaced)])
    assert rc == 0, stderr
    assert_equals_reference(tmp_path / "merged", ref, world_size=0, verify=False)


def test_which_ranks_share_a_dir_is_what_they_see_made_symmetric(monkeypatch):
    """share_dir groups ranks by the announce files each sees: one-sided sight (a listing lagging on one client)
    still joins two ranks, and ranks that see nothing of each other write separate dirs."""
    from types import SimpleNamespace

    from hsx import ledgers
    from hsx.run import Process, share_dir

    views = [[0], [0, 1], [2, 3], [2, 3], [4]]  # rank 0 does not (yet) see rank 1's file; rank 1 sees rank 0's
    for rank in range(5):
        proc = Process(rank=rank, world_size=5, device=None)
        proc.barrier = lambda: None
        proc.all_gather = lambda value, rank=rank: [value if r == rank else v for r, v in enumerate(views)]
        out = SimpleNamespace(state=rank)  # (the announce files each rank sees: `views`, by its .hsx/)
        monkeypatch.setattr(ledgers, "announce", lambda state, run_id, r: None)
        monkeypatch.setattr(ledgers, "announced", lambda state, run_id: views[state])
        share = share_dir(out, proc, "run")
        assert share.ranks == {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3], 4: [4]}[rank]
        assert share.leads == (rank in (0, 2, 4)) and not share.whole
