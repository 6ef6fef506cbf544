"""Copy planning: runs against a per-block reference."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tiercache.copypaths import contiguous_runs


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=60))
def test_runs_cover_pairs_exactly(pairs):
    src = [a for a, _ in pairs]
    dst = [b for _, b in pairs]
    runs = contiguous_runs(src, dst)
    expanded = [(a + i, b + i) for a, b, n in zip(runs.src, runs.dst, runs.length) for i in range(n)]
    assert expanded == list(zip(src, dst))
    # maximal: two adjacent runs never continue each other
    for i in range(len(runs.src) - 1):
        end_s = runs.src[i] + runs.length[i]
        end_d = runs.dst[i] + runs.length[i]
        assert not (end_s == runs.src[i + 1] and end_d == runs.dst[i + 1])


def test_consecutive_batch_is_one_run():
    runs = contiguous_runs(np.arange(10, 500), np.arange(1000, 1490))
    assert runs.length.tolist() == [490]


def _decider(carveout_sms=0, staged_min_run_bytes=0, batch_min_bytes=256 << 10, offload=0):
    """A CopyLauncher's path decision without a GPU: only the attributes it reads."""
    import types

    from tiercache.copypaths import CopyLauncher, StagedCopier

    la = object.__new__(CopyLauncher)
    la.carveout_sms, la.staged_min_run_bytes, la.batch_min_bytes = carveout_sms, staged_min_run_bytes, batch_min_bytes
    la.offload_staged_min_run_bytes = offload
    la.staged = types.SimpleNamespace(host_runs=StagedCopier.host_runs)
    return la


def test_staged_choice_without_carveout():
    runs = np.arange(64)  # one 1 MiB run of 16 KiB blocks
    scattered = np.arange(0, 128, 2)
    off = _decider()
    assert not off._wants_staged(True, runs, 16 << 10) and not off._wants_staged(False, runs, 16 << 10)
    on = _decider(staged_min_run_bytes=512 << 10)
    assert on._wants_staged(True, runs, 16 << 10) and on._wants_staged(False, runs, 16 << 10)
    assert not on._wants_staged(True, scattered, 16 << 10)  # runs of one block: 16 KiB < 512 KiB
    assert not on._wants_staged(True, runs, 256 << 10)  # blocks this large go to the batched copy


def test_staged_choice_under_a_carveout():
    runs = np.arange(64)
    scattered = np.arange(0, 128, 2)
    la = _decider(carveout_sms=8)
    # device -> host never writes host memory from SMs (that slows compute on the other SMs)
    assert la._wants_staged(False, scattered, 16 << 10) and la._wants_staged(False, runs, 16 << 10)
    # host -> device stays on the bulk kernel unless staged_min_run_bytes asks for the staged path
    assert not la._wants_staged(True, runs, 16 << 10) and not la._wants_staged(True, scattered, 16 << 10)
    assert not la._wants_staged(False, runs, 256 << 10)  # large blocks: the batched copy already
    both = _decider(carveout_sms=8, staged_min_run_bytes=512 << 10)
    assert both._wants_staged(True, runs, 16 << 10) and not both._wants_staged(True, scattered, 16 << 10)


def test_offloads_with_host_runs_take_the_copy_engines():
    runs, short = np.arange(64), np.arange(0, 128, 2)
    la = _decider(offload=256 << 10)  # the default
    assert la._wants_staged(False, runs, 16 << 10)  # 1 MiB runs: copy engines write host memory
    assert not la._wants_staged(False, short, 16 << 10)  # 16 KiB runs: the bulk kernel
    assert not la._wants_staged(False, np.arange(8), 16 << 10)  # 128 KiB runs
    assert not la._wants_staged(True, runs, 16 << 10)  # onboards keep the bulk kernel
    both = _decider(offload=256 << 10, staged_min_run_bytes=64 << 10)
    assert both._wants_staged(False, np.arange(8), 16 << 10) and both._wants_staged(True, np.arange(8), 16 << 10)


def test_staged_runs_stop_at_chunks_and_allocations():
    from tiercache.copypaths import run_starts

    row = 4096
    # two allocations side by side in the address space: blocks 0-5 in one, 6-9 in the next
    host_at = 1_000_000 + np.arange(10) * row
    group = np.array([0] * 6 + [1] * 4)
    chunk_of = np.arange(10) // 4  # chunks of 4 blocks
    starts = run_starts(host_at, chunk_of, row, np.diff(group) != 0)
    assert starts.tolist() == [0, 4, 6, 8]
    # a gap in the addresses opens a run too; one group, one chunk
    gap = np.array([0, 1, 2, 5, 6, 9]) * row
    assert run_starts(gap, np.zeros(6, int), row, np.zeros(5, bool)).tolist() == [0, 3, 5]


def test_staged_copy_of_nothing_enqueues_nothing():
    """An empty batch returns before touching CUDA (no staging VRAM, no streams)."""
    from tiercache.copypaths import StagedCopier

    sc = StagedCopier(launcher=None)
    empty = np.zeros(0, dtype=np.int64)
    sc.copy_addrs(empty, empty, 4096, True, stream=None)
    assert sc._buf is None and sc._aux is None


def test_single_large_blocks_stay_off_the_per_block_memcpy():
    """Runs go to cudaMemcpyAsync from memcpy_min_bytes, but a lone block that the batched copy
    takes (row >= batch_min_bytes) stays there, whatever memcpy_min_bytes says."""
    from tiercache.copypaths import memcpy_runs

    #            run lengths: 1, 3, 1, 2 (blocks of 2 MiB)
    runs = contiguous_runs([0, 5, 6, 7, 9, 20, 21], [10, 0, 1, 2, 30, 40, 41])
    assert runs.length.tolist() == [1, 3, 1, 2]
    two_mib = 2 << 20
    assert memcpy_runs(runs, two_mib, two_mib, 128 << 10).tolist() == [False, True, False, True]
    assert memcpy_runs(runs, two_mib, 5 << 20, 128 << 10).tolist() == [False, True, False, False]
    # blocks below batch_min_bytes: a lone block long enough is its own run, as before
    assert memcpy_runs(runs, 64 << 10, 64 << 10, 128 << 10).tolist() == [True, True, True, True]
    assert memcpy_runs(runs, 64 << 10, 128 << 10, 128 << 10).tolist() == [False, True, False, True]


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=0, max_size=60, unique_by=lambda t: t[1]),
       st.sampled_from([1, 4, 16]))
def test_strided_runs_cover_every_row_once_with_constant_pitches(pairs, row):
    """Every (source, destination) pair lies in exactly one run; in a run the destinations
    are consecutive rows and the sources step by the run's pitch (>= row)."""
    from tiercache.copypaths.copyplan import strided_runs

    src = np.array([a * row for a, _ in pairs], dtype=np.int64)
    dst = np.array([b * row for _, b in pairs], dtype=np.int64)
    runs, sp, dp = strided_runs(src, dst, row)
    assert runs.length.sum() == len(pairs) and (sp >= row).all() and (dp >= row).all()
    assert ((sp == row) | (dp == row)).all()  # one side of every run is consecutive rows
    got = []
    for s0, d0, m, ps, pd in zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist(), sp.tolist(), dp.tolist()):
        got += [(s0 + i * ps, d0 + i * pd) for i in range(m)]
    assert sorted(got) == sorted(zip(src.tolist(), dst.tolist()))


def test_strided_runs_of_a_ring_layout():
    """Host blocks of 8 rows each, position p of block j going to row p * 32 + j: one run per
    position, source pitch 8 rows; a last block in a host slot of its own (a block the decode
    completed) is one more run, of its 8 rows, destination pitch 32 rows."""
    from tiercache.copypaths.copyplan import strided_runs

    row = 1 << 17
    src = [(j * 8 + p) * row for j in range(20) for p in range(8)] + [(50 * 8 + p) * row for p in range(8)]
    dst = [(p * 32 + j) * row for j in range(21) for p in range(8)]
    runs, sp, dp = strided_runs(src, dst, row)
    assert runs.length.tolist() == [20] * 8 + [8]
    assert sp.tolist() == [8 * row] * 8 + [row] and dp.tolist() == [row] * 8 + [32 * row]
