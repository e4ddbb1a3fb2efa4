"""Layers from a draft's own config (`--layers-from DRAFT`): the tap list a drafter trainer keeps in its draft
config, read in that trainer's index convention and turned into hsx's (layer i = the output of decoder layer i,
0-based, before the final norm), checked against the target, with a record of where it came from for hsx.json.

Each format below was read off the peer's own code (the commits are in docs/trainers.md):

- DFlash family, `dflash_config.target_layer_ids` (z-lab DFlash, and SpecForge's DFlash, DFlash2, Domino and
  DSpark configs): 0-based decoder layers. z-lab reads transformers' `hidden_states[id + 1]`
  (`extract_context_feature`); SGLang, SpecForge's capture engine, captures "before layer id + 1". Without the
  key, z-lab's model falls back to `build_target_layer_ids(num_target_layers, num_hidden_layers)` (hsx's
  `dflash-K` preset). A DSpark draft also needs the target's last hidden state (`target_last_hidden_states`):
  SpecForge takes it from SGLang's logits processor, after the final norm, so it is hsx's final_hidden_state.
- SpecForge EAGLE-3, `eagle_config.eagle_aux_hidden_state_layer_ids`: 0-based as above (SGLang's `val + 1`);
  without it SpecForge's `resolve_eagle_capture_layers` default [1, N//2-1, N-4], which is EAGLE's own too
  (SafeAILab's EAGLE-3 keeps no list: it takes the inputs of layers 2, N//2 and N-3). Plus the final-norm state
  (`hidden_state`).
- speculators (`speculators_model_type`): `eagle_aux_hidden_state_layer_ids` (eagle3, peagle) or
  `aux_hidden_state_layer_ids` (dflash and its subclasses dflash2, dspark, xpress) count transformers' / vLLM's hidden
  states, 0 being the embedding output, so hsx's layer is id - 1; its data generation always adds vLLM's layer N (the
  last decoder layer's output before the final norm, its verifier state), hsx's N-1. Without a list,
  `resolve_target_layer_ids`' default [2, N//2, N-3].

A list hsx would store differently from how the trainer reads it is refused (one line naming the key): out of
the target's range, repeated, or not increasing (hsx stores layers, and its exports concatenate them, in
increasing order), as is a draft whose target depth, hidden size or vocabulary is not the target's.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx.errors import HsxError, UsageError, one_line
from hsx.schema import Damaged

MAX_DRAFT_CONFIG_BYTES = 1 << 20  # a draft's config.json is a few KB

ZERO_BASED = ("0-based decoder layers: transformers' hidden_states[id + 1] (z-lab), SGLang's capture before "
              "layer id + 1 (SpecForge)")
HIDDEN_STATE_INDEX = ("transformers' / vLLM's hidden-state index: 0 is the embedding output, id is decoder layer "
                      "id - 1's output; vLLM's N is the last layer's before the final norm")
DFLASH_FAMILY = {"DFlashDraftModel": "DFlash", "DFlash2DraftModel": "DFlash2", "DSparkDraftModel": "DSpark",
                 "DominoDraftModel": "Domino"}
SPECULATORS_KEYS = {"eagle3": "eagle_aux_hidden_state_layer_ids", "peagle": "eagle_aux_hidden_state_layer_ids",
                    "dflash": "aux_hidden_state_layer_ids", "dflash2": "aux_hidden_state_layer_ids",
                    "dspark": "aux_hidden_state_layer_ids", "xpress": "aux_hidden_state_layer_ids"}
KNOWN = ("dflash_config.target_layer_ids (z-lab / SpecForge DFlash, DFlash2, DSpark, Domino), "
         "eagle_config.eagle_aux_hidden_state_layer_ids or draft_vocab_size (SpecForge / EAGLE's EAGLE-3), "
         "speculators_model_type (speculators)")


@dataclass(frozen=True)
class DraftLayers:
    """What a draft config asks of the target, in hsx's terms, and where that came from (`record`: hsx.json's
    `layers_from`)."""
    layers: list[int]
    final_hidden: bool
    record: dict[str, Any] = field(default_factory=dict)


def read_draft_config(draft: str) -> tuple[dict[str, Any], str, str]:
    """(the parsed config.json, where it was read, its sha256) of DRAFT: a .json file, a folder holding
    config.json, or a Hub id (huggingface_hub's cache and HF_HUB_OFFLINE apply). UsageError in one line."""
    from hsx.files import _loads, read_bounded

    if not draft or "\x00" in draft:
        raise UsageError("--layers-from needs a draft config: a config.json, a checkpoint folder or a Hub id")
    path = Path(draft).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.exists():
            raise UsageError(f"--layers-from {draft}: the folder holds no config.json")
    elif not path.exists():
        path = _hub_draft_config(draft)
    # a Hub file is snapshots/<commit>/config.json: the commit says which config it was
    where = str(path) if Path(draft).exists() else f"{draft}@{path.parent.name}"
    try:
        blob = read_bounded(Path(os.path.realpath(path)), MAX_DRAFT_CONFIG_BYTES)
    except HsxError as e:
        raise UsageError(f"--layers-from {draft}: {e}") from None
    except OSError as e:
        raise UsageError(f"--layers-from {draft}: cannot read {path}: {e.strerror or e}") from None
    try:
        config = _loads(blob.decode("utf-8"))
    except Damaged as e:  # a key given twice: json would keep the last, a trainer might read the first
        raise UsageError(f"--layers-from {draft}: {path}: {e}") from None
    except (ValueError, RecursionError) as e:
        raise UsageError(f"--layers-from {draft}: {path} is not a JSON config ({one_line(e, 100)})") from None
    if not isinstance(config, dict):
        raise UsageError(f"--layers-from {draft}: {path} is not a JSON object")
    return config, where, hashlib.sha256(blob).hexdigest()


def _hub_draft_config(repo: str) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except ValueError:
        raise UsageError(f"--layers-from {repo}: no such file or folder, and not a Hub id") from None
    try:
        return Path(hf_hub_download(repo, "config.json"))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        raise UsageError(f"--layers-from {repo}: cannot get its config.json from the Hub: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def draft_layers(draft: str, text_config) -> DraftLayers:
    """The layers (hsx's indices, sorted) and final-norm need of the draft DRAFT (see the module docstring) for a
    target whose text config is `text_config`; UsageError, one line naming the key, where they cannot be."""
    config, where, sha = read_draft_config(draft)
    n = int(text_config.num_hidden_layers)
    try:
        found = _interpret(config, n)
        ids, key, convention, fmt, final_hidden, rule = found
        layers = _to_hsx(ids, key, convention, n)
        _check_target(config, fmt, text_config)
    except UsageError as e:
        raise UsageError(f"--layers-from {draft}: {e}") from None
    if fmt.startswith("speculators"):
        layers = sorted(set(layers) | {n - 1})  # its verifier state, vLLM's layer N, always stored last
    record = {"draft": draft, "config": where, "sha256": sha, "format": fmt, "key": key, "ids": ids,
              "convention": convention, "layers": layers, "final_hidden": final_hidden,
              **({"rule": rule} if rule else {})}
    return DraftLayers(layers, final_hidden, record)


def _get(config: dict, dotted: str):
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _architectures(config: dict) -> list[str]:
    arch = config.get("architectures")
    return [a for a in arch if isinstance(a, str)] if isinstance(arch, list) else []


def _interpret(config: dict, n: int):
    """(ids as written, the key, its convention, the format, final_hidden, the default rule used or None)."""
    kind = config.get("speculators_model_type")
    if kind is not None:
        if kind not in SPECULATORS_KEYS:
            raise UsageError(f"speculators_model_type {kind!r}: hsx knows the layers of "
                             f"{', '.join(SPECULATORS_KEYS)} drafts")
        key = SPECULATORS_KEYS[kind]
        ids, rule = config.get(key), None
        if ids is None:  # speculators.models.utils.resolve_target_layer_ids
            ids, rule = [2, n // 2, n - 3], "speculators' resolve_target_layer_ids default [2, N//2, N-3]"
        return ids, key, HIDDEN_STATE_INDEX, f"speculators-{kind}", False, rule
    if isinstance(config.get("dflash_config"), dict) or any(a in DFLASH_FAMILY for a in _architectures(config)):
        name = next((DFLASH_FAMILY[a] for a in _architectures(config) if a in DFLASH_FAMILY), None)
        method = config.get("dflash_config")
        if method is not None and not isinstance(method, dict):
            raise UsageError(f"dflash_config must be an object, got {type(method).__name__}")
        method = method or {}
        if method.get("projector_type") == "dspark":
            name = "DSpark"
        key = "dflash_config.target_layer_ids"
        ids, rule = method.get("target_layer_ids"), None
        if ids is None:  # z-lab's DFlashDraftModel.__init__ (and SpecForge's DFlash draft model)
            draft_layers_n = config.get("num_hidden_layers")
            if type(draft_layers_n) is not int or draft_layers_n < 1:
                raise UsageError(f"{key} is missing, and num_hidden_layers (the draft's depth, which z-lab's "
                                 "build_target_layer_ids needs without it) is not a positive integer")
            ids = _build_target_layer_ids(n, draft_layers_n)
            rule = "z-lab's build_target_layer_ids(num_target_layers, num_hidden_layers)"
        return ids, key, ZERO_BASED, f"dflash-family ({name or 'DFlash'})", name == "DSpark", rule
    if "eagle_config" in config or "draft_vocab_size" in config or any("Eagle3" in a for a in _architectures(config)):
        eagle = config.get("eagle_config")
        if eagle is not None and not isinstance(eagle, dict):
            raise UsageError(f"eagle_config must be an object, got {type(eagle).__name__}")
        key = "eagle_config.eagle_aux_hidden_state_layer_ids"
        ids, rule = (eagle or {}).get("eagle_aux_hidden_state_layer_ids"), None
        if ids is None:  # SpecForge's resolve_eagle_capture_layers; SafeAILab's inputs of layers 2, N//2, N-3
            ids = [1, n // 2 - 1, n - 4]
            rule = "SpecForge's resolve_eagle_capture_layers default [1, N//2-1, N-4] (EAGLE's own layers)"
        arch = next(iter(_architectures(config)), "EAGLE-3")  # (SpecForge's P-EAGLE takes the same layers)
        return ids, key, ZERO_BASED, f"eagle3-family ({arch})", True, rule
    raise UsageError(f"not a draft config hsx knows: expected one of {KNOWN}")


def _build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab/dflash model.py's rule (round half to even, as Python's round)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + (i * (end - start)) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _to_hsx(ids: Any, key: str, convention: str, n: int) -> list[int]:
    if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
        raise UsageError(f"{key} must be a non-empty list of integers, got {str(ids)[:60]}")
    if len(set(ids)) != len(ids):
        raise UsageError(f"{key} {ids} repeats a layer")
    if ids != sorted(ids):
        raise UsageError(f"{key} {ids} is not in increasing order: hsx stores layers (and its exports concatenate "
                         "them) in increasing order, so the draft would read them in another order")
    if convention == HIDDEN_STATE_INDEX:
        if ids[0] < 1 or ids[-1] > n:
            raise UsageError(f"{key} {ids}: this convention's ids run 1..{n} for a target of {n} layers (0 is the "
                             "embedding output, which hsx does not store)")
        return [i - 1 for i in ids]
    if ids[0] < 0 or ids[-1] > n - 2:
        last = (f"; {n - 1} would be transformers' hidden_states[{n}], the final-norm output (--final-hidden)"
                if ids[-1] == n - 1 else "")
        raise UsageError(f"{key} {ids}: out of range for a target of {n} layers (0..{n - 2} in this "
                         f"convention{last})")
    return list(ids)


def _check_target(config: dict, fmt: str, text_config) -> None:
    """The draft's record of its target (depth, hidden size, vocabulary) against the target's config."""
    n, hidden, vocab = (int(text_config.num_hidden_layers), int(text_config.hidden_size),
                        int(text_config.vocab_size))
    body = config.get("transformer_layer_config") if fmt.startswith("speculators") else config
    prefix = "transformer_layer_config." if fmt.startswith("speculators") else ""
    if not isinstance(body, dict):
        raise UsageError(f"{prefix.rstrip('.') or 'config'} must be an object")
    depth = config.get("num_target_layers")
    if depth is not None and depth != n:
        raise UsageError(f"num_target_layers is {depth!r}, and the target has {n} layers: a draft for another "
                         "target")
    checks = [("target_hidden_size", config.get("target_hidden_size"), hidden)]
    if config.get("target_hidden_size") is None:
        checks.append((prefix + "hidden_size", body.get("hidden_size"), hidden))
    checks.append((prefix + "vocab_size", body.get("vocab_size"), vocab))
    for key, value, want in checks:
        if value is not None and value != want:
            raise UsageError(f"{key} is {value!r}, and the target's is {want}: a draft for another target")
