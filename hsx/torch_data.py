"""The torch datasets hsx hands out: `Follow` (what `hsx.follow` returns) and `TorchStream` (what
`hsx.load.torch_stream` returns), `torch.utils.data.IterableDataset`s defined at module level so they pickle by name
(a DataLoader's spawn worker rebuilds one by importing this module).

This module imports torch: hsx.follow and hsx.load import it when they build one, so `import hsx` stays free of
torch. The arguments are checked by the functions that build them (`hsx.follow.follow`, `hsx.load.torch_stream`).
"""

from __future__ import annotations

import collections
import sys
import time
import warnings
from typing import Any

import torch.utils.data

from hsx.errors import HsxError

STATE_VERSION = 1
WAIT_HINT_SECONDS = 60.0  # waiting this long for a unit with uncommitted rows: say why the extractor may be waiting


class TorchStream(torch.utils.data.IterableDataset):
    """`hsx.load.torch_stream`'s dataset: the rows of `ds` (a streamed `datasets.IterableDataset` of an hsx output)
    decoded by `layout` (an hsx.load._Layout) into torch tensors."""

    def __init__(self, ds, layout):
        self.ds, self.layout = ds, layout

    def __iter__(self):
        for t in self.ds.with_format("arrow"):
            if not hasattr(t, "column_names"):
                raise TypeError("torch_stream needs an IterableDataset that yields Arrow rows")
            yield self.layout.row(t)


class Follow(torch.utils.data.IterableDataset):
    """`hsx.follow`'s dataset (see there): a reader of a job's units as they are committed, its position, and its
    ledger. It pickles with its position (its source too: a local one with a new lock, a grpc:// one connecting
    again), but reads only in the training process: a DataLoader worker's copy refuses to hand out rows."""

    def __init__(self, source, consumer: str, delete_consumed: bool, rows: str, layout, commit: str,
                 poll_seconds: float, rank: int, world_size: int, timeout: float | None, batch_size: int | None,
                 prefetch: int):
        """`source`: an hsx.follow.LocalSource or hsx.flight.FlightSource; `layout(summary)`: the hsx.load._Layout
        of torch rows (rows="torch"); the rest as `follow` takes and checks them."""
        self.src = source
        self.consumer, self.delete_consumed, self.rows, self.layout = consumer, delete_consumed, rows, layout
        self.commit_mode, self.poll_seconds = commit, poll_seconds
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.batch_size, self.prefetch = batch_size, prefetch
        self.unchecked = self.src.ledger(consumer)  # ledger lines not yet checked against their manifest line
        self.position: dict[str, int] = {u: r["row"] for u, r in self.unchecked.items()}  # rows handed out
        self.committed: dict[str, int] = dict(self.position)  # what the ledger says
        self.records: dict[str, dict[str, Any]] = {}  # manifest records of the units seen
        self.iterating = False
        self._see(self.src.records())

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "iterating": False}  # (a copy has no rows being handed out)

    # ---- position ----

    def state_dict(self) -> dict[str, Any]:
        """The rows handed out so far (per unit): save it with the trainer's checkpoint."""
        return {"version": STATE_VERSION, "consumer": self.consumer, "rank": self.rank,
                "world_size": self.world_size, "position": dict(self.position)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a checkpoint's `state_dict()`: its position, not the ledger's. Refused (HsxError) when
        the ledger says units this state has not finished were released and deleted since (an older
        checkpoint than the last commit), since those rows are gone, and when it says more rows of a unit
        were read than it holds."""
        if not (isinstance(state, dict) and state.get("version") == STATE_VERSION
                and isinstance(state.get("position"), dict)
                and all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in state["position"].items())):
            raise ValueError("not an hsx.follow state_dict()")
        if (state.get("rank"), state.get("world_size")) != (self.rank, self.world_size):
            raise HsxError(f"this state is rank {state.get('rank')} of {state.get('world_size')}, the reader "
                           f"rank {self.rank} of {self.world_size}: resume with the same ranks")
        if self.iterating:
            raise RuntimeError("load_state_dict before iterating, not during")
        position = dict(state["position"])
        self._see(self.src.records())
        check_position(position, self.records, self.src.where)
        gone = [u for u, row in self.committed.items() if position.get(u, 0) < row
                and (u not in self.records or self.src.gone(self.records[u]))]
        if gone:
            raise HsxError(f"{self.src.where}: this checkpoint is older than what consumer {self.consumer!r} "
                           f"committed and deleted ({len(gone)} unit(s), e.g. train-{gone[0]}.arrow): resume "
                           "from the checkpoint saved last")
        self.position = position
        # The state comes from a durable checkpoint: record it, so units it finished are released now (a kill
        # between the trainer's checkpoint and its commit() must not leave the extractor waiting for them).
        self.commit(state)

    def commit(self, state: dict[str, Any] | None = None) -> None:
        """Record the position (`state`, a `state_dict()` the trainer saved, or every row handed out) in the
        ledger, fsynced, then delete the units it says are wholly consumed (`delete_consumed`). Without
        `delete_consumed` nothing is written: the position is the trainer's `state_dict()`."""
        position = (state or self.state_dict())["position"]
        if any(u not in self.records for u in position):
            self._see(self.src.records())
        check_position(position, self.records, self.src.where)
        if not self.delete_consumed:
            return
        forward = {u: row for u, row in position.items() if u in self.records and row > self.committed.get(u, 0)}
        self.src.record(self.consumer, self.rank, self.world_size, forward)
        self.committed.update(forward)

    # ---- rows ----

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is not None:
            raise HsxError("hsx.follow reads in the training process: use DataLoader(num_workers=0) (the "
                           "position a checkpoint saves must be the one that handed the rows out)")
        self.iterating = True
        # commit="unit": units whose last row was handed out, by the count of rows handed out then; the counts
        # at the last batch starts; a unit is recorded once a batch start `prefetch` batches back is past it
        ends: collections.deque[tuple[int, str]] = collections.deque()
        starts: collections.deque[int] = collections.deque(maxlen=self.prefetch + 1)
        count, last, held = 0, [-1], None

        def asked() -> None:  # a row is asked for: record the units the training step is done with
            if last[0] == count:
                return  # (this request, seen already)
            last[0] = count
            start = _batch_start(sys._getframe(2)) if self.batch_size is None else count % self.batch_size == 0
            if start is None or start:
                starts.append(count)
            if len(starts) == starts.maxlen and ends and ends[0][0] <= starts[0]:
                done = {}
                while ends and ends[0][0] <= starts[0]:
                    unit = ends.popleft()[1]
                    done[unit] = self.records[unit]["rows"]
                self.commit({"position": done})

        try:
            waited_since, warned = time.monotonic(), False
            while True:
                if self.commit_mode == "unit":
                    asked()
                unit = self._next_unit()
                if unit is None:
                    if self._finished():
                        return
                    holding = sorted(u for u, row in self.position.items()
                                     if row > self.committed.get(u, 0) and u in self.records)
                    if holding != held and self.delete_consumed:
                        self.src.hold(self.consumer, self.rank, self.world_size, holding)
                        held = holding
                    if not warned and time.monotonic() - waited_since > WAIT_HINT_SECONDS and any(
                            self.committed.get(u, 0) < row for u, row in self.position.items()):
                        warnings.warn(f"hsx.follow: waiting for a new unit of {self.src.where} while rows "
                                      "handed out are not committed: an `hsx extract --max-pending-gb` job "
                                      "waits for commit() (checkpoint more often, or raise --max-pending-gb)",
                                      stacklevel=2)
                        warned = True
                    if self.timeout is not None and time.monotonic() - waited_since > self.timeout:
                        raise HsxError(f"{self.src.where}: no new unit for {self.timeout:g} s (is hsx extract "
                                       "running?)")
                    time.sleep(self.poll_seconds)
                    continue
                for row in self._unit_rows(unit):
                    count += 1
                    if self.position[unit["unit"]] == unit["rows"]:
                        ends.append((count, unit["unit"]))
                    yield row
                    if self.commit_mode == "unit":
                        asked()
                waited_since, warned = time.monotonic(), False
        finally:
            self.iterating = False

    def _unit_rows(self, rec: dict[str, Any]):
        unit, n = rec["unit"], rec["rows"]
        self.position.setdefault(unit, 0)
        check_position({unit: self.position[unit]}, {unit: rec}, self.src.where)
        if self.position[unit] >= n:
            return
        ds = self.src.open(rec)
        if self.rows == "torch":
            layout, table = self.layout(self.src.summary()), ds.with_format("arrow")
            get = lambda i: layout.row(table[i])  # noqa: E731
        else:
            get = ds.__getitem__
        for i in range(self.position[unit], n):
            row = get(i)
            self.position[unit] = i + 1  # handed out: in the next state_dict()
            yield row

    def _mine(self) -> list[str] | None:
        summary = self.src.summary()
        if summary is None:
            return None  # not planned yet
        return [u for i, u in enumerate(summary.unit_names) if i % self.world_size == self.rank]

    def _see(self, records: dict[str, dict[str, Any]]) -> None:
        """Take these manifest records as the units' own. A ledger line of a unit with other bytes, rows or
        CRC-32 than its manifest line was about another file (a ledger another job left in the dir, a unit
        redone with other bytes, a forged line): its position is dropped, so that unit is read, and never
        deleted as consumed, on its word (hsx.ledgers.consumed counts it so for the extractor)."""
        from hsx.ledgers import uploaded_matches

        self.records.update(records)
        for unit in [u for u in self.unchecked if u in records]:
            led, rec = self.unchecked.pop(unit), records[unit]
            if led["rows"] != rec["rows"] or not uploaded_matches(led, rec):
                self.position.pop(unit, None)
                self.committed.pop(unit, None)

    def _next_unit(self) -> dict[str, Any] | None:
        """The first of this consumer's committed units (in name order) not wholly handed out, or None."""
        mine = self._mine()
        if mine is None:
            return None
        records = self.src.records()
        for unit in sorted(set(mine) & set(records)):
            rec = records[unit]
            self._see({unit: rec})
            if self.position.get(unit, -1) >= rec["rows"]:
                continue
            if self.src.readable(rec, self.consumer):
                return rec
        return None

    def _finished(self) -> bool:
        """Whether the job is complete and every unit of this reader was handed out. A complete job whose
        plan (.hsx/summary.json) is not there, or has units without a manifest line, will never commit
        them (nothing runs): HsxError, rather than waiting for ever."""
        if not self.src.complete():
            return False
        records, mine = self.src.records(), self._mine()
        if mine is None:
            raise HsxError(f"{self.src.where}: a complete output without its job's plan (.hsx/summary.json: "
                           "copied or downloaded without .hsx/?): read it with hsx.load or hsx.torch_view")
        never = [u for u in mine if u not in records]
        if never:
            raise HsxError(f"{self.src.where}: hsx.json says the job is complete, but {len(never)} unit(s) of "
                           f"its plan have no manifest line (train-{never[0]}.arrow"
                           f"{', ...' if len(never) > 1 else ''}): run the job's `hsx extract` command again "
                           "to redo them")
        return all(self.position.get(u, -1) >= records[u]["rows"] for u in mine)


def check_position(position: dict[str, int], records: dict[str, dict[str, Any]], where: str) -> None:
    """HsxError naming the first unit whose position is past its rows: a state of another job, or damaged. Units
    not committed yet are checked once they are (`Follow._unit_rows`)."""
    for unit, row in position.items():
        rec = records.get(unit)
        if rec is not None and row > rec["rows"]:
            raise HsxError(f"{where}: the position says {row} rows of unit {unit} were read, it holds "
                           f"{rec['rows']} (a state of another job, or damaged)")


def _batch_start(frame) -> bool | None:
    """Whether the row asked for starts a batch, when a DataLoader asks (in the process that runs the training
    step: num_workers=0): its fetcher collects a batch's rows into `data` and hands the batch on once full, so a
    request with `data` empty means every row asked for before has been returned to the training step and the
    step over them has returned (the loop asked for the next batch). None when no DataLoader asks. A DataLoader
    whose fetcher reads otherwise (another torch) is an error: a guess could commit rows no step has seen."""
    from torch.utils.data._utils.fetch import _IterableDatasetFetcher

    fetch = _IterableDatasetFetcher.fetch.__code__
    if frame is not None and frame.f_code is fetch:
        if not getattr(frame.f_locals.get("self"), "auto_collation", False):  # (batch_size=None: a row is a step)
            return True
        data = frame.f_locals.get("data")
        if isinstance(data, list):
            return not data
    else:
        callers = [frame]
        while len(callers) < 4 and callers[-1] is not None:
            callers.append(callers[-1].f_back)
        if not any(c is not None and c.f_code.co_filename == fetch.co_filename for c in callers):
            return None
    raise HsxError("hsx.follow cannot tell where this torch's DataLoader starts a batch: pass "
                   "hsx.follow(..., batch_size=B) with the DataLoader's batch size")
