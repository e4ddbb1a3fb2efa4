"""`hsx extract`: wires config → data → buckets → model → capture → engine → sink. The one module that knows
about processes and ranks.

A job tokenizes once (cached under .hsx/), plans units (bucket, then sample_id order), skips units the manifest
says are committed, and runs one `datasets.map` per remaining unit with the pipelined GPU function; each unit is
committed as soon as its map returns. Running the same command again continues; a complete dir is a no-op.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hsx import __version__
from hsx.buckets import plan_units
from hsx.config import (LAYER_CONVENTION, ExtractConfig, HsxError, UsageError, check_config, check_topk_logits,
                        resolve_layers)
from hsx.engine import output_columns
from hsx.fingerprint import model_identity, tokenizer_identity
from hsx.sink import (Committer, OutputDir, combine_rank_stats, complete_info, dataset_card, features, info_features,
                      job_fingerprint)
from hsx.vocab import write_token_frequencies

CPU_TOKEN_BUDGET = 4096
RANK_STATS_WAIT_SECONDS = 60.0
UNIT_BYTES = 2 << 30  # a unit (one file) holds about this much: ~1 s of H200 output, a comfortable Hub file size


class Stopped(Exception):
    """SIGINT/SIGTERM: the job stopped cleanly after a unit; the same command continues it."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Process:
    rank: int
    world_size: int
    device: Any  # torch.device
    state: Any = None  # accelerate.PartialState when launched with several processes (and tp_size 1)
    devices: list = None  # the GPUs this process's model copy is spread over (one, unless --gpus-per-copy)
    local_rank: int = 0  # rank within this node
    tp_size: int = 1  # processes sharing one model copy (tensor parallel); copy k is ranks [k·tp, (k+1)·tp)
    tp_control: Any = None  # a gloo group of this copy's ranks, for decisions taken beside the forward's collectives
    store: Any = None  # the launcher's rendezvous store, for the job's barriers when each copy is its own world
    barriers: int = 0  # barriers passed, naming the next one's keys in `store`

    @property
    def dp_rank(self) -> int:  # which model copy this process belongs to
        return self.rank // self.tp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp_size

    @property
    def writes(self) -> bool:  # one process per model copy writes its output
        return self.rank % self.tp_size == 0

    def distributed_config(self):
        """from_pretrained's `distributed_config` for a sharded copy (None for a whole one): tensor parallel over
        the copy's own torch.distributed world (`_copy_world`)."""
        if self.tp_size == 1:
            return None
        from transformers import DistributedConfig

        return DistributedConfig(tp_plan="auto", tp_size=self.tp_size)

    def agree_max(self, value: int) -> int:
        """The largest `value` over this model copy's tensor-parallel ranks (they must take the same decisions:
        batch sizes, when to stop)."""
        if self.tp_control is None:
            return value
        import torch
        import torch.distributed as dist

        t = torch.tensor([value])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.tp_control)
        return int(t.item())

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.state is not None:
            self.state.wait_for_everyone()
        elif self.store is not None:  # every rank of the job, across copies: count in, wait for the last
            self.barriers += 1
            key = f"hsx/barrier/{self.barriers}"
            if self.store.add(key, 1) == self.world_size:
                self.store.set(key + "/open", "1")
            self.store.wait([key + "/open"])


def current_process(gpus_per_copy: int = 1, tp_size: int = 1) -> Process:
    """This process's rank and devices. Under `accelerate launch` / torchrun (WORLD_SIZE > 1) the process group
    comes from accelerate. hsx needs it only for barriers around tokenization, so it is always gloo on the CPU
    (accelerate's cpu=True state): that also works on machines without CUDA (where accelerate's default state
    is single-process in every rank, so each would process every row) and with several GPUs per process (NCCL
    refuses two ranks on one GPU). Process k of a node uses GPUs [k·G, (k+1)·G) for G = --gpus-per-copy.
    With --tp-size > 1 each model copy is its own world instead (`_copy_world`)."""
    from datetime import timedelta

    import torch

    world = int(os.environ.get("WORLD_SIZE", 1))
    if world % tp_size:
        raise HsxError(f"--tp-size {tp_size} with {world} processes: each model copy is sharded over --tp-size "
                       "processes, so launch a multiple of --tp-size processes")
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if tp_size > 1 and per_node % tp_size:  # copies are consecutive ranks: one would straddle two machines
        raise HsxError(f"--tp-size {tp_size} with {per_node} processes per machine: a model copy would span two "
                       "machines (its every layer waiting on the network); launch a multiple of --tp-size per machine")
    cuda = torch.cuda.is_available()
    torch.set_num_threads(cpu_threads(per_node, cpu_device=not cuda))
    # Ranks meet around tokenization (rank 0 tokenizes, the others wait): allow hours for a big dataset.
    timeout = timedelta(hours=6)
    state = store = tp_control = None
    rank = local = 0
    if world > 1 and tp_size > 1:
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            torch.cuda.set_device(local)  # before NCCL meets this rank (--gpus-per-copy is 1 with --tp-size)
        store, tp_control = _copy_world(rank, tp_size, world, "nccl" if cuda else "gloo", timeout)
    elif world > 1:
        from accelerate import PartialState

        state = PartialState(cpu=True, timeout=timeout)
        rank, world = state.process_index, state.num_processes
        local = int(os.environ.get("LOCAL_RANK", state.local_process_index))
    if not cuda:
        if gpus_per_copy > 1:
            raise HsxError(f"--gpus-per-copy {gpus_per_copy} spreads a model copy over GPUs, and this machine has "
                           "no CUDA GPU")
        return Process(rank=rank, world_size=world, device=torch.device("cpu"), state=state,
                       devices=[torch.device("cpu")], local_rank=local, tp_size=tp_size,
                       tp_control=tp_control, store=store)
    count = torch.cuda.device_count()
    first = local * gpus_per_copy
    if first + gpus_per_copy > count:
        raise HsxError(f"process {local} of this node needs GPUs {first}..{first + gpus_per_copy - 1} "
                       f"(--gpus-per-copy {gpus_per_copy}) but the node has {count}; launch "
                       f"{count // gpus_per_copy} process(es) per node")
    devices = [torch.device("cuda", i) for i in range(first, first + gpus_per_copy)]
    torch.cuda.set_device(devices[0])
    return Process(rank=rank, world_size=world, device=devices[0], state=state, devices=devices, local_rank=local,
                   tp_size=tp_size, tp_control=tp_control, store=store)


def cpu_threads(local_processes: int, cpu_device: bool, environ=os.environ) -> int:
    """torch's CPU threads for one of `local_processes` processes on this machine: OMP_NUM_THREADS when set,
    else this process's cores divided among them, as `accelerate launch` does; on a CPU device one core fewer,
    left to the map thread, which writes while the producer thread computes. torch's default (every core, in
    every process) oversubscribes: the README demo on a 2-core machine busy with other jobs (load 7-9) took
    120-185 s of extraction with 2 threads and 19-23 s with 1; idle, 4.8 s and 5.3 s."""
    if (env := environ.get("OMP_NUM_THREADS", "").strip()).isdigit() and int(env) > 0:
        return int(env)
    from hsx.data import cpu_count

    share = cpu_count() // max(1, local_processes)
    return max(1, share - 1 if cpu_device else share)


def _copy_world(rank: int, tp_size: int, world: int, backend: str, timeout):
    """Make this process's model copy (ranks [k·tp, (k+1)·tp)) its own torch.distributed world; returns the
    launcher's store (the job's barriers go through it) and a gloo group of the copy (for `agree_max`).

    Why a world per copy: transformers 5.24 shards a model over the whole world whatever mesh it is given.
    `from_pretrained` drops a `device_mesh` passed with `tp_plan` (modeling_utils.py: it builds
    DistributedConfig(tp_plan=...), whose tp_size defaults to WORLD_SIZE, and replaces device_mesh with
    initialize_distributed_mesh's mesh of the world), so 4 ranks with tp 2 held one model sharded 4 ways and the two
    "copies" fed different batches into the same collectives ("collective mismatch"). Its one way to declare
    copies, DistributedConfig(dp_replicate_size=...), wraps the model in FSDP2, whose forward fails under
    torch.inference_mode ("Inference tensors do not track version counter") and copies every weight per forward.
    With a world per copy, transformers runs its supported case (tp_size = world) and copies share no collective.
    """
    import torch.distributed as dist

    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
    copy_store = dist.PrefixStore(f"hsx/copy-{rank // tp_size}", store)
    dist.init_process_group(backend, store=copy_store, rank=rank % tp_size, world_size=tp_size, timeout=timeout)
    # On its own communicator: the producer thread's forwards issue the model's collectives concurrently.
    return store, dist.new_group(backend="gloo")


@contextmanager
def stop_on_signal(log) -> Iterator[threading.Event]:
    """SIGINT/SIGTERM ask the job to stop after the unit in progress (schedulers send SIGTERM, then SIGKILL after
    a grace period; a unit is sized to finish within it). A second signal stops at once."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.signum = signum
        stop.set()
        log(f"hsx: {signal.Signals(signum).name}: stopping after the current unit (again to stop now)")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


def assign_units(units: list, rank: int, world_size: int) -> list:
    """This rank's share: longest-processing-time-first by tokens, so ranks finish together. Deterministic, so
    every rank computes the same split from the same manifest."""
    if world_size == 1:
        return list(units)
    load = [0] * world_size
    mine = []
    for u in sorted(units, key=lambda u: (-u.tokens, u.name)):
        r = min(range(world_size), key=lambda k: (load[k], k))
        load[r] += u.tokens
        if r == rank:
            mine.append(u)
    return sorted(mine, key=lambda u: u.name)


def command_line() -> str:
    return "hsx " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv and sys.argv[0] else "hsx extract"


def extract(cfg: ExtractConfig, log=print, model=None) -> dict[str, Any]:
    """Run (or continue) the job; returns the summary that is also written to hsx.json.

    `model` (a LoadedModel) skips loading: `hsx bench` passes the random-weight model it built."""
    check_config(cfg)  # a config built in Python gets the same typed checks as a recipe's
    proc = current_process(cfg.gpus_per_copy, cfg.tp_size)
    say = log if proc.is_main else (lambda *a, **k: None)
    out = OutputDir(cfg.output_dir, rank=proc.rank)
    existed = out.root.exists()
    fresh = not existed or (out.root.is_dir() and not any(out.root.iterdir()))
    try:
        with out.locked(), stop_on_signal(say) as stop:
            try:
                return _extract(cfg, proc, out, stop, say, log, model)
            except HsxError:
                # A job refused before writing anything leaves no dir behind: only while this job holds the
                # lock (a job refused the lock must not remove a running job's .hsx/), and only with one process
                # (several ranks share the dir: one cannot tell the others' state).
                if fresh and proc.world_size == 1:
                    out.remove_if_unused(keep_root=existed)
                raise
    except OSError as e:
        if e.errno == errno.ENOSPC or "No space left" in str(e):
            done = len(out.done_units())
            raise HsxError(f"disk full while writing {cfg.output_dir}: {done} unit(s) are complete and intact; "
                           "free some space and run the same command to continue") from None
        raise


def _extract(cfg: ExtractConfig, proc: Process, out: OutputDir, stop: threading.Event, say, log, model):
    from hsx import data

    t_start = time.perf_counter()
    if model is None:
        model_path, revision, text = _model_facts(cfg)
        num_layers = int(text.num_hidden_layers)
        layers, final_hidden = resolve_layers(cfg.layers, num_layers, cfg.final_hidden)
    else:
        model_path, revision, text = model.model_path, model.revision, model.text_config
        num_layers, layers, final_hidden = model.num_model_layers, model.layers, model.final_hidden
    if cfg.topk_logits and not final_hidden:
        raise UsageError("--topk-logits comes from the final-norm state: add --final-hidden (or use the eagle3 "
                         "preset)")
    check_topk_logits(cfg.topk_logits, int(text.vocab_size))
    raw = data.load_input(cfg)
    tokenizer = _tokenizer(cfg, model_path) if data.row_format(raw.column_names) != "input_ids" else None
    hidden = int(text.hidden_size)
    bytes_per_token = sum(c.nbytes for c in output_columns(len(layers), hidden, final_hidden, cfg.storage_dtype,
                                                            cfg.topk_logits))
    unit_tokens = cfg.unit_tokens or max(1024, UNIT_BYTES // bytes_per_token)
    template_sha = data.chat_template_sha256(tokenizer) if tokenizer is not None else None
    mask = data.mask_method(raw.column_names, tokenizer)  # {"method", "version"}: a new version re-tokenizes
    job = _in_turns(proc, lambda: job_fingerprint({  # local inputs by content: rank 0 hashes, the rest hit its cache
        "model": model_identity(cfg.model, model_path, cfg.trust_remote_code), "revision": revision,
        "tokenizer": tokenizer_identity(cfg.tokenizer, cfg.trust_remote_code), "layers": layers,
        "final_hidden": final_hidden, "storage_dtype": cfg.storage_dtype, "dtype": cfg.dtype,
        "max_length": cfg.max_length, "chat_template_sha256": template_sha,
        "chat_template_kwargs": cfg.chat_template_kwargs, "input": data.input_fingerprint(cfg, raw),
        # unit_tokens as given: the derived default follows from layers, dtype and model, already in here (so
        # changing only --layers reports `differs in: layers`, not unit_tokens too)
        "limit": cfg.limit, "unit_tokens": cfg.unit_tokens, "nonfinite": cfg.nonfinite,
        "topk_logits": cfg.topk_logits,
        "hsx_version": ".".join(__version__.split(".")[:2]), "loss_mask": mask,
    }, given={"model": cfg.model, "tokenizer": cfg.tokenizer, "input": cfg.dataset}))

    tokenized, state = _claim_and_tokenize(cfg, proc, out, job, raw, tokenizer, int(text.vocab_size), say)
    run_id = _shared_run_id(out, proc)
    if state == "complete":
        info = out.read_info()
        say(f"hsx: {cfg.output_dir} is already complete ({info['counts']['rows_written']:,} rows); nothing to do")
        refuse_empty(cfg, info["counts"], written=True)
        if cfg.push_to_hub and proc.is_main:  # finishes an interrupted push; a no-op on a pushed repo
            _push(cfg, log)
        return info
    if state == "resume":
        say(f"hsx: continuing the job in {cfg.output_dir}")
    if cfg.strict and (bad := data.first_skipped(tokenized)):
        raise HsxError(f"--strict: input row {bad[0]} of {cfg.dataset} cannot be used: {bad[1]}")
    if stop.is_set():
        raise Stopped("stopped after tokenizing; run the same command to continue", 128 + stop.signum)
    sample_ids, num_tokens, positions, skipped, truncated = data.usable_rows(tokenized)
    if len(sample_ids) == 0:
        refuse_empty(cfg, {"rows_in": len(raw), "skipped": skipped}, written=False)
    order, units = plan_units(sample_ids, num_tokens, cfg.max_length, unit_tokens)
    summary = {  # what hsx.json says that does not depend on the run: written now, so `hsx merge` can finish
        "model": cfg.model, "model_path": model_path, "revision": revision,
        "tokenizer": cfg.tokenizer or cfg.model, "layers": layers, "final_hidden": final_hidden,
        "layer_convention": LAYER_CONVENTION, "hidden_size": hidden, "num_model_layers": num_layers,
        "vocab_size": int(text.vocab_size),
        "storage_dtype": cfg.storage_dtype, "max_length": cfg.max_length, "chat_template_sha256": template_sha,
        "loss_mask": mask, "counts": {"rows_in": len(raw), "truncated": truncated, "skipped": skipped},
        "unit_names": [u.name for u in units], "hsx_version": __version__,
        "config": {**cfg.to_dict(), "layers": layers, "final_hidden": final_hidden, "unit_tokens": unit_tokens},
        "fingerprint": job["fingerprint"], "command": command_line(),
    }
    if proc.local_rank == 0:
        out.write_summary(summary)
    done = out.done_units()
    proc.barrier()  # every rank read the same manifest before any rank commits a new unit
    pending = [u for u in units if u.name not in done]
    mine = assign_units(pending, proc.dp_rank, proc.dp_size)  # tensor-parallel ranks of one copy share units
    ordered = tokenized.select(positions[order]).select_columns(["sample_id", "input_ids", "loss_mask", "num_tokens"])

    stats: dict[str, Any] = {"seconds": 0.0, "gpu_seconds": 0.0, "tokens": 0, "padded_tokens": 0}
    uploader = None
    if cfg.push_to_hub and cfg.push_mode == "stream":
        from hsx.hub import StreamUploader

        uploader = StreamUploader(cfg.output_dir, cfg.push_to_hub, rank=proc.rank, private=cfg.hub_private,
                                  revision=cfg.hub_revision, delete_after_upload=cfg.delete_after_upload, log=say)
    try:
        if mine:
            stats = _run_units(cfg, proc, out, ordered, mine, layers, final_hidden, hidden, stop, model, say,
                               on_commit=uploader.submit if uploader is not None else None)
    except BaseException:
        if uploader is not None:
            uploader.abort()  # units not uploaded stay on disk; the next run re-submits them
        raise
    if uploader is not None:
        uploader.abort() if stop.is_set() else uploader.close()
    if stop.is_set():
        raise Stopped(f"stopped cleanly after {len(out.done_units())} of {len(units)} units; run the same "
                      "command to continue", 128 + stop.signum)

    return _finish(cfg, proc, out, units, summary, run_id, stats, t_start, log)


def _claim_and_tokenize(cfg: ExtractConfig, proc: Process, out: OutputDir, job: dict, raw, tokenizer,
                        vocab_size: int, say=print):
    """Claim the output dir and tokenize once: rank 0 first; then each node's first process (which finds the
    cache there if the dir is shared, and tokenizes for its node if each node writes its own dir); then everyone
    else. Returns (tokenized rows, the dir's state: new, resume or complete)."""
    from hsx import data

    cache = str(out.state / "tokenized" / "tokens.arrow")
    fingerprint = f"hsx-tok-{job['fingerprint'][:24]}"

    def claim_and_tokenize():
        state = out.claim(job, cfg.overwrite and proc.is_main, check_crc=cfg.check_crc, log=say,
                          check=proc.local_rank == 0)
        if state == "complete":
            return None, state
        out.clear_tmp()
        return data.tokenize(raw, tokenizer, cfg, cache, fingerprint=fingerprint, vocab_size=vocab_size), state

    tokenized, state = _in_turns(proc, claim_and_tokenize)
    return tokenized, state


def _in_turns(proc: Process, fn):
    """fn() on rank 0 first; then on each node's first process (which finds rank 0's work there if the dir or
    cache is shared, and does it for its node if not); then on everyone else. An HsxError is raised on every rank
    that hit it after the last barrier, so no rank waits forever for another."""
    result, error = None, None
    my_turn = 0 if proc.is_main else (1 if proc.local_rank == 0 else 2)
    for turn in range(3 if proc.world_size > 1 else 1):
        if turn == my_turn:
            try:
                result = fn()
            except HsxError as e:
                error = e
        proc.barrier()
    if error is not None:
        raise error
    return result


def _finish(cfg: ExtractConfig, proc: Process, out: OutputDir, units: list, summary: dict, run_id: str,
            stats: dict[str, Any], t_start: float, log) -> dict[str, Any]:
    """This rank's units are committed: mark it done, and finalize (hsx.json, card, push) if every unit is.

    Completion is tracked by the manifests each rank appends to (no collective at the end, which could time out
    when ranks finish far apart): whichever process sees every unit committed finalizes."""
    all_ranks_done = out.mark_rank_done(run_id, proc.rank, proc.world_size, stats) if proc.world_size > 1 else True
    # Read the manifests only after marking this rank done: read before, a rank that committed and marked in
    # between made this one see every rank done but that rank's last unit missing ("1 unit(s) were not written").
    done = out.done_units()
    missing = [u.name for u in units if u.name not in done]
    if missing:
        if not all_ranks_done:
            log(f"hsx: rank {proc.rank}: my units are written; the last rank to finish finalizes (or, when each "
                "node wrote its own dir, `hsx merge OUT NODE_DIRS...`)")
            return {"complete": False, "rank": proc.rank, "run": stats}
        raise HsxError(f"{len(missing)} unit(s) were not written ({missing[0]}, ...); run the command again")
    if not all_ranks_done:
        # Every unit is committed, so the other ranks are past their last commit and about to say they are done:
        # wait briefly for their numbers (not for a rank that died after its last commit).
        deadline = time.monotonic() + RANK_STATS_WAIT_SECONDS
        while len(out.rank_stats(run_id)) < proc.world_size and time.monotonic() < deadline:
            time.sleep(0.2)
    with out.finalizing() as already:
        if already:
            return out.read_info()
        if proc.world_size > 1:  # the job's numbers: every rank's, and their sum
            stats = {**stats, **combine_rank_stats(out.rank_stats(run_id))}
        info = complete_info(summary, done, proc.world_size, stats)
        info["token_frequencies"] = write_token_frequencies(out, summary.get("vocab_size"))
        out.finalize(info, lambda i: dataset_card(i, summary["command"]), features=info_features(info))
    if cfg.push_to_hub:
        _push(cfg, log)
    wall = time.perf_counter() - t_start
    c = info["counts"]
    log(f"hsx: wrote {c['rows_written']:,} rows, {c['tokens_written']:,} tokens to {cfg.output_dir} "
        f"({len(units)} files); skipped {json.dumps(c['skipped'])}; truncated {c['truncated']}; rows with "
        f"NaN/Inf states: {c['nonfinite']['rows']} ({'skipped' if cfg.nonfinite == 'skip' else 'kept, flagged'})")
    refuse_empty(cfg, c, written=True)
    if stats["tokens"]:
        pad = 1 - stats["tokens"] / max(1, stats["padded_tokens"])
        mfu = f", MFU {stats['mfu']:.1%}" if "mfu" in stats else ""
        busy = stats["gpu_seconds"] / max(stats["seconds"] * stats.get("processes", 1), 1e-9)  # per device
        log(f"hsx: {stats['tokens'] / max(stats['seconds'], 1e-9):,.0f} tok/s{mfu} over {stats['seconds']:.1f} s "
            f"of extraction ({wall:.1f} s in all), padding {pad:.1%}, "
            f"{'GPU' if str(stats.get('device', '')).startswith('cuda') else 'CPU'} busy {busy:.0%}")
    return info


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
             f"nothing was written (so {cfg.output_dir} holds no dataset)")
    raise HsxError(f"no usable rows: all {counts['rows_in']:,} input rows of {cfg.dataset} were skipped "
                   f"{json.dumps(counts['skipped'])}; {where}. Fix the input (`--strict` stops at the first bad "
                   "row), or pass --allow-empty if an empty output is expected")


def _shared_run_id(out: OutputDir, proc: Process) -> str:
    """An id every rank of this launch agrees on (rank 0 writes it, the others read it after a barrier), naming
    the per-rank completion markers of this run."""
    if proc.world_size == 1:
        return "single"
    f = out.state / "run-id"
    if proc.is_main:
        import uuid

        from hsx.sink import atomic_write

        atomic_write(f, uuid.uuid4().hex)
    proc.barrier()
    return f.read_text().strip()


def _push(cfg: ExtractConfig, log) -> None:
    from hsx.hub import push_output

    push_output(cfg.output_dir, cfg.push_to_hub, private=cfg.hub_private, revision=cfg.hub_revision, log=log)


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
               final_hidden: bool, hidden: int, stop: threading.Event, loaded=None, log=print,
               on_commit=None) -> dict[str, Any]:
    import datasets
    import torch
    from tqdm.auto import tqdm

    from hsx.engine import Extractor, Pipeline
    from hsx.model import kernel_report, load_model, resolve_packing
    from hsx.moe import resolve_experts, use_experts
    from hsx.writer import unit_files
    from hsx.cost import auto_token_budget, flops, layer_params, measure_matmul_tflops

    device = proc.device
    cuda = device.type == "cuda"
    loaded = loaded or load_model(cfg, device, proc.devices, proc.distributed_config())
    use_experts(loaded.base, resolve_experts(cfg.experts_implementation, cuda))
    kernels = kernel_report(loaded.base)
    if kernels.get("linear_attention_forward") == "transformers":
        log(f"hsx: the Gated DeltaNet layers run on transformers' forward, right-padded, not packed "
            f"({kernels.get('linear_attention_note')}; kernels: {kernels.get('linear_attention')}, conv "
            f"{kernels.get('causal_conv1d')})")
    if kernels.get("attn_implementation") != kernels.get("attn_implementation_requested"):
        log(f"hsx: attention runs as {kernels.get('attn_implementation')!r} "
            f"({kernels.get('attn_implementation_requested')!r} is not available for this model)")
    packing, why_not = resolve_packing(loaded.base, cfg.packing, cuda, cfg.gpus_per_copy == 1 and cfg.tp_size == 1,
                                       cfg.attn_implementation)
    if why_not:
        log(f"hsx: batches run right-padded, not packed: {why_not}")
    width = len(layers) * hidden + (hidden if final_hidden else 0)  # values per token, for memory and Arrow limits
    if cfg.token_budget:
        budget = cfg.token_budget
    elif cuda:
        budget = auto_token_budget(loaded.text_config, width, torch.cuda.mem_get_info(device)[0], cfg.max_length,
                                   eager_attention=packing == "none" and kernels.get("attn_implementation") == "eager")
    else:
        budget = CPU_TOKEN_BUDGET
    # Tensor-parallel ranks must run identical batches: the smallest budget any of them can afford (as negative).
    budget = -proc.agree_max(-budget)
    # Auto compile stays off for a copy spread over GPUs: accelerate's device hooks wrap each layer's forward.
    use_compile = cfg.compile == "on" or (cfg.compile == "auto" and cuda and cfg.gpus_per_copy == 1
                                          and cfg.tp_size == 1)
    extractor = Extractor(loaded, device, budget, compile_model=use_compile, sdpa_backend=cfg.sdpa_backend,
                          nonfinite=cfg.nonfinite, storage_dtype=cfg.storage_dtype, topk_logits=cfg.topk_logits,
                          packing=packing)
    feats = features(len(layers) * hidden, hidden, final_hidden, cfg.nonfinite == "keep", cfg.storage_dtype,
                     cfg.topk_logits)
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
               dynamic_ncols=True, bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, now "
               "{rate_fmt}{postfix}]")
    stats = {"seconds": 0.0, "gpu_seconds": 0.0, "tokens": 0, "padded_tokens": 0, "flops": 0.0,
             "token_budget": budget, "compile": use_compile, "device": str(device), "tp_size": proc.tp_size,
             "model_copies": proc.dp_size, "writes": proc.writes,
             "sdpa_backend": cfg.sdpa_backend if cuda else "n/a", "packing": packing, "kernels": kernels}
    pipeline = Pipeline(extractor, batches(), max_batch)

    def tally(result_table, r):  # followers count too: whichever rank finalizes reports its totals in hsx.json
        stats["tokens"] += r.tokens
        stats["padded_tokens"] += r.padded_tokens
        stats["gpu_seconds"] += extractor.gpu_seconds(r)
        stats["flops"] += flops(loaded.text_config, loaded.depth, result_table.column("num_tokens").to_numpy(),
                                per_layer)
    committer = Committer(out, on_commit=on_commit)
    progress_was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    t0 = time.perf_counter()
    try:
        for u in pending:
            if proc.agree_max(int(stop.is_set())):
                break
            if not proc.writes:  # a tensor-parallel follower: the same forwards as its group's writer, no output
                for table in unit_rows(u).iter(u.batch_size(budget)):
                    tally(pipeline(table), pipeline.last)
                pipeline.release()
                continue
            nonfinite_key = "skipped_nonfinite" if cfg.nonfinite == "skip" else "nonfinite_kept"
            counts = {"rows": 0, "tokens": 0, "skipped_oom": 0, nonfinite_key: 0}

            def step(table, _counts=counts):
                result_table = pipeline(table)
                r = pipeline.last
                _counts["rows"] += result_table.num_rows
                _counts["tokens"] += int(result_table.column("num_tokens").to_numpy().sum())
                _counts["skipped_oom"] += int((~r.kept).sum())
                _counts[nonfinite_key] += r.nonfinite_rows
                tally(result_table, r)
                bar.update(int(table.column("num_tokens").to_numpy().sum()))
                elapsed = time.perf_counter() - t0
                mfu = f", MFU {stats['flops'] / elapsed / (peak_tflops * 1e12):.0%}" if peak_tflops else ""
                # tqdm's own rate (left of the comma) is the recent one; this is the mean since the start
                bar.set_postfix_str(f"mean {stats['tokens'] / max(elapsed, 1e-9):,.0f} tok/s{mfu}", refresh=False)
                return result_table

            committer.check()
            with unit_files(out.tmp) as written:  # hsx.writer: the unit's bytes, checksummed on the way out
                unit_rows(u).map(
                    step, batched=True, batch_size=u.batch_size(budget), features=feats,
                    cache_file_name=str(out.unit_tmp(u.name)), new_fingerprint=f"hsx-{u.name}-{os.getpid()}",
                    writer_batch_size=max(1, (2**31 - 1) // (u.upper_bound * width)), load_from_cache_file=False,
                )
            pipeline.release()
            committer.submit(u.name, counts, crc32=written.crc32(out.unit_tmp(u.name)))
        committer.join()
    finally:
        committer.close()
        pipeline.close()
        bar.close()
        if progress_was_on:
            datasets.enable_progress_bars()
    stats["seconds"] = time.perf_counter() - t0
    stats.update(gpu_waited_for_writer_seconds=pipeline.wait_seconds,
                 map_waited_for_gpu_seconds=pipeline.map_wait_seconds, write_seconds=pipeline.write_seconds)
    if peak_tflops:
        stats["matmul_tflops"] = peak_tflops
        stats["mfu"] = stats["flops"] / stats["seconds"] / (peak_tflops * 1e12)
    return stats
