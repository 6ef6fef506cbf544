"""Writes on the ``io_uring`` engine with their publication (rename) on the ring
(``IORING_OP_RENAMEAT``) or as direct system calls, beside the C threads (the default engine),
in one run: :class:`~tiercache.TierCache` over a root or a root array, ``put`` + ``offload`` of
``--batch`` blocks at a time (``fsync = none``: each write publishes itself), every variant on
a fresh root, the variants alternated ``--reps`` times.

Prints one JSON document: per block size and variant the GB/s of each repetition (block bytes
over the time inside the calls) and the process's CPU per block (user + system, microseconds).

    python3 benchmarks/ring_publish.py /mnt/tcarray/d0,/mnt/tcarray/d1 --bs 16k --bs 256k

Reproduces docs/performance/root-arrays.md, "Publication and unlinks on io_uring".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time

import numpy as np

from tiercache import CacheConfig, PoolSpec, TierCache
from tiercache.bench.fiospec import parse_size
from tiercache.files import set_uring_meta, uring_meta

#: variant name -> (io_engine, publication on the ring)
VARIANTS = {"io_uring+ring_renames": ("io_uring", True), "io_uring+syscall_renames": ("io_uring", False),
            "threads": ("threads", False)}


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def write_once(roots: list[str], bs: int, total: int, batch: int, engine: str, ring: bool, seed: int) -> dict:
    """One variant's writes on fresh roots: ``{"gbps", "cpu_us_per_block"}``."""
    for r in roots:
        shutil.rmtree(r, ignore_errors=True)
    set_uring_meta(ring)
    n = max(batch, total // bs)
    cfg = CacheConfig([PoolSpec("kv", (bs,), "uint8")], host_slots=batch, file_slots=n + batch, fsync="none",
                      io_engine=engine, **({"roots": roots} if len(roots) > 1 else {"root": roots[0]}))
    base = np.frombuffer(np.random.default_rng(seed).bytes(batch * bs), np.uint8).reshape(batch, bs)
    cache = TierCache(cfg)
    timed = cpu = 0.0
    try:
        for i in range(0, n, batch):
            keys = list(range(i, min(n, i + batch)))
            data = base[:len(keys)].copy()
            data[:, :8] = np.array(keys, np.int64).view(np.uint8).reshape(-1, 8)
            t, c = time.perf_counter(), _cpu_s()
            cache.put(keys, data)
            cache.offload(keys)
            timed += time.perf_counter() - t
            cpu += _cpu_s() - c
        # every block published whole: read back a sample, byte for byte
        sample = sorted(np.random.default_rng(seed + 1).choice(n, min(n, batch), replace=False).tolist())
        out = cache.get(sample)
        for j, k in enumerate(sample):
            if int(out[j, :8].view(np.int64)[0]) != k or not np.array_equal(out[j, 8:], base[k % batch, 8:]):
                raise RuntimeError(f"block {k} read back wrong")
    finally:
        cache.close()
        set_uring_meta(True)
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)
    return {"gbps": n * bs / timed / 1e9, "cpu_us_per_block": cpu / n * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("roots", help="a directory, or several separated by commas (a root array)")
    p.add_argument("--bs", action="append", help="block size (repeatable; default 16k 64k 256k 2m)")
    p.add_argument("--size", default="512m", help="bytes written per variant and repetition")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    roots = [r + "/ringpub" for r in a.roots.split(",")]
    sizes = []
    for bs in [parse_size(b) for b in (a.bs or ["16k", "64k", "256k", "2m"])]:
        res: dict = {v: {"gbps": [], "cpu_us_per_block": []} for v in VARIANTS}
        for rep in range(a.reps):
            for v, (engine, ring) in VARIANTS.items():
                r = write_once(roots, bs, parse_size(a.size), a.batch, engine, ring, seed=rep)
                for k in r:
                    res[v][k].append(round(r[k], 3))
        sizes.append({"bs": bs, "batch": a.batch, "ring_can_rename": uring_meta(), "variants": res})
        print(json.dumps(sizes[-1]), file=sys.stderr, flush=True)  # each size as it ends
    print(json.dumps({"job": "ring_publish", "roots": a.roots.split(","), "cores": os.cpu_count(),
                      "when": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "sizes": sizes}, indent=1))


if __name__ == "__main__":
    main()
