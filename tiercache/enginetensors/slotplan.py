"""Planning copies between the engine's device blocks and tiercache's host blocks.

A host block holds ``k`` device blocks (``blocks_per_host_block``; 1 by default). Callers
give, per key, the ``k`` device block ids it spans, ``-1`` where a position is empty (the
first and last host blocks of a sequence are often partial). The host tier's array of a pool,
``uint8 [host_slots, k * block_nbytes]``, is viewed as ``[host_slots * k, block_nbytes]``:
position ``j`` of host slot ``h`` is row ``h * k + j``. Layers split rows further
(:func:`tiercache.transfer.rowcopy.row_view`). Everything here is vectorized NumPy.
"""

from __future__ import annotations

import numpy as np

from tiercache.copypaths import segments_for
from tiercache.enginetensors.devicepools import DevicePools, LayerPart
from tiercache.errors import SlotRangeError
from tiercache.transfer import RowCopy, row_view


def device_slot_matrix(device_slots, n: int, k: int, num_blocks: int) -> np.ndarray:
    """``device_slots`` as an ``int64 [n, k]`` matrix (``-1``: no device block there).

    Accepts ``[n]`` when ``k == 1``.

    Raises:
        SlotRangeError: wrong shape, an id outside ``[-1, num_blocks)``, or a key with no
            device block at all.
    """
    arr = np.asarray(device_slots, dtype=np.int64)
    if arr.ndim == 1 and k == 1:
        arr = arr.reshape(-1, 1)
    if arr.shape != (n, k):
        want = f"[{n}]" + (f" or [{n}, 1]" if k == 1 else f" x {k}")
        raise SlotRangeError(f"device_slots of shape {list(arr.shape)} for {n} keys; expected {want} "
                             f"(blocks_per_host_block = {k}; -1 marks an empty position)")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < -1 or hi >= num_blocks:
            bad = lo if lo < -1 else hi
            raise SlotRangeError(f"device block id {bad} outside [0, {num_blocks}) (-1 marks an empty position)")
        empty = np.flatnonzero((arr < 0).all(axis=1))
        if empty.size:
            raise SlotRangeError(f"key #{int(empty[0])} has no device block (every position is -1)")
    return arr


def masks_of(dev: np.ndarray) -> np.ndarray:
    """Per key, the bit mask of the positions that hold a device block (bit ``j``: position
    ``j``)."""
    weights = np.left_shift(np.int64(1), np.arange(dev.shape[1], dtype=np.int64))
    return ((dev >= 0).astype(np.int64) * weights).sum(axis=1)


def plan_device_host(pools: DevicePools, host_arrays: dict, k: int, dev: np.ndarray, host_slots: np.ndarray,
                     to_device: bool, layerwise: bool, num_tokens: int | None):
    """Row copies between device blocks ``dev`` (``[n, k]``) and host slots ``host_slots``
    (``[n]``), one group per layer when ``layerwise`` (else one group).

    Returns:
        ``(groups, device_ledger_slots, host_ledger_slots)``: the ledger pairs, one per device
        block moved.

    Raises:
        SlotRangeError: onboarding two positions into one device block.
        ArrayMismatchError: ``num_tokens`` on a pool without a token axis.
    """
    i, j = np.nonzero(dev >= 0)
    dev_rows = dev[i, j]
    host_units = host_slots[i] * k + j
    if to_device and np.unique(dev_rows).size != dev_rows.size:
        vals, counts = np.unique(dev_rows, return_counts=True)
        raise SlotRangeError(f"device block {int(vals[counts > 1][0])} appears twice as a destination")
    if layerwise:
        layers = pools.layers
    else:
        layers = [[LayerPart(s.name, 1, 0, s) for s in pools.specs]]
    groups = []
    for layer in layers:
        group = []
        for part in layer:
            d_arr = row_view(pools.raw(part.pool), part.parts)
            h_arr = row_view(row_view(host_arrays[part.pool], k), part.parts)
            d_rows = dev_rows * part.parts + part.index
            h_rows = host_units * part.parts + part.index
            seg = segments_for(part.spec, num_tokens)
            if to_device:
                group.append(RowCopy(h_arr, h_rows, d_arr, d_rows, seg))
            else:
                group.append(RowCopy(d_arr, d_rows, h_arr, h_rows, seg))
        groups.append(group)
    return groups, dev_rows, host_slots[i]
