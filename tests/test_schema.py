"""hsx.schema: the output format in one place. The plan prices exactly what extraction writes, for every storage
dtype, with and without top-k logits and the final-norm state; hsx.json as main writes it reads back as a typed
record, byte for byte; damaged records are one sentence, and one line from every command that reads them (extract's
resume, verify, merge, push, load, the exports): a key given twice, a number too long for int(), a unit that is not a
name. hsx.json lists every unit with its rows, size and CRC-32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import Features, List, Value

import hsx
from helpers import assert_one_error_line, hsx_main
from hsx import ledgers
from hsx.config import load_config
from hsx.info import recorded_info
from hsx.run import extract
from hsx.schema import (STORAGE_DTYPES, Damaged, FileEntry, Info, JobRecord, ManifestRecord, OutputFormat, Summary,
                        decode, dequantize, encode)
from hsx.sink import OutputDir

MAIN_INFO = Path(__file__).parent / "data" / "hsx-main.json"  # hsx.json as main wrote it (demo, --topk-logits 8)


# ---- hsx plan prices every storage dtype and the top-k columns -------------------------------------------------

@pytest.mark.parametrize("dtype, values, itemsize, scales", [
    ("bfloat16", 128, 2, 0), ("float16", 128, 2, 0), ("float32", 128, 4, 0), ("float8_e4m3", 128, 1, 2 * 4)])
def test_plan_prices_every_storage_dtype(dtype, values, itemsize, scales):
    rc, out, err = hsx_main(["plan", "--shape", "tiny", "--layers", "1", "3", "--storage-dtype", dtype, "--json"])
    assert rc == 0, err
    assert json.loads(out)["bytes_per_token"] == values * itemsize + scales  # 2 layers x hidden 64
    assert hsx.plan(shape="tiny", layers=[1, 3], storage_dtype=dtype)["bytes_per_token"] == values * itemsize + scales


def test_plan_prices_topk_logits():
    p = hsx.plan(shape="tiny", layers=[1, 3], final_hidden=True, topk_logits=8)
    assert p["bytes_per_token"] == 3 * 64 * 2 + 8 * (2 + 4) == 432  # states + top-k bf16 values and int32 ids
    rc, out, err = hsx_main(["plan", "--shape", "tiny", "--layers", "1", "3", "--final-hidden", "--topk-logits", "8",
                             "--json"])
    assert rc == 0 and json.loads(out)["bytes_per_token"] == 432


def test_plan_refuses_topk_without_the_final_norm_state_like_extract():
    rc, _, err = hsx_main(["plan", "--shape", "tiny", "--layers", "1", "3", "--topk-logits", "8"])
    assert_one_error_line(rc, err, "--topk-logits comes from the final-norm state")


# ---- the plan's bytes per token are what the Arrow data holds --------------------------------------------------

CASES = [(d, final, topk) for d in STORAGE_DTYPES for final, topk in ((True, 4), (False, 0))]


@pytest.fixture(scope="module")
def written(tmp_path_factory, model4, small_chat_path) -> dict:
    """One tiny extraction per case: (storage dtype, final_hidden, topk_logits) -> output dir."""
    outs = {}
    for dtype, final, topk in CASES:
        out = tmp_path_factory.mktemp("schema") / f"{dtype}-{final}-{topk}"
        cfg = load_config(None, {"output_dir": str(out), "compile": "off", "model": str(model4.path),
                                 "dataset": str(small_chat_path), "layers": ["0", "2"], "final_hidden": final,
                                 "storage_dtype": dtype, "topk_logits": topk})
        extract(cfg, log=lambda *a: None)
        outs[dtype, final, topk] = out
    return outs


def _value_bytes(column) -> int:
    """Bytes of a list column's values as stored (nested lists flattened to their primitive values)."""
    values = column.combine_chunks()
    while hasattr(values, "flatten"):
        values = values.flatten()
    return len(values) * values.type.bit_width // 8


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-final{int(c[1])}-topk{c[2]}")
def test_plan_bytes_per_token_equal_the_written_arrow_data(written, model4, small_chat_path, case):
    dtype, final, topk = case
    out = written[case]
    table = hsx.load(str(out)).data.table
    tokens = sum(table.column("num_tokens").to_pylist())
    assert tokens > 0
    fmt = OutputFormat(2, 64, final, dtype, topk)
    states = [c.name for c in fmt.state_columns()]
    assert table.column_names == ["sample_id", "input_ids", "loss_mask", "num_tokens", *states]
    measured = sum(_value_bytes(table.column(name)) for name in states)
    p = hsx.plan(model=str(model4.path), dataset=str(small_chat_path), layers=[0, 2], final_hidden=final,
                 storage_dtype=dtype, topk_logits=topk)
    assert p["bytes_per_token"] * tokens == measured
    assert p["token_bytes"] * tokens == _value_bytes(table.column("input_ids")) + _value_bytes(
        table.column("loss_mask"))
    info = recorded_info(OutputDir(out).root)
    assert info.format == fmt and info.format.features() == hsx.load(str(out)).features
    # Every buffer: per-token values, per-row scalars and int32 offsets (+1 per list column and chunk)
    chunks = max(c.num_chunks for c in table.columns)
    rows = table.num_rows
    expected = tokens * (fmt.bytes_per_token + fmt.token_bytes) + rows * fmt.bytes_per_row
    assert 0 <= table.nbytes - expected <= chunks * 4 * (len(states) + 2) * 2


def test_features_as_main_writes_them():
    b16 = Value("int16", id="bfloat16")
    assert OutputFormat(2, 64, True, "bfloat16", 8, True).features() == Features({
        "sample_id": Value("int64"), "input_ids": List(Value("int32")), "loss_mask": List(Value("int8")),
        "num_tokens": Value("int32"), "hidden_states": List(List(b16, length=128)),
        "final_hidden_state": List(List(b16, length=64)), "topk_logits": List(List(b16, length=8)),
        "topk_ids": List(List(Value("int32"), length=8)), "has_nonfinite": Value("bool")})
    fp8 = OutputFormat(3, 16, False, "float8_e4m3").features()
    assert fp8["hidden_states"] == List(List(Value("uint8", id="float8_e4m3fn"), length=48))
    assert fp8["hidden_states_scale"] == List(List(Value("float32"), length=3))
    assert "final_hidden_state_scale" not in fp8


@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
def test_encode_then_decode_gives_the_states_back(dtype):
    torch.manual_seed(0)
    layers, final = torch.randn(5, 3 * 8) * 10, torch.randn(5, 8)
    fmt = OutputFormat(3, 8, True, dtype)
    flat = encode([layers, final], 3, dtype)
    assert flat.dtype == torch.uint8 and flat.numel() == 5 * fmt.bytes_per_token
    cols, at = {}, 0
    for c in fmt.state_columns():
        cols[c.name] = flat[at:at + 5 * c.nbytes]
        at += 5 * c.nbytes
    got = decode(cols["hidden_states"].view(getattr(torch, {"bfloat16": "int16", "float8_e4m3": "uint8"}.get(
        dtype, dtype))), dtype).view(5, 3, 8)
    if dtype == "float8_e4m3":
        got = dequantize(got, cols["hidden_states_scale"].view(torch.float32).view(5, 3))
        assert torch.allclose(got.float(), layers.view(5, 3, 8), rtol=0.07, atol=1e-3)  # a 3-bit mantissa
    else:
        assert torch.equal(got, layers.to(getattr(torch, dtype)).view(5, 3, 8))


# ---- hsx.json and the other records ----------------------------------------------------------------------------

def test_hsx_json_as_main_writes_it_reads_back_byte_for_byte():
    text = MAIN_INFO.read_text()
    info = Info.from_dict(json.loads(text))
    assert info.layers == [1, 2, 3, 4, 5] and info.final_hidden and info.complete
    assert info.config.topk_logits == 8 and info.config.nonfinite == "skip" and info.counts.rows_written == 20
    assert info.files[0] == FileEntry(**json.loads(text)["files"][0])
    assert info.format.bytes_per_token == 5 * 64 * 2 + 64 * 2 + 8 * 6
    assert json.dumps(info.to_dict(), indent=2) + "\n" == text
    assert json.loads(json.dumps(info.unfinished().to_dict())) == {**json.loads(text), "complete": False}


def test_an_output_written_by_main_loads(tmp_path):
    """hsx.json as main writes it, over data files: OutputDir and hsx.load read it (names and sizes checked)."""
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    meta = json.loads(MAIN_INFO.read_text())
    OutputFormat.of(Info.from_dict(meta))  # (the format it describes)
    fmt = Info.from_dict(meta).format
    from datasets.arrow_writer import ArrowWriter

    path = out / "data" / "train-000-00000.arrow"
    writer = ArrowWriter(features=fmt.features(), path=str(path))
    writer.finalize()
    writer.close()
    meta["files"] = [{"file": path.name, "unit": "000-00000", "rows": 0, "bytes": path.stat().st_size,
                      "crc32": None}]
    meta["counts"].update(rows_written=0, tokens_written=0)  # (what its one empty file holds: the list and the
    (out / "hsx.json").write_text(json.dumps(meta, indent=2) + "\n")  # counts must agree, or the load refuses)
    assert recorded_info(OutputDir(out).root).files[0].file == path.name
    assert len(hsx.load(str(out))) == 0 and hsx.load(str(out)).features == fmt.features()


@pytest.mark.parametrize("change, needle", [
    (lambda d: d.pop("layers"), "key 'layers' is missing"),
    (lambda d: d.update(layers=[1, 99]), "do not fit a model of 8 layers"),
    (lambda d: d.update(storage_dtype="int4"), "storage_dtype must be one of"),
    (lambda d: d["counts"].pop("tokens_written"), "counts.tokens_written"),
    (lambda d: d["config"].update(topk_logits="8"), "config.topk_logits"),
    (lambda d: d["files"][0].update(file="../../secret"), "`files` is damaged"),
    (lambda d: d["files"][0].update(file=".hsx"), "`files` is damaged"),
    (lambda d: d["files"][0].update(unit=["a"]), "`files` is damaged"),
    (lambda d: d.update(token_frequencies=[1, 2]), "token_frequencies is damaged"),
    (lambda d: d.update(vocab_size=2**40), "vocab_size"),
])
def test_a_damaged_hsx_json_is_one_sentence(change, needle):
    d = json.loads(MAIN_INFO.read_text())
    change(d)
    with pytest.raises(Damaged, match=needle.replace("(", r"\(")):
        Info.from_dict(d)


def test_the_other_records_check_what_they_read():
    rec = {"unit": "000-00000", "file": "train-000-00000.arrow", "bytes": 10, "rows": 1, "tokens": 3,
           "crc32": "abcd", "session": "s1", "skipped_oom": 1}
    assert ManifestRecord.from_dict(rec).skipped_oom == 1
    for bad, needle in (({"unit": "../x", "file": "train-../x.arrow"}, "unit must be a unit name"),
                        ({"file": "train-other.arrow"}, "file must be"), ({"crc32": 5}, "crc32"),
                        ({"nonfinite_kept": -1}, "nonfinite_kept")):
        with pytest.raises(Damaged, match=needle):
            ManifestRecord.from_dict({**rec, **bad})
    with pytest.raises(Damaged, match="fingerprint"):
        JobRecord.from_dict({"inputs": {}})
    summary = {k: v for k, v in json.loads(MAIN_INFO.read_text()).items() if k != "complete"}
    with pytest.raises(Damaged, match="unit_names"):
        Summary.from_dict(summary)
    s = Summary.from_dict({**summary, "unit_names": ["000-00000"], "command": "hsx extract"})
    assert s.unit_names == ["000-00000"] and s.format.topk == 8


def test_a_manifest_holding_only_a_torn_line_is_no_output(tmp_path):
    """A kill mid-append leaves a torn line: no unit was committed, so the dir holds no output (one reader of
    the ledger decides it, the same one that counts units)."""
    out = OutputDir(tmp_path / "out")
    out.state.mkdir(parents=True)
    (out.state / "manifest-00000.jsonl").write_bytes(b'{"unit": "000-00000", "file": "train-0')
    assert ledgers.manifest_records(out.state) == {} and not out.has_output()
    (out.state / "manifest-00001.jsonl").write_text('{"unit": 5}\n')  # a whole line, damaged: kept as output
    assert out.has_output()


def test_plan_refuses_a_topk_over_the_vocabulary_like_extract():
    """Both read the same checks (`config.target_layers`): the tiny shape has 512 tokens."""
    rc, _, err = hsx_main(["plan", "--shape", "tiny", "--layers", "1", "--final-hidden", "--topk-logits", "513"])
    assert_one_error_line(rc, err, "more than the model's vocabulary (512 tokens)")
    assert rc == 1  # as extract: the model's facts, not the command line, refuse it
    assert hsx.plan(shape="tiny", layers=[1], final_hidden=True, topk_logits=512)["bytes_per_token"] > 0


import shutil  # noqa: E402

from helpers import LONG_DIGITS, finished_argv, manifest_records, the_error_line  # noqa: E402
from hsx.config import HsxError  # noqa: E402
from hsx.load import info as output_info  # noqa: E402
from hsx.checksums import file_crc32  # noqa: E402


# ---- hsx.json lists every unit; a damaged record is one line from every command that reads it ----------------------

def test_hsx_json_lists_every_unit(finished):
    info = json.loads((finished / "hsx.json").read_text())
    recs = {r["file"]: r for r in manifest_records(finished)}
    assert [f["file"] for f in info["files"]] == sorted(recs) == sorted(p.name for p in (finished / "data").iterdir())
    for f in info["files"]:
        r = recs[f["file"]]
        assert (f["unit"], f["rows"], f["bytes"], f["crc32"]) == (r["unit"], r["rows"], r["bytes"], r["crc32"])
        assert f["crc32"] == file_crc32(finished / "data" / f["file"])
    assert sum(f["rows"] for f in info["files"]) == info["counts"]["rows_written"]


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
def test_a_damaged_hsx_json_is_one_line_for_every_command(finished_copy, model4, small_chat_path, tmp_path, how):
    argv = finished_argv(model4, small_chat_path, finished_copy)
    _damage_info(finished_copy, how)
    for name, command in _commands(finished_copy, argv, tmp_path).items():
        rc, _, err = hsx_main(command)
        assert_one_error_line(rc, err, "hsx.json", prefix="hsx: ")
    for read in (lambda: hsx.load(str(finished_copy), layers=[1]), lambda: hsx.torch_view(str(finished_copy)),
                 lambda: output_info(str(finished_copy))):
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
def test_a_damaged_manifest_line_is_one_line_for_every_command(finished_copy, model4, small_chat_path, tmp_path, how):
    argv = finished_argv(model4, small_chat_path, finished_copy)
    manifest = sorted((finished_copy / ".hsx").glob("manifest-*.jsonl"))[0]
    lines = manifest.read_text().splitlines()
    lines[1] = json.dumps(MANIFEST_DAMAGE[how](json.loads(lines[1])))
    manifest.write_text("\n".join(lines) + "\n")
    commands = _commands(finished_copy, argv, tmp_path)
    commands.pop("export-specforge")  # reads hsx.json and the data files only
    commands["merge"] = ["merge", str(tmp_path / "merged"), str(finished_copy)]
    commands["extract"] = commands.pop("extract")  # last, resuming: without hsx.json the units are checked
    for name, command in commands.items():
        if name == "extract":
            (finished_copy / "hsx.json").unlink()
        rc, _, err = hsx_main(command)
        line = assert_one_error_line(rc, err, manifest.name, "line 2", prefix="hsx: ")
        assert "damaged" in line, (name, line)


@pytest.mark.parametrize(("name", "content"), [("job.json", b"\xff\xfe"), ("job.json", b'{"inputs": {}}'),
                                               ("summary.json", b"{}"), ("summary.json", b"[]")])
def test_damaged_run_state_is_one_line(finished_copy, model4, small_chat_path, tmp_path, name, content):
    argv = finished_argv(model4, small_chat_path, finished_copy)
    (finished_copy / ".hsx" / name).write_bytes(content)
    commands = {"merge": ["merge", str(tmp_path / "merged"), str(finished_copy)]}
    if name == "job.json":
        commands["extract"] = argv
    for command in commands.values():
        rc, _, err = hsx_main(command)
        assert_one_error_line(rc, err, name, "damaged", prefix="hsx: error: ")


@pytest.mark.parametrize(("where", "damage", "needle"), [
    ("merge-target job.json", b"\xff\xfe", "job.json"),
    ("summary vocab_size", "x", "vocab_size"),
    ("summary vocab_size", 10**12, "vocab_size"),
])
def test_a_damaged_merge_target_or_summary_vocab_size_is_one_line(finished_copy, tmp_path, where, damage, needle):
    if where == "merge-target job.json":
        target = tmp_path / "merged"
        (target / ".hsx").mkdir(parents=True)
        (target / ".hsx" / "job.json").write_bytes(damage)
        command = ["merge", str(target), str(finished_copy)]
    elif where == "summary vocab_size":
        f = finished_copy / ".hsx" / "summary.json"
        f.write_text(json.dumps({**json.loads(f.read_text()), "vocab_size": damage}))
        command = ["merge", str(tmp_path / "merged"), str(finished_copy)]
    rc, _, err = hsx_main(command)
    assert_one_error_line(rc, err, needle, prefix="hsx: error: ")


@pytest.mark.parametrize("unit", [["a"], "../x", 7])
def test_a_listed_file_whose_unit_is_not_a_name_is_one_error(finished_copy, unit):
    f = finished_copy / "hsx.json"
    meta = json.loads(f.read_text())
    meta["files"][0]["unit"] = unit
    f.write_text(json.dumps(meta))
    with pytest.raises(HsxError, match="files` is damaged"):
        hsx.load(str(finished_copy))


@pytest.mark.parametrize("where", ["hsx.json", "summary"])
def test_a_number_too_long_in_what_hsx_wrote_is_one_line(finished_copy, model4, small_chat_path, where):
    """hsx.json, .hsx/summary.json: json.loads raised a ValueError no reader caught."""
    if where == "hsx.json":
        target = finished_copy / "hsx.json"
        target.write_text(target.read_text().replace('"complete": true', f'"complete": true, "x": {LONG_DIGITS}', 1))
        argv = ["verify", str(finished_copy)]
    else:
        target = finished_copy / ".hsx" / "summary.json"
        target.write_text(target.read_text().replace("{", f'{{"x": {LONG_DIGITS}, ', 1))
        argv = finished_argv(model4, small_chat_path, finished_copy)  # the same job: a resume
    rc, _, err = hsx_main(argv)
    line = the_error_line(err)
    assert rc != 0 and "damaged" in line and target.name in line, line


def with_key_twice(path: Path, key: str, value) -> None:
    """The JSON object in `path` with `key` given again first (json.loads kept the last one, silently)."""
    text = path.read_text()
    assert text.lstrip().startswith("{")
    path.write_text("{" + json.dumps(key) + ": " + json.dumps(value) + ", " + text.lstrip()[1:])


def test_a_key_given_twice_in_hsx_json_or_job_json_is_refused(finished_copy, model4, small_chat_path):
    with_key_twice(finished_copy / "hsx.json", "complete", False)
    with pytest.raises(HsxError, match="key 'complete' given twice"):
        hsx.load(finished_copy)
    rc, _, err = hsx_main(["verify", str(finished_copy), "--samples", "0"])
    assert rc == 1 and "given twice" in the_error_line(err)
    shutil.copy(finished_copy / "hsx.json", finished_copy / "hsx.json.bak")
    info = (finished_copy / "hsx.json").read_text()
    (finished_copy / "hsx.json").write_text(info.replace('"complete": false, ', "", 1))
    with_key_twice(finished_copy / ".hsx" / "job.json", "fingerprint", "0" * 64)
    rc, _, err = hsx_main(finished_argv(model4, small_chat_path, finished_copy))
    assert rc == 1 and "job.json is damaged: key 'fingerprint' given twice" in the_error_line(err)


def test_a_manifest_line_with_a_key_given_twice_is_damaged(finished_copy):
    manifest = sorted((finished_copy / ".hsx").glob("manifest-*.jsonl"))[0]
    first, rest = manifest.read_text().split("\n", 1)
    manifest.write_text('{"bytes": 1, ' + first.lstrip()[1:] + "\n" + rest)
    with pytest.raises(HsxError, match="line 1 is damaged: key 'bytes' given twice"):
        hsx.load(finished_copy)
