"""The output dir: Arrow shards under data/, hsx's run state under .hsx/, hsx.json and a dataset card.

    OUT/data/train-<bucket>-<chunk>.arrow   Arrow IPC stream files (what datasets writes; `Dataset.from_file`
                                            memory-maps them; `load_dataset(OUT)` reads them)
    OUT/README.md                           dataset card: YAML `configs` pointing at data/train-*.arrow
    OUT/hsx.json                            what was run, counts, layer convention; `complete` once finalized
    OUT/.hsx/job.json                       the fingerprint of what decides the output
    OUT/.hsx/manifest-<rank>.jsonl          one line per committed unit: rows, tokens, bytes, CRC-32
                                            (one file per rank; datasets ignores dot-folders)

A unit is written by `map` under .hsx/tmp/, fsynced, then renamed into data/ (and the directory fsynced) before
its manifest line is appended, so a kill at any moment leaves either a whole unit or none. Unit names carry no
"-of-N": resumed and parallel runs add units without renaming any.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hsx.config import LAYER_CONVENTION, HsxError

MANIFESTS = "manifest-*.jsonl"  # one per rank: every process appends only to its own


def features(width: int, hidden: int, final_hidden: bool, flag_nonfinite: bool = False,
             storage_dtype: str = "bfloat16"):
    """The output schema. Arrow has no bfloat16: bf16 is stored bit-exact as int16 (marked id="bfloat16"), fp8
    as uint8 bits (id="float8_e4m3fn") with float32 scales per token and layer in `*_scale` columns."""
    from datasets import Features, List, Value

    value = {"bfloat16": Value("int16", id="bfloat16"), "float16": Value("float16"),
             "float32": Value("float32"), "float8_e4m3": Value("uint8", id="float8_e4m3fn")}[storage_dtype]
    f = {
        "sample_id": Value("int64"),
        "input_ids": List(Value("int32")),
        "loss_mask": List(Value("int8")),
        "num_tokens": Value("int32"),
        "hidden_states": List(List(value, length=width)),
    }
    if final_hidden:
        f["final_hidden_state"] = List(List(value, length=hidden))
    if storage_dtype == "float8_e4m3":
        f["hidden_states_scale"] = List(List(Value("float32"), length=width // hidden))
        if final_hidden:
            f["final_hidden_state_scale"] = List(List(Value("float32"), length=1))
    if flag_nonfinite:
        f["has_nonfinite"] = Value("bool")  # with --nonfinite keep: rows whose states hold NaN/Inf
    return Features(f)


def info_features(info: dict[str, Any]):
    """The output schema an hsx.json describes (None if it does not say enough)."""
    if not {"layers", "hidden_size", "final_hidden"} <= set(info):
        return None
    cfg = info.get("config", {})
    return features(len(info["layers"]) * info["hidden_size"], info["hidden_size"], bool(info["final_hidden"]),
                    cfg.get("nonfinite") == "keep", info.get("storage_dtype", "bfloat16"))


class OutputDir:
    def __init__(self, root: str | os.PathLike, rank: int = 0):
        self.root = Path(root)
        self.rank = rank
        self.data = self.root / "data"
        self.state = self.root / ".hsx"
        self.tmp = self.state / "tmp" / f"rank-{rank:05d}"

    def manifest_lines(self) -> Iterator[str]:
        for manifest in sorted(self.state.glob(MANIFESTS)):
            yield from manifest.read_text().splitlines()

    # ---- claiming a dir for a job ----

    @contextmanager
    def locked(self) -> Iterator[None]:
        """One job per dir: an advisory lock on .hsx/lock, released by the kernel if the process dies.

        A non-empty dir that hsx did not write is refused here, before anything (.hsx/) is created in it."""
        self.check_not_foreign()
        self.state.mkdir(parents=True, exist_ok=True)
        name = "lock" if self.rank == 0 else f"lock-{self.rank:05d}"  # a job's ranks each hold their own
        fd = os.open(self.state / name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise HsxError(f"{self.root} is in use by another hsx job (lock held on .hsx/lock)") from None
            yield
        finally:
            os.close(fd)

    def check_not_foreign(self) -> None:
        if self.root.is_dir() and not self.state.is_dir() and any(self.root.iterdir()):
            raise HsxError(f"{self.root} is not empty and was not written by hsx; choose another --output-dir")
        if self.root.exists() and not self.root.is_dir():
            raise HsxError(f"{self.root} is a file, not a folder; choose another --output-dir")

    def has_output(self) -> bool:
        """Whether a job has committed anything here: a manifest line, a data file, or hsx.json."""
        return (any(line.strip() for line in self.manifest_lines()) or any(self.data_files())
                or (self.root / "hsx.json").exists())

    def claim(self, job: dict[str, Any], overwrite: bool) -> str:
        """Record the job's fingerprint, or check it against the one there. Returns 'new', 'resume' or 'complete'.

        A dir whose job failed before committing anything (a --strict error, a missing chat template, ...) holds
        no output, so it is re-claimed for whatever job comes next instead of refused as a different job."""
        job_file = self.state / "job.json"
        if overwrite:
            self.clear()
        elif not job_file.exists() and self.root.exists() and any(
                p.name not in (".hsx",) for p in self.root.iterdir()):
            raise HsxError(f"{self.root} is not empty and was not written by hsx; choose another --output-dir")
        if job_file.exists():
            old = json.loads(job_file.read_text())
            if old.get("fingerprint") == job["fingerprint"]:
                info = self.read_info()
                return "complete" if info.get("complete") else "resume"
            if self.has_output():
                diff = sorted(k for k in set(old.get("inputs", {})) | set(job["inputs"])
                              if old.get("inputs", {}).get(k) != job["inputs"].get(k))
                raise HsxError(f"{self.root} holds a different job (differs in: {', '.join(diff) or 'version'}); "
                               "use another --output-dir, or --overwrite to delete it and start over")
            self.clear()  # a job that failed before committing anything: drop its job.json, tokenized cache, tmp
        self.state.mkdir(parents=True, exist_ok=True)
        atomic_write(job_file, json.dumps(job, indent=2, sort_keys=True))
        return "new"

    def clear(self) -> None:
        """Delete only what hsx writes here (never the lock, which this process holds)."""
        for name in ("hsx.json", "README.md"):
            (self.root / name).unlink(missing_ok=True)
        if self.data.exists():
            for f in self.data.glob("train-*.arrow"):
                f.unlink()
            if not any(self.data.iterdir()):
                self.data.rmdir()
        if self.state.exists():
            for p in self.state.iterdir():
                if not p.name.startswith("lock"):
                    shutil.rmtree(p) if p.is_dir() else p.unlink()

    @contextmanager
    def finalizing(self) -> Iterator[bool]:
        """Serialize finalization between ranks; yields True when another process already finalized."""
        fd = os.open(self.state / "finalize.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield bool(self.read_info().get("complete"))
        finally:
            os.close(fd)

    def read_info(self) -> dict[str, Any]:
        f = self.root / "hsx.json"
        return json.loads(f.read_text()) if f.exists() else {}

    # ---- units ----

    def done_units(self) -> dict[str, dict[str, Any]]:
        """Committed units from the manifests (every rank's), whose files exist with the recorded size."""
        done = {}
        for line in self.manifest_lines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line from a kill mid-append: that unit is redone
            f = self.data / rec["file"]
            if f.exists() and f.stat().st_size == rec["bytes"]:
                done[rec["unit"]] = rec
        return done

    def clear_tmp(self) -> None:
        """Partial units a killed run of this rank left behind (never committed, so never counted)."""
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)

    def unit_tmp(self, unit: str) -> Path:
        self.tmp.mkdir(parents=True, exist_ok=True)
        return self.tmp / f"train-{unit}.arrow"

    def commit(self, unit: str, record: dict[str, Any]) -> None:
        tmp = self.unit_tmp(unit)
        final = self.data / f"train-{unit}.arrow"
        self.data.mkdir(parents=True, exist_ok=True)
        fsync_file(tmp)
        crc = file_crc32(tmp)
        os.replace(tmp, final)
        fsync_dir(self.data)
        record = {"unit": unit, "file": final.name, "bytes": final.stat().st_size, "crc32": crc, **record}
        with open(self.state / f"manifest-{self.rank:05d}.jsonl", "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def data_files(self) -> list[Path]:
        return sorted(self.data.glob("train-*.arrow"))

    # ---- finalizing ----

    def finalize(self, info: dict[str, Any], card: str, features=None) -> None:
        """Write the card and hsx.json (last: `complete` is the commit point of the whole job).

        A job with no usable rows committed no unit; it gets one empty data file with the output schema
        (`features`, a datasets.Features; by default the one `info` describes), so `load_dataset(OUT)` and
        `hsx.load` give 0 rows instead of failing."""
        if not self.data_files():
            features = features if features is not None else info_features(info)
            if features is not None:
                self.write_empty_data_file(features)
        atomic_write(self.root / "README.md", card)
        atomic_write(self.root / "hsx.json", json.dumps(info, indent=2) + "\n")
        shutil.rmtree(self.state / "tmp", ignore_errors=True)  # every rank is done: no partial unit is left

    def write_empty_data_file(self, features) -> Path:
        """data/train-000-00000.arrow with zero rows and the given schema, written under a temp name and renamed."""
        from datasets.arrow_writer import ArrowWriter

        self.data.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        final = self.data / "train-000-00000.arrow"
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

    def __init__(self, out: OutputDir):
        import queue
        import threading

        self.out, self.error = out, None
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="hsx-commit", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.error is None:
                try:
                    self.out.commit(*item)
                except BaseException as e:  # noqa: BLE001  (re-raised on the main thread)
                    self.error = e
            self.queue.task_done()
        self.queue.task_done()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def submit(self, unit: str, record: dict[str, Any]) -> None:
        self.check()
        self.queue.put((unit, record))

    def join(self) -> None:
        self.queue.join()
        self.check()

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()


def job_fingerprint(inputs: dict[str, Any]) -> dict[str, Any]:
    blob = json.dumps(inputs, sort_keys=True, default=str).encode()
    return {"fingerprint": hashlib.sha256(blob).hexdigest()[:32], "inputs": inputs}


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def file_crc32(path: Path, chunk: int = 64 << 20) -> str:
    """CRC-32 of a file (zlib releases the GIL on large buffers: ~1 s per few GB, on the commit thread)."""
    import zlib

    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dataset_card(info: dict[str, Any], command: str) -> str:
    """README.md for the output dir: `configs` for load_dataset, what the columns are, how to decode bf16."""
    c = info["counts"]
    layers = ", ".join(str(i) for i in info["layers"])
    final_col = ("\n- `final_hidden_state`: (T, {h}) int16 bits of bfloat16, the output of the final norm "
                 "(transformers' `hidden_states[N]`, the input of lm_head)").format(h=info["hidden_size"]) \
        if info["final_hidden"] else ""
    return f"""---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*.arrow
tags:
- hsx
- hidden-states
---

# Hidden states of `{info['model']}`

Extracted with [hsx](https://github.com/) {info['hsx_version']}: layers **{layers}** of {info['num_model_layers']}
(hidden size {info['hidden_size']}), {c['rows_written']:,} rows, {c['tokens_written']:,} tokens.

Layer convention: {info['layer_convention']}.

## Columns
- `sample_id`: int64, the row's index in the input dataset (`{info['config']['dataset']}`, split `{info['config']['split']}`)
- `input_ids`: int32 token ids; `loss_mask`: int8, 1 on each assistant token including its end-of-turn token (unshifted)
- `num_tokens`: int32
- `hidden_states`: (T, {len(info['layers'])}·{info['hidden_size']}) int16 bits of bfloat16, layers concatenated in the order above{final_col}

Rows are ordered by length bucket, then `sample_id`. Skipped input rows: {json.dumps(c['skipped'])};
truncated to {info['max_length']} tokens: {c['truncated']}.

## Loading
Arrow has no bfloat16: the states are stored bit-exact as int16. Local outputs, memory-mapped, no copy:

```python
import hsx
ds = hsx.load("path/to/this/dir")          # datasets.Dataset over the Arrow files, memory-mapped
rows = hsx.torch_view(ds)                   # rows[i]["hidden_states"]: torch.bfloat16 (T, layers, hidden)
```

With plain `datasets` (note: `load_dataset` on a local dir copies it into the cache; `streaming=True` does not):

```python
import torch
from datasets import load_dataset
ds = load_dataset("path/or/repo", split="train", streaming=True).with_format("torch", dtype=None)
row = next(iter(ds))
states = row["hidden_states"].view(torch.bfloat16).reshape(row["num_tokens"], {len(info['layers'])}, {info['hidden_size']})
```

Produced by: `{command}`
"""
