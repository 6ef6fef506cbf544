"""``tiercache verify`` beside processes that change the root while it checks (a shared root
in use): a file that vanished, or that was replaced by a good one, between the check and the
report is not bad, and ``--quarantine`` moves only a file that is still bad and still the same
inode (``files.recheck``)."""

from __future__ import annotations

import json
import os

from conftest import bpath, random_keys
from helpers import put_random
from typer.testing import CliRunner

from tiercache import TierCache
from tiercache.cli import app
from tiercache.files import RootDir
from tiercache.rootops import RootCheck, recheck, survey


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def _damaged_root(make_config, rng, bad: int):
    """A root of 6 flushed blocks whose first ``bad`` blocks' kv files have a flipped data
    byte; returns the config, those files, and the good bytes of the second one."""
    cfg = make_config(host_slots=8, pools=None)
    with TierCache(cfg) as c:
        keys = random_keys(rng, 6, "int")
        put_random(c, keys, rng)
        c.flush()
    paths = [bpath(cfg.root, k, "kv") for k in keys[:bad]]
    good = paths[1].read_bytes()
    for p in paths:
        _flip(p, 4096 + 7)
    return cfg, paths, good


def test_recheck_tells_gone_replaced_and_still_bad(make_config, rng, tmp_path):
    cfg, paths, good = _damaged_root(make_config, rng, 4)
    sv = survey(cfg.root)
    entries = {e.relpath: e for e in sv.blocks}
    ent = [entries[str(p.relative_to(cfg.root))] for p in paths]
    os.unlink(paths[0])  # removed by another process
    tmp = paths[1].with_name("x.tmp")
    tmp.write_bytes(good)
    os.replace(tmp, paths[1])  # republished, valid, under a new inode
    other = paths[3].with_name("y.tmp")
    other.write_bytes(paths[3].read_bytes())
    os.replace(other, paths[3])  # replaced by another bad file
    rd = RootDir(cfg.root, check_owner=False)
    try:
        r = [recheck(rd, e) for e in ent]
    finally:
        rd.close()
    assert r[0].problem is None and r[1].problem is None
    assert r[2].problem and r[2].same_file
    assert r[3].problem and not r[3].same_file


def test_verify_quarantine_moves_only_files_still_bad(make_config, rng, monkeypatch):
    cfg, paths, good = _damaged_root(make_config, rng, 3)
    real = RootCheck.results

    def results_then_changes(self):
        found = real(self)
        os.unlink(paths[0])  # between the check and the report, as a sweep would
        tmp = paths[1].with_name("z.tmp")
        tmp.write_bytes(good)
        os.replace(tmp, paths[1])  # a name republished with a valid file
        return found

    monkeypatch.setattr(RootCheck, "results", results_then_changes)
    res = CliRunner().invoke(app, ["verify", "--root", str(cfg.root), "--quarantine", "--json"])
    assert res.exit_code == 1, res.output
    out = json.loads(res.stdout)
    assert [b["file"] for b in out["bad"]] == [paths[2].name] and out["quarantined"] == 1
    assert out["changed_while_checked"] == 2
    assert paths[1].read_bytes() == good  # the republished good file stayed where it is
    assert (cfg.root / "quarantine" / paths[2].name).exists()
    assert sorted(p.name for p in (cfg.root / "quarantine").iterdir()) == [paths[2].name]
