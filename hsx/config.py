"""What a job is: one dataclass, read from a YAML recipe and overridden by command-line flags.

Every field is a YAML key (snake_case) and a flag (kebab-case); an unknown key is an error, not a warning, so a
typo in a recipe never silently runs the wrong job. Layers are resolved against the model's depth here too:
integers (negatives count from the end) or one preset name (`eagle3`, `dflash`, `dflash-K`), giving sorted,
distinct, non-negative decoder-layer indices.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

LAYER_CONVENTION = (
    "layer i is the output of decoder layer i (0-based), before the final norm: transformers' "
    "output_hidden_states[i+1] for i < N-1 and a forward hook for i = N-1; final_hidden_state is the output of "
    "the final norm (transformers' hidden_states[N]), the input of lm_head"
)


class HsxError(Exception):
    """A problem the user can fix; the CLI prints it as one line and exits non-zero, without a traceback."""


@dataclass
class ExtractConfig:
    # What to run and on what.
    model: str = ""
    revision: str | None = None
    tokenizer: str | None = None  # defaults to the model's own
    dataset: str = ""
    dataset_config: str | None = None
    split: str = "train"
    limit: int | None = None  # only the first N input rows: for trying a recipe out
    # What to capture.
    layers: list[int] | str = field(default_factory=list)
    final_hidden: bool = False
    topk_logits: int = 0  # >0: store the target's top-k logits (values and token ids) per token, from the final norm
    max_length: int = 4096
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Where it goes.
    output_dir: str = ""
    storage_dtype: str = "bfloat16"
    strict: bool = False
    # Publishing (token from HF_TOKEN / `hf auth login`, never recorded).
    push_to_hub: str | None = None  # a Hub dataset repo id
    push_mode: str = "end"  # end: upload once complete; stream: upload units as they are committed
    delete_after_upload: bool = False  # stream mode: remove a unit locally once the Hub has it
    hub_private: bool = True
    hub_revision: str | None = None  # branch to push to (created if missing)
    nonfinite: str = "skip"  # rows whose states hold NaN/Inf: "skip" (counted) or "keep" (flagged in has_nonfinite)
    overwrite: bool = False
    # How fast. None changes which rows, tokens or masks are written; packing and tensor parallelism change the
    # states only within bf16 rounding (dtype, part of the job's fingerprint, by its own precision).
    dtype: str = "bfloat16"
    attn_implementation: str = "sdpa"
    sdpa_backend: str = "flash"  # flash, cudnn, efficient or default (torch's choice); see the README's numbers
    experts_implementation: str = "auto"  # MoE experts: auto (hsx_grouped on CUDA), hsx_grouped, grouped_mm, eager
    packing: str = "auto"  # varlen: each batch as one packed sequence; none: right-padded rows; auto (README)
    gpus_per_copy: int = 1  # >1: each process spreads its model copy over this many GPUs (device_map)
    tp_size: int = 1  # >1: a model copy is sharded over this many processes (transformers' tp_plan="auto")
    token_budget: int | None = None  # tokens per batch, padding included; None picks from the device
    unit_tokens: int | None = None  # tokens per output file (a resumable unit); None: about 2 GiB of states
    compile: str = "auto"  # auto (on for CUDA), on, off
    num_proc: int | None = None  # tokenization processes
    trust_remote_code: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in dataclasses.fields(ExtractConfig)}
STORAGE_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3")
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
EXPERTS_CHOICES = ("auto", "hsx_grouped", "grouped_mm", "eager")  # hsx.moe; the last two are transformers' own


def load_config(path: str | None, overrides: dict[str, Any]) -> ExtractConfig:
    """Read a YAML recipe (optional), apply flag overrides (already typed), and check the result."""
    values: dict[str, Any] = {}
    if path:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise HsxError(f"cannot read config {path}: {e}") from None
        if not isinstance(raw, dict):
            raise HsxError(f"config {path}: expected a mapping of keys to values, got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(FIELDS))
        if unknown:
            raise HsxError(f"config {path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(FIELDS)}")
        values.update(raw)
        values = _resolve_recipe_paths(values, Path(path).parent)
    values.update({k: v for k, v in overrides.items() if v is not None})
    cfg = ExtractConfig(**values)
    check_config(cfg)
    return cfg


def _resolve_recipe_paths(values: dict[str, Any], recipe_dir: Path) -> dict[str, Any]:
    """A relative path in a recipe that does not exist from the working directory but does from the recipe's
    folder is read from there (stored normalized: `recipes/../data/x.jsonl` -> `data/x.jsonl`). Anything else (a
    path that exists here, an absolute path, a Hub id) is left as written."""
    for key in ("model", "tokenizer", "dataset"):
        v = values.get(key)
        if (isinstance(v, str) and v and not os.path.isabs(v) and not Path(v).exists()
                and (recipe_dir / v).exists()):
            values[key] = os.path.normpath(recipe_dir / v)
    return values


def check_config(cfg: ExtractConfig) -> None:
    for name in ("model", "dataset", "output_dir"):
        if not getattr(cfg, name):
            raise HsxError(f"--{name.replace('_', '-')} is required")
    if cfg.layers in ([], "", None):
        raise HsxError("--layers is required: integers (negatives count from the end) or a preset "
                       "(eagle3, dflash, dflash-K)")
    cfg.layers = parse_layer_spec(cfg.layers)
    if cfg.max_length < 1:
        raise HsxError(f"--max-length must be positive, got {cfg.max_length}")
    if cfg.storage_dtype not in STORAGE_DTYPES:
        raise HsxError(f"--storage-dtype {cfg.storage_dtype!r} is not supported; choose from {STORAGE_DTYPES}")
    if cfg.dtype not in COMPUTE_DTYPES:
        raise HsxError(f"--dtype {cfg.dtype!r} is not supported; choose from {COMPUTE_DTYPES}")
    if cfg.push_to_hub:
        from huggingface_hub.utils import validate_repo_id

        try:
            validate_repo_id(cfg.push_to_hub)
        except ValueError as e:
            raise HsxError(f"--push-to-hub {cfg.push_to_hub!r}: {e}") from None
    if cfg.push_mode not in ("end", "stream"):
        raise HsxError(f"--push-mode must be end or stream, got {cfg.push_mode!r}")
    if cfg.delete_after_upload and not (cfg.push_to_hub and cfg.push_mode == "stream"):
        raise HsxError("--delete-after-upload needs --push-to-hub REPO and --push-mode stream")
    if cfg.nonfinite not in ("skip", "keep"):
        raise HsxError(f"--nonfinite must be skip or keep, got {cfg.nonfinite!r}")
    if cfg.experts_implementation not in EXPERTS_CHOICES:
        raise HsxError(f"--experts-implementation must be one of {', '.join(EXPERTS_CHOICES)}, "
                       f"got {cfg.experts_implementation!r}")
    if cfg.sdpa_backend not in ("flash", "cudnn", "efficient", "default"):
        raise HsxError(f"--sdpa-backend must be flash, cudnn, efficient or default, got {cfg.sdpa_backend!r}")
    if cfg.packing not in ("auto", "varlen", "none"):
        raise HsxError(f"--packing must be auto, varlen or none, got {cfg.packing!r}")
    if cfg.compile not in ("auto", "on", "off"):
        raise HsxError(f"--compile must be auto, on or off, got {cfg.compile!r}")
    if cfg.topk_logits < 0:
        raise HsxError(f"--topk-logits must be 0 (off) or positive, got {cfg.topk_logits}")
    if cfg.tp_size < 1:
        raise HsxError(f"--tp-size must be at least 1, got {cfg.tp_size}")
    if cfg.tp_size > 1 and cfg.gpus_per_copy > 1:
        raise HsxError("--tp-size and --gpus-per-copy are two ways to split a model copy: choose one")
    if cfg.gpus_per_copy < 1:
        raise HsxError(f"--gpus-per-copy must be at least 1, got {cfg.gpus_per_copy}")
    if cfg.token_budget is not None and cfg.token_budget < 1:
        raise HsxError(f"--token-budget must be positive, got {cfg.token_budget}")
    if isinstance(cfg.chat_template_kwargs, str):
        try:
            cfg.chat_template_kwargs = json.loads(cfg.chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise HsxError(f"--chat-template-kwargs must be a JSON object: {e}") from None
    if not isinstance(cfg.chat_template_kwargs, dict):
        raise HsxError("chat_template_kwargs must be a mapping")


# ---- layers -------------------------------------------------------------------------------------------------

PRESET_RE = re.compile(r"^(eagle3|dflash(?:-(\d+))?)$")


def parse_layer_spec(spec: list | str | int) -> list[int] | str:
    """Normalise `1,-1`, `[1, -1]`, `"1 -1"` to [1, -1]; leave a preset name as a string (it needs N)."""
    if isinstance(spec, int):
        return [spec]
    if isinstance(spec, (list, tuple)):
        if len(spec) == 1 and isinstance(spec[0], str):
            return parse_layer_spec(spec[0])
        items = [str(x) for x in spec]
        if len(items) == 1 and PRESET_RE.match(items[0].strip()):
            return items[0].strip()
        tokens = [t for item in items for t in re.split(r"[,\s]+", item.strip()) if t]
    else:
        s = str(spec).strip()
        if PRESET_RE.match(s):
            return s
        tokens = [t for t in re.split(r"[,\s]+", s) if t]
    try:
        return [int(t) for t in tokens]
    except ValueError:
        raise HsxError(f"--layers {spec!r}: expected integers or one preset (eagle3, dflash, dflash-K)") from None


def preset_layers(name: str, num_layers: int) -> tuple[list[int], bool]:
    """Layers and whether the final-norm state is included, for a preset on a model of `num_layers` layers."""
    n = num_layers
    m = PRESET_RE.match(name)
    if not m:
        raise HsxError(f"unknown layer preset {name!r}; known: eagle3, dflash, dflash-K")
    if name == "eagle3":
        return [1, n // 2 - 1, n - 4], True
    k = int(m.group(2)) if m.group(2) else 5
    if k < 1:
        raise HsxError(f"layer preset {name!r}: K must be at least 1")
    if k == 1:
        return [n // 2], False
    return [round(1 + j * (n - 4) / (k - 1)) for j in range(k)], False


def resolve_layers(spec: list[int] | str, num_layers: int, final_hidden: bool) -> tuple[list[int], bool]:
    """Turn a layer spec into sorted non-negative indices (and the final-hidden flag a preset may add)."""
    if isinstance(spec, str):
        layers, preset_final = preset_layers(spec, num_layers)
        final_hidden = final_hidden or preset_final
        where = f"preset {spec!r}"
    else:
        layers, where = list(spec), "--layers"
    resolved = []
    for i in layers:
        j = i + num_layers if i < 0 else i
        if not 0 <= j < num_layers:
            raise HsxError(f"{where}: layer {i} is out of range for a model with {num_layers} layers "
                           f"(valid: {-num_layers}..{num_layers - 1})")
        resolved.append(j)
    if len(set(resolved)) != len(resolved):
        raise HsxError(f"{where}: duplicate layers {layers} (resolved: {resolved})")
    return sorted(resolved), final_hidden
