"""The metrics benchmark: the same cache work with metrics off and on, alternated in one run.

Off: ``[metrics] enabled = false`` (no per-job totals, nothing registered). On: the default
(every finished job counted in :class:`~tiercache.transfer.TransferStats`), the cache
registered in a registry of its own, served by :func:`tiercache.metrics.start_http_server`, and
a thread scraping that endpoint every ``scrape_s`` seconds (0.1 s by default, 150 times
Prometheus' usual 15 s, so scraping is overrepresented).

Work, through the public API, in calls of ``batch`` small blocks (where per-call costs show most):

- ``file``: ``offload(batch, to="file")`` of host blocks (durable block-file writes), then
  ``onboard(batch, to="host")`` (reads from the files);
- ``copy`` (with a GPU): ``offload(batch, to="host")`` of device blocks, then ``onboard``
  back into VRAM.

Each phase is timed over all its calls; the ratio on/off is taken within each pass and the
median of the passes reported. Every block's bytes are checked at the end of each pass.
"""

from __future__ import annotations

import shutil
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from tiercache.cache import TierCache
from tiercache.config import CacheConfig
from tiercache.cuda import cuda_status
from tiercache.geometry import PoolSpec


class _Scraper:
    """A thread reading ``url`` every ``period`` seconds until stopped; counts its scrapes."""

    def __init__(self, url: str, period: float) -> None:
        self.url, self.period, self.scrapes = url, period, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiercache-bench-scraper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with urllib.request.urlopen(self.url, timeout=10) as resp:
                resp.read()
            self.scrapes += 1
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _one_pass(workload: str, metrics_on: bool, root: Path, pool: PoolSpec, blocks: int, batch: int,
              scrape_s: float, rng: np.random.Generator) -> dict:
    top = "device" if workload == "copy" else "host"
    low = "host" if workload == "copy" else "file"
    cfg = CacheConfig(pools=(pool,), device_slots=blocks if top == "device" else 0, host_slots=blocks,
                      file_slots=blocks if low == "file" else 0, root=root, metrics=metrics_on,
                      metrics_registry="none", metrics_snapshot_s=0)
    data = rng.integers(0, 256, (blocks, pool.block_nbytes), dtype=np.uint8)
    keys = [int(k) for k in rng.choice(1 << 40, blocks, replace=False)]
    batches = [keys[i:i + batch] for i in range(0, blocks, batch)]
    out: dict = {"metrics": "on" if metrics_on else "off"}
    with TierCache(cfg) as cache:
        scraper = server = None
        if metrics_on:
            from prometheus_client import CollectorRegistry

            from tiercache import metrics

            registry = CollectorRegistry()
            metrics.register(cache, registry, name="bench")
            server, _ = metrics.start_http_server(0, registry=registry)
            scraper = _Scraper(f"http://127.0.0.1:{server.server_port}/metrics", scrape_s)
        try:
            cache.put(keys, data, tier=top)
            for phase, call in (("offload", lambda b: cache.offload(b, to=low)),
                                ("onboard", lambda b: cache.onboard(b, to=top))):
                t0 = time.perf_counter()
                for b in batches:
                    call(b)
                dt = time.perf_counter() - t0
                out[phase] = {"seconds": dt, "gbps": blocks * pool.block_nbytes / dt / 1e9,
                              "us_per_call": dt / len(batches) * 1e6}
            got = cache.get(keys)
            out["bytes_ok"] = bool(np.array_equal(got.reshape(blocks, -1).view(np.uint8), data))
        finally:
            if scraper is not None:
                scraper.stop()
                out["scrapes"] = scraper.scrapes
            if server is not None:
                server.shutdown()
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
                      repeat: int = 5, scrape_s: float = 0.1, seed: int | None = None, log=print) -> dict:
    """Metrics off against on (module docstring), ``repeat`` alternated passes per workload.

    Args:
        root: a directory for the passes' file-tier roots (created; each pass's removed).
        block_bytes: bytes per block (one pool).
        blocks: blocks per pass; batch: blocks per call; scrape_s: seconds between scrapes.

    Returns:
        ``{"workloads": {name: {"passes": [...], phase: {"off_gbps", "on_gbps", "ratio"}}}, "ok"}``:
        medians over the passes; ``ok`` is False if any block's bytes differed.

    Raises:
        MissingDependencyError: prometheus-client is not installed.
    """
    from tiercache.metrics import (
        require_prometheus_client,  # the clear error before any work
    )

    require_prometheus_client()
    rng = np.random.default_rng(seed)
    pool = PoolSpec("blk", (block_bytes,), "uint8")
    workloads = ["file"] + (["copy"] if cuda_status().available else [])
    rep: dict = {"block_bytes": block_bytes, "blocks": blocks, "batch": batch, "repeat": repeat,
                 "scrape_s": scrape_s, "record_us": record_cost_us(), "workloads": {}, "ok": True}
    for w in workloads:
        passes = []
        for r in range(repeat):
            pair = {}
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                res = _one_pass(w, on, Path(root) / f"metrics-{w}-{r}-{'on' if on else 'off'}", pool, blocks, batch,
                                scrape_s, rng)
                rep["ok"] &= res["bytes_ok"]
                pair[res["metrics"]] = res
            passes.append(pair)
            log(f"  {w} pass {r + 1}: " + ", ".join(
                f"{ph} off {pair['off'][ph]['gbps']:.3f} on {pair['on'][ph]['gbps']:.3f} GB/s"
                for ph in ("offload", "onboard")))
        summary: dict = {"passes": passes}
        for ph in ("offload", "onboard"):
            summary[ph] = {
                "off_gbps": statistics.median(p["off"][ph]["gbps"] for p in passes),
                "on_gbps": statistics.median(p["on"][ph]["gbps"] for p in passes),
                "off_us_per_call": statistics.median(p["off"][ph]["us_per_call"] for p in passes),
                "on_us_per_call": statistics.median(p["on"][ph]["us_per_call"] for p in passes),
                "ratio": statistics.median(p["on"][ph]["gbps"] / p["off"][ph]["gbps"] for p in passes),
                "ratio_min": min(p["on"][ph]["gbps"] / p["off"][ph]["gbps"] for p in passes),
                "ratio_max": max(p["on"][ph]["gbps"] / p["off"][ph]["gbps"] for p in passes),
            }
        rep["workloads"][w] = summary
    return rep


def format_metrics_report(rep: dict) -> str:
    """The report as a table: per workload and phase, GB/s and us per call off and on, and
    the median ratio on/off with its range over the passes."""
    lines = [(f"metrics off vs on: {rep['blocks']} blocks of {rep['block_bytes'] >> 10} KiB, {rep['batch']} per call, "
              f"{rep['repeat']} alternated passes, on = counted + exported + scraped every {rep['scrape_s']} s"),
             f"{'work':<8}{'phase':<9}{'off GB/s':>10}{'on GB/s':>10}{'off us':>9}{'on us':>9}{'on/off':>8}  range"]
    for w, s in rep["workloads"].items():
        for ph in ("offload", "onboard"):
            d = s[ph]
            lines.append(f"{w:<8}{ph:<9}{d['off_gbps']:>10.3f}{d['on_gbps']:>10.3f}{d['off_us_per_call']:>9.0f}"
                         f"{d['on_us_per_call']:>9.0f}{d['ratio']:>8.3f}  {d['ratio_min']:.3f}-{d['ratio_max']:.3f}")
    lines.append(f"counting one finished job: {rep['record_us']:.2f} us (once per call's job, not per block)")
    lines.append("bytes verified: " + ("ok" if rep["ok"] else "MISMATCH"))
    return "\n".join(lines)
