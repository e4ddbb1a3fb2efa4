"""Inputs and output dirs that are not what they seem (issue 14): local weights, tokenizer files and datasets
identified by content; no delete or write through a symbolic link; `hsx merge` locked and careful; hsx.json's
unit list checked by readers, resume, and push."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import assert_same_output, child_env, fault_argv, hsx_main, manifest_records, message_lines

import hsx
from hsx import fingerprint
from hsx.config import HsxError
from hsx.merge import merge
from hsx.checksums import file_crc32
from hsx.files import atomic_write
from hsx.sink import OutputDir


def one_error_line(rc: int, err: str, *needles: str) -> str:
    assert rc != 0
    assert "Traceback" not in err, err
    lines = [line for line in message_lines(err) if line.startswith("hsx: error: ")]
    assert len(lines) == 1, message_lines(err)
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def flip_tensor_bytes(f: Path, keep_mtime: bool = True) -> None:
    """Rewrite the last bytes of a safetensors file's data (a tensor's values): same size, same header, same
    shapes and dtypes; the modification time set back to what it was."""
    st = f.stat()
    with open(f, "r+b") as fh:
        (header,) = struct.unpack("<Q", fh.read(8))
        assert st.st_size - 16 > 8 + header
        fh.seek(st.st_size - 16)
        old = fh.read(16)
        fh.seek(st.st_size - 16)
        fh.write(bytes(b ^ 0x5A for b in old))
    if keep_mtime:
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size


def flip_unit_bytes(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


@pytest.fixture
def digest_cache(tmp_path, monkeypatch):
    path = tmp_path / "hf-home" / "hsx" / "file-digests.json"
    monkeypatch.setattr(fingerprint, "cache_file", lambda: path)
    return path


@pytest.fixture
def inputs(tmp_path, model4, small_chat_path, digest_cache) -> dict[str, Path]:
    """A private copy of the model folder and the dataset (these tests rewrite them)."""
    root = tmp_path / "inputs"
    shutil.copytree(model4.path, root / "model")
    root.mkdir(exist_ok=True)
    shutil.copy(small_chat_path, root / "chat.jsonl")
    return {"root": root, "model": root / "model", "dataset": root / "chat.jsonl", "out": tmp_path / "out"}


def run(argv: list[str]) -> tuple[int, str, str]:
    return hsx_main(argv)


# ---- 3: weights and tokenizer files by content ------------------------------------------------------------------

def test_digests_are_cached_and_a_rewrite_with_the_mtime_set_back_is_read_again(tmp_path, digest_cache, monkeypatch):
    f = tmp_path / "w.safetensors"
    f.write_bytes(struct.pack("<Q", 2) + b"{}" + os.urandom(1 << 20))
    reads = []
    real = fingerprint.sha256_of
    monkeypatch.setattr(fingerprint, "sha256_of", lambda p: reads.append(p) or real(p))
    monkeypatch.setattr(fingerprint, "RACY_NS", 0)  # (a file written just now is racy: read again)
    first = fingerprint.file_digests([f])
    assert fingerprint.file_digests([f]) == first and len(reads) == 1  # unchanged: not read again
    assert digest_cache.exists()
    time.sleep(0.05)  # (ctime has a coarse clock)
    flip_tensor_bytes(f)
    again = fingerprint.file_digests([f])
    assert len(reads) == 2 and again[0][0] == first[0][0] and again[0][1] != first[0][1]
    import hashlib

    assert again[0][1] == hashlib.sha256(f.read_bytes()).hexdigest()  # all bytes, the Hub's LFS oid


@pytest.mark.parametrize("rewrite", ["weights", "tokenizer"])
def test_a_resume_with_rewritten_weights_or_tokenizer_is_refused(inputs, rewrite):
    argv = fault_argv(inputs["model"], inputs["dataset"], inputs["out"])
    rc, _, err = run(argv)
    assert rc == 0, err
    (inputs["out"] / "hsx.json").unlink()  # as a kill before finalization leaves it: a resume
    records = manifest_records(inputs["out"])
    time.sleep(0.05)
    if rewrite == "weights":
        flip_tensor_bytes(inputs["model"] / "model.safetensors")
        name = "model.safetensors"
    else:
        f = inputs["model"] / "tokenizer.json"
        st = f.stat()
        f.write_text(f.read_text() + " ")  # one byte more: the same tokenizer, other bytes
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        name = "tokenizer.json"
    rc, _, err = run(argv)
    one_error_line(rc, err, "different job", f"model: file {name}")
    assert manifest_records(inputs["out"]) == records  # nothing written with the other model


def test_a_separate_local_tokenizer_is_identified_by_content(inputs, tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    for f in inputs["model"].iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, tok / f.name)
    a = fingerprint.tokenizer_identity(str(tok))
    assert fingerprint.tokenizer_identity(str(tok) + "/") == a and "tokenizer.json" in a["files"]
    (tok / "tokenizer_config.json").write_text((tok / "tokenizer_config.json").read_text() + "\n")
    assert fingerprint.differing_files(a, fingerprint.tokenizer_identity(str(tok))) == ["tokenizer_config.json"]


# ---- 9: the same recipe from another working directory, or spelled another way ---------------------------------

def test_the_same_job_from_another_directory_and_spelling_is_the_same_job(inputs, tmp_path, monkeypatch):
    root = inputs["root"]
    monkeypatch.chdir(root)
    rc, _, err = run(fault_argv("model", "chat.jsonl", "out"))
    assert rc == 0, err
    first = json.loads((root / "out" / "hsx.json").read_text())["fingerprint"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "m").symlink_to(root / "model")
    shutil.copytree(root / "model", elsewhere / "model-copy")
    monkeypatch.chdir(elsewhere)
    for model in ("../inputs/model/", "m", str(elsewhere / "model-copy")):
        rc, stdout, err = run(fault_argv(model, "../inputs/./chat.jsonl", "../inputs/out"))
        assert rc == 0, err
        assert "already complete" in stdout and "--overwrite" not in stdout + err
    assert json.loads((root / "out" / "hsx.json").read_text())["fingerprint"] == first
    job = json.loads((root / "out" / ".hsx" / "job.json").read_text())
    assert set(job["inputs"]["model"]["files"]) >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert str(root) not in json.dumps(job["inputs"])  # no path in what identifies the job


def test_a_different_dataset_is_named_by_the_file_that_differs(inputs):
    argv = fault_argv(inputs["model"], inputs["dataset"], inputs["out"])
    assert run(argv)[0] == 0
    with open(inputs["dataset"], "a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                                            "content": "hello"}]}) + "\n")
    rc, _, err = run(argv)
    one_error_line(rc, err, "different job", "input: file *.jsonl")


# ---- 4: links, and merge's locks ---------------------------------------------------------------------------------

@pytest.fixture
def victim(tmp_path) -> Path:
    v = tmp_path / "victim"
    (v / "data").mkdir(parents=True)
    for name in ("job.json", "manifest-00000.jsonl", "summary.json", "README.md", "hsx.json"):
        (v / name).write_text("precious")
    (v / "data" / "train-000-00000.arrow").write_text("precious")
    return v


def tree(root: Path) -> dict[str, bytes]:
    """Every file's bytes (lock files aside: taking a lock creates them)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(("lock", "busy"))}


@pytest.mark.parametrize("link", [".hsx", "data", ".hsx/tmp", ".hsx/job.json"])
def test_overwrite_never_deletes_through_a_link(inputs, victim, link):
    argv = fault_argv(inputs["model"], inputs["dataset"], inputs["out"])
    assert run(argv)[0] == 0
    out = inputs["out"]
    target = out / link
    shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    target.symlink_to(victim if link != ".hsx/job.json" else victim / "job.json")
    before = tree(victim)
    rc, _, err = run(argv + ["--overwrite"])
    one_error_line(rc, err, "symbolic link", link)
    assert tree(victim) == before


def test_unit_links_lose_the_link_only(tmp_path, victim):
    out = OutputDir(tmp_path / "out")
    with out.locked():
        out.claim({"fingerprint": "a", "inputs": {}}, False)
        out.data.mkdir()
        (out.data / "train-000-00000.arrow").symlink_to(victim / "data" / "train-000-00000.arrow")
        out.claim({"fingerprint": "b", "inputs": {}}, overwrite=True)
    assert not (out.data / "train-000-00000.arrow").is_symlink()
    assert (victim / "data" / "train-000-00000.arrow").read_text() == "precious"


def test_atomic_write_replaces_a_link_never_its_target(tmp_path, victim):
    (tmp_path / ".job.json.tmp").symlink_to(victim / "job.json")
    (tmp_path / "hsx.json").symlink_to(victim / "hsx.json")
    atomic_write(tmp_path / "job.json", "mine")
    atomic_write(tmp_path / "hsx.json", "mine")
    assert (victim / "job.json").read_text() == (victim / "hsx.json").read_text() == "precious"
    assert (tmp_path / "job.json").read_text() == "mine" and not (tmp_path / "hsx.json").is_symlink()


@pytest.fixture(scope="module")
def finished(tmp_path_factory, model4, small_chat_path) -> Path:
    out = tmp_path_factory.mktemp("trust") / "finished"
    rc, _, err = hsx_main(fault_argv(model4.path, small_chat_path, out, "--unit-tokens", "200"))
    assert rc == 0, err
    assert len(list((out / "data").glob("*.arrow"))) >= 4
    return out


def copy_of(finished: Path, dest: Path) -> Path:
    shutil.copytree(finished, dest, symlinks=True)
    return dest


def split_nodes(src: Path, root: Path) -> list[Path]:
    from test_merge import split_like_two_nodes

    return split_like_two_nodes(src, root)


def test_merge_refuses_a_foreign_dir_and_keeps_its_files(finished, tmp_path):
    nodes = split_nodes(finished, tmp_path)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "README.md").write_text("my notes")
    (foreign / "hsx.json").write_text('{"mine": true}')
    with pytest.raises(HsxError, match="not written by hsx"):
        merge(str(foreign), [str(n) for n in nodes], log=lambda *a: None)
    assert tree(foreign) == {"README.md": b"my notes", "hsx.json": b'{"mine": true}'}


@pytest.mark.parametrize("rank", [0, 3])
def test_merge_refuses_a_dir_a_job_is_running_in(finished, tmp_path, rank):
    nodes = split_nodes(finished, tmp_path)
    before = {n: tree(n) for n in nodes}
    with OutputDir(nodes[1], rank=rank).locked():  # a running job's rank `rank` holds its locks
        with pytest.raises(HsxError, match="in use by a running hsx job"):
            merge(str(nodes[0]), [str(n) for n in nodes], log=lambda *a: None)
    assert {n: tree(n) for n in nodes} == before
    with pytest.raises(HsxError, match="in use by another hsx job|being merged"):
        with OutputDir(nodes[0]).locked_whole():
            with OutputDir(nodes[0], rank=5).locked():  # and no job starts while a merge runs
                pass


def test_merge_keeps_the_units_of_a_finished_output(finished, tmp_path):
    nodes = split_nodes(finished, tmp_path)
    whole = copy_of(finished, tmp_path / "whole")
    before = tree(whole / "data")
    merge(str(whole), [str(nodes[0]), str(nodes[1]), str(whole)], log=lambda *a: None)
    assert tree(whole / "data") == before and not any(p.is_symlink() for p in (whole / "data").iterdir())
    assert hsx.load(str(whole), verify=True).data.table.equals(hsx.load(str(finished)).data.table)
    other = copy_of(finished, tmp_path / "other-job")
    job = json.loads((other / ".hsx" / "job.json").read_text())
    (other / ".hsx" / "job.json").write_text(json.dumps({**job, "fingerprint": "another"}))
    with pytest.raises(HsxError, match="another job's output"):
        merge(str(other), [str(n) for n in nodes], log=lambda *a: None)


# ---- 5: readers that notice damage --------------------------------------------------------------------------------

def test_hsx_json_lists_every_unit(finished):
    info = json.loads((finished / "hsx.json").read_text())
    recs = {r["file"]: r for r in manifest_records(finished)}
    assert [f["file"] for f in info["files"]] == sorted(recs) == sorted(p.name for p in (finished / "data").iterdir())
    for f in info["files"]:
        r = recs[f["file"]]
        assert (f["unit"], f["rows"], f["bytes"], f["crc32"]) == (r["unit"], r["rows"], r["bytes"], r["crc32"])
        assert f["crc32"] == file_crc32(finished / "data" / f["file"])
    assert sum(f["rows"] for f in info["files"]) == info["counts"]["rows_written"]


def test_load_refuses_a_damaged_or_incomplete_dir(finished, tmp_path):
    rows = info_rows(finished)
    units = sorted((finished / "data").glob("*.arrow"))
    flipped = copy_of(finished, tmp_path / "flipped")
    flip_unit_bytes(flipped / "data" / units[1].name)
    assert len(hsx.load(str(flipped))) == rows  # sizes agree: only verify=True reads every byte
    with pytest.raises(HsxError, match=f"damaged.*{units[1].name}: its bytes do not match its CRC-32"):
        hsx.load(str(flipped), verify=True)
    deleted = copy_of(finished, tmp_path / "deleted")
    (deleted / "data" / units[2].name).unlink()
    with pytest.raises(HsxError, match=f"damaged: 1 of the {len(units)} files .*{units[2].name}: missing"):
        hsx.load(str(deleted))
    with pytest.raises(HsxError, match="damaged"):
        hsx.torch_view(str(deleted))
    with pytest.warns(UserWarning, match="1 are missing or damaged"):
        part = hsx.load(str(deleted), allow_incomplete=True)
    assert len(part) == rows - unit_rows(finished, units[2].name)
    truncated = copy_of(finished, tmp_path / "truncated")
    with open(truncated / "data" / units[0].name, "r+b") as f:
        f.truncate(100)
    with pytest.raises(HsxError, match="100 bytes, not"):
        hsx.load(str(truncated))
    killed = copy_of(finished, tmp_path / "killed")  # as a kill before finalization leaves it
    (killed / "hsx.json").unlink()
    (killed / "data" / units[-1].name).unlink()
    with pytest.raises(HsxError, match=r"not a finished hsx output \(\d+ of \d+ units committed"):
        hsx.load(str(killed))
    with pytest.warns(UserWarning, match="the job is not finished"):
        assert len(hsx.load(str(killed), allow_incomplete=True)) == rows - unit_rows(finished, units[-1].name)


def test_load_dataset_on_a_dir_with_a_unit_gone_fails_instead_of_fewer_rows(finished, tmp_path):
    from datasets import load_dataset

    gone = copy_of(finished, tmp_path / "trust-unit-gone")  # a folder name of its own (datasets' cache key)
    name = sorted((gone / "data").glob("*.arrow"))[1].name
    (gone / "data" / name).unlink()
    with pytest.raises(Exception, match=name.replace(".", r"\.")):
        sum(1 for _ in load_dataset(str(gone), split="train", streaming=True))
    card = (gone / "README.md").read_text()
    assert "train-*.arrow" not in card.split("---")[1]


def test_load_dataset_on_an_unfinished_dir_fails_instead_of_part_of_it(finished, tmp_path):
    from datasets import load_dataset

    out = tmp_path / "trust-unfinished"  # a folder name of its own (datasets' cache key)
    with OutputDir(out).locked():
        assert OutputDir(out).claim({"fingerprint": "a", "inputs": {}}, False) == "new"
    shutil.copytree(finished / "data", out / "data")  # units committed so far
    with pytest.raises(FileNotFoundError, match="NOT-FINISHED-run-the-same-hsx-extract-command"):
        load_dataset(str(out), split="train", streaming=True)
    with pytest.raises(FileNotFoundError, match="NOT-FINISHED"):
        load_dataset(str(out), split="train")


def info_rows(out: Path) -> int:
    return json.loads((out / "hsx.json").read_text())["counts"]["rows_written"]


def unit_rows(out: Path, name: str) -> int:
    return next(f["rows"] for f in json.loads((out / "hsx.json").read_text())["files"] if f["file"] == name)


# ---- 6: resume checks what it keeps -------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["flipped", "deleted", "truncated", "flipped-no-hsx-json"])
def test_rerun_on_a_damaged_finished_dir_redoes_the_damaged_unit(fault_reference, tmp_path, damage):
    out = copy_of(fault_reference.out, tmp_path / "out")
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
    out = copy_of(fault_reference.out, tmp_path / "out")
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


# ---- 7: push checks every file, follows no link ------------------------------------------------------------------

def test_push_uploads_no_link_and_no_damaged_unit(finished, tmp_path):
    from test_hub import FakeHfApi

    from hsx.hub import push_output

    secret = tmp_path / "secret.txt"
    secret.write_text("hf_TopSecretTokenCCCCCCCCCCCCCCCCCCCC")
    out = copy_of(finished, tmp_path / "out")
    (out / "data" / "train-999-00000.arrow").symlink_to(secret)
    api = FakeHfApi()
    with pytest.raises(HsxError, match="data/ holds 1 data file.* does not list"):
        push_output(out, "someone/states", api=api, log=lambda *a: None)
    assert not pushed(api)

    swapped = copy_of(finished, tmp_path / "swapped")  # a unit replaced by a link to the secret
    name = sorted((swapped / "data").glob("train-0*.arrow"))[0].name
    (swapped / "data" / name).unlink()
    (swapped / "data" / name).symlink_to(secret)
    flipped = copy_of(finished, tmp_path / "flipped")
    flip_unit_bytes(flipped / "data" / name)
    for bad, why in ((swapped, "is a symbolic link, and not one `hsx merge` made"),
                     (flipped, "does not match hsx.json")):
        api = FakeHfApi()
        with pytest.raises(HsxError, match=f"{name} {re.escape(why)}"):
            push_output(bad, "someone/states", api=api, log=lambda *a: None)
        assert f"data/{name}" not in api.repos.get("someone/states", {}).get("branches", {}).get("main", {})
        assert not any(b"TopSecret" in v for v in pushed(api).values())
    linked = copy_of(finished, tmp_path / "linked-card")
    (linked / "README.md").unlink()
    (linked / "README.md").symlink_to(secret)
    with pytest.raises(HsxError, match="symbolic link"):
        push_output(linked, "someone/states", api=FakeHfApi(), log=lambda *a: None)


def test_a_merged_output_pushes_its_linked_units(finished, tmp_path):
    from test_hub import FakeHfApi

    from hsx.hub import push_output

    nodes = split_nodes(finished, tmp_path)
    merge(str(nodes[0]), [str(n) for n in nodes], log=lambda *a: None)
    api = FakeHfApi()
    push_output(nodes[0], "someone/states", api=api, log=lambda *a: None)
    pushed = {k for k in api.files() if k.startswith("data/")}
    assert pushed == {f"data/{p.name}" for p in (finished / "data").iterdir()}
    for p in (finished / "data").iterdir():
        assert api.files()[f"data/{p.name}"] == p.read_bytes()


def test_a_files_list_that_points_out_of_data_is_refused(finished, tmp_path):
    from test_hub import FakeHfApi

    from hsx.hub import push_output

    secret = tmp_path / "secret.txt"
    secret.write_text("hf_TopSecretTokenCCCCCCCCCCCCCCCCCCCC")
    out = copy_of(finished, tmp_path / "out")
    info = json.loads((out / "hsx.json").read_text())
    info["files"].append({"file": "../../secret.txt", "bytes": secret.stat().st_size, "crc32": None, "rows": 0})
    (out / "hsx.json").write_text(json.dumps(info))
    with pytest.raises(HsxError, match="`files` is damaged"):
        push_output(out, "someone/states", api=FakeHfApi(), log=lambda *a: None)
    with pytest.raises(HsxError, match="`files` is damaged"):
        hsx.load(str(out))


# ---- hsx.json's list, the manifests, the counts and data/ tell one story -------------------------------------------

def edit_info(out: Path, **changes) -> None:
    info = json.loads((out / "hsx.json").read_text())
    info.update(changes)
    (out / "hsx.json").write_text(json.dumps(info))


def pushed(api) -> dict[str, bytes]:
    """What a FakeHfApi holds on someone/states' main branch (nothing when no repo was made)."""
    return api.repos.get("someone/states", {}).get("branches", {}).get("main", {})


def refused_everywhere(out: Path, *needles: str) -> None:
    """hsx.load, hsx verify and a push all refuse `out` in one line naming what disagrees; nothing is uploaded."""
    from test_hub import FakeHfApi

    from hsx.hub import push_output

    for read in (lambda: hsx.load(str(out)), lambda: hsx.load(str(out), verify=True)):
        with pytest.raises(HsxError) as e:
            read()
        assert all(n in str(e.value) for n in needles) and "\n" not in str(e.value), str(e.value)
    rc, _, err = hsx_main(["verify", str(out), "--samples", "0"])
    assert rc == 1 and "Traceback" not in err
    assert [line for line in message_lines(err) if all(n in line for n in needles)] == message_lines(err)
    assert len(message_lines(err)) == 1 and message_lines(err)[0].startswith("hsx: verify failed: ")
    api = FakeHfApi()
    with pytest.raises(HsxError, match=re.escape(needles[0])):
        push_output(out, "someone/states", api=api, log=lambda *a: None)
    assert not pushed(api)


def test_a_cut_or_emptied_file_list_is_refused_not_read_as_fewer_rows(finished, tmp_path):
    info = json.loads((finished / "hsx.json").read_text())
    rows = info["counts"]["rows_written"]
    cut = copy_of(finished, tmp_path / "cut")
    edit_info(cut, files=info["files"][:2])
    listed = sum(f["rows"] for f in info["files"][:2])
    refused_everywhere(cut, f"`files` list 2 file(s) of {listed:,} rows, its counts say {rows:,} rows")
    emptied = copy_of(finished, tmp_path / "emptied")
    edit_info(emptied, files=[])
    refused_everywhere(emptied, f"`files` list 0 file(s) of 0 rows, its counts say {rows:,} rows")
    # the counts made to fit the cut list: the manifests still name every unit
    fitted = copy_of(finished, tmp_path / "fitted")
    edit_info(fitted, files=info["files"][:2], counts={**info["counts"], "rows_written": listed})
    refused_everywhere(fitted, f"hsx.json lists 2 file(s), the manifests in .hsx/ {len(info['files'])}",
                       "is in the manifests but not listed")
    # and without .hsx/ (as a copy of the Hub's files has it): data/ still holds the units it does not list
    shutil.rmtree(fitted / ".hsx")
    refused_everywhere(fitted, f"data/ holds {len(info['files']) - 2} data file(s) hsx.json does not list")
    # an older hsx's hsx.json without a list, its data files cut: their rows against the counts
    older = copy_of(finished, tmp_path / "older")
    info_older = {k: v for k, v in info.items() if k != "files"}
    (older / "hsx.json").write_text(json.dumps(info_older))
    shutil.rmtree(older / ".hsx")
    (older / "data" / info["files"][0]["file"]).unlink()
    with pytest.raises(HsxError, match=f"hold {rows - info['files'][0]['rows']:,} rows, its hsx.json counts {rows:,}"):
        hsx.load(str(older))


def test_load_refuses_a_data_file_hsx_json_does_not_list(finished, tmp_path):
    planted = copy_of(finished, tmp_path / "planted")
    first = sorted((planted / "data").glob("*.arrow"))[0]
    shutil.copy(first, planted / "data" / "train-999-00000.arrow")
    refused_everywhere(planted, "data/ holds 1 data file(s) hsx.json does not list (train-999-00000.arrow)",
                       "move away the files it does not list")


@pytest.mark.slow
def test_the_same_command_writes_a_changed_hsx_json_again(fault_reference, tmp_path):
    out = copy_of(fault_reference.out, tmp_path / "out")
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


# ---- no link is read or pushed but those `hsx merge` makes --------------------------------------------------------

def listed_link_to(out: Path, secret: Path, name: str = "train-998-00000.arrow") -> None:
    """A link in data/ to `secret`, listed in hsx.json with the secret's size and CRC-32 (and no rows)."""
    (out / "data" / name).symlink_to(secret)
    info = json.loads((out / "hsx.json").read_text())
    info["files"].append({"file": name, "unit": name[6:-6], "rows": 0, "bytes": secret.stat().st_size,
                          "crc32": file_crc32(secret)})
    (out / "hsx.json").write_text(json.dumps(info))


def test_a_listed_link_to_a_secret_is_neither_read_nor_pushed(finished, tmp_path):
    from test_hub import FakeHfApi

    from hsx.hub import push_output

    secret = tmp_path / "secret.txt"
    secret.write_text("hf_TopSecretTokenCCCCCCCCCCCCCCCCCCCC")
    with_state = copy_of(finished, tmp_path / "with-state")
    listed_link_to(with_state, secret)  # the manifests know no such unit
    refused_everywhere(with_state, "data/train-998-00000.arrow is listed in hsx.json but in no manifest")
    hub_copy = copy_of(finished, tmp_path / "hub-copy")  # no .hsx/ to compare with: the link itself is refused
    shutil.rmtree(hub_copy / ".hsx")
    listed_link_to(hub_copy, secret)
    refused_everywhere(hub_copy, "train-998-00000.arrow is a symbolic link, and not one `hsx merge` made")
    # a link that claims to be a merge's: hsx.json names the secret's folder as a merged dir
    evil = tmp_path / "evil"
    (evil / "data").mkdir(parents=True)
    shutil.copy(secret, evil / "data" / "train-998-00000.arrow")
    claimed = copy_of(finished, tmp_path / "claimed")
    shutil.rmtree(claimed / ".hsx")
    (claimed / "data" / "train-998-00000.arrow").symlink_to(evil / "data" / "train-998-00000.arrow")
    info = json.loads((claimed / "hsx.json").read_text())
    info["files"].append({"file": "train-998-00000.arrow", "unit": "998-00000", "rows": 0,
                          "bytes": secret.stat().st_size, "crc32": file_crc32(secret)})
    info["run"] = {"merged_from": [str(evil.resolve()), str(claimed.resolve())]}
    (claimed / "hsx.json").write_text(json.dumps(info))
    refused_everywhere(claimed, "train-998-00000.arrow is a symbolic link, and not one `hsx merge` made")
    for out in (with_state, hub_copy, claimed):
        api = FakeHfApi()
        with pytest.raises(HsxError):
            push_output(out, "someone/states", api=api, log=lambda *a: None)
        assert not any(b"TopSecret" in v for v in pushed(api).values())


def test_a_data_folder_that_is_a_link_is_not_read(finished, tmp_path):
    elsewhere = copy_of(finished, tmp_path / "elsewhere")
    out = copy_of(finished, tmp_path / "out")
    shutil.rmtree(out / "data")
    (out / "data").symlink_to(elsewhere / "data")
    refused_everywhere(out, "data is a symbolic link; hsx reads and pushes no link out of the output")


def test_merge_links_are_read_from_their_units(finished, tmp_path):
    nodes = split_nodes(finished, tmp_path)
    merge(str(tmp_path / "joined"), [str(n) for n in nodes], log=lambda *a: None)
    joined = tmp_path / "joined"
    ds = hsx.load(str(joined), verify=True)
    assert ds.data.table.equals(hsx.load(str(finished)).data.table)
    rc, _, err = hsx_main(["verify", str(joined), "--samples", "0"])
    assert rc == 0, err
    # a merged dir whose job.json is another job's is no known source
    job = json.loads((nodes[1] / ".hsx" / "job.json").read_text())
    (nodes[1] / ".hsx" / "job.json").write_text(json.dumps({**job, "fingerprint": "another"}))
    with pytest.raises(HsxError, match="is a symbolic link, and not one `hsx merge` made"):
        hsx.load(str(joined))


# ---- the same job writes the same bytes ----------------------------------------------------------------------------

@pytest.mark.slow
def test_the_same_job_writes_the_same_bytes(fault_reference, tmp_path):
    again = tmp_path / "again"  # in another process: nothing of the process (its id) may reach the bytes
    done = subprocess.run([sys.executable, "-m", "hsx", *fault_reference.argv(again)], env=child_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in (fault_reference.out / "data").iterdir())
    assert names == sorted(p.name for p in (again / "data").iterdir())
    differ = [n for n in names if (again / "data" / n).read_bytes() != (fault_reference.out / "data" / n).read_bytes()]
    assert not differ, differ


# ---- datasets' caches stay out of the output -----------------------------------------------------------------------

def test_cache_writing_ops_write_nothing_into_the_output(finished, tmp_path):
    out = copy_of(finished, tmp_path / "out")
    before = tree(out)
    ds = hsx.load(str(out))
    ids = ds["sample_id"]
    assert ds.sort("num_tokens")["num_tokens"] == sorted(ds["num_tokens"])
    assert len(ds.filter(lambda r: r["num_tokens"] > 20)) == sum(n > 20 for n in ds["num_tokens"])
    assert ds.map(lambda r: {"twice": 2 * r["sample_id"]})["twice"] == [2 * i for i in ids]
    assert sorted(ds.shuffle(seed=0).flatten_indices()["sample_id"]) == sorted(ids)
    assert ds.select(range(3)).sort("sample_id", reverse=True)["sample_id"] == sorted(ids[:3], reverse=True)
    assert tree(out) == before, sorted(set(tree(out)) - set(before))
    import datasets

    assert all(Path(f["filename"]).is_relative_to(datasets.config.HF_DATASETS_CACHE) for f in ds.cache_files)
    # cache files an older hsx let datasets write into data/: nothing reads or refuses them
    old_cache = out / "data" / "cache-0123456789abcdef.arrow"
    shutil.copy(sorted((out / "data").glob("train-*.arrow"))[0], old_cache)
    assert len(hsx.load(str(out), verify=True)) == len(ids)
    rc, _, err = hsx_main(["verify", str(out), "--samples", "0"])
    assert rc == 0, err
    from test_hub import FakeHfApi

    from hsx.hub import push_output

    api = FakeHfApi()
    push_output(out, "someone/states", api=api, log=lambda *a: None)
    assert "data/cache-0123456789abcdef.arrow" not in api.files()
