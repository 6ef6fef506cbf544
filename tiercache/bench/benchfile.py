"""The file benchmark: per-block files against the best raw I/O of the same bytes on the same
directory, in one run.

Raw baselines: ``dd`` with O_DIRECT (write with ``conv=fsync``, read to /dev/null), tiercache's
own O_DIRECT pwrite/pread of one big file in 8 MiB requests, fio where installed (the same block
size and ``io_threads`` in flight on one file: writes durable per block with ``fdatasync=1`` like
the block files' policy, and as fio usually runs them with ``end_fsync=1``; reads with
``direct=1``; :mod:`tiercache.bench.fiobase`), plus (with a GPU) one big kvikio read into VRAM. Per-block files:
durable writes (fsync policy ``data``, buffered and O_DIRECT),
cold reads (page cache dropped with ``posix_fadvise(DONTNEED)`` after fsync) with and without
checksum verification, warm reads, reads through ``aiofiles`` against tiercache's worker pool,
and (with a GPU) VRAM <-> file through kvikio. Ratios are per-block over the best raw figure.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np

from tiercache.files import DATA_OFFSET, FileTier, IOPath, select_io_path
from tiercache.geometry import PoolSpec
from tiercache.memory import alloc_host
from tiercache.settings import FileSettings

CHUNK = 8 << 20


def drop_cache(paths) -> None:
    """Evict the files' clean pages from the page cache (no root needed)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw_write(path: Path, buf: np.ndarray) -> float:
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
    try:
        mv = memoryview(buf)
        for off in range(0, buf.nbytes, CHUNK):
            os.pwrite(fd, mv[off:off + CHUNK], off)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def _raw_read(path: Path, buf: np.ndarray) -> float:
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        mv = memoryview(buf)
        for off in range(0, buf.nbytes, CHUNK):
            os.preadv(fd, [mv[off:off + CHUNK]], off)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def _dd(args: list[str]) -> float | None:
    if shutil.which("dd") is None:
        return None
    t = time.perf_counter()
    res = subprocess.run(["dd", *args, "status=none"], capture_output=True)
    return time.perf_counter() - t if res.returncode == 0 else None


def _aiofiles_read(paths: list[Path], bufs: list[np.ndarray]) -> float:
    import aiofiles

    async def one(p, b):
        async with aiofiles.open(p, "rb") as f:
            await f.seek(DATA_OFFSET)
            data = await f.read(b.nbytes)
        b[:] = np.frombuffer(data, dtype=np.uint8)

    async def main():
        await asyncio.gather(*(one(p, b) for p, b in zip(paths, bufs)))

    t = time.perf_counter()
    asyncio.run(main())
    return time.perf_counter() - t


def run_file_bench(root: Path, pool: PoolSpec, blocks: int = 256, io_threads: int = 8, io_mode: str = "auto",
                   log=print) -> dict:
    """Run every stage in a fresh directory under ``root`` (removed afterwards)."""
    work = Path(root) / f"filebench-{os.getpid()}"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, mode=0o700)
    nbytes = blocks * pool.block_nbytes
    rows: list[dict] = []
    rep = {"job": "file", "dir": str(work), "blocks": blocks, "block_bytes": pool.block_nbytes, "bytes": nbytes,
           "io_threads": io_threads, "stages": rows}

    def add(name, path, seconds, extra=None):
        if seconds is None:
            return
        rows.append(
            {"stage": name, "path": path, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9, **(extra or {})}
        )
        log(f"  {name:<34} {path:<16} {nbytes / seconds / 1e9:6.2f} GB/s")

    try:
        host, _owner = alloc_host(nbytes)
        host[:] = np.frombuffer(np.random.default_rng(5).bytes(nbytes), dtype=np.uint8)
        rows_view = host.reshape(blocks, pool.block_nbytes)
        big = work / "raw.bin"
        # raw baselines
        add("raw write (O_DIRECT, fsync)", "pwrite", _raw_write(big, host))
        drop_cache([big])
        add("raw cold read (O_DIRECT)", "pread", _raw_read(big, alloc_host(nbytes)[0]))
        count = max(1, nbytes // CHUNK)
        add("dd write (oflag=direct,fsync)", "dd", _dd([f"if={big}", f"of={work / 'dd.bin'}", f"bs={CHUNK}",
                                                       f"count={count}", "oflag=direct", "conv=fsync"]))
        drop_cache([big])
        add("dd cold read (iflag=direct)", "dd", _dd([f"if={big}", "of=/dev/null", f"bs={CHUNK}", f"count={count}",
                                                     "iflag=direct"]))
        _fio_stages(work / "fio", pool, blocks, io_threads, add)
        keys = list(range(blocks))
        results = {}
        for direct in (False, True):
            ft = FileTier((pool,), blocks, IOPath("posix", "bench"), FileSettings(
                root=work / f"tier-{int(direct)}", fsync="data", io_threads=io_threads, direct_io=direct))
            items = [(k, {pool.name: rows_view[k]}) for k in keys]
            t = time.perf_counter()
            errs = ft.write(items)
            add(f"block files durable write{' O_DIRECT' if direct else ''}", "POSIX pool", time.perf_counter() - t)
            assert not any(errs.values()), errs
            files = [ft.path(k, pool.name) for k in keys]
            out, _o = alloc_host(nbytes)
            outs = out.reshape(blocks, pool.block_nbytes)
            for verify, dt in _cold_reads(ft, files, keys, pool, outs,
                                          lambda: np.array_equal(out, host)):
                add(f"block files cold read{' O_DIRECT' if direct else ''}{'' if verify else ' no-verify'}",
                    "POSIX pool", dt)
                results[(direct, verify)] = dt
            if not direct:
                ft.verify = True
                t = time.perf_counter()
                ft.read([(k, {pool.name: outs[k]}) for k in keys])
                add("block files warm read", "POSIX pool", time.perf_counter() - t)
                drop_cache(files)
                out2, _o2 = alloc_host(nbytes)
                dt = _aiofiles_read(files, list(out2.reshape(blocks, pool.block_nbytes)))
                assert np.array_equal(out2, host)
                add("block files cold read via aiofiles", "aiofiles", dt)
            ft.close()
        _gpu_stages(work, pool, blocks, host, io_threads, io_mode, add, rep)
        raw = ("raw", "dd", "fio")
        best_w = min(r["seconds"] for r in rows if r["stage"].startswith(tuple(f"{x} write" for x in raw)))
        best_r = min(r["seconds"] for r in rows if r["stage"].startswith(tuple(f"{x} cold" for x in raw)))
        for r in rows:
            if "write" in r["stage"] and not r["stage"].startswith(raw):
                r["ratio_to_raw"] = best_w / r["seconds"]
            elif "cold read" in r["stage"] and not r["stage"].startswith(raw):
                r["ratio_to_raw"] = best_r / r["seconds"]
        rep["raw_write_gbps"] = nbytes / best_w / 1e9
        rep["raw_read_gbps"] = nbytes / best_r / 1e9
        rep["checksum_cost"] = results[(False, True)] / results[(False, False)] - 1
        rep["ok"] = True
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rep


def _fio_stages(directory: Path, pool: PoolSpec, blocks: int, io_threads: int, add) -> None:
    """fio rows (where fio is installed): durable and plain writes, cold reads, of ``blocks``
    blocks at the block size with ``io_threads`` in flight."""
    from tiercache.bench.fiobase import fio_binary, run_fio
    from tiercache.bench.fiospec import FioJob

    if fio_binary() is None:
        return
    job = FioJob(name="fiobase", rw="write", iodepth=max(1, io_threads), direct=True)
    nbytes = blocks * pool.block_nbytes
    for label, op, durable in (("fio write (fdatasync=1)", "write", True), ("fio write (end_fsync=1)", "write", False),
                               ("fio cold read (direct=1)", "read", False)):
        b = run_fio(job, pool.block_nbytes, blocks, directory, op, durable=durable)
        add(label, b["engine"], nbytes / max(b["bw_bytes"], 1), {"fio": b})
    shutil.rmtree(directory, ignore_errors=True)


def _cold_reads(ft: FileTier, files, keys, pool: PoolSpec, rows, same) -> list[tuple[bool, float]]:
    """Cold reads of every block into ``rows`` with checksum verification on, then off;
    ``same()`` checks the bytes read. Returns ``[(verify, seconds)]``."""
    out = []
    for verify in (True, False):
        ft.verify = verify
        drop_cache(files)
        t = time.perf_counter()
        errs = ft.read([(k, {pool.name: rows[k]}) for k in keys])
        dt = time.perf_counter() - t
        if any(errs.values()) or not same():
            raise AssertionError(f"cold read returned wrong bytes or errors: {errs}")
        out.append((verify, dt))
    ft.verify = True
    return out


def _gpu_stages(work, pool, blocks, host, io_threads, io_mode, add, rep) -> None:
    """VRAM <-> block files through the path ``io_mode`` picks and through the other one
    (kvikio: GDS or compat mode; tiercache's POSIX pool with O_DIRECT and pinned bounce
    buffers, each I/O thread reading or writing one block while the others' cross PCIe)."""
    from tiercache.cuda import cuda_status

    if not cuda_status().available:
        return
    import cupy

    path = select_io_path(io_mode)
    rep["io_path"] = {"name": path.name, "label": path.label, "reason": path.reason}
    nbytes = host.nbytes
    dev = cupy.asarray(host)
    big = work / "raw.bin"
    try:
        import kvikio
    except ImportError:
        kvikio = None
    if kvikio is not None:

        raw = cupy.empty_like(dev)
        drop_cache([big])
        t = time.perf_counter()
        with kvikio.CuFile(big, "r") as f:
            f.pread(raw, nbytes).get()
        add("raw cold read into VRAM (one kvikio read)", "kvikio", time.perf_counter() - t)
        assert bool((raw == dev).all())
        del raw
    # the chosen path first, then the other one, for the ratio between them
    paths = [path, IOPath("posix", "bench") if path.kvikio else IOPath("compat", "bench")]
    if kvikio is None:
        paths = [p for p in paths if not p.kvikio]
    keys = list(range(blocks))
    rows_dev = dev.reshape(blocks, pool.block_nbytes)
    for p in paths:
        label = p.label + (" + O_DIRECT" if p.name == "posix" else "")
        ft = FileTier((pool,), blocks, p, FileSettings(root=work / f"tier-gpu-{p.name}", fsync="data",
                                                       io_threads=io_threads, direct_io=True))
        t = time.perf_counter()
        errs = ft.write([(k, {pool.name: rows_dev[k]}) for k in keys])
        add("block files durable write from VRAM", label, time.perf_counter() - t)
        assert not any(errs.values()), errs
        files = [ft.path(k, pool.name) for k in keys]
        dev2 = cupy.empty_like(dev)
        rows2 = dev2.reshape(blocks, pool.block_nbytes)
        for verify, dt in _cold_reads(ft, files, keys, pool, rows2, lambda: bool((dev2 == dev).all())):
            add(f"block files cold read into VRAM{'' if verify else ' no-verify'}", label, dt)
        ft.close()


def run_file_bench_repeated(root: Path, pool: PoolSpec, repeats: int, log=print, **kw) -> dict:
    """:func:`run_file_bench` ``repeats`` times; each stage reports the median over the passes of
    its GB/s and of its ratio to the raw figure *of the same pass* (a disk whose speed drifts
    between passes then shifts both sides of a ratio together). ``passes`` keeps every pass."""
    import statistics

    passes = []
    for i in range(repeats):
        if repeats > 1:
            log(f"  pass {i + 1} of {repeats}")
        passes.append(run_file_bench(root, pool, log=log, **kw))
    rep = dict(passes[-1])
    rows = []
    for j, row in enumerate(passes[-1]["stages"]):
        same = [p["stages"][j] for p in passes]
        merged = dict(row, seconds=statistics.median(r["seconds"] for r in same),
                      gb_per_s=statistics.median(r["gb_per_s"] for r in same))
        if "ratio_to_raw" in row:
            merged["ratio_to_raw"] = statistics.median(r["ratio_to_raw"] for r in same)
            merged["ratio_range"] = [min(r["ratio_to_raw"] for r in same), max(r["ratio_to_raw"] for r in same)]
        rows.append(merged)
    for key in ("raw_write_gbps", "raw_read_gbps", "checksum_cost"):
        rep[key] = statistics.median(p[key] for p in passes)
    rep.update(stages=rows, repeats=repeats, passes=passes, ok=all(p["ok"] for p in passes))
    return rep


def format_file_report(rep: dict) -> str:
    """The file benchmark as a table."""
    out = [f"tiercache file benchmark: {rep['blocks']} blocks x {rep['block_bytes'] / 2**20:.2f} MiB "
           f"({rep['bytes'] / 2**20:.0f} MiB) in {rep['dir']}, {rep['io_threads']} I/O threads",
           f"  best raw: write {rep['raw_write_gbps']:.2f} GB/s, cold read {rep['raw_read_gbps']:.2f} GB/s; "
           f"checksum verification costs {rep['checksum_cost']:+.0%} on cold reads"
           + (f" (medians of {rep['repeats']} passes; ratios against each pass's own raw figure)"
              if rep.get("repeats", 1) > 1 else ""), "",
           f"  {'stage':<44} {'path':<16} {'GB/s':>6} {'vs raw':>7} {'range':>10}"]
    for r in rep["stages"]:
        ratio = f"{r['ratio_to_raw']:.0%}" if "ratio_to_raw" in r else ""
        span = f"{r['ratio_range'][0]:.0%}-{r['ratio_range'][1]:.0%}" if "ratio_range" in r else ""
        out.append(f"  {r['stage']:<44} {r['path']:<16} {r['gb_per_s']:>6.2f} {ratio:>7} {span:>10}")
    return "\n".join(out)
