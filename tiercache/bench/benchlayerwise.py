"""``tiercache bench layerwise``: layer-wise onboarding against onboarding everything first.

A vLLM-style KV cache (``num_layers`` tensors ``[num_blocks, 2, block_size, num_kv_heads,
head_dim]``, bf16) is registered with :class:`~tiercache.enginetensors.devicepools.DevicePools`; ``blocks``
random blocks are offloaded to the host tier and onboarded back into scattered block ids
while a stand-in for attention (one bf16 matrix product per layer) runs on the engine's
stream:

- *all first*: the compute stream waits for the whole onboard, then runs every layer;
- *layer-wise*: the compute stream waits for layer ``i`` only before layer ``i``'s product.

Reported: the copy's time to its first layer and to all layers (CUDA events), each variant's
time from the onboard call to the last layer's compute, and the ratio. Every onboarded byte
is compared with what was offloaded.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np


def run_layerwise_bench(num_layers: int = 32, blocks: int = 256, num_blocks: int = 1024, block_size: int = 16,
                        num_kv_heads: int = 8, head_dim: int = 128, matmul_n: int = 4096, repeats: int = 5,
                        root: Path | None = None, log=print) -> dict:
    """Run the benchmark on the current CUDA device (needs CuPy); returns a JSON-ready report."""
    import cupy

    from tiercache.cache import TierCache
    from tiercache.enginetensors import DevicePools

    rng = np.random.default_rng(11)
    shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    caches = [cupy.asarray(rng.integers(1, 1 << 16, size=shape, dtype=np.uint16)) for _ in range(num_layers)]
    # uint16 stands in for bf16 (same size; CuPy has no bf16): blocks move as bytes
    pools = DevicePools.vllm(caches)
    src = rng.choice(num_blocks, blocks, replace=False).astype(np.int64)
    dst = rng.choice(num_blocks, blocks, replace=False).astype(np.int64)
    keys = [int(x) for x in rng.choice(1 << 40, blocks, replace=False)]
    a = cupy.asarray(rng.standard_normal((matmul_n, matmul_n), dtype=np.float32)).astype(cupy.float16)
    compute = cupy.cuda.Stream(non_blocking=True)
    work = Path(root or tempfile.gettempdir()) / "tiercache-layerwise-bench"
    rep: dict = {"job": "layerwise", "num_layers": num_layers, "blocks": blocks,
                 "bytes": blocks * sum(s.block_nbytes for s in pools.specs), "matmul_n": matmul_n, "runs": []}
    with TierCache.for_engine(pools, host_slots=blocks, root=work, fsync="none") as c:
        c.offload_slots(keys, src, wait=True)
        expect = [cp[src].get() for cp in caches]

        def layer_compute():
            return a @ a

        with compute:  # compute alone, for reference
            for _ in range(2):
                t0 = cupy.cuda.Event()
                t0.record(compute)
                for _ in range(num_layers):
                    layer_compute()
                t1 = cupy.cuda.Event()
                t1.record(compute)
                t1.synchronize()
        rep["compute_alone_ms"] = cupy.cuda.get_elapsed_time(t0, t1)
        for rep_i in range(repeats):
            for mode in ("all first", "layer-wise"):
                for cp in caches:
                    cp[dst] = 0
                compute.synchronize()
                cupy.cuda.Device().synchronize()
                with compute:
                    t_start = cupy.cuda.Event()
                    t_start.record(compute)
                    wall = time.perf_counter()
                    h = c.onboard_slots(keys, dst, layerwise=mode == "layer-wise", stream=compute)
                    issue_s = time.perf_counter() - wall
                    for i in range(num_layers):
                        if mode == "layer-wise":
                            h.wait_layer(i, compute)
                        layer_compute()
                    t_end = cupy.cuda.Event()
                    t_end.record(compute)
                    t_end.synchronize()
                job = h.job
                first = cupy.cuda.get_elapsed_time(job.start_event, job.group_events[0])
                total = cupy.cuda.get_elapsed_time(job.start_event, job.end_event)
                run = {"mode": mode, "repeat": rep_i, "first_layer_ms": first, "all_layers_ms": total,
                       "end_to_end_ms": cupy.cuda.get_elapsed_time(t_start, t_end), "issue_ms": issue_s * 1e3,
                       "path": job.path}
                run["ok"] = all(np.array_equal(cp[dst].get(), e) for cp, e in zip(caches, expect))
                rep["runs"].append(run)
                log(f"  {mode:<11} first layer {first:7.3f} ms  all layers {total:7.3f} ms  "
                    f"end to end {run['end_to_end_ms']:7.3f} ms  bytes {'ok' if run['ok'] else 'WRONG'}")
    best = {m: min((r for r in rep["runs"] if r["mode"] == m), key=lambda r: r["end_to_end_ms"])
            for m in ("all first", "layer-wise")}
    rep["best"] = best
    rep["speedup"] = best["all first"]["end_to_end_ms"] / best["layer-wise"]["end_to_end_ms"]
    rep["copy_gbps"] = rep["bytes"] / (best["all first"]["all_layers_ms"] / 1e3) / 1e9
    rep["ok"] = all(r["ok"] for r in rep["runs"])
    return rep


def format_layerwise_report(rep: dict) -> str:
    """The layer-wise benchmark as a table."""
    b = rep["best"]
    lines = [f"tiercache layer-wise onboarding: {rep['blocks']} blocks x {rep['num_layers']} layers "
             f"({rep['bytes'] / 2**20:.0f} MiB, host -> scattered device blocks), compute = one "
             f"{rep['matmul_n']}^2 fp16 matmul per layer ({rep['compute_alone_ms']:.2f} ms alone)", "",
             f"  {'mode':<12} {'first layer ms':>15} {'all layers ms':>14} {'end to end ms':>14}"]
    for m in ("all first", "layer-wise"):
        r = b[m]
        lines.append(f"  {m:<12} {r['first_layer_ms']:>15.3f} {r['all_layers_ms']:>14.3f} {r['end_to_end_ms']:>14.3f}")
    lines += ["", f"  layer-wise / all-first end to end: {rep['speedup']:.2f}x faster; copy "
                  f"{rep['copy_gbps']:.1f} GB/s; bytes {'verified' if rep['ok'] else 'WRONG'}"]
    return "\n".join(lines)
