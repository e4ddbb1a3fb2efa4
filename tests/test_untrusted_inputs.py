"""What hsx reads can be hostile or damaged: an output dir's hsx.json and manifests, pre-tokenized rows, recipes.

- Trust only from the command line: an hsx.json naming a model folder with code and `trust_remote_code: true`
  never runs that code (`hsx verify`), whatever else it says.
- Bad values in data rows: a counted skip with a reason, or one clear error; never a traceback or a coercion.
- A damaged hsx.json, job.json, summary.json or manifest line: one clear line from every command that reads
  them (extract resume, verify, merge, push, load, export-specforge), never a traceback.
"""

from __future__ import annotations

import json
import shutil
import time
import tracemalloc
from pathlib import Path

import pytest

import hsx
from helpers import assert_one_error_line, fault_argv, hsx_main, write_jsonl
from hsx import data
from hsx.config import ExtractConfig, HsxError, parse_layer_spec, resolve_layers
from hsx.load import info as output_info


@pytest.fixture(scope="module")
def finished(tmp_path_factory, model4, small_chat_path):
    """A finished output of model4 (a few units), and the argv that made it."""
    out = tmp_path_factory.mktemp("untrusted") / "out"
    argv = fault_argv(model4.path, small_chat_path, out)
    rc, _, err = hsx_main(argv)
    assert rc == 0, err
    return out, argv


@pytest.fixture
def copy(tmp_path, finished):
    """A copy of the finished output to damage, and the argv that resumes it."""
    out, argv = finished
    dst = tmp_path / "copy"
    shutil.copytree(out, dst, symlinks=True)
    return dst, [str(dst) if a == str(out) else a for a in argv]


# ---- 1. no code runs because of what an output dir says -------------------------------------------------------

@pytest.fixture
def evil_model(tmp_path, model4):
    """model4's weights in a folder whose config maps AutoModel to its own modeling_evil.py, which writes a marker
    file when imported."""
    folder = tmp_path / "evil-model"
    shutil.copytree(model4.path, folder)
    marker = tmp_path / "code-ran"
    (folder / "modeling_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import Qwen3Model as EvilModel\n")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoModel": "modeling_evil.EvilModel", "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, marker


def _point_at(out: Path, model_folder: Path, trust: object) -> None:
    info = json.loads((out / "hsx.json").read_text())
    info["model_path"] = str(model_folder)
    info["config"]["trust_remote_code"] = trust
    (out / "hsx.json").write_text(json.dumps(info))


@pytest.mark.parametrize("trust", [True, "true", False])
def test_verify_never_runs_code_an_output_dir_names(copy, evil_model, trust):
    out, _ = copy
    folder, marker = evil_model
    _point_at(out, folder, trust)
    rc, _, err = hsx_main(["verify", str(out), "--samples", "2"])
    assert not marker.exists(), "verify ran code from a model folder that hsx.json named"
    if trust is not False:
        assert_one_error_line(rc, err, "--trust-remote-code", prefix="hsx: verify failed: ")
    else:  # recomputed with the recorded folder, its code not run (transformers' own Qwen3 class)
        assert rc == 0, err


def test_verify_trust_remote_code_needs_a_model_named_on_the_command_line(copy, evil_model):
    out, _ = copy
    folder, marker = evil_model
    _point_at(out, folder, True)
    rc, _, err = hsx_main(["verify", str(out), "--samples", "2", "--trust-remote-code"])
    assert_one_error_line(rc, err, "--model", prefix="hsx: error: ")
    assert not marker.exists()


def test_verify_with_model_flag_recomputes_against_it(copy, evil_model, model4):
    out, _ = copy
    folder, marker = evil_model
    _point_at(out, folder, True)  # the recorded folder is ignored: --model is the reference
    rc, stdout, err = hsx_main(["verify", str(out), "--samples", "2", "--model", str(model4.path)])
    assert rc == 0, err
    assert "2 rows recomputed" in stdout
    assert not marker.exists()


def test_verify_with_a_model_of_another_depth_is_one_line(copy, model8):
    out, _ = copy
    rc, _, err = hsx_main(["verify", str(out), "--samples", "2", "--model", str(model8.path)])
    assert_one_error_line(rc, err, "8 layers", prefix="hsx: verify failed: ")


# ---- 2. layer bounds come before any allocation ---------------------------------------------------------------

def test_a_huge_dflash_k_fails_before_building_anything():
    tracemalloc.start()
    t = time.perf_counter()
    with pytest.raises(HsxError, match="at most 33"):
        resolve_layers(parse_layer_spec("dflash-999999"), 36, False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.perf_counter() - t < 0.5 and peak < 1 << 20, peak  # no million-entry list was built
    with pytest.raises(HsxError, match="--layers"):
        parse_layer_spec("dflash-999999999")  # no model is that deep: refused as it is parsed


def test_layers_flag_with_a_huge_preset_or_nothing_is_one_line(tmp_path, model4, small_chat_path):
    for layers in (["dflash-999999999"], [""], ["dflash-99999"]):
        t = time.perf_counter()
        argv = ["extract", "--model", str(model4.path), "--dataset", str(small_chat_path), "--output-dir",
                str(tmp_path / "o"), "--layers", *layers]
        rc, _, err = hsx_main(argv)
        assert_one_error_line(rc, err, "layers", prefix="hsx: error: ")
        assert time.perf_counter() - t < 5


def test_topk_logits_above_the_vocabulary_is_one_line(tmp_path, model4, small_chat_path):
    argv = fault_argv(model4.path, small_chat_path, tmp_path / "o", "--topk-logits", "1000000")
    rc, _, err = hsx_main(argv)
    assert_one_error_line(rc, err, "--topk-logits 1000000", "vocabulary", prefix="hsx: error: ")
    assert not (tmp_path / "o" / "hsx.json").exists()


# ---- 8. bad values in pre-tokenized rows ----------------------------------------------------------------------

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


def _tokenize_file(tmp_path, content: bytes):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    cfg = ExtractConfig(model="m", dataset=str(path), layers=[1], output_dir="o")
    raw = data.load_input(cfg)
    return data.tokenize(raw, None, cfg, str(tmp_path / "t.arrow"), fingerprint=f"untrusted-{hash(content)}")


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


def test_a_string_loss_mask_supervises_nothing_end_to_end(tmp_path, model4):
    path = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [5, 6, 7], "loss_mask": ["0", "0", "1"]},
                                                {"input_ids": [5, 6, 7, 8]}])
    rc, _, err = hsx_main(fault_argv(model4.path, path, tmp_path / "o"))
    assert rc == 0, err
    info = json.loads((tmp_path / "o" / "hsx.json").read_text())
    assert info["counts"]["rows_written"] == 1 and info["counts"]["skipped"] == {"bad_loss_mask": 1}
    assert hsx.load(str(tmp_path / "o"))["loss_mask"] == [[1, 1, 1, 1]]  # no loss_mask: every token


# ---- 10. damaged run state: one line from every reader --------------------------------------------------------

DAMAGED_INFO = {
    "garbage": b"\x00\xff not json",
    "truncated": b'{"model": "m", "layers": [1, ',
    "not an object": b"[1, 2, 3]",
    "no layers": None,  # built from the real one below
    "layers wrong": None,
    "counts missing": None,
    "storage dtype unknown": None,
}


def _damage_info(out: Path, how: str) -> None:
    f = out / "hsx.json"
    info = json.loads(f.read_text())
    if DAMAGED_INFO[how] is not None:
        f.write_bytes(DAMAGED_INFO[how])
        return
    if how == "no layers":
        del info["layers"]
    elif how == "layers wrong":
        info["layers"] = "1,3"
    elif how == "counts missing":
        del info["counts"]["rows_written"]
    elif how == "storage dtype unknown":
        info["storage_dtype"] = "int4"
    f.write_text(json.dumps(info))


def _commands(out: Path, argv: list[str], tmp: Path) -> dict[str, list[str]]:
    return {"extract": argv, "verify": ["verify", str(out), "--samples", "1"],
            "export-specforge": ["export-specforge", str(out), str(tmp / "sf")],
            "push": ["push", str(out), "someone/repo"]}


@pytest.mark.parametrize("how", list(DAMAGED_INFO))
def test_a_damaged_hsx_json_is_one_line_for_every_command(copy, tmp_path, how):
    out, argv = copy
    _damage_info(out, how)
    for name, command in _commands(out, argv, tmp_path).items():
        rc, _, err = hsx_main(command)
        assert_one_error_line(rc, err, "hsx.json", prefix="hsx: ")
    for read in (lambda: hsx.load(str(out), layers=[1]), lambda: hsx.torch_view(str(out)),
                 lambda: output_info(str(out))):
        with pytest.raises(HsxError, match="hsx.json is damaged"):
            read()


MANIFEST_DAMAGE = {
    "unit missing": lambda rec: {k: v for k, v in rec.items() if k != "unit"},
    "bytes missing": lambda rec: {k: v for k, v in rec.items() if k != "bytes"},
    "bytes a string": lambda rec: {**rec, "bytes": str(rec["bytes"])},
    "file a path": lambda rec: {**rec, "file": "../../../etc/passwd"},
    "not an object": lambda rec: [rec],
}


@pytest.mark.parametrize("how", list(MANIFEST_DAMAGE))
def test_a_damaged_manifest_line_is_one_line_for_every_command(copy, tmp_path, how):
    out, argv = copy
    manifest = sorted((out / ".hsx").glob("manifest-*.jsonl"))[0]
    lines = manifest.read_text().splitlines()
    lines[1] = json.dumps(MANIFEST_DAMAGE[how](json.loads(lines[1])))
    manifest.write_text("\n".join(lines) + "\n")
    commands = _commands(out, argv, tmp_path)
    commands.pop("export-specforge")  # reads hsx.json and the data files only
    commands["merge"] = ["merge", str(tmp_path / "merged"), str(out)]
    commands["extract"] = commands.pop("extract")  # last, resuming: without hsx.json the units are checked
    for name, command in commands.items():
        if name == "extract":
            (out / "hsx.json").unlink()
        rc, _, err = hsx_main(command)
        line = assert_one_error_line(rc, err, manifest.name, "line 2", prefix="hsx: ")
        assert "damaged" in line, (name, line)


def test_a_torn_manifest_line_is_still_passed_over(copy):
    """A kill mid-append leaves a line that is not JSON: that unit is redone, nothing is refused."""
    out, argv = copy
    manifest = sorted((out / ".hsx").glob("manifest-*.jsonl"))[0]
    with open(manifest, "ab") as f:
        f.write(b'{"unit": "999-99999", "file": "train-999-99')
    rc, stdout, err = hsx_main(argv)
    assert rc == 0, err
    assert "already complete" in stdout + err


@pytest.mark.parametrize(("name", "content"), [("job.json", b"\xff\xfe"), ("job.json", b'{"inputs": {}}'),
                                               ("summary.json", b"{}"), ("summary.json", b"[]")])
def test_damaged_run_state_is_one_line(copy, tmp_path, name, content):
    out, argv = copy
    (out / ".hsx" / name).write_bytes(content)
    commands = {"merge": ["merge", str(tmp_path / "merged"), str(out)]}
    if name == "job.json":
        commands["extract"] = argv
    for command in commands.values():
        rc, _, err = hsx_main(command)
        assert_one_error_line(rc, err, name, "damaged", prefix="hsx: error: ")


# ---- found in review: more damaged state and hostile rows ---------------------------------------------------------

@pytest.mark.parametrize(("where", "damage", "needle"), [
    ("merge-target job.json", b"\xff\xfe", "job.json"),
    ("summary vocab_size", "x", "vocab_size"),
    ("summary vocab_size", 10**12, "vocab_size"),
])
def test_more_damaged_state_is_one_line(copy, tmp_path, where, damage, needle):
    out, argv = copy
    if where == "merge-target job.json":
        target = tmp_path / "merged"
        (target / ".hsx").mkdir(parents=True)
        (target / ".hsx" / "job.json").write_bytes(damage)
        command = ["merge", str(target), str(out)]
    elif where == "summary vocab_size":
        f = out / ".hsx" / "summary.json"
        f.write_text(json.dumps({**json.loads(f.read_text()), "vocab_size": damage}))
        command = ["merge", str(tmp_path / "merged"), str(out)]
    rc, _, err = hsx_main(command)
    assert_one_error_line(rc, err, needle, prefix="hsx: error: ")


@pytest.mark.parametrize("unit", [["a"], "../x", 7])
def test_a_listed_file_whose_unit_is_not_a_name_is_one_error(copy, unit):
    out, _ = copy
    f = out / "hsx.json"
    meta = json.loads(f.read_text())
    meta["files"][0]["unit"] = unit
    f.write_text(json.dumps(meta))
    with pytest.raises(HsxError, match="files` is damaged"):
        hsx.load(str(out))


@pytest.mark.parametrize("entry", [5, [1, 2], {"vocab_size": "8", "supervised_tokens": 1}])
def test_damaged_token_frequencies_entry_is_one_line(copy, entry):
    out, _ = copy
    f = out / "hsx.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), "token_frequencies": entry}))
    rc, _, err = hsx_main(["vocab", str(out), "--draft-vocab-size", "4"])
    assert_one_error_line(rc, err, "token_frequencies", prefix="hsx: error: ")


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
