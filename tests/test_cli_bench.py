"""`tiercache bench` (the main job) through typer's runner and as a real subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tiercache.cli import app

SMALL = """
[tiers]
device_slots = 24
host_slots = 24
file_slots = 64
[file]
root = "{root}"
fsync = "none"
io_threads = 4
[pools.kv]
num_layers = 2
kv_factor = 2
num_kv_heads = 2
tokens_per_block = 16
head_dim = 64
dtype = "bfloat16"
[pools.act]
block_shape = [1000]
dtype = "float32"
"""


@pytest.fixture
def small_config(tmp_path):
    p = tmp_path / "small.toml"
    p.write_text(SMALL.format(root=tmp_path / "root"))
    return p


def test_bench_json_via_runner(small_config):
    res = CliRunner().invoke(app, ["bench", "--config", str(small_config), "--output-format", "json", "--batch", "5"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["ok"] is True and rep["batch"] == 5
    assert rep["block_nbytes"] == 2 * 2 * 2 * 16 * 64 * 2 + 4000
    stages = [s["stage"] for s in rep["stages"]]
    assert "reopen" in stages and any(s.endswith("-> file") for s in stages)
    for s in rep["stages"]:
        if s["stage"].startswith("reopen"):
            continue
        assert s["blocks"] == rep["blocks"] == 24
        assert s["bytes"] == 24 * rep["block_nbytes"] and s["gb_per_s"] > 0
        assert s["lat_ms"]["p99"] >= s["lat_ms"]["p50"] > 0
    assert all(v["mismatched"] == 0 and v["verified_blocks"] == 24 for v in rep["verify"])
    assert rep["io_path"]["name"] in ("gds", "compat", "posix")
    # the job's directory is removed afterwards
    assert not list((small_config.parent / "root").glob("bench-*"))


def test_bench_normal_output_subprocess(small_config):
    exe = shutil.which("tiercache")
    cmd = [exe] if exe else [sys.executable, "-m", "tiercache.cli.app"]
    res = subprocess.run([*cmd, "bench", "--config", str(small_config), "--blocks", "10", "--seed", "7"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "I/O path:" in out and "GB/s" in out and "lat p50 ms" in out
    assert "10/10 blocks byte-exact: OK" in out and "result: OK" in out
    assert "seed 7" in out


def test_login_node_falls_back_with_one_log_line(small_config):
    """GPU packages installed, no GPU: POSIX with one clear line, exit 0 (simulated on GPU hosts)."""
    env = dict(os.environ, TIERCACHE_DISABLE_CUDA="1")
    res = subprocess.run([sys.executable, "-m", "tiercache.cli.app", "bench", "--config", str(small_config),
                          "--output-format", "json"], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["io_path"]["name"] == "posix" and "device" not in rep["tiers"]
    lines = [ln for ln in res.stderr.splitlines() if "CUDA unavailable" in ln]
    assert len(lines) == 1 and "device tier off" in lines[0]
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["bench", "--config", "/nonexistent/x.toml"], "does not exist"),
        (["bench", "--batch", "0"], "--batch"),
        (["bench", "--io", "warp"], "warp"),
    ],
)
def test_bench_usage_errors(args, fragment):
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2
    assert fragment in res.output
    assert "Traceback" not in res.output


def test_vllm_serve_takes_connector_settings_and_variants(tmp_path, monkeypatch):
    """``--connector-set`` and each ``--connector-variant`` (comma-separated, values as JSON
    where they parse) reach the bench as the run's settings and one dict per variant."""
    import tiercache.bench.benchvllmserve as serve

    seen: dict = {}
    monkeypatch.setattr(serve, "run_serve_bench", lambda base, **kw: seen.update(kw) or {"ok": True})
    monkeypatch.setattr(serve, "format_serve_report", lambda rep: "report")
    res = CliRunner().invoke(app, ["bench", "vllm-serve", "--model", "llama-3.1-8b", "--root", str(tmp_path),
                                   "--connector-set", "io_engine=threads", "--connector-variant", "piece_blocks=64",
                                   "--connector-variant", "load_switch_s=0.0002,io_threads=8"])
    assert res.exit_code == 0, res.output
    assert seen["connector_settings"] == {"io_engine": "threads"}
    assert seen["connector_variants"] == [{"piece_blocks": 64}, {"load_switch_s": 0.0002, "io_threads": 8}]
    assert seen["async_scheduling"] is None  # vLLM's default
    for flag, want in (("--no-async-scheduling", False), ("--async-scheduling", True)):
        res = CliRunner().invoke(app, ["bench", "vllm-serve", "--model", "llama-3.1-8b", "--root", str(tmp_path), flag])
        assert res.exit_code == 0 and seen["async_scheduling"] is want, res.output
    res = CliRunner().invoke(app, ["bench", "vllm-serve", "--root", str(tmp_path),
                                   "--connector-variant", "piece_blocks"])
    assert res.exit_code == 2 and "--connector-variant 'piece_blocks': give KEY=VALUE" in res.output


def test_bench_blocks_out_of_range(small_config):
    res = CliRunner().invoke(app, ["bench", "--config", str(small_config), "--blocks", "1000"])
    assert res.exit_code == 2
    assert "blocks = 1000 must be in [1, 24]" in res.output


def test_bench_fails_on_bad_bytes(small_config, monkeypatch):
    """Exit code 1 when verification finds a difference (corrupt the bytes in flight)."""
    import numpy as np

    from tiercache.files import posix_io

    real = posix_io.read_block

    def flip(path, key, pool, out, verify, *args):
        real(path, key, pool, out, False, *args)
        np.asarray(out)[0] ^= 1  # damage after the checksum would have been checked

    monkeypatch.setattr(posix_io, "read_block", flip)  # the python engine's read
    small_config.write_text(small_config.read_text().replace('io_threads = 4', 'io_threads = 4\nio_engine = "python"'))
    monkeypatch.setenv("TIERCACHE_DISABLE_CUDA", "1")
    from tiercache import cuda

    cuda.cuda_status.cache_clear()
    try:
        res = CliRunner().invoke(app, ["bench", "--config", str(small_config), "--blocks", "4", "--io", "posix"])
    finally:
        cuda.cuda_status.cache_clear()
    assert res.exit_code == 1, res.output
    assert "FAILED" in res.output


def test_file_bench_json(small_config):
    res = CliRunner().invoke(app, ["bench", "file", "--config", str(small_config), "--blocks", "8",
                                   "--output-format", "json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    stages = {s["stage"]: s for s in rep["stages"]}
    for name in ("raw write (O_DIRECT, fsync)", "raw cold read (O_DIRECT)", "block files durable write",
                 "block files cold read", "block files cold read via aiofiles", "block files warm read"):
        assert stages[name]["gb_per_s"] > 0, name
    assert 0 < stages["block files cold read"]["ratio_to_raw"]
    assert rep["bytes"] == 8 * rep["block_bytes"]
    assert not list((small_config.parent / "root").glob("filebench-*"))


def test_file_bench_repeat_takes_medians(small_config):
    res = CliRunner().invoke(app, ["bench", "file", "--config", str(small_config), "--blocks", "4",
                                   "--repeat", "3", "--output-format", "json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["repeats"] == 3 and len(rep["passes"]) == 3
    for j, stage in enumerate(rep["stages"]):
        per_pass = sorted(p["stages"][j]["gb_per_s"] for p in rep["passes"])
        assert stage["gb_per_s"] == per_pass[1], stage["stage"]
        if "ratio_to_raw" in stage:
            lo, hi = stage["ratio_range"]
            assert lo <= stage["ratio_to_raw"] <= hi


def test_overlap_table_names_each_method_and_both_slowdowns():
    """The overlap part of the copy report (its numbers come from the GPU; the table is CPU)."""
    from tiercache.bench.benchoverlap import format_overlap_report

    def row(method, direction, layout, k, path, alone, beside, full, cost):
        return {"method": method, "direction": direction, "layout": layout, "carveout": k, "path": path,
                "alone_ratio": alone, "beside_ratio": beside, "vs_full": full, "carveout_cost": cost,
                "vs_carved": (1 + full) / (1 + cost) - 1}
    rep = {"matmul": 8192, "iters": 20, "rounds": 5, "product_alone_s": 0.031, "product_tflops": 707.0,
           "contiguous_gbps": {"h2d": 53.7, "d2h": 55.1}, "blocks": 8192, "block_bytes": 16384,
           "runs": [row("contiguous", "h2d", "-", 0, "memcpy", 0.99, 0.95, 0.017, 0.0),
                    row("tiercache", "h2d", "scattered", 4, "bulk", 0.88, 0.88, 0.015, 0.005)]}
    text = format_overlap_report(rep)
    lines = text.splitlines()
    assert "contiguous 53.7 GB/s h2d, 55.1 d2h" in lines[0] and "medians of 5 rounds" in lines[0]
    carved = next(ln for ln in lines if "scattered" in ln)
    assert carved.split() == ["tiercache", "h2d", "scattered", "4", "bulk", "88%", "88%", "+1.5%", "+0.5%", "+1.0%"]


def test_copy_report_names_the_host_pages(monkeypatch):
    """The copy report's header and partial-copy table say which pages the host blocks were on
    (huge pages by default where reserved)."""
    from tiercache.bench.benchcopy import format_copy_report

    sc = {"block_bytes": 16384, "direction": "h2d", "layout": "scattered", "contiguous_gbps": 55.0,
          "tiercache_gbps": 50.0, "tiercache_ratio": 50 / 55, "tiercache_path": "bulk", "kernel_gbps": 49.0,
          "kernel_ratio": 49 / 55, "naive_gbps": 5.5, "naive_ratio": 0.1, "host_page_bytes": 2 << 20}

    def part(pages, ratio):
        return {"layout": "layer_major" if pages > 4096 else "token_major", "num_tokens": 1, "direction": "h2d",
                "segment_bytes": 256, "partial_gbps": 55 * ratio,
                "contiguous_gbps": 55.0, "ratio": ratio, "host_page_bytes": pages}
    rep = {"device": "dev", "copy_kernel_sms": 8, "scattered": [sc], "partial": [part(2 << 20, 0.91), part(4096, 0.5)],
           "planning": {"blocks": 4096, "submit_us_per_block": 0.4, "plan_us_per_block": 0.01},
           "overlap": {"error": "skipped"}}
    import tiercache.bench.benchoverlap as bo

    monkeypatch.setattr(bo, "format_overlap_report", lambda r: "overlap")
    text = format_copy_report(rep)
    assert "host memory on 2 MiB pages" in text.splitlines()[0]
    rows = [ln.split() for ln in text.splitlines() if "/16 tok" in ln]
    assert [r[2] for r in rows] == ["layer_major", "token_major"]
    assert [r[5:7] for r in rows] == [["2", "MiB"], ["4", "KiB"]]
    assert [r[-1] for r in rows] == ["91%", "50%"]


def test_hf_report_shows_every_measure():
    """The hf job's table (its runs need a GPU; the report is plain text from the run records)."""
    from tiercache.bench.benchhf import format_hf_report

    run = {"context": 16384, "ttft_s": 0.25, "decode_tok_s": 41.5, "pcie_bound_tok_s": 99.0, "share_of_bound": 0.42,
           "peak_vram_bytes": 1156 << 20, "decode_peak_vram_bytes": 133 << 20, "pinned_bytes": 512 << 20,
           "identical": False, "first_divergence": 26, "max_logit_diff": 0.03125, "gpu_wait_ms_per_step": 0.4,
           "cold_decode_tok_s": 12.5, "forward_host_ms_per_step": 10.25, "step_ms": 17.5,
           "decode_tok_s_passes": [40.25, 41.5, 43.0]}
    files = {**run, "mode": "tiercache-files", "ring_layers": 2, "cache_host_ms_per_step": 3.25, "file_read_gbps": 0.89,
             "vs_plain": 0.8125, "vs_ceiling": 0.875,
             "kv_over_host": 2.5, "disk": {"read_gbps": 1.45}}
    text = format_hf_report({"gpu": "H100", "h2d_gbps": 52.5, "kv_bytes_per_token": 32768, "batch": 1, "ok": True,
                             "runs": [{**run, "mode": "offloaded"}, {**files, "tails": "host"},
                                      {**run, "mode": "tiercache-host", "ring_layers": 3, "tails": "device"}]})
    lines = text.splitlines()
    assert lines[2].split()[:10] == ["offloaded", "16384", "0.25", "41.5", "99.0", "0.42", "1156", "133", "512",
                                     "False"]
    assert ("(26, 0.0312); passes 40.2/41.5/43.0; cold run 12.5 tok/s; GPU wait 0.4 ms/step, forward 10.2 of 17.5 "
            "ms/step") in lines[2]
    assert "cache host" not in lines[2] and "R=" not in lines[2]
    assert lines[3].startswith("tiercache-files R=2 ") and lines[3].endswith("cache host 3.2 ms/step")
    assert "; vs plain 0.81; vs ceiling 0.88; GPU wait" in lines[3] and "vs plain" not in lines[2]
    assert "KV 2.5x the host tier; read 0.89 GB/s from files vs fio 1.45 GB/s (0.61)" in lines[4]
    assert lines[5].startswith("tiercache-host R=3 tails=device ")  # tails named where not in host memory
    assert lines[-1].startswith("tiercache's tokens: identical")


def test_hf_median_pass_keeps_the_worst_token_comparison():
    from tiercache.bench.benchhf import _median_pass

    recs = [{"decode_tok_s": 30.0, "identical": True, "first_divergence": None, "max_logit_diff": 0.0, "ttft_s": 1},
            {"decode_tok_s": 10.0, "identical": False, "first_divergence": 7, "max_logit_diff": 0.25, "ttft_s": 2},
            {"decode_tok_s": 20.0, "identical": False, "first_divergence": 4, "max_logit_diff": 0.125, "ttft_s": 3}]
    rec = _median_pass(recs)
    assert rec["decode_tok_s"] == 20.0 and rec["ttft_s"] == 3  # the median pass's own record
    assert rec["decode_tok_s_passes"] == [30.0, 10.0, 20.0]
    assert (rec["identical"], rec["first_divergence"], rec["max_logit_diff"]) == (False, 4, 0.25)
    assert recs[2]["first_divergence"] == 4 and "decode_tok_s_passes" not in recs[2]  # inputs untouched


def test_bench_is_a_command_group_each_job_with_its_own_options():
    """`tiercache bench JOB --help` lists that job's options only; a job's option given to
    another job is a usage error (exit 2, one line); `bench fio` without a job is one too."""
    runner = CliRunner()
    jobs = ["main", "fio", "copy", "file", "layerwise", "metrics", "shared", "vllm-tier", "vllm-serve", "scale", "hf",
            "array"]
    top = runner.invoke(app, ["bench", "--help"], terminal_width=200)
    assert top.exit_code == 0 and all(j in top.output for j in jobs)
    own = {"fio": "--iodepth", "vllm-serve": "--prefix-tokens", "hf": "--ring-layers", "shared": "--procs"}
    for job, opt in own.items():
        text = runner.invoke(app, ["bench", job, "--help"], terminal_width=200).output
        assert opt in text, (job, opt)
        for other, other_opt in own.items():
            if other != job:
                assert other_opt not in text, (job, other_opt)
    res = runner.invoke(app, ["bench", "copy", "--procs", "3"])
    assert res.exit_code == 2 and "No such option" in res.output and len(res.output.strip().splitlines()) == 1
    res = runner.invoke(app, ["bench", "fio"])
    assert res.exit_code == 2 and "give job files or at least one job option" in res.output


def test_array_bench_over_two_roots_verifies_every_path(tmp_path):
    """`tiercache bench array` over two directories: the cache's offload/onboard, the row
    store's stores/loads and a plain caller (fresh processes) run over a root array of both,
    every byte verified, nothing left."""
    roots = [tmp_path / "d0", tmp_path / "d1"]
    for r in roots:
        r.mkdir()
    res = CliRunner().invoke(app, ["bench", "array", "--root", str(roots[0]), "--root", str(roots[1]), "--bs", "64k",
                                   "--size", "4m", "--tiers", "host:file", "--no-baseline", "--output-format", "json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output[res.output.index("{"):])
    assert rep["ok"] and rep["roots"] == [str(r) for r in roots] and rep["batch"] == 32
    (row,) = rep["sizes"]
    assert set(row["paths"]) == {"host:file write", "host:file read", "rowstore store", "rowstore load",
                                 "plain offload", "plain get"}
    assert row["paths"]["host:file read"]["runs"][0]["verified"] == 2 * 64
    assert row["paths"]["rowstore load"]["runs"][0]["verified"] == 64
    assert row["paths"]["plain get"]["runs"][0]["verified"] == 64
    for name, path in row["paths"].items():  # every path reports its CPU per block
        cpu = path["runs"][0]["cpu_us_per_block"]
        assert cpu["user"] >= 0 and cpu["sys"] >= 0 and cpu["user"] + cpu["sys"] > 0, name
    assert all(p["gbps_median"] > 0 for p in row["paths"].values())
    assert not [p for r in roots for p in r.iterdir()]  # the job's directories are removed


@pytest.mark.skipif(shutil.which("fio") is None and not os.environ.get("TIERCACHE_FIO"), reason="fio not installed")
def test_fio_runs_one_job_on_several_directories_at_once(tmp_path):
    from tiercache.bench.fiobase import run_fio
    from tiercache.bench.fiospec import FioJob

    dirs = [tmp_path / "a", tmp_path / "b"]
    job = FioJob(name="two", rw="write", bs=65536, iodepth=4, numjobs=2, direct=False)
    r = run_fio(job, 65536, 16, dirs, "write")
    assert r["bw_bytes"] > 0
    # each directory got numjobs files of 16 blocks written, and they are removed after
    assert "--name=twod0" in r["command"] and "--name=twod1" in r["command"]
    assert not [p for d in dirs for p in d.iterdir()]


@pytest.mark.skipif(shutil.which("fio") is None and not os.environ.get("TIERCACHE_FIO"), reason="fio not installed")
def test_best_fio_reports_every_grid_point_and_the_best_of_them(tmp_path, monkeypatch):
    """fio's best is the largest of the grid it reports, point by point (a report shows how far
    the best is from the other points: at large blocks on a 300 MiB-cache CPU, fio's best read
    reuses buffers that fit in that cache)."""
    import tiercache.bench.fiobase as fiobase
    from tiercache.bench.fiobase import FIO_GRID, best_fio

    size = fiobase.last_level_cache_bytes()
    assert size is None or size >= 1 << 20  # this machine's own: a last-level cache of a MiB or more
    cache_bytes = 4 << 20  # of the grid's points at 64 KiB, 1x128 and 16x8 (8 MiB of buffers) exceed it
    monkeypatch.setattr(fiobase, "last_level_cache_bytes", lambda: cache_bytes)
    r = best_fio(tmp_path, 65536, 2 << 20, 0.2)
    assert "errors" not in r, r.get("errors")
    assert r["cache_bytes"] == cache_bytes
    beyond = {f"numjobs={n} iodepth={d}" for n, d in FIO_GRID if n * d * 65536 > cache_bytes}
    assert beyond == {"numjobs=1 iodepth=128", "numjobs=16 iodepth=8"}
    for op in ("read", "write"):
        grid = r[f"{op}_grid"]
        assert set(grid) == {f"numjobs={n} iodepth={d}" for n, d in FIO_GRID}
        point = " ".join(r[f"{op}_config"].split()[:2])  # "numjobs=N iodepth=D ENGINE"
        assert r[f"{op}_gbps"] == grid[point] == max(grid.values()) > 0  # (points may tie)
        far = r[f"{op}_beyond_cache_config"]
        assert far in beyond and r[f"{op}_beyond_cache_gbps"] == grid[far] == max(grid[p] for p in beyond)
    assert not (tmp_path / "fio").exists()


def test_format_limit_writes_publishes_and_reads_every_file_then_removes_them(tmp_path):
    """The format's limit (kernels/formatlimit.c) over two directories: every file is written
    under its temporary name and renamed (the read pass would fail on a missing final name),
    read back, and nothing is left; a pass over files that are not there reports their error."""
    import numpy as np

    from tiercache.bench.formatlimit import _lib, _run, format_limit

    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    r = format_limit(dirs, 16384, 64 * 16384, inflight=(1, 4))
    assert r["files"] == 64 and r["write_gbps"] > 0 and r["read_gbps"] > 0
    assert r["read_inflight"] in (1, 4) and set(r["cpu_us_per_block"]) == {"write", "read"}
    assert len(r["fs"]) == 2 and all(isinstance(f, str) and f for f in r["fs"])
    assert not [p for d in dirs for p in d.iterdir()]
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        names = b"t0\0f0\0"
        with pytest.raises(FileNotFoundError):
            _run(_lib(), 1, np.array([fd], np.int32), names, np.array([0], np.int64), np.array([3], np.int64),
                 8192, 1, False)
    finally:
        os.close(fd)


def test_hf_bench_plans_runs_and_summarizes_passes_on_the_cpu():
    """bench hf's run plan (plain first at each context, each tiercache mode per variant, the
    files mode with a plain reference at its own context) and its summary of passes (median
    pass, cold figures, share of the PCIe bound, paired ratios), without a GPU."""
    from tiercache.bench.benchhf import _plan, _run_line, _summarize

    variants = [(2, "host"), (4, "host")]
    plan = _plan((1024, 2048), ("tiercache-host", "tiercache-files", "plain-h2d"), variants, 512)
    assert list(plan) == [1024, 2048, 512]
    assert plan[1024][0] == ("plain", None) and plan[512] == [("plain", None), ("tiercache-files", variants[0]),
                                                             ("tiercache-files", variants[1])]
    assert [e for e in plan[2048] if e[0] == "tiercache-host"] == [("tiercache-host", v) for v in variants]

    def rec(mode, tok_s, variant=None):
        return {"mode": mode, "decode_tok_s": tok_s, "new_tokens": 32, "identical": True, "first_divergence": None,
                "max_logit_diff": 0.0, "ttft_s": 0.1, "peak_vram_bytes": 1 << 30, "decode_peak_vram_bytes": 1 << 29,
                "gpu_wait_ms_per_step": 1.0, "forward_host_ms_per_step": 2.0, "step_ms": 5.0,
                "ring_layers": variant[0] if variant else None}

    e, base = ("tiercache-host", variants[0]), ("plain", None)
    passes = {e: [rec(*e[:1], t, e[1]) for t in (90.0, 100.0, 80.0)], base: [rec("plain", t) for t in (100, 125, 100)]}
    cold = {e: rec("tiercache-host", 50.0, e[1]), base: rec("plain", 60.0)}
    out = _summarize(e, passes, cold, 1024, 50.0, 1 << 17)
    assert out["decode_tok_s"] == 90.0 and out["decode_tok_s_passes"] == [90.0, 100.0, 80.0]
    assert out["cold_decode_tok_s"] == 50.0
    assert out["vs_plain"] == pytest.approx(0.8)  # median of 0.9, 0.8, 0.8
    assert out["pcie_bound_tok_s"] == pytest.approx(50e9 / ((1 << 17) * (1024 - 16)))
    assert "tiercache-host R=2" in _run_line(out, 1024)
