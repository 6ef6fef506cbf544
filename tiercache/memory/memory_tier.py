"""Memory tiers: the device tier (VRAM, CuPy) and the host tier (pinned or page-aligned DRAM).

Each tier holds, per pool, one C-contiguous ``uint8`` array of shape
``[num_slots, block_nbytes]``; slot ``s`` of pool ``p`` is row ``s``. Blocks move as bytes; the
typed view of a pool (``[num_slots, *block_shape]`` with the pool's dtype) is available where
the array library has that dtype.
"""

from __future__ import annotations

from tiercache.dtypes import numpy_dtype
from tiercache.errors import UnknownPoolError
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
        TierUnavailableError: ``huge_pages = "on"`` and too few huge pages are free.
    """
    from tiercache.cuda import cuda_status

    is_pinned = cuda_status().available if pinned is None else pinned
    arrays, owners = {}, []
    for p in pools:
        flat, owner = alloc_host(num_slots * p.block_nbytes, pinned=is_pinned, huge_pages=huge_pages)
        arrays[p.name] = flat.reshape(num_slots, p.block_nbytes)
        owners.append(owner)
    return MemoryTier("host", num_slots, pools, arrays, on_device=False, pinned=is_pinned, owners=owners)


def make_device_tier(num_slots: int, pools: tuple[PoolSpec, ...], device_id: int = 0) -> MemoryTier:
    """A device tier of ``num_slots`` slots per pool, allocated with CuPy on ``device_id``.

    Raises:
        TierUnavailableError: no usable CUDA device.
    """
    from tiercache.cuda import require_cupy

    cupy = require_cupy()
    with cupy.cuda.Device(device_id):
        arrays = {p.name: cupy.empty((num_slots, p.block_nbytes), dtype=cupy.uint8) for p in pools}
    return MemoryTier("device", num_slots, pools, arrays, on_device=True, pinned=False)
