"""Experiment: shapes of the bulk-copy (TMA) kernel, partial copies, and copies beside compute.

Measured in one run on the same bytes, every figure against one contiguous cudaMemcpyAsync
timed in the same run:

1. ``gemm``: which cuBLAS kernel an 8192^3 bf16 product runs (grid, block, registers, shared
   memory per CTA, from the PyTorch profiler), to see what room it leaves on an SM.
2. ``probe``: whether small CTAs start beside that product: a kernel of G CTAs x T threads
   with S bytes of shared memory that only reads the clock, launched while the product runs.
   Its duration says whether its CTAs waited for the product's to finish.
3. ``whole``: scattered 16 KiB blocks host <-> device with the bulk kernel's shapes (small
   CTAs that fit beside the product's, large ones) and CTAs per SM, alone and beside it.
4. ``partial``: the first 1 or 4 of 16 tokens of layer-major KV blocks, with the
   gather/scatter kernel and with the bulk kernel (lanes issue one bulk copy per segment),
   and the copy engines' 2-D copy of the same segments (host side in one run).
5. ``batch``: cuMemcpyBatchAsync split over one, two or four streams at 64 and 256 KiB.

Prints one JSON object per line. Usage: python benchmarks/copy_variants.py [sections...]
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from tiercache.batchcopy import BatchCopy
from tiercache.benchcopy import _bufs, _time, scattered_slots
from tiercache.benchoverlap import overlap_rounds
from tiercache.gpumon import ClockSampler
from tiercache.copykernels import CopyLauncher, Segments, segments_for
from tiercache.geometry import PoolSpec
from tiercache.memcopy import data_ptr as ptr
from tiercache.memcopy import MEMCPY_DEFAULT
from tiercache.streams import copy_stream

KiB = 1024
PROBE_SRC = r"""
extern "C" __global__ void probe(long long ns, unsigned long long* out) {
    unsigned long long t0, t1;
    unsigned smid;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1)); } while ((long long)(t1 - t0) < ns);
    if (threadIdx.x == 0) { out[3 * blockIdx.x] = smid; out[3 * blockIdx.x + 1] = t0; out[3 * blockIdx.x + 2] = t1; }
}
"""


def run_beside(product, cs, fn, ts, t_fn: float) -> tuple[float, float]:
    """(seconds per ``fn()`` beside the product, the product's slowdown): medians of 3 rounds."""
    r = overlap_rounds(product, [0], cs, fn, ts, t_fn, 0, 3, ClockSampler())
    return r["beside_s"], r["vs_full"]


def emit(**row) -> None:
    print(json.dumps(row, default=str))
    sys.stdout.flush()


def product_fn(iters: int = 20, m: int = 8192):
    import cupy
    import torch

    a = torch.randn((m, m), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((m, m), device="cuda", dtype=torch.bfloat16)
    cst = torch.cuda.Stream()
    cs = cupy.cuda.ExternalStream(cst.cuda_stream)

    def product():
        with torch.cuda.stream(cst):
            for _ in range(iters):
                torch.matmul(a, b)
    return product, cs, (a, b)


def gemm_info() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16)
    torch.matmul(a, a)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.matmul(a, a)
        torch.cuda.synchronize()
    prof.export_chrome_trace("/tmp/gemm_trace.json")
    for e in json.load(open("/tmp/gemm_trace.json"))["traceEvents"]:
        if e.get("cat") == "kernel":
            emit(section="gemm", name=e["name"][:160], dur_us=e.get("dur"), args=e.get("args"))


def probe() -> None:
    import cupy

    fn = cupy.RawModule(code=PROBE_SRC).get_function("probe")
    fn.max_dynamic_shared_size_bytes = 160 * KiB
    product, cs, _keep = product_fn()
    ts = copy_stream("high")
    for grid, threads, smem in ((132, 32, 0), (132, 32, 8 * KiB), (132, 32, 16 * KiB), (132, 32, 32 * KiB),
                                (132, 32, 64 * KiB), (132, 128, 0), (132, 256, 0), (8, 32, 16 * KiB),
                                (8, 32, 64 * KiB), (264, 32, 16 * KiB)):
        out = cupy.zeros(3 * grid, dtype=cupy.uint64)
        res = {}
        for beside in (False, True):
            cupy.cuda.Device().synchronize()
            if beside:
                product()
                time.sleep(0.005)
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record(ts)
            fn((grid,), (threads,), (np.int64(20_000), out), stream=ts, shared_mem=smem)
            b.record(ts)
            b.synchronize()
            o = out.get().reshape(grid, 3)
            res["beside" if beside else "alone"] = {
                "dur_us": cupy.cuda.get_elapsed_time(a, b) * 1e3,
                "start_spread_us": float(o[:, 1].max() - o[:, 1].min()) / 1e3, "sms": int(np.unique(o[:, 0]).size)}
            cupy.cuda.Device().synchronize()
        emit(section="probe", grid=grid, threads=threads, smem=smem, **res)


def shipped_shapes() -> dict:
    """CopyLauncher bulk shapes to compare (name -> launcher)."""
    out = {}
    for shape, per_sm, sms in (("small", 1, None), ("small", 2, None), ("small", 4, None), ("large", 1, None),
                               ("large", 1, 8), ("small", 1, 66)):
        la = CopyLauncher(0, bulk_sms=sms, bulk_shape=shape, bulk_ctas_per_sm=per_sm)
        out[f"{shape}_x{per_sm}_sms{la.bulk_sms}"] = la
        emit(section="regs", shape=shape, num_regs=la._bulk.num_regs, local=la._bulk.local_size_bytes,
             static_smem=la._bulk.shared_size_bytes)
    la = CopyLauncher(0, bulk_shape="small")
    try:
        la._bulk.preferred_shared_memory_carveout = -1  # the driver's default
        out["small_x1_default_carveout"] = la
    except Exception as exc:  # noqa: BLE001
        emit(section="regs", carveout_error=repr(exc))
    return out


def scattered_case(seed: int, n: int, block: int = 16 * KiB):
    """``(rng, host, keep, dev, cases, stream)`` for ``n`` scattered ``block``-byte copies:
    ``cases`` is ``[(direction, src, src_slots, dst, dst_slots)]`` for h2d and d2h, the host
    side a random half of ``2n`` host rows (runs of ~2 blocks), the device side a permutation
    with no two neighbours adjacent."""
    rng = np.random.default_rng(seed)
    host, keep, dev = _bufs(n, block, 0, host_rows=2 * n)
    hs = rng.permutation(np.sort(rng.choice(2 * n, size=n, replace=False)))
    ds = scattered_slots(rng, n)
    cases = [("h2d", host, hs, dev, ds), ("d2h", dev, ds, host, hs)]
    return rng, host, keep, dev, cases, copy_stream("high")


def whole(reps: int = 7) -> None:
    import cupy

    block, n = 16 * KiB, 8192
    _rng, host, _o, dev, cases, stream = scattered_case(0, n, block)
    nbytes = n * block
    launcher8 = CopyLauncher(0, max_sms=8)
    shipped = shipped_shapes()
    product, cs, _keep = product_fn()
    t_prod = _time(product, cs, 5)
    emit(section="whole", product_ms=t_prod * 1e3)
    for direction, src, s, dst, d in cases:
        sp, dp = ptr(src), ptr(dst)
        contig = nbytes / _time(lambda: cupy.cuda.runtime.memcpyAsync(dp, sp, nbytes, MEMCPY_DEFAULT, stream.ptr),
                                stream, reps, back_to_back=4) / 1e9
        seg = Segments(1, block, block)
        variants = {"kernel_8sm": lambda: launcher8.launch(src, s, dst, d, seg, stream, force="kernel")}
        for vname, la in shipped.items():
            variants[vname] = lambda la=la: la.launch(src, s, dst, d, seg, stream, force="bulk")
        for name, fn in variants.items():
            if isinstance(dst, np.ndarray):
                dst[d] = 0
            else:
                dst[cupy.asarray(d)] = 0
            t = _time(fn, stream, reps, back_to_back=4)
            stream.synchronize()
            got = dst[d] if isinstance(dst, np.ndarray) else dst[cupy.asarray(d)].get()
            want = src[s] if isinstance(src, np.ndarray) else src[cupy.asarray(s)].get()
            row = {"section": "whole", "dir": direction, "variant": name, "gbps": nbytes / t / 1e9, "contig": contig,
                   "ratio": nbytes / t / 1e9 / contig, "ok": bool(np.array_equal(got, want))}
            if direction == "h2d":
                span, slow = run_beside(product, cs, fn, stream, t)
                row.update(beside_ratio=nbytes / span / 1e9 / contig, product=slow)
            emit(**row)
    del host, dev


def partial(reps: int = 7) -> None:
    import cupy

    pool = PoolSpec.kv("kv", num_layers=32, kv_factor=2, num_kv_heads=8, tokens_per_block=16, head_dim=128,
                       dtype="bfloat16")
    rng = np.random.default_rng(1)
    blocks, row = 512, pool.block_nbytes
    host, _o, dev = _bufs(blocks, row, 0)
    s_, d_ = scattered_slots(rng, blocks), scattered_slots(rng, blocks)
    stream = copy_stream("high")
    launcher = CopyLauncher(0)
    shipped = shipped_shapes()
    for n_tok in (1, 4):
        seg = segments_for(pool, n_tok)
        moved = blocks * seg.nbytes
        for direction in ("h2d", "d2h"):
            s, d = s_, d_
            src, dst = (host, dev) if direction == "h2d" else (dev, host)
            sp, dp = ptr(src), ptr(dst)
            contig = moved / _time(lambda: cupy.cuda.runtime.memcpyAsync(dp, sp, moved, MEMCPY_DEFAULT, stream.ptr),
                                   stream, reps, back_to_back=4) / 1e9
            variants = {"kernel_all": lambda: launcher.launch(src, s, dst, d, seg, stream, force="kernel")}
            for vname, la in shipped.items():
                variants[vname] = lambda la=la: la.launch(src, s, dst, d, seg, stream, force="bulk")
            # the copy engines' 2-D copy of the same segments from/to one host run (staging packed)
            rows2d = blocks * seg.segs
            if direction == "h2d":
                variants["ce_2d_run"] = lambda: cupy.cuda.runtime.memcpy2DAsync(
                    dp, seg.seg_bytes, sp, seg.seg_stride, seg.seg_bytes, rows2d, MEMCPY_DEFAULT, stream.ptr)
            else:
                variants["ce_2d_run"] = lambda: cupy.cuda.runtime.memcpy2DAsync(
                    dp, seg.seg_stride, sp, seg.seg_bytes, seg.seg_bytes, rows2d, MEMCPY_DEFAULT, stream.ptr)
            sub = rng.choice(blocks, size=32, replace=False)
            for name, fn in variants.items():
                if isinstance(dst, np.ndarray):
                    dst[d[sub]] = 7
                else:
                    dst[cupy.asarray(d[sub])] = 7
                t = _time(fn, stream, reps, back_to_back=4)
                stream.synchronize()
                ok = None
                if name != "ce_2d_run":
                    g = dst[d[sub]] if isinstance(dst, np.ndarray) else dst[cupy.asarray(d[sub])].get()
                    w = src[s[sub]] if isinstance(src, np.ndarray) else src[cupy.asarray(s[sub])].get()
                    ok = bool(np.array_equal(g.reshape(32, seg.segs, -1)[:, :, :seg.seg_bytes],
                                             w.reshape(32, seg.segs, -1)[:, :, :seg.seg_bytes]))
                emit(section="partial", tokens=n_tok, dir=direction, variant=name, gbps=moved / t / 1e9, contig=contig,
                     ratio=moved / t / 1e9 / contig, ok=ok)
    del host, dev


def batch_split(reps: int = 7) -> None:
    import cupy

    batch = BatchCopy()
    if not batch.available:
        emit(section="batch", error="no cuMemcpyBatchAsync")
        return
    rng = np.random.default_rng(2)
    for block in (64 * KiB, 256 * KiB):
        n = (256 << 20) // block
        host, _o, dev = _bufs(n, block, 0, host_rows=2 * n)
        hs = rng.permutation(np.sort(rng.choice(2 * n, size=n, replace=False)))
        ds = scattered_slots(rng, n)
        streams = [copy_stream("high") for _ in range(4)]
        for direction in ("h2d", "d2h"):
            s, d = (hs, ds) if direction == "h2d" else (ds, hs)
            src, dst = (host, dev) if direction == "h2d" else (dev, host)
            sp, dp = ptr(src), ptr(dst)
            nbytes = n * block
            contig = nbytes / _time(lambda: cupy.cuda.runtime.memcpyAsync(dp, sp, nbytes, MEMCPY_DEFAULT, streams[0].ptr),
                                    streams[0], reps, back_to_back=4) / 1e9
            for k in (1, 2, 4):
                parts = np.array_split(np.arange(n), k)
                args = [batch.prepare(dp + d[p].astype(np.uint64) * block, sp + s[p].astype(np.uint64) * block,
                                      np.full(p.size, block, dtype=np.uint64)) for p in parts]

                def fn(args=args, k=k):
                    for i in range(1, k):
                        streams[i].wait_event(streams[0].record())
                    for i in range(k):
                        batch.launch(args[i], streams[i].ptr)
                    for i in range(1, k):
                        streams[0].wait_event(streams[i].record())
                t = _time(fn, streams[0], reps, back_to_back=4)
                emit(section="batch", block=block, dir=direction, streams=k, gbps=nbytes / t / 1e9, contig=contig,
                     ratio=nbytes / t / 1e9 / contig)
        del host, dev


FIT_SRC = r"""
template <int N>
__device__ __forceinline__ void hold(long long ns, unsigned long long* out, const unsigned* in) {
    unsigned v[N];
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = in[i * 32 + threadIdx.x];
    unsigned long long t0, t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
#pragma unroll
        for (int i = 0; i < N; ++i) asm volatile("add.u32 %0, %0, 1;" : "+r"(v[i]));
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    } while ((long long)(t1 - t0) < ns);
    unsigned acc = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) acc ^= v[i];
    if (acc == 0x12345678u) out[0] = acc;
    if (threadIdx.x == 0) out[1 + blockIdx.x] = t1 - t0;
}
extern "C" __global__ void hold4(long long ns, unsigned long long* out, const unsigned* in) { hold<4>(ns, out, in); }
extern "C" __global__ void hold16(long long ns, unsigned long long* out, const unsigned* in) { hold<16>(ns, out, in); }
extern "C" __global__ void hold24(long long ns, unsigned long long* out, const unsigned* in) { hold<24>(ns, out, in); }

// the gather/scatter loads with no shared memory and one warp per CTA
extern "C" __global__ void __maxnreg__(32) small_ld(const unsigned char* src_base, unsigned char* dst_base,
        const long long* src_off, const long long* dst_off, long long n_blocks, long long block_bytes) {
    const long long cpb = block_bytes / 16, total = cpb * n_blocks;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < total; g += stride * 4) {
        uint4 v[4]; uint4* d[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const long long c = g + u * stride; d[u] = nullptr;
            if (c < total) {
                const long long blk = c / cpb, off = (c - blk * cpb) * 16;
                v[u] = *reinterpret_cast<const uint4*>(src_base + src_off[blk] + off);
                d[u] = reinterpret_cast<uint4*>(dst_base + dst_off[blk] + off);
            }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) if (d[u]) *d[u] = v[u];
    }
}
"""


def fit() -> None:
    """Which small CTAs start beside the product, and whether TMA copies slow it."""
    import cupy

    mod = cupy.RawModule(code=FIT_SRC, options=("-std=c++17",))
    product, cs, _keep = product_fn()
    ts = copy_stream("high")
    inp = cupy.arange(32 * 32, dtype=cupy.uint32)
    for name in ("hold4", "hold16", "hold24"):
        fn = mod.get_function(name)
        fn.max_dynamic_shared_size_bytes = 48 * KiB
        for smem in ((0, 1024, 2048, 3072, 4096, 5120, 6144) if name == "hold4" else (0, 4096)):
            out = cupy.zeros(1 + 132, dtype=cupy.uint64)
            cupy.cuda.Device().synchronize()
            product()
            time.sleep(0.005)
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record(ts)
            fn((132,), (32,), (np.int64(20_000), out, inp), stream=ts, shared_mem=smem)
            b.record(ts)
            b.synchronize()
            emit(section="fit", kernel=name, regs=fn.num_regs, smem=smem, beside_us=cupy.cuda.get_elapsed_time(a, b) * 1e3)
            cupy.cuda.Device().synchronize()
    # copies beside the product: SM loads (no TMA) vs small bulk CTAs with less shared memory
    rng = np.random.default_rng(5)
    block, n = 16 * KiB, 8192
    host, _o, dev = _bufs(n, block, 0)
    s, d = scattered_slots(rng, n), scattered_slots(rng, n)
    nbytes = n * block
    so, do = cupy.asarray(s * block), cupy.asarray(d * block)
    _time(product, cs, 5)  # warm-up
    contig = nbytes / _time(lambda: cupy.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, nbytes, MEMCPY_DEFAULT,
                                                                   ts.ptr), ts, 5, back_to_back=4) / 1e9
    small_ld = mod.get_function("small_ld")
    emit(section="fit", small_ld_regs=small_ld.num_regs)
    seg = Segments(1, block, block)
    variants = {}
    for grid in (132, 264):
        variants[f"small_ld_g{grid}"] = lambda grid=grid: small_ld(
            (grid,), (32,), (np.uint64(host.ctypes.data), np.uint64(dev.data.ptr), so, do, np.int64(n), np.int64(block)),
            stream=ts)
    for chunk in (256, 512, 1024, 2048):
        la = CopyLauncher(0, bulk_shape="small")
        la._bulk_chunk, la._bulk_smem = chunk, 2 * chunk
        variants[f"bulk_small_c{chunk}"] = lambda la=la: la.launch(host, s, dev, d, seg, ts, force="bulk")
    for name, fn in variants.items():
        dev[cupy.asarray(d)] = 0
        t = _time(fn, ts, 5, back_to_back=4)
        ts.synchronize()
        ok = bool(np.array_equal(dev[cupy.asarray(d)].get(), host[s]))
        span, slow = run_beside(product, cs, fn, ts, t)
        emit(section="fit", variant=name, ratio=nbytes / t / 1e9 / contig, beside_ratio=nbytes / span / 1e9 / contig,
             product=slow, ok=ok)


def large() -> None:
    """The large bulk shape's ring (buffers, loads ahead, buffer bytes) on 8 SMs: 16 KiB h2d
    alone (back to back and from idle) and beside the product."""
    import cupy

    from tiercache.kernels.loader import KERNEL_DIR

    rng = np.random.default_rng(6)
    block, n = 16 * KiB, 8192
    host, _o, dev = _bufs(n, block, 0)
    s, d = scattered_slots(rng, n), scattered_slots(rng, n)
    nbytes = n * block
    product, cs, _keep = product_fn()
    ts = copy_stream("high")
    _time(product, cs, 5)  # warm-up
    contig = nbytes / _time(lambda: cupy.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, nbytes, MEMCPY_DEFAULT,
                                                                   ts.ptr), ts, 5, back_to_back=4) / 1e9
    seg = Segments(1, block, block)
    for stages, ahead, chunk in ((8, 6, 8 * KiB), (4, 2, 16 * KiB), (6, 4, 16 * KiB), (8, 6, 16 * KiB), (3, 2, 32 * KiB),
                                 (12, 10, 8 * KiB)):
        fn = cupy.RawModule(code=(KERNEL_DIR / "copy_bulk.cu").read_text(),
                            options=("-std=c++17", f"-DTC_STAGES={stages}", f"-DTC_AHEAD={ahead}")).get_function("tc_bulk_copy")
        fn.max_dynamic_shared_size_bytes = stages * chunk
        fn.preferred_shared_memory_carveout = 100
        for sms in (8, 16):
            la = CopyLauncher(0, max_sms=sms)
            la._bulk_kernels["large"] = (fn, stages * chunk, chunk)
            la._bulk, la._bulk_smem, la._bulk_chunk = la._bulk_kernels["large"]

            def xfer(la=la):
                la.launch(host, s, dev, d, seg, ts, force="bulk")
            dev[cupy.asarray(d)] = 0
            t = _time(xfer, ts, 5, back_to_back=4)
            t_idle = _time(xfer, ts, 5)
            ts.synchronize()
            ok = bool(np.array_equal(dev[cupy.asarray(d)].get(), host[s]))
            span, slow = run_beside(product, cs, xfer, ts, t_idle)
            emit(section="large", stages=stages, ahead=ahead, chunk=chunk, sms=sms, ratio=nbytes / t / 1e9 / contig,
                 idle_ratio=nbytes / t_idle / 1e9 / contig, beside_ratio=nbytes / span / 1e9 / contig,
                 product=slow, ok=ok)


def staged_probe() -> None:
    """Where the staged path's time goes: host submit time per request, and the device-to-device
    scatter alone and beside the product (small CTAs on every SM, large ones on 8 SMs)."""
    import cupy

    rng = np.random.default_rng(7)
    block, n = 16 * KiB, 8192
    host, _o, dev = _bufs(n, block, 0)
    hs = (rng.permutation(n // 64)[:, None] * 64 + np.arange(64)).reshape(-1)
    ds = scattered_slots(rng, n)
    nbytes = n * block
    seg = Segments(1, block, block)
    ts = copy_stream("high")
    product, cs, _keep = product_fn()
    _time(product, cs, 5)  # warm-up
    for chunk in (8 << 20, 32 << 20):
        la = CopyLauncher(0, max_sms=8)
        la.staged.chunk_bytes = chunk
        la.launch(host, hs, dev, ds, seg, ts, force="staged")
        ts.synchronize()
        subs = []
        for _ in range(5):
            t0 = time.perf_counter()
            la.launch(host, hs, dev, ds, seg, ts, force="staged")
            subs.append(time.perf_counter() - t0)
            ts.synchronize()
        t_gpu = _time(lambda: la.launch(host, hs, dev, ds, seg, ts, force="staged"), ts, 5, back_to_back=4)
        emit(section="staged", chunk=chunk, submit_ms=float(np.median(subs)) * 1e3, gpu_ms=t_gpu * 1e3)
    src = cupy.asarray(host)
    for name, la, burst in (("d2d_kernel_all", CopyLauncher(0), True), ("d2d_large_8sm", CopyLauncher(0, max_sms=8), False)):
        def fn(la=la, burst=burst):
            table = la.offsets_table([np.arange(n, dtype=np.int64) * block], [ds.astype(np.int64) * block])
            offs = la.ring.upload(table, ts)
            p = offs.data.ptr
            la.launch_table(src.data.ptr, dev.data.ptr, p, p + 8 * n, n, p + 16 * n, seg, 16, ts, "bulk",
                            all_sms=burst)
            la.ring.release(ts)
        t = _time(fn, ts, 5, back_to_back=4)
        span, slow = run_beside(product, cs, fn, ts, t)
        emit(section="staged", variant=name, alone_gbps=nbytes / t / 1e9, beside_gbps=nbytes / span / 1e9, product=slow)


def thp_host(nbytes: int):
    """Pinned host memory on transparent huge pages: a 2 MiB-aligned anonymous mapping with
    MADV_HUGEPAGE, touched, then registered with CUDA. Returns (array, keep-alive)."""
    import mmap

    import cupy

    huge = 2 << 20
    mm = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = np.frombuffer(mm, dtype=np.uint8)
    off = (-base.ctypes.data) % huge
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, off, nbytes)
    except (AttributeError, OSError) as exc:
        emit(section="thp", madvise_error=repr(exc))
    arr = base[off:off + nbytes]
    arr[::4096] = 1  # fault every page in
    cupy.cuda.runtime.hostRegister(arr.ctypes.data, nbytes, 0)
    return arr, mm


def hugetlb_host(nbytes: int):
    """Pinned host memory on explicit 2 MiB huge pages (``MAP_HUGETLB``; the pool is sized by
    ``/proc/sys/vm/nr_hugepages``), touched, then registered with CUDA. Returns (array, keep-alive)."""
    import mmap

    import cupy

    huge = 2 << 20
    size = -(-nbytes // huge) * huge
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_HUGETLB", 0x40000))
    arr = np.frombuffer(mm, dtype=np.uint8)[:nbytes]
    arr[::4096] = 1
    cupy.cuda.runtime.hostRegister(arr.ctypes.data, nbytes, 0)
    return arr, mm


def hugetlb(reps: int = 7) -> None:
    """:func:`thp` with explicit huge pages instead of transparent ones (fewer translations per
    byte for the GPU's and the IOMMU's page walks, if the pages stay huge all the way down)."""
    emit(section="hugetlb", meminfo=[ln.strip() for ln in open("/proc/meminfo") if ln.startswith("Huge")])
    thp(reps, kinds=("hostalloc", "hugetlb"))


def thp(reps: int = 7, kinds=("hostalloc", "thp")) -> None:
    """Scattered 16 KiB blocks and 1-token partial copies host <-> device from cudaHostAlloc memory
    and from huge-page memory registered with CUDA (fewer IOMMU translations per byte, if any)."""
    import cupy

    try:
        emit(section="thp", enabled=open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(),
             anon_huge_kb=[ln for ln in open("/proc/meminfo") if ln.startswith(("AnonHugePages", "Hugepagesize"))])
    except OSError as exc:
        emit(section="thp", error=repr(exc))
    rng = np.random.default_rng(9)
    pool = PoolSpec.kv("kv", num_layers=32, kv_factor=2, num_kv_heads=8, tokens_per_block=16, head_dim=128,
                       dtype="bfloat16")
    stream = copy_stream("high")
    la = CopyLauncher(0, max_sms=8)
    for what, block, n, seg in (("whole16k", 16 * KiB, 16384, Segments(1, 16 * KiB, 16 * KiB)),
                                ("partial1", pool.block_nbytes, 512, segments_for(pool, 1))):
        dev = cupy.empty((n, block), dtype=cupy.uint8)
        s, d = scattered_slots(rng, n), scattered_slots(rng, n)
        moved = n * seg.nbytes
        for kind in kinds:
            if kind == "hostalloc":
                host, keep = _bufs(n, block, 0)[:2]
            else:
                flat, keep = (thp_host if kind == "thp" else hugetlb_host)(n * block)
                host = flat.reshape(n, block)
                host[:] = rng.integers(0, 256, size=(n, block), dtype=np.uint8)
            for direction in ("h2d", "d2h"):
                src, dst = (host, dev) if direction == "h2d" else (dev, host)
                t_c = _time(lambda: cupy.cuda.runtime.memcpyAsync(ptr(dst), ptr(src), moved, MEMCPY_DEFAULT, stream.ptr),
                            stream, reps, back_to_back=4)
                t = _time(lambda: la.launch(src, s, dst, d, seg, stream), stream, reps, back_to_back=4)
                emit(section="thp", what=what, memory=kind, dir=direction, contig_gbps=moved / t_c / 1e9,
                     gbps=moved / t / 1e9, ratio=t_c / t)
            if kind != "hostalloc":
                cupy.cuda.runtime.hostUnregister(host.ctypes.data)
            del host, keep


def wc_host(nbytes: int):
    """Pinned host memory allocated write-combined (``cudaHostAlloc`` with
    ``cudaHostAllocWriteCombined | cudaHostAllocPortable``): the CUDA guide says such memory is
    not snooped across PCIe, which may let the device's reads of it go faster. Returns
    ``(array, keep-alive)``; the keep-alive frees it."""
    import ctypes

    import cupy

    p = cupy.cuda.runtime.hostAlloc(nbytes, 4 | 1)

    class _Free:
        def __del__(self):
            cupy.cuda.runtime.freeHost(p)

    arr = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(p), dtype=np.uint8)
    return arr, _Free()


def wc(reps: int = 7) -> None:
    """Scattered 16 KiB blocks and 1-token partial copies host <-> device, by the bulk kernel,
    the gather/scatter kernel and the copy engines, from ordinary pinned memory and from
    write-combined pinned memory; each against a contiguous copy of the same bytes from the same
    memory and from ordinary pinned memory, timed in turn. Then the CPU's own read and write
    speed on each (what a POSIX file write of a host block would see)."""
    import cupy

    from tiercache.benchcopy import _time_many

    rng = np.random.default_rng(21)
    pool = PoolSpec.kv("kv", num_layers=32, kv_factor=2, num_kv_heads=8, tokens_per_block=16, head_dim=128,
                       dtype="bfloat16")
    stream = copy_stream("high")
    la = CopyLauncher(0, max_sms=8)
    la4 = CopyLauncher(0, carveout_sms=4)
    for what, block, n, seg in (("whole16k", 16 * KiB, 16384, Segments(1, 16 * KiB, 16 * KiB)),
                                ("whole64k", 64 * KiB, 4096, Segments(1, 64 * KiB, 64 * KiB)),
                                ("partial1", pool.block_nbytes, 512, segments_for(pool, 1))):
        dev = cupy.empty((n, block), dtype=cupy.uint8)
        s, d = scattered_slots(rng, n), scattered_slots(rng, n)
        moved = n * seg.nbytes
        plain, keep_p = _bufs(n, block, 0)[:2]
        flat, keep_w = wc_host(n * block)
        wcm = flat.reshape(n, block)
        wcm[:] = plain
        for direction in ("h2d", "d2h"):
            fns = {}
            for kind, host in (("pinned", plain), ("wc", wcm)):
                src, dst = (host, dev) if direction == "h2d" else (dev, host)
                fns[f"{kind}_contig"] = lambda src=src, dst=dst: cupy.cuda.runtime.memcpyAsync(
                    ptr(dst), ptr(src), moved, MEMCPY_DEFAULT, stream.ptr)
                fns[f"{kind}_bulk8"] = lambda src=src, dst=dst: la.launch(src, s, dst, d, seg, stream, force="bulk")
                fns[f"{kind}_kernel8"] = lambda src=src, dst=dst: la.launch(src, s, dst, d, seg, stream, force="kernel")
                fns[f"{kind}_carve4"] = lambda src=src, dst=dst: la4.launch(src, s, dst, d, seg, stream)
            t = _time_many(fns, stream, reps, back_to_back=4)
            for name, sec in t.items():
                kind = name.split("_")[0]
                emit(section="wc", what=what, dir=direction, variant=name, gbps=moved / sec / 1e9,
                     vs_same_contig=t[f"{kind}_contig"] / sec, vs_pinned_contig=t["pinned_contig"] / sec)
        # bytes check: both memories through the bulk kernel, each direction
        for host in (plain, wcm):
            sub = rng.choice(n, size=16, replace=False)
            dev[cupy.asarray(d)] = 0
            cupy.cuda.Device().synchronize()  # the zeroing ran on the default stream, the copy on another
            la.launch(host, s, dev, d, seg, stream, force="bulk")
            stream.synchronize()
            ok_h2d = bool(np.array_equal(dev[cupy.asarray(d[sub])].get().reshape(16, seg.segs, -1)[:, :, :seg.seg_bytes],
                                         host[s[sub]].reshape(16, seg.segs, -1)[:, :, :seg.seg_bytes]))
            emit(section="wc", what=what, check="h2d", memory="wc" if host is wcm else "pinned", ok=ok_h2d)
        del dev
        # the CPU's view: copy 64 MiB out of and into each memory
        size = min(64 << 20, n * block)
        buf = np.empty(size, dtype=np.uint8)
        for kind, host in (("pinned", plain), ("wc", wcm)):
            h = host.reshape(-1)[:size]
            t0 = time.perf_counter()
            np.copyto(buf, h)
            t1 = time.perf_counter()
            np.copyto(h, buf)
            t2 = time.perf_counter()
            emit(section="wc_cpu", what=what, memory=kind, read_gbps=size / (t1 - t0) / 1e9, write_gbps=size / (t2 - t1) / 1e9)
        del plain, wcm, flat, keep_p, keep_w


def numa_host(nbytes: int, node: int):
    """``nbytes`` of anonymous memory bound to NUMA ``node`` (``mbind``, MPOL_BIND, pages moved),
    touched and then registered with CUDA. Returns ``(array, keep-alive)``."""
    import ctypes
    import mmap

    import cupy

    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(mm, dtype=np.uint8)
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_ulong(1 << node)
    # mbind(addr, len, MPOL_BIND = 2, nodemask, maxnode, MPOL_MF_MOVE = 2); x86-64 syscall 237
    rc = libc.syscall(237, ctypes.c_void_p(arr.ctypes.data), ctypes.c_ulong(nbytes), 2, ctypes.byref(mask),
                      ctypes.c_ulong(64), 2)
    if rc != 0:
        raise OSError(ctypes.get_errno(), "mbind failed")
    arr[::4096] = 1
    cupy.cuda.runtime.hostRegister(arr.ctypes.data, nbytes, 0)
    return arr, mm


def numa(reps: int = 7) -> None:
    """Where host memory sits against the GPU: the guest's NUMA nodes and the GPU's node, then
    16 KiB scattered blocks and a contiguous copy from memory bound to each node. SM-driven reads
    of host memory are bounded by the requests in flight, so a farther node (longer latency)
    would lower them while the copy engines stay at the link's speed."""
    import glob
    import os

    import cupy

    nodes = sorted(glob.glob("/sys/devices/system/node/node[0-9]*"))
    gpus = {}
    for dev in glob.glob("/sys/bus/pci/devices/*"):
        try:
            if open(os.path.join(dev, "vendor")).read().strip() == "0x10de":
                gpus[os.path.basename(dev)] = open(os.path.join(dev, "numa_node")).read().strip()
        except OSError:
            pass
    for addr in gpus:
        try:
            cfg = open(f"/sys/bus/pci/devices/{addr}/config", "rb").read()
            at = cfg[0x34]
            while at and at < len(cfg) - 0x14:
                if cfg[at] == 0x10:  # the PCI Express capability
                    ctl = int.from_bytes(cfg[at + 8:at + 10], "little")
                    cap = int.from_bytes(cfg[at + 4:at + 8], "little")
                    lnk = int.from_bytes(cfg[at + 0x12:at + 0x14], "little")
                    emit(section="numa", pci=addr, max_payload=128 << ((ctl >> 5) & 7),
                         max_read_request=128 << ((ctl >> 12) & 7), max_payload_supported=128 << (cap & 7),
                         ext_tag=bool(ctl & 0x100), relaxed_ordering=bool(ctl & 0x10), no_snoop=bool(ctl & 0x800),
                         link_gen=lnk & 0xF, link_width=(lnk >> 4) & 0x3F)
                    break
                at = cfg[at + 1]
        except OSError as exc:
            emit(section="numa", pci=addr, error=repr(exc))
    emit(section="numa", nodes=[os.path.basename(n) for n in nodes], gpu_nodes=gpus,
         cpus={os.path.basename(n): open(os.path.join(n, "cpulist")).read().strip() for n in nodes},
         mems_allowed=[ln.strip() for ln in open("/proc/self/status") if ln.startswith("Mems_allowed_list")])
    rng = np.random.default_rng(5)
    block, n = 16 * KiB, 16384
    dev = cupy.empty((n, block), dtype=cupy.uint8)
    s, d = scattered_slots(rng, n), scattered_slots(rng, n)
    seg = Segments(1, block, block)
    stream = copy_stream("high")
    la = CopyLauncher(0, max_sms=8)
    moved = n * block
    from tiercache.benchcopy import _time_many

    for i in range(len(nodes)):
        try:
            flat, keep = numa_host(moved, i)
        except OSError as exc:
            emit(section="numa", node=i, error=repr(exc))
            continue
        host = flat.reshape(n, block)
        for direction in ("h2d", "d2h"):
            src, dst = (host, dev) if direction == "h2d" else (dev, host)
            fns = {"contig": lambda src=src, dst=dst: cupy.cuda.runtime.memcpyAsync(ptr(dst), ptr(src), moved,
                                                                                    MEMCPY_DEFAULT, stream.ptr),
                   "bulk8": lambda src=src, dst=dst: la.launch(src, s, dst, d, seg, stream, force="bulk"),
                   "kernel8": lambda src=src, dst=dst: la.launch(src, s, dst, d, seg, stream, force="kernel")}
            t = _time_many(fns, stream, reps, back_to_back=4)
            emit(section="numa", node=i, dir=direction, **{k: round(moved / v / 1e9, 2) for k, v in t.items()},
                 ratio_bulk=t["contig"] / t["bulk8"])
        cupy.cuda.runtime.hostUnregister(host.ctypes.data)
        del host, flat, keep


def main(sections) -> None:
    funcs = {"hugetlb": hugetlb, "numa": numa, "wc": wc, "thp": thp, "gemm": gemm_info, "probe": probe, "whole": whole, "partial": partial, "batch": batch_split, "fit": fit,
             "large": large, "staged": staged_probe}
    if sections and sections[0] == "--repeat":  # run the listed sections again under a new name
        sections = sections[1:]
    for name in sections or list(funcs):
        try:
            funcs[name]()
        except Exception as exc:  # report and go on to the next section
            emit(section=name, error=repr(exc))


if __name__ == "__main__":
    main(sys.argv[1:])
