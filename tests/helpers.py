"""Test helpers shared by the cache tests."""

from __future__ import annotations

import numpy as np

from tiercache import TierCache


def put_random(cache: TierCache, keys: list, rng: np.random.Generator, tier: str | None = None) -> dict:
    """Put random blocks for ``keys`` in every pool; returns ``{key: {pool: bytes row}}``."""
    data = {p.name: rng.integers(1, 256, size=(len(keys), p.block_nbytes), dtype=np.uint8)
            for p in cache.config.pools}
    cache.put(keys, data, tier=tier)
    return {k: {p: data[p][i].copy() for p in data} for i, k in enumerate(keys)}


def assert_bytes(cache: TierCache, expected: dict) -> None:
    """Every key in ``expected`` reads back byte-exact in every pool."""
    keys = list(expected)
    if not keys:
        return
    for p in cache.config.pools:
        got = cache.get(keys, pool=p.name, out=np.empty((len(keys), p.block_nbytes), np.uint8))
        want = np.stack([expected[k][p.name] for k in keys])
        bad = [keys[i] for i in np.flatnonzero((got != want).any(axis=1))]
        assert not bad, f"pool {p.name}: {len(bad)} block(s) differ, e.g. {bad[:3]}"
