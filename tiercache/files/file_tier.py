"""The file tier: one file per block and pool under a root directory that tiercache owns
(marker, single-writer lock and the trust boundary: :mod:`tiercache.files.rootdir`), in the
root's 64 subdirectories (:func:`~tiercache.files.blockfile.block_subdir`). Blocks are written
atomically (see :mod:`tiercache.files.posix_io`); when a cache reopens a root,
:meth:`FileTier.scan` rebuilds the index from the files, removes leftover temporary files,
moves files that fail their header check into ``quarantine/``, and moves block files of the
flat layout of earlier versions (in the root itself) into their subdirectories. Every
operation goes through a directory descriptor of the root and follows no symlink.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tiercache.errors import CorruptBlockError
from tiercache.files import posix_io
from tiercache.files.blockbatch import (
    BlockBatches,
    BlockFuture,
    GroupCommit,
    Outcome,
    all_settled,
    before_io,
    python_rename_all,
    settle_futures,
)
from tiercache.files.blockfile import SUBDIRS, block_filename, block_subdir, file_size, parse_filename
from tiercache.files.blockio import BlockIO, block_io
from tiercache.files.devicepath import IOPath
from tiercache.files.iothreads import IOThreads
from tiercache.files.nativeio import (
    DROP_FD,
    RECYCLE,
    UNLINK,
    NativeIO,
    Ops,
    choose_engine,
    error_for,
    native_hash,
    native_threads,
)
from tiercache.files.openfiles import FREE_FILES, OpenFiles
from tiercache.files.rootarray import RootArray, open_roots
from tiercache.files.rootdir import QUARANTINE, NotRegularFileError, RootDir, RootLock, RootPath, classify
from tiercache.files.rowreads import RowReads
from tiercache.files.rowwrites import RowWrites
from tiercache.files.sharing import published, tmp_abandoned, tmp_name, tmp_owner
from tiercache.geometry import PoolSpec
from tiercache.keys import Key, key_text
from tiercache.settings import FileSettings, SharingSettings

log = logging.getLogger("tiercache")
_VANISHED = "vanished"  # a file deleted between the listing and its check
_SUBDIR_NAMES = frozenset(SUBDIRS)



@dataclass
class ScanResult:
    """What :meth:`FileTier.scan` found.

    Attributes:
        blocks: complete blocks (a valid file for every pool) as ``(key, mtime)``.
        removed_tmp: leftover temporary files deleted.
        quarantined: ``(path, reason)`` of files moved to ``quarantine/``.
        incomplete: keys with files for some pools but not all (left in place).
        extra: per block, the ``extra`` metadata its files were written with (if any).
        foreign: names in the root that tiercache did not write (left in place).
        migrated: block files of the flat layout moved into their subdirectories.
        known: (a scan of some subdirectories against an index) blocks with a file of every
            pool that the index already knew: their headers are not read (every read checks
            them). The cache's :attr:`~tiercache.TierCache.scan` leaves it empty (a key per
            block would outlive the reconciliation).
        from_index: the cache opened from the root's saved index (see
            :mod:`tiercache.files.indexfile`); the other fields then count what the
            reconciliation of the changed subdirectories found (adopted blocks are in ``blocks``).
        dropped: keys of the index whose files were gone (reconciliation).
    """

    blocks: list[tuple[Key, float]] = field(default_factory=list)
    removed_tmp: int = 0
    quarantined: list[tuple[str, str]] = field(default_factory=list)
    incomplete: list[Key] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    migrated: int = 0
    known: list[Key] = field(default_factory=list)
    from_index: bool = False
    dropped: list[Key] = field(default_factory=list)


class FileTier:
    """Block files under ``root``, read and written by a pool of I/O threads.

    Args:
        pools: the cache's pools.
        num_slots: blocks the tier may hold (enforced by the cache's policy).
        io_path: how device buffers reach files (:class:`~tiercache.files.devicepath.IOPath`).
        settings: the ``[file]`` settings (:class:`~tiercache.settings.FileSettings`): the root
            (created if missing; see :func:`open_root`), ``fsync``, checksums, I/O threads
            (:class:`~tiercache.files.iothreads.IOThreads`), the I/O engine
            (:mod:`tiercache.files.nativeio`; the chosen one is :attr:`engine`, with
            :attr:`engine_reason`), O_DIRECT, the root owner check, and ``open_files``: the
            descriptors of block files the native engine keeps open
            (:mod:`tiercache.files.openfiles`; exclusive roots only, which also recycle
            replaced and evicted files. While a tier is open its root is its own: a held
            descriptor keeps serving the verified bytes its file was published with even if
            something else deletes or replaces the name. Shared roots hold none: a descriptor
            would keep the disk space of files other processes delete, and hide their
            deletions).
        sharing: the ``[sharing]`` settings: ``exclusive`` (one process holds the root) or
            ``shared`` (any number of processes, :mod:`tiercache.files.sharing`: the shared lock,
            only abandoned temporary files removed, published files never deleted by a failed
            write, evictions by policy sparing files younger than ``min_age_s``, temporary files
            older than ``tmp_max_age_s`` abandoned whoever wrote them).
        device_id: CUDA device of device buffers.
        free_files: recycled files kept per file size (their disk space is beyond
            ``num_slots``' blocks).

    Raises:
        RootError: see :func:`~tiercache.files.rootdir.open_root` and
            :class:`~tiercache.files.rootdir.RootLock`; ``quarantine`` in the root is a
            symlink or not a directory.
        ConfigError: an ``io_engine`` that cannot run here.
    """

    def __init__(self, pools: tuple[PoolSpec, ...], num_slots: int, io_path: IOPath,
                 settings: FileSettings = FileSettings(), sharing: SharingSettings = SharingSettings(),
                 device_id: int = 0, free_files: int = FREE_FILES) -> None:
        fsync, verify, io_threads = settings.fsync, settings.verify_checksums, settings.io_threads
        direct_io, open_files = settings.direct_io, settings.open_files
        self.settings, self.sharing = settings, sharing
        io_engine = settings.io_engine
        min_age_s, tmp_max_age_s = sharing.min_age_s, sharing.tmp_max_age_s
        self.engine, self.engine_reason = choose_engine(io_engine)
        self.shared = sharing.shared
        self.min_age_s = min_age_s
        self.tmp_max_age_s = tmp_max_age_s
        #: the root, or a root array (one root per device: :mod:`tiercache.files.rootarray`)
        self.dir: RootDir | RootArray = open_roots(settings.all_roots, settings.check_root_owner)
        self._locks: list[RootLock] = []
        try:
            for member in self.dir.members:
                self._locks.append(RootLock(member, shared=self.shared))
                member.subdir(QUARANTINE)  # a symlink or file there is refused now, not followed later
            self.dir.block_dirs(create=True)  # likewise, and their descriptors are held from here on
        except BaseException:
            for lock in self._locks:
                lock.release()
            self.dir.close()
            raise
        #: the home root (the array's first member: its saved index and stats)
        self.root = Path(self.dir.path)
        #: every root of the tier (one for a plain root)
        self.roots = tuple(Path(m.path) for m in self.dir.members)
        self.pools = {p.name: p for p in pools}
        self.num_slots = num_slots
        self.io_path = io_path
        self.fsync = fsync
        self.verify = verify
        self.device_id = device_id
        self.direct_io = direct_io
        self._max_nbytes = max(p.block_nbytes for p in pools)
        self._local = threading.local()
        self._executor = IOThreads(io_threads)
        #: per key, extra header metadata for its next write (set by the cache)
        self.block_meta: dict[Key, dict] = {}
        #: how a single block's file moves (POSIX, or kvikio for device buffers), chosen once
        self.block_io: BlockIO = block_io(io_path, fsync, direct_io, verify, self._staging, device_id, io_threads,
                                          settings.kvikio_task_size, settings.kvikio_gds_threshold)
        self._native = self._batches = None
        #: the native engine's held descriptors and free files (None with the python engine)
        self.open_files: OpenFiles | None = None
        if self.engine in ("io_uring", "threads"):
            self._native = NativeIO(native_threads(self.engine, io_threads, len(self.dir.members)),
                                    uring=self.engine == "io_uring")
            if open_files and not self.shared:  # shared: see the open_files argument
                sizes = len({file_size(p.block_nbytes) for p in pools})
                want = num_slots * len(pools) + FREE_FILES * sizes if open_files < 0 else open_files
                self.open_files = OpenFiles(self.dir.fd, want, recycle=not self.shared, free_files=free_files)
            self._batches = BlockBatches(self.dir, self.pools, self._native, self._executor, fsync, verify,
                                         direct_io, device_id, self.block_meta, self._drop_failed, self.open_files)
        #: reads into the rows of one host buffer with no Python per block (None: this tier's
        #: engine cannot vouch for reads in C; see :meth:`submit_rows`)
        self.row_reads = RowReads(self._batches) if self._batches is not None and verify and native_hash() else None
        #: writes from the rows of one host buffer laid out as arrays (None: this tier's engine
        #: cannot make headers in C; see :meth:`submit_row_writes`)
        self.row_writes = RowWrites(self._batches) if self._batches is not None and native_hash() else None

    # -- paths -------------------------------------------------------------------------
    def path(self, key: Key, pool: str) -> RootPath:
        """The file of ``key`` in ``pool`` (relative to its subdirectory's descriptor)."""
        return self.dir.block_path(key, pool)

    def dir_of(self, key: Key) -> RootDir:
        """The subdirectory of ``key``'s files."""
        return self.dir.subdir(block_subdir(key), create=True)

    def _listing(self, result: ScanResult | None = None, dirs: list[str] | None = None
                 ) -> list[tuple[RootDir, os.DirEntry]]:
        """Every entry of the block subdirectories (or of ``dirs``), with its directory; the
        root's own entries come first when ``dirs`` is None (flat-layout block files there
        are moved into their subdirectories when ``result`` is given, which counts them)."""
        out: list[tuple[RootDir, os.DirEntry]] = []
        if dirs is not None:
            for name in dirs:
                d = self.dir.subdir(name, create=True)
                with d.scandir() as entries:
                    out.extend((d, e) for e in entries)
            return out
        with self.dir.scandir() as entries:
            top = list(entries)
        for entry in top:
            kind = classify(entry.name)
            if kind == "block" and result is not None and entry.is_file(follow_symlinks=False):
                parsed = parse_filename(entry.name)
                if parsed is not None and parsed[1] in self.pools:
                    try:
                        self.dir.child(entry.name).rename(self.path(*parsed))
                        result.migrated += 1
                        continue
                    except FileNotFoundError:  # another process moved it
                        continue
                    except OSError as exc:  # a root array's subdirectory on another device: left
                        if exc.errno != errno.EXDEV:
                            raise
            if kind in ("temporary", "block") or (kind == "foreign" and entry.name not in _SUBDIR_NAMES):
                out.append((self.dir, entry))
        for d in self.dir.block_dirs():
            with d.scandir() as entries:
                out.extend((d, e) for e in entries)
        return out

    # -- index rebuild -----------------------------------------------------------------
    def scan(self, dirs: list[str] | None = None, known: Callable[[Key], bool] | None = None) -> ScanResult:
        """Rebuild the list of complete blocks from the files in the root (see class doc).

        Args:
            dirs: only these block subdirectories (a reconciliation with the saved index,
                while the cache runs): this process's own temporary files are left alone.
            known: ``known(key)`` is True for keys the index holds: a complete set of their
                files is listed in ``known`` without reading headers.
        """
        result = ScanResult()
        found: dict[Key, dict[str, RootPath]] = {}
        for d, entry in self._listing(result, dirs):
            kind = classify(entry.name)
            try:
                regular = entry.is_file(follow_symlinks=False)
            except OSError:
                regular = False
            if kind == "temporary" and regular:
                # exclusive: left by a writer that died (this process holds the lock); shared: only
                # provably abandoned ones (sharing.tmp_abandoned), never a live writer's
                if dirs is not None and (tmp_owner(entry.name) or (0,))[0] == os.getpid():
                    continue  # this process's write in flight, or a free file it holds
                if (not self.shared or self._abandoned(entry)) and d.child(entry.name).unlink():
                    result.removed_tmp += 1
                continue
            if kind == "own":
                continue
            parsed = parse_filename(entry.name)
            if (parsed is None or parsed[1] not in self.pools or not regular or d is self.dir
                    or d.path.name != block_subdir(parsed[0])):
                result.foreign.append(entry.name if d is self.dir else f"{d.path.name}/{entry.name}")
                continue
            found.setdefault(parsed[0], {})[parsed[1]] = d.child(entry.name)
        if known is not None:
            for key in [k for k, by_pool in found.items() if len(by_pool) == len(self.pools) and known(k)]:
                del found[key]
                result.known.append(key)
        checks = [(key, pool, path) for key, by_pool in found.items() for pool, path in by_pool.items()]
        checked = dict(zip(((k, p) for k, p, _ in checks),
                           self._executor.map(lambda c: self._check_file(*c), checks)))
        bad = {kp: reason for kp, (reason, _) in checked.items()}
        for key, by_pool in found.items():
            if any(bad[(key, p)] == _VANISHED for p in by_pool):
                result.incomplete.append(key)
                continue
            reasons = [bad[(key, p)] for p in by_pool if bad[(key, p)]]
            if reasons:
                for pool, path in by_pool.items():
                    self._quarantine(path, bad[(key, pool)] or "another pool's file of this block is bad")
                    result.quarantined.append((path.name, bad[(key, pool)] or "sibling bad"))
                continue
            if set(by_pool) != set(self.pools):
                result.incomplete.append(key)
                continue
            try:
                mtime = max(p.lstat_strict().st_mtime for p in by_pool.values())
            except FileNotFoundError:  # removed while we looked (not by a tiercache writer: we hold the lock)
                result.incomplete.append(key)
                continue
            result.blocks.append((key, mtime))
            extra = checked[(key, next(iter(by_pool)))][1]
            if extra:
                result.extra[key] = extra
        result.blocks.sort(key=lambda kv: kv[1])
        return result

    def remove_top_temporaries(self) -> int:
        """Remove the temporary files in the root itself (left by a process killed while it
        saved the index or stats): all of them on an exclusive root, abandoned ones on a
        shared root. Returns how many were removed. (The full :meth:`scan` does this too.)"""
        removed = 0
        for member in self.dir.members:
            with member.scandir() as it:
                entries = [e for e in it if classify(e.name) == "temporary"]
            for e in entries:
                try:
                    if not e.is_file(follow_symlinks=False):
                        continue
                except OSError:
                    continue
                if (not self.shared or self._abandoned(e)) and member.child(e.name).unlink():
                    removed += 1
        return removed

    def _abandoned(self, entry: os.DirEntry) -> bool:
        try:
            age = time.time() - entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            return False
        return tmp_abandoned(entry.name, age, self.tmp_max_age_s)

    #: a shared root's sweeps take at most this share of the time: the next sweep waits this many
    #: times as long as the last one took (a listing of a million files takes seconds)
    SWEEP_DUTY = 0.1

    def sweep_gap(self, interval_s: float) -> float:
        """Seconds from the end of the last :meth:`sweep` before the next: ``interval_s``, or
        longer where the last sweep took more than :data:`SWEEP_DUTY` of that."""
        return max(interval_s, self.last_sweep_s * (1 - self.SWEEP_DUTY) / self.SWEEP_DUTY)

    last_sweep_s = 0.0  # seconds the last sweep took

    def sweep(self, capacity_blocks: int, keep: set = frozenset()) -> tuple[list[Key], int]:
        """Shared mode: hold the root as a whole to ``capacity_blocks`` complete blocks by
        deleting the least recently used (the newest access or modification time of a block's
        files; readers refresh it with :meth:`touch`) among those published more than
        ``min_age_s`` ago; also removes abandoned temporary files and incomplete blocks
        (files for some pools only) older than ``tmp_max_age_s``. Keys in ``keep`` (this
        process's pinned blocks) are never deleted. Returns the deleted keys and the complete
        blocks left on disk. Its duration is kept (:attr:`last_sweep_s`, :meth:`sweep_gap`)."""
        t0 = time.monotonic()
        try:
            return self._sweep(capacity_blocks, keep)
        finally:
            self.last_sweep_s = time.monotonic() - t0

    def _sweep(self, capacity_blocks: int, keep: set) -> tuple[list[Key], int]:
        found: dict[Key, dict[str, tuple[float, float]]] = {}
        now = time.time()
        for d, entry in self._listing():
            kind = classify(entry.name)
            if kind == "temporary":
                if entry.is_file(follow_symlinks=False) and self._abandoned(entry):
                    d.child(entry.name).unlink()
                continue
            parsed = parse_filename(entry.name) if kind == "block" else None
            if parsed is None or parsed[1] not in self.pools:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            found.setdefault(parsed[0], {})[parsed[1]] = (st.st_mtime, max(st.st_atime, st.st_mtime))
        complete = sorted((max(u for _, u in m.values()), max(p for p, _ in m.values()), k)
                          for k, m in found.items() if len(m) == len(self.pools))
        stale = [k for k, m in found.items()
                 if len(m) < len(self.pools) and now - max(p for p, _ in m.values()) > self.tmp_max_age_s]
        self.delete(stale)
        over = len(complete) - capacity_blocks
        gone = [k for _, mtime, k in complete if now - mtime > self.min_age_s and k not in keep][:max(over, 0)]
        self.delete(gone)
        return gone, len(complete) - len(gone)

    def touch(self, keys: list[Key]) -> None:
        """Shared mode: mark ``keys`` as just used, for :meth:`sweep`'s order, by setting the
        access time of their first pool's file to now (its modification time, the
        publication time that ``min_age_s`` counts from, is kept): one ``stat`` and one
        ``utimensat`` per block. Files deleted meanwhile are skipped."""
        pool = next(iter(self.pools))
        now_ns = time.time_ns()
        for k in keys:
            path = self.path(k, pool)
            try:
                st = os.stat(path.name, dir_fd=path.dir_fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    os.utime(path.name, ns=(now_ns, st.st_mtime_ns), dir_fd=path.dir_fd, follow_symlinks=False)
            except (FileNotFoundError, PermissionError):  # gone, or another user's file: no refresh
                pass

    def header_extra(self, key: Key) -> dict:
        """The ``extra`` metadata of ``key``'s first pool file's header (for example the
        positions of a partial host block); empty when the file is gone or does not verify
        (its read will then fail and name why)."""
        pool = next(iter(self.pools))
        name = block_filename(key, pool)
        try:
            fd = self.path(key, pool).open(os.O_RDONLY)
        except (OSError, NotRegularFileError):
            return {}
        try:
            return posix_io.read_header(fd, key, self.pools[pool], name).extra
        except (CorruptBlockError, OSError):
            return {}
        finally:
            os.close(fd)

    def evict(self, keys: Sequence[Key]) -> list[Key]:
        """Policy eviction of ``keys`` from the bottom tier; returns the keys whose files were
        deleted. Exclusive mode deletes them; shared mode deletes none: the process only
        forgets them, and the root as a whole is held to capacity by :meth:`sweep` (oldest
        first, sparing files younger than ``min_age_s``), so one process's full index never
        deletes what others just published or still read."""
        if self.shared:
            return []
        recycle = self.open_files is not None and self.open_files.recycle
        if self._native is not None:
            self._unlink_many([self.path(k, p) for k in keys for p in self.pools], recycle)
            return list(keys)
        if recycle:
            assert self.open_files is not None
            paths = [self.path(k, p) for k in keys for p in self.pools]
            kept = self.open_files.recycle_names([p.name for p in paths], [tmp_name(p.name) for p in paths],
                                                 [p.dir_fd for p in paths])
            for path, ok in zip(paths, kept):
                if not ok:
                    self._unlink(path)
            return list(keys)
        self.delete(keys)
        return list(keys)

    def probe(self, keys: Sequence[Key]) -> list[Key]:
        """The ``keys`` whose every pool file is published in the root now (another process
        may have written them): :func:`~tiercache.files.sharing.published`."""
        return [k for k in keys if published(self.dir, k, self.pools) is not None]

    def _drop_failed(self, keys: list[Key]) -> None:
        """After a failed write: exclusive mode deletes every file of those keys (no
        half-written or stale block); shared mode deletes none, since another process may
        have published the same key (content keys name immutable bytes)."""
        if not self.shared:
            self.delete(keys)

    def _check_file(self, key: Key, pool: str, path: RootPath) -> tuple[str | None, dict]:
        """``(why the file is bad or None, its header's extra metadata)``."""
        want = file_size(self.pools[pool].block_nbytes)
        try:
            fd = path.open(os.O_RDONLY)
            try:
                header = posix_io.read_header(fd, key, self.pools[pool], path.name)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
        except CorruptBlockError as exc:
            return str(exc), {}
        except NotRegularFileError:
            return f"{path.name}: not a regular file", {}
        except FileNotFoundError:  # deleted meanwhile (a shared root's other process): not bad
            return _VANISHED, {}
        except OSError as exc:
            return f"{path.name}: unreadable ({exc.strerror})", {}
        if size != want:
            return f"{path.name}: {size} bytes, expected {want} (trailing bytes)", {}
        return None, header.extra

    def _forget(self, names) -> None:
        """Block files being deleted, renamed away or replaced by the ``python`` or kvikio
        path: their held descriptors are not used again."""
        if self.open_files is not None:
            self.open_files.forget(names)

    def _quarantine(self, path: RootPath, reason: str) -> bool:
        self._forget([path.name])
        if self.dir.quarantine(path) is None:
            return False
        log.warning("tiercache: quarantined %s: %s", path.name, reason)
        return True

    def confirm_bad(self, key: Key) -> str | None:
        """``key``'s files checked again as they are on disk, each read into a buffer of its
        own (:func:`~tiercache.files.blockcheck.verify_file`): the first problem, or None when
        every file verifies (then a read that failed its checksum saw its destination change
        under it, and the block is good)."""
        from .blockcheck import verify_file

        for pool in self.pools:
            problem = verify_file(self.path(key, pool))
            if problem is not None:
                return problem
        return None

    def quarantine_block(self, key: Key, reason: str) -> int:
        """Move every file of ``key`` to ``quarantine/`` (a block that failed to verify);
        returns how many files were moved (files already gone are skipped)."""
        return sum(self._quarantine(self.path(key, pool), reason) for pool in self.pools)

    # -- I/O -----------------------------------------------------------------------------
    def _staging(self):
        buf = getattr(self._local, "staging", None)
        if buf is None:
            from tiercache.memory import alloc_host

            buf, owner = alloc_host(self._max_nbytes, pinned=True)
            self._local.staging, self._local.owner = buf, owner
        return buf

    def _write_one(self, key: Key, pool: PoolSpec, buf, publish: bool = True) -> RootPath | None:
        """Write one pool's file of ``key``; with ``publish=False`` return its unflushed
        temporary file (group commit)."""
        final = self.path(key, pool.name)
        extra = self.block_meta.get(key)
        if publish:
            self._forget([final.name])
        return self.block_io.write(final, key, pool, buf, extra, publish)

    def _read_one(self, key: Key, pool: PoolSpec, buf) -> None:
        self.block_io.read(self.path(key, pool.name), key, pool, buf)

    def _write_key(self, key: Key, bufs: dict) -> None:
        try:
            for pool, buf in bufs.items():
                self._write_one(key, self.pools[pool], buf)
        except BaseException:
            self._drop_failed([key])  # no half-written block: every pool's file or none
            raise

    def _stage_key(self, key: Key, bufs: dict) -> list[tuple[RootPath, RootPath]]:
        """Every pool's file of ``key`` as an unflushed temporary file: ``[(tmp, final)]``
        (none left behind when one fails)."""
        staged: list[tuple[RootPath, RootPath]] = []
        try:
            for pool, buf in bufs.items():
                tmp = self._write_one(key, self.pools[pool], buf, publish=False)
                if tmp is not None:
                    staged.append((tmp, self.path(key, pool)))
        except BaseException:
            for tmp, _ in staged:
                tmp.unlink()
            self._drop_failed([key])  # as an unbatched write: no file of a failed block is left
            raise
        return staged

    def _read_key(self, key: Key, bufs: dict) -> None:
        for pool, buf in bufs.items():
            self._read_one(key, self.pools[pool], buf)

    def submit(self, kind: str, items: Sequence[tuple[Key, dict]], deps: Sequence = (), delay_s: float = 0.0,
               skip: Callable[[int], str | None] | None = None) -> list[tuple[Key, Future]]:
        """Start reading or writing blocks on the I/O threads; returns ``[(key, future)]``.

        Args:
            kind: ``"write"`` (buffers -> files) or ``"read"`` (files -> buffers).
            items: ``[(key, {pool: buffer})]``, one ``block_nbytes`` buffer per pool (host NumPy
                row or device CuPy row).
            deps: jobs each task waits for (in its I/O thread) before touching the buffers.
            delay_s: debug delay before the I/O (tests of in-flight transfers).
            skip: ``skip(i)`` returns a reason to fail item ``i`` without I/O (its source was
                never filled), checked after ``deps``.

        A write that fails leaves no file of that key behind; a read that fails raises
        :class:`CorruptBlockError` for files that do not verify.

        Writes of two or more blocks (native engine: two or more files, so one block of many
        pools too) under fsync ``data`` or ``data+dir`` are a group commit: each block's files
        are written as temporary files without a flush of their own, then one ``syncfs``
        makes the batch durable and the files are renamed into place; each block's future
        resolves only then (the same guarantee per block as a flush per file, one device
        flush per batch instead of one per file: docs/performance/files.md).

        With the native engine (:attr:`engine`), host buffers, and device buffers on the
        POSIX path, go through :class:`~tiercache.files.blockbatch.BlockBatches`: one C call
        per chunk of the request instead of one Python task per block.
        """
        if self._batches is not None and (not self.io_path.kvikio or all(
                isinstance(b, (memoryview, np.ndarray)) for _, bufs in items for b in bufs.values())):
            submit = self._batches.submit_write if kind == "write" else self._batches.submit_read
            return submit(items, deps, delay_s, skip)
        if kind == "write" and self.fsync != "none" and len(items) > 1:
            return self._submit_group(items, deps, delay_s, skip)
        fn = self._write_key if kind == "write" else self._read_key

        def task(i: int, key: Key, bufs: dict) -> None:
            before_io(i, deps, delay_s, skip)
            fn(key, bufs)

        read = kind == "read" and not deps
        return [(key, self._executor.submit(task, i, key, bufs, read=read)) for i, (key, bufs) in enumerate(items)]

    def submit_rows(self, keys: list[bytes], pool: str, rows, row_idx, deps: Sequence = (),
                    sums: np.ndarray | None = None, span: tuple[int, int] | None = None) -> Outcome | None:
        """Start reading the blocks of ``keys[i]`` (bytes keys) in ``pool`` into
        ``rows[row_idx[i]]`` (``rows``: 2-D host ``uint8``, one block per row, page-aligned)
        with no Python per block (:class:`~tiercache.files.rowreads.RowReads`); returns the
        request's :class:`~tiercache.files.blockbatch.Outcome` (errors by index into ``keys``,
        as :meth:`submit` raises them per block), or None where this path does not apply
        (the ``python`` engine, ``verify`` off, no native XXH3-64, rows that are not one
        aligned block each): then use :meth:`submit`. ``rows`` may be a
        :class:`~tiercache.files.blockpieces.BlockPieces` instead (block ``row_idx[i]`` of it
        read in place; None where the engine cannot move blocks in pieces). The caller keeps the keys from being
        written or evicted until the outcome is settled (the row store pins them). With
        ``sums`` the data's checksums are left to the caller (:meth:`RowReads.submit
        <tiercache.files.rowreads.RowReads.submit>`), and with ``span`` one byte range of each
        block's data is read (ibid.)."""
        if self.row_reads is None or not self.row_reads.applies(pool, rows):
            return None
        return self.row_reads.submit(keys, pool, rows, row_idx, deps, sums, span)

    def submit_row_writes(self, keys: Sequence[Key], pool: str, rows, row_idx, deps: Sequence = (),
                          sums: np.ndarray | None = None) -> Outcome | None:
        """Start writing ``rows[row_idx[i]]`` as the block of ``keys[i]`` (int or bytes keys) in
        ``pool`` (``rows``: 2-D host ``uint8``, one block per row) with the request laid out as
        arrays (:class:`~tiercache.files.rowwrites.RowWrites`); returns the request's
        :class:`~tiercache.files.blockbatch.Outcome` (errors by index into ``keys``, as
        :meth:`submit` gives them per block), or None where this path does not apply (the
        ``python`` engine, no native XXH3-64, rows that are not one aligned block each, a key
        with extra header metadata): then use :meth:`submit`. A one-pool tier only (every
        pool's file of a block is written by one request). The rows must not change until the
        outcome is settled. ``rows`` may be a :class:`~tiercache.files.blockpieces.BlockPieces`
        instead, as for :meth:`submit_rows`. With ``sums`` the headers carry the data
        checksums the caller computed (:meth:`RowWrites.submit
        <tiercache.files.rowwrites.RowWrites.submit>`)."""
        if self.row_writes is None or len(self.pools) != 1 or not self.row_writes.applies(pool, rows):
            return None
        if self.block_meta and any(self.block_meta.get(k) for k in keys):
            return None
        return self.row_writes.submit(keys, pool, rows, row_idx, deps, sums)

    def submit_row_pools(self, keys: list[Key], rows: dict[str, np.ndarray], row_idx, deps: Sequence = ()
                         ) -> list[tuple[Key, BlockFuture]] | None:
        """:meth:`submit_rows` of every pool of a request at once: ``keys[i]``'s file of
        pool ``p`` into ``rows[p][row_idx[i]]`` (``rows[p]``: a host array of one block of
        ``p`` per row, any dtype and block shape, C-contiguous; viewed as raw bytes), int or
        bytes keys. Returns ``[(key, future)]`` as :meth:`submit` does (a block failed where
        any of its files did: the first error; the futures share one outcome), or None where
        the row path does not apply to every pool (then use :meth:`submit`)."""
        if self.row_reads is None or not rows:
            return None
        raw: dict[str, np.ndarray] = {}
        for name, arr in rows.items():
            if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous or not len(arr):
                return None
            raw[name] = arr.reshape(len(arr), -1).view(np.uint8)
            if not self.row_reads.applies(name, raw[name]):
                return None
        idx = np.asarray(row_idx, dtype=np.int64)
        outcome = all_settled([self.row_reads.submit(keys, name, view, idx, deps) for name, view in raw.items()])
        return [(k, BlockFuture(outcome, i)) for i, k in enumerate(keys)]

    def _submit_group(self, items, deps, delay_s, skip) -> list[tuple[Key, Future]]:
        futures = [Future() for _ in items]

        def rename_all(pairs):
            self._forget([final.name for _, final in pairs])
            return python_rename_all(pairs)

        group = GroupCommit(self.dir, self.fsync, [k for k, _ in items], len(items), rename_all,
                            self._drop_failed, settle_futures(futures))

        def task(i: int, key: Key, bufs: dict) -> None:
            try:
                before_io(i, deps, delay_s, skip)
                group.staged[i] = self._stage_key(key, bufs)
            except BaseException as exc:
                group.fail(i, exc)
            finally:
                group.task_done()

        for i, (key, bufs) in enumerate(items):
            self._executor.submit(task, i, key, bufs)
        return [(key, f) for (key, _), f in zip(items, futures)]

    def run_task(self, fn: Callable[[], None]) -> Future:
        """Run ``fn()`` on the tier's I/O threads, after every write (and every read that
        waits for another job) queued before it has started (first in, first out; reads that
        wait for nothing may go ahead): work that must not hold up its caller, such as
        removing evicted files."""
        return self._executor.submit(fn)

    def _wait(self, futures: list[tuple[Key, Future]]) -> dict[Key, BaseException | None]:
        return {key: fut.exception() for key, fut in futures}

    def write(self, items: list[tuple[Key, dict]]) -> dict[Key, BaseException | None]:
        """Write blocks and wait (see :meth:`submit`). Returns, per key, None or its error."""
        return self._wait(self.submit("write", items))

    def read(self, items: list[tuple[Key, dict]]) -> dict[Key, BaseException | None]:
        """Read blocks and wait (see :meth:`submit`). Returns, per key, None or its error
        (:class:`CorruptBlockError` for files that do not verify)."""
        return self._wait(self.submit("read", items))

    def delete(self, keys: list[Key]) -> None:
        """Remove the files of ``keys`` (missing files are ignored; a directory under a block's
        name is left in place, with a warning).

        Raises:
            OSError: a name that could not be removed for another reason (the first of them;
                the others were still tried).
        """
        if self._native is not None:
            self._unlink_many([self.path(k, p) for k in keys for p in self.pools], False)
            return
        for key in keys:
            for pool in self.pools:
                self._unlink(self.path(key, pool))

    def _unlink_many(self, paths: list[RootPath], recycle: bool) -> None:
        """Remove ``paths`` in one native batch (the unlinks run on the C threads, in
        parallel, with no Python per file). With ``recycle``, a file whose writable
        descriptor the open-file cache holds (and has room to keep free) is renamed to a
        temporary name instead, where the name still holds that descriptor's inode, and kept
        as a free file for a later write (:meth:`OpenFiles.recycle_names`, in C)."""
        assert self._native is not None
        n = len(paths)
        if n == 0:
            return
        names = [p.name for p in paths]
        of = self.open_files
        taken = of.take_recyclable(names) if recycle and of is not None else [None] * n
        drop = of.forget([name for name, e in zip(names, taken) if e is None], close=False) if of is not None else {}
        ops = Ops(n, self._native.heads(0))
        ops.names = [name.encode() for name in names]
        ops.dirs = np.fromiter((p.dir_fd for p in paths), np.int32, n)
        if drop:  # unused descriptors of the deleted files: closed by the C threads after their unlink
            for j, name in enumerate(names):
                e = drop.pop(name, None)
                if e is not None:
                    ops.fd[j] = e.fd
                    ops.flags[j] = DROP_FD
        tmps: list[str] = []
        if any(e is not None for e in taken):
            tmps = [tmp_name(name) for name in names]
            ops.finals = [t.encode() for t in tmps]
            for j, e in enumerate(taken):
                if e is not None:
                    ops.flags[j] = RECYCLE
                    ops.kept_ino[j] = e.ino
        try:
            self._native.run(UNLINK, self.dir.fd, ops)
        except BaseException:
            for fd in ops.fd[ops.fd >= 0].tolist():  # not run: the descriptors are still ours
                os.close(fd)
            raise
        finally:
            if tmps:
                assert of is not None
                of.settle_recycled(taken, tmps, ops.dirs.tolist(), (ops.got == 1).tolist())
        first: OSError | None = None
        for j, err in enumerate(ops.err.tolist()):
            if err in (0, errno.ENOENT):
                continue
            st = paths[j].lstat() if err in (errno.EISDIR, errno.EPERM) else None
            if st is not None and stat.S_ISDIR(st.st_mode):
                log.warning("tiercache: %s: a directory, not a block file; left in place", paths[j])
            elif first is None:
                first = error_for(err, str(paths[j]))
        if first is not None:
            raise first

    def _unlink(self, path: RootPath) -> None:
        self._forget([path.name])
        try:
            path.unlink()
        except NotRegularFileError as exc:
            log.warning("tiercache: %s", exc)

    def describe_key(self, key: Key) -> str:
        """A short name of the files of ``key``, for messages."""
        return f"block_{key_text(key)}_pool_*.bin"

    def close(self, before_unlock: Callable[[], None] | None = None) -> None:
        """Stop the I/O threads (after the running ones finish), close held files (deleting
        free files), call ``before_unlock`` (the index checkpoint: nothing of this process
        changes the root any more) and release the root's lock."""
        self._executor.shutdown(wait=True)
        if self._native is not None:
            self._native.close()
            self._native = None  # deletes from ``before_unlock`` (the checkpoint's) take the Python path
        if self.open_files is not None:
            self.open_files.close()
        try:
            if before_unlock is not None:
                before_unlock()
        finally:
            for lock in self._locks:
                lock.release()
        self.dir.close()
