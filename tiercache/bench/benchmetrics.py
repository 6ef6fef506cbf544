"""The metrics benchmark: the same cache calls with metrics off and on, interleaved in one run.

Two caches of the same geometry live side by side on the same devices: one with ``[metrics]
enabled = false`` (no per-job totals, nothing registered), one with the default (every
finished job counted in :class:`~tiercache.transfer.TransferStats`, the cache registered in a
registry served by :func:`tiercache.metrics.start_http_server`). Their calls alternate one by
one (off, on, on, off, ...), each timed alone, so drifts of the machine (other tenants, disk
state, clocks) fall on both; a pass's ratio is the off time over the on time of all its calls,
and the median of ``repeat`` passes is reported. Passes swap which cache is made first and goes
first (that alone moved reads by up to 1.38x between two identical caches). Work, through the public API, in calls of
``batch`` small blocks (where per-call costs show most):

- ``file``: ``offload(batch, to="file")`` of host blocks (durable block-file writes), then
  ``onboard(batch, to="host")`` (reads from the files);
- ``copy`` (with a GPU): ``offload(batch, to="host")`` of device blocks, then ``onboard``
  back into VRAM.

Scraping runs off the hot path, in the exporter's thread; what it costs is measured apart:
milliseconds per scrape of the busy cache over HTTP, and that over Prometheus' usual 15 s
interval as the share of one core (of the GIL) it takes. Every block's bytes are checked.
"""

from __future__ import annotations

import shutil
import statistics
import time
import urllib.request
from pathlib import Path

import numpy as np

from tiercache.cache import TierCache
from tiercache.config import CacheConfig
from tiercache.cuda import cuda_status
from tiercache.geometry import PoolSpec

SCRAPE_INTERVAL_S = 15.0  # Prometheus' default scrape_interval


def _scrape_ms(url: str, n: int = 20) -> float:
    """Median milliseconds of one scrape of ``url`` (collect, text format, HTTP)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as resp:  # our own server on 127.0.0.1
            resp.read()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _paired_pass(workload: str, root: Path, pool: PoolSpec, blocks: int, batch: int,
                 rng: np.random.Generator, swap: bool = False) -> dict:
    top = "device" if workload == "copy" else "host"
    low = "host" if workload == "copy" else "file"
    data = rng.integers(0, 256, (blocks, pool.block_nbytes), dtype=np.uint8)
    keys = [int(k) for k in rng.choice(1 << 40, blocks, replace=False)]
    batches = [keys[i:i + batch] for i in range(0, blocks, batch)]
    caches = {}
    # which cache is made first (and has root "a"), and which is written and read first, matters by
    # itself (an A/A run of two identical caches: reads of the second up to 1.38x faster on the CPU
    # machine's disk), so passes swap the roles
    for mode, sub in ((("on", "a"), ("off", "b")) if swap else (("off", "a"), ("on", "b"))):
        caches[mode] = TierCache(CacheConfig(
            pools=(pool,), device_slots=blocks if top == "device" else 0, host_slots=blocks,
            file_slots=blocks if low == "file" else 0, root=root / sub, metrics=mode == "on",
            metrics_registry="none", metrics_snapshot_s=0))
    first = list(caches)
    out: dict = {}
    server = None
    try:
        from prometheus_client import CollectorRegistry

        from tiercache import metrics

        registry = CollectorRegistry()
        metrics.register(caches["on"], registry, name="bench")
        server, _ = metrics.start_http_server(0, registry=registry)
        for mode in first:
            caches[mode].put(keys, data, tier=top)
        for phase in ("offload", "onboard"):
            spent = {"off": 0.0, "on": 0.0}
            for i, b in enumerate(batches):
                for mode in (first if i % 2 == 0 else first[::-1]):
                    c = caches[mode]
                    t0 = time.perf_counter()
                    if phase == "offload":
                        c.offload(b, to=low)
                    else:
                        c.onboard(b, to=top)
                    spent[mode] += time.perf_counter() - t0
            out[phase] = {mode: {"seconds": t, "gbps": blocks * pool.block_nbytes / t / 1e9,
                                 "us_per_call": t / len(batches) * 1e6} for mode, t in spent.items()}
            out[phase]["ratio"] = spent["off"] / spent["on"]
        out["scrape_ms"] = _scrape_ms(f"http://127.0.0.1:{server.server_port}/metrics")
        out["bytes_ok"] = all(bool(np.array_equal(c.get(keys).reshape(blocks, -1).view(np.uint8), data))
                              for c in caches.values())
    finally:
        if server is not None:
            server.shutdown()
        for c in caches.values():
            c.close()
        shutil.rmtree(root, ignore_errors=True)
    return out


def record_cost_us(n: int = 100_000) -> float:
    """Microseconds one finished job's counting costs (:meth:`TransferStats.record
    <tiercache.transfer.TransferStats.record>`, the only work metrics add to a call), the
    median of 5 timings of ``n`` records."""
    from tiercache.transfer import TransferStats

    ts = TransferStats()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(n):
            ts.record("host", "file", "POSIX", 8, 8 << 16, 0, 1e-4 * (i & 63))
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def run_metrics_bench(root: Path, *, block_bytes: int = 64 << 10, blocks: int = 1024, batch: int = 8,
                      repeat: int = 5, seed: int | None = None, log=print) -> dict:
    """Metrics off against on (module docstring), ``repeat`` passes per workload.

    Args:
        root: a directory for the passes' file-tier roots (created; each pass's removed).
        block_bytes: bytes per block (one pool); blocks: blocks per pass; batch: blocks per call.

    Returns:
        ``{"workloads": {name: {"passes": [...], phase: {"off_gbps", "on_gbps", "ratio", ...},
        "scrape_ms"}}, "record_us", "ok"}``: medians over the passes (ratio: on speed over off
        speed); ``ok`` is False if any block's bytes differed.

    Raises:
        MissingDependencyError: prometheus-client is not installed.
    """
    from tiercache.metrics import require_prometheus_client  # the clear error before any work

    require_prometheus_client()
    rng = np.random.default_rng(seed)
    pool = PoolSpec("blk", (block_bytes,), "uint8")
    workloads = ["file"] + (["copy"] if cuda_status().available else [])
    rep: dict = {"block_bytes": block_bytes, "blocks": blocks, "batch": batch, "repeat": repeat,
                 "record_us": record_cost_us(), "scrape_interval_s": SCRAPE_INTERVAL_S, "workloads": {}, "ok": True}
    for w in workloads:
        passes = []
        for r in range(repeat):
            res = _paired_pass(w, Path(root) / f"metrics-{w}-{r}", pool, blocks, batch, rng, swap=r % 2 == 1)
            rep["ok"] &= res["bytes_ok"]
            passes.append(res)
            log(
                f"  {w} pass {r + 1}: "
                + ", ".join(
                    f"{ph} off {res[ph]['off']['gbps']:.3f} on {res[ph]['on']['gbps']:.3f} GB/s"
                    for ph in ("offload", "onboard")
                )
            )
        summary: dict = {"passes": passes, "scrape_ms": statistics.median(p["scrape_ms"] for p in passes)}
        for ph in ("offload", "onboard"):
            ratios = [p[ph]["ratio"] for p in passes]
            summary[ph] = {
                "off_gbps": statistics.median(p[ph]["off"]["gbps"] for p in passes),
                "on_gbps": statistics.median(p[ph]["on"]["gbps"] for p in passes),
                "off_us_per_call": statistics.median(p[ph]["off"]["us_per_call"] for p in passes),
                "on_us_per_call": statistics.median(p[ph]["on"]["us_per_call"] for p in passes),
                "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            }
        rep["workloads"][w] = summary
    return rep


def format_metrics_report(rep: dict) -> str:
    """The report as a table: per workload and phase, GB/s and us per call off and on, and
    the median ratio on/off with its range over the passes."""
    lines = [(f"metrics off vs on: {rep['blocks']} blocks of {rep['block_bytes'] >> 10} KiB, {rep['batch']} per call, "
              f"calls of two caches interleaved, {rep['repeat']} passes; on/off = speed with metrics over without"),
             f"{'work':<8}{'phase':<9}{'off GB/s':>10}{'on GB/s':>10}{'off us':>9}{'on us':>9}{'on/off':>8}  range"]
    for w, s in rep["workloads"].items():
        for ph in ("offload", "onboard"):
            d = s[ph]
            lines.append(f"{w:<8}{ph:<9}{d['off_gbps']:>10.3f}{d['on_gbps']:>10.3f}{d['off_us_per_call']:>9.0f}"
                         f"{d['on_us_per_call']:>9.0f}{d['ratio']:>8.3f}  {d['ratio_min']:.3f}-{d['ratio_max']:.3f}")
    lines.append(f"counting one finished job: {rep['record_us']:.2f} us (once per call's job, not per block)")
    for w, s in rep["workloads"].items():
        share = s["scrape_ms"] / 1e3 / rep["scrape_interval_s"]
        lines.append(f"one scrape of the {w} cache: {s['scrape_ms']:.2f} ms, off the hot path "
                     f"({100 * share:.3f}% of one core at a scrape every {rep['scrape_interval_s']:.0f} s)")
    lines.append("bytes verified: " + ("ok" if rep["ok"] else "MISMATCH"))
    return "\n".join(lines)
