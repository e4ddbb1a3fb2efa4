"""The command line: `hsx.cli.main([...])` in-process (capsys), and real `python -m hsx` / `hsx` subprocesses.

Problems the user can fix must print one line (`hsx: error: ...`) to stderr, exit non-zero, no traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hsx
from conftest import REPO, write_jsonl
from hsx.cli import main

PROGRESS = re.compile(r"\d+%\|| \d+ examples \[|(it|examples|tok)/s[\],]|^\s*$")


def error_lines(err: str) -> list[str]:
    """stderr without progress bars (datasets/tqdm write those to stderr too)."""
    return [line for line in re.split(r"[\r\n]+", err) if line.strip() and not PROGRESS.search(line)]


def assert_one_line_error(rc: int, err: str, *needles: str) -> str:
    assert rc != 0
    assert "Traceback" not in err, err
    lines = error_lines(err)
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("hsx: error: "), line
    for n in needles:
        assert n in line, (n, line)
    return line


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def base_args(model, dataset, out, *layers: str) -> list[str]:
    return ["extract", "--model", str(model.path), "--dataset", str(dataset), "--layers", *(layers or ("1",)),
            "--output-dir", str(out)]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, model4, small_chat_path):
    """`hsx extract --model --dataset --layers 1 -1 --output-dir` and nothing else."""
    out = tmp_path_factory.mktemp("cli") / "out"
    argv = base_args(model4, small_chat_path, out, "1", "-1")
    rc, stdout, stderr = run_main(argv)
    return {"argv": argv, "out": out, "rc": rc, "stdout": stdout, "stderr": stderr}


# ---- success paths --------------------------------------------------------------------------------------------

def test_four_flags_are_enough(cli_run):
    assert cli_run["rc"] == 0, cli_run["stderr"]
    assert "Traceback" not in cli_run["stderr"]
    info = json.loads((cli_run["out"] / "hsx.json").read_text())
    assert info["complete"] is True
    assert info["layers"] == [1, 3] and info["final_hidden"] is False
    assert info["max_length"] == 4096 and info["config"]["split"] == "train"
    assert info["counts"]["rows_in"] == 7 and info["counts"]["rows_written"] == 6
    assert info["counts"]["skipped"] == {"no_assistant_turn": 1}
    assert "wrote 6 rows" in cli_run["stdout"]
    assert "no_assistant_turn" in cli_run["stdout"]  # the final summary shows the skips
    assert len(hsx.load(str(cli_run["out"]))) == 6


def test_rerun_is_a_noop_that_says_so(cli_run):
    files = {p: p.stat().st_mtime_ns for p in (cli_run["out"] / "data").iterdir()}
    rc, out, err = run_main(cli_run["argv"])
    assert rc == 0 and "Traceback" not in err
    assert "already complete" in out
    assert {p: p.stat().st_mtime_ns for p in (cli_run["out"] / "data").iterdir()} == files


def test_overwrite_restarts(cli_run):
    info_file = cli_run["out"] / "hsx.json"
    before = info_file.stat().st_mtime_ns
    stale = cli_run["out"] / "data" / "train-999-00000.arrow"
    stale.write_bytes(b"not arrow")  # something a previous job left: --overwrite deletes what hsx wrote
    rc, out, err = run_main(cli_run["argv"] + ["--overwrite"])
    assert rc == 0, err
    assert "already complete" not in out and "wrote 6 rows" in out
    assert info_file.stat().st_mtime_ns != before
    assert not stale.exists()
    assert json.loads(info_file.read_text())["complete"] is True
    assert len(hsx.load(str(cli_run["out"]))) == 6


def test_different_job_in_the_dir_is_an_error(cli_run, model4, small_chat_path):
    before = (cli_run["out"] / "hsx.json").read_text()
    rc, out, err = run_main(base_args(model4, small_chat_path, cli_run["out"], "2"))
    assert_one_line_error(rc, err, "different job")
    assert (cli_run["out"] / "hsx.json").read_text() == before


def test_demo_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "demo"
    rc, stdout, stderr = run_main(["extract", "--config", "recipes/demo.yaml", "--output-dir", str(out)])
    assert rc == 0, stderr
    assert "Traceback" not in stderr
    info = json.loads((out / "hsx.json").read_text())
    c = info["counts"]
    assert sum(c["skipped"].values()) == 3
    assert c["skipped"] == {"empty_conversation": 1, "no_assistant_turn": 1, "null_content": 1}
    assert c["rows_in"] == 99 and c["rows_written"] == 96
    assert info["num_model_layers"] == 8 and info["final_hidden"] is True
    assert info["layers"] == [1, 2, 3, 4, 5]  # dflash on 8 layers
    ds = hsx.load(str(out))
    assert len(ds) == 96 and "final_hidden_state" in ds.column_names


# ---- flags and YAML (extract itself replaced: only the parsed config is checked) --------------------------------

@pytest.fixture
def captured_cfg(monkeypatch):
    seen = {}

    def fake_extract(cfg, *a, **k):
        seen["cfg"] = cfg
        return {}

    monkeypatch.setattr("hsx.run.extract", fake_extract)
    return seen


@pytest.mark.parametrize(("layers", "expected"), [(["1", "-1"], [1, -1]), (["1,-1"], [1, -1]), (["eagle3"], "eagle3"),
                                                  (["dflash-3"], "dflash-3"), (["0", "2,4"], [0, 2, 4])])
def test_layers_flag_forms(captured_cfg, layers, expected):
    assert main(["extract", "--model", "m", "--dataset", "d", "--layers", *layers, "--output-dir", "o"]) == 0
    assert captured_cfg["cfg"].layers == expected


def test_flags_override_yaml(tmp_path, captured_cfg):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: m\ndataset: d.jsonl\nlayers: dflash\nfinal_hidden: true\nmax_length: 512\n"
                      "output_dir: from-yaml\ntoken_budget: 100\n")
    assert main(["extract", "--config", str(recipe), "--max-length", "64", "--no-final-hidden", "--layers", "1", "-1",
                 "--output-dir", "o", "--strict"]) == 0
    cfg = captured_cfg["cfg"]
    assert (cfg.max_length, cfg.final_hidden, cfg.layers, cfg.output_dir) == (64, False, [1, -1], "o")
    assert cfg.strict is True
    assert (cfg.model, cfg.dataset, cfg.token_budget) == ("m", "d.jsonl", 100)  # the rest comes from the YAML


def test_unknown_yaml_key(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: m\ndataset: d\nlayers: [1]\noutput_dir: o\nmax_lenght: 5\n")
    rc = main(["extract", "--config", str(recipe)])
    assert_one_line_error(rc, capsys.readouterr().err, "max_lenght")


def test_unknown_flag_is_rejected(capsys):
    with pytest.raises(SystemExit) as e:
        main(["extract", "--model", "m", "--dataset", "d", "--layers", "1", "--output-dir", "o", "--max-lenght", "5"])
    assert e.value.code != 0
    assert "Traceback" not in capsys.readouterr().err


# ---- bad input and user errors: one line, non-zero, no traceback -----------------------------------------------

def test_strict_names_the_first_bad_row(tmp_path, capsys, model4, small_chat_path):
    out = tmp_path / "out"
    rc = main(base_args(model4, small_chat_path, out) + ["--strict"])
    line = assert_one_line_error(rc, capsys.readouterr().err, "row 2", "no_assistant_turn")
    assert "strict" in line
    assert not (out / "hsx.json").exists()
    assert not list(out.glob("data/*.arrow"))


@pytest.mark.parametrize("case", ["empty_conversation", "null_content", "missing_value",
                                  "no_supervised_tokens_after_truncation"])
def test_strict_each_bad_case(tmp_path, capsys, model4, case):
    from conftest import LONG_USER

    good = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello there."}]}
    bad = {
        "empty_conversation": {"messages": []},
        "null_content": {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]},
        "missing_value": {"text": "this row has no messages"},
        "no_supervised_tokens_after_truncation": {"messages": [{"role": "user", "content": LONG_USER},
                                                               {"role": "assistant", "content": "Yes."}]},
    }[case]
    path = write_jsonl(tmp_path / "d.jsonl", [good, good, good, bad, good])
    # without --strict: skipped and counted by reason
    rc, out, err = run_main(base_args(model4, path, tmp_path / "lenient") + ["--max-length", "64"])
    assert rc == 0, err
    info = json.loads((tmp_path / "lenient" / "hsx.json").read_text())
    assert info["counts"]["skipped"] == {case: 1}
    assert info["counts"]["rows_written"] == 4
    # with --strict: an error naming row 3
    rc = main(base_args(model4, path, tmp_path / "strict") + ["--max-length", "64", "--strict"])
    assert_one_line_error(rc, capsys.readouterr().err, "row 3", case)


def test_broken_jsonl(tmp_path, capsys, model4, broken_jsonl):
    rc = main(base_args(model4, broken_jsonl, tmp_path / "out"))
    assert_one_line_error(rc, capsys.readouterr().err, "cannot read dataset", str(broken_jsonl))


def test_chat_data_with_tokenizer_without_template(tmp_path, capsys, model4, small_chat_path,
                                                   no_template_tokenizer_dir):
    rc = main(base_args(model4, small_chat_path, tmp_path / "out") + ["--tokenizer", str(no_template_tokenizer_dir)])
    assert_one_line_error(rc, capsys.readouterr().err, "chat template")


@pytest.mark.parametrize(("layers", "needle"), [(["4"], "out of range"), (["-5"], "out of range"),
                                                (["1", "-3"], "duplicate"), (["one"], "--layers"),
                                                (["dflash-0"], "dflash")])
def test_bad_layers(tmp_path, capsys, model4, small_chat_path, layers, needle):
    rc = main(base_args(model4, small_chat_path, tmp_path / "out", *layers))
    assert_one_line_error(rc, capsys.readouterr().err, needle)


def test_output_dir_not_written_by_hsx(tmp_path, capsys, model4, small_chat_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    rc = main(base_args(model4, small_chat_path, out))
    assert_one_line_error(rc, capsys.readouterr().err, str(out))
    assert (out / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize("missing", ["--model", "--dataset", "--layers", "--output-dir"])
def test_missing_required_flag(capsys, missing):
    argv = ["extract", "--model", "m", "--dataset", "d", "--layers", "1", "--output-dir", "o"]
    i = argv.index(missing)
    del argv[i:i + 2]
    assert_one_line_error(main(argv), capsys.readouterr().err, missing)


def test_missing_model(tmp_path, capsys, small_chat_path):
    rc = main(["extract", "--model", str(tmp_path / "no-such-model"), "--dataset", str(small_chat_path),
               "--layers", "1", "--output-dir", str(tmp_path / "out")])
    assert_one_line_error(rc, capsys.readouterr().err, "no-such-model")


def test_dataset_without_known_columns(tmp_path, capsys, model4):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "b"}])
    rc = main(base_args(model4, path, tmp_path / "out"))
    assert_one_line_error(rc, capsys.readouterr().err, "messages")


def test_unsupported_dataset_file(tmp_path, capsys, model4):
    path = tmp_path / "d.csv"
    path.write_text("text\nhello\n")
    rc = main(base_args(model4, path, tmp_path / "out"))
    assert_one_line_error(rc, capsys.readouterr().err, ".csv")


# ---- real processes -------------------------------------------------------------------------------------------

def _subprocess(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("HF_DATASETS_DISABLE_PROGRESS_BARS", None)
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_subprocess_python_m_hsx_error(tmp_path, model4, broken_jsonl):
    p = _subprocess([sys.executable, "-m", "hsx", *base_args(model4, broken_jsonl, tmp_path / "out")], tmp_path)
    assert_one_line_error(p.returncode, p.stderr, "cannot read dataset")


def test_subprocess_hsx_command_runs(tmp_path, model4, small_chat_path):
    exe = Path(sys.executable).parent / "hsx"
    argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "hsx"]
    out = tmp_path / "out"
    p = _subprocess([*argv, *base_args(model4, small_chat_path, out, "-1"), "--final-hidden"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    assert "wrote 6 rows" in p.stdout
    info = json.loads((out / "hsx.json").read_text())
    assert info["complete"] is True and info["layers"] == [3] and info["final_hidden"] is True
    from datasets import load_dataset

    ds = load_dataset(str(out), split="train")
    assert ds.num_rows == 6 and ds.features["final_hidden_state"].feature.length == 64


# ---- known bugs (strict xfail: they fail today; fix hsx/, then drop the mark) ----------------------------------

def _skipped_or_one_line_error(argv, out: Path, capsys) -> None:
    """A row that cannot be used is either skipped and counted (rc 0), or reported as one line: never a crash."""
    rc = main(argv)
    err = capsys.readouterr().err
    if rc == 0:
        info = json.loads((out / "hsx.json").read_text())
        assert info["counts"]["rows_written"] == 1 and sum(info["counts"]["skipped"].values()) == 1
    else:
        assert_one_line_error(rc, err)


@pytest.mark.xfail(strict=True, reason="BUG: a row the chat template refuses (here role 'tool', which the template "
                   "rejects with raise_exception) crashes the whole job with jinja2 TemplateError and a traceback "
                   "instead of being skipped and counted")
def test_row_rejected_by_template_is_not_a_crash(tmp_path, capsys, model4):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]},
        {"messages": [{"role": "tool", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]},
    ])
    _skipped_or_one_line_error(base_args(model4, path, tmp_path / "out"), tmp_path / "out", capsys)


@pytest.mark.xfail(strict=True, reason="BUG: a pre-tokenized row with a token id >= the model's vocab size crashes "
                   "the forward (IndexError in the embedding, with a traceback) instead of being skipped or "
                   "reported as one line")
def test_out_of_vocab_input_ids_is_not_a_crash(tmp_path, capsys, model4):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 20, 30, 40]}, {"input_ids": [1, 20, 99999]}])
    _skipped_or_one_line_error(base_args(model4, path, tmp_path / "out"), tmp_path / "out", capsys)


@pytest.mark.xfail(strict=True, reason="BUG: a --strict failure leaves .hsx/job.json behind, so after fixing the "
                   "named row the same command fails with 'holds a different job (differs in: input)' although the "
                   "dir holds no output yet (same after a missing-chat-template error)")
def test_fix_the_row_after_strict_and_rerun(tmp_path, capsys, model4):
    good = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, {"messages": []}])
    argv = base_args(model4, path, tmp_path / "out") + ["--strict"]
    assert_one_line_error(main(argv), capsys.readouterr().err, "row 1")
    write_jsonl(path, [good, good])  # the user fixes row 1
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 0, err
    assert json.loads((tmp_path / "out" / "hsx.json").read_text())["counts"]["rows_written"] == 2
