"""The main job: blocks through every tier and back, every byte verified.

Stages (with a GPU)::

    put -> device, device -> host, host -> file, reopen, file -> host, host -> device, verify,
    then the direct path: device -> file (GDS / kvikio compat / POSIX), reopen,
    file -> device, verify.

Without a GPU the host tier is the top: put -> host, host -> file, reopen, file -> host,
verify. Keys are random ints and the data random bytes (never zeros). The job runs in a fresh
directory ``bench-<time>-<pid>`` under the configured root, removed afterwards unless
``keep``.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tiercache.bench.stagestats import StageStats
from tiercache.cache import TierCache
from tiercache.config import CacheConfig
from tiercache.cuda import cuda_status
from tiercache.errors import ConfigError, TierCacheError


def _memcopy_label() -> str:
    return "cudaMemcpyAsync" if cuda_status().available else "memcpy"


def _batched(keys: list[int], batch: int):
    for i in range(0, len(keys), batch):
        yield i, keys[i:i + batch]


def _timed(name: str, path: str, keys: list[int], batch: int, nbytes_per_block: int,
           fn: Callable[[int, list[int]], object]) -> StageStats:
    st = StageStats(name, path, request_blocks=batch)
    t0 = time.perf_counter()
    for i, ks in _batched(keys, batch):
        t = time.perf_counter()
        fn(i, ks)
        st.latencies.append(time.perf_counter() - t)
        st.blocks += len(ks)
    st.seconds = time.perf_counter() - t0
    st.nbytes = st.blocks * nbytes_per_block
    return st


def _verify(cache: TierCache, keys: list[int], expected: dict[str, np.ndarray], batch: int) -> tuple[int, list[int]]:
    """(verified blocks, keys whose bytes differ), reading through ``get`` in batches."""
    bad: list[int] = []
    for i, ks in _batched(keys, batch):
        for pool, exp in expected.items():
            out = np.empty((len(ks), exp.shape[1]), dtype=np.uint8)
            cache.get(ks, pool=pool, out=out)
            rows = np.flatnonzero((out != exp[i:i + len(ks)]).any(axis=1))
            bad.extend(ks[r] for r in rows.tolist())
    bad = sorted(set(bad))
    return len(keys) - len(bad), bad


def run_main_job(config: CacheConfig, batch: int = 32, blocks: int | None = None, seed: int | None = None,
                 keep: bool = False, progress: Callable[[str], None] | None = None) -> dict:
    """Run the main job on ``config``; returns the report (see :func:`format_report`).

    Args:
        config: the cache configuration (its root's ``bench-*`` subdirectory is used).
        batch: blocks per request (1..4096).
        blocks: blocks to move (default: the top tier's slots, at most the file tier's).
        seed: random seed (default: fresh entropy; reported).
        keep: keep the job's directory.
        progress: called with each stage's name as it starts.

    Raises:
        ConfigError: no file tier, a bad batch or block count.
        TierCacheError: any failure of the cache (the report is not produced).
    """
    if config.file_slots == 0:
        raise ConfigError("the main job needs a file tier: file_slots = 0")
    if not 1 <= batch <= 4096:
        raise ConfigError(f"batch = {batch} must be in [1, 4096]")
    seed = int(np.random.SeedSequence(seed).entropy % (1 << 63)) if seed is None else seed
    rng = np.random.default_rng(seed)
    root = Path(config.root) / f"bench-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    cfg = config.replace(root=root)
    note = progress or (lambda _s: None)
    stages: list[StageStats] = []
    verify_results = []
    try:
        cache = TierCache(cfg)
        top = cache.top_tier
        if top == "file":
            raise ConfigError("the main job needs a memory tier (device_slots or host_slots > 0)")
        top_slots = cache.placement.tiers[top].num_slots
        n = min(top_slots, cfg.file_slots) if blocks is None else blocks
        if not 1 <= n <= min(top_slots, cfg.file_slots):
            raise ConfigError(f"blocks = {n} must be in [1, {min(top_slots, cfg.file_slots)}] "
                              f"(the {top} tier's and the file tier's slots)")
        per_block = cfg.block_nbytes
        keys = [int(k) for k in rng.choice(1 << 62, size=n, replace=False)]
        expected = {p.name: np.frombuffer(rng.bytes(n * p.block_nbytes), dtype=np.uint8).reshape(n, p.block_nbytes)
                    for p in cfg.pools}
        mem = _memcopy_label()
        tiers = cache.tier_names

        def stage(name, path, fn):
            note(name)
            stages.append(_timed(name, path, keys, batch, per_block, fn))

        stage(f"put -> {top}", mem, lambda i, ks: cache.put(ks, {p: e[i:i + len(ks)] for p, e in expected.items()}))
        if "device" in tiers and "host" in tiers:
            stage("device -> host", mem, lambda i, ks: cache.offload(ks, to="host"))
        src = "host" if "host" in tiers else top
        stage(f"{src} -> file", "POSIX", lambda i, ks: cache.offload(ks, to="file"))
        cache, st = _reopen(cache, cfg, n, note)
        stages.append(st)
        up = "host" if "host" in tiers else top
        stage(f"file -> {up}", "POSIX", lambda i, ks: cache.onboard(ks, to=up))
        if "device" in tiers and up != "device":
            stage("host -> device", mem, lambda i, ks: cache.onboard(ks, to="device"))
        note("verify")
        verify_results.append(("tiers", *_verify(cache, keys, expected, batch)))
        if "device" in tiers:
            # the direct path: VRAM <-> files without the host tier
            for t in ("host", "file"):
                if t in tiers:
                    cache.evict(keys, tier=t)
            stage("device -> file", cache.io_path.label, lambda i, ks: cache.offload(ks, to="file"))
            cache, st = _reopen(cache, cfg, n, note)
            stages.append(st)
            stage("file -> device", cache.io_path.label, lambda i, ks: cache.onboard(ks, to="device"))
            note("verify")
            verify_results.append(("direct", *_verify(cache, keys, expected, batch)))
        stats = cache.stats()
        cache.close()
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    ok = all(not bad for _, _, bad in verify_results)
    return {
        "job": "main",
        "ok": ok,
        "seed": seed,
        "blocks": n,
        "block_nbytes": per_block,
        "batch": batch,
        "io_path": stats["io_path"],
        "cuda": stats["cuda"],
        "tiers": {t: {"slots": v["slots"]} for t, v in stats["tiers"].items()},
        "pools": stats["pools"],
        "root": str(root),
        "kept": keep,
        "stages": [s.as_dict() for s in stages],
        "verify": [{"round": r, "verified_blocks": v, "mismatched_keys": bad[:20], "mismatched": len(bad)}
                   for r, v, bad in verify_results],
        "counters": stats["counters"],
    }


def _reopen(cache: TierCache, cfg: CacheConfig, n: int, note) -> tuple[TierCache, StageStats]:
    note("reopen")
    cache.close()
    t = time.perf_counter()
    cache = TierCache(cfg)
    cache.wait_reconciled()  # every block listed: the count below is the directory's
    st = StageStats("reopen", "saved index" if cache.scan.from_index else "header scan",
                    blocks=len(cache.keys("file")), seconds=time.perf_counter() - t)
    st.latencies.append(st.seconds)
    if st.blocks != n:
        raise TierCacheError(f"reopen found {st.blocks} blocks in the file tier, expected {n}")
    return cache, st


def format_report(rep: dict) -> str:
    """A short fio-like text summary of a main-job report."""
    pools = ", ".join(f"{p['name']} {p['block_shape']} {p['dtype']}" for p in rep["pools"])
    lines = [
        f"tiercache main job: {rep['blocks']} blocks x {rep['block_nbytes'] / 2**20:.2f} MiB "
        f"(pools: {pools}); requests of {rep['batch']} blocks; seed {rep['seed']}",
        "  tiers: " + ", ".join(f"{t} {v['slots']} slots" for t, v in rep["tiers"].items()),
        f"  I/O path: {rep['io_path']['label']} ({rep['io_path']['reason']})",
        "",
        f"  {'stage':<24}{'path':<17}{'blocks':>7}{'MiB':>10}{'GB/s':>8}{'blocks/s':>10}"
        f"{'lat p50 ms':>12}{'p99 ms':>9}",
    ]
    if rep.get("kept"):
        lines.insert(3, f"  block files kept in {rep['root']} (tiercache verify --root {rep['root']})")
    for s in rep["stages"]:
        lines.append(
            f"  {s['stage']:<24}{s['path']:<17}{s['blocks']:>7}{s['bytes'] / 2**20:>10.1f}"
            f"{s['gb_per_s']:>8.2f}{s['blocks_per_s']:>10.0f}{s['lat_ms']['p50']:>12.2f}{s['lat_ms']['p99']:>9.2f}"
        )
    lines.append("")
    for v in rep["verify"]:
        status = (
            "OK"
            if not v["mismatched"]
            else f"FAILED: {v['mismatched']} block(s) differ, e.g. {v['mismatched_keys'][:5]}"
        )
        lines.append(f"  verify ({v['round']}): {v['verified_blocks']}/{rep['blocks']} blocks byte-exact: {status}")
    lines.append(f"  result: {'OK' if rep['ok'] else 'FAILED'}")
    return "\n".join(lines)
