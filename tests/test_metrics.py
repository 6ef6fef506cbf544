"""Prometheus metrics (tiercache.metrics) and the live view (tiercache top).

The exporter is scraped over HTTP on 127.0.0.1 and parsed with prometheus_client's parser:
after random known work, every counter equals the blocks and bytes moved, the hit/miss
walks are exact, and the latency histograms count every job the engine finished (checked
against the jobs' own results)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
from conftest import bpath, random_blocks, random_keys, random_kv_pool

from tiercache import (
    CacheConfig,
    ConfigError,
    MissingDependencyError,
    PoolSpec,
    TierCache,
    TransferError,
)
from tiercache.config import config_from_dict
from tiercache.files import DATA_OFFSET

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tiercache import metrics


def _cfg(tmp_path, pool, **kw) -> CacheConfig:
    kw = {"host_slots": 64, "file_slots": 64, "metrics_registry": "none", "metrics_snapshot_s": 0, **kw}
    return CacheConfig(pools=(pool,), root=tmp_path / "root", fsync="none", **kw)


@pytest.fixture
def exporter():
    """A registry of its own served on a free port of 127.0.0.1; yields (registry, scrape)."""
    registry = CollectorRegistry()
    server, thread = metrics.start_http_server(0, registry=registry)
    url = f"http://127.0.0.1:{server.server_port}/metrics"

    def scrape() -> dict:
        """{(sample name, frozenset(labels)): value}"""
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, frozenset(s.labels.items()))] = s.value
        return out

    scrape.url = url
    yield registry, scrape
    server.shutdown()
    thread.join(5)


def _get(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def _select(samples: dict, name: str, **labels) -> dict:
    """Samples of ``name`` whose labels include ``labels``: {labels dict as frozenset: value}."""
    want = set(labels.items())
    return {lab: v for (n, lab), v in samples.items() if n == name and want <= set(lab)}


def _jobs_by_pair(results) -> dict:
    out: dict = {}
    for r in results:
        d = out.setdefault((r.src, r.dst), {"jobs": 0, "blocks": 0, "bytes": 0, "seconds": 0.0})
        d["jobs"] += 1
        d["blocks"] += r.blocks
        d["bytes"] += r.nbytes
        d["seconds"] += r.seconds
    return out


def test_exporter_counts_known_work(tmp_path, rng, exporter):
    registry, scrape = exporter
    pool = random_kv_pool(rng)
    n = int(rng.integers(4, 21))
    m, k = int(rng.integers(1, n + 1)), int(rng.integers(1, n + 1))
    keys = random_keys(rng, n)
    absent = [b"absent-" + bytes(rng.integers(0, 256, 8, dtype=np.uint8)) for _ in range(int(rng.integers(1, 6)))]
    looked = [keys[i] for i in rng.choice(n, int(rng.integers(1, n + 1)), replace=False)]
    with TierCache(_cfg(tmp_path, pool)) as c:
        label = f"t{rng.integers(1 << 30)}"
        assert metrics.register(c, registry, name=label) == label
        data = random_blocks(rng, pool, n)
        c.put(keys, data)
        c.offload(keys[:m], to="file")
        c.onboard(keys[:m], to="host")          # m misses in host, m hits in the file tier
        c.onboard(keys[m:], to="host")          # already there: n - m hits, nothing copied
        got = c.get(keys[:k])
        assert np.array_equal(got.reshape(k, -1).view(np.uint8), data[:k])
        for key in looked + absent:
            c.lookup(key)
        s = scrape()
        jobs = _jobs_by_pair(c.get_finished())
        B = pool.block_nbytes
        want = {("caller", "host"): n, ("host", "file"): m, ("file", "host"): m, ("host", "caller"): k}
        for (src, dst), blocks in want.items():
            assert _get(s, "tiercache_transferred_blocks_total", cache=label, src=src, dst=dst) == blocks
            assert _get(s, "tiercache_transferred_bytes_total", cache=label, src=src, dst=dst) == blocks * B
            assert _get(s, "tiercache_transfer_failed_blocks_total", cache=label, src=src, dst=dst) == 0
            assert jobs[(src, dst)]["blocks"] == blocks
        assert set(jobs) == set(want)
        # the histograms count every job the engine finished, with their time
        for (src, dst), j in jobs.items():
            hist = _select(s, "tiercache_transfer_seconds_count", cache=label, src=src, dst=dst)
            assert sum(hist.values()) == j["jobs"]
            total = sum(_select(s, "tiercache_transfer_seconds_sum", cache=label, src=src, dst=dst).values())
            assert total == pytest.approx(j["seconds"], rel=1e-6)
            for labels in hist:
                path = dict(labels)["path"]
                buckets = sorted((float(dict(lab)["le"]), v) for lab, v in _select(
                    s, "tiercache_transfer_seconds_bucket", cache=label, src=src, dst=dst, path=path).items())
                counts = [v for _, v in buckets]
                assert counts == sorted(counts) and buckets[-1] == (float("inf"), hist[labels])
        # occupancy
        assert _get(s, "tiercache_tier_blocks", cache=label, tier="host") == n
        assert _get(s, "tiercache_tier_blocks", cache=label, tier="file") == m
        assert _get(s, "tiercache_tier_capacity_blocks", cache=label, tier="host") == 64
        assert _get(s, "tiercache_tier_used_bytes", cache=label, tier="host") == n * B
        assert _get(s, "tiercache_tier_used_bytes", cache=label, tier="file") == m * c.config.block_file_bytes
        # hit/miss walks
        assert _get(s, "tiercache_onboards_total", cache=label, tier="host", result="miss") == m
        assert _get(s, "tiercache_onboards_total", cache=label, tier="host", result="hit") == n - m
        assert _get(s, "tiercache_onboards_total", cache=label, tier="file", result="hit") == m
        assert _get(s, "tiercache_onboards_total", cache=label, tier="file", result="miss") == 0
        assert _get(s, "tiercache_lookups_total", cache=label, tier="host", result="hit") == len(looked)
        assert _get(s, "tiercache_lookups_total", cache=label, tier="host", result="miss") == len(absent)
        assert _get(s, "tiercache_lookups_total", cache=label, tier="file", result="miss") == len(absent)
        assert _get(s, "tiercache_lookups_total", cache=label, tier="file", result="hit") == 0
        assert _get(s, "tiercache_get_blocks_total", cache=label, tier="host") == k
        for op, v in (("put", n), ("onboarded", n)):
            assert _get(s, "tiercache_blocks_total", cache=label, op=op) == v
        # the I/O path as a labelled gauge: exactly the one this cache took
        paths = {dict(lab)["path"]: v for lab, v in _select(s, "tiercache_io_path", cache=label).items()}
        assert paths == {p: float(p == c.stats()["io_path"]["name"]) for p in ("gds", "compat", "posix")}
        engines = _select(s, "tiercache_file_io_engine", cache=label)
        assert sum(engines.values()) == 1
        assert _get(s, "tiercache_file_io_engine", cache=label, engine=c.stats()["tiers"]["file"]["io_engine"]) == 1


def test_corrupt_file_spills_and_evictions_are_counted(tmp_path, rng, exporter):
    registry, scrape = exporter
    pool = PoolSpec("p", (int(rng.integers(1, 64)) * 64,), "float32")
    keys = [int(k) for k in rng.choice(1 << 40, 12, replace=False)]
    with TierCache(_cfg(tmp_path, pool, host_slots=4, file_slots=8)) as c:
        metrics.register(c, registry, name="bad")
        c.put(keys[:4], random_blocks(rng, pool, 4))
        c.put(keys[4:8], random_blocks(rng, pool, 4))     # spills the first 4 to files
        c.put(keys[8:], random_blocks(rng, pool, 4))      # spills 4 more: the file tier is full
        c.offload(keys[8:10], to="file")                  # 2 least recently used files evicted
        victim = keys[5]
        path = bpath(c.config.root, victim, "p")
        raw = bytearray(path.read_bytes())
        raw[DATA_OFFSET + int(rng.integers(pool.block_nbytes))] ^= 0xFF
        path.write_bytes(bytes(raw))
        with pytest.raises(TransferError):
            c.onboard([victim], to="host")
        s = scrape()
        assert _get(s, "tiercache_spilled_blocks_total", cache="bad", tier="host") == 8
        assert _get(s, "tiercache_evicted_blocks_total", cache="bad") == 2
        assert _get(s, "tiercache_corrupt_blocks_total", cache="bad") == 1
        assert _get(s, "tiercache_quarantined_files_total", cache="bad") == 1
        assert _get(s, "tiercache_file_io_errors_total", cache="bad", op="read") == 1
        assert _get(s, "tiercache_file_io_errors_total", cache="bad", op="write") == 0
        assert _get(s, "tiercache_transfer_failed_blocks_total", cache="bad", src="file", dst="host") == 1
        assert _get(s, "tiercache_transferred_blocks_total", cache="bad", src="host", dst="file") == 10


def test_several_caches_in_one_registry(tmp_path, rng, exporter):
    registry, scrape = exporter
    pool = random_kv_pool(rng)
    a = TierCache(_cfg(tmp_path / "a", pool, file_slots=0))
    b = TierCache(_cfg(tmp_path / "b", pool, file_slots=0, metrics_name="engine-1"))
    try:
        name_a = metrics.register(a, registry)
        assert name_a.startswith("tiercache")
        assert metrics.register(b, registry) == "engine-1"
        c = TierCache(_cfg(tmp_path / "c", pool, file_slots=0))
        assert metrics.register(c, registry) not in (name_a, "engine-1")  # the next free default name
        c.close()
        with pytest.raises(ConfigError, match="engine-1"):
            metrics.register(TierCache(_cfg(tmp_path / "d", pool, file_slots=0)), registry, name="engine-1")
        na, nb = int(rng.integers(1, 10)), int(rng.integers(1, 10))
        a.put(random_keys(rng, na), random_blocks(rng, pool, na))
        b.put(random_keys(rng, nb), random_blocks(rng, pool, nb))
        s = scrape()
        assert _get(s, "tiercache_transferred_blocks_total", cache=name_a, src="caller", dst="host") == na
        assert _get(s, "tiercache_transferred_blocks_total", cache="engine-1", src="caller", dst="host") == nb
        b.close()
        s = scrape()
        assert not _select(s, "tiercache_tier_blocks", cache="engine-1")  # a closed cache's series end
        assert _get(s, "tiercache_tier_blocks", cache=name_a, tier="host") == na
    finally:
        a.close()
        b.close()


def test_default_registry_and_metrics_off(tmp_path, rng):
    from prometheus_client import REGISTRY, generate_latest

    pool = random_kv_pool(rng)
    label = f"default-{rng.integers(1 << 30)}"
    with TierCache(_cfg(tmp_path / "on", pool, metrics_registry="default", metrics_name=label)) as c:
        assert c.metrics_name == label
        c.put([1, 2], random_blocks(rng, pool, 2))
        assert f'cache="{label}"' in generate_latest(REGISTRY).decode()
    assert f'cache="{label}"' not in generate_latest(REGISTRY).decode()
    off = f"off-{rng.integers(1 << 30)}"
    with TierCache(_cfg(tmp_path / "off", pool, metrics=False, metrics_registry="default", metrics_name=off)) as c:
        c.put([1, 2], random_blocks(rng, pool, 2))
        c.offload([1], to="file")
        assert c.metrics_name is None and c.stats()["transfers"] == []
        assert c.stats()["counters"]["put_blocks"] == 2  # stats keep their counters
        assert f'cache="{off}"' not in generate_latest(REGISTRY).decode()


def test_without_prometheus_client(tmp_path, rng, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)
    pool = random_kv_pool(rng)
    with TierCache(_cfg(tmp_path, pool, metrics_registry="default")) as c:  # the library works without it
        assert c.metrics_name is None
        keys = random_keys(rng, 3)
        data = random_blocks(rng, pool, 3)
        c.put(keys, data)
        assert np.array_equal(c.get(keys).reshape(3, -1).view(np.uint8), data)
        assert sum(t["blocks"] for t in c.stats()["transfers"]) == 6
        with pytest.raises(MissingDependencyError, match=r"tiercache\[metrics\]"):
            metrics.register(c)
        with pytest.raises(MissingDependencyError):
            metrics.start_http_server(0)


def test_start_http_server_checks_its_port():
    for bad in (-1, 65536, "80", True):
        with pytest.raises(ConfigError, match="port"):
            metrics.start_http_server(bad)


def test_scrapes_while_threads_work(tmp_path, rng, exporter):
    """Scrapes never fail or wait for a call in progress; the final counts equal the jobs'."""
    registry, scrape = exporter
    pool = random_kv_pool(rng)
    with TierCache(_cfg(tmp_path, pool, host_slots=8, file_slots=256)) as c:
        metrics.register(c, registry, name="busy")
        stop = threading.Event()
        errors = []
        seeds = rng.integers(1 << 31, size=2)

        def work(seed):
            r = np.random.default_rng(seed)
            try:
                while not stop.is_set():
                    ks = random_keys(r, int(r.integers(1, 6)))
                    c.put(ks, random_blocks(r, pool, len(ks)))
                    c.offload(ks, to="file")
                    c.onboard(ks[: int(r.integers(1, len(ks) + 1))], to="host")
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(int(sd),)) for sd in seeds]
        for t in threads:
            t.start()
        scrapes = 0
        t_end = time.monotonic() + 1.5
        while time.monotonic() < t_end:
            scrape()
            scrapes += 1
        stop.set()
        for t in threads:
            t.join()
        assert not errors and scrapes > 5
        s = scrape()
        jobs = _jobs_by_pair(c.get_finished())
        for (src, dst), j in jobs.items():
            assert _get(s, "tiercache_transferred_blocks_total", cache="busy", src=src, dst=dst) == j["blocks"]
            assert (
                sum(_select(s, "tiercache_transfer_seconds_count", cache="busy", src=src, dst=dst).values())
                == j["jobs"]
            )


def test_metrics_config(tmp_path):
    base = {"pools": {"p": {"block_shape": [16], "dtype": "uint8"}}, "tiers": {"host_slots": 2}}
    cfg = config_from_dict({**base, "metrics": {"enabled": False, "name": "eng-0.a:b", "registry": "none",
                                                "snapshot_interval_s": 0.5}})
    assert (cfg.metrics, cfg.metrics_name, cfg.metrics_registry, cfg.metrics_snapshot_s) == (
        False,
        "eng-0.a:b",
        "none",
        0.5,
    )
    for table, match in (({"name": "a b"}, "metrics_name"), ({"name": "x" * 65}, "metrics_name"),
                         ({"registry": "mine"}, "metrics_registry"), ({"enabled": "yes"}, "metrics"),
                         ({"snapshot_interval_s": -1}, "metrics_snapshot_s"), ({"port": 9000}, "unknown key")):
        with pytest.raises(ConfigError, match=match):
            config_from_dict({**base, "metrics": table})


def test_engine_onboards_walk_host_then_file(tmp_path, rng):
    """onboard_slots counts each key's walk: a hit in the host tier, or a miss there and a hit
    in the file tier."""
    from tiercache.enginetensors import DevicePools

    layers = [rng.standard_normal((16, 2, 4, 2, 8)).astype(np.float16) for _ in range(2)]
    pools = DevicePools.vllm(layers, host_ok=True)
    keys = random_keys(rng, 6)
    with TierCache.for_engine(pools, host_slots=8, file_slots=16, root=tmp_path / "r", fsync="none",
                              metrics_registry="none") as c:
        c.offload_slots(keys[:3], [0, 1, 2], wait=True)
        c.offload_slots(keys[3:], [3, 4, 5], to="file")
        c.onboard_slots(keys, [6, 7, 8, 9, 10, 11])
        cnt = c.stats()["counters"]
        assert (cnt["onboard_hits_host"], cnt["onboard_misses_host"], cnt["onboard_hits_file"]) == (3, 3, 3)


def _serve_cache(tmp_path, rng, exporter):
    registry, scrape = exporter
    pool = random_kv_pool(rng)
    c = TierCache(_cfg(tmp_path, pool, metrics_snapshot_s=0.2))
    metrics.register(c, registry, name="live")
    n = int(rng.integers(3, 12))
    keys = random_keys(rng, n)
    c.put(keys, random_blocks(rng, pool, n))
    c.offload(keys, to="file")
    return c, n


def _top(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiercache.cli.app", "top", *args], capture_output=True, text=True,
                          timeout=60)


def test_top_first_frame_from_the_exporter(tmp_path, rng, exporter):
    c, n = _serve_cache(tmp_path, rng, exporter)
    try:
        res = _top("--url", exporter[1].url, "--frames", "1")
        assert res.returncode == 0, res.stderr
        rows = {}
        for line in res.stdout.splitlines():
            cells = [x.strip() for x in line.split("│")[1:-1]]
            if cells and cells[0]:
                rows[cells[0]] = cells
        assert rows["host->file"][1] == str(n) and rows["caller->host"][1] == str(n)  # blocks column
        assert rows["file"][1] == str(n) and rows["host"][1] == "0"                   # blocks per tier
        assert "cache live" in res.stdout
        res = _top("--url", exporter[1].url.removesuffix("/metrics").removeprefix("http://"), "--frames", "2",
                   "--interval", "0.1", "--json")
        assert res.returncode == 0, res.stderr
        frames = [json.loads(line) for line in res.stdout.splitlines()]
        assert len(frames) == 2
        live = frames[1]["caches"]["live"]
        assert live["transfers"]["host->file"]["blocks"] == n and live["transfers"]["host->file"]["jobs"] == 1
        assert live["transfers"]["host->file"]["gbps"] == 0.0  # nothing moved between the frames
        assert frames[0]["caches"]["live"]["transfers"]["host->file"]["gbps"] is None
        assert live["tiers"]["file"]["blocks"] == n
    finally:
        c.close()


def test_top_from_the_root_snapshot(tmp_path, rng, exporter):
    c, n = _serve_cache(tmp_path, rng, exporter)
    try:
        time.sleep(0.25)
        c.lookup(0)  # the first call after the interval saves the snapshot
        res = _top("--root", str(c.config.root), "--frames", "1", "--json")
        assert res.returncode == 0, res.stderr
        live = json.loads(res.stdout)["caches"]["live"]
        assert live["tiers"]["file"]["blocks"] == n and live["transfers"]["caller->host"]["blocks"] == n
    finally:
        c.close()


def test_top_errors(tmp_path):
    for args in ([], ["--url", "http://127.0.0.1:1/metrics", "--root", str(tmp_path)],
                 ["--url", "http://127.0.0.1:1/metrics", "--frames", "1"], ["--root", str(tmp_path), "--frames", "1"]):
        res = _top(*args)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert "Traceback" not in res.stderr and "error" in res.stderr


def test_quantile_interpolates_inside_buckets():
    from tiercache.cli.top_cmd import quantile

    inf = float("inf")
    assert quantile(0.5, [(1.0, 0), (2.0, 0), (inf, 0)]) is None
    assert quantile(0.5, [(1.0, 10), (2.0, 20), (inf, 20)]) == pytest.approx(1.0)
    assert quantile(0.75, [(1.0, 10), (2.0, 20), (inf, 20)]) == pytest.approx(1.5)
    assert quantile(0.99, [(1.0, 0), (2.0, 1), (inf, 100)]) == 2.0  # in the +Inf bucket: the last bound
    assert quantile(0.05, [(0.5, 10), (inf, 10)]) == pytest.approx(0.025)  # rank 0.5 of 10 in [0, 0.5]


@pytest.mark.gpu
def test_device_transfers_are_counted(tmp_path, rng, exporter):
    registry, scrape = exporter
    pool = random_kv_pool(rng)
    n = int(rng.integers(2, 17))
    keys = random_keys(rng, n)
    with TierCache(_cfg(tmp_path, pool, device_slots=32)) as c:
        metrics.register(c, registry, name="gpu")
        data = random_blocks(rng, pool, n)
        c.put(keys, data, tier="device")
        c.offload(keys, to="host")
        c.onboard(keys, to="device")
        c.offload(keys, to="file", keep=True)
        assert np.array_equal(c.get(keys).reshape(n, -1).view(np.uint8), data)
        s = scrape()
        jobs = _jobs_by_pair(c.get_finished())
        for (src, dst), blocks in {("caller", "device"): n, ("device", "host"): n, ("host", "device"): n,
                                   ("device", "caller"): n}.items():
            assert _get(s, "tiercache_transferred_blocks_total", cache="gpu", src=src, dst=dst) == blocks
            hist = _select(s, "tiercache_transfer_seconds_count", cache="gpu", src=src, dst=dst)
            assert sum(hist.values()) == jobs[(src, dst)]["jobs"]
            assert all(dict(lab)["path"] for lab in hist)
        assert _get(s, "tiercache_onboards_total", cache="gpu", tier="device", result="miss") == n
        assert _get(s, "tiercache_onboards_total", cache="gpu", tier="host", result="hit") == n


def test_metrics_bench_job(tmp_path):
    from typer.testing import CliRunner

    from tiercache.cli import app

    res = CliRunner().invoke(app, ["bench", "metrics", "--quick", "--blocks", "24", "--batch", "4",
                                   "--root", str(tmp_path), "--output-format", "json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["ok"] and rep["repeat"] == 3 and rep["record_us"] > 0
    for phase in ("offload", "onboard"):
        d = rep["workloads"]["file"][phase]
        assert d["off_gbps"] > 0 and d["on_gbps"] > 0 and d["ratio_min"] <= d["ratio"] <= d["ratio_max"]
    passes = rep["workloads"]["file"]["passes"]
    assert all(p["bytes_ok"] and p["scrape_ms"] > 0 for p in passes) and len(passes) == 3
    assert list(tmp_path.iterdir()) == []  # each pass's root removed
