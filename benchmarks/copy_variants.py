"""Experiment: SM-driven copy variants for scattered 16/64 KiB host <-> device blocks.

Compares, in one run on the same bytes: one contiguous cudaMemcpyAsync (the ceiling), the
shipped gather/scatter kernel (copy_blocks.cu), the same loads with an L2 256-byte prefetch
hint, and TMA bulk copies (copy_bulk.cu) in several grid/chunk shapes; then, beside a bf16
matrix product, the shipped kernel at 8 SMs against bulk copies with few CTAs. Prints one JSON
object per line and a summary. Usage: python benchmarks/copy_variants.py [--quick]
"""

from __future__ import annotations

import json
import sys

import numpy as np

from tiercache.benchcopy import _bufs, _time, run_beside, scattered_slots
from tiercache.copykernels import CopyLauncher, Segments
from tiercache.kernels.loader import KERNEL_DIR
from tiercache.memcopy import MEMCPY_DEFAULT

HINT_SRC = r"""
extern "C" __global__ void hint_copy(const unsigned char* src_base, unsigned char* dst_base,
                                     const long long* src_off, const long long* dst_off,
                                     long long n_blocks, long long block_bytes) {
    const long long cpb = block_bytes / 16, total = cpb * n_blocks;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < total; g += stride * 8) {
        uint4 v[8]; uint4* d[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const long long c = g + u * stride; d[u] = nullptr;
            if (c < total) {
                const long long blk = c / cpb, off = (c - blk * cpb) * 16;
                const uint4* p = reinterpret_cast<const uint4*>(src_base + src_off[blk] + off);
                asm volatile("ld.global.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                             : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(p));
                d[u] = reinterpret_cast<uint4*>(dst_base + dst_off[blk] + off);
            }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) if (d[u]) *d[u] = v[u];
    }
}
"""


def main(quick: bool = False) -> None:
    import cupy

    dev_id = 0
    sms = cupy.cuda.Device(dev_id).attributes["MultiProcessorCount"]
    bulk = cupy.RawModule(code=(KERNEL_DIR / "copy_bulk.cu").read_text(), options=("-std=c++17",)).get_function("tc_bulk_copy")
    hint = cupy.RawModule(code=HINT_SRC, options=("-std=c++17",)).get_function("hint_copy")
    bulk.max_dynamic_shared_size_bytes = 4 * 32768
    launcher = CopyLauncher(dev_id, max_sms=None)
    launcher8 = CopyLauncher(dev_id, max_sms=8)
    stream = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    rows = []
    reps = 3 if quick else 7
    for block in (16384, 65536):
        n = (128 << 20) // block
        host, _o, dev = _bufs(n, block, dev_id, host_rows=2 * n)
        hs = rng.permutation(np.sort(rng.choice(2 * n, size=n, replace=False)))
        ds = scattered_slots(rng, n)
        nbytes = n * block
        for direction in ("h2d", "d2h"):
            s, d = (hs, ds) if direction == "h2d" else (ds, hs)
            src, dst = (host, dev) if direction == "h2d" else (dev, host)
            sp = src.ctypes.data if isinstance(src, np.ndarray) else src.data.ptr
            dp = dst.ctypes.data if isinstance(dst, np.ndarray) else dst.data.ptr
            so, do = cupy.asarray(s * block), cupy.asarray(d * block)
            seg = Segments(1, block, block)
            contig = nbytes / _time(lambda: cupy.cuda.runtime.memcpyAsync(dp, sp, nbytes, MEMCPY_DEFAULT, stream.ptr),
                                    stream, reps) / 1e9
            variants = {
                "kernel_all": lambda: launcher.launch(src, s, dst, d, seg, stream, force="kernel"),
                "kernel_8sm": lambda: launcher8.launch(src, s, dst, d, seg, stream, force="kernel"),
                "hint_all": lambda: hint((sms * 2,), (256,), (np.uint64(sp), np.uint64(dp), so, do, np.int64(n),
                                                             np.int64(block)), stream=stream),
            }
            for ctas in (1, 2, 4):
                for chunk in (8192, 16384, 32768):
                    if chunk > block:
                        continue
                    def run(ctas=ctas, chunk=chunk):
                        bulk((sms * ctas,), (32,), (np.uint64(sp), np.uint64(dp), so, do, np.int64(n), np.int64(block),
                                                    np.int64(chunk)), stream=stream, shared_mem=4 * chunk)
                    variants[f"bulk_{ctas}x{sms}_c{chunk // 1024}k"] = run
            for ctas in (8, 16, 32):
                def run_few(ctas=ctas):
                    bulk((ctas,), (32,), (np.uint64(sp), np.uint64(dp), so, do, np.int64(n), np.int64(block),
                                          np.int64(16384)), stream=stream, shared_mem=4 * 16384)
                variants[f"bulk_{ctas}cta_c16k"] = run_few
            for name, fn in variants.items():
                if isinstance(dst, np.ndarray):
                    dst[d] = 0
                else:
                    dst[cupy.asarray(d)] = 0
                try:
                    t = _time(fn, stream, reps)
                except Exception as exc:  # a variant that faults: report and go on
                    print(json.dumps({"block": block, "dir": direction, "variant": name, "error": str(exc)}))
                    sys.stdout.flush()
                    raise
                stream.synchronize()
                got = dst[d] if isinstance(dst, np.ndarray) else dst[cupy.asarray(d)].get()
                want = src[s] if isinstance(src, np.ndarray) else src[cupy.asarray(s)].get()
                row = {"block": block, "dir": direction, "variant": name, "gbps": nbytes / t / 1e9, "contig": contig,
                       "ratio": nbytes / t / 1e9 / contig, "ok": bool(np.array_equal(got, want))}
                rows.append(row)
                print(json.dumps(row))
                sys.stdout.flush()
        del host, dev
    overlap(sms, bulk, launcher8, quick)
    print("SUMMARY")
    for r in rows:
        print(f"  {r['block'] // 1024:>3} KiB {r['dir']} {r['variant']:<22} {r['gbps']:6.1f} GB/s {r['ratio']:5.0%} "
              f"{'ok' if r['ok'] else 'WRONG'}")


def overlap(sms, bulk, launcher8, quick) -> None:
    """bf16 product alone and beside 16 KiB h2d transfers (shipped kernel at 8 SMs, bulk with few CTAs)."""
    import cupy
    import torch

    block, blocks, mm, iters = 16384, 8192, 8192, 20
    a = torch.randn((mm, mm), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((mm, mm), device="cuda", dtype=torch.bfloat16)
    cst = torch.cuda.Stream()
    cs = cupy.cuda.ExternalStream(cst.cuda_stream)

    def product():
        with torch.cuda.stream(cst):
            for _ in range(iters):
                torch.matmul(a, b)

    rng = np.random.default_rng(3)
    host, _o, dev = _bufs(blocks, block, 0)
    s, d = scattered_slots(rng, blocks), scattered_slots(rng, blocks)
    so, do = cupy.asarray(s * block), cupy.asarray(d * block)
    nbytes = blocks * block
    ts = cupy.cuda.Stream(non_blocking=True)
    t_prod = _time(product, cs, 5)
    contig = nbytes / _time(lambda: cupy.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, nbytes,
                                                                   MEMCPY_DEFAULT, ts.ptr), ts, 5) / 1e9
    seg = Segments(1, block, block)
    methods = {"kernel_8sm": lambda: launcher8.launch(host, s, dev, d, seg, ts, force="kernel")}
    for ctas in (8, 16, 32, 64):
        for chunk in (16384, 32768):
            methods[f"bulk_{ctas}cta_c{chunk // 1024}k"] = (
                lambda ctas=ctas, chunk=chunk: bulk((ctas,), (32,), (np.uint64(host.ctypes.data), np.uint64(dev.data.ptr),
                                                                     so, do, np.int64(blocks), np.int64(block),
                                                                     np.int64(chunk)), stream=ts, shared_mem=4 * chunk))
    for name, xfer in methods.items():
        t_alone = _time(xfer, ts, 5)
        n_x, t_with, span = run_beside(product, cs, xfer, ts, t_prod / t_alone)
        row = {"overlap": name, "alone_gbps": nbytes / t_alone / 1e9, "alone_ratio": nbytes / t_alone / 1e9 / contig,
               "beside_gbps": n_x * nbytes / span / 1e9, "product_slowdown": t_with / t_prod - 1, "contig": contig}
        row["beside_ratio"] = row["beside_gbps"] / contig
        print(json.dumps(row))
        print(f"  overlap {name:<18} alone {row['alone_ratio']:5.0%}  beside {row['beside_ratio']:5.0%}  "
              f"product {row['product_slowdown']:+.1%}")
        sys.stdout.flush()


if __name__ == "__main__":
    main("--quick" in sys.argv)
