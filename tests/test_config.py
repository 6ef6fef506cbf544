"""Config loading and validation: the shipped configs, and every kind of malformed input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tiercache import CacheConfig, ConfigError, PoolSpec, UnknownPoolError, load_config
from tiercache.config import default_root

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_default_config_is_llama_3_1_8b():
    cfg = load_config(CONFIGS / "default.toml")
    (pool,) = cfg.pools
    assert pool.block_shape == (32, 2, 8, 16, 128)
    assert pool.dtype == "bfloat16"
    assert pool.tokens_per_block == 16 and pool.token_axis == 3
    assert pool.block_nbytes == 32 * 2 * 8 * 16 * 128 * 2 == 2 * 2**20
    # sized for a 24 GiB machine and one GPU
    assert cfg.host_slots * cfg.block_nbytes <= 2 * 2**30
    assert cfg.device_slots * cfg.block_nbytes <= 2 * 2**30
    assert cfg.root == default_root()


def test_kv_layouts_and_bytes():
    lm = PoolSpec.kv("a", num_layers=3, kv_factor=2, num_kv_heads=4, tokens_per_block=16, head_dim=64, dtype="fp16")
    tm = PoolSpec.kv("b", num_layers=3, kv_factor=2, num_kv_heads=4, tokens_per_block=16, head_dim=64,
                     dtype="float16", layout="token_major")
    assert lm.block_shape == (3, 2, 4, 16, 64) and tm.block_shape == (16, 3, 2, 4, 64)
    assert lm.block_nbytes == tm.block_nbytes == 3 * 2 * 4 * 16 * 64 * 2
    assert lm.dtype == "float16" and tm.token_axis == 0
    mla = PoolSpec.kv("mla", num_layers=2, kv_factor=1, num_kv_heads=1, tokens_per_block=64, head_dim=576, dtype="bf16")
    assert mla.block_nbytes == 2 * 64 * 576 * 2


def test_overrides_and_expansion(tmp_path, monkeypatch):
    monkeypatch.setenv("TC_TEST_DIR", str(tmp_path))
    cfg = load_config(CONFIGS / "default.toml", root="$TC_TEST_DIR/x", io_mode="posix")
    assert cfg.root == tmp_path / "x" and cfg.io_mode == "posix"


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


POOL = "[pools.kv]\nnum_layers=2\nkv_factor=2\nnum_kv_heads=1\ntokens_per_block=4\nhead_dim=8\ndtype='float16'\n"


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[tiers]\nhost_slots = 4\n", "at least one [pools"),
        ("[tiers]\nhost_slot = 4\n" + POOL, "unknown key(s) in [tiers]: host_slot"),
        ("[tiers]\nhost_slots = -1\n" + POOL, "host_slots = -1"),
        ("[tiers]\nhost_slots = 'many'\n" + POOL, "host_slots = 'many'"),
        ("[tiers]\nhost_slots = 0\n" + POOL, "every tier has 0 slots"),
        ("[tiers]\nhost_slots = 4\n[file]\nio_mode = 'fast'\n" + POOL, "io_mode = 'fast'"),
        ("[tiers]\nhost_slots = 4\n[file]\nfsync = 'always'\n" + POOL, "none, data, data+dir"),
        ("[tiers]\nhost_slots = 4\n[file]\nio_threads = 0\n" + POOL, "io_threads = 0"),
        ("[tiers]\nhost_slots = 4\n" + POOL.replace("float16", "float13"), "unsupported dtype 'float13'"),
        ("[tiers]\nhost_slots = 4\n" + POOL.replace("head_dim=8\n", ""), "missing head_dim"),
        ("[tiers]\nhost_slots = 4\n" + POOL.replace("head_dim=8", "head_dim=0"), "head_dim = 0"),
        ("[tiers]\nhost_slots = 4\n[pools.a]\nblock_shape=[4, 0]\ndtype='int8'\n", "block_shape"),
        ("[tiers]\nhost_slots = 4\n[pools.'bad name']\nblock_shape=[4]\ndtype='int8'\n", "invalid pool name"),
        ("[tiers]\nhost_slots = 4\n" + POOL + "layout='diagonal'\n", "layout 'diagonal'"),
        ("[tiers\nhost_slots = 4\n", "not valid TOML"),
        ("[tiers]\nhost_slots = 4\n[transfer]\nbulk_shape = 'tiny'\n" + POOL, "bulk_shape = 'tiny'"),
        ("[tiers]\nhost_slots = 4\n[transfer]\nbatch_streams = 0\n" + POOL, "batch_streams = 0"),
        ("[tiers]\nhost_slots = 4\n[transfer]\nbulk_sms = 0\n" + POOL, "bulk_sms = 0"),
        ("[tiers]\nhost_slots = 4\n[transfer]\nstaged_min_run_bytes = -1\n" + POOL, "staged_min_run_bytes = -1"),
        (
            "[tiers]\nhost_slots = 4\n[transfer]\ncarveout_sms = 2000\n" + POOL,
            "carveout_sms = 2000 must be an integer in [0, 1024]",
        ),
        ("[tiers]\nhost_slots = 4\n[transfer]\ncarveout_sms = true\n" + POOL, "carveout_sms = True"),
    ],
)
def test_malformed_configs(tmp_path, text, fragment):
    with pytest.raises(ConfigError) as ei:
        load_config(write(tmp_path, text))
    assert fragment in str(ei.value)
    assert str(tmp_path / "c.toml") in str(ei.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_unknown_pool_lists_valid_ones():
    cfg = CacheConfig(pools=(PoolSpec("a", (4,), "int8"), PoolSpec("b", (4,), "int8")), host_slots=1)
    with pytest.raises(UnknownPoolError) as ei:
        cfg.pool("c")
    assert "'c'" in str(ei.value) and "a, b" in str(ei.value)


def test_duplicate_pools_rejected():
    with pytest.raises(ConfigError, match="duplicate pool names: a"):
        CacheConfig(pools=(PoolSpec("a", (4,), "int8"), PoolSpec("a", (8,), "int8")), host_slots=1)


def test_canonical_dtype_names_every_kind_of_dtype_the_same_way_each_time():
    """Names, NumPy dtypes and scalar types, and PyTorch dtypes map to one canonical name, as
    often as asked (the names are remembered); a bad dtype raises every time (not remembered)."""
    import torch

    from tiercache.dtypes import canonical_dtype

    cases = [("bf16", "bfloat16"), ("BFloat16", "bfloat16"), (torch.bfloat16, "bfloat16"), (np.dtype("uint8"), "uint8"),
             (np.float16, "float16"), (torch.float8_e4m3fn, "float8_e4m3fn"), ("fp8", "float8_e4m3fn"),
             (np.dtype(">f4"), "float32"), (torch.int8, "int8")]
    for _ in range(3):
        for dtype, name in cases:
            assert canonical_dtype(dtype) == name, dtype
    for bad in ("float13", np.dtype("complex64"), [1, 2]):
        for _ in range(2):
            with pytest.raises(ConfigError, match="unsupported dtype"):
                canonical_dtype(bad)
