"""Row writes (tiercache/files/rowwrites.py): a request from the rows of one host buffer laid
out as arrays. Files are byte for byte what the general path writes (header and data), for int
and bytes keys, over a root and a root array, under every fsync policy and both native engines;
replacing blocks leaves no stale byte for a reader that holds descriptors; a failed write or
rename fails only its block and leaves none of its files; rows the path cannot take, and keys
with extra header metadata, go the general way; a row store's stores take it."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from conftest import random_keys
from helpers import spy_request_sizes

from tiercache import PoolSpec, RowStore
from tiercache.arrays import aligned_empty
from tiercache.errors import ConfigError, CorruptBlockError
from tiercache.files import FileTier, IOPath, nativeio
from tiercache.files.blockfile import block_filename, block_location, decode_header
from tiercache.files.nativeio import native_hash
from tiercache.files.rowwrites import RowWrites
from tiercache.rowstore import POOL
from tiercache.settings import sections

NATIVE = [e for e in ("threads", "io_uring") if nativeio.native_status()[0]]
pytestmark = pytest.mark.skipif(not native_hash() or not NATIVE, reason="needs the native engine's XXH3-64")


@pytest.fixture
def row_calls(monkeypatch):
    """Counts the requests that took the row path."""
    return spy_request_sizes(monkeypatch, RowWrites)


def _tier(roots, pool, engine, **kw):
    kw.setdefault("io_threads", 4)
    s = sections(**({"roots": [str(r) for r in roots]} if len(roots) > 1 else {"root": str(roots[0])}),
                 io_engine=engine, **kw)
    return FileTier((pool,), 4096, IOPath("posix", "test"), s["file"], s["sharing"])


def _rows(rng, n: int, bs: int) -> np.ndarray:
    rows = aligned_empty(n * bs).reshape(n, bs)
    rows[:] = rng.integers(0, 256, (n, bs), dtype=np.uint8)
    return rows


def _file(roots, key, pool: str) -> bytes:
    sub, name = block_location(key, pool)
    found = [r / sub / name for r in roots if (r / sub / name).exists()]
    assert len(found) == 1, (key, found)
    return found[0].read_bytes()


def _tmp_files(roots) -> list[str]:
    return [n for r in roots for _, _, files in os.walk(r) for n in files if n.startswith(".tmp.")]


@pytest.mark.parametrize("engine", NATIVE)
@pytest.mark.parametrize("fsync", ["none", "data", "data+dir"])
@pytest.mark.parametrize("members", [1, 2])
@pytest.mark.parametrize("kind", ["int", "bytes", "mixed"])
def test_row_writes_make_the_files_the_general_path_makes(tmp_path, rng, row_calls, engine, fsync, members, kind):
    """Random keys and rows, a request cut into several native calls, rows written in a random
    order: every file equals, byte for byte, the one the general path writes for the same key and
    data, and reads back exact."""
    pool = PoolSpec("kv", (4096 * int(rng.integers(1, 4)),), "uint8")
    n = int(rng.integers(70, 150))
    keys = random_keys(rng, n, kind)
    rows = _rows(rng, n, pool.block_nbytes)
    order = rng.permutation(n)
    row_roots = [tmp_path / f"row{m}" for m in range(members)]
    ref_roots = [tmp_path / f"ref{m}" for m in range(members)]
    ft = _tier(row_roots, pool, engine, fsync=fsync)
    ref = _tier(ref_roots, pool, engine, fsync=fsync)
    outcome = ft.submit_row_writes(keys, "kv", rows, order)
    assert outcome is not None and row_calls == [n]
    assert outcome.exception(30) is None and not outcome.errors
    assert not any(ref.write([(k, {"kv": rows[order[i]]}) for i, k in enumerate(keys)]).values())
    for k in keys:
        assert _file(row_roots, k, "kv") == _file(ref_roots, k, "kv"), k
    out = np.zeros_like(rows)
    assert not any(ft.read([(k, {"kv": out[i]}) for i, k in enumerate(keys)]).values())
    assert np.array_equal(out, rows[order])
    ft.close()
    ref.close()
    assert not _tmp_files(row_roots)


@pytest.mark.parametrize("engine", NATIVE)
def test_replaced_blocks_read_back_new_bytes(tmp_path, rng, row_calls, engine):
    """Blocks written, read (the reads keep descriptors), then replaced by the row path twice:
    each read after a replace returns the new bytes, never the old file's."""
    pool = PoolSpec("kv", (8192,), "uint8")
    keys = random_keys(rng, 40, "bytes")
    ft = _tier([tmp_path / "root"], pool, engine, fsync="none")
    for _ in range(3):
        rows = _rows(rng, 40, 8192)
        assert ft.submit_row_writes(keys, "kv", rows, np.arange(40)).exception(30) is None
        for _ in range(2):
            out = np.zeros_like(rows)
            assert not any(ft.read([(k, {"kv": out[i]}) for i, k in enumerate(keys)]).values())
            assert np.array_equal(out, rows)
    assert len(row_calls) == 3
    ft.close()


@pytest.mark.parametrize("engine", NATIVE)
@pytest.mark.parametrize("fsync,op", [("none", "write"), ("data", "write"), ("data", "rename")])
def test_a_failed_file_fails_only_its_block_and_leaves_none_of_it(tmp_path, rng, row_calls, engine, fsync, op):
    """A write fault (ENOSPC) or, under the group commit, a rename fault (EIO) on one block of a
    request that replaces older blocks: that block fails with the error and no file of it is
    left; the others hold the new bytes."""
    pool = PoolSpec("kv", (4096,), "uint8")
    n = 30
    keys = random_keys(rng, n, "int")
    root = tmp_path / "root"
    ft = _tier([root], pool, engine, fsync=fsync)
    assert ft.submit_row_writes(keys, "kv", _rows(rng, n, 4096), np.arange(n)).exception(30) is None
    new = _rows(rng, n, 4096)
    doomed = int(rng.integers(n))
    if op == "write":
        nativeio.set_fault(nativeio.WRITE, block_filename(keys[doomed], "kv")[:-4], errno.ENOSPC)
    else:
        nativeio.set_fault(nativeio.RENAME, block_filename(keys[doomed], "kv"), errno.EIO)
    try:
        outcome = ft.submit_row_writes(keys, "kv", new, np.arange(n))
        assert outcome is not None
        outcome.exception(30)
    finally:
        nativeio.clear_faults()
    assert set(outcome.errors) == {doomed}
    assert outcome.errors[doomed].errno == (errno.ENOSPC if op == "write" else errno.EIO)
    sub, name = block_location(keys[doomed], "kv")
    assert not (root / sub / name).exists()
    ok = [i for i in range(n) if i != doomed]
    out = np.zeros((len(ok), 4096), np.uint8)
    assert not any(ft.read([(keys[i], {"kv": out[j]}) for j, i in enumerate(ok)]).values())
    assert np.array_equal(out, new[ok])
    free = ft.open_files.free_names() if ft.open_files is not None else []
    assert sorted(_tmp_files([root])) == sorted(free)
    ft.close()
    assert not _tmp_files([root])


def test_what_the_row_path_cannot_take_goes_the_general_way(tmp_path, rng, row_calls):
    """Unaligned rows under O_DIRECT, rows of another size, a key with extra header metadata,
    a tier of two pools: None (the caller takes :meth:`FileTier.submit`)."""
    pool = PoolSpec("kv", (4096,), "uint8")
    ft = _tier([tmp_path / "a"], pool, NATIVE[0], direct_io=True)
    rows = _rows(rng, 4, 4096)
    unaligned = np.frombuffer(aligned_empty(4 * 4096 + 64)[64:].data, np.uint8).reshape(4, 4096)
    assert ft.submit_row_writes([1, 2], "kv", unaligned, [0, 1]) is None
    assert ft.submit_row_writes([1, 2], "kv", _rows(rng, 4, 8192), [0, 1]) is None
    ft.block_meta[2] = {"tokens": 7}
    assert ft.submit_row_writes([1, 2], "kv", rows, [0, 1]) is None
    del ft.block_meta[2]
    assert ft.submit_row_writes([1, 2], "kv", rows, [0, 1]).exception(30) is None
    ft.close()
    s = sections(root=str(tmp_path / "b"), io_engine=NATIVE[0])
    two = FileTier((pool, PoolSpec("v", (4096,), "uint8")), 64, IOPath("posix", "test"), s["file"], s["sharing"])
    assert two.submit_row_writes([1], "kv", rows, [0]) is None
    two.close()
    assert row_calls == [2]


def test_a_row_stores_stores_take_the_row_path(tmp_path, rng, row_calls):
    """Stores into a full row store (evictions recycle files): every key's bytes read back
    exact through the store's loads, and every store request took the row path."""
    bs, n = 4096, 64
    rows = _rows(rng, n, bs)
    with RowStore(rows, tmp_path / "rs", capacity_blocks=2 * n, fsync="data") as st:
        for _ in range(4):
            rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
            keys = [os.urandom(16) for _ in range(n)]
            jid = st.submit_store(keys, np.arange(n))
            assert st.drain(30)
            res = {j.job_id: j for j in st.finished()}[jid]
            assert res.success, res.failed
            want = rows.copy()
            rows[:] = 0
            perm = rng.permutation(n)
            jid = st.submit_load(keys, perm)
            assert st.drain(30)
            assert {j.job_id: j for j in st.finished()}[jid].success
            assert np.array_equal(rows[perm], want)
    assert row_calls == [n] * 4


def _result(st: RowStore, jid):
    assert st.drain(30)
    return {j.job_id: j for j in st.finished()}[jid]


@pytest.mark.parametrize("engine", NATIVE)
def test_stores_can_take_checksums_made_by_the_caller(tmp_path, rng, row_calls, engine):
    """``submit_store(..., sums=...)`` (the vLLM connector's stores, hashed on the GPU): the
    headers carry the caller's checksums as given, for the new keys of the call in their order
    (stored keys skipped); the files are byte for byte a store's without ``sums``; a wrong
    checksum is written as given (the data is not hashed) and that block then fails its read
    and is quarantined, never read back as good; bad ``sums`` submit nothing."""
    import xxhash

    bs, n = 3 * 4096, 12
    rows = _rows(rng, 2 * n, bs)
    keys = [os.urandom(int(rng.integers(1, 40))) for _ in range(n)]
    true = np.array([xxhash.xxh3_64_intdigest(rows[i].tobytes()) for i in range(n)], dtype=np.uint64)
    with RowStore(rows, tmp_path / "plain", capacity_blocks=4 * n, fsync="none", io_engine=engine) as plain, \
            RowStore(rows, tmp_path / "given", capacity_blocks=4 * n, fsync="none", io_engine=engine) as st:
        assert _result(plain, plain.submit_store(keys, np.arange(n))).success
        first = rng.permutation(n)[: n // 3]  # stored first: skipped by the second call
        assert _result(st, st.submit_store([keys[i] for i in first], first, sums=true[first])).success
        wrong = int(rng.choice(np.setdiff1d(np.arange(n), first)))
        given = true.copy()
        given[first] = 1  # the skipped keys' checksums are not used
        given[wrong] ^= np.uint64(1 << int(rng.integers(0, 64)))
        for bad in (np.zeros(n + 1, dtype=np.uint64), true.astype(np.int64), list(true)):
            with pytest.raises(ConfigError, match=f"uint64 array of {n} checksums"):
                st.submit_store(keys, np.arange(n), sums=bad)
        res = _result(st, st.submit_store(keys, np.arange(n), sums=given))
        assert res.success and res.sums_only and sorted(res.skipped) == sorted(keys[i] for i in first)
        for i, k in enumerate(keys):
            body = _file([tmp_path / "given"], k, POOL)
            assert decode_header(body[:4096]).checksum == int(true[i] if i in first else given[i])
            if i != wrong:
                assert body == _file([tmp_path / "plain"], k, POOL)
        rows[n:] = 0
        order = rng.permutation(n)
        res = _result(st, st.submit_load(keys, n + order))
        assert set(res.failed) == {keys[wrong]} and isinstance(res.failed[keys[wrong]], CorruptBlockError)
        good = np.flatnonzero(np.arange(n) != wrong)  # key i went to row n + order[i]
        assert np.array_equal(rows[n + order[good]], rows[good])
        assert not rows[n + order[wrong]].any()  # no unverified byte of the bad block stays in its row
        assert keys[wrong] not in st and len(list((tmp_path / "given" / "quarantine").glob("*"))) == 1
    assert row_calls == [n, len(first), n - len(first)]  # every store took the row path


@pytest.mark.parametrize("kind", ["int", "bytes"])
def test_the_caches_writes_of_host_rows_take_the_row_path(tmp_path, rng, row_calls, kind):
    """A one-pool cache: ``put`` into the host tier, ``offload`` to files (row writes, one
    request each), replaced keys offloaded again, then ``get`` in a fresh cache: exact bytes. A
    cache of two pools writes the general way (no row request)."""
    from tiercache import CacheConfig, TierCache

    bs, n = 8192, 48
    cfg = CacheConfig([PoolSpec("kv", (bs,), "uint8")], host_slots=n, file_slots=4 * n, root=str(tmp_path / "c"),
                      fsync="data")
    keys = random_keys(rng, n, kind)
    cache = TierCache(cfg)
    data = rng.integers(0, 256, (n, bs), dtype=np.uint8)
    cache.put(keys, data)
    cache.offload(keys)
    half = keys[: n // 2]
    data[: n // 2] = rng.integers(0, 256, (n // 2, bs), dtype=np.uint8)
    cache.put(half, data[: n // 2])
    cache.offload(half)
    cache.close()
    assert row_calls == [n, n // 2]
    again = TierCache(cfg)
    order = rng.permutation(n)
    assert np.array_equal(again.get([keys[i] for i in order]), data[order])
    again.close()
    two = CacheConfig([PoolSpec("kv", (bs,), "uint8"), PoolSpec("v", (4096,), "uint8")], host_slots=n,
                      file_slots=4 * n, root=str(tmp_path / "d"))
    c2 = TierCache(two)
    c2.put(keys, {"kv": data, "v": data[:, :4096].copy()})
    c2.offload(keys)
    c2.close()
    assert row_calls == [n, n // 2]
