"""Transfer jobs: one asynchronous batch copy, pollable and waitable.

A job completes either on a CUDA stream (a GPU copy: its end event) or on I/O threads (file
transfers and CPU copies: futures). Either way it can be polled (:meth:`Job.done`), waited on
(:meth:`Job.wait`), made a dependency of a CUDA stream (:meth:`Job.make_stream_wait`) and,
once finished, reports bytes, seconds and direction (:class:`JobResult`).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from tiercache.errors import TransferError
from tiercache.keys import key_text


def distinct_outcomes(futures) -> list:
    """What to wait for to know ``futures`` settled: the outcome a chunk's block futures share
    (their ``outcome``: :class:`~tiercache.files.blockbatch.Outcome`) once, any other future
    itself. Both have ``done()`` and ``exception(timeout)``; an outcome's is its first failure."""
    seen: dict[int, object] = {}
    for f in futures:
        o = getattr(f, "outcome", f)
        seen.setdefault(id(o), o)
    return list(seen.values())


@dataclass(frozen=True)
class JobResult:
    """What a finished job did.

    Attributes:
        job_id: the job's id (increasing in submission order).
        direction: ``offload`` (down the tiers), ``onboard`` (up), ``copy`` (within a tier),
            ``put`` / ``get`` (from / to caller arrays).
        src, dst: tier names (``caller`` for caller arrays).
        blocks: blocks copied (failed ones excluded).
        nbytes: bytes copied (for partial copies, only the tokens copied).
        seconds: time of the copy itself: CUDA event time for GPU copies, wall time from the
            start of the first to the end of the last file operation for file jobs.
        path: how the bytes moved (``memcpy``, ``kernel``, ``memcpy+kernel``, ``cpu``,
            ``POSIX``, ``kvikio compat``, ``GDS (cuFile)``).
        failed: keys (file jobs) or slot indices whose copy failed, with their errors.
    """

    job_id: int
    direction: str
    src: str
    dst: str
    blocks: int
    nbytes: int
    seconds: float
    path: str
    failed: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class Job:
    """One asynchronous transfer. Created by :class:`~tiercache.transfer.engine.TransferEngine`.

    Attributes:
        id, direction, src, dst, blocks, nbytes, path: see :class:`JobResult`.
    """

    def __init__(self, job_id: int, direction: str, src: str, dst: str, blocks: int, nbytes: int, path: str) -> None:
        self.id = job_id
        self.direction = direction
        self.src = src
        self.dst = dst
        self.blocks = blocks
        self.nbytes = nbytes
        self.path = path
        self.stream = None          # CuPy stream of a GPU job
        self.start_event = None
        self.end_event = None
        self.futures: list[tuple[object, Future]] = []  # (key or index, future) of a threaded job
        self.covers: list[Job] = []  # earlier readers this job's completion must imply
        self.failed: dict = {}       # known failures (set at submit for dependency failures)
        self.failed_dst_slots: set[int] = set()  # destination slots that hold no valid block
        self.dst_slots = None  # destination slots of a memory job (int64 array)
        self._dst_slot_of: dict = {}  # key/index -> destination slot, to map failures
        self._t0 = time.perf_counter()
        self._waits: tuple | None = None  # (futures, what they settle through: one per chunk)
        self._t1: float | None = None
        self._result: JobResult | None = None
        self.group_events: list = []  # GPU job: one event per copy group (the last is end_event)
        self.num_groups = 1
        self.retired = False  # set by the engine once finished and reaped (its events recycled)

    # -- state -----------------------------------------------------------------------------
    @property
    def on_gpu(self) -> bool:
        return self.end_event is not None

    def done(self) -> bool:
        """True when the job (and every earlier reader it covers) has finished. Never blocks."""
        if self.retired:
            return True
        if self.on_gpu and not self.end_event.done:
            return False
        if any(not w.done() for w in self._settles()):
            return False
        return all(j.done() for j in self.covers)

    def wait(self, timeout: float | None = None) -> JobResult:
        """Block until finished; return the result.

        Raises:
            TransferError: some blocks failed (``failed_keys`` lists them); the others are in
                place.
            TimeoutError: ``timeout`` (seconds) passed first.
        """
        self.wait_host(timeout)
        res = self.result()
        if res.failed:
            first = next(iter(res.failed.values()))
            names = ", ".join(key_text(k) if isinstance(k, (int, bytes)) else str(k) for k in list(res.failed)[:5])
            raise TransferError(
                f"job {self.id} ({self.src} -> {self.dst}): {len(res.failed)} block(s) failed: {names}: "
                f"{type(first).__name__}: {first}", list(res.failed)
            ) from (first if isinstance(first, BaseException) else None)
        return res

    def wait_host(self, timeout: float | None = None) -> None:
        """Block the calling thread until finished (errors are kept for :meth:`result`)."""
        if self.retired:
            return
        deadline = None if timeout is None else time.perf_counter() + timeout
        if self.on_gpu:
            if timeout is None:
                self.end_event.synchronize()
            else:
                while not self.end_event.done:
                    if time.perf_counter() > deadline:
                        raise TimeoutError(f"job {self.id} not finished after {timeout} s")
                    time.sleep(50e-6)
        for w in self._settles():
            left = None if deadline is None else max(0.0, deadline - time.perf_counter())
            if deadline is None and hasattr(w, "help"):
                w.help()  # an outcome's tasks no I/O thread has started run here (Outcome.help)
            try:
                w.exception(timeout=left)
            except TimeoutError:
                raise TimeoutError(f"job {self.id} not finished after {timeout} s") from None
        for j in self.covers:
            j.wait_host(None if deadline is None else max(0.0, deadline - time.perf_counter()))
        if self._t1 is None:
            self._t1 = time.perf_counter()

    def make_stream_wait(self, stream) -> None:
        """Make CuPy ``stream`` wait for this job: on the device for GPU jobs; threaded jobs
        have no device-side handle, so the host waits for them (unavoidable)."""
        if self.retired:
            return
        threaded = bool(self.futures) or any(not j.on_gpu for j in self.covers)
        if threaded:
            self.wait_host()
        if self.on_gpu:
            stream.wait_event(self.end_event)
        for j in self.covers:
            if j.on_gpu and not j.retired:
                stream.wait_event(j.end_event)

    # -- copy groups (layer-wise onboarding) --------------------------------------------------
    def _group_event(self, i: int):
        if not 0 <= i < self.num_groups:
            raise IndexError(f"group {i} outside [0, {self.num_groups})")
        return self.group_events[i] if self.on_gpu and not self.retired else None

    def group_done(self, i: int) -> bool:
        """True when copy group ``i`` (e.g. layer ``i``) has landed. Never blocks."""
        ev = self._group_event(i)
        return self.done() if ev is None else bool(ev.done)

    def make_stream_wait_group(self, i: int, stream) -> None:
        """CuPy ``stream`` waits (on the device) for copy group ``i`` only."""
        ev = self._group_event(i)
        if ev is None:
            self.make_stream_wait(stream)
        else:
            stream.wait_event(ev)

    def wait_group_host(self, i: int) -> None:
        """Block the calling thread until copy group ``i`` has landed."""
        ev = self._group_event(i)
        if ev is None:
            self.wait_host()
        else:
            ev.synchronize()

    def _settles(self) -> list:
        """The distinct outcomes (or plain futures) :attr:`futures` settle through, found once."""
        if self._waits is None or self._waits[0] is not self.futures:
            self._waits = (self.futures, distinct_outcomes(f for _, f in self.futures))
        return self._waits[1]

    def _any_failed(self) -> bool:
        """Some future failed (the settled ones only: never blocks)."""
        return any(w.done() and w.exception() is not None for w in self._settles())

    # -- failures --------------------------------------------------------------------------
    def failed_slots(self) -> set[int]:
        """Destination slots of this job that hold no valid block (after it finished)."""
        out = set(self.failed_dst_slots)
        for k, f in self.futures if self._any_failed() else ():
            if f.done() and f.exception() is not None and k in self._dst_slot_of:
                out.add(self._dst_slot_of[k])
        return out

    def result(self) -> JobResult:
        """The result of a finished job (call after :meth:`done` is True or after a wait)."""
        if self._result is not None:
            return self._result
        failed = dict(self.failed)
        for k, f in self.futures if self._any_failed() else ():
            exc = f.exception()
            if exc is not None and k not in failed:
                failed[k] = exc
        if self.on_gpu and self.start_event is not None:
            import cupy

            seconds = cupy.cuda.get_elapsed_time(self.start_event, self.end_event) / 1e3
        else:
            seconds = (self._t1 or time.perf_counter()) - self._t0
        per_block = self.nbytes / self.blocks if self.blocks else 0
        ok_blocks = self.blocks - len(failed)
        self._result = JobResult(self.id, self.direction, self.src, self.dst, ok_blocks,
                                 int(per_block * ok_blocks), seconds, self.path, failed)
        return self._result

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<Job {self.id} {self.direction} {self.src}->{self.dst} {self.blocks} blocks {state}>"
