"""`tiercache bench` as fio: options, job files (INI and TOML), fio-style JSON that parses and
adds up, the baseline, and every error path."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from tiercache.bench.fiospec import load_job_file
from tiercache.cli import app
from tiercache.cuda import cuda_status
from tiercache.settings import FileSettings, TransferSettings  # noqa: F401

runner = CliRunner()
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.fixture
def root_args(tmp_path):
    return ["--root", str(tmp_path / "root")]


def check_record(rec: dict, op: str, blocks: int, bs: int) -> None:
    d = rec[op]
    assert d["total_ios"] == blocks and d["io_bytes"] == blocks * bs
    secs = d["runtime"] / 1000
    assert secs > 0
    tol = 1 / d["runtime"] + 0.01  # runtime is whole milliseconds, as in fio
    assert d["bw_bytes"] == pytest.approx(d["io_bytes"] / secs, rel=tol)
    assert d["iops"] == pytest.approx(d["total_ios"] / secs, rel=tol)
    c = d["clat_ns"]
    p = c["percentile"]
    assert c["N"] == blocks and 0 < c["min"] <= p["50.000000"] <= p["99.000000"] <= c["max"]
    assert c["mean"] <= (d["runtime"] + 1) * 1e6  # runtime is truncated to whole milliseconds


def test_write_then_json_adds_up(root_args):
    t = time.perf_counter()
    res = runner.invoke(app, ["bench", "fio", "--rw", "randwrite", "--bs", "64k", "--nblocks", "40", "--iodepth", "8",
                              "--tiers", "host:file", "--output-format", "json", *root_args])
    wall = time.perf_counter() - t
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    (rec,) = doc["jobs"]
    check_record(rec, "write", 40, 65536)
    assert rec["read"]["total_ios"] == 0
    assert rec["write"]["runtime"] / 1000 <= wall  # no longer than the command itself took
    tc = rec["tiercache"]
    assert tc["tiers"] == "host:file" and tc["verified_blocks"] == 80 and "POSIX" in tc["path"]
    b = tc["baseline"]
    assert (
        b["op"] == "write"
        and b["bw_bytes"] > 0
        and b["ratio"] == pytest.approx(rec["write"]["bw_bytes"] / b["bw_bytes"], rel=0.01)
    )
    assert rec["job options"]["iodepth"] == "8" and rec["job options"]["iodepth_batch"] == "2"
    # the process's CPU over the timed phase, as fio's usr_cpu / sys_cpu, and per block
    cpu = tc["cpu_us_per_block"]
    assert rec["usr_cpu"] >= 0 and rec["sys_cpu"] >= 0 and cpu["user"] >= 0 and cpu["sys"] >= 0
    assert cpu["user"] + cpu["sys"] == pytest.approx(
        (rec["usr_cpu"] + rec["sys_cpu"]) / 100 * rec["write"]["runtime"] / 1000 / 40 * 1e6, rel=0.05, abs=200)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread CPU needs Linux /proc")
def test_fio_table_reads_saved_runs(root_args, tmp_path):
    """`bench fio-table` over a saved JSON run: one line per job with tiercache's GB/s, fio's
    and the ratio, as the run reported them; a file that is not such a run is a clear error."""
    res = runner.invoke(app, ["bench", "fio", "--rw", "randread", "--bs", "64k", "--nblocks", "24", "--iodepth", "4",
                              "--tiers", "host:file", "--output-format", "json", *root_args])
    assert res.exit_code == 0, res.output
    saved = tmp_path / "run.json"
    saved.write_text(res.stdout)
    (rec,) = json.loads(res.stdout)["jobs"]
    out = runner.invoke(app, ["bench", "fio-table", str(saved), str(saved)])
    assert out.exit_code == 0, out.output
    header, *rows = out.stdout.strip().splitlines()
    assert header.split()[:3] == ["job", "tiers", "tiercache"] and len(rows) == 2
    cols = rows[0].split()
    assert cols[1] == "host:file" and float(cols[2]) == pytest.approx(rec["read"]["bw_bytes"] / 1e9, abs=0.006)
    b = rec["tiercache"].get("baseline") or {}
    assert float(cols[4]) == pytest.approx(b.get("ratio", 0.0), abs=0.006)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    out = runner.invoke(app, ["bench", "fio-table", str(bad)])
    assert out.exit_code != 0 and "bad.json" in out.output and "not the JSON of a fio-style run" in out.output


def test_thread_cpu_tells_python_threads_from_native_ones():
    import threading

    from tiercache.bench.fiorun import thread_cpu

    spun, done = threading.Event(), threading.Event()

    def spin(s):
        end = time.thread_time() + s
        while time.thread_time() < end:
            pass
        spun.set()
        done.wait(10)  # alive while measured: an ended thread's time leaves /proc/self/task

    before = thread_cpu()
    t = threading.Thread(target=spin, args=(0.3,))
    t.start()
    assert spun.wait(10)
    after = thread_cpu()
    done.set()
    t.join()
    def total(d, kind):
        return d[f"{kind}_user"] + d[f"{kind}_sys"]

    # the spinning thread's time (user, and system: its clock reads are system calls) is Python's
    assert total(after, "python") - total(before, "python") >= 0.2
    assert total(after, "native") - total(before, "native") < 0.1  # no thread outside Python spun


def test_separate_timing_agrees(root_args, tmp_path):
    """The job's bandwidth is that of the same writes timed on their own, within disk noise."""
    from tiercache import PoolSpec
    from tiercache.files import FileTier, IOPath

    res = runner.invoke(
        app,
        [
            "bench",
            "fio",
            "--rw",
            "write",
            "--bs",
            "256k",
            "--nblocks",
            "64",
            "--iodepth",
            "32",
            "--iodepth_batch",
            "32",
            "--no-baseline",
            "--tiers",
            "host:file",
            "--output-format",
            "json",
            *root_args,
        ],
    )
    assert res.exit_code == 0, res.output
    fio_bw = json.loads(res.stdout)["jobs"][0]["write"]["bw_bytes"]
    pool = PoolSpec("bench", (256 * 1024,), "uint8")
    ft = FileTier((pool,), 64, IOPath("posix", "t"), FileSettings(root=tmp_path / "sep", fsync="data", direct_io=True))
    data = np.random.default_rng(0).integers(0, 256, (64, pool.block_nbytes), dtype=np.uint8)
    t = time.perf_counter()
    ft.write([(k, {"bench": data[k]}) for k in range(64)])
    sep_bw = 64 * pool.block_nbytes / (time.perf_counter() - t)
    ft.close()
    assert 0.25 < fio_bw / sep_bw < 4, (fio_bw, sep_bw)


def test_read_and_mixed(root_args):
    res = runner.invoke(app, ["bench", "fio", "--rw", "randrw", "--bs", "16k", "--nblocks", "64", "--iodepth", "4",
                              "--numjobs", "2", "--tiers", "host:file", "--output-format", "json", *root_args])
    assert res.exit_code == 0, res.output
    (rec,) = json.loads(res.stdout)["jobs"]
    assert rec["read"]["total_ios"] + rec["write"]["total_ios"] == 128
    assert rec["read"]["total_ios"] > 0 and rec["write"]["total_ios"] > 0
    assert rec["tiercache"]["verified_blocks"] == 256


def test_time_based(root_args):
    res = runner.invoke(app, ["bench", "fio", "--rw", "read", "--bs", "16k", "--nblocks", "8", "--iodepth", "4",
                              "--runtime", "0.5", "--time_based", "--tiers", "host:file", "--no-baseline",
                              "--output-format", "json", *root_args])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)["jobs"][0]["read"]
    assert d["total_ios"] > 8 and 400 <= d["runtime"] <= 5000  # looped over the 8 blocks for ~0.5 s


def test_job_files_ini_and_toml(tmp_path, root_args):
    ini = tmp_path / "two.ini"
    ini.write_text("[global]\ntiers=host:file\nbs=32k\nnblocks=16\niodepth=4\n\n[w]\nrw=write\n\n[r]\nrw=randread\n")
    toml = tmp_path / "one.toml"
    toml.write_text('[global]\ntiers = "host:file"\nbs = "32k"\n[jobs.t]\nrw = "read"\nnblocks = 8\n')
    res = runner.invoke(app, ["bench", "fio", str(ini), str(toml), "--output-format", "json", *root_args])
    assert res.exit_code == 0, res.output
    jobs = json.loads(res.stdout)["jobs"]
    assert [j["jobname"] for j in jobs] == ["w", "r", "t"]
    check_record(jobs[0], "write", 16, 32768)
    check_record(jobs[1], "read", 16, 32768)
    check_record(jobs[2], "read", 8, 32768)
    res = runner.invoke(app, ["bench", "fio", str(ini), *root_args])  # normal output reads like fio
    assert res.exit_code == 0
    assert (
        "w: (g=0): rw=write, bs=32KiB" in res.output
        and "IOPS=" in res.output
        and "clat percentiles (usec)" in res.output
    )
    assert "tiercache/baseline =" in res.output


def test_shipped_job_files_parse():
    files = sorted((CONFIGS / "jobs").iterdir())
    assert len(files) >= 4
    for f in files:
        jobs = load_job_file(f)
        assert jobs and all(j.rw and j.tiers for j in jobs)
    jobs = load_job_file(CONFIGS / "jobs" / "mixed.ini")
    assert jobs[0].numjobs == 2 and jobs[0].rwmixread == 70 and jobs[0].bs == 256 * 1024


def test_shipped_job_file_runs(root_args):
    res = runner.invoke(app, ["bench", "fio", str(CONFIGS / "jobs" / "randread-4k-aligned.ini"), "--size", "2m",
                              "--output-format", "json", *root_args])
    assert res.exit_code == 0, res.output
    assert [j["jobname"] for j in json.loads(res.stdout)["jobs"]] == ["randread-64k", "randread-2m"]


@pytest.mark.parametrize("args, fragment", [
    (["--rw", "sideways", "--tiers", "host:file"], "rw = 'sideways'"),
    (["--rw", "read", "--bs", "12q"], "bs = '12q' is not a size"),
    (["--rw", "read", "--tiers", "host:tape"], "tiers = 'host:tape'"),
    (["--rw", "read", "--iodepth", "0"], "iodepth = 0"),
    (["--rw", "read", "--iodepth", "4", "--iodepth_batch", "8"], "iodepth_batch = 8"),
    (["--rw", "read", "--time_based"], "time_based needs runtime"),
    (["/nonexistent/jobs.ini"], "does not exist"),
])
def test_fio_usage_errors(args, fragment, root_args):
    res = runner.invoke(app, ["bench", "fio", *args, *root_args])
    assert res.exit_code == 2, res.output
    assert fragment in res.output and "Traceback" not in res.output


def test_bad_job_files(tmp_path, root_args):
    cases = {"syntax.ini": ("[global\nbs=4k\n", "not a valid fio job file"),
             "unknown.ini": ("[j]\nrw=read\nfrobnicate=3\n", "unknown option 'frobnicate'"),
             "empty.ini": ("[global]\nbs=4k\n", "no jobs"),
             "bad.toml": ("[global]\nbs = \n", "not valid TOML"),
             "table.toml": ("[job.x]\nrw='read'\n", "unknown table")}
    for name, (text, fragment) in cases.items():
        p = tmp_path / name
        p.write_text(text)
        res = runner.invoke(app, ["bench", "fio", str(p), *root_args])
        assert res.exit_code == 2 and fragment in res.output, (name, res.output)


@pytest.mark.skipif(cuda_status().available, reason="checks the no-GPU error")
def test_device_tiers_without_gpu(root_args):
    res = runner.invoke(app, ["bench", "fio", "--rw", "read", "--tiers", "device:host", *root_args])
    assert res.exit_code == 2 and "needs a GPU" in res.output


def test_plot(tmp_path, root_args):
    out = tmp_path / "p.png"
    res = runner.invoke(app, ["bench", "fio", "--rw", "write", "--bs", "16k", "--nblocks", "8", "--tiers", "host:file",
                              "--plot", str(out), *root_args])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert res.exit_code == 2 and "needs matplotlib" in res.output
        return
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fio_subprocess(root_args):
    res = subprocess.run([sys.executable, "-m", "tiercache.cli.app", "bench", "fio", "--rw", "read", "--bs", "16k",
                          "--nblocks", "8", "--tiers", "host:file", "--output-format", "json", *root_args],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["jobs"][0]["read"]["total_ios"] == 8


needs_fio = pytest.mark.skipif(
    __import__("shutil").which("fio") is None, reason="fio is not installed (apt-get install fio)"
)


@needs_fio
@pytest.mark.parametrize("rw", ["randread", "randwrite"])
def test_fio_is_the_baseline_on_the_same_directory(root_args, rw):
    """With fio installed, a file job is compared with fio running the same job (same bs,
    iodepth, bytes, direct) on the same directory; writes also durably (fdatasync=1)."""
    res = runner.invoke(app, ["bench", "fio", "--rw", rw, "--bs", "16k", "--nblocks", "64", "--iodepth", "8",
                              "--tiers", "host:file", "--baseline", "fio", "--output-format", "json", *root_args])
    assert res.exit_code == 0, res.output
    (rec,) = json.loads(res.stdout)["jobs"]
    op = rw.removeprefix("rand")
    tc = rec["tiercache"]
    b = tc["baseline"]
    assert b["method"].startswith("fio") and b["op"] == op and b["bw_bytes"] > 0 and b["clat_p99_ns"] > 0
    assert "--bs=16384" in b["command"] and "--iodepth=8" in b["command"] and f"--rw={rw}" in b["command"]
    assert f"--size={64 * 16384}" in b["command"] and "--direct=1" in b["command"]
    assert b["ratio"] == pytest.approx(rec[op]["bw_bytes"] / b["bw_bytes"], rel=0.01)
    assert b["tiercache_clat_p99_ns"] == rec[op]["clat_ns"]["percentile"]["99.000000"]
    assert ("baseline_durable" in tc) == (op == "write")
    if op == "write":
        assert "fdatasync=1" in tc["baseline_durable"]["method"]
    text = runner.invoke(app, ["bench", "fio", "--rw", rw, "--bs", "16k", "--nblocks", "16", "--iodepth", "4",
                               "--tiers", "host:file", *root_args]).output
    assert "baseline (fio" in text and "clat p50/p99 (usec): fio" in text


def test_without_fio_auto_is_naive_and_fio_is_a_clear_error(root_args, monkeypatch, tmp_path):
    monkeypatch.setenv("TIERCACHE_FIO", str(tmp_path / "no-fio-here"))
    res = runner.invoke(app, ["bench", "fio", "--rw", "read", "--bs", "16k", "--nblocks", "8", "--iodepth", "4",
                              "--tiers", "host:file", "--output-format", "json", *root_args])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["jobs"][0]["tiercache"]["baseline"]["method"].startswith("pread/pwrite")
    res = runner.invoke(app, ["bench", "fio", "--rw", "read", "--bs", "16k", "--nblocks", "8", "--tiers", "host:file",
                              "--baseline", "fio", *root_args])
    assert res.exit_code == 2 and "fio is not installed" in res.output


def test_repeat_reports_the_median_of_alternated_passes(root_args):
    res = runner.invoke(app, ["bench", "fio", "--rw", "randread", "--bs", "16k", "--nblocks", "16", "--iodepth", "4",
                              "--tiers", "host:file", "--baseline", "naive", "--repeat", "3", "--output-format", "json",
                              *root_args])
    assert res.exit_code == 0, res.output
    tc = json.loads(res.stdout)["jobs"][0]["tiercache"]
    ratios = sorted(p["baseline_ratio"] for p in tc["passes"])
    assert len(ratios) == 3 and tc["baseline"]["ratio_median"] == ratios[1] == tc["baseline"]["ratio"]
    assert tc["baseline"]["ratio_range"] == [ratios[0], ratios[2]]
