"""Detecting a usable CUDA device without crashing where there is none.

CuPy and kvikio import fine on a machine without a GPU (a login node) but fail at the first
real call; :func:`cuda_status` asks the runtime for a device count once and caches the answer,
so every module can choose its path up front.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from types import ModuleType

log = logging.getLogger("tiercache")

#: set to "1" to hide the GPU from tiercache (tests of the login-node path on a GPU machine)
ENV_DISABLE = "TIERCACHE_DISABLE_CUDA"


@dataclass(frozen=True)
class CudaStatus:
    """Whether CUDA is usable here, and why not when it is not.

    Attributes:
        available: a device is visible and CuPy can talk to it.
        reason: a one-line explanation (device name when available).
        cupy_installed: CuPy imports (the GPU packages are installed).
        device_count: visible CUDA devices (0 when unavailable).
    """

    available: bool
    reason: str
    cupy_installed: bool
    device_count: int = 0


@functools.cache
def cuda_status() -> CudaStatus:
    """Probe CUDA once per process (cached). Never raises."""
    if os.environ.get(ENV_DISABLE, "") not in ("", "0"):
        return CudaStatus(False, f"disabled by {ENV_DISABLE}", _cupy_importable())
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken install
        return CudaStatus(False, f"cupy is not installed ({type(exc).__name__}: {exc})", False)
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver: cudaErrorInsufficientDriver / NoDevice
        return CudaStatus(False, f"no usable CUDA driver or device ({exc})", True)
    if count <= 0:
        return CudaStatus(False, "no CUDA device visible", True)
    try:
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    except Exception as exc:
        return CudaStatus(False, f"CUDA device 0 cannot be queried ({exc})", True)
    return CudaStatus(True, f"{count} device(s), device 0: {name}", True, count)


def _cupy_importable() -> bool:
    """Whether CuPy is installed (without importing it, which takes a while)."""
    import importlib.util

    return importlib.util.find_spec("cupy") is not None


def require_cupy() -> ModuleType:
    """CuPy, where :func:`cuda_status` says CUDA is usable.

    Raises:
        TierUnavailableError: no usable CUDA device.
    """
    status = cuda_status()
    if not status.available:
        from tiercache.errors import TierUnavailableError

        raise TierUnavailableError(f"the device tier needs CUDA: {status.reason}")
    import cupy

    return cupy


def is_device_array(obj: object) -> bool:
    """True for objects that live in GPU memory (``__cuda_array_interface__``)."""
    return hasattr(obj, "__cuda_array_interface__")
