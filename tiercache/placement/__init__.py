"""Placement: which block lives in which slot of which tier, and how blocks move between tiers.

- :mod:`.policy`: :class:`Placement`: key -> slot per tier, LRU order, pins, victim choice
  (pure bookkeeping, no I/O);
- :mod:`.compactslots`: :class:`CompactSlots`: the same for the file tier (millions of blocks)
  in arrays;
- :mod:`.mover`: :class:`BlockMover`: copies keyed blocks between tiers through the transfer
  engine, making room by spilling least recently used blocks down;
- :mod:`.rootindex`: :class:`RootIndex`: a root's saved index loaded at open, reconciled with
  the directory, checkpointed (the cache's file tier and RowStore each hold one);
- :mod:`.fileindex`: :class:`FileIndex`: the cache's file-tier index (a RootIndex) and the
  positions held by partial host blocks (kept in the block files' headers).
- :mod:`.victims`: :func:`lru_victims`: the one least-recently-used victim rule (the cache's
  placement and :class:`~tiercache.RowStore`);
- :mod:`.sharedbook`: :class:`NegativeCache`, :class:`TouchThrottle`: a shared root's
  per-process bookkeeping, kept alike by both facades.

Depends on :mod:`tiercache.transfer` and :mod:`tiercache.files`.
"""

from .compactslots import CompactSlots
from .fileindex import FileIndex
from .mover import BlockMover
from .policy import TIER_ORDER, Placement, TierSlots
from .rootindex import RootIndex
from .sharedbook import NegativeCache, TouchThrottle
from .victims import lru_victims

__all__ = [
    "BlockMover", "CompactSlots", "FileIndex", "NegativeCache", "Placement", "RootIndex", "TIER_ORDER", "TierSlots",
    "TouchThrottle", "lru_victims",
]
