"""A resume (the same command again) keeps only what checks out: a damaged, missing or changed unit or hsx.json is
redone or written again, partial units of ranks this run lacks are cleared; and a resume that computes otherwise
(packing, compile, kernels, on any rank of an earlier run) says so in one notice and hsx.json records every value."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import (assert_same_output, copy_of, drop_manifest_line, edit_info, fault_argv, finished_argv,
                     flip_unit_bytes, hsx_main, message_lines, quiet, the_error_line)

import hsx
from hsx.config import HsxError
from hsx.sink import OutputDir


# ---- a resume keeps only what checks out and redoes the rest -------------------------------------------------------

@pytest.mark.parametrize("damage", ["flipped", "deleted", "truncated", "flipped-no-hsx-json"])
def test_rerun_on_a_damaged_finished_dir_redoes_the_damaged_unit(fault_reference, tmp_path, damage):
    out = copy_of(fault_reference.out, tmp_path, "out")
    name = sorted((out / "data").glob("*.arrow"))[7].name
    f = out / "data" / name
    if damage.startswith("flipped"):
        flip_unit_bytes(f)
    elif damage == "deleted":
        f.unlink()
    else:
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size - 10)
    if damage.endswith("no-hsx-json"):
        (out / "hsx.json").unlink()
    rc, stdout, err = hsx_main(fault_reference.argv(out))
    assert rc == 0, err
    assert "already complete" not in stdout
    assert name in stdout + err and "redone" in stdout + err
    assert_same_output(out, fault_reference.out)
    assert hsx.load(str(out), verify=True).num_rows == 96
    if damage.startswith("flipped"):
        assert (out / ".hsx" / "damaged" / name).exists()  # moved aside, not deleted


def test_check_crc_checks_the_units_of_earlier_runs_too(fault_reference, tmp_path):
    out = copy_of(fault_reference.out, tmp_path, "out")
    manifest = out / ".hsx" / "manifest-00000.jsonl"
    recs = [json.loads(x) for x in manifest.read_text().splitlines()]
    for k, r in enumerate(recs):  # the first 10 units from an earlier run, the rest from the last one
        r["session"] = "earlier" if k < 10 else "last"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in recs))
    flip_unit_bytes(out / "data" / recs[3]["file"])
    with pytest.raises(HsxError, match=r"run the same `hsx extract` command with --check-crc to redo them"):
        hsx.load(str(out), verify=True)  # the advice is the command that repairs it, below
    rc, stdout, err = hsx_main(fault_reference.argv(out))
    assert rc == 0 and "already complete" in stdout  # an earlier run's unit: only its size is checked
    rc, stdout, err = hsx_main(fault_reference.argv(out, "--check-crc"))
    assert rc == 0, err
    assert recs[3]["file"] in stdout + err and "already complete" not in stdout
    assert_same_output(out, fault_reference.out)


@pytest.mark.slow
def test_the_same_command_writes_a_changed_hsx_json_again(fault_reference, tmp_path):
    out = copy_of(fault_reference.out, tmp_path, "out")
    info = json.loads((out / "hsx.json").read_text())
    edit_info(out, files=info["files"][:5])
    with pytest.raises(HsxError, match="run the same `hsx extract` command: it writes hsx.json again"):
        hsx.load(str(out))
    shutil.copy(out / "data" / info["files"][0]["file"], out / "data" / "cache-0123456789abcdef.arrow")  # (older hsx)
    rc, stdout, err = hsx_main(fault_reference.argv(out))
    assert rc == 0, err
    assert "hsx.json is written again from the manifests" in stdout + err
    assert json.loads((out / "hsx.json").read_text())["files"] == info["files"]
    assert len(hsx.load(str(out))) == 96


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


def test_a_resume_clears_partial_units_of_ranks_this_run_does_not_have(finished_copy):
    """A job killed on 8 ranks and resumed on 1 left .hsx/tmp/rank-00007/ behind: never committed, never cleared
    (each rank cleared only its own), and counted by --max-pending-gb's window for ever."""
    from hsx.follow import pending_bytes
    from hsx.schema import JobRecord
    from hsx.files import read_json

    drop_manifest_line(finished_copy)  # (a resume, not a finished dir)
    stale = finished_copy / ".hsx" / "tmp" / "rank-00007" / "train-zzz-00000.arrow"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x" * 1000)
    before = pending_bytes(OutputDir(finished_copy))
    job = read_json(finished_copy / ".hsx" / "job.json", JobRecord).to_dict()
    assert OutputDir(finished_copy).start_or_resume(job, False, log=quiet, check=True) == "resume"
    assert not stale.exists() and pending_bytes(OutputDir(finished_copy)) == before - 1000


# ---- a resume that computes otherwise (packing, compile, kernels): said, and recorded in hsx.json ------------------

def _resume(finished_copy: Path, model4, small_chat_path, *extra: str) -> tuple[dict, list[str]]:
    """Delete one unit of the finished `out` and run the job again (it redoes that unit) with `extra` flags."""
    next((finished_copy / "data").glob("train-*.arrow")).unlink()
    rc, stdout, err = hsx_main(fault_argv(model4.path, small_chat_path, finished_copy, "--unit-tokens", "200", *extra))
    assert rc == 0, err
    notices = [line for line in message_lines(stdout + "\n" + err) if line.startswith("hsx: notice:")]
    return json.loads((finished_copy / "hsx.json").read_text()), notices


def test_a_resume_with_other_packing_says_so_and_hsx_json_lists_every_value(finished_copy, model4, small_chat_path):
    """compile, sdpa_backend, packing and the kernels are outside the fingerprint (a resume may change them), and
    hsx.json's run kept only the last run's: an output of units packed and units padded said `packing varlen`.
    The resume says in one notice which key differs, and run.values_used lists every value its units ran with."""
    first = json.loads((finished_copy / "hsx.json").read_text())["run"]
    assert first["packing"] == "none" and first["values_used"]["packing"] == ["none"]
    info, notices = _resume(finished_copy, model4, small_chat_path, "--packing", "varlen")
    assert len(notices) == 1 and "packing varlen" in notices[0] and "packing none" in notices[0], notices
    assert "compile" not in notices[0]
    assert info["run"]["packing"] == "varlen"  # (the last run's, as readers always read it)
    assert info["run"]["values_used"]["packing"] == ["none", "varlen"]
    assert info["run"]["values_used"]["compile"] == [False]
    rc, _, err = hsx_main(["verify", str(finished_copy), "--samples", "0"])
    assert rc == 0, err
    hsx.load(str(finished_copy))


def test_a_resume_with_the_same_settings_says_nothing_and_lists_one_value(finished_copy, model4, small_chat_path):
    info, notices = _resume(finished_copy, model4, small_chat_path)
    assert notices == [] and info["run"]["values_used"]["packing"] == ["none"]


def test_units_of_an_hsx_that_kept_no_run_ledger_are_compared_with_hsx_json(finished_copy, model4, small_chat_path):
    """Units written before the run ledger: hsx.json's run (the last run's values) is what they ran with."""
    for ledger in (finished_copy / ".hsx").glob("runs-*.jsonl"):
        ledger.unlink()
    info = json.loads((finished_copy / "hsx.json").read_text())
    del info["run"]["values_used"]
    (finished_copy / "hsx.json").write_text(json.dumps(info))
    info, notices = _resume(finished_copy, model4, small_chat_path, "--packing", "varlen")
    assert len(notices) == 1 and "packing none" in notices[0], notices
    assert info["run"]["values_used"]["packing"] == ["none", "varlen"]


def test_a_damaged_run_ledger_is_one_line(finished_copy, model4, small_chat_path):
    (finished_copy / ".hsx" / "runs-00000.jsonl").write_text(json.dumps({"session": "x", "packing": ["a"] * 3}) + "\n")
    next((finished_copy / "data").glob("train-*.arrow")).unlink()
    rc, _, err = hsx_main(finished_argv(model4, small_chat_path, finished_copy))
    line = the_error_line(err)
    assert rc != 0 and "runs-00000.jsonl: line 1 is damaged: packing must be" in line, line


def test_a_resume_names_a_rank_of_an_earlier_run_that_computed_with_other_flags(finished, tmp_path, model4,
                                                                              small_chat_path):
    """The notice said only that this run's values were new to the dir: an earlier run whose rank 1 packed its
    units (rank 0 padded) and a resume that pads said nothing, though the output mixes both. Every rank's ledger
    counts, and the rank that computed otherwise is named."""
    out = copy_of(finished, tmp_path)
    state = out / ".hsx"
    manifest = state / "manifest-00000.jsonl"
    lines = manifest.read_text().splitlines()
    assert len(lines) >= 3
    moved = json.loads(lines[-1])  # (rank 1 committed this unit, with packing varlen)
    manifest.write_text("\n".join(lines[:-1]) + "\n")
    (state / "manifest-00001.jsonl").write_text(json.dumps({**moved, "session": "rank1run"}) + "\n")
    ours = json.loads((state / "runs-00000.jsonl").read_text().splitlines()[-1])
    (state / "runs-00001.jsonl").write_text(json.dumps({**ours, "session": "rank1run", "packing": "varlen"}) + "\n")
    redo = json.loads(lines[0])["file"]
    (out / "data" / redo).unlink()
    rc, stdout, err = hsx_main(finished_argv(model4, small_chat_path, out))
    assert rc == 0, err
    notices = [line for line in message_lines(stdout + "\n" + err) if line.startswith("hsx: notice:")]
    assert len(notices) == 1, notices
    assert "this run computes with packing none" in notices[0] and "packing varlen (rank 1)" in notices[0], notices
    assert "rank 0" not in notices[0] and "compile" not in notices[0]
    info = json.loads((out / "hsx.json").read_text())
    assert info["run"]["values_used"]["packing"] == ["none", "varlen"]


def test_the_notice_names_ranks_and_older_units_in_a_bounded_line():
    from hsx.job import _named

    assert _named(["rank 1"]) == "rank 1"
    assert _named([f"rank {i}" for i in range(20)] + ["hsx.json"]) == (
        "ranks 0, 1, 2, 3, 4, 5, 6, 7 and 12 more; as hsx.json records")
