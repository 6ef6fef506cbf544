"""Requests of block files as batches: the native engine's read and write tasks, and the
group commit both engines share.

A request (``[(key, {pool: buffer})]``) is cut into chunks of whole blocks (up to
:data:`MAX_CHUNK_FILES` files, and :data:`STAGING_BYTES` of pinned staging when device
buffers take the POSIX path); each chunk is one task on the file tier's I/O threads, which
makes one :class:`~tiercache.files.nativeio.NativeIO` call for all its files and then, per
file, checks the header and the XXH3-64 checksum. Chunks of one request overlap: while one
chunk's checksums run in Python, the next chunk's files are on the disk.

Writes follow the fsync policy exactly as the ``python`` engine does (docs in
:meth:`~tiercache.files.FileTier.submit`): with ``none`` each file is published by its
task; otherwise a request of two or more files is a **group commit** (:class:`GroupCommit`):
every file is written as a temporary file without a flush, the last task to finish makes
them durable with one ``syncfs`` and renames them into place (one native batch), and each
block is acknowledged only after that.

With the tier's :class:`~tiercache.files.openfiles.OpenFiles`, reads use the descriptors it
holds and hand it those they open; writes go into its free files where it has one of the
size (else a new temporary file, kept open), and publish with an exchange where the replaced
file can be kept free.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future

import numpy as np

from tiercache.arrays import host_address
from tiercache.errors import CorruptBlockError
from tiercache.files import posix_io
from tiercache.files.blockfile import (
    ALIGN,
    DATA_OFFSET,
    FANOUT,
    SUBDIRS,
    align_up,
    block_location,
    checksum,
    encode_header,
    file_size,
    header_checksum,
    usual_header_tail,
)
from tiercache.files.nativeio import (
    CHECK,
    DIRECT,
    EXCHANGE,
    FDATASYNC,
    HASH,
    HASHONLY,
    KEEP,
    KEEP_DIRECT,
    KEPT_DIRECT,
    KEPT_RDWR,
    MAKEHEAD,
    NOT_REGULAR,
    PUBLISH,
    READ,
    RENAME,
    WRITE,
    NativeIO,
    Ops,
    block_names,
    error_for,
    native_hash,
    native_pieces,
)
from tiercache.files.openfiles import Entry, OpenFiles
from tiercache.files.rootdir import RootDir, RootPath
from tiercache.geometry import PoolSpec
from tiercache.keys import Key

#: files per native call (one task of the I/O threads)
MAX_CHUNK_FILES = 64
#: pinned staging per chunk when device buffers take the POSIX path
STAGING_BYTES = 16 << 20


def before_io(i: int, deps, delay_s: float, skip) -> None:
    """In an I/O thread, before item ``i`` touches its buffers: wait for the jobs it depends
    on, the debug delay, and fail it (``OSError``) when ``skip(i)`` gives a reason."""
    for dep in deps:
        dep.wait_host()
    if delay_s:
        time.sleep(delay_s)
    why = skip(i) if skip is not None else None
    if why:
        raise OSError(why)


def _kept_entry(ops: Ops, j: int) -> Entry | None:
    """The open-file entry of the descriptor operation ``j`` kept (``KEEP``), as the native
    engine described it (inode, size, open flags), or None where it kept none."""
    fd = int(ops.fd[j])
    if fd < 0:
        return None
    fl = int(ops.kept_flags[j])
    return Entry(fd, int(ops.kept_ino[j]), int(ops.kept_size[j]), bool(fl & KEPT_DIRECT), bool(fl & KEPT_RDWR))


def _is_host(buf) -> bool:
    return isinstance(buf, (np.ndarray, memoryview))


def _host_view(buf, pool_name: str) -> np.ndarray:
    """A host buffer as a flat ``uint8`` array (no copy).

    Raises:
        ValueError: the buffer is not contiguous.
    """
    if type(buf) is np.ndarray and buf.ndim == 1 and buf.dtype == np.uint8 and buf.flags.c_contiguous:
        return buf
    view = np.asarray(buf)
    if not view.flags.c_contiguous:
        raise ValueError(f"block buffer of pool {pool_name!r} is not contiguous")
    return view.reshape(-1).view(np.uint8)


def _staged(nbytes: int, ptr: int | None, direct_io: bool) -> bool:
    """Whether a block's buffer (``nbytes`` at address ``ptr``; None: device memory) goes
    through the thread's pinned staging: a device buffer (POSIX path), or with O_DIRECT a host
    buffer of whole pages that does not start on a page (NumPy's own arrays start 16 bytes into
    one). Written or read in place, such a buffer would take the page cache, and a later
    O_DIRECT read of the file would first wait for that cache's writeback: 2 MiB reads over
    RAM-backed ext4 ran at a quarter of the speed of reads of files written with O_DIRECT
    (benchmarks/request_python.py)."""
    if ptr is None:
        return True
    return direct_io and nbytes % ALIGN == 0 and ptr % ALIGN != 0


class Outcome:
    """The outcome of a set of blocks (a chunk of a request, or a group commit's request):
    one event for all of them, the errors of those that failed (by index), callbacks to run
    once settled, and the I/O threads' tasks that settle it (``tasks``: ``[(IOThreads,
    Future)]``, for :meth:`help`)."""

    __slots__ = ("_callbacks", "_lock", "errors", "event", "tasks")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.errors: dict[int, BaseException] = {}
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] | None = []
        self.tasks: list[tuple] = []

    def help(self) -> None:
        """Run in the calling thread those of :attr:`tasks` that no I/O thread has started
        and that are first in their queue (:meth:`IOThreads.run_here
        <tiercache.files.iothreads.IOThreads.run_here>`): a caller about to wait for this
        outcome does its work instead of waking a thread and sleeping until it is done.
        Callbacks registered with :meth:`on_settled` may then run in the calling thread."""
        for executor, fut in self.tasks:
            if not self.event.is_set():
                executor.run_here(fut)

    def settle(self, errors: dict[int, BaseException]) -> None:
        """Record the failures (every other block succeeded), release the waiters, then run
        the callbacks (in this thread)."""
        self.errors.update(errors)
        self.event.set()
        with self._lock:
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            fn()

    def done(self) -> bool:
        """Settled (never blocks)."""
        return self.event.is_set()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait until settled; the first failure of its blocks or None.

        Raises:
            TimeoutError: not settled within ``timeout`` seconds.
        """
        if not self.event.wait(timeout):
            raise TimeoutError(f"blocks not finished after {timeout} s")
        return next(iter(self.errors.values()), None)

    def on_settled(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` once settled: in the settling thread, or now if already settled."""
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        fn()


class BlockFuture:
    """One block's outcome, with the part of :class:`concurrent.futures.Future` that callers
    of :meth:`~tiercache.files.FileTier.submit` use (``done``, ``exception``, ``result``); the
    blocks of one chunk share one event instead of a lock and condition each."""

    __slots__ = ("_i", "_outcome")

    def __init__(self, outcome: Outcome, i: int) -> None:
        self._outcome, self._i = outcome, i

    @property
    def outcome(self) -> Outcome:
        """The outcome this block shares with the others of its chunk: waiting for a
        request's blocks is one wait per chunk (:meth:`Job.wait_host
        <tiercache.transfer.jobs.Job.wait_host>`)."""
        return self._outcome

    def done(self) -> bool:
        return self._outcome.event.is_set()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The block's error or None, once settled.

        Raises:
            TimeoutError: not settled within ``timeout`` seconds.
        """
        if not self._outcome.event.wait(timeout):
            raise TimeoutError(f"block not finished after {timeout} s")
        return self._outcome.errors.get(self._i)

    def result(self, timeout: float | None = None) -> None:
        """None once the block succeeded.

        Raises:
            TimeoutError: see :meth:`exception`; the block's own error if it failed.
        """
        exc = self.exception(timeout)
        if exc is not None:
            raise exc

    def add_done_callback(self, fn: Callable[["BlockFuture"], None]) -> None:
        """Call ``fn(self)`` once the block is settled (as :class:`concurrent.futures.Future`
        does: in the thread that settles it, or at once if it already is)."""
        self._outcome.on_settled(lambda: fn(self))


def all_settled(outcomes: list[Outcome]) -> Outcome:
    """One outcome for several of the same blocks (the files of each pool): settled when
    every one is, a block's error the first of its errors (by outcome order)."""
    if len(outcomes) == 1:
        return outcomes[0]
    out = Outcome()
    out.tasks = [t for o in outcomes for t in o.tasks]
    left = [len(outcomes)]
    lock = threading.Lock()

    def one() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            errors: dict[int, BaseException] = {}
            for o in outcomes:
                for i, e in o.errors.items():
                    errors.setdefault(i, e)
            out.settle(errors)

    for o in outcomes:
        o.on_settled(one)
    return out


def when_all_settled(futures: list, fn: Callable[[], None]) -> None:
    """Call ``fn()`` once, when every one of ``futures`` is settled (in the thread that
    settles the last): one callback per chunk of blocks (:class:`BlockFuture` s of a chunk
    share an :class:`Outcome`), one per future otherwise (:class:`concurrent.futures.Future`)."""
    groups = {id(f._outcome): f._outcome for f in futures if isinstance(f, BlockFuture)}
    others = [f for f in futures if not isinstance(f, BlockFuture)]
    left = [len(groups) + len(others)]
    if not left[0]:
        fn()
        return
    lock = threading.Lock()

    def one(*_) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            fn()

    for o in groups.values():
        o.on_settled(one)
    for f in others:
        f.add_done_callback(one)


class GroupCommit:
    """The group commit of one write request: tasks stage blocks (``staged[i]``: block
    ``i``'s ``[(temporary, final)]`` files, or :meth:`fail`); when the last of ``tasks``
    tasks calls :meth:`task_done`, one filesystem sync makes the staged files durable,
    ``rename_all`` publishes them (``data+dir``: then one directory sync), and ``settle``
    gets every failed block's error (a block whose rename fails has none of its files left:
    no half-published block). Blocks are acknowledged only then.

    Args:
        directory: the root.
        fsync: ``data`` or ``data+dir``.
        keys: per block of the request.
        tasks: how many tasks stage blocks.
        rename_all: ``rename_all([(tmp, final)])`` -> per pair None or the exception (a failed
            rename leaves no temporary file).
        delete: ``delete([key])`` removes a block's files.
        settle: ``settle({index: error})`` once, with every failed block.
        discard: ``discard(item)`` removes a staged file that will not be published (by
            default: unlinks ``item[0]``). Staged items are ``(tmp, final, ...)``: what
            follows the two paths is for ``rename_all`` and ``discard``.
    """

    def __init__(self, directory: RootDir, fsync: str, keys: list[Key], tasks: int, rename_all: Callable,
                 delete: Callable, settle: Callable[[dict], None], discard: Callable | None = None) -> None:
        self.dir, self.fsync, self.keys = directory, fsync, keys
        self.staged: list[list[tuple] | None] = [None] * len(keys)
        self._discard = discard or (lambda item: item[0].unlink())
        self.failed: dict[int, BaseException] = {}
        self._left = tasks
        self._lock = threading.Lock()
        self._rename_all, self._delete, self._settle = rename_all, delete, settle

    def fail(self, i: int, exc: BaseException) -> None:
        """Block ``i`` could not be staged (nothing of it is left on disk)."""
        self.failed[i] = exc

    def task_done(self) -> None:
        """One staging task finished; the last one commits and settles."""
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if not last:
            return
        try:
            self._commit()
        except BaseException as exc:  # never leave a block unsettled
            for i, st in enumerate(self.staged):
                if st is not None and i not in self.failed:
                    self.failed[i] = exc
        self._settle(self.failed)

    def _filesystems(self, ready: list[int]) -> list[int]:
        """A directory descriptor on each filesystem the staged files of ``ready`` are on (one
        for a plain root; a root array's members that this batch wrote to)."""
        if len(self.dir.members) == 1:
            return [self.dir.fd]
        by_dev: dict[int, int] = {}
        for fd in {item[0].dir_fd for i in ready for item in self.staged[i]}:
            by_dev.setdefault(os.fstat(fd).st_dev, fd)
        return list(by_dev.values())

    def _commit(self) -> None:
        ready = [i for i, st in enumerate(self.staged) if st is not None and i not in self.failed]
        if not ready:
            return
        try:
            for fd in self._filesystems(ready):
                posix_io.sync_filesystem(fd)
        except BaseException as exc:
            for i in ready:
                for item in self.staged[i]:
                    self._discard(item)
                self.failed[i] = exc
            return
        items = [(i, item) for i in ready for item in self.staged[i]]
        errs = self._rename_all([item for _, item in items])
        bad: dict[int, BaseException] = {}
        for (i, _), exc in zip(items, errs):
            if exc is not None:
                bad.setdefault(i, exc)
        if bad:
            self._delete([self.keys[i] for i in bad])
        self.failed.update(bad)
        published = [i for i in ready if i not in bad]
        if published and self.fsync == "data+dir":
            try:
                fsync_dirs([item[1] for i in published for item in self.staged[i]])
            except OSError as exc:
                self._delete([self.keys[i] for i in published])
                self.failed.update({i: exc for i in published})


def fsync_dirs(paths) -> None:
    """fsync each distinct directory that holds one of ``paths`` (so renames in it are
    durable): the block subdirectories a batch published into."""
    seen: dict = {}
    for p in paths:
        seen.setdefault(p.dir_fd if p.dir_fd is not None else os.path.dirname(os.fspath(p)), p)
    for p in seen.values():
        posix_io.fsync_dir(p)


def settle_futures(futures: list[Future]) -> Callable[[dict], None]:
    """A ``settle`` for :class:`GroupCommit` that resolves one :class:`Future` per block."""
    def settle(errors: dict) -> None:
        for i, f in enumerate(futures):
            if i in errors:
                f.set_exception(errors[i])
            else:
                f.set_result(None)
    return settle


def python_rename_all(pairs: list[tuple[RootPath, RootPath]]) -> list[BaseException | None]:
    """:func:`~tiercache.files.posix_io.publish_tmp` of each pair, one Python call each."""
    out: list[BaseException | None] = []
    for tmp, final in pairs:
        try:
            posix_io.publish_tmp(tmp, final)
            out.append(None)
        except BaseException as exc:
            out.append(exc)
    return out


class BlockBatches:
    """The native engine's side of a file tier: reads and writes whole requests as batches.

    Args:
        directory: the root.
        pools: the tier's pools by name.
        native: the C thread pool.
        executor: the tier's I/O threads (:class:`~tiercache.files.iothreads.IOThreads`; one
            task per chunk, reads without dependencies ahead of queued writes).
        fsync, verify, direct_io, device_id: as :class:`~tiercache.files.FileTier`.
        block_meta: per key, extra header metadata for its next write.
        delete: ``delete([key])`` removes a block's files.
        open_files: the tier's held descriptors and free files (None: every file is opened,
            created and closed by its operation).
    """

    def __init__(self, directory: RootDir, pools: dict[str, PoolSpec], native: NativeIO, executor: Executor,
                 fsync: str, verify: bool, direct_io: bool, device_id: int, block_meta: dict,
                 delete: Callable, open_files: OpenFiles | None = None) -> None:
        self.dir, self.pools, self.native, self.executor = directory, pools, native, executor
        self.fsync, self.verify, self.direct_io, self.device_id = fsync, verify, direct_io, device_id
        self.block_meta = block_meta
        self._delete = delete
        self.open_files = open_files if open_files is not None and open_files.enabled else None
        #: XXH3-64 of data in the C threads (reads: ``HASH``; writes: a ``HASHONLY`` batch first)
        self.native_hash = native_hash()
        self._local = threading.local()
        #: block subdirectory name -> its directory descriptor (held open by the root for the
        #: tier's life)
        self._subdir_fds: dict[str, int] = {}
        #: the same by subdirectory number, with each one's path text (:meth:`subdirs`)
        self._subdir_table: tuple[np.ndarray, list[str]] | None = None
        self._subdir_lock = threading.Lock()
        self._root = str(directory.path)  # for messages
        #: per pool: its usual header text after the key, kept alive for the C checks
        #: (array, address, length, block bytes)
        self.tails: dict[str, tuple] = {}
        for name, pool in pools.items():
            text = np.frombuffer(usual_header_tail(pool), np.uint8).copy()
            self.tails[name] = (text, text.ctypes.data, text.size, pool.block_nbytes)

    def rows_fit(self, pool: str, rows: np.ndarray) -> bool:
        """Whether the rows of ``rows`` (2-D host ``uint8``) are each one block of ``pool`` of
        whole pages, page-aligned where the tier uses O_DIRECT: what the row reads and writes
        take (the general path stages the others through aligned memory)."""
        p = self.pools.get(pool)
        if p is None or rows.ndim != 2 or rows.shape[1] != p.block_nbytes or p.block_nbytes % ALIGN \
                or rows.strides[1] != 1:
            return False
        return not self.direct_io or (rows.strides[0] % ALIGN == 0 and rows.__array_interface__["data"][0] % ALIGN == 0)

    def pieces_fit(self, pool: str, pieces) -> bool:
        """Whether blocks in ``pieces`` (:class:`~tiercache.files.blockpieces.BlockPieces`) are
        each one block of ``pool`` of whole pages, and the native engine can move blocks in
        pieces (:func:`~tiercache.files.nativeio.native_pieces`). Pieces that are not
        page-aligned are read and written without O_DIRECT."""
        p = self.pools.get(pool)
        return p is not None and pieces.block_bytes == p.block_nbytes and p.block_nbytes % ALIGN == 0 \
            and native_pieces()

    def row_ops(self, keys: list, pool: str, rows, idx: np.ndarray, flags: int) -> Ops:
        """A batch for the blocks of ``keys`` in ``pool`` at rows ``rows[idx]`` (rows that
        :meth:`rows_fit`; ``idx`` ``int64``, one per key): each file's data address from the
        rows' base and stride, its lengths, ``flags`` (plus ``DIRECT`` where the tier uses
        O_DIRECT), the pool's usual header text (what ``CHECK`` compares and ``MAKEHEAD``
        writes), and the final names (:attr:`Ops.name_blob`, :attr:`Ops.name_off`) and their
        subdirectories' descriptors (:attr:`Ops.dirs`) made in C: the row reads' and writes'
        layout, with no Python per block. ``rows`` may instead be a
        :class:`~tiercache.files.blockpieces.BlockPieces` that :meth:`pieces_fit` (block
        ``idx[i]`` of it, read into and written from in place)."""
        spec = self.pools[pool]
        n = len(keys)
        ops = Ops(n, self.native.heads(n))
        direct = self.direct_io
        if isinstance(rows, np.ndarray):
            ops.data[:] = (np.uint64(rows.__array_interface__["data"][0])
                           + idx.astype(np.uint64) * np.uint64(rows.strides[0]))
        else:
            ops.set_pieces(rows.addresses[idx], rows.piece_bytes)
            direct = direct and rows.aligned
        ops.data_len[:] = spec.block_nbytes
        ops.file_len[:] = file_size(spec.block_nbytes)
        ops.flags[:] = flags | (DIRECT if direct else 0)
        ops.expect_usual()
        assert ops.expect is not None and ops.expect_len is not None and ops.nbytes is not None
        _, ops.expect[:], ops.expect_len[:], ops.nbytes[:] = self.tails[pool]
        ops.name_blob, ops.name_off, subs = block_names(keys, pool, FANOUT)
        ops.subs = subs
        ops.dirs = self.subdirs()[0][subs]
        return ops

    def subdirs(self) -> tuple[np.ndarray, list[str]]:
        """Each block subdirectory's descriptor by number (``int32 [FANOUT]``) and its path
        (for messages), opened (and created where missing) once; a root array's come from the
        members that hold them. What the row reads and writes index with the subdirectory
        numbers :func:`~tiercache.files.nativeio.block_names` gives."""
        if self._subdir_table is None:
            with self._subdir_lock:
                if self._subdir_table is None:
                    d = self.dir
                    owner = getattr(d, "owner", None)
                    subs = [(owner(s) if owner else d).subdir(s, create=True) for s in SUBDIRS]
                    self._subdir_table = (np.array([x.fd for x in subs], np.int32), [x._text for x in subs])
        return self._subdir_table

    # -- request -> chunks -------------------------------------------------------------------
    def queue(self, outcome: Outcome, fn: Callable, *args, read: bool = False) -> None:
        """Queue ``fn(*args)`` on the I/O threads as a task that settles ``outcome`` (recorded
        in its :attr:`~Outcome.tasks`, so a waiter can run it itself: :meth:`Outcome.help`)."""
        outcome.tasks.append((self.executor, self.executor.submit(fn, *args, read=read)))

    @staticmethod
    def chunks(items: list[tuple[Key, dict]], direct_io: bool = False) -> list[list[int]]:
        """Indices of ``items`` cut into chunks of whole blocks: as few as hold at most
        :data:`MAX_CHUNK_FILES` files each (a request of up to 64 files is one native call,
        its files all in flight on one io_uring ring or the C threads), evened out, and at most
        :data:`STAGING_BYTES` of buffers that go through staging (:func:`_staged`; ``direct_io``:
        the tier's O_DIRECT setting). Cutting a 32-block request into quarters, as
        before, doubled the Python work per block around the native calls: on an H100 machine
        with four RAM-backed devices, 256 KiB blocks in 32-block requests read at 12.5 GB/s as
        one chunk against 6.2 as four (docs/performance/root-arrays.md, "Several devices: root arrays")."""
        n_files = sum(len(bufs) for _, bufs in items)
        if n_files <= MAX_CHUNK_FILES and sum(align_up(b.nbytes) for _, bufs in items
                                              for b in bufs.values()) <= STAGING_BYTES:
            return [list(range(len(items)))]  # one chunk, whatever goes through staging
        parts = max(1, -(-n_files // MAX_CHUNK_FILES))
        target = -(-n_files // parts)
        out: list[list[int]] = []
        cur: list[int] = []
        files = staged = 0
        for i, (_, bufs) in enumerate(items):
            dev = sum(align_up(b.nbytes) for b in bufs.values() if _staged(
                b.nbytes, host_address(b) if _is_host(b) else None, direct_io))
            if cur and (files + len(bufs) > target or staged + dev > STAGING_BYTES):
                out.append(cur)
                cur, files, staged = [], 0, 0
            cur.append(i)
            files += len(bufs)
            staged += dev
        if cur:
            out.append(cur)
        return out

    def _staging(self, nbytes: int, device: bool) -> np.ndarray:
        """This thread's staging buffer of at least ``nbytes`` (page-aligned): pinned where CUDA
        is usable when device buffers go through it (``device``); else plain memory, so that a
        request of host buffers alone never probes CUDA (the probe imports CuPy: 150 ms)."""
        attr = "staging" if device else "bounce"
        buf = getattr(self._local, attr, None)
        if buf is None or buf.nbytes < nbytes:
            from tiercache.memory import alloc_host

            buf, owner = alloc_host(max(nbytes, 1 << 20), pinned=None if device else False)
            setattr(self._local, attr, buf)
            setattr(self._local, attr + "_owner", owner)
        return buf

    def _layout(self, idx: list[int], items, skip, errors: dict) -> tuple[list[tuple], list[tuple], list[int]]:
        """Per file of the chunk's blocks that are not skipped: ``(item, key, pool, buffer,
        host view)``, the host view being the buffer itself or a slice of pinned staging
        (:func:`_staged`); ``[(j, buffer view, staging view)]`` of the host buffers staged
        (file ``j``: copied into staging before a write, out of it after a read); and each
        file's host view's address."""
        files = []
        dev_bytes = 0
        device = False  # a device buffer among them: the staging is pinned
        direct_io = self.direct_io
        for i in idx:
            why = skip(i) if skip is not None else None
            if why:
                errors[i] = OSError(why)
                continue
            key, bufs = items[i]
            for name, buf in bufs.items():
                pool = self.pools[name]
                if _is_host(buf):
                    view = _host_view(buf, name)
                    ptr = host_address(view)
                else:
                    view = ptr = None
                    device = True
                staged = _staged(buf.nbytes, ptr, direct_io)
                files.append((i, key, pool, buf, view, ptr, staged))
                if staged:
                    dev_bytes += align_up(buf.nbytes)
        staging = self._staging(dev_bytes, device) if dev_bytes else None
        base = staging.__array_interface__["data"][0] if staging is not None else 0
        out, bounce, ptrs, at = [], [], [], 0
        for i, key, pool, buf, view, ptr, staged in files:
            if staged:
                host = staging[at:at + buf.nbytes]
                ptr = base + at
                at += align_up(buf.nbytes)
                if view is not None:
                    bounce.append((len(out), view, host))
            else:
                host = view
            out.append((i, key, pool, buf, host))
            ptrs.append(ptr)
        return out, bounce, ptrs

    def _ops(self, files, ptrs: list[int]) -> Ops:
        """A batch for ``files`` (host views at addresses ``ptrs``): each one's data pointer and
        length, its file's length, and ``DIRECT`` where the tier uses O_DIRECT and its host
        view is whole aligned pages."""
        n = len(files)
        ops = Ops(n, self.native.heads(n))
        lens = [host.nbytes for _, _, _, _, host in files]
        ops.data[:] = ptrs
        ops.data_len[:] = lens
        ops.file_len[:] = [file_size(pool.block_nbytes) for _, _, pool, _, _ in files]
        if self.direct_io and n:
            aligned = ((ops.data % np.uint64(ALIGN)) == 0) & ((ops.data_len % ALIGN) == 0)
            ops.flags[aligned] = DIRECT
        return ops

    def _device_copies(self, pairs) -> None:
        if pairs:
            import cupy

            from tiercache.memory import copy_many_sync

            with cupy.cuda.Device(self.device_id):
                copy_many_sync(pairs)

    # -- reads -------------------------------------------------------------------------------
    def submit_read(self, items, deps=(), delay_s: float = 0.0, skip=None) -> list[tuple[Key, BlockFuture]]:
        """Read ``items`` (``[(key, {pool: buffer})]``) into their buffers; see
        :meth:`~tiercache.files.FileTier.submit`."""
        out: list = [None] * len(items)
        for idx in self.chunks(items, self.direct_io):
            outcome = Outcome()
            for i in idx:
                out[i] = (items[i][0], BlockFuture(outcome, i))
            self.queue(outcome, self._read_chunk, idx, items, outcome, deps, delay_s, skip, read=not deps)
        return out

    def _read_chunk(self, idx, items, outcome: Outcome, deps, delay_s, skip) -> None:
        """One chunk of a read request (a task of the I/O threads): its files read in one
        native call, checked (in C where it can vouch for them), copied out of staging where
        staged, and the chunk's blocks settled."""
        errors: dict[int, BaseException] = {}
        try:
            before_io(idx[0], deps, delay_s, None)
            files, bounce, ptrs = self._layout(idx, items, skip, errors)
            ops = self._ops(files, ptrs)
            names = self._locate(ops, files)
            if self.verify and self.native_hash:
                ops.flags |= HASH
                self._expect(ops, files)
            held = self._hold(names, ops)
            try:
                self.native.run(READ, self.dir.fd, ops)
                self._read_results(ops, files, names, errors)
            finally:
                if self.open_files is not None:
                    self.open_files.release(held)
            self._device_copies([(buf, host) for i, _, _, buf, host in files if not _is_host(buf) and i not in errors])
            for j, view, host in bounce:
                if files[j][0] not in errors:
                    np.copyto(view, host)
        except BaseException as exc:
            for i in idx:
                errors.setdefault(i, exc)
        outcome.settle(errors)

    def _locate(self, ops: Ops, files) -> list[str]:
        """Each file's name (returned, and in ``ops.names``) and its subdirectory's descriptor
        (``ops.dirs``): the tier holds its block subdirectories open for its life, so each
        subdirectory's descriptor is looked up once."""
        names: list[str] = []
        dirs = ops.dirs = np.empty(len(files), np.int32)
        fds = self._subdir_fds
        for j, (_, key, pool, _, _) in enumerate(files):
            sub, name = block_location(key, pool.name)
            fd = fds.get(sub)
            if fd is None:
                fd = fds[sub] = self.dir.block_path(key, pool.name).dir_fd
            dirs[j] = fd
            names.append(name)
        ops.names = [n.encode() for n in names]
        return names

    def _read_results(self, ops: Ops, files, names: list[str], errors: dict) -> None:
        """After the read call: each block's error (a file that failed, or whose sibling did),
        and the descriptors the reads kept (adopted by the open-file cache, or closed). Only
        the files that need a look are visited: those with an error, those the C checks did not
        vouch for, and those that kept a descriptor; the others are done."""
        kept_mask = (ops.flags & KEEP) != 0  # only reads without a held descriptor keep one
        look = kept_mask | (ops.err != 0)
        if ops.verdict is None:
            look[:] = True
        else:
            look |= ops.verdict == 0
        adopted: list[tuple[str, Entry]] = []
        for j in np.flatnonzero(look).tolist():
            i, key, pool, _, host = files[j]
            kept = int(ops.fd[j]) if kept_mask[j] else None
            try:
                if i in errors:
                    raise CorruptBlockError("a sibling file failed")
                if ops.verdict is None or not ops.verdict[j]:  # not vouched for by the C check
                    self.check_read(ops, j, key, pool, host, self.dir.block_path(key, pool.name))
                entry = _kept_entry(ops, j) if kept is not None else None
            except BaseException as exc:
                errors.setdefault(i, exc)
                if kept is not None and kept >= 0:
                    os.close(kept)
                entry = None
            if kept is not None:
                if entry is not None:
                    adopted.append((names[j], entry))
                else:
                    self.open_files.unreserve()
        if adopted:
            self.open_files.adopt_many(adopted)

    def _keep_flags(self, data_len: int) -> int:
        """Flags of an operation of ``data_len`` bytes keeping its file open: an O_DIRECT
        descriptor where the tier uses O_DIRECT and the pool's blocks are page-sized
        multiples, whatever the alignment of the buffer of the operation that opens it."""
        return KEEP | (KEEP_DIRECT if self.direct_io and data_len % ALIGN == 0 else 0)

    def _hold(self, names: list[str], ops: Ops) -> list[Entry | None]:
        """Per read: the held descriptor it uses (its fd set in ``ops``), or None (the read
        opens the file and keeps it: ``KEEP``)."""
        if self.open_files is None:
            return [None] * len(names)
        held = self.open_files.acquire(names, [bool(f & DIRECT) for f in ops.flags.tolist()])
        misses = []
        for j, e in enumerate(held):
            if e is not None:
                ops.fd[j] = e.fd
            else:
                misses.append(j)
        for j in misses[:self.open_files.reserve_many(len(misses)) if misses else 0]:
            ops.flags[j] |= self._keep_flags(int(ops.data_len[j]))
        return held

    def _expect(self, ops: Ops, files) -> None:
        """Mark ``CHECK`` the reads whose blocks are whole pages: the C threads compare the
        header with the usual one of the file's key and pool, the file's size and the data's
        checksum (``kernels/blockio.c``), and Python looks only at the reads they could not
        vouch for (:meth:`check_read`: an error, a header with ``extra``, a bad file)."""
        tails = self.tails
        checked = [host.nbytes == tails[pool.name][3] and host.nbytes % ALIGN == 0 for _, _, pool, _, host in files]
        if any(checked):
            self._expect_tails(ops, files)
            ops.flags[np.array(checked)] |= CHECK

    def _expect_tails(self, ops: Ops, files) -> None:
        """Give each operation its pool's usual header text after the key (``expect``) and
        block bytes (``nbytes``): what ``CHECK`` reads compare and ``MAKEHEAD`` writes write."""
        ops.expect_usual()
        for j, (_, _, pool, _, _) in enumerate(files):
            _, ops.expect[j], ops.expect_len[j], ops.nbytes[j] = self.tails[pool.name]

    def check_read(self, ops: Ops, j: int, key: Key, pool: PoolSpec, host: np.ndarray, path) -> int:
        code = int(ops.err[j])
        where = str(path)
        if code:
            exc = error_for(code, where)
            raise (CorruptBlockError(str(exc)) if code == NOT_REGULAR else exc)
        if ops.got[j] < DATA_OFFSET + pool.block_nbytes:
            raise CorruptBlockError(
                f"{where}: truncated ({int(ops.got[j])} bytes, expected {file_size(pool.block_nbytes)})"
            )
        want = header_checksum(ops.heads[j], key, pool, where)
        if self.verify and (int(ops.hash[j]) if ops.flags[j] & HASH else checksum(host)) != want:
            raise CorruptBlockError(f"{where}: data checksum mismatch")
        return want

    # -- writes ------------------------------------------------------------------------------
    def submit_write(self, items, deps=(), delay_s: float = 0.0, skip=None) -> list[tuple[Key, BlockFuture]]:
        """Write ``items`` (``[(key, {pool: buffer})]``) to their files; see
        :meth:`~tiercache.files.FileTier.submit`."""
        chunks = self.chunks(items, self.direct_io)
        n_files = sum(len(bufs) for _, bufs in items)
        out: list = [None] * len(items)
        group = whole = None
        if self.fsync != "none" and n_files > 1:
            whole = Outcome()
            group = GroupCommit(self.dir, self.fsync, [k for k, _ in items], len(chunks), self.rename_all,
                                self._delete, whole.settle, self.discard)
            out = [(key, BlockFuture(whole, i)) for i, (key, _) in enumerate(items)]
        for idx in chunks:
            outcome = None
            if group is None:
                outcome = Outcome()
                for i in idx:
                    out[i] = (items[i][0], BlockFuture(outcome, i))
            self.queue(whole or outcome, self._write_chunk, idx, items, outcome, deps, delay_s, skip, group)
        return out

    def _write_chunk(self, idx, items, outcome: Outcome | None, deps, delay_s, skip, group: GroupCommit | None) -> None:
        """One chunk of a write request (a task of the I/O threads): stage device and unaligned
        buffers, make the headers, choose each file's name (a free file or a new temporary
        one), write them in one native call, then publish or stage them for the group commit
        (``group``), and settle the chunk's blocks."""
        errors: dict[int, BaseException] = {}
        staged: dict[int, list] = {}
        try:
            before_io(idx[0], deps, delay_s, None)
            files, bounce, ptrs = self._layout(idx, items, skip, errors)
            self._device_copies([(host, buf) for _, _, _, buf, host in files if not _is_host(buf)])
            for _, view, host in bounce:
                np.copyto(host, view)
            ops = self._ops(files, ptrs)
            paths = [self.dir.block_path(key, pool.name) for _, key, pool, _, _ in files]
            ops.dirs = np.fromiter((p.dir_fd for p in paths), np.int32, len(paths))
            self._write_heads(ops, files)
            self.write_files(ops, [f[0] for f in files], paths, idx, items, group is None, errors, staged)
        except BaseException as exc:
            self.chunk_failed(idx, exc, errors, staged)
        self.settle_chunk(idx, errors, staged, outcome, group)

    def write_files(self, ops: Ops, blocks: list[int], paths: list[RootPath], idx: list[int], items,
                    publish: bool, errors: dict, staged: dict) -> None:
        """The files of a chunk whose headers and data are ready in ``ops`` (``blocks[j]``:
        file ``j``'s block, an index into ``items``, whose ``items[i][0]`` is its key; ``paths``:
        each file's final path): names chosen, written in one native call, then published or
        staged for the group commit (:meth:`_write_results`)."""
        files = [(i,) for i in blocks]
        finals = [p.name for p in paths]
        reused = self._write_names(ops, files, finals, publish)
        self.native.run(WRITE, self.dir.fd, ops)
        self._write_results(ops, files, paths, finals, reused, publish, idx, items, errors, staged)

    def chunk_failed(self, idx: list[int], exc: BaseException, errors: dict, staged: dict) -> None:
        """A chunk's work raised ``exc``: its staged files removed, every block not failed
        already fails with ``exc``."""
        for st in staged.values():
            for item in st:
                self.discard(item)
        staged.clear()
        for i in idx:
            errors.setdefault(i, exc)

    @staticmethod
    def settle_chunk(idx: list[int], errors: dict, staged: dict, outcome: Outcome | None,
                     group: GroupCommit | None) -> None:
        """A chunk's blocks settled: its ``outcome`` (published files), or handed to ``group``
        (each block failed or staged) for the group commit."""
        if group is None:
            assert outcome is not None
            outcome.settle(errors)
            return
        for i in idx:
            if i in errors:
                group.fail(i, errors[i])
            else:
                group.staged[i] = staged.get(i, [])
        group.task_done()

    def _write_heads(self, ops: Ops, files) -> None:
        """The header pages: the usual ones made by the C threads in the write call itself
        (checksum, then header: ``MAKEHEAD``); a header with extra metadata encoded here."""
        native_heads = self.native_hash and not (self.block_meta and any(
            self.block_meta.get(key) for _, key, _, _, _ in files))
        if native_heads:
            self._expect_tails(ops, files)
            ops.flags |= MAKEHEAD
            return
        if self.native_hash:  # every file's XXH3-64 on the C threads
            self.native.run(HASHONLY, self.dir.fd, ops)
        for j, (i, key, pool, _, host) in enumerate(files):
            digest = int(ops.hash[j]) if self.native_hash else checksum(host)
            ops.heads[j] = np.frombuffer(encode_header(key, pool, digest, self.block_meta.get(key)), np.uint8)

    def _write_names(self, ops: Ops, files, finals: list[str], publish: bool) -> list[Entry | None]:
        """Each write's file and flags: a free file of its size (written through its held
        descriptor) or a new temporary file (kept open where a descriptor was reserved), to be
        published over its final name (``publish``: by this chunk, exchanged where the replaced
        file is worth keeping). Free files and reservations are taken for the whole chunk at
        once, and nothing after raises before the write call. Returns per file the free file's
        entry it reuses, or None."""
        of = self.open_files
        flags = (PUBLISH | (FDATASYNC if self.fsync != "none" else 0)) if publish else 0
        n = len(files)
        reused: list[Entry | None] = [None] * n
        sizes, dirs, lens = ops.file_len.tolist(), ops.dirs.tolist(), ops.data_len.tolist()
        fl, fds = ops.flags.tolist(), ops.fd.tolist()  # as lists: NumPy's scalars cost more per file
        plan = of.plan_writes(list(zip(sizes, dirs, finals)), publish) if of is not None else None
        names, final_names = ops.names, ops.finals
        for j in range(n):
            final = finals[j]
            free, reserved, exchange, move = plan[j] if plan is not None else (None, False, False, False)
            if move:
                # a large file: one free elsewhere is moved here (a rename) rather than allocated
                free = of.take_free(sizes[j], dirs[j])
                reserved = free is None and of.reserve()
            f = fl[j] | flags | (EXCHANGE if exchange else 0)
            if free is not None:  # a free file of this size: written through its descriptor
                names.append(free[0].encode())
                fds[j] = free[1].fd
                reused[j] = free[1]
                f |= KEEP_DIRECT if free[1].direct else 0
            else:
                names.append(posix_io.tmp_name(final).encode())
                f |= self._keep_flags(lens[j]) if reserved else 0
            final_names.append(final.encode())
            fl[j] = f
        ops.flags[:] = fl
        ops.fd[:] = fds
        return reused

    def _write_results(self, ops: Ops, files, paths, finals: list[str], reused: list[Entry | None], publish: bool,
                       idx: list[int], items, errors: dict, staged: dict) -> None:
        """After the write call: the descriptors kept or reused, each failed block's error
        (none of its files left), and then either the published files' bookkeeping (and the
        directory sync of ``data+dir``) or, for the group commit, each block's files in
        ``staged`` (``[(tmp, final, entry)]``; a block with a failed sibling file has its other
        files removed)."""
        of = self.open_files
        io_failed: set[int] = set()
        entries: list[Entry | None] = [None] * len(files)
        published: list[tuple[int, tuple]] = []
        err, fl, got, dirs = ops.err.tolist(), ops.flags.tolist(), ops.got.tolist(), ops.dirs.tolist()
        for j, (i, *_rest) in enumerate(files):
            if reused[j] is not None:
                entries[j] = reused[j]
            elif fl[j] & KEEP:  # a reserved descriptor: kept (fd >= 0) or not
                entries[j] = _kept_entry(ops, j)
                if entries[j] is None:
                    of.unreserve()
                else:
                    entries[j].refs = 1  # the writer's, until published or discarded
            if err[j]:
                if entries[j] is not None:  # its temporary name is gone
                    of.discard(entries[j])
                    entries[j] = None
                if i not in errors:
                    errors[i] = error_for(err[j], str(paths[j]))
                    io_failed.add(i)
            elif publish and of is not None:
                published.append((j, (finals[j], ops.names[j].decode(), entries[j], got[j], dirs[j])))
        if published:
            for (j, _), drop in zip(published, of.published_many([item for _, item in published])):
                if drop:
                    paths[j].with_name(drop).unlink()
        if io_failed:  # a failed write leaves no file of its block (no stale or half-written one)
            self._delete([items[i][0] for i in sorted(io_failed)])
        if publish:
            ok = [i for i in idx if i not in errors]
            if ok and self.fsync == "data+dir":
                try:
                    fsync_dirs([paths[j] for j, (i, *_r) in enumerate(files) if i not in errors])
                except OSError as exc:
                    self._delete([items[i][0] for i in ok])
                    errors.update({i: exc for i in ok})
            return
        for j, (i, *_rest) in enumerate(files):
            item = (paths[j].with_name(ops.names[j].decode()), paths[j], entries[j])
            if i in errors:
                if not ops.err[j]:
                    self.discard(item)  # a sibling pool's file failed: drop this one too
            else:
                staged.setdefault(i, []).append(item)

    def discard(self, item: tuple) -> None:
        """Remove a staged file that will not be published (``(tmp, final, entry)``) and drop
        its descriptor."""
        tmp, _, entry = item
        tmp.unlink()
        if entry is not None:
            self.open_files.discard(entry)

    def rename_all(self, items: list[tuple]) -> list[BaseException | None]:
        """Publish each staged ``(tmp, final, entry)`` in one native batch (a failed
        rename removes its temporary file), exchanging with the replaced file where the
        open-file cache keeps it; per item None or the exception."""
        ops = Ops(len(items), self.native.heads(0))
        ops.names = [it[0].name.encode() for it in items]
        ops.finals = [it[1].name.encode() for it in items]
        ops.dirs = np.fromiter((it[1].dir_fd for it in items), np.int32, len(items))
        of = self.open_files
        if of is not None:
            for j, it in enumerate(items):
                if of.exchange(it[1].name):
                    ops.flags[j] = EXCHANGE
        self.native.run(RENAME, self.dir.fd, ops)
        out: list[BaseException | None] = []
        published: list[tuple[int, tuple]] = []
        for j, (tmp, final, entry) in enumerate(items):
            if ops.err[j]:
                out.append(error_for(int(ops.err[j]), str(final)))
                if entry is not None:  # its temporary file is gone
                    of.discard(entry)
                continue
            out.append(None)
            if of is not None:
                published.append((j, (final.name, tmp.name, entry, int(ops.got[j]), final.dir_fd)))
        if published:
            for (j, _), drop in zip(published, of.published_many([item for _, item in published])):
                if drop:
                    items[j][1].with_name(drop).unlink()
        return out
