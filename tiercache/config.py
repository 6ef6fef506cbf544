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
    index_checkpoint_s = 60.0      # save the root's index this often (at the next call), on flush and close

    [sharing]
    sharing = "exclusive"          # exclusive (one process) | shared (many processes, content keys)
    min_age_s = 30.0               # shared: files younger than this are not evicted by policy

    [metrics]                      # Prometheus metrics (tiercache.metrics, docs/metrics.md)
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

Each section is a frozen dataclass of :mod:`tiercache.settings`, where every setting's default,
range and meaning is defined once (docs/configuration.md is generated from them). The
``[sharing]`` keys are also accepted in ``[file]``. Every value is validated; an unknown key, a
wrong type, or a value out of range raises :class:`~tiercache.errors.ConfigError` naming the
key, the value, and what is valid.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from tiercache.errors import ConfigError
from tiercache.geometry import PoolSpec
from tiercache.settings import (
    LEGACY_FILE_KEYS,
    SECTIONS,
    DeviceSettings,
    FileSettings,
    MetricsSettings,
    SharingSettings,
    TierSettings,
    TransferSettings,
    default_root,
    flat_names,
    sections,
)

__all__ = ["CacheConfig", "config_from_dict", "default_root", "load_config", "pool_from_table"]

_KV_KEYS = {"num_layers", "kv_factor", "num_kv_heads", "tokens_per_block", "head_dim", "layout"}
_FLAT = flat_names()
#: CacheConfig's attribute of each section
_ATTR = {"tiers": "tier_settings", "file": "file_settings", "sharing": "sharing_settings",
         "transfer": "transfer_settings", "metrics": "metrics_settings", "device": "device_settings"}


class CacheConfig:
    """Everything a :class:`~tiercache.TierCache` needs: its pools and one settings object per
    section (:mod:`tiercache.settings`; docs/configuration.md lists every setting, its default
    and range).

    Args:
        pools: one or more :class:`PoolSpec`; a block has one slot in every pool.
        tier_settings, file_settings, sharing_settings, transfer_settings, metrics_settings,
            device_settings: whole sections (default: each section's defaults).
        **settings: single settings by name (``host_slots=512``, ``root="/mnt/nvme/tc"``,
            ``sharing="shared"``, ``metrics=False``...), applied over the sections.

    Every setting reads as an attribute too (``config.root``, ``config.io_threads``).

    Raises:
        ConfigError: an unknown setting, a value out of range, no pool, duplicate pool names,
            every tier at 0 slots, or a ``capacity_bytes`` too small for one block.
    """

    __slots__ = ("pools", "tier_settings", "file_settings", "sharing_settings", "transfer_settings",
                 "metrics_settings", "device_settings")

    def __init__(self, pools, *, tier_settings: TierSettings | None = None, file_settings: FileSettings | None = None,
                 sharing_settings: SharingSettings | None = None, transfer_settings: TransferSettings | None = None,
                 metrics_settings: MetricsSettings | None = None, device_settings: DeviceSettings | None = None,
                 **settings: Any) -> None:
        if isinstance(pools, PoolSpec):
            pools = (pools,)
        try:
            pools = tuple(pools)
        except TypeError:
            raise ConfigError("pools must be a non-empty list of PoolSpec") from None
        if not pools or not all(isinstance(p, PoolSpec) for p in pools):
            raise ConfigError("pools must be a non-empty list of PoolSpec")
        names = [p.name for p in pools]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"duplicate pool names: {', '.join(dupes)}")
        given = {"tiers": tier_settings, "file": file_settings, "sharing": sharing_settings,
                 "transfer": transfer_settings, "metrics": metrics_settings, "device": device_settings}
        built = sections(given, **settings)
        object.__setattr__(self, "pools", pools)
        for section, obj in built.items():
            object.__setattr__(self, _ATTR[section], obj)
        if self.device_slots + self.host_slots + self.file_slots == 0:
            raise ConfigError("every tier has 0 slots: give device_slots, host_slots or file_slots > 0")
        if self.capacity_bytes and self.file_slots and self.capacity_bytes < self.block_file_bytes:
            raise ConfigError(
                f"capacity_bytes = {self.capacity_bytes} holds no block: one block takes {self.block_file_bytes} "
                "bytes on disk (0 means no byte limit)"
            )

    def __getattr__(self, name: str) -> Any:
        where = _FLAT.get(name)
        if where is None:
            raise AttributeError(f"CacheConfig has no setting {name!r}")
        return getattr(object.__getattribute__(self, _ATTR[where[0]]), where[1])

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("CacheConfig is frozen: use replace()")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheConfig) and all(getattr(self, a) == getattr(other, a) for a in self.__slots__)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, a) for a in self.__slots__))

    def __repr__(self) -> str:
        return "CacheConfig(" + ", ".join(f"{a}={getattr(self, a)!r}" for a in self.__slots__) + ")"

    def __reduce__(self):
        return (_rebuild, (self.pools, {a: getattr(self, a) for a in self.__slots__[1:]}))

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

    def replace(self, pools=None, **changes: Any) -> CacheConfig:
        """A copy with ``changes`` (single settings by name, or whole sections) applied,
        validated like the original."""
        sections = {a: getattr(self, a) for a in self.__slots__[1:]}
        for a in list(sections):
            if a in changes:
                sections[a] = changes.pop(a)
        return CacheConfig(self.pools if pools is None else pools, **sections, **changes)

    def describe(self) -> dict:
        """A JSON-ready description of this configuration: the pools and every setting by its
        flat name."""
        out: dict[str, Any] = {"pools": [p.describe() for p in self.pools]}
        for flat in _FLAT:
            v = getattr(self, flat)
            out[flat] = str(v) if isinstance(v, Path) else v
        out["block_nbytes"] = self.block_nbytes
        return out


def _rebuild(pools, sections: dict) -> CacheConfig:
    return CacheConfig(pools, **sections)


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
    import dataclasses

    _check_keys("top level", data, set(SECTIONS) | {"pools"})
    flat: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        names = {f.name for f in dataclasses.fields(cls)}
        table = _check_keys(section, data.get(section, {}), names | (LEGACY_FILE_KEYS if section == "file" else set()))
        for name, value in table.items():
            if section == "metrics":
                name = next(k for k, (sec, n) in _FLAT.items() if sec == "metrics" and n == name)
            flat[name] = value
    pools_table = data.get("pools")
    if not isinstance(pools_table, dict) or not pools_table:
        raise ConfigError("the config needs at least one [pools.<name>] table")
    pools = tuple(pool_from_table(name, _check_keys(f"pools.{name}", t, _KV_KEYS | {"dtype", "block_shape"}))
                  for name, t in pools_table.items())
    flat.update({k: v for k, v in overrides.items() if v is not None})
    return CacheConfig(pools, **flat)


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
