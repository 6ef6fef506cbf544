"""TierCacheTier through vLLM's own tiering code (CPU; CI runs this file against vLLM 0.33 and
again against 0.26's sources: README, "Quick start").

vLLM's real spec factory loads ``TierCacheTieringSpec`` (or ``TieringOffloadingSpec`` with the
tier's ``module_path``) and builds its real
``TieringOffloadingManager`` over a real ``CPUPrimaryTierOffloadingManager``
(tests/vllm_harness.py); chunks are stored, cascaded to the tier, pushed out of the CPU tier,
looked up and promoted back, and every byte is compared. Also: vLLM's ``fs`` tier's own test
scenarios that apply to any tier, run against TierCacheTier (``TestFsTierScenarios``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import bpath, files, names, require_integration

require_integration("vllm")

import vllm_harness as H  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    Locality,
    LookupResult,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402

from tiercache import ConfigError, RootError  # noqa: E402
from tiercache.files import nativeio  # noqa: E402
from tiercache.integrations import vllmcompat as compat  # noqa: E402
from tiercache.integrations.vllm import TierCacheTier  # noqa: E402

HARNESS = Path(__file__).with_name("vllm_harness.py")


@pytest.fixture(scope="module", autouse=True)
def _shared_regions():
    """The CPU tiers' files in /dev/shm that this module's managers (and the processes it
    killed) left behind are deleted at its end."""
    yield
    H.remove_shared_regions()


@pytest.fixture
def engine(tmp_path, request):
    """An Engine over a fresh manager; ``@pytest.mark.parametrize("tier_config", ...)`` adds keys."""
    extra = getattr(request, "param", {}) or {}
    spec, m = H.build({"root": str(tmp_path / "kv"), "capacity_blocks": 64, **extra})
    eng = H.Engine(m)
    yield eng
    m.shutdown()


def assert_partial(res, ok_keys, ordered: bool = True) -> None:
    """A load that failed for some chunks: it names the others where vLLM's ``JobResult`` has
    ``successful_keys`` (0.33), and fails whole where it has not (0.26)."""
    assert not res.success
    if not compat.PARTIAL_RESULTS:
        assert not hasattr(res, "successful_keys")
    elif ordered:
        assert list(res.successful_keys) == list(ok_keys)
    else:
        assert set(res.successful_keys) == set(ok_keys)


def _files(tier: TierCacheTier) -> list[str]:
    return names(tier.root, "block_")


# -- loading -----------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["spec", "module_path"])
def test_vllm_loads_the_tier_from_its_config_line(tmp_path, route):
    spec, m = H.build({"root": str(tmp_path)}, route=route)
    try:
        assert type(spec).__name__ == ("TierCacheTieringSpec" if route == "spec" else "TieringOffloadingSpec")
        (tier,) = m.secondary_tiers
        assert type(tier) is TierCacheTier and tier.medium is compat.STORAGE_MEDIUM
        # the root is named by vLLM's own FileMapper: <root>/<model>_<digest>_r<rank>
        assert tier.root.parent == tmp_path and tier.root.name.startswith("org_tiny-model_")
        assert tier.root.name.endswith("_r0") and (tier.root / ".tiercache-root").is_file()
        assert (
            json.loads((tmp_path / tier.root.name[:-3] / "config.json").read_text())["model_name"] == "org/tiny-model"
        )
        assert (
            tier.store.row_bytes == 64 << 10 and tier.store.sharing == "exclusive" and tier.store.fsync == "data"
        )  # the cache's default
    finally:
        m.shutdown()


@pytest.mark.slow
def test_a_fresh_process_loads_the_spec_by_name_alone(tmp_path):
    """What vLLM's connector does in a process that never imported tiercache: the spec is found
    by ``spec_name`` + ``spec_module_path``, its metric definitions (read before the spec is
    built) include the tier's, and the tier is created below the CPU tier."""
    code = f"""
import sys; sys.path.insert(0, {str(HARNESS.parent)!r})
assert "tiercache" not in sys.modules
import vllm_harness as H
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
cfg = H.offloading_config({{"root": {str(tmp_path)!r}}})
cls = OffloadingSpecFactory.get_spec_cls(cfg.extra_config)
defs = cls.build_metric_definitions(dict(cfg.extra_config))
assert "vllm:kv_offload_tiercache_stored_chunks" in defs, sorted(defs)
spec = OffloadingSpecFactory.create_spec(cfg)
m = spec.get_manager()
print("LOADED", type(spec).__name__, type(m.secondary_tiers[0]).__name__, flush=True)
m.shutdown()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LOADED TierCacheTieringSpec TierCacheTier" in out.stdout.splitlines()


def test_the_readme_serve_line_builds_the_tier(tmp_path):
    """The ``--kv-transfer-config`` of README.md's ``vllm serve`` line, as vLLM's connector reads
    it (root and sizes scaled to a test), builds TierCacheTieringSpec with the tier below."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    line = re.search(r"^vllm serve \S+ --kv-transfer-config '(.*)'$", readme, re.M).group(1)
    extra = json.loads(line)["kv_connector_extra_config"]
    extra["cpu_bytes_to_use"] = 16 * (64 << 10)
    extra["secondary_tiers"][0].update(root=str(tmp_path), capacity_bytes=1 << 26)
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    spec = OffloadingSpecFactory.create_spec(compat.offloading_config(row_bytes=64 << 10, extra_config=extra,
                                                                      engine_id="tc-readme"))
    m = spec.get_manager()
    try:
        assert type(spec).__name__ == "TierCacheTieringSpec" and type(m.secondary_tiers[0]) is TierCacheTier
    finally:
        m.shutdown()


def test_factory_creates_it_with_locality(tmp_path):
    spec, m = H.build({"root": str(tmp_path / "a")})
    view = m.primary_tier.get_kv_memoryview()
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "TierCacheTier", "module_path": H.MODULE, "root": str(tmp_path / "b"), "locality": "LOCAL",
         "capacity_bytes": 1 << 24}, view, spec)
    try:
        assert isinstance(tier, TierCacheTier) and tier.locality is Locality.LOCAL
        # blocks and recycled free files together hold to capacity_bytes
        assert tier.store.capacity_blocks + tier.store.ft.open_files.free_files == (1 << 24) // ((64 << 10) + 4096)
    finally:
        tier.shutdown()
        m.shutdown()


@pytest.mark.parametrize("bad, match", [
    ({"rooot": "/x"}, "unknown config key.*'rooot'.*valid keys: root"),
    ({"sharing": "public"}, "sharing = 'public' is not valid; choose one of: exclusive, shared"),
    ({"fsync": "always"}, "fsync = 'always' is not valid; choose one of: none, data, data\\+dir"),
    ({"capacity_bytes": 1000}, "capacity_bytes = 1000 must be an integer in \\[69632,"),
    ({"io_threads": 0}, "io_threads = 0 must be an integer in \\[1, 256\\]"),
    ({"io_engine": "aio"}, "io_engine = 'aio' is not valid; choose one of: auto, io_uring, threads, python"),
    ({"locality": "local"}, "'locality' = 'local'; valid: LOCAL, REMOTE"),
    ({"verify": "yes"}, "TierCacheTier: verify = 'yes' must be true or false"),
    ({"root": None}, "'root' = None"),
])
def test_a_bad_key_or_value_is_one_clear_error(tmp_path, bad, match):
    tier = {"root": str(tmp_path), **bad}
    if bad.get("root", "x") is None:
        tier.pop("root")
    with pytest.raises(ConfigError, match=match):
        H.build(tier)


def test_unusable_root_raises_at_construction():
    with pytest.raises((RootError, OSError)):
        H.build({"root": "/dev/null/invalid_path"})


# -- the whole cycle ---------------------------------------------------------------------------
@pytest.mark.parametrize("io_engine", ["auto", "threads", "python"])
def test_random_requests_round_trip_every_byte(tmp_path, seed, io_engine):
    """Random requests (fresh chunks and repeats of earlier ones) through vLLM's manager:
    cascade, CPU-tier eviction, lookup, promotion; every promoted chunk has its bytes."""
    rng = np.random.default_rng(seed)
    spec, m = H.build({"root": str(tmp_path), "capacity_blocks": 512, "io_engine": io_engine}, primary_chunks=12)
    eng = H.Engine(m)
    try:
        stored: list[bytes] = []
        for _ in range(int(rng.integers(6, 12))):
            fresh = H.new_keys(rng, int(rng.integers(1, 9)))
            eng.store(fresh)
            stored += fresh
            if rng.random() < 0.5:  # a later request asks for some earlier chunks
                eng.flush_primary()
                ask = [stored[i] for i in rng.choice(len(stored), size=min(len(stored), int(rng.integers(1, 9))),
                                                     replace=False)]
                got = eng.promote(ask)
                for k in ask:
                    assert got[k] is not None, "a stored chunk was a miss"
                    np.testing.assert_array_equal(got[k], H.chunk_bytes(k, eng.row_bytes))
        eng.flush_primary()
        got = eng.promote(stored)
        assert all(got[k] is not None and np.array_equal(got[k], H.chunk_bytes(k, eng.row_bytes)) for k in stored)
        assert eng.tier.store.counters["loaded_blocks"] >= len(stored)
    finally:
        m.shutdown()


def test_reopened_root_serves_what_an_earlier_instance_stored(tmp_path, rng):
    keys = H.new_keys(rng, 10)
    spec, m = H.build({"root": str(tmp_path)})
    H.Engine(m).store(keys)
    m.shutdown()
    spec, m = H.build({"root": str(tmp_path)})
    try:
        got = H.Engine(m).promote(keys)
        assert all(np.array_equal(got[k], H.chunk_bytes(k, 64 << 10)) for k in keys)
    finally:
        m.shutdown()


@pytest.mark.parametrize("engine", [{"sharing": "exclusive"}, {"sharing": "shared"}], indirect=True)
def test_state_of_a_key_that_is_not_a_content_key_is_absent(engine, rng):
    """RowStore.state answers ABSENT, without raising or probing, for anything that is not a
    content key (1..64 bytes), on either kind of root; a stored key is still PRESENT."""
    from tiercache import KeyState

    keys = H.new_keys(rng, 2)
    engine.store(keys)
    store = engine.tier.store
    for bad in ([1], {"k": 1}, "text", 7, b"", rng.bytes(65), None):
        assert store.state(bad) is KeyState.ABSENT, bad
    assert store.state(keys[0]) is KeyState.PRESENT
    assert not store._probing


def test_kv_cache_groups_are_distinct_chunks(engine, rng):
    h = rng.bytes(32)
    k0, k1 = make_offload_key(h, 0), make_offload_key(h, 1)
    engine.store([k0, k1])
    engine.flush_primary()
    got = engine.promote([k0, k1])
    assert not np.array_equal(got[k0], got[k1])
    np.testing.assert_array_equal(got[k1], H.chunk_bytes(k1, engine.row_bytes))


# -- failures ----------------------------------------------------------------------------------
def test_corrupt_file_fails_that_chunk_only_and_is_quarantined(engine, rng):
    keys = H.new_keys(rng, 4)
    engine.store(keys)
    engine.flush_primary()
    bad = keys[2]
    path = bpath(engine.tier.root, bad, "kv")
    with open(path, "r+b") as f:  # one byte of data, same size: only the checksum can tell
        f.seek(4096 + int(rng.integers(0, engine.row_bytes)))
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    tier = engine.tier
    job = compat.make_job(10_000, keys, np.arange(4), True, ReqContext(req_id="direct"))
    engine.rows[:4] = 0xAB
    tier.submit_load(job)
    tier.drain_jobs()
    (res,) = tier.get_finished_jobs()
    assert_partial(res, [keys[0], keys[1], keys[3]])
    for i, k in enumerate(keys):
        want = np.zeros(engine.row_bytes, np.uint8) if k == bad else H.chunk_bytes(k, engine.row_bytes)
        np.testing.assert_array_equal(engine.rows[i], want)  # the bad row holds no unverified byte
    assert not path.exists() and (tier.root / "quarantine" / path.name).exists()
    assert engine.lookups(keys) == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]
    assert tier.store.counters["corrupt_blocks"] == 1
    # through the manager, the other chunks still promote; the bad one is a miss (recomputed)
    got = engine.promote(keys)
    assert got[bad] is None and all(np.array_equal(got[k], H.chunk_bytes(k, engine.row_bytes))
                                    for k in keys if k != bad)


@pytest.mark.parametrize("engine", [{"open_files": 0}], indirect=True)
def test_file_deleted_behind_its_back_fails_that_chunk(engine, rng):
    """(With held descriptors the tier's root is its own: docs/io-engines.md "Open files and recycled
    files"; without them every load looks at the name.)"""
    keys = H.new_keys(rng, 3)
    engine.store(keys)
    engine.flush_primary()
    os.unlink(bpath(engine.tier.root, keys[0], "kv"))
    tier = engine.tier
    tier.submit_load(compat.make_job(1, keys, np.array([5, 6, 7]), True, ReqContext("r")))
    tier.drain_jobs()
    (res,) = tier.get_finished_jobs()
    assert_partial(res, keys[1:], ordered=False)
    assert engine.lookups(keys[:1]) == [LookupResult.MISS]


@pytest.mark.skipif(not nativeio.native_status()[0], reason="fault injection needs the native engine")
def test_transient_read_error_fails_the_chunk_and_leaves_its_file(engine, rng):
    keys = H.new_keys(rng, 2)
    engine.store(keys)
    path = bpath(engine.tier.root, keys[1], "kv")
    before = path.read_bytes()
    nativeio.set_fault(nativeio.READ, keys[1].hex(), 5, 1)  # EIO once
    try:
        engine.tier.submit_load(compat.make_job(1, keys, np.array([0, 1]), True, ReqContext("r")))
        engine.tier.drain_jobs()
        (res,) = engine.tier.get_finished_jobs()
    finally:
        nativeio.clear_faults()
    assert_partial(res, [keys[0]])
    assert path.read_bytes() == before  # not deleted, not quarantined
    assert not np.any(engine.rows[1])


@pytest.mark.skipif(not nativeio.native_status()[0], reason="fault injection needs the native engine")
def test_failed_store_leaves_no_file_and_reports_failure(engine, rng):
    keys = H.new_keys(rng, 3)
    nativeio.set_fault(nativeio.WRITE, keys[1].hex(), 28)  # ENOSPC
    try:
        eng_rows = [0, 1, 2]
        engine.rows[:3] = 7
        engine.tier.submit_store(compat.make_job(5, keys, np.array(eng_rows), False, ReqContext("r")))
        engine.tier.drain_jobs()
        (res,) = engine.tier.get_finished_jobs()
    finally:
        nativeio.clear_faults()
    assert not res.success
    assert engine.lookups(keys) == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]
    assert f"block_x{keys[1].hex()}_pool_kv.bin" not in _files(engine.tier)
    assert not [n for n in names(engine.tier.root, ".tmp.") if keys[1].hex() in n]


def test_out_of_range_chunk_fails_the_job_not_the_step(engine, rng):
    k = H.new_keys(rng, 1)
    n = engine.rows.shape[0]
    engine.tier.submit_store(compat.make_job(1, k, np.array([n]), False, ReqContext("r")))
    engine.tier.submit_load(compat.make_job(2, k, np.array([n]), True, ReqContext("r")))
    res = {r.job_id: r for r in engine.tier.get_finished_jobs()}
    assert set(res) == {1, 2} and not res[1].success and not res[2].success


# -- in flight, capacity, drain ------------------------------------------------------------------
def _hold_io(tier: TierCacheTier):
    """Block every I/O thread of the tier until the returned event is set."""
    import threading

    gate = threading.Event()
    for _ in range(tier.settings["io_threads"]):
        tier.store.ft.run_task(gate.wait)
    return gate


@pytest.mark.parametrize("engine", [{"io_threads": 2}], indirect=True)
def test_lookup_is_retry_while_the_store_is_in_flight(engine, rng):
    keys = H.new_keys(rng, 3)
    gate = _hold_io(engine.tier)
    try:
        engine.store(keys, drain=False)
        assert engine.lookups(keys) == [LookupResult.RETRY] * 3
        assert engine.tier.has_pending_work()
    finally:
        gate.set()
    engine.settle()
    assert engine.lookups(keys) == [LookupResult.HIT] * 3
    assert not engine.tier.has_pending_work()


def test_capacity_is_held_under_churn_and_eviction_events_flow(tmp_path, rng):
    cap_bytes = 40 * ((64 << 10) + 4096)
    spec, m = H.build({"root": str(tmp_path), "capacity_bytes": cap_bytes, "enable_kv_events": True},
                      events=True, primary_chunks=8)
    eng = H.Engine(m)
    try:
        tier = eng.tier
        live: list[bytes] = []
        removed: set[bytes] = set()
        for _ in range(30):
            keys = H.new_keys(rng, int(rng.integers(1, 9)))
            eng.store(keys)
            live += keys
            if rng.random() < 0.3:  # a reader touches an old chunk: it is kept over others
                tier.touch([live[0]], ReqContext("t"))
                live.append(live.pop(0))
            ev = list(tier.take_events())
            removed |= {k for e in ev if e.removed for k in e.keys}
            assert all(e.medium is compat.STORAGE_MEDIUM for e in ev)
            on_disk = sum(os.path.getsize(f) for f in files(tier.root, "block_*") + files(tier.root, ".tmp.*"))
            assert on_disk <= cap_bytes
        held = [k for k in live if k not in removed]
        assert len(held) == len(tier.store) <= 40
        assert set(H.Engine.lookups(eng, held)) == {LookupResult.HIT}
        assert set(H.Engine.lookups(eng, sorted(removed))) <= {LookupResult.MISS}
        eng.flush_primary()
        got = eng.promote(held[-8:])
        assert all(np.array_equal(got[k], H.chunk_bytes(k, eng.row_bytes)) for k in held[-8:])
    finally:
        m.shutdown()


def test_a_chunk_being_loaded_is_never_evicted(tmp_path, rng):
    spec, m = H.build({"root": str(tmp_path), "capacity_blocks": 4, "io_threads": 1}, primary_chunks=16)
    eng = H.Engine(m)
    try:
        old = H.new_keys(rng, 4)
        eng.store(old)
        gate = _hold_io(eng.tier)
        eng.tier.submit_load(compat.make_job(900, old[:2], np.array([14, 15]), True, ReqContext("r")))
        fresh = H.new_keys(rng, 4)
        eng.rows[:4] = 1
        eng.tier.submit_store(compat.make_job(901, fresh, np.arange(4), False, ReqContext("r")))
        gate.set()
        eng.tier.drain_jobs()
        res = {r.job_id: r for r in eng.tier.get_finished_jobs()}
        assert res[900].success  # its files were not taken away under it
        assert not res[901].success  # only 2 of 4 found room
        assert eng.lookups(old[:2]) == [LookupResult.HIT] * 2
        np.testing.assert_array_equal(eng.rows[14], H.chunk_bytes(old[0], eng.row_bytes))
    finally:
        m.shutdown()


@pytest.mark.parametrize("engine", [{"io_threads": 2}], indirect=True)
def test_drain_and_shutdown_cut_no_transfer_short(engine, rng):
    keys = H.new_keys(rng, 12)
    gate = _hold_io(engine.tier)
    engine.store(keys, drain=False)
    import threading

    threading.Timer(0.3, gate.set).start()
    t0 = time.monotonic()
    engine.tier.drain_jobs()
    assert time.monotonic() - t0 >= 0.25  # it waited for the held transfers
    results = list(engine.tier.get_finished_jobs())
    assert results and all(r.success for r in results)
    assert len(_files(engine.tier)) == 12
    # shutdown with jobs in flight finishes them: every file whole, no temporary left
    more = H.new_keys(rng, 6)
    engine.store(more, drain=False)
    root = engine.tier.root
    engine.tier.shutdown()
    assert not names(root, ".tmp.")
    from tiercache.rootops import verify_file

    assert all(verify_file(f) is None for f in files(root, "block_*"))
    engine.m.shutdown = lambda: engine.m.primary_tier.shutdown()  # the tier is already down


def test_metrics_reach_vllms_stats(engine, rng):
    keys = H.new_keys(rng, 5)
    engine.store(keys)
    engine.flush_primary()
    engine.promote(keys)
    with engine.lock:
        stats = engine.m.get_stats().reduce()
    tier = "('TierCacheTier',)"
    assert stats[f"vllm:kv_offload_tiercache_loaded_chunks:{tier}"] == 5
    assert stats[f"vllm:kv_offload_tiercache_stored_chunks:{tier}"] == len(engine.tier.store)
    assert stats[f"vllm:kv_offload_tiercache_disk_bytes:{tier}"] == len(engine.tier.store) * ((64 << 10) + 4096)
    from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics

    if hasattr(TieringOffloadingMetrics, "READ_BYTES"):  # the manager's per-tier bytes (0.33; not in 0.26)
        assert stats["vllm:kv_offload_tiering_read_bytes:('1:TierCacheTier',)"] == 5 * (64 << 10)
    defs = TierCacheTier.build_metric_definitions({})
    assert set(defs) >= {"vllm:kv_offload_tiercache_loaded_chunks", "vllm:kv_offload_tiercache_disk_bytes"}
    # tiercache's own Prometheus series
    prom = pytest.importorskip("prometheus_client")
    text = prom.generate_latest(prom.REGISTRY).decode()
    name = engine.tier.store.metrics_name
    assert f'tiercache_tier_blocks{{cache="{name}",tier="file"}} {len(engine.tier.store)}.0' in text


# -- several processes ---------------------------------------------------------------------------
def test_the_cli_inspects_verifies_and_purges_a_root_vllm_wrote(tmp_path, rng):
    """``tiercache inspect | verify | purge`` on the root a TierCacheTier wrote: its blocks are
    counted, a flipped byte is found, purge deletes every block and leaves vLLM's config.json;
    given the configured directory, each command names the per-rank root inside it."""
    from typer.testing import CliRunner

    from tiercache.cli import app

    run = CliRunner().invoke
    keys = H.new_keys(rng, int(rng.integers(5, 15)))
    spec, m = H.build({"root": str(tmp_path / "kv")})
    eng = H.Engine(m)
    eng.store(keys)
    root = eng.tier.root
    m.shutdown()
    res = run(app, ["inspect", "--root", str(root), "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)["root"]
    assert r["tiercache_root"] and r["blocks"] == len(keys) and r["pools"]["kv"]["files"] == len(keys)
    res = run(app, ["inspect", "--root", str(tmp_path / "kv"), "--json"])
    assert json.loads(res.stdout)["root"]["roots_inside"] == [str(root)]
    res = run(app, ["verify", "--root", str(tmp_path / "kv")])
    assert res.exit_code == 2 and str(root) in res.output
    res = run(app, ["verify", "--root", str(root), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["checked"] == len(keys)
    bad = bpath(root, keys[int(rng.integers(0, len(keys)))], "kv")
    with open(bad, "r+b") as f:
        f.seek(4096 + int(rng.integers(0, 64 << 10)))
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x5A]))
    res = run(app, ["verify", "--root", str(root), "--json"])
    assert res.exit_code == 1 and [x["file"] for x in json.loads(res.stdout)["bad"]] == [bad.name]
    res = run(app, ["purge", "--root", str(root), "--yes"])
    assert res.exit_code == 0, res.output
    assert files(root, "block_*") == [] and (root.parent / root.name.rsplit("_r", 1)[0] / "config.json").exists()


@pytest.mark.slow
def test_two_instances_share_one_root(tmp_path, rng):
    """While this instance holds a shared root, another vLLM process stores chunks in it; this
    one finds them (RETRY while a background probe looks, then HIT) and promotes every byte."""
    out = tmp_path / "keys.json"
    spec, m = H.build({"root": str(tmp_path / "kv"), "sharing": "shared", "capacity_blocks": 64}, primary_chunks=8)
    child = subprocess.Popen([sys.executable, str(HARNESS), "store", str(tmp_path / "kv"), str(out),
                              str(int(rng.integers(1 << 30))), "12", "shared"],
                             stdin=subprocess.PIPE, cwd=HARNESS.parent)
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert out.exists(), f"the other instance stopped (rc {child.poll()})"
        keys = [bytes.fromhex(h) for h in json.loads(out.read_text())]
        eng = H.Engine(m)
        assert eng.lookups(keys[:1]) == [LookupResult.RETRY]  # a background probe, never the disk inline
        got = eng.promote(keys)
        for k in keys:
            np.testing.assert_array_equal(got[k], H.chunk_bytes(k, eng.row_bytes))
        assert eng.tier.store.counters["discovered_blocks"] == 12
        # and what this one stores, the other finds: both hold the root at once
        mine = H.new_keys(rng, 3)
        eng.store(mine)
        assert all(r is LookupResult.HIT for r in eng.lookups(mine))
    finally:
        m.shutdown()
        child.stdin.close()
        assert child.wait(60) == 0


@pytest.mark.slow
@pytest.mark.parametrize("sharing", ["exclusive", "shared"])
def test_kill9_during_stores_then_only_whole_chunks_are_served(tmp_path, seed, sharing):
    rng = np.random.default_rng(seed)
    log = tmp_path / "acked.txt"
    for round_ in range(2):
        child = subprocess.Popen([sys.executable, str(HARNESS), "churn", str(tmp_path / "kv"), str(log),
                                  str(int(rng.integers(1 << 30))), "100000", sharing], cwd=HARNESS.parent)
        deadline = time.monotonic() + 120
        while (not log.exists() or log.stat().st_size < 70 * (round_ + 1) * 20) and time.monotonic() < deadline:
            assert child.poll() is None, "the storing process died by itself"
            time.sleep(0.02)
        time.sleep(float(rng.uniform(0, 0.3)))
        child.send_signal(signal.SIGKILL)
        child.wait()
    acked = [bytes.fromhex(h) for h in log.read_text().split()]
    assert len(acked) >= 40
    spec, m = H.build({"root": str(tmp_path / "kv"), "sharing": sharing, "capacity_blocks": 100000})
    try:
        eng = H.Engine(m)
        root = eng.tier.root
        # the open starts from the saved index; what the kills left unsaved is adopted in the background
        assert eng.tier.store.wait_reconciled(60)
        assert sharing == "shared" or not names(root, ".tmp.")
        held = len(eng.tier.store)
        assert held >= len(acked)  # every acknowledged chunk survived the kills
        got = eng.promote(acked)
        bad = [k.hex() for k in acked if got[k] is None or not np.array_equal(got[k], H.chunk_bytes(k, eng.row_bytes))]
        assert not bad, f"{len(bad)} acknowledged chunk(s) lost or wrong"
        assert eng.tier.store.counters["corrupt_blocks"] == 0
    finally:
        m.shutdown()


# -- vLLM's fs-tier scenarios that apply to any tier -----------------------------------------------
class TestFsTierScenarios:
    """The scenarios of vLLM's tests/v1/kv_offload/tiering/test_fs_tier.py that do not test
    the fs tier's internals, run against TierCacheTier over a page-aligned float32 tensor of
    2 MiB chunks."""

    N = 8

    @pytest.fixture
    def tier(self, tmp_path):
        import torch

        spec, m = H.build({"root": str(tmp_path / "unused")})
        m.shutdown()
        t = torch.zeros(self.N * (1 << 19) + 1024, dtype=torch.float32)
        shift = (-t.data_ptr() % 4096) // 4
        tensor = t[shift:shift + self.N * (1 << 19)].view(self.N, 1 << 19)
        tier = TierCacheTier(spec, memoryview(tensor.numpy()), "TierCacheTier", root=str(tmp_path), io_threads=4)
        yield tier, tensor
        tier.shutdown()

    @staticmethod
    def key(n: int) -> bytes:
        return make_offload_key(n.to_bytes(8, "big"), 0)

    @staticmethod
    def job(job_id, keys, chunk_ids=None, promotion=False):
        ids = np.array(chunk_ids if chunk_ids is not None else range(len(keys)), dtype=np.int64)
        return compat.make_job(job_id, keys, ids, promotion, ReqContext(req_id="test"))

    @staticmethod
    def drain(tier):
        tier.drain_jobs()
        return list(tier.get_finished_jobs())

    def test_lookup_empty_tier(self, tier):
        t, _ = tier
        assert [t.lookup(self.key(i), ReqContext("x")) for i in (1, 2)] == [LookupResult.MISS] * 2

    def test_store_creates_file_and_lookup_succeeds(self, tier):
        t, _ = tier
        t.submit_store(self.job(1, [self.key(1)], [0]))
        (r,) = self.drain(t)
        assert r.success and t.lookup(self.key(1), ReqContext("x")) is LookupResult.HIT
        assert bpath(t.root, self.key(1), "kv").is_file()

    def test_store_then_load_roundtrip_keeps_the_files(self, tier):
        t, _ = tier
        ks = [self.key(1), self.key(2)]
        t.submit_store(self.job(1, ks, [0, 1]))
        assert all(r.success for r in self.drain(t))
        t.submit_load(self.job(2, ks, [2, 3], True))
        assert all(r.success for r in self.drain(t))
        assert [t.lookup(k, ReqContext("x")) for k in ks] == [LookupResult.HIT] * 2
        assert len(_files(t)) == 2

    def test_failed_load_missing_file(self, tier):
        t, _ = tier
        t.submit_load(self.job(1, [self.key(99)], [0], True))
        (r,) = self.drain(t)
        assert not r.success

    def test_multiple_jobs_tracked_independently(self, tier):
        t, _ = tier
        t.submit_store(self.job(1, [self.key(1)], [0]))
        t.submit_store(self.job(2, [self.key(2)], [1]))
        assert {r.job_id for r in self.drain(t)} == {1, 2}

    def test_multi_block_job_partial_failure(self, tier):
        t, _ = tier
        t.submit_store(self.job(1, [self.key(10), self.key(11)], [0, 1]))
        assert all(r.success for r in self.drain(t))
        t.submit_load(self.job(2, [self.key(10), self.key(11), self.key(99)], [0, 1, 2], True))
        (r,) = self.drain(t)
        assert r.job_id == 2
        assert_partial(r, [self.key(10), self.key(11)])

    @pytest.mark.parametrize("batch_size", [0, 1, 2, 5])
    def test_store_load_data_integrity(self, tier, batch_size):
        import torch

        t, tensor = tier
        tensor[:] = torch.rand(self.N, 1 << 19)
        keys = [self.key(i) for i in range(batch_size)]
        expected = tensor[:batch_size].clone()
        t.submit_store(self.job(1, keys, list(range(batch_size))))
        (r,) = self.drain(t)
        assert r.success
        tensor[:] = 0.0
        load_ids = list(range(self.N - batch_size, self.N))
        t.submit_load(self.job(2, keys, load_ids, True))
        (r,) = self.drain(t)
        assert r.success
        for i, cid in enumerate(load_ids):
            assert torch.equal(tensor[cid], expected[i])

    def test_a_list_of_roots_spreads_chunks_over_them(self, tmp_path):
        """``root`` as a list (one directory per device): a root array of
        ``<dir>/<model>_<digest>_r<rank>`` roots; chunks round-trip byte for byte, every root
        holds some, and a reopen with the roots in another order finds them all."""
        import torch

        spec, m = H.build({"root": str(tmp_path / "unused")})
        m.shutdown()
        t = torch.zeros(self.N * (1 << 19) + 1024, dtype=torch.float32)
        shift = (-t.data_ptr() % 4096) // 4
        tensor = t[shift:shift + self.N * (1 << 19)].view(self.N, 1 << 19)
        dirs = [str(tmp_path / f"nvme{i}") for i in range(3)]
        tier = TierCacheTier(spec, memoryview(tensor.numpy()), "TierCacheTier", root=dirs, io_threads=4)
        try:
            assert [str(r.parent) for r in tier.roots] == dirs and tier.root == tier.roots[0]
            tensor[:] = torch.rand(self.N, 1 << 19)
            expected = tensor.clone()
            keys = [self.key(i) for i in range(self.N)]
            tier.submit_store(self.job(1, keys, list(range(self.N))))
            assert all(r.success for r in self.drain(tier))
        finally:
            tier.shutdown()
        assert all(any(r.glob("*/block_*")) for r in tier.roots)
        tensor[:] = 0.0
        tier = TierCacheTier(spec, memoryview(tensor.numpy()), "TierCacheTier", root=dirs[::-1], io_threads=4)
        try:
            tier.submit_load(self.job(2, keys, list(range(self.N)), True))
            assert all(r.success for r in self.drain(tier))
            assert torch.equal(tensor, expected)
        finally:
            tier.shutdown()

    def test_store_events_carry_locality(self, tmp_path):
        spec, m = H.build({"root": str(tmp_path / "a")}, events=True)
        view = m.primary_tier.get_kv_memoryview()
        t = TierCacheTier(spec, view, "TierCacheTier", root=str(tmp_path / "b"), enable_kv_events=True,
                          locality="LOCAL", capacity_blocks=1)
        try:
            t.submit_store(self.job(1, [self.key(1)], [0]))
            self.drain(t)
            t.submit_store(self.job(2, [self.key(2)], [1]))  # evicts key 1
            self.drain(t)
            ev = list(t.take_events())
            assert [(e.keys, e.removed, e.locality) for e in ev] == [
                ([self.key(1)], False, Locality.LOCAL), ([self.key(2)], False, Locality.LOCAL),
                ([self.key(1)], True, Locality.LOCAL)]
            assert list(t.take_events()) == []
        finally:
            t.shutdown()
            m.shutdown()


def test_the_spec_skips_a_store_for_a_request_whose_state_is_finalized(tmp_path, rng):
    """vLLM 0.26's manager raises KeyError inside the engine for a store built after the
    request's tiering state was finalized; TierCacheTieringSpec's manager skips it (None, as for
    a store the CPU tier cannot take) and counts it, and later stores go on as before."""
    from vllm.v1.kv_offload.base import ReqContext

    from tiercache.integrations.vllm import guard_stores_after_finish

    _, m = H.build({"root": str(tmp_path), "fsync": "none"})
    engine = H.Engine(m)
    keys = H.new_keys(rng, 3)
    gone = ReqContext(req_id="finished-earlier")  # never registered, or already finalized
    with engine.lock:
        assert "_req_state" in vars(m)  # 0.26 and 0.33 keep per-request state
        with pytest.raises(KeyError):  # what the engine met without the guard
            type(m).prepare_store(m, keys, gone)
        assert m.prepare_store(keys, gone) is None
    assert m.tiercache_stores_skipped_after_finish == 1
    guard_stores_after_finish(m)  # idempotent
    assert m.tiercache_stores_skipped_after_finish == 1
    stored = engine.store(H.new_keys(rng, 2))
    assert len(stored) == 2
