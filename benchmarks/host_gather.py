"""Experiment: how fast the CPU gathers scattered 16 KiB rows of pinned host memory into a
contiguous pinned buffer (numpy take per thread), by thread count, against one contiguous
host -> device copy of the same bytes. Prints one JSON object per line."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tiercache.hostmem import alloc_host

KiB = 1024


def main() -> None:
    import cupy

    block, n = 16 * KiB, 8192
    host, _k1 = alloc_host(2 * n * block, pinned=True)
    host = host.reshape(2 * n, block)
    host[:] = 3
    out, _k2 = alloc_host(n * block, pinned=True)
    out = out.reshape(n, block)
    rng = np.random.default_rng(0)
    rows = rng.permutation(np.sort(rng.choice(2 * n, size=n, replace=False)))
    dev = cupy.empty((n, block), dtype=cupy.uint8)
    st = cupy.cuda.Stream(non_blocking=True)
    t = []
    for _ in range(5):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(st)
        cupy.cuda.runtime.memcpyAsync(dev.data.ptr, out.ctypes.data, n * block, 1, st.ptr)
        b.record(st)
        b.synchronize()
        t.append(cupy.cuda.get_elapsed_time(a, b) / 1e3)
    print(json.dumps({"cpus": os.cpu_count(), "contig_h2d_gbps": n * block / min(t) / 1e9}), flush=True)
    for threads in (1, 2, 4, 8, 12, 16):
        pool = ThreadPoolExecutor(threads)
        parts = np.array_split(np.arange(n), threads)

        def one(p):
            np.take(host, rows[p], axis=0, out=out[p])
        best = 1e9
        for _ in range(5):
            t0 = time.perf_counter()
            list(pool.map(one, parts))
            best = min(best, time.perf_counter() - t0)
        print(json.dumps({"threads": threads, "gather_gbps": n * block / best / 1e9}), flush=True)
        pool.shutdown()


if __name__ == "__main__":
    main()
