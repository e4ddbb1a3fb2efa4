"""The claim protocol of `--elastic` (hsx.claims) over an in-process store: a unit is claimed by one process only,
a lost process's claims (and the units it committed, whose dir may be gone with it) return to the pool after its
lease, and a unit committed by a live or finished process is never claimed again."""

from __future__ import annotations

import threading
import time

import pytest

from hsx.claims import Claimed, Claims, parse_endpoint
from hsx.config import HsxError, UsageError

UNITS = {f"000-{i:05d}": 100 + i for i in range(12)}
LEASE = 0.6


def claims(store, **kw) -> Claims:
    kw.setdefault("lease", LEASE)
    return Claims(store, "job", UNITS, poll=0.02, **kw)


def store():
    import torch.distributed as dist

    return dist.HashStore()


def drain(c: Claims, block: bool = True) -> list[str]:
    got = []
    while (name := c.take(block=block)) is not None:
        got.append(name)
        c.committed(name)
    return got


def test_no_unit_is_claimed_twice_by_racing_processes():
    s = store()
    procs = [claims(s) for _ in range(4)]
    got: list[list[str]] = [[] for _ in procs]
    threads = [threading.Thread(target=lambda i=i: got[i].extend(drain(procs[i]))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    every = [n for g in got for n in g]
    assert sorted(every) == sorted(UNITS)  # each unit once, by one process
    for c in procs:
        c.finish()


def test_a_lost_process_claims_and_units_return_after_its_lease():
    s = store()
    a, b = claims(s), claims(s)
    a.take()  # held, not committed
    done = a.take()
    a.committed(done)
    a.stopping.set()  # its heartbeat stops, with no `finish`: killed
    a._thread.join()
    t0 = time.monotonic()
    taken = drain(b)
    assert time.monotonic() - t0 >= LEASE  # not before the lease ran out
    assert sorted(taken) == sorted(UNITS)  # its claim and the unit it committed (its dir may be gone) came back
    assert b.lost_owners == {a.owner}
    b.finish()


def test_a_unit_committed_by_a_live_or_finished_process_is_never_claimed_again():
    s = store()
    a = claims(s)
    first = a.take()
    a.committed(first)
    second = a.take()
    a.committed(second)
    b = claims(s)
    rest = drain(b, block=False)  # a is at work: b takes only what is free
    assert first not in rest and second not in rest
    assert sorted(rest + [first, second]) == sorted(UNITS)
    a._idle(True)  # a waits at its end: its units are final while its heartbeat moves
    assert b.take() is None and not b.lost_owners
    a.finish()  # finished while b ran: its dir keeps its units, for b
    time.sleep(2 * LEASE)
    assert b.take() is None and not b.lost_owners
    b.finish()


def test_a_done_mark_counts_only_while_a_dir_that_holds_the_unit_answers_for_it():
    """A rerun into new or emptied dirs while the job's store lives: the marks of processes that ended before it
    started answered for units no dir held any more, and the rerun exited 0 holding none of them. Such marks are
    redone, unless a live process's dir holds the units (it adopts them, within a lease of the others' start)."""
    s = store()
    old = [claims(s), claims(s)]
    firsts: list[list[str]] = [[], []]
    for k in range(len(UNITS)):  # the two share the job
        name = old[k % 2].take(block=False)
        old[k % 2].committed(name)
        firsts[k % 2].append(name)
    ends = [threading.Thread(target=c.take) for c in old]  # each at its end, waiting for the other's
    for t in ends:
        t.start()
    for t in ends:
        t.join(timeout=30)
    assert sorted(firsts[0] + firsts[1]) == sorted(UNITS) and firsts[1]
    for c in old:
        c.finish()  # the job ended; then its dirs were emptied (or new ones given)
    kept = claims(s)  # a rerun on a dir that still holds old[0]'s units, and one on an empty dir
    kept.adopt(firsts[0])
    kept._idle(True)  # (nothing else it would claim first: the rest is the other's to redo)
    empty = claims(s)
    redone = drain(empty)
    assert sorted(redone) == sorted(firsts[1])  # no live dir holds old[1]'s: redone; kept's answer for the rest
    assert not empty.lost_owners
    kept.finish()
    empty.finish()


def test_a_process_of_another_job_is_refused_while_that_job_runs_and_takes_over_an_ended_one():
    """A node joining with another plan (other --layers or --unit-tokens: another job) ran a whole job of its own
    beside the running one on the same store. It is refused while that job's heartbeats move; once they stop for a
    lease, the store serves the new job."""
    s = store()
    running = claims(s)
    with pytest.raises(HsxError, match="serves another job, still running"):
        Claims(s, "other-job", UNITS, lease=LEASE, poll=0.02)
    running.finish()
    time.sleep(LEASE / 2)
    other = Claims(s, "other-job", UNITS, lease=LEASE, poll=0.02)  # the first job ended: taken over
    assert sorted(drain(other)) == sorted(UNITS)
    other.finish()


def test_no_process_ends_while_another_at_work_may_yet_be_lost():
    s = store()
    a, b = claims(s), claims(s)
    done = a.take()
    a.committed(done)
    assert sorted(drain(b, block=False)) == sorted(set(UNITS) - {done})
    assert b.take(block=False) is None  # nothing free, and a (at work) may still be lost: b would wait
    a.stopping.set()  # a is killed after committing: its dir may be gone with it
    a._thread.join()
    assert b.take() == done and b.lost_owners == {a.owner}
    b.finish()


def test_a_finished_process_left_claims_return_at_once():
    s = store()
    a = claims(s)
    held = a.take()
    a.finish()  # stopped before writing it: its claim goes back
    b = claims(s)
    assert held in drain(b)
    assert not b.lost_owners
    b.finish()


def test_units_in_the_own_dir_are_not_claimed_and_are_done_for_others():
    s = store()
    a = claims(s)
    mine = sorted(UNITS)[:5]
    a.adopt(mine)
    got = drain(a)
    assert sorted(got) == sorted(UNITS)[5:]
    b = claims(s)
    assert b.take() is None  # a is alive and holds the rest committed
    a.finish()
    b.finish()


def test_processes_that_planned_other_units_are_refused():
    s = store()
    claims(s, plan="p1").finish()
    with pytest.raises(HsxError, match="planned other units"):
        claims(s, plan="p2")


def test_claimed_units_feed_the_producer_in_the_order_the_loop_takes_them():
    s = store()
    c = claims(s)
    units = {n: ("unit", n) for n in UNITS}
    claimed = Claimed(c, units)
    loop = list(claimed)
    fed = list(claimed.feed())
    assert loop == fed and sorted(u[1] for u in loop) == sorted(UNITS)
    c.finish()


def test_the_endpoint_is_host_and_port():
    assert parse_endpoint("10.0.0.1:29400") == ("10.0.0.1", 29400)
    assert parse_endpoint("[::1]:29400") == ("::1", 29400)
    for bad in ("10.0.0.1", ":29400", "host:0", "host:x"):
        with pytest.raises(UsageError):
            parse_endpoint(bad)


def test_an_endpoint_where_nothing_listens_is_one_error_at_once_not_minutes_of_retries():
    import socket

    from hsx.claims import connect

    with socket.socket() as s:  # a port bound but not listening: a connection to it is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(HsxError, match="connection refused.*no torchrun agent"):
            connect(f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 10  # (TCPStore alone retried a refused connection for ~150 s)


def test_a_lost_worker_whose_agent_restarted_it_is_no_lost_node():
    """A worker-only kill was reported as "lost the node(s) of agent ..." (and the launch asked to re-form) while
    that agent was alive and restarting its workers. A lost process's agent is a lost node only while no newer
    worker of that agent came to the store."""
    s = store()
    a = claims(s, launch=("run", "host-a-1"))
    b = claims(s, launch=("run", "host-b-2"))
    held = a.take()
    a.stopping.set()  # a's worker is killed
    a._thread.join()
    assert held in drain(b) and b.lost_owners == {a.owner}
    assert b.lost_agents() == ["host-a-1"]  # no sign of its agent: the node is lost
    again = claims(s, launch=("run", "host-a-1"))  # its agent restarted its workers
    assert b.lost_agents() == []
    again.finish()
    b.finish()


def test_an_elastic_launch_without_elastic_says_what_it_does_and_an_empty_address_is_refused(tmp_path):
    """`torchrun --nnodes 1:2 ... -m hsx extract` without --elastic split the units once, and a lost node left the
    others at their share, with no word that --elastic exists: such a launch says so in one line at its start. torchrun
    tells its workers nothing of --nnodes: the agent's command line (the worker's parent) is read. `--elastic ''` ran
    as a plain job: exit 2."""
    import subprocess
    import sys

    from helpers import assert_one_error_line, child_env, hsx_main

    code = "from hsx.run import elastic_note; print(elastic_note())"
    for nnodes, says in (("1:2", True), ("2", False), ("2:2", False)):
        # a parent whose command line holds the option, as torchrun's agent's does (`; true`: sh does not exec)
        done = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "{code}"; true', "torchrun", "--nnodes", nnodes],
                              capture_output=True, text=True, timeout=120,
                              env=child_env(TORCHELASTIC_RUN_ID="job-1"))
        assert done.returncode == 0, done.stderr
        line = done.stdout.strip()
        assert ("--elastic HOST:PORT" in line and f"--nnodes {nnodes}" in line) if says else line == "None", line
    from hsx.run import elastic_note

    assert elastic_note({"PET_NNODES": "1:4"}) is None  # not under torchrun
    assert "--nnodes 1:4" in elastic_note({"PET_NNODES": "1:4", "TORCHELASTIC_RUN_ID": "x"})
    rc, _, err = hsx_main(["extract", "--model", "m", "--dataset", "d", "--layers", "1", "--output-dir",
                           str(tmp_path / "o"), "--elastic", ""])
    assert_one_error_line(rc, err, "--elastic ''")
    assert rc == 2 and not (tmp_path / "o").exists()
