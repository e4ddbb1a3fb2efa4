"""What a local input IS, by content: each file's size and the sha256 of all its bytes, never its path.

A resume must not mix two models: weights rewritten between a kill and a resume (any tensor, same shapes, dtypes
and header) change a file's sha256, so the job's fingerprint changes and the dir is refused. The same recipe run
from another working directory, or with the same folder spelled another way, gives the same fingerprint.

Cost, measured on files in the page cache: sha256 runs at ~1.0 GB/s per thread (H200 host: 1038 MB/s; the
2-core dev box: 737 MB/s under load), and hashlib releases the GIL, so files hash in parallel threads: 16 shards
on the H200 host's 16 cores at 9.5 GB/s (a 16 GB 8B checkpoint in ~2 s; from disk, the disk is the limit). A file
is read once: its digest is cached in $HF_HOME/hsx/file-digests.json under (real path, size, mtime_ns, ctime_ns, inode),
so an unchanged file is not re-read. ctime is in the key because `os.utime` can set mtime back but not ctime.
The digest equals the Hub's LFS oid of the same file.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hsx.config import HsxError

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


def _read_cache() -> dict[str, str]:
    try:
        data = json.loads(cache_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # no cache yet, or a damaged one: hash again


def _write_cache(entries: dict[str, str]) -> None:
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
    """(size, sha256) of each file, from the cache where the file is unchanged, else read whole (in threads)."""
    cache = _read_cache()
    stats = [f.stat() for f in files]
    keys = [_key(f, st) for f, st in zip(files, stats)]
    todo = [i for i, k in enumerate(keys) if k not in cache]
    if todo:
        with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1, 16)) as pool:
            digests = list(pool.map(lambda i: sha256_of(files[i]), todo))
        fresh = {}
        for i, digest in zip(todo, digests):
            cache[keys[i]] = digest
            if _key(files[i], files[i].stat()) == keys[i]:  # not written while it was read
                fresh[keys[i]] = digest
        _write_cache(fresh)
    return [(st.st_size, cache[k]) for st, k in zip(stats, keys)]


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
