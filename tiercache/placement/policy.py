"""Placement: which key sits in which slot of which tier, LRU order per tier, and pins.

This module decides *what* moves (victims for spills); it never touches bytes. Tiers are
ordered top to bottom: ``device``, ``host``, ``file``.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from tiercache.errors import KeyNotFoundError, PinnedBlockError, TierFullError
from tiercache.keys import Key, format_keys, key_text
from tiercache.placement.compactslots import CompactSlots, check_claim
from tiercache.placement.victims import LRU, EvictionPolicy

TIER_ORDER = ("device", "host", "file")


class TierSlots:
    """Slots of one tier: key -> slot, LRU order (least recent first), free slots.

    Free slots come back lowest first, so a batch into an empty tier gets consecutive slots
    (one copy per run, see :mod:`tiercache.copypaths.copyplan`).
    """

    def __init__(self, name: str, num_slots: int) -> None:
        self.name = name
        self.num_slots = num_slots
        self.slot_of: dict[Key, int] = {}
        self.key_at: dict[int, Key] = {}
        self.lru: OrderedDict[Key, None] = OrderedDict()
        self._heap = list(range(num_slots))  # free slots, lowest first; stale entries skipped
        self._free = num_slots

    def __contains__(self, key: Key) -> bool:
        return key in self.slot_of

    def find_many(self, keys: Sequence[Key]) -> np.ndarray:
        """Each key's slot, or -1 (``int64``, in key order)."""
        get = self.slot_of.get
        return np.array([get(k, -1) for k in keys], np.int64)

    def __len__(self) -> int:
        return len(self.slot_of)

    @property
    def free_count(self) -> int:
        return self._free

    def _take(self, key: Key, slot: int) -> None:
        self.slot_of[key] = slot
        self.key_at[slot] = key
        self.lru[key] = None
        self._free -= 1

    def add(self, keys: list[Key]) -> list[int]:
        """Give each key (not yet in this tier) the lowest free slot; the caller made room."""
        if len(keys) > self._free:
            raise TierFullError(f"{self.name} tier: {len(keys)} slots wanted, {self._free} free")
        slots = []
        for k in keys:
            s = heapq.heappop(self._heap)
            while s in self.key_at:  # stale: claimed explicitly
                s = heapq.heappop(self._heap)
            self._take(k, s)
            slots.append(s)
        return slots

    def claim(self, keys: list[Key], slots: list[int]) -> None:
        """Put each key in the given slot (engine-chosen slots; :func:`check_claim` raises
        :class:`SlotRangeError` for a slot out of range, repeated, or holding a key)."""
        check_claim(self.name, self.num_slots, slots, self.key_at)
        for k, s in zip(keys, slots):
            self._take(k, s)

    def remove(self, keys: Iterable[Key]) -> None:
        """Free the slots of ``keys`` (keys not in this tier are ignored)."""
        for k in keys:
            s = self.slot_of.pop(k, None)
            if s is not None:
                del self.lru[k]
                del self.key_at[s]
                heapq.heappush(self._heap, s)
                self._free += 1

    def keys(self) -> list[Key]:
        """Every key of the tier."""
        return list(self.slot_of)

    def touch(self, keys: Iterable[Key]) -> None:
        """Mark ``keys`` most recently used."""
        for k in keys:
            if k in self.lru:
                self.lru.move_to_end(k)


class Placement:
    """Every tier's :class:`TierSlots` plus pin counts.

    Args:
        capacities: slots per tier name, for the tiers that exist, top to bottom.
        file_group: the file tier's :class:`CompactSlots` ``group`` (the key's block subdirectory).
    """

    def __init__(self, capacities: dict[str, int], file_group=None) -> None:
        #: which keys leave a full tier (:class:`~tiercache.placement.victims.EvictionPolicy`)
        self.eviction: EvictionPolicy = LRU()
        self.tiers = {name: CompactSlots(name, n, file_group) if name == "file" else TierSlots(name, n)
                      for name, n in capacities.items()}
        self.pins: dict[Key, int] = {}

    @property
    def order(self) -> list[str]:
        """Tier names present, top to bottom."""
        return [t for t in TIER_ORDER if t in self.tiers]

    def below(self, tier: str) -> list[str]:
        """Tiers under ``tier``, nearest first."""
        order = self.order
        return order[order.index(tier) + 1:]

    def above(self, tier: str) -> list[str]:
        """Tiers over ``tier``, nearest first."""
        order = self.order
        return order[: order.index(tier)][::-1]

    def where(self, key: Key) -> dict[str, int]:
        """``{tier: slot}`` for every tier holding ``key`` (empty if none)."""
        return {t: ts.slot_of[key] for t, ts in self.tiers.items() if key in ts}

    def count_walk(self, counters, what: str, keys, tiers) -> None:
        """Count each key's walk down ``tiers`` (a cache hierarchy's hit rates): in
        ``counters``, ``{what}_misses_{tier}`` for each tier without the key and
        ``{what}_hits_{tier}`` at the first tier with it."""
        for k in keys:
            for t in tiers:
                if k in self.tiers[t]:
                    counters[f"{what}_hits_{t}"] += 1
                    break
                counters[f"{what}_misses_{t}"] += 1

    def contains(self, key: Key) -> bool:
        return any(key in ts for ts in self.tiers.values())

    def contains_many(self, keys: Sequence[Key], tiers: Iterable[str] | None = None) -> list[bool]:
        """Per key, whether any of ``tiers`` (default: every tier) holds it (:meth:`contains`
        for a batch: one batched lookup per tier)."""
        held = np.zeros(len(keys), bool)
        for t in self.tiers if tiers is None else tiers:
            held |= self.tiers[t].find_many(keys) >= 0
        return held.tolist()

    def existing(self, keys: Sequence[Key]) -> list[Key]:
        """The keys some tier holds, in order."""
        return [k for k, held in zip(keys, self.contains_many(keys)) if held]

    def keys(self) -> set[Key]:
        """Every stored key."""
        out: set[Key] = set()
        for ts in self.tiers.values():
            out.update(ts.keys())
        return out

    def has_copy_below(self, key: Key, tier: str) -> bool:
        return any(key in self.tiers[t] for t in self.below(tier))

    def is_pinned(self, key: Key) -> bool:
        return self.pins.get(key, 0) > 0

    def pin(self, keys: Iterable[Key]) -> None:
        for k in keys:
            self.pins[k] = self.pins.get(k, 0) + 1

    def unpin(self, keys: Iterable[Key]) -> None:
        for k in keys:
            n = self.pins.get(k, 0) - 1
            if n > 0:
                self.pins[k] = n
            else:
                self.pins.pop(k, None)

    def room(self, tier: str) -> int:
        """Slots of ``tier`` an operation may fill at once: its slots less its pinned blocks."""
        ts = self.tiers[tier]
        return ts.num_slots - sum(1 for k, n in self.pins.items() if n > 0 and k in ts)

    def require_present(self, keys: list[Key]) -> None:
        """Raises:
            KeyNotFoundError: naming the keys no tier holds."""
        missing = [k for k, held in zip(keys, self.contains_many(keys)) if not held]
        if missing:
            raise KeyNotFoundError(f"key(s) {format_keys(missing)} not stored in any tier")

    def require_unpinned(self, keys: list[Key], action: str) -> None:
        """Raises:
            PinnedBlockError: naming the pinned keys and ``action`` (what was refused)."""
        pinned = [k for k in keys if self.is_pinned(k)]
        if pinned:
            raise PinnedBlockError(f"cannot {action} pinned block(s) {format_keys(pinned)}; unpin them first")

    def victims(self, tier: str, count: int, protect: set[Key]) -> list[Key]:
        """The ``count`` keys of ``tier`` that :attr:`eviction` picks (the least recently used,
        by default) among those that may leave it: not pinned and not in ``protect`` (the keys
        of the operation in progress).

        Raises:
            TierFullError: fewer than ``count`` such keys.
        """
        ts = self.tiers[tier]
        out = self.eviction.victims(ts.lru, count, lambda k: k in protect or self.is_pinned(k))
        if len(out) == max(count, 0):
            return out
        pinned = [k for k in ts.lru if self.is_pinned(k)]
        in_use = sum(1 for k in ts.lru if k in protect and not self.is_pinned(k))
        if not pinned and not in_use:  # an empty tier too small for the request
            raise TierFullError(f"{tier} tier has {ts.num_slots} slots; {count + ts.free_count} needed")
        raise TierFullError(
            f"{tier} tier is full: {count} more slot(s) needed, {ts.free_count} free of {ts.num_slots}; "
            + (f"{len(pinned)} block(s) are pinned (e.g. key {key_text(pinned[0])}), " if pinned else "")
            + f"{in_use} block(s) are in use by this operation" + (" and cannot spill" if in_use else "")
        )
