"""Placement: which block lives in which slot of which tier (bookkeeping; the copies that move
blocks between tiers are :mod:`tiercache.moves`').

- :mod:`.policy`: :class:`Placement`: key -> slot per tier, LRU order, pins, victim choice
  (pure bookkeeping, no I/O);
- :mod:`.compactslots`: :class:`CompactSlots`: the same for the file tier (millions of blocks)
  in arrays;
- :mod:`.rootindex`: :class:`RootIndex`: a root's saved index loaded at open, reconciled with
  the directory, checkpointed (the cache's file tier and RowStore each hold one);
- :mod:`.fileindex`: :class:`FileIndex`: the cache's file-tier index (a RootIndex) and the
  positions held by partial host blocks (kept in the block files' headers).
- :mod:`.victims`: :class:`EvictionPolicy`, the seam both facades (the cache's placement and
  :class:`~tiercache.RowStore`) choose victims through, and :class:`LRU` (:func:`lru_victims`),
  the default;
- :mod:`.sharedbook`: :class:`NegativeCache`, :class:`TouchThrottle`: a shared root's
  per-process bookkeeping, kept alike by both facades.

Depends on :mod:`tiercache.files`.
"""

from .compactslots import CompactSlots
from .fileindex import FileIndex
from .policy import TIER_ORDER, Placement, TierSlots
from .rootindex import RootIndex
from .sharedbook import NegativeCache, TouchThrottle
from .victims import LRU, EvictionPolicy, lru_victims

__all__ = [
    "CompactSlots", "FileIndex", "NegativeCache", "Placement", "RootIndex", "TIER_ORDER", "TierSlots",
    "TouchThrottle", "lru_victims", "EvictionPolicy", "LRU",
]
