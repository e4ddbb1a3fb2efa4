"""Train while extracting: a trainer reads an output dir's units as `hsx extract` commits them and releases them
once consumed, so the job needs disk for a window of units, not for the whole dataset.

- `follow(OUT, ...)`: a `torch.utils.data.IterableDataset` of the job's rows, unit by unit as they are committed
  (`hsx.load`'s dicts, or `hsx.torch_view`'s torch rows). It waits for new units (polling the manifests every
  `poll_seconds`), and ends when hsx.json says the job is complete and every unit of this consumer is consumed.
- It reads a source: a `LocalSource` (OUT on this machine) or, for `grpc://HOST:PORT`, an hsx.flight
  `FlightSource` (an `hsx serve OUT`, which reads OUT with a LocalSource): one reader, two ways to OUT.
- Its position (rows handed out, per unit) is `state_dict()` / `load_state_dict()` (torchdata's
  StatefulDataLoader convention) for the trainer's checkpoint, and `commit()` records it in OUT (a reader with
  `delete_consumed`; one without writes nothing there): one fsynced line per unit in
  `.hsx/consumed-<consumer>-<rank>.jsonl` (hsx.schema.ConsumedRecord), then deletes the units wholly consumed.
  `commit="unit"` does so for a unit once the training step over its last row has returned (`_batch_start`). A
  unit is deleted only after that line is on disk; the extractor counts a wholly consumed unit as done
  (hsx.sink.OutputDir.done_units, as a unit deleted after its Hub upload), so a resumed job never redoes it and
  hsx.json lists it.
- `ConsumerWindow` is `hsx extract --max-pending-gb N`: before each unit, the job waits while N GB of committed
  units are not consumed yet.

Exactly once: rows handed out after the last `commit()` are handed out again after a kill (the ledger is the
resume point), unless the trainer restores a `state_dict()` it saved with its own checkpoint. A trainer that
checkpoints saves `state_dict()` with its weights and calls `commit(that state)` once the checkpoint is durable:
then a kill on either side loses no row and repeats none (docs/follow.md).

One reader per process (DataLoader `num_workers=0`): the position a checkpoint saves must be the one that handed
the rows out. Several trainer ranks each read their share (unit i of the plan goes to rank i % world_size).
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from hsx.errors import HsxError

CONSUMER_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")
STATE_VERSION = 1
MAX_WORLD_SIZE = 1 << 20  # trainer ranks (a rank names a ledger file: 5 digits or more)
WAIT_HINT_SECONDS = 60.0  # waiting this long for a unit with uncommitted rows: say why the extractor may be waiting


# ---- the extractor's side: --max-pending-gb ---------------------------------------------------------------------

def pending_bytes(out, in_flight=()) -> int:
    """Bytes of units on disk that no trainer has consumed yet: committed units (a manifest line) not recorded as
    wholly consumed, units being written under .hsx/tmp/, and `in_flight` (this process's units submitted to its
    committer, between .hsx/tmp/ and their manifest line). Counted by name, once each.

    A file in data/ with no manifest line and not in flight is the leftover of a run killed between a unit's rename
    and its manifest line: no trainer can read it (hsx.follow reads committed units), the redo replaces it, and
    counting it would make the job wait for a consumer that never comes. The order (in_flight given before the
    listing, .hsx/tmp/, then the manifests) sees a unit moving along that path at least once."""
    sizes: dict[str, int] = {}

    def add(name: str, *paths: Path) -> None:
        for f in paths:
            try:
                sizes[name] = f.stat().st_size
                return
            except FileNotFoundError:  # moved on (renamed into data/), or consumed and deleted, since the listing
                pass

    for f in out.state.glob("tmp/*/train-*.arrow"):
        add(f.name, f)
    for unit in in_flight:
        name = f"train-{unit}.arrow"
        if name not in sizes:
            add(name, out.unit_tmp_path(unit), out.data / name)
    from hsx.ledgers import uploaded_matches

    consumed, held = out.consumed(), held_files(out)
    for rec in out.manifest_records().values() if out.state.is_dir() else ():
        name = rec["file"]
        if not uploaded_matches(consumed.get(name), rec) and name not in sizes and name not in held:
            add(name, out.data / name)
    return sum(sizes.values())


def held_files(out) -> set[str]:
    """The units trainers hold in training steps that have not returned, while they wait for a unit to complete
    a batch (`.hsx/holding-<consumer>-<rank>.json`, LocalSource.hold): the window does not wait for them, or a
    batch holding more than the window would wait for a unit the job waits to write."""
    from hsx.schema import RECORD_REST_BYTES
    from hsx.files import read_json

    names: set[str] = set()
    for f in out.state.glob("holding-*.json"):
        files = read_json(f, limit=RECORD_REST_BYTES).get("files") if f.is_file() else None
        if not (isinstance(files, list) and all(isinstance(n, str) for n in files)):
            raise HsxError(f"{f} is damaged (its `files` is not a list of names); remove it")
        names.update(files)
    return names


class ConsumerWindow:
    """`--max-pending-gb`: before each unit, `wait(stop)` returns once fewer than `max_pending_gb` GB of units are
    pending (`pending_bytes`), reading the ledgers every `poll_seconds`, or at once when `stop` (SIGINT/SIGTERM) is
    set. It says so the first time it waits, and again for a wait longer than `LONG_WAIT_SECONDS`. `out`: an
    hsx.sink.OutputDir."""

    LONG_WAIT_SECONDS = 60.0

    def __init__(self, out, max_pending_gb: float, log, poll_seconds: float = 0.2, in_flight=lambda: ()):
        """`in_flight()`: this process's units between .hsx/tmp/ and their manifest line (Committer.in_flight)."""
        self.out, self.max_pending_gb, self.log, self.poll_seconds = out, max_pending_gb, log, poll_seconds
        self.in_flight = in_flight
        self.said = False

    def wait(self, stop) -> None:
        from hsx.schema import human_bytes

        limit, since, long_said = self.max_pending_gb * 1e9, time.monotonic(), False
        while not stop.is_set():
            pending = pending_bytes(self.out, self.in_flight())
            if pending < limit:
                return
            waited = time.monotonic() - since
            if not self.said or (waited > self.LONG_WAIT_SECONDS and not long_said):
                self.log(f"hsx: waiting{f' for {waited:.0f} s' if self.said else ''}: {human_bytes(pending)} of "
                         f"committed units are not consumed yet (--max-pending-gb {self.max_pending_gb:g}); "
                         f"extraction continues as a trainer reading {self.out.root} with hsx.follow consumes them")
                long_said, self.said = self.said, True
            stop.event.wait(self.poll_seconds)


# ---- the trainer's side: hsx.follow ------------------------------------------------------------------------------

_FOLLOW_CLASS = None


def follow(output_dir: str | os.PathLike, consumer: str = "trainer", delete_consumed: bool = False,
           rows: str = "torch", layers: list[int] | None = None, dequantize: bool = True, commit: str = "unit",
           poll_seconds: float = 1.0, rank: int | None = None, world_size: int | None = None,
           timeout: float | None = None, batch_size: int | None = None, prefetch: int = 0,
           token: str | None = None):
    """The rows of the job writing `output_dir`, as its units are committed: a `torch.utils.data.IterableDataset`
    that waits for new units and ends when the job is complete and every unit of this consumer was handed out.

    - `output_dir`: a local output dir, or `grpc://HOST:PORT` of an `hsx serve OUT` (the same rows, position and
      ledgers, recorded by the server in OUT; `token`: its bearer token, else $HSX_SERVE_TOKEN).
    - `rows="torch"`: `hsx.torch_view`'s rows (torch tensors, views of the mapped unit; `layers`, `dequantize` as
      there); `rows="dict"`: `hsx.load(OUT)`'s rows (`datasets` dicts of Python values).
    - `consumer`: names the ledger (.hsx/consumed-<consumer>-<rank>.jsonl); a second trainer reading the same dir
      takes another name (and must not delete).
    - `commit="unit"`: the ledger records a unit once the training step over its last row has returned (the
      batch after it is being fetched; `batch_size`, `prefetch` below), then (`delete_consumed`) deletes it;
      rows not yet recorded at a kill are handed out again. `commit="manual"`: only `commit()` records, for a
      trainer that checkpoints `state_dict()` and calls `commit(state)` after each checkpoint (exactly once).
    - `batch_size`: rows per training step, for commit="unit" (default: the batch size of the DataLoader that asks
      for the rows, else 1: each row asked for is its own step). `prefetch`: batches a wrapper around the
      DataLoader fetches ahead of the training step (accelerate's prepared loaders fetch 1).
    - `delete_consumed=False`: nothing is written into OUT (a read-only output is readable); the position lives
      in `state_dict()` only.
    - `rank`, `world_size`: this trainer's share, unit i of the job's plan to rank i % world_size (default:
      torch.distributed's, else 0 of 1).
    - `timeout`: seconds without a new unit before giving up (HsxError); None waits as long as the job runs.

    Rows come in unit order among the units committed (not the output's global order across ranks)."""
    global _FOLLOW_CLASS
    if _FOLLOW_CLASS is None:
        _FOLLOW_CLASS = _make_class()
    if isinstance(output_dir, str) and output_dir.startswith("grpc"):
        from hsx.flight import FlightSource

        source = FlightSource(output_dir, token)
    else:
        if token is not None:
            raise ValueError("token= is for a grpc://HOST:PORT source (hsx serve), not a local dir")
        source = LocalSource(Path(output_dir), delete_consumed)
    return _FOLLOW_CLASS(source, consumer, delete_consumed, rows, layers, dequantize, commit, poll_seconds, rank,
                         world_size, timeout, batch_size, prefetch)


def _default_rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_consumer(consumer: str, rank, world_size) -> None:
    """ValueError unless `consumer` can name a ledger file and rank/world_size are integers with 0 <= rank <
    world_size (checked by the reader, and by `hsx serve` for what a client sends)."""
    if not isinstance(consumer, str) or not CONSUMER_NAME.fullmatch(consumer):
        raise ValueError(f"consumer {consumer!r}: letters, digits and _ only (it names a ledger file)")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (rank, world_size)):
        raise ValueError(f"rank {rank!r} and world_size {world_size!r}: integers (they name the ledger file and "
                         "split the units)")
    if not 0 <= rank < world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1} (world_size at most {MAX_WORLD_SIZE})")


def check_position(position: dict[str, int], records: dict[str, dict[str, Any]], where: str) -> None:
    """HsxError naming the first unit whose position is past its rows: a state of another job, or damaged. Units
    not committed yet are checked once they are (`Follow._unit_rows`)."""
    for unit, row in position.items():
        rec = records.get(unit)
        if rec is not None and row > rec["rows"]:
            raise HsxError(f"{where}: the position says {row} rows of unit {unit} were read, it holds "
                           f"{rec['rows']} (a state of another job, or damaged)")


class LocalSource:
    """An output dir on this machine's filesystem, as hsx.follow reads it (and `hsx serve` serves it): its plan,
    manifests, hsx.json, the consumers' ledgers, and the units. `write`: whether ledgers may be written and units
    deleted (delete_consumed); a reader that does not delete writes nothing into OUT."""

    def __init__(self, root: Path, write: bool):
        from hsx.sink import OutputDir

        if root.exists() and not root.is_dir():  # (a dir not there yet is waited for, as units are)
            raise HsxError(f"{root} is a file, not an hsx output dir")
        self.out, self.write = OutputDir(root), write
        if write:
            self.out.check_no_links()  # it deletes under data/
        self.where = str(root)
        self.sources: dict = {}  # hsx merge's dirs, each read once (OutputDir.unit_source)
        self.recorded: dict[str, dict[str, int]] = {}  # consumer -> unit -> row its ledger records (valid lines)
        self.swept: set[str] = set()  # consumers whose wholly consumed units were deleted once
        self.lock = threading.Lock()  # (hsx serve records for several clients at once)

    def summary(self):
        return self.out.read_summary()

    def records(self) -> dict[str, dict[str, Any]]:
        return self.out.manifest_records() if self.out.state.is_dir() else {}

    def complete(self) -> bool:
        info = self.out.read_info()
        return info is not None and info.complete

    def ledger(self, consumer: str) -> dict[str, dict[str, Any]]:
        """This consumer's ledger records (every rank's: a resume with another world size finds a unit in
        progress where its previous owner left it), the furthest of each unit."""
        from hsx.schema import ConsumedRecord
        from hsx.files import read_jsonl

        found: dict[str, dict[str, Any]] = {}
        for ledger in sorted(self.out.state.glob(f"consumed-{consumer}-*.jsonl")):
            last: dict[str, dict[str, Any]] = {}
            for rec in read_jsonl(ledger, ConsumedRecord):
                last[rec["unit"]] = rec
            for u, rec in last.items():
                if u not in found or rec["row"] > found[u]["row"]:
                    found[u] = rec
        return found

    def gone(self, rec: dict[str, Any]) -> bool:
        return not os.path.lexists(self.out.data / rec["file"])

    def readable(self, rec: dict[str, Any], consumer: str) -> bool:
        """Whether a committed unit can be read now: False for one a resume moved aside as damaged (it is redone,
        then read); HsxError for one missing or of another size."""
        f = self.out.data / rec["file"]
        if not f.exists() and (self.out.state / "damaged" / rec["file"]).exists():
            return False
        if not f.exists() or f.stat().st_size != rec["bytes"]:
            why = "missing" if not f.exists() else f"{f.stat().st_size} bytes, not {rec['bytes']}"
            raise HsxError(f"{f}: {why} though committed and not consumed by {consumer!r} (deleted by another "
                           "consumer or by --delete-after-upload?); its rows cannot be read")
        return True

    def open(self, rec: dict[str, Any]):
        """The unit's rows: a `datasets.Dataset` memory-mapping it (`table`'s checks)."""
        from datasets import Dataset

        return self._read(rec, lambda path: Dataset.from_file(str(path)), len)

    def table(self, rec: dict[str, Any]):
        """The unit's rows as the memory-mapped pyarrow Table of its file (what `hsx serve` sends), if it is the
        file its manifest line describes: a regular file opened through no link (or, in a dir `hsx merge` joined,
        the unit of a merged dir its link leads to: OutputDir.unit_source), of the recorded size and rows, and its
        name still leading to that file once mapped."""
        import pyarrow as pa

        return self._read(rec, lambda path: pa.ipc.open_stream(pa.memory_map(str(path))).read_all(),
                          lambda t: t.num_rows)

    def _read(self, rec: dict[str, Any], read, rows_of):
        from hsx.files import still_the_file
        from hsx.info import merged_from

        dirs: list[str] = []
        if (self.out.data / rec["file"]).is_symlink():  # (a regular file needs no merged dir: no hsx.json read)
            dirs = merged_from(self.out.read_info()) or [os.path.normpath(d) for d in self.out.merged_sources()
                                                          if os.path.isabs(d)]
        fingerprint = self._fingerprint() if dirs else None
        path = self.out.unit_source(rec["file"], dirs=dirs, fingerprint=fingerprint, sources=self.sources)
        fd = self.out.open_unit(path)
        try:
            size = os.fstat(fd).st_size
            if size != rec["bytes"]:
                raise HsxError(f"{path} holds {size:,} bytes, its manifest line says {rec['bytes']:,}")
            got = read(path)
            still_the_file(path, fd)
        finally:
            os.close(fd)
        if rows_of(got) != rec["rows"]:
            raise HsxError(f"{path} holds {rows_of(got)} rows, its manifest line says {rec['rows']}")
        return got

    def _fingerprint(self) -> str | None:
        from hsx.schema import JobRecord
        from hsx.files import read_json

        f = self.out.state / "job.json"
        return read_json(f, JobRecord).fingerprint if f.exists() else None

    def hold(self, consumer: str, rank: int, world_size: int, units: list[str]) -> None:
        """Say which units this reader holds in steps not yet returned while it waits for a unit (held_files)."""
        from hsx.files import atomic_write

        check_consumer(consumer, rank, world_size)
        records = self.records()
        if not (isinstance(units, list) and all(isinstance(u, str) and u in records for u in units)):
            raise HsxError("hold: units must be committed units of this output")
        if self.write:
            self.out.state.mkdir(parents=True, exist_ok=True)
            atomic_write(self.out.state / f"holding-{consumer}-{rank:05d}.json",
                         json.dumps({"files": sorted(records[u]["file"] for u in units)}) + "\n")

    def record(self, consumer: str, rank: int, world_size: int, rows: dict[str, int]) -> None:
        """Record that rows [0, ROW) of each UNIT of `rows` were consumed: one ledger line per unit (built from its
        manifest record), appended and fsynced, then the units wholly consumed deleted (a link `hsx merge` made:
        the link only). Refused whole (HsxError, nothing written) when a unit is not a committed unit of this
        output, a row is not in 0..its rows, or a row is not past what the consumer's ledger already records (a
        replayed or rewound position). Without `write` nothing is written."""
        from hsx.files import append_synced
        from hsx.ledgers import uploaded_matches

        check_consumer(consumer, rank, world_size)
        if not isinstance(rows, dict):
            raise HsxError("commit: rows must be an object of unit -> row")
        with self.lock:
            records = self.records()
            if self.recorded.get(consumer) is None:
                self.recorded[consumer] = {u: r["row"] for u, r in self.ledger(consumer).items()
                                           if u in records and r["rows"] == records[u]["rows"]
                                           and uploaded_matches(r, records[u])}
            recorded = self.recorded[consumer]
            lines = []
            for unit, row in sorted(rows.items()):
                rec = records.get(unit) if isinstance(unit, str) else None
                if rec is None:
                    raise HsxError(f"commit: {str(unit)[:80]!r} is not a committed unit of this output")
                if type(row) is not int or not 0 <= row <= rec["rows"]:
                    raise HsxError(f"commit: row {str(row)[:20]} of unit {unit} is not in 0..{rec['rows']}")
                if row <= recorded.get(unit, 0):
                    raise HsxError(f"commit: unit {unit} is recorded at row {recorded.get(unit, 0)} already; a "
                                   f"position is recorded only forward (row {row} replays or rewinds it)")
                lines.append({"unit": unit, "file": rec["file"], "bytes": rec["bytes"], "rows": rec["rows"],
                              "row": row, "crc32": rec.get("crc32")})
            if not self.write:
                return
            if lines:
                self.out.state.mkdir(parents=True, exist_ok=True)
                append_synced(self.out.state / f"consumed-{consumer}-{rank:05d}.jsonl",
                              "".join(json.dumps(r, sort_keys=True) + "\n" for r in lines))
                recorded.update({r["unit"]: r["row"] for r in lines})
            whole = [r["file"] for r in lines if r["row"] == r["rows"]]
            if consumer not in self.swept:  # also the units a kill left between their ledger line and delete
                self.swept.add(consumer)
                whole += [records[u]["file"] for u, row in recorded.items() if row == records[u]["rows"]]
            self.out.remove_data_files(whole, links=True)  # only after the ledger line is on disk


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


def _make_class():
    import torch.utils.data

    class Follow(torch.utils.data.IterableDataset):
        """hsx.follow's dataset (see `follow`)."""

        def __init__(self, source, consumer: str, delete_consumed: bool, rows: str, layers, dequantize: bool,
                     commit: str, poll_seconds: float, rank: int | None, world_size: int | None,
                     timeout: float | None, batch_size: int | None, prefetch: int):
            if rows not in ("torch", "dict"):
                raise ValueError(f"rows={rows!r}: 'torch' (hsx.torch_view's rows) or 'dict' (hsx.load's rows)")
            if layers is not None and rows != "torch":
                raise ValueError("layers= selects stored layers of torch rows: use rows='torch'")
            if commit not in ("unit", "manual"):
                raise ValueError(f"commit={commit!r}: 'unit' or 'manual'")
            if not poll_seconds > 0:
                raise ValueError("poll_seconds must be positive")
            if batch_size is not None and not (type(batch_size) is int and batch_size >= 1):
                raise ValueError(f"batch_size={batch_size!r}: a positive integer, or None (the DataLoader's)")
            if not (type(prefetch) is int and prefetch >= 0):
                raise ValueError(f"prefetch={prefetch!r}: a non-negative integer")
            if (rank is None) != (world_size is None):
                raise ValueError("give both rank and world_size, or neither")
            if rank is None:
                rank, world_size = _default_rank()
            check_consumer(consumer, rank, world_size)
            self.src = source
            self.consumer, self.delete_consumed, self.rows, self.layers = consumer, delete_consumed, rows, layers
            self.dequantize, self.commit_mode, self.poll_seconds = dequantize, commit, poll_seconds
            self.rank, self.world_size, self.timeout = rank, world_size, timeout
            self.batch_size, self.prefetch = batch_size, prefetch
            self.unchecked = self.src.ledger(consumer)  # ledger lines not yet checked against their manifest line
            self.position: dict[str, int] = {u: r["row"] for u, r in self.unchecked.items()}  # rows handed out
            self.committed: dict[str, int] = dict(self.position)  # what the ledger says
            self.records: dict[str, dict[str, Any]] = {}  # manifest records of the units seen
            self.iterating = False
            self._see(self.src.records())

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
                layout, table = self._layout(), ds.with_format("arrow")
                get = lambda i: layout.row(table[i])  # noqa: E731
            else:
                get = ds.__getitem__
            for i in range(self.position[unit], n):
                row = get(i)
                self.position[unit] = i + 1  # handed out: in the next state_dict()
                yield row

        def _layout(self):
            from hsx.load import _Layout, layer_positions

            s = self.src.summary()
            positions = None if self.layers is None else layer_positions(s.layers, list(self.layers),
                                                                        s.num_model_layers)
            return _Layout(hidden=s.hidden_size, num_layers=len(s.layers), dtype=s.storage_dtype,
                           positions=positions, dequantize=self.dequantize)

        def _mine(self) -> list[str] | None:
            summary = self.src.summary()
            if summary is None:
                return None  # not planned yet
            return [u for i, u in enumerate(summary.unit_names) if i % self.world_size == self.rank]

        def _see(self, records: dict[str, dict[str, Any]]) -> None:
            """Take these manifest records as the units' own. A ledger line of a unit with other bytes, rows or
            CRC-32 than its manifest line was about another file (a ledger another job left in the dir, a unit
            redone with other bytes, a forged line): its position is dropped, so that unit is read, and never
            deleted as consumed, on its word (hsx.sink.OutputDir.consumed counts it so for the extractor)."""
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

    return Follow
