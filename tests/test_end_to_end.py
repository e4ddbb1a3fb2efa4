"""`hsx.run.extract` end to end on CPU: chat jsonl -> buckets -> truncated hooked forward -> Arrow output dir.

Checked against the reference (the full-depth model on one sample, unpadded), and read back with
`datasets.load_dataset`, `hsx.load`, `hsx.torch_view` and `hsx.collate`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
import yaml

import hsx
from helpers import bf16_ulps, bucket_of, expected_tokenization, rel_err, write_jsonl
from hsx.buckets import UNIT_SPAN, bucket_bounds
from hsx.config import LAYER_CONVENTION, HsxError, load_config
from hsx.run import extract

MAX_LENGTH = 160
INFO_KEYS = {"model", "model_path", "revision", "tokenizer", "layers", "final_hidden", "layer_convention",
             "hidden_size", "num_model_layers", "storage_dtype", "max_length", "chat_template_sha256", "loss_mask",
             "counts", "hsx_version", "config", "complete"}


@dataclass
class Run:
    out: Path
    cfg: Any
    info: dict
    log: list[str]


def run_extract(out: Path, **values) -> Run:
    log: list[str] = []
    cfg = load_config(None, {"output_dir": str(out), "compile": "off", **values})
    info = extract(cfg, log=log.append)
    return Run(out=out, cfg=cfg, info=info, log=log)


@pytest.fixture(scope="module")
def main_run(tmp_path_factory, model8, chat_data) -> Run:
    """8 layers, layers 1, 4, -1 (the last, pre-norm) + final hidden, bf16, multi-row padded batches, small units."""
    return run_extract(tmp_path_factory.mktemp("e2e") / "main", model=str(model8.path), dataset=str(chat_data.path),
                       layers=["1", "4", "-1"], final_hidden=True, max_length=MAX_LENGTH, token_budget=640,
                       unit_tokens=400)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, model8, chat_data) -> Run:
    """The same job one row at a time (token_budget=1 -> batches of 1)."""
    return run_extract(tmp_path_factory.mktemp("e2e") / "single", model=str(model8.path),
                       dataset=str(chat_data.path), layers=["1", "4", "-1"], final_hidden=True,
                       max_length=MAX_LENGTH, token_budget=1, unit_tokens=400)


@pytest.fixture(scope="module")
def trunc_run(tmp_path_factory, model8, chat_data) -> Run:
    """Layers 0 and -6 (= 2): the model is cut after layer 2, no final norm."""
    return run_extract(tmp_path_factory.mktemp("e2e") / "trunc", model=str(model8.path), dataset=str(chat_data.path),
                       layers="0 -6", max_length=MAX_LENGTH, token_budget=2048)


@pytest.fixture(scope="module")
def main_ds(main_run):
    return hsx.load(str(main_run.out))


@pytest.fixture(scope="module")
def expected(chat_data, tokenizer):
    return expected_tokenization(chat_data, tokenizer, MAX_LENGTH)


def bits(values) -> torch.Tensor:
    return torch.tensor(np.asarray(values, dtype=np.int16)).view(torch.bfloat16)


# ---- hsx.json, card, files ------------------------------------------------------------------------------------

def test_hsx_json(main_run, model8, chat_data, expected):
    info = json.loads((main_run.out / "hsx.json").read_text())
    assert info == json.loads(json.dumps(main_run.info))  # what extract returned is what it wrote
    assert INFO_KEYS <= set(info)
    assert info["model"] == str(model8.path)
    assert info["model_path"] == str(Path(model8.path).resolve())
    assert info["revision"] is None
    assert info["tokenizer"] == str(model8.path)
    assert info["layers"] == [1, 4, 7]
    assert info["final_hidden"] is True
    assert info["layer_convention"] == LAYER_CONVENTION
    assert "output_hidden_states[i+1]" in info["layer_convention"] and "hook" in info["layer_convention"]
    assert info["hidden_size"] == 64 and info["num_model_layers"] == 8
    assert info["storage_dtype"] == "bfloat16"
    assert info["max_length"] == MAX_LENGTH
    assert info["chat_template_sha256"] == hashlib.sha256(model8.tokenizer.chat_template.encode()).hexdigest()
    assert info["hsx_version"] == hsx.__version__
    assert info["loss_mask"] == {"method": "markers", "version": 6}  # the demo template has generation markers
    assert info["complete"] is True
    c = info["counts"]
    assert set(c) == {"rows_in", "rows_written", "tokens_written", "truncated", "skipped", "nonfinite"}
    assert c["nonfinite"] == {"mode": "skip", "rows": 0}
    assert c["rows_in"] == len(chat_data.rows)
    assert c["rows_written"] == len(expected.rows)
    assert c["tokens_written"] == sum(len(ids) for ids, _, _ in expected.rows.values())
    assert c["truncated"] == expected.truncated >= 1
    assert c["skipped"] == expected.skip_counts
    assert set(c["skipped"]) >= {"empty_conversation", "no_assistant_turn", "null_content", "missing_value",
                                 "no_supervised_tokens_after_truncation"}
    assert c["rows_written"] + sum(c["skipped"].values()) == c["rows_in"]
    cfg = info["config"]
    assert cfg["layers"] == [1, 4, 7] and cfg["final_hidden"] is True  # fully resolved
    assert cfg["dataset"] == str(chat_data.path) and cfg["max_length"] == MAX_LENGTH and cfg["token_budget"] == 640


def test_output_files(main_run, main_ds):
    from datasets import Dataset

    data_dir = main_run.out / "data"
    names = sorted(p.name for p in data_dir.iterdir())
    assert names and all(re.fullmatch(r"train-[0-9]+(-[0-9]+)*\.arrow", n) for n in names), names
    assert not any("-of-" in n for n in names)
    # several units (small unit_tokens), each named by its first row's bucket, its rows' lengths within the span
    assert len(names) > 3
    bounds = bucket_bounds(MAX_LENGTH)
    for name in names:
        part = Dataset.from_file(str(data_dir / name))
        b = bucket_of(np.asarray(part["num_tokens"]), MAX_LENGTH)
        assert b[0] == int(name.split("-")[1]) and np.all(np.diff(b) >= 0), (name, b)
        assert bounds[b[-1]] <= UNIT_SPAN * bounds[b[0]], (name, b)
    # top level: the card, hsx.json, the supervised-token counts, data/ and the dot-folder only
    assert {p.name for p in main_run.out.iterdir()} <= {"README.md", "hsx.json", "token_frequencies.npy", "data",
                                                        ".hsx"}


def test_dataset_card(main_run):
    text = (main_run.out / "README.md").read_text()
    assert text.startswith("---\n")
    meta = yaml.safe_load(text.split("---\n")[1])
    configs = meta["configs"]
    listed = [f"data/{f['file']}" for f in json.loads((main_run.out / "hsx.json").read_text())["files"]]
    assert configs[0]["data_files"] == [{"split": "train", "path": listed}]
    assert sorted(listed) == sorted(f"data/{p.name}" for p in (main_run.out / "data").glob("train-*.arrow"))
    assert "bfloat16" in text and "view(torch.bfloat16)" in text


# ---- rows: every usable row exactly once, in order, with the right tokens -------------------------------------

def test_rows_complete_unique_and_ordered(main_ds, expected):
    sid = np.asarray(main_ds["sample_id"])
    assert len(sid) == len(set(sid.tolist())), "each row once"
    assert sorted(sid.tolist()) == sorted(expected.rows), "every usable row"
    ntok = np.asarray(main_ds["num_tokens"])
    keys = list(zip(bucket_of(ntok, MAX_LENGTH).tolist(), sid.tolist()))
    assert keys == sorted(keys), "ordered by bucket, then sample_id"
    assert len(set(bucket_of(ntok, MAX_LENGTH).tolist())) > 3


def test_rows_tokens_and_masks(main_ds, expected):
    for row in main_ds.select_columns(["sample_id", "input_ids", "loss_mask", "num_tokens"]):
        ids, mask, _ = expected.rows[row["sample_id"]]
        assert row["input_ids"] == ids
        assert row["loss_mask"] == mask
        assert row["num_tokens"] == len(ids) <= MAX_LENGTH


def test_schema(main_ds):
    t = main_ds.data.table.schema
    assert t.field("sample_id").type == pa.int64()
    assert t.field("input_ids").type == pa.list_(pa.int32())
    assert t.field("loss_mask").type == pa.list_(pa.int8())
    assert t.field("num_tokens").type == pa.int32()
    assert t.field("hidden_states").type == pa.list_(pa.list_(pa.int16(), 3 * 64))
    assert t.field("final_hidden_state").type == pa.list_(pa.list_(pa.int16(), 64))
    f = main_ds.features["hidden_states"]
    assert f.feature.length == 3 * 64 and f.feature.feature.dtype == "int16"
    assert f.feature.feature.id == "bfloat16"  # Value("int16", id="bfloat16")
    assert main_ds.features["final_hidden_state"].feature.length == 64
    assert main_ds.features["final_hidden_state"].feature.feature.id == "bfloat16"


# ---- against the reference ------------------------------------------------------------------------------------

def test_states_match_bf16_reference(main_ds, model8):
    """Per row and layer (1, 4 and the last layer 7, pre-norm) and the final norm: ||got-ref||/||ref|| < 1e-2,
    the reference being the full-depth bf16 model on the row alone, unpadded."""
    view = hsx.torch_view(main_ds, hidden_size=64)
    for i in range(len(view)):
        row = view[i]
        ref = model8.reference(row["input_ids"].tolist(), dtype=torch.bfloat16)
        for k, layer in enumerate([1, 4, 7]):
            e = rel_err(row["hidden_states"][:, k], ref[layer])
            assert e < 1e-2, (row["sample_id"], layer, e)
        e = rel_err(row["final_hidden_state"], ref["final"])
        assert e < 1e-2, (row["sample_id"], "final", e)


def test_truncated_run_matches_reference(trunc_run, model8, expected):
    info = trunc_run.info
    assert info["layers"] == [0, 2] and info["final_hidden"] is False
    ds = hsx.load(str(trunc_run.out))
    assert "final_hidden_state" not in ds.column_names
    assert ds.features["hidden_states"].feature.length == 2 * 64
    assert sorted(ds["sample_id"]) == sorted(expected.rows)
    view = hsx.torch_view(str(trunc_run.out))
    for i in range(len(view)):
        row = view[i]
        assert row["hidden_states"].shape == (len(row["input_ids"]), 2, 64)
        ref = model8.reference(row["input_ids"].tolist(), dtype=torch.bfloat16)
        for k, layer in enumerate([0, 2]):
            assert rel_err(row["hidden_states"][:, k], ref[layer]) < 1e-2, (row["sample_id"], layer)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_other_compute_dtypes(tmp_path, model8, chat_data, dtype):
    """Compute in float32 (stored bf16 = float32 reference rounded to bf16, within 1 ulp) or float16 (close)."""
    run = run_extract(tmp_path / "out", model=str(model8.path), dataset=str(chat_data.path), layers=["2", "-1"],
                      final_hidden=True, max_length=64, token_budget=256, dtype=dtype, limit=12)
    assert run.info["storage_dtype"] == "bfloat16"
    view = hsx.torch_view(str(run.out))
    assert len(view) > 5
    for i in range(len(view)):
        row = view[i]
        ref = model8.reference(row["input_ids"].tolist())  # float32
        for k, layer in enumerate([2, 7]):
            got = row["hidden_states"][:, k]
            if dtype == "float32":
                assert int(bf16_ulps(got, ref[layer]).max()) <= 1, (row["sample_id"], layer)
            else:
                assert rel_err(got, ref[layer]) < 1e-2, (row["sample_id"], layer)
        if dtype == "float32":
            assert int(bf16_ulps(row["final_hidden_state"], ref["final"]).max()) <= 1
        else:
            assert rel_err(row["final_hidden_state"], ref["final"]) < 1e-2


def test_batched_equals_one_at_a_time(main_ds, single_run):
    single = hsx.load(str(single_run.out))
    assert single["sample_id"] == main_ds["sample_id"]  # same rows, same order (order ignores the budget)
    assert single["input_ids"] == main_ds["input_ids"]
    assert single["loss_mask"] == main_ds["loss_mask"]
    a, b = hsx.torch_view(main_ds, hidden_size=64), hsx.torch_view(single, hidden_size=64)
    for i in range(len(a)):
        ra, rb = a[i], b[i]
        for k in range(3):
            assert rel_err(ra["hidden_states"][:, k], rb["hidden_states"][:, k]) < 1e-2
        assert rel_err(ra["final_hidden_state"], rb["final_hidden_state"]) < 1e-2


def test_batched_counts_equal_one_at_a_time(main_run, single_run):
    assert single_run.info["counts"] == main_run.info["counts"]
    assert single_run.info["layers"] == main_run.info["layers"]


# ---- reading back ---------------------------------------------------------------------------------------------

def test_load_dataset_round_trip(main_run, main_ds):
    from datasets import load_dataset

    ds = load_dataset(str(main_run.out), split="train")
    assert ds.num_rows == main_ds.num_rows == main_run.info["counts"]["rows_written"]
    assert ds.features == main_ds.features
    assert ds.features["hidden_states"].feature.feature.id == "bfloat16"
    assert ds.features["hidden_states"].feature.feature.dtype == "int16"
    # bit-exact: the same Arrow data (rows in the same order)
    assert ds.data.table.equals(main_ds.data.table)
    # the plain-datasets decode from the card: int16 kept with dtype=None, then viewed as bfloat16
    t = ds.with_format("torch", dtype=None)
    view = hsx.torch_view(main_ds, hidden_size=64)
    for i in (0, len(ds) // 2, len(ds) - 1):
        row = t[i]
        assert row["hidden_states"].dtype == torch.int16
        states = row["hidden_states"].view(torch.bfloat16).reshape(int(row["num_tokens"]), 3, 64)
        assert torch.equal(states.view(torch.int16), view[i]["hidden_states"].view(torch.int16))
        assert torch.equal(row["final_hidden_state"].view(torch.bfloat16).view(torch.int16),
                           view[i]["final_hidden_state"].view(torch.int16))


def test_hsx_load_is_memory_mapped_in_place(main_run, main_ds):
    files = {Path(f["filename"]).resolve() for f in main_ds.cache_files}
    assert files == {p.resolve() for p in (main_run.out / "data").glob("train-*.arrow")}


def test_torch_view_bit_exact(main_run, main_ds):
    view = hsx.torch_view(str(main_run.out))
    assert len(view) == len(main_ds)
    table = main_ds.data.table
    for i in (0, 1, len(view) // 2, len(view) - 1):
        row = view[i]
        n = int(table.column("num_tokens")[i].as_py())
        assert row["sample_id"] == table.column("sample_id")[i].as_py()
        assert row["input_ids"].tolist() == table.column("input_ids")[i].as_py()
        assert row["loss_mask"].tolist() == table.column("loss_mask")[i].as_py()
        assert row["hidden_states"].dtype == torch.bfloat16 and row["hidden_states"].shape == (n, 3, 64)
        assert row["final_hidden_state"].dtype == torch.bfloat16 and row["final_hidden_state"].shape == (n, 64)
        raw = np.asarray(table.column("hidden_states")[i].as_py(), dtype=np.int16).reshape(n, 3, 64)
        assert torch.equal(row["hidden_states"].view(torch.int16), torch.from_numpy(raw))
        raw = np.asarray(table.column("final_hidden_state")[i].as_py(), dtype=np.int16).reshape(n, 64)
        assert torch.equal(row["final_hidden_state"].view(torch.int16), torch.from_numpy(raw))


def test_collate_pads(main_run, tokenizer):
    view = hsx.torch_view(str(main_run.out))
    idx = [0, len(view) // 2, len(view) - 1]
    rows = [view[i] for i in idx]
    lengths = [r["input_ids"].shape[0] for r in rows]
    assert len(set(lengths)) == 3
    pad = tokenizer.pad_token_id
    batch = hsx.collate(rows, pad_token_id=pad)
    n = max(lengths)
    assert batch["input_ids"].shape == (3, n) and batch["attention_mask"].shape == (3, n)
    assert batch["hidden_states"].shape == (3, n, 3, 64) and batch["hidden_states"].dtype == torch.bfloat16
    assert batch["final_hidden_state"].shape == (3, n, 64)
    for j, (r, t) in enumerate(zip(rows, lengths)):
        assert batch["attention_mask"][j].tolist() == [1] * t + [0] * (n - t)
        assert batch["input_ids"][j, :t].tolist() == r["input_ids"].tolist()
        assert (batch["input_ids"][j, t:] == pad).all()
        assert batch["loss_mask"][j, :t].tolist() == r["loss_mask"].tolist()
        assert (batch["loss_mask"][j, t:] == 0).all()
        assert torch.equal(batch["hidden_states"][j, :t].view(torch.int16), r["hidden_states"].view(torch.int16))
        assert (batch["hidden_states"][j, t:] == 0).all()
        assert torch.equal(batch["final_hidden_state"][j, :t].view(torch.int16),
                           r["final_hidden_state"].view(torch.int16))
        assert (batch["final_hidden_state"][j, t:] == 0).all()


# ---- re-running -----------------------------------------------------------------------------------------------

def test_rerun_complete_is_a_noop(main_run):
    files = {p: p.stat().st_mtime_ns for p in (main_run.out / "data").iterdir()}
    info_before = (main_run.out / "hsx.json").read_text()
    log: list[str] = []
    info = extract(main_run.cfg, log=log.append)
    assert any("already complete" in line for line in log), log
    assert info["counts"] == main_run.info["counts"]
    assert {p: p.stat().st_mtime_ns for p in (main_run.out / "data").iterdir()} == files
    assert (main_run.out / "hsx.json").read_text() == info_before


# ---- other input formats --------------------------------------------------------------------------------------

def _check_rows(out: Path, model, layers, expect: dict[int, tuple[list[int], list[int]]]):
    view = hsx.torch_view(str(out))
    assert sorted(view[i]["sample_id"] for i in range(len(view))) == sorted(expect)
    for i in range(len(view)):
        row = view[i]
        ids, mask = expect[row["sample_id"]]
        assert row["input_ids"].tolist() == ids and row["loss_mask"].tolist() == mask
        ref = model.reference(ids, dtype=torch.bfloat16)
        for k, layer in enumerate(layers):
            assert rel_err(row["hidden_states"][:, k], ref[layer]) < 1e-2


def test_text_rows_end_to_end(tmp_path, model4, tokenizer):
    texts = ["The cat slept on the warm chair while the rain fell softly.", "A good question.",
             "Data flows from the reader to the model and from the model to the writer. " * 3, ""]
    path = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in texts])
    run = run_extract(tmp_path / "out", model=str(model4.path), dataset=str(path), layers=["-1"])
    expect = {i: (tokenizer(t)["input_ids"], [1] * len(tokenizer(t)["input_ids"])) for i, t in enumerate(texts[:3])}
    _check_rows(run.out, model4, [3], expect)
    assert run.info["counts"]["skipped"] == {"empty_text": 1}
    assert run.info["loss_mask"]["method"] == "all_tokens"


def test_input_ids_rows_end_to_end(tmp_path, model4):
    rows = [{"input_ids": [1, 50, 60, 70, 80, 2], "loss_mask": [0, 0, 1, 1, 1, 1]},
            {"input_ids": [1, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100], "loss_mask": [0] * 6 + [1] * 6},
            {"input_ids": [5, 6], "loss_mask": [0, 0]},
            {"input_ids": [5, 6, 7], "loss_mask": [1, 1]}]
    path = write_jsonl(tmp_path / "ids.jsonl", rows)
    run = run_extract(tmp_path / "out", model=str(model4.path), dataset=str(path), layers="0,2")
    expect = {i: (rows[i]["input_ids"], rows[i]["loss_mask"]) for i in (0, 1)}
    _check_rows(run.out, model4, [0, 2], expect)
    assert run.info["counts"]["skipped"] == {"loss_mask_length_mismatch": 1, "no_supervised_tokens": 1}
    # no loss_mask column: every token supervised
    path2 = write_jsonl(tmp_path / "ids2.jsonl", [{"input_ids": r["input_ids"]} for r in rows[:2]])
    run2 = run_extract(tmp_path / "out2", model=str(model4.path), dataset=str(path2), layers=["1"])
    assert [r["loss_mask"] for r in hsx.load(str(run2.out))] == [[1] * 6, [1] * 12]
    assert (run.info["loss_mask"]["method"], run2.info["loss_mask"]["method"]) == ("given", "all_tokens")


def test_sharegpt_rows_end_to_end(tmp_path, model4, tokenizer):
    from helpers import HAND_CONVERSATION

    role_to_from = {"system": "system", "user": "human", "assistant": "gpt"}
    conv = [{"from": role_to_from[m["role"]], "value": m["content"]} for m in HAND_CONVERSATION]
    path = write_jsonl(tmp_path / "sg.jsonl", [{"conversations": conv}, {"conversations": conv[:2]}])
    run = run_extract(tmp_path / "out", model=str(model4.path), dataset=str(path), layers=["1", "3"])
    enc = tokenizer.apply_chat_template(HAND_CONVERSATION, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    _check_rows(run.out, model4, [1, 3], {0: (list(enc["input_ids"]), list(enc["assistant_masks"]))})
    assert run.info["counts"]["skipped"] == {"no_assistant_turn": 1}


def test_output_with_no_usable_rows_loads(tmp_path, model4):
    from datasets import load_dataset

    from hsx.schema import OutputFormat

    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": []}, {"messages": [{"role": "user", "content": "hi"}]}])
    # (a name of its own: datasets' cache keys local dirs by folder name and card, not by path or content)
    # an empty output on purpose (without --allow-empty the job fails: tests/test_cli.py)
    run = run_extract(tmp_path / "no-usable-rows", model=str(model4.path), dataset=str(path), layers=["1"],
                      allow_empty=True)
    assert run.info["complete"] is True and run.info["counts"]["rows_written"] == 0
    assert run.info["counts"]["skipped"] == {"empty_conversation": 1, "no_assistant_turn": 1}
    assert sorted(p.name for p in (run.out / "data").iterdir()) == ["train-000-00000.arrow"]
    ds = hsx.load(str(run.out))
    assert len(ds) == 0 and ds.features == OutputFormat(1, 64, False).features()
    assert len(hsx.torch_view(str(run.out))) == 0
    streamed = load_dataset(str(run.out), split="train", streaming=True)
    assert list(streamed) == [] and streamed.features == OutputFormat(1, 64, False).features()
    # a rerun is a no-op, and another job does not take the dir over (it holds a finished output)
    assert "already complete" in " ".join(run_extract(run.out, model=str(model4.path), dataset=str(path),
                                                      layers=["1"], allow_empty=True).log)
    with pytest.raises(HsxError, match="different job"):
        run_extract(run.out, model=str(model4.path), dataset=str(path), layers=["2"], allow_empty=True)


@pytest.mark.xfail(strict=False, reason="datasets (5.2) refuses to build a split with 0 rows: 'Instruction \"train\" "
                   "corresponds to no data!' (huggingface/datasets PR #8401, open); hsx.load and streaming=True work")
def test_output_with_no_usable_rows_load_dataset_non_streaming(tmp_path, model4):
    from datasets import load_dataset

    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": []}])
    run = run_extract(tmp_path / "no-usable-rows-2", model=str(model4.path), dataset=str(path), layers=["1"],
                      allow_empty=True)
    assert load_dataset(str(run.out), split="train").num_rows == 0
