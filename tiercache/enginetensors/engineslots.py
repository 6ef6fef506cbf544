"""Moving blocks between the engine's own device blocks and tiercache's keyed host/file blocks.

With :class:`~tiercache.enginetensors.devicepools.DevicePools` registered, the device tier is the engine's
memory and the engine allocates it: tiercache never picks a device block itself. The engine
names, per call, the keys (host/file blocks) and the device block ids they map to:

- :meth:`EngineSlots.offload_slots`: device blocks -> host blocks (-> files), asynchronous on
  the offload stream, after the work already queued on the engine's stream (so a block
  written by the engine's last kernel is offloaded complete);
- :meth:`EngineSlots.onboard_slots`: host/file blocks -> device blocks, whole or layer by layer,
  returning an :class:`~tiercache.enginetensors.layerwise.OnboardHandle` the engine's stream waits on.

A host block may hold ``k`` device blocks (``blocks_per_host_block``), so small GPU pages
spill as larger, disk-friendly units; which positions of a host block were filled is kept per
key (and in the block files' headers, so it survives a restart: :class:`~tiercache.placement.FileIndex`)
and checked on onboard.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np

from tiercache.enginetensors.devicepools import DevicePools
from tiercache.enginetensors.layerwise import OnboardHandle
from tiercache.enginetensors.prepared import PreparedOnboard
from tiercache.enginetensors.slotplan import device_slot_matrix, masks_of, plan_device_host
from tiercache.errors import SlotRangeError, TierUnavailableError
from tiercache.keys import normalize_keys
from tiercache.memory import as_cupy_stream
from tiercache.moves import BlockMover
from tiercache.placement import FileIndex, Placement


class EngineSlots:
    """The engine-managed device tier of a :class:`~tiercache.TierCache` (its
    ``offload_slots`` / ``onboard_slots`` call these methods).

    Args:
        device_pools: the engine's tensors.
        blocks_per_host_block: ``k``, device blocks per host/file block.
        tiers: the cache's tiers (``host`` and/or ``file``; ``device`` is ``device_pools``).
        placement, mover, file_index, engine, counters: the cache's parts.
        guard: returns a context manager that holds the cache's lock and raises
            :class:`~tiercache.errors.ClosedError` on a closed cache.
        tier_name: ``tier_name(tier, default)``, the cache's check of a tier name (raises
            :class:`~tiercache.errors.TierUnavailableError`).
    """

    def __init__(self, device_pools: DevicePools, blocks_per_host_block: int, tiers: dict, placement: Placement,
                 mover: BlockMover, file_index: FileIndex, engine, counters: Counter,
                 guard: Callable[[], AbstractContextManager], tier_name: Callable[[str | None, str], str]) -> None:
        self.device_pools = device_pools
        self.blocks_per_host_block = blocks_per_host_block
        self.tiers = tiers
        self.placement = placement
        self.mover = mover
        self.file_index = file_index
        self.engine = engine
        self.counters = counters
        self._guard = guard
        self._tier_name = tier_name

    def engine_stream(self, stream=None):
        """The stream the engine computes on: ``stream``, else PyTorch's current stream for
        PyTorch tensors, else CuPy's current stream."""
        if stream is not None or not self.device_pools.on_device:
            return stream
        if self.device_pools.is_torch:
            import torch

            return torch.cuda.current_stream(self.device_pools.device_id)
        return None

    def _host_sync(self, stream) -> None:
        if self.engine.gpu:
            as_cupy_stream(stream).synchronize()

    def offload_slots(self, keys, device_slots, to: str | None = None, *, num_tokens: int | None = None,
                      stream=None, wait: bool = False):
        """:meth:`TierCache.offload_slots <tiercache.TierCache.offload_slots>` (its docstring has the
        arguments, semantics and errors)."""
        with self._guard():
            ks = normalize_keys(keys)
            self.file_index.check_writable(ks)
            dev = device_slot_matrix(device_slots, len(ks), self.blocks_per_host_block, self.device_pools.num_blocks)
            dst = self._tier_name(to, "host" if "host" in self.tiers else "file")
            existing = self.placement.existing(ks)
            self.placement.require_unpinned(existing, "replace")
            room = self.placement.room("host") if "host" in self.tiers else 0
            if dst == "file" and 0 < room < len([k for k in ks if k not in self.placement.tiers["host"]]):
                # more blocks than the host tier holds: they stream through it to the files
                for start in range(0, len(ks), room):
                    self.offload_slots(ks[start:start + room], dev[start:start + room], "file", num_tokens=num_tokens,
                                       stream=stream)
                self.counters["streamed_offloads"] += 1
                return None
            if "host" not in self.tiers:
                return self._offload_to_file_direct(ks, dev, num_tokens, stream)
            ts = self.placement.tiers["host"]
            new = [k for k in ks if k not in ts]
            self.mover.room_for("host", len(new), ks)
            ts.add(new)
            host_slots = np.array([ts.slot_of[k] for k in ks], dtype=np.int64)
            groups, dev_ledger, host_ledger = plan_device_host(
                self.device_pools, self.tiers["host"].arrays, self.blocks_per_host_block, dev, host_slots,
                to_device=False, layerwise=False, num_tokens=num_tokens)
            self.engine.wait_for_stream(self.engine_stream(stream))
            try:
                job = self.engine.copy_rows("device", dev_ledger, "host", host_ledger, groups, direction="offload")
            except Exception:
                ts.remove(new)
                raise
            self.mover.drop_copies(existing, keep="host")
            self.file_index.record_positions(ks, masks_of(dev).tolist())
            ts.touch(ks)
            self.counters["offloaded_blocks"] += len(ks)
            self.counters["bytes_device_to_host"] += job.nbytes
            if dst == "file":
                job.wait_host()
                self.mover.offload(ks, "file", keep=False)
                return None
        if wait:
            job.wait()
        return job

    def _offload_to_file_direct(self, ks, dev, num_tokens, stream):
        if self.blocks_per_host_block != 1 or num_tokens is not None:
            raise TierUnavailableError("offloading straight to files (no host tier) moves whole blocks with "
                                       "blocks_per_host_block = 1; add a host tier")
        # I/O threads read VRAM outside any stream order: the engine's writes must be complete
        self._host_sync(self.engine_stream(stream))
        ts = self.placement.tiers["file"]
        new = [k for k in ks if k not in ts]
        self.mover.room_for("file", len(new), ks)
        ts.add(new)
        failed = self.mover.transfer(ks, "device", "file", dev[:, 0], [ts.slot_of[k] for k in ks])
        ts.remove([k for k in failed if k in new])
        self.mover.raise_failed(failed, "device", "file")
        ts.touch(ks)
        self.counters["offloaded_blocks"] += len(ks)
        return None




    def onboard_slots(self, keys, device_slots, *, layerwise: bool = False, num_tokens: int | None = None,
                      stream=None) -> OnboardHandle:
        """:meth:`TierCache.onboard_slots <tiercache.TierCache.onboard_slots>` (its docstring has the
        arguments, semantics and errors)."""
        with self._guard():
            ks, dev = self._checked_onboard(keys, device_slots)
            engine_stream = self.engine_stream(stream)
            room = self.placement.room("host") if "host" in self.tiers else 0
            if 0 < room < len([k for k in ks if k not in self.placement.tiers["host"]]):
                # more file-only blocks than the host tier holds: they stream through it, a
                # host tier's worth at a time, each piece complete before the next
                for start in range(0, len(ks), room):
                    self.onboard_slots(ks[start:start + room], dev[start:start + room], num_tokens=num_tokens,
                                       stream=stream).synchronize()
                self.counters["streamed_onboards"] += 1
                return OnboardHandle(None, ks, lambda: engine_stream,
                                     len(self.device_pools.layers) if layerwise else 1)
            self.placement.count_walk(self.counters, "onboard", ks, [t for t in ("host", "file") if t in self.tiers])
            if "host" not in self.tiers:
                handle = self._onboard_from_file_direct(ks, dev, num_tokens, engine_stream)
            else:
                ts = self.placement.tiers["host"]
                below = [k for k in ks if k not in ts]
                if below:
                    self.mover.copy_into(below, "host", set(ks))
                host_slots = np.array([ts.slot_of[k] for k in ks], dtype=np.int64)
                groups, dev_ledger, host_ledger = plan_device_host(
                    self.device_pools, self.tiers["host"].arrays, self.blocks_per_host_block, dev, host_slots,
                    to_device=True, layerwise=layerwise, num_tokens=num_tokens)
                self.engine.wait_for_stream(engine_stream)
                job = self.engine.copy_rows("host", host_ledger, "device", dev_ledger, groups, direction="onboard")
                ts.touch(ks)
                self.counters["bytes_host_to_device"] += job.nbytes
                handle = OnboardHandle(job, ks, lambda: self.engine_stream(stream), len(groups))
            self.counters["onboarded_blocks"] += len(ks)
        if not layerwise and self.engine.gpu and self.device_pools.on_device:
            handle.wait(engine_stream)
        return handle

    def _checked_onboard(self, keys, device_slots) -> tuple[list, np.ndarray]:
        ks = normalize_keys(keys)
        self.file_index.discover(ks)
        dev = device_slot_matrix(device_slots, len(ks), self.blocks_per_host_block, self.device_pools.num_blocks)
        self.placement.require_present(ks)
        self.file_index.check_positions(ks, masks_of(dev).tolist())
        return ks, dev

    def prepare_onboard(self, keys, device_slots, *, layerwise: bool = False, num_tokens: int | None = None,
                        stream=None, exclusive: bool = False) -> PreparedOnboard:
        """:meth:`TierCache.prepare_onboard <tiercache.TierCache.prepare_onboard>` (its docstring has
        the arguments, semantics and errors)."""
        with self._guard():
            ks, dev = self._checked_onboard(keys, device_slots)
            if "host" not in self.tiers:
                raise TierUnavailableError("prepare_onboard copies from the host tier; this cache has none "
                                           "(use onboard_slots)")
            ts = self.placement.tiers["host"]
            below = [k for k in ks if k not in ts]
            if below:
                self.mover.copy_into(below, "host", set(ks))
            self.placement.pin(ks)
            try:
                host_slots = np.array([ts.slot_of[k] for k in ks], dtype=np.int64)
                groups, dev_ledger, host_ledger = plan_device_host(
                    self.device_pools, self.tiers["host"].arrays, self.blocks_per_host_block, dev, host_slots,
                    to_device=True, layerwise=layerwise, num_tokens=num_tokens)
                rows = self.engine.prepare_rows("host", host_ledger, "device", dev_ledger, groups, direction="onboard")
            except BaseException:
                self.placement.unpin(ks)
                raise
            self.counters["prepared_onboards"] += 1
        return PreparedOnboard(self, ks, rows, len(groups), layerwise, stream, exclusive)

    def _onboard_from_file_direct(self, ks, dev, num_tokens, engine_stream) -> OnboardHandle:
        if self.blocks_per_host_block != 1 or num_tokens is not None:
            raise TierUnavailableError("onboarding straight from files (no host tier) moves whole blocks with "
                                       "blocks_per_host_block = 1; add a host tier")
        if np.unique(dev[:, 0]).size != dev.shape[0]:
            raise SlotRangeError("a device block appears twice as a destination")
        ts = self.placement.tiers["file"]
        self._host_sync(engine_stream)  # the engine may still read these blocks' old contents
        failed = self.mover.transfer(ks, "file", "device", [ts.slot_of[k] for k in ks], dev[:, 0])
        self.mover.raise_failed(failed, "file", "device")
        ts.touch(ks)
        return OnboardHandle(None, ks, lambda: engine_stream, 1)
