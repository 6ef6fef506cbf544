"""TierCache on the host and file tiers (runs everywhere, GPU or not)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import bpath, drop_index, files, random_keys
from helpers import assert_bytes, put_random

from tiercache import (
    ArrayMismatchError,
    ClosedError,
    InvalidKeyError,
    KeyNotFoundError,
    PinnedBlockError,
    RootError,
    SlotRangeError,
    TierCache,
    TierFullError,
    TierUnavailableError,
    TransferError,
    UnknownPoolError,
)
from tiercache.files import block_filename
from tiercache.keys import key_text


def test_round_trip_host_file_host(make_config, rng):
    with TierCache(make_config(host_slots=16)) as c:
        keys = random_keys(rng, 16)
        exp = put_random(c, keys, rng, tier="host")
        c.offload(keys, to="file")
        assert all(c.lookup(k) == {"file": c.lookup(k)["file"]} for k in keys)
        for k in keys:  # the files are there, named by key and pool
            for p in c.config.pools:
                assert (bpath(c.config.root, k, p.name)).is_file()
        slots = c.onboard(keys, to="host")
        assert sorted(slots.tolist()) == sorted(set(slots.tolist()))
        assert all(set(c.lookup(k)) == {"host", "file"} for k in keys)  # clean copy stays below
        host = c.host_array("kv", typed=False)
        for k, s in zip(keys, slots):
            assert np.array_equal(host[s], exp[k]["kv"])
        assert_bytes(c, exp)


def test_spills_keep_every_block(make_config, rng):
    cfg = make_config(host_slots=int(rng.integers(3, 8)), file_slots=200)
    with TierCache(cfg) as c:
        exp = {}
        remaining = random_keys(rng, 60)
        while remaining:
            n = int(rng.integers(1, cfg.host_slots + 1))
            batch, remaining = remaining[:n], remaining[n:]
            exp.update(put_random(c, batch, rng))
            assert len(c.keys("host")) <= cfg.host_slots
        assert len(c) == 60
        assert c.stats()["counters"]["spilled_blocks"] >= 60 - cfg.host_slots
        # the most recent batch is still in the host tier
        assert all("host" in c.lookup(k) for k in batch)
        assert_bytes(c, exp)
        # onboard random subsets back: LRU spills others down again, bytes stay exact
        keys = list(exp)
        for _ in range(10):
            sub = [keys[i] for i in rng.choice(len(keys), size=int(rng.integers(1, cfg.host_slots + 1)), replace=False)]
            c.onboard(sub)
            assert all("host" in c.lookup(k) for k in sub)
        assert_bytes(c, exp)


def test_bottom_tier_evicts_lru(make_config, rng):
    cfg = make_config(host_slots=2, file_slots=4)
    with TierCache(cfg) as c:
        keys = random_keys(rng, 8, "int")
        exp = {}
        for k in keys:
            exp.update(put_random(c, [k], rng))
        assert len(c) == 6 and c.stats()["counters"]["evicted_blocks"] == 2
        assert not any(c.lookup(k) for k in keys[:2])  # the two oldest left the cache
        assert len(list(files(cfg.root, "block_*"))) == 4 * len(cfg.pools)
        assert_bytes(c, {k: exp[k] for k in keys[2:]})


def test_reopen_in_new_process_serves_same_bytes(make_config, rng, tmp_path):
    cfg = make_config(host_slots=8)
    with TierCache(cfg) as c:
        keys = random_keys(rng, 12)
        exp = {}
        for i in range(0, 12, 4):
            exp.update(put_random(c, keys[i:i + 4], rng))
        assert c.flush() > 0
    keyfile = tmp_path / "keys.npy"
    np.save(keyfile, np.array([k.hex() if isinstance(k, bytes) else str(k) for k in keys]))
    script = f"""
import numpy as np, sys
from tiercache import TierCache, CacheConfig, PoolSpec
pools = {tuple((p.name, p.block_shape, p.dtype) for p in cfg.pools)!r}
cfg = CacheConfig(pools=tuple(PoolSpec(n, s, d) for n, s, d in pools), host_slots=4, file_slots=64,
                  root={str(cfg.root)!r})
keys = [bytes.fromhex(k) if not k.isdigit() else int(k) for k in np.load({str(keyfile)!r})]
with TierCache(cfg) as c:
    assert len(c) == len(keys), len(c)
    for p in cfg.pools:
        np.save({str(tmp_path)!r} + f"/out_{{p.name}}.npy", c.get(keys, pool=p.name,
                                                   out=np.empty((len(keys), p.block_nbytes), np.uint8)))
"""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", script], check=True, env=env)
    for p in cfg.pools:
        got = np.load(tmp_path / f"out_{p.name}.npy")
        assert np.array_equal(got, np.stack([exp[k][p.name] for k in keys]))


def test_put_replaces_all_copies(make_config, rng):
    with TierCache(make_config(host_slots=4)) as c:
        (k,) = random_keys(rng, 1)
        put_random(c, [k], rng)
        c.offload([k], to="file")
        c.onboard([k])
        assert set(c.lookup(k)) == {"host", "file"}
        exp = put_random(c, [k], rng)  # new bytes
        assert set(c.lookup(k)) == {"host"}
        assert not any(files(c.config.root, "block_*"))
        assert_bytes(c, exp)


def test_typed_put_and_get(make_config, rng):
    cfg = make_config(host_slots=4)
    kv = cfg.pools[0]
    with TierCache(cfg) as c:
        data = {"kv": rng.standard_normal((3, *kv.block_shape)).astype(np.float16),
                "act": rng.standard_normal((3, *cfg.pools[1].block_shape)).astype(np.float32)}
        c.put([1, 2, 3], data)
        c.offload([1, 2, 3], to="file")
        assert np.array_equal(c.get([1, 2, 3], pool="kv"), data["kv"])
        out = np.empty_like(data["act"])
        assert c.get([3, 2, 1], pool="act", out=out) is out
        assert np.array_equal(out, data["act"][::-1])


def test_allocate_then_write_in_place(make_config, rng):
    with TierCache(make_config(host_slots=6)) as c:
        slots = c.allocate([10, 11], slots=[4, 1])
        assert slots.tolist() == [4, 1]
        host = c.host_array("act", typed=False)
        want = rng.integers(1, 256, size=(2, host.shape[1]), dtype=np.uint8)
        host[[4, 1]] = want
        c.host_array("kv", typed=False)[[4, 1]] = 7
        c.offload([10, 11], to="file")
        c.onboard([11, 10])
        assert np.array_equal(c.get([10, 11], pool="act", out=np.empty_like(want)), want)


def test_pinned_blocks_never_move(make_config, rng):
    with TierCache(make_config(host_slots=3)) as c:
        keys = random_keys(rng, 3)
        exp = put_random(c, keys, rng)
        c.pin(keys)
        with pytest.raises(TierFullError, match="host tier is full"):
            put_random(c, random_keys(rng, 1), rng)
        with pytest.raises(PinnedBlockError):
            c.offload(keys[:1], to="file")
        with pytest.raises(PinnedBlockError):
            c.evict(keys[:1])
        assert all(set(c.lookup(k)) == {"host"} for k in keys)
        c.offload(keys, to="file", keep=True)  # copying down is allowed
        c.unpin(keys[:1])
        new = put_random(c, [42], rng)
        assert set(c.lookup(keys[0])) == {"file"}  # the unpinned one made room
        assert_bytes(c, {**exp, **new})


def test_pinned_context_manager(make_config, rng):
    with TierCache(make_config(host_slots=1)) as c:
        put_random(c, [1], rng)
        with c.pinned([1]):
            with pytest.raises(TierFullError):
                put_random(c, [2], rng)
        put_random(c, [2], rng)
        assert set(c.lookup(1)) == {"file"}


def test_bad_inputs_leave_blocks_intact(make_config, rng):
    cfg = make_config(host_slots=4)
    kv, act = cfg.pools
    with TierCache(cfg) as c:
        keys = random_keys(rng, 6)
        exp = put_random(c, keys[:3], rng)
        exp.update(put_random(c, keys[3:], rng))
        good = {"kv": np.ones((1, *kv.block_shape), np.float16), "act": np.ones((1, *act.block_shape), np.float32)}
        cases = [
            (UnknownPoolError, "unknown pool 'nope'", lambda: c.put([99], {**good, "nope": good["kv"]})),
            (UnknownPoolError, "kv, act", lambda: c.get([keys[0]], pool="nope")),
            (ArrayMismatchError, "has shape", lambda: c.put([99], {**good, "kv": np.ones((1, 3), np.float16)})),
            (
                ArrayMismatchError,
                "has dtype float64",
                lambda: c.put([99], {**good, "kv": good["kv"].astype(np.float64)}),
            ),
            (ArrayMismatchError, "for 2 block(s)", lambda: c.put([98, 99], good)),
            (
                ArrayMismatchError,
                "not C-contiguous",
                lambda: c.put([99], {**good, "kv": np.asfortranarray(good["kv"])}),
            ),
            (ArrayMismatchError, "missing", lambda: c.put([99], {"kv": good["kv"]})),
            (ArrayMismatchError, "not an array", lambda: c.put([99], {**good, "kv": [[1, 2]]})),
            (ArrayMismatchError, "name one", lambda: c.get([keys[0]])),
            (KeyNotFoundError, "not stored", lambda: c.get([keys[0], 12345])),
            (KeyNotFoundError, "not stored", lambda: c.onboard([12345])),
            (KeyNotFoundError, "not stored", lambda: c.offload([12345], to="file")),
            (KeyNotFoundError, "not in the file tier", lambda: c.evict([keys[-1]], tier="file")),
            (KeyNotFoundError, "not in the file tier", lambda: c.slots([keys[-1]], tier="file")),
            (SlotRangeError, "slot 4 outside [0, 4)", lambda: c.allocate([99], slots=[4])),
            (SlotRangeError, "slot -1 outside", lambda: c.allocate([99], slots=[-1])),
            (SlotRangeError, "appears twice", lambda: c.allocate([98, 99], slots=[0, 0])),
            (SlotRangeError, "already holds key", lambda: c.allocate([99], slots=[int(c.slots([keys[-1]])[0])])),
            (InvalidKeyError, "already stored", lambda: c.allocate([keys[0]])),
            (InvalidKeyError, "outside [0, 2**63)", lambda: c.onboard([-5])),
            (TierUnavailableError, "no device tier", lambda: c.device_array("kv")),
            (TierUnavailableError, "unknown tier 'gpu'", lambda: c.onboard([keys[0]], to="gpu")),
        ]
        for exc, fragment, fn in cases:
            with pytest.raises(exc) as ei:
                fn()
                pytest.fail(f"no error for case {fragment!r}")
            assert fragment in str(ei.value), (fragment, str(ei.value))
        assert 99 not in c and 98 not in c
        assert_bytes(c, exp)


def test_root_errors(tmp_path, make_config):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(RootError, match="not a directory"):
        TierCache(make_config(root=afile))
    with pytest.raises(RootError, match="cannot create"):
        TierCache(make_config(root=afile / "sub"))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("do not touch")
    with pytest.raises(RootError, match="no .tiercache-root marker"):
        TierCache(make_config(root=foreign))
    assert (foreign / "precious.txt").read_text() == "do not touch"
    missing = tmp_path / "a" / "b" / "root"  # a missing root is created, mode 0700
    with TierCache(make_config(root=missing)):
        assert missing.is_dir() and (missing.stat().st_mode & 0o777) == 0o700


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_root(tmp_path, make_config):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(RootError, match="not writable"):
        TierCache(make_config(root=ro))


def test_write_failure_keeps_source(make_config, rng, io_engine, fail_writes):
    cfg = make_config(host_slots=8, io_engine=io_engine)
    with TierCache(cfg) as c:
        keys = random_keys(rng, 8)
        exp = put_random(c, keys, rng)
        doomed = set(rng.choice(len(keys), size=3, replace=False).tolist())
        doomed_keys = {keys[i] for i in doomed}
        fail_writes.arm(io_engine, doomed_keys)
        with pytest.raises(TransferError) as ei:
            c.offload(keys, to="file")
        assert set(ei.value.failed_keys) == doomed_keys
        assert "No space left" in str(ei.value)
        for k in keys:  # failed ones stay in host, nothing half-written on disk
            assert "host" in c.lookup(k)
            assert ("file" in c.lookup(k)) == (k not in doomed_keys)
        assert not list(files(cfg.root, ".tmp.*"))
        for k in doomed_keys:
            assert not list(files(cfg.root, block_filename(k, "*")))
        fail_writes.disarm()
        c.offload(keys, to="file")  # the cache keeps working
        assert all(set(c.lookup(k)) == {"file"} for k in keys)
        assert_bytes(c, exp)
        assert c.stats()["counters"]["failed_transfers"] == 3


def test_spill_failure_keeps_block_above(make_config, rng, io_engine, fail_writes):
    cfg = make_config(host_slots=2, io_engine=io_engine)
    with TierCache(cfg) as c:
        exp = put_random(c, [1, 2], rng)
        fail_writes.arm(io_engine, [1, 2, 3])
        with pytest.raises(TransferError):
            put_random(c, [3], rng)
        assert 3 not in c
        assert all(set(c.lookup(k)) == {"host"} for k in (1, 2))
        assert_bytes(c, exp)


def test_corrupt_files_are_misses(make_config, rng):
    cfg = make_config(host_slots=8, verify_checksums=True)
    c = TierCache(cfg)
    keys = random_keys(rng, 6, "int")
    exp = put_random(c, keys, rng)
    c.offload(keys, to="file")
    # flip one data byte of one block: detected at read by the checksum
    victim = keys[2]
    path = bpath(cfg.root, victim, "act")
    with open(path, "r+b") as f:
        f.seek(4096 + int(rng.integers(0, cfg.pools[1].block_nbytes)))
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x5A]))
    with pytest.raises(TransferError, match="checksum mismatch") as ei:
        c.onboard(keys)
    assert ei.value.failed_keys == [victim]
    assert victim not in c and (cfg.root / "quarantine" / path.name).is_file()
    assert c.stats()["counters"]["corrupt_blocks"] == 1
    del exp[victim]
    assert_bytes(c, exp)
    c.close()
    # a torn header and a truncated file are found when the root is reopened
    k1, k2 = keys[0], keys[1]
    with open(bpath(cfg.root, k1, "kv"), "r+b") as f:
        f.seek(30)
        f.write(b"\xff\xff")
    os.truncate(bpath(cfg.root, k2, "act"), 4096 + 10)
    (cfg.root / ".tmp.block_1_pool_kv.bin.123.abcd").write_bytes(b"partial")
    (cfg.root / "notes.txt").write_text("someone else's")
    drop_index(cfg.root)  # the scan of every file (the index's open finds them when read)
    with TierCache(cfg) as c2:
        assert set(c2.keys()) == set(keys) - {victim, k1, k2}
        assert c2.scan.removed_tmp == 1 and c2.scan.foreign == ["notes.txt"]
        assert len(c2.scan.quarantined) == 2 * len(cfg.pools)
        assert_bytes(c2, {k: v for k, v in exp.items() if k not in (k1, k2)})
    assert (cfg.root / "notes.txt").exists()


def test_evict(make_config, rng):
    with TierCache(make_config(host_slots=4)) as c:
        exp = put_random(c, [1, 2, 3], rng)
        c.offload([1, 2], to="file", keep=True)
        c.evict([1], tier="host")
        assert set(c.lookup(1)) == {"file"}
        c.evict([2])
        assert 2 not in c and not list(files(c.config.root, "block_2_*"))
        assert_bytes(c, {1: exp[1], 3: exp[3]})


def test_concurrent_callers(make_config, rng):
    cfg = make_config(host_slots=12, file_slots=400)
    errors = []
    with TierCache(cfg) as c:
        def worker(wid: int, seed: int):
            r = np.random.default_rng(seed)
            mine = {}
            try:
                for i in range(25):
                    keys = [wid * 1000 + i * 10 + j for j in range(int(r.integers(1, 4)))]
                    mine.update(put_random(c, keys, r))
                    ks = list(mine)
                    pick = [ks[j] for j in r.choice(len(ks), size=min(3, len(ks)), replace=False)]
                    op = int(r.integers(0, 3))
                    if op == 0:
                        c.offload(pick, to="file")
                    elif op == 1:
                        c.onboard(pick)
                    assert_bytes(c, {k: mine[k] for k in pick})
                assert_bytes(c, mine)
            except Exception as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w, int(rng.integers(1 << 30)))) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors


def test_closed_cache_refuses(make_config):
    c = TierCache(make_config())
    c.close()
    c.close()
    with pytest.raises(ClosedError):
        c.lookup(1)


def test_cpu_only_cache_reports_posix(make_config):
    with TierCache(make_config(io_mode="posix")) as c:
        s = c.stats()
        assert s["io_path"]["name"] == "posix"
        assert set(s["tiers"]) == {"host", "file"}
        assert s["tiers"]["host"]["slots"] == 8


def test_put_of_more_blocks_than_the_tier_streams_through_it(make_config, rng):
    """put of 7 blocks into a 4-slot host tier (one slot pinned) with files below: the blocks
    go in pieces of what the tier can hold (3), each spilling the previous ones down; the tier
    ends with the 3 most recent, the rest are in files, every byte exact. With no tier below it
    is still a TierFullError."""
    with TierCache(make_config(host_slots=4, file_slots=64)) as c:
        pinned = random_keys(rng, 1)
        exp = put_random(c, pinned, rng)
        c.pin(pinned)
        keys = random_keys(rng, 7)
        data = {p.name: rng.integers(1, 256, size=(7, p.block_nbytes), dtype=np.uint8) for p in c.config.pools}
        slots = c.put(keys, data)
        exp.update({k: {p: data[p][i] for p in data} for i, k in enumerate(keys)})
        assert [set(c.lookup(k)) for k in keys] == [{"file"}] * 4 + [{"host"}] * 3
        assert list(slots[:4]) == [-1] * 4 and list(slots[4:]) == list(c.slots(keys[4:], tier="host"))
        assert "host" in c.lookup(pinned[0])
        assert c.stats()["counters"]["streamed_puts"] == 1
        assert_bytes(c, exp)
    with TierCache(make_config(host_slots=4, file_slots=0)) as c:
        with pytest.raises(TierFullError, match="host tier has 4 slots; 6 needed"):
            put_random(c, random_keys(rng, 6), rng)


def test_offload_moves_down_only_and_names_the_keys_held_nowhere_above(make_config, rng):
    """``offload(to=host)`` of a block held only in the file tier is an error naming it (the
    batched lookups look only at the destination and the tiers above it); blocks in the host
    tier or above it offload, and their bytes stay exact."""
    keys = random_keys(rng, 6, "mixed")
    with TierCache(make_config()) as c:
        want = put_random(c, keys, rng, tier="file")
        up = put_random(c, [k + 1 if isinstance(k, int) else k + b"!" for k in keys[:2]], rng)  # host
        with pytest.raises(KeyNotFoundError, match=f"{key_text(keys[3])}.*not stored in host") as exc:
            c.offload([*up, keys[3]], to="host")
        assert "offload moves blocks down" in str(exc.value)
        c.offload(list(up), to="file")
        assert_bytes(c, {**want, **up})
