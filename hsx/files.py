"""File primitives for hsx's output dir: locks, atomic and synced writes, and bounded reads of what hsx wrote.

Files are written, locked and read here without following a link (O_NOFOLLOW) and without waiting on a FIFO
(O_NONBLOCK), each checked to be a regular file once open: hsx never writes, deletes or reads through a link it did
not make, and never blocks on something planted at one of its names. Reads are bounded by hsx.schema's limit for
that file (a bigger one is not hsx's; read whole it would take the machine's memory), and a JSON object with a key
given twice is damaged, not silently the last value. Which files these are and what they hold: hsx.sink (the dir),
hsx.ledgers (the record files), hsx.info (hsx.json)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hsx.errors import HsxError
from hsx.schema import MAX_LEDGER_BYTES, MAX_LEDGER_LINE_BYTES, Damaged

# ---- reading what hsx wrote (which may be damaged, or not hsx's at all) -----------------------------------------

def read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of a JSON file hsx wrote: a regular file reached through no link (a FIFO there would block
    forever, a link read another file), and at most `limit` bytes (hsx.schema's bound for that file: a bigger
    one is not hsx's; read whole it would take the machine's memory)."""
    with open_bounded(path, limit) as f:  # (read(n) allocates n bytes up front: n is the file's size, not limit)
        return f.read(min(os.fstat(f.fileno()).st_size, limit) + 1)[:limit]


def open_bounded(path: Path, limit: int):
    """`path` opened for reading as `read_bounded` reads it: HsxError naming it when it is over `limit` bytes."""
    fd = open_regular(path)
    f = os.fdopen(fd, "rb")
    size = os.fstat(fd).st_size
    if size > limit:
        f.close()
        raise HsxError(f"{path} is damaged: {size:,} bytes, more than hsx writes there ({limit:,} at most)")
    return f


class DuplicateKey(Damaged):
    """A JSON object names `key` twice."""

    def __init__(self, key: str):
        super().__init__(f"key {key[:60]!r} given twice")
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict (json.loads' object_pairs_hook), refusing a key given twice: json keeps the
    last, so a file with two `complete`s or two `files` lists would say one thing to one reader and another to the
    next (and safetensors refuses such a header)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        raise DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


def _loads(text: str) -> Any:
    return json.loads(text, object_pairs_hook=unique_keys)


def read_json(path: Path, record=None, *, limit: int | None = None):
    """A JSON object hsx wrote (hsx.json, .hsx/job.json, .hsx/summary.json) as its typed record
    (`record.from_dict`, hsx.schema; the dict itself without one). Unreadable, over `limit` bytes (default: the
    record's MAX_BYTES; without a record `limit` must be given), not UTF-8 JSON, not an object, or a key missing or
    of the wrong type: HsxError in one line naming the file, never a KeyError three calls later."""
    if limit is None:
        limit = record.MAX_BYTES
    try:
        obj = _loads(read_bounded(path, limit).decode("utf-8"))
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
        f = open_bounded(path, limit)
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




def fsync_file(path: Path) -> None:
    """fsync a file's data, or a directory's entries (a rename is durable only after its directory's fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_file


def link_target(path: Path) -> Path:
    """The file a unit's name leads to: itself, or what `hsx merge`'s link points to (file_crc32 follows none)."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def file_size(path: Path) -> int | None:
    """A file's size, None when there is none (a unit may be deleted by a trainer at any moment: hsx.follow)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


# ---- writing (never through a link, never on a FIFO) ----------------------------------------------------------

def open_no_follow(path: Path, flags: int) -> int:
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
def flock(path: Path, how: int, busy: str) -> Iterator[None]:
    """flock(2) `how` (LOCK_EX or LOCK_SH) on `path`, or HsxError(`busy`) at once if another process holds it.
    The kernel releases it when the process dies; the file stays (empty, never read), so a resume finds no stale
    lock. Not the `filelock` package: its FileLock is exclusive only, and every rank of a job holds .hsx/busy
    SHARED while `hsx merge` takes it exclusive; its ReadWriteLock is an SQLite database (journal files beside
    it); and filelock before 3.20.1 opened the lock file with O_TRUNC and without O_NOFOLLOW, truncating a link's
    target (CVE-2025-68146), where this opens it with O_NOFOLLOW and never truncates."""
    fd = open_no_follow(path, os.O_RDWR | os.O_CREAT)
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
    fd = open_no_follow(path, os.O_WRONLY | os.O_CREAT | flags)
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
    fd = open_no_follow(path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            text = "\n" + text
        _write_all(fd, text)
    finally:
        os.close(fd)


def atomic_tmp_name(name: str, writer: str | None = None) -> str:
    """The temporary name `atomic_write` writes `name` under (a failed write leaves it: hsx's own, never foreign);
    `writer`'s own where several processes write `name` at once."""
    return f".{name}.tmp" if writer is None else f".{name}.{writer}.tmp"


def atomic_write(path: Path, text: str, writer: str | None = None) -> None:
    """`text` as `path`, whole or not at all: written to a temporary name beside it, fsynced, renamed over it, the
    folder fsynced. `writer` (e.g. "rank-00001"): where several processes may write `path` at once, each writes
    its own temporary name (one name for all: one's rename takes the file another is about to rename), and the
    last rename wins."""
    tmp = path.with_name(atomic_tmp_name(path.name, writer))
    if tmp.is_symlink() or (os.path.lexists(tmp) and not tmp.is_dir() and not tmp.is_file()):
        tmp.unlink()  # hsx's own temporary name: a link there goes (the link, never its target), and a FIFO
    _write_synced(tmp, text, os.O_TRUNC)
    os.replace(tmp, path)
    fsync_dir(path.parent)




def atomic_write_with(path: Path, write) -> None:
    """Write `path` atomically through `write(binary file)` (numpy's and torch's savers): into a temporary name
    beside it (one a killed run or a planted link left there is removed, the link only, never written through),
    fsynced, renamed over `path`, the folder fsynced."""
    tmp = path.with_name(atomic_tmp_name(path.name))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
    with os.fdopen(fd, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)