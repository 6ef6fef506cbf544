"""Victim choice, one seam for both facades (the cache's placement and the row store): an
:class:`EvictionPolicy` picks which keys leave a full tier, from the tier's keys in recency
order and a test of what is held in place. :class:`LRU` (the default, :func:`lru_victims`) walks
them from the least recently used and takes the first ``count`` that nothing holds."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from tiercache.keys import Key


def lru_victims(lru: Iterable[Key], count: int, held: Callable[[Key], bool]) -> list[Key]:
    """The first ``count`` keys of ``lru`` (least recently used first; read lazily) for which
    ``held(key)`` is false: pinned keys, keys of the operation in progress, keys being stored or
    read. Fewer when there are not that many; none for ``count <= 0``."""
    out: list[Key] = []
    if count <= 0:
        return out
    for k in lru:
        if held(k):
            continue
        out.append(k)
        if len(out) == count:
            break
    return out


class EvictionPolicy(Protocol):
    """Which keys of a full tier make room (the seam both facades choose victims through)."""

    def victims(self, recency: Iterable[Key], count: int, held: Callable[[Key], bool]) -> list[Key]:
        """Up to ``count`` keys of ``recency`` (a tier's keys, least recently used first, read
        lazily) for which ``held(key)`` is false; fewer when there are not that many."""
        ...


class LRU:
    """Least recently used first (:func:`lru_victims`): the default of both facades."""

    def victims(self, recency: Iterable[Key], count: int, held: Callable[[Key], bool]) -> list[Key]:
        return lru_victims(recency, count, held)
