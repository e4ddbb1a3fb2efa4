"""Loss masks derived from templates without generation markers (hsx.masks), on templates of our own written to
behave like the real families' (tests/chat_families.py): the exact masked token strings of each turn."""

from __future__ import annotations

import json

import numpy as np
import pytest

import chat_families as cf
from helpers import HAND_CONVERSATION, hsx_main, message_lines, write_jsonl
from hsx import data, inputs, masks
from hsx.config import HsxError

SYSTEM = {"role": "system", "content": "You are the assistant. Think, then end."}


def U(content):
    return {"role": "user", "content": content}


def A(content, **keys):
    return {"role": "assistant", "content": content, **keys}


CALL = [{"type": "function", "id": "abcdefghi", "function": {"name": "get", "arguments": '{"city": "Paris"}'}}]
TOOL = {"role": "tool", "content": "sunny", "name": "get", "tool_call_id": "abcdefghi"}


def tokenize(tok, convs, fmt="messages", kwargs=None, **columns):
    return data.tokenize_batch({fmt: convs, **columns}, list(range(len(convs))), tok, fmt, 4096, kwargs or {})


def runs(tok, ids, mask):
    """The decoded text of each run of supervised tokens."""
    m = np.r_[0, np.asarray(mask, dtype=int), 0]
    d = np.diff(m)
    return [tok.decode(ids[a:b]) for a, b in zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1))]


def masked_runs(tok, conv, kwargs=None, **columns):
    out = tokenize(tok, [conv], kwargs=kwargs, **columns)
    assert out["skip_reason"] == [""], out["skip_reason"]
    ids, mask = out["input_ids"][0], out["loss_mask"][0]
    tools = columns.get("tools", [None])[0]
    text = tok.apply_chat_template(conv, tools=tools, tokenize=False, **(kwargs or {}))
    assert ids == tok(text, add_special_tokens=False)["input_ids"]  # one row: the encoding of the whole render
    return runs(tok, ids, mask)


# Answers that also occur in the template text ("hi" in "<think>", "assistant", "user", "model", "end"), an
# answer with surrounding spaces, reasoning in history and on the last turn.
@pytest.mark.parametrize("name, kwargs, conv, expected", [
    ("qwen3", {}, [SYSTEM, U("hi"), A("hi", reasoning_content="think"), U("user"),
                   A(" assistant ", reasoning_content="end")],
     # history reasoning stripped by the template; the last turn's think block is generated
     ["hi<|im_end|>", "<think>\nend\n</think>\n\n assistant <|im_end|>"]),
    ("qwen3", {}, [U("hi"), A("hi")], ["<think>\n\n</think>\n\nhi<|im_end|>"]),  # the block the template adds
    ("qwen3", {"enable_thinking": False}, [U("hi"), A("hi")], ["hi<|im_end|>"]),  # ... is in the prompt here
    ("qwen3", {"enable_thinking": False}, [U("hi"), A("think"), U("user"), A("end", reasoning_content="model")],
     ["think<|im_end|>", "<think>\nmodel\n</think>\n\nend<|im_end|>"]),
    ("qwen3", {}, [U("q"), A("<think>\nabc\n</think>\n\nhi"), U("q2"), A("<think>\nuser\n</think>\n\nend")],
     ["hi<|im_end|>", "<think>\nuser\n</think>\n\nend<|im_end|>"]),  # reasoning inside content
    ("qwen3.5", {}, [SYSTEM, U("hi"), A("hi", reasoning_content="think"), U("user"),
                     A(" assistant ", reasoning_content="end")],
     ["hi<|im_end|>", "end\n</think>\n\n assistant <|im_end|>"]),  # '<think>\n' is the generation prompt's
    ("qwen3.5", {}, [U("hi"), A("think")], ["think<|im_end|>"]),  # no reasoning: no block, header only
    ("qwen3.5", {"enable_thinking": False}, [U("hi"), A("end", reasoning_content="think")],
     ["<think>\nthink\n</think>\n\nend<|im_end|>"]),
    ("llama3", {}, [SYSTEM, U("hi"), A("hi"), U("user"), A(" assistant ")], ["hi<|eot_id|>", "assistant<|eot_id|>"]),
    ("gemma3", {}, [SYSTEM, U("hi"), A("hi"), U("user"), A(" model ")], ["hi<end_of_turn>", "model<end_of_turn>"]),
    ("harmony", {}, [SYSTEM, U("hi"), A("hi", thinking="think"), U("user"), A("end", thinking="model")],
     # one turn: analysis and final channels, through the last end token
     ["<|channel|>final<|message|>hi<|end|>",
      "<|channel|>analysis<|message|>model<|end|><|start|>assistant<|channel|>final<|message|>end<|return|>"]),
    ("deepseek-r1", {}, [SYSTEM, U("hi"), A("<think>\nthink\n</think>\n\nhi"), U("user"),
                         A("<think>model</think>end")],
     ["\n\nhi<｜end▁of▁sentence｜>", "end<｜end▁of▁sentence｜>"]),  # every turn's reasoning dropped by the template
    ("llama2", {}, [SYSTEM, U("hi"), A("hi"), U("user"), A(" assistant ")], [" hi </s>", " assistant </s>"]),
    # the system prompt moves to the last user turn, so the earlier turns' prefix renders differ from the full one
    ("mistral", {}, [SYSTEM, U("hi"), A("hi"), U("user"), A(" INST ")], ["hi</s>", " INST </s>"]),
    ("mistral", {}, [U("hi"), A("one"), A("two")], ["one</s>two</s>"]),  # consecutive turns, no header between
    ("phi3.5", {}, [SYSTEM, U("hi"), A("hi"), U("user"), A("end")], ["hi<|end|>", "end<|end|>"]),  # eos not
    ("phi3", {}, [U("hi"), A("assistant"), U("user"), A("end")], ["assistant<|end|>", "end<|end|>"]),  # header
    # after every user turn, none added by add_generation_prompt
    ("qwen2.5", {}, [U("hi"), A("Qwen"), U("user"), A("end")], ["Qwen<|im_end|>", "end<|im_end|>"]),  # default
    # system prompt
    ("llama3.1", {}, [SYSTEM, U("hi"), A("Cutting"), U("user"), A("assistant")],
     ["Cutting<|eot_id|>", "assistant<|eot_id|>"]),
    ("deepseek-v3", {}, [SYSTEM, U("hi"), A("User"), U("user"), A("end")],
     ["User<｜end▁of▁sentence｜>", "end<｜end▁of▁sentence｜>"]),
    # no end-of-turn token: a turn ends with the role token the model generates to stop (<|user|>); the last turn,
    # followed by nothing, with its text
    ("glm4", {}, [SYSTEM, U("hi"), A("hi"), U("user"), A("assistant")], ["hi<|user|>", "assistant"]),
    ("smollm3", {}, [U("hi"), A("think"), U("user"), A("end")], ["think<|im_end|>", "end<|im_end|>"]),
    ("smollm3", {"enable_thinking": False}, [U("hi"), A("think")], ["think<|im_end|>"]),  # empty think block:
    # the generation prompt's
    ("smollm3", {}, [{"role": "system", "content": "/no_think"}, U("hi"), A("think")], ["think<|im_end|>"]),
    # the header is rendered with the user turn; add_generation_prompt adds nothing after it
    ("deepseek-v3-0324", {}, [SYSTEM, U("hi"), A("Assistant"), U("user"), A("end"), A("two")],
     ["Assistant<｜end▁of▁sentence｜>", "end<｜end▁of▁sentence｜>two<｜end▁of▁sentence｜>"]),
    ("qwen3", {}, [U("hi"), A("one"), U("user")], ["one<|im_end|>"]),  # ends on a user turn
], ids=["qwen3-history", "qwen3-empty-think", "qwen3-no-thinking", "qwen3-no-thinking-reasoning",
        "qwen3-think-in-content", "qwen3.5-history", "qwen3.5-no-reasoning", "qwen3.5-no-thinking", "llama3",
        "gemma3-system-folded", "harmony-channels", "deepseek-r1", "llama2-no-generation-prompt",
        "mistral-system-on-last-user", "mistral-consecutive", "phi3.5", "phi3-header-in-user-turn",
        "qwen2.5-default-system", "llama3.1-date-header", "deepseek-v3", "glm4-no-end-token",
        "smollm3-thinking", "smollm3-no-thinking-kwarg", "smollm3-no-think-flag", "deepseek-v3-0324",
        "qwen3-ends-on-user"])
def test_family_masks(name, kwargs, conv, expected):
    tok = cf.family(name)
    assert not masks.GENERATION_TAG.search(tok.chat_template)
    assert masked_runs(tok, conv, kwargs) == expected


def test_nothing_but_the_assistant_turns_is_masked():
    """Every supervised token lies in an assistant turn's run; system, user and header tokens never are."""
    tok = cf.family("gemma3")
    conv = [SYSTEM, U("hi model"), A("hi"), U("user end"), A("model")]
    out = tokenize(tok, [conv])
    ids, mask = out["input_ids"][0], out["loss_mask"][0]
    assert sum(mask) == sum(len(tok(r, add_special_tokens=False)["input_ids"]) for r in runs(tok, ids, mask))
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert unmasked == ("<bos><start_of_turn>user\nYou are the assistant. Think, then end.\n\nhi model<end_of_turn>\n"
                        "<start_of_turn>model\n\n<start_of_turn>user\nuser end<end_of_turn>\n<start_of_turn>model\n\n")


@pytest.mark.parametrize("name, expected", [
    ("qwen3", ['<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
               "It is sunny.<|im_end|>", "<think>\n\n</think>\n\nbye<|im_end|>"]),
    ("qwen3.5", ["<tool_call>\n<function=get>\n</function>\n</tool_call><|im_end|>", "It is sunny.<|im_end|>",
                 "bye<|im_end|>"]),
    ("llama3", ['{"name": "get", "parameters": {"city": "Paris"}}<|eot_id|>', "It is sunny.<|eot_id|>",
                "bye<|eot_id|>"]),
    ("harmony", [' to=functions.get<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
                 "<|channel|>final<|message|>It is sunny.<|end|>", "<|channel|>final<|message|>bye<|return|>"]),
    ("llama3.1", ['{"name": "get", "parameters": {"city": "Paris"}}<|eot_id|>', "It is sunny.<|eot_id|>",
                  "bye<|eot_id|>"]),
    ("mistral", ['[TOOL_CALLS][{"name": "get", "arguments": {"city": "Paris"}, "id": "abcdefghi"}]</s>',
                 "It is sunny.</s>", "bye</s>"]),
    ("qwen2.5", ['<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                 "It is sunny.<|im_end|>", "bye<|im_end|>"]),
    # the answer after tool outputs has no header: '<｜tool▁outputs▁end｜>' is the prompt's last token
    ("deepseek-v3", ['<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get\n```json\n{"city": "Paris"}\n```'
                     '<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>', "It is sunny.<｜end▁of▁sentence｜>",
                     "bye<｜end▁of▁sentence｜>"]),
    ("deepseek-v3-0324", ['<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get\n```json\n'
                          '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
                          "It is sunny.<｜end▁of▁sentence｜>", "bye<｜end▁of▁sentence｜>"]),
    ("glm4", ['get\n{"city": "Paris"}<|observation|>', "It is sunny.<|user|>", "bye"]),
])
def test_tool_turns_with_null_content(name, expected):
    conv = [U("weather?"), A(None, tool_calls=CALL, thinking="call it", reasoning_content="call it"), TOOL,
            A("It is sunny."), U("thanks"), A("bye")]
    tok = cf.family(name)
    got, reason = data.normalize_conversation(conv)
    assert reason == "" and got[1]["content"] is None and got[1]["tool_calls"] == CALL
    out = tokenize(tok, [conv])
    assert out["skip_reason"] == [""]
    assert runs(tok, out["input_ids"][0], out["loss_mask"][0]) == expected


@pytest.mark.parametrize("name, expected", [
    ("qwen3", ["<|im_end|>", "<think>\n\n</think>\n\nbye<|im_end|>"]),
    ("llama3.1", ["<|eot_id|>", "bye<|eot_id|>"]),
    ("mistral", ["</s>", "bye</s>"]),
    ("glm4", ["<|user|>", "bye"]),
    ("qwen2.5", "mask_template_error"),  # '<|im_start|>assistant<|im_end|>': the turn lacks the generation prompt's
    # '\n', so where it starts is not known
])
def test_empty_assistant_turn(name, expected):
    """An empty answer is its end token alone, or (where the template renders it without the header the model
    is prompted with) a skipped row, never a mask that reaches into the header."""
    tok = cf.family(name)
    out = tokenize(tok, [[U("hi"), A(""), U("more"), A("bye")]])
    if isinstance(expected, str):
        assert out["skip_reason"] == [expected]
    else:
        assert out["skip_reason"] == [""] and runs(tok, out["input_ids"][0], out["loss_mask"][0]) == expected


@pytest.mark.parametrize("name, call_text", [
    ("llama3.1", '{"name": "get", "parameters": {"city": "Paris"}}<|eot_id|>'),
    ("mistral", '[TOOL_CALLS][{"name": "get", "arguments": {"city": "Paris"}, "id": "abcdefghi"}]</s>'),
    ("qwen2.5", '<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'),
    ("deepseek-v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get\n```json\n{"city": "Paris"}\n```'
                    '<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'),
    ("glm4", 'get\n{"city": "Paris"}<|observation|>'),
], ids=["llama3.1", "mistral", "qwen2.5", "deepseek-v3", "glm4"])
def test_tool_call_arguments_string_or_mapping_render_the_same(name, call_text):
    """OpenAI rows give arguments as a JSON string, HF rows as a mapping: both render as the model generates the
    call. Templates that `tojson` the arguments (Llama 3.1, Mistral, Qwen2.5, GLM-4) get a mapping (a string would
    render quoted and escaped); DeepSeek V3's, which concatenates them, gets the string back."""
    tok = cf.family(name)
    as_mapping = [{**CALL[0], "function": {"name": "get", "arguments": {"city": "Paris"}}}]
    rows = [[U("weather?"), A(None, tool_calls=calls), TOOL, A("It is sunny.")] for calls in (CALL, as_mapping)]
    out = tokenize(tok, rows)
    assert out["skip_reason"] == ["", ""]
    assert out["input_ids"][0] == out["input_ids"][1] and out["loss_mask"][0] == out["loss_mask"][1]
    assert runs(tok, out["input_ids"][0], out["loss_mask"][0])[0] == call_text
    assert '\\"' not in tok.decode(out["input_ids"][0])


def test_openai_export_quirks_render_as_vllm_passes_them():
    """What OpenAI-style exports hold besides the standard form: `"tool_calls": []` on a plain answer (dropped: Llama
    3.1's template would take the key for a call and raise), empty arguments (as {}), a flat call {name,
    arguments} without `function`, a tool result that is a JSON list (kept for the template's `tojson`)."""
    tok = cf.family("llama3.1")
    plain = tokenize(tok, [[U("hi"), A("hello")]])
    out = tokenize(tok, [[U("hi"), A("hello", tool_calls=[])]])
    assert out["skip_reason"] == [""] and out["input_ids"] == plain["input_ids"]
    call = [{**CALL[0], "function": {"name": "get", "arguments": ""}}]
    listed = {**TOOL, "content": [{"temp": 20}]}
    out = tokenize(tok, [[U("weather?"), A(None, tool_calls=call), listed, A("Warm.")]])
    assert out["skip_reason"] == [""]
    assert runs(tok, out["input_ids"][0], out["loss_mask"][0]) == ['{"name": "get", "parameters": {}}<|eot_id|>',
                                                                   "Warm.<|eot_id|>"]
    assert '[{"temp": 20}]' in tok.decode(out["input_ids"][0])
    qwen = cf.family("qwen2.5")
    flat = tokenize(qwen, [[U("weather?"), A(None, tool_calls=[{"name": "get", "arguments": '{"city": "Paris"}'}]),
                           TOOL, A("Sunny.")],
                           [U("weather?"), A(None, tool_calls=[{"name": "get", "arguments": {"city": "Paris"}}]),
                            TOOL, A("Sunny.")]])
    assert flat["skip_reason"] == ["", ""] and flat["input_ids"][0] == flat["input_ids"][1]


MARKED = ("{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
          "{%- generation -%}{{- m['content'] or '' -}}{%- for c in m.tool_calls or [] -%}"
          "{{- c.function.name + ' ' + c.function.arguments | tojson -}}{%- endfor -%}{{- '<|im_end|>' -}}"
          "{%- endgeneration -%}{{- '\\n' -}}{%- elif m['role'] in ['system', 'user'] -%}"
          "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
          "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def test_tool_call_arguments_are_mappings_with_generation_markers():
    from hsx.demo import build_tokenizer

    tok = build_tokenizer(MARKED)
    out = tokenize(tok, [[U("weather?"), A(None, tool_calls=CALL), U("ok"), A("fine")]])
    assert out["skip_reason"] == [""]
    assert runs(tok, out["input_ids"][0], out["loss_mask"][0])[0] == 'get {"city": "Paris"}<|im_end|>'


@pytest.mark.parametrize("name, conv, reason", [
    ("phi3", [U("weather?"), A(None, tool_calls=CALL), TOOL, A("It is sunny.")], "tool_call_not_rendered"),
    ("phi3.5", [U("weather?"), A("Let me look.", tool_calls=CALL), U("ok"), A("fine")], "tool_call_not_rendered"),
    ("smollm3", [U("weather?"), A("It is sunny."), TOOL, A("Yes.")], "message_not_rendered"),
    # (GPT-OSS keeps its developer role: a developer message after the first is dropped)
    ("harmony", [U("weather?"), {"role": "developer", "content": "be brief"}, A("Sunny.")], "message_not_rendered"),
    ("markers", [U("weather?"), A(None, tool_calls=CALL), TOOL, A("It is sunny.")], "message_not_rendered"),
], ids=["phi3-tool-call", "phi3.5-tool-call-with-content", "smollm3-tool-result", "harmony-late-developer",
        "markers"])
def test_what_the_template_drops_is_skipped(name, conv, reason):
    """A template without tool support renders an assistant turn's tool calls as nothing (the turn would be
    supervised as an empty answer), one without a branch for a role drops that message (the next answer would
    lose its context): the row is skipped with a reason, on derived masks and on generation markers alike."""
    from hsx.demo import build_tokenizer

    tok = build_tokenizer(MARKED) if name == "markers" else cf.family(name)
    out = tokenize(tok, [conv, [U("hi"), A("hello")]])
    assert out["skip_reason"] == [reason, ""]
    assert out["input_ids"][0] == [] and out["input_ids"][1]
    with_tools = tokenize(tok, [conv], tools=[[{"type": "function", "function": {"name": "get"}}]])
    assert with_tools["skip_reason"] == [reason]  # (the row-by-row path too)


def test_a_dropped_message_is_found_among_many():
    """Each message's sentinel is no part of another's (message 1's is not inside message 27's)."""
    from hsx.demo import build_tokenizer

    tok = build_tokenizer(
        "{%- for m in messages -%}{%- if not (m['role'] == 'tool' and loop.index0 == 1) -%}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    conv = [U("q"), TOOL] + [A("a") if k % 2 else U("q") for k in range(25)] + [TOOL, A("done")]
    assert len(conv) == 29 and conv[27] == TOOL
    assert masks.unrendered(tok, conv, None, {}) == "message_not_rendered"
    assert masks.unrendered(tok, [U("q"), A("a")] + conv[2:], None, {}) == ""


def test_qwen3_agent_turns_keep_reasoning_until_a_later_query():
    """Reasoning of the tool-calling turns after the last user query is kept (and supervised); once a later user
    query exists the template strips it, and the prefix renders no longer match the full one: the turns are found
    by rendering the conversation with the turn swapped for a sentinel."""
    tok = cf.family("qwen3")
    agent = [U("weather?"), A(None, tool_calls=CALL, reasoning_content="call it"), TOOL,
             A("It is sunny.", reasoning_content="done")]
    assert masked_runs(tok, agent) == [
        '<think>\ncall it\n</think>\n\n<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>", "<think>\ndone\n</think>\n\nIt is sunny.<|im_end|>"]
    later = agent + [U("thanks"), A("bye", reasoning_content="fine")]
    full = tok.apply_chat_template(later, tokenize=False)
    assert not full.startswith(tok.apply_chat_template(later[:3], tokenize=False))  # history was rewritten
    assert masked_runs(tok, later) == [
        '<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is sunny.<|im_end|>", "<think>\nfine\n</think>\n\nbye<|im_end|>"]


def test_token_that_straddles_header_and_answer_is_supervised():
    """Llama 2 renders ' ' + answer after '[/INST]' (the header ' ' is not generated) and the tokenizer merges
    the space into the answer's first token: that token carries generated text, so it is supervised (as
    transformers does for generation markers); the '[/INST]' before it is not."""
    tok = cf.family("llama2")
    conv = [U("hi"), A("hi")]
    text = tok.apply_chat_template(conv, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    content_start = text.index(" hi </s>") + 1
    straddle = [k for k, (s, e) in enumerate(enc["offset_mapping"]) if s < content_start < e]
    assert len(straddle) == 1 and tok.decode(enc["input_ids"][straddle[0]]) == " hi"
    out = tokenize(tok, [conv])
    mask = out["loss_mask"][0]
    assert mask[straddle[0]] == 1 and mask[straddle[0] - 1] == 0
    assert tok.decode(out["input_ids"][0][:straddle[0]]).endswith("[/INST]")
    assert runs(tok, out["input_ids"][0], mask) == [" hi </s>"]


def test_derived_equals_generation_markers_on_the_demo(tokenizer, tokenizer_no_generation):
    """The demo's own template, with and without markers: same ids, same masks (incl. answers in header text)."""
    convs = [HAND_CONVERSATION, [U("assistant"), A("assistant")], [U("hi"), A(" user "), U("im"), A("im_end")]]
    gen = tokenize(tokenizer, convs)
    derived = tokenize(tokenizer_no_generation, convs)
    assert gen["skip_reason"] == derived["skip_reason"] == [""] * 3
    assert (derived["input_ids"], derived["loss_mask"]) == (gen["input_ids"], gen["loss_mask"])
    assert runs(tokenizer, gen["input_ids"][1], gen["loss_mask"][1]) == ["assistant<|im_end|>"]


def test_demo_rows_keep_their_marker_masks(tokenizer, tokenizer_no_generation):
    """The shipped demo (recipes/demo.yaml: its template has markers) still gets the markers' masks, row for row,
    and the derivation on the same template without markers gives the same rows."""
    from helpers import REPO

    rows = [json.loads(line) for line in (REPO / "hsx" / "demo" / "chat.jsonl").read_text().splitlines()]
    convs = [r["messages"] for r in rows]
    assert data.mask_record(["messages"], tokenizer) == {"method": "markers", "version": masks.MASK_VERSION}
    got = tokenize(tokenizer, convs)
    derived = tokenize(tokenizer_no_generation, convs)
    checked = 0
    for r, conv in enumerate(convs):
        if got["skip_reason"][r]:
            assert derived["skip_reason"][r] == got["skip_reason"][r]
            continue
        enc = tokenizer.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert (got["input_ids"][r], got["loss_mask"][r]) == (list(enc["input_ids"]), list(enc["assistant_masks"]))
        assert (derived["input_ids"][r], derived["loss_mask"][r]) == (got["input_ids"][r], got["loss_mask"][r])
        checked += 1
    assert checked == 96


def test_template_with_markers_uses_the_markers():
    """Markers that cover the answer but not <|im_end|>: the mask follows them, not the derivation."""
    from hsx.demo import _TEMPLATE_SRC, build_tokenizer

    partial = build_tokenizer(_TEMPLATE_SRC.replace("@GEN@{{- message['content'] + '<|im_end|>' -}}@ENDGEN@",
                                                    "{%- generation -%}{{- message['content'] -}}{%- endgeneration -%}"
                                                    "{{- '<|im_end|>' -}}"))
    assert masks.mask_method("messages", partial, ["messages"]) == "markers"
    out = tokenize(partial, [[U("hi"), A("hello there")]])
    assert runs(partial, out["input_ids"][0], out["loss_mask"][0]) == ["hello there"]


def test_header_not_where_the_turn_starts_is_a_template_error():
    """A template that renders some assistant turns with another header: those rows are `mask_template_error`."""
    from hsx.demo import build_tokenizer

    odd = build_tokenizer(
        "{%- for m in messages -%}{%- if m['role'] == 'assistant' and m['content'].startswith('!') -%}"
        "{{- '<|im_start|>bot\\n' + m['content'] + '<|im_end|>\\n' -}}"
        "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    out = tokenize(odd, [[U("hi"), A("fine")], [U("hi"), A("!loud")], [U("hi"), A("ok"), U("again"), A("!no")]])
    assert out["skip_reason"] == ["", "mask_template_error", "mask_template_error"]
    assert out["input_ids"][1] == [] and out["num_tokens"][1] == 0


def test_last_turn_left_open_ends_with_the_render():
    """A template that leaves the final assistant turn open (no end token, for continuation; Apertus does):
    that turn is supervised through the end of the render, the earlier ones through their end token."""
    from hsx.demo import build_tokenizer

    tok = build_tokenizer(
        "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] -}}"
        "{%- if not (loop.last and m['role'] == 'assistant') -%}{{- '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    out = tokenize(tok, [[U("hi"), A("user"), U("again"), A("assistant")]])
    assert out["skip_reason"] == [""]
    assert runs(tok, out["input_ids"][0], out["loss_mask"][0]) == ["user<|im_end|>", "assistant"]


@pytest.mark.parametrize("template, problem", [
    ("{%- for m in messages -%}{{- m['content'] + '\\n' -}}{%- endfor -%}", "no special token ends"),
    ("{%- for m in messages if m['role'] == 'user' -%}{{- '<|im_start|>user\\n' + m['content'] + '<|im_end|>' -}}"
     "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
     "assistant message is not rendered"),
    ("{{- raise_exception('no') -}}", "cannot render a user/assistant conversation"),
], ids=["no-end-token", "drops-assistant", "raises"])
def test_underivable_template_is_one_line(template, problem):
    from hsx.demo import build_tokenizer

    with pytest.raises(HsxError, match=problem) as e:
        masks.derive_chat_format(build_tokenizer(template), {}, "my-tokenizer")
    message = str(e.value)
    assert "\n" not in message and "my-tokenizer" in message
    assert "{% generation %}" in message and "loss_mask" in message


# ---- the developer role ----------------------------------------------------------------------------------------

DEV = {"role": "developer", "content": "Be brief."}
CHATML_ANY_ROLE = ("{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
                   "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
CHATML_DEVELOPER = (  # a template with a developer role of its own, refusing roles it does not know
    "{%- for m in messages -%}{%- if m['role'] not in ('system', 'developer', 'user', 'assistant') -%}"
    "{{- raise_exception('unknown role') -}}{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


@pytest.mark.parametrize("name, role", [
    ("qwen3", "system"),  # drops a role it does not know
    ("mistral", "system"),  # refuses it
    ("gemma3", "system"),  # refuses it (roles must alternate from the first)
    ("llama3.1", "system"),  # renders any role name as a header: `developer` would be a header it never saw
    ("any-role", "system"),  # ChatML taking any role name
    ("harmony", "developer"),  # GPT-OSS: its developer message
    ("own-developer", "developer"),  # a developer role rendered apart from system
])
def test_developer_role_is_read_off_the_template(name, role):
    """OpenAI's `developer` message (o1+ / GPT-5 datasets) stays `developer` where the template renders that
    role as its own, and is the system prompt where it has none: the same row as with a system message."""
    from hsx.demo import build_tokenizer

    tok = {"any-role": lambda: build_tokenizer(CHATML_ANY_ROLE),
           "own-developer": lambda: build_tokenizer(CHATML_DEVELOPER)}.get(name, lambda: cf.family(name))()
    assert masks.developer_role(tok, {}) == role
    fmt = masks.derive_chat_format(tok, {})
    rows = [[DEV, U("hi"), A("hello")], [{**DEV, "role": "system"}, U("hi"), A("hello")]]
    out = data.tokenize_batch({"messages": rows}, [0, 1], tok, "messages", 4096, {}, chat_format=fmt,
                              developer_as=role)
    assert out["skip_reason"] == ["", ""]
    text = tok.decode(out["input_ids"][0])
    supervised = runs(tok, out["input_ids"][0], out["loss_mask"][0])
    assert "Be brief." in text and len(supervised) == 1 and "hello" in supervised[0] and "brief" not in supervised[0]
    if name == "own-developer":
        assert "<|im_start|>developer\nBe brief." in text
    else:  # (GPT-OSS renders a first system message as its developer message too)
        assert out["input_ids"][0] == out["input_ids"][1] and out["loss_mask"][0] == out["loss_mask"][1]
    if name == "harmony":
        assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text


def test_developer_rows_in_a_job(tmp_path):
    """Through data.tokenize, as a job runs: on Qwen3 (no developer role) a developer row is the system row (it was
    `message_not_rendered`), on Mistral (which refuses the role) too (it was `chat_template_error`); a `system`
    column does not add a second system prompt before a developer message."""
    from hsx.config import ExtractConfig

    rows = [{"messages": [DEV, U("hi"), A("hello")], "system": "Other."},
            {"messages": [{**DEV, "role": "system"}, U("hi"), A("hello")], "system": None}]
    path = write_jsonl(tmp_path / "dev.jsonl", rows)
    cfg = ExtractConfig(model="m", dataset=str(path), layers=[1], output_dir="o")
    for name in ("qwen3", "mistral"):
        tok = cf.family(name)
        out = data.tokenize(inputs.load_input(cfg), tok, cfg, str(tmp_path / f"{name}.arrow"), fingerprint=f"dev-{name}")
        assert out["skip_reason"] == ["", ""]
        assert out["input_ids"][0] == out["input_ids"][1] and out["loss_mask"][0] == out["loss_mask"][1]
        assert "Other." not in tok.decode(out["input_ids"][0])


# ---- input formats ---------------------------------------------------------------------------------------------

def test_conversation_formats_are_the_same_rows(tokenizer):
    """messages / conversations, role/content or from/value, prompt/completion and prompt/response: one row."""
    role_content = [U("hi"), A("hello")]
    from_value = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    ref = tokenize(tokenizer, [role_content])
    for fmt, rows in [("messages", [role_content]), ("conversations", [role_content]),
                      ("messages", [from_value]), ("conversations", [from_value])]:
        out = tokenize(tokenizer, rows, fmt=fmt)
        assert (out["input_ids"], out["loss_mask"], out["skip_reason"]) == (ref["input_ids"], ref["loss_mask"], [""])
    for answer in ("completion", "response"):
        fmt = f"prompt+{answer}"
        assert data.row_format(["prompt", answer, "id"]) == fmt
        out = data.tokenize_batch({"prompt": ["hi", None, [U("hi")], "hi"], answer: ["hello", "x", [A("hello")], None]},
                                  [0, 1, 2, 3], tokenizer, fmt, 4096, {})
        assert out["skip_reason"] == ["", "missing_prompt", "", f"missing_{answer}"]
        assert out["input_ids"][0] == out["input_ids"][2] == ref["input_ids"][0]
        assert out["loss_mask"][0] == ref["loss_mask"][0]


def test_skip_reasons_say_what_is_missing():
    cases = {
        "missing_role": [{"content": "hi"}, A("x")],
        "missing_content": [{"role": "user"}, A("x")],
        "null_content": [U(None), A("x")],
        "message_not_a_mapping": ["hi", A("x")],
        "no_assistant_turn": [U("hi")],
    }
    for reason, conv in cases.items():
        assert data.normalize_conversation(conv) == ([], reason)
    # datasets gives every message every key some row has (null elsewhere): nulls are dropped, so templates that
    # test `'tool_calls' in message` see what the row had
    conv, reason = data.normalize_conversation([{"role": "user", "content": "hi", "tool_calls": None, "from": None,
                                                 "value": None}, A("x", reasoning_content=None, name="bot")])
    assert reason == "" and conv == [U("hi"), A("x", name="bot")]


def test_message_keys_and_tools_reach_the_template():
    tok = cf.family("qwen3")
    template = cf.QWEN3.replace("{%- for message in messages %}{%- if message.role == 'user' or",
                                "{%- for t in tools or [] %}{{- '<|im_start|>system\\ntool ' + t.function.name + "
                                "'<|im_end|>\\n' }}{%- endfor %}{%- for message in messages %}"
                                "{%- if message.role == 'user' or", 1)
    tok = cf.family("qwen3", template)
    tools = [[{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]]
    out = tokenize(tok, [[U("hi"), A("hi", reasoning_content="think")]], tools=tools)
    text = tok.decode(out["input_ids"][0])
    assert "tool get_weather" in text and "<think>\nthink\n</think>" in text
    assert runs(tok, out["input_ids"][0], out["loss_mask"][0]) == ["<think>\nthink\n</think>\n\nhi<|im_end|>"]
    as_json = tokenize(tok, [[U("hi"), A("hi", reasoning_content="think")]], tools=[json.dumps(tools[0])])
    assert as_json["input_ids"] == out["input_ids"]


# ---- the job ---------------------------------------------------------------------------------------------------

def test_mask_method_in_hsx_json_and_fingerprint(tmp_path, model4, tokenizer_no_generation):
    rows = [{"conversations": [U("hi"), A("hello")]}, {"conversations": [U("assistant"), A("user")]}]
    path = write_jsonl(tmp_path / "spec.jsonl", rows)
    tok_dir = tmp_path / "tok"
    tokenizer_no_generation.save_pretrained(tok_dir)
    infos = {}
    for label, extra in [("markers", []), ("derived", ["--tokenizer", str(tok_dir)])]:
        rc, _, err = hsx_main(["extract", "--model", str(model4.path), "--dataset", str(path), "--layers", "1",
                               "--output-dir", str(tmp_path / label), "--compile", "off", *extra])
        assert rc == 0, err
        infos[label] = json.loads((tmp_path / label / "hsx.json").read_text())
        assert infos[label]["loss_mask"] == {"method": label, "version": masks.MASK_VERSION}
        assert infos[label]["counts"]["rows_written"] == 2
    assert infos["markers"]["fingerprint"] != infos["derived"]["fingerprint"]
    job = json.loads((tmp_path / "derived" / ".hsx" / "job.json").read_text())
    assert job["inputs"]["loss_mask"] == {"method": "derived", "version": masks.MASK_VERSION}


def test_plain_prompt_completion_job(tmp_path, model4):
    """`--prompt-completion text` through `hsx extract`: string prompt/completion rows are written as plain text
    (`completion` in hsx.json), a job other than the default chat one (its fingerprint differs)."""
    from hsx import load

    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "The sky is", "completion": " blue."}])
    infos = {}
    for label, extra in [("chat", []), ("text", ["--prompt-completion", "text"])]:
        rc, _, err = hsx_main(["extract", "--model", str(model4.path), "--dataset", str(path), "--layers", "1",
                               "--output-dir", str(tmp_path / label), "--compile", "off", *extra])
        assert rc == 0, err
        infos[label] = json.loads((tmp_path / label / "hsx.json").read_text())
    assert infos["text"]["loss_mask"] == {"method": "completion", "version": masks.MASK_VERSION}
    assert infos["chat"]["loss_mask"]["method"] == "markers"
    assert infos["text"]["fingerprint"] != infos["chat"]["fingerprint"]
    row = load(str(tmp_path / "text"))[0]
    assert "<|im_start|>" not in tok_text(model4, row["input_ids"]) and row["loss_mask"][-1] == 1


def tok_text(model, ids):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model.path).decode(ids)


def test_job_stops_before_extracting_when_no_header_can_be_derived(tmp_path, model4):
    from hsx.demo import build_tokenizer

    tok_dir = tmp_path / "tok"
    build_tokenizer("{%- for m in messages -%}{{- m['content'] + '\\n' -}}{%- endfor -%}").save_pretrained(tok_dir)
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [U("hi"), A("hello")]}])
    out = tmp_path / "out"
    rc, _, err = hsx_main(["extract", "--model", str(model4.path), "--dataset", str(path), "--layers", "1",
                           "--output-dir", str(out), "--compile", "off", "--tokenizer", str(tok_dir)])
    lines = message_lines(err)
    assert rc != 0 and len(lines) == 1, lines
    assert "no special token ends an assistant turn" in lines[0] and "loss_mask" in lines[0]
    assert not list(out.glob("data/*"))


def test_strict_stops_on_mask_template_error(tmp_path, model4):
    from hsx.demo import build_tokenizer

    tok_dir = tmp_path / "tok"
    build_tokenizer(
        "{%- for m in messages -%}{%- if m['role'] == 'assistant' and m['content'].startswith('!') -%}"
        "{{- '<|im_start|>bot\\n' + m['content'] + '<|im_end|>\\n' -}}"
        "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    ).save_pretrained(tok_dir)
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [U("hi"), A("hello")]},
                                              {"messages": [U("hi"), A("!loud")]}])
    argv = ["extract", "--model", str(model4.path), "--dataset", str(path), "--layers", "1", "--compile", "off",
            "--tokenizer", str(tok_dir)]
    rc, _, err = hsx_main(argv + ["--output-dir", str(tmp_path / "lenient")])
    assert rc == 0, err
    info = json.loads((tmp_path / "lenient" / "hsx.json").read_text())
    assert info["counts"]["skipped"] == {"mask_template_error": 1} and info["counts"]["rows_written"] == 1
    rc, _, err = hsx_main(argv + ["--output-dir", str(tmp_path / "strict"), "--strict"])
    assert rc != 0 and "mask_template_error" in err


def test_rows_read_through_datasets_equal_the_rows_as_written(tmp_path):
    """Rows whose messages have different keys (tool calls, null content, reasoning in some rows only) render as
    written after datasets read them (an Arrow struct of the union of keys would give nulls; they are dropped)."""
    from hsx.config import ExtractConfig

    tok = cf.family("qwen3")
    rows = [{"messages": [U("weather?"), A(None, tool_calls=CALL), TOOL, A("It is sunny.")]},
            {"messages": [U("hi"), A("hi", reasoning_content="think"), U("user"), A("end", reasoning_content="x")]},
            {"messages": [{"from": "human", "value": "hi", "role": None}, {"from": "gpt", "value": "hello"}]}]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    cfg = ExtractConfig(model="m", dataset=str(path), layers=[1], output_dir="o")
    raw = inputs.load_input(cfg)
    tokenized = data.tokenize(raw, tok, cfg, str(tmp_path / "t.arrow"), fingerprint="test-masks-union")
    direct = tokenize(tok, [r["messages"] for r in rows])
    assert tokenized["skip_reason"] == direct["skip_reason"] == ["", "", ""]
    assert tokenized["input_ids"] == direct["input_ids"] and tokenized["loss_mask"] == direct["loss_mask"]
    assert runs(tok, direct["input_ids"][0], direct["loss_mask"][0])[0].startswith("<tool_call>")


# ---- a turn end in plain text --------------------------------------------------------------------------------------

# ChatML's layout with its turn end as plain text: '</s>' is no special token of this tokenizer, only
# '<|im_start|>' is, so the first special token after an answer is the next turn's header.
TEXT_END = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '</s>\\n' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_turn_end_in_plain_text_is_derived_and_supervised_through_it_only():
    from chat_families import family_tokenizer

    tok = family_tokenizer(TEXT_END, ("<|endoftext|>", "<|im_start|>"), "<|endoftext|>")
    fmt = masks.derive_chat_format(tok, {})
    assert fmt.eot_tokens == () and fmt.eot_texts == ("</s>",)
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
            {"role": "user", "content": "the end"}, {"role": "assistant", "content": "hi hi"}]
    ids, mask, reason = masks.derived_mask_tokenize(tok, conv, None, {}, fmt)
    assert reason == ""
    text = tok.apply_chat_template(conv, tokenize=False)
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    supervised = "".join(text[s:e] for (s, e), m in zip(offsets, mask) if m)
    assert supervised == "hello there</s>hi hi</s>"  # never the '\n' or the next turn's '<|im_start|>'
