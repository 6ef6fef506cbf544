"""Per-slot ordering of conflicting transfers (read-after-write, write-after-read,
write-after-write).

For every slot of every tier the ledger keeps the id of the job with the last pending write,
of the last pending GPU reader and of the last pending threaded reader (file I/O, CPU copies).
Before a job copies ``src -> dst`` it must wait for the pending writes to its source slots and
for the pending reads and writes of its destination slots; then it is recorded as the new
writer of its destination and a reader of its source. A new reader of a slot makes its own
completion imply the previous reader's of the same kind (it *covers* it), so one id per slot
and kind is enough and a later writer waits for all readers. A writer clears the readers of
the slots it writes (it waited for them).

This generalizes the pending-read/pending-write events of TensorRT-LLM's
``KVCacheTransferManager`` (its long comment on two offloads into one block and on partial
copies from a block being onboarded) to every tier, several readers, and file I/O futures.
Lookups are vectorized with NumPy; only the distinct job ids found are visited.
"""

from __future__ import annotations

import numpy as np

from tiercache.transfer.jobs import Job

_MAX, _MIN = np.maximum.reduce, np.minimum.reduce  # the ufuncs' reductions, without ndarray.max's wrapper


class SlotLedger:
    """The pending-job ids of every slot of every tier.

    Args:
        capacities: ``{tier: num_slots}``.
    """

    def __init__(self, capacities: dict[str, int]) -> None:
        # per tier one [3, n] table: the last pending writer, GPU reader and threaded reader
        # of every slot (one take reads all three); _w/_rg/_rt are its rows
        self._t = {t: np.full((3, n), -1, dtype=np.int64) for t, n in capacities.items()}
        self._w = {t: a[0] for t, a in self._t.items()}
        self._rg = {t: a[1] for t, a in self._t.items()}
        self._rt = {t: a[2] for t, a in self._t.items()}
        # slots whose last writer failed: they hold no valid block until written again
        self._invalid = {t: np.zeros(n, dtype=bool) for t, n in capacities.items()}
        self._any_invalid = {t: False for t in capacities}  # False: no slot of the tier is invalid

    def tracks(self, tier: str) -> bool:
        return tier in self._w

    @staticmethod
    def _ids(arr: np.ndarray, slots: np.ndarray) -> list[int]:
        if slots.size == 0:
            return []
        ids = arr.take(slots)
        hi = int(_MAX(ids))
        if hi < 0:  # nothing pending
            return []
        if int(_MIN(ids)) == hi:  # one job wrote (or read) them all: the common case of a repeated batch
            return [hi]
        return np.unique(ids[ids >= 0]).tolist()

    @staticmethod
    def _block_ids(block: np.ndarray, his: list[int], rows) -> list[int]:
        """Distinct ids (sorted) in ``rows`` of ``block`` (a ``[3, n]`` take of a tier's table
        whose row maxima are ``his``), -1 (nothing pending) left out: a second reduction only
        where a row holds ids, a sort only where it holds several."""
        out: list[int] = []
        for r in rows:
            hi = his[r]
            if hi < 0:  # nothing pending of this kind
                continue
            row = block[r]
            if int(_MIN(row)) == hi:  # one job wrote (or read) them all: a repeated batch
                out.append(hi)
            else:
                out.extend(np.unique(row[row >= 0]).tolist())
        return sorted(set(out)) if len(out) > 1 else out

    def _take(self, tier: str, slots: np.ndarray) -> tuple[np.ndarray, list[int]]:
        block = self._t[tier].take(slots, axis=1)  # [3, n]: writers, GPU readers, threaded readers
        return block, _MAX(block, axis=1).tolist()

    def _ids3(self, tier: str, slots: np.ndarray) -> list[int]:
        """Ids of every pending writer and reader of ``slots`` (sorted, distinct)."""
        if slots.size == 0:
            return []
        return self._block_ids(*self._take(tier, slots), (0, 1, 2))

    def dependencies(
        self, src: str, src_slots: np.ndarray, dst: str, dst_slots: np.ndarray
    ) -> tuple[list[int], list[int]]:
        """Job ids to wait for: ``(writers of the source, readers and writers of the
        destination)``; tiers the ledger does not track (``caller``) contribute none."""
        raw = self._ids(self._w[src], src_slots) if src in self._w else []
        war = self._ids3(dst, dst_slots) if dst in self._t else []
        return raw, war

    def lookup(self, src: str, src_slots: np.ndarray, dst: str, dst_slots: np.ndarray,
               gpu: bool) -> tuple[list[int], list[int], list[int]]:
        """:meth:`dependencies` and :meth:`previous_readers` of the source in one pass (one
        take per tier): ``(raw, war, readers)``."""
        raw: list[int] = []
        readers: list[int] = []
        if src in self._t and src_slots.size:
            block, his = self._take(src, src_slots)
            raw = self._block_ids(block, his, (0,))
            readers = self._block_ids(block, his, (1 if gpu else 2,))
        war = self._ids3(dst, dst_slots) if dst in self._t else []
        return raw, war, readers

    def previous_readers(self, tier: str, slots: np.ndarray, gpu: bool) -> list[int]:
        """Pending readers of ``slots`` of the same kind, which a new reader covers."""
        if tier not in self._w:
            return []
        return self._ids((self._rg if gpu else self._rt)[tier], slots)

    def record(self, job: Job, src: str, src_slots: np.ndarray, dst: str, dst_slots: np.ndarray, gpu: bool) -> None:
        """Record ``job`` as the reader of ``src_slots`` and the writer of ``dst_slots``."""
        if src in self._w and src_slots.size:
            (self._rg if gpu else self._rt)[src][src_slots] = job.id
        if dst in self._t and dst_slots.size:
            self._w[dst][dst_slots] = job.id
            self._rg[dst][dst_slots] = -1
            self._rt[dst][dst_slots] = -1
            if self._any_invalid[dst]:
                inv = self._invalid[dst]
                inv[dst_slots] = False
                self._any_invalid[dst] = bool(inv.any())

    def mark_failed(self, job: Job, tier: str, slots) -> None:
        """A finished ``job`` did not fill ``slots`` of ``tier``: flag those it still owns (no
        later writer) as invalid, so later readers fail instead of copying garbage."""
        if tier not in self._w or not slots:
            return
        arr = np.fromiter(slots, dtype=np.int64)
        arr = arr[self._w[tier][arr] == job.id]
        if arr.size:
            self._invalid[tier][arr] = True
            self._any_invalid[tier] = True

    def set_valid(self, tier: str, slots: np.ndarray, failed: set[int]) -> None:
        """A copy that finished at once (on the CPU, after waiting for every conflicting job)
        wrote ``slots``: they hold valid blocks again, but those in ``failed``."""
        if tier not in self._invalid or slots.size == 0:
            return
        self._invalid[tier][slots] = False
        if failed:
            self._invalid[tier][np.fromiter(failed, dtype=np.int64)] = True
        self._any_invalid[tier] = bool(self._invalid[tier].any())

    def invalid(self, tier: str, slots: np.ndarray) -> np.ndarray:
        """Indices into ``slots`` of the slots that hold no valid block."""
        if tier not in self._invalid or slots.size == 0 or not self._any_invalid[tier]:
            return np.empty(0, dtype=np.int64)
        return np.flatnonzero(self._invalid[tier][slots])

    def pending_writers(self, tier: str, slots: np.ndarray) -> list[int]:
        """Ids of pending writers of ``slots`` (for host-side reads of a tier)."""
        return self._ids(self._w[tier], slots) if tier in self._w else []

    def pending_all(self, tier: str, slots: np.ndarray) -> list[int]:
        """Ids of every pending reader and writer of ``slots`` (for host-side writes)."""
        if tier not in self._w:
            return []
        return self._ids3(tier, slots)
