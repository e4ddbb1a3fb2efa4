"""Which of a job's units this process writes, in one place: its static share of the launch's model copies
(`assign_units`: every rank computes the same split), or the units it claims through a store as it goes
(`--elastic`: hsx.claims) — behind `hand_out`, the one function hsx.run's extract calls. Also what the ranks agree on
before any unit is handed out: the same plan (`plan_hash`) and the units done in any rank's dir
(`units_done_anywhere`)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hsx.errors import HsxError


def assign_units(units: list, rank: int, world_size: int) -> list:
    """This rank's share: longest-processing-time-first by tokens, so ranks finish together. Deterministic, so
    every rank computes the same split from the same manifest."""
    if world_size == 1:
        return list(units)
    load = [0] * world_size
    mine = []
    for u in sorted(units, key=lambda u: (-u.tokens, u.name)):
        r = min(range(world_size), key=lambda k: (load[k], k))
        load[r] += u.tokens
        if r == rank:
            mine.append(u)
    return sorted(mine, key=lambda u: u.name)


def plan_hash(units: list) -> str:
    """What every process must have planned alike: the units' names, rows and tokens."""
    import hashlib

    return hashlib.sha256(json.dumps([[u.name, u.start, u.stop, u.tokens] for u in units]).encode()).hexdigest()


def units_done_anywhere(proc, units: list, done_here: dict) -> set[str]:
    """The units committed in any rank's output dir (with one dir per node, a unit done on one node is done for
    the job), checking that every rank planned the same units. Also the barrier between reading the manifests
    and the first new commit."""
    plan = plan_hash(units)
    views = proc.all_gather([plan, sorted(done_here)])
    if any(p != views[0][0] for p, _ in views):
        raise HsxError("the ranks planned different units from the same job; their tokenizers or datasets "
                       "libraries differ: give every node the same environment")
    return {name for _, names in views for name in names}


@dataclass
class Handout:
    """This process's units, as the run loop and the engine take them."""
    pending: list  # the job's units no dir holds yet (every process's to share)
    units: Any  # what the run loop maps and commits, in order: a list, or hsx.claims.Claimed (claimed as it goes)
    planned: list  # what the engine plans batches over: the share, or every pending unit (any may be claimed here)
    feed: Any = None  # the units in the order the engine's producer runs them (Claimed.feed()); None: `units`
    claims: Any = None  # hsx.claims.Claims with --elastic

    def committed(self, name: str) -> None:
        """A unit's manifest line is on disk: the store says so to the other processes (--elastic)."""
        if self.claims is not None:
            self.claims.committed(name)

    def lost_agents(self) -> list[str]:
        """The torchrun agents whose processes this one found lost (their units taken over), after the job."""
        return self.claims.lost_agents() if self.claims is not None else []


def launch_agent() -> str:
    """The launcher agent this process runs under (its parent: torchrun's, accelerate's), as host-pid."""
    import socket

    return f"{socket.gethostname()[:40]}-{os.getppid()}"


@contextmanager
def hand_out(proc, fingerprint: str, units: list, done: set[str], stop, elastic: str | None,
             say) -> Iterator[Handout]:
    """This process's pending units (`units` less `done`): without a claims store, its model copy's share
    (`assign_units`; tensor-parallel ranks of one copy share units); with one (`proc.claims_store`, from
    --elastic HOST:PORT), claimed as the job goes. On the way out, however it is left, the claims go back to the
    pool (this dir keeps its units) and what the store showed is said."""
    pending = [u for u in units if u.name not in done]
    if proc.claims_store is None:
        mine = assign_units(pending, proc.dp_rank, proc.dp_size)
        yield Handout(pending, mine, mine)
        return
    from hsx.claims import Claimed, Claims, connect

    claims = Claims(proc.claims_store, fingerprint, {u.name: u.tokens for u in units}, plan=plan_hash(units),
                    connect_again=lambda: connect(elastic),
                    launch=(os.environ.get("TORCHELASTIC_RUN_ID", ""), launch_agent()))
    claims.adopt(sorted(done))
    claimed = Claimed(claims, {u.name: u for u in pending}, stop) if pending else None
    try:
        yield Handout(pending, claimed or [], pending, claimed.feed() if claimed else None, claims)
    finally:
        claims.finish()  # (any exit hsx reaches: this dir keeps its units; its claims go back to the pool)
        if claims.store_closed:
            say(f"hsx: the claims store at {elastic} closed while this process waited at its end (its node "
                "finished the job); this dir keeps its units")
        if claims.lost_owners:
            say(f"hsx: took back the units of {len(claims.lost_owners)} lost process(es) "
                f"({', '.join(sorted(claims.lost_owners)[:3])}): their heartbeats stopped for {claims.lease:g} s")
