"""Held descriptors and recycled block files (tiercache.files.openfiles): exact bytes through
random writes, overwrites, evictions and reads against a model; free files reused and never
served torn; the descriptor cap; shared roots hold none."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from conftest import ENGINES, bpath, names, random_keys

from tiercache import CacheConfig, PoolSpec, TierCache
from tiercache.files import FileTier, IOPath, block_filename, block_subdir, nativeio
from tiercache.settings import sections

NATIVE = [e for e in ENGINES if e != "python"]
pytestmark = pytest.mark.skipif(not NATIVE, reason="no C compiler: the native engines cannot be built here")


def _pools(rng):
    return (PoolSpec("kv", (4096 * int(rng.integers(1, 4)),), "uint8"),
            PoolSpec("act", (int(rng.integers(100, 3000)),), "float32"))


def _tier(root, pools, engine, **kw):
    s = sections(root=root, io_engine=engine, io_threads=4, direct_io=True, **kw)
    return FileTier(pools, 4096, IOPath("posix", "test"), s["file"], s["sharing"])


def _rows(rng, pools, n):
    return {p.name: rng.integers(0, 256, (n, p.block_nbytes), dtype=np.uint8) for p in pools}


def _items(keys, arrays):
    return [(k, {name: arr[i] for name, arr in arrays.items()}) for i, k in enumerate(keys)]


def _temporaries(root):
    return sorted(n for n in names(root) if n.startswith(".tmp."))


def _keys_in(rng, subdirs, n: int, distinct: bool = True) -> list:
    """``n`` random int keys whose files go in ``subdirs`` (each in a different one with
    ``distinct``): a free file is reused only by a write into its own subdirectory."""
    subdirs, out = list(subdirs), []
    while len(out) < n:
        k = int(rng.integers(0, 1 << 62))
        if block_subdir(k) in subdirs and k not in out:
            out.append(k)
            if distinct:
                subdirs.remove(block_subdir(k))
    return out


def _check(ft, pools, model):
    keys = list(model)
    if not keys:
        return
    out = {p.name: np.zeros((len(keys), p.block_nbytes), np.uint8) for p in pools}
    errs = ft.read(_items(keys, out))
    assert not any(errs.values()), {k: e for k, e in errs.items() if e}
    for p in pools:
        want = np.stack([model[k][p.name] for k in keys])
        assert np.array_equal(out[p.name], want)


@pytest.mark.parametrize("engine", NATIVE)
@pytest.mark.parametrize("fsync", ["none", "data"])
def test_random_writes_overwrites_evictions_and_reads_match_a_model(tmp_path, rng, engine, fsync):
    pools = _pools(rng)
    root = tmp_path / "root"
    ft = _tier(root, pools, engine, fsync=fsync)
    of = ft.open_files
    assert of is not None and of.recycle
    universe = random_keys(rng, 48)
    model: dict = {}
    for _ in range(30):
        op = rng.integers(0, 3)
        keys = [universe[i] for i in rng.choice(len(universe), int(rng.integers(1, 12)), replace=False)]
        if op == 0 or not model:  # write (new keys and overwrites of held ones)
            data = _rows(rng, pools, len(keys))
            assert not any(ft.write(_items(keys, data)).values())
            for i, k in enumerate(keys):
                model[k] = {p.name: data[p.name][i].copy() for p in pools}
        elif op == 1:  # evict: the files become free files
            gone = [k for k in keys if k in model]
            ft.evict(gone)
            for k in gone:
                del model[k]
                assert not any((bpath(root, k, p.name)).exists() for p in pools)
        else:
            _check(ft, pools, {k: model[k] for k in keys if k in model})
        # the only temporaries are the free files the tier keeps; no stale block file
        assert _temporaries(root) == sorted(of.free_names())
        assert {n for n in names(root) if n.startswith("block_")} == {
            block_filename(k, p.name) for k in model for p in pools}
        assert of.held <= of.capacity
    # whatever the random operations were: an overwrite (its replaced file becomes free) and a
    # new key in the same subdirectory (a free file is reused only there)
    old = next(iter(model)) if model else universe[0]
    new = _keys_in(rng, [block_subdir(old)], 1)[0]
    for k in (old, old, new):
        data = _rows(rng, pools, 1)
        assert not any(ft.write(_items([k], data)).values())
        model[k] = {p.name: data[p.name][0].copy() for p in pools}
    _check(ft, pools, model)
    assert of.hits > 0 and of.recycled > 0 and of.reused > 0  # the mechanisms under test ran
    ft.close()
    assert _temporaries(root) == []  # free files go with the tier
    ft = _tier(root, pools, engine, fsync=fsync)  # a fresh process's view: what is on disk
    assert {k for k, _ in ft.scan().blocks} == set(model)
    _check(ft, pools, model)
    ft.close()


@pytest.mark.parametrize("engine", NATIVE)
def test_a_failed_write_into_a_free_file_is_never_served(tmp_path, rng, engine):
    """Overwrites make free files; the next writes reuse them. One of those writes fails
    mid-way (injected ENOSPC after its data went to the reused file): the block is reported
    failed, its torn bytes are never published under a block name, and the reused file is
    neither kept nor left behind."""
    pools = (PoolSpec("kv", (8192,), "uint8"),)
    root = tmp_path / "root"
    ft = _tier(root, pools, engine, fsync="data")
    of = ft.open_files
    keys = _keys_in(rng, sorted({block_subdir(k) for k in random_keys(rng, 64)})[:16], 16)
    first = _rows(rng, pools, 16)
    assert not any(ft.write(_items(keys, first)).values())
    second = _rows(rng, pools, 16)
    assert not any(ft.write(_items(keys, second)).values())  # 16 exchanges: 16 free files
    assert len(of.free_names()) == 16
    others = _keys_in(rng, {block_subdir(k) for k in keys}, 8)  # each where a free file waits
    doomed = others[int(rng.integers(0, 8))]
    nativeio.set_fault(nativeio.WRITE, block_filename(doomed, "kv"), errno.ENOSPC)
    try:
        errs = ft.write(_items(others, _rows(rng, pools, 8)))
    finally:
        nativeio.clear_faults()
    assert {k for k, e in errs.items() if e} == {doomed}
    assert of.reused >= 8  # the new blocks went into free files
    assert not (bpath(root, doomed, "kv")).exists()
    assert _temporaries(root) == sorted(of.free_names())
    _check(ft, pools, {k: {"kv": second["kv"][i]} for i, k in enumerate(keys)})
    ft.close()


@pytest.mark.parametrize("engine", NATIVE)
@pytest.mark.parametrize("mode", ["move", "lost", "small"])
def test_free_files_move_to_the_subdirectory_that_writes(tmp_path, rng, engine, mode, monkeypatch):
    """Overwrites leave free files in some subdirectories; writes into other subdirectories
    take them (renamed across) when the files are large enough (``small``: they are not, and
    the writes make new files). With ``lost`` the free files were deleted behind the tier's
    back: the renames fail and the writes make new files. Every block reads back exact, now
    and after a reopen, and no temporary is left but the free files."""
    from tiercache.files import openfiles

    pools = (PoolSpec("kv", (8192,), "uint8"),)
    if mode != "small":
        monkeypatch.setattr(openfiles, "MOVE_MIN_BYTES", 4096 + 8192)
    assert (openfiles.MOVE_MIN_BYTES <= 4096 + 8192) == (mode != "small")
    lost = mode == "lost"
    root = tmp_path / "root"
    ft = _tier(root, pools, engine, fsync="none")
    of = ft.open_files
    dirs = sorted({block_subdir(k) for k in random_keys(rng, 256)})
    rng.shuffle(dirs)
    keys = _keys_in(rng, dirs[:8], 8)
    ft.write(_items(keys, _rows(rng, pools, 8)))
    data = _rows(rng, pools, 8)
    assert not any(ft.write(_items(keys, data)).values())
    model = {k: {"kv": data["kv"][i]} for i, k in enumerate(keys)}
    assert len(of.free_names()) == 8
    if lost:
        for name in of.free_names():
            (path,) = root.glob(f"*/{name}")
            path.unlink()
    reused = of.reused
    others = _keys_in(rng, dirs[8:], 8)  # none where a free file waits
    more = _rows(rng, pools, 8)
    assert not any(ft.write(_items(others, more)).values())
    model.update({k: {"kv": more["kv"][i]} for i, k in enumerate(others)})
    assert of.reused - reused == (8 if mode == "move" else 0)
    assert _temporaries(root) == sorted(of.free_names())
    _check(ft, pools, model)
    ft.close()
    ft = _tier(root, pools, engine, fsync="none")
    assert {k for k, _ in ft.scan().blocks} == set(model)
    _check(ft, pools, model)
    ft.close()


@pytest.mark.parametrize("engine", NATIVE)
def test_torn_free_file_left_by_a_crash_is_removed_not_served(tmp_path, rng, engine):
    """A process dies while a free file holds half-written bytes: the next open removes it
    as a temporary and serves only published blocks."""
    pools = (PoolSpec("kv", (8192,), "uint8"),)
    root = tmp_path / "root"
    ft = _tier(root, pools, engine, fsync="data")
    keys = random_keys(rng, 6)
    data = _rows(rng, pools, 6)
    ft.write(_items(keys, _rows(rng, pools, 6)))
    ft.write(_items(keys, data))
    free = ft.open_files.free_names()
    assert free
    (torn,) = [p for p in root.glob(f"*/{free[0]}")]
    with open(torn, "r+b") as f:  # a torn write of another block into it
        f.seek(4096)
        f.write(rng.bytes(3000))
    # the crash: the tier is gone without closing (its descriptors die with the process)
    for lock in ft._locks:
        lock.release()
    ft.dir.close()
    ft = _tier(root, pools, engine, fsync="data")
    scan = ft.scan()
    assert scan.removed_tmp == len(free) and _temporaries(root) == []
    assert {k for k, _ in scan.blocks} == set(keys)
    _check(ft, pools, {k: {"kv": data["kv"][i]} for i, k in enumerate(keys)})
    ft.close()


@pytest.mark.parametrize("engine", NATIVE)
def test_the_descriptor_cap_holds_and_misses_still_read_exact_bytes(tmp_path, rng, engine):
    pools = _pools(rng)
    cap = int(rng.integers(1, 8))
    ft = _tier(tmp_path / "root", pools, engine, open_files=cap)
    keys = random_keys(rng, 40)
    data = _rows(rng, pools, 40)
    assert not any(ft.write(_items(keys, data)).values())
    assert ft.open_files.held <= cap
    _check(ft, pools, {k: {p.name: data[p.name][i] for p in pools} for i, k in enumerate(keys)})
    assert ft.open_files.held <= cap
    ft.close()


def test_open_files_off_and_shared_roots_hold_no_descriptor(tmp_path, rng):
    pools = _pools(rng)
    ft = _tier(tmp_path / "a", pools, NATIVE[0], open_files=0)
    assert ft.open_files is None
    ft.close()
    ft = _tier(tmp_path / "b", pools, NATIVE[0], sharing="shared")
    assert ft.open_files is None
    ft.close()


def test_cache_evictions_recycle_files_for_later_offloads(tmp_path, rng):
    """Through the cache: a full file tier evicts the least recently used blocks into free
    files and the offloads that follow reuse them; every block reads back exact, now and
    after a reopen."""
    pools = (PoolSpec("kv", (16384,), "uint8"),)
    cfg = CacheConfig(pools=pools, host_slots=8, file_slots=8, root=tmp_path / "root")
    expected = {}
    with TierCache(cfg) as c:
        of = c.tiers["file"].open_files
        subdir = block_subdir(int(rng.integers(0, 1 << 62)))
        for _ in range(4):
            keys = _keys_in(rng, {subdir}, 8, distinct=False)  # one subdirectory: its files recycle
            data = {"kv": rng.integers(0, 256, (8, 16384), dtype=np.uint8)}
            c.put(keys, data, tier="file")
            expected = {k: data["kv"][i].copy() for i, k in enumerate(keys)}
        assert of.recycled >= 8 and of.reused >= 8
        got = c.get(list(expected), pool="kv", out=np.empty((8, 16384), np.uint8))
        assert np.array_equal(got, np.stack(list(expected.values())))
    with TierCache(cfg) as c:
        got = c.get(list(expected), pool="kv", out=np.empty((8, 16384), np.uint8))
        assert np.array_equal(got, np.stack(list(expected.values())))


@pytest.mark.parametrize("engine", NATIVE)
def test_files_changed_under_held_descriptors_fail_their_reads(tmp_path, rng, engine):
    """Reads through held descriptors are vouched for by the C check (header, checksum) without
    a size from an open: a data byte flipped in place or a file truncated under the held
    descriptor (the same inode) must fail its block, never be served, and the others read
    exact."""
    from tiercache import CorruptBlockError

    pools = (PoolSpec("kv", (16384,), "uint8"),)
    keys = random_keys(rng, 6)
    data = _rows(rng, pools, 6)
    from tiercache.memory import alloc_host

    ft = _tier(tmp_path / "root", pools, engine, fsync="none")
    assert not any(ft.write(_items(keys, data)).values())  # their descriptors kept (O_DIRECT)
    buf, _owner = alloc_host(6 * 16384)  # page-aligned rows: O_DIRECT reads, through those descriptors
    out = {"kv": buf.reshape(6, 16384)}
    hits = ft.open_files.hits
    with open(bpath(tmp_path / "root", keys[0], "kv"), "r+b") as f:  # a data byte flipped in place
        f.seek(4096 + int(rng.integers(0, 16384)))
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    os.truncate(bpath(tmp_path / "root", keys[1], "kv"), 4096 + 100)
    errs = ft.read(_items(keys, out))
    assert ft.open_files.hits > hits  # the reads went through the held descriptors
    assert isinstance(errs[keys[0]], CorruptBlockError) and "checksum" in str(errs[keys[0]])
    assert isinstance(errs[keys[1]], CorruptBlockError) and "truncated" in str(errs[keys[1]])
    for i in range(2, 6):
        assert errs[keys[i]] is None and np.array_equal(out["kv"][i], data["kv"][i])
    ft.close()


@pytest.mark.parametrize("engine", NATIVE)
def test_evictions_in_one_native_batch_recycle_only_the_held_inode(tmp_path, rng, engine, caplog):
    """Evictions and deletes run as one native UNLINK batch: a file whose name still holds its
    held descriptor's inode becomes a free file (no more than ``free_files``), a file replaced
    under its name is deleted and never kept free, a directory under a block's name is left
    with a warning, every other descriptor is closed, and later writes reuse the free files
    with exact bytes."""
    import logging
    import shutil

    pools = (PoolSpec("kv", (16384,), "uint8"),)
    root = tmp_path / "root"
    s = sections(root=root, io_engine=engine, io_threads=4, direct_io=True, fsync="none")
    ft = FileTier(pools, 4096, IOPath("posix", "test"), s["file"], s["sharing"], free_files=3)
    of = ft.open_files
    n = 10
    keys = random_keys(rng, n)
    data = _rows(rng, pools, n)
    assert not any(ft.write(_items(keys, data)).values())
    paths = {k: bpath(root, k, "kv") for k in keys}
    held = {k: of._open[paths[k].name].fd for k in keys}
    # keys[0]: the same bytes under a new inode (the held descriptor is now stale)
    shutil.copy(paths[keys[0]], str(paths[keys[0]]) + ".copy")
    os.replace(str(paths[keys[0]]) + ".copy", paths[keys[0]])
    # keys[1]: a directory where its file was
    os.unlink(paths[keys[1]])
    os.mkdir(paths[keys[1]])
    evicted = keys[:8]
    with caplog.at_level(logging.WARNING, logger="tiercache"):
        assert ft.evict(evicted) == evicted
    assert "a directory, not a block file" in caplog.text and paths[keys[1]].is_dir()
    for k in evicted[2:]:
        assert not paths[k].exists()
    assert not paths[keys[0]].exists()
    free = [(tmp, dfd, e) for (_, dfd), lst in of._free.items() for tmp, e in lst]
    assert 1 <= len(free) <= 3 and _temporaries(root) == sorted(t for t, _, _ in free)
    for tmp, dfd, e in free:  # each free file is its held descriptor's own inode, never the replaced one
        assert os.stat(tmp, dir_fd=dfd).st_ino == os.fstat(e.fd).st_ino
    kept = {e.fd for _, _, e in free}
    for k in evicted:
        if held[k] not in kept:
            with pytest.raises(OSError) as exc:
                os.fstat(held[k])
            assert exc.value.errno == errno.EBADF
    # later writes into the free files' subdirectories reuse them; every byte reads back
    subdirs = [block_subdir(k) for k in evicted for tmp, _, _ in free if block_filename(k, "kv") in tmp]
    new = _keys_in(rng, subdirs, len(subdirs))
    nd = _rows(rng, pools, len(new))
    reused = of.reused
    assert not any(ft.write(_items(new, nd)).values())
    assert of.reused > reused
    model = {k: {"kv": nd["kv"][i]} for i, k in enumerate(new)}
    model.update({k: {"kv": data["kv"][i]} for i, k in enumerate(keys) if i >= 8})
    _check(ft, pools, model)
    ft.delete(new)  # deletes: the same batch, no free file kept
    assert not any(bpath(root, k, "kv").exists() for k in new)
    ft.close()
    assert _temporaries(root) == []


@pytest.mark.parametrize("engine", NATIVE)
def test_deletes_from_the_closing_checkpoint_still_remove_files(tmp_path, rng, engine):
    """The index checkpoint at close runs after the native threads stop and may delete files
    (keys the reconciled listing dropped): those deletes still remove them, exact."""
    pools = _pools(rng)
    root = tmp_path / "root"
    ft = _tier(root, pools, engine)
    keys = random_keys(rng, 6)
    data = _rows(rng, pools, 6)
    assert not any(ft.write(_items(keys, data)).values())
    gone = keys[:3]
    ft.close(before_unlock=lambda: ft.delete(gone))
    for k in keys:
        assert all(bpath(root, k, p.name).exists() == (k not in gone) for p in pools)
    ft = _tier(root, pools, engine)
    _check(ft, pools, {k: {p.name: data[p.name][i] for p in pools} for i, k in enumerate(keys) if k not in gone})
    ft.close()
