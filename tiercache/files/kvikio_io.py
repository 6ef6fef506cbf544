"""Block-file I/O between VRAM and files through kvikio ``CuFile`` (GDS or kvikio compat mode).

The data of a block goes straight from (or to) its device slot with ``CuFile.pwrite``/
``pread`` at the 4 KiB-aligned data offset, so with GPUDirect Storage no CPU bounce copy is
made. The data's checksum (for the header of a write, and each read's check when
``verify_checksums`` is on) is computed on the GPU where the block is (XXH3-64 by
``kernels/xxh3.cu``, :mod:`tiercache.files.devicehash`); only blocks that kernel does not take
(under 241 bytes, or not on 8-byte boundaries) are copied into a pinned staging buffer and
hashed on the host.
"""

from __future__ import annotations

import os
from pathlib import Path

from tiercache.errors import CorruptBlockError
from tiercache.files import devicehash
from tiercache.files.blockfile import DATA_OFFSET, checksum, encode_header
from tiercache.files.posix_io import atomic_write, read_header
from tiercache.files.rootdir import NotRegularFileError, RootPath, proc_path
from tiercache.geometry import PoolSpec
from tiercache.keys import Key


def configure(num_threads: int, task_size: int | None = None, gds_threshold: int | None = None) -> None:
    """Set kvikio's thread pool size, task size and GDS threshold (process-wide settings)."""
    import kvikio.defaults

    wanted = {"num_threads": num_threads, "task_size": task_size, "gds_threshold": gds_threshold}
    for key, value in wanted.items():
        if value is not None and kvikio.defaults.get(key) != value:
            kvikio.defaults.set(key, value)


def _device_checksum(dev, staging) -> int:
    """XXH3-64 of device buffer ``dev`` (1-D CuPy ``uint8``): on the GPU where
    :func:`~tiercache.files.devicehash.applies`, else via host ``staging`` (pinned, same size or
    larger)."""
    if devicehash.applies(dev.nbytes, dev.data.ptr):
        return int(devicehash.device_checksums(dev.reshape(1, dev.nbytes))[0])
    host = staging[: dev.nbytes]
    dev.get(out=host)
    return checksum(host)


def write_block(final: RootPath | Path, key: Key, pool: PoolSpec, dev, staging, fsync: str, extra: dict | None = None,
                publish: bool = True) -> RootPath | None:
    """Write device buffer ``dev`` (a 1-D CuPy ``uint8`` array of ``block_nbytes``) to
    ``final`` atomically; ``staging`` is a pinned host buffer for the checksum. With
    ``publish=False``, returns the unflushed temporary file for a group commit
    (:func:`~tiercache.files.posix_io.atomic_write`)."""
    import kvikio

    header = encode_header(key, pool, _device_checksum(dev, staging), extra)

    def write_data(fd: int) -> None:
        # the temporary file tiercache created (O_EXCL), reopened by kvikio through its descriptor
        with kvikio.CuFile(proc_path(fd), "r+") as f:
            n = f.pwrite(dev, pool.block_nbytes, file_offset=DATA_OFFSET).get()
        if n != pool.block_nbytes:
            raise OSError(f"kvikio wrote {n} of {pool.block_nbytes} bytes to {final}")

    return atomic_write(final, header, pool.block_nbytes, fsync, write_data, publish=publish)


def read_block(path: RootPath | Path, key: Key, pool: PoolSpec, dev, staging, verify: bool) -> None:
    """Read a block file into device buffer ``dev``, checking header and (when ``verify``)
    checksum through host ``staging``.

    Raises:
        CorruptBlockError: the file does not verify, or is not a regular file.
    """
    import kvikio

    try:
        fd = RootPath.of(path).open(os.O_RDONLY)
    except NotRegularFileError as exc:
        raise CorruptBlockError(str(exc)) from None
    try:
        header = read_header(fd, key, pool, str(path))
        # kvikio opens the very file checked above (no symlink in between)
        with kvikio.CuFile(proc_path(fd), "r") as f:
            n = f.pread(dev, pool.block_nbytes, file_offset=DATA_OFFSET).get()
    finally:
        os.close(fd)
    if n != pool.block_nbytes:
        raise CorruptBlockError(f"{path}: truncated (kvikio read {n} of {pool.block_nbytes} bytes)")
    if verify and _device_checksum(dev, staging) != header.checksum:
        raise CorruptBlockError(f"{path}: data checksum mismatch")
