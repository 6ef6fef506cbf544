"""`tiercache inspect | purge | verify`: every command and its error paths, through typer's
runner and as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import bpath, files, random_keys
from helpers import put_random
from typer.testing import CliRunner

from tiercache import TierCache
from tiercache.cli import app
from tiercache.files import RootLock, block_filename

runner = CliRunner()


@pytest.fixture
def populated(make_config, rng):
    """A closed root with 6 flushed blocks in two pools, one temporary leftover, one foreign file."""
    cfg = make_config(host_slots=8)
    with TierCache(cfg) as c:
        keys = random_keys(rng, 6, "int")
        put_random(c, keys, rng)
        c.flush()
    (cfg.root / ".tmp.block_9_pool_kv.bin.1.abcd").write_bytes(b"x" * 100)
    (cfg.root / "notes.txt").write_text("keep me")
    return cfg, keys


def test_inspect_json(populated):
    cfg, keys = populated
    res = runner.invoke(app, ["inspect", "--root", str(cfg.root), "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)["root"]
    assert r["tiercache_root"] and r["locked_by_pid"] is None
    assert r["blocks"] == 6 and r["block_files"]["files"] == 12
    assert set(r["pools"]) == {"kv", "act"} and r["pools"]["kv"]["files"] == 6
    assert r["temporary"] == {"files": 1, "bytes": 100}
    assert r["foreign"] == ["notes.txt"]
    assert r["live_stats"]["counters"]["flushed_blocks"] == 6  # saved by the cache on flush/close


def test_inspect_says_whether_the_copy_kernels_load_here(populated, monkeypatch):
    """``inspect`` reports the project's copy kernels: on a machine without a usable GPU they
    are unavailable for CUDA's reason; where CUDA works and a kernel does not load, that
    failure is named (the vLLM connector then copies through torch)."""
    from tiercache.copypaths import copykernels
    from tiercache.cuda import CudaStatus, cuda_status

    cfg, _ = populated
    r = json.loads(runner.invoke(app, ["inspect", "--root", str(cfg.root), "--json"]).stdout)
    if not cuda_status().available:
        assert r["copy_kernels"] == {"available": False, "reason": r["cuda"]}
    else:
        assert r["copy_kernels"]["available"] and "gather/scatter kernel" in r["copy_kernels"]["reason"]

    def broken(device_id=0, **kw):
        raise RuntimeError(f"no kernel image for device {device_id}")

    monkeypatch.setattr("tiercache.cuda.cuda_status", lambda: CudaStatus(True, "1 device(s), device 0: X", True, 1))
    monkeypatch.setattr(copykernels, "CopyLauncher", broken)
    assert copykernels.copy_kernel_status(3) == (None, "RuntimeError: no kernel image for device 3")
    res = runner.invoke(app, ["inspect", "--root", str(cfg.root)])
    assert res.exit_code == 0 and "copy kernels: unavailable (RuntimeError: no kernel image for device 0)" in \
        " ".join(res.output.split()), res.output

    # only the bulk (TMA) kernel fails: the gather/scatter kernel alone, and the failure named
    class NoBulk:
        bulk_available = False

        def __init__(self, device_id=0, bulk=True, **kw):
            if bulk:
                raise RuntimeError("copy_bulk.cu: NVRTC_ERROR_COMPILATION")
            self.device_id = device_id

    monkeypatch.setattr(copykernels, "CopyLauncher", NoBulk)
    la, what = copykernels.copy_kernel_status(2)
    assert isinstance(la, NoBulk) and la.device_id == 2
    assert what == "the gather/scatter kernel (the launcher with the bulk kernel failed: RuntimeError: " \
                   "copy_bulk.cu: NVRTC_ERROR_COMPILATION)"

    def fails_differently(device_id=0, bulk=True, **kw):
        raise RuntimeError("bulk" if bulk else "plain")

    monkeypatch.setattr(copykernels, "CopyLauncher", fails_differently)
    assert copykernels.copy_kernel_status(0) == (
        None, "RuntimeError: bulk; without the bulk kernel: RuntimeError: plain")


def test_inspect_counts_a_big_root_from_its_index(populated, monkeypatch):
    import tiercache.cli.inspect_cmd as ic
    from tiercache.files import file_size

    cfg, keys = populated
    full = json.loads(runner.invoke(app, ["inspect", "--root", str(cfg.root), "--json"]).stdout)["root"]
    assert "from_index" not in full  # 6 blocks: listed
    monkeypatch.setattr(ic, "SCAN_MAX_BLOCKS", 5)  # as if it held millions
    listed = []
    real_survey = ic.survey
    monkeypatch.setattr(ic, "survey", lambda root, **kw: listed.append(kw) or real_survey(root, **kw))
    res = runner.invoke(app, ["inspect", "--root", str(cfg.root), "--json"])
    assert listed == [{"subdirs": False}]  # the block subdirectories are not looked into
    r = json.loads(res.stdout)["root"]
    assert r["from_index"]["blocks"] == 6 and isinstance(r["from_index"]["clean"], bool)
    assert {k: r[k] for k in ("blocks", "block_files", "pools")} == {
        k: full[k] for k in ("blocks", "block_files", "pools")
    }
    assert r["pools"]["act"]["bytes"] == 6 * file_size(next(p for p in cfg.pools if p.name == "act").block_nbytes)
    assert r["foreign"] == ["notes.txt"]
    res = runner.invoke(app, ["inspect", "--root", str(cfg.root)])
    assert "counted from the saved index" in " ".join(res.output.split())
    assert "from_index" not in json.loads(runner.invoke(app, ["inspect", "--root", str(cfg.root), "--json",
                                                             "--scan"]).stdout)["root"]
    (cfg.root / ".tiercache-index").write_bytes(b"garbage")  # unusable: listed instead
    assert (
        "from_index"
        not in json.loads(runner.invoke(app, ["inspect", "--root", str(cfg.root), "--json"]).stdout)["root"]
    )


def test_inspect_normal_shows_live_cache(make_config, rng):
    cfg = make_config()
    with TierCache(cfg) as c:
        put_random(c, [1], rng)
        c.flush()
        res = runner.invoke(app, ["inspect", "--root", str(cfg.root)])
        assert res.exit_code == 0, res.output
        assert f"in use by pid {os.getpid()}" in res.output and "blocks (keys)" in res.output


def test_purge_refusals(tmp_path, populated):
    cfg, _ = populated
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "block_1_pool_kv.bin").write_text("not ours")
    res = runner.invoke(app, ["purge", "--root", str(foreign), "--yes"])
    assert res.exit_code == 2 and "no .tiercache-root marker" in res.output
    assert (foreign / "block_1_pool_kv.bin").exists()
    res = runner.invoke(app, ["purge", "--root", str(tmp_path / "nope"), "--yes"])
    assert res.exit_code == 2 and "does not exist" in res.output
    with TierCache(cfg):
        res = runner.invoke(app, ["purge", "--root", str(cfg.root), "--yes"])
        assert res.exit_code == 2 and "in use by process" in res.output
    res = runner.invoke(app, ["purge", "--root", str(cfg.root), "--keys", "zz", "--yes"])
    assert res.exit_code == 2 and "not a key text" in res.output
    res = runner.invoke(app, ["purge", "--root", str(cfg.root), "--older-than", "soon", "--yes"])
    assert res.exit_code == 2 and "not a duration" in res.output
    assert len(list(files(cfg.root, "block_*"))) == 12


def test_purge_filters_confirm_and_dry_run(populated):
    cfg, keys = populated
    res = runner.invoke(app, ["purge", "--root", str(cfg.root), "--pool", "act", "--dry-run"])
    assert res.exit_code == 0 and "would delete 6 file(s)" in res.output
    assert len(list(files(cfg.root, "block_*"))) == 12
    res = runner.invoke(app, ["purge", "--root", str(cfg.root), "--keys", str(keys[0])], input="n\n")
    assert res.exit_code == 0 and "nothing deleted" in res.output  # a deliberate no is not an error
    assert len(list(files(cfg.root, "block_*"))) == 12
    res = runner.invoke(app, ["purge", "--root", str(cfg.root), "--keys", str(keys[0])], input="y\n")
    assert res.exit_code == 0 and "deleted 2 file(s)" in res.output
    assert not list(files(cfg.root, block_filename(keys[0], "*")))
    res = runner.invoke(app, ["purge", "--root", str(cfg.root), "--older-than", "1h", "--yes"])
    assert res.exit_code == 0 and "nothing to purge" in res.output
    old = time.time() - 7200
    for p in files(cfg.root, block_filename(keys[1], "*")):
        os.utime(p, (old, old))
    res = runner.invoke(app, ["purge", "--root", str(cfg.root), "--older-than", "1h", "--yes"])
    assert res.exit_code == 0 and "deleted 2 file(s)" in res.output
    res = runner.invoke(app, ["purge", "--root", str(cfg.root), "--yes"])  # everything tiercache wrote
    assert res.exit_code == 0 and "deleted 9 file(s)" in res.output  # 8 block files + the leftover
    assert (cfg.root / "notes.txt").read_text() == "keep me"
    assert (cfg.root / ".tiercache-root").exists()
    with TierCache(cfg) as c:  # the root is still usable
        assert len(c) == 0


def test_verify(populated, rng):
    cfg, keys = populated
    res = runner.invoke(app, ["verify", "--root", str(cfg.root)])
    assert res.exit_code == 0 and "checked 12 block file(s)" in res.output and ": 0 bad" in res.output
    bad = bpath(cfg.root, keys[2], "kv")
    with open(bad, "r+b") as f:
        f.seek(4096 + 7)
        f.write(b"\x00\x01\x02")
    act = next(p for p in cfg.pools if p.name == "act")
    os.truncate(bpath(cfg.root, keys[3], "act"), 4096 + act.block_nbytes // 2)  # cut into the data
    res = runner.invoke(app, ["verify", "--root", str(cfg.root), "--json"])
    assert res.exit_code == 1
    r = json.loads(res.stdout)
    assert r["checked"] == 12 and {b["file"] for b in r["bad"]} == {bad.name, block_filename(keys[3], "act")}
    assert any("checksum mismatch" in b["problem"] for b in r["bad"]) and any(
        "truncated" in b["problem"] for b in r["bad"]
    )
    lock = RootLock(cfg.root)  # as a running cache holds it (opening one would quarantine on scan)
    res = runner.invoke(app, ["verify", "--root", str(cfg.root), "--quarantine"])
    lock.release()
    assert res.exit_code == 2 and "already open in this process" in res.output
    res = runner.invoke(app, ["verify", "--root", str(cfg.root), "--quarantine"])
    assert res.exit_code == 1 and "2 moved to quarantine/" in res.output
    assert (cfg.root / "quarantine" / bad.name).exists()
    res = runner.invoke(app, ["verify", "--root", str(cfg.root)])
    assert res.exit_code == 0


def test_tools_as_subprocess(populated):
    cfg, _ = populated
    for args, code in ((["inspect", "--root", str(cfg.root), "--json"], 0), (["verify", "--root", str(cfg.root)], 0),
                       (["purge", "--root", str(cfg.root), "--dry-run"], 0), (["purge", "--root", "/proc"], 2),
                       (["verify", "--root", "/nonexistent"], 2)):
        res = subprocess.run([sys.executable, "-m", "tiercache.cli.app", *args], capture_output=True, text=True)
        assert res.returncode == code, (args, res.stdout, res.stderr)
        assert "Traceback" not in res.stderr
