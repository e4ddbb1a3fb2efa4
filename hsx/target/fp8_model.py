"""hsx's FP8 layers in a model: `install` (transformers' FP8Linear → hsx.target.fp8_gemm's `Fp8Linear`), gated MLPs
fused, compile options, the report hsx.json records, and the bf16 reference (hsx.target.drift).

On CUDA with FP8 tensor cores (compute capability 8.9+) `install` puts `Fp8Linear` in the place of transformers'
FP8Linear modules, sharing their tensors. In a compiled layer, projections of one input (q/k/v, gate/up) share one
quantization (`compile_options`' pass merges the equal calls), and a SiLU-gated MLP quantizes silu(gate)·up in the
pass that computes it (`fuse_gated_mlps`), so an FP8 layer adds little beyond its quantization passes to the bf16
layer's non-GEMM time (docs/benchmarks.md, 2026-12-02: FP8 layers quantize each input once). Experts in this
layout (transformers' FP8Experts) run in hsx.target.moe's grouped path (`fp8_experts_forward`), marked on the module
(`FP8_EXPERTS`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch

from hsx.errors import one_line
from hsx.target import fp8_gemm
from hsx.target.fp8 import BLOCK, FP8_DTYPE, Fp8Config
from hsx.target.fp8_gemm import (JIT_GEMMS, JIT_MIN_ROWS, Fp8Linear, backend_of, fp8_mm, fp8_quantize,
                                 fp8_silu_mul_quantize)

FP8_EXPERTS = "_hsx_fp8_experts"  # set on an experts module (hsx.target.moe.use_experts) whose e4m3 experts hsx runs
FP8_EXPERTS_RUN_ON = "_hsx_fp8_experts_run_on"  # set beside it: "triton" where both kernels passed their checks
BF16_REFERENCE = "_hsx_bf16_reference"  # set on such a module by `bf16_reference`: its experts run dequantized


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
        gemm = backend_of(dev) if dev.type == "cuda" else fp8_gemm._BACKEND.get(dev.index, "torch reference")
        how = f"hsx fp8 ({gemm})"
        if gemm != "torch reference":
            for m in mods:
                key = f"{m.out_features}x{m.in_features}"
                if key not in by_shape:
                    # (its check runs here if no batch ran it yet)
                    by_shape[key] = fp8_gemm._runs(m.weight, m.weight_scale_inv)
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
    if mods and how in {f"hsx fp8 ({g})" for g in JIT_GEMMS}:
        under = fp8_gemm._runs(mods[0].weight, mods[0].weight_scale_inv, JIT_MIN_ROWS - 1)
        out["gemm_under_rows"] = {"rows": JIT_MIN_ROWS, "gemm": under}
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
    (hsx.target.moe.use_experts puts hsx's grouped path there)."""
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
    and so do the experts hsx's FP8 path runs (`BF16_REFERENCE`, read by hsx.target.moe): the bf16 model the checkpoint
    was quantized from, up to the weights' rounding. Yields the number of modules switched (hsx.target.drift)."""
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
