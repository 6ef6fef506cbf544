"""Who wrote a temporary file, and when a shared root may remove it: the writer's pid is only
checked in the checker's own boot and PID namespace (two containers on one host share the boot
id, not their pids); the root's own temporary files (index, stats) of a killed process are
removed like block files' (they were left forever)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
from helpers import put_random

from tiercache import TierCache
from tiercache.files import BOOT_TAG, tmp_abandoned, tmp_name, tmp_owner


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _tag_in_new_pid_namespace() -> str:
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    out = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c",
                          "import os; from tiercache.files import BOOT_TAG; print(os.getpid(), BOOT_TAG)"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"unshare --pid is not permitted here: {out.stderr.strip()[-200:]}")
    pid, tag = out.stdout.split()
    assert pid == "1"  # it ran in a new PID namespace
    return tag


def test_a_writer_in_another_pid_namespace_is_never_judged_by_its_pid():
    """A live writer in a container (its own PID namespace, the same boot id) names its file
    with its pid there; that pid is dead (or someone else) here. Its file is abandoned only by
    age, never because the pid is not alive in this namespace."""
    tag = _tag_in_new_pid_namespace()
    assert tag != BOOT_TAG
    dead = _dead_pid()
    mine = f".tmp.block_7_pool_kv.bin.{dead}.{BOOT_TAG}3"
    theirs = f".tmp.block_7_pool_kv.bin.{dead}.{tag}3"
    assert tmp_abandoned(mine, 1.0, 900.0)  # same namespace, dead pid: gone
    assert not tmp_abandoned(theirs, 1.0, 900.0)  # another namespace: its pid is not ours to check
    assert tmp_abandoned(theirs, 901.0, 900.0)  # ... only its age tells


def test_own_temporary_names_carry_the_writer():
    pid = os.getpid()
    assert tmp_owner(f".tmp.own.tiercache-index.{pid}.{BOOT_TAG}") == (pid, BOOT_TAG)
    assert tmp_owner(f".tmp.own.tiercache-root.stats.json.{pid}") == (pid, None)  # earlier releases
    assert tmp_owner(tmp_name("block_5_pool_kv.bin")) == (pid, BOOT_TAG)


def test_a_shared_root_removes_killed_writers_index_and_stats_temporaries(make_config, rng):
    cfg = make_config(host_slots=8, sharing="shared")
    with TierCache(cfg) as c:
        put_random(c, [b"key-1", b"key-2"], rng)
        c.flush()
    dead = _dead_pid()
    left = [cfg.root / f".tmp.own.tiercache-index.{dead}.{BOOT_TAG}",
            cfg.root / f".tmp.own.tiercache-root.stats.json.{dead}.{BOOT_TAG}"]
    old = cfg.root / f".tmp.own.tiercache-index.{dead + 1}"  # an earlier release's name, old
    live = cfg.root / f".tmp.own.tiercache-index.{os.getpid()}.{BOOT_TAG}"  # a live writer's
    for p in (*left, old, live):
        p.write_bytes(b"x" * 64)
    t = time.time() - 2 * cfg.tmp_max_age_s
    os.utime(old, (t, t))
    with TierCache(cfg) as c:
        assert c.wait_reconciled(30)
        assert not any(p.exists() for p in (*left, old)) and live.exists()
    live.unlink()
