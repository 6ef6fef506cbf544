"""Experiment: pinned host memory from cudaHostAlloc (4 KiB pages) against reserved huge pages
registered with CUDA: how long allocating and freeing takes, and how fast each allocation
moves data, allocation by allocation (the guest cannot see where the host put its pages).

For each kind, ``count`` allocations of ``gib`` GiB each, in turn; for each: seconds to allocate
(pinning included) and to free, a contiguous copy of 256 MiB each way (copy engines) and 16 KiB
scattered blocks h2d and d2h by the bulk kernel, with the 1-token partial copy of 2 MiB KV
blocks h2d. Needs ``count * gib`` GiB of huge pages reserved (``sysctl vm.nr_hugepages``).

Prints one JSON object per line. Usage: python benchmarks/host_alloc.py [gib] [count]
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from tiercache.bench.timing import scattered_slots, time_many
from tiercache.copypaths import CopyLauncher, Segments, segments_for
from tiercache.geometry import PoolSpec
from tiercache.memory import MEMCPY_DEFAULT, alloc_host, copy_stream
from tiercache.memory import data_ptr as ptr

KiB, MiB, GiB = 1024, 1 << 20, 1 << 30


def emit(**row) -> None:
    print(json.dumps(row, default=str))
    sys.stdout.flush()


def measure(host: np.ndarray, dev, la, stream, rng, reps: int = 5) -> dict:
    import cupy

    out = {}
    n16 = 16384  # 256 MiB of 16 KiB blocks
    h16 = host[:n16 * 16 * KiB].reshape(n16, 16 * KiB)
    d16 = dev[:n16 * 16 * KiB].reshape(n16, 16 * KiB)
    s, d = scattered_slots(rng, n16), scattered_slots(rng, n16)
    seg = Segments(1, 16 * KiB, 16 * KiB)
    pool = PoolSpec.kv("kv", num_layers=32, kv_factor=2, num_kv_heads=8, tokens_per_block=16, head_dim=128,
                       dtype="bfloat16")
    nkv = 256  # 512 MiB of 2 MiB blocks
    hkv = host[:nkv * pool.block_nbytes].reshape(nkv, pool.block_nbytes)
    dkv = dev[:nkv * pool.block_nbytes].reshape(nkv, pool.block_nbytes)
    pseg = segments_for(pool, 1)
    ks, kd = scattered_slots(rng, nkv), scattered_slots(rng, nkv)
    moved = 256 * MiB
    fns = {"contig_h2d": lambda: cupy.cuda.runtime.memcpyAsync(ptr(d16), ptr(h16), moved, MEMCPY_DEFAULT, stream.ptr),
           "contig_d2h": lambda: cupy.cuda.runtime.memcpyAsync(ptr(h16), ptr(d16), moved, MEMCPY_DEFAULT, stream.ptr),
           "bulk16k_h2d": lambda: la.launch(h16, s, d16, d, seg, stream, force="bulk"),
           "bulk16k_d2h": lambda: la.launch(d16, d, h16, s, seg, stream, force="bulk"),
           "partial1_h2d": lambda: la.launch(hkv, ks, dkv, kd, pseg, stream, force="kernel")}
    t = time_many(fns, stream, reps, back_to_back=4)
    for k, v in t.items():
        out[k] = round((nkv * pseg.nbytes if k.startswith("partial") else moved) / v / 1e9, 2)
    # the partial copy against a contiguous copy of its own byte count, from the same memory
    pm = nkv * pseg.nbytes
    tc = time_many({"c": lambda: cupy.cuda.runtime.memcpyAsync(ptr(dkv), ptr(hkv), pm, MEMCPY_DEFAULT, stream.ptr)},
                    stream, reps, back_to_back=4)["c"]
    out["partial1_ratio"] = round(tc / t["partial1_h2d"], 3)
    out["bulk16k_h2d_ratio"] = round(out["bulk16k_h2d"] / out["contig_h2d"], 3)
    out["bulk16k_d2h_ratio"] = round(out["bulk16k_d2h"] / out["contig_d2h"], 3)
    return out


def main(gib: int = 4, count: int = 3) -> None:
    import cupy

    nbytes = gib * GiB
    dev = cupy.empty(GiB, dtype=cupy.uint8)
    la = CopyLauncher(0, max_sms=8)
    stream = copy_stream("high")
    rng = np.random.default_rng(3)
    for i in range(count):
        for kind in ("off", "on"):
            t0 = time.perf_counter()
            host, owner = alloc_host(nbytes, pinned=True, huge_pages=kind)
            t1 = time.perf_counter()
            host[::4096] = 1  # touched already; this is a no-op pass over the pages
            t2 = time.perf_counter()
            row = measure(host, dev, la, stream, rng)
            t3 = time.perf_counter()
            del host, owner
            import gc

            gc.collect()
            t4 = time.perf_counter()
            emit(round=i, pages=kind, source="hugetlb" if kind == "on" else "cudaHostAlloc", gib=gib,
                 alloc_s=round(t1 - t0, 3), touch_s=round(t2 - t1, 3), free_s=round(t4 - t3, 3), **row)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
