"""The batched GPU function `datasets.map` calls: forward (padded or packed) → real tokens → one pinned host buffer.

A blocking device-to-host copy per batch halved throughput (docs/benchmarks.md, "Figures moved from the code"),
so the GPU work runs one step ahead of `map`. A producer thread walks the same batches `map`
will ask for, in the same order, and for each one: builds the right-padded ids and the index of real tokens on the
host (boolean indexing on the GPU would force a sync), runs the truncated model with `attention_mask=None` (with
causal attention the real tokens are exact and SDPA takes its fastest path; with --packing varlen the rows instead
go back to back in one sequence, with per-row positions and row bounds: hsx.target.model), gathers the captured layers'
real tokens into one device tensor, and copies it on a side stream into a pinned slot. The map function only waits
for a batch that is usually finished already, wraps the slot in a `pyarrow.Table` without copying, and returns it;
`datasets` writes it while the GPU works on the next batches. A slot is reused only after `map` has written its
table (the call after the one that returned it).

A batch that runs out of GPU memory is split in halves and retried, and the token cap for later batches shrinks;
only a single row that cannot fit alone is dropped, with reason `oom`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from hsx.buckets import PAD_MULTIPLE, padded_length
from hsx.errors import HsxError
from hsx.schema import ROW_COLUMNS, Column, OutputFormat, encode
from hsx.target import gdn
from hsx.target.capture import capture
from hsx.target.model import LoadedModel
from hsx.target.prepare import PreparedModel


@dataclass
class Slot:
    """Pinned host memory for one batch in flight: the states out, the padded ids and gather index in."""
    states: torch.Tensor  # uint8, flat: each launched segment holds its columns' bytes one after the other
    ids: torch.Tensor  # int64, flat
    index: torch.Tensor  # int64, flat: where each real token sits in the padded batch (packed: its row)
    positions: torch.Tensor  # int64, flat: packed batches' position ids (each row counts from 0)
    row_bounds: torch.Tensor  # int32: packed batches' row offsets (cu_seqlens)
    chunks: torch.Tensor  # int32: packed batches' fla chunk indices (Gated DeltaNet layers)
    nonfinite: torch.Tensor  # int32 per row: tokens with a NaN/Inf anywhere in their states
    done: torch.cuda.Event | None = None


@dataclass
class Result:
    sample_ids: np.ndarray
    slot: Slot
    kept: np.ndarray  # bool per row: False for rows dropped by an OOM no split could avoid
    tokens: int  # real tokens of kept rows
    padded_tokens: int  # tokens computed, padding included
    segment_tokens: list[int] = field(default_factory=list)  # tokens of each forward (more than one after a split)
    gpu_events: list = field(default_factory=list)  # (start, end) CUDA event pairs of the forwards
    seconds: float = 0.0  # host time of the forwards (CPU runs)
    nonfinite_rows: int = 0  # rows whose states hold NaN/Inf (dropped or flagged)


class Extractor:
    """Pad → forward (hooks) → gather real tokens → copy out, overlapped with `datasets`' writing."""

    def __init__(self, loaded: LoadedModel, device: torch.device, token_budget: int, prepared: PreparedModel,
                 slots: int = 3, sdpa_backend: str = "flash", nonfinite: str = "skip", fmt: OutputFormat | None = None,
                 teacher_top_p: float = 1.0, teacher_temperature: float = 1.0):
        """`fmt`: the job's output format (hsx.target.model.Target's: its storage dtype, top-k logits and teacher
        policy);
        None: the loaded layers in the default storage dtype. `teacher_*`: the policy's top-p and temperature."""
        fmt = fmt or OutputFormat(len(loaded.layers), loaded.hidden_size, loaded.final_hidden)
        self.loaded, self.device = loaded, device
        self.packing = prepared.packing  # "none": right-padded rows; "varlen": one packed sequence per forward
        self.layers, self.final = loaded.layers, loaded.final_hidden  # (final: computed, maybe for the policy only)
        self.store_final = fmt.final_hidden
        self.hidden = loaded.hidden_size
        self.width = len(self.layers) * self.hidden  # values per token in `hidden_states`
        self.storage_dtype = fmt.storage_dtype
        self.topk = fmt.topk
        self.policy = fmt.policy
        self.teacher = (teacher_top_p, teacher_temperature)
        if (self.topk or self.policy) and (not self.final or loaded.lm_head is None):
            raise ValueError("top-k logits and the teacher policy need the final-norm state and the lm_head weight")
        self.columns = fmt.state_columns()
        self.per_token = sum(c.nbytes for c in self.columns)  # bytes per token, all columns
        self.token_cap = token_budget  # shrinks after an OOM
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.linear_attention = prepared.linear_attention  # Gated DeltaNet layers on fla's kernels
        self.compiler = prepared.compiler
        # Triton specializes kernels on whether an int argument is a multiple of 16: one alignment for fla's.
        self.pack_multiple = 2 * PAD_MULTIPLE if self.linear_attention else PAD_MULTIPLE
        self.capacity = 0
        self.free: queue.Queue[Slot | None] = queue.Queue()
        self.num_slots = slots
        self.store: dict[int, torch.Tensor] = {}
        self.sdpa_backend = sdpa_backend
        self.nonfinite = nonfinite  # rows with NaN/Inf states: "skip" them, or "keep" them flagged
        from hsx.target.expert_parallel import group_of

        self.lockstep = group_of(loaded.base)  # --ep-size: the group every forward is a collective of

    # ---- GPU side ----

    def _forward(self, ids: torch.Tensor, index: torch.Tensor, packed: dict | None = None) -> list[torch.Tensor]:
        """(n, layers*hidden) states of the real tokens, and (n, hidden) final-norm states when asked.

        Packed batches (`packed` holds the forward's position ids and row bounds; Gated DeltaNet layers read theirs
        from `gdn.packed_rows`, set by `_launch`) put the n real tokens first: the states are a slice, no gather."""
        h = self.hidden
        if self.lockstep is not None:
            self.lockstep.agree(True)
        if packed is not None:
            n = index.shape[0]
            out = self.loaded.base(input_ids=ids, use_cache=False, **packed)
            states = [torch.cat([self.store[i].reshape(-1, h)[:n] for i in self.layers], dim=1) if self.layers
                      else out.last_hidden_state.new_empty((n, 0))]  # (policy-only: no layer stored)
            if self.final:
                states.append(out.last_hidden_state.reshape(-1, h)[:n])
            return states
        out = self.loaded.base(input_ids=ids, use_cache=False)
        # With a copy spread over several GPUs, layers live on different devices: gather where each layer is, then
        # bring the real tokens (not the padded batch) to the first device.
        parts = [self.store[i].reshape(-1, h).index_select(0, index.to(self.store[i].device, non_blocking=True))
                 .to(index.device, non_blocking=True) for i in self.layers]
        states = [torch.cat(parts, dim=1) if parts  # layers in ascending order
                  else out.last_hidden_state.new_empty((index.shape[0], 0), device=index.device)]
        if self.final:
            last = out.last_hidden_state
            states.append(last.reshape(-1, h).index_select(0, index.to(last.device)).to(index.device))
        return states

    def idle_in_lockstep(self) -> None:
        """--ep-size: once this rank has no forward left, one-token forwards (output dropped) for as long as another
        rank of its group has one, so that the group's all-to-alls always have every rank."""
        if self.lockstep is None:
            return
        if self.packing == "none":
            ids, packed, rows = torch.zeros((1, 1), dtype=torch.int64, device=self.device), {}, None
        else:  # one packed row of the pack multiple's length, as `_launch` hands the forward its rows
            n = self.pack_multiple
            ids = torch.zeros((1, n), dtype=torch.int64, device=self.device)
            bounds = np.array([0, n], dtype=np.int32)
            cu = torch.from_numpy(bounds).to(self.device)
            packed = {"position_ids": torch.arange(n, device=self.device).view(1, n), "cu_seq_lens_q": cu,
                      "cu_seq_lens_k": cu, "max_length_q": n, "max_length_k": n}
            rows = None
            if self.linear_attention:
                chunks = gdn.chunk_indices(bounds, np.empty(2 * (n // gdn.FLA_CHUNK + 2), dtype=np.int32))
                rows = gdn.PackedRows(cu_seqlens=cu, cu_seqlens_cpu=torch.from_numpy(bounds.astype(np.int64)),
                                      chunk_indices=torch.from_numpy(chunks.copy()).to(self.device).view(-1, 2))
        while self.lockstep.agree(False):
            with gdn.packed_rows(rows):
                self.loaded.base(input_ids=ids, use_cache=False, **packed)
            self.store.clear()

    def _topk(self, final: torch.Tensor, chunk: int = 2048) -> list[torch.Tensor]:
        """Top-k logits of lm_head(final) in chunks of tokens: full-vocabulary logits exist for `chunk` tokens at a
        time (2048 × 152k × 2 bytes = 0.6 GB), never for the batch (16k tokens: 5 GB)."""
        head = self.loaded.lm_head
        values, ids = [], []
        for a in range(0, final.shape[0], chunk):
            logits = final[a:a + chunk].to(head.dtype) @ head.t()
            v, i = logits.topk(self.topk, dim=-1)
            values.append(v)
            ids.append(i)
        return [torch.cat(values).to(torch.bfloat16).reshape(-1).view(torch.uint8),
                torch.cat(ids).to(torch.int32).reshape(-1).view(torch.uint8)]

    def _policy(self, final: torch.Tensor, chunk: int = 1024) -> list[torch.Tensor]:
        """The teacher policy (hsx.policy) of lm_head(final), in chunks of tokens: float32 logits exist for `chunk`
        tokens at a time (1024 × 152k × 4 bytes = 0.6 GB). Bytes of policy_ids, policy_logprobs, policy_tail."""
        from hsx.policy import serving_policy

        head = self.loaded.lm_head
        ids, log_probs, tails = [], [], []
        for a in range(0, final.shape[0], chunk):
            i, lp, tail = serving_policy(final[a:a + chunk].to(head.dtype) @ head.t(), self.policy, *self.teacher)
            ids.append(i)
            log_probs.append(lp)
            tails.append(tail)
        return [torch.cat(ids).to(torch.int32).reshape(-1).view(torch.uint8),
                torch.cat(log_probs).to(torch.float16).reshape(-1).view(torch.uint8),
                torch.cat(tails).reshape(-1).view(torch.uint8)]

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """Forward hooks on the captured layers for the duration (on the thread that runs the forwards): each
        forward's layer outputs land in `self.store`, which `_forward` reads."""
        with capture(self.loaded.base, self.layers) as store:
            self.store = store
            try:
                yield
            finally:
                self.store = {}

    def reserve(self, tokens: int) -> None:
        """Pinned slots for batches of up to `tokens` tokens (padding included), before the first batch."""
        if tokens <= self.capacity:
            return
        # Grow all slots together; only happens before the first batch or for a longer-than-budget row.
        while not self.free.empty():
            self.free.get_nowait()
        self.capacity = max(tokens, self.token_cap)
        for _ in range(self.num_slots):
            self.free.put(Slot(
                states=torch.empty(self.capacity * self.per_token, dtype=torch.uint8, pin_memory=self.cuda),
                ids=torch.empty(self.capacity + PAD_MULTIPLE * 64, dtype=torch.int64, pin_memory=self.cuda),
                index=torch.empty(self.capacity, dtype=torch.int64, pin_memory=self.cuda),
                positions=torch.empty(self.capacity + 2 * PAD_MULTIPLE, dtype=torch.int64, pin_memory=self.cuda),
                row_bounds=torch.empty(self.capacity + 2, dtype=torch.int32, pin_memory=self.cuda),
                chunks=torch.empty(2 * (self.capacity + self.capacity // gdn.FLA_CHUNK + 2), dtype=torch.int32,
                                   pin_memory=self.cuda),
                nonfinite=torch.zeros(self.capacity, dtype=torch.int32, pin_memory=self.cuda),
            ))

    def run_batch(self, table: pa.Table, slot: Slot) -> Result:
        """Everything for one map batch, asynchronously: returns once the work is queued on the GPU."""
        ids_col = table.column("input_ids").combine_chunks()
        offsets = ids_col.offsets.to_numpy().astype(np.int64)
        offsets -= offsets[0]
        values = ids_col.values.to_numpy()
        lengths = np.diff(offsets)
        rows = len(lengths)
        kept = np.ones(rows, dtype=bool)
        result = Result(sample_ids=table.column("sample_id").to_numpy(), slot=slot, kept=kept, tokens=0,
                        padded_tokens=0)
        slot.nonfinite[:rows].zero_()
        pending = [(0, rows)]
        written = 0  # tokens already placed in the slot
        while pending:
            a, z = pending.pop(0)
            sub_len = lengths[a:z]
            if self.packing == "none":
                padded = padded_length(sub_len)
                cost = (z - a) * padded  # tokens computed, padding included
            else:  # one sequence: the rows back to back, then padding up to a multiple of 8 (16: fla's kernels)
                padded = cost = int(-(-int(sub_len.sum()) // self.pack_multiple) * self.pack_multiple)
            if cost > self.token_cap and z - a > 1:  # over the (possibly shrunk) cap: split first
                mid = a + (z - a) // 2
                pending[:0] = [(a, mid), (mid, z)]
                continue
            try:
                self._launch(values[offsets[a]:offsets[z]], sub_len, padded, slot, written, a, result)
                written += int(sub_len.sum())
                result.padded_tokens += cost
            except torch.OutOfMemoryError:
                if self.lockstep is not None:  # the group's other ranks are inside this forward's all-to-alls
                    raise HsxError("out of memory in an expert-parallel forward (--ep-size): the group cannot split "
                                   "a batch one rank alone has started; give a smaller --token-budget") from None
                self.store.clear()
                if self.cuda:
                    torch.cuda.empty_cache()
                if z - a == 1:
                    kept[a] = False
                    continue
                self.token_cap = max(padded if self.packing == "none" else PAD_MULTIPLE, cost // 2)
                mid = a + (z - a) // 2
                pending[:0] = [(a, mid), (mid, z)]
        result.tokens = written
        if self.cuda:
            slot.done = torch.cuda.Event()
            slot.done.record(self.copy_stream)
        return result

    def _launch(self, values: np.ndarray, lengths: np.ndarray, padded: int, slot: Slot, at: int, row_at: int,
                result: Result) -> None:
        b, n = len(lengths), int(lengths.sum())
        if self.cuda and result.segment_tokens:
            torch.cuda.current_stream(self.device).synchronize()  # the staging buffers are in use (rare: a split)
        row = np.repeat(np.arange(b, dtype=np.int64), lengths)
        col = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        index_host = slot.index[at:at + n]
        packed = gdn_rows = None
        if self.packing == "none":
            ids_host = slot.ids[: b * padded]
            ids_np = ids_host.numpy().reshape(b, padded)
            ids_np.fill(0)  # pad id: any id works, pad positions never influence real ones (causal, right-padded)
            ids_np[row, col] = values
            np.multiply(row, padded, out=index_host.numpy())
            index_host.numpy()[:] += col
            ids = ids_host.to(self.device, non_blocking=True).view(b, padded)
        else:
            # Rows back to back; the tail padding is a sequence of its own (positions 0..), so nothing attends to it.
            tail = padded - n
            ids_np = slot.ids[:padded].numpy()
            ids_np[:n] = values
            ids_np[n:] = 0
            pos_np = slot.positions[:padded].numpy()
            pos_np[:n] = col
            pos_np[n:] = np.arange(tail)
            index_host.numpy()[:] = row  # packed: the row of each token (for the NaN/Inf count)
            ids = slot.ids[:padded].to(self.device, non_blocking=True).view(1, padded)
            bounds = slot.row_bounds[:b + 1 + (tail > 0)].numpy()  # cu_seqlens: row starts, the tail, the end
            bounds[0] = 0
            np.cumsum(lengths, out=bounds[1:b + 1])
            bounds[b + 1:] = padded
            cu = slot.row_bounds[:len(bounds)].to(self.device, non_blocking=True)
            longest = max(int(lengths.max()), tail)
            packed = {"position_ids": slot.positions[:padded].to(self.device, non_blocking=True).view(1, padded),
                      "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
            if self.linear_attention:  # fla's chunk indices, built here: fla would copy them with a host sync
                chunks = gdn.chunk_indices(bounds, slot.chunks.numpy())
                gdn_rows = gdn.PackedRows(cu_seqlens=cu, cu_seqlens_cpu=torch.from_numpy(bounds.astype(np.int64)),
                                          chunk_indices=slot.chunks[:chunks.size].to(self.device, non_blocking=True)
                                          .view(-1, 2))
        index = index_host.to(self.device, non_blocking=True)
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(self.device))
        t0 = time.perf_counter()
        with gdn.packed_rows(gdn_rows):
            states = self._forward(ids, index, packed)
        if self.compiler is not None:
            self.compiler.start(self.device, padded, self.token_cap)  # forwards recorded each kind's inputs
        result.segment_tokens.append(n)
        self.store.clear()
        # NaN/Inf per row, on the device (one read of the output, small next to the forward): tokens → rows.
        bad_tokens = ~torch.isfinite(states[0]).all(1)
        if self.final:
            bad_tokens |= ~torch.isfinite(states[1]).all(1)
        if self.storage_dtype == "float16":  # past fp16's range the stored value would be inf
            for x in states:
                bad_tokens |= (x.abs() > torch.finfo(torch.float16).max).any(1)
        token_rows = torch.div(index, padded, rounding_mode="floor") if packed is None else index
        bad_rows = torch.zeros(b, dtype=torch.int32, device=bad_tokens.device).index_add_(
            0, token_rows, bad_tokens.int())
        out = encode(states if self.store_final else states[:1], len(self.layers), self.storage_dtype)
        if self.topk:
            out = torch.cat([out, *self._topk(states[1])])
        if self.policy:
            out = torch.cat([out, *self._policy(states[1])])
        dest = slot.states[at * self.per_token:(at + n) * self.per_token]
        bad_dest = slot.nonfinite[row_at:row_at + b]
        if self.cuda:
            end.record(torch.cuda.current_stream(self.device))
            result.gpu_events.append((start, end))
            self.copy_stream.wait_event(end)
            with torch.cuda.stream(self.copy_stream):
                dest.copy_(out, non_blocking=True)
                bad_dest.copy_(bad_rows, non_blocking=True)
            out.record_stream(self.copy_stream)  # keep the allocator off `out` until the copy is done
            bad_rows.record_stream(self.copy_stream)
        else:
            dest.copy_(out)
            bad_dest.copy_(bad_rows)
            result.seconds += time.perf_counter() - t0

    # ---- host side ----

    def to_table(self, table: pa.Table, result: Result) -> pa.Table:
        """The map function's output: the input's columns plus the states, wrapping the slot without a copy.
        The caller has waited for the slot's copy (`Pipeline.__call__`).

        Rows dropped by an OOM have no states in the slot; rows with NaN/Inf states are dropped (a copy of the
        remaining states, only for such a batch) or kept with `has_nonfinite` set, as configured."""
        nonfinite = result.slot.nonfinite[: len(result.kept)].numpy()[result.kept] > 0
        if not result.kept.all():
            table = table.filter(pa.array(result.kept))
        lengths = table.column("num_tokens").to_numpy().astype(np.int64)
        n = int(lengths.sum())
        flat = result.slot.states[: n * self.per_token].numpy()
        values = _split_columns(flat, result.segment_tokens, self.columns)
        result.nonfinite_rows = int(nonfinite.sum())
        if result.nonfinite_rows and self.nonfinite == "skip":
            keep_tokens = np.repeat(~nonfinite, lengths)
            values = [v.reshape(-1, c.nbytes)[keep_tokens].reshape(-1) for v, c in zip(values, self.columns)]
            table = table.filter(pa.array(~nonfinite))
            lengths = lengths[~nonfinite]
        offsets = pa.array(np.r_[0, np.cumsum(lengths)].astype(np.int32))
        columns = {c: table.column(c) for c in ROW_COLUMNS}
        for v, c in zip(values, self.columns):
            columns[c.name] = _nested(v, offsets, c)
        if self.nonfinite == "keep":
            columns["has_nonfinite"] = pa.array(nonfinite)
        return pa.table(columns)

    def gpu_seconds(self, result: Result) -> float:
        if not result.gpu_events:
            return result.seconds
        return sum(s.elapsed_time(e) for s, e in result.gpu_events) / 1000.0


def _nested(values: np.ndarray, offsets: pa.Array, column: Column) -> pa.Array:
    """list<fixed_size_list<type, width>> over `values` (bytes of the column), without copying them."""
    flat = pa.Array.from_buffers(column.arrow_type, len(values) // column.itemsize, [None, pa.py_buffer(values)])
    return pa.ListArray.from_arrays(offsets, pa.FixedSizeListArray.from_arrays(flat, column.width))


def _split_columns(flat: np.ndarray, segment_tokens: list[int], columns: list[Column]) -> list[np.ndarray]:
    """Each launched segment holds its tokens' bytes column after column; return each column's bytes.

    The common case is one segment per batch: zero-copy views. Split batches (after an OOM) are rare and take
    one copy."""
    if len(segment_tokens) <= 1:
        n = int(sum(segment_tokens))
        edges = np.cumsum([0] + [n * c.nbytes for c in columns])
        return [flat[a:z] for a, z in zip(edges[:-1], edges[1:])]
    pieces: list[list[np.ndarray]] = [[] for _ in columns]
    at = 0
    for t in segment_tokens:
        for k, c in enumerate(columns):
            pieces[k].append(flat[at:at + t * c.nbytes])
            at += t * c.nbytes
    return [np.concatenate(p) for p in pieces]


def sdpa_backend(name: str, cuda: bool):
    """The SDPA kernel to use. cuDNN's attention spends host time per call building plans for new (batch,
    length) shapes, which made the host, not the GPU, the bottleneck (docs/benchmarks.md, "What limits it")."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not cuda or name == "default":
        return nullcontext()
    first = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]
    rest = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel([first] + [b for b in rest if b != first], set_priority=True)


class Pipeline:
    """Runs `Extractor.run_batch` over a fixed sequence of batches in a thread, a few batches ahead of `map`."""

    def __init__(self, extractor: Extractor, batches: Iterator[pa.Table], max_batch_tokens: int):
        self.ex = extractor
        self.ex.reserve(max_batch_tokens)
        self.results: queue.Queue = queue.Queue()
        self.returned: Slot | None = None  # the slot whose table map is writing now
        self.last: Result | None = None  # the Result of the table returned last (its counts)
        self.stop = threading.Event()
        # Where the time goes: the producer blocked on a free slot (the writer is behind), map waiting for the GPU,
        # and the time between map calls (datasets writing the previous table).
        self.wait_seconds = 0.0
        self.map_wait_seconds = 0.0
        self.write_seconds = 0.0
        self._returned_at: float | None = None
        # Joined by `close` (job.Extraction's context, hsx.stream's finally); daemon only so that a Pipeline someone forgot
        # to close, its producer waiting for a slot forever, cannot hold the interpreter open.
        self.thread = threading.Thread(target=self._produce, args=(batches,), name="hsx-gpu", daemon=True)
        self.thread.start()

    def _produce(self, batches: Iterator[pa.Table]) -> None:
        try:
            if self.ex.cuda:
                # The current CUDA device is per thread and starts at 0 here. On any other GPU, events recorded on
                # "the current stream" would be on GPU 0's and the copy out would not wait for the forward
                # (seen on 2 GPUs: rank 1 wrote garbage rows; docs/benchmarks.md, "Figures moved from the code").
                torch.cuda.set_device(self.ex.device)
            with torch.inference_mode(), sdpa_backend(self.ex.sdpa_backend, self.ex.cuda), self.ex.capturing():
                for table in batches:
                    t0 = time.perf_counter()
                    slot = self.ex.free.get()
                    self.wait_seconds += time.perf_counter() - t0
                    if slot is None or self.stop.is_set():
                        break
                    self.results.put(self.ex.run_batch(table, slot))
                self.ex.idle_in_lockstep()  # (not after an error: the rank's end ends its group's collectives)
        except BaseException as e:  # surfaced in the map function, on the main thread
            self.results.put(e)
        finally:
            self.results.put(None)

    def __call__(self, table: pa.Table) -> pa.Table:
        """The function given to `datasets.map` (batched, arrow-formatted)."""
        t0 = time.perf_counter()
        if self._returned_at is not None:
            self.write_seconds += t0 - self._returned_at
        if self.returned is not None:
            self.ex.free.put(self.returned)  # datasets wrote the previous table before calling us again
            self.returned = None
        result = self.results.get()
        if isinstance(result, BaseException):
            raise result
        if result is None:
            raise RuntimeError("hsx: the GPU pipeline ended before map did (batches out of step)")
        if len(result.sample_ids) != table.num_rows or not np.array_equal(
                result.sample_ids, table.column("sample_id").to_numpy()):
            raise RuntimeError("hsx: the GPU pipeline and map are out of step")
        self.last = result
        if result.slot.done is not None:
            result.slot.done.synchronize()
        self.map_wait_seconds += time.perf_counter() - t0
        out = self.ex.to_table(table, result)
        self.returned = result.slot
        self._returned_at = time.perf_counter()
        return out

    def release(self) -> None:
        """After a unit's map has finished (its last table is written)."""
        if self._returned_at is not None:
            self.write_seconds += time.perf_counter() - self._returned_at
            self._returned_at = None
        if self.returned is not None:
            self.ex.free.put(self.returned)
            self.returned = None

    def close(self) -> None:
        """Stop the producer after the batch it is running and join it (no deadline: a thread left inside a CUDA
        call when the interpreter exits aborts the process)."""
        self.stop.set()
        self.release()
        self.ex.free.put(None)  # wakes a producer blocked on a slot
        self.thread.join()
