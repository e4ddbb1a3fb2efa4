"""Load the target model cut after the deepest layer we need: base model only, no lm_head, no KV cache.

Only the first `max(layers) + 1` decoder layers are built and read from disk (all of them, plus the final norm,
when the final-norm state is asked for). Without lm_head and the cache, a batch fits where the full CausalLM runs
out of memory on its logits alone (docs/benchmarks.md, "Figures moved from the code"). Weights are read from
safetensors only, never unpickled; remote code runs only when asked.
"""

from __future__ import annotations

import contextlib
import copy
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hsx.config import ExtractConfig, HsxError, layers_run, target_layers
from hsx.errors import one_line
from hsx.schema import OutputFormat
from hsx.target import fp8, fp8_model
from hsx.target.checkpoint import (check_checkpoint, check_finite_weights, check_layer_count, check_loaded_weights,
                                   check_model_files, check_used_scales, checkpoint_keys, hub_config, index_weight_map,
                                   text_weights_prefix)

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


@dataclass
class LoadedModel:
    base: torch.nn.Module  # the decoder stack (XModel), truncated
    layers: list[int]  # resolved, sorted
    final_hidden: bool  # the final-norm state is computed (stored, or only the teacher policy's input)
    num_model_layers: int  # depth of the full model
    depth: int  # decoder layers that run
    hidden_size: int
    model_path: str
    revision: str | None
    text_config: Any  # the truncated config that was built
    lm_head: torch.Tensor | None = None  # (vocab, hidden) output projection, only for top-k logits / the policy


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
    check_layer_count(Path(source) / "config.json" if Path(source).is_dir() else hub_config(source, revision), name)
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code,
                                          **({"revision": revision} if revision else {}))
    # (RecursionError: JSON nested too deeply; TypeError, AttributeError: a field of the wrong JSON type, such as
    # a quantization_config that is a list, which transformers' config classes take for what they expect)
    except (OSError, ValueError, KeyError, RecursionError, TypeError, AttributeError, invalid) as e:
        raise HsxError(f"cannot read the config of model {name!r}: {one_line(e)}") from None


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
# transformers' objects: the attention implementation the job asked for, and (below) the checkpoint's FP8
# quantization; hsx.target.prepare's kernel report reads both.
_ATTN_REQUESTED: "weakref.WeakKeyDictionary[torch.nn.Module, str | None]" = weakref.WeakKeyDictionary()
# The checkpoint's fp8 quantization (transformers drops quantization_config from a model it dequantized on load)
_QUANTIZATION: "weakref.WeakKeyDictionary[torch.nn.Module, fp8.Fp8Config]" = weakref.WeakKeyDictionary()


def requested_attention(base: torch.nn.Module) -> str | None:
    """The attention implementation the job asked of this model (`load_model`'s; None: not loaded there)."""
    return _ATTN_REQUESTED.get(base)


def checkpoint_quantization(base: torch.nn.Module) -> fp8.Fp8Config | None:
    """The checkpoint's FP8 quantization of a model `load_model` loaded (None: none, or not loaded there)."""
    return _QUANTIZATION.get(base)


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
    layers_from: dict[str, Any] | None = None  # --layers-from: where the layers came from (hsx.drafts' record)

    @property
    def hidden_size(self) -> int:
        return int(self.text.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.text.vocab_size)


def read_target(cfg: ExtractConfig, model: LoadedModel | None = None) -> Target:
    """The model's config (not its weights) and the layers `cfg` asks for, refused as `config.target_layers`
    refuses them; `model` (a LoadedModel, hsx bench's or a caller's) is used as it is."""
    draft, layers_from = None, None
    if model is None:
        model_path, revision = resolve_model_path(cfg.model, cfg.revision, cfg.trust_remote_code)
        full = read_model_config(model_path, cfg.model, cfg.trust_remote_code)
        text = fp8.carry_quantization(full, text_config_of(full))
        # (before the job starts or resumes its dir: a damaged one is refused first)
        check_checkpoint(model_path, cfg.model, text)
        num_layers = int(text.num_hidden_layers)
        if cfg.layers_from:
            from hsx.drafts import draft_layers

            draft = draft_layers(cfg.layers_from, text)  # (read once: its record goes into hsx.json)
            layers_from = draft.record
        layers, final_hidden = target_layers(cfg, text, draft=draft)
    else:
        model_path, revision, text = model.model_path, model.revision, model.text_config
        num_layers = model.num_model_layers
        layers, final_hidden = target_layers(cfg, text, (model.layers, model.final_hidden))
    return Target(model_path, revision, text, num_layers, layers, final_hidden,
                  OutputFormat.of_job(cfg, layers, text.hidden_size, final_hidden), layers_from)


def load_model(cfg: ExtractConfig, device: torch.device, devices: list[torch.device] | None = None,
               distributed_config=None, target: Target | None = None,
               experts_share: tuple[int, int] | None = None) -> LoadedModel:
    """The target's weights, cut after the deepest layer it needs. `target`: the job's (`read_target`), whose
    config and layers are used as read, not read again (None: read here). `distributed_config` (transformers'
    DistributedConfig, from hsx.run) shards the copy over processes. `experts_share` (ranks, rank) of an
    expert-parallel group: only this rank's share of the routed experts is read and held
    (hsx.target.expert_parallel.loading_local_experts)."""
    import transformers
    from safetensors import SafetensorError
    from transformers import AutoModel

    if target is None:
        target = read_target(cfg)  # (which checks the checkpoint)
    else:  # the files again: a job's target was read before it tokenized, maybe minutes ago
        check_checkpoint(target.model_path, cfg.model, target.text)
    path, revision, text, n = target.model_path, target.revision, target.text, target.num_layers
    layers = target.layers
    final_hidden = target.final_hidden or bool(target.format.policy)  # (the policy's input, stored or not)
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
    share = contextlib.nullcontext()
    if experts_share is not None:
        from hsx.target.expert_parallel import loading_local_experts

        share = loading_local_experts(*experts_share)
    try:
        with share:
            base, info = AutoModel.from_pretrained(
                path, config=tcfg, dtype=TORCH_DTYPES[cfg.dtype], attn_implementation=attn,
                use_safetensors=True, trust_remote_code=cfg.trust_remote_code, output_loading_info=True,
                **({"distributed_config": distributed_config} if distributed_config is not None
                   else group_device_map(devices or [device])), **kwargs,
            )
    except (OSError, ValueError, SafetensorError) as e:  # (SafetensorError: a file safetensors refuses)
        raise HsxError(f"cannot load model {cfg.model!r}: {one_line(e)}") from None
    except HsxError as e:  # (what reading only this rank's experts refused)
        raise HsxError(f"cannot load model {cfg.model!r}: {e}") from None
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
        fp8_model.install(base)  # (tensor-parallel shards stay on transformers' FP8 forward: DTensor weights)
    head = load_lm_head(path, text, base, device) if cfg.topk_logits or cfg.teacher_policy else None
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
        raise HsxError(f"{path}: no lm_head.weight in the checkpoint; --topk-logits and --teacher-policy need the "
                       "output projection")
    key = min(keys, key=len)
    shard = index_weight_map(Path(path)).get(key)
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
