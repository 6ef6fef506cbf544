"""The staged path: host <-> device copies of blocks whose host slots form runs, with the PCIe
hop on the copy engines and the gather/scatter in VRAM.

SM-driven copies over PCIe cost about one SM per 5 GB/s on an H100 (measured by
``tiercache bench --job copy``), and every SM they hold is taken from the engine's compute. When
the host side of a batch is made of runs of consecutive slots (the cache allocates host slots
lowest-free-first, so an offloaded batch lands in runs and is onboarded from them), the PCIe
hop can instead be one ``cudaMemcpyAsync`` per host run into (or out of) a device staging
buffer, and the scatter (or gather) between the staging buffer and the scattered device slots
is a device-to-device kernel at HBM speed, holding SMs for a small fraction of the time.

The batch is sorted by host slot and processed in chunks through two halves of the staging
buffer: the copy engine fills one half (``stream``) while the kernel empties the other (an
auxiliary stream), ordered by events, so the two hops overlap.
"""

from __future__ import annotations

import numpy as np

from .copykernels import Segments
from .memcopy import MEMCPY_DEFAULT, data_ptr


class StagedCopier:
    """Runs host-run <-> scattered-device copies through a device staging buffer.

    Args:
        launcher: the :class:`~tiercache.copykernels.CopyLauncher` whose kernel does the
            device-side scatter/gather (with its SM bound).
        chunk_bytes: bytes per staging half (two halves are allocated on first use).
    """

    def __init__(self, launcher, chunk_bytes: int = 16 << 20) -> None:
        self.launcher = launcher
        self.chunk_bytes = chunk_bytes
        self._buf = None
        self._aux = None
        self._free = [None, None]  # event: the half's last use finished

    def _setup(self):
        import cupy

        if self._buf is None:
            with cupy.cuda.Device(self.launcher.device_id):
                self._buf = cupy.empty((2, self.chunk_bytes), dtype=cupy.uint8)
                self._aux = cupy.cuda.Stream(non_blocking=True)
        return self._buf, self._aux

    @staticmethod
    def host_runs(host_slots: np.ndarray) -> float:
        """Mean length, in blocks, of the runs of consecutive slots after sorting."""
        if host_slots.size == 0:
            return 0.0
        hs = np.sort(host_slots)
        return hs.size / (1 + int(np.count_nonzero(np.diff(hs) != 1)))

    def copy(self, src, src_slots: np.ndarray, dst, dst_slots: np.ndarray, stream) -> None:
        """Enqueue whole-block copies between host rows and device rows (one side NumPy pinned,
        the other CuPy) on ``stream``; the job's completion is recorded on ``stream`` after this."""
        import cupy

        buf, aux = self._setup()
        h2d = isinstance(src, np.ndarray)
        host, dev = (src, dst) if h2d else (dst, src)
        hslots, dslots = (src_slots, dst_slots) if h2d else (dst_slots, src_slots)
        row = host.shape[1]
        per_chunk = max(1, self.chunk_bytes // row)
        if per_chunk * row > self.chunk_bytes:  # a block larger than a chunk: no staging
            raise ValueError(f"block of {row} bytes exceeds the staging chunk of {self.chunk_bytes}")
        order = np.argsort(hslots, kind="stable")
        hs, ds = hslots[order], dslots[order]
        hp, bp = data_ptr(host), buf.data.ptr
        seg = Segments(1, row, row)
        staging = buf.view(np.uint8).reshape(2, self.chunk_bytes)
        for k, i0 in enumerate(range(0, hs.size, per_chunk)):
            h = k % 2
            i1 = min(i0 + per_chunk, hs.size)
            half = staging[h, : (i1 - i0) * row].reshape(i1 - i0, row)
            local = np.arange(i1 - i0)
            chunk = hs[i0:i1]
            brk = np.flatnonzero(np.diff(chunk) != 1) + 1
            starts = np.concatenate(([0], brk))
            lens = np.diff(np.concatenate((starts, [chunk.size])))
            first_stream = stream if h2d else aux
            if self._free[h] is not None:
                first_stream.wait_event(self._free[h])
            if h2d:
                for st, n in zip(starts.tolist(), lens.tolist()):
                    cupy.cuda.runtime.memcpyAsync(bp + h * self.chunk_bytes + st * row, hp + int(chunk[st]) * row,
                                                  n * row, MEMCPY_DEFAULT, stream.ptr)
                filled = stream.record()
                aux.wait_event(filled)
                self.launcher.launch(half, local, dev, ds[i0:i1], seg, aux, force="kernel")
                self._free[h] = aux.record()
            else:
                self.launcher.launch(dev, ds[i0:i1], half, local, seg, aux, force="kernel")
                gathered = aux.record()
                stream.wait_event(gathered)
                for st, n in zip(starts.tolist(), lens.tolist()):
                    cupy.cuda.runtime.memcpyAsync(hp + int(chunk[st]) * row, bp + h * self.chunk_bytes + st * row,
                                                  n * row, MEMCPY_DEFAULT, stream.ptr)
                self._free[h] = stream.record()
        # the job completes on `stream`: it must also wait for the last kernels on `aux`
        stream.wait_event(aux.record())
