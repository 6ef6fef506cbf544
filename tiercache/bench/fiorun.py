"""Running fio-style jobs on the transfer engine, and reporting them as fio does.

Each job builds its own tiers (the two of its tier pair, ``nblocks * numjobs`` slots each, a fresh
directory under the root for files), fills them with random blocks (not timed), then runs
``numjobs`` threads. A thread keeps ``iodepth`` blocks in flight as requests of
``iodepth_batch`` blocks, each one :meth:`TransferEngine.copy`; a block's completion latency is
the time from its request's submission to the host seeing the request finished. The file
tier gets ``iodepth * numjobs`` I/O threads (at least the config's ``io_threads``): its threads
are its queue depth, as ``iodepth`` is fio's. With
``verify``, every block's bytes are checked at the end. The baseline runs in the same run:

- ``fio`` (jobs with files; ``auto`` where fio is installed): fio itself on the same directory
  with the same block size, queue depth, jobs, bytes, ``direct`` and mix
  (:mod:`tiercache.bench.fiobase`); writes also durably (``fdatasync=1``, like the default fsync
  policy ``data``). The ratio of bandwidths and both sides' completion-latency p50/p99 are
  reported;
- ``naive``: the same bytes moved the naive way (one ``cudaMemcpyAsync`` per block for device
  <-> host; O_DIRECT pread/pwrite of one file in ``bs`` requests for files; one kvikio
  read/write per block for device <-> file).
"""

from __future__ import annotations

import os
import resource
import shutil
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np

from tiercache.bench.fiobase import fio_binary, run_fio
from tiercache.bench.fiospec import FioJob
from tiercache.cuda import cuda_status
from tiercache.errors import ConfigError
from tiercache.files import FileTier, choose_engine, select_io_path
from tiercache.geometry import PoolSpec
from tiercache.memory import alloc_host, make_device_tier, make_host_tier
from tiercache.settings import MAX_IO_THREADS, FileSettings, TransferSettings
from tiercache.transfer import TransferEngine

PERCENTILES = (1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95, 99.99)


class _Dir:
    """Per direction (read/write): bytes, I/Os, latencies in ns, time span."""

    def __init__(self) -> None:
        self.lat: list[np.ndarray] = []
        self.ios = 0
        self.lock = threading.Lock()

    def add(self, n: int, lat_ns: int) -> None:
        with self.lock:
            self.lat.append(np.full(n, lat_ns, dtype=np.int64))
            self.ios += n


def _pool_for(job: FioJob, config_pool: PoolSpec | None) -> PoolSpec:
    if job.bs:
        return PoolSpec("bench", (job.bs,), "uint8")
    if config_pool is None:
        raise ConfigError(f"job {job.name!r}: give bs or a --config with a pool")
    return config_pool


def run_job(job: FioJob, root: Path | list[Path], config_pool: PoolSpec | None = None, io_threads: int = 8, log=print,
            fsync: str = "data") -> dict:
    """Run one job; returns its fio-style JSON record (``jobname``, ``read``, ``write``,
    ``tiercache``). ``root``: the directory the job's files go under, or several (one per
    device: the file tier is then a root array over them, and fio runs on all of them at
    once). ``fsync``: the file tier's policy (:data:`~tiercache.settings.FSYNC_POLICIES`).

    Raises:
        ConfigError: a device tier asked for without a GPU, or bad sizes.
    """
    if "device" in job.tiers and not cuda_status().available:
        raise ConfigError(f"job {job.name!r}: tiers = {job.tiers} needs a GPU ({cuda_status().reason})")
    pool = _pool_for(job, config_pool)
    n = job.blocks_for(pool.block_nbytes)
    total = n * job.numjobs
    if total * pool.block_nbytes > (64 << 30):
        raise ConfigError(f"job {job.name!r}: {total} blocks of {pool.block_nbytes} bytes is over 64 GiB")
    roots = [Path(r) for r in root] if isinstance(root, (list, tuple)) else [Path(root)]
    works = [r / f"fio-{job.name}-{os.getpid()}" for r in roots]
    work = works[0]
    for w in works:
        shutil.rmtree(w, ignore_errors=True)
    tiers: dict = {}
    io_path = select_io_path(job.io) if job.lower == "file" else None
    if job.lower == "file" and choose_engine(job.ioengine)[0] == "python":
        # one Python task per block: as many threads as blocks in flight (fio's iodepth)
        io_threads = min(MAX_IO_THREADS, max(io_threads, job.iodepth * job.numjobs))
    # the native engines run a request's files on one thread's ring: ``io_threads`` as given
    # (threads beyond the requests in flight only fight over the GIL: docs/performance/files.md)
    try:
        for t in (job.upper, job.lower):
            if t == "device":
                tiers[t] = make_device_tier(total, (pool,))
            elif t == "host":
                tiers[t] = make_host_tier(total, (pool,))
            else:
                tiers[t] = FileTier((pool,), total, io_path, FileSettings(
                    root=work, roots=tuple(works) if len(works) > 1 else None, fsync=fsync,
                    verify_checksums=job.verify, io_threads=io_threads, direct_io=job.direct, io_engine=job.ioengine))
        eng = TransferEngine(tiers, (pool,), settings=TransferSettings(copy_kernel_sms=None))
        source, _owner = alloc_host(total * pool.block_nbytes)
        source[:] = np.frombuffer(np.random.default_rng(7).bytes(source.nbytes), dtype=np.uint8)
        src_rows = source.reshape(total, pool.block_nbytes)
        keys = list(range(total))
        # prefill both tiers with the same blocks (not timed): reads find data, writes overwrite it
        for t in tiers:
            eng.copy("caller", np.arange(total), t, np.arange(total), keys=keys if t == "file" else None,
                     src_arrays={pool.name: src_rows}).wait()
        # ramp (fio's ramp_time): one untimed request each way, so one-time costs (module loads,
        # first launches, thread start-up) stay out of the numbers
        ramp = np.arange(min(total, job.batch))
        for src, dst in ((job.upper, job.lower), (job.lower, job.upper)):
            eng.copy(src, ramp, dst, ramp, keys=[int(k) for k in ramp] if "file" in (src, dst) else None).wait()
        stats = {"read": _Dir(), "write": _Dir()}
        by_thread0 = thread_cpu()
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        errors: list[BaseException] = []
        threads = [
            threading.Thread(target=_worker, args=(job, eng, w, n, stats, t0, errors)) for w in range(job.numjobs)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        by_thread1 = thread_cpu()
        if errors:
            raise errors[0]
        engine = next((t.engine for t in tiers.values() if isinstance(t, FileTier)), None)
        record = _record(job, pool, stats, wall, io_path, engine)
        _cpu(record, cpu1.ru_utime - cpu0.ru_utime, cpu1.ru_stime - cpu0.ru_stime, wall, stats)
        if by_thread0 and by_thread1:
            record["tiercache"]["cores_by_thread"] = {
                k: round((by_thread1.get(k, 0.0) - by_thread0.get(k, 0.0)) / wall, 3) for k in sorted(by_thread1)
            }
        if job.verify:
            record["tiercache"]["verified_blocks"] = _verify(eng, tiers, pool, src_rows, keys)
        kind = _baseline_kind(job)
        if kind == "naive":
            record["tiercache"]["baseline"] = _baseline(job, pool, tiers, src_rows, work, record)
        elif kind == "fio":
            for t in list(tiers.values()):  # fio gets the disk to itself
                if isinstance(t, FileTier):
                    t.close()
            tiers.clear()
            record["tiercache"].update(_fio_baselines(job, pool, n, [w / "fio" for w in works] if len(works) > 1
                                                      else work / "fio", record))
        return record
    finally:
        for t in tiers.values():
            if isinstance(t, FileTier):
                t.close()
        for w in works:
            shutil.rmtree(w, ignore_errors=True)


def merge_passes(records: list[dict]) -> dict:
    """One record for several alternated passes of a job (each pass: tiercache, then its
    baseline): the pass with the median ratio to the baseline, plus ``tiercache.passes`` (each
    pass's GB/s, the baseline's and the ratios) and the median and range of the ratios."""
    if len(records) == 1:
        return records[0]
    def ratio(r, key="baseline"):
        return r["tiercache"].get(key, {}).get("ratio")
    ranked = sorted(records, key=lambda r: ratio(r) or 0.0)
    rec = ranked[len(ranked) // 2]
    passes = []
    for r in records:
        op = "read" if r["read"]["total_ios"] >= r["write"]["total_ios"] else "write"
        passes.append({"bw_bytes": r[op]["bw_bytes"], "clat_p99_ns": r[op]["clat_ns"]["percentile"].get("99.000000", 0),
                       **{f"{k}_{f}": r["tiercache"][k][f] for k in ("baseline", "baseline_durable")
                          if k in r["tiercache"] for f in ("bw_bytes", "ratio")}})
    tc = rec["tiercache"]
    tc["passes"] = passes
    for key in ("baseline", "baseline_durable"):
        vals = sorted(p[f"{key}_ratio"] for p in passes if f"{key}_ratio" in p)
        if vals:
            tc[key]["ratio_median"] = (
                vals[len(vals) // 2] if len(vals) % 2 else (vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2
            )
            tc[key]["ratio_range"] = [vals[0], vals[-1]]
    return rec


def _worker(job: FioJob, eng: TransferEngine, w: int, n: int, stats: dict, t0: float, errors: list) -> None:
    try:
        _work(job, eng, w, n, stats, t0)
    except BaseException as exc:  # reported by run_job
        errors.append(exc)


def _work(job: FioJob, eng: TransferEngine, w: int, n: int, stats: dict, t0: float) -> None:
    rng = np.random.default_rng(1000 + w)
    base = w * n
    order = rng.permutation(n) if job.rw.startswith("rand") else np.arange(n)
    mixed = job.rw in ("rw", "randrw", "readwrite")
    deadline = t0 + job.runtime if job.runtime else None
    outstanding: deque = deque()
    i = 0
    batch = min(job.batch, n)  # a request never names a slot twice
    depth = max(1, job.iodepth // batch)

    def more() -> bool:
        if deadline is not None:
            return time.perf_counter() < deadline and (job.time_based or i < n)
        return i < n

    while more() or outstanding:
        while len(outstanding) < depth and more():
            idx = order[np.arange(i, i + batch) % n] + base
            if not job.time_based:
                idx = idx[: max(0, n - i)]
            i += batch
            op = ("read" if rng.random() * 100 < job.rwmixread else "write") if mixed else (
                "read" if job.rw.endswith("read") else "write")
            src, dst = (job.lower, job.upper) if op == "read" else (job.upper, job.lower)
            keys = [int(k) for k in idx] if "file" in (src, dst) else None
            outstanding.append((eng.copy(src, idx, dst, idx, keys=keys), time.perf_counter_ns(), op, idx.size))
        job_, t_sub, op, cnt = outstanding.popleft()
        job_.wait_host()
        if not job_.result().ok:
            raise RuntimeError(f"job {job.name!r}: transfer failed: {job_.result().failed}")
        stats[op].add(cnt, time.perf_counter_ns() - t_sub)


def _clat(lat: np.ndarray) -> dict:
    if lat.size == 0:
        return {"min": 0, "max": 0, "mean": 0.0, "stddev": 0.0, "N": 0, "percentile": {}}
    pct = np.percentile(lat, PERCENTILES)
    return {"min": int(lat.min()), "max": int(lat.max()), "mean": float(lat.mean()), "stddev": float(lat.std()),
            "N": int(lat.size), "percentile": {f"{p:.6f}": int(v) for p, v in zip(PERCENTILES, pct)}}


def _record(job: FioJob, pool: PoolSpec, stats: dict, wall: float, io_path, engine: str | None = None) -> dict:
    rec = {"jobname": job.name, "groupid": 0, "job options": {k: str(v) for k, v in job.options().items()}}
    rec["job options"]["iodepth_batch"] = str(job.batch)
    for op in ("read", "write"):
        d = stats[op]
        lat = np.concatenate(d.lat) if d.lat else np.empty(0, dtype=np.int64)
        io_bytes = d.ios * pool.block_nbytes
        rec[op] = {"io_bytes": io_bytes, "io_kbytes": io_bytes // 1024, "total_ios": d.ios,
                   "runtime": max(1, int(wall * 1000)) if d.ios else 0,  # ms, as fio; a job with I/O took some
                   "bw_bytes": int(io_bytes / wall) if d.ios else 0, "bw": int(io_bytes / wall / 1024) if d.ios else 0,
                   "iops": d.ios / wall if d.ios else 0.0, "clat_ns": _clat(lat)}
    path = (
        "cudaMemcpyAsync/kernel"
        if job.tiers == "device:host"
        else (io_path.label if job.upper == "device" else "POSIX")
        + (" + O_DIRECT" if job.direct and job.lower == "file" else "")
        + (f", {engine} engine" if engine else "")
    )
    rec["tiercache"] = {"tiers": job.tiers, "path": path, "block_bytes": pool.block_nbytes,
                        "io_path_reason": io_path.reason if io_path else None, "io_engine": engine}
    return rec


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads so far, by kind (Linux ``/proc``; empty
    elsewhere): ``python_user`` / ``python_sys`` for the interpreter's threads (the job's
    submitters and the file tier's I/O threads: what one GIL serializes, C calls made from
    them included) and ``native_user`` / ``native_sys`` for threads Python does not know (the
    native engine's pool)."""
    py = {t.native_id for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {"python_user": 0.0, "python_sys": 0.0, "native_user": 0.0, "native_sys": 0.0}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        kind = "python" if int(tid) in py else "native"
        out[f"{kind}_user"] += int(fields[11]) / tick
        out[f"{kind}_sys"] += int(fields[12]) / tick
    return out


def _cpu(rec: dict, user_s: float, sys_s: float, wall: float, stats: dict) -> None:
    """The process's CPU time over the timed phase, as fio reports it (``usr_cpu``,
    ``sys_cpu``: percent of one core) and per block moved (``tiercache.cpu_us_per_block``:
    microseconds of user and system time, every thread of the process: Python, the native
    engine's threads, the kernel's work on their behalf)."""
    rec["usr_cpu"] = 100.0 * user_s / wall if wall > 0 else 0.0
    rec["sys_cpu"] = 100.0 * sys_s / wall if wall > 0 else 0.0
    blocks = stats["read"].ios + stats["write"].ios
    if blocks:
        rec["tiercache"]["cpu_us_per_block"] = {"user": 1e6 * user_s / blocks, "sys": 1e6 * sys_s / blocks}


def _verify(eng: TransferEngine, tiers: dict, pool: PoolSpec, src_rows: np.ndarray, keys: list[int]) -> int:
    """Every block of every tier equals the source (both tiers hold the same blocks)."""
    total = src_rows.shape[0]
    for t in tiers:
        out = np.empty_like(src_rows)
        eng.copy(t, np.arange(total), "caller", np.arange(total), keys=keys if t == "file" else None,
                 dst_arrays={pool.name: out}).wait()
        bad = np.flatnonzero((out != src_rows).any(axis=1))
        if bad.size:
            raise RuntimeError(f"verify: {bad.size} block(s) differ in the {t} tier, e.g. block {int(bad[0])}")
    return total * len(tiers)


def _baseline_kind(job: FioJob) -> str:
    """``fio``, ``naive`` or ``none`` for this job (``auto``: fio for file jobs where installed)."""
    if job.baseline == "auto":
        return "fio" if job.lower == "file" and fio_binary() is not None else "naive"
    if job.baseline == "fio" and job.lower != "file":
        raise ConfigError(f"job {job.name!r}: baseline = fio needs files (tiers host:file or device:file), "
                          f"not {job.tiers}")
    return job.baseline


def _fio_baselines(job: FioJob, pool: PoolSpec, n: int, directory: Path | list[Path], rec: dict) -> dict:
    """fio on the same directory (or directories, at once): ``baseline`` (as fio runs it) and, for writes,
    ``baseline_durable`` (``fdatasync=1``); each with the bandwidth ratio and both p50/p99."""
    op = "read" if rec["read"]["total_ios"] >= rec["write"]["total_ios"] else "write"
    out = {}
    for key, durable in (("baseline", False), ("baseline_durable", True)):
        if durable and op != "write":
            continue
        b = run_fio(job, pool.block_nbytes, n, directory, op, durable=durable)
        ours = rec[op]
        b["ratio"] = (ours["bw_bytes"] or 1) / max(b["bw_bytes"], 1)
        pct = ours["clat_ns"]["percentile"]
        b["tiercache_clat_p50_ns"] = int(pct.get("50.000000", 0))
        b["tiercache_clat_p99_ns"] = int(pct.get("99.000000", 0))
        b["p99_ratio"] = b["tiercache_clat_p99_ns"] / max(b["clat_p99_ns"], 1)
        out[key] = b
    for d in directory if isinstance(directory, list) else [directory]:
        shutil.rmtree(d, ignore_errors=True)
    return out


def _baseline(job: FioJob, pool: PoolSpec, tiers: dict, src_rows: np.ndarray, work: Path, rec: dict) -> dict:
    """The naive way, same blocks, same direction mix (read if the job read, else write)."""
    op = "read" if rec["read"]["total_ios"] >= rec["write"]["total_ios"] else "write"
    total, bs = src_rows.shape
    order = np.random.default_rng(3).permutation(total) if job.rw.startswith("rand") else np.arange(total)
    t = time.perf_counter()
    if job.tiers == "device:host":
        import cupy

        dev, host = tiers["device"].arrays[pool.name], tiers["host"].arrays[pool.name]
        stream = cupy.cuda.Stream(non_blocking=True)
        t = time.perf_counter()
        for r in order.tolist():
            if op == "read":
                cupy.cuda.runtime.memcpyAsync(dev.data.ptr + r * bs, host.ctypes.data + r * bs, bs, 4, stream.ptr)
            else:
                cupy.cuda.runtime.memcpyAsync(host.ctypes.data + r * bs, dev.data.ptr + r * bs, bs, 4, stream.ptr)
        stream.synchronize()
        name = "cudaMemcpyAsync per block"
    elif job.upper == "host":
        raw = work / "baseline.bin"
        flags = os.O_RDWR | os.O_CREAT | (getattr(os, "O_DIRECT", 0) if job.direct and bs % 4096 == 0 else 0)
        fd = os.open(raw, flags, 0o600)
        try:
            data = memoryview(tiers["host"].arrays[pool.name].reshape(-1))
            for r in range(total):  # lay the file out first when reading
                if op == "read":
                    os.pwrite(fd, data[r * bs:(r + 1) * bs], r * bs)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t = time.perf_counter()
            for r in order.tolist():  # the job's order (random for rand* jobs)
                if op == "read":
                    os.preadv(fd, [data[r * bs:(r + 1) * bs]], r * bs)
                else:
                    os.pwrite(fd, data[r * bs:(r + 1) * bs], r * bs)
            if op == "write":
                os.fdatasync(fd)
        finally:
            os.close(fd)
        name = "pread/pwrite of one file" + (" O_DIRECT" if flags & getattr(os, "O_DIRECT", 0) else "")
    else:
        import kvikio

        dev = tiers["device"].arrays[pool.name]
        raw = work / "baseline.bin"
        with kvikio.CuFile(raw, "w") as f:
            f.pwrite(dev.reshape(-1)).get()
        t = time.perf_counter()
        with kvikio.CuFile(raw, "r" if op == "read" else "r+") as f:
            futs = [(f.pread if op == "read" else f.pwrite)(dev[r], bs, r * bs) for r in order.tolist()]
            for fu in futs:
                fu.get()
        name = "kvikio pread/pwrite per block of one file"
    seconds = time.perf_counter() - t
    bw = total * bs / seconds
    ours = rec[op]["bw_bytes"] or 1
    return {"method": name, "op": op, "bw_bytes": int(bw), "seconds": seconds, "ratio": ours / bw}


def format_fio(records: list[dict]) -> str:
    """fio-like text: per job the options line, then per direction IOPS, BW, clat and percentiles."""
    out = []
    for r in records:
        o = r["job options"]
        tc = r["tiercache"]
        out.append(f"{r['jobname']}: (g=0): rw={o['rw']}, bs={_kib(tc['block_bytes'])}, tiers={tc['tiers']}, "
                   f"iodepth={o['iodepth']}, iodepth_batch={o['iodepth_batch']}, numjobs={o['numjobs']}, "
                   f"path={tc['path']}")
        for op in ("read", "write"):
            d = r[op]
            if not d["total_ios"]:
                continue
            c = d["clat_ns"]
            out.append(
                f"  {op}: IOPS={_k(d['iops'])}, BW={d['bw_bytes'] / 2**20:.1f}MiB/s ({d['bw_bytes'] / 1e9:.2f}GB/s)"
                f"({d['io_bytes'] / 2**20:.0f}MiB/{d['runtime']}msec)"
            )
            out.append(
                f"    clat (usec): min={c['min'] / 1e3:.0f}, max={c['max'] / 1e3:.0f}, avg={c['mean'] / 1e3:.1f}, "
                f"stdev={c['stddev'] / 1e3:.1f}"
            )
            p = c["percentile"]
            keys = ["1.000000", "5.000000", "50.000000", "90.000000", "95.000000", "99.000000", "99.900000"]
            out.append(
                "    clat percentiles (usec): "
                + ", ".join(f"{float(k):.2f}th=[{p[k] / 1e3:.0f}]" for k in keys if k in p)
            )
        if "verified_blocks" in tc:
            out.append(f"  verify: {tc['verified_blocks']} blocks byte-exact")
        for key, label in (("baseline", "baseline"), ("baseline_durable", "durable baseline")):
            b = tc.get(key)
            if not b:
                continue
            out.append(f"  {label} ({b['method']}, {b['op']}): BW={b['bw_bytes'] / 2**20:.1f}MiB/s "
                       f"({b['bw_bytes'] / 1e9:.2f}GB/s); tiercache/baseline = {b['ratio']:.2f}"
                       + (f" (median of {len(tc['passes'])} alternated passes; range {b['ratio_range'][0]:.2f}-"
                          f"{b['ratio_range'][1]:.2f})" if "ratio_median" in b else ""))
            if "clat_p99_ns" in b:
                out.append(f"    clat p50/p99 (usec): fio {b['clat_p50_ns'] / 1e3:.0f}/{b['clat_p99_ns'] / 1e3:.0f}, "
                           f"tiercache {b['tiercache_clat_p50_ns'] / 1e3:.0f}/{b['tiercache_clat_p99_ns'] / 1e3:.0f} "
                           f"(p99 x{b['p99_ratio']:.2f})")
        out.append("")
    return "\n".join(out).rstrip()


def format_fio_table(records: list[dict]) -> str:
    """One line per job of saved ``tiercache bench fio --output-format json`` records (the
    ``jobs`` lists of one or more runs, host:file and device:file side by side): tiercache's GB/s
    in the job's main direction, fio's on the same directory and the ratio (with its range over
    alternated passes), fio with ``fdatasync=1`` and that ratio, and p99 completion latency in
    microseconds, tiercache / fio. A baseline a job lacks prints as 0."""
    out = [f"{'job':<22}{'tiers':<13}{'tiercache GB/s':>15}{'fio GB/s':>10}{'ratio':>7}{'range':>12}"
           f"{'durable fio':>12}{'ratio':>7}{'p99 us tc/fio':>16}"]
    for r in records:
        tc = r["tiercache"]
        op = "read" if r["read"]["total_ios"] >= r["write"]["total_ios"] else "write"
        b, d = tc.get("baseline") or {}, tc.get("baseline_durable") or {}
        lo, hi = b.get("ratio_range", [b.get("ratio", 0.0)] * 2)
        out.append(f"{r['jobname']:<22}{tc['tiers']:<13}{r[op]['bw_bytes'] / 1e9:>15.2f}"
                   f"{b.get('bw_bytes', 0) / 1e9:>10.2f}{b.get('ratio', 0.0):>7.2f}{f'{lo:.2f}-{hi:.2f}':>12}"
                   f"{d.get('bw_bytes', 0) / 1e9:>12.2f}{d.get('ratio', 0.0):>7.2f}"
                   f"{b.get('tiercache_clat_p99_ns', 0) / 1e3:>9.0f}/{b.get('clat_p99_ns', 0) / 1e3:.0f}")
    return "\n".join(out)


def _k(x: float) -> str:
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


def _kib(n: int) -> str:
    return f"{n / 1024:.0f}KiB" if n < 2**20 else f"{n / 2**20:.1f}MiB"


def plot(records: list[dict], path: Path) -> None:
    """One figure: bandwidth per job against its baseline, and clat percentiles per job.

    Raises:
        ConfigError: matplotlib is not installed (``pip install tiercache[plot]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'tiercache[plot]'") from None
    names = [r["jobname"] for r in records]
    ops = ["read" if r["read"]["total_ios"] >= r["write"]["total_ios"] else "write" for r in records]
    ours = [r[op]["bw_bytes"] / 1e9 for r, op in zip(records, ops)]
    base = [r["tiercache"].get("baseline", {}).get("bw_bytes", 0) / 1e9 for r in records]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(names) + 4), 4.5))
    x = np.arange(len(names))
    a1.bar(x - 0.2, ours, 0.4, label="tiercache")
    a1.bar(x + 0.2, base, 0.4, label="baseline (fio or naive)")
    a1.set_xticks(x, [f"{n}\n{r['tiercache']['tiers']} {op}" for n, r, op in zip(names, records, ops)], fontsize=8)
    a1.set_ylabel("GB/s")
    a1.set_title("bandwidth")
    a1.legend()
    for q, style in (("50.000000", "o-"), ("99.000000", "s--"), ("99.900000", "^:")):
        a2.plot(x, [r[op]["clat_ns"]["percentile"].get(q, 0) / 1e3 for r, op in zip(records, ops)], style,
                label=f"p{float(q):g}")
    a2.set_xticks(x, names, fontsize=8)
    a2.set_yscale("log")
    a2.set_ylabel("completion latency (us)")
    a2.set_title("clat percentiles")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
