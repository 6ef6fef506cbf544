"""Driver calls packed once (tiercache.copypaths.driverlaunch): the bytes they move, against
CuPy's own launch of the same kernel; argument checks on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from tiercache.copypaths.driverlaunch import KernelCall


class _FakeKernel:
    class kernel:  # noqa: N801 - mimics RawKernel.kernel
        ptr = 0


@pytest.mark.parametrize("bad", [3, 3.0, np.float32(1), np.int16(2), "x"])
def test_kernel_call_refuses_arguments_it_cannot_pack(bad):
    with pytest.raises(TypeError, match="kernel argument"):
        KernelCall(_FakeKernel, (1,), (32,), (np.uint64(1), bad))


@pytest.mark.gpu
def test_driver_calls_move_the_bytes_cupy_would():
    import cupy

    from tiercache.copypaths import CopyLauncher
    from tiercache.copypaths.driverlaunch import MemcpyCall, MemsetCall
    from tiercache.copypaths.segments import Segments

    rng = np.random.default_rng()
    rows, row = 37, 4096
    src = cupy.asarray(rng.integers(0, 256, (rows, row), dtype=np.uint8))
    s_rows = rng.permutation(rows)[:20].astype(np.int64)
    d_rows = rng.permutation(rows)[:20].astype(np.int64)
    launcher = CopyLauncher(0)
    fn = launcher._kernels[16]
    seg = Segments(1, row, row)
    table = cupy.asarray(np.concatenate([s_rows * row, d_rows * row]))
    p = table.data.ptr
    args = (np.uint64(src.data.ptr), np.uint64(0), np.uint64(p), np.uint64(p + 8 * s_rows.size),
            np.int64(s_rows.size), np.int64(seg.segs), np.int64(seg.seg_stride), np.int64(seg.seg_bytes))
    stream = cupy.cuda.Stream(non_blocking=True)
    outs = []
    for how in ("cupy", "driver"):
        dst = cupy.zeros((rows, row), dtype=np.uint8)
        a = (*args[:1], np.uint64(dst.data.ptr), *args[2:])
        if how == "cupy":
            fn((4,), (launcher.threads,), a, stream=stream)
        else:
            KernelCall(fn, (4,), (launcher.threads,), a)(stream)
        stream.synchronize()
        outs.append(cupy.asnumpy(dst))
    assert np.array_equal(outs[0], outs[1])
    assert np.array_equal(outs[1][d_rows], cupy.asnumpy(src)[s_rows])

    buf = cupy.asarray(rng.integers(1, 256, 1000, dtype=np.uint8))
    MemsetCall(buf.data.ptr + 100, 300)(stream)
    host = cupy.cuda.alloc_pinned_memory(1000)
    pinned = np.frombuffer(host, dtype=np.uint8, count=1000)
    pinned[:] = rng.integers(0, 256, 1000, dtype=np.uint8)
    MemcpyCall(buf.data.ptr + 500, pinned.ctypes.data + 10, 200)(stream)
    stream.synchronize()
    got = cupy.asnumpy(buf)
    assert not got[100:400].any()
    assert np.array_equal(got[500:700], pinned[10:210])


def test_2d_copies_refuse_pitches_below_the_width():
    from tiercache.copypaths.driverlaunch import Memcpy2DCall

    with pytest.raises(ValueError, match="pitches"):
        Memcpy2DCall(0, 64, 0, 32, 48, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("batched", [True, False])
def test_2d_copy_batches_move_strided_runs(batched):
    """Random 2-D copies (pinned host -> device, device -> device) in one batch land exactly
    the rows they name, in one cuMemcpy3DBatchAsync or one call each."""
    import cupy

    from tiercache.copypaths.driverlaunch import Memcpy2DBatch

    rng = np.random.default_rng()
    n = 1 << 20
    mem = cupy.cuda.alloc_pinned_memory(n)
    host = np.frombuffer(mem, dtype=np.uint8, count=n)
    host[:] = rng.integers(0, 256, n, dtype=np.uint8)
    dev_src = cupy.asarray(rng.integers(0, 256, n, dtype=np.uint8))
    dst = cupy.zeros(4 * n, dtype=np.uint8)
    copies, want = [], np.zeros(4 * n, dtype=np.uint8)
    for i in range(6):
        width = int(rng.integers(1, 5000))
        height = int(rng.integers(1, 20))
        sp, dp = width + int(rng.integers(0, 300)), width + int(rng.integers(0, 3000))
        s0 = int(rng.integers(0, n - sp * height))
        d0 = i * (n // 2) + int(rng.integers(0, n // 2 - dp * height))
        src_np, src_ptr = (host, host.ctypes.data) if i % 2 else (cupy.asnumpy(dev_src), dev_src.data.ptr)
        for r in range(height):
            want[d0 + r * dp: d0 + r * dp + width] = src_np[s0 + r * sp: s0 + r * sp + width]
        copies.append((dst.data.ptr + d0, dp, src_ptr + s0, sp, width, height))
    batch = Memcpy2DBatch(copies)
    if not batched:
        batch._fn = None
    stream = cupy.cuda.Stream(non_blocking=True)
    batch(stream)
    stream.synchronize()
    assert np.array_equal(cupy.asnumpy(dst), want)
    assert batch.nbytes == sum(c[4] * c[5] for c in copies)


@pytest.mark.gpu
@pytest.mark.parametrize("nbytes", [32 << 10, 4 << 10, 6, 256 << 10])
def test_copy_segments_scatters_and_gathers_between_addresses_exactly(nbytes):
    """CopyLauncher.copy_segments: random segments of a contiguous buffer to random places in
    two other allocations and back (as the vLLM connector's uploads and gathers do), every
    byte checked, every path (bulk, kernel at each alignment, batch for long segments)."""
    import cupy

    from tiercache.copypaths import CopyLauncher

    rng = np.random.default_rng()
    n = 97
    launcher = CopyLauncher(0)
    src = cupy.asarray(rng.integers(0, 256, n * nbytes, dtype=np.uint8))
    pools = [cupy.zeros(2 * n * nbytes, dtype=np.uint8) for _ in range(2)]
    where = rng.permutation(2 * n)[:n]
    pool_of = rng.integers(0, 2, n)
    dst = np.array([pools[p].data.ptr + w * nbytes for p, w in zip(pool_of, where)], dtype=np.int64)
    srcs = src.data.ptr + np.arange(n, dtype=np.int64) * nbytes
    stream = cupy.cuda.Stream(non_blocking=True)
    path = launcher.copy_segments(dst, srcs, nbytes, stream)
    back = cupy.zeros_like(src)
    launcher.copy_segments(back.data.ptr + np.arange(n, dtype=np.int64) * nbytes, dst, nbytes, stream)
    stream.synchronize()
    got = cupy.asnumpy(src).reshape(n, nbytes)
    for i, (p, w) in enumerate(zip(pool_of, where)):
        assert cupy.asnumpy(pools[p][w * nbytes:(w + 1) * nbytes]).tobytes() == got[i].tobytes(), (i, path)
    assert cupy.asnumpy(back).tobytes() == cupy.asnumpy(src).tobytes()
    assert launcher.copy_segments(dst[:0], srcs[:0], nbytes, stream) == "none"
    with pytest.raises(ValueError, match="lengths must match"):
        launcher.copy_segments(dst, srcs[:3], nbytes, stream)


def test_a_plans_table_holds_each_launchs_addresses_and_zeroed_counters():
    """plan_layout: every launch's sources, then every launch's destinations, then a zeroed
    counter area per launch; each launch's offsets point at its own addresses; the widest
    access is each launch's own; bad lengths are refused."""
    from tiercache.copypaths.segmentplan import plan_layout

    rng = np.random.default_rng()
    copies = []
    for nbytes, align in ((32 << 10, 16), (6, 2), (4 << 10, 8), (64, 16)):
        n = int(rng.integers(1, 50))
        # addresses aligned to exactly ``align`` bytes (16: any 16-byte boundary)
        copies.append((rng.integers(1, 1 << 36, n) * 16 + align % 16, rng.integers(1, 1 << 36, n) * 16 + align % 16,
                       nbytes))
    table, launches = plan_layout(copies, sm_slots=7)
    total = sum(len(d) for d, _, _ in copies)
    assert table.dtype == np.int64 and table.size == 2 * total + 8 * len(copies)
    words = table.view(np.uint8)
    for (dst, src, nbytes), p in zip(copies, launches):
        assert p.n == len(src) and p.nbytes == nbytes
        assert words[p.src:p.src + 8 * p.n].view(np.int64).tolist() == list(src)
        assert words[p.dst:p.dst + 8 * p.n].view(np.int64).tolist() == list(dst)
        assert not words[p.counters:p.counters + 8 * 8].any()
    # each launch's own addresses and length bound its access: 6 bytes -> 1, 8-byte addresses -> 8
    assert [p.vec for p in launches] == [16, 1, 8, 16]
    empty, _ = plan_layout([(np.zeros(0), np.zeros(0), 64)], 7)
    assert empty.size == 8
    with pytest.raises(ValueError, match="lengths must match"):
        plan_layout([(np.zeros(3), np.zeros(2), 8)], 7)
    with pytest.raises(ValueError, match="nbytes >= 1"):
        plan_layout([(np.zeros(3), np.zeros(3), 0)], 7)


@pytest.mark.gpu
def test_planned_scatters_move_the_bytes_copy_segments_would():
    """CopyLauncher.plan_segments: the launches of one plan, issued one by one on a stream,
    place every segment where copy_segments would; segments the batch path takes are not
    planned."""
    import cupy

    from tiercache.copypaths import CopyLauncher

    rng = np.random.default_rng()
    launcher = CopyLauncher(0)
    stream = cupy.cuda.Stream(non_blocking=True)
    nbytes, n, pieces = 32 << 10, 24, 5
    src = cupy.asarray(rng.integers(0, 256, pieces * n * nbytes, dtype=np.uint8))
    pool = cupy.zeros(4 * pieces * n * nbytes, dtype=np.uint8)
    where = rng.permutation(4 * pieces * n)[:pieces * n].reshape(pieces, n)
    copies = [(pool.data.ptr + where[k].astype(np.int64) * nbytes,
               src.data.ptr + (k * n + np.arange(n, dtype=np.int64)) * nbytes, nbytes) for k in range(pieces)]
    plan = launcher.plan_segments(copies, stream)
    assert plan is not None
    for k in rng.permutation(pieces).tolist():
        assert plan.launch(k, stream) in ("bulk", "kernel")
    plan.done(stream)
    stream.synchronize()
    got = cupy.asnumpy(src).reshape(pieces * n, nbytes)
    flat = where.reshape(-1)
    for i in range(pieces * n):
        assert cupy.asnumpy(pool[flat[i] * nbytes:(flat[i] + 1) * nbytes]).tobytes() == got[i].tobytes(), i
    big = launcher.batch_min_bytes
    assert launcher.plan_segments([(copies[0][0][:1], copies[0][1][:1], big)], stream) is None
