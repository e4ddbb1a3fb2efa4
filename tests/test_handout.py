"""hsx.handout: the one place a process's units come from — its static share of the model copies, or claims
through the elastic store — and, however the job's loop ends, the claims go back to the pool."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import pytest

from hsx.buckets import Unit
from hsx.handout import assign_units, hand_out


@dataclass
class FakeProc:
    dp_rank: int = 0
    dp_size: int = 1
    claims_store: object = None


UNITS = [Unit(f"000-{i:05d}", 0, 512, i * 10, i * 10 + 10, 100 + 37 * (i % 5)) for i in range(9)]


def test_the_static_shares_of_the_model_copies_cover_the_pending_units_once():
    done = {"000-00002", "000-00007"}
    shares = []
    for rank in range(3):
        with hand_out(FakeProc(rank, 3), "job", UNITS, done, None, None, print) as mine:
            assert mine.claims is None and mine.feed is None and mine.planned == mine.units
            assert [u.name for u in mine.pending] == [u.name for u in UNITS if u.name not in done]
            assert mine.units == assign_units(mine.pending, rank, 3)
            shares.append([u.name for u in mine.units])
    every = [n for s in shares for n in s]
    assert sorted(every) == sorted(u.name for u in UNITS if u.name not in done)  # each pending unit, by one rank
    loads = [sum(u.tokens for u in UNITS if u.name in s) for s in shares]
    assert max(loads) - min(loads) <= max(u.tokens for u in UNITS)  # longest first: the ranks' tokens even out


def test_claimed_units_come_in_claim_order_and_go_back_to_the_pool_when_the_loop_fails():
    import torch.distributed as dist

    from helpers import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    said = []
    with pytest.raises(RuntimeError, match="the loop failed"):
        with hand_out(FakeProc(claims_store=store), "job", UNITS, {"000-00000"}, None, f"127.0.0.1:{port}",
                      said.append) as mine:
            assert mine.planned == mine.pending and len(mine.pending) == len(UNITS) - 1
            it = iter(mine.units)
            first = next(it)
            assert first.name in {u.name for u in mine.pending}
            assert next(mine.feed) is first  # the producer gets the units in the loop's order
            raise RuntimeError("the loop failed")
    owner = mine.claims.owner
    assert store.check([f"hsx/claims/job/fin/{owner}"])  # finished: this process answers for its dir
    assert store.get(f"hsx/claims/job/u/{first.name}") in (b"", b"free")  # its claim went back to the pool
    assert store.get("hsx/claims/job/u/000-00000").startswith(b"done:")  # the dir's own unit: done for the others
