"""SGLang's HiCache on tiercache: a storage backend (GPU -> host -> **files**) with checksums on
every read, atomic writes, a bounded disk with LRU, restart, shared roots and root arrays.

Loaded by SGLang's ``dynamic`` backend factory (SGLang 0.5.6 and later)::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "tiercache", "module_path": "tiercache.integrations.sglang",
          "class_name": "TierCacheHiCacheStorage", "interface_v1": 1, "root": "/mnt/nvme/hicache"}'

``interface_v1: 1`` makes SGLang's cache controller call the zero-copy methods
(:meth:`TierCacheHiCacheStorage.batch_get_v1` / :meth:`~TierCacheHiCacheStorage.batch_set_v1`),
which move pages between the host pool's own memory and the files. The other keys are this
backend's (:data:`DEFAULTS`; docs/sglang.md says what each does).

**How a page moves.** One HiCache page (``page_size`` tokens of every layer, K and V) is one
tiercache block file (``block_{key}_pool_rows.bin``, checksummed). The host pool tells where a
page's bytes are (``get_page_buffer_meta``: ``layer_first`` gives 2 x layers pieces per page,
``page_first`` and ``page_first_direct`` 2 for MHA, 1 for MLA); a batch's pieces are gathered
into pinned staging rows by a copy per run of consecutive pieces (torch, GIL released: a batch
of consecutive slots is one run per piece kind) and written by the native I/O engine's
threads, and read back the same way and scattered likewise. Python runs per batch and per run,
not per page where slots are consecutive.

**What SGLang's own ``file`` backend does not give** (sglang 0.5.23 ``HiCacheFile``: one raw
file per page under ``/tmp/hicache``, no checksum, no fsync): a corrupt, truncated or missing
page is a failed get (the prefix stops there; its file is quarantined), never a wrong page in
the host pool; a restarted server finds its pages (the root's saved index); several servers
may share one root (``sharing: "shared"``); the disk stays within ``capacity_bytes``.

**Keys.** SGLang's page keys (hex SHA-256 strings, or other strings) become block keys (the
hash's bytes, or BLAKE2b of the string). Files go under ``<root>/<model>_<digest>_hc_r<tp
rank>of<tp size>`` (``_hc_mla`` for MLA pools, whose KV every tensor-parallel rank holds
whole: one rank writes, every rank reads). The digest covers the page's geometry, dtype and
host layout, so pages of another model, layout or dtype are never read as this one's.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiercache.arrays import aligned_empty, prefault
from tiercache.errors import ConfigError
from tiercache.files import BlockPieces, native_pieces
from tiercache.integrations import sglangcompat as compat
from tiercache.integrations.engineconfig import ROWSTORE_KEYS, check_positive, with_defaults
from tiercache.integrations.rowjobs import RowJobs
from tiercache.rowstore import KeyState, RowStore
from tiercache.settings import sections

log = logging.getLogger("tiercache")

#: this backend's keys of the extra config and their defaults
DEFAULTS: dict[str, Any] = {
    "root": None, "capacity_bytes": 0, "capacity_blocks": None, "sharing": "exclusive", "fsync": "data",
    "verify": True, "io_engine": "threads", "io_threads": 16, "open_files": -1, "direct_io": True,
    "check_root_owner": True, "staging_bytes": 512 << 20, "probe_wait_s": 0.5, "zero_copy": True,
}
#: keys of the same extra config that SGLang itself reads (ignored here)
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "interface_v2",
                         "tp_lcm_size", "enable_metadata_cache", "metadata_ttl"})
#: the smallest piece (bytes) the batched gather addresses as one row; pieces whose addresses
#: have a smaller common divisor are copied one by one
MIN_ROW_BYTES = 64


def parse_config(extra: dict[str, Any] | None) -> dict[str, Any]:
    """The backend's settings: ``extra`` (SGLang's ``--hicache-storage-backend-extra-config``)
    checked and completed with :data:`DEFAULTS` (SGLang's own keys, :data:`SGLANG_KEYS`, are
    ignored).

    Raises:
        ConfigError: an unknown key (named, with the valid ones), ``root`` missing, or a value
            out of range (the ranges of :mod:`tiercache.settings`).
    """
    who = "TierCacheHiCacheStorage"
    out = with_defaults(dict(extra or {}), DEFAULTS, who, ignored=SGLANG_KEYS)
    out["root"] = [str(r) for r in (out["root"] if isinstance(out["root"], (list, tuple)) else [out["root"]])]
    try:
        sections(**{name: out[k] for k, name in ROWSTORE_KEYS.items()})
    except ConfigError as exc:
        raise ConfigError(f"{who}: {exc}") from None
    check_positive(who, out, "staging_bytes", 1 << 20)
    check_positive(who, out, "capacity_blocks", optional=True)
    if not isinstance(out["zero_copy"], bool):
        raise ConfigError(f"{who}: 'zero_copy' = {out['zero_copy']!r} must be true or false")
    w = out["probe_wait_s"]
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= 60:
        raise ConfigError(f"{who}: 'probe_wait_s' = {w!r} must be seconds in [0, 60]")
    return out


def page_key(key: str) -> bytes:
    """An SGLang page key as a block key: the bytes of a hex hash (up to 64 bytes), else the
    32-byte BLAKE2b of the string."""
    if isinstance(key, bytes):
        return key if 0 < len(key) <= 64 else hashlib.blake2b(key, digest_size=32).digest()
    if 0 < len(key) <= 128 and len(key) % 2 == 0:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    return hashlib.blake2b(key.encode(), digest_size=32).digest()


class PageLayout:
    """Where a host pool keeps each page's bytes, from its ``get_page_buffer_meta``: a page is
    ``pieces`` pieces of ``piece_bytes`` bytes each (their order in the page's file is the
    order the pool lists them), ``page_bytes`` in all.

    Raises:
        ConfigError: the pool lists pieces of different sizes, or none.
    """

    def __init__(self, pool) -> None:
        self.pool = pool
        self.page_size = int(pool.page_size)
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(self.page_size, dtype=torch.int64))
        if not ptrs or len(set(sizes)) != 1:
            raise ConfigError(f"TierCacheHiCacheStorage: the host pool ({type(pool).__name__}, layout "
                              f"{getattr(pool, 'layout', '?')}) gives pieces of sizes {sorted(set(sizes))}; one "
                              "size per page is needed")
        self.pieces, self.piece_bytes = len(ptrs), int(sizes[0])
        self.page_bytes = self.pieces * self.piece_bytes

    def describe(self) -> dict:
        """What makes a page's bytes mean the same thing: the digest of the file names."""
        p = self.pool
        return {
            "pool": type(p).__name__,
            "layout": str(getattr(p, "layout", "")),
            "dtype": str(getattr(p, "dtype", "")),
            "page_size": self.page_size,
            "layers": int(getattr(p, "layer_num", 0) or 0),
            "heads": int(getattr(p, "head_num", 0) or 0),
            "head_dim": int(getattr(p, "head_dim", 0) or 0),
            "pieces": self.pieces,
            "piece_bytes": self.piece_bytes,
        }

    def rows(self, host_indices, pages: int):
        """The host memory of ``pages`` pages starting at token slots ``host_indices[i *
        page_size]``: ``(view, index)``, where ``view`` is a ``[R, g]`` uint8 tensor over the
        span of host memory the pieces cover (no copy) and ``index`` the ``int64`` rows of
        ``view`` that make up the pages, in file order (``pages * page_bytes / g`` rows); or
        ``(None, addresses)`` where the pieces' addresses have no common divisor of at least
        :data:`MIN_ROW_BYTES` (then each piece is copied by itself)."""
        ptrs = self._addresses(host_indices, pages)
        base = int(ptrs.min())
        offs = ptrs - base
        g = int(np.gcd.reduce(np.append(offs, self.piece_bytes)))
        if g < MIN_ROW_BYTES:
            return None, ptrs
        span = int(offs.max()) + self.piece_bytes
        buf = (ctypes.c_uint8 * span).from_address(base)
        view = torch.frombuffer(buf, dtype=torch.uint8).view(-1, g)
        per = self.piece_bytes // g
        index = ((offs // g)[:, None] + np.arange(per, dtype=np.int64)).reshape(-1)
        return view, torch.from_numpy(index)

    def page_pieces(self, host_indices, pages: int) -> BlockPieces:
        """The host memory of ``pages`` pages starting at token slots ``host_indices[i *
        page_size]``, as the blocks of a :class:`~tiercache.files.blockpieces.BlockPieces` (page
        ``i``'s pieces in file order), for reads and writes in place."""
        return BlockPieces(self._addresses(host_indices, pages).reshape(pages, self.pieces), self.piece_bytes)

    def _addresses(self, host_indices, pages: int) -> np.ndarray:
        """The pool's piece addresses (``int64``, file order) of ``pages`` pages at
        ``host_indices``."""
        idx = host_indices[:pages * self.page_size]
        if isinstance(idx, torch.Tensor):
            idx = idx.to("cpu", torch.int64)
        else:
            idx = torch.as_tensor(np.asarray(idx, dtype=np.int64))
        ptrs, _ = self.pool.get_page_buffer_meta(idx)
        return np.asarray(ptrs, dtype=np.int64)


def rank_dir(cfg, layout: PageLayout) -> str:
    """The directory name of this rank's pages under each root (see the module's doc)."""
    model = (getattr(cfg, "model_name", None) or "model").rstrip("/").split("/")[-1]
    model = "".join(c if c.isalnum() or c in "-." else "-" for c in model)[:64] or "model"
    mla = bool(getattr(cfg, "is_mla_model", False))
    shard = {"pp": (getattr(cfg, "pp_rank", 0), getattr(cfg, "pp_size", 1)),
             "cp": (getattr(cfg, "attn_cp_rank", 0), getattr(cfg, "attn_cp_size", 1)),
             "dcp": (getattr(cfg, "dcp_rank", 0), getattr(cfg, "dcp_size", 1))}
    ident = {**layout.describe(), "mla": mla, **({} if mla else {"tp_size": cfg.tp_size}),
             **{k: list(v) for k, v in shard.items() if v[1] > 1}}
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]
    suffix = "".join(f"_{k}{r}of{n}" for k, (r, n) in shard.items() if n > 1)
    return f"{model}_{digest}_hc_mla{suffix}" if mla else f"{model}_{digest}_hc_r{cfg.tp_rank}of{cfg.tp_size}{suffix}"


class TierCacheHiCacheStorage(compat.HiCacheStorage):
    """SGLang's ``HiCacheStorage`` over a tiercache :class:`~tiercache.rowstore.RowStore` (see
    the module's doc). Built by SGLang's ``StorageBackendFactory`` (``dynamic``) as
    ``cls(storage_config, kwargs)``; the store opens when SGLang registers the host pool
    (:meth:`register_mem_pool_host`), which fixes the page size.

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig`` (ranks, model name, MLA, and
            ``extra_config``: :func:`parse_config`).
        kwargs: what the factory passes besides (unused).

    Thread safety: SGLang's prefetch and backup threads call at once; each call takes its own
    staging rows.

    Raises:
        ConfigError: a bad key or value in the extra config.
        RootError: at :meth:`register_mem_pool_host`, a root that cannot be used (not
            writable, not tiercache's, held by another process in exclusive mode).
    """

    def __init__(self, storage_config, kwargs: dict | None = None) -> None:
        self.storage_config = storage_config
        self.settings = parse_config(getattr(storage_config, "extra_config", None))
        # both made by register_mem_pool_host (SGLang calls it before any page moves)
        self.store: RowStore = None  # type: ignore[assignment]
        self.layout: PageLayout = None  # type: ignore[assignment]
        self.staging: torch.Tensor = None  # type: ignore[assignment]  # [slabs * slab_rows, page_bytes] uint8
        self.slab_rows = 0  # pages per staging slab
        self.zero_copy = False  # pages moved in place (set at registration)
        self._slabs = 0
        self.jobs = RowJobs(help=True)  # a get or set waits for its pieces in turn: it runs their I/O itself
        self.writer = bool(compat.is_storage_writer(storage_config))
        self.counters: dict[str, int] = {"get_pages": 0, "get_failed_pages": 0, "set_pages": 0, "set_skipped_pages": 0,
                                         "set_failed_pages": 0, "get_bytes": 0, "set_bytes": 0}
        self._lock = threading.Lock()
        self._slab_free = threading.Condition(self._lock)
        self._free_slabs: list[int] = []
        self._calls: dict[str, tuple[list, list]] = {"get": ([], []), "set": ([], [])}  # pages, GB/s per call

    # -- setup -------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """SGLang's host pool: fixes the page's bytes and opens the store (its roots under
        each configured root, :func:`rank_dir`)."""
        super().register_mem_pool_host(mem_pool_host)
        if self.store is not None:
            return
        self.layout = PageLayout(mem_pool_host)
        s = self.settings
        sub = rank_dir(self.storage_config, self.layout)
        roots = [str(Path(r) / sub) for r in s["root"]]
        sharing = s["sharing"]
        if bool(getattr(self.storage_config, "is_mla_model", False)) and self.storage_config.tp_size > 1 \
                and sharing != "shared":
            sharing = "shared"  # every rank reads the one copy its writer rank stores
            log.info("tiercache: HiCache storage: MLA pages over %d ranks: the root is shared",
                     self.storage_config.tp_size)
        # pages moved in place (below) need no staging rows but the store's two
        in_place = s["zero_copy"] and s["verify"] and s["io_engine"] != "python" and native_pieces()
        rows = 2 if in_place else max(2, s["staging_bytes"] // self.layout.page_bytes)
        self.slab_rows = max(1, min(compat.STORAGE_BATCH_SIZE, rows // 4))
        slabs = max(2, rows // self.slab_rows)
        shape = (slabs * self.slab_rows, self.layout.page_bytes)
        if torch.cuda.is_available():
            self.staging = torch.empty(shape, dtype=torch.uint8, pin_memory=True)  # pinned: page-aligned
        else:  # page-aligned, so that O_DIRECT writes and reads go from and to the rows in place; mapped
            # now, not in the first sets (tiercache.arrays.prefault; pinned memory already is)
            self.staging = torch.from_numpy(prefault(aligned_empty(shape[0] * shape[1]).reshape(shape)))
        self._free_slabs = list(range(slabs))
        self._slabs = slabs
        settings = {name: s[k] for k, name in ROWSTORE_KEYS.items()}
        settings["sharing"] = sharing
        for r in roots:
            Path(r).mkdir(parents=True, exist_ok=True)
        self.store = RowStore(self.staging.numpy(), roots if len(roots) > 1 else roots[0],
                              capacity_blocks=s["capacity_blocks"], on_finish=self.jobs.finished_hook, **settings)
        self.jobs.attach(self.store)
        # pages read into and written from the host pool in place, where the native engine can
        # (a page's pieces by vectored I/O); else through the staging rows
        self.zero_copy = in_place and self.store.pieces_fit(
            BlockPieces(np.zeros((1, self.layout.pieces), np.int64), self.layout.piece_bytes))
        if in_place and not self.zero_copy:
            log.warning("tiercache: HiCache storage: pages of %d bytes cannot move in place here; they go through "
                        "two staging rows", self.layout.page_bytes)
        self._register_metrics(sub)
        log.info("tiercache: HiCache storage: pages of %d bytes (%d pieces of %d), %d staging slab(s) of %d pages, "
                 "root %s (%d pages held), I/O engine %s, %s", self.layout.page_bytes, self.layout.pieces,
                 self.layout.piece_bytes, slabs, self.slab_rows, roots[0], len(self.store), self.store.ft.engine,
                 "pages moved in place" if self.zero_copy else "pages through the staging rows")

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """SGLang's extra host pools (interface v2, SGLang 0.5.2x and later: hybrid models' Mamba
        and sliding-window states, DeepSeek's indexer pools, draft KV). This backend stores the KV
        pool only: the KV pool under its own name is accepted (it is the one registered by
        :meth:`register_mem_pool_host`); any other pool fails the attach here, with its name,
        rather than the first prefetch of a served request.

        Raises:
            ConfigError: ``host_pool_name`` is not the KV pool's.
        """
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name == compat.KV_POOL_NAME:
            return  # SGLang registered it with register_mem_pool_host before
        raise ConfigError(
            f"tiercache's HiCache backend stores the KV pool only; SGLang registered the extra host pool "
            f"{name!r} (a hybrid model's states, an indexer or "
            "a draft pool: interface v2), which it cannot store. Serve this model without a storage backend "
            "or with one of SGLang's backends that implement interface v2")

    def _register_metrics(self, sub: str) -> None:
        """tiercache's Prometheus series of the store (``prometheus_client``'s default registry,
        which SGLang's ``/metrics`` serves), where prometheus-client is installed."""
        from tiercache import metrics
        from tiercache.errors import TierCacheError

        try:
            self.store.metrics_name = metrics.register(self.store, name=f"sglang-hicache-{sub}")
        except (TierCacheError, ImportError, ValueError):  # no prometheus-client, or the name taken
            pass

    def _record(self, op: str, pages: int, t0: float) -> None:
        if pages and getattr(self.storage_config, "enable_storage_metrics", False):
            dt = max(time.perf_counter() - t0, 1e-9)
            n, bw = self._calls[op]
            with self._lock:
                n.append(pages)
                bw.append(pages * self.layout.page_bytes / dt / 1e9)

    def _need_store(self) -> RowStore:
        if self.store is None:
            raise ConfigError("TierCacheHiCacheStorage: no host pool registered yet (SGLang calls "
                              "register_mem_pool_host first)")
        return self.store

    # -- staging slabs -----------------------------------------------------------------------
    def _take_slabs(self, want: int) -> list[int]:
        """Up to ``want`` staging slabs (at least one; waits for one)."""
        with self._lock:
            while not self._free_slabs:
                self._slab_free.wait()
            out = [self._free_slabs.pop() for _ in range(min(want, len(self._free_slabs)))]
        return out

    def _depth(self, pages: int) -> int:
        """Slabs one call of ``pages`` pages keeps in flight: enough for all of them, at most
        half of all slabs (another thread's call gets the rest), at least one."""
        return max(1, min(-(-pages // self.slab_rows), self._slabs // 2))

    def _give_slabs(self, slabs: list[int]) -> None:
        with self._lock:
            self._free_slabs.extend(slabs)
            self._slab_free.notify_all()

    def _slab(self, slab: int, n: int) -> torch.Tensor:
        r0 = slab * self.slab_rows
        return self.staging[r0:r0 + n]

    # -- the host pool's pages <-> staging rows ------------------------------------------------
    def _slots(self, host_indices, pages: list[int]):
        """The token slots of pages ``pages[j]`` of ``host_indices``, in that order."""
        ps = self.layout.page_size
        if len(pages) == pages[-1] - pages[0] + 1:  # consecutive: one slice
            return host_indices[pages[0] * ps:(pages[-1] + 1) * ps]
        if isinstance(host_indices, torch.Tensor):
            pick = torch.as_tensor(pages, dtype=torch.int64)[:, None] * ps + torch.arange(ps)
            return host_indices.to("cpu", torch.int64)[pick.reshape(-1)]
        arr = np.asarray(host_indices, dtype=np.int64)
        return arr[(np.asarray(pages, dtype=np.int64)[:, None] * ps + np.arange(ps)).reshape(-1)]

    def _copy(self, host_indices, pages: list[int], rows: torch.Tensor, to_host: bool) -> None:
        """Pages ``pages[j]`` of ``host_indices`` <-> staging rows ``rows[j]`` (``[n,
        page_bytes]``): a copy per run of consecutive rows (GIL released), or a copy per piece
        where the pieces' addresses allow no rows (:meth:`PageLayout.rows`)."""
        if not pages:
            return
        view, index = self.layout.rows(self._slots(host_indices, pages), len(pages))
        if view is None:
            flat = rows.view(-1).numpy()
            pb = self.layout.piece_bytes
            for i, a in enumerate(index.tolist()):
                here = flat.ctypes.data + i * pb
                ctypes.memmove(a, here, pb) if to_host else ctypes.memmove(here, a, pb)
            return
        flat = rows.view(-1, view.shape[1])
        # one copy per run of consecutive rows (a batch of consecutive slots: one per piece
        # kind, e.g. K and V), each a memcpy with the GIL released; torch's indexed copies move
        # multi-MiB rows at a fraction of memcpy's speed
        idx = index.numpy()
        cuts = np.flatnonzero(np.diff(idx) != 1) + 1
        starts = np.concatenate(([0], cuts)).tolist()
        ends = np.concatenate((cuts, [idx.size])).tolist()
        for a, b in zip(starts, ends):
            h = int(idx[a])
            if to_host:
                view[h:h + b - a].copy_(flat[a:b])
            else:
                flat[a:b].copy_(view[h:h + b - a])

    # -- the zero-copy calls (interface_v1) ----------------------------------------------------
    def batch_get_v1(self, keys: list[str], host_indices, extra_info=None) -> list[bool]:
        """Read pages ``keys[i]`` into the host pool's page at ``host_indices[i * page_size]``
        (``host_indices``: ``int64`` token slots, ``len(keys) * page_size`` of them). Returns one
        bool per key; a page that is missing, or whose file fails its checks, is False and its
        slots are not written (SGLang keeps the leading Trues)."""
        store = self._need_store()
        n = len(keys)
        out = [False] * n
        if not n:
            return out
        t0 = time.perf_counter()
        bkeys = [page_key(k) for k in keys]
        self._discover(bkeys)
        if self.zero_copy:
            res = self.jobs.wait(self.jobs.submit(store.submit_load, bkeys, list(range(n)),
                                                  pieces=self.layout.page_pieces(host_indices, n)))
            for i, k in enumerate(bkeys):
                out[i] = k not in res.failed
            if res.failed:
                log.debug("tiercache: HiCache storage: %d of %d page(s) not read: %s", len(res.failed), n,
                          next(iter(res.failed.values())))
            self._count_get(n, sum(out), t0)
            return out
        slabs = self._take_slabs(self._depth(n))
        pending: list = []
        try:
            for lo in range(0, n, self.slab_rows):
                if len(pending) == len(slabs):
                    self._land_get(pending.pop(0), host_indices, out)
                used = {p[1] for p in pending}
                slab = next(s for s in slabs if s not in used)
                m = min(self.slab_rows, n - lo)
                r0 = slab * self.slab_rows
                jid = self.jobs.submit(store.submit_load, bkeys[lo:lo + m], list(range(r0, r0 + m)))
                pending.append((lo, slab, m, jid, bkeys[lo:lo + m]))
            while pending:
                self._land_get(pending.pop(0), host_indices, out)
        finally:
            for p in pending:
                self.jobs.wait(p[3])
            self._give_slabs(slabs)
        self._count_get(n, sum(out), t0)
        return out

    def _count_get(self, n: int, good: int, t0: float) -> None:
        self.counters["get_pages"] += good
        self.counters["get_failed_pages"] += n - good
        self.counters["get_bytes"] += good * self.layout.page_bytes
        self._record("get", good, t0)

    def _land_get(self, item, host_indices, out: list[bool]) -> None:
        lo, slab, m, jid, bkeys = item
        res = self.jobs.wait(jid)
        ok = [i for i, k in enumerate(bkeys) if k not in res.failed]
        for i in ok:
            out[lo + i] = True
        if len(ok) < m:
            log.debug("tiercache: HiCache storage: %d of %d page(s) not read: %s", m - len(ok), m,
                      next(iter(res.failed.values())))
        if ok:
            rows = self._slab(slab, m)
            src = rows if len(ok) == m else rows[torch.as_tensor(ok)]
            self._copy(host_indices, [lo + i for i in ok], src, to_host=True)

    def batch_set_v1(self, keys: list[str], host_indices, extra_info=None) -> list[bool]:
        """Write the host pool's pages at ``host_indices[i * page_size]`` as pages ``keys[i]``;
        one bool per key (True: stored now or already; a rank that does not write MLA pages
        answers True for all)."""
        store = self._need_store()
        n = len(keys)
        if not n or not self.writer:
            return [True] * n
        out = [False] * n
        t0 = time.perf_counter()
        bkeys = [page_key(k) for k in keys]
        self._discover(bkeys)  # on a shared root: PENDING is a probe for another server's file
        # what is stored (or being stored) is not written again (the store skips those in flight)
        todo = [i for i, k in enumerate(bkeys) if store.state(k) is not KeyState.PRESENT]
        for i in set(range(n)) - set(todo):
            out[i] = True
        self.counters["set_skipped_pages"] += n - len(todo)
        if not todo:
            return out
        if self.zero_copy:
            pieces = self.layout.page_pieces(host_indices, n)
            self._land_set((todo, None, self.jobs.submit(store.submit_store, [bkeys[i] for i in todo], todo,
                                                         pieces=pieces)), out)
            self._record("set", len(todo), t0)
            return out
        slabs = self._take_slabs(self._depth(len(todo)))
        pending: list = []
        try:
            for lo in range(0, len(todo), self.slab_rows):
                if len(pending) == len(slabs):
                    self._land_set(pending.pop(0), out)
                used = {p[1] for p in pending}
                slab = next(s for s in slabs if s not in used)
                part = todo[lo:lo + self.slab_rows]
                self._copy(host_indices, part, self._slab(slab, len(part)), to_host=False)
                r0 = slab * self.slab_rows
                jid = self.jobs.submit(store.submit_store, [bkeys[i] for i in part], list(range(r0, r0 + len(part))))
                pending.append((part, slab, jid))
            while pending:
                self._land_set(pending.pop(0), out)
        finally:
            for p in pending:
                self.jobs.wait(p[2])
            self._give_slabs(slabs)
        self._record("set", len(todo), t0)
        return out

    def _land_set(self, item, out: list[bool]) -> None:
        part, _, jid = item
        res = self.jobs.wait(jid)
        failed = set(res.failed)
        done = 0
        for i, k in zip(part, res.keys):
            out[i] = k not in failed
            done += out[i]
        if failed:
            log.warning("tiercache: HiCache storage: %d page(s) not stored: %s", len(failed),
                        next(iter(res.failed.values())))
        self.counters["set_pages"] += done
        self.counters["set_failed_pages"] += len(part) - done
        self.counters["set_bytes"] += done * self.layout.page_bytes

    def _discover(self, bkeys: list[bytes]) -> None:
        """On a shared root, pages another server stored are found by the store's probes (a
        stat each, on its thread): wait up to ``probe_wait_s`` for those still looked for."""
        store = self.store
        if not store.shared:
            return
        deadline = time.monotonic() + self.settings["probe_wait_s"]
        todo = [k for k in bkeys if store.state(k) is not KeyState.PRESENT]
        while todo and time.monotonic() < deadline:
            todo = [k for k in todo if store.state(k) is KeyState.PENDING]
            if todo:
                time.sleep(0.0005)

    # -- lookups -----------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        """True if page ``key`` is stored (a store of it still in flight: False)."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info=None) -> int:
        """How many of ``keys``, from the first, are stored (on a shared root, pages other
        servers stored are looked for on disk first, up to ``probe_wait_s``)."""
        store = self._need_store()
        bkeys = [page_key(k) for k in keys]
        self._discover(bkeys)
        for i, k in enumerate(bkeys):
            if store.state(k) is not KeyState.PRESENT:
                return i
        return len(bkeys)

    # -- the generic calls (a tensor per page; SGLang without interface_v1) ---------------------
    def get(self, key: str, target_location=None, target_sizes=None):
        """Page ``key`` into ``target_location`` (a tensor of ``page_bytes`` bytes); it, or None
        where the page is missing or fails its checks."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations=None, target_sizes=None):
        """Pages ``keys[i]`` into ``target_locations[i]``; per key the tensor or None."""
        store = self._need_store()
        bkeys = [page_key(k) for k in keys]
        self._discover(bkeys)
        out: list = []
        for lo in range(0, len(keys), self.slab_rows):
            slab = self._take_slabs(1)
            try:
                m = min(self.slab_rows, len(keys) - lo)
                r0 = slab[0] * self.slab_rows
                res = self.jobs.wait(self.jobs.submit(store.submit_load, bkeys[lo:lo + m], list(range(r0, r0 + m))))
                for j in range(m):
                    t = target_locations[lo + j]
                    if bkeys[lo + j] in res.failed:
                        out.append(None)
                        continue
                    t.view(-1).view(torch.uint8).copy_(self.staging[r0 + j])
                    out.append(t)
            finally:
                self._give_slabs(slab)
        return out

    def set(self, key: str, value=None, target_location=None, target_sizes=None) -> bool:
        """Store ``value`` (a tensor of ``page_bytes`` bytes) as page ``key``."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values=None, target_locations=None, target_sizes=None) -> bool:
        """Store ``values[i]`` as pages ``keys[i]``; True if every page is stored."""
        store = self._need_store()
        if not self.writer:
            return True
        ok = True
        for lo in range(0, len(keys), self.slab_rows):
            slab = self._take_slabs(1)
            try:
                part = list(range(lo, min(lo + self.slab_rows, len(keys))))
                r0 = slab[0] * self.slab_rows
                for j, i in enumerate(part):
                    self.staging[r0 + j].copy_(values[i].contiguous().view(-1).view(torch.uint8))
                res = self.jobs.wait(self.jobs.submit(store.submit_store, [page_key(keys[i]) for i in part],
                                                      list(range(r0, r0 + len(part)))))
                ok = ok and not res.failed
            finally:
                self._give_slabs(slab)
        return ok

    # -- the rest ------------------------------------------------------------------------------
    def clear(self) -> None:
        """Forget nothing on disk: HiCache's ``clear`` (a cache flush) keeps the files (use
        ``tiercache purge`` on the root to delete them)."""

    def get_stats(self):
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s per get and per set
        call; kept only with SGLang's ``--enable-storage-metrics``). The backend's own counters
        are :attr:`counters`; the store's are in tiercache's Prometheus series."""
        with self._lock:
            (gp, gb), (sp, sb) = self._calls["get"], self._calls["set"]
            out = compat.storage_metrics(list(gp), list(sp), list(gb), list(sb))
            for lst in (gp, gb, sp, sb):
                lst.clear()
        return out

    def close(self) -> None:
        """Finish what is in flight, save the root's index, release the root."""
        if self.store is not None:
            from tiercache import metrics

            self.store.drain()
            if self.store.metrics_name:
                metrics.unregister(self.store)
            self.store.close()
            self.store = None  # type: ignore[assignment]


__all__ = ["DEFAULTS", "PageLayout", "TierCacheHiCacheStorage", "page_key", "parse_config", "rank_dir"]
