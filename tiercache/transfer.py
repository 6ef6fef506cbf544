"""Moving blocks' bytes between memory endpoints and files (the mechanism; no policy).

A *memory endpoint* is a dict ``{pool: uint8 array [rows, block_nbytes]}`` plus row indices:
a tier's arrays with its slots, or a caller's arrays with rows ``0..n-1``. Copies between two
memory endpoints are planned into runs of consecutive rows (:mod:`tiercache.copyplan`); each run
is one ``cudaMemcpyAsync`` on the stream of its direction (or one NumPy copy host to host).
File transfers go through :class:`~tiercache.file_tier.FileTier`.

Every method returns when its bytes are in place; the asynchronous job API is built on top.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from .copyplan import contiguous_runs
from .cuda import cuda_status
from .memcopy import MEMCPY_DEFAULT, data_ptr


def _on_device(arr) -> bool:
    return not isinstance(arr, np.ndarray)


class Mover:
    """Copies blocks; owns one CUDA stream per direction when CUDA is usable.

    Args:
        device_id: CUDA device of the device tier.
    """

    def __init__(self, device_id: int = 0) -> None:
        self.device_id = device_id
        self._streams = None
        if cuda_status().available:
            import cupy

            with cupy.cuda.Device(device_id):
                self._streams = {
                    "down": cupy.cuda.Stream(non_blocking=True),  # device -> host (offload)
                    "up": cupy.cuda.Stream(non_blocking=True),    # host -> device (onboard)
                }

    def copy(self, src: dict, src_rows: Sequence[int], dst: dict, dst_rows: Sequence[int]) -> float:
        """Copy rows ``src_rows`` of every pool array in ``src`` to rows ``dst_rows`` of
        ``dst`` (same pools). Returns the seconds taken. Rows must already be validated."""
        t0 = time.perf_counter()
        runs = contiguous_runs(src_rows, dst_rows)
        gpu = any(_on_device(a) for a in (*src.values(), *dst.values()))
        if not gpu:
            for pool, s in src.items():
                d = dst[pool]
                for a, b, n in zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist()):
                    d[b:b + n] = s[a:a + n]
            return time.perf_counter() - t0
        import cupy

        down = any(_on_device(a) for a in src.values())
        stream = self._streams["down" if down else "up"]
        with cupy.cuda.Device(self.device_id):
            # order after work the caller already queued (e.g. the kernel that wrote the
            # source) on its current stream; the legacy default stream covers PyTorch's too
            stream.wait_event(cupy.cuda.get_current_stream().record())
            for pool, s in src.items():
                d = dst[pool]
                row = s.shape[1]
                sp, dp = data_ptr(s), data_ptr(d)
                for a, b, n in zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist()):
                    cupy.cuda.runtime.memcpyAsync(dp + b * row, sp + a * row, n * row, MEMCPY_DEFAULT, stream.ptr)
            stream.synchronize()
        return time.perf_counter() - t0

    def synchronize(self) -> None:
        """Wait for every copy issued by this mover."""
        if self._streams:
            for s in self._streams.values():
                s.synchronize()


def rows_of(arrays: dict, rows: Sequence[int]) -> list[dict]:
    """Per row, ``{pool: 1-D row view}``: the buffers of one block, for file I/O."""
    return [{pool: arr[int(r)] for pool, arr in arrays.items()} for r in rows]
