"""Caller arrays: checking them against a pool and viewing them as raw bytes.

A caller passes, per pool, an array of ``n`` blocks: shape ``(n, *block_shape)`` with the
pool's dtype, or ``(n, block_nbytes)`` of ``uint8`` (raw bytes). NumPy, CuPy and PyTorch
arrays are accepted, as is anything with ``__cuda_array_interface__`` (device) or
``__array_interface__`` (host). Arrays must be C-contiguous. Device arrays must be on the
cache's device.
"""

from __future__ import annotations

import ctypes

import numpy as np

from tiercache.dtypes import canonical_dtype
from tiercache.errors import ArrayMismatchError, ConfigError
from tiercache.geometry import PoolSpec


def _is_torch(arr) -> bool:
    return type(arr).__module__.split(".")[0] == "torch"


def raw_view(arr, pool: PoolSpec, n: int, device_id: int | None, what: str = "array"):
    """A ``uint8`` view ``(n, block_nbytes)`` of caller array ``arr`` for ``pool`` (no copy).

    Returns a NumPy array for host memory or a CuPy array for device memory.

    Raises:
        ArrayMismatchError: wrong shape, dtype, memory layout, or device; for ``what="out"``
            (an array tiercache writes into), a read-only array.
    """
    where = f"{what} for pool {pool.name!r}"
    if _is_torch(arr):
        return _torch_raw(arr, pool, n, device_id, where)
    if isinstance(arr, np.ndarray) or (
        hasattr(arr, "__array_interface__") and not hasattr(arr, "__cuda_array_interface__")
    ):
        a = np.asarray(arr)
    elif hasattr(arr, "__cuda_array_interface__"):
        import cupy

        a = cupy.asarray(arr)
        if device_id is not None and a.device.id != device_id:
            raise ArrayMismatchError(f"{where} is on CUDA device {a.device.id}; the cache uses device {device_id}")
    else:
        raise ArrayMismatchError(
            f"{where} of type {type(arr).__name__} is not an array (NumPy, CuPy, PyTorch, or an object "
            "with __array_interface__ / __cuda_array_interface__)"
        )
    _check(tuple(a.shape), a.dtype, bool(a.flags.c_contiguous), pool, n, where)
    if what == "out" and isinstance(a, np.ndarray) and not a.flags.writeable:
        raise ArrayMismatchError(f"{where} is read-only; pass a writable array to fill")
    return a.view(np.uint8).reshape(n, pool.block_nbytes)


def _torch_raw(t, pool: PoolSpec, n: int, device_id: int | None, where: str):
    import torch

    _check(tuple(t.shape), t.dtype, t.is_contiguous(), pool, n, where)
    raw = t.view(torch.uint8).reshape(n, pool.block_nbytes)
    if t.is_cuda:
        if device_id is not None and t.device.index != device_id:
            raise ArrayMismatchError(f"{where} is on cuda:{t.device.index}; the cache uses device {device_id}")
        import cupy

        return cupy.asarray(raw)
    return raw.numpy()


def _check(shape: tuple, dtype, contiguous: bool, pool: PoolSpec, n: int, where: str) -> None:
    try:
        name = canonical_dtype(dtype)
    except ConfigError:
        name = str(dtype)
    typed = (n, *pool.block_shape)
    raw = (n, pool.block_nbytes)
    if name == "uint8" and shape == raw and pool.dtype != "uint8":
        pass
    elif name == "uint8" and pool.dtype != "uint8":  # raw bytes of the wrong shape
        raise ArrayMismatchError(
            f"{where} is uint8 (raw bytes) of shape {shape}; raw bytes of {n} block(s) have shape {raw} "
            f"(or pass {pool.dtype} of shape {typed})"
        )
    elif name != pool.dtype:
        raise ArrayMismatchError(
            f"{where} has dtype {name} and shape {shape}; expected {pool.dtype} (shape {typed}) or uint8 raw bytes "
            f"(shape {raw})"
        )
    elif shape != typed:
        raise ArrayMismatchError(f"{where} has shape {shape}; expected {typed} for {n} block(s)")
    if not contiguous:
        raise ArrayMismatchError(f"{where} is not C-contiguous; pass a contiguous array (e.g. .copy())")


def host_address(arr) -> int:
    """The address of the first byte of a C-contiguous host array or buffer (NumPy array,
    ``memoryview``). Through the buffer protocol (``ctypes.c_char.from_buffer``: 0.7 us on
    the CPU test machine) where the buffer is writable and not empty, else through
    ``__array_interface__`` (2.2 us: it builds a dict per call), which the per-block paths
    would otherwise pay once per file."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(arr))
    except (TypeError, ValueError, BufferError):  # read-only or empty
        return np.asarray(arr).__array_interface__["data"][0]


def prefault(arr: np.ndarray, page: int = 4096) -> np.ndarray:
    """Touch one byte in every ``page`` bytes of ``arr`` (writes a zero there), so that its
    memory is mapped now rather than at its first use; returns ``arr``.

    A buffer allocated once and reused (a staging area) would otherwise pay its page faults
    inside the first requests: on the 2-core CPU test machine a first-touch copy into fresh
    anonymous memory ran at 0.37-1.5 GB/s against 10 GB/s into mapped memory. Pinned memory
    (CUDA's host allocations) is mapped when allocated and needs none of this."""
    flat = arr.reshape(-1).view(np.uint8)
    flat[::page] = 0
    return arr


def aligned_empty(nbytes: int, align: int = 4096) -> np.ndarray:
    """A new, uninitialised ``uint8`` array of ``nbytes`` whose first byte is ``align``-aligned
    (a view into a slightly larger allocation)."""
    buf = np.empty(nbytes + align, dtype=np.uint8)
    skip = -buf.ctypes.data % align
    return buf[skip:skip + nbytes]


def host_output(pool: PoolSpec, n: int, alloc=aligned_empty) -> tuple[np.ndarray, np.ndarray]:
    """A new host array for ``n`` blocks of ``pool``: ``(typed_or_raw, raw_view)``; typed where
    NumPy has the dtype (bfloat16/fp8 need ``ml_dtypes``), else raw ``uint8``. The array starts
    on a page boundary (4096 bytes), so that the file tier reads whole-page blocks into it with
    O_DIRECT, straight from the device (NumPy's own allocation starts 16 bytes into a page,
    which sent those reads through the page cache: an extra copy per block). ``alloc(nbytes)``
    gives the page-aligned ``uint8`` memory (the cache passes
    :func:`tiercache.memory.recycled_empty`, which reuses the memory of arrays let go)."""
    from tiercache.dtypes import numpy_dtype

    raw = alloc(n * pool.block_nbytes).reshape(n, pool.block_nbytes)
    dt = numpy_dtype(pool.dtype)
    if dt is None:
        return raw, raw
    return raw.view(dt).reshape(n, *pool.block_shape), raw
