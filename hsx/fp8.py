"""FP8 block-quantized targets: the official `-FP8` checkpoints' linear layers run on FP8 tensor cores.

The layout (Qwen3 / Qwen3.5 / Qwen3.6 `-FP8`, DeepSeek-V3 style; transformers' FineGrainedFP8 integration):
`quantization_config = {quant_method: fp8, weight_block_size: [128, 128], activation_scheme: dynamic,
fmt: e4m3}`; each quantized linear stores `weight` as float8_e4m3fn (out, in) and `weight_scale_inv` as float32
(ceil(out/128), ceil(in/128)), one scale per 128×128 block, the weight being `weight[i, j] * weight_scale_inv[i // 128,
j // 128]`. Activations are quantized when they arrive, per 1×128 block of each token's features (scale = the
block's absolute max / 448), as the serving engines (vLLM, SGLang) and transformers' FP8Linear do. Attention,
norms, Gated DeltaNet and routers stay in bf16 (the checkpoint's `modules_to_not_convert` and its bf16 tensors).

transformers loads such a checkpoint as stored (its FP8Linear modules hold the e4m3 weights and scales; no bf16
copy). On CUDA with FP8 tensor cores (compute capability 8.9+) `install` puts `Fp8Linear` in their place, sharing
their tensors: a Triton pass quantizes the activations (`hsx::fp8_quantize`), then a block-scaled GEMM multiplies
(`hsx::fp8_mm`), the first of GEMMS that passes its check against the float32 product (`use_gemm`, config key
fp8_gemm), fastest first as measured (GEMMs alone and end to end: docs/benchmarks.md, sessions 13 and 14 and
2026-12-02 (later)): DeepGEMM's `fp8_gemm_nt` where it is installed, for products of DEEPGEMM_MIN_ROWS rows or
more; torch's cuBLAS `_scaled_mm`; fbgemm-gpu-genai's CUTLASS `f8f8bf16_groupwise` where that package is installed;
a Triton kernel (slower than bf16: a fallback).
In a compiled layer, projections of one input (q/k/v, gate/up) share one quantization (`compile_options`' pass
merges the equal calls), and a SiLU-gated MLP quantizes silu(gate)·up in the pass that computes it
(`fuse_gated_mlps`), so an FP8 layer adds little beyond its quantization passes to the bf16 layer's non-GEMM time
(docs/benchmarks.md, 2026-12-02: FP8 layers quantize each input once). Elsewhere (CPU, older GPUs) transformers
dequantizes the weights to the model's dtype at load and that runs instead (`runs_instead`). Experts in this
layout (transformers' FP8Experts) run in hsx.moe's grouped path (`fp8_experts_forward`).
"""

from __future__ import annotations

import math
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from hsx import kernels
from hsx.config import FP8_GEMM_CHOICES
from hsx.errors import HsxError, one_line

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest e4m3fn value
BLOCK = 128  # the only block size hsx's kernels take (the official checkpoints' [128, 128])
MAX_BLOCK = 1 << 16  # a weight_block_size side past this is no block layout (a matrix side is rarely larger)
FP8_EXPERTS = "_hsx_fp8_experts"  # set on an experts module (hsx.moe.use_experts) whose e4m3 experts hsx runs
FP8_EXPERTS_RUN_ON = "_hsx_fp8_experts_run_on"  # set beside it: "triton" where both kernels passed their checks
BF16_REFERENCE = "_hsx_bf16_reference"  # set on such a module by `bf16_reference`: its experts run dequantized
SCALE_EPS = 1e-10  # an all-zero activation block gets this scale instead of 0 (no 0/0)
# Every check of an FP8 kernel (GEMMs here, hsx.moe's expert kernels) against its float32 reference: Frobenius
# relative error below this. A right kernel differs by accumulation order (6.9e-4 on Qwen3-8B's shapes,
# docs/benchmarks.md); a wrong scale layout or tile is off by far more.
CHECK_TOLERANCE = 1e-2
# The official `-FP8` checkpoints' quantization_config (the layout hsx's kernels run)
CHECKPOINT_QUANTIZATION = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK], "activation_scheme": "dynamic",
                           "fmt": "e4m3"}


@dataclass(frozen=True)
class Fp8Config:
    """A checkpoint's `quantization_config` for quant_method fp8, as read (`quantization_of`)."""

    weight_block_size: tuple[int, int]
    activation_scheme: str
    fmt: str
    scale_fmt: str
    modules_to_not_convert: tuple[str, ...]

    def record(self) -> dict[str, Any]:
        """What hsx.json and the job fingerprint record."""
        return {"quant_method": "fp8", "weight_block_size": list(self.weight_block_size),
                "activation_scheme": self.activation_scheme, "fmt": self.fmt, "scale_fmt": self.scale_fmt}

    def blocker(self) -> str | None:
        """Why hsx's kernels cannot run this layout (None when they can)."""
        if list(self.weight_block_size) != [BLOCK, BLOCK]:
            return f"weight_block_size {list(self.weight_block_size)} (hsx's kernels take [128, 128])"
        if self.activation_scheme != "dynamic":
            return f"activation_scheme {self.activation_scheme!r} (hsx's kernels quantize activations dynamically)"
        if self.fmt != "e4m3":
            return f"fmt {self.fmt!r} (hsx's kernels take e4m3 weights)"
        if self.scale_fmt != "float":
            return f"scale_fmt {self.scale_fmt!r} (hsx's kernels take float32 block scales)"
        return None


def quant_method_of(d: dict):
    """A quantization_config mapping's quant_method as transformers spells it (a config object's to_dict gives
    transformers' QuantizationMethod enum): "fp8" is this module's; "FP8" is no method transformers knows."""
    method = d.get("quant_method")
    return getattr(method, "value", method)


def quantization_of(config) -> Fp8Config | None:
    """The fp8 quantization a model config declares (on the text config or, for vision-language checkpoints, the
    outer one), None for an unquantized model or another quant_method transformers knows (its own loader handles
    those). A malformed fp8 entry, or a quant_method transformers does not know (it would load the weights as if
    unquantized, warning only: "FP8" among them, its methods being lower case), is an HsxError: loading it would
    make wrong weights silently."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    d = q if isinstance(q, dict) else (q.to_dict() if hasattr(q, "to_dict") else vars(q))
    if not isinstance(d, dict):
        raise HsxError(f"quantization_config is a {type(q).__name__}, not a mapping")
    method = quant_method_of(d)
    if method != "fp8":
        _check_known_method(d, method)
        return None
    block = d.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= MAX_BLOCK for b in block)):
        raise HsxError(f"quantization_config: weight_block_size {block!r} is not two integers in [1, {MAX_BLOCK:,}]")
    skip = d.get("modules_to_not_convert") or []
    if not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) for s in skip):
        raise HsxError("quantization_config: modules_to_not_convert is not a list of names")
    fields = {}
    for key, default in (("activation_scheme", "dynamic"), ("fmt", "e4m3"), ("scale_fmt", "float")):
        value = d.get(key, default)
        if value is None:
            value = default
        if not isinstance(value, str):
            raise HsxError(f"quantization_config: {key} {value!r} is not a string")
        fields[key] = value.lower()
    return Fp8Config(weight_block_size=(int(block[0]), int(block[1])), modules_to_not_convert=tuple(skip),
                     **fields)


def _check_known_method(d: dict, method) -> None:
    """HsxError unless transformers quantizes by `method` (bitsandbytes by its load_in_* flags): one it does not
    know it skips with a warning, and the stored (e.g. e4m3) weights load as they are, without their scales."""
    if d.get("load_in_8bit") or d.get("load_in_4bit"):
        return
    try:
        from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING as known
    except ImportError:  # another transformers: its loader says what it takes
        return
    if isinstance(method, str) and method in known:
        return
    hint = " (the method is spelled 'fp8')" if isinstance(method, str) and method.strip().lower() == "fp8" else ""
    what = f"quant_method {method!r}" if method is not None else "no quant_method"
    raise HsxError(f"quantization_config has {what}{hint}, which transformers does not know: it would load the "
                   "weights as if unquantized")


def carry_quantization(full_config, text_config):
    """`text_config` with the outer config's quantization_config when only the outer one has it (Qwen3.5/3.6
    vision-language checkpoints): the text model built from it must load the FP8 tensors as FP8, not cast them."""
    if getattr(text_config, "quantization_config", None) is None and text_config is not full_config:
        q = getattr(full_config, "quantization_config", None)
        if q is not None:
            text_config.quantization_config = q
    return text_config


# ---- the checkpoint's FP8 tensors, checked before they load ------------------------------------------------------
# transformers trusts them: on CPU it dequantizes with whatever scale grid it finds (a missing scale leaves the e4m3
# values unscaled, a [1, 1] scale broadcasts, e5m2 bytes read as e5m2, weight_block_size is never read), on a GPU it
# casts what it finds into its e4m3 / float32 parameters. So every float8 tensor's layout is checked here, from the
# safetensors headers, and every scale's values as they are read (`scale_problem`).

WEIGHT_DTYPES = {"e4m3": "F8_E4M3"}  # fmt → the safetensors dtype of its weights (transformers' FP8 layers: e4m3)
FLOAT8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})  # stored weights of any float8 format (F8_E8M0 is a scale's)
SCALE_DTYPES = {"float": ("F32", "BF16"), "ue8m0": ("F8_E8M0", "U8")}  # scale_fmt → the dtypes its scales come in
SCALE_SUFFIX = "_scale_inv"  # X.weight's scales: X.weight_scale_inv; fused experts' X.down_proj: X.down_proj_scale_inv


def stored_problems(tensors: dict[str, Any], quant: Fp8Config | None) -> list[str]:
    """What is wrong with a checkpoint's stored tensors (name → an entry with `dtype`, a safetensors dtype name,
    and `shape`) for the quantization its config declares, one line per tensor, [] when nothing is: every float8
    weight in the declared fmt, 2-D (out, in) or 3-D (experts, out, in), with its `SCALE_SUFFIX` scales of exactly
    (..., ceil(out / block_out), ceil(in / block_in)) for weight_block_size, in a dtype its scale_fmt allows; no
    scale without its float8 weight; no float8 weight at all under a config that declares no quantization (its
    values would be read unscaled), and at least one under an fp8 one."""
    float8 = sorted(n for n, t in tensors.items() if t.dtype in FLOAT8_DTYPES)
    if quant is None:
        return [f"{n} is stored {tensors[n].dtype} but config.json declares no quantization_config: its values "
                "would be read without their scales" for n in float8]
    want = WEIGHT_DTYPES.get(quant.fmt)
    if want is None:
        return [f"quantization_config's fmt is {quant.fmt!r}: transformers' FP8 layers hold e4m3 weights (fmt "
                "'e4m3'); others would be cast"]
    scale_dtypes = SCALE_DTYPES.get(quant.scale_fmt)
    if scale_dtypes is None:
        return [f"quantization_config's scale_fmt is {quant.scale_fmt!r}, not one of {', '.join(SCALE_DTYPES)}"]
    if not float8:
        return ["quantization_config declares fp8 but the checkpoint holds no float8 weight"]
    bo, bi = quant.weight_block_size
    found = []
    for name in float8:
        t, scale = tensors[name], name + SCALE_SUFFIX
        s = tensors.get(scale)
        if t.dtype != want:
            found.append(f"{name} is stored {t.dtype}, not {want} as quantization_config's fmt {quant.fmt!r} says")
        elif len(t.shape) not in (2, 3):
            found.append(f"{name} has shape {list(t.shape)}: an FP8 weight is (out, in), or (experts, out, in)")
        elif s is None:
            found.append(f"{name} has no block scales ({scale} is not in the checkpoint)")
        elif s.dtype not in scale_dtypes:
            found.append(f"{scale} is stored {s.dtype}; scale_fmt {quant.scale_fmt!r} scales are "
                         f"{' or '.join(scale_dtypes)}")
        else:
            *lead, out, inp = t.shape
            grid = [*lead, -(-out // bo), -(-inp // bi)]
            if list(s.shape) != grid:
                found.append(f"{scale} has shape {list(s.shape)}, not {grid}: {name} {list(t.shape)} in "
                             f"weight_block_size {[bo, bi]} blocks")
    for scale in sorted(n for n in tensors if n.endswith(SCALE_SUFFIX)):
        weight = tensors.get(scale[:-len(SCALE_SUFFIX)])
        if weight is None:
            found.append(f"{scale} has no weight ({scale[:-len(SCALE_SUFFIX)]} is not in the checkpoint)")
        elif weight.dtype not in FLOAT8_DTYPES:
            found.append(f"{scale[:-len(SCALE_SUFFIX)]} is stored {weight.dtype}, not {want}, beside its block scales")
    return found


def scale_problem(name: str, scales: torch.Tensor) -> str | None:
    """Why a weight's block scales (as stored: float32, bf16, ue8m0) cannot scale it, None when every one is a
    positive finite number: a zero zeroes a block, a negative one flips its sign, NaN or inf poisons every state
    downstream. One reduction over the tensor, on whatever device it is read to."""
    s = (scales.float() - 127).exp2().masked_fill(scales == 255, math.nan) if scales.dtype == torch.uint8 \
        else scales.float()  # (ue8m0 stored as bytes: 2^(byte - 127), 255 is NaN)
    bad = ~(torch.isfinite(s) & (s > 0))
    count = int(bad.sum())
    if not count:
        return None
    first = int(bad.flatten().nonzero()[0])
    where = [int(i) for i in torch.unravel_index(torch.tensor(first), s.shape)] if s.dim() else []
    return (f"{name} holds {count:,} of {s.numel():,} block scales that are not positive finite numbers (the first, "
            f"at {where}, is {float(s.flatten()[first])!r})")


def has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and kernels.capability_of(device) >= kernels.FP8_TENSOR_CORES


def runs_instead(quant: Fp8Config, device: torch.device) -> str | None:
    """One line saying what runs in place of hsx's FP8 kernels on this device, None when they run."""
    why = quant.blocker()
    if why is None and not has_fp8_tensor_cores(device):
        why = ("no CUDA device" if device.type != "cuda" else
               f"compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))} has no FP8 "
               "tensor cores (8.9+)")
    if why is None:
        return None
    if quant.blocker() is None:
        return (f"hsx: FP8 checkpoint, {why}: transformers dequantizes its weights at load and the linear layers "
                "(and experts, if any) run in the model's dtype, without activation quantization (states differ "
                "from FP8 serving by that)")
    return f"hsx: FP8 checkpoint with {why}: its linear layers and experts run on transformers' FP8 forward"


# ---- the maths (CPU and CUDA alike) ------------------------------------------------------------------------------

def quantize_weight(weight: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """(e4m3 weight, float32 weight_scale_inv): per block, scale = absolute max / 448 and e4m3 = weight / scale,
    the official checkpoints' quantization. Edge blocks cover what is left of the matrix."""
    n, k = weight.shape
    bn, bk = block
    pn, pk = math.ceil(n / bn) * bn, math.ceil(k / bk) * bk
    w = torch.nn.functional.pad(weight.float(), (0, pk - k, 0, pn - n)).view(pn // bn, bn, pk // bk, bk)
    scale = (w.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=SCALE_EPS)  # (blocks_n, blocks_k)
    q = (w / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(pn, pk)[:n, :k].contiguous(), scale


def dequantize_weight(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                      block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    n, k = q.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return (q.float() * s).to(dtype)


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) → (e4m3 (M, K), float32 scales (M, K/128)): per 1×128 block of each row, scale = absolute max / 448.
    Plain torch, so that Inductor fuses it with what comes before (the norm) in a compiled layer."""
    m, k = x.shape
    blocks = x.float().view(m, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=-1).clamp(min=SCALE_EPS) / FP8_MAX
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, k), scale


def quantize_activation_padded(x: torch.Tensor, align: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activation` in the layout cuBLAS takes: rows padded with zeros to a multiple of `align` (M'),
    scales (M', K/128) stored M-major (a transposed view of (K/128, M')): what `fp8_quantize` returns, in plain
    torch (its CPU path)."""
    m, k = x.shape
    x = torch.nn.functional.pad(x, (0, 0, 0, (-m) % align))
    blocks = x.float().view(-1, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=-1).clamp(min=SCALE_EPS) / FP8_MAX
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(-1, k), scale.t().contiguous().t()


def reference_mm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The block-scaled product in float32 (tests; CPU): dequantize both sides, multiply."""
    m, k = xq.shape
    x = (xq.float().view(m, k // BLOCK, BLOCK) * xs.float().unsqueeze(-1)).view(m, k)
    return (x @ dequantize_weight(w, ws, torch.float32).t()).to(out_dtype)


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
    DeepGEMM only from DEEPGEMM_MIN_ROWS rows."""
    first = backend_of(w.device)
    for name in _gemms_from(first)[:-1]:
        if name != first and not _runs_here(name, w.device):  # (the next GEMMs: those hsx.kernels allows here)
            continue
        if name == "deepgemm" and rows is not None and rows < DEEPGEMM_MIN_ROWS:
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
            after = ", else ".join(_GEMM_NAMES[g] + (f" (from {DEEPGEMM_MIN_ROWS:,} rows)" if g == "deepgemm" else "")
                                   for g in _gemms_from(name)[1:] if _missing(g, "auto") is None)
            warnings.warn(f"hsx: {_GEMM_NAMES[name]} failed its check for {w.shape[0]}×{w.shape[1]} FP8 weights on "
                          f"{w.device} ({why}); {after} runs weights of this shape", stacklevel=2)
    return _SHAPES[key]


def _disagrees(name: str, w: torch.Tensor, ws: torch.Tensor) -> str | None:
    """Why GEMM `name`'s products of random activation rows with (w, ws) are not the float32 reference's
    (`relative_error` < CHECK_TOLERANCE), None when they are: 16 and 200 rows (fbgemm runs another kernel at
    M <= 16), DEEPGEMM_MIN_ROWS for DeepGEMM (the kernel it compiles for every larger M)."""
    g = torch.Generator(device=w.device).manual_seed(1)
    for m in (DEEPGEMM_MIN_ROWS,) if name == "deepgemm" else (16, 200):
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


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got − want|| / ||want|| (Frobenius, in float32): what every FP8 kernel check compares to CHECK_TOLERANCE."""
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


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


FBGEMM_OP = "f8f8bf16_groupwise"  # fbgemm-gpu-genai's CUTLASS SM90 GEMM: 1×128 activation, 128×128 weight scales
_FBGEMM: list = []  # [(the op or None, why not or None)], loaded once


def _fbgemm_op():
    """(torch.ops.fbgemm.f8f8bf16_groupwise, None) where fbgemm-gpu-genai imports and registers it; (None, None)
    where fbgemm_gpu is not installed; (None, why) where it is but the op is not usable."""
    if not _FBGEMM:
        _FBGEMM.append(_load_fbgemm())
    return _FBGEMM[0]


def _load_fbgemm():
    import importlib.util

    try:
        if importlib.util.find_spec("fbgemm_gpu") is None:
            return None, None
        with _root_logging_silenced():
            # (fbgemm_gpu's __init__ loads the gen_ai library, which registers torch.ops.fbgemm's GEMMs)
            import fbgemm_gpu.experimental.gen_ai  # noqa: F401
    except Exception as e:  # noqa: BLE001  (a build for another torch or CUDA: undefined symbols, missing libraries)
        return None, f"fbgemm_gpu does not import: {type(e).__name__}: {one_line(e, 160)}"
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
    import importlib
    import importlib.util

    try:
        if importlib.util.find_spec(DEEPGEMM_MODULE) is None:
            return None, None
        module = importlib.import_module(DEEPGEMM_MODULE)
    except Exception as e:  # noqa: BLE001  (a build for another torch or CUDA, no CUDA compiler for its JIT)
        return None, f"deep_gemm does not import: {type(e).__name__}: {one_line(e, 160)}"
    if not callable(getattr(module, "fp8_gemm_nt", None)):
        return None, "this deep_gemm has no fp8_gemm_nt"
    return module, None


# DeepGEMM picks a tile shape per product from M, N and K (its heuristic's cost model), and compiles a kernel (nvcc,
# seconds each) for each tile shape it has not built yet. Below a few thousand rows nearly every M picks another
# one: a bench run of small warm-up batches stalled for minutes. From 8,192 rows, that heuristic (emulated in
# Python; it reproduced the measured compile points exactly) picks 1-3 tile shapes per weight shape up to 32,768
# rows for Qwen3-8B's and Qwen3.6-27B's linears: 6 and 9 kernels in all. Smaller products, the few short batches of
# a job, run on the next GEMM. The sweeps: docs/benchmarks.md, session 13.
DEEPGEMM_MIN_ROWS = 8192


def _deepgemm_mm(xq, xs, w, ws):
    # DeepGEMM's SM90 kernel (recipe (1, 128, 128)) reads the 1×128 scales MN-major and TMA-aligned (M' rows, a
    # multiple of 4: `_quantize_activation_cuda` writes them so, M padded to 16) and the 128×128 ones as the
    # checkpoint stores them, (N/128, K/128) K-major; it compiles a kernel per (N, K) and tile shape on first use
    # and keeps it on disk (DG_JIT_CACHE_DIR, default ~/.deep_gemm).
    dg = _deepgemm_module()[0]
    out = torch.empty((xq.shape[0], w.shape[0]), device=xq.device, dtype=torch.bfloat16)
    dg.fp8_gemm_nt((xq.contiguous(), xs), (w.contiguous(), ws.contiguous()), out)
    return out


DEEPGEMM_ROW_STEP = 64  # DeepGEMM's SM90 tile choice reads M only as ceil(M / block_m), block_m 64, 128 or 256 (M > 32)


# (device, N, K) → the most rows `build_deepgemm_kernels` has run for such weights in this process: a second job in
# one process (the bench's timed run after its warm-up, a notebook's next extract) builds only what is new
_DEEPGEMM_BUILT: dict[tuple, int] = {}


def build_deepgemm_kernels(base: torch.nn.Module, max_rows: int) -> tuple[int, int, float]:
    """Have DeepGEMM build, before the first batch, every kernel it will pick for this model's FP8 linears that it
    runs (`_runs`) at DEEPGEMM_MIN_ROWS..`max_rows` rows: one product per weight shape and multiple of
    DEEPGEMM_ROW_STEP, as every M in between picks the tile shape of the next multiple. Otherwise each kernel is
    compiled (seconds) by the first batch that wants it, in the middle of the run (a 7 s stall at 27B, measured).
    Kernels already in DeepGEMM's disk cache (DG_JIT_CACHE_DIR) load without compiling; row counts this process
    built before are not run again. (weight shapes, products run, seconds); (0, 0, 0.0) when DeepGEMM runs none of
    them."""
    step = DEEPGEMM_ROW_STEP
    shapes = {}
    if max_rows >= DEEPGEMM_MIN_ROWS:
        for m in base.modules():
            if isinstance(m, Fp8Linear) and _runs(m.weight, m.weight_scale_inv, max_rows) == "deepgemm":
                shapes.setdefault((m.weight.device, *m.weight.shape), m)
    if not shapes:
        return 0, 0, 0.0
    floor, top = -(-DEEPGEMM_MIN_ROWS // step) * step, -(-max_rows // step) * step
    t0 = time.perf_counter()
    products = 0
    with torch.inference_mode():
        for key, m in shapes.items():
            device, _, k = key
            rows = range(max(floor, _DEEPGEMM_BUILT.get(key, 0) + step), top + 1, step)
            if not rows:
                continue
            x = torch.zeros(rows[-1], k, device=device, dtype=torch.bfloat16)
            for r in rows:
                _deepgemm_mm(*fp8_quantize(x[:r]), m.weight, m.weight_scale_inv)
            del x
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            products += len(rows)
            _DEEPGEMM_BUILT[key] = top
    return len(shapes), products, time.perf_counter() - t0


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
# DEEPGEMM_MIN_ROWS rows run on the next.
GEMMS = kernels.FP8_GEMMS  # ("deepgemm", "cublas", "fbgemm", "triton"): hsx.kernels holds the order


def _gemms_from(first: str) -> list[str]:
    """The GEMMs tried in turn when `first` is asked for (or runs a device's linears): it, then the others of GEMMS
    fastest first (Triton, last, runs any shape)."""
    return [first] + [g for g in GEMMS if g != first]
_GEMM_NAMES = {"fbgemm": f"fbgemm's {FBGEMM_OP}", "cublas": "cuBLAS's block-scaled _scaled_mm",
               "deepgemm": "DeepGEMM's fp8_gemm_nt",
               "triton": "hsx's Triton block GEMM"}
_BACKEND: dict[int | None, str] = {}  # device index → the GEMM its FP8 linears run (`use_gemm`)
_CHOSEN: dict[int | None, str] = {}  # device index → the choice that _BACKEND's entry answers


def _gemm(name: str):
    return {"fbgemm": _fbgemm_mm, "cublas": _cublas_mm, "deepgemm": _deepgemm_mm, "triton": _triton_mm}[name]


def use_gemm(device: torch.device, choice: str = "auto") -> str:
    """Choose the block-scaled GEMM of `device`'s FP8 linears (config key fp8_gemm): `choice`, or with "auto" the
    first of GEMMS, if it is there and a small product (16 and 200 rows × 384 × 512; DeepGEMM: DEEPGEMM_MIN_ROWS
    rows) agrees with the float32 reference, else the next that does (`_gemms_from`), with one warning saying which
    runs instead (none for an fbgemm_gpu or deep_gemm that is not installed unless it was asked for). Each weight
    shape is checked again at its first use (`_takes`)."""
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
        if name != choice and not _runs_here(name, device):  # not checked on this GPU: said by hsx.kernels' line
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
    """Whether GEMM `name` may run on `device` unasked (`hsx.kernels.fp8_gemm_order`: where it was checked or is
    documented to run; Triton, the portable one, anywhere)."""
    cap = kernels.capability_of(device)
    return cap is None or name in kernels.fp8_gemm_order(cap, frozenset(("deep_gemm", "fbgemm_gpu")))


def _missing(name: str, choice: str) -> str | None:
    """Why GEMM `name` is not there to run ("": not there, nothing to say), None when it is."""
    if name == "fbgemm":
        op, why = _fbgemm_op()
        hint = "fbgemm_gpu is not installed (pip install fbgemm-gpu-genai)"
    elif name == "deepgemm":
        op, why = _deepgemm_module()
        hint = "deep_gemm is not installed (github.com/deepseek-ai/DeepGEMM)"
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
    weights are dequantized per call and the product runs in bf16 (the bf16 model's states, for hsx.drift)."""

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


def compile_options(layer: torch.nn.Module) -> dict[str, Any] | None:
    """Inductor options for compiling a layer holding Fp8Linear modules (None: the defaults): merge equal
    quantizations. One dict for every layer: equal options let the layers share one compiled graph."""
    return _COMPILE_OPTIONS if any(isinstance(m, Fp8Linear) for m in layer.modules()) else None


def _dedupe(graph: torch.fx.Graph) -> int:
    """Merge nodes that apply the same pure op to the same arguments: q/k/v (and gate/up) each quantize one input,
    which without this runs once per projection. Nothing is merged in a graph with a mutating op or a
    higher-order op (e.g. a mutable custom kernel): there, equal calls may not be equal values. Nor is a node
    whose tensor shares storage with one the graph returns: eager code may mutate that one in place."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def storage(node):
        v = node.meta.get("val")
        try:
            return StorageWeakRef(v.untyped_storage()) if isinstance(v, torch.Tensor) else None
        except (NotImplementedError, RuntimeError):
            return None

    calls = [n for n in graph.nodes if n.op == "call_function"]
    for n in calls:
        if isinstance(n.target, torch._ops.HigherOrderOperator) or (
                isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable):
            return 0
    returned = {storage(n) for out in graph.find_nodes(op="output") for n in out.all_input_nodes} - {None}
    seen: dict[tuple, torch.fx.Node] = {}
    merged = 0
    for n in calls:
        t = n.target
        if (not isinstance(t, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in t.tags
                or storage(n) in returned):
            continue
        try:
            key = (t, n.args, tuple(sorted(n.kwargs.items())))
            hash(key)
        except TypeError:
            continue
        if key in seen:
            n.replace_all_uses_with(seen[key])
            graph.erase_node(n)
            merged += 1
        else:
            seen[key] = n
    return merged


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass as _Pass
except ImportError:  # an older torch: no custom passes
    _Pass = object


class _SameQuantizationOnce(_Pass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        _dedupe(graph)

    def uuid(self) -> str:
        return "hsx-fp8-dedupe-3"


# emulate_precision_casts: fused kernels round to bf16 where eager does, so that a compiled layer quantizes the very
# bf16 values transformers' FP8 forward quantizes (without it some e4m3 values round the other way)
_COMPILE_OPTIONS = {"post_grad_custom_pre_pass": _SameQuantizationOnce(), "emulate_precision_casts": True}


def _gated_mlp_forward(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """down_proj(silu(gate_proj(x)) * up_proj(x)) with x quantized once for gate and up, and silu · up quantized
    in the pass that computes it (`fuse_gated_mlps`)."""
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    if gate.reference or up.reference or down.reference:
        return down(mlp.act_fn(gate(x)) * up(x))
    x2 = x.reshape(-1, gate.in_features)
    xq, xs = fp8_quantize(x2)
    aq, a_s = fp8_silu_mul_quantize(fp8_mm(xq, xs, gate.weight, gate.weight_scale_inv),
                                    fp8_mm(xq, xs, up.weight, up.weight_scale_inv))  # rows padded: zeros stay 0
    y = fp8_mm(aq, a_s, down.weight, down.weight_scale_inv)[:x2.shape[0]]
    return y.view(*x.shape[:-1], down.out_features).to(x.dtype)


def fuse_gated_mlps(base: torch.nn.Module) -> int:
    """Run each SiLU-gated MLP whose three projections are bias-free Fp8Linear modules as `_gated_mlp_forward`
    (the same maths as its own forward, in two fewer passes over the activations); the number fused."""
    import types

    fused = 0
    for m in base.modules():
        g, u, d = (getattr(m, k, None) for k in ("gate_proj", "up_proj", "down_proj"))
        act = getattr(m, "act_fn", None)
        if (type(m).__name__.endswith("MLP") and all(isinstance(t, Fp8Linear) and t.bias is None for t in (g, u, d))
                and (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation")
                and g.in_features == u.in_features and g.out_features == u.out_features == d.in_features):
            m.forward = types.MethodType(_gated_mlp_forward, m)
            fused += 1
    return fused


def _fp8_linears(base: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """transformers' FP8Linear modules holding e4m3 weights with 128×128 block scales."""
    found = []
    for name, m in base.named_modules():
        if (type(m).__name__ == "FP8Linear" and getattr(m, "weight", None) is not None
                and m.weight.dtype == FP8_DTYPE and getattr(m, "weight_scale_inv", None) is not None
                and m.weight_scale_inv.dim() == 2 and list(getattr(m, "block_size", None) or []) == [BLOCK, BLOCK]
                and m.in_features % BLOCK == 0):
            found.append((name, m))
    return found


def install(base: torch.nn.Module) -> int:
    """Put `Fp8Linear` in place of transformers' FP8Linear modules (same tensors, no copy), gated MLPs fused
    (`fuse_gated_mlps`); the number replaced. Call on a model on a CUDA device with FP8 tensor cores."""
    swaps = _fp8_linears(base)
    for name, m in swaps:
        base.set_submodule(name, Fp8Linear(m.weight, m.weight_scale_inv, m.bias))
    fuse_gated_mlps(base)
    return len(swaps)


def report(base: torch.nn.Module, quant: Fp8Config | None) -> dict[str, Any] | None:
    """The target's quantization and how its linear layers run, for hsx.json (None: not quantized)."""
    if quant is None:
        return None
    mods = [m for m in base.modules() if isinstance(m, Fp8Linear)]
    by_shape: dict[str, str] = {}
    if mods:
        dev = mods[0].weight.device
        # (off CUDA nothing chose a GEMM unless a caller did: the torch reference runs, no kernel is started)
        gemm = backend_of(dev) if dev.type == "cuda" else _BACKEND.get(dev.index, "torch reference")
        how = f"hsx fp8 ({gemm})"
        if gemm != "torch reference":
            for m in mods:
                key = f"{m.out_features}x{m.in_features}"
                if key not in by_shape:
                    by_shape[key] = _runs(m.weight, m.weight_scale_inv)  # (its check runs here if no batch ran it yet)
            by_shape = {k: v for k, v in by_shape.items() if v != gemm}
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # the checks' float32 copies of the weights go back before a budget is sized
    elif any(type(m).__name__ == "FP8Linear" for m in base.modules()):
        how = "transformers fp8"
    else:
        how = "dequantized by transformers"
    out = {**quant.record(), "linear": how, "fp8_linears": len(mods)}
    if by_shape:  # weight shapes (N×K) whose check failed on the device's GEMM, and the GEMM they run on
        out["gemm_by_shape"] = by_shape
    if mods and how == "hsx fp8 (deepgemm)":
        out["gemm_under_rows"] = {"rows": DEEPGEMM_MIN_ROWS, "gemm": _runs(mods[0].weight, mods[0].weight_scale_inv,
                                                                           DEEPGEMM_MIN_ROWS - 1)}
    experts = [m for m in base.modules() if is_experts_module(m)]
    if experts:
        ours = [m for m in experts if getattr(m, FP8_EXPERTS, False)]
        held = [m for m in experts if _holds_e4m3(m)]
        run_on = sorted({getattr(m, FP8_EXPERTS_RUN_ON, "torch reference") for m in ours})
        out["experts"] = (f"hsx fp8 grouped ({', '.join(run_on)})" if ours
                          else "transformers fp8" if held else "dequantized by transformers")
        out["fp8_experts"] = len(ours)
    return out


def is_experts_module(module: torch.nn.Module) -> bool:
    """Whether `module` is an experts module of transformers' fused layout, which its ExpertsInterface dispatches
    (hsx.moe.use_experts puts hsx's grouped path there)."""
    return type(module).__name__.endswith("Experts") and hasattr(module, "has_gate")


def _holds_e4m3(experts: torch.nn.Module) -> bool:
    w = getattr(experts, "gate_up_proj", getattr(experts, "up_proj", None))
    return w is not None and w.dtype == FP8_DTYPE


def transformers_fp8_blocker(base: torch.nn.Module) -> str | None:
    """Why transformers' FP8 forward cannot run the FP8 modules left to it (FP8Linear modules hsx did not replace;
    e4m3 experts under its eager / grouped_mm implementations): its finegrained-fp8 kernel (the `kernels` package,
    fetched from the Hub) does not load here, and each forward would end in that ImportError. None when nothing is
    left to it or the kernel loads."""
    linears = [m for m in base.modules() if type(m).__name__ == "FP8Linear"
               and getattr(getattr(m, "weight", None), "dtype", None) == FP8_DTYPE]
    experts = [m for m in base.modules() if is_experts_module(m) and _holds_e4m3(m) and not getattr(m, FP8_EXPERTS, False)]
    if not (linears or experts):
        return None
    try:
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel
    except ImportError:  # another transformers: its FP8 forward is what it is
        return None
    try:
        load_finegrained_fp8_kernel()
        return None
    except Exception as e:  # noqa: BLE001  (ImportError; a Hub or build error of the kernel)
        why = one_line(e, 200)
    what = " and ".join(([f"{len(linears)} FP8 linear layers"] if linears else [])
                        + ([f"{len(experts)} FP8 experts modules"] if experts else []))
    hint = ("; --experts-implementation auto (or hsx_grouped) runs FP8 experts on hsx's kernels" if experts else "")
    return (f"{what} would run on transformers' FP8 forward, whose finegrained-fp8 kernel does not load here "
            f"({why}){hint}")


@contextmanager
def bf16_reference(base: torch.nn.Module):
    """Within the block, every Fp8Linear of `base` runs on its dequantized weights in bf16, unquantized activations,
    and so do the experts hsx's FP8 path runs (`BF16_REFERENCE`, read by hsx.moe): the bf16 model the checkpoint
    was quantized from, up to the weights' rounding. Yields the number of modules switched (hsx.drift)."""
    mods = [m for m in base.modules() if isinstance(m, Fp8Linear)]
    experts = [m for m in base.modules() if getattr(m, FP8_EXPERTS, False)]
    for m in mods:
        m.reference = True
    for m in experts:
        setattr(m, BF16_REFERENCE, True)
    try:
        yield len(mods) + len(experts)
    finally:
        for m in mods:
            m.reference = False
        for m in experts:
            setattr(m, BF16_REFERENCE, False)


def reference_blockers(base: torch.nn.Module) -> list[str]:
    """The modules holding e4m3 weights that `bf16_reference` does not switch (transformers' own FP8Linear or FP8
    experts, e.g. of a layout hsx's kernels do not take): a bf16 forward would still run them in FP8."""
    found = []
    for name, m in base.named_modules():
        if isinstance(m, Fp8Linear) or getattr(m, FP8_EXPERTS, False):
            continue
        if any(p.dtype == FP8_DTYPE for p in m.parameters(recurse=False)):
            found.append(name or type(m).__name__)
    return found


# ---- random FP8 weights (hsx bench) --------------------------------------------------------------------------------

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


def gemm(name: str):
    """(GEMM `name` of GEMMS as fp8_mm runs it: (xq, xs, w, ws) → bf16, unchecked; None) where it is there, else
    (None, why): the GEMM bench's access to each one."""
    why = _missing(name, name)
    return (_gemm(name), None) if why is None else (None, why)


def _random_fp8_experts(experts: torch.nn.Module, device: torch.device, std: float) -> None:
    """Give a (meta) experts module of transformers' fused layout (gate_up_proj (E, 2·width, hidden), down_proj
    (E, hidden, width), no bias) random e4m3 weights and 128×128 block scales, FP8Experts' tensors under its names,
    built one expert at a time on `device`: what hsx.moe's FP8 path runs (`use_experts` checks the form)."""
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
