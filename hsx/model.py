"""Load the target model cut after the deepest layer we need: base model only, no lm_head, no KV cache.

Only the first `max(layers) + 1` decoder layers are built and read from disk (all of them, plus the final norm,
when the final-norm state is asked for). Without lm_head and the cache, a Qwen3-8B-shaped batch of 64 fits where
the full CausalLM ran out of memory on 65 GiB of logits alone (on an H200). Weights are read from
safetensors only, never unpickled; remote code runs only when asked.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import os
import re
import signal
import stat
import sys
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from hsx import attention, fp8, gdn, kernels
from hsx.config import ExtractConfig, HsxError, layers_run, target_layers
from hsx.errors import one_line
from hsx.schema import OutputFormat

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


@dataclass
class LoadedModel:
    base: torch.nn.Module  # the decoder stack (XModel), truncated
    layers: list[int]  # resolved, sorted
    final_hidden: bool
    num_model_layers: int  # depth of the full model
    depth: int  # decoder layers that run
    hidden_size: int
    model_path: str
    revision: str | None
    text_config: Any  # the truncated config that was built
    lm_head: torch.Tensor | None = None  # (vocab, hidden) output projection, only for top-k target logits


HUB_COMMIT = re.compile(r"[0-9a-f]{40}")  # a Hub snapshot's folder name: the commit it holds, as job.json records it


def resolve_model_path(model: str, revision: str | None, trust_remote_code: bool) -> tuple[str, str | None]:
    """A local folder and the commit hash it holds (None for a plain local folder). Every command that hands a
    model to transformers' from_pretrained resolves it here first: the files a reader opens as text are bounded
    (`check_model_files`: a folder's stat'ed, a Hub id's sizes asked before anything is downloaded)."""
    check_model_files(model, revision)
    if Path(model).is_dir():
        return str(Path(model).resolve()), revision
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = WEIGHT_PATTERNS + (["*.py"] if trust_remote_code else [])
    try:
        path = snapshot_download(model, revision=revision, allow_patterns=patterns)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        raise HsxError(f"cannot get model {model!r} (revision {revision or 'main'}): {str(e).splitlines()[0]}") \
            from None
    return path, Path(path).name  # snapshots/<commit hash>


def read_model_config(source: str, name: str, trust_remote_code: bool, revision: str | None = None):
    """A model's config (AutoConfig) from a folder, or a Hub id's (from the HF cache when offline); what cannot
    be read is one HsxError naming the model as the user gave it (`name`)."""
    import huggingface_hub.errors
    from transformers import AutoConfig

    # transformers 5 validates configs as huggingface_hub strict dataclasses (e.g. layer_types' length against
    # num_hidden_layers), raising its own error class, not a ValueError
    invalid = getattr(huggingface_hub.errors, "StrictDataclassError", ValueError)
    _check_layer_count(Path(source) / "config.json" if Path(source).is_dir() else _hub_config(source, revision), name)
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code,
                                          **({"revision": revision} if revision else {}))
    # (RecursionError: JSON nested too deeply; TypeError, AttributeError: a field of the wrong JSON type, such as
    # a quantization_config that is a list, which transformers' config classes take for what they expect)
    except (OSError, ValueError, KeyError, RecursionError, TypeError, AttributeError, invalid) as e:
        raise HsxError(f"cannot read the config of model {name!r}: {one_line(e)}") from None


MAX_MODEL_LAYERS = 10_000  # the deepest released LMs have ~200; a config past this is damaged or hostile
# The JSON files hsx reads from a model folder, refused past these sizes before it or transformers parses them
# (parsed whole, 1 GB of JSON such as `[[],[],...]` is ~20 GB of Python objects). Real ones are far smaller:
MAX_CONFIG_BYTES = 16 << 20  # config.json: a few KB, a vision-language model's (text and vision configs) < 1 MB
MAX_CHECKPOINT_TENSORS = 1_000_000  # tensors one checkpoint lists: the largest released (1T-parameter MoEs with
# FP8 scales, thousands of shards) list ~10^5
INDEX_ENTRY_BYTES = 160  # a tensor's entry in model.safetensors.index.json: its name and its shard (~100 bytes)
MAX_INDEX_BYTES = MAX_CHECKPOINT_TENSORS * INDEX_ENTRY_BYTES + (1 << 20)  # 161 MB (with its metadata)
CHECKPOINT_INDEX = "model.safetensors.index.json"


def check_model_file(path: Path, limit: int) -> bool:
    """Whether a file of a model folder is there (False when it is not): HsxError in one line naming it when it
    is not a regular file or over `limit` bytes. Links are followed (a Hub snapshot's files are links to the
    cache's blobs)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    except OSError as e:
        raise HsxError(f"cannot read {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise HsxError(f"{_shown(str(path))} is not a regular file; the model folder is damaged")
    if st.st_size > limit:
        raise HsxError(f"{_shown(str(path))} is {st.st_size:,} bytes, more than any {_shown(path.name)} is "
                       f"({limit:,} at most); the model folder is damaged or not a model's")
    return True


def _shown(name: str) -> str:
    """A file name as one printable line (a folder's or a Hub repo's names are read, not chosen)."""
    return name if name.isprintable() else ascii(name)


def read_model_json(path: Path, limit: int) -> bytes | None:
    """The bytes of a JSON file of a model folder (None when there is none), checked by `check_model_file`."""
    if not check_model_file(path, limit):
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise HsxError(f"cannot read {path}: {e.strerror or e}") from None
    if len(data) > limit:  # (it grew since the stat)
        raise HsxError(f"{path} is more than {limit:,} bytes, more than any {path.name} is; the model folder is "
                       "damaged or not a model's")
    return data


def _hub_config(repo: str, revision: str | None) -> Path | None:
    """A Hub id's config.json in the HF cache (fetched as transformers would), so it is checked before it is
    parsed; None where there is none (transformers' own reading then says why). Its size is asked first: one
    past MAX_CONFIG_BYTES is refused, not downloaded (offline, the cache's copy is bounded as it is read)."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if not constants.HF_HUB_OFFLINE:
        _refuse_oversize_on_hub(repo, _hub_entries(
            lambda api: api.get_paths_info(repo, ["config.json"], revision=revision)))
    try:
        return Path(hf_hub_download(repo, "config.json", revision=revision))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError):
        return None


# The other files transformers reads from a model folder (or a tokenizer's) before any weight, bounded before it
# opens them: a hostile folder's 50 GB tokenizer.json is a memory blow-up inside transformers, not one line. Two
# kinds of bound, each far above real files. Vocabulary-sized files: a tokenizer.json is 2-35 MB (Gemma 3's 262k
# tokens: 33 MB), a sentencepiece tokenizer.model a few MB (Gemma 3's: 4.7 MB), vocab.json and merges.txt a few MB;
# tokenizer_config.json and added_tokens.json may list every added token (Gemma 3's: 1.2 MB).
MAX_TOKENIZER_BYTES = 512 << 20
# Config-sized, held to MAX_CONFIG_BYTES: generation_config.json is ~1 KB, special_tokens_map.json a few KB, a chat
# template (chat_template.jinja / .json, additional_chat_templates/*.jinja) < 100 KB.
CONFIG_SIZED = frozenset({"config.json", "generation_config.json", "special_tokens_map.json", "chat_template.jinja",
                          "chat_template.json"})
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # more named templates, one *.jinja each (transformers reads all)
# Every other file a tokenizer or config reader can open as text is held to MAX_TOKENIZER_BYTES, whatever its name:
# which files a tokenizer reads is its class's (spiece.model, bpe.codes, source.spm, entity_vocab.json, emoji.json,
# vocab.bpe, ...) and its config's to name, so no list of names covers them, while their kinds are few
# (READABLE_SUFFIXES); resolve_model_path's download patterns, which match at any depth, are among them. Other files
# (weights, code, archives, data, images, a README) are neither downloaded by hsx nor opened before the weights:
# not bounded here, so a repo or folder holding a large one is not refused for it.
READABLE_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken", ".spm", ".codes", ".vocab", ".bpe")


def model_file_limit(path: str) -> int | None:
    """The bound of a file of a model folder or Hub repo (`path` in it, '/'-separated) before transformers reads
    or downloads it; None for files no tokenizer or config reader opens as text (READABLE_SUFFIXES)."""
    folder, _, name = path.rpartition("/")
    if not name.lower().endswith(READABLE_SUFFIXES):
        return None
    if (folder == CHAT_TEMPLATE_DIR and name.endswith(".jinja")) or (not folder and name in CONFIG_SIZED):
        return MAX_CONFIG_BYTES
    if not folder and name == CHECKPOINT_INDEX:
        return MAX_INDEX_BYTES
    return MAX_TOKENIZER_BYTES


def _hub_unreachable() -> tuple[type[BaseException], ...]:
    """What a Hub call raises when the Hub cannot say (then the download that follows says why, and what it brings
    is bounded as it is read): an HTTP error (an unknown, gated or private repo or revision), the HTTP client's
    connection errors and timeouts (huggingface_hub.errors imports that client's HTTPError, their base), OSError
    (offline mode, nothing cached, sockets), a source that is not a repo id. Anything else is a bug, not hidden."""
    from huggingface_hub import errors

    return errors.HfHubHTTPError, getattr(errors, "HTTPError", OSError), OSError, errors.HFValidationError


def check_model_files(source: str, revision: str | None = None, local_files_only: bool = False) -> None:
    """HsxError in one line when a file that transformers may read from `source` (a model or tokenizer folder, or
    a Hub id) is over its bound (`model_file_limit`) or not a regular file, before transformers opens it: a
    folder's files (its top level and CHAT_TEMPLATE_DIR, where transformers reads) are stat'ed; a Hub id's sizes,
    every file of the repo, are asked of the Hub before anything is downloaded, or, offline (HF_HUB_OFFLINE,
    `local_files_only`), its snapshot in the HF cache is stat'ed."""
    if Path(source).is_dir():
        _check_folder_files(Path(source))
        return
    from huggingface_hub import constants, snapshot_download

    if constants.HF_HUB_OFFLINE or local_files_only:
        try:
            folder = snapshot_download(source, revision=revision, local_files_only=True)
        except _hub_unreachable():  # nothing cached (or not a Hub id): transformers says what is missing
            return
        _check_folder_files(Path(folder))
        return
    _refuse_oversize_on_hub(source, _hub_entries(
        lambda api: api.list_repo_tree(source, recursive=True, revision=revision)))


def _check_folder_files(folder: Path) -> None:
    for sub in ("", CHAT_TEMPLATE_DIR):
        try:
            with os.scandir(folder / sub) as entries:
                names = [e.name for e in entries if not _is_folder(e)]  # (a folder is no file transformers reads)
        except OSError:
            continue  # (no such folder: nothing transformers would read there)
        for name in names:
            limit = model_file_limit(f"{sub}/{name}" if sub else name)
            if limit is not None:
                check_model_file(folder / sub / name, limit)


def _is_folder(entry: os.DirEntry) -> bool:
    """Whether an entry is a folder, links followed (as transformers' opening would); one that cannot be stat'ed
    (a link loop) is left to check_model_file, which says why, so it cannot hide the others."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def _hub_entries(list_files) -> list:
    """What `list_files(HfApi())` lists (RepoFile-like: path, size); [] when the Hub cannot say (`_hub_unreachable`:
    the download that follows says why, and what it brings is bounded as it is read)."""
    from huggingface_hub import HfApi

    try:
        return list(list_files(HfApi()))
    except _hub_unreachable():
        return []


def _refuse_oversize_on_hub(repo: str, entries: list) -> None:
    for entry in entries:
        path = getattr(entry, "path", None)
        limit = model_file_limit(path) if isinstance(path, str) else None
        sizes = [getattr(entry, "size", None), getattr(getattr(entry, "lfs", None), "size", None)]
        size = max((s for s in sizes if type(s) is int), default=None)  # (an LFS file's: its object's)
        if limit is not None and size is not None and size > limit:
            raise HsxError(f"{repo}: its {_shown(path)} on the Hub is {size:,} bytes, more than any "
                           f"{_shown(path.rpartition('/')[2])} is ({limit:,} at most); not downloaded")


def _check_layer_count(config_file: Path | None, name: str) -> None:
    """HsxError unless a config.json (a folder's, or a Hub id's in the HF cache) is at most MAX_CONFIG_BYTES and
    its num_hidden_layers (its own, and its text_config's) is an integer in [1, MAX_MODEL_LAYERS], checked before
    transformers reads it: its config
    classes build per-layer lists (layer_types) from that count, so 99,999,999,999 never returns."""
    if config_file is None or not config_file.parent.is_dir():
        return  # (none to read: transformers says what is missing)
    data = read_model_json(config_file, MAX_CONFIG_BYTES)
    if data is None:
        return
    try:
        config = json.loads(data)
    except (ValueError, RecursionError):
        return  # (transformers' own reading says what is wrong, caught in read_model_config)
    for part in (config, config.get("text_config")) if isinstance(config, dict) else ():
        layers = part.get("num_hidden_layers") if isinstance(part, dict) else None
        if layers is not None and (type(layers) is not int or not 1 <= layers <= MAX_MODEL_LAYERS):
            raise HsxError(f"the config of model {name!r} says num_hidden_layers = {layers!r}; hsx takes models "
                           f"of 1 to {MAX_MODEL_LAYERS:,} decoder layers")


def text_config_of(config):
    """The decoder's config; for vision-language checkpoints (e.g. Qwen3.5/3.6) the text model's."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def truncated_config(text_config, depth: int):
    cfg = copy.deepcopy(text_config)
    cfg.num_hidden_layers = depth
    if isinstance(getattr(cfg, "layer_types", None), list):  # sliding-window and hybrid models: cut together
        cfg.layer_types = cfg.layer_types[:depth]
    cfg.use_cache = False
    return cfg


def decoder_layers(base: torch.nn.Module) -> torch.nn.ModuleList:
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise HsxError(f"{type(base).__name__} has no `layers` list of decoder layers; this architecture is not "
                       "supported yet")
    return layers


# What hsx did to a model it loaded, kept beside the model (weakly: gone with it) instead of as attributes on
# transformers' objects: the attention implementation the job asked for, and how its layers were compiled.
_ATTN_REQUESTED: "weakref.WeakKeyDictionary[torch.nn.Module, str | None]" = weakref.WeakKeyDictionary()
_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()
# The checkpoint's fp8 quantization (transformers drops quantization_config from a model it dequantized on load)
_QUANTIZATION: "weakref.WeakKeyDictionary[torch.nn.Module, fp8.Fp8Config]" = weakref.WeakKeyDictionary()


def finish_truncation(base: torch.nn.Module, depth: int, final_hidden: bool) -> torch.nn.Module:
    layers = decoder_layers(base)
    if len(layers) > depth:  # GPT-OSS loops over all of self.layers whatever num_hidden_layers says
        base.layers = torch.nn.ModuleList(list(layers)[:depth])
    if not final_hidden and isinstance(getattr(base, "norm", None), torch.nn.Module):
        base.norm = torch.nn.Identity()  # its output is not stored; don't compute it
    base.config.use_cache = False
    base.eval().requires_grad_(False)
    return base


def group_device_map(devices: list[torch.device]) -> dict[str, Any]:
    """from_pretrained arguments that place one copy on `devices`: the whole model on one device, or spread layer
    by layer over a group of GPUs (accelerate's device_map="auto" limited to the group's memory)."""
    if len(devices) == 1:
        return {"device_map": {"": devices[0]}} if devices[0].type != "cpu" else {}
    free = {d.index: torch.cuda.mem_get_info(d)[0] for d in devices}
    # Leave room on each GPU for a batch's activations and the captured states (cost.py sizes them).
    return {"device_map": "auto", "max_memory": {i: int(0.85 * f) for i, f in free.items()}}


# ---- the target: its facts, then its weights -----------------------------------------------------------------------

@dataclass
class Target:
    """The model as a job sees it: where it is, its text config, the layers captured from it, and the output
    format they make (read once, by `read_target`: the job's steps and `load_model` all take this one)."""
    model_path: str
    revision: str | None
    text: Any  # the text model's PretrainedConfig (the full depth)
    num_layers: int
    layers: list[int]
    final_hidden: bool
    format: OutputFormat

    @property
    def hidden_size(self) -> int:
        return int(self.text.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.text.vocab_size)


def read_target(cfg: ExtractConfig, model: LoadedModel | None = None) -> Target:
    """The model's config (not its weights) and the layers `cfg` asks for, refused as `config.target_layers`
    refuses them; `model` (a LoadedModel, hsx bench's or a caller's) is used as it is."""
    if model is None:
        model_path, revision = resolve_model_path(cfg.model, cfg.revision, cfg.trust_remote_code)
        full = read_model_config(model_path, cfg.model, cfg.trust_remote_code)
        text = fp8.carry_quantization(full, text_config_of(full))
        check_checkpoint(model_path, cfg.model, text)  # (before the job claims a dir: a damaged one is refused first)
        num_layers = int(text.num_hidden_layers)
        layers, final_hidden = target_layers(cfg, text)
    else:
        model_path, revision, text = model.model_path, model.revision, model.text_config
        num_layers = model.num_model_layers
        layers, final_hidden = target_layers(cfg, text, (model.layers, model.final_hidden))
    return Target(model_path, revision, text, num_layers, layers, final_hidden,
                  OutputFormat.of_job(cfg, layers, text.hidden_size, final_hidden))


def load_model(cfg: ExtractConfig, device: torch.device, devices: list[torch.device] | None = None,
               distributed_config=None, target: Target | None = None) -> LoadedModel:
    """The target's weights, cut after the deepest layer it needs. `target`: the job's (`read_target`), whose
    config and layers are used as read, not read again (None: read here). `distributed_config` (transformers'
    DistributedConfig, from hsx.run) shards the copy over processes."""
    import transformers
    from safetensors import SafetensorError
    from transformers import AutoModel

    if target is None:
        target = read_target(cfg)  # (which checks the checkpoint)
    else:  # the files again: a job's target was read before it tokenized, maybe minutes ago
        check_checkpoint(target.model_path, cfg.model, target.text)
    path, revision, text, n = target.model_path, target.revision, target.text, target.num_layers
    layers, final_hidden = target.layers, target.final_hidden
    depth = layers_run(n, layers, final_hidden)
    tcfg = truncated_config(text, depth)
    quant = fp8.quantization_of(tcfg)
    attn = supported_attn_implementation(tcfg, cfg.attn_implementation)
    kwargs: dict[str, Any] = {}
    prefix = text_weights_prefix(checkpoint_keys(path))
    if prefix not in (None, "", "model."):
        # A multimodal checkpoint whose text weights sit under a prefix the text model's class does not map by
        # itself (Gemma 3 and other llava-style checkpoints store `language_model.model.*`): without this, every
        # weight is "missing" and the text model runs on random weights. Verified exact on Qwen3.5 too.
        kwargs["key_mapping"] = {"^" + re.escape(prefix): ""}
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the load report lists every layer we chose not to load
    try:
        base, info = AutoModel.from_pretrained(
            path, config=tcfg, dtype=TORCH_DTYPES[cfg.dtype], attn_implementation=attn,
            use_safetensors=True, trust_remote_code=cfg.trust_remote_code, output_loading_info=True,
            **({"distributed_config": distributed_config} if distributed_config is not None
               else group_device_map(devices or [device])), **kwargs,
        )
    except (OSError, ValueError, SafetensorError) as e:  # (SafetensorError: a file safetensors refuses)
        raise HsxError(f"cannot load model {cfg.model!r}: {one_line(e)}") from None
    except (KeyError, TypeError, AttributeError, IndexError, ZeroDivisionError, RuntimeError) as e:
        # the folder's config.json passed transformers' checks but its values do not build this architecture
        # (an unknown hidden_act, heads that do not divide the width, weights of other shapes)
        raise HsxError(f"cannot load model {cfg.model!r} (does its config.json match its weights and "
                       f"architecture?): {type(e).__name__}: {one_line(e)}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    check_loaded_weights(base, info, cfg.model)
    if quant is not None:
        check_used_scales(base, info, cfg.model, prefix)
    base = finish_truncation(base, depth, final_hidden)
    _ATTN_REQUESTED[base] = cfg.attn_implementation
    if distributed_config is None and (not devices or len(devices) == 1):
        base = base.to(device)
    if distributed_config is None:  # (a tensor-parallel copy's DTensor shards: not summed here)
        check_finite_weights(base, cfg.model)
    if quant is not None:
        _QUANTIZATION[base] = quant
    if quant is not None and distributed_config is None and fp8.runs_instead(quant, device) is None:
        fp8.install(base)  # (tensor-parallel shards stay on transformers' FP8 forward: DTensor weights)
    head = load_lm_head(path, text, base, device) if cfg.topk_logits else None
    return LoadedModel(base=base, layers=layers, final_hidden=final_hidden, num_model_layers=n, depth=depth,
                       hidden_size=int(text.hidden_size), model_path=path, revision=revision, text_config=tcfg,
                       lm_head=head)


def load_lm_head(path: str, text_config, base: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """The output projection's weight, read from the checkpoint's safetensors alone (the model itself is loaded
    without lm_head); tied embeddings reuse the input embedding."""
    if getattr(text_config, "tie_word_embeddings", False):
        return base.get_input_embeddings().weight
    from safetensors import safe_open

    keys = [k for k in checkpoint_keys(path) if k.endswith("lm_head.weight")]
    if not keys:
        raise HsxError(f"{path}: no lm_head.weight in the checkpoint; --topk-logits needs the output projection")
    key = min(keys, key=len)
    shard = _index_weight_map(Path(path)).get(key)
    files = [Path(path) / shard] if isinstance(shard, str) else sorted(Path(path).glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as st:
            if key in st.keys():
                return st.get_tensor(key).to(base.get_input_embeddings().weight.dtype)
    raise HsxError(f"{path}: {key} is listed but not found in the checkpoint files")


def supported_attn_implementation(text_config, requested: str | None) -> str | None:
    """`requested`, unless it is the default "sdpa" and the model's class has no SDPA path (GPT-OSS: its attention
    sinks): then None, which lets transformers pick the model's own default (eager for GPT-OSS)."""
    if requested != "sdpa":
        return requested
    try:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING

        cls = MODEL_MAPPING[type(text_config)]
    except (KeyError, ImportError, ValueError):  # remote code, or unknown to this transformers: let it decide
        return requested
    return requested if getattr(cls, "_supports_sdpa", True) else None


def checkpoint_keys(path: str) -> list[str]:
    """The tensor names of a local safetensors checkpoint (from the index, else the files' headers)."""
    folder = Path(path)
    if (folder / CHECKPOINT_INDEX).exists():
        return list(_index_weight_map(folder))
    from safetensors import SafetensorError, safe_open

    keys: list[str] = []
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                keys.extend(st.keys())
        except (OSError, ValueError, RuntimeError, SafetensorError):  # (transformers says what is wrong)
            continue
    return keys


def _index_weight_map(folder: Path) -> dict[str, Any]:
    """The checkpoint index's weight_map (tensor name -> shard file), {} without an index or a readable one (the
    files' own headers, or transformers, say what is there); HsxError when it is over MAX_INDEX_BYTES."""
    data = read_model_json(folder / CHECKPOINT_INDEX, MAX_INDEX_BYTES)
    try:
        weight_map = json.loads(data).get("weight_map") if data is not None else None
    except (ValueError, RecursionError, AttributeError):
        return {}
    return weight_map if isinstance(weight_map, dict) else {}


SINGLE_CHECKPOINT = "model.safetensors"  # what transformers loads, where it is there, before any index
# A safetensors file's JSON header, parsed here (in Python: ~10 objects per 100 bytes of a real one) before
# transformers reads the file. Real ones take ~100 bytes per tensor: a shard's a few MB, 16 MB is ~130,000 tensors
# in one file (safetensors' own bound, 100 MB, would be a 1-2 GB parse). And at most one bracket, brace or comma per
# 4 bytes (a real entry has 7-10 in 50-150 bytes; `[],[],...` has 2 per 3): a hostile header makes no more objects
MAX_HEADER_BYTES = 16 << 20
HEADER_BYTES_PER_TOKEN = 4
# bytes per element of the safetensors dtypes (others, sub-byte ones, are not sized here)
ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "I16": 2, "F16": 2,
              "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8}
SCALE_TORCH = {"F32": torch.float32, "BF16": torch.bfloat16, "U8": torch.uint8, "F8_E8M0": torch.float8_e8m0fnu}
DAMAGED = "the model folder is damaged, or its config.json does not describe its weights"


class StoredTensor(NamedTuple):
    """One tensor of a checkpoint, as its file's safetensors header describes it."""
    file: Path
    dtype: str  # safetensors' name: F8_E4M3, F32, BF16, ...
    shape: tuple[int, ...]
    start: int  # its bytes are [start, end) of the file
    end: int


def checkpoint_files(folder: Path) -> tuple[list[str], dict[str, Any]] | None:
    """The safetensors files transformers loads from a folder, with the index's weight_map ({} for one file):
    model.safetensors where there is one, else the shards the index names; None when there is neither file or no
    readable index (transformers says what is missing). HsxError in one line when a shard the index names is not
    in the folder (or not a file, or a path leading out of it)."""
    if check_model_file(folder / SINGLE_CHECKPOINT, 1 << 62):
        return [SINGLE_CHECKPOINT], {}
    weight_map = _index_weight_map(folder)
    first: dict[str, str] = {}  # shard → the first tensor the index puts in it (named when the shard is not there)
    for key, shard in weight_map.items():
        if not isinstance(shard, str):  # (transformers sorts the names: a number among them is its TypeError)
            raise HsxError(f"{CHECKPOINT_INDEX} puts {_shown(key)} in {_shown(repr(shard)[:60])}, which is no file "
                           f"name; {DAMAGED}")
        first.setdefault(shard, _shown(key))
    for shard, listed in first.items():
        parts = Path(shard).parts
        if not parts or Path(shard).is_absolute() or ".." in parts:
            raise HsxError(f"{CHECKPOINT_INDEX} puts {listed} in {_shown(shard)}, outside the model folder; {DAMAGED}")
        if not check_model_file(folder / shard, 1 << 62):
            raise HsxError(f"{CHECKPOINT_INDEX} puts {listed} in {_shown(shard)}, which is not in the model folder; "
                           f"{DAMAGED}")
    return (sorted(first), weight_map) if first else None


def stored_tensors(folder: Path, files: tuple[list[str], dict[str, Any]] | None = None
                   ) -> dict[str, StoredTensor] | None:
    """Every tensor transformers loads from a folder (every tensor of each of its `checkpoint_files`), from the
    files' headers alone; None where `checkpoint_files` is. HsxError in one line naming the file and tensor when a
    header is malformed or sizes a tensor past its file, a tensor is in two shards, or the index puts a tensor in
    a shard that does not hold it."""
    names, weight_map = files or checkpoint_files(folder) or (None, None)
    if names is None:
        return None
    tensors: dict[str, StoredTensor] = {}
    paths = {shard: folder / shard for shard in names}  # (one Path per file: its tensors' `file`, compared by id)
    for shard in names:
        header = _safetensors_header(paths[shard], shard)
        for key in header.keys() & tensors.keys():
            raise HsxError(f"{_shown(key)} is in both {_shown(tensors[key].file.name)} and {_shown(shard)}; "
                           f"{DAMAGED}")
        tensors.update(header)
    for key, shard in weight_map.items():
        if isinstance(shard, str) and (key not in tensors or tensors[key].file is not paths[shard]):
            raise HsxError(f"{CHECKPOINT_INDEX} puts {_shown(key)} in {_shown(shard)}, which does not hold it; "
                           f"{DAMAGED}")
    return tensors


def _safetensors_header(path: Path, shown: str) -> dict[str, StoredTensor]:
    """The tensors a safetensors file's header describes, each named once, checked to lie within the file and to
    take the bytes its dtype and shape take, the tensors tiling the file's data as safetensors requires."""
    def damaged(why: str) -> HsxError:
        return HsxError(f"{_shown(shown)}: {why}; {DAMAGED}")

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else 0
            if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
                raise damaged(f"its safetensors header length ({n:,} bytes) does not fit its {size:,} bytes")
            raw = f.read(n)
            if (raw.count(b"[") + raw.count(b"{") + raw.count(b",")) * HEADER_BYTES_PER_TOKEN > n:
                raise damaged("its safetensors header is not a list of tensors (too many brackets and commas)")
            header = json.loads(raw, object_pairs_hook=_unique_keys)
    except OSError as e:
        raise HsxError(f"cannot read {path}: {e.strerror or e}") from None
    except _DuplicateKey as e:
        raise damaged(f"its safetensors header names {_shown(e.args[0])} twice") from None
    except (ValueError, RecursionError):
        raise damaged("its safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise damaged("its safetensors header is not a JSON object")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(type(v) is str for v in meta.values())):
        raise damaged("its safetensors header's __metadata__ is not a map of strings (safetensors refuses it)")
    base, room, tensors = 8 + n, size - 8 - n, {}
    for key, entry in header.items():  # (a checkpoint lists up to ~10^5: kept to plain comparisons)
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ok = (type(dtype) is str and type(shape) is list and type(start) is int and type(end) is int
                  and 0 <= start <= end <= room)
            elements = 1
            for d in shape:
                ok = ok and type(d) is int and d >= 0
                elements *= d
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise damaged(f"the header's entry for {_shown(key)} is not a dtype, shape and offsets within the file")
        item = ITEM_BYTES.get(dtype)
        if item is not None and end - start != elements * item:
            raise damaged(f"{_shown(key)} takes {end - start:,} bytes, not the {elements * item:,} its {dtype} "
                          f"{shape} take")
        tensors[key] = StoredTensor(path, dtype, tuple(shape), base + start, base + end)
    # safetensors itself refuses a file whose tensors do not tile its data (a gap, two sharing bytes, bytes left
    # over): refused here too, in one line, rather than as its exception from transformers' loader
    at = base
    for key, t in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if t.start != at:
            raise damaged(f"{_shown(key)}'s bytes start at {t.start - base:,}, not at {at - base:,} where the "
                          "tensor before it ends (tensors overlap or leave a gap)")
        at = t.end
    if at != size:
        raise damaged(f"its tensors end at byte {at - base:,} of its {room:,} bytes of data")
    return tensors


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's dict, refusing a key named twice (json keeps the last, safetensors refuses the file)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return d


# Checkpoints that passed `check_checkpoint` (their files' sizes and times, and the quantization): a job checks
# the model when it reads its facts and again when it loads it
_CHECKED: set[tuple] = set()


def check_checkpoint(path: str, name: str, text_config) -> None:
    """HsxError in one line naming the tensor when a checkpoint's stored tensors are not what its config's
    quantization declares (`fp8.stored_problems`, from the safetensors headers) or a block scale is zero, negative,
    NaN or inf (`fp8.scale_problem`, over the scales read straight from the files: 1/16,384 of the weights'
    elements). A checkpoint of another quantization method is transformers' to load (`fp8.quantization_of` refuses
    one it does not know)."""
    folder = Path(path)
    try:
        quant = fp8.quantization_of(text_config)
        if quant is None and getattr(text_config, "quantization_config", None) is not None:
            return
        files = checkpoint_files(folder) if folder.is_dir() else None
        if files is None:
            return
        stats = [(folder / f).stat() for f in files[0]]
        key = (str(folder), repr(quant), tuple((f, st.st_size, st.st_mtime_ns) for f, st in zip(files[0], stats)))
        if key in _CHECKED:
            return
        tensors = stored_tensors(folder, files)
        problems = fp8.stored_problems(tensors, quant)
        if problems:
            more = f" (and {len(problems) - 1:,} more like it)" if len(problems) > 1 else ""
            raise HsxError(f"{_shown(problems[0])}{more}; {DAMAGED}")
        if quant is not None:
            _check_scale_values(tensors)
    except OSError as e:
        raise HsxError(f"model {name!r}: cannot read {e.filename or 'its files'}: {e.strerror or e}") from None
    except HsxError as e:
        raise HsxError(f"model {name!r}: {e}") from None
    _CHECKED.add(key)


def _check_scale_values(tensors: dict[str, StoredTensor]) -> None:
    """HsxError naming the first scale tensor (in file order) that holds a value `fp8.scale_problem` refuses: the
    scales of each file and dtype read into one buffer (one pread each) and checked in one reduction, the tensor
    looked for only where that finds one."""
    groups: dict[tuple[Path, str], list[str]] = {}
    for k in sorted((k for k in tensors if k.endswith(fp8.SCALE_SUFFIX)),
                    key=lambda k: (tensors[k].file, tensors[k].start)):
        groups.setdefault((tensors[k].file, tensors[k].dtype), []).append(k)
    for (file, dtype), keys in groups.items():
        fd = os.open(file, os.O_RDONLY)
        try:
            chunks = [os.pread(fd, tensors[k].end - tensors[k].start, tensors[k].start) for k in keys]
        finally:
            os.close(fd)
        for k, chunk in zip(keys, chunks):
            if len(chunk) != tensors[k].end - tensors[k].start:
                raise HsxError(f"{_shown(file.name)} ends inside {_shown(k)} (it was cut short); {DAMAGED}")
        data = b"".join(chunks)
        values = torch.frombuffer(bytearray(data), dtype=SCALE_TORCH[dtype]) if data else torch.empty(0)
        if fp8.scale_problem("", values) is None:
            continue
        at = 0
        for k, chunk in zip(keys, chunks):
            n = len(chunk) // values.element_size()
            why = fp8.scale_problem(_shown(k), values[at:at + n].view(tensors[k].shape))
            if why:
                raise HsxError(f"{why}; the model folder is damaged")
            at += n


def text_weights_prefix(keys: list[str]) -> str | None:
    """The prefix of the decoder's weights in a checkpoint: the one that holds both `embed_tokens.weight` and
    `layers.*` ("model." for a CausalLM, "model.language_model." or "language_model.model." for vision-language
    checkpoints). None when there is no such single prefix (other naming): transformers decides alone."""
    emb = "embed_tokens.weight"
    candidates = {k[: -len(emb)] for k in keys if k.endswith(emb) and (k == emb or k[: -len(emb)].endswith("."))}
    candidates = {p for p in candidates if any(k.startswith(p + "layers.") for k in keys)}
    return candidates.pop() if len(candidates) == 1 else None


def check_loaded_weights(base: torch.nn.Module, info: dict, model: str) -> None:
    """Refuse a model whose parameters were not all read from the checkpoint: transformers fills missing ones with
    random values and only logs it (a warning we silence), which would make every hidden state silently wrong."""
    params = dict(base.named_parameters())
    missing = sorted(k for k in info.get("missing_keys", ()) if k in params)
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys", ()))
    if missing or mismatched:
        what = missing or mismatched
        raise HsxError(f"model {model!r}: {len(what)} weight(s) of the decoder were not found in the checkpoint "
                       f"({'missing' if missing else 'shape mismatch'}: {', '.join(what[:3])}"
                       f"{', ...' if len(what) > 3 else ''}); refusing to extract from randomly initialized weights")


def check_used_scales(base: torch.nn.Module, info: dict, model: str, prefix: str | None) -> None:
    """Refuse an FP8 checkpoint's weight whose block scales transformers read but left unused (`prefix`: the
    checkpoint's prefix of the decoder's weights, as its unexpected keys are named): the weight holds the stored
    e4m3 values unscaled (`check_checkpoint` has made sure the weights beside scales are e4m3)."""
    params = dict(base.named_parameters())
    for scale in sorted(str(k) for k in info.get("unexpected_keys", ()) if str(k).endswith(fp8.SCALE_SUFFIX)):
        weight = scale[:-len(fp8.SCALE_SUFFIX)]
        if prefix and weight.startswith(prefix):
            weight = weight[len(prefix):]
        if weight in params:
            raise HsxError(f"model {model!r}: transformers loaded {_shown(weight)} without its block scales "
                           f"{_shown(scale)}, left unused (a module it does not quantize, or fused FP8 experts it "
                           "dequantizes on a device without FP8); refusing to extract from unscaled FP8 weights")


NAN_BYTES = {torch.float8_e4m3fn: (0x7F, 0x7F), torch.float8_e5m2: (0x7C, 0x7C)}  # (mask, value) of NaN/inf bytes


def check_finite_weights(base: torch.nn.Module, model: str) -> None:
    """HsxError naming the first parameter that holds a NaN or inf (a damaged weight, or one dequantized with a
    damaged scale), as loaded: otherwise every state it reaches is NaN and the job would stop on the first row as if
    the data were at fault. One reduction per tensor on its device (a float32 sum, NaN/inf bytes of e4m3 / e5m2
    counted in chunks), one host sync per device."""
    found: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, p in base.named_parameters():
        if p.is_floating_point() and p.numel() and (p.dtype in NAN_BYTES or p.element_size() > 1):
            found.setdefault(p.device, []).append((name, p))
    for params in found.values():
        with torch.no_grad():
            flags = torch.stack([_nonfinite(p) for _, p in params])
        if bool(flags.any()):
            raise HsxError(f"model {model!r}: its weight {_shown(params[int(flags.nonzero()[0])][0])} holds NaN or "
                           "inf values; the model folder is damaged")


def _nonfinite(p: torch.Tensor) -> torch.Tensor:
    if p.dtype in NAN_BYTES:
        mask, value = NAN_BYTES[p.dtype]
        flat = p.detach().reshape(-1).view(torch.uint8)
        return torch.stack([((c & mask) == value).any() for c in flat.split(1 << 26)]).any()
    return ~torch.isfinite(p.detach().sum(dtype=torch.float32))


def truncated_view(causal: torch.nn.Module, text_config, layers: list[int], final_hidden: bool) -> LoadedModel:
    """A truncated decoder that shares the weights of an already built CausalLM (benchmarks: one copy of the
    weights serves the naive runs and hsx's)."""
    base = causal.get_decoder() if hasattr(causal, "get_decoder") else causal.model
    n = int(text_config.num_hidden_layers)
    depth = layers_run(n, layers, final_hidden)
    view = copy.copy(base)  # shallow: same parameters; its own module table, config and hook dicts below
    view._modules, view._parameters, view._buffers = dict(base._modules), dict(base._parameters), dict(base._buffers)
    view.config = truncated_config(base.config, depth)
    view = finish_truncation(view, depth, final_hidden)
    return LoadedModel(base=view, layers=layers, final_hidden=final_hidden, num_model_layers=n, depth=depth,
                       hidden_size=int(text_config.hidden_size), model_path="", revision=None,
                       text_config=view.config)


@dataclass
class PreparedModel:
    """How a prepared model runs its batches (`prepare_model`)."""

    packing: str  # "none": right-padded rows; "varlen": one packed sequence per forward
    linear_attention: bool  # its Gated DeltaNet layers run on fla's kernels
    compiler: "CompileAhead | None"  # the layers' background compilation (None: eager, or compiled in place)


def prepare_model(base: torch.nn.Module, packing: str = "none", compile_model: bool = False, cuda: bool = False,
                  log=print) -> PreparedModel:
    """Switch a loaded model, in place, to run as the job asks; each step once per model. Packed batches
    (`use_packing`: the model's configs name hsx's varlen attention, registered with transformers'
    AttentionInterface; the one change outside the model, idempotent), Gated DeltaNet layers on fla's kernels
    (CUDA with fla installed; packed rows need it), compiled layers (`compile_layers`)."""
    use_packing(base, packing)
    linear = gdn.install(base) if cuda else False
    compiler = compile_layers(base, log=log) if compile_model else None
    return PreparedModel(packing=packing, linear_attention=linear, compiler=compiler)


def compile_layers(base: torch.nn.Module, ahead: bool = True, log=print) -> "CompileAhead | None":
    """Regional compilation: torch.compile each decoder layer's forward, once per model.

    Layers of one class share one graph (compiled once, ~1 graph per layer type), and the capture hooks stay
    outside the compiled code, so adding or removing them never recompiles. Blocks that do not compile well run
    eager inside the compiled layers (`torch.compiler.disable`): the Gated DeltaNet mixers (fla's Triton kernels
    are fused already; traced with dynamic shapes, Inductor spent minutes in sympy on the 27B shape without
    finishing). With `ahead` (the default) no forward ever waits for Inductor: layers run eager until a worker
    thread has compiled every layer kind on a batch's inputs (`CompileAhead.start`), then run only cached graphs
    (a shape whose guards fail runs eager, never recompiles on the extraction thread). Returns the CompileAhead
    (None when `ahead` is off: then the first forwards compile in place)."""
    state = _COMPILED.get(base)
    if state is not None:
        return state or None
    for m in gdn.linear_attention_modules(base):
        m.forward = torch.compiler.disable(m.forward)
    layers = decoder_layers(base)
    if not ahead:
        for layer in layers:
            layer.forward = torch.compile(layer.forward, dynamic=True, options=fp8.compile_options(layer))
        _COMPILED[base] = False
        return None
    ahead_state = CompileAhead(log=log)
    for layer in layers:
        layer.forward = _AheadLayer(layer.forward, ahead_state, _layer_kind(layer), fp8.compile_options(layer))
    _COMPILED[base] = ahead_state
    return ahead_state


def compiled_state(base: torch.nn.Module) -> "CompileAhead | bool | None":
    """How `compile_layers` compiled this model: its CompileAhead, False (compiled in place), None (not)."""
    return _COMPILED.get(base)


def _layer_kind(layer: torch.nn.Module) -> tuple:
    """Layers of one kind share a compiled graph (their class and the attributes its forward branches on)."""
    return (type(layer).__name__,) + tuple(str(getattr(layer, a, "")) for a in ("block_type", "layer_type",
                                                                               "attention_type"))


class CompileAhead:
    """Compiles the decoder layers in a worker thread while extraction runs eager (`compile_layers`).

    Forwards record each layer kind's inputs (with the thread's context variables, e.g. packed rows), the largest
    seen; `start` then compiles and runs each kind once on them, on the worker, in inference mode: after the first
    forward of at least half the token budget, or after SAMPLE_FORWARDS forwards. Inductor picks its kernels' tiles
    for the sample's sizes (dynamic shapes keep the sizes symbolic, not the tiles): compiled on a 16-token first
    batch, a Qwen3.6-35B-A3B attention layer's query norm + rotary kernel took 833 µs at 32k tokens on an H200.
    `ready` is set when every kind compiled; `wait` gives up after a deadline with one line (extraction keeps
    running eager). `close` ends the worker before the job returns: a thread still inside torch's C++ code when the
    interpreter exits is unwound by glibc's thread cancellation through C++ frames, which aborts the process
    ("FATAL: exception not rethrown") after its work is done. A compile in progress cannot be cut short, so `close`
    waits for it."""

    def __init__(self, log=print):
        self.log = log
        self.samples: dict[tuple, tuple] = {}  # kind -> (args, kwargs, context, tokens) of its largest call
        self.forwards = 0  # forwards seen before the compile started
        self.device: torch.device | None = None
        self.layers: list[tuple] = []  # (kind, compiled forward) of every layer
        self.ready = threading.Event()
        self.stopping = threading.Event()  # `close(finish=False)`: compile no further kind
        self.failed: str | None = None
        self.thread: threading.Thread | None = None
        self.seconds: float | None = None  # compile time, once done

    def record(self, kind, args, kwargs) -> None:
        import contextvars

        if self.thread is not None:
            return
        tokens = _call_tokens(args, kwargs)
        if kind in self.samples and self.samples[kind][3] >= tokens:
            return
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        self.samples[kind] = (args, dict(kwargs), contextvars.copy_context(), tokens)

    def start(self, device: torch.device, tokens: int = 0, budget: int = 0) -> None:
        """After a forward of `tokens` (of a `budget` per batch): compile every recorded kind in the background
        (once), if this forward was representative (at least half the budget) or SAMPLE_FORWARDS have run."""
        if self.thread is not None or not self.samples:
            return
        self.device = device
        self.forwards += 1
        if 2 * tokens < budget and self.forwards < SAMPLE_FORWARDS:
            return
        self._launch(device)

    def _launch(self, device: torch.device) -> None:
        trace_fx_once()
        # Not a daemon: the worker always ends on its own, and if no `close` joins it, the interpreter's exit does.
        self.thread = threading.Thread(target=self._compile, args=(device,), name="hsx-compile")
        self.thread.start()

    def close(self, finish: bool) -> None:
        """Join the worker: after every kind compiled (`finish`: the model outlives the job, e.g. `hsx bench`'s),
        or after the kind compiling now (no further kind starts; the layers stay eager). A SIGINT/SIGTERM while
        joining (a second Ctrl-C as a stopped job ends) stops the worker after its kind and is handled once the
        worker ended: raised in the join, it would leave the worker compiling while the job reports it stopped, and
        the interpreter's exit waiting for it, where a further Ctrl-C prints a traceback."""
        if self.thread is None:
            return
        if not finish:
            self.stopping.set()
        if self.thread.is_alive():
            self.log("hsx: waiting for torch.compile's worker to finish the layer kind it is compiling")
        with _signals_held(self._stop_on_signal):
            self.thread.join()

    def _stop_on_signal(self, signum: int) -> None:
        if not self.stopping.is_set():
            self.stopping.set()
            self.log(f"hsx: {signal.Signals(signum).name}: stopping once torch.compile's worker ends the layer kind "
                     "it is compiling (a compile cannot be cut short)")

    def _compile(self, device: torch.device) -> None:
        import time

        t0 = time.perf_counter()
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            with torch.inference_mode():
                for kind, compiled in self.layers:  # every layer: one compile per kind, then guard checks
                    if self.stopping.is_set():
                        return
                    if kind in self.samples:
                        args, kwargs, context, _ = self.samples[kind]
                        context.run(compiled, *args, **kwargs)
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
        except Exception as e:  # noqa: BLE001 - any compiler failure leaves the model eager, as it was
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.log(f"hsx: torch.compile failed ({self.failed[:200]}); the layers keep running eager")
            return
        finally:
            self.samples.clear()  # free the recorded inputs
        self.seconds = time.perf_counter() - t0
        self.ready.set()

    def wait(self, timeout: float) -> bool:
        """Block until compiled (True) or `timeout` seconds (False, with one line); for benchmarks' warm-up. A
        compile still waiting for a representative batch starts now, on the largest recorded."""
        if self.thread is None and self.samples and self.device is not None:
            self._launch(self.device)
        if self.thread is None or self.failed:
            return False
        if not self.ready.wait(timeout):
            self.log(f"hsx: torch.compile not done after {timeout:.0f} s; extraction goes on eager meanwhile")
            return False
        return True


SAMPLE_FORWARDS = 16  # forwards (run eager) a compile waits for a representative batch before it takes the largest


def _call_tokens(args, kwargs) -> int:
    """Tokens in a decoder layer call: its hidden states' elements over the hidden size."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    return hidden.shape[:-1].numel() if isinstance(hidden, torch.Tensor) and hidden.dim() else 0


@contextmanager
def _signals_held(on_signal):
    """SIGINT/SIGTERM, where Python code handles them (not SIG_DFL/SIG_IGN), call `on_signal(signum)` inside the
    block and reach their handler (hsx.run's stop, KeyboardInterrupt) after it. Main thread only (where signals are
    delivered and handlers set); elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum, frame):
        held.append(signum)
        on_signal(signum)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous = {sig: h for sig, h in previous.items() if callable(h)}
    for sig in previous:
        signal.signal(sig, hold)
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
        for signum in held:
            signal.raise_signal(signum)


def trace_fx_once() -> None:
    """Run, on this thread, the one torch.fx symbolic trace Inductor makes per process. While it traces, torch.fx
    swaps `nn.Module.__call__` for every thread (Inductor's first lowering traces a dummy graph,
    `torch._inductor.loop_body.InterpreterShim._dummy_gm`, cached after): made by the compile worker, it broke an
    eager forward on the extraction thread at the same moment ("NameError: module is not installed as a
    submodule"; H200, qwen3-8b warm-up). Traced here before the worker starts, the worker reads the cache. The
    tracers that AOTAutograd uses swap it too, but call the original forward for modules outside their graph."""
    try:
        from torch._inductor.loop_body import InterpreterShim

        InterpreterShim._dummy_gm()
    except Exception:  # noqa: BLE001 - another torch: nothing of this kind to trace ahead
        pass


class _AheadLayer:
    """A decoder layer's forward: eager until its CompileAhead is ready, then the cached compiled graphs only."""

    def __init__(self, forward, state: CompileAhead, kind: tuple, options: dict | None = None):
        self.eager = forward
        self.compiled = torch.compile(forward, dynamic=True, options=options)
        self.cached_only = torch._dynamo.run(self.compiled)  # never compiles: a cache miss runs eager
        self.state, self.kind = state, kind
        state.layers.append((kind, self.compiled))

    def __call__(self, *args, **kwargs):
        if self.state.ready.is_set():
            return self.cached_only(*args, **kwargs)
        if self.state.thread is None and not torch.compiler.is_compiling():
            self.state.record(self.kind, args, kwargs)
        return self.eager(*args, **kwargs)


# ---- which kernels run ---------------------------------------------------------------------------------------------

LINEAR_ATTENTION_KERNEL = "chunk_gated_delta_rule"  # Gated DeltaNet over a whole sequence (fla when installed)
CONV_KERNEL = "causal_conv1d_fn"  # its short causal convolution (causal-conv1d when installed)


# The libraries whose code computes or writes the states (pip's distribution name → module): kernels differ by version
# in their last bits, so a run's record names them. Optional ones not installed are left out.
STATE_LIBRARIES = {"torch": "torch", "transformers": "transformers", "datasets": "datasets",
                   "accelerate": "accelerate", "triton": "triton", "flash-linear-attention": "fla",
                   "causal-conv1d": "causal_conv1d", "kernels": "kernels", "deep_gemm": "deep_gemm",
                   "fbgemm-gpu-genai": "fbgemm_gpu"}


def library_versions() -> dict[str, str]:
    """The versions of STATE_LIBRARIES present (as pip reports them; for a module imported from a source tree, with
    no distribution, its __version__), and "cuda": the CUDA torch was built for. Nothing is imported here."""
    from importlib import metadata

    found: dict[str, str] = {}
    for dist, module in STATE_LIBRARIES.items():
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = getattr(sys.modules.get(module), "__version__", None)
            if isinstance(version, str):
                found[dist] = version
    if torch.version.cuda:
        found["cuda"] = torch.version.cuda
    return found


def kernel_report(base: torch.nn.Module) -> dict[str, Any]:
    """Which code paths the model's forward runs, for hsx.json and the run summary.

    attn_implementation: transformers' attention path (and attn_implementation_requested, what the job asked for;
    they differ when the model has no SDPA path, e.g. GPT-OSS runs eager). experts_implementation: the MoE experts'
    path (None without experts). For hybrid models with Gated DeltaNet layers (Qwen3.5/3.6, Qwen3-Next):
    linear_attention_forward is "hsx fla" when hsx.gdn runs them on fla's delta rule (CUDA with
    flash-linear-attention; linear_attention is then "fla" and causal_conv1d "hsx", `gdn.conv_kernel`: hsx's kernel
    for the convolution, q/k l2norm and layout, or "fla" for head layouts it does not take), else "transformers",
    with linear_attention_note saying why and linear_attention / causal_conv1d naming what transformers' own forward
    binds: "fla" / "causal_conv1d" for those packages' kernels, "torch fallback" for its reference PyTorch code
    (correct for right-padded batches, much slower); on fla's kernels fla_autotune says how their tiles are chosen
    (`gdn.autotuning_note`). All are None without such layers. packing_safe: whether packed (padding-free) batches
    would keep sequences apart (`--packing`)."""
    config = base.config
    modules = list(base.modules())
    has_experts = any(type(m).__name__.endswith("Experts") for m in modules)
    linear = gdn.linear_attention_modules(base)
    report: dict[str, Any] = {
        "attn_implementation": getattr(config, "_attn_implementation", None),
        "attn_implementation_requested": _ATTN_REQUESTED.get(base),
        "experts_implementation": getattr(config, "_experts_implementation", None) if has_experts else None,
        "linear_attention": None,
        "causal_conv1d": None,
        "linear_attention_forward": None,
    }
    if linear:
        blocker = None if gdn.installed(base) else gdn.fla_blocker(linear)
        if blocker is None:
            conv = {gdn.conv_kernel(m) for m in linear}
            report.update(linear_attention="fla", causal_conv1d=conv.pop() if len(conv) == 1 else "hsx, fla",
                          linear_attention_forward="hsx fla",
                          fla_autotune=gdn.autotuning_note(linear[0].conv1d.weight.device))
        else:
            kernels = _fallback_kernels(linear)
            report["linear_attention"] = "fla" if kernels.get(LINEAR_ATTENTION_KERNEL, _importable(
                "fla.ops.gated_delta_rule", "chunk_gated_delta_rule")) else "torch fallback"
            report["causal_conv1d"] = "causal_conv1d" if kernels.get(CONV_KERNEL, _importable(
                "causal_conv1d", "causal_conv1d_fn")) else "torch fallback"
            report.update(linear_attention_forward="transformers", linear_attention_note=blocker)
    report["packing_safe"], report["packing_note"] = _packing(report, config)
    quantization = fp8.report(base, _QUANTIZATION.get(base) or fp8.quantization_of(config))
    if quantization is not None:  # (absent for unquantized models: their hsx.json stays as it was)
        report["quantization"] = quantization
    report.update(kernel_choices(base, has_experts, bool(linear), quantization))
    return report


def kernel_choices(base: torch.nn.Module, has_experts: bool, linear: bool, quantization: dict | None
                   ) -> dict[str, Any]:
    """On CUDA, this GPU's compute capability, those hsx's kernels were checked on, what runs for each kernel choice
    of this model (`hsx.kernels.choose`) and, where a kernel does not run here, the line saying what runs instead
    (`fallbacks`, logged by hsx extract); {} off CUDA."""
    device = next((p.device for p in base.parameters()), torch.device("cpu"))
    cap = kernels.capability_of(device)
    if cap is None:
        return {}
    hsx_fp8 = bool(quantization) and str(quantization.get("linear", "")).startswith("hsx fp8")
    picks = kernels.choose(cap, kernels.installed_packages(), str(getattr(base, "dtype", "")).removeprefix("torch."),
                           experts=has_experts, linear_attention=linear, fp8=hsx_fp8,
                           fp8_gemm=fp8._CHOSEN.get(device.index, "auto"))
    out: dict[str, Any] = {"compute_capability": kernels.cap_str(cap),
                           "kernels_checked_on": sorted({kernels.cap_str(c) for k in kernels.KERNELS.values()
                                                         for c in k.checked_on}),
                           # (the GEMM FP8 linears ran on, after its checks: quantization.linear)
                           "kernel_choices": {name: p.runs for name, p in picks.items() if name != "fp8_linear"}}
    lines = {name: p.line for name, p in picks.items() if p.line}
    if lines:
        out["fallbacks"] = lines
    return out


def _packing(report: dict[str, Any], config) -> tuple[bool, str]:
    if report["linear_attention_forward"] == "transformers":
        return False, ("Gated DeltaNet layers on transformers' forward ignore sequence boundaries "
                       f"({report['linear_attention_note']}): packed sequences would leak into each other")
    return True, ""


def fallback_closure(obj, depth: int = 3) -> dict[str, Any] | None:
    """The variables the function `use_kernel_func_from_hub_with_fallback` made for `obj` closes over (`func_name`,
    `is_new_implementation`, `torch_function`: 5.17 to 5.25 at least), or None when `obj` is not one. With the
    `kernels` package installed (a dependency of transformers from 5.25) that function is wrapped once more, in an
    nn.Module whose forward closes over it as `func`."""
    if depth == 0:
        return None
    if isinstance(obj, torch.nn.Module):
        obj = getattr(type(obj), "forward", None)
    if not callable(obj) or not hasattr(obj, "__code__"):
        return None
    try:
        free = inspect.getclosurevars(obj).nonlocals
    except (TypeError, ValueError):
        return None
    if "is_new_implementation" in free and isinstance(free.get("func_name"), str):
        return free
    return fallback_closure(free.get("func"), depth - 1)


def _fallback_kernels(modules: list[torch.nn.Module]) -> dict[str, bool]:
    """{kernel name: True when its package's implementation is used} for the functions that transformers wraps with
    `use_kernel_func_from_hub_with_fallback` in the modules' modeling files (`fallback_closure`). Older layouts keep
    the kernel as a module attribute."""
    found: dict[str, bool] = {}
    for mod_name in {type(m).__module__ for m in modules}:
        namespace = vars(sys.modules.get(mod_name, object()))
        for obj in list(namespace.values()):
            free = fallback_closure(obj)
            if free is not None:
                found[free["func_name"]] = bool(free["is_new_implementation"])
    for m in modules:  # older transformers: self.chunk_gated_delta_rule = fla's or torch's
        for attr, key in ((LINEAR_ATTENTION_KERNEL, LINEAR_ATTENTION_KERNEL), (CONV_KERNEL, CONV_KERNEL)):
            fn = getattr(m, attr, None)
            if key not in found and callable(fn) and not isinstance(fn, torch.nn.Module):
                found[key] = (getattr(fn, "__module__", "") or "").split(".")[0] in ("fla", "causal_conv1d")
    return found


def _importable(module: str, name: str) -> bool:
    import importlib

    try:
        return getattr(importlib.import_module(module), name, None) is not None
    except Exception:  # noqa: BLE001 - a broken optional kernel package is the same as none
        return False


# ---- packed (padding-free) batches ---------------------------------------------------------------------------------

VARLEN_ATTENTION = "hsx_varlen"  # our attention function's name in transformers' AttentionInterface


def packing_blocker(base: torch.nn.Module) -> str | None:
    """Why this model cannot run packed batches exactly (None when it can)."""
    report = kernel_report(base)
    if report["linear_attention_forward"] == "transformers":
        return f"its Gated DeltaNet layers run right-padded only: {report['linear_attention_note']}"
    if any(hasattr(m, "sinks") for m in base.modules()) and not _varlen_returns_lse():
        return f"attention sinks (GPT-OSS) need varlen attention's log-sum-exp (return_aux), not in torch {torch.__version__}"
    if getattr(base.config, "attn_logit_softcapping", None):
        return "attention logit softcapping has no varlen kernel"
    cap = kernels.capability_of(next((p.device for p in base.parameters()), torch.device("cpu")))
    if cap is not None and not kernels.runs_on("flash_varlen", cap):
        return kernels.fallback_line("flash_varlen", cap).removeprefix("hsx: ")
    if not report["packing_safe"]:
        return report["packing_note"]
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no varlen attention (2.9+)"
    return None


def _varlen_returns_lse() -> bool:
    return "return_aux" in attention.VARLEN_PARAMS  # (empty without torch's varlen module)


def resolve_packing(base: torch.nn.Module, requested: str, cuda: bool, one_gpu_per_copy: bool,
                    attn_implementation: str | None) -> tuple[str, str | None]:
    """The packing to run, and why auto chose none. auto = varlen on one CUDA device with the default attention,
    where it is exact: measured on an H200 (qwen3-8b shape, 721k tokens) it cut GPU time 4.7% against
    right-padded batches (padding 3.1% → 0.03%). Hybrid Gated DeltaNet models pack only on hsx's fla forward
    (hsx.gdn: CUDA with flash-linear-attention). On CPU the varlen path runs SDPA per row: slower than padding."""
    if requested != "auto":  # asked for: `use_packing` refuses varlen where it would not be exact
        return requested, None
    if not cuda:
        return "none", None
    if not one_gpu_per_copy or attn_implementation not in ("sdpa", None):
        return "none", "a copy over several GPUs, or another attention implementation, runs right-padded"
    blocker = packing_blocker(base)
    return ("none", blocker) if blocker else ("varlen", None)


def use_packing(base: torch.nn.Module, packing: str) -> None:
    """Switch the model's attention to run a batch as one packed sequence of rows (`Extractor` passes per-row
    `position_ids` and the row boundaries as `cu_seq_lens_q`): torch's flash-attention varlen kernel, registered
    as a transformers attention function. No mask is built (transformers skips mask creation for an attention
    name it has no mask function for)."""
    if packing == "none":
        return
    blocker = packing_blocker(base)
    if blocker:
        raise HsxError(f"--packing {packing}: {blocker}; use --packing none (right-padded batches, exact here)")
    from transformers import AttentionInterface

    gdn.install(base)  # Gated DeltaNet layers: the row bounds reach fla's convolution and delta rule
    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)
    # Modules read `config._attn_implementation` at every forward; a truncated view's layers keep the full
    # model's config object, so set it on every config in the model.
    for config in {id(c): c for c in (getattr(m, "config", None) for m in base.modules()) if c is not None}.values():
        config._attn_implementation = VARLEN_ATTENTION


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     sliding_window: int | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                     max_length_q: int | None = None, softcap: float | None = None,
                     s_aux: torch.Tensor | None = None, **kwargs):
    """transformers attention function for one packed sequence: q, k, v are (1, heads, T, dim); the rows are
    delimited by `cu_seq_lens_q` (int32, rows + 1 offsets) and each attends causally to itself only.

    On CUDA this is one call per layer: hsx.attention's packed kernel where it takes the heads (plain causal
    attention), else flash-attention varlen (torch.nn.attention.varlen: sinks, sliding windows); on CPU (tests)
    it runs SDPA per row, which is exact and slow. Attention sinks (`s_aux`, GPT-OSS: one extra logit per head in every
    softmax's denominator) rescale the kernel's output: softmax over scores + sink = softmax over scores ×
    sigmoid(lse - sink), lse the log-sum-exp of the row's scores that flash attention returns."""
    if softcap is not None:
        raise HsxError("--packing varlen: this model's attention uses a logit softcap; use --packing none")
    if cu_seq_lens_q is None or max_length_q is None:
        raise HsxError("--packing varlen: the forward was called without row boundaries (cu_seq_lens_q)")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, heads, dim)
    dim_v = v.shape[-1]
    if q.is_cuda:
        if dim_v != q.shape[-1]:  # MLA (DeepSeek): the kernel wants one head dim; pad values, slice the output
            v = torch.nn.functional.pad(v, (0, q.shape[-1] - dim_v))
        if s_aux is None and not sliding_window and attention.supports(q, k, v):
            out = attention.attention(q, k, v, cu_seq_lens_q, max_length_q, scaling)  # (FA2 past its row limit)
        else:
            out = attention.flash_varlen(q, k, v, cu_seq_lens_q, int(max_length_q), scaling, sliding_window,
                                         s_aux is not None)
        if s_aux is not None:
            out, lse = out  # lse: (heads, T) float32
            out = (out.float() * torch.sigmoid(lse.transpose(0, 1) - s_aux.float()).unsqueeze(-1)).to(q.dtype)
        out = out[..., :dim_v]
    else:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        bounds = cu_seq_lens_q.tolist()
        out = torch.cat([_causal_sdpa(q[a:z], k[a:z], v[a:z], scaling, sliding_window, s_aux)
                         for a, z in zip(bounds[:-1], bounds[1:])])
    return out.unsqueeze(0), None  # (1, T, heads, dim): what transformers' attention functions return


def _causal_sdpa(q, k, v, scale, sliding_window, sinks=None):
    """One row's causal attention, (T, heads, dim) in and out; with `sinks`, softmax over the scores and one
    sink logit per head (GPT-OSS's eager attention, written out)."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    if sinks is not None:
        t = q.shape[1]
        i = torch.arange(t)
        keep = (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :] < sliding_window) if sliding_window else True)
        scores = (q @ k.transpose(1, 2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        scores = scores.masked_fill(~keep, float("-inf"))
        logits = torch.cat([scores, sinks.reshape(-1, 1, 1).expand(-1, t, 1).to(scores.dtype)], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        return (probs.to(v.dtype) @ v).transpose(0, 1)
    if sliding_window:
        t = q.shape[1]
        i = torch.arange(t)
        mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < sliding_window)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.transpose(0, 1)
