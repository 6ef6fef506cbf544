"""``tiercache bench scale``: a small root through every phase, the report's numbers
consistent with what was done (CPU; fio where installed)."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from tiercache.bench.benchscale import format_scale_report, run_scale_bench
from tiercache.cli import app
from tiercache.errors import ConfigError


def test_scale_job_from_the_cli(tmp_path):
    res = CliRunner().invoke(app, ["bench", "scale", "--blocks", "700", "--root", str(tmp_path),
                                   "--no-baseline", "--output-format", "json", "--seed", "5"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["ok"] and rep["blocks"] == 700 and rep["block_bytes"] == 4096 and rep["seed"] == 5
    ix = rep["index"]
    assert ix["blocks"] == 700 and ix["open_s"] > 0 and ix["lookup"]["missing"] == 0 and ix["get"]["wrong"] == 0
    assert ix["lookup"]["p50_us"] <= ix["lookup"]["p99_us"] and ix["get"]["p50_us"] <= ix["get"]["p99_us"]
    assert "scan" not in rep and "fio" not in rep  # --no-baseline
    assert rep["verify"]["checked"] == 700 and rep["verify"]["bad"] == 0 and rep["purge_left"] == 0
    assert not any(tmp_path.iterdir())  # the job's directory removed


def test_scale_job_with_its_baselines(tmp_path):
    rep = run_scale_bench(tmp_path, blocks=300, block_bytes=8192, fio_runtime=0.3, seed=9, log=lambda s: None)
    assert rep["ok"], rep
    assert rep["scan"]["blocks"] == 300 and rep["scan"]["open_s"] > 0 and rep["file_bytes"] == 12288
    if shutil.which("fio"):
        assert rep["fio"]["read_gbps"] > 0 and rep["verify_vs_fio"] == rep["verify"]["gbps"] / rep["fio"]["read_gbps"]
    text = format_scale_report(rep)
    assert "open from saved index" in text and "open by full scan" in text and "every block found" in text


@pytest.mark.parametrize("blocks, bs", [(0, 4096), (10, 1000), (10, 0)])
def test_scale_job_refuses_bad_sizes(tmp_path, blocks, bs):
    with pytest.raises(ConfigError, match="block|blocks"):
        run_scale_bench(tmp_path, blocks=blocks, block_bytes=bs, log=lambda s: None)
