"""Reads of whole blocks into the rows of one host buffer, with no Python per block.

A row store's load (the vLLM connector's, SGLang's backend's) reads blocks of one pool into
rows of one page-aligned buffer; the cache's reads into host memory (``get``, ``onboard`` to
the host tier: :meth:`~tiercache.files.FileTier.submit_row_pools`, one request per pool)
read into the rows of the host tier's or the caller's arrays the same way.

The general read path (:mod:`tiercache.files.blockbatch`) takes ``[(key, {pool: buffer})]``
and spends Python per file on each step around the native call: a buffer view's address,
the key's text, hash and file name, the open-file cache, the check flags. Here a request
is arrays: the names and subdirectories come from C
(:func:`~tiercache.files.nativeio.block_names`), each file's data address is the buffer's
base plus its row times the row stride, and the flags and checks are the same for every
file (``CHECK`` and ``HASH``: the C threads vouch for the header, size and XXH3-64 of each).
Python looks only at the files the C threads did not vouch for, with the general path's own check
(:meth:`~tiercache.files.blockbatch.BlockBatches.check_read`), so what a read accepts and how
it fails are the general path's. Files are opened by name (no descriptor of the tier's
open-file cache is used or kept): with the opens in the C threads, an open costs no Python.

Measured: docs/vllm.md ("Row reads, the first load, the array and the disk"), with
``benchmarks/rowstore_load.py``; the cache's reads: docs/performance/root-arrays.md ("The
cache's reads on the row path").
"""

from __future__ import annotations

import threading

import numpy as np

from tiercache.errors import ConfigError, CorruptBlockError
from tiercache.files.blockbatch import MAX_CHUNK_FILES, BlockBatches, Outcome, before_io
from tiercache.files.blockfile import file_size, header_checksum
from tiercache.files.nativeio import CHECK, DIRECT, HASH, HEADER_BYTES, NOT_REGULAR, READ, SUMONLY, error_for


class RowReads:
    """The row reads of one file tier (built by :class:`~tiercache.files.FileTier` where its
    native engine can vouch for reads: ``verify`` on and the native XXH3-64).

    Args:
        batches: the tier's native batches (its root, pools, engine, I/O threads, checks).
    """

    def __init__(self, batches: BlockBatches) -> None:
        self.b = batches

    def applies(self, pool: str, rows) -> bool:
        """Whether rows of ``rows`` (2-D host ``uint8``, writable) can take blocks of ``pool``
        here (:meth:`~tiercache.files.blockbatch.BlockBatches.rows_fit`); or, ``rows`` a
        :class:`~tiercache.files.blockpieces.BlockPieces`, whether its blocks can
        (:meth:`~tiercache.files.blockbatch.BlockBatches.pieces_fit`)."""
        if not isinstance(rows, np.ndarray):
            return self.b.pieces_fit(pool, rows)
        return rows.flags.writeable and self.b.rows_fit(pool, rows)

    def submit(self, keys: list[bytes], pool: str, rows, row_idx, deps=(), sums: np.ndarray | None = None,
               span: tuple[int, int] | None = None) -> Outcome:
        """Read the block of ``keys[i]`` (int or bytes keys) in ``pool`` into ``rows[row_idx[i]]``;
        returns the request's :class:`Outcome` (its errors by index into ``keys``), settled
        once every file is read and checked. ``rows`` must pass :meth:`applies` (rows, or a
        :class:`~tiercache.files.blockpieces.BlockPieces`: block ``row_idx[i]`` of it read in
        place); ``deps``: jobs the reads wait for first.

        Errors per block are the general path's: :class:`FileNotFoundError` for a missing
        file, :class:`~tiercache.errors.CorruptBlockError` for one that does not verify
        (truncated, wrong header, checksum mismatch), other :class:`OSError` s as raised.

        With ``sums`` (``uint64 [len(keys)]``), the C threads check each file's header and size
        but do not hash its data: ``sums[i]`` gets the data checksum its header gives, for the
        caller to compare where the data goes (on the GPU: :mod:`tiercache.files.devicehash`).
        A block Python checks (an unusual header) is verified whole on the host, as without.

        With ``span = (start, length)`` (bytes; ``sums`` required, host rows only) each file's
        header and ``length`` bytes of its data from data byte ``start`` on are read, into the
        same bytes of the row (``rows[r, start:start + length]``; the rest of the row is left
        as it was): one layer group of a block whose file holds every layer. The header and
        the file's size are checked, and ``sums[i]`` gets the whole data's checksum, for the
        caller to compare once every span of the block is in (a missing, truncated or wrong
        file fails here as a whole read does). O_DIRECT where ``start`` and ``length`` are
        multiples of 4 KiB.

        Raises:
            ConfigError: a span outside the block, or without ``sums``, or not into host rows.
        """
        if span is not None:
            start, length = span
            nbytes = self.b.pools[pool].block_nbytes
            if sums is None or not isinstance(rows, np.ndarray) or not (0 <= start and 0 < length
                                                                         and start + length <= nbytes):
                raise ConfigError(f"span {span}: give (start, length) within the {nbytes} bytes of a block, with "
                                 "sums, into host rows")
        idx = np.asarray(row_idx, dtype=np.int64)
        outcome = Outcome()
        n = len(keys)
        if n == 0:
            outcome.settle({})
            return outcome
        parts = -(-n // MAX_CHUNK_FILES)
        step = -(-n // parts)
        left = [parts]
        errors: dict[int, BaseException] = {}
        lock = threading.Lock()

        def chunk(lo: int, hi: int) -> None:
            errs: dict[int, BaseException] = {}
            try:
                before_io(lo, deps, 0.0, None)
                self._read(keys, lo, hi, pool, rows, idx, errs, sums, span)
            except BaseException as exc:
                for i in range(lo, hi):
                    errs.setdefault(i, exc)
            with lock:
                errors.update(errs)
                left[0] -= 1
                last = left[0] == 0
            if last:
                outcome.settle(errors)

        for lo in range(0, n, step):
            self.b.queue(outcome, chunk, lo, min(n, lo + step), read=not deps)
        return outcome

    def _read(self, keys: list[bytes], lo: int, hi: int, pool: str, rows, idx: np.ndarray,
              errors: dict, sums: np.ndarray | None = None, span: tuple[int, int] | None = None) -> None:
        b = self.b
        spec = b.pools[pool]
        ops = b.row_ops(keys[lo:hi], pool, rows, idx[lo:hi], CHECK | (HASH if sums is None else SUMONLY))
        if span is not None:
            start, length = span
            ops.data += np.uint64(start)
            ops.data_len[:] = length
            ops.span_off = np.full(hi - lo, start, np.int64)
            if start % 4096 or length % 4096:  # O_DIRECT reads whole pages
                ops.flags &= np.int32(~DIRECT)
        b.native.run(READ, b.dir.fd, ops)
        if sums is not None:
            sums[lo:hi] = ops.hash
        for j in np.flatnonzero((ops.err != 0) | (ops.verdict == 0)).tolist():
            key = keys[lo + j]
            if span is not None:
                try:  # the header and the size only: the data's checksum is the caller's to compare
                    sums[lo + j] = self._check_span(ops, j, key, spec, b.dir.block_path(key, pool))  # type: ignore[index]
                except BaseException as exc:
                    errors[lo + j] = exc
                continue
            try:  # what the C threads did not vouch for: a header with extra fields, an error
                r = int(idx[lo + j])
                host = rows[r] if isinstance(rows, np.ndarray) else rows.gather(r)
                want = b.check_read(ops, j, key, spec, host, b.dir.block_path(key, pool))
                if sums is not None:
                    sums[lo + j] = want  # verified on the host whole: the data's checksum is the header's
            except BaseException as exc:
                errors[lo + j] = exc

    @staticmethod
    def _check_span(ops, j: int, key: bytes, spec, path) -> int:
        """Python's judgment of a span read the C threads did not vouch for: its error, or its
        header (one with extra fields is parsed here) and the file's size; returns the whole
        data's checksum the header gives."""
        where = str(path)
        code = int(ops.err[j])
        if code:
            exc = error_for(code, where)
            raise (CorruptBlockError(str(exc)) if code == NOT_REGULAR else exc)
        if ops.got[j] < HEADER_BYTES + ops.data_len[j] or ops.file_len[j] != file_size(spec.block_nbytes):
            raise CorruptBlockError(f"{where}: truncated ({int(ops.file_len[j])} bytes, expected "
                                    f"{file_size(spec.block_nbytes)})")
        return header_checksum(ops.heads[j], key, spec, where)
