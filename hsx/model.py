"""Load the target model cut after the deepest layer we need: base model only, no lm_head, no KV cache.

Only the first `max(layers) + 1` decoder layers are built and read from disk (all of them, plus the final norm,
when the final-norm state is asked for). Without lm_head and the cache, a Qwen3-8B-shaped batch of 64 fits where
the full CausalLM ran out of memory on 65 GiB of logits alone (h200-probes.md). Weights are read from
safetensors only, never unpickled; remote code runs only when asked.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hsx.config import ExtractConfig, HsxError, resolve_layers

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


def resolve_model_path(model: str, revision: str | None, trust_remote_code: bool) -> tuple[str, str | None]:
    """A local folder and the commit hash it holds (None for a plain local folder)."""
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


def finish_truncation(base: torch.nn.Module, depth: int, final_hidden: bool) -> torch.nn.Module:
    layers = decoder_layers(base)
    if len(layers) > depth:  # GPT-OSS loops over all of self.layers whatever num_hidden_layers says
        base.layers = torch.nn.ModuleList(list(layers)[:depth])
    if not final_hidden and isinstance(getattr(base, "norm", None), torch.nn.Module):
        base.norm = torch.nn.Identity()  # its output is not stored; don't compute it
    base.config.use_cache = False
    base.eval().requires_grad_(False)
    return base


def load_model(cfg: ExtractConfig, device: torch.device) -> LoadedModel:
    import transformers
    from transformers import AutoConfig, AutoModel

    path, revision = resolve_model_path(cfg.model, cfg.revision, cfg.trust_remote_code)
    try:
        full = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise HsxError(f"cannot read the config of model {cfg.model!r}: {str(e).splitlines()[0]}") from None
    text = text_config_of(full)
    n = int(text.num_hidden_layers)
    layers, final_hidden = resolve_layers(cfg.layers, n, cfg.final_hidden)
    depth = n if final_hidden else max(layers) + 1
    tcfg = truncated_config(text, depth)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the load report lists every layer we chose not to load
    try:
        base = AutoModel.from_pretrained(
            path, config=tcfg, dtype=TORCH_DTYPES[cfg.dtype], attn_implementation=cfg.attn_implementation,
            use_safetensors=True, trust_remote_code=cfg.trust_remote_code,
            device_map={"": device} if device.type != "cpu" else None,
        )
    except (OSError, ValueError) as e:
        raise HsxError(f"cannot load model {cfg.model!r}: {str(e).splitlines()[0]}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    base = finish_truncation(base, depth, final_hidden).to(device)
    return LoadedModel(base=base, layers=layers, final_hidden=final_hidden, num_model_layers=n, depth=depth,
                       hidden_size=int(text.hidden_size), model_path=path, revision=revision, text_config=tcfg)


def build_random_model(text_config, layers: list[int], final_hidden: bool, device: torch.device,
                       dtype: torch.dtype, attn_implementation: str = "sdpa") -> LoadedModel:
    """A random-weight truncated model from a config, built directly on `device` (benchmarks and tests)."""
    from transformers import AutoModel

    n = int(text_config.num_hidden_layers)
    depth = n if final_hidden else max(layers) + 1
    tcfg = truncated_config(text_config, depth)
    tcfg._attn_implementation = attn_implementation
    with torch.device(device):
        base = AutoModel.from_config(tcfg, dtype=dtype, attn_implementation=attn_implementation)
    base = finish_truncation(base, depth, final_hidden)
    return LoadedModel(base=base, layers=layers, final_hidden=final_hidden, num_model_layers=n, depth=depth,
                       hidden_size=int(text_config.hidden_size), model_path="", revision=None, text_config=tcfg)



def truncated_view(causal: torch.nn.Module, text_config, layers: list[int], final_hidden: bool) -> LoadedModel:
    """A truncated decoder that shares the weights of an already built CausalLM (benchmarks: one copy of the
    weights serves the naive runs and hsx's)."""
    base = causal.get_decoder() if hasattr(causal, "get_decoder") else causal.model
    n = int(text_config.num_hidden_layers)
    depth = n if final_hidden else max(layers) + 1
    view = copy.copy(base)  # shallow: same parameters; its own module table, config and hook dicts below
    view._modules, view._parameters, view._buffers = dict(base._modules), dict(base._parameters), dict(base._buffers)
    view.config = truncated_config(base.config, depth)
    view = finish_truncation(view, depth, final_hidden)
    return LoadedModel(base=view, layers=layers, final_hidden=final_hidden, num_model_layers=n, depth=depth,
                       hidden_size=int(text_config.hidden_size), model_path="", revision=None,
                       text_config=view.config)


def compile_layers(base: torch.nn.Module) -> None:
    """Regional compilation: torch.compile each decoder layer's forward, in place, once per model.

    Layers of one class share one graph (compiled once, ~1 graph per layer type plus one for batch size 1), and
    the capture hooks stay outside the compiled code, so adding or removing them never recompiles."""
    if getattr(base, "_hsx_compiled", False):
        return
    for layer in decoder_layers(base):
        layer.forward = torch.compile(layer.forward, dynamic=True)
    base._hsx_compiled = True
