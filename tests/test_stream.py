"""`hsx.stream`: the job's rows handed to a training loop instead of written. Every streamed row equals the
written output's row for the same options (bit for bit, on CPU), in the same order, with the same counts; the
generator stops its GPU thread when the loop stops early; output-only options are refused; the README's
DataLoader example runs as printed; two processes under torchrun stream the whole output between them."""

from __future__ import annotations

import json
import re
import sys
import threading
from pathlib import Path

import pytest
import torch

import hsx
from helpers import REPO, Child, child_env, free_port, one_torch_thread, write_jsonl
from hsx.config import HsxError, UsageError

def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def assert_same_row(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert torch.equal(bits(got[k]), bits(v)), k
        else:
            assert got[k] == v, k


def gpu_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hsx-gpu"]


VARIANTS = {
    "bf16": dict(layers=[1, 3, -1], final_hidden=True, max_length=96),
    # fp8 states (dequantized on both sides), top-k logits, rows with NaN/Inf kept and flagged
    "fp8-topk-keep": dict(layers=[2, -2], final_hidden=True, storage_dtype="float8_e4m3", topk_logits=4,
                          nonfinite="keep", max_length=128),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_streamed_rows_equal_the_written_output(tmp_path, model8, chat_data, variant, capsys):
    options = dict(model=str(model8.path), dataset=str(chat_data.path), compile="off", token_budget=512,
                   unit_tokens=600, **VARIANTS[variant])
    with one_torch_thread():
        hsx.extract(**options, output_dir=str(tmp_path / "out"))
        stream = hsx.stream(**options)
        streamed = list(stream)
    written = hsx.torch_view(tmp_path / "out")
    info = json.loads((tmp_path / "out" / "hsx.json").read_text())
    assert info["units"] > 2  # several units and batches: order across them is checked
    assert [r["sample_id"] for r in streamed] == [written[i]["sample_id"] for i in range(len(written))]
    for i, row in enumerate(streamed):
        assert_same_row(row, written[i])
    c, want = stream.counts, info["counts"]
    assert (c["rows_in"], c["rows"], c["tokens"], c["truncated"], c["skipped"], c["nonfinite"]) == \
        (want["rows_in"], want["rows_written"], want["tokens_written"], want["truncated"], want["skipped"],
         want["nonfinite"])
    assert c["truncated"] > 0 and c["skipped"]  # the input exercises both
    assert f"hsx: streamed {c['rows']:,} rows" in capsys.readouterr().out
    assert not gpu_threads()


@pytest.fixture
def many_units(tmp_path, model4):
    """A job of many small units and batches, so the producer thread is still running when the loop stops."""
    from hsx.demo import chat_rows

    path = write_jsonl(tmp_path / "chat.jsonl", chat_rows(40, seed=5))
    return dict(model=str(model4.path), dataset=str(path), layers=[1], compile="off", token_budget=256,
                unit_tokens=300)


@pytest.mark.parametrize("how", ["break", "close", "exception"])
def test_stopping_early_stops_the_gpu_thread(many_units, how):
    with one_torch_thread():
        if how == "break":
            for row in hsx.stream(**many_units):
                assert gpu_threads()  # the producer is running while the loop reads
                break
        elif how == "close":
            rows = hsx.stream(**many_units)
            next(rows)
            next(rows)
            assert gpu_threads()
            rows.close()
            with pytest.raises(HsxError, match="was closed: a stream hands its rows out once"):
                next(rows)
        else:
            with pytest.raises(ZeroDivisionError):
                with hsx.stream(**many_units) as rows:
                    for row in rows:
                        assert gpu_threads()
                        1 / 0
    for t in threading.enumerate():  # joined by close(); allow a moment for the thread object to retire
        if t.name == "hsx-gpu":
            t.join(timeout=10)
    assert not gpu_threads()


def test_a_stream_read_to_its_end_raises_when_iterated_again(many_units):
    with one_torch_thread():
        rows = hsx.stream(**{**many_units, "limit": 3})
        assert len([r["sample_id"] for r in rows]) == 3
        with pytest.raises(HsxError, match="was read to its end: a stream hands its rows out once"):
            for _ in rows:  # a second epoch over the same stream: never silently 0 rows
                pass


def test_nothing_runs_before_the_first_row(many_units):
    rows = hsx.stream(**many_units)
    assert rows.counts == {} and not gpu_threads()
    rows.close()


def test_a_second_epoch_tokenizes_nothing(many_units):
    import datasets

    cache = Path(datasets.config.HF_DATASETS_CACHE) / "hsx"
    options = {**many_units, "limit": 7}
    with one_torch_thread():
        first = [r["sample_id"] for r in hsx.stream(**options)]
        files = {p: p.stat().st_mtime_ns for p in cache.glob("tokens-*.arrow")}
        again = [r["sample_id"] for r in hsx.stream(**options)]
    assert first == again and len(first) == 7
    assert files and {p: p.stat().st_mtime_ns for p in cache.glob("tokens-*.arrow")} == files


def test_output_options_are_refused_as_keywords_and_ignored_in_a_recipe(tmp_path, many_units):
    for key, value in (("output_dir", str(tmp_path / "o")), ("push_to_hub", "me/x"), ("overwrite", True)):
        with pytest.raises(UsageError, match=f"hsx.stream writes nothing, so it takes no {key}"):
            hsx.stream(**many_units, **{key: value})
    with pytest.raises(UsageError, match="--tp-size is for hsx extract"):
        next(hsx.stream(**many_units, tp_size=2))
    with pytest.MonkeyPatch.context() as env:  # launched, but the trainer made no process group
        env.setenv("WORLD_SIZE", "2")
        with pytest.raises(UsageError, match="create your Accelerator"):
            next(hsx.stream(**many_units))
    with pytest.raises(UsageError, match="--model is required"):
        hsx.stream(dataset=many_units["dataset"], layers=[1])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {many_units['model']}\ndataset: {many_units['dataset']}\nlayers: [1]\n"
                      f"output_dir: {tmp_path / 'never'}\npush_to_hub: me/never\n")
    with one_torch_thread():
        rows = list(hsx.stream(config=recipe, compile="off", limit=5))
    assert len(rows) == 5 and not (tmp_path / "never").exists()


def readme_block(heading: str, page: str = "docs/streaming.md") -> str:
    text = (REPO / page).read_text()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_streaming_example(monkeypatch):
    """The README's DataLoader example, run as printed (from the repo root, on the demo recipe)."""
    code = readme_block("# Streaming")
    monkeypatch.chdir(REPO)
    scope: dict = {}
    with one_torch_thread():
        exec(compile(code, "README.md", "exec"), scope)
    batch = scope["batch"]
    assert scope["steps"] == -(-96 // 8)  # the demo's 96 usable rows, 8 per batch
    assert batch["hidden_states"].dtype == torch.bfloat16 and batch["hidden_states"].shape[2:] == (5, 64)
    assert batch["final_hidden_state"].shape[2:] == (64,)
    assert int(batch["attention_mask"].sum()) == int(batch["num_tokens"].sum())
    assert not gpu_threads()


STREAM_SCRIPT = """
import sys, torch, torch.distributed as dist, hsx
dist.init_process_group("gloo")
torch.set_num_threads(1)
rows = hsx.stream(model=sys.argv[1], dataset=sys.argv[2], layers=[1, -1], final_hidden=True, unit_tokens=400,
                  token_budget=1024, compile="off")
got = {r["sample_id"]: (r["hidden_states"].view(torch.int16).clone(), r["final_hidden_state"].view(torch.int16).clone())
       for r in rows}
torch.save({"rows": got, "counts": rows.counts}, f"{sys.argv[3]}/rank{dist.get_rank()}.pt")
"""


@pytest.mark.slow
def test_two_processes_stream_the_output_between_them(tmp_path, fault_reference):
    """Under torchrun each process streams its share of the units: together, every row of the 1-process
    output, once, bit for bit."""
    ref = fault_reference
    script = tmp_path / "train.py"
    script.write_text(STREAM_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), str(ref.model.path), str(ref.dataset), str(tmp_path)]
    child = Child(cmd, tmp_path / "logs", env=child_env())
    assert child.wait() == 0, child.stderr
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert all(r["rows"] for r in ranks)  # both did work
    assert not ranks[0]["rows"].keys() & ranks[1]["rows"].keys()
    view = hsx.torch_view(ref.out)
    assert sorted(ranks[0]["rows"].keys() | ranks[1]["rows"].keys()) == sorted(ref.sample_ids)
    for i in range(len(view)):
        row = view[i]
        states, final = next(r["rows"][row["sample_id"]] for r in ranks if row["sample_id"] in r["rows"])
        assert torch.equal(states, bits(row["hidden_states"])) and torch.equal(final, bits(row["final_hidden_state"]))
    assert sum(r["counts"]["rows"] for r in ranks) == ref.info["counts"]["rows_written"]
    assert all(r["counts"]["skipped"] == ref.info["counts"]["skipped"] for r in ranks)  # the whole input's counts


@pytest.fixture
def weighty_job(tmp_path, tokenizer, many_units):
    """many_units' job on a model whose weights (~200 MB in float32) dwarf what CUDA keeps per thread (a cuBLAS
    workspace is ~32 MiB), so a model left on the GPU cannot hide in the allocator's noise."""
    import transformers

    from hsx.demo import build_model_config

    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(build_model_config(len(tokenizer), num_layers=2, hidden_size=1024,
                                                             intermediate_size=8192,
                                                             pad_token_id=tokenizer.pad_token_id)).eval()
    model.save_pretrained(tmp_path / "weighty", safe_serialization=True)
    tokenizer.save_pretrained(tmp_path / "weighty")
    return {**many_units, "model": str(tmp_path / "weighty")}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_stream_left_early_gives_the_gpu_memory_back(weighty_job):
    """On a GPU, the model, the slots and the captured states are the stream's: a `break` frees them. A first
    stream leaves what CUDA keeps for the process (cuBLAS's workspaces); after a second, the same job again, what
    is still allocated is far below the model's own footprint. Blocks the copy stream used (`record_stream`) are
    handed back when the allocator next looks at its events: `empty_cache` makes it look."""

    def allocated():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated()

    for _ in hsx.stream(**weighty_job):
        break
    before = allocated()
    for row in hsx.stream(**weighty_job):
        on_gpu = torch.cuda.memory_allocated() - before  # the model is on the GPU while the loop reads
        assert row["hidden_states"].device.type == "cpu"
        break
    assert not gpu_threads()
    assert on_gpu > 64 << 20, on_gpu
    assert allocated() - before < on_gpu // 4, (allocated() - before, on_gpu)
