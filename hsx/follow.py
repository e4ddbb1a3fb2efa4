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
  `commit="unit"` does so for a unit once the training step over its last row has returned
  (hsx.torch_data.batch_start: where batches start, and how many the loaders fetch ahead of the step). A unit is
  deleted only after that line is on disk; the extractor counts a wholly consumed unit as done
  (hsx.ledgers.done_units, as a unit deleted after its Hub upload), so a resumed job never redoes it and hsx.json
  lists it.
- `ConsumerWindow` is `hsx extract --max-pending-gb N`: before each unit, the job waits while N GB of committed
  units are not consumed yet.

Exactly once: rows handed out after the last `commit()` are handed out again after a kill (the ledger is the
resume point), unless the trainer restores a position it saved with its own checkpoint. A trainer that
checkpoints saves the position it trained (`state_dict(batch)` of the batch trained last, or a StatefulDataLoader's
`state_dict()`) with its weights and calls `commit(that state)` once the checkpoint is durable: then a kill on either
side loses no row and repeats none (docs/follow.md).

One reader per process (DataLoader `num_workers=0`): the position a checkpoint saves must be the one that handed
the rows out (the reader, hsx.torch_data.Follow, pickles, but a worker's copy refuses to read). Several trainer ranks each read their share (unit i of the plan goes to rank i % world_size).
"""

from __future__ import annotations

import functools
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from hsx import ledgers
from hsx.errors import HsxError
from hsx.info import read_info, read_summary

CONSUMER_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")
MAX_WORLD_SIZE = 1 << 20  # trainer ranks (a rank names a ledger file: 5 digits or more)


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
    consumed, held = ledgers.consumed(out.state), ledgers.held_files(out.state)
    for rec in ledgers.manifest_records(out.state).values() if out.state.is_dir() else ():
        name = rec["file"]
        if not ledgers.uploaded_matches(consumed.get(name), rec) and name not in sizes and name not in held:
            add(name, out.data / name)
    return sum(sizes.values())


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

def follow(output_dir: str | os.PathLike, consumer: str = "trainer", delete_consumed: bool = False,
           rows: str = "torch", layers: list[int] | None = None, dequantize: bool = True, commit: str = "unit",
           poll_seconds: float = 1.0, rank: int | None = None, world_size: int | None = None,
           timeout: float | None = None, batch_size: int | None = None, prefetch: int | None = None,
           token: str | None = None):
    """The rows of the job writing `output_dir`, as its units are committed: a `torch.utils.data.IterableDataset`
    that waits for new units and ends when the job is complete and every unit of this consumer was handed out.

    - `output_dir`: a local output dir, or `grpc://HOST:PORT` of an `hsx serve OUT` (the same rows, position and
      ledgers, recorded by the server in OUT; `token`: its bearer token, else $HSX_SERVE_TOKEN).
    - `rows="torch"`: `hsx.torch_view`'s rows (torch tensors, views of the mapped unit; `layers`, `dequantize` as
      there); `rows="dict"`: `hsx.load(OUT)`'s rows (`datasets` dicts of Python values).
    - `consumer`: names the ledger (.hsx/consumed-<consumer>-<rank>.jsonl); a second trainer reading the same dir
      takes another name (and must not delete).
    - `commit="unit"`: the ledger records a unit once the training step over its last row has returned (a batch
      is fetched that many batches after it as the loaders that fetch ahead of the step take: accelerate's
      prepared loaders, HF Trainer's accumulation window, read from the call stack; `batch_size`, `prefetch`
      below), then (`delete_consumed`) deletes it; rows not yet recorded at a kill are handed out again.
      `commit="manual"`: only `commit()` records, for a trainer that checkpoints the position it trained
      (`state_dict(batch)`, or a StatefulDataLoader's state_dict()) and commits it after each checkpoint
      (exactly once).
    - `batch_size`: rows per training step for commit="unit" when no DataLoader asks for the rows (a DataLoader's
      own batches win); default 1: each row asked for is its own step (a generator batching the rows is refused
      without it). `prefetch`: batches a wrapper hsx does not
      know fetches ahead of the training step (hsx refuses such a wrapper without it; accelerate's and HF
      Trainer's are read from the call stack, and a larger `prefetch` only delays commits).
    - `delete_consumed=False`: nothing is written into OUT (a read-only output is readable); the position lives
      in `state_dict()` only.
    - `rank`, `world_size`: this trainer's share, unit i of the job's plan to rank i % world_size (default:
      torch.distributed's, else 0 of 1).
    - `timeout`: seconds without a new unit before giving up (HsxError); None waits as long as the job runs.

    Rows come in unit order among the units committed (not the output's global order across ranks)."""
    from hsx.torch_data import Follow

    if isinstance(output_dir, str) and output_dir.startswith("grpc"):
        from hsx.flight import FlightSource

        source = FlightSource(output_dir, token)
    else:
        if token is not None:
            raise ValueError("token= is for a grpc://HOST:PORT source (hsx serve), not a local dir")
        source = LocalSource(Path(output_dir), delete_consumed)
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
    if prefetch is not None and not (type(prefetch) is int and prefetch >= 0):
        raise ValueError(f"prefetch={prefetch!r}: a non-negative integer, or None (read from the loaders)")
    if (rank is None) != (world_size is None):
        raise ValueError("give both rank and world_size, or neither")
    if rank is None:
        rank, world_size = _default_rank()
    check_consumer(consumer, rank, world_size)
    layout = functools.partial(unit_layout, layers=layers, dequantize=dequantize) if rows == "torch" else None
    return Follow(source, consumer, delete_consumed, rows, layout, commit, poll_seconds, rank, world_size, timeout,
                  batch_size, prefetch)


def unit_layout(summary, layers: list[int] | None, dequantize: bool):
    """How torch rows of a job's units are decoded (hsx.load._Layout), from its plan (`summary`)."""
    from hsx.load import _Layout, layer_positions

    positions = None if layers is None else layer_positions(summary.layers, list(layers), summary.num_model_layers)
    return _Layout(hidden=summary.hidden_size, num_layers=len(summary.layers), dtype=summary.storage_dtype,
                   positions=positions, dequantize=dequantize)


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

    def __getstate__(self) -> dict[str, Any]:  # (a pickled hsx.follow, for a spawn DataLoader worker: a new lock)
        return {k: v for k, v in self.__dict__.items() if k != "lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = threading.Lock()

    def summary(self):
        return read_summary(self.out.state)

    def records(self) -> dict[str, dict[str, Any]]:
        return ledgers.manifest_records(self.out.state) if self.out.state.is_dir() else {}

    def complete(self) -> bool:
        info = read_info(self.out.root)
        return info is not None and info.complete

    def ledger(self, consumer: str) -> dict[str, dict[str, Any]]:
        """This consumer's ledger records, the furthest of each unit (hsx.ledgers.consumer_positions)."""
        return ledgers.consumer_positions(self.out.state, consumer)

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
            dirs = merged_from(read_info(self.out.root)) or [os.path.normpath(d)
                                                             for d in ledgers.merged_sources(self.out.state)
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
        """Say which units this reader holds in steps not yet returned while it waits for a unit
        (hsx.ledgers.held_files)."""
        check_consumer(consumer, rank, world_size)
        records = self.records()
        if not (isinstance(units, list) and all(isinstance(u, str) and u in records for u in units)):
            raise HsxError("hold: units must be committed units of this output")
        if self.write:
            ledgers.write_holding(self.out.state, consumer, rank, [records[u]["file"] for u in units])

    def record(self, consumer: str, rank: int, world_size: int, rows: dict[str, int]) -> None:
        """Record that rows [0, ROW) of each UNIT of `rows` were consumed: one ledger line per unit (built from its
        manifest record), appended and fsynced, then the units wholly consumed deleted (a link `hsx merge` made:
        the link only). Refused whole (HsxError, nothing written) when a unit is not a committed unit of this
        output, a row is not in 0..its rows, or a row is not past what the consumer's ledger already records (a
        replayed or rewound position). Without `write` nothing is written."""
        check_consumer(consumer, rank, world_size)
        if not isinstance(rows, dict):
            raise HsxError("commit: rows must be an object of unit -> row")
        with self.lock:
            records = self.records()
            if self.recorded.get(consumer) is None:
                self.recorded[consumer] = {u: r["row"] for u, r in self.ledger(consumer).items()
                                           if u in records and r["rows"] == records[u]["rows"]
                                           and ledgers.uploaded_matches(r, records[u])}
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
                ledgers.record_consumed(self.out.state, consumer, rank, lines)
                recorded.update({r["unit"]: r["row"] for r in lines})
            whole = [r["file"] for r in lines if r["row"] == r["rows"]]
            if consumer not in self.swept:  # also the units a kill left between their ledger line and delete
                self.swept.add(consumer)
                whole += [records[u]["file"] for u, row in recorded.items() if row == records[u]["rows"]]
            self.out.remove_data_files(whole, links=True)  # only after the ledger line is on disk
