"""The transfer engine on host and file tiers (no GPU needed): validation, jobs, ordering of
file I/O against host-slot reuse, partial copies, and a randomized workload."""

from __future__ import annotations

import re

import numpy as np
import pytest
from engine_model import Mirror

from tiercache import ArrayMismatchError, PoolSpec, SlotRangeError
from tiercache.files import FileTier, IOPath
from tiercache.memory import make_host_tier
from tiercache.settings import FileSettings, TransferSettings  # noqa: F401
from tiercache.transfer import TransferEngine
from tiercache.transfer.engine import SMALL_SLOTS


def make_engine(tmp_path, pools, host_slots=16, file_slots=16, ordering=True, host2=False):
    tiers = {"host": make_host_tier(host_slots, pools, pinned=False)}
    tiers["file"] = FileTier(pools, file_slots, IOPath("posix", "test"),
                             FileSettings(root=tmp_path / "root", fsync="none", io_threads=4))
    eng = TransferEngine(tiers, pools, ordering=ordering)
    eng.gpu = False  # these tests exercise the CPU paths even on GPU machines
    eng.launcher = None
    return eng


@pytest.fixture
def kvpool():
    return PoolSpec.kv(
        "kv", num_layers=2, kv_factor=2, num_kv_heads=3, tokens_per_block=8, head_dim=16, dtype="float16"
    )


def test_validation_before_anything_runs(tmp_path, kvpool, rng):
    eng = make_engine(tmp_path, (kvpool,))
    host = eng.tiers["host"].arrays["kv"]
    before = host.copy()
    cases = [
        (SlotRangeError, "source host slot 16 outside [0, 16)", lambda: eng.copy("host", [1, 16], "host", [2, 3])),
        (SlotRangeError, "destination host slot -1", lambda: eng.copy("host", [1, 2], "host", [3, -1])),
        (SlotRangeError, "slot 3 appears twice", lambda: eng.copy("host", [1, 2], "host", [3, 3])),
        (SlotRangeError, "2 destination slots for 3 blocks", lambda: eng.copy("host", [1, 2, 4], "host", [3, 5])),
        (SlotRangeError, "one key per block", lambda: eng.copy("host", [1], "file", [0])),
        (ArrayMismatchError, "num_tokens = -1", lambda: eng.copy("host", [1], "host", [2], num_tokens=-1)),
    ]
    for exc, frag, fn in cases:
        with pytest.raises(exc) as ei:
            fn()
        assert frag in str(ei.value)
    plain = PoolSpec("act", (64,), "float32")
    eng2 = make_engine(tmp_path / "b", (plain,))
    with pytest.raises(ArrayMismatchError, match="no token axis"):
        eng2.copy("host", [0], "host", [1], num_tokens=3)
    assert np.array_equal(host, before)
    assert eng.get_finished() == []


@pytest.mark.parametrize("n", [3, 40, SMALL_SLOTS, SMALL_SLOTS + 1, 700])
def test_slot_checks_of_short_and_long_requests(tmp_path, rng, n):
    """Slot lists up to SMALL_SLOTS are checked as Python ints, longer ones with NumPy: the same
    errors either way (the bad value named), and nothing copied; a good request copies exactly."""
    pool = PoolSpec("kv", (16,), "uint8")
    eng = make_engine(tmp_path, (pool,), host_slots=2 * n, ordering=False)
    host = eng.tiers["host"].arrays["kv"]
    host[:] = rng.integers(0, 256, size=host.shape, dtype=np.uint8)
    src = rng.permutation(n)
    dst = n + rng.permutation(n)
    before = host.copy()
    for bad_at, value, frag in ((int(rng.integers(n)), 2 * n, f"destination host slot {2 * n} outside [0, {2 * n})"),
                                (int(rng.integers(n)), -5, "destination host slot -5 outside")):
        d = dst.copy()
        d[bad_at] = value
        with pytest.raises(SlotRangeError, match=re.escape(frag)):
            eng.copy("host", src, "host", d)
    d = dst.copy()
    d[0] = d[-1]
    with pytest.raises(SlotRangeError, match=f"slot {int(d[0])} appears twice"):
        eng.copy("host", src, "host", d)
    assert np.array_equal(host, before)
    s = src.copy()
    s[0] = s[-1]  # a repeated source is allowed (one block copied to two places)
    eng.copy("host", s, "host", dst).wait()
    before[dst] = before[s]
    assert np.array_equal(host, before)


@pytest.mark.parametrize("layout", ["layer_major", "token_major"])
def test_cpu_partial_copy_matches_reference(tmp_path, rng, layout):
    pool = PoolSpec.kv("kv", num_layers=3, kv_factor=2, num_kv_heads=2, tokens_per_block=16, head_dim=8,
                       dtype="bfloat16", layout=layout)
    eng = make_engine(tmp_path, (pool,), host_slots=8)
    host = eng.tiers["host"].arrays["kv"]
    host[:] = rng.integers(0, 256, size=host.shape, dtype=np.uint8)
    for n in (0, 1, 15, 16, 17):
        before = host.copy()
        eng.copy("host", [1, 2], "host", [5, 6], num_tokens=n).wait()
        exp = before.copy()
        ta = pool.token_axis
        typed_b = before.view(np.uint16).reshape(8, *pool.block_shape)
        typed_e = exp.view(np.uint16).reshape(8, *pool.block_shape)
        idx = [slice(None)] * len(pool.block_shape)
        idx[ta] = slice(0, min(n, 16))
        for s, d in ((1, 5), (2, 6)):
            typed_e[d][tuple(idx)] = typed_b[s][tuple(idx)]
        assert np.array_equal(host, exp), n


def test_jobs_report_bytes_seconds_direction(tmp_path, kvpool, rng):
    eng = make_engine(tmp_path, (kvpool,))
    data = {"kv": rng.integers(1, 256, size=(4, kvpool.block_nbytes), dtype=np.uint8)}
    j1 = eng.copy("caller", np.arange(4), "host", [3, 4, 5, 9], src_arrays=data)
    j2 = eng.copy("host", [3, 4, 5, 9], "file", [0, 1, 2, 3], keys=[10, 11, 12, 13])
    r2 = j2.wait()
    assert r2.direction == "offload" and r2.src == "host" and r2.dst == "file"
    assert r2.blocks == 4 and r2.nbytes == 4 * kvpool.block_nbytes and r2.seconds > 0 and r2.path == "POSIX"
    j3 = eng.copy("file", [0, 1, 2, 3], "host", [12, 13, 14, 15], keys=[10, 11, 12, 13])
    eng.synchronize()
    done = {r.job_id: r for r in eng.get_finished()}
    assert {j1.id, j2.id, j3.id} <= set(done)
    assert done[j3.id].direction == "onboard" and done[j1.id].direction == "put"
    assert eng.get_finished() == []
    assert np.array_equal(eng.tiers["host"].arrays["kv"][12:16], data["kv"])


@pytest.mark.parametrize("ordering", [True, False])
def test_hazard_reusing_a_host_slot_a_file_write_still_reads(tmp_path, kvpool, rng, ordering):
    """Hazard (d) on the CPU path: evict a host slot while its file write is in flight and
    refill it at once. With ordering the refill waits; without, the file gets the new bytes."""
    eng = make_engine(tmp_path, (kvpool,), ordering=ordering)
    old = {"kv": rng.integers(1, 256, size=(1, kvpool.block_nbytes), dtype=np.uint8)}
    new = {"kv": rng.integers(1, 256, size=(1, kvpool.block_nbytes), dtype=np.uint8)}
    eng.copy("caller", [0], "host", [5], src_arrays=old).wait()
    eng.debug_file_delay_s = 0.3
    write = eng.copy("host", [5], "file", [0], keys=[77])
    eng.debug_file_delay_s = 0.0
    eng.copy("caller", [0], "host", [5], src_arrays=new)  # the slot, evicted, is reused
    write.wait()
    out = {"kv": np.empty_like(old["kv"])}
    eng.copy("file", [0], "caller", [0], keys=[77], dst_arrays=out).wait()
    if ordering:
        assert np.array_equal(out["kv"], old["kv"])
    else:  # the debug switch off shows the hazard: the file holds bytes it was never given
        assert np.array_equal(out["kv"], new["kv"])


def test_failed_read_fails_dependent_copy(tmp_path, kvpool, rng):
    eng = make_engine(tmp_path, (kvpool,))
    read = eng.copy("file", [3], "host", [2], keys=[999])  # no such file
    dep = eng.copy("host", [2], "host", [7])
    with pytest.raises(Exception):
        read.wait()
    res = dep.result() if dep.done() else (dep.wait_host() or dep.result())
    assert not res.ok and 0 in res.failed


def test_randomized_workload_host_file(tmp_path, rng):
    pools = (PoolSpec.kv("kv", num_layers=2, kv_factor=1, num_kv_heads=2, tokens_per_block=8, head_dim=4, dtype="int8"),
             PoolSpec.kv("k2", num_layers=1, kv_factor=2, num_kv_heads=1, tokens_per_block=8, head_dim=16,
                         dtype="float32", layout="token_major"))
    eng = make_engine(tmp_path, pools, host_slots=24, file_slots=12)
    m = Mirror(eng, rng)
    m.upload_all()
    for i in range(1500):
        m.random_op()
        if i % 500 == 499:
            assert m.check() == 0
    assert m.check() == 0
    assert m.ops > 1000


def test_finished_jobs_behind_a_slow_one_are_retired_and_reported(tmp_path, kvpool, rng):
    """Submissions retire finished jobs from the oldest on and stop at the first still running
    (a slow file write here); past REAP_ALL_AT pending jobs they retire every finished one, so
    the pending list stays bounded, and every job's result still reaches get_finished."""
    eng = make_engine(tmp_path, (kvpool,), host_slots=8)
    host = eng.tiers["host"].arrays["kv"]
    host[:] = rng.integers(1, 256, size=host.shape, dtype=np.uint8)
    eng.debug_file_delay_s = 5.0  # longer than the writes below take on a loaded 2-core machine
    slow = eng.copy("host", [0], "file", [0], keys=[int(rng.integers(1 << 40))])
    eng.debug_file_delay_s = 0.0
    n = 3 * TransferEngine.REAP_ALL_AT
    most = 0
    keys = rng.choice(1 << 40, n, replace=False) + 1
    for i in range(n):  # file writes (CPU copies retire everything at once: they wait on the host anyway)
        eng.copy("host", [1 + i % 7], "file", [1 + i % 15], keys=[int(keys[i])]).wait()
        most = max(most, len(eng._pending))
    assert not slow.done()
    assert TransferEngine.REAP_ALL_AT < most <= TransferEngine.REAP_ALL_AT + 1
    eng.synchronize()
    results = eng.get_finished()
    assert len(results) == n + 1 and len({r.job_id for r in results}) == n + 1
    assert sum(row["jobs"] for row in eng.transfer_stats.snapshot()) == n + 1
