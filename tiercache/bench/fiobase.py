"""fio itself as the baseline of the file benchmarks: the same job on the same directory.

fio is what users measure their disks with, so a block-file figure is reported as a ratio to
fio run in the same process's run, on the same directory, with the same block size, queue
depth, number of jobs, bytes, ``direct`` flag and read/write mix. fio reads and writes one
file per job with ``ioengine=io_uring`` (``libaio``, then ``psync``, where io_uring is refused);
the binary is ``$TIERCACHE_FIO`` or ``fio`` on ``PATH``.

Writes are run twice: as fio usually runs them (``end_fsync=1``: one flush at the end) and
durably per block (``fdatasync=1``: a flush after every write, what tiercache's default fsync
policy ``data`` promises for each block file), so a durable figure is compared like for like.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from tiercache.bench.fiospec import FioJob
from tiercache.errors import ConfigError

ENGINES = ("io_uring", "libaio", "psync")


def fio_binary() -> str | None:
    """The fio to run: ``$TIERCACHE_FIO`` if set, else ``fio`` on ``PATH``, else None."""
    env = os.environ.get("TIERCACHE_FIO")
    if env:
        return env if os.access(env, os.X_OK) else None
    return shutil.which("fio")


def fio_version(binary: str) -> str:
    try:
        return subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "fio"


def _dirs(directory: Path | list[Path]) -> list[Path]:
    return [Path(d) for d in directory] if isinstance(directory, (list, tuple)) else [Path(directory)]


def fio_args(job: FioJob, block_bytes: int, blocks: int, directory: Path | list[Path], rw: str, engine: str,
             durable: bool = False) -> list[str]:
    """fio's options for ``job`` at ``block_bytes`` per I/O, ``blocks`` blocks per job, in
    ``directory`` (one file per fio job); ``rw`` is fio's (``read``, ``randwrite``...). Several
    directories (the devices of a root array): the same job on each, all at once, reported
    together (``numjobs`` jobs per directory)."""
    dirs = _dirs(directory)
    per_dir = [a for i, d in enumerate(dirs) for a in (f"--name={job.name}" + (f"d{i}" if len(dirs) > 1 else ""),
                                                       f"--directory={d}")]
    args = [f"--rw={rw}", f"--bs={block_bytes}",
            f"--size={blocks * block_bytes}", f"--iodepth={job.iodepth}", f"--numjobs={job.numjobs}",
            f"--ioengine={engine}", f"--direct={int(job.direct)}", "--group_reporting", "--output-format=json",
            "--randrepeat=0", "--invalidate=1"]
    if rw in ("rw", "randrw", "readwrite"):
        args.append(f"--rwmixread={job.rwmixread}")
    if job.runtime:
        args.append(f"--runtime={job.runtime}")
        if job.time_based:
            args.append("--time_based")
    if "write" in rw or rw in ("rw", "randrw", "readwrite"):
        args.append("--fdatasync=1" if durable else "--end_fsync=1")
    return args + per_dir


def _fio_rw(job: FioJob, op: str) -> str:
    """fio's ``rw`` for the direction ``op`` of ``job`` (its mix, when the job mixes)."""
    if job.rw in ("rw", "randrw", "readwrite"):
        return job.rw
    return ("rand" if job.rw.startswith("rand") else "") + op


def run_fio(job: FioJob, block_bytes: int, blocks: int, directory: Path | list[Path], op: str, durable: bool = False,
            binary: str | None = None) -> dict:
    """Run fio for direction ``op`` (``read`` or ``write``) of ``job`` in ``directory`` (or the
    same job in each of several, at once: :func:`fio_args`); returns ``method``, ``op``,
    ``bw_bytes`` (bytes/s, all directories together), ``iops``, ``clat_p50_ns``,
    ``clat_p99_ns``, ``engine``.

    Raises:
        ConfigError: no fio, or fio failed with every engine (its message).
    """
    binary = binary or fio_binary()
    if binary is None:
        raise ConfigError("fio is not installed (apt-get install fio), or set TIERCACHE_FIO to its path")
    dirs = _dirs(directory)
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    last = ""
    for engine in ENGINES:
        cmd = [binary, *fio_args(job, block_bytes, blocks, directory, _fio_rw(job, op), engine, durable)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        try:
            out = json.loads(res.stdout[res.stdout.index("{"):])
            rec = out["jobs"][0]
        except (ValueError, KeyError, IndexError):
            last = (res.stderr or res.stdout).strip().splitlines()[-1:] or [f"exit {res.returncode}"]
            last = last[0]
            continue
        if rec.get("error"):
            last = f"fio error {rec['error']} with {engine}"
            continue
        d = rec[op]
        pct = d["clat_ns"].get("percentile", {})
        for where in dirs:
            for f in where.glob(f"{job.name}*.*"):
                f.unlink(missing_ok=True)
        return {"method": f"{fio_version(binary)} {engine} direct={int(job.direct)}"
                          + (" fdatasync=1" if durable else (" end_fsync=1" if op == "write" else "")),
                "op": op, "engine": engine, "durable": durable, "bw_bytes": int(d["bw_bytes"]),
                "iops": float(d["iops"]), "clat_p50_ns": int(pct.get("50.000000", 0)),
                "clat_p99_ns": int(pct.get("99.000000", 0)), "command": " ".join(cmd)}
    raise ConfigError(f"fio failed with every engine ({', '.join(ENGINES)}): {last}")


#: (numjobs, iodepth) pairs :func:`best_fio` tries: one job at iodepth 32 is not every disk's
#: limit (issue 30: 2 MiB random reads gave 0.9 GB/s at numjobs=1 iodepth=32, 2.0 at 128)
FIO_GRID = ((1, 1), (1, 32), (1, 128), (4, 8), (16, 1), (16, 8))


def last_level_cache_bytes() -> int | None:
    """The size in bytes of CPU 0's last-level (highest-level unified or data) cache, from
    ``/sys/devices/system/cpu/cpu0/cache``; None where Linux does not say."""
    best: tuple[int, int] | None = None
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((d / "level").read_text())
            kind = (d / "type").read_text().strip()
            text = (d / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not text:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1].upper(), 1)
        try:
            size = int(text.rstrip("KkMmGg")) * mult
        except ValueError:
            continue
        if best is None or level > best[0]:
            best = (level, size)
    return best[1] if best else None


def best_fio(work: Path | list[Path], bs: int, total_bytes: int, runtime: float, ops=("read", "write")) -> dict:
    """The best fio over :data:`FIO_GRID` at ``bs`` bytes per I/O, O_DIRECT, ``runtime``
    seconds each, on files of ``total_bytes`` in all under ``work/fio`` (removed after):
    random reads (``"read"`` in ``ops``) and sequential writes (``"write"``). Several ``work``
    directories (one per device): each grid point runs on all of them at once (``numjobs`` jobs
    each, ``total_bytes`` spread over them), so the best is the devices' aggregate. Returns
    ``{"version", "read_gbps", "read_config", "write_gbps", "write_config", "read_grid",
    "write_grid"}`` (GB/s; the grids: every point's GB/s by ``"numjobs=N iodepth=D"``, since
    the best may be a point whose buffers stay in the CPU's cache while a cache's reads land
    in memory that does not; an ``"error"`` where fio is missing, ``"errors"`` of the grid
    points that failed). Also ``"cache_bytes"`` (:func:`last_level_cache_bytes`) and, where
    some point's buffers (numjobs x iodepth x ``bs`` per directory, over all directories)
    exceed it, ``"read_beyond_cache_gbps"`` / ``"read_beyond_cache_config"`` (and ``write_``):
    the best of those points, the speed the devices give reads that land in memory no cache
    holds (a host pool of GiBs)."""
    dirs = _dirs(work)
    binary = fio_binary()
    if binary is None:
        return {"error": "fio is not installed (apt-get install fio), or set TIERCACHE_FIO"}
    cache = last_level_cache_bytes()
    best: dict = {"version": fio_version(binary), "cache_bytes": cache}
    for op, rw in (("read", "randread"), ("write", "write")):
        if op not in ops:
            continue
        for numjobs, iodepth in FIO_GRID:
            job = FioJob(name=f"best{numjobs}x{iodepth}", rw=rw, bs=bs, iodepth=iodepth, numjobs=numjobs,
                         runtime=runtime, time_based=True, direct=True)
            blocks = max(1, total_bytes // bs // numjobs // len(dirs))
            try:
                r = run_fio(job, bs, blocks, [d / "fio" for d in dirs] if len(dirs) > 1 else dirs[0] / "fio", op,
                            binary=binary)
            except ConfigError as exc:
                best.setdefault("errors", []).append(str(exc))
                continue
            gbps = r["bw_bytes"] / 1e9
            point = f"numjobs={numjobs} iodepth={iodepth}"
            best.setdefault(f"{op}_grid", {})[point] = gbps
            if cache is not None and numjobs * iodepth * bs * len(dirs) > cache \
                    and gbps > best.get(f"{op}_beyond_cache_gbps", 0.0):
                best[f"{op}_beyond_cache_gbps"], best[f"{op}_beyond_cache_config"] = gbps, point
            if gbps > best.get(f"{op}_gbps", 0.0):
                best[f"{op}_gbps"], best[f"{op}_config"] = (
                    gbps,
                    f"numjobs={numjobs} iodepth={iodepth} {r['engine']}"
                    + (f" x {len(dirs)} directories" if len(dirs) > 1 else ""),
                )
        for d in dirs:
            shutil.rmtree(d / "fio", ignore_errors=True)
    return best


def beyond_cache_text(best: dict) -> str:
    """The part of a report line that gives :func:`best_fio`'s best points beyond the CPU's
    last-level cache (empty where no point went beyond it)."""
    parts = [f"{op} {best[f'{op}_beyond_cache_gbps']:.2f} GB/s ({best[f'{op}_beyond_cache_config']})"
             for op in ("read", "write") if best.get(f"{op}_beyond_cache_gbps")]
    if not parts:
        return ""
    return f"; with more buffers than the CPU's {best['cache_bytes'] >> 20} MiB cache: " + ", ".join(parts)
