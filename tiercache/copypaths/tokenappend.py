"""One kernel launch per decode step and layer that appends new K/V tokens to a KV cache held
as a ring buffer plus a tail block (``kernels/kv_append.cu``), issued through the driver with
its arguments packed once (:class:`~tiercache.copypaths.driverlaunch.KernelCall`).

A layer-streaming cache (:class:`~tiercache.integrations.transformers.TieredCache`) keeps
each layer's last, partial block in a tail (pinned host memory the kernel reaches through its
unified address, or VRAM), and rebuilds the layer's keys and values in a shared ring buffer
every step: full blocks onboarded from the host, then the tail's tokens and the new ones. With
PyTorch that is three copies and five views per layer (about 50 us of host time on the H200
machine's host); this is one launch (a few us).
"""

from __future__ import annotations

import numpy as np

from tiercache.copypaths.driverlaunch import KernelCall, available
from tiercache.errors import ConfigError

THREADS = 256
MAX_GRID = 1024


class TokenAppend:
    """Appends tokens to one cache's tails and ring buffers (see ``kernels/kv_append.cu``).

    The cache's ring K and V pools are one device allocation: K at ``kv``, V at ``kv +
    pool_stride`` bytes; its tails' K and V likewise, at ``tails`` and ``tails +
    tail_pool_stride`` (default: the ring's allocation and stride). (Sequence ``b``, head
    ``h``) is row ``r = b * heads + h`` of a ring buffer (``ring_row_stride`` bytes apart,
    tokens contiguous) and of a tail (``tail_row_stride`` bytes apart).

    Args:
        kv: device address of the ring's K pool.
        pool_stride: bytes from the ring's K pool to its V pool.
        heads: KV heads per sequence (>= 1); rows: ``batch * heads``.
        row_bytes: bytes per token of one head (``head_dim * itemsize``).
        ring_row_stride, tail_row_stride: bytes between rows of a ring buffer, of a tail.
        device_id: the CUDA device.
        tails: address of the tails' K pool: in VRAM, or in pinned host memory (its unified
            address: the kernel reads the tail's earlier tokens and writes the new ones
            across the bus, ``2 * rows * n * row_bytes`` bytes per call). None: ``kv``.
        tail_pool_stride: bytes from the tails' K pool to their V pool (None: ``pool_stride``).

    Raises:
        ConfigError: a size out of range.

    Build it only where :meth:`usable` is True (the driver loads); elsewhere copy with the
    tensor library.
    """

    def __init__(self, kv: int, pool_stride: int, heads: int, rows: int, row_bytes: int, ring_row_stride: int,
                 tail_row_stride: int, device_id: int = 0, *, tails: int | None = None,
                 tail_pool_stride: int | None = None) -> None:
        for name, v in (("heads", heads), ("rows", rows), ("row_bytes", row_bytes)):
            if v < 1:
                raise ConfigError(f"{name} = {v} must be >= 1")
        if rows % heads:
            raise ConfigError(f"rows = {rows} is not a multiple of heads = {heads}")
        from tiercache.kernels.loader import get_kernel

        self.rows, self.row_bytes = rows, row_bytes
        tails = kv if tails is None else tails
        tail_pool_stride = pool_stride if tail_pool_stride is None else tail_pool_stride
        aligned = all(x % 16 == 0 for x in (kv, pool_stride, row_bytes, ring_row_stride, tail_row_stride, tails,
                                            tail_pool_stride))
        i64, i32 = np.int64, np.int32
        args = (np.uint64(kv), i64(pool_stride), i64(0), i64(0), i64(ring_row_stride), i64(tail_row_stride),
                np.uint64(tails), i64(tail_pool_stride), np.uint64(0), np.uint64(0), *(i64(0),) * 6, i32(heads),
                i32(rows), i32(row_bytes), i32(0), i32(0), i32(0))
        self._calls = {}
        for vec in ((16, 1) if aligned else (1,)):
            self._calls[vec] = KernelCall(get_kernel("kv_append.cu", f"tc_kv_append_v{vec}", device_id), (1,),
                                          (THREADS,), args)

    @staticmethod
    def usable() -> bool:
        """True when the driver loads (the launch goes through ``libcuda``)."""
        return available()

    def __call__(self, stream, k_ptr: int, k_strides, v_ptr: int, v_strides, tail_off: int, ring_off: int,
                 base: int, split: int, n: int) -> None:
        """Enqueue on CuPy ``stream``: ring tokens ``base .. base + n`` of the buffer at
        ``ring_off`` (bytes into a pool) get the tail's tokens ``0 .. split`` (the tail at
        ``tail_off`` bytes into the tails' pool) and then the ``n - split`` new tokens, which
        also go to tail tokens ``split .. n``. New K at device address ``k_ptr`` with ``(batch,
        head, token)`` strides ``k_strides`` in bytes (the head_dim axis contiguous); V
        likewise. ``n == split`` copies the tail's tokens only.

        Raises:
            TransferError: the driver refused the launch.
        """
        vec = 16 if 16 in self._calls and not (k_ptr | v_ptr | tail_off | ring_off
                                                 | k_strides[0] | k_strides[1] | k_strides[2]
                                                 | v_strides[0] | v_strides[1] | v_strides[2]) & 15 else 1
        call = self._calls[vec]
        s = call.set
        s(2, tail_off)
        s(3, ring_off)
        s(8, k_ptr)
        s(9, v_ptr)
        s(10, k_strides[0])
        s(11, k_strides[1])
        s(12, k_strides[2])
        s(13, v_strides[0])
        s(14, v_strides[1])
        s(15, v_strides[2])
        s(19, base)
        s(20, split)
        s(21, n)
        chunks = 2 * self.rows * n * (self.row_bytes // vec)
        call.set_grid(min(MAX_GRID, max(1, -(-chunks // THREADS))))
        call(stream)
