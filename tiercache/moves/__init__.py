"""Moves: keyed blocks copied between tiers through the transfer engine, and room made by
spilling blocks down (:class:`BlockMover`, :mod:`.blockmover`): where the placement's decisions
(:mod:`tiercache.placement`) become copies.

Depends on :mod:`tiercache.placement`, :mod:`tiercache.transfer` and :mod:`tiercache.files`.
"""

from .blockmover import BlockMover

__all__ = ["BlockMover"]
