"""The transfer engine: asynchronous, ordered copies of blocks between tiers, by slot.

``TransferEngine.copy`` validates a batch (every slot id in range, no repeated destination)
before anything runs, then enqueues it as one :class:`~tiercache.transfer.jobs.Job`:

- device <-> host and device <-> device: on the next stream of its direction (``offload``,
  ``onboard`` or ``copy``; a small pool per direction, no stream per call), as
  ``cudaMemcpyAsync`` runs and/or one gather/scatter kernel launch per pool
  (:mod:`tiercache.copypaths.copykernels`);
- host <-> host and caller <-> host without a GPU side: a CPU copy in the calling thread;
- anything <-> file: one task per block file on the file tier's I/O threads.

Conflicting jobs are ordered per slot (:mod:`tiercache.transfer.ordering`): a GPU copy waits on the
device for earlier GPU jobs (``cudaStreamWaitEvent``), and on the host only for threaded jobs
(file I/O), which have no device handle; file tasks wait for their dependencies in their own
I/O thread, never in the caller's. ``ordering=False`` switches all of this off: a debug switch
for tests that show each hazard corrupting bytes without it.

Two sync points tie the engine to the caller's compute stream (CuPy, PyTorch or a raw handle):
:meth:`TransferEngine.wait_for_stream` (copies issued next wait for work already queued there,
e.g. the kernel that wrote the blocks about to be offloaded) and
:meth:`TransferEngine.make_stream_wait` (the compute stream waits for onboards before reading
them).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque

import numpy as np

from tiercache.copypaths import CopyLauncher, contiguous_runs, segments_for
from tiercache.cuda import cuda_status
from tiercache.errors import SlotRangeError, TierUnavailableError
from tiercache.files import BlockFuture, FileTier
from tiercache.geometry import PoolSpec
from tiercache.memory import EventPool, StreamPool, as_cupy_stream
from tiercache.settings import TransferSettings
from tiercache.transfer.jobs import Job, JobResult
from tiercache.transfer.ordering import SlotLedger
from tiercache.transfer.rowcopy import RowCopy
from tiercache.transfer.transferstats import TransferStats

#: slot lists up to this long are checked as Python ints (:meth:`TransferEngine._slots`)
SMALL_SLOTS = 256

TIER_RANK = {"device": 0, "host": 1, "file": 2}


def _direction(src: str, dst: str) -> str:
    if src == "caller":
        return "put"
    if dst == "caller":
        return "get"
    if src == dst:
        return "copy"
    return "offload" if TIER_RANK[src] < TIER_RANK[dst] else "onboard"


class TransferEngine:
    """Asynchronous block copies between the tiers of one cache.

    Args:
        tiers: ``{"device": MemoryTier, "host": MemoryTier, "file": FileTier}`` (any subset).
        pools: the pools.
        device_id: CUDA device.
        settings: the ``[transfer]`` settings (:class:`~tiercache.settings.TransferSettings`):
            streams per direction, the SMs a copy kernel may occupy, the sizes that pick
            ``cudaMemcpyAsync`` / ``cuMemcpyBatchAsync`` / the bulk and staged paths (see
            :class:`~tiercache.copypaths.copykernels.CopyLauncher`).
        ordering: order conflicting copies per slot (turn off only to demonstrate hazards).
        keep_finished: results kept for :meth:`get_finished` (oldest dropped beyond it).
        record_stats: count every finished job in :attr:`transfer_stats` (blocks, bytes,
            failures and a latency histogram per source, destination and copy path).

    The engine is thread-safe (one lock around submission and bookkeeping).
    """

    #: pending jobs past which a submission retires every finished job, not only the oldest ones
    REAP_ALL_AT = 64

    def __init__(self, tiers: dict, pools: tuple[PoolSpec, ...], device_id: int = 0, *,
                 settings: TransferSettings = TransferSettings(), ordering: bool = True,
                 keep_finished: int = 100_000, record_stats: bool = True) -> None:
        self.tiers = tiers
        self.pools = {p.name: p for p in pools}
        self.device_id = device_id
        self.ordering = ordering
        self.gpu = cuda_status().available
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._pending: dict[int, Job] = {}
        self._finished: deque[JobResult] = deque(maxlen=keep_finished)
        self._ledger = SlotLedger({name: t.num_slots for name, t in tiers.items()})
        #: totals of finished jobs (None when ``record_stats`` is off)
        self.transfer_stats: TransferStats | None = TransferStats() if record_stats else None
        self.debug_delay_ns = 0  # tests: keep each GPU job's stream busy this long first
        self.debug_file_delay_s = 0.0  # tests: file tasks sleep this long before their I/O
        if self.gpu:
            t = settings
            self._streams = StreamPool(device_id, max(1, t.streams_per_direction))
            self._events = EventPool()
            import cupy

            with cupy.cuda.Device(device_id):
                self._after_event = cupy.cuda.Event(disable_timing=True)  # wait_for_stream, run_prepared(after=)
            self.launcher = CopyLauncher.from_settings(device_id, t)
        else:
            self._streams = self._events = self.launcher = None

    # -- validation -----------------------------------------------------------------------
    def _slots(self, tier: str, slots, n: int | None, what: str, unique: bool) -> np.ndarray:
        arr = np.asarray(slots, dtype=np.int64).reshape(-1)
        if n is not None and arr.size != n:
            raise SlotRangeError(f"{arr.size} {what} slots for {n} blocks")
        if tier == "caller":
            return arr
        t = self.tiers.get(tier)
        if t is None:
            raise TierUnavailableError(f"no {tier} tier; tiers: {', '.join(self.tiers)}")
        if arr.size:
            # a request's few slots as Python ints (min, max and a set: 3 us for 32 against 11
            # for NumPy's reductions and unique, CPU test machine); NumPy for large ones
            small = arr.size <= SMALL_SLOTS
            vals = arr.tolist() if small else arr
            lo, hi = (min(vals), max(vals)) if small else (int(arr.min()), int(arr.max()))
            if lo < 0 or hi >= t.num_slots:
                bad = lo if lo < 0 else hi
                raise SlotRangeError(f"{what} {tier} slot {bad} outside [0, {t.num_slots})")
            if unique and (len(set(vals)) if small else np.unique(arr).size) != arr.size:
                uniq, counts = np.unique(arr, return_counts=True)
                raise SlotRangeError(f"{what} {tier} slot {int(uniq[counts > 1][0])} appears twice in one batch")
        return arr

    # -- bookkeeping ----------------------------------------------------------------------
    def _job(self, jid: int) -> Job | None:
        return self._pending.get(jid)

    def _reap(self) -> None:
        """Retire every finished job."""
        for job in [j for j in self._pending.values() if j.done()]:
            self._retire(job)

    def _reap_oldest(self) -> None:
        """Retire finished jobs from the oldest on, up to the first one still running: what
        each submission does (a few event queries, not one per pending job); every finished
        job once more than ``REAP_ALL_AT`` are pending."""
        if len(self._pending) > self.REAP_ALL_AT:
            self._reap()
            return
        done = []
        for job in self._pending.values():
            if not job.done():
                break
            done.append(job)
        for job in done:
            self._retire(job)

    def _retire(self, job: Job) -> None:
        job.wait_host()  # sets the end time of threaded jobs; returns at once
        res = job.result()
        if res.failed:
            self._ledger.mark_failed(job, job.dst, job.failed_slots())
        self._finished.append(res)
        if self.transfer_stats is not None:
            self.transfer_stats.record(res.src, res.dst, res.path, res.blocks, res.nbytes, len(res.failed),
                                       res.seconds)
        del self._pending[job.id]
        if job.on_gpu:
            self._events.put(job.start_event, *job.group_events)
        job.retired = True

    def _arrays(self, tier: str, given: dict | None, pools: list[str]) -> dict:
        if given is not None:
            return given
        return {p: self.tiers[tier].arrays[p] for p in pools}

    # -- the one entry point ----------------------------------------------------------------
    def copy(self, src: str, src_slots, dst: str, dst_slots, *, keys=None, pools=None, num_tokens: int | None = None,
             src_arrays: dict | None = None, dst_arrays: dict | None = None) -> Job:
        """Enqueue a copy of blocks from ``src`` slots to ``dst`` slots; returns its job.

        Args:
            src, dst: ``"device"``, ``"host"``, ``"file"``, or ``"caller"`` (with
                ``src_arrays``/``dst_arrays``: ``{pool: uint8 array [rows, block_nbytes]}``,
                rows given as the slots).
            src_slots, dst_slots: equal-length integer sequences. For the file tier the slots
                are its index slots (used for ordering) and ``keys`` name the files.
            keys: block keys, one per slot, required when either side is ``"file"``.
            pools: pool names to copy (default: all).
            num_tokens: copy only the first ``num_tokens`` tokens of each block (KV pools;
                None or >= tokens_per_block: whole blocks). Memory tiers only.

        Raises:
            SlotRangeError: a slot out of range, a repeated destination slot, or slot lists of
                different lengths (nothing is enqueued).
            TierUnavailableError, ArrayMismatchError (bad ``num_tokens``).
        """
        with self._lock:
            s = self._slots(src, src_slots, None, "source", unique=False)
            d = self._slots(dst, dst_slots, s.size, "destination", unique=True)
            pool_names = list(pools) if pools is not None else list(self.pools)
            segs = {p: segments_for(self.pools[p], num_tokens) for p in pool_names}
            if "file" in (src, dst):
                if keys is None or len(keys) != s.size:
                    raise SlotRangeError(f"file transfers need one key per block ({s.size} blocks)")
                if num_tokens is not None:
                    raise SlotRangeError("partial (num_tokens) copies are for memory tiers; files hold whole blocks")
            self._reap_oldest()
            direction = _direction(src, dst)
            if "file" in (src, dst):
                nbytes = s.size * sum(sg.nbytes for sg in segs.values())
                job = self._file_job(next(self._ids), direction, src, s, dst, d, list(keys), pool_names,
                                     src_arrays, dst_arrays, nbytes)
                self._pending[job.id] = job
                return job
            sa = self._arrays(src, src_arrays, pool_names)
            da = self._arrays(dst, dst_arrays, pool_names)
            group = [RowCopy(sa[p], s, da[p], d, segs[p]) for p in pool_names]
            return self._memory_job(direction, src, s, dst, d, [group])

    def copy_rows(self, src: str, src_slots, dst: str, dst_slots, groups: list[list[RowCopy]],
                  direction: str | None = None) -> Job:
        """Enqueue row copies between memory tiers as one job, in ``groups`` whose completions
        can be waited on one by one (layer-wise onboarding: one group per layer).

        ``src_slots``/``dst_slots`` (equal length, one pair per copied unit) are the tier slots
        the ledger orders on; each :class:`RowCopy` names the array rows it moves (views of the
        tiers' arrays, e.g. one layer of each block, or one device block inside a larger host
        block). Destination slots may repeat (several units of one host block); destination
        rows may not, within a :class:`RowCopy`.

        Raises:
            SlotRangeError: a slot or row out of range, repeated destination rows, or
                mismatched lengths (nothing is enqueued).
        """
        with self._lock:
            s, d = self._check_rows(src, src_slots, dst, dst_slots, groups)
            self._reap_oldest()
            return self._memory_job(direction or _direction(src, dst), src, s, dst, d, groups)

    def _check_rows(self, src: str, src_slots, dst: str, dst_slots, groups: list[list[RowCopy]]):
        s = self._slots(src, src_slots, None, "source", unique=False)
        d = self._slots(dst, dst_slots, s.size, "destination", unique=False)
        for g in groups:
            for rc in g:
                rc.validate()
        return s, d

    def prepare_rows(self, src: str, src_slots, dst: str, dst_slots, groups: list[list[RowCopy]],
                     direction: str | None = None) -> PreparedRows:
        """:meth:`copy_rows` planned once, to be enqueued many times by :meth:`run_prepared`:
        validation, and on the GPU the launch plans (:meth:`CopyLauncher.prepare_many
        <tiercache.copypaths.copykernels.CopyLauncher.prepare_many>`), happen here. The arrays,
        rows and slots must keep their meaning while it is used (the caller pins what they
        name); each run is ordered by the ledger like any job.

        Raises:
            SlotRangeError: as :meth:`copy_rows` (nothing is prepared).
        """
        with self._lock:
            s, d = self._check_rows(src, src_slots, dst, dst_slots, groups)
            plans = None
            if self._on_gpu(groups):
                import cupy

                with cupy.cuda.Device(self.device_id):
                    plans = [self.launcher.prepare_many(g) if self._reachable(g) else None for g in groups]
            return PreparedRows(direction or _direction(src, dst), src, s, dst, d, groups, plans,
                                sum(rc.nbytes for g in groups for rc in g))

    def run_prepared(self, prepared: PreparedRows, after=None) -> Job:
        """Enqueue one run of ``prepared`` (from :meth:`prepare_rows`) as a job, ordered
        against every other job by the ledger; returns the job.

        ``after``: a stream (CuPy, PyTorch, ``__cuda_stream__`` or an int handle) whose work
        queued so far the run waits for, on the device; unlike :meth:`wait_for_stream` only
        this job's stream waits (one event record and one wait). None: no such wait."""
        with self._lock:
            self._reap_oldest()
            p = prepared
            return self._memory_job(p.direction, p.src, p.src_slots, p.dst, p.dst_slots, p.groups, p.plans, p.nbytes,
                                    after=after)

    def replayable(self, prepared: PreparedRows) -> bool:
        """True when :meth:`replay_prepared` can run ``prepared``: on the GPU, with a launch
        plan for every group."""
        return bool(self.gpu and prepared.plans is not None and all(p is not None for p in prepared.plans))

    def replay_prepared(self, prepared: PreparedRows, after, stream) -> Job:
        """Enqueue one run of ``prepared`` **outside the slot ledger**: on CuPy ``stream``,
        after the work queued so far on ``after`` (one event record and one wait), then the
        plan's driver calls, then one event per group. Nothing is looked up or recorded, and
        the job is not tracked as pending (:meth:`synchronize` still waits for it: it waits
        for every engine stream).

        For copies whose ordering the caller guarantees: every other access to the
        destination slots, and every write of the source slots, is ordered before or after it
        through ``after`` (see :meth:`PreparedOnboard.launch
        <tiercache.enginetensors.prepared.PreparedOnboard.launch>`'s ``exclusive`` plans, whose
        first run goes through :meth:`run_prepared` and whose replays follow it on its
        stream).

        Returns:
            A GPU :class:`~tiercache.transfer.jobs.Job` whose ``start_event`` is None (its
            result's ``seconds`` is host time).

        Raises:
            TierUnavailableError: ``prepared`` is not replayable (:meth:`replayable`).
            TransferError: the driver refused a launch (nothing after it was enqueued).
        """
        if not self.replayable(prepared):
            raise TierUnavailableError("replay_prepared needs a GPU and a launch plan for every group")
        import cupy

        p = prepared
        job = Job(next(self._ids), p.direction, p.src, p.dst, p.src_slots.size, p.nbytes, "gpu")
        job.dst_slots = p.dst_slots
        job.stream = stream
        with self._lock, cupy.cuda.Device(self.device_id):
            ev = p.after_event
            if ev is None:
                ev = p.after_event = cupy.cuda.Event(disable_timing=True)
            ev.record(as_cupy_stream(after))
            stream.wait_event(ev)
            n = len(p.plans)
            job.num_groups = n
            paths = []
            for plan in p.plans:
                paths.append(plan.run(stream))
                e = cupy.cuda.Event(disable_timing=True)
                e.record(stream)
                job.group_events.append(e)
            job.end_event = job.group_events[-1]
            job.path = paths[0] if n == 1 else "+".join(sorted({x for s in paths for x in s.split("+")} - {"none"}))
        return job

    def _on_gpu(self, groups: list[list[RowCopy]]) -> bool:
        return self.gpu and any(not isinstance(a, np.ndarray) for g in groups for rc in g for a in (rc.src, rc.dst))

    def _reachable(self, group: list[RowCopy]) -> bool:
        return all(self._gpu_reachable(rc.src) and self._gpu_reachable(rc.dst) for rc in group)

    def _memory_job(self, direction, src, s, dst, d, groups: list[list[RowCopy]], plans=None,
                    nbytes: int | None = None, after=None) -> Job:
        if nbytes is None:
            nbytes = sum(rc.nbytes for g in groups for rc in g)
        jid = next(self._ids)
        if self._on_gpu(groups):
            job = self._gpu_job(jid, direction, src, s, dst, d, groups, nbytes, plans, after)
        else:
            job = self._cpu_job(jid, direction, src, s, dst, d, groups, nbytes)
        self._pending[job.id] = job
        return job

    # -- GPU copies ---------------------------------------------------------------------------
    def _gpu_job(self, jid, direction, src, s, dst, d, groups, nbytes, plans=None, after=None) -> Job:
        import cupy

        stream = self._streams.next(direction if direction in ("offload", "onboard") else "copy")
        job = Job(jid, direction, src, dst, s.size, nbytes, "gpu")
        job.dst_slots = d
        job.stream = stream
        with cupy.cuda.Device(self.device_id):
            if after is not None:
                self._after_event.record(as_cupy_stream(after))
                stream.wait_event(self._after_event)
            covers: list[Job] = []
            if self.ordering:
                raw, war, readers = self._ledger.lookup(src, s, dst, d, gpu=True)
                waited_host = False
                for dep in (self._job(i) for i in (sorted(set(raw) | set(war)) if raw and war else raw or war)):
                    if dep is None:
                        continue
                    if dep.futures or any(not c.on_gpu for c in dep.covers):
                        dep.wait_host()  # threaded job: no device handle
                        waited_host = True
                    dep.make_stream_wait(stream)
                if waited_host:  # only threaded (file) jobs fail per block; GPU copies do not
                    self._inherit_failures(job, src, s)
                elif src in self.tiers:
                    bad = self._ledger.invalid(src, s)
                    if bad.size:
                        self._inherit_failures(job, src, s)
                covers = [j for j in (self._job(i) for i in readers) if j is not None and j.stream is not stream]
            job.start_event = self._events.get()
            job.end_event = self._events.get()
            job.start_event.record(stream)
            if self.debug_delay_ns:
                self.launcher.spin(stream, self.debug_delay_ns)
            # the kernel reaches host memory only when it is pinned (mapped into the GPU's
            # address space); caller arrays in pageable memory go through cudaMemcpyAsync
            paths = set()
            job.num_groups = len(groups)
            for gi, group in enumerate(groups):
                if plans is not None and plans[gi] is not None:
                    paths.update(plans[gi].run(stream).split("+"))
                elif self._reachable(group):
                    paths.update(self.launcher.launch_many(group, stream).split("+"))
                else:  # pageable caller memory: the kernels cannot reach it, copy engines can
                    for rc in group:
                        paths.add(self.launcher.launch(rc.src, rc.src_rows, rc.dst, rc.dst_rows, rc.seg, stream,
                                                       force="memcpy"))
                if gi < len(groups) - 1:
                    ev = self._events.get()
                    ev.record(stream)
                    job.group_events.append(ev)
            for c in covers:
                stream.wait_event(c.end_event)
            job.end_event.record(stream)
            job.group_events.append(job.end_event)
            job.path = "+".join(sorted(x for x in paths if x != "none")) or "none"
            if self.ordering:
                self._ledger.record(job, src, s, dst, d, gpu=True)
        return job

    def _gpu_reachable(self, arr) -> bool:
        if not isinstance(arr, np.ndarray):
            return True
        host = self.tiers.get("host")
        if host is not None and host.pinned and any(arr is a for a in host.arrays.values()):
            return True
        from tiercache.memory import is_pinned

        return is_pinned(arr)

    def _inherit_failures(self, job: Job, src: str, s: np.ndarray) -> None:
        """Blocks whose source slot a failed earlier job left invalid fail in ``job`` too
        (call after waiting for the source's writers)."""
        self._reap()
        for i in self._ledger.invalid(src, s).tolist():
            job.failed[i] = RuntimeError(f"source {src} slot {int(s[i])} holds no valid block: the copy into it failed")
            job.failed_dst_slots.add(int(job_dst_slot(job, i)))

    def _source_check(self, src: str, rows: list[int], raw_deps: list[Job]):
        """For file writes: a callable telling an I/O task whether its source slot holds no
        valid block. Failures already known are read now (under the engine lock); those of
        writers still pending are read from the jobs after the task waited for them, so the I/O
        threads never take the engine lock."""
        known = (
            set(np.asarray(rows, dtype=np.int64)[self._ledger.invalid(src, np.asarray(rows, dtype=np.int64))].tolist())
            if src in self.tiers
            else set()
        )
        if not known and not raw_deps:
            return None

        def check(i: int) -> str | None:
            row = rows[i]
            if row in known or any(row in dep.failed_slots() for dep in raw_deps):
                return f"source {src} slot {row} holds no valid block: the copy into it failed"
            return None

        return check

    # -- CPU copies ---------------------------------------------------------------------------
    def _cpu_job(self, jid, direction, src, s, dst, d, groups, nbytes) -> Job:
        job = Job(jid, direction, src, dst, s.size, nbytes, "cpu")
        job.dst_slots = d
        if self.ordering:
            raw, war = self._ledger.dependencies(src, s, dst, d)
            for i in sorted(set(raw) | set(war)):
                dep = self._job(i)
                if dep is not None:
                    dep.wait_host()
            self._inherit_failures(job, src, s)
        job.num_groups = len(groups)
        for group in groups:
            for rc in group:
                _cpu_copy(rc.src, rc.src_rows, rc.dst, rc.dst_rows, rc.seg)
        if self.ordering:  # done already (not a pending reader or writer): its destinations hold what it copied
            self._ledger.set_valid(dst, d, job.failed_dst_slots)
        return job

    # -- file transfers -------------------------------------------------------------------
    def _file_job(self, jid, direction, src, s, dst, d, keys, pool_names, src_arrays, dst_arrays, nbytes) -> Job:
        ft: FileTier = self.tiers["file"]
        mem = src_arrays or dst_arrays or self.tiers[src if dst == "file" else dst].arrays
        on_device = any(not isinstance(a, np.ndarray) for a in mem.values())
        job = Job(jid, direction, src, dst, s.size, nbytes, ft.io_path.label if on_device else "POSIX")
        deps: list[Job] = []
        raw: list[int] = []
        if self.ordering:
            raw, war = self._ledger.dependencies(src, s, dst, d)
            deps = [j for j in (self._job(i) for i in sorted(set(raw) | set(war))) if j is not None]
            job.covers = [j for j in (self._job(i) for i in self._ledger.previous_readers(src, s, gpu=False))
                          if j is not None]
        if dst == "file":
            arrays = self._arrays(src, src_arrays, pool_names)
            rows = [int(r) for r in s]
            skip = self._source_check(src, rows, [j for j in deps if j.id in raw]) if self.ordering else None
            # host rows of a one-pool tier, every source valid: the row writes (names, addresses
            # and headers as arrays: tiercache/files/rowwrites.py); else the general path
            outcome = None
            if skip is None and not on_device and not self.debug_file_delay_s and len(pool_names) == 1:
                outcome = ft.submit_row_writes(keys, pool_names[0], arrays[pool_names[0]], s, deps)
            if outcome is not None:
                job.futures = [(k, BlockFuture(outcome, i)) for i, k in enumerate(keys)]
            else:
                items = [(k, {p: arrays[p][r] for p in pool_names}) for k, r in zip(keys, rows)]
                job.futures = ft.submit("write", items, deps, self.debug_file_delay_s, skip=skip)
            job._dst_slot_of = {k: int(x) for k, x in zip(keys, d)}
        else:
            arrays = self._arrays(dst, dst_arrays, pool_names)
            # host rows: the row reads (names, checks and addresses as arrays, no Python per
            # block: tiercache/files/rowreads.py); else the general path
            rows = None if self.debug_file_delay_s or on_device else {p: arrays[p] for p in pool_names}
            futures = ft.submit_row_pools(keys, rows, d, deps) if rows is not None else None
            if futures is not None:
                job.futures = futures
            else:
                items = [(k, {p: arrays[p][int(r)] for p in pool_names}) for k, r in zip(keys, d)]
                job.futures = ft.submit("read", items, deps, self.debug_file_delay_s)
            job._dst_slot_of = {k: int(x) for k, x in zip(keys, d)}
        if self.ordering:
            self._ledger.record(job, src, s, dst, d, gpu=False)
        return job

    # -- sync points ------------------------------------------------------------------------
    def wait_for_stream(self, stream=None) -> None:
        """Copies enqueued after this call wait for the work already queued on ``stream``
        (the engine's compute stream: CuPy, PyTorch, ``__cuda_stream__`` or an int handle;
        None for CuPy's current stream). Call it before offloading blocks that kernels just
        wrote. Device-side only; the host does not wait."""
        if not self.gpu:
            return
        import cupy

        with self._lock, cupy.cuda.Device(self.device_id):
            # one event serves every call: a wait binds to the event's record at the time of
            # the wait (cudaStreamWaitEvent), so recording it again later changes nothing
            ev = self._after_event
            ev.record(as_cupy_stream(stream))
            for st in self._streams.all():
                st.wait_event(ev)

    def make_stream_wait(self, stream=None, jobs=None) -> None:
        """Make ``stream`` wait for ``jobs`` (default: every pending job writing the device
        tier, i.e. onboards) before it runs anything queued after this call. GPU jobs are
        waited on the device; threaded jobs (file -> device) on the host."""
        if not self.gpu:
            for j in jobs or list(self._pending.values()):
                j.wait_host()
            return
        import cupy

        with self._lock, cupy.cuda.Device(self.device_id):
            st = as_cupy_stream(stream)
            todo = list(jobs) if jobs is not None else [j for j in self._pending.values() if j.dst == "device"]
            for j in todo:
                j.make_stream_wait(st)

    def host_barrier(self, tier: str, slots, write: bool) -> None:
        """Block until host code may read (``write=False``) or overwrite (``write=True``)
        ``slots`` of ``tier``: pending writers, and for a write also pending readers."""
        if not self.ordering:
            return
        arr = np.asarray(slots, dtype=np.int64).reshape(-1)
        with self._lock:
            ids = self._ledger.pending_all(tier, arr) if write else self._ledger.pending_writers(tier, arr)
            deps = [j for j in (self._job(i) for i in ids) if j is not None]
        for j in deps:
            j.wait_host()

    # -- completion -------------------------------------------------------------------------
    def get_finished(self) -> list[JobResult]:
        """Results of the jobs that finished since the last call (never blocks)."""
        with self._lock:
            self._reap()
            out = list(self._finished)
            self._finished.clear()
            return out

    def reap(self, timeout: float = -1) -> bool:
        """Retire the jobs that have finished (their results go to :meth:`get_finished` and
        :attr:`transfer_stats`) without taking their results. Waits at most ``timeout``
        seconds for the engine's lock (-1: as long as it takes); returns False when it could
        not have it (a submission is waiting for file I/O). Never waits for a job."""
        if not self._lock.acquire(timeout=timeout):
            return False
        try:
            self._reap()
        finally:
            self._lock.release()
        return True

    def pending(self) -> list[Job]:
        """Jobs not finished yet, in submission order."""
        with self._lock:
            self._reap()
            return sorted(self._pending.values(), key=lambda j: j.id)

    def synchronize(self) -> None:
        """Wait for every pending job, and for everything queued on the engine's streams
        (replays, :meth:`replay_prepared`, are not tracked as jobs)."""
        for j in self.pending():
            j.wait_host()
        with self._lock:
            self._reap()
            if self.gpu:
                import cupy

                with cupy.cuda.Device(self.device_id):
                    for st in self._streams.all():
                        st.synchronize()

    def shutdown(self) -> None:
        """Drain: wait for every pending job. The engine stays usable."""
        self.synchronize()


def job_dst_slot(job: Job, i: int) -> int:
    """Destination slot of item ``i`` of a memory job."""
    return int(job.dst_slots[i]) if job.dst_slots is not None else -1


def _cpu_copy(src: np.ndarray, s: np.ndarray, dst: np.ndarray, d: np.ndarray, seg) -> None:
    """Host-to-host copy of rows ``s`` -> ``d`` (segments of each row for partial copies)."""
    if seg.segs == 1 and seg.seg_bytes == src.shape[1] == dst.shape[1]:
        runs = contiguous_runs(s, d)
        for a, b, n in zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist()):
            dst[b:b + n] = src[a:a + n]
        return
    # every block is segs * seg_stride bytes, so these reshapes are views of the rows
    sv = src.reshape(src.shape[0], seg.segs, seg.seg_stride)
    dv = dst.reshape(dst.shape[0], seg.segs, seg.seg_stride)
    dv[d, :, : seg.seg_bytes] = sv[s, :, : seg.seg_bytes]


class PreparedRows:
    """A row copy planned once by :meth:`TransferEngine.prepare_rows` (the arguments of
    :meth:`TransferEngine.copy_rows`, validated, with one launch plan per group on the GPU:
    None where a group plans afresh each run, as for pageable caller memory)."""

    def __init__(self, direction: str, src: str, src_slots: np.ndarray, dst: str, dst_slots: np.ndarray,
                 groups: list[list[RowCopy]], plans: list | None, nbytes: int) -> None:
        self.direction = direction
        self.src, self.src_slots = src, src_slots
        self.dst, self.dst_slots = dst, dst_slots
        self.groups = groups
        self.plans = plans
        self.nbytes = nbytes
        self.after_event = None  # replay_prepared's wait on the caller's stream (reused: a wait binds at call time)
