"""Loss masks for chat rows: exactly the tokens the model generates in each assistant turn.

Three methods, recorded in hsx.json and in the job fingerprint (with MASK_VERSION, so a resumed job never mixes
masks of two versions):

- `markers`: the template has `{% generation %}` blocks; transformers' `return_assistant_tokens_mask` marks them.
- `derived`: the template has none (Qwen3/3.5/3.6, Llama 3, Gemma 3, GPT-OSS, DeepSeek, ...). What an assistant
  turn looks like is read off the template itself, never off a table of model names and never by looking for the
  message text in the render: the generation prompt (render with and without `add_generation_prompt`), the header
  every assistant turn starts with and the special tokens that end a turn (renders of sentinel conversations).
  Each turn is then located in the render of the whole conversation by prefix renders (`conv[:i]` with and
  without the generation prompt); a template whose earlier turns depend on later messages (Qwen3's reasoning
  after the last user query, Mistral's system prompt on the last user turn, GPT-OSS's dropped analysis) is
  rendered again with the neighbouring message's content swapped for a sentinel, the rest unchanged. The mask is
  every token after the turn's header (its generation prompt, or the part of it the template rendered for this
  turn) through the last end-of-turn token of that message's rendering: a reasoning block the template adds or
  keeps, tool calls, GPT-OSS's analysis and final channels (one turn: it ends at the last `<|end|>`/`<|return|>`/
  `<|call|>`), and not the text after the end token (`\\n` after `<|im_end|>`); a last turn the template leaves
  open for continuation (no end token) ends with the render. A template with no end-of-turn token of its own
  (GLM-4: a turn ends where the next role token starts) gets as end tokens the role tokens that follow an answer
  (`<|user|>`, `<|observation|>`: the model generates them to stop), so each turn is supervised through the one
  after it, and its last turn, followed by nothing, through its text. Masks are token masks over the tokenizer's
  encoding of the whole render: a token counts when any of its characters is generated, so a token that merges the
  header's last character with the answer's first (Llama 2's header ' ' and answer 'hi' -> ' hi') is supervised,
  as transformers does for generation markers. Cost: about 3 renders per assistant turn (measured on one CPU
  core: ~180 rows/s with a Qwen3-style template at 1.6 turns per row; generation markers: ~1,000 rows/s).
- `given`: pre-tokenized rows bring their own `loss_mask` (`all_tokens` for `text` rows and `input_ids` without
  one; `completion` for string prompt/completion rows read as plain text, hsx.data).

A template whose turns cannot be derived stops the job before anything is extracted (one line: what is missing,
and how to supply markers or a pre-tokenized `loss_mask`); a row whose turn does not sit where the template's
renders say is skipped as `mask_template_error`.

A prompt/completion row supervises its completion's turns only; its prompt's are told in the render of the whole
row, not by the prompt rendered alone (which Qwen3 and any template that looks at later messages renders
otherwise): derived masks skip them by message index; marker masks attribute each span by a render with a sentinel
in each message's text (`context_unsupervised`), and a span that could be either side's skips the row as
`prompt_turn_unattributed`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from hsx.config import HsxError
from hsx.render import RENDER_MIN_CHARS, RenderLimit, check_template_bounds, render_bounds, render_chat
from hsx.render import SENTINEL_ANSWER as _ANSWER, SENTINEL_USER as _USER

MASK_VERSION = 6  # 1: assistant text searched in the render (wrong on thinking templates); 2: derived turns;
# 3: a turn end that is text, not a special token, is supervised through its own text only; 4: tool-call arguments
# rendered as mappings, content-part lists as text, ShareGPT function_call turns and a `system` column read;
# 5: `developer` messages as `system` where the template has no developer role (developer_role), and the assistant
# turns of a prompt given as messages not supervised (only the completion's); 6: those turns told in the render of
# the whole row, not by the prefix it shares with the prompt rendered alone (a prompt turn after where they part
# was supervised: Qwen3's, a header that counts messages), and `prompt_turn_unattributed`
GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
Row = tuple[list[int], list[int], str]

# Sentinel contents: letters only (templates trim, split on '</think>', ...), unlikely in any template text (the
# user's and the answer's are hsx.render's, imported above)
_THINK, _USER2, _ARG, _TOOL = "HsxSentThinkR", "HsxSentUserP", "HsxSentArgV", "HsxSentToolO"
_CALL_ID = "hsxcall01"  # 9 characters: Mistral's templates insist
_FIX = ("; add {% generation %} markers to the template (tokenizer_config.json / chat_template.jinja of --tokenizer) "
        "or give pre-tokenized input_ids with a loss_mask column")


def mask_method(fmt: str, tokenizer, column_names: list[str], plain_completion: bool = False) -> str:
    """Which method makes the masks of a job whose rows are `fmt` (see the module docstring); `plain_completion`:
    string prompt/completion rows read as plain text (`completion`: the completion's tokens)."""
    if plain_completion:
        return "completion"
    if fmt == "input_ids":
        return "given" if "loss_mask" in column_names else "all_tokens"
    if fmt == "text":
        return "all_tokens"
    return "markers" if GENERATION_TAG.search(_template_text(tokenizer)) else "derived"


# The methods that read the tokenizer's character offsets (derived turns and plain-text completions by
# return_offsets_mapping, generation markers by transformers' char_to_token): a fast (tokenizers) tokenizer's only.
OFFSET_METHODS = ("markers", "derived", "completion")


def check_offsets(method: str, tokenizer, name: str) -> None:
    """HsxError in one line, before any row is tokenized, when `method` needs character offsets and `tokenizer`
    (named `name` in the message) is a slow one, which has none (a traceback from inside datasets.map else)."""
    if method in OFFSET_METHODS and not getattr(tokenizer, "is_fast", True):
        raise HsxError(f"tokenizer {name} is a slow (Python) one ({type(tokenizer).__name__}): it gives no "
                       f"character offsets, which the {method!r} loss masks are read off; give --tokenizer a fast one "
                       "(a folder with tokenizer.json), or pre-tokenized input_ids with a loss_mask column")


def _template_text(tokenizer) -> str:
    t = getattr(tokenizer, "chat_template", None) or ""
    return json.dumps(t, sort_keys=True) if isinstance(t, dict) else t


@dataclass(frozen=True)
class ChatFormat:
    """What the template renders around an assistant turn (derived once per job)."""
    gen_header: str  # the generation prompt after a user turn ('<|im_start|>assistant\n')
    min_header: str  # its part every assistant turn's rendering starts with ('<|im_start|>assistant\n' for
    #                  Qwen3.5, whose generation prompt adds '<think>\n'; '<|start|>assistant' for GPT-OSS)
    agp_adds_header: bool  # False: add_generation_prompt adds nothing; the header is the sentinel turn's prefix
    eot_tokens: tuple[str, ...]  # special tokens that end an assistant turn ('<|im_end|>'; '<|end|>', '<|call|>')
    eot_texts: tuple[str, ...] = ()  # where no special token does: the text that does ('</s>' as plain text)

    @property
    def ends(self) -> tuple[str, ...]:
        return self.eot_tokens + self.eot_texts


def _special_ids(tokenizer) -> set[int]:
    ids = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    return ids | set(getattr(tokenizer, "all_special_ids", []) or [])


def _first_special_after(tokenizer, text: str, pos: int, special: set[int], with_position: bool = False):
    """The first special token starting at or after `pos` (None if none); with `with_position`, (it, where it
    starts; len(text) if none)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    for tid, (s, _) in zip(enc["input_ids"], enc["offset_mapping"]):
        if s >= pos and tid in special:
            tok = tokenizer.convert_ids_to_tokens(tid)
            return (tok, s) if with_position else tok
    return (None, len(text)) if with_position else None


def _shared_head(tokenizer, a: str, b: str) -> str:
    """The part of render `a` that render `b` starts with, ending on a token boundary of `a` (Phi-3.5 ends a
    render without the generation prompt with eos: what the two share stops before it)."""
    return a if b.startswith(a) else _common_token_prefix(tokenizer, a, b)


def _common_token_prefix(tokenizer, a: str, b: str) -> str:
    """The longest common prefix of `a` and `b` that ends where a token of `a`'s encoding ends."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    if n == len(a):
        return a
    ends = [e for _, e in tokenizer(a, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
    return a[:max([e for e in ends if e <= n], default=0)]


def derive_chat_format(tokenizer, template_kwargs: dict[str, Any], name: str = "the tokenizer") -> ChatFormat:
    """Read the assistant turn's header and end-of-turn tokens off the template; HsxError (one line) if it cannot."""
    user = {"role": "user", "content": _USER}
    answer = {"role": "assistant", "content": _ANSWER}
    problem = f"the chat template of {name}"
    check_template_bounds(tokenizer, template_kwargs, name)
    try:
        head = render_chat(tokenizer, [user], None, False, template_kwargs)
        prompt = render_chat(tokenizer, [user], None, True, template_kwargs)
        last = render_chat(tokenizer, [user, answer], None, False, template_kwargs)
    except RenderLimit as e:
        raise HsxError(f"{problem}: {e} of a conversation of one word, so it would on every row") from None
    except Exception as e:  # noqa: BLE001  (a template error of any kind)
        raise HsxError(f"{problem} cannot render a user/assistant conversation ({type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''}), so no loss mask can be derived{_FIX}") from None
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": _CALL_ID, "type": "function", "function": {
        "name": "hsx_tool", "arguments": json.dumps({"q": _ARG})}}]}
    tool = {"role": "tool", "content": _TOOL, "name": "hsx_tool", "tool_call_id": _CALL_ID}
    forms = [(last, _ANSWER)]  # (render, the sentinel that ends the assistant message's payload)
    for conv, payload in (([user, answer, {"role": "user", "content": _USER2}], _ANSWER),
                          ([user, {**answer, "reasoning_content": _THINK, "thinking": _THINK}], _ANSWER),
                          ([user, call, tool], _ARG), ([user, {**call, "content": ""}, tool], _ARG)):
        try:  # a template may refuse a trailing user turn, reasoning keys, tool calls, null content
            forms.append((render_chat(tokenizer, conv, None, False, template_kwargs), payload))
        except Exception:  # noqa: BLE001
            pass
    shared = _shared_head(tokenizer, head, prompt)
    if _USER not in shared:  # they differ before the user turn ends
        raise HsxError(f"{problem}: the render with add_generation_prompt does not extend the one without, so no "
                       f"assistant header can be derived{_FIX}")
    head = shared
    if not (last.startswith(head) and _ANSWER in last[len(head):]):
        raise HsxError(f"{problem}: the assistant message is not rendered after the user turn, so no assistant "
                       f"header can be derived{_FIX}")
    turns = [t[len(head):] for t, payload in forms if t.startswith(head) and payload in t[len(head):]]
    gen = prompt[len(head):]
    agp = bool(gen)
    if not agp:  # add_generation_prompt adds nothing (Llama 2, Mistral): the header is what precedes the answer
        gen = turns[0][:turns[0].index(_ANSWER)]
    header = gen
    for t in turns:  # cut where a turn's own tokens start to differ (DeepSeek V3.1: '<think>' / '</think>')
        header = _common_token_prefix(tokenizer, t, header)
    if agp and not header.strip():
        raise HsxError(f"{problem}: no assistant turn starts with the generation prompt {gen!r}, so no "
                       f"assistant header can be derived{_FIX}")
    special = _special_ids(tokenizer)
    # A special token of the assistant's header starts a turn (the user's too, in every family that has one):
    # found first after an answer, it means the answer ended in plain text before it ('</s>\n<|im_start|>').
    starts = set(_specials_in(tokenizer, gen, special))
    eot: list[str] = []
    texts: list[str] = []  # what follows a plain answer, up to the next turn's start or the render's end
    for text, payload in forms:
        if payload in text:
            end = text.rindex(payload) + len(payload)
            tok, at = _first_special_after(tokenizer, text, end, special, with_position=True)
            if tok is not None and tok not in starts:
                if tok not in eot:
                    eot.append(tok)
            elif payload == _ANSWER:
                texts.append(text[end:at].rstrip())
    if eot:
        return ChatFormat(gen_header=gen, min_header=header, agp_adds_header=agp, eot_tokens=tuple(eot))
    if texts and texts[0] and all(t == texts[0] for t in texts):
        return ChatFormat(gen_header=gen, min_header=header, agp_adds_header=agp, eot_tokens=(),
                          eot_texts=(texts[0],))
    raise HsxError(f"{problem}: no special token ends an assistant turn, and the text after an answer "
                   f"({', '.join(sorted(map(repr, set(texts)))) or 'none'}) is not one turn end, so the end of a turn "
                   f"cannot be derived{_FIX}")


_ROLE = "hsxsentrole"  # a role no template knows: rendered as it is only by a template that renders any role name


def developer_role(tokenizer, template_kwargs: dict[str, Any]) -> str:
    """The role `developer` messages (OpenAI's o1+ / GPT-5 system prompt) are given to the template: 'developer'
    where the template renders that role as one of its own (GPT-OSS's harmony template: its developer message),
    else 'system', as llama.cpp and vLLM's Responses API map it: most templates have no developer role and drop it
    (Qwen3), refuse it (Qwen3.5, Mistral, Gemma 3) or write it as an unknown header the model never saw (Llama 3,
    ChatML that takes any role name). Read off renders of a developer, a system and an unknown role's message, not
    off the model's name: a template that renders the unknown role the way it renders `developer`, the role's
    name swapped, takes any role name and has no developer role."""
    def render(role: str) -> str | None:
        conv = [{"role": role, "content": _USER2}, {"role": "user", "content": _USER},
                {"role": "assistant", "content": _ANSWER}]
        try:
            text = render_chat(tokenizer, conv, None, False, template_kwargs)
        except Exception:  # noqa: BLE001  (a template that refuses the role)
            return None
        return text if _USER2 in text else None

    developer = render("developer")
    if developer is None:
        return "system"
    unknown = render(_ROLE)
    if unknown is not None and unknown.lower().replace(_ROLE, "developer") == developer.lower():
        return "system"
    return "developer"


RENDERED_ROLES = ("user", "assistant", "system")  # every template renders these (a system prompt may be folded)


def unrendered(tokenizer, conv: list[dict], tools, template_kwargs: dict[str, Any],
               max_chars: int = RENDER_MIN_CHARS) -> str:
    """'tool_call_not_rendered' when the template renders nothing of one of the conversation's tool calls (a
    template without tool support: the turn would be supervised as an empty answer), 'message_not_rendered' when
    it renders nothing of a message of another role than user, assistant or system (a tool result in a template
    with no branch for it, a role it does not know: the next answer would lose its context); '' otherwise, also
    when the template refuses the check's render. One render, only for a conversation that has such messages or
    calls: each such message's content and each call's function name swapped for a sentinel of its own."""
    if all(m.get("role") in RENDERED_ROLES and not m.get("tool_calls") for m in conv):
        return ""
    sentinels = []
    probe = []
    for k, m in enumerate(conv):
        m = dict(m)
        if m.get("role") not in RENDERED_ROLES:
            m["content"] = f"HsxSentMsg{_letters(k)}End"
            sentinels.append((m["content"], "message_not_rendered"))
        if isinstance(m.get("tool_calls"), list):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                nested = isinstance(c, dict) and isinstance(c.get("function"), dict)
                fn = c["function"] if nested else c  # (OpenAI's {function: {name, ...}}, or a flat {name, ...})
                if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                    name = f"HsxSentCall{_letters(k)}X{_letters(j)}End"
                    c = {**c, "function": {**fn, "name": name}} if nested else {**c, "name": name}
                    sentinels.append((name, "tool_call_not_rendered"))
                calls.append(c)
            m["tool_calls"] = calls
        probe.append(m)
    if not sentinels:
        return ""
    try:
        text = render_chat(tokenizer, probe, tools, False, template_kwargs, max_chars)
    except RenderLimit:
        raise
    except Exception:  # noqa: BLE001  (a template that checks names against its tools: nothing to tell)
        return ""
    found = set(_SENTINEL.findall(text))  # (one pass: a search per sentinel was quadratic, 39 s for 80,000 results)
    return next((reason for sentinel, reason in sentinels if sentinel not in found), "")


_SENTINEL = re.compile(r"HsxSent(?:Msg[a-z]+|Call[a-z]+X[a-z]+)End")  # unrendered's sentinels: none overlaps another


def _letters(k: int) -> str:
    """k in lowercase letters ('a', 'b', ..., 'ba'): sentinels of letters only, as templates may trim or split
    digits; the sentinels end in capitals, so none is part of another ('...bEnd' is not in '...bbEnd')."""
    out = ""
    while True:
        out = chr(ord("a") + k % 26) + out
        k //= 26
        if not k:
            return out


def _specials_in(tokenizer, text: str, special: set[int]) -> list[str]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
    return [tokenizer.convert_ids_to_tokens(i) for i in ids if i in special]


def derived_mask_tokenize(tokenizer, conv: list[dict], tools, template_kwargs: dict[str, Any],
                          fmt: ChatFormat, max_chars: int = RENDER_MIN_CHARS, context: int = 0) -> Row:
    """(input_ids, loss_mask, skip_reason) of one conversation: the encoding of the template's render of it, and
    1 on the tokens of each assistant turn from its header's end through its last end-of-turn token, except the
    turns among the first `context` messages (a prompt/completion row's prompt: each turn is located in the render
    of the whole conversation, so a template that renders the prompt alone otherwise changes nothing). Raises
    whatever the template raises (the caller counts it as `chat_template_error`, or a RenderLimit's reason)."""
    text = render_chat(tokenizer, conv, tools, False, template_kwargs, max_chars)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    eot_ids = {tokenizer.convert_tokens_to_ids(t) for t in fmt.eot_tokens}
    is_eot = np.isin(np.asarray(ids, dtype=np.int64), list(eot_ids))
    renders: dict[tuple[int, bool], str | None] = {}

    def prefix(k: int, agp: bool) -> str | None:
        if (k, agp) not in renders:
            try:
                renders[k, agp] = (render_chat(tokenizer, conv[:k], tools, agp, template_kwargs, max_chars) if k
                                   else None)
            except RenderLimit:
                raise
            except Exception:  # noqa: BLE001  (a template may refuse a conversation that ends with a tool turn)
                renders[k, agp] = None
        return renders[k, agp]

    def swapped(k: int, message: dict) -> str | None:
        try:
            return render_chat(tokenizer, conv[:k] + [message] + conv[k + 1:], tools, False, template_kwargs, max_chars)
        except RenderLimit:
            raise
        except Exception:  # noqa: BLE001
            return None

    spans = []
    for i, m in enumerate(conv):
        if m["role"] != "assistant" or i < context:
            continue
        start = _content_start(tokenizer, text, i, prefix, swapped, fmt)
        if start is None:
            return ids, [0] * len(ids), "mask_template_error"
        stop = _region_stop(text, conv, i, start, prefix, swapped, fmt, offsets[:, 0])
        if stop is None:
            return ids, [0] * len(ids), "mask_template_error"
        inside = np.flatnonzero(is_eot & (offsets[:, 0] >= start) & (offsets[:, 1] <= stop))
        end = int(offsets[inside[-1], 1]) if len(inside) else -1
        for t in fmt.eot_texts:  # a turn end in plain text: through its last occurrence in the turn
            at = text.rfind(t, start, stop)
            end = max(end, at + len(t) if at >= 0 else -1)
        if end >= 0:
            spans.append((start, end))
        elif i == len(conv) - 1 and len(text.rstrip()) > start:  # the render ends with this turn, left open for
            spans.append((start, len(text.rstrip())))  # continuation without its end token (Apertus)
        else:
            return ids, [0] * len(ids), "mask_template_error"
    mask = np.zeros(len(ids), dtype=bool)
    for s, e in spans:
        mask |= (offsets[:, 1] > s) & (offsets[:, 0] < e) & (offsets[:, 1] > offsets[:, 0])
    return ids, mask.astype(np.int8).tolist(), ""


UNATTRIBUTED = "prompt_turn_unattributed"  # the skip reason of a row whose prompt's turns cannot be told apart
_TURN = re.compile(r"HsxSentTurn[a-z]+X[a-z]+End")  # context_unsupervised's sentinels


def context_unsupervised(tokenizer, row: Row, conv: list[dict], context: int, tools, template_kwargs: dict[str, Any],
                         max_chars: int = RENDER_MIN_CHARS) -> Row:
    """`row`, a generation-marker mask of `conv`, with the supervised tokens of the first `context` messages (a
    prompt/completion row's prompt) not supervised, told in the render of the whole conversation, never in the
    prompt's own, which a template may render otherwise (Qwen3's last turn, a header that counts messages).

    One more render marks points of each message: a sentinel at the end of each assistant message's content,
    reasoning and tool-call names, and inside each user or tool message's content; the render less its sentinels
    must be the row's, each sentinel at most once, in message order (else again without the tool-call sentinels,
    which a template may look up among its tools, then without the user and tool ones). Templates render messages
    in order, so a span of supervised text belongs to an assistant message from the one of the last point before
    it to the one of the first point after it; a `{% generation %}` block (transformers' renderer records them)
    lies in one message, so one holding a point is that point's message's. A supervised token that may be either
    side's (a prompt that ends with an answer where the renderer's blocks are not to be had, or a think block of
    its own there) skips the row as `prompt_turn_unattributed`: never a mask that supervises the prompt's turns or
    drops the completion's. Costs three renders and an encoding, only for rows whose prompt has assistant turns."""
    ids, mask, reason = row
    if reason or not any(m["role"] == "assistant" for m in conv[:context]):
        return row
    text = render_chat(tokenizer, conv, tools, False, template_kwargs, max_chars)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) != list(ids):
        return [], [], UNATTRIBUTED
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    supervised = np.asarray(mask, dtype=bool)
    blocks = _generation_blocks(tokenizer, conv, tools, template_kwargs, text, max_chars)
    if blocks is None:  # the runs of supervised tokens, each maybe more than one block
        edges = np.diff(np.r_[0, supervised.astype(np.int8), 0])
        blocks = [(int(offsets[a, 0]), int(offsets[b - 1, 1]))
                  for a, b in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1))]
        whole = False
    else:
        whole = True
    for names, others in ((True, True), (False, True), (False, False)):
        probe, owners = _turn_probe(conv, names, others)
        try:
            other = render_chat(tokenizer, probe, tools, False, template_kwargs, max_chars + sum(map(len, owners)))
        except RenderLimit:
            raise
        except Exception:  # noqa: BLE001  (a template that refuses the sentinels: the next probe, or the skip)
            continue
        points = _turn_points(text, other, owners)
        if points is None:
            continue
        prompt = np.zeros(len(ids), dtype=bool)
        completion = np.zeros(len(ids), dtype=bool)
        for (a, b), side in zip(blocks, _block_sides(blocks, points, conv, context, whole)):
            tokens = (offsets[:, 0] < b) & (offsets[:, 1] > a)
            if side is not None:
                (prompt if side else completion)[tokens] = True
            else:
                prompt[tokens] = completion[tokens] = True
        if np.any(supervised & (prompt == completion)):  # both sides', or no block's (fewer points tell no more)
            break
        return ids, (supervised & completion).astype(np.int8).tolist(), ""
    return [], [], UNATTRIBUTED


def _generation_blocks(tokenizer, conv: list[dict], tools, template_kwargs: dict[str, Any], text: str,
                       max_chars: int) -> list[tuple[int, int]] | None:
    """The characters of each `{% generation %}` block of `text`, the template's render of `conv`, as
    transformers' renderer records them for return_assistant_tokens_mask; None where that renderer is not there or
    renders otherwise (it is not a public function)."""
    try:
        from transformers.utils.chat_template_utils import render_jinja_template

        template = tokenizer.get_chat_template(None, tools or None)
        messages = [{k: v for k, v in m.items() if v is not None} for m in conv]  # (as apply_chat_template does)
        with render_bounds(tokenizer, template_kwargs, tools, max_chars):
            rendered, blocks = render_jinja_template(
                conversations=[messages], tools=tools or None, chat_template=template,
                return_assistant_tokens_mask=True, **{**tokenizer.special_tokens_map, **template_kwargs})
        spans = [(int(a), int(b)) for a, b in blocks[0]]
    except RenderLimit:
        raise
    except Exception:  # noqa: BLE001
        return None
    if rendered != [text] or any(not 0 <= a <= b <= len(text) for a, b in spans):
        return None
    return spans


def _turn_probe(conv: list[dict], names: bool, others: bool) -> tuple[list[dict], dict[str, int]]:
    """`conv` with a sentinel at the end of (before the trailing whitespace of, which templates trim) each assistant
    message's content and reasoning, with `names` of its tool-call names, and with `others` in the middle of each
    user or tool message's content (templates test how a tool result in a user turn starts and ends; not in a
    system or developer prompt, which templates move); and which message each sentinel marks. Empty text is left
    empty (templates test it)."""
    owners: dict[str, int] = {}

    def mark(s: str, k: int, at: int | None = None) -> str:
        sentinel = f"HsxSentTurn{_letters(k)}X{_letters(len(owners))}End"
        owners[sentinel] = k
        at = len(s.rstrip()) if at is None else at
        return s[:at] + sentinel + s[at:]

    probe = []
    for k, m in enumerate(conv):
        m = dict(m)
        if m["role"] == "assistant":
            for key in ("reasoning_content", "thinking", "content"):
                if isinstance(m.get(key), str) and m[key].strip():
                    m[key] = mark(m[key], k)
            if names and isinstance(m.get("tool_calls"), list):
                calls = []
                for c in m["tool_calls"]:
                    nested = isinstance(c, dict) and isinstance(c.get("function"), dict)
                    fn = c["function"] if nested else c
                    if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"].strip():
                        name = mark(fn["name"], k)
                        c = {**c, "function": {**fn, "name": name}} if nested else {**c, "name": name}
                    calls.append(c)
                m["tool_calls"] = calls
        elif (others and m["role"] not in ("system", "developer") and isinstance(m.get("content"), str)
              and m["content"].strip()):
            m["content"] = mark(m["content"], k, len(m["content"]) // 2)
        probe.append(m)
    return probe, owners


def _turn_points(text: str, other: str, owners: dict[str, int]) -> list[tuple[int, int]] | None:
    """(position in `text`, message) of each sentinel of the probe render `other`, in order; None unless `other` less
    its sentinels is `text`, each sentinel is rendered at most once, and their messages come in order."""
    points: list[tuple[int, int]] = []
    removed = 0
    seen: set[str] = set()
    for found in _TURN.finditer(other):
        sentinel = found.group()
        if sentinel not in owners or sentinel in seen:
            return None
        seen.add(sentinel)
        points.append((found.start() - removed, owners[sentinel]))
        removed += len(sentinel)
    if _TURN.sub("", other) != text or any(b[1] < a[1] for a, b in zip(points, points[1:])):
        return None
    return points


def _block_sides(blocks: list[tuple[int, int]], points: list[tuple[int, int]], conv: list[dict], context: int,
                 whole: bool) -> list[bool | None]:
    """For each block (characters of the render), whether it belongs to the first `context` messages; None if it
    cannot be told. `whole`: each block lies in one message (a generation block, not a run of several)."""
    sides: list[bool | None] = []
    for a, b in blocks:
        owners = {k for p, k in points if a <= p <= b} if whole else set()
        if not owners:  # an assistant message from the last point's before it to the first point's after it
            lo = max([k for p, k in points if p <= a], default=0)
            hi = min([k for p, k in points if p >= b], default=len(conv) - 1)
            owners = {k for k in range(lo, hi + 1) if conv[k]["role"] == "assistant"}
        side = {k < context for k in owners}
        sides.append(side.pop() if len(side) == 1 else None)
    return sides


def _content_start(tokenizer, text: str, i: int, prefix, swapped, fmt: ChatFormat) -> int | None:
    """Where turn i's generated text starts in `text` (just after its header), or None."""
    before, prompt = prefix(i, False), prefix(i, True)
    shared = _shared_head(tokenizer, before, prompt) if before is not None and prompt is not None else None
    if (shared is not None and text.startswith(shared)  # ... and only end-of-render text (eos) was left out:
            and not any(t in before[len(shared):] for t in fmt.ends)):
        at, gen = len(shared), prompt[len(shared):]
        if not gen and not fmt.agp_adds_header:
            gen = fmt.gen_header
        headers = [gen, fmt.min_header if gen.startswith(fmt.min_header) else _common_prefix(gen, fmt.min_header)]
    else:  # earlier turns render differently without what follows: swap this turn for a sentinel, keep the rest
        other = swapped(i, {"role": "assistant", "content": _ANSWER})
        pos = other.find(_ANSWER) if other is not None else -1
        at = other.rfind(fmt.min_header, 0, pos) if pos >= 0 else -1  # no header (Mistral): at the sentinel
        if at < 0 or text[:at] != other[:at] or any(t in other[at:pos] for t in fmt.ends):
            return None
        headers = [fmt.gen_header, fmt.min_header]
    for h in headers:
        if text.startswith(h, at):
            return at + len(h)
    return None


def _region_stop(text: str, conv: list[dict], i: int, start: int, prefix, swapped, fmt: ChatFormat,
                 token_starts: np.ndarray) -> int | None:
    """An end bound for turn i's rendering in `text`: the start of the next message's rendering (or a point past
    turn i's last end-of-turn token and before the next message's first one), or None."""
    if i == len(conv) - 1:
        return len(text)
    through = prefix(i + 1, False)
    if through is not None:
        shared = len(through) if text.startswith(through) else _token_boundary(text, through, token_starts)
        if (any(t in text[start:shared] for t in fmt.ends)  # turn i ends inside what they share, and
                and not any(t in through[shared:] for t in fmt.ends)):  # none of its end tokens is left out
            return shared
    nxt = conv[i + 1]
    other = swapped(i + 1, {**nxt, "content": _USER2 if nxt["role"] != "assistant" else _ANSWER})
    marker = _USER2 if nxt["role"] != "assistant" else _ANSWER
    pos = other.find(marker, start) if other is not None else -1
    if pos < 0:
        return None
    end = max((other.rfind(t, start, pos) + len(t) for t in fmt.ends if other.rfind(t, start, pos) >= 0),
              default=-1)
    if end < 0 or text[:end] != other[:end]:
        return None
    return end


def _token_boundary(text: str, other: str, token_starts: np.ndarray) -> int:
    """The length of the common prefix of `text` and `other`, backed off to where a token of `text` starts."""
    n = len(_common_prefix(text, other))
    k = int(np.searchsorted(token_starts, n, side="right"))
    return int(token_starts[k - 1]) if k and n < len(text) else n


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


# ---- regenerated rows (hsx regenerate) ----------------------------------------------------------------------

GENERATED_MISMATCH = "generated_tokens_mismatch"  # a regenerated turn the template does not render as generated


def generated_supervision(tokenizer, row: Row, conv: list[dict], generated: Any) -> Row:
    """`row` (the template's tokens and mask of `conv`) with the supervision of a row `hsx regenerate` wrote: its
    `generated` records ({message, token_ids, finish_reason}) say which assistant messages the target answered and
    with which token ids. Only those turns are supervised (an assistant turn the dataset brought, a tool call kept
    as it was, is context), each exactly on the ids the engine generated: the turn's run of supervised tokens must
    decode to the text of those ids (the template rendered the answer as it was generated: checked, never assumed)
    and is replaced by them, followed by the end-of-turn special tokens the template adds where the engine did not
    report its stop token; an answer cut by max_new_tokens (finish_reason length) never supervises that end. A turn
    stored without ids (its reasoning dropped) keeps the template's mask. A row whose turns cannot be matched so is
    skipped as `generated_tokens_mismatch`."""
    ids, mask, reason = row
    if reason:
        return row
    if not isinstance(generated, list) or not all(isinstance(g, dict) for g in generated):
        return [], [], GENERATED_MISMATCH
    by_message = {g.get("message"): g for g in generated}
    answers = [k for k, m in enumerate(conv) if m["role"] == "assistant"]
    supervised = np.asarray(mask, dtype=np.int8)
    edges = np.diff(np.r_[0, supervised, 0])
    runs = list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))
    if len(runs) != len(answers) or not set(by_message) <= set(answers):
        return [], [], GENERATED_MISMATCH
    special = _special_ids(tokenizer)
    new_ids: list[int] = []
    new_mask: list[int] = []
    at = 0
    for (a, b), k in zip(runs, answers):
        new_ids += ids[at:a]
        new_mask += [0] * (a - at)
        at = b
        g = by_message.get(k)
        if g is None:  # not the target's answer: context
            new_ids += ids[a:b]
            new_mask += [0] * (b - a)
            continue
        tokens = g.get("token_ids")
        if tokens is None:
            new_ids += ids[a:b]
            new_mask += [1] * (b - a)
            continue
        if not (isinstance(tokens, list) and all(type(t) is int for t in tokens)):
            return [], [], GENERATED_MISMATCH
        tail = _generated_tail(tokenizer, ids[a:b], tokens, special)
        if tail is None:
            return [], [], GENERATED_MISMATCH
        new_ids += tokens + tail
        new_mask += [1] * len(tokens) + [int(g.get("finish_reason") != "length")] * len(tail)
    new_ids += ids[at:]
    new_mask += [0] * (len(ids) - at)
    return new_ids, new_mask, ""


def _generated_tail(tokenizer, rendered: list[int], generated: list[int], special: set[int]) -> list[int] | None:
    """The special tokens the template renders after the generated ones (an end of turn the engine did not report:
    its stop token left out, or an answer that was cut), or None where `rendered` is not the text of `generated`
    followed by special tokens only."""
    def text(t: list[int]) -> str:
        return tokenizer.decode(t, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    if rendered == generated:
        return []
    whole, answer = text(rendered), text(generated)
    if not whole.startswith(answer):
        return None
    for j in range(len(rendered), -1, -1):
        tail = rendered[j:]
        if tail and tail[0] not in special:
            break
        if text(tail) == whole[len(answer):] and text(rendered[:j]) == answer:
            return tail
    return None
