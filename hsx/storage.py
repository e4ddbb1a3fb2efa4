"""What the output storage itself takes, measured apart from a job: its sequential write rates (`measure_storage`:
buffered and O_DIRECT, in the ways hsx's writer writes) and hsx's writer alone on it (`measure_writer`). `hsx bench`
reports them beside a run's own write rate, so a slow run is put down to the storage, the writer or the GPU
(docs/storage.md: what to choose)."""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from hsx.checksums import checksum_pool, wait_all
from hsx.files import fsync_file
from hsx.writer import (DIRECT_BLOCK, DIRECT_IN_FLIGHT, UnitFile, filesystem_type, libc, pwrite_all, resolve_mode,
                        spares_for, supports_direct)

PROBE_DIRECT = ((DIRECT_BLOCK, 1), (DIRECT_BLOCK, DIRECT_IN_FLIGHT), (DIRECT_BLOCK, 4), (4 * DIRECT_BLOCK, 1),
                (4 * DIRECT_BLOCK, DIRECT_IN_FLIGHT))
"""The O_DIRECT ways the storage probe tries, (block, writes in flight): one write at a time, the writer's way,
more in flight, larger blocks one and DIRECT_IN_FLIGHT at a time (disks differ in which of these they take
fastest); its best is the best of all of them and buffered, so a disk that takes more than the writer asks of it
reads as such."""


def measure_storage(folder: str | os.PathLike, nbytes: int, block: int = DIRECT_BLOCK,
                    direct_ways: tuple[tuple[int, int], ...] = PROBE_DIRECT) -> dict:
    """Sequential write rate of `folder`'s filesystem: `nbytes` in `block`-sized writes, buffered, and with
    O_DIRECT (where files there open with it) in each of `direct_ways` (block, writes in flight: that many
    threads taking the next block; with more than one, the file fallocated to its length first, as UnitFile
    extends it ahead), each until fsync returns, as a unit's commit waits for it. The file is removed after each.
    Rates in GB/s (1e9 bytes): `direct_gb_per_s` is the first way's (one `block` at a time), `direct` lists every
    way's, `best_gb_per_s` is the best of all; O_DIRECT's are None / empty where it does not apply."""
    import time

    import numpy as np

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    nbytes = max(block, nbytes // block * block)
    largest = max([block] + [b for b, _ in direct_ways])
    source = mmap.mmap(-1, largest)  # page-aligned, as O_DIRECT needs; random bytes (no zero-page shortcuts)
    np.frombuffer(source, dtype=np.uint8)[:] = np.random.default_rng(0).integers(0, 256, largest, dtype=np.uint8)
    result = {"path": str(folder), "filesystem": filesystem_type(folder), "bytes": nbytes, "block_bytes": block,
              "direct": []}

    def timed(direct: bool, size: int, in_flight: int) -> float:
        path = folder / f".hsx-storage-probe-{os.getpid()}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | (os.O_DIRECT if direct else 0)
        fd = os.open(path, flags, 0o644)
        total = max(size, nbytes // size * size)
        offsets = iter(range(0, total, size))
        lock = threading.Lock()

        def write_blocks() -> None:
            with memoryview(source) as view:
                while True:
                    with lock:
                        offset = next(offsets, None)
                    if offset is None:
                        return
                    pwrite_all(fd, view[:size], offset)

        try:
            t0 = time.perf_counter()
            if in_flight > 1:
                libc().fallocate(fd, 0, 0, total)  # (as UnitFile's _extend; where it fails, the writes extend)
            with ThreadPoolExecutor(max_workers=in_flight) as pool:
                wait_all([pool.submit(write_blocks) for _ in range(in_flight)])
            os.fsync(fd)
            return total / (time.perf_counter() - t0) / 1e9
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)

    try:
        result["buffered_gb_per_s"] = timed(False, block, 1)
        result["direct_gb_per_s"] = None
        if supports_direct(folder):
            for size, in_flight in direct_ways:
                rate = timed(True, size, in_flight)
                result["direct"].append({"block_bytes": size, "in_flight": in_flight, "gb_per_s": rate})
            result["direct_gb_per_s"] = result["direct"][0]["gb_per_s"] if result["direct"] else None
    finally:
        source.close()
    ways = [("buffered", result["buffered_gb_per_s"])] + [
        (f"O_DIRECT, {w['block_bytes'] >> 20} MiB x {w['in_flight']} in flight", w["gb_per_s"])
        for w in result["direct"]]
    result["best"], result["best_gb_per_s"] = max(ways, key=lambda w: w[1])
    return result


def storage_probe_bytes(folder: str | os.PathLike, wanted: float) -> int:
    """`wanted` bytes, or a quarter of the free space of `folder`'s filesystem if that is less."""
    import shutil

    return int(min(wanted, shutil.disk_usage(folder).free / 4))


def measure_writer(folder: str | os.PathLike, nbytes: int, unit_bytes: int, piece: int = 512 << 20,
                   mode: str = "auto") -> dict:
    """hsx's writer alone on `folder`'s filesystem, fed as fast as it takes bytes: `nbytes` of random bytes as
    units of `unit_bytes` (UnitFiles as a job writes its units: `mode` resolved there, one checksum pool, the
    DirectStages or Spares `spares_for` makes), in `piece`-sized writes (a batch's big buffer), each unit fsynced
    on a thread while the next one is written, as hsx.sink's Committer does. Against `measure_storage`'s best it
    says how much of the storage the writer can use, unit boundaries included; against a run's write rate,
    whether the GPU or the writer limited it. The files are removed after."""
    import time

    import numpy as np

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    unit_bytes = max(1, min(int(unit_bytes), int(nbytes)))
    sizes = [unit_bytes] * max(1, int(nbytes) // unit_bytes)
    source = mmap.mmap(-1, max(1, min(piece, unit_bytes)))
    np.frombuffer(source, dtype=np.uint8)[:] = np.random.default_rng(1).integers(0, 256, len(source), dtype=np.uint8)
    resolved = resolve_mode(folder, mode)
    pool, syncs = checksum_pool(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="hsx-probe-fsync")
    futures: list[Future] = []

    def fsync_and_remove(path: str) -> None:
        try:
            fsync_file(Path(path))
        finally:
            os.unlink(path)

    spares = spares_for(folder, sizes, resolved)
    try:
        with memoryview(source) as view:
            t0 = time.perf_counter()
            for i, size in enumerate(sizes):
                path = str(folder / f".hsx-writer-probe-{os.getpid()}-{i}")
                with UnitFile(path, resolved, spares=spares, pool=pool) as f:
                    for at in range(0, size, len(view)):
                        f.write(view[:min(len(view), size - at)])
                futures.append(syncs.submit(fsync_and_remove, path))
            wait_all(futures)
            seconds = time.perf_counter() - t0
    finally:
        wait(futures)
        if spares is not None:
            spares.close()
        pool.shutdown(wait=True)
        syncs.shutdown(wait=True)
        source.close()
        for leftover in folder.glob(f".hsx-writer-probe-{os.getpid()}-*"):
            leftover.unlink(missing_ok=True)
    return {"mode": resolved, "bytes": sum(sizes), "units": len(sizes), "unit_bytes": unit_bytes,
            "gb_per_s": sum(sizes) / seconds / 1e9}
