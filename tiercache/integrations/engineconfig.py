"""The engine integrations' configs: a dict from the engine's own config (vLLM's
``kv_connector_extra_config``, SGLang's ``--hicache-storage-backend-extra-config``), checked
and completed with the integration's defaults, whatever the engine."""

from __future__ import annotations

import os
from typing import Any

from tiercache.errors import ConfigError
from tiercache.settings import MAX_ROOTS

#: an integration's keys that are settings of its :class:`~tiercache.rowstore.RowStore`, and
#: their names there
ROWSTORE_KEYS = {"capacity_bytes": "capacity_bytes", "sharing": "sharing", "fsync": "fsync",
                 "verify": "verify_checksums", "io_engine": "io_engine", "io_threads": "io_threads",
                 "open_files": "open_files", "direct_io": "direct_io", "check_root_owner": "check_root_owner"}


def with_defaults(config: dict[str, Any], defaults: dict[str, Any], who: str,
                  ignored: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``config`` completed with ``defaults``, its keys and its ``root`` (a directory, or a list
    of 1 .. 64 different ones: a root array) checked; ``who`` names the integration in errors;
    keys in ``ignored`` (the engine's own, in the same dict) are dropped.

    Raises:
        ConfigError: an unknown key (named, with the valid ones), or ``root`` missing or bad.
    """
    config = {k: v for k, v in config.items() if k not in ignored}
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise ConfigError(f"{who}: unknown config key(s) {', '.join(map(repr, unknown))}; "
                          f"valid keys: {', '.join(defaults)}")
    out = {**defaults, **config}
    roots = out["root"] if isinstance(out["root"], (list, tuple)) else [out["root"]]
    if not roots or any(not isinstance(r, (str, os.PathLike)) or not str(r) for r in roots):
        raise ConfigError(f"{who}: 'root' = {out['root']!r}: give the directory for the files, or a "
                          "list of directories (one per device)")
    if len(set(map(str, roots))) != len(roots) or len(roots) > MAX_ROOTS:
        raise ConfigError(f"{who}: 'root' = {out['root']!r}: give 1 .. {MAX_ROOTS} different directories")
    return out


def check_positive(who: str, config: dict[str, Any], key: str, lo: int = 1, optional: bool = False) -> None:
    """``config[key]`` is an integer >= ``lo`` (or None where ``optional``).

    Raises:
        ConfigError: naming the key, the value and the range.
    """
    v = config[key]
    if optional and v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(f"{who}: {key!r} = {v!r} must be an integer >= {lo}")
