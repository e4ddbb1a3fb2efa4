"""The exports read by the trainers' OWN code, from their released packages: specforge 0.2.0 (OfflineManifestReader
lists the files, load_feature_file loads them, the eagle3 / dflash / dspark strategy's normalize_offline_sample
shapes them) and speculators 0.9.0 (ArrowDataset with on_missing="raise", its collate, its vocab mapping and config
parsing).

Their pins conflict with ours (specforge: torch 2.11, transformers 5.8.1, sglang; speculators: datasets <= 5.1,
transformers <= 5.19), so each is installed with `pip install --no-deps --target` into the pytest cache, plus only
the few packages their reading code imports; a test skips, saying why, where that cannot be done (no network).
The tensors must equal hsx.torch_view's rows for the same sample up to the trainer's documented renaming,
reshaping and (SpecForge EAGLE-3) zeroed last loss-mask position."""

from __future__ import annotations

import hashlib
import os
import importlib
import importlib.util
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import hsx_main, message_lines, write_jsonl
from hsx.config import load_config
from hsx.export import export_specforge, export_speculators
from hsx.load import load as hsx_load, torch_view
from hsx.run import extract
from hsx.vocab import draft_vocab, read_token_frequencies, write_draft_vocab

LAYERS = [0, 1, 2, 3]  # every layer of model4: layer 3 (N-1) is speculators' verifier state
EAGLE3_AUX = [0, 1, 2]
MAX_LEN = 4096
SPECFORGE = ["specforge==0.2.0"]
# speculators' ArrowDataset imports openai (its on_missing="generate" client) and hs_connectors (FileTransfer);
# its config resolution needs pydantic-settings.
SPECULATORS = ["speculators==0.9.0", "hs-connectors==0.9.0", "openai==3.57.0", "sniffio==1.3.1",
               "pydantic-settings==2.16.3", "python-dotenv==1.2.4"]
PYDANTIC = ["pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5"]
pytestmark = pytest.mark.slow  # each module fixture extracts and exports a whole output (~30 s on 2 loaded cores)


def quiet(*_a, **_k):
    pass


def _site(request, requirements: list[str]) -> Path:
    """A --target dir holding `requirements` (installed once, cached under .pytest_cache), on sys.path."""
    key = hashlib.sha256(" ".join(requirements).encode()).hexdigest()[:12]
    cache = getattr(request.config, "cache", None)  # None under `-p no:cacheprovider`: install per session
    root = (Path(cache.mkdir(f"hsx-trainers-{key}")) if cache is not None
            else request.getfixturevalue("tmp_path_factory").mktemp(f"hsx-trainers-{key}"))
    site, done = root / "site", root / "installed"
    if not done.exists():
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--upgrade", "--target", str(site), *requirements]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.skip(f"pip install {' '.join(requirements)} took over 10 minutes (no network?)")
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["?"])[-1]
            pytest.skip(f"cannot pip install {' '.join(requirements)} here (no network?): {last}")
        done.write_text(" ".join(requirements) + "\n")
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    return site


def _import(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.skip(f"{package}'s reading code imports {e.name!r}, which is not installable here: {e}")


@pytest.fixture(scope="session")
def specforge(request):
    _site(request, SPECFORGE)
    _import("specforge.runtime.data_plane.offline_reader", "specforge 0.2.0")
    return _import("specforge.algorithms.builtin", "specforge 0.2.0").builtin_algorithm_registry()


@pytest.fixture(scope="session")
def speculators(request):
    extra = PYDANTIC if importlib.util.find_spec("pydantic") is None else []
    _site(request, SPECULATORS + extra)
    return _import("speculators.train.data", "speculators 0.9.0")


@pytest.fixture(scope="module")
def out(tmp_path_factory, model4, chat_data) -> Path:
    root = tmp_path_factory.mktemp("trainers") / "out"
    cfg = load_config(None, {"output_dir": str(root), "compile": "off", "model": str(model4.path),
                             "dataset": str(chat_data.path), "layers": [str(i) for i in LAYERS],
                             "final_hidden": True, "max_length": 160, "token_budget": 640})
    extract(cfg, log=quiet)
    return root


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


def sample_of(path: str) -> int:
    return int(Path(path).name.removesuffix(".ckpt").split("_")[1])


# ---- SpecForge ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["eagle3", "dflash", "dspark"])
def test_specforge_reads_every_exported_file(specforge, out, tmp_path, monkeypatch, layout):
    from specforge.runtime.data_plane.feature_store import load_feature_file

    # The reader's eager pass (off by default): it loads every file and checks the strategy's keys are tensors.
    monkeypatch.setenv("SPECFORGE_VALIDATE_OFFLINE_FEATURES", "1")
    layers = EAGLE3_AUX if layout == "eagle3" else LAYERS
    dest = tmp_path / layout
    res = export_specforge(str(out), dest, layers=layers, layout=layout, log=quiet)
    provider = specforge.resolve(layout).providers.offline[0]  # the strategy's own reader and normalizer
    refs = list(provider.build_reader(str(dest), run_id="hsx", ttt_length=7, max_len=MAX_LEN))
    files = sorted(str(p.resolve()) for p in dest.rglob("*.ckpt"))
    assert len(files) == res["written"] > 10 and res["skipped"] == 0
    assert sorted(r.feature_store_uri.removeprefix("file://") for r in refs) == files  # every file, listed once
    normalize = provider.build_normalizer(MAX_LEN)

    view = torch_view(str(out), layers=layers)
    position = {view[i]["sample_id"]: i for i in range(len(view))}
    assert sorted(position) == sorted(sample_of(f) for f in files)
    for ref in refs:
        path = ref.feature_store_uri.removeprefix("file://")
        raw = load_feature_file(path)
        sample = normalize({key: raw[key] for key in ref.feature_keys})
        row = view[position[sample_of(path)]]
        n = row["input_ids"].shape[0]
        assert ref.num_tokens == n
        assert torch.equal(sample["input_ids"], row["input_ids"].long()[None])
        states = row["hidden_states"].reshape(1, n, -1)  # the layers side by side, increasing layer order
        if layout == "eagle3":
            mask = row["loss_mask"].long().clone()
            mask[-1] = 0  # SpecForge's EAGLE-3 zeroes the last position (nothing follows it)
            assert set(sample) == {"input_ids", "loss_mask", "attention_mask", "hidden_state", "target"}
            assert torch.equal(sample["loss_mask"], mask[None])
            assert torch.equal(sample["attention_mask"], torch.ones(1, n, dtype=torch.long))
            assert sample["hidden_state"].shape == (1, n, 3 * 64) and sample["target"].shape == (1, n, 64)
            assert torch.equal(bits(sample["hidden_state"]), bits(states))
            assert torch.equal(bits(sample["target"]), bits(row["final_hidden_state"][None]))  # final norm
        else:
            dspark = {"target_last_hidden_states"} if layout == "dspark" else set()
            assert set(sample) == {"input_ids", "loss_mask", "hidden_states"} | dspark
            assert torch.equal(sample["loss_mask"], row["loss_mask"].long()[None])
            assert sample["hidden_states"].shape == (1, n, len(LAYERS) * 64)
            assert torch.equal(bits(sample["hidden_states"]), bits(states))
            if dspark:  # the target's last hidden state after the final norm, as SpecForge's capture stores it
                assert torch.equal(bits(sample["target_last_hidden_states"]), bits(row["final_hidden_state"][None]))


def test_specforge_dflash_leaves_out_rows_its_normalizer_rejects(specforge, model4, tmp_path):
    """SpecForge's DFlash needs two consecutive supervised tokens; a row without them is left out and counted
    (its normalizer raises on it), the others are exported."""
    rows = [{"input_ids": [5, 6, 7, 8, 9, 10], "loss_mask": [0, 0, 1, 1, 1, 0]},
            {"input_ids": [5, 6, 7, 8, 9, 10], "loss_mask": [0, 1, 0, 1, 0, 1]},
            {"input_ids": [11, 12, 13, 14], "loss_mask": [0, 0, 1, 1]}]
    root = tmp_path / "out"
    extract(load_config(None, {"output_dir": str(root), "compile": "off", "model": str(model4.path),
                               "dataset": str(write_jsonl(tmp_path / "ids.jsonl", rows)), "layers": ["1", "3"]}),
            log=quiet)
    res = export_specforge(str(root), tmp_path / "sf", layout="dflash", log=quiet)
    assert res["written"] == 2 and res["skipped"] == 1
    assert sorted(sample_of(str(p)) for p in (tmp_path / "sf").rglob("*.ckpt")) == [0, 2]
    normalize = specforge.resolve("dflash").providers.offline[0].build_normalizer(MAX_LEN)
    view = torch_view(str(root))
    row = next(view[i] for i in range(len(view)) if view[i]["sample_id"] == 1)
    with pytest.raises(ValueError, match="consecutive"):
        normalize({"input_ids": row["input_ids"].long(), "loss_mask": row["loss_mask"].long(),
                   "hidden_states": row["hidden_states"].reshape(6, -1)})


def test_specforge_counts_the_same_vocabulary(specforge, out, tmp_path):
    """SpecForge's own count over the exported files equals hsx's token_frequencies.npy, its mapping builder
    gives hsx's d2t/t2d, and the mapping file passes its consistency check."""
    from specforge.core.compact_teacher import validate_vocab_mapping_consistency
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    dest = tmp_path / "sf"
    export_specforge(str(out), dest, layers=EAGLE3_AUX, log=quiet)
    counts = read_token_frequencies(out)
    theirs = count_effective_feature_tokens(str(dest), target_vocab_size=len(counts))
    assert theirs == Counter({i: int(c) for i, c in enumerate(counts) if c})
    distinct = int(np.count_nonzero(counts))
    for k in (distinct // 2, distinct + 7):  # fewer tokens than seen, and more (the lowest unseen ids fill in)
        in_id_order = Counter({i: int(counts[i]) for i in range(len(counts)) if counts[i]})  # ties: lower id
        d2t, t2d = process_token_dict_to_mappings(in_id_order, k, len(counts))
        ours = draft_vocab(counts, k)
        assert np.array_equal(ours[0], d2t.numpy()) and np.array_equal(ours[1], t2d.numpy())
        files = write_draft_vocab(str(out), k, tmp_path / "vocab", log=quiet)
        mapping = torch.load(files["specforge"], weights_only=True)  # what its load_vocab_mapping reads
        assert mapping["d2t"].dtype == torch.int64 and mapping["t2d"].dtype == torch.bool
        validate_vocab_mapping_consistency(mapping["t2d"], mapping["d2t"])
        assert torch.equal(mapping["d2t"], d2t) and torch.equal(mapping["t2d"], t2d)


# ---- --layers-from: the layers each peer's own code captures for its draft config ----------------------------

QWEN3_8B = {"num_hidden_layers": 36, "hidden_size": 4096, "vocab_size": 151936}


def test_specforge_resolves_the_layers_hsx_reads(specforge, tmp_path):
    """SpecForge's own resolvers (model_providers) on its draft configs: SGLang captures "before layer id + 1", so
    its id is hsx's layer, one for one."""
    from types import SimpleNamespace

    from specforge.algorithms.model_providers import resolve_dflash_capture_layers, resolve_eagle_capture_layers

    import json

    from hsx.drafts import draft_layers

    target = SimpleNamespace(**QWEN3_8B)
    run = SimpleNamespace(model=SimpleNamespace(aux_hidden_state_layer_ids=None))
    configs = [
        ("dflash", {"architectures": ["DFlashDraftModel"], "num_target_layers": 36, "hidden_size": 4096,
                    "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33]}}),
        ("dflash", {"architectures": ["DSparkDraftModel"], "num_target_layers": 36, "hidden_size": 4096,
                    "dflash_config": {"projector_type": "dspark", "target_layer_ids": [2, 10, 18, 26, 32]}}),
        ("eagle3", {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32000,
                    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 18, 33]}}),
        ("eagle3", {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32000}),  # its default
    ]
    for kind, config in configs:
        theirs = (resolve_dflash_capture_layers if kind == "dflash" else resolve_eagle_capture_layers)(
            run, config, target)
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert draft_layers(str(tmp_path / "config.json"), target).layers == theirs, (config, theirs)
    # a DFlash config without the list: its draft model's fallback, z-lab's rule (SpecForge's copy of it)
    build_target_layer_ids = _import("specforge.modeling.draft.dflash", "specforge 0.2.0").build_target_layer_ids
    for n, k in ((36, 5), (64, 5), (64, 1), (28, 3), (40, 8)):
        config = {"architectures": ["DFlashDraftModel"], "num_target_layers": n, "num_hidden_layers": k,
                  "dflash_config": {"mask_token_id": 0}}
        (tmp_path / "config.json").write_text(json.dumps(config))
        shape = SimpleNamespace(num_hidden_layers=n, hidden_size=64, vocab_size=100)
        assert draft_layers(str(tmp_path / "config.json"), shape).layers == build_target_layer_ids(n, k), (n, k)


def test_speculators_resolves_the_layers_hsx_reads(speculators, tmp_path):
    """speculators' own default (resolve_target_layer_ids, reading the verifier's config) counts the embedding
    output as 0: hsx's layers are its ids - 1, plus the verifier layer N-1."""
    import json
    from types import SimpleNamespace

    from speculators.models.utils import resolve_target_layer_ids

    from hsx.drafts import draft_layers

    (tmp_path / "verifier").mkdir()
    (tmp_path / "verifier" / "config.json").write_text(json.dumps({"model_type": "qwen3", **QWEN3_8B}))
    with pytest.warns(UserWarning):
        theirs = resolve_target_layer_ids(None, str(tmp_path / "verifier"))
    draft = {"speculators_model_type": "dspark", "transformer_layer_config": {"hidden_size": 4096,
                                                                             "vocab_size": 151936}}
    (tmp_path / "draft.json").write_text(json.dumps(draft))
    d = draft_layers(str(tmp_path / "draft.json"), SimpleNamespace(**QWEN3_8B))
    assert d.layers == [i - 1 for i in theirs] + [35]


# ---- speculators ----------------------------------------------------------------------------------------------

def test_speculators_arrow_dataset_reads_the_export(speculators, out, tmp_path):
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.recovery import SampleUnavailable

    dest = tmp_path / "sp"
    res = export_speculators(str(out), dest, log=quiet)
    assert res["target_layer_ids"] == [1, 2, 3]  # hsx layers 0, 1, 2 in vLLM's numbering (embeddings = 0)
    ds = ArrowDataset(max_len=MAX_LEN, datapath=str(dest), on_missing="raise")
    view = torch_view(str(out), layers=LAYERS)
    by_sid = sorted(range(len(view)), key=lambda i: view[i]["sample_id"])  # export order: by sample_id
    assert len(ds) == len(view) == res["rows"] == res["written"] > 10
    assert ds.approx_lengths == [int(view[i]["input_ids"].shape[0]) for i in by_sid]
    for i, pos in enumerate(by_sid):
        sample, row = ds[i], view[pos]
        assert not isinstance(sample, SampleUnavailable)
        n = row["input_ids"].shape[0]
        assert torch.equal(sample["input_ids"], row["input_ids"].long())
        assert torch.equal(sample["loss_mask"], row["loss_mask"].long())
        assert torch.equal(bits(sample["hidden_states"]), bits(row["hidden_states"][:, :3].reshape(n, -1)))
        # the last decoder layer, before the final norm (speculators applies its frozen verifier_norm)
        assert torch.equal(bits(sample["verifier_last_hidden_states"]), bits(row["hidden_states"][:, 3]))
        assert sample["lengths"].tolist() == [n] and torch.equal(sample["position_ids"], torch.arange(n))
    batch = CollateFn(max_len=512, hidden_size=64, num_target_layers=3)([ds[0], ds[1]])
    assert batch["hidden_states"].shape == (1, 512, 3 * 64) and batch["error_records"] == 0
    # its train/validation split is positional over the same files
    val = ArrowDataset(max_len=MAX_LEN, datapath=str(dest), on_missing="raise", train_ratio=0.5, split="val")
    assert torch.equal(val[0]["input_ids"], ds[len(ds) // 2]["input_ids"])
    (dest / "hidden_states" / "hs_0.safetensors").unlink()  # on_missing="raise": a missing file is an error
    with pytest.raises(RuntimeError, match="Failed to load hidden states"):
        ds[0]
    res = export_speculators(str(out), dest, log=quiet)  # resumes: writes only the missing file
    assert res["written"] == 1 and res["kept"] == len(ds) - 1 and torch.equal(ds[0]["input_ids"],
                                                                                 view[by_sid[0]]["input_ids"].long())


def test_speculators_vocab_and_config(speculators, out, tmp_path):
    """token_freq.pt through speculators' own mapping builder gives the d2t/t2d files its trainer finds in
    --data-path; speculators.yaml parses with its own config resolution."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    dest, k = tmp_path / "sp", 40
    export_speculators(str(out), dest, draft_vocab_size=k, log=quiet)
    freq = torch.load(dest / "token_freq.pt", weights_only=True)
    counts = read_token_frequencies(out)
    assert freq == {i: int(c) for i, c in enumerate(counts) if c}
    d2t, t2d = build_vocab_mappings_from_distribution(freq, k, len(counts))
    assert torch.equal(torch.from_numpy(np.load(dest / f"d2t-{k}.npy")), d2t)  # how its trainer loads them
    assert torch.equal(torch.from_numpy(np.load(dest / f"t2d-{k}.npy")), t2d)

    config = _import("speculators.train.config", "speculators 0.9.0 (config)")
    resolution = _import("speculators.train.config.resolution", "speculators 0.9.0 (config)")
    cfg = resolution.resolve(config.TrainConfig, ["--config", str(dest / "speculators.yaml")])
    assert cfg.data.data_path == str(dest.resolve()) and cfg.generation.on_missing == "raise"
    assert cfg.draft.target_layer_ids == [1, 2, 3] and cfg.draft.draft_vocab_size == k


def test_speculators_export_needs_the_last_layer(out, tmp_path, model4, small_chat_path):
    root = tmp_path / "no-last"
    extract(load_config(None, {"output_dir": str(root), "compile": "off", "model": str(model4.path),
                               "dataset": str(small_chat_path), "layers": ["0", "1"], "limit": 3}), log=quiet)
    with pytest.raises(ValueError, match="last decoder layer"):
        export_speculators(str(root), tmp_path / "x", log=quiet)
    with pytest.raises(ValueError, match="auxiliary"):
        export_speculators(str(out), tmp_path / "y", layers=[3], log=quiet)


def test_an_export_resumes_but_never_mixes_two(out, tmp_path):
    dest = tmp_path / "sf"
    export_specforge(str(out), dest, layers=EAGLE3_AUX, log=quiet)
    assert export_specforge(str(out), dest, layers=[2, 0, 1], log=quiet)["written"] == 0  # the same export
    with pytest.raises(ValueError, match="holds another export"):
        export_specforge(str(out), dest, layout="dflash", log=quiet)
    code, _, err = hsx_main(["export-specforge", str(out), str(dest), "--layout", "dflash"])
    assert code == 1 and len(message_lines(err)) == 1 and "holds another export" in err
    res = export_specforge(str(out), dest, layout="dflash", overwrite=True, log=quiet)
    assert res["written"] == len(list(dest.rglob("*.ckpt"))) and res["kept"] == 0
    assert all("hidden_states" in torch.load(f, weights_only=True) for f in dest.rglob("*.ckpt"))
    with pytest.raises(ValueError, match="outside the output dir"):
        export_speculators(str(out), out / "speculators", log=quiet)


def test_speculators_export_of_fp8_is_dequantized(speculators, model4, small_chat_path, tmp_path):
    from speculators.train.data import ArrowDataset

    root = tmp_path / "fp8"
    extract(load_config(None, {"output_dir": str(root), "compile": "off", "model": str(model4.path),
                               "dataset": str(small_chat_path), "layers": ["1", "3"],
                               "storage_dtype": "float8_e4m3"}), log=quiet)
    export_speculators(str(root), tmp_path / "sp", log=quiet)
    ds = ArrowDataset(max_len=MAX_LEN, datapath=str(tmp_path / "sp"), on_missing="raise")
    view = torch_view(str(root))
    by_sid = sorted(range(len(view)), key=lambda i: view[i]["sample_id"])
    for i, pos in enumerate(by_sid):
        row = view[pos]
        states = row["hidden_states"]
        if "hidden_states_scale" in row:  # stored as e4m3 with a float32 scale per token and layer
            states = (states.float() * row["hidden_states_scale"][..., None]).to(torch.bfloat16)
        assert ds[i]["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(bits(ds[i]["hidden_states"]), bits(states[:, 0]))
        assert torch.equal(bits(ds[i]["verifier_last_hidden_states"]), bits(states[:, 1]))


# ---- what an export keeps, deletes and refuses in DEST ---------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory, model4, small_chat_path) -> Path:
    """A few rows in several units, extracted with the model given as a RELATIVE path (as a recipe or a user in
    the model's parent folder would)."""
    root = tmp_path_factory.mktemp("small") / "out"
    here = Path.cwd()
    os.chdir(model4.path.parent)
    try:
        extract(load_config(None, {"output_dir": str(root), "compile": "off", "model": model4.path.name,
                                   "dataset": str(small_chat_path), "layers": [str(i) for i in LAYERS],
                                   "final_hidden": True, "max_length": 160, "token_budget": 160}), log=quiet)
    finally:
        os.chdir(here)
    assert len(list((root / "data").glob("train-*.arrow"))) >= 2
    return root


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def exported(root: Path) -> dict[str, bytes]:
    """The trainer's files of an export (its record aside, whose token differs per export; its own path as DEST)."""
    return {k: v.replace(str(root.resolve()).encode(), b"DEST") for k, v in tree(root).items()
            if not k.startswith("hsx-export.")}


def test_an_export_refuses_a_dest_it_did_not_write(small, tmp_path):
    sf = tmp_path / "sf"
    (sf / "rows_0-99").mkdir(parents=True)
    (sf / "rows_0-99" / "data_0.ckpt").write_text("FOREIGN\n")
    with pytest.raises(ValueError, match=r"rows_0-99/data_0.ckpt was not written by this export"):
        export_specforge(str(small), sf, layout="dflash", log=quiet)
    code, _, err = hsx_main(["export-specforge", str(small), str(sf), "--layout", "dflash", "--overwrite"])
    assert code == 1 and len(message_lines(err)) == 1 and "rows_0-99/data_0.ckpt" in err  # --overwrite too
    assert tree(sf) == {"rows_0-99/data_0.ckpt": b"FOREIGN\n"}  # nothing written, nothing deleted

    sp = tmp_path / "sp"
    (sp / "hidden_states").mkdir(parents=True)
    foreign = {"state.json": b"{}", "data-00000-of-00001.arrow": b"x", "hidden_states/hs_0.safetensors": b"y"}
    for name, blob in foreign.items():
        (sp / name).write_bytes(blob)
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="data-00000-of-00001.arrow was not written by this export"):
            export_speculators(str(small), sp, overwrite=overwrite, log=quiet)
    assert tree(sp) == foreign

    secret = tmp_path / "secret"
    secret.write_text("keep")
    linked = tmp_path / "linked"
    export_specforge(str(small), linked, layout="dflash", log=quiet)
    link = next(linked.glob("rows_*")) / "data_99.ckpt"
    link.symlink_to(secret)
    for overwrite in (False, True):  # a link is never followed, adopted or deleted
        with pytest.raises(ValueError, match="was not written by this export"):
            export_specforge(str(small), linked, layout="dflash", overwrite=overwrite, log=quiet)
    assert secret.read_text() == "keep" and link.is_symlink()


def test_an_export_refuses_a_recorded_file_that_changed(small, tmp_path):
    import json
    import shutil

    dest = tmp_path / "sf"
    export_specforge(str(small), dest, layout="dflash", log=quiet)
    other = tmp_path / "other"  # the same rows, another job
    shutil.copytree(small, other)
    info = json.loads((other / "hsx.json").read_text())
    (other / "hsx.json").write_text(json.dumps({**info, "fingerprint": "another-job"}))
    code, _, err = hsx_main(["export-specforge", str(other), str(dest), "--layout", "dflash"])
    assert code == 1 and len(message_lines(err)) == 1 and "another job's output" in err
    victim = sorted(dest.rglob("*.ckpt"))[0]
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    victim.write_bytes(bytes(blob))  # the same size, other bytes
    for overwrite in (False, True):  # neither resumed over nor deleted: it is no longer what hsx wrote
        with pytest.raises(ValueError, match=f"{victim.parent.name}/{victim.name} is not the file this export"):
            export_specforge(str(small), dest, layout="dflash", overwrite=overwrite, log=quiet)
    assert victim.exists()
    victim.unlink()  # deleted: written again
    assert export_specforge(str(small), dest, layout="dflash", log=quiet)["written"] == 1


def test_an_interrupted_export_resumes_from_what_it_can_prove(small, tmp_path, monkeypatch):
    """A kill at any point (here: before the 2nd sample file's rename) leaves temporary files hsx recognises and
    removes, and recorded files it verifies and keeps; the resumed export equals an uninterrupted one, byte for
    byte."""
    import hsx.export as export

    whole_sf, whole_sp = tmp_path / "whole-sf", tmp_path / "whole-sp"
    export_specforge(str(small), whole_sf, layout="dflash", log=quiet)
    export_speculators(str(small), whole_sp, log=quiet)
    for name, run, whole in (("sf", lambda d: export_specforge(str(small), d, layout="dflash", log=quiet), whole_sf),
                             ("sp", lambda d: export_speculators(str(small), d, log=quiet), whole_sp)):
        dest = tmp_path / name
        real, calls = os.replace, []

        def dies(src, dst, real=real, calls=calls):
            calls.append(dst)
            if len([c for c in calls if Path(c).suffix in (".ckpt", ".safetensors")]) == 2:
                raise KeyboardInterrupt  # as a kill would, between two renames
            real(src, dst)

        monkeypatch.setattr(export.os, "replace", dies)
        with pytest.raises(KeyboardInterrupt):
            run(dest)
        monkeypatch.setattr(export.os, "replace", real)
        assert any(p.name.startswith(".hsx-") for p in dest.rglob("*"))  # temporary files of the killed run
        res = run(dest)
        assert res["kept"] > 0 and res["written"] > 0
        assert not any(p.name.startswith(".hsx-") for p in dest.rglob("*"))
        assert exported(dest) == exported(whole)


def test_exported_files_follow_the_umask(small, tmp_path):
    old = os.umask(0o002)
    try:
        export_speculators(str(small), tmp_path / "sp", log=quiet)
        export_specforge(str(small), tmp_path / "sf", layout="dflash", log=quiet)
    finally:
        os.umask(old)
    modes = {p.stat().st_mode & 0o777 for p in [*(tmp_path / "sp").rglob("*.safetensors"),
                                                  *(tmp_path / "sf").rglob("*.ckpt")]}
    assert modes == {0o664}


def test_speculators_config_names_the_model_from_anywhere(small, model4, tmp_path):
    """hsx.json's `model` is relative here; speculators.yaml's verifier must work from any directory."""
    import yaml

    export_speculators(str(small), tmp_path / "sp", log=quiet)
    cfg = yaml.safe_load((tmp_path / "sp" / "speculators.yaml").read_text())
    assert cfg["train"]["verifier"]["verifier_name_or_path"] == str(model4.path.resolve())


def test_every_reader_of_an_output_an_export_used_up_is_told_where_its_rows_went(small, tmp_path):
    """hsx.load suggested allow_incomplete=True, which then failed; load_dataset raised FileNotFoundError for the
    first deleted unit (the card still listed them); a rerun of the finished export said it deleted them again."""
    import shutil

    from datasets import load_dataset

    from hsx.errors import HsxError

    out, dest, said = tmp_path / "out", tmp_path / "moved", []
    shutil.copytree(small, out)
    units = len(list((out / "data").glob("train-*.arrow")))
    export_specforge(str(out), dest, layout="dflash", delete_source=True, log=said.append)
    assert said[-1].count(f"; deleted {units} source unit(s)") == 1
    for incomplete in (False, True):
        with pytest.raises(HsxError) as e:
            hsx_load(out, allow_incomplete=incomplete)
        assert str(dest.resolve()) in str(e.value) and "no file of it is left here" in str(e.value)
        assert "allow_incomplete" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="EXPORTED-and-deleted-the-rows-are-in-the-export-see-README"):
        load_dataset(str(out), split="train")
    card = (out / "README.md").read_text()
    assert f"{units} of the {units} files" in card and str(dest.resolve()) in card and "train-" not in card
    export_specforge(str(out), dest, layout="dflash", delete_source=True, log=said.append)
    assert f"; deleted 0 source unit(s) ({units} deleted by an earlier run)" in said[-1]


@pytest.mark.parametrize("trainer", ["specforge", "speculators"])
def test_delete_source_costs_no_second_copy(small, tmp_path, monkeypatch, trainer):
    """--delete-source: each unit is deleted once its exported files are committed, so DEST and OUT never hold
    more than one unit twice; interrupted, it resumes; the files equal a plain export's, byte for byte."""
    import shutil

    import hsx.export as export

    def run(dest, out, **kw):
        if trainer == "specforge":
            return export_specforge(str(out), dest, layout="dflash", log=quiet, **kw)
        return export_speculators(str(out), dest, log=quiet, **kw)

    run(tmp_path / "plain", small)
    out = tmp_path / "out"
    shutil.copytree(small, out)
    units = sorted((out / "data").glob("train-*.arrow"))
    real, seen = export.Dest.release, []

    def release_then_die(self, unit, *args):
        seen.append({p.name for p in (out / "data").glob("train-*.arrow")})
        real(self, unit, *args)
        if len(seen) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(export.Dest, "release", release_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "moved", out, delete_source=True)
    assert len(list((out / "data").glob("train-*.arrow"))) == len(units) - 1
    from hsx.errors import HsxError

    with pytest.raises(HsxError, match=f"allow_incomplete=True\\) reads the {len(units) - 1} files left"):
        hsx_load(out)  # part used up: the rest is there to read, as it says
    assert len(hsx_load(out, allow_incomplete=True)) > 0
    with pytest.raises(ValueError, match="deleted"):  # its source is going: an overwrite cannot redo it
        run(tmp_path / "moved", out, delete_source=True, overwrite=True)
    res = run(tmp_path / "moved", out, delete_source=True)
    assert res["released"] == len(units) and not list((out / "data").glob("train-*.arrow"))
    assert [len(s) for s in seen] == list(range(len(units), 0, -1))  # one unit released at a time
    assert exported(tmp_path / "moved") == exported(tmp_path / "plain")
    with pytest.raises(ValueError, match="another export"):  # the record names its options
        run(tmp_path / "moved", small)
