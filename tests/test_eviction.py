"""The eviction seam (tiercache/placement/victims.py): both facades choose their victims through
an EvictionPolicy (LRU by default), so a policy set on either one decides which blocks leave,
and no block is lost either way (a cache's host victims spill to files)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers import assert_bytes, put_random

from tiercache import RowStore, TierCache
from tiercache.placement import LRU, EvictionPolicy, lru_victims
from tiercache.rowstore import KeyState


class MostRecent:
    """Most recently used first: the opposite of the default, so the seam's use shows."""

    def __init__(self) -> None:
        self.calls = 0

    def victims(self, recency, count, held):
        self.calls += 1
        return lru_victims(reversed(list(recency)), count, held)


def test_lru_is_the_default_policy_of_both_facades(make_config, tmp_path):
    policy: EvictionPolicy = LRU()
    assert policy.victims([1, 2, 3, 4], 2, lambda k: k == 1) == [2, 3]
    with TierCache(make_config()) as c:
        assert isinstance(c.placement.eviction, LRU)
    store = RowStore(np.zeros((4, 4096), np.uint8), tmp_path / "rows", fsync="none")
    try:
        assert isinstance(store.eviction, LRU)
    finally:
        store.close()


def test_the_cache_spills_the_blocks_its_policy_picks(make_config, rng):
    with TierCache(make_config(host_slots=4)) as c:
        mru = c.placement.eviction = MostRecent()
        first = put_random(c, [10, 11, 12, 13], rng, tier="host")
        more = put_random(c, [20], rng, tier="host")  # one slot needed: the policy picks 13
        assert mru.calls >= 1
        assert 13 not in c.keys("host") and 13 in c.keys("file")
        assert sorted(c.keys("host")) == [10, 11, 12, 20]
        assert_bytes(c, {**first, **more})  # spilled, not lost


def test_the_row_store_drops_the_blocks_its_policy_picks(tmp_path, rng):
    rows = rng.integers(0, 256, (8, 4096), dtype=np.uint8)
    want = rows.copy()
    store = RowStore(rows, tmp_path / "rows", capacity_blocks=4, fsync="none")
    try:
        mru = store.eviction = MostRecent()
        keys = [os.urandom(8) for _ in range(5)]
        for i, k in enumerate(keys):  # the fifth finds the store full: the policy picks the newest
            store.submit_store([k], [i])
            assert store.drain(30)
        assert all(r.success for r in store.finished())
        assert mru.calls >= 1
        states = [store.state(k) for k in keys]
        assert states[3] is not KeyState.PRESENT and all(s is KeyState.PRESENT for s in states[:3] + states[4:])
        store.submit_load([keys[0], keys[4]], [5, 6])
        assert store.drain(30) and all(r.success for r in store.finished())
        assert np.array_equal(rows[5], want[0]) and np.array_equal(rows[6], want[4])
    finally:
        store.close()


@pytest.mark.parametrize("sharing", ["exclusive", "shared"])
def test_discarded_blocks_leave_the_index_and_their_files_go_on_a_shared_root_too(tmp_path, rng, sharing):
    """``RowStore.discard``: unlike an eviction (which leaves a shared root's files to the
    sweep), a discarded block's files are deleted at once, so neither this store nor another
    on the root serves it; the other blocks stay, byte-exact; a key not held is skipped."""
    rows = rng.integers(0, 256, (8, 4096), dtype=np.uint8)
    want = rows.copy()
    keys = [os.urandom(16) for _ in range(4)]
    kw = {"fsync": "none", "sharing": sharing}
    store = RowStore(rows, tmp_path / "rows", capacity_blocks=8, **kw)
    try:
        store.submit_store(keys, [0, 1, 2, 3])
        assert store.drain(30) and all(r.success for r in store.finished())
        files = {f.name for f in (tmp_path / "rows").rglob("block_*.bin")}
        assert len(files) == 4
        assert store.discard([keys[1], keys[3], os.urandom(16)]) == [keys[1], keys[3]]
        assert sorted(store.take_removed()) == sorted([keys[1], keys[3]])
        left = {f.name for f in (tmp_path / "rows").rglob("block_*.bin")}
        assert len(left) == 2 and left < files
        assert [store.state(k) is KeyState.PRESENT for k in (keys[0], keys[2])] == [True, True]
        assert store.state(keys[1]) is not KeyState.PRESENT
    finally:
        store.close()
    other = RowStore(np.zeros((4, 4096), np.uint8), tmp_path / "rows", capacity_blocks=8, **kw)
    try:
        other.submit_load([keys[0], keys[1], keys[2]], [0, 1, 2])
        assert other.drain(30)
        (res,) = other.finished()
        assert set(res.failed) == {keys[1]}
        assert np.array_equal(other.rows[0], want[0]) and np.array_equal(other.rows[2], want[2])
    finally:
        other.close()
