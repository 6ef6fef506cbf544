"""An onboard planned once and launched many times (:meth:`TierCache.prepare_onboard
<tiercache.TierCache.prepare_onboard>`).

An engine that brings the same blocks back into the same device blocks again and again (a
decoder whose KV cache lives in host memory and streams through a few layers of VRAM every
step; a prefix shared by many requests) pays :meth:`~tiercache.TierCache.onboard_slots`'
host-side work on every call: key checks, position checks, the row plan, the copy path's
planning and its argument uploads. A :class:`PreparedOnboard` does all of that once, pins the
blocks in the host tier so that their slots stay where the plan points, and per
:meth:`~PreparedOnboard.launch` only orders the copy after conflicting jobs (the slot ledger)
and issues the driver calls or kernel launches. Measured on an H100 (docs/performance/engines.md,
"transformers' generate"): the host cost of one layer's onboard fell from milliseconds to tens
of microseconds.
"""

from __future__ import annotations

from tiercache.enginetensors.layerwise import OnboardHandle
from tiercache.errors import ClosedError
from tiercache.memory import as_cupy_stream


class PreparedOnboard:
    """A planned onboard of ``keys`` into fixed device blocks (from
    :meth:`TierCache.prepare_onboard <tiercache.TierCache.prepare_onboard>`).

    While it is held, its keys are pinned in the host tier (reference-counted, like
    :meth:`~tiercache.TierCache.pin`): they are not spilled, evicted or replaced
    (:class:`~tiercache.errors.PinnedBlockError`). :meth:`release` (or leaving a ``with``
    block) unpins them.

    An *exclusive* plan (``prepare_onboard(..., exclusive=True)``) is for device blocks that
    are the caller's alone while it is held: its first launch is ordered by the slot ledger
    like any onboard, and every later launch *replays* it on the first one's stream, ordered
    only after the launch's ``stream`` (:meth:`TransferEngine.replay_prepared
    <tiercache.transfer.engine.TransferEngine.replay_prepared>`): no ledger lookup, no job
    bookkeeping; on the host an event record and wait, the plan's driver calls and one event
    per group. The caller's side of the contract: every other access to the destination
    device blocks (its kernels, offloads that read them, other plans that write them) is
    ordered through the stream it launches after (for a transfer job: make that stream wait
    for it, :meth:`TierCache.make_stream_wait <tiercache.TierCache.make_stream_wait>`, before
    the next launch). The host blocks need nothing: they are pinned, so nothing rewrites
    them. :meth:`release` waits on the host for the last replay if it is still running, so
    that the ledger's view holds again afterwards.

    Attributes:
        keys: the keys, one per host block, in the order given.
        num_layers: completions of each launch's handle (1 unless layer-wise).
        nbytes: bytes each launch copies.
        exclusive: whether later launches replay the first one outside the ledger.
        released: True after :meth:`release`.
    """

    def __init__(self, slots, keys: list, rows, num_layers: int, layerwise: bool, stream,
                 exclusive: bool = False) -> None:
        self._slots = slots
        self.keys = keys
        self._rows = rows
        self.num_layers = num_layers
        self.layerwise = layerwise
        self.nbytes = rows.nbytes
        self._stream = stream
        self.exclusive = exclusive
        self._replay_stream = None  # set by a clean first launch of an exclusive plan
        self._last = None  # the last replay's job
        self.released = False

    def launch(self, stream=None) -> OnboardHandle:
        """Enqueue the copy once more: it starts after the work already queued on ``stream``
        (default: the stream given to ``prepare_onboard``, else the tensors' library's current
        stream) and after conflicting transfers. Without ``layerwise`` that stream also waits
        for it, on the device; with it the engine calls the handle's ``wait_layer``. The host
        never waits.

        Returns:
            An :class:`~tiercache.enginetensors.layerwise.OnboardHandle` for this launch.

        Raises:
            ClosedError: after :meth:`release` or the cache's ``close``.
            TransferError: the driver refused a replay's launch.
        """
        s = self._slots
        given = self._stream if stream is None else stream
        with s._guard():
            if self.released:
                raise ClosedError(f"this prepared onboard of {len(self.keys)} blocks was released")
            engine_stream = s.engine_stream(given)
            # the copy waits for the work queued so far on the engine's stream (None: CuPy's current)
            after = as_cupy_stream(engine_stream) if s.engine.gpu else None
            if self._replay_stream is not None:
                job = self._last = s.engine.replay_prepared(self._rows, after, self._replay_stream)
            else:
                job = s.engine.run_prepared(self._rows, after=after)
                # replays follow a clean first launch on its stream (so after its waits for the
                # host blocks' writers); a first launch that inherited failures never replays
                if self.exclusive and job.on_gpu and not job.failed and s.engine.replayable(self._rows):
                    self._replay_stream = job.stream
            s.counters["onboarded_blocks"] += len(self.keys)
            s.counters["onboard_hits_host"] += len(self.keys)
            s.counters["prepared_onboard_launches"] += 1
            s.counters["bytes_host_to_device"] += job.nbytes
        handle = OnboardHandle(job, self.keys, lambda: s.engine_stream(given), self.num_layers)
        if not self.layerwise and s.engine.gpu and s.device_pools.on_device:
            handle.wait(engine_stream)
        return handle

    def release(self) -> None:
        """Unpin the keys and mark them recently used in the host tier (idempotent). Launches
        already enqueued complete normally."""
        if self.released:
            return
        self.released = True
        if self._last is not None:  # the ledger never saw the replays: the last one ends first
            self._last.wait_host()
            self._last = None
        try:
            with self._slots._guard():
                # recency is counted here, once: pinned keys cannot be spilled anyway
                self._slots.placement.tiers["host"].touch(self.keys)
                self._slots.placement.unpin(self.keys)
        except ClosedError:  # a closed cache holds no pins worth undoing
            pass

    def __enter__(self) -> PreparedOnboard:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<PreparedOnboard {len(self.keys)} keys, {self.nbytes} bytes per launch, {state}>"
