"""Memory tiers: the device tier (VRAM, CuPy) and the host tier (pinned or page-aligned DRAM).

Each tier holds, per pool, one C-contiguous ``uint8`` array of shape
``[num_slots, block_nbytes]``; slot ``s`` of pool ``p`` is row ``s``. Blocks move as bytes; the
typed view of a pool (``[num_slots, *block_shape]`` with the pool's dtype) is available where
the array library has that dtype.
"""

from __future__ import annotations

import os

from tiercache.dtypes import numpy_dtype
from tiercache.errors import TierUnavailableError, UnknownPoolError
from tiercache.geometry import PoolSpec
from tiercache.memory.hostmem import alloc_host


class MemoryTier:
    """Slots of block memory in one place (``device`` or ``host``).

    Attributes:
        name: ``"device"`` or ``"host"``.
        num_slots: slots per pool.
        pools: the pools, by name.
        arrays: per pool, the ``uint8`` array ``[num_slots, block_nbytes]`` (CuPy for the
            device tier, NumPy for the host tier).
        on_device: True for VRAM.
        pinned: True when host memory is page-locked.
    """

    def __init__(self, name: str, num_slots: int, pools: tuple[PoolSpec, ...], arrays: dict,
                 on_device: bool, pinned: bool, owners: list | None = None) -> None:
        self.name = name
        self.num_slots = num_slots
        self.pools = {p.name: p for p in pools}
        self.arrays = arrays
        self.on_device = on_device
        self.pinned = pinned
        self._owners = owners or []

    def memory(self) -> list[dict]:
        """Per allocation of a host tier, where its memory came from (pinned, page size,
        source; see :class:`~tiercache.memory.hostmem.HostMemory`); empty for a device tier."""
        return [o.describe() for o in self._owners if hasattr(o, "describe")]

    def array(self, pool: str):
        """The raw ``uint8`` array ``[num_slots, block_nbytes]`` of ``pool``.

        Raises:
            UnknownPoolError: no such pool.
        """
        try:
            return self.arrays[pool]
        except KeyError:
            raise UnknownPoolError(
                f"unknown pool {pool!r}; this cache has pools: {', '.join(self.pools)}"
            ) from None

    def typed(self, pool: str):
        """``[num_slots, *block_shape]`` view with the pool's dtype where the array library
        supports it, else the raw ``uint8`` array."""
        spec = self.pools.get(pool) or self.array(pool)
        raw = self.array(pool)
        if self.on_device:
            import cupy

            try:
                dt = cupy.dtype(spec.dtype)
            except TypeError:
                return raw
        else:
            dt = numpy_dtype(spec.dtype)
            if dt is None:
                return raw
        return raw.view(dt).reshape((self.num_slots, *spec.block_shape))

    @property
    def nbytes(self) -> int:
        """Bytes of block memory this tier holds (all pools, all slots)."""
        return sum(p.block_nbytes for p in self.pools.values()) * self.num_slots


def make_host_tier(num_slots: int, pools: tuple[PoolSpec, ...], pinned: bool | None = None,
                   huge_pages: str = "off") -> MemoryTier:
    """A host tier of ``num_slots`` slots per pool, one allocation per pool.

    Memory is pinned when CUDA is usable (or ``pinned=True``), page-aligned in every case, on
    huge pages as ``huge_pages`` asks (``auto``, ``on``, ``off``; see
    :func:`~tiercache.memory.hostmem.alloc_host`).

    Raises:
        TierUnavailableError: ``huge_pages = "on"`` and too few huge pages are free, or the
            memory cannot be had (naming the bytes needed and the machine's memory).
    """
    from tiercache.cuda import cuda_status

    is_pinned = cuda_status().available if pinned is None else pinned
    need, have = sum(num_slots * p.block_nbytes for p in pools), total_host_memory()
    if have and need > have:
        raise TierUnavailableError(
            f"cannot allocate the host tier: host_slots = {num_slots} of {sum(p.block_nbytes for p in pools)} bytes "
            f"need {_gib(need)}, and this machine has {_gib(have)} of memory: lower host_slots")
    arrays, owners = {}, []
    for p in pools:
        nbytes = num_slots * p.block_nbytes
        try:
            flat, owner = alloc_host(nbytes, pinned=is_pinned, huge_pages=huge_pages)
        except TierUnavailableError:
            raise
        except (MemoryError, OSError, OverflowError, ValueError) as exc:
            raise TierUnavailableError(
                f"cannot allocate the host tier: pool {p.name!r} needs {num_slots} slots x {p.block_nbytes} bytes = "
                f"{_gib(nbytes)} of {'pinned ' if is_pinned else ''}host memory ({_gib(total_host_memory())} in this "
                f"machine): lower host_slots ({type(exc).__name__}: {exc})") from None
        except Exception as exc:  # CuPy's allocation errors
            if "memory" not in str(exc).lower() and "alloc" not in type(exc).__name__.lower():
                raise
            raise TierUnavailableError(
                f"cannot allocate the host tier: pool {p.name!r} needs {_gib(nbytes)} of pinned host memory "
                f"({_gib(total_host_memory())} in this machine): lower host_slots ({exc})") from None
        arrays[p.name] = flat.reshape(num_slots, p.block_nbytes)
        owners.append(owner)
    return MemoryTier("host", num_slots, pools, arrays, on_device=False, pinned=is_pinned, owners=owners)


def make_device_tier(num_slots: int, pools: tuple[PoolSpec, ...], device_id: int = 0) -> MemoryTier:
    """A device tier of ``num_slots`` slots per pool, allocated with CuPy on ``device_id``.

    Raises:
        TierUnavailableError: no usable CUDA device, or too little device memory (naming the
            bytes needed and free).
    """
    from tiercache.cuda import require_cupy

    cupy = require_cupy()
    with cupy.cuda.Device(device_id):
        try:
            arrays = {p.name: cupy.empty((num_slots, p.block_nbytes), dtype=cupy.uint8) for p in pools}
        except cupy.cuda.memory.OutOfMemoryError:
            need = sum(num_slots * p.block_nbytes for p in pools)
            free, total = cupy.cuda.runtime.memGetInfo()
            raise TierUnavailableError(
                f"cannot allocate the device tier: {num_slots} slots need {_gib(need)} of device memory, "
                f"{_gib(free)} of {_gib(total)} free on device {device_id}: lower device_slots") from None
    return MemoryTier("device", num_slots, pools, arrays, on_device=True, pinned=False)


def total_host_memory() -> int:
    """Bytes of memory in this machine (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"
