"""The on-disk format's own limit: one file per block, measured in C beside fio.

``tiercache bench array`` runs :func:`format_limit` over the same directories as fio. Its C
threads (``kernels/formatlimit.c``) do, per block, only what the format asks of the file
system:

- write: open an existing temporary file (written once before, as a recycled free file is) with O_DIRECT, write
the header page and
  the data, close it, rename it over its final name (atomic publication);
- read: open the final file with O_DIRECT, read it whole, close it.

Nothing else runs: no checksum, no name building, no Python. Files are spread over the
directories (one per device) and over :data:`~tiercache.files.blockfile.FANOUT`
subdirectories in each, as the file tier spreads blocks. Each in-flight count of
:data:`INFLIGHT` (threads, one file each at a time: what fio's jobs times iodepth keep in
flight) is run, and the best of each direction is the limit. Where this limit is well below
fio's best, the format itself (an open, a close and a rename per block) is what stops a size;
where it is close to fio and the engine is not, the engine is.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import resource
import shutil
from pathlib import Path

import numpy as np

from tiercache.files import FANOUT, SUBDIRS, file_size

#: files in flight (threads) tried; the best of each direction is reported
INFLIGHT = (1, 16, 32, 128)


def _lib():
    from tiercache.kernels.hostlib import load

    lib = load("formatlimit.c")
    fn = lib.tc_format_limit
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32]
    return fn


def fs_type(path: Path) -> str:
    """The file system type (``ext4``, ``xfs``, ``tmpfs``, ...) of the mount holding ``path``,
    from ``/proc/mounts`` (``"unknown"`` where it cannot be read)."""
    target = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def _cpu_s() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def direct_io_works(directory: Path) -> bool:
    """Whether files in ``directory`` open with O_DIRECT (older tmpfs refuses it: EINVAL)."""
    probe = Path(directory) / f".direct-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    os.close(fd)
    return True


def _run(fn, op: int, dir_fds: np.ndarray, names: bytes, tmp_off: np.ndarray, final_off: np.ndarray,
         file_bytes: int, inflight: int, direct: bool = True) -> tuple[float, float, float]:
    """One C pass; (seconds, user CPU seconds, system CPU seconds).

    Raises:
        OSError: the first error of any file (its errno).
    """
    u0, s0 = _cpu_s()
    ns = fn(op, len(dir_fds), dir_fds.ctypes.data, names, tmp_off.ctypes.data, final_off.ctypes.data,
            file_bytes, inflight, int(direct))
    u1, s1 = _cpu_s()
    if ns < 0:
        raise OSError(-ns, f"format limit {'write' if op == 0 else 'read'}: {os.strerror(-ns)}")
    return ns / 1e9, u1 - u0, s1 - s0


def format_limit(dirs: list[Path], block_bytes: int, total_bytes: int, inflight=INFLIGHT, seed: int = 0) -> dict:
    """The format's limit over ``dirs`` (one per device) for blocks of ``block_bytes``:
    ``total_bytes`` of blocks written, then read in random order, at each in-flight count of
    ``inflight`` (module docstring). Files live under ``<dir>/format-limit`` (removed after).

    Returns:
        ``{"write_gbps", "write_inflight", "read_gbps", "read_inflight", "cpu_us_per_block":
        {"write": {"user", "sys"}, "read": {...}}, "fs": [type per dir], "files", "direct_io"}``
        (``direct_io`` false where a file system refuses O_DIRECT: then buffered): GB/s of
        block bytes (not counting the header page, as the engine's figures), the best point of
        each direction and the CPU per block (user and system, microseconds) at that point.

    Raises:
        OSError: a file operation failed (the first error), or the C code cannot be built.
    """
    fn = _lib()
    fbytes = file_size(block_bytes)
    n = max(1, total_bytes // block_bytes)
    work = [Path(d) / "format-limit" for d in dirs]
    rng = random.Random(seed)
    out: dict = {"fs": [fs_type(Path(d)) for d in dirs], "files": n, "inflight": list(inflight)}
    fds: list[int] = []
    try:
        for w in work:
            w.mkdir(parents=True, exist_ok=True)
        direct = out["direct_io"] = all(direct_io_works(w) for w in work)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        sub_fds = []
        for w in work:
            for s in SUBDIRS:
                (w / s).mkdir(parents=True, exist_ok=True)
                fd = os.open(w / s, os.O_RDONLY | os.O_DIRECTORY)
                fds.append(fd)
                sub_fds.append(fd)
        # file i: device i % len(dirs), one of its subdirectories by a mix of i
        where = [sub_fds[(i % len(work)) * FANOUT + ((i * 0x9E3779B1) >> 8) % FANOUT] for i in range(n)]
        blob = bytearray()
        tmp_off = np.empty(n, np.int64)
        final_off = np.empty(n, np.int64)
        for i in range(n):
            tmp_off[i] = len(blob)
            blob += f".tmp-block_{i}_pool_kv.bin\0".encode()
            final_off[i] = len(blob)
            blob += f"block_{i}_pool_kv.bin\0".encode()
        names = bytes(blob)
        dir_fds = np.array(where, np.int32)
        fill = mmap.mmap(-1, fbytes)  # page-aligned zeros
        for k in inflight:
            for i in range(n):  # the temporary files, written once: what a recycled free file is
                # O_DIRECT: no dirty page cache left for the timed write to flush first
                fd = os.open(names[tmp_off[i]:names.index(b"\0", tmp_off[i])], flags, 0o600, dir_fd=where[i])
                try:
                    os.pwrite(fd, fill, 0)
                finally:
                    os.close(fd)
            wall, user, sys_ = _run(fn, 0, dir_fds, names, tmp_off, final_off, fbytes, k, direct)
            _best(out, "write", n * block_bytes / wall / 1e9, k, user, sys_, n)
            order = list(range(n))
            rng.shuffle(order)
            perm = np.array(order, np.int64)
            wall, user, sys_ = _run(fn, 1, dir_fds[perm].copy(), names, tmp_off[perm].copy(), final_off[perm].copy(),
                                    fbytes, k, direct)
            _best(out, "read", n * block_bytes / wall / 1e9, k, user, sys_, n)
            for i in range(n):
                os.unlink(names[final_off[i]:names.index(b"\0", final_off[i])], dir_fd=where[i])
    finally:
        for fd in fds:
            os.close(fd)
        for w in work:
            shutil.rmtree(w, ignore_errors=True)
    return out


def _best(out: dict, op: str, gbps: float, inflight: int, user: float, sys_: float, n: int) -> None:
    if gbps > out.get(f"{op}_gbps", 0.0):
        out[f"{op}_gbps"], out[f"{op}_inflight"] = gbps, inflight
        out.setdefault("cpu_us_per_block", {})[op] = {"user": user / n * 1e6, "sys": sys_ / n * 1e6}
