"""hsx.checksums: its CRC-32s are zlib's, whichever library computes them, and pieces checksummed apart join to
the CRC-32 of the whole (what a unit's streamed checksum and file_crc32 both give)."""

from __future__ import annotations

import zlib

import numpy as np

from hsx import checksums
from hsx.checksums import crc32_combine, file_crc32
from hsx.writer import UnitFile


def test_crc32_combine_is_zlibs():
    rng = np.random.default_rng(0)
    for n1, n2 in [(0, 5), (7, 0), (1, 1), (1000, 4097), (3, 1 << 20)]:
        a, b = rng.bytes(n1), rng.bytes(n2)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), n2) == zlib.crc32(a + b)


def test_checksums_are_zlibs_crc32_whichever_library_computes_them(tmp_path, monkeypatch):
    """checksums.crc32 (zlib-ng where installed) gives zlib's values: whole, resumed from a value, over a memoryview;
    file_crc32 and a UnitFile's streamed CRC are zlib's per chunk, so manifests written with either library
    verify with the other."""
    rng = np.random.default_rng(1)
    data = rng.bytes((5 << 20) + 123)
    assert checksums.crc32(data) == zlib.crc32(data)
    assert checksums.crc32(memoryview(data)[7:], 0x1234) == zlib.crc32(data[7:], 0x1234)
    monkeypatch.setattr(checksums, "CRC_CHUNK", 2 << 20)
    monkeypatch.setattr(checksums, "CRC_PIECE", 1 << 20)
    path = tmp_path / "f.bin"
    with UnitFile(path) as f:
        f.write(data)
    expected = ":".join(f"{zlib.crc32(data[i:i + (2 << 20)]):08x}" for i in range(0, len(data), 2 << 20))
    assert file_crc32(path) == expected
    assert f.crc32() == expected
    assert checksums.CRC32_LIBRARY in ("zlib", "zlib-ng")
