"""The per-block I/O seam (tiercache/files/blockio.py): chosen once from the device path, host
blocks round-trip byte-exact through the POSIX implementation with their checksums checked, a
damaged file is refused, and a failed write leaves nothing behind."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tiercache.errors import CorruptBlockError
from tiercache.files import blockio
from tiercache.files.blockio import KvikioBlockIO, PosixBlockIO, block_io
from tiercache.files.devicepath import IOPath
from tiercache.files.rootdir import RootPath
from tiercache.geometry import PoolSpec


def _at(directory, name: str) -> RootPath:
    """``name`` in ``directory``, as the file tier names files (its descriptor and the name)."""
    return RootPath(os.open(directory, os.O_RDONLY | os.O_DIRECTORY), name, None, str(directory))


def _staging():
    raise AssertionError("host buffers never touch the staging buffer")


def test_the_device_path_chooses_the_implementation_once(monkeypatch):
    configured = []
    monkeypatch.setattr(blockio.kvikio_io, "configure", lambda *a: configured.append(a))
    assert type(block_io(IOPath("posix", "forced"), "none", False, True, _staging)) is PosixBlockIO
    assert not configured
    io = block_io(IOPath("compat", "no nvidia-fs"), "data", True, True, _staging, 0, 8, 1 << 20, 4096)
    assert type(io) is KvikioBlockIO and configured == [(8, 1 << 20, 4096)]


@pytest.mark.parametrize("kind", ["posix", "compat"])
@pytest.mark.parametrize("fsync", ["none", "data"])
def test_host_blocks_round_trip_and_damage_is_refused(tmp_path, rng, kind, fsync, monkeypatch):
    monkeypatch.setattr(blockio.kvikio_io, "configure", lambda *a: None)
    pool = PoolSpec("kv", (8, 1024), "uint8")
    io = block_io(IOPath(kind, "test"), fsync, False, True, _staging)
    data = rng.integers(0, 256, pool.block_nbytes, dtype=np.uint8)
    key = os.urandom(16)
    final = _at(tmp_path, "block")
    assert io.write(final, key, pool, data, {"note": 1}, True) is None and (tmp_path / "block").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["block"]  # published: no temporary left
    out = np.zeros_like(data)
    io.read(final, key, pool, out)
    assert np.array_equal(out, data)
    with pytest.raises(CorruptBlockError):
        io.read(final, os.urandom(16), pool, np.zeros_like(data))  # another key's file
    raw = bytearray((tmp_path / "block").read_bytes())
    raw[-1] ^= 0x40  # one bit of the data
    (tmp_path / "block").write_bytes(bytes(raw))
    with pytest.raises(CorruptBlockError):
        io.read(final, key, pool, np.zeros_like(data))


def test_a_write_that_fails_leaves_no_file(tmp_path, rng, monkeypatch):
    pool = PoolSpec("kv", (4, 1024), "uint8")
    io = PosixBlockIO("data", False, True, _staging)

    def failing_fsync(fd):
        raise OSError(5, "injected EIO")

    monkeypatch.setattr(os, "fdatasync", failing_fsync)
    with pytest.raises(OSError, match="injected"):
        io.write(_at(tmp_path, "block"), os.urandom(8), pool, rng.integers(0, 256, pool.block_nbytes, dtype=np.uint8),
                 None, True)
    assert list(tmp_path.iterdir()) == []
