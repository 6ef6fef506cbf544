"""Device tier round trips: VRAM <-> pinned DRAM <-> files, kvikio path and forced POSIX path."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import bpath, random_keys
from helpers import assert_bytes, put_random

from tiercache import ArrayMismatchError, TierCache

pytestmark = pytest.mark.gpu


def _cupy():
    import cupy

    return cupy


def _device_random(pool, n, rng):
    cp = _cupy()
    return cp.asarray(rng.integers(1, 256, size=(n, pool.block_nbytes), dtype=np.uint8))


@pytest.mark.parametrize("io_mode", ["auto", "compat", "posix"])
def test_device_host_file_round_trip(make_config, rng, io_mode):
    cfg = make_config(device_slots=12, host_slots=12, file_slots=64, io_mode=io_mode)
    with TierCache(cfg) as c:
        assert c.tier_names == ["device", "host", "file"]
        if io_mode == "auto":  # GDS where cuFile has it, else O_DIRECT through pinned staging
            gds = "GDS available" in c.io_path.reason
            assert c.io_path.name == ("gds" if gds else "posix"), c.io_path
        else:
            assert c.io_path.name == io_mode
        keys = random_keys(rng, 12)
        data = {p.name: _device_random(p, 12, rng) for p in cfg.pools}
        slots = c.put(keys, data)  # from device memory
        exp = {k: {p: data[p][i].get() for p in data} for i, k in enumerate(keys)}
        dev = c.device_array("kv", typed=False)
        assert all(np.array_equal(dev[s].get(), exp[k]["kv"]) for k, s in zip(keys, slots))
        c.offload(keys, to="host")
        assert all(set(c.lookup(k)) == {"host"} for k in keys)
        c.offload(keys, to="file")
        assert all(set(c.lookup(k)) == {"file"} for k in keys)
        c.onboard(keys, to="host")
        slots = c.onboard(keys, to="device")
        for p in cfg.pools:
            dev = c.device_array(p.name, typed=False)
            got = dev[_cupy().asarray(slots)].get()
            assert np.array_equal(got, np.stack([exp[k][p.name] for k in keys]))
        # the direct path: device -> file -> device, no host tier in between
        c.evict(keys, tier="host")
        c.evict(keys, tier="file")
        c.offload(keys, to="file")
        assert all(set(c.lookup(k)) == {"file"} for k in keys)
    with TierCache(cfg) as c2:  # reopen: file -> device directly
        assert sorted(c2.keys(), key=str) == sorted(keys, key=str)
        slots = c2.onboard(keys, to="device")
        for p in cfg.pools:
            got = c2.device_array(p.name, typed=False)[_cupy().asarray(slots)].get()
            assert np.array_equal(got, np.stack([exp[k][p.name] for k in keys]))
        assert c2.stats()["counters"]["bytes_file_to_device"] == 12 * cfg.block_nbytes


def test_device_spills_through_every_tier(make_config, rng):
    cfg = make_config(device_slots=4, host_slots=6, file_slots=200)
    with TierCache(cfg) as c:
        exp = {}
        keys = random_keys(rng, 40)
        for i in range(0, 40, 3):
            exp.update(put_random(c, keys[i:i + 3], rng))  # host numpy -> device
        assert len(c.keys("device")) <= 4 and len(c.keys("host")) <= 6
        assert len(c.keys("file")) >= 30
        assert_bytes(c, exp)
        for _ in range(8):
            sub = [keys[j] for j in rng.choice(40, size=int(rng.integers(1, 5)), replace=False)]
            slots = c.onboard(sub)
            dev = c.device_array("act", typed=False)
            for k, s in zip(sub, slots):
                assert np.array_equal(dev[int(s)].get(), exp[k]["act"])
        assert_bytes(c, exp)


def test_get_into_device_out(make_config, rng):
    cfg = make_config(device_slots=4, host_slots=4)
    cp = _cupy()
    with TierCache(cfg) as c:
        exp = put_random(c, [1, 2, 3], rng, tier="host")
        c.offload([3], to="file")
        out = cp.empty((3, cfg.pools[1].block_nbytes), dtype=cp.uint8)
        c.get([3, 1, 2], pool="act", out=out)
        assert np.array_equal(out.get(), np.stack([exp[k]["act"] for k in (3, 1, 2)]))


def test_torch_tensors(make_config, rng):
    torch = pytest.importorskip("torch")
    cfg = make_config(device_slots=4, host_slots=4)
    kv, act = cfg.pools
    with TierCache(cfg) as c:
        t_kv = torch.randn((2, *kv.block_shape), device="cuda").to(torch.float16)
        t_act = torch.randn((2, *act.block_shape), device="cuda")
        c.put([5, 6], {"kv": t_kv, "act": t_act})
        c.offload([5, 6], to="file")
        out = torch.empty_like(t_kv)
        c.get([5, 6], pool="kv", out=out)
        assert torch.equal(out, t_kv)
        with pytest.raises(ArrayMismatchError, match="dtype bfloat16"):
            c.put([7], {"kv": t_kv[:1].to(torch.bfloat16), "act": t_act[:1]})


@pytest.mark.parametrize("io_mode", ["compat", "posix"])
def test_device_reads_never_follow_a_symlinked_block_file(make_config, rng, tmp_path, io_mode):
    """kvikio opens the very file tiercache opened without following a symlink (through
    /proc/self/fd), so a block file swapped for a symlink is quarantined, not read."""
    import os
    import shutil

    from tiercache.errors import TransferError
    from tiercache.files import block_filename

    # open_files=0: each read looks at the name (held descriptors read the published file
    # and never open the name: tests/test_root_trust.py)
    cfg = make_config(device_slots=4, host_slots=0, file_slots=16, io_mode=io_mode, open_files=0)
    outside = tmp_path / "outside"
    outside.mkdir()
    with TierCache(cfg) as c:
        keys = [21, 22]
        data = {p.name: _device_random(p, 2, rng) for p in cfg.pools}
        c.put(keys, data)
        exp = {k: {p: data[p][i].get() for p in data} for i, k in enumerate(keys)}
        c.offload(keys, to="file")  # device -> file straight (no host tier)
        name, path = block_filename(21, "kv"), bpath(cfg.root, 21, "kv")
        shutil.copy(path, outside / "copy.bin")
        os.unlink(path)
        path.symlink_to(outside / "copy.bin")
        before = (outside / "copy.bin").read_bytes()
        with pytest.raises(TransferError, match="not a regular file"):
            c.onboard(keys, to="device")
        assert 21 not in c and (cfg.root / "quarantine" / name).is_symlink()
        slots = c.onboard([22], to="device")
        for p in cfg.pools:
            got = c.device_array(p.name, typed=False)[int(slots[0])].get()
            assert np.array_equal(got, exp[22][p.name])
        assert (outside / "copy.bin").read_bytes() == before
