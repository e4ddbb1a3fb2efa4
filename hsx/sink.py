"""The output dir: Arrow shards under data/, hsx's run state under .hsx/, hsx.json and a dataset card. `OutputDir`
starts a job in a dir (or resumes it), commits the job's units and finalizes it; what each record file holds is
read and written by hsx.ledgers, hsx.json by hsx.info, each file through hsx.files.

This is the one drawing of the dir (README.md links here; tests/test_sink.py compares it with what an extraction
writes). `<name>` stands for a part of a name; a path ending in `?` is there only in some states (`hsx vocab`, a
running or killed job, several ranks or nodes, a push, a trainer following the job, an export, a merge, a resume),
every other one in every finished extraction's dir.

    OUT/data/train-<bucket>-<chunk>.arrow       Arrow IPC stream files, one per unit (what datasets writes:
                                                `Dataset.from_file` memory-maps them, `load_dataset(OUT)` reads them);
                                                `hsx merge` may make them links to the units of the dirs it joined
    OUT/README.md                               dataset card (hsx.card): YAML `configs` naming the data files
                                                (a placeholder naming a file that does not exist until finalized)
    OUT/hsx.json                                model, revision, layers, convention, counts, config, run stats,
                                                and `files`: each unit's name, rows, bytes and CRC-32; `complete`
                                                once finalized (hsx.info)
    OUT/token_frequencies.npy                   supervised-token counts per token id, the draft vocabulary's input
                                                (hsx.vocab)
    OUT/vocab_mapping-<K>.pt?                   `hsx vocab OUT`'s draft vocabularies (hsx.vocab): SpecForge's,
    OUT/d2t-<K>.npy?                            and speculators' pair
    OUT/t2d-<K>.npy?
    OUT/.hsx/job.json                           the fingerprint of what decides the output (hsx.fingerprint)
    OUT/.hsx/summary.json                       the plan: units, counts, config; hsx.json is built from it
    OUT/.hsx/tokenized/tokens.arrow             the tokenized rows, cached for a resume
    OUT/.hsx/lock                               flock(2)ed by a running job (empty, never read); `lock-<rank>`
                                                by ranks past the first
    OUT/.hsx/lock-<rank>?
    OUT/.hsx/busy                               flock(2)ed shared by every rank, exclusive by `hsx merge`
    OUT/.hsx/finalize.lock                      flock(2)ed by each rank as it finalizes, one at a time
    OUT/.hsx/manifest-<rank>.jsonl              one line per committed unit: rows, tokens, bytes, CRC-32, session
                                                (one file per rank; datasets ignores dot-folders) (hsx.ledgers)
    OUT/.hsx/runs-<rank>.jsonl                  what each run of a rank computed the states with (hsx.ledgers)
    OUT/.hsx/tmp/rank-<rank>/?                  units being written, renamed into data/ once whole; gone once
                                                finalized
    OUT/.hsx/ranks/<run>/<rank>.here?           which ranks of a run write here, and which finished (their
    OUT/.hsx/ranks/<run>/<rank>.done?           throughput numbers): a run of several processes
    OUT/.hsx/share-done.json?                   a node's finished share of a job whose nodes write their own dirs
    OUT/.hsx/uploaded-<rank>.jsonl?             one line per file a Hub push committed (hsx.hub; `uploaded-push`
                                                for `hsx push`); a unit deleted after upload (--delete-after-upload)
                                                still counts as done
    OUT/.hsx/uploaded-push.jsonl?
    OUT/.hsx/consumed-<consumer>-<rank>.jsonl?  one line per unit a trainer reading the running job (hsx.follow)
                                                consumed, whole or up to a row; a wholly consumed unit it deleted
                                                still counts as done
    OUT/.hsx/holding-<consumer>-<rank>.json?    the units such a trainer holds in a step not yet returned while it
                                                waits for a unit (hsx.ledgers.held_files)
    OUT/.hsx/consumers.json?                    the consumers the output serves, declared and retired: a unit is
                                                deleted once every declared one consumed it (hsx.ledgers.released)
    OUT/.hsx/consumers.lock?                    flock(2)ed while consumers.json is rewritten
    OUT/.hsx/consumer-<consumer>-<rank>.lock?   flock(2)ed by the live local reader that deletes for that
                                                consumer rank (hsx.follow.LocalSource.take_consumer)
    OUT/.hsx/exported.jsonl?                    one line per unit an export with --delete-source deleted, and where
                                                its rows went (hsx.export), so a reader says so
    OUT/.hsx/merged-from.json?                  the dirs `hsx merge` linked units from (hsx.merge)
    OUT/.hsx/manifest-merged.jsonl?             the merged dirs' manifest records, as one manifest (hsx.merge)
    OUT/.hsx/damaged/?                          units a resume found damaged (wrong CRC-32), moved aside and redone

Every JSON file and ledger line here is read through its typed, checked record in hsx.schema (Info, Summary,
JobRecord, ManifestRecord, UploadRecord, ...): a damaged one is one line naming the file.

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

import fcntl
import fnmatch
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from hsx import ledgers
from hsx.checksums import file_crc32
from hsx.errors import HsxError
from hsx.files import atomic_write, flock, fsync_dir, fsync_file, link_target, open_no_follow, open_regular
from hsx.fingerprint import JOB_FILE, describe_difference, recorded_job, same_job, write_job
from hsx.info import info_features, listed_files, merged_from, recorded_info, read_summary, unit_entry, write_info
from hsx.schema import Info

EMPTY_FILE = "train-000-00000.arrow"  # the one data file of a job without usable rows (OutputDir.finalize)
# What datasets writes next to a memory-mapped file for a cache-writing op (sort, map, filter, shuffle): an older
# hsx.load left them in data/; never part of the output, never read as it
DATASETS_CACHE_FILES = "cache-*.arrow"


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

    # ---- starting (or resuming) a job in a dir ----

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
        with flock(self.state / name, fcntl.LOCK_EX, in_use), flock(self.state / "busy", fcntl.LOCK_SH, merging), \
                ExitStack() as self._held:
            yield

    def lock_as_first(self) -> None:
        """Inside `locked()`: also hold .hsx/lock, as rank 0 does in its dir, for the first rank writing into a dir
        rank 0 does not write into (a node's own dir), so no other job starts there while this one runs."""
        self._held.enter_context(flock(self.state / "lock", fcntl.LOCK_EX,
                                        f"{self.root} is in use by another hsx job (lock held on .hsx/lock)"))

    @contextmanager
    def locked_whole(self, what: str = "hsx merge") -> Iterator[None]:
        """The whole dir for one process (`hsx merge`): every rank of a running job holds .hsx/busy shared, so
        this exclusive lock is refused while any of them runs (and no job starts while it is held)."""
        self.check_not_foreign()
        self.check_no_links()
        self._make_state()
        running = f"{self.root} is in use by a running hsx job; {what} once it has finished"
        with flock(self.state / "lock", fcntl.LOCK_EX, running), flock(self.state / "busy", fcntl.LOCK_EX, running):
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
            return bool(ledgers.manifest_records(self.state))
        except HsxError:
            return True

    def start_or_resume(self, job: dict[str, Any], overwrite: bool, check_crc: bool = False, log=print,
                        check: bool = True) -> str:
        """Record the job's fingerprint, or check it against the one there. Returns 'new', 'resume' or 'complete'.

        A dir whose job failed before committing anything (a --strict error, a missing chat template, ...) holds
        no output, so it is taken for whatever job comes next instead of refused as a different job.

        The same job: the units it keeps are checked (check_units): the size of every one, the CRC-32 of the
        units of the run that wrote last (all of them with `check_crc`). A finished dir with a damaged or missing
        unit is not 'complete': it is marked unfinished and resumed, redoing those units."""
        job_file = self.state / JOB_FILE
        if overwrite:
            self.clear()
        elif not job_file.exists() and self.root.exists() and any(
                p.name not in (".hsx",) for p in self.root.iterdir()):
            raise HsxError(f"{self.root} is not empty and was not written by hsx; choose another --output-dir")
        old = recorded_job(self.state) if job_file.exists() else None
        if old is not None:
            if same_job(old, job["fingerprint"]):
                if check:  # (the dir's first process, before any rank of this run writes: hsx.job starts in turns)
                    self.clear_tmp(every_rank=True)
                return self._resume_state(check_crc, log, check)
            if self.has_output():
                raise HsxError(f"{self.root} holds a different job (differs in: {describe_difference(old.to_dict(), job)}); "
                               "use another --output-dir, or --overwrite to delete it and start over")
            self.clear()  # a job that failed before committing anything: drop its job.json, tokenized cache, tmp
        self.state.mkdir(parents=True, exist_ok=True)
        write_job(self.state, job)
        if check:
            self.write_unfinished_card()
        return "new"

    def remove_if_unused(self, keep_root: bool = False) -> None:
        """Remove .hsx/ (and the dir, unless `keep_root` or something else is in it) when no job committed
        anything here."""
        if self.has_output() or not self.root.is_dir():
            return
        card = self.root / "README.md"  # the placeholder card a start writes (write_unfinished_card), nothing else
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
        info = recorded_info(self.root)
        complete = info is not None and info.complete
        damaged = self.check_units(check_crc) if check else []
        summary = read_summary(self.state)
        expected = ((summary.unit_names if summary else [])
                    or [e.unit for e in (info.files if info else None) or () if e.unit])
        done = ledgers.done_units(self.state, self.data)
        missing = [u for u in expected if u not in done]
        if complete and not (damaged or missing):
            problem = self.listing_problem(info, data_dir=False) if check else None
            if problem is None:
                return "complete"
            log(f"hsx: {self.root}: {problem}; hsx.json is written again from the manifests")
        # committed once (damaged ones too), now gone
        lost = [u for u in missing if u in ledgers.manifest_records(self.state)]
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
            write_info(self.root, info.unfinished().to_dict())
        if check and (complete or not (self.root / "README.md").exists()):
            self.write_unfinished_card()
        return "resume"

    def _remove_uncommitted(self, units: list[str], log) -> None:
        """A unit of the plan in data/ with no manifest line: a run was killed between its rename and its manifest
        line (or mid-line). Its rows are redone and the redo replaces the file; until then no reader may take it
        for output and no `--max-pending-gb` window may wait for a trainer to consume it, so it goes now. Files
        that are not units of this job's plan are left alone, and so is anything but a regular file
        (`remove_data_files`: never through a link)."""
        records = ledgers.manifest_records(self.state)
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
        check = set(ledgers.manifest_records(self.state)) if all_crc else ledgers.last_session_units(self.state)
        damaged = []
        for unit, rec in ledgers.manifest_records(self.state).items():
            f = self.data / rec["file"]
            try:
                if unit not in check or not f.exists() or f.stat().st_size != rec["bytes"] or "crc32" not in rec:
                    continue
                crc = file_crc32(link_target(f))
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
        fd = open_no_follow(self.state / "finalize.lock", os.O_RDWR | os.O_CREAT)  # (a link: refused)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            info = recorded_info(self.root)
            yield info is not None and info.complete
        finally:
            os.close(fd)

    def write_exported_card(self, gone: int, total: int, dest: str, command: str) -> None:
        """README.md once an export with --delete-source deletes units (`gone` of `total`): its configs name a file
        that does not exist and says why, as the unfinished card does, so `load_dataset(OUT)` fails naming it
        instead of the first deleted unit, and the text says where the rows went."""
        dest = dest if dest.isprintable() else repr(dest)
        atomic_write(self.root / "README.md", EXPORTED_CARD.format(gone=gone, total=total, dest=dest,
                                                                   command=command))

    # ---- units ----

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
        ledgers.append_manifest(self.state, self.rank, {"unit": unit, "file": final.name, "bytes": final.stat().st_size,
                                                        "crc32": crc, "session": self.session, **record})

    def data_files(self) -> list[Path]:
        return sorted(self.data.glob("train-*.arrow"))

    def file_problem(self, entry: dict[str, Any], crc: bool = False) -> str | None:
        """What is wrong with one file hsx.json (or a manifest) lists, None if nothing: 'uploaded' for a unit
        deleted after its upload (--delete-after-upload), 'consumed' for one a trainer consumed and deleted
        (hsx.follow), 'exported' for one an export deleted, 'missing', else a few words. `crc`: read it whole and
        compare its CRC-32 too."""
        f = self.data / entry["file"]
        if not f.exists():
            return ledgers.gone_file(self.state, entry)
        if f.stat().st_size != entry["bytes"]:
            return f"{f.stat().st_size} bytes, not {entry['bytes']}"
        if crc and entry.get("crc32") and file_crc32(link_target(f)) != entry["crc32"]:
            return "its bytes do not match its CRC-32"
        return None

    # ---- checking a finished output before reading or pushing it ----

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
            records = ({r["file"]: r for r in ledgers.manifest_records(self.state).values()} if self.state.is_dir()
                       else {})
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
        # (units uploaded and deleted are not "no unit")
        if not self.data_files() and not ledgers.done_units(self.state, self.data):
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
        write_info(self.root, info)

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


def _merged_units(src: Path, fingerprint: str | None) -> set[str]:
    """The unit files a merged dir's manifests record, if it is an hsx output of the job `fingerprint` (its
    .hsx/ and job.json reached through no link); else none."""
    state = src / ".hsx"
    try:
        if not stat.S_ISDIR(os.lstat(state).st_mode) or not stat.S_ISREG(os.lstat(state / "job.json").st_mode):
            return set()
        if not same_job(recorded_job(state), fingerprint):
            return set()
        return {r["file"] for r in ledgers.manifest_records(state).values()}
    except (OSError, HsxError):
        return set()


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

