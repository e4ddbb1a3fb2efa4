"""Which of hsx's kernels run on which GPU: the compute capabilities each was checked on, in one table.

hsx's own kernels (Triton) and the library kernels it chooses between were measured by this project on H200s and
an H100, both compute capability 9.0 (docs/benchmarks.md); their tiles and stages were tuned there. On any other
GPU (A100 8.0, L40S 8.9, B200 10.0, RTX PRO 6000 Blackwell 12.0, ...) each runs only where its own documentation or
source says it supports that GPU (`Kernel.documented`, cited in `Kernel.source`); elsewhere the portable path named
in `Kernel.instead` runs, and one line says so (`choose`: hsx extract logs it, hsx.json's run.kernels.fallbacks
records it). Portable kernels (`instead` None) run everywhere they can, each checked against its reference on the
device before use (hsx.target.fp8_gemm's Triton GEMM and quantization, hsx.target.moe_kernels' FP8 expert kernels).

`choose` is a pure function of (capability, installed packages, dtype, what the model has), so a CPU test can ask
what any GPU gets; the modules that run the kernels ask `allowed(name, device)` (`runs_on` the device's capability)
where they choose (inside their custom ops, or once when a model is prepared: nothing a compiled graph guards on).
To add a GPU: run tests/test_gpu.py and `hsx bench` on it, then add its capability to the kernels' `checked_on`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

Capability = tuple[int, int]

MEASURED = (9, 0)  # H200 (and H100): every number in docs/benchmarks.md
# What a capability is, for the lines below (not a list of supported GPUs)
GPU_KINDS: dict[Capability, str] = {(8, 0): "A100", (8, 6): "RTX 30xx / A40", (8, 9): "L40S / RTX 40xx",
                                    (9, 0): "H100 / H200", (10, 0): "B200", (12, 0): "RTX PRO 6000 Blackwell"}
FP8_TENSOR_CORES = (8, 9)  # e4m3 tensor cores from Ada (8.9) on; torch._scaled_mm itself: "8.9 or >= 9.0"


@dataclass(frozen=True)
class Kernel:
    what: str
    instead: str | None  # what runs where this kernel does not (None: it is the portable path itself)
    checked_on: tuple[Capability, ...] = (MEASURED,)  # measured by this project
    documented: tuple[Capability, Capability] | None = None  # (lowest, highest) its own docs/source name
    source: str = ""  # where `documented` (or why not more) is stated
    dtypes: tuple[str, ...] = ()  # the model dtypes it takes (empty: any)

    def runs_on(self, capability: Capability | None) -> bool:
        if capability is None:
            return False
        if capability in self.checked_on or self.instead is None:
            return True
        return self.documented is not None and self.documented[0] <= capability <= self.documented[1]


HALF = ("bfloat16", "float16")
KERNELS: dict[str, Kernel] = {
    # packed (padding-free) batches
    "packed_attention": Kernel("hsx's packed causal attention kernel (Triton, tiles tuned on an H200)",
                               "torch's flash-attention 2 varlen", dtypes=HALF),
    "flash_varlen": Kernel("torch's flash-attention 2 varlen (packed batches)", "right-padded batches (SDPA)",
                           documented=((8, 0), (12, 1)),
                           source="torch aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, "
                                  "check_flash_attention_hardware_support: [sm80, sm121]"),
    # mixture of experts (--experts-implementation hsx_grouped)
    "moe_gate_up": Kernel("hsx's fused expert gate/up kernel (Triton)",
                          "the pair gather, torch._grouped_mm and the activation", dtypes=HALF),
    "moe_sum_pairs": Kernel("hsx's expert-sum kernel (Triton)", "the same float32 sum in torch (equal bit for bit)"),
    "moe_route_topk": Kernel("hsx's router top-k kernel (Triton)", "the router's softmax and torch.topk in torch"),
    "grouped_mm": Kernel("torch._grouped_mm's CUTLASS grouped GEMM",
                         "torch._grouped_mm's fallback: one matmul per expert after a device-to-host copy of the "
                         "offsets", documented=((9, 0), (10, 0)), dtypes=("bfloat16",),
                         source="torch aten/src/ATen/native/cuda/GroupedBlas.cpp, _grouped_mm_cuda: the fast path "
                                "on _scaled_mm_allowed_device(sm90_only, sm100_only), bf16 only"),
    "fp8_experts": Kernel("hsx's FP8 expert kernels (Triton; checked against the torch reference on the device "
                          "first, which runs where they fail)", None),
    # Gated DeltaNet (Qwen3.5/3.6, Qwen3-Next) on flash-linear-attention
    "gdn_kernels": Kernel("hsx's Gated DeltaNet convolution, q/k l2norm and gated RMSNorm kernels (Triton)",
                          "fla's causal_conv1d, the l2norm and the gated RMSNorm in torch"),
    "fla_tuned_configs": Kernel("hsx's tuned tiles for fla's delta-rule kernels (gdn.TUNED_CONFIGS)",
                                "fla's own autotuning"),
    # FP8 checkpoints: activation quantization and block-scaled GEMMs (hsx.target.fp8_gemm.GEMMS, fastest first)
    "fp8_gemm_deepgemm": Kernel("DeepGEMM's fp8_gemm_nt", "the next block-scaled GEMM",
                                source="hsx calls its SM90 recipe (float32 1x128 / 128x128 scales); DeepGEMM's "
                                       "SM100 kernels take UE8M0 scales"),
    "fp8_gemm_cublas": Kernel("cuBLAS's block-scaled _scaled_mm", "the next block-scaled GEMM",
                              source="torch aten/src/ATen/native/cuda/ScaledBlas.cpp, _check_deepseek_support: "
                                     "\"DeepSeek style (1x128, 128x128) scaling only supported in CUDA for SM90\""),
    "fp8_gemm_flashinfer": Kernel("flashinfer's fp8_blockscale_gemm_sm90", "the next block-scaled GEMM",
                                  checked_on=(), documented=((9, 0), (9, 0)),
                                  source="flashinfer gemm/gemm_base.py, fp8_blockscale_gemm_sm90: \"only supported "
                                         "on SM90 (Hopper)\"; not yet run by this project"),
    "fp8_gemm_fbgemm": Kernel("fbgemm's f8f8bf16_groupwise", "the next block-scaled GEMM",
                              source="a CUTLASS SM90 kernel; fbgemm-gpu-genai 1.6.0's wheel carries sm_90a code"),
    "fp8_gemm_triton": Kernel("hsx's Triton block GEMM and activation quantization (checked against the float32 "
                              "product on the device first)", None),
}


def runs_on(name: str, capability: Capability | None) -> bool:
    """Whether kernel `name` of KERNELS runs on a GPU of this compute capability (None: no GPU)."""
    return KERNELS[name].runs_on(capability)


def cap_str(capability: Capability) -> str:
    return f"{capability[0]}.{capability[1]}"


def cap_name(capability: Capability) -> str:
    kind = GPU_KINDS.get(capability)
    return cap_str(capability) + (f" ({kind})" if kind else "")


def _checked(k: Kernel) -> str:
    return ", ".join(cap_name(c) for c in k.checked_on) or "none yet"


def fallback_line(name: str, capability: Capability) -> str:
    """hsx: <kernel> was checked on <capabilities>, not on this GPU's: <what runs instead>."""
    k = KERNELS[name]
    if k.documented is not None:
        why = f", documented for {cap_str(k.documented[0])}-{cap_str(k.documented[1])} ({k.source})"
    else:
        why = f" ({k.source})" if k.source else ""
    return (f"hsx: {k.what}: checked on compute capability {_checked(k)}{why}; this GPU is {cap_name(capability)}: "
            f"{k.instead} runs instead")


@dataclass(frozen=True)
class Pick:
    runs: str  # what runs (a KERNELS name, or the portable path's description)
    line: str | None = None  # the one line saying what runs instead, where the kernel does not


def choose(capability: Capability | None, packages: frozenset[str] = frozenset(), dtype: str = "bfloat16", *,
           packing: bool = True, experts: bool = False, linear_attention: bool = False, fp8: bool = False,
           fp8_gemm: str = "auto") -> dict[str, Pick]:
    """What runs for each kernel choice of a model (with MoE `experts`, Gated DeltaNet `linear_attention`, an FP8
    checkpoint `fp8`) of `dtype` on a GPU of `capability` (None: CPU, where the torch references run and nothing
    is said) with these Python packages importable ("deep_gemm", "fbgemm_gpu", "flashinfer", "fla"). Pure: no GPU
    is asked."""
    if capability is None:
        return {}
    picks: dict[str, Pick] = {}

    def pick(name: str, takes: bool = True, instead: str | None = None) -> bool:
        k = KERNELS[name]
        dtype_ok = not k.dtypes or dtype in k.dtypes
        if takes and dtype_ok and k.runs_on(capability):
            picks[name] = Pick(name)
            return True
        if not dtype_ok:
            line = f"hsx: {k.what} takes {'/'.join(k.dtypes)}, not {dtype}: {instead or k.instead} runs instead"
        else:
            line = fallback_line(name, capability) if takes else None
        picks[name] = Pick(instead or k.instead or "", line)
        return False

    if packing and pick("flash_varlen"):
        pick("packed_attention")
    if experts:
        pick("moe_gate_up")
        pick("moe_sum_pairs")
        pick("moe_route_topk")
        pick("grouped_mm")
        if fp8 and capability >= FP8_TENSOR_CORES:  # (below: dequantized at load, run as bf16 experts)
            pick("fp8_experts")
    if linear_attention and "fla" in packages:
        pick("gdn_kernels")
        pick("fla_tuned_configs")
    if fp8:
        picks.update(_fp8_picks(capability, packages, fp8_gemm))
    return picks


FP8_GEMMS = ("deepgemm", "cublas", "fbgemm", "triton")  # hsx.target.fp8_gemm.GEMMS: what auto tries, fastest first
FP8_ASKED_ONLY = ("flashinfer",)  # GEMMs that run only where --fp8-gemm names them: not measured, so not ordered
# GEMMs that run only with their package
FP8_PACKAGES = {"deepgemm": "deep_gemm", "fbgemm": "fbgemm_gpu", "flashinfer": "flashinfer"}


@functools.cache  # (asked by each FP8 product that falls past its first GEMM: decided once)
def fp8_gemm_order(capability: Capability, packages: frozenset[str], choice: str = "auto") -> tuple[str, ...]:
    """The block-scaled GEMMs an FP8 linear may run on this GPU, in the order tried: under auto those of FP8_GEMMS
    whose package is there and that run on this capability (Triton, the portable one, last); a GEMM named by
    --fp8-gemm first, wherever it is, its package there (each is checked against the float32 product before use);
    one of FP8_ASKED_ONLY only then."""
    asked = (choice,) if choice in FP8_ASKED_ONLY else ()
    order = [g for g in asked + FP8_GEMMS if FP8_PACKAGES.get(g, g) in packages or g not in FP8_PACKAGES]
    order = [g for g in order if g == choice or runs_on(f"fp8_gemm_{g}", capability)]
    if choice in order:
        order.remove(choice)
        order.insert(0, choice)
    return tuple(order)


def _fp8_picks(capability: Capability, packages: frozenset[str], choice: str) -> dict[str, Pick]:
    if capability < FP8_TENSOR_CORES:
        return {"fp8_linear": Pick("dequantized by transformers",
                                   f"hsx: FP8 checkpoint, compute capability {cap_name(capability)} has no FP8 "
                                   "tensor cores (8.9+): transformers dequantizes its weights at load and the linear "
                                   "layers run in the model's dtype, without activation quantization")}
    order = fp8_gemm_order(capability, packages, choice)
    skipped = [g for g in FP8_GEMMS if g not in order and (FP8_PACKAGES.get(g, g) in packages
                                                           or g not in FP8_PACKAGES)]
    line = None
    if skipped:
        names = ", ".join(KERNELS[f"fp8_gemm_{g}"].what for g in skipped)
        line = (f"hsx: FP8 linears: {names}: checked on compute capability "
                f"{_checked(KERNELS['fp8_gemm_' + skipped[0]])}; this GPU is {cap_name(capability)}: "
                f"{KERNELS['fp8_gemm_' + order[0]].what} runs instead")
    return {"fp8_linear": Pick(order[0], line)}


# ---- the device this process runs on ------------------------------------------------------------------------------

@functools.cache
def _capability(index: int | None) -> Capability:
    import torch

    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def capability_of(device) -> Capability | None:
    """The compute capability of a torch device (None off CUDA); asked of the driver once per device."""
    if getattr(device, "type", None) != "cuda":
        return None
    return _capability(device.index)


def allowed(name: str, device) -> bool:
    """Whether kernel `name` runs on `device` (a torch device): `runs_on` its capability."""
    return runs_on(name, capability_of(device))


def installed_packages() -> frozenset[str]:
    """The optional kernel packages `choose` asks about that are installed (found, not imported)."""
    import importlib.util

    found = set()
    for module in ("deep_gemm", "fbgemm_gpu", "flashinfer", "fla"):
        try:
            if importlib.util.find_spec(module) is not None:
                found.add(module)
        except (ImportError, ValueError):
            pass
    return frozenset(found)
