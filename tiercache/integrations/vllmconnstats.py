"""The vLLM connector's counters in vLLM's own channels.

Each worker of :class:`~tiercache.integrations.vllmconnector.TierCacheConnector` reports, every
step that changed them, the deltas of the counters below (``get_kv_connector_stats``); vLLM sums
the ranks' reports (:meth:`TierCacheConnectorStats.aggregate`), logs them in its periodic "KV
Transfer metrics" line (:meth:`TierCacheConnectorStats.reduce`), and adds them to Prometheus
counters on its ``/metrics``: ``vllm:tiercache_connector_<name>_total`` with vLLM's engine labels
(:class:`TierCacheConnectorPromMetrics`). Blocks are summed over tensor-parallel ranks (each rank
holds its part of a block).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

#: the exported counters: name -> (the worker's counter it comes from, its divisor to the
#: unit, the documentation)
COUNTERS: dict[str, tuple[str, float, str]] = {
    "loaded_blocks": ("loaded_blocks", 1, "blocks loaded from files into vLLM's KV cache (summed over ranks)"),
    "load_error_blocks": ("load_error_blocks", 1, "blocks whose file was missing, truncated or failed its "
                          "checksum: reported to vLLM, which recomputed them (summed over ranks)"),
    "load_calls": ("load_calls", 1, "steps in which a worker loaded blocks (summed over ranks)"),
    "load_seconds": ("load_us", 1e6, "seconds the engine's thread spent loading (summed over ranks)"),
    "stored_blocks": ("stored_blocks", 1, "blocks written to files (summed over ranks)"),
    "stores_skipped_blocks": ("stores_skipped_blocks", 1, "blocks not stored because the writes fell behind or "
                              "a finished request's gathers found no staging slab (summed over ranks)"),
    "store_failed_blocks": ("store_failed_blocks", 1, "blocks whose file write failed (summed over ranks)"),
    "gpu_checked_blocks": ("gpu_checked_blocks", 1, "loaded blocks whose checksums the GPU compared "
                           "(summed over ranks)"),
}


def deltas(counters: dict[str, int], last: dict[str, int]) -> dict[str, float]:
    """The exported counters' growth since ``last`` (a worker's counters as this function last
    saw them; updated in place), in their units; only those that grew."""
    out: dict[str, float] = {}
    for name, (src, div, _) in COUNTERS.items():
        now = counters.get(src, 0)
        if now != last.get(src, 0):
            out[name] = (now - last.get(src, 0)) / div if div != 1 else now - last.get(src, 0)
            last[src] = now
    return out


class TierCacheConnectorStats(KVConnectorStats):
    """Counter deltas (``data``: name -> amount, names of :data:`COUNTERS`), summed when vLLM
    aggregates the ranks' or the steps' reports."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for k, v in (other.data or {}).items():
            merged[k] = merged.get(k, 0) + v
        return TierCacheConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class TierCacheConnectorPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per :data:`COUNTERS` entry, ``vllm:tiercache_connector_<name>``
    (``_total`` appended by the client), one labelled child per engine."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.children: dict[tuple[int, str], Any] = {}
        for name, (_, _, doc) in COUNTERS.items():
            counter = self._counter_cls(name=f"vllm:tiercache_connector_{name}", documentation=doc,
                                        labelnames=labelnames)
            for idx, values in per_engine_labelvalues.items():
                self.children[(idx, name)] = counter.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, amount in transfer_stats_data.items():
            child = self.children.get((engine_idx, name))
            if child is not None and amount:
                child.inc(amount)


__all__ = ["COUNTERS", "TierCacheConnectorPromMetrics", "TierCacheConnectorStats", "deltas"]
