"""Consumer side: read an hsx output, local or on the Hub, as torch tensors without copying; batch it for a
drafter's training (exports to trainers' own layouts: hsx.export).

- `load(path_or_repo, split="train", layers=None, streaming=None, revision=None)`
  * a local output dir: one `datasets.Dataset` memory-mapped from data/<split>-*.arrow in place
    (`Dataset.from_file`, 0.008 s for 472 MB). `datasets.load_dataset(DIR)` would first copy everything into the
    HF cache (472 MB -> a 472 MB cache file, so a second terabyte for a terabyte output; ../shared/notes/
    datasets-arrow.md §4), and datasets 5.2 keys that cache by the folder's name and the card's configs, not by the
    files (hsx puts the job fingerprint in the card's config to keep two jobs apart).
  * a Hub repo id: `load_dataset(repo, split=..., streaming=True)`, an `IterableDataset` that downloads as it
    goes and caches nothing; `streaming=False` downloads the whole repo into the cache first.
  * `layers=[...]` (model layer indices as in hsx.json; negatives count from the model's end): rows as torch
    tensors holding only those of the stored layers: a `torch_view` (map-style, len + index) for a local dir or a
    non-streaming load, a `torch_stream` (iterable) when streaming. Cost: locally, evenly spaced layers are a
    strided view of the memory-mapped file and others are gathered by `index_select` (a copy of the selected
    layers only); pages of the other layers are not read unless they share a 4 KiB page (a layer row is
    hidden x 2 bytes: 8 KiB at hidden 4096). Streaming, every row arrives whole: the download and the Arrow
    parsing cost all stored layers, and `layers=` only saves memory downstream.
- `torch_view` / `torch_stream`: rows with `torch.bfloat16` states (float16 / float32 as stored; fp8 as
  `torch.float8_e4m3fn` with its `*_scale` column), views of the Arrow buffers, no copy. Arrow has no bfloat16:
  bf16 is stored bit-exact as int16, and datasets' torch/numpy formatters would widen it to int64 unless told
  `dtype=None`.
- `collate(rows, pad_token_id=0, pad_to_multiple_of=None)`: right-padded batches for a DataLoader.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

STORAGE_NUMPY = {"bfloat16": "int16", "float16": "float16", "float32": "float32", "float8_e4m3": "uint8"}
IGNORE_INDEX = -100  # `labels` outside the loss (transformers' and torch's CrossEntropyLoss default)


# ---- opening ----------------------------------------------------------------------------------------------------

def load(path_or_repo: str | os.PathLike, split: str = "train", layers: list[int] | None = None,
         streaming: bool | None = None, revision: str | None = None):
    """An hsx output as a dataset: a local dir memory-mapped (`datasets.Dataset`, no copy), a Hub repo streamed
    (`datasets.IterableDataset`; `streaming=False` downloads it into the HF cache first). With `layers`, rows
    as torch tensors of only those layers instead (`torch_view` / `torch_stream`; see the module docstring)."""
    local = _local_dir(path_or_repo)
    if local is not None:
        if revision is not None:
            raise ValueError("revision= is for Hub repos; a local dir is read as it is")
        if not streaming:
            ds = _load_local(local, split)
            return ds if layers is None else torch_view(ds, layers=layers, meta=info(local))
    from datasets import load_dataset

    if local is not None:
        ds = load_dataset(str(local), split=split, streaming=True)
    else:
        streaming = True if streaming is None else streaming
        ds = load_dataset(str(path_or_repo), split=split, streaming=streaming, revision=revision)
    if layers is None:
        return ds
    meta = info(local) if local is not None else hub_info(str(path_or_repo), revision)
    return torch_stream(ds, layers=layers, meta=meta) if streaming else torch_view(ds, layers=layers, meta=meta)


def _local_dir(path_or_repo: str | os.PathLike) -> Path | None:
    """The output dir, or None for a Hub repo id ("name" or "owner/name")."""
    p = Path(path_or_repo).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise NotADirectoryError(f"{path_or_repo}: an hsx output is a folder")
    s = str(path_or_repo)
    if isinstance(path_or_repo, Path) or s.startswith((".", "/", "~")) or s.count("/") > 1:
        raise FileNotFoundError(f"{path_or_repo}: no such output dir")
    return None


def _load_local(root: Path, split: str):
    from datasets import Dataset, concatenate_datasets

    files = sorted((root / "data").glob(f"{split}-*.arrow"))
    if not files:
        have = sorted({f.name.split("-")[0] for f in (root / "data").glob("*-*.arrow")})
        raise FileNotFoundError(f"{root}: no data/{split}-*.arrow files" +
                                (f" (splits here: {', '.join(have)})" if have else " (not an hsx output dir?)"))
    _warn_if_partial(root)
    return concatenate_datasets([Dataset.from_file(str(f)) for f in files])


def _warn_if_partial(root: Path) -> None:
    """A dir whose units were deleted after their upload (--delete-after-upload) holds only part of the output."""
    if not any((root / ".hsx").glob("uploaded-*.jsonl")):
        return
    from hsx.sink import OutputDir

    out = OutputDir(root)
    gone = [r for r in out.manifest_records().values() if not (out.data / r["file"]).exists()]
    if gone:
        repos = sorted({f"{u.get('repo')}" for u in out.uploaded().values() if u.get("repo")})
        warnings.warn(f"{root}: {len(gone)} unit(s) were deleted after their upload to "
                      f"{', '.join(repos) or 'the Hub'}; this dir holds only part of the output: load the repo "
                      "instead", stacklevel=3)


def info(path: str | os.PathLike) -> dict[str, Any]:
    """hsx.json of a local output dir."""
    return json.loads((Path(path) / "hsx.json").read_text())


def hub_info(repo_id: str, revision: str | None = None) -> dict[str, Any]:
    """hsx.json of a Hub repo (one small download, cached by huggingface_hub)."""
    from huggingface_hub import hf_hub_download

    return json.loads(Path(hf_hub_download(repo_id, "hsx.json", repo_type="dataset", revision=revision)).read_text())


# ---- decoding rows ----------------------------------------------------------------------------------------------

@dataclass
class _Layout:
    """How one row's states are laid out, and which of the stored layers to hand out."""

    hidden: int
    num_layers: int  # stored in hidden_states
    dtype: str  # storage dtype
    positions: list[int] | None  # indices into the stored layers, or None for all

    def row(self, t) -> dict[str, Any]:
        """One row (a one-row pyarrow Table sliced from the mapped file) as torch views."""
        ids = _tensor(_values(t, "input_ids"))
        n = ids.shape[0]
        names = set(t.column_names)
        row: dict[str, Any] = {
            "sample_id": int(t.column("sample_id")[0].as_py()),
            "input_ids": ids,
            "loss_mask": _tensor(_values(t, "loss_mask")),
            "hidden_states": _select(self._states(t, "hidden_states").view(n, self.num_layers, self.hidden),
                                     self.positions),
        }
        if "hidden_states_scale" in names:
            row["hidden_states_scale"] = _select(_tensor(_values(t, "hidden_states_scale", nested=True))
                                                 .view(n, self.num_layers), self.positions)
        if "final_hidden_state" in names:
            row["final_hidden_state"] = self._states(t, "final_hidden_state").view(n, -1)
        if "final_hidden_state_scale" in names:
            row["final_hidden_state_scale"] = _tensor(_values(t, "final_hidden_state_scale", nested=True)).view(n, 1)
        if "has_nonfinite" in names:
            row["has_nonfinite"] = bool(t.column("has_nonfinite")[0].as_py())
        return row

    def _states(self, t, name: str):
        import torch

        a = _values(t, name, nested=True)
        if a.dtype != np.dtype(STORAGE_NUMPY[self.dtype]):
            raise TypeError(f"{name} holds {a.dtype} values, not the {STORAGE_NUMPY[self.dtype]} bits of "
                            f"{self.dtype} an hsx output stores (rows re-encoded by a Python-level map?)")
        x = _tensor(a)
        if self.dtype == "bfloat16":
            return x.view(torch.bfloat16)
        if self.dtype == "float8_e4m3":
            return x.view(torch.float8_e4m3fn)
        return x


def _storage_dtype(meta: dict | None, features) -> str:
    if meta and meta.get("storage_dtype"):
        return meta["storage_dtype"]
    try:
        value = features["hidden_states"].feature.feature
    except (KeyError, TypeError, AttributeError):
        return "bfloat16"
    if getattr(value, "id", None) == "float8_e4m3fn" or value.dtype == "uint8":
        return "float8_e4m3"
    return value.dtype if value.dtype in ("float16", "float32") else "bfloat16"


def _layout(meta: dict | None, features, hidden_size: int | None, layers: list[int] | None) -> _Layout:
    width = None
    try:
        width = features["hidden_states"].feature.length
    except (KeyError, TypeError, AttributeError):
        pass
    hidden = hidden_size or (meta or {}).get("hidden_size")
    if hidden is None and features is not None and "final_hidden_state" in features:
        hidden = features["final_hidden_state"].feature.length
    if width is None and meta:
        width = len(meta["layers"]) * meta["hidden_size"]
    if width is None:
        raise ValueError("cannot tell the row layout: pass the output dir, or meta=<its hsx.json as a dict>")
    hidden = hidden or width  # unknown: one row of all layers side by side
    positions = None
    if layers is not None:
        if not meta or "layers" not in meta:
            raise ValueError("layers= selects by model layer index: pass the output dir, or meta=<its hsx.json as "
                             "a dict>")
        positions = layer_positions(meta["layers"], list(layers), meta.get("num_model_layers"))
    return _Layout(hidden=hidden, num_layers=width // hidden, dtype=_storage_dtype(meta, features),
                   positions=positions)


def layer_positions(stored: list[int], wanted: list[int], num_model_layers: int | None = None) -> list[int]:
    """Where each wanted model layer (negatives count from the model's end) sits among the stored layers."""
    out = []
    for w in wanted:
        j = w + num_model_layers if (w < 0 and num_model_layers) else w
        if j not in stored:
            raise ValueError(f"layer {w} is not in this output; its layers are {stored}")
        out.append(stored.index(j))
    if not out:
        raise ValueError("layers= is empty")
    return out


def _select(x, positions: list[int] | None):
    """The chosen layers (dim 1): a strided view when they are evenly spaced and increasing, else a copy of just
    those layers."""
    if positions is None:
        return x
    step = positions[1] - positions[0] if len(positions) > 1 else 1
    if step > 0 and positions == list(range(positions[0], positions[0] + step * len(positions), step)):
        return x[:, positions[0]:positions[-1] + 1:step]
    import torch

    bits = _bits_dtype(x.dtype)  # (index_select through the integer bits: bit-exact, any CPU)
    index = torch.tensor(positions)
    return x.view(bits).index_select(1, index).view(x.dtype) if bits is not None else x.index_select(1, index)


class torch_view:  # noqa: N801  (reads like a function: torch_view(OUT)[i])
    """Rows of an hsx output as torch tensors; `hidden_states` is a (T, layers, hidden) view of the mapped file
    (torch.bfloat16 for bf16 outputs), no copy. A map-style dataset: `len(view)`, `view[i]`; give it to a
    `torch.utils.data.DataLoader` with `collate_fn=hsx.collate`.

    `source`: an output dir, or a `datasets.Dataset` of one (from `load`) with `meta` (its hsx.json) or
    `hidden_size`. `layers`: only these of the stored layers, by model layer index (needs the dir or `meta`)."""

    def __init__(self, source, hidden_size: int | None = None, layers: list[int] | None = None,
                 meta: dict[str, Any] | None = None):
        if isinstance(source, (str, Path)):
            meta = meta or info(source)
            source = load(str(source))
        self.layout = _layout(meta, source.features, hidden_size, layers)
        self.ds = source.with_format("arrow")
        self.hidden = self.layout.hidden
        self.width = self.layout.num_layers * self.layout.hidden

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.layout.row(self.ds[int(i)])  # a one-row pyarrow Table sliced from the mapped file


_STREAM_CLASS = None


def torch_stream(source, layers: list[int] | None = None, meta: dict[str, Any] | None = None,
                 hidden_size: int | None = None):
    """Rows of a streamed hsx output (`datasets.IterableDataset`) as torch tensors, like `torch_view`'s rows.

    A `torch.utils.data.IterableDataset`: in a DataLoader with workers, datasets hands each worker its own
    files (so use at least as many files as workers). Every row is downloaded and parsed whole: `layers=` saves
    memory, not bandwidth."""
    global _STREAM_CLASS
    if _STREAM_CLASS is None:
        import torch.utils.data

        class TorchStream(torch.utils.data.IterableDataset):
            def __init__(self, ds, layout: _Layout):
                self.ds, self.layout = ds, layout

            def __iter__(self):
                for t in self.ds.with_format("arrow"):
                    if not hasattr(t, "column_names"):
                        raise TypeError("torch_stream needs an IterableDataset that yields Arrow rows")
                    yield self.layout.row(t)

        _STREAM_CLASS = TorchStream
    return _STREAM_CLASS(source, _layout(meta, getattr(source, "features", None), hidden_size, layers))


def _tensor(a: np.ndarray):
    """`torch.from_numpy` of a read-only view. The views are read-only on purpose (they are the mapped file);
    torch warns about that, so the warning is silenced here, and only here."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


def _values(t, name: str, nested: bool = False) -> np.ndarray:
    """The row's values as a read-only numpy view of the Arrow buffer (zero copy)."""
    arr = t.column(name).chunk(0) if t.column(name).num_chunks == 1 else t.column(name).combine_chunks()
    inner = arr.flatten()
    if nested:
        inner = inner.flatten()
    return inner.to_numpy(zero_copy_only=True)


# ---- batching ---------------------------------------------------------------------------------------------------

STATE_KEYS = ("hidden_states", "hidden_states_scale", "final_hidden_state", "final_hidden_state_scale")


def collate(rows: list[dict[str, Any]], pad_token_id: int = 0, pad_to_multiple_of: int | None = None
            ) -> dict[str, Any]:
    """Right-pad `torch_view` / `torch_stream` rows into one batch (B = len(rows), N = the longest row, rounded up
    to `pad_to_multiple_of`):

    - `input_ids` (B, N) long, padded with `pad_token_id`; `attention_mask` (B, N) long, 1 on real tokens
    - `loss_mask` (B, N) long, as stored: 1 on each assistant token (including its end-of-turn token), UNSHIFTED:
      `loss_mask[t]` says whether token t is a target. A next-token loss on position t's output (which predicts
      token t+1) uses `loss_mask[:, 1:]` against `logits[:, :-1]`.
    - `labels` (B, N) long: `input_ids` where loss_mask is 1, else -100; unshifted, the convention of
      transformers' causal-LM loss (it shifts internally).
    - the states: `hidden_states` (B, N, layers, hidden) and `final_hidden_state` (B, N, hidden) in their stored
      dtype (bfloat16), zero on padding; fp8 outputs also give their `*_scale` columns
    - `sample_id` (B,) and `num_tokens` (B,) long; `has_nonfinite` (B,) bool where stored

    The states are copied into the batch (one copy, the padded tensor the model takes)."""
    import torch

    if not rows:
        raise ValueError("collate: no rows")
    lengths = [int(r["input_ids"].shape[0]) for r in rows]
    n = max(lengths)
    if pad_to_multiple_of:
        n = -(-n // pad_to_multiple_of) * pad_to_multiple_of
    b = len(rows)
    batch: dict[str, Any] = {
        "input_ids": torch.full((b, n), pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros((b, n), dtype=torch.long),
        "loss_mask": torch.zeros((b, n), dtype=torch.long),
        "labels": torch.full((b, n), IGNORE_INDEX, dtype=torch.long),
        "sample_id": torch.tensor([int(r["sample_id"]) for r in rows], dtype=torch.long),
        "num_tokens": torch.tensor(lengths, dtype=torch.long),
    }
    keys = [k for k in STATE_KEYS if k in rows[0]]
    for key in keys:
        batch[key] = _zeros((b, n, *rows[0][key].shape[1:]), rows[0][key].dtype)
    for j, (r, t) in enumerate(zip(rows, lengths)):
        batch["input_ids"][j, :t] = r["input_ids"]
        batch["attention_mask"][j, :t] = 1
        batch["loss_mask"][j, :t] = r["loss_mask"]
        for key in keys:
            _copy_into(batch[key][j, :t], r[key])
    batch["labels"] = torch.where(batch["loss_mask"].bool(), batch["input_ids"], batch["labels"])
    if "has_nonfinite" in rows[0]:
        batch["has_nonfinite"] = torch.tensor([bool(r["has_nonfinite"]) for r in rows])
    return batch


def _bits_dtype(dtype):
    import torch

    return {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}.get(dtype)


def _zeros(shape, dtype):
    import torch

    bits = _bits_dtype(dtype)
    return torch.zeros(shape, dtype=bits).view(dtype) if bits is not None else torch.zeros(shape, dtype=dtype)


def _copy_into(dst, src) -> None:
    """Bit-exact copy (through the integer bits for bf16 / fp8, which CPU kernels may not copy natively)."""
    bits = _bits_dtype(src.dtype)
    if bits is not None:
        dst.view(bits).copy_(src.view(bits))
    else:
        dst.copy_(src)


def __getattr__(name: str):
    """`hsx.load.export_specforge` moved to hsx.export (which imports this module); the old import keeps working."""
    if name == "export_specforge":
        from hsx.export import export_specforge

        return export_specforge
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
