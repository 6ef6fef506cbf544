"""The staged path: host <-> device copies of blocks whose host slots form runs, with the PCIe
hop on the copy engines and the gather/scatter in VRAM.

Any SM that copies over PCIe also slows the compute kernels sharing it: on an H100, one small
copy CTA per SM beside cuBLAS's bf16 GEMM (which fits: one warp, 4 KiB of shared memory) still
slowed the product by about 40%, with TMA bulk copies and with plain loads alike, while the
copy engines take no SMs (``benchmarks/copy_variants.py``, section ``fit``). When the host side
of a batch is made of runs of consecutive slots (the cache allocates host slots lowest-free-
first, so an offloaded batch lands in runs and is onboarded from them), the PCIe hop is one
batched driver copy (``cuMemcpyBatchAsync``; ``cudaMemcpyAsync`` per run without it) of the runs
into (or out of) a device staging buffer, and the scatter (or gather) between the staging buffer
and the scattered device slots is a device-to-device copy at HBM speed, by the launcher's
bulk-copy kernel where it has one (small CTAs that fit beside compute and finish quickly, as
their requests never wait on PCIe), else by its gather/scatter kernel.

The batch is sorted by host slot and processed in chunks through two halves of the staging
buffer: the copy engines fill one half (``stream``) while the kernel empties the other (an
auxiliary stream), ordered by events, so the two hops overlap.
"""

from __future__ import annotations

import numpy as np

from .copykernels import Segments
from .memcopy import MEMCPY_DEFAULT, data_ptr
from .streams import copy_stream


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
        self._keep: list = []  # arguments of the batched driver copies in flight (kept alive)

    def _setup(self):
        import cupy

        if self._buf is None:
            with cupy.cuda.Device(self.launcher.device_id):
                self._buf = cupy.empty((2, self.chunk_bytes), dtype=cupy.uint8)
                self._aux = copy_stream("high")  # its kernels take SMs ahead of compute
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
        hp, bp = np.uint64(data_ptr(host)), buf.data.ptr
        seg = Segments(1, row, row)
        staging = buf.view(np.uint8).reshape(2, self.chunk_bytes)
        force = "bulk" if self.launcher.bulk_available else "kernel"
        self._keep = []
        # the device side's first reads and writes come after what the job waited for on `stream`
        aux.wait_event(stream.record())
        for k, i0 in enumerate(range(0, hs.size, per_chunk)):
            h = k % 2
            i1 = min(i0 + per_chunk, hs.size)
            half = staging[h, : (i1 - i0) * row].reshape(i1 - i0, row)
            local = np.arange(i1 - i0)
            chunk = hs[i0:i1]
            brk = np.flatnonzero(np.diff(chunk) != 1) + 1
            starts = np.concatenate(([0], brk))
            lens = np.diff(np.concatenate((starts, [chunk.size])))
            host_at = hp + chunk[starts].astype(np.uint64) * np.uint64(row)
            stage_at = np.uint64(bp + h * self.chunk_bytes) + starts.astype(np.uint64) * np.uint64(row)
            sizes = lens.astype(np.uint64) * np.uint64(row)
            first_stream = stream if h2d else aux
            if self._free[h] is not None:
                first_stream.wait_event(self._free[h])
            if h2d:
                self._pcie(stage_at, host_at, sizes, stream)
                aux.wait_event(stream.record())
                self.launcher.launch(half, local, dev, ds[i0:i1], seg, aux, force=force)
                self._free[h] = aux.record()
            else:
                self.launcher.launch(dev, ds[i0:i1], half, local, seg, aux, force=force)
                stream.wait_event(aux.record())
                self._pcie(host_at, stage_at, sizes, stream)
                self._free[h] = stream.record()
        # the job completes on `stream`: it must also wait for the last kernels on `aux`
        stream.wait_event(aux.record())

    def _pcie(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream) -> None:
        """The copy engines' hop: one batched driver copy of the runs (``uint64`` addresses and
        byte sizes), or one ``cudaMemcpyAsync`` per run where the driver lacks it."""
        import cupy

        batch = self.launcher.batch
        if batch.available and dsts.size > 1:
            args = batch.prepare(dsts, srcs, sizes)
            self._keep.append(args)
            batch.launch(args, stream.ptr)
            return
        for d, s_, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            cupy.cuda.runtime.memcpyAsync(d, s_, n, MEMCPY_DEFAULT, stream.ptr)
