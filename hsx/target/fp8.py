"""FP8 block-quantized targets: the official `-FP8` checkpoints' format, its checks and its reference maths.

The layout (Qwen3 / Qwen3.5 / Qwen3.6 `-FP8`, DeepSeek-V3 style; transformers' FineGrainedFP8 integration):
`quantization_config = {quant_method: fp8, weight_block_size: [128, 128], activation_scheme: dynamic,
fmt: e4m3}`; each quantized linear stores `weight` as float8_e4m3fn (out, in) and `weight_scale_inv` as float32
(ceil(out/128), ceil(in/128)), one scale per 128×128 block, the weight being `weight[i, j] * weight_scale_inv[i // 128,
j // 128]`. Activations are quantized when they arrive, per 1×128 block of each token's features (scale = the
block's absolute max / 448), as the serving engines (vLLM, SGLang) and transformers' FP8Linear do. Attention,
norms, Gated DeltaNet and routers stay in bf16 (the checkpoint's `modules_to_not_convert` and its bf16 tensors).

This module reads what a checkpoint declares (`quantization_of`), checks what it stores (`stored_problems`,
`scale_problem`), says what runs on a device (`runs_instead`), and holds the block quantization's maths in plain
torch (`quantize_weight`, `quantize_activation`, `reference_mm`: the reference every FP8 kernel is checked against,
`relative_error`). transformers loads such a checkpoint as stored (its FP8Linear modules hold the e4m3 weights and
scales; no bf16 copy). On CUDA with FP8 tensor cores (compute capability 8.9+) hsx runs the linear layers on its
block-scaled GEMMs (hsx.target.fp8_gemm), put in the model by hsx.target.fp8_model; elsewhere (CPU, older GPUs)
transformers
dequantizes the weights to the model's dtype at load and that runs instead (`runs_instead`). Experts in this
layout (transformers' FP8Experts) run in hsx.target.moe's grouped path (`fp8_experts_forward`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from hsx.errors import HsxError
from hsx.target import kernels

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest e4m3fn value
BLOCK = 128  # the only block size hsx's kernels take (the official checkpoints' [128, 128])
MAX_BLOCK = 1 << 16  # a weight_block_size side past this is no block layout (a matrix side is rarely larger)
SCALE_EPS = 1e-10  # an all-zero activation block gets this scale instead of 0 (no 0/0)
# Every check of an FP8 kernel (hsx.target.fp8_gemm's GEMMs, hsx.target.moe_kernels' expert kernels) against its float32
# reference: Frobenius relative error below this. A right kernel differs by accumulation order (6.9e-4 on
# Qwen3-8B's shapes, docs/benchmarks.md); a wrong scale layout or tile is off by far more.
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


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got − want|| / ||want|| (Frobenius, in float32): what every FP8 kernel check compares to CHECK_TOLERANCE."""
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
