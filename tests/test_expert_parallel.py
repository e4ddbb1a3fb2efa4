"""--ep-size: a mixture of experts' routed experts sharded over the processes of a group (gloo on CPU), each process
on its own batches and units, tokens sent to their experts' ranks by all-to-all. Each run must equal one process
row by row: within float32 rounding, not bit for bit (the experts' GEMMs run other row counts than in one process,
and CPU GEMMs round a row differently at another row count: a few ulps, relative error norm ~1e-9 here).

Models: tiny random Qwen3-MoE (8 experts, 2 per token, a dense layer among MoE ones) and DeepSeek-V3 (MLA, a dense
first layer, 8 routed experts and a shared one), with the demo's tokenizer, saved in float32. FP8 experts as stored
(e4m3 with block scales, hsx's grouped FP8 path: on CPU its torch reference) are checked at the model's forward,
as `hsx extract` on a CPU loads an FP8 checkpoint dequantized (transformers does, without CUDA)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import Child, assert_units_intact, child_env, child_pids, committed_units, free_port, is_complete

import hsx
from hsx.config import HsxError

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "hsx" / "demo" / "tiny-qwen3"
CHATS = ROOT / "hsx" / "demo" / "chat.jsonl"


def tiny_moe_config(kind: str):
    import transformers as T

    vocab = json.loads((DEMO / "config.json").read_text())["vocab_size"]
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=2, pad_token_id=0)
    if kind == "qwen3_moe":
        return T.Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=16, num_hidden_layers=4, num_experts=8,
                                num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                                mlp_only_layers=[1])
    return T.DeepseekV3Config(**common, num_hidden_layers=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                              topk_group=1, moe_intermediate_size=32)


def save_tiny_moe(folder: Path, kind: str) -> Path:
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(kind), dtype=torch.float32)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEMO / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ep-models")
    return {kind: save_tiny_moe(root / kind, kind) for kind in ("qwen3_moe", "deepseek_v3")}


def argv(model: Path, out: Path, *extra: str) -> list[str]:
    return ["extract", "--model", str(model), "--dataset", str(CHATS), "--layers", "1", "3", "--final-hidden",
            "--dtype", "float32", "--storage-dtype", "float32", "--max-length", "512", "--limit", "40",
            "--output-dir", str(out), *extra]


def command(args: list[str], nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "hsx", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), "-m", "hsx", *args]


def run(args: list[str], nproc: int):
    return subprocess.run(command(args, nproc), cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=600)


def failure(r) -> str:
    return "\n".join([line for line in r.stderr.splitlines() if "hsx:" in line] + [r.stderr[-2000:]])


@pytest.fixture(scope="module")
def references(models, tmp_path_factory) -> dict[str, Path]:
    """One process, no --ep-size: the output every expert-parallel run must equal."""
    root = tmp_path_factory.mktemp("ep-refs")
    refs = {}
    for kind, model in models.items():
        r = run(argv(model, root / kind), 1)
        assert r.returncode == 0, failure(r)
        refs[kind] = root / kind
    return refs


def assert_equals_one_process(out: Path, ref: Path, rows: int = 40, tolerance: float = 1e-7) -> None:
    """The same rows, ids and masks; the states within float32 rounding (relative error norm under 1e-7, float32's
    unit roundoff is 6e-8). `rows`: the first rows of the reference's job (a job of a smaller --limit)."""
    a = hsx.load(str(ref)).data.table.sort_by("sample_id").slice(0, rows)
    b = hsx.load(str(out)).data.table.sort_by("sample_id")
    assert a.num_rows == b.num_rows == rows
    for c in ("sample_id", "input_ids", "loss_mask", "num_tokens"):
        assert a.column(c).combine_chunks().equals(b.column(c).combine_chunks()), c
    for c in ("hidden_states", "final_hidden_state"):
        x, y = (np.asarray(t.column(c).combine_chunks().flatten().flatten().to_numpy(zero_copy_only=False),
                           dtype=np.float64) for t in (a, b))
        assert np.abs(x).max() > 0.05
        assert np.linalg.norm(x - y) / np.linalg.norm(x) < tolerance, c


def writers(out: Path) -> list[str]:
    return sorted(m.name for m in (out / ".hsx").glob("manifest-*.jsonl") if m.stat().st_size)


# ---- expert-parallel runs against one process ----------------------------------------------------------------------

@pytest.mark.slow
def test_two_ranks_qwen3_moe_equal_one_process(models, references, tmp_path):
    out = tmp_path / "ep2"
    r = run(argv(models["qwen3_moe"], out, "--ep-size", "2"), 2)
    assert r.returncode == 0, failure(r)
    assert ("--ep-size 2: each rank holds 4 routed experts of each of 3 mixture-of-experts layers (8 experts each; "
            "only its own read from the checkpoint)") in r.stdout
    info = json.loads((out / "hsx.json").read_text())
    assert (info["world_size"], info["config"]["ep_size"], info["run"]["model_copies"]) == (2, 2, 2)
    assert writers(out) == ["manifest-00000.jsonl", "manifest-00001.jsonl"]  # each rank its own units
    assert_equals_one_process(out, references["qwen3_moe"])


@pytest.mark.slow
def test_four_ranks_deepseek_v3_equal_one_process(models, references, tmp_path):
    """One group of 4 (2 experts each, MLA and the shared expert whole on each rank), uneven shares of units."""
    out = tmp_path / "ep4"
    r = run(argv(models["deepseek_v3"], out, "--ep-size", "4", "--unit-tokens", "1500"), 4)
    assert r.returncode == 0, failure(r)
    assert "--ep-size 4: each rank holds 2 routed experts of each of 3 mixture-of-experts layers" in r.stdout
    assert len(writers(out)) == 4  # every rank wrote units of its own
    assert_equals_one_process(out, references["deepseek_v3"])


@pytest.mark.slow
def test_an_idle_rank_serves_its_group_and_two_groups_split_the_units(models, references, tmp_path):
    """A job of one row (one unit): rank 0 writes it, rank 1 has no unit and runs idle forwards until rank 0 is done
    (without them rank 0 would wait in its first all-to-all); packed (--packing varlen, as on GPUs: the idle
    forward is one packed row too). Then 4 processes as 2 groups of 2."""
    one = tmp_path / "one-unit"
    r = run(argv(models["deepseek_v3"], one, "--ep-size", "2", "--limit", "1", "--packing", "varlen"), 2)
    assert r.returncode == 0, failure(r)
    assert writers(one) == ["manifest-00000.jsonl"]
    # (the reference ran right-padded: its attention sums in another order than the packed one's)
    assert_equals_one_process(one, references["deepseek_v3"], rows=1, tolerance=1e-6)
    groups = tmp_path / "two-groups"
    r = run(argv(models["qwen3_moe"], groups, "--ep-size", "2"), 4)
    assert r.returncode == 0, failure(r)
    assert len(writers(groups)) == 4
    assert_equals_one_process(groups, references["qwen3_moe"])


@pytest.mark.slow
def test_a_rank_killed_ends_its_group_and_the_same_command_finishes_the_job(models, references, tmp_path):
    """SIGKILL one worker of a 2-process --ep-size 2 job after its first committed units: the other rank (inside
    or entering an all-to-all with it) ends too, the launcher exits non-zero, committed units are intact; the same
    command finishes the job, equal to one process."""
    out = tmp_path / "out"
    args = argv(models["qwen3_moe"], out, "--ep-size", "2", "--unit-tokens", "300")
    child = Child(command(args, 2), tmp_path / "run", env=child_env(), cwd=ROOT)
    assert child.poll_until(lambda: committed_units(out) >= 2), child.stderr
    workers = child_pids(child.proc.pid)
    assert len(workers) == 2, workers
    os.kill(max(workers), signal.SIGKILL)
    assert child.wait(timeout=300) != 0
    child.kill_tree(signal.SIGKILL)  # nothing of the job may outlive it
    done = len(assert_units_intact(out))
    units = len(json.loads((out / ".hsx" / "summary.json").read_text())["unit_names"])
    assert 2 <= done < units and not is_complete(out), (done, units)
    r = run(args, 2)
    assert r.returncode == 0, failure(r)
    assert "continuing the job" in r.stdout
    assert is_complete(out)
    assert_equals_one_process(out, references["qwen3_moe"])


# ---- the sharding and the refusals (no process group) ---------------------------------------------------------------

def fake_group(size: int, rank: int):
    from hsx.target.expert_parallel import EpGroup

    return EpGroup(group=None, size=size, rank=rank, device=torch.device("cpu"))


def test_each_rank_keeps_its_contiguous_share_of_every_experts_tensor():
    import transformers

    from hsx.target.expert_parallel import GROUP, shard_experts

    torch.manual_seed(0)
    full = transformers.AutoModel.from_config(tiny_moe_config("deepseek_v3"), dtype=torch.float32)
    torch.manual_seed(0)
    part = transformers.AutoModel.from_config(tiny_moe_config("deepseek_v3"), dtype=torch.float32)
    assert shard_experts(part, fake_group(4, 1)) == (3, 2)
    assert getattr(part, GROUP).rank == 1
    for a, b in zip(full.layers[1:], part.layers[1:]):
        assert b.mlp.experts.num_experts == 2
        assert torch.equal(b.mlp.experts.gate_up_proj, a.mlp.experts.gate_up_proj[2:4])
        assert torch.equal(b.mlp.experts.down_proj, a.mlp.experts.down_proj[2:4])
        assert torch.equal(b.mlp.gate.weight, a.mlp.gate.weight)  # the router, whole
        assert torch.equal(b.mlp.shared_experts.up_proj.weight, a.mlp.shared_experts.up_proj.weight)
    assert torch.equal(part.layers[0].mlp.up_proj.weight, full.layers[0].mlp.up_proj.weight)  # the dense layer


def test_shard_refuses_a_dense_model_and_experts_that_do_not_split_evenly():
    import transformers

    from hsx.target.expert_parallel import shard_experts

    dense = transformers.AutoModel.from_config(transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16))
    with pytest.raises(HsxError, match="no routed experts to shard"):
        shard_experts(dense, fake_group(2, 0))
    moe = transformers.AutoModel.from_config(tiny_moe_config("qwen3_moe"))
    with pytest.raises(HsxError, match="has 8 experts, which do not split evenly over 3 ranks"):
        shard_experts(moe, fake_group(3, 0))


@pytest.mark.parametrize("extra, needle", [
    (["--tp-size", "2"], "does not combine with --tp-size or --gpus-per-copy"),
    (["--elastic", "127.0.0.1:1"], "--ep-size with --elastic is not supported yet"),
])
def test_ep_size_refuses_what_it_does_not_combine_with(extra, needle, tmp_path, capsys):
    from hsx.cli import main

    rc = main(argv(DEMO, tmp_path / "x", "--ep-size", "2", *extra))
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("hsx: error: ") and needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()


def test_ep_size_must_divide_each_machines_processes(monkeypatch):
    from hsx.run import current_process

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(HsxError, match="--ep-size 4 with 4 processes \\(2 per machine\\)"):
        current_process(ep_size=4)


# ---- FP8 experts as stored, sharded --------------------------------------------------------------------------------

def _fp8_worker(rank: int, world: int, folder: str, init: str, results: str) -> None:
    """One rank: the FP8 checkpoint loaded as stored (e4m3 experts, block scales: transformers does so only where it
    sees CUDA, so the load is told there is one), run by hsx's grouped FP8 path (its torch reference on CPU); the
    whole model's states for this rank's own batch, then those of the model with its experts sharded over the
    group; rank 1 has one batch fewer and serves rank 0's last forward idle."""
    from unittest import mock

    import torch.distributed as dist
    import transformers

    from test_fp8 import _emulated_fp8_linear_forward

    from hsx.target import moe
    from hsx.target.expert_parallel import EpGroup, loading_local_experts, shard_experts

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)

    def load():
        with mock.patch.object(torch.cuda, "is_available", lambda: True), \
                mock.patch.object(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0)):
            model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
        for m in model.modules():  # (transformers' FP8 linear GEMM is a CUDA kernel: its maths in float32, as there)
            if type(m).__name__ == "FP8Linear":
                m.forward = _emulated_fp8_linear_forward.__get__(m)
        moe.use_experts(model, moe.EXPERTS_IMPLEMENTATION)
        return model

    g = torch.Generator().manual_seed(10 + rank)
    batches = [torch.randint(3, 500, (2 - rank, 29 + 8 * rank), generator=g) for _ in range(2 - rank)]
    whole, sharded = load(), load()
    with loading_local_experts(world, rank):  # only this rank's experts read from the checkpoint
        own = load()
    ep = EpGroup(dist.new_group([0, 1], backend="gloo"), world, rank, torch.device("cpu"))
    modules, local = shard_experts(sharded, ep)
    shard_experts(own, ep)
    experts = [m for m in sharded.modules() if getattr(m, "num_experts", None) == local and hasattr(m, "down_proj")]
    out = {"modules": modules, "local": local,
           "e4m3": all(m.gate_up_proj.dtype == torch.float8_e4m3fn and m.gate_up_proj.shape[0] == local
                       and m.gate_up_proj_scale_inv.shape[0] == local for m in experts), "rel": []}
    with torch.inference_mode():
        for ids in batches:
            want = whole(input_ids=ids).last_hidden_state
            ep.agree(True)
            got = sharded(input_ids=ids).last_hidden_state
            out["rel"].append(((got - want).norm() / want.norm()).item())
            ep.agree(True)
            out.setdefault("own_equal", []).append(torch.equal(own(input_ids=ids).last_hidden_state, got))
        while ep.agree(False):  # rank 1 once rank 0 is on its last batch: one-token forwards
            sharded(input_ids=torch.zeros((1, 1), dtype=torch.int64))
            ep.agree(True)
            own(input_ids=torch.zeros((1, 1), dtype=torch.int64))
            out["idle_forwards"] = out.get("idle_forwards", 0) + 1
    Path(results, f"{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


@pytest.mark.slow
def test_fp8_experts_stay_fp8_when_sharded_and_equal_the_whole_model(tmp_path):
    """Also: each rank's model loaded with only its own experts read runs the same forwards bit for bit."""
    import torch.multiprocessing as mp
    from test_fp8 import _save_fp8_moe_checkpoint

    folder = tmp_path / "fp8"
    folder.mkdir()
    _save_fp8_moe_checkpoint(folder, "qwen3_moe")
    results = tmp_path / "results"
    results.mkdir()
    mp.spawn(_fp8_worker, args=(2, str(folder), f"tcp://127.0.0.1:{free_port()}", str(results)), nprocs=2)
    got = [json.loads((results / f"{r}.json").read_text()) for r in (0, 1)]
    for r in got:
        assert r["modules"] == 2 and r["local"] == 4 and r["e4m3"], r
        assert all(rel < 1e-6 for rel in r["rel"]), r
    assert len(got[0]["rel"]) == 2 and len(got[1]["rel"]) == 1 and got[1]["idle_forwards"] == 1
    assert got[0]["own_equal"] == [True, True] and got[1]["own_equal"] == [True]  # read-own-experts: bit for bit


# ---- each rank reads only its own experts from the checkpoint --------------------------------------------------------

class _ReadRecorder:
    """safetensors' safe_open, recording the key of every tensor whose bytes are read (a slice indexed)."""

    def __init__(self, real, reads: list[str]):
        self.real, self.reads = real, reads

    def __call__(self, *args, **kwargs):
        handle, reads = self.real(*args, **kwargs), self.reads

        class Slice:
            def __init__(self, key):
                self.key, self.inner = key, handle.get_slice(key)

            def get_shape(self):
                return self.inner.get_shape()

            def get_dtype(self):
                return self.inner.get_dtype()

            def __getitem__(self, index):
                reads.append(self.key)
                return self.inner[index]

        class Handle:
            def keys(self):
                return handle.keys()

            def get_slice(self, key):
                return Slice(key)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

        return Handle()


def _save_stacked(model_folder: Path, folder: Path) -> Path:
    """The same weights with each experts module's tensors stored stacked (one 3-D tensor, experts first), as some
    checkpoints store them (and as transformers' own modules hold them)."""
    import transformers
    from safetensors.torch import save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    shutil.copy(model_folder / "config.json", folder / "config.json")
    return folder


@pytest.mark.parametrize("kind, layout", [("qwen3_moe", "per-expert"), ("deepseek_v3", "per-expert"),
                                          ("qwen3_moe", "stacked")])
def test_a_rank_reads_only_its_experts_and_holds_what_whole_load_then_shard_holds(models, kind, layout, tmp_path,
                                                                                  monkeypatch):
    """Rank 1 of 2 loaded with `loading_local_experts`: every parameter equal bit for bit (and in shape) to the whole
    model's after `shard_experts`; of the checkpoint it read every non-expert tensor and its own experts' (or its rows
    of the stacked ones), never rank 0's; it holds the replicated weights plus half the experts."""
    import safetensors
    import transformers

    from hsx.target.expert_parallel import LOADED_SHARD, loading_local_experts, shard_experts

    folder = models[kind] if layout == "per-expert" else _save_stacked(models[kind], tmp_path / "stacked")
    whole = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32)
    whole_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    expert_bytes = sum(p.numel() * p.element_size() for n, p in whole.named_parameters() if ".experts." in n)
    shard_experts(whole, fake_group(2, 1))
    reads: list[str] = []
    monkeypatch.setattr(safetensors, "safe_open", _ReadRecorder(safetensors.safe_open, reads))
    with loading_local_experts(2, 1) as record:
        part = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32)
    assert record.modules == 3 and all(getattr(m, LOADED_SHARD, None) == (4, 4) for m in part.modules()
                                       if hasattr(m, LOADED_SHARD))
    a, b = dict(whole.named_parameters()), dict(part.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].shape == b[name].shape and torch.equal(a[name], b[name]), name
    held = sum(p.numel() * p.element_size() for p in part.parameters())
    assert held == whole_bytes - expert_bytes // 2
    expert_reads = [k for k in reads if ".experts." in k]
    if layout == "per-expert":
        assert sorted({int(k.split(".experts.")[1].split(".")[0]) for k in expert_reads}) == [4, 5, 6, 7]
        assert len(record.skipped) == 3 * 4 * 3 and not any(k in reads for k in record.skipped)
    else:
        assert len(record.sliced) == 3 * 2 and set(expert_reads) == set(record.sliced)
    assert {f"model.{n}" for n in a if ".experts." not in n} <= set(reads)  # the replicated weights, all read
    # sharding the model loaded so keeps it as it is and installs the dispatch
    assert shard_experts(part, fake_group(2, 1)) == (3, 4)
    assert all(torch.equal(a[n], p) for n, p in part.named_parameters())


def test_fp8_experts_read_as_stored_only_this_ranks(tmp_path):
    """An FP8 checkpoint (per-expert e4m3 weights and block scales) loaded as stored: rank 0 of 2 holds its 4
    experts' e4m3 weights and scales, equal to the whole load's rows."""
    from unittest import mock

    import transformers
    from test_fp8 import _save_fp8_moe_checkpoint

    from hsx.target.expert_parallel import loading_local_experts

    folder = tmp_path / "fp8"
    folder.mkdir()
    _save_fp8_moe_checkpoint(folder, "qwen3_moe")
    with mock.patch.object(torch.cuda, "is_available", lambda: True), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0)):
        whole = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32)
        with loading_local_experts(2, 0):
            part = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32)
    experts = [(m, part.get_submodule(n)) for n, m in whole.named_modules() if n.endswith("mlp.experts")]
    assert len(experts) == 2
    for full, mine in experts:
        for name in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"):
            got, want = getattr(mine, name), getattr(full, name)
            assert got.dtype == want.dtype and torch.equal(got.float(), want[:4].float()), name
        assert mine.gate_up_proj.dtype == torch.float8_e4m3fn and mine.num_experts == 4


def test_expert_tensors_that_disagree_in_shape_are_one_line(models, tmp_path):
    """A checkpoint whose expert 5 has another shape than its peers: the rank holding it refuses in one line."""
    from safetensors.torch import load_file, save_file

    from hsx.config import ExtractConfig
    from hsx.target.model import load_model

    folder = tmp_path / "damaged"
    shutil.copytree(models["qwen3_moe"], folder)
    state = load_file(str(folder / "model.safetensors"))
    key = "model.layers.2.mlp.experts.5.gate_proj.weight"
    state[key] = state[key][:-1].clone()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HsxError) as e:
        load_model(ExtractConfig(model=str(folder), dataset="d", layers=[3], output_dir="o", dtype="float32"),
                   torch.device("cpu"), experts_share=(2, 1))
    assert "\n" not in str(e.value) and "layers.2.mlp.experts" in str(e.value), str(e.value)
