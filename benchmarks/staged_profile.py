"""Experiment: the staged path alone, 16 KiB blocks, host runs of 64: host submit time per
request and GPU time per request, by direction, PCIe streams and chunk size, against one
contiguous copy; and the bulk kernel for reference. Prints one JSON object per line."""

from __future__ import annotations

import json
import time

import numpy as np

from tiercache.benchcopy import _time_many
from tiercache.copykernels import CopyLauncher, Segments
from tiercache.memcopy import MEMCPY_DEFAULT
from tiercache.memcopy import data_ptr as ptr
from copy_variants import scattered_case

KiB = 1024


def main() -> None:
    import cupy

    block, n = 16 * KiB, 16384
    rng, host, _k, dev, _cases, st = scattered_case(21, n, block)
    runs = (rng.permutation(n // 64)[:, None] * 64 + np.arange(64)).reshape(-1)
    ds = rng.permutation(n)
    seg = Segments(1, block, block)
    nbytes = n * block
    for direction in ("d2h", "h2d"):
        src, s, dst, d = (dev, ds, host, runs) if direction == "d2h" else (host, runs, dev, ds)
        fns = {"contiguous": lambda: cupy.cuda.runtime.memcpyAsync(ptr(dst), ptr(src), nbytes, MEMCPY_DEFAULT, st.ptr)}
        las = {}
        for streams in (1, 2, 4):
            for chunk in (16 << 20, 32 << 20):
                la = CopyLauncher(0, max_sms=8, batch_streams=streams)
                la.staged.chunk_bytes = chunk
                las[f"staged_s{streams}_c{chunk >> 20}M"] = la
                fns[f"staged_s{streams}_c{chunk >> 20}M"] = lambda la=la: la.launch(src, s, dst, d, seg, st, force="staged")
        bulk = CopyLauncher(0, max_sms=8)
        fns["bulk"] = lambda: bulk.launch(src, s, dst, d, seg, st, force="bulk")
        t = _time_many(fns, st, 7, back_to_back=4)
        for name, sec in t.items():
            row = {"dir": direction, "variant": name, "ratio": t["contiguous"] / sec, "gpu_ms": sec * 1e3}
            if name in las:  # host submit time of one request, stream idle
                subs = []
                for _ in range(5):
                    st.synchronize()
                    t0 = time.perf_counter()
                    fns[name]()
                    subs.append(time.perf_counter() - t0)
                row["submit_ms"] = float(np.median(subs)) * 1e3
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
