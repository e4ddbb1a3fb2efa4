"""Draft vocabulary: how often each token is a training target, and the d2t/t2d mapping EAGLE-3 drafters use to
predict over the K most frequent target tokens instead of the whole vocabulary.

- `OUT/token_frequencies.npy`: int64 (vocab_size,), how many times each token id is supervised (loss_mask 1) in
  the output. Written once by the job's finalizer (`write_token_frequencies`): a `np.bincount` over the
  input_ids / loss_mask Arrow buffers of the data files, no Python per token, and only those two columns are
  read (≈5 bytes/token of pages, against 32+ KiB/token of states at hidden 4096). hsx.json's
  `token_frequencies` says what was counted. When units were deleted after their upload the count runs over
  the tokenized rows instead (so it also holds rows skipped later as `oom` / `nonfinite`; hsx.json says so).
- `draft_vocab(freqs, K)`: the K most frequent ids (ties: the lower id; fewer than K seen: the lowest unseen
  ids fill in), as both trainers build it (SpecForge `process_token_dict_to_mappings`, speculators
  `build_vocab_mappings_from_distribution`): `d2t[i] = draft_ids[i] - i` (int64 offsets: target id =
  i + d2t[i]) and `t2d` (bool, vocab_size) marking the draft tokens.
- `write_draft_vocab(out, K, dest)`: `vocab_mapping-K.pt` (SpecForge: torch.save({"d2t", "t2d"}), its
  `--vocab-mapping`) and `d2t-K.npy` / `t2d-K.npy` (speculators: np.save, found in its --data-path by size).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from hsx import ledgers
from hsx.files import atomic_write_with
from hsx.info import recorded_info

FREQUENCIES_FILE = "token_frequencies.npy"
SPECULATORS_FREQUENCIES_FILE = "token_freq.pt"  # speculators' name and format: torch.save({token_id: count})


def count_supervised(tables: Iterable, vocab_size: int) -> np.ndarray:
    """Per-token counts of the supervised tokens (loss_mask 1) of Arrow tables with `input_ids` and `loss_mask`
    list columns: int64 (vocab_size,)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for table in tables:
        for batch in table.select(["input_ids", "loss_mask"]).to_batches():
            ids = batch.column(0).flatten().to_numpy(zero_copy_only=False)  # flatten: honours slice offsets
            mask = batch.column(1).flatten().to_numpy(zero_copy_only=False)
            if len(ids) != len(mask):
                raise ValueError("input_ids and loss_mask differ in length")
            chosen = ids[mask != 0]
            if len(chosen) and (int(chosen.min()) < 0 or int(chosen.max()) >= vocab_size):
                raise ValueError(f"token id outside the vocabulary [0, {vocab_size})")
            counts += np.bincount(chosen, minlength=vocab_size)
    return counts


def write_token_frequencies(out, vocab_size: int | None) -> dict[str, Any] | None:
    """Count the finished output's supervised tokens into OUT/token_frequencies.npy (atomically) and return
    hsx.json's `token_frequencies` entry; None when the vocabulary size is unknown. `out`: an OutputDir."""
    from datasets import Dataset

    if not vocab_size:
        return None
    files = [out.data / r["file"] for r in ledgers.manifest_records(out.state).values()]  # every committed unit
    counts = None
    if all(f.exists() for f in files):
        try:
            source, counts = "output", count_supervised((Dataset.from_file(str(f)).data.table for f in files),
                                                        int(vocab_size))
        except FileNotFoundError:  # a unit a trainer consumed and deleted meanwhile (hsx.follow)
            counts = None
    if counts is None:  # units deleted after their upload or consumption: the tokenized rows planned
        import pyarrow.compute as pc

        cache_file = out.state / "tokenized" / "tokens.arrow"
        if not cache_file.exists():  # (a merged dir has no tokenized cache)
            return None
        cache = Dataset.from_file(str(cache_file)).data.table
        source, tables = "tokenized", [cache.filter(pc.equal(cache.column("skip_reason"), ""))]
        counts = count_supervised(tables, int(vocab_size))
    atomic_write_with(out.root / FREQUENCIES_FILE, lambda f: np.save(f, counts))
    return {"file": FREQUENCIES_FILE, "vocab_size": int(vocab_size), "supervised_tokens": int(counts.sum()),
            "distinct_tokens": int(np.count_nonzero(counts)), "counted_over": source}


def read_token_frequencies(out_dir: str | os.PathLike) -> np.ndarray:
    """OUT/token_frequencies.npy as int64 (vocab_size,), checked against hsx.json."""
    root = Path(out_dir)
    from hsx.sink import OutputDir

    info = recorded_info(OutputDir(root).root)  # (its token_frequencies entry checked: hsx.schema.Info)
    meta = info.token_frequencies if info is not None else None
    path = root / FREQUENCIES_FILE
    if not meta or not path.is_file():
        raise FileNotFoundError(f"{out_dir} has no {FREQUENCIES_FILE} (written by hsx extract when a job "
                                "finishes; outputs of older versions lack it)")
    counts = _read_counts(path, meta["vocab_size"])
    if counts is None or int(counts.sum()) != meta["supervised_tokens"]:
        raise ValueError(f"{path} does not match hsx.json's token_frequencies (damaged or replaced?)")
    return counts


def _read_counts(path: Path, vocab_size: int) -> np.ndarray | None:
    """The (vocab_size,) int64 array of a .npy file hsx wrote, its header checked before any allocation: np.load
    allocates the shape a header claims (a 100-byte file claiming 10**12 entries: a MemoryError); the file is
    a regular one reached through no link, of exactly the size that header says. None when it is not."""
    from hsx.files import open_regular

    with os.fdopen(open_regular(path), "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                           (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if read_header is None:
                return None
            shape, fortran, dtype = read_header(f)
        except (ValueError, SyntaxError, TypeError):
            return None
        if shape != (vocab_size,) or dtype != np.dtype("<i8") or \
                os.fstat(f.fileno()).st_size != f.tell() + 8 * vocab_size:
            return None
        return np.fromfile(f, dtype=dtype, count=vocab_size)


def draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t, t2d) for the `draft_vocab_size` most frequent tokens: d2t int64 offsets (target id = i + d2t[i]),
    t2d bool over the target vocabulary."""
    vocab = len(counts)
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"--draft-vocab-size must be in [1, {vocab}] (the target's vocabulary), "
                         f"not {draft_vocab_size}")
    by_frequency = np.lexsort((np.arange(vocab), -counts))  # most frequent first; ties: lower id first
    chosen = np.sort(by_frequency[:draft_vocab_size])
    t2d = np.zeros(vocab, dtype=bool)
    t2d[chosen] = True
    return (chosen - np.arange(draft_vocab_size)).astype(np.int64), t2d


def write_draft_vocab(out_dir: str | os.PathLike, draft_vocab_size: int, dest: str | os.PathLike | None = None,
                      log=print) -> dict[str, Any]:
    """`hsx vocab OUT --draft-vocab-size K`: the mapping files both trainers load, into `dest` (default OUT)."""
    import torch

    counts = read_token_frequencies(out_dir)
    d2t, t2d = draft_vocab(counts, draft_vocab_size)
    dest = Path(dest) if dest is not None else Path(out_dir)
    dest.mkdir(parents=True, exist_ok=True)
    k = draft_vocab_size
    paths = {"specforge": dest / f"vocab_mapping-{k}.pt", "d2t": dest / f"d2t-{k}.npy", "t2d": dest / f"t2d-{k}.npy"}
    writers = {"specforge": lambda f: torch.save({"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)}, f),
               "d2t": lambda f: np.save(f, d2t), "t2d": lambda f: np.save(f, t2d)}
    if dest.resolve() != Path(out_dir).resolve():  # a folder hsx does not own: replace only this same mapping
        for name, path in paths.items():
            if os.path.lexists(path) and not _holds(path, writers[name]):
                raise ValueError(f"{path} exists and is not this mapping (another output's, or not hsx's); hsx "
                                 "replaces nothing it did not write: move it away or choose another --dest")
    for name, path in paths.items():
        atomic_write_with(path, writers[name])
    covered = float(counts[t2d].sum() / max(1, counts.sum()))
    log(f"hsx: draft vocabulary of {k:,} of {len(counts):,} tokens covers {covered:.2%} of the "
        f"{int(counts.sum()):,} supervised tokens: {paths['specforge']} (SpecForge --vocab-mapping), "
        f"{paths['d2t'].name} + {paths['t2d'].name} (speculators, found in its --data-path)")
    return {"coverage": covered, **{name: str(p) for name, p in paths.items()}}


def write_speculators_frequencies(counts: np.ndarray, path: Path) -> None:
    """speculators' token_freq.pt: torch.save of {token_id: count} over the tokens seen."""
    import torch

    seen = np.flatnonzero(counts)
    atomic_write_with(path, lambda f: torch.save(dict(zip(seen.tolist(), counts[seen].tolist())), f))


def _holds(path: Path, write) -> bool:
    """Whether `path` is a regular file (no link) holding exactly what `write` writes (np.save and torch.save of
    the same arrays write the same bytes)."""
    buf = io.BytesIO()
    write(buf)
    want = buf.getvalue()
    return (not path.is_symlink() and path.is_file() and path.stat().st_size == len(want)
            and path.read_bytes() == want)


