"""A held-out attacker's round on a finished output (issue 27's bar): a unit swapped between its check and its
read or upload, an export journal that claims units were released, and a reader of an output an export used up."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from helpers import fault_argv, hsx_main

import hsx
from hsx.config import HsxError
from hsx.export import export_specforge
from hsx.hub import push_output
from hsx.checksums import file_crc32
from test_hub import REPO, FakeHfApi


def quiet(*a, **k):
    pass


@pytest.fixture(scope="module")
def finished(tmp_path_factory, model4, small_chat_path) -> Path:
    out = tmp_path_factory.mktemp("round4") / "finished"
    rc, _, err = hsx_main(fault_argv(model4.path, small_chat_path, out, "--unit-tokens", "200"))
    assert rc == 0, err
    assert len(list((out / "data").glob("*.arrow"))) >= 4
    return out


@pytest.fixture
def out(finished, tmp_path) -> Path:
    return Path(shutil.copytree(finished, tmp_path / "out", symlinks=True))


def swap_for_link(unit: Path, target: Path) -> None:
    """What an attacker does between hsx's check of a unit and its open: the name now leads out of the output."""
    unit.unlink()
    os.symlink(target, unit)


def test_a_unit_swapped_for_a_link_after_its_check_is_not_pushed(out, tmp_path):
    """The bytes checked against hsx.json are the bytes uploaded: the file is opened once, checked on that fd,
    and uploaded from it; a name swapped for a link to a secret after the check uploads no secret."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"SECRET" * 1000)
    api = FakeHfApi()
    real = api.create_commit
    swapped = []

    def swap_then_commit(repo_id, operations, **kw):  # after check_before_upload, before the file is read
        for unit in sorted((out / "data").glob("train-*.arrow")):
            if not unit.is_symlink():
                swapped.append(unit.name)
                swap_for_link(unit, secret)
        return real(repo_id, operations, **kw)

    api.create_commit = swap_then_commit
    try:
        push_output(out, REPO, api=api, log=quiet)
    except HsxError:
        pass  # a later commit may refuse the swapped names; what matters is what went up
    assert swapped
    uploaded = api.files()
    assert all(b"SECRET" not in data for data in uploaded.values())
    assert uploaded, "the first commit's units went up from the files as checked"


def test_load_refuses_a_unit_swapped_for_a_link_after_its_check(out, finished, tmp_path, monkeypatch):
    """hsx.load checks each unit's name, then maps it: a swap in between (a link to another output's unit, valid
    Arrow of the same schema) is caught, never read as this output's rows."""
    other = tmp_path / "other.arrow"
    victim = sorted((out / "data").glob("train-*.arrow"))[0]
    shutil.copy(sorted((finished / "data").glob("train-*.arrow"))[-1], other)
    load_module = importlib.import_module("hsx.load")  # (hsx.load is also the function)
    real = load_module.open_arrow_files

    def swap_then_open(files):
        swap_for_link(victim, other)
        return real(files)

    monkeypatch.setattr(load_module, "open_arrow_files", swap_then_open)
    with pytest.raises(HsxError, match="changed while it was being opened|not the regular file"):
        hsx.load(out)


def test_a_crc_never_waits_on_a_fifo_nor_follows_a_link(tmp_path):
    """file_crc32 opens once, without following a link and without blocking: a FIFO named like a unit (swapped in
    after a check) is refused at once, not waited on forever."""
    fifo = tmp_path / "train-001-00000.arrow"
    os.mkfifo(fifo)
    result = []

    def crc():
        try:
            result.append(file_crc32(fifo))
        except HsxError as e:
            result.append(e)

    t = threading.Thread(target=crc, daemon=True)
    t.start()
    t.join(10)
    blocked = t.is_alive()
    if blocked:  # let the blocked reader go (a writer opens the FIFO), so the failure is not a hang
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
    assert not blocked, "file_crc32 blocked on a FIFO"
    assert isinstance(result[0], HsxError)
    real = tmp_path / "real"
    real.write_bytes(b"x" * 10)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(HsxError, match="symbolic link"):
        file_crc32(link)


def test_an_export_journal_alone_never_deletes_a_source_unit(out, tmp_path):
    """A `released` line in DEST's journal (forged, or from a kill) deletes nothing: a plain export keeps every
    source unit, and a unit still on disk is exported again rather than taken as done."""
    dest = tmp_path / "dest"
    export_specforge(out, dest, layout="dflash", log=quiet)
    token = json.loads((dest / "hsx-export.json").read_text())["token"]
    units = sorted(p.name for p in (out / "data").glob("train-*.arrow"))
    with open(dest / "hsx-export.jsonl", "a") as f:
        f.write(json.dumps({"token": token, "released": units[1]}) + "\n")
    export_specforge(out, dest, layout="dflash", log=quiet)
    assert sorted(p.name for p in (out / "data").glob("train-*.arrow")) == units
    (out / "data" / units[1]).unlink()  # and gone: a plain export cannot have released it
    with pytest.raises(ValueError, match="journal is damaged"):
        export_specforge(out, dest, layout="dflash", log=quiet)


def test_load_of_an_output_an_export_used_up_says_where_its_rows_went(out, tmp_path):
    dest = tmp_path / "moved"
    export_specforge(out, dest, layout="dflash", delete_source=True, log=quiet)
    assert not list((out / "data").glob("train-*.arrow"))
    with pytest.raises(HsxError) as e:
        hsx.load(out)
    msg = str(e.value)
    assert "\n" not in msg and "export-specforge --delete-source" in msg and str(dest.resolve()) in msg
    assert "damaged" not in msg


def test_push_refuses_a_fifo_named_like_its_card_before_uploading(out):
    """README.md, hsx.json and token_frequencies.npy go up as regular files only: a FIFO there was read (and
    waited on forever) by the upload; now it is refused before anything is uploaded."""
    (out / "README.md").unlink()
    os.mkfifo(out / "README.md")
    api = FakeHfApi()
    result = []

    def push():
        try:
            result.append(push_output(out, REPO, api=api, log=quiet))
        except HsxError as e:
            result.append(e)

    t = threading.Thread(target=push, daemon=True)
    t.start()
    t.join(30)
    blocked = t.is_alive()
    if blocked:  # let the blocked reader go, so the failure is not a hang
        os.close(os.open(out / "README.md", os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
    assert not blocked, "push waited on a FIFO"
    assert isinstance(result[0], HsxError) and "not a regular file" in str(result[0])
    assert REPO not in api.repos or not any(api.files())


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


def run_with_deadline(fn, unblock: Path | None = None, seconds: float = 30):
    """fn()'s result or exception; a call still blocked after `seconds` fails the test (a writer opens the FIFO
    `unblock` first, so the failure is not a hang)."""
    result = []

    def call():
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001
            result.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    blocked = t.is_alive()
    if blocked and unblock is not None:
        os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
    assert not blocked, f"{fn} blocked"
    return result[0]


@pytest.mark.parametrize("name", ["hsx.json", ".hsx/manifest-00000.jsonl", ".hsx/job.json"])
def test_a_fifo_for_hsx_own_json_is_refused_not_waited_on(out, name, model4, small_chat_path):
    """hsx.json, a manifest or job.json replaced by a FIFO: load and extract waited forever (and a SIGTERM, which
    hsx takes as "stop after this unit", never stopped them); now one line."""
    (out / name).unlink()
    os.mkfifo(out / name)
    if name == ".hsx/job.json":
        res = run_with_deadline(lambda: hsx_main(fault_argv(model4.path, small_chat_path, out)), out / name, 60)
        rc, _, err = res
        assert rc == 1 and "Traceback" not in err and "not a regular file" in err, err
    else:
        res = run_with_deadline(lambda: hsx.load(out), out / name)
        assert isinstance(res, HsxError) and "not a regular file" in str(res)


def test_a_huge_or_linked_hsx_json_is_refused_unread(out, tmp_path):
    """A 1.2 GB hsx.json would be read whole into memory (then parsed); a link would read another output's."""
    hsx_json = out / "hsx.json"
    other = tmp_path / "elsewhere.json"
    shutil.copy(hsx_json, other)
    hsx_json.unlink()
    hsx_json.symlink_to(other)
    with pytest.raises(HsxError, match="symbolic link"):
        hsx.load(out)
    hsx_json.unlink()
    with open(hsx_json, "wb") as f:
        f.truncate(1_200_000_000)  # (sparse: no disk used)
    with pytest.raises(HsxError, match="more than hsx writes there"):
        hsx.load(out)


def test_merge_links_no_unit_that_is_itself_a_link(finished, tmp_path):
    """A node dir whose unit is a link (to a copy elsewhere, or to anything) is not that dir's unit: merge said
    "merged" and wrote an output every reader then refused; now the merge refuses, in one line, before writing."""
    from test_merge import split_like_two_nodes

    from hsx.merge import merge

    node0, node1 = split_like_two_nodes(finished, tmp_path)
    unit = sorted((node1 / "data").iterdir())[0]
    elsewhere = tmp_path / "elsewhere.arrow"
    shutil.copy(unit, elsewhere)
    unit.unlink()
    unit.symlink_to(elsewhere)
    with pytest.raises(HsxError, match="in none of the dirs"):
        merge(str(tmp_path / "m"), [str(node0), str(node1)], log=quiet)
    assert not (tmp_path / "m" / "hsx.json").exists()


def test_a_jsonl_line_nested_too_deeply_is_one_line_not_a_crash(tmp_path, model4):
    """pyarrow's JSON reader (datasets') crashed the process with a segmentation fault on a line nested 100,000
    levels deep; now the line is named. Brackets inside strings, and nesting of a few hundred levels, still load."""
    import subprocess
    import sys

    from helpers import child_env

    good = {"messages": [{"role": "user", "content": "[" * 5000 + "{"}, {"role": "assistant", "content": "ok"}]}
    data = tmp_path / "deep.jsonl"
    data.write_text(json.dumps(good) + "\n" + '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    argv = [sys.executable, "-m", "hsx", *fault_argv(model4.path, data, tmp_path / "out")]
    res = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 1, (res.returncode, res.stderr[-2000:])
    lines = [line for line in res.stderr.splitlines() if line.startswith("hsx: error: ")]
    assert len(lines) == 1 and "line 2 nests JSON too deeply" in lines[0], res.stderr[-2000:]
    from hsx.data import check_json_nesting

    data.write_text(json.dumps(good) + "\n" + '{"messages": ' + "[" * 300 + "]" * 300 + "}\n")
    check_json_nesting(data)  # (no error: a string full of brackets, and 300 levels, are fine)


@pytest.mark.parametrize("case", ["config_deep", "tokenizer_deep", "layers_huge"])
def test_hostile_model_files_are_one_line(tmp_path, model4, small_chat_path, case):
    """A config.json or tokenizer.json nested 200,000 deep was a RecursionError traceback; a config.json saying
    99,999,999,999 layers never returned (transformers builds a per-layer list first)."""
    import subprocess
    import sys

    from helpers import child_env

    model = Path(shutil.copytree(model4.path, tmp_path / "model"))
    deep = '{"a": ' + "[" * 200_000 + "]" * 200_000 + "}"
    if case == "config_deep":
        (model / "config.json").write_text(deep)
    elif case == "tokenizer_deep":
        (model / "tokenizer.json").write_text(deep)
    else:
        config = json.loads((model / "config.json").read_text())
        config.pop("layer_types", None)
        config["num_hidden_layers"] = 99_999_999_999
        (model / "config.json").write_text(json.dumps(config))
    argv = [sys.executable, "-m", "hsx", *fault_argv(model, small_chat_path, tmp_path / "out")]
    res = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.startswith("hsx: error: ")]
    assert len(lines) == 1, res.stderr[-2000:]
