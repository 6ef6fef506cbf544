"""CUDA stream and event pools, and adapting the caller's streams (CuPy, PyTorch, raw handles)."""

from __future__ import annotations

import itertools


def as_cupy_stream(stream=None):
    """A CuPy stream object for ``stream``: a CuPy ``Stream``/``ExternalStream``, a PyTorch
    ``torch.cuda.Stream`` (its ``cuda_stream`` handle), an object with ``__cuda_stream__``
    (the CUDA stream protocol), an int ``cudaStream_t`` handle, or None for CuPy's current
    stream.

    Raises:
        TypeError: anything else.
    """
    import cupy

    if stream is None:
        return cupy.cuda.get_current_stream()
    if isinstance(stream, (cupy.cuda.Stream, cupy.cuda.ExternalStream)):
        return stream
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        return _external(int(stream.cuda_stream))
    if hasattr(stream, "__cuda_stream__"):
        _version, handle = stream.__cuda_stream__()
        return _external(int(handle))
    if isinstance(stream, int):
        return _external(stream)
    raise TypeError(
        f"stream of type {type(stream).__name__}: pass a CuPy stream, a torch.cuda.Stream, an "
        "object with __cuda_stream__, an int cudaStream_t, or None"
    )


class _Handle:
    """A raw ``cudaStream_t`` exposed through the CUDA stream protocol."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


_WRAPPED: dict[tuple[int, int], object] = {}  # (handle, device) -> CuPy stream: wrapping costs microseconds


def _external(handle: int):
    import cupy

    key = (handle, cupy.cuda.runtime.getDevice())
    st = _WRAPPED.get(key)
    if st is not None:
        return st
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:  # CuPy 14+: ExternalStream is deprecated
        st = from_external(_Handle(handle))
    else:
        st = cupy.cuda.ExternalStream(handle)
    if len(_WRAPPED) >= 256:  # a handle names one CUDA stream while it lives; forget old ones
        _WRAPPED.clear()
    _WRAPPED[key] = st
    return st


def copy_stream(priority: str = "high"):
    """A non-blocking stream; ``high`` priority lets copy kernels take SMs ahead of compute
    kernels when both wait for them (the copy engines are not affected)."""
    import cupy

    if priority == "high":
        # CUDA clamps a priority outside the device's range to its highest priority
        return cupy.cuda.Stream(non_blocking=True, priority=-1000)
    return cupy.cuda.Stream(non_blocking=True)


class StreamPool:
    """``per_direction`` non-blocking streams for each direction, handed out round-robin, so
    independent jobs of one direction may overlap (their conflicts are ordered by events, not by
    stream order)."""

    def __init__(self, device_id: int, per_direction: int = 2, priority: str = "high") -> None:
        import cupy

        self.device_id = device_id
        self._streams: dict[str, list] = {}
        self._cycle: dict[str, itertools.cycle] = {}
        with cupy.cuda.Device(device_id):
            for d in ("offload", "onboard", "copy"):
                self._streams[d] = [copy_stream(priority) for _ in range(per_direction)]
                self._cycle[d] = itertools.cycle(self._streams[d])

    def next(self, direction: str):
        """The next stream for ``direction`` (``offload``, ``onboard`` or ``copy``)."""
        return next(self._cycle[direction if direction in self._cycle else "copy"])

    def all(self) -> list:
        return [s for ss in self._streams.values() for s in ss]


class EventPool:
    """Reusable timing events (creating one per copy costs more than the copy for small ones)."""

    def __init__(self) -> None:
        self._free: list = []

    def get(self):
        import cupy

        return self._free.pop() if self._free else cupy.cuda.Event()

    def put(self, *events) -> None:
        self._free.extend(e for e in events if e is not None)
