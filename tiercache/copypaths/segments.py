"""Which bytes of each block a copy moves: whole blocks, or the first tokens of each.

A copy of the first ``num_tokens`` tokens of a KV block is ``segs`` segments of ``seg_bytes``
bytes, ``seg_stride`` apart (one segment for token-major blocks, one per layer and K/V for
layer-major ones). Every copy path takes a :class:`Segments`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tiercache.errors import ArrayMismatchError
from tiercache.geometry import PoolSpec


@dataclass(frozen=True)
class Segments:
    """Which bytes of each block a copy moves: ``segs`` segments of ``seg_bytes`` bytes at
    ``r * seg_stride``, r < segs."""

    segs: int
    seg_stride: int
    seg_bytes: int

    @property
    def nbytes(self) -> int:
        """Bytes moved per block."""
        return self.segs * self.seg_bytes


def segments_for(pool: PoolSpec, num_tokens: int | None) -> Segments:
    """The segments of a copy of the first ``num_tokens`` tokens (None: the whole block).

    ``num_tokens >= tokens_per_block`` is a whole-block copy; 0 copies nothing.

    Raises:
        ArrayMismatchError: ``num_tokens`` negative, or the pool has no token axis.
    """
    if num_tokens is None:
        return Segments(1, pool.block_nbytes, pool.block_nbytes)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
        raise ArrayMismatchError(f"num_tokens = {num_tokens!r} must be an integer >= 0")
    if pool.token_axis is None:
        raise ArrayMismatchError(
            f"pool {pool.name!r} has no token axis (a plain block_shape pool); partial copies need "
            "a KV pool (PoolSpec.kv with layout layer_major or token_major)"
        )
    tpb = pool.block_shape[pool.token_axis]
    if num_tokens >= tpb:
        return Segments(1, pool.block_nbytes, pool.block_nbytes)
    outer = math.prod(pool.block_shape[: pool.token_axis])
    inner = math.prod(pool.block_shape[pool.token_axis + 1:]) * pool.itemsize
    if outer == 1:
        return Segments(1, tpb * inner, num_tokens * inner)
    return Segments(outer, tpb * inner, num_tokens * inner)


def vector_bytes(*values: int) -> int:
    """The widest access (16, 8, 4 or 1 bytes) that divides every one of ``values`` (addresses,
    strides, lengths): what the copy kernels may use without misaligned accesses."""
    for v in (16, 8, 4):
        if all(x % v == 0 for x in values):
            return v
    return 1
