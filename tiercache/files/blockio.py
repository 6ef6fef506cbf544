"""How one block's file moves between a buffer and the disk: the :class:`BlockIO` protocol and
its implementations, chosen once per file tier by :func:`block_io` from the device path
(:mod:`.devicepath`).

- :class:`PosixBlockIO`: POSIX writes (temporary file, flush per the fsync policy, rename) and
  verified reads (:mod:`.posix_io`); a device buffer bounces through pinned staging.
- :class:`KvikioBlockIO`: device buffers straight between VRAM and the file through kvikio's
  ``CuFile`` (GDS, or its compat mode without nvidia-fs: :mod:`.kvikio_io`); host buffers as
  POSIX.
- The native engine moves whole requests instead (many blocks in one C call:
  :class:`~tiercache.files.blockbatch.BlockBatches`, also chosen once, by the file tier's
  ``io_engine``); a BlockIO serves what it does not take: single-block tasks of the ``python``
  engine, group commits, and device buffers on kvikio's path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from tiercache.files import kvikio_io, posix_io
from tiercache.files.devicepath import IOPath
from tiercache.files.rootdir import RootPath
from tiercache.geometry import PoolSpec
from tiercache.keys import Key
from tiercache.memory import copy_sync


class BlockIO(Protocol):
    """One block file of one pool, written from or read into one buffer (host memory: a NumPy
    array or memoryview of ``pool.block_nbytes`` bytes; device memory: a CuPy array of as many).
    """

    def write(self, final: RootPath, key: Key, pool: PoolSpec, buf, extra: dict | None,
              publish: bool) -> RootPath | None:
        """Write ``buf`` as the file ``final`` of ``key``. ``publish``: flushed and renamed into
        place (returns None); else the unflushed temporary file is returned (a group commit
        publishes it). Raises OSError; no temporary file is left behind on failure."""
        ...

    def read(self, path: RootPath, key: Key, pool: PoolSpec, buf) -> None:
        """Read the file ``path`` of ``key`` into ``buf``, its header and (with verify) its
        checksum checked. Raises :class:`~tiercache.errors.CorruptBlockError` for a file that
        does not verify, OSError (FileNotFoundError for a missing one)."""
        ...


def _is_host(buf) -> bool:
    return isinstance(buf, memoryview) or hasattr(buf, "ctypes")


class PosixBlockIO:
    """POSIX block files (see the module's doc).

    Args:
        fsync: the fsync policy (``none``, ``data``, ``data+dir``).
        direct_io: O_DIRECT where the buffer and the file system allow it.
        verify: check the data's checksum on every read.
        staging: returns this thread's pinned staging buffer (uint8, at least a block).
        device_id: the CUDA device of device buffers.
    """

    def __init__(self, fsync: str, direct_io: bool, verify: bool, staging: Callable[[], np.ndarray],
                 device_id: int = 0) -> None:
        self.fsync, self.direct_io, self.verify = fsync, direct_io, verify
        self.staging, self.device_id = staging, device_id

    def write(self, final: RootPath, key: Key, pool: PoolSpec, buf, extra: dict | None,
              publish: bool) -> RootPath | None:
        if _is_host(buf):
            return posix_io.write_block(final, key, pool, buf, self.fsync, self.direct_io, extra, publish)
        import cupy

        with cupy.cuda.Device(self.device_id):
            return self._write_device(final, key, pool, buf, extra, publish)

    def read(self, path: RootPath, key: Key, pool: PoolSpec, buf) -> None:
        if hasattr(buf, "ctypes"):
            posix_io.read_block(path, key, pool, buf, self.verify, self.direct_io)
            return
        import cupy

        with cupy.cuda.Device(self.device_id):
            self._read_device(path, key, pool, buf)

    def _write_device(self, final, key, pool, buf, extra, publish):
        host = self.staging()[: pool.block_nbytes]  # bounce through pinned staging
        copy_sync(host, buf)
        return posix_io.write_block(final, key, pool, host, self.fsync, self.direct_io, extra, publish)

    def _read_device(self, path, key, pool, buf) -> None:
        host = self.staging()[: pool.block_nbytes]
        posix_io.read_block(path, key, pool, host, self.verify, self.direct_io)
        copy_sync(buf, host)


class KvikioBlockIO(PosixBlockIO):
    """Device buffers through kvikio (see the module's doc); host buffers as
    :class:`PosixBlockIO`. Same arguments."""

    def _write_device(self, final, key, pool, buf, extra, publish):
        return kvikio_io.write_block(final, key, pool, buf, self.staging(), self.fsync, extra, publish)

    def _read_device(self, path, key, pool, buf) -> None:
        kvikio_io.read_block(path, key, pool, buf, self.staging(), self.verify)


def block_io(io_path: IOPath, fsync: str, direct_io: bool, verify: bool, staging: Callable[[], np.ndarray],
             device_id: int = 0, io_threads: int = 1, kvikio_task_size: int = 0,
             kvikio_gds_threshold: int = 0) -> BlockIO:
    """The file tier's :class:`BlockIO`: kvikio's where the device path is kvikio's (its
    thread pool and thresholds configured here, once), else POSIX."""
    if io_path.kvikio:
        kvikio_io.configure(io_threads, kvikio_task_size, kvikio_gds_threshold)
        return KvikioBlockIO(fsync, direct_io, verify, staging, device_id)
    return PosixBlockIO(fsync, direct_io, verify, staging, device_id)
