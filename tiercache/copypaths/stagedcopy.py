"""The staged path: host <-> device copies of blocks whose host slots form runs, with the PCIe
hop on the copy engines and the gather/scatter in VRAM.

SMs that copy over PCIe slow the compute kernels: on an H100, one small copy CTA per SM beside
cuBLAS's bf16 GEMM slowed the product by about 45%; copies by SMs the GEMM does not use (an SM
carve-out) still slowed it by 40-85% when they wrote host memory (a few percent when they read
it). The copy engines take no SMs: beside the GEMM a contiguous copy keeps 97-98% of its speed
and costs the GEMM about 1% (docs/performance/copies.md). When the host side of a batch is made of runs
of consecutive slots (the cache allocates host slots lowest-free-first, so an offloaded batch
lands in runs and is onboarded from them), the PCIe hop is one batched driver copy per chunk
(``cuMemcpyBatchAsync``; ``cudaMemcpyAsync`` per run without it) of the runs into (or out of) a
device staging buffer, and the scatter (or gather) between the staging buffer and the scattered
device slots is the gather/scatter kernel at HBM speed: a burst on every SM (high-priority
stream, in the gaps between compute kernels), or on the SMs of the carve-out.

The launcher sends here device -> host batches into host runs (``offload_staged_min_run_bytes``),
every device -> host batch under an SM carve-out, and host <-> device batches with long runs
when ``staged_min_run_bytes`` asks for it. The batch is sorted by host address and processed in
chunks through a ring of staging buffers: the copy engines fill one buffer (the PCIe hops
alternate between ``pcie_streams`` streams, one copy engine each) while the kernel empties
another (an auxiliary stream), ordered by events, so the hops overlap. The ring's depth
(``buffers * chunk_bytes``) is how long the copy engines keep going while the kernels wait for
SMs.
"""
from __future__ import annotations

import numpy as np

from tiercache.copypaths.segments import Segments, vector_bytes
from tiercache.memory import MEMCPY_DEFAULT, copy_stream, data_ptr


def run_starts(host_at: np.ndarray, chunk_of: np.ndarray, row: int, new_group: np.ndarray) -> np.ndarray:
    """Where the copy engines' runs start in a batch sorted by host address: block i opens a
    run unless it follows block i-1 at ``row`` bytes in the same chunk (``chunk_of``) and the
    same host allocation (``new_group[i-1]`` False)."""
    return np.flatnonzero(np.concatenate(([True], (np.diff(host_at) != row) | (np.diff(chunk_of) != 0) | new_group)))


class StagedCopier:
    """Runs host-run <-> scattered-device copies through a device staging buffer.

    Args:
        launcher: the :class:`~tiercache.copypaths.copykernels.CopyLauncher` whose kernel does the
            device-side scatter/gather (with its SM bound).
        chunk_bytes: bytes per staging buffer (``buffers`` of them are allocated on first use).
        buffers: staging buffers in the ring (>= 2).
        pcie_streams: streams the PCIe hops are dealt over, chunk by chunk (the job's stream and
            ``pcie_streams - 1`` more): each feeds its own copy engine, which hides the engines'
            per-copy cost between the chunks.
        hop_all_sms: the VRAM hop (the gather/scatter kernel) as a burst on every SM (True), or
            within the launcher's bound of ``max_sms`` SMs x ``ctas_per_sm`` CTAs (the SMs the
            compute kernels leave free when they run with an SM carve-out).
    """

    def __init__(self, launcher, chunk_bytes: int = 16 << 20, buffers: int = 4, hop_all_sms: bool = True,
                 pcie_streams: int = 2) -> None:
        self.launcher = launcher
        self.chunk_bytes = chunk_bytes
        self.hop_all_sms = hop_all_sms
        self.pcie_streams = max(1, pcie_streams)
        self._buf = None
        self._aux = None
        self.available = True  # False once its staging VRAM could not be allocated
        self._pcie_aux: list = []  # the copy-engine streams besides the job's own
        self.buffers = max(2, buffers)
        self._free = [None] * self.buffers  # event: the buffer's last use finished
        self._keep: list = []  # arguments of the batched driver copies in flight (kept alive)

    def reserve(self) -> bool:
        """Allocate the staging buffers (``buffers * chunk_bytes`` of VRAM) and streams if not
        yet done. Returns False, with a warning, and stays unavailable if the VRAM is not there
        (an engine that took nearly all of it): the launcher's other paths take over."""
        if not self.available:
            return False
        import cupy

        try:
            self._setup()
        except cupy.cuda.memory.OutOfMemoryError as exc:
            import warnings

            self.available = False
            warnings.warn(f"tiercache: no VRAM for the staged path's {self.buffers} x {self.chunk_bytes} bytes "
                          f"of staging ({exc}); copies take the kernel paths", RuntimeWarning, stacklevel=3)
        return self.available

    def _setup(self):
        import cupy

        if self._buf is None:
            with cupy.cuda.Device(self.launcher.device_id):
                self._buf = cupy.empty((self.buffers, self.chunk_bytes), dtype=cupy.uint8)
                self._aux = copy_stream("high")  # its kernels take SMs ahead of compute
        while len(self._pcie_aux) < self.pcie_streams - 1:
            with cupy.cuda.Device(self.launcher.device_id):
                self._pcie_aux.append(copy_stream("high"))
        return self._buf, self._aux

    @staticmethod
    def host_runs(host_slots: np.ndarray, step: int = 1) -> float:
        """Mean length, in blocks, of the runs of consecutive slots (or of addresses ``step``
        bytes apart) after sorting."""
        if host_slots.size == 0:
            return 0.0
        hs = np.sort(host_slots)
        return hs.size / (1 + int(np.count_nonzero(np.diff(hs) != step)))

    def copy(self, src, src_slots: np.ndarray, dst, dst_slots: np.ndarray, stream) -> None:
        """Enqueue whole-block copies between host rows and device rows (one side NumPy pinned,
        the other CuPy) on ``stream``; the job's completion is recorded on ``stream`` after this."""
        h2d = isinstance(src, np.ndarray)
        host, dev = (src, dst) if h2d else (dst, src)
        hslots, dslots = (src_slots, dst_slots) if h2d else (dst_slots, src_slots)
        row = host.shape[1]
        self.copy_addrs(data_ptr(host) + hslots.astype(np.int64) * row, data_ptr(dev) + dslots.astype(np.int64) * row,
                        row, h2d, stream)

    def copy_addrs(self, host_at: np.ndarray, dev_at: np.ndarray, row: int, h2d: bool, stream,
                   group: np.ndarray | None = None) -> None:
        """:meth:`copy` by addresses: block i is the ``row`` bytes at ``host_at[i]`` (pinned
        host memory) and ``dev_at[i]`` (device memory), ``int64`` arrays; host -> device when
        ``h2d``. Blocks of several host allocations may be mixed when ``group[i]`` names block
        i's allocation: a run of host addresses ``row`` apart never crosses from one to another
        (two allocations may lie side by side in the address space, and one copy must not span
        them).

        Raises:
            ValueError: ``row`` exceeds ``chunk_bytes``.
        """
        if host_at.size == 0:
            return
        buf, aux = self._setup()
        per_chunk = max(1, self.chunk_bytes // row)
        if per_chunk * row > self.chunk_bytes:  # a block larger than a chunk: no staging
            raise ValueError(f"block of {row} bytes exceeds the staging chunk of {self.chunk_bytes}")
        order = np.argsort(host_at, kind="stable")
        host_at, dev_at = host_at[order].astype(np.int64), dev_at[order].astype(np.int64)
        new_group = np.zeros(max(0, host_at.size - 1), dtype=bool) if group is None else np.diff(group[order]) != 0
        la, n = self.launcher, host_at.size
        self._keep = []
        bp = buf.data.ptr
        # every address once, vectorized: block i goes through chunk i // per_chunk, in buffer
        # chunk % buffers; its kernel hop uses absolute addresses (bases 0)
        chunk_of = np.arange(n) // per_chunk
        stage_at = bp + (chunk_of % self.buffers) * self.chunk_bytes + (np.arange(n) - chunk_of * per_chunk) * row
        n_chunks = int(chunk_of[-1]) + 1
        cuts = list(range(0, n, per_chunk)) + [n]
        src_at, dst_at = (stage_at, dev_at) if h2d else (dev_at, stage_at)
        table = la.offsets_table([src_at], [dst_at])  # the gather/scatter kernel needs no counters
        offs = la.ring.upload(table, stream)
        tp = offs.data.ptr
        # the copy engines' hop: runs of consecutive host blocks, cut at chunk boundaries
        starts = run_starts(host_at, chunk_of, row, new_group)
        sizes = np.diff(np.concatenate((starts, [n]))) * row
        host_runs, stage_runs = host_at[starts], stage_at[starts]
        run_cut = np.searchsorted(chunk_of[starts], np.arange(n_chunks + 1))
        seg = Segments(1, row, row)
        vec = vector_bytes(bp, row, self.chunk_bytes, *np.unique(dev_at % 16).tolist())
        # the device side's first reads and writes come after the upload and what the job waited
        # for on `stream`
        pcie = [stream, *self._pcie_aux[:max(0, min(self.pcie_streams, n_chunks) - 1)]]
        start = stream.record()
        for st in [aux, *pcie[1:]]:
            st.wait_event(start)
        for k in range(n_chunks):
            h, ce = k % self.buffers, pcie[k % len(pcie)]
            i0, i1, r0, r1 = cuts[k], cuts[k + 1], run_cut[k], run_cut[k + 1]
            first_stream = ce if h2d else aux
            if self._free[h] is not None:
                first_stream.wait_event(self._free[h])
            if h2d:
                self._pcie(stage_runs[r0:r1], host_runs[r0:r1], sizes[r0:r1], ce)
                aux.wait_event(ce.record())
                self._hop(tp, i0, i1, n, seg, vec, aux)
                self._free[h] = aux.record()
            else:
                self._hop(tp, i0, i1, n, seg, vec, aux)
                ce.wait_event(aux.record())
                self._pcie(host_runs[r0:r1], stage_runs[r0:r1], sizes[r0:r1], ce)
                self._free[h] = ce.record()
        la.ring.release(aux)  # the kernels on aux read the table
        # the job completes on `stream`: it must also wait for the last kernels on `aux` and the
        # copies on the other copy-engine streams
        for st in [aux, *pcie[1:]]:
            stream.wait_event(st.record())

    def _hop(self, tp: int, i0: int, i1: int, n: int, seg: Segments, vec: int, aux) -> None:
        """The VRAM hop of blocks ``i0:i1`` (addresses in the uploaded table at ``tp``): the
        gather/scatter kernel, as a burst on every SM or within the launcher's SM bound (where,
        with 8 CTAs per SM, it moved 200 GB/s on 4 SMs of an H100 against 90-130 GB/s for the bulk
        kernel, whose few warps keep less in flight)."""
        self.launcher.launch_table(0, 0, tp + 8 * i0, tp + 8 * (n + i0), i1 - i0, tp + 16 * n, seg, vec, aux,
                                   force="kernel", all_sms=self.hop_all_sms)

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
