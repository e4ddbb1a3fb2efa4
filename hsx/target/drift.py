"""FP8 against bf16: how far a target's states move when its FP8 linear layers and experts run as served
(activations quantized per 1×128 block, block-scaled FP8 products) instead of on their dequantized weights in bf16.
`hsx bench`'s drift column and `hsx verify OUT --against-bf16 N` both compute it here.

Each row runs alone (batch 1, unpadded) through the model with extraction's capture hooks (hsx.target.capture: each
chosen layer's output; with `final_hidden`, the final norm's output as the model returns it, as hsx.engine stores
it): once as loaded (the FP8 forward), once within `fp8_model.bf16_reference` (the same weights dequantized, the same
activations unquantized). A layer's relative error is the Frobenius one over every token of the rows,
sqrt(Σ‖a − b‖² / Σ‖b‖²), and the same over the loss-masked tokens alone. With stored states given (an output's
rows), they are compared with both forwards too: stored vs fresh FP8 is storage (dtype) error, stored vs bf16 what a
drafter trained on the output sees beyond the bf16 model. Two forwards per row and a host sum per state: a
diagnostic, not the hot loop (`hsx verify --against-bf16 5` on a 4-layer, 256-wide FP8 Qwen3's output: 0.13 s on a
CPU, load included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hsx.errors import HsxError
from hsx.target import fp8_model
from hsx.target.capture import capture

FINAL = "final_hidden_state"  # the final norm's output, named as its stored column
COMPARISONS = ("fp8_vs_bf16", "stored_vs_bf16", "stored_vs_fp8")


@dataclass
class DriftRow:
    """One row to compare: its token ids, its loss mask (None: every token counts), and, for an output's row, its
    stored states {layer name: (tokens, hidden)}."""
    ids: Any
    loss_mask: Any = None
    stored: dict[str, torch.Tensor] | None = None


@dataclass
class _Sums:
    """Σ‖a − b‖² and Σ‖b‖² per (comparison, state), over all tokens and over the loss-masked ones."""
    err: dict[tuple[str, str, bool], float] = field(default_factory=dict)
    ref: dict[tuple[str, str, bool], float] = field(default_factory=dict)

    def add(self, comparison: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
            mask: torch.Tensor | None) -> None:
        for name, b in want.items():
            d = (got[name].float() - b).pow(2).sum(-1)
            r = b.pow(2).sum(-1)
            for masked in (False, True):
                if masked and mask is None:
                    continue
                key = (comparison, name, masked)
                de, dr = (d[mask], r[mask]) if masked else (d, r)
                self.err[key] = self.err.get(key, 0.0) + float(de.sum())
                self.ref[key] = self.ref.get(key, 0.0) + float(dr.sum())

    def relative(self, comparison: str, masked: bool) -> dict[str, float]:
        out = {}
        for (c, name, m), e in self.err.items():
            ref = self.ref[(c, name, m)]
            if c != comparison or m != masked or ref == 0.0:  # (no token: no number, rather than a 0)
                continue
            out[name] = math.sqrt(e / ref) if math.isfinite(e) and math.isfinite(ref) else float("inf")
        return out


def state_names(layers: list[int], final_hidden: bool) -> list[str]:
    return [str(i) for i in layers] + ([FINAL] if final_hidden else [])


def forward_states(base: torch.nn.Module, layers: list[int], final_hidden: bool,
                   ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """{state name: (tokens, hidden) float32} of one row (`ids` (tokens,)), captured as extraction captures them."""
    with capture(base, layers) as store:
        out = base(input_ids=ids[None], use_cache=False)
        states = {str(i): store[i][0].float() for i in layers}
    if final_hidden:
        states[FINAL] = out.last_hidden_state[0].float()
    return states


def compare(base: torch.nn.Module, layers: list[int], final_hidden: bool, rows: list[DriftRow],
            device: torch.device) -> dict[str, Any]:
    """Relative errors per state of the FP8 forward against the bf16 one (and of stored states against both) over
    `rows`. `switched` says how many modules the bf16 forward runs on dequantized weights: 0 where the model holds
    no e4m3 weights (transformers dequantized them at load), and then the two forwards are one (fp8_vs_bf16 = 0).
    An e4m3 module the bf16 forward would not switch is refused (its number would understate the drift)."""
    blockers = fp8_model.reference_blockers(base)
    if blockers:
        raise HsxError(f"no bf16 reference for {len(blockers)} FP8 module(s) on transformers' FP8 forward "
                       f"({blockers[0]}, ...): hsx switches only its own FP8 linear layers and experts")
    sums = _Sums()
    tokens = masked_tokens = 0
    switched = 0
    with torch.inference_mode():
        for row in rows:
            ids = torch.as_tensor(np.asarray(row.ids), dtype=torch.long).to(device)
            mask = None if row.loss_mask is None else torch.as_tensor(np.asarray(row.loss_mask)).to(device).bool()
            fresh = forward_states(base, layers, final_hidden, ids)
            with fp8_model.bf16_reference(base) as switched:
                ref = forward_states(base, layers, final_hidden, ids) if switched else fresh
            sums.add("fp8_vs_bf16", fresh, ref, mask)
            if row.stored is not None:
                stored = {k: v.to(device) for k, v in row.stored.items()}
                sums.add("stored_vs_bf16", stored, ref, mask)
                sums.add("stored_vs_fp8", stored, fresh, mask)
            tokens += int(ids.shape[0])
            masked_tokens += int(mask.sum()) if mask is not None else 0
    report: dict[str, Any] = {"rows": len(rows), "tokens": tokens, "masked_tokens": masked_tokens,
                              "switched": switched}
    for masked in (False, True):
        report["relative_error_masked" if masked else "relative_error"] = {
            c: sums.relative(c, masked) for c in COMPARISONS if sums.relative(c, masked)}
    return report


def spread_rows(total: int, n: int) -> np.ndarray:
    """min(n, total) row positions evenly spaced over [0, total), first and last included: deterministic, and over
    an output (ordered by length bucket, then sample_id) they cover short rows and long ones alike."""
    n = min(n, total)
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    return np.unique(np.linspace(0, total - 1, n).round().astype(np.int64))
