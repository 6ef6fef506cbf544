"""Moving keyed blocks between tiers: copies through the transfer engine, and room made by
spilling least recently used blocks down.

:class:`BlockMover` is the part of :class:`~tiercache.TierCache` that turns placement
decisions (:class:`~tiercache.placement.Placement`) into copies. It keeps the rules
docs/architecture.md states: a block leaves a tier only after its copy below is complete; a
failed copy registers nothing at the destination and leaves the source registered; a block file
that fails to verify is quarantined and dropped from the file tier.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np

from tiercache.errors import CorruptBlockError, KeyNotFoundError, SpillError, TornReadError, TransferError
from tiercache.files import FileTier
from tiercache.geometry import PoolSpec
from tiercache.keys import Key, format_keys
from tiercache.placement import Placement
from tiercache.transfer import TransferEngine


class BlockMover:
    """Copies blocks between a cache's tiers and makes room in them.

    Not thread-safe on its own: the owning cache calls it under its lock.

    Args:
        tiers: tier name -> its memory (:class:`~tiercache.memory.MemoryTier`) or
            :class:`~tiercache.files.FileTier`.
        placement: where every key sits.
        engine: the transfer engine over ``tiers``.
        pools: the cache's pools (a block is one slot in each).
        counters: the cache's counters; this class adds ``bytes_{src}_to_{dst}``,
            ``failed_transfers``, ``corrupt_blocks``, ``spilled_blocks``, ``evicted_blocks``
            and ``offloaded_blocks``.
    """

    def __init__(self, tiers: dict, placement: Placement, engine: TransferEngine, pools: tuple[PoolSpec, ...],
                 counters: Counter, after_file_write: Callable[[set], None] | None = None,
                 after_file_read: Callable[[list], None] | None = None) -> None:
        self.tiers = tiers
        self.placement = placement
        self.engine = engine
        self.pools = {p.name: p for p in pools}
        self.counters = counters
        #: called after blocks were written to the file tier (shared roots: the root-wide sweep)
        self.after_file_write: Callable[[set], None] = after_file_write or (lambda keep: None)
        #: called with the keys read from the file tier (shared roots: refresh their use time)
        self.after_file_read: Callable[[list], None] = after_file_read or (lambda keys: None)

    def transfer(self, keys: list[Key], src: str, dst: str, src_rows, dst_rows,
                 src_arrays: dict | None = None, dst_arrays: dict | None = None) -> dict[Key, BaseException]:
        """Copy ``keys`` from rows ``src_rows`` of tier ``src`` to rows ``dst_rows`` of ``dst``
        and wait. ``*_arrays`` are caller arrays ``{pool: array}`` (tier ``"caller"``). Reads
        from files that fail to verify quarantine the file and drop the key from the file tier.

        Returns:
            The keys that failed, with their errors (empty when all landed).
        """
        pools = list(src_arrays or dst_arrays or self.pools)
        job = self.engine.copy(src, src_rows, dst, dst_rows, keys=keys, pools=pools,
                               src_arrays=src_arrays, dst_arrays=dst_arrays)
        job.wait_host()
        res = job.result()
        failed = {(keys[k] if isinstance(k, int) and "file" not in (src, dst) else k): e for k, e in res.failed.items()}
        if src == "file":
            self._quarantine_bad_reads(failed)
            self.after_file_read([k for k in keys if k not in failed] if failed else keys)
        block = sum(self.pools[p].block_nbytes for p in pools)
        self.counters[f"bytes_{src}_to_{dst}"] += (len(keys) - len(failed)) * block
        self.counters["failed_transfers"] += len(failed)
        return failed

    def _quarantine_bad_reads(self, failed: dict[Key, BaseException]) -> None:
        ft: FileTier = self.tiers["file"]
        for k, exc in failed.items():
            if isinstance(exc, FileNotFoundError) and ft.shared:  # evicted by another process: gone, not corrupt
                self.placement.tiers["file"].remove([k])
                self.counters["vanished_blocks"] += 1
            elif isinstance(exc, CorruptBlockError) and "checksum mismatch" in str(exc) and ft.confirm_bad(k) is None:
                # the file verifies on a read of its own: the destination changed while it was
                # read (a caller's buffer written during the call), not the file: keep the block
                failed[k] = TornReadError(f"block {k!r}: its destination changed while it was read ({exc}); its "
                                          "file verifies and is kept", [k])
                self.counters["torn_reads"] += 1
            elif isinstance(exc, (CorruptBlockError, FileNotFoundError)):
                self.counters["quarantined_files"] += ft.quarantine_block(k, str(exc))
                self.placement.tiers["file"].remove([k])
                self.counters["corrupt_blocks"] += 1

    @staticmethod
    def raise_failed(failed: dict[Key, BaseException], src: str, dst: str) -> None:
        """Raise :class:`TransferError` naming the failed keys (``failed_keys``), chained to
        the first error; nothing when ``failed`` is empty."""
        if failed:
            first = next(iter(failed.values()))
            raise TransferError(
                f"{len(failed)} block(s) failed {src} -> {dst}: {format_keys(list(failed))}: "
                f"{type(first).__name__}: {first}", list(failed)
            ) from first

    def make_room(self, tier: str, count: int, protect: set[Key]) -> None:
        """Free ``count`` slots in ``tier``: its least recently used blocks that are neither
        pinned nor in ``protect`` are dropped when a copy below exists, copied down first
        otherwise (recursively making room there), or evicted from the bottom tier.

        Raises:
            TierFullError: too few blocks may leave. SpillError: a spill failed (the victims
            stay where they were; its ``failed_keys`` is empty: callers report their own keys
            through :meth:`room_for`).
        """
        ts = self.placement.tiers[tier]
        need = count - ts.free_count
        if need <= 0:
            return
        victims = self.placement.victims(tier, need, protect)
        spill = [k for k in victims if not self.placement.has_copy_below(k, tier)]
        below = self.placement.below(tier)
        if spill and below:
            try:
                self.copy_into(spill, below[0], protect | set(victims))
            except TransferError as exc:
                raise SpillError(f"no room in the {tier} tier: spilling its least recently used block(s) "
                                 f"{format_keys(spill)} to {below[0]} failed (they stay in {tier}): {exc}",
                                 victims=spill) from exc
            self.counters["spilled_blocks"] += len(spill)
            self.counters[f"spilled_blocks_{tier}"] += len(spill)
        elif spill:  # bottom tier: the block leaves the cache (a shared root: this process's index)
            if tier == "file" and self.tiers["file"].shared:
                self.tiers["file"].evict(spill)  # deletes nothing: the root's sweeps do
                self.counters["forgotten_blocks"] += len(spill)
            else:
                self.counters["evicted_blocks"] += len(spill)
                if tier == "file":
                    self.tiers["file"].evict(spill)
        ts.remove(victims)

    def room_for(self, tier: str, count: int, keys: list[Key], protect: set[Key] | None = None) -> None:
        """:meth:`make_room` for a call that stores ``keys`` (``count`` of them new to ``tier``):
        a failed spill is a :class:`SpillError` whose ``failed_keys`` are ``keys`` (none of them
        was stored), not the victims (which stay where they were)."""
        try:
            self.make_room(tier, count, set(keys) if protect is None else protect)
        except SpillError as exc:
            keys = list(keys)
            raise SpillError(f"{len(keys)} block(s) not stored: {format_keys(keys)}: {exc.reason}", keys, exc.victims,
                             exc.reason) from exc

    def copy_into(self, keys: list[Key], dst: str, protect: set[Key]) -> np.ndarray:
        """Copy ``keys`` into tier ``dst`` from the nearest tier holding each (keys already in
        ``dst`` stay as they are) and mark them recently used.

        Returns:
            Their slots in ``dst`` (``int64``, in key order).

        Raises:
            TierFullError. TransferError: after the other keys completed; the failed keys are
            not registered in ``dst`` and stay registered where they were. SpillError: no room
            could be made in ``dst``; ``failed_keys`` lists the keys not already there.
        """
        ts = self.placement.tiers[dst]
        new = [k for k, s in zip(keys, ts.find_many(keys).tolist()) if s < 0]
        # each key's nearest source: the closest tier above or below dst holding it (a tier above
        # first at equal distance), with its slot there; one batched lookup per tier of the keys
        # not found yet. Found before room is made: protected, the keys' own copies do not move
        # meanwhile
        order = self.placement.order
        near = sorted((t for t in order if t != dst), key=lambda t: abs(order.index(t) - order.index(dst)))
        groups: dict[str, tuple[list[Key], list[int]]] = {}
        left = new
        for t in near:
            if not left:
                break
            slots = self.placement.tiers[t].find_many(left).tolist()
            found = [(k, s) for k, s in zip(left, slots) if s >= 0]
            if found:
                groups[t] = ([k for k, _ in found], [s for _, s in found])
                left = [k for k, s in zip(left, slots) if s < 0]
        if left:
            raise KeyNotFoundError(f"block {format_keys(left[:1])} is in no tier to copy into {dst} from")
        self.room_for(dst, len(new), new, protect | set(keys))
        dst_slots = dict(zip(new, ts.add(new)))
        failures: dict[Key, BaseException] = {}
        for src, (ks, src_slots) in groups.items():
            src_ts = self.placement.tiers[src]
            try:
                failed = self.transfer(ks, src, dst, src_slots, [dst_slots[k] for k in ks])
            except Exception as exc:  # the whole batch failed (e.g. a CUDA error)
                failed = {k: exc for k in ks}
            failures.update(failed)
            src_ts.touch(ks)
        if failures:
            ts.remove(list(failures))
        if dst == "file" and new:
            self.after_file_write(protect | set(keys))
        if failures:
            self.raise_failed(failures, "/".join(groups), dst)
        ts.touch(keys)
        return ts.find_many(keys)

    def offload(self, keys: list[Key], dst: str, keep: bool) -> np.ndarray:
        """:meth:`copy_into` ``dst``, counted as an offload; without ``keep`` the copies above
        ``dst`` are then dropped. Returns the slots in ``dst``."""
        slots = self.copy_into(keys, dst, set(keys))
        self.counters["offloaded_blocks"] += len(keys)
        if not keep:
            for t in self.placement.above(dst):
                self.placement.tiers[t].remove(keys)
        return slots

    def drop_copies(self, keys: list[Key], keep: str) -> None:
        """Drop ``keys`` from every tier but ``keep`` (their files too): the copies a
        replaced key leaves behind once its new bytes are in ``keep``. On a shared root the
        file copy stays: a content key names the same bytes whoever wrote them."""
        shared = "file" in self.tiers and self.tiers["file"].shared
        for t in self.placement.order:
            if t == keep or (t == "file" and shared):
                continue
            drop = [k for k, s in zip(keys, self.placement.tiers[t].find_many(keys).tolist()) if s >= 0]
            self.placement.tiers[t].remove(drop)
            if t == "file" and drop:
                self.tiers["file"].delete(drop)
