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


def assert_segment_round_trip(seg, src: np.ndarray, s, dev_before: np.ndarray, dev_after: np.ndarray, d,
                              back_before: np.ndarray, back_after: np.ndarray, h) -> None:
    """After a partial copy of rows ``s`` of ``src`` to device rows ``d`` and from there to host
    rows ``h`` (``seg``: ``segs`` segments of ``seg_bytes``, ``seg_stride`` apart, per row): the
    device and host arrays hold exactly those segments, and every other byte as before."""
    def head(a):  # [rows, segs, seg_bytes]
        return a.reshape(a.shape[0], seg.segs, seg.seg_stride)[:, :, :seg.seg_bytes]

    want_dev = dev_before.copy()
    head(want_dev)[d] = head(src[s])
    assert np.array_equal(dev_after, want_dev)
    want_back = back_before.copy()
    head(want_back)[h] = head(want_dev[d])
    assert np.array_equal(back_after, want_back)


def partial_round_trip(la, seg, src: np.ndarray, back: np.ndarray, rng: np.random.Generator, picks: int,
                       force: str | None = None) -> set:
    """Random bytes in ``src``, ``back`` (pinned host ``[n, row]`` arrays) and a device array;
    then the segments of ``picks`` random rows host -> device -> host through ``la.launch``
    (``force``: a path, or None for the launcher's choice), checked byte for byte with
    :func:`assert_segment_round_trip`. Returns the paths taken."""
    import cupy

    n, row = src.shape
    src[:] = rng.integers(1, 256, size=src.shape, dtype=np.uint8)
    back[:] = rng.integers(1, 256, size=back.shape, dtype=np.uint8)
    before = back.copy()
    dev = cupy.asarray(rng.integers(1, 256, size=(n, row), dtype=np.uint8))
    dev_before = dev.get()
    s, d, h = (rng.permutation(n)[:picks] for _ in range(3))
    st = cupy.cuda.Stream(non_blocking=True)
    paths = {la.launch(src, s, dev, d, seg, st, force=force), la.launch(dev, d, back, h, seg, st, force=force)}
    st.synchronize()
    assert_segment_round_trip(seg, src, s, dev_before, dev.get(), d, before, back, h)
    return paths


def spy_request_sizes(monkeypatch, cls, name: str = "submit") -> list[int]:
    """Wrap ``cls.name(self, keys, ...)`` to record ``len(keys)`` of each call (which requests
    took a path, and how many blocks each carried); returns the list it fills."""
    calls: list[int] = []
    real = getattr(cls, name)

    def spy(self, keys, *a, **k):
        calls.append(len(keys))
        return real(self, keys, *a, **k)

    monkeypatch.setattr(cls, name, spy)
    return calls
