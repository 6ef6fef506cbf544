"""What the placement knows of the file tier beyond slots: the index rebuilt from a root's
files when a cache opens, and which positions of partial host blocks hold device blocks.

A host block may hold ``k`` device blocks (``blocks_per_host_block``); when an engine offloads
fewer than ``k`` of them, the positions it filled are kept here and in the block files' headers
(``extra.positions``), so that an onboard of a position never written is refused, after a
restart too.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from tiercache.errors import InvalidKeyError, KeyNotFoundError
from tiercache.files import FileTier
from tiercache.keys import Key, key_from_text, key_text
from tiercache.placement.policy import Placement
from tiercache.placement.rootindex import RootIndex
from tiercache.placement.sharedbook import NegativeCache, TouchThrottle
from tiercache.settings import SharingSettings


class FileIndex(RootIndex):
    """The file tier's index (:class:`~tiercache.placement.rootindex.RootIndex`: the saved
    index and its reconciliation) and the positions of partial host blocks.

    Args:
        file_tier: the cache's file tier, or None (positions are then kept in memory only).
        placement: where every key sits.
        blocks_per_host_block: ``k``, device blocks per host block (positions are bits
            ``0 .. k-1``).
        counters: the cache's counters (``evicted_blocks``, ``quarantined_files``).
        sharing: the ``[sharing]`` settings (shared roots: ``negative_ttl_s``, ``sweep_interval_s``).
        checkpoint_interval_s: seconds between saves of the root's index.
        make_room: frees file-tier slots for blocks found on disk (the mover's ``make_room``).
    """

    def __init__(self, file_tier: FileTier | None, placement: Placement, blocks_per_host_block: int,
                 counters: Counter, sharing: SharingSettings = SharingSettings(),
                 checkpoint_interval_s: float = 60.0, make_room: Callable[[int, set], None] | None = None) -> None:
        super().__init__(file_tier, None, counters, contains=placement.contains, make_room=make_room,
                         checkpoint_interval_s=checkpoint_interval_s)
        self.placement = placement
        self.k = blocks_per_host_block
        #: shared mode: key -> time.monotonic() until which it is known to be in no file
        self._absent = NegativeCache(sharing.negative_ttl_s)
        self.negative_ttl_s = sharing.negative_ttl_s
        self.sweep_interval_s = sharing.sweep_interval_s
        self._last_sweep = 0.0
        #: shared mode: key -> time.monotonic() of this process's last refresh of its use time
        self._touched: TouchThrottle | None = None  # made at the first read (min_age_s is the file tier's)
        #: shared mode: complete blocks in the root at the last sweep (None before one)
        self.on_disk_blocks: int | None = None
        #: key -> bit mask of the positions its host block holds, for partial host blocks only
        self.positions: dict[Key, int] = {}

    @property
    def slots(self):
        """The file tier's slots (the placement's)."""
        return self.placement.tiers["file"]

    # -- the positions saved with the index and in block headers ------------------------------
    def loaded_meta(self, saved: dict[str, int]) -> None:
        if self.k > 1:
            for text, mask in saved.items():
                k = key_from_text(text)
                if k in self.slots:
                    self._set_position(k, mask)

    def found_meta(self, key: Key, meta: dict) -> None:
        if "positions" in meta and self.k > 1:
            self._set_position(key, int(meta["positions"]))

    def meta_to_save(self) -> dict[str, int]:
        ts = self.slots
        return {key_text(k): m for k, m in self.positions.items() if k in ts}

    def forgotten(self, key: Key) -> None:
        self.forget_positions([key])

    def _set_position(self, key: Key, mask: int) -> None:
        self.positions[key] = mask
        if self.file_tier is not None:
            self.file_tier.block_meta[key] = {"positions": mask}

    # -- shared roots ----------------------------------------------------------------------
    def check_writable(self, keys: list[Key]) -> None:
        """Shared mode takes content keys only.

        Raises:
            InvalidKeyError: an integer key in shared mode (named).
        """
        if self.shared:
            ints = [k for k in keys if isinstance(k, int)]
            if ints:
                raise InvalidKeyError(
                    f"key {key_text(ints[0])} is an integer: a shared root takes content keys (bytes, e.g. a prefix "
                    "hash), which name the same bytes in every process; integer keys name one process's slots")

    def discover(self, keys: list[Key]) -> list[Key]:
        """Shared mode: register in the file tier those of ``keys`` that no tier holds but
        whose files another process has published since (a miss is not looked for again for
        ``negative_ttl_s``), making room with :attr:`make_room`. Returns the keys found."""
        if not self.shared:
            return []
        now = time.monotonic()
        self._absent.ttl_s = self.negative_ttl_s
        todo = [k for k in dict.fromkeys(keys) if isinstance(k, bytes) and not self.placement.contains(k)
                and not self._absent.absent(k, now)]
        if not todo:
            return []
        found = self.file_tier.probe(todo)
        self._absent.mark(set(todo) - set(found), now)
        if found:
            self.make_room(len(found), set(keys))
            self.slots.add(found)
            self.counters["discovered_blocks"] += len(found)
            if self.k > 1:
                self._discover_positions(found)
        return found

    def _discover_positions(self, keys: list[Key]) -> None:
        """The positions of discovered partial host blocks, from their files' headers (a
        block whose header says nothing holds all ``k``)."""
        for k in keys:
            mask = self.file_tier.header_extra(k).get("positions")
            if mask is not None:
                self._set_position(k, int(mask))

    def after_read(self, keys: list[Key]) -> None:
        """Shared mode, after ``keys`` were read from files: refresh their use time in the
        root (:meth:`FileTier.touch <tiercache.files.FileTier.touch>`), so that the root's
        sweeps delete the least recently used blocks, not the oldest published; at most once
        per key every ``max(1, min_age_s)`` seconds per process."""
        if not self.shared or not keys:
            return
        if self._touched is None:
            self._touched = TouchThrottle(max(1.0, self.file_tier.min_age_s))
        todo = self._touched.due(keys)
        if todo:
            self.file_tier.touch(todo)

    def after_write(self, keep: set = frozenset()) -> None:
        """Shared mode, after file writes: at most every ``sweep_interval_s`` (longer where a
        sweep takes more than a tenth of that: :meth:`FileTier.sweep_gap`), hold the root
        as a whole to the file tier's capacity (:meth:`FileTier.sweep
        <tiercache.files.FileTier.sweep>`; neither pinned keys nor ``keep`` are deleted) and
        forget the blocks deleted."""
        if not self.shared or time.monotonic() - self._last_sweep < self.file_tier.sweep_gap(self.sweep_interval_s):
            return
        gone, self.on_disk_blocks = self.file_tier.sweep(self.slots.num_slots,
                                                         set(self.placement.pins) | set(keep))
        self.slots.remove(gone)
        self._last_sweep = time.monotonic()  # from its end: a long sweep is not followed at once
        self.counters["evicted_blocks"] += len(gone)

    def forget_positions(self, keys: list[Key]) -> None:
        """``keys``' host blocks are now whole (or gone): no partial-position record."""
        if self.positions:
            for k in keys:
                self.positions.pop(k, None)
                if self.file_tier is not None:
                    self.file_tier.block_meta.pop(k, None)

    def record_positions(self, keys: list[Key], masks: list[int]) -> None:
        """After an offload: key ``keys[i]``'s host block holds the positions of ``masks[i]``."""
        if self.k == 1:
            return
        full = (1 << self.k) - 1
        self.forget_positions([k for k, m in zip(keys, masks) if m == full])
        for k, m in zip(keys, masks):
            if m != full:
                self._set_position(k, m)

    def check_positions(self, keys: list[Key], masks: list[int]) -> None:
        """Before an onboard of positions ``masks[i]`` of ``keys[i]``.

        Raises:
            KeyNotFoundError: a position its host block never held (named, with those it holds).
        """
        if self.k == 1 or not self.positions:
            return
        for k, m in zip(keys, masks):
            have = self.positions.get(k)
            if have is not None and m & ~have:
                missing = [j for j in range(self.k) if (m & ~have) >> j & 1]
                raise KeyNotFoundError(f"key {key_text(k)}: position(s) {missing} of its host block were never "
                                       f"offloaded (it holds positions {[j for j in range(self.k) if have >> j & 1]})")
