"""Saved indexes crafted to pass their checksums (XXH3 is not a MAC) but not sane: each opens
into the logged rebuild from the files (or, where the entries are sane, a working tier), never
an exception, never a wedged tier (the hardening issue's fuzzed indexes)."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
from helpers import assert_bytes, put_random

from tiercache import TierCache
from tiercache.files.blockfile import checked_metadata, pack_metadata
from tiercache.files.indexfile import INDEX_FORMAT, MAGIC

INDEX = ".tiercache-index"


def _parts(root):
    data = (root / INDEX).read_bytes()
    _, meta_raw, at = checked_metadata(data, MAGIC, INDEX_FORMAT, len(data), "index")
    return json.loads(meta_raw), bytearray(data[at:])


def _write(root, meta, body, meta_raw: bytes | None = None) -> None:
    import xxhash

    if meta_raw is None:
        meta["body_xxh3"] = xxhash.xxh3_64_intdigest(bytes(body))
        meta_raw = json.dumps(meta).encode()
    (root / INDEX).write_bytes(pack_metadata(MAGIC, INDEX_FORMAT, meta_raw) + bytes(body))


def _fields(body, n):
    """Views of the body's arrays (klen, kval, hash, tick, group)."""
    b = np.frombuffer(body, np.uint8)
    return (b[:n], b[n:9 * n].view(np.int64), b[9 * n:17 * n].view(np.uint64), b[17 * n:25 * n].view(np.uint64),
            b[25 * n:26 * n])


@pytest.fixture
def saved(make_config, rng):
    cfg = make_config(host_slots=8, file_slots=32)
    with TierCache(cfg) as c:
        keys = list(range(100, 112))
        exp = put_random(c, keys, rng, tier="file")
    return cfg, exp


def _craft(case: str, root) -> None:
    meta, body = _parts(root)
    n = meta["count"]
    klen, kval, hsh, tick, group = _fields(body, n)
    if case == "dir_times_not_a_map":
        meta["dir_times"] = ["00"]
    elif case == "positions_not_a_map":
        meta["positions"] = "everything"
    elif case == "count_infinite":
        meta["count"] = float("inf")
    elif case == "clock_huge":
        meta["clock"] = 2 ** 64 - 1
    elif case == "tick_at_the_top":
        tick[0] = 2 ** 64 - 1
        meta["clock"] = 2 ** 62
    elif case == "deep_json":
        _write(root, None, body, meta_raw=b"[" * 200_000 + b"]" * 200_000)
        return
    elif case == "wrong_hash":
        hsh[3] ^= np.uint64(1)
    elif case == "key_twice":
        kval[1], hsh[1] = kval[0], hsh[0]
    elif case == "sparse_2g":
        (root / INDEX).write_bytes(b"")  # after the real header: a huge hole announced nowhere
        _write(root, meta, body)
        with open(root / INDEX, "r+b") as f:
            f.truncate(2 << 30)
        return
    _write(root, meta, body)


CASES = ["dir_times_not_a_map", "positions_not_a_map", "count_infinite", "clock_huge", "tick_at_the_top",
         "deep_json", "wrong_hash", "key_twice", "sparse_2g"]


@pytest.mark.parametrize("case", CASES)
def test_a_crafted_index_is_rebuilt_from_the_files(saved, rng, caplog, monkeypatch, case):
    cfg, exp = saved
    _craft(case, cfg.root)
    reads = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off, *a: reads.append(sum(len(b) for b in bufs))
                        or real(fd, bufs, off, *a))
    with caplog.at_level(logging.WARNING, logger="tiercache"):
        with TierCache(cfg) as c:
            assert c.wait_reconciled(30)
            assert sorted(c.keys("file")) == sorted(exp)
            assert sum("rebuilt from the directory" in r.getMessage() for r in caplog.records) == 1
            monkeypatch.undo()
            assert_bytes(c, exp)
            more = put_random(c, list(range(200, 228)), rng, tier="file")  # evicts the oldest: not wedged
            assert_bytes(c, more)
    assert all(r < (1 << 20) for r in reads)  # nothing read whole that the header did not announce


def test_entries_of_absent_files_do_not_wedge_the_tier(saved, rng):
    """A sane-looking index whose entries name files that are not there (the directory times
    unchanged): their reads fail and drop them, and evictions take them like any block."""
    cfg, exp = saved
    for k in list(exp)[:6]:
        for f in cfg.root.rglob(f"block_{k}_pool_*.bin"):
            st = os.stat(f.parent)
            f.unlink()
            os.utime(f.parent, ns=(st.st_atime_ns, st.st_mtime_ns))
    with TierCache(cfg) as c:
        assert c.wait_reconciled(30)
        more = put_random(c, list(range(300, 332)), rng, tier="file")  # every slot
        assert_bytes(c, more)
        assert len(c.keys("file")) == 32
