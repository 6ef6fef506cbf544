"""Copy-path calibration: the threshold choice (CPU, on made-up measurements), its TOML output,
the command without a GPU, and a real run on the GPU."""

from __future__ import annotations

import tomllib

import pytest
from typer.testing import CliRunner

from cli.app import app
from tiercache import ConfigError
from tiercache.bench.calibrate import KiB, MiB, calibrate, crossover, format_calibration
from tiercache.config import config_from_dict
from tiercache.cuda import cuda_status


def rows(kind, table):
    """``table``: {bytes: (sm_h2d, ce_h2d, sm_d2h, ce_d2h)} -> measurement rows."""
    out = []
    for size, (sh, ch, sd, cd) in table.items():
        out.append({"kind": kind, "bytes": size, "direction": "h2d", "sm_gbps": sh, "ce_gbps": ch})
        out.append({"kind": kind, "bytes": size, "direction": "d2h", "sm_gbps": sd, "ce_gbps": cd})
    return out


H100_LIKE = {16 * KiB: (49, 5, 50, 20), 64 * KiB: (50, 46, 51, 45), 256 * KiB: (50, 53, 51, 52),
             2 * MiB: (50, 54, 51, 54)}


def test_copy_engines_win_from_the_first_size_where_both_directions_keep_up():
    assert crossover(rows("blocks", H100_LIKE), "blocks", 0.97) == (256 * KiB, True)
    # at a looser tolerance 64 KiB counts: 46/50 = 0.92 and 45/51 = 0.88
    assert crossover(rows("blocks", H100_LIKE), "blocks", 0.88) == (64 * KiB, True)


def test_a_loss_above_a_win_moves_the_threshold_up():
    table = dict(H100_LIKE)
    table[1 * MiB] = (50, 40, 51, 52)  # the copy engines lose h2d at 1 MiB: only 2 MiB counts
    assert crossover(rows("blocks", table), "blocks", 0.97) == (2 * MiB, True)


def test_copy_engines_that_never_catch_up():
    table = {s: (50, 30, 50, 30) for s in (KiB, 4 * KiB, 8 * MiB)}
    assert crossover(rows("runs", table), "runs", 0.97) == (16 * MiB, False)
    everywhere = {s: (50, 55, 50, 55) for s in (128 * KiB, 1 * MiB)}
    assert crossover(rows("runs", everywhere), "runs", 0.97) == (128 * KiB, True)


def test_bad_arguments():
    with pytest.raises(ConfigError, match="tolerance = 0"):
        crossover(rows("blocks", H100_LIKE), "blocks", 0)
    with pytest.raises(ConfigError, match="no measurements of kind 'runs'"):
        crossover(rows("blocks", H100_LIKE), "runs", 0.97)
    with pytest.raises(ConfigError, match="tolerance = 3"):
        calibrate(tolerance=3)


def test_printed_lines_are_a_valid_transfer_table():
    rs = rows("blocks", H100_LIKE) + rows("runs", {s: (50, 30, 50, 30) for s in (128 * KiB, 8 * MiB)})
    for r in rs:
        r.update(sm_path="bulk", ce_path="batch" if r["kind"] == "blocks" else "memcpy",
                 ratio=r["ce_gbps"] / r["sm_gbps"])
    rep = {"tolerance": 0.97, "rows": rs, "transfer": {"batch_min_bytes": 262144, "memcpy_min_bytes": 16 * MiB},
           "reached": {"batch_min_bytes": True, "memcpy_min_bytes": False}}
    text = format_calibration(rep)
    assert ["blocks", "256", "KiB", "h2d", "bulk", "50.0", "batch", "53.0", "106%"] in [
        ln.split() for ln in text.splitlines()
    ]
    table = tomllib.loads(text[text.index("[transfer]"):])
    assert table == {"transfer": {"batch_min_bytes": 262144, "memcpy_min_bytes": 16 * MiB}}
    assert "never caught up" in text.splitlines()[-1]
    cfg = config_from_dict(
        {**table, "tiers": {"host_slots": 4}, "pools": {"a": {"block_shape": [16], "dtype": "uint8"}}}
    )
    assert cfg.batch_min_bytes == 262144 and cfg.memcpy_min_bytes == 16 * MiB


@pytest.mark.skipif(cuda_status().available, reason="checks the no-GPU error")
def test_command_without_a_gpu_says_so():
    res = CliRunner().invoke(app, ["calibrate", "--quick"])
    assert res.exit_code == 2 and "calibration needs a GPU" in res.output


@pytest.mark.gpu
def test_calibration_on_the_gpu():
    """A quick run measures every size both ways, and what it prints loads as a config."""
    res = CliRunner().invoke(app, ["calibrate", "--quick", "--json"])
    assert res.exit_code == 0, res.output
    import json

    rep = json.loads(res.stdout)
    kinds = {(r["kind"], r["bytes"], r["direction"]) for r in rep["rows"]}
    assert len(kinds) == len(rep["rows"]) and all(r["sm_gbps"] > 1 and r["ce_gbps"] > 0.1 for r in rep["rows"])
    assert {"memcpy_min_bytes"} <= set(rep["transfer"])
    cfg = config_from_dict({"transfer": rep["transfer"], "tiers": {"host_slots": 4},
                            "pools": {"a": {"block_shape": [16], "dtype": "uint8"}}})
    assert cfg.memcpy_min_bytes == rep["transfer"]["memcpy_min_bytes"]
