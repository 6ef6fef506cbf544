"""Choosing the file I/O path: GDS, kvikio compat mode, or tiercache's POSIX path.

========  =====================================================================================
path      what moves the bytes between VRAM and a block file
========  =====================================================================================
gds       kvikio ``CuFile`` with cuFile/GPUDirect Storage: DMA between VRAM and NVMe.
compat    kvikio ``CuFile`` in kvikio's compatibility mode: kvikio's POSIX thread pool through
          its own pinned bounce buffers (only with ``io_mode = "compat"``).
posix     tiercache's own pread/pwrite worker pool, O_DIRECT, through pinned staging buffers
          (one per I/O thread, so block i+1 is on the disk while block i crosses PCIe): no
          CUDA, no GDS under ``auto`` (it measured faster than kvikio's compat mode, which
          bounces the bytes a second time), or ``io_mode = "posix"``.
========  =====================================================================================

Host-tier <-> file transfers always use the POSIX pool; the choice above decides how device
blocks reach files directly.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiercache.cuda import CudaStatus, cuda_status
from tiercache.errors import IOPathError


@dataclass(frozen=True)
class IOPath:
    """The chosen I/O path.

    Attributes:
        name: ``"gds"``, ``"compat"`` or ``"posix"``.
        reason: why this path was taken (one line, for stats and the benchmark).
        kvikio: True when device <-> file goes through kvikio.
    """

    name: str
    reason: str

    @property
    def kvikio(self) -> bool:
        return self.name in ("gds", "compat")

    @property
    def label(self) -> str:
        """Human name: ``GDS``, ``kvikio compat`` or ``POSIX``."""
        return {"gds": "GDS (cuFile)", "compat": "kvikio compat", "posix": "POSIX"}[self.name]


def _kvikio_probe() -> tuple[bool, bool, str]:
    """(kvikio importable, GDS usable, reason)."""
    try:
        import kvikio
        import kvikio.defaults
    except Exception as exc:
        return False, False, f"kvikio is not installed ({type(exc).__name__})"
    try:
        if kvikio.defaults.is_compat_mode_preferred():
            return True, False, "kvikio prefers compat mode (no cuFile/nvidia-fs, or KVIKIO_COMPAT_MODE=on)"
        import kvikio.cufile_driver

        if not kvikio.cufile_driver.get("is_gds_available"):
            return True, False, "cuFile reports GDS unavailable (no nvidia-fs driver)"
    except Exception as exc:
        return True, False, f"cuFile driver cannot be opened ({exc})"
    return True, True, "cuFile driver reports GDS available"


def select_io_path(mode: str, cuda: CudaStatus | None = None) -> IOPath:
    """Pick the I/O path for ``mode`` (``auto | gds | compat | posix``).

    ``auto`` never fails: it falls back to POSIX where CUDA or kvikio is missing (the cache
    logs that once per process). An explicit
    ``gds`` or ``compat`` that cannot run raises.

    Raises:
        IOPathError: ``gds`` or ``compat`` asked for where it cannot run.
    """
    cuda = cuda if cuda is not None else cuda_status()
    if mode == "posix":
        return IOPath("posix", "io_mode = posix (forced)")
    if not cuda.available:
        if mode in ("gds", "compat"):
            raise IOPathError(f"io_mode = {mode!r} needs CUDA, but {cuda.reason}; use io_mode = 'auto' or 'posix'")
        return IOPath("posix", f"no CUDA: {cuda.reason}")
    has_kvikio, gds, why = _kvikio_probe()
    if not has_kvikio:
        if mode in ("gds", "compat"):
            raise IOPathError(f"io_mode = {mode!r} needs kvikio: {why}; install tiercache[cu12] or [cu13]")
        return IOPath("posix", why)
    if mode == "gds":
        if not gds:
            raise IOPathError(f"io_mode = 'gds' but {why}; use io_mode = 'auto' or 'compat'")
        return IOPath("gds", why)
    if mode == "compat":
        import kvikio
        import kvikio.defaults

        kvikio.defaults.set("compat_mode", kvikio.CompatMode.ON)
        return IOPath("compat", "io_mode = compat (forced)")
    if gds:
        return IOPath("gds", why)
    # without GDS, kvikio's compat mode bounces through its own buffers after we already
    # staged the block on the host for its checksum; tiercache's O_DIRECT path from that pinned
    # staging buffer measured faster (docs/performance/files.md); io_mode = "compat" still picks kvikio
    return IOPath("posix", f"no GDS ({why}): O_DIRECT through pinned staging buffers")
