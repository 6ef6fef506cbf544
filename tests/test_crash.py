"""Crash safety: a child process spills and flushes blocks continuously and is killed with
SIGKILL at random moments; after each kill the root is reopened, every block it serves must
match the bytes written, and every block acknowledged as flushed must be present."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import files
from crash_child import block, pools

from tiercache import CacheConfig, TierCache

KILLS = int(os.environ.get("TIERCACHE_CRASH_KILLS", "50"))


@pytest.mark.slow
def test_sigkill_at_random_moments(tmp_path, rng):
    root, ack = tmp_path / "root", tmp_path / "acked.log"
    env = dict(os.environ, TIERCACHE_DISABLE_CUDA="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parent.parent),
                                           os.environ.get("PYTHONPATH", "")]))
    cfg = CacheConfig(pools=pools, host_slots=6, file_slots=100_000, root=root, fsync="data")
    next_key, served_total = 0, 0
    verified: set[int] = set()
    for i in range(KILLS):
        child = subprocess.Popen([sys.executable, str(Path(__file__).parent / "crash_child.py"), str(root),
                                  str(ack), str(next_key)], env=env, stderr=subprocess.PIPE)
        # wait until it is writing (its first acknowledgement of this round), then a random moment
        deadline = time.time() + 60
        base = ack.stat().st_size if ack.exists() else 0
        while (not ack.exists() or ack.stat().st_size == base) and child.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        assert child.poll() is None, child.stderr.read().decode()
        time.sleep(float(rng.uniform(0, 0.25)))
        child.send_signal(signal.SIGKILL)
        child.wait()
        acked = {int(k) for line in ack.read_text().splitlines() if line.strip() for k in line.split()}
        with TierCache(cfg) as cache:
            assert cache.wait_reconciled(60)  # the index saved last, reconciled with the directory
            stored = set(cache.keys("file"))
            missing = acked - stored
            assert not missing, f"kill {i}: acknowledged blocks lost: {sorted(missing)[:5]}"
            # every block new since the last round, and a sample of the older ones (already
            # verified once; no process writes a key twice)
            old = sorted(stored & verified)
            sample = [old[j] for j in rng.choice(len(old), size=min(20, len(old)), replace=False)] if old else []
            keys = sorted(stored - verified) + sample
            for p in pools:
                got = cache.get(keys, pool=p.name, out=np.empty((len(keys), p.block_nbytes), np.uint8))
                want = np.concatenate([block(k, p) for k in keys])
                bad = [keys[j] for j in np.flatnonzero((got != want).any(axis=1))]
                assert not bad, f"kill {i}: blocks served with wrong bytes: {bad[:5]}"
            verified |= stored
            served_total = len(stored)
            assert not list(files(root, ".tmp.*")), "temporary files survived the reopen"
        next_key = max(stored | acked | {next_key}) + 1000  # fresh keys for the next round
    assert served_total >= KILLS  # every round acknowledged at least one batch


CHURN_KILLS = int(os.environ.get("TIERCACHE_CRASH_CHURN_KILLS", "12"))


@pytest.mark.slow
def test_sigkill_in_checkpoints_and_evictions(tmp_path, rng):
    """Kills land inside an index checkpoint (its temporary file half written) and inside an
    eviction (one of a block's files removed, the other not yet), alternately, in a file tier
    of 60 blocks that every batch overflows. After each: no temporary file survives the
    reopen, every block served has its bytes, the newest acknowledged blocks (which the LRU
    order keeps) are all there, and the tier holds no more than its slots."""
    from crash_child import CHURN_SLOTS

    root, ack, marks = tmp_path / "root", tmp_path / "acked.log", tmp_path / "marks.log"
    env = dict(os.environ, TIERCACHE_DISABLE_CUDA="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parent.parent),
                                           os.environ.get("PYTHONPATH", "")]))
    cfg = CacheConfig(pools=pools, host_slots=6, file_slots=CHURN_SLOTS, root=root, fsync="data")
    next_key = 0
    landed = {"checkpoint": 0, "evict": 0}
    for i in range(CHURN_KILLS):
        target = ("checkpoint", "evict")[i % 2]
        seen = marks.read_text().count(target) if marks.exists() else 0
        child = subprocess.Popen([sys.executable, str(Path(__file__).parent / "crash_child.py"), str(root),
                                  str(ack), str(next_key), str(marks)], env=env, stderr=subprocess.PIPE)
        deadline = time.time() + 60
        while (not marks.exists() or marks.read_text().count(target) == seen) and time.time() < deadline:
            assert child.poll() is None, child.stderr.read().decode()
            time.sleep(0.002)
        assert marks.exists() and marks.read_text().count(target) > seen, f"kill {i}: no {target} within 60 s"
        time.sleep(float(rng.uniform(0, 0.008)))  # inside the pause that follows the mark
        child.send_signal(signal.SIGKILL)
        child.wait()
        landed[target] += 1
        text = ack.read_text() if ack.exists() else ""  # a kill in the open's first checkpoint: none yet
        acked = [int(k) for line in text.splitlines() if line.strip() for k in line.split()]
        with TierCache(cfg) as cache:
            assert cache.wait_reconciled(60)
            stored = set(cache.keys("file"))
            assert len(stored) <= CHURN_SLOTS
            newest = [k for k in acked[-30:] if k >= next_key]  # this round's, newest 30
            assert set(newest) <= stored, (
                f"kill {i} ({target}): acknowledged blocks lost: {sorted(set(newest) - stored)[:5]}"
            )
            keys = sorted(stored)
            for p in pools if keys else ():
                got = cache.get(keys, pool=p.name, out=np.empty((len(keys), p.block_nbytes), np.uint8))
                want = np.concatenate([block(k, p) for k in keys])
                bad = [keys[j] for j in np.flatnonzero((got != want).any(axis=1))]
                assert not bad, f"kill {i} ({target}): blocks served with wrong bytes: {bad[:5]}"
        assert not list(files(root, ".tmp.*")), f"kill {i} ({target}): temporary files survived the reopen"
        next_key = max(set(acked) | {next_key}) + 1000
    assert landed["checkpoint"] and landed["evict"]
