"""Input rows → token ids and loss masks, once, as a batched `datasets.map` cached under the output dir.

Rows are chat (`messages` or `conversations`, each message {role, content} or ShareGPT {from, value}, plus any
keys the template reads, and optional `tools` and `system` columns; or `prompt` with `completion`/`response`,
TRL's lists of messages, or strings), plain `text`,
or pre-tokenized `input_ids` (+ optional `loss_mask`). Chat rows go through the tokenizer's chat template, one row
per conversation; the loss mask is what the model generates in each assistant turn, end-of-turn token included
(hsx.masks: from `{% generation %}` markers, or derived from the template); of a prompt/completion row, only the
completion's turns. String prompt/completion rows are a user and an assistant turn, or with `prompt_completion:
text` (TRL's standard form, as its SFT reads it) plain text, prompt + completion + eos, supervised on the
completion and eos. A `messages` row `hsx regenerate` wrote (a `generated` column) is supervised on the target's
answers only, on the ids the engine generated (hsx.masks.generated_supervision). `text` rows are supervised on every
token. Rows longer than `max_length` are truncated (and counted); rows that cannot be used get a `skip_reason`
instead of being dropped, so every input row is accounted for. `sample_id` is the row's index in the input
(after concatenating files).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import numpy as np

from hsx import masks as loss_masks
from hsx import render
from hsx.config import ExtractConfig, HsxError
from hsx.schema import ROW_COLUMNS

TOKENIZED_COLUMNS = (*ROW_COLUMNS, "truncated", "skip_reason")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
                  "tool": "tool", "observation": "tool", "function_call": "function_call"}
CHAT_FORMATS = ("messages", "conversations", "prompt+completion", "prompt+response")


# ---- tokenize -----------------------------------------------------------------------------------------------

def row_format(column_names: list[str]) -> str:
    """The row format a dataset's columns say (the first of input_ids, messages, conversations, text,
    prompt+completion, prompt+response that it has)."""
    for fmt in ("input_ids", "messages", "conversations", "text", "prompt+completion", "prompt+response"):
        if all(c in column_names for c in fmt.split("+")):
            return fmt
    alpaca = ("; Alpaca rows (instruction/input/output) are not read: write them as prompt/completion, joining "
              "instruction and input as your trainer does") if {"instruction", "output"} <= set(column_names) else ""
    raise HsxError(f"dataset has none of the columns messages, conversations, text, input_ids, prompt+completion, "
                   f"prompt+response (it has: {', '.join(column_names)}){alpaca}")


def mask_record(column_names: list[str], tokenizer, plain: bool = False) -> dict[str, Any]:
    """How this job's loss masks are made ({"method": markers | derived | given | all_tokens | completion,
    "version"}): part of the job fingerprint (so of the tokenization cache key) and of hsx.json. `plain`: the
    rows are string prompt/completion pairs read as plain text (plain_completion)."""
    fmt = row_format(column_names)
    return {"method": loss_masks.mask_method(fmt, tokenizer, column_names, plain), "version": loss_masks.MASK_VERSION}


def plain_completion(ds, cfg: ExtractConfig) -> bool:
    """Whether the job reads its rows as plain-text prompt/completion pairs: `prompt_completion: text` and both
    columns hold strings (TRL's standard form; lists of messages are chat whatever the key says). HsxError for a
    `system` or `tools` column beside them: plain text has no place for either."""
    fmt = row_format(ds.column_names)
    if cfg.prompt_completion != "text" or not fmt.startswith("prompt+"):
        return False
    if not all(getattr(ds.features.get(c), "dtype", None) in ("string", "large_string", "null")
               for c in fmt.split("+")):
        return False
    extra = [c for c in ("system", "tools") if c in ds.column_names]
    if extra:
        raise HsxError(f"dataset {cfg.dataset}: a {' and a '.join(extra)} column needs the chat template, and "
                       "prompt_completion text reads prompt and completion as plain text; use prompt_completion chat "
                       "or drop the column")
    return True


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
    check_columns(ds, fmt, cfg.dataset)
    chat_format = None
    plain = plain_completion(ds, cfg)
    method = loss_masks.mask_method(fmt, tokenizer, ds.column_names, plain)
    if fmt in CHAT_FORMATS and not plain and not chat_template_text(tokenizer):
        hint = (", --prompt-completion text for string prompts and completions (plain text)"
                if fmt.startswith("prompt+") else "")
        raise HsxError(f"tokenizer {cfg.tokenizer or cfg.model} has no chat template, so it cannot tokenize "
                       f"{fmt!r} rows as chat; give --tokenizer one that has{hint}, or pre-tokenized input_ids")
    loss_masks.check_offsets(method, tokenizer, cfg.tokenizer or cfg.model)
    developer_as = "developer"
    if fmt in CHAT_FORMATS and not plain:
        developer_as = loss_masks.developer_role(tokenizer, dict(cfg.chat_template_kwargs))
        if method == "derived":  # stops here if it cannot be
            chat_format = loss_masks.derive_chat_format(tokenizer, dict(cfg.chat_template_kwargs),  # derived
                                                        name=cfg.tokenizer or cfg.model)
        else:  # (derive_chat_format checks this too)
            render.check_template_bounds(tokenizer, dict(cfg.chat_template_kwargs), cfg.tokenizer or cfg.model)
    features = datasets.Features({
        "sample_id": datasets.Value("int64"),
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "num_tokens": datasets.Value("int32"),
        "truncated": datasets.Value("bool"),
        "skip_reason": datasets.Value("string"),
    })
    if len(ds) == 0:  # (map over 0 rows returns them with their own columns, not these)
        return datasets.Dataset.from_dict({k: [] for k in features}, features=features)
    num_proc = tokenize_processes(cfg.num_proc, len(ds))
    return ds.map(
        tokenize_batch,
        batched=True,
        batch_size=256,
        with_indices=True,
        remove_columns=ds.column_names,
        features=features,
        fn_kwargs={"tokenizer": tokenizer, "fmt": fmt, "max_length": cfg.max_length,
                   "template_kwargs": dict(cfg.chat_template_kwargs), "vocab_size": vocab_size,
                   "chat_format": chat_format, "prompt_completion": "text" if plain else "chat",
                   "developer_as": developer_as},
        num_proc=num_proc,
        cache_file_name=cache_file,
        new_fingerprint=fingerprint,
        desc="tokenizing",
    )


def check_columns(ds, fmt: str, name: str) -> None:
    """What no row of `ds` can get past, checked on the Arrow columns before any row is read (one HsxError line
    instead of a UnicodeDecodeError from inside `map`): text that is not UTF-8 (Arrow's full validation, one pass),
    and pre-tokenized columns of floats or of mixed types. Arrow's JSON reader makes a whole column float when one
    row holds a float, and datasets' makes a column of mixed types JSON, decoding a string "1" as 1: the good rows
    can no longer be told from the bad ones, so no row is skipped, the input is refused. (A column whose rows all
    hold strings, booleans or nulls keeps them: those rows are skipped as bad_input_ids / bad_loss_mask.)"""
    import pyarrow as pa

    for column in ds.column_names:
        try:
            ds.data.column(column).validate(full=True)
        except pa.ArrowInvalid as e:
            where = re.search(r"chunk (\d+).*Invalid UTF8 sequence at string index (\d+)", str(e))
            row = (sum(len(c) for c in ds.data.column(column).chunks[:int(where[1])]) + int(where[2])
                   if where and pa.types.is_string(ds.data.column(column).type) else None)
            raise HsxError(f"dataset {name}: column {column!r} holds text that is not UTF-8"
                           + (f" (row {row})" if row is not None else "") + "; re-encode the input as UTF-8") from None
    if fmt != "input_ids":
        return
    for column, what in (("input_ids", "integer token ids"), ("loss_mask", "0/1 integers")):
        feature = ds.features.get(column)
        inner = getattr(feature, "feature", None)
        dtype = str(getattr(inner, "dtype", ""))
        if dtype.startswith(("float", "double", "halffloat")):
            raise HsxError(f"dataset {name}: column {column!r} holds {dtype} values, not {what}; write them "
                           "as integers (no decimal point)")
        if "Json" in (type(feature).__name__, type(inner).__name__):
            raise HsxError(f"dataset {name}: column {column!r} mixes value types across rows (strings, lists or "
                           f"booleans among integers), which the JSON reader does not keep apart (\"1\" reads as "
                           f"1); make every row a list of {what}")


def tokenize_processes(asked: int | None, rows: int) -> int | None:
    """How many processes tokenize `rows` rows: `asked` (--num-proc) or up to 8 for 20k+ rows, never more than
    the cores this process may run on (more only time-slice the same cores, each with its own tokenizer copy)."""
    n = asked if asked is not None else (8 if rows >= 20_000 else None)
    return None if n is None else min(n, cpu_count())


def cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def tokenize_batch(batch: dict[str, list], indices: list[int], tokenizer, fmt: str, max_length: int,
                   template_kwargs: dict[str, Any], vocab_size: int | None = None,
                   chat_format: loss_masks.ChatFormat | None = None, prompt_completion: str = "chat",
                   developer_as: str = "developer") -> dict[str, list]:
    """The rows of one batch. `prompt_completion` "text": string prompt/completion rows as plain text
    (plain_completion_tokenize); `developer_as`: the role `developer` messages are rendered as
    (hsx.masks.developer_role)."""
    n = len(indices)
    ids: list[list[int]] = [[] for _ in range(n)]
    masks: list[list[int]] = [[] for _ in range(n)]
    reasons = [""] * n
    if fmt == "input_ids":
        for r, (row_ids, row_mask) in enumerate(zip(batch["input_ids"], batch.get("loss_mask", [None] * n))):
            reasons[r] = pretokenized_problem(row_ids, row_mask)
            if not reasons[r]:
                ids[r] = list(row_ids)
                masks[r] = list(row_mask) if row_mask is not None else [1] * len(row_ids)
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
        convs: list[list[dict[str, Any]]] = []
        tools: list[list | None] = []
        prompt_turns: list[int] = []  # messages of a prompt that holds assistant turns (0: none to unsupervise)
        good, plain = [], []
        for r in range(n):
            system = batch["system"][r] if "system" in batch else None
            prompt_len = 0
            if fmt in ("messages", "conversations"):
                conv, reason = normalize_conversation(batch[fmt][r], system)
            else:
                prompt, answer = fmt.split("+")
                if (prompt_completion == "text" and isinstance(batch[prompt][r], str)
                        and isinstance(batch[answer][r], str)):
                    plain.append(r)
                    continue
                conv, reason = prompt_completion_conversation(batch[prompt][r], batch[answer][r], answer, system)
                if not reason:  # (normalizing keeps each message, and may add a system one first)
                    completion = batch[answer][r]
                    prompt_len = len(conv) - (len(completion) if isinstance(completion, list) else 1)
            if reason:
                reasons[r] = reason
                continue
            if developer_as != "developer":
                conv = [{**m, "role": developer_as} if m["role"] == "developer" else m for m in conv]
            good.append(r)
            convs.append(conv)
            tools.append(row_tools(batch["tools"][r]) if "tools" in batch else None)
            prompt_turns.append(prompt_len if any(m["role"] == "assistant" for m in conv[:prompt_len]) else 0)
        if good:
            max_chars = render.render_char_limit(max_length)
            rows = chat_tokenize(tokenizer, convs, template_kwargs, tools, chat_format, max_chars, prompt_turns)
            if "generated" in batch and fmt == "messages":  # a row hsx regenerate wrote: the engine's own ids
                rows = [loss_masks.generated_supervision(tokenizer, row, conv, batch["generated"][r])
                        for r, row, conv in zip(good, rows, convs)]
            for r, row in zip(good, rows):
                ids[r], masks[r], reasons[r] = row
        if plain:
            prompt, answer = fmt.split("+")
            rows = plain_completion_tokenize(tokenizer, [batch[prompt][r] for r in plain],
                                             [batch[answer][r] for r in plain])
            for r, (row_ids, row_mask, reason) in zip(plain, rows):
                ids[r], masks[r], reasons[r] = row_ids, row_mask, reason
    _mixed_formats(batch, fmt, reasons)
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


FORMAT_COLUMNS = ("input_ids", "messages", "conversations", "text", "prompt", "completion", "response")  # row_format's
MISSING = ("missing_value", "missing_prompt", "missing_completion", "missing_response")


def _mixed_formats(batch: dict[str, list], fmt: str, reasons: list[str]) -> None:
    """A row whose format column is null while a column of another format holds a value is a row of another format
    in a file that mixes them (datasets gives every row every column): `mixed_input_formats`, not `missing_value`,
    so the count says what happened."""
    others = [c for c in FORMAT_COLUMNS if c in batch and c not in fmt.split("+")]
    for r, reason in enumerate(reasons):
        if reason in MISSING and any(batch[c][r] is not None for c in others):
            reasons[r] = "mixed_input_formats"


INT32_MAX = 2**31 - 1  # input_ids are stored as int32


def pretokenized_problem(row_ids: Any, row_mask: Any) -> str:
    """The skip reason of a pre-tokenized row ("" when usable). `input_ids` must be a list of integers in int32
    range and `loss_mask` (optional) a list of as many 0s and 1s. Nothing is converted: a float id (1.0 or 0.2), a
    string, a boolean, a nested list or a null is `bad_input_ids` / `bad_loss_mask`, never silently an id or a
    supervised token (a mask of strings, each truthy, would otherwise supervise every token)."""
    # set(map(type, ...)), min, max: C loops, half the time of a Python check per element (168 vs 344 ns here)
    if row_ids is None:
        return "missing_value"
    if not isinstance(row_ids, list):
        return "bad_input_ids"
    if not row_ids:
        return "empty_input"
    if not (set(map(type, row_ids)) <= {int} and -INT32_MAX <= min(row_ids) and max(row_ids) <= INT32_MAX):
        return "bad_input_ids"  # (ids outside the vocabulary are token_id_out_of_range, where it is known)
    if row_mask is None:
        return ""
    if not (isinstance(row_mask, list) and set(map(type, row_mask)) <= {int} and set(row_mask) <= {0, 1}):
        return "bad_loss_mask"
    if len(row_mask) != len(row_ids):
        return "loss_mask_length_mismatch"
    return ""


def normalize_conversation(raw: Any, system: Any = None, need_answer: bool = True) -> tuple[list[dict[str, Any]], str]:
    """A list of messages the template can take ({role, content} plus every other key a message has:
    reasoning_content, thinking, tool_calls, name, tool_call_id, ...), or a skip reason that says what is wrong.

    Each message may be {role, content} or ShareGPT {from, value} (either spelling in either column). Keys whose
    value is null are dropped (an Arrow struct gives every message every key any row has; templates test
    `'tool_calls' in message`), except `content`: an assistant message with `tool_calls` and null content is valid.
    OpenAI content-part lists become their text (message_text); a ShareGPT `function_call` turn becomes an
    assistant message with `tool_calls`. `system` (a row's `system` column) is the system prompt of a
    conversation that has none of its own, neither a system nor a developer message first (as LLaMA-Factory reads
    that column). `need_answer` False: a conversation without an assistant turn is fine (a prompt to answer:
    hsx.regenerate)."""
    if raw is None:
        return [], "missing_value"
    if isinstance(raw, str):  # a CSV cell (CSV holds no lists), or an export that wrote the list as JSON text
        raw = _json_list(raw)
        if raw is None:
            return [], "bad_conversation"
    if not isinstance(raw, list) or len(raw) == 0:
        return [], "empty_conversation"
    conv = []
    for m in raw:
        if not isinstance(m, dict):
            return [], "message_not_a_mapping"
        role = m.get("role") if m.get("role") is not None else m.get("from")
        if role is None:
            return [], "missing_role"
        content_key = "content" if "content" in m and (m["content"] is not None or m.get("value") is None) else "value"
        if content_key not in m:
            return [], "missing_content"
        msg = {k: v for k, v in m.items() if v is not None and k not in ("role", "from", "content", "value")}
        if "tool_calls" in msg:  # a list of mappings (a JSON string of one is read): templates iterate over it, and
            calls = msg["tool_calls"]  # over a string or a number they render characters or nothing
            calls = _json_list(calls) if isinstance(calls, str) else calls
            if not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
                return [], "bad_tool_calls"
            msg["tool_calls"] = [{k: v for k, v in c.items() if v is not None} for c in calls]
            if not msg["tool_calls"]:  # `"tool_calls": []` on a plain answer (OpenAI exports): no calls, as vLLM
                del msg["tool_calls"]  # passes it (Llama 3.1's template takes the key for one call and raises)
        role = SHAREGPT_ROLES.get(str(role).lower(), str(role))
        content, reason = message_text(m[content_key], role)
        if reason:
            return [], reason
        if role == "function_call":  # ShareGPT (LLaMA-Factory): the assistant's call(s) as JSON in `value`
            calls = sharegpt_tool_calls(content)
            if calls is None:
                return [], "bad_function_call"
            role, content, msg = "assistant", None, {**msg, "tool_calls": calls}
        if content is None and not (role == "assistant" and msg.get("tool_calls")):
            return [], "null_content"
        conv.append({"role": role, "content": content, **msg})
    if need_answer and not any(m["role"] == "assistant" for m in conv):
        return [], "no_assistant_turn"
    if isinstance(system, str) and system and conv[0]["role"] not in ("system", "developer"):
        conv.insert(0, {"role": "system", "content": system})
    return conv, ""


def _json(text: str) -> Any:
    """The value JSON text in a row spells, or None where it is not JSON hsx reads (nested 100k deep:
    RecursionError; an int of over 4300 digits: ValueError). Every caller takes a JSON null as nothing too."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _json_list(text: str) -> list | None:
    value = _json(text)
    return value if isinstance(value, list) else None


TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}  # part type -> the
# key of its text: Chat Completions' text and refusal parts, the Responses API's input_text / output_text


def message_text(content: Any, role: str = "user") -> tuple[Any, str]:
    """(content, skip reason) of one message: an OpenAI content-part list of text parts becomes their text joined
    by a newline (what vLLM renders for a template that takes text); a list with an image, audio or any other
    non-text part is `non_text_content` (a text-only model would be trained on an answer about something it
    never saw); a text part without its text is `bad_content`. A tool result's list that is not
    content parts (no item has a `type`) is structured output, kept for the template (Llama 3.1's `tojson`s it);
    other content is kept as it is."""
    if not isinstance(content, list):
        return content, ""
    if role == "tool" and not any(isinstance(p, dict) and "type" in p for p in content):
        return content, ""
    texts = []
    for part in content:
        if not isinstance(part, dict):
            return None, "bad_content"
        kind = part.get("type") or "text"
        if kind not in TEXT_PARTS:
            return None, "non_text_content"
        if not isinstance(part.get(TEXT_PARTS[kind]), str):
            return None, "bad_content"
        texts.append(part[TEXT_PARTS[kind]])
    return "\n".join(texts), ""


def sharegpt_tool_calls(value: Any) -> list[dict[str, Any]] | None:
    """A ShareGPT `function_call` value (a JSON object {name, arguments} or a list of them) as OpenAI tool calls,
    or None if it is not one."""
    calls = _json(value) if isinstance(value, str) else None
    calls = [calls] if isinstance(calls, dict) else calls
    if not (isinstance(calls, list) and calls and all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c for c in calls)):
        return None
    return [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]


def prompt_completion_conversation(prompt: Any, completion: Any, answer_column: str = "completion",
                                   system: Any = None) -> tuple[list[dict[str, Any]], str]:
    """`prompt`/`completion` (or `prompt`/`response`) as chat turns: strings become one user and one assistant
    message; lists of messages (TRL's conversational form) are taken as they are (the prompt's own assistant turns
    are then context, not supervised: chat_tokenize's `contexts`)."""
    if prompt is None or completion is None:
        return [], "missing_prompt" if prompt is None else f"missing_{answer_column}"
    head = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    tail = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
    if not isinstance(head, list) or not isinstance(tail, list):
        return [], "empty_conversation"
    return normalize_conversation(head + tail, system)


def plain_completion_tokenize(tokenizer, prompts: list[str], completions: list[str]) -> list[loss_masks.Row]:
    """TRL's standard prompt-completion, as its SFT trainer reads it: prompt + completion as plain text, eos
    appended to a completion that does not end with it (the model learns to stop), tokenized as `text` rows are
    (the tokenizer's own special tokens added); supervised is every token holding a character of the completion."""
    eos = tokenizer.eos_token or ""
    texts = [p + (c if not eos or c.endswith(eos) else c + eos) for p, c in zip(prompts, completions)]
    if not texts:
        return []
    enc = tokenizer(texts, add_special_tokens=True, return_offsets_mapping=True)
    rows = []
    for row_ids, offsets, prompt in zip(enc["input_ids"], enc["offset_mapping"], prompts):
        start = len(prompt)
        rows.append((list(row_ids), [int(e > start and e > s) for s, e in offsets], ""))
    return rows


def row_tools(raw: Any) -> list | None:
    """A row's `tools` column for the template: a list of tool schemas (a JSON string of one is parsed)."""
    if isinstance(raw, str):
        raw = _json(raw)
    return raw if isinstance(raw, list) and raw else None


def chat_tokenize(tokenizer, convs: list[list[dict[str, Any]]], template_kwargs: dict[str, Any],
                  tools: list | None = None, chat_format: loss_masks.ChatFormat | None = None,
                  max_chars: int = render.RENDER_MIN_CHARS,
                  contexts: list[int] | None = None) -> list[loss_masks.Row]:
    """(input_ids, loss_mask, skip_reason) per conversation, by the template's generation markers when it has
    them, else by turns derived from the template (hsx.masks); the assistant turns among a conversation's first
    `contexts` messages (a prompt/completion row's prompt) are not supervised, each told in the render of the whole
    conversation (masks.derived_mask_tokenize, masks.context_unsupervised: `prompt_turn_unattributed` where a
    marker template's run cannot be told). A conversation the template refuses (a role it
    rejects with raise_exception, content it cannot render, ...) is skipped as `chat_template_error`; one whose
    render runs past the bounds of hsx.render (CPU time; characters, `max_chars`) as
    `chat_template_timeout` / `chat_template_output_too_long`. A row whose tool calls or messages of a role other
    than user, assistant and system the template renders nothing of is skipped as `tool_call_not_rendered` /
    `message_not_rendered` (hsx.masks.unrendered): its mask or its context would be wrong."""
    tools = tools or [None] * len(convs)
    contexts = contexts or [0] * len(convs)

    def checked(row: loss_masks.Row, conv, row_tools) -> loss_masks.Row:
        reason = row[2] or loss_masks.unrendered(tokenizer, conv, row_tools, template_kwargs, max_chars)
        return ([], [], reason) if reason else row

    if loss_masks.GENERATION_TAG.search(chat_template_text(tokenizer) or ""):
        def context_free(row, conv, row_tools, context):
            return loss_masks.context_unsupervised(tokenizer, row, conv, context, row_tools, template_kwargs,
                                                   max_chars)

        if not any(tools):
            firsts = [next(_render_variants(conv)) for conv in convs]
            try:
                rows = _generation_mask_tokenize(tokenizer, firsts, template_kwargs, None, max_chars)
            except Exception:  # noqa: BLE001  (one bad row fails the whole batch: find it row by row)
                rows = None
            if rows is not None:
                results = []
                for row, conv, context in zip(rows, firsts, contexts):
                    with render.row_budget():
                        try:
                            results.append(checked(context_free(row, conv, None, context), conv, None))
                        except render.RenderLimit as e:
                            results.append(([], [], e.reason))
                return results

        def one(conv, row_tools, context):
            row = _generation_mask_tokenize(tokenizer, [conv], template_kwargs, row_tools, max_chars)[0]
            return context_free(row, conv, row_tools, context)
    else:
        fmt = chat_format or loss_masks.derive_chat_format(tokenizer, template_kwargs)

        def one(conv, row_tools, context):
            return loss_masks.derived_mask_tokenize(tokenizer, conv, row_tools, template_kwargs, fmt, max_chars,
                                                    context)
    results = []
    for conv, row_tools, context in zip(convs, tools, contexts):
        with render.row_budget():  # (every render of the row, its variants and checks, together)
            for variant in _render_variants(conv):
                try:
                    results.append(checked(one(variant, row_tools, context), variant, row_tools))
                    break
                except render.RenderLimit as e:  # (another variant would run as long)
                    results.append(([], [], e.reason))
                    break
                except Exception:  # noqa: BLE001
                    continue
            else:
                results.append(([], [], "chat_template_error"))
    return results


def _render_variants(conv: list[dict[str, Any]]):
    """The conversation with tool-call arguments given as a JSON string parsed into a mapping (as vLLM passes
    them: templates such as Llama 3.1's, Mistral's and Qwen2.5's apply `tojson` to them, which would render a
    string as a quoted string), then (only if the template refused it) with the arguments as a JSON string
    (DeepSeek V3 concatenates them), and each with null content as '' (Qwen3's cannot render null content)."""
    parsed = [{**m, "tool_calls": [_parsed_arguments(c) for c in m["tool_calls"]]}
              if isinstance(m.get("tool_calls"), list) else m for m in conv]
    as_text = [{**m, "tool_calls": [_text_arguments(c) for c in m["tool_calls"]]}
               if isinstance(m.get("tool_calls"), list) else m for m in conv]
    seen: list[list[dict[str, Any]]] = []
    for variant in (parsed, as_text):
        for v in (variant, [{**m, "content": "" if m.get("content") is None else m["content"]} for m in variant]):
            if v not in seen:
                seen.append(v)
                yield v


def _with_arguments(call: dict, args: Any) -> dict:
    """`call` with its arguments replaced (OpenAI's {function: {name, arguments}}, or a flat {name, arguments})."""
    if isinstance(call.get("function"), dict):
        return {**call, "function": {**call["function"], "arguments": args}}
    return {**call, "arguments": args}


def _arguments(call: Any) -> Any:
    if not isinstance(call, dict):
        return None
    fn = call["function"] if isinstance(call.get("function"), dict) else call
    return fn.get("arguments")


def _parsed_arguments(call: Any) -> Any:
    """A call whose arguments are a JSON string of a mapping, with the mapping; '' as {} (as vLLM does)."""
    args = _arguments(call)
    if not isinstance(args, str):
        return call
    if not args.strip():
        return _with_arguments(call, {})
    parsed = _json(args)
    return _with_arguments(call, parsed) if isinstance(parsed, dict) else call


def _text_arguments(call: Any) -> Any:
    args = _arguments(call)
    if not isinstance(args, (dict, list)):
        return call
    return _with_arguments(call, json.dumps(args, ensure_ascii=False))


def _generation_mask_tokenize(tokenizer, convs, template_kwargs, tools,
                              max_chars: int = render.RENDER_MIN_CHARS) -> list[loss_masks.Row]:
    """Rendered as text first, its length checked, then rendered and tokenized with the assistant mask: transformers
    renders and tokenizes in one call there, and a render of hundreds of MB reaching the tokenizer aborts the
    process (an allocation it cannot make). The second render costs about what the first does, a small part of
    tokenizing."""
    # (a batch's normal rows take a fraction of its CPU time)
    with render.render_bounds(tokenizer, template_kwargs, tools, max_chars):
        texts = tokenizer.apply_chat_template(convs, tools=tools, tokenize=False, **template_kwargs)
        for text in [texts] if isinstance(texts, str) else texts:
            if len(text) > max_chars:
                raise render.RenderLimit("chat_template_output_too_long", f"the chat template rendered "
                                             f"{len(text):,} characters for one conversation (at most {max_chars:,})")
        enc = tokenizer.apply_chat_template(convs, tools=tools, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **template_kwargs)
    return [(list(i), list(m), "") for i, m in zip(enc["input_ids"], enc["assistant_masks"])]


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
