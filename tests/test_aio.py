"""The asyncio front end: awaits work, the loop stays responsive, cancellation leaves the cache
consistent."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from conftest import random_keys
from helpers import assert_bytes

from tiercache import KeyNotFoundError, TierCache
from tiercache.aio import AsyncTierCache
from tiercache.files import posix_io


def test_await_round_trip_and_errors(make_config, rng):
    async def main():
        async with AsyncTierCache(TierCache(make_config(host_slots=4))) as ac:
            keys = random_keys(rng, 6)
            data = {p.name: rng.integers(1, 256, (6, p.block_nbytes), dtype=np.uint8) for p in ac.cache.config.pools}
            await ac.put(keys[:3], {k: v[:3] for k, v in data.items()})
            await ac.put(keys[3:], {k: v[3:] for k, v in data.items()})
            await ac.offload(keys, to="file")
            await ac.onboard(keys[:4])
            assert all("host" in ac.lookup(k) for k in keys[:4])
            assert_bytes(ac.cache, {k: {p: data[p][i] for p in data} for i, k in enumerate(keys)})
            with pytest.raises(KeyNotFoundError):
                await ac.onboard([12345])
    asyncio.run(main())


def test_loop_not_blocked_and_cancel_is_consistent(make_config, rng, monkeypatch):
    real = posix_io.read_block

    def slow(*args):
        time.sleep(0.05)
        return real(*args)

    monkeypatch.setattr(posix_io, "read_block", slow)

    async def main():
        ac = AsyncTierCache(TierCache(make_config(host_slots=8, io_threads=1, io_engine="python")))
        keys = random_keys(rng, 8, "int")
        data = {p.name: rng.integers(1, 256, (8, p.block_nbytes), dtype=np.uint8) for p in ac.cache.config.pools}
        await ac.put(keys, data)
        await ac.offload(keys, to="file")
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        t = asyncio.create_task(ticker())
        task = asyncio.create_task(ac.onboard(keys))  # 8 blocks x 2 pools x 50 ms, one I/O thread
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ticks >= 10  # the loop kept running while the onboard worked
        await ac.flush()  # queued behind the cancelled onboard, which runs to completion
        t.cancel()
        where = [ac.lookup(k) for k in keys]
        assert all("file" in w for w in where)
        assert all("host" in w for w in where) or not any("host" in w for w in where)
        assert_bytes(ac.cache, {k: {p: data[p][i] for p in data} for i, k in enumerate(keys)})
        await ac.aclose()
    asyncio.run(main())


def test_await_engine_slots_and_cancel(tmp_path, rng, monkeypatch):
    from layouts import make_pools, snapshot

    pools = make_pools("fastdeploy", rng, nb=16)
    before = snapshot(pools)
    real = posix_io.read_block

    def slow(*args):
        time.sleep(0.02)
        return real(*args)

    async def main():
        cache = TierCache.for_engine(pools, host_slots=4, file_slots=32, blocks_per_host_block=2,
                                     root=tmp_path / "root", fsync="none", io_threads=1, io_engine="python")
        async with AsyncTierCache(cache) as ac:
            keys = random_keys(rng, 4)
            dev = rng.permutation(16)[:8].reshape(4, 2)
            await ac.offload_slots(keys, dev, to="file")
            assert all(set(ac.lookup(k)) == {"file"} for k in keys)
            monkeypatch.setattr(posix_io, "read_block", slow)
            task = asyncio.create_task(ac.onboard_slots(keys, dev[::-1].copy(), layerwise=True))
            await asyncio.sleep(0.03)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            monkeypatch.setattr(posix_io, "read_block", real)
            h = await ac.onboard_slots(keys, dev[::-1].copy())  # queued behind the cancelled one
            assert h.done()
            await ac.wait_layer(h, 0)
            now = snapshot(pools)
            for i, j in np.ndindex(4, 2):
                a, b = dev[i, j], dev[::-1][i, j]
                for name in now:
                    assert np.array_equal(now[name][b], before[name][a])
            # a prepared onboard: the file-only keys come up to the host tier in the worker
            await ac.evict(keys)
            stored = snapshot(pools)
            await ac.offload_slots(keys[:2], dev[:2], to="file")
            with await ac.prepare_onboard(keys[:2], dev[2:]) as p:
                assert all("host" in ac.lookup(k) for k in keys[:2])
                p.launch().synchronize()
            now = snapshot(pools)
            for name in now:
                assert np.array_equal(now[name][dev[2:].reshape(-1)], stored[name][dev[:2].reshape(-1)])
    asyncio.run(main())
