"""What the transfer engine moved: per (source tier, destination tier, copy path) totals and a
latency histogram, recorded once per finished job.

The totals are plain integers and the histogram a fixed list of bucket counts (Prometheus'
cumulative ``le`` buckets are built from them when exported, :mod:`tiercache.metrics`), so
recording costs one dictionary lookup, a few additions and one ``bisect`` per job (not per
block), under a lock of its own.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

#: upper bounds (seconds) of the latency buckets of one job: 10 us (a small host copy) to 10 s
#: (a large batch of files); a last, unbounded bucket follows
LATENCY_BUCKETS_S: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


@dataclass
class PathTotals:
    """Totals of the jobs of one (src, dst, path).

    Attributes:
        jobs: finished jobs.
        blocks, nbytes: blocks and bytes copied (failed blocks excluded; partial copies count
            the tokens copied).
        failed_blocks: blocks whose copy failed (I/O error, checksum, a failed source).
        seconds_sum: total job time (seconds: CUDA event time for GPU jobs, wall time of the
            file operations for file jobs).
        buckets: job count per latency bucket, ``len(LATENCY_BUCKETS_S) + 1`` (the last one
            unbounded); not cumulative.
    """

    jobs: int = 0
    blocks: int = 0
    nbytes: int = 0
    failed_blocks: int = 0
    seconds_sum: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))

    def describe(self) -> dict:
        return {"jobs": self.jobs, "blocks": self.blocks, "bytes": self.nbytes, "failed_blocks": self.failed_blocks,
                "seconds_sum": self.seconds_sum, "buckets": list(self.buckets)}


class TransferStats:
    """Per (src, dst, path) totals of finished jobs (:class:`PathTotals`); thread-safe.

    Tier names are ``device``, ``host``, ``file`` and ``caller`` (the caller's arrays, for
    ``put``/``get``); paths are :attr:`JobResult.path <tiercache.transfer.jobs.JobResult.path>`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[tuple[str, str, str], PathTotals] = {}

    def record(self, src: str, dst: str, path: str, blocks: int, nbytes: int, failed: int, seconds: float) -> None:
        """Count one finished job: ``blocks``/``nbytes`` copied, ``failed`` blocks failed, in
        ``seconds``."""
        i = bisect.bisect_left(LATENCY_BUCKETS_S, seconds)
        with self._lock:
            t = self._totals.get((src, dst, path))
            if t is None:
                t = self._totals[(src, dst, path)] = PathTotals()
            t.jobs += 1
            t.blocks += blocks
            t.nbytes += nbytes
            t.failed_blocks += failed
            t.seconds_sum += seconds
            t.buckets[i] += 1

    def snapshot(self) -> list[dict]:
        """A JSON-ready copy: one dict per (src, dst, path) with the :class:`PathTotals`
        fields (``bytes`` for ``nbytes``), sorted by those three names."""
        with self._lock:
            items = sorted(self._totals.items())
            return [{"src": s, "dst": d, "path": p, **t.describe()} for (s, d, p), t in items]
