"""Moving blocks between the engine's own device blocks and tiercache's keyed host/file blocks.

With :class:`~tiercache.serving.devicepools.DevicePools` registered, the device tier is the engine's
memory and the engine allocates it: tiercache never picks a device block itself. The engine
names, per call, the keys (host/file blocks) and the device block ids they map to:

- :meth:`EngineSlots.offload_slots`: device blocks -> host blocks (-> files), asynchronous on
  the offload stream, after the work already queued on the engine's stream (so a block
  written by the engine's last kernel is offloaded complete);
- :meth:`EngineSlots.onboard_slots`: host/file blocks -> device blocks, whole or layer by layer,
  returning an :class:`~tiercache.serving.layerwise.OnboardHandle` the engine's stream waits on.

A host block may hold ``k`` device blocks (``blocks_per_host_block``), so small GPU pages
spill as larger, disk-friendly units; which positions of a host block were filled is kept per
key (and in the block files' headers, so it survives a restart) and checked on onboard.
"""

from __future__ import annotations

import numpy as np

from tiercache.errors import KeyNotFoundError, SlotRangeError, TierUnavailableError
from tiercache.keys import key_text, normalize_keys
from tiercache.serving.layerwise import OnboardHandle
from tiercache.serving.slotplan import device_slot_matrix, masks_of, plan_device_host


class EngineSlots:
    """Mixin of :class:`~tiercache.TierCache`: the engine-managed device tier."""

    def _engine_stream(self, stream):
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
            from tiercache.memory import as_cupy_stream

            as_cupy_stream(stream).synchronize()

    def _require_device_pools(self) -> None:
        if self.device_pools is None:
            raise TierUnavailableError("offload_slots/onboard_slots need the engine's tensors: create the cache "
                                       "with TierCache.for_engine(DevicePools(...), ...)")

    def offload_slots(self, keys, device_slots, to: str | None = None, *, num_tokens: int | None = None,
                      stream=None, wait: bool = False):
        """Copy the engine's device blocks into keyed host blocks (or files).

        Args:
            keys: ``n`` keys, one per host block.
            device_slots: the engine's block ids, ``[n]`` (one device block per key) or
                ``[n, k]`` for ``blocks_per_host_block = k``, ``-1`` for empty positions.
            to: ``"host"`` (default when there is a host tier) or ``"file"`` (through the host
                tier, whose copies are then dropped; straight from VRAM when there is none).
            num_tokens: copy only the first ``num_tokens`` tokens of each device block.
            stream: the engine's stream (CuPy, PyTorch, ``__cuda_stream__`` or handle; default:
                the current stream of the tensors' library). The copy starts after the work
                already queued there.
            wait: block until the bytes are in place (host) instead of returning at once.

        Returns:
            The :class:`~tiercache.transfer.jobs.Job` of the device -> host copy (poll it, or
            :meth:`get_finished`), or None for ``to="file"`` (done when it returns).

        A key already stored is replaced. Room is made by spilling least recently used host
        blocks to the file tier.

        Raises:
            SlotRangeError: bad ``device_slots`` shape or ids. TierUnavailableError: no
            device pools, or ``to="file"`` with ``k > 1`` and no host tier. PinnedBlockError,
            TierFullError, TransferError.
        """
        self._require_device_pools()
        with self._lock:
            self._check_open()
            ks = normalize_keys(keys)
            dev = device_slot_matrix(device_slots, len(ks), self.blocks_per_host_block, self.device_pools.num_blocks)
            dst = self._tier_name(to, "host" if "host" in self.tiers else "file")
            existing = [k for k in ks if self.placement.contains(k)]
            self._require_unpinned(existing, "replace")
            if "host" not in self.tiers:
                return self._offload_to_file_direct(ks, dev, num_tokens, stream)
            ts = self.placement.tiers["host"]
            new = [k for k in ks if k not in ts]
            self._make_room("host", len(new), set(ks))
            ts.add(new)
            host_slots = np.array([ts.slot_of[k] for k in ks], dtype=np.int64)
            groups, dev_ledger, host_ledger = plan_device_host(
                self.device_pools, self.tiers["host"].arrays, self.blocks_per_host_block, dev, host_slots,
                to_device=False, layerwise=False, num_tokens=num_tokens)
            self.engine.wait_for_stream(self._engine_stream(stream))
            try:
                job = self.engine.copy_rows("device", dev_ledger, "host", host_ledger, groups, direction="offload")
            except Exception:
                ts.remove(new)
                raise
            self._forget_other_copies(existing, keep="host")
            self._record_masks(ks, dev)
            ts.touch(ks)
            self.counters["offloaded_blocks"] += len(ks)
            self.counters["bytes_device_to_host"] += job.nbytes
            if dst == "file":
                job.wait_host()
                self.offload(ks, to="file")
                return None
        if wait:
            job.wait()
        return job

    def _offload_to_file_direct(self, ks, dev, num_tokens, stream):
        if self.blocks_per_host_block != 1 or num_tokens is not None:
            raise TierUnavailableError("offloading straight to files (no host tier) moves whole blocks with "
                                       "blocks_per_host_block = 1; add a host tier")
        # I/O threads read VRAM outside any stream order: the engine's writes must be complete
        self._host_sync(self._engine_stream(stream))
        ts = self.placement.tiers["file"]
        new = [k for k in ks if k not in ts]
        self._make_room("file", len(new), set(ks))
        ts.add(new)
        failed = self._transfer(ks, "device", "file", dev[:, 0], [ts.slot_of[k] for k in ks])
        ts.remove([k for k in failed if k in new])
        self._raise_failed(failed, "device", "file")
        ts.touch(ks)
        self.counters["offloaded_blocks"] += len(ks)
        return None

    def _forget_other_copies(self, keys, keep: str) -> None:
        """Replaced keys: drop their copies outside tier ``keep`` (files included)."""
        for t in self.placement.order:
            if t == keep:
                continue
            drop = [k for k in keys if k in self.placement.tiers[t]]
            self.placement.tiers[t].remove(drop)
            if t == "file" and drop:
                self.tiers["file"].delete(drop)

    def _record_masks(self, ks, dev: np.ndarray) -> None:
        if self.blocks_per_host_block == 1:
            return
        full = (1 << self.blocks_per_host_block) - 1
        ft = self.tiers.get("file")
        masks = masks_of(dev).tolist()
        self._forget_masks([k for k, m in zip(ks, masks) if m == full])
        for k, m in zip(ks, masks):
            if m != full:
                self._sub_masks[k] = m
                if ft is not None:
                    ft.block_meta[k] = {"positions": m}

    def _check_masks(self, ks, dev: np.ndarray) -> None:
        if self.blocks_per_host_block == 1 or not self._sub_masks:
            return
        want = masks_of(dev).tolist()
        for k, m in zip(ks, want):
            have = self._sub_masks.get(k)
            if have is not None and m & ~have:
                missing = [j for j in range(self.blocks_per_host_block) if (m & ~have) >> j & 1]
                raise KeyNotFoundError(f"key {key_text(k)}: position(s) {missing} of its host block were never "
                                       f"offloaded (it holds positions "
                                       f"{[j for j in range(self.blocks_per_host_block) if have >> j & 1]})")

    def onboard_slots(self, keys, device_slots, *, layerwise: bool = False, num_tokens: int | None = None,
                      stream=None) -> OnboardHandle:
        """Copy keyed host/file blocks into the engine's device blocks.

        Args:
            keys: ``n`` stored keys.
            device_slots: destination block ids, ``[n]`` or ``[n, k]`` (``-1``: skip that
                position); no block id twice.
            layerwise: copy layer 0 of every block, then layer 1, ...; the handle then has one
                completion per layer (:meth:`OnboardHandle.wait_layer`).
            num_tokens: copy only the first ``num_tokens`` tokens of each device block.
            stream: the engine's stream (default: the tensors' library's current stream). The
                copy starts after work already queued there (which may still read the old
                contents of these blocks). Without ``layerwise``, that stream also waits for
                the copy, on the device, before anything queued after this call; with
                ``layerwise`` the engine calls ``wait_layer`` itself.

        Keys only in the file tier are first read into the host tier (the call returns
        after those reads); with no host tier, files go straight into VRAM.

        Raises:
            KeyNotFoundError: a key not stored, or a position its host block never held.
            SlotRangeError, TierUnavailableError, TransferError (file reads that failed; the
            bad files are quarantined).
        """
        self._require_device_pools()
        with self._lock:
            self._check_open()
            ks = normalize_keys(keys)
            dev = device_slot_matrix(device_slots, len(ks), self.blocks_per_host_block, self.device_pools.num_blocks)
            self._require_present(ks)
            self._check_masks(ks, dev)
            engine_stream = self._engine_stream(stream)
            if "host" not in self.tiers:
                handle = self._onboard_from_file_direct(ks, dev, num_tokens, engine_stream)
            else:
                ts = self.placement.tiers["host"]
                below = [k for k in ks if k not in ts]
                if below:
                    self._copy_into(below, "host", set(ks))
                host_slots = np.array([ts.slot_of[k] for k in ks], dtype=np.int64)
                groups, dev_ledger, host_ledger = plan_device_host(
                    self.device_pools, self.tiers["host"].arrays, self.blocks_per_host_block, dev, host_slots,
                    to_device=True, layerwise=layerwise, num_tokens=num_tokens)
                self.engine.wait_for_stream(engine_stream)
                job = self.engine.copy_rows("host", host_ledger, "device", dev_ledger, groups, direction="onboard")
                ts.touch(ks)
                self.counters["bytes_host_to_device"] += job.nbytes
                handle = OnboardHandle(job, ks, lambda: self._engine_stream(stream), len(groups))
            self.counters["onboarded_blocks"] += len(ks)
        if not layerwise and self.engine.gpu and self.device_pools.on_device:
            handle.wait(engine_stream)
        return handle

    def _onboard_from_file_direct(self, ks, dev, num_tokens, engine_stream) -> OnboardHandle:
        if self.blocks_per_host_block != 1 or num_tokens is not None:
            raise TierUnavailableError("onboarding straight from files (no host tier) moves whole blocks with "
                                       "blocks_per_host_block = 1; add a host tier")
        if np.unique(dev[:, 0]).size != dev.shape[0]:
            raise SlotRangeError("a device block appears twice as a destination")
        ts = self.placement.tiers["file"]
        self._host_sync(engine_stream)  # the engine may still read these blocks' old contents
        failed = self._transfer(ks, "file", "device", [ts.slot_of[k] for k in ks], dev[:, 0])
        self._raise_failed(failed, "file", "device")
        ts.touch(ks)
        return OnboardHandle(None, ks, lambda: engine_stream, 1)
