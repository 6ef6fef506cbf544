"""The scale benchmark (``tiercache bench scale --blocks N``): what a root of ``N`` block
files costs to open, to hold in memory, to look up, to verify and to purge.

One run, on one directory (``<root>/scale-bench``):

1. **populate**: one cache writes ``N`` blocks of ``block_bytes`` random bytes straight to the
   file tier (``put(..., tier="file")``, ``fsync = "none"``, 16-byte content keys, as vLLM's
   and SGLang's are) and closes (its index saved).
2. **open from the saved index**, in a fresh process (``spawn``; modules imported and an empty
   cache opened first, so that what is measured is the open): seconds to open, resident memory
   it added (``/proc/self/statm``) per block; then ``lookup`` of random present keys and
   single-key ``get`` of random file-only blocks (every byte compared), p50/p99 in
   microseconds; absent keys' ``lookup`` too.
3. **open by full scan** (the index deleted first), in another fresh process: what every open
   did before the saved index (one header read per block), as the baseline of the same run
   (``scan = False`` skips it).
4. ``tiercache inspect --json``, ``tiercache verify --json`` and ``tiercache purge --yes``
   as a user runs them (subprocesses; seconds each). verify's speed (every byte of every
   block file, over its wall time, survey included) is compared with the best fio random read
   (:func:`~tiercache.bench.fiobase.best_fio`, O_DIRECT, I/O size = one block file) on the same
   directory; so is its time inside the process (``verify --json``'s ``seconds``: without
   the interpreter's start and exit; the listing and the checks overlap, one subdirectory's
   files checked while the next is filed).
   The page cache is dropped before verify where this process may
   (``/proc/sys/vm/drop_caches``: root); the report says whether it was.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tiercache.bench.fiobase import best_fio
from tiercache.files import file_size

#: blocks per ``put`` while populating (and per batch of generated data)
BATCH = 4096
#: keys timed in the lookup and get phases
LOOKUPS, GETS = 10_000, 2_000
POOL = "scale"


def _keys(seed: int, start: int, stop: int) -> list[bytes]:
    """The content keys of blocks ``start..stop`` (16 bytes each)."""
    return [hashlib.blake2b(b"%d:%d" % (seed, i), digest_size=16).digest() for i in range(start, stop)]


def _batch(seed: int, b: int, n: int, block_bytes: int) -> np.ndarray:
    """The bytes of batch ``b`` (its ``n`` blocks): ``uint8 [n, block_bytes]``."""
    return np.random.default_rng([seed, b]).integers(0, 256, (n, block_bytes), dtype=np.uint8)


def _config(root: Path, blocks: int, block_bytes: int, **kw):
    from tiercache.config import CacheConfig
    from tiercache.geometry import PoolSpec

    return CacheConfig(pools=(PoolSpec(POOL, (block_bytes,), "uint8"),), device_slots=0, host_slots=0,
                       file_slots=blocks, root=root, fsync="none", metrics_registry="none", metrics_snapshot_s=0, **kw)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pct(xs: list[float]) -> dict:
    a = np.asarray(xs) * 1e6
    return {"p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99))}


def populate(root: Path, blocks: int, block_bytes: int, seed: int, log=print) -> float:
    """Write ``blocks`` blocks to a fresh cache at ``root`` and close it; returns seconds."""
    from tiercache.cache import TierCache

    t0 = time.perf_counter()
    with TierCache(_config(root, blocks, block_bytes)) as cache:
        for b, start in enumerate(range(0, blocks, BATCH)):
            stop = min(start + BATCH, blocks)
            cache.put(_keys(seed, start, stop), _batch(seed, b, stop - start, block_bytes), tier="file")
            if b % 64 == 63:
                log(f"  populated {stop} of {blocks} blocks")
        cache.flush()
    return time.perf_counter() - t0


def _open_child(root: str, blocks: int, block_bytes: int, seed: int, timed: bool, results) -> None:
    """Runs in a fresh process: open ``root``, measure, put the result on ``results``."""
    out: dict = {}
    try:
        import tempfile

        from tiercache.cache import TierCache

        with tempfile.TemporaryDirectory() as warm:  # imports and first-use costs paid before the measure
            with TierCache(_config(Path(warm) / "r", 16, block_bytes)) as c:
                c.put(_keys(seed, 0, 4), np.zeros((4, block_bytes), np.uint8), tier="file")
                c.get(_keys(seed, 0, 1))
                c.lookup(b"absent-key-00000")
        rss0 = _rss()
        t0 = time.perf_counter()
        cache = TierCache(_config(Path(root), blocks, block_bytes))
        out["open_s"] = time.perf_counter() - t0
        out["rss_bytes"] = _rss() - rss0
        out["blocks"] = len(cache)
        try:
            if timed:
                rng = np.random.default_rng(seed + 1)
                idx = rng.integers(0, blocks, LOOKUPS)
                keys = [_keys(seed, int(i), int(i) + 1)[0] for i in idx]
                lat, wrong = [], 0
                for k in keys:
                    t = time.perf_counter()
                    found = cache.lookup(k)
                    lat.append(time.perf_counter() - t)
                    wrong += "file" not in found
                out["lookup"] = {**_pct(lat), "missing": wrong}
                lat = []
                for i in range(LOOKUPS):
                    k = b"absent-%09d" % i
                    t = time.perf_counter()
                    cache.lookup(k)
                    lat.append(time.perf_counter() - t)
                out["lookup_absent"] = _pct(lat)
                # gets: random blocks of a few random batches (their bytes regenerated once each)
                nb = (blocks + BATCH - 1) // BATCH
                lat, bad = [], 0
                for b in rng.choice(nb, min(nb, 16), replace=False):
                    n = min(BATCH, blocks - b * BATCH)
                    data = _batch(seed, int(b), n, block_bytes)
                    for j in rng.integers(0, n, GETS // min(nb, 16)):
                        k = _keys(seed, int(b) * BATCH + int(j), int(b) * BATCH + int(j) + 1)
                        t = time.perf_counter()
                        got = cache.get(k)
                        lat.append(time.perf_counter() - t)
                        bad += not np.array_equal(np.asarray(got).reshape(-1), data[j])
                out["get"] = {**_pct(lat), "wrong": bad}
        finally:
            cache.close()
    except BaseException as exc:  # reported to the parent
        out["error"] = f"{type(exc).__name__}: {exc}"
    results.put(out)


def _open(root: Path, blocks: int, block_bytes: int, seed: int, timed: bool) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    p = ctx.Process(target=_open_child, args=(str(root), blocks, block_bytes, seed, timed, results))
    p.start()
    out = results.get()
    p.join()
    return out


def _cli(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "tiercache.cli", *args], capture_output=True, text=True)
    return time.perf_counter() - t0, res


def drop_page_cache() -> bool:
    """Flush dirty pages and drop the page cache (``/proc/sys/vm/drop_caches``), so that what
    follows reads from the disk. Returns False where this process may not (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_scale_bench(root: Path, blocks: int, block_bytes: int = 4096, scan: bool = True, fio: bool = True,
                    fio_runtime: float = 3.0, seed: int | None = None, keep: bool = False, log=print) -> dict:
    """Run the scale benchmark (module docstring) on ``root/scale-bench``; returns the report:
    ``populate_s``, ``index`` and ``scan`` (``open_s``, ``rss_bytes``, ``rss_per_block``,
    lookups and gets), ``inspect_s``, ``verify`` (``seconds``, ``gbps``, ``bad``,
    ``page_cache_dropped``), ``fio`` (best random read), ``verify_vs_fio``, ``purge_s``,
    ``ok`` (every block found, every byte equal, verify found nothing, purge left nothing).

    Raises:
        ConfigError: ``blocks`` < 1 or a block size that is not a positive multiple of 4096.
    """
    from tiercache.errors import ConfigError
    from tiercache.files import INDEX

    if blocks < 1:
        raise ConfigError(f"--blocks {blocks}: the scale job needs at least 1 block")
    if block_bytes <= 0 or block_bytes % 4096:
        raise ConfigError(f"block size {block_bytes}: the scale job takes a positive multiple of 4096 bytes")
    seed = int(np.random.SeedSequence().entropy % (2**31)) if seed is None else seed
    work = Path(root) / "scale-bench"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cache_root = work / "root"
    rep: dict = {"blocks": blocks, "block_bytes": block_bytes, "file_bytes": file_size(block_bytes), "seed": seed}
    try:
        log(f"scale: populating {blocks} blocks of {block_bytes} bytes in {cache_root}")
        rep["populate_s"] = populate(cache_root, blocks, block_bytes, seed, log)
        log("scale: opening from the saved index (fresh process)")
        rep["index"] = _open(cache_root, blocks, block_bytes, seed, True)
        if scan:
            log("scale: opening by full scan (index deleted; fresh process)")
            (cache_root / INDEX).unlink(missing_ok=True)
            rep["scan"] = _open(cache_root, blocks, block_bytes, seed, False)
        for k in ("index", "scan"):
            if k in rep and "rss_bytes" in rep[k]:
                rep[k]["rss_per_block"] = rep[k]["rss_bytes"] / blocks
        rep["inspect_s"], res = _cli("inspect", "--root", str(cache_root), "--json")
        rep["inspect_ok"] = res.returncode == 0
        log("scale: verify")
        dropped = drop_page_cache()
        secs, res = _cli("verify", "--root", str(cache_root), "--json")
        try:
            v = json.loads(res.stdout)
        except ValueError:
            v = {"checked": 0, "bad": [{"problem": (res.stderr or res.stdout).strip()[-300:]}]}
        total = v["checked"] * file_size(block_bytes)
        rep["verify"] = {"seconds": secs, "checked": v["checked"], "bad": len(v["bad"]), "gbps": total / secs / 1e9,
                         "survey_s": v.get("survey_s"), "in_process_s": v.get("seconds"), "page_cache_dropped": dropped}
        if v.get("seconds"):  # listing, reading and checking, inside the process
            rep["verify"]["in_process_gbps"] = total / v["seconds"] / 1e9
        if fio:
            log("scale: fio's best random read on the same directory")
            rep["fio"] = best_fio(work, file_size(block_bytes), min(blocks * file_size(block_bytes), 1 << 30),
                                  fio_runtime, ops=("read",))
            if rep["fio"].get("read_gbps"):
                rep["verify_vs_fio"] = rep["verify"]["gbps"] / rep["fio"]["read_gbps"]
                if "in_process_gbps" in rep["verify"]:
                    rep["in_process_vs_fio"] = rep["verify"]["in_process_gbps"] / rep["fio"]["read_gbps"]
        log("scale: purge")
        rep["purge_s"], res = _cli("purge", "--root", str(cache_root), "--yes")
        left = sum(1 for _, _, fs in os.walk(cache_root) for f in fs if f.startswith("block_"))
        rep["purge_left"] = left
        ix = rep["index"]
        rep["ok"] = ("error" not in ix and ix.get("blocks") == blocks and ix["lookup"]["missing"] == 0
                     and ix["get"]["wrong"] == 0 and rep["verify"]["checked"] == blocks and rep["verify"]["bad"] == 0
                     and res.returncode == 0 and left == 0 and rep.get("scan", {}).get("blocks", blocks) == blocks)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    return rep


def format_scale_report(rep: dict) -> str:
    """The report as a table (one line per measure)."""
    def mib(b):
        return f"{b / 2**20:.0f} MiB"

    lines = [f"scale: {rep['blocks']} blocks of {rep['block_bytes']} bytes ({rep['file_bytes']} bytes per file), "
             f"seed {rep['seed']}", f"populate                  {rep['populate_s']:.1f} s"]
    for k, what in (("index", "open from saved index"), ("scan", "open by full scan")):
        r = rep.get(k)
        if not r:
            continue
        if "error" in r:
            lines.append(f"{what:<26}ERROR {r['error']}")
            continue
        lines.append(
            f"{what:<26}{r['open_s']:.2f} s, {mib(r['rss_bytes'])} resident ({r['rss_per_block']:.0f} B/block)"
        )
    ix = rep["index"]
    if "lookup" in ix:
        lines.append(
            f"lookup (present / absent)  p50 {ix['lookup']['p50_us']:.1f} / {ix['lookup_absent']['p50_us']:.1f} us, "
            f"p99 {ix['lookup']['p99_us']:.1f} / {ix['lookup_absent']['p99_us']:.1f} us"
        )
        lines.append(f"get (one file-only block)  p50 {ix['get']['p50_us']:.0f} us, p99 {ix['get']['p99_us']:.0f} us")
    lines.append(f"inspect                   {rep['inspect_s']:.2f} s")
    v = rep["verify"]
    lines.append(f"verify                    {v['seconds']:.1f} s, {v['gbps']:.2f} GB/s, {v['bad']} bad"
                 + ("" if v["page_cache_dropped"] else " (page cache NOT dropped: not root)"))
    if v.get("in_process_s"):
        lines.append(f"  inside the process       {v['in_process_s']:.1f} s ({v['in_process_gbps']:.2f} GB/s; "
                     f"listing done after {v['survey_s']:.1f} s)")
    f = rep.get("fio") or {}
    if f.get("read_gbps"):
        lines.append(
            f"fio best random read      {f['read_gbps']:.2f} GB/s ({f['read_config']}); "
            f"verify / fio = {rep['verify_vs_fio']:.2f}"
            + (f", inside the process / fio = {rep['in_process_vs_fio']:.2f}" if "in_process_vs_fio" in rep else "")
        )
    elif f:
        lines.append(f"fio                       {f.get('error') or f.get('errors')}")
    lines.append(f"purge                     {rep['purge_s']:.1f} s, {rep['purge_left']} block files left")
    lines.append(
        "bytes: " + ("every block found and equal" if rep["ok"] else "MISMATCH, missing blocks or a failed tool")
    )
    return "\n".join(lines)
