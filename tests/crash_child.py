"""Child of the crash test: spill and flush blocks forever; after each flush returns, append the
flushed keys to the acknowledgement log (fsynced), so the parent knows what must survive."""

import os
import sys

import numpy as np

from tiercache import CacheConfig, PoolSpec, TierCache

pools = (PoolSpec("kv", (2, 2, 4, 16, 32), "float16"), PoolSpec("act", (3000,), "float32"))


def block(key: int, pool: PoolSpec) -> np.ndarray:
    """The bytes of block ``key`` in ``pool``: a function of the key alone, never zeros."""
    return np.random.default_rng([key, len(pool.name)]).integers(1, 256, size=(1, pool.block_nbytes), dtype=np.uint8)


if __name__ == "__main__":
    root, ack_path, start = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg = CacheConfig(pools=pools, host_slots=6, file_slots=100_000, root=root, fsync="data", io_threads=4)
    with TierCache(cfg) as cache, open(ack_path, "a") as ack:
        key = start
        while True:
            batch = list(range(key, key + 3))
            for k in batch:
                cache.put([k], {p.name: block(k, p) for p in pools})
            cache.flush(batch)
            ack.write(" ".join(map(str, batch)) + "\n")
            ack.flush()
            os.fsync(ack.fileno())
            key += 3
