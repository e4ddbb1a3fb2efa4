"""Where a unit's bytes go: the file pyarrow's IPC stream writer (inside `datasets`' ArrowWriter) writes to.

`Dataset.map` opens its output through fsspec, a buffered Python file; pyarrow hands each record batch's body
buffers to its `write` zero-copy, so nearly all of the writing time is the kernel's write call, and a CRC-32 read
back at commit would be a second pass over every byte. `UnitFile` takes the same calls and:

- checksums the bytes as they pass, in threads (`hsx.checksums.StreamCrc`: pieces joined by `crc32_combine`), in
  `file_crc32`'s format (a CRC-32 per 256 MiB chunk), so the commit never reads the unit back;
- writes big buffers straight from the pinned slot with os.write (no Python file layers);
- with O_DIRECT on disks (not in memory: `resolve_mode` says why): 64 MiB aligned blocks (a unit's first ones
  smaller: `UnitFile._stage`) from staging buffers that the units share (`DirectStages`, faulted in ahead), filled
  while earlier ones are written, DIRECT_IN_FLIGHT (2) writes at once into a file extended ahead of them, so the
  disk always has the next write queued. At a unit boundary the disk waits for the map thread, so what that thread
  does there is kept short: the I/O threads run for the job (`DirectIO`: a thread's start and exit each wait for
  the GIL the GPU thread keeps busy), and the pages map's `Dataset.from_file` reads next are asked for at once
  (`UnitFile._prefetch`);
- in memory (tmpfs), "mapped": a write call there allocates every new page under the file's lock, so `Spares`
  prepares the next unit's file while the one before is written (fallocate, then MADV_POPULATE_WRITE, on 3
  threads, a madvise call per POPULATE_STEP) and the checksum threads copy the big buffers into its mapped pages
  as they checksum them; a record batch's small writes are gathered and handed to them with its big one.

One `checksum_pool` serves a job's units: a pool per unit cost each unit's close its threads' exits, each waiting
for the GIL. The rates behind these choices: docs/benchmarks.md#the-writer-and-the-outputs-filesystem.

The file's bytes are exactly what datasets writes (same writer, same schema metadata; tests/test_writer.py
compares them), so `load_dataset` and `Dataset.from_file` read a unit as before. `unit_files` puts `UnitFile`
under the ArrowWriter that one `map` call opens for a file in hsx's unit folder, and nowhere else.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path

from hsx.checksums import SMALL, StreamCrc, crc32, wait_all

DIRECT_BLOCK = 64 << 20  # O_DIRECT writes: this size, aligned (a multiple of any logical block size)
DIRECT_ALIGN = 4096
DIRECT_IN_FLIGHT = 2  # O_DIRECT writes at once (one per I/O thread): the disk gets the next while one completes
DIRECT_STAGES = DIRECT_IN_FLIGHT + 4  # staging buffers: in the writes, queued for them, and the one being filled
DIRECT_EXTEND = 1 << 30  # the file is extended (fallocate) this far ahead of the O_DIRECT writes: see UnitFile
DIRECT_FIRST = 8 << 20  # a unit's first O_DIRECT write; each next one twice as long, up to DIRECT_BLOCK (see _stage)
WRITE_MODES = ("auto", "buffered", "direct", "mapped")


def unit_fingerprint(job_fingerprint: str, unit: str) -> str:
    """The fingerprint `Dataset.map` writes into a unit's Arrow schema metadata (and `Dataset.from_file` takes
    back as the dataset's): the job's and the unit's names, nothing of the process or the clock, so the same job
    writes the same bytes. Different jobs differ in it, so datasets' caches keyed by it never mix two outputs."""
    return f"hsx-{job_fingerprint[:24]}-{unit}"


# ---- the file -----------------------------------------------------------------------------------------------------

def supports_direct(folder: str | os.PathLike) -> bool:
    """Whether files in `folder` open with O_DIRECT (tmpfs: no)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = Path(folder) / f".hsx-direct-probe-{os.getpid()}-{threading.get_ident()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    except OSError:
        probe.unlink(missing_ok=True)
        return False
    os.close(fd)
    probe.unlink(missing_ok=True)
    return True


def _address(view: memoryview) -> int:
    """The address of a contiguous buffer (writable or not)."""
    import numpy as np

    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of `view` at `offset` of `fd` (os.pwrite until done); an O_DIRECT write cut short is one OSError
    naming the range left unaligned. The writer's and hsx.storage's probes' one way to write at an offset."""
    at = 0
    while at < len(view):
        try:
            at += os.pwrite(fd, view[at:], offset + at)
        except OSError as e:
            if e.errno == errno.EINVAL:  # (O_DIRECT: a write cut short leaves the rest unaligned)
                raise _cut_short(e, offset + at, offset + len(view), bool(at)) from None
            raise


def _cut_short(error: OSError, at: int, end: int, short: bool) -> OSError:
    """What an O_DIRECT write's EINVAL at byte `at` stands for: the kernel cuts a write that crosses the file size
    limit (`ulimit -f`; Python ignores SIGXFSZ) to an unaligned length, so EFBIG where `end` passes it; no space
    left after a short write (`short`); else the EINVAL itself."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and end > limit:
        return OSError(errno.EFBIG, os.strerror(errno.EFBIG))
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if short else error


class UnitFile:
    """A write-only binary file for pyarrow's stream writer: buffers as they come, checksummed on the way.

    mode "buffered": big buffers go to os.write from where they are; "direct": everything passes through
    DIRECT_STAGES aligned 64 MiB staging buffers (`spares`' DirectStages when given, else its own) written with
    O_DIRECT by DIRECT_IN_FLIGHT threads, the file extended ahead (the last block padded, then the file truncated
    to its length); "mapped" (memory filesystems): the file is a `Spare` whose pages were
    allocated and mapped ahead, and big buffers are copied into it by the checksum threads, each copying and
    checksumming its own pieces (bytes past what the spare has ready, or with no spare, go by pwrite). Errors of
    those threads (a full disk) surface at that write, every later write and at close; close leaves the file
    exactly as long as what was written."""

    def __init__(self, path: str | os.PathLike, mode: str = "buffered", crc_threads: int | None = None,
                 spares: Spares | DirectStages | None = None, pool: ThreadPoolExecutor | None = None):
        if mode not in ("buffered", "direct", "mapped"):
            raise ValueError(f"UnitFile mode must be buffered, direct or mapped, got {mode!r}")
        self.path, self.mode = str(path), mode
        self.crc = StreamCrc(crc_threads, pool)  # (every write waits for its own pieces: a shared pool is safe)
        self.closed = False
        self.size = 0  # bytes accepted
        self.error: BaseException | None = None
        self.spare: Spare | None = None
        # O_NOFOLLOW: a link planted at the unit's path fails instead of truncating its target (as hsx.sink opens)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        if mode == "direct":
            self.fd = os.open(self.path, flags | os.O_DIRECT, 0o644)
            self.lender = spares if isinstance(spares, DirectStages) else None
            self.stages = self.lender.lend() if self.lender is not None else DirectStages.make()
            self.free: queue.Queue = queue.Queue()
            for s in self.stages:
                self.free.put(s)
            self.stage, self.fill, self.written = self.free.get(), 0, 0
            self.holding = True  # whether `stage` is this file's to fill (not handed to the I/O threads)
            self.small_pages: list[list[int]] = []  # [first, last] page runs of the small writes (see _prefetch)
            self.extended: int | None = 0  # the file's length set by fallocate so far (None: fallocate failed)
            self.io = self.lender.io if self.lender is not None else DirectIO()  # (the lender's: kept running)
        elif mode == "mapped":
            self.spare = spares.take(self.path) if spares is not None else None
            self.fd = self.spare.fd if self.spare is not None else os.open(self.path, flags, 0o644)
            self.pending = bytearray()  # small writes gathered (see write)
        else:
            self.fd = os.open(self.path, flags, 0o644)
            self.pending = bytearray()

    # the file API pyarrow uses
    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass  # bytes are handed to the kernel by write/close

    def write(self, data) -> int:
        if self.closed:
            raise ValueError("I/O operation on closed file")
        self._raise_io_error()
        view = memoryview(data).cast("B")
        n = len(view)
        if self.mode == "mapped":
            # A record batch comes as ~17 writes, all but its states' buffer small (IPC framing, padding, the
            # offsets, token and row columns). Stored one by one on this thread, each is a ctypes memmove and a
            # CRC-32 that let go of the GIL, which the GPU thread may then keep for a switch interval (measured
            # beside a busy Python thread: 12 ms a batch): the small ones are gathered and handed to the pool with
            # the next big write, one wait for both (or stored at close).
            if n < SMALL:
                self.pending += view
                if len(self.pending) >= SMALL:
                    self._store(self._take_pending())
            else:
                self._store(self._take_pending(), view)
            self.size += n
            return n
        futures = self.crc.feed(view)
        try:
            if self.mode == "direct":
                if n < SMALL:
                    self._note_small(n)
                self._stage(view)
            elif n < SMALL:
                self.pending += view
                if len(self.pending) >= SMALL:
                    self._write_all(memoryview(self.pending))
                    self.pending = bytearray()
            else:
                if self.pending:
                    self._write_all(memoryview(self.pending))
                    self.pending = bytearray()
                self._write_all(view)
        finally:
            wait_all(futures)  # the caller may reuse the memory once write returns
        self.size += n
        return n

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.mode == "direct":
                self._finish_direct()
            elif self.mode == "mapped":
                self._finish_mapped()
            elif self.pending:
                self._write_all(memoryview(self.pending))
                self.pending = bytearray()
        finally:
            self.crc.close()
            os.close(self.fd)
            if self.spare is not None:
                self.spare.release()
            if self.mode == "direct":
                if self.lender is not None:
                    self.lender.give_back(self.stages)  # (the I/O threads are joined: no write reads them)
                else:
                    DirectStages.free(self.stages)

    def crc32(self) -> str:
        """file_crc32's value for the bytes written (after close)."""
        return self.crc.hexdigest()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # buffered
    def _write_all(self, view: memoryview) -> None:
        while view:
            view = view[os.write(self.fd, view):]

    # mapped
    def _store(self, *views: memoryview) -> None:
        """Copy `views` (the next bytes of the stream, in order) into the file and checksum them, on the pool's
        threads; back once every piece is done."""
        futures: list[Future] = []
        try:
            try:
                for view in views:
                    if self.spare is not None:
                        self.spare.passed = self.crc.pos + len(view)
                    futures += self.crc.feed(view, self._put, on_pool=True)
            finally:
                wait_all(futures)  # (an error too waits: no piece still reads the caller's memory)
        except BaseException as e:
            self.error = self.error or e.with_traceback(None)  # (sticky: the file has a hole now)
            raise

    def _take_pending(self) -> memoryview:
        pending, self.pending = self.pending, bytearray()
        return memoryview(pending)

    def _put(self, piece: memoryview, offset: int) -> int:
        """Store `piece` at `offset` (a copy into the spare's pages where they are ready, else pwrite); its CRC-32.
        Runs on the checksum threads, several at once on different pieces."""
        spare, n = self.spare, len(piece)
        if spare is not None and spare.covers(offset, n):
            ctypes.memmove(spare.addr + offset, _address(piece), n)  # (releases the GIL)
        else:
            pwrite_all(self.fd, piece, offset)
        return crc32(piece)

    def _finish_mapped(self) -> None:
        try:
            if self.error is None and self.pending:
                self._store(self._take_pending())
        finally:
            if self.spare is not None:
                self.spare.stop()  # its preparation done with before the size is set (fallocate would extend it)
            os.ftruncate(self.fd, self.size)  # a spare is longer than its unit
        self._raise_io_error()

    # direct
    def _stage(self, view: memoryview) -> None:
        """Copy into the staging buffers, handing each full block to the I/O threads. A unit's blocks start at
        DIRECT_FIRST and double up to DIRECT_BLOCK (offsets stay multiples of DIRECT_FIRST, aligned): the disk
        starts once 8 MiB are staged, not 64, and each block is staged while the one before is written (a whole
        first 64 MiB block would leave the disk idle at every unit boundary while it fills)."""
        at = 0
        while at < len(view):
            block = min(DIRECT_BLOCK, max(DIRECT_FIRST, self.written))  # (8, 8, 16, 32 MiB, ...: doubling)
            n = min(len(view) - at, block - self.fill)
            ctypes.memmove(_address(memoryview(self.stage)) + self.fill, _address(view[at:at + n]), n)  # (no GIL)
            self.fill += n
            at += n
            if self.fill == block:
                self._extend(self.written + block)
                self._submit(block)
                self.written += block
                self.stage, self.fill = self._next_stage(), 0
                self.holding = True

    def _extend(self, end: int) -> None:
        """Make the file at least `end` bytes long ahead of the writes, DIRECT_EXTEND at a time (fallocate: the
        blocks reserved, unwritten), so that the O_DIRECT writes land inside the file's length: ext4 runs those
        under a shared lock, several at once (Linux 6.5+), while a write that extends the file takes the lock
        exclusively and completes before the next starts (DIRECT_IN_FLIGHT would be one). Where fallocate fails
        (a filesystem without it, too little space for the step), the writes extend the file as before; close
        cuts the file to its bytes either way."""
        if self.extended is None or end <= self.extended:
            return
        if libc().fallocate(self.fd, 0, self.extended, DIRECT_EXTEND) != 0:
            self.extended = None
        else:
            self.extended += DIRECT_EXTEND

    def _submit(self, n: int) -> None:
        """Hand the stage being filled (its first `n` bytes) to the I/O threads, at the file's next offset."""
        self.io.queue.put((self, self.stage, n, self.written))
        self.holding = False

    def _next_stage(self):
        return self._take_free(raise_errors=True)

    def _take_free(self, raise_errors: bool):
        """A stage back from the I/O threads (waiting while they write); an ended I/O thread is an OSError, and
        with `raise_errors` so is a write's error (without, a close still waits for every stage)."""
        while True:
            try:
                return self.free.get(timeout=1.0)
            except queue.Empty:
                if raise_errors:
                    self._raise_io_error()
                if not self.io.alive():
                    raise OSError("hsx: an O_DIRECT writer thread ended") from None

    def _write_block(self, stage: mmap.mmap, n: int, offset: int) -> None:
        """On a DirectIO thread: one block at its offset; the stage goes back to this file's free ones after."""
        if self.error is None:
            try:
                with memoryview(stage) as whole:
                    pwrite_all(self.fd, whole[:n], offset)
            except BaseException as e:  # noqa: BLE001  (raised on the writing thread)
                self.error = e.with_traceback(None)  # (its frames would pin the staging buffer)
        self.free.put(stage)

    def _finish_direct(self) -> None:
        """Write the last block (padded), and wait until every stage is back: each write has returned. The I/O
        threads are the lender's and keep running (a unit's own ones are ended here)."""
        try:
            if self.fill and self.error is None:
                padded = -(-self.fill // DIRECT_ALIGN) * DIRECT_ALIGN
                self.stage[self.fill:padded] = bytes(padded - self.fill)
                self._submit(padded)
                self.written += self.fill
        finally:
            try:
                for _ in range(len(self.stages) - self.holding):  # (an error too waits: no write still reads one)
                    self._take_free(raise_errors=False)
            finally:
                if self.lender is None:
                    self.io.close()
        self._raise_io_error()
        os.ftruncate(self.fd, self.size)  # drop the last block's padding and what fallocate reserved past it
        self._prefetch()

    def _note_small(self, n: int) -> None:
        first, last = self.size // mmap.PAGESIZE, (self.size + max(n, 1) - 1) // mmap.PAGESIZE
        if self.small_pages and first <= self.small_pages[-1][1] + 1:
            self.small_pages[-1][1] = max(self.small_pages[-1][1], last)
        else:
            self.small_pages.append([first, last])

    def _prefetch(self) -> None:
        """Ask the kernel to read the pages of the small writes (the IPC framing, the offsets and token columns,
        the end-of-stream marker) into the page cache, all at once and nothing around them: `map` opens the unit
        right after its close (Dataset.from_file reads every message through a memory map) while the next unit
        waits, and the O_DIRECT writes left none of its pages cached: without the advice each place it touches is
        a synchronous read of the disk's read-ahead window, one after another. Every write has returned: the
        pages read are the file's bytes."""
        for first, last in self.small_pages:
            try:
                os.posix_fadvise(self.fd, first * mmap.PAGESIZE, (last - first + 1) * mmap.PAGESIZE,
                                 os.POSIX_FADV_WILLNEED)
            except (OSError, AttributeError):  # (advice only)
                return

    def _raise_io_error(self) -> None:
        if self.error is not None:  # (sticky: the file is incomplete, every later write or close says so)
            raise self.error


class DirectIO:
    """The threads that run O_DIRECT writes (DIRECT_IN_FLIGHT of them, so that many at once), fed (UnitFile, stage,
    bytes, offset) items, kept from unit to unit by the DirectStages that lends the stages. Started and ended per
    unit, they would cost its boundary the threads' start and exit, each waiting for the GIL that the GPU thread
    and map keep busy, while the disk idles."""

    def __init__(self, threads: int | None = None):
        self.queue: queue.Queue = queue.Queue()
        self.threads = [threading.Thread(target=self._work, name="hsx-direct-io", daemon=True)
                        for _ in range(threads or DIRECT_IN_FLIGHT)]
        for t in self.threads:
            t.start()

    def _work(self) -> None:
        while (item := self.queue.get()) is not None:
            unit, stage, n, offset = item
            unit._write_block(stage, n, offset)
            del unit, stage, item  # (a finished unit is not pinned while the thread waits for the next item)

    def alive(self) -> bool:
        return all(t.is_alive() for t in self.threads)

    def close(self) -> None:
        for _ in self.threads:
            self.queue.put(None)
        for t in self.threads:
            t.join()


class DirectStages:
    """The O_DIRECT staging buffers (DIRECT_STAGES × DIRECT_BLOCK, page-aligned) of the units one loop writes, kept
    from unit to unit and faulted in on a thread when made: a fresh buffer's first fill pays a page fault per
    4 KiB (several times the cost of a second fill), and a unit's first block waits for that fill with the disk
    idle; unmapping them at each close would idle it again. One UnitFile holds
    them at a time; another one meanwhile makes its own (the first set back is kept, the other freed). Its
    DirectIO threads write every unit's blocks (they run until `close`).
    `expected`: the largest unit's bytes, as far as the stages are faulted in ahead (a smaller unit touches no
    more)."""

    def __init__(self, expected: int):
        self.stages: list[mmap.mmap] | None = self.make()
        self.io = DirectIO()
        self.thread = threading.Thread(target=self._populate, args=(list(self.stages), expected),
                                       name="hsx-stages", daemon=True)
        self.thread.start()

    @staticmethod
    def make() -> list[mmap.mmap]:
        return [mmap.mmap(-1, DIRECT_BLOCK) for _ in range(DIRECT_STAGES)]  # page-aligned, as O_DIRECT needs

    @staticmethod
    def _populate(stages: list[mmap.mmap], expected: int) -> None:
        """Through libc (ctypes lets go of the GIL; mmap.madvise holds it, stalling the other threads while it
        populates: docs/benchmarks.md, "Figures moved from the code"). MADV_POPULATE_WRITE never changes bytes: a
        fill may run beside it."""
        lib = libc()
        for stage in stages:
            n = min(len(stage), -(-expected // mmap.PAGESIZE) * mmap.PAGESIZE)
            if n <= 0:
                return
            try:
                addr = _address(memoryview(stage))
            except ValueError:  # (closed)
                return
            if lib.madvise(addr, n, MADV_POPULATE_WRITE) != 0:  # (Linux < 5.14: the first fill faults them in)
                return
            expected -= n

    def lend(self) -> list[mmap.mmap]:
        stages, self.stages = self.stages, None
        return stages if stages is not None else self.make()

    def give_back(self, stages: list[mmap.mmap]) -> None:
        if self.stages is None:
            self.stages = stages
        else:
            self.free(stages)

    @staticmethod
    def free(stages: list[mmap.mmap]) -> None:
        for stage in stages:
            try:
                stage.close()
            except BufferError:  # a view still exported (an error's traceback): freed with it
                pass

    def close(self) -> None:
        self.thread.join()
        self.io.close()
        if self.stages is not None:
            self.free(self.stages)
            self.stages = None

    def __enter__(self) -> DirectStages:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- memory filesystems: a unit's pages allocated ahead --------------------------------------------------------

SPARE_CHUNK = 64 << 20  # a spare is prepared in steps of this size, a few at once
# Per madvise call: each holds the mmap lock that mmap/munmap wait for (16 MiB cut map's time at unit boundaries
# on a 2-core VM, but more of each unit then went by pwrite, its spare not ready: kept at one call per chunk until
# a GPU run decides; docs/benchmarks.md#the-writer-and-the-outputs-filesystem)
POPULATE_STEP = SPARE_CHUNK
SPARE_THREADS = 3  # preparing threads (fallocate takes the file's lock; the page faults run in parallel)
SPARE_NAME = ".hsx-spare"  # in the unit folder, while prepared (then renamed to the unit's file)
SPARE_MARGIN = 1.01  # a spare is this much longer than the unit's estimate (+ 4 MiB); close cuts the rest
MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in writable without touching them; fails instead of SIGBUS
_PROT_RW, _MAP_SHARED = 3, 1
_LIBC: list = []


def libc():
    """This process's C library (ctypes, loaded once) with the signatures hsx calls: mmap, munmap, madvise,
    fallocate (their calls let go of the GIL). The writer's and hsx.storage's probes' one handle on it."""
    if not _LIBC:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int64]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        _LIBC.append(lib)
    return _LIBC[0]


def _os_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


class Spare:
    """A file of `size` bytes in a memory filesystem, its pages allocated (fallocate) and mapped writable
    (MADV_POPULATE_WRITE) ahead, SPARE_CHUNK at a time on a pool's threads, so that filling it is a memory copy
    that several threads do at once. Only the chunks prepared (`covers`) are written through the mapping (a page
    fault there can no longer find the filesystem full, which would be a SIGBUS).
    Preparation stops where the filesystem would keep less than `reserve` bytes free, or at any error, and skips
    the chunks that the file's writer has passed (`passed`: it wrote them by pwrite, being ahead)."""

    def __init__(self, path: str, size: int, pool: ThreadPoolExecutor, reserve: int):
        self.path, self.size, self.reserve, self.pool = path, max(1, size), reserve, pool
        self.passed = 0  # the writer's bytes so far (set by UnitFile): chunks before are not worth preparing
        self.stopped = False
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                          0o644)
        try:
            os.ftruncate(self.fd, self.size)
            addr = libc().mmap(None, self.size, _PROT_RW, _MAP_SHARED, self.fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise _os_error("mmap")
        except BaseException:
            os.close(self.fd)
            raise
        self.addr = addr
        self._done = [False] * -(-self.size // SPARE_CHUNK)  # per chunk: prepared
        self.futures = [pool.submit(self._prepare, i) for i in range(len(self._done))]

    def _prepare(self, i: int) -> None:
        offset = i * SPARE_CHUNK
        n = min(SPARE_CHUNK, self.size - offset)
        if self.stopped or self.passed >= offset + n:
            return
        lib = libc()
        try:
            stat = os.statvfs(os.path.dirname(self.path))
            room = stat.f_bavail * stat.f_frsize
        except OSError:
            room = 0
        if room - n < self.reserve or lib.fallocate(self.fd, 0, offset, n) != 0:
            self.stopped = True  # (the rest is written by pwrite, which reports a full filesystem as ENOSPC)
            return
        # A populate holds the process's mmap lock (shared) for its whole range, and every mmap or munmap waits
        # for it: the map thread does several at each unit boundary (Dataset.from_file, the next spare, datasets
        # unmapping the tables before), so they are kept short.
        for at in range(offset, offset + n, POPULATE_STEP):
            if lib.madvise(self.addr + at, min(POPULATE_STEP, offset + n - at), MADV_POPULATE_WRITE) != 0:
                self.stopped = True
                return
        self._done[i] = True

    def covers(self, offset: int, n: int) -> bool:
        """Whether bytes [offset, offset + n) are prepared (and still mapped)."""
        return (self.addr is not None and offset + n <= self.size
                and all(self._done[offset // SPARE_CHUNK:(offset + n - 1) // SPARE_CHUNK + 1]))

    def stop(self) -> None:
        """No preparation after this returns."""
        self.stopped = True
        wait(self.futures)

    def unmap(self) -> None:
        if self.addr is not None:
            addr, self.addr = self.addr, None
            libc().munmap(addr, self.size)

    def release(self) -> None:
        """Unmap on the pool's threads (0.1 s per GB of mapped pages, measured): the file's bytes stay."""
        try:
            self.pool.submit(self.unmap)
        except RuntimeError:  # (the pool is shut down)
            self.unmap()


class Spares:
    """The files of the units this process writes next into `folder` (a memory filesystem), each prepared while
    the one before is written: `sizes` are their expected byte counts, in order. `take(path)` gives the next one
    (renamed to `path`) and starts preparing the one after. Each keeps its own size's worth of free space for
    the unit being written (Spare.reserve). A spare left by a kill is removed with the rest of .hsx/tmp/."""

    def __init__(self, folder: str | os.PathLike, sizes: list[int], threads: int = SPARE_THREADS):
        self.folder = str(folder)
        self.sizes = list(sizes)
        self.pool = ThreadPoolExecutor(max_workers=max(1, min(threads, os.cpu_count() or 1)),
                                       thread_name_prefix="hsx-spare")
        self.next: Spare | None = None
        self._start_next()

    def _start_next(self) -> None:
        if self.sizes:
            size = self.sizes.pop(0)
            size = -(-int(size * SPARE_MARGIN + (4 << 20)) // mmap.PAGESIZE) * mmap.PAGESIZE
            path = os.path.join(self.folder, SPARE_NAME)
            try:
                self.next = Spare(path, size, self.pool, reserve=size)
            except OSError:
                self.next = None  # (no spare: that unit is written by pwrite)

    def take(self, path: str) -> Spare | None:
        spare, self.next = self.next, None
        if spare is not None:
            try:
                os.replace(spare.path, path)
            except OSError:
                self._drop(spare)
                spare = None
            else:
                spare.path = path
        self._start_next()
        return spare

    def _drop(self, spare: Spare) -> None:
        spare.stop()
        spare.unmap()
        os.close(spare.fd)
        try:
            os.unlink(spare.path)
        except OSError:
            pass

    def close(self) -> None:
        if self.next is not None:
            self._drop(self.next)
            self.next = None
        self.sizes = []
        self.pool.shutdown(wait=True)

    def __enter__(self) -> Spares:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def filesystem_type(folder: str | os.PathLike) -> str:
    """The type of the filesystem holding `folder` ("tmpfs", "ext4", ...; "" if unknown), from the mount table."""
    path, best, kind = os.path.realpath(folder), "", ""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or not rest:
            continue
        mount = fields[4].encode().decode("unicode_escape")  # (\040 for a space)
        if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, rest[0]
    return kind


def supports_mapped(folder: str | os.PathLike) -> bool:
    """Whether `folder` takes what a Spare does (tmpfs: fallocate, a shared mapping, MADV_POPULATE_WRITE)."""
    probe = os.path.join(folder, f".hsx-mapped-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError:
        return False
    try:
        lib = libc()
        os.ftruncate(fd, mmap.PAGESIZE)
        if lib.fallocate(fd, 0, 0, mmap.PAGESIZE) != 0:
            return False
        addr = lib.mmap(None, mmap.PAGESIZE, _PROT_RW, _MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return False
        ok = lib.madvise(addr, mmap.PAGESIZE, MADV_POPULATE_WRITE) == 0
        lib.munmap(addr, mmap.PAGESIZE)
        return ok
    except (OSError, AttributeError):  # (AttributeError: a libc without fallocate)
        return False
    finally:
        os.close(fd)
        try:
            os.unlink(probe)
        except OSError:
            pass


def resolve_mode(folder: str | os.PathLike, mode: str = "auto") -> str:
    """auto: in memory (tmpfs) "mapped" where the kernel takes it, else "buffered"; elsewhere O_DIRECT where files
    in `folder` open with it. On a disk O_DIRECT in large aligned blocks outruns the page cache's write-back; in
    tmpfs it does not (its staging copy costs more than it saves), and a write call there pays for allocating each
    new page under the file's lock, so "mapped" moves the allocation (fallocate) and the page faults
    (MADV_POPULATE_WRITE, in parallel) to threads that prepare the next unit's file, leaving a copy and the CRC-32
    on each writing thread. The measured rates of each mode:
    docs/benchmarks.md#the-writer-and-the-outputs-filesystem."""
    if mode not in WRITE_MODES:
        raise ValueError(f"write mode must be one of {', '.join(WRITE_MODES)}, got {mode!r}")
    if mode == "auto":
        if filesystem_type(folder) in ("tmpfs", "ramfs"):
            return "mapped" if supports_mapped(folder) else "buffered"
        return "direct" if supports_direct(folder) else "buffered"
    return mode


class Written:
    """The UnitFiles one `map` call wrote (normally one)."""

    def __init__(self):
        self.files: list[UnitFile] = []

    def crc32(self, path: str | os.PathLike) -> str | None:
        """The CRC-32s of the file now at `path` (map renames its temp file there) if a UnitFile wrote it whole;
        None otherwise (the caller reads the file instead)."""
        done = [f for f in self.files if f.closed]
        if len(done) != 1 or len(self.files) != 1:
            return None
        try:
            size = os.stat(path).st_size
        except OSError:
            return None
        return done[0].crc32() if size == done[0].size else None


@contextmanager
def unit_files(folder: str | os.PathLike, mode: str = "auto", spares: Spares | DirectStages | None = None,
               pool: ThreadPoolExecutor | None = None) -> Iterator[Written]:
    """Within the block, an ArrowWriter that `datasets.map` opens for a file directly in `folder` writes it
    through a UnitFile (in "mapped" mode, into the next of `spares`, with O_DIRECT on the stages `spares` lends;
    checksummed on `pool`, a `checksum_pool` the caller keeps for its units, or on threads of the file's own).
    map builds its writer inside `_map_single` from the module's `ArrowWriter` name, with a path (no way to pass
    a file), so the name is bound to a subclass for the block and restored after; any other path, or a datasets
    whose writer lacks the attributes used here, keeps datasets' own file."""
    import datasets.arrow_dataset as arrow_dataset

    original = arrow_dataset.ArrowWriter
    folder = os.path.realpath(folder)
    if mode == "auto" and isinstance(spares, (Spares, DirectStages)):
        # spares_for resolved the mode: resolving it again probes the folder at every unit (in tmpfs a file
        # mapped and unmapped, which waits for the next unit's spare preparation: ~10 ms a unit, measured)
        mode = "mapped" if isinstance(spares, Spares) else "direct"
    resolve_mode(folder, mode) if mode != "auto" else None  # (a wrong mode fails here, not inside map)
    written = Written()

    class UnitArrowWriter(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            path = getattr(self, "_path", None)
            stream = getattr(self, "stream", None)
            if (getattr(self, "_closable_stream", False) and isinstance(path, str) and stream is not None
                    and os.path.dirname(os.path.realpath(path)) == folder):
                stream.close()
                # (map made the folder)
                self.stream = UnitFile(path, resolve_mode(folder, mode), spares=spares, pool=pool)
                written.files.append(self.stream)

    arrow_dataset.ArrowWriter = UnitArrowWriter
    try:
        yield written
    finally:
        arrow_dataset.ArrowWriter = original
        for f in written.files:
            if not f.closed:  # map failed before finalizing: release the fd and threads (the file is not used)
                try:
                    f.close()
                except OSError:
                    pass


def spares_for(folder: str | os.PathLike, sizes: list[int], mode: str = "auto") -> Spares | DirectStages | None:
    """For a loop of `unit_files` blocks writing units of about `sizes` bytes, in order, into `folder`: the
    Spares they take in "mapped" mode, the DirectStages they share with O_DIRECT (None in buffered mode, or with
    no sizes). The caller closes it."""
    if not sizes:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    resolved = resolve_mode(folder, mode)
    return (Spares(folder, sizes) if resolved == "mapped" else DirectStages(max(sizes)) if resolved == "direct"
            else None)
