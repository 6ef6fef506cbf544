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
  every layer, in layer order (K and V apart where the attention backend keeps them apart),
  each part's bytes in memory order, as a tiercache block file (4 KiB header, XXH3-64, atomic
  publication) under ``<root>/<model>_<digest>_c_r<rank>`` (the digest covers the model, the
  block size, the parallel sizes and what decides the layout: :func:`layout_digest`). The key
  is vLLM's block hash (a prefix hash: it names the block's tokens and every token before
  them).
- **Scheduler side.** An in-memory index of the blocks every rank's root holds (listed at
  start; then the stores gathered, less the loads that failed). A lookup counts the leading
  blocks of a request's prompt that are there, beyond vLLM's own prefix-cache hit. The worker
  loads them inside a step's ``start_load_kv``; with vLLM's async scheduling (its default) the
  load is asynchronous in vLLM's terms and the request waits in ``WAITING_FOR_REMOTE_KVS`` for
  that step and the one scheduled before its report, and where vLLM schedules synchronously it
  is synchronous: computed in the same step (``load_mode``; synchronous loads with async
  scheduling gave a wrong token after a failed load: docs/vllm.md). (A first version loaded on
  a thread of its own; vLLM 0.26's engine loop ran empty steps back to back, holding the GIL,
  and the thread starved.) Each step's metadata names, per
  request, the blocks to load (keys and GPU block ids) and the newly computed full blocks of
  its prompt to store.
- **Worker side** (one per rank, :class:`ConnectorWorker`). A
  :class:`~tiercache.rowstore.RowStore` over a pinned staging buffer of rows (one row = one
  block's file data), on the native I/O engine. A load runs on the engine's thread: the
  prefix is read in pieces by the I/O engine's threads while the pieces already read go up,
  each in one contiguous copy into VRAM and one launch of the project's gather/scatter kernel
  into the blocks' pages (no Python per block or layer). A store is gathered the same way in
  reverse after the step's forward pass, and written by a background thread; a finished
  request's blocks are freed at once (its gathers still queued are issued before the next
  step's loads and forward pass, or skipped where no staging slab is free).
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
import queue
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from tiercache.arrays import aligned_empty
from tiercache.errors import ConfigError
from tiercache.files import (
    SUBDIRS,
    IOPath,
    claim_layout,
    device_hash_applies,
    device_hasher,
    parse_filename,
    select_io_path,
)
from tiercache.integrations import vllmconnstats
from tiercache.integrations.engineconfig import ROWSTORE_KEYS, check_positive, with_defaults
from tiercache.integrations.loadcost import POLICIES as LOAD_POLICIES
from tiercache.integrations.loadcost import PROBE_EVERY, LoadCost
from tiercache.integrations.rowjobs import RowJobs
from tiercache.integrations.vllmlayers import LayerGroups, LayerwiseLoad
from tiercache.rowstore import POOL, RowStore
from tiercache.settings import sections

log = logging.getLogger("tiercache")

#: the connector's keys, their defaults, and where each tiercache setting lives
DEFAULTS: dict[str, Any] = {
    "root": None, "capacity_bytes": 0, "capacity_blocks": None, "sharing": "exclusive", "fsync": "data",
    "verify": True, "io_engine": "threads", "io_threads": 16, "open_files": -1, "direct_io": True,
    "check_root_owner": True, "staging_bytes": 2 << 30, "piece_blocks": 32, "copy_kernel": "auto",
    "copy_streams": "compute", "load_policy": "faster", "device_staging_bytes": 512 << 20,
    "store_gathers": "thread", "io_mode": "auto", "verify_on": "auto", "load_switch_s": 0.0,
    "scatter_tables": "piece", "load_mode": "auto", "layer_groups": 0,
}
#: how a request waits for its load: ``async``, vLLM's asynchronous load (the request waits in
#: WAITING_FOR_REMOTE_KVS until a step reports it received: one step, two with vLLM's async
#: scheduling), or ``sync``: loaded in the step that computes its suffix, before the forward
#: pass (no step of waiting). ``auto``: ``sync`` where vLLM schedules synchronously on its V1
#: model runner, else ``async``. ``sync`` is refused with vLLM's async scheduling (the step
#: after a failed load is already scheduled from a token sampled over the damaged blocks, and
#: vLLM hands that token out: measured on a GPU with vLLM 0.26 and reproduced under vLLM's own
#: scheduler on the CPU, tests/test_vllm_scheduler.py) and on its V2 model runner (a failed
#: synchronous load is recomputed from the wrong offset: vllm-project/vllm#49250; two wrong
#: answers in two failed loads on an H200 with vLLM 0.26, 2026-12-07)
LOAD_MODES = ("auto", "async", "sync")
#: where the connector's GPU work runs: ``compute``, the engine's own stream (the device
#: slabs' copies and kernels ordered with vLLM's kernels; the default), or ``side``: streams of
#: its own, overlapping vLLM's work. With side streams, vLLM 0.26 on an H200 hit an illegal
#: memory access in FlashAttention four runs in four with Qwen2.5-32B's geometry (never with
#: Llama-3.1-8B's, never with CUDA_LAUNCH_BLOCKING=1, never with torch's copies); on the
#: engine's stream it ran clean (docs/vllm.md, "The direct path: status")
COPY_STREAMS = ("compute", "side")
#: how pages move between the device slabs and the blocks: the project's kernels (``auto``: the
#: bulk-copy kernel where it applies, else the gather/scatter kernel; ``kernel``: always the
#: gather/scatter kernel), or ``torch``: a copy per layer region (no CuPy needed)
COPY_KERNELS = ("auto", "kernel", "torch")
#: who issues the stores' gathers: ``thread``, a thread of the connector's own, once the step's
#: forward pass is done, or ``engine``: the engine's
#: thread inside ``wait_for_save``. There, with an eager forward pass's kernels still queued on
#: the engine's stream, the launches waited for the GPU: a Llama-3.1-8B prompt's gathers held
#: the engine's thread for 240-280 ms, the length of its prefill (docs/vllm.md)
STORE_GATHERS = ("thread", "engine")
#: ``io_mode``: how loads reach vLLM's GPU blocks (:func:`~tiercache.files.select_io_path`):
#: ``auto``, GDS (kvikio's ``CuFile`` reads straight into device slabs) where the cuFile driver
#: reports it, else the native engine's reads into pinned staging and one copy up per piece;
#: ``gds`` (an error where GDS is not available), ``compat`` (kvikio in its compatibility mode,
#: into device slabs), ``posix`` (pinned staging)
SETTING_KEYS = {**ROWSTORE_KEYS, "io_mode": "io_mode"}
#: ``verify_on``: where the data checksums of loads (with ``verify`` on) are compared and
#: those of stores made: ``auto``, on the GPU (:mod:`tiercache.files.devicehash`: a load's rows
#: once up in the device slab, a store's once gathered into its device slab) where the kernel
#: applies, else on the host; ``host``: the native engine's threads, as each file is read or
#: written; ``device`` (an error where it cannot)
VERIFY_ON = ("auto", "host", "device")
#: ``scatter_tables``: a load's scatter kernels take their segment tables ``piece`` by piece
#: (built, uploaded and released with each launch), or all of the ``load``'s at once, before
#: its first piece (:meth:`~tiercache.copypaths.copykernels.CopyLauncher.plan_segments`): less
#: Python and one GIL release fewer per piece on the engine's thread (docs/performance/vllm.md,
#: "A load inside the engine against the worker alone")
SCATTER_TABLES = ("piece", "load")
#: ``layer_groups``: 0, a load is whole before the forward pass; N >= 2, layer-wise loads: the
#: layers in N groups, each group read and sent up before the first layer that needs it while
#: the layers before it compute (:mod:`tiercache.integrations.vllmlayers`; synchronous loads
#: only: vLLM's async scheduling off)


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
    for k, lo in (("staging_bytes", 1 << 20), ("piece_blocks", 1), ("device_staging_bytes", 1 << 20)):
        check_positive("TierCacheConnector", out, k, lo)
    if out["copy_streams"] not in COPY_STREAMS:
        raise ConfigError(f"TierCacheConnector: 'copy_streams' = {out['copy_streams']!r}; valid: "
                          f"{', '.join(COPY_STREAMS)}")
    if out["store_gathers"] not in STORE_GATHERS:
        raise ConfigError(f"TierCacheConnector: 'store_gathers' = {out['store_gathers']!r}; valid: "
                          f"{', '.join(STORE_GATHERS)}")
    if out["load_mode"] not in LOAD_MODES:
        raise ConfigError(f"TierCacheConnector: 'load_mode' = {out['load_mode']!r}; valid: {', '.join(LOAD_MODES)}")
    if out["load_policy"] not in LOAD_POLICIES:
        raise ConfigError(f"TierCacheConnector: 'load_policy' = {out['load_policy']!r}; valid: "
                          f"{', '.join(LOAD_POLICIES)}")
    if out["copy_kernel"] not in COPY_KERNELS:
        raise ConfigError(
            f"TierCacheConnector: 'copy_kernel' = {out['copy_kernel']!r}; valid: {', '.join(COPY_KERNELS)}"
        )
    if out["scatter_tables"] not in SCATTER_TABLES:
        raise ConfigError(f"TierCacheConnector: 'scatter_tables' = {out['scatter_tables']!r}; valid: "
                          f"{', '.join(SCATTER_TABLES)}")
    lg = out["layer_groups"]
    if isinstance(lg, bool) or not isinstance(lg, int) or lg < 0 or lg == 1:
        raise ConfigError(f"TierCacheConnector: 'layer_groups' = {lg!r}; valid: 0 (whole blocks before the forward "
                          "pass) or an integer of at least 2 (layer-wise loads in that many groups of layers)")
    if out["verify_on"] not in VERIFY_ON:
        raise ConfigError(f"TierCacheConnector: 'verify_on' = {out['verify_on']!r}; valid: {', '.join(VERIFY_ON)}")
    check_positive("TierCacheConnector", out, "capacity_blocks", optional=True)
    sw = out["load_switch_s"]
    if isinstance(sw, bool) or not isinstance(sw, (int, float)) or not 0 <= sw <= 0.1:
        raise ConfigError(f"TierCacheConnector: 'load_switch_s' = {sw!r}; valid: 0 (Python's own switch interval) "
                          "or seconds up to 0.1")
    return out


def block_key(h) -> bytes:
    """A vLLM block hash as a tiercache key (bytes, 1..64: longer hashes are hashed down)."""
    b = bytes(h) if not isinstance(h, int) else h.to_bytes(16, "little", signed=True)
    return b if 0 < len(b) <= 64 else hashlib.blake2b(b, digest_size=32).digest()


def rank_roots(roots: list[str], digest: str, model: str, rank: int) -> list[Path]:
    """Where rank ``rank`` keeps its files: ``<root>/<model>_<digest>_c_r<rank>`` under each root."""
    name = "".join(c if c.isalnum() or c in "-." else "-" for c in Path(model.rstrip("/")).name)[:64] or "model"
    return [Path(r) / f"{name}_{digest}_c_r{rank}" for r in roots]


def other_layouts(roots: list[Path]) -> list[Path]:
    """Directories beside ``roots`` (what :func:`rank_roots` gives) of the same model and rank
    under another digest: files of another vLLM release, attention backend or KV layout, or of
    a connector before files held memory order (2026-12-07), which no engine with this
    configuration reads. The worker names them at start, with the command that frees them."""
    out = []
    for r in roots:
        model, _, rank = r.name.rpartition("_c_r")
        name = model.rsplit("_", 1)[0]
        try:
            siblings = list(r.parent.glob(f"{name}_*_c_r{rank}"))
        except OSError:
            continue
        out += sorted(p for p in siblings
                      if p != r and p.name.rpartition("_c_r")[0].rsplit("_", 1)[0] == name and p.is_dir())
    return out


def layout_digest(vllm_config) -> str:
    """What must match for two engines to read each other's files: the model, dtype, block size,
    parallel sizes and what decides the KV cache's layout in memory, whose bytes a file holds
    in memory order (:func:`block_views`): vLLM's version (its attention backends' shapes
    change between releases: 0.26's FlashAttention packs K and V per head), the attention
    backend asked for, and ``VLLM_KV_CACHE_LAYOUT``. The scheduler computes it without the
    tensors, so both sides compute it from the configuration alone."""
    import vllm

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    attn = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    ident = {"model": str(mc.model), "dtype": str(mc.dtype), "cache_dtype": str(cc.cache_dtype),
             "block_size": int(cc.block_size), "tp": int(pc.tensor_parallel_size),
             "pp": int(pc.pipeline_parallel_size), "layers": int(mc.get_num_layers(pc)),
             "kv_heads": int(mc.get_num_kv_heads(pc)), "head_size": int(mc.get_head_size()),
             "file_order": "memory", "vllm": str(getattr(vllm, "__version__", "")),
             "attention_backend": str(attn) if attn is not None else os.environ.get("VLLM_ATTENTION_BACKEND", ""),
             "kv_cache_layout": os.environ.get("VLLM_KV_CACHE_LAYOUT", "")}
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
    part's outermost axis in memory until each block's part fills one dense range of memory
    (FlashAttention's ``[2, num_blocks, ...]`` gives K and V apart; ``[num_blocks, 2, ...]`` one
    view; vLLM 0.26's ``[num_blocks, heads, block_size, 2 * head_size]`` over memory ordered
    ``[num_blocks, block_size, heads, 2 * head_size]`` one view). A view's bytes are the part's
    in memory order, whatever the order of its logical axes: one segment per block and view for
    the copy kernels, never one per token and head.

    Raises:
        ConfigError: no axis of ``num_blocks``, or a block's part that is never dense.
    """
    dims = [i for i, s in enumerate(t.shape) if s == num_blocks]
    if not dims:
        raise ConfigError(f"TierCacheConnector: a KV cache tensor of shape {tuple(t.shape)} has no axis of "
                          f"{num_blocks} blocks")
    bdim = max(dims, key=lambda i: t.stride(i))
    parts = [t.movedim(bdim, 0)]
    while not all(_dense(p[0]) and p.stride(0) >= p[0].numel() for p in parts):
        if parts[0].dim() < 3:
            raise ConfigError(f"TierCacheConnector: the blocks of a KV cache tensor of shape {tuple(t.shape)} and "
                              f"strides {t.stride()} are not contiguous in memory")
        # the part's outermost axis in memory (the largest stride) goes first, then split along it
        parts = [q for p in parts
                 for q in p.movedim(1 + max(range(p.dim() - 1), key=lambda i: p.stride(1 + i)), 1).unbind(1)]
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    es = t.element_size()
    return [torch.as_strided(raw, (num_blocks, p[0].numel() * es), (p.stride(0) * es, 1), p.storage_offset() * es)
            for p in parts]


def kv_layout(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> dict:
    """What a block file's bytes mean in this engine: each KV cache tensor's dtype, logical
    shape (the block axis as ``"blocks"``) and memory order (its axes of more than one element,
    outermost first), as :func:`~tiercache.files.rootdir.claim_layout` records and checks it
    per directory: ``{"signature": 16 hex digits, "describe": text}``. Two engines whose
    auto-selected attention backends lay the cache out differently (the configuration the
    directory's digest covers cannot tell) get different signatures."""
    kinds: dict[str, int] = {}
    seen = set()
    for t in kv_caches.values():
        ident = (t.data_ptr(), tuple(t.shape), t.stride())
        if ident in seen:
            continue
        seen.add(ident)
        blocks = max((i for i, n in enumerate(t.shape) if n == num_blocks), key=lambda i: t.stride(i), default=-1)
        shape = ["blocks" if i == blocks else int(n) for i, n in enumerate(t.shape)]
        order = sorted((i for i in range(t.dim()) if t.shape[i] > 1), key=lambda i: (-t.stride(i), i))
        text = f"{str(t.dtype).removeprefix('torch.')} {shape} in memory order {order}".replace("'", "")
        kinds[text] = kinds.get(text, 0) + 1
    describe = "; ".join(f"{n} x {k}" for k, n in kinds.items())
    return {"signature": hashlib.sha256(describe.encode()).hexdigest()[:16], "describe": describe}


def _dense(part: torch.Tensor) -> bool:
    """Whether the elements of ``part`` fill one range of memory with no gap, in some order of
    its axes (its lowest address is its first element's: torch's strides are not negative)."""
    expect = 1
    for stride, size in sorted((st, sz) for st, sz in zip(part.stride(), part.shape) if sz != 1):
        if stride != expect:
            return False
        expect *= size
    return True


@dataclass
class BlockTransfer:
    """One request's blocks to load or store in a step: ``keys[i]`` (tiercache keys, bytes)
    is the file of vLLM block ``block_ids[i]`` (ids in vLLM's paged KV cache)."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class TierCacheConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers: blocks to load and to store, per request."""

    loads: list[BlockTransfer] = field(default_factory=list)
    stores: list[BlockTransfer] = field(default_factory=list)
    #: requests preempted since the last step: their blocks are free and may be overwritten by
    #: the next forward pass, so their stores still waiting for staging are gathered first
    preempted: list[str] = field(default_factory=list)
    #: requests finished since the last step whose stores vLLM did not wait for: their blocks
    #: are free too, so their gathers are issued (or, with no staging slab free, skipped) first
    released: list[str] = field(default_factory=list)
    #: the loads are synchronous (``load_mode``): vLLM computes their requests in this step and
    #: expects no report of them received
    sync_loads: bool = False
    #: block keys stored in an earlier step over a synchronous load that failed there (vLLM
    #: discarded that step's output and recomputes): every worker deletes their files
    discard: list[bytes] = field(default_factory=list)


@dataclass
class TierCacheWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's report of the workers to the scheduler: the keys (16-byte block keys) whose
    stores did not reach a file (skipped where the writes fell behind or a finished request's
    gathers found no slab, or failed), so the scheduler's index does not offer them. Ranks'
    reports are merged by union: a block is on disk only where every rank stored its part."""

    unstored: frozenset = frozenset()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, TierCacheWorkerMetadata):
            return self
        return TierCacheWorkerMetadata(unstored=self.unstored | other.unstored)


@dataclass
class _Req:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    load: tuple[int, list[bytes]] | None = None
    loading: list[bytes] = field(default_factory=list)
    load_ids: list[int] = field(default_factory=list)
    load_start: int = 0  # the first loaded block's index in the request
    stored_upto: int = 0
    storing: list[bytes] = field(default_factory=list)
    #: the load policy's answer for this request (None: not asked yet): asked once per
    #: request, however many times vLLM looks it up while it waits to be scheduled
    load_ok: bool | None = None


class ConnectorScheduler:
    """The scheduler side of :class:`TierCacheConnector`: the index of the blocks on disk (keys
    present in every rank's root, in least-recently-used order), and the loads and stores of
    each step.

    Args:
        vllm_config: vLLM's config (``cache_config.block_size``: tokens per block).
        settings: :func:`parse_config`'s result (``capacity_blocks`` bounds the index).
        roots_by_rank: per tensor-parallel rank, its roots (listed once, names only).
    """

    #: on a shared root, a lookup that misses lists the roots again at most this often (seconds):
    #: blocks other engines stored since become hits
    RESCAN_S = 1.0

    def __init__(self, vllm_config, settings: dict, roots_by_rank: list[list[Path]]) -> None:
        self.block_size = int(vllm_config.cache_config.block_size)
        self.settings = settings
        self.roots_by_rank = roots_by_rank
        self.present: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._scanned = 0.0
        self._rescan()
        self.reqs: dict[str, _Req] = {}
        self._to_load: list[str] = []
        self._storing: set[bytes] = set()  # keys some request is storing
        self._released: list[str] = []  # finished with stores, freed at once: the next step's to tell
        self._unstored: set[bytes] = set()  # reported not stored before their request's stores ended
        self._step_stores: dict[str, list[bytes]] = {}  # the last step's stores, per request
        self._discard: list[bytes] = []  # stored over a failed sync load: the next step's to delete
        # vLLM's async scheduling schedules the next step before a step's output comes back
        async_scheduling = bool(getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False))
        depth = 2 if async_scheduling else 1
        mode = settings["load_mode"]
        try:
            v2_runner = bool(getattr(vllm_config, "use_v2_model_runner", False))
        except Exception:  # noqa: BLE001 - a config this vLLM cannot decide on: assume the riskier runner
            v2_runner = True
        why_not_sync = None
        if async_scheduling:
            why_not_sync = ("needs vLLM's async scheduling off (--no-async-scheduling): with it on, a load that "
                            "fails has its request's next step scheduled from a wrong token")
        elif v2_runner:
            why_not_sync = ("needs vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0): on the V2 runner a "
                            "synchronous load that fails is recomputed from the wrong offset and gives wrong tokens "
                            "(vllm-project/vllm#49250; measured with this connector on an H200, vLLM 0.26.0)")
        if mode == "sync" and why_not_sync:
            raise ConfigError(f"TierCacheConnector: 'load_mode' = 'sync' {why_not_sync}; 'auto' or 'async' load "
                              "asynchronously")
        self.sync_loads = mode == "sync" or (mode == "auto" and why_not_sync is None)
        if settings["layer_groups"] and not self.sync_loads:
            raise ConfigError("TierCacheConnector: 'layer_groups' needs synchronous loads ('load_mode' 'auto' or "
                              f"'sync'), which {why_not_sync or 'load_mode async turns off'}: a layer-wise load is "
                              "verified after the forward pass, and only then may vLLM drop that step's output")
        self._sync_loaded: list[str] = []  # loaded in the last step (sync loads): measured at its output
        self.cost = LoadCost(self.block_size, settings["load_policy"], pipeline_depth=depth)
        log.info("tiercache: vLLM connector: %d block(s) on disk under %s", len(self.present),
                 ", ".join(str(r[0]) for r in roots_by_rank))

    def _rescan(self) -> int:
        """Add the keys present in every rank's roots to the index (names only); returns how
        many were new."""
        keys = None
        for roots in self.roots_by_rank:
            found = list_keys(roots)
            keys = found if keys is None else keys & found
        new = [k for k in keys or () if k not in self.present]
        for k in new:
            self.present[k] = None
            self.present.move_to_end(k, last=False)  # older than what this engine used
        self._scanned = time.monotonic()
        return len(new)

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
        keys = self._match(hashes, start, limit)
        if (len(keys) < limit - start and self.settings["sharing"] == "shared"
                and time.monotonic() - self._scanned >= self.RESCAN_S and self._rescan()):
            keys = self._match(hashes, start, limit)  # other engines' stores since the last listing
        if keys and st.load_ok is None:
            st.load_ok = self.cost.should_load(len(keys))
            if not st.load_ok and self.cost.skipped == 1:
                log.info("tiercache: vLLM connector: reading a prefix is slower than recomputing it here (%s); "
                         "prefixes are recomputed (load_policy = 'faster'; one in %d still loads)",
                         self.cost.stats(), PROBE_EVERY)
        if st.load_ok is False:
            keys = []
        st.load = (start, keys) if keys else None
        # either way the worker reads and uploads in the step's start_load_kv: asynchronous in
        # vLLM's terms (reported received in that step; the request waits for it), or, where
        # vLLM schedules synchronously (load_mode), synchronous: computed in the same step
        return (len(keys) * self.block_size, not self.sync_loads) if keys else (0, False)

    def _match(self, hashes, start: int, limit: int) -> list[bytes]:
        """The keys of blocks ``start..limit-1`` up to the first one not on disk."""
        keys = []
        for i in range(start, limit):
            k = block_key(hashes[i])
            if k not in self.present:
                break
            keys.append(k)
        return keys

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
        st.loading, st.load_ids, st.load_start = keys, ids[start:start + len(keys)], start
        st.load = (start, keys)
        for k in keys:
            self.present.move_to_end(k, last=True)
        self._to_load.append(request.request_id)

    def build_connector_meta(self, so) -> TierCacheConnectorMetadata:
        meta = TierCacheConnectorMetadata()
        meta.preempted = [r for r in (getattr(so, "preempted_req_ids", None) or ()) if r in self.reqs]
        meta.released, self._released = self._released, []
        for rid in meta.released:  # the workers issue their gathers before this step's loads
            st = self.reqs.pop(rid, None)
            if st is not None:
                self._stored(st)
        if meta.released:
            self._evict()
        for rid in self._to_load:
            st = self.reqs.get(rid)
            if st is not None and st.load is not None:
                meta.loads.append(BlockTransfer(rid, st.loading, st.load_ids))
                st.load = None
        self._to_load.clear()
        meta.sync_loads = self.sync_loads
        meta.discard, self._discard = self._discard, []
        self._step_stores = {}
        if self.sync_loads:
            self._sync_loaded += [t.req_id for t in meta.loads]
        self.cost.step(int(getattr(so, "total_num_scheduled_tokens", 0) or 0),
                       {t.req_id: len(t.keys) for t in meta.loads})
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
            if k not in self.present and k not in self._storing:
                self._unstored.discard(k)  # a report of an earlier store of it is not about this one
                keys.append(k)
                ids.append(st.block_ids[b])
        st.stored_upto = full
        if keys:
            st.storing.extend(keys)
            self._storing.update(keys)
            self._step_stores[rid] = keys
            meta.stores.append(BlockTransfer(rid, keys, ids))

    def update_connector_output(self, out) -> None:
        self.cost.output()
        wm = getattr(out, "kv_connector_worker_meta", None)
        if isinstance(wm, TierCacheWorkerMetadata) and wm.unstored:
            for k in wm.unstored:  # a later lookup would read a file that is not there
                if self.present.pop(k, None) is None and k in self._storing:
                    self._unstored.add(k)  # its request's stores have not ended: not to be listed then
        for rid in getattr(out, "finished_sending", None) or ():
            st = self.reqs.pop(rid, None)
            if st is not None:  # its blocks' bytes are in pinned staging, on their way to files
                self._stored(st)
                self._evict()
        bad = set(getattr(out, "invalid_block_ids", None) or ())
        stats = getattr(out, "kv_connector_stats", None)
        if self._sync_loaded and isinstance(stats, vllmconnstats.TierCacheConnectorStats):
            # a sync load costs its own duration: the workers' measure (the scheduler's would
            # count the request's prefill in the same step)
            d = stats.data
            self.cost.measured(d.get("load_seconds", 0.0), d.get("loaded_blocks", 0) + d.get("load_error_blocks", 0))
        done, self._sync_loaded = list(getattr(out, "finished_recving", None) or ()) + self._sync_loaded, []
        for rid in done:  # async loads reported received, and sync loads of the step this output ends
            if self.sync_loads:
                self.cost.forget(rid)  # measured above, by the workers
            else:
                self.cost.loaded(rid)
            st = self.reqs.get(rid)
            if st is not None:
                failed = next((j for j, b in enumerate(st.load_ids) if b in bad), None)
                for k, b in zip(st.loading, st.load_ids):
                    if b in bad:  # a load that failed: its key leaves the index
                        self.present.pop(k, None)
                if failed is not None and self.sync_loads:
                    self._failed_sync_load(rid, st, st.load_start + failed)
                st.loading, st.load_ids = [], []

    def _failed_sync_load(self, rid: str, st: _Req, first_bad: int) -> None:
        """Request ``rid``'s synchronous load failed from block ``first_bad`` on, in the step
        whose forward pass also computed the rest of its prompt over those blocks: vLLM
        discards that output and recomputes from ``first_bad``. The blocks stored in that step
        hold bytes computed over the bad ones: they are forgotten here and every worker deletes
        them (``meta.discard``; the rank whose load failed never wrote them), and the request
        stores again from ``first_bad`` as it recomputes."""
        keys = self._step_stores.pop(rid, [])
        if keys:
            gone = set(keys)
            st.storing = [k for k in st.storing if k not in gone]
            self._storing.difference_update(gone)
            self._unstored.difference_update(gone)
            for k in keys:
                self.present.pop(k, None)
            self._discard.extend(keys)
        st.stored_upto = min(st.stored_upto, first_bad)

    def _stored(self, st: _Req) -> None:
        """A request's stores have ended (gathered, or skipped): its keys are listed as on disk,
        less those a worker reported not stored."""
        for k in st.storing:
            if k in self._unstored:
                self._unstored.discard(k)
            else:
                self.present[k] = None
        self._storing.difference_update(st.storing)

    def _evict(self) -> None:
        cap = self.settings["capacity_blocks"]
        while cap is not None and len(self.present) > cap:
            self.present.popitem(last=False)

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        self.cost.forget(request.request_id)
        st = self.reqs.get(request.request_id)
        if st is None:
            return False, None
        if st.storing:
            # freed at once: the next step's metadata names it, and each worker issues its
            # gathers still queued before that step's loads and forward pass (which wait for
            # them on the GPU), or skips them where no staging slab is free; vLLM does not wait
            # (holding the blocks until finished_sending would cost the next request two steps
            # where the GPU's blocks are short)
            self._released.append(request.request_id)
            return False, None
        self.reqs.pop(request.request_id, None)
        return False, None


class ConnectorWorker:
    """The worker side of :class:`TierCacheConnector` for one rank: pinned staging rows
    (``[rows, row_bytes]`` uint8; a row is one block's pages of every layer region, as in its
    file), the :class:`~tiercache.rowstore.RowStore` of this rank's roots, and the thread that
    writes stores.

    - **Loads** run on the engine's own thread, inside ``start_load_kv`` of the step the
      lookup scheduled, and (asynchronous loads) that step's ``get_finished`` reports them
      received. The prefix is read in
      pieces of ``piece`` blocks into a ring of load slabs (the native I/O engine's threads
      read and verify; the engine thread waits with the GIL released), and each piece, once
      read, goes up in one contiguous copy into a device slab and from there into its blocks'
      pages by one launch of the gather/scatter kernel (:meth:`CopyLauncher.copy_segments`),
      while the next pieces are read.
    - **Stores** are gathered after the step's forward pass (an event): the pages of up to
      ``piece`` blocks into a free device slab (a ring in ``device_staging_bytes``) by one kernel
      launch, then one copy of that slab into a free store slab of pinned rows on a copy stream
      of its own. By default (``store_gathers = "thread"``) a gatherer thread waits for the
      forward pass on the host and issues them on a stream of its own, so the engine's thread
      never waits for the GPU (a full prompt's blocks are immutable while held, and a preempted
      request's are gathered before the next forward pass, which waits for them on the GPU).
      The writer thread writes each slab's files once its copy is done (two slabs in flight). A
      finished request's blocks are not held: vLLM frees them at once, and the next step's
      :meth:`before_forward` issues its gathers still queued (or skips them where no slab is
      free) before anything may overwrite them.

    Args:
        settings: :func:`parse_config`'s result.
        roots: this rank's roots (one, or a root array's members).

    A load or store never raises into vLLM: a failed load is reported as load errors of its
    blocks from the first bad one on (vLLM recomputes them), a failed store is logged and its
    blocks are not kept.
    """

    #: seconds a load waits for a store of the same block still being written
    WRITE_WAIT_S = 30.0
    #: seconds a load on a shared root waits for the store to find other engines' files
    PROBE_WAIT_S = 2.0
    #: device slabs of ``piece`` blocks that kvikio reads loads into (GDS, compat): one being
    #: scattered into its blocks while the next ones are read
    DEVICE_LOAD_SLABS = 3

    def __init__(self, settings: dict, roots: list[Path]) -> None:
        self.settings = settings
        self.roots = roots
        self.views: list[torch.Tensor] = []
        self.store: RowStore = None  # type: ignore[assignment]  # made by register()
        self.launcher: Any = None
        self.copy_path = ""  # how pages move between the device slabs and the blocks (register)
        self.counters: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self.jobs = RowJobs()
        self._errors: set[int] = set()
        self._recving: set[str] = set()
        self._slab_events: list = []
        self._next_slab = 0
        self._cupy_streams: dict = {}
        self._streams: tuple = ()
        # stores: [req_id, keys, block ids, step event] waiting for a store slab
        self._gathers: collections.deque = collections.deque()
        self._unstamped: list[list] = []  # planned this step, before its forward pass ends
        self._queued: collections.Counter = collections.Counter()  # blocks per request not yet gathered
        self._gathering: dict[str, list] = collections.defaultdict(list)  # gather events per request
        self._had_stores: set[str] = set()
        self._finished_reqs: set[str] = set()
        self._free_slabs: list[int] = []
        self._slab_freed = threading.Condition(self._lock)
        self._gathered_ev = None  # the last gather's device-side copy (before its copy to the host)
        self._dev_events: list = []  # per device store slab: its copy to the host (None: free)
        self._next_dev = 0
        # the stores' state (_gathers, _queued, _gathering, the device slabs), shared by the
        # engine's thread and the gatherer thread
        self._glock = threading.RLock()
        self._kick = threading.Event()
        self._stopping = False
        self._gatherer: threading.Thread | None = None
        self._gather_stream = None
        self.gather_launcher = None
        self._writing: dict[bytes, threading.Event] = {}  # gathered, file not yet written
        self._unstored: set[bytes] = set()  # stores skipped or failed since the last report (_lock)
        self._failed_sync: set[str] = set()  # requests whose synchronous load failed in this step
        self._layerwise: LayerwiseLoad | None = None  # this step's layer-wise load (layer_groups)
        self.layer_groups: LayerGroups | None = None
        self._writes: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self._plans: _ScatterPlans | None = None  # a load's planned scatters (scatter_tables = "load")

    # -- setup -------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        seen: dict[tuple, int] = {}
        views: list[torch.Tensor] = []
        layer_regions: list[tuple[str, list[int]]] = []
        for name, t in kv_caches.items():
            mine = []
            for v in block_views(t, num_blocks):
                ident = (v.data_ptr(), v.stride(0), v.shape[1])
                if ident not in seen:
                    seen[ident] = len(views)
                    views.append(v)
                mine.append(seen[ident])
            layer_regions.append((name, mine))
        self.views = views
        self.offsets = np.cumsum([0] + [v.shape[1] for v in views]).tolist()
        self.row_bytes = int(self.offsets[-1])
        self.device = views[0].device
        self.cuda = views[0].is_cuda
        #: how loads reach the blocks: kvikio (GDS, compat) into device slabs, or (posix) the
        #: native engine into pinned staging, then one copy up per piece
        self.load_path = select_io_path(self.settings["io_mode"]) if self.cuda else IOPath("posix", "CPU tensors")
        self.device_reads = self.load_path.kvikio
        total = max(4, self.settings["staging_bytes"] // self.row_bytes)
        self.piece = max(1, min(self.settings["piece_blocks"], total // 4))
        slabs = total // self.piece
        # a few load slabs keep the reads ahead of the uploads; the rest takes stores, so that
        # a whole prompt's blocks are gathered at once, without waiting for the writes of
        # earlier slabs (a finished request's stores still queued are skipped)
        self.load_slabs = min(max(3, slabs // 4), 8)
        # reads into device slabs take no pinned load slab (DEVICE_LOAD_SLABS in VRAM instead)
        pinned_load = 0 if self.device_reads else self.load_slabs
        if self.device_reads:
            self.load_slabs = self.DEVICE_LOAD_SLABS
        store_slabs = max(2, slabs - pinned_load)
        rows = (pinned_load + store_slabs) * self.piece
        if self.cuda:
            self.staging = torch.empty((rows, self.row_bytes), dtype=torch.uint8, pin_memory=True)  # page-aligned
        else:  # page-aligned too: O_DIRECT from and to the rows in place, and the row reads apply
            self.staging = torch.from_numpy(aligned_empty(rows * self.row_bytes).reshape(rows, self.row_bytes))
        self._slab_events = [None] * self.load_slabs
        self._free_slabs = list(range(pinned_load, pinned_load + store_slabs))
        self.max_queued = 4 * store_slabs * self.piece
        # per region: device address of block 0, bytes between blocks, bytes; grouped by size
        self.view_ptrs = np.array([v.data_ptr() for v in views], dtype=np.int64)
        self.view_strides = np.array([v.stride(0) for v in views], dtype=np.int64)
        self.view_sizes = np.array([v.shape[1] for v in views], dtype=np.int64)
        self.row_offsets = np.array(self.offsets[:-1], dtype=np.int64)
        self.size_groups = [(int(s), np.flatnonzero(self.view_sizes == s)) for s in np.unique(self.view_sizes)]
        self.layer_groups = None
        if self.settings["layer_groups"]:
            why = None
            if self.device_reads:
                why = f"loads go by {self.load_path.name} into device slabs, not through pinned staging"
            elif self.cuda and self.settings["copy_kernel"] == "torch":
                why = "they need the project's copy kernels (copy_kernel = torch)"
            try:
                groups = LayerGroups(layer_regions, self.row_offsets, self.view_sizes, self.settings["layer_groups"])
            except ValueError as exc:
                why = str(exc)
            if why:
                log.warning("tiercache: vLLM connector: layer-wise loads are off (%s): loads are whole", why)
            else:
                self.layer_groups = groups
        if self.cuda:
            if self.settings["copy_streams"] == "side":
                self._streams = (torch.cuda.Stream(device=self.device), torch.cuda.Stream(device=self.device))
            # loads: one device slab that each piece goes up into (pinned staging), or a ring of
            # them that kvikio reads the pieces into (GDS, compat)
            self.dev_loads = torch.empty((self.load_slabs if self.device_reads else 1, self.piece, self.row_bytes),
                                         dtype=torch.uint8, device=self.device)
            self.dev_load = self.dev_loads[0]
            # stores gather into a ring of device slabs whose copies to the host run on a stream
            # of their own: the engine's stream holds the gather kernels only
            n_dev = max(2, min(store_slabs, self.settings["device_staging_bytes"] // (self.piece * self.row_bytes)))
            self.dev_store = torch.empty((n_dev, self.piece, self.row_bytes), dtype=torch.uint8, device=self.device)
            self._dev_events = [None] * n_dev
            self._d2h_stream = self._streams[1] if self._streams else torch.cuda.Stream(device=self.device)
            self.launcher, self.copy_path = _launcher(self.device) if self.settings["copy_kernel"] != "torch" else (
                None, "torch (copy_kernel = torch)")
            self._force = "kernel" if self.settings["copy_kernel"] == "kernel" else None
            self.gather_launcher = self.launcher
            if self.settings["store_gathers"] == "thread":
                # the gatherer's own stream and launcher (a launcher's upload ring is one thread's)
                self._gather_stream = self._streams[1] if self._streams else torch.cuda.Stream(device=self.device)
                if self.launcher is not None:
                    self.gather_launcher = _launcher(self.device)[0]
        else:
            self.copy_path = "torch (CPU)"
        self.hasher, self.verify_where = self._device_hasher()
        self.store_hasher, self.store_sums_where = self._store_hasher()
        if self.store_hasher is not None:  # per device store slab, and per pinned slab once copied down
            self.dev_store_sums = torch.empty((len(self._dev_events), self.piece), dtype=torch.int64,
                                              device=self.device)
            self.slab_sums = torch.empty((pinned_load + store_slabs, self.piece), dtype=torch.int64, pin_memory=True)
        s = self.settings
        self.store = RowStore(
            self.staging.numpy(),
            [str(r) for r in self.roots] if len(self.roots) > 1 else str(self.roots[0]),
            capacity_blocks=s["capacity_blocks"],
            on_finish=self.jobs.finished_hook,
            device=(self.device.index or 0) if self.device_reads else None,
            **{name: s[k] for k, name in SETTING_KEYS.items() if k != "io_mode"},
            io_mode=self.load_path.name,
        )
        reads = self.store.ft.row_reads
        if self.layer_groups is not None and (reads is None or not reads.applies(POOL, self.store.rows)):
            log.warning("tiercache: vLLM connector: layer-wise loads are off (the native engine's row reads do not "
                        "apply to %d-byte rows here): loads are whole", self.row_bytes)
            self.layer_groups = None
        try:  # engines whose blocks mean other bytes never share a directory
            self.layout = kv_layout(kv_caches, num_blocks)
            for r in self.roots:
                claim_layout(r, self.layout)
        except Exception:
            self.store.close()
            raise
        self.jobs.attach(self.store)
        self._writer = threading.Thread(target=self._write_loop, name="tiercache-vllm-connector-writer", daemon=True)
        self._writer.start()
        if self.settings["store_gathers"] == "thread":
            self._gatherer = threading.Thread(target=self._gather_loop, name="tiercache-vllm-connector-gatherer",
                                              daemon=True)
            self._gatherer.start()
        self.store_slabs = store_slabs
        d = self.describe()
        log.info("tiercache: vLLM connector worker: %d region(s) per block, %d bytes per block file, pieces of %d "
                 "blocks, %d load slab(s) (%s) and %d store slab(s) of pinned staging, loads by %s, checksums "
                 "compared %s, stores' checksums made %s, copies by %s, I/O engine %s, root %s (%d blocks held)",
                 d["regions_per_block"], d["row_bytes"], d["piece_blocks"], d["load_slabs"], d["load_slabs_in"],
                 d["store_slabs"], d["load_path"], d["checksums_compared"], d["store_checksums_made"], d["copies"],
                 d["io_engine"], self.roots[0], len(self.store))
        if self.cuda and self.launcher is None and self.settings["copy_kernel"] != "torch":
            log.warning("tiercache: vLLM connector: the project's copy kernels are unavailable (%s): loads and stores "
                        "go through torch's copies, a kernel launch per layer region and piece", self.copy_path)

    def describe(self) -> dict:
        """What this worker runs on (what its start-up log line says): ``regions_per_block``,
        ``row_bytes`` (bytes per block file's data), ``piece_blocks``, ``load_slabs`` and
        ``load_slabs_in`` (``pinned`` or ``device``), ``store_slabs``, ``load_path`` (kvikio /
        POSIX and why), ``checksums_compared`` and ``store_checksums_made`` (host or GPU, and
        why), ``copies`` (the project's copy kernels or torch's, and why), ``scatter_tables``,
        ``io_engine``."""
        return {"regions_per_block": len(self.views), "row_bytes": self.row_bytes, "piece_blocks": self.piece,
                "load_slabs": self.load_slabs, "load_slabs_in": "device" if self.device_reads else "pinned",
                "store_slabs": self.store_slabs, "load_path": f"{self.load_path.label} ({self.load_path.reason})",
                "checksums_compared": self.verify_where, "store_checksums_made": self.store_sums_where,
                "copies": self.copy_path, "scatter_tables": self.settings["scatter_tables"],
                "io_engine": self.store.ft.engine}

    def _device_hasher(self):
        """(the :class:`~tiercache.files.devicehash.DeviceHasher` that checks the pinned path's
        pieces once up in the device slab, or None; where checksums are compared, in words).

        Raises:
            ConfigError: ``verify_on = "device"`` where the GPU cannot check these loads.
        """
        s = self.settings
        if not s["verify"]:
            return None, "nowhere (verify = false)"
        if self.device_reads:
            return None, "on the GPU by the file tier's device reads"
        return self._gpu_hasher(self.dev_load if self.cuda else None, "each piece in the device slab")

    def _store_hasher(self):
        """(the :class:`~tiercache.files.devicehash.DeviceHasher` that makes the stores'
        checksums in the device store slabs, or None; where they are made, in words). A store's
        checksum goes into its file's header whatever ``verify`` says.

        Raises:
            ConfigError: ``verify_on = "device"`` where the GPU cannot hash these blocks.
        """
        return self._gpu_hasher(self.dev_store if self.cuda else None, "each gathered slab")

    def _gpu_hasher(self, slab: torch.Tensor | None, what: str):
        """(the process's :class:`~tiercache.files.devicehash.DeviceHasher` for rows of device
        ``slab``, or None where ``verify_on``, the tensors or the kernel keep it on the host;
        where the checksums are made, in words: ``what`` on the GPU, or the host and why).

        Raises:
            ConfigError: ``verify_on = "device"`` where the GPU cannot take them.
        """
        s = self.settings
        why = "verify_on = host" if s["verify_on"] == "host" else "CPU tensors" if slab is None else ""
        if slab is not None and not why:
            if device_hash_applies(self.row_bytes, slab.data_ptr(), self.row_bytes):
                try:
                    return device_hasher(self.device.index or 0), f"on the GPU ({what})"
                except Exception as exc:  # the kernel does not build here: the host does it
                    why = f"the GPU's XXH3 kernel is not available ({exc})"
            else:
                why = f"blocks of {self.row_bytes} bytes are not for the GPU's XXH3 kernel"
        if s["verify_on"] == "device":
            raise ConfigError(f"TierCacheConnector: verify_on = 'device' cannot run here: {why}")
        return None, f"on the host ({why})"

    @property
    def stream(self):
        """The loads' stream: a side stream, or (``copy_streams = "compute"``) the engine's."""
        return self._streams[0] if self._streams else torch.cuda.current_stream(self.device)

    @property
    def store_stream(self):
        """The gathers' stream: the gatherer thread's, a side stream, or (``copy_streams =
        "compute"``, ``store_gathers = "engine"``) the engine's."""
        if self._gather_stream is not None:
            return self._gather_stream
        return self._streams[1] if self._streams else torch.cuda.current_stream(self.device)

    # -- RowStore jobs -----------------------------------------------------------------------
    def _submit(self, fn, keys: list[bytes], row0: int, **kwargs) -> int:
        return self.jobs.submit(fn, keys, list(range(row0, row0 + len(keys))), **kwargs)

    def _wait(self, jid: int):
        """Wait (GIL released) for RowStore job ``jid``; its :class:`RowJobResult`."""
        return self.jobs.wait(jid)

    # -- loads (the engine thread) -----------------------------------------------------------
    def load(self, transfers: list[BlockTransfer], report: bool = True) -> None:
        """Load every transfer's blocks, in place when this returns; :meth:`get_finished`
        reports the requests received in the same step (``report``: asynchronous loads; a
        synchronous one's request is computed in this step, and vLLM expects no report)."""
        if not transfers:
            return
        if self.layer_groups is not None and not report and (not self.cuda or self.launcher is not None):
            for t in transfers:
                self._ready(t.keys)
            self._layerwise = LayerwiseLoad(self, transfers)  # lands in wait_for_layer_load, ends in finish_layers
            return
        t0 = time.perf_counter()
        was = sys.getswitchinterval()
        if self.settings["load_switch_s"]:  # the engine's thread gets the GIL back sooner after each release
            sys.setswitchinterval(self.settings["load_switch_s"])
        try:
            landed = [self._load(t) for t in transfers]
            if self.cuda:
                self.stream.synchronize()  # in place before vLLM hears of it (get_finished)
        finally:
            sys.setswitchinterval(was)
        for t, (failed_from, check) in zip(transfers, landed):
            if check is not None:
                failed_from = self._check_sums(t, failed_from, *check)
            self._settle_load(t, failed_from)
            if failed_from is not None and not report:
                # this step's forward pass computes the request over the blocks that failed:
                # what it stores would be wrong (after_forward drops it)
                self._failed_sync.add(t.req_id)
        if report:
            self._recving.update(t.req_id for t in transfers)
        self.counters["load_calls"] += 1
        self.counters["load_us"] += int((time.perf_counter() - t0) * 1e6)

    def wait_layer(self, layer_name: str) -> None:
        """``wait_for_layer_load``: a layer-wise load's groups up to this layer's are in its
        blocks (their copies enqueued on the engine's stream before this layer's kernels)."""
        lw = self._layerwise
        if lw is not None:
            assert self.layer_groups is not None
            lw.land(self.layer_groups.group_of.get(layer_name, len(self.layer_groups) - 1))

    def finish_layers(self) -> None:
        """At the step's end (``wait_for_save``): a layer-wise load's last groups, its checksums
        compared, its blocks settled (load errors from the first bad block of each request)."""
        lw, self._layerwise = self._layerwise, None
        if lw is None:
            return
        late = not lw.waited
        firsts = lw.finish()
        for t, first in zip(lw.transfers, firsts):
            self._settle_load(t, first)
            if first is not None:
                self._failed_sync.add(t.req_id)
        if late:
            self.counters["layerwise_unwaited_loads"] += 1
            self.layer_groups = None
            log.warning("tiercache: vLLM connector: vLLM did not call wait_for_layer_load during a layer-wise load "
                        "(its blocks are recomputed); loads are whole from now on")
        self.counters["layerwise_loads"] += 1
        self.counters["load_calls"] += 1
        self.counters["load_us"] += int(lw.exposed * 1e6)

    def _ready(self, keys: list[bytes]) -> None:
        """Before a load reads ``keys``: their writes from this process finished, and on a shared
        root the blocks other engines stored found."""
        self._await_writes(keys)
        if self.store.shared:
            self._discover(keys)

    def _await_writes(self, keys: list[bytes]) -> None:
        """A block stored moments ago may still be on its way to its file: wait for it."""
        deadline = time.monotonic() + self.WRITE_WAIT_S
        for k in keys:
            ev = self._writing.get(k)
            if ev is not None and not ev.wait(max(0.0, deadline - time.monotonic())):
                return

    def _discover(self, keys: list[bytes]) -> None:
        """On a shared root, blocks another engine stored since this one started are not in the
        store's index yet: wait for its probes of them (a stat each, on its background thread;
        at most ``PROBE_WAIT_S``). What is still not found fails its load (vLLM recomputes)."""
        from tiercache.rowstore import KeyState

        deadline = time.monotonic() + self.PROBE_WAIT_S
        todo = [k for k in keys if self.store.state(k) is not KeyState.PRESENT]
        while todo and time.monotonic() < deadline:
            todo = [k for k in todo if self.store.state(k) is KeyState.PENDING]
            if todo:
                time.sleep(0.0005)
        if todo:
            self.counters["probe_timeouts"] += 1

    def _load(self, t: BlockTransfer):
        """Read and send up ``t``'s blocks (the GPU's work enqueued on :attr:`stream`); returns
        (the first block that failed on the host, or None; what :meth:`_check_sums` compares
        once the stream is done, or None where the host checked every block)."""
        self._ready(t.keys)
        inflight: collections.deque = collections.deque()
        failed_from = None
        check = None
        self._plans = _ScatterPlans(self, t) if self._plan_loads() else None
        if self.hasher is not None:  # the headers' checksums, and the GPU's of what went up
            check = (np.zeros(len(t.keys), dtype=np.uint64),
                     torch.zeros(len(t.keys), dtype=torch.int64, device=self.device),
                     np.zeros(len(t.keys), dtype=bool))
        try:
            for lo in range(0, len(t.keys), self.piece):
                if failed_from is not None:
                    break  # vLLM recomputes from the first bad block: the rest is not needed
                keys, ids = t.keys[lo:lo + self.piece], t.block_ids[lo:lo + self.piece]
                slab = self._next_slab
                self._next_slab = (slab + 1) % self.load_slabs
                ev = self._slab_events[slab]
                if ev is not None:
                    t0 = time.perf_counter()
                    ev.synchronize()  # the slab's previous piece is up
                    self.counters["slab_wait_us"] += int((time.perf_counter() - t0) * 1e6)
                t0 = time.perf_counter()
                if self.device_reads:  # straight into device slab ``slab`` (kvikio: GDS or its compat mode)
                    job = self.jobs.submit(self.store.submit_load, keys, list(range(len(keys))),
                                           device_rows=self.dev_loads[slab])
                else:  # into pinned staging; with ``check``, the data's checksums are the GPU's to compare
                    sums = {} if check is None else {"sums": check[0][lo:lo + len(keys)]}
                    job = self._submit(self.store.submit_load, keys, slab * self.piece, **sums)
                inflight.append((lo, keys, ids, slab, job))
                self.counters["submit_us"] += int((time.perf_counter() - t0) * 1e6)
                if len(inflight) >= self.load_slabs - 1:
                    # one slab of slack: the slab read next is the one landed a piece ago, whose
                    # upload has had the time of this piece's landing to finish
                    failed_from = self._land(inflight.popleft(), failed_from, check)
            while inflight:
                failed_from = self._land(inflight.popleft(), failed_from, check)
        except Exception:
            log.exception("tiercache: vLLM connector: the load of request %s failed; vLLM recomputes it", t.req_id)
            failed_from = 0 if failed_from is None else failed_from
            for item in inflight:
                self._wait(item[4])
        finally:
            if self._plans is not None:
                self._plans.close()
                self._plans = None
        return failed_from, check

    def _plan_loads(self) -> bool:
        """Whether a load's scatters are planned per load (``scatter_tables = "load"``, the
        project's kernels, pieces copied up from pinned staging)."""
        return self.settings["scatter_tables"] == "load" and self.cuda and self.launcher is not None \
            and not self.device_reads

    def _check_sums(self, t: BlockTransfer, failed_from: int | None, sums: np.ndarray, dev_sums: torch.Tensor,
                    on_gpu: np.ndarray) -> int | None:
        """After the loads' stream is done: compare the GPU's checksums of ``t``'s blocks that
        went up unchecked with their headers'; a block that does not match fails the load from
        there on (its file checked again on the host, and quarantined where it is bad)."""
        n = len(t.keys) if failed_from is None else failed_from
        got = dev_sums[:n].cpu().numpy().view(np.uint64)
        bad = np.flatnonzero(on_gpu[:n] & (got != sums[:n])).tolist()
        self.counters["gpu_checked_blocks"] += int(on_gpu[:n].sum())
        if not bad:
            return failed_from
        errors = self.store.reject([t.keys[i] for i in bad], "data checksum mismatch in device memory")
        first = t.keys[bad[0]]
        log.warning("tiercache: vLLM connector: block %s could not be loaded (%s); vLLM recomputes from there",
                    first.hex(), errors[first])
        self.counters["gpu_checksum_mismatches"] += len(bad)
        return bad[0]

    def _settle_load(self, t: BlockTransfer, failed_from: int | None) -> None:
        """Report ``t``'s blocks from ``failed_from`` on as load errors (vLLM recomputes them)."""
        if failed_from is not None:
            with self._lock:
                self._errors.update(t.block_ids[failed_from:])
            self.counters["load_error_blocks"] += len(t.block_ids) - failed_from
        self.counters["loaded_blocks"] += len(t.block_ids) if failed_from is None else failed_from
        self.counters[f"loads_{self.load_path.name}"] += 1

    def _land(self, item, failed_from: int | None, check=None) -> int | None:
        """Wait for a piece's reads, then send its good leading rows up into their blocks (and,
        with ``check``, hash them in the device slab on the way)."""
        lo, keys, ids, slab, job = item
        t0 = time.perf_counter()
        res = self._wait(job)
        self.counters["read_wait_us"] += int((time.perf_counter() - t0) * 1e6)
        good = next((i for i, k in enumerate(keys) if k in res.failed), len(keys))
        if good < len(keys) and failed_from is None:
            failed_from = lo + good
            log.warning("tiercache: vLLM connector: block %s could not be loaded (%s); vLLM recomputes from there",
                        keys[good].hex(), res.failed[keys[good]])
        if failed_from is not None and failed_from <= lo:
            good = 0
        if good:
            t0 = time.perf_counter()
            self._upload(slab, ids[:good], lo // self.piece if good == len(ids) else None)
            if check is not None and res.sums_only:
                self._hash_slab(good, check[1][lo:lo + good])
                check[2][lo:lo + good] = True
            self.counters["upload_issue_us"] += int((time.perf_counter() - t0) * 1e6)
        return failed_from

    def _hash_slab(self, n: int, out: torch.Tensor) -> None:
        """Enqueue the XXH3-64 of the device slab's first ``n`` rows into ``out`` on the loads'
        stream (after the piece's copy up, before the next piece's)."""
        self.hasher.hash_rows(self.dev_load[:n], out, self._cupy(self.stream))

    def _cupy(self, stream):
        """CuPy's view of torch stream ``stream`` (made once per stream)."""
        cs = self._cupy_streams.get(stream.cuda_stream)
        if cs is None:
            cs = self._cupy_streams[stream.cuda_stream] = _cupy_stream(stream, self.device)
        return cs

    def _segments(self, base: int, ids: list[int], regions: np.ndarray | None = None, stride: int | None = None,
                  origin: int = 0):
        """Per region size: (device page addresses, staging addresses from ``base``) of every
        block ``ids[i]`` (row ``i``) and region of that size, row-major. ``regions``: only these
        (default: all), staged in rows of ``stride`` bytes (default: a block's) that start at
        byte ``origin`` of a block's row (a layer group's span)."""
        blocks = np.asarray(ids, dtype=np.int64)
        rows = base + np.arange(len(ids), dtype=np.int64) * (self.row_bytes if stride is None else stride)
        groups = self.size_groups if regions is None else [
            (int(sz), regions[self.view_sizes[regions] == sz]) for sz in np.unique(self.view_sizes[regions])]
        for size, rs in groups:
            pages = (self.view_ptrs[rs][None, :] + blocks[:, None] * self.view_strides[rs][None, :]).ravel()
            staged = (rows[:, None] + (self.row_offsets[rs] - origin)[None, :]).ravel()
            yield size, pages, staged

    def _upload(self, slab: int, ids: list[int], piece: int | None = None) -> None:
        """Staging rows of load slab ``slab`` -> the pages of blocks ``ids`` (``piece``: the
        whole of this piece of the load, whose scatter may be planned: :class:`_ScatterPlans`)."""
        n, row0 = len(ids), slab * self.piece
        src = self.staging[row0:row0 + n]
        if not self.cuda:
            idx = torch.tensor(ids, dtype=torch.long)
            for v, off in zip(self.views, self.offsets):
                v.index_copy_(0, idx, src[:, off:off + v.shape[1]])
            return
        if self.device_reads:  # the piece is in device slab ``slab`` already
            with torch.cuda.stream(self.stream):
                t0 = time.perf_counter()
                self._device_copy(self.dev_loads[slab], ids, self.stream, to_pages=True, launcher=self.launcher)
                ev = torch.cuda.Event()
                ev.record(self.stream)
                self._slab_events[slab] = ev  # kvikio may read the next piece into it once this is done
                self.counters["scatter_issue_us"] += int((time.perf_counter() - t0) * 1e6)
            return
        with torch.cuda.stream(self.stream):
            t0 = time.perf_counter()
            self.dev_load[:n].copy_(src, non_blocking=True)  # one contiguous copy over PCIe
            ev = torch.cuda.Event()
            ev.record(self.stream)
            self._slab_events[slab] = ev  # the pinned slab may take the next piece once this is up
            t1 = time.perf_counter()
            if self._plans is None or piece is None or not self._plans.launch(piece):
                if self._plans is not None:
                    self._plans.close()
                self._device_copy(self.dev_load, ids, self.stream, to_pages=True, launcher=self.launcher)
            self.counters["h2d_issue_us"] += int((t1 - t0) * 1e6)
            self.counters["scatter_issue_us"] += int((time.perf_counter() - t1) * 1e6)

    def _device_copy(self, dev: torch.Tensor, ids: list[int], stream, to_pages: bool, launcher) -> None:
        """Device slab rows <-> the pages of blocks ``ids``, on ``stream`` (current), by
        ``launcher`` (None: torch's copies)."""
        if launcher is not None:
            cs = self._cupy(stream)
            for size, pages, staged in self._segments(dev.data_ptr(), ids):
                if to_pages:
                    path = launcher.copy_segments(pages, staged, size, cs, self._force)
                else:
                    path = launcher.copy_segments(staged, pages, size, cs, self._force)
                self.counters[f"segment_copies_{path}"] += 1
            return
        self.counters["segment_copies_torch"] += len(self.views)
        # from pinned memory, asynchronously: a pageable copy would wait for the stream's earlier work
        idx = torch.tensor(ids, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)
        n = len(ids)
        for v, off in zip(self.views, self.offsets):
            if to_pages:
                v.index_copy_(0, idx, dev[:n, off:off + v.shape[1]])
            else:
                dev[:n, off:off + v.shape[1]].copy_(v.index_select(0, idx))

    # -- stores (the engine thread gathers, the writer thread writes) --------------------------
    def plan_stores(self, stores: list[BlockTransfer]) -> None:
        """Queue the step's stores; they are gathered once its forward pass is done."""
        with self._glock:
            self._plan_stores(stores)

    def _plan_stores(self, stores: list[BlockTransfer]) -> None:
        for t in stores:
            self._had_stores.add(t.req_id)
            if sum(self._queued.values()) + len(t.keys) > self.max_queued:
                # the writes fall behind: skip rather than hold the engine's blocks
                self.counters["stores_skipped_blocks"] += len(t.keys)
                self._not_stored(t.keys)
                if self.counters["stores_skipped_blocks"] == len(t.keys):
                    log.warning("tiercache: vLLM connector: writes fall behind (%d blocks queued); stores are "
                                "skipped until they catch up", sum(self._queued.values()))
                continue
            self._queued[t.req_id] += len(t.keys)
            entry = [t.req_id, list(t.keys), list(t.block_ids), None]
            self._gathers.append(entry)
            self._unstamped.append(entry)

    def after_forward(self) -> None:
        """``wait_for_save``: the step's stores may read their blocks once the forward pass
        that computed them is done (an event on the current stream); gather what fits."""
        t0 = time.perf_counter()
        with self._glock:
            if self._failed_sync:
                self._drop_failed_stores()
            if self._unstamped:
                ev = True
                if self.cuda:
                    ev = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(self.device))
                for e in self._unstamped:
                    e[3] = ev
                self._unstamped = []
            if self._gatherer is None:
                self._gather()
        if self._gatherer is not None:
            self._kick.set()
        self.counters["after_forward_us"] += int((time.perf_counter() - t0) * 1e6)

    def _drop_failed_stores(self) -> None:
        """Forget the stores planned in this step for requests whose synchronous load failed
        in it: vLLM computed them over the blocks that failed and discards that step's output
        for them (it recomputes from the first bad block), so their bytes must not reach a
        file. Callers hold ``_glock``; the stores are not stamped yet, so none was gathered."""
        rids, self._failed_sync = self._failed_sync, set()
        dropped = [e for e in self._unstamped if e[0] in rids]
        if not dropped:
            return
        self._unstamped = [e for e in self._unstamped if e[0] not in rids]
        self._gathers = collections.deque(e for e in self._gathers if not any(e is d for d in dropped))
        for rid, keys, _, _ in dropped:
            self._queued[rid] -= len(keys)
            self.counters["stores_dropped_blocks"] += len(keys)
            self._not_stored(keys)

    def discard(self, keys: Iterable[bytes]) -> None:
        """Blocks the scheduler found computed over a synchronous load that failed (on this
        rank or another: with tensor parallelism every rank computed over it): drop their
        stores still queued, wait for those being written, and delete their files
        (:meth:`RowStore.discard`), so that no later lookup serves them."""
        ks = set(keys)
        if not ks:
            return
        with self._glock:
            kept: collections.deque = collections.deque()
            for e in self._gathers:
                pairs = [(k, b) for k, b in zip(e[1], e[2]) if k not in ks]
                if len(pairs) < len(e[1]):
                    self._queued[e[0]] -= len(e[1]) - len(pairs)
                    self.counters["stores_dropped_blocks"] += len(e[1]) - len(pairs)
                    e[1], e[2] = [k for k, _ in pairs], [b for _, b in pairs]
                if e[1]:
                    kept.append(e)
            self._gathers = kept
            self._unstamped = [e for e in self._unstamped if e[1]]
        deadline = time.monotonic() + self.WRITE_WAIT_S
        for k in ks:
            ev = self._writing.get(k)
            if ev is not None:
                ev.wait(max(0.0, deadline - time.monotonic()))
        try:
            self.counters["discarded_blocks"] += len(self.store.discard(ks))
        except Exception:  # pragma: no cover - reported, never raised into vLLM
            log.exception("tiercache: vLLM connector: %d block(s) computed over a failed load could not be "
                          "deleted", len(ks))
        self._not_stored(ks)

    #: seconds the gatherer waits before it looks again for a free slab
    GATHER_POLL_S = 0.001

    def _gather_loop(self) -> None:
        """The gatherer thread (``store_gathers = "thread"``): waits on the host for the forward
        pass of the oldest queued store, then issues what fits (free device and pinned slabs)."""
        if self.cuda:
            torch.cuda.set_device(self.device)
            if self.gather_launcher is not None:
                import cupy

                cupy.cuda.Device(self.device.index or 0).use()
        while not self._stopping:
            with self._glock:
                ev = self._gathers[0][3] if self._gathers else None
            if ev is None:
                self._kick.wait(0.05)
                self._kick.clear()
                continue
            try:
                if ev is not True:
                    ev.synchronize()  # the GIL is released while the forward pass ends
                with self._glock:
                    self._gather()
                    more = bool(self._gathers) and self._gathers[0][3] is not None
            except Exception:  # pragma: no cover - reported, never raised into vLLM
                log.exception("tiercache: vLLM connector: a gather failed; its stores are skipped")
                self._drop_gathers()
                continue
            if more:
                self._kick.wait(self.GATHER_POLL_S)
                self._kick.clear()

    def _drop_gathers(self) -> None:
        """A gather failed: forget the stores queued (their blocks are freed unstored)."""
        with self._glock:
            for rid, keys, _, _ in self._gathers:
                self._queued[rid] -= len(keys)
                self.counters["stores_skipped_blocks"] += len(keys)
                self._not_stored(keys)
            self._gathers.clear()

    def _not_stored(self, keys) -> None:
        """Keys whose store will not reach a file: the next :meth:`report` names them."""
        with self._lock:
            self._unstored.update(keys)

    def report(self) -> frozenset:
        """The keys not stored since the last call (the scheduler's index drops them)."""
        with self._lock:
            out, self._unstored = frozenset(self._unstored), set()
        return out

    def _free_dev(self, block: bool) -> int | None:
        """The next device store slab once its last copy to the host is done: None if it is
        not done and ``block`` is false (the gathers go on in a later call)."""
        if not self.cuda:
            return 0
        dev = self._next_dev
        ev = self._dev_events[dev]
        if ev is not None and not ev.query():
            if not block:
                self.counters["gather_dev_busy"] += 1
                return None
            ev.synchronize()
        return dev

    def _gather(self, block: bool = False) -> None:
        """Issue the queued gathers whose forward pass is stamped, while device and pinned slabs
        are free (``block``: wait for a device slab's copy). Callers hold ``_glock``."""
        while self._gathers and self._gathers[0][3] is not None:
            dev = self._free_dev(block)
            if dev is None:
                return
            with self._lock:
                if not self._free_slabs:
                    return
                slab = self._free_slabs.pop()
            entry = self._gathers[0]
            rid, keys, ids, step_ev = entry
            n = min(len(keys), self.piece)
            with self._lock:
                for k in keys[:n]:
                    self._writing[k] = threading.Event()
            gev, rows_ev = self._gather_rows(slab, dev, ids[:n], step_ev)
            if gev is not None:
                self._gathering[rid].append(gev)
            self._queued[rid] -= n
            if n == len(keys):
                self._gathers.popleft()
            else:
                entry[1], entry[2] = keys[n:], ids[n:]
            self._writes.put((keys[:n], slab, rows_ev))

    def _gather_rows(self, slab: int, dev: int, ids: list[int], step_ev):
        """The pages of blocks ``ids`` -> device store slab ``dev`` (after ``step_ev``) -> the
        rows of store slab ``slab`` (and, with :attr:`store_hasher`, the rows' XXH3-64 made in
        the device slab -> :attr:`slab_sums` ``[slab]``); returns two events (None, None: both
        done now): the pages are read (the blocks may change), and the rows (and checksums) are
        complete (the files may be written)."""
        n, row0 = len(ids), slab * self.piece
        dst = self.staging[row0:row0 + n]
        if not self.cuda:
            idx = torch.tensor(ids, dtype=torch.long)
            for v, off in zip(self.views, self.offsets):
                dst[:, off:off + v.shape[1]] = v.index_select(0, idx)
            return None, None
        buf = self.dev_store[dev]
        t0 = time.perf_counter()
        hashed = None
        with torch.cuda.stream(self.store_stream):
            self.store_stream.wait_event(step_ev)
            self._device_copy(buf, ids, self.store_stream, to_pages=False, launcher=self.gather_launcher)
            gathered = torch.cuda.Event()
            gathered.record(self.store_stream)  # the pages are read: they may change now
            if self.store_hasher is not None:  # the files' checksums, from the slab while it goes down
                self.store_hasher.hash_rows(buf[:n], self.dev_store_sums[dev, :n], self._cupy(self.store_stream))
                hashed = torch.cuda.Event()
                hashed.record(self.store_stream)
        self._gathered_ev = gathered
        t1 = time.perf_counter()
        d2h = self._d2h_stream
        with torch.cuda.stream(d2h):
            d2h.wait_event(gathered)
            dst.copy_(buf[:n], non_blocking=True)
            if hashed is not None:
                d2h.wait_event(hashed)
                self.slab_sums[slab, :n].copy_(self.dev_store_sums[dev, :n], non_blocking=True)
            rows_ev = torch.cuda.Event()
            rows_ev.record(d2h)
        self.counters["gather_issue_us"] += int((t1 - t0) * 1e6)
        self.counters["d2h_issue_us"] += int((time.perf_counter() - t1) * 1e6)
        self._dev_events[dev] = rows_ev  # the slab may take the next gather once this is done
        self._next_dev = (dev + 1) % len(self._dev_events)
        return gathered, rows_ev

    #: store slabs the writer keeps in the I/O engine at once (the next slab's files start
    #: while the last one's finish)
    WRITES_IN_FLIGHT = 2

    def _write_loop(self) -> None:
        pending: collections.deque = collections.deque()  # (keys, slab, job id or None)
        while True:
            try:
                item = self._writes.get(block=not pending)
            except queue.Empty:
                self._finish_write(*pending.popleft())
                continue
            if item is None:
                while pending:
                    self._finish_write(*pending.popleft())
                return
            keys, slab, rows_ev = item
            jid = None
            try:
                sums = {}
                if rows_ev is not None:
                    rows_ev.synchronize()
                    if self.store_hasher is not None:  # made on the GPU: the C threads do not hash the data
                        sums = {"sums": self.slab_sums[slab, :len(keys)].numpy().view(np.uint64)}
                jid = self._submit(self.store.submit_store, keys, slab * self.piece, **sums)
            except Exception:  # pragma: no cover - reported, never raised into vLLM
                log.exception("tiercache: vLLM connector: a store of %d block(s) failed", len(keys))
            pending.append((keys, slab, jid, time.perf_counter()))
            if len(pending) >= self.WRITES_IN_FLIGHT:
                self._finish_write(*pending.popleft())

    def _finish_write(self, keys: list[bytes], slab: int, jid: int | None, submitted: float = 0.0) -> None:
        """Wait for a store slab's write (job ``jid``, submitted at ``submitted`` perf_counter
        seconds; None: it failed to start), count it, and free the slab and the blocks' waiters."""
        try:
            if jid is not None:
                res = self._wait(jid)
                self.counters["write_slabs"] += 1
                self.counters["write_us"] += int((time.perf_counter() - submitted) * 1e6)
                self.counters["stored_blocks"] += len(keys) - len(res.failed)
                written = len(keys) - len(res.failed) - len(res.skipped)
                if res.sums_only:
                    self.counters["gpu_summed_store_blocks"] += written
                elif self.store_hasher is not None and written:
                    # the GPU's checksums went unused (the store's row writes did not take the job:
                    # the host hashed the data); the files are as good, the CPU's cost is not
                    self.counters["store_sums_unused_blocks"] += written
                if res.failed:
                    self._not_stored(res.failed)
                    self.counters["store_failed_blocks"] += len(res.failed)
                    log.warning("tiercache: vLLM connector: %d block(s) not stored: %s", len(res.failed),
                                next(iter(res.failed.values())))
        except Exception:  # pragma: no cover - reported, never raised into vLLM
            log.exception("tiercache: vLLM connector: a store of %d block(s) failed", len(keys))
            self._not_stored(keys)
        finally:
            with self._lock:
                self._free_slabs.append(slab)
                self._slab_freed.notify_all()
                for k in keys:
                    ev = self._writing.pop(k, None)
                    if ev is not None:
                        ev.set()

    def before_forward(self, preempted: list[str], released: Iterable[str] = ()) -> None:
        """Before a step's loads and forward pass (which may write any block vLLM freed): the
        stores of ``preempted`` requests still waiting for a store slab are gathered now,
        waiting for the writer to free slabs where none is free (vLLM's own offloading
        connector flushes a preempted request's stores the same way); those of ``released``
        requests (finished, their blocks freed without waiting) are gathered as far as free
        slabs go and the rest skipped (``stores_skipped_blocks``), so a finished request never
        stalls the engine; and the loads' and the forward pass's streams wait for every gather
        already issued to have read its pages (an event on the GPU; the host does not wait)."""
        if self._unstamped:  # planned in a step without a forward pass: what is enqueued is enough
            self.after_forward()
        with self._glock:
            if released:
                self._release(set(released))
            if preempted and any(e[0] in preempted for e in self._gathers):
                t0 = time.perf_counter()
                while any(e[0] in preempted for e in self._gathers):
                    with self._lock:
                        if not self._free_slabs:
                            self._slab_freed.wait(1.0)
                    self._gather(block=True)
                self.counters["preemption_flush_us"] += int((time.perf_counter() - t0) * 1e6)
            if self.cuda and self._gathered_ev is not None:
                torch.cuda.current_stream(self.device).wait_event(self._gathered_ev)
                if self._streams:  # the loads' side stream writes freed blocks too
                    self._streams[0].wait_event(self._gathered_ev)
                self._gathered_ev = None

    def _release(self, rids: set[str]) -> None:
        """Requests whose blocks vLLM freed at their finish: issue their queued gathers that
        free slabs take now, skip the rest, and forget them (no finished_sending: vLLM no
        longer knows them). Callers hold ``_glock``."""
        rids &= self._had_stores
        if not rids:
            return
        if any(e[0] in rids for e in self._gathers):
            self._gather(block=True)  # waits for a device slab's copy down, never for the writer
            kept = collections.deque(e for e in self._gathers if e[0] not in rids)
            for rid, keys, _, _ in (e for e in self._gathers if e[0] in rids):
                self.counters["stores_skipped_blocks"] += len(keys)
                self.counters["released_skipped_blocks"] += len(keys)
                self._not_stored(keys)
            self._gathers = kept
        for r in rids:
            self._had_stores.discard(r)
            self._finished_reqs.discard(r)
            self._queued.pop(r, None)
            self._gathering.pop(r, None)
        self.counters["released_requests"] += len(rids)

    # -- what finished -----------------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(sending, recving)``: requests whose blocks may be freed (finished, and every
        block they store read out of their pages), and requests whose loads are done."""
        with self._glock:
            if self._gatherer is None:
                self._gather()
            self._finished_reqs |= set(finished_req_ids) & self._had_stores
            sending = set()
            for r in self._finished_reqs:
                if self._queued[r] > 0:
                    continue
                evs = self._gathering.get(r)
                if evs and not all(e.query() for e in evs):
                    continue
                sending.add(r)
            for r in sending:
                self._finished_reqs.discard(r)
                self._had_stores.discard(r)
                self._queued.pop(r, None)
                self._gathering.pop(r, None)
        recving, self._recving = self._recving, set()
        return sending or None, recving or None

    def load_errors(self) -> set[int]:
        with self._lock:
            out, self._errors = self._errors, set()
        return out

    def drain(self, timeout: float = 60.0) -> bool:
        """Gather what is queued and wait until every gathered block's file is written; False
        if ``timeout`` seconds passed first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._glock:
                self._gather()
                gathers = bool(self._gathers)
            with self._lock:
                if not gathers and not self._writing:
                    return True
                self._slab_freed.wait(0.01)
        return False

    def close(self) -> None:
        """Gather and write what is queued, then close the store."""
        deadline = time.monotonic() + 60.0
        if self._gatherer is not None:
            self._stopping = True
            self._kick.set()
            self._gatherer.join()
            self._gatherer = None
        with self._glock:
            for e in self._unstamped:
                e[3] = True if not self.cuda else torch.cuda.current_stream(self.device).record_event()
            self._unstamped = []
        while self._gathers and time.monotonic() < deadline:
            with self._glock:
                self._gather()
            time.sleep(0.001)
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join()
        if self.store is not None:
            self.store.drain()
            self.store.close()


class _ScatterPlans:
    """The scatters of one load's pieces planned in groups (``scatter_tables = "load"``): each
    group's tables built and uploaded on the loads' stream when its first piece lands, its
    plan released after its last, so that one plan at a time holds part of the launcher's
    upload ring. A piece the plans do not take (the launcher would not plan, or the piece was
    cut short by a failed block) is scattered by ``copy_segments`` as before, after the open
    plan is released (that call's release would otherwise free the plan's tables early)."""

    #: bytes of tables per group (a quarter of the launcher's 4 MiB upload ring at most)
    GROUP_BYTES = 1 << 20

    def __init__(self, worker: ConnectorWorker, t: BlockTransfer) -> None:
        self.w = worker
        self.ids = t.block_ids
        self.pieces = -(-len(self.ids) // worker.piece)
        # a piece's table: a source and a destination address per segment (one per region of each
        # block), and a counter area per launch (one per size of region)
        per_piece = 16 * len(worker.views) * worker.piece + 8 * (1 + worker.launcher.SM_SLOTS) * len(worker.size_groups)
        self.group = max(1, self.GROUP_BYTES // per_piece)
        self.open: tuple[int, Any, list[list[int]]] | None = None  # (group, plan, launches per piece)
        self.refused = False  # the launcher would not plan these copies: every piece as before

    def launch(self, piece: int) -> bool:
        """Issue piece ``piece``'s scatter from its group's plan; False where it has none (then
        the caller scatters it, after :meth:`close`)."""
        if self.refused:
            return False
        g = piece // self.group
        if self.open is None or self.open[0] != g:
            self.close()
            plan, per_piece = self._plan(g)
            if plan is None:
                self.refused = True
                return False
            self.open = (g, plan, per_piece)
        _, plan, per_piece = self.open
        cs = self.w._cupy(self.w.stream)
        for j in per_piece[piece - g * self.group]:
            plan.launch(j, cs)
        self.w.counters["planned_scatter_pieces"] += 1
        if piece == min((g + 1) * self.group, self.pieces) - 1:
            self.close()  # the group's last piece: its tables may be reused once the stream is past it
        return True

    def _plan(self, g: int) -> tuple[Any, list[list[int]]]:
        w = self.w
        copies: list[tuple[np.ndarray, np.ndarray, int]] = []
        per_piece: list[list[int]] = []
        base = w.dev_load.data_ptr()
        for k in range(g * self.group, min((g + 1) * self.group, self.pieces)):
            ids = self.ids[k * w.piece:(k + 1) * w.piece]
            per_piece.append(list(range(len(copies), len(copies) + len(w.size_groups))))
            copies += [(pages, staged, int(size)) for size, pages, staged in w._segments(base, ids)]
        return w.launcher.plan_segments(copies, w._cupy(w.stream), w._force), per_piece

    def close(self) -> None:
        """Release the open plan's tables (once the loads' stream is past its launches)."""
        if self.open is not None:
            self.open[1].done(self.w._cupy(self.w.stream))
        self.open = None


def _cupy_stream(stream: torch.cuda.Stream, device: torch.device):
    """CuPy's view of a torch stream (the kernels launch through CuPy)."""
    import warnings

    import cupy

    with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream for Stream.from_external
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(stream.cuda_stream, device.index or 0)


def _launcher(device: torch.device):
    """The project's copy kernels for ``device`` (needs CuPy), or None and why: then the
    uploads and gathers go through torch (a copy per region)."""
    from tiercache.copypaths import copy_kernel_status

    launcher, what = copy_kernel_status(device.index or 0)
    return launcher, what if launcher is not None else f"torch ({what})"


def _side(obj, wanted: str, role: str):
    """``obj``, this connector's side for a ``wanted``-side call; a ConfigError naming the mix-up
    where it is None (the connector was built for ``role``)."""
    if obj is None:
        raise ConfigError(f"TierCacheConnector: a {wanted}-side call on a {role}-side connector")
    return obj


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
        self._reported: dict[str, int] = {}  # the worker's counters as get_kv_connector_stats last saw them
        if role == KVConnectorRole.SCHEDULER:
            self._sched = ConnectorScheduler(vllm_config, self.settings,
                                     [rank_roots(self.settings["root"], digest, model, r) for r in range(tp)])
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank() if tp > 1 else 0
            roots = rank_roots(self.settings["root"], digest, model, rank)
            others = other_layouts(roots)
            if others:
                log.warning("tiercache: vLLM connector: %s hold files of this model and rank that this engine "
                            "does not read (another vLLM release, attention backend or KV layout, or a connector "
                            "before 2026-12-07); `tiercache purge --root DIR` frees their space",
                            ", ".join(map(str, others)))
            self._worker = ConnectorWorker(self.settings, roots)

    @property
    def sched(self) -> ConnectorScheduler:
        """The scheduler side. Raises ConfigError on a worker-side connector."""
        return _side(self._sched, "scheduler", "worker")

    @property
    def worker(self) -> ConnectorWorker:
        """The worker side. Raises ConfigError on a scheduler-side connector."""
        return _side(self._worker, "worker", "scheduler")

    # -- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self.sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self.sched.update_connector_output(connector_output)

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        return self.sched.request_finished(request, block_ids)

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self.kv_cache_config.num_blocks if self.kv_cache_config is not None else None
        if num_blocks is None:
            num_blocks = next(iter(kv_caches.values())).shape[0]
        self.worker.register(kv_caches, int(num_blocks))

    def handle_preemptions(self, kv_connector_metadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, TierCacheConnectorMetadata):
            self.worker.before_forward(kv_connector_metadata.preempted, kv_connector_metadata.released)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierCacheConnectorMetadata)
        self.worker.before_forward(meta.preempted, meta.released)  # again: vLLMs without handle_preemptions
        self.worker.discard(meta.discard)
        self.worker.plan_stores(meta.stores)
        self.worker.load(meta.loads, report=not meta.sync_loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:  # layer-wise loads land here; whole ones are in already
            self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # stores gather whole blocks after the forward pass (wait_for_save)

    def wait_for_save(self) -> None:
        self.worker.finish_layers()  # before after_forward: it drops the stores of a load that failed
        self.worker.after_forward()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads (``layer_groups``) run in ``wait_for_layer_load``, which a captured
        CUDA graph would skip."""
        return bool((extra_config or {}).get("layer_groups"))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors()

    def build_connector_worker_meta(self) -> TierCacheWorkerMetadata | None:
        unstored = self.worker.report() if self._worker is not None else frozenset()
        return TierCacheWorkerMetadata(unstored=unstored) if unstored else None

    def get_kv_connector_stats(self) -> vllmconnstats.TierCacheConnectorStats | None:
        """This worker's counter deltas since the last call (:mod:`vllmconnstats`), or None."""
        if self._worker is None:
            return None
        grown = vllmconnstats.deltas(dict(self._worker.counters), self._reported)
        return vllmconnstats.TierCacheConnectorStats(data=grown) if grown else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> vllmconnstats.TierCacheConnectorStats:
        return vllmconnstats.TierCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return vllmconnstats.TierCacheConnectorPromMetrics(vllm_config, metric_types, labelnames,
                                                           per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()


__all__ = [
    "BlockTransfer",
    "ConnectorScheduler",
    "ConnectorWorker",
    "DEFAULTS",
    "TierCacheConnector",
    "TierCacheConnectorMetadata",
    "TierCacheWorkerMetadata",
    "block_key",
    "block_views",
    "parse_config",
    "rank_roots",
]
