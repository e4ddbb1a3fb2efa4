"""The command line: `hsx.cli.main([...])` in-process (capsys), and real `python -m hsx` / `hsx` subprocesses.

Problems the user can fix must print one line (`hsx: error: ...`) to stderr, exit non-zero, no traceback.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hsx
from helpers import REPO, assert_one_error_line, hsx_main, message_lines, write_jsonl
from hsx.cli import main
from hsx.cost import GPUS

def base_args(model, dataset, out, *layers: str) -> list[str]:
    return ["extract", "--model", str(model.path), "--dataset", str(dataset), "--layers", *(layers or ("1",)),
            "--output-dir", str(out)]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, model4, small_chat_path):
    """`hsx extract --model --dataset --layers 1 -1 --output-dir` and nothing else."""
    out = tmp_path_factory.mktemp("cli") / "out"
    argv = base_args(model4, small_chat_path, out, "1", "-1")
    rc, stdout, stderr = hsx_main(argv)
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
    rc, out, err = hsx_main(cli_run["argv"])
    assert rc == 0 and "Traceback" not in err
    assert "already complete" in out
    assert {p: p.stat().st_mtime_ns for p in (cli_run["out"] / "data").iterdir()} == files


def test_overwrite_restarts(cli_run):
    info_file = cli_run["out"] / "hsx.json"
    before = info_file.stat().st_mtime_ns
    stale = cli_run["out"] / "data" / "train-999-00000.arrow"
    stale.write_bytes(b"not arrow")  # something a previous job left: --overwrite deletes what hsx wrote
    rc, out, err = hsx_main(cli_run["argv"] + ["--overwrite"])
    assert rc == 0, err
    assert "already complete" not in out and "wrote 6 rows" in out
    assert info_file.stat().st_mtime_ns != before
    assert not stale.exists()
    assert json.loads(info_file.read_text())["complete"] is True
    assert len(hsx.load(str(cli_run["out"]))) == 6


def test_different_job_in_the_dir_is_an_error(cli_run, model4, small_chat_path):
    before = (cli_run["out"] / "hsx.json").read_text()
    rc, out, err = hsx_main(base_args(model4, small_chat_path, cli_run["out"], "2"))
    assert_one_error_line(rc, err, "different job")
    assert (cli_run["out"] / "hsx.json").read_text() == before


def demo_command() -> list[str]:
    """The recipe's first line, which is the command to run it from the repo root."""
    first = (REPO / "recipes" / "demo.yaml").read_text().splitlines()[0]
    assert first.startswith("# hsx extract "), first
    return shlex.split(first[len("# hsx "):])


@pytest.mark.slow
def test_demo_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "demo"
    argv = demo_command()
    assert argv[argv.index("--config") + 1] == "recipes/demo.yaml"
    argv[argv.index("--output-dir") + 1] = str(out)  # the recipe's own command, written elsewhere
    rc, stdout, stderr = hsx_main(argv)
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
    assert info["config"]["model"] == "hsx/demo/tiny-qwen3"  # recipe-relative, normalized against the cwd
    assert info["config"]["dataset"] == "hsx/demo/chat.jsonl"


def test_demo_recipe_from_another_directory(tmp_path, monkeypatch):
    """`hsx extract --config /abs/path/recipes/demo.yaml` from anywhere: the recipe's paths are its own."""
    monkeypatch.chdir(tmp_path)
    rc, stdout, stderr = hsx_main(["extract", "--config", str(REPO / "recipes" / "demo.yaml"), "--output-dir", "out",
                                   "--limit", "10"])
    assert rc == 0, stderr
    info = json.loads((tmp_path / "out" / "hsx.json").read_text())
    assert info["config"]["model"] == str(REPO / "hsx" / "demo" / "tiny-qwen3")
    assert info["config"]["dataset"] == str(REPO / "hsx" / "demo" / "chat.jsonl")
    assert info["counts"]["rows_in"] == 10 and info["num_model_layers"] == 8


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
    assert_one_error_line(rc, capsys.readouterr().err, "max_lenght")


def test_unknown_flag_is_rejected(capsys):
    with pytest.raises(SystemExit) as e:
        main(["extract", "--model", "m", "--dataset", "d", "--layers", "1", "--output-dir", "o", "--max-lenght", "5"])
    assert e.value.code != 0
    assert "Traceback" not in capsys.readouterr().err


# ---- bad input and user errors: one line, non-zero, no traceback -----------------------------------------------

def test_strict_names_the_first_bad_row(tmp_path, capsys, model4, small_chat_path):
    out = tmp_path / "out"
    rc = main(base_args(model4, small_chat_path, out) + ["--strict"])
    line = assert_one_error_line(rc, capsys.readouterr().err, "row 2", "no_assistant_turn")
    assert "strict" in line
    assert not (out / "hsx.json").exists()
    assert not list(out.glob("data/*.arrow"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_gpus_per_copy_without_gpus_is_one_line(tmp_path, capsys, model4, small_chat_path):
    rc = main(base_args(model4, small_chat_path, tmp_path / "out") + ["--gpus-per-copy", "2"])
    assert_one_error_line(rc, capsys.readouterr().err, "--gpus-per-copy 2", "no CUDA GPU")
    assert rc == 1  # the machine's, not the flag's: a runtime error


@pytest.mark.parametrize("case", ["empty_conversation", "null_content", "missing_value",
                                  "no_supervised_tokens_after_truncation"])
def test_strict_each_bad_case(tmp_path, capsys, model4, case):
    from helpers import LONG_USER

    good = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello there."}]}
    bad = {
        "empty_conversation": {"messages": []},
        "null_content": {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]},
        "missing_value": {"messages": None},
        "no_supervised_tokens_after_truncation": {"messages": [{"role": "user", "content": LONG_USER},
                                                               {"role": "assistant", "content": "Yes."}]},
    }[case]
    path = write_jsonl(tmp_path / "d.jsonl", [good, good, good, bad, good])
    # without --strict: skipped and counted by reason
    rc, out, err = hsx_main(base_args(model4, path, tmp_path / "lenient") + ["--max-length", "64"])
    assert rc == 0, err
    info = json.loads((tmp_path / "lenient" / "hsx.json").read_text())
    assert info["counts"]["skipped"] == {case: 1}
    assert info["counts"]["rows_written"] == 4
    # with --strict: an error naming row 3
    rc = main(base_args(model4, path, tmp_path / "strict") + ["--max-length", "64", "--strict"])
    assert_one_error_line(rc, capsys.readouterr().err, "row 3", case)


def test_broken_jsonl(tmp_path, capsys, model4, broken_jsonl):
    rc = main(base_args(model4, broken_jsonl, tmp_path / "out"))
    assert_one_error_line(rc, capsys.readouterr().err, "cannot read dataset", str(broken_jsonl))


def test_chat_data_with_tokenizer_without_template(tmp_path, capsys, model4, small_chat_path,
                                                   no_template_tokenizer_dir):
    rc = main(base_args(model4, small_chat_path, tmp_path / "out") + ["--tokenizer", str(no_template_tokenizer_dir)])
    assert_one_error_line(rc, capsys.readouterr().err, "chat template")


@pytest.mark.parametrize(("layers", "needle"), [(["4"], "out of range"), (["-5"], "out of range"),
                                                (["1", "-3"], "duplicate"), (["one"], "--layers"),
                                                (["dflash-0"], "dflash")])
def test_bad_layers(tmp_path, capsys, model4, small_chat_path, layers, needle):
    rc = main(base_args(model4, small_chat_path, tmp_path / "out", *layers))
    assert_one_error_line(rc, capsys.readouterr().err, needle)


def test_output_dir_not_written_by_hsx(tmp_path, capsys, model4, small_chat_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    rc = main(base_args(model4, small_chat_path, out))
    assert_one_error_line(rc, capsys.readouterr().err, str(out), "not written by hsx")
    assert (out / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]  # no .hsx/ left behind
    rc = main(base_args(model4, small_chat_path, out))  # so the second try says the same, not something else
    assert_one_error_line(rc, capsys.readouterr().err, str(out), "not written by hsx")
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]


def test_output_dir_that_exists_empty_is_used(tmp_path, model4, small_chat_path):
    out = tmp_path / "out"
    out.mkdir()
    rc, stdout, err = hsx_main(base_args(model4, small_chat_path, out))
    assert rc == 0, err
    assert json.loads((out / "hsx.json").read_text())["counts"]["rows_written"] == 6


@pytest.mark.parametrize("missing", ["--model", "--dataset", "--layers", "--output-dir"])
def test_missing_required_flag(capsys, missing):
    argv = ["extract", "--model", "m", "--dataset", "d", "--layers", "1", "--output-dir", "o"]
    i = argv.index(missing)
    del argv[i:i + 2]
    assert_one_error_line(main(argv), capsys.readouterr().err, missing)


def test_missing_model(tmp_path, capsys, small_chat_path):
    rc = main(["extract", "--model", str(tmp_path / "no-such-model"), "--dataset", str(small_chat_path),
               "--layers", "1", "--output-dir", str(tmp_path / "out")])
    assert_one_error_line(rc, capsys.readouterr().err, "no-such-model")


def test_dataset_without_known_columns(tmp_path, capsys, model4):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "b"}])
    rc = main(base_args(model4, path, tmp_path / "out"))
    assert_one_error_line(rc, capsys.readouterr().err, "messages")


def test_unsupported_dataset_file(tmp_path, capsys, model4):
    path = tmp_path / "d.xml"
    path.write_text("<text>hello</text>\n")
    rc = main(base_args(model4, path, tmp_path / "out"))
    assert_one_error_line(rc, capsys.readouterr().err, ".xml")


def test_csv_input(tmp_path, model4):
    path = tmp_path / "d.csv"
    path.write_text('text\nhello there\n"second row, with a comma"\n')
    rc, _, err = hsx_main(base_args(model4, path, tmp_path / "out"))
    assert rc == 0, err
    assert json.loads((tmp_path / "out" / "hsx.json").read_text())["counts"]["rows_written"] == 2


@pytest.fixture
def split_folder(tmp_path):
    """train/ (3 rows) and test/ (2 rows), chat rows, as a user's own dataset folder."""
    def row(text):
        return {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": text + " ok"}]}

    write_jsonl(tmp_path / "d" / "train" / "0.jsonl", [row(f"train {i}") for i in range(3)])
    write_jsonl(tmp_path / "d" / "test" / "0.jsonl", [row(f"test {i}") for i in range(2)])
    return tmp_path / "d"


@pytest.mark.parametrize(("split", "rows"), [(None, 3), ("test", 2)])
def test_extract_reads_one_split_of_a_folder(tmp_path, model4, split_folder, split, rows):
    """Only the split asked for (default train) is written, never train and test merged; the output's own split is
    train whatever was read, as load_dataset gives it."""
    import datasets

    from hsx.data import tokenize_batch

    out = tmp_path / "out"
    rc, _, err = hsx_main(base_args(model4, split_folder, out) + (["--split", split] if split else []))
    assert rc == 0, err
    written = datasets.load_dataset(str(out))
    assert list(written) == ["train"]
    want = datasets.load_dataset(str(split_folder))[split or "train"]
    assert sorted(written["train"]["sample_id"]) == list(range(rows)) == list(range(len(want)))
    expected = tokenize_batch({"messages": want["messages"]}, list(range(rows)), model4.tokenizer, "messages",
                              4096, {})
    by_id = {r["sample_id"]: r["input_ids"] for r in written["train"]}
    assert [by_id[i] for i in range(rows)] == expected["input_ids"]


def test_all_rows_skipped_is_an_error_naming_the_reasons(tmp_path, capsys, model4):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": []}, {"messages": [{"role": "user", "content": "x"}]}])
    out = tmp_path / "out"
    rc = main(base_args(model4, path, out))
    line = assert_one_error_line(rc, capsys.readouterr().err, "no usable rows", "empty_conversation",
                                 "no_assistant_turn", "--allow-empty")
    assert rc == 1 and "2 input rows" in line
    assert not out.exists()  # no dir that load_dataset cannot read
    rc, _, err = hsx_main(base_args(model4, path, out) + ["--allow-empty"])
    assert rc == 0, err
    assert "0 rows (--allow-empty)" in err and "corresponds to no data" in err  # datasets' own limit, said
    import datasets

    assert len(hsx.load(str(out))) == 0
    assert list(datasets.load_dataset(str(out), split="train", streaming=True)) == []
    assert json.loads((out / "hsx.json").read_text())["counts"]["skipped"] == {"empty_conversation": 1,
                                                                             "no_assistant_turn": 1}


def test_failed_validation_leaves_no_dir(tmp_path, capsys, model4, small_chat_path):
    out = tmp_path / "out"
    assert_one_error_line(main(base_args(model4, small_chat_path, out, "99")), capsys.readouterr().err,
                          "out of range")
    assert not out.exists()
    out.mkdir()  # a dir the user made stays, without .hsx/
    assert_one_error_line(main(base_args(model4, small_chat_path, out, "99")), capsys.readouterr().err,
                          "out of range")
    assert out.is_dir() and not any(out.iterdir())


# ---- real processes -------------------------------------------------------------------------------------------

def _subprocess(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("HF_DATASETS_DISABLE_PROGRESS_BARS", None)
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_subprocess_python_m_hsx_error(tmp_path, model4, broken_jsonl):
    p = _subprocess([sys.executable, "-m", "hsx", *base_args(model4, broken_jsonl, tmp_path / "out")], tmp_path)
    assert_one_error_line(p.returncode, p.stderr, "cannot read dataset")


@pytest.mark.slow
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


# ---- rows that could crash the job, and dirs that could be refused wrongly ----------------------------------------

def test_row_rejected_by_template_is_skipped(tmp_path, capsys, model4):
    """A row the chat template refuses (role 'tool': the demo template raises) is skipped and counted."""
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]},
        {"messages": [{"role": "tool", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]},
    ])
    rc = main(base_args(model4, path, tmp_path / "out"))
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "Traceback" not in err
    info = json.loads((tmp_path / "out" / "hsx.json").read_text())
    assert info["counts"]["rows_written"] == 1
    assert info["counts"]["skipped"] == {"chat_template_error": 1}
    assert [r["sample_id"] for r in hsx.load(str(tmp_path / "out"))] == [0]
    # --strict names it
    rc = main(base_args(model4, path, tmp_path / "strict") + ["--strict"])
    assert_one_error_line(rc, capsys.readouterr().err, "row 1", "chat_template_error")


def test_out_of_vocab_input_ids_is_skipped(tmp_path, capsys, model4):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 20, 30, 40]}, {"input_ids": [1, 20, 99999]}])
    rc = main(base_args(model4, path, tmp_path / "out"))
    err = capsys.readouterr().err
    assert rc == 0, err
    info = json.loads((tmp_path / "out" / "hsx.json").read_text())
    assert info["counts"]["rows_written"] == 1
    assert info["counts"]["skipped"] == {"token_id_out_of_range": 1}


def test_fix_the_row_after_strict_and_rerun(tmp_path, capsys, model4):
    good = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, {"messages": []}])
    out = tmp_path / "out"
    argv = base_args(model4, path, out) + ["--strict"]
    assert_one_error_line(main(argv), capsys.readouterr().err, "row 1")
    assert not out.exists()  # the refused job leaves nothing behind
    write_jsonl(path, [good, good])  # the user fixes row 1
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 0, err
    assert json.loads((out / "hsx.json").read_text())["counts"]["rows_written"] == 2
    assert len(hsx.load(str(out))) == 2


def test_fix_the_tokenizer_after_missing_template_and_rerun(tmp_path, capsys, model4, small_chat_path,
                                                           no_template_tokenizer_dir):
    out = tmp_path / "out"
    argv = base_args(model4, small_chat_path, out)
    assert_one_error_line(main(argv + ["--tokenizer", str(no_template_tokenizer_dir)]), capsys.readouterr().err,
                          "chat template")
    assert not out.exists()
    rc = main(argv)  # the model's own tokenizer, which has one
    err = capsys.readouterr().err
    assert rc == 0, err
    assert json.loads((out / "hsx.json").read_text())["counts"]["rows_written"] == 6


def test_a_dir_with_output_of_another_job_is_still_refused_after_a_failure(tmp_path, capsys, model4,
                                                                           small_chat_path):
    """Re-claiming is only for dirs that hold no output: a finished job is never replaced silently."""
    out = tmp_path / "out"
    assert main(base_args(model4, small_chat_path, out)) == 0
    capsys.readouterr()
    before = sorted(p.name for p in (out / "data").iterdir())
    rc = main(base_args(model4, small_chat_path, out, "2"))
    assert_one_error_line(rc, capsys.readouterr().err, "different job")
    assert sorted(p.name for p in (out / "data").iterdir()) == before


def test_exit_codes_usage_2_runtime_1(tmp_path, capsys, model4, small_chat_path, broken_jsonl):
    usage = [["extract", "--dataset", str(small_chat_path), "--layers", "1", "--output-dir", str(tmp_path / "b")],
             base_args(model4, small_chat_path, tmp_path / "c") + ["--topk-logits", "2"]]
    for argv in usage:
        assert main(argv) == 2, argv
    for argv in (["extract", "--no-such-flag"],  # argparse's own usage errors (a choice flag's too)
                 base_args(model4, small_chat_path, tmp_path / "a") + ["--storage-dtype", "int4"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
    assert main(base_args(model4, broken_jsonl, tmp_path / "d")) == 1  # the data's fault
    assert main(base_args(model4, small_chat_path, tmp_path / "e", "99")) == 2  # a layer the model lacks: an argument
    capsys.readouterr()


def test_a_wrong_flag_is_one_line_from_its_command(capsys):
    """argparse printed the whole usage (29 lines for extract) before its error line, and an unknown flag after a
    command was the top-level parser's error; under `hsx launch` too."""
    for argv, line in [
        (["extract", "--bogus", "1"], "hsx extract: error: unrecognized arguments: --bogus 1; see `hsx extract --help`"),
        (["launch", "--num_processes", "1", "extract", "--bogus", "1"],
         "hsx extract: error: unrecognized arguments: --bogus 1; see `hsx extract --help`"),
        (["plan", "--gpu", "nope"], "hsx plan: error: argument --gpu: invalid choice: 'nope' (choose from "
                                    + ", ".join(repr(g) for g in sorted(GPUS)) + "); see `hsx plan --help`"),
        (["launch", "--bogus", "extract"], "hsx launch: error: unrecognized arguments: --bogus; see `hsx launch --help`"),
        ([], "hsx: error: the following arguments are required: command; see `hsx --help`"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        captured = capsys.readouterr()
        assert e.value.code == 2 and captured.err.splitlines() == [line] and not captured.out, (argv, captured.err)


@pytest.mark.slow
def test_options_that_do_not_apply_to_this_model_or_data_are_said_in_one_line_each(tmp_path, model4,
                                                                                     small_chat_path):
    """--fp8-gemm on a bf16 model, --experts-implementation on a dense one, --prompt-completion text on chat rows
    were accepted without a word. A recipe may set them for every model, so the job runs, saying so once each."""
    argv = base_args(model4, small_chat_path, tmp_path / "out") + [
        "--fp8-gemm", "cublas", "--experts-implementation", "eager", "--prompt-completion", "text", "--compile", "off"]
    rc, out, err = hsx_main(argv)
    assert rc == 0, err
    notes = [line for line in out.splitlines() if "does not apply" in line]
    assert notes == [
        f"hsx: --prompt-completion text does not apply: {small_chat_path}'s rows are 'messages', not string prompt "
        "and completion columns; they are read as they are (chat rows with the template, loss on the assistant turns)",
        f"hsx: --experts-implementation eager does not apply: {model4.path} has no mixture-of-experts layers",
        f"hsx: --fp8-gemm cublas does not apply: {model4.path} is not an FP8 checkpoint (its linear layers run in "
        "bfloat16)"], out


def _subcommands():
    from hsx.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_flag_and_positional_has_help(command):
    missing = [a.dest for a in _subcommands()[command]._actions if a.dest != "help" and not a.help]
    assert not missing, f"hsx {command}: no help for {missing}"


def test_kernel_choices_are_advanced_flags_that_still_override_a_recipe(tmp_path):
    """The benchmarking knobs sit in extract's and plan's "advanced" help group, and are flags and recipe keys as
    before; no flag's help points to README numbers."""
    from hsx.config import ADVANCED, config_of

    kernels = {"attn_implementation", "sdpa_backend", "experts_implementation", "fp8_gemm", "packing", "compile"}
    assert set(ADVANCED) == kernels
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: m\ndataset: d\noutput_dir: o\nlayers: [1]\nsdpa_backend: cudnn\npacking: none\n")
    for command in ("extract", "plan"):
        parser = _subcommands()[command]
        groups = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
        assert groups["advanced"] == kernels and not kernels & groups["options"]
        text = parser.format_help()
        assert "README's" not in text and text.index("advanced:") > text.index("--trust-remote-code")
        args = parser.parse_args(["--config", str(recipe), "--fp8-gemm", "cublas", "--packing", "varlen"])
        cfg = config_of(args)
        assert (cfg.sdpa_backend, cfg.fp8_gemm, cfg.packing, cfg.compile) == ("cudnn", "cublas", "varlen", "auto")


def test_hub_visibility_is_spelled_the_same_for_extract_and_push():
    def flags(command):
        return {s for a in _subcommands()[command]._actions for s in a.option_strings if "hub-" in s}

    assert {"--hub-private", "--no-hub-private", "--hub-revision"} <= flags("push") & flags("extract")
    assert not [s for a in _subcommands()["push"]._actions for s in a.option_strings if s == "--public"]


def test_plan_json_to_stdout_or_a_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    base = ["plan", "--config", "recipes/demo.yaml", "--tokens", "1000"]
    for argv in (base + ["--json"], base + ["--json", "-"]):
        assert main(argv) == 0
        p = json.loads(capsys.readouterr().out)  # stdout is the JSON and nothing else
        assert p["bytes_per_token"] == 768 and "H200" in p["planned_for"] and p["rate_bound"] == "writer"
    assert main(base + ["--json", str(tmp_path / "plan.json")]) == 0
    assert "bytes per token" in capsys.readouterr().out  # the plan as text, the JSON in the file
    assert json.loads((tmp_path / "plan.json").read_text())["bytes_per_token"] == 768
    assert main(base) == 0 and "writer's fastest measured" in capsys.readouterr().out  # a tiny model
    assert main(["plan", "--shape", "qwen3-8b", "--layers", "eagle3", "--tokens", "1000"]) == 0
    assert "70% of an H200's 790 TFLOP/s" in capsys.readouterr().out


def test_changing_only_layers_names_only_layers(tmp_path, capsys, model4, small_chat_path):
    out = tmp_path / "out"
    assert main(base_args(model4, small_chat_path, out, "1")) == 0
    capsys.readouterr()
    line = assert_one_error_line(main(base_args(model4, small_chat_path, out, "2")), capsys.readouterr().err,
                                 "different job")
    assert "(differs in: layers)" in line


def test_a_dir_planned_another_way_is_refused(tmp_path, capsys, model4, small_chat_path, monkeypatch):
    """The rule that cuts rows into units is part of the job: a dir whose units were cut another way (an older hsx)
    holds other rows under the same unit names, so resuming it would skip rows; it is refused, naming the plan."""
    out = tmp_path / "out"
    monkeypatch.setattr("hsx.job.UNIT_PLAN", "buckets-1.0625-span-1.0")
    assert main(base_args(model4, small_chat_path, out, "1")) == 0
    monkeypatch.undo()
    capsys.readouterr()
    line = assert_one_error_line(main(base_args(model4, small_chat_path, out, "1")), capsys.readouterr().err,
                                 "different job")
    assert "(differs in: unit_plan)" in line


def test_export_specforge_error_speaks_flags(tmp_path, capsys, monkeypatch, cli_run):
    out = cli_run["out"]  # layers 1 and 3 of 4, no final norm state: refused before any file is written
    rc = main(["export-specforge", str(out), str(tmp_path / "sf")])
    assert_one_error_line(rc, capsys.readouterr().err, "--final-hidden")
    meta = json.loads((out / "hsx.json").read_text())
    from hsx.schema import Info

    monkeypatch.setattr(sys.modules["hsx.export"], "read_info",
                        lambda path: Info.from_dict({**meta, "final_hidden": True}))
    rc = main(["export-specforge", str(out), str(tmp_path / "sf")])
    line = assert_one_error_line(rc, capsys.readouterr().err, "3 auxiliary layers", "--layers 1 3")
    assert "layers=[" not in line.split("(in Python")[0]
    assert not (tmp_path / "sf").exists()


def test_progress_bar_labels_its_two_rates(cli_run):
    bars = [line for line in re.split(r"[\r\n]+", cli_run["stderr"]) if line.startswith("extracting:")]
    assert bars and all(", now " in line for line in bars)  # tqdm's recent rate
    assert any("mean " in line and " tok/s" in line for line in bars)  # ours, since the start


def test_import_cli_loads_no_torch_datasets_or_transformers():
    """`hsx --help` stays fast: the command line imports the heavy stacks only when a command runs them."""
    code = ("import sys, hsx.cli; heavy = [m for m in ('torch', 'datasets', 'transformers', 'accelerate') "
            "if m in sys.modules]; assert not heavy, heavy")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_version_flag(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"hsx {version('hsx')}" == f"hsx {hsx.__version__}"


def test_exit_status_of_each_error():
    from hsx.errors import HsxError, Stopped, UsageError, VerifyFailed, exit_status

    assert [exit_status(e) for e in (UsageError("x"), HsxError("x"), VerifyFailed("x"), Stopped("x", 143))] == [
        2, 1, 1, 143]


FINALIZER_SCRIPT = r'''
import os, signal, sys, time
import hsx.commands
from hsx.cli import main


class Finalized:
    def __del__(self):  # the signal's handler runs inside this finalizer
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        time.sleep(0.3)


def command(args):
    x = Finalized()
    del x
    for _ in range(10000):  # short sleeps: a signal that lands just before a sleep starts is seen when it ends
        time.sleep(0.01)
    print("not interrupted")


hsx.commands.COMMANDS["verify"] = command
sys.exit(main(["verify", "out"]))
'''


@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_inside_a_finalizer_still_ends_the_command_with_one_line(tmp_path, sig, code):
    """A handler's KeyboardInterrupt raised while a `__del__` runs cannot leave it: Python printed "Exception
    ignored ... Traceback" and went on (a second Ctrl-C under `hsx launch` did, now and then). It is delivered again
    where it can propagate: the interrupted line, the signal's exit status, no traceback. Deterministic: the signal
    is sent from inside the finalizer, and delivered again once the main thread has left the hook (not after a
    delay that a loaded machine could outlast; the test below holds the main thread in the hook)."""
    from helpers import child_env

    script = tmp_path / "finalizer.py"
    script.write_text(FINALIZER_SCRIPT)
    done = subprocess.run([sys.executable, str(script), sig], capture_output=True, text=True, timeout=120,
                          env=child_env(), preexec_fn=default_sigint)
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert "not interrupted" not in done.stdout
    assert done.returncode == code, done.stderr
    assert message_lines(done.stderr)[-1].startswith("hsx: interrupted"), done.stderr


def test_an_error_raised_while_an_interrupt_unwinds_is_the_interrupted_line(monkeypatch, capsys):
    """A second Ctrl-C raised inside datasets' map: its clean-up (the writer finalizing a file the interrupt had
    closed) raised ValueError over the KeyboardInterrupt, and the rank printed that traceback. The command ended
    because of the signal: one line, 128 + its number; an error with no interrupt behind it still propagates."""
    import hsx.commands

    def interrupted_then_cleanup_fails(args):
        try:
            raise KeyboardInterrupt(15)  # as hsx.run's handler raises the second SIGTERM
        finally:
            raise ValueError("I/O operation on closed file")

    monkeypatch.setitem(hsx.commands.COMMANDS, "verify", interrupted_then_cleanup_fails)
    assert main(["verify", "out"]) == 143
    err = capsys.readouterr().err
    assert message_lines(err) == ["hsx: interrupted; finished units are kept: run the same command to continue"], err

    def plain_failure(args):
        raise ValueError("a bug")

    monkeypatch.setitem(hsx.commands.COMMANDS, "verify", plain_failure)
    with pytest.raises(ValueError, match="a bug"):
        main(["verify", "out"])


def test_an_interrupt_that_lands_inside_the_finalizer_hook_is_sent_once_more(monkeypatch):
    """On a loaded machine the interrupt sent back to the main thread could land while the hook was still running
    (it waited for its thread to start) and be lost: "not interrupted" after a Ctrl-C in 1 of ~50 runs with the CPUs
    busy. Landing there now sends it once more; an error that is no signal still propagates."""
    import types

    import hsx.cli as cli

    sent = []

    def interrupt_later(signum, delay=0.01):
        sent.append(signum)
        if len(sent) == 1:
            raise KeyboardInterrupt  # the first one arrived before the hook returned

    monkeypatch.setattr(cli, "_interrupt_main_later", interrupt_later)
    with cli._interrupts_out_of_finalizers():
        sys.unraisablehook(types.SimpleNamespace(exc_value=KeyboardInterrupt(15)))
    assert sent == [15, signal.SIGINT]
    assert cli._signal_of(ValueError("x")) is None and cli._signal_of(KeyboardInterrupt()) == signal.SIGINT

    def broken(signum, delay=0.01):
        raise ValueError("a bug")

    monkeypatch.setattr(cli, "_interrupt_main_later", broken)
    with cli._interrupts_out_of_finalizers(), pytest.raises(ValueError, match="a bug"):
        sys.unraisablehook(types.SimpleNamespace(exc_value=KeyboardInterrupt()))


def test_an_interrupt_is_delivered_again_only_once_the_main_thread_has_left_the_hook(monkeypatch):
    """The interrupt sent back to the main thread went after a fixed 10 ms: a main thread held up longer in the
    hook (a loaded 2-core machine) got it there, where it is lost, and the command ran on ("not interrupted", exit
    0: the README's test command failed once so). It goes once the hook's frame is off the main thread's stack,
    however long that takes: here the hook holds the main thread for 0.3 s, and no interrupt lands inside it."""
    import time

    import hsx.cli as cli

    inside = []

    def hook(u):  # stands for `unraisable`: asks for the interrupt, then stays a while
        cli._interrupt_main_later(signal.SIGINT)
        inside.append("asked")
        end = time.monotonic() + 0.3
        while time.monotonic() < end:  # (Python bytecode: an interrupt would land here)
            pass
        inside.append("left")

    monkeypatch.setattr(sys, "unraisablehook", hook)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # (see default_sigint)
    try:
        sys.unraisablehook(None)
        with pytest.raises(KeyboardInterrupt):
            for _ in range(3000):  # interrupted once the hook returned (short sleeps: see FINALIZER_SCRIPT)
                time.sleep(0.01)
    except KeyboardInterrupt:
        pytest.fail("the interrupt landed inside the hook")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert inside == ["asked", "left"]


def default_sigint():
    """SIGINT back to its default in a child: a test command started in the background of a non-interactive shell
    (`cmd &`) inherits SIGINT ignored, and Python then installs no handler of its own (Ctrl-C is not delivered)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


from helpers import child_env, the_error_line  # noqa: E402


# ---- numbers out of range, an unwritable --json, and SIGTERM: one line ---------------------------------------------

@pytest.mark.parametrize("argv", [
    ["verify", "{out}", "--samples", "-3"],
    ["verify", "{out}", "--samples", "1", "--seed", "-1"],
    ["verify", "{out}", "--samples", "1", "--tolerance", "nan"],
    ["plan", "--model", "{model}", "--layers", "1", "--tokens", "-5"],
    ["plan", "--model", "{model}", "--layers", "1", "--rate", "nan"],
    ["plan", "--model", "{model}", "--layers", "1", "--gpu-memory-gib", "inf"],
    ["bench", "--model", "{model}", "--count", "-1", "--skip", "a,b"],
    ["bench", "--model", "{model}", "--mean", "nan", "--skip", "a,b"],
])
def test_numeric_options_out_of_range_are_one_line(finished, model4, argv, tmp_path):
    """Negative, NaN and infinite values of verify's, plan's and bench's numbers: one line, exit 2 (they were
    numpy's `negative dimensions` and an OverflowError, as tracebacks, or a verify failing every layer)."""
    argv = [a.format(out=finished, model=model4.path) for a in argv]
    if argv[0] == "bench":
        argv += ["--output-dir", str(tmp_path / "b")]
    rc, _, err = hsx_main(argv)
    assert rc == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("hsx: error: ")]
    assert len(lines) == 1 and "must be" in lines[0], err


def test_a_json_path_that_cannot_be_written_is_one_line(tmp_path, model4):
    """`hsx plan --json` into a folder or under a missing parent is one line (an OSError would be a traceback)."""
    for dest in (tmp_path, tmp_path / "missing" / "plan.json"):
        rc, _, err = hsx_main(["plan", "--model", str(model4.path), "--layers", "1", "--json", str(dest)])
        assert rc == 1 and "cannot write --json" in the_error_line(err), err


def test_sigterm_ends_a_command_with_one_line_and_143(tmp_path):
    """Any command, not only extract: a SIGTERM during an export killed it silently (exit -15, no line)."""
    code = ("import os, signal, sys, time\n"
            "import hsx.commands as c\n"
            "def slow(args):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(30)\n"
            "c.COMMANDS['vocab'] = slow\n"
            "from hsx.cli import main\n"
            "sys.exit(main(['vocab', 'OUT', '--draft-vocab-size', '8']))\n")
    res = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert res.returncode == 143, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr
    assert [line for line in res.stderr.splitlines() if line.startswith("hsx: ")] == [
        "hsx: interrupted; finished units are kept: run the same command to continue"]


def test_every_export_comes_from_the_one_table(monkeypatch):
    """hsx.exports.EXPORTS is the one list of trainer exports: each row is an `hsx` attribute (hsx.export's
    function, in __all__), a subcommand whose flags give every option the row passes on (each a keyword of the
    function), and what that subcommand runs: the function, given those flags."""
    import inspect

    import hsx.commands
    import hsx.export
    from hsx.cli import build_parser
    from hsx.exports import EXPORTS

    assert [spec.function for spec in EXPORTS] == ["export_specforge", "export_speculators"]  # a new one: on purpose
    parser = build_parser()
    for spec in EXPORTS:
        assert getattr(hsx, spec.function) is getattr(hsx.export, spec.function) and spec.function in hsx.__all__
        assert set(spec.options) <= set(inspect.signature(getattr(hsx.export, spec.function)).parameters)
        args = parser.parse_args([spec.command, "OUT", "DEST"])
        assert set(spec.options) <= set(vars(args))
        seen = {}
        monkeypatch.setattr(hsx.export, spec.function, lambda out, dest, **kw: seen.update(out=out, dest=dest, **kw))
        hsx.commands.COMMANDS[spec.command](args)
        assert seen == {"out": "OUT", "dest": "DEST", **{name: getattr(args, name) for name in spec.options}}
