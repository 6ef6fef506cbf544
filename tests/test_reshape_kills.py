"""Changes of a root array's members killed at every step (``tiercache roots add|remove``).

Each scenario makes an array (or a plain root) holding random blocks, keeps a copy of it, and
then, for every step k of the command (every call that changes a file system: an open for
writing, a write, a flush, a rename, an unlink, a copy, a mkdir), restores the copy, runs the
command in a forked child that SIGKILLs itself just before its k-th step, and runs the same
command again. After every kill point:

- the rerun exits 0;
- every block reads back byte-exact through a cache opened on the resulting members;
- nothing outside the members changed (a bystander root and files beside the members);
- no temporary file is left in any member.

The cross-device scenario moves blocks between two tmpfs mounts (copy, flush, rename, unlink),
where ``copy_file_range`` fails with EXDEV; it is skipped where this process cannot mount.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import random_keys
from helpers import assert_bytes, put_random

from tiercache import CacheConfig, PoolSpec, TierCache

POOLS = (PoolSpec("kv", (4096,), "uint8"), PoolSpec("act", (300,), "float32"))
BLOCKS = 16

#: the os calls that change a file system: the child is killed before one of them
_MUTATORS = ("write", "pwrite", "ftruncate", "fsync", "fdatasync", "replace", "rename", "unlink", "rmdir", "mkdir",
             "link", "copy_file_range", "sendfile", "utime")
_WRITE_FLAGS = os.O_CREAT | os.O_WRONLY | os.O_RDWR | os.O_TRUNC


def _cfg(roots) -> CacheConfig:
    return CacheConfig(roots=[str(r) for r in roots], pools=POOLS, host_slots=4, file_slots=200, fsync="none",
                       metrics_registry="none", metrics_snapshot_s=0)


_COMMAND = []


def _cli(argv: list[str]):
    """``tiercache ARGV`` through CliRunner (the click command built once: typer builds it per call)."""
    if not _COMMAND:
        import typer

        from cli.app import app
        _COMMAND.append(typer.main.get_command(app))
    return CliRunner().invoke(_COMMAND[0], argv)


def _run_cli_killed_at(k: int | None, argv: list[str]) -> dict:
    """Run ``tiercache ARGV`` in a forked child that SIGKILLs itself just before its k-th
    file-system change (never, with None). Returns ``{"killed", "steps", "code", "output"}``."""
    _cli(["roots", "--help"])  # built before the fork
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        real_write, steps = os.write, [0]

        def counted(name, real):
            def call(*args, **kwargs):
                if name == "open" and not (args[1] if len(args) > 1 else kwargs.get("flags", 0)) & _WRITE_FLAGS:
                    return real(*args, **kwargs)
                steps[0] += 1
                if steps[0] == k:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(*args, **kwargs)
            return call

        for name in _MUTATORS + ("open",):
            setattr(os, name, counted(name, getattr(os, name)))
        try:
            res = _cli(argv)
            out = {"code": res.exit_code, "output": res.output, "steps": steps[0]}
        except BaseException as exc:
            out = {"code": -1, "output": repr(exc), "steps": steps[0]}
        data = json.dumps(out).encode()
        while data:
            data = data[real_write(w, data):]
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    out = json.loads(b"".join(chunks)) if chunks else {"code": None, "output": "", "steps": None}
    return {"killed": killed, **out}


def _tree(top: Path, skip: set[Path]) -> dict[str, tuple]:
    """Every entry under ``top`` except the ``skip`` directories' contents: kind, size, mode,
    modification time and, for files, a digest."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        here = Path(dirpath)
        dirnames[:] = [n for n in dirnames if here / n not in skip]
        for n in dirnames + filenames:
            p = here / n
            st = p.lstat()
            if p.is_dir() and not p.is_symlink():  # a directory's times move with its members'
                out[str(p.relative_to(top))] = (st.st_mode,)
                continue
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else ""
            out[str(p.relative_to(top))] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out


def _temporaries(roots) -> list[str]:
    return [str(p) for r in roots if Path(r).is_dir() for p in Path(r).rglob(".tmp*")]


def _restore(template: Path, roots: list[Path]) -> None:
    for i, r in enumerate(roots):
        if r.is_mount():  # a mount point stays: its contents are replaced
            for p in r.iterdir():
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            shutil.copytree(template / str(i), r, dirs_exist_ok=True)
        else:
            shutil.rmtree(r, ignore_errors=True)
            if (template / str(i)).exists():
                shutil.copytree(template / str(i), r)
        if (template / str(i)).exists():
            os.chmod(r, 0o700)


def _every_step(tmp_path: Path, start: list[Path], argv: list[str], after: list[Path], want: dict,
                extra: list[Path] = (), stride: int = 1) -> int:
    """The scenario's loop (see the module's doc); ``start``: the roots that hold blocks now,
    ``extra``: other roots the command names (new ones); returns the number of kill points."""
    everything = list(start) + [p for p in extra if p not in start]
    template = tmp_path / "template"
    template.mkdir()
    for i, r in enumerate(everything):
        if r.exists():
            shutil.copytree(r, template / str(i), symlinks=True)
    bystander = tmp_path / "bystander"
    with TierCache(CacheConfig(root=str(bystander), pools=POOLS, host_slots=4, file_slots=50, fsync="none",
                               metrics_registry="none", metrics_snapshot_s=0)) as c:
        put_random(c, random_keys(np.random.default_rng(1), 4), np.random.default_rng(2), tier="file")
    (tmp_path / "notes.txt").write_text("not tiercache's")
    outside = _tree(tmp_path, set(everything) | {template})
    full = _run_cli_killed_at(None, argv)
    assert full["code"] == 0 and not full["killed"], full
    steps = full["steps"]
    assert steps > 5, full
    points = 0
    for k in range(1, steps + 1, stride):
        _restore(template, everything)
        run = _run_cli_killed_at(k, argv)
        if not run["killed"]:  # the command finished in fewer steps this time
            assert run["code"] == 0, (k, run)
        points += 1
        again = _cli(argv)
        assert again.exit_code == 0, (k, again.output)
        assert not _temporaries(everything), (k, _temporaries(everything))
        with TierCache(_cfg(after)) as cache:
            assert len(cache.keys("file")) == len(want), (k, again.output)
            assert_bytes(cache, want)
        assert not _temporaries(everything), k
        assert _tree(tmp_path, set(everything) | {template}) == outside, k
    _restore(template, everything)
    return points


def _array(tmp_path: Path, roots: list[Path], rng) -> dict:
    keys = random_keys(rng, BLOCKS)
    if len(roots) == 1:
        cfg = CacheConfig(root=str(roots[0]), pools=POOLS, host_slots=4, file_slots=200, fsync="none",
                          metrics_registry="none", metrics_snapshot_s=0)
    else:
        cfg = _cfg(roots)
    with TierCache(cfg) as c:
        return put_random(c, keys, rng, tier="file")


def _m(tmp_path: Path, n: int) -> list[Path]:
    (tmp_path / "devs").mkdir(exist_ok=True)
    return [tmp_path / "devs" / f"m{i}" for i in range(n)]


#: each change: (members, how many hold blocks before, the command, members after, whether the
#: last member is a new, empty directory)
CHANGES = {
    "add": (3, 2, lambda m: ["roots", "add", m[0], m[1], "--new", m[2]], 3, True),
    "remove given one member": (3, 3, lambda m: ["roots", "remove", m[0], "--drop", m[2]], 2, False),
    "remove given every member": (3, 3, lambda m: ["roots", "remove", m[0], m[1], m[2], "--drop", m[2]], 2, False),
    "plain root to array": (2, 1, lambda m: ["roots", "add", m[0], "--new", m[1]], 2, True),
    "array to plain root": (2, 2, lambda m: ["roots", "remove", m[0], "--drop", m[1]], 1, False),
}


@pytest.mark.slow
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_killed_at_every_step_is_finished_by_its_rerun(tmp_path, rng, change):
    n, holding, command, after, new = CHANGES[change]
    m = _m(tmp_path, n)
    want = _array(tmp_path, m[:holding], rng)
    if new:
        m[-1].mkdir(mode=0o700)
    argv = command([str(p) for p in m])
    assert _every_step(tmp_path, m[:holding], argv, m[:after], want, extra=m[holding:]) > 10


@pytest.mark.slow
def test_forget_killed_at_every_step(tmp_path, rng):
    """A member whose device is gone: its blocks are lost, the others' read exact."""
    from tiercache.files import block_subdir, subdir_owner

    m = _m(tmp_path, 3)
    want = _array(tmp_path, m, rng)
    owned = subdir_owner(m[2])
    kept = {k: v for k, v in want.items() if not owned[block_subdir(k)]}
    assert 0 < len(kept) < len(want)
    shutil.rmtree(m[2])
    argv = ["roots", "remove", str(m[0]), "--forget", str(m[2])]
    assert _every_step(tmp_path, m[:2], argv, m[:2], kept) > 5


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here ({res.stderr.strip() or res.returncode}): the cross-device reshape "
                    "needs two real file systems")


@pytest.fixture
def two_filesystems(tmp_path):
    """Two tmpfs mounts under ``tmp_path`` (each a file system of its own), unmounted after."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting file systems needs root and mount(8)")
    mounts = [tmp_path / "devs" / "fs0", tmp_path / "devs" / "fs1"]
    try:
        for p in mounts:
            _mount_tmpfs(p, "64m")
        yield mounts
    finally:
        for p in mounts:
            if p.is_mount():
                subprocess.run(["umount", "-l", str(p)], check=False)


@pytest.mark.slow
def test_cross_device_add_and_remove_killed_at_every_step(tmp_path, rng, two_filesystems):
    a, b = two_filesystems
    assert os.stat(a).st_dev != os.stat(b).st_dev
    want = _array(tmp_path, [a], rng)
    argv = ["roots", "add", str(a), "--new", str(b)]
    assert _every_step(tmp_path, [a], argv, [a, b], want, extra=[b], stride=2) > 10
    res = _cli(argv)
    assert res.exit_code == 0, res.output
    assert any(p.name.startswith("block_") for p in b.rglob("*"))
    shutil.rmtree(tmp_path / "template")
    argv = ["roots", "remove", str(a), "--drop", str(b)]
    assert _every_step(tmp_path, [a, b], argv, [a], want, stride=2) > 10
