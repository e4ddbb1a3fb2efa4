"""Temporary: rates of hsx.fingerprint (sha256 of whole files, threads) and hsx.sink.file_crc32."""
import os, sys, time, tempfile
from pathlib import Path
sys.path.insert(0, os.getcwd())
from hsx import fingerprint
from hsx.sink import file_crc32

root = Path(sys.argv[1]); n = int(sys.argv[2]); size = int(sys.argv[3]) << 20
root.mkdir(parents=True, exist_ok=True)
files = []
for i in range(n):
    f = root / f"model-{i:05d}.safetensors"
    if not f.exists() or f.stat().st_size != size:
        with open(f, "wb") as fh:
            for _ in range(size >> 24):
                fh.write(os.urandom(16 << 20))
    files.append(f)
cache = root / "cache.json"
cache.unlink(missing_ok=True)
fingerprint.cache_file = lambda: cache
total = n * size / 1e6
print(f"cpus {os.cpu_count()}, {n} files x {size>>20} MiB = {total:.0f} MB (page cache warm)")
for f in files: fingerprint.sha256_of(f)  # warm the page cache
t = time.perf_counter(); fingerprint.sha256_of(files[0]); dt = time.perf_counter() - t
print(f"sha256 one file, one thread: {size/1e6/dt:.0f} MB/s")
t = time.perf_counter(); fingerprint.file_digests(files); dt = time.perf_counter() - t
print(f"file_digests cold cache, {min(n, os.cpu_count(), 16)} threads: {total/dt:.0f} MB/s ({dt:.2f} s)")
t = time.perf_counter(); fingerprint.file_digests(files); dt = time.perf_counter() - t
print(f"file_digests cached: {dt*1e3:.1f} ms")
t = time.perf_counter()
for f in files: file_crc32(f)
dt = time.perf_counter() - t
print(f"file_crc32 (256 MiB chunks, up to 8 threads per file): {total/dt:.0f} MB/s -> {1e6/(total/dt)/60:.1f} min per TB")
