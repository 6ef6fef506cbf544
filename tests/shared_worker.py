"""A process of the shared-root tests: random put / offload to file / flush / onboard / get /
evict on a small space of content keys whose bytes follow from the key, on one root shared
with other such processes.

    python shared_worker.py ROOT LOGDIR SEED SECONDS [CAPACITY_BLOCKS]

Every block read is compared with the bytes its key names; a mismatch is written to
``LOGDIR/wrong-<pid>.log`` and the process exits 3. The keys a ``flush`` wrote are appended to
``flushed-<pid>.log`` once it returned, with the time it started; keys whose files are to be
deleted (evict, sweeps, reconciliations) to ``evicting-<pid>.log`` before, and to
``evicted-<pid>.log`` after. Any unexpected error goes to
``error-<pid>.log`` (exit 4). A read of a key another process deleted meanwhile is expected.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import traceback

import numpy as np

from tiercache import CacheConfig, KeyNotFoundError, PoolSpec, TierCache, TransferError

NUM_KEYS = 96
POOLS = (PoolSpec("k", (4096,), "uint8"), PoolSpec("v", (2048,), "float32"))


def key_of(i: int) -> bytes:
    return hashlib.sha256(b"shared-root-key-%d" % i).digest()[:16]


def bytes_of(key: bytes) -> dict[str, np.ndarray]:
    """The bytes a key names (the same in every process)."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return {p.name: rng.integers(0, 256, p.block_nbytes, dtype=np.uint8) for p in POOLS}


def config(root: str, capacity_blocks: int) -> CacheConfig:
    return CacheConfig(pools=POOLS, host_slots=8, file_slots=capacity_blocks, root=root, sharing="shared",
                       min_age_s=0.5, negative_ttl_s=0.05, metrics_registry="none", metrics_snapshot_s=0,
                       io_threads=4)


def _log(logdir: str, what: str, line: str, when: float | None = None) -> None:
    """Append ``<time> line`` to ``LOGDIR/<what>-<pid>.log`` (``when``, else now)."""
    with open(os.path.join(logdir, f"{what}-{os.getpid()}.log"), "a") as fh:
        fh.write(f"{time.time() if when is None else when:.6f} {line}\n")


def _vanished(exc: BaseException) -> bool:
    """A read from files that failed because another process deleted them meanwhile (a write
    that fails is never expected: it would mean a live writer's temporary file was removed)."""
    return isinstance(exc, TransferError) and isinstance(exc.__cause__, FileNotFoundError) and " file -> " in str(exc)


def _log_deletions(logdir: str) -> None:
    """Every deletion of block files (explicit evictions, sweeps, reconciliations) is logged
    as it starts (``evicting``) and once it is done (``evicted``), so the test knows until when
    each key's files may have been deleted (a process killed in between: until its death)."""
    from tiercache.files import FileTier

    real = FileTier.delete

    def delete(self, keys):
        names = " ".join(k.hex() for k in keys if isinstance(k, bytes))
        if names:
            _log(logdir, "evicting", names)
        real(self, keys)
        if names:
            _log(logdir, "evicted", names)

    FileTier.delete = delete


def run(root: str, logdir: str, seed: int, seconds: float, capacity: int) -> int:
    rng = np.random.default_rng(seed)
    _log_deletions(logdir)
    keys = [key_of(i) for i in range(NUM_KEYS)]
    deadline = time.monotonic() + seconds
    with TierCache(config(root, capacity)) as cache:
        while time.monotonic() < deadline:
            ks = [keys[i] for i in rng.choice(NUM_KEYS, int(rng.integers(1, 5)), replace=False)]
            op = rng.choice(
                ["put", "offload", "flush", "onboard", "get", "evict"], p=[0.2, 0.15, 0.2, 0.15, 0.25, 0.05]
            )
            try:
                if op == "put":
                    cache.put(ks, {p.name: np.stack([bytes_of(k)[p.name] for k in ks]) for p in POOLS})
                elif op == "offload":
                    have = [k for k in ks if cache.lookup(k).keys() - {"file"}]
                    if have:
                        cache.offload(have, to="file")
                elif op == "flush":
                    have = [k for k in ks if cache.lookup(k)]
                    if have:
                        # the keys this flush writes (those already in the file tier, this
                        # process's or discovered, it leaves alone), logged with its start time
                        written = [k for k in have if "file" not in cache.lookup(k)]
                        started = time.time()
                        cache.flush(have)
                        if written:
                            _log(logdir, "flushed", " ".join(k.hex() for k in written), started)
                elif op == "onboard":
                    have = [k for k in ks if cache.lookup(k)]
                    if have:
                        cache.onboard(have, to="host")
                elif op == "get":
                    have = [k for k in ks if cache.lookup(k)]
                    if have:
                        out = {p.name: np.zeros((len(have), p.block_nbytes), np.uint8) for p in POOLS}
                        cache.get(have, out={p.name: out[p.name] for p in POOLS})
                        for i, k in enumerate(have):
                            want = bytes_of(k)
                            for p in POOLS:
                                if not np.array_equal(out[p.name][i], want[p.name]):
                                    _log(logdir, "wrong", f"{k.hex()} {p.name}")
                                    return 3
                elif op == "evict":
                    have = [k for k in ks if "file" in cache.lookup(k)]
                    if have:
                        cache.evict(have)
            except KeyNotFoundError:
                continue  # evicted by another process between the lookup and the call
            except TransferError as exc:
                if not _vanished(exc):
                    _log(logdir, "error", f"{op}: {traceback.format_exc()}")
                    return 4
    return 0


if __name__ == "__main__":
    root, logdir, seed, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    cap = int(sys.argv[5]) if len(sys.argv) > 5 else 4096
    try:
        sys.exit(run(root, logdir, seed, seconds, cap))
    except Exception:
        _log(logdir, "error", traceback.format_exc())
        sys.exit(4)
