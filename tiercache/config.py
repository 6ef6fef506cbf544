"""Cache configuration: pools, slots per tier, the file-tier root and the I/O mode.

A configuration comes from keyword arguments or from a TOML file (parsed with the standard
library's ``tomllib``)::

    [tiers]
    device_slots = 256        # blocks in VRAM (0: no device tier)
    host_slots = 512          # blocks in pinned DRAM (0: no host tier)
    host_huge_pages = "auto"  # auto | on | off: the host tier on reserved huge pages
    file_slots = 4096         # blocks in files under [file].root (0: no file tier)

    [file]
    root = "/mnt/nvme/tiercache"   # default: <tmp>/tiercache-<user>
    io_mode = "auto"               # auto | gds | compat | posix
    fsync = "data"                 # none | data | data+dir
    verify_checksums = true
    io_threads = 8
    io_engine = "auto"             # auto | io_uring | threads | python
    open_files = -1                # block files held open and recycled: -1 auto, 0 none, N at most
    check_root_owner = true        # refuse a root of another user or writable by others
    sharing = "exclusive"          # exclusive (one process) | shared (many processes, content keys)
    min_age_s = 30.0               # shared: files younger than this are not evicted by policy
    negative_ttl_s = 1.0           # shared: a key found in no file is not looked for again this long
    tmp_max_age_s = 900.0          # shared: temporary files older than this are abandoned
    index_checkpoint_s = 60.0      # save the root's index this often (at the next call), on flush and close

    [metrics]                      # Prometheus metrics (tiercache.metrics, README "Metrics")
    enabled = true                 # count transfers (latency histograms) and export them
    name = ""                      # the cache label (default: "tiercache", then "tiercache-2", ...)
    registry = "default"           # default: prometheus_client's REGISTRY when installed | none
    snapshot_interval_s = 5.0      # save stats in the root this often (tiercache top --root); 0: on flush/close

    [pools.kv]                     # a KV-cache pool (layer_major or token_major layout)
    num_layers = 32
    kv_factor = 2
    num_kv_heads = 8
    tokens_per_block = 16
    head_dim = 128
    dtype = "bfloat16"

    [pools.act]                    # or any block shape
    block_shape = [4096]
    dtype = "float16"

Every value is validated; an unknown key, a wrong type, or a value out of range raises
:class:`~tiercache.errors.ConfigError` naming the key, the value, and what is valid.
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import re
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercache.errors import ConfigError
from tiercache.files import IO_ENGINES
from tiercache.geometry import PoolSpec
from tiercache.memory import HUGE_PAGE_MODES

IO_MODES = ("auto", "gds", "compat", "posix")
FSYNC_POLICIES = ("none", "data", "data+dir")
MAX_IO_THREADS = 256

_TIER_KEYS = {"device_slots", "host_slots", "file_slots", "host_huge_pages"}
_FILE_KEYS = {"root", "io_mode", "fsync", "verify_checksums", "io_threads", "io_engine", "capacity_bytes", "direct_io",
              "kvikio_task_size", "kvikio_gds_threshold", "check_root_owner", "sharing", "min_age_s",
              "negative_ttl_s", "tmp_max_age_s", "open_files", "index_checkpoint_s"}
SHARING_MODES = ("exclusive", "shared")
_KV_KEYS = {"num_layers", "kv_factor", "num_kv_heads", "tokens_per_block", "head_dim", "layout"}
_TRANSFER_KEYS = {"streams_per_direction", "copy_kernel_sms", "memcpy_min_bytes", "batch_min_bytes", "batch_streams",
                  "bulk_shape", "bulk_sms", "staged_min_run_bytes", "offload_staged_min_run_bytes", "carveout_sms"}
BULK_SHAPES = ("small", "large", "off")
METRICS_REGISTRIES = ("default", "none")
_METRICS_NAME = re.compile(r"[A-Za-z0-9_.:-]{0,64}", re.ASCII)
#: [metrics] keys -> CacheConfig fields
_METRICS_KEYS = {"enabled": "metrics", "name": "metrics_name", "registry": "metrics_registry",
                 "snapshot_interval_s": "metrics_snapshot_s"}
_TOP_KEYS = {"tiers", "file", "pools", "device", "transfer", "metrics"}


def default_root() -> Path:
    """``<system temp dir>/tiercache-<user>``: the file-tier root when none is configured."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name in some containers
        user = str(os.getuid())
    return Path(tempfile.gettempdir()) / f"tiercache-{user}"


@dataclass(frozen=True)
class CacheConfig:
    """Everything a :class:`~tiercache.TierCache` needs.

    Attributes:
        pools: one or more :class:`PoolSpec`; a block has one slot in every pool.
        device_slots: blocks the device tier holds (VRAM), >= 0. Ignored (with one log line)
            where no CUDA device is usable.
        host_slots: blocks the host tier holds (pinned DRAM with CUDA, page-aligned DRAM
            without), >= 0.
        file_slots: blocks the file tier holds, >= 0; 0 turns the file tier off.
        host_huge_pages: where the host tier's memory comes from: ``auto`` (default: huge
            pages, registered with CUDA, when enough are reserved and free, else ordinary pinned
            memory), ``on`` (huge pages or :class:`~tiercache.errors.TierUnavailableError`) or
            ``off``. Pinning huge pages is faster (16 GiB: 6.2 s against 10.6 s on an H100
            test machine) and copies run at the same speed (see :mod:`tiercache.memory.hostmem`);
            reserve them with ``sysctl vm.nr_hugepages=N`` (N x 2 MiB).
        root: directory of the file tier (created if missing).
        io_mode: ``auto`` (GDS if present, else kvikio compat mode with CUDA, else POSIX),
            ``gds``, ``compat`` (kvikio's POSIX thread pool) or ``posix`` (tiercache's own
            pread/pwrite through host memory).
        fsync: ``none``, ``data`` (fsync each block file before its rename; the default) or
            ``data+dir`` (also fsync the directory after the rename).
        verify_checksums: verify each block file's checksum when it is read.
        io_threads: file I/O threads (tiercache's POSIX pool and kvikio's), 1..256.
        io_engine: who runs the POSIX path's per-file system calls: ``auto`` (the default:
            ``io_uring`` where rings can be set up, else ``threads``, else ``python`` where no C
            compiler can build ``kernels/blockio.c``), ``io_uring`` (each I/O thread queues a
            request's opens, reads/writes and flushes on its own ring), ``threads`` (a pool of
            ``io_threads`` C threads with blocking calls) or ``python`` (one Python task per
            block). See :mod:`tiercache.files.batchio` and docs/performance.md.
        open_files: descriptors of block files the native I/O engine holds open, so a read is
            one ``preadv`` and a write reuses a free, already allocated file
            (:mod:`tiercache.files.openfiles`): -1 (the default) every block file of the tier
            plus 256 free files per file size, within 3/4 of the process's open-file limit
            (raised to its hard limit); 0 opens, creates and closes a file per operation; N at
            most N. Exclusive roots only (a shared root holds none).
        capacity_bytes: bytes the file tier may use on disk (0: no byte limit; ``file_slots``
            still applies). Least recently used blocks are deleted beyond it.
        direct_io: open block files with O_DIRECT on the POSIX path (the default: cold reads
            measured 97% of raw with it, 80% without; spills do not evict the page cache).
            Blocks whose size is not a multiple of 4096, and filesystems without O_DIRECT
            (tmpfs), use buffered I/O.
        check_root_owner: refuse a root that another user owns or that group or others may
            write (the default; README, "The file tier on disk": whoever can write a root can
            plant blocks, since checksums detect corruption, not forgery). ``False`` accepts it.
        sharing: ``exclusive`` (the default: one process opens the root; any keys; the
            capacity is exact; a second process gets :class:`~tiercache.errors.RootError`) or
            ``shared`` (any number of processes on one machine or on a shared file system open
            it at once; content keys (bytes) only, since they name immutable bytes that any
            writer may publish; a miss looks for files others published; ``file_slots`` and
            ``capacity_bytes`` hold for the root as a whole; README "Sharing a root").
        min_age_s: shared mode: block files younger than this many seconds are not evicted by
            the policy (a reader may be about to open what another process just published);
            0..86400, default 30.
        negative_ttl_s: shared mode: a key found in no file is not looked for on disk again for
            this many seconds (0: every miss looks); 0..3600, default 1.
        tmp_max_age_s: shared mode: a temporary file of another machine or boot is abandoned
            (removed) once older than this; on this machine a dead writer's are removed at once;
            60..604800, default 900.
        index_checkpoint_s: the root's saved index (``.tiercache-index``, what the next open
            starts from instead of reading every file) is saved on ``flush``, on close and at
            the first call this many seconds after the last save; 1..86400, default 60.
        kvikio_task_size: bytes per kvikio task (None: kvikio's default, 4 MiB).
        kvikio_gds_threshold: I/O smaller than this skips cuFile in kvikio (None: default).
        device_id: CUDA device ordinal of the device tier.
        streams_per_direction: CUDA streams per copy direction (offload, onboard, copy), 1..16.
        copy_kernel_sms: SMs the gather/scatter kernel may occupy, 1..1024 (None: all); default
            8, which on an H100 moves as much as all 132 SMs (47 GB/s, 16 KiB blocks) while
            leaving the rest to the engine's compute (docs/performance.md).
        memcpy_min_bytes: runs of consecutive slots of at least this many bytes go to
            ``cudaMemcpyAsync`` (copy engines, no SMs); shorter ones to the kernel.
        batch_min_bytes: other blocks, and segments of partial copies (the first tokens of a
            token-major block are one segment), of at least this many bytes go to
            ``cuMemcpyBatchAsync`` (copy engines, no SMs) where the driver has it; default
            128 KiB, where ``tiercache calibrate`` measured the copy engines at 100-105% of the
            bulk kernel on H100 and H200 test machines (64 KiB: 96-102%, 32 KiB: 66-99%).
            ``tiercache calibrate`` measures this machine's crossover.
        batch_streams: streams (and so copy engines) one ``cuMemcpyBatchAsync`` batch is split
            over, 1..16; default 2 (256 KiB blocks: 97-100% of contiguous, against 97-102% on one
            stream and 87% at 64 KiB).
        bulk_shape: the bulk-copy (TMA) kernel used for 16-byte-aligned blocks and segments on
            sm_90+: ``large`` (default: one CTA per SM with 64 KiB of shared memory, on
            ``bulk_sms`` SMs), ``small`` (one warp, 4 KiB of shared memory and 32 registers per
            thread per CTA: it fits beside a compute kernel's CTAs, so with ``bulk_sms`` = all
            it moves 84-92% of contiguous beside a bf16 GEMM, but slows that GEMM by ~45%, see
            docs/performance.md), or ``off`` (the gather/scatter kernel only).
        bulk_sms: SMs the bulk kernel may place a CTA on, 1..1024 (None: ``copy_kernel_sms``).
        staged_min_run_bytes: host <-> device batches of blocks under ``batch_min_bytes`` whose
            host slots form runs averaging at least this many bytes go through the staged path
            (copy engines for PCIe, a burst kernel for the scatter in VRAM, 64 MiB of staging
            VRAM allocated on first use; see ``tiercache/stagedcopy.py``); 0 (default) turns it
            off.
        offload_staged_min_run_bytes: device -> host batches of such blocks whose host slots run
            at least this many bytes on average take the staged path, 0..2^40 (0: off); default
            256 KiB. Its copy engines write host memory: SMs writing host memory (the bulk
            kernel) slowed a bf16 GEMM on the other SMs by ~50% on an H100, and alone both move
            90-96% of contiguous (docs/performance.md).
        carveout_sms: SMs your compute kernels leave free for copies (their SM carve-out, e.g.
            :func:`tiercache.sm_carveout` around cuBLASLt GEMMs), 0..1024; 0 (default): none.
            When set, copy kernels stay on that many SMs and the copy paths are picked for
            running beside compute (device -> host and host-run batches on the copy engines,
            see :class:`~tiercache.copypaths.copykernels.CopyLauncher` and docs/performance.md).
        metrics: count every finished transfer (blocks, bytes, failures, a latency histogram per
            direction and copy path, :class:`~tiercache.transfer.TransferStats`) and export
            the cache's metrics (:mod:`tiercache.metrics`); default true. ``False`` records
            no transfer latencies (``stats()`` keeps its counters) and registers nothing.
        metrics_name: the ``cache`` label of this cache's metrics, up to 64 characters of
            ``[A-Za-z0-9_.:-]`` ("" (default): ``tiercache``, or ``tiercache-2``, ... when that
            name is taken in the registry).
        metrics_registry: ``default`` (register in ``prometheus_client.REGISTRY``, the registry
            an engine's exporter serves, when prometheus-client is installed) or ``none``
            (register yourself with :func:`tiercache.metrics.register`).
        metrics_snapshot_s: with a file tier, save ``stats()`` in the root (for ``tiercache
            inspect`` and ``tiercache top --root``) at the first call this many seconds after the
            last save, 0..86400; default 5; 0: only on ``flush`` and ``close``.

    Raises:
        ConfigError: any value out of range (see each attribute).
    """

    pools: tuple[PoolSpec, ...]
    device_slots: int = 0
    host_slots: int = 0
    file_slots: int = 0
    host_huge_pages: str = "auto"
    root: Path | None = None
    io_mode: str = "auto"
    fsync: str = "data"
    verify_checksums: bool = True
    io_threads: int = 8
    io_engine: str = "auto"
    capacity_bytes: int = 0
    direct_io: bool = True
    check_root_owner: bool = True
    sharing: str = "exclusive"
    min_age_s: float = 30.0
    negative_ttl_s: float = 1.0
    tmp_max_age_s: float = 900.0
    open_files: int = -1
    index_checkpoint_s: float = 60.0
    kvikio_task_size: int | None = None
    kvikio_gds_threshold: int | None = None
    device_id: int = 0
    streams_per_direction: int = 2
    copy_kernel_sms: int | None = 8
    memcpy_min_bytes: int = 4 << 20
    batch_min_bytes: int = 128 << 10
    batch_streams: int = 2
    bulk_shape: str = "large"
    bulk_sms: int | None = None
    staged_min_run_bytes: int = 0
    offload_staged_min_run_bytes: int = 256 << 10
    carveout_sms: int = 0
    metrics: bool = True
    metrics_name: str = ""
    metrics_registry: str = "default"
    metrics_snapshot_s: float = 5.0

    def __post_init__(self) -> None:
        pools = self.pools
        if isinstance(pools, PoolSpec):
            pools = (pools,)
        pools = tuple(pools)
        if not pools or not all(isinstance(p, PoolSpec) for p in pools):
            raise ConfigError("pools must be a non-empty list of PoolSpec")
        names = [p.name for p in pools]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"duplicate pool names: {', '.join(dupes)}")
        object.__setattr__(self, "pools", pools)
        for key in ("device_slots", "host_slots", "file_slots", "device_id"):
            _check_int(key, getattr(self, key), 0, 1 << 31)
        if self.device_slots + self.host_slots + self.file_slots == 0:
            raise ConfigError("every tier has 0 slots: give device_slots, host_slots or file_slots > 0")
        _check_choice("host_huge_pages", self.host_huge_pages, HUGE_PAGE_MODES)
        _check_int("io_threads", self.io_threads, 1, MAX_IO_THREADS)
        _check_int("streams_per_direction", self.streams_per_direction, 1, 17)
        if self.copy_kernel_sms is not None:
            _check_int("copy_kernel_sms", self.copy_kernel_sms, 1, 1025)
        _check_int("memcpy_min_bytes", self.memcpy_min_bytes, 1, 1 << 40)
        _check_int("batch_min_bytes", self.batch_min_bytes, 1, 1 << 40)
        _check_int("batch_streams", self.batch_streams, 1, 17)
        _check_choice("bulk_shape", self.bulk_shape, BULK_SHAPES)
        if self.bulk_sms is not None:
            _check_int("bulk_sms", self.bulk_sms, 1, 1025)
        _check_int("staged_min_run_bytes", self.staged_min_run_bytes, 0, 1 << 40)
        _check_int("offload_staged_min_run_bytes", self.offload_staged_min_run_bytes, 0, 1 << 40)
        _check_int("carveout_sms", self.carveout_sms, 0, 1025)
        _check_choice("io_mode", self.io_mode, IO_MODES)
        _check_choice("fsync", self.fsync, FSYNC_POLICIES)
        _check_choice("io_engine", self.io_engine, IO_ENGINES)
        _check_choice("metrics_registry", self.metrics_registry, METRICS_REGISTRIES)
        _check_choice("sharing", self.sharing, SHARING_MODES)
        for key, lo, hi in (("min_age_s", 0, 86400), ("negative_ttl_s", 0, 3600), ("tmp_max_age_s", 60, 604800),
                             ("index_checkpoint_s", 1, 86400)):
            _check_seconds(key, getattr(self, key), lo, hi)
        if not isinstance(self.metrics_name, str) or not _METRICS_NAME.fullmatch(self.metrics_name):
            raise ConfigError(f"metrics_name = {self.metrics_name!r} must be up to 64 characters of A-Z a-z 0-9 _ . : -")
        _check_seconds("metrics_snapshot_s", self.metrics_snapshot_s, 0, 86400)
        for key in ("verify_checksums", "direct_io", "check_root_owner", "metrics"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key} = {getattr(self, key)!r} must be true or false")
        _check_int("capacity_bytes", self.capacity_bytes, 0, 1 << 62)
        _check_int("open_files", self.open_files, -1, 1 << 20)
        for key in ("kvikio_task_size", "kvikio_gds_threshold"):
            if getattr(self, key) is not None:
                _check_int(key, getattr(self, key), 0 if key == "kvikio_gds_threshold" else 4096, 1 << 40)
        if self.capacity_bytes and self.file_slots and self.capacity_bytes < self.block_file_bytes:
            raise ConfigError(
                f"capacity_bytes = {self.capacity_bytes} holds no block: one block takes {self.block_file_bytes} "
                "bytes on disk (0 means no byte limit)"
            )
        root = self.root
        if root is None:
            root = default_root()
        elif isinstance(root, (str, os.PathLike)):
            text = os.fspath(root)
            if not text.strip():
                raise ConfigError("root is empty: give a directory path")
            root = Path(os.path.expandvars(os.path.expanduser(text)))
        else:
            raise ConfigError(f"root = {root!r} must be a path string")
        object.__setattr__(self, "root", root)

    def pool(self, name: str) -> PoolSpec:
        """The pool called ``name``.

        Raises:
            UnknownPoolError: no pool has that name.
        """
        for p in self.pools:
            if p.name == name:
                return p
        from tiercache.errors import UnknownPoolError

        raise UnknownPoolError(
            f"unknown pool {name!r}; this cache has pools: {', '.join(p.name for p in self.pools)}"
        )

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all pools."""
        return sum(p.block_nbytes for p in self.pools)

    @property
    def block_file_bytes(self) -> int:
        """Bytes one block takes on disk (its files for every pool, headers and padding)."""
        from tiercache.files import file_size

        return sum(file_size(p.block_nbytes) for p in self.pools)

    @property
    def file_capacity_slots(self) -> int:
        """Blocks the file tier may hold: ``file_slots``, lowered by ``capacity_bytes``."""
        if not self.capacity_bytes:
            return self.file_slots
        return min(self.file_slots, self.capacity_bytes // self.block_file_bytes)

    def replace(self, **changes: Any) -> CacheConfig:
        """A copy with ``changes`` applied (validated like the original)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> dict:
        """A JSON-ready description of this configuration."""
        return {
            "pools": [p.describe() for p in self.pools],
            "device_slots": self.device_slots,
            "host_slots": self.host_slots,
            "file_slots": self.file_slots,
            "host_huge_pages": self.host_huge_pages,
            "root": str(self.root),
            "io_mode": self.io_mode,
            "fsync": self.fsync,
            "verify_checksums": self.verify_checksums,
            "io_threads": self.io_threads,
            "io_engine": self.io_engine,
            "capacity_bytes": self.capacity_bytes,
            "direct_io": self.direct_io,
            "check_root_owner": self.check_root_owner,
            "sharing": self.sharing,
            "min_age_s": self.min_age_s,
            "negative_ttl_s": self.negative_ttl_s,
            "tmp_max_age_s": self.tmp_max_age_s,
            "open_files": self.open_files,
            "index_checkpoint_s": self.index_checkpoint_s,
            "streams_per_direction": self.streams_per_direction,
            "copy_kernel_sms": self.copy_kernel_sms,
            "memcpy_min_bytes": self.memcpy_min_bytes,
            "batch_min_bytes": self.batch_min_bytes,
            "batch_streams": self.batch_streams,
            "bulk_shape": self.bulk_shape,
            "bulk_sms": self.bulk_sms,
            "staged_min_run_bytes": self.staged_min_run_bytes,
            "offload_staged_min_run_bytes": self.offload_staged_min_run_bytes,
            "carveout_sms": self.carveout_sms,
            "metrics": self.metrics,
            "metrics_name": self.metrics_name,
            "metrics_registry": self.metrics_registry,
            "metrics_snapshot_s": self.metrics_snapshot_s,
            "block_nbytes": self.block_nbytes,
        }


def _check_int(key: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value < hi:
        raise ConfigError(f"{key} = {value!r} must be an integer in [{lo}, {hi})")


def _check_seconds(key: str, value: Any, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ConfigError(f"{key} = {value!r} must be a number of seconds in [{lo}, {hi}]")


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} = {value!r} is not valid; choose one of: {', '.join(choices)}")


def _check_keys(where: str, table: Any, allowed: set[str]) -> dict:
    if not isinstance(table, dict):
        raise ConfigError(f"[{where}] must be a table, got {type(table).__name__}")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(
            f"unknown key(s) in [{where}]: {', '.join(unknown)}; valid keys: {', '.join(sorted(allowed))}"
        )
    return table


def pool_from_table(name: str, table: dict) -> PoolSpec:
    """Build a pool from its TOML table: KV geometry keys, or ``block_shape``, plus ``dtype``.

    Raises:
        ConfigError: missing, unknown or invalid keys.
    """
    where = f"pools.{name}"
    if "block_shape" in table:
        _check_keys(where, table, {"block_shape", "dtype"})
        if "dtype" not in table:
            raise ConfigError(f"[{where}] needs dtype")
        shape = table["block_shape"]
        if not isinstance(shape, list):
            raise ConfigError(f"[{where}] block_shape = {shape!r} must be a list of positive integers")
        return PoolSpec(name=name, block_shape=tuple(shape), dtype=table["dtype"])
    _check_keys(where, table, _KV_KEYS | {"dtype"})
    missing = sorted((_KV_KEYS - {"layout"}) - set(table))
    if missing:
        raise ConfigError(
            f"[{where}] is missing {', '.join(missing)}; give either block_shape + dtype or the "
            "KV geometry (num_layers, kv_factor, num_kv_heads, tokens_per_block, head_dim, dtype)"
        )
    kw = {k: table[k] for k in _KV_KEYS if k in table}
    return PoolSpec.kv(name, dtype=table.get("dtype", "bfloat16"), **kw)


def config_from_dict(data: dict, **overrides: Any) -> CacheConfig:
    """Build a :class:`CacheConfig` from a parsed TOML document, then apply ``overrides``
    (keyword names of :class:`CacheConfig`, for command-line options).

    Raises:
        ConfigError: malformed document or invalid values.
    """
    _check_keys("top level", data, _TOP_KEYS)
    tiers = _check_keys("tiers", data.get("tiers", {}), _TIER_KEYS)
    file = _check_keys("file", data.get("file", {}), _FILE_KEYS)
    device = _check_keys("device", data.get("device", {}), {"device_id"})
    transfer = _check_keys("transfer", data.get("transfer", {}), _TRANSFER_KEYS)
    metrics = {_METRICS_KEYS[k]: v for k, v in _check_keys("metrics", data.get("metrics", {}), set(_METRICS_KEYS)).items()}
    pools_table = data.get("pools")
    if not isinstance(pools_table, dict) or not pools_table:
        raise ConfigError("the config needs at least one [pools.<name>] table")
    pools = tuple(pool_from_table(name, _check_keys(f"pools.{name}", t, _KV_KEYS | {"dtype", "block_shape"}))
                  for name, t in pools_table.items())
    kwargs: dict[str, Any] = {"pools": pools, **tiers, **file, **device, **transfer, **metrics}
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return CacheConfig(**kwargs)
    except TypeError as exc:  # an override with a wrong name
        raise ConfigError(str(exc)) from None


def load_config(path: str | os.PathLike, **overrides: Any) -> CacheConfig:
    """Read a TOML configuration file (see the module docstring for its form).

    Raises:
        ConfigError: ``path`` is not a path, the file is missing, unreadable, not UTF-8, not
            valid TOML, or holds invalid values.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"config {path!r}: give a CacheConfig or the path of a TOML file")
    p = Path(path)
    try:
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte {exc.start}): not a TOML file") from None
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {exc.strerror}") from None
    try:
        return config_from_dict(data, **overrides)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None
