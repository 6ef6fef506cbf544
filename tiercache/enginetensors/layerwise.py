"""The handle of an onboard into the engine's device blocks, with one completion per layer.

Layer-wise onboarding copies layer 0 of every block first, then layer 1, and so on, on one
stream, recording a CUDA event after each layer. The engine makes its compute stream wait for
layer ``i`` just before attention on layer ``i``, so compute on the first layers overlaps the
copies of the later ones (the pattern of vLLM's ``wait_for_layer_load`` and LMCache's
layer-wise retrieval).
"""

from __future__ import annotations

from tiercache.memory import as_cupy_stream
from tiercache.transfer import Job, JobResult


class OnboardHandle:
    """An onboard in flight (returned by :meth:`TierCache.onboard_slots`).

    Attributes:
        num_layers: completions it exposes (1 unless the onboard is layer-wise).
        keys: the keys onboarded.
        job: the underlying :class:`~tiercache.transfer.jobs.Job` (None when nothing had to move).
    """

    def __init__(self, job: Job | None, keys: list, default_stream, num_layers: int) -> None:
        self.job = job
        self.keys = keys
        self.num_layers = num_layers
        self._default_stream = default_stream

    def _stream(self, stream):
        return as_cupy_stream(self._default_stream() if stream is None else stream)

    def _check(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside [0, {self.num_layers})")

    def wait_layer(self, layer: int, stream=None) -> None:
        """``stream`` (default: the engine's current stream) waits, on the device, for layer
        ``layer``; the host does not block.

        Raises:
            IndexError: ``layer`` outside ``[0, num_layers)``.
        """
        self._check(layer)
        if self.job is None:
            return
        if not self.job.on_gpu:  # host-memory pools: the copy runs on the CPU
            self.job.wait_host()
            return
        self.job.make_stream_wait_group(layer, self._stream(stream))

    def wait(self, stream=None) -> None:
        """``stream`` waits, on the device, for every layer."""
        if self.job is None:
            return
        if not self.job.on_gpu:
            self.job.wait_host()
            return
        self.job.make_stream_wait(self._stream(stream))

    def layer_done(self, layer: int) -> bool:
        """True once layer ``layer`` has landed. Never blocks."""
        self._check(layer)
        return self.job is None or self.job.group_done(layer)

    def synchronize_layer(self, layer: int) -> None:
        """Block the calling thread until layer ``layer`` has landed."""
        self._check(layer)
        if self.job is not None:
            self.job.wait_group_host(layer)

    def done(self) -> bool:
        """True once every layer has landed. Never blocks."""
        return self.job is None or self.job.done()

    def synchronize(self) -> JobResult | None:
        """Block until every layer has landed; returns the job's result.

        Raises:
            TransferError: blocks failed (their source copy was invalid).
        """
        return None if self.job is None else self.job.wait()

    def __repr__(self) -> str:
        return (
            f"<OnboardHandle {len(self.keys)} keys, {self.num_layers} layers, {'done' if self.done() else 'pending'}>"
        )
