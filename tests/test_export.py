"""The exports (hsx.export): the journal read a line at a time and bounded, never a reason to delete a source unit;
files an export does not own left alone; and every reader of an output an export used up says where its rows went."""

from __future__ import annotations

import json
import os

import pytest

from helpers import LONG_DIGITS, call_with_deadline, hsx_main, quiet, the_error_line
from test_hub import REPO, FakeHfApi

import hsx
from hsx.config import HsxError
from hsx.export import export_specforge
from hsx.export_journal import JOURNAL
from hsx.hub import push_output


# ---- the journal: read a line at a time, bounded, never a reason to delete -----------------------------------------

def test_an_export_journal_alone_never_deletes_a_source_unit(finished_copy, tmp_path):
    """A `released` line in DEST's journal (forged, or from a kill) deletes nothing: a plain export keeps every
    source unit, and a unit still on disk is exported again rather than taken as done."""
    dest = tmp_path / "dest"
    export_specforge(finished_copy, dest, layout="dflash", log=quiet)
    token = json.loads((dest / "hsx-export.json").read_text())["token"]
    units = sorted(p.name for p in (finished_copy / "data").glob("train-*.arrow"))
    with open(dest / "hsx-export.jsonl", "a") as f:
        f.write(json.dumps({"token": token, "released": units[1]}) + "\n")
    export_specforge(finished_copy, dest, layout="dflash", log=quiet)
    assert sorted(p.name for p in (finished_copy / "data").glob("train-*.arrow")) == units
    (finished_copy / "data" / units[1]).unlink()  # and gone: a plain export cannot have released it
    with pytest.raises(ValueError, match="journal is damaged"):
        export_specforge(finished_copy, dest, layout="dflash", log=quiet)


def test_an_export_journal_line_with_a_number_too_long_is_not_a_traceback(finished_copy, tmp_path):
    dest = tmp_path / "dest"
    export_specforge(finished_copy, dest, layout="dflash")
    with open(dest / JOURNAL, "a") as f:
        f.write(f'{{"token": "x", "n": {LONG_DIGITS}}}\n')
    export_specforge(finished_copy, dest, layout="dflash")  # a resume: that line is passed over, as a torn one


def test_a_huge_export_journal_is_refused_not_read_whole(finished_copy, tmp_path, monkeypatch):
    import hsx.export_journal
    dest = tmp_path / "dest"
    export_specforge(finished_copy, dest, layout="dflash")
    limit = (dest / JOURNAL).stat().st_size + 100
    monkeypatch.setattr(hsx.export_journal, "MAX_JOURNAL_BYTES", limit)
    with open(dest / JOURNAL, "a") as f:
        f.write("\n" * limit)  # (a sparse 100 GB file read whole took the machine's memory)
    with pytest.raises(HsxError, match=f"{JOURNAL} is damaged: .* more than hsx writes"):
        export_specforge(finished_copy, dest, layout="dflash")


def test_an_export_journal_line_longer_than_any_hsx_writes_is_refused_naming_it(finished_copy, tmp_path, monkeypatch):
    """The journal was read whole (up to 1 GiB) and split into lines; it is read a line at a time as the ledgers
    are, each line bounded (hsx.schema: a unit's files at most), so a line past that is one error naming the line."""
    import hsx.export_journal
    dest = tmp_path / "dest"
    export_specforge(finished_copy, dest, layout="dflash")
    journal = dest / JOURNAL
    token = json.loads(journal.read_text().splitlines()[0])["token"]
    longest = max(len(line) for line in journal.read_bytes().splitlines(keepends=True))
    monkeypatch.setattr(hsx.export_journal, "MAX_JOURNAL_LINE_BYTES", longest + 10)
    export_specforge(finished_copy, dest, layout="dflash")  # (every line hsx wrote is within the bound: a resume)
    with open(journal, "a") as f:
        f.write(json.dumps({"token": token, "unit": "x", "skipped": 0, "files": {"a" * (longest + 10): [1, "0"]}})
                + "\n")
    number = len(journal.read_text().splitlines())
    with pytest.raises(HsxError, match=f"{JOURNAL}: line {number} is damaged: over {longest + 10:,} bytes"):
        export_specforge(finished_copy, dest, layout="dflash")


def test_the_journal_bounds_follow_from_the_counts():
    from hsx import schema

    assert schema.MAX_JOURNAL_LINE_BYTES >= schema.MAX_EXPORT_FILES_PER_UNIT * schema.EXPORT_FILE_ENTRY_BYTES
    assert schema.MAX_JOURNAL_BYTES >= schema.MAX_EXPORT_FILES * schema.EXPORT_FILE_ENTRY_BYTES
    entry = json.dumps({"hidden_states/hs_123456789.safetensors": [123456789012, "89abcdef:01234567"]})
    assert len(entry) < schema.EXPORT_FILE_ENTRY_BYTES


# ---- what an export may and may not touch --------------------------------------------------------------------------

def test_an_exported_file_that_became_a_folder_is_named_as_such(finished_copy, tmp_path):
    dest = tmp_path / "dest"
    export_specforge(finished_copy, dest, layout="dflash", log=quiet)
    ckpt = sorted(dest.glob("rows_*/data_*.ckpt"))[0]
    ckpt.unlink()
    ckpt.mkdir()
    with pytest.raises(ValueError) as e:
        export_specforge(finished_copy, dest, layout="dflash", log=quiet)
    assert "not the file this export wrote" in str(e.value) and "folder" in str(e.value)
    assert "not in hsx-export.json" not in str(e.value)
    assert ckpt.is_dir()  # nothing deleted


def test_exporting_a_running_or_foreign_dir_says_it_is_not_finished(tmp_path):
    """It said 'cannot read OUT/hsx.json: No such file or directory' (a running job's dir, or a model folder)."""
    (tmp_path / "running" / ".hsx").mkdir(parents=True)
    with pytest.raises(ValueError, match="is not a finished hsx output \\(no hsx.json\\)"):
        export_specforge(tmp_path / "running", tmp_path / "dest", layout="dflash", log=quiet)
    assert not (tmp_path / "dest").exists()


def test_a_fifo_at_exported_jsonl_does_not_hang_an_export_that_deletes_its_source(finished_copy, tmp_path):
    fifo = finished_copy / ".hsx" / "exported.jsonl"
    os.mkfifo(fifo)
    units = sorted((finished_copy / "data").glob("train-*.arrow"))
    done, error = call_with_deadline(
        lambda: export_specforge(finished_copy, tmp_path / "dest", layout="dflash", delete_source=True), 60, fifo)
    assert done and isinstance(error, HsxError) and "exported.jsonl is not a regular file" in str(error), error
    assert all(u.is_file() for u in units)  # no unit deleted without its record


# ---- an output an export used up says where its rows went ----------------------------------------------------------

def test_load_of_an_output_an_export_used_up_says_where_its_rows_went(finished_copy, tmp_path):
    dest = tmp_path / "moved"
    export_specforge(finished_copy, dest, layout="dflash", delete_source=True, log=quiet)
    assert not list((finished_copy / "data").glob("train-*.arrow"))
    with pytest.raises(HsxError) as e:
        hsx.load(finished_copy)
    msg = str(e.value)
    assert "\n" not in msg and "export-specforge --delete-source" in msg and str(dest.resolve()) in msg
    assert "damaged" not in msg


def test_verify_and_push_of_a_used_up_output_say_where_its_rows_went(finished_copy, tmp_path):
    """They said 'in the manifest but missing' (verify) and pushed nothing useful; hsx.load said where."""
    dest = tmp_path / "moved"
    export_specforge(finished_copy, dest, layout="dflash", delete_source=True, log=quiet)
    rc, _, err = hsx_main(["verify", str(finished_copy), "--samples", "0"])
    line = the_error_line(err)
    assert rc == 1 and "export-specforge --delete-source" in line and str(dest.resolve()) in line, line
    assert "missing" not in line
    api = FakeHfApi()
    with pytest.raises(HsxError, match="exported and then deleted") as e:
        push_output(finished_copy, REPO, api=api, log=quiet)
    assert "\n" not in str(e.value) and str(dest.resolve()) in str(e.value)
    assert REPO not in api.repos  # refused before the repo was made


def test_a_forged_exported_ledger_prints_no_second_line(finished_copy, tmp_path):
    dest = tmp_path / "moved"
    export_specforge(finished_copy, dest, layout="dflash", delete_source=True, log=quiet)
    ledger = finished_copy / ".hsx" / "exported.jsonl"
    lines = [json.loads(x) for x in ledger.read_text().splitlines()]
    ledger.write_text("".join(json.dumps({**r, "dest": "/x\nhsx: all good"}) + "\n" for r in lines))
    with pytest.raises(HsxError) as e:
        hsx.load(finished_copy)
    assert "\n" not in str(e.value) and "exported and then deleted" in str(e.value)


def test_an_export_suggests_layers_the_model_has_and_a_wrong_layer_argument_exits_2(tmp_path, model4,
                                                                                    small_chat_path, finished):
    """export-speculators on an output without the last decoder layer suggested `--layers 1 17 32 -1` (a 36-layer
    model's) whatever the model: the demo's extract then refused layer 17 with exit 1. The suggestion is the
    output's own layers plus -1, which its model has; a layer the model lacks, or one an export cannot find stored,
    is a wrong argument: exit 2."""
    import re

    from helpers import assert_one_error_line, fault_argv

    out = tmp_path / "out"
    argv = fault_argv(model4.path, small_chat_path, out)
    argv[argv.index("--layers") + 1: argv.index("--layers") + 3] = ["0", "1"]  # not layer 3, the last of 4
    rc, _, err = hsx_main(argv)
    assert rc == 0, err
    rc, _, err = hsx_main(["export-speculators", str(out), str(tmp_path / "dest")])
    line = assert_one_error_line(rc, err, "verifier state")
    suggested = re.search(r"--layers ([-0-9 ]+)\)", line).group(1).split()
    assert suggested == ["0", "1", "-1"], line
    again = list(argv)
    again[again.index("--layers") + 1: again.index("--layers") + 3] = suggested
    again[again.index("--output-dir") + 1] = str(tmp_path / "again")
    rc, _, err = hsx_main(again)  # the suggestion runs on this model
    assert rc == 0, err
    rc, _, err = hsx_main(["export-speculators", str(tmp_path / "again"), str(tmp_path / "dest")])
    assert rc == 0, err
    bad = list(argv)
    bad[bad.index("--layers") + 1: bad.index("--layers") + 3] = ["1", "17"]
    rc, _, err = hsx_main(bad)
    assert_one_error_line(rc, err, "out of range for a model with 4 layers")
    assert rc == 2
    for command in (["export-speculators", str(finished), str(tmp_path / "d1"), "--layers", "2"],
                    ["export-specforge", str(finished), str(tmp_path / "d2"), "--layout", "dflash", "--layers", "2"]):
        rc, _, err = hsx_main(command)
        assert_one_error_line(rc, err, "layer 2 is not in this output")
        assert rc == 2
