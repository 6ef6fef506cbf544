"""Settings: one frozen dataclass per section of the TOML configuration, each setting defined
once (its default, its valid range or choices, one line of meaning) and validated once.

=====================  =========================================================================
section                dataclass
=====================  =========================================================================
``[tiers]``            :class:`TierSettings`: slots per tier, the host tier's memory
``[file]``             :class:`FileSettings`: the file tier's root, durability, I/O engine, threads
``[sharing]``          :class:`SharingSettings`: exclusive or shared roots and their timings
``[transfer]``         :class:`TransferSettings`: copy paths between VRAM and host memory
``[metrics]``          :class:`MetricsSettings`: Prometheus metrics and saved snapshots
``[device]``           :class:`DeviceSettings`: the CUDA device
=====================  =========================================================================

:class:`~tiercache.CacheConfig` holds one of each; :class:`~tiercache.files.FileTier`,
:class:`~tiercache.transfer.TransferEngine`, :class:`~tiercache.RowStore` and the vLLM tier take
the sections whole. Each field's ``metadata`` carries its range (``lo``, ``hi``, both inclusive)
or ``choices`` and its ``doc``; :func:`reference` renders them (docs/configuration.md is
generated from it, and a test fails when the two differ).

A bad value raises :class:`~tiercache.errors.ConfigError` naming the setting, the value and what
is valid.
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from tiercache.errors import ConfigError

IO_MODES = ("auto", "gds", "compat", "posix")
FSYNC_POLICIES = ("none", "data", "data+dir")
IO_ENGINES = ("auto", "io_uring", "threads", "python")
SHARING_MODES = ("exclusive", "shared")
HUGE_PAGE_MODES = ("auto", "on", "off")
BULK_SHAPES = ("small", "large", "off")
METRICS_REGISTRIES = ("default", "none")
MAX_IO_THREADS = 256
MAX_ROOTS = 64  # a root array gives each member one of the 64 block subdirectories at least
_METRICS_NAME = re.compile(r"[A-Za-z0-9_.:-]{0,64}", re.ASCII)


def _s(default: Any, doc: str, *, lo: float | None = None, hi: float | None = None,
       choices: tuple | None = None, kind: str | None = None, optional: bool = False) -> Any:
    """A setting: its default and the metadata the validation and the reference read.
    ``kind``: ``int`` (an integer), ``seconds`` (a number), ``bool``, ``path`` or ``name``."""
    if kind is None:
        kind = "bool" if isinstance(default, bool) else "choice" if choices else "int"
    return field(default=default, metadata={"doc": doc, "lo": lo, "hi": hi, "choices": choices, "kind": kind,
                                            "optional": optional})


def _check(section: str, f: dataclasses.Field, value: Any) -> None:
    m = f.metadata
    kind, lo, hi = m["kind"], m["lo"], m["hi"]
    name = f.name
    if section == "metrics":  # named as CacheConfig and the command line name it
        name = next(flat for flat, field_name in METRICS_FLAT.items() if field_name == f.name)
    if value is None and m["optional"]:
        return
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{name} = {value!r} must be true or false")
    elif kind == "choice":
        if value not in m["choices"]:
            raise ConfigError(f"{name} = {value!r} is not valid; choose one of: {', '.join(m['choices'])}")
    elif kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ConfigError(f"{name} = {value!r} must be an integer in [{lo}, {hi}]")
    elif kind == "seconds":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
            raise ConfigError(f"{name} = {value!r} must be a number of seconds in [{lo}, {hi}]")
    elif kind == "name":
        if not isinstance(value, str) or not _METRICS_NAME.fullmatch(value):
            raise ConfigError(f"{name} = {value!r} must be up to 64 characters of A-Z a-z 0-9 _ . : -")


@dataclass(frozen=True)
class _Section:
    """Validation of every field from its metadata, once, at construction (a dataclass without
    fields of its own: the sections add them)."""

    #: the TOML section's name
    SECTION = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check(self.SECTION, f, getattr(self, f.name))

    def replace(self, **changes: Any):
        """A copy with ``changes`` (validated like the original).

        Raises:
            ConfigError: an unknown name or a bad value.
        """
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ConfigError(f"unknown [{self.SECTION}] setting(s) {', '.join(unknown)}; valid: "
                              f"{', '.join(sorted(names))}")
        return dataclasses.replace(self, **changes)

    def describe(self) -> dict:
        """The settings as a JSON-ready dict."""
        def plain(v):
            return str(v) if isinstance(v, Path) else [plain(x) for x in v] if isinstance(v, tuple) else v
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _path(name: str, value: Any) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{name} = {value!r} must be a path string")
    text = os.fspath(value)
    if not text.strip():
        raise ConfigError(f"{name} is empty: give a directory path")
    return Path(os.path.expandvars(os.path.expanduser(text)))


def default_root() -> Path:
    """``<system temp dir>/tiercache-<user>``: the file-tier root when none is configured."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name in some containers
        user = str(os.getuid())
    return Path(tempfile.gettempdir()) / f"tiercache-{user}"


@dataclass(frozen=True)
class TierSettings(_Section):
    """``[tiers]``: how many blocks each tier holds, and where the host tier's memory comes from."""

    SECTION = "tiers"
    device_slots: int = _s(0, "blocks the device tier holds in VRAM (0: none; ignored without CUDA)", lo=0,
                           hi=2**31 - 1)
    host_slots: int = _s(0, "blocks the host tier holds (pinned DRAM with CUDA, page-aligned without); 0: none",
                         lo=0, hi=2**31 - 1)
    file_slots: int = _s(0, "blocks the file tier holds under [file] root; 0: no file tier", lo=0, hi=2**31 - 1)
    host_huge_pages: str = _s("auto", "the host tier on reserved huge pages: auto (when enough are free), on "
                              "(or fail), off", choices=HUGE_PAGE_MODES)


@dataclass(frozen=True)
class FileSettings(_Section):
    """``[file]``: the file tier's root, durability, checks and I/O engine."""

    SECTION = "file"
    root: Path | None = _s(None, "directory of the file tier (created if missing); default "
                           "<system temp dir>/tiercache-<user>", kind="path", optional=True)
    roots: tuple[Path, ...] | None = _s(None, "several roots, one per device, as one file tier (a root array: "
                                        "blocks spread by a hash of their key; docs/file-format.md); "
                                        "root is then the first", kind="paths", optional=True)
    io_mode: str = _s("auto", "how device blocks reach files: auto (GDS, else kvikio's compat mode with CUDA, "
                      "else POSIX), gds, compat, posix", choices=IO_MODES)
    fsync: str = _s("data", "durability before a write is reported: none, data (fsync each file before its "
                    "rename; a batch shares one syncfs), data+dir (also the directory)", choices=FSYNC_POLICIES)
    verify_checksums: bool = _s(True, "check each block file's XXH3-64 when it is read")
    io_threads: int = _s(8, "file I/O threads (tiercache's and kvikio's); reads that wait for nothing go ahead "
                         "of queued writes", lo=1, hi=MAX_IO_THREADS)
    io_engine: str = _s("auto", "who runs the per-file system calls: auto (the C threads where the native "
                        "library builds, else python), io_uring, threads, python", choices=IO_ENGINES)
    capacity_bytes: int = _s(0, "bytes the file tier may take on disk (0: no byte limit; file_slots still "
                             "holds); least recently used blocks are deleted beyond it", lo=0, hi=2**62)
    direct_io: bool = _s(True, "O_DIRECT block files where block sizes are multiples of 4096 (cold reads 97% "
                         "of raw against 80% buffered)")
    open_files: int = _s(-1, "block files the native engine holds open and recycles: -1 every file of the "
                         "tier within 3/4 of the open-file limit, 0 none, N at most N (exclusive roots)",
                         lo=-1, hi=2**20)
    check_root_owner: bool = _s(True, "refuse a root that another user owns or that others may write")
    index_checkpoint_s: float = _s(60.0, "save the root's index (what the next open starts from) at the first "
                                   "call this long after the last save, and on flush and close",
                                   lo=1, hi=86400, kind="seconds")
    kvikio_task_size: int | None = _s(None, "bytes per kvikio task (none: kvikio's default, 4 MiB)", lo=4096,
                                      hi=2**40, optional=True)
    kvikio_gds_threshold: int | None = _s(None, "I/O smaller than this skips cuFile in kvikio (none: its "
                                          "default)", lo=0, hi=2**40, optional=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        roots = self.roots
        if roots is not None:
            if isinstance(roots, (str, os.PathLike)) or not isinstance(roots, (list, tuple)):
                raise ConfigError(f"roots = {roots!r} must be a list of directory paths")
            if not 1 <= len(roots) <= MAX_ROOTS:
                raise ConfigError(f"roots has {len(roots)} entries: give 1 .. {MAX_ROOTS} directories")
            roots = tuple(_path("roots", r) for r in roots)
            if len(set(roots)) != len(roots):
                dup = next(r for i, r in enumerate(roots) if r in roots[:i])
                raise ConfigError(f"roots lists {str(dup)!r} twice")
            object.__setattr__(self, "roots", roots)
        root = self.root
        if root is None:
            root = roots[0] if roots else default_root()
        else:
            root = _path("root", root)
            if roots and root not in roots:
                raise ConfigError(f"root = {str(root)!r} is not one of roots = {[str(r) for r in roots]}; give "
                                  "one of them (or leave root out: it is then the first)")
        object.__setattr__(self, "root", root)

    @property
    def all_roots(self) -> tuple[Path, ...]:
        """The directories of the file tier: ``roots``, or ``(root,)``."""
        return self.roots if self.roots else (cast(Path, self.root),)  # root is set by __post_init__


@dataclass(frozen=True)
class SharingSettings(_Section):
    """``[sharing]``: one process per root, or many on one root (content keys only)."""

    SECTION = "sharing"
    sharing: str = _s("exclusive", "exclusive (one process opens the root; any keys) or shared (any number of "
                      "processes at once; content keys; docs/sharing.md)", choices=SHARING_MODES)
    min_age_s: float = _s(30.0, "shared: block files younger than this are not evicted by policy", lo=0,
                          hi=86400, kind="seconds")
    negative_ttl_s: float = _s(1.0, "shared: a key found in no file is not looked for on disk again this long",
                               lo=0, hi=3600, kind="seconds")
    tmp_max_age_s: float = _s(900.0, "shared: another machine's or boot's temporary files older than this are "
                              "abandoned (this machine's dead writers' at once)", lo=60, hi=604800,
                              kind="seconds")
    sweep_interval_s: float = _s(1.0, "shared: the least time between two sweeps of the root back to its "
                                 "capacity (longer where a sweep took more than a tenth of it)", lo=0, hi=3600,
                                 kind="seconds")

    @property
    def shared(self) -> bool:
        """The root is shared by several processes."""
        return self.sharing == "shared"


@dataclass(frozen=True)
class TransferSettings(_Section):
    """``[transfer]``: which copy path moves blocks between VRAM and host memory."""

    SECTION = "transfer"
    streams_per_direction: int = _s(2, "CUDA streams per copy direction (offload, onboard, copy)", lo=1, hi=16)
    copy_kernel_sms: int | None = _s(8, "SMs the gather/scatter kernel may occupy (none: all); 8 moves as "
                                     "much as 132 on an H100", lo=1, hi=1024, optional=True)
    memcpy_min_bytes: int = _s(4 << 20, "runs of consecutive slots this long go to cudaMemcpyAsync", lo=1,
                               hi=2**40)
    batch_min_bytes: int = _s(128 << 10, "other blocks and segments this long go to cuMemcpyBatchAsync (copy "
                              "engines); tiercache calibrate measures the crossover", lo=1, hi=2**40)
    batch_streams: int = _s(2, "streams (copy engines) one cuMemcpyBatchAsync batch is split over", lo=1, hi=16)
    bulk_shape: str = _s("large", "the TMA bulk-copy kernel: large (one CTA per SM), small (fits beside "
                         "compute), off", choices=BULK_SHAPES)
    bulk_sms: int | None = _s(None, "SMs the bulk kernel may use (none: copy_kernel_sms)", lo=1, hi=1024,
                              optional=True)
    staged_min_run_bytes: int = _s(0, "host -> device batches whose host runs average this many bytes take "
                                   "the staged path (0: off)", lo=0, hi=2**40)
    offload_staged_min_run_bytes: int = _s(256 << 10, "device -> host batches whose host runs average this many "
                                           "bytes take the staged path (0: off)", lo=0, hi=2**40)
    carveout_sms: int = _s(0, "SMs your compute kernels leave free for copies (tiercache.sm_carveout); 0: none",
                           lo=0, hi=1024)


@dataclass(frozen=True)
class MetricsSettings(_Section):
    """``[metrics]``: Prometheus metrics and the stats snapshots ``tiercache top --root`` reads."""

    SECTION = "metrics"
    enabled: bool = _s(True, "count every transfer (latency histograms) and export the cache's metrics")
    name: str = _s("", "the cache label of its series (\"\": tiercache, then tiercache-2, ...)", kind="name")
    registry: str = _s("default", "default: prometheus_client's REGISTRY when installed; none: register "
                       "yourself (tiercache.metrics.register)", choices=METRICS_REGISTRIES)
    snapshot_interval_s: float = _s(5.0, "save stats in the root this often (0: only on flush and close)", lo=0,
                                    hi=86400, kind="seconds")


@dataclass(frozen=True)
class DeviceSettings(_Section):
    """``[device]``: the CUDA device of the device tier."""

    SECTION = "device"
    device_id: int = _s(0, "CUDA device ordinal of the device tier", lo=0, hi=2**31 - 1)


#: the sections, by TOML name
SECTIONS: dict[str, type[_Section]] = {c.SECTION: c for c in (TierSettings, FileSettings, SharingSettings,
                                                               TransferSettings, MetricsSettings, DeviceSettings)}
#: [metrics] fields under the flat names CacheConfig and the command line use
METRICS_FLAT = {"metrics": "enabled", "metrics_name": "name", "metrics_registry": "registry",
                "metrics_snapshot_s": "snapshot_interval_s"}
#: [sharing] keys also accepted in [file] (where they were before the [sharing] section)
LEGACY_FILE_KEYS = frozenset(f.name for f in dataclasses.fields(SharingSettings))


def flat_names() -> dict[str, tuple[str, str]]:
    """Every setting's flat name (a :class:`~tiercache.CacheConfig` keyword) -> (section, field)."""
    out: dict[str, tuple[str, str]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            out[f.name] = (section, f.name)
    for flat, name in METRICS_FLAT.items():
        del out[name]
        out[flat] = ("metrics", name)
    return out


def sections(base: dict[str, Any] | None = None, **settings: Any) -> dict[str, Any]:
    """The section objects (``{"file": FileSettings, ...}``) of single settings given by their
    flat names (:func:`flat_names`), over ``base`` (section objects to start from; default:
    each section's defaults).

    Raises:
        ConfigError: an unknown name or a bad value.
    """
    flat = flat_names()
    unknown = sorted(set(settings) - set(flat))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(flat))}")
    per: dict[str, dict] = {}
    for name, value in settings.items():
        section, field_name = flat[name]
        per.setdefault(section, {})[field_name] = value
    out = {}
    for section, cls in SECTIONS.items():
        obj = (base or {}).get(section)
        changes = per.get(section, {})
        if obj is None:
            obj = cls(**changes)
        elif not isinstance(obj, cls):
            raise ConfigError(f"[{section}] settings {obj!r} must be a {cls.__name__}")
        elif changes:
            obj = obj.replace(**changes)
        out[section] = obj
    return out


def default(section: str, name: str) -> Any:
    """The default of ``[section] name`` (the one definition)."""
    return next(f.default for f in dataclasses.fields(SECTIONS[section]) if f.name == name)




def reference(default_toml: str | None = None) -> str:
    """The configuration reference (Markdown): per section, each setting's default, range and
    meaning, after ``default_toml`` (the text of ``configs/default.toml``, read from
    :func:`tiercache.resources.default_config` when None and present); docs/configuration.md
    holds this text."""
    if default_toml is None:
        from tiercache.resources import default_config

        if default_config().is_file():
            default_toml = default_config().read_text()
    lines = ["# Configuration", "",
             "Generated from `tiercache/settings.py` (`python -m tiercache.settings > docs/configuration.md`); a test",
             "fails when the two differ.", "",
             "A configuration is a TOML file (`TierCache.open(\"my.toml\")`, `--config` on the command line), parsed",
             "with `tomllib` and validated: an unknown key or a bad value is one `ConfigError` naming it and what is",
             "valid. Each section below is one frozen dataclass of `tiercache/settings.py` (`TierSettings`,",
             "`FileSettings`, `SharingSettings`, `TransferSettings`, `MetricsSettings`, `DeviceSettings`), where the",
             "setting's default, range and meaning are defined once; `CacheConfig`, `FileTier`, `TransferEngine`,",
             "`RowStore` and the vLLM tier take the sections whole. Every setting is also a keyword of `CacheConfig`",
             "(the `[metrics]` ones as `metrics`, `metrics_name`, `metrics_registry`, `metrics_snapshot_s`). The",
             "`[sharing]` keys are also read in `[file]`, where they were before that section. Ranges include both",
             "ends.", ""]
    if default_toml:
        lines += ["`configs/default.toml`, the configuration `tiercache bench` runs by default:", "", "```toml",
                  default_toml.rstrip("\n"), "```", ""]
    for section, cls in SECTIONS.items():
        desc = (cls.__doc__ or "").split(":", 1)[-1].strip()
        lines += [f"## [{section}]", "", desc[:1].upper() + desc[1:], "",
                  "| setting | default | valid | meaning |", "| --- | --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            m = f.metadata
            if m["kind"] == "choice":
                valid = " \\| ".join(m["choices"])
            elif m["kind"] == "bool":
                valid = "true \\| false"
            elif m["kind"] in ("int", "seconds"):
                valid = f"{m['lo']:g} .. {m['hi']:g}" if m["kind"] == "seconds" else f"{m['lo']} .. {m['hi']}"
            elif m["kind"] == "name":
                valid = "up to 64 of A-Z a-z 0-9 _ . : -"
            elif m["kind"] == "paths":
                valid = "a list of 1 .. 64 paths"
            else:
                valid = "a path"
            if m["optional"] and m["kind"] not in ("path", "paths"):
                valid += " or none"
            d = f.default
            shown = "none" if d is None else str(d).lower() if isinstance(d, bool) else f'"{d}"' if isinstance(d, str) \
                else f"{d:g}" if isinstance(d, float) else str(d)
            lines.append(f"| `{f.name}` | {shown} | {valid} | {m['doc']} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m tiercache.settings > docs/configuration.md
    import sys

    sys.stdout.write(reference())
