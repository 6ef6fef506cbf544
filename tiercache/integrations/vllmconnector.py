"""tiercache's own offloading path in vLLM: a KV connector that loads a prefix from block files
straight into vLLM's paged GPU KV cache, and stores computed blocks behind the forward pass.

Load it with one config line (vLLM 0.26 through 0.33; docs/vllm.md has the table of keys)::

    --kv-transfer-config '{"kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.integrations.vllmconnector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"root": "/mnt/nvme/kv"}}'

Why a connector and not an ``OffloadingSpec``, and what the stages measured before it were:
docs/vllm.md, "The direct path: design".

- **Files.** One file per vLLM block (``block_size`` tokens) and rank: the block's page of
  every layer, in layer order (K and V apart where the attention backend keeps them apart), as
  a tiercache block file (4 KiB header, XXH3-64, atomic publication) under
  ``<root>/<model>_<digest>_c_r<rank>`` (the digest covers the model, the block size, the
  layout and the parallel sizes). The key is vLLM's block hash (a prefix hash: it names the
  block's tokens and every token before them).
- **Scheduler side.** An in-memory index of the blocks every rank's root holds (listed at
  start; then the stores that finished, less the loads that failed). A lookup counts the
  leading blocks of a request's prompt that are there, beyond vLLM's own prefix-cache hit, and
  asks vLLM to load them asynchronously: the request waits in ``WAITING_FOR_REMOTE_KVS`` while
  other requests run, and no step polls the disk. Each step's metadata names, per request, the
  blocks to load (keys and GPU block ids) and the newly computed full blocks of its prompt to
  store.
- **Worker side** (one per rank). A :class:`~tiercache.rowstore.RowStore` over a pinned
  staging buffer of rows (one row = one block's file data), on the native I/O engine. A load
  reads a prefix in pieces; while piece ``i + 1`` is read, piece ``i`` goes from its pinned rows
  straight into its blocks' pages, every region of every block in one ``cuMemcpyBatchAsync``
  on a side stream (addresses computed at once: no Python per block or layer, which inside
  vLLM's busy engine loop waits for the GIL at every call; without the batch call, a copy and
  a scatter per region). A store waits for the step's
  forward pass (an event), gathers the blocks' pages into staging rows and writes them in the
  background; a finished request's blocks are held until its stores are published.
- **Never a wrong token.** A block whose file is missing, truncated or fails its checksum is
  reported through ``get_block_ids_with_load_errors``: vLLM recomputes from that block on
  (``kv_load_failure_policy = "recompute"``, which the connector sets where it is not), the
  file is quarantined and the key leaves the index.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from tiercache.errors import ConfigError
from tiercache.files import SUBDIRS, parse_filename
from tiercache.rowstore import RowStore
from tiercache.integrations.vllm import with_defaults
from tiercache.settings import sections

log = logging.getLogger("tiercache")

#: the connector's keys, their defaults, and where each tiercache setting lives
DEFAULTS: dict[str, Any] = {
    "root": None, "capacity_bytes": 0, "capacity_blocks": None, "sharing": "exclusive", "fsync": "data",
    "verify": True, "io_engine": "auto", "io_threads": 8, "open_files": -1, "direct_io": True,
    "check_root_owner": True, "staging_bytes": 1 << 30, "piece_blocks": 32,
}
SETTING_KEYS = {"capacity_bytes": "capacity_bytes", "sharing": "sharing", "fsync": "fsync",
                "verify": "verify_checksums", "io_engine": "io_engine", "io_threads": "io_threads",
                "open_files": "open_files", "direct_io": "direct_io", "check_root_owner": "check_root_owner"}


def parse_config(extra: dict[str, Any]) -> dict[str, Any]:
    """The connector's settings: ``extra`` (``kv_connector_extra_config``) checked and completed
    with :data:`DEFAULTS`.

    Raises:
        ConfigError: an unknown key (named, with the valid ones), ``root`` missing, or a value
            out of range (the ranges of :mod:`tiercache.settings`).
    """
    out = with_defaults(extra, DEFAULTS, "TierCacheConnector")
    out["root"] = [str(r) for r in (out["root"] if isinstance(out["root"], (list, tuple)) else [out["root"]])]
    try:
        sections(**{name: out[k] for k, name in SETTING_KEYS.items()})
    except ConfigError as exc:
        raise ConfigError(f"TierCacheConnector: {exc}") from None
    for k, lo in (("staging_bytes", 1 << 20), ("piece_blocks", 1)):
        v = out[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"TierCacheConnector: {k!r} = {v!r} must be an integer >= {lo}")
    cap = out["capacity_blocks"]
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ConfigError(f"TierCacheConnector: 'capacity_blocks' = {cap!r} must be a positive integer")
    return out


def block_key(h) -> bytes:
    """A vLLM block hash as a tiercache key (bytes, 1..64: longer hashes are hashed down)."""
    b = bytes(h) if not isinstance(h, int) else h.to_bytes(16, "little", signed=True)
    return b if 0 < len(b) <= 64 else hashlib.blake2b(b, digest_size=32).digest()


def rank_roots(roots: list[str], digest: str, model: str, rank: int) -> list[Path]:
    """Where rank ``rank`` keeps its files: ``<root>/<model>_<digest>_c_r<rank>`` under each root."""
    name = "".join(c if c.isalnum() or c in "-." else "-" for c in Path(model.rstrip("/")).name)[:64] or "model"
    return [Path(r) / f"{name}_{digest}_c_r{rank}" for r in roots]


def layout_digest(vllm_config, row_bytes_hint: str = "") -> str:
    """What must match for two engines to read each other's files: the model, dtype, block size,
    KV layout and parallel sizes."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    ident = {"model": str(mc.model), "dtype": str(mc.dtype), "cache_dtype": str(cc.cache_dtype),
             "block_size": int(cc.block_size), "tp": int(pc.tensor_parallel_size),
             "pp": int(pc.pipeline_parallel_size), "layers": int(mc.get_num_layers(pc)),
             "kv_heads": int(mc.get_num_kv_heads(pc)), "head_size": int(mc.get_head_size()),
             "extra": row_bytes_hint}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]


def list_keys(roots: list[Path]) -> set[bytes]:
    """The keys of the block files under ``roots`` (names only; files are checked when read)."""
    out: set[bytes] = set()
    for r in roots:
        for sub in SUBDIRS:
            try:
                names = os.listdir(r / sub)
            except OSError:
                continue
            for n in names:
                parsed = parse_filename(n)
                if parsed is not None and isinstance(parsed[0], bytes):
                    out.add(parsed[0])
    return out


def block_views(t: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """Byte views ``[num_blocks, page_bytes]`` (uint8) of one layer's KV cache tensor: the block
    axis (the axis of size ``num_blocks`` that is outermost in memory) first, split along the
    next axes until each block's part is contiguous (FlashAttention's ``[2, num_blocks, ...]``
    gives K and V apart; ``[num_blocks, 2, ...]`` one view).

    Raises:
        ConfigError: no axis of ``num_blocks``, or a block's part that is never contiguous.
    """
    dims = [i for i, s in enumerate(t.shape) if s == num_blocks]
    if not dims:
        raise ConfigError(f"TierCacheConnector: a KV cache tensor of shape {tuple(t.shape)} has no axis of "
                          f"{num_blocks} blocks")
    bdim = max(dims, key=lambda i: t.stride(i))
    parts = [t.movedim(bdim, 0)]
    while not all(p[0].is_contiguous() and p.stride(0) >= p[0].numel() for p in parts):
        if parts[0].dim() < 3:
            raise ConfigError(f"TierCacheConnector: the blocks of a KV cache tensor of shape {tuple(t.shape)} and "
                              f"strides {t.stride()} are not contiguous in memory")
        parts = [q for p in parts for q in p.unbind(1)]
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    es = t.element_size()
    return [torch.as_strided(raw, (num_blocks, p[0].numel() * es), (p.stride(0) * es, 1), p.storage_offset() * es)
            for p in parts]


@dataclass
class _Transfer:
    req_id: str
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class TierCacheConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers: blocks to load and to store, per request."""

    loads: list[_Transfer] = field(default_factory=list)
    stores: list[_Transfer] = field(default_factory=list)


@dataclass
class _Req:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    load: tuple[int, list[bytes]] | None = None
    loading: list[bytes] = field(default_factory=list)
    load_ids: list[int] = field(default_factory=list)
    stored_upto: int = 0
    storing: list[bytes] = field(default_factory=list)


class ConnectorScheduler:
    """The scheduler side of :class:`TierCacheConnector`: the index of the blocks on disk (keys
    present in every rank's root, in least-recently-used order), and the loads and stores of
    each step.

    Args:
        vllm_config: vLLM's config (``cache_config.block_size``: tokens per block).
        settings: :func:`parse_config`'s result (``capacity_blocks`` bounds the index).
        roots_by_rank: per tensor-parallel rank, its roots (listed once, names only).
    """

    def __init__(self, vllm_config, settings: dict, roots_by_rank: list[list[Path]]) -> None:
        self.block_size = int(vllm_config.cache_config.block_size)
        self.settings = settings
        keys = None
        for roots in roots_by_rank:
            found = list_keys(roots)
            keys = found if keys is None else keys & found
        self.present: collections.OrderedDict[bytes, None] = collections.OrderedDict((k, None) for k in keys or ())
        self.reqs: dict[str, _Req] = {}
        self._to_load: list[str] = []
        log.info("tiercache: vLLM connector: %d block(s) on disk under %s", len(self.present),
                 ", ".join(str(r[0]) for r in roots_by_rank))

    def _req(self, request) -> _Req:
        st = self.reqs.get(request.request_id)
        if st is None:
            st = self.reqs[request.request_id] = _Req(request)
        return st

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._req(request)
        hashes = request.block_hashes
        start = num_computed_tokens // self.block_size
        limit = min(len(hashes), (request.num_prompt_tokens - 1) // self.block_size)  # >= 1 token to compute
        keys = []
        for i in range(start, limit):
            k = block_key(hashes[i])
            if k not in self.present:
                break
            keys.append(k)
        st.load = (start, keys) if keys else None
        return (len(keys) * self.block_size, True) if keys else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        st = self._req(request)
        if num_external_tokens <= 0 or st.load is None:
            st.load = None
            return
        start, keys = st.load
        keys = keys[:num_external_tokens // self.block_size]
        ids = list(blocks.get_block_ids()[0])
        if len(ids) < start + len(keys):
            raise RuntimeError(f"TierCacheConnector: {len(ids)} blocks allocated for request {request.request_id}, "
                               f"{start + len(keys)} expected")
        st.loading, st.load_ids = keys, ids[start:start + len(keys)]
        st.load = (start, keys)
        for k in keys:
            self.present.move_to_end(k, last=True)
        self._to_load.append(request.request_id)

    def build_connector_meta(self, so) -> TierCacheConnectorMetadata:
        meta = TierCacheConnectorMetadata()
        for rid in self._to_load:
            st = self.reqs.get(rid)
            if st is not None and st.load is not None:
                meta.loads.append(_Transfer(rid, st.loading, st.load_ids))
                st.load = None
        self._to_load.clear()
        for new in so.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            self._plan_store(meta, new.req_id, st, new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0))
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None)
        for i, rid in enumerate(cached.req_ids):
            st = self.reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            was_resumed = (rid in resumed) if resumed is not None else bool(cached.resumed_from_preemption[i])
            if new_ids is not None:
                st.block_ids = list(new_ids[0]) if was_resumed else st.block_ids + list(new_ids[0])
            self._plan_store(meta, rid, st, cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0))
        return meta

    def _plan_store(self, meta: TierCacheConnectorMetadata, rid: str, st: _Req, computed: int) -> None:
        full = min(computed, st.request.num_prompt_tokens) // self.block_size
        full = min(full, len(st.request.block_hashes), len(st.block_ids))
        if full <= st.stored_upto:
            return
        keys, ids = [], []
        for b in range(st.stored_upto, full):
            k = block_key(st.request.block_hashes[b])
            if k not in self.present and k not in st.storing:
                keys.append(k)
                ids.append(st.block_ids[b])
        st.stored_upto = full
        if keys:
            st.storing.extend(keys)
            meta.stores.append(_Transfer(rid, keys, ids))

    def update_connector_output(self, out) -> None:
        for rid in getattr(out, "finished_sending", None) or ():
            st = self.reqs.pop(rid, None)
            if st is not None:
                for k in st.storing:
                    self.present[k] = None
                self._evict()
        bad = set(getattr(out, "invalid_block_ids", None) or ())
        for rid in getattr(out, "finished_recving", None) or ():
            st = self.reqs.get(rid)
            if st is not None and bad:
                for k, b in zip(st.loading, st.load_ids):
                    if b in bad:
                        self.present.pop(k, None)
            if st is not None:
                st.loading = []

    def _evict(self) -> None:
        cap = self.settings["capacity_blocks"]
        while cap is not None and len(self.present) > cap:
            self.present.popitem(last=False)

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        st = self.reqs.get(request.request_id)
        if st is None:
            return False, None
        if st.storing:
            return True, None  # held until the stores are published (finished_sending)
        self.reqs.pop(request.request_id, None)
        return False, None


class ConnectorWorker:
    """The worker side of :class:`TierCacheConnector` for one rank: the pinned staging rows
    (``[2 * piece, row_bytes]`` uint8; a row is one block's pages of every layer region), the
    :class:`~tiercache.rowstore.RowStore` of this rank's roots, the thread that runs loads
    (first) and stores, and what finished.

    Args:
        settings: :func:`parse_config`'s result.
        roots: this rank's roots (one, or a root array's members).

    A load or store never raises into vLLM: a failed load is reported as load errors of its
    blocks from the first bad one, a failed store is logged and its blocks are not kept.
    """

    def __init__(self, settings: dict, roots: list[Path]) -> None:
        self.settings = settings
        self.roots = roots
        self.views: list[torch.Tensor] = []
        self.store: RowStore | None = None
        self._q: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._recving: set[str] = set()
        self._errors: set[int] = set()
        self._stores_left: collections.Counter = collections.Counter()
        self._had_stores: set[str] = set()
        self._finished_reqs: set[str] = set()
        self._results: dict = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self._step_event = None

    # -- setup -------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        seen, views = set(), []
        for t in kv_caches.values():
            for v in block_views(t, num_blocks):
                ident = (v.data_ptr(), v.stride(0), v.shape[1])
                if ident not in seen:
                    seen.add(ident)
                    views.append(v)
        self.views = views
        self.offsets = np.cumsum([0] + [v.shape[1] for v in views]).tolist()
        self.row_bytes = int(self.offsets[-1])
        self.device = views[0].device
        self.cuda = views[0].is_cuda
        # two slabs of staging rows: one piece lands while the next is read
        self.piece = max(1, min(self.settings["piece_blocks"], self.settings["staging_bytes"] // self.row_bytes // 2))
        rows = 2 * self.piece
        self.staging = torch.empty((rows, self.row_bytes), dtype=torch.uint8, pin_memory=self.cuda)
        self.dev_staging = torch.empty((self.piece, self.row_bytes), dtype=torch.uint8, device=self.device)
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.batch = None
        if self.cuda:  # one driver call per piece: every region of every block, host rows <-> device pages
            from tiercache.copypaths import BatchCopy

            b = BatchCopy()
            self.batch = b if b.available else None
        self.view_ptrs = np.array([v.data_ptr() for v in views], dtype=np.uint64)
        self.view_strides = np.array([v.stride(0) for v in views], dtype=np.uint64)
        self.view_sizes = np.array([v.shape[1] for v in views], dtype=np.uint64)
        s = self.settings
        self.store = RowStore(self.staging.numpy(), [str(r) for r in self.roots] if len(self.roots) > 1 else
                              str(self.roots[0]), capacity_blocks=s["capacity_blocks"],
                              **{name: s[k] for k, name in SETTING_KEYS.items()})
        self._thread = threading.Thread(target=self._run, name="tiercache-vllm-connector", daemon=True)
        self._thread.start()
        log.info("tiercache: vLLM connector worker: %d region(s) per block, %d bytes per block file, %d staging "
                 "rows, pieces of %d, root %s (%d blocks held)", len(views), self.row_bytes, rows, self.piece,
                 self.roots[0], len(self.store))

    # -- the step's calls --------------------------------------------------------------------
    def submit(self, meta: TierCacheConnectorMetadata) -> None:
        with self._cv:
            for t in meta.loads:
                self._q.appendleft(("load", t, None))  # loads before queued stores
            if meta.stores:
                ev = None
                if self.cuda:  # stores wait for this step's forward pass
                    ev = torch.cuda.Event()
                    self._step_event = ev
                for t in meta.stores:
                    self._stores_left[t.req_id] += 1
                    self._had_stores.add(t.req_id)
                    self._q.append(("store", t, ev))
            self._cv.notify()

    def after_forward(self) -> None:
        """``wait_for_save``: the step's stores may read the blocks once the forward pass that
        computed them is done (an event on the current stream)."""
        ev, self._step_event = self._step_event, None
        if ev is not None:
            ev.record(torch.cuda.current_stream(self.device))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._cv:
            self._finished_reqs |= set(finished_req_ids)
            sending = {r for r in self._finished_reqs if r in self._had_stores and not self._stores_left[r]}
            self._finished_reqs -= sending
            self._had_stores -= sending
            self._finished_reqs &= self._had_stores
            recving, self._recving = self._recving, set()
        return sending or None, recving or None

    def load_errors(self) -> set[int]:
        with self._cv:
            out, self._errors = self._errors, set()
        return out

    # -- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                if self._closed and not self._q:
                    return
                kind, t, ev = self._q.popleft()
            try:
                if kind == "load":
                    self._load(t)
                else:
                    self._store(t, ev)
            except Exception:  # pragma: no cover - reported, never raised into vLLM
                log.exception("tiercache: vLLM connector %s of request %s failed", kind, t.req_id)
                if kind == "load":
                    with self._cv:
                        self._errors.update(t.block_ids)
                        self._recving.add(t.req_id)
            finally:
                if kind == "store":
                    with self._cv:
                        self._stores_left[t.req_id] -= 1

    def _wait_job(self, job_id) -> Any:
        while True:
            for r in self.store.finished():
                self._results[r.job_id] = r
            if job_id in self._results:
                return self._results.pop(job_id)
            time.sleep(0.0001)

    def _slab(self, i: int, n: int) -> list[int]:
        """Rows of staging slab ``i % 2``, ``n`` of them."""
        base = (i % 2) * self.piece
        return list(range(base, base + n))

    def _load(self, t: _Transfer) -> None:
        pending: collections.deque = collections.deque()
        failed_from = None
        for i, lo in enumerate(range(0, len(t.keys), self.piece)):
            keys, ids = t.keys[lo:lo + self.piece], t.block_ids[lo:lo + self.piece]
            rows = self._slab(i, len(keys))
            pending.append((lo, keys, ids, rows, self.store.submit_load(keys, rows)))
            if len(pending) >= 2:
                failed_from = self._land(pending.popleft(), failed_from)
        while pending:
            failed_from = self._land(pending.popleft(), failed_from)
        with self._cv:
            if failed_from is not None:
                self._errors.update(t.block_ids[failed_from:])
            self._recving.add(t.req_id)

    def _land(self, item, failed_from: int | None) -> int | None:
        """Wait for a piece's reads, then copy its good leading rows into their blocks (done
        when this returns: the slab is read again next)."""
        lo, keys, ids, rows, job = item
        res = self._wait_job(job)
        good = next((i for i, k in enumerate(keys) if k in res.failed), len(keys))
        if good < len(keys) and failed_from is None:
            failed_from = lo + good
            log.warning("tiercache: vLLM connector: block %s could not be loaded (%s); vLLM recomputes from there",
                        keys[good].hex(), res.failed[keys[good]])
        if failed_from is not None and failed_from <= lo:
            good = 0
        if good:
            self._scatter(rows[0], ids[:good])
        return failed_from

    def _addresses(self, row0: int, ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(device pages, host row parts, sizes)``: one copy per block and region, row-major."""
        n = len(ids)
        blocks = np.asarray(ids, dtype=np.uint64)
        dev = (self.view_ptrs[None, :] + blocks[:, None] * self.view_strides[None, :]).ravel()
        base = np.uint64(self.staging.data_ptr() + row0 * self.row_bytes)
        host = (base + np.arange(n, dtype=np.uint64)[:, None] * np.uint64(self.row_bytes)
                + np.asarray(self.offsets[:-1], dtype=np.uint64)[None, :]).ravel()
        return dev, host, np.tile(self.view_sizes, n)

    def _scatter(self, row0: int, ids: list[int]) -> None:
        """Staging rows ``row0 ..`` -> the pages of blocks ``ids`` (one copy up, then a scatter
        per region on the device)."""
        if self.batch is not None:
            dev, host, sizes = self._addresses(row0, ids)
            self.batch.launch(self.batch.prepare(dev, host, sizes), self.stream.cuda_stream)
            self.stream.synchronize()
            return
        n = len(ids)
        src = self.staging[row0:row0 + n]
        idx = torch.tensor(ids, dtype=torch.long, device=self.device)
        if not self.cuda:
            for v, off in zip(self.views, self.offsets):
                v.index_copy_(0, idx, src[:, off:off + v.shape[1]])
            return
        with torch.cuda.stream(self.stream):
            dev = self.dev_staging[:n]
            dev.copy_(src, non_blocking=True)
            for v, off in zip(self.views, self.offsets):
                v.index_copy_(0, idx, dev[:, off:off + v.shape[1]])
        self.stream.synchronize()

    def _gather(self, row0: int, ids: list[int], ev) -> None:
        """The pages of blocks ``ids`` -> staging rows ``row0 ..`` (after ``ev``: the forward
        pass that computed them)."""
        if self.batch is not None:
            if ev is not None:
                self.stream.wait_event(ev)
            dev, host, sizes = self._addresses(row0, ids)
            self.batch.launch(self.batch.prepare(host, dev, sizes), self.stream.cuda_stream)
            self.stream.synchronize()
            return
        n = len(ids)
        dst = self.staging[row0:row0 + n]
        idx = torch.tensor(ids, dtype=torch.long, device=self.device)
        if not self.cuda:
            for v, off in zip(self.views, self.offsets):
                dst[:, off:off + v.shape[1]] = v.index_select(0, idx)
            return
        with torch.cuda.stream(self.stream):
            if ev is not None:
                self.stream.wait_event(ev)
            dev = self.dev_staging[:n]
            for v, off in zip(self.views, self.offsets):
                dev[:, off:off + v.shape[1]].copy_(v.index_select(0, idx))
            dst.copy_(dev, non_blocking=True)
        self.stream.synchronize()

    def _store(self, t: _Transfer, ev) -> None:
        for lo in range(0, len(t.keys), self.piece):
            keys, ids = t.keys[lo:lo + self.piece], t.block_ids[lo:lo + self.piece]
            rows = self._slab(0, len(keys))
            self._gather(rows[0], ids, ev)
            res = self._wait_job(self.store.submit_store(keys, rows))
            if res.failed:
                log.warning("tiercache: vLLM connector: %d block(s) not stored: %s", len(res.failed),
                            next(iter(res.failed.values())))

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
        if self.store is not None:
            self.store.drain()
            self.store.close()


class TierCacheConnector(KVConnectorBase_V1):
    """vLLM's KV connector for tiercache's direct path (see the module's doc).

    Args:
        vllm_config, role, kv_cache_config: what vLLM passes to every connector.

    Raises:
        ConfigError: a bad key or value in ``kv_connector_extra_config``.
        RootError: a root that cannot be used (not writable, not tiercache's, in use).
    """

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.settings = parse_config(dict(ktc.kv_connector_extra_config or {}))
        if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            # a file that fails its checks must be a recompute of that prefix, never a failed request
            log.info("tiercache: vLLM connector sets kv_load_failure_policy to 'recompute'")
            ktc.kv_load_failure_policy = "recompute"
        digest = layout_digest(vllm_config)
        model = str(vllm_config.model_config.model)
        tp = int(vllm_config.parallel_config.tensor_parallel_size)
        self.kv_cache_config = kv_cache_config
        self._sched: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = ConnectorScheduler(vllm_config, self.settings,
                                     [rank_roots(self.settings["root"], digest, model, r) for r in range(tp)])
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank() if tp > 1 else 0
            self._worker = ConnectorWorker(self.settings, rank_roots(self.settings["root"], digest, model, rank))

    # -- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._sched.update_connector_output(connector_output)

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        return self._sched.request_finished(request, block_ids)

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self.kv_cache_config.num_blocks if self.kv_cache_config is not None else None
        if num_blocks is None:
            num_blocks = next(iter(kv_caches.values())).shape[0]
        self._worker.register(kv_caches, int(num_blocks))

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierCacheConnectorMetadata)
        self._worker.submit(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request runs once every block is in

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # stores gather whole blocks after the forward pass (wait_for_save)

    def wait_for_save(self) -> None:
        self._worker.after_forward()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()


__all__ = ["ConnectorScheduler", "ConnectorWorker", "DEFAULTS", "TierCacheConnector", "TierCacheConnectorMetadata", "block_key", "block_views",
           "parse_config", "rank_roots"]
