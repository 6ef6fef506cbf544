"""Raw copies between host and device memory by pointer (CUDA unified addressing)."""

from __future__ import annotations

import threading

import numpy as np

#: cudaMemcpyDefault: direction inferred from the pointers (unified virtual addressing)
MEMCPY_DEFAULT = 4

_local = threading.local()


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

    # a non-blocking stream of this thread: a plain cudaMemcpy would run on the legacy default
    # stream and wait for every kernel the engine has queued there (PyTorch's default stream)
    streams = _local.__dict__.setdefault("streams", {})
    dev = cupy.cuda.Device().id
    stream = streams.get(dev)
    if stream is None:
        stream = streams[dev] = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.runtime.memcpyAsync(data_ptr(dst), data_ptr(src), dst.nbytes, MEMCPY_DEFAULT, stream.ptr)
    stream.synchronize()
