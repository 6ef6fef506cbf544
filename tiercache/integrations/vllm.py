"""tiercache as a storage tier of vLLM's KV offloading (vLLM 0.26 through 0.33,
``vllm/v1/kv_offload/tiering``).

vLLM's ``OffloadingConnector`` with a tiering spec moves KV blocks between the GPU and a CPU
*primary* tier itself, then cascades them to *secondary* tiers and promotes them back.
:class:`TierCacheTier` is such a secondary tier. :class:`TierCacheTieringSpec` (vLLM's
``TieringOffloadingSpec`` with the tier registered) loads it on every release from 0.26::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
      "kv_role": "kv_both", "kv_connector_extra_config": {
        "spec_name": "TierCacheTieringSpec", "spec_module_path": "tiercache.integrations.vllm",
        "cpu_bytes_to_use": 17179869184,
        "secondary_tiers": [{"type": "TierCacheTier", "root": "/mnt/nvme/kv",
                             "capacity_bytes": 500000000000}]}}'

On 0.33 and later vLLM's own spec also loads it by module path: ``"spec_name":
"TieringOffloadingSpec"`` and ``"module_path": "tiercache.integrations.vllm"`` in the tier's
entry. What differs between releases is handled in :mod:`tiercache.integrations.vllmcompat`.

Each chunk of the primary tier (one row of its buffer, every layer of the chunk) becomes one
tiercache block file, ``block_x<OffloadKey hex>_pool_kv.bin``: the 4 KiB header (key,
geometry, XXH3-64 of the data), the row's bytes, atomic publication. Rows go to files and back
without a copy, O_DIRECT (the primary buffer is page-aligned), on tiercache's native I/O
engine (:class:`~tiercache.RowStore` does the work; this module is vLLM's face of it).

The files of one model and parallel layout live in their own tiercache root,
``<root>/<model>_<digest>_r<rank>`` (vLLM's own ``FileMapper`` names it, as for its ``fs`` tier:
the digest covers the model, dtype, tokens per hash, chunking, parallel sizes and KV-cache
groups; the KV-cache group is part of the ``OffloadKey``), so several models share a ``root``
and several vLLM instances share one model's files with ``"sharing": "shared"`` (one instance's
stores are hits for another's lookups).

Config keys (beside vLLM's ``type``, ``module_path`` and ``backpressure``); those that are
tiercache settings have the cache's defaults and ranges (:mod:`tiercache.settings`,
docs/configuration.md; ``verify`` is ``verify_checksums`` there):

=====================  ==========================  ===========================================
key                    default                     meaning
=====================  ==========================  ===========================================
``root``               (required)                  directory under which the tier's roots live,
                                                   or a list of them (one per device: a root
                                                   array, blocks spread by a hash of the key)
``capacity_bytes``     0: 90% of the free space    disk bytes the tier's files may take (each
                       at start, plus the files    chunk: its row plus a 4 KiB header); least
                       already there               recently used chunks are evicted beyond it
``capacity_blocks``    none                        the same bound in chunks (the smaller holds)
``sharing``            ``"exclusive"``             ``"shared"``: several vLLM instances (or
                                                   processes) on one root
``fsync``              ``"data"``                  ``"none"`` / ``"data+dir"``: durable before
                                                   a store is reported (docs/file-format.md)
``verify``             ``true``                    check each load's XXH3-64
``io_engine``          ``"auto"``                  ``io_uring`` | ``threads`` | ``python``
``io_threads``         8                           I/O threads
``open_files``         -1                          held descriptors (-1 auto, 0 none)
``direct_io``          ``true``                    O_DIRECT where rows are page-aligned
``enable_kv_events``   ``false``                   emit stored/removed ``OffloadingEvent``\\ s
                                                   (when vLLM's KV events are on)
``locality``           none                        ``"LOCAL"`` | ``"REMOTE"``, as vLLM's tiers
``metrics_port``       none                        serve tiercache's Prometheus series from
                                                   this port in the scheduler process
``check_root_owner``   ``true``                    refuse a root others can write
``min_age_s``          30                          shared: files younger are not evicted
``negative_ttl_s``     1                           shared: a key in no file is not probed again
``tmp_max_age_s``      900                         shared: temporary files older are abandoned
``index_checkpoint_s`` 60                          seconds between saves of the root's index
                                                   (what a restart opens from; also at close)
=====================  ==========================  ===========================================

A bad key or value is one :class:`~tiercache.ConfigError` at construction, naming it and what
is valid.

Behaviour vLLM's interface leaves to the tier:

- ``lookup`` never waits on the disk: ``HIT`` for a chunk whose file is published, ``RETRY``
  while its store is in flight (and, on a shared root, while a background probe looks for
  another instance's file), ``MISS`` otherwise.
- A store of a chunk already stored is skipped; room is made by evicting least recently used
  chunks (``touch`` refreshes them), never one being loaded; with ``enable_kv_events`` each
  eviction is a removal ``OffloadingEvent``.
- A load whose file is missing or fails its header or checksum fails that chunk
  (``successful_keys`` lists the others); the file is quarantined, the chunk is a ``MISS`` from
  then on, and its primary row is zeroed before the job is reported: no unverified byte stays.
- ``drain_jobs`` and ``shutdown`` let every submitted transfer finish (none is cut short).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from tiercache import KeyState, RowStore
from tiercache.errors import ConfigError, TierCacheError
from tiercache.integrations import vllmcompat as compat
from tiercache.integrations.engineconfig import with_defaults
from tiercache.integrations.vllmcompat import SecondaryTierManager
from tiercache.settings import default as settings_default
from tiercache.settings import sections

log = logging.getLogger("tiercache")
_PRESENT, _PENDING = KeyState.PRESENT, KeyState.PENDING

#: config keys that are tiercache settings -> (section, setting) (:mod:`tiercache.settings`: one
#: default and one range for the cache, the row store and this tier)
SETTING_KEYS: dict[str, tuple[str, str]] = {
    "capacity_bytes": ("file", "capacity_bytes"), "fsync": ("file", "fsync"), "verify": ("file", "verify_checksums"),
    "io_engine": ("file", "io_engine"), "io_threads": ("file", "io_threads"), "open_files": ("file", "open_files"),
    "direct_io": ("file", "direct_io"), "check_root_owner": ("file", "check_root_owner"),
    "index_checkpoint_s": ("file", "index_checkpoint_s"), "sharing": ("sharing", "sharing"),
    "min_age_s": ("sharing", "min_age_s"), "negative_ttl_s": ("sharing", "negative_ttl_s"),
    "tmp_max_age_s": ("sharing", "tmp_max_age_s"),
}
#: config keys and their defaults (``root`` has none; ``capacity_bytes`` 0: 90% of the free space)
DEFAULTS: dict[str, Any] = {
    "root": None, "capacity_blocks": None, "enable_kv_events": False, "locality": None, "metrics_port": None,
    **{key: settings_default(*where) for key, where in SETTING_KEYS.items()},
}
_BOOL_KEYS = ("enable_kv_events",)

# metric names (vLLM's Prometheus frontend adds nothing to them)
STORED = "vllm:kv_offload_tiercache_stored_chunks"
LOADED = "vllm:kv_offload_tiercache_loaded_chunks"
EVICTED = "vllm:kv_offload_tiercache_evicted_chunks"
DROPPED = "vllm:kv_offload_tiercache_dropped_stores"
CORRUPT = "vllm:kv_offload_tiercache_corrupt_chunks"
VANISHED = "vllm:kv_offload_tiercache_vanished_chunks"
CHUNKS = "vllm:kv_offload_tiercache_chunks"
DISK_BYTES = "vllm:kv_offload_tiercache_disk_bytes"
CAPACITY_BYTES = "vllm:kv_offload_tiercache_capacity_bytes"
_COUNTERS = {STORED: "stored_blocks", LOADED: "loaded_blocks", EVICTED: "evicted_blocks", DROPPED: "dropped_stores",
             CORRUPT: "corrupt_blocks", VANISHED: "vanished_blocks"}


def parse_config(config: dict[str, Any]) -> dict[str, Any]:
    """The tier's settings: ``config`` checked and completed with :data:`DEFAULTS`.

    Raises:
        ConfigError: an unknown key (named, with the valid ones), ``root`` missing, or a value
            out of range (the ranges of :mod:`tiercache.settings`).
    """
    out = with_defaults(config, DEFAULTS, "TierCacheTier")
    if out["capacity_bytes"] is None:  # as before the settings had one default: no byte bound given
        out["capacity_bytes"] = 0
    try:
        sections(**{where[1]: out[k] for k, where in SETTING_KEYS.items()})
    except ConfigError as exc:
        msg = str(exc)
        for k, (_, name) in SETTING_KEYS.items():
            if k != name and msg.startswith(name + " "):
                msg = k + msg[len(name):]
        raise ConfigError(f"TierCacheTier: {msg}") from None
    for k in _BOOL_KEYS:
        if not isinstance(out[k], bool):
            raise ConfigError(f"TierCacheTier: {k!r} = {out[k]!r} must be true or false")
    if out["locality"] is not None:
        try:
            out["locality"] = Locality(out["locality"])
        except ValueError:
            raise ConfigError(f"TierCacheTier: 'locality' = {out['locality']!r}; valid: "
                              f"{', '.join(m.value for m in Locality)}") from None
    port = out["metrics_port"]
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
        raise ConfigError(f"TierCacheTier: 'metrics_port' = {port!r} must be an integer in [0, 65535]")
    return out


class TierCacheTier(SecondaryTierManager):
    """A vLLM secondary tier of KV chunks in tiercache block files (module docstring).

    Args:
        offloading_spec: vLLM's ``OffloadingSpec`` (its config names the tier's root).
        primary_kv_view: the CPU primary tier's buffer, ``[num_chunks, row_bytes]``; chunk ``c``
            is row ``c``.
        tier_type: the tier's type name (``"TierCacheTier"``).
        backpressure_detector: vLLM's, if configured.
        **config: the keys of :data:`DEFAULTS` (table in the module docstring).

    Raises:
        ConfigError: a bad key or value.
        RootError: the root cannot be opened (not writable, another process holds it in
            another sharing mode, not tiercache's).
    """

    medium: ClassVar[Any] = compat.STORAGE_MEDIUM

    def __init__(self, offloading_spec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector=None, **config: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, **compat.tier_init_args(backpressure_detector))
        for key in compat.FACTORY_KEYS:  # releases whose factory passes them through (0.26)
            config.pop(key, None)
        self.settings = parse_config(config)
        self.locality = self.settings["locality"]
        given = self.settings["root"]
        mappers = [FileMapper.from_offloading_spec(root_dir=str(r), offloading_spec=offloading_spec,
                                                   blocks_per_file=offloading_spec.blocks_per_chunk,
                                                   parallel_agnostic=True)
                   for r in (given if isinstance(given, (list, tuple)) else [given])]
        mapper = mappers[0]
        #: the tiercache root (the home of a root array: ``root`` given as a list of directories)
        self.root = Path(f"{mapper.base_path}_r{mapper.rank}")
        #: every root (``<root>/<model>_<digest>_r<rank>`` under each directory given)
        self.roots = [Path(f"{m.base_path}_r{m.rank}") for m in mappers]
        self._write_run_config(mapper)
        self.store = RowStore(primary_kv_view, self.roots if len(self.roots) > 1 else self.root,
                              capacity_blocks=self.settings["capacity_blocks"],
                              **{where[1]: self.settings[k] for k, where in SETTING_KEYS.items()})
        self.events: list[OffloadingEvent] | None = None
        if self.settings["enable_kv_events"]:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                log.warning("tiercache: enable_kv_events is set on tier %r but vLLM's KV cache events are off; "
                            "the tier emits none", tier_type)
        self._failed: list = []  # jobs refused at submit (reported like any other)
        self._reported: dict[str, int] = {}
        self._labels = (tier_type,)
        self._metrics_server = None
        self._register_metrics()
        log.info("tiercache: vLLM tier %r at %s: %d chunk(s) held, capacity %d chunk(s) of %d bytes, %s, fsync %s, "
                 "%s engine", tier_type, self.root, len(self.store), self.store.capacity_blocks,
                 self.store.row_bytes, self.store.sharing, self.store.fsync, self.store.ft.engine)

    def _write_run_config(self, mapper: FileMapper) -> None:
        path = Path(mapper.get_config_file_path())
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(mapper.get_run_config(), indent=2, sort_keys=True))
            os.replace(tmp, path)

    def _register_metrics(self) -> None:
        from tiercache import metrics

        try:
            self.store.metrics_name = metrics.register(self.store, name=f"vllm-{self.tier_type}-{self.root.name}")
        except (TierCacheError, ImportError):  # no prometheus-client: vLLM's own series remain
            return
        port = self.settings["metrics_port"]
        if port is not None:
            self._metrics_server, _ = metrics.start_http_server(port, addr="0.0.0.0")

    # -- lookups -------------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT / MISS from memory, RETRY while the chunk's store (or a shared root's probe) is
        in flight; never waits on the disk."""
        state = self.store.state(key)
        if state is _PRESENT:
            return LookupResult.HIT
        return LookupResult.RETRY if state is _PENDING else LookupResult.MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.store.touch(keys)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    # -- jobs ----------------------------------------------------------------------------------
    def submit_store(self, job_metadata: Any) -> None:  # the release's TransferJob (vllmcompat)
        """Write the job's primary rows (``chunk_ids``) as block files; returns at once."""
        self._submit(self.store.submit_store, job_metadata)

    def submit_load(self, job_metadata: Any) -> None:  # the release's TransferJob (vllmcompat)
        """Read the job's chunks into its primary rows (``chunk_ids``); returns at once."""
        self._submit(self.store.submit_load, job_metadata)

    def _submit(self, submit, job: Any) -> None:
        try:
            submit(list(job.keys), compat.job_rows(job), job_id=job.job_id)
        except TierCacheError as exc:  # a key or row vLLM should never send: fail the job, not the step
            log.error("tiercache: %s job %s refused: %s", "load" if job.is_promotion else "store", job.job_id, exc)
            self._failed.append(compat.job_result(job.job_id, False, transfer_time=0.0, transfer_bytes=0))

    def get_finished_jobs(self) -> Iterable:
        """The jobs finished since the last call (vLLM's ``JobResult``\\ s); a load that failed
        for some chunks names the others in ``successful_keys`` where the release has it (0.33),
        else fails whole (0.26)."""
        out, self._failed = self._failed, []
        for res in self.store.finished():
            partial = None
            if res.kind == "load" and res.failed:
                done = res.done_keys
                partial = tuple(done) if done else None
            elif res.kind == "store" and self.events is not None:
                written = [k for k in res.done_keys if k not in set(res.skipped)]
                if written:
                    self.events.append(OffloadingEvent(keys=written, medium=self.medium, removed=False,
                                                       locality=self.locality))
            out.append(compat.job_result(res.job_id, res.success, successful_keys=partial,
                                         transfer_time=res.seconds, transfer_bytes=res.nbytes))
        return out

    def has_pending_work(self) -> bool:
        return bool(self._failed) or self.store.jobs_in_flight > 0

    def take_events(self) -> Iterable[OffloadingEvent]:
        removed = self.store.take_removed()
        if self.events is None:
            return ()
        out, self.events = self.events, []
        if removed:
            out.append(OffloadingEvent(keys=removed, medium=self.medium, removed=True, locality=self.locality))
        return out

    def drain_jobs(self) -> None:
        """Wait until every submitted job has finished (none is cut short)."""
        self.store.drain()

    def shutdown(self) -> None:
        """Finish every job, save the root's stats, release the root."""
        from tiercache import metrics

        try:
            metrics.unregister(self.store)
        except ImportError:
            pass
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self.store.close()

    # -- metrics -------------------------------------------------------------------------------
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """The tier's series (label ``tier``: the tier type)."""
        doc = {
            STORED: "Chunks written to tiercache block files.",
            LOADED: "Chunks read back from tiercache block files into the primary tier.",
            EVICTED: "Chunks that left the tier (capacity, a shared root's sweep, or a failed load).",
            DROPPED: "Chunks whose store found no room (every chunk was being read or written).",
            CORRUPT: "Chunks whose file failed its header or XXH3-64 check (quarantined).",
            VANISHED: "Chunks whose file was gone when loaded (a shared root's other process deleted it).",
        }
        out: dict[str, OffloadingMetricMetadata] = {
            name: OffloadingCounterMetadata(documentation=text, labelnames=("tier",)) for name, text in doc.items()}
        out[CHUNKS] = OffloadingGaugeMetadata(documentation="Chunks the tier holds.", labelnames=("tier",))
        out[DISK_BYTES] = OffloadingGaugeMetadata(documentation="Disk bytes the tier's chunk files take.",
                                                  labelnames=("tier",))
        out[CAPACITY_BYTES] = OffloadingGaugeMetadata(documentation="Disk bytes the tier may take.",
                                                      labelnames=("tier",))
        return out

    def get_stats(self):
        """Counter increments since the last call, and the current gauges."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        st = self.store.stats()
        counters, tier = st["counters"], st["tiers"]["file"]
        stats = OffloadingConnectorStats()
        for metric, name in _COUNTERS.items():
            delta = counters.get(name, 0) - self._reported.get(name, 0)
            if delta:
                stats.increase_counter(metric, delta, self._labels)
                self._reported[name] = counters.get(name, 0)
        stats.set_gauge(CHUNKS, tier["used"], self._labels)
        stats.set_gauge(DISK_BYTES, tier["bytes_on_disk"], self._labels)
        stats.set_gauge(CAPACITY_BYTES, tier["bytes_capacity_on_disk"], self._labels)
        return stats

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("tiercache_root", "tiercache_sharing", "tiercache_fsync", "tiercache_io_engine")

    def config_info(self) -> dict[str, str]:
        return {"tiercache_root": str(self.root), "tiercache_sharing": self.store.sharing,
                "tiercache_fsync": self.store.fsync, "tiercache_io_engine": self.store.ft.engine}


class TierCacheTieringSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` with :class:`TierCacheTier` registered as the secondary
    tier type ``"TierCacheTier"``: the way to load the tier on releases whose tier factory has
    no ``module_path`` (0.26-0.32), and equally valid on 0.33::

        "kv_connector_extra_config": {"spec_name": "TierCacheTieringSpec",
          "spec_module_path": "tiercache.integrations.vllm", "cpu_bytes_to_use": 17179869184,
          "secondary_tiers": [{"type": "TierCacheTier", "root": "/mnt/nvme/kv"}]}

    It changes one thing more: a store built for a request whose tiering state vLLM has already
    finalized is skipped (``prepare_store`` returns None, as vLLM does for a store its CPU tier
    cannot take), where vLLM 0.26's manager raises ``KeyError`` inside the engine (seen after a
    "cannot store chunks" when the CPU tier was full); the skipped stores are counted in the
    manager's ``tiercache_stores_skipped_after_finish``. The CPU primary tier, its eviction policy
    and every secondary tier, vLLM's own included, behave as under ``TieringOffloadingSpec``
    (vLLM's connector imports this module, which registers the tier, before it reads the tiers'
    metric definitions).
    """

    def get_manager(self):
        manager = super().get_manager()
        guard_stores_after_finish(manager)
        return manager


def guard_stores_after_finish(manager) -> None:
    """Make ``manager`` (vLLM's ``TieringOffloadingManager``) skip a store for a request it no
    longer tracks, instead of raising ``KeyError`` (see :class:`TierCacheTieringSpec`).
    Idempotent; a manager without per-request state is left as it is."""
    if getattr(manager, "tiercache_stores_skipped_after_finish", None) is not None \
            or not hasattr(manager, "_req_state"):
        return
    manager.tiercache_stores_skipped_after_finish = 0
    real = manager.prepare_store

    def prepare_store(keys, req_context, *args, **kwargs):
        if req_context.req_id not in manager._req_state:
            manager.tiercache_stores_skipped_after_finish += 1
            return None
        return real(keys, req_context, *args, **kwargs)

    manager.prepare_store = prepare_store


compat.register_tier("TierCacheTier", __name__, "TierCacheTier")
