"""The hardening issue's low items: slots bounded by memory, the row store checks what the
cache checks, a root opened twice in one process, purge's pool names, failed loads' rows."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import put_random
from typer.testing import CliRunner

from tiercache import ConfigError, RootError, RowStore, TierCache
from tiercache.cli import app


def test_file_slots_beyond_this_machines_memory_are_one_clear_error(make_config, tmp_path):
    with pytest.raises(ConfigError, match=r"file tier: 2147483647 slots would need .* GiB of index memory"):
        TierCache(make_config(host_slots=8, file_slots=2**31 - 1))
    never = tmp_path / "never-made"
    with pytest.raises(ConfigError, match="slots would need"):
        RowStore(np.zeros((2, 4096), np.uint8), never, capacity_blocks=1 << 40)
    assert not never.exists()  # refused before anything was created


@pytest.mark.parametrize("bad, match", [
    ({"tmp_max_age_s": 1.5}, r"tmp_max_age_s = 1.5 must be a number of seconds in \[60, 604800\]"),
    ({"verify_checksums": "yes"}, "verify_checksums = 'yes' must be true or false"),
    ({"verify": True}, r"RowStore: unknown setting\(s\) verify; valid: .*verify_checksums"),
    ({"direct_io": 1}, "direct_io = 1 must be true or false"),
    ({"check_root_owner": None}, "check_root_owner = None must be true or false"),
])
def test_the_row_store_checks_what_the_cache_checks(tmp_path, bad, match):
    with pytest.raises(ConfigError, match=match):
        RowStore(np.zeros((2, 4096), np.uint8), tmp_path / "r", capacity_blocks=8, **bad)


def test_a_job_id_is_not_reused_while_its_job_is_open(tmp_path, rng):
    rows = rng.integers(0, 256, (4, 4096), dtype=np.uint8)
    with RowStore(rows, tmp_path / "r", capacity_blocks=8) as st:
        st.submit_store([b"a" * 16], [0], job_id=7)
        with pytest.raises(ConfigError, match="job_id 7 is a job still in flight or not yet reported"):
            st.submit_store([b"b" * 16], [1], job_id=7)
        assert st.drain(30) and [r.job_id for r in st.finished()] == [7]
        st.submit_store([b"b" * 16], [1], job_id=7)  # reported: the id is free again
        assert st.drain(30) and [r.job_id for r in st.finished()] == [7]


def test_a_load_of_a_key_not_stored_zeroes_its_row(tmp_path, rng):
    rows = rng.integers(1, 256, (4, 4096), dtype=np.uint8)
    with RowStore(rows, tmp_path / "r", capacity_blocks=8) as st:
        st.submit_load([b"never stored key"], [2])
        assert st.drain(30)
        (res,) = st.finished()
        assert not res.success and not rows[2].any() and rows[1].all()


def test_a_closed_row_store_holds_no_export_of_the_engines_buffer(tmp_path, rng):
    """The engine may resize or free its buffer once the store is closed: no view of it stays
    (a bytearray refuses to grow while any export of it lives)."""
    buf = bytearray(rng.bytes(4 * 4096))
    keys = [rng.bytes(16) for _ in range(3)]
    with RowStore(buf, tmp_path / "r", capacity_blocks=8) as st:
        st.submit_store(keys, [0, 1, 2])
        assert st.drain(30) and all(r.success for r in st.finished())
        st.submit_load(keys, [3, 2, 1])
        assert st.drain(30) and all(r.success for r in st.finished())
    buf.extend(b"x")  # BufferError while a view is kept
    assert len(buf) == 4 * 4096 + 1


def test_a_root_opened_twice_in_one_process_says_so(make_config, rng):
    cfg = make_config(host_slots=8)
    with TierCache(cfg):
        with pytest.raises(RootError, match="already open in this process"):
            TierCache(cfg)


def test_purge_refuses_a_pool_name_that_is_a_path(make_config, rng):
    cfg = make_config(host_slots=8)
    with TierCache(cfg) as c:
        put_random(c, [1, 2], rng, tier="file")
    res = CliRunner().invoke(app, ["purge", "--root", str(cfg.root), "--pool", "../../etc", "--yes"])
    assert res.exit_code == 2 and "is not a pool name" in res.output
