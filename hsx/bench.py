"""`hsx bench`: hsx against the two common ways of extracting hidden states, on the same data, in one process.

(a) EAGLE ge_data style: batch 1, the full CausalLM, `output_hidden_states=True`, a blocking copy per sample.
(b) DeepSpec / SpecForge-HF style: padded batches of 32 in dataset order, full depth, no lm_head, an attention
    mask, a blocking copy per batch.
(c) hsx's real pipeline (`hsx extract` on the same rows and the same weights), writing the real Arrow output.

(a) and (b) run on a subset (rows drawn from the same distribution) and are reported as rates; the table says
how many rows each used. Weights are random, from a named shape or a local model; lengths are drawn from a
lognormal body with a uniform tail (default: mean ≈ 354 tokens, 1% tail to 4k: the distribution of hsx's first
measurements, kept so that runs compare). Results go to docs/benchmarks.md, dated, with the command and commit.
Rates are steady state: (c) first runs a warm-up extraction (compile, cuBLAS, allocator) that is timed apart.
"""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from hsx.info import recorded_info

# Defaults by device (`hsx bench` flags left unset): the GPU's are what the benchmarks were measured with; on CPU a
# tiny shape and rows of at most 512 tokens, so the bench ends in about a minute (an 8B float32 forward takes minutes a
# row there, and (b)'s padded batches of 32 rows over a 4k-token tail took 4.5 of 5 minutes at 200 rows).
GPU_BENCH_SHAPE, CPU_BENCH_SHAPE, CPU_BENCH_MAX_LENGTH = "qwen3-8b", "tiny", 512
# The storage probe writes this many times (c)'s output, within these bounds (GB): enough to see the storage's rate
# beyond its caches, not 4 GB after a CPU run that wrote 10 MB.
STORAGE_PROBE_TIMES, STORAGE_PROBE_GB = 4, (0.25, 4.0)
WARMUP_COMPILE_WAIT_S = 90.0  # the longest the warm-up waits for the background compile before timing eager


def synthetic_lengths(count: int, mean: float, spread: float, tail: float, min_length: int, max_length: int,
                      seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mu = math.log(mean) - spread**2 / 2
    lengths = np.clip(rng.lognormal(mu, spread, count), min_length, max_length).astype(np.int64)
    n_tail = int(round(tail * count))
    if n_tail:
        idx = rng.choice(count, n_tail, replace=False)
        lengths[idx] = rng.integers(max_length // 2, max_length + 1, n_tail)
    return lengths


def bench_drift(base, layers: list[int], final_hidden: bool, rows: list[np.ndarray], device, log) -> dict[str, Any]:
    """The drift column: each captured state's relative error, FP8 forward against the bf16 forward of the same
    dequantized weights, over `rows` (hsx.target.drift, as `hsx verify --against-bf16`); {"not_measured": why} where hsx
    has no bf16 reference of some FP8 module."""
    from hsx.errors import HsxError
    from hsx.target import drift

    try:
        d = drift.compare(base, layers, final_hidden, [drift.DriftRow(r) for r in rows], device)
    except HsxError as e:
        log(f"  FP8 vs bf16 drift: not measured: {e}")
        return {"not_measured": str(e)}
    out = {"rows": d["rows"], "tokens": d["tokens"], "relative_error": d["relative_error"]["fp8_vs_bf16"]}
    log(f"  FP8 vs bf16 (dequantized weights), relative error per layer on {out['rows']} rows: "
        + ", ".join(f"{k}: {v:.2%}" for k, v in out["relative_error"].items()))
    return out


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _progress(rows: list[np.ndarray], desc: str | None):
    """A tqdm bar over the rows' tokens (None: no bar, for warm-ups): (a) and (b) take minutes on a CPU."""
    from tqdm.auto import tqdm

    return tqdm(total=int(sum(len(r) for r in rows)), unit="tok", unit_scale=True, desc=desc, disable=desc is None,
                dynamic_ncols=True, leave=False)


def run_naive(causal, rows: list[np.ndarray], layers: list[int], device, desc: str | None = None
              ) -> tuple[float, int]:
    """(a): one sample at a time through the full CausalLM, output_hidden_states, blocking copies."""
    import torch

    n_layers = causal.config.get_text_config().num_hidden_layers
    tokens = 0
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode(), _progress(rows, desc) as bar:
        for ids in rows:
            out = causal(input_ids=torch.from_numpy(ids)[None].to(device), output_hidden_states=True,
                         use_cache=False)
            # hidden_states[i+1] is layer i's output; the last layer's pre-norm output is not available here.
            states = torch.cat([out.hidden_states[min(i + 1, n_layers)][0] for i in layers], dim=-1)
            states.cpu()
            tokens += len(ids)
            bar.update(len(ids))
    _sync(device)
    return tokens, time.perf_counter() - t0


def run_padded(base, rows: list[np.ndarray], layers: list[int], device, batch: int = 32, desc: str | None = None
               ) -> tuple[int, int, float]:
    """(b): dataset order, padded batches of 32, full depth, attention mask, blocking copy per batch."""
    import torch

    n_layers = base.config.num_hidden_layers
    tokens = padded = 0
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode(), _progress(rows, desc) as bar:
        for k in range(0, len(rows), batch):
            chunk = rows[k:k + batch]
            t = max(len(r) for r in chunk)
            ids = np.zeros((len(chunk), t), dtype=np.int64)
            mask = np.zeros((len(chunk), t), dtype=np.int64)
            for j, r in enumerate(chunk):
                ids[j, :len(r)], mask[j, :len(r)] = r, 1
            m = torch.from_numpy(mask).to(device)
            out = base(input_ids=torch.from_numpy(ids).to(device), attention_mask=m, output_hidden_states=True,
                       use_cache=False)
            states = torch.cat([out.hidden_states[min(i + 1, n_layers)] for i in layers], dim=-1)
            states[m.bool()].cpu()
            tokens += int(mask.sum())
            padded += ids.size
            bar.update(int(mask.sum()))
    _sync(device)
    return tokens, padded, time.perf_counter() - t0


def bench(args, log=print, on_results=None) -> dict[str, Any] | None:
    """Runs (a), (b) and (c) with `args` (`hsx bench`'s flags, hsx.cli) and returns the results; `log` gets the
    lines and the table, `on_results` the results as soon as they are measured (and again once a profile is
    written). None on a process other than the main one of a launch (the main one reports)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM

    from hsx.config import ExtractConfig, HsxError, parse_layer_spec, resolve_layers
    from hsx.cost import _num_experts, budget_cap, flops, layer_params, measure_matmul_tflops, shape_config
    from hsx.run import current_process, extract
    from hsx.sink import OutputDir
    from hsx import bench_models
    from hsx.target import checkpoint, fp8, fp8_gemm, fp8_model
    from hsx.target import model as hsx_model
    from hsx.target.prepare import compiled_state

    proc = current_process(args.gpus_per_copy)
    device = proc.device
    cuda = device.type == "cuda"
    import argparse

    from hsx.config import default_of

    args = argparse.Namespace(**{**vars(args),  # (the flags left unset: the device's defaults, above)
                                 "shape": args.shape or (GPU_BENCH_SHAPE if cuda else CPU_BENCH_SHAPE),
                                 "max_length": args.max_length or (default_of("max_length") if cuda else
                                                                   CPU_BENCH_MAX_LENGTH)})
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.model:  # as extract loads it: its small files and its config.json bounded before transformers reads
        model_path, _ = hsx_model.resolve_model_path(args.model, None, trust_remote_code=False)
        full_config = hsx_model.read_model_config(model_path, args.model, trust_remote_code=False)
        checkpoint.check_checkpoint(model_path, args.model,
                                   fp8.carry_quantization(full_config, hsx_model.text_config_of(full_config)))
    else:
        full_config = shape_config(args.shape)
    text = hsx_model.text_config_of(full_config)
    n = int(text.num_hidden_layers)
    layers, final_hidden = resolve_layers(parse_layer_spec(args.layers), n, args.final_hidden)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if proc.world_size > 1:  # `accelerate launch -m hsx bench`: (c) data parallel over the processes
        skip |= {"a", "b"}
        if not proc.is_main:
            log = lambda *a, **k: None  # noqa: E731

    log(f"hsx bench: {args.model or args.shape} ({n} layers × {text.hidden_size}), layers {layers}"
        f"{' + final' if final_hidden else ''}, {args.count} rows of at most {args.max_length} tokens, device {device}")
    quant = fp8.quantization_of(hsx_model.text_config_of(full_config)) or fp8.quantization_of(full_config)
    instead = fp8.runs_instead(quant, device) if quant is not None else None
    if instead:
        log(instead)
    on_fp8 = quant is not None and instead is None
    peak_tflops = measure_matmul_tflops(device, fp8=on_fp8)
    log(f"  measured matmul rate: {flop_rate(peak_tflops)} "
        f"({('e4m3 8192³' if on_fp8 else 'bf16 8192³') if cuda else 'fp32 1024³'})")

    # One set of weights for every run: (a) uses the CausalLM, (b) its base model, (c) a truncated view of it.
    # Seeded: every process of a data-parallel run builds the same weights, so its output equals one process's.
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    if args.model:
        causal = AutoModelForCausalLM.from_pretrained(model_path, config=full_config, dtype=dtype,
                                                      use_safetensors=True, **hsx_model.group_device_map(proc.devices))
    elif quant is not None:  # e4m3 weights built directly, layer by layer: never a bf16 copy of the model
        if len(proc.devices) > 1 or not on_fp8:
            raise HsxError(f"--shape {args.shape}: random FP8 weights are built on one GPU with FP8 tensor cores")
        causal = bench_models.random_causal_lm(full_config, device,
                                               hsx_model.supported_attn_implementation(text, "sdpa"))
    elif len(proc.devices) > 1:
        causal = random_model_over(full_config, dtype, proc.devices)
    else:
        with torch.device(device):
            causal = AutoModelForCausalLM.from_config(
                full_config, dtype=dtype, attn_implementation=hsx_model.supported_attn_implementation(text, "sdpa"))
    causal.eval().requires_grad_(False)
    causal.config.use_cache = False
    if args.model and on_fp8 and len(proc.devices) == 1:
        fp8_model.install(causal)
    if on_fp8 and len(proc.devices) == 1 and _num_experts(text):
        # e4m3 experts on hsx's grouped path, a checkpoint's as random ones: in (a) and (b) too, and the drift
        # column's bf16 forward switches only experts on that path
        from hsx.target.moe import EXPERTS_IMPLEMENTATION, use_experts

        use_experts(causal, EXPERTS_IMPLEMENTATION)
    if on_fp8:
        log(f"  FP8 GEMM: {fp8_gemm.use_gemm(device, args.fp8_gemm)}")
    build_s = time.perf_counter() - t0
    base = causal.get_decoder() if hasattr(causal, "get_decoder") else causal.model
    vocab = int(text.vocab_size)

    lengths = synthetic_lengths(args.count, args.mean, args.spread, args.tail, args.min_length, args.max_length,
                                args.seed)
    rng = np.random.default_rng(args.seed + 1)
    rows = [rng.integers(0, vocab, int(n_tok)).astype(np.int32) for n_tok in lengths]
    per_layer = layer_params(text)

    def rate(tokens: int, seconds: float, lens: np.ndarray, depth: int) -> dict[str, float]:
        f = flops(text, depth, lens, per_layer)
        return {"tokens": int(tokens), "seconds": seconds, "tok_per_s": tokens / seconds,
                "mfu": f / seconds / (peak_tflops * 1e12)}

    results: dict[str, Any] = {
        "model": args.model or f"random:{args.shape}", "layers": layers, "final_hidden": final_hidden,
        "num_model_layers": n, "hidden_size": int(text.hidden_size), "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "dtype": str(dtype).replace("torch.", ""), "matmul_tflops": peak_tflops, "rows": args.count,
        "tokens": int(lengths.sum()), "mean_length": float(lengths.mean()), "max_length_drawn": int(lengths.max()),
        "model_build_seconds": build_s, "versions": _versions(),
    }
    if quant is not None:
        results["quantization"] = fp8_model.report(base, quant)
        results["matmul_rate_of"] = "e4m3" if on_fp8 else "bf16"
    if on_fp8 and args.drift_rows > 0:
        results["drift"] = bench_drift(base, layers, final_hidden, rows[:args.drift_rows], device, log)
        _free(device)

    baseline = None
    if proc.world_size > 1 and getattr(args, "scaling_baseline", None):
        baseline = read_baseline(args.scaling_baseline, results)

    # (a) and (b): subsets drawn at random from the same rows.
    if "a" not in skip:
        idx = np.sort(np.random.default_rng(args.seed + 2).choice(args.count, min(args.subset_a, args.count),
                                                                   replace=False))
        try:
            run_naive(causal, [rows[i] for i in idx[:3]], layers, device)  # warm-up
            tok, sec = run_naive(causal, [rows[i] for i in idx], layers, device, desc="(a) batch 1")
            results["a"] = {**rate(tok, sec, lengths[idx], n), "rows": len(idx), "padding": 0.0}
            log(f"  (a) naive: {results['a']['tok_per_s']:,.0f} tok/s, MFU {results['a']['mfu']:.1%} ({len(idx)} rows)")
        except torch.OutOfMemoryError as e:
            results["a"] = {"oom": str(e).splitlines()[0], "rows": len(idx)}
            log("  (a) naive: out of memory")
        results["a"]["what"] = "batch 1, full CausalLM, output_hidden_states, blocking copy"
        _free(device)
    if "b" not in skip:
        k = min(args.subset_b, args.count)
        try:
            run_padded(base, rows[:32], layers, device)  # warm-up
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            tok, pad, sec = run_padded(base, rows[:k], layers, device, desc="(b) padded 32")
            results["b"] = {**rate(tok, sec, lengths[:k], n), "rows": k, "padding": 1 - tok / pad}
            if cuda:
                results["b"]["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            log(f"  (b) padded: {results['b']['tok_per_s']:,.0f} tok/s, MFU {results['b']['mfu']:.1%}, "
                f"padding {results['b']['padding']:.1%} ({k} rows)")
        except torch.OutOfMemoryError as e:
            results["b"] = {"oom": str(e).splitlines()[0], "rows": k}
            log("  (b) padded: out of memory")
        results["b"]["what"] = ("dataset order, padded batches of 32, full depth, no lm_head, attention mask, "
                                "output_hidden_states, blocking copy")
        _free(device)

    # (c): hsx's real pipeline over all rows, sharing the weights.
    loaded = hsx_model.truncated_view(causal, text, layers, final_hidden)
    if not final_hidden:
        del causal.lm_head  # (c) never needs it; free its memory (and the full model is not used again)
    if proc.world_size > 1:  # one input and one output for every process of the launch
        work = Path(tempfile.gettempdir()) / f"hsx-bench-{os.environ.get('MASTER_PORT', 'dp')}"
    else:
        work = Path(tempfile.mkdtemp(prefix="hsx-bench-"))
    out_dir = Path(args.output_dir) if args.output_dir else work / "out"
    warm_idx = warmup_rows(lengths, args.token_budget or budget_cap(text))
    if proc.is_main:
        work.mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(work / "input"))
        datasets.Dataset.from_dict({"input_ids": [rows[i] for i in warm_idx]}).save_to_disk(str(work / "warm"))
    proc.barrier()
    common = dict(model=results["model"], dataset=str(work / "input"), layers=layers, final_hidden=final_hidden,
                  max_length=args.max_length, token_budget=args.token_budget, compile=args.compile,
                  sdpa_backend=args.sdpa_backend, storage_dtype=args.storage_dtype, packing=args.packing,
                  experts_implementation=args.experts_implementation, gpus_per_copy=args.gpus_per_copy,
                  fp8_gemm=args.fp8_gemm, overwrite=True)
    quiet = lambda *a, **k: None  # noqa: E731
    t0 = time.perf_counter()
    warm = ExtractConfig(**{**common, "dataset": str(work / "warm"), "output_dir": str(work / "warm-out")})
    warm_info = extract(warm, log=quiet, model=loaded)
    warm_extract_s = time.perf_counter() - t0
    compiler = compiled_state(loaded.base)
    if compiler:  # compiled ahead in a worker: the timed run starts on compiled layers (or gives up, one line)
        compiler.wait(WARMUP_COMPILE_WAIT_S)
    warmup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    with gpu_clocks(device) if cuda else nullcontext({}) as clocks:
        info = extract(ExtractConfig(**{**common, "output_dir": str(out_dir)}), log=quiet, model=loaded)
    if proc.world_size > 1:  # the job's numbers, every rank's combined, from whichever process finalized
        proc.barrier()
        info = recorded_info(OutputDir(out_dir).root).to_dict()  # (checked: hsx.schema.Info)
        results["processes"] = proc.world_size
    run = info["run"]
    out_bytes = sum(f.stat().st_size for f in (out_dir / "data").glob("*.arrow"))
    results["c"] = {
        **rate(run["tokens"], run["seconds"], lengths, loaded.depth), "rows": info["counts"]["rows_written"],
        "padding": 1 - run["tokens"] / max(1, run["padded_tokens"]),
        "gpu_idle": 1 - run["gpu_seconds"] / run["seconds"],
        "output_bytes": out_bytes, "output_gb_per_s": out_bytes / run["seconds"] / 1e9,
        "compile_warmup_seconds": warmup_s, "warmup_extract_seconds": warm_extract_s,
        "token_budget": run.get("token_budget"),
        "compile_seconds": getattr(compiler, "seconds", None),
        "compiled": bool(compiler and compiler.ready.is_set()),
        "layers_run": loaded.depth, "compile": run.get("compile"), "sdpa_backend": run.get("sdpa_backend"),
        "gpus_per_copy": args.gpus_per_copy,
        "storage_dtype": args.storage_dtype, "packing": run.get("packing"), "kernels": run.get("kernels"),
        # (the warm-up's job built the JIT GEMMs' kernels; the timed one, in the same process, had none left to build)
        **{f"{name}_build": ((warm_info or {}).get("run", {}).get("kernels") or {}).get(f"{name}_build")
           for name in fp8_gemm.JIT_GEMMS},
        "pipeline": {
            k: run[k] for k in ("gpu_seconds", "gpu_waited_for_writer_seconds", "map_waited_for_gpu_seconds",
                                "write_seconds") if k in run},
        "what": "hsx extract: length buckets, token budget, truncated, hooks, pipelined copies, Arrow output",
    }
    if cuda:
        results["c"]["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if clocks:
        results["c"]["gpu_clocks"] = clocks  # (this process's GPU, during (c))
    write_s = run.get("write_seconds")
    if write_s:  # the writer's busy rate: output bytes over the time map spent writing (between its calls)
        results["c"]["writer_gb_per_s"] = out_bytes / write_s / 1e9
        results["c"]["writer_what"] = (
            "writer_gb_per_s = output_bytes / pipeline.write_seconds: the wall seconds map had writing to do (from "
            "returning a table to its next call, and from the last one until the unit's file was closed), not a "
            "sum over the writer's copy, checksum and spare-preparing threads")
    from hsx.checksums import CRC32_LIBRARY
    from hsx.writer import resolve_mode

    results["c"]["write_mode"] = resolve_mode(out_dir / ".hsx")  # (what hsx.writer picked for the units there)
    results["c"]["crc32"] = CRC32_LIBRARY
    probe_gb = args.storage_gb if args.storage_gb is not None else min(max(
        STORAGE_PROBE_TIMES * out_bytes / 1e9, STORAGE_PROBE_GB[0]), STORAGE_PROBE_GB[1])
    if proc.is_main and probe_gb > 0:  # (after (c): its fsynced output leaves no writeback behind)
        results["storage"] = storage_report(out_dir, probe_gb, results["c"])
    for other in ("a", "b"):
        if other in results and "tok_per_s" in results[other]:
            results[f"c_over_{other}"] = results["c"]["tok_per_s"] / results[other]["tok_per_s"]
    if proc.world_size > 1:  # MFU against every process's GPU; idle is the GPUs' average
        results["c"]["ranks"] = run.get("ranks", [])
        results["c"]["gpu_idle"] = 1 - run["gpu_seconds"] / (run["seconds"] * proc.world_size)
        if "mfu" in run:
            results["c"]["mfu"] = run["mfu"]
        if not proc.is_main:
            return None
        results["scaling"] = scaling(results, baseline)
    log(format_table(results))
    if on_results:  # before profiling: a profile that fails or is cut short loses no measurement
        on_results(results)
    if args.profile:
        profile_batches(loaded, rows, lengths, run.get("token_budget") or 16384, args.profile, args.sdpa_backend,
                        run.get("packing", "none"))
        results["c"]["profile"] = args.profile
        if on_results:
            on_results(results)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
        if args.output_dir:
            shutil.rmtree(out_dir, ignore_errors=True)
    return results


class _NvmlUtilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


POWER_CAP_REASONS = 0x4 | 0x80  # NVML clocks event reasons: SW power cap, HW power brake


@contextmanager
def gpu_clocks(device, every: float = 0.25):
    """Within the block, the GPU's SM clock, power and throttle reasons sampled by NVML (the driver's
    libnvidia-ml, through ctypes) every `every` s; at exit the dict yielded holds the busy samples' means
    (utilization ≥ 50%). Why: a GPU busy without a break runs at its power limit and a lower clock, while one
    that waits for its writer clocks higher in its bursts, so GPU-time MFU differs between runs of the same
    kernels (docs/benchmarks.md, 2026-11-30 to 2026-12-01, the dense table). Empty where NVML or the GPU's UUID
    is not to be had."""
    import threading

    import torch

    stats: dict[str, Any] = {}
    lib, handle = None, ctypes.c_void_p()
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        if lib.nvmlInit_v2() != 0:
            lib = None
        elif lib.nvmlDeviceGetHandleByUUID(("GPU-" + uuid.removeprefix("GPU-")).encode(), ctypes.byref(handle)):
            lib.nvmlShutdown()
            lib = None
    except (OSError, AttributeError, RuntimeError, ValueError):
        lib = None
    if lib is None:  # no driver library, no such device (MIG, another vendor): nothing to report
        yield stats
        return
    reasons_of = getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        lib, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
    samples: list[tuple[int, int, int]] = []  # (SM MHz, mW, reasons) of busy samples
    stop = threading.Event()

    def sample() -> None:
        clock, power, util, reasons = ctypes.c_uint(), ctypes.c_uint(), _NvmlUtilization(), ctypes.c_ulonglong()
        while not stop.wait(every):
            if (lib.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(util)) != 0 or util.gpu < 50
                    or lib.nvmlDeviceGetClockInfo(handle, 1, ctypes.byref(clock)) != 0  # NVML_CLOCK_SM
                    or lib.nvmlDeviceGetPowerUsage(handle, ctypes.byref(power)) != 0):
                continue
            if reasons_of is None or reasons_of(handle, ctypes.byref(reasons)) != 0:
                reasons.value = 0
            samples.append((clock.value, power.value, reasons.value))

    thread = threading.Thread(target=sample, name="hsx-bench-nvml", daemon=True)
    thread.start()
    try:
        yield stats
    finally:
        stop.set()
        thread.join()
        top = ctypes.c_uint()
        if lib.nvmlDeviceGetMaxClockInfo(handle, 1, ctypes.byref(top)) == 0:
            stats["max_sm_clock_mhz"] = top.value
        lib.nvmlShutdown()
        if samples:
            stats.update(busy_samples=len(samples),
                         busy_sm_clock_mhz=sum(c for c, _, _ in samples) / len(samples),
                         busy_power_w=sum(p for _, p, _ in samples) / len(samples) / 1000,
                         power_capped_share=sum(bool(r & POWER_CAP_REASONS) for _, _, r in samples) / len(samples))


def storage_report(out_dir: Path, gb: float, c: dict[str, Any]) -> dict[str, Any]:
    """The output storage's own sequential write rates (hsx.storage.measure_storage), and (c)'s rates as shares of
    the better one."""
    from hsx.storage import measure_storage, measure_writer, storage_probe_bytes

    nbytes = storage_probe_bytes(out_dir, gb * 1e9)
    try:
        s = measure_storage(out_dir / ".hsx-storage", nbytes)
        # the writer alone, in units of (c)'s mean size: the disk's share it can use, unit boundaries included
        units = len(list((out_dir / "data").glob("*.arrow"))) or 1
        s["writer_alone"] = measure_writer(out_dir / ".hsx-storage", nbytes, c["output_bytes"] // units)
    finally:
        shutil.rmtree(out_dir / ".hsx-storage", ignore_errors=True)
    s["hsx_share"] = c["output_gb_per_s"] / s["best_gb_per_s"]
    s["writer_alone_share"] = s["writer_alone"]["gb_per_s"] / s["best_gb_per_s"]
    if "writer_gb_per_s" in c:
        s["writer_share"] = c["writer_gb_per_s"] / s["best_gb_per_s"]
    return s


def warmup_rows(lengths: np.ndarray, budget: int) -> np.ndarray:
    """The rows of (c)'s warm-up, sorted: a stratified slice of ~96 (every length bucket's batch shapes) and a
    budget's worth of rows around the median length, so that torch.compile's sample is a batch as large as the timed
    run's (CompileAhead starts on a forward of half the budget)."""
    order = np.argsort(lengths, kind="stable")
    middle = order[len(order) // 2:]
    block = middle[:int(np.searchsorted(np.cumsum(lengths[middle]), budget)) + 1]
    return np.union1d(order[:: max(1, len(order) // 96)], block)


def profile_batches(loaded, rows: list[np.ndarray], lengths: np.ndarray, budget: int, path: str,
                    backend: str, packing: str = "none") -> None:
    """Kernel time of (c)'s GPU work on a dozen budget-sized batches spread over the length distribution."""
    import pyarrow as pa
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hsx.engine import Extractor, sdpa_backend
    from hsx.target.prepare import compiled_state, prepare_model

    order = np.argsort(lengths, kind="stable")
    batches, cur, cur_max = [], [], 0
    for i in order:
        if cur and (len(cur) + 1) * max(cur_max, lengths[i]) > budget:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(int(i))
        cur_max = max(cur_max, int(lengths[i]))
    batches.append(cur)
    pick = [batches[k] for k in np.linspace(0, len(batches) - 1, 12).astype(int)]
    device = next(loaded.base.parameters()).device
    prepared = prepare_model(loaded.base, packing, compile_model=compiled_state(loaded.base) is not None, cuda=True)
    ex = Extractor(loaded, device, budget, prepared)
    ex.reserve(budget + 4096)
    tables = [pa.table({"sample_id": pa.array(b, pa.int64()),
                        "input_ids": pa.array([rows[i].tolist() for i in b], pa.list_(pa.int32()))}) for b in pick]
    slots = [ex.free.get() for _ in range(ex.num_slots)]

    def run(batch: int, table) -> None:
        # A slot's pinned inputs are read by its batch's host-to-device copies when the GPU reaches them: refilled
        # before that (one slot for every batch, as this did), a batch ran on the next one's row bounds and the
        # varlen attention read out of bounds (an illegal memory access, qwen3-8b with 200 rows on a GPU).
        slot = slots[batch % len(slots)]
        if slot.done is not None:
            slot.done.synchronize()
        ex.run_batch(table, slot)

    with torch.inference_mode(), sdpa_backend(backend, True), ex.capturing():
        for i, t in enumerate(tables[:2]):
            run(i, t)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            for i, t in enumerate(tables):
                run(i, t)
            torch.cuda.synchronize()
    # kernels first; then the ops by input shape, which tells apart the GEMMs that one kernel name covers
    Path(path).write_text(
        prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=80, max_name_column_width=160)
        + "\n\nBy input shape (ops that ran on the GPU, by their device time):\n"
        + prof.key_averages(group_by_input_shape=True).table(sort_by="cuda_time_total", row_limit=60,
                                                              max_name_column_width=60, max_shapes_column_width=120))


def random_model_over(config, dtype, devices):
    """A random-weight CausalLM spread layer by layer over `devices`, as `from_pretrained(device_map="auto")` would
    place a checkpoint (hsx.target.model.group_device_map's memory limits), with each weight created on its own GPU: a
    70B shape never exists whole in host memory. Init: normal(0, initializer_range), norms 1."""
    import torch
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import AutoModelForCausalLM

    from hsx.target.model import group_device_map, supported_attn_implementation, text_config_of

    with init_empty_weights():  # parameters on the meta device, buffers (rotary frequencies) real
        causal = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=supported_attn_implementation(text_config_of(config), "sdpa"))
    causal.tie_weights()  # before placement: tied weights must land on one device
    limits = group_device_map(devices)["max_memory"]
    device_map = infer_auto_device_map(causal, max_memory=limits, dtype=dtype,
                                       no_split_module_classes=causal._no_split_modules)
    std = float(getattr(text_config_of(config), "initializer_range", 0.02))
    gen = torch.Generator(devices[0]).manual_seed(0)
    for name, param in list(causal.named_parameters()):
        where = max((k for k in device_map if name == k or name.startswith(k + ".") or not k), key=len)
        target = torch.device("cuda", device_map[where]) if isinstance(device_map[where], int) else device_map[where]
        value = torch.empty(param.shape, dtype=dtype, device=target)
        if name.endswith("bias"):
            value.zero_()
        elif param.dim() == 1:
            value.fill_(1.0)
        else:
            value.normal_(0.0, std, generator=gen if target == devices[0] else None)
        set_module_tensor_to_device(causal, name, target, value=value)
    return dispatch_model(causal, device_map=device_map)


def _free(device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _versions() -> dict[str, str]:
    from hsx.target.prepare import library_versions
    from hsx.version import __version__

    return {"hsx": __version__, **library_versions()}


def read_baseline(path: str, results: dict[str, Any]) -> float:
    """The one-process tok/s of `path`, the JSON of the same bench (`--scaling-baseline`): checked before
    anything is measured (a file given by the user: one clear line if it is not what it should be)."""
    from hsx.config import HsxError
    from hsx.files import read_json
    from hsx.schema import RECORD_REST_BYTES

    base = read_json(Path(path), limit=RECORD_REST_BYTES)  # (a bench's JSON: its config and numbers, a few KB)
    one = base["c"].get("tok_per_s") if isinstance(base.get("c"), dict) else None
    if not isinstance(one, (int, float)) or one <= 0 or base.get("processes", 1) != 1:
        raise HsxError(f"{path} is not the JSON of a one-process `hsx bench` run (--json): it has no positive "
                       "c.tok_per_s, or was launched over several processes")
    differs = [k for k in ("model", "layers", "final_hidden", "rows", "tokens", "dtype") if base.get(k) != results[k]]
    if differs:
        raise HsxError(f"{path} measured another bench (differs in: {', '.join(differs)}); run the same flags in "
                       "one process for the baseline")
    return float(one)


def scaling(results: dict[str, Any], baseline: float | None) -> dict[str, Any]:
    """A launched bench's scaling: each process's own tok/s (its tokens over its seconds), the job's (every
    process's tokens over the slowest one's seconds), and, given one process's tok/s on the same bench, the
    efficiency: the job's tok/s over N times the one process's."""
    c, n = results["c"], results["processes"]
    out: dict[str, Any] = {
        "processes": n, "tok_per_s": c["tok_per_s"],
        "per_process_tok_per_s": [r["tokens"] / r["seconds"] for r in c.get("ranks", []) if r.get("seconds")]}
    if baseline:
        out.update(baseline_tok_per_s=baseline, efficiency=c["tok_per_s"] / (n * baseline))
    return out


WRITER_WAIT_NOTED = 0.05  # the GPU waited for the writer this share of its time or more: the summary says so


def _writer_note(c: dict[str, Any]) -> list[str]:
    """A line when (c)'s GPU waited for the writer WRITER_WAIT_NOTED of its time or more: how long, the writer's
    rate, and where its checksums ran on zlib, that zlib-ng (the gpu extra) computes them about twice as fast."""
    pipe = c.get("pipeline") or {}
    waited, gpu = pipe.get("gpu_waited_for_writer_seconds"), pipe.get("gpu_seconds")
    if not (waited and gpu) or waited < WRITER_WAIT_NOTED * gpu:
        return []
    rate = f" (busy at {c['writer_gb_per_s']:.2f} GB/s)" if "writer_gb_per_s" in c else ""
    hint = ("; its CRC-32 ran on zlib: pip install zlib-ng (hsx's gpu extra) checksums about twice as fast"
            if c.get("crc32") == "zlib" else "")
    return [f"(c): the GPU waited {waited:.2f} s of {gpu:.2f} s for the writer{rate}{hint}"]


def flop_rate(tflops: float) -> str:
    """A measured matmul rate with three significant figures: a CPU's rate of a few hundredths, printed with one
    decimal as zero TFLOP/s, read as if nothing was measured, beside an MFU taken against it."""
    return f"{tflops:,.1f} TFLOP/s" if tflops >= 10 else f"{tflops:.3g} TFLOP/s" if tflops >= 1 else \
        f"{tflops * 1e3:.3g} GFLOP/s"


def format_table(r: dict[str, Any]) -> str:
    lines = ["| run | rows | tok/s | MFU | padding | peak GiB | vs (c) |", "|---|---|---|---|---|---|---|"]
    for key, name in (("a", "(a) batch 1, output_hidden_states"), ("b", "(b) padded 32, dataset order"),
                      ("c", "(c) hsx extract")):
        if key not in r:
            continue
        x = r[key]
        if "oom" in x:
            lines.append(f"| {name} | {x['rows']:,} | out of memory | | | | |")
            continue
        ratio = f"{r['c_over_' + key]:.1f}×" if key != "c" and f"c_over_{key}" in r else ""
        peak = f"{x['peak_gpu_gib']:.1f}" if "peak_gpu_gib" in x else "n/a"  # (no GPU: a CPU run)
        lines.append(f"| {name} | {x['rows']:,} | {x['tok_per_s']:,.0f} | {x['mfu']:.1%} | {x['padding']:.1%} | "
                     f"{peak} | {ratio} |")
    c = r["c"]
    from hsx.target import fp8_gemm  # (a bench's JSON is formatted where it ran: torch is there)

    # (hsx.job: the JIT GEMMs' kernels, inside the warm-up)
    dg = "".join(f", {who}'s kernels {c[name + '_build']['seconds']:.1f} s"
                 for name, (who, _) in fp8_gemm.JIT_GEMMS.items() if c.get(f"{name}_build"))
    device = "GPU" if str(r.get("device", "")).startswith("cuda") else "CPU"  # (the loop's compute: CPU time there)
    lines.append(f"(c): {device} idle {c['gpu_idle']:.1%}, output {c['output_gb_per_s']:.2f} GB/s, warm-up "
                 f"{c['compile_warmup_seconds']:.1f} s (compile: {c['compile']}"
                 f"{', compiled' if c.get('compiled') else ''}{dg}), sdpa {c['sdpa_backend']}, "
                 f"packing {c.get('packing', 'none')}, "
                 f"token budget {c['token_budget']}, "
                 f"layers run {c['layers_run']}/{r['num_model_layers']}; matmul rate {flop_rate(r['matmul_tflops'])} "
                 f"(MFU's denominator, {r.get('dtype', '?')})")
    lines += _writer_note(c)
    if "scaling" in r:
        sc = r["scaling"]
        each = ", ".join(f"{x:,.0f}" for x in sc["per_process_tok_per_s"])
        eff = (f"; scaling efficiency {sc['efficiency']:.1%} against one process's {sc['baseline_tok_per_s']:,.0f} "
               "tok/s" if "efficiency" in sc else "; scaling efficiency: pass --scaling-baseline ONE.json, the same "
               "bench's --json in one process")
        lines.append(f"(c) over {sc['processes']} processes: {sc['tok_per_s']:,.0f} tok/s in all; each process "
                     f"{each} tok/s{eff}")
    g = c.get("gpu_clocks") or {}
    if "busy_sm_clock_mhz" in g:
        top = f" of {g['max_sm_clock_mhz']}" if "max_sm_clock_mhz" in g else ""
        lines.append(f"(c) GPU while busy: SM clock {g['busy_sm_clock_mhz']:,.0f}{top} MHz, "
                     f"{g['busy_power_w']:.0f} W, power-capped in {g['power_capped_share']:.0%} of "
                     f"{g['busy_samples']} samples")
    if "storage" in r:
        s = r["storage"]
        direct = ", ".join(f"{w['block_bytes'] >> 20} MiB x {w['in_flight']} {w['gb_per_s']:.2f}"
                           for w in s.get("direct", [])) or "n/a"
        writer = (f"; the writer, busy {c['writer_gb_per_s']:.2f} GB/s = {s['writer_share']:.0%}"
                  if "writer_share" in s else "")
        lines.append(f"storage ({s['filesystem'] or '?'}, {s['bytes'] / 1e9:.2f} GB until fsync): buffered "
                     f"{s['buffered_gb_per_s']:.2f} GB/s, O_DIRECT (block x writes in flight) {direct} GB/s; (c) "
                     f"wrote {c['output_gb_per_s']:.2f} GB/s = {s['hsx_share']:.0%} of the best ({s['best']})"
                     f"{writer} (write mode {c.get('write_mode')})")
        if "writer_alone" in s:
            w, gpu_s = s["writer_alone"], c.get("pipeline", {}).get("gpu_seconds")
            gpu = (f"; the {device} alone {c['output_bytes'] / gpu_s / 1e9:.2f} GB/s (output / {device} time)"
                   if gpu_s else "")
            lines.append(f"the writer alone ({w['mode']}, {w['units']} units of {w['unit_bytes'] / 1e6:,.0f} MB, "
                         f"each fsynced): {w['gb_per_s']:.2f} GB/s = {s['writer_alone_share']:.0%} of the storage's "
                         f"best{gpu}")
    return "\n".join(lines)


# ---- the FP8 GEMMs alone (`hsx bench --gemms`) ---------------------------------------------------------------------

# bf16 `x @ w.t()`, then hsx.target.fp8_gemm's block-scaled GEMMs (Triton left out)
GEMM_BENCH = ("bf16", "cublas", "deepgemm", "fbgemm", "flashinfer")


def bench_gemms(shapes: list[str], tokens: int, log=print) -> dict[str, Any]:
    """TFLOP/s of each FP8 linear shape of the named model shapes at `tokens` rows: bf16 against
    hsx.target.fp8_gemm's cuBLAS, DeepGEMM, fbgemm and flashinfer block-scaled GEMMs where installed (activations
    already quantized: the GEMM alone, the weight scales' transposed copy fbgemm takes included; DeepGEMM's and
    flashinfer's kernels compiled by the first, untimed call), best of
    3 × 20 calls; each FP8 product's relative error against the float32 product on its first 256 rows; and the time
    of all the model's linears per `tokens` tokens."""
    import torch

    from hsx.cost import shape_config
    from hsx import bench_models
    from hsx.errors import HsxError
    from hsx.target import fp8, fp8_gemm
    from hsx.target.model import text_config_of

    if not torch.cuda.is_available() or not fp8.has_fp8_tensor_cores(torch.device("cuda")):
        raise HsxError("--gemms measures FP8 GEMMs: it needs a CUDA GPU with FP8 tensor cores (8.9+)")
    device = torch.device("cuda", torch.cuda.current_device())
    results: dict[str, Any] = {"tokens": tokens, "device_name": torch.cuda.get_device_name(device),
                               "versions": _versions(), "shapes": {}}
    missing = {name: fp8_gemm.gemm(name)[1] for name in GEMM_BENCH[1:] if fp8_gemm.gemm(name)[0] is None}
    if missing:
        results["not_run"] = missing
    for shape in shapes:
        counts = bench_models.linear_shapes(text_config_of(shape_config(shape)))
        rows, totals = [], {name: 0.0 for name in GEMM_BENCH}
        for (n, k), count in sorted(counts.items()):
            row = _gemm_row(device, tokens, n, k, missing)
            row["count"] = count
            for name in GEMM_BENCH:
                if isinstance(row.get(name), float) and totals[name] is not None:
                    totals[name] += count * 2.0 * tokens * n * k / (row[name] * 1e12)
                else:
                    totals[name] = None
            rows.append(row)
        results["shapes"][shape] = {"linears": rows, "seconds_all_linears": totals}
        log(format_gemms(shape, tokens, rows, totals))
    if missing:
        log("  not run: " + "; ".join(f"{k}: {v}" for k, v in missing.items()))
    return results


def _gemm_row(device, tokens: int, n: int, k: int, missing: dict[str, str]) -> dict[str, Any]:
    import torch

    from hsx.errors import one_line
    from hsx.target import fp8, fp8_gemm

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, k, device=device, generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, generator=g, dtype=torch.bfloat16) * 0.02
    wq, ws = fp8.quantize_weight(w)
    xq, xs = fp8_gemm.fp8_quantize(x)
    want = fp8.reference_mm(xq[:256], xs[:256], wq, ws, torch.float32)
    row: dict[str, Any] = {"n": n, "k": k, "bf16": _tflops(lambda: x @ w.t(), tokens, n, k, device)}
    for name in GEMM_BENCH[1:]:
        if name in missing:
            continue
        run = fp8_gemm.gemm(name)[0]
        try:
            got = run(xq, xs, wq, ws)[:256]
            row[f"{name}_error"] = fp8.relative_error(got, want)
            row[name] = _tflops(lambda: run(xq, xs, wq, ws), tokens, n, k, device)
        except Exception as e:  # noqa: BLE001  (a shape or build the GEMM does not take: reported, not fatal)
            row[name] = f"{type(e).__name__}: {one_line(e, 120)}"
    return row


def _tflops(fn, m: int, n: int, k: int, device) -> float:
    from hsx.cost import best_seconds

    return 2.0 * m * n * k / best_seconds(fn, device) / 1e12


def format_gemms(shape: str, tokens: int, rows: list[dict[str, Any]], totals: dict[str, float | None]) -> str:
    def rate(row, name):
        v = row.get(name)
        if isinstance(v, float):
            err = row.get(f"{name}_error")
            return f"{v:,.0f}" + (f" ({err:.1e})" if err is not None else "")
        return "–" if v is None else "failed"

    lines = [f"{shape}, M = {tokens:,} tokens: TFLOP/s (relative error against float32)",
             "| N × K | per model | bf16 | cuBLAS block-scaled | DeepGEMM | fbgemm groupwise | flashinfer |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['n']} × {row['k']} | {row['count']} | "
                     + " | ".join(rate(row, name) for name in GEMM_BENCH) + " |")
    base = totals["bf16"]
    cells = [f"{t * 1e3:,.1f} ms" + (f" ({base / t:.2f}×)" if base and name != "bf16" else "")
             if t else "–" for name, t in ((name, totals.get(name)) for name in GEMM_BENCH)]
    lines.append("| all linears | | " + " | ".join(cells) + " |")
    failed = [f"{row['n']}×{row['k']} {name}: {row[name]}" for row in rows for name in GEMM_BENCH
              if isinstance(row.get(name), str)]
    return "\n".join(lines + failed)
