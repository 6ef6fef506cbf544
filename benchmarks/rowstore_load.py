"""A row store's loads as an engine's connector issues them: where the calling thread's time goes.

Stores ``--blocks`` random blocks from the rows of a page-aligned host buffer into ``ROOT``
(:class:`~tiercache.RowStore`), then loads them back ``--runs`` times in pieces of ``--piece``
blocks, every piece submitted before the first is waited for (as the vLLM connector's worker
does), and checks the bytes of the last run. Prints per block: the submit call's time on the
calling thread (p50 and p90 over every piece of every run; the I/O threads run the reads
beside it) and the whole load's time (p50 over runs). Then the stores of a full store: a
store of ``2 x --blocks`` blocks is filled, and each of ``--runs`` rounds stores ``--blocks`` new
blocks in pieces (each piece evicts as many least recently used ones, whose files are
recycled or deleted); prints the round's time per block (p50 over rounds) and checks the
last round's bytes.

    python3 benchmarks/rowstore_load.py /dev/shm/rl --bs 16k --bs 256k

Reproduces docs/vllm.md, "The cold round" (the submits of a load on the CPU machine), and
docs/performance/root-arrays.md, "Evictions in one native batch" (the stores).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import numpy as np

from tiercache import RowStore
from tiercache.arrays import aligned_empty
from tiercache.bench.fiospec import parse_size
from tiercache.integrations.rowjobs import RowJobs


def measure(root: str, bs: int, blocks: int, piece: int, runs: int) -> dict:
    """``{"submit_p50_us", "submit_p90_us", "load_us"}`` per block (module docstring)."""
    shutil.rmtree(root, ignore_errors=True)
    rows = aligned_empty(blocks * bs).reshape(blocks, bs)
    rows[:] = np.frombuffer(np.random.default_rng(bs).bytes(blocks * bs), np.uint8).reshape(blocks, bs)
    want = rows.copy()
    jobs = RowJobs()
    submits: list[float] = []
    loads: list[float] = []
    with RowStore(rows, root, capacity_blocks=4 * blocks, fsync="none", on_finish=jobs.finished_hook) as st:
        jobs.attach(st)
        keys = [os.urandom(16) for _ in range(blocks)]
        assert jobs.wait(jobs.submit(st.submit_store, keys, list(range(blocks)))).success
        for _ in range(runs):
            rows[:] = 0
            t0, ids = time.perf_counter(), []
            for lo in range(0, blocks, piece):
                t = time.perf_counter()
                ids.append(jobs.submit(st.submit_load, keys[lo:lo + piece], list(range(lo, lo + piece))))
                submits.append((time.perf_counter() - t) / piece)
            for jid in ids:
                assert jobs.wait(jid).success, "a load failed"
            loads.append((time.perf_counter() - t0) / blocks)
        if not np.array_equal(rows, want):
            raise RuntimeError("blocks read back wrong")
    shutil.rmtree(root, ignore_errors=True)
    submits.sort()
    return {"submit_p50_us": submits[len(submits) // 2] * 1e6, "submit_p90_us": submits[int(len(submits) * 0.9)] * 1e6,
            "load_us": statistics.median(loads) * 1e6, "store_us": churn(root, rows, piece, runs)}


def churn(root: str, rows: np.ndarray, piece: int, runs: int) -> float:
    """Stores into a full row store (module docstring): p50 microseconds per block of a round."""
    blocks = rows.shape[0]
    rng = np.random.default_rng(blocks)
    jobs = RowJobs()
    times: list[float] = []
    with RowStore(rows, root, capacity_blocks=2 * blocks, fsync="none", on_finish=jobs.finished_hook) as st:
        jobs.attach(st)
        for r in range(runs + 2):
            rows[:] = np.frombuffer(rng.bytes(rows.size), np.uint8).reshape(rows.shape)
            keys = [os.urandom(16) for _ in range(blocks)]
            t0 = time.perf_counter()
            ids = [jobs.submit(st.submit_store, keys[lo:lo + piece], list(range(lo, lo + piece)))
                   for lo in range(0, blocks, piece)]
            for jid in ids:
                res = jobs.wait(jid)
                assert res.success, f"a store failed: {list(res.failed.values())[:1]}"
            if r >= 2:  # rounds 0 and 1 fill the store; the others evict as many blocks as they store
                times.append((time.perf_counter() - t0) / blocks)
        want = rows.copy()
        rows[:] = 0
        assert jobs.wait(jobs.submit(st.submit_load, keys, list(range(blocks)))).success
        if not np.array_equal(rows, want):
            raise RuntimeError("stored blocks read back wrong")
    shutil.rmtree(root, ignore_errors=True)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root")
    p.add_argument("--bs", action="append", help="block size (repeatable; default 16k)")
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--piece", type=int, default=32, help="blocks per submit")
    p.add_argument("--runs", type=int, default=20)
    a = p.parse_args()
    for bs in [parse_size(b, "--bs") for b in (a.bs or ["16k"])]:
        r = measure(a.root, bs, a.blocks, a.piece, a.runs)
        print(f"{bs >> 10:>5} KiB: submit {r['submit_p50_us']:.1f} us/block p50, {r['submit_p90_us']:.1f} p90; "
              f"load {r['load_us']:.1f} us/block; stores into a full store {r['store_us']:.1f} us/block")


if __name__ == "__main__":
    main()
