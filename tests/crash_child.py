"""Child of the crash tests: spill and flush blocks forever; after each flush returns, append the
flushed keys to the acknowledgement log (fsynced), so the parent knows what must survive.

With a fifth argument (a marks file) it runs the churn of test_sigkill_in_checkpoints_and_evictions:
a file tier of 60 blocks (every batch evicts), and a line in the marks file when a checkpoint
of the index has half written its temporary file (``checkpoint``) and when an eviction has
removed one file of a block (``evict``), each followed by a pause in which the parent kills."""

import os
import sys

import numpy as np

from tiercache import CacheConfig, PoolSpec, TierCache

pools = (PoolSpec("kv", (2, 2, 4, 16, 32), "float16"), PoolSpec("act", (3000,), "float32"))


def block(key: int, pool: PoolSpec) -> np.ndarray:
    """The bytes of block ``key`` in ``pool``: a function of the key alone, never zeros."""
    return np.random.default_rng([key, len(pool.name)]).integers(1, 256, size=(1, pool.block_nbytes), dtype=np.uint8)


CHURN_SLOTS = 60


def _hooks(marks_path: str) -> None:
    """Pauses inside index checkpoints and evictions, announced in ``marks_path``."""
    import time

    from tiercache.files import FileTier, indexfile
    from tiercache.files.rootdir import TMP_OWN

    marks = open(marks_path, "a")

    def mark(what: str) -> None:
        marks.write(what + "\n")
        marks.flush()

    original_write, original_unlink, original_many = indexfile.write_atomic, FileTier._unlink, FileTier._unlink_many

    def write_atomic(root, name, data, fsync=False):
        tmp = root.child(f"{TMP_OWN}{name.lstrip('.')}.{os.getpid()}")
        fd = tmp.open(os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_TRUNC)
        os.write(fd, data[: len(data) // 2])  # as a checkpoint is when a kill lands in it
        os.close(fd)
        mark("checkpoint")
        time.sleep(0.03)
        tmp.unlink()
        original_write(root, name, data, fsync)

    def unlink(self, path):  # the Python engine: one file at a time
        original_unlink(self, path)
        mark("evict")
        time.sleep(0.01)

    def unlink_many(self, paths, recycle):  # the native engine's batch: stopped after a block's first file
        original_many(self, paths[:1], recycle)
        mark("evict")
        time.sleep(0.01)
        original_many(self, paths[1:], recycle)

    indexfile.write_atomic, FileTier._unlink, FileTier._unlink_many = write_atomic, unlink, unlink_many


if __name__ == "__main__":
    root, ack_path, start = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg = CacheConfig(pools=pools, host_slots=6, file_slots=100_000, root=root, fsync="data", io_threads=4)
    if len(sys.argv) > 4:
        _hooks(sys.argv[4])
        cfg = CacheConfig(pools=pools, host_slots=6, file_slots=CHURN_SLOTS, root=root, fsync="data", io_threads=4,
                          index_checkpoint_s=1)
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
