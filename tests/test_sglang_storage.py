"""tiercache as SGLang's HiCache storage backend (tiercache/integrations/sglang.py), on the CPU,
through SGLang's own code: the backend is built by SGLang's ``StorageBackendFactory``
(``dynamic``) over real host pools (``MHATokenToKVPoolHost`` and ``MLATokenToKVPoolHost`` on CPU
tensors, in every layout they have), and driven by SGLang's ``HiCacheController`` page set and
get paths (the zero-copy ones that ``interface_v1`` selects).

Pages come back byte-exact into other slots; ``batch_exists`` counts leading hits; a restarted
backend keeps its hits; two processes share one root; a flipped byte, a truncated or a deleted
file stops a prefix there (never a wrong page in the host pool); the disk stays within capacity
under churn; concurrent calls from several threads keep every byte.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import require_integration

sglang = require_integration("sglang")
torch = pytest.importorskip("torch")

warnings.filterwarnings("ignore")
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

from tiercache.bench.benchsglang import (  # noqa: E402
    format_sglang_report,
    page_bytes_at,
    run_sglang_bench,
    sglang_host_pool,
)
from tiercache.bench.benchsglang import storage_config as bench_storage_config  # noqa: E402
from tiercache.errors import ConfigError  # noqa: E402
from tiercache.integrations.sglang import TierCacheHiCacheStorage, page_key, parse_config  # noqa: E402

# pages of whole 4 KiB pieces (page_first 8 KiB, layer_first 4 KiB, MLA 36 KiB): the backend moves
# them in place (zero_copy) or, asked, through its staging rows
PS, LAYERS, HEADS, HD = 16, 2, 4, 32
TOKENS = 64 * PS
LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
CONNECT = {"backend_name": "tiercache", "module_path": "tiercache.integrations.sglang",
           "class_name": "TierCacheHiCacheStorage", "interface_v1": 1}


def host_pool(kind: str, layout: str, seed: int):
    """A real SGLang host pool on the CPU (``kind``: ``mha`` or ``mla``, SGLang's MLA width), of
    ``TOKENS`` device tokens (the host pool twice that), random bytes."""
    geometry = {"num_hidden_layers": LAYERS, "num_key_value_heads": HEADS, "head_dim": HD}
    return sglang_host_pool(geometry, TOKENS // PS, PS, layout=layout, mla=kind == "mla", seed=seed)


def storage_config(kind: str, layout: str, extra: dict, tp_rank: int = 0, tp_size: int = 1):
    """SGLang's ``HiCacheStorageConfig`` for this test's model, connecting tiercache's backend."""
    return bench_storage_config({**CONNECT, **extra}, mla=kind == "mla", model="org/tiny-model",
                                page_first=layout != "layer_first", tp_rank=tp_rank, tp_size=tp_size)


def backend(root, pool, kind, layout, **extra):
    """Built as SGLang builds it: the factory, then the host pool registered."""
    be = StorageBackendFactory.create_backend(
        "dynamic", storage_config(kind, layout, {"root": str(root), "fsync": "none", **extra}), pool
    )
    be.register_mem_pool_host(pool)
    return be


page_bytes = page_bytes_at


def slots(pages: list[int]) -> torch.Tensor:
    """Token slots of whole pages ``pages`` (page p: slots p*PS .. p*PS+PS-1)."""
    return torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in pages]).to(torch.int64)


def put(be, keys, pages) -> bool:
    return HiCacheController._page_set_zero_copy(SimpleNamespace(storage_backend=be), keys, slots(pages))


def get(be, keys, pages) -> int:
    """Pages read, as the controller counts them (0.5.11 and later return it; earlier releases
    add the tokens to the prefetch operation)."""
    tokens = []
    op = SimpleNamespace(request_id="r", is_terminated=lambda: False, increment=lambda n: tokens.append(n) or True)
    n = HiCacheController._page_get_zero_copy(SimpleNamespace(storage_backend=be, page_size=PS), op, keys,
                                              slots(pages))
    return n if n is not None else sum(tokens) // PS


def hexkeys(rng, n):
    return [rng.bytes(32).hex() for _ in range(n)]


@pytest.mark.parametrize("zero_copy", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pages_set_and_get_through_sglangs_controller_byte_exact(tmp_path, rng, kind, layout, zero_copy):
    pool = host_pool(kind, layout, int(rng.integers(1 << 30)))
    be = backend(tmp_path, pool, kind, layout, staging_bytes=1 << 20, zero_copy=zero_copy)
    assert isinstance(be, TierCacheHiCacheStorage)
    assert be.zero_copy == zero_copy  # pages in place, or through the staging rows
    keys = hexkeys(rng, 24)
    src = [int(p) for p in rng.choice(np.arange(0, 30), 24, replace=False)]
    want = [page_bytes(pool, p * PS) for p in src]
    assert be.batch_exists(keys) == 0
    assert put(be, keys, src)
    assert be.batch_exists(keys) == 24 and be.batch_exists(keys[:5] + hexkeys(rng, 1) + keys[5:]) == 5
    dst = [int(p) for p in rng.choice(np.arange(32, 64), 24, replace=False)]
    assert get(be, keys, dst) == 24
    assert [page_bytes(pool, p * PS) for p in dst] == want
    # storing again is a no-op that reports success
    assert put(be, keys[:3], src[:3]) and be.counters["set_skipped_pages"] == 3
    be.close()
    # a restarted backend finds every page (the root's saved index)
    pool2 = host_pool(kind, layout, 7)
    be2 = backend(tmp_path, pool2, kind, layout, zero_copy=not zero_copy)  # either way reads either's files
    assert be2.batch_exists(keys) == 24
    assert get(be2, keys, list(range(40, 64))) == 24
    assert [page_bytes(pool2, p * PS) for p in range(40, 64)] == want
    be2.close()


@pytest.mark.parametrize("zero_copy", [True, False])
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_page_stops_the_prefix_and_never_reaches_the_pool(tmp_path, rng, damage, zero_copy):
    pool = host_pool("mha", "page_first", int(rng.integers(1 << 30)))
    be = backend(tmp_path, pool, "mha", "page_first", zero_copy=zero_copy)
    keys = hexkeys(rng, 8)
    assert put(be, keys, list(range(8)))
    be.close()
    bad = 5
    files = {p.name: p for p in Path(tmp_path).rglob("block_*.bin")}
    name = next(n for n in files if page_key(keys[bad]).hex() in n)
    path = files[name]
    inside = 4096 + be.layout.page_bytes // 2  # a byte of the page (after the 4 KiB header)
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[inside] ^= 0x40
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        os.truncate(path, inside)
    else:
        path.unlink()
    be = backend(tmp_path, pool, "mha", "page_first", zero_copy=zero_copy)
    before = [page_bytes(pool, p * PS) for p in range(32, 40)]
    assert all(any(b) for b in before)  # random bytes there: what is left after is visible
    got = get(be, keys, list(range(32, 40)))
    assert got == bad
    after = [page_bytes(pool, p * PS) for p in range(32, 40)]
    assert after[:bad] == [page_bytes(pool, p * PS) for p in range(bad)]
    # the bad page's slots: untouched (read into staging), or zeroed (read in place and failed)
    assert after[bad] == (bytes(len(before[bad])) if zero_copy else before[bad])
    assert be.batch_exists(keys) == bad  # it left the store
    be.close()


def test_capacity_holds_under_churn_and_recent_pages_stay(tmp_path, rng):
    pool = host_pool("mha", "layer_first", int(rng.integers(1 << 30)))
    be = backend(tmp_path, pool, "mha", "layer_first", capacity_blocks=20)
    rounds = [hexkeys(rng, 8) for _ in range(10)]
    for keys in rounds:
        assert put(be, keys, list(range(8)))
        assert len(be.store) <= 20
    assert be.batch_exists(rounds[-1]) == 8  # the newest pages are kept
    assert be.batch_exists(rounds[0]) == 0
    assert len(list(Path(tmp_path).rglob("block_*.bin"))) <= 20  # the files too (recycled ones included)
    assert get(be, rounds[-1], list(range(16, 24))) == 8
    assert [page_bytes(pool, p * PS) for p in range(16, 24)] == [page_bytes(pool, p * PS) for p in range(8)]
    be.close()


def test_threads_set_and_get_at_once_and_keep_every_byte(tmp_path, rng):
    pool = host_pool("mha", "page_first", int(rng.integers(1 << 30)))
    be = backend(tmp_path, pool, "mha", "page_first", staging_bytes=1 << 20)  # few slabs: they are shared
    groups = [(hexkeys(rng, 6), list(range(6 * i, 6 * i + 6))) for i in range(4)]
    want = {k: page_bytes(pool, p * PS) for keys, pages in groups for k, p in zip(keys, pages)}
    errors = []

    def worker(i):
        try:
            keys, pages = groups[i]
            assert put(be, keys, pages)
            dst = [32 + 6 * i + j for j in range(6)]
            assert get(be, keys, dst) == 6
            assert [page_bytes(pool, p * PS) for p in dst] == [want[k] for k in keys]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    be.close()


CHILD = r'''
import sys, json
sys.path.insert(0, sys.argv[4])
import test_sglang_storage as t
pool = t.host_pool("mha", "page_first", int(sys.argv[3]))
be = t.backend(sys.argv[1], pool, "mha", "page_first", sharing="shared")
keys = json.loads(sys.argv[2])
if sys.argv[5] == "put":
    assert t.put(be, keys, list(range(len(keys))))
    print(json.dumps([t.page_bytes(pool, p * t.PS).hex() for p in range(len(keys))]))
else:
    n = t.get(be, keys, list(range(40, 40 + len(keys))))
    print(json.dumps({"n": n, "exists": be.batch_exists(keys),
                      "pages": [t.page_bytes(pool, p * t.PS).hex() for p in range(40, 40 + len(keys))]}))
be.close()
'''


def test_two_processes_share_one_root(tmp_path, rng):
    """Process A stores while B is up on the same root (shared): B finds A's pages and reads
    them byte-exact; an exclusive root refuses a second process."""
    import json

    keys = hexkeys(rng, 6)
    here = str(Path(__file__).parent)
    pool_b = host_pool("mha", "page_first", 3)
    be_b = backend(tmp_path, pool_b, "mha", "page_first", sharing="shared")  # B, up first (its index: empty)
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), json.dumps(keys), "11", here, "put"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    want = json.loads(out.stdout.strip().splitlines()[-1])
    assert be_b.batch_exists(keys) == 6
    assert get(be_b, keys, list(range(40, 46))) == 6
    assert [page_bytes(pool_b, p * PS).hex() for p in range(40, 46)] == want
    be_b.close()
    # a fresh process reads them too
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), json.dumps(keys), "5", here, "get"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["n"] == 6 and res["exists"] == 6 and res["pages"] == want
    excl = tmp_path / "exclusive"
    a = backend(excl, host_pool("mha", "page_first", 1), "mha", "page_first")
    with pytest.raises(Exception, match="(?i)in use|held|lock|another"):
        backend(excl, host_pool("mha", "page_first", 2), "mha", "page_first")
    a.close()


def test_roots_hold_each_layout_and_rank_apart(tmp_path, rng):
    """The same keys under another layout, rank or dtype are other pages (other directories)."""
    keys = hexkeys(rng, 2)
    a = backend(tmp_path, host_pool("mha", "page_first", 1), "mha", "page_first")
    assert put(a, keys, [0, 1])
    a.close()
    b = backend(tmp_path, host_pool("mha", "page_first_direct", 2), "mha", "page_first_direct")
    assert b.batch_exists(keys) == 0
    b.close()
    dirs = sorted(p.name for p in Path(tmp_path).iterdir() if p.is_dir())
    assert len(dirs) == 2 and all("_hc_r0of1" in d for d in dirs)


def test_metrics_and_the_cli_work_on_its_roots(tmp_path, rng):
    """SGLang's storage metrics (pages and GB/s per call), tiercache's Prometheus series, and
    ``tiercache inspect | verify | purge`` on the backend's root."""
    import json

    from typer.testing import CliRunner

    from cli.app import app

    prom = pytest.importorskip("prometheus_client")
    pool = host_pool("mha", "page_first", int(rng.integers(1 << 30)))
    cfg = storage_config("mha", "page_first", {"root": str(tmp_path), "fsync": "none"})
    cfg.enable_storage_metrics = True
    be = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    be.register_mem_pool_host(pool)
    keys = hexkeys(rng, 10)
    assert put(be, keys, list(range(10))) and get(be, keys, list(range(20, 30))) == 10
    m = be.get_stats()
    assert m.backup_pgs == [10] and m.prefetch_pgs == [10] and m.prefetch_bandwidth[0] > 0
    assert be.get_stats().prefetch_pgs == []  # reset by each call
    name = be.store.metrics_name
    assert prom.REGISTRY.get_sample_value("tiercache_tier_blocks", {"cache": name, "tier": "file"}) == 10
    root = next(p for p in Path(tmp_path).iterdir() if p.is_dir())
    be.close()
    assert prom.REGISTRY.get_sample_value("tiercache_tier_blocks", {"cache": name, "tier": "file"}) is None
    runner = CliRunner()
    res = runner.invoke(app, ["verify", "--root", str(root), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["checked"] == 10 and not rep["bad"]
    res = runner.invoke(app, ["inspect", "--root", str(root), "--json"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["purge", "--root", str(root), "--yes"])
    assert res.exit_code == 0, res.output
    assert not list(root.rglob("block_*.bin"))
    be = backend(tmp_path, pool, "mha", "page_first")
    assert be.batch_exists(keys) == 0
    be.close()


def test_the_config_is_checked():
    with pytest.raises(ConfigError, match="unknown config key.*'rot'"):
        parse_config({**CONNECT, "rot": "/x"})
    with pytest.raises(ConfigError, match="'root'"):
        parse_config(dict(CONNECT))
    with pytest.raises(ConfigError, match="staging_bytes"):
        parse_config({"root": "/x", "staging_bytes": 10})
    with pytest.raises(ConfigError, match="sharing"):
        parse_config({"root": "/x", "sharing": "everyone"})
    s = parse_config({**CONNECT, "root": ["/a", "/b"], "capacity_bytes": 1 << 30})
    assert s["root"] == ["/a", "/b"] and s["capacity_bytes"] == 1 << 30 and s["io_threads"] == 16


def test_extra_host_pools_fail_the_attach_by_name(tmp_path, rng):
    """Interface v2's extra host pools (hybrid models): the KV pool under its own name is taken,
    any other pool is refused at registration, naming it, and the KV pages still move."""
    from sglang.srt.mem_cache import hicache_storage

    # releases before interface v2 have no pool names (nor call this): their strings
    kv, mamba = (hicache_storage.PoolName.KV, hicache_storage.PoolName.MAMBA) if hasattr(
        hicache_storage, "PoolName") else ("kv", "mamba")
    pool = host_pool("mha", "page_first", int(rng.integers(1 << 30)))
    be = backend(tmp_path, pool, "mha", "page_first")
    be.register_mem_host_pool_v2(pool, kv)
    other = host_pool("mha", "page_first", 5)
    with pytest.raises(ConfigError, match="extra host pool 'mamba'"):
        be.register_mem_host_pool_v2(other, mamba)
    keys = hexkeys(rng, 3)
    assert put(be, keys, [0, 1, 2]) and get(be, keys, [40, 41, 42]) == 3
    assert [page_bytes(pool, p * PS) for p in (40, 41, 42)] == [page_bytes(pool, p * PS) for p in (0, 1, 2)]
    be.close()


def test_page_keys():
    h = "ab" * 32
    assert page_key(h) == bytes.fromhex(h)
    assert len(page_key("not-hex-key")) == 32 and page_key("x") != page_key("y")




@pytest.mark.parametrize("zero_copy", [True, False])
def test_the_bench_runs_both_backends_through_the_controller(tmp_path, zero_copy):
    left: list[list[str]] = []  # at each backend's report line: the backends' roots still there

    def log(line: str) -> None:
        if ": set " in line:
            left.append(sorted(p.name for p in tmp_path.glob("sglang-storage-*/root-*")))

    rep = run_sglang_bench(tmp_path, models=("tiny-llama",), page_tokens=16, total_bytes=4 << 20, batch=8, fio=False,
                           seed=3, zero_copy=zero_copy, log=log)
    assert rep["ok"]
    assert left == [[], []]  # each backend's pages removed once it is measured (a tmpfs holds one at a time)
    run = rep["runs"][0]
    for b in ("file", "tiercache"):
        res = run["backends"][b]
        assert res["wrong_pages"] == 0 and res["get"]["pages_read"] == run["pages"] and res["set"]["gbps"] > 0
    assert set(run["tiercache_over_file"]) == {"set", "get"}
    # tiny-llama's 16-token pages are whole 4 KiB pieces: in place unless asked otherwise
    assert run["backends"]["tiercache"]["in_place"] == zero_copy and rep["zero_copy"] == zero_copy
    assert isinstance(run["pool_page_aligned"], bool) and not run["pool_pinned"]
    assert ("in place" if zero_copy else "through staging rows") in format_sglang_report(rep)
    assert not list(tmp_path.glob("sglang-storage-*"))  # removed without keep


LEAK_CHILD = r'''
import gc, sys, weakref
from pathlib import Path
import tiercache.bench.benchsglang as bs
pools = []
real = bs.sglang_host_pool
def pool(*a, **k):
    p = real(*a, **k)
    pools.append(weakref.ref(p))
    return p
bs.sglang_host_pool = pool
rep = bs.run_sglang_bench(Path(sys.argv[1]), models=("tiny-llama",), page_tokens=16, total_bytes=1 << 20, batch=8,
                          fio=False, seed=5)
gc.collect()
print(rep["ok"], len(pools), sum(r() is not None for r in pools))
'''


def test_the_bench_frees_each_models_pool_in_a_fresh_process(tmp_path):
    """In a process that first meets SGLang in the bench, a model's host pool is gone once its
    run ends (SGLang keeps the traceback of an optional import that failed; first imported
    from the function that built a pool, it held that pool, and the next model's pool was
    refused for want of free memory)."""
    out = subprocess.run([sys.executable, "-c", LEAK_CHILD, str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-3:] == ["True", "1", "0"], out.stdout[-500:]


def test_the_bench_calls_hold_as_many_pages_as_sglangs_controller_by_default(tmp_path):
    """Without a batch, a call holds SGLang's own STORAGE_BATCH_SIZE pages (two calls at least
    per op); with keep, each backend's root is left with every page's file in it."""
    from tiercache.integrations.sglangcompat import STORAGE_BATCH_SIZE

    rep = run_sglang_bench(tmp_path, models=("tiny-llama",), page_tokens=16, total_bytes=1 << 20, fio=False,
                           seed=4, keep=True)
    run = rep["runs"][0]
    assert rep["ok"] and run["batch"] == STORAGE_BATCH_SIZE and run["pages"] == 2 * STORAGE_BATCH_SIZE
    (work,) = tmp_path.glob("sglang-storage-*")
    assert len(list((work / "root-file").rglob("*.bin"))) == run["pages"]  # SGLang's file backend: a file a page
    assert len([p for p in (work / "root-tiercache").rglob("block_*") if p.is_file()]) == run["pages"]
