"""Consumer side: open an output dir memory-mapped and read bfloat16 states without copying.

`datasets.load_dataset(OUT)` works, but on a local dir it first copies everything into the HF cache (a second
terabyte for a terabyte output), and datasets' torch/numpy formatters widen int16 to int64 unless told
`dtype=None`. `load` maps the Arrow files in place (`Dataset.from_file`); `torch_view` reads rows through Arrow
and hands out `torch.bfloat16` views of the mapped bytes; `collate` right-pads rows into a training batch.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np


def load(path: str):
    """The output dir as one `datasets.Dataset`, memory-mapped from data/train-*.arrow, in output order."""
    from datasets import Dataset, concatenate_datasets

    files = sorted((Path(path) / "data").glob("train-*.arrow"))
    if not files:
        raise FileNotFoundError(f"{path}: no data/train-*.arrow files (not an hsx output dir?)")
    return concatenate_datasets([Dataset.from_file(str(f)) for f in files])


def info(path: str) -> dict[str, Any]:
    return json.loads((Path(path) / "hsx.json").read_text())


class torch_view:  # noqa: N801  (reads like a function: torch_view(OUT)[i])
    """Rows of an hsx output as torch tensors; states are `torch.bfloat16` (T, layers, hidden) views, no copy.

    `source` is an output dir, or a dataset from `load` together with `hidden_size`."""

    def __init__(self, source, hidden_size: int | None = None):
        if isinstance(source, (str, Path)):
            hidden_size = hidden_size or info(str(source))["hidden_size"]
            source = load(str(source))
        features = source.features
        if hidden_size is None and "final_hidden_state" in features:
            hidden_size = features["final_hidden_state"].feature.length
        self.ds = source.with_format("arrow")
        self.width = features["hidden_states"].feature.length
        self.hidden = hidden_size or self.width  # unknown: one row of all layers side by side

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, Any]:
        t = self.ds[int(i)]  # a one-row pyarrow Table sliced from the mapped file
        ids = _tensor(_values(t, "input_ids"))
        n = ids.shape[0]
        row: dict[str, Any] = {
            "sample_id": int(t.column("sample_id")[0].as_py()),
            "input_ids": ids,
            "loss_mask": _tensor(_values(t, "loss_mask")),
            "hidden_states": _bf16(t, "hidden_states").view(n, self.width // self.hidden, self.hidden),
        }
        if "final_hidden_state" in t.column_names:
            row["final_hidden_state"] = _bf16(t, "final_hidden_state").view(n, -1)
        return row


def _tensor(a: np.ndarray):
    """`torch.from_numpy` of a read-only view. The views are read-only on purpose (they are the mapped file);
    torch warns about that, so the warning is silenced here, and only here."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


def _bf16(t, name: str):
    import torch

    return _tensor(_values(t, name, nested=True)).view(torch.bfloat16)


def _values(t, name: str, nested: bool = False) -> np.ndarray:
    """The row's values as a read-only numpy view of the Arrow buffer (zero copy)."""
    arr = t.column(name).chunk(0) if t.column(name).num_chunks == 1 else t.column(name).combine_chunks()
    inner = arr.flatten()
    if nested:
        inner = inner.flatten()
    return inner.to_numpy(zero_copy_only=True)


def collate(rows: list[dict[str, Any]], pad_token_id: int = 0) -> dict[str, Any]:
    """Right-pad a list of `torch_view` rows into a batch with `attention_mask` and `loss_mask`."""
    import torch

    n = max(r["input_ids"].shape[0] for r in rows)
    b = len(rows)
    batch: dict[str, Any] = {
        "input_ids": torch.full((b, n), pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros((b, n), dtype=torch.long),
        "loss_mask": torch.zeros((b, n), dtype=torch.long),
    }
    for key in ("hidden_states", "final_hidden_state"):
        if key in rows[0]:
            batch[key] = torch.zeros((b, n, *rows[0][key].shape[1:]), dtype=torch.bfloat16)
    for j, r in enumerate(rows):
        t = r["input_ids"].shape[0]
        batch["input_ids"][j, :t] = r["input_ids"]
        batch["attention_mask"][j, :t] = 1
        batch["loss_mask"][j, :t] = r["loss_mask"]
        for key in ("hidden_states", "final_hidden_state"):
            if key in r:
                batch[key][j, :t] = r[key]
    return batch
