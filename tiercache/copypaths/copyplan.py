"""Copy planning: turn (source slot, destination slot) pairs into runs of consecutive slots.

A run where both the source and the destination slots are consecutive becomes one copy of
``length * block_nbytes`` bytes instead of ``length`` copies. Planning is vectorized (NumPy):
no Python loop per block.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Runs(NamedTuple):
    """Runs of consecutive slots: copy ``length[i]`` blocks from ``src[i]`` to ``dst[i]``."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray


def contiguous_runs(src_slots, dst_slots) -> Runs:
    """Split paired slot lists into maximal runs that are consecutive on both sides.

    Args:
        src_slots, dst_slots: equal-length 1-D integer sequences.

    Returns:
        :class:`Runs`; ``length.sum() == len(src_slots)``.
    """
    src = np.asarray(src_slots, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_slots, dtype=np.int64).reshape(-1)
    if src.shape != dst.shape:
        raise ValueError(f"{src.size} source slots but {dst.size} destination slots")
    n = src.size
    if n == 0:
        empty = np.empty(0, dtype=np.int64)
        return Runs(empty, empty, empty)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [n]))
    return Runs(src[starts], dst[starts], ends - starts)


def memcpy_runs(runs: Runs, row: int, memcpy_min_bytes: int, batch_min_bytes: int) -> np.ndarray:
    """Which runs go to one ``cudaMemcpyAsync`` each: runs of at least ``memcpy_min_bytes``
    (``row``-byte blocks), except single blocks that the batched driver copy takes anyway
    (``row >= batch_min_bytes``). One call per block is the naive loop (92-95% of contiguous for
    2 MiB blocks on an H100, against 99% for the batched copy over two streams), so a threshold
    calibrated on runs of small blocks (``tiercache calibrate``: 2 MiB) cannot send scattered
    2 MiB blocks there. Returns a boolean mask over the runs."""
    big = runs.length.astype(np.int64) * row >= memcpy_min_bytes
    if row >= batch_min_bytes:
        big &= runs.length >= 2
    return big
