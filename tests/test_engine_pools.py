"""The engine's own tensors as the device tier: every field layout round-trips through host
and file tiers byte for byte, with host blocks of k device blocks (partial first/last host
blocks), layer-wise onboarding, partial-token copies, reopen, and registration errors.

The same tests run on NumPy "device" tensors on the CPU (CPU engines, and CI) and, with the
``gpu`` marker, on CuPy and PyTorch CUDA tensors."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_keys
from layouts import LAYOUTS, expected_partial, make_pools, scramble, snapshot

from tiercache import ArrayMismatchError, ConfigError, KeyNotFoundError, SlotRangeError, TierCache, TierUnavailableError
from tiercache.enginetensors import DevicePools


def _positions(rng, n: int, k: int, nb: int, partial: bool) -> np.ndarray:
    """``[n, k]`` distinct random device block ids; with ``partial``, the first host block
    lacks its first positions and the last one its last positions (-1)."""
    dev = rng.permutation(nb)[: n * k].reshape(n, k).astype(np.int64)
    if partial and k > 1:
        dev[0, : int(rng.integers(1, k))] = -1
        dev[-1, int(rng.integers(1, k)):] = -1
    return dev


def _check_onboarded(pools, before, dev_src, dev_dst, num_tokens=None, old=None):
    """Device block ``dev_dst[i, j]`` now holds what ``dev_src[i, j]`` held in ``before``."""
    now = snapshot(pools)
    for spec in pools.specs:
        for a, b in zip(dev_src.reshape(-1).tolist(), dev_dst.reshape(-1).tolist()):
            if a < 0:
                continue
            want = before[spec.name][a]
            if num_tokens is not None:
                want = expected_partial(old[spec.name][b], want, spec, num_tokens)
            assert np.array_equal(now[spec.name][b], want), (spec.name, a, b)


def _cache(pools, tmp_path, k, host_slots=3, file_slots=64):
    return TierCache.for_engine(pools, host_slots=host_slots, file_slots=file_slots, blocks_per_host_block=k,
                                root=tmp_path / "root", fsync="none")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_layout_round_trips_every_tier(tmp_path, rng, backend, layout, k):
    pools = make_pools(layout, rng, backend, nb=24)
    before = snapshot(pools)
    n = 6
    keys = random_keys(rng, n)
    dev = _positions(rng, n, k, pools.num_blocks, partial=True)
    with _cache(pools, tmp_path, k, host_slots=4) as c:
        c.offload_slots(keys[:3], dev[:3], wait=True)
        c.offload_slots(keys[3:], dev[3:], wait=True)  # host holds 4: the oldest spill to files
        assert {t for key in keys for t in c.lookup(key)} == {"host", "file"}
        c.flush()
        scramble(pools, rng)
        order = rng.permutation(n)
        dst = np.where(dev[order] >= 0, rng.permutation(pools.num_blocks)[: n * k].reshape(n, k), -1)
        for part in (slice(0, 3), slice(3, n)):  # batches up to the host tier's size
            c.onboard_slots([keys[i] for i in order[part]], dst[part], layerwise=bool(rng.integers(2))).synchronize()
        _check_onboarded(pools, before, dev[order], dst)
    scramble(pools, rng)
    with _cache(pools, tmp_path, k, host_slots=n) as c:  # reopen: index and partial positions from the files
        assert set(c.keys()) == set(keys)
        h = c.onboard_slots(keys, dev, layerwise=True)
        assert h.num_layers == len(pools.layers)
        h.synchronize()
        assert all(h.layer_done(i) for i in range(h.num_layers))
        _check_onboarded(pools, before, dev, dev)
        if k > 1:
            full = np.arange(k, dtype=np.int64)[None, :] + 0 * dev[:1]
            with pytest.raises(KeyNotFoundError, match="never"):
                c.onboard_slots(keys[:1], full)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_token_copies(tmp_path, rng, backend, layout):
    pools = make_pools(layout, rng, backend, nb=16, bs=8)
    bs = 8
    keys = random_keys(rng, 4)
    dev = rng.permutation(16)[:4].astype(np.int64)
    before = snapshot(pools)
    with _cache(pools, tmp_path, 1, host_slots=8) as c:
        c.offload_slots(keys, dev, wait=True)
        for num_tokens in (0, 1, bs - 1, bs, bs + 3):
            scramble(pools, rng)
            old = snapshot(pools)
            dst = rng.permutation(16)[:4].astype(np.int64)
            c.onboard_slots(keys, dst, num_tokens=num_tokens, layerwise=bool(rng.integers(2))).synchronize()
            _check_onboarded(pools, before, dev.reshape(-1, 1), dst.reshape(-1, 1),
                             num_tokens=min(num_tokens, bs), old=old)
        # a partial offload: only the first tokens reach the host block
        t = int(rng.integers(1, bs))
        src = snapshot(pools)
        c.offload_slots([b"partial"], dev[:1], num_tokens=t, wait=True)
        scramble(pools, rng)
        old = snapshot(pools)
        c.onboard_slots([b"partial"], dev[1:2], num_tokens=t).synchronize()
        _check_onboarded(pools, src, dev[:1].reshape(1, 1), dev[1:2].reshape(1, 1), num_tokens=t, old=old)


def test_engine_writes_are_the_tensors(tmp_path, rng):
    """Registration copies nothing: bytes the engine writes into its tensor are what gets
    offloaded, and onboards land in the engine's tensor."""
    caches = [rng.standard_normal((8, 2, 4, 2, 16)).astype(np.float16) for _ in range(2)]
    pools = DevicePools.vllm(caches, host_ok=True)
    with _cache(pools, tmp_path, 1) as c:
        caches[1][5] = 7.0
        c.offload_slots([42], [5], wait=True)
        caches[1][6] = -1.0
        c.onboard_slots([42], [6]).synchronize()
        assert (caches[1][6] == 7.0).all()
        assert c.device_array("layer.1") is caches[1]


def test_device_slot_errors(tmp_path, rng):
    pools = make_pools("vllm", rng, nb=8)
    with _cache(pools, tmp_path, 2) as c:
        with pytest.raises(SlotRangeError, match=r"shape \[2\].*x 2"):
            c.offload_slots([1, 2], [0, 1])
        with pytest.raises(SlotRangeError, match="8 outside"):
            c.offload_slots([1], [[0, 8]])
        with pytest.raises(SlotRangeError, match="no device block"):
            c.offload_slots([1], [[-1, -1]])
        c.offload_slots([1, 2], [[0, 1], [2, 3]], wait=True)
        with pytest.raises(SlotRangeError, match="twice"):
            c.onboard_slots([1, 2], [[4, 5], [5, 6]])
        with pytest.raises(KeyNotFoundError):
            c.onboard_slots([99], [[4, 5]])
        with pytest.raises(TierUnavailableError, match="offload_slots"):
            c.put([3], np.zeros((1, *c.config.pools[0].block_shape), np.float16), tier="device")
        assert c.tier_names == ["host", "file"]


def test_registration_errors(rng):
    good = np.ones((4, 2, 8, 2, 16), np.float16)
    with pytest.raises(ArrayMismatchError, match="host memory"):
        DevicePools.vllm([good])
    with pytest.raises(ArrayMismatchError, match="not C-contiguous"):
        DevicePools({"a": np.ones((4, 32), np.float16)[:, ::2]}, host_ok=True)
    with pytest.raises(ArrayMismatchError, match="expected"):
        DevicePools.vllm([np.ones((4, 8, 2, 16), np.float16)], host_ok=True)
    with pytest.raises(ArrayMismatchError, match="axis 1 must be 2"):
        DevicePools.vllm([np.ones((4, 3, 8, 2, 16), np.float16)], host_ok=True)
    with pytest.raises(ArrayMismatchError, match="num_blocks"):
        DevicePools.vllm([good, np.ones((5, 2, 8, 2, 16), np.float16)], host_ok=True)
    with pytest.raises(ArrayMismatchError, match="unsupported dtype.*sub-byte"):
        DevicePools({"a": np.ones((4, 8), np.complex64)}, host_ok=True)
    with pytest.raises(ArrayMismatchError, match="aligned to 16"):
        DevicePools({"a": np.zeros(4 * 64 + 1, np.uint8)[1:].reshape(4, 64)}, host_ok=True)
    with pytest.raises(ArrayMismatchError, match=r"\[num_blocks, \*block_shape\]"):
        DevicePools({"a": np.ones(16, np.float16)}, host_ok=True)
    with pytest.raises(ConfigError, match="exactly once"):
        DevicePools({"a": good, "b": good}, host_ok=True, layers=[["a"]])
    with pytest.raises(ArrayMismatchError, match="not a tensor"):
        DevicePools({"a": [1, 2, 3]}, host_ok=True)
    with pytest.raises(ConfigError, match="blocks_per_host_block"):
        TierCache.for_engine(DevicePools.vllm([good], host_ok=True), host_slots=2, blocks_per_host_block=0)
    with pytest.raises(ConfigError, match="needs a host tier"):
        TierCache.for_engine(DevicePools.vllm([good], host_ok=True), file_slots=2, blocks_per_host_block=2)


def test_no_host_tier_goes_straight_to_files(tmp_path, rng, backend):
    pools = make_pools("mla", rng, backend, nb=12)
    before = snapshot(pools)
    keys = random_keys(rng, 5)
    dev = rng.permutation(12)[:5].astype(np.int64)
    with TierCache.for_engine(pools, file_slots=16, root=tmp_path / "root", fsync="none") as c:
        assert c.offload_slots(keys, dev) is None  # done when it returns
        assert all(set(c.lookup(k)) == {"file"} for k in keys)
        scramble(pools, rng)
        dst = rng.permutation(12)[:5].astype(np.int64)
        c.onboard_slots(keys, dst).synchronize()
        _check_onboarded(pools, before, dev.reshape(-1, 1), dst.reshape(-1, 1))
        with pytest.raises(TierUnavailableError, match="host tier"):
            c.onboard_slots(keys[:1], dst[:1], num_tokens=2)


def test_batches_larger_than_the_host_tier_stream_through_it(tmp_path, rng, backend):
    """offload_slots(to="file") and onboard_slots of more blocks than the host tier holds go
    through it in pieces (host tier of 2, 7 blocks), bytes exact; a pinned host block shrinks
    the pieces."""
    pools = make_pools("vllm", rng, backend, nb=24)
    before = snapshot(pools)
    keys = random_keys(rng, 7)
    dev = rng.permutation(pools.num_blocks)[:7].astype(np.int64)
    with _cache(pools, tmp_path, 1, host_slots=3) as c:
        c.offload_slots([b"pinned"], [int(dev[0])], wait=True)
        c.pin([b"pinned"])  # the host tier has room for 2 at a time
        assert c.offload_slots(keys, dev, to="file") is None
        assert all(set(c.lookup(k)) == {"file"} for k in keys)
        assert c.stats()["counters"]["streamed_offloads"] == 1
        scramble(pools, rng)
        dst = rng.permutation(pools.num_blocks)[:7].astype(np.int64)
        h = c.onboard_slots(keys, dst, layerwise=True)
        assert h.done() and all(h.layer_done(i) for i in range(h.num_layers)) and h.num_layers == len(pools.layers)
        _check_onboarded(pools, before, dev.reshape(-1, 1), dst.reshape(-1, 1))
        assert c.stats()["counters"]["streamed_onboards"] == 1
        assert "host" in c.lookup(b"pinned")
