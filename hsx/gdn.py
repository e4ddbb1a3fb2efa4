"""Gated DeltaNet layers (Qwen3.5/3.6, Qwen3-Next linear attention) on flash-linear-attention's kernels.

transformers' own GatedDeltaNet forward runs its short convolution as `F.conv1d` without causal-conv1d (a torch
fallback: measured on an H200, the 27B shape ran at 35.5% MFU), its gated RMSNorm and gating as separate elementwise
ops, and it ignores sequence boundaries: in a packed batch every row's recurrent state and convolution window leak
into the next (NeMo Automodel #2147: layer outputs off by 0.40). `install` replaces, per module instance, the forward
of each such layer with `fla_forward`: fla's Triton causal_conv1d, one Triton kernel for the q/k l2norm,
chunk_gated_delta_rule with the gate and beta sigmoid fused in, and fla's fused gated RMSNorm. For a packed batch
(`packed_rows`, set by hsx.engine around each forward) the row boundaries go to both the convolution and the delta
rule, so each row starts from a zero state and a zero convolution window: the packed forward equals one forward
per row. Right-padded batches need no boundaries (causal: padding sits after every real token).

Nothing is changed at import time or in transformers' classes (installed modules are kept in a weak set); a cached
(generation) call or an attention mask falls back to transformers' forward. Without fla, or on CPU, the modules
keep transformers' forward (exact for hsx's right-padded batches) and packing is refused.
"""

from __future__ import annotations

import contextvars
import functools
import types
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

FLA_CHUNK = 64  # fla's chunk size for the delta rule and its convolution: the chunk indices below use it
_INSTALLED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # modules whose forward `install` replaced


@dataclass(frozen=True)
class PackedRows:
    """The row boundaries of one packed forward: fla's `cu_seqlens` (device, int32), the same on the host, and the
    chunk indices fla would otherwise compute with a blocking host copy in the first layer of every batch."""
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    chunk_indices: torch.Tensor


_ROWS: contextvars.ContextVar[PackedRows | None] = contextvars.ContextVar("hsx_packed_rows", default=None)


@contextmanager
def packed_rows(rows: PackedRows | None):
    """The Gated DeltaNet layers called inside see `rows` (this thread only)."""
    token = _ROWS.set(rows)
    try:
        yield
    finally:
        _ROWS.reset(token)


def chunk_indices(bounds: np.ndarray, out: np.ndarray) -> np.ndarray:
    """(chunks, 2) [sequence, chunk within it] for cu_seqlens `bounds`, written into `out` (what fla's
    prepare_chunk_indices returns, computed on the host)."""
    counts = -(-np.diff(bounds) // FLA_CHUNK)
    total = int(counts.sum())
    view = out[: 2 * total].reshape(total, 2)
    view[:, 0] = np.repeat(np.arange(len(counts)), counts)
    view[:, 1] = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    return view


def is_linear_attention(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith("GatedDeltaNet") or (getattr(module, "layer_type", None) == "linear_attention"
                                              and not name.endswith("DecoderLayer"))


def linear_attention_modules(base: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in base.modules() if is_linear_attention(m)]


def fla_blocker(modules: list[torch.nn.Module]) -> str | None:
    """Why `install` would leave these modules on transformers' forward (None: it will switch them all)."""
    if not modules:
        return "no Gated DeltaNet layers"
    if not fla_importable():
        return 'flash-linear-attention is not installed (pip install "hsx[gpu]")'
    for m in modules:
        if not _supported_layout(m):
            return f"{type(m).__name__} has a projection layout hsx does not know"
        if getattr(m, "_hf_hook", None) is not None:
            return "a copy spread over several GPUs (accelerate device hooks on the layers)"
        weight = getattr(m.conv1d, "weight", None)
        if weight is None or weight.device.type != "cuda":
            return "fla's kernels need CUDA"
    return None


def install(base: torch.nn.Module) -> bool:
    """Switch every Gated DeltaNet module of `base` to `fla_forward` (once). False when `fla_blocker` says no."""
    modules = linear_attention_modules(base)
    if fla_blocker(modules) is not None:
        return False
    for m in modules:
        if m not in _INSTALLED:  # the instance's forward, as accelerate's hooks and torch.compile replace it
            m.forward = types.MethodType(fla_forward, m)
            _INSTALLED.add(m)
    return True


def installed(base: torch.nn.Module) -> bool:
    modules = linear_attention_modules(base)
    return bool(modules) and all(m in _INSTALLED for m in modules)


def fla_importable() -> bool:
    try:
        from fla.modules.causal_conv1d import causal_conv1d  # noqa: F401
        from fla.modules.norm.fused_norm_gate import rms_norm_gated  # noqa: F401
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken optional kernel package (e.g. no Triton) is the same as none
        return False
    return True


def _supported_layout(m: torch.nn.Module) -> bool:
    common = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "head_k_dim", "head_v_dim", "key_dim", "value_dim")
    qwen3_5 = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    qwen3_next = ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering")
    return all(hasattr(m, a) for a in common) and (all(hasattr(m, a) for a in qwen3_5)
                                                    or all(hasattr(m, a) for a in qwen3_next))


def _projections(self, x: torch.Tensor):
    """(conv input q|k|v (B, T, 2·key_dim + value_dim), z (B, T, HV, dv), b (B, T, HV), a (B, T, HV))."""
    batch, seq, _ = x.shape
    if hasattr(self, "in_proj_qkv"):  # Qwen3.5/3.6
        z = self.in_proj_z(x).reshape(batch, seq, -1, self.head_v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
    q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(x), self.in_proj_ba(x))  # Qwen3-Next
    return torch.cat([t.reshape(batch, seq, -1) for t in (q, k, v)], dim=-1), z, b, a


def fla_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """transformers' GatedDeltaNet forward without a cache, on fla's kernels, packed rows kept apart."""
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    rows = _ROWS.get()
    cache = kwargs.get("cache", kwargs.get("cache_params", args[0] if args else None))
    if cache is not None or kwargs.get("attention_mask") is not None:
        if rows is not None:
            raise ValueError("hsx: a packed batch reached a Gated DeltaNet layer with a cache or an attention mask")
        return type(self).forward(self, hidden_states, *args, **kwargs)  # transformers' own forward
    if rows is None and kwargs.get("cu_seq_lens_q") is not None:
        raise ValueError("hsx: a packed batch reached a Gated DeltaNet layer without its row bounds (packed_rows)")
    batch, seq, _ = hidden_states.shape
    varlen = {} if rows is None else {"cu_seqlens": rows.cu_seqlens, "cu_seqlens_cpu": rows.cu_seqlens_cpu,
                                      "chunk_indices": rows.chunk_indices}
    mixed, z, b, a = _projections(self, hidden_states)
    mixed, _ = causal_conv1d(mixed, weight=self.conv1d.weight.squeeze(1), bias=self.conv1d.bias,
                             activation=self.activation, **varlen)
    q, k = qk_l2norm(mixed, self.key_dim, self.head_k_dim)
    v = mixed[..., 2 * self.key_dim:].reshape(batch, seq, -1, self.head_v_dim)
    # g = -exp(A_log)·softplus(a + dt_bias) and beta = sigmoid(b), as transformers computes them, inside the kernel.
    out, _ = chunk_gated_delta_rule(q, k, v, g=a, beta=b, use_gate_in_kernel=True,
                                    A_log=self.A_log, dt_bias=self.dt_bias, use_beta_sigmoid_in_kernel=True,
                                    **varlen)
    eps = getattr(self.norm, "variance_epsilon", getattr(self.norm, "eps", 1e-6))
    out = _gated_rms_norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim), self.norm.weight, eps)
    return self.out_proj(out.reshape(batch, seq, -1))


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' reference l2norm of the last dimension (float32 math)."""
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def qk_l2norm(mixed: torch.Tensor, key_dim: int, head_dim: int, eps: float = 1e-6):
    """(q, k), each (B, T, key_dim // head_dim, head_dim) and contiguous, l2-normalised per head, from the conv
    output's first 2·key_dim columns: one Triton kernel reading the strided heads once (float32 math, as `_l2norm`).
    In torch the same took 7 kernels per tensor (casts, square, sum, rsqrt, products): ~3% of the 27B shape's GPU
    time. fla's own l2norm is not used: it autotunes anew for each ceil(rows / 65536), ~10 s stalls per batch size.
    Off CUDA, or for a head size that is not a power of two, the torch reference."""
    batch, seq, _ = mixed.shape
    heads = key_dim // head_dim
    if mixed.device.type != "cuda" or head_dim & (head_dim - 1) or mixed.stride(-1) != 1:
        q, k = mixed[..., :key_dim], mixed[..., key_dim:2 * key_dim]
        return (_l2norm(q.reshape(batch, seq, heads, head_dim), eps),
                _l2norm(k.reshape(batch, seq, heads, head_dim), eps))
    out = torch.empty(2, batch, seq, heads, head_dim, device=mixed.device, dtype=mixed.dtype)
    rows = batch * seq * 2 * heads
    if rows:
        flat = mixed.reshape(batch * seq, mixed.shape[-1])  # a view for the conv's (contiguous) output
        _qk_l2norm_kernel()[(-(-rows // _QK_ROWS),)](
            flat, out, rows, 2 * heads, flat.stride(0), batch * seq * key_dim, eps, D=head_dim, BR=_QK_ROWS,
            num_warps=4)
    return out[0], out[1]


_QK_ROWS = 16  # (token, head) rows per program: 16 × 128 values, one tile; no autotuning, so nothing to wait for


@functools.cache
def _qk_l2norm_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["rows", "plane"])
    def qk_l2norm_kernel(x, y, rows, heads, stride_t, plane, eps, D: tl.constexpr, BR: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
        live = r < rows
        t = r // heads
        h = r % heads
        half = heads // 2
        src = x + t * stride_t + h * D
        dst = y + (h >= half).to(tl.int64) * plane + t * (half * D) + (h % half) * D
        d = tl.arange(0, D)
        v = tl.load(src[:, None] + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        scale = tl.math.rsqrt(tl.sum(v * v, 1) + eps)
        tl.store(dst[:, None] + d[None, :], (v * scale[:, None]).to(y.dtype.element_ty), mask=live[:, None])

    return qk_l2norm_kernel


NORM_ROWS = 65536  # fla's fused norm kernels compile one variant per ceil(rows / 65536): feed them one block size


def _gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight · rmsnorm(x) · silu(gate) per head (rows of head_v_dim), fla's fused kernel on blocks of NORM_ROWS."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return torch.cat([rms_norm_gated(x[a:a + NORM_ROWS], gate[a:a + NORM_ROWS], weight, None, activation="swish",
                                     eps=eps) for a in range(0, x.shape[0], NORM_ROWS)])
