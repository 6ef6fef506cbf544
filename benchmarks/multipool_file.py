"""A vLLM-layout cache against fio: 32 per-layer pools of 64 KiB blocks (bf16, 16 tokens x K/V x
8 KV heads x head_dim 128), so one block is 32 files. The cache offloads whole blocks from the
host tier to files and onboards them back (``TierCache.offload`` / ``onboard``, the default
fsync policy ``data``); fio runs 64 KiB random writes (``end_fsync=1`` and ``fdatasync=1``) and
random reads at iodepth 32 on the same directory, alternated with the cache's passes. Every
onboarded byte is checked. The claim it reproduces: docs/experiments/files.md, "The native I/O
engine", the multi-pool case.

    python3 benchmarks/multipool_file.py [--root DIR] [--blocks 64] [--repeat 3] [--engine auto]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from tiercache import CacheConfig, PoolSpec, TierCache
from tiercache.bench.fiobase import run_fio
from tiercache.bench.fiospec import FioJob

LAYERS = 32
BLOCK_SHAPE = (16, 2, 8, 128)  # tokens_per_block, kv_factor, num_kv_heads, head_dim (bf16: 64 KiB)


def one_pass(root: Path, blocks: int, engine: str, rng: np.random.Generator) -> dict:
    pools = tuple(PoolSpec(f"layer{i}", BLOCK_SHAPE, "bfloat16") for i in range(LAYERS))
    cfg = CacheConfig(pools=pools, device_slots=0, host_slots=blocks, file_slots=blocks, root=root,
                      fsync="data", io_threads=32, io_engine=engine)
    nbytes = blocks * sum(p.block_nbytes for p in pools)
    with TierCache(cfg) as cache:
        keys = [rng.bytes(16) for _ in range(blocks)]  # content hashes
        data = {p.name: rng.integers(0, 256, (blocks, p.block_nbytes), dtype=np.uint8) for p in pools}
        cache.put(keys, data)
        t = time.perf_counter()
        cache.offload(keys, to="file")
        write_s = time.perf_counter() - t
        t = time.perf_counter()
        cache.onboard(keys, to="host")
        read_s = time.perf_counter() - t
        for p in pools:
            if not np.array_equal(cache.get(keys, pool=p.name).reshape(blocks, -1).view(np.uint8), data[p.name]):
                raise SystemExit(f"onboarded bytes differ in pool {p.name}")
        engine_ran = cache.stats()["tiers"]["file"]["io_engine"]
    shutil.rmtree(root)
    return {"write_GBps": nbytes / write_s / 1e9, "read_GBps": nbytes / read_s / 1e9, "engine": engine_ran}


def fio_pass(directory: Path, blocks: int) -> dict:
    n = blocks * LAYERS
    out = {}
    for key, rw, op, durable in (("fio_write_GBps", "randwrite", "write", False),
                                 ("fio_write_durable_GBps", "randwrite", "write", True),
                                 ("fio_read_GBps", "randread", "read", False)):
        job = FioJob(name="multipool", rw=rw, bs=65536, iodepth=32, direct=True)
        out[key] = run_fio(job, 65536, n, directory, op, durable=durable)["bw_bytes"] / 1e9
    shutil.rmtree(directory, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=None)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--engine", default="auto")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(dir=args.root))
    rng = np.random.default_rng()
    passes = []
    for _ in range(args.repeat):
        tc = one_pass(base / "cache", args.blocks, args.engine, rng)
        fio = fio_pass(base / "fio", args.blocks)
        passes.append({**tc, **fio, "write_ratio": tc["write_GBps"] / fio["fio_write_GBps"],
                       "write_ratio_durable": tc["write_GBps"] / fio["fio_write_durable_GBps"],
                       "read_ratio": tc["read_GBps"] / fio["fio_read_GBps"]})
    shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(p[k] for p in passes) for k in passes[0] if k != "engine"}
    print(json.dumps({"blocks": args.blocks, "pools": LAYERS, "block_bytes": 65536, "engine": passes[0]["engine"],
                      "median": med, "passes": passes}, indent=1))


if __name__ == "__main__":
    main()
