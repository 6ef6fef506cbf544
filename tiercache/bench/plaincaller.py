"""The API as a plain caller uses it, timed: ``TierCache`` with default settings over a root
array, ``put`` + ``offload`` of ``batch`` blocks at a time, then a fresh process that
``get``s every block in random order, ``batch`` at a time (no ``out``: the cache allocates).

Nothing is tuned (no ``io_threads``, no depth): what the cache chooses from its roots and
block size is what is measured. ``tiercache bench array`` runs it beside fio and the tuned
jobs (:func:`plain_caller`); each phase runs in a process of its own
(``python -m tiercache.bench.plaincaller``), so the reads find nothing in memory.

Block ``k`` holds ``k`` (int64) in its first 8 bytes and the rest of row ``k % batch`` of a
seeded random buffer: every byte read is checked, outside the timed calls.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def _config(roots: list[str], bs: int, n: int, batch: int):
    from tiercache import CacheConfig, PoolSpec

    return CacheConfig([PoolSpec("kv", (bs,), "uint8")], host_slots=batch, file_slots=n + batch,
                       fsync="none", **({"roots": roots} if len(roots) > 1 else {"root": roots[0]}))


def _blocks(seed: int, batch: int, bs: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(batch * bs), np.uint8).reshape(batch, bs).copy()


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def _phase(op: str, roots: list[str], bs: int, total_bytes: int, batch: int, seed: int) -> dict:
    """One phase in this process: ``write`` (put + offload) or ``read`` (get, random order)."""
    from tiercache import TierCache

    n = max(batch, total_bytes // bs)
    base = _blocks(seed, batch, bs)
    cache = TierCache(_config(roots, bs, n, batch))
    timed = user = system = 0.0
    try:
        if op == "write":
            for i in range(0, n, batch):
                keys = list(range(i, min(n, i + batch)))
                data = base[:len(keys)].copy()
                data[:, :8] = np.array(keys, np.int64).view(np.uint8).reshape(-1, 8)
                t, (u, s) = time.perf_counter(), _cpu()
                cache.put(keys, data)
                cache.offload(keys)
                timed += time.perf_counter() - t
                user, system = user + _cpu()[0] - u, system + _cpu()[1] - s
        else:
            order = list(range(n))
            random.Random(seed).shuffle(order)
            for i in range(0, n, batch):
                keys = order[i:i + batch]
                t, (u, s) = time.perf_counter(), _cpu()
                out = cache.get(keys)
                timed += time.perf_counter() - t
                user, system = user + _cpu()[0] - u, system + _cpu()[1] - s
                got_keys = out[:, :8].copy().view(np.int64).reshape(-1)
                want = base[np.array(keys) % batch]
                if not (np.array_equal(got_keys, np.array(keys, np.int64)) and np.array_equal(out[:, 8:], want[:, 8:])):
                    raise RuntimeError(f"plain caller: a block of {keys} read back wrong")
    finally:
        cache.close()
    return {"gbps": n * bs / timed / 1e9, "blocks": n, "seconds": timed,
            "cpu_us_per_block": {"user": user / n * 1e6, "sys": system / n * 1e6}}


def plain_caller(dirs: list[Path], bs: int, total_bytes: int, batch: int = 32, seed: int = 0) -> dict:
    """Both phases (module docstring) over ``dirs`` (one root per device, under
    ``<dir>/plain``, removed after), each in a fresh Python process.

    Returns:
        ``{"write": phase, "read": phase}``, a phase being ``{"gbps", "blocks", "seconds",
        "cpu_us_per_block": {"user", "sys"}}`` (GB/s of block bytes over the time inside
        the API calls; the process's CPU within those calls, all threads, microseconds per
        block).

    Raises:
        RuntimeError: a phase failed (its message), or a block read back wrong.
    """
    roots = [str(Path(d) / "plain") for d in dirs]
    out: dict = {}
    try:
        for op in ("write", "read"):
            cmd = [
                sys.executable,
                "-m",
                "tiercache.bench.plaincaller",
                op,
                "--bs",
                str(bs),
                "--size",
                str(total_bytes),
                "--batch",
                str(batch),
                "--seed",
                str(seed),
                *[a for r in roots for a in ("--root", r)],
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"plain caller {op}: {proc.stderr.strip()[-2000:]}")
            out[op] = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m tiercache.bench.plaincaller write|read --root D ... --bs B --size S``: one
    phase; prints its result as one JSON line."""
    p = argparse.ArgumentParser(prog="python -m tiercache.bench.plaincaller")
    p.add_argument("op", choices=("write", "read"))
    p.add_argument("--root", action="append", required=True)
    p.add_argument("--bs", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(json.dumps(_phase(a.op, a.root, a.bs, a.size, a.batch, a.seed)))


if __name__ == "__main__":
    main()
