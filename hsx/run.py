"""`hsx extract`: wires config → data → buckets → model → capture → extract → sink. The one module that knows
about processes and ranks.

A job tokenizes once (cached under .hsx/), plans units (bucket, then sample_id order), skips units the manifest
says are committed, and runs one `datasets.map` per remaining unit with the pipelined GPU function; each unit is
committed as soon as its map returns. Running the same command again continues; a complete dir is a no-op.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Any

from hsx import __version__
from hsx.buckets import plan_units
from hsx.config import LAYER_CONVENTION, ExtractConfig, HsxError, resolve_layers
from hsx.sink import Committer, OutputDir, dataset_card, features, job_fingerprint

CPU_TOKEN_BUDGET = 4096
UNIT_BYTES = 2 << 30  # a unit (one file) holds about this much: ~1 s of H200 output, a comfortable Hub file size


@dataclass
class Process:
    rank: int
    world_size: int
    device: Any  # torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def current_process() -> Process:
    import torch

    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return Process(rank=rank, world_size=world, device=device)


def command_line() -> str:
    return "hsx " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv and sys.argv[0] else "hsx extract"


def extract(cfg: ExtractConfig, log=print, model=None) -> dict[str, Any]:
    """Run (or continue) the job; returns the summary that is also written to hsx.json.

    `model` (a LoadedModel) skips loading: `hsx bench` passes the random-weight model it built."""
    from hsx import data

    proc = current_process()
    if proc.world_size > 1:
        raise HsxError("multi-process runs are not supported yet; run one process")
    out = OutputDir(cfg.output_dir)
    t_start = time.perf_counter()
    with out.locked():
        if model is None:
            model_path, revision, text = _model_facts(cfg)
            num_layers = int(text.num_hidden_layers)
            layers, final_hidden = resolve_layers(cfg.layers, num_layers, cfg.final_hidden)
        else:
            model_path, revision, text = model.model_path, model.revision, model.text_config
            num_layers, layers, final_hidden = model.num_model_layers, model.layers, model.final_hidden
        raw = data.load_input(cfg)
        tokenizer = _tokenizer(cfg, model_path) if data.row_format(raw.column_names) != "input_ids" else None
        raw = data.load_input(cfg)
        hidden = int(text.hidden_size)
        bytes_per_token = 2 * (len(layers) + int(final_hidden)) * hidden
        unit_tokens = cfg.unit_tokens or max(1024, UNIT_BYTES // bytes_per_token)
        template_sha = data.chat_template_sha256(tokenizer) if tokenizer is not None else None
        job = job_fingerprint({
            "model": cfg.model, "revision": revision, "tokenizer": cfg.tokenizer, "layers": layers,
            "final_hidden": final_hidden, "storage_dtype": cfg.storage_dtype, "dtype": cfg.dtype,
            "max_length": cfg.max_length, "chat_template_sha256": template_sha,
            "chat_template_kwargs": cfg.chat_template_kwargs, "input": data.input_fingerprint(cfg, raw),
            "limit": cfg.limit, "unit_tokens": unit_tokens, "hsx_version": ".".join(__version__.split(".")[:2]),
        })
        state = out.claim(job, cfg.overwrite)
        if state == "complete":
            info = out.read_info()
            log(f"hsx: {cfg.output_dir} is already complete ({info['counts']['rows_written']:,} rows); nothing to do")
            return info
        if state == "resume":
            log(f"hsx: continuing the job in {cfg.output_dir}")

        tokenized = data.tokenize(raw, tokenizer, cfg, str(out.state / "tokenized" / "tokens.arrow"),
                                  fingerprint=f"hsx-tok-{job['fingerprint'][:24]}", vocab_size=int(text.vocab_size))
        if cfg.strict and (bad := data.first_skipped(tokenized)):
            raise HsxError(f"--strict: input row {bad[0]} of {cfg.dataset} cannot be used: {bad[1]}")
        sample_ids, num_tokens, positions, skipped, truncated = data.usable_rows(tokenized)
        order, units = plan_units(sample_ids, num_tokens, cfg.max_length, unit_tokens)
        done = out.done_units()
        pending = [u for u in units if u.name not in done]
        ordered = tokenized.select(positions[order]).select_columns(
            ["sample_id", "input_ids", "loss_mask", "num_tokens"])

        stats = {"seconds": 0.0, "gpu_seconds": 0.0, "tokens": 0, "padded_tokens": 0}
        if pending:
            stats = _run_units(cfg, proc, out, ordered, pending, layers, final_hidden, hidden, model)
        elif units:
            log("hsx: every unit is already written; finalizing")

        done = out.done_units()
        missing = [u.name for u in units if u.name not in done]
        if missing:
            raise HsxError(f"{len(missing)} unit(s) were not written ({missing[0]}, ...); run the command again")
        oom = sum(r.get("skipped_oom", 0) for r in done.values())
        if oom:
            skipped = dict(sorted({**skipped, "oom": skipped.get("oom", 0) + oom}.items()))
        info = {
            "model": cfg.model, "model_path": model_path, "revision": revision,
            "tokenizer": cfg.tokenizer or cfg.model, "layers": layers, "final_hidden": final_hidden,
            "layer_convention": LAYER_CONVENTION, "hidden_size": hidden, "num_model_layers": num_layers,
            "storage_dtype": cfg.storage_dtype, "max_length": cfg.max_length,
            "chat_template_sha256": template_sha,
            "counts": {
                "rows_in": len(raw),
                "rows_written": sum(r["rows"] for r in done.values()),
                "tokens_written": sum(r["tokens"] for r in done.values()),
                "truncated": truncated,
                "skipped": skipped,
            },
            "units": len(units), "world_size": proc.world_size, "hsx_version": __version__,
            "config": {**cfg.to_dict(), "layers": layers, "final_hidden": final_hidden},
            "fingerprint": job["fingerprint"], "run": stats, "complete": True,
        }
        out.finalize(info, dataset_card(info, command_line()),
                     features=features(len(layers) * hidden, hidden, final_hidden))
        wall = time.perf_counter() - t_start
        c = info["counts"]
        log(f"hsx: wrote {c['rows_written']:,} rows, {c['tokens_written']:,} tokens to {cfg.output_dir} "
            f"({len(units)} files); skipped {json.dumps(c['skipped'])}; truncated {c['truncated']}")
        if stats["tokens"]:
            pad = 1 - stats["tokens"] / max(1, stats["padded_tokens"])
            mfu = f", MFU {stats['mfu']:.1%}" if "mfu" in stats else ""
            log(f"hsx: {stats['tokens'] / max(stats['seconds'], 1e-9):,.0f} tok/s{mfu} over {stats['seconds']:.1f} s "
                f"of extraction ({wall:.1f} s in all), padding {pad:.1%}, "
                f"GPU busy {stats['gpu_seconds'] / max(stats['seconds'], 1e-9):.0%}")
        return info


def _model_facts(cfg: ExtractConfig):
    from transformers import AutoConfig

    from hsx.model import resolve_model_path, text_config_of

    model_path, revision = resolve_model_path(cfg.model, cfg.revision, cfg.trust_remote_code)
    try:
        text = text_config_of(AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.trust_remote_code))
    except (OSError, ValueError, KeyError) as e:
        raise HsxError(f"cannot read the config of model {cfg.model!r}: {str(e).splitlines()[0]}") from None
    return model_path, revision, text


def _tokenizer(cfg: ExtractConfig, model_path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(cfg.tokenizer or model_path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise HsxError(f"cannot load tokenizer {cfg.tokenizer or cfg.model!r}: {str(e).splitlines()[0]}") from None


def _run_units(cfg: ExtractConfig, proc: Process, out: OutputDir, ordered, pending, layers: list[int],
               final_hidden: bool, hidden: int, loaded=None) -> dict[str, Any]:
    import datasets
    import torch
    from tqdm.auto import tqdm

    from hsx.extract import Extractor, Pipeline
    from hsx.model import load_model
    from hsx.plan import auto_token_budget, flops, layer_params, measure_matmul_tflops

    device = proc.device
    cuda = device.type == "cuda"
    loaded = loaded or load_model(cfg, device)
    width = len(layers) * hidden + (hidden if final_hidden else 0)
    if cfg.token_budget:
        budget = cfg.token_budget
    elif cuda:
        budget = auto_token_budget(loaded.text_config, width, torch.cuda.mem_get_info(device)[0], cfg.max_length)
    else:
        budget = CPU_TOKEN_BUDGET
    use_compile = cfg.compile == "on" or (cfg.compile == "auto" and cuda)
    extractor = Extractor(loaded, device, budget, compile_model=use_compile, sdpa_backend=cfg.sdpa_backend)
    feats = features(len(layers) * hidden, hidden, final_hidden)
    peak_tflops = measure_matmul_tflops(device) if cuda else None
    per_layer = layer_params(loaded.text_config)

    def unit_rows(u):
        return ordered.select(range(u.start, u.stop)).with_format("arrow")

    def batches():
        for u in pending:
            yield from unit_rows(u).iter(u.batch_size(budget))

    max_batch = max(u.batch_size(budget) * u.upper_bound for u in pending)
    total_tokens = sum(u.tokens for u in pending)
    bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, desc="extracting", disable=not proc.is_main,
               dynamic_ncols=True)
    stats = {"seconds": 0.0, "gpu_seconds": 0.0, "tokens": 0, "padded_tokens": 0, "flops": 0.0,
             "token_budget": budget, "compile": use_compile, "device": str(device),
             "sdpa_backend": cfg.sdpa_backend if cuda else "n/a"}
    pipeline = Pipeline(extractor, batches(), max_batch)
    committer = Committer(out)
    progress_was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    t0 = time.perf_counter()
    try:
        for u in pending:
            counts = {"rows": 0, "tokens": 0, "skipped_oom": 0}

            def step(table, _counts=counts):
                result_table = pipeline(table)
                r = pipeline.last
                _counts["rows"] += result_table.num_rows
                _counts["tokens"] += r.tokens
                _counts["skipped_oom"] += int((~r.kept).sum())
                stats["tokens"] += r.tokens
                stats["padded_tokens"] += r.padded_tokens
                stats["gpu_seconds"] += extractor.gpu_seconds(r)
                stats["flops"] += flops(loaded.text_config, loaded.depth,
                                        result_table.column("num_tokens").to_numpy(), per_layer)
                bar.update(int(table.column("num_tokens").to_numpy().sum()))
                elapsed = time.perf_counter() - t0
                mfu = f", MFU {stats['flops'] / elapsed / (peak_tflops * 1e12):.0%}" if peak_tflops else ""
                bar.set_postfix_str(f"{stats['tokens'] / max(elapsed, 1e-9):,.0f} tok/s{mfu}", refresh=False)
                return result_table

            committer.check()
            unit_rows(u).map(
                step, batched=True, batch_size=u.batch_size(budget), features=feats,
                cache_file_name=str(out.unit_tmp(u.name)), new_fingerprint=f"hsx-{u.name}-{os.getpid()}",
                writer_batch_size=max(1, (2**31 - 1) // (u.upper_bound * width)), load_from_cache_file=False,
            )
            pipeline.release()
            committer.submit(u.name, counts)
        committer.join()
    finally:
        committer.close()
        pipeline.close()
        bar.close()
        if progress_was_on:
            datasets.enable_progress_bars()
    stats["seconds"] = time.perf_counter() - t0
    stats.update(gpu_waited_for_writer_seconds=pipeline.wait_seconds, map_waited_for_gpu_seconds=pipeline.map_wait_seconds,
                 write_seconds=pipeline.write_seconds)
    if peak_tflops:
        stats["matmul_tflops"] = peak_tflops
        stats["mfu"] = stats["flops"] / stats["seconds"] / (peak_tflops * 1e12)
    return stats
