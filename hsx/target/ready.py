"""The target model made ready for a job on this process: `ready_model` turns the job's target (hsx.target.model.Target)
and config into a loaded, prepared model and the report of the kernels it runs (`ReadyModel`).

Each choice takes the ones before it: the weights (or a caller's model, hsx bench's) → the experts implementation
→ the FP8 GEMM, or why the checkpoint runs otherwise → the kernel report (hsx.json's `run.kernels`) → packing →
the token budget (one for every rank of a copy) → compile → DeepGEMM's kernels for the budget's rows. Options a
recipe sets for every model that this one leaves unused are one line each, not a refusal: a recipe shared between
a dense and an MoE model, a bf16 and an FP8 one, stays usable for both.

hsx.job's Extraction runs the engine over what this returns; hsx.target.model loads and cuts the model,
hsx.target.prepare prepares it to run and reports its kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hsx.config import ExtractConfig, HsxError

if TYPE_CHECKING:
    from hsx.target.model import LoadedModel, Target
    from hsx.target.prepare import PreparedModel

CPU_TOKEN_BUDGET = 4096


@dataclass
class ReadyModel:
    """A model ready for the engine, and what was chosen for it."""
    loaded: LoadedModel
    prepared: PreparedModel  # packing, Gated DeltaNet kernels, the compile worker
    kernels: dict[str, Any]  # hsx.target.prepare.kernel_report's, with DeepGEMM's build when one ran
    budget: int  # tokens per forward, the same on every rank of a copy
    compile: bool
    fp8_gemm: str | None  # the GEMM FP8 linear layers run on (None: none run FP8 here)
    fp8_matmuls: bool  # the checkpoint is FP8 and runs FP8 matmuls on this device (the MFU's peak is e4m3's)
    owns_model: bool  # loaded here: the job's end finishes its compile (a caller's model outlives the job)


def ready_model(cfg: ExtractConfig, proc, target: Target, loaded: LoadedModel | None = None,
                log=print) -> ReadyModel:
    """`proc`: hsx.run's Process (its device, the copy's devices and ranks); `loaded`: a caller's model, used as
    it is (else `target`'s weights are loaded)."""
    import torch

    from hsx.cost import auto_token_budget, check_token_budget, memory_bytes
    from hsx.target import fp8, fp8_gemm, fp8_model
    from hsx.target.model import load_model
    from hsx.target.moe import has_experts, resolve_experts, use_experts
    from hsx.target.prepare import kernel_report, prepare_model, resolve_packing

    device = proc.device
    cuda = device.type == "cuda"
    owns_model = loaded is None
    # (an expert-parallel rank reads only its share of the experts: its memory is the replicated weights + its share)
    share = (proc.ep_size, proc.ep_group.rank) if proc.ep_size > 1 else None
    loaded = loaded or load_model(cfg, device, proc.devices, proc.distributed_config(), target, experts_share=share)
    use_experts(loaded.base, resolve_experts(cfg.experts_implementation, cuda))
    if proc.ep_size > 1:  # this rank keeps its share of the experts; tokens travel to the others' (all-to-all)
        from hsx.target.expert_parallel import shard_experts

        modules, local = shard_experts(loaded.base, proc.ep_group)
        log(f"hsx: --ep-size {proc.ep_size}: each rank holds {local} routed experts of each of {modules} "
            f"mixture-of-experts layers ({local * proc.ep_size} experts each"
            + ("; only its own read from the checkpoint" if owns_model else "") + "); each runs its own batches")
    quant = fp8.quantization_of(loaded.text_config)
    if cfg.experts_implementation != "auto" and not has_experts(loaded.base):
        log(f"hsx: --experts-implementation {cfg.experts_implementation} does not apply: {cfg.model} has no "
            "mixture-of-experts layers")
    if cfg.fp8_gemm != "auto" and quant is None:
        log(f"hsx: --fp8-gemm {cfg.fp8_gemm} does not apply: {cfg.model} is not an FP8 checkpoint (its linear "
            f"layers run in {cfg.dtype})")
    instead = fp8.runs_instead(quant, device) if quant is not None else None
    gemm = None
    if quant is not None and instead is None:
        gemm = fp8_gemm.use_gemm(device, cfg.fp8_gemm)  # before the report: hsx.json names the GEMM that runs
    blocker = fp8_model.transformers_fp8_blocker(loaded.base) if quant is not None else None
    if blocker:
        raise HsxError(blocker)
    kernels = kernel_report(loaded.base)
    if instead:
        log(instead)
    for line in kernels.get("fallbacks", {}).values():  # kernels not checked on this GPU (hsx.target.kernels)
        log(line)
    if kernels.get("linear_attention_forward") == "transformers":
        log(f"hsx: the Gated DeltaNet layers run on transformers' forward, right-padded, not packed "
            f"({kernels.get('linear_attention_note')}; kernels: {kernels.get('linear_attention')}, conv "
            f"{kernels.get('causal_conv1d')})")
    if kernels.get("attn_implementation") != kernels.get("attn_implementation_requested"):
        log(f"hsx: attention runs as {kernels.get('attn_implementation')!r} "
            f"({kernels.get('attn_implementation_requested')!r} is not available for this model)")
    packing, why_not = resolve_packing(loaded.base, cfg.packing, cuda,
                                       cfg.gpus_per_copy == 1 and cfg.tp_size == 1, cfg.attn_implementation)
    if why_not:
        log(f"hsx: batches run right-padded, not packed: {why_not}")
    values_per_token = target.format.values_per_token  # hidden states and the final-norm state
    if cfg.token_budget:
        budget = cfg.token_budget
        check_token_budget(loaded.text_config, values_per_token, budget, memory_bytes(device),
                           "this machine's memory" if device.type == "cpu" else f"GPU {device}")
    elif cuda:
        budget = auto_token_budget(loaded.text_config, values_per_token, torch.cuda.mem_get_info(device)[0],
                                   cfg.max_length, eager_attention=packing == "none"
                                   and kernels.get("attn_implementation") == "eager")
    else:
        budget = CPU_TOKEN_BUDGET
    # Tensor-parallel ranks must run identical batches: the smallest budget any of them can afford (as negative).
    budget = -proc.agree_max(-budget)
    if proc.ep_size > 1:  # an expert-parallel group's ranks run their forwards in lockstep: one budget for all
        budget = proc.ep_group.agree_min(budget)
    # Auto compile stays off for a copy spread over GPUs: accelerate's device hooks wrap each layer's forward.
    use_compile = cfg.compile == "on" or (cfg.compile == "auto" and cuda and cfg.gpus_per_copy == 1
                                          and cfg.tp_size == 1 and cfg.ep_size == 1)
    prepared = prepare_model(loaded.base, packing, compile_model=use_compile, cuda=cuda, log=log)
    if gemm is not None:  # (a JIT GEMM may run some shapes as the fallback of another device choice too)
        rows = max(budget, cfg.max_length or 0)
        for name, (shapes, products, seconds) in fp8_gemm.build_jit_kernels(loaded.base, rows).items():
            kernels[f"{name}_build"] = {"weight_shapes": shapes, "rows": [fp8_gemm.JIT_MIN_ROWS, rows],
                                        "products": products, "seconds": round(seconds, 1)}
            who, cache = fp8_gemm.JIT_GEMMS[name]
            log(f"hsx: {who}'s kernels for {shapes} weight shapes at {fp8_gemm.JIT_MIN_ROWS:,}-{rows:,} "
                + (f"rows ready in {seconds:.1f} s ({products} products; the kernels it compiled stay in "
                   f"{cache})" if products else "rows: built earlier in this process"))
    return ReadyModel(loaded, prepared, kernels, budget, use_compile, gemm,
                      fp8_matmuls=quant is not None and not instead, owns_model=owns_model)
