"""Checking a root's block files at the disk's speed: what ``tiercache verify`` and ``purge`` run.

A block file is checked against itself (:func:`~tiercache.rootops.inventory.verify_file` says
what that means: a regular file, its header naming its key and pool, its exact size, the
XXH3-64 of its data). Checking them one Python call at a time stops far below the disk for
small blocks (measured in docs/performance/scale.md, "Opening a root of a million blocks"), so here
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

import contextlib
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple

import numpy as np

from tiercache.errors import ConfigError, CorruptBlockError
from tiercache.files import (
    ALIGN,
    CHECK,
    DATA_OFFSET,
    DIRECT,
    HASH,
    NOT_REGULAR,
    READ,
    UNLINK,
    NativeIO,
    Ops,
    RootDir,
    RootPath,
    checksum,
    choose_engine,
    decode_header,
    file_size,
    header_checksum,
    native_hash,
    usual_header_tail,
)
from tiercache.geometry import PoolSpec
from tiercache.rootops.inventory import FileEntry, entry_path, is_own_block_file, verify_file

#: files of each pool checked in Python before the rest (its geometry learnt from the first
#: of them whose header decodes)
LEARN_FILES = 32
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
    the data (lists; None where the C threads did not hash it), and the header pages
    (``uint8 [n, 4096]``)."""

    err: list[int]
    got: list[int]
    file_len: list[int]
    hash: list[int]
    heads: np.ndarray


class _Tail(NamedTuple):
    """A pool's metadata text after the key (:func:`usual_header_tail`), kept alive for the C
    threads: the array, its address and size, and the pool's block bytes."""

    text: np.ndarray
    addr: int
    size: int
    nbytes: int


class _Checker:
    """Checks chunks of files with one native engine; learns each pool's geometry."""

    def __init__(self, rd: RootDir, native: NativeIO) -> None:
        self.rd = rd
        self.native = native
        self.hash = native_hash()
        self._pools: dict[str, PoolSpec] = {}
        self._tails: dict[str, _Tail] = {}  # per pool: what the C threads compare (CHECK reads)
        self._dirs: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def _staging(self, nbytes: int) -> np.ndarray:
        """This thread's page-aligned staging buffer of at least ``nbytes`` bytes (reused:
        a fresh one per chunk cost a page fault per 4 KiB)."""
        buf = getattr(self._local, "staging", None)
        if buf is None or buf.size < nbytes:
            raw = np.empty(max(nbytes, 1 << 20) + ALIGN, np.uint8)
            start = -raw.ctypes.data % ALIGN
            buf = self._local.staging = raw[start:start + max(nbytes, 1 << 20)]
        return buf

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
                tail = np.frombuffer(usual_header_tail(pool), np.uint8)
                self._tails[name] = _Tail(tail, tail.ctypes.data, tail.size, pool.block_nbytes)

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
        # each file's data at a page-aligned offset of this thread's staging buffer
        room = (lens + (ALIGN - 1)) // ALIGN * ALIGN
        offs = np.zeros(n, np.int64)
        np.cumsum(room[:-1], out=offs[1:])
        staging = self._staging(int(room.sum()))
        ops.names = [e.name.encode() for e in files]
        ops.dirs = np.fromiter((self.dir_fd(e.dir) for e in files), np.int32, n)
        ops.data[:] = np.uint64(staging.ctypes.data) + offs.astype(np.uint64)
        ops.data_len[:] = lens
        checked = self._expect(files, ops)
        if self.hash and whole:
            ops.flags[~checked] |= HASH
        # O_DIRECT where the length allows it, as fio's reads in the comparison (through the
        # page cache, the copy out of it cost more CPU on a cold root than the checks did)
        ops.flags[lens % ALIGN == 0] |= DIRECT
        self.native.run(READ, self.rd.fd, ops)
        # per-file values as Python lists (one conversion per chunk, not a NumPy scalar per field)
        hashes = [h if not c else None for h, c in zip(ops.hash.tolist(), checked.tolist())]  # None: not hashed
        r = _Results(ops.err.tolist(), ops.got.tolist(), ops.file_len.tolist(), hashes, ops.heads)
        for e, err, file_len in zip(files, r.err, r.file_len):
            if e.size < 0 and not err:  # listed without a stat: the size its file had when read
                e.size = file_len
        # files the C threads passed need nothing more; the rest are judged here
        verdict = ops.verdict.tolist() if ops.verdict is not None else [0] * n
        if not whole:
            return [(e, None if ok else self._header(e, r, j)[0]) for j, (e, ok) in enumerate(zip(files, verdict))]
        out = []
        for j in (j for j, ok in enumerate(verdict) if not ok):
            problem = self._check(files[j], r, j, staging, int(offs[j]), int(lens[j]))
            if problem:
                out.append((files[j], problem))
        return out

    def _expect(self, files: list[FileEntry], ops: Ops) -> np.ndarray:
        """Mark the reads of ``files`` whose pool's geometry is known ``CHECK`` (header, size
        and checksum compared in the C threads: ``kernels/blockio.c``); returns which
        (``bool [n]``)."""
        tails = self._tails
        per_file = [tails.get(e.pool) for e in files]
        checked = np.fromiter((t is not None for t in per_file), bool, len(files))
        if checked.any():
            ops.expect_usual()
            ops.expect[:] = [t.addr if t is not None else 0 for t in per_file]
            ops.expect_len[:] = [t.size if t is not None else 0 for t in per_file]
            ops.nbytes[:] = [t.nbytes if t is not None else 0 for t in per_file]
            ops.flags[checked] |= CHECK
        return checked

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
            problem = verify_file(entry_path(self.rd, e))
            if problem is None and r.file_len[j] > DATA_OFFSET:
                self._sizes[e.pool] = r.file_len[j]  # the size to read its pool's files with
            return problem
        problem, want, nbytes = self._header(e, r, j)
        if problem:
            return problem
        name, got = e.name, r.got[j]
        have = got - DATA_OFFSET
        if have < nbytes:
            return f"{name}: truncated ({max(have, 0)} of {nbytes} data bytes)"
        if e.size != file_size(nbytes):
            return f"{name}: {e.size} bytes, expected {file_size(nbytes)} (trailing bytes)"
        if r.hash[j] is not None and self.hash and nbytes == size and got == DATA_OFFSET + size:
            hashed = r.hash[j]
        else:
            hashed = checksum(staging[off:off + nbytes])
        if hashed != want:
            return f"{name}: data checksum mismatch"
        self._sizes[e.pool] = e.size
        return None


#: Python's thread switch interval while a root is checked beside its listing (seconds)
CHECK_SWITCH_S = 0.0005


@contextlib.contextmanager
def quick_gil_handoff(interval: float = CHECK_SWITCH_S):
    """Python's thread switch interval set to ``interval`` seconds for the block (then put
    back; it is the process's): a :class:`RootCheck`'s threads need the GIL for a moment per
    chunk while the survey's listing holds it, and at Python's default 5 ms they left the disk
    idle meanwhile (verify of a million files: 17.3 s against 13.8-15.4 s, docs/performance/scale.md)."""
    was = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        yield
    finally:
        sys.setswitchinterval(was)


#: what a :class:`RootCheck` does with each file
VERIFY, OWN, DELETE = "verify", "own", "delete"


class RootCheck:
    """Checks (``verify``), tells tiercache's own (``own``) or deletes tiercache's own
    (``delete``) block files of ``rd``'s root, in native chunks on ``threads`` threads, as they
    are handed in with :meth:`add`: a survey hands each subdirectory's files in as soon as it
    is listed (``survey(..., on_blocks=check.add)``), so that the listing of the next
    subdirectory (Python) overlaps the checks of those listed (the disk and the C threads). At
    a million files of a root the listing took as long as a third of the checks
    (docs/performance/scale.md, "Opening a root of a million blocks").

    Files go in inode order within each :meth:`add` (a subdirectory's files in inode order
    checked as fast, measured, as the whole root's). Per mode, :meth:`results` returns
    ``verify``: ``(entry, problem)`` for each bad file; ``own``: the entries whose header is
    tiercache's and names the file's key and pool; ``delete``: ``(entries removed, how many
    were left as not tiercache's)``, each chunk's own files unlinked by the thread that read
    its headers. Entries of size -1 (listed without a stat) get the size their file had when
    read. ``on_done(n)`` is called as each ``n`` files are done (from the threads). Entries
    that are not surveyed block files (no key: a symlink, a directory, a file in the wrong
    subdirectory) and every entry with ``io_engine = "python"`` go one by one
    (:func:`verify_file`, :func:`is_own_block_file`).

    Raises:
        ConfigError: an unknown or unavailable ``io_engine``, or an unknown ``mode``.
    """

    def __init__(self, rd: RootDir, mode: str = VERIFY, threads: int = 8,
                 on_done: Callable[[int], None] | None = None, io_engine: str = "auto") -> None:
        if mode not in (VERIFY, OWN, DELETE):
            raise ConfigError(f"RootCheck mode {mode!r}; valid: {VERIFY}, {OWN}, {DELETE}")
        self.rd, self.mode, self.on_done = rd, mode, on_done
        self.engine, _ = choose_engine(io_engine)
        self._native = NativeIO(threads, uring=self.engine == "io_uring") if self.engine != "python" else None
        self._checker = _Checker(rd, self._native) if self._native is not None else None
        self._pool = ThreadPoolExecutor(threads)
        self._futures: list = []
        self._pools_known: set[str] = set()

    def add(self, entries: list[FileEntry]) -> None:
        """Queue ``entries`` (block files of the root, from
        :func:`~tiercache.rootops.inventory.survey`)."""
        native = [e for e in entries if e.key is not None] if self._checker is not None else []
        rest = [e for e in entries if e.key is None] if self._checker is not None else entries
        for start in range(0, len(rest), CHUNK_FILES):  # spread over the threads, as the chunks are
            self._futures.append(self._pool.submit(self._one_by_one, rest[start:start + CHUNK_FILES]))
        if not native:
            return
        # a pool's first files are checked first, in Python: its geometry is learnt from the
        # first whose header decodes, before its other files go to the C threads (whose
        # checks need it); several, since the first ones may be damaged
        first: dict[str, list[FileEntry]] = {}
        for e in native:
            if e.pool not in self._pools_known:
                batch = first.setdefault(e.pool, [])
                if len(batch) < LEARN_FILES:
                    batch.append(e)
        if first:
            self._pools_known.update(first)
            learners = [e for batch in first.values() for e in batch]
            learning = [self._pool.submit(self._chunk, files) for files in self._cut(learners)]
            self._futures += learning
            for f in learning:
                f.result()
            picked = {id(e) for batch in first.values() for e in batch}
            native = [e for e in native if id(e) not in picked]
        for files in self._cut(native):
            self._futures.append(self._pool.submit(self._chunk, files))

    def _cut(self, entries: list[FileEntry]) -> list[list[FileEntry]]:
        return _chunks(entries, self._checker.size if self.mode == VERIFY else None)

    def _chunk(self, files: list[FileEntry]):
        checked = self._checker.chunk(files, whole=self.mode == VERIFY)
        if self.mode == VERIFY:
            out = checked
        else:
            mine = [e for e, problem in checked if problem is None]
            out = mine
            if self.mode == DELETE:
                ops = Ops(len(mine), self._native.heads(0))
                ops.names = [e.name.encode() for e in mine]
                ops.dirs = np.fromiter((self._checker.dir_fd(e.dir) for e in mine), np.int32, len(mine))
                self._native.run(UNLINK, -1, ops)
                out = ([e for e, err in zip(mine, ops.err.tolist()) if not err], len(files) - len(mine))
        if self.on_done is not None:
            self.on_done(len(files))
        return out

    def _one_by_one(self, entries: list[FileEntry]):
        rd = self.rd
        if self.mode == VERIFY:
            out = [(e, p) for e in entries if (p := verify_file(entry_path(rd, e)))]
        else:
            mine = []
            for e in entries:
                path = entry_path(rd, e)
                if e.size < 0:
                    st = path.lstat()
                    e.size = st.st_size if st is not None else -1
                if is_own_block_file(path):
                    mine.append(e)
            out = mine
            if self.mode == DELETE:
                gone = unlink_all([entry_path(rd, e) for e in mine], 1, None, "python")
                out = ([e for e, ok in zip(mine, gone) if ok], len(entries) - len(mine))
        if self.on_done is not None:
            self.on_done(len(entries))
        return out

    def results(self):
        """Wait for every file added; what the mode returns (above)."""
        parts = [f.result() for f in self._futures]
        if self.mode == DELETE:
            return [e for gone, _ in parts for e in gone], sum(left for _, left in parts)
        return [x for part in parts for x in part]

    def close(self) -> None:
        """Wait for the threads and free the native engine."""
        self._pool.shutdown(wait=True)
        if self._native is not None:
            self._native.close()

    def __enter__(self) -> "RootCheck":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def verify_entries(rd: RootDir, entries: list[FileEntry], threads: int = 8,
                   on_done: Callable[[int], None] | None = None,
                   io_engine: str = "auto") -> list[tuple[FileEntry, str]]:
    """Check the block files ``entries`` (from :func:`~tiercache.rootops.inventory.survey` of
    ``rd``'s root) on ``threads`` threads; returns ``(entry, problem)`` for each bad one
    (:class:`RootCheck`, ``verify``). A file that changed since the survey (its size) is
    checked as it is now.

    Args:
        io_engine: the native engine to read with (``auto``, ``io_uring``, ``threads``) or
            ``python`` (:func:`verify_file` per file).

    Raises:
        ConfigError: an unknown or unavailable ``io_engine``.
    """
    with RootCheck(rd, VERIFY, threads, on_done, io_engine) as check:
        check.add(entries)
        return check.results()


def own_entries(rd: RootDir, entries: list[FileEntry], threads: int = 8, io_engine: str = "auto") -> list[FileEntry]:
    """Those of the block files ``entries`` whose header is tiercache's and names the same
    key and pool as the file's name (what ``purge`` may delete, corrupt data included): header
    pages read in native chunks on ``threads`` threads (:class:`RootCheck`, ``own``).

    Raises:
        ConfigError: an unknown or unavailable ``io_engine``.
    """
    with RootCheck(rd, OWN, threads, None, io_engine) as check:
        check.add(entries)
        return check.results()


def delete_own(rd: RootDir, entries: list[FileEntry], threads: int = 8, on_done: Callable[[int], None] | None = None,
               io_engine: str = "auto") -> tuple[list[FileEntry], int]:
    """:func:`own_entries` and :func:`unlink_all` in one pass (``purge --yes``;
    :class:`RootCheck`, ``delete``): each chunk's header pages are read and its files that are
    tiercache's are unlinked by the same thread at once, so that one chunk's header reads
    overlap another's unlinks. Returns the entries removed (sizes from the native reads) and
    how many were left as not tiercache's.

    Raises:
        ConfigError: an unknown or unavailable ``io_engine``.
    """
    with RootCheck(rd, DELETE, threads, on_done, io_engine) as check:
        check.add(entries)
        return check.results()


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


class Recheck(NamedTuple):
    """A bad file looked at again: ``problem`` is None when it is gone (removed or replaced
    under its name by a good file since it was checked, as on a shared root in use);
    ``same_file``: the name still holds the file (inode) found bad, checked once more."""

    problem: str | None
    same_file: bool


def recheck(rd: RootDir, entry: FileEntry) -> Recheck:
    """Check one file that a verify found bad once more, as it is now: a file that vanished or
    was replaced by a good one is not bad; only a file that is still bad, and still the same
    inode before and after the check, may be quarantined (``same_file``)."""
    path = entry_path(rd, entry)
    before = path.lstat()
    if before is None:
        return Recheck(None, False)
    problem = verify_file(path)
    after = path.lstat()
    if problem is None or after is None:
        return Recheck(None, False)
    if "unreadable (No such file or directory)" in problem:  # went between the lstat and the open
        return Recheck(None, False)
    same = after.st_ino == before.st_ino and (not entry.ino or entry.ino == before.st_ino)
    return Recheck(problem, same)
