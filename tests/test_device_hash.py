"""Block checksums on the GPU (``kernels/xxh3.cu``, :mod:`tiercache.files.devicehash`): the
kernel's XXH3-64 equals the xxhash library's, bit for bit, for random rows of random lengths
(every length class of XXH3's long form: a partial last stripe, whole 1 KiB blocks, rows
farther apart than their length, more rows than one grid's height), and kvikio's reads and
writes use it. On the CPU: the secret the kernel takes is the library's, and what the kernel
refuses is refused with the reason."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import xxhash

from tiercache.files import devicehash
from tiercache.files.rootdir import RootPath


def test_the_secret_is_the_librarys_default(rng):
    secret = devicehash.default_secret()
    assert secret is not None and len(secret) == 192
    import xxhash._xxhash as ext

    with_secret = ctypes.CDLL(ext.__file__).XXH3_64bits_withSecret
    with_secret.restype = ctypes.c_uint64
    with_secret.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
    for n in rng.integers(241, 1 << 16, 20).tolist():
        data = rng.bytes(n)
        assert with_secret(data, n, secret, 192) == xxhash.xxh3_64_intdigest(data)
    # a wrong secret would not reproduce it: the check is not vacuous
    other = bytes(b ^ 1 for b in secret)
    assert with_secret(b"x" * 300, 300, other, 192) != xxhash.xxh3_64_intdigest(b"x" * 300)


@pytest.mark.parametrize("nbytes, address, pitch, ok", [
    (241, 0, 0, True), (240, 0, 0, False), (1 << 21, 4096, 1 << 21, True), (4096, 4, 4096, False),
    (4096, 0, 4100, False)])
def test_what_the_kernel_takes(nbytes, address, pitch, ok):
    assert devicehash.applies(nbytes, address, pitch) is ok


def _lengths(rng) -> list[int]:
    fixed = [241, 255, 256, 1023, 1024, 1025, 1088, 2047, 2048, 4096 + 63, 65536, 2 << 20]
    return fixed + rng.integers(241, 300_000, 8).tolist()


@pytest.mark.gpu
def test_gpu_checksums_equal_the_librarys(rng):
    cupy = pytest.importorskip("cupy")
    for nbytes in _lengths(rng):
        n = int(rng.integers(1, 6))
        pitch = nbytes + (-nbytes % 8) + 8 * int(rng.integers(0, 3))  # rows apart by more than their length
        host = rng.integers(0, 256, (n, pitch), dtype=np.uint8)
        dev = cupy.asarray(host)[:, :nbytes]
        got = devicehash.device_checksums(dev)
        want = [xxhash.xxh3_64_intdigest(host[i, :nbytes].tobytes()) for i in range(n)]
        assert got.tolist() == want, f"{nbytes} bytes, pitch {pitch}"
    # one byte changed anywhere changes that row's checksum only
    host = rng.integers(0, 256, (4, 8192), dtype=np.uint8)
    dev = cupy.asarray(host)
    before = devicehash.device_checksums(dev)
    i, j = int(rng.integers(0, 4)), int(rng.integers(0, 8192))
    dev[i, j] ^= 1
    after = devicehash.device_checksums(dev)
    assert [a != b for a, b in zip(after, before)] == [k == i for k in range(4)]


@pytest.mark.gpu
def test_gpu_checksums_of_more_rows_than_a_grid_is_high(rng):
    cupy = pytest.importorskip("cupy")
    n = 65535 + 9
    host = rng.integers(0, 256, (n, 256), dtype=np.uint8)
    got = devicehash.device_checksums(cupy.asarray(host))
    for i in [0, 1, 65534, 65535, 65536, n - 1] + rng.integers(0, n, 20).tolist():
        assert int(got[i]) == xxhash.xxh3_64_intdigest(host[i].tobytes()), i


@pytest.mark.gpu
def test_rows_the_kernel_refuses_are_named(rng):
    cupy = pytest.importorskip("cupy")
    h = devicehash.hasher(0)
    out = cupy.empty(2, dtype=cupy.uint64)
    with pytest.raises(ValueError, match="at least 241 bytes"):
        h.hash_rows(cupy.zeros((2, 200), dtype=cupy.uint8), out)
    with pytest.raises(ValueError, match="8-byte boundaries"):
        h.hash_rows(cupy.zeros((2, 4100), dtype=cupy.uint8)[:, 4:], out)
    with pytest.raises(ValueError, match="give \\[2\\] 64-bit words"):
        h.hash_rows(cupy.zeros((2, 4096), dtype=cupy.uint8), cupy.empty(3, dtype=cupy.uint64))


@pytest.mark.gpu
def test_kvikio_reads_check_on_the_gpu(tmp_path, rng, monkeypatch):
    """A device:file round trip through kvikio (compat mode without GDS): the header's checksum
    is the GPU's, a read verifies with it, and a flipped byte is caught; the host's hash is
    never called for a block the kernel takes."""
    cupy = pytest.importorskip("cupy")
    pytest.importorskip("kvikio")
    from tiercache.errors import CorruptBlockError
    from tiercache.files import kvikio_io
    from tiercache.files.blockfile import DATA_OFFSET
    from tiercache.geometry import PoolSpec

    def host_hash(*_):
        raise AssertionError("hashed on the host")

    monkeypatch.setattr(kvikio_io, "checksum", host_hash)
    pool = PoolSpec("kv", (64, 1024), "uint8")
    data = rng.integers(0, 256, pool.block_nbytes, dtype=np.uint8)
    dev = cupy.asarray(data)
    staging = np.empty(pool.block_nbytes, dtype=np.uint8)
    name = "block_x0a_pool_kv.bin"
    path = tmp_path / name
    at = RootPath(os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY), name, None, str(tmp_path))
    kvikio_io.write_block(at, b"\x0a", pool, dev, staging, "none")
    back = cupy.zeros_like(dev)
    kvikio_io.read_block(at, b"\x0a", pool, back, staging, verify=True)
    assert np.array_equal(cupy.asnumpy(back), data)
    raw = bytearray(path.read_bytes())
    raw[DATA_OFFSET + int(rng.integers(0, pool.block_nbytes))] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptBlockError, match="checksum mismatch"):
        kvikio_io.read_block(at, b"\x0a", pool, back, staging, verify=True)
