"""Errors that reach the user as one clear line (CLI exit 2, or one ``TierCacheError`` from the
library), not tracebacks: unreadable entries in a root (mode 000, checked without root's
permission override), files that are not UTF-8, malformed URLs and arguments."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers import put_random

from tiercache import ConfigError, InvalidKeyError, TierCache

LOCK = ".tiercache-root.lock"


def _run(args: list[str], **kw) -> subprocess.CompletedProcess:
    """``args`` without the permission override root has (CAP_DAC_OVERRIDE): as a user would."""
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: mode 000 would not stop this process")
        args = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *args]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, **kw)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "tiercache.cli", *args])


@pytest.fixture
def root(make_config, rng):
    cfg = make_config(host_slots=8)
    with TierCache(cfg) as c:
        put_random(c, list(range(40)), rng, tier="file")
    return cfg


OPEN = """
import sys
from tiercache import TierCache, TierCacheError
try:
    TierCache.open(sys.argv[1])
    print("OPENED")
except TierCacheError as exc:
    print(type(exc).__name__, exc)
"""


def _config_file(cfg, tmp_path) -> str:
    pools = "\n".join(f'[pools.{p.name}]\nblock_shape = {list(p.block_shape)}\ndtype = "{p.dtype}"' for p in cfg.pools)
    path = tmp_path / "c.toml"
    path.write_text(f'[tiers]\ndevice_slots = 0\nhost_slots = 8\nfile_slots = 64\n[file]\nroot = "{cfg.root}"\n'
                    f'fsync = "none"\n{pools}\n')
    return str(path)


@pytest.mark.parametrize("entry", ["00", LOCK])
def test_an_unreadable_entry_opens_into_one_root_error(root, tmp_path, entry):
    cfgfile = _config_file(root, tmp_path)
    p = root.root / entry
    mode = p.stat().st_mode
    p.chmod(0)
    try:
        out = _run([sys.executable, "-c", OPEN, cfgfile])
    finally:
        p.chmod(mode & 0o7777)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stdout.startswith("RootError") and "permission denied (mode 0o0)" in out.stdout, out.stdout


def test_verify_and_purge_name_an_unreadable_subdirectory(root):
    sub = root.root / "00"
    sub.chmod(0)
    try:
        v = _cli("verify", "--root", str(root.root))
        q = _cli("verify", "--root", str(root.root), "--json")
        pg = _cli("purge", "--root", str(root.root), "--yes")
    finally:
        sub.chmod(0o700)
    for r in (v, q, pg):
        assert "Traceback" not in r.stderr + r.stdout, r.stderr
    assert v.returncode == 1 and "BAD" in v.stdout and "00: permission denied" in v.stdout
    assert (
        pg.returncode == 0
        and "left alone" in pg.stdout + pg.stderr
        and "00: permission denied" in pg.stdout + pg.stderr
    )
    assert list(sub.iterdir())  # what was inside stays (it could not be read)


def test_verify_quarantine_with_an_unreadable_quarantine_is_one_line(root, rng):
    path = next(root.root.glob("*/block_*_pool_kv.bin"))
    with open(path, "r+b") as f:
        f.seek(5000)
        f.write(b"\x00\x01\x02")
    q = root.root / "quarantine"
    q.mkdir(mode=0o700, exist_ok=True)
    q.chmod(0)
    try:
        r = _cli("verify", "--root", str(root.root), "--quarantine")
    finally:
        q.chmod(0o700)
    assert "Traceback" not in r.stderr and r.returncode == 2, r.stderr
    assert r.stderr.startswith("tiercache: error:") and "quarantine: permission denied" in r.stderr


def test_files_that_are_not_utf8_are_one_config_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe[global]\nrw=read\n")
    for args in (["inspect", "--config", str(bad)], ["bench", "fio", str(bad)]):
        r = subprocess.run([sys.executable, "-m", "tiercache.cli", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "is not UTF-8 text" in r.stderr
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        TierCache.open(bad)
    with pytest.raises(ConfigError, match="config 123: give a CacheConfig or the path"):
        TierCache.open(123)


def test_a_malformed_url_is_one_line():
    pytest.importorskip("prometheus_client")
    r = subprocess.run([sys.executable, "-m", "tiercache.cli", "top", "--url", "http://[::1"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "is not a URL" in r.stderr, r.stderr


def test_rowstore_refuses_keys_that_are_not_a_sequence(tmp_path):
    from tiercache import RowStore

    rows = np.zeros((4, 4096), np.uint8)
    with RowStore(rows, tmp_path / "rows", capacity_blocks=16) as st:
        with pytest.raises(InvalidKeyError, match="keys = None: give a sequence of content keys"):
            st.submit_store(None, [0])
        with pytest.raises(InvalidKeyError):
            st.submit_load(None, [0])
