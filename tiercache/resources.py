"""The data files tiercache ships (``configs/`` in the source tree, ``tiercache.configs`` once
installed), found one way in both: through ``importlib.resources``.

Every reader of a shipped file goes through here: the default configuration
(:func:`default_config`), the model geometries of ``tiercache bench vllm-serve``
(:func:`models_dir`) and the job files (:func:`config_file`).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def config_file(name: str) -> Path:
    """The shipped file ``name`` (a path relative to ``configs/``, e.g. ``"jobs/mixed.ini"``);
    it may not exist (check ``is_file()``)."""
    return Path(str(files("tiercache.configs").joinpath(name)))


def default_config() -> Path:
    """``configs/default.toml``: the configuration ``tiercache bench`` and the tools use when
    none is given."""
    return config_file("default.toml")


def models_dir() -> Path:
    """``configs/models/``: model geometries (``<name>.json``, a Hugging Face ``config.json``)."""
    return config_file("models")


__all__ = ["config_file", "default_config", "models_dir"]
