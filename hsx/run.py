"""`hsx extract` and `hsx.stream`: the job's steps (hsx.job) run in this process, as one rank of a launch: the
process and its ranks (`Process`), the dir its ranks share, the job they agree on; which units it writes is
hsx.handout's.

`extract` tokenizes once (cached under .hsx/), plans units (bucket, then sample_id order), skips units the
manifest says are committed, and runs one `datasets.map` per remaining unit with the pipelined GPU function; each
unit is committed as soon as its map returns. Running the same command again continues; a complete dir is a
no-op. `stream` runs the same steps up to the engine and yields this rank's rows instead of writing them.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from hsx.config import ExtractConfig, HsxError, UsageError, check_config
from hsx.errors import Stopped, file_system_error, file_system_line
from hsx.handout import assign_units, hand_out, launch_agent, units_done_anywhere
from hsx.job import (Extraction, Job, RunStats, StreamCounts, UnitCounts, commit_units, finish, push, record_run,
                     refuse_empty)
from hsx import ledgers
from hsx.info import recorded_info, write_summary
from hsx.sink import OutputDir


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
    gathers: int = 0  # all_gathers through `store`, naming the next one's keys
    claims_store: Any = None  # --elastic: the store units are claimed through (hsx.claims); the ranks are this node's
    ep_size: int = 1  # processes sharing one model's routed experts (--ep-size), each on its own batches and units
    ep_group: Any = None  # hsx.target.expert_parallel.EpGroup of this process's group

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

    def in_turns(self, fn, leads: bool | None = None):
        """fn() on rank 0 first; then on each node's first process (which finds rank 0's work there if the cache is
        shared, and does it for its node if not); then on everyone else. With `leads` (whether this process is the
        first of the ranks sharing an output dir: hsx.run.DirShare), each dir's first process goes with rank 0
        (their dirs are apart), then everyone else. An HsxError is raised on every rank that hit it after the last
        barrier, so no rank waits forever for another."""
        result, error = None, None
        if leads is None:
            my_turn = 0 if self.is_main else (1 if self.local_rank == 0 else 2)
        else:
            my_turn = 0 if self.is_main or leads else 2
        for turn in range(3 if self.world_size > 1 else 1):
            if turn == my_turn:
                try:
                    result = fn()
                except HsxError as e:
                    error = e
            self.barrier()
        if error is not None:
            raise error
        return result

    def all_gather(self, value: Any) -> list:
        """`value` (JSON-able) from every rank, in rank order: what the ranks must agree on travels this way, over
        the launcher's process group (or its store), never through a file that another node may not see."""
        if self.world_size == 1:
            return [value]
        if self.state is not None:
            import torch.distributed as dist

            got = [None] * self.world_size
            dist.all_gather_object(got, value)
            return got
        # each tensor-parallel copy is its own world (`_copy_world`): the job's ranks meet in the launcher's store
        self.gathers += 1
        keys = [f"hsx/gather/{self.gathers}/{r}" for r in range(self.world_size)]
        self.store.set(keys[self.rank], json.dumps(value))
        self.store.wait(keys)
        return [json.loads(self.store.get(k)) for k in keys]

    def barrier(self) -> None:
        if self.state is not None:
            self.state.wait_for_everyone()
        elif self.store is not None:  # every rank of the job, across copies: count in, wait for the last
            self.barriers += 1
            key = f"hsx/barrier/{self.barriers}"
            if self.store.add(key, 1) == self.world_size:
                self.store.set(key + "/open", "1")
            self.store.wait([key + "/open"])


MAX_THREADS = 1 << 16  # torch.set_num_threads takes an int32; no machine has this many cores per process


def env_int(name: str, default: int, low: int = 0, environ=os.environ) -> int:
    """A launcher's integer environment variable (WORLD_SIZE, LOCAL_WORLD_SIZE, RANK, LOCAL_RANK), `default` when
    unset or empty; HsxError naming it unless it is an integer in [low, 2**31): WORLD_SIZE=0 ran as a world of no
    process, and 'abc' was a ValueError traceback."""
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    value = int(raw) if raw.lstrip("+-").isdecimal() and len(raw) <= 12 else None
    if value is None or not low <= value < 2**31:
        raise HsxError(f"environment variable {name}={raw[:40]!r} is not an integer of at least {low} (the launcher "
                       "sets it: accelerate launch, torchrun); unset it to run one process")
    return value


def current_process(gpus_per_copy: int = 1, tp_size: int = 1, elastic: str | None = None,
                    ep_size: int = 1) -> Process:
    """This process's rank and devices. Under `accelerate launch` / torchrun (WORLD_SIZE > 1) the process group
    comes from accelerate. hsx needs it only for barriers and for what the ranks must agree on (`all_gather`:
    small objects), so it is always gloo on the CPU (accelerate's cpu=True state): that also works on machines
    without CUDA (where accelerate's default state is single-process in every rank, so each would process every
    row) and with several GPUs per process (NCCL refuses two ranks on one GPU). Process k of a node uses GPUs [k·G, (k+1)·G) for G = --gpus-per-copy.
    With --tp-size > 1 each model copy is its own world instead (`_copy_world`). With `elastic` (--elastic
    HOST:PORT) the ranks are this node's alone (`_node_world`): nodes share nothing but the claims store. With
    --ep-size > 1, ranks [k·ep, (k+1)·ep) share their experts (hsx.target.expert_parallel), each still a copy of its own
    for the units."""
    from datetime import timedelta

    import torch

    if elastic:
        return _node_world(elastic, gpus_per_copy, tp_size)
    world = env_int("WORLD_SIZE", 1, low=1)
    if world % tp_size:
        raise HsxError(f"--tp-size {tp_size} with {world} processes: each model copy is sharded over --tp-size "
                       "processes, so launch a multiple of --tp-size processes")
    per_node = env_int("LOCAL_WORLD_SIZE", world, low=1)
    if tp_size > 1 and per_node % tp_size:  # copies are consecutive ranks: one would straddle two machines
        raise HsxError(f"--tp-size {tp_size} with {per_node} processes per machine: a model copy would span two "
                       "machines (its every layer waiting on the network); launch a multiple of --tp-size per machine")
    if ep_size > 1 and (world % ep_size or per_node % ep_size):
        raise HsxError(f"--ep-size {ep_size} with {world} processes ({per_node} per machine): the experts are "
                       "sharded over --ep-size processes of one machine, so launch a multiple of --ep-size processes "
                       "on each")
    cuda = torch.cuda.is_available()
    torch.set_num_threads(cpu_threads(per_node, cpu_device=not cuda))
    # Ranks meet around tokenization (rank 0 tokenizes, the others wait): allow hours for a big dataset.
    timeout = timedelta(hours=6)
    state = store = tp_control = None
    rank = local = 0
    if world > 1 and tp_size > 1:
        rank, local = env_int("RANK", 0), env_int("LOCAL_RANK", 0)
        if cuda:
            torch.cuda.set_device(local)  # before NCCL meets this rank (--gpus-per-copy is 1 with --tp-size)
        store, tp_control = _copy_world(rank, tp_size, world, "nccl" if cuda else "gloo", timeout)
    elif world > 1:
        from accelerate import PartialState

        state = PartialState(cpu=True, timeout=timeout)
        rank, world = state.process_index, state.num_processes
        local = env_int("LOCAL_RANK", state.local_process_index)
    proc = _with_devices(Process(rank=rank, world_size=world, device=torch.device("cpu"), state=state,
                                 local_rank=local, tp_size=tp_size, tp_control=tp_control, store=store),
                         gpus_per_copy)
    if ep_size > 1:
        from hsx.target.expert_parallel import make_groups

        proc.ep_size, proc.ep_group = ep_size, make_groups(rank, world, ep_size, proc.device)
    return proc


def _with_devices(proc: Process, gpus_per_copy: int) -> Process:
    """`proc` with its devices: the CPU, or GPUs [k·G, (k+1)·G) for process k of its node."""
    import torch

    cuda, local = torch.cuda.is_available(), proc.local_rank
    if not cuda:
        if gpus_per_copy > 1:
            raise HsxError(f"--gpus-per-copy {gpus_per_copy} spreads a model copy over GPUs, and this machine has "
                           "no CUDA GPU")
        proc.devices = [torch.device("cpu")]
        return proc
    count = torch.cuda.device_count()
    first = local * gpus_per_copy
    if first + gpus_per_copy > count:
        raise HsxError(f"process {local} of this node needs GPUs {first}..{first + gpus_per_copy - 1} "
                       f"(--gpus-per-copy {gpus_per_copy}) but the node has {count}; launch "
                       f"{count // gpus_per_copy} process(es) per node")
    proc.devices = [torch.device("cuda", i) for i in range(first, first + gpus_per_copy)]
    proc.device = proc.devices[0]
    torch.cuda.set_device(proc.device)
    return proc


def _node_world(endpoint: str, gpus_per_copy: int, tp_size: int) -> Process:
    """--elastic: this node's processes (LOCAL_RANK of LOCAL_WORLD_SIZE, from the launcher) are the job's world as
    this process sees it; they agree (the job, the dir, the units done) through the claims store, under a prefix
    of their own launcher process and its restart count. No collective ever spans nodes, so a lost node blocks
    nobody: the others' claims take its units back (hsx.claims)."""
    import torch
    import torch.distributed as dist

    from hsx.claims import connect

    if tp_size > 1:
        raise UsageError("--elastic claims units per model copy of one process: --tp-size is not supported with it "
                         "(--gpus-per-copy spreads a copy over this process's GPUs)")
    world, local = env_int("LOCAL_WORLD_SIZE", 1, low=1), env_int("LOCAL_RANK", 0)
    if local >= world:
        raise HsxError(f"environment variable LOCAL_RANK={local} is not below LOCAL_WORLD_SIZE={world}")
    cuda = torch.cuda.is_available()
    torch.set_num_threads(cpu_threads(world, cpu_device=not cuda))
    store = connect(endpoint)
    # Every process of one node has the same parent (the launcher's agent); a restart of its workers is a new group.
    node = f"{launch_agent()}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')[:8]}"
    node_store = dist.PrefixStore(f"hsx/node/{node}", store) if world > 1 else None
    return _with_devices(Process(rank=local, world_size=world, device=torch.device("cpu"), local_rank=local,
                                 store=node_store, claims_store=store), gpus_per_copy)


def cpu_threads(local_processes: int, cpu_device: bool, environ=os.environ) -> int:
    """torch's CPU threads for one of `local_processes` processes on this machine: OMP_NUM_THREADS when set,
    else this process's cores divided among them, as `accelerate launch` does; on a CPU device one core fewer,
    left to the map thread, which writes while the producer thread computes. torch's default (every core, in
    every process) oversubscribes: the README demo on a 2-core machine busy with other jobs (load 7-9) took
    120-185 s of extraction with 2 threads and 19-23 s with 1; idle, 4.8 s and 5.3 s."""
    env = environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdecimal() and len(env) <= 6 and 0 < int(env) <= MAX_THREADS:  # (20 digits: no count torch takes)
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


@dataclass
class StopRequest:
    """Set by SIGINT/SIGTERM: the job stops after the unit in progress, exiting 128 + the signal's number."""
    event: threading.Event = field(default_factory=threading.Event)
    signum: int = 0

    def is_set(self) -> bool:
        return self.event.is_set()

    def set(self, signum: int) -> None:
        self.signum = signum
        self.event.set()

    def stopped(self, message: str) -> Stopped:
        return Stopped(message, 128 + self.signum)


@contextmanager
def stop_on_signal(log) -> Iterator[StopRequest]:
    """SIGINT/SIGTERM ask the job to stop after the unit in progress (schedulers send SIGTERM, then SIGKILL after
    a grace period; a unit is sized to finish within it). A second signal stops at once."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt(signum)
        stop.set(signum)
        log(f"hsx: {signal.Signals(signum).name}: stopping after the current unit (again to stop now)")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


def extract(cfg: ExtractConfig, log=print, model=None) -> dict[str, Any]:
    """Run (or continue) the job; returns the summary that is also written to hsx.json.

    `model` (a LoadedModel) skips loading: `hsx bench` passes the random-weight model it built."""
    cfg = check_config(cfg)  # a config built in Python gets the same typed checks as a recipe's
    proc = current_process(cfg.gpus_per_copy, cfg.tp_size, cfg.elastic, cfg.ep_size)
    say = log if proc.is_main else (lambda *a, **k: None)
    note = None if cfg.elastic else elastic_note()
    if note and env_int("LOCAL_RANK", proc.local_rank) == 0:  # (said on every node, once)
        log(note)
    # --elastic: the launch's global rank names this process's files (nodes may share one dir)
    out = OutputDir(cfg.output_dir, rank=env_int("RANK", proc.rank) if cfg.elastic else proc.rank)
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
    except (OSError, ValueError) as e:
        fault = file_system_error(e)
        if fault is None:
            raise
        try:
            kept = f"{len(ledgers.done_units(out.state, out.data))} unit(s) are complete and intact"
        except (OSError, HsxError):  # (the dir cannot be read either: EIO, EACCES)
            kept = "the units committed are kept"
        raise HsxError(file_system_line(fault, cfg.output_dir, kept)) from None


def _extract(cfg: ExtractConfig, proc: Process, out: OutputDir, stop: StopRequest, say, log, model):
    """The steps, in order: prepare → agree → start (or resume) → tokenize → units → engine + commit (this rank's
    pending units) → finish."""
    t_start = time.perf_counter()
    job = Job.prepare(cfg, proc, model, say)
    share = share_dir(out, proc, agree_on_job(proc, job.fingerprint))
    if proc.claims_store is not None:  # this node's ranks are not the job's: other nodes write other dirs
        share.job_wide = False
    if share.leads and not proc.is_main:
        out.lock_as_first()
    state = job.start_or_resume(out, share.leads)
    states = [s for s in proc.all_gather(state if share.leads else None) if s]  # each dir's, as its first rank found it
    if all(s == "complete" for s in states):
        info = recorded_info(out.root).to_dict()
        say(f"hsx: {cfg.output_dir} is already complete ({info['counts']['rows_written']:,} rows); nothing to do")
        refuse_empty(cfg, info["counts"], written=True)
        if cfg.push_to_hub and proc.is_main:  # finishes an interrupted push; a no-op on a pushed repo
            push(cfg, log)
        return info
    if "resume" in states or "complete" in states:
        say(f"hsx: continuing the job in {cfg.output_dir}")
    if cfg.push_to_hub and cfg.push_mode == "end" and proc.is_main and share.whole:
        from hsx.hub import check_end_push  # (a dir holding a node's share is pushed after `hsx merge`, not here)

        check_end_push(cfg.output_dir, cfg.push_to_hub, revision=cfg.hub_revision, overwrite=cfg.hub_overwrite,
                       log=say)
    tokenized = job.tokenize_into(out, share.leads)
    job.check_strict(tokenized)
    if stop.is_set():
        raise stop.stopped("stopped after tokenizing; run the same command to continue")
    units = job.units(tokenized)
    summary = job.summary(units)
    if share.leads:
        write_summary(out.state, summary)
    # (one reader per dir)
    done = units_done_anywhere(proc, units.all, ledgers.done_units(out.state, out.data) if share.leads else {})
    stats = RunStats()
    uploader = None
    if cfg.push_to_hub and cfg.push_mode == "stream":
        from hsx.hub import StreamUploader, job_files

        known: dict[str, int] = {}  # the job's units on the Hub as every dir knows them (one dir per node)
        for files in proc.all_gather(job_files(out, cfg.push_to_hub, cfg.hub_revision) if share.leads else {}):
            known.update(files)
        uploader = StreamUploader(cfg.output_dir, cfg.push_to_hub, rank=proc.rank, private=cfg.hub_private,
                                  revision=cfg.hub_revision, delete_after_upload=cfg.delete_after_upload, log=say,
                                  overwrite=cfg.hub_overwrite, known=known, resubmit=False)
        proc.barrier()  # every rank checked whose repo it is before any rank uploads
        uploader.resubmit_leftovers()
    with hand_out(proc, job.fingerprint, units.all, done, stop, cfg.elastic, say) as mine:
        def on_commit(name, path):  # (on the commit thread, once the unit's manifest line is on disk)
            mine.committed(name)
            if uploader is not None:
                uploader.submit(name, path)

        try:
            # (an expert-parallel rank with no unit still serves its group's forwards)
            if mine.units or (proc.ep_size > 1 and mine.pending):
                with Extraction(cfg, proc, job.target, units.ordered, mine.planned, model, say,
                                feed=mine.feed) as extraction:
                    record_run(out, extraction.stats, say, compare=proc.is_main)
                    commit_units(extraction, proc, out, mine.units, stop,
                                 on_commit=on_commit if mine.claims is not None or uploader is not None else None)
                stats = extraction.stats
        except BaseException:
            if uploader is not None:
                uploader.abort()  # units not uploaded stay on disk; the next run re-submits them
            raise
    if uploader is not None:
        uploader.abort() if stop.is_set() else uploader.close()
    if stop.is_set():
        committed = ledgers.done_units(out.state, out.data)
        raise stop.stopped(f"stopped cleanly after {len(committed)} of {len(units.all)} units; run the same "
                           "command to continue")

    info = finish(cfg, proc, out, units.all, summary, share, stats.as_dict(), t_start, log,
                  pending=[u.name for u in mine.pending])
    lost = mine.lost_agents()
    if lost and env_int("TORCHELASTIC_MAX_RESTARTS", 0) > env_int("TORCHELASTIC_RESTART_COUNT", 0):
        # torch's agent would wait 300 s (hard-coded) in its exit barrier for the lost node's agent: a failed
        # worker makes it re-form the launch without that node instead, and the restarted workers find the job done
        # (the job succeeded: said without `error:`, as a stop is, with the status torchrun restarts on)
        raise Stopped(f"this launch lost the node(s) of agent {', '.join(lost[:3])}, and this process took over "
                      "their units and finished the job; it ends with exit status 1 only so that torchrun re-forms "
                      "the launch without them (the restarted processes find the work done and exit 0) instead of "
                      "waiting 300 s for them", 1)
    return info


def elastic_nnodes(environ=os.environ) -> str | None:
    """The `--nnodes MIN:MAX` of the torchrun launch this process runs under, when MIN differs from MAX (an elastic
    launch: nodes may be lost or join); None otherwise or where it cannot be told. torchrun hands its workers no
    variable for it (TORCHELASTIC_RUN_ID says only that torchrun launched them): it is read from PET_NNODES (the
    option given by environment) or the agent's command line (/proc, Linux)."""
    if not environ.get("TORCHELASTIC_RUN_ID"):
        return None
    value = environ.get("PET_NNODES", "").strip()
    if not value:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                argv = f.read(1 << 16).decode(errors="replace").split("\0")
        except OSError:
            return None
        for i, arg in enumerate(argv):
            if arg == "--nnodes" and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith("--nnodes="):
                value = arg.partition("=")[2]
    low, sep, high = value.partition(":")
    return value if sep and low.strip() != high.strip() else None


def elastic_note(environ=os.environ) -> str | None:
    """One line for an elastic torchrun launch of a job without --elastic: what a lost or joining node does to it,
    and how to have units claimed as processes go instead."""
    nnodes = elastic_nnodes(environ)
    if nnodes is None:
        return None
    return (f"hsx: torchrun launched this job elastically (--nnodes {nnodes[:20]}), but without --elastic HOST:PORT "
            "its units are split once between the nodes of the first round: a node lost mid-job leaves its share "
            "undone (the others write only theirs, then torch waits 300 s for it; rerun on the dirs left to finish), "
            "and a joining node restarts every node's workers; add --elastic HOST:PORT (your --rdzv-endpoint) to "
            "claim units as processes go (docs/scale-out.md)")


def agree_on_job(proc: Process, fingerprint: str) -> str:
    """Check that every rank prepared the same job (a node whose copy of the model or data differs would write
    rows of another job), and return the id of this run, made by rank 0 and handed to all."""
    if proc.world_size == 1:
        return "single"
    import uuid

    views = proc.all_gather([fingerprint, uuid.uuid4().hex if proc.is_main else None])
    odd = [r for r, (f, _) in enumerate(views) if f != views[0][0]]
    if odd:
        raise HsxError(f"rank {odd[0]} prepared another job than rank 0 (fingerprint {views[odd[0]][0][:12]} vs "
                       f"{views[0][0][:12]}): its model, tokenizer or data differ; give every node the same files")
    return views[0][1]


@dataclass
class DirShare:
    """Which ranks of this run write into the same output dir as this one: all of them when the dir is on one
    shared filesystem, a node's ranks when each node has its own dir (on a local disk)."""
    run_id: str
    rank: int
    ranks: list[int]  # in order; the first one leads (starts the job and tokenizes first, checks the units)
    world_size: int
    job_wide: bool = True  # these ranks are every process of the job (not so with --elastic: one node's)

    @property
    def leads(self) -> bool:
        return self.rank == self.ranks[0]

    @property
    def whole(self) -> bool:  # every rank writes here: this dir alone holds the job's output
        return self.job_wide and len(self.ranks) == self.world_size


def share_dir(out: OutputDir, proc: Process, run_id: str) -> DirShare:
    """Find which ranks share this rank's output dir by what they see, not by hostnames or path strings (the same
    path on two machines is two dirs; two paths may be one NFS dir): each rank leaves a file named for the run
    and its rank, and, after a barrier, says which ranks' files it sees. Ranks one of which sees the other's file
    share a dir (and so do ranks sharing with a third: seeing is made symmetric and transitive, so a directory
    listing lagging on one client cannot split a shared dir)."""
    if proc.world_size == 1:
        return DirShare(run_id, 0, [0], 1)
    ledgers.announce(out.state, run_id, proc.rank)
    proc.barrier()
    seen = proc.all_gather(ledgers.announced(out.state, run_id))
    group = list(range(proc.world_size))  # union-find over "r sees s"

    def root(r: int) -> int:
        while group[r] != r:
            r = group[r]
        return r

    for r, ranks in enumerate(seen):
        for other in ranks:
            if 0 <= other < proc.world_size:
                group[root(other)] = root(r)
    mine = [r for r in range(proc.world_size) if root(r) == root(proc.rank)]
    return DirShare(run_id, proc.rank, mine, proc.world_size)


def stream(cfg: ExtractConfig, counts: StreamCounts, log=print, model=None) -> Iterator[dict[str, Any]]:
    """This process's share of the job's rows as torch tensors (`hsx.torch_view`'s rows), computed by the steps
    `extract` runs up to the engine (tokenize → units → engine) and written nowhere; `counts` is filled as it goes.
    The rules (which options, which rows, cleanup) are `hsx.stream`'s docstring."""
    import torch

    from hsx.load import table_rows

    cfg = check_config(cfg, required=("model", "dataset"))
    if cfg.tp_size > 1 or cfg.ep_size > 1:
        raise UsageError("hsx.stream runs a whole model copy in each process, next to the training loop: "
                         f"--{'tp' if cfg.tp_size > 1 else 'ep'}-size is for hsx extract (--gpus-per-copy spreads a "
                         "copy over this process's GPUs)")
    if env_int("WORLD_SIZE", 1, low=1) > 1 and not (torch.distributed.is_available()
                                                          and torch.distributed.is_initialized()):
        raise UsageError("hsx.stream under a launcher: create your Accelerator (or torch.distributed process group) "
                         "before reading the stream; its ranks share the work through that group")
    proc = current_process(cfg.gpus_per_copy, cfg.tp_size)
    say = log if proc.is_main else (lambda *a, **k: None)
    job = Job.prepare(cfg, proc, model, say)
    tokenized = job.tokenize(stream_cache_file(job.fingerprint))
    job.check_strict(tokenized)
    units = job.units(tokenized)
    counts.input, counts.engine = units.counts, UnitCounts(cfg.nonfinite)
    mine = assign_units(units.all, proc.dp_rank, proc.dp_size)
    if not mine:
        return
    extraction = Extraction(cfg, proc, job.target, units.ordered, mine, model, say, progress=False)
    counts.engine = extraction.start_unit()  # one count over all units
    try:
        for u in mine:
            for table in extraction.batches(u):
                # The batch's table wraps a pinned slot the engine reuses: the rows get their own copies, and the
                # slot goes back before the first row is handed out, so the GPU runs ahead while the loop trains.
                rows = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in row.items()}
                        for row in table_rows(extraction(table), len(job.target.layers), job.target.hidden_size,
                                                   cfg.storage_dtype)]
                extraction.release()
                yield from rows
        c = counts.as_dict()
        say(f"hsx: streamed {c['rows']:,} rows, {c['tokens']:,} tokens; skipped {json.dumps(c['skipped'])}; "
            f"truncated {c['truncated']}")
    finally:
        cuda = extraction.extractor.cuda
        extraction.close()  # stops and joins the producer thread, even when the loop stopped early
        del extraction
        if cuda:
            torch.cuda.empty_cache()  # the model and slots were this generator's alone (unless `model` was given)


def stream_cache_file(fingerprint: str) -> str:
    """Where a stream's tokenized rows are cached (no output dir to hold them): datasets' cache (HF_DATASETS_CACHE),
    named by the job's fingerprint, so the next epoch's stream tokenizes nothing."""
    import datasets

    return os.path.join(str(datasets.config.HF_DATASETS_CACHE), "hsx", f"tokens-{fingerprint[:24]}.arrow")
