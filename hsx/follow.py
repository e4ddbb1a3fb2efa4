"""Train while extracting: a trainer reads an output dir's units as `hsx extract` commits them and releases them
once consumed, so the job needs disk for a window of units, not for the whole dataset.

- `follow(OUT, ...)`: a `torch.utils.data.IterableDataset` of the job's rows, unit by unit as they are committed
  (`hsx.load`'s dicts, or `hsx.torch_view`'s torch rows). It waits for new units (polling the manifests every
  `poll_seconds`), and ends when hsx.json says the job is complete and every unit of this consumer is consumed.
- It reads a source (`Source`, the written contract of its transports): a `LocalSource` (OUT on this machine) or,
  for `grpc://HOST:PORT`, an hsx.flight `FlightSource` (an `hsx serve OUT`, which reads OUT with a LocalSource):
  one reader, two ways to OUT.
- Its position (rows handed out, per unit) is `state_dict()` / `load_state_dict()` (torchdata's
  StatefulDataLoader convention) for the trainer's checkpoint, and `commit()` records it in OUT (a reader with
  `delete_consumed`; one without writes nothing there): one fsynced line per unit in
  `.hsx/consumed-<consumer>-<rank>.jsonl` (hsx.schema.ConsumedRecord), then deletes the units every declared
  consumer has consumed whole (hsx.ledgers.released). A reader with `delete_consumed` declares its consumer in
  OUT and holds its consumer rank's lock (`LocalSource.take_consumer`: a second live one is refused);
  `hsx consumers OUT` lists the consumers and retires one that stopped for good (`retire`).
- Each unit's CRC-32 is checked against its manifest line before any of its rows is handed out
  (`check_unit_crc`; over Flight, each record batch's too: hsx.flight).
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

import fcntl
import functools
import os
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from hsx import ledgers
from hsx.errors import HsxError
from hsx.files import open_no_follow
from hsx.info import recorded_info, read_summary
from hsx.schema import CONSUMER_NAME

SUPERSEDED = "superseded"  # an older local reader's claim, once a newer reader in its process took it over
LOCAL = "local"  # the session of a local reader's claim (LocalSource.take_consumer); hsx serve's clients send their own
MAX_WORLD_SIZE = 1 << 20  # trainer ranks (a rank names a ledger file: 5 digits or more)


# ---- the extractor's side: --max-pending-gb ---------------------------------------------------------------------

def pending_bytes(out, in_flight=()) -> int:
    """Bytes of units on disk that are not consumed yet: committed units (a manifest line) not consumed whole by
    every declared consumer (hsx.ledgers.released: the rule that deletes them), units being written under
    .hsx/tmp/, and `in_flight` (this process's units submitted to its committer, between .hsx/tmp/ and their
    manifest line). Counted by name, once each.

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
    records = ledgers.manifest_records(out.state) if out.state.is_dir() else {}
    released, held = ledgers.released(out.state, records), ledgers.held_files(out.state)
    for unit, rec in records.items():
        name = rec["file"]
        if unit not in released and name not in sizes and name not in held:
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
           token: str | None = None, units_ahead: int = 1):
    """The rows of the job writing `output_dir`, as its units are committed: a `torch.utils.data.IterableDataset`
    that waits for new units and ends when the job is complete and every unit of this consumer was handed out.

    - `output_dir`: a local output dir, or `grpc://HOST:PORT` of an `hsx serve OUT` (the same rows, position and
      ledgers, recorded by the server in OUT; `token`: its bearer token, else $HSX_SERVE_TOKEN). `units_ahead`
      (grpc:// only): units read ahead, each on its own connection, while the rows before them are handed out:
      the transfer overlaps training, and several streams read faster than one (docs/follow.md, "Throughput";
      memory: up to that many units more); 0 reads each unit when its first row is asked for.
    - `rows="torch"`: `hsx.torch_view`'s rows (torch tensors, views of the mapped unit; `layers`, `dequantize` as
      there); `rows="dict"`: `hsx.load(OUT)`'s rows (`datasets` dicts of Python values).
    - `consumer`: names the ledger (.hsx/consumed-<consumer>-<rank>.jsonl); a second trainer reading the same dir
      takes another name. With `delete_consumed` the name is declared in OUT (.hsx/consumers.json): a unit is
      deleted only once every declared consumer consumed it, and a second live deleting reader of the same
      name and rank is refused (`hsx consumers OUT` lists them, `--retire NAME` releases one that stopped).
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

        if not (type(units_ahead) is int and units_ahead >= 0):
            raise ValueError(f"units_ahead={units_ahead!r}: a non-negative integer")
        source = FlightSource(output_dir, token, units_ahead)
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
    if delete_consumed:  # one live deleting reader per consumer rank; its units then wait for it
        source.take_consumer(consumer, rank, world_size)
    elif consumer in source.declared():
        warnings.warn(f"hsx.follow: consumer {consumer!r} is declared in {source.where}, so its units are deleted "
                      "(and the extractor's --max-pending-gb window released) only once it records them, which a "
                      "reader without delete_consumed=True never does: pass delete_consumed=True, or read under "
                      "another consumer= name", stacklevel=2)
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


def check_unit_crc(path: Path, fd: int, rec: dict[str, Any]) -> None:
    """HsxError naming the unit unless the file open at `fd` has the CRC-32 its manifest line records (a flipped
    bit in a unit of the right size is valid Arrow: only the checksum tells). Read whole, before any row of it is
    handed out; a manifest line without a CRC-32 (an older hsx's) is checked by size only."""
    from hsx.checksums import file_crc32

    want = rec.get("crc32")
    if want and file_crc32(path, fd) != want:
        raise HsxError(f"{path}: unit {rec['unit']}'s bytes do not match the CRC-32 its manifest line records "
                       f"({want}): damaged on disk; none of its rows were handed out and nothing was deleted (run "
                       "the job's `hsx extract` command with --check-crc to redo it)")


# A process's local claims, by lock file: a newer reader of the same consumer rank in this process (a notebook cell
# run again, a trainer restarted in-process while its old loader is still referenced) takes the claim over and the
# older one records nothing more (its commit is refused: `_check_holder`); across processes the flock refuses.
_IN_PROCESS: dict[tuple[str, str, int], "weakref.ref[LocalSource]"] = {}
_IN_PROCESS_LOCK = threading.Lock()


def _lock_key(lock: Path, consumer: str, rank: int) -> tuple[str, str, int]:
    return (os.path.realpath(lock.parent), consumer, rank)


def _take_over_in_process(source: "LocalSource", lock: Path, consumer: str, rank: int) -> int | None:
    """The flock fd of an older live reader of this consumer rank in this process, moved to `source` (the older
    one's claim dropped), or None when no reader of this process holds it."""
    with _IN_PROCESS_LOCK:
        ref = _IN_PROCESS.get(_lock_key(lock, consumer, rank))
        older = ref() if ref is not None else None
        if older is None or older is source:
            return None
        with older.lock:
            fd = older.flocks.pop((consumer, rank), None)
            older.holders[(consumer, rank)] = SUPERSEDED
        return fd


def _close_all(fds: dict) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


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


@runtime_checkable
class Source(Protocol):
    """What hsx.follow reads an output dir through (hsx.torch_data.Follow's `src`, and `follow` itself): a
    `LocalSource` (OUT on this machine) or an hsx.flight `FlightSource` (OUT behind `hsx serve`). Every method
    raises HsxError (one line) for what it cannot do or refuses; records are hsx.schema's, as dicts.

    Pickling: a source pickles (a spawn DataLoader worker's copy of Follow) into a fresh one over the same OUT (a
    new lock, a new connection) that has taken no consumer rank: the copy records nothing, so the one consumer
    rank stays the original's. tests/test_follow.py checks both sources against this and that its members are
    exactly the ones hsx.follow calls (a new call is a deliberate change here)."""

    where: str  # OUT as errors name it: a path, or grpc://HOST:PORT

    def summary(self) -> Any:
        """The job's plan (hsx.schema.Summary of .hsx/summary.json), or None before the job wrote it."""

    def records(self) -> dict[str, dict[str, Any]]:
        """The committed units: unit -> its manifest record (hsx.schema.ManifestRecord, checked)."""

    def complete(self) -> bool:
        """Whether hsx.json says the job is complete."""

    def declared(self) -> list[str]:
        """The consumers units wait for (declared and not retired)."""

    def ledger(self, consumer: str) -> dict[str, dict[str, Any]]:
        """`consumer`'s ledger: unit -> its furthest consumed record."""

    def gone(self, rec: dict[str, Any]) -> bool:
        """Whether the committed unit `rec` is no longer in data/ (deleted once consumed, uploaded or exported)."""

    def readable(self, rec: dict[str, Any], consumer: str) -> bool:
        """Whether unit `rec` can be read now: False for one a resume moved aside (it is redone); HsxError for one
        missing or of another size though `consumer` has not consumed it."""

    def open(self, rec: dict[str, Any]) -> Any:
        """Unit `rec`'s rows as a `datasets.Dataset`, checked against its manifest line (size, CRC-32, rows) before
        any row is handed out."""

    def open_ahead(self, recs: list[dict[str, Any]]) -> None:
        """Begin reading these units (the ones this reader opens next, in order) where reading one takes long; a
        later `open` of one of them takes what was read. Nothing where `open` is cheap (a local memory map)."""

    def take_consumer(self, consumer: str, rank: int, world_size: int) -> None:
        """Make this reader the one deleting reader of `consumer`'s rank `rank`: declare the consumer in OUT and
        refuse a second live one (a lock, or a lease renewed while the reader lives)."""

    def hold(self, consumer: str, rank: int, world_size: int, units: list[str]) -> None:
        """Say which units of the rank's share this reader holds in steps not yet returned (the extractor's
        --max-pending-gb window counts them)."""

    def record(self, consumer: str, rank: int, world_size: int, rows: dict[str, int]) -> None:
        """Record rows [0, ROW) of each unit as consumed (fsynced ledger lines, forward only, of the rank's share),
        then delete the units every declared consumer consumed whole; refused whole, nothing written, when any
        is wrong. A reader without delete_consumed writes nothing."""


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
        self.lock = threading.RLock()  # (hsx serve records for several clients at once)
        self._holders_init()

    def _holders_init(self) -> None:
        # (consumer, rank) -> the session that may record for it (a local reader's: LOCAL; hsx serve's clients:
        # theirs), and the flocks held on .hsx/consumer-<consumer>-<rank>.lock (closed when this source goes)
        self.holders: dict[tuple[str, int], str] = {}
        self.heard: dict[tuple[str, int], float] = {}  # when the claiming session last called (monotonic)
        self.wanted: list[tuple[str, int, int, str]] = []  # claims waiting for OUT to exist
        self.flocks: dict[tuple[str, int], int] = {}
        weakref.finalize(self, _close_all, self.flocks)

    def __getstate__(self) -> dict[str, Any]:  # (a pickled hsx.follow, for a spawn DataLoader worker: a new lock)
        return {k: v for k, v in self.__dict__.items() if k not in ("lock", "holders", "heard", "wanted", "flocks")}

    def __setstate__(self, state: dict[str, Any]) -> None:  # (a copy claims nothing: it records nothing)
        self.__dict__.update(state)
        self.lock = threading.RLock()
        self._holders_init()

    def take_consumer(self, consumer: str, rank: int, world_size: int, session: str = LOCAL,
                      by: str = "hsx.follow") -> None:
        """Make this source the one deleting reader of `consumer`'s rank `rank`: declare the consumer in OUT
        (hsx.ledgers.declare_consumers: units then wait for it) and hold .hsx/consumer-<consumer>-<rank>.lock
        (flock, released when the process ends): a second live local reader of it is refused (HsxError, one
        line). `session`: who records for it here; hsx serve's clients (each its own session, no lock: a server
        cannot see a client's process) hold it while they renew it (hsx.flight.CLAIM_RENEW_SECONDS): another
        session's claim is refused while the holder was heard from within CLAIM_LEASE_SECONDS, and takes it over
        after (a trainer restarted after a kill, once its dead self's lease ran out). A retired consumer is
        refused. A dir not there yet is claimed once it is."""
        check_consumer(consumer, rank, world_size)
        if not self.write:
            raise HsxError(f"{self.where}: a read-only reader records nothing, so it claims no consumer")
        if not (isinstance(session, str) and session):
            raise HsxError("claim: a session names the reader")
        from hsx.flight import CLAIM_LEASE_SECONDS

        with self.lock:
            holder = self.holders.get((consumer, rank))
            if session != LOCAL and holder not in (None, session):
                quiet = time.monotonic() - self.heard.get((consumer, rank), 0.0)
                if quiet < CLAIM_LEASE_SECONDS:
                    raise HsxError(f"{self.where}: consumer {consumer!r} rank {rank} already has a live reader that "
                                   f"deletes (it renewed its claim {quiet:.0f} s ago): two readers of one name would "
                                   "delete units the other has not read; give this one another consumer= name, or "
                                   f"stop the other (a stopped one's claim lapses after {CLAIM_LEASE_SECONDS:g} s)")
            self.wanted.append((consumer, rank, world_size, session))
            self._take_wanted(by)

    def _take_wanted(self, by: str = "hsx.follow") -> None:
        """Take the claims asked for, once OUT is a dir (its .hsx/ made if the job has not yet). Under self.lock."""
        if not self.wanted or not self.out.root.is_dir():
            return
        self.out.state.mkdir(exist_ok=True)
        self.out.check_no_links()
        while self.wanted:
            consumer, rank, _, session = self.wanted[0]
            if session == LOCAL and (consumer, rank) not in self.flocks:  # (hsx serve's clients: by session)
                lock = self.out.state / f"consumer-{consumer}-{rank:05d}.lock"
                fd = _take_over_in_process(self, lock, consumer, rank)
                if fd is None:
                    fd = open_no_follow(lock, os.O_RDWR | os.O_CREAT)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        os.close(fd)
                        self.wanted.pop(0)
                        raise HsxError(f"{self.where}: consumer {consumer!r} rank {rank} already has a live reader "
                                       f"that deletes (it holds .hsx/{lock.name}): two readers of one name would "
                                       "delete units the other has not read; give this one another consumer= "
                                       "name, or stop the other") from None
                self.flocks[(consumer, rank)] = fd
                with _IN_PROCESS_LOCK:
                    _IN_PROCESS[_lock_key(lock, consumer, rank)] = weakref.ref(self)
            ledgers.declare_consumers(self.out.state, [consumer], by)
            self.holders[(consumer, rank)] = session
            self.heard[(consumer, rank)] = time.monotonic()
            self.wanted.pop(0)

    def _check_holder(self, consumer: str, rank: int, session: str, verb: str) -> None:
        if consumer in ledgers.consumers_record(self.out.state).retired:
            raise HsxError(f"{verb}: consumer {consumer!r} was retired (hsx consumers --retire): it records "
                           "nothing more; read under another consumer= name")
        if self.holders.get((consumer, rank)) == session:
            self.heard[(consumer, rank)] = time.monotonic()
        elif self.holders.get((consumer, rank)) == SUPERSEDED:
            raise HsxError(f"{verb}: a newer hsx.follow of consumer {consumer!r} rank {rank} in this process took "
                           "over; this older reader records nothing more (iterate the newer one)")
        else:
            raise HsxError(f"{verb}: consumer {consumer!r} rank {rank} is not this reader's to record"
                           + (" (another reader of that consumer and rank claimed it, after this one's claim "
                              "lapsed: two deleting readers of one name?)" if (consumer, rank) in self.holders else
                              " (a deleting reader claims its consumer first: hsx.follow does)"))

    def _check_share(self, units, rank: int, world_size: int, verb: str) -> None:
        """HsxError unless every unit is of rank `rank`'s share of `world_size` (unit i of the plan to rank i %
        world_size, as the reader splits them): a rank records and holds only the units it reads."""
        summary = self.summary()
        index = {u: i for i, u in enumerate(summary.unit_names)} if summary is not None else {}
        for unit in units:
            i = index.get(unit)
            if i is None or i % world_size != rank:
                raise HsxError(f"{verb}: unit {str(unit)[:80]} is "
                               + ("not in the job's plan" if i is None else f"rank {i % world_size}'s of "
                                  f"{world_size}") + f", not rank {rank}'s: a rank records only units of its share")

    def summary(self):
        return read_summary(self.out.state)

    def records(self) -> dict[str, dict[str, Any]]:
        if self.wanted:
            with self.lock:
                self._take_wanted()
        return ledgers.manifest_records(self.out.state) if self.out.state.is_dir() else {}

    def complete(self) -> bool:
        info = recorded_info(self.out.root)
        return info is not None and info.complete

    def declared(self) -> list[str]:
        """The consumers units wait for (hsx.ledgers.active_consumers)."""
        return ledgers.active_consumers(self.out.state) if self.out.state.is_dir() else []

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

    def open_ahead(self, recs: list[dict[str, Any]]) -> None:
        pass  # (a unit is memory-mapped: its pages come as its rows are read)

    def table(self, rec: dict[str, Any]):
        """The unit's rows as the memory-mapped pyarrow Table of its file (what `hsx serve` sends), if it is the
        file its manifest line describes: a regular file opened through no link (or, in a dir `hsx merge` joined,
        the unit of a merged dir its link leads to: OutputDir.unit_source), of the recorded size, CRC-32
        (`check_unit_crc`, read from the fd then mapped) and rows, and its name still leading to that file once
        mapped."""
        import pyarrow as pa

        return self._read(rec, lambda path: pa.ipc.open_stream(pa.memory_map(str(path))).read_all(),
                          lambda t: t.num_rows)

    def _read(self, rec: dict[str, Any], read, rows_of):
        from hsx.files import still_the_file
        from hsx.info import merged_from

        dirs: list[str] = []
        if (self.out.data / rec["file"]).is_symlink():  # (a regular file needs no merged dir: no hsx.json read)
            dirs = merged_from(recorded_info(self.out.root)) or [os.path.normpath(d)
                                                             for d in ledgers.merged_sources(self.out.state)
                                                             if os.path.isabs(d)]
        fingerprint = self._fingerprint() if dirs else None
        path = self.out.unit_source(rec["file"], dirs=dirs, fingerprint=fingerprint, sources=self.sources)
        fd = self.out.open_unit(path)
        try:
            size = os.fstat(fd).st_size
            if size != rec["bytes"]:
                raise HsxError(f"{path} holds {size:,} bytes, its manifest line says {rec['bytes']:,}")
            check_unit_crc(path, fd, rec)
            got = read(path)
            still_the_file(path, fd)
        finally:
            os.close(fd)
        if rows_of(got) != rec["rows"]:
            raise HsxError(f"{path} holds {rows_of(got)} rows, its manifest line says {rec['rows']}")
        return got

    def _fingerprint(self) -> str | None:
        from hsx.fingerprint import recorded_job

        job = recorded_job(self.out.state)
        return job.fingerprint if job is not None else None

    def hold(self, consumer: str, rank: int, world_size: int, units: list[str], session: str = LOCAL) -> None:
        """Say which units this reader holds in steps not yet returned while it waits for a unit
        (hsx.ledgers.held_files)."""
        check_consumer(consumer, rank, world_size)
        records = self.records()
        if not (isinstance(units, list) and all(isinstance(u, str) and u in records for u in units)):
            raise HsxError("hold: units must be committed units of this output")
        if self.write:
            if not units and any(w[:2] == (consumer, rank) for w in self.wanted):
                return  # (claimed once OUT exists: nothing was held before it did)
            self._check_share(units, rank, world_size, "hold")
            self._check_holder(consumer, rank, session, "hold")
            ledgers.write_holding(self.out.state, consumer, rank, [records[u]["file"] for u in units])

    def record(self, consumer: str, rank: int, world_size: int, rows: dict[str, int], session: str = LOCAL) -> None:
        """Record that rows [0, ROW) of each UNIT of `rows` were consumed: one ledger line per unit (built from its
        manifest record), appended and fsynced, then the units wholly consumed deleted (a link `hsx merge` made:
        the link only). Refused whole (HsxError, nothing written) when a unit is not a committed unit of this
        output, a row is not in 0..its rows, or a row is not past what the consumer's ledger already records (a
        replayed or rewound position), and (with `write`) when `session` does not hold the consumer rank's claim
        (`take_consumer`) or a unit is not of that rank's share. A unit is deleted only once every declared consumer
        consumed it whole (hsx.ledgers.released): the last of them to commit it deletes it. Without `write`
        nothing is written."""
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
            self._check_share([r["unit"] for r in lines], rank, world_size, "commit")
            self._check_holder(consumer, rank, session, "commit")
            if lines:
                ledgers.record_consumed(self.out.state, consumer, rank, lines)
                recorded.update({r["unit"]: r["row"] for r in lines})
            whole = {r["unit"] for r in lines if r["row"] == r["rows"]}
            if consumer not in self.swept:  # also the units a kill left between their ledger line and delete
                self.swept.add(consumer)
                whole |= {u for u, row in recorded.items() if row == records[u]["rows"]}
            # only after the ledger line is on disk, and only units every declared consumer consumed whole
            released = ledgers.released(self.out.state, records) if whole else set()
            self.out.remove_data_files([records[u]["file"] for u in sorted(whole & released)], links=True)


# ---- `hsx consumers OUT`: the consumers an output serves, declared and retired -------------------------------------

def _state_of(out_dir) -> Any:
    from hsx.sink import OutputDir

    out = OutputDir(Path(out_dir))
    if not out.state.is_dir():
        raise HsxError(f"{out_dir}: no .hsx/ folder (not an hsx output dir, or its job has not started)")
    return out


def _live_locks(state: Path, consumer: str) -> tuple[list[int], list[str]]:
    """Try the locks of `consumer`'s ranks (.hsx/consumer-<consumer>-<rank>.lock): (fds taken, names held by a live
    reader). The caller closes the fds (holding them keeps a reader from starting meanwhile)."""
    taken, busy = [], []
    for lock in sorted(state.glob(f"consumer-{consumer}-*.lock")):
        fd = open_no_follow(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            taken.append(fd)
        except BlockingIOError:
            os.close(fd)
            busy.append(lock.name)
    return taken, busy


def consumer_report(out_dir) -> dict[str, Any]:
    """What `hsx consumers OUT` lists: each consumer (declared or with a ledger) with what declared it, its ranks,
    the units it consumed whole, whether a live local reader holds it, the units only it holds back (what retiring
    it would release), and the retired ones."""
    out = _state_of(out_dir)
    state = out.state
    rec, ranks = ledgers.consumers_record(state), ledgers.ledger_consumers(state)
    records = ledgers.manifest_records(state)
    active = ledgers.active_consumers(state)
    whole = {c: ledgers.wholly_consumed(state, c, records) for c in active}
    consumers = []
    for name in active:
        others = [whole[c] for c in active if c != name]
        held_back = sorted(set.intersection(*others) - whole[name]) if others else []
        taken, busy = _live_locks(state, name)
        for fd in taken:
            os.close(fd)
        consumers.append({"name": name, "declared_by": rec.declared.get(name, "its ledger (an older hsx)"),
                          "ranks": ranks.get(name, []), "consumed": len(whole[name]), "live": bool(busy),
                          "holds_back": held_back})
    return {"output_dir": str(out_dir), "units": len(records), "released": len(ledgers.released(state, records)),
            "consumers": consumers, "retired": rec.retired}


def retire(out_dir, consumer: str, log=print) -> list[str]:
    """`hsx consumers OUT --retire NAME`: NAME stops holding units back (it consumes no more; its ledgers stay).
    The units every consumer left has consumed whole are deleted now, and named. Refused (HsxError, nothing
    changed) for a name that is not an active consumer, and while a live local reader holds it. Returns the unit
    files deleted."""
    out = _state_of(out_dir)
    out.check_no_links()  # (it writes .hsx/consumers.json and deletes under data/)
    state = out.state
    rec = ledgers.consumers_record(state)
    active = ledgers.active_consumers(state)
    if consumer not in active:
        if consumer in rec.retired:
            raise HsxError(f"{out_dir}: consumer {consumer!r} is retired already ({rec.retired[consumer]})")
        raise HsxError(f"{out_dir}: {str(consumer)[:80]!r} is not a consumer of it (its consumers: "
                       f"{', '.join(active) or 'none'})")
    taken, busy = _live_locks(state, consumer)
    try:
        if busy:
            raise HsxError(f"{out_dir}: consumer {consumer!r} has a live reader (it holds .hsx/{busy[0]}): stop it "
                           "first; retiring it would delete units under it")
        records = ledgers.manifest_records(state)
        before = ledgers.released(state, records)
        ledgers.retire_consumer(state, consumer)
        for holding in state.glob(f"holding-{consumer}-*.json"):  # (what it held no longer holds the window)
            if holding.is_file() and not holding.is_symlink():
                holding.unlink()
        left = [c for c in active if c != consumer]
        newly = sorted(ledgers.released(state, records) - before)
        deleted = out.remove_data_files([records[u]["file"] for u in newly], links=True)
    finally:
        for fd in taken:
            os.close(fd)
    if not left:
        log(f"hsx consumers: {consumer!r} retired; no consumer is left, so no unit is released and nothing is "
            f"deleted (units wait until a consumer is declared and consumes them)")
    else:
        waiting = sum(1 for u in records if u not in before and u not in newly)
        log(f"hsx consumers: {consumer!r} retired (its ledgers stay); {len(newly)} unit(s) that "
            f"{', '.join(repr(c) for c in left)} had consumed whole are released"
            + (f" and deleted: {', '.join(deleted[:5])}{', ...' if len(deleted) > 5 else ''}" if deleted else "")
            + f"; {waiting} committed unit(s) still wait for a consumer")
    return deleted

