"""What a job costs before it runs: weights, activation memory per token, token budget, FLOPs, disk and time.

`hsx plan` prints it; `hsx extract` uses the same numbers for its token budget and the MFU in its progress bar,
and `hsx bench` for MFU. Model shapes that benchmarks and offline planning need ship here (facts from the
models' config.json files), so nothing needs the Hub. MFU counts real tokens only: 2 × (parameters of the
decoder layers run) per token, plus causal attention, 2·L²·d_attn per attention layer per sequence of length L.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

ARROW_MAX_VALUES = 2**31 - 1  # per record batch and per sample (ArrowCapacityError / offset overflow beyond)
BYTES_PER_VALUE = {"bfloat16": 2}
DEFAULT_BUDGET_CAP = 16384  # measured fastest on an H200, 8B shape: 16k 48% vs 64k 44% of the matmul rate

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
}


def shape_config(name: str):
    """A transformers config for a named shape."""
    from transformers import AutoConfig

    from hsx.config import HsxError

    if name not in SHAPES:
        raise HsxError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    facts = dict(SHAPES[name])
    return AutoConfig.for_model(facts.pop("model_type"), **facts)


# ---- compute ------------------------------------------------------------------------------------------------

def _head_dim(c) -> int:
    return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)


def layer_params(c) -> int:
    """Matmul parameters of one dense decoder layer (attention projections + gated MLP)."""
    h, hd = int(c.hidden_size), _head_dim(c)
    q, kv = int(c.num_attention_heads) * hd, int(c.num_key_value_heads) * hd
    return h * q + 2 * h * kv + q * h + 3 * h * int(c.intermediate_size)


def flops(c, depth: int, lengths: np.ndarray, layer_param_count: int | None = None) -> float:
    """FLOPs of running `depth` decoder layers over sequences of these lengths (real tokens only)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    per_layer = layer_param_count if layer_param_count is not None else layer_params(c)
    d_attn = int(c.num_attention_heads) * _head_dim(c)
    return depth * (2.0 * per_layer * lengths.sum() + 2.0 * d_attn * float((lengths ** 2).sum()))


def measure_matmul_tflops(device, size: int | None = None, repeats: int = 20) -> float:
    """The bf16 (CPU: float32) dense matmul rate of this device, measured now, in TFLOP/s."""
    import torch

    cuda = device.type == "cuda"
    n = size or (8192 if cuda else 1024)
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    best = math.inf
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(repeats if cuda else 3):
            a @ b
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - t0) / (repeats if cuda else 3))
    return 2 * n**3 / best / 1e12


# ---- memory and disk ----------------------------------------------------------------------------------------

def activation_bytes_per_token(c, stored_values_per_token: int, dtype_bytes: int = 2) -> int:
    """Peak GPU bytes per token in a batch: one layer's transient activations plus the captured outputs
    (held until the batch ends) and the gathered copy. A 1.5× margin covers allocator fragmentation."""
    h, hd, i = int(c.hidden_size), _head_dim(c), int(c.intermediate_size)
    q, kv = int(c.num_attention_heads) * hd, int(c.num_key_value_heads) * hd
    transient = max(q + 2 * kv + q + h, 3 * i + h) + 3 * h  # attention or MLP stage, plus residual/norm
    return int(1.5 * dtype_bytes * (transient + 2 * stored_values_per_token))


def auto_token_budget(c, stored_values_per_token: int, free_bytes: int, max_length: int) -> int:
    """The smaller of the fastest measured budget and what free memory allows (never below one full row)."""
    fits = int(0.8 * free_bytes) // activation_bytes_per_token(c, stored_values_per_token)
    budget = min(DEFAULT_BUDGET_CAP, fits)
    return max(budget, max_length)


def weight_bytes(c, depth: int, dtype_bytes: int = 2) -> int:
    return dtype_bytes * (depth * layer_params(c) + int(c.vocab_size) * int(c.hidden_size))


def plan(c, layers: list[int], final_hidden: bool, max_length: int, tokens: int | None = None,
         rows: int | None = None, rate_tokens_per_s: float | None = None, gpu_bytes: int | None = None,
         matmul_tflops: float = 790.0, mfu: float = 0.70, storage_dtype: str = "bfloat16") -> dict[str, Any]:
    """A job's costs as a dict (what `hsx plan --json` prints)."""
    n = int(c.num_hidden_layers)
    depth = n if final_hidden else max(layers) + 1
    h = int(c.hidden_size)
    values = len(layers) * h + (h if final_hidden else 0)
    bpt = values * BYTES_PER_VALUE[storage_dtype]
    weights = weight_bytes(c, depth)
    act = activation_bytes_per_token(c, values)
    budget = auto_token_budget(c, values, (gpu_bytes - weights) if gpu_bytes else 1 << 62, max_length)
    flops_per_token = flops(c, depth, np.array([1.0]))  # the attention term is per-length; added below
    out: dict[str, Any] = {
        "num_model_layers": n, "layers": layers, "final_hidden": final_hidden, "layers_run": depth,
        "hidden_size": h, "values_per_token": values, "bytes_per_token": bpt,
        "weight_bytes": weights, "activation_bytes_per_token": act, "token_budget": budget,
        "peak_gpu_bytes_estimate": weights + act * budget,
        "max_length": max_length,
        "arrow_values_per_max_length_row": max_length * values,
        "arrow_limit_ok": max_length * values <= ARROW_MAX_VALUES,
        "max_tokens_per_record_batch": ARROW_MAX_VALUES // values,
    }
    if gpu_bytes is not None:
        out["gpu_bytes"] = gpu_bytes
        out["fits"] = weights + act * max_length <= gpu_bytes
    if tokens is not None:
        mean_len = tokens / rows if rows else 350.0
        per_token = flops_per_token + 2.0 * int(c.num_attention_heads) * _head_dim(c) * depth * mean_len
        rate = rate_tokens_per_s or (mfu * matmul_tflops * 1e12 / per_token)
        out.update({"tokens": tokens, "total_bytes": tokens * bpt, "rate_tokens_per_s": rate,
                    "rate_source": "given" if rate_tokens_per_s else f"{mfu:.0%} of {matmul_tflops:.0f} TFLOP/s",
                    "expected_seconds": tokens / rate})
    return out


def format_plan(p: dict[str, Any]) -> str:
    gib = 1024**3
    lines = [
        f"layers {p['layers']}{' + final norm state' if p['final_hidden'] else ''}: runs {p['layers_run']} of "
        f"{p['num_model_layers']} decoder layers, no lm_head",
        f"weights (layers run + embeddings): {p['weight_bytes'] / gib:.1f} GiB",
        f"activation memory per token: {p['activation_bytes_per_token'] / 1024:.0f} KiB; token budget "
        f"{p['token_budget']:,} (peak ≈ {p['peak_gpu_bytes_estimate'] / gib:.1f} GiB)",
        f"output: {p['bytes_per_token']:,} bytes per token ({p['values_per_token']:,} bf16 values)",
        f"Arrow limit: a {p['max_length']:,}-token row holds {p['arrow_values_per_max_length_row']:,} values "
        f"({'ok' if p['arrow_limit_ok'] else 'OVER 2^31: lower --max-length or store fewer layers'}); at most "
        f"{p['max_tokens_per_record_batch']:,} tokens per record batch",
    ]
    if "fits" in p:
        lines.append(f"fits one GPU of {p['gpu_bytes'] / gib:.0f} GiB: {'yes' if p['fits'] else 'NO'}")
    if "tokens" in p:
        lines.append(f"{p['tokens']:,} tokens → {p['total_bytes'] / 1e12:.3f} TB on disk; at "
                     f"{p['rate_tokens_per_s']:,.0f} tok/s ({p['rate_source']}) ≈ {_duration(p['expected_seconds'])}")
    return "\n".join(lines)


def plan_command(args) -> dict[str, Any]:
    """`hsx plan`: the job's costs from its recipe/flags, offline where the model's shape is known."""
    import json

    from hsx.cli import config_overrides
    from hsx.config import load_config, resolve_layers

    overrides = config_overrides(args)
    overrides.setdefault("output_dir", "(plan)")
    if args.shape:
        overrides["model"] = overrides.get("model") or f"shape:{args.shape}"
    overrides.setdefault("dataset", "(none)")
    cfg = load_config(args.config, overrides)
    if args.shape:
        text = shape_config(args.shape)
    else:
        from transformers import AutoConfig

        from hsx.model import resolve_model_path, text_config_of

        text = text_config_of(AutoConfig.from_pretrained(resolve_model_path(cfg.model, cfg.revision, False)[0]))
    layers, final_hidden = resolve_layers(cfg.layers, int(text.num_hidden_layers), cfg.final_hidden)
    tokens, rows = args.tokens, None
    if tokens is None and cfg.dataset != "(none)":
        from hsx.data import load_input

        rows = len(load_input(cfg))
        tokens = rows * 354  # the mean of the H200 probes' chat-like distribution; --tokens gives the real count
    p = plan(text, layers, final_hidden, cfg.max_length, tokens=tokens, rows=rows, rate_tokens_per_s=args.rate,
             gpu_bytes=int(args.gpu_memory_gib * 1024**3))
    if rows is not None:
        p["rows"], p["tokens_estimated"] = rows, True
    print(json.dumps(p, indent=2) if args.json else format_plan(p))
    return p


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
