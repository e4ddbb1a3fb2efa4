"""What a job costs before it runs: weights, activation memory per token, token budget, GPUs, FLOPs, disk, time.

`hsx plan` prints it and `hsx.plan()` returns it (both through `job_plan`); `hsx extract` uses the same numbers
for its token budget and the MFU in its progress bar, and `hsx bench` for MFU. Model shapes that benchmarks and
offline planning need ship here (facts from the models' config.json files, `SHAPES`, reachable by Hub id through
`HUB_SHAPES`), so planning a recipe never needs the Hub; nor does it need the data (`DATASET_SIZES`, or
`--tokens`).

FLOPs count real tokens only: 2 × (matmul parameters of the decoder layers run) per token, with mixture-of-experts
layers counting the router and the ACTIVE experts only, plus causal attention, 2·L²·d_attn per full-attention
layer per sequence of length L (sliding-window layers: the pairs inside the window). Linear-attention layers
(Gated DeltaNet) count their projections and convolution; their recurrent/chunked state work is left out (under
1% of a Qwen3.6-27B layer's matmuls). Weights count every expert. Norms, biases and rotary tables are left out.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import time
from pathlib import Path
from typing import Any

import numpy as np

from hsx.errors import HsxError, check_range
from hsx.schema import DEFAULT_STORAGE_DTYPE, SCALED_DTYPE, OutputFormat, human_bytes

ARROW_MAX_VALUES = 2**31 - 1  # per record batch and per sample (ArrowCapacityError / offset overflow beyond)
DEFAULT_BUDGET_CAP = 16384  # the fastest budget measured at the 8B shape (docs/benchmarks.md, "Figures moved")
# Rows per expert GEMM (a batch's tokens × k / experts) that MoE budgets give at least: past ~1k rows the grouped
# GEMMs gain little, and larger batches slowed the writer (docs/benchmarks.md, "Figures moved" and 2026-11-30).
MOE_TOKENS_PER_EXPERT = 1024
GPU_HEADROOM = 0.9  # of a GPU's memory a model copy may plan on; the CUDA context, cuBLAS and compile take the rest
NODE_GPUS = 8  # GPUs per node, for the per-node time and launch line
# GPUs a plan can be made for (`hsx plan --gpu`; the machine running the plan needs none): NVIDIA's datasheet dense
# (not 2:4-sparse) tensor-core rates, bf16 and e4m3 (fp8_matmul_tflops: None, no FP8 tensor cores, an FP8 checkpoint
# runs dequantized), the memory (the datasheet's; the H200's as torch sees it, GPU_HEADROOM covers the rest), and the
# compute capability (hsx.target.kernels: which kernels run there). Every GPU's rates are on one basis, the datasheet's:
# a plan scales each by the share of its datasheet peak a matmul reached where hsx measured it (MEASURED_MATMUL),
# so no GPU is planned at its peak beside another at its measured rate.
GPUS: dict[str, dict[str, Any]] = {
    "h200": {"matmul_tflops": 989.0, "fp8_matmul_tflops": 1979.0, "memory_gib": 139.0, "capability": (9, 0)},
    "h100-sxm": {"matmul_tflops": 989.0, "fp8_matmul_tflops": 1979.0, "memory_gib": 80.0, "capability": (9, 0)},
    "h100-pcie": {"matmul_tflops": 756.0, "fp8_matmul_tflops": 1513.0, "memory_gib": 80.0, "capability": (9, 0)},
    "a100-40gb": {"matmul_tflops": 312.0, "fp8_matmul_tflops": None, "memory_gib": 40.0, "capability": (8, 0)},
    "a100-80gb": {"matmul_tflops": 312.0, "fp8_matmul_tflops": None, "memory_gib": 80.0, "capability": (8, 0)},
    "l40s": {"matmul_tflops": 362.0, "fp8_matmul_tflops": 733.0, "memory_gib": 48.0, "capability": (8, 9)},
    "b200": {"matmul_tflops": 2250.0, "fp8_matmul_tflops": 4500.0, "memory_gib": 180.0, "capability": (10, 0)},
    # RTX PRO 6000 Blackwell (Workstation and Server Edition, 96 GB GDDR7): its datasheet gives 4,000 "AI TOPS"
    # (FP4, 2:4 sparse), i.e. 1,000 FP8 and 500 bf16 dense at the halving per format the others' datasheets show
    "rtx-pro-6000": {"matmul_tflops": 500.0, "fp8_matmul_tflops": 1000.0, "memory_gib": 96.0, "capability": (12, 0)},
}
# The matmul rates hsx measured (`hsx bench`, 8192³, in each run: docs/benchmarks.md), on the one GPU kind measured;
# the plan's MFUs (PLAN_MFU*, MEASURED_MFU) are shares of these.
MEASURED_ON = "h200"
MEASURED_MATMUL = {"matmul_tflops": 790.0, "fp8_matmul_tflops": 1419.0}


def planned_tflops(gpu: str, key: str = "matmul_tflops") -> float | None:
    """The matmul rate a plan gives `gpu` (`key`: "matmul_tflops", bf16, or "fp8_matmul_tflops"): its datasheet
    rate × the share of the datasheet a matmul reached on the GPU hsx measured (MEASURED_ON); that GPU's own rate
    is then exactly the one measured."""
    datasheet = GPUS[gpu][key]
    return None if datasheet is None else datasheet * MEASURED_MATMUL[key] / GPUS[MEASURED_ON][key]


def rate_basis(gpu: str, key: str = "matmul_tflops") -> str:
    """How `planned_tflops` came to its rate, in words (`hsx plan` prints it)."""
    what = "bf16" if key == "matmul_tflops" else "FP8"
    measured, datasheet = MEASURED_MATMUL[key], GPUS[MEASURED_ON][key]
    share, on = f"{measured / datasheet:.2f}", MEASURED_ON.upper()
    if gpu == MEASURED_ON:
        return (f"{what} matmul {measured:.0f} TFLOP/s, measured: {share} of its datasheet {datasheet:.0f}; every "
                "GPU is planned at that share of its datasheet rate")
    return (f"{what} matmul {planned_tflops(gpu, key):.0f} TFLOP/s: its datasheet {GPUS[gpu][key]:.0f} × {share}, the "
            f"share of the datasheet rate a matmul reached on the {on} ({measured:.0f} of {datasheet:.0f}); "
            f"not measured on this GPU")


FP8_SUFFIX = "-fp8"  # `--shape NAME-fp8`: a shape with its official FP8 checkpoint's quantization_config
DEFAULT_GPU = "h200"
PLAN_MFU = 0.70  # the rate a plan assumes: at or under the dense shapes' measured end-to-end MFU (README's table)
PLAN_MFU_MOE = 0.40  # mixture of experts (active parameters): under the MoE shapes' measured MFU (README's table),
# for the shapes not measured (other widths, experts and head layouts)
# The fastest the writer has stored states, per process, into tmpfs (docs/benchmarks.md: "the writer and the
# output's filesystem", and session 13). A plan's rate is never more than this many bytes per second of output: a
# small model's FLOPs would otherwise promise hundreds of GB/s of writes.
WRITER_BYTES_PER_S = 4.79e9
PLAN_MFU_FP8 = 0.48  # FP8 checkpoints, of the FP8 matmul rate: under the dense FP8 shapes' measured MFU on cuBLAS
# (docs/benchmarks.md, 2026-12-02 and 2026-12-02 (later))
# FP8 mixtures of experts, of the FP8 matmul rate: planned at the bf16 MoE rate (PLAN_MFU_MOE × MEASURED_MATMUL's bf16
# / FP8 rates), as the FP8 experts measured no faster than the bf16 checkpoint (docs/benchmarks.md, 2026-12-02 (later))
PLAN_MFU_MOE_FP8 = 0.22
DEFAULT_MEAN_TOKENS = 354  # tokens per row when only the row count is known: hsx bench's chat-like mean
GATED_QUERY_MODEL_TYPES = {"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}  # q_proj also makes the output gate

# Facts from each model's config.json (random weights built from these are the benchmark subjects).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                 max_position_embeddings=4096, tie_word_embeddings=True),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192),
                         tie_word_embeddings=False),
    "qwen3-32b": dict(model_type="qwen3", hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                      max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=False),
    "llama-3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                        tie_word_embeddings=False),
    # Qwen3.6-27B (config.json: model_type qwen3_5, a VLM; this is its text_config, which hsx runs; Qwen3.5-27B
    # has the same text shape). 16 × [Gated DeltaNet ×3, gated full attention ×1]; the MTP layer is not run.
    "qwen3.6-27b": dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, head_dim=256, vocab_size=248320,
                        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_conv_kernel_dim=4,
                        layer_types=[("full_attention" if i % 4 == 3 else "linear_attention") for i in range(64)],
                        max_position_embeddings=262144, rms_norm_eps=1e-6,
                        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                                             mrope_section=[11, 11, 10], mrope_interleaved=True),
                        tie_word_embeddings=False),
    # Qwen3-30B-A3B: 128 experts of width 768, 8 routed per token, every layer (3.3B of 30.5B parameters active).
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                          max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                          tie_word_embeddings=False),
    # GPT-OSS-20B: 32 experts of width 2880 (with biases, clamped SwiGLU), 4 per token; attention with sinks and
    # biases, sliding window 128 on even layers, full on odd ones; YaRN rope. The checkpoint stores the experts in
    # MXFP4; this shape (and hsx's forward) runs them in bf16.
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                        num_local_experts=32, num_experts_per_tok=4, sliding_window=128, attention_bias=True,
                        layer_types=[("sliding_attention" if i % 2 == 0 else "full_attention") for i in range(24)],
                        max_position_embeddings=131072, rms_norm_eps=1e-5, swiglu_limit=7.0,
                        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                             beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
                        tie_word_embeddings=False),
    # Qwen3.6-35B-A3B (config.json: model_type qwen3_5_moe, a VLM; this is its text_config; Qwen3.5-35B-A3B has
    # the same text shape): 10 × [Gated DeltaNet ×3, gated full attention ×1], every layer 256 experts of width 512,
    # 8 routed per token, plus a shared expert of width 512 behind a sigmoid gate; the MTP layer is not run.
    "qwen3.6-35b-a3b": dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
                            num_attention_heads=16, num_key_value_heads=2, head_dim=256, vocab_size=248320,
                            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                            linear_value_head_dim=128, linear_conv_kernel_dim=4,
                            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512,
                            layer_types=[("full_attention" if i % 4 == 3 else "linear_attention") for i in range(40)],
                            max_position_embeddings=262144, rms_norm_eps=1e-6,
                            rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                                                 partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
                                                 mrope_interleaved=True),
                            tie_word_embeddings=False),
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                            num_attention_heads=64, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
                            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                            max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                            tie_word_embeddings=False),
    # Frontier mixtures of experts (config.json of each official checkpoint; the MTP layers the checkpoints add,
    # num_nextn_predict_layers, are not run). DeepSeek-V3 (and R1, V3-0324, V3.1: one shape): MLA, 3 dense layers,
    # then 256 routed experts of width 2048 (8 per token) and one shared; its checkpoint is block-FP8 (NAME-fp8).
    "deepseek-v3": dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                        num_attention_heads=128, num_key_value_heads=128, vocab_size=129280,
                        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                        moe_intermediate_size=2048, first_k_dense_replace=3, moe_layer_freq=1, n_group=8,
                        topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=163840,
                        rms_norm_eps=1e-6, rope_scaling=dict(type="yarn", factor=40, beta_fast=32, beta_slow=1,
                                                             mscale=1.0, mscale_all_dim=1.0,
                                                             original_max_position_embeddings=4096),
                        rope_theta=10000, tie_word_embeddings=False),
    # Kimi-K2 (Instruct, Base; K2.5's text model): DeepSeek-V3's architecture with 64 heads, 384 experts, one dense
    # layer; block-FP8 checkpoint.
    "kimi-k2": dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                    num_attention_heads=64, num_key_value_heads=64, vocab_size=163840,
                    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=2048,
                    first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1,
                    routed_scaling_factor=2.827, norm_topk_prob=True, max_position_embeddings=131072,
                    rms_norm_eps=1e-6, rope_scaling=dict(type="yarn", factor=32.0, beta_fast=1.0, beta_slow=1.0,
                                                         mscale=1.0, mscale_all_dim=1.0,
                                                         original_max_position_embeddings=4096),
                    rope_theta=50000.0, tie_word_embeddings=False),
    # GLM-4.5: grouped-query attention (96 heads, 8 kv, biases, half-rotary), 3 dense layers, then 160 experts of
    # width 1536 (8 per token) and one shared; bf16 checkpoint and an official FP8 one.
    "glm-4.5": dict(model_type="glm4_moe", hidden_size=5120, intermediate_size=12288, num_hidden_layers=92,
                    num_attention_heads=96, num_key_value_heads=8, head_dim=128, vocab_size=151552,
                    attention_bias=True, partial_rotary_factor=0.5, use_qk_norm=False,
                    n_routed_experts=160, n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=1536,
                    first_k_dense_replace=3, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                    norm_topk_prob=True, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1000000,
                    tie_word_embeddings=False),
    # GLM-5 (transformers' glm_moe_dsa, whose defaults are this checkpoint's): MLA with DeepSeek sparse attention's
    # indexer, 3 dense layers, then 256 experts of width 2048 (8 per token) and one shared.
    "glm-5": dict(model_type="glm_moe_dsa", hidden_size=6144, intermediate_size=12288, num_hidden_layers=78,
                  num_attention_heads=64, num_key_value_heads=64, vocab_size=154880, q_lora_rank=2048,
                  kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32,
                  index_head_dim=128, index_topk=2048, n_routed_experts=256, n_shared_experts=1,
                  num_experts_per_tok=8, moe_intermediate_size=2048, first_k_dense_replace=3, n_group=1,
                  topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=202752,
                  rms_norm_eps=1e-5, tie_word_embeddings=False),
}

# End-to-end MFU that `hsx bench --shape NAME` measured (default flags, output to tmpfs; the runs are in
# docs/benchmarks.md, the README's table sums them up): `hsx plan` uses it for that shape instead of PLAN_MFU. Where
# VMs differ, rounded down from the lower median; FP8 shapes of the FP8 matmul rate on cuBLAS's GEMM (hsx's
# default without DeepGEMM installed: DeepGEMM's faster runs are not planned on).
MEASURED_MFU: dict[str, float] = {"qwen3.6-27b": 0.72, "qwen3-30b-a3b": 0.46, "gpt-oss-20b": 0.52,
                                  "qwen3.6-35b-a3b": 0.45, "qwen3-8b-fp8": 0.53, "qwen3.6-27b-fp8": 0.55,
                                  "qwen3-30b-a3b-fp8": 0.24}

# Hub model ids whose shape ships here: `hsx plan --model ID` (or a recipe naming it) plans offline.
HUB_SHAPES: dict[str, str] = {
    "Qwen/Qwen3-8B": "qwen3-8b",
    "Qwen/Qwen3-8B-FP8": "qwen3-8b-fp8",
    "Qwen/Qwen3.5-27B-FP8": "qwen3.6-27b-fp8",
    "Qwen/Qwen3.6-27B-FP8": "qwen3.6-27b-fp8",
    "Qwen/Qwen3-32B": "qwen3-32b",
    "Qwen/Qwen3.5-27B": "qwen3.6-27b",
    "Qwen/Qwen3.6-27B": "qwen3.6-27b",
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b",
    "Qwen/Qwen3-30B-A3B-Base": "qwen3-30b-a3b",
    "Qwen/Qwen3-235B-A22B": "qwen3-235b-a22b",
    "Qwen/Qwen3-235B-A22B-Instruct-2507": "qwen3-235b-a22b",
    "Qwen/Qwen3-235B-A22B-FP8": "qwen3-235b-a22b-fp8",
    "deepseek-ai/DeepSeek-V3": "deepseek-v3-fp8",
    "deepseek-ai/DeepSeek-V3-0324": "deepseek-v3-fp8",
    "deepseek-ai/DeepSeek-V3.1": "deepseek-v3-fp8",
    "deepseek-ai/DeepSeek-R1": "deepseek-v3-fp8",
    "deepseek-ai/DeepSeek-R1-0528": "deepseek-v3-fp8",
    "moonshotai/Kimi-K2-Instruct": "kimi-k2-fp8",
    "moonshotai/Kimi-K2-Instruct-0905": "kimi-k2-fp8",
    "moonshotai/Kimi-K2-Base": "kimi-k2-fp8",
    "zai-org/GLM-4.5": "glm-4.5",
    "zai-org/GLM-4.5-FP8": "glm-4.5-fp8",
    "zai-org/GLM-5": "glm-5",
    "zai-org/GLM-5-FP8": "glm-5-fp8",
    "Qwen/Qwen3.5-35B-A3B": "qwen3.6-35b-a3b",
    "Qwen/Qwen3.6-35B-A3B": "qwen3.6-35b-a3b",
    "openai/gpt-oss-20b": "gpt-oss-20b",
    "meta-llama/Llama-3.1-8B": "llama-3.1-8b",
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "meta-llama/Meta-Llama-3-70B": "llama-3-70b",
    "meta-llama/Meta-Llama-3-70B-Instruct": "llama-3-70b",
}

# Public chat datasets whose size ships here, so a recipe's disk and time can be planned without the data:
# (Hub id, split) -> (rows, mean tokens per row with a chat template applied). Rows are from the dataset card;
# tokens are an ESTIMATE (the split's text bytes from the card / ~4.3 bytes per token of the Llama-3 and Qwen
# tokenizers, + template tokens; expect ±15%). `--tokens` overrides; hsx.json's tokens_written is the truth.
DATASET_SIZES: dict[tuple[str, str], tuple[int, int]] = {
    ("HuggingFaceH4/ultrachat_200k", "train_sft"): (207_865, 1_500),  # 1.40 GB of text, ~6.7 kB per row
    ("HuggingFaceH4/ultrachat_200k", "test_sft"): (23_110, 1_500),
}


def shape_config(name: str):
    """A transformers config for a named shape (a `SHAPES` key, or a Hub id in `HUB_SHAPES`)."""
    from transformers import AutoConfig

    from hsx.config import HsxError

    key = HUB_SHAPES.get(name, name)
    fp8 = key.endswith(FP8_SUFFIX) and key.removesuffix(FP8_SUFFIX) in SHAPES
    if key not in SHAPES and not fp8:
        raise HsxError(f"unknown shape {name!r}; known: {', '.join(SHAPES)} (each also as NAME{FP8_SUFFIX}: its "
                       f"official FP8 checkpoint's layout), or the Hub ids {', '.join(HUB_SHAPES)}")
    facts = dict(SHAPES[key.removesuffix(FP8_SUFFIX) if fp8 else key])
    if fp8:
        from hsx.target.fp8 import CHECKPOINT_QUANTIZATION

        facts["quantization_config"] = dict(CHECKPOINT_QUANTIZATION)
    return AutoConfig.for_model(facts.pop("model_type"), **facts)


def is_fp8(c) -> bool:
    """Whether a model config declares fp8 block quantization (its linear layers' weights are 1 byte, and run on
    the FP8 matmul rate)."""
    from hsx.target.fp8 import quant_method_of  # (the spelling hsx extract accepts: "FP8" is refused there)

    q = getattr(c, "quantization_config", None)
    d = q if isinstance(q, dict) else (q.to_dict() if hasattr(q, "to_dict") else {})
    return isinstance(d, dict) and quant_method_of(d) == "fp8"


# ---- compute ------------------------------------------------------------------------------------------------

def _head_dim(c) -> int:
    return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)


def layer_types(c) -> list[str]:
    """Each decoder layer's kind: full_attention (the default), sliding_attention or linear_attention."""
    n = int(c.num_hidden_layers)
    kinds = getattr(c, "layer_types", None)
    return list(kinds[:n]) if isinstance(kinds, (list, tuple)) and len(kinds) >= n else ["full_attention"] * n


def _num_experts(c) -> int:
    return int(getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
               or getattr(c, "n_routed_experts", None) or 0)


def _is_moe_layer(c, i: int) -> bool:
    """Qwen-MoE / Mixtral rule: every `decoder_sparse_step`-th layer routes, except `mlp_only_layers`; DeepSeek /
    GLM rule: `mlp_layer_types` where given, else the layers from `first_k_dense_replace` on (`_deepseek_moe_layer`)."""
    if not _num_experts(c) or not getattr(c, "num_experts_per_tok", None):
        return False
    if _deepseek_moe_layer(c, i) is not None:
        return _deepseek_moe_layer(c, i)
    if i in (getattr(c, "mlp_only_layers", None) or []):
        return False
    return (i + 1) % int(getattr(c, "decoder_sparse_step", None) or 1) == 0


def _attention_params(c, kind: str) -> int:
    h = int(c.hidden_size)
    if _is_mla(c):
        return _mla_params(c)
    if kind == "linear_attention":  # Gated DeltaNet: in_proj_qkv, in_proj_z, in_proj_a/b, depthwise conv, out_proj
        kd = int(c.linear_num_key_heads) * int(c.linear_key_head_dim)
        vd = int(c.linear_num_value_heads) * int(c.linear_value_head_dim)
        conv = 2 * kd + vd
        return h * (conv + vd + 2 * int(c.linear_num_value_heads)) + conv * int(c.linear_conv_kernel_dim) + vd * h
    hd = _head_dim(c)
    q, kv = int(c.num_attention_heads) * hd, int(c.num_key_value_heads) * hd
    gate = 2 if getattr(c, "model_type", "") in GATED_QUERY_MODEL_TYPES else 1
    return h * q * gate + 2 * h * kv + q * h


def _mlp_params(c, i: int, active: bool) -> int:
    h = int(c.hidden_size)
    if not _is_moe_layer(c, i):
        return 3 * h * int(c.intermediate_size)
    e, k = _num_experts(c), int(c.num_experts_per_tok)
    m = int(getattr(c, "moe_intermediate_size", None) or c.intermediate_size)
    shared = int(getattr(c, "shared_expert_intermediate_size", None) or 0)
    if not shared and getattr(c, "n_shared_experts", None):  # DeepSeek / GLM: n_shared × the expert width, no gate
        return h * e + 3 * h * m * (k if active else e) + 3 * h * m * int(c.n_shared_experts)
    return h * e + 3 * h * m * (k if active else e) + (3 * h * shared + h if shared else 0)


def decoder_layer_params(c, i: int, active: bool = True) -> int:
    """Matmul parameters of decoder layer i: those a token goes through (`active`: routed experts only), or all
    of them (the weights)."""
    return _attention_params(c, layer_types(c)[i]) + _mlp_params(c, i, active)


def layer_params(c, depth: int | None = None) -> int:
    """Matmul parameters a token goes through per decoder layer, averaged over the first `depth` layers (all by
    default): exact for uniform dense models; for hybrid and MoE models `depth × layer_params(c, depth)` is the
    per-token count of running those layers (active experts only)."""
    d = depth or int(c.num_hidden_layers)
    return round(sum(decoder_layer_params(c, i) for i in range(d)) / d)


def attention_flops(c, depth: int, lengths: np.ndarray) -> float:
    """The length-dependent attention FLOPs (scores and weighted values) of `depth` layers over these sequences."""
    lengths = np.asarray(lengths, dtype=np.float64)
    d_attn = int(c.num_attention_heads) * _head_dim(c)
    kinds = layer_types(c)[:depth]
    if _is_mla(c):  # scores over the q/k head width, values over v_head_dim
        d_attn = int(c.num_attention_heads) * (_mla_qk_head_dim(c) + int(c.v_head_dim)) // 2
    full = kinds.count("full_attention") + kinds.count("indexed_attention")  # DSA counted as full (an upper bound)
    total = 2.0 * d_attn * float((lengths**2).sum()) * full
    window = getattr(c, "sliding_window", None)
    if kinds.count("sliding_attention"):
        w = float(window) if window else math.inf
        pairs = np.where(lengths <= w, lengths**2 / 2, w * lengths - w * w / 2)
        total += 4.0 * d_attn * float(pairs.sum()) * kinds.count("sliding_attention")
    return total


def flops(c, depth: int, lengths: np.ndarray, layer_param_count: int | None = None) -> float:
    """FLOPs of running `depth` decoder layers over sequences of these lengths (real tokens only).
    `layer_param_count`: the per-layer mean from `layer_params`, precomputed (the progress bar calls this often)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    per_layer = layer_param_count if layer_param_count is not None else layer_params(c, depth)
    return 2.0 * depth * per_layer * float(lengths.sum()) + attention_flops(c, depth, lengths)


def measure_matmul_tflops(device, size: int | None = None, repeats: int = 20, fp8: bool = False) -> float:
    """The bf16 (CPU: float32) dense matmul rate of this device, measured now, in TFLOP/s; with `fp8` (CUDA), the
    e4m3 rate (`torch._scaled_mm`, tensor-wise scales, bf16 out): the FP8 peak FP8 targets' MFU is taken against."""
    import torch

    cuda = device.type == "cuda"
    n = size or (8192 if cuda else 1024)
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    if fp8 and cuda:
        one = torch.ones((), device=device)
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b column-major, as cuBLAS wants
        matmul = lambda x, y: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa
    else:
        matmul = torch.matmul
    return 2 * n**3 / best_seconds(lambda: matmul(a, b), device, repeats if cuda else 3) / 1e12


def best_seconds(fn, device, repeats: int = 20) -> float:
    """Seconds per call of `fn`: after 3 warm-up calls, the best of 3 rounds of `repeats` calls (CUDA synchronized
    around each round)."""
    import torch

    cuda = device.type == "cuda"
    for _ in range(3):
        fn()
    best = math.inf
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best


# ---- memory and disk ----------------------------------------------------------------------------------------

def _transient_values(c, i: int) -> int:
    """Values per token alive while decoder layer i runs its attention or its MLP stage (the larger one)."""
    h, kind = int(c.hidden_size), layer_types(c)[i]
    if kind == "linear_attention":
        from hsx.target.gdn import FLA_CHUNK  # here: `import hsx` loads this module, and gdn loads torch

        kd = int(c.linear_num_key_heads) * int(c.linear_key_head_dim)
        hv, dv = int(c.linear_num_value_heads), int(c.linear_value_head_dim)
        conv = 2 * kd + hv * dv
        # qkv before and after the conv, z, a/b, the core output, and the per-chunk states spread over the chunk
        attn = 2 * conv + 2 * hv * dv + 2 * hv + hv * int(c.linear_key_head_dim) * dv // FLA_CHUNK + h
    elif _is_mla(c):
        attn = _mla_transient_values(c)
    else:
        hd = _head_dim(c)
        q, kv = int(c.num_attention_heads) * hd, int(c.num_key_value_heads) * hd
        gate = 2 if getattr(c, "model_type", "") in GATED_QUERY_MODEL_TYPES else 1
        attn = q * gate + 2 * kv + q + h
    if _is_moe_layer(c, i):  # each token is copied to its k experts: input, gate/up, activation, output
        k, e = int(c.num_experts_per_tok), _num_experts(c)
        m = int(getattr(c, "moe_intermediate_size", None) or c.intermediate_size)
        mlp = k * (2 * h + 3 * m) + 2 * e  # router logits in float32
        if getattr(c, "n_shared_experts", None):  # the shared expert's gate/up and activation
            mlp += 3 * m * int(c.n_shared_experts)
    else:
        mlp = 3 * int(c.intermediate_size) + h
    return max(attn, mlp)


def activation_bytes_per_token(c, stored_values_per_token: int, dtype_bytes: int = 2) -> int:
    """Peak GPU bytes per token in a batch: the largest layer's transient activations plus the captured outputs
    (held until the batch ends) and the gathered copy. A 1.5× margin covers allocator fragmentation."""
    h = int(c.hidden_size)
    transient = max(_transient_values(c, i) for i in range(int(c.num_hidden_layers))) + 3 * h  # + residual/norm
    return int(1.5 * dtype_bytes * (transient + 2 * stored_values_per_token))


def auto_token_budget(c, stored_values_per_token: int, free_bytes: int, max_length: int,
                      eager_attention: bool = False) -> int:
    """The smaller of the fastest measured budget and what free memory allows (never below one full row).

    Eager attention (GPT-OSS has no SDPA path) materializes the scores: heads × L float32 per token of a row
    of length L, counted at max_length (flash/SDPA kernels keep them on chip)."""
    per_token = activation_bytes_per_token(c, stored_values_per_token)
    if eager_attention:
        per_token += 4 * int(c.num_attention_heads) * max_length
    fits = int(0.8 * free_bytes) // per_token
    budget = min(budget_cap(c), fits)
    return max(budget, max_length)


def memory_bytes(device) -> int:
    """The memory a batch lives in: the GPU's total, or the host's physical memory for a CPU run."""
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[1])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_token_budget(c, stored_values_per_token: int, token_budget: int, memory: int, where: str) -> None:
    """HsxError (one line) for a --token-budget whose batch cannot fit in `memory` bytes at all (by
    activation_bytes_per_token, the estimate auto_token_budget sizes batches with), before anything allocates."""
    need = activation_bytes_per_token(c, stored_values_per_token) * token_budget
    if need > memory:
        gib = 1 << 30
        raise HsxError(f"--token-budget {token_budget:,}: a batch needs about {need / gib:,.1f} GiB, more than the "
                       f"{memory / gib:,.1f} GiB of {where}; give a smaller one, or leave it unset for one that fits")


def budget_cap(c) -> int:
    """The fastest budget: DEFAULT_BUDGET_CAP, or for a mixture of experts the batch that gives each expert
    MOE_TOKENS_PER_EXPERT rows on average (tokens × k / experts): an expert's GEMM is only as large as its share of
    the batch (Qwen3-30B-A3B, 8 of 128 experts: 1,024 rows at 16k tokens; 2,048 at 32k)."""
    routed = [i for i in range(int(c.num_hidden_layers)) if _is_moe_layer(c, i)]
    if not routed:
        return DEFAULT_BUDGET_CAP
    return max(DEFAULT_BUDGET_CAP, MOE_TOKENS_PER_EXPERT * _num_experts(c) // int(c.num_experts_per_tok))


def weight_bytes(c, depth: int, dtype_bytes: int = 2, lm_head: bool = False) -> int:
    """The weights hsx loads: the first `depth` decoder layers (every expert) and the embeddings; lm_head only for
    top-k logits or the teacher policy (`lm_head`), and only when it is not the embedding itself.
    FP8 checkpoints: the layers at 1 byte a weight (their scales and bf16 norms are well under 1%)."""
    layers = sum(decoder_layer_params(c, i, active=False) for i in range(depth))
    tables = 2 if lm_head and not getattr(c, "tie_word_embeddings", False) else 1
    return (1 if is_fp8(c) else dtype_bytes) * layers + tables * dtype_bytes * int(c.vocab_size) * int(c.hidden_size)


def gpus_per_copy(weights: int, activation_per_token: int, min_batch_tokens: int, gpu_bytes: int,
                  node_gpus: int = NODE_GPUS) -> int | None:
    """GPUs one model copy needs (1, 2, 4, ... up to a node): its share of the weights plus a batch of
    `min_batch_tokens` within GPU_HEADROOM of each GPU. None: more than a node."""
    g = 1
    while g <= node_gpus:
        if weights / g + activation_per_token * min_batch_tokens <= GPU_HEADROOM * gpu_bytes:
            return g
        g *= 2
    return None


# ---- frontier mixtures of experts: MLA, DeepSeek/GLM layer rules, experts sharded over GPUs ------------------

def _is_mla(c) -> bool:
    """Multi-head latent attention (DeepSeek-V3, Kimi-K2, GLM-5): queries and keys/values through low-rank
    projections (`kv_lora_rank`)."""
    return bool(getattr(c, "kv_lora_rank", None))


def _mla_qk_head_dim(c) -> int:
    return int(c.qk_nope_head_dim) + int(c.qk_rope_head_dim)


def _mla_params(c) -> int:
    """MLA's matrices: q (through q_lora_rank where set), the joint kv down-projection with the rotary key, kv up,
    the output; GLM-5's sparse-attention indexer (its query, key and head weights) where the config has one."""
    h, heads, qk = int(c.hidden_size), int(c.num_attention_heads), _mla_qk_head_dim(c)
    q_rank, kv_rank = getattr(c, "q_lora_rank", None), int(c.kv_lora_rank)
    q = h * int(q_rank) + int(q_rank) * heads * qk if q_rank else h * heads * qk
    kv = h * (kv_rank + int(c.qk_rope_head_dim)) + kv_rank * heads * (int(c.qk_nope_head_dim) + int(c.v_head_dim))
    out = heads * int(c.v_head_dim) * h
    indexer = 0
    if getattr(c, "index_n_heads", None) and q_rank:
        ih, idim = int(c.index_n_heads), int(c.index_head_dim)
        indexer = int(q_rank) * ih * idim + h * idim + h * ih
    return q + kv + out + indexer


def _mla_transient_values(c) -> int:
    """Values per token alive in an MLA layer: q, the compressed kv, the expanded keys and values, the output."""
    heads, qk, v = int(c.num_attention_heads), _mla_qk_head_dim(c), int(c.v_head_dim)
    q_rank = int(getattr(c, "q_lora_rank", None) or 0)
    compressed = q_rank + int(c.kv_lora_rank) + int(c.qk_rope_head_dim)
    return compressed + heads * qk * 2 + heads * v * 2 + int(c.hidden_size)


def _deepseek_moe_layer(c, i: int) -> bool | None:
    """DeepSeek-V3 / Kimi-K2 / GLM-4.5 / GLM-5's rule (None for a config without one): `mlp_layer_types`
    ("sparse") where the config lists them, else layer i >= `first_k_dense_replace` and i % `moe_layer_freq` == 0."""
    kinds = getattr(c, "mlp_layer_types", None)
    if isinstance(kinds, (list, tuple)) and len(kinds) > i:
        return kinds[i] == "sparse"
    first = getattr(c, "first_k_dense_replace", None)
    if first is None:
        return None
    freq = getattr(c, "moe_layer_freq", None)
    return i >= int(first) and (not isinstance(freq, int) or freq <= 1 or i % freq == 0)


def _routed_params(c, i: int) -> int:
    """Decoder layer i's routed experts (every one of them): what expert parallelism shards."""
    if not _is_moe_layer(c, i):
        return 0
    m = int(getattr(c, "moe_intermediate_size", None) or c.intermediate_size)
    return 3 * int(c.hidden_size) * m * _num_experts(c)


def _fp8_scale_bytes(params: int) -> int:
    """Block-FP8's float32 scale per 128×128 block of a weight (1/4,096 of its bytes)."""
    from hsx.target.fp8 import BLOCK

    return 4 * -(-params // (BLOCK * BLOCK))


EP_SIZES = (1, 2, 4, 8)  # ranks of an expert-parallel group within one node


def expert_split_bytes(c, depth: int, fp8: bool | None = None, dtype_bytes: int = 2) -> dict[str, int]:
    """The weights of the first `depth` layers + embeddings split as expert parallelism places them: `routed` (the
    routed experts, sharded over the group's GPUs) and `replicated` (embeddings, attention, dense MLPs, shared
    experts, routers, norms: whole on every GPU). `fp8` (default: what the config declares): linear layers at one
    byte plus their block scales, routers, norms and embeddings at `dtype_bytes`, as the official FP8 checkpoints
    store them."""
    fp8 = is_fp8(c) if fp8 is None else fp8
    h = int(c.hidden_size)
    routed = sum(_routed_params(c, i) for i in range(depth))
    router = h * _num_experts(c) * sum(_is_moe_layer(c, i) for i in range(depth))
    other = sum(decoder_layer_params(c, i, active=False) for i in range(depth)) - routed - router
    norms = depth * 2 * h + (depth * (int(getattr(c, "q_lora_rank", None) or 0) + int(c.kv_lora_rank))
                             if _is_mla(c) else 0)
    embeddings = int(c.vocab_size) * h
    if fp8:
        return {"routed": routed + _fp8_scale_bytes(routed),
                "replicated": other + _fp8_scale_bytes(other) + dtype_bytes * (router + norms + embeddings)}
    return {"routed": dtype_bytes * routed, "replicated": dtype_bytes * (other + router + norms + embeddings)}


def expert_parallel_gpu_bytes(split: dict[str, int], ep_size: int) -> int:
    """One GPU's weights when the routed experts are sharded over `ep_size` GPUs and the rest is replicated."""
    return split["replicated"] + -(-split["routed"] // ep_size)


def expert_parallel_size(split: dict[str, int], batch_bytes: int, gpu_bytes: int,
                         sizes: tuple[int, ...] = EP_SIZES) -> int | None:
    """The fewest GPUs of a node whose group holds the weights and a batch on each GPU (GPU_HEADROOM of each);
    None: no group of one node does."""
    for n in sizes:
        if expert_parallel_gpu_bytes(split, n) + batch_bytes <= GPU_HEADROOM * gpu_bytes:
            return n
    return None


def frontier_fit(c, depth: int, batch_bytes: int, node_gpus: int = NODE_GPUS, gpu: str | None = None,
                  gpu_bytes: int | None = None) -> list[dict[str, Any]]:
    """For each GPU hsx plans for and each weight format (bf16; FP8, as stored or as an FP8 checkpoint of it would
    be): the expert-parallel group that holds the model (`ep_size`, None where a node does not) and its per-GPU
    bytes at that size (at a node's size where none fits). `gpu` planned with `gpu_bytes` of memory (a
    --gpu-memory-gib) is taken at that size."""
    sizes = tuple(n for n in EP_SIZES if n <= node_gpus)
    rows = []
    for fp8 in (False, True):
        split = expert_split_bytes(c, depth, fp8=fp8)
        for name, spec in GPUS.items():
            if fp8 and spec["fp8_matmul_tflops"] is None:
                continue  # no FP8 tensor cores: an FP8 checkpoint is dequantized there (the bf16 row)
            memory = gpu_bytes if name == gpu and gpu_bytes else int(spec["memory_gib"] * 1024**3)
            n = expert_parallel_size(split, batch_bytes, memory, sizes)
            rows.append({"gpu": name, "format": "fp8" if fp8 else "bf16", "ep_size": n, "gpu_bytes": memory,
                         "per_gpu_bytes": expert_parallel_gpu_bytes(split, n or sizes[-1])})
    return rows


def expert_parallel_refusal(name: str, p: dict[str, Any], gpu: str) -> str:
    """The one line `hsx plan` refuses a mixture of experts with that no node of these GPUs holds, with its numbers
    and what would hold it: another weight format or GPU in one node, or how many nodes pipeline stages would take."""
    gib = 1024**3
    ep, n = p["expert_parallel"], p["node_gpus"]
    batch = p["activation_bytes_per_token"] * p["min_batch_tokens"]
    need = ep["per_gpu_bytes_at_node"] + batch
    cap = GPU_HEADROOM * p["gpu_bytes"]
    stored = "fp8" if ep["fp8"] else "bf16"
    fits = [r for r in ep["fit"] if r["ep_size"] and (r["format"] == "fp8" or stored == "bf16")]
    fits.sort(key=lambda r: (r["gpu"] != gpu, r["format"] != stored, r["ep_size"]))
    fits = list({r["gpu"]: r for r in reversed(fits)}.values())[::-1][:4]  # this GPU first; one format per GPU
    where = "; ".join(f"{'an FP8 checkpoint' if r['format'] != stored else stored.upper()} on {r['ep_size']} "
                      f"{r['gpu'].upper()} of {r['gpu_bytes'] / gib:,.0f} GiB ({r['per_gpu_bytes'] / gib:,.0f} "
                      "GiB/GPU)" for r in fits)
    nodes = math.ceil(p["weight_bytes"] / (n * (cap - batch))) if cap > batch else None
    return (f"{name}: {p['weight_bytes'] / gib:,.0f} GiB of weights ({stored.upper()}); with its routed experts over "
            f"the {n} GPUs of a node each {gpu.upper()} needs {ep['replicated_bytes'] / gib:,.1f} GiB replicated + "
            f"{ep['routed_bytes'] / n / gib:,.1f} GiB of experts + {batch / gib:,.1f} GiB for a batch = "
            f"{need / gib:,.1f} GiB, more than {GPU_HEADROOM:.0%} of its {p['gpu_bytes'] / gib:,.0f} GiB; it would "
            f"fit: {where or 'no node of the GPUs hsx knows'}"
            + (f"; or {nodes} nodes of these as pipeline stages (not built yet: docs/scale-out.md)" if nodes else ""))


def expert_parallel_lines(p: dict[str, Any]) -> list[str]:
    """`hsx plan`'s lines on expert parallelism: the split, the group for these GPUs, and which GPUs hold it."""
    ep = p.get("expert_parallel")
    if not ep or p.get("gpus_per_copy") == 1:  # a copy per GPU: data parallel, nothing to shard
        return []
    gib = 1024**3
    n = ep["ep_size"]
    lines = [f"experts: {ep['routed_bytes'] / gib:,.1f} GiB routed (sharded by --ep-size), "
             f"{ep['replicated_bytes'] / gib:,.1f} GiB replicated on every GPU (embeddings, attention, dense and "
             "shared MLPs, routers)"]
    if n:
        lines.append(f"  --ep-size {n}: {ep['per_gpu_bytes'] / gib:,.1f} GiB of weights per GPU, each GPU on its own "
                     "batches, each reading only its own experts from the checkpoint (unmeasured on GPUs: "
                     "docs/scale-out.md#expert-parallelism---ep-size)")
    elif p.get("gpus_per_copy"):
        lines.append(f"  no expert-parallel group of a node holds it ({ep['per_gpu_bytes_at_node'] / gib:,.1f} GiB of "
                     f"weights per GPU at {p['node_gpus']}): only an even split does (--tp-size {p['gpus_per_copy']} or "
                     f"--gpus-per-copy {p['gpus_per_copy']})")
    held = {}
    for r in ep["fit"]:
        if r["ep_size"]:
            held.setdefault(r["format"], []).append(f"{r['ep_size']}×{r['gpu']} "
                                                    f"({r['per_gpu_bytes'] / gib:,.0f} GiB/GPU)")
    stored = "fp8" if ep["fp8"] else "bf16"
    for fmt, where in held.items():
        what = fmt if fmt == stored else f"{fmt} (an FP8 checkpoint of it)"
        lines.append(f"  {what} held by: {', '.join(where)}")
    return lines


def expert_parallel_plan(c, depth: int, act: int, min_batch: int, gpu_bytes: int | None,
                         node_gpus: int = NODE_GPUS, gpu: str | None = None) -> dict[str, Any] | None:
    """The expert-parallel part of a plan for a model with routed experts (None for one without)."""
    if not any(_is_moe_layer(c, i) for i in range(depth)):
        return None
    split = expert_split_bytes(c, depth)
    batch = act * min_batch
    n = expert_parallel_size(split, batch, gpu_bytes, tuple(s for s in EP_SIZES if s <= node_gpus)) \
        if gpu_bytes else None
    return {"fp8": is_fp8(c), "routed_bytes": split["routed"], "replicated_bytes": split["replicated"],
            "ep_size": n, "per_gpu_bytes": expert_parallel_gpu_bytes(split, n) if n else None,
            "per_gpu_bytes_at_node": expert_parallel_gpu_bytes(split, node_gpus),
            "fit": frontier_fit(c, depth, batch, node_gpus, gpu, gpu_bytes)}


# ---- the plan -----------------------------------------------------------------------------------------------

def plan(c, layers: list[int], final_hidden: bool, max_length: int, tokens: int | None = None,
         rows: int | None = None, rate_tokens_per_s: float | None = None, gpu_bytes: int | None = None,
         matmul_tflops: float = MEASURED_MATMUL["matmul_tflops"], mfu: float | None = None,
         storage_dtype: str = DEFAULT_STORAGE_DTYPE, topk_logits: int = 0, teacher_policy: int = 0,
         token_budget: int | None = None, node_gpus: int = NODE_GPUS, gpu_name: str | None = None
         ) -> dict[str, Any]:
    """A job's costs as a dict (what `hsx plan --json` prints).

    Memory: a copy that needs g > 1 GPUs is planned as its decoder layers spread evenly over the group
    (device_map-style), each GPU holding weights/g plus a whole batch's activations. Time: the rate is one GPU's
    (`rate_tokens_per_s`, or `mfu` of `matmul_tflops` over this model's FLOPs per token, by default the rate
    measured for its kind: `plan_mfu`); a copy on g GPUs
    runs its layers one GPU at a time, so it goes at about that rate too, and a node runs node_gpus // g copies."""
    from hsx.config import layers_run

    n = int(c.num_hidden_layers)
    depth = layers_run(n, layers, final_hidden or bool(teacher_policy))  # (the policy is the final norm's)
    h = int(c.hidden_size)
    fmt = OutputFormat(len(layers), h, final_hidden, storage_dtype, topk_logits, policy=teacher_policy)
    if fmt.problem():
        raise ValueError(fmt.problem())
    values = fmt.values_per_token
    widest = max(values, *(col.width for col in fmt.state_columns()))  # (a policy-only output's: the policy's)
    bpt = fmt.bytes_per_token  # the state columns as written (hsx.schema); + token_bytes for input_ids, loss_mask
    weights = weight_bytes(c, depth, lm_head=bool(topk_logits or teacher_policy))
    act = activation_bytes_per_token(c, values)
    min_batch = max(max_length, DEFAULT_BUDGET_CAP // 4)  # one full row, and enough tokens to keep a GPU busy
    gpus = gpus_per_copy(weights, act, token_budget or min_batch, gpu_bytes, node_gpus) if gpu_bytes else 1
    per_gpu_weights = weights / (gpus or node_gpus)
    budget = token_budget or auto_token_budget(
        c, values, (gpu_bytes - per_gpu_weights) if gpu_bytes else 1 << 62, max_length)
    out: dict[str, Any] = {
        "num_model_layers": n, "layers": layers, "final_hidden": final_hidden, "layers_run": depth,
        "hidden_size": h, "values_per_token": values, "storage_dtype": storage_dtype, "topk_logits": topk_logits,
        "teacher_policy": teacher_policy,
        "bytes_per_token": bpt, "token_bytes": fmt.token_bytes, "bytes_per_row": fmt.bytes_per_row,
        "weight_bytes": weights, "activation_bytes_per_token": act, "token_budget": budget,
        "peak_gpu_bytes_estimate": int(per_gpu_weights + act * budget),  # per GPU of a copy
        "max_length": max_length,
        "arrow_values_per_max_length_row": max_length * widest,
        "arrow_limit_ok": max_length * widest <= ARROW_MAX_VALUES,
        "max_tokens_per_record_batch": ARROW_MAX_VALUES // widest,
    }
    if gpu_bytes is not None:
        copies = node_gpus // gpus if gpus else 0
        out.update({"gpu_bytes": gpu_bytes, "fits": gpus == 1, "gpus_per_copy": gpus, "node_gpus": node_gpus,
                    "copies_per_node": copies})
    ep = expert_parallel_plan(c, depth, act, token_budget or min_batch, gpu_bytes, node_gpus,
                              gpu_name.lower() if gpu_name else None)
    if ep:
        out.update({"expert_parallel": ep, "min_batch_tokens": token_budget or min_batch})
    if tokens is not None:
        mean_len = min(tokens / rows if rows else float(DEFAULT_MEAN_TOKENS), float(max_length))
        per_token = 2.0 * depth * layer_params(c, depth) + attention_flops(c, depth, np.array([mean_len])) / mean_len
        mfu = mfu if mfu is not None else plan_mfu(c)
        rate = rate_tokens_per_s or (mfu * matmul_tflops * 1e12 / per_token)
        whose = f"an {gpu_name}'s " if gpu_name else ""
        source = "given" if rate_tokens_per_s else f"{mfu:.0%} of {whose}{matmul_tflops:.0f} TFLOP/s"
        if not rate_tokens_per_s and rate * bpt > WRITER_BYTES_PER_S:
            rate = WRITER_BYTES_PER_S / bpt
            source = (f"the writer's fastest measured {WRITER_BYTES_PER_S / 1e9:.2f} GB/s per process, not the "
                      f"GPU's FLOPs; a model this small is bound by per-batch overheads this plan does not model")
        if storage_dtype != SCALED_DTYPE:  # what --storage-dtype float8_e4m3 would write instead (plan's "to fit")
            fp8_bpt = dataclasses.replace(fmt, storage_dtype=SCALED_DTYPE).bytes_per_token
            out.update({"float8_bytes_per_token": fp8_bpt, "float8_total_bytes": tokens * fp8_bpt})
        out.update({"tokens": tokens, "total_bytes": tokens * bpt, "flops_per_token": per_token,
                    "rate_tokens_per_s": rate, "rate_bound": "writer" if "writer" in source else "compute",
                    "rate_source": source,
                    "expected_seconds": tokens / rate, "write_bytes_per_s": rate * bpt})
        if out.get("copies_per_node"):
            out["expected_seconds_node"] = tokens / rate / out["copies_per_node"]
            out["write_bytes_per_s_node"] = rate * bpt * out["copies_per_node"]
    return out


def plan_mfu(c) -> float:
    """The share of the matmul rate a plan assumes for this model: PLAN_MFU_MOE for a mixture of experts (FLOPs of
    the active parameters; PLAN_MFU_MOE_FP8 of the FP8 rate for an FP8 one), PLAN_MFU_FP8 (of the FP8 rate) for a
    dense FP8 checkpoint, PLAN_MFU otherwise."""
    if any(_is_moe_layer(c, i) for i in range(int(c.num_hidden_layers))):
        return PLAN_MFU_MOE_FP8 if is_fp8(c) else PLAN_MFU_MOE
    return PLAN_MFU_FP8 if is_fp8(c) else PLAN_MFU


def format_plan(p: dict[str, Any]) -> str:
    gib = 1024**3
    lines = []
    if p.get("planned_for"):
        lines.append(f"planned for {p['planned_for']}" + (
            "; this machine has no GPU, so `hsx extract` here runs on its CPU, far slower than the times below"
            if p.get("machine_has_gpu") is False else ""))
    if p.get("kernel_fallbacks"):  # kernels not checked on that GPU (hsx.target.kernels), as hsx extract would say
        lines.append(f"kernels on compute capability {p['compute_capability']}:")
        lines += [f"  {line.removeprefix('hsx: ')}" for line in p["kernel_fallbacks"]]
    lines += [
        f"layers {p['layers']}{' + final norm state' if p['final_hidden'] else ''}: runs {p['layers_run']} of "
        f"{p['num_model_layers']} decoder layers, "
        + ("lm_head in chunks of tokens" if p["topk_logits"] or p["teacher_policy"] else "no lm_head"),
        f"weights (layers run + embeddings{' + lm_head' if p['topk_logits'] or p['teacher_policy'] else ''}): "
        f"{p['weight_bytes'] / gib:.1f} GiB",
        f"activation memory per token: {p['activation_bytes_per_token'] / 1024:.0f} KiB; token budget "
        f"{p['token_budget']:,} (peak ≈ {p['peak_gpu_bytes_estimate'] / gib:.1f} GiB per GPU)",
        f"output: {p['bytes_per_token']:,} bytes per token ({p['values_per_token']:,} {p['storage_dtype']} values"
        + (", fp8 scales" if p["storage_dtype"] == SCALED_DTYPE else "")
        + (f", top-k {p['topk_logits']} logits and ids" if p["topk_logits"] else "")
        + (f", a teacher policy of {p['teacher_policy']} ids and log-probs and its tail mass"
           if p["teacher_policy"] else "")
        + f"; input_ids and loss_mask add {p['token_bytes']})",
        f"Arrow limit: a {p['max_length']:,}-token row holds {p['arrow_values_per_max_length_row']:,} values "
        f"({'ok' if p['arrow_limit_ok'] else 'OVER 2^31: lower --max-length or store fewer layers'}); at most "
        f"{p['max_tokens_per_record_batch']:,} tokens per record batch",
    ]
    if "gpus_per_copy" in p:
        g, size = p["gpus_per_copy"], f"{p['gpu_bytes'] / gib:.0f} GiB"
        node = f"{p['copies_per_node']} copies per {p['node_gpus']}-GPU node"
        if g == 1:
            lines.append(f"GPUs: 1 × {size} per model copy → {node}")
        elif g:
            lines.append(f"GPUs: {g} × {size} per model copy, its layers spread over the group with device_map "
                         f"(--gpus-per-copy {g}; --tp-size {g} shards it instead) → {node}")
        else:
            lines.append(f"GPUs: a model copy needs more than {p['node_gpus']} GPUs of {size}")
    lines += expert_parallel_lines(p)
    if "launch" in p:
        lines.append(f"launch: {p['launch']}")
    if "launch_expert_parallel" in p:
        lines.append(f"launch, expert parallel (every GPU on its own batches; unmeasured on GPUs): "
                     f"{p['launch_expert_parallel']}")
    if p.get("launch_node"):
        lines.append(f"  a node of {p['node_gpus']} GPUs: {p['launch_node']}")
    if "tokens" in p:
        when = format_duration(p["expected_seconds"]) + (" on one copy" if p.get("copies_per_node") else "")
        if p.get("copies_per_node", 1) > 1:
            when += f", {format_duration(p['expected_seconds_node'])} on a node of {p['node_gpus']} GPUs"
        lines.append(f"{p['tokens']:,} tokens ({p.get('tokens_source', 'given')}) → "
                     f"{human_bytes(p['total_bytes'])} on disk; at {p['rate_tokens_per_s']:,.0f} tok/s per copy "
                     f"({p['rate_source']}) ≈ {when}")
        node = f", {human_bytes(p['write_bytes_per_s_node'])}/s per node" if p.get("copies_per_node", 1) > 1 else ""
        lines.append(f"disk writes: {human_bytes(p['write_bytes_per_s'])}/s per copy{node}")
        lines += fit_lines(p)
    else:
        lines.append("disk and time: give --tokens N (the dataset's size is not known offline)")
    return "\n".join(lines)


def fit_lines(p: dict[str, Any]) -> list[str]:
    """What makes the output fit less disk, each with its number for this plan (they combine): the fp8 storage
    dtype, training while extracting (a window of units on disk), node shares in local dirs."""
    total = p["total_bytes"]
    lines = ["to need less disk (these combine):"]
    if "float8_total_bytes" in p:
        lines.append(f"  --storage-dtype float8_e4m3: {p['float8_bytes_per_token']:,} bytes per token, "
                     f"{human_bytes(p['float8_total_bytes'])} in all ({p['float8_total_bytes'] / total:.0%}; e4m3 "
                     "values with a float32 scale per token and layer, read back as bf16: docs/storage.md)")
    lines.append("  train while extracting: --max-pending-gb N, with the trainer reading hsx.follow(OUT, "
                 "delete_consumed=True): the disk holds N GB of units not yet consumed (a unit is ~2 GiB), not "
                 f"{human_bytes(total)} (docs/follow.md)")
    lines.append("  --push-to-hub REPO --push-mode stream --delete-after-upload: each unit leaves the disk once the "
                 "Hub has it")
    shares = ", ".join(f"{human_bytes(total / k)} over {k}" for k in (2, 4, 8))
    lines.append(f"  nodes each writing a local --output-dir: a node's disk holds its share, {shares} nodes; "
                 "`hsx merge` joins the dirs by metadata (docs/scale-out.md)")
    return lines


def launch_commands(config_path: str | None, overrides: dict[str, Any], output_dir: str, gpus: int,
                    node_gpus: int = NODE_GPUS, recipe_keys=()) -> tuple[str, str | None]:
    """The command that runs the planned job (one copy), and the one that fills a node with copies (None when a
    copy already takes the node). Accelerate configs are the shipped recipes/accelerate/{1,8}gpu.yaml."""
    args = ["extract"] + (["--config", config_path] if config_path else [])
    for key, value in overrides.items():
        if key == "output_dir":
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        elif key == "layers" and isinstance(value, (list, tuple)):
            args += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            import json

            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    if gpus > 1 and not {"gpus_per_copy", "tp_size"} & {*overrides, *recipe_keys}:
        args += ["--gpus-per-copy", str(gpus)]  # each process takes this many GPUs of its node
    args += ["--output-dir", output_dir]
    tail = " ".join(shlex.quote(a) for a in args)
    node = f"hsx launch --config_file recipes/accelerate/{node_gpus}gpu.yaml"
    if gpus == 1:
        return f"hsx {tail}", f"{node} {tail}"
    return f"{node} --num_processes {node_gpus // gpus} {tail}", None


PLACEHOLDER = "(plan)"


def job_plan(config: str | None, overrides: dict[str, Any], shape: str | None = None, tokens: int | None = None,
             gpu: str = DEFAULT_GPU, gpu_memory_gib: float | None = None, rate: float | None = None) -> dict[str, Any]:
    """A job's costs from its recipe and overrides (`hsx plan` prints them, `hsx.plan()` returns them), offline
    for local models and shipped shapes.

    Tokens come from `tokens`; else from `DATASET_SIZES` for a known Hub dataset; else, for a local dataset,
    from tokenizing it (a sample of SAMPLE_ROWS rows when larger; rows × DEFAULT_MEAN_TOKENS without a tokenizer
    offline); else there is no disk or time line. Neither the dataset nor the weights are downloaded."""
    from hsx.config import UsageError, load_config, target_layers

    if gpu not in GPUS:
        raise UsageError(f"unknown gpu {gpu!r}; known: {', '.join(sorted(GPUS))}")
    check_range("tokens", tokens, 1, 2**63 - 1)
    check_range("rate", rate, 1e-9, integer=False)
    check_range("gpu_memory_gib", gpu_memory_gib, 1e-3, 2**40, integer=False)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if shape:
        overrides["model"] = overrides.get("model") or f"shape:{shape}"
    recipe = _recipe_keys(config)
    # output_dir and dataset are required by an extract job, not by a plan: fill in only what neither gives
    placeholders = {k: PLACEHOLDER for k in ("output_dir", "dataset") if not overrides.get(k) and not recipe.get(k)}
    cfg = load_config(config, {**overrides, **placeholders})  # a wrong recipe or option: UsageError
    gpu_gib = gpu_memory_gib if gpu_memory_gib is not None else GPUS[gpu]["memory_gib"]
    text = model_text_config(cfg, shape)
    layers, final_hidden = target_layers(cfg, text)
    tokens, rows, source = planned_tokens(cfg, tokens)
    known_shape = shape or HUB_SHAPES.get(cfg.model)
    planned = text
    if is_fp8(text) and GPUS[gpu]["fp8_matmul_tflops"] is None:
        # no FP8 tensor cores: transformers dequantizes the checkpoint at load (hsx.target.kernels), so it is planned as
        # the bf16 model it becomes: 2-byte weights, the bf16 rate and MFU
        import copy

        planned = copy.copy(text)
        planned.quantization_config = None
    rate_key = "fp8_matmul_tflops" if is_fp8(planned) else "matmul_tflops"
    rate_tflops = planned_tflops(gpu, rate_key)
    mfu = MEASURED_MFU.get(known_shape) if planned is text else None
    p = plan(planned, layers, final_hidden, cfg.max_length, tokens=tokens, rows=rows, rate_tokens_per_s=rate,
             gpu_bytes=int(gpu_gib * 1024**3), storage_dtype=cfg.storage_dtype, topk_logits=cfg.topk_logits,
             teacher_policy=cfg.teacher_policy, token_budget=cfg.token_budget, gpu_name=gpu.upper(),
             matmul_tflops=rate_tflops, **({"mfu": mfu} if mfu is not None else {}))
    ep = p.get("expert_parallel")
    if ep and p.get("gpus_per_copy") is None and ep["ep_size"] is None:
        raise HsxError(expert_parallel_refusal(shape or cfg.model, p, gpu))
    import torch

    from hsx.target.kernels import cap_name, choose

    spec = GPUS[gpu]
    p["rate_basis"] = rate_basis(gpu, rate_key)
    p["planned_for"] = f"{gpu.upper()} GPUs ({gpu_gib:.0f} GiB; {p['rate_basis']})"
    p["compute_capability"] = cap_name(spec["capability"])
    picks = choose(spec["capability"], frozenset(("fla",)), cfg.dtype, packing=True,  # (fla: in hsx[gpu])
                   experts=any(_is_moe_layer(text, i) for i in range(int(text.num_hidden_layers))),
                   linear_attention="linear_attention" in layer_types(text), fp8=is_fp8(text))
    p["kernel_fallbacks"] = [pk.line for pk in picks.values() if pk.line]
    p["machine_has_gpu"] = torch.cuda.is_available()
    if tokens is not None:
        p["tokens_source"] = source
        p["tokens_estimated"] = source.startswith("estimate")
        if rows is not None:
            p["rows"] = rows
    if not shape and p["gpus_per_copy"]:  # a named shape has no weights to run
        output_dir = cfg.output_dir if cfg.output_dir != PLACEHOLDER else default_output_dir(config, cfg.model)
        p["launch"], node = launch_commands(config, overrides, output_dir, p["gpus_per_copy"], recipe_keys=recipe)
        if node:
            p["launch_node"] = node
        if ep and ep["ep_size"] and p["gpus_per_copy"] > 1 and not {"gpus_per_copy", "tp_size", "ep_size"} & {
                *overrides, *recipe}:
            # the same node with every GPU on its own batches (--ep-size), beside device_map's one busy GPU
            p["launch_expert_parallel"] = launch_commands(config, {**overrides, "ep_size": ep["ep_size"]},
                                                          output_dir, 1, recipe_keys=recipe)[1].replace(
                "hsx launch ", f"hsx launch --num_processes {NODE_GPUS - NODE_GPUS % ep['ep_size']} ", 1)
    return p


def _recipe_keys(path: str | None) -> dict[str, Any]:
    """The recipe's keys, typed ({} for a recipe that load_config will refuse, in one line, right after)."""
    if not path:
        return {}
    from hsx.config import HsxError, read_recipe

    try:
        return read_recipe(path)
    except HsxError:
        return {}


def default_output_dir(config_path: str | None, model: str) -> str:
    """out/<recipe name>, or out/<model name> without a recipe."""
    name = Path(config_path).stem if config_path else Path(model.rstrip("/")).name.lower()
    return f"out/{name}"


def model_text_config(cfg, shape: str | None = None):
    """The decoder's config: a named shape, a local model folder's config.json, a shape shipped for this Hub id,
    or the Hub id's config.json (config only, from the Hugging Face cache when offline)."""
    from hsx.config import HsxError
    from hsx.target.model import read_model_config, text_config_of

    if shape:
        return shape_config(shape)
    if Path(cfg.model).is_dir():
        return text_config_of(read_model_config(cfg.model, cfg.model, cfg.trust_remote_code))
    if cfg.model in HUB_SHAPES:
        return shape_config(cfg.model)
    try:
        return text_config_of(read_model_config(cfg.model, cfg.model, cfg.trust_remote_code, cfg.revision))
    except HsxError as e:
        raise HsxError(f"{e}; shapes that ship with hsx: {', '.join(HUB_SHAPES)}; or pass --shape (one of "
                       f"{', '.join(SHAPES)})") from None


def planned_tokens(cfg, given: int | None) -> tuple[int | None, int | None, str]:
    """(tokens, rows, where the number comes from); tokens None when nothing offline tells."""
    if given is not None:
        return given, None, "given"
    if cfg.dataset == PLACEHOLDER:
        return None, None, ""
    known = DATASET_SIZES.get((cfg.dataset, cfg.split))
    if known:
        rows, mean = known
        rows = min(rows, cfg.limit) if cfg.limit is not None else rows
        mean = min(mean, cfg.max_length)
        return rows * mean, rows, f"estimate: {cfg.dataset} {cfg.split}, {rows:,} rows × ~{mean:,} tokens"
    if Path(cfg.dataset).exists():
        return local_tokens(cfg)
    return None, None, ""


SAMPLE_ROWS = 2000  # a local dataset larger than this is planned from an evenly spaced sample of its rows


def local_tokens(cfg) -> tuple[int, int, str]:
    """Tokens and usable rows of a local dataset, tokenized as `hsx extract` would (chat template, max_length,
    skips), all of it or a sample of SAMPLE_ROWS rows scaled up. Without a tokenizer available offline:
    rows × DEFAULT_MEAN_TOKENS."""
    import tempfile
    import uuid

    import datasets

    from hsx.data import row_format, tokenize, usable_rows
    from hsx.inputs import load_input

    ds = load_input(cfg)
    rows = len(ds)
    tokenizer = None
    if row_format(ds.column_names) != "input_ids":
        tokenizer = _offline_tokenizer(cfg)
        if tokenizer is None:
            return (rows * DEFAULT_MEAN_TOKENS, rows, f"estimate: {rows:,} rows × {DEFAULT_MEAN_TOKENS} tokens (no "
                    f"tokenizer offline); --tokens gives the real count")
    sample = ds if rows <= SAMPLE_ROWS else ds.select(np.linspace(0, rows - 1, SAMPLE_ROWS).astype(np.int64))
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="hsx-plan-") as tmp:
            tokenized = tokenize(sample, tokenizer, cfg, str(Path(tmp) / "tokens.arrow"),
                                 fingerprint=f"hsx-plan-{uuid.uuid4().hex}")
            num_tokens = usable_rows(tokenized)[1]
            del tokenized
    finally:
        if bars:
            datasets.enable_progress_bars()
    if sample is ds:
        return int(num_tokens.sum()), len(num_tokens), f"counted: {rows:,} rows tokenized, {len(num_tokens):,} usable"
    scale = rows / len(sample)
    return (round(int(num_tokens.sum()) * scale), round(len(num_tokens) * scale),
            f"estimate: {len(sample):,} of {rows:,} rows tokenized, scaled up")


def _offline_tokenizer(cfg):
    """The job's tokenizer from a local folder or the Hugging Face cache; None if that needs the Hub."""
    from transformers import AutoTokenizer

    from hsx.target.checkpoint import check_model_files

    source = cfg.tokenizer or cfg.model
    kwargs = {} if Path(source).is_dir() else {"revision": cfg.revision, "local_files_only": True}
    check_model_files(source, cfg.revision, local_files_only=True)  # (bounded before transformers reads them)
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code, **kwargs)
    except (OSError, ValueError):
        return None


def format_duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
