"""``tiercache bench sglang-storage``: SGLang's own ``file`` HiCache backend and tiercache's
(:mod:`tiercache.integrations.sglang`) side by side, in one run, on one directory, driven
through the same calls of SGLang's cache controller that a server makes.

For each model geometry (``configs/models``: KV heads, head_dim and layers of a real model), a
real SGLang host pool (``MHATokenToKVPoolHost``, layout ``page_first``, on the CPU, random
bytes) of ``pages`` pages of ``page_tokens`` tokens; then for each backend:

1. **set**: every page, in batches of ``batch`` pages (by default as many as SGLang's controller
   puts in one storage call, its ``STORAGE_BATCH_SIZE``), through the controller's page-set path
   for that backend (``_generic_page_set`` for ``file``, which SGLang uses for it;
   ``_page_set_zero_copy`` for tiercache, which ``interface_v1`` selects);
2. the page cache dropped where this process may (``/proc/sys/vm/drop_caches``: SGLang's file
   backend reads through it, tiercache with O_DIRECT), so that gets come from the device;
3. **get**: every page in a new random order, in batches, into other slots of the pool
   (``_generic_page_get`` / ``_page_get_zero_copy``), and every page compared byte for byte
   with what was set.

Reported per backend and op: pages/s, GB/s, batch latency p50/p99, and wrong pages (must be
0); the speed ratios tiercache / file; and fio's best random read and sequential write at the
page's size on the same directory (:func:`~tiercache.bench.fiobase.best_fio`). Both backends
write without fsync here (SGLang's file backend has none; tiercache's ``fsync`` is set to
``none`` for the comparison and reported). Reproduces docs/sglang.md's table.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np

from tiercache.bench.benchvllmserve import head_dim, model_config
from tiercache.bench.fiobase import beyond_cache_text
from tiercache.errors import ConfigError

BACKENDS = ("file", "tiercache")
#: SGLang's environment variable for its file backend's directory (the only one 0.5.10 reads)
FILE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"


def import_sglang() -> None:
    """Import every SGLang module the bench uses, before any pool exists. SGLang's imports try
    optional packages (vLLM's kernels among them) and keep a failed attempt's exception, whose
    traceback holds the frames of the import chain up to the function that first imported: were
    that a function holding a host pool, the pool (GiBs) would outlive it, and SGLang would refuse
    the next model's pool for want of free memory.

    Raises:
        ConfigError: SGLang is not importable.
    """
    try:
        import sglang.srt.managers.cache_controller  # noqa: F401
        import sglang.srt.mem_cache.hicache_storage  # noqa: F401
        import sglang.srt.mem_cache.memory_pool  # noqa: F401
        import sglang.srt.mem_cache.storage  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"sglang-storage: SGLang is not installed ({exc}); see README.md, 'Quick start'") from None
    try:
        import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
        import sglang.srt.mem_cache.pool_host.mla  # noqa: F401
    except ImportError:
        import sglang.srt.mem_cache.memory_pool_host  # noqa: F401


def sglang_host_pool(cfg: dict, pages: int, page_tokens: int, layout: str = "page_first", mla: bool = False,
                     seed: int = 0, pin: bool = False):
    """A real SGLang host pool on the CPU for model config ``cfg`` (``num_hidden_layers``,
    ``num_key_value_heads``, head_dim), holding ``pages`` pages of ``page_tokens`` tokens (its
    device pool as large, so twice that in all), float16 (bfloat16 for ``mla``: SGLang's MLA
    pool, 512 + 64 wide), filled with random bytes from ``seed``. Built with the API of the
    installed release (0.5.11 and later: from the device pool's buffer info; earlier: from the
    device pool).

    Raises:
        ConfigError: SGLang is not importable.
    """
    import torch

    warnings.filterwarnings("ignore", module="sglang")
    import_sglang()
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    try:
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
        new = True
    except ImportError:
        from sglang.srt.mem_cache.memory_pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost
        new = False
    layers, tokens = int(cfg["num_hidden_layers"]), pages * page_tokens
    if mla:
        dev = MLATokenToKVPool(tokens, page_tokens, torch.bfloat16, 512, 64, layers, "cpu", False, 0, layers)
        cls, extra = MLATokenToKVPoolHost, {"target_layer_num": layers}
    else:
        dev = MHATokenToKVPool(tokens, page_tokens, torch.float16, int(cfg["num_key_value_heads"]), head_dim(cfg),
                               layers, "cpu", False, start_layer=0, end_layer=layers)
        cls, extra = MHATokenToKVPoolHost, {"write_back_staging": getattr(dev, "hicache_write_back_staging", None)}
    if new:
        pool = cls(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_tokens, layout, pin_memory=pin,
                   device="cpu", device_capacity_tokens=dev.size, start_layer=dev.start_layer, end_layer=dev.end_layer,
                   **extra)
    else:
        pool = cls(dev, 2.0, 0, page_tokens, layout, pin_memory=pin, device="cpu")
    buf = pool.kv_buffer.view(torch.uint8).view(-1)
    g = torch.Generator().manual_seed(seed)
    step = 1 << 26
    for lo in range(0, buf.numel(), step):
        part = buf[lo:lo + step]
        part.copy_(torch.randint(0, 256, part.shape, generator=g, dtype=torch.uint8))
    return pool


def page_bytes_at(pool, slot: int) -> bytes:
    """The bytes of the page at token slot ``slot``, in the pool's piece order."""
    import torch

    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(slot, slot + pool.page_size))
    return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))


def storage_config(extra: dict, mla: bool = False, model: str = "bench/model", page_first: bool = True,
                   tp_rank: int = 0, tp_size: int = 1):
    """SGLang's ``HiCacheStorageConfig`` for rank ``tp_rank`` of ``tp_size`` (the fields the
    installed release has)."""
    import dataclasses

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    want = {"tp_rank": tp_rank, "tp_size": tp_size, "pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0, "attn_cp_size": 1,
            "is_mla_model": mla, "enable_storage_metrics": False, "is_page_first_layout": page_first,
            "model_name": model, "extra_config": extra}
    names = {f.name for f in dataclasses.fields(HiCacheStorageConfig)}
    return HiCacheStorageConfig(**{k: v for k, v in want.items() if k in names})


class ControllerCalls:
    """The page set and get paths of SGLang's ``HiCacheController`` for one backend, called on a
    stand-in controller that carries only what those paths read."""

    def __init__(self, backend, pool, zero_copy: bool) -> None:
        from sglang.srt.managers.cache_controller import HiCacheController

        self.c = HiCacheController
        self.stub = SimpleNamespace(storage_backend=backend, storage_host_pool=pool, mem_pool_host=pool,
                                    page_size=pool.page_size)
        self.zero_copy = zero_copy

    def set(self, keys: list[str], slots) -> bool:
        fn = self.c._page_set_zero_copy if self.zero_copy else self.c._generic_page_set
        return bool(fn(self.stub, keys, slots))

    def get(self, keys: list[str], slots) -> int:
        """Pages read (the leading run the controller counts)."""
        tokens: list[int] = []
        op = SimpleNamespace(
            request_id="bench", is_terminated=lambda: False, increment=lambda n: tokens.append(n) or True
        )
        fn = self.c._page_get_zero_copy if self.zero_copy else self.c._generic_page_get
        n = fn(self.stub, op, keys, slots)
        return int(n) if n is not None else sum(tokens) // self.stub.page_size


def _drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else 0.0


def _backend(name: str, roots: list[Path], pool, io_threads: int, zero_copy: bool = True):
    """Backend ``name`` over ``roots`` (SGLang's ``file`` backend takes the first; tiercache's
    with its ``zero_copy`` setting)."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    if name == "file":
        # its directory: the extra config's "file_storage_path" where the release reads it
        # (0.5.23), else only SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR (0.5.10: otherwise /tmp/hicache)
        cfg = storage_config({"file_storage_path": str(roots[0])})
        with mock.patch.dict(os.environ, {FILE_DIR_ENV: str(roots[0])}):
            be = StorageBackendFactory.create_backend("file", cfg, pool)
        where = Path(getattr(be, "file_path", roots[0]))
        if where.resolve() != roots[0].resolve():
            raise ConfigError(f"sglang-storage: SGLang's file backend writes to {where}, not {roots[0]}: "
                              "the comparison would not be on one directory")
    else:
        cfg = storage_config({"backend_name": "tiercache", "module_path": "tiercache.integrations.sglang",
                              "class_name": "TierCacheHiCacheStorage", "interface_v1": 1,
                              "root": [str(r) for r in roots] if len(roots) > 1 else str(roots[0]),
                              "fsync": "none", "io_threads": io_threads, "zero_copy": zero_copy})
        be = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    be.register_mem_pool_host(pool)
    return be


def run_one(work: Path, name: str, cfg: dict, pages: int, page_tokens: int, batch: int, seed: int,
            io_threads: int, log=lambda s: None, array: list[Path] | None = None, zero_copy: bool = True,
            keep: bool = False) -> dict:
    """One model geometry: both backends on ``work`` (with ``array``: tiercache over those
    directories, SGLang's ``file`` backend on the first; see the module's doc). Each backend's
    files are removed once it is measured (``keep``: left), so that a directory in memory
    (tmpfs) holds one backend's pages at a time."""
    import torch

    pool = sglang_host_pool(
        cfg, pages, page_tokens, seed=seed, pin=torch.cuda.is_available()
    )  # the host pool holds twice: sources, destinations
    pb = len(page_bytes_at(pool, 0))
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(32).hex() for _ in range(pages)]
    src = list(range(pages))
    want = [page_bytes_at(pool, p * page_tokens) for p in src]
    ptrs, _ = pool.get_page_buffer_meta(torch.arange(page_tokens))
    out: dict = {"model": name, "page_tokens": page_tokens, "page_bytes": pb, "pages": pages, "batch": batch,
                 # a pinned pool (CUDA) is page-aligned; a CPU tensor is where torch's allocator
                 # aligns large blocks (THP_MEM_ALLOC_ENABLE=1): O_DIRECT in place needs it
                 "pool_pinned": bool(torch.cuda.is_available()),
                 "pool_page_aligned": all(int(a) % 4096 == 0 for a in ptrs), "backends": {}}

    def slots(ps):
        return torch.cat([torch.arange(p * page_tokens, (p + 1) * page_tokens) for p in ps]).to(torch.int64)

    for bname in BACKENDS:
        roots = [d / f"{work.name}-{bname}" for d in array] if array else [work / f"root-{bname}"]
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
        be = _backend(bname, roots, pool, io_threads, zero_copy)
        calls = ControllerCalls(be, pool, zero_copy=bname == "tiercache")
        res: dict = {}
        times = []
        t_all = time.perf_counter()
        for lo in range(0, pages, batch):
            t0 = time.perf_counter()
            ok = calls.set(keys[lo:lo + batch], slots(src[lo:lo + batch]))
            times.append(time.perf_counter() - t0)
            if not ok:
                raise ConfigError(f"sglang-storage: the {bname} backend failed to store a batch")
        dt = time.perf_counter() - t_all
        res["set"] = {"pages_per_s": pages / dt, "gbps": pages * pb / dt / 1e9, "batch_p50_ms": 1e3 * _pct(times, 50),
                      "batch_p99_ms": 1e3 * _pct(times, 99)}
        res["page_cache_dropped"] = _drop_page_cache()
        order = [int(i) for i in rng.permutation(pages)]
        dst = list(range(pages, 2 * pages))
        times, got = [], 0
        t_all = time.perf_counter()
        for lo in range(0, pages, batch):
            idx = order[lo:lo + batch]
            t0 = time.perf_counter()
            got += calls.get([keys[i] for i in idx], slots([dst[i] for i in idx]))
            times.append(time.perf_counter() - t0)
        dt = time.perf_counter() - t_all
        res["get"] = {"pages_per_s": pages / dt, "gbps": pages * pb / dt / 1e9, "batch_p50_ms": 1e3 * _pct(times, 50),
                      "batch_p99_ms": 1e3 * _pct(times, 99), "pages_read": got}
        res["wrong_pages"] = sum(page_bytes_at(pool, dst[i] * page_tokens) != want[i] for i in range(pages))
        if bname == "tiercache":
            res["in_place"] = bool(be.zero_copy)  # pages moved in place, not through staging rows
        if hasattr(be, "close"):
            be.close()
        out["backends"][bname] = res
        if not keep:
            for root in roots:
                shutil.rmtree(root, ignore_errors=True)
        log(f"  {name}: {bname}: set {res['set']['gbps']:.2f} GB/s, get {res['get']['gbps']:.2f} GB/s, "
            f"{res['wrong_pages']} wrong page(s)")
        for p in range(pages, 2 * pages):  # the next backend's gets land on other bytes
            ptrs, sizes = pool.get_page_buffer_meta(torch.arange(p * page_tokens, (p + 1) * page_tokens))
            for a, s in zip(ptrs, sizes):
                ctypes.memset(a, 0, s)
    f, t = out["backends"]["file"], out["backends"]["tiercache"]
    out["tiercache_over_file"] = {op: t[op]["gbps"] / f[op]["gbps"] for op in ("set", "get")}
    return out


def run_sglang_bench(directory: Path, models: tuple[str, ...] = ("llama-3.1-8b", "tiny-llama"), page_tokens: int = 64,
                     total_bytes: int = 1 << 30, batch: int | None = None, fio: bool = True, fio_runtime: float = 5.0,
                     io_threads: int = 16, seed: int | None = None, keep: bool = False, log=lambda s: None,
                     array: list[Path] | None = None, zero_copy: bool = True) -> dict:
    """The bench (see the module's doc): per model, ``total_bytes`` of pages (at least 2 * ``batch``
    pages; ``batch`` None: SGLang's own ``STORAGE_BATCH_SIZE``, the pages its controller puts in
    one storage call, 128) under a fresh work directory in ``directory``; with ``array`` (directories, one per
    device), tiercache's backend over all of them (a root array), SGLang's ``file`` backend on
    the first, and fio over all of them; ``zero_copy``: tiercache's setting of that name (False:
    its pages through staging rows, for comparison). Returns the report (JSON-ready).

    Raises:
        ConfigError: SGLang missing, a bad model, a bad size, or a backend that failed.
    """
    import_sglang()
    import sglang

    from tiercache.integrations.sglangcompat import STORAGE_BATCH_SIZE

    batch = STORAGE_BATCH_SIZE if batch is None else batch
    if batch < 1 or page_tokens < 1 or total_bytes < 1:
        raise ConfigError(f"sglang-storage: batch={batch}, page_tokens={page_tokens}, total_bytes={total_bytes} "
                          "must be positive")
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    directory.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="sglang-storage-", dir=directory))
    report: dict = {"sglang": sglang.__version__, "seed": seed, "directory": str(directory), "runs": [],
                    "array": [str(d) for d in array] if array else None, "zero_copy": zero_copy}
    try:
        for i, model in enumerate(models):
            name, cfg = model_config(model)
            kv_tok = 2 * int(cfg["num_hidden_layers"]) * int(cfg["num_key_value_heads"]) * head_dim(cfg) * 2
            pb = kv_tok * page_tokens
            pages = max(2 * batch, total_bytes // pb)
            log(f"sglang-storage: {name}, {pages} pages of {page_tokens} tokens ({pb} bytes)")
            rep = run_one(work, name, cfg, pages, page_tokens, batch, seed + i, io_threads, log, array, zero_copy, keep)
            if fio:
                from tiercache.bench.fiobase import best_fio

                log(f"  fio: best at {pb} bytes on the same {'devices' if array else 'directory'}")
                rep["fio"] = best_fio(list(array) if array else work, pb, min(pages * pb, 4 << 30), fio_runtime)
                for op, fop in (("get", "read"), ("set", "write")):
                    g = rep["fio"].get(f"{fop}_gbps")
                    if g:
                        rep["backends"]["tiercache"][op]["over_fio"] = rep["backends"]["tiercache"][op]["gbps"] / g
                        rep["backends"]["file"][op]["over_fio"] = rep["backends"]["file"][op]["gbps"] / g
                    far = rep["fio"].get(f"{fop}_beyond_cache_gbps")
                    if far:  # against fio's best with a host pool's footprint (fiobase.best_fio)
                        rep["backends"]["tiercache"][op]["over_fio_beyond_cache"] = \
                            rep["backends"]["tiercache"][op]["gbps"] / far
            report["runs"].append(rep)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    report["ok"] = all(b["wrong_pages"] == 0 and b["get"]["pages_read"] == r["pages"]
                       for r in report["runs"] for b in r["backends"].values())
    return report


def format_sglang_report(rep: dict) -> str:
    """The report as text."""
    lines = [f"tiercache sglang-storage (SGLang {rep['sglang']}), {rep['directory']}, seed {rep['seed']}"]
    for r in rep["runs"]:
        lines.append(f"{r['model']}: {r['pages']} pages of {r['page_tokens']} tokens ({r['page_bytes']} B), "
                     f"batches of {r['batch']}")
        lines.append(
            f"  {'backend':10} {'op':4} {'pages/s':>9} {'GB/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'/fio':>6}  wrong"
        )
        for b, res in r["backends"].items():
            for op in ("set", "get"):
                o = res[op]
                fio = f"{o['over_fio']:.2f}" if "over_fio" in o else "-"
                lines.append(f"  {b:10} {op:4} {o['pages_per_s']:9.0f} {o['gbps']:7.2f} {o['batch_p50_ms']:8.1f} "
                             f"{o['batch_p99_ms']:8.1f} {fio:>6}  {res['wrong_pages']}")
        t = r["tiercache_over_file"]
        moved = "in place" if r["backends"]["tiercache"].get("in_place") else "through staging rows"
        aligned = "page-aligned" if r.get("pool_page_aligned") else "not page-aligned (no O_DIRECT in place)"
        pinned = "pinned" if r.get("pool_pinned") else "not pinned"
        lines.append(f"  tiercache's pages {moved}; the host pool {pinned}, {aligned}")
        lines.append(f"  tiercache / file: set {t['set']:.2f}x, get {t['get']:.2f}x"
                     + ("" if r["backends"]["tiercache"]["page_cache_dropped"] else " (page cache not dropped: gets "
                        "may come from memory)"))
        f = r.get("fio") or {}
        if f.get("read_gbps"):
            lines.append(f"  fio at the page size: read {f['read_gbps']:.2f} GB/s ({f.get('read_config')}), "
                         f"write {f.get('write_gbps', 0):.2f} GB/s ({f.get('write_config')})" + beyond_cache_text(f))
            if f.get("read_grid"):
                lines.append("  fio's reads by point: " + ", ".join(f"{k} {v:.2f}" for k, v in f["read_grid"].items()))
    lines.append("ok" if rep["ok"] else "FAILED: wrong or missing pages")
    return "\n".join(lines)


__all__ = ["BACKENDS", "ControllerCalls", "format_sglang_report", "page_bytes_at", "run_sglang_bench",
           "sglang_host_pool", "storage_config"]
