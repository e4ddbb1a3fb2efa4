"""The benchmark's random FP8 models: a CausalLM of a config with random e4m3 weights and 128×128 block scales
built on the device one layer at a time (`random_causal_lm`, `hsx bench` on a model it has no weights of), and the
FP8 linear layers' weight shapes of a config (`linear_shapes`, the GEMM bench's shapes).
"""

from __future__ import annotations

import math

import torch

from hsx.target.fp8 import BLOCK, CHECKPOINT_QUANTIZATION, FP8_DTYPE, quantize_weight
from hsx.target.fp8_gemm import Fp8Linear
from hsx.target.fp8_model import fuse_gated_mlps, is_experts_module


def random_causal_lm(config, device: torch.device, attn_implementation: str | None, std: float = 0.02):
    """A CausalLM of `config` with random weights, its decoder's linear layers e4m3 + 128×128 scales built one at a
    time on `device` (no bf16 copy of the model), the rest (embeddings, norms, lm_head, Gated DeltaNet
    parameters) in bf16, normal(0, std) or ones for norms."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        causal = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                  attn_implementation=attn_implementation)
    decoder = causal.get_decoder()
    for name in _block_linears(decoder):
        lin = decoder.get_submodule(name)
        w = torch.randn(lin.out_features, lin.in_features, device=device, dtype=torch.bfloat16) * std
        q, s = quantize_weight(w)
        del w
        bias = (torch.nn.Parameter(torch.zeros(lin.out_features, device=device, dtype=torch.bfloat16),
                                   requires_grad=False) if lin.bias is not None else None)
        decoder.set_submodule(name, Fp8Linear(torch.nn.Parameter(q, requires_grad=False),
                                              torch.nn.Parameter(s, requires_grad=False), bias))
    for m in decoder.modules():
        if is_experts_module(m):
            _random_fp8_experts(m, device, std)
    _materialize(causal, device)
    with torch.no_grad():
        for name, p in causal.named_parameters():
            if p.dtype == FP8_DTYPE or name.endswith("_scale_inv"):
                continue
            if p.dim() == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
            else:
                p.normal_(0.0, std)
    for name, m in list(causal.named_modules()):  # buffers computed at init (rotary frequencies): build anew
        if "rotary" in type(m).__name__.lower():
            with torch.device(device):  # (some rotary classes take no device argument: Qwen3-MoE's)
                causal.set_submodule(name, type(m)(config=m.config))
    causal.config.quantization_config = dict(CHECKPOINT_QUANTIZATION)
    fuse_gated_mlps(decoder)
    return causal


def _block_linears(decoder: torch.nn.Module) -> list[str]:
    """The decoder's linear layers a random FP8 model quantizes: both sides whole 128-blocks (Gated DeltaNet's
    one-row-per-head in_proj_a / in_proj_b stay bf16, as in the checkpoints)."""
    return [n for n, m in decoder.named_modules()
            if type(m) is torch.nn.Linear and m.in_features % BLOCK == 0 and m.out_features % BLOCK == 0]


def linear_shapes(config) -> dict[tuple[int, int], int]:
    """(N, K) → how many of the FP8 linear layers of a model of `config` (built on the meta device: nothing
    allocated) have that weight shape; the GEMM bench's shapes (`hsx bench --gemms`)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        decoder = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).get_decoder()
    counts: dict[tuple[int, int], int] = {}
    for name in _block_linears(decoder):
        lin = decoder.get_submodule(name)
        counts[(lin.out_features, lin.in_features)] = counts.get((lin.out_features, lin.in_features), 0) + 1
    return counts


def _random_fp8_experts(experts: torch.nn.Module, device: torch.device, std: float) -> None:
    """Give a (meta) experts module of transformers' fused layout (gate_up_proj (E, 2·width, hidden), down_proj
    (E, hidden, width), no bias) random e4m3 weights and 128×128 block scales, FP8Experts' tensors under its names,
    built one expert at a time on `device`: what hsx.target.moe's FP8 path runs (`use_experts` checks the form)."""
    if (not getattr(experts, "has_gate", False) or getattr(experts, "has_bias", True)
            or getattr(experts, "is_transposed", True)):
        from hsx.errors import HsxError

        raise HsxError(f"random FP8 experts need transformers' fused gate/up layout, not {type(experts).__name__}'s")
    for name in ("gate_up_proj", "down_proj"):
        shape = getattr(experts, name).shape
        q = torch.empty(shape, device=device, dtype=FP8_DTYPE)
        s = torch.empty(shape[0], math.ceil(shape[1] / BLOCK), math.ceil(shape[2] / BLOCK), device=device,
                        dtype=torch.float32)
        for e in range(shape[0]):
            q[e], s[e] = quantize_weight(torch.randn(shape[1:], device=device, dtype=torch.bfloat16) * std)
        setattr(experts, name, torch.nn.Parameter(q, requires_grad=False))
        setattr(experts, name + "_scale_inv", torch.nn.Parameter(s, requires_grad=False))
    experts.block_size, experts.activation_scheme = [BLOCK, BLOCK], "dynamic"


def _materialize(module: torch.nn.Module, device: torch.device) -> None:
    """Allocate (uninitialized) on `device` every parameter and buffer still on the meta device; those already
    real stay as they are (`Module.to_empty` would reallocate them too). Tied parameters stay tied."""
    made: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    new = torch.empty_like(t, device=device)
                    made[id(t)] = torch.nn.Parameter(new, requires_grad=False) if table is m._parameters else new
                table[name] = made[id(t)]
