"""The transfer engine: asynchronous, ordered copies between tiers.

- :mod:`.engine`: :class:`TransferEngine`: jobs by slot or by row views, over the copy paths
  (:mod:`tiercache.copypaths`) and the file tier's I/O threads;
- :mod:`.ordering`: the per-slot ledger of pending readers and writers (RAW, WAR, WAW);
- :mod:`.jobs`: :class:`Job` / :class:`JobResult` (poll, wait, stream waits, bytes, seconds);
- :mod:`.transferstats`: :class:`TransferStats`: blocks, bytes, failures and a latency
  histogram per source, destination and copy path, counted once per finished job;
- :mod:`.rowcopy`: row views of tier arrays (a device block inside a host block, one layer);
- :mod:`.carveout`: :func:`sm_carveout`, PyTorch's cuBLASLt SM carve-out for copies beside
  compute.

Depends on :mod:`tiercache.copypaths`, :mod:`tiercache.files`, :mod:`tiercache.memory`.
"""

from .carveout import sm_carveout
from .engine import PreparedRows, TransferEngine
from .jobs import Job, JobResult
from .rowcopy import RowCopy, row_view
from .transferstats import LATENCY_BUCKETS_S, PathTotals, TransferStats

__all__ = [
    "Job",
    "JobResult",
    "LATENCY_BUCKETS_S",
    "PathTotals",
    "PreparedRows",
    "RowCopy",
    "TransferEngine",
    "TransferStats",
    "row_view",
    "sm_carveout",
]
