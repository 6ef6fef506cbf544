"""A caller that waits for its own file request runs the request's I/O task itself
(Outcome.help -> IOThreads.run_here) instead of waking an I/O thread and sleeping: the cache's
row writes and reads, the general path (two pools) and the group commit, in one thread and in
several at once, with exact bytes."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import random_keys

from tiercache import CacheConfig, PoolSpec, TierCache
from tiercache.files import nativeio


@pytest.fixture
def native_threads_seen(monkeypatch):
    """The names of the Python threads that made each native call."""
    seen: list[str] = []
    real = nativeio.NativeIO.run

    def run(self, *a, **k):
        seen.append(threading.current_thread().name)
        return real(self, *a, **k)

    monkeypatch.setattr(nativeio.NativeIO, "run", run)
    return seen


def _pools(two: bool, bs: int):
    return [PoolSpec("kv", (bs,), "uint8")] + ([PoolSpec("v", (4096,), "uint8")] if two else [])


@pytest.mark.parametrize("two_pools", [False, True])
@pytest.mark.parametrize("fsync", ["none", "data"])
def test_a_plain_calls_file_work_runs_in_the_calling_thread(tmp_path, rng, native_threads_seen, two_pools, fsync):
    """After a first round (which starts the I/O threads: a thread being started takes the task
    queued for it), most requests' native calls are made by the caller's own thread; every
    block reads back exact. (Most, not all: an idle I/O thread woken by the queueing may get
    the GIL first on a loaded machine and take the task, as before.)"""
    bs, n, rounds = 8192, 16, 6
    cfg = CacheConfig(_pools(two_pools, bs), host_slots=n, file_slots=4 * n * rounds, root=str(tmp_path / "c"),
                      fsync=fsync, io_engine="threads")
    keys = random_keys(rng, n * rounds, "mixed")
    data = {"kv": rng.integers(0, 256, (n * rounds, bs), dtype=np.uint8)}
    if two_pools:
        data["v"] = rng.integers(0, 256, (n * rounds, 4096), dtype=np.uint8)
    me, mine = threading.current_thread().name, []
    with TierCache(cfg) as cache:
        for r in range(rounds):
            ks, sl = keys[r * n:(r + 1) * n], slice(r * n, (r + 1) * n)
            del native_threads_seen[:]
            cache.put(ks, {p: a[sl] for p, a in data.items()})
            cache.offload(ks)
            order = rng.permutation(n)
            for p, a in data.items():
                assert np.array_equal(cache.get([ks[i] for i in order], pool=p), a[sl][order])
            if r:
                mine.append(native_threads_seen.count(me) / len(native_threads_seen))
    assert len(mine) == rounds - 1 and np.mean(mine) >= 0.5, mine


def test_callers_in_several_threads_get_their_own_bytes(tmp_path, rng):
    """Four threads put, offload and get their own random keys in turns; whichever thread runs a
    request's I/O, every block comes back exact, and a second cache reads them all."""
    bs, per, rounds = 8192, 24, 6
    cfg = CacheConfig(_pools(False, bs), host_slots=8 * per, file_slots=4 * 4 * per * rounds,
                      root=str(tmp_path / "c"), fsync="none")
    keys = random_keys(rng, 4 * per * rounds, "mixed")
    data = rng.integers(0, 256, (len(keys), bs), dtype=np.uint8)
    errors: list[BaseException] = []
    cache = TierCache(cfg)

    def caller(t: int) -> None:
        try:
            for r in range(rounds):
                lo = (t * rounds + r) * per
                ks = keys[lo:lo + per]
                cache.put(ks, data[lo:lo + per])
                cache.offload(ks)
                back = cache.get(ks[::-1])
                if not np.array_equal(back, data[lo:lo + per][::-1]):
                    raise AssertionError(f"thread {t} round {r}: wrong bytes")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    cache.close()
    assert not errors, errors
    with TierCache(cfg) as again:
        order = rng.permutation(len(keys))
        assert np.array_equal(again.get([keys[i] for i in order]), data[order])


def test_row_jobs_with_help_run_their_io_in_the_waiting_thread(tmp_path, rng, native_threads_seen):
    """RowJobs(help=True) (what the SGLang backend uses): after a first store and load, the
    waiting thread makes most of the native calls of the stores and loads it waits for; the
    rows come back exact, a damaged file still fails its page alone, and help() of a job that
    is done or unknown does nothing."""
    import os

    from tiercache import RowStore
    from tiercache.arrays import aligned_empty
    from tiercache.files import block_relpath
    from tiercache.integrations.rowjobs import RowJobs

    n, bs = 16, 8192
    rows = aligned_empty(2 * n * bs).reshape(2 * n, bs)
    jobs = RowJobs(help=True)
    me, mine = threading.current_thread().name, []
    with RowStore(rows, tmp_path / "rs", capacity_blocks=8 * n, on_finish=jobs.finished_hook) as st:
        jobs.attach(st)
        for r in range(4):
            want = rng.integers(0, 256, (n, bs), dtype=np.uint8)
            rows[:n] = want
            keys = [os.urandom(16) for _ in range(n)]
            del native_threads_seen[:]
            assert jobs.wait(jobs.submit(st.submit_store, keys, list(range(n)))).success
            if r == 3:  # damage one page's file: that page alone fails
                path = tmp_path / "rs" / block_relpath(keys[5], "kv")
                data = bytearray(path.read_bytes())
                data[-1] ^= 0xFF
                path.write_bytes(bytes(data))
            res = jobs.wait(jobs.submit(st.submit_load, keys, list(range(n, 2 * n))))
            good = [i for i in range(n) if not (r == 3 and i == 5)]
            assert set(res.failed) == ({keys[5]} if r == 3 else set())
            assert np.array_equal(rows[n:][good], want[good])
            if r:
                mine.append(native_threads_seen.count(me) / len(native_threads_seen))
            st.help(res.job_id)  # done: nothing to run
        st.help("no such job")
    assert np.mean(mine) >= 0.5, mine
