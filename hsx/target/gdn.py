"""Gated DeltaNet layers (Qwen3.5/3.6, Qwen3-Next linear attention) on flash-linear-attention's kernels.

transformers' own GatedDeltaNet forward runs its short convolution as `F.conv1d` without causal-conv1d (a torch
fallback, about half hsx's rate at the 27B shape), its gated RMSNorm and gating as separate elementwise
ops, and it ignores sequence boundaries: in a packed batch every row's recurrent state and convolution window leak
into the next (NeMo Automodel #2147: layer outputs off by 0.40). `install` replaces, per module instance, the
forward of each such layer with `fla_forward`: one Triton kernel for the short convolution, the q/k l2norm and the
q, k, v layout the delta rule reads (`conv_qkv`), fla's chunk_gated_delta_rule with the gate and beta sigmoid fused
in, and one Triton kernel for the gated RMSNorm (`gated_rms_norm`). For a packed batch (`packed_rows`, set by
hsx.engine around each forward) the row boundaries go to both the convolution and the delta rule, so each row starts
from a zero state and a zero convolution window: the packed forward equals one forward per row. Right-padded batches
need no boundaries (causal: padding sits after every real token).

fla's first forward autotunes its kernels (tens of seconds on a fresh GPU at the 27B shape); `settle_autotuning`
hands them the configs that run chose, so the first forward compiles one per kernel. The measurements behind this
module: docs/benchmarks.md (2026-11-30 to 2026-12-01, session 12, "Figures moved from the code").

Nothing is changed at import time or in transformers' classes (installed modules are kept in a weak set); a cached
(generation) call or an attention mask falls back to transformers' forward. Without fla, or on CPU, the modules
keep transformers' forward (exact for hsx's right-padded batches) and packing is refused.
"""

from __future__ import annotations

import contextvars
import functools
import os
import types
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hsx.target import kernels

# fla's chunk size for the delta rule and its convolution: the chunk indices below use it, and hsx.cost prices the
# per-chunk states with it
FLA_CHUNK = 64
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
    """Switch every Gated DeltaNet module of `base` to `fla_forward` (once), fla's autotuning settled ahead where
    hsx has measured it (`settle_autotuning`). False when `fla_blocker` says no."""
    modules = linear_attention_modules(base)
    if fla_blocker(modules) is not None:
        return False
    for m in modules:
        if m not in _INSTALLED:  # the instance's forward, as accelerate's hooks and torch.compile replace it
            m.forward = types.MethodType(fla_forward, m)
            _INSTALLED.add(m)
    settle_autotuning(modules[0].conv1d.weight.device)
    return True


# ---- fla's autotuning, settled ahead --------------------------------------------------------------------------
# fla autotunes its kernels on the first packed forward of a Gated DeltaNet layer: on a fresh GPU that compiles and
# times dozens of configs in the warm-up (docs/design.md, packed Gated DeltaNet). These are the winners of one such
# run (fla 0.6.0, Triton 3.6, an H200, Qwen3.5/3.6 head sizes: keys 128, values 128, conv width 4, packed rows)
# for the five kernels hsx still runs (its own took the convolution and the gated norm). On the GPUs they were tuned
# for (compute capability 9.0) `settle_autotuning` narrows each kernel's candidate list to its winner when the key
# matches, heads and channels aside: still a config fla would time itself (`early_config_prune`, Triton's own hook),
# so nothing but the choice of tile changes; any other key, kernel or GPU autotunes as before.

@dataclass(frozen=True)
class TunedConfig:
    kernel: str  # "module:attribute" of fla's kernel
    key: tuple[tuple[str, Any], ...]  # its autotune key when tuned
    counts: tuple[str, ...]  # key entries that may differ (heads, channels, blocks): the rest must be equal
    kwargs: tuple[tuple[str, int], ...]
    num_warps: int
    num_stages: int


_HEADS = ("H", "HV")
TUNED_CONFIGS: tuple[TunedConfig, ...] = (
    TunedConfig("fla.ops.gated_delta_rule.gate:gdn_gate_chunk_cumsum_scalar_kernel",
                (("H", 48), ("BT", 64), ("IS_VARLEN", True), ("REVERSE", False)), ("H",), (), 4, 3),
    TunedConfig("fla.ops.gated_delta_rule.chunk_fwd:chunk_gated_delta_rule_fwd_kkt_solve_kernel",
                (("H", 16), ("HV", 48), ("K", 128), ("BC", 16)), _HEADS, (("BK", 64),), 1, 3),
    TunedConfig("fla.ops.gated_delta_rule.wy_fast:recompute_w_u_fwd_kernel",
                (("H", 16), ("HV", 48), ("K", 128), ("V", 128), ("BT", 64), ("BK", 64), ("BV", 64),
                 ("IS_VARLEN", True)), _HEADS, (), 4, 3),
    TunedConfig("fla.ops.common.chunk_delta_h:chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
                (("H", 16), ("HV", 48), ("K", 128), ("V", 128), ("BT", 64), ("STATE_V_FIRST", False)), _HEADS,
                (("BV", 64),), 4, 4),
    TunedConfig("fla.ops.common.chunk_o:chunk_fwd_kernel_o",
                (("H", 16), ("HV", 48), ("K", 128), ("V", 128), ("BT", 64), ("STATE_V_FIRST", False)), _HEADS,
                (("BK", 64), ("BV", 64)), 4, 3),
)
_SETTLED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # fla's autotuners narrowed by `settle_autotuning`


def tuned_choice(tuned: list[TunedConfig], keys: list[str], configs: list, args: dict[str, Any]):
    """The config among `configs` that `tuned` names for the key values in `args` (None: autotune as usual)."""
    for t in tuned:
        if [name for name, _ in t.key] != list(keys):  # fla changed the kernel's key: not the kernel tuned
            continue
        if any(args.get(name) != value for name, value in t.key if name not in t.counts):
            continue
        for c in configs:
            if c.kwargs == dict(t.kwargs) and c.num_warps == t.num_warps and c.num_stages == t.num_stages:
                return c
    return None


def _left_to_fla(device: torch.device | None) -> str | None:
    """Why fla's kernels keep fla's own tile choice here (None: `TUNED_CONFIGS` apply)."""
    if os.environ.get("FLA_CACHE_MODE") or os.environ.get("FLA_CONFIG_DIR"):
        return "fla's config cache (FLA_CACHE_MODE/FLA_CONFIG_DIR set)"
    if not torch.cuda.is_available() or not kernels.runs_on("fla_tuned_configs",
                                                           tuple(torch.cuda.get_device_capability(device))):
        return "fla's autotuning"
    return None


def autotuning_note(device: torch.device | None = None) -> str:
    """How fla's kernels choose their tiles on this GPU (for hsx.json's kernels)."""
    return _left_to_fla(device) or "hsx's tuned configs (H200), fla's autotuning for other keys"


def settle_autotuning(device: torch.device | None = None) -> int:
    """Narrow fla's autotuned kernels to `TUNED_CONFIGS` (see above); the number of kernels narrowed. Left to fla
    when the user configured its own config cache (FLA_CACHE_MODE/FLA_CONFIG_DIR) or on another kind of GPU."""
    if _left_to_fla(device):
        return 0
    import importlib

    from triton.runtime.autotuner import Autotuner

    by_kernel: dict[str, list[TunedConfig]] = {}
    for t in TUNED_CONFIGS:
        by_kernel.setdefault(t.kernel, []).append(t)
    settled = 0
    for name, tuned in by_kernel.items():
        module, attribute = name.split(":")
        try:
            fn = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError):  # another fla version: that kernel autotunes as fla ships it
            continue
        while not isinstance(fn, Autotuner) and hasattr(fn, "fn"):
            fn = fn.fn
        if not isinstance(fn, Autotuner):
            continue
        if fn not in _SETTLED:
            fn.early_config_prune = _narrowed(fn, tuned, fn.early_config_prune)
            _SETTLED.add(fn)
        settled += 1
    return settled


def _narrowed(autotuner, tuned: list[TunedConfig], prune):
    def early_config_prune(configs, named_args, **kwargs):
        configs = prune(configs, named_args, **kwargs) if prune else configs
        choice = tuned_choice(tuned, list(autotuner.keys), configs, {**named_args, **kwargs})
        return configs if choice is None else [choice]
    return early_config_prune


def installed(base: torch.nn.Module) -> bool:
    modules = linear_attention_modules(base)
    return bool(modules) and all(m in _INSTALLED for m in modules)


def fla_importable() -> bool:
    try:
        from fla.modules.causal_conv1d import causal_conv1d  # noqa: F401
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
    varlen = _fla_varlen(rows)
    mixed, z, b, a = _projections(self, hidden_states)
    q, k, v = conv_qkv(self, mixed, rows)
    # g = -exp(A_log)·softplus(a + dt_bias) and beta = sigmoid(b), as transformers computes them, inside the kernel.
    out, _ = chunk_gated_delta_rule(q, k, v, g=a, beta=b, use_gate_in_kernel=True,
                                    A_log=self.A_log, dt_bias=self.dt_bias, use_beta_sigmoid_in_kernel=True,
                                    **varlen)
    eps = getattr(self.norm, "variance_epsilon", getattr(self.norm, "eps", 1e-6))
    out = gated_rms_norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim), self.norm.weight, eps)
    return self.out_proj(out.reshape(batch, seq, -1))


def _fla_varlen(rows: PackedRows | None) -> dict[str, torch.Tensor]:
    """fla's keyword arguments for a packed batch's row bounds (none for a right-padded batch)."""
    return {} if rows is None else {"cu_seqlens": rows.cu_seqlens, "cu_seqlens_cpu": rows.cu_seqlens_cpu,
                                    "chunk_indices": rows.chunk_indices}


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' reference l2norm of the last dimension (float32 math)."""
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def qk_l2norm(mixed: torch.Tensor, key_dim: int, head_dim: int, eps: float = 1e-6):
    """(q, k), each (B, T, key_dim // head_dim, head_dim) and contiguous, l2-normalised per head, from the conv
    output's first 2·key_dim columns: one Triton kernel reading the strided heads once (float32 math, as `_l2norm`).
    In torch the same took 7 kernels per tensor (casts, square, sum, rsqrt, products). fla's own l2norm is not
    used: it autotunes anew for each ceil(rows / 65536), a stall at each new batch size.
    Off CUDA, or for a head size that is not a power of two, the torch reference."""
    batch, seq, _ = mixed.shape
    heads = key_dim // head_dim
    if (mixed.device.type != "cuda" or head_dim & (head_dim - 1) or mixed.stride(-1) != 1
            or not kernels.allowed("gdn_kernels", mixed.device)):
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


def conv_qkv(self, mixed: torch.Tensor, rows: PackedRows | None):
    """(q, k, v), each (B, T, heads, head dim) and contiguous, from the projections' q|k|v columns `mixed` (B, T,
    2·key_dim + value_dim): the causal depthwise convolution (SiLU), q and k l2-normalised per head, each packed row
    starting from a zero window. On CUDA one Triton kernel (`_conv_qkv_kernel`) reads `mixed` once and writes the
    three tensors the delta rule reads: fla's causal_conv1d, `qk_l2norm` and the copy fla's chunk_gated_delta_rule
    makes of the strided v were three passes over the same data; fused, the one pass takes about half their time
    (docs/benchmarks.md, session 12). Its arithmetic is fla's convolution's (float32 taps in order, the bias, SiLU,
    one rounding), then `qk_l2norm`'s. Elsewhere, or for shapes it does not take, those three steps."""
    batch, seq, _ = mixed.shape
    weight = self.conv1d.weight.squeeze(1)
    if _conv_qkv_takes(self, mixed, weight):
        return _conv_qkv_cuda(mixed, weight, self.conv1d.bias, self.activation, self.key_dim, self.head_k_dim,
                              self.head_v_dim, rows)
    from fla.modules.causal_conv1d import causal_conv1d

    mixed, _ = causal_conv1d(mixed, weight=weight, bias=self.conv1d.bias, activation=self.activation,
                             **_fla_varlen(rows))
    q, k = qk_l2norm(mixed, self.key_dim, self.head_k_dim)
    return q, k, mixed[..., 2 * self.key_dim:].reshape(batch, seq, -1, self.head_v_dim)


def _power_of_2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def _conv_qkv_takes(self, mixed: torch.Tensor, weight: torch.Tensor) -> bool:
    """A contiguous bf16/fp16 CUDA input of a layer `conv_kernel` names "hsx" for."""
    return (mixed.is_cuda and mixed.dtype in (torch.bfloat16, torch.float16) and mixed.is_contiguous()
            and weight.dim() == 2 and weight.shape[0] == mixed.shape[-1] and conv_kernel(self) == "hsx")


def conv_kernel(self) -> str:
    """Which kernel runs this layer's short convolution on CUDA: "hsx" (`conv_qkv`'s) for one head size over the q,
    k and v column blocks (a power of two, at most 256) and SiLU or no activation (Qwen3.5/3.6, Qwen3-Next: heads
    of 128), else "fla" (its causal_conv1d, then `qk_l2norm`)."""
    d, key_dim, head_v = int(self.head_k_dim), int(self.key_dim), int(self.head_v_dim)
    value_dim = int(self.conv1d.weight.shape[0]) - 2 * key_dim
    takes = (_power_of_2(d) and d <= 256 and key_dim % d == 0 and value_dim > 0 and value_dim % d == 0
             and head_v > 0 and value_dim % head_v == 0
             and getattr(self, "activation", "") in (None, "silu", "swish"))
    cap = kernels.capability_of(self.conv1d.weight.device)  # (None off CUDA: the layout alone answers)
    return "hsx" if takes and (cap is None or kernels.runs_on("gdn_kernels", cap)) else "fla"


CONV_TOKENS = FLA_CHUNK  # tokens per program: a packed row's chunks (PackedRows.chunk_indices) are the tiles


def _conv_qkv_cuda(mixed, weight, bias, activation, key_dim: int, head_k_dim: int, head_v_dim: int,
                   rows: PackedRows | None):
    batch, seq, channels = mixed.shape
    value_dim = channels - 2 * key_dim
    tokens = batch * seq
    out = torch.empty(tokens * channels, device=mixed.device, dtype=mixed.dtype)
    q = out[:tokens * key_dim].view(batch, seq, key_dim // head_k_dim, head_k_dim)
    k = out[tokens * key_dim:2 * tokens * key_dim].view(batch, seq, key_dim // head_k_dim, head_k_dim)
    v = out[2 * tokens * key_dim:].view(batch, seq, value_dim // head_v_dim, head_v_dim)
    if tokens:
        weight = weight.contiguous()
        varlen = rows is not None
        grid = ((rows.chunk_indices.shape[0] if varlen else -(-seq // CONV_TOKENS)), channels // head_k_dim,
                1 if varlen else batch)
        _conv_qkv_kernel()[grid](
            mixed, weight, weight if bias is None else bias, q, k, v,
            rows.cu_seqlens if varlen else mixed, rows.chunk_indices if varlen else mixed,
            seq, channels, key_dim, value_dim, 1e-6, D=head_k_dim, W=weight.shape[1], BT=CONV_TOKENS,
            HAS_BIAS=bias is not None, SILU=activation is not None, VARLEN=varlen, num_warps=4)
    return q, k, v


@functools.cache
def _conv_qkv_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["seq"])
    def conv_qkv_kernel(x, w, bias, q, k, v, cu_seqlens, chunk_indices, seq, channels, key_dim, value_dim, eps,
                        D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, HAS_BIAS: tl.constexpr,
                        SILU: tl.constexpr, VARLEN: tl.constexpr):
        i_t, i_c = tl.program_id(0), tl.program_id(1)
        if VARLEN:  # (row, chunk within it) pairs: a tile never crosses a row's start
            row = tl.load(chunk_indices + 2 * i_t).to(tl.int64)
            i_t = tl.load(chunk_indices + 2 * i_t + 1)
            start = tl.load(cu_seqlens + row).to(tl.int64)
            length = tl.load(cu_seqlens + row + 1).to(tl.int64) - start
        else:
            start = tl.program_id(2).to(tl.int64) * seq
            length = seq
        t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
        d = tl.arange(0, D)
        col = i_c * D + d
        acc = tl.zeros((BT, D), dtype=tl.float32)
        for j in tl.static_range(W):  # tap j reads token t - (W - 1 - j); before the row's start: zero
            src = t - (W - 1 - j)
            x_j = tl.load(x + (start + src)[:, None] * channels + col[None, :],
                          mask=((src >= 0) & (src < length))[:, None], other=0.0).to(tl.float32)
            acc += x_j * tl.load(w + col * W + j).to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias + col).to(tl.float32)[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        y = acc.to(q.dtype.element_ty)
        live = (t < length)[:, None]
        c0 = i_c * D
        token = start + t
        if c0 < 2 * key_dim:  # a q or k head: l2-normalised from the rounded convolution, as qk_l2norm
            yf = y.to(tl.float32)
            y = (yf * tl.math.rsqrt(tl.sum(yf * yf, 1) + eps)[:, None]).to(q.dtype.element_ty)
            if c0 < key_dim:
                tl.store(q + token[:, None] * key_dim + (c0 + d)[None, :], y, mask=live)
            else:
                tl.store(k + token[:, None] * key_dim + (c0 - key_dim + d)[None, :], y, mask=live)
        else:
            tl.store(v + token[:, None] * value_dim + (c0 - 2 * key_dim + d)[None, :], y, mask=live)

    return conv_qkv_kernel


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' gated RMSNorm of Qwen3.5/3.6 and Qwen3-Next per head (rows of head_v_dim): x normalised in float32
    and rounded, times the weight (rounded as torch's product of the two is), times SiLU(gate) in float32, rounded
    once more. On CUDA one Triton kernel over all rows: fla's fused kernel, fed blocks of 65,536 rows (it compiles
    one variant per ceil(rows / 65,536)) and concatenated, took about twice this kernel's time (docs/benchmarks.md,
    session 12). Elsewhere, or for a head size that is not a power of two, the same in torch."""
    rows, dim = x.shape
    if not (x.is_cuda and _power_of_2(dim) and dim <= 1024 and x.is_contiguous() and gate.is_contiguous()
            and gate.shape == x.shape and weight.shape == (dim,) and kernels.allowed("gdn_kernels", x.device)):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        h = weight * h.to(x.dtype)
        return (h * torch.nn.functional.silu(gate.float())).to(x.dtype)
    out = torch.empty_like(x)
    if rows:
        rounds = torch.promote_types(weight.dtype, x.dtype) != torch.float32
        _gated_norm_kernel()[(-(-rows // _NORM_ROWS),)](x, gate, weight, out, rows, eps, D=dim, BR=_NORM_ROWS,
                                                        ROUND_WEIGHTED=rounds, num_warps=4)
    return out


_NORM_ROWS = 16  # rows per program (16 × 128 values for Qwen's heads), no autotuning


@functools.cache
def _gated_norm_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["rows"])
    def gated_norm_kernel(x, gate, w, y, rows, eps, D: tl.constexpr, BR: tl.constexpr,
                          ROUND_WEIGHTED: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
        live = (r < rows)[:, None]
        d = tl.arange(0, D)
        at = r[:, None] * D + d[None, :]
        h = tl.load(x + at, mask=live, other=0.0).to(tl.float32)
        h = (h * tl.math.rsqrt(tl.sum(h * h, 1) / D + eps)[:, None]).to(y.dtype.element_ty).to(tl.float32)
        h = h * tl.load(w + d).to(tl.float32)[None, :]
        if ROUND_WEIGHTED:
            h = h.to(y.dtype.element_ty).to(tl.float32)
        g = tl.load(gate + at, mask=live, other=0.0).to(tl.float32)
        tl.store(y + at, (h * (g * tl.sigmoid(g))).to(y.dtype.element_ty), mask=live)

    return gated_norm_kernel
