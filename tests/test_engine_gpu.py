"""The transfer engine on the GPU: the four hazards (each shown to corrupt bytes with ordering
switched off and to be safe with it on), partial copies against NumPy, a 100,000-operation
randomized workload against a mirror, and the two sync points with PyTorch streams."""

from __future__ import annotations

import os

import numpy as np
import pytest
from engine_model import Mirror
from helpers import partial_round_trip

from tiercache import PoolSpec
from tiercache.files import FileTier, select_io_path
from tiercache.memory import make_device_tier, make_host_tier
from tiercache.settings import FileSettings, TransferSettings  # noqa: F401
from tiercache.transfer import TransferEngine

pytestmark = pytest.mark.gpu
DELAY_NS = 80_000_000  # 80 ms: the first copy of each hazard is still in flight


def make_engine(tmp_path, pools, device_slots=16, host_slots=16, file_slots=16, ordering=True, **kw):
    tiers = {"device": make_device_tier(device_slots, pools), "host": make_host_tier(host_slots, pools)}
    if file_slots:
        tiers["file"] = FileTier(pools, file_slots, select_io_path("auto"),
                                 FileSettings(root=tmp_path / "root", fsync="none", io_threads=4))
    settings = TransferSettings(**{"copy_kernel_sms": None, "streams_per_direction": 2, **kw})
    return TransferEngine(tiers, pools, ordering=ordering, settings=settings)


@pytest.fixture
def pool():
    return PoolSpec.kv(
        "kv", num_layers=4, kv_factor=2, num_kv_heads=4, tokens_per_block=16, head_dim=64, dtype="bfloat16"
    )


def fill(eng, tier, slot, rng, pool):
    data = {pool.name: rng.integers(1, 256, size=(1, pool.block_nbytes), dtype=np.uint8)}
    eng.copy("caller", [0], tier, [slot], src_arrays=data).wait()
    return data[pool.name][0]


def read(eng, tier, slot, pool, key=None):
    out = {pool.name: np.empty((1, pool.block_nbytes), np.uint8)}
    eng.copy(tier, [slot], "caller", [0], keys=None if key is None else [key], dst_arrays=out).wait()
    return out[pool.name][0]


def race(eng, first, second, file_delay: bool = False) -> None:
    """Run ``first`` (a copy kept in flight by a debug delay), then ``second`` at once; wait."""
    if file_delay:
        eng.debug_file_delay_s = 0.3
    else:
        eng.debug_delay_ns = DELAY_NS
    first()
    eng.debug_delay_ns, eng.debug_file_delay_s = 0, 0.0
    second()
    eng.synchronize()


@pytest.mark.parametrize("ordering", [True, False])
def test_hazard_two_offloads_into_one_host_slot(tmp_path, rng, pool, ordering):
    eng = make_engine(tmp_path, (pool,), ordering=ordering)
    x, y = fill(eng, "device", 0, rng, pool), fill(eng, "device", 1, rng, pool)
    race(eng, lambda: eng.copy("device", [0], "host", [5]),   # first offload, slow
         lambda: eng.copy("device", [1], "host", [5]))        # second offload into the same slot
    got = read(eng, "host", 5, pool)
    assert np.array_equal(got, y) if ordering else np.array_equal(got, x)


@pytest.mark.parametrize("ordering", [True, False])
def test_hazard_onboard_from_slot_still_being_written(tmp_path, rng, pool, ordering):
    eng = make_engine(tmp_path, (pool,), ordering=ordering)
    x = fill(eng, "device", 0, rng, pool)
    stale = fill(eng, "host", 5, rng, pool)
    race(eng, lambda: eng.copy("device", [0], "host", [5]),   # offload in flight
         lambda: eng.copy("host", [5], "device", [3]))        # onboard from the slot being written
    got = read(eng, "device", 3, pool)
    assert np.array_equal(got, x) if ordering else np.array_equal(got, stale)


@pytest.mark.parametrize("ordering", [True, False])
def test_hazard_partial_copy_from_block_being_onboarded(tmp_path, rng, pool, ordering):
    eng = make_engine(tmp_path, (pool,), ordering=ordering)
    x = fill(eng, "host", 5, rng, pool)
    stale = fill(eng, "device", 2, rng, pool)
    dst_before = fill(eng, "device", 7, rng, pool)
    race(eng, lambda: eng.copy("host", [5], "device", [2]),                   # onboard in flight
         lambda: eng.copy("device", [2], "device", [7], num_tokens=5))       # partial reuse of it
    got = read(eng, "device", 7, pool).view(np.uint16).reshape(pool.block_shape)
    src = (x if ordering else stale).view(np.uint16).reshape(pool.block_shape)
    assert np.array_equal(got[:, :, :, :5], src[:, :, :, :5])
    assert np.array_equal(got[:, :, :, 5:], dst_before.view(np.uint16).reshape(pool.block_shape)[:, :, :, 5:])


@pytest.mark.parametrize("ordering", [True, False])
def test_hazard_evicting_host_slot_a_file_write_reads(tmp_path, rng, pool, ordering):
    eng = make_engine(tmp_path, (pool,), ordering=ordering)
    x = fill(eng, "host", 5, rng, pool)
    y = fill(eng, "device", 1, rng, pool)
    race(eng, lambda: eng.copy("host", [5], "file", [0], keys=[1234]),   # file write reading host slot 5
         lambda: eng.copy("device", [1], "host", [5]), file_delay=True)  # slot 5 evicted, refilled at once
    got = read(eng, "file", 0, pool, key=1234)
    assert np.array_equal(got, x) if ordering else np.array_equal(got, y)


DTYPES = ["float32", "float16", "bfloat16", "int8", "float8_e4m3fn"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["layer_major", "token_major"])
def test_partial_copies_match_numpy(tmp_path, rng, dtype, layout):
    pool = PoolSpec.kv("kv", num_layers=3, kv_factor=2, num_kv_heads=2, tokens_per_block=16,
                       head_dim=int(rng.choice([8, 24, 64])), dtype=dtype, layout=layout)
    eng = make_engine(tmp_path, (pool,), device_slots=12, host_slots=12, file_slots=0)
    ta = pool.token_axis
    for n in (0, 1, 15, 16, 40):
        for src, dst in (("host", "device"), ("device", "host"), ("device", "device")):
            init = {t: rng.integers(0, 256, size=(12, pool.block_nbytes), dtype=np.uint8) for t in ("device", "host")}
            for t in init:
                eng.copy("caller", np.arange(12), t, np.arange(12), src_arrays={"kv": init[t]}).wait()
            s = rng.choice(12, size=5, replace=False)
            d = rng.choice(np.setdiff1d(np.arange(12), s) if src == dst else np.arange(12), size=5, replace=False)
            eng.copy(src, s, dst, d, num_tokens=n).wait()
            exp = init[dst].copy()
            sv = init[src].reshape(12, *pool.block_shape, pool.itemsize)
            ev = exp.reshape(12, *pool.block_shape, pool.itemsize)
            idx = [slice(None)] * (len(pool.block_shape) + 1)
            idx[ta] = slice(0, min(n, 16))
            for a, b in zip(s, d):
                ev[b][tuple(idx)] = sv[a][tuple(idx)]
            out = {"kv": np.empty_like(exp)}
            eng.copy(dst, np.arange(12), "caller", np.arange(12), dst_arrays=out).wait()
            assert np.array_equal(out["kv"], exp), (n, src, dst)


def test_path_choice_and_bounded_sms(tmp_path, rng):
    pool = PoolSpec("blk", (1 << 20,), "uint8")  # 1 MiB blocks
    eng = make_engine(tmp_path, (pool,), device_slots=8, host_slots=8, file_slots=0, memcpy_min_bytes=2 << 20,
                      batch_min_bytes=4 << 20, copy_kernel_sms=2)
    eng.launcher.staged_min_run_bytes = 1 << 40  # staged path off here; test_staged_path_* covers it
    assert eng.launcher.max_sms == 2
    data = rng.integers(0, 256, size=(8, pool.block_nbytes), dtype=np.uint8)
    eng.copy("caller", np.arange(8), "host", np.arange(8), src_arrays={"blk": data}).wait()
    sm = "bulk" if eng.launcher.bulk_available else "kernel"  # TMA bulk copies on sm_90+
    assert eng.copy("host", [0, 1, 2], "device", [4, 5, 6]).wait().path == "memcpy"     # one 3 MiB run
    assert eng.copy("host", [7, 3], "device", [0, 2]).wait().path == sm                 # scattered 1 MiB blocks
    assert eng.copy("host", [0, 1, 5], "device", [1, 2, 7]).wait().path == f"{sm}+memcpy"
    out = {"blk": np.empty((8, pool.block_nbytes), np.uint8)}
    eng.copy("device", np.arange(8), "caller", np.arange(8), dst_arrays=out).wait()
    exp = {4: 0, 5: 1, 6: 2, 0: 7, 1: 0, 2: 1, 7: 5}  # the third copy overwrote slot 2
    assert eng.launcher.batch_min_bytes == 4 << 20
    eng.launcher.batch_min_bytes = 1 << 20  # now scattered 1 MiB blocks go to the copy engines
    want = "batch" if eng.launcher.batch.available else "memcpy"
    assert eng.copy("device", [4, 6], "host", [0, 7]).wait().path == want
    eng.launcher.memcpy_min_bytes = 1 << 20  # a lone block the batched copy takes is no "run" ...
    assert eng.copy("host", [5], "device", [3]).wait().path == want
    assert eng.copy("host", [3, 4], "device", [5, 6]).wait().path == "memcpy"  # ... two in a row are
    host = eng.tiers["host"].arrays["blk"]
    assert np.array_equal(host[0], data[0]) and np.array_equal(host[7], data[2])
    for d, s_ in exp.items():
        assert np.array_equal(out["blk"][d], data[s_]), d


@pytest.mark.parametrize("staged", [False, True])
def test_randomized_workload_100k_ops(tmp_path, rng, staged):
    """100,000 random operations (TIERCACHE_STRESS_OPS) against the mirror; ``staged``: a fifth
    as many with every whole-block host <-> device batch forced through the staged path (its
    auxiliary streams under the same ordering), which these small blocks never reach otherwise."""
    n_ops = int(os.environ.get("TIERCACHE_STRESS_OPS", "100000")) // (5 if staged else 1)
    pools = (
        PoolSpec.kv("kv", num_layers=2, kv_factor=2, num_kv_heads=2, tokens_per_block=8, head_dim=16, dtype="float16"),
        PoolSpec.kv(
            "mla",
            num_layers=2,
            kv_factor=1,
            num_kv_heads=1,
            tokens_per_block=8,
            head_dim=24,
            dtype="int8",
            layout="token_major",
        ),
    )
    eng = make_engine(tmp_path, pools, device_slots=48, host_slots=48, file_slots=16)
    if staged:
        eng.launcher.staged_min_run_bytes = eng.launcher.offload_staged_min_run_bytes = 1
        eng.launcher.staged.chunk_bytes = 4 * pools[0].block_nbytes  # many chunks, every buffer reused
    m = Mirror(eng, rng)
    m.upload_all()
    checks = 0
    while m.ops < n_ops:
        m.random_op()
        if m.ops % 20000 == 0:
            assert m.check() == 0, f"mismatch after {m.ops} ops"
            checks += 1
    assert m.check() == 0
    results = eng.get_finished()
    assert all(r.ok for r in results)
    print(f"{m.ops} ops, {checks + 1} full checks, 0 mismatches")


def test_sync_points_with_torch_streams(tmp_path, rng, pool):
    """The engine's compute stream writes a block and it is offloaded at once; then an onboard is
    consumed on the compute stream. Without the sync points these race."""
    torch = pytest.importorskip("torch")
    import cupy

    eng = make_engine(tmp_path, (pool,), file_slots=0)
    dev = eng.tiers["device"].arrays["kv"]
    compute = torch.cuda.Stream()
    tdev = torch.as_tensor(dev, device="cuda")  # zero-copy view of the device tier
    for trial in range(3):
        with torch.cuda.stream(compute):
            torch.cuda._sleep(50_000_000)  # a long kernel before the write
            tdev[3].fill_(trial + 7)
        eng.wait_for_stream(compute)
        eng.copy("device", [3], "host", [9]).wait()
        assert (eng.tiers["host"].arrays["kv"][9] == trial + 7).all()
        # onboard, then read on the compute stream after make_stream_wait
        eng.tiers["host"].arrays["kv"][10] = trial + 100
        eng.debug_delay_ns = 50_000_000
        job = eng.copy("host", [10], "device", [4])
        eng.debug_delay_ns = 0
        eng.make_stream_wait(compute)
        with torch.cuda.stream(compute):
            total = tdev[4].to(torch.int64).sum()
        compute.synchronize()
        assert int(total) == (trial + 100) * pool.block_nbytes
        job.wait()
    # CuPy streams and raw handles are accepted too
    s = cupy.cuda.Stream(non_blocking=True)
    eng.wait_for_stream(s)
    eng.make_stream_wait(s.ptr)


@pytest.mark.parametrize("carveout", [0, 3])
@pytest.mark.parametrize("n_blocks", [1, 7, 300])
def test_staged_path_round_trip(tmp_path, rng, n_blocks, carveout):
    """Host runs <-> scattered device slots through the staging buffer, chunked, over two
    copy-engine streams (tiny chunks here, so many chunks reuse every buffer); with a carve-out
    the VRAM hop stays on 3 SMs."""
    pool = PoolSpec("blk", (4096 + 512,), "uint8")
    eng = make_engine(tmp_path, (pool,), device_slots=320, host_slots=320, file_slots=0, carveout_sms=carveout)
    assert eng.launcher.staged.hop_all_sms == (not carveout) and eng.launcher.staged.pcie_streams == 2
    eng.launcher.staged.chunk_bytes = 5 * pool.block_nbytes
    eng.launcher.staged_min_run_bytes = 1
    data = rng.integers(0, 256, size=(320, pool.block_nbytes), dtype=np.uint8)
    eng.copy("caller", np.arange(320), "host", np.arange(320), src_arrays={"blk": data}).wait()
    start = int(rng.integers(0, 320 - n_blocks + 1))
    hs = np.arange(start, start + n_blocks)
    hs[: n_blocks // 2] = hs[: n_blocks // 2][::-1]  # runs in any order in the batch
    ds = rng.choice(320, size=n_blocks, replace=False)
    job = eng.copy("host", hs, "device", ds)
    assert job.wait().path == "staged"
    got = {"blk": np.empty((n_blocks, pool.block_nbytes), np.uint8)}
    eng.copy("device", ds, "caller", np.arange(n_blocks), dst_arrays=got).wait()
    assert np.array_equal(got["blk"], data[hs])
    # and back: scattered device -> other host runs
    hs2 = (hs + 1) % 320 if n_blocks < 320 else hs
    back = eng.copy("device", ds, "host", hs2).wait()
    assert back.path == "staged"
    assert np.array_equal(eng.tiers["host"].arrays["blk"][hs2], data[hs])


def test_carveout_paths_byte_exact(tmp_path, rng):
    """Under an SM carve-out: copy kernels stay on its SMs, host -> device blocks go to the bulk
    kernel (scattered or in runs), every device -> host batch to the staged path; bytes exact."""
    block, n = 16 << 10, 600
    pool = PoolSpec("blk", (block,), "uint8")
    eng = make_engine(tmp_path, (pool,), device_slots=n, host_slots=n, file_slots=0, carveout_sms=4)
    la = eng.launcher
    assert la.max_sms == la.bulk_sms == 4 and la.ctas_per_sm == 8 and not la.staged.hop_all_sms
    la.staged.chunk_bytes = 64 * block  # several chunks per batch: every staging buffer reused
    data = rng.integers(1, 256, size=(n, block), dtype=np.uint8)
    eng.copy("caller", np.arange(n), "host", np.arange(n), src_arrays={"blk": data}).wait()
    host = eng.tiers["host"].arrays["blk"]
    sm = "bulk" if la.bulk_available else "kernel"

    def device_rows(ds):
        out = {"blk": np.empty((len(ds), block), np.uint8)}
        eng.copy("device", ds, "caller", np.arange(len(ds)), dst_arrays=out).wait()
        return out["blk"]
    hs = rng.permutation(n)[:300]  # scattered host slots
    perm = rng.permutation(n)
    ds, ds2 = perm[:300], perm[300:]  # disjoint scattered device slots
    assert eng.copy("host", hs, "device", ds).wait().path == sm
    assert np.array_equal(device_rows(ds), data[hs])
    runs = np.arange(150, 450)  # one 4.7 MiB host run, device slots scattered
    assert eng.copy("host", runs, "device", ds2).wait().path == sm
    assert np.array_equal(device_rows(ds2), data[runs])
    # device -> host, scattered and into runs: the staged path (copy engines write host memory)
    back = rng.permutation(n)[:300]
    assert eng.copy("device", ds2, "host", back).wait().path == "staged"
    assert np.array_equal(host[back], data[runs])
    assert eng.copy("device", ds, "host", np.arange(300)).wait().path == "staged"
    assert np.array_equal(host[:300], data[hs])


def test_upload_ring_wraps_without_clobbering(rng):
    import cupy

    from tiercache.copypaths import UploadRing

    ring = UploadRing(0, nbytes=4096)
    stream = cupy.cuda.Stream(non_blocking=True)
    outs, wants = [], []
    for i in range(60):
        arr = rng.integers(0, 1 << 40, size=int(rng.integers(1, 200)), dtype=np.int64)
        dev = ring.upload(arr, stream)
        out = cupy.empty_like(dev)
        with stream:
            out[...] = dev * 1  # a "kernel" reading the upload, on the stream
        ring.release(stream)
        outs.append(out)
        wants.append(arr)
    stream.synchronize()
    for out, want in zip(outs, wants):
        assert np.array_equal(out.get(), want)


@pytest.mark.parametrize("force", ["bulk-small", "bulk-large", "kernel"])
@pytest.mark.parametrize("nbytes", [16, 4096 + 48, 16384, 16384 * 3 + 512, 40_002])
def test_bulk_and_sm_kernels_byte_exact(rng, force, nbytes):
    """Both SM-driven paths (TMA bulk copies in both shapes, the gather/scatter kernel) move
    random scattered blocks host -> device -> device -> host exactly, including sizes that are
    not whole multiples of the bulk piece or of 16 bytes (those fall back to the kernel)."""
    import cupy

    from tiercache.copypaths import CopyLauncher, Segments
    from tiercache.memory import alloc_host

    shape = force.split("-")[1] if "-" in force else "small"
    force = force.split("-")[0]
    la = CopyLauncher(0, max_sms=3, bulk_shape=shape, bulk_ctas_per_sm=2)
    if force == "bulk" and not la.bulk_available:
        pytest.skip("bulk copies need compute capability 9.0")
    n = 37
    src, _o1 = alloc_host(n * nbytes, pinned=True)
    src = src.reshape(n, nbytes)
    src[:] = rng.integers(1, 256, size=src.shape, dtype=np.uint8)
    back, _o2 = alloc_host(n * nbytes, pinned=True)
    back = back.reshape(n, nbytes)
    back[:] = 0
    dev, dev2 = cupy.zeros((n, nbytes), cupy.uint8), cupy.zeros((n, nbytes), cupy.uint8)
    p1, p2, p3, p4 = (rng.permutation(n) for _ in range(4))
    seg = Segments(1, nbytes, nbytes)
    st = cupy.cuda.Stream(non_blocking=True)
    paths = {la.launch(src, p1, dev, p2, seg, st, force=force), la.launch(dev, p2, dev2, p3, seg, st, force=force),
             la.launch(dev2, p3, back, p4, seg, st, force=force)}
    st.synchronize()
    assert np.array_equal(back[p4], src[p1])
    want = "bulk" if force == "bulk" and nbytes % 16 == 0 else "kernel"
    assert paths == {want}


@pytest.mark.parametrize("shape", ["small", "large"])
@pytest.mark.parametrize("segs,seg_stride,seg_bytes", [(64, 4096, 256), (12, 8192, 4096), (5, 16384, 9216),
                                                       (3, 48, 32), (1, 40_000, 39_984)])
def test_bulk_segments_match_numpy(rng, shape, segs, seg_stride, seg_bytes):
    """The bulk kernel's segmented copies (the first tokens of each block: ``segs`` pieces of
    ``seg_bytes``, ``seg_stride`` apart; short segments packed several to a buffer, long ones
    cut into pieces) write exactly those bytes of random scattered blocks, host -> device and
    device -> host, and leave the rest of each destination block untouched."""

    from tiercache.copypaths import CopyLauncher, Segments
    from tiercache.memory import alloc_host

    la = CopyLauncher(0, max_sms=5, bulk_shape=shape)
    if not la.bulk_available:
        pytest.skip("bulk copies need compute capability 9.0")
    n, row = 29, segs * seg_stride
    src, _o1 = alloc_host(n * row, pinned=True)
    back, _o2 = alloc_host(n * row, pinned=True)
    seg = Segments(segs, seg_stride, seg_bytes)
    assert partial_round_trip(la, seg, src.reshape(n, row), back.reshape(n, row), rng, 23, force="bulk") == {"bulk"}


@pytest.mark.parametrize("row", [4096, 48, 256 * 1024])
def test_launch_many_merges_pools_into_one_launch(rng, row):
    """Several pools' row copies go out as one launch (absolute addresses) and land exactly;
    mixed row sizes fall back to one launch per pool."""
    import cupy

    from tiercache.copypaths import CopyLauncher, Segments
    from tiercache.memory import alloc_host
    from tiercache.transfer import RowCopy

    la = CopyLauncher(0, max_sms=4)
    n, pools = 24, 3
    hosts = []
    for _ in range(pools):
        h, owner = alloc_host(n * row, pinned=True)
        h = h.reshape(n, row)
        h[:] = rng.integers(1, 256, size=h.shape, dtype=np.uint8)
        hosts.append((h, owner))
    devs = [cupy.zeros((n, row), cupy.uint8) for _ in range(pools)]
    seg = Segments(1, row, row)
    perms = [(rng.permutation(n)[:16], rng.permutation(n)[:16]) for _ in range(pools)]
    copies = [RowCopy(h, s, d, t, seg) for (h, _), d, (s, t) in zip(hosts, devs, perms)]
    st = cupy.cuda.Stream(non_blocking=True)
    path = la.launch_many(copies, st)
    st.synchronize()
    for (h, _), d, (s, t) in zip(hosts, devs, perms):
        assert np.array_equal(d[t].get(), h[s])
    want = "batch" if row >= la.batch_min_bytes and la.batch.available else (
        "bulk" if la.bulk_available and row % 16 == 0 else "kernel")
    assert path == want
    # another row size: no merge (one launch per pool), still exact
    h2, _o = alloc_host(n * (row + 16), pinned=True)
    h2 = h2.reshape(n, row + 16)
    h2[:] = rng.integers(1, 256, size=h2.shape, dtype=np.uint8)
    odd = cupy.zeros((n, row + 16), cupy.uint8)
    for d in devs:
        d[...] = 0
    s2, t2 = rng.permutation(n)[:10], rng.permutation(n)[:10]
    la.launch_many([copies[0], RowCopy(h2, s2, odd, t2, Segments(1, row + 16, row + 16))], st)
    st.synchronize()
    (h, _), (s, t) = hosts[0], perms[0]
    assert np.array_equal(devs[0][t].get(), h[s]) and np.array_equal(odd[t2].get(), h2[s2])


@pytest.mark.parametrize("offload_min", [256 << 10, 0])
def test_offload_of_several_pools_into_host_runs(rng, offload_min):
    """Device -> host of three pools' blocks into runs of host rows: one staged copy for all
    pools (copy engines write host memory) by default, the bulk/gather kernel with the threshold
    off; the bytes land exactly either way, and host rows outside the copy stay untouched."""
    import cupy

    from tiercache.copypaths import CopyLauncher, Segments
    from tiercache.memory import alloc_host
    from tiercache.transfer import RowCopy

    row, n, pools = 16 << 10, 96, 3
    la = CopyLauncher(0, max_sms=4, offload_staged_min_run_bytes=offload_min)
    la.staged.chunk_bytes = 40 * row  # several chunks, every staging buffer reused
    hosts, keep, devs, copies = [], [], [], []
    for _ in range(pools):
        h, owner = alloc_host(n * row, pinned=True)
        h = h.reshape(n, row)
        h[:] = 7
        hosts.append(h)
        keep.append(owner)
        dev = cupy.asarray(rng.integers(1, 256, size=(n, row), dtype=np.uint8))
        devs.append(dev)
        src, dst = rng.permutation(n)[:80], np.arange(8, 88)  # one 1.25 MiB run of host rows
        copies.append(RowCopy(dev, src, h, dst, Segments(1, row, row)))
    st = cupy.cuda.Stream(non_blocking=True)
    path = la.launch_many(copies, st)
    st.synchronize()
    assert path == ("staged" if offload_min else ("bulk" if la.bulk_available else "kernel"))
    for h, dev, c in zip(hosts, devs, copies):
        assert np.array_equal(h[c.dst_rows], dev[c.src_rows].get())
        assert (h[:8] == 7).all() and (h[88:] == 7).all()


def test_offload_without_staging_vram_falls_back(tmp_path, rng, monkeypatch):
    """When the staging buffers cannot be allocated (an engine took the VRAM), offloads into host
    runs warn once and go by the kernel paths; the bytes still land."""
    import cupy

    from tiercache.copypaths import StagedCopier

    def no_vram(self):
        raise cupy.cuda.memory.OutOfMemoryError(64 << 20, 0)
    monkeypatch.setattr(StagedCopier, "_setup", no_vram)
    block = 16 << 10
    pool = PoolSpec("blk", (block,), "uint8")
    eng = make_engine(tmp_path, (pool,), device_slots=64, host_slots=64, file_slots=0)
    data = rng.integers(1, 256, size=(64, block), dtype=np.uint8)
    eng.copy("caller", np.arange(64), "host", np.arange(64), src_arrays={"blk": data}).wait()
    ds = rng.permutation(64)[:40]
    eng.copy("host", np.arange(40), "device", ds).wait()
    with pytest.warns(RuntimeWarning, match="no VRAM for the staged path"):
        job = eng.copy("device", ds, "host", np.arange(20, 60))  # a 640 KiB host run
    assert job.wait().path in ("bulk", "kernel")
    assert not eng.launcher.staged.available
    assert np.array_equal(eng.tiers["host"].arrays["blk"][20:60], data[:40])
    assert eng.copy("device", ds, "host", np.arange(20, 60)).wait().path in ("bulk", "kernel")  # no second warning


@pytest.mark.parametrize("layout,num_tokens,batch_min,want", [
    ("token_major", 1, 1024, "batch"),   # one segment per block: 1 token x 1536 bytes
    ("token_major", 5, 4096, "batch"),   # 5 x 1536 bytes
    ("token_major", 5, 1 << 30, None),   # segments below batch_min_bytes: an SM kernel
    ("layer_major", 3, 256, "batch"),    # 12 segments of 3 x 128 bytes per block
])
def test_long_segments_take_the_copy_engines(rng, layout, num_tokens, batch_min, want):
    """Partial copies whose segments are at least ``batch_min_bytes`` go to the batched driver
    copy, one copy per segment, host -> device -> host: exactly those bytes, the rest untouched."""

    from tiercache.copypaths import CopyLauncher, segments_for
    from tiercache.memory import alloc_host

    pool = PoolSpec.kv("kv", num_layers=3, kv_factor=2, num_kv_heads=2, tokens_per_block=8, head_dim=64,
                       dtype="float16", layout=layout)
    seg = segments_for(pool, num_tokens)
    la = CopyLauncher(0, max_sms=4, batch_min_bytes=batch_min)
    if want == "batch" and not la.batch.available:
        pytest.skip("cuMemcpyBatchAsync needs CUDA 12.8")
    assert (seg.seg_bytes >= batch_min) == (want == "batch")
    n, row = 23, pool.block_nbytes
    src, _o1 = alloc_host(n * row, pinned=True)
    back, _o2 = alloc_host(n * row, pinned=True)
    paths = partial_round_trip(la, seg, src.reshape(n, row), back.reshape(n, row), rng, 17)
    assert (paths == {want}) if want else ("batch" not in paths)
