"""Root arrays: several roots (one per device) as one file tier, placement by a hash of the key,
explicit adding and removing of members (tiercache/files/rootarray.py)."""

from __future__ import annotations

import errno
import json
import os
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import random_keys
from helpers import assert_bytes, put_random
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tiercache import CacheConfig, PoolSpec, RowStore, TierCache
from tiercache.errors import ConfigError, RootError
from tiercache.files import (
    ARRAY,
    SUBDIRS,
    FileTier,
    IOPath,
    balanced_table,
    block_subdir,
    members_of,
    read_record,
    reshape,
    rootreshape,
)
from tiercache.files.rootdir import RootDir, RootPath
from tiercache.settings import sections

POOLS = (PoolSpec("kv", (8192,), "uint8"), PoolSpec("act", (1000,), "float32"))


def _cfg(roots, **kw):
    base = dict(pools=POOLS, host_slots=8, file_slots=400, fsync="none")
    base.update(kw)
    if isinstance(roots, (list, tuple)):
        return CacheConfig(roots=[str(r) for r in roots], **base)
    return CacheConfig(root=str(roots), **base)


def _files_per_root(roots) -> list[int]:
    return [sum(1 for s in SUBDIRS if (Path(r) / s).is_dir() for _ in (Path(r) / s).iterdir()) for r in roots]


def _owners(roots) -> dict[str, Path]:
    """Subdirectory -> the root whose record gives it that subdirectory."""
    out = {}
    for r in roots:
        with RootDir(r, check_owner=False) as rd:
            rec = read_record(rd)
        me = [m for m, _ in rec.members].index(rec.member)
        for i, name in enumerate(SUBDIRS):
            if rec.table[i] == me:
                assert name not in out
                out[name] = Path(r)
    assert len(out) == len(SUBDIRS)
    return out


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), st.data())
def test_balanced_table_evens_the_shares_and_moves_the_fewest(n_old, data):
    old = data.draw(st.lists(st.integers(0, n_old - 1), min_size=64, max_size=64))
    leaving = data.draw(st.sets(st.integers(0, n_old - 1), max_size=n_old - 1))
    added = data.draw(st.integers(0, 8))
    kept = [m for m in range(n_old) if m not in leaving]
    keep = [kept.index(m) if m in kept else -1 for m in range(n_old)]
    n_new = len(kept) + added
    new = balanced_table(old, n_old, keep, n_new)
    counts = Counter(new)
    assert set(counts) == set(range(n_new))
    assert max(counts.values()) - min(counts.values()) <= 1
    # the fewest moves: a kept member keeps min(held, share) of its subdirectories, and the
    # shares one above 64 // n go to the members that hold the most (no table moves fewer)
    base, extra = divmod(64, n_new)
    held = Counter(keep[t] for t in old if keep[t] >= 0)
    by_held = sorted(range(n_new), key=lambda m: -held[m])
    share = {m: base + (i < extra) for i, m in enumerate(by_held)}
    fewest = 64 - sum(min(held[m], share[m]) for m in range(n_new))
    moved = sum(1 for i in range(64) if keep[old[i]] != new[i])
    assert moved == fewest


def test_a_cache_spreads_blocks_over_its_roots_and_reopens_in_any_order(tmp_path, rng):
    roots = [tmp_path / f"dev{i}" for i in range(3)]
    keys = random_keys(rng, 240)
    with TierCache(_cfg(roots)) as c:
        want = put_random(c, keys, rng, tier="file")
        c.flush()
        assert c.stats()["tiers"]["file"]["roots"] == [str(r) for r in roots]
    owners = _owners(roots)
    for r in roots:  # every block file is in the root that owns its subdirectory
        for f in r.glob("*/block_*"):
            assert owners[f.parent.name] == r, f
    per = _files_per_root(roots)
    assert sum(per) == 2 * len(keys) and min(per) > 0.5 * max(per), per
    order = [roots[2], roots[0], roots[1]]
    with TierCache(_cfg(order)) as c:
        assert len(c.keys("file")) == len(keys)
        assert_bytes(c, want)


def test_an_open_refuses_missing_extra_and_single_members(tmp_path, rng):
    roots = [tmp_path / f"dev{i}" for i in range(3)]
    with TierCache(_cfg(roots)) as c:
        put_random(c, random_keys(rng, 20), rng, tier="file")
    with pytest.raises(RootError, match=f"{roots[2]}.* missing from the roots given"):
        TierCache(_cfg(roots[:2]))
    with pytest.raises(RootError, match="missing from the roots given"):
        TierCache(_cfg(roots[1]))  # one member alone, as a plain root
    with pytest.raises(RootError, match=f"{tmp_path / 'new'}.* not members of the root array.*roots add"):
        TierCache(_cfg(roots + [tmp_path / "new"]))
    # plain roots with blocks are never made an array silently
    plain = tmp_path / "plain"
    with TierCache(_cfg(plain)) as c:
        put_random(c, random_keys(rng, 5), rng, tier="file")
    with pytest.raises(RootError, match=f"{plain}.* hold blocks and are not part of a root array"):
        TierCache(_cfg([plain, tmp_path / "empty"]))
    assert not (plain / ARRAY).exists() and not (tmp_path / "empty" / ARRAY).exists()


def test_roots_setting_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="roots lists .* twice"):
        sections(roots=[str(tmp_path / "a"), str(tmp_path / "a")])
    with pytest.raises(ConfigError, match="1 .. 64"):
        sections(roots=[])
    with pytest.raises(ConfigError, match="must be a list"):
        sections(roots=str(tmp_path))
    with pytest.raises(ConfigError, match="is not one of roots"):
        sections(roots=[str(tmp_path / "a")], root=str(tmp_path / "b"))
    s = sections(roots=[str(tmp_path / "a"), str(tmp_path / "b")])["file"]
    assert s.root == tmp_path / "a" and s.all_roots == (tmp_path / "a", tmp_path / "b")


def test_add_then_remove_roots_moves_blocks_and_loses_none(tmp_path, rng):
    a, b, c, d = (tmp_path / n for n in "abcd")
    keys = random_keys(rng, 300)
    with TierCache(_cfg(a)) as cache:
        want = put_random(cache, keys, rng, tier="file")
    res = reshape([a], add=[b, c])
    assert res.after == [str(a), str(b), str(c)] and res.files_moved > 0
    assert sorted(map(str, members_of(b))) == sorted(map(str, [a, b, c]))
    per = _files_per_root([a, b, c])
    assert sum(per) == 2 * len(keys) and min(per) > 0.5 * max(per)
    with TierCache(_cfg([c, a, b])) as cache:
        assert_bytes(cache, want)
        more = put_random(cache, random_keys(rng, 40), rng, tier="file")
    want.update(more)
    res = reshape([a, b, c], add=[d], drop=[a])
    assert sorted(res.after) == sorted(map(str, [b, c, d]))
    assert not (a / ARRAY).exists() and _files_per_root([a]) == [0]
    with pytest.raises(RootError):
        TierCache(_cfg([a, b, c, d]))
    with TierCache(_cfg([b, c, d])) as cache:
        assert_bytes(cache, want)
    # down to one member: a plain root again
    reshape([b, c, d], drop=[c, d])
    assert not (b / ARRAY).exists()
    with TierCache(_cfg(b)) as cache:
        assert_bytes(cache, want)


def test_forget_drops_only_the_gone_members_blocks(tmp_path, rng):
    roots = [tmp_path / f"dev{i}" for i in range(3)]
    keys = random_keys(rng, 200)
    with TierCache(_cfg(roots)) as cache:
        want = put_random(cache, keys, rng, tier="file")
    owners = _owners(roots)
    import shutil
    shutil.rmtree(roots[1])  # the device is gone
    with pytest.raises(RootError, match="not reachable.*--forget"):
        reshape([roots[0], roots[2]])
    reshape([roots[0], roots[2]], forget=[roots[1]])
    kept = {k: v for k, v in want.items() if owners[block_subdir(k)] != roots[1]}
    assert 0 < len(kept) < len(want)
    with TierCache(_cfg([roots[0], roots[2]])) as cache:
        assert_bytes(cache, kept)
        lost = [k for k in want if k not in kept]
        assert lost and not any(k in cache for k in lost)


def test_an_interrupted_change_is_refused_then_finished_by_running_it_again(tmp_path, rng, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    keys = random_keys(rng, 200)
    with TierCache(_cfg(a)) as cache:
        want = put_random(cache, keys, rng, tier="file")
    real, moved = rootreshape._move_file, []

    def crash_after_some(src, dst, name):
        if len(moved) == 37:
            raise KeyboardInterrupt("killed")
        moved.append(name)
        real(src, dst, name)

    monkeypatch.setattr(rootreshape, "_move_file", crash_after_some)
    with pytest.raises(KeyboardInterrupt):
        reshape([a], add=[b])
    monkeypatch.setattr(rootreshape, "_move_file", real)
    for listed in ([a, b], [a]):
        with pytest.raises(RootError, match="interrupted.*run the same"):
            TierCache(_cfg(listed))
    reshape([a], add=[b])  # the same command again
    with TierCache(_cfg([a, b])) as cache:
        assert_bytes(cache, want)
    assert all(n > 0 for n in _files_per_root([a, b]))


def test_a_move_between_filesystems_copies_flushes_then_unlinks(tmp_path, rng, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    keys = random_keys(rng, 60)
    with TierCache(_cfg(a)) as cache:
        want = put_random(cache, keys, rng, tier="file")
    real = RootPath.rename

    def cross_device(self, dst):
        if self.dir_fd != dst.dir_fd and not self.name.startswith(".tmp"):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real(self, dst)

    synced = []
    monkeypatch.setattr(RootPath, "rename", cross_device)
    monkeypatch.setattr(os, "fdatasync", lambda fd, real=os.fdatasync: (synced.append(fd), real(fd)))
    res = reshape([a], add=[b])
    monkeypatch.undo()
    assert res.files_moved > 0 and len(synced) >= res.files_moved
    assert not [p for p in b.rglob(".tmp*")] and not [p for p in a.rglob(".tmp*")]
    with TierCache(_cfg([a, b])) as cache:
        assert_bytes(cache, want)


def test_two_processes_opening_fresh_roots_at_once_make_one_array(tmp_path):
    roots = [str(tmp_path / f"dev{i}") for i in range(4)]
    s = sections(roots=roots, sharing="shared", io_engine="python", io_threads=2)
    tiers, errors = [], []

    def open_one(order):
        try:
            fs = s["file"].replace(roots=tuple(order), root=None)
            tiers.append(FileTier(POOLS, 100, IOPath("posix", "test"), fs, s["sharing"]))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_one, args=(roots[::step],)) for step in (1, -1, 1, -1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    ids = {read_record(t.dir.home).array_id for t in tiers}
    assert len(ids) == 1
    for t in tiers:
        t.close()


def test_rowstore_over_a_root_array(tmp_path, rng):
    roots = [tmp_path / "d0", tmp_path / "d1"]
    n, row = 64, 8192
    rows = rng.integers(0, 256, (n, row), dtype=np.uint8)
    keys = [rng.bytes(16) for _ in range(n)]
    with RowStore(rows, roots, capacity_blocks=4 * n) as st:
        st.submit_store(keys, list(range(n)))
        assert st.drain(30) and all(r.success for r in st.finished())
        assert st.stats()["tiers"]["file"]["roots"] == [str(r) for r in roots]
    assert all(c > 0 for c in _files_per_root(roots))
    out = np.zeros_like(rows)
    with RowStore(out, roots[::-1], capacity_blocks=4 * n) as st:
        assert len(st) == n
        st.submit_load(keys, list(range(n)))
        assert st.drain(30) and all(r.success for r in st.finished())
    assert np.array_equal(out, rows)
    with pytest.raises(RootError, match="missing from the roots given"):
        RowStore(out, roots[0], capacity_blocks=4 * n)


def test_cli_roots_show_add_remove_and_verify_over_the_array(tmp_path, rng):
    from cli.app import app

    runner = CliRunner()
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    with TierCache(_cfg(a)) as cache:
        put_random(cache, random_keys(rng, 80), rng, tier="file")
    r = runner.invoke(app, ["roots", "add", str(a), "--new", str(b), "--new", str(c)])
    assert r.exit_code == 2 and "do not exist" in r.output  # a mistyped path is never created
    assert not b.exists() and not c.exists() and not (a / ARRAY).exists()
    b.mkdir(mode=0o700)
    c.mkdir(mode=0o700)
    r = runner.invoke(app, ["roots", "add", str(a), "--new", str(b), "--new", str(c)])
    assert r.exit_code == 0, r.output
    assert "moved" in r.output
    r = runner.invoke(app, ["roots", "show", str(c), "--json"])
    shown = json.loads(r.output)
    assert [m["root"] for m in shown["members"]] == [str(a), str(b), str(c)]
    assert sum(m["blocks"] for m in shown["members"]) == 80 and sum(m["subdirs"] for m in shown["members"]) == 64
    r = runner.invoke(app, ["verify", "--root", str(b), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["checked"] == 160
    victim = sorted(c.glob("*/block_*_pool_kv.bin"))[0]
    with open(victim, "r+b") as f:
        f.seek(5000)
        f.write(b"\xff" * 8)
    r = runner.invoke(app, ["verify", "--root", str(a)])
    assert r.exit_code == 1 and victim.name in r.output and "1 bad" in r.output
    r = runner.invoke(app, ["roots", "remove", str(a), "--drop", str(c)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["roots", "show", str(a), "--json"])
    assert [m["root"] for m in json.loads(r.output)["members"]] == [str(a), str(b)]
    r = runner.invoke(app, ["verify", "--root", str(a), "--json"])
    assert r.exit_code == 1 and len(json.loads(r.output)["bad"]) == 1  # the bad file moved with its subdirectory
    r = runner.invoke(app, ["purge", "--root", str(b), "--yes"])
    assert r.exit_code == 0, r.output
    assert _files_per_root([a, b]) == [0, 0]


def test_processes_opening_one_new_root_at_once_all_succeed(tmp_path):
    """Each opener may find the directory holding only another's marker being written or its
    lock file: still a new root of tiercache's, never "not empty and not ours"."""
    for attempt in range(5):
        s = sections(root=str(tmp_path / f"fresh{attempt}"), sharing="shared", io_engine="python", io_threads=2)
        tiers, errors = [], []

        def open_one():
            try:
                tiers.append(FileTier(POOLS, 100, IOPath("posix", "test"), s["file"], s["sharing"]))
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=open_one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for t in tiers:
            t.close()


def test_top_reads_the_array_stats_from_any_member(tmp_path, rng):
    pytest.importorskip("prometheus_client")
    from cli.top_cmd import read_root

    roots = [tmp_path / f"dev{i}" for i in range(3)]
    with TierCache(_cfg(roots)) as c:
        put_random(c, random_keys(rng, 30), rng, tier="file")
        c.flush()
    for member in roots:  # the stats live in the home (the first member); any member finds them
        fams, age = read_root(member)
        assert fams and age is not None and age < 60


def test_an_opener_that_lists_a_new_root_after_another_finished_opening_it_takes_it(tmp_path, monkeypatch):
    """The race behind "not empty and has no marker": this opener found no marker, then another
    opener wrote its marker and made the block subdirectories before this one listed the root."""
    from tiercache.files import rootdir

    where = tmp_path / "fresh"
    real, raced = RootDir.scandir, []

    def other_opener_finishes_first(self):
        if self.path == where and not raced:
            raced.append(True)
            other = rootdir.open_root(where)
            other.block_dirs(create=True)
            other.close()
        return real(self)

    monkeypatch.setattr(RootDir, "scandir", other_opener_finishes_first)
    rootdir.open_root(where).close()
    assert raced
