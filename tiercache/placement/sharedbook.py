"""Per-process bookkeeping for a shared root, which both facades (the cache's file index and
the row store) keep: keys looked for and found in no file (not looked for again for a while),
and keys whose use time was refreshed lately (not refreshed again for a while). Both tables
forget their stale entries once they pass :data:`MAX_ENTRIES`."""

from __future__ import annotations

import time
from collections.abc import Iterable

from tiercache.keys import Key

#: entries past which a table drops what has expired
MAX_ENTRIES = 65536


class NegativeCache:
    """Keys found in no file of a shared root: :meth:`absent` says so for ``ttl_s`` seconds
    after :meth:`mark`, so a miss costs one probe per key per ``ttl_s`` (0: every miss looks).

    Args:
        ttl_s: seconds a miss is remembered.
    """

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = float(ttl_s)
        self._until: dict[Key, float] = {}

    def absent(self, key: Key, now: float | None = None) -> bool:
        """``key`` was found in no file less than ``ttl_s`` seconds ago."""
        return self._until.get(key, 0.0) > (time.monotonic() if now is None else now)

    def mark(self, keys: Iterable[Key], now: float | None = None) -> None:
        """``keys`` were looked for and found in no file."""
        now = time.monotonic() if now is None else now
        for k in keys:
            self._until[k] = now + self.ttl_s
        if len(self._until) > MAX_ENTRIES:
            self._until = {k: t for k, t in self._until.items() if t > now}


class TouchThrottle:
    """At most one use-time refresh per key every ``every_s`` seconds in this process (a
    refresh is a ``utimensat``; a hot key read many times a second needs one).

    Args:
        every_s: seconds between two refreshes of one key.
    """

    def __init__(self, every_s: float) -> None:
        self.every_s = float(every_s)
        self._at: dict[Key, float] = {}

    def due(self, keys: Iterable[Key], now: float | None = None) -> list[Key]:
        """Those of ``keys`` not refreshed within ``every_s`` seconds, recorded as refreshed
        now (the caller refreshes them)."""
        now = time.monotonic() if now is None else now
        todo = [k for k in keys if now - self._at.get(k, -self.every_s) >= self.every_s]
        for k in todo:
            self._at[k] = now
        if len(self._at) > MAX_ENTRIES:
            self._at = {k: t for k, t in self._at.items() if now - t < self.every_s}
        return todo
