"""Blocks whose bytes lie in pieces of host memory the caller owns.

A host KV pool keeps a page's K and V apart (SGLang's ``page_first`` layout: two pieces per
page), or each layer's apart (``layer_first``: two per layer). Where a block file holds such a
page, its bytes are the pieces in order. The native engine reads into and writes from the
pieces in place, by vectored I/O, and checksums them as one run
(:meth:`~tiercache.files.nativeio.Ops.set_pieces`): no copy through a staging row.
"""

from __future__ import annotations

import ctypes

import numpy as np

#: the alignment O_DIRECT needs of every piece's address and length
ALIGN = 4096


class BlockPieces:
    """Block ``i`` is ``addresses[i, 0]``, ``addresses[i, 1]``, ... of ``piece_bytes`` bytes
    each, in that order (``block_bytes = k * piece_bytes``).

    Args:
        addresses: ``int64 [n, k]`` host addresses (``k >= 1``). The memory must stay valid,
            and unchanged during a write, until the request using it is settled.
        piece_bytes: bytes of each piece (``>= 1``).

    Raises:
        ValueError: ``addresses`` not 2-D with at least one column, or ``piece_bytes < 1``.
    """

    def __init__(self, addresses, piece_bytes: int) -> None:
        addr = np.ascontiguousarray(addresses, dtype=np.int64)
        if addr.ndim != 2 or addr.shape[1] < 1 or piece_bytes < 1:
            raise ValueError(f"BlockPieces: addresses of shape {addr.shape} (need [n, k], k >= 1), "
                             f"piece_bytes = {piece_bytes} (need >= 1)")
        self.addresses = addr
        self.piece_bytes = int(piece_bytes)
        self.block_bytes = self.piece_bytes * addr.shape[1]
        #: every piece starts on a 4 KiB page and is whole pages: O_DIRECT can use them
        self.aligned = self.piece_bytes % ALIGN == 0 and not bool(np.any(addr % ALIGN))

    def __len__(self) -> int:
        return self.addresses.shape[0]

    def gather(self, i: int) -> np.ndarray:
        """A copy of block ``i``'s bytes (``uint8 [block_bytes]``): for the rare checks in
        Python of a file the native engine did not vouch for."""
        out = np.empty(self.block_bytes, np.uint8)
        for j, a in enumerate(self.addresses[i].tolist()):
            ctypes.memmove(out.ctypes.data + j * self.piece_bytes, a, self.piece_bytes)
        return out

    def zero(self, i: int) -> None:
        """Zero block ``i``'s pieces (a failed load: no unverified byte stays there)."""
        for a in self.addresses[i].tolist():
            ctypes.memset(a, 0, self.piece_bytes)
