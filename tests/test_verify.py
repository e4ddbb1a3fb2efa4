"""`hsx verify`: never runs code because of what an output dir says (trust only from the command line, --model the
reference), and checks the job record (max_length, the model's commit) before any row is recomputed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import assert_one_error_line, hsx_main, the_error_line


# ---- no code runs because of what an output dir says ---------------------------------------------------------------

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
def test_verify_never_runs_code_an_output_dir_names(finished_copy, evil_model, trust):
    folder, marker = evil_model
    _point_at(finished_copy, folder, trust)
    rc, _, err = hsx_main(["verify", str(finished_copy), "--samples", "2"])
    assert not marker.exists(), "verify ran code from a model folder that hsx.json named"
    if trust is not False:
        assert_one_error_line(rc, err, "--trust-remote-code", prefix="hsx: verify failed: ")
    else:  # recomputed with the recorded folder, its code not run (transformers' own Qwen3 class)
        assert rc == 0, err


def test_verify_trust_remote_code_needs_a_model_named_on_the_command_line(finished_copy, evil_model):
    folder, marker = evil_model
    _point_at(finished_copy, folder, True)
    rc, _, err = hsx_main(["verify", str(finished_copy), "--samples", "2", "--trust-remote-code"])
    assert_one_error_line(rc, err, "--model", prefix="hsx: error: ")
    assert not marker.exists()


def test_verify_with_model_flag_recomputes_against_it(finished_copy, evil_model, model4):
    folder, marker = evil_model
    _point_at(finished_copy, folder, True)  # the recorded folder is ignored: --model is the reference
    rc, stdout, err = hsx_main(["verify", str(finished_copy), "--samples", "2", "--model", str(model4.path)])
    assert rc == 0, err
    assert "2 rows recomputed" in stdout
    assert not marker.exists()


def test_verify_with_a_model_of_another_depth_is_one_line(finished_copy, model8):
    rc, _, err = hsx_main(["verify", str(finished_copy), "--samples", "2", "--model", str(model8.path)])
    assert_one_error_line(rc, err, "8 layers", prefix="hsx: verify failed: ")


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
        line = the_error_line(err)
        assert rc != 0 and needle in line, (path, line)
        assert not marker.exists()
    rc, _, err = hsx_main(["verify", str(out), "--against-bf16", "2", "--model", "someone/model"])  # (offline)
    line = the_error_line(err)
    assert rc != 0 and "not an FP8 checkpoint" in line, line  # (the record decides first: nothing is fetched)


# ---- what the job record says is checked before any row is recomputed ----------------------------------------------

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
    line = the_error_line(err)
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
        line = the_error_line(err)
        assert rc != 0 and needle in line and "job.json" in line, line


def test_against_bf16_takes_only_a_commit_as_a_hub_models_revision(finished, tmp_path, model4):
    """hsx records a Hub model's commit (its snapshot folder's name, 40 hex digits) with its id; a record naming a
    branch or tag ("main") let any folder named `main` pass as that model's snapshot."""
    out = Path(shutil.copytree(finished, tmp_path / "out"))
    folder = Path(shutil.copytree(model4.path, tmp_path / "snap" / "main"))
    info = json.loads((out / "hsx.json").read_text())
    info["model_path"] = str(folder)
    (out / "hsx.json").write_text(json.dumps(info))
    job = json.loads((out / ".hsx" / "job.json").read_text())
    job["inputs"].update(model="someone/model", revision="main")
    (out / ".hsx" / "job.json").write_text(json.dumps(job))
    rc, _, err = hsx_main(["verify", str(out), "--against-bf16", "2"])
    line = the_error_line(err)
    assert rc != 0 and "job.json" in line and "40-digit hex" in line and "'main'" in line, line


def test_verify_of_an_output_a_trainer_consumed_says_so(finished_copy):
    """A unit hsx.follow deleted once consumed (delete_consumed) was 'in the manifest but missing' to verify,
    while hsx.load said what happened."""
    rec = json.loads(sorted((finished_copy / ".hsx").glob("manifest-*.jsonl"))[0].read_text().splitlines()[0])
    (finished_copy / ".hsx" / "consumed-trainer.jsonl").write_text(json.dumps(
        {"unit": rec["unit"], "file": rec["file"], "bytes": rec["bytes"], "rows": rec["rows"], "row": rec["rows"],
         "crc32": rec.get("crc32")}) + "\n")
    (finished_copy / "data" / rec["file"]).unlink()
    rc, _, err = hsx_main(["verify", str(finished_copy), "--samples", "0"])
    line = the_error_line(err)
    assert rc == 1 and "deleted once a trainer consumed them" in line and "missing" not in line, line
