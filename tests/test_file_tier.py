"""The file tier's safety features: root lock, per-rank roots, byte capacity, O_DIRECT,
wrong-geometry files, permissions."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import bpath, drop_index, files, random_keys
from helpers import assert_bytes, put_random

from tiercache import CacheConfig, ConfigError, PoolSpec, RootError, TierCache
from tiercache.files import block_filename, lock_holder


def test_second_writer_is_refused_until_the_first_closes(make_config):
    cfg = make_config()
    c1 = TierCache(cfg)
    assert lock_holder(cfg.root) == str(os.getpid())
    with pytest.raises(RootError, match=r"already open in this process"):
        TierCache(cfg)
    c1.close()
    assert lock_holder(cfg.root) is None
    with TierCache(cfg):
        pass


def test_lock_is_held_across_processes(make_config, tmp_path):
    cfg = make_config()
    code = (f"import time, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "from tiercache.files.rootdir import RootLock, open_root; from pathlib import Path; "
            f"open_root(Path({str(cfg.root)!r})); l = RootLock(Path({str(cfg.root)!r})); "
            "print('locked', flush=True); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(RootError, match=f"pid {child.pid}"):
            TierCache(cfg)
    finally:
        child.kill()
        child.wait()
    with TierCache(cfg):  # the kernel dropped the dead process's lock
        pass


def test_ranks_side_by_side(make_config, rng, tmp_path):
    caches = [TierCache(make_config(root=tmp_path / "root" / f"rank{r}")) for r in range(3)]
    try:
        exp = [put_random(c, random_keys(rng, 5), rng) for c in caches]
        for c in caches:
            c.flush()
        for c, e in zip(caches, exp):
            assert_bytes(c, e)
    finally:
        for c in caches:
            c.close()


def test_capacity_bytes_evicts_least_recently_used(make_config, rng):
    cfg = make_config(host_slots=2, file_slots=1000)
    cfg = cfg.replace(capacity_bytes=3 * cfg.block_file_bytes + 100)
    assert cfg.file_capacity_slots == 3
    with TierCache(cfg) as c:
        keys = random_keys(rng, 8, "int")
        exp = {}
        for k in keys:
            exp.update(put_random(c, [k], rng))
        on_disk = sum(f.stat().st_size for f in files(cfg.root, "block_*"))
        assert on_disk <= cfg.capacity_bytes
        assert c.stats()["tiers"]["file"]["bytes_on_disk"] == on_disk
        assert len(c) == 5 and c.stats()["counters"]["evicted_blocks"] == 3
        assert_bytes(c, {k: exp[k] for k in keys[3:]})
    with pytest.raises(ConfigError, match="holds no block"):
        cfg.replace(capacity_bytes=10)


@pytest.mark.parametrize("fsync", ["none", "data", "data+dir"])
def test_direct_io_round_trip(make_config, rng, fsync):
    aligned = PoolSpec("a", (1024,), "float32")       # 4096 bytes: O_DIRECT
    odd = PoolSpec("b", (1000,), "float32")           # 4000 bytes: buffered fallback
    cfg = make_config(pools=(aligned, odd), host_slots=6, direct_io=True, fsync=fsync)
    with TierCache(cfg) as c:
        keys = random_keys(rng, 10)
        exp = {}
        for i in range(0, 10, 5):
            exp.update(put_random(c, keys[i:i + 5], rng))
        c.flush()
        c.evict([k for k in keys if "host" in c.lookup(k)], tier="host")  # now read from files
        assert_bytes(c, exp)
        c.onboard(keys[:6])
        assert_bytes(c, exp)


def test_wrong_geometry_files_are_quarantined(make_config, rng):
    cfg = make_config(pools=(PoolSpec("kv", (4, 16), "float16"),), host_slots=4)
    with TierCache(cfg) as c:
        put_random(c, [1, 2], rng)
        c.flush()
    other = cfg.replace(pools=(PoolSpec("kv", (8, 8), "float16"),))  # same name and size, other shape
    with TierCache(other) as c2:
        assert len(c2) == 0
        assert len(c2.scan.quarantined) == 2
        assert "wrong geometry: block_shape" in c2.scan.quarantined[0][1]
        assert c2.stats()["counters"]["quarantined_files"] == 2
    assert sorted(p.name for p in (cfg.root / "quarantine").iterdir()) == [
        block_filename(1, "kv"), block_filename(2, "kv")]


def test_permissions(make_config, rng):
    cfg = make_config(host_slots=2)
    with TierCache(cfg) as c:
        for k in (1, 2, 3):
            put_random(c, [k], rng)  # the third spills the first
        c.flush()
        c.get([1], pool="kv")
    found = list(files(cfg.root, "block_*"))
    assert found and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in found)
    assert stat.S_IMODE(cfg.root.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.parent.stat().st_mode) == 0o700 for f in found)  # their subdirectories too
    # a corrupt file gets quarantined into a 0700 directory
    with open(found[0], "r+b") as f:
        f.write(b"junk")
    drop_index(cfg.root)
    with TierCache(cfg) as c:
        assert c.scan.quarantined
    assert stat.S_IMODE((cfg.root / "quarantine").stat().st_mode) == 0o700


def test_a_slot_left_invalid_by_a_failed_read_is_valid_again_once_written(tmp_path, rng):
    """A failed file -> host read leaves its host slot invalid; a put (a CPU copy) that reuses
    the slot makes it valid again, so spilling that block to a file works (regression: CPU
    copies did not clear the flag, and the spill failed with 'holds no valid block')."""
    from tiercache import TransferError
    from tiercache.files import DATA_OFFSET

    pool = PoolSpec("p", (1024,), "uint8")
    cfg = CacheConfig(pools=(pool,), host_slots=1, file_slots=8, root=tmp_path / "r", fsync="none")
    a, b, c = (int(x) for x in rng.choice(1 << 30, 3, replace=False))
    with TierCache(cfg) as cache:
        data = rng.integers(1, 256, (3, 1024), dtype=np.uint8)
        cache.put([a], data[:1])
        cache.offload([a], to="file")
        path = bpath(cfg.root, a, "p")
        raw = bytearray(path.read_bytes())
        raw[DATA_OFFSET] ^= 0xFF
        path.write_bytes(bytes(raw))
        with pytest.raises(TransferError):
            cache.onboard([a], to="host")        # fails into host slot 0
        cache.put([b], data[1:2])                  # reuses slot 0
        cache.put([c], data[2:3])                  # spills b to a file: must read slot 0
        assert cache.lookup(b) == {"file": cache.lookup(b)["file"]}
        assert np.array_equal(cache.get([b]).reshape(1, -1), data[1:2])
