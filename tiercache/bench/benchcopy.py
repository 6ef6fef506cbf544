"""The copy benchmark: scattered block copies between pinned DRAM and VRAM, measured in one run
against the baselines on the same bytes.

For each block size (16 KiB, 64 KiB, 256 KiB, 2 MiB by default) and direction (h2d, d2h),
``blocks`` slots are copied with random, non-consecutive slot ids on both sides by:

- ``contiguous``: one ``cudaMemcpyAsync`` of all the bytes (the bus's ceiling, the reference);
- ``naive``: one ``cudaMemcpyAsync`` per block, from a Python loop;
- ``batch``: the driver's ``cuMemcpyBatchAsync`` (what vLLM uses), where the driver has it;
- ``tiercache``: the engine's launcher with its own path choice; ``kernel``, ``bulk`` and
  ``staged``: the gather/scatter kernel, the bulk-copy (TMA) kernel and the staged path (copy
  engines for host runs, the gather/scatter kernel in VRAM; host-runs layout only) forced.

Every figure is the median of ``reps`` runs timed with CUDA events, after a warm-up. It then
measures partial copies (first N tokens of each KV block) against a contiguous copy of the same
number of bytes, the planning cost per block of a 4096-block batch, and (:mod:`tiercache.bench.benchoverlap`)
a bf16 matrix product running alone and beside a stream of 16 KiB scattered transfers, by each
path, with and without an SM carve-out.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from tiercache.bench.timing import host_device_buffers, scattered_slots, time_many, time_one
from tiercache.copypaths import BatchCopy, CopyLauncher, Segments, segments_for
from tiercache.geometry import PoolSpec
from tiercache.memory import MEMCPY_DEFAULT
from tiercache.settings import TransferSettings

KiB = 1024
MiB = 1024 * KiB


def bench_scattered(sizes=(16 * KiB, 64 * KiB, 256 * KiB, 2 * MiB), total: int = 256 * MiB, reps: int = 7,
                    device_id: int = 0, copy_kernel_sms: int | None = None, seed: int = 0, log=print,
                    launcher_kw: dict | None = None) -> list[dict]:
    """Scattered host <-> device copies: GB/s of each method and ratios to contiguous."""
    import cupy

    rng = np.random.default_rng(seed)
    batch = BatchCopy()
    launcher = CopyLauncher(device_id, max_sms=copy_kernel_sms, **(launcher_kw or {}))
    rows = []
    with cupy.cuda.Device(device_id):
        stream = cupy.cuda.Stream(non_blocking=True)
        for block in sizes:
            n = max(8, total // block)
            host, _owner, dev = host_device_buffers(n, block, device_id, host_rows=2 * n)
            dev_scat = scattered_slots(rng, n)
            nbytes = n * block
            for direction, layout in (("h2d", "scattered"), ("d2h", "scattered"), ("h2d", "host-runs"),
                                      ("d2h", "host-runs")):
                # scattered: random slots on both sides (a random half of the host slots); host-runs: the host
                # side in runs of 64
                # consecutive slots (what the cache's allocator produces), the device side scattered
                if layout == "scattered":  # n of the 2n host slots, at random: runs average ~2 blocks
                    hs_ = rng.permutation(np.sort(rng.choice(2 * n, size=n, replace=False)))
                else:
                    hs_ = (
                        (rng.permutation(n // 64)[:, None] * 64 + np.arange(64)).reshape(-1)
                        if n >= 64
                        else np.arange(n)
                    )
                s, d = (hs_, dev_scat) if direction == "h2d" else (dev_scat, hs_)
                src, dst = (host, dev) if direction == "h2d" else (dev, host)
                sp, dp = (src.ctypes.data if isinstance(src, np.ndarray) else src.data.ptr,
                          dst.ctypes.data if isinstance(dst, np.ndarray) else dst.data.ptr)
                seg = Segments(1, block, block)
                res = {"block_bytes": block, "direction": direction, "layout": layout, "blocks": n, "bytes": nbytes,
                       "host_page_bytes": _owner.page_bytes}

                def contiguous():
                    cupy.cuda.runtime.memcpyAsync(dp, sp, nbytes, MEMCPY_DEFAULT, stream.ptr)

                s_l, d_l = (s * block).tolist(), (d * block).tolist()

                def naive():
                    for a, b in zip(s_l, d_l):
                        cupy.cuda.runtime.memcpyAsync(dp + b, sp + a, block, MEMCPY_DEFAULT, stream.ptr)

                path = []

                def ours():
                    path.append(launcher.launch(src, s, dst, d, seg, stream))

                def kernel():
                    launcher.launch(src, s, dst, d, seg, stream, force="kernel")

                def bulk():
                    launcher.launch(src, s, dst, d, seg, stream, force="bulk")

                res["naive_gbps"] = nbytes / time_one(naive, stream, max(3, reps // 2), warmup=1) / 1e9
                # the baseline and every method timed in turn (see time_many)
                fns = {"contiguous": contiguous, "tiercache": ours, "kernel": kernel}
                if batch.available:
                    args = batch.prepare(dp + d.astype(np.uint64) * block, sp + s.astype(np.uint64) * block,
                                         np.full(n, block, dtype=np.uint64))
                    try:
                        batch.launch(args, stream.ptr)
                        fns["batch"] = lambda: batch.launch(args, stream.ptr)
                    except RuntimeError as exc:
                        res["batch_error"] = str(exc)
                if launcher._bulk is not None:
                    fns["bulk"] = bulk
                if layout == "host-runs" and block <= launcher.staged.chunk_bytes:
                    fns["staged"] = lambda: launcher.launch(src, s, dst, d, seg, stream, force="staged")
                for name, t in time_many(fns, stream, reps, back_to_back=4).items():
                    res[f"{name}_gbps"] = nbytes / t / 1e9
                res["tiercache_idle_gbps"] = nbytes / time_one(ours, stream, reps) / 1e9
                res["tiercache_path"] = path[-1]
                # correctness of the timed path
                stream.synchronize()
                check = rng.choice(n, size=min(n, 16), replace=False)
                got = dst[d[check]] if isinstance(dst, np.ndarray) else dst[d[check]].get()
                want = src[s[check]] if isinstance(src, np.ndarray) else src[s[check]].get()
                res["verified"] = bool(np.array_equal(got, want))
                for k in ("naive", "batch", "tiercache", "kernel", "bulk", "staged"):
                    if f"{k}_gbps" in res:
                        res[f"{k}_ratio"] = res[f"{k}_gbps"] / res["contiguous_gbps"]
                rows.append(res)
                log(
                    f"  {layout} {block // KiB:>5} KiB {direction}: contiguous {res['contiguous_gbps']:.1f} GB/s, "
                    f"tiercache {res['tiercache_gbps']:.1f} ({res['tiercache_ratio']:.0%}, "
                    f"{res['tiercache_path']}), naive "
                    f"{res['naive_gbps']:.1f}, batch {res.get('batch_gbps', float('nan')):.1f}"
                )
            del host, dev
    return rows


def bench_partial(tokens=(1, 4, 8), blocks: int = 512, reps: int = 7, device_id: int = 0,
                  copy_kernel_sms: int | None = None, seed: int = 1, log=print, launcher_kw: dict | None = None,
                  huge_pages: str = "auto", layouts=("layer_major", "token_major")) -> list[dict]:
    """Partial copies (first N of 16 tokens) of Llama-3.1-8B KV blocks (2 MiB) in each of
    ``layouts``, against a contiguous copy of the same number of bytes; host blocks on huge pages
    as ``huge_pages`` asks (``auto``, ``on``, ``off``). Layer-major blocks give one segment of
    ``N * 256`` bytes per (layer, K/V, head), 4 KiB apart; token-major blocks one segment of
    ``N * 128 KiB``."""
    import cupy

    rng = np.random.default_rng(seed)
    launcher = CopyLauncher(device_id, max_sms=copy_kernel_sms, **(launcher_kw or {}))
    rows = []
    with cupy.cuda.Device(device_id):
        stream = cupy.cuda.Stream(non_blocking=True)
        for layout in layouts:
            pool = PoolSpec.kv("kv", num_layers=32, kv_factor=2, num_kv_heads=8, tokens_per_block=16, head_dim=128,
                               dtype="bfloat16", layout=layout)
            host, _owner, dev = host_device_buffers(blocks, pool.block_nbytes, device_id, huge_pages=huge_pages)
            s, d = scattered_slots(rng, blocks), scattered_slots(rng, blocks)
            for n_tok in tokens:
                seg = segments_for(pool, n_tok)
                moved = blocks * seg.nbytes
                for direction in ("h2d", "d2h"):
                    src, dst = (host, dev) if direction == "h2d" else (dev, host)
                    sp = src.ctypes.data if isinstance(src, np.ndarray) else src.data.ptr
                    dp = dst.ctypes.data if isinstance(dst, np.ndarray) else dst.data.ptr
                    t = time_many(
                        {
                            "c": lambda: cupy.cuda.runtime.memcpyAsync(dp, sp, moved, MEMCPY_DEFAULT, stream.ptr),
                            "p": lambda: launcher.launch(src, s, dst, d, seg, stream),
                        },
                        stream,
                        reps,
                        back_to_back=4,
                    )
                    t_c, t_p = t["c"], t["p"]
                    rows.append({"layout": layout, "num_tokens": n_tok, "direction": direction, "blocks": blocks,
                                 "bytes": moved, "host_page_bytes": _owner.page_bytes,
                                 "segment_bytes": seg.seg_bytes, "contiguous_gbps": moved / t_c / 1e9,
                                 "partial_gbps": moved / t_p / 1e9, "ratio": t_c / t_p})
                    log(f"  partial {layout} {n_tok:>2}/16 tokens {direction}: {moved / t_p / 1e9:.1f} GB/s vs "
                        f"contiguous {moved / t_c / 1e9:.1f} ({t_c / t_p:.0%}), segments of {seg.seg_bytes} B, host "
                        f"pages {_pages(_owner.page_bytes)}")
            del host, dev, _owner
    return rows


def bench_planning(blocks: int = 4096, block: int = 16 * KiB, reps: int = 20, device_id: int = 0, log=print) -> dict:
    """Host time of submitting one scattered 4096-block host -> device batch through the engine
    (validation, ordering, planning, offsets upload, launch), per block."""
    import cupy

    from tiercache.memory import make_device_tier, make_host_tier
    from tiercache.transfer import TransferEngine

    pool = PoolSpec("blk", (block,), "uint8")
    tiers = {"device": make_device_tier(blocks, (pool,), device_id), "host": make_host_tier(blocks, (pool,))}
    eng = TransferEngine(tiers, (pool,), device_id, settings=TransferSettings(copy_kernel_sms=None))  # all SMs
    rng = np.random.default_rng(2)
    s, d = scattered_slots(rng, blocks), scattered_slots(rng, blocks)
    eng.copy("host", s, "device", d).wait()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        job = eng.copy("host", s, "device", d)
        times.append(time.perf_counter() - t)
        job.wait()
    med = statistics.median(times)
    from tiercache.copypaths import contiguous_runs

    t = time.perf_counter()
    for _ in range(reps):
        contiguous_runs(s, d)
    plan_only = (time.perf_counter() - t) / reps
    cupy.cuda.Device(device_id).synchronize()
    res = {"blocks": blocks, "submit_us_per_block": med / blocks * 1e6, "plan_us_per_block": plan_only / blocks * 1e6}
    log(f"  planning: submit {res['submit_us_per_block']:.2f} us/block (plan only {res['plan_us_per_block']:.3f}) "
        f"for a {blocks}-block batch")
    return res


def run_copy_bench(quick: bool = False, device_id: int = 0, copy_kernel_sms: int | None = None, carveout: int = 4,
                   log=print) -> dict:
    """Every part of the copy benchmark; returns a JSON-ready report. ``carveout``: the SMs the
    overlap part's carve-out rows keep free of compute (0: no such rows)."""
    from tiercache.cuda import cuda_status

    st = cuda_status()
    if not st.available:
        from tiercache.errors import TierUnavailableError

        raise TierUnavailableError(f"the copy benchmark needs a GPU: {st.reason}")
    total = 64 * MiB if quick else 256 * MiB
    rep = {"job": "copy", "device": st.reason, "copy_kernel_sms": copy_kernel_sms}
    rep["scattered"] = bench_scattered(total=total, device_id=device_id, copy_kernel_sms=copy_kernel_sms, log=log)
    rep["partial"] = bench_partial(
        blocks=128 if quick else 512, device_id=device_id, copy_kernel_sms=copy_kernel_sms, log=log
    )
    rep["planning"] = bench_planning(device_id=device_id, log=log)
    from tiercache.bench.benchoverlap import bench_overlap

    rep["overlap"] = bench_overlap(iters=5 if quick else 20, rounds=3 if quick else 5, carveout=carveout,
                                   copy_kernel_sms=copy_kernel_sms, device_id=device_id, log=log)
    rep["ok"] = all(r.get("verified", True) for r in rep["scattered"])
    return rep


def _pages(nbytes: int) -> str:
    """A page size for the tables: ``4 KiB``, ``2 MiB``."""
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def format_copy_report(rep: dict) -> str:
    """The copy benchmark as tables."""
    pages = _pages(rep["scattered"][0].get("host_page_bytes", 4 * KiB)) if rep["scattered"] else "?"
    out = [
        f"tiercache copy benchmark on {rep['device']} (copy kernel SMs: {rep['copy_kernel_sms'] or 'all'}; "
        f"host memory on {pages} pages)",
        "",
        f"  {'block':>8} {'dir':>4} {'host side':>10} {'contig GB/s':>12} {'tiercache':>10} {'ratio':>6} "
        f"{'path':>7} {'kernel':>7} "
        f"{'ratio':>6} {'bulk':>7} {'ratio':>6} {'staged':>7} {'ratio':>6} {'naive':>7} {'ratio':>6} {'batch':>7} "
        f"{'ratio':>6}",
    ]
    for r in rep["scattered"]:
        out.append(
            f"  {r['block_bytes'] // KiB:>5} KiB {r['direction']:>4} {r['layout']:>10} {r['contiguous_gbps']:>12.1f} "
            f"{r['tiercache_gbps']:>10.1f} {r['tiercache_ratio']:>6.0%} {r['tiercache_path']:>7} "
            f"{r['kernel_gbps']:>7.1f} {r['kernel_ratio']:>6.0%} {r.get('bulk_gbps', float('nan')):>7.1f} "
            f"{r.get('bulk_ratio', float('nan')):>6.0%} {r.get('staged_gbps', float('nan')):>7.1f} "
            f"{r.get('staged_ratio', float('nan')):>6.0%} {r['naive_gbps']:>7.1f} "
            f"{r['naive_ratio']:>6.0%} {r.get('batch_gbps', float('nan')):>7.1f} "
            f"{r.get('batch_ratio', float('nan')):>6.0%}"
        )
    out += ["", f"  {'partial':>12} {'layout':>11} {'dir':>4} {'segment B':>10} {'host pages':>10} {'GB/s':>7} "
                f"{'contig':>7} {'ratio':>6}"]
    for r in rep["partial"]:
        out.append(
            f"  {r['num_tokens']:>5}/16 tok {r.get('layout', 'layer_major'):>11} {r['direction']:>4} "
            f"{r['segment_bytes']:>10} "
            f"{_pages(r.get('host_page_bytes', 4 * KiB)):>10} {r['partial_gbps']:>7.1f} "
            f"{r['contiguous_gbps']:>7.1f} {r['ratio']:>6.0%}"
        )
    p = rep["planning"]
    out += ["", f"  planning a {p['blocks']}-block batch: {p['submit_us_per_block']:.2f} us/block submit "
                f"({p['plan_us_per_block']:.3f} us/block run planning)"]
    from tiercache.bench.benchoverlap import format_overlap_report

    out += ["", format_overlap_report(rep["overlap"])]
    return "\n".join(out)
