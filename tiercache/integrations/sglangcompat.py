"""What differs between the SGLang releases :mod:`tiercache.integrations.sglang` supports
(0.5.6 and later: the ``dynamic`` backend factory and ``interface_v1``), found by feature, not
by version number. Importing this module imports SGLang's storage interface."""

from __future__ import annotations

from sglang.srt.mem_cache import hicache_storage as _hs

#: the base class of HiCache storage backends
HiCacheStorage = _hs.HiCacheStorage
#: pages per batched storage call in SGLang's cache controller (128 where it does not say)
STORAGE_BATCH_SIZE = int(getattr(_hs, "STORAGE_BATCH_SIZE", 128))
#: the KV pool's name in interface v2's pool registrations (``PoolName.KV``; "kv" where the
#: release has no such name)
KV_POOL_NAME = str(_hs.PoolName.KV.value) if hasattr(_hs, "PoolName") else "kv"


def is_storage_writer(cfg) -> bool:
    """Whether this rank writes pages: every rank for MHA; for MLA (every rank holds the same
    KV) one rank, as SGLang says (``HiCacheStorageConfig.is_storage_writer``, newer releases),
    else rank 0."""
    w = getattr(type(cfg), "is_storage_writer", None)
    if isinstance(w, property):
        return bool(cfg.is_storage_writer)
    return not getattr(cfg, "is_mla_model", False) or getattr(cfg, "tp_rank", 0) == 0


def version() -> str:
    """The installed SGLang's version."""
    import sglang

    return str(getattr(sglang, "__version__", "?"))


def storage_metrics(prefetch_pgs: list, backup_pgs: list, prefetch_gbps: list, backup_gbps: list):
    """SGLang's ``StorageMetrics`` (what ``get_stats`` returns to its storage metrics
    collector: pages per get and per set call, and their GB/s), or a dict where the release
    has none."""
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except ImportError:
        try:
            from sglang.srt.metrics.collector import StorageMetrics
        except ImportError:
            return {"prefetch_pgs": prefetch_pgs, "backup_pgs": backup_pgs, "prefetch_bandwidth": prefetch_gbps,
                    "backup_bandwidth": backup_gbps}
    m = StorageMetrics()
    m.prefetch_pgs.extend(prefetch_pgs)
    m.backup_pgs.extend(backup_pgs)
    m.prefetch_bandwidth.extend(prefetch_gbps)
    m.backup_bandwidth.extend(backup_gbps)
    return m
