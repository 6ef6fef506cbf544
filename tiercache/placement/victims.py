"""Least-recently-used victim choice, one rule for both facades (the cache's placement and the
row store): walk a tier's keys from the least recently used and take the first ``count`` that
nothing holds in place."""

from __future__ import annotations

from collections.abc import Callable, Iterable

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
