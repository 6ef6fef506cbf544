"""Group commit of block-file writes: a batch's temporary files, one filesystem sync, then the
renames; each block acknowledged only after the sync; failures leave nothing behind."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from conftest import bpath, files, random_keys
from helpers import assert_bytes, put_random

from tiercache import PoolSpec, TierCache, TransferError
from tiercache.files import FileTier, IOPath, block_filename, posix_io
from tiercache.settings import FileSettings, TransferSettings  # noqa: F401


@pytest.fixture
def tier(tmp_path, io_engine):
    def make(fsync="data", direct=True):
        pool = PoolSpec("kv", (4096 * 3,), "uint8")
        return FileTier((pool,), 64, IOPath("posix", "test"), FileSettings(
            root=tmp_path / "root", fsync=fsync, io_threads=4, direct_io=direct, io_engine=io_engine)), pool
    return make


def _rows(rng, n, pool):
    return rng.integers(1, 256, size=(n, pool.block_nbytes), dtype=np.uint8)


@pytest.mark.parametrize("fsync", ["data", "data+dir"])
def test_one_sync_per_batch_and_renames_only_after_it(tier, rng, monkeypatch, fsync):
    ft, pool = tier(fsync)
    rows = _rows(rng, 16, pool)
    calls, dir_syncs = [], []
    real_sync = posix_io.sync_filesystem

    def sync(dir_fd):
        # nothing is published before the batch is durable
        assert not list(files(ft.root, "block_*")), "a block file was renamed into place before the sync"
        assert len(list(files(ft.root, ".tmp.block_*"))) == 16
        calls.append(dir_fd)
        real_sync(dir_fd)

    monkeypatch.setattr(posix_io, "sync_filesystem", sync)
    monkeypatch.setattr(posix_io, "fsync_dir", lambda p: dir_syncs.append(p))
    errs = ft.write([(k, {"kv": rows[k]}) for k in range(16)])
    assert not any(errs.values()) and len(calls) == 1
    # data+dir: one sync of each block subdirectory the batch published into
    dirs = {str(bpath(ft.root, k, "kv").parent) for k in range(16)}
    assert sorted(os.path.dirname(os.fspath(p)) for p in dir_syncs) == (sorted(dirs) if fsync == "data+dir" else [])
    assert not list(files(ft.root, ".tmp.*"))
    out = np.empty_like(rows)
    assert not any(ft.read([(k, {"kv": out[k]}) for k in range(16)]).values())
    assert np.array_equal(out, rows)
    ft.close()


def test_a_failed_block_does_not_hold_back_the_others(tier, rng, io_engine, fail_writes):
    ft, pool = tier()
    rows = _rows(rng, 8, pool)
    fail_writes.arm(io_engine, (2, 5))
    errs = ft.write([(k, {"kv": rows[k]}) for k in range(8)])
    assert {k for k, e in errs.items() if e} == {2, 5}
    assert sorted(p.name for p in files(ft.root, "block_*")) == sorted(block_filename(k, "kv") for k in range(8)
                                                                      if k not in (2, 5))
    assert not list(files(ft.root, ".tmp.*"))
    ft.close()


def test_a_failed_sync_publishes_nothing_and_the_source_stays(make_config, rng, monkeypatch, io_engine):
    cfg = make_config(host_slots=8, fsync="data", io_engine=io_engine)
    with TierCache(cfg) as c:
        keys = random_keys(rng, 6)
        exp = put_random(c, keys, rng)

        def broken(dir_fd):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(posix_io, "sync_filesystem", broken)
        with pytest.raises(TransferError, match="Input/output error") as ei:
            c.offload(keys, to="file")
        assert set(ei.value.failed_keys) == set(keys)
        assert not list(files(cfg.root, "block_*")) and not list(files(cfg.root, ".tmp.*"))
        assert all(set(c.lookup(k)) == {"host"} for k in keys)
        monkeypatch.undo()
        c.offload(keys, to="file")
        assert all(set(c.lookup(k)) == {"file"} for k in keys)
        assert_bytes(c, exp)


def test_fsync_none_needs_no_sync(tier, rng, monkeypatch):
    ft, pool = tier("none")
    monkeypatch.setattr(posix_io, "sync_filesystem", lambda fd: pytest.fail("synced under fsync=none"))
    rows = _rows(rng, 4, pool)
    assert not any(ft.write([(k, {"kv": rows[k]}) for k in range(4)]).values())
    ft.close()
