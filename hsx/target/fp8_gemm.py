"""The FP8 checkpoints' linear layers on FP8 tensor cores: `Fp8Linear` and the block-scaled GEMMs under it.

`Fp8Linear` runs a linear layer of the `-FP8` layout (hsx.target.fp8) over transformers' e4m3 weights and 128×128 block
scales, shared (hsx.target.fp8_model's `install` puts it in the model): a Triton pass quantizes the activations
(`hsx::fp8_quantize`), then a block-scaled GEMM multiplies (`hsx::fp8_mm`), the first of GEMMS that passes its check
against the float32 product (`use_gemm`, config key fp8_gemm), fastest first as measured (GEMMs alone and end to
end: docs/benchmarks.md, sessions 13 and 14 and 2026-12-02 (later)): DeepGEMM's `fp8_gemm_nt` where it is
installed, for products of JIT_MIN_ROWS rows or more; torch's cuBLAS `_scaled_mm`; fbgemm-gpu-genai's CUTLASS
`f8f8bf16_groupwise` where that package is installed; a Triton kernel (slower than bf16: a fallback). flashinfer's
`fp8_blockscale_gemm_sm90` (TensorRT-LLM's copy of DeepGEMM's SM90 kernels, in a PyPI package) runs where asked for
(fp8_gemm flashinfer), not yet under auto: no measurement places it. Each weight shape is checked again at its first
use (`_takes`); off CUDA the ops run hsx.target.fp8's torch reference.
"""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager

import torch

from hsx.config import FP8_GEMM_CHOICES
from hsx.errors import HsxError, one_line
from hsx.target import kernels
from hsx.target.fp8 import (BLOCK, CHECK_TOLERANCE, FP8_DTYPE, FP8_MAX, SCALE_EPS, dequantize_weight,
                            quantize_activation, quantize_activation_padded, quantize_weight, reference_mm,
                            relative_error)


# ---- the GEMM ------------------------------------------------------------------------------------------------------

@torch.library.custom_op("hsx::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """bf16 (M, N) = quantize(x) @ (w · ws)ᵀ for bf16 x (M, K): x quantized per 1×128 block (`quantize_activation`),
    w e4m3 (N, K) with float32 block scales ws (N/128, K/128). The eager path: one Triton pass quantizes."""
    if not x.is_cuda:
        xq, xs = quantize_activation(x)
        return reference_mm(xq, xs, w, ws)
    m = x.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if m == 0:
        return x.new_empty((0, w.shape[0]), dtype=torch.bfloat16)
    xq, xs = _quantize_activation_cuda(x)  # rows padded to a multiple of 16, scales M-major
    return _block_mm(xq, xs, w, ws)[:m]


@torch.library.custom_op("hsx::fp8_mm", mutates_args=())
def fp8_mm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """bf16 (M, N) = (xq · xs) @ (w · ws)ᵀ for activations already quantized (`fp8_quantize`,
    `fp8_silu_mul_quantize`): compiled layers and fused MLPs, where one quantization feeds several GEMMs."""
    if not xq.is_cuda:
        return reference_mm(xq, xs, w, ws)
    if xq.shape[0] == 0:
        return xq.new_empty((0, w.shape[0]), dtype=torch.bfloat16)
    return _block_mm(xq, xs, w, ws)


@fp8_mm.register_fake
def _(xq, xs, w, ws):
    return xq.new_empty((xq.shape[0], w.shape[0]), dtype=torch.bfloat16)


@torch.library.custom_op("hsx::fp8_quantize", mutates_args=())
def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activation_padded` as one op (on CUDA one Triton pass): in a compiled layer, q/k/v (and gate/up)
    quantize the same input through equal calls, which `compile_options`' pass merges into one."""
    if not x.is_cuda or x.shape[0] == 0:
        return quantize_activation_padded(x, ROW_ALIGN)
    return _quantize_activation_cuda(x if x.stride(-1) == 1 else x.contiguous())


@fp8_quantize.register_fake
def _quantized_like(x):
    m, k = x.shape
    m_pad = (m + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
    return (x.new_empty((m_pad, k), dtype=FP8_DTYPE),
            x.new_empty((k // BLOCK, m_pad), dtype=torch.float32).t())


@torch.library.custom_op("hsx::fp8_silu_mul_quantize", mutates_args=())
def fp8_silu_mul_quantize(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_quantize(silu(gate) * up)` in one pass for bf16 gate and up (M, K): a gated MLP's down_proj input is
    never written in bf16."""
    if not gate.is_cuda or gate.shape[0] == 0:
        return quantize_activation_padded(torch.nn.functional.silu(gate) * up, ROW_ALIGN)
    return _quantize_activation_cuda(gate if gate.stride(-1) == 1 else gate.contiguous(),
                                     up if up.stride(-1) == 1 else up.contiguous())


@fp8_silu_mul_quantize.register_fake
def _(gate, up):
    return _quantized_like(gate)


def _block_mm(xq, xs, w, ws):
    return _gemm(_runs(w, ws, xq.shape[0]))(xq, xs, w, ws)


def _runs(w: torch.Tensor, ws: torch.Tensor, rows: int | None = None) -> str:
    """The GEMM that multiplies `rows` activation rows (None: a full batch's) by (w, ws): the device's (`use_gemm`)
    where its check for this weight's shape passed, else the next of GEMMS whose does (Triton, last, runs any);
    DeepGEMM and flashinfer (JIT_GEMMS) only from JIT_MIN_ROWS rows."""
    first = backend_of(w.device)
    for name in _gemms_from(first)[:-1]:
        if name != first and not _runs_here(name, w.device):  # (the next GEMMs: those hsx.target.kernels allows here)
            continue
        if name in JIT_GEMMS and rows is not None and rows < JIT_MIN_ROWS:
            continue
        if _takes(name, w, ws):
            return name
    return GEMMS[-1]


_SHAPES: dict[tuple, bool] = {}  # (GEMM, device, N, K) → its product with such a weight agreed with the reference


def _takes(name: str, w: torch.Tensor, ws: torch.Tensor) -> bool:
    """Whether GEMM `name` multiplies by this weight's shape: on the first call for (device, N, K), products with
    these very weights (16 and 200 rows: fbgemm runs another kernel at M <= 16) agree with the reference; else one
    warning and the next GEMM runs such weights from then on. cuBLAS and fbgemm tile N by whole scale blocks; cuBLAS
    takes K in multiples of 512 only (`_cublas_mm`): other weights go to the next GEMM without a word (hsx.json's
    `gemm_by_shape` lists them)."""
    key = (name, w.device.index, *w.shape)
    if key in _SHAPES:  # (every call of a linear asks: decided once per shape)
        return _SHAPES[key]
    if (w.shape[0] % BLOCK or (name == "cublas" and (w.shape[1] // BLOCK) % CUBLAS_K_BLOCKS)
            or _missing(name, "auto") is not None):  # (an fbgemm_gpu that is not installed: nothing to say)
        _SHAPES[key] = False
    else:
        why = _disagrees(name, w, ws)
        _SHAPES[key] = why is None
        if why is not None:
            after = ", else ".join(_GEMM_NAMES[g] + (f" (from {JIT_MIN_ROWS:,} rows)" if g in JIT_GEMMS else "")
                                   for g in _gemms_from(name)[1:] if _missing(g, "auto") is None)
            warnings.warn(f"hsx: {_GEMM_NAMES[name]} failed its check for {w.shape[0]}×{w.shape[1]} FP8 weights on "
                          f"{w.device} ({why}); {after} runs weights of this shape", stacklevel=2)
    return _SHAPES[key]


def _disagrees(name: str, w: torch.Tensor, ws: torch.Tensor) -> str | None:
    """Why GEMM `name`'s products of random activation rows with (w, ws) are not the float32 reference's
    (`relative_error` < CHECK_TOLERANCE), None when they are: 16 and 200 rows (fbgemm runs another kernel at
    M <= 16), JIT_MIN_ROWS for DeepGEMM and flashinfer (the kernels they compile for every larger M)."""
    g = torch.Generator(device=w.device).manual_seed(1)
    for m in (JIT_MIN_ROWS,) if name in JIT_GEMMS else (16, 200):
        x = torch.randn(m, w.shape[1], device=w.device, generator=g, dtype=torch.bfloat16)
        xq, xs = fp8_quantize(x)
        want = reference_mm(xq, xs, w, ws, torch.float32)
        try:
            got = _gemm(name)(xq, xs, w, ws).float()
        except Exception as e:  # noqa: BLE001  (an unsupported shape or build: CUBLAS_STATUS_NOT_SUPPORTED, ...)
            return f"{type(e).__name__}: {one_line(e, 160)}"
        if got.shape != want.shape:
            return f"its product has shape {tuple(got.shape)}, not {tuple(want.shape)}"
        err = relative_error(got, want)
        if not err < CHECK_TOLERANCE:
            return f"relative error {err:.3g} against the float32 product at {m} rows"
    return None


@fp8_linear.register_fake
def _(x, w, ws):
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.bfloat16)


CUBLAS_K_BLOCKS = 4  # cuBLAS's 128×128 scales need K/128 a multiple of this (real models' K are multiples of 512)


def _cublas_mm(xq, xs, w, ws):
    # cuBLAS reads the 1×128 scales M-major (outer-dimension-major, as `_quantize_activation_cuda` writes them; M is
    # padded to 16) and the 128×128 ones as (K/128, N/128). With K/128 not a multiple of 4 (K = 256, 640, 768) torch
    # 2.11 returned wrong products, and refused scales padded to 4 blocks ("Invalid scaling configuration"): such
    # weights are not cuBLAS's (`_takes`; docs/benchmarks.md, 2026-12-02 (later), "cuBLAS and small K").
    if ws.shape[1] % CUBLAS_K_BLOCKS:
        raise ValueError(f"cuBLAS's block-scaled GEMM needs K/128 a multiple of {CUBLAS_K_BLOCKS} (K = {w.shape[1]})")
    if xs.stride(0) != 1:
        xs = xs.t().contiguous().t()
    return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)


def _import_optional(package: str, module: str, guard=None):
    """(the imported `module`, None) of an optional GEMM `package`; (None, None) where the package is not installed;
    (None, why) where it is but does not import (a build for another torch or CUDA: undefined symbols, missing
    libraries or dependencies, no CUDA compiler for a JIT). `guard`: a context manager around the import."""
    import importlib
    import importlib.util
    from contextlib import nullcontext

    try:
        if importlib.util.find_spec(package) is None:
            return None, None
        with guard or nullcontext():
            return importlib.import_module(module), None
    except Exception as e:  # noqa: BLE001  (whatever the package's import raises: said in one line, not raised)
        return None, f"{package} does not import: {type(e).__name__}: {one_line(e, 160)}"


FBGEMM_OP = "f8f8bf16_groupwise"  # fbgemm-gpu-genai's CUTLASS SM90 GEMM: 1×128 activation, 128×128 weight scales
_FBGEMM: list = []  # [(the op or None, why not or None)], loaded once


def _fbgemm_op():
    """(torch.ops.fbgemm.f8f8bf16_groupwise, None) where fbgemm-gpu-genai imports and registers it; (None, None)
    where fbgemm_gpu is not installed; (None, why) where it is but the op is not usable."""
    if not _FBGEMM:
        _FBGEMM.append(_load_fbgemm())
    return _FBGEMM[0]


def _load_fbgemm():
    # (fbgemm_gpu's __init__ loads the gen_ai library, which registers torch.ops.fbgemm's GEMMs)
    module, why = _import_optional("fbgemm_gpu", "fbgemm_gpu.experimental.gen_ai", _root_logging_silenced())
    if module is None:
        return None, why
    try:
        return getattr(torch.ops.fbgemm, FBGEMM_OP), None
    except (AttributeError, RuntimeError):
        return None, f"this fbgemm_gpu has no torch.ops.fbgemm.{FBGEMM_OP} (it is fbgemm-gpu-genai's)"


@contextmanager
def _root_logging_silenced():
    """fbgemm_gpu logs through the root logger as it imports (1.6.0: its version table has no entry for itself), and
    `logging.warning` on an unconfigured root logger installs a stderr handler for the whole process: during the
    import, neither."""
    import logging

    root, guard = logging.getLogger(), logging.NullHandler()
    before = logging.root.manager.disable
    root.addHandler(guard)  # a handler present: logging.warning() does not configure the root logger
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(before)
        root.removeHandler(guard)


def _fbgemm_mm(xq, xs, w, ws):
    # The CUTLASS kernel reads raw pointers and checks no layout: x_scale as (K/128, M) and w_scale as (K/128, N/128),
    # both contiguous (CUTLASS's SM90 block scaling takes scales MN-major only), M = xq's rows; it computes the
    # transposed product (N × M), so its token tile is 128 wide (16 at M <= 16). The weight scales' transposed copy
    # is N·K/16384 floats (12 KiB for 4096 × 12288).
    op = _fbgemm_op()[0]
    xs_t = xs.t() if xs.t().is_contiguous() else xs.t().contiguous()
    return op(xq.contiguous(), w.contiguous(), xs_t, ws.t().contiguous())


DEEPGEMM_MODULE = "deep_gemm"  # DeepSeek's DeepGEMM: JIT-compiled SM90 FP8 GEMMs with 1×128 / 128×128 float32 scales
_DEEPGEMM: list = []  # [(the module or None, why not or None)], imported once


def _deepgemm_module():
    """(deep_gemm, None) where DeepGEMM imports with its FP8 GEMM; (None, None) where it is not installed; (None, why)
    where it is but cannot run."""
    if not _DEEPGEMM:
        _DEEPGEMM.append(_load_deepgemm())
    return _DEEPGEMM[0]


def _load_deepgemm():
    module, why = _import_optional(DEEPGEMM_MODULE, DEEPGEMM_MODULE)
    if module is None:
        return None, why
    if not callable(getattr(module, "fp8_gemm_nt", None)):
        return None, "this deep_gemm has no fp8_gemm_nt"
    return module, None


# DeepGEMM picks a tile shape per product from M, N and K (its heuristic's cost model), and compiles a kernel (nvcc,
# seconds each) for each tile shape it has not built yet. Below a few thousand rows nearly every M picks another
# one: a bench run of small warm-up batches stalled for minutes. From 8,192 rows, that heuristic (emulated in
# Python; it reproduced the measured compile points exactly) picks 1-3 tile shapes per weight shape up to 32,768
# rows for Qwen3-8B's and Qwen3.6-27B's linears: 6 and 9 kernels in all. Smaller products, the few short batches of
# a job, run on the next GEMM. The sweeps: docs/benchmarks.md, session 13. flashinfer's copy of those kernels
# (TensorRT-LLM's) compiles per tile shape too (NVRTC), by an older heuristic of the same kind: emulated, it picks
# 41-45 kernels under 8,192 rows and 5-6 from there to 32,768 for the same two models (docs/fp8.md).
JIT_MIN_ROWS = 8192
# The GEMMs that compile a kernel per tile shape at first use → (their name in a line, where they keep the kernels)
JIT_GEMMS = {"deepgemm": ("DeepGEMM", "DG_JIT_CACHE_DIR, default ~/.deep_gemm"),
             "flashinfer": ("flashinfer", "TRTLLM_DG_CACHE_DIR, default ~/.tensorrt_llm")}
# A JIT GEMM's tile choice reads M only as ceil(M / block_m) above 64 rows: DeepGEMM's block_m is 64, 128 or 256,
# flashinfer's (TensorRT-LLM's heuristic) 128: one product per multiple of the step builds every kernel in a range
JIT_ROW_STEP = {"deepgemm": 64, "flashinfer": 128}


def _deepgemm_mm(xq, xs, w, ws):
    # DeepGEMM's SM90 kernel (recipe (1, 128, 128)) reads the 1×128 scales MN-major and TMA-aligned (M' rows, a
    # multiple of 4: `_quantize_activation_cuda` writes them so, M padded to 16) and the 128×128 ones as the
    # checkpoint stores them, (N/128, K/128) K-major; it compiles a kernel per (N, K) and tile shape on first use
    # and keeps it on disk (DG_JIT_CACHE_DIR, default ~/.deep_gemm).
    dg = _deepgemm_module()[0]
    out = torch.empty((xq.shape[0], w.shape[0]), device=xq.device, dtype=torch.bfloat16)
    dg.fp8_gemm_nt((xq.contiguous(), xs), (w.contiguous(), ws.contiguous()), out)
    return out


FLASHINFER_GEMM = "fp8_blockscale_gemm_sm90"  # flashinfer.gemm's SM90 block-scale GEMM (TensorRT-LLM's kernels)
_FLASHINFER: list = []  # [(flashinfer.gemm or None, why not or None)], imported once
_FLASHINFER_RUNNERS: dict[int | None, tuple] = {}  # device index → (the GEMM runner, its workspace)


def _flashinfer_module():
    """(flashinfer.gemm, None) where flashinfer imports with its SM90 block-scale GEMM; (None, None) where it is not
    installed; (None, why) where it is but cannot run. Importing builds nothing: the GEMM's module is compiled at
    its first product (`_flashinfer_runner`)."""
    if not _FLASHINFER:
        _FLASHINFER.append(_load_flashinfer())
    return _FLASHINFER[0]


def _load_flashinfer():
    module, why = _import_optional("flashinfer", "flashinfer.gemm")
    if module is None:
        return None, why
    base = getattr(module, "gemm_base", None)
    make = getattr(getattr(base, "get_fp8_blockscale_gemm_runner_sm90", None), "__wrapped__", None)
    if not callable(getattr(module, FLASHINFER_GEMM, None)) or not callable(make):
        return None, f"this flashinfer has no gemm.{FLASHINFER_GEMM} runner (flashinfer-python 0.6 or later has)"
    return module, None


def _flashinfer_runner(device: torch.device):
    """This process's own runner of flashinfer's SM90 block-scale GEMM on `device`. flashinfer's public
    `fp8_blockscale_gemm_sm90` allocates, at every call, a workspace sized for its bf16 paths (which quantize
    inside: M·K + N·K bytes and more, ~0.7 GB at a 27B down_proj of 32,768 rows by its formula) and configures it on
    one runner that it shares process-wide; the e4m3 × e4m3 product reads no workspace but refuses to run without
    one. So hsx builds a runner of its own (flashinfer's construction, uncached: the first one compiles the module
    with nvcc and keeps it in flashinfer's JIT cache) and gives it a workspace of 128 bytes, which only that path
    ever sees."""
    got = _FLASHINFER_RUNNERS.get(device.index)
    if got is None:
        runner = _flashinfer_module()[0].gemm_base.get_fp8_blockscale_gemm_runner_sm90.__wrapped__()
        workspace = torch.empty(128, dtype=torch.uint8, device=device)
        runner.configure_workspace(workspace)
        got = _FLASHINFER_RUNNERS[device.index] = (runner, workspace)
    return got[0]


def _flashinfer_mm(xq, xs, w, ws):
    # TensorRT-LLM's kernel reads raw pointers (flashinfer checks the shapes of the weight scales only): xq (M, K)
    # and w (N, K) e4m3 K-major; the 1×128 scales as DeepGEMM does, (K/128, M) contiguous with M a multiple of 4 (its
    # TMA descriptor's leading dimension is M rounded up to 4: `_quantize_activation_cuda` pads M to 16); the
    # 128×128 ones (N/128, K/128) contiguous; N a multiple of 64. It picks a tile shape from M and compiles its
    # kernel with NVRTC at first use, kept on disk (TRTLLM_DG_CACHE_DIR, default ~/.tensorrt_llm).
    m, n = xq.shape[0], w.shape[0]
    if m % 4 or n % 64:
        raise ValueError(f"flashinfer's {FLASHINFER_GEMM} needs M a multiple of 4 and N of 64 (M = {m}, N = {n})")
    if not xs.t().is_contiguous():
        xs = xs.t().contiguous().t()
    out = torch.empty((m, n), device=xq.device, dtype=torch.bfloat16)
    _flashinfer_runner(xq.device).run_gemm(xq.contiguous(), w.contiguous(), out, xs, ws.contiguous())
    return out


# (GEMM, device, N, K) → the most rows `build_jit_kernels` has run for such weights in this process: a second job in
# one process (the bench's timed run after its warm-up, a notebook's next extract) builds only what is new
_JIT_BUILT: dict[tuple, int] = {}


def build_jit_kernels(base: torch.nn.Module, max_rows: int) -> dict[str, tuple[int, int, float]]:
    """Have each JIT GEMM (DeepGEMM, flashinfer) build, before the first batch, every kernel it will pick for this
    model's FP8 linears that it runs (`_runs`) at JIT_MIN_ROWS..`max_rows` rows: one product per weight shape and
    multiple of its JIT_ROW_STEP, as every M in between picks the tile shape of the next multiple. Otherwise each
    kernel is compiled (seconds) by the first batch that wants it, in the middle of the run (a 7 s stall at 27B,
    measured with DeepGEMM). Kernels already in the GEMM's disk cache load without compiling; row counts this
    process built before are not run again. {GEMM: (weight shapes, products run, seconds)} for the JIT GEMMs that
    run some of them."""
    shapes: dict[tuple, Fp8Linear] = {}
    if max_rows >= JIT_MIN_ROWS:
        for m in base.modules():
            if isinstance(m, Fp8Linear):
                name = _runs(m.weight, m.weight_scale_inv, max_rows)
                if name in JIT_GEMMS:
                    shapes.setdefault((name, m.weight.device, *m.weight.shape), m)
    built: dict[str, tuple[int, int, float]] = {}
    with torch.inference_mode():
        for key, m in shapes.items():
            name, device, _, k = key
            t0 = time.perf_counter()
            step = JIT_ROW_STEP[name]
            floor, top = -(-JIT_MIN_ROWS // step) * step, -(-max_rows // step) * step
            rows = range(max(floor, _JIT_BUILT.get(key, 0) + step), top + 1, step)
            if rows:
                x = torch.zeros(rows[-1], k, device=device, dtype=torch.bfloat16)
                for r in rows:
                    _gemm(name)(*fp8_quantize(x[:r]), m.weight, m.weight_scale_inv)
                del x
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                _JIT_BUILT[key] = top
            n_shapes, products, seconds = built.get(name, (0, 0, 0.0))
            built[name] = (n_shapes + 1, products + len(rows), seconds + time.perf_counter() - t0)
    return built


ROW_ALIGN = 16  # cuBLAS's block-scaled FP8 GEMM wants the rows (and the scales' leading dimension) aligned
_QUANT_KERNEL = None


def _quantize_activation_cuda(x: torch.Tensor, up: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activation` in one Triton pass: e4m3 (M', K) and float32 scales (M', K/128) stored M-major
    (a transposed view of (K/128, M')), M' = M rounded up to ROW_ALIGN, the extra rows zeros. With `up`, what is
    quantized is silu(x) · up, rounded to bf16 after each step as in eager bf16 (a gated MLP's down_proj input)."""
    global _QUANT_KERNEL
    import triton

    if _QUANT_KERNEL is None:
        import triton.language as tl
        from torch._inductor.runtime.triton_helpers import libdevice

        # Not specialized on the row count: Triton would build a second kernel for M % 16 == 0, compiled mid-run
        # by the first batch whose token count is such (~1 in 16); M_pad is always a multiple of 16.
        @triton.jit(do_not_specialize=["M"])
        def act_quant(x, u, q, s, M, M_pad, K, stride_xm, stride_um, EPS: tl.constexpr, QMAX: tl.constexpr,
                      BM: tl.constexpr, GATED: tl.constexpr):
            rm = tl.program_id(0) * BM + tl.arange(0, BM)
            kb = tl.program_id(1)
            rk = kb * 128 + tl.arange(0, 128)
            v = tl.load(x + rm[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=(rm < M)[:, None],
                        other=0.0).to(tl.float32)
            if GATED:
                uv = tl.load(u + rm[:, None].to(tl.int64) * stride_um + rk[None, :], mask=(rm < M)[:, None],
                             other=0.0).to(tl.float32)
                a = (v / (1.0 + libdevice.exp(-v))).to(tl.bfloat16).to(tl.float32)
                v = (a * uv).to(tl.bfloat16).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(v), axis=1), EPS) / QMAX
            qv = tl.clamp(v / scale[:, None], -QMAX, QMAX)
            keep = rm < M_pad
            tl.store(q + rm[:, None].to(tl.int64) * K + rk[None, :], qv.to(q.dtype.element_ty), mask=keep[:, None])
            tl.store(s + kb * M_pad + rm, scale, mask=keep)

        _QUANT_KERNEL = act_quant
    m, k = x.shape
    m_pad = -(-m // ROW_ALIGN) * ROW_ALIGN
    q = torch.empty((m_pad, k), device=x.device, dtype=FP8_DTYPE)
    s = torch.empty((k // BLOCK, m_pad), device=x.device, dtype=torch.float32)
    bm = 32
    u = x if up is None else up
    _QUANT_KERNEL[(triton.cdiv(m_pad, bm), k // BLOCK)](x, u, q, s, m, m_pad, k, x.stride(0), u.stride(0),
                                                         EPS=SCALE_EPS, QMAX=FP8_MAX, BM=bm, GATED=up is not None,
                                                         num_warps=4)
    return q, s.t()


# What auto tries, fastest first (docs/fp8.md's GEMM tables); Triton, last, runs any shape. DeepGEMM and fbgemm run
# where their packages are installed (neither is a dependency of hsx); DeepGEMM's products of fewer than
# JIT_MIN_ROWS rows run on the next. flashinfer, not measured yet, runs only where asked for (`_gemms_from`).
GEMMS = kernels.FP8_GEMMS  # ("deepgemm", "cublas", "fbgemm", "triton"): hsx.target.kernels holds the order


def _gemms_from(first: str) -> list[str]:
    """The GEMMs tried in turn when `first` is asked for (or runs a device's linears): it, then the others of GEMMS
    fastest first (Triton, last, runs any shape)."""
    return [first] + [g for g in GEMMS if g != first]
_GEMM_NAMES = {"fbgemm": f"fbgemm's {FBGEMM_OP}", "cublas": "cuBLAS's block-scaled _scaled_mm",
               "deepgemm": "DeepGEMM's fp8_gemm_nt", "flashinfer": f"flashinfer's {FLASHINFER_GEMM}",
               "triton": "hsx's Triton block GEMM"}
_BACKEND: dict[int | None, str] = {}  # device index → the GEMM its FP8 linears run (`use_gemm`)
_CHOSEN: dict[int | None, str] = {}  # device index → the choice that _BACKEND's entry answers


def _gemm(name: str):
    return {"fbgemm": _fbgemm_mm, "cublas": _cublas_mm, "deepgemm": _deepgemm_mm, "flashinfer": _flashinfer_mm,
            "triton": _triton_mm}[name]


def gemm(name: str):
    """(GEMM `name` of GEMMS as fp8_mm runs it: (xq, xs, w, ws) → bf16, unchecked; None) where it is there, else
    (None, why): the GEMM bench's access to each one."""
    why = _missing(name, name)
    return (_gemm(name), None) if why is None else (None, why)


def use_gemm(device: torch.device, choice: str = "auto") -> str:
    """Choose the block-scaled GEMM of `device`'s FP8 linears (config key fp8_gemm): `choice`, or with "auto" the
    first of GEMMS, if it is there and a small product (16 and 200 rows × 384 × 512; DeepGEMM, flashinfer:
    JIT_MIN_ROWS rows) agrees with the float32 reference, else the next that does (`_gemms_from`), with one warning
    saying which runs instead (none for an fbgemm_gpu, deep_gemm or flashinfer that is not installed unless it was
    asked for). Each weight shape is checked again at its first use (`_takes`)."""
    if choice not in FP8_GEMM_CHOICES:
        raise HsxError(f"fp8_gemm {choice!r} is not one of {', '.join(FP8_GEMM_CHOICES)}")
    if _CHOSEN.get(device.index) == choice and device.index in _BACKEND:
        return _BACKEND[device.index]
    if device.type == "cuda":
        _check_quantization(device)
    g = torch.Generator(device=device).manual_seed(0)
    wq, ws = quantize_weight(torch.randn(384, 512, device=device, generator=g) * 0.05)
    failed = []
    for name in _gemms_from(GEMMS[0] if choice == "auto" else choice):
        if name != choice and not _runs_here(name, device):  # not checked on this GPU: said by hsx.target.kernels' line
            continue
        why = _missing(name, choice)
        if why is None:
            why = _disagrees(name, wq, ws)
        if why is None:
            break
        failed.append((name, why))
    else:
        raise HsxError(f"hsx's FP8 block GEMM disagrees with the reference on {device} ({failed[-1][1]})")
    said = [f"{_GEMM_NAMES[n]}: {why}" for n, why in failed if why]
    if said:
        warnings.warn(f"hsx: {'; '.join(said)}; FP8 linears run on {_GEMM_NAMES[name]} instead", stacklevel=2)
    _BACKEND[device.index], _CHOSEN[device.index] = name, choice
    return name


def _runs_here(name: str, device: torch.device) -> bool:
    """Whether GEMM `name` may run on `device` unasked (`hsx.target.kernels.fp8_gemm_order`: where it was checked or is
    documented to run; Triton, the portable one, anywhere)."""
    cap = kernels.capability_of(device)
    return cap is None or name in kernels.fp8_gemm_order(cap, frozenset(kernels.FP8_PACKAGES.values()))


def _missing(name: str, choice: str) -> str | None:
    """Why GEMM `name` is not there to run ("": not there, nothing to say), None when it is."""
    if name == "fbgemm":
        op, why = _fbgemm_op()
        hint = "fbgemm_gpu is not installed (pip install fbgemm-gpu-genai)"
    elif name == "deepgemm":
        op, why = _deepgemm_module()
        hint = "deep_gemm is not installed (github.com/deepseek-ai/DeepGEMM)"
    elif name == "flashinfer":
        op, why = _flashinfer_module()
        hint = "flashinfer is not installed (pip install flashinfer-python)"
    else:
        return None
    if op is not None:
        return None
    return why or (hint if choice == name else "")


def _check_quantization(device: torch.device) -> None:
    """The Triton activation quantization equals its torch reference bit for bit on this GPU (else an error: every
    FP8 GEMM reads what it writes)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(201, 512, device=device, generator=g, dtype=torch.bfloat16)
    xq, xs = _quantize_activation_cuda(x)
    tq, ts = quantize_activation(x)
    if not (torch.equal(xq[:201].view(torch.uint8), tq.view(torch.uint8)) and torch.equal(xs[:201], ts)):
        raise HsxError("hsx's FP8 activation quantization disagrees with its reference on this GPU")


def backend_of(device: torch.device) -> str:
    """The GEMM `device`'s FP8 linears run (chosen by `use_gemm`, "auto" when nothing chose)."""
    return _BACKEND.get(device.index) or use_gemm(device)


_TRITON_KERNEL = None


def _triton_kernel():
    """A block-scaled FP8 GEMM in Triton, after the design of SGLang's and vLLM's `w8a8_block_fp8_matmul`
    (Apache-2.0): each K step of 128 is one scale block, its partial product scaled by the activation row's and the
    weight block's scales before accumulating in float32. Tiles autotuned per (N, K)."""
    global _TRITON_KERNEL
    if _TRITON_KERNEL is not None:
        return _TRITON_KERNEL
    import triton
    import triton.language as tl

    configs = [triton.Config({"BM": bm, "BN": bn, "GROUP_M": 8}, num_stages=s, num_warps=wp)
               for bm, bn, s, wp in ((128, 128, 3, 8), (128, 128, 4, 4), (64, 128, 4, 4), (128, 256, 3, 8))]

    @triton.autotune(configs=configs, key=["N", "K"])
    @triton.jit
    def block_fp8_mm(a, b, c, a_s, b_s, M, N, K, stride_am, stride_bn, stride_cm, stride_asm, stride_ask,
                     stride_bsn, stride_bsk, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
        BK: tl.constexpr = 128
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        num_n = tl.cdiv(N, BN)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        group_m = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        m_ok = rm < M
        n_ok = rn < N
        a_ptr = a + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
        b_ptr = b + rn[None, :].to(tl.int64) * stride_bn + rk[:, None]
        as_ptr = a_s + rm.to(tl.int64) * stride_asm
        bs_ptr = b_s + (rn // BK) * stride_bsn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BK)):
            k_ok = rk < K - kb * BK
            av = tl.load(a_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            bv = tl.load(b_ptr, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            sa = tl.load(as_ptr + kb * stride_ask, mask=m_ok, other=0.0)
            sb = tl.load(bs_ptr + kb * stride_bsk, mask=n_ok, other=0.0)
            acc += tl.dot(av, bv) * sa[:, None] * sb[None, :]
            a_ptr += BK
            b_ptr += BK
        c_ptr = c + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
        tl.store(c_ptr, acc.to(tl.bfloat16), mask=m_ok[:, None] & n_ok[None, :])

    def run(xq, xs, w, ws):
        m, k = xq.shape
        n = w.shape[0]
        out = torch.empty((m, n), device=xq.device, dtype=torch.bfloat16)
        grid = lambda meta: (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)  # noqa: E731
        block_fp8_mm[grid](xq, w, out, xs, ws, m, n, k, xq.stride(0), w.stride(0), out.stride(0), xs.stride(0),
                           xs.stride(1), ws.stride(0), ws.stride(1))
        return out

    _TRITON_KERNEL = run
    return run


def _triton_mm(xq, xs, w, ws):
    return _triton_kernel()(xq.contiguous(), xs, w.contiguous(), ws)


# ---- the module ----------------------------------------------------------------------------------------------------

class Fp8Linear(torch.nn.Module):
    """A linear layer over e4m3 weights with 128×128 block scales (the tensors of transformers' FP8Linear, shared,
    under the same names): `fp8_linear`. With `reference` on, the
    weights are dequantized per call and the product runs in bf16 (the bf16 model's states, for hsx.target.drift)."""

    def __init__(self, weight: torch.nn.Parameter, weight_scale_inv: torch.nn.Parameter,
                 bias: torch.nn.Parameter | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight, self.weight_scale_inv = weight, weight_scale_inv
        self.bias = bias
        self.reference = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        if self.reference:
            y = x @ dequantize_weight(self.weight, self.weight_scale_inv, x.dtype).t()
        else:
            x2 = x.reshape(-1, self.in_features)
            if torch.compiler.is_compiling():
                # two ops, so that the projections of one input share its quantization (`compile_options`)
                xq, xs = fp8_quantize(x2)
                y = fp8_mm(xq, xs, self.weight, self.weight_scale_inv)[:x2.shape[0]]
            else:
                y = fp8_linear(x2, self.weight, self.weight_scale_inv)
            y = y.view(*lead, self.out_features).to(x.dtype)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 128x128 blocks"
