"""The job as named steps: start (or resume) → tokenize → units → engine → commit → finish.

`hsx.run.extract` runs them all with an output dir: it starts (or resumes) the job in the dir, tokenizes once
into the dir's cache, plans units, runs the engine over this rank's units, commits each unit's file as its
`datasets.map` returns, and finishes with hsx.json and the card. `hsx.run.stream` runs tokenize → units → engine
only and hands the rows to a training loop. Both compute the same rows in the same order: what tokenization
keeps, in units planned the same way, through the same Extractor and Pipeline.

Each step takes what the one before returned: `Job.prepare` (the target, hsx.target.model.Target: the model's facts and
layers, read once; the input; the job's fingerprint) → `Job.start_or_resume` + `Job.tokenize_into`, or `Job.tokenize`
(tokenized rows) → `Job.units` (`Units`: the ordered rows, the units, the input's counts) → `Extraction` (the
model hsx.target.ready makes ready → Extractor → Pipeline; `RunStats`, `UnitCounts`) → `commit_units` → `finish`
(hsx.json). Processes and ranks are run.py's: the steps take its `Process`.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hsx import ledgers
from hsx.buckets import UNIT_PLAN, Unit, plan_units
from hsx.card import dataset_card
from hsx.config import LAYER_CONVENTION, ExtractConfig, HsxError
from hsx.fingerprint import (fresh_digests_only, job_fingerprint, model_identity, recorded_job,
                             tokenizer_identity)
from hsx.info import combine_rank_stats, complete_info, info_features, recorded_info
from hsx.schema import ROW_COLUMNS, RUN_VARIANT_KEYS
from hsx.sink import Committer, OutputDir
from hsx.version import __version__
from hsx.vocab import write_token_frequencies

if TYPE_CHECKING:
    from hsx.target.model import Target

RANK_STATS_WAIT_SECONDS = 60.0
UNIT_BYTES = 2 << 30  # a unit (one file) holds about this much: seconds of a GPU's output, a comfortable Hub file size


# ---- the model's facts and the input: Job.prepare ----------------------------------------------------------------

@dataclass
class InputCounts:
    """What tokenization did to the input: rows read, rows cut at max_length, rows skipped by reason."""
    rows_in: int
    truncated: int
    skipped: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return {"rows_in": self.rows_in, "truncated": self.truncated, "skipped": self.skipped}


@dataclass
class Units:
    """The units step's output: the usable rows in output order (bucket, then sample_id), cut into units."""
    ordered: Any  # datasets.Dataset: sample_id, input_ids, loss_mask, num_tokens
    all: list[Unit]
    counts: InputCounts


@dataclass
class Job:
    """One job's inputs, read once: the target model, the input rows, the tokenizer, and the fingerprint that
    names the tokenization cache and the output dir's job."""
    cfg: ExtractConfig
    proc: Any  # hsx.run.Process
    target: Target
    raw: Any  # datasets.Dataset: the input split
    tokenizer: Any  # None for pre-tokenized input
    mask: dict[str, Any]  # {"method", "version"}: a new version re-tokenizes
    template_sha: str | None
    unit_tokens: int
    identity: dict[str, Any]  # job_fingerprint's record: {"fingerprint", ...}
    say: Any = print

    @classmethod
    def prepare(cls, cfg: ExtractConfig, proc, model=None, say=print) -> Job:
        from hsx import data, inputs
        from hsx.target.model import read_target

        began_ns = time.time_ns()
        target = read_target(cfg, model)
        raw = inputs.load_input(cfg)
        tokenizer = _tokenizer(cfg, target.model_path) if data.row_format(raw.column_names) != "input_ids" else None
        unit_tokens = cfg.unit_tokens or max(1024, UNIT_BYTES // target.format.bytes_per_token)
        template_sha = data.chat_template_sha256(tokenizer) if tokenizer is not None else None
        plain = data.plain_completion(raw, cfg)
        mask = data.mask_record(raw.column_names, tokenizer, plain)
        if cfg.prompt_completion == "text" and not plain:  # a recipe's key that this dataset leaves unused: said
            fmt = data.row_format(raw.column_names)
            what = ("prompt and completion columns hold messages, not strings" if fmt.startswith("prompt+") else
                    f"rows are {fmt!r}, not string prompt and completion columns")
            say(f"hsx: --prompt-completion text does not apply: {cfg.dataset}'s {what}; they are read as they are "
                "(chat rows with the template, loss on the assistant turns)")
        # local inputs are identified by content: rank 0 hashes them, the other ranks hit its cache. Where the
        # dir holds a job already, the fingerprint decides whether it continues: no digest older than this
        # launch stands in for reading the files (hsx.fingerprint).
        decides = bool(cfg.output_dir) and (OutputDir(cfg.output_dir).state / "job.json").exists()

        def identity_of():
            with fresh_digests_only(began_ns) if decides else contextlib.nullcontext():
                return job_fingerprint(_identity(cfg, target, raw, template_sha, mask),
                                       given={"model": cfg.model, "tokenizer": cfg.tokenizer, "input": cfg.dataset})

        identity = proc.in_turns(identity_of)
        return cls(cfg, proc, target, raw, tokenizer, mask, template_sha, unit_tokens, identity, say)

    @property
    def fingerprint(self) -> str:
        return self.identity["fingerprint"]

    # ---- start (or resume) → tokenize ----

    def start_or_resume(self, out: OutputDir, leads: bool) -> str:
        """Start (or resume) the job in the output dir, in turns (`Process.in_turns`): the first process of the ranks
        writing into it (`leads`: hsx.run.DirShare) checks its units and, with --overwrite, clears it; the others
        then find the job there. Returns the dir's state: new, resume or complete."""
        cfg = self.cfg

        def start():
            state = out.start_or_resume(self.identity, cfg.overwrite and leads, check_crc=cfg.check_crc,
                                        log=self.say, check=leads)
            if state != "complete":
                out.clear_tmp()
            return state

        return self.proc.in_turns(start, leads)

    def tokenize_into(self, out: OutputDir, leads: bool):
        """Tokenize once into the output dir's cache, in turns: the first process of each dir (`leads`) finds
        rank 0's cache there when the dir is shared, and tokenizes for its dir when each node writes its own."""
        return self.proc.in_turns(lambda: self._tokenize(str(out.state / "tokenized" / "tokens.arrow")), leads)

    def tokenize(self, cache_file: str):
        """Tokenize into `cache_file` without an output dir (a stream), in turns as `tokenize_into`; a cache
        file already there for this job's fingerprint is reused."""
        return self.proc.in_turns(lambda: self._tokenize(cache_file))

    def _tokenize(self, cache_file: str):
        from hsx import data

        return data.tokenize(self.raw, self.tokenizer, self.cfg, cache_file,
                             fingerprint=f"hsx-tok-{self.fingerprint[:24]}", vocab_size=self.target.vocab_size)

    def check_strict(self, tokenized) -> None:
        from hsx import data

        if self.cfg.strict and (bad := data.first_skipped(tokenized)):
            from hsx.schema import SKIP_REASONS

            raise HsxError(f"--strict: input row {bad[0]} of {self.cfg.dataset} cannot be used: {bad[1]} "
                           f"({SKIP_REASONS.get(bad[1], 'see docs/inputs.md')})")

    # ---- units ----

    def units(self, tokenized) -> Units:
        """The usable rows in output order, cut into units of about `unit_tokens` (a job with none is refused)."""
        from hsx import data

        sample_ids, num_tokens, positions, skipped, truncated = data.usable_rows(tokenized)
        counts = InputCounts(rows_in=len(self.raw), truncated=truncated, skipped=skipped)
        if len(sample_ids) == 0:
            refuse_empty(self.cfg, {"rows_in": counts.rows_in, "skipped": skipped}, written=False)
        order, units = plan_units(sample_ids, num_tokens, self.cfg.max_length, self.unit_tokens)
        ordered = tokenized.select(positions[order]).select_columns(list(ROW_COLUMNS))
        return Units(ordered=ordered, all=units, counts=counts)

    def summary(self, units: Units) -> dict[str, Any]:
        """What hsx.json says that does not depend on the run: written before the engine runs, so `hsx merge` can
        finish a job whose ranks each wrote their own dir."""
        cfg, t = self.cfg, self.target
        return {
            "model": cfg.model, "model_path": t.model_path, "revision": t.revision,
            "tokenizer": cfg.tokenizer or cfg.model, "layers": t.layers, "final_hidden": t.final_hidden,
            "layer_convention": LAYER_CONVENTION, "hidden_size": t.hidden_size, "num_model_layers": t.num_layers,
            "vocab_size": t.vocab_size,
            "storage_dtype": cfg.storage_dtype, "max_length": cfg.max_length, "chat_template_sha256": self.template_sha,
            "loss_mask": self.mask, "counts": units.counts.as_dict(),
            "unit_names": [u.name for u in units.all], "hsx_version": __version__,
            "config": {**cfg.to_dict(), "layers": t.layers, "final_hidden": t.final_hidden,
                       "unit_tokens": self.unit_tokens},
            "fingerprint": self.fingerprint, "command": command_line(),
            **({"layers_from": t.layers_from} if t.layers_from else {}),
        }


def _identity(cfg: ExtractConfig, target: Target, raw, template_sha: str | None, mask: dict) -> dict[str, Any]:
    """What the job's fingerprint is made of: everything that changes which rows, tokens or states are written."""
    from hsx import inputs

    return {
        "model": model_identity(cfg.model, target.model_path, cfg.trust_remote_code), "revision": target.revision,
        "tokenizer": tokenizer_identity(cfg.tokenizer, cfg.trust_remote_code), "layers": target.layers,
        "final_hidden": target.final_hidden, "storage_dtype": cfg.storage_dtype, "dtype": cfg.dtype,
        "max_length": cfg.max_length, "chat_template_sha256": template_sha,
        "chat_template_kwargs": cfg.chat_template_kwargs, "input": inputs.input_fingerprint(cfg, raw),
        # unit_tokens as given: the derived default follows from layers, dtype and model, already in here (so
        # changing only --layers reports `differs in: layers`, not unit_tokens too)
        "limit": cfg.limit, "unit_tokens": cfg.unit_tokens, "unit_plan": UNIT_PLAN, "nonfinite": cfg.nonfinite,
        "topk_logits": cfg.topk_logits,
        # (only with a policy: an output without one keeps its fingerprint)
        **({"teacher_policy": [cfg.teacher_policy, cfg.teacher_top_p, cfg.teacher_temperature]}
           if cfg.teacher_policy else {}),
        "hsx_version": ".".join(__version__.split(".")[:2]), "loss_mask": mask,
        **_quantization_identity(target.text),
    }


def _quantization_identity(text) -> dict[str, Any]:
    """The target's FP8 quantization, when it has one (an unquantized target's fingerprint is unchanged)."""
    from hsx.target.fp8 import quantization_of

    quant = quantization_of(text)
    return {"quantization": quant.record()} if quant is not None else {}


def command_line() -> str:
    return "hsx " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv and sys.argv[0] else "hsx extract"


def _tokenizer(cfg: ExtractConfig, model_path: str):
    from transformers import AutoTokenizer

    from hsx.target.checkpoint import check_model_files

    check_model_files(cfg.tokenizer or model_path)  # (its files' sizes, before transformers reads them whole)
    try:
        return AutoTokenizer.from_pretrained(cfg.tokenizer or model_path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, RecursionError) as e:  # (RecursionError: JSON nested too deeply)
        raise HsxError(f"cannot load tokenizer {cfg.tokenizer or cfg.model!r}: {str(e).splitlines()[0]}") from None


# ---- engine ------------------------------------------------------------------------------------------------------

@dataclass
class UnitCounts:
    """What the engine did with one unit's rows (a manifest record's counts)."""
    nonfinite_mode: str  # "skip" or "keep"
    rows: int = 0  # rows out
    tokens: int = 0  # their tokens
    skipped_oom: int = 0  # rows that did not fit in GPU memory alone
    nonfinite: int = 0  # rows with NaN/Inf states: dropped (skip) or flagged (keep)

    def add(self, other: UnitCounts) -> None:
        self.rows += other.rows
        self.tokens += other.tokens
        self.skipped_oom += other.skipped_oom
        self.nonfinite += other.nonfinite

    def as_record(self) -> dict[str, int]:
        nonfinite_key = "skipped_nonfinite" if self.nonfinite_mode == "skip" else "nonfinite_kept"
        return {"rows": self.rows, "tokens": self.tokens, "skipped_oom": self.skipped_oom,
                nonfinite_key: self.nonfinite}


@dataclass
class StreamCounts:
    """A stream's counts (`hsx.stream(...).counts`), in hsx.json's `counts` terms: the input's (every process reads
    all of it) once tokenized, then this process's rows and tokens as they are handed out."""
    input: InputCounts | None = None
    engine: UnitCounts | None = None  # set with `input`

    def as_dict(self) -> dict[str, Any]:
        if self.input is None:
            return {}
        e = self.engine
        skipped = dict(self.input.skipped)
        # rows the engine dropped count as skipped, under hsx.json's reasons
        for reason, n in (("oom", e.skipped_oom), ("nonfinite", e.nonfinite if e.nonfinite_mode == "skip" else 0)):
            if n:
                skipped[reason] = skipped.get(reason, 0) + n
        return {"rows_in": self.input.rows_in, "rows": e.rows, "tokens": e.tokens, "truncated": self.input.truncated,
                "skipped": dict(sorted(skipped.items())), "nonfinite": {"mode": e.nonfinite_mode, "rows": e.nonfinite}}


@dataclass
class RunStats:
    """This rank's run: hsx.json's `run` (or, with several ranks, one of its `ranks`). The engine's settings stay
    None on a rank that had no unit to run, and are left out of the record."""
    seconds: float = 0.0
    gpu_seconds: float = 0.0
    tokens: int = 0
    padded_tokens: int = 0
    flops: float | None = None
    token_budget: int | None = None
    compile: bool | None = None
    device: str | None = None
    tp_size: int | None = None
    model_copies: int | None = None
    writes: bool | None = None
    sdpa_backend: str | None = None
    packing: str | None = None
    experts_implementation: str | None = None  # what the MoE experts ran (left out without experts)
    fp8_gemm: str | None = None  # the block-scaled GEMM an FP8 target's linears ran (left out without one)
    kernels: dict[str, Any] | None = None
    # hsx.target.prepare.library_versions: the libraries that computed the states
    versions: dict[str, str] | None = None
    gpu_waited_for_writer_seconds: float | None = None
    map_waited_for_gpu_seconds: float | None = None
    write_seconds: float | None = None
    matmul_tflops: float | None = None
    mfu: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


class Extraction:
    """The job's engine step on this rank: the model made ready (hsx.target.ready), hsx.engine's Extractor and Pipeline
    over `units`' batches, in order, with the run's stats and progress bar. Call it on each batch (the
    function `datasets.map` runs, or a stream's loop), `release()` after each unit, and `close()` (or use it as a
    context manager) at the end: that stops the producer thread and frees the slots."""

    def __init__(self, cfg: ExtractConfig, proc, target: Target, ordered, units: list[Unit], loaded=None,
                 log=print, progress: bool = True, feed=None):
        """`feed`: the units to run, in order, when they are claimed as the job goes (hsx.claims.Claimed.feed);
        `units` are then those it may give (they size the batches and the progress bar); `loaded`: a model given
        (hsx bench's), which outlives the job, and so does its compile."""
        from tqdm.auto import tqdm

        from hsx.cost import layer_params, measure_matmul_tflops
        from hsx.engine import Extractor, Pipeline
        from hsx.target.prepare import library_versions
        from hsx.target.ready import ready_model

        self.cfg, self.ordered, self.units, self.log = cfg, ordered, units, log
        device = proc.device
        cuda = device.type == "cuda"
        self.ready = ready = ready_model(cfg, proc, target, loaded, log)
        self.loaded, self.budget = ready.loaded, ready.budget
        budget, kernels, fmt = ready.budget, ready.kernels, target.format
        self.values_per_token = fmt.values_per_token  # hidden states and the final-norm state
        self.extractor = Extractor(ready.loaded, device, budget, ready.prepared, sdpa_backend=cfg.sdpa_backend,
                                   nonfinite=cfg.nonfinite, fmt=fmt, teacher_top_p=cfg.teacher_top_p,
                                   teacher_temperature=cfg.teacher_temperature)
        self.features = fmt.features()
        self.peak_tflops = measure_matmul_tflops(device, fp8=ready.fp8_matmuls) if cuda else None
        self.per_layer = layer_params(ready.loaded.text_config)
        self.stats = RunStats(flops=0.0, token_budget=budget, compile=ready.compile, device=str(device),
                              tp_size=proc.tp_size, model_copies=proc.dp_size, writes=proc.writes,
                              sdpa_backend=cfg.sdpa_backend if cuda else "n/a", packing=ready.prepared.packing,
                              experts_implementation=kernels.get("experts_implementation"), fp8_gemm=ready.fp8_gemm,
                              kernels=kernels, versions=library_versions())
        max_batch = max((u.batch_size(budget) * u.upper_bound for u in units), default=budget)
        self.bar = tqdm(total=sum(u.tokens for u in units), unit="tok", unit_scale=True, desc="extracting",
                        disable=not (progress and proc.is_main), dynamic_ncols=True,
                        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, now "
                        "{rate_fmt}{postfix}]")
        self.counts = UnitCounts(cfg.nonfinite)  # the unit in progress (`start_unit`)
        self.pipeline = Pipeline(self.extractor, (t for u in (units if feed is None else feed)
                                                  for t in self.batches(u)), max_batch)
        self.t0 = time.perf_counter()
        self.closed = False

    def rows(self, unit: Unit):
        """The unit's rows, Arrow-formatted (what map and the pipeline read)."""
        return self.ordered.select(range(unit.start, unit.stop)).with_format("arrow")

    def batch_size(self, unit: Unit) -> int:
        return unit.batch_size(self.budget)

    def batches(self, unit: Unit):
        return self.rows(unit).iter(self.batch_size(unit))

    def start_unit(self) -> UnitCounts:
        self.counts = UnitCounts(self.cfg.nonfinite)
        return self.counts

    def __call__(self, table):
        """One batch: its output table (the input's columns plus the states, wrapping a pinned slot that is reused
        at the next call or `release()`), counted in `counts` and `stats`."""
        from hsx.cost import flops

        result_table = self.pipeline(table)
        r = self.pipeline.last
        c, s = self.counts, self.stats
        c.rows += result_table.num_rows
        c.tokens += int(result_table.column("num_tokens").to_numpy().sum())
        c.skipped_oom += int((~r.kept).sum())
        c.nonfinite += r.nonfinite_rows
        # followers count too: whichever rank finalizes reports its totals in hsx.json
        s.tokens += r.tokens
        s.padded_tokens += r.padded_tokens
        s.gpu_seconds += self.extractor.gpu_seconds(r)
        s.flops += flops(self.loaded.text_config, self.loaded.depth, result_table.column("num_tokens").to_numpy(),
                         self.per_layer)
        if not self.bar.disable:
            self.bar.update(int(table.column("num_tokens").to_numpy().sum()))
            elapsed = time.perf_counter() - self.t0
            mfu = f", MFU {s.flops / elapsed / (self.peak_tflops * 1e12):.0%}" if self.peak_tflops else ""
            # tqdm's own rate (left of the comma) is the recent one; this is the mean since the start
            self.bar.set_postfix_str(f"mean {s.tokens / max(elapsed, 1e-9):,.0f} tok/s{mfu}", refresh=False)
        return result_table

    def release(self) -> None:
        """The last table handed out is no longer read (map wrote it, or a stream copied its rows)."""
        self.pipeline.release()

    def close(self) -> RunStats:
        """Stop and join the producer thread and the compile worker, free the slots; the run's numbers."""
        s = self.stats
        if self.closed:
            return s
        self.closed = True
        try:
            self.pipeline.close()
        finally:
            if self.extractor.compiler is not None:
                self.extractor.compiler.close(finish=not self.ready.owns_model)
        self.bar.close()
        s.seconds = time.perf_counter() - self.t0
        s.gpu_waited_for_writer_seconds = self.pipeline.wait_seconds
        s.map_waited_for_gpu_seconds = self.pipeline.map_wait_seconds
        s.write_seconds = self.pipeline.write_seconds
        if self.peak_tflops:
            s.matmul_tflops = self.peak_tflops
            s.mfu = s.flops / s.seconds / (self.peak_tflops * 1e12)
        return s

    def __enter__(self) -> Extraction:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- commit ------------------------------------------------------------------------------------------------------

def commit_units(extraction: Extraction, proc, out: OutputDir, units: list[Unit], stop, on_commit=None) -> None:
    """One `datasets.map` per unit into its temporary file, committed (renamed, recorded in the manifest) by the
    Committer's thread while the next unit runs. Stops after the unit in progress when `stop` is set. `units`: a
    list, or units claimed as the loop goes (hsx.claims.Claimed: closed here, so the producer ends with the loop)."""
    import datasets

    from hsx.checksums import checksum_pool
    from hsx.schema import TOKEN_COLUMNS
    from hsx.writer import spares_for, unit_files, unit_fingerprint

    unit_rows, step, budget, feats = extraction.rows, extraction, extraction.budget, extraction.features
    # the widest column's values per token bound a record batch (Arrow's 2^31 values per array): a policy-only
    # output's widest is the policy's
    values_per_token = max(extraction.values_per_token, *(c.width for c in extraction.extractor.columns))
    job_fp = recorded_job(out.state).fingerprint
    progress_was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    unit_bytes = extraction.extractor.per_token + sum(c.nbytes for c in TOKEN_COLUMNS)  # (per token; rows add ~0.1%)
    spares = committer = crc_pool = None
    try:
        committer = Committer(out, on_commit=on_commit)
        crc_pool = checksum_pool()  # the writer's checksum threads, for every unit (hsx.writer)
        # hsx.writer: in memory, each unit's file is prepared while the one before is written (None elsewhere)
        # (claimed units come in an order not known ahead: no spare files prepared for them)
        spares = spares_for(out.tmp, [u.tokens * unit_bytes for u in units]
                            if proc.writes and isinstance(units, list) else [])
        window = None
        if extraction.cfg.max_pending_gb:  # train while extracting: wait for a trainer (hsx.follow) to catch up
            from hsx.follow import ConsumerWindow

            window = ConsumerWindow(out, extraction.cfg.max_pending_gb, extraction.log,
                                    in_flight=committer.in_flight)
        for u in units:
            if window is not None:
                window.wait(stop)
            if proc.agree_max(int(stop.is_set())):
                break
            counts = extraction.start_unit()
            if not proc.writes:  # a tensor-parallel follower: the same forwards as its group's writer, no output
                for table in extraction.batches(u):
                    extraction(table)
                extraction.release()
                continue
            committer.check()
            # hsx.writer: the bytes checksummed on the way out, on the job's checksum threads
            with unit_files(out.tmp, spares=spares, pool=crc_pool) as written:
                unit_rows(u).map(
                    step, batched=True, batch_size=u.batch_size(budget), features=feats,
                    cache_file_name=str(out.unit_tmp(u.name)), new_fingerprint=unit_fingerprint(job_fp, u.name),
                    writer_batch_size=max(1, (2**31 - 1) // (u.upper_bound * values_per_token)),
                    load_from_cache_file=False,
                )
            extraction.release()
            committer.submit(u.name, counts.as_record(), crc32=written.crc32(out.unit_tmp(u.name)))
        committer.join()
    finally:
        if not isinstance(units, list):
            units.close()
        if spares is not None:
            spares.close()
        if crc_pool is not None:
            crc_pool.shutdown(wait=True)
        if committer is not None:
            committer.close()
        if progress_was_on:
            datasets.enable_progress_bars()


def record_run(out: OutputDir, stats: RunStats, say, compare: bool = True) -> None:
    """Before this run commits a unit: with `compare` (one process per job), one notice naming each
    RUN_VARIANT_KEYS key whose value differs from one the units already in `out` were computed with, and which
    ranks computed them (every rank's .hsx/runs-<rank>.jsonl counts: a rank of an earlier run that ran with other
    flags is named even where other ranks ran with this run's). Those keys are outside the job's fingerprint, so a
    resume may change them, and the output then holds units whose states differ by the compute dtype's rounding
    (hsx.json's run.values_used lists every value). Then this run's values, recorded in the dir."""
    mine = {k: v for k, v in stats.as_dict().items() if k in RUN_VARIANT_KEYS}
    done = ledgers.done_units(out.state, out.data) if compare else {}
    other: dict[str, dict[tuple[str, Any], tuple[Any, list[str]]]] = {}  # key -> value -> (value, whose)
    for whose, used in ledgers.run_values_by_rank(out.state, done).items():
        for k, values in used.items():
            for v in values:
                if k in mine and not (type(v) is type(mine[k]) and v == mine[k]):
                    other.setdefault(k, {}).setdefault((type(v).__name__, v), (v, []))[1].append(whose)
    if other:
        say(f"hsx: notice: this run computes with {', '.join(f'{k} {mine[k]}' for k in other)}; units among the "
            f"{len(done)} already in {out.root} were computed with "
            f"{'; '.join(f'{k} ' + ' or '.join(f'{v} ({_named(w)})' for v, w in other[k].values()) for k in other)}"
            ": the output holds units whose states differ by the compute dtype's rounding (hsx.json's "
            "run.values_used lists every value)")
    ledgers.record_run(out.state, out.rank, out.session, mine)


def _named(whose: list[str], most: int = 8) -> str:
    """'rank 3', 'ranks 0, 2, 5', 'as hsx.json records' (units of an older hsx), at most `most` ranks named."""
    ranks = [w.removeprefix("rank ") for w in whose if w.startswith("rank ")]
    parts = [("rank " if len(ranks) == 1 else "ranks ") + ", ".join(ranks[:most])
             + (f" and {len(ranks) - most} more" if len(ranks) > most else "")] if ranks else []
    parts += ["as hsx.json records" if w == "hsx.json" else w for w in whose if not w.startswith("rank ")]
    return "; ".join(parts)


# ---- finish ------------------------------------------------------------------------------------------------------

def finish(cfg: ExtractConfig, proc, out: OutputDir, units: list[Unit], summary: dict, share,
           stats: dict[str, Any], t_start: float, log, pending: list[str] | None = None) -> dict[str, Any]:
    """This rank's units are committed: mark it done, and finalize (hsx.json, card, push) if every unit is in its
    dir. `share` (hsx.run.DirShare): the ranks writing into this dir, and the run's id. `pending`: the units no dir
    held when this run started (what it wrote, for its last line; default: all of them).

    Completion is tracked by the manifests each rank appends to (no collective at the end, which could time out
    when ranks finish far apart): whichever process sees every unit committed finalizes. When each node writes
    its own dir, a dir holds only its node's units: it stays unfinished (no hsx.json, the unfinished card) and
    `hsx merge` of the node dirs makes the whole output."""
    run_id, writers = share.run_id, len(share.ranks)
    all_ranks_done = (ledgers.mark_rank_done(out.state, run_id, proc.rank, writers, stats) if proc.world_size > 1
                      else True)
    # Read the manifests only after marking this rank done: read before, a rank that committed and marked in
    # between made this one see every rank done but that rank's last unit missing ("1 unit(s) were not written").
    done = ledgers.done_units(out.state, out.data)
    missing = [u.name for u in units if u.name not in done]
    if missing:
        if not all_ranks_done:
            log(f"hsx: rank {proc.rank}: my units are written; the last rank writing into {cfg.output_dir} to "
                "finish finalizes it")
            return {"complete": False, "rank": proc.rank, "run": stats}
        if not share.whole:  # this node's share of a job whose nodes each write their own dir
            ledgers.mark_share_done(out.state, len(units) - len(missing), len(units), proc.rank)
            log(f"hsx: {cfg.output_dir} holds {len(units) - len(missing)} of the job's {len(units)} units (this "
                "node's share; the other nodes' dirs hold the rest): once every node has finished, join them with "
                "`hsx merge OUT NODE_DIR...` (see docs/scale-out.md)")
            return {"complete": False, "rank": proc.rank, "units": len(units) - len(missing), "run": stats}
        raise HsxError(f"{len(missing)} unit(s) were not written ({missing[0]}, ...); run the command again")
    if not all_ranks_done:
        # Every unit is committed, so the other ranks are past their last commit and about to say they are done:
        # wait briefly for their numbers (not for a rank that died after its last commit).
        deadline = time.monotonic() + RANK_STATS_WAIT_SECONDS
        while len(ledgers.rank_stats(out.state, run_id)) < writers and time.monotonic() < deadline:
            time.sleep(0.2)
    with out.finalizing() as already:
        if already:
            return recorded_info(out.root).to_dict()
        if proc.world_size > 1:  # the job's numbers: every rank's, and their sum
            stats = {**stats, **combine_rank_stats(ledgers.rank_stats(out.state, run_id))}
        used = ledgers.run_values(out.state, done)  # (the keys above are the last run's; these, every run's)
        if used:
            stats = {**stats, "values_used": used}
        # dirs a `hsx merge --partial` linked units from: readers follow only those
        merged = ledgers.merged_sources(out.state)
        info = complete_info(summary, done, proc.world_size, {**stats, "merged_from": merged} if merged else stats)
        info["token_frequencies"] = write_token_frequencies(out, summary.get("vocab_size"))
        out.finalize(info, lambda i: dataset_card(i, summary["command"]), features=info_features(info))
    if cfg.push_to_hub:
        push(cfg, log)
    wall = time.perf_counter() - t_start
    c = info["counts"]
    log(f"hsx: {_what_was_written(out, units, pending, c, cfg.output_dir)}; skipped {json.dumps(c['skipped'])}; "
        f"truncated {c['truncated']}; rows with "
        f"NaN/Inf states: {c['nonfinite']['rows']} ({'skipped' if cfg.nonfinite == 'skip' else 'kept, flagged'})")
    if c["skipped"].get("generated_tokens_mismatch"):
        from hsx.schema import SKIP_REASONS

        log(f"hsx: {c['skipped']['generated_tokens_mismatch']} rows skipped as generated_tokens_mismatch: "
            f"{SKIP_REASONS['generated_tokens_mismatch']}")
    refuse_empty(cfg, c, written=True)
    if stats["tokens"]:
        pad = 1 - stats["tokens"] / max(1, stats["padded_tokens"])
        mfu = f", MFU {stats['mfu']:.1%}" if "mfu" in stats else ""
        busy = stats["gpu_seconds"] / max(stats["seconds"] * stats.get("processes", 1), 1e-9)  # per device
        log(f"hsx: {stats['tokens'] / max(stats['seconds'], 1e-9):,.0f} tok/s{mfu} over {stats['seconds']:.1f} s "
            f"of extraction ({wall:.1f} s in all), padding {pad:.1%}, "
            f"{'GPU' if str(stats.get('device', '')).startswith('cuda') else 'CPU'} busy {busy:.0%}")
    return info


def _what_was_written(out: OutputDir, units: list[Unit], pending: list[str] | None, counts: dict[str, Any],
                      where: str) -> str:
    """The end line's first part: what the output holds, and, after a resume, what this run wrote of it (a resumed
    run that wrote 13 rows of 96 must not say it wrote 96)."""
    whole = f"{counts['rows_written']:,} rows, {counts['tokens_written']:,} tokens to {where} ({len(units)} files)"
    if pending is None or len(pending) >= len(units):
        return f"wrote {whole}"
    done = ledgers.done_units(out.state, out.data)
    mine = [done[u] for u in pending if u in done]
    rows, tokens = sum(r.get("rows", 0) for r in mine), sum(r.get("tokens", 0) for r in mine)
    return (f"this run wrote {rows:,} rows, {tokens:,} tokens ({len(mine)} of the {len(units)} files; the others "
            f"were committed before); the output holds {whole.replace(' to ', ' in ', 1)}")


def refuse_empty(cfg: ExtractConfig, counts: dict[str, Any], written: bool) -> None:
    """A job that writes no row fails (unless --allow-empty), naming why every row was skipped: an empty
    training set is almost always a format the input was not in, and exit 0 would hide it until training."""
    if counts.get("rows_written", 0):
        return
    if cfg.allow_empty:
        if written:
            print(f"hsx: {cfg.output_dir} holds 0 rows (--allow-empty): hsx.load and load_dataset(..., "
                  "streaming=True) read it as empty; a plain load_dataset refuses an empty split ('corresponds to "
                  "no data')", file=sys.stderr)
        return
    where = (f"{cfg.output_dir} holds an empty dataset" if written else
             f"nothing was written (so {cfg.output_dir} holds no dataset)" if cfg.output_dir else "nothing to stream")
    raise HsxError(f"no usable rows: all {counts['rows_in']:,} input rows of {cfg.dataset} were skipped "
                   f"{json.dumps(counts['skipped'])}; {where}. Fix the input (`--strict` stops at the first bad "
                   "row), or pass --allow-empty if an empty output is expected")


def push(cfg: ExtractConfig, log) -> None:
    from hsx.hub import push_output

    push_output(cfg.output_dir, cfg.push_to_hub, private=cfg.hub_private, revision=cfg.hub_revision, log=log,
                overwrite=cfg.hub_overwrite)
