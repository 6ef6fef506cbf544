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
    and return when the copy is complete.

    Raises:
        ValueError: the sizes differ.
    """
    copy_many_sync([(dst, src)])


def copy_many_sync(pairs) -> None:
    """Copy each ``(dst, src)`` of ``pairs`` (as :func:`copy_sync`), queued back to back on
    one stream of this thread, and return when all are complete (one synchronization).

    Raises:
        ValueError: a pair's sizes differ (nothing is copied).
    """
    pairs = list(pairs)
    for dst, src in pairs:
        if dst.nbytes != src.nbytes:
            raise ValueError(f"copy of {src.nbytes} bytes into a buffer of {dst.nbytes}")
    if all(isinstance(d, np.ndarray) and isinstance(s, np.ndarray) for d, s in pairs):
        for dst, src in pairs:
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
    for dst, src in pairs:
        cupy.cuda.runtime.memcpyAsync(data_ptr(dst), data_ptr(src), dst.nbytes, MEMCPY_DEFAULT, stream.ptr)
    stream.synchronize()
