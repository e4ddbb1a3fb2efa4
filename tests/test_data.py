"""Input rows -> token ids and loss masks: chat (messages / ShareGPT), text, pre-tokenized; skips; truncation.
Hostile or damaged input (empty, not UTF-8, nested too deeply, bad pre-tokenized values, hostile tool calls, a slow
tokenizer where the masks need offsets, an unusable datasets cache) is a counted skip or one line, never a traceback."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from helpers import HAND_CONVERSATION, LONG_USER, expected_tokenization, write_jsonl
from hsx import data, inputs, masks, render
from hsx.config import ExtractConfig, HsxError

EXPECTED_HAND_TEXT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is the weather today?<|im_end|>\n"
    "<|im_start|>assistant\nThe weather today is sunny.<|im_end|>\n"
    "<|im_start|>user\nAnd the river?<|im_end|>\n"
    "<|im_start|>assistant\nThe river is quiet, and the water is warm.<|im_end|>\n"
)


def tok_batch(tokenizer, fmt, values, max_length=4096, kwargs=None):
    return data.tokenize_batch({fmt: values}, list(range(len(values))), tokenizer, fmt, max_length, kwargs or {})


def runs(mask):
    """[start, stop) of each run of ones."""
    m = np.r_[0, np.asarray(mask, dtype=int), 0]
    d = np.diff(m)
    return list(zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1)))


# ---- chat -----------------------------------------------------------------------------------------------------

def test_hand_checked_conversation_mask(tokenizer):
    out = tok_batch(tokenizer, "messages", [HAND_CONVERSATION])
    ids, mask = out["input_ids"][0], out["loss_mask"][0]
    assert out["skip_reason"] == [""]
    assert len(ids) == len(mask) == out["num_tokens"][0]
    assert tokenizer.decode(ids) == EXPECTED_HAND_TEXT
    r = runs(mask)
    assert len(r) == 2, r
    assert [tokenizer.decode(ids[a:b]) for a, b in r] == [
        "The weather today is sunny.<|im_end|>",
        "The river is quiet, and the water is warm.<|im_end|>",
    ]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    for a, b in r:
        assert ids[b - 1] == im_end  # the end-of-turn token is supervised ...
        assert tokenizer.decode(ids[b:b + 1]) == "\n"  # ... the newline after it is not
        assert tokenizer.decode(ids[:a]).endswith("<|im_start|>assistant\n")  # the header is not
    # nothing else is masked: not the system prompt, the user turns, the headers, or the other <|im_end|>s
    assert sum(mask) == sum(b - a for a, b in r)
    assert sum(1 for i, m in zip(ids, mask) if i == im_end and m) == 2
    assert sum(1 for i, m in zip(ids, mask) if i == im_start and m) == 0


def test_mask_matches_template_rendering(tokenizer):
    """The ids are exactly the template's text tokenized."""
    out = tok_batch(tokenizer, "messages", [HAND_CONVERSATION])
    text = tokenizer.apply_chat_template(HAND_CONVERSATION, tokenize=False)
    assert text == EXPECTED_HAND_TEXT
    assert out["input_ids"][0] == tokenizer(text, add_special_tokens=False)["input_ids"]


def conversations():
    from hsx.demo import chat_rows

    convs = [HAND_CONVERSATION] + [r["messages"] for r in chat_rows(16, seed=5)[:16]]
    convs.append([{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi there, how are you?"},
                  {"role": "user", "content": "Fine."}, {"role": "assistant", "content": "Good to hear it."}])
    return convs


def test_fallback_mask_equals_generation_mask(tokenizer, tokenizer_no_generation):
    convs = conversations()
    assert not masks.GENERATION_TAG.search(tokenizer_no_generation.chat_template)
    assert masks.GENERATION_TAG.search(tokenizer.chat_template)
    gen = tok_batch(tokenizer, "messages", convs)
    fb = tok_batch(tokenizer_no_generation, "messages", convs)
    assert gen["skip_reason"] == fb["skip_reason"] == [""] * len(convs)
    assert fb["input_ids"] == gen["input_ids"]
    for i, (m_gen, m_fb) in enumerate(zip(gen["loss_mask"], fb["loss_mask"])):
        assert m_fb == m_gen, f"conversation {i}"
        assert sum(m_gen) > 0


@pytest.mark.parametrize("conv", [
    [{"role": "user", "content": "Please say: yes."}, {"role": "assistant", "content": "yes."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "a"}],
    [{"role": "system", "content": "yes."}, {"role": "user", "content": "yes."},
     {"role": "assistant", "content": "yes."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "a"}],
    [{"role": "user", "content": "Say 'im' twice."}, {"role": "assistant", "content": "im"},
     {"role": "user", "content": "Again: im"}, {"role": "assistant", "content": "im im"}],
], ids=["content-in-user-turn", "content-in-special-token", "content-in-system-and-user", "repeated-multi-turn",
        "content-in-later-user-turn"])
def test_fallback_mask_when_content_repeats_earlier(tokenizer, tokenizer_no_generation, conv):
    gen = tok_batch(tokenizer, "messages", [conv])
    fb = tok_batch(tokenizer_no_generation, "messages", [conv])
    assert gen["skip_reason"] == fb["skip_reason"] == [""]
    assert fb["input_ids"] == gen["input_ids"]
    assert fb["loss_mask"] == gen["loss_mask"]


# ChatML with a header that counts the messages: no render of a shorter conversation is a prefix of a longer one,
# so where an assistant turn starts cannot be derived from the template: the job stops (one line), no guess.
_COUNTING_TEMPLATE = (
    "{{- '<|im_start|>system\nTurns: ' + (messages|length|string) + '<|im_end|>\n' -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def test_template_whose_turns_cannot_be_derived_stops(tmp_path, chat_data):
    from hsx.demo import build_tokenizer

    counting = build_tokenizer(_COUNTING_TEMPLATE)
    with pytest.raises(HsxError, match=r"no assistant header can be derived; add \{% generation %\} markers .* "
                                       r"loss_mask") as e:
        tok_batch(counting, "messages", [HAND_CONVERSATION])
    assert "\n" not in str(e.value)
    raw = inputs.load_input(cfg_for(chat_data.path))
    with pytest.raises(HsxError, match="no assistant header"):  # before any row is tokenized
        data.tokenize(raw, counting, cfg_for(chat_data.path), str(tmp_path / "t.arrow"), fingerprint="test-tok-count")
    assert not (tmp_path / "t.arrow").exists()


@pytest.mark.parametrize("fixture", ["tokenizer", "tokenizer_no_generation"])
def test_row_the_template_refuses_is_skipped(request, fixture):
    """The demo template raises on role 'tool': that row is skipped, the rest of its batch is tokenized as usual."""
    tok = request.getfixturevalue(fixture)
    good = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    tool = [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "It is 42."}]
    with pytest.raises(Exception, match="Unsupported role"):
        tok.apply_chat_template(tool, tokenize=False)
    out = tok_batch(tok, "messages", [good, tool, HAND_CONVERSATION, tool])
    assert out["skip_reason"] == ["", "chat_template_error", "", "chat_template_error"]
    assert out["input_ids"][1] == out["input_ids"][3] == [] and out["num_tokens"][1] == 0
    alone = tok_batch(tok, "messages", [good, HAND_CONVERSATION])
    assert [out["input_ids"][0], out["input_ids"][2]] == alone["input_ids"]
    assert [out["loss_mask"][0], out["loss_mask"][2]] == alone["loss_mask"]
    assert all(sum(m) > 0 for m in alone["loss_mask"])


def test_sharegpt_equals_messages(tokenizer):
    msgs = HAND_CONVERSATION
    role_to_from = {"system": "system", "user": "human", "assistant": "gpt"}
    share = [{"from": role_to_from[m["role"]], "value": m["content"]} for m in msgs]
    a = tok_batch(tokenizer, "messages", [msgs])
    b = tok_batch(tokenizer, "conversations", [share])
    assert b["skip_reason"] == [""]
    assert (b["input_ids"], b["loss_mask"]) == (a["input_ids"], a["loss_mask"])


def test_sharegpt_bad_rows(tokenizer):
    rows = [[], None, [{"from": "human", "value": "hi"}], [{"from": "human", "value": "hi"}, {"from": "gpt",
                                                                                              "value": None}],
            [{"value": "hi"}, {"from": "gpt", "value": "x"}]]
    out = tok_batch(tokenizer, "conversations", rows)
    assert out["skip_reason"] == ["empty_conversation", "missing_value", "no_assistant_turn", "null_content",
                                  "missing_role"]
    assert out["input_ids"] == [[]] * 5 and out["num_tokens"] == [0] * 5


def test_chat_bad_rows(tokenizer):
    rows = [[], None, [{"role": "user", "content": "hi"}],
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
            [{"role": "system", "content": None}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "ok"}],
            [{"role": None, "content": "hi"}, {"role": "assistant", "content": "ok"}],
            HAND_CONVERSATION]
    out = tok_batch(tokenizer, "messages", rows)
    assert out["skip_reason"] == ["empty_conversation", "missing_value", "no_assistant_turn", "null_content",
                                  "null_content", "missing_role", ""]
    assert out["num_tokens"][-1] > 0 and out["num_tokens"][:-1] == [0] * 6


def _parts(*texts):
    return [{"type": "text", "text": t} for t in texts]


IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}


def test_openai_content_parts_are_their_text():
    """OpenAI content-part lists: text parts are the message's text (joined by '\\n', as vLLM renders them for a
    template that takes text); a row with an image (a text-only model would learn an answer about a picture it
    never saw) or a malformed part is skipped with its reason. A template that renders only string content
    (Qwen3's own, for assistant turns) would otherwise supervise an empty answer."""
    import chat_families as cf

    tok = cf.family("qwen3")
    U = lambda c: {"role": "user", "content": c}  # noqa: E731
    A = lambda c: {"role": "assistant", "content": c}  # noqa: E731
    plain = [U("hi\nthere"), A("hello")]
    rows = [plain, [U(_parts("hi", "there")), A(_parts("hello"))],
            [U(_parts("hi", "there")), A([{**p, "image_url": None} for p in _parts("hello")])],  # (Arrow's nulls)
            [U(_parts("hi") + [IMAGE]), A("hello")], [U([{"type": "text", "text": None}]), A("hello")],
            [U(["hi"]), A("hello")],
            # the Responses API's parts; an unknown part type is not text
            [U([{"type": "input_text", "text": "hi"}, {"type": "input_text", "text": "there"}]),
             A([{"type": "output_text", "text": "hello"}])],
            [U("hi"), A([{"type": "thing", "text": "hello"}])]]
    out = tok_batch(tok, "messages", rows)
    assert out["skip_reason"] == ["", "", "", "non_text_content", "bad_content", "bad_content", "",
                                  "non_text_content"]
    assert out["input_ids"][1] == out["input_ids"][2] == out["input_ids"][6] == out["input_ids"][0]
    assert out["loss_mask"][1] == out["loss_mask"][0]
    assert tok.decode([i for i, m in zip(out["input_ids"][1], out["loss_mask"][1]) if m]).endswith("hello<|im_end|>")


def test_content_parts_read_through_datasets(tmp_path):
    import chat_families as cf

    tok = cf.family("qwen3")
    rows = [{"messages": [{"role": "user", "content": _parts("hi")}, {"role": "assistant", "content": _parts("yes")}]},
            {"messages": [{"role": "user", "content": _parts("look") + [IMAGE]},
                          {"role": "assistant", "content": _parts("a cat")}]}]
    path = write_jsonl(tmp_path / "parts.jsonl", rows)
    cfg = ExtractConfig(model="m", dataset=str(path), layers=[1], output_dir="o")
    out = data.tokenize(inputs.load_input(cfg), tok, cfg, str(tmp_path / "t.arrow"), fingerprint="test-parts")
    assert out["skip_reason"] == ["", "non_text_content"]
    direct = tok_batch(tok, "messages", [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]])
    assert out["input_ids"][0] == direct["input_ids"][0] and out["loss_mask"][0] == direct["loss_mask"][0]


def test_sharegpt_function_call_observation_and_system_column():
    """LLaMA-Factory's ShareGPT: a `function_call` turn (JSON {name, arguments} in `value`) is the assistant's
    tool call, `observation` the tool's answer, and the `system` column the system prompt of a conversation
    without its own: the same row as the OpenAI messages."""
    import json

    import chat_families as cf

    tok = cf.family("qwen3")
    call = {"name": "get", "arguments": {"city": "Paris"}}
    share = [{"from": "human", "value": "weather?"}, {"from": "function_call", "value": json.dumps(call)},
             {"from": "observation", "value": "sunny"}, {"from": "gpt", "value": "It is sunny."}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": call}]},
                {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]
    ref = tok_batch(tok, "messages", [messages])
    own_system = [{"from": "system", "value": "Be brief."}] + share
    bad = [share[0], {"from": "function_call", "value": "get(city='Paris')"}, *share[2:]]
    out = data.tokenize_batch({"conversations": [share, own_system, bad], "system": ["Be brief.", "Other.", "x"]},
                              [0, 1, 2], tok, "conversations", 4096, {})
    assert out["skip_reason"] == ["", "", "bad_function_call"]
    assert out["input_ids"][0] == out["input_ids"][1] == ref["input_ids"][0]  # the conversation's own system wins
    assert out["loss_mask"][0] == ref["loss_mask"][0]
    assert tok.decode([i for i, m in zip(out["input_ids"][0], out["loss_mask"][0]) if m]).startswith(
        '<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>')


def test_trl_conversational_prompt_completion():
    """TRL's conversational prompt-completion: `prompt` (system and user turns) and `completion` (assistant
    turns, tool calls included) are lists of messages: the same row as `messages`; the `system` column too."""
    import chat_families as cf

    tok = cf.family("llama3.1")
    call = [{"type": "function", "function": {"name": "get", "arguments": '{"city": "Paris"}'}}]
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"}]
    completion = [{"role": "assistant", "content": None, "tool_calls": call}]
    ref = tok_batch(tok, "messages", [prompt + completion])
    out = data.tokenize_batch({"prompt": [prompt, prompt[1:]], "completion": [completion, completion],
                               "system": [None, "Be brief."]}, [0, 1], tok, "prompt+completion", 4096, {})
    assert out["skip_reason"] == ["", ""] and ref["skip_reason"] == [""]
    assert out["input_ids"] == ref["input_ids"] * 2 and out["loss_mask"] == ref["loss_mask"] * 2


def test_json_text_conversations_and_tool_calls(tmp_path):
    """A CSV cell holds no list: a `messages` column of JSON text is read as the list it spells, and so is a
    `tool_calls` given as JSON text (templates iterate over it: over a string they would render characters, or
    nothing); what is not such a list is skipped with its reason."""
    import csv
    import json

    import chat_families as cf

    tok = cf.family("qwen3")
    call = [{"type": "function", "function": {"name": "get", "arguments": {"city": "Paris"}}}]
    conv = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": call},
            {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]
    as_text = [*conv[:1], {**conv[1], "tool_calls": json.dumps(call)}, *conv[2:]]
    path = tmp_path / "chat.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["messages"])
        for row in (json.dumps(conv), json.dumps(as_text), "not json", json.dumps({"role": "user"})):
            w.writerow([row])
    cfg = ExtractConfig(model="m", dataset=str(path), layers=[1], output_dir="o")
    out = data.tokenize(inputs.load_input(cfg), tok, cfg, str(tmp_path / "t.arrow"), fingerprint="test-csv-chat")
    ref = tok_batch(tok, "messages", [conv])
    assert out["skip_reason"] == ["", "", "bad_conversation", "bad_conversation"]
    assert out["input_ids"][0] == out["input_ids"][1] == ref["input_ids"][0]
    assert out["loss_mask"][0] == ref["loss_mask"][0] and any(ref["loss_mask"][0])
    bad = [[*conv[:1], {**conv[1], "tool_calls": bad_calls}, *conv[2:]] for bad_calls in (7, "get()", ["get"])]
    assert tok_batch(tok, "messages", bad)["skip_reason"] == ["bad_tool_calls"] * 3


def test_truncation(tokenizer):
    long_answer = [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": LONG_USER}]
    long_prompt = [{"role": "user", "content": LONG_USER}, {"role": "assistant", "content": "Yes."}]
    full = tok_batch(tokenizer, "messages", [long_answer])
    short = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    out = tok_batch(tokenizer, "messages", [long_answer, long_prompt, short], max_length=40)
    assert len(full["input_ids"][0]) > 40
    assert out["truncated"] == [True, False, False]
    assert out["skip_reason"] == ["", "no_supervised_tokens_after_truncation", ""]
    assert out["input_ids"][0] == full["input_ids"][0][:40]
    assert out["loss_mask"][0] == full["loss_mask"][0][:40]
    assert out["num_tokens"][0] == 40


def test_text_rows(tokenizer):
    texts = ["The cat slept on the warm chair.", "", None, "A good question is often more useful."]
    out = tok_batch(tokenizer, "text", texts)
    assert out["skip_reason"] == ["", "empty_text", "missing_value", ""]
    for r in (0, 3):
        assert out["input_ids"][r] == tokenizer(texts[r])["input_ids"]
        assert out["loss_mask"][r] == [1] * len(out["input_ids"][r])
        assert out["num_tokens"][r] == len(out["input_ids"][r]) > 0


def test_input_ids_rows(tokenizer):
    batch = {"input_ids": [[5, 6, 7], [8, 9], [], None, [1, 2, 3], [4, 4]],
             "loss_mask": [[0, 1, 1], None, [], None, [1, 0], [0, 0]]}
    out = data.tokenize_batch(batch, list(range(10, 16)), tokenizer, "input_ids", 4096, {})
    assert out["sample_id"] == list(range(10, 16))
    assert out["skip_reason"] == ["", "", "empty_input", "missing_value", "loss_mask_length_mismatch",
                                  "no_supervised_tokens"]
    assert out["input_ids"][:2] == [[5, 6, 7], [8, 9]]
    assert out["loss_mask"][:2] == [[0, 1, 1], [1, 1]]  # no loss_mask: every token supervised
    out = data.tokenize_batch({"input_ids": [[5, 6, 7, 8]]}, [0], tokenizer, "input_ids", 2, {})
    assert out["input_ids"] == [[5, 6]] and out["truncated"] == [True]


def test_input_ids_out_of_vocab(tokenizer):
    batch = {"input_ids": [[1, 2, 3], [1, 2, 100], [1, -1, 3], [99, 0], [5, 6, 7, 100], [100]]}
    out = data.tokenize_batch(batch, list(range(6)), tokenizer, "input_ids", 4096, {}, vocab_size=100)
    assert out["skip_reason"] == ["", "token_id_out_of_range", "token_id_out_of_range", "", "token_id_out_of_range",
                                  "token_id_out_of_range"]
    assert out["input_ids"] == [[1, 2, 3], [], [], [99, 0], [], []]
    assert out["num_tokens"] == [3, 0, 0, 2, 0, 0]
    # a bad id past max_length still marks the row as bad input (it does not depend on the cut)
    out = data.tokenize_batch(batch, list(range(6)), tokenizer, "input_ids", 3, {}, vocab_size=100)
    assert out["skip_reason"][4] == "token_id_out_of_range" and out["truncated"][4] is False
    # without a vocab size nothing is checked (as before)
    out = data.tokenize_batch(batch, list(range(6)), tokenizer, "input_ids", 4096, {})
    assert out["skip_reason"] == [""] * 6


def test_chat_and_text_rows_out_of_vocab(tokenizer):
    """A --tokenizer whose ids exceed the model's vocabulary: those rows are skipped too."""
    ids = tok_batch(tokenizer, "messages", [HAND_CONVERSATION])["input_ids"][0]
    top = max(ids)
    out = data.tokenize_batch({"messages": [HAND_CONVERSATION]}, [0], tokenizer, "messages", 4096, {},
                              vocab_size=top)
    assert out["skip_reason"] == ["token_id_out_of_range"]
    out = data.tokenize_batch({"messages": [HAND_CONVERSATION]}, [0], tokenizer, "messages", 4096, {},
                              vocab_size=top + 1)
    assert out["skip_reason"] == [""] and out["input_ids"][0] == ids
    text = "The cat slept on the warm chair."
    top = max(tokenizer(text)["input_ids"])
    out = data.tokenize_batch({"text": [text]}, [0], tokenizer, "text", 4096, {}, vocab_size=top)
    assert out["skip_reason"] == ["token_id_out_of_range"]


def test_row_format():
    assert data.row_format(["messages", "id"]) == "messages"
    assert data.row_format(["conversations"]) == "conversations"
    assert data.row_format(["text", "meta"]) == "text"
    assert data.row_format(["input_ids", "text"]) == "input_ids"
    with pytest.raises(HsxError, match="messages"):
        data.row_format(["prompt", "answer"])
    with pytest.raises(HsxError, match="Alpaca rows .* write them as prompt/completion"):
        data.row_format(["instruction", "input", "output"])


def test_chat_template_sha256(tokenizer, tokenizer_no_generation):
    from hsx.demo import CHAT_TEMPLATE

    assert data.chat_template_sha256(tokenizer) == hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()
    assert data.chat_template_sha256(tokenizer) != data.chat_template_sha256(tokenizer_no_generation)


# ---- through datasets -----------------------------------------------------------------------------------------

def cfg_for(path, **kw):
    return ExtractConfig(model="m", dataset=str(path), layers=[1], output_dir="o", **kw)


def test_tokenize_through_datasets(tmp_path, tokenizer, chat_data):
    raw = inputs.load_input(cfg_for(chat_data.path, max_length=160))
    assert len(raw) == len(chat_data.rows)
    tok = data.tokenize(raw, tokenizer, cfg_for(chat_data.path, max_length=160), str(tmp_path / "t.arrow"),
                        fingerprint="test-tok-1")
    assert tok.column_names == list(data.TOKENIZED_COLUMNS)
    assert tok.features["input_ids"].feature.dtype == "int32"
    assert tok.features["loss_mask"].feature.dtype == "int8"
    assert tok["sample_id"] == list(range(len(chat_data.rows)))
    exp = expected_tokenization(chat_data, tokenizer, 160)
    reasons = tok["skip_reason"]
    assert {i: r for i, r in enumerate(reasons) if r} == exp.skip
    sample_ids, num_tokens, positions, skipped, truncated = data.usable_rows(tok)
    assert sorted(sample_ids.tolist()) == sorted(exp.rows)
    assert skipped == exp.skip_counts
    assert truncated == exp.truncated >= 1
    assert truncated == sum(tok["truncated"])
    for sid, n in zip(sample_ids.tolist(), num_tokens.tolist()):
        ids, mask, _ = exp.rows[sid]
        assert n == len(ids) <= 160
        assert tok[positions[sample_ids.tolist().index(sid)]]["input_ids"] == ids
        assert tok[positions[sample_ids.tolist().index(sid)]]["loss_mask"] == mask
    assert data.first_skipped(tok) == (min(exp.skip), exp.skip[min(exp.skip)])
    # the hand conversation (row 0) went through the same map unchanged
    direct = tok_batch(tokenizer, "messages", [HAND_CONVERSATION])
    assert tok[0]["input_ids"] == direct["input_ids"][0] and tok[0]["loss_mask"] == direct["loss_mask"][0]


def test_tokenize_checks_vocab_size_through_datasets(tmp_path):
    path = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [1, 20, 30, 40]}, {"input_ids": [1, 20, 99999]},
                                                {"input_ids": [-3, 4]}, {"input_ids": [7, 8]}])
    cfg = cfg_for(path)
    raw = inputs.load_input(cfg)
    tok = data.tokenize(raw, None, cfg, str(tmp_path / "t.arrow"), fingerprint="test-tok-vocab", vocab_size=512)
    assert tok["skip_reason"] == ["", "token_id_out_of_range", "token_id_out_of_range", ""]
    sample_ids, num_tokens, _, skipped, _ = data.usable_rows(tok)
    assert sample_ids.tolist() == [0, 3] and num_tokens.tolist() == [4, 2]
    assert skipped == {"token_id_out_of_range": 2}
    assert data.first_skipped(tok) == (1, "token_id_out_of_range")


def test_tokenize_chat_without_template_is_an_error(tmp_path, chat_data):
    from hsx.demo import build_tokenizer

    raw = inputs.load_input(cfg_for(chat_data.path))
    with pytest.raises(HsxError, match="chat template"):
        data.tokenize(raw, build_tokenizer(chat_template=None), cfg_for(chat_data.path), str(tmp_path / "t.arrow"),
                      fingerprint="test-tok-2")


def test_load_input_folder_and_limit(tmp_path):
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"text": "a"}, {"text": "b"}])
    write_jsonl(tmp_path / "d" / "b.jsonl", [{"text": "c"}])
    write_jsonl(tmp_path / "d" / ".hidden" / "x.jsonl", [{"text": "zzz"}])
    ds = inputs.load_input(cfg_for(tmp_path / "d"))
    assert ds["text"] == ["a", "b", "c"]
    assert inputs.load_input(cfg_for(tmp_path / "d", limit=2))["text"] == ["a", "b"]


def test_load_input_errors(tmp_path, broken_jsonl):
    with pytest.raises(HsxError, match="cannot read dataset"):
        inputs.load_input(cfg_for(broken_jsonl))
    (tmp_path / "x.xml").write_text("<a/>")
    with pytest.raises(HsxError, match="unsupported"):
        inputs.load_input(cfg_for(tmp_path / "x.xml"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(HsxError):
        inputs.load_input(cfg_for(tmp_path / "empty"))


@pytest.mark.parametrize("layout", ["folders", "hub"])
def test_load_input_splits_like_load_dataset(tmp_path, monkeypatch, layout):
    """A folder with train and test files is two splits, as `load_dataset(DIR)` reads it, never one merged."""
    import datasets

    train, test = [{"text": f"train {i}"} for i in range(3)], [{"text": f"test {i}"} for i in range(2)]
    root = tmp_path / "d"
    if layout == "folders":
        write_jsonl(root / "train" / "part-0.jsonl", train)
        write_jsonl(root / "test" / "part-0.jsonl", test)
    else:  # what `push_to_hub` writes and `snapshot_download` brings back
        write_jsonl(root / "data" / "train-00000-of-00001.jsonl", train)
        write_jsonl(root / "data" / "test-00000-of-00001.jsonl", test)
    reference = datasets.load_dataset(str(root))
    assert inputs.load_input(cfg_for(root))["text"] == reference["train"]["text"] == [r["text"] for r in train]
    assert inputs.load_input(cfg_for(root, split="test"))["text"] == reference["test"]["text"]
    assert inputs.load_input(cfg_for(root, split="test[:1]"))["text"] == ["test 0"]
    with pytest.raises(HsxError, match="validation"):
        inputs.load_input(cfg_for(root, split="validation"))
    monkeypatch.chdir(tmp_path)  # a relative path, as typed
    assert inputs.load_input(cfg_for("d", split="test"))["text"] == reference["test"]["text"]


def test_load_input_csv(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "rows.csv").write_text('text\nhello\n"two, with a comma"\n')
    assert inputs.load_input(cfg_for(tmp_path / "d" / "rows.csv"))["text"] == ["hello", "two, with a comma"]
    assert inputs.load_input(cfg_for(tmp_path / "d"))["text"] == ["hello", "two, with a comma"]


# ---- prompt / completion ----------------------------------------------------------------------------------------

PLAIN_ROWS = [{"prompt": "The sky is", "completion": " blue."},
              {"prompt": "Q: what is the weather?\nA:", "completion": " sunny<|im_end|>"},  # (eos already there)
              {"prompt": None, "completion": " x"}]


def test_standard_prompt_completion_as_plain_text(tmp_path):
    """`prompt_completion: text`: TRL's standard prompt-completion read as its SFT trainer reads it: prompt +
    completion + eos as plain text, no chat template needed, supervised on the completion and the eos only."""
    from hsx.demo import build_tokenizer

    tok = build_tokenizer(None)  # (a base model's: no chat template)
    path = write_jsonl(tmp_path / "pc.jsonl", PLAIN_ROWS)
    cfg = ExtractConfig(model="m", dataset=str(path), layers=[1], output_dir="o", prompt_completion="text")
    ds = inputs.load_input(cfg)
    assert data.plain_completion(ds, cfg)
    assert data.mask_record(ds.column_names, tok, data.plain_completion(ds, cfg))["method"] == "completion"
    out = data.tokenize(ds, tok, cfg, str(tmp_path / "t.arrow"), fingerprint="test-plain")
    assert out["skip_reason"] == ["", "", "missing_prompt"]
    for k, (prompt, completion) in enumerate([("The sky is", " blue.<|im_end|>"),
                                              ("Q: what is the weather?\nA:", " sunny<|im_end|>")]):
        ids, mask = out["input_ids"][k], out["loss_mask"][k]
        assert ids == tok(prompt + completion)["input_ids"]
        assert tok.decode([i for i, m in zip(ids, mask) if m]) == completion  # the eos once, and nothing before
        assert mask[-1] == 1 and not any(mask[:len(tok(prompt)["input_ids"]) - 1])


def test_standard_prompt_completion_default_is_chat(tmp_path, tokenizer):
    """By default string prompt/completion rows are a user and an assistant turn through the chat template (what a
    chat server renders for the drafter's target); a tokenizer without a template says which key reads them as text."""
    from hsx.demo import build_tokenizer

    assert ExtractConfig().prompt_completion == "chat"
    path = write_jsonl(tmp_path / "pc.jsonl", PLAIN_ROWS[:1])
    cfg = ExtractConfig(model="m", dataset=str(path), layers=[1], output_dir="o")
    ds = inputs.load_input(cfg)
    assert not data.plain_completion(ds, cfg)
    out = data.tokenize(ds, tokenizer, cfg, str(tmp_path / "t.arrow"), fingerprint="test-chat-pc")
    ref = tok_batch(tokenizer, "messages", [[{"role": "user", "content": "The sky is"},
                                             {"role": "assistant", "content": " blue."}]])
    assert out["input_ids"][0] == ref["input_ids"][0] and out["loss_mask"][0] == ref["loss_mask"][0]
    with pytest.raises(HsxError, match="no chat template.*--prompt-completion text"):
        data.tokenize(ds, build_tokenizer(None), cfg, str(tmp_path / "u.arrow"), fingerprint="test-chat-pc-none")


def test_plain_text_prompt_completion_takes_messages_as_chat_and_refuses_system(tmp_path, tokenizer):
    """TRL's conversational form (lists of messages) is chat whatever prompt_completion says; a `system` column
    beside string prompts has no place in plain text: one error line, not a dropped system prompt."""
    conv = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "hello"}]}
    path = write_jsonl(tmp_path / "conv.jsonl", [conv])
    cfg = ExtractConfig(model="m", dataset=str(path), layers=[1], output_dir="o", prompt_completion="text")
    ds = inputs.load_input(cfg)
    assert not data.plain_completion(ds, cfg)
    out = data.tokenize(ds, tokenizer, cfg, str(tmp_path / "t.arrow"), fingerprint="test-conv-text")
    assert out["input_ids"][0] == tok_batch(tokenizer, "messages", [conv["prompt"] + conv["completion"]])["input_ids"][0]
    path = write_jsonl(tmp_path / "sys.jsonl", [{**PLAIN_ROWS[0], "system": "Be brief."}])
    cfg = ExtractConfig(model="m", dataset=str(path), layers=[1], output_dir="o", prompt_completion="text")
    with pytest.raises(HsxError, match="system column needs the chat template"):
        data.plain_completion(inputs.load_input(cfg), cfg)


@pytest.mark.parametrize("name", ["markers", "qwen3", "llama3.1", "harmony", "mistral"])
def test_conversational_prompt_completion_supervises_the_completion_only(name):
    """TRL trains a conversational prompt-completion row on the completion: an assistant turn inside the prompt
    (few-shot, an earlier exchange) is context, not supervised; the same conversation as `messages` supervises
    both turns."""
    import chat_families as cf
    from hsx.demo import build_tokenizer

    tok = build_tokenizer() if name == "markers" else cf.family(name)
    prompt = [{"role": "user", "content": "first?"}, {"role": "assistant", "content": "one"},
              {"role": "user", "content": "second?"}]
    completion = [{"role": "assistant", "content": "two"}]
    whole = tok_batch(tok, "messages", [prompt + completion])
    out = data.tokenize_batch({"prompt": [prompt], "completion": [completion]}, [0], tok, "prompt+completion",
                              4096, {})
    assert out["skip_reason"] == [""] and out["input_ids"] == whole["input_ids"]
    supervised = [tok.decode(whole["input_ids"][0][a:b]) for a, b in runs(whole["loss_mask"][0])]
    assert len(supervised) == 2 and "one" in supervised[0] and "two" in supervised[1]
    assert [tok.decode(out["input_ids"][0][a:b]) for a, b in runs(out["loss_mask"][0])] == supervised[1:]


# Templates with generation markers whose prompt rendered alone is not a prefix of the whole row's render: the
# last assistant turn gets an (empty) think block, as Qwen3's does; the same with the whole turn, header and newline
# included, one generation block (as TRL's training templates wrap it: two answers in a row are one run of tokens);
# a system header counts the messages; the same header, and an answer, its tool calls and the last turn's think
# block in generation blocks apart (a newline outside them); the same, refusing a tool it does not know.
_LAST_THINKS = (
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}{%- generation %}"
    "{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{{- m.content + '<|im_end|>' }}"
    "{%- endgeneration %}{{- '\\n' }}{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
_WHOLE_TURN = (_LAST_THINKS.replace("{{- '<|im_start|>assistant\\n' }}{%- generation %}",
                                    "{%- generation %}{{- '<|im_start|>assistant\\n' }}")
               .replace("{%- endgeneration %}{{- '\\n' }}", "{{- '\\n' }}{%- endgeneration %}"))
_COUNTED = ("{{- '<|im_start|>system\\n' + (messages | length | string) + ' messages<|im_end|>\\n' }}"
            + _LAST_THINKS.replace("loop.last", "false"))
_SPLIT_BLOCKS = (
    "{{- '<|im_start|>system\\n' + (messages | length | string) + ' messages<|im_end|>\\n' }}"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.last %}{%- generation %}{{- '<think>\\n\\n</think>' }}{%- endgeneration %}{{- '\\n' }}{%- endif %}"
    "{%- generation %}{{- m.content or '' }}{%- endgeneration %}"
    "{%- for c in m.tool_calls or [] %}{{- '\\n' }}{%- generation %}"
    "{{- '<tool_call>' + c.function.name + '</tool_call>' }}{%- endgeneration %}{%- endfor %}"
    "{%- generation %}{{- '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
_KNOWN_TOOLS = _SPLIT_BLOCKS.replace("{%- for c in m.tool_calls or [] %}", "{%- for c in m.tool_calls or [] %}"
                                     "{%- if c.function.name != 'get' %}{{- raise_exception('no such tool') }}"
                                     "{%- endif %}")
_MARKED = {"last_thinks": _LAST_THINKS, "whole_turn": _WHOLE_TURN, "counted": _COUNTED,
           "split_blocks": _SPLIT_BLOCKS, "known_tools": _KNOWN_TOOLS}
_FEW_SHOT = [{"role": "user", "content": "first?"}, {"role": "assistant", "content": "one"},
             {"role": "user", "content": "second?"}, {"role": "assistant", "content": "two"}]
_ASKED = [*_FEW_SHOT, {"role": "user", "content": "third?"}]
_CALL = [{"type": "function", "function": {"name": "get", "arguments": "{}"}}]
_TOOL_PROMPT = [{"role": "user", "content": "first?"}, {"role": "assistant", "content": "one"},
                {"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": _CALL},
                {"role": "tool", "content": "sunny"}]
_COMPLETION = [{"role": "assistant", "content": "three"}]


def completion_only(name, prompt):
    """(tokenizer, the row as `messages`, the mask that supervises only the completion's turn): the tokens of the
    `messages` mask from the completion's header on (every template here is ChatML)."""
    import chat_families as cf
    from hsx.demo import build_tokenizer

    tok = cf.family(name) if name in cf.FAMILIES else build_tokenizer(_MARKED[name])
    whole = tok_batch(tok, "messages", [prompt + _COMPLETION])
    assert whole["skip_reason"] == [""]
    text = tok.apply_chat_template(prompt + _COMPLETION, tokenize=False)
    assert not text.startswith(tok.apply_chat_template(prompt, tokenize=False))  # the case: they diverge
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == whole["input_ids"][0]
    header = text.rindex("<|im_start|>assistant")
    expected = [int(m and s >= header) for m, (s, _) in zip(whole["loss_mask"][0], enc["offset_mapping"])]
    assert 0 < sum(expected) < sum(whole["loss_mask"][0])  # the prompt's turns are supervised as `messages`
    assert tok.decode([i for i, m in zip(whole["input_ids"][0], expected) if m]).removeprefix(
        "<|im_start|>assistant\n").replace("<think>\n\n</think>", "").strip("\n") == "three<|im_end|>"
    return tok, whole, expected


def completion_row(tok, prompt):
    return data.tokenize_batch({"prompt": [prompt], "completion": [_COMPLETION]}, [0], tok, "prompt+completion",
                               4096, {})


@pytest.mark.parametrize("name, prompt", [("qwen3", _FEW_SHOT), ("last_thinks", _FEW_SHOT), ("whole_turn", _FEW_SHOT),
                                          ("counted", _FEW_SHOT), ("counted", _ASKED), ("split_blocks", _TOOL_PROMPT),
                                          ("known_tools", _TOOL_PROMPT)])
def test_prompt_turns_unsupervised_where_the_prompt_alone_renders_otherwise(name, prompt):
    """The prompt's assistant turns are context even where the template renders the prompt alone differently from
    the same turns inside the whole row (Qwen3 gives the last turn a think block; a header that counts messages):
    the mask is exactly the completion's part of the mask the same conversation gets as `messages`, each span
    told to its message in the whole row's render, not by a prefix shared with the prompt rendered alone. A
    generation block that holds only a think block or an end token is told by the messages around it."""
    tok, whole, expected = completion_only(name, prompt)
    out = completion_row(tok, prompt)
    assert out["skip_reason"] == [""] and out["input_ids"] == whole["input_ids"]
    ids = whole["input_ids"][0]
    assert out["loss_mask"][0] == expected, [tok.decode(ids[a:b]) for a, b in runs(out["loss_mask"][0])]
    if name in _MARKED:  # a row with tools takes the markers' row-by-row path: the same mask
        tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object", "properties": {}}}}]
        batch = {"prompt": [prompt], "completion": [_COMPLETION], "tools": [tools]}
        assert data.tokenize_batch(batch, [0], tok, "prompt+completion", 4096, {})["loss_mask"] == out["loss_mask"]


@pytest.mark.parametrize("name, prompt, told", [("counted", _ASKED, True), ("split_blocks", _TOOL_PROMPT, True),
                                                ("whole_turn", _FEW_SHOT, False), ("counted", _FEW_SHOT, False)])
def test_prompt_turns_told_without_the_renderers_blocks(monkeypatch, name, prompt, told):
    """Where transformers' renderer gives no generation blocks (it is not a public function), the runs of supervised
    tokens are told by the messages around them: a prompt that ends with a user turn or a tool result is told; one
    that ends with an answer is skipped (its run and the completion's may be one run), not guessed."""
    tok, whole, expected = completion_only(name, prompt)
    monkeypatch.setattr(masks, "_generation_blocks", lambda *a, **k: None)
    out = completion_row(tok, prompt)
    if told:
        assert out["skip_reason"] == [""] and out["loss_mask"][0] == expected
    else:
        assert out["skip_reason"] == ["prompt_turn_unattributed"]


def test_prompt_turn_not_attributable_is_skipped():
    """A supervised block no message's text can be told to: the last turn's think block is a generation block of
    its own, after the prompt's last turn (an answer) and before the completion's text, and the prompt alone
    renders otherwise (a header counts the messages). The row is skipped with its reason, never kept with a mask
    that may supervise the prompt's turn or drop the completion's; a prompt ending with a tool result (which comes
    between the two turns) is told apart."""
    from hsx.demo import build_tokenizer

    tok = build_tokenizer(_SPLIT_BLOCKS)
    out = data.tokenize_batch({"prompt": [_FEW_SHOT, _TOOL_PROMPT], "completion": [_COMPLETION] * 2}, [0, 1], tok,
                              "prompt+completion", 4096, {})
    assert out["skip_reason"] == ["prompt_turn_unattributed", ""]


import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

from helpers import LONG_DIGITS, assert_one_error_line, fault_argv, hsx_main, the_error_line  # noqa: E402
import hsx  # noqa: E402


# ---- the input: empty, missing, not UTF-8, nested too deeply, an unusable cache ------------------------------------

def test_num_proc_is_capped_at_the_cores_this_process_may_use():
    cores = data.cpu_count()
    assert data.tokenize_processes(100000, 10) == cores
    assert data.tokenize_processes(None, 50_000) == min(8, cores)
    assert data.tokenize_processes(None, 10) is None


@pytest.mark.parametrize("kind", ["jsonl", "blank-jsonl", "parquet"])
def test_an_empty_input_is_zero_rows_not_a_traceback(tmp_path, model4, kind):
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "empty.parquet"
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    else:
        path = tmp_path / "empty.jsonl"
        path.write_text("" if kind == "jsonl" else "\n \n")
    rc, _, err = hsx_main(fault_argv(model4.path, path, tmp_path / "a"))
    assert rc == 1
    assert_one_error_line(rc, err, "has no rows", "--allow-empty")
    assert "StopIteration" not in err
    rc, _, err = hsx_main(fault_argv(model4.path, path, tmp_path / "b", "--allow-empty"))
    assert rc == 0, err
    import hsx

    assert len(hsx.load(tmp_path / "b")) == 0


def test_a_missing_offline_hub_dataset_says_what_and_where(tmp_path, model4):
    rc, _, err = hsx_main(fault_argv(model4.path, "nobody-hsx/no-such-dataset", tmp_path / "out"))
    line = assert_one_error_line(rc, err, "nobody-hsx/no-such-dataset", "datasets' cache",
                                 os.environ["HF_DATASETS_CACHE"])
    assert "None" not in line


def test_an_unusable_datasets_cache_is_named_not_the_dataset(tmp_path, model4, small_chat_path, monkeypatch):
    """HF_DATASETS_CACHE (or HF_HOME) naming a file: 'no file or folder <the dataset>' (which exists) or a raw
    FileExistsError; now the cache is named."""
    import datasets

    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", afile / "datasets")
    rc, _, err = hsx_main(fault_argv(model4.path, small_chat_path, tmp_path / "o"))
    line = the_error_line(err)
    assert rc == 1 and f"datasets' cache {afile / 'datasets'} cannot be used" in line, line


def test_a_jsonl_line_nested_too_deeply_is_one_line_not_a_crash(tmp_path, model4):
    """pyarrow's JSON reader (datasets') crashed the process with a segmentation fault on a line nested 100,000
    levels deep; now the line is named. Brackets inside strings, and nesting of a few hundred levels, still load."""
    import subprocess
    import sys

    from helpers import child_env

    good = {"messages": [{"role": "user", "content": "[" * 5000 + "{"}, {"role": "assistant", "content": "ok"}]}
    data = tmp_path / "deep.jsonl"
    data.write_text(json.dumps(good) + "\n" + '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    argv = [sys.executable, "-m", "hsx", *fault_argv(model4.path, data, tmp_path / "out")]
    res = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 1, (res.returncode, res.stderr[-2000:])
    lines = [line for line in res.stderr.splitlines() if line.startswith("hsx: error: ")]
    assert len(lines) == 1 and "line 2 nests JSON too deeply" in lines[0], res.stderr[-2000:]
    from hsx.inputs import check_json_nesting

    data.write_text(json.dumps(good) + "\n" + '{"messages": ' + "[" * 300 + "]" * 300 + "}\n")
    check_json_nesting(data)  # (no error: a string full of brackets, and 300 levels, are fine)


def _tokenize_file(tmp_path, content: bytes):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    cfg = ExtractConfig(model="m", dataset=str(path), layers=[1], output_dir="o")
    raw = inputs.load_input(cfg)
    return data.tokenize(raw, None, cfg, str(tmp_path / "t.arrow"), fingerprint=f"untrusted-{hash(content)}")


@pytest.mark.parametrize("content", [
    b'{"text": "fine"}\n{"text": "caf\xe9 au lait"}\n',  # Latin-1, not UTF-8
    b'{"messages": [{"role": "user", "content": "h\xffi"}, {"role": "assistant", "content": "x"}]}\n',
    b'{"input_ids": [1, 2], "note": "\xc3"}\n',  # in a column hsx does not even use
])
def test_non_utf8_jsonl_is_one_clear_error(tmp_path, content):
    with pytest.raises(HsxError, match="not UTF-8"):
        _tokenize_file(tmp_path, content)


def test_non_utf8_jsonl_through_the_cli_is_one_line(tmp_path, model4):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "caf\xe9 au lait"}\n')
    rc, _, err = hsx_main(fault_argv(model4.path, path, tmp_path / "o"))
    assert_one_error_line(rc, err, "not UTF-8", "row 0", prefix="hsx: error: ")


# ---- bad values in pre-tokenized rows: a counted skip, or one clear error ------------------------------------------

@pytest.mark.parametrize(("ids", "mask", "reason"), [
    ([1.0, 2.0], None, "bad_input_ids"),
    ([0.2, 1], None, "bad_input_ids"),
    (["1", "2"], None, "bad_input_ids"),
    ([[1, 2]], None, "bad_input_ids"),
    ([1, None], None, "bad_input_ids"),
    ([True, False], None, "bad_input_ids"),
    ("1 2 3", None, "bad_input_ids"),
    (7, None, "bad_input_ids"),
    ([1, 2 ** 40], None, "bad_input_ids"),
    (None, None, "missing_value"),
    ([1, 2], ["0", "1"], "bad_loss_mask"),  # strings: each truthy, so once every token was supervised
    ([1, 2], ["", "x"], "bad_loss_mask"),
    ([1, 2], [0.2, 1], "bad_loss_mask"),
    ([1, 2], [True, False], "bad_loss_mask"),
    ([1, 2], [2, 1], "bad_loss_mask"),
    ([1, 2], [-1, 1], "bad_loss_mask"),
    ([1, 2], [[1], [0]], "bad_loss_mask"),
    ([1, 2], [1, None], "bad_loss_mask"),
    ([1, 2], "11", "bad_loss_mask"),
    ([1, 2], [1], "loss_mask_length_mismatch"),
    ([1, 2], [0, 1], ""),
])
def test_bad_pretokenized_values_are_counted_skips(ids, mask, reason):
    batch = {"input_ids": [ids, [3, 4]], "loss_mask": [mask, None]}
    out = data.tokenize_batch(batch, [0, 1], None, "input_ids", 4096, {})
    assert out["skip_reason"] == [reason, ""]
    assert out["input_ids"][1] == [3, 4] and out["loss_mask"][1] == [1, 1]
    if reason:
        assert out["input_ids"][0] == [] and out["num_tokens"][0] == 0
    else:
        assert out["loss_mask"][0] == [0, 1]


def test_bad_rows_through_datasets_are_counted(tmp_path):
    rows = [{"input_ids": [1, 2, 3], "loss_mask": [True, True, False]}, {"input_ids": [1, 2], "loss_mask": None},
            {"input_ids": [4, None]}, {"input_ids": [4, 5], "loss_mask": [False, True]}, {"input_ids": None}]
    tok = _tokenize_file(tmp_path, b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    assert tok["skip_reason"] == ["bad_loss_mask", "", "bad_input_ids", "bad_loss_mask", "missing_value"]
    _, _, _, skipped, _ = data.usable_rows(tok)
    assert skipped == {"bad_loss_mask": 2, "bad_input_ids": 1, "missing_value": 1}


@pytest.mark.parametrize(("rows", "needle"), [
    ([{"input_ids": [1, 2]}, {"input_ids": [0.2, 1]}], "'input_ids' holds float64"),
    ([{"input_ids": [1, 2], "loss_mask": [0.2, 1]}, {"input_ids": [1, 2], "loss_mask": [1, 1]}],
     "'loss_mask' holds float64"),
    # datasets reads a column of mixed types as JSON and decodes the string "0" as 0: refused, not guessed
    ([{"input_ids": [5, 6], "loss_mask": ["0", "1"]}, {"input_ids": [5, 6], "loss_mask": [1, 1]}],
     "'loss_mask' mixes value types"),
    ([{"input_ids": [[1], [2]]}, {"input_ids": [4, 5]}], "'input_ids' mixes value types"),
    ([{"input_ids": ["7", "8"]}, {"input_ids": [4, 5]}], "'input_ids' mixes value types"),
])
def test_a_float_or_mixed_column_is_one_clear_error(tmp_path, rows, needle):
    """Arrow makes the whole column float when one row holds a float: the integer rows cannot be told apart."""
    with pytest.raises(HsxError, match=needle):
        _tokenize_file(tmp_path, b"".join(json.dumps(r).encode() + b"\n" for r in rows))


def test_a_string_loss_mask_supervises_nothing_end_to_end(tmp_path, model4):
    path = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [5, 6, 7], "loss_mask": ["0", "0", "1"]},
                                                {"input_ids": [5, 6, 7, 8]}])
    rc, _, err = hsx_main(fault_argv(model4.path, path, tmp_path / "o"))
    assert rc == 0, err
    info = json.loads((tmp_path / "o" / "hsx.json").read_text())
    assert info["counts"]["rows_written"] == 1 and info["counts"]["skipped"] == {"bad_loss_mask": 1}
    assert hsx.load(str(tmp_path / "o"))["loss_mask"] == [[1, 1, 1, 1]]  # no loss_mask: every token


# ---- hostile chat rows: rendered without what is broken, or a counted skip, never a traceback ----------------------

def test_hostile_tools_and_tool_calls_are_no_traceback(tmp_path, model4):
    """A `tools` or tool-call `arguments` string nested 100k deep (json.loads: RecursionError) and a `tool_calls`
    that is not a list: each row is rendered without them or skipped with a reason, never a traceback."""
    deep = "[" * 100_000
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
             "tools": deep},
            {"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": None,
                           "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": deep}}]}]},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo",
                                                              "tool_calls": 7}]}]
    path = tmp_path / "hostile.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    rc, _, err = hsx_main(["extract", "--model", str(model4.path), "--dataset", str(path), "--layers", "1",
                           "--output-dir", str(tmp_path / "out"), "--allow-empty"])
    assert "Traceback" not in err and "RecursionError" not in err, err
    assert rc == 0, err


def test_a_rows_tools_or_tool_arguments_with_a_number_too_long_is_not_json(tmp_path):
    """A dataset row's `tools` string or a tool call's `arguments` holding a 5000-digit number: taken as text
    (as any string that is not JSON), not a ValueError out of the tokenizing map."""
    from hsx.data import _parsed_arguments, row_tools

    assert row_tools(f'[{{"n": {LONG_DIGITS}}}]') is None
    call = {"function": {"name": "f", "arguments": f'{{"n": {LONG_DIGITS}}}'}}
    assert _parsed_arguments(call) == call


DEEP = '{"a":' * 980 + "1" + "}" * 980


@pytest.mark.parametrize("raw,system,reason", [
    # tool-call arguments as JSON text: nested ~1000 deep, a 5000-digit int (int() refuses it), not an object
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": DEEP}}]}], None, ""),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": '{"a": ' + "1" * 5000 + "}"}}]}], None, ""),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}]}], None, ""),
    # a messages cell of JSON text nested past the parser's depth; content parts by the 100,000
    ("[" * 100_000, None, "bad_conversation"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}] * 100_000}, {"role": "assistant", "content": "b"}],
     None, ""),
    ([{"role": "user", "content": [[{"type": "text", "text": "a"}]]}, {"role": "assistant", "content": "b"}],
     None, "bad_content"),
    # a system column of another type is no system prompt
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}], {"role": "system"}, ""),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}], ["x"] * 10, ""),
])
def test_hostile_row_formats_are_a_reason_or_a_render(raw, system, reason):
    from chat_families import family

    conv, why = data.normalize_conversation(raw, system)
    assert why == reason
    if not why:
        assert all(m["role"] != "system" for m in conv)
        tok = family("qwen3")
        rows = data.chat_tokenize(tok, [conv], {}, None, masks.derive_chat_format(tok, {}), render.render_char_limit(64))
        assert rows[0][2] in ("", "chat_template_output_too_long"), rows[0][2]


# ---- a slow tokenizer: refused before any row when the masks need offsets ------------------------------------------

def slow_tokenizer(template: str):
    """A word-level slow (Python) tokenizer: transformers' PreTrainedTokenizer, no tokenizer.json, no offsets."""
    from transformers import PreTrainedTokenizer

    words = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "hi", "ok", "\n", " "]

    class WordTokenizer(PreTrainedTokenizer):
        def __init__(self, **kwargs):
            self.vocab = {w: i for i, w in enumerate(words)}
            super().__init__(unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>"], **kwargs)

        @property
        def vocab_size(self):
            return len(self.vocab)

        def get_vocab(self):
            return dict(self.vocab)

        def _tokenize(self, text):
            return re.findall(r"\w+|\s|[^\w\s]", text)

        def _convert_token_to_id(self, token):
            return self.vocab.get(token, 0)

        def _convert_id_to_token(self, index):
            return words[index] if 0 <= index < len(words) else "<unk>"

    tok = WordTokenizer()
    tok.chat_template = template
    assert not tok.is_fast
    return tok


PLAIN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


MARKERS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
           "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n"
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template,rows,extra,method", [
    (PLAIN, [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}], {},
     "derived"),
    (MARKERS, [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}], {},
     "markers"),
    (PLAIN, [{"prompt": "hi", "completion": "ok"}], {"prompt_completion": "text"}, "completion"),
])
def test_a_slow_tokenizer_is_refused_before_any_row_when_the_masks_need_offsets(tmp_path, template, rows, extra,
                                                                                 method):
    """Masks read off the chat template (derived turns, generation markers, plain completions) take character
    offsets from the tokenizer; a slow one has none (its encodings silently lack offset_mapping: a KeyError
    traceback from inside datasets.map, or from deriving the turns): one line naming the tokenizer and the fix."""
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = ExtractConfig(model="slow-model", dataset=str(path), layers=[1], output_dir="o", **extra)
    with pytest.raises(HsxError, match=f"tokenizer slow-model is a slow .* the '{method}' loss masks .* "
                                       "tokenizer.json"):
        data.tokenize(inputs.load_input(cfg), slow_tokenizer(template), cfg, str(tmp_path / "t.arrow"),
                      fingerprint="test-slow")


def test_a_slow_tokenizer_still_tokenizes_text_rows(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"text": "hi ok"}])
    cfg = ExtractConfig(model="slow-model", dataset=str(path), layers=[1], output_dir="o")
    rows = data.tokenize(inputs.load_input(cfg), slow_tokenizer(PLAIN), cfg, str(tmp_path / "t.arrow"),
                         fingerprint="test-slow-text")
    assert rows[0]["input_ids"] == [6, 9, 7] and rows[0]["loss_mask"] == [1, 1, 1]


def test_rows_of_another_format_in_a_mixed_file_are_skipped_under_a_reason_that_says_so(tokenizer, tmp_path):
    """A JSONL file mixing `messages` rows and `text` (or `input_ids`) rows: datasets gives every row every column, hsx
    reads the first format (messages), and the other rows came out as `missing_value`, a reason named nowhere.
    They are `mixed_input_formats`; a row that is null in every format column stays `missing_value`."""
    import datasets

    path = tmp_path / "mixed.jsonl"
    write_jsonl(path, [{"messages": HAND_CONVERSATION}, {"text": "plain text, another format"},
                       {"input_ids": [1, 2, 3]}, {"messages": None}])
    ds = datasets.load_dataset("json", data_files=str(path), split="train")
    fmt = data.row_format(ds.column_names)
    assert fmt == "input_ids"  # (the first format its columns have)
    batch = ds.to_dict()
    fmt = "messages"  # as a file without input_ids rows would be read
    del batch["input_ids"]
    out = data.tokenize_batch(batch, list(range(len(ds))), tokenizer, fmt, 4096, {})
    assert out["skip_reason"] == ["", "mixed_input_formats", "missing_value", "missing_value"]
    out = data.tokenize_batch(ds.to_dict(), list(range(len(ds))), tokenizer, "input_ids", 4096, {})
    assert out["skip_reason"] == ["mixed_input_formats", "mixed_input_formats", "", "missing_value"]


def test_every_skip_reason_is_documented_and_every_documented_one_is_hsxs():
    """docs/inputs.md's table of skip reasons is hsx.schema.SKIP_REASONS, both ways; the reasons the tokenizer
    gives its bad rows are all in it."""
    import re
    from pathlib import Path

    from hsx.schema import SKIP_REASONS

    text = (Path(__file__).parent.parent / "docs" / "inputs.md").read_text()
    table = text[text.index("## Skipped rows"):]
    table = table[:table.index("\n## ")]
    assert re.findall(r"^\| `([a-z0-9_]+)` \|", table, flags=re.M) == list(SKIP_REASONS)
    given = {data.prompt_completion_conversation(p, c, answer)[1]
             for p, c, answer in (("hi", None, "response"), ("hi", None, "completion"), (None, "x", "completion"))}
    user = {"role": "user", "content": "hi"}
    for raw in ([], None, "not json", [1], [{"content": "x"}], [{"role": "user"}], [user],
                [user, {"role": "assistant", "content": None}],
                [user, {"role": "assistant", "content": "x", "tool_calls": "nope"}],
                [user, {"from": "function_call", "value": "nope"}],
                [{"role": "user", "content": [{"type": "text"}]}, {"role": "assistant", "content": "x"}],
                [{"role": "user", "content": [IMAGE]}, {"role": "assistant", "content": "x"}]):
        given.add(data.normalize_conversation(raw)[1])
    for ids, mask in ((None, None), ("x", None), ([], None), ([1.0], None), ([1], [2]), ([1, 2], [1])):
        given.add(data.pretokenized_problem(ids, mask))
    given -= {""}
    assert len(given) >= 17 and given <= set(SKIP_REASONS), given - set(SKIP_REASONS)
