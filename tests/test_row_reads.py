"""Row reads (tiercache/files/rowreads.py): a row store's loads with no Python per block. The
names made in C are the reference names (block_location); bytes round-trip exactly over a root
and a root array, in requests cut into several native calls; every way a file can be bad fails
only its block, with its row zeroed and corrupt files quarantined; a file the C threads do not
vouch for is judged by Python's check; rows that do not fit take the general path."""

from __future__ import annotations

import contextlib
import os
import string

import numpy as np
import pytest
from conftest import random_keys
from helpers import spy_request_sizes
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache import RowStore
from tiercache.arrays import aligned_empty
from tiercache.bench.benchvllmserve import damage_file
from tiercache.errors import ConfigError, CorruptBlockError
from tiercache.files import nativeio
from tiercache.files.blockfile import FANOUT, SUBDIRS, block_location
from tiercache.files.nativeio import block_names, native_hash
from tiercache.files.rowreads import RowReads
from tiercache.rowstore import POOL

pytestmark = pytest.mark.skipif(not native_hash(), reason="needs the native engine's XXH3-64")

POOL_CHARS = string.ascii_letters + string.digits + "_.-"


INT_KEYS = st.integers(0, (1 << 63) - 1)
BYTES_KEYS = st.binary(min_size=1, max_size=64)


@settings(max_examples=300, deadline=None)
@given(keys=st.one_of(st.lists(BYTES_KEYS, min_size=1, max_size=80), st.lists(INT_KEYS, min_size=1, max_size=80),
                      st.lists(st.one_of(INT_KEYS, BYTES_KEYS), min_size=1, max_size=80)),
       pool=st.text(POOL_CHARS, min_size=0, max_size=20).map(lambda s: "p" + s))
def test_the_names_made_in_c_are_the_reference_names(keys, pool):
    """Bytes keys, int keys (in C each) and a mix of both (spelled in Python)."""
    blob, offs, subs = block_names(keys, pool, FANOUT)
    raw = blob.raw
    for k, o, s in zip(keys, offs.tolist(), subs.tolist()):
        sub, name = block_location(k, pool)
        assert raw[o:raw.index(b"\0", o)].decode() == name and SUBDIRS[s] == sub


def test_a_key_out_of_range_is_refused():
    with pytest.raises(ValueError, match="1..64 bytes"):
        block_names([b"ok", b""], "kv", FANOUT)
    with pytest.raises(ValueError, match="1..64 bytes"):
        block_names([b"x" * 65], "kv", FANOUT)
    with pytest.raises(ValueError, match="outside"):
        block_names([3, 1 << 63], "kv", FANOUT)


@pytest.fixture
def row_calls(monkeypatch):
    """Counts the requests that took the row path."""
    return spy_request_sizes(monkeypatch, RowReads)


def _rows(rng, n: int, bs: int) -> np.ndarray:
    rows = aligned_empty(n * bs).reshape(n, bs)
    rows[:] = rng.integers(0, 256, (n, bs), dtype=np.uint8)
    return rows


@contextlib.contextmanager
def _stored(rng, root, n: int, bs: int, key_bytes=lambda rng: 16):
    """A row store of ``2 n`` page-aligned rows of ``bs`` random bytes whose first ``n`` rows
    are stored under random keys: ``(store, rows, copy of the first n rows, keys)``."""
    rows = _rows(rng, 2 * n, bs)
    want = rows[:n].copy()
    keys: list[bytes] = []
    while len(keys) < n:  # distinct keys (short ones may be drawn twice)
        k = rng.bytes(key_bytes(rng))
        if k not in keys:
            keys.append(k)
    with RowStore(rows, root, capacity_blocks=2 * n, fsync="none") as st_:
        st_.submit_store(keys, list(range(n)))
        st_.drain()
        st_.finished()
        yield st_, rows, want, keys


def _load(st_: RowStore, keys, rows):
    jid = st_.submit_load(keys, rows)
    st_.drain()
    return next(r for r in st_.finished() if r.job_id == jid)


@pytest.mark.parametrize("members", [1, 2])
def test_loads_take_the_row_path_and_return_exact_bytes(tmp_path, rng, row_calls, members):
    n, bs = 150, 8192  # three native calls of at most 64 files
    root = [tmp_path / f"d{i}" for i in range(members)] if members > 1 else tmp_path / "r"
    with _stored(rng, root, n, bs, lambda rng: int(rng.integers(1, 65))) as (st_, rows, want, keys):
        dest = (n + rng.permutation(n)).tolist()
        rows[n:] = 0
        res = _load(st_, keys, dest)
        assert res.success and row_calls == [n]
        assert np.array_equal(rows[dest], want)


def _damage(path: str, how: str, other: str) -> None:
    """The bench's damage (``delete``, ``truncate``, ``data``: a flipped data byte), a flipped
    byte of the header's metadata (``header``), or the file replaced by a symlink to ``other``."""
    if how in ("delete", "truncate", "data"):
        damage_file(path, "flip" if how == "data" else how)
    elif how == "header":
        with open(path, "r+b") as f:
            f.seek(40)
            b = f.read(1)
            f.seek(40)
            f.write(bytes([b[0] ^ 0x01]))
    elif how == "symlink":
        os.unlink(path)
        os.symlink(other, path)


def test_every_bad_file_fails_only_its_block(tmp_path, rng, row_calls):
    hows = ["delete", "truncate", "data", "header", "symlink"]
    n, bs = 12, 8192
    with _stored(rng, tmp_path / "r", n, bs) as (st_, rows, want, keys):
        bad = dict(zip(rng.choice(n, len(hows), replace=False).tolist(), hows))
        for i, how in bad.items():
            _damage(os.fspath(st_.ft.path(keys[i], POOL)), how, os.fspath(st_.ft.path(keys[(i + 1) % n], POOL)))
        rows[n:] = 0xAA
        res = _load(st_, keys, list(range(n, 2 * n)))
        assert row_calls == [n]
        assert set(res.failed) == {keys[i] for i in bad}
        for i in range(n):
            if i in bad:
                exc = res.failed[keys[i]]
                assert isinstance(exc, FileNotFoundError if bad[i] == "delete" else CorruptBlockError), (bad[i], exc)
                assert not rows[n + i].any()  # no unverified byte stays in the row
            else:
                assert np.array_equal(rows[n + i], want[i])
        moved = [m for m in os.listdir(tmp_path / "r" / "quarantine") if "block_" in m]
        assert len(moved) == len(bad) - 1, moved  # every corrupt file; the deleted one is just forgotten
        assert all(st_.state(keys[i]).name == "ABSENT" for i in bad)


def test_files_the_c_threads_do_not_vouch_for_are_judged_by_python(tmp_path, rng, row_calls, monkeypatch):
    """With every verdict withheld, Python's check accepts the good files and catches a bad one."""
    real = nativeio.NativeIO.run

    def no_verdict(self, kind, dir_fd, ops):
        out = real(self, kind, dir_fd, ops)
        if kind == nativeio.READ and ops.verdict is not None:
            ops.verdict[:] = 0
        return out

    monkeypatch.setattr(nativeio.NativeIO, "run", no_verdict)
    n, bs = 6, 4096
    with _stored(rng, tmp_path / "r", n, bs) as (st_, rows, want, keys):
        _damage(os.fspath(st_.ft.path(keys[2], POOL)), "data", "")
        res = _load(st_, keys, list(range(n, 2 * n)))
        assert row_calls == [n] and set(res.failed) == {keys[2]}
        assert isinstance(res.failed[keys[2]], CorruptBlockError)
        for i in (0, 1, 3, 4, 5):
            assert np.array_equal(rows[n + i], want[i])


def test_rows_the_row_path_cannot_take_go_the_general_way(tmp_path, rng, row_calls):
    """Unaligned rows under O_DIRECT: the general path (its aligned staging), same bytes."""
    n, bs = 5, 4096
    raw = aligned_empty(2 * n * bs + 64)[64:]  # rows 64 bytes past a page
    rows = raw.reshape(2 * n, bs)
    rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
    want = rows[:n].copy()
    keys = [rng.bytes(8) for _ in range(n)]
    with RowStore(rows, tmp_path / "r", capacity_blocks=2 * n, fsync="none") as st_:
        assert st_.ft.row_reads is not None and not st_.ft.row_reads.applies(POOL, rows)
        st_.submit_store(keys, list(range(n)))
        st_.drain()
        st_.finished()
        res = _load(st_, keys, list(range(n, 2 * n)))
        assert res.success and row_calls == [] and np.array_equal(rows[n:], want)


@pytest.mark.parametrize("kind", ["int", "bytes", "mixed"])
def test_the_cache_reads_files_into_host_rows_on_the_row_path(tmp_path, rng, row_calls, kind):
    """``TierCache.get`` and ``onboard`` of blocks held only in files, two pools of whole
    pages (one of float32 blocks), int, bytes or mixed keys: one row request per pool and
    call, exact bytes; a damaged file fails its block alone (and is quarantined), the others
    still read exact."""
    from tiercache import CacheConfig, PoolSpec, TierCache
    from tiercache.errors import TierCacheError

    pools = [PoolSpec("kv", (2, 4096), "uint8"), PoolSpec("act", (1024 * int(rng.integers(1, 4)),), "float32")]
    n = 40
    cfg = CacheConfig(pools, device_slots=0, host_slots=n, file_slots=4 * n, root=tmp_path / "root", fsync="none")
    keys = random_keys(rng, n, kind)
    data = {p.name: rng.integers(0, 256, (n, p.block_nbytes), dtype=np.uint8) for p in pools}
    with TierCache(cfg) as c:
        c.put(keys, {p.name: data[p.name].view(p.dtype).reshape(n, *p.block_shape) for p in pools})
        c.offload(keys)
        assert all(list(c.lookup(k)) == ["file"] for k in keys)
        order = rng.permutation(n).tolist()
        for p in pools:
            got = c.get([keys[i] for i in order], pool=p.name)
            assert np.array_equal(got.reshape(n, -1).view(np.uint8), data[p.name][order])
        assert row_calls == [n, n]  # a request per call (get reads the pool it is asked for)
        _damage(os.fspath(c._file_tier.path(keys[order[3]], "kv")), "data", "")
        with pytest.raises(TierCacheError):
            c.get([keys[i] for i in order[:8]], pool="kv")
        rest = [keys[i] for i in order[4:20]]
        c.onboard(rest, to="host")
        assert row_calls[-2:] == [len(rest)] * 2  # into the host tier's rows: a request per pool
        for p in pools:
            got = c.get(rest, pool=p.name)
            assert np.array_equal(got.reshape(len(rest), -1).view(np.uint8), data[p.name][order[4:20]])
    assert [m for m in os.listdir(tmp_path / "root" / "quarantine") if "block_" in m]


def _sums_load(st: RowStore, keys, rows, sums):
    jid = st.submit_load(keys, rows, sums=sums)
    st.drain()
    return next(r for r in st.finished() if r.job_id == jid)


@pytest.mark.parametrize("missing", [False, True])
def test_loads_can_leave_the_data_checksums_to_the_caller(tmp_path, rng, missing):
    """``submit_load(..., sums=...)``: the C threads check headers and sizes, and give each
    header's checksum (what the vLLM connector compares on the GPU); a flipped data byte
    passes that, so the caller's own comparison finds it and :meth:`RowStore.reject`
    quarantines the file and forgets the key; a truncated file fails in the load itself; a key
    rejected whose file verifies is kept (the bytes changed on their way, not in the file)."""
    import xxhash

    n, row = 10, 3 * 4096
    rows = aligned_empty((2 * n + 1) * row).reshape(2 * n + 1, row)
    rows[:n] = rng.integers(0, 256, (n, row), dtype=np.uint8)
    keys = random_keys(rng, n, "bytes")
    root = tmp_path / "r"
    with RowStore(rows, root, capacity_blocks=64, fsync="none", open_files=0) as st:
        st.submit_store(keys, list(range(n)))
        st.drain()
        assert all(r.success for r in st.finished())
        want = [xxhash.xxh3_64_intdigest(rows[i].tobytes()) for i in range(n)]
        asked = keys + [rng.bytes(9)] if missing else keys  # a key never stored: no checksum
        sums = np.full(len(asked), 7, dtype=np.uint64)
        res = _sums_load(st, asked, list(range(n, n + len(asked))), sums)
        assert res.sums_only and set(res.failed) == set(asked[n:])
        assert sums[:n].tolist() == want and sums[n:].tolist() == [0] * (len(asked) - n)
        assert np.array_equal(rows[n:2 * n], rows[:n])
        flip, cut, good = (int(i) for i in rng.permutation(n)[:3])
        damage_file(next(root.glob(f"*/block_x{keys[flip].hex()}_pool_*.bin")), "flip")
        damage_file(next(root.glob(f"*/block_x{keys[cut].hex()}_pool_*.bin")), "truncate")
        with pytest.raises(ConfigError, match="uint64 array of 10 checksums"):
            st.submit_load(keys, list(range(n, 2 * n)), sums=np.zeros(n + 1, dtype=np.uint64))
        sums = np.zeros(n, dtype=np.uint64)
        res = _sums_load(st, keys, list(range(n, 2 * n)), sums)
        assert set(res.failed) == {keys[cut]} and isinstance(res.failed[keys[cut]], CorruptBlockError)
        got = [xxhash.xxh3_64_intdigest(rows[n + i].tobytes()) for i in range(n)]
        mismatched = [i for i in range(n) if i != cut and got[i] != int(sums[i])]
        assert mismatched == [flip]  # the header still gives the block's true checksum
        out = st.reject([keys[flip], keys[good]], "data checksum mismatch on the GPU")
        assert isinstance(out[keys[flip]], CorruptBlockError)
        assert type(out[keys[good]]).__name__ == "TornReadError"
        assert keys[flip] not in st and keys[cut] not in st and keys[good] in st
        assert len(list((root / "quarantine").glob("*"))) >= 2


@pytest.mark.parametrize("aligned", [True, False], ids=["pages", "bytes"])
@pytest.mark.parametrize("members", [1, 2])
def test_span_loads_assemble_blocks_group_by_group_and_give_the_whole_checksum(tmp_path, rng, aligned, members,
                                                                                row_calls):
    """``submit_load(..., span=(start, length))``: a block read in spans (a layer group at a
    time, as the vLLM connector's layer-wise loads read), each into its own bytes of the row,
    assembles byte-exact; every span gives the header's checksum of the whole data, which the
    assembled row matches; nothing outside the span is written."""
    import xxhash

    n, row = 40, 16 * 4096
    cuts = [0, 4096, 5 * 4096, 12 * 4096, row] if aligned else [0, 1000, 4097, 33333, row]
    rows = aligned_empty((2 * n) * row).reshape(2 * n, row)
    rows[:n] = rng.integers(0, 256, (n, row), dtype=np.uint8)
    keys = random_keys(rng, n, "bytes")
    root = [tmp_path / f"d{i}" for i in range(members)] if members > 1 else tmp_path / "r"
    with RowStore(rows, root, capacity_blocks=2 * n, fsync="none", open_files=0) as st:
        st.submit_store(keys, list(range(n)))
        assert st.drain(30) and all(r.success for r in st.finished())
        rows[n:] = 0xAA
        want = [xxhash.xxh3_64_intdigest(rows[i].tobytes()) for i in range(n)]
        order = rng.permutation(n).tolist()  # any order of keys and rows
        for lo, hi in zip(cuts, cuts[1:]):
            sums = np.zeros(n, dtype=np.uint64)
            jid = st.submit_load([keys[i] for i in order], [n + i for i in order], sums=sums, span=(lo, hi - lo))
            assert st.drain(30)
            (res,) = [r for r in st.finished() if r.job_id == jid]
            assert res.success and res.sums_only and res.nbytes == n * (hi - lo)
            assert sums.tolist() == [want[i] for i in order]
            assert np.array_equal(rows[n:, lo:hi], rows[:n, lo:hi])
            assert (rows[n:, hi:] == 0xAA).all()  # the spans not read yet are untouched
        assert np.array_equal(rows[n:], rows[:n])
    assert sum(row_calls) == (len(cuts) - 1) * n


def test_a_bad_file_fails_its_span_load_or_its_assembled_checksum(tmp_path, rng):
    """What a span read checks (the header, the file's size) fails there: a deleted file, a cut
    one (whatever span is asked), a flipped header byte; a flipped data byte passes each span
    and the assembled row's checksum differs from the header's, for the caller's check and
    :meth:`RowStore.reject`. A span outside the row, or without sums, is refused."""
    import xxhash

    n, row = 8, 4 * 4096
    rows = aligned_empty((2 * n) * row).reshape(2 * n, row)
    rows[:n] = rng.integers(0, 256, (n, row), dtype=np.uint8)
    keys = random_keys(rng, n, "bytes")
    root = tmp_path / "r"
    with RowStore(rows, root, capacity_blocks=2 * n, fsync="none", open_files=0) as st:
        st.submit_store(keys, list(range(n)))
        assert st.drain(30) and all(r.success for r in st.finished())
        bad = dict(zip((0, 1, 2, 3), ("delete", "truncate", "header", "data")))
        for i, how in bad.items():
            _damage(os.fspath(st.ft.path(keys[i], POOL)), how, "")
        with pytest.raises(ConfigError, match="span"):
            st.submit_load(keys, list(range(n, 2 * n)), span=(0, 4096))
        with pytest.raises(ConfigError, match="span"):
            st.submit_load(keys, list(range(n, 2 * n)), sums=np.zeros(n, np.uint64), span=(4096, row))
        with pytest.raises(ConfigError, match="span"):  # the file tier's own row reads refuse it too
            st.ft.submit_rows(keys, POOL, rows, list(range(n, 2 * n)), sums=np.zeros(n, np.uint64), span=(0, row + 1))
        sums = np.zeros(n, dtype=np.uint64)
        rows[n:] = 0xAA
        jid = st.submit_load(keys, list(range(n, 2 * n)), sums=sums, span=(0, 4096))  # before the cut
        assert st.drain(30)
        (res,) = [r for r in st.finished() if r.job_id == jid]
        assert set(res.failed) == {keys[0], keys[1], keys[2]}
        # a failed key's span is zeroed, and nothing else of its row (other spans are other blocks')
        assert not rows[n:n + 3, :4096].any() and (rows[n:n + 3, 4096:] == 0xAA).all()
        assert isinstance(res.failed[keys[0]], FileNotFoundError)
        assert all(isinstance(res.failed[keys[i]], CorruptBlockError) for i in (1, 2))
        jid = st.submit_load(keys[3:], list(range(n + 3, 2 * n)), sums=sums[3:], span=(4096, row - 4096))
        assert st.drain(30) and all(r.success for r in st.finished() if r.job_id == jid)
        got = [xxhash.xxh3_64_intdigest(rows[n + i].tobytes()) for i in range(3, n)]
        assert [i for i, (g, s) in zip(range(3, n), zip(got, sums[3:].tolist())) if g != s] == [3]
        assert isinstance(st.reject([keys[3]], "assembled checksum")[keys[3]], CorruptBlockError)
