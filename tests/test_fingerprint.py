"""A job is identified by the content of its inputs (hsx.fingerprint): weights, tokenizer files and datasets by their
bytes, wherever and however they are named; a resume with other bytes is refused naming the file that differs. The
file-digest cache saves time but never decides: a damaged, forged, stale or FIFO cache is a miss."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
from pathlib import Path

import pytest

from helpers import assert_one_error_line, call_with_deadline, fault_argv, hsx_main, manifest_records, the_error_line

from hsx import fingerprint


# ---- a file's digest: cached by its stat, never trusted past it ----------------------------------------------------

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


def _cache_key(f: Path) -> str:
    return fingerprint._key(f, f.stat())


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
    assert again[0][1] == hashlib.sha256(f.read_bytes()).hexdigest()  # all bytes, the Hub's LFS oid


@pytest.mark.parametrize("entry", [None, "0" * 63, ["x"], {"sha256": None, "hashed_at_ns": 1},
                                   {"sha256": "A" * 64, "hashed_at_ns": 1}, {"sha256": "a" * 64}])
def test_a_null_or_malformed_cache_entry_is_a_miss(tmp_path, digest_cache, entry):
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(4096))
    os.utime(f, ns=(1, 1))
    digest_cache.parent.mkdir(parents=True)
    digest_cache.write_text(json.dumps({_cache_key(f): entry}))
    assert fingerprint.file_digests([f]) == [(4096, hashlib.sha256(f.read_bytes()).hexdigest())]


@pytest.mark.parametrize("content", ["{", "[1, 2]", "null", "\x00" * 10, "[" * 100000])
def test_a_damaged_cache_file_is_a_miss(tmp_path, digest_cache, content):
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc")
    digest_cache.parent.mkdir(parents=True)
    digest_cache.write_text(content)
    assert fingerprint.file_digests([f]) == [(3, hashlib.sha256(b"abc").hexdigest())]


def test_a_fifo_as_the_cache_file_is_a_miss_not_a_hang(tmp_path, digest_cache):
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc")
    digest_cache.parent.mkdir(parents=True)
    os.mkfifo(digest_cache)  # nobody writes it: a plain read would wait forever
    done, digests = call_with_deadline(lambda: fingerprint.file_digests([f]), 20, digest_cache)
    assert done and digests == [(3, hashlib.sha256(b"abc").hexdigest())]
    assert digest_cache.is_file()  # the digest was saved over it, as a regular file


def test_a_file_rewritten_within_a_coarse_clock_tick_is_read_again(tmp_path, digest_cache, monkeypatch):
    """A filesystem with a coarse clock keeps size, times and inode across an in-place rewrite within one tick:
    the key cannot tell, so an entry hashed in that tick must not stand for the new bytes."""
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 4096)
    frozen = _cache_key(f)
    monkeypatch.setattr(fingerprint, "_key", lambda path, st: frozen)  # the times the coarse clock kept
    assert fingerprint.file_digests([f])[0][1] == hashlib.sha256(b"a" * 4096).hexdigest()
    with open(f, "r+b") as fh:
        fh.write(b"b")
    assert fingerprint.file_digests([f])[0][1] == hashlib.sha256(b"b" + b"a" * 4095).hexdigest()


# ---- a job is its inputs' content: weights, tokenizer and data files, wherever and however they are named ----------

@pytest.mark.parametrize("rewrite", ["weights", "tokenizer"])
def test_a_resume_with_rewritten_weights_or_tokenizer_is_refused(inputs, rewrite):
    argv = fault_argv(inputs["model"], inputs["dataset"], inputs["out"])
    rc, _, err = hsx_main(argv)
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
    rc, _, err = hsx_main(argv)
    line = the_error_line(err)
    assert rc != 0 and "different job" in line and f"model: file {name}" in line, line
    assert manifest_records(inputs["out"]) == records  # nothing written with the other model


@pytest.mark.parametrize("form", ["digest", "entry", "null"])
def test_a_resume_never_takes_a_stale_or_forged_digest_for_the_swapped_weights(tmp_path, model4, small_chat_path,
                                                                                digest_cache, form):
    model = tmp_path / "model"
    shutil.copytree(model4.path, model)
    argv = fault_argv(model, small_chat_path, tmp_path / "out")
    rc, _, err = hsx_main(argv)
    assert rc == 0, err
    (tmp_path / "out" / "hsx.json").unlink()  # as a kill before finalization leaves it: a resume
    weights = model / "model.safetensors"
    old = hashlib.sha256(weights.read_bytes()).hexdigest()
    blob = bytearray(weights.read_bytes())
    blob[-8:] = bytes(b ^ 0x5A for b in blob[-8:])  # a tensor's bytes, the same size and header
    weights.write_bytes(bytes(blob))
    long_ago = time.time_ns() - 3600 * 10**9
    os.utime(weights, ns=(long_ago - 10**10, long_ago - 10**10))
    cache = json.loads(digest_cache.read_text())
    cache[_cache_key(weights)] = {"digest": old, "null": None,
                                  "entry": {"sha256": old, "hashed_at_ns": long_ago}}[form]
    digest_cache.write_text(json.dumps(cache))
    rc, _, err = hsx_main(argv)
    assert_one_error_line(rc, err, "different job", "model.safetensors")
    job = json.loads((tmp_path / "out" / ".hsx" / "job.json").read_text())
    assert job["inputs"]["model"]["files"]["model.safetensors"][1] == old


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


def test_the_same_job_from_another_directory_and_spelling_is_the_same_job(inputs, tmp_path, monkeypatch):
    root = inputs["root"]
    monkeypatch.chdir(root)
    rc, _, err = hsx_main(fault_argv("model", "chat.jsonl", "out"))
    assert rc == 0, err
    first = json.loads((root / "out" / "hsx.json").read_text())["fingerprint"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "m").symlink_to(root / "model")
    shutil.copytree(root / "model", elsewhere / "model-copy")
    monkeypatch.chdir(elsewhere)
    for model in ("../inputs/model/", "m", str(elsewhere / "model-copy")):
        rc, stdout, err = hsx_main(fault_argv(model, "../inputs/./chat.jsonl", "../inputs/out"))
        assert rc == 0, err
        assert "already complete" in stdout and "--overwrite" not in stdout + err
    assert json.loads((root / "out" / "hsx.json").read_text())["fingerprint"] == first
    job = json.loads((root / "out" / ".hsx" / "job.json").read_text())
    assert set(job["inputs"]["model"]["files"]) >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert str(root) not in json.dumps(job["inputs"])  # no path in what identifies the job


def test_a_different_dataset_is_named_by_the_file_that_differs(inputs):
    argv = fault_argv(inputs["model"], inputs["dataset"], inputs["out"])
    assert hsx_main(argv)[0] == 0
    with open(inputs["dataset"], "a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                                            "content": "hello"}]}) + "\n")
    rc, _, err = hsx_main(argv)
    line = the_error_line(err)
    assert rc != 0 and "different job" in line and "input: file *.jsonl" in line, line
