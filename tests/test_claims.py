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
    a.finish()  # finished: its dir keeps its units
    time.sleep(2 * LEASE)
    c = claims(s)
    assert c.take() is None and not c.lost_owners
    b.finish()
    c.finish()


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
