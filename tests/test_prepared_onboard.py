"""Prepared onboards (TierCache.prepare_onboard): planned once, launched many times.

Every launch must land exactly what onboard_slots would (every engine layout, host blocks of k
device blocks with partial positions, layer-wise, first tokens only); the keys stay pinned in
the host tier while the plan is held (file-only keys are brought up first); launches are
ordered against other transfers by the slot ledger; a released plan or a closed cache refuses
to launch. NumPy "device" tensors on the CPU; CuPy and PyTorch CUDA tensors with the ``gpu``
marker."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_keys
from layouts import LAYOUTS, expected_partial, make_pools, scramble, snapshot

from tiercache import (
    ClosedError,
    KeyNotFoundError,
    PinnedBlockError,
    SlotRangeError,
    TierCache,
    TierFullError,
    TierUnavailableError,
)


def _cache(pools, tmp_path, k, host_slots, file_slots=64):
    return TierCache.for_engine(pools, host_slots=host_slots, file_slots=file_slots, blocks_per_host_block=k,
                                root=tmp_path / "root", fsync="none")


def _positions(rng, n, k, nb):
    dev = rng.permutation(nb)[: n * k].reshape(n, k).astype(np.int64)
    if k > 1:
        dev[0, : int(rng.integers(1, k))] = -1
        dev[-1, int(rng.integers(1, k)):] = -1
    return dev


def _expect(pools, stored, dev_src, dev_dst, old, num_tokens=None):
    """Device block ``dev_dst[i, j]`` holds what ``dev_src[i, j]`` held in ``stored``; every
    other block holds what it held in ``old``."""
    now = snapshot(pools)
    for spec in pools.specs:
        want = old[spec.name].copy()
        for a, b in zip(dev_src.reshape(-1).tolist(), dev_dst.reshape(-1).tolist()):
            if a >= 0:
                block = stored[spec.name][a]
                want[b] = block if num_tokens is None else expected_partial(old[spec.name][b], block, spec, num_tokens)
        assert np.array_equal(now[spec.name], want), spec.name


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k", [1, 3])
def test_every_launch_lands_the_blocks(tmp_path, rng, backend, layout, k):
    """Launched three times, with the device blocks scrambled in between, each launch lands
    the same bytes as the first, and nothing outside its destination changes."""
    pools = make_pools(layout, rng, backend, nb=30)
    n = 5
    keys = random_keys(rng, n)
    dev = _positions(rng, n, k, pools.num_blocks)
    stored = snapshot(pools)
    layerwise = bool(rng.integers(2))
    num_tokens = None if rng.integers(2) else int(rng.integers(1, 8))
    with _cache(pools, tmp_path, k, host_slots=8) as c:
        c.offload_slots(keys, dev, wait=True)
        order = rng.permutation(n)
        dst = np.where(dev[order] >= 0, rng.permutation(pools.num_blocks)[: n * k].reshape(n, k), -1)
        with c.prepare_onboard([keys[i] for i in order], dst, layerwise=layerwise, num_tokens=num_tokens) as p:
            assert p.num_layers == (len(pools.layers) if layerwise else 1)
            for _ in range(3):
                scramble(pools, rng)
                old = snapshot(pools)
                p.launch().synchronize()
                _expect(pools, stored, dev[order], dst, old, num_tokens)
        counters = c.stats()["counters"]
        assert counters["prepared_onboard_launches"] == 3 and counters["onboarded_blocks"] == 3 * n


def test_keys_are_pinned_while_held_and_come_up_from_files(tmp_path, rng, backend):
    pools = make_pools("vllm", rng, backend, nb=24)
    keys = random_keys(rng, 6)
    dev = rng.permutation(pools.num_blocks)[:6].astype(np.int64)
    stored = snapshot(pools)
    with _cache(pools, tmp_path, 1, host_slots=4) as c:
        c.offload_slots(keys, dev, to="file")
        assert all(set(c.lookup(key)) == {"file"} for key in keys)
        dst = rng.permutation(pools.num_blocks)[:3].astype(np.int64)
        p = c.prepare_onboard(keys[:3], dst)
        assert all("host" in c.lookup(key) for key in keys[:3])
        with pytest.raises(PinnedBlockError, match="evict"):
            c.evict(keys[:1])
        with pytest.raises(PinnedBlockError, match="replace"):
            c.offload_slots(keys[1:2], dev[:1], wait=True)
        # the other keys stream through the one host slot left; the pinned ones stay
        c.onboard_slots(keys[3:], rng.permutation(pools.num_blocks)[:3]).synchronize()
        assert all("host" in c.lookup(key) for key in keys[:3])
        with pytest.raises(TierFullError, match="pinned"):  # 3 pinned of 4: no room for 2 more
            c.prepare_onboard(keys[3:5], dst[:2])
        scramble(pools, rng)
        old = snapshot(pools)
        p.launch().synchronize()
        _expect(pools, stored, dev[:3], dst, old)
        p.release()
        p.release()  # idempotent
        with pytest.raises(ClosedError, match="released"):
            p.launch()
        c.evict(keys[:1])  # unpinned now
        q = c.prepare_onboard(keys[1:2], dst[:1])
    with pytest.raises(ClosedError):
        q.launch()
    q.release()  # after close: nothing to undo, no error


def test_bad_arguments_are_refused_and_pin_nothing(tmp_path, rng):
    pools = make_pools("mla", rng, "numpy", nb=12)
    keys = random_keys(rng, 3)
    with _cache(pools, tmp_path, 2, host_slots=4) as c:
        c.offload_slots(keys, np.array([[0, 1], [2, 3], [4, -1]]), wait=True)
        with pytest.raises(KeyNotFoundError):
            c.prepare_onboard([b"missing"], [[5, 6]])
        with pytest.raises(KeyNotFoundError, match="position"):
            c.prepare_onboard(keys[2:], [[5, 6]])  # position 1 was never filled
        with pytest.raises(SlotRangeError, match="twice"):
            c.prepare_onboard(keys[:2], [[5, 6], [6, 7]])
        with pytest.raises(SlotRangeError, match="outside"):
            c.prepare_onboard(keys[:1], [[5, 99]])
        assert not c.placement.pins
    with TierCache.for_engine(make_pools("mla", rng, "numpy", nb=12), file_slots=8, root=tmp_path / "r2",
                              fsync="none") as c:
        c.offload_slots(keys[:1], [0])
        with pytest.raises(TierUnavailableError, match="host tier"):
            c.prepare_onboard(keys[:1], [1])


@pytest.mark.parametrize("exclusive", [False, True])
def test_launches_are_ordered_against_other_transfers(tmp_path, rng, backend, exclusive):
    """Two plans into the same device blocks land in launch order; an offload right after
    the launches reads what the second wrote; a launch right after the offload that fills its
    host blocks lands the new bytes (no waits on the host in between). Exclusive plans get
    the same order from the stream alone: their replays skip the ledger, and each launch
    (not layer-wise) makes the stream wait for it."""
    pools = make_pools("fastdeploy", rng, backend, nb=40)
    n = 8
    keys, other = random_keys(rng, n), random_keys(rng, n)
    perm = rng.permutation(pools.num_blocks).astype(np.int64)
    src, dst, dst2 = perm[:n], perm[n:2 * n], perm[2 * n:3 * n]
    with _cache(pools, tmp_path, 1, host_slots=3 * n) as c:
        c.offload_slots(keys, src, wait=True)
        c.offload_slots(other, src[::-1].copy(), wait=True)
        stored = snapshot(pools)
        first, second = (c.prepare_onboard(ks, dst, exclusive=exclusive) for ks in (keys, other))
        for _ in range(3):
            scramble(pools, rng)
            first.launch()
            second.launch()
            echo = random_keys(rng, n)
            c.offload_slots(echo, dst)  # must read what `second` wrote: other's blocks
            with c.prepare_onboard(echo, dst2) as third:
                old = snapshot(pools)
                third.launch().synchronize()
                _expect(pools, stored, src[::-1].copy(), dst2, old)
        first.release()
        second.release()


def _device_scramble(pools, rng):
    """Device-resident random bytes for every pool, and a function that copies them over the
    pools on the current stream (a kernel: the host does not wait for the stream)."""
    import cupy

    new = {s.name: cupy.asarray(rng.integers(1, 256, size=pools.raw(s.name).shape, dtype=np.uint8))
           for s in pools.specs}

    def run():
        for s in pools.specs:
            pools.raw(s.name)[...] = new[s.name]

    return {s.name: cupy.asnumpy(a) for s, a in zip(pools.specs, new.values())}, run


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "torch"], indirect=True)
@pytest.mark.parametrize("layerwise", [False, True])
def test_exclusive_replays_follow_the_stream_and_end_by_release(tmp_path, rng, backend, layerwise):
    """An exclusive plan's launches after the first replay it (no ledger job, no pending
    job): each lands the same bytes after whatever the stream queued before it (here a device
    write of the same blocks behind a 30 ms spin, which a replay that ignored the stream would
    precede and lose to); ``synchronize`` of the engine and ``release`` wait for a replay
    still in flight."""
    import cupy

    from tiercache.memory import as_cupy_stream

    pools = make_pools("vllm", rng, backend, nb=32)
    n, k = 6, 2
    keys = random_keys(rng, n)
    dev = _positions(rng, n, k, pools.num_blocks)
    stored = snapshot(pools)
    with _cache(pools, tmp_path, k, host_slots=8) as c:
        c.offload_slots(keys, dev, wait=True)
        dst = np.where(dev >= 0, rng.permutation(pools.num_blocks)[: n * k].reshape(n, k), -1)
        stream = as_cupy_stream(c.engine_stream())
        p = c.prepare_onboard(keys, dst, layerwise=layerwise, exclusive=True)
        first = p.launch()
        assert first.job.start_event is not None  # the first launch is a ledger job
        for i in range(3):
            garbage, overwrite = _device_scramble(pools, rng)
            pending = len(c.engine.pending())
            c.engine.launcher.spin(stream, 30_000_000)
            overwrite()
            h = p.launch()
            assert h.job.start_event is None and len(c.engine.pending()) <= pending  # a replay
            if i == 0:
                c.engine.synchronize()
                assert h.done()
            else:
                h.synchronize()
            cupy.cuda.Device().synchronize()
            _expect(pools, stored, dev, dst, garbage)
        c.engine.launcher.spin(stream, 30_000_000)
        h = p.launch()
        assert not h.done()
        p.release()
        assert h.done()  # release waited for it


@pytest.mark.gpu
def test_rows_for_the_batched_copy_launch_as_one_kernel(tmp_path, rng):
    """128 KiB rows (a 1024-token block of head_dim 64, bf16): a fresh onboard gives them to the
    driver's batched copy, a prepared one to the bulk kernel (one launch, its table on the
    device); both land the same bytes."""
    torch = pytest.importorskip("torch")
    from tiercache.enginetensors import DevicePools

    nb, tpb, d = 24, 1024, 64
    ring = {n: torch.from_numpy(rng.integers(0, 1 << 15, size=(nb, tpb, d), dtype=np.int16)).cuda().view(torch.bfloat16)
            for n in ("k", "v")}
    pools = DevicePools(ring, token_axis=0, layers=[["k", "v"]])
    keys = random_keys(rng, 4)
    dev = rng.permutation(nb)[:8].reshape(4, 2).astype(np.int64)
    perm = rng.permutation([b for b in range(nb) if b not in dev]).astype(np.int64)
    with _cache(pools, tmp_path, 2, host_slots=8) as c:
        c.offload_slots(keys, dev, wait=True)
        stored = snapshot(pools)
        fresh = c.onboard_slots(keys, perm[:8].reshape(4, 2), layerwise=True)
        fresh.synchronize()
        assert fresh.job.path == "batch"
        with c.prepare_onboard(keys, perm[8:16].reshape(4, 2), layerwise=True) as p:
            for _ in range(2):
                scramble(pools, rng)
                old = snapshot(pools)
                h = p.launch()
                h.synchronize()
                assert h.job.path == "bulk"
                _expect(pools, stored, dev, perm[8:16].reshape(4, 2), old)


@pytest.mark.gpu
@pytest.mark.parametrize("tpb, path", [(1024, "memcpy2d"), (256, "memcpy2d"), (64, "bulk")])
def test_strided_runs_of_large_rows_go_to_2d_copies(tmp_path, rng, tpb, path):
    """A layer-streaming cache's layout: host blocks of k device blocks (rows of 128, 32 or
    8 KiB), position p of block j going to row j of position p's run of consecutive device
    rows. A prepared launch moves each strided run with one 2-D copy (path ``memcpy2d``) when
    its rows are at least 16 KiB and its runs 128 KiB, else with the bulk kernel; the bytes
    are exact on every launch; scattered destinations keep the bulk kernel."""
    torch = pytest.importorskip("torch")
    from tiercache.enginetensors import DevicePools

    nb, d, k, n = 48, 64, 2, 6
    ring = {name: torch.from_numpy(rng.integers(0, 1 << 15, size=(nb, tpb, d), dtype=np.int16)).cuda().view(
        torch.bfloat16) for name in ("k", "v")}
    pools = DevicePools(ring, token_axis=0, layers=[["k", "v"]])
    keys = random_keys(rng, n)
    dev = rng.permutation(nb)[: n * k].reshape(n, k).astype(np.int64)
    with _cache(pools, tmp_path, k, host_slots=n) as c:
        c.offload_slots(keys, dev, wait=True)
        stored = snapshot(pools)
        base = int(rng.integers(0, nb - 2 * 8))
        dst = base + np.arange(k)[None, :] * 8 + np.arange(n)[:, None]  # position p's run: rows base + 8p ..
        with c.prepare_onboard(keys, dst, layerwise=True, exclusive=bool(rng.integers(2))) as p:
            for _ in range(3):
                scramble(pools, rng)
                old = snapshot(pools)
                h = p.launch()
                h.synchronize()
                torch.cuda.synchronize()
                _expect(pools, stored, dev, dst, old)
            assert p._rows.plans[0].path == path
        scattered = rng.permutation(nb)[: n * k].reshape(n, k).astype(np.int64)
        with c.prepare_onboard(keys, scattered) as p:
            assert p._rows.plans[0].path == "bulk"
