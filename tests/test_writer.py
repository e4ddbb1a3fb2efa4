"""hsx.writer: the unit file's bytes are datasets' own, its streamed CRC-32 is file_crc32's, errors surface; in
memory (tmpfs) the same through spares prepared ahead, and a job killed mid-write resumes to the same output. The
same job writes the same bytes, in another process too; file_crc32 neither waits on a FIFO nor follows a link."""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest

from hsx import checksums, sink, storage, writer
from hsx.checksums import file_crc32
from hsx.schema import OutputFormat
from hsx.writer import Spares, UnitFile, resolve_mode, unit_files

WIDTH, HIDDEN = 3 * 64, 64


@pytest.fixture
def shm():
    """A folder in a memory filesystem that takes spares ("mapped" mode), removed after."""
    if not (os.path.isdir("/dev/shm") and writer.filesystem_type("/dev/shm") == "tmpfs"
            and writer.supports_mapped("/dev/shm")):
        pytest.skip("no tmpfs with fallocate and MADV_POPULATE_WRITE here")
    folder = Path(tempfile.mkdtemp(prefix="hsx-test-", dir="/dev/shm"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _wait_prepared(spare, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not spare.covers(0, spare.size) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert spare.covers(0, spare.size)


def _where(mode, tmp_path, shm_folder):
    if mode == "direct" and not writer.supports_direct(tmp_path):
        pytest.skip("this filesystem takes no O_DIRECT")
    return shm_folder if mode == "mapped" else tmp_path


@pytest.fixture
def folder_for(request, tmp_path):
    """The folder a mode's test writes in: a tmpfs one for "mapped" (requested lazily: it may skip)."""
    return lambda mode: _where(mode, tmp_path, request.getfixturevalue("shm") if mode == "mapped" else None)


@pytest.mark.parametrize("mode", ["buffered", "direct", "mapped-short", "mapped-long", "mapped-none"])
def test_unit_file_bytes_and_crc_across_chunks(folder_for, monkeypatch, mode):
    """Small and big writes, pieces over several CRC chunks: the file holds exactly the bytes (its size is theirs
    after close), and the streamed CRC-32s are what file_crc32 reads back. mapped: a spare shorter than the file
    (the rest by pwrite), longer (cut at close), or none."""
    monkeypatch.setattr(checksums, "CRC_CHUNK", 3 << 20)  # several chunks in a small file
    monkeypatch.setattr(checksums, "CRC_PIECE", 1 << 20)
    monkeypatch.setattr(writer, "DIRECT_BLOCK", 1 << 20)
    monkeypatch.setattr(writer, "DIRECT_EXTEND", 3 << 20)  # (extended past the end, then cut at close)
    monkeypatch.setattr(writer, "SPARE_CHUNK", 1 << 20)
    folder = folder_for(mode.split("-")[0])
    data = np.random.default_rng(1).integers(0, 256, (10 << 20) + 123, dtype=np.uint8)
    parts = [b"\xff\xff\xff\xff", memoryview(data)[:100], pa.py_buffer(data[100:(7 << 20) + 5]), b"abc" * 999,
             memoryview(data)[(7 << 20) + 5:]]
    expected = b"".join(bytes(memoryview(p)) for p in parts)
    path = folder / "u.arrow"
    spares = None
    if mode.startswith("mapped"):
        size = {"mapped-short": 5 << 20, "mapped-long": 40 << 20, "mapped-none": None}[mode]
        spares = Spares(folder, [size] if size else [])
        if size:
            _wait_prepared(spares.next)  # (prepared ahead, as while the unit before is written)
    puts = {"copied": 0, "pwritten": 0}
    real_pwrite = writer.pwrite_all
    monkeypatch.setattr(writer, "pwrite_all", lambda fd, v, o: puts.__setitem__("pwritten", puts["pwritten"] + len(v))
                        or real_pwrite(fd, v, o))
    with UnitFile(path, mode.split("-")[0], spares=spares) as f:
        for p in parts:
            assert f.write(p) == len(memoryview(p))
    if spares is not None:
        spares.close()
    assert path.read_bytes() == expected and f.size == len(expected) == path.stat().st_size
    assert f.crc32() == file_crc32(path) and f.crc32().count(":") == 3
    if mode == "mapped-long":
        assert puts["pwritten"] == 0  # every byte copied into the prepared pages
    if mode in ("mapped-short", "mapped-none"):
        assert 0 < puts["pwritten"] <= len(expected) and (puts["pwritten"] < len(expected)) == (mode == "mapped-short")
    assert sorted(p.name for p in folder.iterdir()) == ["u.arrow"]  # no spare left


@pytest.mark.parametrize("mode", ["buffered", "direct", "mapped"])
def test_unit_files_share_one_checksum_pool_and_leave_it_running(folder_for, monkeypatch, mode):
    """A job's units checksum on one pool (hsx.checksums.checksum_pool): each file's bytes and CRC-32s are its own,
    closing a file leaves the shared pool running (the next unit uses it), and no file starts threads of its own."""
    monkeypatch.setattr(checksums, "CRC_CHUNK", 2 << 20)
    monkeypatch.setattr(checksums, "CRC_PIECE", 1 << 20)
    monkeypatch.setattr(writer, "DIRECT_BLOCK", 1 << 20)
    monkeypatch.setattr(writer, "SPARE_CHUNK", 1 << 20)
    folder = folder_for(mode)
    rng = np.random.default_rng(2)
    blobs = [rng.bytes((3 << 20) + 17), rng.bytes((5 << 20) + 1), rng.bytes(4097)]
    started = []
    monkeypatch.setattr(checksums, "checksum_pool", lambda threads=None: started.append(threads))  # (none may be made)
    pool = writer.ThreadPoolExecutor(max_workers=3, thread_name_prefix="hsx-crc")
    spares = Spares(folder, [len(b) for b in blobs]) if mode == "mapped" else None
    try:
        for i, blob in enumerate(blobs):
            path = folder / f"u{i}.arrow"
            with UnitFile(path, mode, spares=spares, pool=pool) as f:
                f.write(blob[:1000])
                f.write(memoryview(blob)[1000:])
            assert path.read_bytes() == blob and f.crc32() == file_crc32(path)
            assert pool.submit(lambda: 7).result() == 7  # still running after the file closed
    finally:
        if spares is not None:
            spares.close()
        pool.shutdown(wait=True)
    assert started == []


def test_empty_unit_file(tmp_path):
    with UnitFile(tmp_path / "e", "buffered") as f:
        pass
    assert f.crc32() == file_crc32(tmp_path / "e") and (tmp_path / "e").stat().st_size == 0


@pytest.mark.parametrize("mode", ["buffered", "direct", "mapped"])
def test_a_link_at_a_units_path_is_never_written_through(folder_for, mode):
    """A symbolic link planted where a unit (or a spare) is opened fails to open; its target keeps its bytes."""
    if mode == "direct" and not writer.supports_direct(folder_for("buffered")):
        pytest.skip("no O_DIRECT here")
    folder = folder_for(mode)
    target = folder / "target"
    target.write_bytes(b"keep me")
    (folder / "u.arrow").symlink_to(target)
    with pytest.raises(OSError):
        UnitFile(folder / "u.arrow", mode)
    if mode == "mapped":
        (folder / writer.SPARE_NAME).symlink_to(target)
        with Spares(folder, [1 << 20]) as spares:
            assert spares.next is None  # (no spare: that unit would be written by pwrite, through O_NOFOLLOW too)
    assert target.read_bytes() == b"keep me"


@pytest.mark.parametrize("fallocate", ["works", "fails"])
def test_direct_writes_in_flight_inside_the_extended_file(tmp_path, monkeypatch, fallocate):
    """O_DIRECT: DIRECT_IN_FLIGHT writes at once, each full block inside the file's length (fallocated ahead, so
    that ext4 runs them side by side); where fallocate fails the writes extend the file. Either way the file is
    exactly the bytes written, and its CRC-32 file_crc32's."""
    import threading

    if not writer.supports_direct(tmp_path):
        pytest.skip("this filesystem takes no O_DIRECT")
    monkeypatch.setattr(writer, "DIRECT_BLOCK", 1 << 20)
    monkeypatch.setattr(writer, "DIRECT_EXTEND", 4 << 20)
    if fallocate == "fails":
        monkeypatch.setattr(writer, "libc", lambda: type("NoFallocate", (), {"fallocate": lambda *a: -1})())
    real, lock, seen = os.pwrite, threading.Lock(), {"now": 0, "most": 0, "inside": 0, "blocks": 0}

    def pwrite(fd, view, offset):
        with lock:
            seen["now"] += 1
            seen["most"] = max(seen["most"], seen["now"])
            if len(view) == 1 << 20:
                seen["blocks"] += 1
                seen["inside"] += offset + len(view) <= os.fstat(fd).st_size
        time.sleep(0.02)  # (long enough for the other thread to start its own)
        try:
            return real(fd, view, offset)
        finally:
            with lock:
                seen["now"] -= 1

    monkeypatch.setattr(writer.os, "pwrite", pwrite)
    data = np.random.default_rng(2).integers(0, 256, (9 << 20) + 4321, dtype=np.uint8)
    path = tmp_path / "u.arrow"
    with UnitFile(path, "direct") as f:
        for at in range(0, len(data), 3 << 19):
            f.write(memoryview(data)[at:at + (3 << 19)])
    assert path.read_bytes() == data.tobytes() and path.stat().st_size == len(data) == f.size
    assert f.crc32() == file_crc32(path)
    assert seen["most"] == writer.DIRECT_IN_FLIGHT >= 2 and seen["blocks"] == 9
    assert seen["inside"] == (9 if fallocate == "works" else 0)
    assert f.extended == (12 << 20 if fallocate == "works" else None)


def test_direct_blocks_start_small_and_double(tmp_path, monkeypatch):
    """A unit's O_DIRECT writes start at DIRECT_FIRST and double up to DIRECT_BLOCK, at aligned offsets (the disk
    starts before a whole block is staged); the bytes are exactly the file's."""
    if not writer.supports_direct(tmp_path):
        pytest.skip("this filesystem takes no O_DIRECT")
    monkeypatch.setattr(writer, "DIRECT_BLOCK", 4 << 20)
    monkeypatch.setattr(writer, "DIRECT_FIRST", 1 << 20)
    real, writes = os.pwrite, []

    def pwrite(fd, view, offset):
        writes.append((offset >> 20, len(view) / (1 << 20)))
        return real(fd, view, offset)

    monkeypatch.setattr(writer.os, "pwrite", pwrite)
    data = np.random.default_rng(4).integers(0, 256, (13 << 20) + 5, dtype=np.uint8).tobytes()
    with UnitFile(tmp_path / "u", "direct") as f:
        f.write(data)
    assert sorted(writes) == [(0, 1), (1, 1), (2, 2), (4, 4), (8, 4), (12, 1 + 4096 / (1 << 20))]  # (last: padded)
    assert (tmp_path / "u").read_bytes() == data and f.crc32() == file_crc32(tmp_path / "u")


def test_direct_stages_are_lent_to_one_unit_at_a_time(tmp_path, monkeypatch):
    """DirectStages lends its buffers to one UnitFile; a second one open meanwhile writes through its own. The pool
    keeps the first set to come back, for the next unit, and frees the other. The bytes are right either way."""
    if not writer.supports_direct(tmp_path):
        pytest.skip("this filesystem takes no O_DIRECT")
    monkeypatch.setattr(writer, "DIRECT_BLOCK", 1 << 20)
    monkeypatch.setattr(writer, "DIRECT_EXTEND", 2 << 20)
    data = np.random.default_rng(3).integers(0, 256, (3 << 20) + 77, dtype=np.uint8).tobytes()
    with writer.DirectStages(5 << 20) as pool:
        lent = pool.stages
        assert len(lent) == writer.DIRECT_STAGES
        a, b = UnitFile(tmp_path / "a", "direct", spares=pool), UnitFile(tmp_path / "b", "direct", spares=pool)
        assert a.stages is lent and b.stages is not lent and pool.stages is None
        for f in (a, b):
            f.write(data)
        b.close()
        assert pool.stages is b.stages and not any(s.closed for s in b.stages)  # kept for the next unit
        a.close()
        assert pool.stages is b.stages and all(s.closed for s in lent)  # one set is enough: a's freed
        with UnitFile(tmp_path / "c", "direct", spares=pool) as c:
            c.write(data)
        assert c.stages is b.stages
    assert all(s.closed for s in b.stages)  # (the pool's, at its close)
    assert all((tmp_path / n).read_bytes() == data for n in "abc")


def test_direct_io_threads_outlive_the_units_of_their_stages(tmp_path, monkeypatch):
    """The O_DIRECT I/O threads belong to the DirectStages: a job's units write through the same ones and start or
    end none (a unit boundary paid their start and exit, each waiting for the GIL); closing a unit still waits for
    every write of its own. A UnitFile without stages lent starts its own and ends them at its close."""
    import threading

    if not writer.supports_direct(tmp_path):
        pytest.skip("this filesystem takes no O_DIRECT")
    monkeypatch.setattr(writer, "DIRECT_BLOCK", 1 << 20)
    monkeypatch.setattr(writer, "DIRECT_FIRST", 1 << 20)
    monkeypatch.setattr(writer, "DIRECT_EXTEND", 2 << 20)
    real, writers = os.pwrite, set()

    def pwrite(fd, view, offset):
        writers.add(threading.get_ident())
        time.sleep(0.01)  # (a close that did not wait would find its bytes missing)
        return real(fd, view, offset)

    monkeypatch.setattr(writer.os, "pwrite", pwrite)
    rng = np.random.default_rng(5)
    blobs = [rng.bytes((3 << 20) + 11), rng.bytes(5 << 20), rng.bytes(123)]
    io_threads = lambda: sorted(t.ident for t in threading.enumerate() if t.name == "hsx-direct-io")  # noqa: E731
    before = io_threads()
    with writer.DirectStages(8 << 20) as stages:
        running = io_threads()
        assert len(running) == len(before) + writer.DIRECT_IN_FLIGHT
        for i, blob in enumerate(blobs):
            with UnitFile(tmp_path / f"u{i}", "direct", spares=stages) as f:
                f.write(blob)
            assert (tmp_path / f"u{i}").read_bytes() == blob and f.crc32() == file_crc32(tmp_path / f"u{i}")
            assert io_threads() == running  # none started or ended by the unit
        assert writers <= set(running) - set(before)
    assert io_threads() == before  # ended with the stages
    with UnitFile(tmp_path / "alone", "direct") as f:
        assert len(io_threads()) == len(before) + writer.DIRECT_IN_FLIGHT
        f.write(blobs[0])
    assert io_threads() == before and (tmp_path / "alone").read_bytes() == blobs[0]


def test_direct_close_reads_ahead_the_small_writes_pages(tmp_path, monkeypatch):
    """After an O_DIRECT unit's last write returns, its close asks the kernel for the pages of its small writes
    (framing, small columns, the end marker: what map's Dataset.from_file reads next), merged into page runs, and
    nothing of the big buffers; the advice fails quietly where the kernel does not take it."""
    if not writer.supports_direct(tmp_path):
        pytest.skip("this filesystem takes no O_DIRECT")
    monkeypatch.setattr(writer, "DIRECT_BLOCK", 1 << 20)
    page = mmap.PAGESIZE
    advised = []

    def fadvise(fd, offset, n, advice):
        assert advice == os.POSIX_FADV_WILLNEED and os.fstat(fd).st_size == f.size  # (every write returned)
        advised.append((offset, n))

    monkeypatch.setattr(writer.os, "posix_fadvise", fadvise)
    big = np.random.default_rng(6).bytes(3 * page * 256)  # 3 MiB with 4 KiB pages: one "big" write
    parts = [b"a" * 100, b"b" * 50, big, b"c" * 8, b"d" * (page + 1)]
    with UnitFile(tmp_path / "u", "direct") as f:
        for part in parts:
            f.write(part)
    assert (tmp_path / "u").read_bytes() == b"".join(parts)
    end_big = 150 + len(big)
    assert advised == [(0, page), (end_big // page * page, ((end_big + 8 + page + 1 - 1) // page
                                                          - end_big // page + 1) * page)]

    def refuse(*a):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(writer.os, "posix_fadvise", refuse)
    with UnitFile(tmp_path / "v", "direct") as f:
        f.write(b"x" * 10)
    assert (tmp_path / "v").read_bytes() == b"x" * 10


@pytest.mark.parametrize("mode", ["buffered", "direct", "mapped"])
def test_measure_writer(folder_for, monkeypatch, mode):
    """The writer alone: its bytes in whole units of the size asked (at least one), each fsynced, every file
    removed after; the rate is positive and the mode is the one it ran."""
    monkeypatch.setattr(writer, "DIRECT_BLOCK", 1 << 20)
    monkeypatch.setattr(writer, "SPARE_CHUNK", 1 << 20)
    folder = folder_for(mode) / "probe"
    synced = []
    real = os.fsync
    monkeypatch.setattr(writer.os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    w = storage.measure_writer(folder, (5 << 20) + 3, 2 << 20, piece=1 << 20, mode=mode)
    assert w["mode"] == mode and w["units"] == 2 == len(synced) and w["bytes"] == 4 << 20 and w["gb_per_s"] > 0
    assert list(folder.iterdir()) == []
    w = storage.measure_writer(folder, 1 << 20, 8 << 20, piece=1 << 19, mode=mode)  # (a unit larger than the bytes)
    assert w["units"] == 1 and w["bytes"] == 1 << 20 and list(folder.iterdir()) == []


def test_direct_stages_fault_in_as_far_as_the_largest_unit(monkeypatch):
    """DirectStages faults in its buffers through libc's madvise (off the GIL), as far as `expected` bytes: whole
    stages, then part of one (in pages), then no more."""
    calls = []

    class Libc:
        def madvise(self, addr, n, advice):
            calls.append((n, advice))
            return 0

    monkeypatch.setattr(writer, "libc", lambda: Libc())
    monkeypatch.setattr(writer, "DIRECT_BLOCK", 1 << 20)
    with writer.DirectStages((2 << 20) + 5) as pool:
        pool.thread.join()
    assert calls == [(1 << 20, writer.MADV_POPULATE_WRITE)] * 2 + [(mmap.PAGESIZE, writer.MADV_POPULATE_WRITE)]


def test_direct_write_error_surfaces(tmp_path, monkeypatch):
    if not writer.supports_direct(tmp_path):
        pytest.skip("this filesystem takes no O_DIRECT")
    monkeypatch.setattr(writer, "DIRECT_BLOCK", 1 << 20)

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer.os, "pwrite", full)
    f = UnitFile(tmp_path / "u", "direct")
    with pytest.raises(OSError, match="No space left"):
        for _ in range(8):
            f.write(bytes(1 << 20))
    with pytest.raises(OSError, match="No space left"):
        f.close()
    f.close()  # (closing again is a no-op)
    assert f.closed


def _map(rows: datasets.Dataset, out: str):
    """A unit's map as run.py calls it: an arrow-formatted batched function returning a table of the output
    schema, the states wrapping one buffer."""
    def step(table):
        n = table.column("num_tokens").to_numpy()
        states = np.arange(int(n.sum()) * WIDTH, dtype=np.int16) * 7
        offsets = pa.array(np.r_[0, np.cumsum(n)].astype(np.int32))
        fsl = pa.FixedSizeListArray.from_arrays(pa.array(states), WIDTH)
        return pa.table({"sample_id": table.column("sample_id"), "input_ids": table.column("input_ids"),
                         "loss_mask": table.column("loss_mask"), "num_tokens": table.column("num_tokens"),
                         "hidden_states": pa.ListArray.from_arrays(offsets, fsl)})

    return rows.with_format("arrow").map(step, batched=True, batch_size=3, features=OutputFormat(WIDTH // HIDDEN, HIDDEN, False).features(),
                                         cache_file_name=out, new_fingerprint="t", load_from_cache_file=False)


@pytest.fixture
def rows():
    n = [5, 9, 1, 30, 2, 17, 4]
    return datasets.Dataset.from_dict({
        "sample_id": list(range(len(n))), "input_ids": [[3] * k for k in n], "loss_mask": [[1] * k for k in n],
        "num_tokens": n}, features=datasets.Features({
            "sample_id": datasets.Value("int64"), "input_ids": datasets.List(datasets.Value("int32")),
            "loss_mask": datasets.List(datasets.Value("int8")), "num_tokens": datasets.Value("int32")}))


@pytest.mark.parametrize("mode", ["buffered", "direct", "mapped"])
def test_map_through_unit_files_writes_datasets_own_bytes(tmp_path, folder_for, rows, mode, monkeypatch):
    """Two units in a row as commit_units writes them (mapped: each into a spare prepared ahead; pieces of 64 KiB
    so that the copy threads write several at once; direct: both through the same staging buffers, 64 KiB
    blocks): byte for byte what datasets writes, CRC-32 right, readable."""
    folder = folder_for(mode) / "unit"
    folder.mkdir()
    (tmp_path / "plain").mkdir()
    monkeypatch.setattr(checksums, "CRC_PIECE", 64 << 10)
    monkeypatch.setattr(writer, "SMALL", 16 << 10)
    monkeypatch.setattr(checksums, "SMALL", 16 << 10)
    monkeypatch.setattr(writer, "SPARE_CHUNK", 64 << 10)
    monkeypatch.setattr(writer, "DIRECT_BLOCK", 64 << 10)
    monkeypatch.setattr(writer, "DIRECT_EXTEND", 128 << 10)
    plain = _map(rows, str(tmp_path / "plain" / "u.arrow"))
    a = (tmp_path / "plain" / "u.arrow").read_bytes()
    original = datasets.arrow_dataset.ArrowWriter
    spares = writer.spares_for(folder, [len(a)] * 2, mode)
    assert isinstance(spares, {"mapped": Spares, "direct": writer.DirectStages, "buffered": type(None)}[mode])
    stages = spares.stages if mode == "direct" else None
    try:
        for name in ("u0.arrow", "u1.arrow"):
            with unit_files(folder, mode, spares=spares) as written:
                ours = _map(rows, str(folder / name))
            assert datasets.arrow_dataset.ArrowWriter is original  # restored
            assert len(written.files) == 1 and written.files[0].mode == mode
            if mode == "direct":  # the same buffers, lent to the unit and given back
                assert written.files[0].stages is stages and spares.stages is stages
            assert (folder / name).read_bytes() == a  # byte for byte what datasets writes
            assert written.crc32(folder / name) == file_crc32(folder / name)
            assert ours["num_tokens"] == plain["num_tokens"]
            back = datasets.Dataset.from_file(str(folder / name))
            assert back.features == OutputFormat(WIDTH // HIDDEN, HIDDEN, False).features() and len(back) == len(rows)
            assert list(back["num_tokens"]) == plain["num_tokens"].to_pylist()
    finally:
        if spares is not None:
            spares.close()
    assert sorted(p.name for p in folder.iterdir()) == ["u0.arrow", "u1.arrow"]  # the spares are gone


def test_mapped_small_writes_are_stored_as_one_piece(shm, monkeypatch):
    """In tmpfs a record batch's small writes (IPC framing, offsets, the token columns) are gathered and stored
    as one piece before its big one (and the trailing ones at close): each store lets go of the GIL, which the
    GPU thread may keep for a switch interval. The file and its CRC-32s are the bytes written, in order."""
    monkeypatch.setattr(checksums, "CRC_CHUNK", 3 << 20)  # (a gathered piece may straddle a chunk)
    monkeypatch.setattr(checksums, "CRC_PIECE", 1 << 20)
    monkeypatch.setattr(writer, "SPARE_CHUNK", 1 << 20)
    data = np.random.default_rng(3).integers(0, 256, 9 << 20, dtype=np.uint8)
    small = [b"\xff\xff\xff\xff", bytes(range(200)), b"\x00" * 7, memoryview(data)[:5000], b"abc" * 100]
    parts = small + [memoryview(data)[5000:(3 << 20) - 7]] + small + [pa.py_buffer(data[3 << 20:])] + small[:2]
    expected = b"".join(bytes(memoryview(p)) for p in parts)
    spares = Spares(shm, [len(expected)])
    _wait_prepared(spares.next)
    stores = []
    real_put = UnitFile._put
    monkeypatch.setattr(UnitFile, "_put", lambda self, piece, offset: stores.append((offset, len(piece)))
                        or real_put(self, piece, offset))
    try:
        with UnitFile(shm / "u.arrow", "mapped", spares=spares) as f:
            for p in parts:
                f.write(p)
            assert f.tell() == len(expected)
    finally:
        spares.close()
    assert (shm / "u.arrow").read_bytes() == expected
    assert f.crc32() == file_crc32(shm / "u.arrow")
    small_bytes = sum(len(memoryview(p)) for p in small)
    groups = [(0, small_bytes), (small_bytes + (3 << 20) - 7 - 5000, small_bytes), (len(expected) - 204, 204)]
    assert sum(n for _, n in stores) == len(expected)  # every byte stored once
    for start, n in groups:  # each run of small writes: one store
        assert [s for s in stores if start <= s[0] < start + n] == [(start, n)]


def test_unit_files_take_the_mode_from_the_spares(shm, rows, monkeypatch):
    """With spares_for's Spares, each unit's writer is "mapped" without probing the folder again: the probe maps
    and unmaps a file, which waits for the next unit's spare being prepared (milliseconds at every unit)."""
    folder = shm / "unit"
    spares = writer.spares_for(folder, [1 << 20] * 2)
    assert isinstance(spares, Spares)
    probes = []
    monkeypatch.setattr(writer, "supports_mapped", lambda f: probes.append(f) or True)
    monkeypatch.setattr(writer, "supports_direct", lambda f: probes.append(f) or False)
    try:
        for name in ("u0.arrow", "u1.arrow"):
            with unit_files(folder, spares=spares) as written:
                _map(rows, str(folder / name))
            assert [f.mode for f in written.files] == ["mapped"]
            assert written.crc32(folder / name) == file_crc32(folder / name)
    finally:
        spares.close()
    assert probes == []


def test_spare_populates_in_steps(shm, monkeypatch):
    """A spare's pages are faulted in POPULATE_STEP at a time (each madvise holds the mmap lock that map's
    mmap and munmap calls wait for), all of them, and only inside the spare."""
    monkeypatch.setattr(writer, "SPARE_CHUNK", 1 << 20)
    monkeypatch.setattr(writer, "POPULATE_STEP", 256 << 10)
    lib = writer.libc()
    calls = []

    class Recording:
        def __getattr__(self, name):
            return getattr(lib, name)

        def madvise(self, addr, n, advice):
            calls.append((addr, n, advice))
            return lib.madvise(addr, n, advice)

    monkeypatch.setattr(writer, "libc", lambda: Recording())
    spares = Spares(shm, [(2 << 20) + 100])
    try:
        spare = spares.next
        _wait_prepared(spare)
        populated = sorted((a - spare.addr, n) for a, n, advice in calls if advice == writer.MADV_POPULATE_WRITE)
    finally:
        spares.close()
    assert populated and max(n for _, n in populated) <= 256 << 10
    assert [a for a, _ in populated] == list(range(0, spare.size, 256 << 10))  # every page, once, in steps
    assert sum(n for _, n in populated) == spare.size


def test_mapped_copy_error_surfaces(shm, monkeypatch):
    """A copy thread's error (here ENOSPC from pwrite past the spare) is raised by that write, by every later
    one and by close, after every piece handed out has finished (none still reads the caller's memory)."""
    monkeypatch.setattr(checksums, "CRC_PIECE", 1 << 20)
    monkeypatch.setattr(writer, "SPARE_CHUNK", 1 << 20)
    spares = Spares(shm, [2 << 20])
    _wait_prepared(spares.next)
    running = []

    def full(fd, view, offset):
        running.append(offset)
        time.sleep(0.05)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "pwrite_all", full)
    f = UnitFile(shm / "u", "mapped", crc_threads=2, spares=spares)
    real_wait = writer.wait

    def checked_wait(futures):  # every future is waited for before the error is raised
        done = real_wait(futures)
        assert all(x.done() for x in futures)
        return done

    monkeypatch.setattr(writer, "wait", checked_wait)
    data = bytes(8 << 20)
    with pytest.raises(OSError, match="No space left"):
        f.write(data)  # the first ~2 MiB+ fit the spare, the rest fail
    assert len(running) >= 2
    with pytest.raises(OSError, match="No space left"):
        f.write(b"x")
    with pytest.raises(OSError, match="No space left"):
        f.close()
    f.close()  # (closing again is a no-op)
    spares.close()
    assert f.closed and (shm / "u").stat().st_size == 0  # the size of what was accepted (nothing)


def test_spare_skips_what_the_writer_passed(shm, monkeypatch):
    """A writer ahead of its spare's preparation writes by pwrite, and the chunks it has passed are not prepared
    after (no work behind it); the chunks ahead still are, and then take copies. The bytes are all right."""
    import threading

    monkeypatch.setattr(writer, "SPARE_CHUNK", 1 << 20)
    monkeypatch.setattr(checksums, "CRC_PIECE", 1 << 20)
    gate = threading.Event()
    spares = Spares(shm, [], threads=1)
    spares.pool.submit(gate.wait)  # the preparing thread is busy until the gate opens
    spares.sizes = [8 << 20]
    spares._start_next()
    spare = spares.next
    data = np.random.default_rng(2).integers(0, 256, 10 << 20, dtype=np.uint8)
    pwritten = []
    real_pwrite = writer.pwrite_all
    monkeypatch.setattr(writer, "pwrite_all", lambda fd, v, o: pwritten.append(len(v)) or real_pwrite(fd, v, o))
    f = UnitFile(shm / "u", "mapped", spares=spares)
    f.write(memoryview(data)[:3 << 20])  # nothing prepared yet: pwrite
    gate.set()
    spare.futures[-1].result()  # (every chunk's task has run)
    assert spare._done[:3] == [False] * 3 and all(spare._done[3:])
    f.write(memoryview(data)[3 << 20:])  # into the prepared chunks: copies
    f.close()
    assert sum(pwritten) == 3 << 20
    spares.close()
    assert (shm / "u").read_bytes() == data.tobytes() and f.crc32() == file_crc32(shm / "u")


def test_spare_keeps_the_reserve_free(shm, monkeypatch):
    """A spare is not prepared into the last `reserve` bytes of free space (the unit being written needs them):
    nothing of it is ready, and the unit goes by pwrite, whole and right."""
    monkeypatch.setattr(writer, "SPARE_CHUNK", 1 << 20)
    free = shutil.disk_usage(shm).free
    pool = writer.ThreadPoolExecutor(2)
    spare = writer.Spare(str(shm / "s"), 4 << 20, pool, reserve=free)
    spare.stop()
    assert not spare.covers(0, 1) and spare.stopped
    spare.unmap()
    os.close(spare.fd)
    pool.shutdown()
    assert (shm / "s").stat().st_blocks == 0  # nothing allocated


@pytest.mark.slow
def test_sigkill_mid_mapped_write_then_resume(fault_reference, shm):
    """The fault job with its output in tmpfs ("mapped" units): killed by SIGKILL while a unit is being written
    into its spare, then run again: the output is the uninterrupted reference (no spare or partial unit left)."""
    from helpers import assert_equals_reference, assert_units_intact, committed_units, hsx_child, hsx_main

    ref = fault_reference
    out = shm / "out"
    argv = ref.argv(out)
    child = hsx_child(argv, shm / "run0")
    hit = child.poll_until(lambda: committed_units(out) >= 3)
    if hit:
        time.sleep(0.01)
        child.kill_tree(signal.SIGKILL)
    rc = child.wait()
    assert rc == -signal.SIGKILL, child.stderr
    done = len(assert_units_intact(out))
    assert 3 <= done < ref.units
    rc, stdout, stderr = hsx_main(argv)
    assert rc == 0, stderr
    assert_equals_reference(out, ref)


def test_unit_files_leaves_other_folders_and_failures_alone(tmp_path, rows):
    (tmp_path / "unit").mkdir()
    (tmp_path / "else").mkdir()
    with unit_files(tmp_path / "unit") as written:
        _map(rows, str(tmp_path / "else" / "u.arrow"))  # not the unit folder: datasets' own file
    assert written.files == [] and written.crc32(tmp_path / "else" / "u.arrow") is None

    def boom(table):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with unit_files(tmp_path / "unit") as written:
            rows.with_format("arrow").map(boom, batched=True, cache_file_name=str(tmp_path / "unit" / "x.arrow"),
                                          load_from_cache_file=False, new_fingerprint="b")
    assert datasets.arrow_dataset.ArrowWriter.__name__ == "ArrowWriter"
    assert all(f.closed for f in written.files) and not (tmp_path / "unit" / "x.arrow").exists()


def test_resolve_mode(tmp_path):
    with pytest.raises(ValueError, match="write mode"):
        resolve_mode(tmp_path, "fast")
    assert resolve_mode(tmp_path, "buffered") == "buffered"
    memory = writer.filesystem_type(tmp_path) in ("tmpfs", "ramfs")
    assert resolve_mode(tmp_path) == ("direct" if writer.supports_direct(tmp_path) and not memory else "buffered")
    if writer.filesystem_type("/dev/shm") == "tmpfs":  # (O_DIRECT measured slower there: resolve_mode)
        assert resolve_mode("/dev/shm") == ("mapped" if writer.supports_mapped("/dev/shm") else "buffered")
    assert resolve_mode(tmp_path, "mapped") == "mapped"
    assert not writer.supports_direct(tmp_path / "missing") and not list(tmp_path.iterdir())  # (no probe left)


def test_extract_commits_the_streamed_crc(tmp_path, model4, small_chat_path, monkeypatch):
    """A job's commits take the CRC-32 the writer streamed (no read-back of the unit) and it is the file's."""
    from helpers import hsx_main

    reads = []
    real = sink.file_crc32
    monkeypatch.setattr(sink, "file_crc32", lambda p: reads.append(p) or real(p))
    out = tmp_path / "out"
    rc, _, err = hsx_main(["extract", "--model", str(model4.path), "--dataset", str(small_chat_path), "--layers",
                           "1", "--output-dir", str(out), "--unit-tokens", "300", "--compile", "off"])
    assert rc == 0, err
    records = [json.loads(x) for f in sorted((out / ".hsx").glob("manifest-*.jsonl")) for x in f.read_text().splitlines() if x.strip()]
    assert len(records) > 1 and reads == []
    for r in records:
        assert r["crc32"] == real(out / "data" / r["file"])


def test_measure_storage(tmp_path, monkeypatch):
    ways = ((1 << 20, 1), (1 << 20, 2), (2 << 20, 1))
    s = storage.measure_storage(tmp_path / "probe", 3 << 20, block=1 << 20, direct_ways=ways)
    assert s["bytes"] == 3 << 20 and s["buffered_gb_per_s"] > 0
    rates = [s["buffered_gb_per_s"]] + [w["gb_per_s"] for w in s["direct"]]
    assert s["best_gb_per_s"] == max(rates) and all(r > 0 for r in rates)  # the best of every way tried
    assert (s["direct_gb_per_s"] is None) == (not writer.supports_direct(tmp_path))
    if s["direct"]:  # every way, in order; the first one's rate is the plain O_DIRECT one
        assert [(w["block_bytes"], w["in_flight"]) for w in s["direct"]] == list(ways)
        assert s["direct_gb_per_s"] == s["direct"][0]["gb_per_s"]
    assert (s["best"] == "buffered") == (s["best_gb_per_s"] == s["buffered_gb_per_s"])
    assert list((tmp_path / "probe").iterdir()) == []  # the probe files are gone
    monkeypatch.setattr(storage, "supports_direct", lambda folder: False)  # (tmpfs before Linux 6.6, ...)
    s = storage.measure_storage(tmp_path / "probe", 1 << 20, block=1 << 20)
    assert s["direct_gb_per_s"] is None and s["best_gb_per_s"] == s["buffered_gb_per_s"]
    assert storage.storage_probe_bytes(tmp_path, 1e30) < 1e30  # capped by a quarter of the free space


def test_bench_reports_the_storage(tmp_path, capsys, monkeypatch):
    import tempfile

    from hsx.cli import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    report = tmp_path / "bench.json"
    assert main(["bench", "--shape", "tiny", "--count", "20", "--max-length", "128", "--skip", "a,b",
                 "--storage-gb", "0.01", "--json", str(report), "--output-dir", str(tmp_path / "out")]) == 0
    r = json.loads(report.read_text())
    s, c = r["storage"], r["c"]
    assert s["bytes"] > 0 and s["buffered_gb_per_s"] > 0 and s["hsx_share"] == c["output_gb_per_s"] / s["best_gb_per_s"]
    assert c["writer_gb_per_s"] >= c["output_gb_per_s"] and s["writer_share"] >= s["hsx_share"]
    assert c["write_mode"] in ("buffered", "direct", "mapped")
    w = s["writer_alone"]
    assert w["mode"] == c["write_mode"] and w["gb_per_s"] > 0 and s["writer_alone_share"] == w["gb_per_s"] / s["best_gb_per_s"]
    assert 0 < w["unit_bytes"] <= c["output_bytes"]  # (c)'s mean unit
    printed = capsys.readouterr().out
    assert "storage (" in printed and "the writer alone (" in printed
    assert not (tmp_path / "out").exists()  # removed as before (no --keep)


import subprocess  # noqa: E402
import sys  # noqa: E402

from helpers import call_with_deadline, child_env  # noqa: E402
from hsx.config import HsxError  # noqa: E402


# ---- the same job writes the same bytes; file_crc32 neither waits on a FIFO nor follows a link ---------------------

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


def test_a_crc_never_waits_on_a_fifo_nor_follows_a_link(tmp_path):
    """file_crc32 opens once, without following a link and without blocking: a FIFO named like a unit (swapped in
    after a check) is refused at once, not waited on forever."""
    fifo = tmp_path / "train-001-00000.arrow"
    os.mkfifo(fifo)
    done, result = call_with_deadline(lambda: file_crc32(fifo), 10, fifo)
    assert done, "file_crc32 blocked on a FIFO"
    assert isinstance(result, HsxError)
    real = tmp_path / "real"
    real.write_bytes(b"x" * 10)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(HsxError, match="symbolic link"):
        file_crc32(link)
