"""Two engine processes on one shared root: A offloads a sequence's blocks from its KV-cache
tensors to files, B (started after A) onboards each into its own tensors as soon as A
publishes it.

    python shared_sequence.py offload ROOT LOGDIR SEED NBLOCKS K BACKEND
    python shared_sequence.py onboard ROOT LOGDIR SEED NBLOCKS K BACKEND

Both processes derive the sequence from ``SEED``: A's tensors (:func:`layouts.make_pools`,
vLLM layout, BACKEND ``numpy`` for host tensors or ``torch`` for CUDA ones), the device
block ids holding the sequence's ``NBLOCKS`` blocks, ``K`` device blocks per host block (the
last host block partial when ``K`` does not divide ``NBLOCKS``) and chained prefix-hash keys.

A publishes the first host block, then waits for ``LOGDIR/b-ready`` (B's cache is open)
before publishing the rest, one by one with short random pauses; it logs each key's
publication time in ``published.log``. B polls ``lookup`` for each key in order, onboards it
(layer-wise every other block) into random ids of its own tensors and compares every byte
with A's; it prints one JSON line: the blocks onboarded, wrong blocks, and per block the
seconds from publication to the end of the onboard. It exits 3 on a wrong byte, 4 on a
timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np
from layouts import make_pools, raw_host, snapshot

from tiercache import KeyNotFoundError, TierCache

TIMEOUT_S = 60.0


def sequence(seed: int, nblocks: int, k: int, nb: int):
    """``(keys, dev)``: one chained content key per host block and ``[n, k]`` device ids of
    A's tensors (``-1`` past the sequence's end)."""
    n = -(-nblocks // k)
    ids = np.full(n * k, -1, dtype=np.int64)
    ids[:nblocks] = np.random.default_rng(seed + 7).permutation(nb)[:nblocks]
    keys, prev = [], b"seq-%d" % seed
    for i in range(n):
        prev = hashlib.sha256(prev + ids[i * k:(i + 1) * k].tobytes()).digest()[:16]
        keys.append(prev)
    return keys, ids.reshape(n, k)


def open_cache(pools, root: str, k: int) -> TierCache:
    return TierCache.for_engine(pools, host_slots=4, file_slots=256, blocks_per_host_block=k, root=root,
                                sharing="shared", fsync="data", min_age_s=60, negative_ttl_s=0.002,
                                metrics_registry="none", metrics_snapshot_s=0)


def offload(root: str, logdir: str, seed: int, nblocks: int, k: int, backend: str) -> int:
    rng = np.random.default_rng(seed)
    pools = make_pools("vllm", rng, backend, nb=4 * nblocks)
    keys, dev = sequence(seed, nblocks, k, pools.num_blocks)
    with open_cache(pools, root, k) as cache, open(os.path.join(logdir, "published.log"), "a") as log:
        for i, key in enumerate(keys):
            cache.offload_slots([key], dev[i:i + 1], to="file")  # published when it returns
            log.write(f"{time.time():.6f} {key.hex()}\n")
            log.flush()
            if i == 0:
                deadline = time.monotonic() + TIMEOUT_S
                while not os.path.exists(os.path.join(logdir, "b-ready")):
                    if time.monotonic() > deadline:
                        return 4
                    time.sleep(0.005)
            time.sleep(float(rng.uniform(0, 0.02)))
    return 0


def onboard(root: str, logdir: str, seed: int, nblocks: int, k: int, backend: str) -> int:
    src = make_pools("vllm", np.random.default_rng(seed), "numpy", nb=4 * nblocks)  # A's bytes, rebuilt
    want = snapshot(src)
    keys, dev = sequence(seed, nblocks, k, src.num_blocks)
    rng = np.random.default_rng(seed + 1)
    pools = make_pools("vllm", rng, backend, nb=4 * nblocks)  # B's own tensors, other bytes
    dst = np.where(dev >= 0, rng.permutation(pools.num_blocks)[:dev.size].reshape(dev.shape), -1)
    report = {"onboarded": 0, "wrong": 0, "lag_s": [], "missing_position_refused": None}
    with open_cache(pools, root, k) as cache:
        open(os.path.join(logdir, "b-ready"), "w").close()
        ready = time.time()
        for i, key in enumerate(keys):
            deadline = time.monotonic() + TIMEOUT_S
            while "file" not in cache.lookup(key):
                if time.monotonic() > deadline:
                    print(json.dumps(report))
                    return 4
                time.sleep(0.001)
            cache.onboard_slots([key], dst[i:i + 1], layerwise=bool(i % 2)).synchronize()
            done = time.time()
            for spec in pools.specs:
                got = raw_host(pools, spec.name)
                for a, b in zip(dev[i].tolist(), dst[i].tolist()):
                    if a >= 0 and not np.array_equal(got[b], want[spec.name][a]):
                        report["wrong"] += 1
            report["onboarded"] += 1
            report["lag_s"].append(done)
        if dev[-1, -1] < 0:  # the partial last host block: a position A never offloaded is refused
            try:
                cache.onboard_slots([keys[-1]], np.arange(k)[None, :]).synchronize()
                report["missing_position_refused"] = False
            except KeyNotFoundError:
                report["missing_position_refused"] = True
    published = {}
    with open(os.path.join(logdir, "published.log")) as fh:
        for line in fh:
            t, h = line.split()
            published[h] = float(t)
    report["after_ready"] = sum(published[key.hex()] > ready for key in keys)
    report["lag_s"] = [round(t - published[key.hex()], 6) for t, key in zip(report["lag_s"], keys)]
    print(json.dumps(report))
    return 3 if report["wrong"] else 0


if __name__ == "__main__":
    mode, root, logdir, seed, nblocks, k, backend = sys.argv[1:8]
    fn = {"offload": offload, "onboard": onboard}[mode]
    sys.exit(fn(root, logdir, int(seed), int(nblocks), int(k), backend))
