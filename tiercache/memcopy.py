"""Raw copies between host and device memory by pointer (CUDA unified addressing)."""

from __future__ import annotations

import numpy as np

#: cudaMemcpyDefault: direction inferred from the pointers (unified virtual addressing)
MEMCPY_DEFAULT = 4


def data_ptr(arr) -> int:
    """Address of the first element of a NumPy or CuPy array."""
    if isinstance(arr, np.ndarray):
        return arr.ctypes.data
    return arr.data.ptr


def copy_sync(dst, src) -> None:
    """Copy all bytes of ``src`` into ``dst`` (same nbytes, each host or device, contiguous)
    and return when the copy is complete."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into a buffer of {dst.nbytes}")
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
        np.copyto(dst, src)
        return
    import cupy

    cupy.cuda.runtime.memcpy(data_ptr(dst), data_ptr(src), dst.nbytes, MEMCPY_DEFAULT)
