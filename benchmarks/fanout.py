"""Directory fan-out at a million files: block files in one directory (the flat layout of
earlier versions) against tiercache's 64 hashed subdirectories (``block_relpath``).

For each layout, on the same file system: create N files of one block each (``--bytes``, 8 KiB:
a 4 KiB header and a 4 KiB block) named as tiercache names them, on 8 threads; list them (page
cache dropped first, where this process may); open and read 10k random ones (cold); unlink them
all on 8 threads. Prints one line per layout and phase (seconds, files/s).

    python3 benchmarks/fanout.py DIR [--files 1000000] [--bytes 8192]

Reproduces docs/performance/scale.md, "Directory fan-out at a million files".
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tiercache.bench.benchscale import drop_page_cache
from tiercache.files import block_filename, block_relpath

THREADS = 8


def _parallel(fn, items) -> None:
    chunks = [items[i::THREADS] for i in range(THREADS)]
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda c: [fn(x) for x in c], chunks))


def run(base: Path, files: int, nbytes: int, flat: bool) -> dict:
    root = base / ("flat" if flat else "fanout")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    keys = [os.urandom(16) for _ in range(files)]
    paths = [str(root / (block_filename(k, "kv") if flat else block_relpath(k, "kv"))) for k in keys]
    if not flat:
        for p in {os.path.dirname(p) for p in paths}:
            os.mkdir(p)
    data = os.urandom(nbytes)

    def create(p):
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, data)
        os.close(fd)

    out = {}
    t = time.perf_counter()
    _parallel(create, paths)
    out["create_s"] = time.perf_counter() - t
    out["cold"] = drop_page_cache()
    t = time.perf_counter()
    n = 0
    for d in ([root] if flat else sorted(p for p in root.iterdir())):
        with os.scandir(d) as it:
            n += sum(1 for _ in it)
    out["list_s"] = time.perf_counter() - t
    assert n == files
    drop_page_cache()
    sample = random.sample(paths, min(10_000, files))

    def read(p):
        fd = os.open(p, os.O_RDONLY)
        os.read(fd, nbytes)
        os.close(fd)

    t = time.perf_counter()
    _parallel(read, sample)
    out["read10k_s"] = time.perf_counter() - t
    t = time.perf_counter()
    _parallel(os.unlink, paths)
    os.sync()
    out["unlink_s"] = time.perf_counter() - t
    shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--files", type=int, default=1_000_000)
    ap.add_argument("--bytes", type=int, default=8192)
    a = ap.parse_args()
    for flat in (True, False):
        r = run(a.dir, a.files, a.bytes, flat)
        name = "flat (one directory)" if flat else "64 subdirectories"
        print(f"{name:22} create {r['create_s']:.1f} s ({a.files / r['create_s']:.0f}/s), "
              f"list {r['list_s']:.2f} s{'' if r['cold'] else ' (warm: page cache not dropped)'}, "
              f"open+read 10k cold {r['read10k_s']:.2f} s, unlink {r['unlink_s']:.1f} s "
              f"({a.files / r['unlink_s']:.0f}/s)", flush=True)


if __name__ == "__main__":
    main()
