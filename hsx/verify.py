"""`hsx verify OUT`: trust, but check. Re-reads an output dir and recomputes rows with the reference forward.

Checks, in order: hsx.json says complete; its file list, the manifests, the counts and data/ agree, and no
file is a link but those `hsx merge` makes; the schema matches the recorded layers and hidden size; each data
file matches its manifest line (size, CRC-32, rows); the row and token counts match hsx.json; no `sample_id`
repeats; no row is longer than the job's max_length; every row's columns have `num_tokens` entries; and K random
rows recomputed by the reference — the full-depth model on one sample, unpadded: `output_hidden_states[i+1]` for
layer i < N-1, a hook for the pre-norm output of layer N-1, `hidden_states[N]` for `final_hidden_state` — agree
within a relative error (Frobenius, per layer). Any mismatch is a non-zero exit.

Trust comes from the command line only: OUT is data, and its hsx.json may name any folder and say
`trust_remote_code: true`. The reference is `--model PATH` when given, else the folder hsx.json records, and its
own code runs only with `--trust-remote-code`, which needs `--model` (the model whose code runs is the one the
user named, never one the output dir names). A job that ran remote code cannot be recomputed without both.

`--against-bf16 N` (FP8 targets, `against_bf16`): N rows spread over the output run again, FP8 and on the
dequantized weights in bf16 (hsx.target.drift); per stored state, stored vs bf16, FP8 vs bf16 and stored vs FP8.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hsx import ledgers
from hsx.errors import HsxError, VerifyFailed
from hsx.info import recorded_info
from hsx.schema import Info

TRUST_NEEDS_MODEL = ("--trust-remote-code needs --model PATH: verify runs code only from a model named on the "
                     "command line, never from the one OUT's hsx.json names")
RAN_REMOTE_CODE = ("the job ran the model's own code (trust_remote_code), and verify takes no trust from hsx.json: "
                   "pass --model PATH --trust-remote-code")


def verify(out_dir: str, samples: int = 8, tolerance: float = 2e-2, seed: int = 0, log=print,
           model: str | None = None, trust_remote_code: bool = False) -> dict[str, Any]:
    """`model` / `trust_remote_code`: the reference model and whether its own code may run (from the command
    line; see the module docstring)."""
    import pyarrow.compute as pc

    from hsx.config import HsxError
    from hsx.errors import check_range
    from hsx.ledgers import uploaded_matches
    from hsx.load import open_checked_files, torch_view
    from hsx.sink import OutputDir

    check_range("samples", samples, 0, 2**31 - 1)
    check_range("seed", seed, 0, 2**32 - 1)  # (numpy's seeds)
    check_range("tolerance", tolerance, 0, integer=False)

    if trust_remote_code and not model:
        raise HsxError(TRUST_NEEDS_MODEL)
    out = OutputDir(out_dir)
    problems: list[str] = []
    try:
        info = recorded_info(out.root)
        records = ledgers.manifest_records(out.state)
        uploaded = ledgers.uploaded(out.state)
    except HsxError as e:
        raise VerifyFailed(str(e)) from None
    if info is None or not info.complete:
        raise VerifyFailed(f"{out_dir}: hsx.json is missing or the job is not complete")
    try:  # hsx.json's list, the manifests, the counts and data/ agree; no link is read but `hsx merge`'s
        out.check_finished(info)
        sources: dict = {}
        files = [out.unit_source(f.name, info, sources) for f in out.data_files()]
    except HsxError as e:
        raise VerifyFailed(str(e)) from None
    # Files against the manifest first (size, CRC-32): a damaged file is named here, before anything parses it.
    for f in files:
        rec = next((r for r in records.values() if r["file"] == f.name), None)
        if rec is None:
            if info.counts.rows_written == 0 and f.name == "train-000-00000.arrow":
                continue  # the empty file of an output with no usable rows
            problems.append(f"{f.name} is not in the manifest")
            continue
        if f.stat().st_size != rec["bytes"]:
            problems.append(f"{f.name}: {f.stat().st_size} bytes, manifest says {rec['bytes']}")
        elif "crc32" in rec and _crc_of_approved(out, f) != rec["crc32"]:
            problems.append(f"{f.name}: CRC-32 differs from the manifest (the file changed after it was written)")
    missing = {r["file"] for r in records.values()
               if not uploaded_matches(uploaded.get("data/" + r["file"]), r)} - {f.name for f in files}
    used_up = ledgers.used_up(out.root, [r for r in records.values() if r["file"] in missing]) if missing else None
    if used_up:
        raise VerifyFailed(used_up)
    consumed = ledgers.consumed(out.state) if missing else {}
    eaten = [r["file"] for r in records.values()
             if r["file"] in missing and uploaded_matches(consumed.get(r["file"]), r)]
    if eaten:  # (as hsx.load says it)
        raise VerifyFailed(f"{out_dir}: {len(eaten)} unit(s) were deleted once a trainer consumed them (hsx.follow "
                           f"with delete_consumed: {eaten[0]}, ...); this dir holds only part of the output")
    problems += [f"{name} is in the manifest but missing" for name in sorted(missing)]
    if problems:
        raise VerifyFailed(f"{len(problems)} problem(s): " + "; ".join(problems[:10]))

    try:
        ds = open_checked_files(out, files)  # every file on disk, not only those hsx.json lists (as hsx.load reads)
    except HsxError as e:
        raise VerifyFailed(str(e)) from None
    except Exception as e:  # noqa: BLE001  (any unreadable file is a failed verification, in one line)
        raise VerifyFailed(f"cannot read the data files: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    expected = info.format.features()
    if ds.features.arrow_schema != expected.arrow_schema:
        problems.append(f"schema {ds.features} differs from the expected {expected}")

    ids = np.asarray(ds.data.column("sample_id").to_numpy())
    if len(ids) != info.counts.rows_written:
        problems.append(f"{len(ids)} rows, hsx.json says {info.counts.rows_written}")
    if len(np.unique(ids)) != len(ids):
        problems.append(f"{len(ids) - len(np.unique(ids))} sample_id(s) repeat")
    num_tokens = ds.data.column("num_tokens").to_numpy()
    if len(num_tokens) and int(num_tokens.max()) > info.max_length:  # (hsx cuts every row at it: not hsx's rows,
        longer = int((num_tokens > info.max_length).sum())          # and the recompute would run them whole)
        problems.append(f"{longer} row(s) are longer than the job's max_length {info.max_length} (up to "
                        f"{int(num_tokens.max()):,} tokens)")
    if int(num_tokens.sum()) != info.counts.tokens_written:
        problems.append(f"{int(num_tokens.sum())} tokens, hsx.json says {info.counts.tokens_written}")
    for col in ["input_ids", "loss_mask"] + [c.name for c in info.format.state_columns()]:  # (every per-token column)
        lengths = pc.list_value_length(ds.data.column(col)).to_numpy(zero_copy_only=False)
        if not np.array_equal(lengths, num_tokens):
            differ = int((lengths != num_tokens).sum())
            problems.append(f"column {col}: lengths differ from num_tokens in {differ} rows")

    errors: dict[str, float] = {}
    if samples and len(ds):
        recorded = info.model_path
        if not model and info.config.get("trust_remote_code") is not False:
            problems.append(f"cannot recompute rows: {RAN_REMOTE_CODE}")
        elif not model and not (isinstance(recorded, str) and recorded and Path(recorded).is_dir()):
            problems.append(f"cannot recompute rows: model folder {recorded!r} is not here; pass --model PATH")
        else:
            errors = _recompute(info, torch_view(out_dir), samples, seed, model or recorded, trust_remote_code)
            for name, err in errors.items():
                if not err <= tolerance:
                    problems.append(f"{name}: relative error {err:.3g} > {tolerance:g}")
    report = {"rows": len(ds), "files": len(files), "samples": min(samples, len(ds)), "worst_relative_error": errors,
              "problems": problems}
    if errors:
        log("hsx verify: worst relative error per layer: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    if problems:
        raise VerifyFailed(f"{len(problems)} problem(s): " + "; ".join(problems[:10]))
    log(f"hsx verify: {out_dir} is consistent: {len(ds):,} rows in {len(files)} files, "
        f"{min(samples, len(ds))} rows recomputed within {tolerance:g}")
    return report


def _crc_of_approved(out, f: Path) -> str:
    """CRC-32 of a unit read through the fd `OutputDir.open_unit` checks (the file unit_source approved, no link)."""
    import os

    from hsx.checksums import file_crc32
    from hsx.config import HsxError

    try:
        fd = out.open_unit(f)
    except HsxError as e:
        raise VerifyFailed(str(e)) from None
    try:
        return file_crc32(f, fd)
    finally:
        os.close(fd)


def _recompute(info: Info, rows, samples: int, seed: int, model_path: str,
               trust_remote_code: bool) -> dict[str, float]:
    import torch
    from transformers import AutoModel

    from hsx.target.checkpoint import check_checkpoint
    from hsx.target.fp8 import carry_quantization
    from hsx.target.model import TORCH_DTYPES, decoder_layers, read_model_config, resolve_model_path, text_config_of

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # as extract loads it: its small files and its config.json bounded before transformers reads them, its stored
    # tensors checked against its quantization (HsxError)
    path, _ = resolve_model_path(model_path, None, trust_remote_code)
    config = read_model_config(path, model_path, trust_remote_code)
    check_checkpoint(path, model_path, carry_quantization(config, text_config_of(config)))
    try:
        model = AutoModel.from_pretrained(path, config=config, dtype=TORCH_DTYPES[info.config.dtype],
                                          use_safetensors=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise VerifyFailed(f"cannot load the reference model {model_path}: {str(e).strip().splitlines()[0]}"
                           if str(e).strip() else f"cannot load the reference model {model_path}") from None
    model = model.to(device).eval()
    n = info.num_model_layers
    if len(decoder_layers(model)) != n:
        raise VerifyFailed(f"the reference model {model_path} has {len(decoder_layers(model))} layers; the output "
                           f"was extracted from one with {n}")
    last = {}
    hook = decoder_layers(model)[n - 1].register_forward_hook(
        lambda m, a, o: last.__setitem__("out", o[0] if isinstance(o, tuple) else o))
    worst: dict[str, float] = {}
    picks = np.random.default_rng(seed).choice(len(rows), min(samples, len(rows)), replace=False)
    try:
        with torch.inference_mode():
            for i in picks:
                row = rows[int(i)]
                if row.get("has_nonfinite"):
                    continue  # kept on purpose (--nonfinite keep): the reference is non-finite there too
                ids = row["input_ids"].long()[None].to(device)
                out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
                for j, layer in enumerate(info.layers):
                    ref = out.hidden_states[layer + 1] if layer < n - 1 else last["out"]
                    _worst(worst, f"layer {layer}", row["hidden_states"][:, j], ref[0])
                if "final_hidden_state" in row:
                    _worst(worst, "final_hidden_state", row["final_hidden_state"], out.hidden_states[n][0])
    finally:
        hook.remove()
    return worst


def _worst(worst: dict[str, float], name: str, got, ref) -> None:
    got, ref = got.float().cpu(), ref.float().cpu()
    if got.shape != ref.shape:  # a --model of another hidden size
        worst[name] = float("inf")
        return
    err = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
    if not np.isfinite(err):
        err = float("inf")
    worst[name] = max(worst.get(name, 0.0), err)



# ---- FP8 against bf16 -----------------------------------------------------------------------------------------------

def against_bf16(out_dir: str, rows: int, model: str | None = None, trust_remote_code: bool = False,
                 log=print) -> dict[str, Any]:
    """How far an FP8 target's stored states are from its bf16 model's (`hsx verify OUT --against-bf16 N`).

    `rows` rows spread evenly over the output (hsx.target.drift.spread_rows; more than the output holds: all of them)
    run
    again through the target as hsx loads it for extraction (hsx.target.model.load_model, the job's layers and dtype,
    its experts implementation for this device): the FP8 forward, and the bf16 forward of the same dequantized
    weights (hsx.target.drift). Per stored state: stored vs bf16 (what was asked), fresh FP8 vs bf16 (the drift FP8
    adds on this device) and stored vs fresh FP8 (storage and kernel differences), over all tokens and over the
    loss-masked ones. The model is the folder hsx.json records, or `model`; either must have the files the job's
    fingerprint records. Refused (HsxError) when the target is not FP8."""
    import torch

    from hsx.config import EXPERTS_CHOICES, config_from
    from hsx.errors import check_range
    from hsx.load import torch_view
    from hsx.sink import OutputDir
    from hsx.target import drift, fp8, fp8_model
    from hsx.target.model import load_model, read_model_config, text_config_of
    from hsx.target.moe import resolve_experts, use_experts

    check_range("--against-bf16", rows, 1, 2**31 - 1)
    if trust_remote_code and not model:
        raise HsxError(TRUST_NEEDS_MODEL)
    out = OutputDir(out_dir)
    info = recorded_info(out.root)
    if info is None or not info.complete:
        raise HsxError(f"{out_dir}: hsx.json is missing or the job is not complete")
    job = _job_record(out)
    recorded_quant = _recorded_quantization(info, job)
    not_fp8 = (f"{out_dir} was extracted from {info.model}, which is not an FP8 checkpoint (no quantization_config "
               "with quant_method fp8): --against-bf16 compares an FP8 target's states with its bf16 model's")
    folder = model or info.model_path
    if not (isinstance(folder, str) and folder and Path(folder).is_dir()):
        if recorded_quant is False:  # (what the output records says enough)
            raise HsxError(not_fp8)
        raise HsxError(f"model folder {folder!r} is not here" + ("" if model else
                       " (hsx.json records it); pass --model PATH, a folder with the same files"))
    if not model and info.config.get("trust_remote_code") is not False:
        raise HsxError(RAN_REMOTE_CODE)
    _check_model_identity(job, out.state / "job.json", info, folder, trust_remote_code, log)
    full = read_model_config(folder, folder, trust_remote_code)
    quant = fp8.quantization_of(fp8.carry_quantization(full, text_config_of(full)))  # (the folder decides)
    if quant is None:
        raise HsxError(not_fp8)

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    experts = info.config.get("experts_implementation")
    cfg = config_from({"model": folder, "layers": list(info.layers), "final_hidden": info.final_hidden,
                       "dtype": info.config.dtype, "compile": "off", "trust_remote_code": trust_remote_code,
                       "experts_implementation": experts if experts in EXPERTS_CHOICES else "auto"}, required=())
    loaded = load_model(cfg, device)
    if (loaded.num_model_layers, loaded.layers, loaded.hidden_size) != (info.num_model_layers,
                                                                          sorted(info.layers), info.hidden_size):
        raise HsxError(f"{folder} has {loaded.num_model_layers} layers of {loaded.hidden_size}; the output was "
                       f"extracted from one with {info.num_model_layers} of {info.hidden_size}")
    use_experts(loaded.base, resolve_experts(cfg.experts_implementation, device.type == "cuda"))
    instead = fp8.runs_instead(quant, device)
    if instead:
        log(instead)

    view = torch_view(out_dir)
    picks = drift.spread_rows(len(view), rows)
    if rows > len(view):
        log(f"hsx verify: --against-bf16 {rows}: the output holds {len(view)} rows; all of them are compared")
    names = drift.state_names(loaded.layers, loaded.final_hidden)  # (hidden_states holds them in this order)
    chosen, sample_ids, nonfinite = [], [], 0
    for i in picks:
        row = view[int(i)]
        if row.get("has_nonfinite"):
            nonfinite += 1  # kept on purpose (--nonfinite keep): no error is defined there
            continue
        stored = {name: row["hidden_states"][:, j] for j, name in enumerate(names[:len(loaded.layers)])}
        if info.final_hidden:
            stored[drift.FINAL] = row["final_hidden_state"]
        chosen.append(drift.DriftRow(row["input_ids"], row["loss_mask"], stored))
        sample_ids.append(int(row["sample_id"]))
    if not chosen:
        raise HsxError(f"{out_dir}: no row to compare ({len(view)} rows, {nonfinite} chosen with non-finite states)")
    result = drift.compare(loaded.base, loaded.layers, loaded.final_hidden, chosen, device)
    report = {"output_dir": str(out_dir), "model": folder, "device": str(device), "sample_ids": sample_ids,
              "skipped_nonfinite": nonfinite, "storage_dtype": info.storage_dtype,
              "quantization": quant.record(), "extracted_with": recorded_quant or None,
              "runs_here": fp8_model.report(loaded.base, quant),
              **result}
    report["notes"] = _drift_notes(report, instead)
    for line in format_drift(report):
        log(line)
    return report


def _job_record(out):
    from hsx.fingerprint import recorded_job

    return recorded_job(out.state)


def _recorded_quantization(info: Info, job) -> dict | bool | None:
    """How the output records its target's quantization: hsx.json's run.kernels.quantization (how the linear
    layers and experts ran), else the job fingerprint's; False where the fingerprint says none (not FP8); None
    where neither says (an older output: the model folder's config decides)."""
    run = info.raw.get("run") if isinstance(info.raw, dict) else None
    kernels = run.get("kernels") if isinstance(run, dict) else None
    quant = kernels.get("quantization") if isinstance(kernels, dict) else None
    if isinstance(quant, dict) and quant.get("quant_method") == "fp8":
        return quant
    if job is not None:
        q = job.inputs.get("quantization")
        if isinstance(q, dict) and q.get("quant_method") == "fp8":
            return q
        return False
    return None


def _check_model_identity(job, job_file, info: Info, folder: str, trust_remote_code: bool, log) -> None:
    """HsxError unless `folder` holds the files (by size and sha256) the job's fingerprint (`job`, read from
    `job_file`) records for its model; a job that named a Hub model records its id and commit: the folder must be
    that commit's snapshot. A record that says neither is refused, never taken as leave to skip the check."""
    from hsx.fingerprint import MODEL_SUFFIXES, differing_files, folder_identity
    from hsx.target.model import HUB_COMMIT

    recorded = job.inputs.get("model") if job is not None else None
    if isinstance(recorded, dict):
        files = differing_files(recorded, folder_identity(folder, MODEL_SUFFIXES + ((".py",) if trust_remote_code
                                                                                    else ())))
        if files:
            raise HsxError(f"model folder {folder} differs from the one the output was extracted from (by the job's "
                           f"fingerprint: {', '.join(files[:3])}{', ...' if len(files) > 3 else ''})")
    elif isinstance(recorded, str):
        revision = job.inputs.get("revision")
        if not (isinstance(revision, str) and HUB_COMMIT.fullmatch(revision)):  # (hsx records a Hub model's
            # commit with its id, always: its snapshot folder's name)
            raise HsxError(f"{job_file}: the model {recorded[:100]!r} is recorded without its commit (a 40-digit hex "
                           f"hash, not {str(revision)[:60]!r}), so model folder {folder} cannot be checked against "
                           "it; the job record is damaged")
        if Path(folder).resolve().name != revision:
            raise HsxError(f"model folder {folder} is not the snapshot of {recorded} at commit {revision} that the "
                           "output was extracted from")
    elif job is not None:  # (hsx records a local model folder by its files, a Hub model by its id)
        raise HsxError(f"{job_file}: its model is neither a Hub id nor a folder's files, so model folder {folder} "
                       "cannot be checked against it; the job record is damaged")
    else:
        log(f"hsx verify: {info.model}: the output records no fingerprint of its model; {folder} is used unchecked")


def _drift_notes(report: dict[str, Any], instead: str | None) -> list[str]:
    notes = []
    if instead and not report["switched"]:
        notes.append("this device runs the dequantized weights, so its FP8 forward is the bf16 one: fp8_vs_bf16 "
                     "is 0 by construction, stored_vs_fp8 equals stored_vs_bf16")
    ran = report.get("extracted_with") or {}
    linear = str(ran.get("linear", "")) if isinstance(ran, dict) else ""
    if instead and not report["switched"] and linear.startswith(("hsx fp8", "transformers fp8")):
        notes.append(f"the extraction ran FP8 ({linear}): stored_vs_bf16 holds its FP8 drift; run on a GPU with "
                     "FP8 tensor cores to tell it from storage error")
    if report["switched"] and linear.startswith("dequantized"):
        notes.append("the extraction ran the dequantized weights (hsx.json): the stored states are the bf16 model's, "
                     "not FP8 serving's")
    if report["storage_dtype"] == "float8_e4m3":
        notes.append("the states are stored in float8_e4m3 (per-token scales): every stored_* number includes that "
                     "storage's rounding")
    return notes


def format_drift(report: dict[str, Any]) -> list[str]:
    """The lines `hsx verify --against-bf16` prints: a header, one table row per stored state, the notes."""
    rel, masked = report["relative_error"], report["relative_error_masked"]
    lines = [f"hsx verify: FP8 vs bf16 on {report['rows']} rows ({report['tokens']:,} tokens, "
             f"{report['masked_tokens']:,} loss-masked); relative error ||a - b|| / ||b|| per stored state, "
             "b the second named:"]
    cols = [("stored vs bf16", rel, "stored_vs_bf16"), ("(masked)", masked, "stored_vs_bf16"),
            ("FP8 vs bf16", rel, "fp8_vs_bf16"), ("(masked)", masked, "fp8_vs_bf16"),
            ("stored vs FP8", rel, "stored_vs_fp8")]
    names = list(rel.get("fp8_vs_bf16", {}))
    width = max([len("layer")] + [len(n) for n in names])
    lines.append("  " + "layer".ljust(width) + "".join(f"  {c[0]:>14}" for c in cols))
    for name in names:
        cells = []
        for _, table, key in cols:
            v = table.get(key, {}).get(name)
            cells.append(f"  {'-' if v is None else f'{v:.3e}':>14}")
        lines.append("  " + name.ljust(width) + "".join(cells))
    lines += [f"  note: {n}" for n in report["notes"]]
    return lines
