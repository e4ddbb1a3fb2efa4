"""Input rows → token ids and loss masks, once, as a batched `datasets.map` cached under the output dir.

Rows are chat (`messages` of {role, content}, or ShareGPT `conversations` of {from, value}), plain `text`, or
pre-tokenized `input_ids` (+ optional `loss_mask`). Chat rows go through the tokenizer's chat template; the loss
mask marks exactly the assistant tokens, including each turn's end-of-turn token. It comes from the template's
`{% generation %}` markers when it has them (`return_assistant_tokens_mask`), otherwise from character offsets
of each assistant message in the rendered text. `text` rows are supervised on every token. Rows longer than
`max_length` are truncated (and counted); rows that cannot be used get a `skip_reason` instead of being dropped,
so every input row is accounted for. `sample_id` is the row's index in the input (after concatenating files).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from hsx.config import ExtractConfig, HsxError

TOKENIZED_COLUMNS = ("sample_id", "input_ids", "loss_mask", "num_tokens", "truncated", "skip_reason")
LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


# ---- load ---------------------------------------------------------------------------------------------------

def load_input(cfg: ExtractConfig):
    """The input split as a `datasets.Dataset`: a Hub id, a local file, a folder of files, or a saved dataset."""
    import datasets

    path = Path(cfg.dataset)
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its own "Failed to load JSON" line doubles ours
    try:
        if path.is_dir() and (path / "state.json").exists():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[cfg.split]
        elif path.exists():
            files = _local_files(path)
            builder = LOCAL_BUILDERS[files[0].suffix]
            ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split=cfg.split)
        else:
            ds = datasets.load_dataset(cfg.dataset, cfg.dataset_config, split=cfg.split)
    except HsxError:
        raise
    except Exception as e:  # datasets wraps parse errors; the innermost message names the problem
        raise HsxError(f"cannot read dataset {cfg.dataset}: {_innermost(e)}{_json_line(path, e)}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
    if cfg.limit is not None:
        ds = ds.select(range(min(cfg.limit, len(ds))))
    return ds


def _json_line(path: Path, e: BaseException) -> str:
    """For a JSON Lines file that does not parse, the first line that is not valid JSON (the parser only says
    'Trailing data at position N', which helps nobody find it)."""
    if not (path.is_file() and path.suffix == ".jsonl"):
        return ""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        json.loads(line)
                    except json.JSONDecodeError as bad:
                        return f" (line {number}: {bad.msg})"
    except OSError:
        pass
    return ""


def _local_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix not in LOCAL_BUILDERS:
            raise HsxError(f"{path}: unsupported file type {path.suffix!r}; use {', '.join(LOCAL_BUILDERS)}")
        return [path]
    files = sorted(f for f in path.rglob("*") if f.suffix in LOCAL_BUILDERS and not any(
        part.startswith(".") for part in f.relative_to(path).parts))
    if not files:
        raise HsxError(f"{path}: no {', '.join(LOCAL_BUILDERS)} files in this folder")
    kinds = {LOCAL_BUILDERS[f.suffix] for f in files}
    if len(kinds) > 1:
        raise HsxError(f"{path}: mixed file types ({', '.join(sorted(kinds))}); keep one type per folder")
    return files


def _innermost(e: BaseException) -> str:
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{type(e).__name__}: {first}"


def input_fingerprint(cfg: ExtractConfig, ds) -> dict[str, Any]:
    """What identifies the input data: a local file or folder by its files' names, sizes and sha256 (content,
    not how its path is spelled: hsx.fingerprint); a Hub dataset by its name and datasets' fingerprint."""
    from hsx.fingerprint import files_identity

    path = Path(cfg.dataset)
    if path.exists():  # (datasets' fingerprint of a local file includes temp paths)
        files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
        return {"split": cfg.split, **files_identity(path, files)}
    return {"dataset": cfg.dataset, "split": cfg.split, "fingerprint": ds._fingerprint}


# ---- tokenize -----------------------------------------------------------------------------------------------

def row_format(column_names: list[str]) -> str:
    for fmt in ("input_ids", "messages", "conversations", "text"):
        if fmt in column_names:
            return fmt
    raise HsxError(f"dataset has none of the columns messages, conversations, text, input_ids "
                   f"(it has: {', '.join(column_names)})")


def chat_template_text(tokenizer) -> str | None:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        t = json.dumps(t, sort_keys=True)
    return t


def chat_template_sha256(tokenizer) -> str | None:
    t = chat_template_text(tokenizer)
    return hashlib.sha256(t.encode()).hexdigest() if t else None


def tokenize(ds, tokenizer, cfg: ExtractConfig, cache_file: str, fingerprint: str, vocab_size: int | None = None):
    """One batched `map` over the whole input; returns the tokenized dataset (memory-mapped from `cache_file`).

    `vocab_size` (the model's vocabulary): rows with a token id outside [0, vocab_size) are skipped as
    `token_id_out_of_range` instead of crashing the forward; None checks nothing. The map is cached under
    `fingerprint`, which must change with it (the job fingerprint does: it names the model)."""
    import datasets

    fmt = row_format(ds.column_names)
    if fmt in ("messages", "conversations") and not chat_template_text(tokenizer):
        raise HsxError(f"tokenizer {cfg.tokenizer or cfg.model} has no chat template, so it cannot tokenize "
                       f"{fmt!r} rows; give --tokenizer one that has, or pre-tokenized input_ids")
    features = datasets.Features({
        "sample_id": datasets.Value("int64"),
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "num_tokens": datasets.Value("int32"),
        "truncated": datasets.Value("bool"),
        "skip_reason": datasets.Value("string"),
    })
    num_proc = cfg.num_proc if cfg.num_proc is not None else (min(8, _cpu_count()) if len(ds) >= 20_000 else None)
    return ds.map(
        tokenize_batch,
        batched=True,
        batch_size=256,
        with_indices=True,
        remove_columns=ds.column_names,
        features=features,
        fn_kwargs={"tokenizer": tokenizer, "fmt": fmt, "max_length": cfg.max_length,
                   "template_kwargs": dict(cfg.chat_template_kwargs), "vocab_size": vocab_size},
        num_proc=num_proc,
        cache_file_name=cache_file,
        new_fingerprint=fingerprint,
        desc="tokenizing",
    )


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def tokenize_batch(batch: dict[str, list], indices: list[int], tokenizer, fmt: str, max_length: int,
                   template_kwargs: dict[str, Any], vocab_size: int | None = None) -> dict[str, list]:
    n = len(indices)
    ids: list[list[int]] = [[] for _ in range(n)]
    masks: list[list[int]] = [[] for _ in range(n)]
    reasons = [""] * n
    if fmt == "input_ids":
        for r, (row_ids, row_mask) in enumerate(zip(batch["input_ids"], batch.get("loss_mask", [None] * n))):
            if row_ids is None:
                reasons[r] = "missing_value"
            elif len(row_ids) == 0:
                reasons[r] = "empty_input"
            elif row_mask is not None and len(row_mask) != len(row_ids):
                reasons[r] = "loss_mask_length_mismatch"
            else:
                ids[r] = list(row_ids)
                masks[r] = [1 if m else 0 for m in row_mask] if row_mask is not None else [1] * len(row_ids)
    elif fmt == "text":
        good = [r for r, t in enumerate(batch["text"]) if isinstance(t, str) and t.strip()]
        for r, t in enumerate(batch["text"]):
            if r not in good:
                reasons[r] = "missing_value" if t is None else "empty_text"
        if good:
            enc = tokenizer([batch["text"][r] for r in good], add_special_tokens=True)["input_ids"]
            for r, row_ids in zip(good, enc):
                ids[r], masks[r] = list(row_ids), [1] * len(row_ids)
    else:
        convs: list[list[dict[str, str]]] = []
        good = []
        for r, raw in enumerate(batch[fmt]):
            conv, reason = normalize_conversation(raw, sharegpt=(fmt == "conversations"))
            if reason:
                reasons[r] = reason
            else:
                good.append(r)
                convs.append(conv)
        if good:
            for r, (row_ids, row_mask, reason) in zip(good, chat_tokenize(tokenizer, convs, template_kwargs)):
                ids[r], masks[r], reasons[r] = row_ids, row_mask, reason
    truncated = [False] * n
    for r in range(n):
        if reasons[r]:
            continue
        if vocab_size is not None and ids[r] and (min(ids[r]) < 0 or max(ids[r]) >= vocab_size):
            reasons[r] = "token_id_out_of_range"  # the embedding lookup would fail (or read garbage)
            continue
        if len(ids[r]) > max_length:
            ids[r], masks[r], truncated[r] = ids[r][:max_length], masks[r][:max_length], True
        if not any(masks[r]):
            reasons[r] = "no_supervised_tokens_after_truncation" if truncated[r] else "no_supervised_tokens"
    for r in range(n):
        if reasons[r]:
            ids[r], masks[r], truncated[r] = [], [], False
    return {
        "sample_id": list(indices),
        "input_ids": ids,
        "loss_mask": masks,
        "num_tokens": [len(x) for x in ids],
        "truncated": truncated,
        "skip_reason": reasons,
    }


def normalize_conversation(raw: Any, sharegpt: bool) -> tuple[list[dict[str, str]], str]:
    """A clean [{role, content}] list, or a skip reason."""
    if raw is None:
        return [], "missing_value"
    if not isinstance(raw, list) or len(raw) == 0:
        return [], "empty_conversation"
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    conv = []
    for m in raw:
        if not isinstance(m, dict) or m.get(role_key) is None:
            return [], "missing_value"
        if m.get(content_key) is None:
            return [], "null_content"
        role = str(m[role_key])
        if sharegpt:
            role = SHAREGPT_ROLES.get(role.lower(), role)
        conv.append({"role": role, "content": m[content_key]})
    if not any(m["role"] == "assistant" for m in conv):
        return [], "no_assistant_turn"
    return conv, ""


def chat_tokenize(tokenizer, convs: list[list[dict[str, str]]],
                  template_kwargs: dict[str, Any]) -> list[tuple[list[int], list[int], str]]:
    """(input_ids, loss_mask, skip_reason) per conversation. A conversation the template refuses (a role it
    rejects with raise_exception, content it cannot render, ...) is skipped as `chat_template_error`."""
    if GENERATION_TAG.search(chat_template_text(tokenizer) or ""):
        try:
            return _generation_mask_tokenize(tokenizer, convs, template_kwargs)
        except Exception:  # noqa: BLE001  (one bad row fails the whole batch: find it row by row)
            results = []
            for conv in convs:
                try:
                    results += _generation_mask_tokenize(tokenizer, [conv], template_kwargs)
                except Exception:  # noqa: BLE001
                    results.append(([], [], "chat_template_error"))
            return results
    results = []
    for conv in convs:
        try:
            results.append(offset_mask_tokenize(tokenizer, conv, template_kwargs))
        except Exception:  # noqa: BLE001
            results.append(([], [], "chat_template_error"))
    return results


def _generation_mask_tokenize(tokenizer, convs, template_kwargs) -> list[tuple[list[int], list[int], str]]:
    enc = tokenizer.apply_chat_template(convs, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True, **template_kwargs)
    return [(list(i), list(m), "") for i, m in zip(enc["input_ids"], enc["assistant_masks"])]


def offset_mask_tokenize(tokenizer, conv: list[dict[str, str]],
                         template_kwargs: dict[str, Any]) -> tuple[list[int], list[int], str]:
    """Fallback for templates without generation markers: find each assistant message in the rendered text and
    mark the tokens that overlap it, plus the end-of-turn token that directly follows it.

    Assistant message i is looked for where the template puts it: after the rendering of the messages before it
    with the generation prompt (`conv[:i]`, add_generation_prompt=True), when the full text starts with that.
    Templates that rewrite history (drop earlier reasoning, ...) break that; then the search is sequential, past
    the content of every earlier message (of any role), so text repeated from an earlier turn is not marked."""
    text = tokenizer.apply_chat_template(conv, tokenize=False, **template_kwargs)
    eos = tokenizer.eos_token or ""
    spans, pos = [], 0
    for i, m in enumerate(conv):
        content = m["content"] if isinstance(m["content"], str) else str(m["content"])
        if m["role"] != "assistant":
            found = _find_content(text, content, pos)
            if found is not None:
                pos = found[1]
            continue
        prefix = _rendered_prefix(tokenizer, conv[:i], template_kwargs)
        if prefix is not None and text.startswith(prefix):
            found = _find_content(text, content, len(prefix), anchored=True)
        else:
            found = _find_content(text, content, pos)
        if found is None:
            continue
        start, end = found
        if eos and text.startswith(eos, end):
            end += len(eos)
        spans.append((start, end))
        pos = end
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if not spans:
        return ids, [0] * len(ids), "assistant_not_found_in_template"
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(ids), dtype=bool)
    for s, e in spans:
        mask |= (offsets[:, 0] < e) & (offsets[:, 1] > s)
    return ids, mask.astype(np.int8).tolist(), ""


def _rendered_prefix(tokenizer, head: list[dict[str, str]], template_kwargs: dict[str, Any]) -> str | None:
    """The text the template renders before an assistant turn that follows `head`, or None if it will not."""
    try:
        prefix = tokenizer.apply_chat_template(head, tokenize=False, add_generation_prompt=True, **template_kwargs)
    except Exception:  # noqa: BLE001  (e.g. a template that refuses an empty list or a trailing system turn)
        return None
    return prefix if isinstance(prefix, str) else None


def _find_content(text: str, content: str, pos: int, anchored: bool = False) -> tuple[int, int] | None:
    """[start, end) of `content` in `text` at or after `pos`. Templates may strip whitespace or an earlier turn's
    reasoning; those forms are tried in turn. `anchored`: the content is expected at `pos` (after whitespace)
    and is taken from there when it is; otherwise the first occurrence after `pos` counts."""
    needles = [n for n in dict.fromkeys((content, content.strip(), content.split("</think>")[-1].strip())) if n]
    if anchored:
        at = len(text) - len(text[pos:].lstrip())
        for needle in needles:
            if text.startswith(needle, at):
                return at, at + len(needle)
    for needle in needles:
        start = text.find(needle, pos)
        if start >= 0:
            return start, start + len(needle)
    return None


# ---- accounting ---------------------------------------------------------------------------------------------

def usable_rows(tokenized) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int], int]:
    """(sample_ids, num_tokens) of usable rows, the row positions, skip counts by reason, and the truncated count.

    Reads only the small columns, through Arrow, so it costs no Python per row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = tokenized.data.table if tokenized._indices is None else tokenized.flatten_indices().data.table
    reasons = table.column("skip_reason")
    ok = pc.equal(reasons, "").to_numpy(zero_copy_only=False)
    positions = np.flatnonzero(ok)
    sample_ids = table.column("sample_id").to_numpy()[positions]
    num_tokens = table.column("num_tokens").to_numpy()[positions].astype(np.int64)
    skipped: dict[str, int] = {}
    if not ok.all():
        for item in pc.value_counts(pc.filter(reasons, pc.invert(pa.array(ok, type=pa.bool_())))).to_pylist():
            skipped[item["values"]] = int(item["counts"])
    truncated = int(pc.sum(table.column("truncated")).as_py() or 0)
    return sample_ids, num_tokens, positions, dict(sorted(skipped.items())), truncated


def first_skipped(tokenized) -> tuple[int, str] | None:
    import pyarrow.compute as pc

    table = tokenized.data.table
    bad = np.flatnonzero(pc.not_equal(table.column("skip_reason"), "").to_numpy(zero_copy_only=False))
    if len(bad) == 0:
        return None
    i = int(bad[0])
    return int(table.column("sample_id")[i].as_py()), table.column("skip_reason")[i].as_py()
