"""How a batch of block copies between two memory endpoints is executed on the GPU.

Per pool, a batch is planned into runs of consecutive slots on both sides
(:mod:`tiercache.copypaths.copyplan`), and each part goes where it was measured to be fastest:

- runs of at least ``memcpy_min_bytes``: one ``cudaMemcpyAsync`` each (copy engines, no SMs);
- blocks under ``batch_min_bytes`` in device -> host batches whose host slots form runs of at
  least ``offload_staged_min_run_bytes`` (on average; 256 KiB by default), in every device ->
  host batch under an SM carve-out (``carveout_sms``), and in host <-> device batches with runs
  of at least ``staged_min_run_bytes`` (off by default): the staged path
  (:mod:`tiercache.copypaths.stagedcopy`): copy engines for PCIe, the gather/scatter kernel for the
  scatter/gather in VRAM (a burst on every SM, or on the carve-out's SMs). SMs that write host
  memory slow compute on the other SMs (~50% for a bf16 GEMM on an H100); copy engines do not;
- other blocks of at least ``batch_min_bytes``, and partial copies whose segments are that
  long (token-major blocks: one segment per block): ``cuMemcpyBatchAsync``, one copy per
  segment, split over ``batch_streams`` streams (copy engines; per-segment
  ``cudaMemcpyAsync`` where the driver lacks it);
- the rest, 16-byte aligned, on sm_90+: one launch of the bulk-copy kernel
  (``kernels/copy_bulk.cu``): the Tensor Memory Accelerator moves blocks (or the first tokens
  of each, as segments) global -> shared -> global, one warp per CTA driving a ring of
  buffers. Shape ``large`` (default): 4 x 16 KiB buffers, one CTA on each of ``bulk_sms`` SMs;
  shape ``small``: 2 x 2 KiB buffers and 32 registers per thread, one CTA per SM on every SM,
  small enough to sit beside a compute kernel's CTAs. Segments shorter than a buffer go to the
  bulk kernel only on the small shape;
- anything else (and partial copies with short segments): one launch of the gather/scatter
  kernel (``kernels/copy_blocks.cu``), which reads and writes pinned host memory through
  unified addressing with 16-byte accesses where alignment allows; each block is ``segs``
  segments of ``seg_bytes`` bytes, ``seg_stride`` apart.

The gather/scatter kernel's grid is capped at ``max_sms * ctas_per_sm`` thread blocks, the bulk
kernel's at ``bulk_sms * bulk_ctas_per_sm``, so a copy occupies a bounded share of the GPU while
the engine computes. Measured on an H100 (docs/performance/copies.md): scattered 16 and 64 KiB blocks
at 88-96% of a contiguous copy, 256 KiB and up at 94-99%.
"""

from __future__ import annotations

import math

import numpy as np

from tiercache.copypaths import driverlaunch
from tiercache.copypaths.copyplan import contiguous_runs, memcpy_runs, strided_runs
from tiercache.copypaths.driverlaunch import KernelCall, Memcpy2DBatch, MemcpyCall, MemsetCall
from tiercache.copypaths.segments import Segments, vector_bytes
from tiercache.memory import MEMCPY_DEFAULT, data_ptr
from tiercache.settings import TransferSettings

#: the ``[transfer]`` settings' defaults, the launcher's own (tiercache.settings defines them once)
_DEFAULTS = TransferSettings()


def launcher_kwargs(t: TransferSettings) -> dict:
    """:class:`CopyLauncher`'s keyword arguments from the ``[transfer]`` settings (``bulk_shape =
    "off"``: no bulk kernel)."""
    return {"max_sms": t.copy_kernel_sms, "memcpy_min_bytes": t.memcpy_min_bytes, "batch_min_bytes": t.batch_min_bytes,
            "batch_streams": t.batch_streams, "bulk": t.bulk_shape != "off",
            "bulk_shape": "small" if t.bulk_shape == "off" else t.bulk_shape, "bulk_sms": t.bulk_sms,
            "staged_min_run_bytes": t.staged_min_run_bytes, "carveout_sms": t.carveout_sms,
            "offload_staged_min_run_bytes": t.offload_staged_min_run_bytes}


class CopyLauncher:
    """Enqueues block copies on a stream (see the module docstring).

    Args:
        device_id: the CUDA device.
        max_sms: SMs a copy kernel may occupy (None: all).
        ctas_per_sm: thread blocks per SM when sizing the grid.
        threads: threads per block.
        unroll: chunks in flight per thread (4 or 8).
        memcpy_min_bytes: runs at least this long go to ``cudaMemcpyAsync``.
        batch_min_bytes: other blocks (and segments of partial copies) at least this long go to
            ``cuMemcpyBatchAsync``.
        staged_min_run_bytes: host <-> device batches whose host-side runs average at least
            this many bytes take the staged path; 0 (the default) turns it off (alone it matches the
            bulk kernel, 90-98% of contiguous; beside a GEMM it needs deep staging, see
            docs/performance/copies.md).
        offload_staged_min_run_bytes: device -> host batches whose host-side runs average at
            least this many bytes take the staged path (default 256 KiB; 0: off): its copy engines
            write host memory, where the bulk kernel's SMs writing it slowed a bf16 GEMM on the
            other SMs by ~50% on an H100; alone both move 90-96% of contiguous.
        bulk: use the bulk-copy (TMA) kernel for 16-byte-aligned blocks and segments where the
            GPU has it (compute capability 9.0+).
        bulk_shape: ``large`` (64 KiB of shared memory per CTA, one CTA on each of ``bulk_sms``
            SMs: it does not share SMs with compute kernels) or ``small`` (one warp, 4 KiB of
            shared memory and 32 registers per thread per CTA: it fits beside a compute kernel's
            CTAs, which it then slows); see ``kernels/copy_bulk.cu`` and docs/performance/copies.md.
        bulk_sms: SMs the bulk kernel may use (None: ``max_sms``); its grid is ``bulk_sms *
            bulk_ctas_per_sm`` and the kernel holds at most ``bulk_ctas_per_sm`` CTAs per SM.
        batch_streams: streams one ``cuMemcpyBatchAsync`` batch is split over (see
            :meth:`_launch_batch`); also the copy-engine streams of the staged path.
        carveout_sms: the SMs the compute kernels leave free (their SM carve-out, for example
            ``tiercache.sm_carveout(carveout_sms)`` around cuBLASLt GEMMs), 0..1024; 0: none. When
            set, copies are picked for running beside compute: every copy kernel stays on
            ``carveout_sms`` SMs and fills them (two large bulk CTAs, or eight gather/scatter
            CTAs, on each); device -> host batches of whole blocks under ``batch_min_bytes`` take
            the staged path, whose PCIe hop is on the copy engines and whose VRAM hop stays on
            those SMs: SMs that write host memory slowed a GEMM on the other SMs by 40-60% on an
            H100, copy engines do not (docs/performance/copies.md). Host -> device copies keep the bulk
            kernel (SMs reading host memory cost the GEMM a few percent).

    Raises:
        ValueError: ``unroll`` not 4 or 8, an unknown ``bulk_shape``, or ``carveout_sms`` out
            of range.
    """

    #: bulk-copy kernel shapes (kernels/copy_bulk.cu): kernel name, shared-memory buffers, bytes
    #: per buffer. ``small`` fits beside a compute kernel's CTAs on the same SM; ``large`` keeps
    #: more bytes in flight per SM.
    BULK_SHAPES = {"small": ("tc_bulk_copy_small", 2, 2048), "large": ("tc_bulk_copy", 4, 16384)}
    #: per-SM counters the bulk kernel may index (by %smid)
    SM_SLOTS = 256
    #: a prepared launch of rows of at least ``MEMCPY2D_MIN_ROW_BYTES`` goes to 2-D copies when
    #: its strided runs average at least ``MEMCPY2D_MIN_ROWS`` rows and ``batch_min_bytes``
    #: bytes (else the bulk kernel)
    MEMCPY2D_MIN_ROWS = 4
    MEMCPY2D_MIN_ROW_BYTES = 16 << 10

    @classmethod
    def from_settings(cls, device_id: int, settings: TransferSettings) -> CopyLauncher:
        """A launcher on CUDA device ``device_id`` as the ``[transfer]`` settings configure it
        (:func:`launcher_kwargs`); what the transfer engine builds."""
        return cls(device_id, **launcher_kwargs(settings))

    def __init__(self, device_id: int = 0, max_sms: int | None = None, ctas_per_sm: int = 2, threads: int = 256,
                 unroll: int = 8, memcpy_min_bytes: int = _DEFAULTS.memcpy_min_bytes,
                 batch_min_bytes: int = _DEFAULTS.batch_min_bytes,
                 staged_min_run_bytes: int = _DEFAULTS.staged_min_run_bytes, bulk: bool = True,
                 bulk_shape: str = _DEFAULTS.bulk_shape, bulk_sms: int | None = None, bulk_ctas_per_sm: int = 1,
                 batch_streams: int = _DEFAULTS.batch_streams, carveout_sms: int = 0,
                 offload_staged_min_run_bytes: int = _DEFAULTS.offload_staged_min_run_bytes) -> None:
        import cupy

        from tiercache.copypaths.batchcopy import BatchCopy
        from tiercache.kernels.loader import get_kernel

        if unroll not in (4, 8):
            raise ValueError(f"unroll = {unroll} must be 4 or 8")
        if isinstance(carveout_sms, bool) or not isinstance(carveout_sms, (int, np.integer)) or not (
                0 <= carveout_sms <= 1024):
            raise ValueError(f"carveout_sms = {carveout_sms!r} must be an integer in 0..1024")
        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            self.num_sms = cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]
            self._kernels = {v: get_kernel("copy_blocks.cu", f"tc_copy_v{v}_u{unroll}", device_id)
                             for v in (16, 8, 4, 1)}
            self._spin = get_kernel("copy_blocks.cu", "tc_spin", device_id)
            cc = int(cupy.cuda.Device(device_id).compute_capability)
            if bulk_shape not in self.BULK_SHAPES:
                raise ValueError(f"bulk_shape = {bulk_shape!r}: expected one of {sorted(self.BULK_SHAPES)}")
            self._bulk = None
            self._bulk_kernels = {}  # shape -> (kernel, shared-memory bytes, bytes per buffer)
            if bulk and cc >= 90:
                for shape, (name, stages, chunk) in self.BULK_SHAPES.items():
                    fn = get_kernel("copy_bulk.cu", name, device_id)
                    fn.max_dynamic_shared_size_bytes = stages * chunk
                    # keep SMs in their largest shared-memory configuration, which a compute
                    # kernel needs anyway: a copy CTA that lands on an idle SM then does not make
                    # the next compute CTA wait for an L1/shared-memory reconfiguration
                    fn.preferred_shared_memory_carveout = 100
                    self._bulk_kernels[shape] = (fn, stages * chunk, chunk)
                self._bulk, self._bulk_smem, self._bulk_chunk = self._bulk_kernels[bulk_shape]
        self.bulk_shape = bulk_shape
        self.bulk_ctas_per_sm = bulk_ctas_per_sm
        self.carveout_sms = min(int(carveout_sms), self.num_sms)
        if self.carveout_sms:  # copy kernels only where compute leaves room, filling those SMs
            max_sms = bulk_sms = self.carveout_sms
            ctas_per_sm = max(ctas_per_sm, 8)
            if bulk_shape == "large":
                self.bulk_ctas_per_sm = max(2, bulk_ctas_per_sm)
        self.max_sms = self.num_sms if max_sms is None else max(1, min(int(max_sms), self.num_sms))
        self.bulk_sms = self.max_sms if bulk_sms is None else max(1, min(int(bulk_sms), self.num_sms))
        self.ctas_per_sm = ctas_per_sm
        self.threads = threads
        self.unroll = unroll
        self.memcpy_min_bytes = memcpy_min_bytes
        self.batch_min_bytes = batch_min_bytes
        self.staged_min_run_bytes = staged_min_run_bytes
        self.offload_staged_min_run_bytes = offload_staged_min_run_bytes
        self.batch = BatchCopy()
        self.batch_streams = batch_streams
        self._aux: list = []  # auxiliary streams of split batched copies
        self._keep = None  # arguments of the last batch call
        self._recording: list | None = None  # while prepare_many plans: the operations, not issued
        self._upload_stream = None  # uploads of prepared launches' tables
        from tiercache.copypaths.stagedcopy import StagedCopier
        from tiercache.copypaths.uploadring import UploadRing

        self.staged = StagedCopier(self, pcie_streams=batch_streams, hop_all_sms=not self.carveout_sms)
        self.ring = UploadRing(device_id)

    @property
    def bulk_available(self) -> bool:
        """True when whole aligned blocks go through the bulk-copy (TMA) kernel."""
        return self._bulk is not None

    def spin(self, stream, ns: int) -> None:
        """Debug: occupy ``stream`` for ``ns`` nanoseconds (one thread)."""
        self._spin((1,), (1,), (np.int64(ns),), stream=stream)

    def launch(self, src, src_slots: np.ndarray, dst, dst_slots: np.ndarray, seg: Segments, stream,
               force: str | None = None) -> str:
        """Copy rows ``src_slots`` of ``src`` to rows ``dst_slots`` of ``dst`` (``uint8``
        ``[rows, block_nbytes]`` arrays, host or device) on ``stream``. Returns the path used
        (``memcpy``, ``kernel`` or ``memcpy+kernel``). ``force`` = ``"memcpy"`` or
        ``"kernel"`` overrides the choice (benchmarks)."""
        import cupy

        n = src_slots.size
        if n == 0 or seg.seg_bytes == 0:
            return "none"
        row_src, row_dst = src.shape[1], dst.shape[1]
        sp, dp = data_ptr(src), data_ptr(dst)
        used = set()
        kernel_idx = np.arange(n)
        whole = seg.segs == 1 and seg.seg_bytes == row_src == row_dst
        if force == "memcpy" and not whole:
            # partial copies without the kernel (pageable memory): one 2-D copy per block
            for a, b in zip(src_slots.tolist(), dst_slots.tolist()):
                self._emit(lambda st, d=dp + b * row_dst, s=sp + a * row_src: cupy.cuda.runtime.memcpy2DAsync(
                    d, seg.seg_stride, s, seg.seg_stride, seg.seg_bytes, seg.segs, MEMCPY_DEFAULT, st.ptr), stream)
            return "memcpy"
        if whole and force not in ("kernel", "batch", "bulk"):
            runs = contiguous_runs(src_slots, dst_slots)
            big = (runs.length >= 1) if force == "memcpy" else memcpy_runs(runs, row_src, self.memcpy_min_bytes,
                                                                           self.batch_min_bytes)
            if big.any():
                for a, b, m in zip(runs.src[big].tolist(), runs.dst[big].tolist(), runs.length[big].tolist()):
                    self._memcpy(dp + b * row_dst, sp + a * row_src, m * row_src, stream)
                used.add("memcpy")
                starts = np.concatenate(([0], np.cumsum(runs.length)[:-1]))
                covered = np.zeros(n, dtype=bool)
                for st, m in zip(starts[big].tolist(), runs.length[big].tolist()):
                    covered[st:st + m] = True
                kernel_idx = np.flatnonzero(~covered)
        host_dev = isinstance(src, np.ndarray) != isinstance(dst, np.ndarray)
        if whole and kernel_idx.size and host_dev and row_src <= self.staged.chunk_bytes and (
                force == "staged" or force is None and self._wants_staged(
                    isinstance(src, np.ndarray), (src_slots if isinstance(src, np.ndarray) else dst_slots)[kernel_idx],
                    row_src)) and self._staged_ok():
            self.staged.copy(src, src_slots[kernel_idx], dst, dst_slots[kernel_idx], stream)
            used.add("staged")
            kernel_idx = kernel_idx[:0]
        if kernel_idx.size:
            src_off = src_slots[kernel_idx].astype(np.int64) * row_src
            dst_off = dst_slots[kernel_idx].astype(np.int64) * row_dst
            self._launch_offsets(sp, src_off, dp, dst_off, row_src, seg, stream, force, used,
                                 vector_bytes(sp, dp, row_src, row_dst, seg.seg_stride, seg.seg_bytes))
        return "+".join(sorted(used))

    def _wants_staged(self, h2d: bool, host_slots: np.ndarray, row: int, step: int = 1) -> bool:
        """Whether a host <-> device batch of whole ``row``-byte blocks (not taken by
        ``cudaMemcpyAsync`` runs) takes the staged path: only blocks under ``batch_min_bytes``
        (larger ones already go to the copy engines); under an SM carve-out every device -> host
        batch; otherwise batches whose host-side runs average ``staged_min_run_bytes`` (either
        direction) or ``offload_staged_min_run_bytes`` (device -> host), where set. ``host_slots``
        are slots, or addresses with ``step = row``."""
        if row >= self.batch_min_bytes:
            return False
        if self.carveout_sms and not h2d:
            return True
        needs = [x for x in (self.staged_min_run_bytes, 0 if h2d else self.offload_staged_min_run_bytes) if x]
        return bool(needs) and self.staged.host_runs(host_slots, step) * row >= min(needs)

    def _launch_offsets(self, sp: int, src_off: np.ndarray, dp: int, dst_off: np.ndarray, row: int, seg: Segments,
                        stream, force: str | None, used: set, vec: int) -> None:
        """Copy block ``i`` from ``sp + src_off[i]`` to ``dp + dst_off[i]`` (``int64`` byte offsets;
        with bases 0 they are addresses) by the batched driver copy (segments of at least
        ``batch_min_bytes``), the bulk kernel or the gather/scatter kernel, whichever applies;
        adds the path to ``used``."""
        import cupy

        n = src_off.size
        if self._recording is not None and seg.segs == 1 and seg.seg_bytes == row >= self.MEMCPY2D_MIN_ROW_BYTES \
                and driverlaunch.available():
            # a prepared launch of rows that line up in long strided runs (a host block's rows
            # going to consecutive device rows, as a layer-streaming cache's ring is laid out):
            # one 2-D copy per run on the copy engines, which keep ~95% of a contiguous copy
            # beside compute where the bulk kernel shares the SMs with it (docs/performance/copies.md)
            runs, sp2, dp2 = strided_runs(sp + src_off, dp + dst_off, row)
            k = runs.length.size
            if k * self.MEMCPY2D_MIN_ROWS <= n and n * row >= k * self.batch_min_bytes:
                self._recording.append(
                    Memcpy2DBatch(
                        [
                            (b, pd, a, ps, row, m)
                            for a, b, m, ps, pd in zip(
                                runs.src.tolist(), runs.dst.tolist(), runs.length.tolist(), sp2.tolist(), dp2.tolist()
                            )
                        ]
                    )
                )
                used.add("memcpy2d")
                return
        # a prepared launch takes a kernel where one can copy the rows: its host cost per run is
        # one launch, where the driver's batched copy costs ~1-2 us per row on every run
        batch_ok = self._recording is None or self._bulk is None
        if force == "batch" or (force is None and batch_ok and seg.seg_bytes >= self.batch_min_bytes):
            # one copy-engine copy per segment (a whole block is one segment): segments this long
            # move faster there than by SMs, and the copy engines leave the SMs to compute (a
            # token-major partial copy is one N x 128 KiB segment per Llama-8B block)
            step = np.arange(seg.segs, dtype=np.uint64) * np.uint64(seg.seg_stride)
            srcs = ((np.uint64(sp) + src_off.astype(np.uint64))[:, None] + step).reshape(-1)
            dsts = ((np.uint64(dp) + dst_off.astype(np.uint64))[:, None] + step).reshape(-1)
            if self.batch.available:
                self._launch_batch(dsts, srcs, seg.seg_bytes, stream)
                used.add("batch")
            else:
                for a, b in zip(srcs.tolist(), dsts.tolist()):
                    self._memcpy(b, a, seg.seg_bytes, stream)
                used.add("memcpy")
            return
        table = self.offsets_table([src_off], [dst_off])
        if self._recording is not None:
            # a prepared launch owns its table on the device; each run zeroes the bulk kernel's
            # counters (the rest of the table never changes)
            with cupy.cuda.Device(self.device_id):
                # on a stream of its own: cupy.asarray's legacy stream would wait for the whole queue
                if self._upload_stream is None:
                    self._upload_stream = cupy.cuda.Stream(non_blocking=True)
                offs = cupy.empty(table.shape, dtype=table.dtype)
                offs.set(table, stream=self._upload_stream)
                self._upload_stream.synchronize()
            p = offs.data.ptr
            cp, cn = p + 16 * n, 8 * (table.size - 2 * n)
            zero = MemsetCall(cp, cn) if driverlaunch.available() else \
                (lambda st: cupy.cuda.runtime.memsetAsync(cp, 0, cn, st.ptr))
            zero.table = offs  # the table lives as long as the recorded calls
            self._emit(zero, stream)
            used.add(self.launch_table(sp, dp, p, p + 8 * n, n, p + 16 * n, seg, vec, stream, force))
            return
        offs = self.ring.upload(table, stream)  # async, from pinned memory
        p = offs.data.ptr
        used.add(self.launch_table(sp, dp, p, p + 8 * n, n, p + 16 * n, seg, vec, stream, force))
        self.ring.release(stream)

    def copy_segments(self, dst_addrs, src_addrs, nbytes: int, stream, force: str | None = None) -> str:
        """Copy ``n`` segments of ``nbytes`` bytes each within this launcher's GPU: segment ``i``
        from device address ``src_addrs[i]`` to ``dst_addrs[i]`` (integer arrays ``[n]``;
        segments must not overlap), on ``stream`` (a CuPy stream), in one launch: one table
        upload (pinned ring, asynchronous) and one kernel (the bulk kernel where every address
        is 16-byte aligned and the GPU has it, else the gather/scatter kernel), or one batched
        driver copy for segments of at least ``batch_min_bytes``. What a scatter from a
        contiguous staging buffer into paged blocks needs, and the gather back: no call per
        segment (the driver's batched copy costs ~1-2 us of host time per segment).

        ``force``: ``"kernel"`` (the gather/scatter kernel), ``"bulk"`` or ``"batch"`` instead
        of the choice. Returns the path (``bulk``, ``kernel``, ``batch``; ``none`` for no
        segment).

        Raises:
            ValueError: arrays of different lengths, or ``nbytes`` < 1.
        """
        src = np.ascontiguousarray(src_addrs, dtype=np.int64).reshape(-1)
        dst = np.ascontiguousarray(dst_addrs, dtype=np.int64).reshape(-1)
        if src.size != dst.size or nbytes < 1:
            raise ValueError(f"copy_segments: {src.size} sources, {dst.size} destinations, nbytes = {nbytes} "
                             "(lengths must match, nbytes >= 1)")
        if not src.size:
            return "none"
        used: set = set()
        vec = vector_bytes(int(nbytes), int(np.bitwise_or.reduce(src)), int(np.bitwise_or.reduce(dst)))
        self._launch_offsets(0, src, 0, dst, int(nbytes), Segments(1, int(nbytes), int(nbytes)), stream, force, used,
                             vec)
        return "+".join(sorted(used))

    def plan_segments(self, copies: list, stream, force: str | None = None):
        """:meth:`copy_segments` of each of ``copies`` (``[(dst_addrs, src_addrs, nbytes)]``)
        planned at once: their tables built and uploaded (asynchronously, on ``stream``) in one
        copy, each launch issued later by :meth:`SegmentPlan.launch
        <tiercache.copypaths.segmentplan.SegmentPlan.launch>` with no NumPy or upload of its
        own (:mod:`tiercache.copypaths.segmentplan`). Returns None where :meth:`copy_segments`
        would not take a kernel for every copy (segments of ``batch_min_bytes`` or more, or
        ``force = "batch"``), or the tables would take more than a quarter of the upload ring:
        then copy each with :meth:`copy_segments`.

        Raises:
            ValueError: arrays of different lengths in a copy, or ``nbytes < 1``.
        """
        from tiercache.copypaths.segmentplan import SegmentPlan, plan_layout

        if self._recording is not None or force == "batch" or (
                force is None and any(nbytes >= self.batch_min_bytes for _, _, nbytes in copies)):
            return None
        table, launches = plan_layout(copies, self.SM_SLOTS)
        if table.nbytes > self.ring.nbytes // 4:
            return None
        return SegmentPlan(self, table, launches, stream, force)

    def offsets_table(self, src_offs: list, dst_offs: list) -> np.ndarray:
        """The kernels' argument table for launches of ``len(src_offs)`` lists of blocks: all
        source offsets, all destination offsets, then one zeroed counter area per launch (the
        bulk kernel's work counter and per-SM CTA counts, ``1 + SM_SLOTS`` words)."""
        n = sum(o.size for o in src_offs)
        table = np.zeros(2 * n + len(src_offs) * (1 + self.SM_SLOTS), dtype=np.int64)
        if src_offs:
            table[:n], table[n:2 * n] = np.concatenate(src_offs), np.concatenate(dst_offs)
        return table

    def launch_table(self, sp: int, dp: int, src_p: int, dst_p: int, n: int, counters_p: int, seg: Segments,
                     vec: int, stream, force: str | None = None, all_sms: bool = False) -> str:
        """Launch one copy of ``n`` blocks whose ``int64`` offsets are already on the device at
        ``src_p`` and ``dst_p`` (block ``i``: ``sp + src[i]`` -> ``dp + dst[i]``), by the bulk kernel
        when the GPU has it, every address is 16-byte aligned (``vec == 16``) and ``force``
        allows, else by the gather/scatter kernel with ``vec``-byte accesses. ``counters_p``:
        ``1 + SM_SLOTS`` zeroed words (see :meth:`offsets_table`). ``all_sms``: the gather/scatter
        kernel on every SM, whatever the bounds (device-to-device bursts: at HBM speed they need
        the SMs for a few microseconds, which they take in the gaps between compute kernels).
        Returns the path."""
        shape = self.bulk_shape
        whole = seg.segs == 1
        if not all_sms and vec == 16 and self._bulk is not None and (force == "bulk" or force is None and (
                whole or seg.seg_bytes >= self._bulk_kernels[shape][2] or shape == "small")):
            # segments shorter than a buffer go to the bulk kernel only on the small shape's many
            # CTAs: a few large CTAs issue too slowly for 256-byte pieces (1 token: 38% of
            # contiguous on 8 SMs, against ~90% for the gather/scatter kernel)
            fn, smem, chunk = self._bulk_kernels[shape]
            sms = self.bulk_sms
            # the per-SM cap keeps small CTAs from stacking on one SM (where a compute CTA then
            # no longer fits); large CTAs never fit beside compute, so several may share an SM
            per_sm = self.bulk_ctas_per_sm if shape == "small" else 0
            args = (np.uint64(sp), np.uint64(dp), np.uint64(src_p), np.uint64(dst_p), np.int64(n), np.int64(seg.segs),
                    np.int64(seg.seg_stride), np.int64(seg.seg_bytes), np.int64(chunk),
                    np.uint64(counters_p), np.int32(per_sm))
            grid = (sms * self.bulk_ctas_per_sm,)
            self._kernel(fn, grid, (32,), args, smem, stream)
            return "bulk"
        chunks = n * seg.segs * (seg.seg_bytes // vec)
        sms = self.num_sms if all_sms else self.max_sms
        grid = max(1, min(math.ceil(chunks / (self.threads * self.unroll)), sms * self.ctas_per_sm))
        fn = self._kernels[vec]
        args = (np.uint64(sp), np.uint64(dp), np.uint64(src_p), np.uint64(dst_p), np.int64(n),
                np.int64(seg.segs), np.int64(seg.seg_stride), np.int64(seg.seg_bytes))
        self._kernel(fn, (grid,), (self.threads,), args, 0, stream)
        return "kernel"

    def _launch_batch(self, dsts: np.ndarray, srcs: np.ndarray, row: int, stream) -> None:
        """``cuMemcpyBatchAsync`` of ``row``-byte copies, split over ``batch_streams`` streams
        (``stream`` and auxiliary ones joined back into it): each stream feeds its own copy
        engine, which hides the engines' per-copy cost (64 and 256 KiB blocks on an H100: 87% and
        97% of contiguous on one stream, 95% and 97-100% on two)."""
        import cupy

        from tiercache.memory import copy_stream

        k = max(1, min(self.batch_streams, dsts.size))
        parts = np.array_split(np.arange(dsts.size), k)
        batches = [self.batch.prepare(dsts[p], srcs[p], np.full(p.size, row, dtype=np.uint64)) for p in parts]
        with cupy.cuda.Device(self.device_id):
            while len(self._aux) < k - 1:
                self._aux.append(copy_stream("high"))
        aux = self._aux[:k - 1]

        def run(stream) -> None:
            self._keep = batches
            if aux:
                start = stream.record()
                for a in aux:
                    a.wait_event(start)
            for args, st in zip(batches, [stream, *aux]):
                self.batch.launch(args, st.ptr)
            for a in aux:
                stream.wait_event(a.record())

        self._emit(run, stream)

    # -- issuing, or recording for a prepared launch ------------------------------------------
    def _emit(self, op, stream) -> None:
        """Run ``op(stream)`` now, or keep it for :class:`PreparedLaunch` while recording."""
        if self._recording is not None:
            self._recording.append(op)
        else:
            op(stream)

    def _kernel(self, fn, grid, block, args: tuple, smem: int, stream) -> None:
        """Launch ``fn`` now (CuPy), or record it as a driver call packed once."""
        if self._recording is not None and driverlaunch.available():
            self._recording.append(KernelCall(fn, grid, block, args, smem))
        else:
            self._emit(lambda st: fn(grid, block, args, stream=st, shared_mem=smem), stream)

    def _memcpy(self, dst: int, src: int, nbytes: int, stream) -> None:
        import cupy

        if self._recording is not None and driverlaunch.available():
            self._recording.append(MemcpyCall(dst, src, nbytes))
        else:
            self._emit(lambda st: cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, MEMCPY_DEFAULT, st.ptr), stream)

    def _staged_ok(self) -> bool:
        """The staged path may take a batch (its buffers are reserved); a prepared launch
        cannot record it (it cycles shared staging buffers), so recording stops there."""
        if self._recording is not None:
            raise _NotRecordable
        return self.staged.reserve()

    def prepare_many(self, copies: list) -> PreparedLaunch:
        """Plan :meth:`launch_many` of ``copies`` once, for many runs: the path choice,
        addresses, driver batch arguments and kernel tables are built now (tables uploaded to
        the device once), and :meth:`PreparedLaunch.run` only issues the calls. The rows,
        arrays and their contents' addresses must stay as they are while it is used. A batch
        for the staged path is not recorded: its runs plan afresh each time. Whole rows of
        ``MEMCPY2D_MIN_ROW_BYTES`` and more go to 2-D copies (one per strided run,
        :func:`~tiercache.copypaths.copyplan.strided_runs`, all in one
        ``cuMemcpy3DBatchAsync`` where the driver has it) when the runs average
        ``MEMCPY2D_MIN_ROWS`` rows and ``batch_min_bytes`` bytes; other rows that would go to
        the driver's batched copy go to the bulk kernel where the GPU has it: the batched
        copy's host cost grows with the rows on every run (about 130 us for 128 rows on an
        H100 host), a kernel launch's does not."""
        self._recording = []
        try:
            path = self.launch_many(copies, None)
            ops = self._recording
        except _NotRecordable:
            path, ops = None, None
        finally:
            self._recording = None
        return PreparedLaunch(self, copies, ops, path)

    def launch_many(self, copies: list, stream) -> str:
        """Enqueue several :class:`~tiercache.transfer.rowcopy.RowCopy` (e.g. one per layer's pool) on
        ``stream``. When they all move whole rows of one size and none has a run of consecutive
        slots long enough for ``cudaMemcpyAsync``, they go out as one launch (absolute
        addresses: one offsets upload, one kernel or driver call for all pools); otherwise one
        :meth:`launch` each. Returns the paths used."""
        rows = {(c.src.shape[1], c.dst.shape[1], c.seg) for c in copies}
        mergeable = len(copies) > 1 and len(rows) == 1
        if mergeable:
            row_src, row_dst, seg = rows.pop()
            mergeable = row_src == row_dst and seg.segs == 1 and seg.seg_bytes == row_src
        if mergeable:
            for c in copies:
                runs = contiguous_runs(c.src_rows, c.dst_rows)
                if memcpy_runs(runs, row_src, self.memcpy_min_bytes, self.batch_min_bytes).any():
                    mergeable = False
                    break
        if not mergeable:
            paths = {self.launch(c.src, c.src_rows, c.dst, c.dst_rows, c.seg, stream) for c in copies} - {"none"}
            return "+".join(sorted(paths)) or "none"
        src_addr = np.concatenate([data_ptr(c.src) + c.src_rows.astype(np.int64) * row_src for c in copies])
        dst_addr = np.concatenate([data_ptr(c.dst) + c.dst_rows.astype(np.int64) * row_src for c in copies])
        if src_addr.size == 0 or row_src == 0:
            return "none"
        h2d = isinstance(copies[0].src, np.ndarray)
        if h2d != isinstance(copies[0].dst, np.ndarray) and row_src <= self.staged.chunk_bytes and self._wants_staged(
                h2d, src_addr if h2d else dst_addr, row_src, step=row_src) and self._staged_ok():
            host_at, dev_at = (src_addr, dst_addr) if h2d else (dst_addr, src_addr)
            pool_of = np.repeat(np.arange(len(copies)), [c.src_rows.size for c in copies])
            self.staged.copy_addrs(host_at, dev_at, row_src, h2d, stream, group=pool_of)
            return "staged"
        bases = {data_ptr(c.src) for c in copies} | {data_ptr(c.dst) for c in copies}
        used: set = set()
        self._launch_offsets(0, src_addr, 0, dst_addr, row_src, seg, stream, None, used,
                             vector_bytes(row_src, *bases))
        return "+".join(sorted(used))


def copy_kernel_status(device_id: int = 0) -> tuple[CopyLauncher | None, str]:
    """The project's copy kernels on CUDA device ``device_id``: ``(launcher, what runs)``
    where they build and load (a :class:`CopyLauncher` with default settings), else ``(None,
    why not)``: no usable GPU (:func:`~tiercache.cuda.cuda_status`'s reason), CuPy missing, a
    kernel that does not compile or load. Where the launcher with the bulk (TMA) kernel cannot
    be built, one without it is tried (the gather/scatter kernel alone, still one launch per
    copy) and ``what runs`` names the first failure. Never raises. What ``tiercache inspect``
    reports and the vLLM connector chooses its copies by (without them: torch's, a launch per
    region)."""
    from tiercache.cuda import cuda_status

    st = cuda_status()
    if not st.available:
        return None, st.reason
    try:
        la = CopyLauncher(device_id)
    except Exception as exc:  # CuPy missing, no kernel for this GPU, a compile or load failure
        first = f"{type(exc).__name__}: {exc}"
        try:
            la = CopyLauncher(device_id, bulk=False)
        except Exception as exc2:
            again = f"{type(exc2).__name__}: {exc2}"
            return None, first if again == first else f"{first}; without the bulk kernel: {again}"
        return la, f"the gather/scatter kernel (the launcher with the bulk kernel failed: {first})"
    return la, "the gather/scatter kernel" + (" and the bulk (TMA) kernel" if la.bulk_available else "")


class _NotRecordable(Exception):
    """A path a :class:`PreparedLaunch` cannot replay (the staged path)."""


class PreparedLaunch:
    """A :meth:`CopyLauncher.launch_many` planned once (:meth:`CopyLauncher.prepare_many`) and
    issued by :meth:`run` as often as needed: per run only the driver calls and kernel
    launches (a few microseconds each), none of the planning (run detection, path choice,
    address arithmetic, table uploads) that costs a fresh launch most of its host time.

    Attributes:
        copies: the :class:`~tiercache.transfer.rowcopy.RowCopy` list it moves.
        path: the paths its runs take (as :meth:`CopyLauncher.launch_many` names them), or
            None when it plans afresh each run (the staged path).
    """

    def __init__(self, launcher: CopyLauncher, copies: list, ops: list | None, path: str | None) -> None:
        self.launcher = launcher
        self.copies = copies
        self._ops = ops
        self.path = path

    def run(self, stream) -> str:
        """Enqueue the copies on ``stream`` (a CuPy stream); returns the paths used."""
        if self._ops is None:
            return self.launcher.launch_many(self.copies, stream)
        for op in self._ops:
            op(stream)
        return self.path
