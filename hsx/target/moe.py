"""Mixture-of-experts layers at GEMM speed: the experts of every routed layer as two grouped GEMMs.

transformers (5.x) runs the experts of Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next, GPT-OSS, DeepSeek-V3 ... through its
`ExpertsInterface` (`config._experts_implementation`: "eager" loops over the experts, "grouped_mm" sorts the
token-expert pairs and runs `torch._grouped_mm`). `grouped_experts_forward` is hsx's entry in that interface,
"hsx_grouped": the same two grouped GEMMs (gate/up, then down) over the pairs sorted by expert, with less memory
traffic around them:
- the routing weight scales the activations before the down projection (w·(a @ D) = (w·a) @ D), so no pass over
  the (pairs × hidden) product is spent on it;
- the down projection's bias (GPT-OSS) is added once per token as a (tokens × experts) routing matrix times the
  bias table, not gathered per pair;
- expert boundaries come from `searchsorted` on the sorted expert ids (fixed shapes: no graph break, no sync);
- the pair gathers (hidden rows, routing weights) are an op Inductor cannot fuse into (`gather_rows`): fused, it
  recomputed the residual add and RMSNorm before the row gather for each of a token's k copies, and the router's
  top-k renormalization for each element of the activation;
- for experts of Qwen3-MoE's form (one gate_up weight, SiLU, no bias) there is no pair gather: the gate/up GEMM
  is one Triton kernel that reads the token rows by index and applies SiLU(gate)·up and the routing weight to
  its float32 tiles (`gate_up_activation`, faster than the row gather, CUTLASS's grouped GEMM and the compiled
  activation it replaces); so is GPT-OSS's (biases, the clamped gate of interleaved columns);
- the k outputs of a token are gathered back and summed in float32 in a fixed order (deterministic; no atomics),
  on CUDA in one Triton kernel (`sum_pairs`, a fraction of Inductor's row gathers' time).
With it, routers of Qwen3-MoE's form run their float32 softmax, top-k and renormalization as one op (`route_topk`,
a fraction of transformers' softmax + `torch.topk` + division). Each kernel's timing against what it replaced:
docs/benchmarks.md, 2026-11-30 to 2026-12-01 and 2026-12-02 (MoE).
Its output equals transformers' eager experts within rounding (float32 on CPU: tests/test_moe.py; bf16 on a GPU:
tests/test_gpu.py). Expert-parallel layers (EP sentinels) keep transformers' own implementation.
FP8 experts (the `-FP8` checkpoints' e4m3 experts with 128×128 block scales, transformers' FP8Experts) run block-scaled
FP8 in the same path (`fp8_experts_forward`: tokens quantized per 1×128 block, two Triton kernels after vLLM's
fused_moe_kernel with use_fp8_w8a8; on CPU tensors their torch reference, one expert dequantized at a time). The
kernels are checked against that reference on a GPU (tests/test_fp8.py, `gpu`); docs/fp8.md.

`use_experts(base, name)` switches a loaded model's experts implementation, like `use_packing` for attention. The ops
this path runs (each a Triton kernel on CUDA and its torch reference elsewhere) are hsx.target.moe_kernels'.
"""

from __future__ import annotations

import functools

import torch

from hsx.target import fp8, fp8_gemm, fp8_model, kernels
from hsx.target.moe_kernels import (FUSED_DTYPES, fp8_experts_run_on, fp8_gate_up_activation, fp8_grouped_down,
                             fp8_grouped_reference, gate_up_activation, gather_rows, grouped_mm, route_topk,
                             sum_pairs)

EXPERTS_IMPLEMENTATION = "hsx_grouped"  # our name in transformers' ExpertsInterface (one of config.EXPERTS_CHOICES)
FUSED_GATE_UP = "_hsx_fused_gate_up"  # set on an experts module by use_experts: decided once, not while traced


def _gate_up_fusable(module: torch.nn.Module) -> bool:
    """Whether an experts module's gate/up projection, activation and routing weight can be `gate_up_activation`:
    gate and up in one weight, no norm after the experts, and either transformers' default gate (SiLU of the first
    half times the second) without bias, or GPT-OSS's clamped gate (`_clamped_gate`)."""
    return _gate_up_form(module) is not None


def _gate_up_form(module: torch.nn.Module) -> str | None:
    """The form in which the fused op runs the module's gate/up: "silu", "clamped" (GPT-OSS's, with biases) or None."""
    from transformers.activations import SiLUActivation
    from transformers.integrations import moe as hf_moe

    if not getattr(module, "has_gate", False) or getattr(module, "has_post_expert_norm", False):
        return None
    if (not module.has_bias and getattr(type(module), "_apply_gate", None) is getattr(hf_moe, "_default_apply_gate",
                                                                                        False)
            and type(getattr(module, "act_fn", None)) in (SiLUActivation, torch.nn.SiLU)):
        return "silu"
    if module.has_bias and _clamped_gate(module) is not None:
        return "clamped"
    return None


def _clamped_gate(module: torch.nn.Module) -> tuple[float, float] | None:
    """(alpha, limit) when the module's `_apply_gate` is GPT-OSS's: interleaved gate and up columns, the gate
    clamped above at `limit`, up to ±limit, (up + 1) · gate · sigmoid(alpha · gate). Checked by running it on a
    probe that crosses both clamps (float64, on the CPU), not by its source: decided once, in use_experts."""
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if not isinstance(alpha, (int, float)) or not isinstance(limit, (int, float)) or not limit > 0:
        return None
    probe = torch.linspace(-2.0, 2.0, 64, dtype=torch.float64).mul(limit).reshape(2, 32)
    try:
        got = module._apply_gate(probe)
    except Exception:  # noqa: BLE001 - a gate of another form: not this kernel's
        return None
    gate, up = probe[..., ::2].clamp(max=limit), probe[..., 1::2].clamp(min=-limit, max=limit)
    want = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or not torch.allclose(got, want, rtol=1e-12,
                                                                                          atol=0.0):
        return None
    return float(alpha), float(limit)


def _holds_fp8(module: torch.nn.Module) -> bool:
    w = getattr(module, "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj", None)
    return isinstance(w, torch.Tensor) and w.element_size() == 1


def _transformers_forward(self: torch.nn.Module, hidden_states, top_k_index, top_k_weights):
    """transformers' own grouped forward for experts hsx's does not run (expert-parallel sentinels; e4m3 experts of
    another layout): its FP8 one for e4m3 weights where this transformers has it, else the class's own loop."""
    if not _holds_fp8(self):
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    try:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS

        forward = ALL_FP8_EXPERTS_FUNCTIONS["grouped_mm"]
    except (ImportError, KeyError):
        forward = type(self).forward.__wrapped__  # the class's forward before transformers' dispatch wrapped it
    return forward(self, hidden_states, top_k_index, top_k_weights)


def grouped_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward signature: (tokens, hidden), (tokens, k) expert ids, (tokens, k) weights."""
    fp8_path = getattr(self, FP8_EXPERTS, False)
    if getattr(self, "_is_expert_parallel", False) or (not fp8_path and _holds_fp8(self)):
        return _transformers_forward(self, hidden_states, top_k_index, top_k_weights)
    tokens = hidden_states.shape[0]
    k = top_k_index.shape[-1]
    experts = int(self.num_experts)
    dtype = hidden_states.dtype
    # Permutation: pairs sorted by expert (stable: token order kept within an expert), groups' end offsets. The
    # ids come as int64; the radix sort makes one pass per key byte, so they are sorted as int16.
    key_dtype = torch.int16 if experts <= torch.iinfo(torch.int16).max else torch.int32
    expert_of_pair, order = torch.sort(top_k_index.reshape(-1).to(key_dtype), stable=True)
    bounds = torch.arange(1, experts + 1, device=order.device, dtype=expert_of_pair.dtype)  # compiled: a constant
    offsets = torch.searchsorted(expert_of_pair, bounds, out_int32=True)
    if fp8_path:  # e4m3 experts: both products block-scaled FP8, the routing weight in the down one
        forward = dequantized_experts_forward if getattr(self, fp8_model.BF16_REFERENCE, False) else fp8_experts_forward
        return _to_tokens(forward(self, hidden_states, order, offsets, top_k_weights, k), order, k).to(dtype)
    post_norm = getattr(self, "has_post_expert_norm", False)
    if (getattr(self, FUSED_GATE_UP, False) and hidden_states.is_cuda and hidden_states.dtype in FUSED_DTYPES
            and self.gate_up_proj.dtype == dtype):  # up and gate projection, activation, routing weight: one kernel
        if self.has_bias:  # GPT-OSS's clamped gate (the only biased form use_experts marks)
            y = gate_up_activation(hidden_states, order, offsets, top_k_weights, self.gate_up_proj,
                                   bool(self.is_transposed), k, self.gate_up_proj_bias, True, float(self.alpha),
                                   float(self.limit))
        else:
            y = gate_up_activation(hidden_states, order, offsets, top_k_weights, self.gate_up_proj,
                                   bool(self.is_transposed), k)
    else:
        x = gather_rows(hidden_states, order // k)
        w_in = self.gate_up_proj if self.has_gate else self.up_proj
        y = grouped_mm(x, w_in if self.is_transposed else w_in.transpose(-2, -1), offsets)
        if self.has_bias:
            y = y + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[expert_of_pair.long()]
        y = self._apply_gate(y) if self.has_gate else self.act_fn(y)
        # The pairs' routing weights as a tensor of their own: gathered inside the activation's kernel, Inductor
        # recomputed the router's top-k renormalization (a sum over the token's k weights) for every element.
        pair_weight = gather_rows(top_k_weights.reshape(-1, 1), order)
        if not post_norm:  # a norm after each expert does not commute with the weight: applied after it instead
            y = y * pair_weight.to(y.dtype)
    # Down projection, back to token order, sum of a token's k outputs.
    w_out = self.down_proj
    z = grouped_mm(y, w_out if self.is_transposed else w_out.transpose(-2, -1), offsets)
    if post_norm:
        if self.has_bias:
            z = z + self.down_proj_bias[expert_of_pair.long()]
        z = self.post_expert_norm(z) * pair_weight.to(z.dtype)
    extra = None
    if self.has_bias and not post_norm:  # sum_j w_tj · b_(e_tj) = routing matrix (tokens × experts) @ bias table
        routing = torch.zeros(tokens, experts, device=z.device, dtype=torch.float32)
        routing.scatter_(1, top_k_index, top_k_weights.float())
        extra = routing @ self.down_proj_bias.float()
    return _to_tokens(z, order, k, extra).to(dtype)


def _to_tokens(z: torch.Tensor, order: torch.Tensor, k: int, extra: torch.Tensor | None = None) -> torch.Tensor:
    """The pairs' outputs z (in expert order, `order` the pair each row is) back in token order, each token's k
    outputs summed (plus `extra`), in one pass: as a sum(dim=1) it became an Inductor reduction far under memory
    bandwidth, a large share of a Qwen3-30B-A3B layer's GPU time (docs/benchmarks.md, 2026-11-30 to 2026-12-01)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return sum_pairs(z, inverse, k, extra)


# ---- FP8 experts (the official `-FP8` MoE checkpoints) --------------------------------------------------------------

FP8_EXPERTS = fp8_model.FP8_EXPERTS  # set on an experts module by use_experts: its e4m3 experts run as below


def _fp8_experts_form(module: torch.nn.Module) -> bool:
    """Whether an experts module holds e4m3 experts hsx's FP8 path runs: transformers' FP8Experts layout (gate_up_proj
    (E, 2·width, hidden) and down_proj (E, hidden, width) float8_e4m3fn, float32 scales per 128×128 block,
    (E, 2·width/128, hidden/128) and (E, hidden/128, width/128)), dynamic activations, no bias, no norm after the
    experts, and SiLU(gate)·up (checked by running its `_apply_gate` on a probe)."""
    gu, gs = getattr(module, "gate_up_proj", None), getattr(module, "gate_up_proj_scale_inv", None)
    dn, ds = getattr(module, "down_proj", None), getattr(module, "down_proj_scale_inv", None)
    if not all(isinstance(t, torch.Tensor) for t in (gu, gs, dn, ds)) or gu.dtype != fp8.FP8_DTYPE:
        return False
    if (not getattr(module, "has_gate", False) or getattr(module, "has_bias", True)
            or getattr(module, "has_post_expert_norm", False) or getattr(module, "is_transposed", True)
            or list(getattr(module, "block_size", None) or []) != [fp8.BLOCK, fp8.BLOCK]
            or getattr(module, "activation_scheme", None) != "dynamic"):
        return False
    if (gu.dim() != 3 or dn.dim() != 3 or dn.dtype != fp8.FP8_DTYPE or gs.dtype != torch.float32
            or ds.dtype != torch.float32 or gu.stride(-1) != 1 or dn.stride(-1) != 1):  # (the kernels' K steps)
        return False
    experts, two_width, hidden = gu.shape
    width = two_width // 2
    if (width % fp8.BLOCK or hidden % fp8.BLOCK or tuple(dn.shape) != (experts, hidden, width)
            or tuple(gs.shape) != (experts, two_width // fp8.BLOCK, hidden // fp8.BLOCK)
            or tuple(ds.shape) != (experts, hidden // fp8.BLOCK, width // fp8.BLOCK)):
        return False
    probe = torch.linspace(-6.0, 6.0, 64, dtype=torch.float64).reshape(2, 32)
    try:
        got = module._apply_gate(probe)
    except Exception:  # noqa: BLE001 - a gate of another form: not this path's
        return False
    gate, up = probe.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-12, atol=0)


def fp8_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, order: torch.Tensor,
                        offsets: torch.Tensor, top_k_weights: torch.Tensor, k: int) -> torch.Tensor:
    """The pairs' outputs (pairs in expert order, hidden) of e4m3 experts, as the serving engines compute them:
    each token quantized once per 1×128 block (shared by its k pairs), the gate/up product, SiLU(gate)·up, that
    quantized per 1×128 block, the down product, times the routing weight."""
    xq, xs = fp8_gemm.fp8_quantize(hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous())
    y = fp8_gate_up_activation(xq, xs, order, offsets, self.gate_up_proj, self.gate_up_proj_scale_inv, k,
                               hidden_states.dtype)
    aq, a_s = fp8_gemm.fp8_quantize(y)
    return fp8_grouped_down(aq, a_s, order, offsets, top_k_weights, self.down_proj, self.down_proj_scale_inv,
                            hidden_states.dtype)


def dequantized_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, order: torch.Tensor,
                                offsets: torch.Tensor, top_k_weights: torch.Tensor, k: int) -> torch.Tensor:
    """`fp8_experts_forward`'s pairs' outputs from the bf16 model of the same experts (`fp8_model.bf16_reference`): the
    weights dequantized one expert at a time, the products in the activations' dtype, nothing quantized."""
    dtype = hidden_states.dtype
    x = gather_rows(hidden_states, order // k)
    gate, up = fp8_grouped_reference(x, offsets, self.gate_up_proj, self.gate_up_proj_scale_inv, dtype).chunk(2, -1)
    y = torch.nn.functional.silu(gate) * up
    z = fp8_grouped_reference(y, offsets, self.down_proj, self.down_proj_scale_inv, dtype)
    return z * gather_rows(top_k_weights.reshape(-1, 1), order).to(dtype)


# Routers whose forward is Qwen3-MoE's (the same source in transformers; `_router_renormalizes` checks it): linear,
# float32 softmax, top-k, renormalization (optional by config, or always: Qwen3.5/3.6-MoE), weights back in the
# logits' dtype.
QWEN3_MOE_ROUTERS = ("Qwen3MoeTopKRouter", "Qwen3NextTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter",
                     "Qwen3OmniMoeThinkerTextTopKRouter", "Qwen3_5MoeTopKRouter")
RENORMALIZE = "_hsx_router_renormalizes"  # set on a router by use_router: decided once, not while traced


def routed_forward(self: torch.nn.Module, hidden_states: torch.Tensor):
    """Qwen3-MoE's router forward with the softmax, top-k and renormalization as `route_topk`."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    weights, index = route_topk(router_logits, self.top_k, bool(getattr(self, RENORMALIZE)))
    return router_logits, weights, index


ROUTER_RENORMALIZE_IF = ("        if self.norm_topk_prob:\n"
                         "            router_top_value /= router_top_value.sum(dim=-1, keepdim=True)\n")
ROUTER_RENORMALIZE_ALWAYS = "        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)\n"


@functools.cache
def _qwen3_moe_router_sources() -> dict[str, str]:
    """{forward source: "config" (renormalizes when `norm_topk_prob`) or "always"}: Qwen3-MoE's router forward
    as this transformers writes it, and the same with the renormalization unconditional (Qwen3.5/3.6-MoE's)."""
    import inspect

    try:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        source = inspect.getsource(Qwen3MoeTopKRouter.forward)
    except Exception:  # noqa: BLE001 - another transformers: no router of that form to replace
        return {}
    steps = ("F.linear(hidden_states, self.weight)", "softmax(router_logits, dtype=torch.float, dim=-1)",
             "torch.topk(router_probs, self.top_k, dim=-1)", ROUTER_RENORMALIZE_IF,
             "router_top_value.to(router_logits.dtype)", "return router_logits, router_scores, router_indices")
    if not all(step in source for step in steps):
        return {}
    return {source: "config", source.replace(ROUTER_RENORMALIZE_IF, ROUTER_RENORMALIZE_ALWAYS): "always"}


def _router_renormalizes(module: torch.nn.Module) -> bool | None:
    """Whether a router of Qwen3-MoE's form renormalizes its top-k weights; None for any other module."""
    import inspect

    cls = type(module)
    if cls.__name__ not in QWEN3_MOE_ROUTERS or getattr(module, "bias", None) is not None:
        return None
    try:
        form = _qwen3_moe_router_sources().get(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return None
    if form == "always":
        return True
    return bool(module.norm_topk_prob) if form == "config" and hasattr(module, "norm_topk_prob") else None


def use_router(base: torch.nn.Module, fused: bool) -> None:
    """Run routers of Qwen3-MoE's form through `routed_forward` (fused) or their class's forward again."""
    for m in base.modules():
        renormalizes = _router_renormalizes(m)
        if renormalizes is None:
            continue
        if fused:
            setattr(m, RENORMALIZE, renormalizes)
            m.forward = routed_forward.__get__(m)
        else:
            m.__dict__.pop("forward", None)


def register() -> None:
    """Make "hsx_grouped" a transformers experts implementation (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, grouped_experts_forward)
    try:  # FP8 experts (FP8Experts) dispatch through an interface of their own
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    except ImportError:
        return
    ALL_FP8_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, grouped_experts_forward)


def has_experts(base: torch.nn.Module) -> bool:
    """Whether the model has experts modules that transformers' ExpertsInterface dispatches."""
    return any(_dispatched(m) for m in base.modules())


def _dispatched(module: torch.nn.Module) -> bool:
    return fp8_model.is_experts_module(module)


def resolve_experts(requested: str, cuda: bool) -> str | None:
    """The experts implementation to run: auto is hsx_grouped on CUDA (measured: see the README's Benchmarks) and
    transformers' own choice elsewhere (None: leave the model as loaded)."""
    if requested != "auto":
        return requested
    return EXPERTS_IMPLEMENTATION if cuda else None


def use_experts(base: torch.nn.Module, name: str | None) -> None:
    """Switch every experts module of the model to `name` (None: unchanged). Modules read
    `config._experts_implementation` at each forward; a truncated view's layers keep the full model's config
    object, so every config in the model is set."""
    if name is None or not has_experts(base):
        return
    use_router(base, name == EXPERTS_IMPLEMENTATION)
    for m in base.modules():
        if _dispatched(m):
            device = next(m.parameters()).device
            setattr(m, FUSED_GATE_UP, name == EXPERTS_IMPLEMENTATION and _gate_up_fusable(m)
                    and (device.type != "cuda" or kernels.allowed("moe_gate_up", device)))
            setattr(m, FP8_EXPERTS, name == EXPERTS_IMPLEMENTATION and _fp8_experts_form(m))
            if getattr(m, FP8_EXPERTS):
                setattr(m, fp8_model.FP8_EXPERTS_RUN_ON, fp8_experts_run_on(m, m.gate_up_proj.is_cuda))
    if name == EXPERTS_IMPLEMENTATION:
        register()
    configs = {id(m.config): m.config for m in base.modules() if _dispatched(m) and getattr(m, "config", None)}
    configs[id(base.config)] = base.config
    for config in configs.values():
        config._experts_implementation = name
