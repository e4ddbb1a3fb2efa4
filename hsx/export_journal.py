"""An export's DEST as a durable copy that holds only what it can prove it wrote (hsx.export's two layouts write
through it). DEST/hsx-export.json (RECORD, written first, durably) names the source and the export's options and
a token; DEST/hsx-export.jsonl (JOURNAL), appended and fsynced once per committed batch, lists each file written
(path, bytes, CRC-32 of the bytes written) before the file gets its name; each file is written as
.hsx-<token>-<name>, fsynced, then renamed. So a resume verifies and keeps the recorded files, removes its own
temporary files and writes the rest; anything else in DEST (a file or link not in the record) is refused, never
deleted; `overwrite` deletes only what the record proves; a source file released (deleted once its copies are
durable) is journaled first."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx.checksums import CRC_CHUNK, crc32, file_crc32
from hsx.files import append_synced, atomic_tmp_name, atomic_write, fsync_dir, fsync_file, read_json, read_jsonl
from hsx.schema import MAX_INFO_BYTES, MAX_JOURNAL_BYTES, MAX_JOURNAL_LINE_BYTES, Damaged

RECORD = "hsx-export.json"
JOURNAL = "hsx-export.jsonl"
LOCK = "hsx-export.lock"
RECORD_VERSION = 1
_TOKEN = re.compile(r"[0-9a-f]{12}")
RECORDED_PATH = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*(/[A-Za-z0-9_-][A-Za-z0-9_.-]*)?")  # no dot files, no ..


def _crc(data) -> str:
    """CRC-32 of bytes in hsx.checksums.file_crc32's form (one per 256 MiB chunk), so a file is checked by re-reading."""
    view = memoryview(data).cast("B")
    return ":".join(f"{crc32(view[i:i + CRC_CHUNK]):08x}" for i in range(0, max(len(view), 1), CRC_CHUNK))


@dataclass
class Dest:
    root: Path
    token: str
    files: dict[str, list]  # relative path -> [bytes, crc32] of each file this export wrote (verified)
    released: set[str] = field(default_factory=set)  # source units deleted after their files were durable
    skipped: dict[str, int] = field(default_factory=dict)  # unit -> rows left out
    parts: dict[str, list[str]] = field(default_factory=dict)  # "dataset" -> its files
    staged: dict[str, tuple[Path, int, str]] = field(default_factory=dict)

    def temp(self, rel: str) -> Path:
        path = self.root / rel
        return path.with_name(f".hsx-{self.token}-{path.name}")

    def stage(self, rel: str, data) -> None:
        """Write one file under its temporary name; commit() makes it durable and gives it its name."""
        tmp = self.temp(rel)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        # 0o666: the umask decides, as for any file the user writes; O_NOFOLLOW: never through a link
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666)
        try:
            view = memoryview(data).cast("B")
            size = len(view)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        self.staged[rel] = (tmp, size, _crc(data))

    def stage_file(self, rel: str, path: Path) -> None:
        self.staged[rel] = (path, path.stat().st_size, file_crc32(path))

    def commit(self, unit: str | None = None, skipped: int = 0, part: str | None = None) -> None:
        """Record the staged files (fsynced), then give them their names: a kill before the record leaves only
        temporary files (removed on resume), after it whole files the record proves."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:  # fsyncs of many small files overlap on the device
            list(pool.map(fsync_file, [tmp for tmp, _, _ in self.staged.values()]))
        files = {rel: [n, crc] for rel, (_, n, crc) in self.staged.items()}
        line = {"token": self.token, "unit": unit, "part": part, "skipped": skipped, "files": files}
        append_synced(self.root / JOURNAL, json.dumps(line) + "\n")
        for rel, (tmp, _, _) in self.staged.items():
            os.replace(tmp, self.root / rel)
        for folder in {(self.root / rel).parent for rel in self.staged}:
            fsync_dir(folder)
        self.files.update(files)
        if unit is not None:
            self.skipped[unit] = skipped
        if part is not None:
            self.parts[part] = sorted(files)
        self.staged.clear()

    def release(self, unit: Path, note: Callable[[], None]) -> None:
        """Delete a source file whose copies are committed: recorded first in the journal (so a resume passes it
        over), then `note()` (where the source records it: hsx.export, the output's .hsx/exported.jsonl), then
        deleted."""
        append_synced(self.root / JOURNAL, json.dumps({"token": self.token, "released": unit.name}) + "\n")
        note()
        unit.unlink()
        fsync_dir(unit.parent)
        self.released.add(unit.name)


def _not_written_here(dest: Path, rel: str, why: str = "") -> ValueError:
    return ValueError(f"{dest}: {rel} was not written by this export{why} (it is not in {RECORD}); hsx exports "
                      "into an empty folder or its own export only: move it away or choose another folder")


def _read_record(dest: Path) -> dict[str, Any] | None:
    path = dest / RECORD
    if not os.path.lexists(path):
        return None
    if path.is_symlink() or not path.is_file():
        raise _not_written_here(dest, RECORD, " (a link or not a file)")
    record = read_json(path, limit=MAX_INFO_BYTES)  # (it lists the source's units, as its hsx.json does)
    if record.get("version") != RECORD_VERSION or not isinstance(record.get("token"), str) \
            or not _TOKEN.fullmatch(record["token"]):
        raise ValueError(f"{path} is not an hsx export record (damaged, or another program's): move it away or "
                         "choose another folder")
    return record


@dataclass(frozen=True)
class _JournalLine:
    """read_jsonl's check of a journal line of the export `token` (another token's lines are passed over)."""
    token: str

    def from_dict(self, line: dict[str, Any]) -> None:
        if line.get("token") != self.token:
            return
        files = line.get("files", {})
        if not (isinstance(files, dict) and all(
                isinstance(rel, str) and RECORDED_PATH.fullmatch(rel) and isinstance(v, list) and len(v) == 2
                and type(v[0]) is int and isinstance(v[1], str) for rel, v in files.items())
                and isinstance(line.get("released", ""), str) and isinstance(line.get("unit") or "", str)
                and isinstance(line.get("part") or "", str) and type(line.get("skipped", 0)) is int):
            raise Damaged("not an hsx export record (move it away or choose another folder)")


def _read_journal(dest: Path, token: str) -> Dest:
    """What the record's journal says was written (its own token's lines; a torn last line is passed over: its
    files never got their names). Read a line at a time (hsx.schema bounds the file and its lines)."""
    d = Dest(dest, token, {})
    path = dest / JOURNAL
    if not os.path.lexists(path):
        return d
    if path.is_symlink() or not path.is_file():
        raise _not_written_here(dest, JOURNAL, " (a link or not a file)")
    for line in read_jsonl(path, _JournalLine(token), limit=MAX_JOURNAL_BYTES, line_limit=MAX_JOURNAL_LINE_BYTES):
        if line.get("token") != token:
            continue
        files = line.get("files", {})
        d.files.update(files)
        if line.get("released"):
            d.released.add(line["released"])
        if line.get("unit"):
            d.skipped[line["unit"]] = line.get("skipped", 0)
        if line.get("part"):
            d.parts[line["part"]] = sorted(files)
    return d


def _scan(dest: Path, recorded: dict[str, list], token: str | None, dirs: re.Pattern) -> tuple[list[str], list[Path]]:
    """(foreign paths, this record's temporary files) in DEST; os.walk never follows links, and a link anywhere
    is foreign."""
    foreign, temps = [], []
    prefix = f".hsx-{token}-" if token else None
    for folder, subdirs, names in os.walk(dest):
        here = Path(folder)
        top = here == dest
        keep = []
        for name in sorted(subdirs + names):
            p = here / name
            rel = p.relative_to(dest).as_posix()
            if p.is_symlink():
                foreign.append(rel)
            elif (prefix and name.startswith(prefix)) or (top and name == atomic_tmp_name(RECORD) and name in names):
                temps.append(p)  # (the record's own temporary file: its write failed, a full disk say)
            elif name in subdirs:
                (keep.append(name) if top and dirs.fullmatch(name) else foreign.append(rel))
            elif not (rel in recorded or (top and name in (RECORD, JOURNAL, LOCK))):
                foreign.append(rel)
        subdirs[:] = keep
    return sorted(foreign), temps


def _check_recorded(d: Dest) -> dict[str, list]:
    """The recorded files still there, each checked to be the file written (a regular file, bytes, CRC-32); a
    recorded path holding anything else is refused, never replaced or deleted."""
    present = {}
    for rel, (size, crc) in sorted(d.files.items()):
        p = d.root / rel
        if not os.path.lexists(p):
            continue
        if p.is_symlink() or not p.is_file() or p.stat().st_size != size or file_crc32(p) != crc:
            raise ValueError(f"{d.root}: {rel} is not the file this export wrote (its bytes differ from {JOURNAL}'s "
                             "record); move it away, or delete it to have it written again")
        present[rel] = [size, crc]
    return present


def _difference(record: dict[str, Any], want: dict[str, Any]) -> str:
    if record.get("source", {}).get("fingerprint") != want["source"]["fingerprint"]:
        return "another job's output"
    if record.get("source") != want["source"]:
        return "another output of this job"
    opts, theirs = want["options"], record.get("options") or {}
    return ", ".join(k for k in sorted(set(opts) | set(theirs)) if opts.get(k) != theirs.get(k)) or "options"


def open_dest(dest: Path, identity: dict[str, Any], source_path: str, options: dict[str, Any], overwrite: bool,
              dirs: re.Pattern) -> Dest:
    """DEST ready for this export (called with DEST's lock held): a new record in an empty folder, the record's
    verified files on a resume, or (overwrite) the files the record proves hsx wrote deleted first."""
    want = {"source": identity, "options": options}
    record = _read_record(dest)
    d = _read_journal(dest, record["token"]) if record else Dest(dest, "", {})
    foreign, temps = _scan(dest, d.files, record and record["token"], dirs)
    changed = [rel for rel in foreign if rel in d.files]  # written as a file, now a folder or a link
    if changed:
        raise ValueError(f"{dest}: {changed[0]} is not the file this export wrote ({JOURNAL} records a file, "
                         "this is a folder or a link); move it away, or delete it to have it written again")
    if foreign:
        raise _not_written_here(dest, foreign[0])
    same = record is not None and {k: record.get(k) for k in want} == want
    if record is not None and not same and not overwrite:
        raise ValueError(f"{dest} holds another export ({RECORD} differs: {_difference(record, want)}); choose "
                         "another folder, or overwrite (--overwrite) to replace the files it wrote")
    for t in temps:  # this record's own temporary files: a kill before their commit
        shutil.rmtree(t) if t.is_dir() else t.unlink()
    d.files = _check_recorded(d)
    if same and not overwrite:
        return d  # (a torn last line of the journal: append_synced ends it before the next record)
    if same and d.released:
        raise ValueError(f"{dest}: this export deleted {len(d.released)} source unit(s) as it went "
                         "(--delete-source), so it cannot be rewritten; run it again without --overwrite to finish it")
    for rel in d.files:
        (dest / rel).unlink()
    token = secrets.token_hex(6)
    atomic_write(dest / RECORD, json.dumps({"version": RECORD_VERSION, "token": token, **want,
                                            "source_path": source_path}, indent=2) + "\n")
    if os.path.lexists(dest / JOURNAL):
        (dest / JOURNAL).unlink()
        fsync_dir(dest)
    return Dest(dest, token, {})


def dest_folder(out_dir, dest, dirs: re.Pattern) -> Path:
    """DEST, created if missing; a folder without a record that holds anything is refused before hsx writes in it."""
    dest = Path(dest)
    root = Path(out_dir).resolve()
    if dest.resolve() == root or root in dest.resolve().parents:
        raise ValueError(f"{dest}: export into a folder outside the output dir {out_dir}")
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise ValueError(f"{dest} is a link or a file; export into a folder")
    if dest.is_dir() and _read_record(dest) is None:  # refused before anything is written into it
        foreign, _ = _scan(dest, {}, None, dirs)
        if foreign:
            raise _not_written_here(dest, foreign[0])
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only file system, a parent that is a file, /proc
        raise ValueError(f"cannot create {dest}: {e.strerror or e}; export into a folder this user can write") \
            from None
    return dest
