"""Checking a root's block files at the disk's speed: what ``tiercache verify`` and ``purge`` run.

A block file is checked against itself (:func:`~tiercache.files.rootsurvey.verify_file` says
what that means: a regular file, its header naming its key and pool, its exact size, the
XXH3-64 of its data). Checking them one Python call at a time stops far below the disk for
small blocks (measured in docs/performance.md, "Opening a root of a million blocks"), so here
chunks of files go to the native engine (``kernels/blockio.c``) in one call each: open without
following a symlink, ``fstat`` (regular files only; a file whose size changed since the survey
is checked again on its own), one vectored read of header page and data,
XXH3-64 of the data in the C threads, close. Several Python threads submit chunks at once (each
drives its own io_uring ring, or hands files to the C pool's threads), and Python only checks
each header: by byte comparison with the usual header of the file's key in its pool (the pool's
geometry is learnt from the first of its files that decodes), the full JSON parse only where
that comparison fails. Where the native library cannot be built here, files go through
:func:`verify_file` on the same threads.

``purge`` deletes only files whose header is tiercache's and names the file's key and pool: it
reads header pages only, in the same chunks (:func:`own_entries`), and unlinks with native
calls too (:func:`unlink_all`: a run per subdirectory, so that the unlinks of different
subdirectories, each under its own directory lock, proceed together; :func:`delete_own`, for
``purge --yes``: each chunk's own files unlinked by the thread that read its headers).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple

import numpy as np

from tiercache.errors import ConfigError, CorruptBlockError
from tiercache.files.batchio import HASH, NOT_REGULAR, READ, UNLINK, NativeIO, Ops, choose_engine, native_hash
from tiercache.files.blockfile import DATA_OFFSET, checksum, decode_header, file_size, header_checksum
from tiercache.files.rootdir import RootDir, RootPath
from tiercache.files.rootsurvey import FileEntry, entry_path, is_own_block_file, verify_file
from tiercache.geometry import PoolSpec

#: files per native call, and data bytes per call (a chunk ends at whichever comes first)
CHUNK_FILES = 256
CHUNK_BYTES = 32 << 20


def _chunks(entries: list[FileEntry], size_of: Callable[[FileEntry], int] | None = None) -> list[list[FileEntry]]:
    """``entries`` in inode order (the file system's inode tables, and mostly its data, read
    in order: in name order a cold root of a million files checked 3.5x slower), cut into
    chunks of at most :data:`CHUNK_FILES` files and, where whole files are read (``size_of``:
    the bytes to read of each), :data:`CHUNK_BYTES` bytes (a larger file is a chunk of its own)."""
    out: list[list[FileEntry]] = []
    cur: list[FileEntry] = []
    size = 0
    for e in sorted(entries, key=lambda e: (e.ino, e.dir, e.name)):
        n = size_of(e) if size_of is not None else 0
        if cur and (len(cur) >= CHUNK_FILES or size + n > CHUNK_BYTES):
            out.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += n
    if cur:
        out.append(cur)
    return out


class _Results(NamedTuple):
    """A chunk's per-file results: errno (or NOT_REGULAR), bytes read, file size, XXH3-64 of
    the data (lists), and the header pages (``uint8 [n, 4096]``)."""

    err: list[int]
    got: list[int]
    file_len: list[int]
    hash: list[int]
    heads: np.ndarray


class _Checker:
    """Checks chunks of files with one native engine; learns each pool's geometry."""

    def __init__(self, rd: RootDir, native: NativeIO) -> None:
        self.rd = rd
        self.native = native
        self.hash = native_hash()
        self._pools: dict[str, PoolSpec] = {}
        self._dirs: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    def _learn(self, name: str, header) -> None:
        """Remember pool ``name``'s geometry from a file's decoded ``header`` (the first one)."""
        with self._lock:
            if name in self._pools:
                return
            try:
                pool = PoolSpec(name, tuple(header.block_shape), header.dtype)
            except ConfigError:  # a geometry PoolSpec refuses: such files get the full parse
                return
            if pool.block_nbytes == header.nbytes:
                self._pools[name] = pool

    def dir_fd(self, sub: str) -> int:
        """The descriptor of block subdirectory ``sub`` (``""``: the root), opened once."""
        fd = self._dirs.get(sub)
        if fd is None:
            fd = self._dirs[sub] = (self.rd.subdir(sub) if sub else self.rd).fd
        return fd

    def chunk(self, files: list[FileEntry], whole: bool = True) -> list[tuple[FileEntry, str | None]]:
        """``(entry, problem)`` for each bad file of ``files`` (one native call); with
        ``whole`` False only header pages are read and every file is returned, its problem
        None where its header is tiercache's and names its key and pool."""
        n = len(files)
        ops = Ops(n, self.native.heads(n))
        lens = (np.fromiter((max(self.size(e) - DATA_OFFSET, 0) for e in files), np.int64, n) if whole
                else np.zeros(n, np.int64))
        offs = np.zeros(n, np.int64)
        np.cumsum(lens[:-1], out=offs[1:])
        staging = np.empty(max(int(lens.sum()), 1), np.uint8)
        ops.names = [e.name.encode() for e in files]
        ops.dirs = np.fromiter((self.dir_fd(e.dir) for e in files), np.int32, n)
        ops.data[:] = np.uint64(staging.ctypes.data) + offs.astype(np.uint64)
        ops.data_len[:] = lens
        if self.hash and whole:
            ops.flags |= HASH
        self.native.run(READ, self.rd.fd, ops)
        # per-file values as Python lists (one conversion per chunk, not a NumPy scalar per field)
        r = _Results(ops.err.tolist(), ops.got.tolist(), ops.file_len.tolist(), ops.hash.tolist(), ops.heads)
        for j, e in enumerate(files):
            if e.size < 0 and not r.err[j]:  # listed without a stat: the size its file had when read
                e.size = r.file_len[j]
        if not whole:
            return [(e, self._header(e, r, j)[0]) for j, e in enumerate(files)]
        out = []
        for j, (e, off, size) in enumerate(zip(files, offs.tolist(), lens.tolist())):
            problem = self._check(e, r, j, staging, off, size)
            if problem:
                out.append((e, problem))
        return out

    def _header(self, e: FileEntry, r: _Results, j: int) -> tuple[str | None, int, int]:
        """``(problem, data checksum, data bytes)`` of file ``j``'s header: a problem when it
        could not be read or is not tiercache's header of the file's key and pool."""
        name = e.name
        code = r.err[j]
        if code == NOT_REGULAR:
            return f"{name}: not a regular file (a symlink or directory)", 0, 0
        if code:
            return f"{name}: unreadable ({os.strerror(code)})", 0, 0
        head = r.heads[j][:min(r.got[j], DATA_OFFSET)]
        pool = self._pools.get(e.pool)
        if pool is not None:
            try:
                return None, header_checksum(head, e.key, pool, name), pool.block_nbytes
            except CorruptBlockError:
                pass  # another geometry, or a bad header: the full parse says which
        try:
            header = decode_header(bytes(head), name)
        except CorruptBlockError as exc:
            return str(exc), 0, 0
        if (header.key, header.pool) != (e.key, e.pool):
            return f"{name}: header names key/pool {header.key!r}/{header.pool!r}, not its file name", 0, 0
        self._learn(e.pool, header)
        return None, header.checksum, header.nbytes

    def size(self, e: FileEntry) -> int:
        """The bytes to read of ``e``'s file: its surveyed size, else the size of the last file
        of its pool that verified (the first one's stat'ed)."""
        if e.size >= 0:
            return e.size
        size = self._sizes.get(e.pool)
        if size is None:
            try:
                size = os.stat(e.name, dir_fd=self.dir_fd(e.dir), follow_symlinks=False).st_size
            except OSError:
                size = DATA_OFFSET
            self._sizes[e.pool] = size
        return size

    def _check(self, e: FileEntry, r: _Results, j: int, staging: np.ndarray, off: int, size: int) -> str | None:
        if not r.err[j] and r.file_len[j] != DATA_OFFSET + size:
            # replaced or resized since the survey, or not the size of its pool's files: on its own
            return verify_file(entry_path(self.rd, e))
        problem, want, nbytes = self._header(e, r, j)
        if problem:
            return problem
        name, got = e.name, r.got[j]
        have = got - DATA_OFFSET
        if have < nbytes:
            return f"{name}: truncated ({max(have, 0)} of {nbytes} data bytes)"
        if e.size != file_size(nbytes):
            return f"{name}: {e.size} bytes, expected {file_size(nbytes)} (trailing bytes)"
        if self.hash and nbytes == size and got == DATA_OFFSET + size:
            hashed = r.hash[j]
        else:
            hashed = checksum(staging[off:off + nbytes])
        if hashed != want:
            return f"{name}: data checksum mismatch"
        self._sizes[e.pool] = e.size
        return None


def _in_chunks(rd: RootDir, entries: list[FileEntry], threads: int, engine: str, whole: bool,
               on_done: Callable[[int], None] | None) -> list[tuple[FileEntry, str | None]]:
    """What :meth:`_Checker.chunk` returns for all ``entries``, chunks run on ``threads``
    threads with one native engine."""
    native = NativeIO(threads, uring=engine == "io_uring")
    try:
        checker = _Checker(rd, native)

        def run(files):
            found = checker.chunk(files, whole)
            if on_done is not None:
                on_done(len(files))
            return found

        with ThreadPoolExecutor(threads) as pool:
            return [x for found in pool.map(run, _chunks(entries, checker.size if whole else None)) for x in found]
    finally:
        native.close()


def _one_by_one(entries: list, fn: Callable, threads: int, on_done: Callable[[int], None] | None) -> list:
    """``fn(entry)`` of each entry, on ``threads`` threads, in order."""
    out = []
    with ThreadPoolExecutor(threads) as pool:
        for r in pool.map(fn, entries):
            out.append(r)
            if on_done is not None:
                on_done(1)
    return out


def verify_entries(rd: RootDir, entries: list[FileEntry], threads: int = 8,
                   on_done: Callable[[int], None] | None = None,
                   io_engine: str = "auto") -> list[tuple[FileEntry, str]]:
    """Check the block files ``entries`` (from :func:`~tiercache.files.rootsurvey.survey` of
    ``rd``'s root) on ``threads`` threads; returns ``(entry, problem)`` for each bad one.
    ``on_done(n)`` is called as each ``n`` files are checked (from the threads). A file that
    changed since the survey (its size) is checked as it is now. Entries listed without a
    stat (``survey(..., sizes=False)``: size -1) get the size their file had when read.

    Args:
        io_engine: the native engine to read with (``auto``, ``io_uring``, ``threads``) or
            ``python`` (:func:`verify_file` per file).

    Raises:
        ConfigError: an unknown or unavailable ``io_engine``.
    """
    engine, _ = choose_engine(io_engine)
    # surveyed block files go in native chunks; anything else under a block name (a symlink,
    # a directory, a file in the wrong subdirectory: no size or key surveyed) one by one
    native = [e for e in entries if e.key is not None] if engine != "python" else []
    rest = entries if engine == "python" else [e for e in entries if e.key is None]
    problems = _one_by_one(rest, lambda e: verify_file(entry_path(rd, e)), threads, on_done)
    bad = [(e, p) for e, p in zip(rest, problems) if p]
    if native:
        bad += _in_chunks(rd, native, threads, engine, True, on_done)
    return bad


def own_entries(rd: RootDir, entries: list[FileEntry], threads: int = 8, io_engine: str = "auto") -> list[FileEntry]:
    """Those of the block files ``entries`` whose header is tiercache's and names the same
    key and pool as the file's name (what ``purge`` may delete, corrupt data included): header
    pages read in native chunks on ``threads`` threads (:func:`is_own_block_file` per file
    with ``io_engine = "python"`` or where the native library cannot be built). Entries of
    size -1 get the size their file had when read (the native engine's).

    Raises:
        ConfigError: an unknown or unavailable ``io_engine``.
    """
    engine, _ = choose_engine(io_engine)
    if engine == "python" or any(e.key is None for e in entries):
        def own(e: FileEntry) -> bool:
            path = entry_path(rd, e)
            if e.size < 0:
                st = path.lstat()
                e.size = st.st_size if st is not None else -1
            return is_own_block_file(path)

        owned = _one_by_one(entries, own, threads, None)
        return [e for e, ok in zip(entries, owned) if ok]
    return [e for e, problem in _in_chunks(rd, entries, threads, engine, False, None) if problem is None]


def delete_own(rd: RootDir, entries: list[FileEntry], threads: int = 8, on_done: Callable[[int], None] | None = None,
               io_engine: str = "auto") -> tuple[list[FileEntry], int]:
    """:func:`own_entries` and :func:`unlink_all` in one pass (``purge --yes``): each chunk's
    header pages are read and its files that are tiercache's are unlinked by the same thread
    at once, so that one chunk's header reads overlap another's unlinks. Returns the entries
    removed (sizes from the native reads) and how many were left as not tiercache's.

    Raises:
        ConfigError: an unknown or unavailable ``io_engine``.
    """
    engine, _ = choose_engine(io_engine)
    if engine == "python" or any(e.key is None for e in entries):
        owned = own_entries(rd, entries, threads, io_engine)
        if on_done is not None and len(entries) > len(owned):
            on_done(len(entries) - len(owned))  # those left alone count as done
        gone = unlink_all([entry_path(rd, e) for e in owned], threads, on_done, io_engine)
        return [e for e, ok in zip(owned, gone) if ok], len(entries) - len(owned)
    native = NativeIO(threads, uring=engine == "io_uring")
    try:
        checker = _Checker(rd, native)

        def run(files: list[FileEntry]) -> tuple[list[FileEntry], int]:
            mine = [e for e, problem in checker.chunk(files, whole=False) if problem is None]
            ops = Ops(len(mine), native.heads(0))
            ops.names = [e.name.encode() for e in mine]
            ops.dirs = np.fromiter((checker.dir_fd(e.dir) for e in mine), np.int32, len(mine))
            native.run(UNLINK, -1, ops)
            if on_done is not None:
                on_done(len(files))
            return [e for e, err in zip(mine, ops.err.tolist()) if not err], len(files) - len(mine)

        removed, foreign = [], 0
        with ThreadPoolExecutor(threads) as pool:
            for gone, left in pool.map(run, _chunks(entries)):
                removed += gone
                foreign += left
        return removed, foreign
    finally:
        native.close()


def unlink_all(paths: list[RootPath], threads: int = 8, on_done: Callable[[int], None] | None = None,
               io_engine: str = "auto") -> list[bool]:
    """Remove ``paths`` (names under the root's directory descriptors: never through a
    symlink; a symlink that took a name since it was checked is removed itself, its target
    untouched; a directory is left) in runs of :data:`CHUNK_FILES` names of one directory (a
    directory's entries change under its own lock: runs of different directories proceed
    together), each run one native call (``unlinkat`` in the C threads; one Python call per
    name with ``io_engine = "python"`` or where the native library cannot be built), on
    ``threads`` threads. Returns, per path, whether this call removed it.

    Raises:
        ConfigError: an unknown or unavailable ``io_engine``.
    """
    engine, _ = choose_engine(io_engine)
    native = None if engine == "python" or any(p.dir_fd is None for p in paths) else NativeIO(threads)

    def run(idx: list[int]) -> list[bool]:
        if native is None:
            done = []
            for i in idx:
                try:
                    done.append(paths[i].unlink())
                except OSError:  # a directory under the name (NotRegularFileError) or a vanished parent
                    done.append(False)
        else:
            ops = Ops(len(idx), native.heads(0))
            ops.names = [paths[i].name.encode() for i in idx]
            ops.dirs = np.fromiter((paths[i].dir_fd for i in idx), np.int32, len(idx))
            native.run(UNLINK, -1, ops)
            done = (ops.err == 0).tolist()
        if on_done is not None:
            on_done(len(idx))
        return done

    order = sorted(range(len(paths)), key=lambda i: (paths[i].dir_fd or -1, paths[i].name))
    runs: list[list[int]] = []
    for i in order:
        if not runs or len(runs[-1]) >= CHUNK_FILES or paths[runs[-1][0]].dir_fd != paths[i].dir_fd:
            runs.append([])
        runs[-1].append(i)
    out = [False] * len(paths)
    try:
        with ThreadPoolExecutor(threads) as pool:
            for idx, done in zip(runs, pool.map(run, runs)):
                for i, ok in zip(idx, done):
                    out[i] = ok
    finally:
        if native is not None:
            native.close()
    return out
