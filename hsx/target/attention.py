"""Causal attention over one packed sequence of short rows (`cu_seqlens`), grouped-query heads, as one Triton kernel.

hsx packs a batch's rows into one sequence; flash-attention 2's varlen kernel (torch.nn.attention.varlen) gives each
(row, head) its own 128-query tiles, so a row of a few hundred tokens spends most of its tiles on the causal
diagonal and the ragged last tile, far below the kernel's rate on long rows. Here a program
takes a fixed slice of the packed sequence, TOK consecutive tokens × the G query heads that share one key/value head
(TOK·G = 128 query rows), wherever rows begin or end inside it: each query row keeps the keys from its own row's
start to itself (a per-token start mask), so a tile never waits on a row boundary, and a K/V block is loaded once
for the G heads that read it. Tiles inside one row run their full key blocks unmasked. Timed against FA2 on the
batches `hsx bench --profile` draws, with Qwen3-30B-A3B's and Qwen3-8B's heads: docs/benchmarks.md (2026-11-30 to
2026-12-01).

The scores and the softmax are float32 (online, in base 2), the output rounded once; it equals flash-attention's
within bf16 rounding (tests/test_gpu.py). CUDA only; `hsx.target.prepare.varlen_attention` calls it where `supports`
holds
(no sinks, no sliding window; else FA2, as for batches with rows over KERNEL_ROW_LIMIT tokens, and on GPUs the kernel
was not checked on: `hsx.target.kernels`, compute capability 9.0).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch

from hsx.config import HsxError
from hsx.target import kernels

QUERY_ROWS = 128  # query rows of one program: TOK tokens × G heads of one key/value head group
# Fixed, no autotuning at run time: of the configs timed (key blocks 32-128, 4 or 8 warps, 2-4 stages) this was the
# fastest for both head layouts above (docs/benchmarks.md, "Figures moved from the code").
KEY_BLOCK, NUM_WARPS, NUM_STAGES = 32, 4, 3
# Batches whose longest row is longer run flash-attention 2 varlen: the kernel was measured faster on the bench's
# length distribution (rows up to 4,096 tokens), not beyond; FA2's 128-query tiles suit long rows.
KERNEL_ROW_LIMIT = 4096


def _varlen_signature() -> frozenset[str]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.9: no varlen kernel (packing_blocker says so)
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


# varlen_attn's keyword names in this torch (they changed in 2.10, 2.12); read here once, since inspecting inside a
# compiled layer would break its graph.
VARLEN_PARAMS: frozenset[str] = _varlen_signature()


def flash_varlen(q, k, v, cu: torch.Tensor, max_len: int, scale: float | None, sliding_window: int | None,
                 lse: bool = False):
    """flash-attention 2 varlen (torch.nn.attention.varlen) over the rows `cu` delimits, in this torch's keywords;
    with `lse`, (out, aux) where aux.lse is (heads, T) float32."""
    from torch.nn.attention.varlen import varlen_attn

    params = VARLEN_PARAMS
    kwargs: dict[str, Any] = {"scale": scale}
    if lse:  # packing_blocker refused sinks where varlen_attn has no return_aux
        from torch.nn.attention.varlen import AuxRequest

        kwargs["return_aux"] = AuxRequest(lse=True)
    if "window_size" in params:  # torch ≥ 2.10: (left, right); right 0 is causal; a sliding window keeps W-1 back
        kwargs["window_size"] = (sliding_window - 1 if sliding_window else -1, 0)
    else:  # torch 2.9
        if sliding_window:
            raise HsxError("--packing varlen: sliding-window attention needs torch >= 2.10; use --packing none")
        kwargs["is_causal"] = True
    if "enable_gqa" in params and k.shape[1] != q.shape[1]:  # earlier versions pass fewer k/v heads through
        kwargs["enable_gqa"] = True
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes these (T, heads, dim) tensors: one head dim (64 or 128) for q, k and v, query heads
    a multiple of the key/value heads, at most 128 of them per group."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and v.dtype == q.dtype
            and dim in (64, 128) and k.shape[-1] == dim and v.shape[-1] == dim and v.shape[1] == kv_heads
            and heads % kv_heads == 0 and heads // kv_heads <= QUERY_ROWS
            and all(x.stride(-1) == 1 for x in (q, k, v)))


def row_starts(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """(tokens,) int32: the packed position where each token's row begins (tokens past cu_seqlens[-1]: there)."""
    pos = torch.arange(tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    row = torch.searchsorted(cu_seqlens[1:].contiguous(), pos, right=True)
    return cu_seqlens.index_select(0, row).to(torch.int32)


@torch.library.custom_op("hsx::packed_causal_attention", mutates_args=())
def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_len: int, scale: float) -> torch.Tensor:
    """(T, heads, dim) q, (T, kv_heads, dim) k and v: (T, heads, dim) causal attention of each token over its own
    row's keys, in q's dtype. A custom op, as flash-attention's varlen op is: a compiled layer calls it as it is,
    the row starts included (computed in the compiled layer instead, they left the compiled graphs unused past the
    first batch with torch 2.11, so the bench ran eager; the cause was not found: docs/benchmarks.md, 2026-11-30 to
    2026-12-01).
    A batch whose longest row (`max_len`) exceeds KERNEL_ROW_LIMIT runs flash-attention 2 here instead: decided
    inside the op, a branch on the length in the compiled layer would be a guard, and a batch failing it would
    run the layer eager."""
    if max_len > KERNEL_ROW_LIMIT or not kernels.allowed("packed_attention", q.device):  # (hsx.target.kernels' table)
        return flash_varlen(q, k, v, cu_seqlens, max_len, scale, None)
    tokens, heads, dim = q.shape
    groups = heads // k.shape[1]
    out = torch.empty(tokens, heads, dim, device=q.device, dtype=q.dtype)
    per_program = QUERY_ROWS // groups
    if tokens:
        grid = (-(-tokens // per_program), k.shape[1])
        _kernel()[grid](q, k, v, out, row_starts(cu_seqlens, tokens), tokens, q.stride(0), q.stride(1),
                        k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
                        scale * math.log2(math.e), G=groups, TOK=per_program, BM=QUERY_ROWS, BN=KEY_BLOCK, D=dim,
                        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


@packed_causal_attention.register_fake
def _(q, k, v, cu_seqlens, max_len, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
              scale: float | None) -> torch.Tensor:
    """Causal attention of the packed rows `cu_seqlens` delimits (the longest `max_len` tokens): (T, heads, dim) q,
    k, v in, (T, heads, dim) out."""
    return packed_causal_attention(q, k, v, cu_seqlens, int(max_len),
                                   q.shape[-1] ** -0.5 if scale is None else float(scale))


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["tokens"])
    def packed_attention_kernel(Q, K, V, O, starts, tokens, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                                stride_vh, stride_ot, stride_oh, qk_scale, G: tl.constexpr, TOK: tl.constexpr,
                                BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
        first = tl.program_id(0) * TOK
        kv_head = tl.program_id(1)
        r = tl.arange(0, BM)
        d = tl.arange(0, D)
        tok = first + r // G  # query row r: token first + r // G, head kv_head·G + r % G
        head = kv_head * G + r % G
        live = (r < TOK * G) & (tok < tokens)
        s = tl.load(starts + tok, mask=live, other=0)
        q = tl.load(Q + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=live[:, None], other=0.0)
        hi = tl.minimum(first + TOK, tokens)
        lo = tl.load(starts + first)  # starts never decrease: the tile's first and last tokens bound its rows
        s_max = tl.load(starts + hi - 1)
        # Keys every query row of the tile keeps: one row's start up to the tile's first token (none when rows
        # begin inside the tile); those blocks need no mask.
        full = tl.where(s_max == lo, (first + 1 - lo) // BN, 0)
        mid = lo + full * BN
        m_i = tl.full([BM], -1.0e30, tl.float32)  # finite: a row masked out of a whole block keeps alpha = 1
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        K += kv_head.to(tl.int64) * stride_kh  # this group's key and value head
        V += kv_head.to(tl.int64) * stride_vh
        for masked in tl.static_range(2):  # [lo, mid) unmasked, then [mid, hi) with the row and causal masks
            for start in range(mid if masked else lo, hi if masked else mid, BN):
                n = start + tl.arange(0, BN)
                if masked:
                    inside = n < hi
                    kt = tl.load(K + n.to(tl.int64)[None, :] * stride_kt + d[:, None], mask=inside[None, :],
                                 other=0.0)
                    vb = tl.load(V + n.to(tl.int64)[:, None] * stride_vt + d[None, :], mask=inside[:, None],
                                 other=0.0)
                else:
                    kt = tl.load(K + n.to(tl.int64)[None, :] * stride_kt + d[:, None])
                    vb = tl.load(V + n.to(tl.int64)[:, None] * stride_vt + d[None, :])
                qk = tl.dot(q, kt) * qk_scale
                if masked:
                    keep = (n[None, :] >= s[:, None]) & (n[None, :] <= tok[:, None])
                    qk = tl.where(keep, qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                p = tl.math.exp2(qk - m_new[:, None])
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
                m_i = m_new
        out = acc / tl.where(live, l_i, 1.0)[:, None]
        tl.store(O + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(O.dtype.element_ty), mask=live[:, None])

    return packed_attention_kernel
