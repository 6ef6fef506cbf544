"""Host memory: 4 KiB pages, reserved huge pages, and what happens when they cannot be had.

Huge pages are reserved by the administrator (``/proc/sys/vm/nr_hugepages``); tests that need
them skip where too few are free (CI), and the fallback and error paths run everywhere by making
the huge-page mapping fail.
"""

from __future__ import annotations

import errno

import numpy as np
import pytest
from conftest import random_keys
from helpers import assert_bytes, put_random

from tiercache import CacheConfig, ConfigError, TierCache, TierUnavailableError
from tiercache.memory import PAGE, alloc_host, free_huge_pages, hostmem, huge_page_bytes, make_host_tier


def _need_huge(nbytes: int) -> int:
    page = huge_page_bytes()
    if page == 0 or free_huge_pages() * page < nbytes + page:
        pytest.skip(f"needs {nbytes} bytes of free huge pages (sysctl vm.nr_hugepages); {free_huge_pages()} free")
    return page


def _no_huge_pages(monkeypatch):
    def fail(nbytes, page):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")
    monkeypatch.setattr(hostmem, "_map_huge", fail)
    monkeypatch.setattr(hostmem, "huge_page_bytes", lambda: 2 << 20)


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_four_kib_pages_round_trip(rng, mode, monkeypatch):
    _no_huge_pages(monkeypatch)
    n = int(rng.integers(1, 5 << 20))
    arr, owner = alloc_host(n, pinned=False, huge_pages=mode)
    assert arr.size == n and arr.ctypes.data % PAGE == 0
    assert owner.page_bytes == PAGE and owner.source == "mmap" and not owner.pinned
    data = rng.integers(1, 256, size=n, dtype=np.uint8)
    arr[:] = data
    assert np.array_equal(arr, data)


def test_on_without_huge_pages_names_the_shortfall(monkeypatch):
    _no_huge_pages(monkeypatch)
    with pytest.raises(TierUnavailableError) as err:
        alloc_host(5 << 20, pinned=False, huge_pages="on")
    msg = str(err.value)
    assert "3 huge pages of 2048 KiB" in msg and "5242880 bytes" in msg and "vm.nr_hugepages" in msg


def test_bad_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="'always'.*auto, on, off"):
        alloc_host(4096, pinned=False, huge_pages="always")


def test_auto_keeps_small_allocations_on_small_pages(monkeypatch):
    """Below one huge page, auto does not round a buffer up to 2 MiB."""
    calls = []
    monkeypatch.setattr(hostmem, "huge_page_bytes", lambda: 2 << 20)
    monkeypatch.setattr(hostmem, "_map_huge", lambda n, p: calls.append(n))
    _arr, owner = alloc_host((2 << 20) - 1, pinned=False, huge_pages="auto")
    assert owner.page_bytes == PAGE and calls == []


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_huge_pages_round_trip(rng, mode):
    n = int(rng.integers(2 << 20, 7 << 20))
    page = _need_huge(n)
    before = free_huge_pages()
    arr, owner = alloc_host(n, pinned=False, huge_pages=mode)
    assert owner.source == "hugetlb" and owner.page_bytes == page
    assert arr.size == n and arr.ctypes.data % page == 0
    assert free_huge_pages() <= before - -(-n // page)  # the pages are taken now, not at first touch
    data = rng.integers(1, 256, size=n, dtype=np.uint8)
    arr[:] = data
    assert np.array_equal(arr, data)


def test_config_key_is_validated(make_config):
    assert make_config().host_huge_pages == "auto"
    with pytest.raises(ConfigError, match="host_huge_pages = 'yes'"):
        make_config(host_huge_pages="yes")


def test_host_tier_reports_its_pages(rng, make_config, monkeypatch):
    _no_huge_pages(monkeypatch)
    with TierCache(make_config(host_slots=4)) as c:
        assert c.stats()["tiers"]["host"]["page_bytes"] == [PAGE]
    with pytest.raises(TierUnavailableError):
        TierCache(make_config(host_slots=4, host_huge_pages="on"))


def test_cache_on_huge_pages_keeps_bytes(rng, make_config):
    """A host tier on huge pages, spilling to files and back: exact bytes."""
    cfg = make_config(host_slots=6, host_huge_pages="on")
    _need_huge(sum(p.block_nbytes for p in cfg.pools) * 6 + len(cfg.pools) * huge_page_bytes())
    tier = make_host_tier(6, cfg.pools, pinned=False, huge_pages="on")
    assert {m["source"] for m in tier.memory()} == {"hugetlb"}
    del tier
    with TierCache(cfg) as c:
        assert c.stats()["tiers"]["host"]["page_bytes"] == [huge_page_bytes()]
        keys = random_keys(rng, 10)
        exp = put_random(c, keys[:6], rng, tier="host")
        exp.update(put_random(c, keys[6:], rng, tier="host"))  # 4 more into 6 slots: 4 spill to files
        assert sum("file" in c.lookup(k) for k in keys) >= 4
        c.onboard(keys[:6], to="host")
        assert_bytes(c, exp)


def test_toml_key(tmp_path):
    from tiercache.config import load_config

    p = tmp_path / "c.toml"
    p.write_text("[tiers]\nhost_slots = 2\nhost_huge_pages = 'off'\n[pools.a]\nblock_shape = [16]\ndtype = 'uint8'\n")
    assert load_config(p).host_huge_pages == "off"
    assert isinstance(load_config(p), CacheConfig)


def test_recycled_arrays_come_back_only_when_every_view_is_gone(rng):
    """get()'s new arrays reuse the memory of arrays let go: page-aligned, reused only once the
    array and every view over it are gone (a view alive keeps its bytes: nothing else is handed
    the same memory), and the pool stays within its bound."""
    import gc

    from tiercache.memory import recycled

    size = int(rng.integers(1, 5)) * (1 << 20) + int(rng.integers(0, 4096))
    a = recycled.recycled_empty(size)
    assert a.nbytes == size and a.ctypes.data % 4096 == 0
    a[:] = rng.integers(0, 256, size, dtype=np.uint8)
    keep = a[size // 2:].reshape(-1)  # a view outlives its array
    want = keep.copy()
    addr = a.ctypes.data
    del a
    gc.collect()
    others = [recycled.recycled_empty(size) for _ in range(3)]
    for o in others:
        assert o.ctypes.data != addr  # not handed out while the view lives
        o[:] = 0xAB
    assert np.array_equal(keep, want)
    del keep
    gc.collect()
    del others
    gc.collect()
    assert recycled.pool_stats()["kept_bytes"] <= recycled.POOL_BYTES


def test_recycled_memory_is_reused_without_new_pages():
    """A second array of the same size after the first is let go takes its pages: no new
    page faults (what a loop of get() calls without ``out`` does)."""
    import resource

    from tiercache.memory import recycled

    size = 8 << 20
    x = recycled.recycled_empty(size)
    x[::4096] = 1
    addr = x.ctypes.data
    del x
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y = recycled.recycled_empty(size)
    y[::4096] = 2
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert y.ctypes.data == addr and faults < 64, faults


def test_recycled_arrays_are_never_shared_between_threads(rng):
    """Threads taking and letting go of recycled arrays at once: each thread's array holds only
    what that thread wrote while it holds it (no mapping handed to two holders)."""
    import threading

    from tiercache.memory import recycled

    size = 2 << 20
    bad: list[str] = []

    def work(tid: int) -> None:
        for _ in range(40):
            a = recycled.recycled_empty(size)
            a[:] = tid
            view = a[size // 3:]
            del a
            if not (view == tid).all():
                bad.append(f"thread {tid}: another holder wrote its array")
            del view

    threads = [threading.Thread(target=work, args=(t + 1,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad, bad[:3]
    assert recycled.pool_stats()["kept_bytes"] <= recycled.POOL_BYTES


@pytest.mark.gpu
def test_pinned_memory_starts_on_a_page_after_other_pinned_allocations(rng):
    """CuPy's pinned pool hands out 512-byte-aligned pieces of its allocations: after small
    pinned allocations of others, the host memory tiercache asks for still starts on a page
    (what O_DIRECT and the row reads need), and is pinned."""
    cupy = pytest.importorskip("cupy")
    held = [cupy.cuda.alloc_pinned_memory(int(n)) for n in rng.integers(1, 3000, 8)]
    for _ in range(6):
        arr, owner = alloc_host(int(rng.integers(1, 1 << 20)), pinned=True)
        assert arr.__array_interface__["data"][0] % PAGE == 0 and owner.pinned
        arr[:] = 7  # the whole of it is there
        held.append(owner)
