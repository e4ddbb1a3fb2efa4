"""The forward path in float32, checked before storage: truncated model + hooks + right-padded batches + gather.

The Extractor is driven through the Pipeline, exactly as `datasets.map` drives it; its device tensor (what it copies
to the host as bf16 bits) is recorded by wrapping `_forward`, and compared with the full-depth model run on one
sample, unpadded (helpers.TinyModel.reference), within 1e-5.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from helpers import as_table, bf16_ulps, make_cfg
from hsx.engine import Extractor, Pipeline
from hsx.errors import HsxError
from hsx.target.capture import capture
from hsx.target.model import load_model
from hsx.target.prepare import prepare_model

CPU = torch.device("cpu")


def sample_ids_lists(tokenizer, n=7, seed=11):
    from hsx.demo import chat_rows

    rows = chat_rows(n, seed=seed)[:n]
    return [tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"] for r in rows]


class Recorder:
    """Wraps Extractor._forward. For each forward it records the padded ids, the gather index, the hooked layers'
    outputs and the final norm's output as the model computed them (float32 for a float32 model, before any
    conversion for storage), and the tensor `_forward` hands on to be copied out."""

    def __init__(self, ex: Extractor, fail=None):
        self.ex = ex
        self.orig = ex._forward
        self.calls: list[dict] = []
        self.fail = fail
        self._final = None
        norm = getattr(ex.loaded.base, "norm", None)
        if ex.final and isinstance(norm, torch.nn.Module):
            norm.register_forward_hook(lambda m, a, o: setattr(self, "_final", o.detach().clone()))
        ex._forward = self

    def __call__(self, ids, index, packed=None):
        if self.fail is not None and self.fail(ids):
            raise torch.OutOfMemoryError("simulated")
        out = self.orig(ids, index, packed)
        self.calls.append({
            "ids": ids.detach().clone(), "index": index.detach().clone(),
            "layers": {i: t.detach().clone() for i, t in self.ex.store.items()},
            "final": self._final, "out": [t.detach().clone() for t in out],
        })
        return out

    def real_tokens(self, call, lengths):
        """(n, layers, hidden) and (n, hidden) of the real tokens, gathered here with our own host index."""
        b, padded = call["ids"].shape
        rows = np.repeat(np.arange(b), lengths)
        cols = np.concatenate([np.arange(t) for t in lengths])
        states = torch.stack([call["layers"][i][rows, cols] for i in self.ex.layers], dim=1)
        final = call["final"][rows, cols] if call["final"] is not None else None
        return states, final, torch.from_numpy(rows * padded + cols)


def run_pipeline(loaded, batches, token_budget, fail=None, packing="none"):
    ex = Extractor(loaded, CPU, token_budget, prepare_model(loaded.base, packing))
    rec = Recorder(ex, fail)
    # rows × their padded length: also bounds a packed batch (its tokens rounded up to a multiple of 8)
    max_tokens = max(t.num_rows * (-(-max(t.column("num_tokens").to_pylist()) // 8) * 8) for t in batches)
    pipe = Pipeline(ex, iter(batches), max_tokens)
    try:
        tables = [pipe(t) for t in batches]
    finally:
        pipe.close()
    return ex, rec, tables


def stored(table, column, width):
    flat = table.column(column).combine_chunks().flatten().flatten().to_numpy().copy()
    return torch.from_numpy(flat).view(torch.bfloat16).reshape(-1, width)


@pytest.fixture(scope="module")
def ids_lists(tokenizer):
    return sample_ids_lists(tokenizer)


@pytest.mark.parametrize(("layers", "final"), [([0, 2, 5], False), ([1, 4, 7], True), ([7], False)],
                         ids=["truncated", "last+final", "last-only"])
def test_float32_forward_matches_reference(model8, ids_lists, layers, final):
    """Truncated model, hooks, right padding, attention_mask=None: real tokens equal the unpadded full-depth
    reference within 1e-5 in float32, for several layers including the last (pre-norm) and the final norm."""
    loaded = load_model(make_cfg(model8, layers, final), CPU)
    assert next(loaded.base.parameters()).dtype == torch.float32
    # two batches of several rows of different lengths: right padding inside each
    batches = [as_table(ids_lists[:4]), as_table(ids_lists[4:], first_id=4)]
    ex, rec, tables = run_pipeline(loaded, batches, token_budget=1 << 16)
    assert [c["ids"].shape[0] for c in rec.calls] == [4, len(ids_lists) - 4]
    for batch, call in zip(batches, rec.calls):
        lengths = batch.column("num_tokens").to_pylist()
        assert len(set(lengths)) > 1  # really padded
        assert call["ids"].shape[1] % 8 == 0 and call["ids"].shape[1] >= max(lengths)
        assert sorted(call["layers"]) == layers
        states, fin, index = rec.real_tokens(call, lengths)
        assert states.dtype == torch.float32
        assert torch.equal(call["index"], index)  # hsx's host-built gather index picks exactly the real tokens
        at = 0
        for ids in batch.column("input_ids").to_pylist():
            ref = model8.reference(ids)
            t = len(ids)
            assert call["ids"][ids_row(call, at, t)].tolist()[:t] == ids
            for k, layer in enumerate(layers):
                torch.testing.assert_close(states[at:at + t, k], ref[layer], atol=1e-5, rtol=1e-5,
                                           msg=lambda m, layer=layer: f"layer {layer}: {m}")
            if final:
                torch.testing.assert_close(fin[at:at + t], ref["final"], atol=1e-5, rtol=1e-5)
            at += t
    # and what is stored is those float32 values rounded to bf16 (within 1 bf16 ulp of the reference)
    for batch, table in zip(batches, tables):
        check_table_against_reference(model8, table, layers, final)


def ids_row(call, at, t):
    """The padded row of `ids` holding the real tokens that start at flat position `at`."""
    return int(call["index"][at]) // call["ids"].shape[1]


def test_layers_are_distinguishable(model8, ids_lists):
    """Guard for the tests above: neighbouring layers (and pre-/post-norm) differ by far more than tolerance."""
    ref = model8.reference(ids_lists[0])
    for i in range(model8.num_layers - 1):
        assert (ref[i] - ref[i + 1]).abs().max() > 1e-2
    assert (ref[model8.num_layers - 1] - ref["final"]).abs().max() > 1e-2


def test_stored_bits_are_the_bf16_of_the_forward(model8, ids_lists):
    """The table stores exactly the bf16 bits of the computed states: layers side by side in `layers` order,
    the final norm separately, rows in batch order."""
    layers = [1, 4, 7]
    h = model8.hidden
    loaded = load_model(make_cfg(model8, layers, True), CPU)
    batch = as_table(ids_lists[:5])
    ex, rec, (table,) = run_pipeline(loaded, [batch], token_budget=1 << 16)
    assert table.column_names == ["sample_id", "input_ids", "loss_mask", "num_tokens", "hidden_states",
                                  "final_hidden_state"]
    assert table.schema.field("hidden_states").type == pa.list_(pa.list_(pa.int16(), len(layers) * h))
    assert table.schema.field("final_hidden_state").type == pa.list_(pa.list_(pa.int16(), h))
    states, fin, _ = rec.real_tokens(rec.calls[0], batch.column("num_tokens").to_pylist())
    assert torch.equal(stored(table, "hidden_states", len(layers) * h).reshape(-1, len(layers), h),
                       states.to(torch.bfloat16))
    assert torch.equal(stored(table, "final_hidden_state", h), fin.to(torch.bfloat16))
    for c in ("sample_id", "input_ids", "loss_mask", "num_tokens"):
        assert table.column(c).to_pylist() == batch.column(c).to_pylist()


def test_batch_split_over_token_cap_keeps_layout(model8, ids_lists):
    """A batch over the token cap runs as several forwards; the stored rows equal one-at-a-time reference."""
    layers = [2, 7]
    loaded = load_model(make_cfg(model8, layers, True), CPU)
    batch = as_table(ids_lists[:5])
    longest = -(-max(batch.column("num_tokens").to_pylist()) // 8) * 8
    ex, rec, (table,) = run_pipeline(loaded, [batch], token_budget=longest)
    assert len(rec.calls) > 1, "the batch should have been split"
    check_table_against_reference(model8, table, layers, final=True)


def test_oom_split_and_drop(model8, ids_lists):
    """An OOM splits the batch; a single row that still does not fit is dropped; the rest stay exact."""
    layers = [3]
    loaded = load_model(make_cfg(model8, layers, True), CPU)
    batch = as_table(ids_lists[:5])
    victim = max(range(5), key=lambda r: len(ids_lists[r]))
    victim_len = -(-len(ids_lists[victim]) // 8) * 8
    assert [-(-len(ids_lists[r]) // 8) * 8 for r in range(5)].count(victim_len) == 1

    def fail(ids):  # everything with more than one row fails, and the longest row fails alone too
        return ids.shape[0] > 1 or ids.shape[1] == victim_len

    ex, rec, (table,) = run_pipeline(loaded, [batch], token_budget=1 << 16, fail=fail)
    kept = [r for r in range(5) if r != victim]
    assert table.column("sample_id").to_pylist() == kept
    assert ex.token_cap < (1 << 16)
    check_table_against_reference(model8, table, layers, final=True)


def test_an_oom_inside_an_expert_parallel_forward_is_one_line_not_a_split(model8, ids_lists):
    """Under --ep-size the group's other ranks are inside the forward's all-to-alls, so one rank cannot split the
    batch alone: an out-of-memory error there is one line naming --token-budget (it was a NameError: the engine
    raised HsxError without importing it)."""
    loaded = load_model(make_cfg(model8, [3], True), CPU)
    ex = Extractor(loaded, CPU, 1 << 16, prepare_model(loaded.base, "none"))

    class OneRankGroup:  # agrees with itself: the lockstep of a group of one
        def agree(self, has_work):
            return has_work

    ex.lockstep = OneRankGroup()
    Recorder(ex, fail=lambda ids: True)
    batch = as_table(ids_lists[:3])
    pipe = Pipeline(ex, iter([batch]), 1 << 16)
    try:
        with pytest.raises(HsxError, match="out of memory in an expert-parallel forward .*--token-budget"):
            pipe(batch)
    finally:
        pipe.close()


def check_table_against_reference(model, table, layers, final):
    """Stored bf16 states are the float32 reference rounded to bf16, within 1 bf16 ulp."""
    h = model.hidden
    for row in table.to_pylist():
        ref = model.reference(row["input_ids"])
        got = torch.tensor(row["hidden_states"], dtype=torch.int16).view(torch.bfloat16).reshape(-1, len(layers), h)
        assert got.shape[0] == row["num_tokens"] == len(row["input_ids"])
        for k, layer in enumerate(layers):
            assert int(bf16_ulps(got[:, k], ref[layer]).max()) <= 1, f"layer {layer}"
        if final:
            fin = torch.tensor(row["final_hidden_state"], dtype=torch.int16).view(torch.bfloat16)
            assert int(bf16_ulps(fin.reshape(-1, h), ref["final"]).max()) <= 1


# ---- model loading and hooks ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("layers", "final", "depth"), [([0, 2], False, 3), ([5], False, 6), ([1], True, 8),
                                                       ("dflash-2", False, 6)])
def test_load_model_truncates(model8, layers, final, depth):
    loaded = load_model(make_cfg(model8, layers, final), CPU)
    base = loaded.base
    assert loaded.depth == depth and len(base.layers) == depth
    assert loaded.num_model_layers == 8 and loaded.hidden_size == 64
    assert not hasattr(base, "lm_head")
    assert not any(p.requires_grad for p in base.parameters())
    assert isinstance(base.norm, torch.nn.Identity) != final
    # the loaded weights are the saved ones (float32: bit-exact)
    src = model8.model.model
    for i in range(depth):
        for (name, p), (name2, q) in zip(base.layers[i].named_parameters(), src.layers[i].named_parameters()):
            assert name == name2 and torch.equal(p, q)
    assert torch.equal(base.embed_tokens.weight, src.embed_tokens.weight)


def test_load_model_dtype(model8):
    loaded = load_model(make_cfg(model8, [1], False, dtype="bfloat16"), CPU)
    assert next(loaded.base.parameters()).dtype == torch.bfloat16


def test_capture_hooks_removed(model8):
    loaded = load_model(make_cfg(model8, [0, 2], False), CPU)
    layers = loaded.base.layers
    with pytest.raises(RuntimeError, match="boom"):
        with capture(loaded.base, [0, 2]) as store:
            assert len(layers[0]._forward_hooks) == 1 and len(layers[2]._forward_hooks) == 1
            with torch.inference_mode():
                loaded.base(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
            assert sorted(store) == [0, 2] and store[2].shape == (1, 3, 64)
            raise RuntimeError("boom")
    assert all(len(layer._forward_hooks) == 0 for layer in layers)
    assert store == {}


# ---- packed batches (--packing) ------------------------------------------------------------------------------------

def test_packed_batches_match_reference(model8, ids_lists):
    """Each batch runs as ONE sequence (rows back to back, padding to a multiple of 8 as a sequence of its own);
    stored rows equal the one-sample reference, as with right padding."""
    layers = [1, 4, 7]
    loaded = load_model(make_cfg(model8, layers, True), CPU)
    batches = [as_table(ids_lists[:4]), as_table(ids_lists[4:], first_id=4)]
    ex, rec, tables = run_pipeline(loaded, batches, 1 << 16, packing="varlen")
    for batch, call in zip(batches, rec.calls):
        n = sum(batch.column("num_tokens").to_pylist())
        assert call["ids"].shape == (1, -(-n // 8) * 8)
        assert call["ids"][0, :n].tolist() == [t for ids in batch.column("input_ids").to_pylist() for t in ids]
    for table in tables:
        check_table_against_reference(model8, table, layers, final=True)


def test_packed_split_and_oom(model8, ids_lists):
    """Packed batches over the token cap split by tokens; an OOM splits further and drops a row only alone."""
    layers = [2, 7]
    loaded = load_model(make_cfg(model8, layers, True), CPU)
    batch = as_table(ids_lists[:5])
    lengths = batch.column("num_tokens").to_pylist()
    ex, rec, (table,) = run_pipeline(loaded, [batch], sum(lengths) // 2, packing="varlen")
    assert len(rec.calls) > 1 and all(c["ids"].shape[0] == 1 for c in rec.calls)
    check_table_against_reference(model8, table, layers, final=True)
    victim = max(range(5), key=lambda r: lengths[r])
    victim_len = -(-lengths[victim] // 8) * 8

    def fail(ids):  # anything longer than the longest row alone fails, and that row alone too
        return ids.shape[1] >= victim_len

    ex, rec, (table,) = run_pipeline(loaded, [batch], 1 << 16, fail=fail, packing="varlen")
    assert table.column("sample_id").to_pylist() == [r for r in range(5) if r != victim]
    check_table_against_reference(model8, table, layers, final=True)


def test_packed_nonfinite_rows_are_found_per_row(model8, ids_lists):
    """NaN in one row's tokens of a packed sequence: that row (and only it) is skipped."""
    from hsx.target.model import decoder_layers

    layers = [1, 3]
    loaded = load_model(make_cfg(model8, layers, False), CPU)
    batch = as_table(ids_lists[:4])
    lengths = batch.column("num_tokens").to_pylist()
    a, z = sum(lengths[:2]), sum(lengths[:3])  # row 2's tokens in the packed sequence

    def poison(module, args, output):
        output[0, a:z] = float("nan")
        return output

    handle = decoder_layers(loaded.base)[0].register_forward_hook(poison)
    try:
        ex, rec, (table,) = run_pipeline(loaded, [batch], 1 << 16, packing="varlen")
    finally:
        handle.remove()
    assert table.column("sample_id").to_pylist() == [0, 1, 3]
    check_table_against_reference(model8, table, layers, final=False)


def test_inductors_fx_trace_runs_before_the_compile_worker(monkeypatch):
    """torch.fx swaps nn.Module.__call__ for every thread while it traces; Inductor's one symbolic trace per process
    (a dummy graph, cached) made on the compile worker broke an eager forward on the extraction thread. `start`
    makes it on the calling thread first: the worker's lowering then hits the cache."""
    import threading

    import torch
    from torch._inductor.loop_body import InterpreterShim

    from hsx.target.prepare import CompileAhead

    InterpreterShim._dummy_gm.cache_clear()
    traced_on = []
    real = torch.fx.symbolic_trace
    monkeypatch.setattr(torch.fx, "symbolic_trace",
                        lambda root, *a, **k: traced_on.append(threading.current_thread()) or real(root, *a, **k))
    state = CompileAhead(log=lambda *a: None)
    state.record(("kind",), (torch.zeros(1),), {})  # one layer kind seen, no compiled layer to run
    state.start(torch.device("cpu"))
    state.thread.join(30)
    assert traced_on == [threading.current_thread()] and InterpreterShim._dummy_gm.cache_info().currsize == 1
    InterpreterShim._dummy_gm()  # what the worker's first lowering calls: a cache hit, no trace
    assert len(traced_on) == 1 and state.ready.is_set() and state.failed is None


def test_a_second_ctrl_c_while_joining_the_compile_worker_ends_it_first():
    """A stopped job joins the compile worker as it ends; a second Ctrl-C then (hsx.run's handler raises
    KeyboardInterrupt) must reach the job only once the worker ended, no further layer kind compiled: raised in the
    join, it left the worker compiling and the interpreter's exit waiting for it."""
    import os
    import signal
    import threading
    import time

    import torch

    from hsx.run import stop_on_signal
    from hsx.target.prepare import CompileAhead

    compiling, compiled = threading.Event(), []

    def slow_kind(x):  # a compile in progress: it cannot be cut short
        compiling.set()
        time.sleep(1.0)
        compiled.append("a")

    def signals():
        compiling.wait(30)
        for _ in range(2):  # apart: two signals before the handler runs are one
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)

    state = CompileAhead(log=lambda *a: None)
    state.record(("a",), (torch.zeros(1),), {})
    state.record(("b",), (torch.zeros(1),), {})
    state.layers = [(("a",), slow_kind), (("b",), lambda x: compiled.append("b"))]
    with stop_on_signal(lambda *a: None) as stop:
        state.start(torch.device("cpu"))
        sender = threading.Thread(target=signals)
        sender.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                state.close(finish=True)
            alive = state.thread.is_alive()
        finally:
            sender.join()
            state.thread.join()
    assert not alive and stop.is_set()
    assert compiled == ["a"]  # the signal stopped the worker after its kind


def test_the_compile_waits_for_a_representative_batch_and_takes_the_largest():
    """Inductor picks its kernels' tiles for the sample's sizes, so the compile runs on the largest forward seen:
    it starts after a forward of at least half the token budget, or after SAMPLE_FORWARDS forwards, or when `wait`
    asks for it (a benchmark's warm-up), never on a small first batch alone."""
    import torch

    from hsx.target import prepare
    from hsx.target.prepare import CompileAhead

    ran = []
    cpu = torch.device("cpu")

    def compiling(state):
        state.layers = [(("a",), lambda h, **kw: ran.append(h.shape[1]))]
        return state

    state = compiling(CompileAhead(log=lambda *a: None))
    for tokens in (16, 900, 300):  # forwards under half a 4,096 budget: recorded, not compiled
        state.record(("a",), (torch.zeros(1, tokens, 4),), {})
        state.start(cpu, tokens, 4096)
    assert state.thread is None and state.samples[("a",)][3] == 900
    state.record(("a",), (torch.zeros(1, 2048, 4),), {})
    state.start(cpu, 2048, 4096)  # half the budget: the compile starts, on the largest sample
    state.thread.join(30)
    assert state.ready.is_set() and ran == [2048]

    state = compiling(CompileAhead(log=lambda *a: None))
    for i in range(prepare.SAMPLE_FORWARDS):
        state.record(("a",), (torch.zeros(1, 10 + i % 3, 4),), {})
        state.start(cpu, 10 + i % 3, 4096)
        assert (state.thread is None) == (i < prepare.SAMPLE_FORWARDS - 1)  # small batches only: the 16th starts it
    state.thread.join(30)
    assert ran[-1] == 12

    state = compiling(CompileAhead(log=lambda *a: None))
    state.record(("a",), (torch.zeros(1, 40, 4),), {})
    state.start(cpu, 40, 4096)
    assert state.thread is None and state.wait(30) and ran[-1] == 40  # the warm-up's wait starts it
