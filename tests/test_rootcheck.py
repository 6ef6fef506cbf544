"""The parallel checks behind ``tiercache verify`` and ``purge`` (tiercache/rootops/check.py):
on every I/O engine they say exactly what the one-file-at-a-time checks say, for random damage
done to random files, and the deletion never goes through a name that stopped being a file."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from conftest import random_keys
from helpers import put_random

from tiercache import TierCache
from tiercache.files import RootDir
from tiercache.files.blockfile import DATA_OFFSET, encode_header
from tiercache.geometry import PoolSpec
from tiercache.rootops import check as rootcheck
from tiercache.rootops import entry_path, is_own_block_file, survey, verify_file
from tiercache.rootops.check import delete_own, own_entries, unlink_all, verify_entries


def _damage(path, kind: str, rng: np.random.Generator, other) -> None:
    size = path.stat().st_size
    if kind == "data byte":
        with open(path, "r+b") as f:
            f.seek(int(rng.integers(DATA_OFFSET, size - 1)) if size > DATA_OFFSET + 1 else DATA_OFFSET)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([(b[0] ^ 0xFF) if b else 1]))
    elif kind == "header byte":
        with open(path, "r+b") as f:
            f.seek(int(rng.integers(0, 120)))
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x5A]))
    elif kind == "cut in header":
        os.truncate(path, int(rng.integers(0, DATA_OFFSET)))
    elif kind == "cut in data":
        os.truncate(path, int(rng.integers(DATA_OFFSET, size)))
    elif kind == "trailing":
        with open(path, "ab") as f:
            f.write(b"\0" * int(rng.integers(1, 9000)))
    elif kind == "other key":
        shutil.copyfile(other, path)
    elif kind == "empty":
        os.truncate(path, 0)


KINDS = ("data byte", "header byte", "cut in header", "cut in data", "trailing", "other key", "empty")


@pytest.fixture
def damaged(make_config, rng):
    """A closed root of 80 blocks in two pools (int and content keys) with about a third of
    its files damaged in random ways, and one file of another geometry under pool "kv"."""
    cfg = make_config(host_slots=0, file_slots=200)
    keys = random_keys(rng, 40, "int") + random_keys(rng, 40, "bytes")
    with TierCache(cfg) as c:
        put_random(c, keys, rng, tier="file")
        c.flush()
    sv = survey(cfg.root)
    files = [cfg.root / e.relpath for e in sv.blocks]
    for p in rng.choice(len(files), len(files) // 3, replace=False):
        _damage(files[p], KINDS[int(rng.integers(len(KINDS)))], rng, files[(p + 1) % len(files)])
    # pool "kv" in another geometry (a root written before a config change): its own header is whole
    odd = next(e for e in sv.blocks if e.pool == "kv")
    other = PoolSpec("kv", (3, 5), "float32")
    data = rng.integers(0, 256, other.block_nbytes, dtype=np.uint8)
    from tiercache.files.blockfile import checksum, file_size

    blob = encode_header(odd.key, other, checksum(data)) + data.tobytes()
    (cfg.root / odd.relpath).write_bytes(blob + b"\0" * (file_size(other.block_nbytes) - len(blob)))
    return cfg


def _expected(rd, entries):
    return {e.name: p for e in entries if (p := verify_file(entry_path(rd, e)))}


@pytest.mark.parametrize("sizes", [True, False], ids=["stat", "listing"])
def test_verify_entries_says_what_verify_file_says(damaged, io_engine, monkeypatch, sizes):
    monkeypatch.setattr(rootcheck, "CHUNK_FILES", 7)  # many chunks, on several threads
    entries = survey(damaged.root, sizes=sizes).blocks
    with RootDir(damaged.root, check_owner=False) as rd:
        want = _expected(rd, entries)
        done = []
        got = verify_entries(rd, entries, threads=3, on_done=done.append, io_engine=io_engine)
    assert len(want) > 10
    assert {e.name: p for e, p in got} == want
    assert sum(done) == len(entries)
    if io_engine != "python":  # sizes learnt as the files were read
        assert [e.size for e in entries] == [e.size for e in survey(damaged.root).blocks]


def test_files_changed_after_the_survey(damaged, io_engine, rng):
    entries = survey(damaged.root).blocks
    gone, link, directory, grown = entries[0], entries[1], entries[2], entries[3]
    os.unlink(damaged.root / gone.relpath)
    target = damaged.root / "elsewhere"
    target.write_bytes(b"x" * 9000)
    os.unlink(damaged.root / link.relpath)
    os.symlink(target, damaged.root / link.relpath)
    os.unlink(damaged.root / directory.relpath)
    os.mkdir(damaged.root / directory.relpath)
    with open(damaged.root / grown.relpath, "ab") as f:
        f.write(b"\0" * 4096)
    with RootDir(damaged.root, check_owner=False) as rd:
        got = dict((e.name, p) for e, p in verify_entries(rd, entries, threads=2, io_engine=io_engine))
        assert "No such file" in got[gone.name]
        assert "not a regular file" in got[link.name] and "not a regular file" in got[directory.name]
        assert got[grown.name] == verify_file(entry_path(rd, grown))
        owned = {e.name for e in own_entries(rd, entries, threads=2, io_engine=io_engine)}
        assert not owned & {gone.name, link.name, directory.name}
    assert target.read_bytes() == b"x" * 9000


@pytest.mark.parametrize("sizes", [True, False], ids=["stat", "listing"])
def test_own_entries_and_unlink_all(damaged, io_engine, rng, sizes):
    entries = survey(damaged.root, sizes=sizes).blocks
    with RootDir(damaged.root, check_owner=False) as rd:
        want = {e.name for e in entries if is_own_block_file(entry_path(rd, e))}
        owned = own_entries(rd, entries, threads=3, io_engine=io_engine)
        assert {e.name for e in owned} == want and 0 < len(want) < len(entries)
        paths = [entry_path(rd, e) for e in owned]
        # a symlink that took a name after the check goes itself (its target stays); a directory stays
        link, directory = owned[0], owned[1]
        target = damaged.root / "target"
        target.write_bytes(b"keep")
        os.unlink(damaged.root / link.relpath)
        os.symlink(target, damaged.root / link.relpath)
        os.unlink(damaged.root / directory.relpath)
        os.mkdir(damaged.root / directory.relpath)
        done = []
        removed = unlink_all(paths, threads=4, on_done=done.append, io_engine=io_engine)
        assert unlink_all(paths[2:5], threads=2, io_engine=io_engine) == [False] * 3  # gone already
    assert removed == [e is not directory for e in owned] and sum(done) == len(owned)
    assert target.read_bytes() == b"keep"
    assert not os.path.lexists(damaged.root / link.relpath) and (damaged.root / directory.relpath).is_dir()
    left = {e.name for e in survey(damaged.root).blocks}
    assert left == {e.name for e in entries} - want


@pytest.mark.parametrize("sizes", [True, False], ids=["stat", "listing"])
def test_delete_own_removes_exactly_what_own_entries_names(damaged, io_engine, monkeypatch, sizes):
    monkeypatch.setattr(rootcheck, "CHUNK_FILES", 5)
    entries = survey(damaged.root, sizes=sizes).blocks
    with RootDir(damaged.root, check_owner=False) as rd:
        want = {e.name: os.stat(damaged.root / e.relpath).st_size for e in entries
                if is_own_block_file(entry_path(rd, e))}
        done = []
        gone, foreign = delete_own(rd, entries, threads=3, on_done=done.append, io_engine=io_engine)
    assert {e.name: e.size for e in gone} == want and foreign == len(entries) - len(want) > 0
    assert sum(done) == len(entries)
    assert {e.name for e in survey(damaged.root).blocks} == {e.name for e in entries} - set(want)


def test_chunks_hold_their_byte_bound_when_the_listing_gave_no_sizes(damaged, monkeypatch):
    """Listed without a stat, files are sized by the first of their pool (stat'ed once): big
    blocks still go a few per native call, not CHUNK_FILES (a staging buffer per call)."""
    from tiercache.files import native_status

    if not native_status()[0]:
        pytest.skip(f"native I/O unavailable: {native_status()[1]}")
    monkeypatch.setattr(rootcheck, "CHUNK_BYTES", 3 * 16384)
    entries = survey(damaged.root, sizes=False).blocks
    with RootDir(damaged.root, check_owner=False) as rd:
        from tiercache.files.nativeio import NativeIO

        native = NativeIO(1)
        try:
            checker = rootcheck._Checker(rd, native)
            chunks = rootcheck._chunks(entries, checker.size)
        finally:
            native.close()
    assert sorted(e.name for c in chunks for e in c) == sorted(e.name for e in entries)
    assert all(sum(checker.size(e) for e in c) <= 3 * 16384 or len(c) == 1 for c in chunks)
    assert max(len(c) for c in chunks) < rootcheck.CHUNK_FILES
    inos = [e.ino for c in chunks for e in c]
    assert inos == sorted(inos) and all(inos)


def _native_or_skip():
    from tiercache.files import native_status

    if not native_status()[0]:
        pytest.skip(f"native I/O unavailable: {native_status()[1]}")


def _count_python_judgements(monkeypatch) -> list[str]:
    """The names of the files :class:`rootcheck._Checker` judged in Python (not in the C threads)."""
    judged: list[str] = []
    check = rootcheck._Checker._check

    def counted(self, e, *args):
        judged.append(e.name)
        return check(self, e, *args)

    monkeypatch.setattr(rootcheck._Checker, "_check", counted)
    return judged


def test_the_c_threads_judge_usual_files_and_python_the_rest(make_config, rng, monkeypatch, io_engine):
    """A usual block file is judged in the C threads (only each pool's first few files, which
    teach its geometry, in Python); a header with ``extra`` (valid, not the usual bytes) and
    any byte of the header changed anywhere the checks read go to Python, and the verdicts are
    exactly verify_file's: the C comparison never passes a file Python would refuse."""
    if io_engine == "python":
        pytest.skip("the C threads' checks")
    _native_or_skip()
    monkeypatch.setattr(rootcheck, "CHUNK_FILES", 16)
    cfg = make_config(host_slots=0, file_slots=400)
    keys = random_keys(rng, 150, "int") + random_keys(rng, 150, "bytes")
    with TierCache(cfg) as c:
        put_random(c, keys, rng, tier="file")
        c.flush()
    entries = survey(cfg.root).blocks
    pools = {e.pool for e in entries}
    judged = _count_python_judgements(monkeypatch)
    with RootDir(cfg.root, check_owner=False) as rd:
        assert verify_entries(rd, entries, threads=3, io_engine=io_engine) == []
    assert len(pools) <= len(judged) <= len(pools) * rootcheck.LEARN_FILES  # at most each pool's first files

    # one byte changed at a random offset of the part of the header the checks read (prefix,
    # metadata, the padding just after), in half of the files; one header rewritten with extra
    files = [cfg.root / e.relpath for e in entries]
    changed = rng.choice(len(files), len(files) // 2, replace=False)
    for p in changed:
        with open(files[p], "r+b") as f:
            head = f.read(64)
            meta_len = int.from_bytes(head[12:16], "little")
            at = int(rng.integers(0, min(24 + meta_len + 8, DATA_OFFSET)))
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ int(rng.integers(1, 256))]))
    spare = next(i for i in range(len(files)) if i not in set(changed.tolist()))
    e = entries[spare]
    pool = next(p for p in cfg.pools if p.name == e.pool)
    data = files[spare].read_bytes()[DATA_OFFSET:DATA_OFFSET + pool.block_nbytes]
    from tiercache.files.blockfile import checksum

    files[spare].write_bytes(encode_header(e.key, pool, checksum(data), extra={"note": "x"})
                             + files[spare].read_bytes()[DATA_OFFSET:])
    judged.clear()
    with RootDir(cfg.root, check_owner=False) as rd:
        want = _expected(rd, entries)
        got = {x.name: p for x, p in verify_entries(rd, entries, threads=3, io_engine=io_engine)}
    assert got == want and e.name not in got
    assert len(want) > len(changed) // 2  # most changes break the header
    assert e.name in judged and set(want) <= set(judged)
    assert len(judged) <= len(changed) + 1 + len(pools) * rootcheck.LEARN_FILES


def test_survey_hands_each_directory_to_on_blocks_and_checks_run_as_they_come(make_config, rng, io_engine):
    """``survey(on_blocks=...)`` hands every block file exactly once, one directory per call;
    a RootCheck fed that way (what ``verify`` and ``purge --yes`` run) finds what one call finds."""
    cfg = make_config(host_slots=0, file_slots=300)
    keys = random_keys(rng, 200, "bytes")
    with TierCache(cfg) as c:
        put_random(c, keys, rng, tier="file")
        c.flush()
    sv0 = survey(cfg.root)
    for i in range(0, len(sv0.blocks), 7):
        _damage(cfg.root / sv0.blocks[i].relpath, KINDS[int(rng.integers(len(KINDS)))], rng,
                cfg.root / sv0.blocks[(i + 1) % len(sv0.blocks)].relpath)
    calls: list[list] = []
    with RootDir(cfg.root, check_owner=False) as rd:
        with rootcheck.RootCheck(rd, rootcheck.VERIFY, threads=3, io_engine=io_engine) as check:
            def add(entries):
                calls.append(list(entries))
                check.add(entries)

            sv = survey(cfg.root, sizes=False, on_blocks=add)
            got = {e.name: p for e, p in check.results()}
        want = _expected(rd, sv.blocks)
    assert sorted(e.name for part in calls for e in part) == sorted(e.name for e in sv.blocks)
    assert all(len({e.dir for e in part}) == 1 for part in calls)
    assert len({part[0].dir for part in calls}) == len(calls) > 10
    assert got == want and len(want) > 0


def test_gc_paused_and_quick_gil_handoff_put_things_back():
    import gc
    import sys

    from tiercache.rootops import gc_paused, quick_gil_handoff

    before = sys.getswitchinterval()
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), quick_gil_handoff(0.001):
        assert sys.getswitchinterval() == pytest.approx(0.001)
        raise RuntimeError
    assert sys.getswitchinterval() == before
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
