"""The slots of a large tier (the file tier: millions of blocks) in arrays, not dicts.

:class:`CompactSlots` answers what :class:`~tiercache.placement.policy.TierSlots` answers
(key -> slot, slot -> key, least recently used order, free slots) at about 40 bytes per
block plus the key's own bytes, where ``TierSlots``' three dicts cost about 400 bytes, and it
loads a saved index (:meth:`CompactSlots.load`) with a few vectorized passes instead of one
Python call per block.

Per slot it keeps the key (``klen`` 255 for an int key held in ``kval``; 1..64 for a bytes
key whose bytes sit in an arena at offset ``kval``; 0 for a free slot), a 64-bit hash and the
tick of its last use. Lookups find a key's slot in two levels, a small dict of keys added
since the last merge and a sorted array of ``(hash, slot)``; an entry of the sorted array is
only a hint, confirmed by comparing the key stored at its slot, so removals leave it in place
until the next merge. The least recently used order is the order of ticks: victims come from
a cached list of the oldest slots (every later use has a larger tick, so that list stays the
true oldest until it runs out), refreshed with one partial sort.

Reads from other threads (``key in slots``) need no lock: the sorted array and its slots are
swapped as one tuple, and dict lookups are atomic.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from tiercache.errors import ConfigError, SlotRangeError, TierFullError
from tiercache.keys import KEY_HASH_GOLDEN, Key, key_hash, key_text

INT_KEY = 255  # klen of a slot holding an int key
_CANDIDATES = 1024  # oldest slots cached per refresh (at least)
ARENA_SLACK = 1 << 20  # bytes of removed keys' bytes tolerated in the arena (beyond half of it)
MERGE_MIN = 4096  # recent keys kept in the dict before a merge (at least; else 1/8 of the sorted array)


def _physical_memory() -> int:
    """This machine's memory in bytes (0 where it cannot be read)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 0


def check_claim(name: str, num_slots: int, slots: list[int], key_at) -> None:
    """Check engine-chosen ``slots`` of tier ``name`` before they are claimed.

    Raises:
        SlotRangeError: a slot out of ``[0, num_slots)``, repeated, or holding a key (named).
    """
    for s in slots:
        if not 0 <= s < num_slots:
            raise SlotRangeError(f"{name} slot {s} outside [0, {num_slots})")
    if len(set(slots)) != len(slots):
        dup = next(s for i, s in enumerate(slots) if s in slots[:i])
        raise SlotRangeError(f"{name} slot {dup} appears twice")
    for s in slots:
        if s in key_at:
            raise SlotRangeError(f"{name} slot {s} already holds key {key_text(key_at[s])}")


class _SlotOf:
    """``slots.slot_of``: the mapping key -> slot."""

    __slots__ = ("_s",)

    def __init__(self, s: CompactSlots) -> None:
        self._s = s

    def __getitem__(self, key: Key) -> int:
        slot = self._s.find(key)
        if slot < 0:
            raise KeyError(key)
        return slot

    def get(self, key: Key, default=None):
        slot = self._s.find(key)
        return default if slot < 0 else slot

    def __contains__(self, key: Key) -> bool:
        return self._s.find(key) >= 0

    def __iter__(self) -> Iterator[Key]:
        return iter(self._s.keys())

    def __len__(self) -> int:
        return len(self._s)


class _KeyAt:
    """``slots.key_at``: the mapping slot -> key."""

    __slots__ = ("_s",)

    def __init__(self, s: CompactSlots) -> None:
        self._s = s

    def __contains__(self, slot: int) -> bool:
        return 0 <= slot < self._s.num_slots and bool(self._s._klen[slot])

    def __getitem__(self, slot: int) -> Key:
        if slot not in self:
            raise KeyError(slot)
        return self._s.key_of(slot)


class CompactSlots:
    """Slots of one tier: key -> slot, slot -> key, LRU order, free slots, in arrays.

    The interface of :class:`~tiercache.placement.policy.TierSlots` (``add``, ``claim``,
    ``remove``, ``touch``, ``slot_of``, ``key_at``, ``lru``, ``free_count``), for a tier of
    any size. Free slots are reused most recently freed first, then never used ones, lowest
    first.

    Args:
        name: the tier's name (in error messages).
        num_slots: slots of the tier (``>= 0``); memory is committed only for slots used.
        group: ``group(key)`` in ``[0, 256)``, kept per slot (the file tier: the key's block
            subdirectory, so that a reconciliation finds a subdirectory's keys): :meth:`in_group`.
    """

    #: bytes per slot when every slot is used (klen, group, kval, hash, tick, the sorted copy of
    #: hash and slot), not counting bytes keys' bytes
    BYTES_PER_SLOT = 42

    @classmethod
    def check_fits(cls, name: str, num_slots: int) -> None:
        """Raise :class:`ConfigError` (naming ``num_slots`` and this machine's memory) where the
        index of ``num_slots`` slots, full, would need more memory than the machine has: what
        a caller checks before it creates anything on disk."""
        need = num_slots * cls.BYTES_PER_SLOT
        ram = _physical_memory()
        if ram and need > ram:
            raise ConfigError(f"{name} tier: {num_slots} slots would need {need / 2**30:.1f} GiB of index memory when "
                              f"full ({cls.BYTES_PER_SLOT} B per block), more than this machine's "
                              f"{ram / 2**30:.1f} GiB: give fewer slots (file_slots, capacity_bytes)")

    def __init__(self, name: str, num_slots: int, group: Callable[[Key], int] | None = None) -> None:
        self.check_fits(name, num_slots)
        self.name = name
        self.num_slots = num_slots
        self.group = group
        n = max(num_slots, 1)
        self._klen = np.zeros(n, np.uint8)
        self._group = np.zeros(n, np.uint8)
        #: (kval, arena): an int key, or the offset of a bytes key's bytes in the arena; swapped
        #: as one when the arena is compacted, so a reader never pairs new offsets with an old arena
        self._kv: tuple[np.ndarray, bytearray] = (np.zeros(n, np.int64), bytearray())
        self._hash = np.zeros(n, np.uint64)
        self._tick = np.zeros(n, np.uint64)
        self._arena_dead = 0
        self._base: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.uint64), np.zeros(0, np.int64))
        self._delta: dict[Key, int] = {}
        self._next = 0  # slots at or above were never used
        self._freed = array("q")  # slots freed below _next
        self._used = 0
        self._clock = 1
        self._cand: tuple[np.ndarray, np.ndarray] | None = None  # oldest slots, their ticks then
        self.slot_of = _SlotOf(self)
        self.key_at = _KeyAt(self)

    # -- lookups ---------------------------------------------------------------------------
    def _holds(self, slot: int, key: Key) -> bool:
        n = int(self._klen[slot])
        if n == 0:
            return False
        kval, arena = self._kv
        if n == INT_KEY:
            return isinstance(key, int) and int(kval[slot]) == key
        if not isinstance(key, bytes) or len(key) != n:
            return False
        off = int(kval[slot])
        return arena[off:off + n] == key

    def find(self, key: Key) -> int:
        """``key``'s slot, or -1."""
        slot = self._delta.get(key)
        if slot is not None:
            return slot
        bh, bs = self._base
        if not len(bh):
            return -1
        h = np.uint64(key_hash(key))
        i = int(bh.searchsorted(h))
        while i < len(bh) and bh[i] == h:
            slot = int(bs[i])
            if self._holds(slot, key):
                return slot
            i += 1
        return -1

    def find_many(self, keys: Sequence[Key]) -> np.ndarray:
        """Each key's slot, or -1 (``int64``, in key order): :meth:`find` for a batch, with one
        sorted search for the keys not among the recent ones and the int keys' slots checked
        as arrays (0.3-0.6 us a key in batches of 32 against 1.9-3.0 for :meth:`find` in a tier
        of 50,000 keys, whose NumPy scalars cost more than the search)."""
        n = len(keys)
        delta = self._delta
        out = np.array([delta.get(k, -1) for k in keys], np.int64)
        bh, bs = self._base
        if not n or not len(bh):
            return out
        rest = np.flatnonzero(out < 0)
        if not len(rest):
            return out
        rk = [keys[i] for i in rest.tolist()]
        ints = all(type(k) is int for k in rk)
        if ints:
            kv = np.array(rk, np.uint64)
            h = kv * np.uint64(KEY_HASH_GOLDEN)  # key_hash of int keys, wrapping as it does
        else:
            h = np.fromiter((key_hash(k) for k in rk), np.uint64, len(rk))
        pos = bh.searchsorted(h)
        inside = pos < len(bh)
        at = np.where(inside, pos, 0)
        hit = inside & (bh[at] == h)
        cand = bs[at]
        if ints:
            sure = hit & (self._klen[cand] == INT_KEY) & (self._kv[0][cand].view(np.uint64) == kv)
            out[rest[sure]] = cand[sure]
            hit &= ~sure
        for j in np.flatnonzero(hit).tolist():  # bytes keys, and hashes shared by several slots
            out[rest[j]] = self.find(rk[j])
        return out

    def key_of(self, slot: int) -> Key:
        """The key in ``slot`` (which must hold one)."""
        n = int(self._klen[slot])
        kval, arena = self._kv
        if n == INT_KEY:
            return int(kval[slot])
        off = int(kval[slot])
        return bytes(arena[off:off + n])

    def __contains__(self, key: Key) -> bool:
        return self.find(key) >= 0

    def __len__(self) -> int:
        return self._used

    @property
    def free_count(self) -> int:
        return self.num_slots - self._used

    def used_slots(self) -> np.ndarray:
        """The slots holding a key (``int64``, ascending)."""
        return np.flatnonzero(self._klen[: self._next])

    def in_group(self, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The used slots of ``group``, their ticks and their keys' hashes now (``int64``,
        ``uint64``, ``uint64``)."""
        used = self.used_slots()
        used = used[self._group[used] == group]
        return used, self._tick[used], self._hash[used]

    def tick_of(self, slot: int) -> int:
        """The tick of ``slot``'s last use (a write or a touch)."""
        return int(self._tick[slot])

    def keys(self) -> list[Key]:
        """Every key, in slot order."""
        return [self.key_of(int(s)) for s in self.used_slots()]

    # -- changes ---------------------------------------------------------------------------
    def _store(self, key: Key, slot: int) -> None:
        kval, arena = self._kv
        if isinstance(key, int):
            kval[slot] = key
            self._klen[slot] = INT_KEY
        else:
            kval[slot] = len(arena)
            arena += key
            self._klen[slot] = len(key)
        self._hash[slot] = key_hash(key)
        if self.group is not None:
            self._group[slot] = self.group(key)
        self._tick[slot] = self._clock
        self._clock += 1
        self._delta[key] = slot
        self._used += 1
        if len(self._delta) > max(MERGE_MIN, len(self._base[0]) // 8):
            self._merge()

    def _merge(self) -> None:
        """Fold the dict of recent keys into the sorted array (one sort of every used slot's
        hash)."""
        used = self.used_slots()
        h = self._hash[used]
        order = np.argsort(h, kind="stable")
        self._base = (h[order], used[order])
        self._delta = {}

    def add(self, keys: Sequence[Key]) -> list[int]:
        """Give each key (not yet in this tier) a free slot; the caller made room.

        Raises:
            TierFullError: fewer free slots than keys.
        """
        if len(keys) > self.free_count:
            raise TierFullError(f"{self.name} tier: {len(keys)} slots wanted, {self.free_count} free")
        n = len(keys)
        take = min(n, len(self._freed))
        slots = self._freed[len(self._freed) - take:].tolist()[::-1]  # as pop() takes them: the last freed first
        del self._freed[len(self._freed) - take:]
        slots.extend(range(self._next, self._next + n - take))
        self._next += n - take
        kinds = {type(k) for k in keys}
        if n < 4 or len(kinds) != 1:
            for k, s in zip(keys, slots):
                self._store(k, s)
            return slots
        self._store_many(keys, slots, kinds.pop() is int)
        return slots

    def _store_many(self, keys: Sequence[Key], slots: list[int], ints: bool) -> None:
        """:meth:`_store` of keys of one kind (``ints``: int keys; else bytes keys), as
        arrays: one assignment per array, bytes keys' bytes appended to the arena at once
        (a key's NumPy scalar stores cost 3 us a key in a row store's submits)."""
        n = len(keys)
        at = np.array(slots, np.int64)
        kval, arena = self._kv
        if ints:
            kv = np.array(keys, np.int64)
            kval[at] = kv
            self._klen[at] = INT_KEY
            self._hash[at] = kv.view(np.uint64) * np.uint64(KEY_HASH_GOLDEN)  # key_hash, wrapping as it does
        else:
            lens = np.fromiter(map(len, keys), np.int64, n)
            offs = np.empty(n, np.int64)
            offs[0] = len(arena)
            np.cumsum(lens[:-1], out=offs[1:])
            offs[1:] += len(arena)
            arena += b"".join(keys)  # type: ignore[arg-type]  # bytes keys here
            kval[at] = offs
            self._klen[at] = lens
            self._hash[at] = np.fromiter(map(key_hash, keys), np.uint64, n)
        if self.group is not None:
            self._group[at] = np.fromiter(map(self.group, keys), np.uint8, n)
        self._tick[at] = np.fromiter(range(self._clock, self._clock + n), np.uint64, n)
        self._clock += n
        self._delta.update(zip(keys, slots))
        self._used += n
        if len(self._delta) > max(MERGE_MIN, len(self._base[0]) // 8):
            self._merge()

    def claim(self, keys: list[Key], slots: list[int]) -> None:
        """Put each key in the given slot.

        Raises:
            SlotRangeError: a slot out of ``[0, num_slots)``, repeated, or holding a key.
        """
        check_claim(self.name, self.num_slots, slots, self.key_at)
        taken = set(slots)
        if any(s < self._next for s in taken):
            self._freed = array("q", [f for f in self._freed if f not in taken])
        for s in sorted(taken):
            while self._next < s:  # slots skipped over are free
                self._freed.append(self._next)
                self._next += 1
            if self._next == s:
                self._next += 1
        for k, s in zip(keys, slots):
            self._store(k, s)

    def remove(self, keys: Iterable[Key]) -> None:
        """Free the slots of ``keys`` (keys not in this tier are ignored)."""
        for k in keys:
            s = self.find(k)
            if s < 0:
                continue
            self._delta.pop(k, None)
            n = int(self._klen[s])
            if n != INT_KEY:
                self._arena_dead += n
            self._klen[s] = 0
            self._freed.append(s)
            self._used -= 1
        if self._arena_dead > max(ARENA_SLACK, len(self._kv[1]) // 2):
            self._compact_arena()

    def _compact_arena(self) -> None:
        """Copy the bytes keys still held into a new arena (vectorized)."""
        used = self.used_slots()
        lens = self._klen[used]
        byt = used[lens != INT_KEY]
        n = self._klen[byt].astype(np.int64)
        kval, arena = self._kv
        starts = np.concatenate(([0], np.cumsum(n)[:-1])) if len(n) else n
        idx = np.repeat(kval[byt] - starts, n) + np.arange(int(n.sum()))
        new = kval.copy()
        new[byt] = starts
        self._kv = (new, bytearray(np.frombuffer(arena, np.uint8)[idx].tobytes()))
        self._arena_dead = 0

    def touch(self, keys: Iterable[Key]) -> None:
        """Mark ``keys`` most recently used (in order: the last is the most recent)."""
        slots = self.find_many(keys if isinstance(keys, (list, tuple)) else list(keys))
        slots = slots[slots >= 0]
        if len(slots):
            # np.fromiter, not np.arange: with arange here a row store load's submit took 60-70 us a
            # block at p90 behind busy I/O threads on the CPU machine, against 7-10 (not isolated)
            self._tick[slots] = np.fromiter(range(self._clock, self._clock + len(slots)), np.uint64, len(slots))
            self._clock += len(slots)

    # -- saving and loading ----------------------------------------------------------------
    def export(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, bytes, int]:
        """The used slots' ``(klen u8, kval i64, hash u64, tick u64, group u8, arena, next
        tick)``, in slot order, with a compacted arena (offsets into it): what :meth:`load`
        takes."""
        used = self.used_slots()
        klen = self._klen[used]
        kval, arena = self._kv
        kval = kval[used]
        byt = klen != INT_KEY
        n = klen[byt].astype(np.int64)
        starts = np.concatenate(([0], np.cumsum(n)[:-1])) if len(n) else n
        idx = np.repeat(kval[byt] - starts, n) + np.arange(int(n.sum()))
        packed = np.frombuffer(arena, np.uint8)[idx].tobytes() if len(idx) else b""
        kval[byt] = starts
        return klen, kval, self._hash[used], self._tick[used], self._group[used], packed, self._clock

    def load(self, klen: np.ndarray, kval: np.ndarray, hashes: np.ndarray, ticks: np.ndarray, groups: np.ndarray,
             arena: bytes, clock: int) -> None:
        """Fill an empty instance with what :meth:`export` returned (at most ``num_slots``
        entries), in slots ``0 .. n-1``, with vectorized copies and one sort.

        Raises:
            TierFullError: more entries than slots.
        """
        n = len(klen)
        if n > self.num_slots:
            raise TierFullError(f"{self.name} tier: {n} saved blocks, {self.num_slots} slots")
        assert self._used == 0 and self._next == 0, "load into an empty CompactSlots"
        self._klen[:n] = klen
        self._kv[0][:n] = kval
        self._kv[1][:] = arena
        self._hash[:n] = hashes
        self._tick[:n] = ticks
        self._group[:n] = groups
        self._next = self._used = n
        self._clock = max(int(clock), int(ticks.max()) + 1 if n else 1)
        self._merge()

    # -- least recently used order ---------------------------------------------------------
    @property
    def lru(self) -> Iterator[Key]:
        """Keys, least recently used first (lazily: victims take the first few)."""
        return (self.key_of(s) for s in self.lru_slots())

    def lru_slots(self) -> Iterator[int]:
        """Used slots, least recently used first: the cached oldest, then chunks of the
        rest, each found with one partial sort of the ticks above the last chunk's."""
        cmax = -1
        if self._cand is not None:
            slots, ticks = self._cand
            live = (self._klen[slots] != 0) & (self._tick[slots] == ticks)
            if not live.all():  # evicted or used since: they are no longer among the oldest
                slots, ticks = slots[live], ticks[live]
                self._cand = (slots, ticks) if len(slots) else None
            if len(slots):
                cmax = int(ticks[-1])
                yield from slots.tolist()
        while True:
            used = self.used_slots()
            ticks = self._tick[used]
            if cmax >= 0:  # every slot not yielded yet has a later tick (ticks only grow)
                later = ticks > cmax
                used, ticks = used[later], ticks[later]
            if not len(used):
                return
            k = min(len(used), max(_CANDIDATES, len(used) // 64))
            if k < len(used):
                part = np.argpartition(ticks, k - 1)[:k]
                used, ticks = used[part], ticks[part]
            order = np.argsort(ticks, kind="stable")
            used, ticks = used[order], ticks[order]
            if cmax < 0:  # the oldest of all: cached for the next victims
                self._cand = (used, ticks)
            yield from used.tolist()
            cmax = int(ticks[-1])
