"""A seventh held-out round on the newest surfaces: chat templates that build a string or list far longer than
their operands in one step (widths: `.center(n)`, `|indent(n)`, `'%*s' % (n, x)`, `'{:>{}}'.format(x, n)`,
`|batch(n)`; joins: `~` and `+` doubling in a loop, `|join` and `|tojson` of a repeated list, a loop emitting one
long string), `hsx verify` on an output whose rows are longer than its job's max_length, and row formats (tool-call
arguments, content parts, the system column) that were already refused or rendered as they should."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import chat_tokenize_peak, fault_argv, hsx_main, message_lines

from hsx import data, masks, render


def one_error_line(err: str) -> str:
    assert "Traceback" not in err, err[-2000:]
    errors = [line for line in message_lines(err) if line.startswith(("hsx: error: ", "hsx: verify failed: "))]
    assert len(errors) == 1, err[-2000:]
    return errors[0]


# ---- one step that builds a string or list far longer than its operands ---------------------------------------

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
    from chat_families import QWEN3, family

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
    from chat_families import family

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
    from chat_families import FAMILIES

    from hsx.config import HsxError

    from chat_families import family

    assert render.unbounded_step(template) is not None
    with pytest.raises(HsxError, match="a step without a bound"):
        render.check_template_bounds(family("qwen3", template), {})
    for name, spec in FAMILIES.items():
        assert render.unbounded_step(spec["template"]) is None, name


# ---- hsx verify: rows longer than the job's max_length -------------------------------------------------------

@pytest.fixture(scope="module")
def finished(tmp_path_factory, model4, small_chat_path) -> Path:
    out = tmp_path_factory.mktemp("round7") / "finished"
    rc, _, err = hsx_main(fault_argv(model4.path, small_chat_path, out))
    assert rc == 0, err
    return out


def test_verify_refuses_rows_longer_than_the_jobs_max_length(finished, tmp_path):
    """Every row hsx writes is cut at the job's max_length; a dir whose rows are longer (an hsx.json edited, or
    rows written by something else: one row of 10^6 tokens is an attention of 10^12 scores in the recompute) is
    not what the job wrote: one line naming max_length, before any row is run through the model."""
    out = Path(shutil.copytree(finished, tmp_path / "out"))
    rc, _, err = hsx_main(["verify", str(out), "--samples", "0"])
    assert rc == 0, err
    info = json.loads((out / "hsx.json").read_text())
    info["max_length"] = 4
    (out / "hsx.json").write_text(json.dumps(info))
    rc, _, err = hsx_main(["verify", str(out), "--samples", "0"])
    line = one_error_line(err)
    assert rc != 0 and "max_length 4" in line and "longer" in line, line


def test_against_bf16_refuses_a_job_record_that_cannot_check_the_model_folder(finished, tmp_path, model4):
    """A job record naming a Hub model without its commit (hsx records both, always), or a model that is neither
    an id nor a folder's files: --against-bf16 skipped its check of the model folder and compared the stored
    states with whatever model hsx.json named. One line naming job.json, before the model is read."""
    out = Path(shutil.copytree(finished, tmp_path / "out"))
    info = json.loads((out / "hsx.json").read_text())
    info["model_path"] = str(model4.path)
    (out / "hsx.json").write_text(json.dumps(info))
    job = json.loads((out / ".hsx" / "job.json").read_text())
    for model, revision, needle in (("someone/model", None, "recorded without its commit"),
                                    ("someone/model", "", "recorded without its commit"),
                                    (42, "abc", "neither a Hub id nor a folder's files")):
        job["inputs"].update(model=model, revision=revision)
        (out / ".hsx" / "job.json").write_text(json.dumps(job))
        rc, _, err = hsx_main(["verify", str(out), "--against-bf16", "2"])
        line = one_error_line(err)
        assert rc != 0 and needle in line and "job.json" in line, line


# ---- row formats that were already refused or rendered -----------------------------------------------------------

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


# ---- hsx verify --against-bf16: the model hsx.json names -----------------------------------------------------

def test_against_bf16_never_runs_code_of_the_model_folder_hsx_json_names(finished, tmp_path):
    """hsx.json (and a job fingerprint forged to name a Hub id, which checks no files) point --against-bf16 at a
    folder with `auto_map` code: transformers is never told to trust it, so its code does not run (one line, no
    marker file); hsx.json saying trust_remote_code is refused without --model; a model path that is a FIFO, the
    root folder or a file is one line (the job's record says it is no FP8 target), and no run waits on a FIFO."""
    import os

    out = Path(shutil.copytree(finished, tmp_path / "out"))
    evil = tmp_path / ("e" * 40)  # (named as a Hub snapshot is: its commit)
    evil.mkdir()
    marker = tmp_path / "ran"
    (evil / "config.json").write_text(json.dumps({
        "model_type": "evil-hsx", "architectures": ["EvilForCausalLM"], "num_hidden_layers": 4,
        "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel",
                     "AutoModelForCausalLM": "evil.EvilModel"}}))
    (evil / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    job = json.loads((out / ".hsx" / "job.json").read_text())
    job["inputs"]["model"] = "someone/evil"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "afile").write_text("x")
    info = json.loads((out / "hsx.json").read_text())
    for path, trust, needle in ((evil, False, "cannot read the config"), (evil, True, "--trust-remote-code"),
                                (fifo, False, "not an FP8 checkpoint"), ("/", False, "is not the snapshot"),
                                (tmp_path / "afile", False, "not an FP8 checkpoint")):
        info["model_path"] = str(path)
        info["config"]["trust_remote_code"] = trust
        (out / "hsx.json").write_text(json.dumps(info))
        job["inputs"]["revision"] = Path(path).name if len(Path(path).name) == 40 else "0" * 40  # (the evil folder
        # passes as that commit's snapshot)
        (out / ".hsx" / "job.json").write_text(json.dumps(job))
        rc, _, err = hsx_main(["verify", str(out), "--against-bf16", "2"])
        line = one_error_line(err)
        assert rc != 0 and needle in line, (path, line)
        assert not marker.exists()
    rc, _, err = hsx_main(["verify", str(out), "--against-bf16", "2", "--model", "someone/model"])  # (offline)
    line = one_error_line(err)
    assert rc != 0 and "not an FP8 checkpoint" in line, line  # (the record decides first: nothing is fetched)


# ---- hub push: the remote hsx.json ---------------------------------------------------------------------------

@pytest.mark.parametrize("remote", [
    b"[1, 2, 3]",  # JSON, not an object
    b"[" * 100_000 + b"]" * 100_000,  # nested past the parser's depth
    b'{"fingerprint": ' + b"1" * 5000 + b"}",  # a number int() refuses
    b'{"fingerprint": {"a": "b"}}',  # not a string
    b'{"fingerprint": ""}',
    b"\xff\xfe{}",  # not UTF-8
])
def test_push_reads_a_hostile_remote_hsx_json_as_not_this_jobs(finished, tmp_path, remote):
    from test_hub import REPO, FakeHfApi

    from hsx.config import HsxError
    from hsx.hub import push_output

    out = Path(shutil.copytree(finished, tmp_path / "out"))
    api = FakeHfApi()
    api.create_repo(REPO, repo_type="dataset", exist_ok=True)
    api.files().update({"hsx.json": remote})
    with pytest.raises(HsxError, match=r"holds an hsx.json that is not this job's.*--hub-overwrite"):
        push_output(out, REPO, api=api, log=lambda *a: None)
    assert api.files() == {"hsx.json": remote} and api.commits == []


# ---- many turns: derived masks render every prefix ---------------------------------------------------------------

def test_a_row_of_many_turns_is_bounded_by_a_row_budget(monkeypatch):
    """Derived masks render each turn's prefixes, so a row's renders grow with turns × length: 1,000 one-letter
    turns (a 40 KB row) took 98 s of CPU, each render well within its own bound. The renders of one row share a
    budget (ROW_CPU_SECONDS, here 0.5 s): past it the row is a counted chat_template_timeout, and the next row
    gets its own budget."""
    import time

    from chat_families import family

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

    from chat_families import family

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


# ---- a launcher's environment ------------------------------------------------------------------------------------

@pytest.mark.parametrize("var,value", [("WORLD_SIZE", "abc"), ("WORLD_SIZE", "0"), ("WORLD_SIZE", "-3"),
                                       ("WORLD_SIZE", "1" * 5000), ("LOCAL_WORLD_SIZE", "x")])
def test_a_launcher_variable_that_is_no_count_is_one_line(model4, small_chat_path, tmp_path, monkeypatch, var, value):
    """WORLD_SIZE=abc was a ValueError traceback; WORLD_SIZE=0 ran as a world of no process (an AttributeError
    at the first all_gather): one line naming the variable, nothing written."""
    monkeypatch.setenv(var, value)
    rc, _, err = hsx_main(fault_argv(model4.path, small_chat_path, tmp_path / "o"))
    line = one_error_line(err)
    assert rc != 0 and f"environment variable {var}=" in line, line
    assert not (tmp_path / "o" / "data").exists() or not any((tmp_path / "o" / "data").iterdir())


def test_an_omp_num_threads_torch_cannot_take_is_as_if_unset():
    """OMP_NUM_THREADS of 20 digits reached torch.set_num_threads (an overflow traceback)."""
    from hsx.run import cpu_threads

    assert cpu_threads(1, False, {"OMP_NUM_THREADS": "9" * 20}) == cpu_threads(1, False, {})
    assert cpu_threads(1, False, {"OMP_NUM_THREADS": "3"}) == 3
