"""Segment copies planned together: one argument table on the device for several launches.

:meth:`CopyLauncher.copy_segments <tiercache.copypaths.copykernels.CopyLauncher.copy_segments>`
builds, uploads and releases a table of segment addresses for every launch. A caller that knows
a batch of launches ahead (the vLLM connector's load: one scatter per piece of the prefix, each
issued once the piece is up) can build the tables of all of them at once, upload them in one
copy, and then issue each launch with no NumPy and no upload of its own: :class:`SegmentPlan`.

Layout (what :meth:`~tiercache.copypaths.copykernels.CopyLauncher.offsets_table` makes for a
list of launches): every launch's source addresses one after the other, then every launch's
destination addresses in the same order, then one zeroed counter area of ``1 + sm_slots``
words per launch (the bulk kernel's work counter and per-SM CTA counts). All ``int64``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tiercache.copypaths.segments import Segments, vector_bytes


@dataclass(frozen=True)
class PlannedLaunch:
    """One launch of a plan: ``n`` segments of ``nbytes`` bytes; byte offsets into the table of
    its source addresses (``src``), destination addresses (``dst``) and counters; ``vec``: the
    widest access every address and the length allow."""

    n: int
    nbytes: int
    src: int
    dst: int
    counters: int
    vec: int


def plan_layout(copies: list[tuple[np.ndarray, np.ndarray, int]], sm_slots: int) -> tuple[np.ndarray,
                                                                                          list[PlannedLaunch]]:
    """The table and the launches of ``copies`` (``[(dst_addrs, src_addrs, nbytes)]``, integer
    address arrays of one length each, ``nbytes >= 1``), as the module docstring lays them out.

    Returns:
        (``int64`` table, one :class:`PlannedLaunch` per copy, byte offsets into the table).

    Raises:
        ValueError: arrays of different lengths in a copy, or ``nbytes < 1``.
    """
    srcs, dsts = [], []
    for dst, src, nbytes in copies:
        s = np.ascontiguousarray(src, dtype=np.int64).reshape(-1)
        d = np.ascontiguousarray(dst, dtype=np.int64).reshape(-1)
        if s.size != d.size or nbytes < 1:
            raise ValueError(f"plan_layout: {s.size} sources, {d.size} destinations, nbytes = {nbytes} "
                             "(lengths must match, nbytes >= 1)")
        srcs.append(s)
        dsts.append(d)
    total = sum(s.size for s in srcs)
    words = 1 + sm_slots
    table = np.zeros(2 * total + len(copies) * words, dtype=np.int64)
    launches, at = [], 0
    for j, (s, d, (_, _, nbytes)) in enumerate(zip(srcs, dsts, copies)):
        table[at:at + s.size] = s
        table[total + at:total + at + s.size] = d
        vec = vector_bytes(int(nbytes), int(np.bitwise_or.reduce(s)) if s.size else 0,
                           int(np.bitwise_or.reduce(d)) if d.size else 0)
        launches.append(PlannedLaunch(int(s.size), int(nbytes), 8 * at, 8 * (total + at),
                                      8 * (2 * total + j * words), vec))
        at += s.size
    return table, launches


class SegmentPlan:
    """Launches of :meth:`~tiercache.copypaths.copykernels.CopyLauncher.copy_segments`' kind
    whose table went up in one upload (made by
    :meth:`~tiercache.copypaths.copykernels.CopyLauncher.plan_segments`). Issue each with
    :meth:`launch` (once, in any order, on the stream the plan was made on or one ordered after
    it), then :meth:`done` once after the last: the table's memory is the launcher's upload
    ring's until then, and the launcher must take no other upload and release in between (one
    thread per launcher)."""

    def __init__(self, launcher, table: np.ndarray, launches: list[PlannedLaunch], stream,
                 force: str | None = None) -> None:
        self.launcher = launcher
        self.launches = launches
        self.force = force
        self._base = launcher.ring.upload(table, stream).data.ptr  # async, from pinned memory
        self._done = False

    def launch(self, j: int, stream) -> str:
        """Issue launch ``j`` on ``stream``; returns the path (``bulk`` or ``kernel``)."""
        p, b = self.launches[j], self._base
        if not p.n:
            return "none"
        return self.launcher.launch_table(0, 0, b + p.src, b + p.dst, p.n, b + p.counters,
                                          Segments(1, p.nbytes, p.nbytes), p.vec, stream, self.force)

    def done(self, stream) -> None:
        """The table may be reused once ``stream`` gets here (after every launch issued)."""
        if not self._done:
            self._done = True
            self.launcher.ring.release(stream)
