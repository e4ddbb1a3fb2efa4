"""What a job IS, in one place: its local inputs by content (each file's size and the sha256 of all its bytes,
never its path), the job's fingerprint hashed from its inputs (`job_fingerprint`; hsx.job assembles them), written
to and read from .hsx/job.json (`write_job`, `recorded_job`), and compared (`same_job`, `describe_difference`,
`check_recorded_job`).

A resume must not mix two models: weights rewritten between a kill and a resume (any tensor, same shapes, dtypes
and header) change a file's sha256, so the job's fingerprint changes and the dir is refused. The same recipe run
from another working directory, or with the same folder spelled another way, gives the same fingerprint.

Cost: one read of every file, and hashlib releases the GIL, so files hash in parallel threads, one shard per core
(from disk, the disk is the limit); docs/benchmarks.md has the rates measured (2026-12-02, sha256).

The digest cache ($HF_HOME/hsx/file-digests.json) saves that read; it never decides whether two jobs are the same.
An entry is {"sha256", "hashed_at_ns"} under (real path, size, mtime_ns, ctime_ns, inode), and it is used only if
- it is well formed (64 hex digits, an integer time): a null, a truncated digest, a damaged file are cache misses;
- it is not racy (git's rule for its index): the file's mtime and ctime are more than RACY_NS older than when its
  hashing began. A file rewritten in place within one tick of a coarse clock (FAT's 2 s, HFS+'s 1 s, a network
  filesystem's) keeps its size, times and inode; an entry hashed in that tick would vouch for bytes it never read;
- it is not from the future (a clock set back since, or an entry not written by hashing);
- and, where the digests decide something (`fresh_digests_only`: the job resumes an output dir, so a matching
  fingerprint continues it), it was hashed by this job: since it began, by this process or by another rank that
  began hashing after it. Anything older is read again: a stale entry (a copy tool that preserves
  mtimes onto a filesystem that reuses the inode, a clock set back) or a forged one cannot make a changed model
  pass as the old one. The cost is one read of the model per resume (the ~2 s per 16 GB above, from the page
  cache; it also warms the page cache for the load that follows). New jobs, plans and the ranks after the first
  still read digests from the cache.
The digest equals the Hub's LFS oid of the same file.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import re
import stat
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hsx.config import HsxError
from hsx.files import atomic_write, read_json
from hsx.schema import JobRecord

# What transformers and hsx read from a local model folder (model.WEIGHT_PATTERNS, plus code with
# trust_remote_code): weights, configs, tokenizer files, chat templates.
MODEL_SUFFIXES = (".json", ".safetensors", ".jinja", ".model", ".txt", ".tiktoken")
READ_CHUNK = 16 << 20
_cache_lock = threading.Lock()


def cache_file() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "hsx" / "file-digests.json"


def _key(path: Path, st: os.stat_result) -> str:
    return f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"


# How much older than the start of its hashing a file's mtime and ctime must be for its entry to count: the
# coarsest timestamp granularity of common filesystems (FAT: 2 s), plus a second of clock skew for a network one.
RACY_NS = 3_000_000_000
MAX_CACHE_BYTES = 256 << 20  # ~1M entries of ~250 bytes; a larger file is not the cache hsx writes
_HEX64 = re.compile(r"[0-9a-f]{64}")
_entries_since: contextvars.ContextVar[int | None] = contextvars.ContextVar("hsx_digests_since", default=None)


@contextlib.contextmanager
def fresh_digests_only(since_ns: int):
    """Within it, file_digests uses only cache entries whose hashing began at or after `since_ns` (time.time_ns())
    and reads every other file again: for when the digests decide (a resume)."""
    token = _entries_since.set(since_ns)
    try:
        yield
    finally:
        _entries_since.reset(token)


def _read_cache() -> dict[str, dict[str, Any]]:
    """The cache's well-formed entries: {key: {"sha256": 64 hex digits, "hashed_at_ns": int}}. Anything else in
    it (a null, a digest of the wrong length, an entry of an earlier format, a file that is not JSON) is no entry."""
    try:  # without waiting on a FIFO, and only a regular file of a sane size (else: no cache, hash again)
        fd = os.open(cache_file(), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return {}  # no cache yet
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_CACHE_BYTES:
            return {}
        try:
            data = json.loads(f.read(MAX_CACHE_BYTES))
        except (OSError, ValueError, RecursionError):
            return {}  # a damaged cache: hash again
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and _well_formed(v)}


def _well_formed(entry: Any) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and bool(_HEX64.fullmatch(entry["sha256"]))
            and type(entry.get("hashed_at_ns")) is int)


def _usable(entry: dict[str, Any] | None, st: os.stat_result, since_ns: int | None) -> bool:
    """Whether a cache entry may stand for reading the file (see the module docstring)."""
    if entry is None:
        return False
    at = entry["hashed_at_ns"]
    if max(st.st_mtime_ns, st.st_ctime_ns) + RACY_NS >= at or at > time.time_ns():
        return False
    return since_ns is None or at >= since_ns


def _write_cache(entries: dict[str, dict[str, Any]]) -> None:
    f = cache_file()
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        with _cache_lock:
            merged = {**_read_cache(), **entries}
            tmp = f.with_name(f".{f.name}.{uuid.uuid4().hex}.tmp")  # a name of its own: ranks write at once
            tmp.write_text(json.dumps(merged))
            os.replace(tmp, f)
    except OSError:
        pass  # a read-only HF_HOME: the digests are only re-computed next time


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(view):
            h.update(view[:k])
    return h.hexdigest()


def file_digests(files: list[Path]) -> list[tuple[int, str]]:
    """(size, sha256) of each file, from the cache where an entry may stand for it (see the module docstring),
    else read whole (in threads)."""
    cache = _read_cache()
    since = _entries_since.get()
    stats = [f.stat() for f in files]
    keys = [_key(f, st) for f, st in zip(files, stats)]
    digests = {i: cache[k]["sha256"] for i, (k, st) in enumerate(zip(keys, stats)) if _usable(cache.get(k), st, since)}
    todo = [i for i in range(len(files)) if i not in digests]
    if todo:
        started = time.time_ns()
        with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1, 16)) as pool:
            read = list(pool.map(lambda i: sha256_of(files[i]), todo))
        fresh = {}
        for i, digest in zip(todo, read):
            digests[i] = digest
            if _key(files[i], files[i].stat()) == keys[i]:  # not written while it was read
                fresh[keys[i]] = {"sha256": digest, "hashed_at_ns": started}
        _write_cache(fresh)
    return [(st.st_size, digests[i]) for i, st in enumerate(stats)]


def folder_identity(folder: str | os.PathLike, suffixes: tuple[str, ...] = MODEL_SUFFIXES) -> dict[str, Any]:
    """{"files": {name: [size, sha256]}} of the top-level files of a local model or tokenizer folder that
    transformers reads (by suffix), hidden files excepted."""
    root = Path(folder)
    try:
        files = sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith(".")
                       and p.name.endswith(suffixes))
        return {"files": {f.name: list(d) for f, d in zip(files, file_digests(files))}}
    except OSError as e:
        raise HsxError(f"cannot read {root}: {e.strerror or e}") from None


def files_identity(root: Path, files: list[Path]) -> dict[str, Any]:
    """{"files": {name: [size, sha256]}} of a local dataset: names relative to its folder (a single file: by
    its suffix only, which decides how it is read)."""
    try:
        names = [str(f.relative_to(root)) if f != root else f"*{f.suffix}" for f in files]
        return {"files": {n: list(d) for n, d in zip(names, file_digests(files))}}
    except OSError as e:
        raise HsxError(f"cannot read {root}: {e.strerror or e}") from None


def differing_files(old: Any, new: Any) -> list[str]:
    """The files whose size or bytes differ between two identities (added and removed ones too)."""
    a = old.get("files", {}) if isinstance(old, dict) else {}
    b = new.get("files", {}) if isinstance(new, dict) else {}
    return sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))


def model_identity(name: str, path: str, trust_remote_code: bool = False) -> Any:
    """A local model folder by its files' content (code too, when it runs); a Hub model by its id (the job
    fingerprint also holds the snapshot's commit hash)."""
    if not Path(name).is_dir():
        return name
    return folder_identity(path, MODEL_SUFFIXES + ((".py",) if trust_remote_code else ()))


def tokenizer_identity(name: str | None, trust_remote_code: bool = False) -> Any:
    """--tokenizer: a local folder by its files' content, a Hub id as it is; None (the model's own) as None."""
    if name is None or not Path(name).is_dir():
        return name
    return folder_identity(name, MODEL_SUFFIXES + ((".py",) if trust_remote_code else ()))


# ---- the job: its fingerprint, .hsx/job.json, and two jobs compared -------------------------------------------------

JOB_FILE = "job.json"  # in an output dir's .hsx/


def job_fingerprint(inputs: dict[str, Any], given: dict[str, Any] | None = None) -> dict[str, Any]:
    """The job's identity: a hash of `inputs` (local files by content, above). `given` (how the inputs were named on
    the command line) is kept beside it for messages, outside the hash."""
    blob = json.dumps(inputs, sort_keys=True, default=str).encode()
    return {"fingerprint": hashlib.sha256(blob).hexdigest()[:32], "inputs": inputs, "given": given or {}}


def write_job(state: Path, job: dict[str, Any]) -> None:
    """.hsx/job.json: the job's fingerprint (`job_fingerprint`), which a later run of the dir is checked against."""
    atomic_write(state / JOB_FILE, json.dumps(job, indent=2, sort_keys=True))


def recorded_job(state: Path) -> JobRecord | None:
    """The job an output dir's .hsx/ (`state`) records; None where it records none (no job.json, not even a link).
    One that cannot be read, or a link: HsxError in one line (hsx.files.read_json)."""
    f = state / JOB_FILE
    return read_json(f, JobRecord) if os.path.lexists(f) else None


def same_job(recorded: JobRecord | None, fingerprint: str | None) -> bool:
    """Whether a dir's recorded job is the job of `fingerprint` (a dir recording none is no job's)."""
    return recorded is not None and fingerprint is not None and recorded.fingerprint == fingerprint


def check_recorded_job(recorded: JobRecord, where: Path) -> None:
    """HsxError unless the record's fingerprint is that of the inputs it records (a dir whose job.json was edited
    or copied from another job: what reads its inputs, such as hsx verify's model check, would be misled)."""
    if job_fingerprint(recorded.inputs)["fingerprint"] != recorded.fingerprint:
        raise HsxError(f"{where}: its fingerprint is not that of the inputs it records: the dir is damaged or not "
                       "the job's; merge without it")


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
