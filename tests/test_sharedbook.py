"""The bookkeeping both facades keep for a shared root (a miss remembered for a while, a use
time refreshed at most so often) and their one LRU victim rule."""

from __future__ import annotations

import random

from tiercache.placement import NegativeCache, TouchThrottle, lru_victims, sharedbook


def test_a_miss_is_remembered_for_its_ttl_only():
    nc = NegativeCache(2.0)
    nc.mark([b"a", b"b"], now=10.0)
    assert nc.absent(b"a", now=11.9) and not nc.absent(b"a", now=12.0) and not nc.absent(b"c", now=10.0)
    nc.ttl_s = 0.0
    nc.mark([b"c"], now=20.0)
    assert not nc.absent(b"c", now=20.0)  # 0: every miss looks again


def test_tables_forget_stale_entries_past_their_bound(monkeypatch):
    monkeypatch.setattr(sharedbook, "MAX_ENTRIES", 10)
    nc = NegativeCache(1.0)
    nc.mark([bytes([i]) for i in range(8)], now=0.0)
    nc.mark([bytes([100 + i]) for i in range(5)], now=5.0)  # the first 8 have expired: dropped
    assert len(nc._until) == 5 and nc.absent(bytes([100]), now=5.5)
    tt = TouchThrottle(1.0)
    tt.due([bytes([i]) for i in range(8)], now=0.0)
    assert tt.due([bytes([100 + i]) for i in range(5)], now=3.0) and len(tt._at) == 5


def test_a_key_is_refreshed_at_most_once_per_interval():
    tt = TouchThrottle(1.0)
    assert tt.due([b"a", b"b"], now=0.0) == [b"a", b"b"]
    assert tt.due([b"a", b"c"], now=0.5) == [b"c"]
    assert tt.due([b"a", b"b", b"c"], now=1.0) == [b"a", b"b"]


def test_victims_are_the_least_recently_used_not_held():
    rng = random.Random(5)
    lru = [bytes([i]) for i in range(50)]
    held = set(rng.sample(lru, 20))
    got = lru_victims(iter(lru), 10, held.__contains__)
    assert got == [k for k in lru if k not in held][:10]
    assert lru_victims(lru, 100, held.__contains__) == [k for k in lru if k not in held]
    assert lru_victims(lru, 0, held.__contains__) == [] and lru_victims(lru, -3, held.__contains__) == []
