"""Blocks in pieces of the caller's memory (tiercache/files/blockpieces.py): a row store writes
them from and reads them into the pieces in place (vectored I/O in the native engine, the
checksum of the pieces as one run). The files are byte for byte the files rows make; bytes
round-trip exactly whatever the pieces' alignment and count (more pieces than one vectored
call takes included), on both native engines, over a root and a root array; a bad file fails
only its block, whose pieces are zeroed; what the store cannot take is refused up front."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
from helpers import spy_request_sizes

from tiercache import BlockPieces, RowStore
from tiercache.arrays import aligned_empty
from tiercache.bench.benchvllmserve import damage_file
from tiercache.errors import ConfigError, CorruptBlockError
from tiercache.files import nativeio
from tiercache.files.rowreads import RowReads
from tiercache.files.rowwrites import RowWrites
from tiercache.rowstore import POOL

ENGINES = ["threads"] + (["io_uring"] if nativeio.uring_status()[0] else [])
pytestmark = pytest.mark.skipif(not nativeio.native_pieces(), reason="needs the native engine's XXH3-64 streaming")


class Pool:
    """A host pool of ``pages`` pages, each ``k`` pieces of ``piece`` bytes kept apart (piece j of
    every page in region j, as a KV pool keeps K and V, or layers, apart), random bytes; region
    starts are page-aligned plus ``skew`` bytes."""

    def __init__(self, rng, pages: int, k: int, piece: int, skew: int = 0) -> None:
        self.region = piece * pages + 4096
        self.mem = aligned_empty(k * self.region + 4096)
        self.mem[:] = rng.integers(0, 256, self.mem.size, dtype=np.uint8)
        base = self.mem.ctypes.data + skew
        self.addr = np.array([[base + j * self.region + p * piece for j in range(k)] for p in range(pages)],
                             np.int64)
        self.k, self.piece = k, piece

    def pieces(self, order) -> BlockPieces:
        return BlockPieces(self.addr[np.asarray(order)], self.piece)

    def page(self, p: int) -> bytes:
        return b"".join(ctypes.string_at(int(a), self.piece) for a in self.addr[p])


def _done(st_: RowStore, jid):
    st_.drain()
    return next(r for r in st_.finished() if r.job_id == jid)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("k, piece, skew", [(2, 8192, 0), (2, 8192, 64), (80, 4096, 0), (1, 65536, 0),
                                            (3, 12288, 512)])
@pytest.mark.parametrize("members", [1, 2])
def test_pieces_round_trip_in_place_and_make_the_files_rows_make(tmp_path, rng, engine, k, piece, skew, members,
                                                                  monkeypatch):
    reads, writes = spy_request_sizes(monkeypatch, RowReads), spy_request_sizes(monkeypatch, RowWrites)
    n = 70  # two native calls of at most 64 files
    pool = Pool(rng, 2 * n, k, piece, skew)
    want = [pool.page(p) for p in range(n)]
    roots = [str(tmp_path / f"d{i}") for i in range(members)]
    rows = aligned_empty(n * k * piece).reshape(n, k * piece)
    keys = [rng.bytes(int(rng.integers(8, 65))) for _ in range(n)]  # 8+ bytes: no two alike
    with RowStore(rows, roots if members > 1 else roots[0], fsync="data", io_engine=engine) as st_:
        src = rng.permutation(n)  # page src[i] stored as keys[i]
        res = _done(st_, st_.submit_store(keys, list(range(n)), pieces=pool.pieces(src)))
        assert res.success and writes == [n]
        # the files: as rows make them (a row load of each reads and verifies it)
        res = _done(st_, st_.submit_load(keys, list(range(n))))
        assert res.success
        assert all(rows[i].tobytes() == want[src[i]] for i in range(n))
        # into other pages, in place, in another order
        dst = n + rng.permutation(n)
        res = _done(st_, st_.submit_load(keys, list(range(n)), pieces=pool.pieces(dst)))
        assert res.success and reads == [n, n]
        assert all(pool.page(int(dst[i])) == want[src[i]] for i in range(n))


def test_a_bad_file_fails_only_its_block_and_zeroes_its_pieces(tmp_path, rng):
    n, k, piece = 10, 2, 8192
    pool = Pool(rng, 2 * n, k, piece)
    want = [pool.page(p) for p in range(n)]
    rows = aligned_empty(2 * k * piece).reshape(2, k * piece)
    keys = [rng.bytes(16) for _ in range(n)]
    with RowStore(rows, tmp_path / "r", fsync="none") as st_:
        assert _done(st_, st_.submit_store(keys, list(range(n)), pieces=pool.pieces(range(n)))).success
        bad = {2: "flip", 5: "truncate", 7: "delete"}
        for i, how in bad.items():
            damage_file(os.fspath(st_.ft.path(keys[i], POOL)), how)
        res = _done(st_, st_.submit_load(keys, list(range(n)), pieces=pool.pieces(range(n, 2 * n))))
        assert set(res.failed) == {keys[i] for i in bad}
        for i in range(n):
            if i in bad:
                assert isinstance(res.failed[keys[i]], FileNotFoundError if bad[i] == "delete" else CorruptBlockError)
                assert pool.page(n + i) == bytes(k * piece)  # no unverified byte stays in the pool
            else:
                assert pool.page(n + i) == want[i]
        # a key never stored fails at once, its pieces zeroed too
        res = _done(st_, st_.submit_load([rng.bytes(16)], [0], pieces=pool.pieces([0])))
        assert not res.success and pool.page(0) == bytes(k * piece)


def test_what_the_store_cannot_take_is_refused_up_front(tmp_path, rng):
    rows = aligned_empty(2 * 8192).reshape(2, 8192)
    pool = Pool(rng, 4, 2, 4096)
    with RowStore(rows, tmp_path / "r", fsync="none") as st_:
        with pytest.raises(ConfigError, match="BlockPieces of 8192-byte blocks"):
            st_.submit_store([b"a"], [0], pieces=BlockPieces(pool.addr[:1, :1], 4096))  # 4 KiB blocks
        with pytest.raises(ConfigError, match="BlockPieces"):
            st_.submit_load([b"a"], [0], pieces=pool.addr)  # not a BlockPieces
        with pytest.raises(Exception, match=r"row 4 outside \[0, 4\)"):
            st_.submit_store([b"a"], [4], pieces=pool.pieces(range(4)))
        assert not st_.jobs_in_flight
    with RowStore(rows, tmp_path / "p", fsync="none", io_engine="python") as st_:
        assert not st_.pieces_fit(pool.pieces(range(4)))  # no native engine: no pieces
    with pytest.raises(ValueError, match="need \\[n, k\\]"):
        BlockPieces(np.zeros(3, np.int64), 4096)
    with pytest.raises(ValueError, match="piece_bytes = 0"):
        BlockPieces(np.zeros((3, 1), np.int64), 0)
    assert BlockPieces(np.array([[4096, 8192]]), 4096).aligned
    assert not BlockPieces(np.array([[4096, 8200]]), 4096).aligned


def _store_without_streaming(st_: RowStore, keys, pool: Pool, **kw):
    """``st_``'s store of ``keys`` from pool pages 0.. with the native XXH3 streaming functions
    gone (as where no state could be allocated), put back after; its result."""
    lib = nativeio._library()[0]
    stream = nativeio._xxh3_stream()
    assert lib is not None and stream is not None
    lib.tc_set_hash_stream(None, None, None, None, None)
    try:
        return _done(st_, st_.submit_store(keys, list(range(len(keys))), pieces=pool.pieces(range(len(keys))), **kw))
    finally:
        lib.tc_set_hash_stream(*stream)


def test_a_write_whose_checksum_cannot_be_made_fails_and_leaves_no_file(tmp_path, rng):
    """Without the streaming functions (as where no state could be allocated) a block in
    several pieces gets no header: its write fails, nothing is published, and the store still
    takes the same pieces once they are back."""
    n, k, piece = 4, 2, 8192
    pool = Pool(rng, n, k, piece)
    want = [pool.page(p) for p in range(n)]
    rows = aligned_empty(n * k * piece).reshape(n, k * piece)
    keys = [rng.bytes(16) for _ in range(n)]
    with RowStore(rows, tmp_path / "r", fsync="none") as st_:
        res = _store_without_streaming(st_, keys, pool)
        assert set(res.failed) == set(keys) and all(isinstance(e, OSError) for e in res.failed.values())
        assert not list((tmp_path / "r").rglob("block_*.bin")) and all(st_.state(key).name == "ABSENT" for key in keys)
        assert [pool.page(p) for p in range(n)] == want  # the source is untouched
        assert _done(st_, st_.submit_store(keys, list(range(n)), pieces=pool.pieces(range(n)))).success
        assert _done(st_, st_.submit_load(keys, list(range(n)))).success
        assert [rows[i].tobytes() for i in range(n)] == want


def test_a_store_given_the_checksums_writes_pieces_without_hashing_them(tmp_path, rng):
    """``submit_store(..., pieces=..., sums=...)`` (checksums made by the caller, as the vLLM
    connector's on the GPU): the C threads do not hash the data, so the store succeeds even
    with the streaming functions gone (a store without ``sums`` fails there, as above), and
    the files read back verified and byte-exact once they are back."""
    import xxhash

    n, k, piece = 6, 3, 8192
    pool = Pool(rng, n, k, piece)
    want = [pool.page(p) for p in range(n)]
    sums = np.array([xxhash.xxh3_64_intdigest(w) for w in want], dtype=np.uint64)
    rows = aligned_empty(n * k * piece).reshape(n, k * piece)
    keys = [rng.bytes(16) for _ in range(n)]
    with RowStore(rows, tmp_path / "r", fsync="none") as st_:
        res = _store_without_streaming(st_, keys, pool, sums=sums)
        assert res.success and res.sums_only
        res = _done(st_, st_.submit_load(keys, list(range(n))))
        assert res.success and [rows[i].tobytes() for i in range(n)] == want
