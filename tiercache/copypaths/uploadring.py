"""Asynchronous uploads of small host arrays (kernel arguments such as per-block offsets).

``cupy.asarray`` of a NumPy array copies from pageable memory, which blocks the host until the
stream reaches the copy: any launch queued behind pending work would stall the caller. The ring
keeps a pinned host buffer and a device buffer of the same size; each upload takes the next
region of both, copies with ``cudaMemcpyAsync`` (truly asynchronous from pinned memory), and
records an event after the kernels that read it (:meth:`UploadRing.release`). A region is
reused only after its event completed; the host waits only if the ring wraps onto a region still
in use.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from tiercache.memory import MEMCPY_DEFAULT, alloc_host

ALIGN = 256


class UploadRing:
    """A pinned -> device ring of ``nbytes`` bytes on CUDA device ``device_id``."""

    def __init__(self, device_id: int = 0, nbytes: int = 4 << 20) -> None:
        import cupy

        self.nbytes = nbytes
        self.host, self._owner = alloc_host(nbytes, pinned=True)
        with cupy.cuda.Device(device_id):
            self.dev = cupy.empty(nbytes, dtype=cupy.uint8)
        self._head = 0
        self._busy: deque[tuple[int, int, object]] = deque()  # (start, end, event) in allocation order
        self._open: list[tuple[int, int]] = []  # regions uploaded but not yet released
        self._spare: list = []  # events of released regions, reused
        self._lock = threading.Lock()

    def upload(self, arr: np.ndarray, stream):
        """Enqueue an upload of ``arr`` (C-contiguous) on ``stream``; returns the device array
        (same dtype and shape). Call :meth:`release` after enqueuing the kernels that read it."""
        import cupy

        raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        n = -(-raw.size // ALIGN) * ALIGN
        if n > self.nbytes:  # larger than the ring: a one-off buffer, synchronously
            return cupy.asarray(arr)
        with self._lock:
            if self._head + n > self.nbytes:
                self._head = 0
            start, end = self._head, self._head + n
            while self._busy and self._overlaps(start, end):  # oldest first
                ev = self._busy.popleft()[2]
                ev.synchronize()
                if not any(e is ev for *_, e in self._busy):
                    self._spare.append(ev)
            self.host[start:start + raw.size] = raw
            cupy.cuda.runtime.memcpyAsync(self.dev.data.ptr + start, self.host.ctypes.data + start, raw.size,
                                          MEMCPY_DEFAULT, stream.ptr)
            self._head = end
            self._open.append((start, end))
        return self.dev[start:start + raw.size].view(arr.dtype).reshape(arr.shape)

    def _overlaps(self, start: int, end: int) -> bool:
        return any(s < end and start < e for s, e, _ in self._busy)

    def release(self, stream) -> None:
        """The regions uploaded since the last release are free once ``stream`` gets here."""
        import cupy

        with self._lock:
            ev = self._spare.pop() if self._spare else cupy.cuda.Event(disable_timing=True)
            ev.record(stream)
            for s, e in self._open:
                self._busy.append((s, e, ev))
            self._open.clear()
