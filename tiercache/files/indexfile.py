"""The root's saved index: ``<root>/.tiercache-index``, so that a root of millions of block
files opens without reading every header.

The directory stays the truth: the index is a checkpoint of which blocks the root held
(their keys, use order and partial-block positions) plus, per block subdirectory, its
modification time when the checkpoint was taken. A subdirectory whose time has not moved
since holds the same names (every create, rename and unlink in a directory moves its time);
one whose time moved is listed again and reconciled with the index in the background
(:class:`~tiercache.placement.fileindex.FileIndex`). Bytes are never taken from the index:
every read checks the file's header and XXH3-64, so a stale or lying index can only make a
block missing, never serve wrong bytes.

Format (one file, replaced atomically: a temporary file, then a rename):

- 8-byte magic ``TCINDEX\\0``, u32 format version, u32 metadata length, u64 XXH3-64 of the
  metadata, the metadata (JSON), then the body;
- metadata: the root's identity (device and inode of the root directory), the pools (name
  and file size), the block count ``n``, the arena length, the next tick, the body's
  XXH3-64, the subdirectories' times (ns) and the wall time they were read, the positions of
  partial host blocks;
- body: ``klen u8[n]``, ``kval i64[n]``, ``hash u64[n]``, ``tick u64[n]``, ``group u8[n]``
  (the block's subdirectory) and the key arena (see
  :class:`~tiercache.placement.compactslots.CompactSlots`).

A file that is truncated, corrupt, of another format version, of another root or of other
pools is refused with its reason; the caller rebuilds from the directory.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import numpy as np
import xxhash

from tiercache.files.blockfile import SUBDIRS, checked_metadata, file_size, pack_metadata
from tiercache.files.rootdir import INDEX, RootDir, write_atomic
from tiercache.geometry import PoolSpec
from tiercache.keys import KEY_HASH_GOLDEN, key_hash

MAGIC = b"TCINDEX\0"
INDEX_FORMAT = 1
#: a subdirectory's time is trusted only if it was this much older than the wall clock when
#: read: file times come from the kernel's coarse clock, so a change in the same tick as the
#: reading would leave the time unchanged
TIME_MARGIN_NS = 50_000_000


class IndexUnusable(Exception):
    """The saved index cannot be used (the message says why); the root is scanned instead."""


@dataclass
class SavedIndex:
    """A root's saved index: per block its key (``klen``, ``kval``, ``arena``), hash, tick
    and subdirectory number (``group``), in arrays of one length ``n``; ``clock`` the next tick; ``positions`` per
    key text
    the positions mask of a partial host block; ``dir_times`` per subdirectory its
    modification time (ns) when the index was taken, ``None`` where it cannot be trusted."""

    klen: np.ndarray
    kval: np.ndarray
    hash: np.ndarray
    tick: np.ndarray
    group: np.ndarray
    arena: bytes
    clock: int
    positions: dict[str, int] = field(default_factory=dict)
    dir_times: dict[str, int | None] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.klen)


def root_identity(rd: RootDir) -> list[int]:
    """The root directory's device and inode: an index copied from another root does not match."""
    st = os.fstat(rd.fd)
    return [st.st_dev, st.st_ino]


def pools_signature(pools) -> list[list]:
    """Each pool's name, dtype, block shape and file size: an index of other pools does not match."""
    return [[p.name, str(p.dtype), list(p.block_shape), file_size(p.block_nbytes)] for p in pools]


def dir_times(rd: RootDir) -> dict[str, int | None]:
    """Each block subdirectory's modification time (ns), ``None`` for one changed within
    :data:`TIME_MARGIN_NS` of now (see there) or missing."""
    now = time.time_ns()
    out: dict[str, int | None] = {}
    for name in SUBDIRS:
        st = rd.child(name).lstat()
        out[name] = st.st_mtime_ns if st is not None and st.st_mtime_ns < now - TIME_MARGIN_NS else None
    return out


def changed_dirs(rd: RootDir, saved: dict[str, int | None]) -> list[str]:
    """The subdirectories whose time differs from ``saved`` (or was not trusted then)."""
    out = []
    for name in SUBDIRS:
        st = rd.child(name).lstat()
        if saved.get(name) is None or st is None or st.st_mtime_ns != saved[name]:
            out.append(name)
    return out


def save_index(rd: RootDir, pools: tuple[PoolSpec, ...], index: SavedIndex, fsync: bool = False) -> int:
    """Write ``index`` as the root's saved index (atomically). Returns the bytes written.

    Raises:
        OSError: the write failed (the previous index, if any, is untouched).
    """
    body = b"".join([np.ascontiguousarray(index.klen, np.uint8).tobytes(),
                     np.ascontiguousarray(index.kval, np.int64).tobytes(),
                     np.ascontiguousarray(index.hash, np.uint64).tobytes(),
                     np.ascontiguousarray(index.tick, np.uint64).tobytes(),
                     np.ascontiguousarray(index.group, np.uint8).tobytes(), bytes(index.arena)])
    meta = json.dumps({
        "root": root_identity(rd), "pools": pools_signature(pools), "count": len(index),
        "arena": len(index.arena), "clock": index.clock, "body_xxh3": xxhash.xxh3_64_intdigest(body),
        "dir_times": index.dir_times, "positions": index.positions, "written": time.time(),
    }, separators=(",", ":")).encode()
    data = pack_metadata(MAGIC, INDEX_FORMAT, meta) + body
    write_atomic(rd, INDEX, data, fsync=fsync)
    return len(data)


def index_summary(rd: RootDir) -> dict | None:
    """What the root's saved index says without reading its body (a few KB however many
    blocks): ``{"blocks", "pools": [[name, dtype, shape, file bytes], ...], "written"
    (seconds since the epoch), "clean" (every subdirectory's time trusted: saved by the close
    of an exclusive root that had not written in its last :data:`TIME_MARGIN_NS`)}``; None when there is no index,
    or it is
    unreadable, corrupt, or another root's."""
    p = rd.child(INDEX)
    try:
        fd = p.open(os.O_RDONLY)
    except OSError:
        return None
    try:
        head = os.pread(fd, 24, 0)
        if len(head) < 24:
            return None
        meta_len = int.from_bytes(head[12:16], "little")
        data = head + os.pread(fd, meta_len, 24)
        _, meta_raw, _ = checked_metadata(data, MAGIC, INDEX_FORMAT, len(data), "index")
        meta = json.loads(meta_raw)
        if meta["root"] != root_identity(rd):
            return None
        return {"blocks": int(meta["count"]), "pools": meta["pools"], "written": float(meta.get("written", 0.0)),
                "clean": all(t is not None for t in meta["dir_times"].values())}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        os.close(fd)


#: the largest tick or clock an index may carry (a put adds ticks from there without overflow)
MAX_CLOCK = 1 << 62
#: the most entries an index may hold, and its metadata's most bytes (positions of partial blocks)
MAX_ENTRIES, MAX_META = 1 << 32, 1 << 30
#: entries whose key hash is recomputed at load (all of them for int keys): a wrong hash would
#: leave its slot unreachable by key
HASH_SAMPLE = 4096


def _int(meta: dict, name: str, lo: int, hi: int) -> int:
    v = meta.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise IndexUnusable(f"{name} = {v!r} not an integer in [{lo}, {hi}]")
    return v


def _checked_meta(meta) -> tuple[int, int, int, dict[str, int], dict[str, int | None]]:
    """``(count, arena bytes, clock, positions, dir_times)`` of the metadata, every field's type
    and range checked (an index's checksums prove it is whole, not that it is sane)."""
    if not isinstance(meta, dict):
        raise IndexUnusable("metadata is not an object")
    n = _int(meta, "count", 0, MAX_ENTRIES)
    arena = _int(meta, "arena", 0, 64 * n)
    clock = _int(meta, "clock", 0, MAX_CLOCK)
    _int(meta, "body_xxh3", 0, (1 << 64) - 1)
    positions, times = meta.get("positions"), meta.get("dir_times")
    if not isinstance(positions, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63
            for k, v in positions.items()):
        raise IndexUnusable("positions is not a map of key text to a mask")
    if not isinstance(times, dict) or not all(
            k in SUBDIRS and (v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0))
            for k, v in times.items()):
        raise IndexUnusable("dir_times is not a map of subdirectory to a time")
    return n, arena, clock, positions, times


def _check_hashes(index: SavedIndex) -> None:
    """Every int key's hash, and those of a sample of the bytes keys, recomputed."""
    ints = np.flatnonzero(index.klen == 255)
    if len(ints):
        want = index.kval[ints].astype(np.uint64) * np.uint64(KEY_HASH_GOLDEN)  # key_hash, vectorized
        if not np.array_equal(want, index.hash[ints]):
            raise IndexUnusable("an entry's hash does not match its key")
    byt = np.flatnonzero(index.klen != 255)
    if len(byt) > HASH_SAMPLE:
        byt = np.random.default_rng().choice(byt, HASH_SAMPLE, replace=False)
    arena = memoryview(index.arena)
    for i in byt.tolist():
        o, n = int(index.kval[i]), int(index.klen[i])
        if key_hash(bytes(arena[o:o + n])) != int(index.hash[i]):
            raise IndexUnusable("an entry's hash does not match its key")


def load_index(rd: RootDir, pools: tuple[PoolSpec, ...]) -> SavedIndex | None:
    """The root's saved index, or None when it has none. Its header and metadata are read and
    checked first (types, ranges, and the file's size against the entries it announces), the
    body only then; the entries are checked too (ranges, ticks below the clock, no key twice,
    key hashes: :func:`_check_hashes`).

    Raises:
        IndexUnusable: truncated, corrupt, another format version, another root, other pools,
            not a regular file, or any field or entry out of its range (the reason in the
            message). Nothing else: a crafted or damaged index is rebuilt from the files.
    """
    try:
        return _load_index(rd, pools)
    except IndexUnusable:
        raise
    except (ValueError, TypeError, KeyError, OverflowError, RecursionError, MemoryError) as exc:
        raise IndexUnusable(f"{type(exc).__name__}: {exc}"[:300]) from None


def _load_index(rd: RootDir, pools: tuple[PoolSpec, ...]) -> SavedIndex | None:
    p = rd.child(INDEX)
    if p.lstat() is None:
        return None
    try:
        fd = p.open(os.O_RDONLY)
    except OSError as exc:
        raise IndexUnusable(f"cannot be opened ({exc.strerror or exc})") from None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 24, 0)
        meta_len = int.from_bytes(head[12:16], "little") if len(head) == 24 else 0
        if meta_len > min(MAX_META, size):
            raise IndexUnusable(f"metadata length {meta_len} out of range")
        prefix = head + os.pread(fd, meta_len, 24)
        try:
            _, meta_raw, body_at = checked_metadata(prefix, MAGIC, INDEX_FORMAT, len(prefix), "index")
        except ValueError as exc:
            raise IndexUnusable(str(exc)) from None
        meta = json.loads(meta_raw)
        n, arena_len, clock, positions, times = _checked_meta(meta)
        if meta.get("root") != root_identity(rd):
            raise IndexUnusable("written for another root directory")
        if meta.get("pools") != pools_signature(pools):
            raise IndexUnusable(f"written for pools {meta.get('pools')}, not {pools_signature(pools)}")
        if size != body_at + 26 * n + arena_len:
            raise IndexUnusable(f"{size} bytes where its {n} entries need {body_at + 26 * n + arena_len}")
        body = bytearray(size - body_at)
        got = os.preadv(fd, [body], body_at) if body else 0
    finally:
        os.close(fd)
    if got != len(body) or xxhash.xxh3_64_intdigest(body) != meta["body_xxh3"]:
        raise IndexUnusable("body truncated or corrupt")
    body = memoryview(body)
    klen = np.frombuffer(body, np.uint8, n, 0)
    kval = np.frombuffer(body, np.int64, n, n)
    index = SavedIndex(klen, kval, np.frombuffer(body, np.uint64, n, 9 * n),
                       np.frombuffer(body, np.uint64, n, 17 * n), np.frombuffer(body, np.uint8, n, 25 * n),
                       bytes(body[26 * n:]), clock, positions, times)
    byt = klen != 255
    if (
        ((klen == 0) | (klen > 64) & byt).any()
        or (index.group >= len(SUBDIRS)).any()
        or (byt.any() and int((kval[byt] + klen[byt]).max()) > arena_len)
        or (byt.any() and int(kval[byt].min()) < 0)
        or ((~byt).any() and int(kval[~byt].min()) < 0)
    ):
        raise IndexUnusable("entries out of range")
    if n and int(index.tick.max()) >= clock:
        raise IndexUnusable("an entry's tick is not below the index's clock")
    if n > 1:
        hs = np.sort(index.hash)
        if (hs[1:] == hs[:-1]).any():
            raise IndexUnusable("a key appears twice")
    _check_hashes(index)
    return index
