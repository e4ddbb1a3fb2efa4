"""The output dir: starting a job in it (and refusing dirs hsx did not write), finalizing, empty outputs; nothing
deleted or written through a link (--overwrite, a resume's leftovers, atomic_write); hsx.json, the manifests and
job.json read as bounded regular files, torn ledger lines passed over."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hsx
from hsx import ledgers
from hsx.config import HsxError
from hsx.schema import OutputFormat
from hsx.info import info_features
from hsx.fingerprint import job_fingerprint
from hsx.sink import OutputDir

CARD = "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*.arrow\n---\n"
INFO = {"layers": [1, 3], "hidden_size": 64, "final_hidden": True, "complete": True, "model": "m",
        "num_model_layers": 4, "storage_dtype": "bfloat16", "max_length": 16, "config": {},
        "counts": {"rows_in": 0, "rows_written": 0, "tokens_written": 0, "truncated": 0, "skipped": {}}}


def job(**inputs):
    return job_fingerprint({"model": "m", "input": "a", **inputs})


def tree(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ---- locked: a dir hsx did not write is refused before anything is created in it --------------------------------

def test_locked_refuses_a_foreign_dir_and_creates_nothing(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    out = OutputDir(tmp_path)
    with pytest.raises(HsxError, match="not empty and was not written by hsx"):
        with out.locked():
            pass
    assert tree(tmp_path) == ["notes.txt"]


@pytest.mark.parametrize("setup", ["missing", "empty", "hsx-state-only"])
def test_locked_accepts_new_empty_and_hsx_dirs(tmp_path, setup):
    root = tmp_path / "out"
    if setup != "missing":
        root.mkdir()
    if setup == "hsx-state-only":  # a run that failed before claiming (a bad --model) left only its lock
        (root / ".hsx").mkdir()
        (root / ".hsx" / "lock").write_text("")
    out = OutputDir(root)
    with out.locked():
        assert out.start_or_resume(job(), overwrite=False) == "new"
    assert (root / ".hsx" / "job.json").exists()


def test_locked_refuses_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(HsxError, match="not a folder"):
        with OutputDir(tmp_path / "f").locked():
            pass


# ---- claim --------------------------------------------------------------------------------------------------

def test_same_job_resumes_or_is_complete(tmp_path):
    out = OutputDir(tmp_path / "out")
    with out.locked():
        assert out.start_or_resume(job(), False) == "new"
        assert out.start_or_resume(job(), False) == "resume"
        (out.root / "hsx.json").write_text(json.dumps(INFO))
        assert out.start_or_resume(job(), False) == "complete"


def test_a_dir_without_output_is_reclaimed_by_another_job(tmp_path):
    """A job that failed before committing a unit (--strict, no chat template, ...) leaves only .hsx state; the
    next job takes the dir over and the stale state goes."""
    out = OutputDir(tmp_path / "out")
    with out.locked():
        assert out.start_or_resume(job(input="a"), False) == "new"
        (out.state / "tokenized").mkdir()
        (out.state / "tokenized" / "tokens.arrow").write_bytes(b"stale")
        out.unit_tmp("000-00000").write_bytes(b"half a unit")
        (out.state / "manifest-00000.jsonl").write_text("")
        (out.data).mkdir()
        new = job(input="b")
        assert out.start_or_resume(new, False) == "new"
        assert json.loads((out.state / "job.json").read_text())["fingerprint"] == new["fingerprint"]
        assert tree(out.root) == [".hsx", ".hsx/busy", ".hsx/job.json", ".hsx/lock", "README.md"]
        assert out.start_or_resume(new, False) == "resume"


@pytest.mark.parametrize("output", ["manifest", "data_file", "hsx_json"])
def test_a_dir_with_output_of_another_job_is_refused(tmp_path, output):
    out = OutputDir(tmp_path / "out")
    with out.locked():
        out.start_or_resume(job(input="a"), False)
        if output == "manifest":
            (out.state / "manifest-00000.jsonl").write_text('{"unit": "000-00000"}\n')
        elif output == "data_file":
            out.data.mkdir()
            (out.data / "train-000-00000.arrow").write_bytes(b"x")
        else:
            (out.root / "hsx.json").write_text("{}")
        before = tree(out.root)
        with pytest.raises(HsxError, match=r"holds a different job \(differs in: input\)"):
            out.start_or_resume(job(input="b"), False)
        assert tree(out.root) == before
        assert out.start_or_resume(job(input="b"), overwrite=True) == "new"


# ---- finalize: a job without rows still gets a loadable data file -----------------------------------------------

def test_finalize_without_units_writes_an_empty_data_file(tmp_path):
    from datasets import Dataset, load_dataset

    out = OutputDir(tmp_path / "empty-output")  # a name of its own: datasets caches local dirs by folder name
    feats = OutputFormat(2, 64, True).features()
    with out.locked():
        out.start_or_resume(job(), False)
        out.unit_tmp("000-00000")  # finalize also clears .hsx/tmp
        out.finalize(INFO, CARD, features=feats)
    assert [p.name for p in out.data_files()] == ["train-000-00000.arrow"]
    assert tree(out.root) == [".hsx", ".hsx/busy", ".hsx/job.json", ".hsx/lock", "README.md", "data",
                              "data/train-000-00000.arrow", "hsx.json"]
    ds = Dataset.from_file(str(out.data_files()[0]))
    assert ds.num_rows == 0 and ds.features == feats
    loaded = hsx.load(str(out.root))
    assert len(loaded) == 0 and loaded.features == feats
    assert loaded.features["hidden_states"].feature.feature.id == "bfloat16"
    assert len(hsx.torch_view(str(out.root))) == 0
    streamed = load_dataset(str(out.root), split="train", streaming=True)
    assert list(streamed) == [] and streamed.features == feats


def test_finalize_empty_schema_defaults_to_the_info(tmp_path):
    out = OutputDir(tmp_path / "out")
    with out.locked():
        out.start_or_resume(job(), False)
        out.finalize({**INFO, "final_hidden": False}, CARD)
    assert hsx.load(str(out.root)).features == OutputFormat(2, 64, False).features()
    assert info_features({"layers": [1]}) is None


def test_finalize_with_units_adds_no_empty_file(tmp_path):
    out = OutputDir(tmp_path / "out")
    out.data.mkdir(parents=True)
    (out.data / "train-003-00000.arrow").write_bytes(b"a unit")
    out.finalize(INFO, CARD, features=OutputFormat(2, 64, True).features())
    assert [p.name for p in out.data_files()] == ["train-003-00000.arrow"]


# ---- load: the read-only warning is silenced where it happens, not for the whole program -------------------------

@pytest.mark.slow
def test_load_silences_the_read_only_warning_only_where_it_happens():
    code = (
        "import warnings, numpy as np\nfrom hsx.load import _tensor\n"
        "assert not any(f[1] is not None and 'not writable' in f[1].pattern for f in warnings.filters), "
        "'hsx.load installed a global warnings filter'\n"
        "warnings.simplefilter('error')\n"  # a warning that escapes _tensor raises here
        "a = np.arange(4, dtype=np.int16)\n"
        "a.setflags(write=False)\n"
        "t = _tensor(a)\n"
        "assert t.tolist() == [0, 1, 2, 3] and t.data_ptr() == a.ctypes.data\n"  # a view, no copy
        "print('ok')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ok"


# ---- how much of a record is read ----------------------------------------------------------------------------------

def _sparse(path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)  # (no data blocks: cheap to make, and old code read it whole)


def test_records_over_their_bound_are_refused_before_they_are_read(tmp_path):
    """hsx.json, summary.json and job.json were read up to 1 GiB and parsed (1 GiB of `[[],...]`: ~20 GB of
    Python objects); each is now bounded by what the record can list (hsx.schema) and a bigger one is one line
    naming it, read no further."""
    import tracemalloc

    from hsx.info import read_summary
    from hsx.load import read_info
    from hsx.schema import MAX_INFO_BYTES, MAX_JOB_BYTES

    out = OutputDir(tmp_path / "out")
    _sparse(out.root / "hsx.json", MAX_INFO_BYTES + 1)
    _sparse(out.state / "summary.json", MAX_INFO_BYTES + 1)
    _sparse(out.state / "job.json", MAX_JOB_BYTES + 1)
    for name, read in (("hsx.json", lambda: read_info(out.root)), ("summary.json", lambda: read_summary(out.state)),
                       ("job.json", lambda: out.start_or_resume({"fingerprint": "f" * 32, "inputs": {}},
                                                                 overwrite=False))):
        tracemalloc.start()
        try:
            with pytest.raises(HsxError, match=rf"{name} is damaged: [\d,]+ bytes, more than hsx writes there"):
                read()
            assert tracemalloc.get_traced_memory()[1] < 1 << 20, name
        finally:
            tracemalloc.stop()
    from hsx.schema import JobRecord
    from hsx.files import read_json

    (out.state / "job.json").write_text(json.dumps({"fingerprint": "f" * 32, "inputs": {}}))
    tracemalloc.start()
    try:  # a record of a few bytes is read in a few bytes (not a buffer of its bound: 1 GiB before)
        assert read_json(out.state / "job.json", JobRecord).fingerprint == "f" * 32
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_the_record_bounds_hold_a_job_of_max_units_and_input_files():
    """The bounds are sized per unit and per input file: what hsx writes for one, at its longest, fits in them
    (a real output is never refused)."""
    from hsx.schema import INPUT_FILE_ENTRY_BYTES, MAX_LEDGER_LINE_BYTES, UNIT_ENTRY_BYTES, FileEntry

    entry = FileEntry("train-999-99999.arrow", 2**40, "ffffffff", "999-99999", 2**31).to_dict()
    grows = len(json.dumps({"files": [entry] * 2}, indent=2)) - len(json.dumps({"files": [entry]}, indent=2))
    assert grows <= UNIT_ENTRY_BYTES  # hsx.json (OutputDir.finalize's indent), summary.json's unit name less
    line = json.dumps({"unit": "999-99999", "file": "train-999-99999.arrow", "bytes": 2**40, "crc32": "ffffffff",
                       "session": "f" * 12, "rows": 2**31, "tokens": 2**40, "skipped_oom": 2**31,
                       "skipped_nonfinite": 2**31, "nonfinite_kept": 2**31}, sort_keys=True) + "\n"
    assert len(line) <= UNIT_ENTRY_BYTES  # a manifest line (OutputDir.commit)
    one = {"files": {"data/" + "x" * 120 + ".parquet": [2**40, "f" * 64]}}
    grows = len(json.dumps({**one, "files": {**one["files"], "y": [2**40, "f" * 64]}}, indent=2, sort_keys=True))
    assert grows - len(json.dumps(one, indent=2, sort_keys=True)) <= INPUT_FILE_ENTRY_BYTES  # job.json
    assert len(json.dumps({"file": "train-999-99999.arrow", "dest": "/" + "d" * 4096, "bytes": 2**40,
                           "crc32": "ffffffff", "command": "export-speculators"})) < MAX_LEDGER_LINE_BYTES


def test_a_ledger_is_read_a_line_at_a_time(tmp_path):
    """A ledger was read whole and split (8 MB of newlines: a list of 8M lines); now a line at a time, each at
    most MAX_LEDGER_LINE_BYTES: a longer one (which hsx never writes) is one line naming the file and line."""
    import tracemalloc

    from hsx.schema import MAX_LEDGER_LINE_BYTES

    out = OutputDir(tmp_path / "out")
    out.state.mkdir(parents=True)
    rec = {"unit": "000-00000", "file": "train-000-00000.arrow", "bytes": 1, "rows": 1, "tokens": 1}
    manifest = out.state / "manifest-00000.jsonl"
    manifest.write_text("\n" * (8 << 20) + json.dumps(rec) + "\n")
    tracemalloc.start()
    try:
        assert list(ledgers.manifest_records(out.state)) == ["000-00000"]
        assert tracemalloc.get_traced_memory()[1] < 2 << 20
    finally:
        tracemalloc.stop()
    manifest.write_text(json.dumps(rec) + "\n" + json.dumps({**rec, "session": "s" * MAX_LEDGER_LINE_BYTES}) + "\n")
    with pytest.raises(HsxError, match=r"manifest-00000.jsonl: line 2 is damaged: over [\d,]+ bytes"):
        ledgers.manifest_records(out.state)


def test_the_jobs_run_record_names_the_kernels_every_rank_ran():
    """Like compile, sdpa_backend and packing, the experts kernel and the FP8 GEMM (numerically different
    kernels, allowed to change on a resume) are in the job's `run`, not only under each rank's."""
    from hsx.info import combine_rank_stats

    rank = {"seconds": 1.0, "tokens": 10, "padded_tokens": 12, "gpu_seconds": 0.5, "sdpa_backend": "flash",
            "packing": "varlen", "compile": True, "experts_implementation": "hsx_grouped", "fp8_gemm": "cublas",
            "kernels": {"linear_attention": "fla"}, "versions": {"torch": "2.11.0", "deep_gemm": "2.6.1"}}
    run = combine_rank_stats([{**rank, "rank": 0}, {**rank, "rank": 1}])
    assert {k: run[k] for k in ("sdpa_backend", "packing", "compile", "experts_implementation", "fp8_gemm")} == {
        "sdpa_backend": "flash", "packing": "varlen", "compile": True, "experts_implementation": "hsx_grouped",
        "fp8_gemm": "cublas"}
    assert run["kernels"] == rank["kernels"] and run["versions"] == rank["versions"]  # (README: run.kernels)


import os  # noqa: E402
import shutil  # noqa: E402

from helpers import (LONG_DIGITS, call_with_deadline, drop_manifest_line, fault_argv,  # noqa: E402
                     finished_argv, hsx_main, quiet, swap_for_link, the_error_line, tree_bytes)
from hsx.files import atomic_write  # noqa: E402


# ---- no delete or write through a link -----------------------------------------------------------------------------

@pytest.fixture
def victim(tmp_path) -> Path:
    v = tmp_path / "victim"
    (v / "data").mkdir(parents=True)
    for name in ("job.json", "manifest-00000.jsonl", "summary.json", "README.md", "hsx.json"):
        (v / name).write_text("precious")
    (v / "data" / "train-000-00000.arrow").write_text("precious")
    return v


@pytest.mark.parametrize("link", [".hsx", "data", ".hsx/tmp", ".hsx/job.json"])
def test_overwrite_never_deletes_through_a_link(model4, small_chat_path, tmp_path, victim, link):
    out = tmp_path / "out"
    argv = fault_argv(model4.path, small_chat_path, out)
    assert hsx_main(argv)[0] == 0
    target = out / link
    shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    target.symlink_to(victim if link != ".hsx/job.json" else victim / "job.json")
    before = tree_bytes(victim)
    rc, _, err = hsx_main(argv + ["--overwrite"])
    line = the_error_line(err)
    assert rc != 0 and "symbolic link" in line and link in line, line
    assert tree_bytes(victim) == before


def test_unit_links_lose_the_link_only(tmp_path, victim):
    out = OutputDir(tmp_path / "out")
    with out.locked():
        out.start_or_resume({"fingerprint": "a", "inputs": {}}, False)
        out.data.mkdir()
        (out.data / "train-000-00000.arrow").symlink_to(victim / "data" / "train-000-00000.arrow")
        out.start_or_resume({"fingerprint": "b", "inputs": {}}, overwrite=True)
    assert not (out.data / "train-000-00000.arrow").is_symlink()
    assert (victim / "data" / "train-000-00000.arrow").read_text() == "precious"


def test_atomic_write_replaces_a_link_never_its_target(tmp_path, victim):
    (tmp_path / ".job.json.tmp").symlink_to(victim / "job.json")
    (tmp_path / "hsx.json").symlink_to(victim / "hsx.json")
    atomic_write(tmp_path / "job.json", "mine")
    atomic_write(tmp_path / "hsx.json", "mine")
    assert (victim / "job.json").read_text() == (victim / "hsx.json").read_text() == "precious"
    assert (tmp_path / "job.json").read_text() == "mine" and not (tmp_path / "hsx.json").is_symlink()


def test_ranks_marking_a_nodes_share_done_at_once_each_write_through_a_name_of_their_own(tmp_path):
    """Every rank of a node that finds its share done writes .hsx/share-done.json, at the same moment: with one
    temporary name for all, one rank's rename took the file another was about to rename (FileNotFoundError: a
    finished node's job exited 1 in CI). Two ranks as threads, many times over: no error, one whole record."""
    import threading

    from hsx import ledgers

    errors = []

    def mark(rank):
        try:
            for _ in range(500):
                ledgers.mark_share_done(tmp_path, 3, 6, rank)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=mark, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["share-done.json"]
    assert json.loads((tmp_path / "share-done.json").read_text()) == {"units": 3, "of": 6}


def test_a_fifo_at_an_atomic_writes_temporary_name_is_replaced(finished_copy):
    os.mkfifo(finished_copy / ".hsx" / ".summary.json.tmp")
    done, error = call_with_deadline(lambda: atomic_write(finished_copy / ".hsx" / "summary.json", "{}\n"), 60,
                                     finished_copy / ".hsx" / ".summary.json.tmp")
    assert done and error is None and (finished_copy / ".hsx" / "summary.json").read_text() == "{}\n"


# ---- a resume's removal of a killed commit's leftover unit ---------------------------------------------------------

def test_remove_uncommitted_deletes_nothing_through_a_linked_data_dir(finished_copy, tmp_path):
    unit = drop_manifest_line(finished_copy)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(finished_copy / "data", elsewhere)
    (finished_copy / "data").symlink_to(elsewhere)
    log: list[str] = []
    with pytest.raises(HsxError, match="data is a symbolic link or not a folder; hsx never deletes through links"):
        OutputDir(finished_copy)._remove_uncommitted([unit], log.append)
    assert (elsewhere / f"train-{unit}.arrow").is_file()
    assert not log


def test_remove_uncommitted_removes_only_the_name_of_a_hard_linked_unit(finished_copy, tmp_path):
    """A leftover that is a hard link (a `cp -al` snapshot of the dir): the snapshot's file stays whole."""
    unit = drop_manifest_line(finished_copy)
    snapshot = tmp_path / "snapshot.arrow"
    os.link(finished_copy / "data" / f"train-{unit}.arrow", snapshot)
    size = snapshot.stat().st_size
    OutputDir(finished_copy)._remove_uncommitted([unit], quiet)
    assert not (finished_copy / "data" / f"train-{unit}.arrow").exists()
    assert snapshot.stat().st_size == size and snapshot.stat().st_nlink == 1


def test_remove_uncommitted_leaves_folders_fifos_and_links_alone(finished_copy, tmp_path):
    names = ["a-0", "b-0", "c-0"]
    (finished_copy / "data" / "train-a-0.arrow").mkdir()
    os.mkfifo(finished_copy / "data" / "train-b-0.arrow")
    (tmp_path / "t").write_text("x")
    (finished_copy / "data" / "train-c-0.arrow").symlink_to(tmp_path / "t")
    OutputDir(finished_copy)._remove_uncommitted(names, quiet)
    assert (finished_copy / "data" / "train-a-0.arrow").is_dir() and (tmp_path / "t").read_text() == "x"
    data = finished_copy / "data"
    assert os.path.lexists(data / "train-b-0.arrow") and (data / "train-c-0.arrow").is_symlink()


# ---- hsx.json, the manifests and job.json: read as regular files, bounded, torn lines passed over ------------------

@pytest.mark.parametrize("name", ["hsx.json", ".hsx/manifest-00000.jsonl", ".hsx/job.json"])
def test_a_fifo_for_hsx_own_json_is_refused_not_waited_on(finished_copy, name, model4, small_chat_path):
    """hsx.json, a manifest or job.json replaced by a FIFO is one line at once: opened as a file, load and extract
    would wait forever (and a SIGTERM, which hsx takes as "stop after this unit", would not stop them)."""
    (finished_copy / name).unlink()
    os.mkfifo(finished_copy / name)
    if name == ".hsx/job.json":
        done, res = call_with_deadline(lambda: hsx_main(finished_argv(model4, small_chat_path, finished_copy)), 60,
                                       finished_copy / name)
        assert done, "extract waited on a FIFO"
        rc, _, err = res
        assert rc == 1 and "Traceback" not in err and "not a regular file" in err, err
    else:
        done, res = call_with_deadline(lambda: hsx.load(finished_copy), 30, finished_copy / name)
        assert done, "hsx.load waited on a FIFO"
        assert isinstance(res, HsxError) and "not a regular file" in str(res)


def test_a_huge_or_linked_hsx_json_is_refused_unread(finished_copy, tmp_path):
    """A 1.2 GB hsx.json would be read whole into memory (then parsed); a link would read another output's."""
    hsx_json = finished_copy / "hsx.json"
    shutil.copy(hsx_json, tmp_path / "elsewhere.json")
    swap_for_link(hsx_json, tmp_path / "elsewhere.json")
    with pytest.raises(HsxError, match="symbolic link"):
        hsx.load(finished_copy)
    hsx_json.unlink()
    with open(hsx_json, "wb") as f:
        f.truncate(1_200_000_000)  # (sparse: no disk used)
    with pytest.raises(HsxError, match="more than hsx writes there"):
        hsx.load(finished_copy)


def test_a_ledger_line_with_a_number_too_long_is_passed_over_as_a_torn_one(finished_copy):
    """(A torn line's unit is redone, uploaded again or read again: never a loss.)"""
    manifest = next((finished_copy / ".hsx").glob("manifest-*.jsonl"))
    with open(manifest, "a") as f:
        f.write(f'{{"unit": "zz", "bytes": {LONG_DIGITS}}}\n')
    (finished_copy / ".hsx" / "uploaded-push.jsonl").write_text(f'{{"file": "data/x.arrow", "bytes": {LONG_DIGITS}}}\n')
    o = OutputDir(finished_copy)
    assert ledgers.uploaded(o.state) == {} and "zz" not in ledgers.manifest_records(o.state)
    assert len(ledgers.done_units(o.state, o.data)) >= 3


def test_a_torn_manifest_line_is_still_passed_over(finished_copy, model4, small_chat_path):
    """A kill mid-append leaves a line that is not JSON: that unit is redone, nothing is refused."""
    argv = finished_argv(model4, small_chat_path, finished_copy)
    manifest = sorted((finished_copy / ".hsx").glob("manifest-*.jsonl"))[0]
    with open(manifest, "ab") as f:
        f.write(b'{"unit": "999-99999", "file": "train-999-99')
    rc, stdout, err = hsx_main(argv)
    assert rc == 0, err
    assert "already complete" in stdout + err


# ---- the drawing in hsx.sink's docstring is what an extraction writes ------------------------------------------

def drawing() -> list[tuple[re.Pattern, bool, str]]:
    """hsx.sink's drawing of the output dir: for each drawn path (`OUT/...`, the first word of its line), the
    pattern of the paths it stands for (`<name>`: a part of a name; a path ending in `/`: that folder and all in
    it), whether it is there only in some states (`?`), and the path as drawn."""
    import hsx.sink

    found = []
    for line in hsx.sink.__doc__.splitlines():
        m = re.match(r"    OUT/(\S+)", line)
        if not m:
            continue
        drawn = m.group(1)
        path = drawn.removesuffix("?")
        rx = "".join("[^/]+" if part.startswith("<") else re.escape(part) for part in re.split(r"(<[^>]+>)", path))
        found.append((re.compile(rx + (".*" if path.endswith("/") else "")), drawn.endswith("?"), drawn))
    return found


def undrawn_and_unwritten(written: list[str]) -> tuple[list[str], list[str]]:
    """The written paths no drawn path stands for, and the drawn paths (not marked `?`) that stand for none."""
    drawn = drawing()
    undrawn = [w for w in written if not any(rx.fullmatch(w) for rx, _, _ in drawn)]
    unwritten = [d for rx, optional, d in drawn if not optional and not any(rx.fullmatch(w) for w in written)]
    return undrawn, unwritten


@pytest.mark.slow
def test_the_drawing_of_the_output_dir_names_every_file_an_extraction_writes(tmp_path, model4, small_chat_path):
    """A real extraction's dir holds exactly what hsx.sink's docstring draws: no file the drawing lacks, and every
    file it draws as always there (the README links to this drawing instead of drawing its own)."""
    from helpers import hsx_main

    out = tmp_path / "out"
    rc, _, err = hsx_main(["extract", "--model", str(model4.path), "--dataset", str(small_chat_path), "--layers",
                           "1", "--output-dir", str(out), "--unit-tokens", "300", "--compile", "off"])
    assert rc == 0, err
    written = sorted(str(p.relative_to(out)) + ("/" if p.is_dir() else "") for p in out.rglob("*")
                     if not p.is_dir() or not any(p.iterdir()))  # (files, and folders holding nothing)
    assert len([w for w in written if w.startswith("data/train-")]) > 1
    assert undrawn_and_unwritten(written) == ([], [])
    # The comparison itself: a file the drawing lacks is named, and so is a drawn file that was not written.
    stray = [w for w in written if w != ".hsx/summary.json"] + [".hsx/notes.json"]
    assert undrawn_and_unwritten(stray) == ([".hsx/notes.json"], [".hsx/summary.json"])
    assert any(optional for _, optional, _ in drawing()) and "[hsx/sink.py](hsx/sink.py)" in (
        Path(hsx.__file__).parents[1] / "README.md").read_text()


def test_the_finalize_lock_is_never_opened_through_a_link(tmp_path):
    """.hsx/finalize.lock is opened as the other locks are: a link planted there is refused in one line, and the
    file it names is neither created nor opened for writing."""
    out = OutputDir(tmp_path / "out")
    out.state.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere.txt"
    (out.state / "finalize.lock").symlink_to(elsewhere)
    with pytest.raises(HsxError, match="symbolic link"):
        with out.finalizing():
            pass
    assert not elsewhere.exists()
