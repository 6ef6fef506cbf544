"""Host memory for the host tier and for staging buffers.

With CUDA: pinned (page-locked) memory, so copies to and from VRAM run at full PCIe speed and
asynchronously, and copy kernels reach it through unified addressing. It comes from one of:

- **Huge pages** (``MAP_HUGETLB``, the size the kernel's ``Hugepagesize`` names, usually 2 MiB)
  registered with CUDA (``cudaHostRegister``), where the administrator reserved them
  (``sysctl vm.nr_hugepages=N``). Pinning them is faster: on an H100 test machine, 16 GiB took
  6.2 s against 10.6 s from ``cudaHostAlloc`` (4 GiB: 0.7-1.3 s against 3.3 s). Copies run at
  the same speed from either (benchmarks/host_alloc.py; docs/performance/copies.md, "Host memory").
- CuPy's ``alloc_pinned_memory`` (``cudaHostAlloc``, 4 KiB pages) otherwise.

Without CUDA: an anonymous ``mmap`` (huge pages where asked for and reserved), page-aligned,
as O_DIRECT I/O requires.
"""

from __future__ import annotations

import errno
import mmap
from pathlib import Path

import numpy as np

from tiercache.cuda import cuda_status
from tiercache.errors import ConfigError, TierUnavailableError
from tiercache.settings import HUGE_PAGE_MODES

PAGE = 4096
MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)  # Linux; the value on x86-64 and arm64
REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
REGISTER_MAPPED = 2  # cudaHostRegisterMapped: reachable from kernels (implied with unified addressing)


class HostMemory:
    """Owns one host allocation: keep it for as long as arrays over it are used.

    Attributes:
        nbytes: bytes asked for.
        pinned: True when the memory is page-locked and registered with CUDA.
        page_bytes: the size of its pages in bytes (4096, or the huge page size).
        source: ``"cudaHostAlloc"``, ``"hugetlb+cudaHostRegister"``, ``"hugetlb"`` or ``"mmap"``.
    """

    def __init__(self, nbytes: int, pinned: bool, page_bytes: int, source: str, keep: object,
                 registered: int | None = None) -> None:
        self.nbytes = nbytes
        self.pinned = pinned
        self.page_bytes = page_bytes
        self.source = source
        self._keep = keep
        self._registered = registered

    def describe(self) -> dict:
        """``{"pinned", "page_bytes", "source"}``, JSON-ready."""
        return {"pinned": self.pinned, "page_bytes": self.page_bytes, "source": self.source}

    def __del__(self) -> None:
        if self._registered is not None:
            try:
                import cupy

                cupy.cuda.runtime.hostUnregister(self._registered)
            except Exception:  # interpreter shutdown, or CUDA already torn down
                pass
            self._registered = None


def huge_page_bytes() -> int:
    """The kernel's default huge page size in bytes (``Hugepagesize`` in /proc/meminfo); 0 where
    there is none (not Linux, or no hugetlbfs)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("Hugepagesize:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def free_huge_pages() -> int:
    """Huge pages reserved and free now (``HugePages_Free``); 0 where there are none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("HugePages_Free:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _map_huge(nbytes: int, page: int) -> mmap.mmap:
    """``nbytes`` rounded up to ``page`` of anonymous memory on huge pages, faulted in now.

    Raises:
        OSError: no huge pages (ENOMEM when too few are reserved).
    """
    size = -(-nbytes // page) * page
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB
                     | getattr(mmap, "MAP_POPULATE", 0))


def _register(arr: np.ndarray) -> int:
    """Page-lock ``arr``'s memory and register it with CUDA; returns its address."""
    import cupy

    addr = arr.ctypes.data
    cupy.cuda.runtime.hostRegister(addr, arr.nbytes, REGISTER_PORTABLE | REGISTER_MAPPED)
    return addr


def _huge(nbytes: int, pinned: bool, mode: str) -> tuple[np.ndarray, HostMemory] | None:
    """Huge-page memory, or None where ``mode`` is ``auto`` and it cannot be had.

    Raises:
        TierUnavailableError: ``mode`` is ``on`` and huge pages cannot be had.
    """
    page = huge_page_bytes()
    if mode == "auto" and (page == 0 or nbytes < page):
        return None  # no hugetlbfs, or less than one huge page: 4 KiB pages waste nothing
    need = -(-nbytes // page) if page else 0
    try:
        if page == 0:
            raise OSError(errno.ENOSYS, "this kernel has no huge pages")
        mm = _map_huge(nbytes, page)
        arr = np.frombuffer(mm, dtype=np.uint8, count=max(nbytes, 1))
        registered = _register(arr) if pinned else None
    except Exception as exc:
        if mode == "auto":
            return None
        raise TierUnavailableError(
            f"host_huge_pages = 'on', but {need} huge pages of {page // 1024} KiB for {nbytes} bytes could not "
            f"be had ({exc}); {free_huge_pages()} are free. Reserve them (sysctl vm.nr_hugepages=N) or set "
            "host_huge_pages = 'auto' or 'off'") from exc
    source = "hugetlb+cudaHostRegister" if pinned else "hugetlb"
    return arr[:nbytes], HostMemory(nbytes, pinned, page, source, mm, registered)


def alloc_host(nbytes: int, pinned: bool | None = None, huge_pages: str = "off") -> tuple[np.ndarray, HostMemory]:
    """Allocate ``nbytes`` of page-aligned host memory.

    Args:
        nbytes: size in bytes (0 allowed).
        pinned: True to require pinned memory, False for pageable, None for pinned when CUDA
            is usable.
        huge_pages: ``off`` (4 KiB pages), ``auto`` (huge pages when at least one huge page is
            asked for and enough are reserved and free, else 4 KiB pages) or ``on`` (huge pages
            or an error).

    Returns:
        ``(array, owner)``: a 1-D ``uint8`` array over the memory, and the
        :class:`HostMemory` that owns it (keep a reference for as long as the array is used).

    Raises:
        ConfigError: ``huge_pages`` is not one of ``auto``, ``on``, ``off``.
        TierUnavailableError: ``huge_pages = "on"`` and the huge pages cannot be had.
    """
    if huge_pages not in HUGE_PAGE_MODES:
        raise ConfigError(f"host_huge_pages = {huge_pages!r} is not valid; choose one of: {', '.join(HUGE_PAGE_MODES)}")
    if pinned is None:
        pinned = cuda_status().available
    size = max(int(nbytes), 1)
    if huge_pages != "off":
        got = _huge(size, pinned, huge_pages)
        if got is not None:
            return got[0][:nbytes], got[1]
    if pinned:
        import cupy

        # CuPy's pinned pool hands out pieces of larger allocations, 512-byte aligned: once
        # anything else took pinned memory from it (CuPy's own staging of an asynchronous copy,
        # for one), a piece need not start on a page, and O_DIRECT and the row reads need one
        mem = cupy.cuda.alloc_pinned_memory(size + PAGE)
        off = -mem.ptr % PAGE
        arr = np.frombuffer(mem, dtype=np.uint8, count=size + PAGE)[off:off + size]
        return arr[:nbytes], HostMemory(nbytes, True, PAGE, "cudaHostAlloc", mem)
    # MAP_POPULATE faults the pages in now, not on the first copy into each block
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(-1, size, flags=flags)
    arr = np.frombuffer(mm, dtype=np.uint8, count=size)
    return arr[:nbytes], HostMemory(nbytes, False, PAGE, "mmap", mm)


def is_pinned(arr: np.ndarray) -> bool:
    """True when ``arr`` lies in page-locked memory registered with CUDA."""
    if not cuda_status().available:
        return False
    import cupy

    try:
        attrs = cupy.cuda.runtime.pointerGetAttributes(arr.ctypes.data)
    except Exception:
        return False
    return attrs.type == cupy.cuda.runtime.memoryTypeHost
