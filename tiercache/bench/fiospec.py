"""fio-style job descriptions for ``tiercache bench``: options, sizes, job files.

Options keep fio's names where they fit (``rw``, ``bs``, ``size``, ``iodepth``,
``iodepth_batch``, ``numjobs``, ``runtime``, ``time_based``, ``direct``, ``verify``, ``rwmixread``)
and add tiercache's (``tiers``, ``io``, ``nblocks``, ``baseline``). A job file is fio's INI
(``[global]`` then one section per job) or TOML (``[global]`` and ``[jobs.<name>]``).
"""

from __future__ import annotations

import configparser
import re
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path

from tiercache.errors import ConfigError
from tiercache.files import IO_ENGINES
from tiercache.settings import IO_MODES

RW = ("read", "write", "randread", "randwrite", "rw", "randrw", "readwrite")
TIER_PAIRS = ("device:host", "host:file", "device:file")
#: what a job is compared with: fio on the same directory (``auto``: fio where installed, else
#: the naive way), the naive way in Python, or nothing
BASELINES = ("auto", "fio", "naive", "none")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text, what: str = "size") -> int:
    """Bytes in a fio-style size: ``4096``, ``16k``, ``2m``, ``1g``, ``16KiB`` (powers of 1024).

    Raises:
        ConfigError: not a size, or not positive.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.match(str(text))
        if not m:
            raise ConfigError(f"{what} = {text!r} is not a size (e.g. 4096, 16k, 2m, 1g)")
        value = int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " "))
    if value <= 0:
        raise ConfigError(f"{what} = {text!r} must be positive")
    return value


def parse_bool(text, what: str) -> bool:
    if isinstance(text, bool):
        return text
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on", ""):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{what} = {text!r} must be a boolean (0/1, true/false)")


@dataclass(frozen=True)
class FioJob:
    """One job. Sizes in bytes, ``runtime`` in seconds (0: run through the blocks once).

    ``rw``: read = onboard (lower tier -> upper), write = offload (upper -> lower); ``rand*``
    visits the blocks in random order; ``rw``/``randrw`` mixes them (``rwmixread`` percent
    reads). ``bs`` 0 means the config's pool geometry. ``iodepth`` blocks are in flight per job,
    submitted ``iodepth_batch`` per engine request (default ``iodepth // 4``). ``baseline`` is one
    of :data:`BASELINES` (``True``/``False`` mean ``auto``/``none``). ``ioengine`` is the file
    tier's I/O engine (:data:`~tiercache.files.IO_ENGINES`; fio's own engine names, such as
    ``libaio`` or ``psync``, are accepted and mean ``auto``).
    """

    name: str = "job"
    rw: str = "write"
    bs: int = 0
    size: int = 256 << 20
    nblocks: int = 0
    iodepth: int = 32
    iodepth_batch: int = 0
    numjobs: int = 1
    runtime: float = 0.0
    time_based: bool = False
    direct: bool = True
    tiers: str = "host:file"
    io: str = "auto"
    ioengine: str = "auto"
    verify: bool = True
    rwmixread: int = 50
    baseline: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.baseline, bool):
            object.__setattr__(self, "baseline", "auto" if self.baseline else "none")
        if self.baseline not in BASELINES:
            raise ConfigError(f"job {self.name!r}: baseline = {self.baseline!r}; valid: {', '.join(BASELINES)}")
        if self.rw not in RW:
            raise ConfigError(f"job {self.name!r}: rw = {self.rw!r}; valid: {', '.join(RW)}")
        if self.tiers not in TIER_PAIRS:
            raise ConfigError(f"job {self.name!r}: tiers = {self.tiers!r}; valid: {', '.join(TIER_PAIRS)}")
        if self.ioengine not in IO_ENGINES:
            raise ConfigError(f"job {self.name!r}: ioengine = {self.ioengine!r}; valid: {', '.join(IO_ENGINES)}")
        if self.io not in IO_MODES:
            raise ConfigError(f"job {self.name!r}: io = {self.io!r}; valid: {', '.join(IO_MODES)}")
        for key, lo, hi in (("iodepth", 1, 65536), ("numjobs", 1, 64), ("rwmixread", 0, 100)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ConfigError(f"job {self.name!r}: {key} = {v!r} must be an integer in [{lo}, {hi}]")
        if not 0 <= self.iodepth_batch <= self.iodepth:
            raise ConfigError(
                f"job {self.name!r}: iodepth_batch = {self.iodepth_batch} must be in [0, iodepth={self.iodepth}]"
            )
        if self.runtime < 0 or (self.time_based and self.runtime <= 0):
            raise ConfigError(f"job {self.name!r}: time_based needs runtime > 0 (got {self.runtime})")
        if self.nblocks < 0:
            raise ConfigError(f"job {self.name!r}: nblocks = {self.nblocks} must be >= 0")

    @property
    def batch(self) -> int:
        """Blocks per engine request: ``iodepth_batch``, by default a quarter of ``iodepth`` (so
        four requests overlap)."""
        return self.iodepth_batch or max(1, self.iodepth // 4)

    @property
    def upper(self) -> str:
        return self.tiers.split(":")[0]

    @property
    def lower(self) -> str:
        return self.tiers.split(":")[1]

    def blocks_for(self, block_bytes: int) -> int:
        """Blocks per job: ``nblocks``, else ``size // block_bytes`` (at least 1)."""
        return self.nblocks or max(1, self.size // block_bytes)

    def options(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "name"}


_CONVERT = {
    "bs": lambda v: parse_size(v, "bs"),
    "size": lambda v: parse_size(v, "size"),
    "nblocks": int,
    "iodepth": int,
    "iodepth_batch": int,
    "iodepth_batch_submit": int,
    "numjobs": int,
    "rwmixread": int,
    "runtime": lambda v: float(str(v).rstrip("s") or 0),
    "time_based": lambda v: parse_bool(v, "time_based"),
    "direct": lambda v: parse_bool(v, "direct"),
    "verify": lambda v: parse_bool(v, "verify"),
    "baseline": lambda v: str(v).strip().lower() if str(v).strip().lower() in BASELINES else parse_bool(v, "baseline"),
    "rw": str,
    "readwrite": str,
    "tiers": str,
    "io": str,
    "ioengine": str,
    "blocksize": lambda v: parse_size(v, "bs"),
}
_ALIASES = {"readwrite": "rw", "iodepth_batch_submit": "iodepth_batch", "blocksize": "bs"}


def job_from_options(name: str, opts: dict, base: FioJob | None = None) -> FioJob:
    """A job from option names and values (fio spellings accepted), on top of ``base``.

    Raises:
        ConfigError: an unknown option or a bad value (the message names both).
    """
    kw = {}
    for key, value in opts.items():
        k = key.strip().lower().replace("-", "_")
        if k not in _CONVERT:
            raise ConfigError(f"job {name!r}: unknown option {key!r}; tiercache understands: "
                              f"{', '.join(sorted(_CONVERT))}")
        if k == "ioengine" and str(value).strip() not in IO_ENGINES:  # one of fio's own engines
            continue
        try:
            kw[_ALIASES.get(k, k)] = _CONVERT[k](value)
        except ConfigError as exc:
            raise ConfigError(f"job {name!r}: {exc}") from None
        except (ValueError, TypeError):
            raise ConfigError(f"job {name!r}: {key} = {value!r} is not valid") from None
    return replace(base or FioJob(), name=name, **kw)


def load_job_file(path: Path, overrides: dict | None = None) -> list[FioJob]:
    """Jobs from a fio INI or TOML job file; ``overrides`` (command-line options) apply to all.

    Raises:
        ConfigError: missing or unreadable file, not UTF-8, syntax error, no jobs, or bad options.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"job file {str(p)!r} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"job file {str(p)!r} is not UTF-8 text (byte {exc.start}): not a fio job file") from None
    except OSError as exc:
        raise ConfigError(f"job file {str(p)!r} cannot be read: {exc.strerror}") from None
    if p.suffix == ".toml":
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"job file {p}: not valid TOML: {exc}") from None
        glob, sections = doc.get("global", {}), doc.get("jobs", {})
        if set(doc) - {"global", "jobs"}:
            raise ConfigError(
                f"job file {p}: unknown table(s) {sorted(set(doc) - {'global', 'jobs'})}; use [global] and "
                f"[jobs.<name>]"
            )
    else:
        cp = configparser.ConfigParser(interpolation=None, allow_no_value=True)
        try:
            cp.read_string(text)
        except configparser.Error as exc:
            raise ConfigError(f"job file {p}: not a valid fio job file: {exc}") from None
        glob = dict(cp["global"]) if cp.has_section("global") else {}
        sections = {s: dict(cp[s]) for s in cp.sections() if s != "global"}
    if not sections:
        raise ConfigError(f"job file {p}: no jobs (add a section per job)")
    return [job_from_options(name, {**glob, **opts, **(overrides or {})}) for name, opts in sections.items()]
