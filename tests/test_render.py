"""A chat template's render is bounded (hsx.render, the renderer hsx.masks uses): in CPU time and output size for
the whole job (one line) or for a row (a counted skip naming why); a step without a bound (an integer power, a
literal width or count past MAX_REPEAT) is refused before the template compiles; a step whose size a row decides
is checked before it allocates. Templates within the bounds render exactly as jinja renders them."""

from __future__ import annotations

import pytest

from helpers import chat_tokenize_peak
from chat_families import FAMILIES, QWEN3, family

from hsx import data, masks, render
from hsx.config import HsxError


# ---- a template's render is bounded in time and size: the job stops in one line, or the row is a counted skip ------

CONV = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_a_template_that_multiplies_every_row_stops_the_job_in_one_line(monkeypatch):
    tok = family("qwen3", QWEN3.replace("message.content", "message.content * 200000"))
    assert "* 200000" in tok.chat_template
    with pytest.raises(HsxError, match="characters .* every row"):
        masks.derive_chat_format(tok, {}, name="evil")


def test_a_template_that_loops_without_end_stops_the_job_in_one_line(monkeypatch):
    monkeypatch.setattr(render, "RENDER_CPU_SECONDS", 0.5)
    monkeypatch.setattr(render.cpu_time_limit, "__defaults__", (0.5,))
    loops = "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}{% endfor %}" \
            "{% endfor %}{% endfor %}"
    tok = family("qwen3", loops + QWEN3)
    with pytest.raises(HsxError, match="CPU .* every row"):
        masks.derive_chat_format(tok, {}, name="evil")


def test_a_row_whose_render_explodes_is_a_counted_skip_naming_why(monkeypatch):
    monkeypatch.setattr(render.cpu_time_limit, "__defaults__", (0.5,))
    bomb = ("{%- if 'BOOM' in message.content %}{{ message.content * 3000000 }}{% endif %}"
            "{%- if 'LOOP' in message.content %}{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}"
            "{% endfor %}{% endif %}")
    tok = family("qwen3", QWEN3.replace("{%- for message in messages %}", "{%- for message in messages %}" + bomb, 1))
    assert bomb in tok.chat_template
    fmt = masks.derive_chat_format(tok, {})
    convs = [CONV, [{"role": "user", "content": "BOOM"}, CONV[1]], [{"role": "user", "content": "LOOP"}, CONV[1]]]
    reasons = [r[2] for r in data.chat_tokenize(tok, convs, {}, None, fmt, render.render_char_limit(64))]
    assert reasons == ["", "chat_template_output_too_long", "chat_template_timeout"]


def test_a_row_that_explodes_a_template_with_generation_markers_never_reaches_the_tokenizer(monkeypatch):
    """With `{% generation %}` markers transformers renders and tokenizes in one call: the render's size is checked
    first, so a row rendering hundreds of MB is a counted skip, not a tokenizer abort; the other rows keep their
    marker masks."""
    from hsx.demo import CHAT_TEMPLATE, build_tokenizer

    bomb = "{%- if 'BOOM' in message.content %}{{ message.content * 3000000 }}{% endif %}"
    template = CHAT_TEMPLATE.replace("{%- for message in messages -%}", "{%- for message in messages -%}" + bomb, 1)
    assert bomb in template
    tok = build_tokenizer(template)
    seen = []
    convs = [CONV, [{"role": "user", "content": "BOOM"}, CONV[1]], CONV]
    real_call = type(tok).__call__

    def counting_call(self, text, *a, **k):
        seen.extend(len(t) for t in ([text] if isinstance(text, str) else text))
        return real_call(self, text, *a, **k)

    monkeypatch.setattr(type(tok), "__call__", counting_call)
    rows = data.chat_tokenize(tok, convs, {}, None, None, render.render_char_limit(64))
    assert [r[2] for r in rows] == ["", "chat_template_output_too_long", ""]
    assert rows[0][:2] == rows[2][:2] and sum(rows[0][1]) > 0  # marker masks of the other rows
    assert seen and max(seen) < render.render_char_limit(64)  # the tokenizer never saw the exploded render


def test_a_row_of_many_turns_is_bounded_by_a_row_budget(monkeypatch):
    """Derived masks render each turn's prefixes, so a row's renders grow with turns × length: 1,000 one-letter
    turns (a 40 KB row) took 98 s of CPU, each render well within its own bound. The renders of one row share a
    budget (ROW_CPU_SECONDS, here 0.5 s): past it the row is a counted chat_template_timeout, and the next row
    gets its own budget."""
    import time

    monkeypatch.setattr(render, "ROW_CPU_SECONDS", 0.5, raising=False)
    tok = family("qwen3")
    fmt = masks.derive_chat_format(tok, {})
    many = [m for _ in range(300) for m in ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"})]
    fine = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    start = time.process_time()
    rows = data.chat_tokenize(tok, [fine, many, fine], {}, None, fmt, render.render_char_limit(131072))
    spent = time.process_time() - start
    assert [r[2] for r in rows] == ["", "chat_template_timeout", ""]
    assert rows[0][0] and rows[0] == rows[2]
    assert spent < 5, spent  # (unbounded: ~10 s)


def test_unrendered_finds_its_sentinels_in_one_pass():
    """masks.unrendered searched the render once per sentinel: 80,000 tool results (a 2.4 MB row) took 39 s after
    the render. One pass over the render finds them all; a message the template drops is still named."""
    import time

    tok = family("qwen3")
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}
    conv = [{"role": "user", "content": "hi"}, call, *[{"role": "tool", "content": "r"}] * 50_000,
            {"role": "assistant", "content": "ok"}]
    start = time.process_time()
    assert masks.unrendered(tok, conv, None, {}, max_chars=64 * 131072) == ""
    spent = time.process_time() - start
    assert spent < 5, spent  # (a search per sentinel: ~15 s here)
    dropped = family("qwen3", "{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}{% for c in "
                              "m.tool_calls or [] %}{{ c.function.name }}{% endfor %}{% endif %}{% endfor %}")
    assert masks.unrendered(dropped, conv[:3] + conv[-1:], None, {}) == "message_not_rendered"


# ---- a step with no bound is refused before the template compiles or renders ---------------------------------------

@pytest.mark.parametrize("power", ["{{ 10 ** 100000000 }}",  # folded while the template compiles
                                   "{{ 2 ** (messages[0].content | length * 100000000) }}",  # from the data
                                   "{%- set n = 10 ** 60 %}{%- set n = n ** 60 %}{%- set n = n ** 60 %}"
                                   "{{ n ** 60 }}",  # powers of powers through a variable
                                   "{{ (((10 ** 60) ** 60) ** 60) ** 60 }}",
                                   "{{ 'x' * 10 ** 10 }}", "{{ [0] * 10000000000 }}"])  # gigabytes in one step
def test_a_template_with_an_unbounded_step_is_refused_before_it_renders(power):
    # One integer power is one step of C code that no timer interrupts (`10 ** 100000000` ran for minutes).
    tok = family("qwen3", power + QWEN3)
    with pytest.raises(HsxError, match=r"a step without a bound \(`\*\*?`.* on line 1: "):
        masks.derive_chat_format(tok, {}, name="evil")
    tok.chat_template = {"default": QWEN3, "tool_use": power + QWEN3}  # every named template is read
    with pytest.raises(HsxError, match="small constant"):
        render.check_template_bounds(tok, {}, name="evil")
    assert render.unbounded_step(power + QWEN3).startswith("`*")


def test_small_constant_powers_render_as_before():
    tok = family("qwen3", "{%- set unit = 2 ** 10 %}{%- set half = 2 ** -1 %}{%- set root = messages | length ** 0.5 %}"
                          + QWEN3)
    assert render.unbounded_step(tok.chat_template) is None
    assert render.unbounded_step("{{ '-' * 2 ** 20 }}{{ messages[0].content * 3000000 }}") is None
    plain = masks.derive_chat_format(family("qwen3", QWEN3), {})
    assert masks.derive_chat_format(tok, {}) == plain


@pytest.mark.parametrize("template", [
    "{{ 'x'|center(10000000000) }}",  # jinja folds a filter of literals while it compiles: before any render
    "{{ 'x'|center(10 ** 10) }}",
    "{{ '%*s'|format(10000000000, 'x') }}",
    "{{ ['a']|batch(10000000000, 'z')|list }}",
    "{{ 'a'|indent(width=10000000000) }}",
    "{{ '%9999999999s' % 'x' }}",  # (transformers' environment folds `%` too)
    "{{ '{:>9999999999}'.format('x') }}",
    "{{ 'x'.center(10000000000) }}",
])
def test_a_literal_width_past_the_bound_is_refused_before_it_compiles(template):
    """A filter or `%` of literal operands is computed while jinja compiles the template (transformers compiles it
    before the first render), so no render bound can see it: a literal width or count above MAX_REPEAT is refused
    by the static check, as `'x' * 10**10` is. The templates of the model families pass."""
    assert render.unbounded_step(template) is not None
    with pytest.raises(HsxError, match="a step without a bound"):
        render.check_template_bounds(family("qwen3", template), {})
    for name, spec in FAMILIES.items():
        assert render.unbounded_step(spec["template"]) is None, name


# ---- a step whose size a row decides is checked against the render's bound before it allocates ---------------------

@pytest.mark.parametrize("markers", [False, True])
def test_a_repetition_a_row_sizes_is_refused_before_it_allocates(markers):
    """`'x' * (message.content | int)`: the static check sees no literal count; a row of '90000000' built 90 MB
    (a row of '10000000000', 10 GB) before the render's length bound could look at it."""
    bomb = "{%- if message.content is string and message.content[:1] == '9' %}{{ 'x' * (message.content | int) }}" \
           "{% endif %}"
    if markers:  # (rendered and tokenized by transformers in one call)
        from hsx.demo import CHAT_TEMPLATE, build_tokenizer

        template = CHAT_TEMPLATE.replace("{%- for message in messages -%}", "{%- for message in messages -%}" + bomb, 1)
        tok = build_tokenizer(template)
    else:
        template = QWEN3.replace("{%- for message in messages %}", "{%- for message in messages %}" + bomb, 1)
        tok = family("qwen3", template)
    assert bool(masks.GENERATION_TAG.search(template)) == markers
    assert render.unbounded_step(tok.chat_template) is None and bomb in tok.chat_template
    conv = [{"role": "user", "content": "90000000"}, {"role": "assistant", "content": "ok"}]
    fine = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    fmt = None if markers else masks.derive_chat_format(tok, {})
    rows, peak = chat_tokenize_peak(tok, [fine, conv, fine], fmt)
    assert [r[2] for r in rows] == ["", "chat_template_output_too_long", ""]
    assert rows[0][0] and rows[0] == rows[2]
    assert peak < 20_000_000, peak  # (the 90 MB string was never built)
    # outside hsx's render bounds the same compiled template renders as transformers does
    assert len(tok.apply_chat_template([{"role": "user", "content": "9000"}], tokenize=False)) > 9000


N = "(message.content | int)"  # a row's content of '20000000': 20 M characters, past the render's 1 M bound


STEPS = {
    "str.center": "{{ 'x'.center(%s) }}" % N,
    "str.ljust": "{{ 'x'.ljust(%s) }}" % N,
    "str.zfill": "{{ 'x'.zfill(%s) }}" % N,
    "str.expandtabs": "{{ '\\t'.expandtabs(%s) }}" % N,
    "str.center by item": "{{ 'x'['center'](%s) }}" % N,
    "str.format width": "{{ '{:>{}}'.format('x', %s) }}" % N,
    "str.format_map width": "{{ '{a:>{w}}'.format_map({'a': 'x', 'w': %s}) }}" % N,
    "str.replace": "{{ ('x' * (%s // 1000)).replace('x', 'y' * 1000) }}" % N,
    "str.translate": "{{ ('x' * (%s // 1000)).translate({120: 'y' * 1000}) }}" % N,
    "% width": "{{ '%%*s' %% (%s, 'x') }}" % N,
    "|center": "{{ 'x'|center(%s) }}" % N,
    "|format width": "{{ '%%*s'|format(%s, 'x') }}" % N,
    "|indent": "{{ 'a\\nb'|indent(%s) }}" % N,
    "|batch fill": "{{ (['a']|batch(%s, 'z')|list)|length }}" % N,
    "|wordwrap": "{{ ('x' * (%s // 1000))|wordwrap(1, true, 'y' * 1000)|length }}" % N,
    "|join of a repeated list": "{%% set big = 'x' * (%s // 1000) %%}{{ ([big] * 1000)|join|length }}" % N,
    "|tojson of a repeated list": "{%% set big = 'x' * (%s // 1000) %%}{{ ([big] * 1000)|tojson|length }}" % N,
    "|tojson of a repeated mapping": "{%% set d = {'a': 'x' * (%s // 1000)} %%}{{ ([d] * 1000)|tojson|length }}" % N,
    "|string of nested repeated lists": "{%% set big = ['x' * (%s // 1000000)] %%}{%% set l = [big] * 1000 %%}"
                                        "{{ ([l] * 1000)|string|length }}" % N,
    "~ doubling": "{%- set ns = namespace(s='xxxxxxxxxx') %}{%- for i in range(22) %}{%- set ns.s = ns.s ~ ns.s %}"
                  "{%- endfor %}{{ ns.s|length }}",
    "+ doubling": "{%- set ns = namespace(s='xxxxxxxxxx') %}{%- for i in range(22) %}{%- set ns.s = ns.s + ns.s %}"
                  "{%- endfor %}{{ ns.s|length }}",
    "a macro emitting one string": "{%% macro m(big) %%}{%% for i in range(1000) %%}{{ big }}{%% endfor %%}"
                                   "{%% endmacro %%}{{ m('x' * (%s // 1000))|length }}" % N,
    "a set block emitting one string": "{%% set big = 'x' * (%s // 1000) %%}{%% set s %%}{%% for i in range(1000) %%}"
                                       "{{ big }}{%% endfor %%}{%% endset %%}{{ s|length }}" % N,
    "a loop emitting one string": "{%% set big = 'x' * (%s // 1000) %%}{%% for i in range(1000) %%}{{ big }}"
                                  "{%% endfor %%}" % N,
}


@pytest.mark.parametrize("step", list(STEPS))
def test_a_step_a_row_sizes_is_refused_before_it_allocates(step):
    """Each step is one C call (or a few) that builds tens of MB from a row's `20000000` (10 GB from one of
    `10000000000`, and the process killed) before the render's length could be looked at, and no CPU timer
    interrupts a C call: each is checked against the render's bound before it runs, and the row is a counted
    chat_template_output_too_long. The other rows render as before."""
    bomb = "{%- if message.content is string and message.content[:1] == '2' %}" + STEPS[step] + "{% endif %}"
    template = QWEN3.replace("{%- for message in messages %}", "{%- for message in messages %}" + bomb, 1)
    tok = family("qwen3", template)
    assert render.unbounded_step(tok.chat_template) is None and bomb in tok.chat_template
    conv = [{"role": "user", "content": "20000000"}, {"role": "assistant", "content": "ok"}]
    fine = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    fmt = masks.derive_chat_format(tok, {})
    rows, peak = chat_tokenize_peak(tok, [fine, conv, fine], fmt)
    assert [r[2] for r in rows] == ["", "chat_template_output_too_long", ""]
    assert rows[0][0] and rows[0] == rows[2]
    assert peak < 10_000_000, peak  # (the tens of MB were never built)


def test_the_checked_steps_render_as_before_within_the_bound_and_outside_it():
    """The same steps on small operands render what jinja renders (the checks only refuse), inside hsx's render
    bounds and outside them (another user of the compiled template in this process)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    small = ("{{ 'x'.center(5) }}|{{ 'ab'|center(6) }}|{{ '%*s' % (4, 'y') }}|{{ '{:>{}}'.format('z', 3) }}|"
             "{{ 'a\\nb'|indent(2) }}|{{ ['a', 'b']|join('-') }}|{{ 'x' ~ 'y' ~ 1 }}|{{ 'p' + 'q' }}|"
             "{{ 'aXa'.replace('X', 'yy') }}|{{ (['a', 'b', 'c']|batch(2, 'z')|list)|length }}|"
             "{{ '%s-%d'|format('s', 7) }}|{{ 'abc'.translate({98: 'BB'}) }}|{{ [1] * 3 }}|{{ 'abc'[[1]] }}|"
             "{% for m in messages %}{{ m.content }}{% endfor %}")
    want = "  x  |  ab  |   y|  z|a\n  b|a-b|xy1|pq|ayya|2|s-7|aBBc|[1, 1, 1]||hihello"
    tok = family("qwen3", small)
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with render.render_bounds(tok, {}, None):
        assert tok.apply_chat_template(conv, tokenize=False) == want
    assert getattr(_compile_jinja_template(small), "_hsx_bounded", False)
    assert tok.apply_chat_template(conv, tokenize=False) == want
    big = family("qwen3", "{{ 'x'.center(3000000)|length }}{{ 'y' * 2000000 }}")
    assert len(big.apply_chat_template(conv, tokenize=False)) == 2000007  # (outside the bounds: no check)
