"""The bounded chat-template renderer: a render is a template program run on a row's data, so the work one row
can cause is bounded before and while it runs.

- Before the first render, `check_template_bounds` refuses a template with a step no timer interrupts
  (`unbounded_step`: a power that is not a small constant, a literal repetition or width above MAX_REPEAT), and one
  whose render of a two-word conversation already runs past the bounds below.
- Each render (`render_chat`, or a caller's own inside `render_bounds`) gets RENDER_CPU_SECONDS of CPU
  (`cpu_time_limit`), the row's renders together ROW_CPU_SECONDS (`row_budget`), and every step that can build a
  long string or list (`*`, `+`, `%`, `~`, width-taking methods and filters, the render's output) is checked
  against the render's character bound before it runs (`_bound_repetitions`).

A render past a bound raises RenderLimit, whose `reason` is the row's skip reason (hsx.data counts it); hsx.masks
reads loss masks off the renders made here.
"""

from __future__ import annotations

import contextvars
import re
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any

from hsx.config import HsxError

# A two-word conversation (letters only: templates trim and split text), the sentinels of a render's user and
# assistant turns here and in hsx.masks (which adds its own for the other parts of a conversation)
SENTINEL_USER, SENTINEL_ANSWER = "HsxSentUserQ", "HsxSentAnswerA"

# A render is a template program run on the row's data; these bound the work one row can cause. A template's
# loops are Python (Jinja compiles to it), stopped by a CPU-time timer; one C-level operation (a string repeated
# 10^5 times) is not interrupted, but its result is refused before the tokenizer (which aborts the process on an
# allocation it cannot make) sees it. Normal renders take about a millisecond and a few KB per turn.
RENDER_CPU_SECONDS = 5.0
RENDER_MIN_CHARS = 1 << 20  # what any render may be; a row may be CHARS_PER_TOKEN_BOUND × max_length
CHARS_PER_TOKEN_BOUND = 64  # far above any tokenizer's characters per token: longer is no truncation candidate


class RenderLimit(Exception):
    """A render that ran past RENDER_CPU_SECONDS or produced more than its character bound: `reason` is the
    row's skip reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def render_char_limit(max_length: int) -> int:
    """The longest render of a row whose tokens are truncated at max_length."""
    return max(RENDER_MIN_CHARS, CHARS_PER_TOKEN_BOUND * max_length)


@contextmanager
def cpu_time_limit(seconds: float = RENDER_CPU_SECONDS):
    """RenderLimit('chat_template_timeout') once this process has spent `seconds` of CPU inside the block. A
    CPU-time timer (SIGVTALRM), not a wall clock: a loaded machine does not turn a slow row into a skipped one,
    and SIGALRM stays free for the caller. Only in the main thread (where signals are delivered); elsewhere the
    block runs unbounded in time."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum, frame):
        raise RenderLimit("chat_template_timeout", f"the chat template ran over {seconds:g} s of CPU on one render")

    previous = signal.signal(signal.SIGVTALRM, expired)
    signal.setitimer(signal.ITIMER_VIRTUAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, previous)


ROW_CPU_SECONDS = 60.0  # all renders of one row: derived masks render each prefix (~3 per turn), so a row's cost
# grows with turns × length: 1,000 one-letter turns (a 40 KB row) took 98 s on one core, 100 such turns ~1 s
_ROW_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("hsx_row_deadline", default=None)


@contextmanager
def row_budget(seconds: float | None = None):
    """Within it, the renders of one row together may spend `seconds` (ROW_CPU_SECONDS) of this thread's CPU: a
    render that starts after that is RenderLimit('chat_template_timeout'). Each render is bounded by itself
    (`cpu_time_limit`); this bounds how many renders one row can ask for."""
    token = _ROW_DEADLINE.set(time.thread_time() + (ROW_CPU_SECONDS if seconds is None else seconds))
    try:
        yield
    finally:
        _ROW_DEADLINE.reset(token)


def _check_row_budget() -> None:
    deadline = _ROW_DEADLINE.get()
    if deadline is not None and time.thread_time() > deadline:
        raise RenderLimit("chat_template_timeout", "the chat template's renders of one row ran over "
                          f"{ROW_CPU_SECONDS:g} s of CPU together")


# The longest `s * n` (characters or items) a render in `render_bounds` may build: its render's own bound.
_REPEAT_LIMIT: contextvars.ContextVar[int | None] = contextvars.ContextVar("hsx_repeat_limit", default=None)


@contextmanager
def render_bounds(tokenizer, template_kwargs: dict[str, Any], tools=None, max_chars: int = RENDER_MIN_CHARS):
    """The bounds of one render (or one batch's): the row's CPU budget left (`row_budget`), RENDER_CPU_SECONDS of
    CPU (`cpu_time_limit`), and every step that can build a long string or list checked before it runs
    (`_bound_repetitions`): one longer than `max_chars` (the render's own bound) is
    RenderLimit('chat_template_output_too_long'). `'x' * (message.content | int)` with a row's content of
    '10000000000' would be one allocation of 10 GB, made (or the process killed) before the render's length could
    be looked at; the static check (`unbounded_step`) sees only literal counts."""
    _check_row_budget()
    _bound_repetitions(tokenizer, template_kwargs, tools)
    token = _REPEAT_LIMIT.set(max_chars)
    try:
        with cpu_time_limit():
            yield
    finally:
        _REPEAT_LIMIT.reset(token)


def _bound_repetitions(tokenizer, template_kwargs: dict[str, Any], tools) -> None:
    """Recompile transformers' cached template for this tokenizer and kwargs (its own sandboxed environment,
    filters and globals) with every step that can build a string or list far longer than its operands checked
    first (`_Sizes`), once per template: `*`, `+` and `%` (jinja2's `intercepted_binops`), `~` (the template's own
    join), the width-taking str methods and filters (`'x'.center(n)`, `'%*s' % (n, x)`, `'{:>{}}'.format(x, n)`,
    `|indent(n)`, `|batch(n)`, ...), and the render's total output (a loop emitting one long string 100,000 times
    is joined in one step). Each is one C call of gigabytes (or a process killed) that no CPU timer interrupts.
    Outside `render_bounds` the checks let everything through, so another user of the same template in this
    process renders as before. Where transformers' internals differ, nothing is changed: the static check and the
    render's length bound still apply."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        source = tokenizer.get_chat_template(template_kwargs.get("chat_template"), tools or None)
        compiled = _compile_jinja_template(source)
        if getattr(compiled, "_hsx_bounded", False):
            return
        env = compiled.environment
        if not getattr(env, "sandboxed", False):
            return
        env.intercepted_binops = frozenset(env.intercepted_binops | {"*", "+", "%"})
        env.call_binop = _checked_binop(env.call_binop)
        env.call = _checked_call(env.call)
        env.concat = _checked_join(env.concat)  # (a macro's, a `{% set %}` block's, a `{% filter %}` block's output)
        for name, size in _FILTER_SIZES.items():
            if name in env.filters:
                env.filters[name] = _checked_filter(env.filters[name], size)
        fresh = env.from_string(source)
        namespace = fresh.root_render_func.__globals__  # (this template's module: its blocks and macros share it)
        for join in ("str_join", "markup_join"):
            if callable(namespace.get(join)):
                namespace[join] = _checked_join(namespace[join])
        compiled.root_render_func, compiled.blocks = _bounded_output(fresh.root_render_func), fresh.blocks
        compiled._debug_info = getattr(fresh, "_debug_info", getattr(compiled, "_debug_info", ""))
        compiled._hsx_bounded = True
    except Exception:  # noqa: BLE001  (no template, another transformers: its own render says so, per row)
        return


def _too_long(size: int, what: str) -> None:
    """RenderLimit when a step would build `size` characters or items, past the render's own bound."""
    limit = _REPEAT_LIMIT.get()
    if limit is not None and size > limit:
        raise RenderLimit("chat_template_output_too_long", f"the chat template {what} of {size:,} characters or "
                          f"items in one render (at most {limit:,} in all)")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _chars(x: Any, depth: int = 8, memo: dict[int, int] | None = None) -> int:
    """Characters (and items) of a string, or of the strings lists, tuples and mappings hold at any depth to 8,
    each object counted as often as it is referenced: what serializing the value (`|tojson`, `|string`, `~`) would
    write. `[{'a': big}] * 1000` holds 1000 references to one string; written out, they are 1000 copies of it.
    Each object is measured once (`memo`), so a list of n references costs n additions."""
    if isinstance(x, str):
        return len(x)
    if not isinstance(x, (list, tuple, dict)) or depth == 0:
        return 0
    memo = {} if memo is None else memo
    if id(x) not in memo:
        memo[id(x)] = 0  # (a structure holding itself: counted once)
        items = [*x.keys(), *x.values()] if isinstance(x, dict) else x
        memo[id(x)] = len(items) + sum(_chars(v, depth - 1, memo) for v in items)
    return memo[id(x)]


_PERCENT_SPEC = re.compile(r"%[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


def _format_width(fmt: str, args: Any, braces: bool) -> int:
    """The widest field a format string may pad to: a width or precision written in it, or, where it takes one
    from its arguments (`%*s`, `{:{}}`), the largest integer argument."""
    specs: list[str] = []
    if braces:
        import string

        try:
            specs = [spec for _, field, spec, _ in string.Formatter().parse(fmt) if field is not None and spec]
        except ValueError:  # (malformed: the call itself raises)
            return 0
        dynamic = any("{" in spec for spec in specs)
        digits = [d for spec in specs for d in _DIGITS.findall(spec)]
    else:
        groups = [g for m in _PERCENT_SPEC.finditer(fmt) for g in m.groups() if g]
        dynamic = "*" in groups
        digits = [g for g in groups if g != "*"]
    widths = [(1 << 62) if len(d) > 18 else int(d) for d in digits]
    if dynamic:
        values = args.values() if isinstance(args, dict) else args if isinstance(args, (list, tuple)) else (args,)
        widths += [abs(v) for v in values if _is_int(v)]
    return max(widths, default=0)


def _checked_binop(call_binop):
    def checked(context, operator, left, right):
        if _REPEAT_LIMIT.get() is not None:
            if operator == "*":
                for items, times in ((left, right), (right, left)):
                    if isinstance(items, (str, list, tuple)) and _is_int(times):
                        _too_long(max(_chars(items), len(items)) * times, f"repeats {len(items):,} characters "
                                  f"or items {times:,} times: a string or list")
            elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                _too_long(_chars(left) + _chars(right), "adds a string or list")
            elif operator == "%" and isinstance(left, str):
                _too_long(len(left) + _format_width(left, right, False), "formats (`%`) a string")
        return call_binop(context, operator, left, right)

    return checked


def _method_size(method: str, s: str, args: tuple, kwargs: dict) -> int:
    """How long `s.method(*args)` can be (0: not a method that grows a string past its operands)."""
    first = args[0] if args else None
    if method in ("center", "ljust", "rjust", "zfill"):
        return first if _is_int(first) else 0
    if method == "expandtabs":
        size = first if _is_int(first) else kwargs.get("tabsize", 8)
        return len(s) * size if _is_int(size) else 0
    if method == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        return len(s) + (s.count(args[0]) if args[0] else len(s) + 1) * len(args[1])
    if method == "join" and isinstance(first, (list, tuple)):
        return _chars(first) + len(s) * len(first)
    if method == "translate" and isinstance(first, dict):
        return len(s) * max([len(v) for v in first.values() if isinstance(v, str)] + [1])
    if method in ("format", "format_map"):
        values = (first if method == "format_map" else [*args, *kwargs.values()])
        strings = values.values() if isinstance(values, dict) else values
        return len(s) + _format_width(s, values, True) + sum(_chars(v) for v in strings)
    return 0


def _checked_call(call):
    """`env.call` (every call a template makes) checking a str's growing methods (`_method_size`) before they run
    (jinja's sandboxed `format` wrapper names the method it wraps in `__wrapped__`)."""
    def checked(*args, **kwargs):
        if _REPEAT_LIMIT.get() is not None and len(args) >= 2:
            method = getattr(args[1], "__wrapped__", args[1])
            s, name = getattr(method, "__self__", None), getattr(method, "__name__", None)
            if isinstance(s, str) and name in _METHODS:
                _too_long(_method_size(name, s, args[2:], kwargs), f"builds a string (str.{name})")
        return call(*args, **kwargs)

    return checked


_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "replace", "join", "translate", "format",
                      "format_map"})


def _lines(s: Any) -> int:
    return s.count("\n") + 1 if isinstance(s, str) else 0


def _filter_arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


# Filters that build a string or list longer than their operands: how long, from (value, *args, **kwargs).
_FILTER_SIZES = {
    "center": lambda v, a, k: _filter_arg(a, k, 0, "width", 80) if _is_int(_filter_arg(a, k, 0, "width", 80)) else 0,
    "indent": lambda v, a, k: len(str(v)) + _lines(str(v)) * (
        len(w) if isinstance(w := _filter_arg(a, k, 0, "width", 4), str) else w if _is_int(w) else 0),
    "format": lambda v, a, k: (len(v) + _format_width(v, a or k, False) + sum(_chars(x) for x in a))
    if isinstance(v, str) else 0,
    "join": lambda v, a, k: _chars(v) + (len(v) * len(d) if isinstance(d := _filter_arg(a, k, 0, "d", ""), str)
                                          else 0) if isinstance(v, (list, tuple)) else 0,
    "replace": lambda v, a, k: len(v) + (v.count(a[0]) if a[0] else len(v) + 1) * len(a[1])
    if isinstance(v, str) and len(a) >= 2 and isinstance(a[0], str) and isinstance(a[1], str) else 0,
    "batch": lambda v, a, k: n if _is_int(n := _filter_arg(a, k, 0, "linecount", 0)) else 0,
    "wordwrap": lambda v, a, k: len(v) * (1 + len(w)) if isinstance(v, str) and isinstance(
        w := _filter_arg(a, k, 2, "wrapstring", ""), str) else 0,
}


def _checked_filter(f, size):
    """A filter checked (`size` of its value and arguments) before it runs; its jinja `pass_*` marker kept."""
    import functools

    passed = getattr(f, "jinja_pass_arg", None) is not None  # (@pass_context & co.: that comes first)

    @functools.wraps(f)
    def checked(*args, **kwargs):
        if _REPEAT_LIMIT.get() is not None:
            value, rest = (args[1], args[2:]) if passed else (args[0], args[1:])
            try:
                n = size(value, rest, kwargs)
            except (TypeError, AttributeError, IndexError):  # (arguments the filter itself refuses)
                n = 0
            _too_long(n, f"builds a string or list (|{f.__name__.removeprefix('do_')})")
        return f(*args, **kwargs)

    return checked


def _checked_join(join):
    """The template's `~` (jinja2's str_join / markup_join), the pieces' length checked before they are joined."""
    def checked(seq):
        seq = list(seq)
        if _REPEAT_LIMIT.get() is not None:
            _too_long(sum(len(x) if isinstance(x, str) else _chars(x) for x in seq), "joins (`~`) a string")
        return join(seq)

    return checked


def _bounded_output(root):
    """The template's render function, its output counted as it comes (before `concat` or the caller joins it)."""
    def bounded(context):
        limit = _REPEAT_LIMIT.get()
        if limit is None:
            yield from root(context)
            return
        total = 0
        for piece in root(context):
            total += len(piece)
            if total > limit:
                _too_long(total, "outputs a render")
            yield piece

    return bounded


def render_chat(tokenizer, conv: list[dict], tools, agp: bool, kwargs: dict[str, Any],
                max_chars: int = RENDER_MIN_CHARS) -> str:
    """The template's render of `conv` as text, inside `render_bounds` and no longer than `max_chars`
    (RenderLimit otherwise)."""
    with render_bounds(tokenizer, kwargs, tools, max_chars):
        text = tokenizer.apply_chat_template(conv, tools=tools or None, tokenize=False, add_generation_prompt=agp,
                                             **kwargs)
    if not isinstance(text, str):
        raise TypeError(f"the template rendered {type(text).__name__}, not text")
    if len(text) > max_chars:
        raise RenderLimit("chat_template_output_too_long", f"the chat template rendered {len(text):,} characters "
                          f"for one conversation (at most {max_chars:,})")
    return text


SMALL_EXPONENT = 64  # `b ** e` of two literal numbers, e this small: fast for any literal b (4,300 digits at most)
MAX_REPEAT = 10**8  # `s * n` with a literal n above this: one allocation of gigabytes, whatever s is


def unbounded_step(source: str) -> str | None:
    """Where a chat template raises a number to a power that is not a small constant, or repeats something a
    literal number of times above MAX_REPEAT (None: nowhere). An integer
    power is one step of C code whose time grows with the exponent (`10 ** 100000000` runs for minutes, and a
    constant one already while the template compiles), and a power of a variable can be a power of a power: no timer
    can stop it, so such a template is refused before its first render. What passes: literal numbers to a small
    literal power, and anything to a float power (a float, or an OverflowError at once). Likewise `'x' * 10**10` is
    one allocation of 10 GB before any bound on the render's length can look. Templates of the model families use
    neither."""
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):  # transformers' `{% generation %}` tag, parsed only
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(extensions=[Generation, jinja2.ext.loopcontrols])
    try:
        tree = env.parse(source)
    except (jinja2.TemplateError, RecursionError):  # transformers names a template it cannot read, per row
        return None

    def number(node):  # a literal number (with its sign, or a literal power that passes), else None
        sign = 1
        while isinstance(node, (nodes.Neg, nodes.Pos)):
            sign, node = (-sign if isinstance(node, nodes.Neg) else sign), node.node
        if isinstance(node, nodes.Pow):
            base, exponent = number(node.left), number(node.right)
            small = (isinstance(exponent, int) and abs(exponent) <= SMALL_EXPONENT and isinstance(base, int)
                     and abs(base).bit_length() * abs(exponent) <= 1 << 16 and (base or exponent >= 0))
            return sign * base ** exponent if small else None
        value = node.value if isinstance(node, nodes.Const) else None
        return sign * value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    for power in tree.find_all(nodes.Pow):
        base, exponent = number(power.left), number(power.right)
        if not (isinstance(exponent, float) or (
                isinstance(exponent, int) and abs(exponent) <= SMALL_EXPONENT and base is not None)):
            return f"`**` on line {power.lineno}"
    for product in tree.find_all(nodes.Mul):
        for factor in (number(product.left), number(product.right)):
            if isinstance(factor, int) and abs(factor) > MAX_REPEAT:
                return f"`*` by {factor:.3g} on line {product.lineno}"
    # jinja folds a filter of literals while it compiles (`'x'|center(10**10)`, `'%*s'|format(10**10, 'x')`), and
    # transformers' environment folds `%` too: a literal width is refused here, one from a row when it runs
    for call in tree.find_all((nodes.Filter, nodes.Call)):
        for arg in [*call.args, *(k.value for k in call.kwargs)]:
            width = number(arg)
            if isinstance(width, int) and abs(width) > MAX_REPEAT:
                return f"a width or count of {width:.3g} on line {call.lineno}"
    for fmt in tree.find_all(nodes.Mod):
        if isinstance(fmt.left, nodes.Const) and isinstance(fmt.left.value, str) and _format_width(
                fmt.left.value, (), False) > MAX_REPEAT:
            return f"a `%` width above {MAX_REPEAT:.0e} on line {fmt.lineno}"
    for fmt in tree.find_all(nodes.Const):
        if isinstance(fmt.value, str) and "{" in fmt.value and _format_width(fmt.value, (), True) > MAX_REPEAT:
            return f"a format width above {MAX_REPEAT:.0e} on line {fmt.lineno}"
    return None


def check_template_bounds(tokenizer, template_kwargs: dict[str, Any], name: str = "the tokenizer") -> None:
    """HsxError (one line) for a template whose render of a two-message conversation of a few words runs past the
    render bounds: it would on every row."""
    templates = getattr(tokenizer, "chat_template", None)
    for source in (templates.values() if isinstance(templates, dict) else [templates]):
        where = unbounded_step(source) if isinstance(source, str) else None
        if where:
            raise HsxError(f"the chat template of {name} has a step without a bound ({where}: a power that is not a "
                           f"small constant, or a repetition above {MAX_REPEAT:.0e}): one such step can run for hours "
                           "or take all memory and nothing can interrupt it, so hsx does not render it")
    try:
        render_chat(tokenizer, [{"role": "user", "content": SENTINEL_USER},
                                {"role": "assistant", "content": SENTINEL_ANSWER}], None, False, template_kwargs)
    except RenderLimit as e:
        raise HsxError(f"the chat template of {name}: {e} of a two-message conversation of two words, so it would "
                       "on every row") from None
    except Exception:  # noqa: BLE001  (other refusals are counted per row, as chat_template_error)
        pass
