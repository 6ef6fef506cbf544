"""Copies beside compute: a large bf16 matrix product alone and beside a stream of scattered
16 KiB transfers, by each copy path, with and without an SM carve-out.

A copy kernel takes SMs from compute and the copy engines take none, so the question is what
each path keeps of its bandwidth beside the product and what it costs the product. The product
(``iters`` GEMMs of ``matmul``^3, PyTorch, one after another on their own stream) runs in
``rounds`` rounds of three timings each, back to back so that clock drift (the GEMM runs at the
board's power limit, and its time moves by several percent between runs on the same machine)
hits all three alike:

1. the product alone, on every SM (the baseline: what the engine runs without tiercache);
2. the product alone with the carve-out (cuBLASLt sized for ``multiprocessors - k`` SMs,
   :func:`tiercache.sm_carveout`), for methods that use one;
3. the product (carved where the method uses a carve-out) beside enough transfers, queued up
   front, to span it.

Reported per method: transfer bandwidth alone and beside the product (as a share of one
contiguous ``cudaMemcpyAsync`` of the same bytes), and the medians over rounds of the product's
slowdown against the full product alone (``vs_full``: the whole cost) and against the carved
product alone (``vs_carved``: what the transfers add), with the per-round figures and the SM
clock, board power and power-cap share (NVML, where available) of the last round.
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np

from tiercache.bench.gpumon import ClockSampler
from tiercache.bench.timing import host_device_buffers, scattered_slots, time_one
from tiercache.copypaths import CopyLauncher, Segments
from tiercache.memory import MEMCPY_DEFAULT, data_ptr

KiB = 1024


def make_product(matmul: int, iters: int, device_id: int):
    """``(product, carve, stream, engine)``: ``product()`` enqueues ``iters`` bf16 GEMMs of
    ``matmul``^3 on ``stream`` (a CuPy external stream over PyTorch's), with the SM carve-out
    ``carve[0]`` (0: none; needs PyTorch). Without PyTorch, CuPy fp16 GEMMs and no carve-out."""
    import cupy

    carve = [0]
    try:
        import torch

        from tiercache.transfer import sm_carveout

        a = torch.randn((matmul, matmul), device=f"cuda:{device_id}", dtype=torch.bfloat16)
        b = torch.randn((matmul, matmul), device=f"cuda:{device_id}", dtype=torch.bfloat16)
        cstream = torch.cuda.Stream(device=device_id)

        def gemms():
            with torch.cuda.stream(cstream):
                for _ in range(iters):
                    torch.matmul(a, b)

        def product():
            if carve[0]:
                with sm_carveout(carve[0]):
                    gemms()
            else:
                gemms()
        return product, carve, cupy.cuda.ExternalStream(cstream.cuda_stream), "torch"
    except ImportError:
        a = cupy.random.standard_normal((matmul, matmul), dtype=cupy.float32).astype(cupy.float16)
        b = cupy.random.standard_normal((matmul, matmul), dtype=cupy.float32).astype(cupy.float16)
        cs = cupy.cuda.Stream(non_blocking=True)

        def product():
            with cs:
                for _ in range(iters):
                    cupy.matmul(a, b)
        return product, None, cs, "cupy-fp16"


def _timed(fn, stream, sampler: ClockSampler) -> tuple[float, dict]:
    """Seconds of ``fn()`` on ``stream`` by CUDA events, from an idle device, and the clocks."""
    import cupy

    a, b = cupy.cuda.Event(), cupy.cuda.Event()
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    a.record(stream)
    fn()
    b.record(stream)
    b.synchronize()
    return cupy.cuda.get_elapsed_time(a, b) / 1e3, sampler.window(t0, time.perf_counter())


def overlap_rounds(product, carve, cs, xfer, ts, t_xfer: float, k: int, rounds: int, sampler: ClockSampler) -> dict:
    """``rounds`` rounds of: the product alone on every SM, alone with carve-out ``k`` (when
    ``k``), and with carve-out ``k`` beside ``ceil(product / t_xfer)`` calls of ``xfer()`` on
    ``ts`` queued up front, after one round not counted (the first round after a method change
    read 10-20% slow on the H100 test machines). Returns medians (see the module docstring);
    ``beside_s`` is the transfers' span per call."""
    import cupy

    rows = []
    for _ in range(rounds + 1):
        carve[0] = 0
        t_full, w_full = _timed(product, cs, sampler)
        carve[0] = k
        t_carved, w_carved = _timed(product, cs, sampler) if k else (t_full, w_full)
        n_x = max(2, math.ceil(t_carved / t_xfer))
        ev = [cupy.cuda.Event() for _ in range(4)]
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        ev[0].record(cs)
        ev[2].record(ts)
        product()
        for _ in range(n_x):
            xfer()
        ev[1].record(cs)
        ev[3].record(ts)
        ev[1].synchronize()
        ev[3].synchronize()
        w_with = sampler.window(t0, time.perf_counter())
        t_with = cupy.cuda.get_elapsed_time(ev[0], ev[1]) / 1e3
        span = cupy.cuda.get_elapsed_time(ev[2], ev[3]) / 1e3 / n_x
        rows.append((t_full, t_carved, t_with, span, (w_full, w_carved, w_with)))
    carve[0] = 0
    rows = rows[1:]  # the warm-up round
    return {"product_s": statistics.median(r[0] for r in rows), "beside_s": statistics.median(r[3] for r in rows),
            "vs_full": statistics.median(r[2] / r[0] - 1 for r in rows),
            "vs_carved": statistics.median(r[2] / r[1] - 1 for r in rows),
            "carveout_cost": statistics.median(r[1] / r[0] - 1 for r in rows),
            "vs_full_rounds": [round(r[2] / r[0] - 1, 3) for r in rows],
            "clocks": dict(zip(("full", "carved", "beside"), rows[-1][4]))}


def _same(src, s, dst, d, rng) -> bool:
    pick = rng.choice(s.size, size=min(s.size, 32), replace=False)
    got = dst[d[pick]] if isinstance(dst, np.ndarray) else dst[d[pick]].get()
    want = src[s[pick]] if isinstance(src, np.ndarray) else src[s[pick]].get()
    return bool(np.array_equal(got, want))


def bench_overlap(block: int = 16 * KiB, blocks: int = 8192, matmul: int = 8192, iters: int = 20, rounds: int = 5,
                  carveout: int = 4, copy_kernel_sms: int | None = 8, device_id: int = 0, log=print) -> dict:
    """The product alone and beside ``blocks`` scattered ``block``-byte transfers per request, by
    each method (see the module docstring); ``carveout``: the SMs the carve-out rows keep free
    (0: none), ``copy_kernel_sms``: the SM bound of the rows without one (the default config's)."""
    import cupy

    from tiercache.memory import copy_stream

    rng = np.random.default_rng(3)
    with cupy.cuda.Device(device_id):
        product, carve, cs, engine = make_product(matmul, iters, device_id)
        host, _owner, dev = host_device_buffers(blocks, block, device_id, host_rows=2 * blocks)
        scattered = np.sort(rng.choice(2 * blocks, size=blocks, replace=False))
        layouts = {"scattered": rng.permutation(scattered),  # host runs of ~2 blocks
                   "host-runs": (rng.permutation(blocks // 64)[:, None] * 64 + np.arange(64)).reshape(-1)}
        ds = scattered_slots(rng, blocks)
        nbytes = blocks * block
        seg = Segments(1, block, block)
        ts = copy_stream("high")
        sampler = ClockSampler(device_id)

        def contiguous(direction):
            d_, s_ = (data_ptr(dev), data_ptr(host)) if direction == "h2d" else (data_ptr(host), data_ptr(dev))
            cupy.cuda.runtime.memcpyAsync(d_, s_, nbytes, MEMCPY_DEFAULT, ts.ptr)

        contig = {d: nbytes / time_one(lambda d=d: contiguous(d), ts, 5, back_to_back=4) / 1e9 for d in ("h2d", "d2h")}
        time_one(product, cs, 2)  # warm-up: clocks, cuBLAS's choices
        t_full = time_one(product, cs, 3)
        res = {"matmul": matmul, "iters": iters, "rounds": rounds, "engine": engine, "block_bytes": block,
               "blocks": blocks, "product_alone_s": t_full, "product_tflops": 2 * matmul ** 3 * iters / t_full / 1e12,
               "contiguous_gbps": contig, "carveout": carveout if carve is not None else 0,
               "clock_samples": sampler.available, "runs": []}
        log(f"  overlap: {matmul}^3 bf16 product x{iters} alone {t_full * 1e3:.1f} ms ({res['product_tflops']:.0f} "
            f"TFLOP/s); contiguous {contig['h2d']:.1f} GB/s h2d, {contig['d2h']:.1f} d2h")
        default = CopyLauncher(device_id, max_sms=copy_kernel_sms)
        # (name, direction, host layout, carve-out, launcher, force); launcher None: contiguous
        methods = [
            ("contiguous", "h2d", "-", 0, None, None),
            ("contiguous", "d2h", "-", 0, None, None),
            ("tiercache", "h2d", "scattered", 0, default, None),
            ("tiercache", "d2h", "scattered", 0, default, None),
            ("tiercache", "h2d", "host-runs", 0, default, None),
            ("tiercache", "d2h", "host-runs", 0, default, None),
            ("batch", "h2d", "scattered", 0, default, "batch"),
            (
                "bulk_small_all_sms",
                "h2d",
                "scattered",
                0,
                CopyLauncher(device_id, bulk_shape="small", bulk_sms=1024),
                "bulk",
            ),
        ]
        if res["carveout"]:
            carved = CopyLauncher(device_id, carveout_sms=carveout)
            methods += [("tiercache", dr, lay, carveout, carved, None) for dr in ("h2d", "d2h")
                        for lay in ("scattered", "host-runs")]
        for name, direction, layout, k, la, force in methods:
            hs = layouts.get(layout, layouts["scattered"])
            src, sl, dst, dl = (host, hs, dev, ds) if direction == "h2d" else (dev, ds, host, hs)
            path = []

            def xfer(la=la, force=force, direction=direction, src=src, sl=sl, dst=dst, dl=dl):
                if la is None:
                    contiguous(direction)
                else:
                    path.append(la.launch(src, sl, dst, dl, seg, ts, force=force))
            if force in ("bulk", "batch") and not (la.bulk_available if force == "bulk" else la.batch.available):
                continue
            t_x = time_one(xfer, ts, 5, back_to_back=4)
            ok = _same(src, sl, dst, dl, rng) if la is not None else None
            r = overlap_rounds(product, carve or [0], cs, xfer, ts, t_x, k, rounds, sampler)
            row = {"method": name, "direction": direction, "layout": layout, "carveout": k,
                   "path": path[-1] if path else "memcpy", "ok": ok, "alone_gbps": nbytes / t_x / 1e9,
                   "alone_ratio": nbytes / t_x / 1e9 / contig[direction], "beside_gbps": nbytes / r["beside_s"] / 1e9,
                   "beside_ratio": nbytes / r["beside_s"] / 1e9 / contig[direction], **r}
            res["runs"].append(row)
            log(
                f"  overlap {name:>18} {direction} {layout:>9} carve-out {k}: {row['path']}, alone "
                f"{row['alone_ratio']:.0%}, "
                f"beside {row['beside_ratio']:.0%} of contiguous; product {row['vs_full']:+.1%} "
                f"(carve-out {row['carveout_cost']:+.1%}, transfers {row['vs_carved']:+.1%})"
            )
        sampler.close()
    return res


def format_overlap_report(o: dict) -> str:
    """The overlap table."""
    c = o["contiguous_gbps"]
    out = [f"  {o['matmul']}^3 bf16 product x{o['iters']}: {o['product_alone_s'] * 1e3:.1f} ms alone "
           f"({o['product_tflops']:.0f} TFLOP/s); contiguous {c['h2d']:.1f} GB/s h2d, {c['d2h']:.1f} d2h; "
           f"{o['blocks']} x {o['block_bytes'] // KiB} KiB per request; medians of {o['rounds']} rounds",
           f"  {'method':>18} {'dir':>4} {'host side':>10} {'carve':>5} {'path':>8} {'alone':>6} {'beside':>7} "
           f"{'product':>8} {'carve-out':>9} {'transfers':>9}"]
    for r in o["runs"]:
        out.append(f"  {r['method']:>18} {r['direction']:>4} {r['layout']:>10} {r['carveout']:>5} {r['path']:>8} "
                   f"{r['alone_ratio']:>6.0%} {r['beside_ratio']:>7.0%} {r['vs_full']:>+8.1%} "
                   f"{r['carveout_cost']:>+9.1%} {r['vs_carved']:>+9.1%}")
    out.append("  (alone, beside: % of contiguous; product: slowdown vs the product alone on every SM = carve-out "
               "+ transfers)")
    return "\n".join(out)
