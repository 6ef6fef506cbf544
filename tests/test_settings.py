"""Settings are defined once (tiercache/settings.py): the cache, the row store and the vLLM tier
take the same section objects with the same defaults; the configuration reference in docs/ is
generated from them; TOML sections map onto them; a bad value names the setting and its range."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from tiercache import CacheConfig, ConfigError, PoolSpec, RowStore
from tiercache.config import config_from_dict
from tiercache.settings import (
    SECTIONS,
    FileSettings,
    SharingSettings,
    TransferSettings,
    default,
    reference,
    sections,
)

ROOT = Path(__file__).resolve().parents[1]
POOL = PoolSpec("kv", (4096,), "uint8")


def test_the_configuration_reference_is_generated_from_the_settings():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc == reference((ROOT / "configs" / "default.toml").read_text()), \
        "regenerate: python -m tiercache.settings > docs/configuration.md"
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in doc


def test_cache_row_store_and_vllm_tier_share_one_default_per_setting(tmp_path):
    from conftest import require_integration

    require_integration("vllm")  # skipped where vLLM is not installed (never in CI)
    from tiercache.integrations.vllm import DEFAULTS, SETTING_KEYS, parse_config

    cfg = CacheConfig(pools=(POOL,), host_slots=1, root=tmp_path / "c")
    assert cfg.file_settings == FileSettings(root=tmp_path / "c")
    assert cfg.sharing_settings == SharingSettings() and cfg.transfer_settings == TransferSettings()
    for key, (section, name) in SETTING_KEYS.items():
        assert DEFAULTS[key] is default(section, name), key  # the very object the dataclass defines
    parsed = parse_config({"root": str(tmp_path)})
    with RowStore(np.zeros((4, 4096), np.uint8), tmp_path / "r", capacity_blocks=8,
                  **{name: parsed[k] for k, (_, name) in SETTING_KEYS.items()}) as via_tier, \
            RowStore(np.zeros((4, 4096), np.uint8), tmp_path / "s", capacity_blocks=8) as plain:
        assert via_tier.file_settings == FileSettings(root=tmp_path / "r")
        assert plain.file_settings == FileSettings(root=tmp_path / "s")
        assert via_tier.sharing_settings == plain.sharing_settings == cfg.sharing_settings
        assert plain.ft.settings is plain.file_settings  # passed whole to the file tier


def test_each_choice_list_and_validator_is_defined_once():
    """The tuples of valid choices live in settings.py alone, and no module keeps its own
    integer or choice checker for settings."""
    src = {p: p.read_text() for p in (ROOT / "tiercache").rglob("*.py")}
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            choices = f.metadata["choices"]
            if choices:
                text = "(" + ", ".join(f'"{c}"' for c in choices) + ")"
                holders = [p.name for p, s in src.items() if text in s]
                assert holders == ["settings.py"], (f.name, holders)
    for p, s in src.items():
        if p.name != "settings.py":
            assert not re.search(r"^def _check_choice\(", s, re.M), p


def test_toml_sections_map_onto_the_dataclasses():
    base = {"tiers": {"host_slots": 4}, "pools": {"kv": {"block_shape": [4096], "dtype": "uint8"}}}
    cfg = config_from_dict({**base, "sharing": {"sharing": "shared", "min_age_s": 2.0},
                            "metrics": {"enabled": False, "snapshot_interval_s": 0}, "file": {"io_threads": 3}})
    assert cfg.sharing_settings == SharingSettings(sharing="shared", min_age_s=2.0)
    assert (cfg.metrics, cfg.metrics_snapshot_s, cfg.io_threads) == (False, 0, 3)
    # the [sharing] keys are still read where they were, in [file]
    old = config_from_dict({**base, "file": {"sharing": "shared", "negative_ttl_s": 0.5}})
    assert old.sharing_settings == SharingSettings(sharing="shared", negative_ttl_s=0.5)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) in \[sharing\]: fsync"):
        config_from_dict({**base, "sharing": {"fsync": "data"}})
    assert cfg.replace(io_threads=5).file_settings == cfg.file_settings.replace(io_threads=5)
    assert cfg.replace(sharing_settings=SharingSettings()).sharing == "exclusive"
    assert set(cfg.describe()) >= {"root", "io_threads", "sharing", "metrics_snapshot_s", "copy_kernel_sms"}


@pytest.mark.parametrize("flat, value, message", [
    ("io_threads", 0, r"io_threads = 0 must be an integer in \[1, 256\]"),
    ("fsync", "always", r"fsync = 'always' is not valid; choose one of: none, data, data\+dir"),
    ("tmp_max_age_s", 5, r"tmp_max_age_s = 5 must be a number of seconds in \[60, 604800\]"),
    ("direct_io", 1, r"direct_io = 1 must be true or false"),
    ("metrics_name", "a b", r"metrics_name|name = 'a b' must be up to 64 characters"),
    ("copy_kernel_sms", 2000, r"copy_kernel_sms = 2000 must be an integer in \[1, 1024\]"),
    ("nonsense", 1, r"unknown setting\(s\) nonsense; valid: .*io_threads"),
])
def test_a_bad_value_names_the_setting_and_its_range(tmp_path, flat, value, message):
    with pytest.raises(ConfigError, match=message):
        CacheConfig(pools=(POOL,), host_slots=1, **{flat: value})
    if flat in ("io_threads", "fsync", "tmp_max_age_s", "direct_io"):
        with pytest.raises(ConfigError, match=message):
            RowStore(np.zeros((2, 4096), np.uint8), tmp_path / "r", capacity_blocks=4, **{flat: value})
        with pytest.raises(ConfigError, match=message):
            sections(**{flat: value})


def test_copy_launcher_defaults_are_the_transfer_settings():
    """CopyLauncher takes its thresholds' defaults from [transfer] (one default per setting,
    defined once in tiercache.settings), so a launcher built without settings copies as the
    engine's does."""
    import inspect

    from tiercache.copypaths.copykernels import CopyLauncher
    from tiercache.settings import TransferSettings

    sig, t = inspect.signature(CopyLauncher.__init__), TransferSettings()
    shared = [k for k in sig.parameters if k in {f.name for f in dataclasses.fields(TransferSettings)}]
    assert {"memcpy_min_bytes", "batch_min_bytes", "staged_min_run_bytes", "bulk_shape", "batch_streams",
            "offload_staged_min_run_bytes"} <= set(shared)
    for k in shared:
        assert sig.parameters[k].default == getattr(t, k), k


def test_copy_launcher_takes_the_transfer_settings():
    """CopyLauncher.from_settings (what the transfer engine builds) maps every [transfer] setting
    the launcher has onto its own argument, and bulk_shape "off" turns the bulk kernel off."""
    import inspect

    from tiercache.copypaths.copykernels import CopyLauncher, launcher_kwargs
    from tiercache.settings import TransferSettings

    t = TransferSettings(memcpy_min_bytes=3 << 20, batch_min_bytes=96 << 10, copy_kernel_sms=12, carveout_sms=6,
                         bulk_shape="small", batch_streams=3)
    kw = launcher_kwargs(t)
    params = inspect.signature(CopyLauncher.__init__).parameters
    assert set(kw) <= set(params), set(kw) - set(params)
    assert kw["memcpy_min_bytes"] == 3 << 20 and kw["batch_min_bytes"] == 96 << 10 and kw["max_sms"] == 12
    assert kw["carveout_sms"] == 6 and kw["bulk"] and kw["bulk_shape"] == "small" and kw["batch_streams"] == 3
    off = launcher_kwargs(TransferSettings(bulk_shape="off"))
    assert off["bulk"] is False and off["bulk_shape"] == "small"
    for k in ("memcpy_min_bytes", "batch_min_bytes", "staged_min_run_bytes", "batch_streams", "carveout_sms",
              "offload_staged_min_run_bytes", "bulk_sms"):
        assert kw[k] == getattr(t, k), k
