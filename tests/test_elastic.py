"""Elastic jobs (`--elastic HOST:PORT`, hsx.claims) under real torchrun agents with c10d rendezvous on this machine,
each "node" with its own output dir: a node SIGKILLed mid-job (its dir deleted) leaves the survivor to finish the
whole job alone, equal to one process bit for bit, long before torch's 300 s exit barrier; a node that joins a
running job with its own launcher takes units, and `hsx merge` of the two dirs equals one process."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from helpers import (Child, assert_equals_reference, assert_units_intact, child_env, committed_units, descendants,
                     free_port, hsx_main, manifest_records)

pytestmark = pytest.mark.slow

LEASE = "10"  # seconds without a heartbeat before a process is taken for lost (a loaded 2-core box stalls ~s)


def units_of(out: Path) -> set[str]:
    return {r["unit"] for r in manifest_records(out)}


def agent(ref, out: Path, port: int, logs: Path, *launch: str, lease: str = LEASE) -> Child:
    """One node: a torchrun agent of the c10d rendezvous at 127.0.0.1:`port` (`launch`: its rendezvous options),
    one hsx process claiming units through that store."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", *launch,
           "-m", "hsx", *ref.argv(out), "--elastic", f"127.0.0.1:{port}"]
    return Child(cmd, logs, env=child_env(HSX_LEASE_SECONDS=lease))


def rendezvous(port: int, is_host: bool) -> list[str]:
    """Both nodes start at once and meet in the first round (one that came after its last call would join by
    torch's scale-up, which fails); which one hosts the store is said, not raced for on one machine. last_call and
    keep_alive shorter than torch's 30 s and 5 × 3 s: the launch re-formed after the lost node completes sooner."""
    return ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
            "hsx-elastic-test", "--max-restarts", "3", "--rdzv-conf",
            f"is_host={str(is_host).lower()},last_call_timeout=15,keep_alive_interval=2,keep_alive_max_attempt=3"]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_host(ref, out: Path, port: int, logs: Path, *launch: str, lease: str = LEASE) -> Child:
    """The node that hosts the store: started first, and given until its port listens."""
    host = agent(ref, out, port, logs, *launch, lease=lease)
    assert host.poll_until(lambda: listening(port), timeout=120, every=0.1), host.stderr
    return host


@pytest.mark.timeout(600)  # two model loads, a lease, a re-formed launch: ~2-3 min on a loaded 2-core box
def test_a_node_killed_mid_job_leaves_the_survivor_to_finish_alone(tmp_path, fault_reference):
    ref = fault_reference
    port = free_port()
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    host = agent(ref, dirs[0], port, tmp_path / "node0-log", *rendezvous(port, is_host=True))
    other = agent(ref, dirs[1], port, tmp_path / "node1-log", *rendezvous(port, is_host=False))
    try:
        # both at work: the other node has committed units (so its lost dir costs the survivor work)
        assert other.poll_until(lambda: committed_units(dirs[1]) >= 2, timeout=300, every=0.05), other.stderr
        assert committed_units(dirs[0]) < ref.units
        other.kill_tree(signal.SIGKILL)  # the node is gone: its agent, its workers, its disk
        other.wait(30)
        lost = units_of(dirs[1])
        shutil.rmtree(dirs[1])
        t0 = time.monotonic()
        rc = host.wait(timeout=240)
        took = time.monotonic() - t0
    finally:
        host.kill_tree(signal.SIGKILL)
        other.kill_tree(signal.SIGKILL)
    assert rc == 0, host.stderr[-3000:]
    print(f"the survivor ended {took:.0f} s after the kill")
    assert took < 200, took  # torch's exit barrier alone would wait 300 s for the lost agent
    assert "took back the units of 1 lost process" in host.stdout
    assert_equals_reference(dirs[0], ref, verify=False)
    assert lost and lost <= units_of(dirs[0])  # the lost node's units were redone here


@pytest.mark.timeout(600)
def test_a_node_joining_a_running_job_takes_units_and_the_merge_equals_one_process(tmp_path, fault_reference):
    ref = fault_reference
    port = free_port()
    dirs = [tmp_path / "node0", tmp_path / "joined"]
    host = start_host(ref, dirs[0], port, tmp_path / "node0-log", "--nnodes", "1", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hsx-elastic-test", lease="300")
    joined = None
    try:
        assert host.poll_until(lambda: committed_units(dirs[0]) >= 2, timeout=300, every=0.05), host.stderr
        # The running node is held still (within its lease) until the new one has written units: on this small job
        # it would otherwise finish before a new process has loaded its model.
        workers = descendants(host.proc.pid)
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        # the documented join: a launcher of its own (no scale-up of the running rendezvous), the same --elastic
        joined = agent(ref, dirs[1], port, tmp_path / "joined-log", "--standalone", lease="300")
        try:
            assert joined.poll_until(lambda: committed_units(dirs[1]) >= 2, timeout=240, every=0.05), joined.stderr
        finally:
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
        assert joined.wait(timeout=300) == 0, joined.stderr[-3000:]
        assert host.wait(timeout=120) == 0, host.stderr[-3000:]
    finally:
        host.kill_tree(signal.SIGKILL)
        if joined is not None:
            joined.kill_tree(signal.SIGKILL)
    shares = [units_of(d) for d in dirs]
    assert shares[0] and shares[1] and not shares[0] & shares[1], shares  # each unit written once, by one node
    assert len(shares[0] | shares[1]) == ref.units
    for d in dirs:
        assert_units_intact(d)
    rc, stdout, stderr = hsx_main(["merge", str(tmp_path / "merged"), *map(str, dirs)])
    assert rc == 0, stderr
    assert_equals_reference(tmp_path / "merged", ref, world_size=0, verify=False)


@pytest.mark.timeout(300)
def test_a_lost_claims_store_is_one_line_without_torchs_stack_dumps(tmp_path, fault_reference):
    """The store's client logs each failed socket call as a C++ warning with a 20-frame stack dump before raising it
    (a joining node that waited at its end when the host's agent ended printed two). hsx says what a lost store
    means in one line; torch's C++ warnings are off under --elastic, its errors and hsx's line kept."""
    import gc
    from datetime import timedelta

    import torch.distributed as dist

    from helpers import message_lines

    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    out = tmp_path / "out"
    child = Child([sys.executable, "-m", "hsx", *fault_reference.argv(out), "--elastic", f"127.0.0.1:{port}"],
                  tmp_path / "log", env=child_env(HSX_LEASE_SECONDS=LEASE))
    try:
        assert child.poll_until(lambda: host.check(["hsx/claims/job"]), timeout=240, every=0.01), child.stderr
        del host  # the agent hosting the store is gone
        gc.collect()
        rc = child.wait(timeout=120)
    finally:
        child.kill_tree(signal.SIGKILL)
    assert rc == 1, child.stderr[-3000:]
    assert "Exception raised from" not in child.stderr and "frame #" not in child.stderr, child.stderr[-3000:]
    errors = [line for line in message_lines(child.stderr) if line.startswith("hsx: error:")]
    assert len(errors) == 1 and "lost the claims store" in errors[0], child.stderr[-3000:]


@pytest.mark.timeout(600)
def test_a_rerun_into_an_emptied_dir_while_the_store_lives_redoes_the_job(tmp_path, fault_reference):
    """Rerunning an elastic job into new or emptied dirs while its claims store still lived exited 0 with "holds 0 of
    the job's N units (... the other nodes' dirs hold the rest)" though no dir held them: the ended run's `done`
    marks stood for units no dir held. A done mark counts only while a dir that holds the unit answers for it: the
    rerun redoes the job, equal to one process."""
    from datetime import timedelta

    import torch.distributed as dist

    ref = fault_reference
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "hsx", *ref.argv(out), "--elastic", f"127.0.0.1:{port}"]
    first = Child(argv, tmp_path / "first", env=child_env(HSX_LEASE_SECONDS=LEASE))
    assert first.wait(timeout=300) == 0, first.stderr[-3000:]
    assert_equals_reference(out, ref, verify=False)
    shutil.rmtree(out)  # emptied (or a new dir): no dir holds the job's units, the store still lives
    again = Child(argv, tmp_path / "again", env=child_env(HSX_LEASE_SECONDS=LEASE))
    assert again.wait(timeout=300) == 0, again.stderr[-3000:]
    assert "holds 0 of" not in again.stdout, again.stdout
    assert_equals_reference(out, ref, verify=False)
    assert store.check(["hsx/claims/job"])  # (the same store served both)
