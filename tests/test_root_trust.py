"""The root is a trust boundary: symlinks, odd names and races never reach outside it.

One test per defect found when the root was attacked (each failed before the fix), then a
fuzz-style test: random trees of files, directories and symlinks, inside the root and out, put
under a root, then every command run on it; nothing outside the root is read, written, moved or
deleted, nothing raises a traceback, and no wrong block is served.
"""

from __future__ import annotations

import json
import os
import shutil
import stat

import numpy as np
import pytest
from conftest import bpath, drop_index, files, names, random_keys
from helpers import assert_bytes, put_random
from typer.testing import CliRunner

from tiercache import ArrayMismatchError, CacheConfig, ConfigError, PoolSpec, RootError, TierCache, TierFullError
from tiercache.cli import app
from tiercache.config import config_from_dict
from tiercache.cuda import cuda_status
from tiercache.errors import TransferError
from tiercache.files import SUBDIRS, FileTier, block_filename, block_subdir
from tiercache.files.nativeio import native_status

runner = CliRunner()


def tree(path) -> dict:
    """Everything under ``path`` (symlinks not followed): relative name -> (kind, bytes or
    link target, mode, mtime_ns)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                what = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                what = ("dir", None)
            else:
                with open(p, "rb") as f:
                    what = ("file", f.read())
            out[os.path.relpath(p, path)] = (*what, stat.S_IMODE(st.st_mode), st.st_mtime_ns)
    return out


@pytest.fixture
def outside(tmp_path):
    """A directory beside the root with files a user cares about."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "precious.txt").write_text("user data")
    (d / "block_1_pool_kv.bin").write_bytes(b"not a block")
    (d / "x").write_text("12345")
    return d


@pytest.fixture
def flushed(make_config, rng):
    """A closed root holding 4 flushed blocks; returns ``(config, {key: {pool: bytes}})``."""
    cfg = make_config(host_slots=8)
    with TierCache(cfg) as c:
        exp = put_random(c, random_keys(rng, 4, "int"), rng)
        c.flush()
    return cfg, exp


def one_line_error(res, code=2) -> str:
    assert res.exit_code == code, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    return lines[0]


# -- 1. symlinked quarantine/ ------------------------------------------------------------------
def test_purge_never_deletes_through_a_symlinked_quarantine(flushed, outside):
    cfg, _ = flushed
    before = tree(outside)
    (cfg.root / "quarantine").symlink_to(outside)
    res = runner.invoke(app, ["purge", "--root", str(cfg.root), "--yes"])
    assert res.exit_code == 0, res.output
    assert "left alone" in res.output and "symlink" in res.output
    assert tree(outside) == before
    assert not list(files(cfg.root, "block_*"))  # the root's own blocks went


def test_quarantine_through_a_symlink_is_refused_not_followed(flushed, outside, rng):
    cfg, exp = flushed
    victim = next(iter(exp))
    bad = bpath(cfg.root, victim, "act")
    with open(bad, "r+b") as f:
        f.seek(4096)
        f.write(b"\x00\x01\x02")
    (cfg.root / "quarantine").symlink_to(outside)
    before = tree(outside)
    with pytest.raises(RootError, match="quarantine.*symlink"):
        TierCache(cfg)  # the reopen scan would move the bad file out of the root
    line = one_line_error(runner.invoke(app, ["verify", "--root", str(cfg.root), "--quarantine"]))
    assert "symlink" in line
    assert tree(outside) == before and bad.is_file()


def test_quarantine_never_replaces_what_is_already_there(flushed, rng):
    """A second bad entry under a name already in quarantine/ (a directory in place of a
    block file, where a file of that name was quarantined before) gets a suffixed name; the
    earlier evidence stays, and verify reports instead of failing."""
    cfg, exp = flushed
    victim = bpath(cfg.root, list(exp)[int(rng.integers(len(exp)))], "kv")
    with open(victim, "r+b") as f:
        f.seek(4096)
        f.write(rng.bytes(16))
    first = victim.read_bytes()
    res = runner.invoke(app, ["verify", "--root", str(cfg.root), "--quarantine"])
    assert res.exit_code == 1 and "1 moved to quarantine/" in res.output, res.output
    for n in (1, 2):
        victim.mkdir()
        (victim / "inner").write_text(str(n))
        res = runner.invoke(app, ["verify", "--root", str(cfg.root), "--quarantine", "--json"])
        assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output  # a finding, not a crash
        assert json.loads(res.stdout)["quarantined"] >= 1 and not victim.exists()
    q = cfg.root / "quarantine"
    assert (q / victim.name).read_bytes() == first
    assert [(q / f"{victim.name}.{n}" / "inner").read_text() for n in (1, 2)] == ["1", "2"]


# -- 2. symlinked lock ----------------------------------------------------------------------------
def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(flushed, outside):
    cfg, _ = flushed
    target = outside / "x"
    lock = cfg.root / ".tiercache-root.lock"
    lock.unlink()
    lock.symlink_to(target)
    before = tree(outside)
    with pytest.raises(RootError, match="lock.*not a regular file"):
        TierCache(cfg)
    res = runner.invoke(app, ["verify", "--root", str(cfg.root), "--quarantine"])
    assert "not a regular file" in one_line_error(res)
    res = runner.invoke(app, ["purge", "--root", str(cfg.root), "--yes"])
    assert "not a regular file" in one_line_error(res)
    assert tree(outside) == before and target.read_text() == "12345"


def test_a_hard_linked_lock_file_is_refused(flushed, tmp_path):
    cfg, _ = flushed
    other = tmp_path / "elsewhere.txt"
    other.write_text("keep")
    lock = cfg.root / ".tiercache-root.lock"
    lock.unlink()
    os.link(other, lock)
    with pytest.raises(RootError, match="hard links"):
        TierCache(cfg)
    assert other.read_text() == "keep"


# -- 3. purge holds the lock; the scan survives files vanishing ------------------------------------
def test_purge_holds_the_root_lock_while_deleting(flushed, monkeypatch):
    cfg, _ = flushed
    from tiercache.files import RootPath

    seen = []
    real = RootPath.unlink

    def unlink(self):
        if not seen:
            try:
                TierCache(cfg).close()
                seen.append(None)
            except RootError as exc:
                seen.append(exc)
        return real(self)

    monkeypatch.setattr(RootPath, "unlink", unlink)
    res = runner.invoke(app, ["purge", "--root", str(cfg.root), "--yes"])
    assert res.exit_code == 0, res.output
    assert isinstance(seen[0], RootError) and "in use" in str(seen[0])


def test_scan_survives_a_file_removed_while_it_looks(flushed, monkeypatch):
    cfg, exp = flushed
    gone = next(iter(exp))
    real = FileTier._check_file

    def check_then_vanish(self, key, pool, path):
        out = real(self, key, pool, path)
        if key == gone:
            os.unlink(path)
        return out

    monkeypatch.setattr(FileTier, "_check_file", check_then_vanish)
    drop_index(cfg.root)
    with TierCache(cfg) as c:
        assert gone not in c and gone in c.scan.incomplete
        assert_bytes(c, {k: v for k, v in exp.items() if k != gone})


# -- 4. non-canonical names never shadow a block ------------------------------------------------
def test_non_canonical_names_do_not_shadow_valid_blocks(make_config, rng):
    cfg = make_config(host_slots=8)
    with TierCache(cfg) as c:
        exp = put_random(c, [12, 16], rng)
        c.flush()
    (cfg.root / "block_00012_pool_kv.bin").write_bytes(b"junk")
    (cfg.root / "block_\u0661\u0662_pool_kv.bin").write_bytes(b"junk")
    (cfg.root / "block_12_pool_kv.bin\n").write_bytes(b"junk")
    shutil.copy(bpath(cfg.root, 16, "kv"), cfg.root / "block_016_pool_kv.bin")
    drop_index(cfg.root)
    with TierCache(cfg) as c:
        assert set(c.keys()) == {12, 16}
        assert_bytes(c, exp)
        assert "block_016_pool_kv.bin" in c.scan.foreign
    res = runner.invoke(app, ["verify", "--root", str(cfg.root), "--json"])
    assert res.exit_code == 1
    bad = {b["file"] for b in json.loads(res.stdout)["bad"]}
    assert {"block_016_pool_kv.bin", "block_00012_pool_kv.bin", "block_\u0661\u0662_pool_kv.bin"} <= bad


# -- 5. directories and user files under tiercache's names -----------------------------------------
def test_odd_entries_under_our_names_are_left_alone(make_config, rng):
    cfg = make_config(host_slots=8)
    with TierCache(cfg) as c:
        put_random(c, [3], rng)
        c.flush()
    (cfg.root / ".tmp.somedir").mkdir()
    (cfg.root / ".tmp.userfile").write_text("mine")
    bpath(cfg.root, 25, "kv").mkdir()
    with TierCache(cfg) as c:
        assert (cfg.root / ".tmp.somedir").is_dir() and (cfg.root / ".tmp.userfile").read_text() == "mine"
        exp = put_random(c, [25], rng)
        with pytest.raises(TransferError) as ei:
            c.offload([25], to="file")
        assert ei.value.failed_keys == [25] and 25 in c.keys("host")
        assert_bytes(c, exp)
        c.evict([25])  # no raw IsADirectoryError: the directory is not ours
        assert 25 not in c
    assert bpath(cfg.root, 25, "kv").is_dir()


# -- 6. purge decides what is ours by the header ---------------------------------------------------
def test_purge_deletes_only_files_with_tiercache_headers(flushed, rng, tmp_path):
    cfg, _ = flushed
    junk = ["block_30_pool_other.bin", "block_00012_pool_kv.bin", "block_\u0661\u0662_pool_kv.bin",
            block_filename(7, "kv")]
    for name in junk:
        (cfg.root / name).write_bytes(b"user bytes" * 100)
    # a real block file of a pool this config lacks is tiercache's: purge may delete it
    other = CacheConfig(pools=(PoolSpec("other", (64,), "uint8"),), host_slots=2, file_slots=4,
                        root=tmp_path / "other", fsync="none")
    with TierCache(other) as c:
        c.put([31], np.ones((1, 64), np.uint8))
        c.flush()
    shutil.copy(bpath(other.root, 31, "other"), bpath(cfg.root, 31, "other"))
    res = runner.invoke(app, ["purge", "--root", str(cfg.root), "--yes"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in files(cfg.root, "block_*")) == sorted(junk)


# -- 7. validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [[2.7, 4], [True, 4], "12", [4, "5"], []])
def test_block_shapes_must_be_integers(shape):
    with pytest.raises(ConfigError, match="block_shape"):
        PoolSpec("p", shape, "uint8")
    if isinstance(shape, list):
        with pytest.raises(ConfigError, match="block_shape"):
            config_from_dict({"tiers": {"host_slots": 1}, "pools": {"p": {"block_shape": shape, "dtype": "uint8"}}})


@pytest.mark.parametrize("name", ["kv\n", "kv/../x", "k\u0131v", "", "-kv"])
def test_pool_names_are_plain_ascii(name):
    with pytest.raises(ConfigError, match="pool name"):
        PoolSpec(name, (4,), "uint8")


@pytest.mark.parametrize("toml, fragment", [
    ('[tiers]\nhost_slots = 4\nfile_slots = 8\n[pools.kv]\nblock_shape = [100000, 100000, 100000, 100000]\n'
     'dtype = "uint8"\n', "at most"),
    ('[tiers]\nhost_slots = 2000000\nfile_slots = 8\n[pools.kv]\nblock_shape = [1048576]\ndtype = "uint8"\n',
     "GiB"),
])
def test_oversized_configs_are_one_line_errors(tmp_path, toml, fragment):
    p = tmp_path / "big.toml"
    p.write_text(toml + f'[file]\nroot = "{tmp_path / "root"}"\n')
    line = one_line_error(runner.invoke(app, ["bench", "--config", str(p)]))
    assert fragment in line and line.startswith("tiercache: error:")


# -- 8. messages -----------------------------------------------------------------------------------
def test_raw_bytes_of_the_wrong_shape_name_the_shape(make_config):
    pool = PoolSpec("kv", (8, 4), "float16")
    with TierCache(make_config(pools=(pool,))) as c:
        with pytest.raises(ArrayMismatchError, match=r"shape \(3, 32\).*\(3, 64\)"):
            c.put([1, 2, 3], np.zeros((3, 32), np.uint8) + 1)


def test_keys_out_of_range_say_so(flushed):
    cfg, _ = flushed
    line = one_line_error(runner.invoke(app, ["purge", "--root", str(cfg.root), "--keys", "99999999999999999999",
                                              "--yes"]))
    assert "out of range" in line and "2**63" in line


def test_tier_full_messages_name_the_real_cause(make_config, rng):
    with TierCache(make_config(host_slots=4, file_slots=0)) as c:
        put_random(c, random_keys(rng, 2), rng)  # two blocks that could leave: still too few slots
        with pytest.raises(TierFullError, match="host tier has 4 slots; 6 needed"):
            put_random(c, random_keys(rng, 6), rng)
        c.evict(c.keys())
        keys = random_keys(rng, 4, "int")
        put_random(c, keys, rng)
        c.pin(keys[1:2])
        c.pin(keys[::2])
        with pytest.raises(TierFullError) as ei:
            put_random(c, random_keys(rng, 3), rng)
        msg = str(ei.value)
        assert "3 block(s) are pinned" in msg and f"e.g. key {keys[0]}" in msg


def test_get_into_a_read_only_array_is_an_array_mismatch(make_config, rng):
    with TierCache(make_config()) as c:
        put_random(c, [5], rng)
        out = np.empty((1, c.config.pools[0].block_nbytes), np.uint8)
        out.flags.writeable = False
        with pytest.raises(ArrayMismatchError, match="read-only"):
            c.get([5], pool=c.config.pools[0].name, out=out)


# -- 9. verify is exact; symlinked blocks are never served ---------------------------------------
def test_verify_finds_trailing_bytes_and_symlinked_blocks(flushed, outside):
    cfg, exp = flushed
    a, b = list(exp)[:2]
    with open(bpath(cfg.root, a, "kv"), "ab") as f:
        f.write(os.urandom(5000))
    copy = outside / "valid-copy.bin"
    shutil.move(bpath(cfg.root, b, "kv"), copy)
    (bpath(cfg.root, b, "kv")).symlink_to(copy)
    res = runner.invoke(app, ["verify", "--root", str(cfg.root), "--json"])
    assert res.exit_code == 1
    problems = {x["file"]: x["problem"] for x in json.loads(res.stdout)["bad"]}
    assert "trailing bytes" in problems[block_filename(a, "kv")]
    assert "not a regular file" in problems[block_filename(b, "kv")]
    before = tree(outside)
    drop_index(cfg.root)
    with TierCache(cfg) as c:
        assert a not in c and b not in c  # neither is served
        assert_bytes(c, {k: v for k, v in exp.items() if k not in (a, b)})
    assert tree(outside) == before


def _symlink_block_8(c, cfg, rng, outside):
    """Blocks 8 and 9 in files; block 8's file then replaced by a symlink to a copy of it
    outside the root. Returns (the blocks' bytes, block 8's file name)."""
    exp = put_random(c, [8, 9], rng)
    c.offload([8, 9], to="file")
    name = block_filename(8, "kv")
    shutil.copy(bpath(cfg.root, 8, "kv"), outside / "copy.bin")
    bpath(cfg.root, 8, "kv").unlink()
    bpath(cfg.root, 8, "kv").symlink_to(outside / "copy.bin")
    return exp, name


def test_a_block_replaced_by_a_symlink_at_run_time_is_not_followed(make_config, rng, outside):
    """Without held descriptors the read finds the symlink and refuses it."""
    cfg = make_config(host_slots=4, open_files=0)
    with TierCache(cfg) as c:
        exp, name = _symlink_block_8(c, cfg, rng, outside)
        before = tree(outside)
        with pytest.raises(TransferError, match="not a regular file") as ei:
            c.onboard([8, 9])
        assert ei.value.failed_keys == [8] and 8 not in c
        assert_bytes(c, {9: exp[9]})
        assert (cfg.root / "quarantine" / name).is_symlink()  # the link moved, its target did not
        assert tree(outside) == before


@pytest.mark.skipif(not native_status()[0], reason="held descriptors need the native I/O engine")
def test_a_held_block_replaced_by_a_symlink_is_neither_followed_nor_swapped(make_config, rng, outside):
    """With held descriptors (the default) the tier reads the file it published, not the
    name: the symlink is never opened. The next write of the block does not swap the symlink
    into a free file (only a regular file is exchanged): it replaces the link, and the target
    outside is untouched throughout."""
    cfg = make_config(host_slots=4)
    with TierCache(cfg) as c:
        exp, name = _symlink_block_8(c, cfg, rng, outside)
        before = tree(outside)
        c.onboard([8, 9])
        assert_bytes(c, exp)
        new = put_random(c, [8], rng)
        c.offload([8], to="file")
        assert bpath(cfg.root, 8, "kv").is_file() and not bpath(cfg.root, 8, "kv").is_symlink()
        assert not [n for n in names(cfg.root) if n.startswith(".tmp.")]  # the link is not kept as a free file
        assert tree(outside) == before
        c.onboard([8])
        assert_bytes(c, {8: new[8], 9: exp[9]})
    assert tree(outside) == before


# -- 10. ownership ---------------------------------------------------------------------------------
def test_a_root_writable_by_others_is_refused_unless_allowed(make_config, rng):
    cfg = make_config()
    cfg.root.mkdir()
    os.chmod(cfg.root, 0o777)
    with pytest.raises(RootError, match="writable by group or others"):
        TierCache(cfg)
    with TierCache(cfg.replace(check_root_owner=False)) as c:
        put_random(c, [1], rng)
        c.flush()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory to another user")
def test_a_root_of_another_user_is_refused(make_config):
    cfg = make_config()
    cfg.root.mkdir(mode=0o700)
    os.chown(cfg.root, 65534, 65534)
    with pytest.raises(RootError, match="belongs to uid 65534"):
        TierCache(cfg)


# -- CLI usage errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [
    ["bench", "--blocks", "0"], ["bench", "--threads", "0"], ["bench", "--batch", "99999"],
    ["calibrate", "--tolerance", "5"], ["verify", "--threads", "0"], ["inspect", "--json", "extra"],
    ["purge", "--nope"], ["bench", "--io", "warp"], ["nosuchcommand"],
])
def test_every_usage_error_is_one_line_with_exit_2(args):
    line = one_line_error(runner.invoke(app, args))
    assert line.startswith("tiercache: error:")


def test_purge_older_than_garbage_is_one_line(flushed):
    cfg, _ = flushed
    assert "not a duration" in one_line_error(runner.invoke(app, ["purge", "--root", str(cfg.root),
                                                                  "--older-than", "7x", "--yes"]))


def test_purge_without_an_answer_exits_2_and_deletes_nothing(flushed):
    cfg, _ = flushed
    res = runner.invoke(app, ["purge", "--root", str(cfg.root)])  # no terminal, no input
    assert res.exit_code == 2 and "nothing deleted" in res.output
    assert len(list(files(cfg.root, "block_*"))) == 8


@pytest.mark.skipif(cuda_status().available, reason="checks the no-GPU error")
def test_calibrate_json_without_a_gpu_is_json():
    res = runner.invoke(app, ["calibrate", "--json"])
    assert res.exit_code == 2
    assert json.loads(res.stdout)["ok"] is False


def test_bench_keep_names_the_root_and_verify_finds_roots_inside_a_parent(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text(f'[tiers]\nhost_slots = 4\nfile_slots = 8\n[file]\nroot = "{tmp_path / "r"}"\nfsync = "none"\n'
                    '[pools.kv]\nblock_shape = [1024]\ndtype = "uint8"\n')
    res = runner.invoke(app, ["bench", "--config", str(toml), "--keep"])
    assert res.exit_code == 0, res.output
    kept = next(ln for ln in res.output.splitlines() if "block files kept in" in ln).split("kept in ")[1].split()[0]
    assert runner.invoke(app, ["verify", "--root", kept]).exit_code == 0
    line = one_line_error(runner.invoke(app, ["verify", "--root", str(tmp_path / "r")]))
    assert kept in line


# -- fuzz: random hostile trees ----------------------------------------------------------------
def _hostile_tree(rng, root, outside, keys, pools) -> None:
    """Put 1..12 random entries under ``root``: regular files, directories, symlinks (to
    files and directories outside and inside, dangling), hard links to outside files, under
    tiercache's own names, block names of stored and new keys (canonical or not), temporary
    names and random ones; sometimes damage a stored block file."""
    names = [".tiercache-root", ".tiercache-root.lock", ".tiercache-root.stats.json", "quarantine",
             ".tmp.x", ".tmp.block_5_pool_kv.bin.1.ab", ".tmp.own.marker.9", "notes.txt",
             "block_7_pool_nosuch.bin", "block_0007_pool_kv.bin", "block_\u0667_pool_kv.bin"]
    names += [block_filename(k, p.name) for k in keys for p in pools] + [block_filename(99, p.name) for p in pools]
    existing = [p for p in root.iterdir() if p.is_file() and not p.is_symlink()]
    for _ in range(int(rng.integers(1, 13))):
        name = str(rng.choice(names))
        p = root / name
        kind = rng.choice(["file", "dir", "link_out_file", "link_out_dir", "link_in", "dangling", "hardlink",
                           "damage"])
        if kind == "damage":
            victims = [q for q in existing if q.name.startswith("block_") and q.is_file() and not q.is_symlink()]
            if victims:
                with open(victims[int(rng.integers(len(victims)))], "r+b") as f:
                    f.seek(int(rng.integers(0, 4200)))
                    f.write(rng.bytes(int(rng.integers(1, 64))))
            continue
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.is_dir():
            shutil.rmtree(p)
        if kind == "file":
            p.write_bytes(rng.bytes(int(rng.integers(0, 9000))))
        elif kind == "dir":
            p.mkdir()
            (p / "inner").write_text("x")
        elif kind == "link_out_file":
            p.symlink_to(outside / str(rng.choice(["precious.txt", "x", "block_1_pool_kv.bin"])))
        elif kind == "link_out_dir":
            p.symlink_to(outside)
        elif kind == "link_in" and existing:
            p.symlink_to(existing[int(rng.integers(len(existing)))])
        elif kind == "hardlink":
            os.link(outside / "x", p)
        else:
            p.symlink_to(root / "nowhere")


def test_random_hostile_trees_never_reach_outside_the_root(make_config, tmp_path, rng, outside):
    (outside / "sub").mkdir()
    (outside / "sub" / "deep.txt").write_text("deep")
    for trial in range(12):
        cfg = make_config(host_slots=8, root=tmp_path / f"root{trial}")
        with TierCache(cfg) as c:
            exp = put_random(c, random_keys(rng, 4, "int"), rng)
            c.flush()
        _hostile_tree(rng, cfg.root, outside, list(exp), cfg.pools)
        before = tree(outside)
        try:
            with TierCache(cfg) as c:
                served = [k for k in c.keys() if k in exp]
                assert set(c.keys()) <= set(exp)  # nothing planted is served as a block
                try:
                    assert_bytes(c, {k: exp[k] for k in served})
                except TransferError as exc:  # a damaged file: quarantined, never served wrong
                    assert isinstance(exc, TransferError)
                    assert_bytes(c, {k: exp[k] for k in c.keys()})
        except RootError:
            pass  # a refused root (symlinked lock or quarantine, broken marker) is a clean error
        for args in (["verify", "--root", str(cfg.root)], ["verify", "--root", str(cfg.root), "--quarantine"],
                     ["inspect", "--root", str(cfg.root), "--json"], ["purge", "--root", str(cfg.root), "--yes"]):
            res = runner.invoke(app, args)
            assert res.exception is None or isinstance(res.exception, SystemExit), (args, res.output)
            assert res.exit_code in (0, 1, 2) and "Traceback" not in res.output, (args, res.output)
        assert tree(outside) == before, f"trial {trial}: something outside the root changed"


# -- 12. block subdirectories ----------------------------------------------------------------------
def test_block_files_are_spread_over_subdirectories_by_key(make_config, rng):
    cfg = make_config(host_slots=8)
    keys = random_keys(rng, 40, "mixed")
    with TierCache(cfg) as c:
        put_random(c, keys, rng)
        c.flush()
    found = files(cfg.root, "block_*")
    assert len(found) == 40 * len(cfg.pools) and not list(cfg.root.glob("block_*"))  # none flat
    assert {p.parent.name for p in found} <= set(SUBDIRS) and len({p.parent.name for p in found}) > 10
    for k in keys:  # every pool's file of a block in one subdirectory, the key's
        assert {bpath(cfg.root, k, p.name).parent for p in cfg.pools} == {cfg.root / block_subdir(k)}


def test_a_root_of_the_flat_layout_is_moved_into_subdirectories(make_config, rng):
    """Roots written before subdirectories (every block file in the root itself) open with
    every block, moved into place, bytes exact."""
    cfg = make_config(host_slots=8)
    keys = random_keys(rng, 12, "mixed")
    with TierCache(cfg) as c:
        exp = put_random(c, keys, rng)
        c.flush()
    for f in files(cfg.root, "block_*"):
        f.rename(cfg.root / f.name)  # the flat layout
    (cfg.root / ".tmp.block_3_pool_kv.bin.1.ab").write_bytes(b"left by a crash")
    drop_index(cfg.root)  # roots of the flat layout were written before the index
    with TierCache(cfg) as c:
        assert c.scan.migrated == 12 * len(cfg.pools) and c.scan.removed_tmp == 1
        assert set(c.keys()) == set(keys)
        assert_bytes(c, exp)
    assert not list(cfg.root.glob("block_*")) and len(files(cfg.root, "block_*")) == 12 * len(cfg.pools)


def test_a_symlink_in_place_of_a_block_subdirectory_is_refused_never_followed(make_config, rng, outside):
    cfg = make_config(host_slots=8)
    with TierCache(cfg) as c:
        put_random(c, [1], rng)
        c.flush()
    victim = cfg.root / SUBDIRS[int(rng.integers(0, len(SUBDIRS)))]
    shutil.rmtree(victim)
    victim.symlink_to(outside, target_is_directory=True)
    before = tree(outside)
    with pytest.raises(RootError, match="symlink or not a directory"):
        TierCache(cfg)
    res = runner.invoke(app, ["verify", "--root", str(cfg.root), "--json"])
    assert res.exit_code == 1 and any(f"{victim} is a symlink" in b["problem"] for b in json.loads(res.stdout)["bad"])
    runner.invoke(app, ["purge", "--root", str(cfg.root), "--yes"])
    assert tree(outside) == before  # nothing through the link was read into, moved or deleted
