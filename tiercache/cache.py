"""``TierCache``: the public facade an engine uses.

Keys map to slots in up to three tiers (``device`` VRAM, ``host`` pinned DRAM, ``file``
block files). The cache places, spills, onboards and evicts blocks; the engine reads and
writes the bytes of device slots in place through :meth:`TierCache.device_array` or hands
whole arrays to :meth:`TierCache.put` / :meth:`TierCache.get`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np

from tiercache.arrays import host_output, raw_view
from tiercache.config import CacheConfig, load_config
from tiercache.cuda import cuda_status
from tiercache.enginetensors import EngineSlots, OnboardHandle, PreparedOnboard
from tiercache.errors import (
    ArrayMismatchError,
    ClosedError,
    ConfigError,
    InvalidKeyError,
    KeyNotFoundError,
    SlotRangeError,
    TierUnavailableError,
    TransferError,
)
from tiercache.files import FileTier, IOPath, block_subdir_index, select_io_path, write_stats
from tiercache.keys import Key, format_keys, normalize_keys
from tiercache.memory import MemoryTier, make_device_tier, make_host_tier, recycled_empty
from tiercache.moves import BlockMover
from tiercache.placement import TIER_ORDER, FileIndex, Placement
from tiercache.transfer import LATENCY_BUCKETS_S, Job, TransferEngine

log = logging.getLogger("tiercache")
_logged_no_cuda = False


class TierCache:
    """A tiered block cache over VRAM, pinned DRAM and files.

    Create it from a :class:`~tiercache.config.CacheConfig` or a TOML path
    (:meth:`open`); use it as a context manager or call :meth:`close`. All methods are
    thread-safe (one lock); every method returns when its bytes are in place.

    Keys are ints in ``[0, 2**63)`` (block ids) or 1..64 bytes (content hashes). A block has one
    slot per pool in each tier that holds it; a key may be in several tiers at once (a clean
    copy below). When a tier is full, its least recently used unpinned blocks spill to the tier
    below (dropped outright when a copy below exists; evicted when the bottom tier is full);
    a block leaves a tier only after its copy below is complete.

    Without a usable GPU the device tier is off (one log line) and the same API runs over the
    host and file tiers.

    Engines that own their KV-cache tensors register them as the device tier
    (:meth:`for_engine` with :class:`~tiercache.DevicePools`); the device tier is then theirs
    to allocate, and blocks move with :meth:`offload_slots` / :meth:`onboard_slots` by the
    engine's block ids.

    The class is a facade over its parts: :class:`~tiercache.placement.Placement` (which key
    is where), :class:`~tiercache.moves.BlockMover` (copies between tiers, spills),
    :class:`~tiercache.placement.FileIndex` (the file tier's index, partial host blocks),
    :class:`~tiercache.transfer.TransferEngine` (ordered asynchronous copies) and, with the
    engine's tensors, :class:`~tiercache.enginetensors.EngineSlots`.

    Args:
        config: the configuration.
        device_pools: the engine's tensors as the device tier (``config.pools`` must be
            ``device_pools.host_specs(blocks_per_host_block)``; :meth:`for_engine` builds it).
        blocks_per_host_block: device blocks per host/file block (>= 1; > 1 needs a host tier).

    Raises (constructor):
        ConfigError: invalid configuration.
        RootError: unusable file-tier root.
        IOPathError: ``io_mode`` ``gds``/``compat`` that cannot run here.
    """

    def __init__(self, config: CacheConfig, device_pools=None, blocks_per_host_block: int = 1) -> None:
        self._check_engine_args(config, device_pools, blocks_per_host_block)
        self.device_pools = device_pools
        self.blocks_per_host_block = blocks_per_host_block
        self.config = config
        self._lock = threading.RLock()
        self._closed = False
        self._snapshot_at: float | None = None  # when the next periodic stats snapshot is due
        self.counters: Counter[str] = Counter()
        cuda = cuda_status()
        self.io_path: IOPath = (
            select_io_path(config.io_mode, cuda) if config.file_slots else IOPath("posix", "no file tier")
        )
        self._log_no_cuda(cuda)
        self.tiers: dict[str, MemoryTier | FileTier] = {}
        if device_pools is not None:
            self.tiers["device"] = device_pools.memory_tier()
        elif config.device_slots and cuda.available:
            self.tiers["device"] = make_device_tier(config.device_slots, config.pools, config.device_id)
        if config.host_slots:
            self.tiers["host"] = make_host_tier(config.host_slots, config.pools, huge_pages=config.host_huge_pages)
        if config.file_slots:
            self.tiers["file"] = FileTier(config.pools, config.file_capacity_slots, self.io_path,
                                          config.file_settings, config.sharing_settings, config.device_id)
        if not self.tiers:
            raise TierUnavailableError("no tier is usable: the device tier needs CUDA; give host_slots or file_slots")
        # the engine allocates its own device blocks: tiercache never places keys there
        self.placement = Placement({name: self._capacity(name) for name in self.tiers
                                    if not (name == "device" and device_pools is not None)},
                                   file_group=block_subdir_index)
        self.engine = TransferEngine(self.tiers, config.pools, config.device_id, settings=config.transfer_settings,
                                     record_stats=config.metrics)
        # the index makes room through the mover, the mover tells the index what it wrote and read
        self.file_index = FileIndex(self._file_tier, self.placement, blocks_per_host_block, self.counters,
                                    config.sharing_settings, config.index_checkpoint_s,
                                    make_room=lambda n, protect: self.mover.make_room("file", n, protect))
        self.mover = BlockMover(
            self.tiers,
            self.placement,
            self.engine,
            config.pools,
            self.counters,
            after_file_write=self.file_index.after_write,
            after_file_read=self.file_index.after_read,
        )
        self._engine_slots = None if device_pools is None else EngineSlots(
            device_pools, blocks_per_host_block, self.tiers, self.placement, self.mover, self.file_index,
            self.engine, self.counters, self._guarded, self._tier_name)
        #: the root's scan at open (:class:`~tiercache.files.ScanResult`), None without a file tier
        self.scan = self.file_index.rebuild() if "file" in self.tiers else None
        from tiercache.metrics import register_default

        #: the ``cache`` label of its metrics (None until registered in a registry)
        self.metrics_name: str | None = None
        register_default(self)
        if "file" in self.tiers and config.metrics_snapshot_s > 0:
            self._snapshot_at = time.monotonic() + config.metrics_snapshot_s

    # -- construction helpers -------------------------------------------------------------
    @classmethod
    def for_engine(cls, device_pools, *, host_slots: int = 0, file_slots: int = 0, blocks_per_host_block: int = 1,
                   **options) -> TierCache:
        """A cache over the engine's own tensors (:class:`~tiercache.enginetensors.devicepools.DevicePools`)
        with ``host_slots`` host blocks and ``file_slots`` file blocks of
        ``blocks_per_host_block`` device blocks each; ``options`` are other
        :class:`CacheConfig` fields (``root``, ``fsync``, ``io_threads``...).

        Raises:
            ConfigError: bad options, or ``blocks_per_host_block`` out of range.
        """
        k = blocks_per_host_block
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 64:
            raise ConfigError(f"blocks_per_host_block = {k!r} must be an integer in [1, 64]")
        config = CacheConfig(pools=device_pools.host_specs(k), host_slots=host_slots, file_slots=file_slots,
                             device_id=device_pools.device_id or 0, **options)
        return cls(config, device_pools=device_pools, blocks_per_host_block=k)

    @staticmethod
    def _check_engine_args(config: CacheConfig, device_pools, k: int) -> None:
        if device_pools is None:
            if k != 1:
                raise ConfigError(f"blocks_per_host_block = {k} needs device_pools (the engine's tensors)")
            return
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 64:
            raise ConfigError(f"blocks_per_host_block = {k!r} must be an integer in [1, 64]")
        want = device_pools.host_specs(k)
        if tuple(config.pools) != want:
            raise ConfigError(f"config pools {[p.describe() for p in config.pools]} do not match the registered "
                              f"tensors {[p.describe() for p in want]}; use TierCache.for_engine")
        if k > 1 and not config.host_slots:
            raise ConfigError(f"blocks_per_host_block = {k} needs a host tier (host_slots > 0)")
        if config.device_slots:
            raise ConfigError("device_slots must be 0 with registered device pools (the tensors set it)")

    @classmethod
    def open(cls, config: CacheConfig | str | Path, **overrides) -> TierCache:
        """A cache from a config object or a TOML file path, with keyword ``overrides``
        (names of :class:`CacheConfig` fields)."""
        if not isinstance(config, CacheConfig):
            config = load_config(config, **overrides)
        elif overrides:
            config = config.replace(**overrides)
        return cls(config)

    def _capacity(self, name: str) -> int:
        return {"device": self.config.device_slots, "host": self.config.host_slots,
                "file": self.config.file_capacity_slots}[name]

    def _log_no_cuda(self, cuda) -> None:
        global _logged_no_cuda
        if cuda.available or _logged_no_cuda:
            return
        _logged_no_cuda = True
        # a warning where the GPU was expected (CUDA packages installed, or device slots asked for)
        level = logging.WARNING if cuda.cupy_installed or self.config.device_slots else logging.INFO
        log.log(level, "tiercache: CUDA unavailable (%s): device tier off, file I/O through POSIX", cuda.reason)

    # -- small accessors ------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def _file_tier(self) -> FileTier | None:
        """The file tier, where the cache has one."""
        t = self.tiers.get("file")
        return t if isinstance(t, FileTier) else None

    def _check_open(self) -> None:
        """Raise ClosedError after close; save the stats snapshot when it is due."""
        if self._closed:
            raise ClosedError("this TierCache is closed")
        if self._snapshot_at is not None and time.monotonic() >= self._snapshot_at:
            self._write_stats_snapshot()
        self.file_index.tend()

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        """Hold the lock of an open cache."""
        with self._lock:
            self._check_open()
            yield

    @property
    def top_tier(self) -> str:
        """The highest tier present (``device`` with a GPU, else ``host`` or ``file``)."""
        return self.placement.order[0]

    @property
    def tier_names(self) -> list[str]:
        """The tiers present, top to bottom."""
        return self.placement.order

    def _tier_name(self, tier: str | None, default: str) -> str:
        name = default if tier is None else tier
        if name not in TIER_ORDER:
            raise TierUnavailableError(f"unknown tier {name!r}; tiers: {', '.join(TIER_ORDER)}")
        if name == "device" and self.device_pools is not None:
            raise TierUnavailableError("the device tier is the engine's own tensors: move blocks to and from it "
                                       "with offload_slots / onboard_slots (by block id)")
        if name not in self.tiers:
            why = {"device": f"no usable CUDA device ({cuda_status().reason})" if not cuda_status().available
                   else "device_slots = 0"}.get(name, f"{name}_slots = 0")
            raise TierUnavailableError(f"this cache has no {name} tier ({why}); tiers: {', '.join(self.tier_names)}")
        return name

    def _memory_tier(self, tier: str) -> MemoryTier:
        t = self.tiers[self._tier_name(tier, tier)]
        if not isinstance(t, MemoryTier):
            raise TierUnavailableError(f"the {tier} tier has no memory slots")
        return t

    def device_array(self, pool: str | None = None, typed: bool = True):
        """The device tier's CuPy array of ``pool``: ``[device_slots, *block_shape]`` with the
        pool's dtype (``typed`` and where CuPy has it), else ``uint8`` ``[device_slots,
        block_nbytes]``. Engines read and write slots in place.

        Raises:
            TierUnavailableError: no device tier. UnknownPoolError: no such pool.
        """
        name = self._pool_name(pool)
        if self.device_pools is not None:
            return self.device_pools.tensor(name) if typed else self.device_pools.raw(name)
        t = self._memory_tier("device")
        return t.typed(name) if typed else t.array(name)

    def host_array(self, pool: str | None = None, typed: bool = True):
        """The host tier's NumPy array of ``pool`` (see :meth:`device_array`)."""
        t = self._memory_tier("host")
        name = self._pool_name(pool)
        return t.typed(name) if typed else t.array(name)

    def _pool_name(self, pool: str | None) -> str:
        if pool is None:
            if len(self.config.pools) != 1:
                raise ArrayMismatchError(
                    f"this cache has {len(self.config.pools)} pools "
                    f"({', '.join(p.name for p in self.config.pools)}); name one"
                )
            return self.config.pools[0].name
        return self.config.pool(pool).name

    # -- lookups ---------------------------------------------------------------------------
    def lookup(self, key) -> dict[str, int]:
        """Where ``key`` lives: ``{tier: slot}`` for each tier holding it (empty if none).
        For the file tier the slot is an index into its capacity, not a file offset."""
        with self._lock:
            self._check_open()
            (k,) = normalize_keys([key])
            self.file_index.discover([k])
            self.placement.count_walk(self.counters, "lookup", [k], self.placement.order)
            return self.placement.where(k)

    def __contains__(self, key) -> bool:
        return bool(self.lookup(key))

    def __len__(self) -> int:
        with self._lock:
            return len(self.placement.keys())

    def keys(self, tier: str | None = None) -> list[Key]:
        """Stored keys (of one tier, least recently used first, when ``tier`` is given)."""
        with self._lock:
            self._check_open()
            if tier is None:
                return list(self.placement.keys())
            return list(self.placement.tiers[self._tier_name(tier, tier)].lru)

    def slots(self, keys, tier: str | None = None) -> np.ndarray:
        """Slots (``int64``, one per key, in order) of ``keys`` in ``tier`` (default: top tier).

        Raises:
            KeyNotFoundError: a key not in that tier.
        """
        with self._lock:
            self._check_open()
            ks = normalize_keys(keys)
            name = self._tier_name(tier, self.top_tier)
            ts = self.placement.tiers[name]
            missing = [k for k in ks if k not in ts]
            if missing:
                raise KeyNotFoundError(f"key(s) {format_keys(missing)} not in the {name} tier")
            return np.array([ts.slot_of[k] for k in ks], dtype=np.int64)

    # -- pins ------------------------------------------------------------------------------
    def pin(self, keys) -> None:
        """Pin blocks (reference-counted): pinned blocks never move or leave any tier.

        Raises:
            KeyNotFoundError: a key that is not stored.
        """
        with self._lock:
            self._check_open()
            ks = normalize_keys(keys)
            self.file_index.discover(ks)
            self.placement.require_present(ks)
            self.placement.pin(ks)

    def unpin(self, keys) -> None:
        """Undo one :meth:`pin` per key (unpinning an unpinned key does nothing)."""
        with self._lock:
            self.placement.unpin(normalize_keys(keys))

    @contextlib.contextmanager
    def pinned(self, keys) -> Iterator[None]:
        """Context manager: pin ``keys`` for the duration of the ``with`` block."""
        self.pin(keys)
        try:
            yield
        finally:
            self.unpin(keys)

    # -- public operations ---------------------------------------------------------------
    def _as_pool_arrays(self, data, n: int, what: str, device_ok: bool = True) -> dict:
        if not isinstance(data, dict):
            data = {self._pool_name(None): data}
        names = {p.name for p in self.config.pools}
        unknown = sorted(set(data) - names)
        if unknown:
            self.config.pool(unknown[0])  # raises UnknownPoolError with the list
        missing = sorted(names - set(data))
        if missing and what == "data":
            raise ArrayMismatchError(f"data for pool(s) {', '.join(missing)} missing; a put needs every pool")
        device_id = self.config.device_id
        out = {p: raw_view(a, self.config.pool(p), n, device_id, what) for p, a in data.items()}
        if not device_ok and any(not isinstance(a, np.ndarray) for a in out.values()):
            raise ArrayMismatchError(f"{what} is in device memory but this cache has no CUDA device")
        return out

    def put(self, keys, data, tier: str | None = None) -> np.ndarray:
        """Store blocks from caller arrays into ``tier`` (default: the top tier).

        Args:
            keys: ``n`` keys (one key is a batch of one).
            data: one array ``(n, *block_shape)`` of the pool's dtype (or ``(n, block_nbytes)``
                ``uint8``) for a one-pool cache, or ``{pool: array}`` with every pool. Host
                (NumPy, PyTorch CPU) or device (CuPy, PyTorch CUDA) memory.
            tier: ``"device"``, ``"host"`` or ``"file"``.

        Returns:
            The slots the blocks took in ``tier`` (``int64``, in key order); ``-1`` for blocks
            that streamed through it to the tier below.

        A key already stored is replaced: its new bytes go in, then its other copies are
        dropped. Room is made by spilling least recently used blocks. More new blocks than
        ``tier`` can hold (its slots less its pinned blocks) stream through it when a tier lies
        below: they go in pieces of that size, each spilling the previous ones down, so the last
        piece stays in ``tier`` and the rest land below (as ``put`` piece by piece would).

        Raises:
            InvalidKeyError, ArrayMismatchError, UnknownPoolError, TierUnavailableError,
            PinnedBlockError (replacing a pinned key), TierFullError, TransferError.
        """
        with self._lock:
            self._check_open()
            ks = normalize_keys(keys)
            self.file_index.check_writable(ks)
            name = self._tier_name(tier, self.top_tier)
            arrays = self._as_pool_arrays(data, len(ks), "data", device_ok=cuda_status().available)
            existing = self.placement.existing(ks)
            self.placement.require_unpinned(existing, "replace")
            ts = self.placement.tiers[name]
            room = self.placement.room(name)
            if len([k for k in ks if k not in ts]) <= room or not self.placement.below(name) or room < 1:
                return self._put_chunk(ks, arrays, name)
            # more new blocks than the tier can hold: they stream through it, a tier-full at a time
            failed: dict = {}
            for start in range(0, len(ks), room):
                part = ks[start:start + room]
                try:
                    self._put_chunk(part, {p: a[start:start + room] for p, a in arrays.items()}, name)
                except TransferError as exc:
                    failed.update({k: exc for k in exc.failed_keys})
            self.counters["streamed_puts"] += 1
            self.mover.raise_failed(failed, "caller", name)
            return np.array([ts.slot_of.get(k, -1) for k in ks], dtype=np.int64)

    def _put_chunk(self, ks: list[Key], arrays: dict, name: str) -> np.ndarray:
        ts = self.placement.tiers[name]
        # old copies in other tiers go after the new bytes are in; in this tier, reuse slots
        new = [k for k in ks if k not in ts]
        self.mover.room_for(name, len(new), ks)  # a failed spill: nothing of this piece stored or replaced
        ts.add(new)
        rows = [ts.slot_of[k] for k in ks]
        failed = self.mover.transfer(ks, "caller", name, np.arange(len(ks)), rows, src_arrays=arrays)
        if failed:
            ts.remove([k for k in failed if k in new])
        ok = [k for k in ks if k not in failed]
        self.file_index.forget_positions(ok)
        self.mover.drop_copies(ok, keep=name)
        ts.touch(ok)
        self.counters["put_blocks"] += len(ok)
        if name == "file" and ok:  # a shared root is held to its capacity as a spill would hold it
            self.file_index.after_write(set(ks))
        self.mover.raise_failed(failed, "caller", name)
        return np.array(rows, dtype=np.int64)

    def allocate(self, keys, tier: str | None = None, slots=None) -> np.ndarray:
        """Reserve slots in memory tier ``tier`` (default: the top tier) for new ``keys``
        whose bytes the engine writes in place (rows of :meth:`device_array` /
        :meth:`host_array`). With ``slots``, the engine chooses the slots (its own block
        ids); they must be free. Returns the slots (``int64``, in key order).

        Raises:
            InvalidKeyError: a key already stored. SlotRangeError: a slot out of
            ``[0, num_slots)``, repeated, or taken. TierFullError, TierUnavailableError.
        """
        with self._lock:
            self._check_open()
            ks = normalize_keys(keys)
            self.file_index.check_writable(ks)
            name = self._tier_name(tier, self.top_tier)
            self._memory_tier(name)
            existing = self.placement.existing(ks)
            if existing:
                raise InvalidKeyError(f"key(s) {format_keys(existing)} already stored; evict them or use put()")
            ts = self.placement.tiers[name]
            if slots is not None:
                wanted = [int(s) for s in np.asarray(slots, dtype=np.int64).reshape(-1)]
                if len(wanted) != len(ks):
                    raise SlotRangeError(f"{len(wanted)} slots given for {len(ks)} keys")
                ts.claim(ks, wanted)
            else:
                self.mover.room_for(name, len(ks), ks)
                wanted = ts.add(ks)
            self.counters["allocated_blocks"] += len(ks)
            return np.array(wanted, dtype=np.int64)

    def get(self, keys, pool: str | None = None, out=None):
        """Read blocks' bytes from the highest tier holding each, without moving them.

        Args:
            keys: ``n`` keys.
            pool: one pool name (required for several pools unless ``out`` is a dict).
            out: optional array ``(n, *block_shape)`` (or raw ``(n, block_nbytes)`` ``uint8``),
                host or device, filled in place; or ``{pool: array}``.

        Returns:
            ``out`` if given, else a new NumPy array ``(n, *block_shape)`` of the pool's dtype
            (raw ``uint8`` ``(n, block_nbytes)`` where NumPy lacks the dtype).

        Raises:
            KeyNotFoundError, UnknownPoolError, ArrayMismatchError, TransferError.
        """
        with self._lock:
            self._check_open()
            ks = normalize_keys(keys)
            self.file_index.discover(ks)
            found = self._highest_copies(ks)
            result: Any
            if isinstance(out, dict):
                outs = self._as_pool_arrays(out, len(ks), "out")
                result = out
            else:
                name = self._pool_name(pool)
                if out is None:
                    result, raw = host_output(self.config.pool(name), len(ks), recycled_empty)
                    outs = {name: raw}
                else:
                    result = out
                    outs = self._as_pool_arrays({name: out}, len(ks), "out")
            for tier, (idx, sub, slots) in found.items():
                failed = self.mover.transfer(sub, tier, "caller", slots, idx, dst_arrays=outs)
                self.counters[f"get_hits_{tier}"] += len(sub) - len(failed)
                self.mover.raise_failed(failed, tier, "caller")
            return result

    def _highest_copies(self, ks: list[Key]) -> dict[str, tuple[list[int], list[Key], list[int]]]:
        """Per tier, top first, the keys whose highest copy it holds: ``(positions in ks, keys,
        slots)``; one batched lookup per tier of the keys not found above it.

        Raises:
            KeyNotFoundError: naming the keys no tier holds.
        """
        found: dict[str, tuple[list[int], list[Key], list[int]]] = {}
        left: list[int] = list(range(len(ks)))
        for tier in self.placement.order:
            at = self.placement.tiers[tier].find_many([ks[i] for i in left]).tolist()
            idx = [i for i, s in zip(left, at) if s >= 0]
            if idx:
                found[tier] = (idx, [ks[i] for i in idx], [s for s in at if s >= 0])
                left = [i for i, s in zip(left, at) if s < 0]
            if not left:
                break
        if left:
            self.placement.require_present([ks[i] for i in left])  # raises, naming them
        return found

    def offload(self, keys, to: str | None = None, keep: bool = False) -> np.ndarray:
        """Move blocks down to tier ``to`` (default: the tier below the top tier).

        Each key is copied from the nearest tier above ``to`` that holds it (nothing is copied
        for keys already in ``to``). With ``keep=False`` the copies above ``to`` are then
        dropped; with ``keep=True`` they stay (the copy below is clean).

        Returns:
            The keys' slots in ``to``.

        Raises:
            KeyNotFoundError: a key not stored at or above ``to``.
            PinnedBlockError: ``keep=False`` for a pinned key.
            TierFullError, TransferError (the source copies stay valid and registered).
        """
        with self._lock:
            self._check_open()
            ks = normalize_keys(keys)
            order = self.placement.order
            default = order[1] if len(order) > 1 else order[0]
            dst = self._tier_name(to, default)
            upper = [dst, *self.placement.above(dst)]
            missing = [k for k, h in zip(ks, self.placement.contains_many(ks, upper)) if not h]
            if missing:
                raise KeyNotFoundError(f"key(s) {format_keys(missing)} not stored in {' or '.join(upper)}; "
                                       "offload moves blocks down (use onboard to move them up)")
            if not keep:
                self.placement.require_unpinned([k for k in ks if any(k in self.placement.tiers[t] for t in upper[1:])],
                                       "offload (keep=False)")
            return self.mover.offload(ks, dst, keep)

    def onboard(self, keys, to: str | None = None) -> np.ndarray:
        """Bring blocks up into tier ``to`` (default: the top tier) from the nearest tier
        below that holds each; the copy below stays (clean). Keys already in ``to`` are
        only marked recently used.

        Returns:
            The keys' slots in ``to`` (``int64``, in key order): with the device tier, rows
            of :meth:`device_array`.

        Raises:
            KeyNotFoundError: a key not stored at or below ``to``.
            TierFullError, TransferError (a block whose file failed to verify is quarantined
            and dropped; the error lists it).
        """
        with self._lock:
            self._check_open()
            ks = normalize_keys(keys)
            self.file_index.discover(ks)
            dst = self._tier_name(to, self.top_tier)
            lower = [dst, *self.placement.below(dst)]
            missing = [k for k in ks if not any(k in self.placement.tiers[t] for t in lower)]
            if missing:
                raise KeyNotFoundError(f"key(s) {format_keys(missing)} not stored in {' or '.join(lower)}")
            self.placement.count_walk(self.counters, "onboard", ks, lower)
            slots = self.mover.copy_into(ks, dst, set(ks))
            self.counters["onboarded_blocks"] += len(ks)
            return slots

    def flush(self, keys=None) -> int:
        """Make sure every block (or each of ``keys``) has a copy in the file tier, so that it
        survives the process. Returns the number of blocks written.

        Raises:
            TierUnavailableError: no file tier. TransferError.
        """
        with self._lock:
            self._check_open()
            self._tier_name("file", "file")
            ks = normalize_keys(keys) if keys is not None else sorted(
                self.placement.keys(), key=lambda k: (isinstance(k, bytes), k))
            self.placement.require_present(ks)
            todo = [k for k in ks if k not in self.placement.tiers["file"]]
            if todo:
                self.mover.copy_into(todo, "file", set(todo))
            self.counters["flushed_blocks"] += len(todo)
            self._write_stats_snapshot()
            self.file_index.checkpoint()
            return len(todo)

    def evict(self, keys, tier: str | None = None) -> None:
        """Drop blocks from ``tier``, or from every tier when ``tier`` is None (the blocks
        are then gone, files included).

        Raises:
            KeyNotFoundError: a key not in that tier (or not stored).
            PinnedBlockError: a pinned key.
        """
        with self._lock:
            self._check_open()
            ks = normalize_keys(keys)
            tiers = self.placement.order if tier is None else [self._tier_name(tier, tier)]
            if tier is None:
                self.placement.require_present(ks)
            else:
                missing = [k for k in ks if k not in self.placement.tiers[tiers[0]]]
                if missing:
                    raise KeyNotFoundError(f"key(s) {format_keys(missing)} not in the {tiers[0]} tier")
            self.placement.require_unpinned(ks, "evict")
            if tier is None:
                self.file_index.forget_positions(ks)
            for t in tiers:
                self.placement.tiers[t].remove(ks)
                if t == "file":
                    cast(FileTier, self.tiers["file"]).delete(ks)
            self.counters["evict_calls"] += 1

    # -- the engine's own tensors (TierCache.for_engine) ------------------------------------
    def _slots(self) -> EngineSlots:
        if self._engine_slots is None:
            raise TierUnavailableError("offload_slots/onboard_slots need the engine's tensors: create the cache "
                                       "with TierCache.for_engine(DevicePools(...), ...)")
        return self._engine_slots

    def offload_slots(self, keys, device_slots, to: str | None = None, *, num_tokens: int | None = None,
                      stream=None, wait: bool = False) -> Job | None:
        """Copy the engine's device blocks into keyed host blocks (or files).

        Args:
            keys: ``n`` keys, one per host block.
            device_slots: the engine's block ids, ``[n]`` (one device block per key) or
                ``[n, k]`` for ``blocks_per_host_block = k``, ``-1`` for empty positions.
            to: ``"host"`` (default when there is a host tier) or ``"file"`` (through the host
                tier, whose copies are then dropped; straight from VRAM when there is none).
            num_tokens: copy only the first ``num_tokens`` tokens of each device block.
            stream: the engine's stream (CuPy, PyTorch, ``__cuda_stream__`` or handle; default:
                the current stream of the tensors' library). The copy starts after the work
                already queued there.
            wait: block until the bytes are in place (host) instead of returning at once.

        Returns:
            The :class:`~tiercache.transfer.jobs.Job` of the device -> host copy (poll it, or
            :meth:`get_finished`), or None for ``to="file"`` (done when it returns).

        A key already stored is replaced. Room is made by spilling least recently used host
        blocks to the file tier. With ``to="file"``, more blocks than the host tier holds (its
        slots less its pinned blocks) stream through it in pieces of that size.

        Raises:
            SlotRangeError: bad ``device_slots`` shape or ids. TierUnavailableError: no
            device pools, or ``to="file"`` with ``k > 1`` and no host tier. PinnedBlockError,
            TierFullError, TransferError.
        """
        return self._slots().offload_slots(keys, device_slots, to, num_tokens=num_tokens, stream=stream, wait=wait)

    def onboard_slots(self, keys, device_slots, *, layerwise: bool = False, num_tokens: int | None = None,
                      stream=None) -> OnboardHandle:
        """Copy keyed host/file blocks into the engine's device blocks.

        Args:
            keys: ``n`` stored keys.
            device_slots: destination block ids, ``[n]`` or ``[n, k]`` (``-1``: skip that
                position); no block id twice.
            layerwise: copy layer 0 of every block, then layer 1, ...; the handle then has one
                completion per layer (:meth:`OnboardHandle.wait_layer`).
            num_tokens: copy only the first ``num_tokens`` tokens of each device block.
            stream: the engine's stream (default: the tensors' library's current stream). The
                copy starts after work already queued there (which may still read the old
                contents of these blocks). Without ``layerwise``, that stream also waits for
                the copy, on the device, before anything queued after this call; with
                ``layerwise`` the engine calls ``wait_layer`` itself.

        Keys only in the file tier are first read into the host tier (the call returns
        after those reads); with no host tier, files go straight into VRAM. When more of them
        than the host tier holds (its slots less its pinned blocks) must come from files, they
        stream through it in pieces of that size, each complete before the next; the call then
        returns when every block is on the device, and every layer of the handle is done.

        Raises:
            KeyNotFoundError: a key not stored, or a position its host block never held.
            SlotRangeError, TierUnavailableError, TransferError (file reads that failed; the
            bad files are quarantined).
        """
        return self._slots().onboard_slots(keys, device_slots, layerwise=layerwise, num_tokens=num_tokens,
                                           stream=stream)

    def prepare_onboard(self, keys, device_slots, *, layerwise: bool = False, num_tokens: int | None = None,
                        stream=None, exclusive: bool = False) -> PreparedOnboard:
        """Plan an onboard of ``keys`` into ``device_slots`` once, for many launches
        (:meth:`PreparedOnboard.launch <tiercache.enginetensors.prepared.PreparedOnboard.launch>`):
        for engines that bring the same blocks into the same device blocks again and again,
        such as a decoder streaming each layer's KV from host memory every step.

        Args:
            keys, device_slots, layerwise, num_tokens: as :meth:`onboard_slots`.
            stream: the default stream of its launches (as :meth:`onboard_slots`).
            exclusive: the device blocks are the caller's alone while the plan is held, and
                the caller orders every other access to them through the launch stream; then
                launches after the first replay it outside the slot ledger, for a few driver
                calls of host time each (the contract is in
                :class:`~tiercache.enginetensors.prepared.PreparedOnboard`'s docstring).

        Keys only in the file tier are read into the host tier now. Every key is then pinned
        there until :meth:`PreparedOnboard.release <tiercache.enginetensors.prepared.PreparedOnboard.release>`:
        its host slot, and so the plan, stay valid; meanwhile the keys cannot be spilled,
        evicted or replaced. Each launch copies the host blocks' contents at that time, ordered
        after conflicting transfers like any onboard; on the host it costs the launch calls
        (no per-key work).

        Returns:
            A :class:`~tiercache.enginetensors.prepared.PreparedOnboard`.

        Raises:
            KeyNotFoundError: a key not stored, or a position its host block never held.
            SlotRangeError: bad ``device_slots`` (as :meth:`onboard_slots`).
            TierUnavailableError: no device pools, or no host tier.
            TierFullError: the file-only keys do not fit in the host tier's unpinned slots.
            TransferError: file reads that failed (the bad files are quarantined).
        """
        return self._slots().prepare_onboard(keys, device_slots, layerwise=layerwise, num_tokens=num_tokens,
                                             stream=stream, exclusive=exclusive)

    def engine_stream(self, stream=None):
        """The stream the engine computes on, as ``offload_slots`` / ``onboard_slots`` default
        it: ``stream`` if given, else PyTorch's current stream (of this thread) for PyTorch
        tensors, else None (CuPy's current stream). ``stream`` unchanged without device pools."""
        return stream if self._engine_slots is None else self._engine_slots.engine_stream(stream)

    # -- sync points with the engine's compute stream --------------------------------------
    def wait_for_stream(self, stream=None) -> None:
        """Copies issued after this call wait for work already queued on ``stream`` (CuPy,
        PyTorch, ``__cuda_stream__`` or int handle; None: CuPy's current stream). Call it before
        offloading blocks your kernels just wrote on a side stream."""
        self.engine.wait_for_stream(stream)

    def get_finished(self) -> list:
        """Results (:class:`~tiercache.transfer.jobs.JobResult`) of the transfers finished since the
        last call; never blocks (for engines that poll)."""
        return self.engine.get_finished()

    def make_stream_wait(self, stream=None, jobs=None) -> None:
        """``stream`` (CuPy, PyTorch, ``__cuda_stream__`` or int handle; None: CuPy's current
        stream) waits, on the device, for ``jobs`` (:class:`~tiercache.transfer.jobs.Job`, for
        example an offload whose source blocks the engine is about to overwrite; default: every
        onboard still in flight) before running what is queued on it next. Jobs of file I/O are
        waited for on the host."""
        self.engine.make_stream_wait(stream, jobs)

    # -- stats & lifecycle ----------------------------------------------------------------
    def wait_reconciled(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit) for the reconciliation of the root's
        saved index with its directory (started at open for the subdirectories changed since
        the index was saved: files the index does not know adopted, entries whose files are
        gone dropped; see :attr:`scan`) and apply it. Returns True when none is running.

        Raises:
            ClosedError: after :meth:`close`.
        """
        with self._lock:
            self._check_open()
            return self.file_index.apply_reconciled(timeout)

    def stats(self, block: bool = True) -> dict:
        """A JSON-ready snapshot: I/O path (and why), per-tier slots used/free and bytes,
        counters (puts, onboards, offloads, spills, evictions, lookup/onboard hits and misses
        per tier, bytes moved per tier pair, failed transfers, corrupt blocks, quarantined
        files) and ``transfers``: per source tier, destination tier and copy path, the jobs,
        blocks, bytes, failed blocks and job-latency histogram (bucket bounds in seconds in
        ``latency_buckets_s``; see :class:`~tiercache.transfer.TransferStats`).

        Args:
            block: False reads without waiting for a call in progress (for exporters): the
                values are then each exact but may be taken a few blocks apart.
        """
        if self._closed:
            raise ClosedError("this TierCache is closed")
        if block:
            with self._lock:
                self.engine.reap()
                return self._stats()
        self.engine.reap(timeout=0.05)
        for _ in range(10):
            try:
                return self._stats()
            except RuntimeError:  # a dict changed size while being read: read again
                continue
        with self._lock:
            return self._stats()

    def _stats(self) -> dict:
        per_block = self.config.block_nbytes
        tiers = {}
        for name in self.placement.order:
            ts = self.placement.tiers[name]
            t: Any = self.tiers[name]  # a MemoryTier (device, host) or the FileTier (file)
            tiers[name] = {
                "slots": ts.num_slots,
                "used": len(ts),
                "free": ts.free_count,
                "bytes_used": len(ts) * per_block,
                "bytes_capacity": ts.num_slots * per_block,
                **(
                    {"pinned_memory": t.pinned, "page_bytes": sorted({m["page_bytes"] for m in t.memory()})}
                    if name == "host"
                    else {}
                ),
                **(
                    {
                        "root": str(t.root),
                        "roots": [str(r) for r in t.roots],
                        "bytes_on_disk": len(ts) * self.config.block_file_bytes,
                        "capacity_bytes": self.config.capacity_bytes,
                        "direct_io": self.config.direct_io,
                        "bytes_capacity_on_disk": ts.num_slots * self.config.block_file_bytes,
                        "io_engine": t.engine,
                        "io_engine_reason": t.engine_reason,
                        # shared roots: the index (used) is this process's knowledge; on_disk_blocks
                        # counts the root's complete blocks at the last sweep (None before one)
                        "sharing": self.config.sharing,
                        "on_disk_blocks": self.file_index.on_disk_blocks,
                    }
                    if name == "file"
                    else {}
                ),
            }
        return {
            "io_path": {"name": self.io_path.name, "label": self.io_path.label, "reason": self.io_path.reason},
            "cuda": cuda_status().reason,
            "tiers": tiers,
            "pools": [p.describe() for p in self.config.pools],
            "blocks": len(self.placement.keys()),
            "pinned_blocks": len(self.placement.pins),
            "counters": dict(self.counters),
            "metrics_name": self.metrics_name,
            "transfers": [] if self.engine.transfer_stats is None else self.engine.transfer_stats.snapshot(),
            "latency_buckets_s": list(LATENCY_BUCKETS_S),
        }

    def close(self) -> None:
        """Wait for transfers, stop I/O threads and release memory. Idempotent. Blocks in the
        file tier stay on disk; blocks only in memory tiers are dropped (call :meth:`flush`
        first to keep them)."""
        with self._lock:
            if self._closed:
                return
            self._write_stats_snapshot()
            self._closed = True
            from tiercache.metrics import unregister

            unregister(self)
            self.engine.shutdown()
            ft = self._file_tier
            if ft is not None:
                self.file_index.stop()
                ft.close(before_unlock=lambda: self.file_index.checkpoint(closing=True))
            self.tiers.clear()

    def _write_stats_snapshot(self) -> None:
        """The latest stats in the root, for ``tiercache inspect`` and ``tiercache top --root``
        (on flush, on close, and every ``metrics_snapshot_s`` seconds at the next call)."""
        ft = self._file_tier
        if self._snapshot_at is not None:
            self._snapshot_at = time.monotonic() + self.config.metrics_snapshot_s
        if ft is not None:
            write_stats(ft.dir, self.stats())

    def __enter__(self) -> TierCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # best effort
        try:
            self.close()
        except Exception:
            pass
