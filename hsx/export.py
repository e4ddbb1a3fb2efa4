"""Exports into the offline layouts that drafter trainers read with their own code (checked against the released
packages in tests/test_trainers.py: specforge 0.2.0's OfflineManifestReader / load_feature_file /
normalize_offline_sample, speculators 0.9.0's ArrowDataset).

- `export_specforge(OUT, DEST, layout="eagle3" | "dflash")`: one `torch.save` file per sample,
  DEST/rows_{k}-{end}/data_{i}.ckpt (SpecForge's prepare_hidden_states.py layout, groups of 2000):
  * eagle3: input_ids (T,) int64, loss_mask (T,) int64, hidden_state (1, T, H) = the final-norm output (SpecForge
    stores it post-norm), aux_hidden_state (1, T, 3H) = 3 layers side by side in increasing layer order.
  * dflash (its DFlash, Domino strategies): input_ids, loss_mask, hidden_states (T, L·H) of the chosen layers in
    increasing layer order. SpecForge's DFlash normalizer rejects a sample without two consecutive supervised
    tokens, so such rows are left out and counted.
- `export_speculators(OUT, DEST)`: speculators' offline data dir (what `speculators prepare-data` and
  `generate-offline-data` leave, read by its `ArrowDataset` with `--on-missing raise`):
  * DEST/ a `datasets.save_to_disk` dataset in torch format: input_ids, loss_mask (int64 lists), seq_len, and
    hsx's sample_id, sorted by sample_id; its row i goes with DEST/hidden_states/hs_{i}.safetensors:
  * token_ids (T,) int64, hidden_states (T, L+1, H) bfloat16: the L auxiliary layers, then the last decoder
    layer's output BEFORE the final norm (vLLM's layer N; speculators applies a frozen verifier_norm itself),
    so the output must store layer N-1 (`--layers 1 17 32 -1` for N = 36: its ids are hsx's + 1).
  * DEST/token_freq.pt (its token-frequency file: {token_id: count} of supervised tokens), and with
    `draft_vocab_size` DEST/d2t-K.npy + t2d-K.npy, which its trainer finds by size in --data-path.
  * DEST/speculators.yaml: the `speculators train --config` keys this data implies (verifier, target layer ids,
    data path, on_missing: raise).

States keep the stored dtype; fp8 outputs are dequantized to bfloat16. Every file is written under a temporary
name and renamed, so an interrupted export leaves whole files only; existing sample files are kept unless
`overwrite` (an export resumes); DEST/hsx-export.json records what was exported, and an export of another output
or other layers into the same DEST is refused (without `overwrite`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from hsx.load import layer_positions, read_info, torch_view
from hsx.schema import Info, dequantize

SPECFORGE_GROUP_SIZE = 2000
SPECFORGE_LAYOUTS = ("eagle3", "dflash")


def _rows(out_dir, meta: Info, layers: list[int]):
    """A torch_view of `layers` (model indices) sorted by layer: SpecForge and vLLM capture in increasing order."""
    positions = layer_positions(meta.layers, layers, meta.num_model_layers)
    order = np.argsort(positions, kind="stable")
    return torch_view(out_dir, layers=[layers[k] for k in order], meta=meta)


def _states(row: dict, key: str):
    """A row's states as a contiguous bfloat16/float tensor of its own (fp8 dequantized: x = q * scale). Cloned: a
    view would save the whole mapped buffer it points into."""
    import torch

    x = row[key]
    scale = row.get(f"{key}_scale")
    if scale is not None:
        x = dequantize(x, scale)
    return x.clone(memory_format=torch.contiguous_format)


def _claim(out_dir, meta: Info, dest: Path, what: dict[str, Any], overwrite: bool) -> None:
    """DEST/hsx-export.json names the output and options an export came from, so that running it again resumes
    it, and a different export into the same DEST is refused instead of mixing files of two jobs."""
    import json

    if dest.resolve() == Path(out_dir).resolve() or Path(out_dir).resolve() in dest.resolve().parents:
        raise ValueError(f"{dest}: export into a folder outside the output dir {out_dir}")
    mine = {"fingerprint": meta.fingerprint, **what}
    marker = dest / "hsx-export.json"
    if marker.exists() and not overwrite:
        try:
            theirs = json.loads(marker.read_text())
        except ValueError:
            theirs = None
        if theirs != mine:
            raise ValueError(f"{dest} holds another export ({marker.name} differs: another output, layers or "
                             "layout); choose another folder, or overwrite to rewrite its files")
    _save(marker, lambda tmp: tmp.write_text(json.dumps(mine, indent=2) + "\n"))


def _save(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def export_specforge(out_dir: str | os.PathLike, dest: str | os.PathLike, layers: list[int] | None = None,
                     layout: str = "eagle3", group_size: int = SPECFORGE_GROUP_SIZE, overwrite: bool = False,
                     log=print) -> dict[str, Any]:
    """Write an output as SpecForge's offline per-sample files (see the module docstring). `i` is the row's
    `sample_id` (its input row, as SpecForge numbers rows; skipped rows leave gaps). eagle3 needs the final-norm
    state (--final-hidden; the eagle3 preset has it) and 3 layers (`layers` picks 3 of more); dflash takes
    every stored layer or `layers`. Returns {"written", "kept", "skipped", "dest"}."""
    import torch

    if layout not in SPECFORGE_LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(SPECFORGE_LAYOUTS)}, not {layout!r}")
    meta = read_info(out_dir)
    chosen = list(layers) if layers is not None else list(meta.layers)
    if layout == "eagle3":
        if not meta.final_hidden:
            raise ValueError(f"{out_dir}: SpecForge's EAGLE-3 trainer needs hidden_state, the final-norm output: "
                             "extract with --final-hidden (the eagle3 preset includes it)")
        if len(chosen) != 3:
            example = " ".join(str(i) for i in meta.layers[:3])
            raise ValueError(f"SpecForge's EAGLE-3 takes 3 auxiliary layers; this output stores {meta.layers}: "
                             f"pick 3 with --layers, e.g. --layers {example} (in Python: layers=[...])")
    view = _rows(out_dir, meta, chosen)
    rows_in = meta.counts.rows_in
    dest = Path(dest)
    resolved = sorted(x + meta.num_model_layers if x < 0 else x for x in chosen)
    _claim(out_dir, meta, dest, {"trainer": "specforge", "layout": layout, "layers": resolved,
                                 "group_size": group_size}, overwrite)
    written = kept = skipped = 0
    for i in range(len(view)):
        row = view[i]
        sid = row["sample_id"]
        k = sid // group_size * group_size
        end = min(k + group_size, rows_in) if rows_in > sid else k + group_size
        path = dest / f"rows_{k}-{end}" / f"data_{sid}.ckpt"
        mask = row["loss_mask"].to(torch.long)
        if layout == "dflash" and not bool((mask[1:] * mask[:-1]).any()):
            skipped += 1  # SpecForge's has_consecutive_supervised_tokens
            if overwrite:
                path.unlink(missing_ok=True)  # this sample's file from an earlier export
            continue
        if path.exists() and not overwrite:
            kept += 1
            continue
        n = row["input_ids"].shape[0]
        sample = {"input_ids": row["input_ids"].to(torch.long), "loss_mask": mask}
        if layout == "eagle3":
            sample["hidden_state"] = _states(row, "final_hidden_state").unsqueeze(0)
            sample["aux_hidden_state"] = _states(row, "hidden_states").reshape(1, n, -1)
        else:
            sample["hidden_states"] = _states(row, "hidden_states").reshape(n, -1)
        _save(path, lambda tmp, s=sample: torch.save(s, tmp))
        written += 1
    log(f"hsx: exported {written} sample(s) to {dest} in SpecForge's offline {layout} layout"
        + (f" ({kept} already there)" if kept else "")
        + (f"; left out {skipped} row(s) without two consecutive supervised tokens (SpecForge's DFlash rejects "
           "them)" if skipped else ""))
    return {"written": written, "kept": kept, "skipped": skipped, "dest": str(dest)}


def export_speculators(out_dir: str | os.PathLike, dest: str | os.PathLike, layers: list[int] | None = None,
                       draft_vocab_size: int | None = None, overwrite: bool = False, log=print) -> dict[str, Any]:
    """Write an output as speculators' offline training dir (see the module docstring). `layers`: the auxiliary
    layers (default: every stored layer but the last decoder layer, which is always the verifier state).
    Returns {"written", "kept", "rows", "target_layer_ids", "dest"}."""
    import pyarrow as pa
    import torch
    import yaml
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from safetensors.torch import save_file

    from hsx.load import load
    from hsx.vocab import SPECULATORS_FREQUENCIES_FILE, count_supervised, draft_vocab, write_speculators_frequencies

    meta = read_info(out_dir)
    last = meta.num_model_layers - 1
    if last not in meta.layers:
        raise ValueError(f"{out_dir}: speculators' trainer takes the last decoder layer's output before the final "
                         f"norm (layer {last}) as the verifier state, and this output stores layers "
                         f"{meta.layers}: extract with that layer too (e.g. --layers 1 17 32 -1)")
    aux = list(layers) if layers is not None else [x for x in meta.layers if x != last]
    aux = sorted(x + meta.num_model_layers if x < 0 else x for x in aux)
    if not aux or last in aux:
        raise ValueError(f"pick the auxiliary layers among {[x for x in meta.layers if x != last]} (layer "
                         f"{last} is the verifier state and always comes last)")
    view = torch_view(out_dir, layers=[*aux, last], meta=meta)
    dest = Path(dest)
    _claim(out_dir, meta, dest, {"trainer": "speculators", "layers": [*aux, last]}, overwrite)
    states_dir = dest / "hidden_states"
    ds = load(out_dir)
    table = ds.data.table.select(["sample_id", "input_ids", "loss_mask", "num_tokens"])
    order = np.argsort(table.column("sample_id").to_numpy(), kind="stable")
    table = table.take(pa.array(order))
    long_list = pa.list_(pa.int64())
    data = pa.table({"input_ids": table.column("input_ids").cast(long_list),
                     "loss_mask": table.column("loss_mask").cast(long_list),
                     "seq_len": table.column("num_tokens").cast(pa.int64()),
                     "sample_id": table.column("sample_id")})
    Dataset(InMemoryTable(data)).with_format("torch").save_to_disk(str(dest))

    written = kept = 0
    for file_idx, position in enumerate(order.tolist()):
        path = states_dir / f"hs_{file_idx}.safetensors"
        if path.exists() and not overwrite:
            kept += 1
            continue
        row = view[position]
        sample = {"hidden_states": _states(row, "hidden_states"), "token_ids": row["input_ids"].to(torch.long)}
        _save(path, lambda tmp, s=sample: save_file(s, str(tmp)))
        written += 1

    vocab_size = meta.vocab_size or (meta.token_frequencies or {}).get("vocab_size")
    ids = table.column("input_ids").combine_chunks().flatten().to_numpy()
    counts = count_supervised([table], int(vocab_size or (int(ids.max()) + 1 if len(ids) else 1)))
    write_speculators_frequencies(counts, dest / SPECULATORS_FREQUENCIES_FILE)
    if draft_vocab_size is not None:
        if not vocab_size:
            raise ValueError(f"{out_dir}: hsx.json does not record the model's vocab_size (an older output): "
                             "build the draft vocabulary with speculators' --draft-vocab-size from token_freq.pt")
        d2t, t2d = draft_vocab(counts, draft_vocab_size)
        np.save(dest / f"d2t-{draft_vocab_size}.npy", d2t)
        np.save(dest / f"t2d-{draft_vocab_size}.npy", t2d)
    target_layer_ids = [x + 1 for x in aux]  # speculators / vLLM count the embedding output as layer 0
    config = {"train": {  # its stage-shaped config file: the trainer's keys under `train:`
        "verifier": {"verifier_name_or_path": meta.model},
        "draft": {"target_layer_ids": target_layer_ids,
                  **({"draft_vocab_size": draft_vocab_size} if draft_vocab_size else {})},
        "data": {"data_path": str(dest.resolve())}, "generation": {"on_missing": "raise"}}}
    _save(dest / "speculators.yaml", lambda tmp: tmp.write_text(
        "# speculators train --config <this file> [--speculator-type dflash] ...; written by hsx "
        "export-speculators\n" + yaml.safe_dump(config, sort_keys=False)))
    log(f"hsx: exported {written} sample(s) to {dest} in speculators' offline layout"
        + (f" ({kept} already there)" if kept else "")
        + f"; train with --data-path {dest} --target-layer-ids {' '.join(map(str, target_layer_ids))} "
          "--on-missing raise (or --config speculators.yaml)")
    return {"written": written, "kept": kept, "rows": len(order), "target_layer_ids": target_layer_ids,
            "dest": str(dest)}
