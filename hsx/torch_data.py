"""The torch datasets hsx hands out: `Follow` (what `hsx.follow` returns) and `TorchStream` (what
`hsx.load.torch_stream` returns), `torch.utils.data.IterableDataset`s defined at module level so they pickle by name
(a DataLoader's spawn worker rebuilds one by importing this module).

`Follow`'s position must be the one trained, not the one handed out, whatever wraps its DataLoader: a batch names
the position after its last row (`state_dict(batch)`, by the rows' sample_id), torchdata's StatefulDataLoader
snapshots `state_dict()` between batches, and the default commit reads from the call stack of each fetch where a
batch starts and how many batches the loaders above fetch ahead of the step (`batch_start`, `look_ahead`):
accelerate's prepared loaders and HF Trainer's accumulation window are known, a wrapper hsx cannot read is refused.

This module imports torch: hsx.follow and hsx.load import it when they build one, so `import hsx` stays free of
torch. The arguments are checked by the functions that build them (`hsx.follow.follow`, `hsx.load.torch_stream`).
"""

from __future__ import annotations

import collections
import inspect
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch.utils.data

from hsx.errors import HsxError

STATE_VERSION = 1
TRAIL_ROWS = 1 << 14  # rows handed out last whose sample_id a batch position can name (state_dict(batch))
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
                 prefetch: int | None):
        """`source`: an hsx.follow.Source (its LocalSource, or hsx.flight.FlightSource); `layout(summary)`: the
        hsx.load._Layout of torch rows (rows="torch"); the rest as `follow` takes and checks them."""
        self.src = source
        self.consumer, self.delete_consumed, self.rows, self.layout = consumer, delete_consumed, rows, layout
        self.commit_mode, self.poll_seconds = commit, poll_seconds
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.batch_size, self.prefetch = batch_size, prefetch
        self.unchecked = self.src.ledger(consumer)  # ledger lines not yet checked against their manifest line
        self.position: dict[str, int] = {u: r["row"] for u, r in self.unchecked.items()}  # rows handed out
        self.committed: dict[str, int] = dict(self.position)  # what the ledger says
        self.records: dict[str, dict[str, Any]] = {}  # manifest records of the units seen
        self.next_records: dict[str, dict[str, Any]] = {}  # the committed units as `_next_unit` last read them
        self.iterating = False
        self._new_trail()
        self._see(self.src.records())

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "iterating": False}  # (a copy has no rows being handed out)

    def _new_trail(self) -> None:
        """Forget which rows this reader handed out (a new iteration): a batch of an earlier one names no row."""
        # units opened in this iteration, in order: unit -> (first row, rows of this iteration handed out before)
        self.opened: dict[str, tuple[int, int]] = {}
        self.handed: dict[int, int] = {}  # sample_id -> its row's number in this iteration (the last TRAIL_ROWS)
        self.handed_order: collections.deque[int] = collections.deque()
        self.batch_starts: collections.deque[int] = collections.deque()  # rows handed out at the last batch starts
        self.fetched_ahead = 0  # batches the loaders fetch ahead of the step (read at the last batch start)
        self.stopped_early = False  # the iteration was closed before its rows ended (a loop that stopped)

    # ---- position ----

    def state_dict(self, batch=None) -> dict[str, Any]:
        """The position to save with the trainer's checkpoint. `batch`: a batch of this reader's rows (a dict with
        a `sample_id` column, as `hsx.collate` and `default_collate` build, or a list of rows): the position after
        its last row, i.e. what the steps up to this batch trained, whatever fetched batches ahead of the step
        (accelerate's prepared loaders do). Without `batch`: every row handed out so far, which is the position
        trained only where nothing fetches ahead (a plain DataLoader; torchdata's StatefulDataLoader calls this
        between its batches, and accelerate's `use_stateful_dataloader=True` snapshots it before its look-ahead);
        refused (HsxError) while a loader hsx sees fetching ahead holds rows no step has trained yet."""
        if batch is None:
            if self._holding_ahead() and not _called_by_a_stateful_loader(sys._getframe(1)):
                raise HsxError(f"hsx.follow: the loader fetches {self.fetched_ahead} batch(es) ahead of the training "
                               "step, so the rows handed out are not the rows trained: save "
                               "rows.state_dict(batch) of the batch just trained")
            position = dict(self.position)
        else:
            position = self._position_before(self._last_seq(batch) + 1)
        return {"version": STATE_VERSION, "consumer": self.consumer, "rank": self.rank,
                "world_size": self.world_size, "position": position}

    def _holding_ahead(self) -> bool:
        """Whether batches were fetched ahead of the step and perhaps never trained: while iterating, and after
        an iteration closed before its rows ended (the loop above stopped; not after the rows ended, when the
        loaders hand on every batch they fetched)."""
        return bool(self.fetched_ahead) and (self.iterating or self.stopped_early)

    def _last_seq(self, batch) -> int:
        """The number in this iteration of the last row of `batch` (its rows found by sample_id among the rows
        handed out last), once checked that its rows were handed out one after another."""
        ids = batch_sample_ids(batch)
        seqs = sorted(self.handed.get(i, -1) for i in ids)
        if not ids or seqs[0] < 0:
            raise HsxError(f"{self.src.where}: this batch holds rows this reader has not handed out in its current "
                           f"iteration (a batch of another reader or an earlier run, or older than its last "
                           f"{TRAIL_ROWS} rows): name the batch just trained")
        if seqs[-1] - seqs[0] + 1 != len(seqs):
            raise HsxError(f"{self.src.where}: this batch's rows were not handed out one after another (a shuffle "
                           "or a second reader between hsx.follow and the batch?): its position would count rows "
                           "no step has trained")
        return seqs[-1]

    def _position_before(self, n: int) -> dict[str, int]:
        """The position when this iteration had handed out `n` rows: units opened after that go back to where
        they were opened."""
        position = dict(self.position)
        for unit, (first, before) in self.opened.items():
            if before >= n:
                if first:
                    position[unit] = first
                else:
                    position.pop(unit, None)
            elif before + (position[unit] - first) > n:  # (the unit the n-th row is in)
                position[unit] = first + n - before
        return position

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a checkpoint's `state_dict()`: its position, not the ledger's. Refused (HsxError) when
        the ledger says units this state has not finished were released and deleted since (an older
        checkpoint than the last commit), since those rows are gone, and when it says more rows of a unit
        were read than it holds."""
        state = follow_state(state)
        position_of(state)
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
        self._new_trail()  # (a batch of before names no row of this position)
        # The state comes from a durable checkpoint: record it, so units it finished are released now (a kill
        # between the trainer's checkpoint and its commit() must not leave the extractor waiting for them).
        self.commit(state)

    def commit(self, state=None) -> None:
        """Record a position in the ledger, fsynced, then delete the units it says are wholly consumed
        (`delete_consumed`): `state`, a `state_dict()` the trainer saved (or the state_dict() of a StatefulDataLoader
        or accelerate-prepared loader over this reader, which holds it), or a batch (the position after its last
        row, `state_dict(batch)`), or, without one, every row handed out. Only forward: a position behind what the
        ledger records changes nothing. Without a state while a loader fetching ahead holds rows (a loop that
        stopped before the rows ended): the rows before the batches fetched ahead. Without `delete_consumed` nothing
        is written: the position is the trainer's `state_dict()`."""
        if state is None:  # (what hsx knows was trained, while a loader fetching ahead holds rows)
            ahead, starts = (self.fetched_ahead if self._holding_ahead() else 0), self.batch_starts
            position = dict(self.position) if not ahead else self._position_before(
                starts[-ahead] if len(starts) >= ahead else 0)
        elif is_state(state):
            position = position_of(follow_state(state))
        else:
            position = self._position_before(self._last_seq(state) + 1)
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
        self._new_trail()
        # commit="unit": units whose last row was handed out, by the count of rows handed out then; the counts at
        # the batch starts seen; a unit is recorded once a batch start `ahead` batches after its last row is seen
        # (`ahead`: the batches fetched ahead of the training step, read from the call stack at each batch start)
        ends: collections.deque[tuple[int, str]] = collections.deque()
        starts = self.batch_starts
        count, last, held = 0, [-1], None

        def asked() -> None:  # a row is asked for: record the units the training step is done with
            if last[0] == count:
                return  # (this request, seen already)
            last[0] = count
            # (commit="manual" too: a loader that skips batches or splits them between processes is refused)
            start, ahead = batch_start(sys._getframe(2), self.batch_size, count, self.prefetch, self.world_size,
                                       strict=self.commit_mode == "unit")
            if not start:
                return
            self.fetched_ahead = ahead
            starts.append(count)
            while len(starts) > ahead + 1:
                starts.popleft()
            if self.commit_mode == "unit" and len(starts) == ahead + 1 and ends and ends[0][0] <= starts[0]:
                done = {}
                while ends and ends[0][0] <= starts[0]:
                    unit = ends.popleft()[1]
                    done[unit] = self.records[unit]["rows"]
                self.commit({"version": STATE_VERSION, "position": done})

        try:
            waited_since, warned = time.monotonic(), False
            while True:
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
                for row in self._unit_rows(unit, count):
                    count += 1
                    if self.position[unit["unit"]] == unit["rows"]:
                        ends.append((count, unit["unit"]))
                    yield row
                    asked()
                waited_since, warned = time.monotonic(), False
        except GeneratorExit:  # (closed before the rows ended: the loop above stopped)
            self.stopped_early = True
            raise
        finally:
            self.iterating = False

    def _unit_rows(self, rec: dict[str, Any], seq: int):
        """The rows of a unit from the position on; `seq`: rows this iteration handed out before it (the trail
        `state_dict(batch)` reads)."""
        unit, n = rec["unit"], rec["rows"]
        self.position.setdefault(unit, 0)
        check_position({unit: self.position[unit]}, {unit: rec}, self.src.where)
        if self.position[unit] >= n:
            return
        ds = self.src.open(rec)
        self.src.open_ahead(self._unread(unit))  # (over the network: the next units come while these rows go)
        if self.rows == "torch":
            layout, table = self.layout(self.src.summary()), ds.with_format("arrow")
            get = lambda i: layout.row(table[i])  # noqa: E731
        else:
            get = ds.__getitem__
        self.opened[unit] = (self.position[unit], seq)
        for i in range(self.position[unit], n):
            row = get(i)
            sample_id = int(row["sample_id"])
            self.handed[sample_id] = seq
            self.handed_order.append(sample_id)
            if len(self.handed_order) > TRAIL_ROWS:
                old = self.handed_order.popleft()
                if self.handed.get(old, seq) < seq - TRAIL_ROWS:
                    del self.handed[old]
            seq += 1
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

    def _unread(self, current: str) -> list[dict[str, Any]]:
        """This consumer's committed units other than `current` not wholly handed out, in the order `_next_unit`
        takes them, as it last read the records (nothing read again; a unit committed later may come before them)."""
        mine, records = self._mine() or [], self.next_records
        return [records[u] for u in sorted(set(mine) & set(records))
                if u != current and self.position.get(u, -1) < records[u]["rows"]]

    def _next_unit(self) -> dict[str, Any] | None:
        """The first of this consumer's committed units (in name order) not wholly handed out, or None."""
        mine = self._mine()
        if mine is None:
            return None
        records = self.next_records = self.src.records()
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


def _called_by_a_stateful_loader(frame) -> bool:
    """Whether torchdata's StatefulDataLoader asks for the state (its snapshot between batches, which accelerate
    takes before its look-ahead fetch), rather than the trainer."""
    return frame.f_globals.get("__name__", "").startswith("torchdata.")


def is_state(x) -> bool:
    """Whether `x` is a position to commit (a `state_dict()`, or a loader's state_dict() holding one), not a batch."""
    return isinstance(x, dict) and ("position" in x or "dataset_state" in x)


def position_of(state) -> dict[str, int]:
    """The position of an hsx.follow `state_dict()`: ValueError for anything else."""
    if not (isinstance(state, dict) and state.get("version") == STATE_VERSION
            and isinstance(state.get("position"), dict)
            and all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in state["position"].items())):
        raise ValueError("not an hsx.follow state_dict()")
    return state["position"]


def follow_state(state):
    """The hsx.follow state in `state`: itself, or the dataset state of a torchdata StatefulDataLoader's (or an
    accelerate-prepared stateful loader's) state_dict(), which is this reader's state_dict() at the batch it
    yielded last."""
    if isinstance(state, dict) and "dataset_state" in state and "position" not in state:
        return state["dataset_state"]
    return state


def batch_sample_ids(batch) -> list[int]:
    """The sample ids of a batch: its `sample_id` column (a tensor or a list), or each row's (a list of rows)."""
    if isinstance(batch, Mapping) and "sample_id" in batch:
        ids = batch["sample_id"]
        ids = ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else list(ids)
    elif isinstance(batch, (list, tuple)) and all(isinstance(r, Mapping) and "sample_id" in r for r in batch):
        ids = [r["sample_id"] for r in batch]
    else:
        raise ValueError("not a batch of hsx.follow rows: a dict with a sample_id column (hsx.collate and "
                         "default_collate keep it) or a list of rows")
    return [int(i) for i in ids]


def batch_start(frame, batch_size: int | None, count: int, prefetch: int | None, world_size: int,
                strict: bool = True) -> tuple[bool, int]:
    """(whether the row asked for starts a training step's batch, how many batches are fetched ahead of the step
    being trained), read from `frame`, the frame asking hsx.follow for a row.

    A DataLoader asks from its fetcher (in the process that runs the training step: num_workers=0): the fetcher
    collects a batch's rows into `data` and hands the batch on once full, so a request with `data` empty means
    every row asked for before has been returned from the DataLoader (its batches win over `batch_size`). Who
    asks the DataLoader for batches says how many it fetches ahead of the step (`look_ahead`). Without a
    DataLoader: every `batch_size` rows (else every row) is a step, `prefetch` fetched ahead. A DataLoader whose
    fetcher reads otherwise (another torch) is an error unless `batch_size` is given: a guess could commit rows no
    step has seen. `strict=False` (commit="manual", whose positions name batches): only what loses rows whatever
    is committed is refused (skipped batches, batches split between processes), not a look-ahead hsx cannot see."""
    from torch.utils.data._utils.fetch import _IterableDatasetFetcher

    fetch = _IterableDatasetFetcher.fetch.__code__
    if frame is not None and frame.f_code is fetch:
        if not getattr(frame.f_locals.get("self"), "auto_collation", False):  # (batch_size=None: a row is a step)
            start = True
        else:
            data = frame.f_locals.get("data")
            if not isinstance(data, list):
                if not strict:
                    return False, 0
                raise HsxError("hsx.follow cannot tell where this torch's DataLoader starts a batch: pass "
                               "hsx.follow(..., batch_size=B) with the DataLoader's batch size")
            start = not data
        return start, (look_ahead(frame.f_back, prefetch if strict else 0, world_size) if start else 0)
    _refuse_a_dataset_wrapper(frame)
    callers = [frame]
    while len(callers) < 4 and callers[-1] is not None:
        callers.append(callers[-1].f_back)
    if strict and batch_size is None and any(c is not None and c.f_code.co_filename == fetch.co_filename
                                             for c in callers):
        raise HsxError("hsx.follow cannot tell where this torch's DataLoader starts a batch: pass "
                       "hsx.follow(..., batch_size=B) with the DataLoader's batch size")
    if batch_size is not None:
        return count % batch_size == 0, prefetch or 0
    if strict and prefetch is None:
        _rows_are_steps(frame)
    return True, prefetch or 0


def _rows_are_steps(frame) -> None:
    """Without a DataLoader, each row asked for is taken for a training step of its own: true of a loop
    (`for row in rows`, through a generator expression or tqdm), not of a generator or iterator that collects rows
    into batches of its own: HsxError for those."""
    asker = _asker(frame)
    while asker is not None and asker.f_code.co_name == "<genexpr>":
        asker = _asker(asker.f_back)
    if asker is None or _plain(asker):
        return
    name = getattr(asker.f_code, "co_qualname", asker.f_code.co_name)
    raise HsxError(f"hsx.follow is read by {name} ({asker.f_globals.get('__name__', '?')}), not by a DataLoader: "
                   "hsx cannot tell which rows make a training step. Pass hsx.follow(..., batch_size=B) with the "
                   "rows of a step (and prefetch=N if it collects steps ahead of training them), or "
                   "commit='manual'")


def _plain(frame) -> bool:
    """Whether `frame` is a plain function of the trainer's own code (not a generator or iterator, not a
    library's): its loop trains each item it asks for before asking for the next."""
    code = frame.f_code
    package = frame.f_globals.get("__name__", "").partition(".")[0]
    return not (code.co_flags & (inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR)
                or code.co_name in ("__next__", "__iter__") or package in LOADER_PACKAGES)


def _refuse_a_dataset_wrapper(frame) -> None:
    """accelerate wraps an IterableDataset in IterableDatasetShard when several processes each read
    (dispatch_batches=False): each process would keep 1 of every N batches of what its own reader hands out."""
    shard = _accelerate("IterableDatasetShard")
    if shard is not None and frame is not None and frame.f_code is shard.__iter__.__code__:
        raise HsxError("hsx.follow under accelerate's IterableDatasetShard (several processes with "
                       "dispatch_batches=False): each process would drop the batches of the others from its own "
                       "share; use accelerate's default dispatch_batches=True with hsx.follow(..., rank=0, "
                       "world_size=1), or give each process a DataLoader that accelerate does not prepare")


def _accelerate(name: str):
    """accelerate.data_loader's `name`, if accelerate is imported (a loader it prepared can only exist then)."""
    module = sys.modules.get("accelerate.data_loader")
    return getattr(module, name, None)


def _loader_internal(frame) -> bool:
    """Whether `frame` runs inside a DataLoader's iterator (torch's or torchdata's) or tqdm (which yields what it
    is given, one at a time): frames between a fetch and whoever asks the loader for a batch."""
    name = frame.f_globals.get("__name__", "")
    return name in ("torch.utils.data.dataloader", "torchdata.stateful_dataloader.stateful_dataloader") or \
        name == "tqdm" or name.startswith("tqdm.")


def _asker(frame):
    while frame is not None and _loader_internal(frame):
        frame = frame.f_back
    return frame


# Packages whose code drives a training loop or wraps loaders: a frame of theirs asking for batches that hsx does
# not know is a wrapper whose look-ahead hsx cannot see (user code asking is the training loop itself).
LOADER_PACKAGES = ("accelerate", "transformers", "torch", "torchdata", "lightning", "pytorch_lightning",
                   "lightning_fabric", "deepspeed", "trl")


def look_ahead(frame, prefetch: int | None, world_size: int) -> int:
    """Batches a DataLoader has handed out beyond the one whose training step is running, when its fetch starts,
    from who asks it for batches (`frame`: the caller of the fetch):

    - the training loop itself (user code): 0;
    - accelerate's DataLoaderShard / DataLoaderDispatcher (Accelerator.prepare): 1 (they fetch one batch ahead to
      see the last one); a Dispatcher of N processes reads N batches per step on process 0 (then hsx.follow must
      read every rank's units there: rank=0, world_size=1); plus what their own asker fetches ahead;
    - transformers' Trainer (get_batch_samples): gradient_accumulation_steps - 1 more (it fetches the
      accumulation window before training its first batch);
    - anything else that iterates batches (a generator or __next__ of another package, or of the trainer's; any
      loop on a thread other than the main one, as a background prefetcher runs): `prefetch`, which the user gave
      for it; refused when not given: a guess could commit untrained rows.

    A loader that skips batches it fetched (accelerate's skip_first_batches, HF Trainer's resume) is refused: the
    rows skipped were never trained, and hsx.follow resumes from its own position."""
    total = _ahead(_asker(frame), prefetch, world_size)
    if threading.current_thread() is not threading.main_thread():
        total = max(total, _unknown(None, prefetch))
    return max(total, prefetch or 0)


def _ahead(frame, prefetch: int | None, world_size: int) -> int:
    if frame is None:
        return 0
    code = frame.f_code
    shard, dispatcher, skip = (_accelerate(n) for n in ("DataLoaderShard", "DataLoaderDispatcher", "SkipDataLoader"))
    if code.co_name == "<genexpr>":  # (yields each batch as it gets it: its asker decides)
        return _ahead(_asker(frame.f_back), prefetch, world_size)
    if shard is not None and code in (shard.__iter__.__code__, getattr(skip, "__iter__", shard.__iter__).__code__):
        _no_skipping(frame)
        return (1 if code is shard.__iter__.__code__ else 0) + _ahead(_asker(frame.f_back), prefetch, world_size)
    if dispatcher is not None and code is dispatcher._fetch_batches.__code__:
        outer = frame.f_back
        if outer is None or outer.f_code is not dispatcher.__iter__.__code__:
            return _unknown(frame, prefetch)
        _no_skipping(outer)
        processes = frame.f_locals["self"].state.num_processes
        if processes > 1 and world_size > 1:
            raise HsxError(f"hsx.follow under accelerate's DataLoaderDispatcher with {processes} processes: it reads "
                           f"on process 0 only and sends each process its slice, so reading rank 0's share of "
                           f"{world_size} there would leave the others unread: pass hsx.follow(..., rank=0, "
                           "world_size=1), or give each process a DataLoader over its own share that accelerate "
                           "does not prepare")
        return processes * (1 + _ahead(_asker(outer.f_back), prefetch, world_size)) + processes - 1
    trainer = sys.modules.get("transformers.trainer")
    if trainer is not None and code.co_name == "get_batch_samples" and isinstance(frame.f_locals.get("self"),
                                                                                  trainer.Trainer):
        return max(0, frame.f_locals["self"].args.gradient_accumulation_steps - 1)  # (a subclass's too)
    return 0 if _plain(frame) else _unknown(frame, prefetch)


def _unknown(frame, prefetch: int | None) -> int:
    """`prefetch` for a wrapper hsx cannot read (`frame` asks for batches; None: a thread other than the main
    one), else HsxError."""
    if prefetch is not None:
        return prefetch
    if frame is None:
        where = f"the loop on thread {threading.current_thread().name!r} (a background prefetcher?)"
    else:
        name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)  # (Python 3.10: co_name)
        where = f"{name} ({frame.f_globals.get('__name__', '?')})"
    raise HsxError(f"hsx.follow cannot tell how many batches {where} fetches ahead of the training step, so "
                   "commit='unit' cannot tell which rows were trained: pass hsx.follow(..., prefetch=N) with that "
                   "count (0 if it fetches none), or commit='manual' with rows.commit(batch) after each step")


def _no_skipping(frame) -> None:
    loader = frame.f_locals.get("self")
    if getattr(loader, "skip_batches", 0):
        raise HsxError(f"this accelerate loader skips its first {loader.skip_batches} batches (skip_first_batches; "
                       "HF Trainer's resume from a checkpoint does so): their rows would be handed out and never "
                       "trained. hsx.follow resumes from its own position: pass TrainingArguments("
                       "ignore_data_skip=True), or do not skip")
