"""Rows of an engine's host buffer <-> block files: asynchronous store and load jobs by
content key, for serving engines whose own CPU tier holds the KV bytes (vLLM's offloading
tiers, SGLang's HiCache storage backends).

An engine keeps its host KV cache as one buffer of rows, ``[num_rows, row_bytes]`` (one row
per block or chunk). :class:`RowStore` writes rows to tiercache's block files (one file per
key: 4 KiB header, XXH3-64 of the data, atomic publication) and reads them back into rows,
straight between the row and the file (O_DIRECT where the rows are page-aligned), on the file
tier's native I/O engine. Nothing is copied on the way beyond what the checksum reads.

- **Jobs.** :meth:`RowStore.submit_store` and :meth:`RowStore.submit_load` return at once;
  :meth:`RowStore.finished` hands back each job's :class:`RowJobResult` (per key: done or
  why not) once its last file settled; :meth:`RowStore.drain` waits for every job.
- **Keys** are content keys (bytes, 1..64): the same key names the same bytes in every
  process, which is what lets processes share a root (``sharing = "shared"``).
- **State without the disk.** :meth:`RowStore.state` answers from memory: ``PRESENT``,
  ``ABSENT``, or ``PENDING`` while a store of the key is in flight (and, on a shared root,
  while a background probe looks for another process's file of it).
- **Capacity.** At most ``capacity_blocks`` blocks: a store that needs room evicts the least
  recently used blocks that no load is reading (:meth:`RowStore.touch` refreshes); their
  files go on an I/O thread, before any later write of the same key. A shared root is held
  to its capacity as a whole by a background sweep (:meth:`FileTier.sweep
  <tiercache.files.FileTier.sweep>`).
- **Never a wrong byte.** A load whose file fails its header or checksum fails that key; the
  file is quarantined, the key forgotten, and the key's row is zeroed before the job is
  reported, so no unverified byte stays in it (a load given ``sums`` leaves the data's
  checksum to its caller, who compares it before using the row: the vLLM connector, on the
  GPU). A store that fails leaves no file of its key.

Depends on :mod:`tiercache.files` and :mod:`tiercache.placement`.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from tiercache.errors import (
    ArrayMismatchError,
    ClosedError,
    ConfigError,
    CorruptBlockError,
    InvalidKeyError,
    KeyNotFoundError,
    SlotRangeError,
    TierFullError,
    TornReadError,
)
from tiercache.files import (
    FREE_FILES,
    SUBDIRS,
    BlockPieces,
    FileTier,
    IOPath,
    Outcome,
    block_subdir_index,
    file_size,
    select_io_path,
    when_all_settled,
    write_stats,
)
from tiercache.geometry import PoolSpec
from tiercache.keys import MAX_BYTES_KEY
from tiercache.placement import LRU, CompactSlots, EvictionPolicy, NegativeCache, RootIndex, TouchThrottle
from tiercache.settings import FileSettings, SharingSettings, sections
from tiercache.transfer import LATENCY_BUCKETS_S, TransferStats

log = logging.getLogger("tiercache")

#: single settings RowStore takes by name: the [file] and [sharing] sections' (tiercache.settings)
_ROWSTORE_KEYS = frozenset(f.name for c in (FileSettings, SharingSettings) for f in dataclasses.fields(c)) - {
    "root",
    "roots",
}
#: the one pool of a row store's files (``block_x<key>_pool_kv.bin``)
POOL = "kv"


class KeyState(enum.Enum):
    """Where a key stands, as :meth:`RowStore.state` sees it without touching the disk."""

    ABSENT = "absent"
    PRESENT = "present"
    #: a store of the key is in flight, or (shared roots) a probe for another process's file
    PENDING = "pending"


@dataclass
class RowJobResult:
    """What one store or load job did.

    Attributes:
        job_id: the id given to the submit call.
        kind: ``"store"`` or ``"load"``.
        keys: the job's keys, in order.
        failed: key -> why, for every key that was not stored or loaded.
        skipped: stores only: keys already stored (or being stored) that were not written again.
        nbytes: bytes moved between rows and files (failed keys excluded).
        seconds: from the submit call to the job's last file (wall time).
    """

    job_id: Hashable
    kind: str
    keys: list[bytes]
    failed: dict[bytes, BaseException] = field(default_factory=dict)
    skipped: list[bytes] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0
    #: loads given ``sums``: True where the data's checksums were left to the caller (the
    #: headers' values are in ``sums``); False where they were verified here as usual.
    #: Stores given ``sums``: True where the headers took the caller's checksums; False where
    #: the data was hashed here as usual
    sums_only: bool = False

    @property
    def success(self) -> bool:
        """True when every key was stored (or already stored) or loaded."""
        return not self.failed

    @property
    def done_keys(self) -> list[bytes]:
        """The keys that succeeded, in order."""
        return [k for k in self.keys if k not in self.failed]


class _Eviction:
    """Files of evicted keys being removed on an I/O thread; a later write of one of those
    keys waits for it (``wait_host``, the dependency protocol of :meth:`FileTier.submit`)."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = threading.Event()

    def wait_host(self) -> None:
        self.event.wait()


@dataclass
class _Job:
    result: RowJobResult
    items: list[tuple[bytes, int]]  # (key, row) of the keys that went to the disk
    start: float
    futures: list = field(default_factory=list)
    #: a load read by the file tier's row reads: its errors by index into ``items``
    outcome: Outcome | None = None
    #: the job's blocks are in pieces of the caller's memory (``items``' rows index it), not rows
    pieces: BlockPieces | None = None
    #: a load into rows of this device array (``items``' rows index it), not the host rows
    device_rows: Any = None
    #: a load whose data checksums go to the caller: ``uint64`` per key of the load, in order
    sums: _Sums | None = None
    #: a store whose data checksums the caller made: ``uint64`` per item, in order
    store_sums: np.ndarray | None = None
    #: a load of a span of each block's data: (start, length) bytes
    span: tuple[int, int] | None = None


class RowStore:
    """Block files for the rows of an engine's host buffer (see the module docstring).

    Args:
        rows: the engine's buffer: any C-contiguous array or buffer whose first axis is the
            row (``[num_rows, ...]``; a ``memoryview``, NumPy array, or a CPU tensor's
            ``.numpy()``); each row is one block of ``row_bytes`` bytes. Loads need it
            writable. Rows that start on a 4 KiB boundary and are 4 KiB multiples are read
            and written with O_DIRECT.
        root: the directory of the block files (a tiercache root: created, marked and locked,
            :class:`~tiercache.files.FileTier`), or a list of directories, one per device (a
            root array: blocks spread over them by a hash of the key,
            :mod:`tiercache.files.rootarray`).
        capacity_blocks: the most blocks the store holds (default: as ``capacity_bytes``
            allows, and with ``capacity_bytes`` 0: 90% of the root's file system's free space
            at open, plus what the root's blocks already take (a root array: the members' count
            times the least of theirs: each member holds an even share); each block takes
            ``file_size(row_bytes)``: its row plus the 4 KiB header, 4 KiB-padded).
        file_settings: the ``[file]`` settings (:class:`~tiercache.settings.FileSettings`;
            their ``root`` is replaced by ``root``): ``capacity_bytes`` (disk bytes the blocks
            may take; the smaller of it and ``capacity_blocks`` holds), ``fsync`` (``none``: a
            power loss may drop recent blocks, a stale file then fails its checksum and is
            quarantined, never served; ``data``: group commit, data on the disk before the
            rename; ``data+dir``), ``verify_checksums``, ``io_engine``, ``io_threads`` (each
            runs a chunk of a job's files at a time), ``open_files``, ``direct_io`` (where rows
            are aligned), ``check_root_owner``, ``index_checkpoint_s`` (seconds between saves
            of the root's index, what the next open starts from; also saved at close; the open
            reconciles it with the directory in the background, :meth:`wait_reconciled`).
        sharing_settings: the ``[sharing]`` settings: ``exclusive`` or ``shared`` (any number
            of processes, each seeing the others' blocks: docs/sharing.md); shared
            roots: files younger than ``min_age_s`` are not swept, a key found in no file is
            not looked for again for ``negative_ttl_s``, temporary files older than
            ``tmp_max_age_s`` are abandoned, at most one capacity sweep per
            ``sweep_interval_s`` (longer where a sweep takes more than a tenth of that).
        on_finish: called with a job's id from the I/O thread that settles its last file, once
            :meth:`finished` can report it (a waiter's wake-up; it must not call back into the
            store, and must be quick).
        device: the CUDA device whose memory loads may also go straight into (rows of a device array,
            :meth:`submit_load`'s ``device_rows``), by the path ``io_mode`` selects
            (:func:`~tiercache.files.select_io_path`: ``auto`` takes GDS where the cuFile driver
            reports it, else tiercache's POSIX reads through pinned staging; ``compat``: kvikio's
            compatibility mode); :attr:`device_path` is the path taken and why.
        **settings: single ``[file]`` and ``[sharing]`` settings by name (``fsync="none"``,
            ``sharing="shared"``), over the two sections. Their defaults are the cache's
            (:mod:`tiercache.settings`).

    Raises:
        ConfigError: a bad value (named, with the valid range).
        IOPathError: with a ``device``, an ``io_mode`` of ``gds`` or ``compat`` that cannot run here.
        ArrayMismatchError: ``rows`` is not a C-contiguous buffer of at least one row.
        RootError: see :class:`~tiercache.files.FileTier` (another process holds the root in
            another mode, a root that is not tiercache's, ...).
    """

    def __init__(self, rows, root: str | os.PathLike | Sequence[str | os.PathLike], *,
                 capacity_blocks: int | None = None,
                 file_settings: FileSettings | None = None, sharing_settings: SharingSettings | None = None,
                 on_finish: Callable[[Hashable], None] | None = None, device: int | None = None,
                 **settings) -> None:
        self.on_finish = on_finish
        self.rows = _row_view(rows)
        self._row_views: list[np.ndarray | None] | None = None
        self.num_rows, self.row_bytes = self.rows.shape
        bad = sorted(set(settings) - _ROWSTORE_KEYS)
        if bad:
            raise ConfigError(
                f"RowStore: unknown setting(s) {', '.join(bad)}; valid: {', '.join(sorted(_ROWSTORE_KEYS))}"
            )
        got = sections({"file": file_settings, "sharing": sharing_settings}, **settings)
        if isinstance(root, (list, tuple)):
            fs: FileSettings = got["file"].replace(roots=tuple(root), root=None)
        else:
            fs = got["file"].replace(root=Path(cast("str | os.PathLike[str]", root)), roots=None)
        ss: SharingSettings = got["sharing"]
        self.file_settings, self.sharing_settings = fs, ss
        #: the home root (a root array's first member); :attr:`roots`: every root
        self.root = fs.root
        self.roots = fs.all_roots
        self.file_bytes = file_size(self.row_bytes)
        self.capacity_blocks = self._capacity(fs.capacity_bytes or None, capacity_blocks)
        self.shared = ss.shared
        self.sharing, self.fsync = ss.sharing, fs.fsync
        self.negative_ttl_s, self.sweep_interval_s = float(ss.negative_ttl_s), float(ss.sweep_interval_s)
        self.pool = PoolSpec(POOL, (self.row_bytes,), "uint8")
        # recycled files (exclusive roots) take disk space too: they come out of the capacity
        free_files = 0 if self.shared else min(FREE_FILES, self.capacity_blocks // 16)
        CompactSlots.check_fits("file", self.capacity_blocks)  # before anything is created on disk
        #: how loads into device rows reach the files (with a ``device``; ``io_mode`` chooses)
        self.device_path: IOPath | None = select_io_path(fs.io_mode) if device is not None else None
        self.ft = FileTier((self.pool,), self.capacity_blocks, self.device_path or IOPath("posix", "host rows"), fs,
                           ss, device_id=device or 0, free_files=free_files)
        self.capacity_blocks -= free_files
        self._lock = threading.RLock()
        self._cv = threading.Condition(threading.Lock())  # completions -> drain()
        self._done: collections.deque = collections.deque()  # filled by I/O threads
        self.index = CompactSlots("file", self.capacity_blocks, group=block_subdir_index)
        #: which keys make room when the store is full (:class:`~tiercache.placement.EvictionPolicy`)
        self.eviction: EvictionPolicy = LRU()
        self._storing: dict[bytes, _Job] = {}
        self._pins: collections.Counter = collections.Counter()
        self._evicting: dict[bytes, _Eviction] = {}
        self._jobs_in_flight = 0
        self._open_ids: set = set()  # job ids submitted and not yet reported by finished()
        self._outcomes: dict = {}  # job id -> the outcome of its row request, until it finishes (help)
        self._finished: list[RowJobResult] = []
        self._removed: list[bytes] = []
        self.counters: collections.Counter = collections.Counter()
        self.transfer_stats = TransferStats()
        self.metrics_name: str | None = None
        self.closed = False
        self._absent = NegativeCache(self.negative_ttl_s)
        self._probing: set[bytes] = set()
        self._probe_q: collections.deque = collections.deque()
        self._touch_q: collections.deque = collections.deque()
        self._touched = TouchThrottle(max(1.0, ss.min_age_s))
        self._sweep_wanted = False
        self._bg_cv = threading.Condition(threading.Lock())
        self._bg_stop = False
        self._bg: threading.Thread | None = None
        #: the root's saved index (``.tiercache-index``): what the open starts from
        self.root_index = RootIndex(self.ft, self.index, self.counters, accepts=lambda k: isinstance(k, bytes),
                                    busy=self._storing.__contains__,
                                    checkpoint_interval_s=fs.index_checkpoint_s)
        try:
            self.scan = self.root_index.rebuild()
        except BaseException:
            self.ft.close()
            raise
        if self.shared:
            self._bg = threading.Thread(target=self._background, name="tiercache-rowstore", daemon=True)
            self._bg.start()

    @staticmethod
    def blocks_for(blocks: int) -> int:
        """The ``capacity_blocks`` at which an exclusive store holds ``blocks`` blocks (its
        recycled free files come out of the capacity: ``min(FREE_FILES, capacity // 16)``)."""
        cap = blocks
        while cap - min(FREE_FILES, cap // 16) < blocks:
            cap += 1
        return cap

    # -- setup -------------------------------------------------------------------------------
    def _capacity(self, capacity_bytes, capacity_blocks) -> int:
        caps = []
        if capacity_blocks is not None:
            _check_int("capacity_blocks", capacity_blocks, 1, 1 << 40)
            caps.append(int(capacity_blocks))
        if capacity_bytes is not None:
            _check_int("capacity_bytes", capacity_bytes, self.file_bytes, 1 << 62,
                       f" (one block of {self.row_bytes} bytes takes {self.file_bytes} bytes on disk)")
            caps.append(int(capacity_bytes) // self.file_bytes)
        if not caps:  # 90% of the free space, plus what the root's blocks take already
            per_root = []
            for root in self.roots:
                probe = root
                while not probe.exists() and probe != probe.parent:
                    probe = probe.parent
                free = shutil.disk_usage(probe).free
                per_root.append(int(free * 0.9) // self.file_bytes + self._blocks_there(root))
            caps.append(max(1, min(per_root) * len(per_root)))
        return min(caps)

    @staticmethod
    def _blocks_there(root: Path) -> int:
        """Block files already in ``root`` (its subdirectories, and its top from a flat root of
        an earlier version): names only, no stat."""
        count = 0
        for d in (root, *(root / sub for sub in SUBDIRS)):
            try:
                with os.scandir(d) as it:
                    count += sum(1 for e in it if e.name.startswith("block_") and e.name.endswith(".bin"))
            except OSError:  # no such subdirectory yet (or unreadable: the open reports it)
                continue
        return count

    # -- keys and rows -----------------------------------------------------------------------
    def pieces_fit(self, pieces: BlockPieces) -> bool:
        """Whether :meth:`submit_store` and :meth:`submit_load` take ``pieces``: blocks of
        :attr:`row_bytes` each in pieces of the caller's memory
        (:class:`~tiercache.files.blockpieces.BlockPieces`), moved in place by the native
        engine (the row reads and writes, with the native XXH3-64 and its streaming form)."""
        ft = self.ft
        return pieces.block_bytes == self.row_bytes and ft.row_reads is not None and ft.row_writes is not None \
            and len(ft.pools) == 1 and ft.row_reads.applies(POOL, pieces) and ft.row_writes.applies(POOL, pieces)

    def _check_pieces(self, pieces: BlockPieces | None) -> int:
        """The number of blocks jobs may address: rows, or blocks of ``pieces``."""
        if pieces is None:
            return self.num_rows
        if not isinstance(pieces, BlockPieces) or not self.pieces_fit(pieces):
            raise ConfigError(f"pieces = {pieces!r:.80}: need a BlockPieces of {self.row_bytes}-byte blocks that "
                              "this store's native engine can move (RowStore.pieces_fit)")
        return len(pieces)

    def _keys_rows(self, keys, rows, num_rows: int | None = None) -> tuple[list[bytes], list[int]]:
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
            raise InvalidKeyError(f"keys = {keys!r:.60}: give a sequence of content keys (bytes)")
        if isinstance(rows, (str, bytes)) or not isinstance(rows, (Iterable, np.ndarray)):
            raise SlotRangeError(f"rows = {rows!r:.60}: give a sequence of row numbers")
        ks = [_content_key(k) for k in keys]
        if len(set(ks)) != len(ks):
            dup = next(k for i, k in enumerate(ks) if k in ks[:i])
            raise InvalidKeyError(f"key {dup.hex()} appears twice in one job")
        rs = [_row_index(r) for r in (rows.tolist() if isinstance(rows, np.ndarray) else rows)]
        if len(ks) != len(rs):
            raise ConfigError(f"{len(ks)} keys but {len(rs)} rows: give one row per key")
        num_rows = self.num_rows if num_rows is None else num_rows
        bad = [r for r in rs if not 0 <= r < num_rows]
        if bad:
            raise SlotRangeError(f"row {bad[0]} outside [0, {num_rows})")
        return ks, rs

    def _items(self, pairs: list[tuple[bytes, int]]) -> list[tuple[bytes, dict]]:
        views = self._row_views  # each row's view, made on its first use (not one per block and job)
        if views is None:
            views = self._row_views = [None] * self.num_rows
        out = []
        for k, r in pairs:
            v = views[r]
            if v is None:
                v = views[r] = self.rows[r]
            out.append((k, {POOL: v}))
        return out

    # -- state -------------------------------------------------------------------------------
    def state(self, key: bytes) -> KeyState:
        """Where ``key`` stands, from memory only (never waits on the disk).

        ``PENDING`` while a store of it is in flight; on a shared root also while a background
        probe looks for another process's file of it (ask again later: the answer is then
        ``PRESENT`` or ``ABSENT``, and an absent key is not looked for again for
        ``negative_ttl_s``). A key that is not a valid content key is ``ABSENT``.
        """
        if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_BYTES_KEY:
            return KeyState.ABSENT
        if self._done:  # results of finished jobs first (a store that just finished is PRESENT)
            with self._lock:
                self._apply()
        # no lock: membership tests of dicts are atomic, and a key enters _storing before the
        # index and leaves it after the index is settled (submit_store, _settle)
        if key in self._storing:
            return KeyState.PENDING
        if key in self.index.slot_of:
            return KeyState.PRESENT
        if not self.shared:
            return KeyState.ABSENT
        with self._lock:
            if self._absent.absent(key):
                return KeyState.ABSENT
            if key not in self._probing:
                self._probing.add(key)
                self._probe_q.append(key)
                self._wake()
            return KeyState.PENDING

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark ``keys`` most recently used (keys not held are ignored)."""
        with self._lock:
            self.index.touch(k for k in keys if isinstance(k, bytes))

    def __contains__(self, key: bytes) -> bool:
        return self.state(key) is KeyState.PRESENT

    def __len__(self) -> int:
        return len(self.index) - len(self._storing)

    # -- jobs --------------------------------------------------------------------------------
    def submit_store(self, keys, rows, job_id: Hashable = None, *, pieces: BlockPieces | None = None,
                     sums: np.ndarray | None = None) -> Hashable:
        """Write rows ``rows[i]`` as the blocks of ``keys[i]``; returns ``job_id`` at once.

        Keys already stored, or being stored, are skipped (content keys: the same bytes).
        Room is made by evicting the least recently used blocks no load is reading; keys that
        find no room fail (:class:`TierFullError`). The rows must not change until the job
        is finished.

        Args:
            keys: content keys (bytes, 1..64 each).
            rows: row indices, one per key (a list or an integer array).
            job_id: any hashable id for the result (default: an increasing integer).
            pieces: blocks in pieces of the caller's memory
                (:class:`~tiercache.files.blockpieces.BlockPieces`, :meth:`pieces_fit`):
                ``rows`` then index its blocks, written from in place (no copy to a row).
            sums: ``uint64 [len(keys)]``: the XXH3-64 (seed 0) of each key's block as the
                caller computed it (on the GPU, where the block was:
                :mod:`tiercache.files.devicehash`); the files' headers carry these and the
                data is not hashed again where the row writes take the job (elsewhere it is,
                and ``sums`` goes unused). A wrong checksum makes its file fail every read
                (a corrupt block, quarantined), never pass one.

        Raises:
            InvalidKeyError, SlotRangeError, ConfigError: bad keys, rows out of range, or
                lengths that differ, ``pieces`` this store cannot take, or ``sums`` of the
                wrong length or dtype (nothing is submitted).
            ClosedError: after :meth:`close`.
        """
        with self._lock:
            self._check_open()
            ks, rs = self._keys_rows(keys, rows, self._check_pieces(pieces))
            if sums is not None and (not isinstance(sums, np.ndarray) or sums.shape != (len(ks),)
                                     or sums.dtype != np.uint64):
                got = f"{getattr(sums, 'dtype', type(sums).__name__)} of shape {getattr(sums, 'shape', None)}"
                raise ConfigError(f"sums: give a uint64 array of {len(ks)} checksums, one per key; got {got}")
            job_id = self._job_id(job_id)
            result = RowJobResult(job_id, "store", ks)
            self._apply()
            new: list[tuple[bytes, int]] = []
            where: list[int] = []  # each new key's place in ``keys`` (its checksum in ``sums``)
            for i, (k, r, slot) in enumerate(zip(ks, rs, self.index.find_many(ks).tolist())):
                if slot >= 0:
                    result.skipped.append(k)
                else:
                    new.append((k, r))
                    where.append(i)
            seen = {k for k, _ in new}
            room = self.index.free_count
            deps = []
            if len(new) > room:
                victims = self._victims(len(new) - room, seen)
                ev = self._evict(victims)
                if ev is not None:
                    deps.append(ev)  # the writes go into the files it frees (recycled: no allocation)
                room += len(victims)
            for k, _ in new[room:]:
                result.failed[k] = TierFullError(
                    f"no room for block {k.hex()}: the {self.capacity_blocks} blocks of {self.root} are all being "
                    "read or written")
            new = new[:room]
            self.counters["dropped_stores"] += len(result.failed)
            job = _Job(result, new, time.monotonic(), pieces=pieces,
                       store_sums=None if sums is None else sums[np.asarray(where[:room], dtype=np.int64)])
            for k, _ in new:  # before the index: a lock-free state() sees PENDING, never PRESENT too early
                self._storing[k] = job
            self.index.add([k for k, _ in new])
            for k, _ in new:  # a key evicted earlier whose files may not be gone yet
                e = self._evicting.get(k)
                if e is not None and e not in deps:
                    deps.append(e)
            self._launch(job, "write", deps)
            return job_id

    def submit_load(self, keys, rows, job_id: Hashable = None, *, pieces: BlockPieces | None = None,
                    device_rows=None, sums: np.ndarray | None = None, span: tuple[int, int] | None = None) -> Hashable:
        """Read the blocks of ``keys[i]`` into rows ``rows[i]``; returns ``job_id`` at once.

        A key that is not stored (or still being stored) fails at once
        (:class:`KeyNotFoundError`). A key whose file is gone fails; one whose file does not
        verify fails and its file is quarantined (:class:`CorruptBlockError`); either way the
        key is forgotten and its row is zeroed before the job is reported. A read that fails
        its checksum while the file verifies on a read of its own (the row was written while
        it was read) fails with :class:`TornReadError`, its row zeroed, and the key and its
        file are kept. The keys read are
        protected from eviction until the job finishes, and marked most recently used.
        With ``pieces`` (as :meth:`submit_store`), ``rows`` index its blocks, read into in
        place, and a failed key's pieces are zeroed. With ``device_rows`` (a store made with
        a ``device``: a CuPy ``uint8`` array ``[n, row_bytes]`` on the GPU, or anything
        ``cupy.asarray`` takes without a copy, such as a CUDA tensor), ``rows`` index its rows,
        read by :attr:`device_path` (GDS: DMA from the file into the row; the header is checked
        on the host and the data's checksum from a copy through pinned staging), and a failed
        key's device row is zeroed.

        With ``sums`` (``uint64 [len(keys)]``, host rows only), each file's header and size
        are checked but its data is not hashed: ``sums[i]`` gets the data checksum of key
        ``i``'s header (where the job's result says :attr:`RowJobResult.sums_only`; where the
        row reads do not apply, the data is verified here as usual). The caller compares each
        checksum with the data's (on the GPU, :mod:`tiercache.files.devicehash`) before it uses
        the row, and hands the keys that do not match to :meth:`reject`.

        With ``span = (start, length)`` (bytes; with ``sums``, host rows only, the native
        engine's row reads) only ``length`` bytes of each block's data from byte ``start`` on
        are read, into the same bytes of the row (the rest of the row is left as it was; where
        the key fails, the span's bytes are zeroed): one layer group of a block whose file holds every layer
        (:meth:`RowReads.submit <tiercache.files.rowreads.RowReads.submit>`). Each file's
        header and size are checked and ``sums[i]`` gets the whole data's checksum: the caller
        compares it once every span of the block is in (its own check of the assembled row).

        Raises:
            InvalidKeyError, SlotRangeError, ConfigError: as :meth:`submit_store`; also
                ``rows`` is read-only, or ``device_rows`` on a store made without
                a ``device`` or not of ``[n, row_bytes]`` bytes.
            ClosedError: after :meth:`close`.
        """
        with self._lock:
            self._check_open()
            dev = None if device_rows is None else self._device_rows(device_rows)
            if pieces is None and dev is None and not self.rows.flags.writeable:
                raise ConfigError("the row buffer is read-only: loads need a writable buffer")
            ks, rs = self._keys_rows(keys, rows, dev.shape[0] if dev is not None else self._check_pieces(pieces))
            if len(set(rs)) != len(rs):
                dup = next(r for i, r in enumerate(rs) if r in rs[:i])
                raise SlotRangeError(f"row {dup} appears twice in one load")
            if sums is not None:
                if dev is not None or pieces is not None or len(sums) != len(ks) or sums.dtype != np.uint64:
                    raise ConfigError(f"sums: give a uint64 array of {len(ks)} checksums, for host rows only")
                sums[:] = 0  # a key that is not read has no checksum to compare
            if span is not None:
                start, length = span
                reads = self.ft.row_reads
                if sums is None or reads is None or not reads.applies(POOL, self.rows) \
                        or not (0 <= start and 0 < length and start + length <= self.row_bytes):
                    raise ConfigError(f"span {span}: give (start, length) within a row's {self.row_bytes} bytes, "
                                      "with sums, on a store whose loads take the native engine's row reads")
            job_id = self._job_id(job_id)
            result = RowJobResult(job_id, "load", ks)
            self._apply()
            go: list[tuple[bytes, int]] = []
            held = (self.index.find_many(ks) >= 0).tolist()
            for k, r, h in zip(ks, rs, held):
                if h and k not in self._storing:
                    go.append((k, r))
                else:
                    why = "is still being stored" if k in self._storing else "is not stored"
                    result.failed[k] = KeyNotFoundError(f"block {k.hex()} {why} in {self.root}")
                    self._zero(pieces, r, dev)  # as for any failed load: no stale byte looks like the block
            self._pins.update(k for k, _ in go)
            self.index.touch(k for k, _ in go)
            pos = {k: i for i, k in enumerate(ks)}
            job = _Job(result, go, time.monotonic(), pieces=pieces, device_rows=dev,
                       sums=None if sums is None else _ordered_sums(sums, [pos[k] for k, _ in go]), span=span)
            self._launch(job, "read", [])
            return job_id

    def _job_id(self, job_id):
        """``job_id`` (or the next number), registered until :meth:`finished` reports it.

        Raises:
            ConfigError: ``job_id`` is a job's still in flight or not yet reported.
        """
        if job_id is None:
            while True:
                self.counters["jobs"] += 1
                if self.counters["jobs"] not in self._open_ids:
                    job_id = self.counters["jobs"]
                    break
        elif job_id in self._open_ids:
            raise ConfigError(f"job_id {job_id!r} is a job still in flight or not yet reported by finished(): "
                              "give each job its own id")
        self._open_ids.add(job_id)
        return job_id

    def _device_rows(self, device_rows):
        """``device_rows`` as a CuPy ``[n, row_bytes]`` uint8 array (no copy), checked."""
        if self.device_path is None:
            raise ConfigError("device_rows: this RowStore was made without a device (RowStore(..., device=0))")
        import cupy

        dev = cupy.asarray(device_rows)
        if dev.ndim != 2 or dev.shape[1] * dev.itemsize != self.row_bytes or not dev.flags.c_contiguous:
            raise ConfigError(f"device_rows of shape {tuple(dev.shape)} and dtype {dev.dtype}: give a C-contiguous "
                              f"[n, {self.row_bytes}] array of bytes")
        return dev.view(cupy.uint8)

    def _launch(self, job: _Job, kind: str, deps: list) -> None:
        self._jobs_in_flight += 1
        if not job.items:
            self._finish(job)
            return
        if job.device_rows is not None:  # the general path: kvikio (GDS, compat) or staged POSIX reads
            futures = self.ft.submit(kind, [(k, {POOL: job.device_rows[r]}) for k, r in job.items], deps=deps)
            job.futures = [f for _, f in futures]
            when_all_settled(job.futures, lambda: self._finish(job))
            return
        keys = [k for k, _ in job.items]
        rows = [r for _, r in job.items]
        # the row reads and writes (tiercache/files/rowreads.py, rowwrites.py): a request as arrays
        src = self.rows if job.pieces is None else job.pieces
        if kind == "read":
            sums = job.sums.scratch if job.sums is not None else None
            job.outcome = self.ft.submit_rows(keys, POOL, src, rows, deps, sums, job.span)
            job.result.sums_only = job.outcome is not None and sums is not None
        else:
            job.outcome = self.ft.submit_row_writes(keys, POOL, src, rows, deps, job.store_sums)
            job.result.sums_only = job.outcome is not None and job.store_sums is not None
        assert job.outcome is not None or job.pieces is None  # pieces only where pieces_fit
        if job.outcome is not None:
            outcome = job.outcome
            self._outcomes[job.result.job_id] = outcome
            outcome.on_settled(lambda: self._finish(job))
            return
        futures = self.ft.submit(kind, self._items(job.items), deps=deps)
        job.futures = [f for _, f in futures]
        when_all_settled(job.futures, lambda: self._finish(job))

    def _finish(self, job: _Job) -> None:
        """The job's files are all settled (in the thread that settled the last one): a
        failed load's rows are zeroed and bad files quarantined here, before anyone hears of
        the job; the index is updated by the owner thread (:meth:`_apply`)."""
        res = job.result
        self._outcomes.pop(res.job_id, None)
        if job.sums is not None and res.sums_only:
            job.sums.deliver()
        errors = job.outcome.errors if job.outcome is not None else None
        for i, (k, r) in enumerate(job.items):
            exc = errors.get(i) if errors is not None else job.futures[i].exception()
            if exc is None:
                res.nbytes += self.row_bytes if job.span is None else job.span[1]
                continue
            if res.kind == "load" and isinstance(exc, CorruptBlockError) and "checksum mismatch" in str(exc) \
                    and self.ft.confirm_bad(k) is None:
                # the file verifies on a read of its own: the row changed while it was read
                # (a caller writing into a row of a load in flight), not the file: keep it
                exc = TornReadError(f"block {k.hex()}: row {r} changed while it was read ({exc}); its file verifies "
                                    "and is kept: do not write into the rows of a load in flight", [k])
            res.failed[k] = exc
            if res.kind == "load":
                if job.span is not None:  # only the span's bytes were read into: the rest of the row is another's
                    self.rows[r, job.span[0]:job.span[0] + job.span[1]].fill(0)
                else:
                    self._zero(job.pieces, r, job.device_rows)  # no unverified byte stays in the row
                if isinstance(exc, CorruptBlockError):
                    self.ft.quarantine_block(k, str(exc))
        res.seconds = time.monotonic() - job.start
        with self._cv:
            self._done.append(job)
            self._cv.notify_all()
        if self.on_finish is not None:
            self.on_finish(res.job_id)

    def _zero(self, pieces: BlockPieces | None, r: int, device_rows=None) -> None:
        if device_rows is not None:
            device_rows[r].fill(0)
        elif pieces is None:
            self.rows[r].fill(0)
        else:
            pieces.zero(r)

    def _victims(self, count: int, protect: set[bytes]) -> list[bytes]:
        return self.eviction.victims(  # type: ignore[return-value]  # a row store's keys are bytes
            self.index.lru, count, lambda k: k in protect or k in self._storing or bool(self._pins.get(k))
        )

    def _evict(self, keys: list[bytes]) -> _Eviction | None:
        """Drop ``keys`` from the index now; their files go on an I/O thread (exclusive roots;
        a shared root's files are left to the sweep). Returns what a write waits on for them."""
        if not keys:
            return None
        self.index.remove(keys)
        self._removed.extend(keys)
        self.counters["evicted_blocks"] += len(keys)
        if self.shared:
            return None
        ev = _Eviction()
        for k in keys:
            self._evicting[k] = ev

        def run() -> None:
            try:
                self.ft.evict(keys)
            except BaseException:  # a file left behind is adopted or replaced later, never served stale
                log.exception("tiercache: evicting %d block(s) from %s", len(keys), self.root)
            finally:
                ev.event.set()
                with self._cv:
                    self._done.append(("evicted", keys, ev))

        self.ft.run_task(run)
        return ev

    # -- completions -------------------------------------------------------------------------
    def _apply(self) -> None:
        """Under the lock: take what the I/O threads and the background thread finished, and
        the reconciliation of the saved index (its dropped keys are reported as removed);
        save the index when a checkpoint is due."""
        self._reconciled()
        self.root_index.tend()
        while self._done:
            item = self._done.popleft()
            if isinstance(item, _Job):
                self._settle(item)
            elif item[0] == "probe":
                self._discovered(item[1], item[2])
            elif item[0] == "swept":
                gone = [k for k in item[1] if k in self.index and k not in self._storing and not self._pins.get(k)]
                self.index.remove(gone)
                self._removed.extend(gone)
                self.counters["evicted_blocks"] += len(gone)
                self.on_disk_blocks = item[2]
            else:  # ("evicted", keys, eviction)
                _, keys, ev = item
                for k in keys:
                    if self._evicting.get(k) is ev:
                        del self._evicting[k]

    def _settle(self, job: _Job) -> None:
        res = job.result
        n_ok = len(job.items) - sum(1 for k, _ in job.items if k in res.failed)
        if res.kind == "store":
            failed = [k for k, _ in job.items if k in res.failed]
            self.index.remove(failed)  # before they leave _storing (see state())
            for k, _ in job.items:
                if self._storing.get(k) is job:
                    del self._storing[k]
            self.counters["stored_blocks"] += n_ok
            if n_ok and self.shared:
                self._sweep_wanted = True
                self._wake()
            self.transfer_stats.record("host", "file", "posix", n_ok, n_ok * self.row_bytes, len(failed), res.seconds)
        else:
            self._pins.subtract(k for k, _ in job.items)
            for k, _ in job.items:
                if self._pins.get(k, 1) <= 0:
                    del self._pins[k]
            bad = [k for k, _ in job.items if k in res.failed and not isinstance(res.failed[k], TornReadError)]
            self.index.remove(bad)  # gone, corrupt or unreadable: a lookup must not promise it again
            self.counters["torn_reads"] += sum(isinstance(e, TornReadError) for e in res.failed.values())
            self._removed.extend(bad)
            self.counters["loaded_blocks"] += n_ok
            self.counters["corrupt_blocks"] += sum(isinstance(res.failed[k], CorruptBlockError) for k in bad)
            self.counters["quarantined_files"] += sum(isinstance(res.failed[k], CorruptBlockError) for k in bad)
            self.counters["vanished_blocks"] += sum(isinstance(res.failed[k], FileNotFoundError) for k in bad)
            to, path = ("device", self.ft.io_path.name) if job.device_rows is not None else ("host", "posix")
            self.transfer_stats.record("file", to, path, n_ok, n_ok * self.row_bytes, len(bad), res.seconds)
            if n_ok and self.shared:
                self._touch_q.append([k for k, _ in job.items if k not in res.failed])
                self._wake()
        self._jobs_in_flight -= 1
        self._finished.append(res)

    def help(self, job_id: Hashable) -> None:
        """Run here the I/O of job ``job_id`` that no I/O thread has started yet
        (:meth:`Outcome.help <tiercache.files.blockbatch.Outcome.help>`): for a caller about to
        wait for that job, which would otherwise wake a thread and sleep until it is done. Call
        it holding none of this store's locks (the job may finish in this thread, and its
        ``on_finish`` hook runs here). Nothing happens for a job that is done, unknown, or on
        the general path."""
        outcome = self._outcomes.get(job_id)
        if outcome is not None:
            outcome.help()

    def reject(self, keys: Iterable[bytes], why: str) -> dict[bytes, BaseException]:
        """Keys of finished loads (with ``sums``) whose data did not match their checksum in
        the caller's own check: each key's file is read again and verified on the host. A file
        that does not verify is quarantined and its key forgotten
        (:class:`CorruptBlockError`); one that does is kept (:class:`TornReadError`: the bytes
        changed on their way, not in the file). ``why`` says where the mismatch was seen.
        Returns key -> that error; the caller treats every key given as not loaded."""
        out: dict[bytes, BaseException] = {}
        for k in keys:
            problem = self.ft.confirm_bad(k)
            if problem is None:
                out[k] = TornReadError(f"block {k.hex()}: {why}; its file verifies and is kept", [k])
                with self._lock:
                    self.counters["torn_reads"] += 1
                continue
            exc = CorruptBlockError(f"block {k.hex()}: {why} ({problem})")
            self.ft.quarantine_block(k, str(exc))
            with self._lock:
                if k in self.index and k not in self._storing:
                    self.index.remove([k])
                    self._removed.append(k)
                self.counters["corrupt_blocks"] += 1
                self.counters["quarantined_files"] += 1
            out[k] = exc
        return out

    def discard(self, keys: Iterable[bytes]) -> list[bytes]:
        """Forget ``keys`` and delete their files now, on a shared root too: blocks whose bytes
        must never be served (a caller learned after the store that they were computed from a
        bad input). Unlike eviction, which leaves a shared root's files to the sweep, another
        process must not find these. Keys not held are skipped; a key whose store is still in
        flight is left alone (wait for its job first). Returns the keys whose files were deleted.

        Raises:
            ClosedError: after :meth:`close`.
            OSError: a file that could not be removed for another reason than being gone.
        """
        with self._lock:
            self._check_open()
            self._apply()
            gone = [k for k in dict.fromkeys(keys)
                    if isinstance(k, bytes) and k in self.index and k not in self._storing]
            if gone:
                self.index.remove(gone)
                self._removed.extend(gone)
                self.counters["discarded_blocks"] += len(gone)
        self.ft.delete(list[Any](gone))
        return gone

    def finished(self) -> list[RowJobResult]:
        """The jobs that finished since the last call (in the order they finished)."""
        with self._lock:
            self._apply()
            out, self._finished = self._finished, []
            self._open_ids.difference_update(r.job_id for r in out)
            return out

    def take_removed(self) -> list[bytes]:
        """Keys that left the store since the last call (evicted for room, swept on a shared
        root, or dropped after a failed load)."""
        with self._lock:
            self._apply()
            out, self._removed = self._removed, []
            return out

    @property
    def jobs_in_flight(self) -> int:
        """Jobs submitted whose files are not all settled yet."""
        with self._lock:
            self._apply()
            return self._jobs_in_flight

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has finished (none is cut short); their results
        stay for :meth:`finished`. Returns False if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                self._apply()
                if self._jobs_in_flight == 0:
                    return True
            with self._cv:
                if self._done:
                    continue
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left if left is not None else 1.0)

    # -- shared roots: probes, sweeps, use times (background thread) -------------------------
    on_disk_blocks: int | None = None

    def _wake(self) -> None:
        with self._bg_cv:
            self._bg_cv.notify()

    def _background(self) -> None:
        last_sweep = 0.0
        while True:
            with self._bg_cv:
                while not (self._bg_stop or self._probe_q or self._touch_q or self._sweep_wanted):
                    self._bg_cv.wait()
                if self._bg_stop:
                    return
            try:
                if self._probe_q:
                    todo: list[bytes] = []
                    while self._probe_q and len(todo) < 4096:
                        todo.append(self._probe_q.popleft())
                    found = self.ft.probe(todo)
                    with self._cv:
                        self._done.append(("probe", todo, found))
                while self._touch_q:
                    self._touch(self._touch_q.popleft())
                if self._sweep_wanted and time.monotonic() - last_sweep >= self.ft.sweep_gap(self.sweep_interval_s):
                    self._sweep_wanted = False
                    with self._lock:
                        keep = set(self._pins) | set(self._storing)
                    gone, left = self.ft.sweep(self.capacity_blocks, keep)
                    last_sweep = time.monotonic()  # from its end (FileTier.sweep_gap)
                    with self._cv:
                        self._done.append(("swept", gone, left))
                elif self._sweep_wanted:
                    time.sleep(min(0.05, self.sweep_interval_s))
            except Exception:
                log.exception("tiercache: background work on shared root %s", self.root)
                time.sleep(0.1)

    def _touch(self, keys: list[bytes]) -> None:
        todo = self._touched.due(keys)
        if todo:
            self.ft.touch(todo)

    def _discovered(self, asked: list[bytes], found: list[bytes]) -> None:
        found_set = set(found)
        for k in asked:
            self._probing.discard(k)
        self._absent.ttl_s = self.negative_ttl_s  # (a caller may have changed it)
        self._absent.mark([k for k in asked if k not in found_set])
        new = [k for k in found if k not in self.index]
        over = len(new) - self.index.free_count
        if over > 0:  # a full index forgets its least recently used (a shared root keeps the files)
            victims = self._victims(over, set(new))
            self.index.remove(victims)
            new = new[: self.index.free_count]
        self.index.add(new)
        self.counters["discovered_blocks"] += len(new)

    # -- stats and close ---------------------------------------------------------------------
    def stats(self, block: bool = True) -> dict:
        """A JSON-ready snapshot in the shape of :meth:`TierCache.stats
        <tiercache.TierCache.stats>` (one ``file`` tier), which :mod:`tiercache.metrics`
        exports and ``tiercache inspect`` shows: blocks held, capacity, bytes on disk, the
        I/O engine, counters (``stored_blocks``, ``loaded_blocks``, ``evicted_blocks``,
        ``dropped_stores``, ``corrupt_blocks``, ``quarantined_files``, ``vanished_blocks``,
        ``discovered_blocks``) and per-direction job totals (``transfers``: ``host`` is the
        engine's rows). ``block`` is accepted for the exporters' call and ignored."""
        if self.closed:
            raise ClosedError("this RowStore is closed")
        with self._lock:
            self._apply()
            used = len(self.index)
            tiers = {"file": {
                "slots": self.capacity_blocks, "used": used, "free": self.index.free_count,
                "bytes_used": used * self.row_bytes, "bytes_capacity": self.capacity_blocks * self.row_bytes,
                "root": str(self.root), "roots": [str(r) for r in self.roots], "bytes_on_disk": used * self.file_bytes,
                "bytes_capacity_on_disk": self.capacity_blocks * self.file_bytes,
                "capacity_bytes": self.capacity_blocks * self.file_bytes,
                "io_engine": self.ft.engine, "io_engine_reason": self.ft.engine_reason,
                "sharing": self.sharing, "on_disk_blocks": self.on_disk_blocks, "fsync": self.fsync,
            }}
            return {
                "io_path": ({"name": "posix", "label": "POSIX", "reason": "host rows"} if self.device_path is None
                            else {"name": self.device_path.name, "label": self.device_path.label,
                                  "reason": self.device_path.reason}),
                "tiers": tiers, "pools": [self.pool.describe()], "blocks": used,
                "pinned_blocks": len(self._pins), "jobs_in_flight": self._jobs_in_flight,
                "counters": dict(self.counters), "metrics_name": self.metrics_name,
                "transfers": self.transfer_stats.snapshot(), "latency_buckets_s": list(LATENCY_BUCKETS_S),
            }

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError("this RowStore is closed")

    def wait_reconciled(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit) for the reconciliation of the root's
        saved index with its directory (started at open for the subdirectories that changed
        since it was saved) and apply it. Returns True when none is running.

        Raises:
            ClosedError: after :meth:`close`.
        """
        self._check_open()
        with self._lock:
            done = self._reconciled(timeout)
            self._apply()
            return done

    def _reconciled(self, timeout: float | None = 0.0) -> bool:
        """Under the lock: apply the index's reconciliation if it has ended (waiting up to
        ``timeout`` seconds); the keys it dropped (files gone) are reported as removed."""
        if not self.root_index.reconciling:
            return True
        if not self.root_index.apply_reconciled(timeout):
            return False
        self._removed.extend(k for k in self.scan.dropped or () if isinstance(k, bytes))
        return True

    def close(self) -> None:
        """Wait for every job (none is cut short), save the stats in the root (for
        ``tiercache inspect``), stop the threads and release the root. Idempotent."""
        if self.closed:
            return
        self.drain()
        try:
            write_stats(self.ft.dir, self.stats())
        except OSError as exc:
            log.warning("tiercache: could not save stats in %s: %s", self.root, exc)
        self.closed = True
        if self._bg is not None:
            with self._bg_cv:
                self._bg_stop = True
                self._bg_cv.notify()
            self._bg.join()
        self.root_index.stop()
        self.ft.close(before_unlock=lambda: self.root_index.checkpoint(closing=True))
        self.rows = None  # type: ignore[assignment]  # the engine may release its buffer now (no export of it is left here)
        self._row_views = None

    def __enter__(self) -> RowStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- a load's checksums for the caller ---------------------------------------------------------
@dataclass
class _Sums:
    """A load's data checksums for the caller (:meth:`RowStore.submit_load`'s ``sums``): the
    row reads write ``scratch`` (one per key read, in the job's order), delivered to the
    caller's ``out[where]`` once the job settles."""

    out: np.ndarray
    where: np.ndarray | None  # None: the job reads every key, in order (scratch is out)
    scratch: np.ndarray

    def deliver(self) -> None:
        if self.where is not None:
            self.out[self.where] = self.scratch


def _ordered_sums(out: np.ndarray, where: list[int]) -> _Sums:
    if where == list(range(len(out))):
        return _Sums(out, None, out)
    return _Sums(out, np.asarray(where, dtype=np.int64), np.zeros(len(where), dtype=np.uint64))


# -- validation ----------------------------------------------------------------------------------
def _row_view(rows) -> np.ndarray:
    """``rows`` as ``uint8 [num_rows, row_bytes]`` over the same memory."""
    try:
        arr = np.asarray(rows)
    except (TypeError, ValueError) as exc:
        raise ArrayMismatchError(f"the row buffer ({type(rows).__name__}) exposes no buffer: {exc}") from None
    if arr.ndim == 0 or arr.shape[0] == 0 or arr.size == 0:
        raise ArrayMismatchError(f"the row buffer has shape {arr.shape}: it needs at least one row")
    if not arr.flags.c_contiguous:
        raise ArrayMismatchError(f"the row buffer (shape {arr.shape}, strides {arr.strides}) is not C-contiguous")
    return arr.reshape(-1).view(np.uint8).reshape(arr.shape[0], -1)


def _content_key(k) -> bytes:
    if isinstance(k, (bytearray, memoryview)):
        k = bytes(k)
    if not isinstance(k, bytes) or not 1 <= len(k) <= MAX_BYTES_KEY:
        what = f"{len(k)} bytes" if isinstance(k, bytes) else type(k).__name__
        raise InvalidKeyError(f"key {k!r} ({what}): a row store takes content keys of 1..{MAX_BYTES_KEY} bytes")
    return k


def _row_index(r) -> int:
    if type(r) is int:  # the common case, before the slower checks
        return r
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
        raise SlotRangeError(f"row {r!r} is not an integer")
    return int(r)


def _check_int(name: str, value, lo: int, hi: int, note: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
        raise ConfigError(f"{name} = {value!r} must be an integer in [{lo}, {hi}]{note}")

