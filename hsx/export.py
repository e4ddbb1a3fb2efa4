"""Exports into the offline layouts that drafter trainers read with their own code (checked against the released
packages in tests/test_trainers.py: specforge 0.2.0's OfflineManifestReader / load_feature_file /
normalize_offline_sample, speculators 0.9.0's ArrowDataset).

- `export_specforge(OUT, DEST, layout="eagle3" | "dflash" | "dspark")`: one `torch.save` file per sample,
  DEST/rows_{k}-{end}/data_{i}.ckpt (SpecForge's prepare_hidden_states.py layout, groups of 2000):
  * eagle3: input_ids (T,) int64, loss_mask (T,) int64, hidden_state (1, T, H) = the final-norm output (SpecForge
    stores it post-norm), aux_hidden_state (1, T, 3H) = 3 layers side by side in increasing layer order.
  * dflash (its DFlash, Domino strategies): input_ids, loss_mask, hidden_states (T, L·H) of the chosen layers in
    increasing layer order. SpecForge's DFlash normalizer rejects a sample without two consecutive supervised
    tokens, so such rows are left out and counted.
  * dspark: dflash's record plus target_last_hidden_states (T, H) = the final-norm output (SpecForge's capture
    takes it from SGLang's logits processor, after the norm; its DSpark normalizer checks the four keys and their
    lengths, and rejects what the dflash normalizer rejects).
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
  One layout for every speculator type: speculators' ArrowDataset splits the last stored layer off as
  verifier_last_hidden_states for EAGLE-3, DFlash, DFlash2 and DSpark alike (speculators 0.9.0 train/data.py).

States keep the stored dtype; fp8 outputs are dequantized to bfloat16.

DEST holds only what an export can prove it wrote (hsx.export_journal writes it so). DEST/hsx-export.json (written
first, durably) names the source (its job fingerprint and its units: name, bytes, CRC-32) and the export's
options; DEST/hsx-export.jsonl, appended and fsynced once per source unit, lists each file written (path, bytes,
CRC-32 of the bytes written) before the file gets its name. Each file is written as .hsx-<token>-<name> (the
token is the record's), fsynced, then renamed. So:
- a DEST holding anything else (a file or link not in the record, a symbolic link anywhere) is refused, naming it;
- running the same export again resumes it: recorded files are verified (bytes and CRC-32, which reads them once),
  kept, and the rest is written; hsx's own temporary files are removed;
- a DEST holding another export (another output, layers or options) is refused; `overwrite` first deletes the
  files the record proves hsx wrote (they still verify), and refuses instead where anything else is there;
- `delete_source` converts the output unit by unit and deletes each source unit once its exported files are
  durable and recorded (peak disk: the export plus one unit; the output dir is used up: each deletion is also
  recorded in its .hsx/exported.jsonl, and `hsx.load` refuses it in one line naming the command and DEST); a
  resume goes on from the first unit not yet released (a unit still on disk is exported again, never deleted
  on the journal's word alone)."""

from __future__ import annotations

import fcntl
import gc
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hsx.load import layer_positions, read_info, torch_view
from hsx.schema import ROW_COLUMNS, Info, dequantize
from hsx.errors import ArgumentError
from hsx.export_journal import JOURNAL, LOCK, RECORDED_PATH, Dest, dest_folder, open_dest
from hsx.files import flock
from hsx.info import listed_files
from hsx.ledgers import record_exported
from hsx.sink import OutputDir

SPECFORGE_GROUP_SIZE = 2000
SPECFORGE_LAYOUTS = ("eagle3", "dflash", "dspark")  # the CLI's --layout choices
_SPECFORGE_DIRS = re.compile(r"rows_\d+-\d+")
_SPECULATORS_DIRS = re.compile(r"hidden_states")
_DATASET_PART = "dataset"


# ---- the source output ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Source:
    root: Path
    meta: Info
    units: list[dict[str, Any]]  # hsx.json's `files` entries, in order

    @property
    def identity(self) -> dict[str, Any]:
        """What an export came from: the job and its exact units (a record matches only the same bytes)."""
        return {"fingerprint": self.meta.fingerprint,
                "units": [[e["file"], e["bytes"], e.get("crc32")] for e in self.units]}


def _source(out_dir) -> _Source:
    if not os.path.lexists(Path(out_dir) / "hsx.json"):  # a job still running, interrupted, or not an output
        raise ValueError(f"{out_dir} is not a finished hsx output (no hsx.json): finish the job (run the same "
                         "`hsx extract` command) before exporting it")
    meta = read_info(out_dir)
    units = listed_files(meta)
    if not meta.complete or not units:
        raise ValueError(f"{out_dir} is not a finished hsx output (its hsx.json lists no files): finish the job "
                         "(run the same `hsx extract` command) before exporting it")
    return _Source(Path(out_dir), meta, units)


def _units(src: _Source, dest: Dest, delete_source: bool):
    """(name, path) of each unit still to export, checked first: all present and intact (with `delete_source`,
    CRC-32 too, and no links: a unit is deleted only as the regular file hsx wrote).

    A unit the journal says was released is passed over only once it is gone, and only by a --delete-source
    export: a unit still there (a kill between the record and the deletion, or a journal line hsx did not write)
    is exported again, its recorded files verified and kept, before it is deleted; DEST's journal alone never
    deletes a unit."""
    out = OutputDir(src.root)
    todo = []
    for e in src.units:
        path = out.data / e["file"]
        if e["file"] in dest.released and not os.path.lexists(path):
            if not delete_source:
                raise ValueError(f"{dest.root}: {JOURNAL} says source unit {e['file']} was deleted, and this "
                                 "export does not delete units: the journal is damaged; export into a new folder")
            continue
        if delete_source and path.is_symlink():
            raise ValueError(f"{src.root}: data/{e['file']} is a link (a merged output's unit): deleting it frees "
                             "nothing; export without delete_source (--delete-source)")
        problem = out.file_problem(e, crc=delete_source)
        if problem:
            why = {"missing": "missing", "uploaded": "deleted after its upload to the Hub",
                   "exported": "deleted by an earlier export (--delete-source)"}.get(problem,
                                                                                             f"damaged ({problem})")
            raise ValueError(f"{src.root}: data/{e['file']} is {why}; an export needs every unit of the output")
        todo.append((e["file"], path))
    return todo


def _open_unit(path: Path, meta: Info, layers: list[int]):
    """A torch_view of one unit, `layers` (model indices) in increasing order: SpecForge and vLLM capture so."""
    from datasets import Dataset

    positions = layer_positions(meta.layers, layers, meta.num_model_layers)
    order = np.argsort(positions, kind="stable")
    return torch_view(Dataset.from_file(str(path)), layers=[layers[k] for k in order], meta=meta)


def _states(row: dict, key: str):
    """A row's states as a contiguous bfloat16/float tensor of its own (fp8 dequantized: x = q * scale). Cloned: a
    view would save the whole mapped buffer it points into."""
    import torch

    x = row[key]
    scale = row.get(f"{key}_scale")
    if scale is not None:
        x = dequantize(x, scale)
    return x.clone(memory_format=torch.contiguous_format)


# ---- DEST (hsx.export_journal) and the source's side of a release ---------------------------------------------

def _note_released(d: Dest, unit: Path, src: _Source, command: str) -> None:
    """Where the output records a unit an export released: its .hsx/exported.jsonl, so a reader of the output is
    told where its rows went, and its card."""
    entry = next(e for e in src.units if e["file"] == unit.name)
    out = OutputDir(src.root)
    record_exported(out.state, entry, str(d.root.resolve()), command)
    out.write_exported_card(len(d.released | {unit.name}), len(src.units), str(d.root.resolve()), command)


def _deleted(d: Dest, before: int) -> str:
    """What this run of a --delete-source export deleted (a rerun of a finished one deleted nothing)."""
    return f"; deleted {len(d.released) - before} source unit(s)" + (
        f" ({before} deleted by an earlier run)" if before else "")


def _exporting(out_dir, dest, src: _Source, dirs: re.Pattern, delete_source: bool):
    """The locks an export holds: DEST's own (one export per DEST), and with delete_source the whole output dir
    (no job, merge or push runs while its units are deleted)."""
    from contextlib import ExitStack

    stack = ExitStack()
    path = dest_folder(out_dir, dest, dirs)
    stack.enter_context(flock(path / LOCK, fcntl.LOCK_EX,
                               f"{path} is in use by another hsx export (lock held on {LOCK})"))
    if delete_source:
        given_as = "OUTPUT_DIR (a dir `hsx extract` wrote)"
        stack.enter_context(OutputDir(src.root, given_as=given_as).locked_whole("export --delete-source"))
    return stack, path


# ---- SpecForge ------------------------------------------------------------------------------------------------

def _stored_layers(meta: Info, chosen: list[int]) -> None:
    """`--layers` of an export must be stored layers of the output: a wrong argument (ArgumentError: exit 2)."""
    try:
        layer_positions(meta.layers, chosen, meta.num_model_layers)
    except ValueError as e:
        raise ArgumentError(f"--layers: {e}") from None


def export_specforge(out_dir: str | os.PathLike, dest: str | os.PathLike, layers: list[int] | None = None,
                     layout: str = "eagle3", group_size: int = SPECFORGE_GROUP_SIZE, overwrite: bool = False,
                     delete_source: bool = False, log=print) -> dict[str, Any]:
    """Write an output as SpecForge's offline per-sample files (see the module docstring). `i` is the row's
    `sample_id` (its input row, as SpecForge numbers rows; skipped rows leave gaps). eagle3 needs the final-norm
    state (--final-hidden; the eagle3 preset has it) and 3 layers (`layers` picks 3 of more); dflash takes every stored
    layer or `layers`; dspark takes them too, and the final-norm state. Returns {"written", "kept", "skipped",
    "released", "dest"}."""
    import torch

    if layout not in SPECFORGE_LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(SPECFORGE_LAYOUTS)}, not {layout!r}")
    src = _source(out_dir)
    meta = src.meta
    chosen = list(layers) if layers is not None else list(meta.layers)
    if layout == "dspark" and not meta.final_hidden:
        raise ValueError(f"{out_dir}: SpecForge's DSpark trainer needs target_last_hidden_states, the final-norm "
                         "output: extract with --final-hidden (--layers-from a DSpark draft includes it)")
    if layout == "eagle3":
        if not meta.final_hidden:
            raise ValueError(f"{out_dir}: SpecForge's EAGLE-3 trainer needs hidden_state, the final-norm output: "
                             "extract with --final-hidden (the eagle3 preset includes it)")
        if len(chosen) != 3:
            example = " ".join(str(i) for i in meta.layers[:3])
            raise ArgumentError(f"SpecForge's EAGLE-3 takes 3 auxiliary layers; this output stores {meta.layers}: "
                             f"pick 3 with --layers, e.g. --layers {example} (in Python: layers=[...])")
    _stored_layers(meta, chosen)  # a layer not stored: refused before DEST
    rows_in = meta.counts.rows_in
    resolved = sorted(x + meta.num_model_layers if x < 0 else x for x in chosen)
    options = {"trainer": "specforge", "layout": layout, "layers": resolved, "group_size": group_size,
               "delete_source": delete_source}
    stack, dest = _exporting(out_dir, dest, src, _SPECFORGE_DIRS, delete_source)
    written = kept = 0
    with stack:
        d = open_dest(dest, src.identity, str(src.root.resolve()), options, overwrite, _SPECFORGE_DIRS)
        released_before = len(d.released)
        for name, path in _units(src, d, delete_source):
            view = _open_unit(path, meta, chosen)
            skipped = 0
            for i in range(len(view)):
                row = view[i]
                sid = row["sample_id"]
                k = sid // group_size * group_size
                end = min(k + group_size, rows_in) if rows_in > sid else k + group_size
                rel = f"rows_{k}-{end}/data_{sid}.ckpt"
                mask = row["loss_mask"].to(torch.long)
                if layout != "eagle3" and not bool((mask[1:] * mask[:-1]).any()):
                    skipped += 1  # SpecForge's has_consecutive_supervised_tokens
                    continue
                if rel in d.files:
                    kept += 1
                    continue
                n = row["input_ids"].shape[0]
                sample = {"input_ids": row["input_ids"].to(torch.long), "loss_mask": mask}
                if layout == "eagle3":
                    sample["hidden_state"] = _states(row, "final_hidden_state").unsqueeze(0)
                    sample["aux_hidden_state"] = _states(row, "hidden_states").reshape(1, n, -1)
                else:
                    sample["hidden_states"] = _states(row, "hidden_states").reshape(n, -1)
                if layout == "dspark":
                    sample["target_last_hidden_states"] = _states(row, "final_hidden_state")
                buf = io.BytesIO()
                torch.save(sample, buf)
                d.stage(rel, buf.getbuffer())
                written += 1
            if d.staged or name not in d.skipped:
                d.commit(unit=name, skipped=skipped)
            view = row = sample = None  # the unit's memory map goes with its last reference
            if delete_source:
                gc.collect()  # (only once it is unmapped does deleting the unit free its disk)
                d.release(path, lambda: _note_released(d, path, src, "export-specforge"))
    skipped = sum(d.skipped.values())
    log(f"hsx: exported {written} sample(s) to {dest} in SpecForge's offline {layout} layout"
        + (f" ({kept} already there)" if kept else "")
        + (_deleted(d, released_before) if delete_source else "")
        + (f"; left out {skipped} row(s) without two consecutive supervised tokens (SpecForge's {layout} "
           "normalizer rejects them)" if skipped else ""))
    return {"written": written, "kept": kept, "skipped": skipped, "released": len(d.released), "dest": str(dest)}


# ---- speculators ----------------------------------------------------------------------------------------------

def _verifier(meta: Info) -> str:
    """The verifier speculators loads: the Hub id of a Hub model, else the absolute folder the job read (never a
    relative path, which would only work from the directory the job ran in)."""
    path = meta.model_path
    if not path or Path(path).parent.name == "snapshots":  # huggingface_hub's cache: snapshots/<commit>
        return meta.model if path or Path(meta.model).is_absolute() or not os.path.isdir(meta.model) \
            else str(Path(meta.model).resolve())
    return path


def _write_dataset_part(d: Dest, src: _Source, todo, aux: list[int], draft_vocab_size: int | None) -> None:
    """speculators' dataset dir (ids, masks, lengths, sorted by sample_id), token_freq.pt, d2t/t2d and
    speculators.yaml: small files, all built from the token columns of every unit, committed together."""
    import pyarrow as pa
    import yaml
    from datasets import Dataset
    from datasets.table import InMemoryTable

    from hsx.vocab import SPECULATORS_FREQUENCIES_FILE, count_supervised, draft_vocab, write_speculators_frequencies

    if d.released:
        raise ValueError(f"{d.root}: files of this export's dataset are missing and its source units were deleted "
                         "(--delete-source): export again into a new folder from a finished output")
    meta = src.meta
    tables = [Dataset.from_file(str(p)).data.table.select(list(ROW_COLUMNS)) for _, p in todo]
    table = pa.concat_tables(tables)
    order = np.argsort(table.column("sample_id").to_numpy(), kind="stable")
    table = table.take(pa.array(order))
    long_list = pa.list_(pa.int64())
    data = pa.table({"input_ids": table.column("input_ids").cast(long_list),
                     "loss_mask": table.column("loss_mask").cast(long_list),
                     "seq_len": table.column("num_tokens").cast(pa.int64()),
                     "sample_id": table.column("sample_id")})
    tmp = d.temp(_DATASET_PART)
    Dataset(InMemoryTable(data)).with_format("torch").save_to_disk(str(tmp))
    vocab_size = meta.vocab_size or (meta.token_frequencies or {}).get("vocab_size")
    ids = table.column("input_ids").combine_chunks().flatten().to_numpy()
    counts = count_supervised([table], int(vocab_size or (int(ids.max()) + 1 if len(ids) else 1)))
    write_speculators_frequencies(counts, tmp / SPECULATORS_FREQUENCIES_FILE)
    if draft_vocab_size is not None:
        if not vocab_size:
            raise ValueError(f"{src.root}: hsx.json does not record the model's vocab_size (an older output): "
                             "build the draft vocabulary with speculators' --draft-vocab-size from token_freq.pt")
        d2t, t2d = draft_vocab(counts, draft_vocab_size)
        np.save(tmp / f"d2t-{draft_vocab_size}.npy", d2t)
        np.save(tmp / f"t2d-{draft_vocab_size}.npy", t2d)
    config = {"train": {  # its stage-shaped config file: the trainer's keys under `train:`
        "verifier": {"verifier_name_or_path": _verifier(meta)},
        "draft": {"target_layer_ids": [x + 1 for x in aux],
                  **({"draft_vocab_size": draft_vocab_size} if draft_vocab_size else {})},
        "data": {"data_path": str(d.root.resolve())}, "generation": {"on_missing": "raise"}}}
    (tmp / "speculators.yaml").write_text(
        "# speculators train --config <this file> [--speculator-type dflash|dflash2|dspark] ...; written by hsx "
        "export-speculators\n" + yaml.safe_dump(config, sort_keys=False))
    for f in sorted(tmp.iterdir()):
        if f.is_dir() or not RECORDED_PATH.fullmatch(f.name):
            raise ValueError(f"datasets wrote {f.name} in a save_to_disk folder; hsx does not know that layout")
        d.stage_file(f.name, f)
    d.commit(part=_DATASET_PART)
    tmp.rmdir()


def export_speculators(out_dir: str | os.PathLike, dest: str | os.PathLike, layers: list[int] | None = None,
                       draft_vocab_size: int | None = None, overwrite: bool = False, delete_source: bool = False,
                       log=print) -> dict[str, Any]:
    """Write an output as speculators' offline training dir (see the module docstring). `layers`: the auxiliary
    layers (default: every stored layer but the last decoder layer, which is always the verifier state).
    Returns {"written", "kept", "rows", "target_layer_ids", "released", "dest"}."""
    import torch
    from datasets import load_from_disk
    from safetensors.torch import save as safetensors_bytes

    src = _source(out_dir)
    meta = src.meta
    last = meta.num_model_layers - 1
    if last not in meta.layers:
        raise ValueError(f"{out_dir}: speculators' trainer takes the last decoder layer's output before the final "
                         f"norm (layer {last}) as the verifier state, and this output stores layers "
                         f"{meta.layers}: extract with that layer too (e.g. --layers "
                         f"{' '.join(str(x) for x in meta.layers)} -1)")
    aux = list(layers) if layers is not None else [x for x in meta.layers if x != last]
    aux = sorted(x + meta.num_model_layers if x < 0 else x for x in aux)
    if not aux or last in aux:
        raise ArgumentError(f"pick the auxiliary layers among {[x for x in meta.layers if x != last]} (layer "
                         f"{last} is the verifier state and always comes last)")
    _stored_layers(meta, aux)
    options = {"trainer": "speculators", "layers": [*aux, last], "draft_vocab_size": draft_vocab_size,
               "verifier": _verifier(meta), "delete_source": delete_source}
    stack, dest = _exporting(out_dir, dest, src, _SPECULATORS_DIRS, delete_source)
    written = kept = 0
    with stack:
        d = open_dest(dest, src.identity, str(src.root.resolve()), options, overwrite, _SPECULATORS_DIRS)
        released_before = len(d.released)
        todo = _units(src, d, delete_source)
        if not all(rel in d.files for rel in d.parts.get(_DATASET_PART, [None])):
            _write_dataset_part(d, src, todo, aux, draft_vocab_size)
        sample_ids = np.asarray(load_from_disk(str(dest)).with_format("numpy")["sample_id"])
        rows = len(sample_ids)
        for name, path in todo:
            view = _open_unit(path, meta, [*aux, last])
            for i in range(len(view)):
                row = view[i]
                file_idx = int(np.searchsorted(sample_ids, row["sample_id"]))
                if file_idx == rows or sample_ids[file_idx] != row["sample_id"]:
                    raise ValueError(f"{dest}: its dataset lacks sample {row['sample_id']} of {name}; export again "
                                     "into a new folder")
                rel = f"hidden_states/hs_{file_idx}.safetensors"
                if rel in d.files:
                    kept += 1
                    continue
                sample = {"hidden_states": _states(row, "hidden_states"), "token_ids": row["input_ids"].to(torch.long)}
                d.stage(rel, safetensors_bytes(sample))
                written += 1
            if d.staged or name not in d.skipped:
                d.commit(unit=name)
            view = row = sample = None  # the unit's memory map goes with its last reference
            if delete_source:
                gc.collect()  # (only once it is unmapped does deleting the unit free its disk)
                d.release(path, lambda: _note_released(d, path, src, "export-speculators"))
    target_layer_ids = [x + 1 for x in aux]  # speculators / vLLM count the embedding output as layer 0
    log(f"hsx: exported {written} sample(s) to {dest} in speculators' offline layout"
        + (f" ({kept} already there)" if kept else "")
        + (_deleted(d, released_before) if delete_source else "")
        + f"; train with --data-path {dest} --target-layer-ids {' '.join(map(str, target_layer_ids))} "
          "--on-missing raise (or --config speculators.yaml)")
    return {"written": written, "kept": kept, "rows": rows, "target_layer_ids": target_layer_ids,
            "released": len(d.released), "dest": str(dest)}
