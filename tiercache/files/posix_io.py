"""POSIX block-file I/O: atomic writes and verified reads with pwrite/pread.

Every write goes to a temporary file in the same directory (``O_EXCL``, mode 0600), is
flushed according to the fsync policy, and is renamed over the final name, so a reader never
sees a torn block and a crash leaves either the old file, the new file, or a temporary file
that the next open removes.

Paths are :class:`~tiercache.files.rootdir.RootPath` (a root's directory descriptor and a
plain name) or plain paths; no open follows a symlink in the last component, and a name that
is not a regular file reads as a corrupt block.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tiercache.errors import CorruptBlockError
from tiercache.files.blockfile import (
    ALIGN,
    DATA_OFFSET,
    check_header,
    checksum,
    decode_header,
    encode_header,
    file_size,
    header_checksum,
)
from tiercache.files.rootdir import FILE_MODE, NotRegularFileError, RootPath
from tiercache.files.sharing import tmp_name
from tiercache.geometry import PoolSpec
from tiercache.keys import Key

O_DIRECT = getattr(os, "O_DIRECT", 0)
_local = threading.local()


def _page() -> memoryview:
    """A thread-local, page-aligned 4096-byte buffer (headers under O_DIRECT)."""
    buf = getattr(_local, "page", None)
    if buf is None:
        buf = _local.page = mmap.mmap(-1, DATA_OFFSET)
    return memoryview(buf)


def direct_ok(buf) -> bool:
    """True when ``buf`` may be used for O_DIRECT I/O: page-aligned address and length."""
    arr = np.asarray(buf)
    return bool(O_DIRECT) and arr.ctypes.data % 4096 == 0 and arr.nbytes % 4096 == 0


def _open(path: RootPath, flags: int, direct: bool, mode: int = FILE_MODE) -> tuple[int, bool]:
    """Open a regular file without following a symlink, with O_DIRECT when asked and
    supported (filesystems such as tmpfs refuse it)."""
    if direct:
        try:
            return path.open(flags | O_DIRECT, mode), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return path.open(flags, mode), False


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of a vector of buffers (after a short read or write)."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views.pop(0)
    if views and n:
        views[0] = views[0][n:]


def pwrite_all(fd: int, buffers: list, offset: int) -> None:
    """Write every byte of ``buffers`` at ``offset``, retrying short writes."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError("pwritev wrote 0 bytes")
        offset += n
        _advance(views, n)


def _preadv_all(fd: int, buffers: list) -> int:
    """Fill ``buffers`` from offset 0 until they are full or the file ends; returns bytes read."""
    views = [memoryview(b).cast("B") for b in buffers]
    total = 0
    while views:
        n = os.preadv(fd, views, total)
        if n == 0:
            break
        total += n
        _advance(views, n)
    return total


def fsync_dir(path: RootPath) -> None:
    """fsync the directory that holds ``path`` so that a rename in it is durable."""
    if path.dir_fd is not None:
        os.fsync(path.dir_fd)
        return
    fd = os.open(Path(os.fspath(path)).parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(final: RootPath | Path, header: bytes, nbytes: int, fsync: str,
                 write_data: Callable[[int], None] | None = None, direct: bool = False, data=None,
                 publish: bool = True) -> RootPath | None:
    """Create ``final`` atomically: header at 0 and the data at :data:`DATA_OFFSET` (``data``,
    written in the same ``pwritev`` as the header, or by ``write_data(fd)``), padded to
    :func:`file_size`, flushed per ``fsync``, renamed over ``final`` (a symlink there is
    replaced, never followed; a directory there fails the write). ``direct`` opens the file
    with O_DIRECT (the data must then be page-aligned).

    With ``publish=False`` the temporary file is written but neither flushed nor renamed: it is
    returned for a group commit (:func:`sync_filesystem`, then :func:`publish_tmp`).

    On any error the temporary file is removed and ``final`` is untouched.
    """
    final = RootPath.of(final)
    tmp = final.with_name(tmp_name(final.name))
    fd, direct = _open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, direct)
    try:
        if direct:
            page = _page()
            page[:] = header
            head = page
        else:
            head = header
        if data is not None:  # header and data in one request: one extent, one syscall
            pwrite_all(fd, [head, data], 0)
        else:
            pwrite_all(fd, [head], 0)
            write_data(fd)
        if nbytes % ALIGN:
            os.ftruncate(fd, file_size(nbytes))
        if fsync != "none" and publish:
            os.fdatasync(fd)
        os.close(fd)
        fd = -1
        if not publish:
            return tmp
        tmp.rename(final)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink()
        raise
    if fsync == "data+dir":
        fsync_dir(final)
    return None


def publish_tmp(tmp: RootPath, final: RootPath) -> None:
    """Rename a temporary file of :func:`atomic_write` (``publish=False``) over ``final``.

    Raises:
        OSError: the temporary file is removed and ``final`` is untouched.
    """
    try:
        tmp.rename(final)
    except BaseException:
        tmp.unlink()
        raise


try:
    _syncfs = ctypes.CDLL(None, use_errno=True).syncfs
except (AttributeError, OSError):  # not Linux
    _syncfs = None


def sync_filesystem(dir_fd: int) -> None:
    """Make every write to the filesystem holding the directory ``dir_fd`` durable: one
    ``syncfs`` (one journal commit and device flush for a whole batch of files; Linux), else
    ``sync``. The group commit of :class:`~tiercache.files.FileTier`.

    Raises:
        OSError: ``syncfs`` failed.
    """
    if _syncfs is None:
        os.sync()
        return
    if _syncfs(dir_fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs: {os.strerror(err)}")


def write_block(final: RootPath | Path, key: Key, pool: PoolSpec, data, fsync: str, direct: bool = False,
                extra: dict | None = None, publish: bool = True) -> RootPath | None:
    """Write one block from host memory ``data`` (``block_nbytes`` bytes) to ``final``;
    ``direct`` uses O_DIRECT where ``data`` is page-aligned in address and length; ``extra``
    goes into the header. With ``publish=False``, returns the unflushed temporary file for a
    group commit (see :func:`atomic_write`)."""
    header = encode_header(key, pool, checksum(data), extra)
    return atomic_write(final, header, pool.block_nbytes, fsync, direct=direct and direct_ok(data),
                        data=memoryview(np.asarray(data)).cast("B"), publish=publish)


def read_header(fd: int, key: Key, pool: PoolSpec, where: str):
    """Read, decode and check the header of an open block file; returns the header.

    Raises:
        CorruptBlockError: bad header, wrong geometry, or a file shorter than its block.
    """
    page = _page()
    n = os.preadv(fd, [page], 0)  # an aligned buffer: valid under O_DIRECT too
    header = decode_header(bytes(page[:n]), where)
    check_header(header, key, pool, where)
    size = os.fstat(fd).st_size
    if size < DATA_OFFSET + pool.block_nbytes:
        raise CorruptBlockError(f"{where}: truncated ({size} bytes, expected {file_size(pool.block_nbytes)})")
    return header


def read_block(path: RootPath | Path, key: Key, pool: PoolSpec, out, verify: bool, direct: bool = False) -> None:
    """Read one block into host buffer ``out`` (``block_nbytes`` bytes), checking its header
    and, when ``verify``, its checksum; ``direct`` uses O_DIRECT where ``out`` is page-aligned.

    Raises:
        CorruptBlockError: the file does not verify, or is not a regular file.
        FileNotFoundError / OSError: the file cannot be read.
    """
    path = RootPath.of(path)
    try:
        fd, _ = _open(path, os.O_RDONLY, direct and direct_ok(out))
    except NotRegularFileError as exc:
        raise CorruptBlockError(str(exc)) from None
    try:
        # header and data in one request (one I/O instead of a small one and a large one)
        page = _page()
        view = memoryview(np.asarray(out)).cast("B")
        want = DATA_OFFSET + len(view)
        got = _preadv_all(fd, [page, view])
        want_sum = header_checksum(page, key, pool, str(path))
        if got < want:
            raise CorruptBlockError(f"{path}: truncated ({got} bytes, expected {file_size(pool.block_nbytes)})")
    finally:
        os.close(fd)
    if verify and checksum(out) != want_sum:
        raise CorruptBlockError(f"{path}: data checksum mismatch")
