"""A sixth held-out round on the newest surfaces: `hsx launch`'s accelerate config files, hsx.follow and
--max-pending-gb (forged, torn, huge, FIFO and linked ledgers), the resume's removal of a killed commit's leftover
unit, `hsx merge`, the exports and their journals, and numbers too long for Python's int() in any file hsx reads
(JSON or YAML: a ValueError that is not a JSONDecodeError)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import chat_tokenize_peak, fault_argv, hsx_main, the_error_line

import hsx
from hsx.config import HsxError
from hsx.sink import OutputDir

LONG = "1" * 5000  # past Python's 4300-digit limit for int(str): json.loads and yaml raise a bare ValueError


def quiet(*a, **k):
    pass


@pytest.fixture(scope="module")
def finished(tmp_path_factory, model4, small_chat_path) -> Path:
    out = tmp_path_factory.mktemp("round6") / "finished"
    rc, _, err = hsx_main(fault_argv(model4.path, small_chat_path, out, "--unit-tokens", "200"))
    assert rc == 0, err
    assert len(list((out / "data").glob("train-*.arrow"))) >= 3
    return out


@pytest.fixture
def out(finished, tmp_path) -> Path:
    return Path(shutil.copytree(finished, tmp_path / "out", symlinks=True))


# ---- numbers too long for int() ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text,needle", [
    (f"num_processes: {LONG}\n", "accelerate config file"),
    ("num_processes: 1\nwhen: 2001-13-45\n", "accelerate config file"),  # a date YAML reads, that is no date
    (f'{{"num_processes": {LONG}}}\n', "accelerate config file"),
])
def test_launch_config_with_a_value_yaml_cannot_build_is_one_line(tmp_path, text, needle, capsys):
    from hsx.cli import main

    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    rc = main(["launch", "--config_file", str(path), "extract", "--config", "recipes/demo.yaml",
               "--output-dir", str(tmp_path / "o")])
    line = the_error_line(capsys.readouterr().err)
    assert rc == 2 and needle in line and str(path) in line, line
    assert not (tmp_path / "o").exists()


def test_a_recipe_with_a_number_too_long_is_one_line(tmp_path, capsys):
    from hsx.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"layers: [1]\nlimit: {LONG}\n")
    rc = main(["extract", "--config", str(recipe), "--model", "m", "--dataset", "d", "--output-dir",
               str(tmp_path / "o")])
    line = the_error_line(capsys.readouterr().err)
    assert rc == 2 and str(recipe) in line, line
    rc = main(["extract", "--model", "m", "--dataset", "d", "--layers", "1", "--output-dir", str(tmp_path / "o"),
               "--chat-template-kwargs", f'{{"x": {LONG}}}'])
    line = the_error_line(capsys.readouterr().err)
    assert rc == 2 and "chat_template_kwargs" in line, line


@pytest.mark.parametrize("where", ["hsx.json", "summary"])
def test_a_number_too_long_in_what_hsx_wrote_is_one_line(out, model4, small_chat_path, where):
    """hsx.json, .hsx/summary.json: json.loads raised a ValueError no reader caught."""
    if where == "hsx.json":
        target = out / "hsx.json"
        target.write_text(target.read_text().replace('"complete": true', f'"complete": true, "x": {LONG}', 1))
        argv = ["verify", str(out)]
    else:
        target = out / ".hsx" / "summary.json"
        target.write_text(target.read_text().replace("{", f'{{"x": {LONG}, ', 1))
        argv = fault_argv(model4.path, small_chat_path, out, "--unit-tokens", "200")  # the same job: a resume
    rc, _, err = hsx_main(argv)
    line = the_error_line(err)
    assert rc != 0 and "damaged" in line and target.name in line, line


def test_a_ledger_line_with_a_number_too_long_is_passed_over_as_a_torn_one(out):
    """(A torn line's unit is redone, uploaded again or read again: never a loss.)"""
    manifest = next((out / ".hsx").glob("manifest-*.jsonl"))
    with open(manifest, "a") as f:
        f.write(f'{{"unit": "zz", "bytes": {LONG}}}\n')
    (out / ".hsx" / "uploaded-push.jsonl").write_text(f'{{"file": "data/x.arrow", "bytes": {LONG}}}\n')
    o = OutputDir(out)
    assert o.uploaded() == {} and "zz" not in o.manifest_records() and len(o.done_units()) >= 3


def test_follow_and_the_window_read_a_ledger_line_with_a_number_too_long_as_torn(out):
    from hsx.follow import pending_bytes

    before = pending_bytes(OutputDir(out))
    (out / ".hsx" / "consumed-trainer-00000.jsonl").write_text(f'{{"unit": "x", "n": {LONG}}}\n')
    assert pending_bytes(OutputDir(out)) == before  # (read as a torn line: nothing consumed)
    assert len(list(hsx.follow(out, rows="dict", commit="manual"))) == len(hsx.load(str(out)))


def test_an_export_journal_line_with_a_number_too_long_is_not_a_traceback(out, tmp_path):
    from hsx.export import JOURNAL, export_specforge

    dest = tmp_path / "dest"
    export_specforge(out, dest, layout="dflash")
    with open(dest / JOURNAL, "a") as f:
        f.write(f'{{"token": "x", "n": {LONG}}}\n')
    export_specforge(out, dest, layout="dflash")  # a resume: that line is passed over, as a torn one


# ---- hsx.follow: ledgers ----------------------------------------------------------------------------------------

def test_follow_deletes_no_unit_a_ledger_of_other_bytes_says_was_consumed(out):
    """A ledger line for a unit with other bytes or CRC-32 than the manifest's (another job's ledger left in the
    dir, a forged one) made follow(delete_consumed=True) skip that unit and delete it unread."""
    records = OutputDir(out).manifest_records()
    victim = sorted(records.values(), key=lambda r: r["unit"])[0]
    forged = {**victim, "row": victim["rows"], "crc32": "00000000"}
    forged = {k: forged[k] for k in ("unit", "file", "bytes", "rows", "row", "crc32")}
    (out / ".hsx" / "consumed-trainer-00000.jsonl").write_text(json.dumps(forged) + "\n")
    rows = list(hsx.follow(out, rows="dict", delete_consumed=True))
    assert sum(r["rows"] for r in records.values()) == len(rows)  # the victim's rows were handed out too
    assert OutputDir(out).done_units().keys() == records.keys()


def test_follow_refuses_a_ledger_that_is_a_link_or_a_fifo_before_appending(out, tmp_path):
    outside = tmp_path / "outside.jsonl"
    outside.write_text("")
    ledger = out / ".hsx" / "consumed-trainer-00000.jsonl"
    ledger.symlink_to(outside)
    with pytest.raises(HsxError, match="symbolic link"):
        list(hsx.follow(out, rows="dict"))
    assert outside.read_text() == ""
    ledger.unlink()
    os.mkfifo(ledger)
    with pytest.raises(HsxError, match="not a regular file"):
        hsx.follow(out, rows="dict")


def test_the_window_of_a_job_is_not_hung_by_a_fifo_ledger(out):
    from hsx.follow import pending_bytes

    os.mkfifo(out / ".hsx" / "consumed-trainer-00000.jsonl")
    with pytest.raises(HsxError, match="not a regular file"):
        pending_bytes(OutputDir(out))


# ---- the resume's removal of a killed commit's leftover ---------------------------------------------------------

def _drop_manifest_line(out: Path, unit: str) -> None:
    manifest = next((out / ".hsx").glob("manifest-*.jsonl"))
    lines = manifest.read_text().splitlines(keepends=True)
    manifest.write_text("".join(ln for ln in lines if json.loads(ln)["unit"] != unit))


def test_remove_uncommitted_deletes_nothing_through_a_linked_data_dir(out, tmp_path):
    records = OutputDir(out).manifest_records()
    unit = sorted(records)[0]
    _drop_manifest_line(out, unit)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(out / "data", elsewhere)
    (out / "data").symlink_to(elsewhere)
    log: list[str] = []
    with pytest.raises(HsxError, match="data is a symbolic link or not a folder; hsx never deletes through links"):
        OutputDir(out)._remove_uncommitted([unit], log.append)
    assert (elsewhere / f"train-{unit}.arrow").is_file()
    assert not log


def test_follow_deletes_nothing_through_a_data_dir_swapped_for_a_link(out, tmp_path):
    """The links are checked when the reader starts; data/ moved elsewhere and linked while the trainer runs
    (days) made each deletion of a consumed unit go through the link."""
    f = hsx.follow(out, rows="dict", delete_consumed=True)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(out / "data", elsewhere)
    (out / "data").symlink_to(elsewhere)
    before = sorted(p.name for p in elsewhere.iterdir())
    with pytest.raises(HsxError, match="symbolic link"):
        list(f)
    assert sorted(p.name for p in elsewhere.iterdir()) == before


def test_remove_uncommitted_removes_only_the_name_of_a_hard_linked_unit(out, tmp_path):
    """A leftover that is a hard link (a `cp -al` snapshot of the dir): the snapshot's file stays whole."""
    records = OutputDir(out).manifest_records()
    unit = sorted(records)[0]
    _drop_manifest_line(out, unit)
    snapshot = tmp_path / "snapshot.arrow"
    os.link(out / "data" / f"train-{unit}.arrow", snapshot)
    size = snapshot.stat().st_size
    OutputDir(out)._remove_uncommitted([unit], quiet)
    assert not (out / "data" / f"train-{unit}.arrow").exists()
    assert snapshot.stat().st_size == size and snapshot.stat().st_nlink == 1


def test_remove_uncommitted_leaves_folders_fifos_and_links_alone(out, tmp_path):
    names = ["a-0", "b-0", "c-0"]
    (out / "data" / "train-a-0.arrow").mkdir()
    os.mkfifo(out / "data" / "train-b-0.arrow")
    (tmp_path / "t").write_text("x")
    (out / "data" / "train-c-0.arrow").symlink_to(tmp_path / "t")
    OutputDir(out)._remove_uncommitted(names, quiet)
    assert (out / "data" / "train-a-0.arrow").is_dir() and (tmp_path / "t").read_text() == "x"
    assert os.path.lexists(out / "data" / "train-b-0.arrow") and (out / "data" / "train-c-0.arrow").is_symlink()


def test_a_rows_tools_or_tool_arguments_with_a_number_too_long_is_not_json(tmp_path):
    """A dataset row's `tools` string or a tool call's `arguments` holding a 5000-digit number: taken as text
    (as any string that is not JSON), not a ValueError out of the tokenizing map."""
    from hsx.data import _parsed_arguments, row_tools

    assert row_tools(f'[{{"n": {LONG}}}]') is None
    call = {"function": {"name": "f", "arguments": f'{{"n": {LONG}}}'}}
    assert _parsed_arguments(call) == call


def test_the_window_counts_a_unit_whose_ledger_line_is_of_other_bytes(out):
    """A consumed line with another CRC-32 than the unit's manifest line is no consumption of that unit (as
    done_units and hsx.follow read it): the window still counts the unit as pending."""
    from hsx.follow import pending_bytes

    before = pending_bytes(OutputDir(out))
    rec = sorted(OutputDir(out).manifest_records().values(), key=lambda r: r["unit"])[0]
    line = {"unit": rec["unit"], "file": rec["file"], "bytes": rec["bytes"], "rows": rec["rows"],
            "row": rec["rows"], "crc32": "00000000"}
    (out / ".hsx" / "consumed-trainer-00000.jsonl").write_text(json.dumps(line) + "\n")
    assert pending_bytes(OutputDir(out)) == before
    line["crc32"] = rec["crc32"]
    (out / ".hsx" / "consumed-trainer-00000.jsonl").write_text(json.dumps(line) + "\n")
    assert pending_bytes(OutputDir(out)) == before - rec["bytes"]


def test_a_huge_export_journal_is_refused_not_read_whole(out, tmp_path, monkeypatch):
    import hsx.export
    from hsx.export import JOURNAL, export_specforge

    dest = tmp_path / "dest"
    export_specforge(out, dest, layout="dflash")
    limit = (dest / JOURNAL).stat().st_size + 100
    monkeypatch.setattr(hsx.export, "MAX_JOURNAL_BYTES", limit)
    with open(dest / JOURNAL, "a") as f:
        f.write("\n" * limit)  # (a sparse 100 GB file read whole took the machine's memory)
    with pytest.raises(HsxError, match=f"{JOURNAL} is damaged: .* more than hsx writes"):
        export_specforge(out, dest, layout="dflash")


# ---- hsx launch: options over several machines -------------------------------------------------------------------

@pytest.mark.parametrize("options,needle", [
    (["--num_machines", "2", "--machine_rank", "2", "--num_processes", "2"], "0 to 1"),
    (["--num_machines", "2", "--machine_rank", "-1", "--num_processes", "2"], "0 to 1"),
    (["--num_machines", "2", "--machine_rank", "0", "--num_processes", "3"], "multiple of 2"),
    (["--num_machines", "2", "--machine_rank", "0", "--num_processes", "1"], "multiple of 2"),
    (["--config_file", "{two}", "--num_processes", "2"], "0 to 1"),
])
def test_launch_refuses_a_machine_rank_or_process_count_the_machines_cannot_run(tmp_path, monkeypatch, capsys,
                                                                                  options, needle):
    """A --machine_rank outside --num_machines made torchrun wait for ever for its rendezvous; 3 processes over 2
    machines started 2 (accelerate gives each machine num_processes // num_machines), 1 over 2 started none."""
    import accelerate.commands.launch

    from hsx.cli import main

    started = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", started.append)
    (tmp_path / "two.yaml").write_text("num_machines: 2\nmachine_rank: 7\n")
    options = [o.format(two=tmp_path / "two.yaml") for o in options]
    rc = main(["launch", *options, "extract", "--config", "recipes/demo.yaml", "--output-dir", str(tmp_path / "o")])
    line = the_error_line(capsys.readouterr().err)
    assert rc == 2 and needle in line and not started, line
    rc = main(["launch", "--num_machines", "2", "--machine_rank", "1", "--num_processes", "2", "extract", "--config",
               "recipes/demo.yaml", "--output-dir", str(tmp_path / "o")])
    assert rc == 0 and len(started) == 1  # (the launch a good command line makes)


def test_follow_of_a_complete_job_that_will_never_commit_a_unit_says_so(out, tmp_path):
    """hsx.json complete, but a planned unit without a manifest line (or no plan at all: a dir copied without
    .hsx/): nothing will ever commit it, and the reader waited for ever (or until its timeout)."""
    copy = Path(shutil.copytree(out, tmp_path / "copy"))
    unit = sorted(OutputDir(out).manifest_records())[-1]
    _drop_manifest_line(out, unit)
    with pytest.raises(HsxError, match=f"complete, but 1 unit\\(s\\) of its plan have no manifest line "
                                       f"\\(train-{unit}.arrow\\)"):
        list(hsx.follow(out, rows="dict", commit="manual", timeout=30))
    shutil.rmtree(copy / ".hsx")
    with pytest.raises(HsxError, match="without its job's plan"):
        list(hsx.follow(copy, rows="dict", commit="manual", timeout=30))


# ---- FIFOs planted where hsx appends -----------------------------------------------------------------------------

def _finishes(fn, fifo: Path, seconds: float = 60.0):
    """fn() in a thread: (finished, its exception). A writer blocked opening `fifo` is released afterwards."""
    import threading

    got: list = []

    def run():
        try:
            fn()
            got.append(None)
        except BaseException as e:  # noqa: BLE001
            got.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():  # (the old code: blocked in open() until a reader comes)
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        t.join(10)
        os.close(fd)
        return False, None
    return True, got[0]


def test_a_fifo_planted_at_the_ledger_after_follow_started_is_refused_not_waited_on(out):
    f = hsx.follow(out, rows="dict", delete_consumed=True)  # (no ledger yet: nothing to check; it appends to one)
    ledger = out / ".hsx" / "consumed-trainer-00000.jsonl"
    os.mkfifo(ledger)
    done, error = _finishes(lambda: list(f), ledger)
    assert done and isinstance(error, HsxError) and "not a regular file" in str(error), error
    # a reader that deletes nothing reads the ledger (its resume point) and writes none: not held by the FIFO either
    done, error = _finishes(lambda: list(hsx.follow(out, rows="dict")), ledger)
    assert done and isinstance(error, HsxError) and "not a regular file" in str(error), error


def test_a_fifo_at_exported_jsonl_does_not_hang_an_export_that_deletes_its_source(out, tmp_path):
    from hsx.export import export_specforge

    fifo = out / ".hsx" / "exported.jsonl"
    os.mkfifo(fifo)
    units = sorted((out / "data").glob("train-*.arrow"))
    done, error = _finishes(lambda: export_specforge(out, tmp_path / "dest", layout="dflash", delete_source=True),
                            fifo)
    assert done and isinstance(error, HsxError) and "exported.jsonl is not a regular file" in str(error), error
    assert all(u.is_file() for u in units)  # no unit deleted without its record


def test_a_fifo_at_an_atomic_writes_temporary_name_is_replaced(out):
    from hsx.files import atomic_write

    os.mkfifo(out / ".hsx" / ".summary.json.tmp")
    done, error = _finishes(lambda: atomic_write(out / ".hsx" / "summary.json", "{}\n"),
                            out / ".hsx" / ".summary.json.tmp")
    assert done and error is None and (out / ".hsx" / "summary.json").read_text() == "{}\n"


# ---- the advice names the option that gave the dir ----------------------------------------------------------------

def test_a_refused_merge_or_push_dir_is_named_by_its_own_argument_not_output_dir(out, tmp_path):
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    rc, _, err = hsx_main(["merge", str(tmp_path / "merged"), str(out), str(stranger)])
    line = the_error_line(err)
    assert rc != 0 and "choose another DIR of `hsx merge`" in line and "--output-dir" not in line, line
    afile = tmp_path / "afile"
    afile.write_text("x")
    rc, _, err = hsx_main(["merge", str(afile), str(out)])
    line = the_error_line(err)
    assert rc != 0 and "is a file, not a folder; choose another OUTPUT_DIR of `hsx merge`" in line, line
    assert afile.read_text() == "x" and (stranger / "notes.txt").read_text() == "mine"
    hub_copy = tmp_path / "downloaded"  # (an output without .hsx/, as the Hub holds it)
    shutil.copytree(out, hub_copy, ignore=shutil.ignore_patterns(".hsx"))
    rc, _, err = hsx_main(["push", str(hub_copy), "someone/states"])
    line = the_error_line(err)
    assert rc != 0 and "OUTPUT_DIR of `hsx push`" in line and "--output-dir" not in line, line


# ---- a row-level repetition in a chat template --------------------------------------------------------------------

@pytest.mark.parametrize("markers", [False, True])
def test_a_repetition_a_row_sizes_is_refused_before_it_allocates(markers):
    """`'x' * (message.content | int)`: the static check sees no literal count; a row of '90000000' built 90 MB
    (a row of '10000000000', 10 GB) before the render's length bound could look at it."""
    from chat_families import QWEN3, family

    from hsx import masks

    bomb = "{%- if message.content is string and message.content[:1] == '9' %}{{ 'x' * (message.content | int) }}" \
           "{% endif %}"
    if markers:  # (rendered and tokenized by transformers in one call)
        from hsx.demo import CHAT_TEMPLATE, build_tokenizer

        template = CHAT_TEMPLATE.replace("{%- for message in messages -%}", "{%- for message in messages -%}" + bomb, 1)
        tok = build_tokenizer(template)
    else:
        template = QWEN3.replace("{%- for message in messages %}", "{%- for message in messages %}" + bomb, 1)
        tok = family("qwen3", template)
    assert bool(masks.GENERATION_TAG.search(template)) == markers
    assert masks.unbounded_step(tok.chat_template) is None and bomb in tok.chat_template
    conv = [{"role": "user", "content": "90000000"}, {"role": "assistant", "content": "ok"}]
    fine = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    fmt = None if markers else masks.derive_chat_format(tok, {})
    rows, peak = chat_tokenize_peak(tok, [fine, conv, fine], fmt)
    assert [r[2] for r in rows] == ["", "chat_template_output_too_long", ""]
    assert rows[0][0] and rows[0] == rows[2]
    assert peak < 20_000_000, peak  # (the 90 MB string was never built)
    # outside hsx's render bounds the same compiled template renders as transformers does
    assert len(tok.apply_chat_template([{"role": "user", "content": "9000"}], tokenize=False)) > 9000


def test_launch_reads_the_hsx_recipe_and_flags_once_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    """A recipe every rank fails on (a FIFO each rank's read refused, a key with a wrong value, --layers missing)
    started all the ranks, each printing its own line, then the launcher's."""
    import accelerate.commands.launch

    from hsx.cli import main

    started = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", started.append)
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "bad.yaml").write_text("layers: [1]\nstorage_dtype: int4\n")
    for argv, needle in ((["--config", str(tmp_path / "fifo.yaml")], "is not a regular file"),
                         (["--config", str(tmp_path / "bad.yaml")], "storage_dtype"),
                         (["--model", "m", "--dataset", "d"], "--layers is required")):
        rc = main(["launch", "--num_processes", "2", "extract", *argv, "--output-dir", str(tmp_path / "o")])
        line = the_error_line(capsys.readouterr().err)
        assert rc != 0 and needle in line and not started, line
    assert not (tmp_path / "o").exists()
    rc = main(["launch", "--num_processes", "2", "extract", "--config", "recipes/demo.yaml", "--output-dir",
               str(tmp_path / "o")])
    assert rc == 0 and len(started) == 1


def test_a_resume_clears_partial_units_of_ranks_this_run_does_not_have(out):
    """A job killed on 8 ranks and resumed on 1 left .hsx/tmp/rank-00007/ behind: never committed, never cleared
    (each rank cleared only its own), and counted by --max-pending-gb's window for ever."""
    from hsx.follow import pending_bytes
    from hsx.schema import JobRecord
    from hsx.files import read_json

    _drop_manifest_line(out, sorted(OutputDir(out).manifest_records())[0])  # (a resume, not a finished dir)
    stale = out / ".hsx" / "tmp" / "rank-00007" / "train-zzz-00000.arrow"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x" * 1000)
    before = pending_bytes(OutputDir(out))
    job = read_json(out / ".hsx" / "job.json", JobRecord).to_dict()
    assert OutputDir(out).claim(job, False, log=quiet, check=True) == "resume"
    assert not stale.exists() and pending_bytes(OutputDir(out)) == before - 1000


@pytest.mark.parametrize("rank,world_size", [(0.5, 2), ("0", 1), (True, 2), (0, 2.0)])
def test_follow_takes_only_integer_ranks(out, rank, world_size):
    """A float rank passed the range check and failed later formatting the ledger's name; True read as rank 1."""
    with pytest.raises(ValueError, match="integers"):
        hsx.follow(out, rank=rank, world_size=world_size)


# ---- token_frequencies.npy -------------------------------------------------------------------------------------

def test_a_frequencies_file_whose_header_claims_a_huge_array_is_damaged_not_a_memory_error(out, tmp_path):
    """np.load allocates the shape the .npy header claims: 100 bytes claiming 10**12 int64 were a MemoryError
    traceback from `hsx vocab` and the speculators export."""
    import io

    import numpy as np

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<i8", "fortran_order": False, "shape": (10**12,)})
    (out / "token_frequencies.npy").write_bytes(header.getvalue() + bytes(64))
    rc, _, err = hsx_main(["vocab", str(out), "--draft-vocab-size", "4", "--dest", str(tmp_path / "v")])
    line = the_error_line(err)
    assert rc != 0 and "does not match hsx.json's token_frequencies" in line, line
    (out / "token_frequencies.npy").unlink()
    (out / "token_frequencies.npy").symlink_to(tmp_path / "elsewhere.npy")
    rc, _, err = hsx_main(["vocab", str(out), "--draft-vocab-size", "4", "--dest", str(tmp_path / "v")])
    assert rc != 0, err
    the_error_line(err)
