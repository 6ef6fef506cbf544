"""The root-array benchmark (``tiercache bench array --root D0 --root D1 ...``): the file tier over
several devices (one root each) against fio's best on the same devices, in one run.

Per block size (16 KiB to 2 MiB by default), in directories ``<Di>/array-bench-<pid>``:

1. **fio's best aggregate**: :func:`~tiercache.bench.fiobase.best_fio` over every directory at
   once (each grid point: ``numjobs`` jobs per directory at ``iodepth``, O_DIRECT, random reads
   and sequential writes; the best point of the grid is the yardstick).
2. **the cache's path**: fio-style jobs (:func:`~tiercache.bench.fiorun.run_job`) on the tier
   pairs asked for (``host:file``, ``device:file`` with a GPU): offload (write) and onboard
   (random read) of ``total_bytes`` per job through the transfer engine and a file tier that
   is a root array over the directories, at ``iodepth`` blocks in flight in requests of
   ``batch`` blocks (by default the row store's job size, ``per_job``: the two paths compared
   like for like), every byte verified at the end.
3. **the row store** (the vLLM tier's path, :class:`~tiercache.RowStore` over the same
   directories): stores and loads of ``total_bytes`` in jobs of ``per_job`` rows, all jobs
   submitted at once, loads checked byte for byte; the process's CPU per block.
4. **the format's own limit** (:func:`~tiercache.bench.formatlimit.format_limit`): C threads
   that do only a block file's open, O_DIRECT write or read, close and (writes) rename, at
   the best of several in-flight counts; the limit of one file per block on these file
   systems, beside fio's large files.
5. **a plain caller** (:func:`~tiercache.bench.plaincaller.plain_caller`): ``TierCache`` with
   default settings, ``put`` + ``offload`` of ``batch`` blocks at a time, and a fresh process
   that ``get``s them in random order: what an engine calling the API gets without tuning.

Each tiercache figure is reported as GB/s and as its ratio to fio's best of the same direction
in the same run (and to the format's limit); the cache's paths also give the process's CPU time per block (user
and system,
all threads) over the timed phase, and the cores its Python threads (one GIL) and its native
threads kept busy. Writes use ``fsync`` (default ``none``, as fio's ``end_fsync=1``: one flush
at the end). ``repeat`` alternated passes give the median and range of each ratio.
"""

from __future__ import annotations

import os
import resource
import shutil
import time
from pathlib import Path

import numpy as np

from tiercache.bench.fiobase import best_fio, beyond_cache_text
from tiercache.bench.fiorun import run_job
from tiercache.bench.fiospec import FioJob
from tiercache.bench.formatlimit import format_limit
from tiercache.bench.plaincaller import plain_caller
from tiercache.errors import ConfigError

DEFAULT_SIZES = (16 << 10, 64 << 10, 256 << 10, 2 << 20)


def _median(vals: list[float]) -> float:
    s = sorted(vals)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def _rowstore(dirs: list[Path], bs: int, total_bytes: int, per_job: int, io_threads: int, fsync: str,
              seed: int, io_engine: str = "auto") -> dict:
    """Row store stores and loads of ``total_bytes`` over ``dirs``; GB/s each way."""
    from tiercache import RowStore
    from tiercache.memory import alloc_host

    n = max(per_job, total_bytes // bs)
    buf, _owner = alloc_host(n * bs, pinned=False)
    rows = buf.reshape(n, bs)
    rows[:] = np.frombuffer(np.random.default_rng(seed).bytes(n * bs), np.uint8).reshape(n, bs)
    keys = [os.urandom(16) for _ in range(n)]
    out: dict = {}
    roots = [d / "rowstore" for d in dirs]
    with RowStore(rows, roots if len(roots) > 1 else roots[0], capacity_blocks=RowStore.blocks_for(n + per_job),
                  fsync=fsync, io_threads=io_threads, io_engine=io_engine) as st:
        for op in ("store", "load"):
            if op == "load":
                rows[:] = 0
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t = time.perf_counter()
            for i in range(0, n, per_job):
                idx = list(range(i, min(n, i + per_job)))
                sub = [keys[j] for j in idx]
                (st.submit_store if op == "store" else st.submit_load)(sub, idx)
            if not st.drain(600):
                raise RuntimeError("row store jobs did not finish in 600 s")
            wall = time.perf_counter() - t
            failed = [r for r in st.finished() if not r.success]
            if failed:
                raise RuntimeError(f"row store {op}: {len(failed)} job(s) failed")
            out[f"{op}_gbps"] = n * bs / wall / 1e9
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            out[f"{op}_cpu_us_per_block"] = {"user": (r1.ru_utime - r0.ru_utime) / n * 1e6,
                                             "sys": (r1.ru_stime - r0.ru_stime) / n * 1e6}
        want = np.frombuffer(np.random.default_rng(seed).bytes(n * bs), np.uint8).reshape(n, bs)
        bad = int(np.count_nonzero((rows != want).any(axis=1)))
        if bad:
            raise RuntimeError(f"row store: {bad} row(s) loaded wrong")
        out["verified_rows"] = n
    for r in roots:
        shutil.rmtree(r, ignore_errors=True)
    return out


def run_array_bench(
    roots: list[Path],
    block_sizes=DEFAULT_SIZES,
    tiers=("host:file",),
    total_bytes: int = 1 << 30,
    iodepth: int = 128,
    batch: int = 32,
    numjobs: int = 1,
    io_threads: int | None = None,
    per_job: int = 32,
    fsync: str = "none",
    io_engine: str = "auto",
    rowstore: bool = True,
    limit: bool = True,
    plain: bool = True,
    fio: bool = True,
    fio_runtime: float = 2.0,
    repeat: int = 1,
    seed: int | None = None,
    log=print,
) -> dict:
    """Run the job (module docstring) over ``roots`` (one directory per device); returns a
    JSON-ready report: per block size, fio's best (read and write, GB/s and its grid point),
    and per tiercache path its GB/s and ratio to fio's best (median and range over passes).
    ``io_threads``: the file tier's I/O threads (default: one per request in flight,
    ``numjobs * ceil(iodepth / batch)``, which the row store gets too). ``io_engine``: the
    file tier's engine on the tuned paths and the row store (the plain caller keeps the
    default). ``limit`` and ``plain``: also the format's limit (a baseline: not with ``fio=False``) and the plain
    caller (module docstring).

    Raises:
        ConfigError: no roots, a block size that is not a positive multiple of 4096, or a
            device tier asked for without a GPU (see :func:`~tiercache.bench.fiorun.run_job`).
    """
    if not roots:
        raise ConfigError("give at least one directory (--root, repeatable: one per device)")
    for bs in block_sizes:
        if bs <= 0 or bs % 4096:
            raise ConfigError(f"block size {bs} must be a positive multiple of 4096")
    seed = int(np.random.SeedSequence().entropy % (1 << 31)) if seed is None else seed
    if io_threads is None:  # one per request in flight (each runs its files on its thread's ring)
        io_threads = max(1, numjobs * -(-iodepth // batch))
    dirs = [Path(r) / f"array-bench-{os.getpid()}" for r in roots]
    report: dict = {
        "job": "array",
        "roots": [str(r) for r in roots],
        "total_bytes": total_bytes,
        "iodepth": iodepth,
        "batch": batch,
        "rows_per_job": per_job,
        "numjobs": numjobs,
        "io_threads": io_threads,
        "io_engine": io_engine,
        "fsync": fsync,
        "repeat": repeat,
        "seed": seed,
        "host": os.uname().nodename,
        "cores": os.cpu_count(),
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "sizes": [],
    }
    knobs = dict(tiers=tiers, total_bytes=total_bytes, iodepth=iodepth, batch=batch, numjobs=numjobs,
                 io_threads=io_threads, per_job=per_job, fsync=fsync, io_engine=io_engine, rowstore=rowstore,
                 limit=limit and fio, plain=plain, fio=fio, fio_runtime=fio_runtime, log=log)
    try:
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        for bs in block_sizes:
            row: dict = {"block_bytes": bs, "fio": [], "limit": [], "paths": {}}
            for p in range(repeat):
                _pass(row, dirs, bs, seed + p, **knobs)
                log(format_size(row, partial=True))
            _summarize(row)
            report["sizes"].append(row)
        report["ok"] = True  # every phase verified its bytes (a mismatch raises)
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    return report


def _pass(row: dict, dirs: list[Path], bs: int, seed: int, *, tiers, total_bytes: int, iodepth: int, batch: int,
          numjobs: int, io_threads: int, per_job: int, fsync: str, io_engine: str, rowstore: bool, limit: bool,
          plain: bool, fio: bool, fio_runtime: float, log) -> None:
    """One pass of block size ``bs``: fio's best, the format's limit, each tiercache path (the
    tuned engine's tier pairs, the row store, a plain caller), appended to ``row``'s lists."""
    best = best_fio(dirs, bs, total_bytes, fio_runtime) if fio else {}
    row["fio"].append(best)
    lim = format_limit(dirs, bs, total_bytes, seed=seed) if limit else {}
    row["limit"].append(lim)
    paths = row["paths"]
    if lim:
        row["fs"] = lim["fs"]
        for op in ("write", "read"):
            paths.setdefault(f"format limit {op}", []).append(
                {"gbps": lim[f"{op}_gbps"], "fio_gbps": best.get(f"{op}_gbps"),
                 "inflight": lim[f"{op}_inflight"], "cpu_us_per_block": lim["cpu_us_per_block"][op]})
    for pair in tiers:
        for rw, op in (("write", "write"), ("randread", "read")):
            job = FioJob(name=f"arr{bs >> 10}k{rw}", rw=rw, bs=bs, size=max(bs, total_bytes // numjobs),
                         iodepth=iodepth, iodepth_batch=min(batch, iodepth), numjobs=numjobs, tiers=pair,
                         baseline="none", verify=True, ioengine=io_engine)
            rec = run_job(job, dirs, io_threads=io_threads, log=log, fsync=fsync)
            paths.setdefault(f"{pair} {op}", []).append(
                {"gbps": rec[op]["bw_bytes"] / 1e9, "fio_gbps": best.get(f"{op}_gbps"),
                 "limit_gbps": lim.get(f"{op}_gbps"), "path": rec["tiercache"]["path"],
                 "verified": rec["tiercache"].get("verified_blocks"),
                 "cpu_us_per_block": rec["tiercache"].get("cpu_us_per_block"),
                 "cores_by_thread": rec["tiercache"].get("cores_by_thread")})
    if rowstore:
        rs = _rowstore(dirs, bs, total_bytes, per_job, io_threads, fsync, seed, io_engine)
        for op, fio_op in (("store", "write"), ("load", "read")):
            paths.setdefault(f"rowstore {op}", []).append(
                {"gbps": rs[f"{op}_gbps"], "fio_gbps": best.get(f"{fio_op}_gbps"),
                 "limit_gbps": lim.get(f"{fio_op}_gbps"), "verified": rs["verified_rows"],
                 "cpu_us_per_block": rs[f"{op}_cpu_us_per_block"]})
    if plain:
        pc = plain_caller(dirs, bs, total_bytes, batch=batch, seed=seed)
        for op, fio_op in (("offload", "write"), ("get", "read")):
            r = pc[fio_op]
            paths.setdefault(f"plain {op}", []).append(
                {"gbps": r["gbps"], "fio_gbps": best.get(f"{fio_op}_gbps"), "limit_gbps": lim.get(f"{fio_op}_gbps"),
                 "verified": r["blocks"], "cpu_us_per_block": r["cpu_us_per_block"]})


def _summarize(row: dict) -> None:
    """Each path's passes: median GB/s, its ratio to fio's best (median and range) and to the
    format's limit."""
    for name, runs in row["paths"].items():
        ratios = [r["gbps"] / r["fio_gbps"] for r in runs if r.get("fio_gbps")]
        of_limit = [r["gbps"] / r["limit_gbps"] for r in runs if r.get("limit_gbps")]
        row["paths"][name] = {"runs": runs, "gbps_median": _median([r["gbps"] for r in runs]),
                              **({"ratio_median": _median(ratios), "ratio_range": [min(ratios), max(ratios)]}
                                 if ratios else {}),
                              **({"limit_ratio_median": _median(of_limit)} if of_limit else {})}


def format_size(row: dict, partial: bool = False) -> str:
    """One block size's lines: fio's best, then each path's GB/s and ratio."""
    bs = row["block_bytes"]
    lines = []
    fs = f" on {', '.join(sorted(set(row['fs'])))}" if row.get("fs") else ""
    for i, best in enumerate(row["fio"][-1:] if partial else row["fio"]):
        if best.get("error"):
            lines.append(f"{bs >> 10:>6} KiB  fio: {best['error']}")
        elif best:
            lines.append(
                f"{bs >> 10:>6} KiB{fs}  fio's best: read {best.get('read_gbps', 0):.2f} GB/s "
                f"({best.get('read_config')}), write {best.get('write_gbps', 0):.2f} GB/s ({best.get('write_config')})"
                + beyond_cache_text(best)
            )
    for name, v in row["paths"].items():
        runs = v["runs"] if isinstance(v, dict) else v
        last = runs[-1] if partial else None
        if partial:
            ratio = f"{last['gbps'] / last['fio_gbps']:.2f} of fio" if last.get("fio_gbps") else ""
            if last.get("limit_gbps"):
                ratio += f", {last['gbps'] / last['limit_gbps']:.2f} of the limit"
            lines.append(f"          {name:<22} {last['gbps']:6.2f} GB/s  {ratio}{_cpu_text(last)}")
        else:
            rng = v.get("ratio_range")
            ratio = (f"{v['ratio_median']:.2f} of fio ({rng[0]:.2f}-{rng[1]:.2f})" if rng else "")
            if "limit_ratio_median" in v:
                ratio += f", {v['limit_ratio_median']:.2f} of the limit"
            lines.append(f"          {name:<22} {v['gbps_median']:6.2f} GB/s  {ratio}{_cpu_text(runs[len(runs) // 2])}")
    return "\n".join(lines)


def _cpu_text(run: dict) -> str:
    cpu, cores = run.get("cpu_us_per_block"), run.get("cores_by_thread")
    text = f"  {run['inflight']} files in flight;" if run.get("inflight") else ""
    text += f"  CPU {cpu['user']:.0f} us user + {cpu['sys']:.0f} us sys per block" if cpu else ""
    if cores:
        text += (f"; cores: Python threads {cores['python_user']:.2f} user + {cores['python_sys']:.2f} sys, "
                 f"native {cores['native_user']:.2f} + {cores['native_sys']:.2f}")
    return text


def format_array(report: dict) -> str:
    head = (
        f"tiercache array benchmark: {len(report['roots'])} root(s) ({', '.join(report['roots'])}), "
        f"{report['total_bytes'] >> 20} MiB per phase, iodepth {report['iodepth']} in requests of "
        f"{report.get('batch', report['iodepth'] // 4)}, row store jobs of {report.get('rows_per_job', 32)}, "
        f"numjobs {report['numjobs']}, "
        f"{report['io_threads']} I/O threads, io_engine {report.get('io_engine', 'auto')}, fsync "
        f"{report['fsync']}, {report['repeat']} pass(es), "
        f"{report['cores']} cores, {report['when']}"
    )
    return "\n".join([head] + [format_size(row) for row in report["sizes"]])
