"""A model or tokenizer (a folder or a Hub id) is checked before transformers reads it (hsx.target.checkpoint):
config.json, the checkpoint index and every file a tokenizer reader opens are bounded in size, by stat in a folder
and by the Hub's listing before a download; a config that does not build the model is one line naming the key;
verify and bench resolve a model as extract does."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import fault_argv, hsx_main, message_lines, the_error_line

import hsx.target.model
from hsx.target import checkpoint
from hsx.config import ExtractConfig, HsxError


# ---- config.json and the checkpoint index: bounded before they are parsed ------------------------------------------

def _sparse(path: Path, size: int) -> Path:
    """A file of `size` bytes that takes no disk (a hostile folder's can be many GB)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def _cfg(model: str, **extra) -> ExtractConfig:
    return ExtractConfig(model=model, dataset="d", layers=[1], output_dir="o", dtype="float32", **extra)


def _big_json(path: Path, size: int, obj: dict) -> None:
    """A valid JSON object of at least `size` bytes (its padding in one key)."""
    path.write_text(json.dumps({**obj, "padding": "x" * size}))


@pytest.mark.parametrize("name,bound", [("config.json", "MAX_CONFIG_BYTES"),
                                        ("model.safetensors.index.json", "MAX_INDEX_BYTES")])
def test_a_model_folder_json_past_its_bound_is_refused_before_it_is_parsed(model4, tmp_path, monkeypatch, name,
                                                                            bound):
    """config.json and model.safetensors.index.json were read whole, whatever their size (json.loads of 1 GB of
    `[[],...]` takes ~20 GB): past a bound far above any real one, one line naming the file, nothing parsed."""
    model = Path(shutil.copytree(model4.path, tmp_path / "model"))
    monkeypatch.setattr(checkpoint, bound, 1 << 20)
    if name == "config.json":
        _big_json(model / name, 2 << 20, json.loads((model / name).read_text()))
    else:
        _big_json(model / name, 2 << 20, {"metadata": {}, "weight_map": {}})
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(checkpoint.json, "loads", lambda s, *a, **k: parsed.append(len(s)) or real_loads(s, *a, **k))
    cfg = _cfg(str(model))
    with pytest.raises(HsxError, match=re.escape(str(model / name)) + r" is [\d,]+ bytes, more than any"):
        hsx.target.model.load_model(cfg, __import__("torch").device("cpu"))
    assert not [n for n in parsed if n > 1 << 20]


def test_a_model_folder_json_that_is_not_a_file_is_one_line(model4, tmp_path):
    model = Path(shutil.copytree(model4.path, tmp_path / "model"))
    (model / "model.safetensors.index.json").unlink(missing_ok=True)
    os.mkfifo(model / "model.safetensors.index.json")  # (read, it would wait forever)
    cfg = _cfg(str(model))
    with pytest.raises(HsxError, match="model.safetensors.index.json is not a regular file"):
        hsx.target.model.load_model(cfg, __import__("torch").device("cpu"))


def test_real_sized_model_jsons_are_within_the_bounds():
    from hsx.target.checkpoint import MAX_CHECKPOINT_TENSORS, MAX_CONFIG_BYTES, MAX_INDEX_BYTES

    name = "model.language_model.layers.60.mlp.experts.383.down_proj.weight_scale_inv"
    entry = json.dumps({name: "model-01999-of-02000.safetensors"})
    assert MAX_INDEX_BYTES >= MAX_CHECKPOINT_TENSORS * len(entry) and MAX_CONFIG_BYTES >= 1 << 20


def test_a_hub_ids_config_json_is_bounded_too(tmp_path, monkeypatch):
    """A Hub id's config.json (what `hsx plan` and the benchmark read by id) is checked in the HF cache before
    transformers parses it, as a folder's is."""
    import huggingface_hub

    snapshot = tmp_path / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    _big_json(snapshot / "config.json", 2 << 20, {"model_type": "llama", "num_hidden_layers": 2})
    monkeypatch.setattr(checkpoint, "MAX_CONFIG_BYTES", 1 << 20)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name, **k: str(snapshot / name))
    with pytest.raises(HsxError, match=re.escape(str(snapshot / "config.json")) + " is [\\d,]+ bytes, more than any"):
        hsx.target.model.read_model_config("someone/model", "someone/model", False)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 10**11}))
    with pytest.raises(HsxError, match="num_hidden_layers = 100000000000"):
        hsx.target.model.read_model_config("someone/model", "someone/model", False)


@pytest.mark.parametrize("case", ["config_deep", "tokenizer_deep", "layers_huge"])
def test_a_deeply_nested_or_impossibly_deep_model_is_one_line(tmp_path, model4, small_chat_path, case):
    """A config.json or tokenizer.json nested 200,000 deep (a RecursionError in the parser), or a config.json saying
    99,999,999,999 layers (transformers builds a per-layer list first, and never returns), is one line."""
    import subprocess
    import sys

    from helpers import child_env

    model = Path(shutil.copytree(model4.path, tmp_path / "model"))
    deep = '{"a": ' + "[" * 200_000 + "]" * 200_000 + "}"
    if case == "config_deep":
        (model / "config.json").write_text(deep)
    elif case == "tokenizer_deep":
        (model / "tokenizer.json").write_text(deep)
    else:
        config = json.loads((model / "config.json").read_text())
        config.pop("layer_types", None)
        config["num_hidden_layers"] = 99_999_999_999
        (model / "config.json").write_text(json.dumps(config))
    argv = [sys.executable, "-m", "hsx", *fault_argv(model, small_chat_path, tmp_path / "out")]
    res = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.startswith("hsx: error: ")]
    assert len(lines) == 1, res.stderr[-2000:]


@pytest.mark.parametrize("case", ["hidden_size_str", "layer_types_short", "hidden_act_unknown"])
def test_a_config_that_does_not_build_the_model_is_one_line_naming_the_key(tmp_path, model4, small_chat_path,
                                                                             case):
    """transformers' validation error is reported with its why, not cut to its first line ('Validation error for
    field ...:'); an unknown hidden_act is one line, not a KeyError traceback."""
    model = Path(shutil.copytree(model4.path, tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    if case == "hidden_size_str":
        config["hidden_size"], needle = "x", "expected int"
    elif case == "layer_types_short":
        config["layer_types"], needle = ["full_attention"], "must be equal to the number of `layer_types`"
    else:
        config["hidden_act"], needle = "nope", "KeyError: 'nope'"
    (model / "config.json").write_text(json.dumps(config))
    rc, _, err = hsx_main(fault_argv(model, small_chat_path, tmp_path / "o"))
    line = the_error_line(err)
    assert rc == 1 and needle in line, line


# ---- a model folder's tokenizer files and small configs: bounded before transformers opens them --------------------

@pytest.mark.parametrize("name,bound", [
    ("tokenizer.json", "MAX_TOKENIZER_BYTES"), ("tokenizer_config.json", "MAX_TOKENIZER_BYTES"),
    ("spm.model", "MAX_TOKENIZER_BYTES"), ("merges.txt", "MAX_TOKENIZER_BYTES"),
    ("chat_template.jinja", "MAX_CONFIG_BYTES"), ("generation_config.json", "MAX_CONFIG_BYTES"),
    ("special_tokens_map.json", "MAX_CONFIG_BYTES"), ("additional_chat_templates/tool_use.jinja", "MAX_CONFIG_BYTES"),
])
def test_a_tokenizer_file_past_its_bound_is_one_line_before_transformers_reads_it(model4, tmp_path, monkeypatch,
                                                                                   name, bound):
    """Nothing bounded these: a folder's 20 GB tokenizer.json was read whole inside transformers (a memory blow-up,
    not one line). Each is stat'ed first; the bound is generous (512 MB for vocabulary-sized files, 16 MB for
    configs and templates), so the files here are sparse."""
    import transformers

    from hsx.job import _tokenizer

    model = Path(shutil.copytree(model4.path, tmp_path / "model"))
    limit = getattr(checkpoint, bound)
    _sparse(model / name, limit + 1)
    opened = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: opened.append(a))
    with pytest.raises(HsxError, match=re.escape(f"{model / name} is {limit + 1:,} bytes, more than any "
                                                 f"{Path(name).name} is ({limit:,} at most)")):
        _tokenizer(_cfg(str(model)), str(model))
    assert not opened
    _sparse(model / name, limit)  # (at the bound: handed to transformers)
    _tokenizer(_cfg(str(model)), str(model))
    assert len(opened) == 1


def test_an_oversize_tokenizer_is_one_error_line_from_the_command_line(model4, small_chat_path, tmp_path):
    model = Path(shutil.copytree(model4.path, tmp_path / "model"))
    _sparse(model / "tokenizer.json", (512 << 20) + 1)
    rc, _, err = hsx_main(fault_argv(model, small_chat_path, tmp_path / "out"))
    assert rc != 0 and "Traceback" not in err, err[-2000:]
    errors = [line for line in message_lines(err) if line.startswith("hsx: error: ")]
    assert len(errors) == 1 and "tokenizer.json is 536,870,913 bytes, more than any tokenizer.json" in errors[0]


def test_a_tokenizer_file_linked_out_of_the_folder_counts_at_its_target_size(model4, tmp_path, monkeypatch):
    """Links are followed (a Hub snapshot's files are links into the cache's blobs), so a link is bounded by what
    transformers would read through it; a link to a fifo (which a read would wait on forever) is refused."""
    import transformers

    from hsx.job import _tokenizer

    model = Path(shutil.copytree(model4.path, tmp_path / "model"))
    big = _sparse(tmp_path / "elsewhere" / "blob", checkpoint.MAX_TOKENIZER_BYTES + 1)
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to(big)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("opened"))
    with pytest.raises(HsxError, match=re.escape(str(model / "tokenizer.json")) + r" is 536,870,913 bytes"):
        _tokenizer(_cfg(str(model)), str(model))
    os.mkfifo(tmp_path / "elsewhere" / "fifo")
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to(tmp_path / "elsewhere" / "fifo")
    with pytest.raises(HsxError, match="tokenizer.json is not a regular file"):
        _tokenizer(_cfg(str(model)), str(model))


def test_a_separate_tokenizer_folder_is_bounded_too(model4, tmp_path, monkeypatch):
    """--tokenizer: its folder's files are what transformers reads, not the model's."""
    import transformers

    from hsx.job import _tokenizer

    tok = Path(shutil.copytree(model4.path, tmp_path / "tok"))
    _sparse(tok / "vocab.json", checkpoint.MAX_TOKENIZER_BYTES + 1)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("opened"))
    with pytest.raises(HsxError, match=re.escape(str(tok / "vocab.json")) + " is 536,870,913 bytes"):
        _tokenizer(_cfg(str(model4.path), tokenizer=str(tok)), str(model4.path))


def test_the_plans_offline_tokenizer_from_the_hf_cache_is_bounded(model4, tmp_path, monkeypatch):
    """`hsx plan` reads a Hub id's tokenizer from the HF cache only: the cached snapshot's files are bounded."""
    import huggingface_hub

    from hsx.cost import _offline_tokenizer

    snapshot = Path(shutil.copytree(model4.path, tmp_path / "snapshots" / ("a" * 40)))
    _sparse(snapshot / "tokenizer.json", checkpoint.MAX_TOKENIZER_BYTES + 1)
    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, **k: asked.append((repo, k)) or str(snapshot))
    with pytest.raises(HsxError, match=re.escape(str(snapshot / "tokenizer.json")) + " is 536,870,913 bytes"):
        _offline_tokenizer(_cfg("someone/model", revision="v1"))
    assert asked == [("someone/model", {"revision": "v1", "local_files_only": True})]


def test_real_sized_tokenizer_files_are_within_the_bounds():
    from hsx.target.checkpoint import MAX_CONFIG_BYTES, MAX_TOKENIZER_BYTES, model_file_limit

    assert MAX_TOKENIZER_BYTES >= 10 * (35 << 20) and MAX_CONFIG_BYTES >= 100 * (100 << 10)
    assert model_file_limit("tokenizer.json") == MAX_TOKENIZER_BYTES
    assert model_file_limit("tiktoken.model") == model_file_limit("qwen.tiktoken") == MAX_TOKENIZER_BYTES
    assert model_file_limit("additional_chat_templates/rag.jinja") == MAX_CONFIG_BYTES
    assert model_file_limit("model-00001-of-00002.safetensors") is None


def test_a_folders_files_of_any_name_are_bounded_and_its_weights_and_subfolders_are_not(model4, tmp_path,
                                                                                        monkeypatch):
    import transformers

    from hsx.job import _tokenizer

    tok = Path(shutil.copytree(model4.path, tmp_path / "tok"))
    _sparse(tok / "source.spm", checkpoint.MAX_TOKENIZER_BYTES + 1)
    opened = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: opened.append(a))
    cfg = _cfg(str(model4.path), tokenizer=str(tok))
    with pytest.raises(HsxError, match=re.escape(str(tok / "source.spm")) + " is 536,870,913 bytes"):
        _tokenizer(cfg, str(model4.path))
    (tok / "source.spm").unlink()
    _sparse(tok / "pytorch_model.bin", checkpoint.MAX_TOKENIZER_BYTES + 1)
    _sparse(tok / "original" / "big.txt", checkpoint.MAX_TOKENIZER_BYTES + 1)  # (transformers reads the top level)
    _sparse(tok / "backup.tar", checkpoint.MAX_TOKENIZER_BYTES + 1)  # (no reader opens it: not refused for it)
    (tok / "loop.json").symlink_to(tok / "loop.json")  # (cannot be stat'ed: said, not a way to skip the others)
    with pytest.raises(HsxError, match=re.escape(f"cannot read {tok / 'loop.json'}")):
        _tokenizer(cfg, str(model4.path))
    (tok / "loop.json").unlink()
    _tokenizer(cfg, str(model4.path))
    assert len(opened) == 1
    assert checkpoint.model_file_limit("sub/tokenizer.json") == checkpoint.MAX_TOKENIZER_BYTES
    assert checkpoint.model_file_limit("model.safetensors.index.json") == checkpoint.MAX_INDEX_BYTES
    assert checkpoint.model_file_limit("Model.SafeTensors") is checkpoint.model_file_limit("x/y.gguf") is None
    assert checkpoint.model_file_limit("data.parquet") is checkpoint.model_file_limit("README.md") is None
    assert checkpoint.model_file_limit("vocab.bpe") == checkpoint.model_file_limit("Tokenizer.MODEL") == (
        checkpoint.MAX_TOKENIZER_BYTES)


# ---- a Hub id: sizes asked before anything is downloaded -----------------------------------------------------------

class FakeHub:
    """HfApi's metadata calls, from a dict of path -> size (None: a folder); `fail`: what listing raises (True:
    OSError)."""

    def __init__(self, sizes: dict[str, int | None], fail: bool | BaseException = False):
        self.sizes, self.fail, self.calls = sizes, fail, []

    def _entry(self, path: str):
        size = self.sizes[path]
        return SimpleNamespace(path=path) if size is None else SimpleNamespace(path=path, size=size, lfs=None)

    def get_paths_info(self, repo_id, paths, **kw):
        self.calls.append(("get_paths_info", repo_id, list(paths), kw.get("revision")))
        return [self._entry(p) for p in paths if p in self.sizes]

    def list_repo_tree(self, repo_id, path_in_repo=None, *, recursive=False, **kw):
        self.calls.append(("list_repo_tree", repo_id, path_in_repo, recursive, kw.get("revision")))
        if self.fail:
            raise OSError("no network") if self.fail is True else self.fail
        prefix = f"{path_in_repo}/" if path_in_repo else ""
        return [self._entry(p) for p in self.sizes
                if p.startswith(prefix) and (recursive or "/" not in p[len(prefix):])]


@pytest.fixture
def online(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def use(hub: FakeHub) -> list:
        monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: hub)
        downloads: list = []
        monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: downloads.append(a) or "/none")
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: downloads.append(a) or "/none/x")
        return downloads

    return use


def test_a_hub_ids_config_json_size_is_asked_before_it_is_downloaded(online):
    """It was checked only once downloaded into the HF cache: a 40 GB config.json filled the disk first."""
    hub = FakeHub({"config.json": checkpoint.MAX_CONFIG_BYTES + 1})
    downloads = online(hub)
    with pytest.raises(HsxError, match=re.escape(
            f"someone/model: its config.json on the Hub is {checkpoint.MAX_CONFIG_BYTES + 1:,} bytes, more than any "
            f"config.json is ({checkpoint.MAX_CONFIG_BYTES:,} at most); not downloaded")):
        hsx.target.model.read_model_config("someone/model", "someone/model", False, "v2")
    assert hub.calls == [("get_paths_info", "someone/model", ["config.json"], "v2")] and downloads == []


def test_a_hub_model_with_an_oversize_tokenizer_file_is_refused_before_its_snapshot_is_downloaded(online):
    hub = FakeHub({"config.json": 700, "model.safetensors": 50 << 30, "tokenizer.json": 600 << 20})
    downloads = online(hub)
    with pytest.raises(HsxError, match=r"someone/model: its tokenizer.json on the Hub is 629,145,600 bytes, more "
                                       r"than any tokenizer.json is \(536,870,912 at most\); not downloaded"):
        hsx.target.model.resolve_model_path("someone/model", "v2", False)
    assert downloads == [] and hub.calls == [("list_repo_tree", "someone/model", None, True, "v2")]
    hub.sizes["tokenizer.json"] = 30 << 20  # (real-sized; the 50 GB of weights are not bounded here)
    assert hsx.target.model.resolve_model_path("someone/model", "v2", False) == ("/none", "none")
    assert downloads == [("someone/model",)]
    hub.sizes["tokenizer.json"], hub.fail = 600 << 20, True  # no metadata: the download says why, if it fails
    hsx.target.model.resolve_model_path("someone/model", "v2", False)
    assert len(downloads) == 2


def test_a_hub_tokenizers_templates_folder_is_asked_too(online, monkeypatch):
    """--tokenizer as a Hub id: transformers downloads and reads it in one go, so only the Hub's sizes can bound it;
    the additional_chat_templates/ folder's templates are in the listing, which is recursive."""
    import transformers

    from hsx.job import _tokenizer

    hub = FakeHub({"tokenizer.json": 9 << 20, "additional_chat_templates": None,
                   "additional_chat_templates/tool_use.jinja": 20 << 20})
    online(hub)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("opened"))
    with pytest.raises(HsxError, match="someone/tok: its additional_chat_templates/tool_use.jinja on the Hub is "
                                       "20,971,520 bytes, more than any tool_use.jinja is"):
        _tokenizer(_cfg("someone/model", tokenizer="someone/tok"), "/unused")
    assert hub.calls == [("list_repo_tree", "someone/tok", None, True, None)]  # (one listing, every folder's)


def test_a_hub_tokenizers_files_of_any_name_are_bounded_before_download(online, monkeypatch):
    """A tokenizer class reads files of its own names (bpe.codes, source.spm, emoji.json, ...), which transformers
    fetched unchecked: every file of the repo a reader opens as text (READABLE_SUFFIXES), at any depth, is held to
    MAX_TOKENIZER_BYTES; weights, code, data and archives are not (a repo is not refused for a large one)."""
    import transformers

    from hsx.job import _tokenizer

    big = checkpoint.MAX_TOKENIZER_BYTES + 1
    hub = FakeHub({"tokenizer.json": 9 << 20, "bpe.codes": big, "model.safetensors": 50 << 30,
                   "pytorch_model.bin": 50 << 30, "original": None, "original/consolidated.00.pth": 50 << 30,
                   "tokenization_mine.py": 1 << 10, "train.parquet": 4 << 30, "images/plot.png": big,
                   "backup.tar": 3 << 30})
    online(hub)
    opened = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: opened.append(a))
    cfg = _cfg("someone/model", tokenizer="someone/tok")
    with pytest.raises(HsxError, match=f"someone/tok: its bpe.codes on the Hub is {big:,} bytes, more than any "
                                       f"bpe.codes is \\({checkpoint.MAX_TOKENIZER_BYTES:,} at most\\); not downloaded"):
        _tokenizer(cfg, "/unused")
    hub.sizes.update({"bpe.codes": 1 << 20, "original/notes.txt": big})  # (a download's patterns match any depth)
    with pytest.raises(HsxError, match="its original/notes.txt on the Hub is"):
        _tokenizer(cfg, "/unused")
    del hub.sizes["original/notes.txt"]
    _tokenizer(cfg, "/unused")  # (weights, code, data and archives are no tokenizer's to bound)
    assert opened == [("someone/tok",)]


def _client_error(name: str, *args, **kwargs) -> BaseException:
    """An error of the HTTP client huggingface_hub uses (httpx, or the module its errors import)."""
    import importlib

    from huggingface_hub import errors

    return getattr(importlib.import_module(errors.HTTPError.__module__.split(".")[0]), name)(*args, **kwargs)


def test_the_hub_listing_skips_only_when_the_hub_cannot_say(online):
    """Any exception of the listing was taken as "the Hub cannot say" and the check skipped: a bug in hsx (or in a
    huggingface_hub it misreads) silently dropped the bound. HTTP, connection and OS errors still skip (the
    download says why); anything else is raised."""
    from huggingface_hub.errors import HfHubHTTPError

    request = _client_error("Request", "GET", "https://huggingface.co/api/models/someone/model/tree/main")
    response = _client_error("Response", 404, request=request)
    hub = FakeHub({"tokenizer.json": 600 << 20})
    downloads = online(hub)
    for unreachable in (HfHubHTTPError("404 Client Error", response=response),
                        _client_error("ConnectError", "connection refused"), OSError("no network")):
        hub.fail = unreachable
        hsx.target.model.resolve_model_path("someone/model", None, False)
    assert len(downloads) == 3
    hub.fail = TypeError("list_repo_tree() got an unexpected keyword argument 'recursive'")
    with pytest.raises(TypeError, match="unexpected keyword"):
        hsx.target.model.resolve_model_path("someone/model", None, False)
    assert len(downloads) == 3


# ---- verify and bench load a model as extract does: its files bounded first ----------------------------------------

def _bench_argv(model: str) -> list[str]:
    return ["bench", "--model", model, "--layers", "1", "--count", "4", "--max-length", "64", "--skip", "a,b",
            "--storage-gb", "0", "--compile", "off"]


@pytest.mark.parametrize("command", ["verify", "bench"])
def test_verify_and_bench_bound_a_model_folders_files_before_transformers_loads_it(command, finished, model4,
                                                                                     tmp_path, monkeypatch):
    """`hsx verify --model` and `hsx bench --model` handed the folder to from_pretrained unchecked: a 16 MB+
    generation_config.json (or tokenizer.json, ...) and a config.json hsx refuses were read inside transformers.
    Both resolve the model as extract does (resolve_model_path, read_model_config) before it loads anything."""
    import transformers

    model = Path(shutil.copytree(model4.path, tmp_path / "model"))
    _sparse(model / "generation_config.json", checkpoint.MAX_CONFIG_BYTES + 1)
    for auto in (transformers.AutoModel, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(auto, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    argv = ["verify", str(finished), "--samples", "2", "--model", str(model)] if command == "verify" else \
        _bench_argv(str(model))
    rc, _, err = hsx_main(argv)
    errors = message_lines(err)
    assert rc == 1 and len(errors) == 1, err[-2000:]
    assert errors[0].startswith("hsx: error: ") and (
        f"generation_config.json is {checkpoint.MAX_CONFIG_BYTES + 1:,} bytes, more than any") in errors[0], errors
    (model / "generation_config.json").unlink()
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 0}))
    rc, _, err = hsx_main(argv)
    assert rc == 1 and "num_hidden_layers = 0; hsx takes models of 1 to 10,000" in err, err[-2000:]


def test_verify_asks_a_hub_models_sizes_before_it_is_downloaded(finished, online, monkeypatch):
    import transformers

    hub = FakeHub({"config.json": 700, "model.safetensors": 50 << 30, "tokenizer.json": 600 << 20})
    downloads = online(hub)
    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    rc, _, err = hsx_main(["verify", str(finished), "--samples", "2", "--model", "someone/model"])
    assert rc == 1 and "someone/model: its tokenizer.json on the Hub is 629,145,600 bytes" in err, err[-2000:]
    assert downloads == [] and hub.calls == [("list_repo_tree", "someone/model", None, True, None)]
