"""Timing of one benchmark stage: bandwidth, rate and latency percentiles."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class StageStats:
    """One stage of a benchmark: ``blocks`` blocks of ``nbytes`` bytes in total, moved in
    requests whose completion latencies (seconds) are ``latencies``; ``seconds`` is the wall
    time of the whole stage.

    Attributes:
        name: stage name (``"host -> file"``).
        path: the copy/I-O path that ran (``"cudaMemcpyAsync"``, ``"POSIX"``, ``"kvikio compat"``...).
    """

    name: str
    path: str
    blocks: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    request_blocks: int = 1

    @property
    def gbps(self) -> float:
        """Bandwidth in GB/s (10^9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def blocks_per_s(self) -> float:
        return self.blocks / self.seconds if self.seconds > 0 else 0.0

    def percentile_ms(self, q: float) -> float:
        """Latency percentile ``q`` (0..100) of the requests, in milliseconds."""
        if not self.latencies:
            return 0.0
        return float(np.percentile(np.asarray(self.latencies), q)) * 1e3

    def as_dict(self) -> dict:
        return {
            "stage": self.name,
            "path": self.path,
            "blocks": self.blocks,
            "bytes": self.nbytes,
            "seconds": self.seconds,
            "gb_per_s": self.gbps,
            "mib_per_s": self.nbytes / self.seconds / 2**20 if self.seconds > 0 else 0.0,
            "blocks_per_s": self.blocks_per_s,
            "request_blocks": self.request_blocks,
            "lat_ms": {"p50": self.percentile_ms(50), "p99": self.percentile_ms(99),
                       "max": max(self.latencies, default=0.0) * 1e3},
        }
