"""Host arrays whose memory is reused once the caller lets them go.

:meth:`TierCache.get <tiercache.TierCache.get>` without ``out`` returns new arrays. Memory new
to the process costs a page fault and a zeroed page per 4 KiB the first time it is touched,
and with O_DIRECT reads the kernel takes those faults while it pins the pages for the I/O:
on the CPU test machine a 32-block ``get`` of 256 KiB blocks ran at 1.5-1.7 GB/s into new
arrays against 2.4 into arrays it had used before (55-76 against 17-28 us of system time per
block; ``tiercache bench array``'s plain caller measures it).

:func:`recycled_empty` hands out page-aligned ``uint8`` arrays over anonymous mappings. The
array's base object is a small ctypes array over the mapping; when the last NumPy array or
view over it is gone (CPython frees it at once, by reference count), its ``__del__`` puts the
mapping back in a pool by size, and the next allocation of that size takes it with its pages
already in place. The pool keeps at most :data:`POOL_BYTES`; beyond it a mapping is let go
(unmapped once nothing exports it). The bytes of a reused array are whatever its last user
left (as ``np.empty``'s are undefined).
"""

from __future__ import annotations

import ctypes
import mmap
import threading

import numpy as np

#: bytes of released mappings kept for reuse (all sizes together)
POOL_BYTES = 512 << 20
#: allocations below this take NumPy's own allocator (its small-block cache is cheaper)
MIN_BYTES = 1 << 20

_lock = threading.RLock()  # re-entrant: a __del__ may run while this thread holds it
_free: dict[int, list[mmap.mmap]] = {}
_kept = [0]
_types: dict[int, type] = {}


def _give_back(mm: mmap.mmap) -> None:
    with _lock:
        if _kept[0] + len(mm) <= POOL_BYTES:
            _free.setdefault(len(mm), []).append(mm)
            _kept[0] += len(mm)


def _lease_type(size: int) -> type:
    """A ctypes array type of ``size`` bytes whose instances return their mapping to the pool
    when they die."""
    with _lock:
        t = _types.get(size)
        if t is None:
            def __del__(self) -> None:
                mm = self.__dict__.pop("mm", None)
                if mm is not None:
                    _give_back(mm)

            t = _types[size] = type(f"_Recycled{size}", (ctypes.c_ubyte * size,), {"__del__": __del__})
        return t


def recycled_empty(nbytes: int) -> np.ndarray:
    """A new, uninitialised, page-aligned ``uint8`` array of ``nbytes`` bytes, over memory
    that returns to this module's pool when the array and all its views are gone (module
    docstring). Small arrays (below :data:`MIN_BYTES`) come from NumPy."""
    if nbytes < MIN_BYTES:
        buf = np.empty(nbytes + mmap.PAGESIZE, np.uint8)
        skip = -buf.ctypes.data % mmap.PAGESIZE
        return buf[skip:skip + nbytes]
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    with _lock:
        spare = _free.get(size)
        mm = spare.pop() if spare else None
        if mm is not None:
            _kept[0] -= size
    if mm is None:
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    lease = _lease_type(size).from_buffer(mm)
    lease.mm = mm
    return np.frombuffer(lease, np.uint8, count=nbytes)


def pool_stats() -> dict[str, int]:
    """``{"kept_bytes", "kept_buffers"}``: what the pool holds now."""
    with _lock:
        return {"kept_bytes": _kept[0], "kept_buffers": sum(len(v) for v in _free.values())}
