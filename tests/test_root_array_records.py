"""A root array's records are as untrusted as any file in a root: a crafted record never leads
a command outside its array; members prove membership by their own records; damaged records
are refused with a clear error; openers that spell the members differently agree; a full
member fails only its own writes and moves."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from conftest import random_keys
from helpers import assert_bytes, put_random
from typer.testing import CliRunner

from tiercache import CacheConfig, PoolSpec, TierCache
from tiercache.errors import RootError, TransferError
from tiercache.files import ARRAY, SUBDIRS, FileTier, IOPath, block_subdir, member_states, read_record, subdir_owner
from tiercache.files.rootdir import RootDir
from tiercache.settings import sections

POOLS = (PoolSpec("kv", (8192,), "uint8"), PoolSpec("act", (100,), "float32"))


def _cfg(roots, **kw) -> CacheConfig:
    base = dict(pools=POOLS, host_slots=64, file_slots=400, fsync="none", metrics_registry="none",
                metrics_snapshot_s=0)
    base.update(kw)
    if isinstance(roots, (list, tuple)):
        return CacheConfig(roots=[str(r) for r in roots], **base)
    return CacheConfig(root=str(roots), **base)


def _app():
    from cli.app import app
    return app


def _block_files(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("block_*"))}


def _record(root: Path) -> dict:
    return json.loads((root / ARRAY).read_text())


def _write_record(root: Path, rec) -> None:
    (root / ARRAY).write_text(rec if isinstance(rec, str) else json.dumps(rec))


@pytest.fixture
def crafted(tmp_path, rng):
    """An array [r, w] holding blocks, and a plain root v holding blocks of its own."""
    r, w, v = tmp_path / "r", tmp_path / "w", tmp_path / "v"
    with TierCache(_cfg([r, w])) as c:
        put_random(c, random_keys(rng, 40), rng, tier="file")
    with TierCache(_cfg(v)) as c:
        put_random(c, random_keys(rng, 10), rng, tier="file")
    return r, w, v


def test_a_record_naming_another_root_never_makes_commands_act_there(crafted):
    r, w, v = crafted
    rec = _record(r)
    w_id = next(i for i, p in rec["members"] if p == str(w))
    rec["members"] = [[i, str(v) if i == w_id else p] for i, p in rec["members"]]
    _write_record(r, rec)
    before_v, before_w = _block_files(v), _block_files(w)
    runner = CliRunner()
    res = runner.invoke(_app(), ["purge", "--root", str(r), "--yes"])
    assert res.exit_code == 2 and str(v) in res.output and "do not prove" in res.output, res.output
    res = runner.invoke(_app(), ["verify", "--root", str(r)])
    assert res.exit_code == 2 and str(v) in res.output
    res = runner.invoke(_app(), ["roots", "show", str(r), "--json"])
    shown = json.loads(res.stdout)
    assert res.exit_code == 1 and {m["root"]: m["state"] for m in shown["members"]}[str(v)] == "unproven"
    assert "blocks" not in next(m for m in shown["members"] if m["root"] == str(v))  # not looked into
    res = runner.invoke(_app(), ["inspect", "--root", str(r), "--json"])
    assert res.exit_code in (0, 1) and "unproven" in res.stdout
    res = runner.invoke(_app(), ["roots", "add", str(r), "--new", str(w)])
    assert res.exit_code == 2
    assert _block_files(v) == before_v and _block_files(w) == before_w
    assert read_record(RootDir(v, check_owner=False)) is None


def test_a_record_naming_a_path_elsewhere_creates_nothing_there(crafted, tmp_path):
    r, w, _ = crafted
    elsewhere = tmp_path / "elsewhere" / "deep" / "x"
    rec = _record(r)
    rec["members"] = [[i, str(elsewhere) if p == str(w) else p] for i, p in rec["members"]]
    _write_record(r, rec)
    new = tmp_path / "new"
    new.mkdir(mode=0o700)
    for argv in (["roots", "add", str(r), "--new", str(new)], ["roots", "remove", str(r), "--drop", str(elsewhere)],
                 ["purge", "--root", str(r), "--yes"], ["verify", "--root", str(r)]):
        res = CliRunner().invoke(_app(), argv)
        assert res.exit_code == 2, (argv, res.output)
        assert not (tmp_path / "elsewhere").exists(), argv
    _, states = member_states(r)
    assert [s.state for s in states] == ["here", "missing"]


@pytest.mark.parametrize("path", ["", "relative/dir", "."])
def test_a_member_path_that_is_empty_or_relative_is_never_read(crafted, tmp_path, path, monkeypatch):
    r, w, _ = crafted
    monkeypatch.chdir(w)  # the current directory holds blocks: a bad path must not lead there
    rec = _record(r)
    rec["members"] = [[i, path if p == str(w) else p] for i, p in rec["members"]]
    _write_record(r, rec)
    before = _block_files(w)
    res = CliRunner().invoke(_app(), ["verify", "--root", str(r), "--json"])
    assert res.exit_code == 2, res.output
    assert ("damaged" in res.output) if path == "" else ("relative path" in res.output), res.output
    res = CliRunner().invoke(_app(), ["purge", "--root", str(r), "--yes"])
    assert res.exit_code == 2 and _block_files(w) == before


@pytest.mark.parametrize("text", ["[]", "1", '"x"', "null", "{}", '{"format": 1, "array": "x"}',
                                  "not json", '{"format": 1, "members": [[1, 2]]}'])
def test_a_record_that_is_not_a_record_is_refused_with_a_clear_error(tmp_path, rng, text):
    a, b = tmp_path / "a", tmp_path / "b"
    with TierCache(_cfg([a, b])) as c:
        put_random(c, random_keys(rng, 8), rng, tier="file")
    good = _record(a)
    _write_record(a, text)
    with pytest.raises(RootError, match="damaged"):
        TierCache(_cfg([a, b]))
    for argv in (["verify", "--root", str(a)], ["roots", "show", str(a)], ["purge", "--root", str(a), "--yes"],
                 ["roots", "add", str(a), "--new", str(tmp_path)]):
        res = CliRunner().invoke(_app(), argv)
        assert res.exit_code == 2 and "damaged" in res.output and "Traceback" not in res.output, (argv, res.output)
    _write_record(a, good)
    with TierCache(_cfg([a, b])) as c:
        assert len(c.keys("file")) == 8


def test_decode_checks_every_field(tmp_path, rng):
    a, b = tmp_path / "a", tmp_path / "b"
    with TierCache(_cfg([a, b])):
        pass
    good = _record(a)
    bad = [
        {**good, "table": good["table"][:-1]},
        {**good, "table": [0] * 63 + [2]},
        {**good, "table": [True] * 64},
        {**good, "generation": -1},
        {**good, "generation": "1"},
        {**good, "member": "0" * 32},
        {**good, "members": good["members"] + [good["members"][0]]},
        {**good, "members": [[good["members"][0][0], "/x\x00y"], good["members"][1]]},
        {**good, "moving": []},
        {**good, "moving": {"members": good["members"], "table": good["table"], "gone": ["f" * 32]}},
        {**good, "array": "../etc"},
    ]
    for rec in bad:
        _write_record(a, rec)
        with pytest.raises(RootError, match="damaged|not among"):
            read_record(RootDir(a, check_owner=False))


def test_openers_that_spell_the_members_differently_agree_on_one_array(tmp_path):
    """Symlinks, ``..`` and another order name the same directories: every opener takes the
    same locks (by device and inode) and finds or makes the same array."""
    for attempt in range(6):
        base = tmp_path / f"try{attempt}"
        (base / "x").mkdir(parents=True)
        roots = [base / f"dev{i}" for i in range(3)]
        for r in roots:
            r.mkdir(mode=0o700)
        os.symlink(roots[0], base / "link0")
        spellings = [roots, [base / "x" / ".." / "dev2", base / "link0", roots[1]],
                     [base / "link0", roots[2], base / "x" / ".." / "dev1"], roots[::-1]]
        tiers, errors = [], []

        def open_one(order):
            try:
                s = sections(roots=[str(p) for p in order], sharing="shared", io_engine="python", io_threads=2)
                tiers.append(FileTier(POOLS, 100, IOPath("posix", "test"), s["file"], s["sharing"]))
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=open_one, args=(o,)) for o in spellings * 2]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        recs = [read_record(RootDir(r, check_owner=False)) for r in roots]
        assert len({r.array_id for r in recs}) == 1 and len({r.member for r in recs}) == 3
        assert len({(r.members, r.table) for r in recs}) == 1
        for t in tiers:
            t.close()


def _mount_tmpfs(where: Path, size: str) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small file system needs root and mount(8)")
    where.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {res.stderr.strip()}")


@pytest.fixture
def small_fs(tmp_path):
    where = tmp_path / "small"
    _mount_tmpfs(where, "256k")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_member_fails_only_its_own_writes_and_loses_no_block(tmp_path, rng, small_fs):
    big = tmp_path / "big"
    roots = [big, small_fs]
    keys = random_keys(rng, 120)
    with TierCache(_cfg(roots, host_slots=200)) as c:
        want = put_random(c, keys, rng, tier="host")
        owned = subdir_owner(small_fs)
        on_small = [k for k in keys if owned[block_subdir(k)]]
        assert 30 < len(on_small) < 90
        failed = []
        for i in range(0, len(keys), 8):
            batch = keys[i:i + 8]
            try:
                c.offload(batch, to="file")
            except TransferError as exc:
                failed.append((batch, exc))
        assert failed and all("No space" in str(e) or "ENOSPC" in str(e) or "space" in str(e) for _, e in failed)
        in_files = set(c.keys("file"))
        assert {k for k in keys if not owned[block_subdir(k)]} <= in_files  # the big member took all of its own
        assert in_files & set(on_small) != set(on_small)
        assert_bytes(c, want)  # every block still readable (a failed offload keeps the source)
        assert not [p for p in small_fs.rglob(".tmp*")]
    with TierCache(_cfg(roots)) as c:
        assert set(c.keys("file")) == in_files
        assert_bytes(c, {k: want[k] for k in in_files})


def test_a_move_onto_a_full_member_stops_cleanly_and_finishes_once_there_is_room(tmp_path, rng, small_fs):
    src = tmp_path / "src"
    keys = random_keys(rng, 120)
    with TierCache(_cfg(src, host_slots=200)) as c:
        want = put_random(c, keys, rng, tier="file")
    argv = ["roots", "add", str(src), "--new", str(small_fs)]
    res = CliRunner().invoke(_app(), argv)
    assert res.exit_code == 2 and "run the same command again" in res.output, res.output
    assert "Traceback" not in res.output
    assert not [p for p in small_fs.rglob(".tmp*")] and not [p for p in src.rglob(".tmp*")]
    with pytest.raises(RootError, match="interrupted"):
        TierCache(_cfg([src, small_fs]))
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_fs)], check=True)
    res = CliRunner().invoke(_app(), argv)
    assert res.exit_code == 0 and "finished a change" in res.output, res.output
    with TierCache(_cfg([src, small_fs])) as c:
        assert len(c.keys("file")) == len(keys)
        assert_bytes(c, want)
    assert sum(1 for _ in small_fs.rglob("block_*")) > 0


def test_cli_says_what_is_true(tmp_path, rng):
    runner = CliRunner()
    res = runner.invoke(_app(), ["roots", "show", "/etc"])
    assert res.exit_code == 2 and "not a tiercache root" in res.output
    parent = tmp_path / "parent"
    root = parent / "bench-1-2"
    with TierCache(_cfg(root)) as c:
        put_random(c, random_keys(rng, 4), rng, tier="file")
    res = runner.invoke(_app(), ["roots", "show", str(parent)])
    assert res.exit_code == 2 and str(root) in res.output and "give one of them" in res.output
    res = runner.invoke(_app(), ["purge", "--root", str(parent), "--yes"])
    assert res.exit_code == 2, res.output
    msg = " ".join(res.output.split())
    assert "is not a tiercache root itself" in msg and str(root) in msg and "did not create" not in msg
    assert msg.endswith("nothing was deleted"), msg
    res = runner.invoke(_app(), ["purge", "--root", str(root)], input="n\n")
    assert res.exit_code == 0 and "nothing deleted" in res.output  # a deliberate no is not an error
    assert len(list(root.rglob("block_*"))) == 8
    res = runner.invoke(_app(), ["purge", "--root", str(root)], input="")
    assert res.exit_code == 2 and "no answer" in res.output
    for extra in ([], ["--yes"]):
        res = runner.invoke(_app(), ["purge", "--root", str(root), "--pool", "nosuch", *extra])
        assert res.exit_code == 0 and "no block file of pool(s) nosuch" in res.output and "act, kv" in res.output
    assert len(list(root.rglob("block_*"))) == 8
    res = runner.invoke(_app(), ["top", "--root", str(tmp_path / "nope"), "--frames", "1"])
    assert res.exit_code == 2 and res.output.count(str(tmp_path / "nope")) == 1, res.output
    res = runner.invoke(_app(), ["roots", "add", str(root), "--new", str(tmp_path / "mistyped" / "path")])
    assert res.exit_code == 2 and not (tmp_path / "mistyped").exists()


def test_member_states_during_an_interrupted_change_include_the_leaving_members(tmp_path, rng, monkeypatch):
    from tiercache.files import reshape, rootreshape

    m = [tmp_path / f"m{i}" for i in range(3)]
    with TierCache(_cfg(m)) as c:
        want = put_random(c, random_keys(rng, 64), rng, tier="file")

    def killed(*a, **k):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(rootreshape._Change, "_move", killed)
    with pytest.raises(KeyboardInterrupt):
        reshape([m[0], m[1]], drop=[m[2]])
    monkeypatch.undo()
    _, states = member_states(m[0])
    assert [(s.path, s.state, s.leaving) for s in states] == [(m[0], "here", False), (m[1], "proven", False),
                                                              (m[2], "proven", True)]
    res = CliRunner().invoke(_app(), ["roots", "remove", str(m[0]), "--drop", str(m[2])])
    assert res.exit_code == 0, res.output
    assert not (m[2] / ARRAY).exists() and not list(m[2].rglob("block_*"))
    with TierCache(_cfg(m[:2])) as c:
        assert len(c.keys("file")) == 64
        assert_bytes(c, want)
    assert len(SUBDIRS) == 64
