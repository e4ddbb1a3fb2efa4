"""A second held-out round on a finished output and the commands around it: JSON with a key given twice, readers of
an output an export used up, a model whose config does not build, hostile accelerate config files and process
counts, recipes that are FIFOs, an unusable datasets cache or output dir, and SIGTERM during a command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import child_env, copy_of, fault_argv, finished_job, hsx_main, the_error_line

import hsx
from hsx.config import HsxError
from hsx.export import export_specforge
from hsx.hub import push_output
from test_hub import REPO, FakeHfApi

ROOT = Path(__file__).resolve().parents[1]


def quiet(*a, **k):
    pass


@pytest.fixture(scope="module")
def finished(tmp_path_factory, model4, small_chat_path) -> Path:
    return finished_job(tmp_path_factory, model4, small_chat_path, "round5")


@pytest.fixture
def out(finished, tmp_path) -> Path:
    return copy_of(finished, tmp_path)


def with_key_twice(path: Path, key: str, value) -> None:
    """The JSON object in `path` with `key` given again first (json.loads kept the last one, silently)."""
    text = path.read_text()
    assert text.lstrip().startswith("{")
    path.write_text("{" + json.dumps(key) + ": " + json.dumps(value) + ", " + text.lstrip()[1:])


def test_a_key_given_twice_in_hsx_json_or_job_json_is_refused(out, model4, small_chat_path):
    with_key_twice(out / "hsx.json", "complete", False)
    with pytest.raises(HsxError, match="key 'complete' given twice"):
        hsx.load(out)
    rc, _, err = hsx_main(["verify", str(out), "--samples", "0"])
    assert rc == 1 and "given twice" in the_error_line(err)
    shutil.copy(out / "hsx.json", out / "hsx.json.bak")
    (out / "hsx.json").write_text((out / "hsx.json").read_text().replace('"complete": false, ', "", 1))
    with_key_twice(out / ".hsx" / "job.json", "fingerprint", "0" * 64)
    rc, _, err = hsx_main(fault_argv(model4.path, small_chat_path, out, "--unit-tokens", "200"))
    assert rc == 1 and "job.json is damaged: key 'fingerprint' given twice" in the_error_line(err)


def test_a_manifest_line_with_a_key_given_twice_is_damaged(out):
    manifest = sorted((out / ".hsx").glob("manifest-*.jsonl"))[0]
    first, rest = manifest.read_text().split("\n", 1)
    manifest.write_text('{"bytes": 1, ' + first.lstrip()[1:] + "\n" + rest)
    with pytest.raises(HsxError, match="line 1 is damaged: key 'bytes' given twice"):
        hsx.load(out)


def test_verify_and_push_of_a_used_up_output_say_where_its_rows_went(out, tmp_path):
    """They said 'in the manifest but missing' (verify) and pushed nothing useful; hsx.load said where."""
    dest = tmp_path / "moved"
    export_specforge(out, dest, layout="dflash", delete_source=True, log=quiet)
    rc, _, err = hsx_main(["verify", str(out), "--samples", "0"])
    line = the_error_line(err)
    assert rc == 1 and "export-specforge --delete-source" in line and str(dest.resolve()) in line, line
    assert "missing" not in line
    api = FakeHfApi()
    with pytest.raises(HsxError, match="exported and then deleted") as e:
        push_output(out, REPO, api=api, log=quiet)
    assert "\n" not in str(e.value) and str(dest.resolve()) in str(e.value)
    assert REPO not in api.repos  # refused before the repo was made


def test_a_forged_exported_ledger_prints_no_second_line(out, tmp_path):
    dest = tmp_path / "moved"
    export_specforge(out, dest, layout="dflash", delete_source=True, log=quiet)
    ledger = out / ".hsx" / "exported.jsonl"
    lines = [json.loads(x) for x in ledger.read_text().splitlines()]
    ledger.write_text("".join(json.dumps({**r, "dest": "/x\nhsx: all good"}) + "\n" for r in lines))
    with pytest.raises(HsxError) as e:
        hsx.load(out)
    assert "\n" not in str(e.value) and "exported and then deleted" in str(e.value)


def test_an_exported_file_that_became_a_folder_is_named_as_such(out, tmp_path):
    dest = tmp_path / "dest"
    export_specforge(out, dest, layout="dflash", log=quiet)
    ckpt = sorted(dest.glob("rows_*/data_*.ckpt"))[0]
    ckpt.unlink()
    ckpt.mkdir()
    with pytest.raises(ValueError) as e:
        export_specforge(out, dest, layout="dflash", log=quiet)
    assert "not the file this export wrote" in str(e.value) and "folder" in str(e.value)
    assert "not in hsx-export.json" not in str(e.value)
    assert ckpt.is_dir()  # nothing deleted


@pytest.mark.parametrize("case", ["hidden_size_str", "layer_types_short", "hidden_act_unknown"])
def test_a_config_that_does_not_build_the_model_is_one_line_naming_the_key(tmp_path, model4, small_chat_path,
                                                                             case):
    """transformers' validation error was cut to its first line ('Validation error for field ...:'), without the
    why; an unknown hidden_act was a KeyError traceback."""
    model = Path(shutil.copytree(model4.path, tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    if case == "hidden_size_str":
        config["hidden_size"], needle = "x", "expected int"
    elif case == "layer_types_short":
        config["layer_types"], needle = ["full_attention"], "must be equal to the number of `layer_types`"
    else:
        config["hidden_act"], needle = "nope", "KeyError: 'nope'"
    (model / "config.json").write_text(json.dumps(config))
    rc, _, err = hsx_main(fault_argv(model, small_chat_path, tmp_path / "o"))
    line = the_error_line(err)
    assert rc == 1 and needle in line, line


@pytest.fixture
def accelerate_files(tmp_path) -> dict[str, Path]:
    files = {"bomb": "a: &a [x, x]\nb: [*a, *a]\n", "list": "[1, 2]\n",
             "sagemaker": "compute_environment: AMAZON_SAGEMAKER\n", "many": "num_processes: 999999\n",
             "zero": "num_processes: 0\n"}
    paths = {}
    for name, text in files.items():
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(text)
    paths["fifo"] = tmp_path / "fifo.yaml"
    os.mkfifo(paths["fifo"])
    paths["missing"] = tmp_path / "missing.yaml"
    return paths


@pytest.mark.parametrize("options,needle", [
    (["--num_processes", "0"], "at least 1"),
    (["--num_processes", "-1"], "at least 1"),
    (["--num_processes", "100000"], "processes on each"),
    (["--config_file", "{zero}"], "at least 1"),
    (["--config_file", "{many}"], "processes on each"),
    (["--config_file", "{missing}"], "No such file"),
    (["--config_file", "{fifo}"], "not a regular file"),
    (["--config_file", "{bomb}"], "aliases"),
    (["--config_file", "{list}"], "expected a mapping"),
    (["--config_file", "{sagemaker}"], "LOCAL_MACHINE"),
])
def test_launch_refuses_bad_process_counts_and_config_files_in_one_line(accelerate_files, options, needle,
                                                                        tmp_path, capsys):
    """0 or -1 processes ran one; 100,000 would start them all; a missing --config_file was accelerate's
    traceback, a FIFO hung it; a SageMaker config sends the job to AWS. All before any rank starts."""
    from hsx.cli import main

    options = [o.format(**accelerate_files) for o in options]
    rc = main(["launch", *options, "extract", "--config", "recipes/demo.yaml", "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and needle in the_error_line(err), err
    assert not (tmp_path / "o").exists()


def test_a_recipe_that_is_a_fifo_or_a_folder_is_one_line(tmp_path, capsys):
    from hsx.cli import main

    os.mkfifo(tmp_path / "fifo.yaml")
    for recipe in (tmp_path / "fifo.yaml", tmp_path):
        rc = main(["extract", "--config", str(recipe), "--output-dir", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert rc == 2 and "is not a regular file" in the_error_line(err), err


def test_an_unusable_datasets_cache_is_named_not_the_dataset(tmp_path, model4, small_chat_path, monkeypatch):
    """HF_DATASETS_CACHE (or HF_HOME) naming a file: 'no file or folder <the dataset>' (which exists) or a raw
    FileExistsError; now the cache is named."""
    import datasets

    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", afile / "datasets")
    rc, _, err = hsx_main(fault_argv(model4.path, small_chat_path, tmp_path / "o"))
    line = the_error_line(err)
    assert rc == 1 and f"datasets' cache {afile / 'datasets'} cannot be used" in line, line


def test_an_output_dir_or_dest_that_cannot_be_made_is_one_line(tmp_path, finished, model4, small_chat_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    rc, _, err = hsx_main(fault_argv(model4.path, small_chat_path, afile / "out"))
    assert rc == 1 and "cannot create" in the_error_line(err)
    rc, _, err = hsx_main(["merge", str(afile / "merged"), str(finished)])
    assert rc == 1 and "cannot create" in the_error_line(err)
    rc, _, err = hsx_main(["export-specforge", "--layout", "dflash", str(finished), str(afile / "dest")])
    assert rc == 1 and "cannot create" in the_error_line(err)
    assert afile.read_text() == ""


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
                         timeout=120, cwd=ROOT)
    assert res.returncode == 143, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr
    assert [line for line in res.stderr.splitlines() if line.startswith("hsx: ")] == [
        "hsx: interrupted; finished units are kept: run the same command to continue"]


def test_vocab_writes_through_no_planted_link_and_replaces_no_foreign_file(finished, tmp_path):
    """`hsx vocab --dest D` opened D/.NAME.tmp with open(): a link planted there had its target overwritten; a
    foreign d2t-K.npy in D was replaced without a word."""
    from hsx.vocab import write_draft_vocab

    dest = tmp_path / "dest"
    dest.mkdir()
    target = tmp_path / "target"
    target.write_text("SECRET")
    os.symlink(target, dest / ".t2d-8.npy.tmp")
    write_draft_vocab(finished, 8, dest, log=quiet)
    assert target.read_text() == "SECRET" and (dest / "t2d-8.npy").is_file()
    write_draft_vocab(finished, 8, dest, log=quiet)  # the same mapping again: fine
    (dest / "d2t-16.npy").write_text("FOREIGN")
    with pytest.raises(ValueError, match="is not this mapping"):
        write_draft_vocab(finished, 16, dest, log=quiet)
    assert (dest / "d2t-16.npy").read_text() == "FOREIGN"


def test_a_json_path_that_cannot_be_written_is_one_line(tmp_path, model4):
    """`hsx plan --json` into a folder or under a missing parent was an OSError traceback."""
    for dest in (tmp_path, tmp_path / "missing" / "plan.json"):
        rc, _, err = hsx_main(["plan", "--model", str(model4.path), "--layers", "1", "--json", str(dest)])
        assert rc == 1 and "cannot write --json" in the_error_line(err), err


def test_one_launched_process_killed_by_a_signal_is_named(monkeypatch, capsys):
    """`hsx launch --num_processes 1` whose process was SIGKILLed (the OOM killer) exited 137 without a word."""
    import accelerate.commands.launch as accelerate_launch
    import accelerate.utils

    from hsx import launch

    cmd = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    monkeypatch.setattr(accelerate.utils, "prepare_simple_launcher_cmd_env", lambda args: (cmd, dict(os.environ)))
    with launch._one_process_forwarding() as status:
        accelerate_launch.simple_launcher(None)
    assert status == [137]
    assert the_error_line(capsys.readouterr().err) == (
        "hsx: error: the process was killed by SIGKILL; finished units are kept: run the same command to continue")


def test_exporting_a_running_or_foreign_dir_says_it_is_not_finished(tmp_path):
    """It said 'cannot read OUT/hsx.json: No such file or directory' (a running job's dir, or a model folder)."""
    (tmp_path / "running" / ".hsx").mkdir(parents=True)
    with pytest.raises(ValueError, match="is not a finished hsx output \\(no hsx.json\\)"):
        export_specforge(tmp_path / "running", tmp_path / "dest", layout="dflash", log=quiet)
    assert not (tmp_path / "dest").exists()


def test_a_recipe_path_starting_with_tilde_is_under_home(tmp_path, monkeypatch):
    """`output_dir: ~/out` in a recipe wrote into a folder literally named `~` in the working directory."""
    from hsx.config import load_config

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("output_dir: ~/out\nmodel: ~/models/m\ndataset: d.jsonl\nlayers: [1]\n")
    cfg = load_config(str(recipe), {})
    assert cfg.output_dir == str(tmp_path / "home" / "out") and cfg.model == str(tmp_path / "home" / "models" / "m")


def test_verify_of_an_output_a_trainer_consumed_says_so(out):
    """A unit hsx.follow deleted once consumed (delete_consumed) was 'in the manifest but missing' to verify,
    while hsx.load said what happened."""
    rec = json.loads(sorted((out / ".hsx").glob("manifest-*.jsonl"))[0].read_text().splitlines()[0])
    (out / ".hsx" / "consumed-trainer.jsonl").write_text(json.dumps(
        {"unit": rec["unit"], "file": rec["file"], "bytes": rec["bytes"], "rows": rec["rows"], "row": rec["rows"],
         "crc32": rec.get("crc32")}) + "\n")
    (out / "data" / rec["file"]).unlink()
    rc, _, err = hsx_main(["verify", str(out), "--samples", "0"])
    line = the_error_line(err)
    assert rc == 1 and "deleted once a trainer consumed them" in line and "missing" not in line, line
