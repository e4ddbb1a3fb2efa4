"""`hsx verify OUT`: trust, but check. Re-reads an output dir and recomputes rows with the reference forward.

Checks, in order: hsx.json says complete; its file list, the manifests, the counts and data/ agree, and no
file is a link but those `hsx merge` makes; the schema matches the recorded layers and hidden size; each data
file matches its manifest line (size, CRC-32, rows); the row and token counts match hsx.json; no `sample_id`
repeats; every row's columns have `num_tokens` entries; and K random rows recomputed by the reference — the
full-depth model on one sample, unpadded: `output_hidden_states[i+1]` for layer i < N-1, a hook for the pre-norm
output of layer N-1, `hidden_states[N]` for `final_hidden_state` — agree within a relative error (Frobenius,
per layer). Any mismatch is a non-zero exit.

Trust comes from the command line only: OUT is data, and its hsx.json may name any folder and say
`trust_remote_code: true`. The reference is `--model PATH` when given, else the folder hsx.json records, and its
own code runs only with `--trust-remote-code`, which needs `--model` (the model whose code runs is the one the
user named, never one the output dir names). A job that ran remote code cannot be recomputed without both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hsx.errors import VerifyFailed
from hsx.schema import Info


def verify(out_dir: str, samples: int = 8, tolerance: float = 2e-2, seed: int = 0, log=print,
           model: str | None = None, trust_remote_code: bool = False) -> dict[str, Any]:
    """`model` / `trust_remote_code`: the reference model and whether its own code may run (from the command
    line; see the module docstring)."""
    import pyarrow.compute as pc

    from hsx.config import HsxError
    from hsx.errors import check_range
    from hsx.load import open_checked_files, torch_view
    from hsx.sink import OutputDir, uploaded_matches

    check_range("samples", samples, 0, 2**31 - 1)
    check_range("seed", seed, 0, 2**32 - 1)  # (numpy's seeds)
    check_range("tolerance", tolerance, 0, integer=False)

    if trust_remote_code and not model:
        raise HsxError("--trust-remote-code needs --model PATH: verify runs code only from a model named on the "
                       "command line, never from the one OUT's hsx.json names")
    out = OutputDir(out_dir)
    problems: list[str] = []
    try:
        info = out.read_info()
        records = out.manifest_records()
        uploaded = out.uploaded()
    except HsxError as e:
        raise VerifyFailed(str(e)) from None
    if info is None or not info.complete:
        raise VerifyFailed(f"{out_dir}: hsx.json is missing or the job is not complete")
    final = info.final_hidden
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
    used_up = out.used_up([r for r in records.values() if r["file"] in missing]) if missing else None
    if used_up:
        raise VerifyFailed(used_up)
    consumed = out.consumed() if missing else {}
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
    if int(num_tokens.sum()) != info.counts.tokens_written:
        problems.append(f"{int(num_tokens.sum())} tokens, hsx.json says {info.counts.tokens_written}")
    for col in ("input_ids", "loss_mask", "hidden_states") + (("final_hidden_state",) if final else ()):
        lengths = pc.list_value_length(ds.data.column(col)).to_numpy(zero_copy_only=False)
        if not np.array_equal(lengths, num_tokens):
            differ = int((lengths != num_tokens).sum())
            problems.append(f"column {col}: lengths differ from num_tokens in {differ} rows")

    errors: dict[str, float] = {}
    if samples and len(ds):
        recorded = info.model_path
        if not model and info.config.get("trust_remote_code") is not False:
            problems.append("cannot recompute rows: the job ran the model's own code (trust_remote_code), and "
                            "verify takes no trust from hsx.json: pass --model PATH --trust-remote-code")
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

    from hsx.config import HsxError
    from hsx.sink import file_crc32

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

    from hsx.model import TORCH_DTYPES, decoder_layers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model = AutoModel.from_pretrained(model_path, dtype=TORCH_DTYPES[info.config.dtype],
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

