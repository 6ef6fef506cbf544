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


def strided_runs(src_addr, dst_addr, row: int) -> tuple[Runs, np.ndarray, np.ndarray]:
    """Split paired row addresses into runs that one 2-D copy moves each: rows ``row`` bytes
    apart on one side whose partners step by one constant pitch (at least ``row`` bytes) on
    the other. First runs of consecutive destination rows (a host block's rows going to
    consecutive device rows), then, among the rows left alone, runs of consecutive source
    rows (one host block's rows going to rows a constant pitch apart).

    Args:
        src_addr, dst_addr: equal-length 1-D integer sequences of row addresses (bytes).
        row: bytes per row (> 0).

    Returns:
        ``(runs, src_pitch, dst_pitch)``: :class:`Runs` of addresses (``src`` and ``dst``
        hold each run's first row, ``length`` its rows) and each run's pitches in bytes.
    """
    src = np.asarray(src_addr, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_addr, dtype=np.int64).reshape(-1)
    if src.shape != dst.shape:
        raise ValueError(f"{src.size} source rows but {dst.size} destination rows")
    out = []  # (src, dst, length, src pitch, dst pitch)
    alone = []
    for d0, s0, m, pitch in _pitched(dst.tolist(), src.tolist(), row):
        if m > 1:
            out.append((s0, d0, m, pitch, row))
        else:
            alone.append((s0, d0))
    for s0, d0, m, pitch in _pitched([a for a, _ in alone], [b for _, b in alone], row):
        out.append((s0, d0, m, row, pitch))
    cols = [np.asarray(c, dtype=np.int64) for c in zip(*out)] if out else [np.empty(0, dtype=np.int64)] * 5
    return Runs(cols[0], cols[1], cols[2]), cols[3], cols[4]


def _pitched(a: list, b: list, row: int):
    """Maximal runs, in ``a`` order, where ``a`` steps by ``row`` and ``b`` by one constant
    pitch >= ``row``: yields ``(a0, b0, length, pitch of b)``."""
    order = sorted(range(len(a)), key=a.__getitem__)
    a = [a[i] for i in order]
    b = [b[i] for i in order]
    i, n = 0, len(a)
    while i < n:
        j = i + 1
        pitch = b[j] - b[i] if j < n else row
        if j < n and a[j] - a[i] == row and pitch >= row:
            while j < n and a[j] - a[j - 1] == row and b[j] - b[j - 1] == pitch:
                j += 1
        else:
            pitch = row
        yield a[i], b[i], j - i, pitch
        i = j
