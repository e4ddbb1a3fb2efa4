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
    OUT/.hsx/damaged/                       units a resume found damaged (wrong CRC-32), moved aside and redone

hsx.json lists every file of the finished output (name, unit, rows, bytes, CRC-32): it travels with the data to
the Hub, where .hsx/ does not, so a reader (hsx.load, hsx push) checks what it reads against it.

hsx never writes or deletes through a symbolic link in the dir (.hsx/, data/, hsx.json, README.md and anything
under .hsx/ must be what they seem: a link there is refused in one line). Units under data/ may be links only as
`hsx merge` makes them; deleting one removes the link, never its target.

A unit is written by `map` under .hsx/tmp/, fsynced, then renamed into data/ (and the directory fsynced) before
its manifest line is appended, so a kill at any moment leaves either a whole unit or none. Unit names carry no
"-of-N": resumed and parallel runs add units without renaming any.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hsx.config import COMPUTE_DTYPES, STORAGE_DTYPES, HsxError
from hsx.fingerprint import differing_files

MANIFESTS = "manifest-*.jsonl"  # one per rank: every process appends only to its own
UPLOADED = "uploaded-*.jsonl"  # Hub upload records (hsx.hub): one per rank, and uploaded-push.jsonl


# ---- reading what hsx wrote (which may be damaged, or not hsx's at all) -----------------------------------------

def read_json(path: Path, problem=None) -> dict[str, Any]:
    """A JSON object hsx wrote (hsx.json, .hsx/job.json, .hsx/summary.json), checked by `problem(obj)` (a
    sentence, or None when it is fine). Unreadable, not UTF-8 JSON, not an object, or a key missing or of the
    wrong type: HsxError in one line naming the file, never a KeyError three calls later."""
    try:
        obj = json.loads(Path(path).read_bytes().decode("utf-8"))
    except OSError as e:
        raise HsxError(f"cannot read {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise HsxError(f"{path} is damaged: not valid JSON ({str(e).splitlines()[0][:100]})") from None
    why = ("not a JSON object" if not isinstance(obj, dict) else problem(obj) if problem is not None else None)
    if why:
        raise HsxError(f"{path} is damaged: {why}")
    return obj


def read_jsonl(path: Path, problem) -> Iterator[dict[str, Any]]:
    """The records of a JSON Lines ledger hsx appends to (.hsx/manifest-*.jsonl, .hsx/uploaded-*.jsonl). A line
    that is not JSON is a torn append from a kill (its unit is redone) and is passed over; a whole JSON line that
    is not a valid record (`problem`) was damaged or written by something else: HsxError naming file and line."""
    try:
        blob = Path(path).read_bytes()
    except OSError as e:
        raise HsxError(f"cannot read {path}: {e.strerror or e}") from None
    for number, raw in enumerate(blob.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            continue
        why = "not a JSON object" if not isinstance(rec, dict) else problem(rec)
        if why:
            raise HsxError(f"{path}: line {number} is damaged: {why}")
        yield rec


def _is_int(v: Any, least: int = 0) -> bool:
    return type(v) is int and v >= least


def _first_problem(obj: dict[str, Any], checks: dict[str, tuple[Any, str]]) -> str | None:
    """`checks`: key -> (predicate of its value, what it must be). The first key missing or failing."""
    for key, (ok, must) in checks.items():
        if key not in obj:
            return f"key {key!r} is missing"
        if not ok(obj[key]):
            return f"{key} must be {must}, got {str(obj[key])[:60]!r}"
    return None


def _layers_ok(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(_is_int(i) for i in v) and len(set(v)) == len(v)


_OUTPUT_CHECKS = {
    "model": (lambda v: isinstance(v, str), "a string"),
    "layers": (_layers_ok, "a list of distinct non-negative integers"),
    "hidden_size": (lambda v: _is_int(v, 1), "a positive integer"),
    "num_model_layers": (lambda v: _is_int(v, 1), "a positive integer"),
    "final_hidden": (lambda v: type(v) is bool, "true or false"),
    "storage_dtype": (lambda v: v in STORAGE_DTYPES, f"one of {', '.join(STORAGE_DTYPES)}"),
    "max_length": (lambda v: _is_int(v, 1), "a positive integer"),
    "counts": (lambda v: isinstance(v, dict), "an object"),
    "config": (lambda v: isinstance(v, dict), "an object"),
}
_CONFIG_CHECKS = {  # what readers take from the recorded config (hsx.json's and summary.json's "config")
    "nonfinite": (lambda v: v in ("skip", "keep"), "skip or keep"),
    "topk_logits": (lambda v: _is_int(v), "a non-negative integer"),
    "dtype": (lambda v: v in COMPUTE_DTYPES, f"one of {', '.join(COMPUTE_DTYPES)}"),
}


def _output_problem(obj: dict[str, Any], checks: dict[str, tuple[Any, str]], counts: tuple[str, ...]) -> str | None:
    why = _first_problem(obj, {**_OUTPUT_CHECKS, **checks})
    if why:
        return why
    if max(obj["layers"]) >= obj["num_model_layers"]:
        return f"layers {obj['layers']} do not fit a model of {obj['num_model_layers']} layers"
    config = {k: v for k, v in obj["config"].items() if k in _CONFIG_CHECKS}
    why = _first_problem(config, {k: c for k, c in _CONFIG_CHECKS.items() if k in config})
    if why:
        return "config." + why
    for key in counts:
        if not _is_int(obj["counts"].get(key)):
            return f"counts.{key} must be a non-negative integer, got {obj['counts'].get(key)!r}"
    if not isinstance(obj["counts"].get("skipped"), dict):
        return "counts.skipped must be an object"
    return None


def info_problem(info: dict[str, Any]) -> str | None:
    """What is wrong with an hsx.json (None: every key its readers use is there, of the right type)."""
    return _output_problem(info, {"complete": (lambda v: type(v) is bool, "true or false")},
                           ("rows_in", "rows_written", "tokens_written", "truncated"))


def summary_problem(summary: dict[str, Any]) -> str | None:
    """What is wrong with a .hsx/summary.json (what `hsx merge` and finalization build hsx.json from)."""
    return _output_problem(summary, {
        "unit_names": (lambda v: isinstance(v, list) and all(isinstance(u, str) for u in v), "a list of strings"),
        "command": (lambda v: isinstance(v, str), "a string"),
        "hsx_version": (lambda v: isinstance(v, str), "a string"),
        "layer_convention": (lambda v: isinstance(v, str), "a string")}, ("rows_in", "truncated")) or (
        None if summary.get("vocab_size") is None or (_is_int(summary["vocab_size"], 1)
                                                      and summary["vocab_size"] <= 2**31)
        else "vocab_size must be a positive integer (input_ids are int32)")


def job_problem(job: dict[str, Any]) -> str | None:
    return _first_problem(job, {"fingerprint": (lambda v: isinstance(v, str) and bool(v), "a string"),
                                "inputs": (lambda v: isinstance(v, dict), "an object")})


UNIT_NAME = re.compile(r"[0-9A-Za-z][0-9A-Za-z_.-]*")  # a file name under data/, never a path


def manifest_problem(rec: dict[str, Any]) -> str | None:
    why = _first_problem(rec, {
        "unit": (lambda v: isinstance(v, str) and UNIT_NAME.fullmatch(v) is not None, "a unit name"),
        "file": (lambda v: v == f"train-{rec.get('unit')}.arrow", f"train-{rec.get('unit')}.arrow"),
        "bytes": (_is_int, "a non-negative integer"),
        "rows": (_is_int, "a non-negative integer"),
        "tokens": (_is_int, "a non-negative integer"),
    })
    if why is None and not isinstance(rec.get("crc32", ""), str):
        why = "crc32 must be a string"
    for key in ("skipped_oom", "skipped_nonfinite", "nonfinite_kept"):  # summed into hsx.json's counts
        if why is None and not _is_int(rec.get(key, 0)):
            why = f"{key} must be a non-negative integer"
    return why


def uploaded_problem(rec: dict[str, Any]) -> str | None:
    return _first_problem(rec, {"file": (lambda v: isinstance(v, str), "a path in the repo"),
                                "bytes": (_is_int, "a non-negative integer")})


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
        self.session = uuid.uuid4().hex[:12]  # in this process's manifest lines: which run committed a unit

    def manifest_lines(self) -> Iterator[str]:
        for manifest in sorted(self.state.glob(MANIFESTS)):
            yield from manifest.read_text(errors="replace").splitlines()

    # ---- claiming a dir for a job ----

    @contextmanager
    def locked(self) -> Iterator[None]:
        """One job per dir: an advisory lock on .hsx/lock, released by the kernel if the process dies.

        A non-empty dir that hsx did not write is refused here, before anything (.hsx/) is created in it."""
        self.check_not_foreign()
        self.check_no_links()
        self.state.mkdir(parents=True, exist_ok=True)
        name = "lock" if self.rank == 0 else f"lock-{self.rank:05d}"  # a job's ranks each hold their own
        in_use = f"{self.root} is in use by another hsx job (lock held on .hsx/lock)"
        merging = f"{self.root} is being merged (`hsx merge` holds .hsx/busy)"
        with _flock(self.state / name, fcntl.LOCK_EX, in_use), _flock(self.state / "busy", fcntl.LOCK_SH, merging):
            yield

    @contextmanager
    def locked_whole(self, what: str = "hsx merge") -> Iterator[None]:
        """The whole dir for one process (`hsx merge`): every rank of a running job holds .hsx/busy shared, so
        this exclusive lock is refused while any of them runs (and no job starts while it is held)."""
        self.check_not_foreign()
        self.check_no_links()
        self.state.mkdir(parents=True, exist_ok=True)
        running = f"{self.root} is in use by a running hsx job; {what} once it has finished"
        with _flock(self.state / "lock", fcntl.LOCK_EX, running), _flock(self.state / "busy", fcntl.LOCK_EX, running):
            yield

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
            raise HsxError(f"{self.root} is not empty and was not written by hsx; choose another --output-dir")
        if self.root.exists() and not self.root.is_dir():
            raise HsxError(f"{self.root} is a file, not a folder; choose another --output-dir")

    def has_output(self) -> bool:
        """Whether a job has committed anything here: a manifest line, a data file, or hsx.json."""
        return (any(line.strip() for line in self.manifest_lines()) or any(self.data_files())
                or (self.root / "hsx.json").exists())

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
            old = read_json(job_file, job_problem)
            if old.get("fingerprint") == job["fingerprint"]:
                return self._resume_state(check_crc, log, check)
            if self.has_output():
                raise HsxError(f"{self.root} holds a different job (differs in: {describe_difference(old, job)}); "
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
        damaged = self.check_units(check_crc) if check else []
        expected = (self.read_summary().get("unit_names")
                    or [r["unit"] for r in listed_files(info) or [] if r.get("unit")])
        done = self.done_units()
        missing = [u for u in expected if u not in done]
        if info.get("complete") and not (damaged or missing):
            return "complete"
        if damaged or missing:
            names = damaged or [f"train-{u}.arrow" for u in missing]
            log(f"hsx: {self.root}: {len(damaged)} damaged and {len(missing) - len(damaged)} missing unit(s) "
                f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); they are redone"
                + (" (damaged ones moved to .hsx/damaged/)" if damaged else ""))
        if check and info.get("complete"):  # no longer finished: a reader must not take it for a whole output
            atomic_write(self.root / "hsx.json", json.dumps({**info, "complete": False}, indent=2) + "\n")
        if check and (info.get("complete") or not (self.root / "README.md").exists()):
            self.write_unfinished_card()
        return "resume"

    def check_units(self, all_crc: bool = False) -> list[str]:
        """Check the committed units on disk against their manifest records: the size of every one, and the
        CRC-32 of those the last run of each rank wrote (every unit's with `all_crc`). A unit whose bytes differ
        is moved to .hsx/damaged/ (not deleted), so it is redone; a unit of the wrong size is not counted as done
        (done_units) and is redone. Returns the names of the files moved aside."""
        check = set()
        for manifest in sorted(self.state.glob(MANIFESTS)):
            recs = list(read_jsonl(manifest, manifest_problem))
            last = recs[-1].get("session") if recs else None
            check |= {r["unit"] for r in recs if all_crc or (last is not None and r.get("session") == last)}
        damaged = []
        for unit, rec in self.manifest_records().items():
            f = self.data / rec["file"]
            if unit not in check or not f.exists() or f.stat().st_size != rec["bytes"] or "crc32" not in rec:
                continue
            if file_crc32(f) != rec["crc32"]:
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
                record = json.loads(f.read_text() or "{}")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                continue
            if isinstance(record, dict):
                stats.append(record)
        return stats

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write(self.state / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")

    def read_summary(self) -> dict[str, Any]:
        f = self.state / "summary.json"
        return read_json(f, summary_problem) if f.exists() else {}

    def read_info(self) -> dict[str, Any]:
        """hsx.json ({} when there is none yet); HsxError when it is damaged (see `read_json`)."""
        f = self.root / "hsx.json"
        return read_json(f, info_problem) if f.exists() else {}

    # ---- units ----

    def manifest_records(self) -> dict[str, dict[str, Any]]:
        """Every committed unit's manifest record (every rank's), by unit name; whether its file is still here
        or not."""
        records = {}
        for manifest in sorted(self.state.glob(MANIFESTS)):
            for rec in read_jsonl(manifest, manifest_problem):  # a torn line from a kill: that unit is redone
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
            elif uploaded_matches(uploaded.get(f"data/{rec['file']}"), rec) and not (
                    self.state / "damaged" / rec["file"]).exists():  # (gone after its upload, not moved aside)
                done[unit] = rec
        return done

    # ---- upload bookkeeping (hsx.hub) ----

    def uploaded(self) -> dict[str, dict[str, Any]]:
        """What Hub pushes recorded as committed on the Hub, by path in the repo (`data/train-....arrow`): the last
        record of each path over every .hsx/uploaded-*.jsonl (one per rank, and one for `hsx push`)."""
        records: dict[str, dict[str, Any]] = {}
        for ledger in sorted(self.state.glob(UPLOADED)):
            for rec in read_jsonl(ledger, uploaded_problem):  # a torn line: uploaded again (a no-op on the Hub)
                records[rec["file"]] = rec
        return records

    def record_uploaded(self, records: list[dict[str, Any]], name: str | None = None) -> None:
        """Append upload records to .hsx/uploaded-<name>.jsonl (default: this rank's) and fsync: called only after
        the Hub confirmed the commit, and before any local file is deleted."""
        if not records:
            return
        self.state.mkdir(parents=True, exist_ok=True)
        name = name or f"{self.rank:05d}"
        append_synced(self.state / f"uploaded-{name}.jsonl", "".join(json.dumps(r, sort_keys=True) + "\n"
                                                                      for r in records))

    def clear_tmp(self) -> None:
        """Partial units a killed run of this rank left behind (never committed, so never counted)."""
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)

    def unit_tmp(self, unit: str) -> Path:
        self.tmp.mkdir(parents=True, exist_ok=True)
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
        torn = manifest.exists() and manifest.stat().st_size > 0 and not manifest.read_bytes().endswith(b"\n")
        # After a kill mid-append the last line is torn: end it, so this record starts a line of its own.
        append_synced(manifest, ("\n" if torn else "") + json.dumps(record, sort_keys=True) + "\n")

    def data_files(self) -> list[Path]:
        return sorted(self.data.glob("train-*.arrow"))

    def file_problem(self, entry: dict[str, Any], crc: bool = False) -> str | None:
        """What is wrong with one file hsx.json (or a manifest) lists, None if nothing: 'uploaded' for a unit
        deleted after its upload (--delete-after-upload), else a few words. `crc`: read it whole and compare its
        CRC-32 too."""
        f = self.data / entry["file"]
        if not f.exists():
            return "uploaded" if uploaded_matches(self.uploaded().get(f"data/{entry['file']}"), entry) else "missing"
        if f.stat().st_size != entry["bytes"]:
            return f"{f.stat().st_size} bytes, not {entry['bytes']}"
        if crc and entry.get("crc32") and file_crc32(f) != entry["crc32"]:
            return "its bytes do not match its CRC-32"
        return None

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

    def submit(self, unit: str, record: dict[str, Any], crc32: str | None = None) -> None:
        self.check()
        self.queue.put((unit, record, crc32))

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
    info.update(units=len(summary["unit_names"]), world_size=world_size, run=run or {}, complete=True,
                files=[unit_entry(done[u]) for u in summary["unit_names"] if u in done])
    return info


def listed_files(info: dict[str, Any]) -> list[dict[str, Any]] | None:
    """hsx.json's `files` (None for an older hsx's hsx.json, which has none); a damaged list is one HsxError."""
    files = info.get("files")
    if files is None:
        return None
    def ok(e) -> bool:  # a plain name inside data/ (never a path out of it), a size, a CRC-32
        name = e.get("file") if isinstance(e, dict) else None
        return (isinstance(name, str) and "/" not in name and name[:1] not in ("", ".")
                and isinstance(e.get("bytes"), int) and isinstance(e.get("crc32"), (str, type(None)))
                and (e.get("unit") is None or (isinstance(e["unit"], str) and UNIT_NAME.fullmatch(e["unit"]))))

    if not isinstance(files, list) or not all(ok(e) for e in files):
        raise HsxError("hsx.json's `files` is damaged (each entry needs a file name in data/, bytes and crc32)")
    return files


def unit_entry(rec: dict[str, Any]) -> dict[str, Any]:
    """What hsx.json says of one file of the output: readers check names and sizes (and CRCs) against it."""
    return {"file": rec["file"], "unit": rec.get("unit"), "rows": rec.get("rows", 0), "bytes": rec["bytes"],
            "crc32": rec.get("crc32")}


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


def _open_no_follow(path: Path, flags: int) -> int:
    """os.open that never opens a link's target: a link at `path` fails (ELOOP) instead of being written through."""
    return os.open(path, flags | os.O_NOFOLLOW, 0o644)


@contextmanager
def _flock(path: Path, how: int, busy: str) -> Iterator[None]:
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
        view = memoryview(text.encode())
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def append_synced(path: Path, text: str) -> None:
    _write_synced(path, text, os.O_APPEND)


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    if tmp.is_symlink():
        tmp.unlink()  # (the link, never its target)
    _write_synced(tmp, text, os.O_TRUNC)
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


STORAGE_EXACTNESS = {  # what the card says of the stored states, per --storage-dtype
    "bfloat16": "stored bit-exact as the int16 bits of bfloat16 (Arrow has no bfloat16)",
    "float16": "converted to float16 (exact for bfloat16 values with |x| in ~[6e-5, 65504]; outside it, not)",
    "float32": "stored as float32 (exact for bfloat16 and float16 compute)",
    "float8_e4m3": "quantized to float8_e4m3fn, stored as its uint8 bits with a float32 scale per token and layer "
                   "(x ≈ q * scale, lossy: a 3-bit mantissa)",
}


UNFINISHED = "data/NOT-FINISHED-run-the-same-hsx-extract-command-to-finish.arrow"
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


def card_paths(info: dict[str, Any]) -> str:
    """The card's data_files: exactly the files hsx.json lists, so `load_dataset` reads the committed units only
    and fails on a missing one instead of returning fewer rows (a glob, without hsx.json's list)."""
    files = [f["file"] for f in info.get("files") or []]
    if not files:
        return " data/train-*.arrow"
    return "".join(f"\n    - data/{name}" for name in files)


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
    exactness = STORAGE_EXACTNESS.get(dtype, f"stored as {dtype}")
    stream_arg = ", streaming=True" if repo else ""
    view_note = "bfloat16, dequantized" if dtype == "float8_e4m3" else "a view"
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
rows = hsx.load("{where}", layers=[{first}]{stream_arg})
ds = hsx.load("{where}"{stream_arg})  # {"a datasets.IterableDataset" if repo else "a datasets.Dataset, no copy"}
```'''
    plain = f'''```python
import torch
from datasets import load_dataset
ds = load_dataset("{where}", split="train", streaming=True).with_format("torch")
row = next(iter(ds))
{_decode_lines(dtype, num_layers, hidden)}  # (T, layers, hidden){", bit-exact" if dtype == "bfloat16" else ""}
```'''
    if big:
        loading = f"""## Loading
This output holds about **{human_bytes(size)}** of states. A plain `load_dataset("{where}")` first copies all of
it into the HF cache; stream it instead, or read it with hsx:

{hsx_load}

With plain `datasets`, streaming (the states are {exactness}):

{plain}
"""
    else:
        loading = f"""## Loading
The states are {exactness}. Local outputs, memory-mapped, no copy:

```python
import hsx
ds = hsx.load("{where}")           # datasets.Dataset over the Arrow files, memory-mapped
rows = hsx.torch_view("{where}")   # rows[i]["hidden_states"]: torch tensor (T, layers, hidden), {view_note}
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
    path:{card_paths(info)}
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
    unit files (OUT may be one of the dirs), a manifest, hsx.json and the card. No hidden-state byte is copied.

    Like extract, it holds every dir whole while it works (refused while a job runs in any of them), refuses an
    OUT that hsx did not write or that holds another job, and never deletes or replaces a file in OUT/data/
    (only links an earlier merge made): OUT's own unit of a name is the one kept."""
    from contextlib import ExitStack

    out = OutputDir(out_dir)
    sources = [OutputDir(d) for d in dirs]
    with ExitStack() as stack:
        seen = set()
        for d in [out, *sources]:
            if d.root.resolve() not in seen:  # (one lock per dir: OUT may be one of the sources)
                seen.add(d.root.resolve())
                stack.enter_context(d.locked_whole())
        return _merge(out, sources, dirs, log)


def _merge(out: OutputDir, sources: list[OutputDir], dirs: list[str], log) -> dict[str, Any]:
    jobs = []
    for src in sources:
        f = src.state / "job.json"
        if not f.exists():
            raise HsxError(f"{src.root} holds no hsx job (.hsx/job.json is missing)")
        jobs.append(read_json(f, job_problem))
    if len({j["fingerprint"] for j in jobs}) != 1:
        raise HsxError("the dirs hold different jobs (their fingerprints differ); merge only one job's dirs")
    own = out.state / "job.json"
    if own.exists() and read_json(own, job_problem)["fingerprint"] != jobs[0]["fingerprint"] \
            and out.has_output():
        raise HsxError(f"{out.root} holds another job's output; merge into a new dir or one of the job's dirs")
    summary = next((s for s in (src.read_summary() for src in sources) if s), None)
    if summary is None:
        raise HsxError("no dir has a planning summary (.hsx/summary.json): did the job get past tokenization?")
    done: dict[str, tuple[OutputDir, dict[str, Any]]] = {}
    if own.exists():
        done = {u: (out, rec) for u, rec in out.done_units().items() if (out.data / rec["file"]).exists()
                and not (out.data / rec["file"]).is_symlink()}  # OUT's own files are kept, never replaced
    for src in sources:
        for unit, rec in src.done_units().items():
            if (src.data / rec["file"]).exists():
                done.setdefault(unit, (src, rec))
    missing = [u for u in summary["unit_names"] if u not in done]
    if missing:
        raise HsxError(f"{len(missing)} of {len(summary['unit_names'])} units are in none of the dirs "
                       f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); run the job again to "
                       "write them, then merge")
    out.data.mkdir(parents=True, exist_ok=True)
    lines = []
    for unit in summary["unit_names"]:
        src, rec = done[unit]
        target, link = src.data / rec["file"], out.data / rec["file"]
        if src is not out and target.resolve() != link.resolve():
            if link.exists() and not link.is_symlink():
                raise HsxError(f"{link} is not a unit of this job's dirs; move it away, then merge")
            if link.is_symlink():
                link.unlink()  # a link of an earlier merge (the link only)
            os.symlink(os.path.relpath(target.resolve(), out.data.resolve()), link)
        lines.append(json.dumps(rec, sort_keys=True))
    atomic_write(out.state / "manifest-merged.jsonl", "\n".join(lines) + "\n")
    atomic_write(out.state / "job.json", json.dumps(jobs[0], indent=2, sort_keys=True))
    out.write_summary(summary)
    info = complete_info(summary, {u: rec for u, (_, rec) in done.items()}, world_size=0,
                         run={"merged_from": [str(Path(d).resolve()) for d in dirs]})
    from hsx.vocab import write_token_frequencies

    info["token_frequencies"] = write_token_frequencies(out, summary.get("vocab_size"))
    out.finalize(info, lambda i: dataset_card(i, summary["command"]), features=info_features(info))
    log(f"hsx merge: {out.root}: {info['counts']['rows_written']:,} rows in {len(lines)} units from "
        f"{len(dirs)} dirs (symlinked, nothing copied)")
    return info
