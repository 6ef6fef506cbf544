"""The shared-root benchmark: ``N`` processes reading and writing one root against one process
doing the same work alone, in one run.

Each process opens the root in shared mode (``[file] sharing = "shared"``, the user's other
file settings: fsync policy, I/O engine, direct I/O, ``io_threads``) and, after a barrier
that every process of the pass reaches with its cache open:

- **write**: ``put(keys, data, tier="file")`` of its own ``blocks`` random blocks in calls of
  ``batch`` (durable block files, published one by one);
- **read** (after a second barrier): ``get`` of the blocks the *next* process wrote, which it
  finds in the root (discovery: one ``stat`` per pool file; or the background reconciliation
  of the open, which lists the root's subdirectories, adopted it first) and reads from their files;
  every byte is compared with what the writer put.

A phase's aggregate speed is all processes' bytes over the time from the first process's
start to the last one's end (one clock: one machine). The single-process run writes and
reads ``N * blocks`` blocks alone, in the same calls. Passes alternate which run goes first;
the ratio reported is the median over passes of ``N``-process over one-process speed.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from tiercache.geometry import PoolSpec

BARRIER_TIMEOUT_S = 300.0


def _keys(seed: int, writer: int, blocks: int) -> list[bytes]:
    """Content keys of ``writer``'s blocks (the same in every process)."""
    return [hashlib.sha256(b"bench-shared-%d-%d-%d" % (seed, writer, i)).digest()[:16] for i in range(blocks)]


def _data(seed: int, writer: int, blocks: int, nbytes: int) -> np.ndarray:
    """``writer``'s block bytes, ``uint8 [blocks, nbytes]``."""
    return np.random.default_rng([seed, writer]).integers(0, 256, (blocks, nbytes), dtype=np.uint8)


def _worker(root: str, pool: PoolSpec, index: int, procs: int, blocks: int, batch: int, seed: int,
            file_options: dict, barrier, results) -> None:
    """One process of a pass; puts ``{"index", "write": (t0, t1), "read": (t0, t1), "ok",
    "discovered", "adopted"}`` (or ``{"index", "error"}``) on ``results``."""
    from tiercache.cache import TierCache
    from tiercache.config import CacheConfig

    out: dict = {"index": index}
    try:
        keys, data = _keys(seed, index, blocks), _data(seed, index, blocks, pool.block_nbytes)
        peer = (index + 1) % procs
        cfg = CacheConfig(pools=(pool,), host_slots=0, file_slots=procs * blocks + 1, root=root, sharing="shared",
                          min_age_s=3600.0, negative_ttl_s=0.0, metrics_registry="none", metrics_snapshot_s=0,
                          **file_options)
        with TierCache(cfg) as cache:
            barrier.wait(BARRIER_TIMEOUT_S)
            t0 = time.time()
            for i in range(0, blocks, batch):
                cache.put(keys[i:i + batch], data[i:i + batch], tier="file")
            out["write"] = (t0, time.time())
            barrier.wait(BARRIER_TIMEOUT_S)
            want, got = _keys(seed, peer, blocks), np.empty_like(data)
            t0 = time.time()
            for i in range(0, blocks, batch):
                cache.get(want[i:i + batch], out=got[i:i + batch])
            out["read"] = (t0, time.time())
            out["ok"] = bool(np.array_equal(got, _data(seed, peer, blocks, pool.block_nbytes)))
            counters = cache.stats()["counters"]  # found by a stat probe, or listed by the open's reconciliation
            out["discovered"] = int(counters.get("discovered_blocks", 0))
            out["adopted"] = int(counters.get("adopted_blocks", 0))
    except BaseException as exc:  # reported to the parent, which fails the pass
        barrier.abort()
        out["error"] = f"{type(exc).__name__}: {exc}"
    results.put(out)


def _run(root: Path, pool: PoolSpec, procs: int, blocks: int, batch: int, seed: int, file_options: dict) -> dict:
    """One run of ``procs`` processes of ``blocks`` blocks each on a fresh ``root``."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(str(root), pool, i, procs, blocks, batch, seed, file_options,
                                                 barrier, results)) for i in range(procs)]
    try:
        for w in workers:
            w.start()
        outs = [results.get(timeout=3 * BARRIER_TIMEOUT_S) for _ in workers]
        for w in workers:
            w.join(60)
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
        shutil.rmtree(root, ignore_errors=True)
    errors = [o["error"] for o in outs if "error" in o]
    if errors:
        from tiercache.errors import TierCacheError

        raise TierCacheError(f"shared-root bench: a process failed: {errors[0]}")
    nbytes = procs * blocks * pool.block_nbytes
    rep = {"procs": procs, "blocks": procs * blocks, "ok": all(o["ok"] for o in outs),
           "discovered": sum(o["discovered"] for o in outs), "adopted": sum(o.get("adopted", 0) for o in outs)}
    for phase in ("write", "read"):
        t = max(o[phase][1] for o in outs) - min(o[phase][0] for o in outs)
        rep[phase] = {"seconds": t, "gbps": nbytes / t / 1e9}
    return rep


def run_shared_bench(root: Path, procs: int = 4, blocks: int = 512, block_bytes: int = 64 << 10, batch: int = 16,
                     repeat: int = 3, seed: int | None = None, file_options: dict | None = None,
                     log=lambda s: None) -> dict:
    """``procs`` processes on one shared root against one process, ``repeat`` alternated passes.

    Args:
        root: a directory for the runs (each pass uses and removes a fresh subdirectory).
        procs: processes sharing the root, 2..64.
        blocks: blocks each of them writes (and another reads); the single process does
            ``procs * blocks``.
        block_bytes: bytes per block (one ``uint8`` pool).
        batch: blocks per ``put`` / ``get`` call.
        repeat: passes; the ratios reported are medians over them.
        seed: random seed (None: a random one, reported).
        file_options: other :class:`~tiercache.config.CacheConfig` file fields (``fsync``,
            ``io_engine``, ``io_threads``, ``direct_io``...).

    Returns:
        ``{"procs", "block_bytes", "batch", "seed", "passes": [{"single", "shared",
        "write_ratio", "read_ratio"}], "write_ratio", "read_ratio", "ok"}``, speeds in GB/s
        (1e9 bytes per second).

    Raises:
        ConfigError: ``procs`` or sizes out of range. TierCacheError: a process failed.
    """
    from tiercache.errors import ConfigError

    if not 2 <= procs <= 64:
        raise ConfigError(f"--procs {procs} is out of range: 2..64 processes")
    if blocks < 1 or batch < 1 or block_bytes < 1:
        raise ConfigError(f"blocks ({blocks}), batch ({batch}) and block bytes ({block_bytes}) must be positive")
    seed = int(np.random.default_rng().integers(1 << 31)) if seed is None else seed
    pool = PoolSpec("kv", (block_bytes,), "uint8")
    opts = dict(file_options or {})
    passes = []
    for p in range(repeat):
        runs = {}
        for name in (("single", "shared") if p % 2 == 0 else ("shared", "single")):
            n = procs if name == "shared" else 1
            runs[name] = _run(Path(root) / f"shared-bench-{p}-{name}", pool, n, blocks * procs // n, batch,
                              seed + p, opts)
        runs["write_ratio"] = runs["shared"]["write"]["gbps"] / runs["single"]["write"]["gbps"]
        runs["read_ratio"] = runs["shared"]["read"]["gbps"] / runs["single"]["read"]["gbps"]
        passes.append(runs)
        log(f"pass {p + 1}/{repeat}: write {runs['shared']['write']['gbps']:.3f} vs "
            f"{runs['single']['write']['gbps']:.3f} GB/s, read {runs['shared']['read']['gbps']:.3f} vs "
            f"{runs['single']['read']['gbps']:.3f} GB/s")
    return {"procs": procs, "block_bytes": block_bytes, "batch": batch, "blocks_per_proc": blocks, "seed": seed,
            "file_options": opts, "passes": passes,
            "write_ratio": statistics.median(r["write_ratio"] for r in passes),
            "read_ratio": statistics.median(r["read_ratio"] for r in passes),
            "ok": all(r[n]["ok"] for r in passes for n in ("single", "shared"))
            # each reader found its peer's blocks by a probe or in the open's reconciliation (which
            # may also adopt the blocks of writers it does not read: hence at least)
            and all(r["shared"]["discovered"] + r["shared"]["adopted"] >= procs * blocks for r in passes)}


def format_shared_report(rep: dict) -> str:
    """A text table of :func:`run_shared_bench`'s report."""
    kib = rep["block_bytes"] >> 10
    lines = [
        f"shared root: {rep['procs']} processes vs 1, {kib} KiB blocks, {rep['batch']} per call, "
        f"{rep['blocks_per_proc']} blocks per process, seed {rep['seed']}",
        f"{'pass':>4}  {'write 1p':>9}  {'write Np':>9}  {'ratio':>6}  {'read 1p':>9}  {'read Np':>9}  {'ratio':>6}",
    ]
    for i, r in enumerate(rep["passes"]):
        lines.append(f"{i + 1:>4}  {r['single']['write']['gbps']:>9.3f}  {r['shared']['write']['gbps']:>9.3f}  "
                     f"{r['write_ratio']:>6.2f}  {r['single']['read']['gbps']:>9.3f}  "
                     f"{r['shared']['read']['gbps']:>9.3f}  {r['read_ratio']:>6.2f}")
    lines.append(f"median ratio (N processes / one, aggregate GB/s): write {rep['write_ratio']:.2f}, "
                 f"read {rep['read_ratio']:.2f}")
    lines.append("bytes: " + ("every block verified" if rep["ok"] else "MISMATCH or blocks not found"))
    return "\n".join(lines)
