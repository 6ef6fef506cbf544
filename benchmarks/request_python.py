"""Where a file-tier request's time goes: inside the native engine's calls, and outside them
(the Python of the request: chunks, names, operations, checks, futures, thread hand-offs).

One :class:`~tiercache.TierCache` over ``ROOT`` (a tmpfs directory shows the Python best: the
storage is not the bound), one request of ``--batch`` host blocks at a time through the file
tier's :meth:`~tiercache.files.FileTier.submit`, writes then reads, each request waited for
before the next (as an engine's step waits for its load). Prints per block: the request's
wall time, the time inside ``NativeIO.run`` and the rest. Every read is checked byte for byte.

    python3 benchmarks/request_python.py /dev/shm/rp --bs 256k --bs 16k --set io_engine=threads

Reproduces docs/performance/root-arrays.md, "The format's own limit, a plain caller, and the C threads
by default".
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

import numpy as np

from tiercache import CacheConfig, PoolSpec, TierCache
from tiercache.arrays import aligned_empty
from tiercache.bench.fiospec import parse_size
from tiercache.files import nativeio


def measure(root: str, bs: int, batch: int, requests: int, settings: dict) -> dict:
    """Per block (microseconds): ``total``, ``native`` (inside ``NativeIO.run``) and
    ``outside``, for ``write`` and ``read``."""
    roots = root.split(",")
    for r in roots:
        shutil.rmtree(r, ignore_errors=True)
    cfg = CacheConfig([PoolSpec("kv", (bs,), "uint8")], host_slots=batch, file_slots=requests * batch + batch,
                      fsync="none", **({"roots": roots} if len(roots) > 1 else {"root": roots[0]}), **settings)
    inside = [0.0]
    orig = nativeio.NativeIO.run

    def timed_run(self, *a):
        t = time.perf_counter()
        try:
            return orig(self, *a)
        finally:
            inside[0] += time.perf_counter() - t

    nativeio.NativeIO.run = timed_run
    out: dict = {}
    try:
        with TierCache(cfg) as cache:
            ft = cache.mover.tiers["file"]
            src = np.frombuffer(np.random.default_rng(bs).bytes(batch * bs), np.uint8).reshape(batch, bs).copy()
            dst = aligned_empty(batch * bs).reshape(batch, bs)
            dst[:] = 0
            for kind in ("write", "read"):
                total, inside[0] = 0.0, 0.0
                for r in range(requests):
                    keys = list(range(r * batch, (r + 1) * batch))
                    bufs = src if kind == "write" else dst
                    t = time.perf_counter()
                    for _, fut in ft.submit(kind, [(k, {"kv": b}) for k, b in zip(keys, bufs)]):
                        fut.result()
                    total += time.perf_counter() - t
                    if kind == "read" and not np.array_equal(dst, src):
                        raise RuntimeError(f"request {r}: blocks read back wrong")
                n = requests * batch
                out[kind] = {"total": total / n * 1e6, "native": inside[0] / n * 1e6,
                             "outside": (total - inside[0]) / n * 1e6}
    finally:
        nativeio.NativeIO.run = orig
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)
    return out


def _value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="a directory, or several joined by commas (a root array)")
    p.add_argument("--bs", action="append", help="block size (repeatable; default 256k)")
    p.add_argument("--batch", type=int, default=32, help="blocks per request")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--set", action="append", default=[], help="file settings k=v,... (repeatable: one run each)")
    a = p.parse_args()
    for bs in [parse_size(b, "--bs") for b in (a.bs or ["256k"])]:
        for spec in a.set or [""]:
            settings = {k: _value(v) for k, v in (kv.split("=", 1) for kv in spec.split(",") if kv)}
            r = measure(a.root, bs, a.batch, a.requests, settings)
            for kind, v in r.items():
                print(f"{bs >> 10:>5} KiB {spec or 'defaults':<34} {kind:<5} {v['total']:7.1f} us/block: "
                      f"native {v['native']:6.1f}, outside {v['outside']:6.1f}")


if __name__ == "__main__":
    main()
