"""Host memory for the host tier and for staging buffers.

With CUDA: pinned (page-locked) memory from CuPy's ``alloc_pinned_memory``, so copies to and
from VRAM run at full PCIe speed and asynchronously. Without CUDA: an anonymous ``mmap``, which
is page-aligned (4 KiB), as O_DIRECT I/O requires.
"""

from __future__ import annotations

import mmap

import numpy as np

from .cuda import cuda_status

PAGE = 4096


def alloc_host(nbytes: int, pinned: bool | None = None) -> tuple[np.ndarray, object]:
    """Allocate ``nbytes`` of page-aligned host memory.

    Args:
        nbytes: size in bytes (0 allowed).
        pinned: True to require pinned memory, False for pageable, None for pinned when CUDA
            is usable.

    Returns:
        ``(array, owner)``: a 1-D ``uint8`` array over the memory, and the object that owns
        it (keep a reference for as long as the array is used).
    """
    if pinned is None:
        pinned = cuda_status().available
    size = max(int(nbytes), 1)
    if pinned:
        import cupy

        mem = cupy.cuda.alloc_pinned_memory(size)
        arr = np.frombuffer(mem, dtype=np.uint8, count=size)
        return arr[:nbytes], mem
    # MAP_POPULATE faults the pages in now, not on the first copy into each block
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(-1, size, flags=flags)
    arr = np.frombuffer(mm, dtype=np.uint8, count=size)
    return arr[:nbytes], mm


def is_pinned(arr: np.ndarray) -> bool:
    """True when ``arr`` lies in page-locked memory registered with CUDA."""
    if not cuda_status().available:
        return False
    import cupy

    try:
        attrs = cupy.cuda.runtime.pointerGetAttributes(arr.ctypes.data)
    except Exception:
        return False
    return attrs.type == cupy.cuda.runtime.memoryTypeHost
