"""Layer-wise loads of the vLLM connector (``layer_groups``): a prefix read from its files one
layer group at a time, each group sent up into vLLM's paged blocks before the first layer that
attends to it, while the layers before it compute.

A block file holds every layer's part of one block, in layer order (:func:`~tiercache.
integrations.vllmconnector.block_views`), so a group of consecutive layers is one byte span of
each file. A load's tiles, group by group (``[group, piece of blocks]``), are read by the native
engine's span reads (:meth:`RowStore.submit_load(..., span=...)
<tiercache.rowstore.RowStore.submit_load>`) into the group's bytes of a ring of pinned slabs,
as far ahead as free slab columns allow; ``wait_for_layer_load(layer)`` (vLLM calls it before
each attention layer) lands every tile of the groups up to that layer's: one pitched copy up of
the tile into a device slab and one launch of the copy kernel into its blocks' pages, on the
engine's stream, so vLLM's kernels of that layer are ordered after them.

A file's checksum covers all its layers, so a block is verified only once its last group is
in: its pages are gathered back into the device slab and hashed on the GPU
(:mod:`tiercache.files.devicehash`) right after the last group's upload, and compared at the
step's end (``wait_for_save``). A block that fails (read error, or a checksum that does not
match) is a load error of it and the blocks after it. Its layers have been computed on by then;
this is safe only where vLLM drops that step's output for the request and recomputes (its
synchronous scheduling, which ``layer_groups`` requires: with async scheduling the next step is
already scheduled from the token; docs/vllm.md, "What changed from the first version", 1), and
the connector does not store what the step computed over it (``_drop_failed_stores``).

Should vLLM never call ``wait_for_layer_load`` for a load (a model whose attention layers are not
wrapped), the groups land at the step's end, after the forward pass read the blocks: every block
of that load is then a load error (recomputed) and later loads are whole-block ones.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import numpy as np
import torch

log = logging.getLogger("tiercache")


class LayerGroups:
    """The KV cache's layers (in vLLM's forward order) in ``groups`` groups of consecutive
    layers, each one byte span of a block's row.

    Args:
        layer_regions: per layer name (in forward order), the indices of its regions in the
            row (the worker's views).
        row_offsets: ``int64 [regions]`` byte offset of each region in a row.
        sizes: ``int64 [regions]`` bytes of each region.
        groups: how many groups (at most one per layer; at least 2).

    Raises:
        ValueError: a group's regions that are not one contiguous span of the row.
    """

    def __init__(self, layer_regions: list[tuple[str, list[int]]], row_offsets: np.ndarray, sizes: np.ndarray,
                 groups: int) -> None:
        n = len(layer_regions)
        groups = max(1, min(groups, n))
        bounds = [round(i * n / groups) for i in range(groups + 1)]
        self.spans: list[tuple[int, int]] = []
        self.regions: list[np.ndarray] = []
        self.group_of: dict[str, int] = {}
        for g in range(groups):
            members = layer_regions[bounds[g]:bounds[g + 1]]
            regions = np.array(sorted({r for _, rs in members for r in rs}), dtype=np.int64)
            lo = int(row_offsets[regions].min())
            hi = int((row_offsets[regions] + sizes[regions]).max())
            if int(sizes[regions].sum()) != hi - lo:
                raise ValueError(f"layer group {g}: its regions are not one span of the row")
            self.spans.append((lo, hi))
            self.regions.append(regions)
            for name, _ in members:
                self.group_of[name] = g

    def __len__(self) -> int:
        return len(self.spans)


class LayerwiseLoad:
    """One step's synchronous loads (``transfers``), read and sent up layer group by layer
    group (see the module docstring). Made by ``ConnectorWorker.load`` in ``start_load_kv``;
    :meth:`land` from ``wait_for_layer_load``; :meth:`finish` at the step's end."""

    def __init__(self, worker: Any, transfers: list) -> None:
        self.w = worker
        self.groups: LayerGroups = worker.layer_groups
        self.transfers = transfers
        self.keys = [k for t in transfers for k in t.keys]
        self.ids = [b for t in transfers for b in t.block_ids]
        self.t0 = time.perf_counter()
        self.exposed = 0.0  # seconds the engine's thread spent here (what the load costs it)
        n, piece = len(self.keys), worker.piece
        self.tiles = [(g, lo) for g in range(len(self.groups)) for lo in range(0, n, piece)]
        self.pieces = -(-n // piece)
        self.sums = np.zeros(n, dtype=np.uint64)  # the headers' checksums (the first group's reads)
        self.failed: dict[int, BaseException] = {}  # by index into keys
        self.submitted = 0
        self.landed = 0  # tiles landed
        self.landed_group = -1
        self.inflight: collections.deque = collections.deque()  # (tile, job id)
        self.col_events: dict[tuple[int, int], Any] = {}  # (slab, group) -> its last upload
        self.col_last: dict[tuple[int, int], int] = {}  # (slab, group) -> the last tile read into them
        self.waited = False
        self.dev_sums = torch.zeros(n, dtype=torch.int64, device=worker.device) if worker.hasher is not None else None
        self.hashed_ev: Any = None
        self._submit(block=False)
        self.exposed += time.perf_counter() - self.t0

    # -- reads ------------------------------------------------------------------------------
    def _slab(self, tile: int) -> int:
        return (tile % self.pieces) % self.w.load_slabs

    def _submit(self, block: bool) -> None:
        """Submit the next tiles' reads while their slab columns are free (``block``: wait for
        the next one's columns, where nothing is in flight)."""
        w = self.w
        while self.submitted < len(self.tiles):
            t = self.submitted
            g, lo = self.tiles[t]
            slab = self._slab(t)
            last = self.col_last.get((slab, g))
            if last is not None and last >= self.landed:
                return  # the tile read into these columns before is not even sent up yet
            ev = self.col_events.get((slab, g))
            if ev is not None and not ev.query():
                if not (block and not self.inflight):
                    return
                ev.synchronize()  # that tile's upload (on the engine's stream) is done
            self.col_last[(slab, g)] = t
            keys = self.keys[lo:lo + w.piece]
            a, b = self.groups.spans[g]
            sums = self.sums[lo:lo + len(keys)] if g == 0 else np.zeros(len(keys), dtype=np.uint64)
            jid = w._submit(w.store.submit_load, keys, slab * w.piece, sums=sums, span=(a, b - a))
            self.inflight.append((t, jid, sums))
            self.submitted += 1

    # -- landing ----------------------------------------------------------------------------
    def land(self, group: int) -> None:
        """Land every tile of the groups up to ``group`` (read, sent up into their pages on the
        engine's stream); after the last one, enqueue the blocks' checksums."""
        t0 = time.perf_counter()
        self.waited = True
        w = self.w
        while self.landed_group < group:
            if not self.inflight:
                self._submit(block=True)
            t, jid, sums = self.inflight.popleft()
            res = w._wait(jid)
            g, lo = self.tiles[t]
            keys = self.keys[lo:lo + w.piece]
            for i, k in enumerate(keys):
                if k in res.failed:
                    self.failed.setdefault(lo + i, res.failed[k])
                elif g and sums[i] != self.sums[lo + i] and (lo + i) not in self.failed:
                    from tiercache.errors import CorruptBlockError

                    self.failed[lo + i] = CorruptBlockError(f"block {k.hex()}: its header changed between spans")
            self._upload(t, self._slab(t), g, self.ids[lo:lo + len(keys)])
            self.landed += 1
            if self.landed % self.pieces == 0:
                self.landed_group += 1
            self._submit(block=False)
            if self.landed == len(self.tiles):
                self._hash()
        self.exposed += time.perf_counter() - t0

    def _upload(self, tile: int, slab: int, g: int, ids: list[int]) -> None:
        w = self.w
        a, b = self.groups.spans[g]
        width, m, row0 = b - a, len(ids), slab * w.piece
        regions = self.groups.regions[g]
        if not w.cuda:
            src = w.staging[row0:row0 + m]
            idx = torch.tensor(ids, dtype=torch.long)
            for r in regions.tolist():
                off = int(w.row_offsets[r])
                w.views[r].index_copy_(0, idx, src[:, off:off + int(w.view_sizes[r])])
            return
        import cupy

        stream = torch.cuda.current_stream(w.device)
        cs = w._cupy(stream)
        dev = w.dev_load.data_ptr()
        host = w.staging.data_ptr() + row0 * w.row_bytes + a
        cupy.cuda.runtime.memcpy2DAsync(dev, width, host, w.row_bytes, width, m,
                                        cupy.cuda.runtime.memcpyHostToDevice, cs.ptr)
        ev = torch.cuda.Event()
        ev.record(stream)
        self.col_events[(slab, g)] = ev  # the slab's columns of this group may take the next tile
        for size, pages, staged in w._segments(dev, ids, regions=regions, stride=width, origin=a):
            path = w.launcher.copy_segments(pages, staged, size, cs, w._force) if w.launcher is not None else None
            if path is None:
                raise RuntimeError("layer-wise loads need the project's copy kernels")
            w.counters[f"segment_copies_{path}"] += 1

    def _hash(self) -> None:
        """Every group is up: the blocks' pages, gathered back a piece at a time into the device
        slab, hashed on the GPU (enqueued on the engine's stream; compared in :meth:`finish`)."""
        w = self.w
        if self.dev_sums is None:
            return
        stream = torch.cuda.current_stream(w.device)
        cs = w._cupy(stream)
        with torch.cuda.stream(stream):
            for lo in range(0, len(self.ids), w.piece):
                ids = self.ids[lo:lo + w.piece]
                w._device_copy(w.dev_load, ids, stream, to_pages=False, launcher=w.launcher)
                w.hasher.hash_rows(w.dev_load[:len(ids)], self.dev_sums[lo:lo + len(ids)], cs)
            ev = torch.cuda.Event()
            ev.record(stream)
            self.hashed_ev = ev

    # -- the step's end ---------------------------------------------------------------------
    def finish(self) -> list[int | None]:
        """Land what is left, compare every block's checksum; returns per transfer the first
        block that failed (None: all loaded)."""
        t0 = time.perf_counter()
        late = not self.waited
        self.land(len(self.groups) - 1)
        bad = set(self.failed)
        n = len(self.keys)
        if self.dev_sums is not None:
            self.hashed_ev.synchronize()
            got = self.dev_sums.cpu().numpy().view(np.uint64)
            mismatched = [i for i in np.flatnonzero(got != self.sums).tolist() if i not in bad]
            self.w.counters["gpu_checked_blocks"] += n - len(bad)
        else:  # the host's check: the pages' bytes gathered back into rows
            mismatched = [i for i in range(n) if i not in bad and self._host_sum(i) != int(self.sums[i])]
        if mismatched:
            errors = self.w.store.reject([self.keys[i] for i in mismatched], "data checksum mismatch after a "
                                         "layer-wise load")
            self.w.counters["gpu_checksum_mismatches" if self.dev_sums is not None else "checksum_mismatches"] += \
                len(mismatched)
            for i in mismatched:
                self.failed[i] = errors[self.keys[i]]
        out: list[int | None] = []
        lo = 0
        for t in self.transfers:
            first = min((i - lo for i in self.failed if lo <= i < lo + len(t.keys)), default=None)
            if late:  # the forward pass read the blocks before they were in
                first = 0
            if first is not None and first < len(t.keys):
                k = t.keys[first]
                log.warning("tiercache: vLLM connector: block %s could not be loaded layer-wise (%s); vLLM "
                            "recomputes from there", k.hex(), self.failed.get(lo + first, "its layers were not "
                                                                          "waited for"))
            out.append(first)
            lo += len(t.keys)
        self.exposed += time.perf_counter() - t0
        return out

    def _host_sum(self, i: int) -> int:
        import xxhash

        w = self.w
        idx = torch.tensor([self.ids[i]], dtype=torch.long, device=w.device)
        row = np.concatenate([v.index_select(0, idx).cpu().numpy().reshape(-1) for v in w.views])
        return xxhash.xxh3_64_intdigest(row.tobytes())
