"""``tiercache bench vllm-tier``: TierCacheTier against vLLM's own ``fs`` tier, through
vLLM's secondary-tier interface, on the same directory and the same primary buffer, in one run.

Both tiers are built by vLLM's ``SecondaryTierFactory`` over one page-aligned buffer of rows
(the CPU primary tier's ``[num_chunks, row_bytes]``) and driven as vLLM's tiering manager
drives them: ``submit_store`` / ``submit_load`` jobs of ``chunks_per_job`` chunks, at most
``jobs_in_flight`` outstanding, ``get_finished_jobs`` polled meanwhile. Per row size and pass:

- **store** and **load** GB/s: every chunk of the buffer (``total_bytes``) stored into a fresh
  directory, then loaded back into a random permutation of the rows and compared byte for
  byte (outside the timing). vLLM's ``fs`` tier (its 16 + 16 threads) and tiercache at matched
  durability (``fsync = "none"``: neither flushes), and tiercache's durable ``fsync = "data"``
  stores beside them.
- **lookup** latency over 10,000 keys (half stored, half not): each ``lookup`` call's time on
  the scheduler thread, and the time until the call that gives the verdict (the ``fs`` tier
  answers RETRY until its lookup thread has probed the file; a step passes in between).
- **second store and disk**: as many new chunks again are stored into the same tier (timed:
  its directories exist now; tiercache's is full, so it evicts and reuses files), then the
  bytes the directory takes (vLLM's ``fs`` tier has no bound; tiercache's
  ``capacity_blocks`` is the buffer's chunks).
- **fio**: the best of a numjobs x iodepth grid (``fiobase.FIO_GRID``) of random reads and of writes
  at the row size, direct I/O, on the same directory: one job at iodepth 32 is not every
  disk's limit.

Passes alternate which tier goes first; ratios are medians over passes of each pass's ratio.
After each tier's run its directory is deleted, synced and left to settle (:data:`SETTLE_S`),
so no tier's timed phase pays for the deletions of the one before it (on a file system
mounted with ``discard`` they are many seconds of device work).
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from tiercache.bench.fiobase import best_fio
from tiercache.errors import ConfigError, MissingDependencyError

#: (numjobs, iodepth) of the fio grid
SYSTEMS = ("fs", "tiercache", "tiercache-durable")
#: seconds the disk is left alone after a tier's files are deleted, before the next tier's run
SETTLE_S = 2.0
LOOKUPS = 10_000


def _vllm():
    try:
        # probes: the bench needs these names of vLLM's tiering code, and its own adapter over them
        from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key  # noqa: F401
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: F401
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: F401

        from tiercache.integrations import vllmcompat  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError(f"tiercache bench vllm-tier needs vLLM 0.26+ ({exc}); README.md, 'Quick start', "
                                     "has the command that installs it") from None
    return locals()


def _spec(v, row_bytes: int, chunks: int):
    cfg = v["vllmcompat"].offloading_config(
        row_bytes=row_bytes, extra_config={"cpu_bytes_to_use": chunks * row_bytes, "secondary_tiers": []},
        engine_id="tiercache-bench", model="bench/model")
    return v["TieringOffloadingSpec"](cfg)


def _tier(v, system: str, directory: Path, view: memoryview, spec, chunks: int, io_threads: int):
    if system == "fs":
        conf = {"type": "fs", "root_dir": str(directory), "n_read_threads": 16, "n_write_threads": 16}
    else:
        from tiercache import RowStore

        conf = {"type": "TierCacheTier", "module_path": "tiercache.integrations.vllm", "root": str(directory),
                "capacity_blocks": RowStore.blocks_for(chunks), "io_threads": io_threads,
                "fsync": "data" if system == "tiercache-durable" else "none"}
    return v["SecondaryTierFactory"].create_secondary_tier(conf, view, spec)


def _run_jobs(v, tier, keys: list[bytes], rows: np.ndarray, promotion: bool, per_job: int, in_flight: int,
              first_id: int) -> tuple[float, bool]:
    """Submit ``keys`` <-> ``rows`` in jobs of ``per_job``, at most ``in_flight`` outstanding;
    returns (seconds from the first submit to the last result, every job succeeded)."""
    ctx = v["ReqContext"](req_id="bench")
    jobs = [(keys[i:i + per_job], rows[i:i + per_job]) for i in range(0, len(keys), per_job)]
    pending: set[int] = set()
    ok = True
    nxt = 0
    t0 = time.perf_counter()
    while nxt < len(jobs) or pending:
        while nxt < len(jobs) and len(pending) < in_flight:
            ks, rs = jobs[nxt]
            job = v["vllmcompat"].make_job(first_id + nxt, ks, rs, promotion, ctx)
            (tier.submit_load if promotion else tier.submit_store)(job)
            pending.add(first_id + nxt)
            nxt += 1
        got = list(tier.get_finished_jobs())
        for r in got:
            pending.discard(r.job_id)
            ok &= bool(r.success)
        if not got:
            time.sleep(0.0002)
    return time.perf_counter() - t0, ok


def _lookups(v, tier, present: list[bytes], rng: np.random.Generator) -> dict:
    """Per-call and per-verdict lookup latencies (microseconds) over :data:`LOOKUPS` keys."""
    absent = [v["make_offload_key"](rng.bytes(32), 0) for _ in range(LOOKUPS // 2)]
    sample = [present[int(i)] for i in rng.integers(0, len(present), LOOKUPS - len(absent))] + absent
    rng.shuffle(sample)
    retry, end = v["LookupResult"].RETRY, v["ScheduleEndContext"](new_req_ids=(), preempted_req_ids=())
    calls, verdicts, wrong = [], [], 0
    present_set = set(present)
    for b in range(0, LOOKUPS, 256):
        ctx = v["ReqContext"](req_id=f"lookup-{b}")
        tier.on_new_request(ctx)
        batch = sample[b:b + 256]
        first: dict[int, int] = {}
        todo = list(range(len(batch)))
        while todo:
            later = []
            for j in todo:
                t = time.perf_counter_ns()
                r = tier.lookup(batch[j], ctx)
                t1 = time.perf_counter_ns()
                calls.append(t1 - t)
                first.setdefault(j, t)
                if r is retry:
                    later.append(j)
                else:
                    verdicts.append(t1 - first[j])
                    wrong += (r is v["LookupResult"].HIT) != (batch[j] in present_set)
            todo = later
            tier.on_schedule_end(end)  # a scheduler step ends (the fs tier posts its probes here)
            if todo:
                time.sleep(0.0005)
        tier.on_request_finished(ctx)

    def pct(xs, q):
        return round(float(np.percentile(xs, q)) / 1e3, 2)

    return {"call_p50_us": pct(calls, 50), "call_p99_us": pct(calls, 99), "verdict_p50_us": pct(verdicts, 50),
            "verdict_p99_us": pct(verdicts, 99), "calls": len(calls), "wrong": wrong}


def _wait_job(v, tier, job_id: int, others: set[int]) -> tuple[float, bool]:
    """Poll ``get_finished_jobs`` until ``job_id`` is reported; returns (seconds, success).
    Results of ``others`` seen meanwhile are removed from that set."""
    t0 = time.perf_counter()
    while True:
        for r in tier.get_finished_jobs():
            if r.job_id == job_id:
                return time.perf_counter() - t0, bool(r.success)
            others.discard(r.job_id)
        time.sleep(0.0002)


def _load_under_store(v, tier, keys: list[bytes], rows: np.ndarray, data: np.ndarray, per_job: int,
                      rng: np.random.Generator) -> dict:
    """A prefix's load while the tier is busy storing, as in a serving engine (a repeat's
    prefix comes back while the chunks of the requests before it are being written): a quarter
    of the stored chunks (the most recently used: no store evicts them) loaded as one job,
    alone, then again right after a quarter of the buffer's worth of new chunks was submitted
    for storing. Returns the two load latencies (seconds) and whether the loaded bytes were the
    stored ones."""
    n = len(keys)
    m = max(1, n // 4)
    ctx = v["ReqContext"](req_id="under")
    mk = v["vllmcompat"].make_job
    dst = np.arange(n // 2, n // 2 + m)
    got: dict = {}
    for phase, first in (("alone", 3 << 20), ("under_store", 4 << 20)):
        pending: set[int] = set()
        if phase == "under_store":
            new = [v["make_offload_key"](rng.bytes(32), 0) for _ in range(m)]
            for j, i in enumerate(range(0, m, per_job)):
                tier.submit_store(mk(first + 1 + j, new[i:i + per_job], np.arange(i, min(m, i + per_job)), False, ctx))
                pending.add(first + 1 + j)
        rows[dst] = 0
        tier.submit_load(mk(first, keys[-m:], dst, True, ctx))
        dt, ok = _wait_job(v, tier, first, pending)
        ok &= bool(np.array_equal(rows[dst], data[-m:]))
        while pending:  # the stores finish before the next phase
            for r in tier.get_finished_jobs():
                pending.discard(r.job_id)
            time.sleep(0.0005)
        got[f"load_{phase}_s"], got["under_ok"] = dt, got.get("under_ok", True) and ok
    return got


def _disk_bytes(directory: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(directory):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def _system_pass(v, system: str, work: Path, view, rows: np.ndarray, data: np.ndarray, spec, per_job: int,
                 in_flight: int, io_threads: int, rng: np.random.Generator, lookups: bool) -> dict:
    n, row_bytes = rows.shape
    directory = work / system
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    keys = [v["make_offload_key"](rng.bytes(32), 0) for _ in range(n)]
    tier = _tier(v, system, directory, view, spec, n, io_threads)
    out: dict = {"system": system}
    try:
        rows[:] = data
        os.sync()
        dt, ok = _run_jobs(v, tier, keys, np.arange(n), False, per_job, in_flight, 0)
        out["store_gbps"], out["ok"] = n * row_bytes / dt / 1e9, ok
        if system == "tiercache-durable":
            return out
        os.sync()
        perm = rng.permutation(n)
        rows[:] = 0
        dt, ok = _run_jobs(v, tier, keys, perm, True, per_job, in_flight, 1 << 20)
        out["load_gbps"] = n * row_bytes / dt / 1e9
        out["ok"] &= ok and bool(np.array_equal(rows[perm], data))
        if lookups:
            out["lookup"] = _lookups(v, tier, keys, rng)
            out["ok"] &= out["lookup"]["wrong"] == 0
        out.update(_load_under_store(v, tier, keys, rows, data, per_job, rng))
        out["ok"] &= out.pop("under_ok")
        more = [v["make_offload_key"](rng.bytes(32), 0) for _ in range(n)]
        rows[:] = data
        os.sync()
        dt, ok = _run_jobs(v, tier, more, np.arange(n), False, per_job, in_flight, 2 << 20)
        out["store2_gbps"] = n * row_bytes / dt / 1e9
        out["ok"] &= ok
        tier.drain_jobs()
        out["disk_bytes_after_2x"] = _disk_bytes(directory)
        out["data_bytes_2x"] = 2 * n * row_bytes
    finally:
        tier.shutdown()
        shutil.rmtree(directory, ignore_errors=True)
        # the next tier's timed phase must not pay for these deletions: the file system's
        # journal commits them (with the discards of a `discard` mount) at its next sync
        os.sync()
        time.sleep(SETTLE_S)
    return out


def run_vllm_tier_bench(root: Path, row_sizes=(256 << 10, 2 << 20), total_bytes: int = 1 << 30,
                        per_job: int = 32, in_flight: int = 8, repeat: int = 3, io_threads: int = 16,
                        fio: bool = True, fio_runtime: float = 2.0, seed: int | None = None, log=print) -> dict:
    """Run the job (module docstring) under ``root``; returns a JSON-ready report.

    Args:
        root: a directory on the disk to measure (a ``bench-vllm-<pid>`` folder is made in it).
        row_sizes: bytes per chunk (row) to measure, each a multiple of 4096.
        total_bytes: bytes of chunks per phase (the primary buffer's size).
        per_job, in_flight: chunks per job, jobs outstanding.
        repeat: alternated passes (medians over them).
        io_threads: tiercache's I/O threads.
        fio: also run fio's grid (``fiobase.FIO_GRID``) on the same directory each pass.

    Raises:
        MissingDependencyError: vLLM is not installed.
        ConfigError: a row size that is not a positive multiple of 4096.
    """
    v = _vllm()
    for rb in row_sizes:
        if rb <= 0 or rb % 4096:
            raise ConfigError(f"row size {rb} must be a positive multiple of 4096")
    rng = np.random.default_rng(seed)
    work = Path(root) / f"bench-vllm-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"job": "vllm-tier", "total_bytes": total_bytes, "chunks_per_job": per_job,
                    "jobs_in_flight": in_flight, "io_threads": io_threads, "repeat": repeat, "rows": [],
                    "host": os.uname().nodename, "when": time.strftime("%Y-%m-%d %H:%M")}
    ok = True
    try:
        for rb in row_sizes:
            n = total_bytes // rb
            mm = mmap.mmap(-1, n * rb)
            rows = np.frombuffer(mm, np.uint8).reshape(n, rb)
            view = memoryview(rows)
            data = rng.integers(0, 256, (n, rb), dtype=np.uint8)
            spec = _spec(v, rb, n)
            passes = []
            for p in range(repeat):
                order = list(SYSTEMS) if p % 2 == 0 else list(reversed(SYSTEMS))
                res = {s: _system_pass(v, s, work, view, rows, data, spec, per_job, in_flight, io_threads, rng,
                                       lookups=p == 0) for s in order}
                res["fio"] = best_fio(work, rb, total_bytes, fio_runtime) if fio else {}
                passes.append(res)
                ok &= all(res[s]["ok"] for s in SYSTEMS)
                log(
                    f"  row {rb >> 10} KiB pass {p + 1}/{repeat}: "
                    + ", ".join(
                        f"{s} store {res[s]['store_gbps']:.2f}"
                        + (f" load {res[s]['load_gbps']:.2f}" if "load_gbps" in res[s] else "")
                        for s in SYSTEMS
                    )
                    + (
                        f"; fio read {res['fio'].get('read_gbps', 0):.2f} write {res['fio'].get('write_gbps', 0):.2f}"
                        if fio
                        else ""
                    )
                    + " GB/s"
                )
            del view, rows, mm  # freed when the tiers' last references go
            report["rows"].append(_summary(rb, passes))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["ok"] = ok
    return report


def _summary(row_bytes: int, passes: list[dict]) -> dict:
    def med(xs):
        xs = [x for x in xs if x is not None]
        return round(statistics.median(xs), 3) if xs else None

    def col(system, field):
        return [p[system].get(field) for p in passes]

    def ratio(a_sys, a, b_sys, b):
        return med([p[a_sys][a] / p[b_sys][b] if p[b_sys].get(b) else None for p in passes])

    out = {"row_bytes": row_bytes, "passes": passes}
    for s in SYSTEMS:
        out[s] = {"store_gbps": med(col(s, "store_gbps")), "load_gbps": med(col(s, "load_gbps")),
                  "store2_gbps": med(col(s, "store2_gbps")), "load_alone_s": med(col(s, "load_alone_s")),
                  "load_under_store_s": med(col(s, "load_under_store_s"))}
    for op in ("store", "load", "store2"):
        out[f"{op}_vs_fs"] = ratio("tiercache", f"{op}_gbps", "fs", f"{op}_gbps")
    # a prefix's load while stores are in flight: fs tier's seconds / tiercache's (speed ratio)
    out["load_under_store_vs_fs"] = ratio("fs", "load_under_store_s", "tiercache", "load_under_store_s")
    out["durable_store_vs_fs"] = ratio("tiercache-durable", "store_gbps", "fs", "store_gbps")
    if passes[0]["fio"].get("read_gbps"):
        for sys_ in ("fs", "tiercache"):
            out[f"{sys_}_load_vs_fio"] = med([p[sys_]["load_gbps"] / p["fio"]["read_gbps"] for p in passes])
            out[f"{sys_}_store_vs_fio"] = med([p[sys_]["store_gbps"] / p["fio"]["write_gbps"] for p in passes
                                               if p["fio"].get("write_gbps")])
        out["fio_read_gbps"] = med([p["fio"].get("read_gbps") for p in passes])
        out["fio_write_gbps"] = med([p["fio"].get("write_gbps") for p in passes])
        out["fio_best"] = passes[0]["fio"]
    out["lookup"] = {s: passes[0][s].get("lookup") for s in ("fs", "tiercache")}
    out["disk"] = {s: {"bytes_after_2x": passes[0][s].get("disk_bytes_after_2x"),
                       "data_bytes_2x": passes[0][s].get("data_bytes_2x")} for s in ("fs", "tiercache")}
    return out


def format_vllm_tier_report(rep: dict) -> str:
    """The report as a table: per row size, GB/s of each tier, ratios, lookups, disk."""
    lines = [f"tiercache vllm-tier job: {rep['total_bytes'] >> 20} MiB per phase, jobs of {rep['chunks_per_job']} "
             f"chunks, {rep['jobs_in_flight']} in flight, {rep['repeat']} alternated pass(es); medians "
             f"({rep['host']}, {rep['when']})", ""]
    lines.append(f"  {'row':>8}  {'tier':<18} {'store GB/s':>10} {'load GB/s':>10} {'2nd store':>10}")
    for r in rep["rows"]:
        for s in SYSTEMS:
            ld, s2 = r[s]["load_gbps"], r[s].get("store2_gbps")
            lines.append(f"  {r['row_bytes'] >> 10:>6}Ki  {s:<18} {r[s]['store_gbps']:>10.2f} "
                         f"{'' if ld is None else f'{ld:.2f}':>10} {'' if s2 is None else f'{s2:.2f}':>10}")
        if r.get("fio_read_gbps"):
            lines.append(
                f"  {'':>8}  {'fio (best of grid)':<18} {r['fio_write_gbps']:>10.2f} {r['fio_read_gbps']:>10.2f}"
                f"   (write {r['fio_best'].get('write_config')}, read {r['fio_best'].get('read_config')})"
            )
        lines.append(f"  {'':>8}  tiercache / fs: store {r['store_vs_fs']}, load {r['load_vs_fs']}, second store "
                     f"{r['store2_vs_fs']}; durable store "
                     f"{r['durable_store_vs_fs']}" + (f"; vs fio: tiercache load {r['tiercache_load_vs_fio']}, "
                                                      f"store {r['tiercache_store_vs_fio']}; fs load "
                                                      f"{r['fs_load_vs_fio']}, store {r['fs_store_vs_fio']}"
                                                      if r.get("fio_read_gbps") else ""))
        if r.get("load_under_store_vs_fs"):
            lines.append(f"  {'':>8}  a quarter's load, alone / while a quarter is stored: " + "; ".join(
                f"{s} {r[s]['load_alone_s'] * 1e3:.0f} / {r[s]['load_under_store_s'] * 1e3:.0f} ms"
                for s in ("fs", "tiercache")) + f"; speed tiercache / fs under stores {r['load_under_store_vs_fs']}")
        for s, lk in r["lookup"].items():
            if lk:
                lines.append(f"  {'':>8}  lookup {s:<10} call p50 {lk['call_p50_us']} us p99 {lk['call_p99_us']} us; "
                             f"verdict p50 {lk['verdict_p50_us']} us p99 {lk['verdict_p99_us']} us")
        for s, d in r["disk"].items():
            if d["bytes_after_2x"] is not None:
                lines.append(f"  {'':>8}  disk {s:<12} {d['bytes_after_2x'] / 2**20:.0f} MiB after storing "
                             f"{d['data_bytes_2x'] / 2**20:.0f} MiB of chunks")
        lines.append("")
    lines.append(f"  bytes verified: {'OK' if rep['ok'] else 'FAILED'}")
    return "\n".join(lines)
