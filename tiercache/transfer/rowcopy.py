"""One row copy of a transfer: rows of one array to rows of another, as planned views.

A tier array is ``uint8 [num_slots, block_nbytes]``. Reshaped without copying, the same memory
is ``[num_slots * parts, block_nbytes / parts]``: one row per layer of each block (layer-wise
onboarding of a layer-major block) or one row per device block inside a larger host block
(host blocks of ``k`` device blocks). A :class:`RowCopy` moves such rows; the transfer engine
runs a list of them as one job and orders it by tier slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tiercache.copypaths import Segments
from tiercache.errors import SlotRangeError


@dataclass(frozen=True)
class RowCopy:
    """Copy rows ``src_rows`` of ``src`` to rows ``dst_rows`` of ``dst`` (the bytes ``seg``
    names of each row).

    Attributes:
        src, dst: ``uint8`` arrays ``[rows, row_bytes]`` (NumPy or CuPy), C-contiguous.
        src_rows, dst_rows: ``int64`` row indices of equal length.
        seg: the bytes of each row to copy (whole rows or the first tokens).
    """

    src: object
    src_rows: np.ndarray
    dst: object
    dst_rows: np.ndarray
    seg: Segments

    @property
    def nbytes(self) -> int:
        """Bytes this copy moves."""
        return int(self.src_rows.size) * self.seg.nbytes

    def validate(self) -> None:
        """Raises SlotRangeError: rows out of range, lengths that differ, a repeated
        destination row, or a segment longer than a row."""
        if self.src_rows.shape != self.dst_rows.shape:
            raise SlotRangeError(f"{self.src_rows.size} source rows for {self.dst_rows.size} destination rows")
        for name, arr, rows in (("source", self.src, self.src_rows), ("destination", self.dst, self.dst_rows)):
            if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= arr.shape[0]):
                bad = int(rows.min()) if int(rows.min()) < 0 else int(rows.max())
                raise SlotRangeError(f"{name} row {bad} outside [0, {arr.shape[0]})")
            if self.seg.segs * self.seg.seg_stride > arr.shape[1]:
                raise SlotRangeError(f"{name} rows of {arr.shape[1]} bytes are shorter than the copy "
                                     f"({self.seg.segs} x {self.seg.seg_stride} bytes)")
        if np.unique(self.dst_rows).size != self.dst_rows.size:
            raise SlotRangeError("a destination row appears twice in one copy")


def row_view(arr, parts: int):
    """``arr`` (``[n, row_bytes]``) viewed as ``[n * parts, row_bytes / parts]`` (no copy)."""
    n, row = arr.shape
    if row % parts:
        raise SlotRangeError(f"rows of {row} bytes do not split into {parts} equal parts")
    return arr.reshape(n * parts, row // parts)
