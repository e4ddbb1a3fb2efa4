"""What is read as input (recipes, flags, data, templates, model folders) bounds the work it can cause, and every
problem it causes is one line: integer keys with largest values, an empty input, an offline miss, the file-digest
cache that may save time but never decide, templates that render without bound, and template-kwargs hsx owns."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import assert_one_error_line, fault_argv, hsx_main, write_jsonl
from hsx import data
from hsx.config import ExtractConfig, HsxError, config_from, parse_value


# ---- integer keys have largest values --------------------------------------------------------------------------

@pytest.mark.parametrize("name, value", [("max_length", 99999999999999999999), ("token_budget", 99999999999999),
                                         ("unit_tokens", 2**40), ("limit", 10**30), ("topk_logits", 2**31),
                                         ("num_proc", 10**25), ("gpus_per_copy", 10**19)])
def test_an_integer_key_too_large_for_any_machine_is_one_line(name, value):
    with pytest.raises(HsxError, match=f"{name} must be at most"):
        parse_value(name, value)


def test_a_huge_max_length_in_a_recipe_is_one_usage_line(tmp_path, model4, small_chat_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("max_length: 99999999999999999999\n")
    rc, _, err = hsx_main(["extract", "--config", str(recipe), *fault_argv(model4.path, small_chat_path,
                                                                           tmp_path / "out")[1:]])
    assert rc == 2
    assert_one_error_line(rc, err, "max_length must be at most 2,147,483,647")


def test_a_token_budget_no_memory_holds_is_one_line(tmp_path, model4, small_chat_path):
    argv = fault_argv(model4.path, small_chat_path, tmp_path / "out")
    argv[argv.index("--token-budget") + 1] = "2000000000"
    rc, _, err = hsx_main(argv)
    assert_one_error_line(rc, err, "--token-budget 2,000,000,000", "GiB", "memory")


def test_num_proc_is_capped_at_the_cores_this_process_may_use():
    cores = data.cpu_count()
    assert data.tokenize_processes(100000, 10) == cores
    assert data.tokenize_processes(None, 50_000) == min(8, cores)
    assert data.tokenize_processes(None, 10) is None


# ---- empty and missing inputs ---------------------------------------------------------------------------------

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


# ---- the file-digest cache saves time, never decides -----------------------------------------------------------

import hashlib  # noqa: E402
import shutil  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from hsx import fingerprint  # noqa: E402


@pytest.fixture
def digest_cache(tmp_path, monkeypatch):
    path = tmp_path / "hf-home" / "hsx" / "file-digests.json"
    monkeypatch.setattr(fingerprint, "cache_file", lambda: path)
    return path


def _cache_key(f: Path) -> str:
    return fingerprint._key(f, f.stat())


@pytest.mark.parametrize("entry", [None, "0" * 63, ["x"], {"sha256": None, "hashed_at_ns": 1},
                                   {"sha256": "A" * 64, "hashed_at_ns": 1}, {"sha256": "a" * 64}])
def test_a_null_or_malformed_cache_entry_is_a_miss(tmp_path, digest_cache, entry):
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(4096))
    os.utime(f, ns=(1, 1))
    digest_cache.parent.mkdir(parents=True)
    digest_cache.write_text(json.dumps({_cache_key(f): entry}))
    assert fingerprint.file_digests([f]) == [(4096, hashlib.sha256(f.read_bytes()).hexdigest())]


@pytest.mark.parametrize("content", ["{", "[1, 2]", "null", "\x00" * 10, "[" * 100000])
def test_a_damaged_cache_file_is_a_miss(tmp_path, digest_cache, content):
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc")
    digest_cache.parent.mkdir(parents=True)
    digest_cache.write_text(content)
    assert fingerprint.file_digests([f]) == [(3, hashlib.sha256(b"abc").hexdigest())]


def test_a_fifo_as_the_cache_file_is_a_miss_not_a_hang(tmp_path, digest_cache):
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc")
    digest_cache.parent.mkdir(parents=True)
    os.mkfifo(digest_cache)  # nobody writes it: a plain read would wait forever
    done = []
    t = threading.Thread(target=lambda: done.append(fingerprint.file_digests([f])), daemon=True)
    t.start()
    t.join(20)
    assert done == [[(3, hashlib.sha256(b"abc").hexdigest())]]
    assert digest_cache.is_file()  # the digest was saved over it, as a regular file


def test_a_file_rewritten_within_a_coarse_clock_tick_is_read_again(tmp_path, digest_cache, monkeypatch):
    """A filesystem with a coarse clock keeps size, times and inode across an in-place rewrite within one tick:
    the key cannot tell, so an entry hashed in that tick must not stand for the new bytes."""
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 4096)
    frozen = _cache_key(f)
    monkeypatch.setattr(fingerprint, "_key", lambda path, st: frozen)  # the times the coarse clock kept
    assert fingerprint.file_digests([f])[0][1] == hashlib.sha256(b"a" * 4096).hexdigest()
    with open(f, "r+b") as fh:
        fh.write(b"b")
    assert fingerprint.file_digests([f])[0][1] == hashlib.sha256(b"b" + b"a" * 4095).hexdigest()


@pytest.mark.parametrize("form", ["digest", "entry", "null"])
def test_a_resume_never_takes_a_stale_or_forged_digest_for_the_swapped_weights(tmp_path, model4, small_chat_path,
                                                                                digest_cache, form):
    model = tmp_path / "model"
    shutil.copytree(model4.path, model)
    argv = fault_argv(model, small_chat_path, tmp_path / "out")
    rc, _, err = hsx_main(argv)
    assert rc == 0, err
    (tmp_path / "out" / "hsx.json").unlink()  # as a kill before finalization leaves it: a resume
    weights = model / "model.safetensors"
    old = hashlib.sha256(weights.read_bytes()).hexdigest()
    blob = bytearray(weights.read_bytes())
    blob[-8:] = bytes(b ^ 0x5A for b in blob[-8:])  # a tensor's bytes, the same size and header
    weights.write_bytes(bytes(blob))
    long_ago = time.time_ns() - 3600 * 10**9
    os.utime(weights, ns=(long_ago - 10**10, long_ago - 10**10))
    cache = json.loads(digest_cache.read_text())
    cache[_cache_key(weights)] = {"digest": old, "null": None,
                                  "entry": {"sha256": old, "hashed_at_ns": long_ago}}[form]
    digest_cache.write_text(json.dumps(cache))
    rc, _, err = hsx_main(argv)
    assert_one_error_line(rc, err, "different job", "model.safetensors")
    job = json.loads((tmp_path / "out" / ".hsx" / "job.json").read_text())
    assert job["inputs"]["model"]["files"]["model.safetensors"][1] == old


# ---- a template's render is bounded in time and size -----------------------------------------------------------

from chat_families import QWEN3, family  # noqa: E402
from hsx import masks, render  # noqa: E402

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


# ---- chat_template_kwargs may not set what hsx passes ----------------------------------------------------------

@pytest.mark.parametrize("key", ["tokenize", "messages", "tools", "add_generation_prompt", "eos_token",
                                 "return_assistant_tokens_mask"])
def test_chat_template_kwargs_may_not_set_a_key_hsx_passes(tmp_path, model4, small_chat_path, key):
    argv = fault_argv(model4.path, small_chat_path, tmp_path / "out", "--chat-template-kwargs",
                      json.dumps({key: True, "enable_thinking": False}))
    rc, _, err = hsx_main(argv)
    assert rc == 2
    assert_one_error_line(rc, err, f"chat_template_kwargs may not set {key}")
    assert not (tmp_path / "out").exists()


def test_the_reserved_template_kwargs_cover_apply_chat_template(tokenizer):
    import inspect

    from transformers import PreTrainedTokenizerBase

    from hsx.config import RESERVED_TEMPLATE_KWARGS

    params = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"self", "kwargs"}
    assert params <= RESERVED_TEMPLATE_KWARGS
    assert set(tokenizer.special_tokens_map) <= RESERVED_TEMPLATE_KWARGS  # (what it passes the template too)


# ---- resume messages -------------------------------------------------------------------------------------------

def test_a_resume_says_to_do_for_units_never_written_and_missing_only_for_lost_ones(tmp_path, model4,
                                                                                   small_chat_path):
    out = tmp_path / "out"
    argv = fault_argv(model4.path, small_chat_path, out)
    rc, _, err = hsx_main(argv)
    assert rc == 0, err
    (out / "hsx.json").unlink()
    manifests = sorted((out / ".hsx").glob("manifest*.jsonl"))
    assert len(manifests) == 1
    records = manifests[0].read_text().splitlines()
    assert len(records) >= 3
    manifests[0].write_text("\n".join(records[:2]) + "\n")  # as a kill after two commits leaves it
    for rec in records[2:]:
        (out / "data" / json.loads(rec)["file"]).unlink()
    (out / "data" / json.loads(records[1])["file"]).unlink()  # and one committed unit lost since
    rc, said, err = hsx_main(argv)
    assert rc == 0, err
    assert "0 damaged and 1 missing unit(s)" in said + err, said
    assert f"1 unit(s) done, {len(records) - 2} to do" in said + err, said


# ---- a plan says what it is for ---------------------------------------------------------------------------------

def test_a_plan_of_a_tiny_model_on_a_cpu_says_what_it_is_for_and_no_nonsense_rate(tmp_path):
    from hsx.cost import WRITER_BYTES_PER_S

    repo = Path(__file__).resolve().parent.parent
    rc, said, err = hsx_main(["plan", "--config", str(repo / "recipes" / "demo.yaml"), "--json", "-"])
    assert rc == 0, err
    p = json.loads(said)
    assert p["write_bytes_per_s"] <= WRITER_BYTES_PER_S * 1.0001
    assert p["rate_bound"] == "writer"
    rc, said, err = hsx_main(["plan", "--config", str(repo / "recipes" / "demo.yaml")])
    assert said.startswith("planned for H200 GPUs")
    import torch

    assert ("this machine has no GPU" in said) == (not torch.cuda.is_available())
    assert "561" not in said and "GB/s per copy" in said


# ---- a turn end in plain text ----------------------------------------------------------------------------------

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


# ---- a full disk where a library's cleanup hides it -------------------------------------------------------------

def test_a_full_disk_when_a_unit_file_closes_is_one_line(tmp_path, monkeypatch, model4, small_chat_path):
    """ENOSPC as a unit's file is closed: datasets' map then finalizes its writer again, on the closed stream, and
    raises 'I/O operation on closed file' with the ENOSPC as its context. Still the disk-full line."""
    import errno

    from hsx import writer

    real_close = writer.UnitFile.close
    fired = []

    def close(self):
        if not fired and not self.closed:
            fired.append(1)
            real_close(self)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_close(self)

    monkeypatch.setattr(writer.UnitFile, "close", close)
    rc, _, err = hsx_main(fault_argv(model4.path, small_chat_path, tmp_path / "out"))
    assert fired
    assert_one_error_line(rc, err, "disk full while writing", "run the same command to continue")
    monkeypatch.setattr(writer.UnitFile, "close", real_close)
    rc, _, err = hsx_main(fault_argv(model4.path, small_chat_path, tmp_path / "out"))
    assert rc == 0, err


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
