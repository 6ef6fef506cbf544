"""Experiment: copies on SMs that the compute kernels leave free (an SM carve-out), and how many
SMs a copy needs.

1. ``sweep``: 16 KiB scattered blocks host <-> device and 1-token partial copies on k SMs
   (k = 4 ... all), by the bulk kernel with several rings and CTAs per SM, and by the
   gather/scatter kernel with several CTAs per SM; each against one contiguous copy of the same
   bytes timed in the same run.
2. ``carveout``: an 8192^3 bf16 product through cuBLASLt with PyTorch's SM carve-out
   (``torch._C._set_sm_carveout_experimental(k)``, which sets CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET):
   its grid and time per k; then the product beside a stream of 16 KiB scattered transfers on
   the k SMs it leaves, in rounds that time the full product alone, the carved product alone
   and the carved product beside the transfers one after another, with the SM clock, board power
   and throttle reasons (NVML) sampled through each phase.

Prints one JSON object per line. Usage: python benchmarks/carveout.py [sections...]
"""

from __future__ import annotations

import json
import sys

import numpy as np

from tiercache.benchcopy import _bufs, _time, scattered_slots
from tiercache.benchoverlap import overlap_rounds
from copy_variants import scattered_case, wc_host
from tiercache.gpumon import ClockSampler
from tiercache.copykernels import CopyLauncher, Segments, segments_for
from tiercache.geometry import PoolSpec
from tiercache.memcopy import MEMCPY_DEFAULT
from tiercache.memcopy import data_ptr as ptr
from tiercache.streams import copy_stream

KiB = 1024
MiB_ = 1 << 20
RINGS = ((4, 2, 16 * KiB), (8, 6, 16 * KiB), (12, 10, 16 * KiB), (6, 4, 32 * KiB))


def emit(**row) -> None:
    print(json.dumps(row, default=str))
    sys.stdout.flush()


_RING_FNS: dict = {}


def ring_launcher(sms: int, ring=(4, 2, 16 * KiB), ctas: int = 1, kernel_ctas: int = 2, writes: int = -1) -> CopyLauncher:
    """A launcher whose large bulk shape is ``ring`` = (buffers, loads ahead, buffer bytes), on
    ``sms`` SMs with ``ctas`` bulk CTAs (``kernel_ctas`` gather/scatter CTAs) per SM; ``writes``:
    the bulk kernel's bound on store groups in flight per lane (-1: none)."""
    import cupy

    from tiercache.kernels.loader import KERNEL_DIR

    stages, ahead, chunk = ring
    if (stages, ahead, writes) not in _RING_FNS:
        fn = cupy.RawModule(code=(KERNEL_DIR / "copy_bulk.cu").read_text(),
                            options=("-std=c++17", f"-DTC_STAGES={stages}", f"-DTC_AHEAD={ahead}",
                                     f"-DTC_WRITES={writes}")).get_function("tc_bulk_copy")
        fn.preferred_shared_memory_carveout = 100
        _RING_FNS[(stages, ahead, writes)] = fn
    fn = _RING_FNS[(stages, ahead, writes)]
    fn.max_dynamic_shared_size_bytes = max(fn.max_dynamic_shared_size_bytes, stages * chunk)
    la = CopyLauncher(0, max_sms=sms, bulk_sms=sms, bulk_ctas_per_sm=ctas, ctas_per_sm=kernel_ctas)
    la._bulk_kernels["large"] = (fn, stages * chunk, chunk)
    la._bulk, la._bulk_smem, la._bulk_chunk = la._bulk_kernels["large"]
    return la


def _zero(dst, d) -> None:
    import cupy

    if isinstance(dst, np.ndarray):
        dst[d] = 0
    else:
        dst[cupy.asarray(d)] = 0


def _same(src, s, dst, d) -> bool:
    import cupy

    got = dst[d] if isinstance(dst, np.ndarray) else dst[cupy.asarray(d)].get()
    want = src[s] if isinstance(src, np.ndarray) else src[cupy.asarray(s)].get()
    return bool(np.array_equal(got, want))


def sweep(reps: int = 5) -> None:
    import cupy

    block, n = 16 * KiB, 16384
    rng, host, _o, dev, cases, stream = scattered_case(11, n, block)
    nbytes = n * block
    seg = Segments(1, block, block)
    num_sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    for direction, src, s, dst, d in cases:
        sp, dp = ptr(src), ptr(dst)
        contig = nbytes / _time(lambda: cupy.cuda.runtime.memcpyAsync(dp, sp, nbytes, MEMCPY_DEFAULT, stream.ptr),
                                stream, reps, back_to_back=4) / 1e9
        for sms in (4, 6, 8, 16, 32, num_sms):
            variants = {}
            for ring in RINGS:
                for ctas in (1, 2, 3):
                    if ring[0] * ring[2] * ctas <= 200 * KiB:
                        la = ring_launcher(sms, ring, ctas)
                        variants[f"bulk_{ring[0]}x{ring[2] // KiB}k_a{ring[1]}_c{ctas}"] = (la, "bulk")
            for kc in (2, 4, 8):
                variants[f"kernel_c{kc}"] = (ring_launcher(sms, kernel_ctas=kc), "kernel")
            for name, (la, force) in variants.items():
                _zero(dst, d)
                t = _time(lambda la=la, force=force: la.launch(src, s, dst, d, seg, stream, force=force), stream, reps,
                          back_to_back=4)
                stream.synchronize()
                emit(section="sweep", dir=direction, sms=sms, variant=name, gbps=nbytes / t / 1e9, contig=contig,
                     ratio=nbytes / t / 1e9 / contig, ok=_same(src, s, dst, d))
    del host, dev
    # 1 of 16 tokens of layer-major KV blocks (256-byte segments) by the gather/scatter kernel
    pool = PoolSpec.kv("kv", num_layers=32, kv_factor=2, num_kv_heads=8, tokens_per_block=16, head_dim=128,
                       dtype="bfloat16")
    blocks = 512
    host, _o, dev = _bufs(blocks, pool.block_nbytes, 0)
    s, d = scattered_slots(rng, blocks), scattered_slots(rng, blocks)
    seg = segments_for(pool, 1)
    moved = blocks * seg.nbytes
    for direction in ("h2d", "d2h"):
        src, dst = (host, dev) if direction == "h2d" else (dev, host)
        sp, dp = ptr(src), ptr(dst)
        t_c = _time(lambda: cupy.cuda.runtime.memcpyAsync(dp, sp, moved, MEMCPY_DEFAULT, stream.ptr), stream, reps,
                    back_to_back=4)
        for sms in (8, 16, 32, num_sms):
            for kc in (2, 4, 8):
                la = ring_launcher(sms, kernel_ctas=kc)
                t = _time(lambda la=la: la.launch(src, s, dst, d, seg, stream, force="kernel"), stream, reps,
                          back_to_back=4)
                emit(section="sweep_partial", dir=direction, sms=sms, kernel_ctas=kc, ratio=t_c / t,
                     gbps=moved / t / 1e9)


def gemm_grid(a, b) -> list:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.matmul(a, b)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.matmul(a, b)
        torch.cuda.synchronize()
    path = "/tmp/carve_trace.json"
    prof.export_chrome_trace(path)
    out = []
    for e in json.load(open(path))["traceEvents"]:
        if e.get("cat") == "kernel":
            args = e.get("args", {})
            out.append({"name": e["name"][:60], "grid": args.get("grid"), "block": args.get("block"),
                        "smem": args.get("shared memory"), "dur_us": e.get("dur")})
    return out


def carveout(iters: int = 40, rounds: int = 4, methods_fn=None, gemm_table: bool = True, memory: str = "pinned") -> None:
    """``memory``: ``pinned`` (cudaHostAlloc) or ``wc`` (write-combined) host memory."""
    import cupy
    import torch

    m = 8192
    a = torch.randn((m, m), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((m, m), device="cuda", dtype=torch.bfloat16)
    cst = torch.cuda.Stream()
    cs = cupy.cuda.ExternalStream(cst.cuda_stream)
    carve = [None]

    def product():
        torch._C._set_sm_carveout_experimental(carve[0] or None)
        with torch.cuda.stream(cst):
            for _ in range(iters):
                torch.matmul(a, b)
        torch._C._set_sm_carveout_experimental(None)

    for lib in ("cublas", "cublaslt") if gemm_table else ():
        torch.backends.cuda.preferred_blas_library(lib)
        for k in ((None,) if lib == "cublas" else (None, 2, 4, 8, 16)):
            carve[0] = k
            torch._C._set_sm_carveout_experimental(k)
            grid = gemm_grid(a, b)
            torch._C._set_sm_carveout_experimental(None)
            t = _time(product, cs, 3)
            emit(section="carve_gemm", lib=lib, carveout=k, ms=t * 1e3 / iters,
                 tflops=2 * m ** 3 * iters / t / 1e12, kernels=grid)
    torch.backends.cuda.preferred_blas_library("cublaslt")
    sampler = ClockSampler()
    rng = np.random.default_rng(12)
    block, n = 16 * KiB, 8192
    host, _o, dev = _bufs(n, block, 0)
    if memory == "wc":
        flat, _w = wc_host(n * block)
        flat[:] = host.reshape(-1)
        host = flat.reshape(n, block)
    s, d = scattered_slots(rng, n), scattered_slots(rng, n)
    nbytes = n * block
    seg = Segments(1, block, block)
    ts = copy_stream("high")

    def contiguous(direction):
        if direction == "h2d":
            cupy.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, nbytes, MEMCPY_DEFAULT, ts.ptr)
        else:
            cupy.cuda.runtime.memcpyAsync(host.ctypes.data, dev.data.ptr, nbytes, MEMCPY_DEFAULT, ts.ptr)

    contig = {dr: nbytes / _time(lambda dr=dr: contiguous(dr), ts, 5, back_to_back=4) / 1e9 for dr in ("h2d", "d2h")}
    emit(section="carveout", memory=memory, contiguous_gbps=contig)
    # (name, direction, carve-out k, launcher, force); launcher None: one contiguous copy-engine transfer
    methods = methods_fn() if methods_fn else first_methods()

    runs = (rng.permutation(n // 64)[:, None] * 64 + np.arange(64)).reshape(-1)
    for name, direction, k, la, force, *layout in methods:
        hs_ = runs if layout == ["runs"] else s
        src, sl, dst, dl = (host, hs_, dev, d) if direction == "h2d" else (dev, d, host, hs_)

        def xfer(la=la, force=force, direction=direction, src=src, sl=sl, dst=dst, dl=dl):
            if la is None:
                contiguous(direction)
            elif callable(la):
                la(src, sl, dst, dl, ts)
            else:
                la.launch(src, sl, dst, dl, seg, ts, force=force)
        _zero(dst, dl)
        t_x = _time(xfer, ts, 5, back_to_back=4)
        ok = _same(src, sl, dst, dl) if la is not None else None
        r = overlap_rounds(product, carve, cs, xfer, ts, t_x, k or 0, rounds, sampler)
        emit(section="carveout", memory=memory, method=name, dir=direction, carveout=k, layout=layout, alone_gbps=nbytes / t_x / 1e9,
             alone_ratio=nbytes / t_x / 1e9 / contig[direction], beside_ratio=nbytes / r["beside_s"] / 1e9 / contig[direction],
             vs_full=r["vs_full"], vs_carved=r["vs_carved"], carved_vs_full=r["carveout_cost"], ok=ok,
             clocks=r["clocks"], spread=r["vs_full_rounds"])
    sampler.close()


def first_methods() -> list:
    methods = [("contiguous", "h2d", None, None, None), ("contiguous", "d2h", None, None, None),
               ("none_bulk_8sm", "h2d", None, ring_launcher(8), "bulk")]
    for k in (4, 8):
        for ring, ctas in (((4, 2, 16 * KiB), 1), ((8, 6, 16 * KiB), 1), ((12, 10, 16 * KiB), 1), ((4, 2, 16 * KiB), 2)):
            for direction in ("h2d", "d2h"):
                methods.append((f"bulk_{ring[0]}x{ring[2] // KiB}k_c{ctas}", direction, k, ring_launcher(k, ring, ctas),
                                "bulk"))
        methods.append(("kernel_c4", "h2d", k, ring_launcher(k, kernel_ctas=4), "kernel"))
    return methods


def batch_fn(order: int = 1, flags: int = 0, streams: int = 1, block: int = 16 * KiB):
    """A transfer callable: cuMemcpyBatchAsync with the given source access order and flags,
    split over ``streams`` streams joined back into the caller's."""
    from tiercache.batchcopy import BatchCopy, _Attrs

    bc = BatchCopy()
    aux = [copy_stream("high") for _ in range(streams - 1)]
    keep = []

    def fn(src, sl, dst, dl, ts):
        srcs = np.uint64(ptr(src)) + sl.astype(np.uint64) * np.uint64(block)
        dsts = np.uint64(ptr(dst)) + dl.astype(np.uint64) * np.uint64(block)
        parts = np.array_split(np.arange(sl.size), streams)
        keep.clear()
        if aux:
            ev = ts.record()
            for a in aux:
                a.wait_event(ev)
        for p, st in zip(parts, [ts, *aux]):
            args = bc.prepare(dsts[p], srcs[p], np.full(p.size, block, dtype=np.uint64))
            args = (*args[:3], _Attrs(order, 0, 0, 0, 0, flags), *args[4:])
            keep.append(args)
            bc.launch(args, st.ptr)
        for a in aux:
            ts.wait_event(a.record())
    return fn if bc.available else None


def hybrid_fn(la: CopyLauncher, force: str, frac: float, streams: int = 2, block: int = 16 * KiB):
    """A transfer callable: ``frac`` of the blocks by cuMemcpyBatchAsync on ``streams`` auxiliary
    streams (copy engines), the rest by ``la`` on the caller's stream, at the same time."""
    bf = batch_fn(streams=streams, block=block)
    aux = copy_stream("high")
    seg = Segments(1, block, block)

    def fn(src, sl, dst, dl, ts):
        m = int(round(sl.size * frac))
        ev = ts.record()
        aux.wait_event(ev)
        if m:
            bf(src, sl[:m], dst, dl[:m], aux)
        la.launch(src, sl[m:], dst, dl[m:], seg, ts, force=force)
        ts.wait_event(aux.record())
    return fn


def hybrid(reps: int = 5) -> None:
    """16 KiB scattered h2d/d2h: the batched driver copy's variants alone, and a share of the
    blocks on the copy engines beside the bulk kernel on 8 SMs."""
    import cupy

    block, n = 16 * KiB, 16384
    _rng, host, _o, dev, cases, stream = scattered_case(13, n, block)
    nbytes = n * block
    for direction, src, s, dst, d in cases:
        sp, dp = ptr(src), ptr(dst)
        contig = nbytes / _time(lambda: cupy.cuda.runtime.memcpyAsync(dp, sp, nbytes, MEMCPY_DEFAULT, stream.ptr),
                                stream, reps, back_to_back=4) / 1e9
        variants = {}
        for order, flags, streams in ((1, 0, 1), (1, 1, 1), (3, 0, 1), (3, 1, 1), (1, 0, 2), (1, 0, 4), (3, 1, 4)):
            fn = batch_fn(order, flags, streams)
            if fn is not None:
                variants[f"batch_o{order}_f{flags}_s{streams}"] = fn
        la = ring_launcher(8)
        for frac in (0.0, 0.1, 0.2, 0.3):
            for streams in (2, 4):
                variants[f"hybrid_bulk8_f{frac}_s{streams}"] = hybrid_fn(la, "bulk", frac, streams)
        for name, fn in variants.items():
            _zero(dst, d)
            try:
                t = _time(lambda fn=fn: fn(src, s, dst, d, stream), stream, reps, back_to_back=4)
            except RuntimeError as exc:
                emit(section="hybrid", dir=direction, variant=name, error=str(exc))
                continue
            stream.synchronize()
            emit(section="hybrid", dir=direction, variant=name, gbps=nbytes / t / 1e9, ratio=nbytes / t / 1e9 / contig,
                 ok=_same(src, s, dst, d))


def second_methods() -> list:
    """Repeat the best carve-out configurations; look for a d2h one that does not slow compute."""
    r4 = (4, 2, 16 * KiB)
    methods = [("contiguous", "h2d", None, None, None), ("contiguous", "d2h", None, None, None),
               ("bulk_4x16k_c2", "h2d", 4, ring_launcher(4, r4, 2), "bulk"),
               ("bulk_4x16k_c3", "h2d", 4, ring_launcher(4, r4, 3), "bulk"),
               ("bulk_4x16k_c1", "h2d", 8, ring_launcher(8, r4, 1), "bulk"),
               ("kernel_c8", "h2d", 4, ring_launcher(4, kernel_ctas=8), "kernel")]
    for writes in (0, 1):
        for ctas in (1, 2, 3):
            methods.append((f"bulk_4x16k_c{ctas}_w{writes}", "d2h", 4, ring_launcher(4, r4, ctas, writes=writes), "bulk"))
    for kc in (2, 4, 8):
        methods.append((f"kernel_c{kc}", "d2h", 4, ring_launcher(4, kernel_ctas=kc), "kernel"))
    methods.append(("bulk_4x16k_c2", "d2h", 2, ring_launcher(2, r4, 2), "bulk"))
    for flags in (0, 1):
        fn = batch_fn(1, flags, 2)
        if fn is not None:
            methods.append((f"batch_f{flags}_s2", "h2d", None, fn, None))
    return methods


def third_methods() -> list:
    """The staged path (copy engines over PCIe, VRAM hop on the SMs the carve-out leaves) against
    the bulk kernel, h2d and d2h, host slots in runs of 64."""
    r4 = (4, 2, 16 * KiB)
    methods = [("contiguous", "h2d", None, None, None), ("contiguous", "d2h", None, None, None)]
    for k in (4, 8):
        for direction in ("h2d", "d2h"):
            la = ring_launcher(k, r4, 2)
            la.staged.hop_all_sms = False
            methods.append((f"staged_hop{k}sm", direction, k, la, "staged", "runs"))
            deep = ring_launcher(k, r4, 2)
            deep.staged.hop_all_sms = False
            deep.staged.chunk_bytes = 32 << 20
            methods.append((f"staged128M_hop{k}sm", direction, k, deep, "staged", "runs"))
    methods.append(("bulk_4x16k_c2", "h2d", 4, ring_launcher(4, r4, 2), "bulk"))
    methods.append(("bulk_4x16k_c2", "h2d", 4, ring_launcher(4, r4, 2), "bulk", "runs"))
    for direction in ("h2d", "d2h"):
        methods.append(("staged_burst", direction, None, ring_launcher(8, r4, 1), "staged", "runs"))
        la = ring_launcher(4, r4, 2)
        la.staged.hop_all_sms = False
        methods.append(("staged_hop4sm_nocarve", direction, None, la, "staged", "runs"))
    return methods


def fourth_methods() -> list:
    """The staged path's PCIe hop by one cudaMemcpyAsync per host run against the batched driver
    copy, beside the carved product; the shipped carve-out launcher for reference."""
    import types

    methods = [("contiguous", "h2d", None, None, None), ("contiguous", "d2h", None, None, None)]
    for k in (8, 4):
        methods.append(("shipped_bulk", "h2d", k, CopyLauncher(0, carveout_sms=k), None))
    for pcie in ("batch", "memcpy"):
        for direction in ("d2h", "h2d"):
            la = CopyLauncher(0, carveout_sms=8)
            if pcie == "memcpy":
                la.batch = types.SimpleNamespace(available=False)
            methods.append((f"staged_{pcie}", direction, 8, la, "staged", "runs"))
    return methods


def wc_methods() -> list:
    """The shipped launcher with 4 SMs carved out, onboards scattered and from host runs, and
    the staged offload into host runs."""
    methods = [("contiguous", "h2d", None, None, None), ("contiguous", "d2h", None, None, None)]
    for layout in ([], ["runs"]):
        methods.append(("shipped_carve4", "h2d", 4, CopyLauncher(0, carveout_sms=4), None, *layout))
    methods.append(("shipped_carve4", "d2h", 4, CopyLauncher(0, carveout_sms=4), None, "runs"))
    methods.append(("shipped_carve4_bulk", "d2h", 4, CopyLauncher(0, carveout_sms=4), "bulk"))
    return methods


def carve_wc() -> None:
    """The product beside onboards from ordinary and from write-combined pinned memory, in turn."""
    for memory in ("pinned", "wc", "pinned", "wc"):
        carveout(rounds=5, methods_fn=wc_methods, gemm_table=False, memory=memory)


def carve4() -> None:
    carveout(rounds=5, methods_fn=fourth_methods, gemm_table=False)


def carve3() -> None:
    carveout(rounds=5, methods_fn=third_methods, gemm_table=False)


def carve2() -> None:
    carveout(rounds=6, methods_fn=second_methods, gemm_table=False)


def batch_sizes(reps: int = 5) -> None:
    """Where the batched driver copy's host -> device cliff lies: 4096 copies of c bytes, 32 KiB
    apart at scattered slots on both sides, for c around 16 KiB, with each source access order
    (1 stream, 2 during the API call, 3 any) and the prefer-overlap flag; against contiguous."""
    import cupy

    from tiercache.batchcopy import BatchCopy, _Attrs
    from tiercache.benchcopy import _time_many

    bc = BatchCopy()
    if not bc.available:
        emit(section="batch_sizes", error="no cuMemcpyBatchAsync")
        return
    stride, n = 32 * KiB, 4096
    rng = np.random.default_rng(8)
    host, _o, dev = _bufs(n, stride, 0)
    ts = copy_stream("high")
    hs, ds = scattered_slots(rng, n), scattered_slots(rng, n)
    for c in (8 * KiB, 12 * KiB, 16 * KiB - 256, 16 * KiB, 16 * KiB + 256, 20 * KiB, 24 * KiB, 32 * KiB):
        for direction in ("h2d", "d2h"):
            src, sl, dst, dl = (host, hs, dev, ds) if direction == "h2d" else (dev, ds, host, hs)
            srcs = np.uint64(ptr(src)) + sl.astype(np.uint64) * np.uint64(stride)
            dsts = np.uint64(ptr(dst)) + dl.astype(np.uint64) * np.uint64(stride)
            fns = {"contig": lambda src=src, dst=dst, c=c: cupy.cuda.runtime.memcpyAsync(
                ptr(dst), ptr(src), n * c, MEMCPY_DEFAULT, ts.ptr)}
            keep = []
            for order, flags in ((1, 0), (2, 0), (3, 0), (1, 1), (3, 1)):
                args = bc.prepare(dsts, srcs, np.full(n, c, dtype=np.uint64))
                args = (*args[:3], _Attrs(order, 0, 0, 0, 0, flags), *args[4:])
                keep.append(args)
                fns[f"o{order}f{flags}"] = lambda args=args: bc.launch(args, ts.ptr)
            t = _time_many(fns, ts, reps, back_to_back=2)
            emit(section="batch_sizes", bytes=c, dir=direction, **{k: round(n * c / v / 1e9, 2) for k, v in t.items()},
                 us_per_copy={k: round(v / n * 1e6, 3) for k, v in t.items() if k != "contig"})


def split_sets(hs: np.ndarray, frac: float, rng, max_run: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Indices of a batch to send through the copy engines (whole runs of 2..``max_run``
    consecutive host slots, in random order, up to ``frac`` of the blocks) and the rest (to the
    SM kernel)."""
    order = np.argsort(hs, kind="stable")
    hsorted = hs[order]
    pos = np.arange(hs.size)
    starts = np.flatnonzero(np.concatenate(([True], np.diff(hsorted) != 1)))
    since = pos - starts[np.searchsorted(starts, pos, side="right") - 1]
    starts = np.flatnonzero((since % max_run) == 0)
    lengths = np.diff(np.concatenate((starts, [hs.size])))
    runs = [order[a:a + m] for a, m in zip(starts.tolist(), lengths.tolist()) if m >= 2]
    ce, total = [], 0
    for i in rng.permutation(len(runs)):
        if total + runs[i].size > frac * hs.size:
            continue
        ce.append(runs[i])
        total += runs[i].size
    ce = np.sort(np.concatenate(ce)) if ce else np.zeros(0, dtype=np.int64)
    rest = np.setdiff1d(np.arange(hs.size), ce)
    return ce, rest


def split(reps: int = 5, only: tuple = ()) -> None:
    """16 KiB blocks host <-> device split between the copy engines (the staged path: runs of
    >= 2 host slots, 32 KiB and up per copy, into staging VRAM, then a scatter kernel) and the
    bulk kernel on 8 SMs, running at once: do the two paths add up past the SMs' ceiling?"""
    import cupy

    from tiercache.benchcopy import _time_many

    block, n = 16 * KiB, 8192
    rng = np.random.default_rng(17)
    host, _o, dev = _bufs(n, block, 0, host_rows=2 * n)
    ds = scattered_slots(rng, n)
    layouts = {"scattered": rng.permutation(np.sort(rng.choice(2 * n, size=n, replace=False))),
               "host-runs": (rng.permutation(n // 64)[:, None] * 64 + np.arange(64)).reshape(-1)}
    la = CopyLauncher(0, max_sms=8)
    seg = Segments(1, block, block)
    ts, sa = copy_stream("high"), copy_stream("high")
    nbytes = n * block
    for layout, hs in layouts.items():
        if only and layout not in only:
            continue
        for direction in ("h2d", "d2h"):
            src, sl, dst, dl = (host, hs, dev, ds) if direction == "h2d" else (dev, ds, host, hs)
            fns = {"contig": lambda src=src, dst=dst: cupy.cuda.runtime.memcpyAsync(ptr(dst), ptr(src), nbytes,
                                                                                    MEMCPY_DEFAULT, ts.ptr),
                   "bulk": lambda src=src, sl=sl, dst=dst, dl=dl: la.launch(src, sl, dst, dl, seg, ts, force="bulk"),
                   "staged": lambda src=src, sl=sl, dst=dst, dl=dl: la.launch(src, sl, dst, dl, seg, ts, force="staged")}
            sets = {}
            for frac in (0.2, 0.35, 0.5, 0.65, 0.8):
                ce, rest = split_sets(hs, frac, rng)
                sets[frac] = (ce.size / n, ce, rest)

                def hybrid(src=src, sl=sl, dst=dst, dl=dl, ce=ce, rest=rest):
                    sa.wait_event(ts.record())
                    la.staged.copy(src, sl[ce], dst, dl[ce], ts)
                    la.launch(src, sl[rest], dst, dl[rest], seg, sa, force="bulk")
                    ts.wait_event(sa.record())
                fns[f"split{frac}"] = hybrid
            t = _time_many(fns, ts, reps, back_to_back=4)
            ok = {}
            for name in fns:  # each method alone into a zeroed destination
                if name != "contig":
                    _zero(dst, dl)
                    cupy.cuda.Device().synchronize()  # the zeroing ran on the default stream
                    fns[name]()
                    ts.synchronize()
                    ok[name] = _same(src, sl, dst, dl)
            emit(section="split", layout=layout, dir=direction, ok=all(ok.values()), bad=[k for k, v in ok.items() if not v],
                 **{k: round(t["contig"] / v, 3) for k, v in t.items() if k != "contig"},
                 contig_gbps=round(nbytes / t["contig"] / 1e9, 1),
                 ce_share={k: round(v[0], 2) for k, v in sets.items()})


def locality(reps: int = 5) -> None:
    """Does the SMs' host -> device ceiling depend on where in host memory the blocks lie?
    16 KiB blocks (128 MiB per request) by the bulk and gather kernels to scattered device slots,
    the host side sequential, in runs of 64, scattered over 256 MiB, or scattered (with repeats)
    within a small region that an IOMMU's translation cache could hold."""
    import cupy

    from tiercache.benchcopy import _time_many

    block, n = 16 * KiB, 8192
    rng = np.random.default_rng(23)
    host, _o, dev = _bufs(n, block, 0, host_rows=2 * n)
    ds = scattered_slots(rng, n)
    la = CopyLauncher(0, max_sms=8)
    seg = Segments(1, block, block)
    ts = copy_stream("high")
    nbytes = n * block
    layouts = {"sequential": np.arange(n), "runs64": (rng.permutation(n // 64)[:, None] * 64 + np.arange(64)).reshape(-1),
               "scattered_256MiB": rng.permutation(np.sort(rng.choice(2 * n, size=n, replace=False)))}
    for region_mib in (2, 8, 32):
        layouts[f"repeats_in_{region_mib}MiB"] = rng.integers(0, region_mib * MiB_ // block, size=n)
    fns = {"contig": lambda: cupy.cuda.runtime.memcpyAsync(ptr(dev), ptr(host), nbytes, MEMCPY_DEFAULT, ts.ptr),
           "contig_2MiB_pieces": lambda: [cupy.cuda.runtime.memcpyAsync(ptr(dev) + o, ptr(host) + o, 2 * MiB_,
                                                                        MEMCPY_DEFAULT, ts.ptr)
                                          for o in range(0, nbytes, 2 * MiB_)]}
    for name, hs in layouts.items():
        fns[f"bulk_{name}"] = lambda hs=hs: la.launch(host, hs, dev, ds, seg, ts, force="bulk")
        fns[f"kernel_{name}"] = lambda hs=hs: la.launch(host, hs, dev, ds, seg, ts, force="kernel")
    t = _time_many(fns, ts, reps, back_to_back=4)
    emit(section="locality", contig_gbps=round(nbytes / t["contig"] / 1e9, 1),
         **{k: round(t["contig"] / v, 3) for k, v in t.items() if k != "contig"})


def main(sections) -> None:
    funcs = {"locality": locality, "split_runs": lambda: split(only=("host-runs",)), "split": split, "batch_sizes": batch_sizes, "carve_wc": carve_wc, "sweep": sweep, "carveout": carveout, "hybrid": hybrid, "carve2": carve2, "carve3": carve3, "carve4": carve4, "hop": hop}
    for name in sections or list(funcs):
        try:
            funcs[name]()
        except Exception as exc:  # report and go on to the next section
            import traceback

            emit(section=name, error=repr(exc), tb=traceback.format_exc()[-1500:])



def hop(reps: int = 5) -> None:
    """The staged path's VRAM hop on a few SMs: device -> device scattered 16 KiB blocks by the
    bulk kernel and by the gather/scatter kernel, and the staged path alone with each."""
    import cupy

    rng = np.random.default_rng(14)
    block, n = 16 * KiB, 8192
    host, _o, dev = _bufs(n, block, 0)
    dev2 = cupy.empty_like(dev)
    s, d = scattered_slots(rng, n), scattered_slots(rng, n)
    runs = (rng.permutation(n // 64)[:, None] * 64 + np.arange(64)).reshape(-1)
    seg = Segments(1, block, block)
    ts = copy_stream("high")
    nbytes = n * block
    contig = nbytes / _time(lambda: cupy.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, nbytes, MEMCPY_DEFAULT,
                                                                   ts.ptr), ts, reps, back_to_back=4) / 1e9
    for k in (4, 8):
        for name, la, force in (("bulk_c2", ring_launcher(k, ctas=2), "bulk"), ("bulk_c3", ring_launcher(k, ctas=3), "bulk"),
                                ("bulk8_c2", ring_launcher(k, (8, 6, 16 * KiB), ctas=2), "bulk"),
                                ("bulk12_c1", ring_launcher(k, (12, 10, 16 * KiB), ctas=1), "bulk"),
                                ("kernel_c2", ring_launcher(k, kernel_ctas=2), "kernel"),
                                ("kernel_c8", ring_launcher(k, kernel_ctas=8), "kernel")):
            t = _time(lambda la=la, force=force: la.launch(dev, s, dev2, d, seg, ts, force=force), ts, reps, back_to_back=4)
            emit(section="hop", sms=k, variant=name, d2d_gbps=nbytes / t / 1e9)
            la.staged.hop_all_sms = False
            if force == "kernel":
                la._bulk = None  # the hop by the gather/scatter kernel
            for chunk in (16 << 20, 32 << 20):
                la.staged.chunk_bytes, la.staged._buf = chunk, None
                for direction in ("h2d", "d2h"):
                    src, sl, dst, dl = (host, runs, dev, d) if direction == "h2d" else (dev, d, host, runs)
                    t = _time(lambda la=la, src=src, sl=sl, dst=dst, dl=dl: la.launch(src, sl, dst, dl, seg, ts, force="staged"),
                              ts, reps, back_to_back=4)
                    emit(section="hop_staged", sms=k, variant=name, chunk=chunk, dir=direction, ratio=nbytes / t / 1e9 / contig)
        la = ring_launcher(k)
        la.staged.hop_all_sms = True
        for direction in ("h2d", "d2h"):
            src, sl, dst, dl = (host, runs, dev, d) if direction == "h2d" else (dev, d, host, runs)
            t = _time(lambda la=la, src=src, sl=sl, dst=dst, dl=dl: la.launch(src, sl, dst, dl, seg, ts, force="staged"),
                      ts, reps, back_to_back=4)
            emit(section="hop_staged", variant="burst_all_sms", dir=direction, ratio=nbytes / t / 1e9 / contig)


if __name__ == "__main__":
    main(sys.argv[1:])
