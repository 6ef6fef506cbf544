"""Writes of whole blocks from the rows of one host buffer, with the per-file Python of a
write request's layout done as arrays.

A row store's store (the vLLM connector's, SGLang's backend's) writes blocks of one pool from
rows of one page-aligned buffer. The general write path (:mod:`tiercache.files.blockbatch`)
takes ``[(key, {pool: buffer})]`` and, per file, looks at the buffer (host or device, its
address, whether it must be staged), builds its final path from the key's text and hash, and
per block hands back a future. Here a request is arrays: each file's data address is the
buffer's base plus its row times the row stride, the final names and subdirectories come
from C (:func:`~tiercache.files.nativeio.block_names`), the header of every file is made by
the C threads (``MAKEHEAD``: the usual header of the key in its final name, with the data's
XXH3-64), and the request settles one :class:`~tiercache.files.blockbatch.Outcome` per chunk.

What follows the layout is the general path's own code
(:meth:`~tiercache.files.blockbatch.BlockBatches.write_files`): the choice of each file's name
(a free file to reuse, or a new temporary file, with the open-file cache's reservations),
the native write, publication or the group commit (``fsync`` ``data`` and ``data+dir``: one
``syncfs`` per request, then the renames), and a failed block's cleanup (none of its files
left). So the format, the guarantees and the failures are the general path's.

Applies where the tier's native engine makes headers (the native XXH3-64), no key of the
request carries extra header metadata, and each row is one block of whole pages, page-aligned
where the tier writes with O_DIRECT; :meth:`~tiercache.files.FileTier.submit_row_writes`
answers None otherwise (then the general path).

Measured: docs/performance/root-arrays.md ("A row store's stores on the row path").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tiercache.files.blockbatch import MAX_CHUNK_FILES, BlockBatches, GroupCommit, Outcome, all_settled, before_io
from tiercache.files.nativeio import MAKEHEAD, SUMONLY
from tiercache.files.rootdir import RootPath


class RowWrites:
    """The row writes of one file tier (built by :class:`~tiercache.files.FileTier` where its
    native engine can make headers: the native XXH3-64).

    Args:
        batches: the tier's native batches (its root, pools, engine, I/O threads, fsync,
            open-file cache).
    """

    def __init__(self, batches: BlockBatches) -> None:
        self.b = batches

    def applies(self, pool: str, rows) -> bool:
        """Whether rows of ``rows`` (2-D host ``uint8``) can give blocks of ``pool`` here
        (:meth:`~tiercache.files.blockbatch.BlockBatches.rows_fit`); or, ``rows`` a
        :class:`~tiercache.files.blockpieces.BlockPieces`, whether its blocks can
        (:meth:`~tiercache.files.blockbatch.BlockBatches.pieces_fit`)."""
        if not isinstance(rows, np.ndarray):
            return self.b.pieces_fit(pool, rows)
        return self.b.rows_fit(pool, rows)

    def submit(self, keys: Sequence, pool: str, rows, row_idx, deps=(), sums: np.ndarray | None = None) -> Outcome:
        """Write ``rows[row_idx[i]]`` as the block of ``keys[i]`` (int or bytes keys) in
        ``pool``; returns the request's :class:`Outcome` (errors by index into ``keys``),
        settled once every block is published (or failed, none of its files left). ``rows``
        must pass :meth:`applies` (rows, or a :class:`~tiercache.files.blockpieces.BlockPieces`:
        block ``row_idx[i]`` of it written from in place) and stay unchanged until then;
        ``deps``: jobs the writes wait for first.

        Errors per block are the general path's (:meth:`FileTier.submit
        <tiercache.files.FileTier.submit>`): the :class:`OSError` of the failed file
        operation, or of the group commit's ``syncfs`` or rename.

        With ``sums`` (``uint64 [len(keys)]``), ``sums[i]`` is the XXH3-64 of block ``i``'s
        data as the caller computed it (on the GPU, where the block was:
        :mod:`tiercache.files.devicehash`): the headers carry it and the C threads do not hash
        the data. A wrong one never passes a read: every read checks the data against it.
        """
        b = self.b
        n = len(keys)
        idx = np.asarray(row_idx, dtype=np.int64)
        if n == 0:
            done = Outcome()
            done.settle({})
            return done
        parts = -(-n // MAX_CHUNK_FILES)
        step = -(-n // parts)
        chunks = [list(range(lo, min(n, lo + step))) for lo in range(0, n, step)]
        items = [(k,) for k in keys]  # what the general path's results read: each block's key
        if b.fsync != "none" and n > 1:  # one syncfs for the request, then the renames (FileTier.submit)
            outcome = Outcome()
            group = GroupCommit(b.dir, b.fsync, list(keys), len(chunks), b.rename_all, b._delete, outcome.settle,
                                b.discard)
            for c in chunks:
                b.queue(outcome, self._chunk, c, items, pool, rows, idx, deps, None, group, sums)
            return outcome
        outcomes = [Outcome() for _ in chunks]
        for c, o in zip(chunks, outcomes):
            b.queue(o, self._chunk, c, items, pool, rows, idx, deps, o, None, sums)
        return all_settled(outcomes)

    def _chunk(self, c: list[int], items: list[tuple], pool: str, rows, idx: np.ndarray, deps,
               outcome: Outcome | None, group: GroupCommit | None, sums: np.ndarray | None = None) -> None:
        """One chunk (a task of the I/O threads): its batch laid out as arrays, then the
        general path's names, write and publication."""
        b = self.b
        errors: dict[int, BaseException] = {}
        staged: dict[int, list] = {}
        try:
            before_io(c[0], deps, 0.0, None)
            lo, hi = c[0], c[-1] + 1
            flags = MAKEHEAD | (0 if sums is None else SUMONLY)
            ops = b.row_ops([items[i][0] for i in c], pool, rows, idx[lo:hi], flags)
            if sums is not None:
                ops.hash[:] = sums[lo:hi]  # what the headers carry (SUMONLY: the data is not hashed)
            assert ops.name_blob is not None and ops.name_off is not None and ops.subs is not None
            raw, texts = ops.name_blob.raw, b.subdirs()[1]
            # the general path's names: the final paths (and below, temporary names) as text
            paths = [RootPath(fd, raw[o:raw.index(b"\0", o)].decode(), None, texts[s])
                     for fd, o, s in zip(ops.dirs.tolist(), ops.name_off.tolist(), ops.subs.tolist())]
            ops.name_blob = ops.name_off = None
            b.write_files(ops, c, paths, c, items, group is None, errors, staged)
        except BaseException as exc:
            b.chunk_failed(c, exc, errors, staged)
        b.settle_chunk(c, errors, staged, outcome, group)
