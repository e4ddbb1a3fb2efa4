"""hsx.json, the output's description: what was run, the counts, the layer convention, and (once `complete`) every
file of the output with its rows, bytes and CRC-32. It travels with the data to the Hub, where .hsx/ does not, so a
reader (hsx.load, hsx push) checks what it reads against it.

Its checked record is hsx.schema.Info; this module is the one that reads it (`recorded_info`), writes it
(`write_info`, atomically) and builds it, as datasets' `DatasetInfo` reads, writes and merges dataset_info.json:
`complete_info` makes a finished job's from the planning-time summary (.hsx/summary.json, `read_summary`,
`write_summary`) and the manifests' records, `combine_rank_stats` merges its ranks' throughput into its `run`. The
other readings of it (its file list, the dirs a merge joined, the output schema and size) are here too."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from hsx.errors import HsxError
from hsx.files import atomic_write, read_json
from hsx.schema import RUN_VARIANT_KEYS, Damaged, FileEntry, Info, RunRecord, Summary

INFO = "hsx.json"  # in the output dir's root
SUMMARY = "summary.json"  # in its .hsx/


def recorded_info(root: Path) -> Info | None:
    """hsx.json of the dir `root` (None when there is none yet); HsxError when it is damaged (hsx.files.read_json).
    The users' `hsx.read_info(OUT)` (hsx.load) is the one that says in one line when there is none."""
    f = root / INFO
    return read_json(f, Info) if f.exists() else None


def write_info(root: Path, info: dict[str, Any]) -> None:
    """Write hsx.json atomically (with `complete`, the commit point of the whole job)."""
    atomic_write(root / INFO, json.dumps(info, indent=2) + "\n")


def read_summary(state: Path) -> Summary | None:
    """.hsx/summary.json (None before planning wrote it); HsxError when it is damaged (hsx.files.read_json)."""
    f = state / SUMMARY
    return read_json(f, Summary) if f.exists() else None


def write_summary(state: Path, summary: dict[str, Any]) -> None:
    atomic_write(state / SUMMARY, json.dumps(summary, indent=2, default=str) + "\n")


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



def unit_entry(rec: dict[str, Any]) -> dict[str, Any]:
    """What hsx.json says of one file of the output: readers check names and sizes (and CRCs) against it."""
    return FileEntry(rec["file"], rec["bytes"], rec.get("crc32"), rec.get("unit"), rec.get("rows", 0)).to_dict()



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



def recorded_run_values(root: Path) -> list[RunRecord]:
    """hsx.json's run values (its values_used, else the last run's) as records; none where it has none (the values
    of units an older hsx committed, which kept no .hsx/runs-*.jsonl)."""
    try:
        info = recorded_info(root)
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


def info_features(info: dict[str, Any]):
    """The output schema a (complete_info-built) hsx.json describes (None if it does not say enough)."""
    try:
        return Info.from_dict(info).format.features()
    except Damaged:
        return None


def output_bytes(info: dict[str, Any]) -> int:
    """The states' size: tokens x the state bytes per token (fp8's scales in, top-k columns out; hsx.schema)."""
    fmt = replace(Info.from_dict(info).format, topk=0)
    return int(info["counts"]["tokens_written"]) * fmt.bytes_per_token
