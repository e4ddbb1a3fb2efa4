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
  its float32 tiles (`gate_up_activation`: 1,367 µs a Qwen3-30B-A3B layer at 16k tokens on an H200, against
  1,652 for the row gather, CUTLASS's grouped GEMM and the compiled activation); so is GPT-OSS's (biases, the
  clamped gate of interleaved columns: 3,793 µs a GPT-OSS-20B layer at 16k tokens against 4,036 compiled);
- the k outputs of a token are gathered back and summed in float32 in a fixed order (deterministic; no atomics),
  on CUDA in one Triton kernel (`sum_pairs`: 137 µs a Qwen3-30B-A3B layer at 16k tokens, 361 as Inductor's).
With it, routers of Qwen3-MoE's form run their float32 softmax, top-k and renormalization as one op (`route_topk`:
13 µs at 16k tokens × 128 experts on an H200, against 148 µs for transformers' softmax + `torch.topk` + division).
Its output equals transformers' eager experts within rounding (float32 on CPU: tests/test_moe.py; bf16 on a GPU:
tests/test_gpu.py). Expert-parallel layers (EP sentinels) keep transformers' own implementation.

`use_experts(base, name)` switches a loaded model's experts implementation, like `use_packing` for attention.
"""

from __future__ import annotations

import functools

import torch

EXPERTS_IMPLEMENTATION = "hsx_grouped"  # our name in transformers' ExpertsInterface (one of config.EXPERTS_CHOICES)


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(pairs, in) @ per-group (groups, in, out) -> (pairs, out); rows offsets[g-1]:offsets[g] use weight[g]."""
    mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return mm(x, weight, offs=offsets)


@torch.library.custom_op("hsx::gather_rows", mutates_args=())
def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] along rows, opaque to torch.compile, so that x is computed once rather than once per gathered row.
    Inside a compiled decoder layer Inductor fused the pair gather with the residual add and RMSNorm before it,
    recomputing them for each of a token's k copies: 578 µs per Qwen3-30B-A3B layer at 16k tokens on an H200
    against 259 µs for the gather alone."""
    return x.index_select(0, index)


@gather_rows.register_fake
def _(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.new_empty((index.shape[0],) + tuple(x.shape[1:]))


@torch.library.custom_op("hsx::sum_pairs", mutates_args=())
def sum_pairs(z: torch.Tensor, inverse: torch.Tensor, k: int, extra: torch.Tensor | None = None) -> torch.Tensor:
    """(tokens, hidden) in z's dtype: for each token t, z[inverse[t·k]] + ... + z[inverse[t·k + k-1]] (+ extra[t]),
    summed in float32 in that order and rounded once. On CUDA one Triton kernel reads each pair row once: compiled
    by Inductor as k row gathers, the same took 361 µs a Qwen3-30B-A3B layer at 16k tokens on an H200, ~2.5× the
    time its ~600 MB of traffic needs. Elsewhere the same sum in torch (the reference: equal bit for bit)."""
    if z.is_cuda and z.shape[0] and z.stride(-1) == 1:
        return _sum_pairs_cuda(z, inverse, k, extra)
    rows = z[inverse].view(-1, k, z.shape[-1])
    out = rows[:, 0].float()
    for j in range(1, k):
        out = out + rows[:, j]
    if extra is not None:
        out = out + extra
    return out.to(z.dtype)


@sum_pairs.register_fake
def _(z: torch.Tensor, inverse: torch.Tensor, k: int, extra: torch.Tensor | None = None) -> torch.Tensor:
    return z.new_empty((inverse.shape[0] // k, z.shape[-1]))


SUM_TOKENS, SUM_COLUMNS = 16, 256  # one program's tile: 16 tokens × 256 columns, each of its k rows read once


def _sum_pairs_cuda(z: torch.Tensor, inverse: torch.Tensor, k: int, extra: torch.Tensor | None) -> torch.Tensor:
    tokens, hidden = inverse.shape[0] // k, z.shape[-1]
    out = torch.empty(tokens, hidden, device=z.device, dtype=z.dtype)
    if tokens:
        has_extra = extra is not None
        grid = (-(-tokens // SUM_TOKENS), -(-hidden // SUM_COLUMNS))
        _sum_pairs_kernel()[grid](z, inverse, extra.contiguous() if has_extra else z, out, tokens, hidden,
                                  z.stride(0), K=k, HAS_EXTRA=has_extra, BT=SUM_TOKENS, BH=SUM_COLUMNS,
                                  num_warps=4)
    return out


@functools.cache
def _sum_pairs_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["tokens"])
    def sum_pairs_kernel(z, inverse, extra, out, tokens, hidden, stride_z, K: tl.constexpr,
                         HAS_EXTRA: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        live = t < tokens
        mask = live[:, None] & (h < hidden)[None, :]
        p = tl.load(inverse + t * K, mask=live, other=0).to(tl.int64)
        acc = tl.load(z + p[:, None] * stride_z + h[None, :], mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(1, K):
            p = tl.load(inverse + t * K + j, mask=live, other=0).to(tl.int64)
            acc += tl.load(z + p[:, None] * stride_z + h[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_EXTRA:
            acc += tl.load(extra + t[:, None] * hidden + h[None, :], mask=mask, other=0.0)
        tl.store(out + t[:, None] * hidden + h[None, :], acc.to(out.dtype.element_ty), mask=mask)

    return sum_pairs_kernel


FUSED_DTYPES = (torch.bfloat16, torch.float16)
FUSED_GATE_UP = "_hsx_fused_gate_up"  # set on an experts module by use_experts: decided once, not while traced


@torch.library.custom_op("hsx::gate_up_activation", mutates_args=())
def gate_up_activation(hidden: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
                       gate_up: torch.Tensor, transposed: bool, k: int, bias: torch.Tensor | None = None,
                       clamped: bool = False, alpha: float = 1.0, limit: float = 0.0) -> torch.Tensor:
    """(pairs, width) in hidden's dtype: row r is pair p = order[r] (token p // k, its routing weight weights.flat[p])
    through expert e (rows offsets[e-1]:offsets[e]): silu(x @ G_e) · (x @ U_e) · weight, with x = hidden[p // k] and
    gate_up[e] = [G_e | U_e] as (in, 2·width) when `transposed`, else as (2·width, in) (transformers' layouts; gate
    columns first, as its default `_apply_gate` chunks them). `clamped` is GPT-OSS's gate instead: gate and up
    columns interleaved (2c, 2c+1), `bias[e]` added to both, then (clamp(u, ±limit) + 1) · g' · sigmoid(alpha · g'),
    g' = min(g, limit). On CUDA one Triton grouped GEMM that reads the token rows by index and applies the bias,
    activation and weight to its float32 tiles, so neither the (pairs × hidden) row gather nor the (pairs × 2·width)
    product is written and read again. Elsewhere the same in torch (the reference)."""
    if hidden.is_cuda and order.shape[0] and hidden.dtype in FUSED_DTYPES and gate_up.dtype == hidden.dtype:
        return _gate_up_cuda(hidden.contiguous(), order.contiguous(), offsets.contiguous(), weights.contiguous(),
                             gate_up, transposed, k, None if bias is None else bias.contiguous(), clamped, alpha,
                             limit)
    return _gate_up_reference(hidden, order, offsets, weights, gate_up, transposed, k, bias, clamped, alpha, limit)


@gate_up_activation.register_fake
def _(hidden: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
      gate_up: torch.Tensor, transposed: bool, k: int, bias: torch.Tensor | None = None, clamped: bool = False,
      alpha: float = 1.0, limit: float = 0.0) -> torch.Tensor:
    return hidden.new_empty((order.shape[0], gate_up.shape[-1 if transposed else -2] // 2))


def _gate_up_reference(hidden, order, offsets, weights, gate_up, transposed, k, bias=None, clamped=False, alpha=1.0,
                       limit=0.0):
    """gate_up_activation in torch: the row gather, the grouped GEMM, then the bias, activation and weight."""
    x = hidden.index_select(0, order // k)
    y = _grouped_mm(x, gate_up if transposed else gate_up.transpose(-2, -1), offsets)
    if bias is not None:  # each row's expert: the first whose end offset lies past it
        rows = torch.arange(order.shape[0], device=order.device, dtype=offsets.dtype)
        y = y + bias[torch.searchsorted(offsets, rows, right=True)]
    if clamped:
        gate, up = y[..., ::2].clamp(max=limit), y[..., 1::2].clamp(min=-limit, max=limit)
        y = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    else:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y * weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)


# One program's tile: 128 pairs × 128 columns of the gate and the same 128 of the up projection (two float32
# accumulators), 64 of the hidden dimension a step, in a 4-stage pipeline; 8 warps (vLLM's H200 choice at this
# shape). Measured at Qwen3-30B-A3B's (16k tokens, 128 experts, top-8, width 768) on an H200: 1,367 µs, against
# 1,498 with 3 stages, 1,898 for 128 × 64 and 1,836 for 64 × 128 with 4 warps.
GATE_UP_ROWS, GATE_UP_COLUMNS, GATE_UP_STEP, GATE_UP_WARPS, GATE_UP_STAGES = 128, 128, 64, 8, 4


def _gate_up_cuda(hidden, order, offsets, weights, gate_up, transposed, k, bias=None, clamped=False, alpha=1.0,
                  limit=0.0):
    pairs, (experts, hidden_dim) = order.shape[0], (gate_up.shape[0], hidden.shape[1])
    width = gate_up.shape[-1 if transposed else -2] // 2
    stride_in, stride_out = (gate_up.stride(1), gate_up.stride(2)) if transposed else (gate_up.stride(2),
                                                                                       gate_up.stride(1))
    out = torch.empty(pairs, width, device=hidden.device, dtype=hidden.dtype)
    rows, columns = GATE_UP_ROWS, GATE_UP_COLUMNS
    # Row tiles never straddle two experts: sum over e of ceil(n_e / rows) <= ceil(pairs / rows) + experts. The
    # programs past the real count (known on the GPU only: no sync) return at once.
    grid = ((-(-pairs // rows) + experts) * -(-width // columns),)
    has_bias = bias is not None
    _gate_up_kernel()[grid](hidden, order, offsets, weights, gate_up, bias if has_bias else gate_up, out, pairs,
                            hidden.stride(0), gate_up.stride(0), stride_in, stride_out,
                            bias.stride(0) if has_bias else 0, float(alpha), float(limit), K=k, E=experts,
                            EP=_next_power_of_2(experts), HIDDEN=hidden_dim, WIDTH=width, BM=rows, BN=columns,
                            BK=GATE_UP_STEP, HAS_BIAS=has_bias, CLAMPED=clamped, num_warps=GATE_UP_WARPS,
                            num_stages=GATE_UP_STAGES)
    return out


@functools.cache
def _gate_up_kernel():
    import triton
    import triton.language as tl

    # After vLLM's fused_moe_kernel (vllm/model_executor/layers/fused_moe/fused_moe.py, Apache-2.0): A rows loaded
    # by token index (pair // k), B the expert's weight tile. Here without per-expert padding: each program finds
    # its expert and rows from the experts' end offsets; and with the gated activation and the routing weight in
    # the epilogue.
    @triton.jit(do_not_specialize=["pairs"])
    def gate_up_kernel(x, order, offsets, weights, w, bias, out, pairs, stride_x, stride_we, stride_wk, stride_wn,
                       stride_be, alpha, limit, K: tl.constexpr, E: tl.constexpr, EP: tl.constexpr,
                       HIDDEN: tl.constexpr, WIDTH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr):
        pid = tl.program_id(0)
        tile = pid // tl.cdiv(WIDTH, BN)
        column_tile = pid % tl.cdiv(WIDTH, BN)  # neighbouring programs share the rows; the next tiles the weights
        # The tile table from the experts' end offsets: tiles of expert e = ceil(n_e / BM), in expert order.
        e = tl.arange(0, EP)
        ends = tl.load(offsets + e, mask=e < E, other=0)
        starts = tl.load(offsets + e - 1, mask=(e > 0) & (e < E), other=0)
        tiles = (ends - starts + BM - 1) // BM
        expert = tl.sum((tl.cumsum(tiles, 0) <= tile).to(tl.int32), 0)  # experts whose tiles all come before
        if expert >= E:
            return
        first_tile = tl.sum(tl.where(e < expert, tiles, 0), 0)
        row0 = tl.sum(tl.where(e == expert, starts, 0), 0) + (tile - first_tile) * BM
        end = tl.sum(tl.where(e == expert, ends, 0), 0)
        rows = row0 + tl.arange(0, BM)
        live = rows < end
        rows = tl.minimum(rows, end - 1)  # the tail reads the expert's last row again: no masks in the loop
        pair = tl.load(order + rows).to(tl.int64)
        columns = column_tile * BN + tl.arange(0, BN)
        steps = tl.arange(0, BK)
        a_ptr = x + (pair // K)[:, None] * stride_x + steps[None, :]
        w_e = w + expert.to(tl.int64) * stride_we
        if CLAMPED:
            # Gate and up interleaved (GPT-OSS): the 2·BN weight columns of this tile are contiguous, so one
            # accumulator over them, split into gate and up in the epilogue (strided loads of each half would be
            # 2-byte loads the async copies cannot take).
            both = (column_tile * 2 * BN + tl.arange(0, 2 * BN)) % (2 * WIDTH)
            b_ptr = w_e + steps[:, None] * stride_wk + both[None, :] * stride_wn
            acc = tl.zeros([BM, 2 * BN], dtype=tl.float32)
            for i in range(tl.cdiv(HIDDEN, BK)):
                if HIDDEN % BK == 0:
                    a = tl.load(a_ptr)
                    b = tl.load(b_ptr)
                else:
                    step_in = steps < HIDDEN - i * BK
                    a = tl.load(a_ptr, mask=step_in[None, :], other=0.0)
                    b = tl.load(b_ptr, mask=step_in[:, None], other=0.0)
                acc = tl.dot(a, b, acc)
                a_ptr += BK
                b_ptr += BK * stride_wk
            if HAS_BIAS:
                acc += tl.load(bias + expert.to(tl.int64) * stride_be + both).to(tl.float32)[None, :]
            gate, up = tl.split(tl.reshape(acc, [BM, BN, 2]))
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            y = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
        else:
            inside = columns % WIDTH
            g_ptr = w_e + steps[:, None] * stride_wk + inside[None, :] * stride_wn
            u_ptr = g_ptr + WIDTH * stride_wn
            gate = tl.zeros([BM, BN], dtype=tl.float32)
            up = tl.zeros([BM, BN], dtype=tl.float32)
            for i in range(tl.cdiv(HIDDEN, BK)):
                if HIDDEN % BK == 0:
                    a = tl.load(a_ptr)
                    g = tl.load(g_ptr)
                    u = tl.load(u_ptr)
                else:
                    step_in = steps < HIDDEN - i * BK
                    a = tl.load(a_ptr, mask=step_in[None, :], other=0.0)
                    g = tl.load(g_ptr, mask=step_in[:, None], other=0.0)
                    u = tl.load(u_ptr, mask=step_in[:, None], other=0.0)
                gate = tl.dot(a, g, gate)
                up = tl.dot(a, u, up)
                a_ptr += BK
                g_ptr += BK * stride_wk
                u_ptr += BK * stride_wk
            if HAS_BIAS:
                b_e = bias + expert.to(tl.int64) * stride_be
                gate += tl.load(b_e + inside).to(tl.float32)[None, :]
                up += tl.load(b_e + WIDTH + inside).to(tl.float32)[None, :]
            y = gate * tl.sigmoid(gate) * up
        weight = tl.load(weights + pair).to(tl.float32)
        y = y * weight[:, None]
        keep = live[:, None] & (columns < WIDTH)[None, :]
        tl.store(out + rows.to(tl.int64)[:, None] * WIDTH + columns[None, :], y.to(out.dtype.element_ty),
                 mask=keep)

    return gate_up_kernel


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


def grouped_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward signature: (tokens, hidden), (tokens, k) expert ids, (tokens, k) weights."""
    if getattr(self, "_is_expert_parallel", False):
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
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
        y = _grouped_mm(x, w_in if self.is_transposed else w_in.transpose(-2, -1), offsets)
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
    z = _grouped_mm(y, w_out if self.is_transposed else w_out.transpose(-2, -1), offsets)
    if post_norm:
        if self.has_bias:
            z = z + self.down_proj_bias[expert_of_pair.long()]
        z = self.post_expert_norm(z) * pair_weight.to(z.dtype)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    extra = None
    if self.has_bias and not post_norm:  # sum_j w_tj · b_(e_tj) = routing matrix (tokens × experts) @ bias table
        routing = torch.zeros(tokens, experts, device=z.device, dtype=torch.float32)
        routing.scatter_(1, top_k_index, top_k_weights.float())
        extra = routing @ self.down_proj_bias.float()
    # Back to token order and the sum of a token's k outputs, in one pass (as a sum(dim=1) it became an Inductor
    # reduction 7x under memory bandwidth: 19% of a Qwen3-30B-A3B layer's GPU time on an H200).
    return sum_pairs(z, inverse, k, extra).to(dtype)


@torch.library.custom_op("hsx::route_topk", mutates_args=())
def route_topk(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's router after its linear layer: softmax over the experts in float32, the k largest (descending;
    on CUDA, among equal probabilities the lower expert first), divided by their sum when `renormalize`; weights in
    the logits' dtype, expert ids int64. On CUDA one Triton kernel reads each token's logits once: `torch.topk` alone
    took 2.7% of Qwen3-30B-A3B's GPU time on an H200 (Inductor cannot lower it). Elsewhere the reference in torch."""
    if logits.is_cuda and logits.shape[0] and logits.stride(-1) == 1 and k <= logits.shape[-1] <= ROUTE_EXPERTS_MAX:
        return _route_topk_cuda(logits, k, renormalize)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, index = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), index


@route_topk.register_fake
def _(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows = logits.shape[0]
    return logits.new_empty((rows, k)), logits.new_empty((rows, k), dtype=torch.int64)


ROUTE_TOKENS, ROUTE_EXPERTS_MAX = 32, 1024  # one program: 32 tokens' logits in registers (128 experts: 16 KB)


def _route_topk_cuda(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, experts = logits.shape
    weights = torch.empty(tokens, k, device=logits.device, dtype=logits.dtype)
    index = torch.empty(tokens, k, device=logits.device, dtype=torch.int64)
    grid = (-(-tokens // ROUTE_TOKENS),)
    _route_kernel()[grid](logits, weights, index, tokens, logits.stride(0), E=experts,
                          EP=_next_power_of_2(experts), K=k, KP=_next_power_of_2(k),
                          RENORM=renormalize, BT=ROUTE_TOKENS, num_warps=4)
    return weights, index


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _route_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["tokens"])
    def route_kernel(logits, weights, index, tokens, stride, E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr,
                     KP: tl.constexpr, RENORM: tl.constexpr, BT: tl.constexpr):
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        e = tl.arange(0, EP)
        live = t < tokens
        mask = live[:, None] & (e < E)[None, :]
        x = tl.load(logits + t[:, None] * stride + e[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        x = x - tl.max(x, 1)[:, None]
        p = tl.where(mask, tl.exp(x), 0.0)
        p = p / tl.sum(p, 1)[:, None]
        p = tl.where(mask, p, -1.0)  # below every probability: never picked
        j = tl.arange(0, KP)
        top = tl.zeros([BT, KP], tl.float32)
        ids = tl.zeros([BT, KP], tl.int64)
        for i in tl.static_range(K):
            best = tl.max(p, 1)
            at = tl.min(tl.where(p == best[:, None], e[None, :], EP), 1)  # the lowest expert of the largest
            # A NaN row (a non-finite hidden state) matches no expert: keep its ids in range (its weights stay NaN,
            # its states are flagged downstream) instead of naming expert E, which the grouped GEMM would index.
            at = tl.minimum(at, E - 1)
            top = tl.where(j[None, :] == i, best[:, None], top)
            ids = tl.where(j[None, :] == i, at.to(tl.int64)[:, None], ids)
            p = tl.where(e[None, :] == at[:, None], -1.0, p)
        if RENORM:
            top = top / tl.sum(top, 1)[:, None]
        out = t[:, None] * K + j[None, :]
        keep = live[:, None] & (j < K)[None, :]
        tl.store(weights + out, top.to(weights.dtype.element_ty), mask=keep)
        tl.store(index + out, ids, mask=keep)

    return route_kernel


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


def has_experts(base: torch.nn.Module) -> bool:
    """Whether the model has experts modules that transformers' ExpertsInterface dispatches."""
    return any(_dispatched(m) for m in base.modules())


def _dispatched(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("Experts") and hasattr(module, "has_gate")


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
            setattr(m, FUSED_GATE_UP, name == EXPERTS_IMPLEMENTATION and _gate_up_fusable(m))
    if name == EXPERTS_IMPLEMENTATION:
        register()
    configs = {id(m.config): m.config for m in base.modules() if _dispatched(m) and getattr(m, "config", None)}
    configs[id(base.config)] = base.config
    for config in configs.values():
        config._experts_implementation = name
