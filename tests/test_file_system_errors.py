"""File-system errors in extract, merge and export: a full disk (a real one: a small tmpfs, where this machine lets
the test mount one), a file size limit (`ulimit -f`: a child process with RLIMIT_FSIZE; Python ignores SIGXFSZ, so
the write fails with EFBIG), a read-only or unwritable dir, a failing disk (injected). Each is one line naming the
path and what to do, exit 1, every committed unit kept, and the same command continues once the cause is gone; an
output dir or DEST that cannot be made is one line too.

The jobs are `fault_reference`'s (conftest.py): model4, the demo chat, ~55 units (or conftest's smaller `finished`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import (assert_equals_reference, assert_one_error_line, assert_units_intact, child_env, hsx_main,
                     is_complete)

pytestmark = pytest.mark.slow  # every test runs the fault job at least twice


# ---- the means: a small real file system, a file size limit, an injected error ------------------------------------

@contextlib.contextmanager
def small_tmpfs(path: Path, size: int):
    """A tmpfs of `size` bytes mounted at `path` (skips where mounting is not permitted: no root, no
    CAP_SYS_ADMIN, as in CI); yields a function that remounts it with another size."""
    path.mkdir(parents=True, exist_ok=True)
    if sys.platform != "linux" or shutil.which("mount") is None:
        pytest.skip("needs Linux's mount(8)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")

    def resize(new: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={new}", str(path)], check=True, capture_output=True)

    try:
        yield resize
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def hsx_limited(argv: list[str], max_file_bytes: int, **env: str) -> tuple[int, str]:
    """`python -m hsx ARGV` in a child whose files may grow to `max_file_bytes` (`ulimit -f`), with `env` set:
    (rc, stderr)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    done = subprocess.run([sys.executable, "-m", "hsx", *argv], env=child_env(**env), preexec_fn=limit,
                          capture_output=True, text=True, timeout=300)
    return done.returncode, done.stderr


def data_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in (out / "data").iterdir())


def assert_kept_and_unfinished(out: Path, ref) -> int:
    """Every unit committed is intact and the reference's; the dir is not taken for a finished output."""
    recs = assert_units_intact(out)
    ref_crc = {r["unit"]: r["crc32"] for r in assert_units_intact(ref.out)}
    assert all(ref_crc[r["unit"]] == r["crc32"] for r in recs)
    assert not is_complete(out)
    return len(recs)


def split_nodes(ref, root: Path) -> list[Path]:
    from test_merge import split_like_two_nodes

    return split_like_two_nodes(ref.out, root)


def export_argv(out: Path, dest: Path) -> list[str]:
    return ["export-specforge", str(out), str(dest), "--layout", "dflash"]


# ---- extract -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["full-disk", "ulimit"])
def test_extract_stopped_by_the_file_system_is_one_line_and_resumes(tmp_path, fault_reference, how):
    """A real full disk (a tmpfs half the output's size), or `ulimit -f` below the largest unit (which gave
    `OSError: File too large`, then `ValueError: I/O operation on closed file` as a traceback): one line naming the
    path and what to do, the units committed kept; the cause gone, the same command finishes the job, equal to the
    reference."""
    ref = fault_reference
    size = data_bytes(ref.out)
    with contextlib.ExitStack() as stack:
        if how == "full-disk":
            resize = stack.enter_context(small_tmpfs(tmp_path / "disk", size // 2))
            out = tmp_path / "disk" / "out"
            rc, _, err = hsx_main(ref.argv(out))
            needles = ("disk full while writing", "free some space")
        else:
            sizes = sorted(p.stat().st_size for p in (ref.out / "data").iterdir())
            out = tmp_path / "out"
            rc, err = hsx_limited(ref.argv(out), sizes[len(sizes) // 2])
            needles = ("file too large", "ulimit -f")
        line = assert_one_error_line(rc, err, *needles, str(out), "run the same command to continue")
        assert rc == 1 and f"{assert_kept_and_unfinished(out, ref)} unit(s) are complete and intact" in line
        if how == "full-disk":
            resize(size * 3)
        rc, _, err = hsx_main(ref.argv(out))
        assert rc == 0, err
        assert_equals_reference(out, ref, verify=False)


@pytest.mark.parametrize("where, code", [("unit_write", errno.EFBIG), ("manifest", errno.EIO),
                                         ("hsx.json", errno.EROFS), ("lock", errno.EACCES)])
def test_a_file_system_error_at_each_moment_of_extract(tmp_path, monkeypatch, fault_reference, where, code):
    """EFBIG while a unit is written, EIO while its manifest line is appended, EROFS while hsx.json is written,
    EACCES on .hsx/lock (a dir readable but not writable): one line naming the path, what it is and what to do;
    the units committed kept; the same command, the cause gone, finishes the job."""
    import hsx.files
    import hsx.info
    import hsx.ledgers
    from hsx import writer

    ref = fault_reference
    fired = []

    def fault(path) -> None:
        if not fired:
            fired.append(str(path))
            raise OSError(code, os.strerror(code), str(path))

    real_close, real_append, real_atomic, real_open = (writer.UnitFile.close, hsx.ledgers.append_synced,
                                                       hsx.info.atomic_write, hsx.files.open_no_follow)
    units = []

    def close(self):
        units.append(1)
        if len(units) == 7 and not self.closed:  # (the unit file's last bytes go out as it closes)
            real_close(self)
            fault(self.path)
        return real_close(self)

    appended = []

    def append_synced(path, text):
        if path.name.startswith("manifest-"):
            appended.append(1)
            if len(appended) == 5:
                fault(path)
        return real_append(path, text)

    def atomic_write(path, text):
        if path.name == "hsx.json":
            fault(path.with_name(".hsx.json.tmp"))
        return real_atomic(path, text)

    def open_no_follow(path, flags):
        if path.name == "lock":
            fault(path)
        return real_open(path, flags)

    patch = {"unit_write": (writer.UnitFile, "close", close), "manifest": (hsx.ledgers, "append_synced", append_synced),
             "hsx.json": (hsx.info, "atomic_write", atomic_write),
             "lock": (hsx.files, "open_no_follow", open_no_follow)}[where]
    monkeypatch.setattr(*patch)
    out = tmp_path / "out"
    rc, _, err = hsx_main(ref.argv(out))
    assert fired, where
    what = {errno.EFBIG: "file too large", errno.EIO: "I/O error", errno.EROFS: "read-only file system",
            errno.EACCES: "permission denied"}[code]
    assert_one_error_line(rc, err, what, fired[0], "run the same command to continue")
    assert rc == 1
    kept = assert_kept_and_unfinished(out, ref)
    assert kept >= {"unit_write": 1, "manifest": 1, "hsx.json": ref.units, "lock": 0}[where]
    monkeypatch.undo()
    rc, _, err = hsx_main(ref.argv(out))
    assert rc == 0, err
    assert_equals_reference(out, ref, verify=False)


def test_an_output_dir_on_a_read_only_mount_is_one_line_on_its_lock(tmp_path, fault_reference):
    """A finished output on a read-only mount (a bind mount remounted ro, where this machine allows it): extract,
    merge into it and export --delete-source each say so in one line naming .hsx/lock, and change nothing."""
    ref = fault_reference
    src = tmp_path / "src"
    shutil.copytree(ref.out, src)
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True).returncode != 0:
            pytest.skip("cannot remount read-only here")
        listing = sorted(str(p.relative_to(ro)) for p in ro.rglob("*"))
        for argv in (ref.argv(ro), ["merge", str(ro), str(ro)],
                     [*export_argv(ro, tmp_path / "dest"), "--delete-source"]):
            rc, _, err = hsx_main(argv)
            assert_one_error_line(rc, err, "read-only file system", str(ro / ".hsx" / "lock"),
                                  "make it writable or use another dir")
            assert rc == 1
        assert sorted(str(p.relative_to(ro)) for p in ro.rglob("*")) == listing
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)


# ---- merge -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["full-disk", "ulimit", "link"])
def test_a_file_system_error_during_merge_is_one_line_and_a_rerun_merges(tmp_path, monkeypatch, fault_reference,
                                                                         how):
    """OUT on a full disk (a 16 KiB tmpfs), under `ulimit -f` (a 24-line traceback), or ENOSPC as a unit is linked
    (a full inode table): one line naming the path, exit 1, no source unit changed, OUT not finished; the same
    merge, the cause gone, gives the reference's output."""
    import hsx
    import hsx.merge

    ref = fault_reference
    nodes = split_nodes(ref, tmp_path)
    units = {p: p.read_bytes() for n in nodes for p in (n / "data").iterdir()}
    argv = ["merge", str(tmp_path / "disk" / "joined" if how == "full-disk" else tmp_path / "joined"),
            *map(str, nodes)]
    out = Path(argv[1])
    with contextlib.ExitStack() as stack:
        if how == "full-disk":
            resize = stack.enter_context(small_tmpfs(tmp_path / "disk", 16 << 10))
            rc, _, err = hsx_main(argv)
            needles = ("disk full while writing", str(out))
        elif how == "ulimit":
            rc, err = hsx_limited(argv, 1000)
            needles = ("file too large", "ulimit -f", str(out))
        else:
            real_symlink, made = os.symlink, []

            def symlink(target, link, *a, **k):
                made.append(link)
                if len(made) == 3:  # (as os.symlink names them: the target, then the link written)
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target), None, str(link))
                return real_symlink(target, link, *a, **k)

            monkeypatch.setattr(hsx.merge.os, "symlink", symlink)
            rc, _, err = hsx_main(argv)
            monkeypatch.setattr(hsx.merge.os, "symlink", real_symlink)
            needles = ("disk full while writing", str(made[2]))
        assert_one_error_line(rc, err, *needles, "run the same command to continue")
        assert rc == 1 and not (out / "hsx.json").exists()
        assert {p: p.read_bytes() for n in nodes for p in (n / "data").iterdir()} == units
        if how == "full-disk":
            resize(1 << 20)
        rc, _, err = hsx_main(argv)
        assert rc == 0, err
        assert hsx.load(str(out), verify=True).data.table.equals(hsx.load(str(ref.out)).data.table)


# ---- export ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["record", "full-disk"])
def test_an_export_that_failed_to_write_continues_on_a_rerun(tmp_path, fault_reference, how):
    """`ulimit -f` as the export writes its record (hsx-export.json): its own .hsx-export.json.tmp was then called
    foreign and every later run refused. DEST on a full disk part-way: one line. Either way the rerun finishes
    the export, equal to one that never failed."""
    ref = fault_reference
    whole = tmp_path / "whole"
    rc, _, err = hsx_main(export_argv(ref.out, whole))
    assert rc == 0, err
    files = sorted(str(p.relative_to(whole)) for p in whole.rglob("*.ckpt"))
    with contextlib.ExitStack() as stack:
        if how == "record":
            dest = tmp_path / "dest"
            rc, err = hsx_limited(export_argv(ref.out, dest), 100)
            needles = ("file too large", str(dest))
        else:
            resize = stack.enter_context(small_tmpfs(tmp_path / "disk", data_bytes(ref.out) // 4))
            dest = tmp_path / "disk" / "dest"
            rc, _, err = hsx_main(export_argv(ref.out, dest))
            needles = ("disk full while writing", str(dest))
            resize(data_bytes(ref.out) * 4)
        assert_one_error_line(rc, err, *needles, "run the same command to continue")
        assert rc == 1
        rc, out, err = hsx_main(export_argv(ref.out, dest))
        assert rc == 0, err
        assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*.ckpt")) == files
        for f in files:
            assert (dest / f).read_bytes() == (whole / f).read_bytes()
        assert not list(dest.rglob(".hsx-*"))  # its temporary files, the record's too, are gone


@pytest.mark.parametrize("ledger", ["consumed-trainer-00000.jsonl", "uploaded-main-00000.jsonl", "exported.jsonl"])
def test_a_record_appended_after_a_ledger_line_a_full_disk_cut_is_not_lost(tmp_path, ledger):
    """A full disk (or a size limit, or a kill) cuts an append mid-line; the next append (the trainer's next commit,
    the rerun's upload record) joined that torn line and readers passed over the joined line, so the record
    appended after the fault was lost (a follow consumer's progress read back older, its units deleted as
    consumed). Every ledger hsx appends to goes through `append_synced`, which ends a torn line first."""
    from hsx.files import append_synced, read_jsonl

    path = tmp_path / ledger
    append_synced(path, '{"unit": "000-00000", "row": 3}\n')
    with open(path, "a") as f:  # what the write a full disk stopped left behind
        f.write('{"unit": "000-00001", "ro')
    append_synced(path, '{"unit": "000-00002", "row": 7}\n{"unit": "000-00003", "row": 1}\n')
    assert [r["unit"] for r in read_jsonl(path)] == ["000-00000", "000-00002", "000-00003"]


def test_a_file_system_error_in_datasets_cache_is_named_not_blamed_on_the_dataset(tmp_path):
    """`hsx plan` (and extract) read the input through datasets, which writes its cache (HF_DATASETS_CACHE): a size
    limit (or full disk) there said "cannot read dataset ...: OSError: [Errno 27] File too large", blaming the input.
    Now the file-system line, naming the cache, and the same command continues once the cause is gone."""
    demo = Path(__file__).resolve().parents[1] / "recipes" / "demo.yaml"
    cache = tmp_path / "cache"
    rc, err = hsx_limited(["plan", "--config", str(demo)], 8 << 10, HF_DATASETS_CACHE=str(cache))
    line = assert_one_error_line(rc, err, "file too large", str(cache), "run the same command to continue")
    assert rc == 1 and "cannot read dataset" not in line
    rc, err = hsx_limited(["plan", "--config", str(demo)], resource.RLIM_INFINITY, HF_DATASETS_CACHE=str(cache))
    assert rc == 0, err


from helpers import fault_argv, the_error_line  # noqa: E402


# ---- a disk full as a unit's file closes; an output dir or DEST that cannot be made --------------------------------

def test_a_full_disk_when_a_unit_file_closes_is_one_line(tmp_path, monkeypatch, model4, small_chat_path):
    """ENOSPC as a unit's file is closed: datasets' map then finalizes its writer again, on the closed stream, and
    raises 'I/O operation on closed file' with the ENOSPC as its context. Still the disk-full line."""
    import errno

    from hsx import writer

    real_close = writer.UnitFile.close
    fired = []

    def close(self):
        if not fired and not self.closed:
            fired.append(1)
            real_close(self)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_close(self)

    monkeypatch.setattr(writer.UnitFile, "close", close)
    rc, _, err = hsx_main(fault_argv(model4.path, small_chat_path, tmp_path / "out"))
    assert fired
    assert_one_error_line(rc, err, "disk full while writing", "run the same command to continue")
    monkeypatch.setattr(writer.UnitFile, "close", real_close)
    rc, _, err = hsx_main(fault_argv(model4.path, small_chat_path, tmp_path / "out"))
    assert rc == 0, err


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


def test_no_usable_temporary_directory_is_one_line(tmp_path, finished):
    """`ulimit -f 0; hsx merge ...` ended in a 47-line traceback: `import datasets` (through dill) asks for a
    temporary directory, and a file size limit of 0 leaves Python none it can write to. One line, exit 1, saying
    why, before anything is written."""
    out = tmp_path / "merged"
    rc, err = hsx_limited(["merge", str(out), str(finished)], 0)
    line = assert_one_error_line(rc, err, "no usable temporary directory", "ulimit -f")
    assert rc == 1 and not out.exists(), line
