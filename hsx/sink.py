"""The output dir: Arrow shards under data/, hsx's run state under .hsx/, hsx.json and a dataset card.

    OUT/data/train-<bucket>-<chunk>.arrow   Arrow IPC stream files (what datasets writes; `Dataset.from_file`
                                            memory-maps them; `load_dataset(OUT)` reads them)
    OUT/README.md                           dataset card: YAML `configs` pointing at data/train-*.arrow
    OUT/hsx.json                            what was run, counts, layer convention; `complete` once finalized
    OUT/.hsx/job.json                       the fingerprint of what decides the output
    OUT/.hsx/manifest-<rank>.jsonl          one line per committed unit: rows, tokens, bytes, CRC-32
                                            (one file per rank; datasets ignores dot-folders)
    OUT/.hsx/uploaded-<rank>.jsonl          one line per file a Hub push committed (hsx.hub); a unit deleted
                                            after upload (--delete-after-upload) still counts as done

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

from hsx.config import HsxError

MANIFESTS = "manifest-*.jsonl"  # one per rank: every process appends only to its own
UPLOADED = "uploaded-*.jsonl"  # Hub upload records (hsx.hub): one per rank, and uploaded-push.jsonl


def features(width: int, hidden: int, final_hidden: bool, flag_nonfinite: bool = False,
             storage_dtype: str = "bfloat16", topk_logits: int = 0):
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
    if topk_logits:
        f["topk_logits"] = List(List(Value("int16", id="bfloat16"), length=topk_logits))
        f["topk_ids"] = List(List(Value("int32"), length=topk_logits))
    if flag_nonfinite:
        f["has_nonfinite"] = Value("bool")  # with --nonfinite keep: rows whose states hold NaN/Inf
    return Features(f)


def info_features(info: dict[str, Any]):
    """The output schema an hsx.json describes (None if it does not say enough)."""
    if not {"layers", "hidden_size", "final_hidden"} <= set(info):
        return None
    cfg = info.get("config", {})
    return features(len(info["layers"]) * info["hidden_size"], info["hidden_size"], bool(info["final_hidden"]),
                    cfg.get("nonfinite") == "keep", info.get("storage_dtype", "bfloat16"), cfg.get("topk_logits", 0))


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
        # One listing, not an exists() check then a listing: another rank of this job may create .hsx/ between.
        entries = [p.name for p in self.root.iterdir()] if self.root.is_dir() else []
        if entries and ".hsx" not in entries:
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
        for name in ("hsx.json", "README.md", "token_frequencies.npy"):
            (self.root / name).unlink(missing_ok=True)
        for pattern in ("vocab_mapping-*.pt", "d2t-*.npy", "t2d-*.npy"):  # `hsx vocab OUT` writes these here
            for f in self.root.glob(pattern):
                f.unlink()
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

    def mark_rank_done(self, run_id: str, rank: int, world_size: int, stats: dict[str, Any] | None = None) -> bool:
        """Record that `rank` finished its share of run `run_id` (with its throughput numbers); True once every
        rank of the run has."""
        folder = self.state / "ranks" / run_id
        folder.mkdir(parents=True, exist_ok=True)
        record = {k: v for k, v in (stats or {}).items() if isinstance(v, (int, float, str, bool))}
        atomic_write(folder / f"{rank:05d}.done", json.dumps({"rank": rank, **record}) + "\n")
        return len(list(folder.glob("*.done"))) >= world_size

    def rank_stats(self, run_id: str) -> list[dict[str, Any]]:
        """What each rank of run `run_id` recorded when it finished, in rank order."""
        stats = []
        for f in sorted((self.state / "ranks" / run_id).glob("*.done")):
            try:
                stats.append(json.loads(f.read_text() or "{}"))
            except json.JSONDecodeError:
                continue
        return stats

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write(self.state / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")

    def read_summary(self) -> dict[str, Any]:
        f = self.state / "summary.json"
        return json.loads(f.read_text()) if f.exists() else {}

    def read_info(self) -> dict[str, Any]:
        f = self.root / "hsx.json"
        return json.loads(f.read_text()) if f.exists() else {}

    # ---- units ----

    def manifest_records(self) -> dict[str, dict[str, Any]]:
        """Every committed unit's manifest record (every rank's), by unit name; whether its file is still here
        or not."""
        records = {}
        for line in self.manifest_lines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line from a kill mid-append: that unit is redone
            records[rec["unit"]] = rec
        return records

    def done_units(self) -> dict[str, dict[str, Any]]:
        """Committed units from the manifests (every rank's) whose files exist with the recorded size, or that a
        Hub push recorded as uploaded (in .hsx/uploaded-*.jsonl, with the same size and CRC-32): with
        --delete-after-upload those are gone from disk and must not be redone."""
        uploaded = self.uploaded()
        done = {}
        for unit, rec in self.manifest_records().items():
            f = self.data / rec["file"]
            if f.exists() and f.stat().st_size == rec["bytes"]:
                done[unit] = rec
            elif uploaded_matches(uploaded.get(f"data/{rec['file']}"), rec):
                done[unit] = rec
        return done

    # ---- upload bookkeeping (hsx.hub) ----

    def uploaded(self) -> dict[str, dict[str, Any]]:
        """What Hub pushes recorded as committed on the Hub, by path in the repo (`data/train-....arrow`): the last
        record of each path over every .hsx/uploaded-*.jsonl (one per rank, and one for `hsx push`)."""
        records: dict[str, dict[str, Any]] = {}
        for ledger in sorted(self.state.glob(UPLOADED)):
            for line in ledger.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line: that file is uploaded again (a no-op on the Hub)
                records[rec["file"]] = rec
        return records

    def record_uploaded(self, records: list[dict[str, Any]], name: str | None = None) -> None:
        """Append upload records to .hsx/uploaded-<name>.jsonl (default: this rank's) and fsync: called only after
        the Hub confirmed the commit, and before any local file is deleted."""
        if not records:
            return
        self.state.mkdir(parents=True, exist_ok=True)
        name = name or f"{self.rank:05d}"
        with open(self.state / f"uploaded-{name}.jsonl", "a") as f:
            f.write("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())

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
        manifest = self.state / f"manifest-{self.rank:05d}.jsonl"
        torn = manifest.exists() and manifest.stat().st_size > 0 and not manifest.read_bytes().endswith(b"\n")
        with open(manifest, "a") as f:
            # After a kill mid-append the last line is torn: end it, so this record starts a line of its own.
            f.write(("\n" if torn else "") + json.dumps(record, sort_keys=True) + "\n")
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
        if not self.data_files() and not self.done_units():  # (units uploaded and deleted are not "no unit")
            features = features if features is not None else info_features(info)
            if features is not None:
                self.write_empty_data_file(features)
        # Every rank is done: no partial unit is left. Before hsx.json, so a kill after it leaves nothing behind.
        shutil.rmtree(self.state / "tmp", ignore_errors=True)
        atomic_write(self.root / "README.md", card)
        atomic_write(self.root / "hsx.json", json.dumps(info, indent=2) + "\n")

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

    def __init__(self, out: OutputDir, on_commit=None):
        """`on_commit(unit, path)` runs on the commit thread after each unit's manifest line is on disk (hsx.hub's
        StreamUploader.submit: --push-mode stream)."""
        import queue
        import threading

        self.out, self.error, self.on_commit = out, None, on_commit
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="hsx-commit", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.error is None:
                try:
                    self.out.commit(*item)
                    if self.on_commit is not None:
                        self.on_commit(item[0], self.out.data / f"train-{item[0]}.arrow")
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
    for key in ("token_budget", "compile", "sdpa_backend", "packing", "device", "tp_size", "model_copies"):
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
    info.update(units=len(summary["unit_names"]), world_size=world_size, run=run or {}, complete=True)
    return info


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


CRC_CHUNK = 256 << 20


def file_crc32(path: Path) -> str:
    """CRC-32 of each 256 MiB chunk of a file, ":"-joined, computed by a few threads (zlib releases the GIL).

    One thread manages ~1-2 GB/s, slower than an H200 writes an 8B model's states (1.6 GB/s): measured there,
    a single-threaded checksum fell behind the writer and added 6.4 s to a 9 s run."""
    import zlib
    from concurrent.futures import ThreadPoolExecutor

    size = Path(path).stat().st_size

    def chunk_crc(i: int) -> str:
        crc, buf = 0, bytearray(16 << 20)
        view = memoryview(buf)
        with open(path, "rb", buffering=0) as f:
            f.seek(i * CRC_CHUNK)
            left = min(CRC_CHUNK, size - i * CRC_CHUNK)
            while left > 0:
                k = f.readinto(view[: min(len(buf), left)])
                if not k:
                    break
                crc = zlib.crc32(view[:k], crc)
                left -= k
        return f"{crc:08x}"

    chunks = max(1, -(-size // CRC_CHUNK))
    with ThreadPoolExecutor(max_workers=min(8, chunks, os.cpu_count() or 1)) as pool:
        return ":".join(pool.map(chunk_crc, range(chunks)))


def fsync_file(path: Path) -> None:
    """fsync a file's data, or a directory's entries (a rename is durable only after its directory's fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_file


BIG_OUTPUT_BYTES = 50e9  # above this (or on the Hub) the card leads with streaming / hsx.load
STORAGE_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3": 1}


def output_bytes(info: dict[str, Any]) -> int:
    """The states' size: tokens x stored vectors x hidden x itemsize (+ fp8's float32 scale per vector)."""
    dtype = info.get("storage_dtype", "bfloat16")
    vectors = len(info["layers"]) + int(bool(info.get("final_hidden")))
    per_vector = info["hidden_size"] * STORAGE_ITEMSIZE.get(dtype, 2) + (4 if dtype == "float8_e4m3" else 0)
    return int(info["counts"]["tokens_written"]) * vectors * per_vector


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _decode_lines(dtype: str, num_layers: int, hidden: int) -> str:
    """The plain-torch decode of one row from `with_format("torch")`, which widens the stored integer bits to
    int64 (a streaming dataset's with_format takes no dtype=): narrow them back, then reinterpret."""
    shape = f'row["num_tokens"], {num_layers}, {hidden}'
    if dtype == "bfloat16":
        return f'states = row["hidden_states"].to(torch.int16).view(torch.bfloat16).reshape({shape})'
    if dtype == "float8_e4m3":
        return (f'q = row["hidden_states"].to(torch.uint8).view(torch.float8_e4m3fn).reshape({shape})\n'
                'states = (q.float() * row["hidden_states_scale"][..., None]).to(torch.bfloat16)  # x = q * scale')
    return f'states = row["hidden_states"].reshape({shape})  # {dtype}'


def dataset_card(info: dict[str, Any], command: str) -> str:
    """README.md for the output dir (and its Hub repo): YAML `configs` for load_dataset, the job fingerprint, what
    the columns are, how to decode the states, and how to load them without copying.

    The fingerprint is in the YAML twice: `hsx_fingerprint` for people and tools, and as the config's
    `description`, which is what busts datasets' cache of local dirs: datasets 5.2 keys `load_dataset(DIR)` by
    the folder's name and the card's configs (not the path, not the files' contents or mtimes), so two outputs
    in folders of the same name (or one folder re-made by another job) returned the first one's rows; a
    top-level YAML key does not change that key, the config's description does (tests/test_load.py)."""
    import re

    c = info["counts"]
    num_layers, hidden = len(info["layers"]), info["hidden_size"]
    layers = ", ".join(str(i) for i in info["layers"])
    dtype = info.get("storage_dtype", "bfloat16")
    cfg = info.get("config", {})
    repo = cfg.get("push_to_hub")
    where = repo or "path/to/this/dir"
    fingerprint = info.get("fingerprint", "")
    size = output_bytes(info)
    big = bool(repo) or size > BIG_OUTPUT_BYTES
    command = re.sub(r"hf_[A-Za-z0-9]{8,}", "hf_***", command)  # never a token in a card
    stored = {"bfloat16": "int16 bits of bfloat16", "float16": "float16", "float32": "float32",
              "float8_e4m3": "uint8 bits of float8_e4m3fn (x = q * scale)"}.get(dtype, dtype)
    scale_cols = ("\n- `hidden_states_scale`: (T, {n}) float32, one scale per token and layer (fp8: absmax / 448)"
                  .format(n=num_layers) if dtype == "float8_e4m3" else "")
    final_col = (f"\n- `final_hidden_state`: (T, {hidden}) {stored}, the output of the final norm (transformers' "
                 "`hidden_states[N]`, the input of lm_head)") if info["final_hidden"] else ""
    flag_col = ("\n- `has_nonfinite`: bool, the row's states hold NaN/Inf (kept with --nonfinite keep)"
                if cfg.get("nonfinite") == "keep" else "")
    first = info["layers"][0]
    split = cfg.get("split", "?")
    more_cols = scale_cols + final_col + flag_col
    hsx_load = f'''```python
import hsx
# {"streamed from the Hub" if repo else "memory-mapped in place"}: torch rows, (T, 1, {hidden}) states of layer {first}
rows = hsx.load("{where}", layers=[{first}])
ds = hsx.load("{where}")  # {"a datasets.IterableDataset (streaming)" if repo else "a datasets.Dataset, no copy"}
```'''
    plain = f'''```python
import torch
from datasets import load_dataset
ds = load_dataset("{where}", split="train", streaming=True).with_format("torch")
row = next(iter(ds))
{_decode_lines(dtype, num_layers, hidden)}  # (T, layers, hidden), bit-exact
```'''
    if big:
        loading = f"""## Loading
This output holds about **{human_bytes(size)}** of states. A plain `load_dataset("{where}")` first copies all of
it into the HF cache; stream it instead, or read it with hsx:

{hsx_load}

With plain `datasets`, streaming (Arrow has no bfloat16: the states are stored bit-exact as {stored}):

{plain}
"""
    else:
        loading = f"""## Loading
Arrow has no bfloat16: the states are stored bit-exact as {stored}. Local outputs, memory-mapped, no copy:

```python
import hsx
ds = hsx.load("{where}")           # datasets.Dataset over the Arrow files, memory-mapped
rows = hsx.torch_view("{where}")   # rows[i]["hidden_states"]: torch tensor (T, layers, hidden), a view
```

With plain `datasets` (`load_dataset` on a local dir copies it into the cache; `streaming=True` does not):

{plain}
"""
    return f"""---
configs:
- config_name: default
  description: hsx job {fingerprint}
  data_files:
  - split: train
    path: data/train-*.arrow
hsx_fingerprint: {fingerprint or "null"}
tags:
- hsx
- hidden-states
---

# Hidden states of `{info['model']}`

Extracted with hsx {info['hsx_version']}: layers **{layers}** of {info['num_model_layers']}
(hidden size {hidden}){" and the final-norm output" if info["final_hidden"] else ""}, stored as {dtype};
{c['rows_written']:,} rows, {c['tokens_written']:,} tokens, about {human_bytes(size)} of states.

Layer convention: {info['layer_convention']}.

{loading}
## Columns
- `sample_id`: int64, the row's index in the input dataset (`{cfg.get('dataset', '?')}`, split `{split}`)
- `input_ids`: int32 token ids; `loss_mask`: int8, 1 on each assistant token including its end-of-turn token (unshifted)
- `num_tokens`: int32
- `hidden_states`: (T, {num_layers}·{hidden}) {stored}, layers concatenated in the order above{more_cols}

Rows are ordered by length bucket, then `sample_id`. Skipped input rows: {json.dumps(c['skipped'])};
truncated to {info['max_length']} tokens: {c['truncated']}.

Produced by: `{command}`

Job fingerprint: `{fingerprint}` (hsx.json holds the whole job).
"""


def merge(out_dir: str, dirs: list[str], log=print) -> dict[str, Any]:
    """`hsx merge OUT DIR...`: join the dirs that the nodes of one job wrote (each its own, when there is no
    shared filesystem) into OUT. Only metadata is written: OUT/data/ gets relative symlinks to the other dirs'
    unit files (OUT may be one of the dirs), a manifest, hsx.json and the card. No hidden-state byte is copied."""
    sources = [OutputDir(d) for d in dirs]
    jobs = []
    for src in sources:
        f = src.state / "job.json"
        if not f.exists():
            raise HsxError(f"{src.root} holds no hsx job (.hsx/job.json is missing)")
        jobs.append(json.loads(f.read_text()))
    if len({j["fingerprint"] for j in jobs}) != 1:
        raise HsxError("the dirs hold different jobs (their fingerprints differ); merge only one job's dirs")
    summary = next((s for s in (src.read_summary() for src in sources) if s), None)
    if summary is None:
        raise HsxError("no dir has a planning summary (.hsx/summary.json): did the job get past tokenization?")
    done: dict[str, tuple[OutputDir, dict[str, Any]]] = {}
    for src in sources:
        for unit, rec in src.done_units().items():
            done.setdefault(unit, (src, rec))
    missing = [u for u in summary["unit_names"] if u not in done]
    if missing:
        raise HsxError(f"{len(missing)} of {len(summary['unit_names'])} units are in none of the dirs "
                       f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); run the job again to "
                       "write them, then merge")
    out = OutputDir(out_dir)
    out.data.mkdir(parents=True, exist_ok=True)
    out.state.mkdir(parents=True, exist_ok=True)
    lines = []
    for unit in summary["unit_names"]:
        src, rec = done[unit]
        target, link = src.data / rec["file"], out.data / rec["file"]
        if target.resolve() != link.resolve():
            if link.is_symlink() or link.exists():
                link.unlink()
            os.symlink(os.path.relpath(target.resolve(), out.data.resolve()), link)
        lines.append(json.dumps(rec, sort_keys=True))
    atomic_write(out.state / "manifest-merged.jsonl", "\n".join(lines) + "\n")
    atomic_write(out.state / "job.json", json.dumps(jobs[0], indent=2, sort_keys=True))
    out.write_summary(summary)
    info = complete_info(summary, {u: rec for u, (_, rec) in done.items()}, world_size=0,
                         run={"merged_from": [str(Path(d).resolve()) for d in dirs]})
    from hsx.vocab import write_token_frequencies

    info["token_frequencies"] = write_token_frequencies(out, summary.get("vocab_size"))
    out.finalize(info, dataset_card(info, summary["command"]), features=info_features(info))
    log(f"hsx merge: {out_dir}: {info['counts']['rows_written']:,} rows in {len(lines)} units from "
        f"{len(dirs)} dirs (symlinked, nothing copied)")
    return info
