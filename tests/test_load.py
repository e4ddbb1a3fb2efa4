"""Consumer side (hsx.load): local dirs memory-mapped, Hub repos streamed, layer subsets as views, collate for a
DataLoader, SpecForge's offline export, and the dataset card (configs, fingerprint, decode snippet, streaming
advice, and datasets' stale local cache). A damaged, incomplete, changed or linked output is refused in one line by
every reader (hsx.load, load_dataset, hsx verify, hsx push), never read as fewer rows; datasets' caches stay out of
the output."""

from __future__ import annotations

import functools
import json
import sys
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import hsx
from hsx.card import dataset_card
from hsx.config import load_config
from hsx.export import export_specforge
from hsx.load import collate, layer_positions, torch_stream, torch_view
from hsx.load import load as hsx_load
from hsx.run import extract

LAYERS = [0, 1, 3]  # of model4's 4 layers


def run_extract(out: Path, **values) -> dict:
    cfg = load_config(None, {"output_dir": str(out), "compile": "off", **values})
    return extract(cfg, log=lambda *a: None)


@pytest.fixture(scope="module")
def out(tmp_path_factory, model4, chat_data) -> Path:
    """4 layers, layers 0, 1, 3 + the final norm, several units."""
    root = tmp_path_factory.mktemp("load") / "out"
    run_extract(root, model=str(model4.path), dataset=str(chat_data.path), layers=[str(i) for i in LAYERS],
                final_hidden=True, max_length=160, token_budget=640, unit_tokens=300)
    return root


@pytest.fixture(scope="module")
def meta(out) -> dict:
    return json.loads((out / "hsx.json").read_text())


@pytest.fixture(scope="module")
def table(out):
    return hsx_load(str(out)).data.table


def stored(table, i: int, column: str = "hidden_states") -> torch.Tensor:
    """Row i's stored int16 bits, straight from Arrow: (T, layers, 64) or (T, 64)."""
    n = int(table.column("num_tokens")[i].as_py())
    raw = np.asarray(table.column(column)[i].as_py(), dtype=np.int16)
    return torch.from_numpy(raw.reshape(n, -1, 64) if column == "hidden_states" else raw.reshape(n, 64))


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


# ---- load: local dirs ---------------------------------------------------------------------------------------

def test_local_load_is_memory_mapped_in_place(out):
    from datasets import Dataset

    ds = hsx.load(str(out))
    assert isinstance(ds, Dataset) and len(ds) > 10
    assert {Path(f["filename"]).resolve() for f in ds.cache_files} == \
        {p.resolve() for p in (out / "data").glob("train-*.arrow")}
    assert len(list((out / "data").glob("train-*.arrow"))) > 2  # several units


@pytest.mark.parametrize("layers", [[1], [0, 3], [3, 0], [-1], [0, 1, 3], [1, 3], [3]])
def test_layers_subset_is_bit_exact(out, table, layers):
    rows = hsx.load(str(out), layers=layers)
    assert isinstance(rows, torch_view) and len(rows) == table.num_rows
    positions = [LAYERS.index(w % 4) for w in layers]
    for i in (0, 1, len(rows) // 2, len(rows) - 1):
        row = rows[i]
        n = int(table.column("num_tokens")[i].as_py())
        assert row["hidden_states"].dtype == torch.bfloat16
        assert row["hidden_states"].shape == (n, len(layers), 64)
        assert torch.equal(bits(row["hidden_states"]), stored(table, i)[:, positions])
        assert torch.equal(bits(row["final_hidden_state"]), stored(table, i, "final_hidden_state"))
        assert row["input_ids"].tolist() == table.column("input_ids")[i].as_py()
        assert row["loss_mask"].tolist() == table.column("loss_mask")[i].as_py()
        assert row["sample_id"] == table.column("sample_id")[i].as_py()


def test_layer_subsets_are_views_when_evenly_spaced(out, meta):
    ds = hsx.load(str(out))  # one mapping, three views of it
    full, one, spaced = (torch_view(ds, meta=meta), torch_view(ds, layers=[1], meta=meta),
                         torch_view(ds, layers=[0, 3], meta=meta))
    for i in (0, len(full) - 1):
        f = full[i]["hidden_states"]
        assert one[i]["hidden_states"].data_ptr() == f[:, 1].data_ptr()  # a view of the mapped row, no copy
        assert spaced[i]["hidden_states"].data_ptr() == f[:, 0].data_ptr()  # positions 0, 2: stride 2
        assert not one[i]["hidden_states"].is_contiguous() or f.shape[0] == 1
    mixed = torch_view(str(out), layers=[3, 0])[0]["hidden_states"]  # decreasing: gathered (a copy of 2 layers)
    assert torch.equal(bits(mixed), bits(full[0]["hidden_states"][:, [2, 0]]))


def test_layer_errors(out, meta):
    with pytest.raises(ValueError, match=r"layer 2 is not in this output; its layers are \[0, 1, 3\]"):
        hsx.load(str(out), layers=[2])
    from datasets import Dataset

    bare = Dataset.from_file(str(next((out / "data").glob("train-*.arrow"))))  # no hsx.json, no layout note
    with pytest.raises(ValueError, match="needs|pass the output dir"):
        torch_view(bare, layers=[1])  # a bare Dataset does not know the model layer indices
    assert layer_positions([1, 4, 7], [-1, 1], num_model_layers=8) == [2, 0]
    with pytest.raises(FileNotFoundError):
        hsx.load(str(out / "missing"))
    with pytest.raises(FileNotFoundError, match="no data/test-"):
        hsx.load(str(out), split="test")
    with pytest.raises(ValueError, match="revision"):
        hsx.load(str(out), revision="v1")


def test_a_dataset_of_an_output_without_the_final_norm_state_gives_the_dirs_shapes(tmp_path, model4,
                                                                                   small_chat_path):
    """Without the final-norm state a Dataset's features give only hidden_states' width (layers x hidden): torch_view
    of hsx.load's Dataset must still give (T, layers, hidden) as torch_view of the dir does (hsx.load notes the
    layout in the Dataset's info), and a Dataset that cannot tell is refused in one line, never read as
    (T, 1, layers x hidden)."""
    from datasets import load_dataset

    out = tmp_path / "out"
    run_extract(out, model=str(model4.path), dataset=str(small_chat_path), layers=["0", "1", "3"],
                final_hidden=False)
    want = torch_view(str(out))
    assert want[0]["hidden_states"].shape[1:] == (3, 64)
    ds = hsx.load(str(out))
    for got in (torch_view(ds), torch_view(ds.shuffle(seed=1).sort("sample_id"))):
        by_id = {want[i]["sample_id"]: want[i]["hidden_states"] for i in range(len(want))}
        assert len(got) == len(want)
        for i in range(len(got)):
            assert torch.equal(bits(got[i]["hidden_states"]), bits(by_id[got[i]["sample_id"]]))
    assert torch.equal(bits(torch_view(ds, layers=[3])[0]["hidden_states"]), bits(want[0]["hidden_states"][:, 2:]))
    streamed = next(iter(torch_stream(hsx.load(str(out), streaming=True))))
    assert streamed["hidden_states"].shape == want[0]["hidden_states"].shape
    files = sorted(str(f) for f in (out / "data").glob("train-*.arrow"))
    plain = load_dataset("arrow", data_files=files, split="train")  # no hsx.json beside, no note: cannot tell
    with pytest.raises(ValueError, match="cannot tell how the 192 values a token of hidden_states split") as e:
        torch_view(plain)
    assert "\n" not in str(e.value)
    for view in (torch_view(plain, meta=hsx.read_info(out)), torch_view(plain, hidden_size=64)):
        assert view[0]["hidden_states"].shape[1:] == (3, 64)
    with pytest.raises(ValueError, match="does not divide"):
        torch_view(plain, hidden_size=50)
    with pytest.raises(ValueError, match="another output"):
        torch_view(plain, meta={**json.loads((out / "hsx.json").read_text()), "layers": [0, 1]})


def test_local_streaming(out, table):
    from datasets import IterableDataset

    ds = hsx.load(str(out), streaming=True)
    assert isinstance(ds, IterableDataset)
    assert [r["sample_id"] for r in ds] == table.column("sample_id").to_pylist()
    rows = hsx.load(str(out), streaming=True, layers=[3, 1])
    assert isinstance(rows, torch.utils.data.IterableDataset)
    got = list(rows)
    assert len(got) == table.num_rows
    for i in (0, len(got) // 2, len(got) - 1):
        assert got[i]["sample_id"] == table.column("sample_id")[i].as_py()
        assert got[i]["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(bits(got[i]["hidden_states"]), stored(table, i)[:, [2, 1]])
        assert torch.equal(bits(got[i]["final_hidden_state"]), stored(table, i, "final_hidden_state"))


def test_a_spawn_dataloader_worker_reads_torch_stream_rows(out, table):
    """A spawn worker (the start method off Linux, and with CUDA) gets torch_stream's dataset by pickle and hands
    out every row, bit for bit as the stored ones."""
    rows = hsx.load(str(out), streaming=True, layers=[3, 1])
    loader = torch.utils.data.DataLoader(rows, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    got = list(loader)
    assert [r["sample_id"] for r in got] == table.column("sample_id").to_pylist()
    for i in (0, len(got) - 1):
        assert torch.equal(bits(got[i]["hidden_states"]), stored(table, i)[:, [2, 1]])


def test_hub_repo_one_type_per_call_form(out, meta, monkeypatch):
    """A repo id goes to load_dataset and hsx.json comes from the repo (both stubbed: no network); the type
    depends only on the call form, as for a local dir: Dataset, IterableDataset, torch_view, torch_stream."""
    import datasets

    L = sys.modules["hsx.load"]  # (the attribute hsx.load is the function)

    calls = []
    real = datasets.load_dataset

    def fake_load_dataset(path, split=None, streaming=False, revision=None, **kw):
        calls.append({"path": path, "split": split, "streaming": streaming, "revision": revision})
        return real(str(out), split=split, streaming=streaming)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(L, "hub_info", lambda repo, revision=None: calls.append(("hsx.json", repo, revision)) or meta)
    for source in ("someone/hidden-states", str(out)):
        assert type(hsx.load(source)) is datasets.Dataset
        assert isinstance(hsx.load(source, streaming=True), datasets.IterableDataset)
        assert isinstance(hsx.load(source, layers=[1]), torch_view)
        assert isinstance(hsx.load(source, layers=[1], streaming=True), torch.utils.data.IterableDataset)
    ds = hsx.load("someone/hidden-states", streaming=True)
    assert calls[-1] == {"path": "someone/hidden-states", "split": "train", "streaming": True, "revision": None}
    rows = hsx.load("someone/hidden-states", layers=[1], revision="v2", streaming=True)
    assert calls[-2]["revision"] == "v2" and calls[-1] == ("hsx.json", "someone/hidden-states", "v2")
    first = next(iter(rows))
    assert first["hidden_states"].shape[1:] == (1, 64)
    mapped = hsx.load("someone/hidden-states", layers=[1])
    assert calls[-2]["streaming"] is False and isinstance(mapped, torch_view)
    assert torch.equal(bits(mapped[0]["hidden_states"]), bits(first["hidden_states"]))


# ---- collate and a DataLoader -----------------------------------------------------------------------------------

def test_collate_pads_masks_and_labels(out, table):
    rows = torch_view(str(out), layers=[1, 3])
    idx = [0, len(rows) // 2, len(rows) - 1]
    batch = collate([rows[i] for i in idx], pad_token_id=7, pad_to_multiple_of=64)
    lengths = [int(table.column("num_tokens")[i].as_py()) for i in idx]
    n = -(-max(lengths) // 64) * 64
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["labels"].shape == (3, n)
    assert batch["hidden_states"].shape == (3, n, 2, 64) and batch["hidden_states"].dtype == torch.bfloat16
    assert batch["final_hidden_state"].shape == (3, n, 64)
    assert batch["num_tokens"].tolist() == lengths
    assert batch["sample_id"].tolist() == [table.column("sample_id")[i].as_py() for i in idx]
    for j, (i, t) in enumerate(zip(idx, lengths)):
        ids = torch.tensor(table.column("input_ids")[i].as_py())
        mask = torch.tensor(table.column("loss_mask")[i].as_py())
        assert batch["attention_mask"][j].tolist() == [1] * t + [0] * (n - t)
        assert torch.equal(batch["input_ids"][j, :t], ids) and (batch["input_ids"][j, t:] == 7).all()
        assert torch.equal(batch["loss_mask"][j, :t], mask.long()) and (batch["loss_mask"][j, t:] == 0).all()
        # labels: the tokens under the loss mask, -100 elsewhere, unshifted
        assert torch.equal(batch["labels"][j, :t], torch.where(mask.bool(), ids, -100))
        assert (batch["labels"][j, t:] == -100).all()
        assert torch.equal(bits(batch["hidden_states"][j, :t]), stored(table, i)[:, [1, 2]])
        assert (bits(batch["hidden_states"][j, t:]) == 0).all()
        assert torch.equal(bits(batch["final_hidden_state"][j, :t]), stored(table, i, "final_hidden_state"))
    with pytest.raises(ValueError):
        collate([])


def test_dataloader_example(out, table, tokenizer):
    """The README's DataLoader snippet, map-style (local) and iterable (streaming)."""
    from torch.utils.data import DataLoader

    rows = hsx.load(str(out), layers=[0, 1, 3])
    loader = DataLoader(rows, batch_size=4, shuffle=True, num_workers=0,
                        collate_fn=functools.partial(hsx.collate, pad_token_id=tokenizer.pad_token_id))
    seen = []
    for batch in loader:
        assert batch["hidden_states"].dtype == torch.bfloat16 and batch["hidden_states"].shape[2:] == (3, 64)
        assert int(batch["attention_mask"].sum()) == int(batch["num_tokens"].sum())
        seen += batch["sample_id"].tolist()
    assert sorted(seen) == sorted(table.column("sample_id").to_pylist())
    stream = DataLoader(hsx.load(str(out), streaming=True, layers=[3]), batch_size=4, collate_fn=hsx.collate)
    assert sum(b["input_ids"].shape[0] for b in stream) == table.num_rows


# ---- SpecForge export ---------------------------------------------------------------------------------------

def test_export_specforge_round_trip(out, table, meta, tmp_path):
    dest = tmp_path / "specforge"
    res = export_specforge(str(out), dest, log=lambda *a: None)
    files = sorted(dest.rglob("*.ckpt"))
    assert res["written"] == len(files) == table.num_rows
    rows_in = meta["counts"]["rows_in"]
    sids = table.column("sample_id").to_pylist()
    assert {f"rows_0-{min(2000, rows_in)}/data_{s}.ckpt" for s in sids} == \
        {str(f.relative_to(dest)) for f in files}
    assert not list(dest.rglob(".*"))  # no temporary file left
    for i in (0, len(sids) // 2, len(sids) - 1):
        data = torch.load(dest / f"rows_0-{min(2000, rows_in)}" / f"data_{sids[i]}.ckpt", weights_only=True)
        assert set(data) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        n = int(table.column("num_tokens")[i].as_py())
        assert data["input_ids"].dtype == data["loss_mask"].dtype == torch.int64
        assert data["input_ids"].tolist() == table.column("input_ids")[i].as_py()
        assert data["loss_mask"].tolist() == table.column("loss_mask")[i].as_py()
        assert data["hidden_state"].shape == (1, n, 64) and data["hidden_state"].dtype == torch.bfloat16
        assert data["aux_hidden_state"].shape == (1, n, 3 * 64) and data["aux_hidden_state"].dtype == torch.bfloat16
        assert torch.equal(bits(data["hidden_state"][0]), stored(table, i, "final_hidden_state"))
        # aux: the 3 layers concatenated in increasing layer order, exactly the stored row
        assert torch.equal(bits(data["aux_hidden_state"][0]), stored(table, i).reshape(n, 3 * 64))
    # a file holds its own sample only (a view would drag the whole mapped buffer into torch.save)
    biggest = max(f.stat().st_size for f in files)
    assert biggest < 2 * (2 + 8 + 8 + 4 * 64 * 2) * int(max(table.column("num_tokens").to_pylist())) + 4096
    # resumable: existing files are kept
    again = export_specforge(str(out), dest, log=lambda *a: None)
    assert again == {"written": 0, "kept": len(files), "skipped": 0, "released": 0, "dest": str(dest)}


def test_export_specforge_needs_final_hidden_and_3_layers(out, tmp_path):
    with pytest.raises(ValueError, match="3 auxiliary layers"):
        export_specforge(str(out), tmp_path / "x", layers=[0, 1])
    res = export_specforge(str(out), tmp_path / "y", layers=[3, 0, 1], log=lambda *a: None)  # reordered: by layer
    f = next((tmp_path / "y").rglob("*.ckpt"))
    assert res["written"] > 0 and torch.load(f, weights_only=True)["aux_hidden_state"].shape[-1] == 3 * 64
    copy = tmp_path / "nofinal"
    shutil.copytree(out, copy)
    meta = json.loads((copy / "hsx.json").read_text())
    (copy / "hsx.json").write_text(json.dumps({**meta, "final_hidden": False}))
    with pytest.raises(ValueError, match="final-norm"):
        export_specforge(str(copy), tmp_path / "z")


def test_export_specforge_groups_by_2000(tmp_path, out, meta, table):
    """SpecForge's folder of a sample: rows_{k}-{end} with k = i // 2000 * 2000 and end capped by the row count
    (here with groups of 10)."""
    export_specforge(str(out), tmp_path / "g", group_size=10, log=lambda *a: None)
    rows_in = meta["counts"]["rows_in"]
    want = {f"rows_{s // 10 * 10}-{min(s // 10 * 10 + 10, rows_in)}/data_{s}.ckpt"
            for s in table.column("sample_id").to_pylist()}
    assert {str(f.relative_to(tmp_path / "g")) for f in (tmp_path / "g").rglob("*.ckpt")} == want
    assert len({w.split("/")[0] for w in want}) >= 3 and rows_in % 10 != 0  # a short last group


# ---- the card -----------------------------------------------------------------------------------------------

def test_card_yaml_fingerprint_and_decode(out, meta):
    text = (out / "README.md").read_text()
    card = yaml.safe_load(text.split("---\n")[1])
    assert card["configs"][0]["config_name"] == "default"
    # exactly the committed units hsx.json lists (no glob: a unit gone is an error, not fewer rows)
    listed = [f"data/{f['file']}" for f in meta["files"]]
    assert card["configs"][0]["data_files"] == [{"split": "train", "path": listed}]
    assert sorted(meta["files"], key=lambda f: f["file"]) == meta["files"] and len(meta["files"]) == meta["units"]
    assert card["configs"][0]["description"] == f"hsx job {meta['fingerprint']}"
    assert card["hsx_fingerprint"] == meta["fingerprint"]
    assert 'to(torch.int16).view(torch.bfloat16).reshape(row["num_tokens"], 3, 64)' in text
    assert "layers **0, 1, 3** of 4" in text and meta["layer_convention"] in text
    assert f"{meta['counts']['rows_written']:,} rows" in text and "Produced by: `" in text
    # a small local output: hsx.load / torch_view first, no "stream it" lead
    assert "hsx.torch_view(" in text and "stream it instead" not in text


def test_card_leads_with_streaming_for_hub_and_big_outputs(meta):
    hub = dataset_card({**meta, "config": {**meta["config"], "push_to_hub": "me/states"}},
                       "hsx extract --push-to-hub me/states")
    loading = hub[hub.index("## Loading"):]
    assert loading.index("import hsx") < loading.index("from datasets import load_dataset")
    assert "stream it instead" in hub and 'load_dataset("me/states", split="train", streaming=True)' in hub
    big = dataset_card({**meta, "counts": {**meta["counts"], "tokens_written": 10**9}}, "hsx extract")
    assert "stream it instead" in big and "about **512.0 GB**" in big
    assert "hf_***" in dataset_card(meta, "hsx extract --x hf_abcdefghijklmnopqrstuvwxyz")


def test_card_decode_for_other_storage_dtypes(meta):
    fp8 = dataset_card({**meta, "storage_dtype": "float8_e4m3"}, "hsx")
    assert "view(torch.float8_e4m3fn)" in fp8 and "hidden_states_scale" in fp8
    assert "view(torch.bfloat16)" not in dataset_card({**meta, "storage_dtype": "float32"}, "hsx")


def _same_named_outputs(tmp_path, model4, small_chat_path):
    a, b = tmp_path / "a" / "out", tmp_path / "b" / "out"
    run_extract(a, model=str(model4.path), dataset=str(small_chat_path), layers=["1"])
    run_extract(b, model=str(model4.path), dataset=str(small_chat_path), layers=["2", "3"])
    return a, b


def test_fingerprint_in_card_config_busts_datasets_local_cache(tmp_path, model4, small_chat_path):
    """datasets 5.2 caches load_dataset(DIR) by folder name + the card's configs: two jobs in folders named alike
    must still read their own rows (the config's description carries the job fingerprint)."""
    from datasets import load_dataset

    a, b = _same_named_outputs(tmp_path, model4, small_chat_path)
    assert load_dataset(str(a), split="train").features["hidden_states"].feature.length == 64
    got = load_dataset(str(b), split="train")
    assert got.features["hidden_states"].feature.length == 128
    assert got.data.table.equals(hsx.load(str(b)).data.table)


@pytest.mark.xfail(strict=True, reason="datasets 5.2 keys its cache of a local dir by the folder's name and the "
                   "card's configs, not the path or the files: without the fingerprint in the config, a second job "
                   "in a folder of the same name reads the first one's rows (a top-level YAML key does not help)")
def test_without_the_config_fingerprint_datasets_returns_stale_rows(tmp_path, model4, small_chat_path):
    from datasets import load_dataset

    a, b = _same_named_outputs(tmp_path, model4, small_chat_path)
    for root in (a, b):  # keep hsx_fingerprint at the top level, drop it from the config
        text = (root / "README.md").read_text()
        (root / "README.md").write_text("\n".join(line for line in text.splitlines()
                                                  if not line.strip().startswith("description: hsx job")) + "\n")
    load_dataset(str(a), split="train")
    assert load_dataset(str(b), split="train").features["hidden_states"].feature.length == 128


def test_torch_stream_rejects_python_rows(out):
    ds = hsx.load(str(out), streaming=True).map(lambda r: r)  # a Python-level map: rows are no longer Arrow
    with pytest.raises(TypeError, match="int64 values, not the int16 bits of bfloat16"):
        next(iter(torch_stream(ds, layers=[1], meta=json.loads((out / "hsx.json").read_text()))))


def test_card_decode_snippet_runs(out, table):
    """The card's plain-datasets snippet, run as written (on the local dir instead of a repo)."""
    text = (out / "README.md").read_text()
    block = next(b for b in text.split("```python\n")[1:] if "from datasets import load_dataset" in b)
    code = block.split("```")[0].replace("path/to/this/dir", str(out))
    scope: dict = {}
    exec(code, scope)  # noqa: S102  (our own card)
    assert scope["states"].dtype == torch.bfloat16  # the first row, in output order
    assert torch.equal(bits(scope["states"]), stored(table, 0))


@pytest.fixture(scope="module")
def dtype_outputs(tmp_path_factory, model4, small_chat_path) -> dict[str, Path]:
    outs = {}
    for dtype in ("bfloat16", "float16", "float8_e4m3"):
        outs[dtype] = tmp_path_factory.mktemp("dtype") / dtype
        run_extract(outs[dtype], model=str(model4.path), dataset=str(small_chat_path), layers=["0", "1", "3"],
                    final_hidden=True, storage_dtype=dtype)
    return outs


def test_other_storage_dtypes_decode(dtype_outputs, tmp_path):
    ref = torch_view(str(dtype_outputs["bfloat16"]))
    f16 = torch_view(str(dtype_outputs["float16"]), layers=[1, 3])
    fp8 = torch_view(str(dtype_outputs["float8_e4m3"]), layers=[1, 3])
    raw = hsx.load(str(dtype_outputs["float8_e4m3"]), layers=[1, 3], dequantize=False)
    assert len(ref) == len(f16) == len(fp8) > 2
    for i in range(len(ref)):
        want = ref[i]["hidden_states"][:, 1:].float()
        a, q = f16[i], fp8[i]
        assert a["hidden_states"].dtype == torch.float16 and a["hidden_states"].shape == want.shape
        assert torch.allclose(a["hidden_states"].float(), want, rtol=1e-2, atol=1e-3)
        # by default fp8 comes back dequantized to bfloat16 (x = q * scale), the scales already applied
        assert q["hidden_states"].dtype == q["final_hidden_state"].dtype == torch.bfloat16
        assert "hidden_states_scale" not in q and "final_hidden_state_scale" not in q
        x = q["hidden_states"].float()
        assert float((x - want).norm() / want.norm()) < 0.06  # e4m3: 3 mantissa bits, per-token absmax scales
        f = q["final_hidden_state"].float()
        assert float((f - ref[i]["final_hidden_state"].float()).norm() / f.norm()) < 0.06
        r = raw[i]  # raw values and scales on request
        assert r["hidden_states"].dtype == torch.float8_e4m3fn and r["hidden_states_scale"].shape == want.shape[:2]
        assert torch.equal((r["hidden_states"].float() * r["hidden_states_scale"][..., None]).to(torch.bfloat16),
                           q["hidden_states"])
    batch = collate([fp8[0], fp8[1]])
    n = int(batch["num_tokens"].max())
    assert batch["hidden_states"].dtype == torch.bfloat16 and "hidden_states_scale" not in batch
    assert torch.equal(batch["hidden_states"][0, : fp8[0]["input_ids"].shape[0]], fp8[0]["hidden_states"])
    batch = collate([raw[0], raw[1]])
    assert batch["hidden_states"].dtype == torch.float8_e4m3fn and batch["hidden_states_scale"].shape == (2, n, 2)
    assert torch.equal(batch["hidden_states"][0, : raw[0]["input_ids"].shape[0]].view(torch.uint8),
                       raw[0]["hidden_states"].view(torch.uint8))
    export_specforge(str(dtype_outputs["float8_e4m3"]), tmp_path / "sf", log=lambda *a: None)
    f = next((tmp_path / "sf").rglob("*.ckpt"))
    data = torch.load(f, weights_only=True)
    assert data["aux_hidden_state"].dtype == data["hidden_state"].dtype == torch.bfloat16  # dequantized


@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3"])
def test_card_decode_snippet_runs_for_other_dtypes(dtype_outputs, dtype):
    root = dtype_outputs[dtype]
    text = (root / "README.md").read_text()
    block = next(b for b in text.split("```python\n")[1:] if "from datasets import load_dataset" in b)
    scope: dict = {}
    exec(block.split("```")[0].replace("path/to/this/dir", str(root)), scope)  # noqa: S102
    row = torch_view(str(root))[0]  # (fp8: dequantized as the snippet does)
    assert torch.equal(scope["states"].float(), row["hidden_states"].float())
    card = text.replace("\n", " ")
    assert "bit-exact" not in card  # only bfloat16 storage is
    assert ("lossy" in card) == (dtype == "float8_e4m3")


def test_every_stored_column_comes_back(tmp_path, model4, small_chat_path):
    """torch_view, torch_stream and collate hand out every column the output stores: top-k logits and ids,
    has_nonfinite and num_tokens too, each equal to what Arrow holds."""
    root = tmp_path / "topk"
    run_extract(root, model=str(model4.path), dataset=str(small_chat_path), layers=["1"], final_hidden=True,
                topk_logits=3, nonfinite="keep")
    table = hsx.load(str(root)).data.table
    assert {"topk_logits", "topk_ids", "has_nonfinite"} <= set(table.column_names)
    view, stream = torch_view(str(root)), list(hsx.load(str(root), layers=[1], streaming=True))
    for i in range(len(view)):
        row = view[i]
        assert set(table.column_names) <= set(row), set(table.column_names) - set(row)
        n = int(table.column("num_tokens")[i].as_py())
        assert row["num_tokens"] == n and row["has_nonfinite"] is False
        want_ids = np.asarray(table.column("topk_ids")[i].as_py(), dtype=np.int32)
        assert torch.equal(row["topk_ids"], torch.from_numpy(want_ids)) and row["topk_ids"].shape == (n, 3)
        want_logits = torch.from_numpy(np.asarray(table.column("topk_logits")[i].as_py(), dtype=np.int16))
        assert row["topk_logits"].dtype == torch.bfloat16 and torch.equal(bits(row["topk_logits"]), want_logits)
        assert (row["topk_logits"][:, :-1] >= row["topk_logits"][:, 1:]).all()  # sorted, so really logits
        assert set(table.column_names) <= set(stream[i])
        assert torch.equal(stream[i]["topk_ids"], row["topk_ids"])
    batch = collate([view[0], view[1]], pad_to_multiple_of=8)
    n0, width = int(view[0]["num_tokens"]), batch["input_ids"].shape[1]
    assert batch["topk_ids"].shape == (2, width, 3) and batch["topk_logits"].dtype == torch.bfloat16
    assert torch.equal(batch["topk_ids"][0, :n0], view[0]["topk_ids"]) and not batch["topk_ids"][0, n0:].any()
    assert batch["has_nonfinite"].tolist() == [False, False]


def test_a_hub_hsx_json_bigger_than_hsx_writes_is_not_downloaded(monkeypatch, tmp_path):
    """hsx.load(REPO, layers=...) downloaded the repo's hsx.json whatever its size (into the HF cache) before the
    read refused it: its size is asked first, and a forged one is one line, with nothing downloaded."""
    from types import SimpleNamespace

    import huggingface_hub

    from hsx.config import HsxError
    from hsx.load import hub_info
    from hsx.schema import MAX_INFO_BYTES

    asked, downloaded = [], []

    class Api:
        def get_paths_info(self, repo_id, paths, **kw):
            asked.append((repo_id, paths, kw.get("revision")))
            return [SimpleNamespace(path="hsx.json", size=MAX_INFO_BYTES + 1)]

    cached = tmp_path / "hsx.json"  # (what an earlier download left in the cache)
    with open(cached, "wb") as f:
        f.truncate(MAX_INFO_BYTES + 1)
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: Api())
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: downloaded.append(a) or str(cached))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(HsxError, match=r"someone/states: its hsx.json is [\d,]+ bytes, more than hsx writes"):
        hub_info("someone/states", "v2")
    assert asked == [("someone/states", ["hsx.json"], "v2")] and not downloaded
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # only the cache: its copy is bounded
    with pytest.raises(HsxError, match=r"hsx.json is damaged: [\d,]+ bytes, more than hsx writes there"):
        hub_info("someone/states", "v2")
    assert len(asked) == 1 and len(downloaded) == 1


import importlib  # noqa: E402
import re  # noqa: E402

from helpers import (copy_of, edit_info, flip_unit_bytes, hsx_main, message_lines, planted_secret,  # noqa: E402
                     swap_for_link, tree_bytes)
from test_hub import FakeHfApi, pushed  # noqa: E402
from hsx.config import HsxError  # noqa: E402
from hsx.hub import push_output  # noqa: E402
from hsx.sink import OutputDir, file_crc32  # noqa: E402


# ---- a damaged, incomplete or changed output is refused, never read as fewer rows ----------------------------------

def info_rows(out: Path) -> int:
    return json.loads((out / "hsx.json").read_text())["counts"]["rows_written"]


def unit_rows(out: Path, name: str) -> int:
    return next(f["rows"] for f in json.loads((out / "hsx.json").read_text())["files"] if f["file"] == name)


def test_load_refuses_a_damaged_or_incomplete_dir(finished, tmp_path):
    rows = info_rows(finished)
    units = sorted((finished / "data").glob("*.arrow"))
    flipped = copy_of(finished, tmp_path, "flipped")
    flip_unit_bytes(flipped / "data" / units[1].name)
    assert len(hsx.load(str(flipped))) == rows  # sizes agree: only verify=True reads every byte
    with pytest.raises(HsxError, match=f"damaged.*{units[1].name}: its bytes do not match its CRC-32"):
        hsx.load(str(flipped), verify=True)
    deleted = copy_of(finished, tmp_path, "deleted")
    (deleted / "data" / units[2].name).unlink()
    with pytest.raises(HsxError, match=f"damaged: 1 of the {len(units)} files .*{units[2].name}: missing"):
        hsx.load(str(deleted))
    with pytest.raises(HsxError, match="damaged"):
        hsx.torch_view(str(deleted))
    with pytest.warns(UserWarning, match="1 are missing or damaged"):
        part = hsx.load(str(deleted), allow_incomplete=True)
    assert len(part) == rows - unit_rows(finished, units[2].name)
    truncated = copy_of(finished, tmp_path, "truncated")
    with open(truncated / "data" / units[0].name, "r+b") as f:
        f.truncate(100)
    with pytest.raises(HsxError, match="100 bytes, not"):
        hsx.load(str(truncated))
    killed = copy_of(finished, tmp_path, "killed")  # as a kill before finalization leaves it
    (killed / "hsx.json").unlink()
    (killed / "data" / units[-1].name).unlink()
    with pytest.raises(HsxError, match=r"not a finished hsx output \(\d+ of \d+ units committed"):
        hsx.load(str(killed))
    with pytest.warns(UserWarning, match="the job is not finished"):
        assert len(hsx.load(str(killed), allow_incomplete=True)) == rows - unit_rows(finished, units[-1].name)


def test_load_dataset_on_a_dir_with_a_unit_gone_fails_instead_of_fewer_rows(finished, tmp_path):
    from datasets import load_dataset

    gone = copy_of(finished, tmp_path, "trust-unit-gone")  # a folder name of its own (datasets' cache key)
    name = sorted((gone / "data").glob("*.arrow"))[1].name
    (gone / "data" / name).unlink()
    with pytest.raises(Exception, match=name.replace(".", r"\.")):
        sum(1 for _ in load_dataset(str(gone), split="train", streaming=True))
    card = (gone / "README.md").read_text()
    assert "train-*.arrow" not in card.split("---")[1]


def test_load_dataset_on_an_unfinished_dir_fails_instead_of_part_of_it(finished, tmp_path):
    from datasets import load_dataset

    out = tmp_path / "trust-unfinished"  # a folder name of its own (datasets' cache key)
    with OutputDir(out).locked():
        assert OutputDir(out).start_or_resume({"fingerprint": "a", "inputs": {}}, False) == "new"
    shutil.copytree(finished / "data", out / "data")  # units committed so far
    with pytest.raises(FileNotFoundError, match="NOT-FINISHED-run-the-same-hsx-extract-command"):
        load_dataset(str(out), split="train", streaming=True)
    with pytest.raises(FileNotFoundError, match="NOT-FINISHED"):
        load_dataset(str(out), split="train")


def test_load_refuses_a_unit_swapped_for_a_link_after_its_check(finished_copy, finished, tmp_path, monkeypatch):
    """hsx.load checks each unit's name, then maps it: a swap in between (a link to another output's unit, valid
    Arrow of the same schema) is caught, never read as this output's rows."""
    other = tmp_path / "other.arrow"
    victim = sorted((finished_copy / "data").glob("train-*.arrow"))[0]
    shutil.copy(sorted((finished / "data").glob("train-*.arrow"))[-1], other)
    load_module = importlib.import_module("hsx.load")  # (hsx.load is also the function)
    real = load_module.open_arrow_files

    def swap_then_open(files):
        swap_for_link(victim, other)
        return real(files)

    monkeypatch.setattr(load_module, "open_arrow_files", swap_then_open)
    with pytest.raises(HsxError, match="changed while it was being opened|not the regular file"):
        hsx.load(finished_copy)


# ---- hsx.json's list, the manifests, the counts and data/ tell one story to every reader ---------------------------

def refused_everywhere(out: Path, *needles: str) -> None:
    """hsx.load, hsx verify and a push all refuse `out` in one line naming what disagrees; nothing is uploaded."""
    for read in (lambda: hsx.load(str(out)), lambda: hsx.load(str(out), verify=True)):
        with pytest.raises(HsxError) as e:
            read()
        assert all(n in str(e.value) for n in needles) and "\n" not in str(e.value), str(e.value)
    rc, _, err = hsx_main(["verify", str(out), "--samples", "0"])
    assert rc == 1 and "Traceback" not in err
    assert [line for line in message_lines(err) if all(n in line for n in needles)] == message_lines(err)
    assert len(message_lines(err)) == 1 and message_lines(err)[0].startswith("hsx: verify failed: ")
    api = FakeHfApi()
    with pytest.raises(HsxError, match=re.escape(needles[0])):
        push_output(out, "someone/states", api=api, log=lambda *a: None)
    assert not pushed(api)


def test_a_cut_or_emptied_file_list_is_refused_not_read_as_fewer_rows(finished, tmp_path):
    info = json.loads((finished / "hsx.json").read_text())
    rows = info["counts"]["rows_written"]
    cut = copy_of(finished, tmp_path, "cut")
    edit_info(cut, files=info["files"][:2])
    listed = sum(f["rows"] for f in info["files"][:2])
    refused_everywhere(cut, f"`files` list 2 file(s) of {listed:,} rows, its counts say {rows:,} rows")
    emptied = copy_of(finished, tmp_path, "emptied")
    edit_info(emptied, files=[])
    refused_everywhere(emptied, f"`files` list 0 file(s) of 0 rows, its counts say {rows:,} rows")
    # the counts made to fit the cut list: the manifests still name every unit
    fitted = copy_of(finished, tmp_path, "fitted")
    edit_info(fitted, files=info["files"][:2], counts={**info["counts"], "rows_written": listed})
    refused_everywhere(fitted, f"hsx.json lists 2 file(s), the manifests in .hsx/ {len(info['files'])}",
                       "is in the manifests but not listed")
    # and without .hsx/ (as a copy of the Hub's files has it): data/ still holds the units it does not list
    shutil.rmtree(fitted / ".hsx")
    refused_everywhere(fitted, f"data/ holds {len(info['files']) - 2} data file(s) hsx.json does not list")
    # an older hsx's hsx.json without a list, its data files cut: their rows against the counts
    older = copy_of(finished, tmp_path, "older")
    info_older = {k: v for k, v in info.items() if k != "files"}
    (older / "hsx.json").write_text(json.dumps(info_older))
    shutil.rmtree(older / ".hsx")
    (older / "data" / info["files"][0]["file"]).unlink()
    with pytest.raises(HsxError, match=f"hold {rows - info['files'][0]['rows']:,} rows, its hsx.json counts {rows:,}"):
        hsx.load(str(older))


def test_load_refuses_a_data_file_hsx_json_does_not_list(finished, tmp_path):
    planted = copy_of(finished, tmp_path, "planted")
    first = sorted((planted / "data").glob("*.arrow"))[0]
    shutil.copy(first, planted / "data" / "train-999-00000.arrow")
    refused_everywhere(planted, "data/ holds 1 data file(s) hsx.json does not list (train-999-00000.arrow)",
                       "move away the files it does not list")


# ---- no link is read or pushed but those `hsx merge` makes ---------------------------------------------------------

def listed_link_to(out: Path, secret: Path, name: str = "train-998-00000.arrow") -> None:
    """A link in data/ to `secret`, listed in hsx.json with the secret's size and CRC-32 (and no rows)."""
    (out / "data" / name).symlink_to(secret)
    info = json.loads((out / "hsx.json").read_text())
    info["files"].append({"file": name, "unit": name[6:-6], "rows": 0, "bytes": secret.stat().st_size,
                          "crc32": file_crc32(secret)})
    (out / "hsx.json").write_text(json.dumps(info))


def test_a_listed_link_to_a_secret_is_neither_read_nor_pushed(finished, tmp_path):
    secret = planted_secret(tmp_path)
    with_state = copy_of(finished, tmp_path, "with-state")
    listed_link_to(with_state, secret)  # the manifests know no such unit
    refused_everywhere(with_state, "data/train-998-00000.arrow is listed in hsx.json but in no manifest")
    hub_copy = copy_of(finished, tmp_path, "hub-copy")  # no .hsx/ to compare with: the link itself is refused
    shutil.rmtree(hub_copy / ".hsx")
    listed_link_to(hub_copy, secret)
    refused_everywhere(hub_copy, "train-998-00000.arrow is a symbolic link, and not one `hsx merge` made")
    # a link that claims to be a merge's: hsx.json names the secret's folder as a merged dir
    evil = tmp_path / "evil"
    (evil / "data").mkdir(parents=True)
    shutil.copy(secret, evil / "data" / "train-998-00000.arrow")
    claimed = copy_of(finished, tmp_path, "claimed")
    shutil.rmtree(claimed / ".hsx")
    (claimed / "data" / "train-998-00000.arrow").symlink_to(evil / "data" / "train-998-00000.arrow")
    info = json.loads((claimed / "hsx.json").read_text())
    info["files"].append({"file": "train-998-00000.arrow", "unit": "998-00000", "rows": 0,
                          "bytes": secret.stat().st_size, "crc32": file_crc32(secret)})
    info["run"] = {"merged_from": [str(evil.resolve()), str(claimed.resolve())]}
    (claimed / "hsx.json").write_text(json.dumps(info))
    refused_everywhere(claimed, "train-998-00000.arrow is a symbolic link, and not one `hsx merge` made")
    for out in (with_state, hub_copy, claimed):
        api = FakeHfApi()
        with pytest.raises(HsxError):
            push_output(out, "someone/states", api=api, log=lambda *a: None)
        assert not any(b"TopSecret" in v for v in pushed(api).values())


def test_a_data_folder_that_is_a_link_is_not_read(finished, tmp_path):
    elsewhere = copy_of(finished, tmp_path, "elsewhere")
    out = copy_of(finished, tmp_path, "out")
    shutil.rmtree(out / "data")
    (out / "data").symlink_to(elsewhere / "data")
    refused_everywhere(out, "data is a symbolic link; hsx reads and pushes no link out of the output")


# ---- datasets' caches stay out of the output -----------------------------------------------------------------------

def test_cache_writing_ops_write_nothing_into_the_output(finished, tmp_path):
    out = copy_of(finished, tmp_path, "out")
    before = tree_bytes(out)
    ds = hsx.load(str(out))
    ids = ds["sample_id"]
    assert ds.sort("num_tokens")["num_tokens"] == sorted(ds["num_tokens"])
    assert len(ds.filter(lambda r: r["num_tokens"] > 20)) == sum(n > 20 for n in ds["num_tokens"])
    assert ds.map(lambda r: {"twice": 2 * r["sample_id"]})["twice"] == [2 * i for i in ids]
    assert sorted(ds.shuffle(seed=0).flatten_indices()["sample_id"]) == sorted(ids)
    assert ds.select(range(3)).sort("sample_id", reverse=True)["sample_id"] == sorted(ids[:3], reverse=True)
    assert tree_bytes(out) == before, sorted(set(tree_bytes(out)) - set(before))
    import datasets

    assert all(Path(f["filename"]).is_relative_to(datasets.config.HF_DATASETS_CACHE) for f in ds.cache_files)
    # cache files an older hsx let datasets write into data/: nothing reads or refuses them
    old_cache = out / "data" / "cache-0123456789abcdef.arrow"
    shutil.copy(sorted((out / "data").glob("train-*.arrow"))[0], old_cache)
    assert len(hsx.load(str(out), verify=True)) == len(ids)
    rc, _, err = hsx_main(["verify", str(out), "--samples", "0"])
    assert rc == 0, err
    api = FakeHfApi()
    push_output(out, "someone/states", api=api, log=lambda *a: None)
    assert "data/cache-0123456789abcdef.arrow" not in api.files()
