"""Prometheus metrics of tiercache caches, through ``prometheus-client`` (``pip install
'tiercache[metrics]'``; the rest of the library works without it).

A cache (``[metrics] enabled``, the default) registers itself in ``prometheus_client.REGISTRY``
when it opens, so an engine's own exporter (vLLM, SGLang, a FastAPI ``/metrics`` route) serves
its metrics with no code; :func:`register` puts it in another registry, and
:func:`start_http_server` serves a registry from a process of its own. Several caches in one
registry are told apart by the ``cache`` label (``[metrics] name``).

Nothing is counted at scrape time that the cache did not already count: a scrape reads the
cache's counters and its transfer engine's per-job totals
(:class:`~tiercache.transfer.TransferStats`) without waiting for a running call, and retires
finished jobs first when the engine is free (so a job the caller waited for is counted).
The hot path pays one dictionary update per finished job, never per block or per scrape.

Metrics (every one has the label ``cache``; counters end in ``_total``):

========================================  =========  ===========================================
name                                      labels     meaning
========================================  =========  ===========================================
tiercache_tier_capacity_blocks            tier       blocks the tier can hold
tiercache_tier_blocks                     tier       blocks the tier holds
tiercache_tier_used_bytes                 tier       bytes those blocks take (files: on disk)
tiercache_tier_capacity_bytes             tier       bytes the tier can hold
tiercache_pinned_blocks                              blocks pinned by the caller
tiercache_io_path                         path       1 for the file tier's I/O path (gds,
                                                     compat, posix), 0 for the others
tiercache_file_io_engine                  engine     1 for the engine of the POSIX path
                                                     (io_uring, threads, python), 0 otherwise
tiercache_lookups_total                   tier,      per key looked up, walking down the tiers:
                                          result     ``miss`` at each tier without it, ``hit``
                                                     at the first with it
tiercache_onboards_total                  tier,      the same walk for each key onboarded (from
                                          result     the destination tier down)
tiercache_get_blocks_total                tier       blocks ``get`` read, by the tier read from
tiercache_transferred_blocks_total        src, dst   blocks copied (``caller``: your arrays)
tiercache_transferred_bytes_total         src, dst   bytes copied
tiercache_transfer_failed_blocks_total    src, dst   blocks whose copy failed
tiercache_transfer_seconds                src, dst,  histogram of job latencies (CUDA event
                                          path       time for GPU jobs, wall time of the file
                                                     operations for file jobs)
tiercache_file_io_errors_total            op         failed block-file reads/writes
tiercache_corrupt_blocks_total                       blocks whose file failed to verify
tiercache_quarantined_files_total                    files moved to ``quarantine/``
tiercache_spilled_blocks_total            tier       blocks copied down to make room in tier
tiercache_evicted_blocks_total                       blocks that left the bottom tier
tiercache_blocks_total                    op         put, allocated, offloaded, onboarded,
                                                     flushed blocks
tiercache_streamed_calls_total            call       calls larger than a tier that streamed
                                                     through it (put, offload, onboard)
========================================  =========  ===========================================
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict

from tiercache.errors import ClosedError, ConfigError, MissingDependencyError
from tiercache.transfer import LATENCY_BUCKETS_S

IO_PATHS = ("gds", "compat", "posix")
IO_ENGINE_NAMES = ("io_uring", "threads", "python")
_OPS = ("put", "allocated", "offloaded", "onboarded", "flushed")
_STREAMED = ("put", "offload", "onboard")
_DEFAULT_NAME = "tiercache"


def require_prometheus_client():
    """The ``prometheus_client`` module.

    Raises:
        MissingDependencyError: it is not installed (the message names the extra).
    """
    try:
        import prometheus_client
        import prometheus_client.core
    except ImportError:
        raise MissingDependencyError(
            "tiercache's metrics need prometheus-client, which is not installed: pip install 'tiercache[metrics]'"
        ) from None
    return prometheus_client


# -- families from stats snapshots -----------------------------------------------------------
def families(snapshots: dict[str, dict]) -> list:
    """Prometheus metric families of caches' stats.

    Args:
        snapshots: ``{cache name: TierCache.stats()}`` (a live cache's, or one saved in a
            root, ``.tiercache-root.stats.json``).

    Returns:
        ``prometheus_client`` metric families (the table in this module's docstring).

    Raises:
        MissingDependencyError: prometheus-client is not installed.
    """
    core = require_prometheus_client().core
    G, C, H = core.GaugeMetricFamily, core.CounterMetricFamily, core.HistogramMetricFamily
    fam = {
        "cap_blocks": G("tiercache_tier_capacity_blocks", "Blocks the tier can hold.", labels=["cache", "tier"]),
        "blocks": G("tiercache_tier_blocks", "Blocks the tier holds.", labels=["cache", "tier"]),
        "used": G("tiercache_tier_used_bytes", "Bytes the tier's blocks take (file tier: on disk).",
                  labels=["cache", "tier"]),
        "cap_bytes": G("tiercache_tier_capacity_bytes", "Bytes the tier can hold.", labels=["cache", "tier"]),
        "pinned": G("tiercache_pinned_blocks", "Blocks pinned by the caller.", labels=["cache"]),
        "io_path": G("tiercache_io_path", "1 for the file tier's I/O path (gds, compat, posix), 0 for the others.",
                     labels=["cache", "path"]),
        "io_engine": G("tiercache_file_io_engine", "1 for the engine running the POSIX path's system calls.",
                       labels=["cache", "engine"]),
        "lookups": C("tiercache_lookups", "Keys looked up, per tier walked: miss at each tier without the key, "
                     "hit at the first with it.", labels=["cache", "tier", "result"]),
        "onboards": C("tiercache_onboards", "Keys onboarded, per tier walked from the destination down: miss at "
                      "each tier without the key, hit at the first with it.", labels=["cache", "tier", "result"]),
        "gets": C("tiercache_get_blocks", "Blocks get() read, by the tier read from.", labels=["cache", "tier"]),
        "moved_blocks": C("tiercache_transferred_blocks", "Blocks copied between tiers (caller: your arrays).",
                          labels=["cache", "src", "dst"]),
        "moved_bytes": C("tiercache_transferred_bytes", "Bytes copied between tiers (caller: your arrays).",
                         labels=["cache", "src", "dst"]),
        "failed": C("tiercache_transfer_failed_blocks", "Blocks whose copy failed.", labels=["cache", "src", "dst"]),
        "seconds": H("tiercache_transfer_seconds", "Latency of one transfer job (CUDA event time for GPU jobs, "
                     "wall time of the file operations for file jobs).", labels=["cache", "src", "dst", "path"]),
        "io_errors": C("tiercache_file_io_errors", "Block-file reads or writes that failed.", labels=["cache", "op"]),
        "corrupt": C("tiercache_corrupt_blocks", "Blocks whose file failed to verify.", labels=["cache"]),
        "quarantined": C("tiercache_quarantined_files", "Files moved to quarantine/.", labels=["cache"]),
        "spilled": C("tiercache_spilled_blocks", "Blocks copied down to make room in the tier.",
                     labels=["cache", "tier"]),
        "evicted": C("tiercache_evicted_blocks", "Blocks that left the bottom tier.", labels=["cache"]),
        "ops": C("tiercache_blocks", "Blocks put, allocated, offloaded, onboarded or flushed by the cache's calls.",
                 labels=["cache", "op"]),
        "streamed": C("tiercache_streamed_calls", "Calls larger than a tier that streamed through it.",
                      labels=["cache", "call"]),
    }
    for name, st in snapshots.items():
        _add_cache(fam, name, st)
    return list(fam.values())


def _add_cache(fam: dict, name: str, st: dict) -> None:
    counters = st.get("counters", {})
    order = list(st.get("tiers", {}))
    for tier, t in st.get("tiers", {}).items():
        fam["cap_blocks"].add_metric([name, tier], t["slots"])
        fam["blocks"].add_metric([name, tier], t["used"])
        fam["used"].add_metric([name, tier], t.get("bytes_on_disk", t["bytes_used"]))
        fam["cap_bytes"].add_metric([name, tier], t.get("bytes_capacity_on_disk", t["bytes_capacity"]))
        fam["spilled"].add_metric([name, tier], counters.get(f"spilled_blocks_{tier}", 0))
    fam["pinned"].add_metric([name], st.get("pinned_blocks", 0))
    path = st.get("io_path", {}).get("name")
    for p in IO_PATHS:
        fam["io_path"].add_metric([name, p], 1.0 if p == path else 0.0)
    engine = st.get("tiers", {}).get("file", {}).get("io_engine")
    for e in IO_ENGINE_NAMES:
        fam["io_engine"].add_metric([name, e], 1.0 if e == engine else 0.0)
    walk_tiers = order + [t for t in ("device", "host", "file") if t not in order]
    for what in ("lookup", "onboard"):
        for tier in walk_tiers:
            hits, misses = counters.get(f"{what}_hits_{tier}", 0), counters.get(f"{what}_misses_{tier}", 0)
            if tier in order or hits or misses:
                fam[f"{what}s"].add_metric([name, tier, "hit"], hits)
                fam[f"{what}s"].add_metric([name, tier, "miss"], misses)
    for tier in order:
        fam["gets"].add_metric([name, tier], counters.get(f"get_hits_{tier}", 0))
    _add_transfers(fam, name, st.get("transfers", []), st.get("latency_buckets_s", LATENCY_BUCKETS_S))
    fam["corrupt"].add_metric([name], counters.get("corrupt_blocks", 0))
    fam["quarantined"].add_metric([name], counters.get("quarantined_files", 0))
    fam["evicted"].add_metric([name], counters.get("evicted_blocks", 0))
    for op in _OPS:
        fam["ops"].add_metric([name, op], counters.get(f"{op}_blocks", 0))
    for call in _STREAMED:
        fam["streamed"].add_metric([name, call], counters.get(f"streamed_{call}s", 0))


def _add_transfers(fam: dict, name: str, transfers: list[dict], bounds) -> None:
    per_pair: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    io_errors = {"read": 0, "write": 0}
    for t in transfers:
        pair = per_pair[(t["src"], t["dst"])]
        pair[0] += t["blocks"]
        pair[1] += t["bytes"]
        pair[2] += t["failed_blocks"]
        if t["src"] == "file":
            io_errors["read"] += t["failed_blocks"]
        if t["dst"] == "file":
            io_errors["write"] += t["failed_blocks"]
        cumulative, buckets = 0, []
        for le, n in zip([*map(float, bounds), float("inf")], t["buckets"]):
            cumulative += n
            buckets.append(("+Inf" if le == float("inf") else repr(le), cumulative))
        fam["seconds"].add_metric([name, t["src"], t["dst"], t["path"]], buckets, t["seconds_sum"])
    for (src, dst), (blocks, nbytes, failed) in sorted(per_pair.items()):
        fam["moved_blocks"].add_metric([name, src, dst], blocks)
        fam["moved_bytes"].add_metric([name, src, dst], nbytes)
        fam["failed"].add_metric([name, src, dst], failed)
    for op, n in io_errors.items():
        fam["io_errors"].add_metric([name, op], n)


# -- registration ----------------------------------------------------------------------------
class CacheCollector:
    """A ``prometheus_client`` collector of every cache registered in one registry (one
    collector per registry, so the caches' series share their metric names and differ by the
    ``cache`` label). Holds weak references: a cache that is closed or collected drops out.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._caches: dict[str, weakref.ref] = {}

    def add(self, cache, name: str = "") -> str:
        """Add ``cache`` under ``name`` ("" picks ``tiercache``, ``tiercache-2``, ...); returns the name.

        Raises:
            ConfigError: ``name`` is taken by another open cache of this registry.
        """
        with self._lock:
            self._prune()
            if name:
                other = self._caches.get(name)
                if other is not None and other() is not cache:
                    raise ConfigError(f"metrics_name = {name!r} is already used by another open cache in this "
                                      "registry; give each cache its own [metrics] name")
            else:
                n = 1
                name = _DEFAULT_NAME
                while name in self._caches and self._caches[name]() is not cache:
                    n += 1
                    name = f"{_DEFAULT_NAME}-{n}"
            self._caches[name] = weakref.ref(cache)
            return name

    def remove(self, cache) -> bool:
        """Drop ``cache``; True if it was here."""
        with self._lock:
            names = [n for n, ref in self._caches.items() if ref() is cache]
            for n in names:
                del self._caches[n]
            return bool(names)

    def names(self) -> list[str]:
        """Names of the caches this collector exports."""
        with self._lock:
            self._prune()
            return sorted(self._caches)

    def _prune(self) -> None:
        for n in [n for n, ref in self._caches.items() if ref() is None or ref().closed]:
            del self._caches[n]

    def describe(self) -> list:
        # no fixed series: the registry then does not call collect() at registration
        return []

    def collect(self):
        with self._lock:
            self._prune()
            caches = [(n, ref()) for n, ref in self._caches.items()]
        snaps = {}
        for name, cache in caches:
            if cache is None:
                continue
            try:
                snaps[name] = cache.stats(block=False)
            except (ClosedError, KeyError):  # closed meanwhile (its tiers gone): its series end
                continue
        yield from families(snaps)


_collectors: dict[int, tuple[object, CacheCollector]] = {}
_collectors_lock = threading.Lock()


def _collector_for(registry) -> CacheCollector:
    with _collectors_lock:
        entry = _collectors.get(id(registry))
        if entry is None or entry[0] is not registry:
            collector = CacheCollector()
            registry.register(collector)
            entry = _collectors[id(registry)] = (registry, collector)
        return entry[1]


def register(cache, registry=None, name: str | None = None) -> str:
    """Export ``cache``'s metrics from ``registry`` (default: ``prometheus_client.REGISTRY``).

    Args:
        cache: a :class:`~tiercache.TierCache`.
        registry: a ``prometheus_client.CollectorRegistry``.
        name: its ``cache`` label (default: ``cache.config.metrics_name``, else
            ``tiercache``, ``tiercache-2``, ... as free in that registry).

    Returns:
        The ``cache`` label given (also ``cache.metrics_name`` when it had none, so the stats it
        saves in its root carry it).

    Raises:
        MissingDependencyError: prometheus-client is not installed.
        ConfigError: ``name`` is already used in that registry by another open cache.
    """
    prom = require_prometheus_client()
    reg = prom.REGISTRY if registry is None else registry
    given = _collector_for(reg).add(cache, cache.config.metrics_name if name is None else name)
    if cache.metrics_name is None:
        cache.metrics_name = given
    return given


def unregister(cache) -> None:
    """Stop exporting ``cache`` from every registry (done by ``close()``)."""
    with _collectors_lock:
        collectors = [c for _, c in _collectors.values()]
    for c in collectors:
        c.remove(cache)


def register_default(cache) -> str | None:
    """What a cache does when it opens: with ``[metrics] enabled`` and ``registry = "default"``,
    :func:`register` in ``prometheus_client.REGISTRY`` if prometheus-client is installed.
    Returns the ``cache`` label, or None when nothing was registered."""
    cfg = cache.config
    if not cfg.metrics or cfg.metrics_registry != "default":
        return None
    try:
        return register(cache)
    except MissingDependencyError:
        return None


def start_http_server(port: int, addr: str = "127.0.0.1", registry=None):
    """Serve ``registry`` (default: ``prometheus_client.REGISTRY``) at
    ``http://addr:port/metrics`` from a daemon thread (prometheus-client's own server), for a
    process without an exporter of its own.

    Args:
        port: TCP port, 0..65535 (0: a free one; read it from ``server.server_port``).
        addr: the address to bind; the default keeps it on this machine.

    Returns:
        ``(server, thread)``; ``server.shutdown()`` stops it.

    Raises:
        MissingDependencyError: prometheus-client is not installed.
        ConfigError: ``port`` outside 0..65535. OSError: the port cannot be bound.
    """
    prom = require_prometheus_client()
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"port = {port!r} must be an integer in [0, 65535]")
    return prom.start_http_server(port, addr=addr, registry=prom.REGISTRY if registry is None else registry)
