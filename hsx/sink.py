"""The output dir: Arrow shards under data/, hsx's run state under .hsx/, hsx.json and a dataset card.

    OUT/data/train-<bucket>-<chunk>.arrow   Arrow IPC stream files (what datasets writes; `Dataset.from_file`
                                            memory-maps them; `load_dataset(OUT)` reads them)
    OUT/README.md                           dataset card (hsx.card): YAML `configs` naming the data files
    OUT/hsx.json                            what was run, counts, layer convention; `complete` once finalized
    OUT/.hsx/job.json                       the fingerprint of what decides the output
    OUT/.hsx/manifest-<rank>.jsonl          one line per committed unit: rows, tokens, bytes, CRC-32
                                            (one file per rank; datasets ignores dot-folders)
    OUT/.hsx/uploaded-<rank>.jsonl          one line per file a Hub push committed (hsx.hub); a unit deleted
                                            after upload (--delete-after-upload) still counts as done
    OUT/.hsx/consumed-<consumer>.jsonl      one line per unit a trainer reading the running job (hsx.follow)
                                            consumed, whole or up to a row; a wholly consumed unit it deleted
                                            still counts as done
    OUT/.hsx/holding-<consumer>-<rank>.json the units such a trainer holds in a step not yet returned while it
                                            waits for a unit (hsx.follow.held_files)
    OUT/.hsx/exported.jsonl                 one line per unit an export with --delete-source deleted, and where
                                            its rows went (hsx.export), so a reader says so
    OUT/.hsx/damaged/                       units a resume found damaged (wrong CRC-32), moved aside and redone

hsx.json lists every file of the finished output (name, unit, rows, bytes, CRC-32): it travels with the data to
the Hub, where .hsx/ does not, so a reader (hsx.load, hsx push) checks what it reads against it. Every JSON file
and ledger line here is read through its typed, checked record in hsx.schema (Info, Summary, JobRecord,
ManifestRecord, UploadRecord): a damaged one is one line naming the file.

hsx never writes or deletes through a symbolic link in the dir (.hsx/, data/, hsx.json, README.md and anything
under .hsx/ must be what they seem: a link there is refused in one line). Units under data/ may be links only as
`hsx merge` makes them; deleting one removes the link, never its target. Readers (hsx.load, hsx verify, hsx push)
follow such a link only into a dir the merge recorded in hsx.json, of the same job, whose manifest records that
unit (`OutputDir.unit_source`), and read a finished output only when hsx.json's list, the manifests, the counts and
data/ agree (`OutputDir.check_finished`).

A unit is written by `map` under .hsx/tmp/, fsynced, then renamed into data/ (and the directory fsynced) before
its manifest line is appended, so a kill at any moment leaves either a whole unit or none. Unit names carry no
"-of-N": resumed and parallel runs add units without renaming any.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import hashlib
import json
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from hsx.config import HsxError
from hsx.fingerprint import differing_files
from hsx.schema import (DEFAULT_STORAGE_DTYPE, MAX_LEDGER_BYTES, MAX_LEDGER_LINE_BYTES, RECORD_REST_BYTES,
                        RUN_VARIANT_KEYS, ConsumedRecord, Damaged, FileEntry, Info, JobRecord, ManifestRecord,
                        OutputFormat, RunRecord, Summary, UploadRecord, merged_values, values_used)

MANIFESTS = "manifest-*.jsonl"  # one per rank: every process appends only to its own
UPLOADED = "uploaded-*.jsonl"  # Hub upload records (hsx.hub): one per rank, and uploaded-push.jsonl
CONSUMED = "consumed-*.jsonl"  # what trainers following the job consumed (hsx.follow): one per consumer
RUNS = "runs-*.jsonl"  # what each run of a rank computed the states with (hsx.schema.RunRecord): one per rank
EXPORTED = "exported.jsonl"  # units an export with --delete-source deleted (hsx.export), and where to
EMPTY_FILE = "train-000-00000.arrow"  # the one data file of a job without usable rows (OutputDir.finalize)
# What datasets writes next to a memory-mapped file for a cache-writing op (sort, map, filter, shuffle): an older
# hsx.load left them in data/; never part of the output, never read as it
DATASETS_CACHE_FILES = "cache-*.arrow"


# ---- reading what hsx wrote (which may be damaged, or not hsx's at all) -----------------------------------------

def _read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of a JSON file hsx wrote: a regular file reached through no link (a FIFO there would block
    forever, a link read another file), and at most `limit` bytes (hsx.schema's bound for that file: a bigger
    one is not hsx's; read whole it would take the machine's memory)."""
    with _open_bounded(path, limit) as f:  # (read(n) allocates n bytes up front: n is the file's size, not limit)
        return f.read(min(os.fstat(f.fileno()).st_size, limit) + 1)[:limit]


def _open_bounded(path: Path, limit: int):
    """`path` opened for reading as `_read_bounded` reads it: HsxError naming it when it is over `limit` bytes."""
    fd = open_regular(path)
    f = os.fdopen(fd, "rb")
    size = os.fstat(fd).st_size
    if size > limit:
        f.close()
        raise HsxError(f"{path} is damaged: {size:,} bytes, more than hsx writes there ({limit:,} at most)")
    return f


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict, refusing a key given twice: json keeps the last, so a file with two
    `complete`s or two `files` lists would say one thing to one reader and another to the next."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise Damaged(f"key {dup[:60]!r} given twice")
    return obj


def _loads(text: str) -> Any:
    return json.loads(text, object_pairs_hook=_unique_keys)


def read_json(path: Path, record=None, *, limit: int | None = None):
    """A JSON object hsx wrote (hsx.json, .hsx/job.json, .hsx/summary.json) as its typed record
    (`record.from_dict`, hsx.schema; the dict itself without one). Unreadable, over `limit` bytes (default: the
    record's MAX_BYTES; without a record `limit` must be given), not UTF-8 JSON, not an object, or a key missing or
    of the wrong type: HsxError in one line naming the file, never a KeyError three calls later."""
    if limit is None:
        limit = record.MAX_BYTES
    try:
        obj = _loads(_read_bounded(path, limit).decode("utf-8"))
    except OSError as e:
        raise HsxError(f"cannot read {path}: {e.strerror or e}") from None
    except Damaged as e:
        raise HsxError(f"{path} is damaged: {e}") from None
    except (ValueError, RecursionError) as e:  # (not JSON, not UTF-8, or an int of over 4300 digits)
        raise HsxError(f"{path} is damaged: not valid JSON ({str(e).splitlines()[0][:100]})") from None
    try:
        if not isinstance(obj, dict):
            raise Damaged("not a JSON object")
        return record.from_dict(obj) if record is not None else obj
    except Damaged as e:
        raise HsxError(f"{path} is damaged: {e}") from None


def read_jsonl(path: Path, record=None, *, limit: int = MAX_LEDGER_BYTES,
               line_limit: int = MAX_LEDGER_LINE_BYTES) -> Iterator[dict[str, Any]]:
    """The records of a JSON Lines ledger hsx appends to (.hsx/manifest-*.jsonl, .hsx/uploaded-*.jsonl, an
    export's journal), as the dicts written, each checked by `record.from_dict` (hsx.schema). A line that is not
    JSON is a torn append from a kill (its unit is redone) and is passed over; a whole JSON line that is not a
    valid record was damaged or written by something else: HsxError naming file and line. Read a line at a time:
    the file is at most `limit` bytes, a line at most `line_limit` (hsx.schema's bounds for that file; a
    ledger's by default)."""
    try:
        f = _open_bounded(path, limit)
    except OSError as e:
        raise HsxError(f"cannot read {path}: {e.strerror or e}") from None
    with f:
        yield from _ledger_records(path, f, record, line_limit)


def _ledger_records(path: Path, f, record, line_limit: int) -> Iterator[dict[str, Any]]:
    for number, raw in enumerate(iter(lambda: f.readline(line_limit + 1), b""), 1):
        if len(raw) > line_limit:
            raise HsxError(f"{path}: line {number} is damaged: over {line_limit:,} bytes, longer than "
                           "any line hsx writes")
        if not raw.strip():
            continue
        try:
            rec = _loads(raw.decode("utf-8"))
        except Damaged as e:  # (a key given twice: a whole line, written by something else)
            raise HsxError(f"{path}: line {number} is damaged: {e}") from None
        except (ValueError, RecursionError):  # (torn; or an int of over 4300 digits, which hsx never writes)
            continue
        try:
            if not isinstance(rec, dict):
                raise Damaged("not a JSON object")
            if record is not None:
                record.from_dict(rec)
        except Damaged as e:
            raise HsxError(f"{path}: line {number} is damaged: {e}") from None
        yield rec


def info_features(info: dict[str, Any]):
    """The output schema a (complete_info-built) hsx.json describes (None if it does not say enough)."""
    try:
        return Info.from_dict(info).format.features()
    except Damaged:
        return None


class OutputDir:
    def __init__(self, root: str | os.PathLike, rank: int = 0, given_as: str = "--output-dir"):
        """`given_as`: how the user named this dir (`hsx extract --output-dir`, a merge's OUTPUT_DIR or DIR, ...),
        for the advice of a refusal."""
        self.root = Path(root)
        self.rank = rank
        self.given_as = given_as
        self.data = self.root / "data"
        self.state = self.root / ".hsx"
        self.tmp = self.state / "tmp" / f"rank-{rank:05d}"
        self.session = uuid.uuid4().hex[:12]  # in this process's manifest lines: which run committed a unit
        self.approved: dict[str, tuple[int, int]] = {}  # path -> (st_dev, st_ino) unit_source checked

    # ---- claiming a dir for a job ----

    @contextmanager
    def locked(self) -> Iterator[None]:
        """One job per dir: an advisory lock on .hsx/lock, released by the kernel if the process dies.

        A non-empty dir that hsx did not write is refused here, before anything (.hsx/) is created in it."""
        self.check_not_foreign()
        self.check_no_links()
        self._make_state()
        name = "lock" if self.rank == 0 else f"lock-{self.rank:05d}"  # a job's ranks each hold their own
        in_use = f"{self.root} is in use by another hsx job (lock held on .hsx/lock)"
        merging = f"{self.root} is being merged (`hsx merge` holds .hsx/busy)"
        with _flock(self.state / name, fcntl.LOCK_EX, in_use), _flock(self.state / "busy", fcntl.LOCK_SH, merging), \
                ExitStack() as self._held:
            yield

    def lock_as_first(self) -> None:
        """Inside `locked()`: also hold .hsx/lock, as rank 0 does in its dir, for the first rank writing into a dir
        rank 0 does not write into (a node's own dir), so no other job starts there while this one runs."""
        self._held.enter_context(_flock(self.state / "lock", fcntl.LOCK_EX,
                                        f"{self.root} is in use by another hsx job (lock held on .hsx/lock)"))

    @contextmanager
    def locked_whole(self, what: str = "hsx merge") -> Iterator[None]:
        """The whole dir for one process (`hsx merge`): every rank of a running job holds .hsx/busy shared, so
        this exclusive lock is refused while any of them runs (and no job starts while it is held)."""
        self.check_not_foreign()
        self.check_no_links()
        self._make_state()
        running = f"{self.root} is in use by a running hsx job; {what} once it has finished"
        with _flock(self.state / "lock", fcntl.LOCK_EX, running), _flock(self.state / "busy", fcntl.LOCK_EX, running):
            yield

    def _make_state(self) -> None:
        try:
            self.state.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a read-only file system, a parent that is a file, /proc
            raise HsxError(f"cannot create {self.state}: {e.strerror or e}; choose another {self.given_as}, one "
                           "this user can write") from None

    def check_no_links(self) -> None:
        """Refuse a dir where .hsx/, data/, hsx.json, README.md or anything under .hsx/ is a symbolic link: hsx
        writes and deletes there, and must never do it in the link's target."""
        links = [p for p in (self.state, self.data, self.root / "hsx.json", self.root / "README.md")
                 if p.is_symlink()]
        if self.state.is_dir() and not links:
            for folder, dirs, files in os.walk(self.state):  # (os.walk does not follow links)
                links += [Path(folder) / n for n in dirs + files if (Path(folder) / n).is_symlink()]
        if links:
            raise HsxError(f"{self.root}: {links[0].relative_to(self.root)} is a symbolic link; hsx never writes "
                           "or deletes through links in its output dir: remove the link or choose another dir")

    def check_not_foreign(self) -> None:
        # One listing, not an exists() check then a listing: another rank of this job may create .hsx/ between.
        entries = [p.name for p in self.root.iterdir()] if self.root.is_dir() else []
        if entries and ".hsx" not in entries:
            raise HsxError(f"{self.root} is not empty and was not written by hsx; choose another {self.given_as}")
        if self.root.exists() and not self.root.is_dir():
            raise HsxError(f"{self.root} is a file, not a folder; choose another {self.given_as}")

    def has_output(self) -> bool:
        """Whether a job has committed anything here: a manifest record, a data file, or hsx.json. A damaged
        manifest counts as output (it is never cleared as unused); a torn line alone does not."""
        if any(self.data_files()) or (self.root / "hsx.json").exists():
            return True
        try:
            return bool(self.manifest_records())
        except HsxError:
            return True

    def claim(self, job: dict[str, Any], overwrite: bool, check_crc: bool = False, log=print,
              check: bool = True) -> str:
        """Record the job's fingerprint, or check it against the one there. Returns 'new', 'resume' or 'complete'.

        A dir whose job failed before committing anything (a --strict error, a missing chat template, ...) holds
        no output, so it is re-claimed for whatever job comes next instead of refused as a different job.

        The same job: the units it keeps are checked (check_units): the size of every one, the CRC-32 of the
        units of the run that wrote last (all of them with `check_crc`). A finished dir with a damaged or missing
        unit is not 'complete': it is marked unfinished and resumed, redoing those units."""
        job_file = self.state / "job.json"
        if overwrite:
            self.clear()
        elif not job_file.exists() and self.root.exists() and any(
                p.name not in (".hsx",) for p in self.root.iterdir()):
            raise HsxError(f"{self.root} is not empty and was not written by hsx; choose another --output-dir")
        if job_file.exists():
            old = read_json(job_file, JobRecord)
            if old.fingerprint == job["fingerprint"]:
                if check:  # (the dir's first process, before any rank of this run writes: hsx.job claims in turns)
                    self.clear_tmp(every_rank=True)
                return self._resume_state(check_crc, log, check)
            if self.has_output():
                raise HsxError(f"{self.root} holds a different job (differs in: {describe_difference(old.to_dict(), job)}); "
                               "use another --output-dir, or --overwrite to delete it and start over")
            self.clear()  # a job that failed before committing anything: drop its job.json, tokenized cache, tmp
        self.state.mkdir(parents=True, exist_ok=True)
        atomic_write(job_file, json.dumps(job, indent=2, sort_keys=True))
        if check:
            self.write_unfinished_card()
        return "new"

    def remove_if_unused(self, keep_root: bool = False) -> None:
        """Remove .hsx/ (and the dir, unless `keep_root` or something else is in it) when no job committed
        anything here."""
        if self.has_output() or not self.root.is_dir():
            return
        card = self.root / "README.md"  # the placeholder card a claim writes (write_unfinished_card), nothing else
        if card.is_file() and not card.is_symlink() and card.read_text(errors="replace") == UNFINISHED_CARD:
            card.unlink()
        if self.data.is_dir() and not self.data.is_symlink() and not any(self.data.iterdir()):
            self.data.rmdir()
        shutil.rmtree(self.state, ignore_errors=True)
        if not keep_root and not any(self.root.iterdir()):
            self.root.rmdir()

    def write_unfinished_card(self) -> None:
        """Until finalize writes the real card, README.md points `load_dataset(OUT)` at a file that does not
        exist and says so, so reading a running or interrupted job fails instead of returning part of it."""
        atomic_write(self.root / "README.md", UNFINISHED_CARD)

    def _resume_state(self, check_crc: bool, log, check: bool) -> str:
        """'complete' or 'resume'. `check`: this process checks the units (one per dir: the other ranks of the
        job come after it and only count them)."""
        info = self.read_info()
        complete = info is not None and info.complete
        damaged = self.check_units(check_crc) if check else []
        summary = self.read_summary()
        expected = ((summary.unit_names if summary else [])
                    or [e.unit for e in (info.files if info else None) or () if e.unit])
        done = self.done_units()
        missing = [u for u in expected if u not in done]
        if complete and not (damaged or missing):
            problem = self.listing_problem(info, data_dir=False) if check else None
            if problem is None:
                return "complete"
            log(f"hsx: {self.root}: {problem}; hsx.json is written again from the manifests")
        lost = [u for u in missing if u in self.manifest_records()]  # committed once (damaged ones too), now gone
        if damaged or lost:
            names = damaged or [f"train-{u}.arrow" for u in lost]
            log(f"hsx: {self.root}: {len(damaged)} damaged and {len(lost) - len(damaged)} missing unit(s) "
                f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); they are redone"
                + (" (damaged ones moved to .hsx/damaged/)" if damaged else ""))
        if len(missing) > len(lost):  # never written: the rest of an interrupted job, not a loss
            log(f"hsx: {self.root}: {len(done)} unit(s) done, {len(missing) - len(lost)} to do")
        if check:
            self._remove_uncommitted(summary.unit_names if summary else [], log)
        if check and complete:  # no longer finished: a reader must not take it for a whole output
            atomic_write(self.root / "hsx.json", json.dumps(info.unfinished().to_dict(), indent=2) + "\n")
        if check and (complete or not (self.root / "README.md").exists()):
            self.write_unfinished_card()
        return "resume"

    def _remove_uncommitted(self, units: list[str], log) -> None:
        """A unit of the plan in data/ with no manifest line: a run was killed between its rename and its manifest
        line (or mid-line). Its rows are redone and the redo replaces the file; until then no reader may take it
        for output and no `--max-pending-gb` window may wait for a trainer to consume it, so it goes now. Files
        that are not units of this job's plan are left alone, and so is anything but a regular file
        (`remove_data_files`: never through a link)."""
        records = self.manifest_records()
        gone = self.remove_data_files([f"train-{unit}.arrow" for unit in units if unit not in records])
        if gone:
            log(f"hsx: {self.root}: {len(gone)} unit file(s) a killed run renamed into data/ but never recorded "
                f"({', '.join(gone[:3])}{', ...' if len(gone) > 3 else ''}) removed; they are redone")

    def remove_data_files(self, names: list[str], links: bool = False) -> list[str]:
        """Remove these names from data/ where each is a regular file (and, with `links`, a symbolic link: the
        link only, as `hsx merge` makes them); a folder, a FIFO or anything else there is left alone. data/ is
        opened as the folder it is, never through a link, and each name is looked up and removed in it, so data/
        swapped for a link after the dir was checked (check_no_links) deletes nothing elsewhere: HsxError. A
        hard-linked file loses this name only; its other names keep the bytes. Returns the names removed."""
        if not names:
            return []
        try:
            folder = os.open(self.data, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return []
        except OSError:
            raise HsxError(f"{self.data} is a symbolic link or not a folder; hsx never deletes through links in its "
                           "output dir: put the folder itself there") from None
        gone = []
        try:
            for name in names:
                try:
                    mode = os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode
                    if stat.S_ISREG(mode) or (links and stat.S_ISLNK(mode)):
                        os.unlink(name, dir_fd=folder)
                        gone.append(name)
                except FileNotFoundError:  # (gone already: another consumer, a resume)
                    continue
            if gone:
                os.fsync(folder)
        finally:
            os.close(folder)
        return gone

    def check_units(self, all_crc: bool = False) -> list[str]:
        """Check the committed units on disk against their manifest records: the size of every one, and the
        CRC-32 of those the last run of each rank wrote (every unit's with `all_crc`). A unit whose bytes differ
        is moved to .hsx/damaged/ (not deleted), so it is redone; a unit of the wrong size is not counted as done
        (done_units) and is redone. Returns the names of the files moved aside."""
        check = set()
        for manifest in sorted(self.state.glob(MANIFESTS)):
            recs = list(read_jsonl(manifest, ManifestRecord))
            last = recs[-1].get("session") if recs else None
            check |= {r["unit"] for r in recs if all_crc or (last is not None and r.get("session") == last)}
        damaged = []
        for unit, rec in self.manifest_records().items():
            f = self.data / rec["file"]
            try:
                if unit not in check or not f.exists() or f.stat().st_size != rec["bytes"] or "crc32" not in rec:
                    continue
                crc = file_crc32(_target(f))
            except FileNotFoundError:  # consumed and deleted meanwhile by a trainer reading the job (hsx.follow)
                continue
            if crc != rec["crc32"]:
                (self.state / "damaged").mkdir(exist_ok=True)
                os.replace(f, self.state / "damaged" / f.name)
                damaged.append(f.name)
        if damaged:
            fsync_dir(self.data)
        return damaged

    def clear(self) -> None:
        """Delete only what hsx writes here (never the lock, which this process holds), and never through a
        link: a unit that is a link (`hsx merge`) loses the link, its target stays."""
        self.check_no_links()
        for name in ("hsx.json", "README.md", "token_frequencies.npy"):
            (self.root / name).unlink(missing_ok=True)
        for pattern in ("vocab_mapping-*.pt", "d2t-*.npy", "t2d-*.npy"):  # `hsx vocab OUT` writes these here
            for f in self.root.glob(pattern):
                f.unlink()
        if self.data.exists():
            for f in self.data.glob("train-*.arrow"):
                f.unlink()
            for f in self.data.glob(DATASETS_CACHE_FILES):  # datasets' caches of those units (an older hsx.load's)
                f.unlink()
            if not any(self.data.iterdir()):
                self.data.rmdir()
        if self.state.exists():
            for p in self.state.iterdir():
                if not p.name.startswith("lock") and p.name != "busy":
                    shutil.rmtree(p) if p.is_dir() else p.unlink()

    @contextmanager
    def finalizing(self) -> Iterator[bool]:
        """Serialize finalization between ranks; yields True when another process already finalized."""
        fd = os.open(self.state / "finalize.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            info = self.read_info()
            yield info is not None and info.complete
        finally:
            os.close(fd)

    def announce(self, run_id: str, rank: int) -> None:
        """Leave a file saying `rank` of run `run_id` writes here (hsx.run.share_dir: which ranks share a dir)."""
        folder = self.state / "ranks" / run_id
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / f"{rank:05d}.here", run_id + "\n")

    def announced(self, run_id: str) -> list[int]:
        """The ranks of run `run_id` that announced themselves here."""
        folder = self.state / "ranks" / run_id
        return sorted(int(f.name[:-5]) for f in folder.glob("*.here") if f.name[:-5].isdigit())

    def mark_rank_done(self, run_id: str, rank: int, world_size: int, stats: dict[str, Any] | None = None) -> bool:
        """Record that `rank` finished its share of run `run_id` (with its throughput numbers); True once all
        `world_size` ranks of the run that write into this dir have."""
        folder = self.state / "ranks" / run_id
        folder.mkdir(parents=True, exist_ok=True)
        record = {k: v for k, v in (stats or {}).items() if isinstance(v, (int, float, str, bool))}
        atomic_write(folder / f"{rank:05d}.done", json.dumps({"rank": rank, **record}) + "\n")
        return len(list(folder.glob("*.done"))) >= world_size

    def mark_share_done(self, units: int, of: int) -> None:
        """This dir holds a finished node's share of a job whose nodes each write their own dir: `units` of its `of`
        units. Readers then name `hsx merge` as the next step, not the same `hsx extract` (nothing is left to run)."""
        atomic_write(self.state / "share-done.json", json.dumps({"units": units, "of": of}) + "\n")

    def finished_share(self) -> tuple[int, int] | None:
        """(units, of) when this dir is a node's finished share (`mark_share_done`) and no unit was committed or lost
        since; None otherwise, or when the record is damaged (it only chooses which next step a message names)."""
        try:
            record = json.loads(_read_bounded(self.state / "share-done.json", 256))
            units, of = record["units"], record["of"]
        except (OSError, ValueError, TypeError, KeyError, HsxError):
            return None
        if type(units) is not int or type(of) is not int or not 0 < units < of or units != len(self.done_units()):
            return None
        return units, of

    def rank_stats(self, run_id: str) -> list[dict[str, Any]]:
        """What each rank of run `run_id` recorded when it finished, in rank order."""
        stats = []
        for f in sorted((self.state / "ranks" / run_id).glob("*.done")):
            try:  # (a rank's numbers: a few hundred bytes, well within the rest of a record)
                record = json.loads(_read_bounded(f, RECORD_REST_BYTES) or b"{}")
            except (OSError, ValueError, RecursionError, HsxError):
                continue
            if isinstance(record, dict):
                stats.append(record)
        return stats

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write(self.state / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")

    def read_summary(self) -> Summary | None:
        """.hsx/summary.json (None before planning wrote it); HsxError when it is damaged (see `read_json`)."""
        f = self.state / "summary.json"
        return read_json(f, Summary) if f.exists() else None

    def read_info(self) -> Info | None:
        """hsx.json (None when there is none yet); HsxError when it is damaged (see `read_json`)."""
        f = self.root / "hsx.json"
        return read_json(f, Info) if f.exists() else None

    # ---- units ----

    def manifest_records(self) -> dict[str, dict[str, Any]]:
        """Every committed unit's manifest record (every rank's), by unit name; whether its file is still here
        or not."""
        records = {}
        for manifest in sorted(self.state.glob(MANIFESTS)):
            for rec in read_jsonl(manifest, ManifestRecord):  # a torn line from a kill: that unit is redone
                records[rec["unit"]] = rec
        return records

    def done_units(self) -> dict[str, dict[str, Any]]:
        """Committed units from the manifests (every rank's) whose files exist with the recorded size, or that a
        Hub push recorded as uploaded (in .hsx/uploaded-*.jsonl, with the same size and CRC-32): with
        --delete-after-upload those are gone from disk and must not be redone."""
        uploaded, consumed = self.uploaded(), self.consumed()
        done = {}
        for unit, rec in self.manifest_records().items():
            f = self.data / rec["file"]
            if _size(f) == rec["bytes"]:
                done[unit] = rec
            elif (uploaded_matches(uploaded.get(f"data/{rec['file']}"), rec)
                  or uploaded_matches(consumed.get(rec["file"]), rec)) and not (
                    self.state / "damaged" / rec["file"]).exists():  # (gone after its upload, not moved aside)
                done[unit] = rec
        return done

    def record_run(self, settings: dict[str, Any]) -> None:
        """Append this run's RUN_VARIANT_KEYS values to .hsx/runs-<rank>.jsonl (fsynced, before its first commit):
        its units' manifest lines name its session, so what computed each unit is known after any kill."""
        self.state.mkdir(parents=True, exist_ok=True)
        line = {"session": self.session, **{k: settings[k] for k in RUN_VARIANT_KEYS if k in settings}}
        path = self.state / f"runs-{self.rank:05d}.jsonl"
        append_synced(path, json.dumps(line, sort_keys=True) + "\n")  # (a torn last line is ended first)

    def run_values(self, units: dict[str, dict[str, Any]]) -> dict[str, list]:
        """Every RUN_VARIANT_KEYS value the runs that committed `units` (manifest records, as done_units gives)
        computed with: their records in .hsx/runs-*.jsonl, and for units of an older hsx, which kept none, the
        values hsx.json's run records (the last run's)."""
        return merged_values(*self.run_values_by_rank(units).values())

    def run_values_by_rank(self, units: dict[str, dict[str, Any]]) -> dict[str, dict[str, list]]:
        """`run_values` by whose they are: "rank N" for the records of .hsx/runs-<N>.jsonl (every rank's ledger,
        each read bounded, as read_jsonl reads), "hsx.json" for units of an older hsx; only those with values."""
        sessions = {rec.get("session") for rec in units.values()}
        found: set[str] = set()
        by_rank: dict[str, list[RunRecord]] = {}
        for ledger in sorted(self.state.glob(RUNS)) if units else ():
            runs = [RunRecord.from_dict(rec) for rec in read_jsonl(ledger, RunRecord) if rec["session"] in sessions]
            found |= {r.session for r in runs}
            rank = ledger.name[len("runs-"):-len(".jsonl")]
            by_rank.setdefault(f"rank {int(rank)}" if rank.isdigit() and len(rank) < 10 else ascii(ledger.name),
                               []).extend(runs)
        older = self._recorded_run_values() if sessions - found else []
        whose = {"hsx.json": values_used(older)} if older else {}
        whose.update({k: values_used(runs) for k, runs in by_rank.items()})
        return {k: v for k, v in whose.items() if v}

    def _recorded_run_values(self) -> list[RunRecord]:
        """hsx.json's run values (its values_used, else the last run's) as records; none where it has none."""
        try:
            info = self.read_info()
        except HsxError:
            return []
        run = info.raw.get("run") if info is not None else None
        if not isinstance(run, dict):
            return []
        used = run.get("values_used")
        pairs = ([(k, v) for k, vs in used.items() if k in RUN_VARIANT_KEYS and isinstance(vs, list) for v in vs]
                 if isinstance(used, dict) else [(k, run[k]) for k in RUN_VARIANT_KEYS if k in run])
        try:
            return [RunRecord.from_dict({"session": "", k: v}) for k, v in pairs]
        except Damaged:
            return []

    # ---- upload bookkeeping (hsx.hub) ----

    def uploaded(self) -> dict[str, dict[str, Any]]:
        """What Hub pushes recorded as committed on the Hub, by path in the repo (`data/train-....arrow`): the last
        record of each path over every .hsx/uploaded-*.jsonl (one per rank, and one for `hsx push`)."""
        records: dict[str, dict[str, Any]] = {}
        for ledger in sorted(self.state.glob(UPLOADED)):
            for rec in read_jsonl(ledger, UploadRecord):  # a torn line: uploaded again (a no-op on the Hub)
                records[rec["file"]] = rec
        return records

    def consumed(self) -> dict[str, dict[str, Any]]:
        """The units trainers following the job (hsx.follow) recorded as wholly consumed, by file name: the last
        record of each unit in each .hsx/consumed-*.jsonl whose `row` is its `rows`. Such a unit may be deleted
        (`delete_consumed`) and is still done, as a unit deleted after its upload is."""
        whole: dict[str, dict[str, Any]] = {}
        for ledger in sorted(self.state.glob(CONSUMED)):
            last: dict[str, dict[str, Any]] = {}
            for rec in read_jsonl(ledger, ConsumedRecord):  # a torn line: that progress is read again
                last[rec["file"]] = rec
            whole.update({f: r for f, r in last.items() if r["row"] == r["rows"]})
        return whole

    def record_exported(self, entry: dict[str, Any], dest: str, command: str) -> None:
        """Append to .hsx/exported.jsonl that `entry`'s unit is about to be deleted by `hsx <command> --delete-source`
        into `dest` (fsynced before the deletion), so a reader of this dir is told where its rows went."""
        append_synced(self.state / EXPORTED, json.dumps({"file": entry["file"], "bytes": entry["bytes"],
                                                         "crc32": entry.get("crc32"), "dest": dest,
                                                         "command": command}, sort_keys=True) + "\n")

    def write_exported_card(self, gone: int, total: int, dest: str, command: str) -> None:
        """README.md once an export with --delete-source deletes units (`gone` of `total`): its configs name a file
        that does not exist and says why, as the unfinished card does, so `load_dataset(OUT)` fails naming it
        instead of the first deleted unit, and the text says where the rows went."""
        dest = dest if dest.isprintable() else repr(dest)
        atomic_write(self.root / "README.md", EXPORTED_CARD.format(gone=gone, total=total, dest=dest,
                                                                   command=command))

    def exported(self) -> dict[str, dict[str, Any]]:
        """What .hsx/exported.jsonl says exports deleted, by file name (well-formed lines only: it only explains a
        missing unit, it never makes one count as present)."""
        path = self.state / EXPORTED
        if not path.is_file() or path.is_symlink():
            return {}
        records = {}
        for rec in read_jsonl(path):
            if isinstance(rec.get("file"), str) and isinstance(rec.get("dest"), str) \
                    and isinstance(rec.get("command"), str):
                records[rec["file"]] = rec
        return records

    def used_up(self, entries: list[dict[str, Any]]) -> str | None:
        """The line for a dir an export with --delete-source used up: of `entries` (hsx.json's or the manifests'
        records), those missing here that .hsx/exported.jsonl records with their size and CRC-32, and where their
        rows went. None when there are none (a missing unit is then just missing)."""
        records = self.exported()
        gone = [e["file"] for e in entries
                if not os.path.lexists(self.data / e["file"]) and uploaded_matches(records.get(e["file"]), e)]
        if not gone:
            return None
        rec = records[gone[0]]
        # (what the ledger says is shown as a quoted string: a forged one prints no second line)
        dest = rec["dest"] if rec["dest"].isprintable() else repr(rec["dest"])
        command = rec["command"] if rec["command"].isprintable() else repr(rec["command"])
        return (f"{self.root}: {len(gone)} of its {len(entries)} files were exported and then deleted "
                f"(`hsx {command[:40]} --delete-source` into {dest[:300]}); its rows are there now, in that "
                "trainer's layout, not here")

    def record_uploaded(self, records: list[dict[str, Any]], name: str | None = None) -> None:
        """Append upload records to .hsx/uploaded-<name>.jsonl (default: this rank's) and fsync: called only after
        the Hub confirmed the commit, and before any local file is deleted."""
        if not records:
            return
        self.state.mkdir(parents=True, exist_ok=True)
        name = name or f"{self.rank:05d}"
        append_synced(self.state / f"uploaded-{name}.jsonl", "".join(json.dumps(r, sort_keys=True) + "\n"
                                                                      for r in records))

    def clear_tmp(self, every_rank: bool = False) -> None:
        """Partial units a killed run of this rank (`every_rank`: of any rank) left behind, never committed, so
        never counted. Every rank's once per claim: a resume on fewer ranks would leave the others' behind, and
        --max-pending-gb (hsx.follow.pending_bytes) would count them as pending for ever."""
        folder = self.tmp.parent if every_rank else self.tmp
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)

    def unit_tmp(self, unit: str) -> Path:
        self.tmp.mkdir(parents=True, exist_ok=True)
        return self.unit_tmp_path(unit)

    def unit_tmp_path(self, unit: str) -> Path:
        return self.tmp / f"train-{unit}.arrow"

    def commit(self, unit: str, record: dict[str, Any], crc32: str | None = None) -> None:
        """Make a unit written under .hsx/tmp/ durable and count it. `crc32`: its file_crc32 value, when the writer
        computed it on the way out (hsx.writer); else the file is read back for it."""
        tmp = self.unit_tmp(unit)
        final = self.data / f"train-{unit}.arrow"
        self.data.mkdir(parents=True, exist_ok=True)
        fsync_file(tmp)
        crc = crc32 or file_crc32(tmp)
        os.replace(tmp, final)
        fsync_dir(self.data)
        record = {"unit": unit, "file": final.name, "bytes": final.stat().st_size, "crc32": crc,
                  "session": self.session, **record}
        manifest = self.state / f"manifest-{self.rank:05d}.jsonl"
        # (after a kill mid-append the last line is torn: append_synced ends it, this record starts a line)
        append_synced(manifest, json.dumps(record, sort_keys=True) + "\n")

    def data_files(self) -> list[Path]:
        return sorted(self.data.glob("train-*.arrow"))

    def file_problem(self, entry: dict[str, Any], crc: bool = False) -> str | None:
        """What is wrong with one file hsx.json (or a manifest) lists, None if nothing: 'uploaded' for a unit
        deleted after its upload (--delete-after-upload), 'consumed' for one a trainer consumed and deleted
        (hsx.follow), else a few words. `crc`: read it whole and compare its
        CRC-32 too."""
        f = self.data / entry["file"]
        if not f.exists():
            if uploaded_matches(self.uploaded().get(f"data/{entry['file']}"), entry):
                return "uploaded"
            if uploaded_matches(self.consumed().get(entry["file"]), entry):
                return "consumed"
            return "exported" if uploaded_matches(self.exported().get(entry["file"]), entry) else "missing"
        if f.stat().st_size != entry["bytes"]:
            return f"{f.stat().st_size} bytes, not {entry['bytes']}"
        if crc and entry.get("crc32") and file_crc32(_target(f)) != entry["crc32"]:
            return "its bytes do not match its CRC-32"
        return None

    # ---- checking a finished output before reading or pushing it ----

    def merged_sources(self, add: list[str] | None = None) -> list[str]:
        """The dirs `hsx merge` linked units from into this one (.hsx/merged-from.json), with `add` recorded too:
        a partial merge's links stay readable once the job's `hsx extract` finishes the dir (its hsx.json's
        `run.merged_from` is this list)."""
        path = self.state / "merged-from.json"
        known = read_json(path, limit=RECORD_REST_BYTES).get("dirs") if path.exists() else []  # (a path per dir)
        if not isinstance(known, list) or not all(isinstance(d, str) for d in known):
            raise HsxError(f"{path} is damaged (its `dirs` is not a list of paths); remove it and merge again")
        if add:
            known = [*known, *(d for d in add if d not in known)]
            atomic_write(path, json.dumps({"dirs": known}, indent=2) + "\n")
        return known

    def unit_source(self, name: str, info: Info | None = None, sources: dict | None = None, *,
                    dirs: list[str] | None = None, fingerprint: str | None = None) -> Path:
        """Where to read data/<name> from, checked without following a link: the file itself when it is a regular
        file; for a link as `hsx merge` makes them, the unit it points to, if that is data/<name> of one of the
        dirs hsx.json says were merged (`run.merged_from`), a regular file reached through no further link, in an
        hsx output of the same job whose manifest records it. Anything else (a link elsewhere, a device, a
        folder) is HsxError in one line: hsx reads and pushes no file from outside the output's known dirs.
        `sources`: a dict shared by the calls for one output (each merged dir's manifest is read once). `dirs`,
        `fingerprint`: the merged dirs and the job, for a dir without a finished hsx.json (hsx.follow reading a job
        that `hsx merge --partial` began: .hsx/merged-from.json and .hsx/job.json)."""
        self._check_data_not_a_link()
        p = self.data / name
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            raise HsxError(f"{p} is missing") from None
        if stat.S_ISREG(st.st_mode):
            self.approved[str(p)] = (st.st_dev, st.st_ino)
            return p
        if not stat.S_ISLNK(st.st_mode):
            raise HsxError(f"{p} is not a regular file; an hsx output holds only the files it wrote")
        target = os.path.normpath(os.path.join(os.path.realpath(self.data), os.readlink(p)))
        if dirs is None:
            dirs, fingerprint = merged_from(info), info.fingerprint if info is not None else None
        for src in dirs:
            expected = os.path.join(src, "data", name)
            if target != expected or os.path.realpath(expected) != expected:
                continue
            try:
                st = os.lstat(expected)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if sources is None:
                sources = {}
            if src not in sources:
                sources[src] = _merged_units(Path(src), fingerprint)
            if name in sources[src]:
                self.approved[expected] = (st.st_dev, st.st_ino)
                return Path(expected)
        raise HsxError(f"{p} is a symbolic link, and not one `hsx merge` made to a unit of the dirs it merged; "
                       "hsx reads and pushes no link out of the output: remove it")

    def open_unit(self, path: Path) -> int:
        """A read-only fd of a unit `unit_source` returned, checked to be the very file it approved: the checks are
        made on what is read, so a file swapped for a link (or any other file) after the check is refused."""
        return open_regular(path, self.approved[str(path)])

    def listing_problem(self, info: Info, data_dir: bool = True) -> str | None:
        """What disagrees in a finished output, None if nothing: hsx.json's `files`, its counts, the manifests
        in .hsx/ (where the dir has them: a Hub copy does not) and the files in data/ must tell one story; data/
        may hold no data file the list does not name (datasets' own cache-*.arrow files aside, which nothing
        reads as part of the output; `data_dir=False` leaves data/'s listing out)."""
        listed = listed_files(info)
        counts = info.counts
        try:
            records = {r["file"]: r for r in self.manifest_records().values()} if self.state.is_dir() else {}
        except HsxError as e:
            return str(e)
        if listed is None:  # an older hsx's hsx.json: the manifests are the list (and without them, no list)
            if not records:
                return None
            listed = list(records.values())
        names = [e["file"] for e in listed]
        if len(set(names)) != len(names):
            return "hsx.json's `files` names a file twice"
        raw = info.raw.get("files") if isinstance(info.raw, dict) else None
        if isinstance(raw, list) and all(isinstance(e, dict) and "rows" in e for e in raw):
            rows = sum(e["rows"] for e in listed)
            if rows != counts.rows_written:
                return (f"hsx.json's `files` list {len(listed)} file(s) of {rows:,} rows, its counts say "
                        f"{counts.rows_written:,} rows")
        if records:
            only_listed = sorted(set(names) - set(records))
            only_recorded = sorted(set(records) - set(names))
            if only_listed == [EMPTY_FILE] and counts.rows_written == 0:
                only_listed = []  # the empty data file of a job without rows is in no manifest
            if only_listed or only_recorded:
                name, where = ((only_listed[0], "is listed in hsx.json but in no manifest") if only_listed else
                               (only_recorded[0], "is in the manifests but not listed in hsx.json"))
                return (f"hsx.json lists {len(names)} file(s), the manifests in .hsx/ {len(records)} "
                        f"(data/{name} {where})")
            for e in listed:
                r = records.get(e["file"])
                if r is not None and (r["bytes"], r.get("crc32"), r.get("rows", 0)) != (
                        e["bytes"], e.get("crc32"), e.get("rows", 0)):
                    return f"data/{e['file']}: hsx.json and its manifest record differ (size, CRC-32 or rows)"
            tokens = sum(r.get("tokens", 0) for r in records.values())
            if tokens != counts.tokens_written:
                return f"the manifests count {tokens:,} tokens, hsx.json's counts say {counts.tokens_written:,}"
        unlisted = sorted(set(self.data_file_names()) - set(names)) if data_dir else []
        if unlisted:
            return (f"data/ holds {len(unlisted)} data file(s) hsx.json does not list ({unlisted[0]}"
                    f"{', ...' if len(unlisted) > 1 else ''})")
        return None

    def data_file_names(self) -> list[str]:
        """The names of the data files in data/ (every *.arrow entry, link or not, but datasets' cache files)."""
        try:
            names = os.listdir(self.data)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(n for n in names if n.endswith(".arrow") and not fnmatch.fnmatch(n, DATASETS_CACHE_FILES))

    def _check_data_not_a_link(self) -> None:
        if os.path.islink(self.data):
            raise HsxError(f"{self.data} is a symbolic link; hsx reads and pushes no link out of the output")

    def check_finished(self, info: Info) -> None:
        """HsxError, one line, unless the finished output's list, manifests, counts and data/ agree
        (listing_problem)."""
        self._check_data_not_a_link()
        problem = self.listing_problem(info)
        if problem:
            advice = ("move away the files it does not list" if problem.startswith("data/ holds") else
                      "run the same `hsx extract` command: it writes hsx.json again from the manifests")
            raise HsxError(f"{self.root}: the output does not agree with itself: {problem}; hsx reads and pushes "
                           f"only an output whose hsx.json, manifests and data/ agree ({advice})")

    # ---- finalizing ----

    def finalize(self, info: dict[str, Any], card, features=None) -> None:
        """Write the card and hsx.json (last: `complete` is the commit point of the whole job). `card`: its text,
        or a function of the final `info` (the card's configs list exactly the files hsx.json lists).

        A job with no usable rows committed no unit; it gets one empty data file with the output schema
        (`features`, a datasets.Features; by default the one `info` describes), so `load_dataset(OUT)` and
        `hsx.load` give 0 rows instead of failing."""
        if not self.data_files() and not self.done_units():  # (units uploaded and deleted are not "no unit")
            features = features if features is not None else info_features(info)
            if features is not None:
                f = self.write_empty_data_file(features)
                if "files" in info:
                    info["files"] = [unit_entry({"file": f.name, "bytes": f.stat().st_size,
                                                 "crc32": file_crc32(f)})]
        card = card(info) if callable(card) else card
        # Every rank is done: no partial unit is left. Before hsx.json, so a kill after it leaves nothing behind.
        shutil.rmtree(self.state / "tmp", ignore_errors=True)
        atomic_write(self.root / "README.md", card)
        atomic_write(self.root / "hsx.json", json.dumps(info, indent=2) + "\n")

    def write_empty_data_file(self, features) -> Path:
        """data/train-000-00000.arrow with zero rows and the given schema, written under a temp name and renamed."""
        from datasets.arrow_writer import ArrowWriter

        self.data.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        final = self.data / EMPTY_FILE
        tmp = self.tmp / f"empty-{final.name}"
        writer = ArrowWriter(features=features, path=str(tmp))
        try:
            writer.finalize()
        finally:
            writer.close()
        fsync_file(tmp)
        os.replace(tmp, final)
        fsync_dir(self.data)
        return final


class Committer:
    """Commits units (fsync, rename, manifest) on a background thread: an fsync waits for the disk to take
    gigabytes, and the GPU must not wait with it. Errors (a full disk) surface at the next submit or join."""

    def __init__(self, out: OutputDir, on_commit=None):
        """`on_commit(unit, path)` runs on the commit thread after each unit's manifest line is on disk (hsx.hub's
        StreamUploader.submit: --push-mode stream)."""
        import queue
        import threading

        self.out, self.error, self.on_commit = out, None, on_commit
        self.queue: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.units: set[str] = set()  # submitted, manifest line not yet on disk
        self.thread = threading.Thread(target=self._work, name="hsx-commit", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.error is None:
                try:
                    self.out.commit(*item)
                    with self.lock:
                        self.units.discard(item[0])
                    if self.on_commit is not None:
                        self.on_commit(item[0], self.out.data / f"train-{item[0]}.arrow")
                except BaseException as e:  # noqa: BLE001  (re-raised on the main thread)
                    self.error = e
            self.queue.task_done()
        self.queue.task_done()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def submit(self, unit: str, record: dict[str, Any], crc32: str | None = None) -> None:
        self.check()
        with self.lock:
            self.units.add(unit)
        self.queue.put((unit, record, crc32))

    def in_flight(self) -> list[str]:
        """The units submitted whose manifest line is not on disk yet (a unit that failed to commit stays here)."""
        with self.lock:
            return list(self.units)

    def join(self) -> None:
        self.queue.join()
        self.check()

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()


def uploaded_matches(uploaded: dict[str, Any] | None, rec: dict[str, Any]) -> bool:
    """Whether an upload record is of this manifest record's file: same size, and same CRC-32 where both say."""
    return (uploaded is not None and uploaded.get("bytes") == rec["bytes"]
            and (uploaded.get("crc32") is None or rec.get("crc32") is None or uploaded["crc32"] == rec["crc32"]))


def combine_rank_stats(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One job's throughput from its ranks' own numbers: tokens add up, the job took as long as its slowest rank,
    MFU is against the sum of the ranks' measured matmul rates. Each rank's numbers stay under `ranks`."""
    working = [r for r in ranks if r.get("seconds")]
    if not working:
        return {"ranks": ranks}
    writers = [r for r in working if r.get("writes", True)]  # tensor-parallel followers ran the same batches
    seconds = max(r["seconds"] for r in working)
    run = {"tokens": sum(r.get("tokens", 0) for r in writers),
           "padded_tokens": sum(r.get("padded_tokens", 0) for r in writers),
           "gpu_seconds": sum(r.get("gpu_seconds", 0.0) for r in working), "seconds": seconds,
           "processes": len(working),
           "slowest_over_mean_seconds": seconds / (sum(r["seconds"] for r in working) / len(working))}
    run["tok_per_s"] = run["tokens"] / seconds
    peaks = [r["matmul_tflops"] for r in working if "matmul_tflops" in r]
    if len(peaks) == len(working) and all("flops" in r for r in writers):
        run["flops"] = sum(r["flops"] for r in writers)
        run["mfu"] = run["flops"] / seconds / (sum(peaks) * 1e12)
    for key in ("token_budget", "compile", "sdpa_backend", "packing", "experts_implementation", "fp8_gemm", "device",
                "tp_size", "model_copies", "kernels", "versions"):
        if key in working[0]:
            run[key] = working[0][key]
    run["ranks"] = ranks
    return run


def complete_info(summary: dict[str, Any], done: dict[str, dict[str, Any]], world_size: int,
                  run: dict[str, Any] | None = None) -> dict[str, Any]:
    """hsx.json of a finished job: the summary written at planning time plus what the manifests record."""
    info = {k: v for k, v in summary.items() if k not in ("unit_names", "command")}
    counts = dict(summary["counts"])
    extra = {"oom": sum(r.get("skipped_oom", 0) for r in done.values()),
             "nonfinite": sum(r.get("skipped_nonfinite", 0) for r in done.values())}
    skipped = dict(counts["skipped"])
    for reason, n in extra.items():
        if n:
            skipped[reason] = skipped.get(reason, 0) + n
    info["counts"] = {
        "rows_in": counts["rows_in"],
        "rows_written": sum(r["rows"] for r in done.values()),
        "tokens_written": sum(r["tokens"] for r in done.values()),
        "truncated": counts["truncated"],
        "skipped": dict(sorted(skipped.items())),
        "nonfinite": {"mode": summary["config"].get("nonfinite", "skip"),
                      "rows": sum(r.get("skipped_nonfinite", 0) + r.get("nonfinite_kept", 0) for r in done.values())},
    }
    info.update(units=len(summary["unit_names"]), world_size=world_size, run=run or {}, complete=True,
                files=[unit_entry(done[u]) for u in summary["unit_names"] if u in done])
    return info


def listed_files(info: Info | None) -> list[dict[str, Any]] | None:
    """hsx.json's `files` as dicts (None without hsx.json, or for an older hsx's, which lists none); each entry
    was checked when hsx.json was read (hsx.schema.FileEntry: a plain name inside data/, a size, a CRC-32)."""
    return None if info is None or info.files is None else [e.to_dict() for e in info.files]


def merged_from(info: Info | None) -> list[str]:
    """The dirs `hsx merge` joined into this output, as its hsx.json records them (absolute, resolved paths)."""
    run = info.raw.get("run") if info is not None and isinstance(info.raw, dict) else None
    dirs = run.get("merged_from") if isinstance(run, dict) else None
    if not isinstance(dirs, list):
        return []
    return [os.path.normpath(d) for d in dirs if isinstance(d, str) and os.path.isabs(d)]


def _merged_units(src: Path, fingerprint: str | None) -> set[str]:
    """The unit files a merged dir's manifests record, if it is an hsx output of the job `fingerprint` (its
    .hsx/ and job.json reached through no link); else none."""
    state = src / ".hsx"
    try:
        if not stat.S_ISDIR(os.lstat(state).st_mode) or not stat.S_ISREG(os.lstat(state / "job.json").st_mode):
            return set()
        if fingerprint is None or read_json(state / "job.json", JobRecord).fingerprint != fingerprint:
            return set()
        return {r["file"] for r in OutputDir(src).manifest_records().values()}
    except (OSError, HsxError):
        return set()


def unit_entry(rec: dict[str, Any]) -> dict[str, Any]:
    """What hsx.json says of one file of the output: readers check names and sizes (and CRCs) against it."""
    return FileEntry(rec["file"], rec["bytes"], rec.get("crc32"), rec.get("unit"), rec.get("rows", 0)).to_dict()


def job_fingerprint(inputs: dict[str, Any], given: dict[str, Any] | None = None) -> dict[str, Any]:
    """The job's identity: a hash of `inputs` (local files by content: hsx.fingerprint). `given` (how the inputs
    were named on the command line) is kept beside it for messages, outside the hash."""
    blob = json.dumps(inputs, sort_keys=True, default=str).encode()
    return {"fingerprint": hashlib.sha256(blob).hexdigest()[:32], "inputs": inputs, "given": given or {}}


def describe_difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What differs between two jobs' inputs, naming the files whose bytes differ for local inputs."""
    a, b = old.get("inputs", {}), new.get("inputs", {})
    parts = []
    for key in sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            sub = sorted(k for k in set(x) | set(y) if k != "files" and x.get(k) != y.get(k))
            files = differing_files(x, y)
            what = sub + ([f"file{'s' if len(files) > 1 else ''} {', '.join(files[:3])}"
                           + (", ..." if len(files) > 3 else "")] if files else [])
            parts.append(f"{key}: {'; '.join(what)}")
        else:
            parts.append(key)
    return ", ".join(parts) or "version"


def _target(path: Path) -> Path:
    """The file a unit's name leads to: itself, or what `hsx merge`'s link points to (file_crc32 follows none)."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def _size(path: Path) -> int | None:
    """A file's size, None when there is none (a unit may be deleted by a trainer at any moment: hsx.follow)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _open_no_follow(path: Path, flags: int) -> int:
    """os.open of the regular file at `path` (created with O_CREAT) for hsx to write or lock: never a link's
    target (HsxError, where the link would be written through), and never a FIFO or a device planted at one of
    its names (opened without waiting: a FIFO with no reader would block the write for ever)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise HsxError(f"{path} is a symbolic link; hsx never writes through links") from None
        if e.errno == errno.ENXIO:  # a FIFO that no process reads
            raise HsxError(f"{path} is not a regular file; hsx writes only regular files there") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise HsxError(f"{path} is not a regular file; hsx writes only regular files there")
    return fd


@contextmanager
def _flock(path: Path, how: int, busy: str) -> Iterator[None]:
    """flock(2) `how` (LOCK_EX or LOCK_SH) on `path`, or HsxError(`busy`) at once if another process holds it.
    The kernel releases it when the process dies; the file stays (empty, never read), so a resume finds no stale
    lock. Not the `filelock` package: its FileLock is exclusive only, and every rank of a job holds .hsx/busy
    SHARED while `hsx merge` takes it exclusive; its ReadWriteLock is an SQLite database (journal files beside
    it); and filelock before 3.20.1 opened the lock file with O_TRUNC and without O_NOFOLLOW, truncating a link's
    target (CVE-2025-68146), where this opens it with O_NOFOLLOW and never truncates."""
    fd = _open_no_follow(path, os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
        except BlockingIOError:
            raise HsxError(busy) from None
        yield
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str, flags: int) -> None:
    """Write `text` to `path` (never to a link's target) and fsync it."""
    fd = _open_no_follow(path, os.O_WRONLY | os.O_CREAT | flags)
    try:
        _write_all(fd, text)
    finally:
        os.close(fd)


def _write_all(fd: int, text: str) -> None:
    view = memoryview(text.encode())
    while view:
        view = view[os.write(fd, view):]
    os.fsync(fd)


def append_synced(path: Path, text: str) -> None:
    """Append `text` (whole lines) to ledger `path`, fsynced. A last line left torn (a kill, or a full disk or size
    limit mid-append) is ended first: `text` would otherwise join it, and readers pass over the joined line, so the
    record appended after the fault would be lost (a consumer's progress, an upload, a committed unit)."""
    fd = _open_no_follow(path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            text = "\n" + text
        _write_all(fd, text)
    finally:
        os.close(fd)


def atomic_tmp_name(name: str) -> str:
    """The temporary name `atomic_write` writes `name` under (a failed write leaves it: hsx's own, never foreign)."""
    return f".{name}.tmp"


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(atomic_tmp_name(path.name))
    if tmp.is_symlink() or (os.path.lexists(tmp) and not tmp.is_dir() and not tmp.is_file()):
        tmp.unlink()  # hsx's own temporary name: a link there goes (the link, never its target), and a FIFO
    _write_synced(tmp, text, os.O_TRUNC)
    os.replace(tmp, path)
    fsync_dir(path.parent)


CRC_CHUNK = 256 << 20


def _crc32_function():
    """zlib's CRC-32, computed by zlib-ng where it is installed (the `gpu` extra): the same values, with carry-less
    multiply instructions, about twice zlib's rate per core; in tmpfs the checksum is the largest part of the
    writer's work (docs/storage.md)."""
    try:
        from zlib_ng import zlib_ng

        return zlib_ng.crc32, "zlib-ng"
    except ImportError:
        import zlib

        return zlib.crc32, "zlib"


crc32, CRC32_LIBRARY = _crc32_function()  # crc32(data, value=0) -> int, like zlib.crc32; both release the GIL


def open_regular(path: Path, expect: tuple[int, int] | None = None) -> int:
    """A read-only fd of the regular file at `path`: opened without following a link (O_NOFOLLOW) and without
    waiting on a FIFO (O_NONBLOCK), then checked by fstat to be a regular file and, with `expect` (the (st_dev,
    st_ino) an earlier lstat approved), that very file. So a file swapped between the check and the open (a link
    to a file outside the output, another file) is refused, never read. FileNotFoundError passes through."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise HsxError(f"{path} is a symbolic link; hsx reads and pushes no link's target") from None
        if isinstance(e, FileNotFoundError):
            raise
        raise HsxError(f"cannot open {path}: {e.strerror or e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) and expect is None:
        os.close(fd)
        raise HsxError(f"{path} is not a regular file; hsx reads and pushes only the regular files it wrote")
    if not stat.S_ISREG(st.st_mode) or (expect is not None and (st.st_dev, st.st_ino) != tuple(expect)):
        os.close(fd)
        raise HsxError(f"{path} is not the regular file hsx checked (it was replaced while being read); hsx reads "
                       "and pushes only the files it checked")
    return fd


def still_the_file(path: Path, fd: int) -> None:
    """HsxError unless `path` still leads, through no link, to the regular file open as `fd`: called after a
    library has opened the file again by name (datasets maps by path), so a swap in between is refused."""
    st = os.fstat(fd)
    try:
        os.close(open_regular(path, (st.st_dev, st.st_ino)))
    except (HsxError, OSError):
        raise HsxError(f"{path} changed while it was being opened (it is no longer the file hsx checked); hsx "
                       "reads only the files it checked") from None


def file_crc32(path: Path, fd: int | None = None) -> str:
    """CRC-32 of each 256 MiB chunk of a file, ":"-joined, computed by a few threads (`crc32` releases the GIL).
    The file is opened once (`open_regular`: no link followed) and every chunk read from that fd (`fd`: one the
    caller opened, so what it checks is what it then reads), never re-opened by name between chunks.

    One thread manages ~1-2 GB/s with zlib, slower than an H200 writes an 8B model's states (1.6 GB/s): measured
    there, a single-threaded checksum fell behind the writer and added 6.4 s to a 9 s run."""
    from concurrent.futures import ThreadPoolExecutor

    own = fd is None
    if own:
        fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size

        def chunk_crc(i: int) -> str:
            crc, buf = 0, bytearray(16 << 20)
            view = memoryview(buf)
            at, end = i * CRC_CHUNK, min((i + 1) * CRC_CHUNK, size)
            while at < end:
                k = os.preadv(fd, [view[: min(len(buf), end - at)]], at)
                if not k:
                    break
                crc = crc32(view[:k], crc)
                at += k
            return f"{crc:08x}"

        chunks = max(1, -(-size // CRC_CHUNK))
        with ThreadPoolExecutor(max_workers=min(8, chunks, os.cpu_count() or 1)) as pool:
            return ":".join(pool.map(chunk_crc, range(chunks)))
    finally:
        if own:
            os.close(fd)


def fsync_file(path: Path) -> None:
    """fsync a file's data, or a directory's entries (a rename is durable only after its directory's fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_file




def output_bytes(info: dict[str, Any]) -> int:
    """The states' size: tokens x the state bytes per token (fp8's scales in, top-k columns out; hsx.schema)."""
    fmt = OutputFormat(len(info["layers"]), info["hidden_size"], bool(info.get("final_hidden")),
                       info.get("storage_dtype", DEFAULT_STORAGE_DTYPE))
    return int(info["counts"]["tokens_written"]) * fmt.bytes_per_token


UNFINISHED = "data/NOT-FINISHED-run-the-same-hsx-extract-command-to-finish.arrow"
USED_UP = "data/EXPORTED-and-deleted-the-rows-are-in-the-export-see-README.md.arrow"
EXPORTED_CARD = f"""---
configs:
- config_name: default
  data_files:
  - split: train
    path: {USED_UP}
---

# An hsx output used up by an export

{{gone}} of the {{total}} files of this output were exported by `hsx {{command}} --delete-source` into `{{dest}}` and
then deleted: the rows are there now, in that trainer's layout, not here. hsx.json still describes the job;
`hsx.load(OUT, allow_incomplete=True)` reads the files left, if any.
"""
UNFINISHED_CARD = f"""---
configs:
- config_name: default
  data_files:
  - split: train
    path: {UNFINISHED}
---

# An unfinished hsx job

This dir holds part of an hsx output: the job is running, or was interrupted. Run the same `hsx extract` command
to finish it (`hsx.load(OUT, allow_incomplete=True)` reads the units committed so far).
"""

