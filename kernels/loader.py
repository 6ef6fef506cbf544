"""Loading tiercache's CUDA kernels (``kernels/*.cu``) with CuPy ``RawModule``.

Sources are compiled once per process and device with NVRTC (CuPy caches the binary on disk
as well), so the first launch pays the compile and later ones do not.
"""

from __future__ import annotations

import functools
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
SOURCES = ("copy_blocks.cu", "copy_bulk.cu", "kv_append.cu", "xxh3.cu")


def kernel_sources() -> list[Path]:
    """Every CUDA source shipped with tiercache (CI compiles each with nvcc)."""
    return sorted(KERNEL_DIR.glob("*.cu"))


@functools.cache
def _module(name: str, device_id: int):
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.RawModule(code=(KERNEL_DIR / name).read_text(), options=("-std=c++17",))


def get_kernel(source: str, name: str, device_id: int = 0):
    """The ``RawKernel`` ``name`` from ``kernels/<source>`` on ``device_id`` (compiled once).

    Raises:
        cupy.cuda.compiler.CompileException: the source does not compile.
    """
    return _module(source, device_id).get_function(name)
