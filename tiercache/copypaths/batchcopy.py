"""The driver's batched copy, ``cuMemcpyBatchAsync`` (CUDA 12.8+), called through ctypes.

One call hands the copy engines a list of (destination, source, size) triples: no SMs are used
and there is one API call for the batch instead of one per block. On the H100s measured here it
reaches ~97% of a contiguous copy for 2 MiB blocks but far less for small ones, which is why the
engine uses it only for blocks of at least ``batch_min_bytes``.
"""

from __future__ import annotations

import ctypes

import numpy as np

from tiercache.errors import TransferError


class _Attrs(ctypes.Structure):  # CUmemcpyAttributes: access order, src/dst location hints, flags
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcType", ctypes.c_int), ("srcId", ctypes.c_int),
                ("dstType", ctypes.c_int), ("dstId", ctypes.c_int), ("flags", ctypes.c_uint)]


SRC_ACCESS_ORDER_STREAM = 1


class BatchCopy:
    """``cuMemcpyBatchAsync`` where the driver has it (``available``)."""

    def __init__(self) -> None:
        self.fn = None
        self.v2 = False  # CUDA 13 signature (no failIdx)
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return
        for name, v2 in (("cuMemcpyBatchAsync_v2", True), ("cuMemcpyBatchAsync", False)):
            fn = getattr(lib, name, None)
            if fn is not None:
                self.fn, self.v2 = fn, v2
                break

    @property
    def available(self) -> bool:
        return self.fn is not None

    def prepare(self, dsts, srcs, sizes) -> tuple:
        """Arguments for :meth:`launch`: addresses and sizes as ``uint64`` arrays."""
        return (np.ascontiguousarray(dsts, dtype=np.uint64), np.ascontiguousarray(srcs, dtype=np.uint64),
                np.ascontiguousarray(sizes, dtype=np.uint64), _Attrs(SRC_ACCESS_ORDER_STREAM, 0, 0, 0, 0, 0),
                np.zeros(1, dtype=np.uint64), np.zeros(1, dtype=np.uint64))

    def launch(self, args: tuple, stream_ptr: int) -> None:
        """Enqueue the copies of ``args`` on ``stream_ptr``.

        Raises:
            TransferError: the driver refused the batch (its CUresult).
        """
        dsts, srcs, sizes, attrs, idxs, fail = args
        p = ctypes.c_void_p
        common = [p(dsts.ctypes.data), p(srcs.ctypes.data), p(sizes.ctypes.data), ctypes.c_size_t(dsts.size),
                  ctypes.byref(attrs), p(idxs.ctypes.data), ctypes.c_size_t(1)]
        rc = self.fn(*common, p(stream_ptr)) if self.v2 else self.fn(*common, p(fail.ctypes.data), p(stream_ptr))
        if rc != 0:
            raise TransferError(f"cuMemcpyBatchAsync failed with CUresult {rc}")
