"""hsx's CRC-32s: one per 256 MiB chunk of a file, ":"-joined (`file_crc32`), the value every manifest line,
upload record and hsx.json entry carries, so a unit is checked by re-reading it.

`crc32` is zlib's (zlib-ng's where installed: the same values); both release the GIL, so a file's chunks are
checksummed on a few threads. The writer (hsx.writer) checksums a unit's bytes as they pass instead of reading
the file back: `StreamCrc` gives `file_crc32`'s value from pieces checksummed apart on a shared pool
(`checksum_pool`) and joined by `crc32_combine`."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from hsx.files import open_regular

CRC_CHUNK = 256 << 20


def _crc32_function():
    """zlib's CRC-32, computed by zlib-ng where it is installed (the `gpu` extra): the same values, with carry-less
    multiply instructions, about twice zlib's rate per core; in tmpfs the checksum is the largest part of the
    writer's work (docs/benchmarks.md#the-writer-and-the-outputs-filesystem)."""
    try:
        from zlib_ng import zlib_ng

        return zlib_ng.crc32, "zlib-ng"
    except ImportError:
        import zlib

        return zlib.crc32, "zlib"


crc32, CRC32_LIBRARY = _crc32_function()  # crc32(data, value=0) -> int, like zlib.crc32; both release the GIL



def file_crc32(path: Path, fd: int | None = None) -> str:
    """CRC-32 of each 256 MiB chunk of a file, ":"-joined, computed by a few threads (`crc32` releases the GIL).
    The file is opened once (`open_regular`: no link followed) and every chunk read from that fd (`fd`: one the
    caller opened, so what it checks is what it then reads), never re-opened by name between chunks.

    Several threads because one thread's zlib CRC is slower than a GPU writes states: single-threaded, the
    checksum fell behind the writer (docs/benchmarks.md, 2026-11-30 to 2026-12-01)."""
    own = fd is None
    if own:
        fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size

        def chunk_crc(i: int) -> str:
            crc, buf = 0, bytearray(16 << 20)
            view = memoryview(buf)
            at, end = i * CRC_CHUNK, min((i + 1) * CRC_CHUNK, size)
            while at < end:
                k = os.preadv(fd, [view[: min(len(buf), end - at)]], at)
                if not k:
                    break
                crc = crc32(view[:k], crc)
                at += k
            return f"{crc:08x}"

        chunks = max(1, -(-size // CRC_CHUNK))
        with ThreadPoolExecutor(max_workers=min(8, chunks, os.cpu_count() or 1)) as pool:
            return ":".join(pool.map(chunk_crc, range(chunks)))
    finally:
        if own:
            os.close(fd)



# ---- CRC-32 of a stream, its pieces computed apart ------------------------------------------------------------

CRC_PIECE = 32 << 20  # a big buffer is checksummed in pieces of this size, in parallel
SMALL = 1 << 20  # pieces below this are checksummed on the caller's thread (hsx.writer gathers its small writes to it)
_ZEROS_OPS: list[list[int]] = []  # _ZEROS_OPS[k]: the GF(2) operator that appends 2**k zero bytes to a CRC-32


def _times(op: list[int], vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= op[i]
        vec >>= 1
        i += 1
    return s


def _zeros_ops() -> list[list[int]]:
    if not _ZEROS_OPS:
        op = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit (reflected polynomial)
        for _ in range(3):  # 2, 4, 8 bits: one zero byte
            op = [_times(op, op[n]) for n in range(32)]
        ops = [op]
        for _ in range(47):  # up to 2**47 bytes
            op = [_times(op, op[n]) for n in range(32)]
            ops.append(op)
        _ZEROS_OPS[:] = ops
    return _ZEROS_OPS


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """zlib's crc32_combine: the CRC-32 of A+B from crc32(A), crc32(B) and len(B) (Python's zlib lacks it)."""
    ops = _zeros_ops()
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _times(ops[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2




CRC_THREADS = 4  # checksum (and, mapped, copy) threads per writing process


def checksum_pool(threads: int | None = None) -> ThreadPoolExecutor:
    """The threads that checksum (and in "mapped" mode store) big pieces, for UnitFiles to share. A pool per file
    would be shut down at every unit's close, and its threads' exits wait for the GIL, which the GPU thread and
    map keep busy: tens of milliseconds a unit. One pool for the job's units costs that once."""
    return ThreadPoolExecutor(max_workers=max(1, threads or min(CRC_THREADS, os.cpu_count() or 1)),
                              thread_name_prefix="hsx-crc")



def wait_all(futures: list[Future]) -> None:
    """Wait for every future, then raise the first one's error (none is left reading memory the caller frees)."""
    if futures:
        wait(futures)
        for f in futures:
            f.result()



class StreamCrc:
    """`file_crc32`'s CRC-32s (one per 256 MiB chunk) of a byte stream fed in order; big pieces are checksummed
    by a thread pool (`pool`, shared and left running; else one of `threads` of its own) while the caller writes
    them."""

    def __init__(self, threads: int | None = None, pool: ThreadPoolExecutor | None = None):
        self.own_pool = pool is None
        self.pool = checksum_pool(threads) if pool is None else pool
        self.chunk = CRC_CHUNK  # file_crc32's chunk
        self.pos = 0
        self.chunks: list[list[tuple[int | Future, int]]] = []  # per chunk: (crc or its future, length)

    def feed(self, view: memoryview, put=None, on_pool: bool = False) -> list[Future]:
        """Account for `view` (the next bytes of the stream); returns the futures still reading it: the caller
        waits for them before the memory may change. `put(piece, offset)`, if given, stores a piece at its offset
        in the stream and returns its CRC-32: run on the pool for big pieces (copy and checksum in parallel), and
        for small ones too with `on_pool`."""
        futures: list[Future] = []
        at = 0
        try:
            while at < len(view):
                chunk, inside = divmod(self.pos, self.chunk)
                if chunk == len(self.chunks):
                    self.chunks.append([])
                n = min(len(view) - at, self.chunk - inside, CRC_PIECE)
                piece = view[at:at + n]
                if n < SMALL and not on_pool:
                    self.chunks[chunk].append((crc32(piece) if put is None else put(piece, self.pos), n))
                else:
                    f = self.pool.submit(crc32, piece) if put is None else self.pool.submit(put, piece, self.pos)
                    futures.append(f)
                    self.chunks[chunk].append((f, n))
                at += n
                self.pos += n
        except BaseException:
            wait_all(futures)  # (an inline piece failed: the pieces already handed out still read `view`)
            raise
        return futures

    def hexdigest(self) -> str:
        out = []
        for pieces in self.chunks or [[]]:
            crc = 0
            for value, n in pieces:
                crc = crc32_combine(crc, value.result() if isinstance(value, Future) else value, n)
            out.append(f"{crc:08x}")
        return ":".join(out)

    def close(self) -> None:
        if self.own_pool:
            self.pool.shutdown(wait=True)

