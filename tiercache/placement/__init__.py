"""Placement: which block lives in which slot of which tier, and how blocks move between tiers.

- :mod:`.policy`: :class:`Placement`: key -> slot per tier, LRU order, pins, victim choice
  (pure bookkeeping, no I/O);
- :mod:`.compactslots`: :class:`CompactSlots`: the same for the file tier (millions of blocks)
  in arrays;
- :mod:`.mover`: :class:`BlockMover`: copies keyed blocks between tiers through the transfer
  engine, making room by spilling least recently used blocks down;
- :mod:`.fileindex`: :class:`FileIndex`: the file tier's index rebuilt from a root at open, and
  the positions held by partial host blocks (kept in the block files' headers).

Depends on :mod:`tiercache.transfer` and :mod:`tiercache.files`.
"""

from .compactslots import CompactSlots
from .fileindex import FileIndex
from .mover import BlockMover
from .policy import TIER_ORDER, Placement, TierSlots

__all__ = [
    "BlockMover", "CompactSlots", "FileIndex", "Placement", "TIER_ORDER", "TierSlots",
]
