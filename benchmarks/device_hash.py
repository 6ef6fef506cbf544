"""Block checksums on the GPU (:mod:`tiercache.files.devicehash`, ``kernels/xxh3.cu``) against the
host's: GB/s of XXH3-64 over ``--rows`` rows of ``--bs`` bytes, in device memory (CUDA events
around the kernels) and on one host core (the xxhash library, the function the file tier's
reads call), and a device-to-host copy of the same rows beside them (what checking a device
row on the host needs first). Every device checksum is compared with the library's.

    python3 benchmarks/device_hash.py --bs 2m --rows 32 --runs 20

Reproduces docs/vllm.md, "Checksums on the GPU".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    return int(text[:-1]) * units[text[-1].lower()] if text[-1].lower() in units else int(text)


def main() -> None:
    import cupy
    import xxhash

    from tiercache.files import devicehash

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bs", default="2m", help="bytes per row (block), e.g. 2m, 256k")
    ap.add_argument("--rows", type=int, default=32, help="rows per launch (a connector piece: 32)")
    ap.add_argument("--runs", type=int, default=20)
    a = ap.parse_args()
    bs = _size(a.bs)
    rng = np.random.default_rng()
    host = rng.integers(0, 256, (a.rows, bs), dtype=np.uint8)
    dev = cupy.asarray(host)
    out = cupy.empty(a.rows, dtype=cupy.uint64)
    h = devicehash.hasher(dev.device.id)
    stream = cupy.cuda.Stream(non_blocking=True)
    pinned = cupy.cuda.alloc_pinned_memory(host.nbytes)
    back = np.frombuffer(pinned, dtype=np.uint8, count=host.nbytes).reshape(host.shape)
    gpu, d2h, cpu = [], [], []
    for _ in range(a.runs):
        e0, e1, e2 = (cupy.cuda.Event() for _ in range(3))
        e0.record(stream)
        h.hash_rows(dev, out, stream)
        e1.record(stream)
        dev.get(stream=stream, out=back)
        e2.record(stream)
        e2.synchronize()
        gpu.append(cupy.cuda.get_elapsed_time(e0, e1) / 1e3)
        d2h.append(cupy.cuda.get_elapsed_time(e1, e2) / 1e3)
        t0 = time.perf_counter()
        want = [xxhash.xxh3_64_intdigest(back[i]) for i in range(a.rows)]
        cpu.append(time.perf_counter() - t0)
        assert out.get().tolist() == want, "the GPU's checksums differ from the library's"
    nbytes = host.nbytes
    print(json.dumps({
        "block_bytes": bs, "rows": a.rows, "runs": a.runs, "device": cupy.cuda.runtime.getDeviceProperties(
            dev.device.id)["name"].decode(),
        "gpu_hash_gbps": nbytes / statistics.median(gpu) / 1e9,
        "gpu_hash_us_per_launch": statistics.median(gpu) * 1e6,
        "d2h_copy_gbps": nbytes / statistics.median(d2h) / 1e9,
        "host_hash_gbps_one_core": nbytes / statistics.median(cpu) / 1e9,
        "checked": a.runs * a.rows}, indent=1))


if __name__ == "__main__":
    main()
