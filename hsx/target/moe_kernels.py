"""The kernels of hsx.target.moe's grouped experts (its docstring says what each one saves): torch custom ops
(`hsx::...`),
each a Triton kernel on CUDA and the same maths in torch elsewhere (the reference): `gather_rows`, `sum_pairs`,
`gate_up_activation`, `route_topk`, and for e4m3 experts `fp8_gate_up_activation` and `fp8_grouped_down`, which run
only where they pass their check against the reference on the device (`fp8_experts_run_on`). `grouped_mm` is
torch's grouped GEMM."""

from __future__ import annotations

import functools
import warnings

import torch

from hsx.target import fp8, fp8_gemm, kernels


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(pairs, in) @ per-group (groups, in, out) -> (pairs, out); rows offsets[g-1]:offsets[g] use weight[g]."""
    mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return mm(x, weight, offs=offsets)


@torch.library.custom_op("hsx::gather_rows", mutates_args=())
def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] along rows, opaque to torch.compile, so that x is computed once rather than once per gathered row.
    Inside a compiled decoder layer Inductor fused the pair gather with the residual add and RMSNorm before it,
    recomputing them for each of a token's k copies, at twice the gather's own time (docs/benchmarks.md,
    2026-11-30 to 2026-12-01)."""
    return x.index_select(0, index)


@gather_rows.register_fake
def _(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.new_empty((index.shape[0],) + tuple(x.shape[1:]))


@torch.library.custom_op("hsx::sum_pairs", mutates_args=())
def sum_pairs(z: torch.Tensor, inverse: torch.Tensor, k: int, extra: torch.Tensor | None = None) -> torch.Tensor:
    """(tokens, hidden) in z's dtype: for each token t, z[inverse[t·k]] + ... + z[inverse[t·k + k-1]] (+ extra[t]),
    summed in float32 in that order and rounded once. On CUDA one Triton kernel reads each pair row once: compiled
    by Inductor as k row gathers, the same took several times what its memory traffic needs (docs/benchmarks.md,
    2026-11-30 to 2026-12-01). Elsewhere the same sum in torch (the reference: equal bit for bit)."""
    if z.is_cuda and z.shape[0] and z.stride(-1) == 1 and kernels.allowed("moe_sum_pairs", z.device):
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
    y = grouped_mm(x, gate_up if transposed else gate_up.transpose(-2, -1), offsets)
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
# accumulators), 64 of the hidden dimension a step, in a 4-stage pipeline; 8 warps (vLLM's choice at this shape):
# the fastest of the tiles timed at Qwen3-30B-A3B's shape (docs/benchmarks.md, 2026-11-30 to 2026-12-01).
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


# ---- FP8 experts (the official `-FP8` MoE checkpoints) --------------------------------------------------------------

@torch.library.custom_op("hsx::fp8_gate_up_activation", mutates_args=())
def fp8_gate_up_activation(xq: torch.Tensor, xs: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor,
                           gate_up: torch.Tensor, gate_up_scale: torch.Tensor, k: int,
                           out_dtype: torch.dtype) -> torch.Tensor:
    """(pairs, width) in out_dtype: row r is pair p = order[r] (token p // k) through expert e (rows
    offsets[e-1]:offsets[e]): silu(x @ G_eᵀ) · (x @ U_eᵀ), x = the token's e4m3 row xq[p // k] times its 1×128 block
    scales xs[p // k] (`hsx.target.fp8_gemm.fp8_quantize`), [G_e; U_e] = gate_up[e] (2·width, hidden) e4m3 times its
    128×128 block scales gate_up_scale[e]. On CUDA one Triton kernel (`fp8_gate_up_kernel`); elsewhere the reference
    (`_fp8_gate_up_reference`), one expert's weights dequantized at a time."""
    if xq.is_cuda and order.shape[0] and _fp8_kernels_take(gate_up, gate_up_scale, "gate_up"):
        return _fp8_gate_up_cuda(xq, xs, order.contiguous(), offsets.contiguous(), gate_up, gate_up_scale, k,
                                 out_dtype)
    return _fp8_gate_up_reference(xq, xs, order, offsets, gate_up, gate_up_scale, k, out_dtype)


@fp8_gate_up_activation.register_fake
def _(xq, xs, order, offsets, gate_up, gate_up_scale, k, out_dtype):
    return xq.new_empty((order.shape[0], gate_up.shape[1] // 2), dtype=out_dtype)


@torch.library.custom_op("hsx::fp8_grouped_down", mutates_args=())
def fp8_grouped_down(aq: torch.Tensor, a_s: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor,
                     weights: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """(pairs, hidden) in out_dtype: row r = (aq[r] · a_s[r]) @ D_eᵀ · weights.flat[order[r]] for the expert e whose
    rows hold r, D_e = down[e] (hidden, width) e4m3 times its 128×128 block scales down_scale[e]; aq, a_s the rows'
    e4m3 values and 1×128 block scales (`hsx.target.fp8_gemm.fp8_quantize`, rows may be padded). The routing weight
    scales
    the float32 product, as transformers' FP8 experts scale their output. On CUDA one Triton kernel; elsewhere the
    reference."""
    if aq.is_cuda and order.shape[0] and _fp8_kernels_take(down, down_scale, "down"):
        return _fp8_down_cuda(aq, a_s, order.contiguous(), offsets.contiguous(), weights.contiguous(), down,
                              down_scale, out_dtype)
    return _fp8_down_reference(aq, a_s, order, offsets, weights, down, down_scale, out_dtype)


@fp8_grouped_down.register_fake
def _(aq, a_s, order, offsets, weights, down, down_scale, out_dtype):
    return aq.new_empty((order.shape[0], down.shape[1]), dtype=out_dtype)


_FP8_KERNEL_CHECKS: dict[tuple, bool] = {}  # (device, op, weight shape) → the kernel agreed with the reference


def _fp8_kernels_take(w: torch.Tensor, ws: torch.Tensor, op: str) -> bool:
    """Whether the Triton kernel runs `op` ("gate_up" or "down") for experts of this weight shape: on its first
    call for (device, shape), 192 tokens routed 2 each over the first experts of these very weights must agree with
    the reference (`fp8.relative_error` < fp8.CHECK_TOLERANCE), else (a compile error, a wrong result) one warning
    and the reference runs from then on: slow, never wrong."""
    key = (w.device.index, op, *w.shape)
    if key not in _FP8_KERNEL_CHECKS:
        experts, n, hidden = w.shape
        k, tokens = 2, 192
        g = torch.Generator(device=w.device).manual_seed(1)
        width = n // 2 if op == "gate_up" else hidden
        x = torch.randn(tokens, hidden if op == "gate_up" else width, device=w.device, generator=g,
                        dtype=torch.bfloat16)
        xq, xs = fp8_gemm.fp8_quantize(x)
        used = min(experts, 3)
        offsets = torch.full((experts,), tokens * k, device=w.device, dtype=torch.int64)
        offsets[:used] = torch.arange(1, used + 1, device=w.device) * (tokens * k // used)
        offsets[used - 1] = tokens * k
        order = torch.randperm(tokens * k, device=w.device, generator=g)
        try:
            if op == "gate_up":
                want = _fp8_gate_up_reference(xq, xs, order, offsets, w, ws, k, torch.float32)
                got = _fp8_gate_up_cuda(xq, xs, order, offsets, w, ws, k, torch.float32)
            else:
                weights = torch.rand(tokens, k, device=w.device, generator=g)
                xq, xs = fp8_gemm.fp8_quantize(x.repeat_interleave(k, 0))  # one row per pair, as after gate/up
                want = _fp8_down_reference(xq, xs, order, offsets, weights, w, ws, torch.float32)
                got = _fp8_down_cuda(xq, xs, order, offsets, weights, w, ws, torch.float32)
            ok = fp8.relative_error(got, want) < fp8.CHECK_TOLERANCE
            why = "its product differs from the reference"
        except Exception as e:  # noqa: BLE001  (a Triton compile or launch error on this GPU)
            ok, why = False, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        if not ok:
            warnings.warn(f"hsx: the FP8 experts' {op} kernel failed its check on {w.device} ({why}); experts of "
                          "this shape run the slow reference (one expert dequantized at a time)", stacklevel=2)
        _FP8_KERNEL_CHECKS[key] = ok
    return _FP8_KERNEL_CHECKS[key]


def fp8_experts_run_on(module: torch.nn.Module, cuda: bool) -> str:
    """What runs an FP8 experts module's products: "triton" where both kernels pass their checks for its weight
    shapes (run now, once per shape: hsx.json's record says what ran, not what was meant to), else "torch
    reference"."""
    if not cuda:
        return "torch reference"
    ok = (_fp8_kernels_take(module.gate_up_proj, module.gate_up_proj_scale_inv, "gate_up")
          and _fp8_kernels_take(module.down_proj, module.down_proj_scale_inv, "down"))
    return "triton" if ok else "torch reference"


def _dequantized_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 (M, K) = e4m3 (M, K) times its (M, K/128) 1×128 block scales."""
    m, k = q.shape
    return (q.float().view(m, k // fp8.BLOCK, fp8.BLOCK) * scale.float()[:m].unsqueeze(-1)).view(m, k)


def fp8_grouped_reference(x: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(pairs, N) in `dtype`: rows offsets[e-1]:offsets[e] of x times expert e's (N, K) weight dequantized to
    `dtype`, one expert at a time (a layer's experts are never all dequantized at once: memory stays one
    expert's)."""
    out = x.new_zeros((x.shape[0], w.shape[1]), dtype=dtype)
    ends = offsets.tolist()
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            out[start:end] = x[start:end].to(dtype) @ fp8.dequantize_weight(w[e], ws[e], dtype).t()
        start = end
    return out


def _fp8_gate_up_reference(xq, xs, order, offsets, gate_up, gate_up_scale, k, out_dtype):
    x = _dequantized_rows(xq, xs).index_select(0, order // k)
    gate, up = fp8_grouped_reference(x, offsets, gate_up, gate_up_scale).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(out_dtype)


def _fp8_down_reference(aq, a_s, order, offsets, weights, down, down_scale, out_dtype):
    z = fp8_grouped_reference(_dequantized_rows(aq, a_s)[:order.shape[0]], offsets, down, down_scale)
    return (z * weights.reshape(-1)[order].float().unsqueeze(1)).to(out_dtype)


# One program's tile: 64 pairs × 128 columns (one 128-column scale block of the gate and the same of the up
# projection), 128 of the hidden dimension a step (one scale block), 3 stages: the fastest of the tiles swept at
# Qwen3-30B-A3B's and Qwen3.6-35B-A3B's expert shapes (docs/benchmarks.md, 2026-12-02 (later), FP8 experts): the
# gate/up kernel, two accumulators, is faster on 8 warps than on vLLM's default 4; the down kernel is fastest on 4;
# 128-row tiles and more stages were slower or out of shared memory.
FP8_ROWS, FP8_STAGES = 64, 3
FP8_GATE_UP_WARPS, FP8_DOWN_WARPS = 8, 4


def _fp8_tiles(pairs: int, experts: int, columns: int) -> tuple[int]:
    """The launch grid: row tiles never straddle two experts, so at most ceil(pairs / rows) + experts of them (the
    programs past the real count return at once), times the column tiles."""
    return ((-(-pairs // FP8_ROWS) + experts) * (columns // 128),)


def _fp8_gate_up_cuda(xq, xs, order, offsets, gate_up, gate_up_scale, k, out_dtype):
    pairs, (experts, two_width, hidden) = order.shape[0], gate_up.shape
    width = two_width // 2
    out = torch.empty(pairs, width, device=xq.device, dtype=out_dtype)
    _fp8_kernels()[0][_fp8_tiles(pairs, experts, width)](
        xq, xs, order, offsets, gate_up, gate_up_scale, out, pairs, xq.stride(0), xs.stride(0), xs.stride(1),
        gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0), gate_up_scale.stride(1),
        gate_up_scale.stride(2), K=k, E=experts, EP=_next_power_of_2(experts), HIDDEN=hidden, WIDTH=width,
        BM=FP8_ROWS, num_warps=FP8_GATE_UP_WARPS, num_stages=FP8_STAGES)
    return out


def _fp8_down_cuda(aq, a_s, order, offsets, weights, down, down_scale, out_dtype):
    pairs, (experts, hidden, width) = order.shape[0], down.shape
    out = torch.empty(pairs, hidden, device=aq.device, dtype=out_dtype)
    _fp8_kernels()[1][_fp8_tiles(pairs, experts, hidden)](
        aq, a_s, order, offsets, weights, down, down_scale, out, pairs, aq.stride(0), a_s.stride(0), a_s.stride(1),
        down.stride(0), down.stride(1), down_scale.stride(0), down_scale.stride(1), down_scale.stride(2),
        E=experts, EP=_next_power_of_2(experts), HIDDEN=hidden, WIDTH=width, BM=FP8_ROWS, num_warps=FP8_DOWN_WARPS,
        num_stages=FP8_STAGES)
    return out


@functools.cache
def _fp8_kernels():
    import triton
    import triton.language as tl

    # After vLLM's fused_moe_kernel with use_fp8_w8a8 and block_shape [128, 128]
    # (vllm/model_executor/layers/fused_moe/fused_moe.py, Apache-2.0): A rows by token index, a_scale per (row,
    # K block), b_scale per (expert, N block, K block), each K step of 128 one scale block whose partial product is
    # scaled by a_scale · b_scale before it is accumulated in float32. Here without per-expert padding (the tile
    # table from the experts' end offsets, as `gate_up_kernel`), and with SiLU(gate)·up, or the routing weight, in
    # the epilogue.
    @triton.jit
    def expert_tile(offsets, tile, E: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr):
        """(expert, first row, end row) of row tile `tile`; expert == E past the real tiles."""
        e = tl.arange(0, EP)
        ends = tl.load(offsets + e, mask=e < E, other=0)
        starts = tl.load(offsets + e - 1, mask=(e > 0) & (e < E), other=0)
        tiles = (ends - starts + BM - 1) // BM
        expert = tl.sum((tl.cumsum(tiles, 0) <= tile).to(tl.int32), 0)
        first_tile = tl.sum(tl.where(e < expert, tiles, 0), 0)
        row0 = tl.sum(tl.where(e == expert, starts, 0), 0) + (tile - first_tile) * BM
        end = tl.sum(tl.where(e == expert, ends, 0), 0)
        return expert, row0, end

    @triton.jit(do_not_specialize=["pairs"])
    def fp8_gate_up_kernel(xq, xs, order, offsets, w, ws, out, pairs, stride_x, stride_xs_m, stride_xs_k,
                           stride_we, stride_wn, stride_se, stride_sn, stride_sk, K: tl.constexpr, E: tl.constexpr,
                           EP: tl.constexpr, HIDDEN: tl.constexpr, WIDTH: tl.constexpr, BM: tl.constexpr):
        BN: tl.constexpr = 128
        BK: tl.constexpr = 128
        pid = tl.program_id(0)
        tile = pid // (WIDTH // BN)
        column_tile = pid % (WIDTH // BN)
        expert, row0, end = expert_tile(offsets, tile, E, EP, BM)
        if expert >= E:
            return
        rows = row0 + tl.arange(0, BM)
        live = rows < end
        rows = tl.minimum(rows, end - 1)
        token = (tl.load(order + rows).to(tl.int64)) // K
        steps = tl.arange(0, BK)
        columns = column_tile * BN + tl.arange(0, BN)
        a_ptr = xq + token[:, None] * stride_x + steps[None, :]
        as_ptr = xs + token * stride_xs_m
        w_e = w + expert.to(tl.int64) * stride_we
        g_ptr = w_e + columns[None, :].to(tl.int64) * stride_wn + steps[:, None]
        u_ptr = g_ptr + WIDTH * stride_wn
        s_e = ws + expert.to(tl.int64) * stride_se
        sg_ptr = s_e + column_tile * stride_sn
        su_ptr = s_e + (WIDTH // BN + column_tile) * stride_sn
        gate = tl.zeros([BM, BN], dtype=tl.float32)
        up = tl.zeros([BM, BN], dtype=tl.float32)
        for i in range(HIDDEN // BK):
            a = tl.load(a_ptr)
            sa = tl.load(as_ptr + i * stride_xs_k)
            gate += tl.dot(a, tl.load(g_ptr)) * (sa[:, None] * tl.load(sg_ptr + i * stride_sk))
            up += tl.dot(a, tl.load(u_ptr)) * (sa[:, None] * tl.load(su_ptr + i * stride_sk))
            a_ptr += BK
            g_ptr += BK
            u_ptr += BK
        y = gate * tl.sigmoid(gate) * up
        tl.store(out + rows.to(tl.int64)[:, None] * WIDTH + columns[None, :], y.to(out.dtype.element_ty),
                 mask=live[:, None])

    @triton.jit(do_not_specialize=["pairs"])
    def fp8_down_kernel(aq, a_s, order, offsets, weights, w, ws, out, pairs, stride_a, stride_as_m, stride_as_k,
                        stride_we, stride_wn, stride_se, stride_sn, stride_sk, E: tl.constexpr, EP: tl.constexpr,
                        HIDDEN: tl.constexpr, WIDTH: tl.constexpr, BM: tl.constexpr):
        BN: tl.constexpr = 128
        BK: tl.constexpr = 128
        pid = tl.program_id(0)
        tile = pid // (HIDDEN // BN)
        column_tile = pid % (HIDDEN // BN)
        expert, row0, end = expert_tile(offsets, tile, E, EP, BM)
        if expert >= E:
            return
        rows = row0 + tl.arange(0, BM)
        live = rows < end
        rows = tl.minimum(rows, end - 1).to(tl.int64)
        steps = tl.arange(0, BK)
        columns = column_tile * BN + tl.arange(0, BN)
        a_ptr = aq + rows[:, None] * stride_a + steps[None, :]
        as_ptr = a_s + rows * stride_as_m
        b_ptr = w + expert.to(tl.int64) * stride_we + columns[None, :].to(tl.int64) * stride_wn + steps[:, None]
        sb_ptr = ws + expert.to(tl.int64) * stride_se + column_tile * stride_sn
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for i in range(WIDTH // BK):
            sa = tl.load(as_ptr + i * stride_as_k)
            acc += tl.dot(tl.load(a_ptr), tl.load(b_ptr)) * (sa[:, None] * tl.load(sb_ptr + i * stride_sk))
            a_ptr += BK
            b_ptr += BK
        weight = tl.load(weights + tl.load(order + rows)).to(tl.float32)
        acc = acc * weight[:, None]
        tl.store(out + rows[:, None] * HIDDEN + columns[None, :], acc.to(out.dtype.element_ty), mask=live[:, None])

    return fp8_gate_up_kernel, fp8_down_kernel


@torch.library.custom_op("hsx::route_topk", mutates_args=())
def route_topk(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's router after its linear layer: softmax over the experts in float32, the k largest (descending;
    on CUDA, among equal probabilities the lower expert first), divided by their sum when `renormalize`; weights in
    the logits' dtype, expert ids int64. On CUDA one Triton kernel reads each token's logits once: `torch.topk` alone
    was a visible share of Qwen3-30B-A3B's GPU time (Inductor cannot lower it; docs/benchmarks.md, 2026-11-30 to
    2026-12-01). Elsewhere the reference in torch."""
    if (logits.is_cuda and logits.shape[0] and logits.stride(-1) == 1 and k <= logits.shape[-1] <= ROUTE_EXPERTS_MAX
            and kernels.allowed("moe_route_topk", logits.device)):
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
