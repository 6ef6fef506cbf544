"""The layout record of a root (``claim_layout``, ``<root>/.tiercache-layout``): the first
process's record stays, a process whose blocks mean other bytes is refused with both named,
processes racing on a new root agree on one record, a planted symlink is refused without being
followed, the root's own tools count the record as the root's own, and a whole-root purge frees
it with the blocks."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest
from typer.testing import CliRunner

from tiercache import ConfigError, RootError, RowStore
from tiercache.cli import app
from tiercache.files import LAYOUT, claim_layout, classify


def _root(tmp_path, rng, blocks: int = 3):
    """A row store's root with ``blocks`` stored blocks."""
    rows = rng.integers(0, 256, (4, 4096), dtype=np.uint8)
    with RowStore(rows, tmp_path / "root", capacity_blocks=8, fsync="none") as st:
        st.submit_store([os.urandom(16) for _ in range(blocks)], list(range(blocks)))
        assert st.drain(30) and all(r.success for r in st.finished())
    return tmp_path / "root"


def _rec(sig: str) -> dict:
    return {"signature": sig, "describe": f"layout {sig}"}


def test_the_first_record_stays_and_another_signature_is_refused_naming_both(tmp_path, rng):
    root = _root(tmp_path, rng)
    assert claim_layout(root, _rec("a1")) is True
    assert claim_layout(root, _rec("a1")) is False
    with pytest.raises(ConfigError, match="layout a1.*layout b2"):
        claim_layout(root, _rec("b2"))
    assert claim_layout(root, _rec("a1")) is False
    assert classify(LAYOUT) == "own"
    assert [n for n in os.listdir(root) if n.startswith(".tmp")] == []


@pytest.mark.parametrize("mixed", [False, True], ids=["same", "two-signatures"])
def test_processes_racing_on_a_new_root_agree_on_one_record(tmp_path, rng, mixed):
    root = _root(tmp_path, rng, blocks=0)
    sigs = [("a" if not mixed or i % 2 else "b") for i in range(16)]
    made, refused, barrier = [], [], threading.Barrier(len(sigs))

    def claim(sig: str) -> None:
        barrier.wait()
        try:
            made.append((sig, claim_layout(root, _rec(sig))))
        except ConfigError:
            refused.append(sig)

    threads = [threading.Thread(target=claim, args=(s,)) for s in sigs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [s for s, m in made if m]
    assert len(winners) == 1
    assert all(s == winners[0] for s, _ in made) and all(s != winners[0] for s in refused)
    assert len(made) + len(refused) == 16 and (len(refused) == 8) is mixed
    assert [n for n in os.listdir(root) if n.startswith(".tmp")] == []


def test_a_symlink_planted_as_the_record_is_refused_and_not_followed(tmp_path, rng):
    root = _root(tmp_path, rng)
    outside = tmp_path / "outside.json"
    outside.write_text('{"signature": "a1"}')
    os.symlink(outside, root / LAYOUT)
    with pytest.raises(RootError, match="unreadable layout record"):
        claim_layout(root, _rec("a1"))
    assert outside.read_text() == '{"signature": "a1"}'


def test_the_tools_take_the_record_as_the_roots_own_and_a_whole_purge_frees_it(tmp_path, rng):
    root = _root(tmp_path, rng)
    claim_layout(root, _rec("a1"))
    runner = CliRunner()
    out = runner.invoke(app, ["verify", "--root", str(root), "--json"])
    assert out.exit_code == 0, out.output
    out = runner.invoke(app, ["inspect", "--root", str(root), "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["root"]["foreign"] == [], out.output
    out = runner.invoke(app, ["purge", "--root", str(root), "--yes"])
    assert out.exit_code == 0, out.output
    assert not (root / LAYOUT).exists()
    assert claim_layout(root, _rec("b2")) is True
