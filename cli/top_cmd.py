"""``tiercache top``: a live view of running caches, from their Prometheus exporter or from the
stats a cache saves in its root.

Both sources become the same metric families (:func:`tiercache.metrics.families` for a saved
snapshot, ``prometheus_client.parser`` for an exporter's text), and a frame is computed from
those alone: per tier occupancy and hit rates, per direction blocks, bytes, bandwidth since the
previous frame and job-latency percentiles (interpolated inside the histogram's buckets, as
Prometheus' ``histogram_quantile`` does), and the error counters.
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tiercache.errors import MissingDependencyError
from tiercache.metrics import require_prometheus_client

from .common import fail, human_bytes

TIER_ORDER = ("device", "host", "file")


# -- sources -----------------------------------------------------------------------------------
def scrape_url(url: str, timeout: float = 5.0) -> list:
    """Metric families from an exporter's ``/metrics`` text.

    Raises:
        OSError: the address cannot be read. ValueError: the text is not Prometheus' format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode("utf-8", "replace")
    return list(text_string_to_metric_families(text))


def read_root(root: Path) -> tuple[list, float | None]:
    """Metric families of the stats a cache last saved in ``root`` (a root array's: in its home),
    and their age (seconds).

    Raises:
        OSError: the root cannot be read. LookupError: no cache has saved stats there.
    """
    from tiercache.errors import RootError
    from tiercache.metrics import families
    from tiercache.rootops import members_of, survey

    if not os.path.isdir(root):
        raise LookupError("no such directory")
    try:  # a root array's cache saves its stats in the array's home (its first member)
        root = members_of(root)[0]
    except RootError:
        pass
    sv = survey(root)
    st = sv.stats
    if not st:
        raise LookupError("no cache has saved its stats here yet (a cache saves them every "
                          "[metrics] snapshot_interval_s, on flush and on close)")
    name = st.get("metrics_name") or f"pid {st.get('pid', '?')}"
    age = time.time() - st["time"] if "time" in st else None
    return families({name: st}), age


# -- frames ------------------------------------------------------------------------------------
def _samples(fams) -> dict[str, list[tuple[dict, float]]]:
    out: dict[str, list[tuple[dict, float]]] = {}
    for fam in fams:
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile (0..1) of a cumulative histogram ``[(le, count)]`` sorted by ``le``
    (the last ``le`` is +Inf), interpolated linearly inside the bucket it falls in, as
    Prometheus' ``histogram_quantile``; None with no observations. Falls in the +Inf bucket:
    the largest finite bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if math.isinf(le):
                return prev_le
            if n == prev_n:
                return le
            return prev_le + (le - prev_le) * (rank - prev_n) / (n - prev_n)
        prev_le, prev_n = le, n
    return prev_le


def frame(fams) -> dict[str, dict]:
    """One frame: ``{cache: {"tiers": {...}, "transfers": {"src->dst": {...}}, ...}}``."""
    sm = _samples(fams)
    caches: dict[str, dict] = {}

    def cache(labels: dict) -> dict:
        return caches.setdefault(labels.get("cache", "?"), {
            "tiers": {}, "transfers": {}, "io_path": None, "io_engine": None, "errors": {}})

    for metric, key in (("tiercache_tier_blocks", "blocks"), ("tiercache_tier_capacity_blocks", "capacity_blocks"),
                        ("tiercache_tier_used_bytes", "used_bytes"),
                        ("tiercache_tier_capacity_bytes", "capacity_bytes"),
                        ("tiercache_spilled_blocks_total", "spilled")):
        for labels, v in sm.get(metric, []):
            cache(labels)["tiers"].setdefault(labels["tier"], {})[key] = int(v)
    for what in ("lookups", "onboards"):
        for labels, v in sm.get(f"tiercache_{what}_total", []):
            t = cache(labels)["tiers"].setdefault(labels["tier"], {})
            t[f"{what}_{labels['result']}"] = int(v)
    for labels, v in sm.get("tiercache_io_path", []):
        if v:
            cache(labels)["io_path"] = labels["path"]
    for labels, v in sm.get("tiercache_file_io_engine", []):
        if v:
            cache(labels)["io_engine"] = labels["engine"]
    for metric, key in (
        ("tiercache_transferred_blocks_total", "blocks"),
        ("tiercache_transferred_bytes_total", "bytes"),
        ("tiercache_transfer_failed_blocks_total", "failed"),
    ):
        for labels, v in sm.get(metric, []):
            cache(labels)["transfers"].setdefault(f"{labels['src']}->{labels['dst']}", {})[key] = int(v)
    hist: dict[tuple[str, str], dict[float, float]] = {}
    for labels, v in sm.get("tiercache_transfer_seconds_bucket", []):
        k = (labels.get("cache", "?"), f"{labels['src']}->{labels['dst']}")
        le = float(labels["le"])
        hist.setdefault(k, {})
        hist[k][le] = hist[k].get(le, 0.0) + v  # summed over copy paths
    for (name, pair), by_le in hist.items():
        buckets = sorted(by_le.items())
        t = caches[name]["transfers"].setdefault(pair, {})
        t["jobs"] = int(buckets[-1][1])
        t["p50_s"], t["p99_s"] = quantile(0.5, buckets), quantile(0.99, buckets)
    for metric, key in (("tiercache_corrupt_blocks_total", "corrupt_blocks"),
                        ("tiercache_quarantined_files_total", "quarantined_files"),
                        ("tiercache_evicted_blocks_total", "evicted_blocks")):
        for labels, v in sm.get(metric, []):
            cache(labels)["errors"][key] = int(v)
    for labels, v in sm.get("tiercache_file_io_errors_total", []):
        cache(labels)["errors"][f"file_{labels['op']}_errors"] = int(v)
    for c in caches.values():
        for t in c["tiers"].values():
            for what in ("lookups", "onboards"):
                hit, miss = t.get(f"{what}_hit", 0), t.get(f"{what}_miss", 0)
                t[f"{what}_hit_rate"] = hit / (hit + miss) if hit + miss else None
    return caches


def add_rates(cur: dict, prev: dict | None, seconds: float) -> None:
    """Bytes per second of each direction since the previous frame (``gbps``; None on the first)."""
    for name, c in cur.items():
        for pair, t in c["transfers"].items():
            old = (prev or {}).get(name, {}).get("transfers", {}).get(pair)
            t["gbps"] = (
                None if old is None or seconds <= 0 else (t.get("bytes", 0) - old.get("bytes", 0)) / seconds / 1e9
            )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.3f}"


def render(view: dict[str, dict], source: str, note: str = "") -> Group:
    """A frame as rich tables, one set per cache."""
    parts = [Text(f"tiercache top: {source}{note}", style="bold")]
    if not view:
        parts.append(Text("no tiercache metrics there (no cache registered?)"))
    for name, c in sorted(view.items()):
        parts.append(Text(f"cache {name}: I/O path {c['io_path'] or '-'}, POSIX engine {c['io_engine'] or '-'}"))
        t = Table(title=f"{name}: tiers", title_justify="left")
        for col in ("tier", "blocks", "capacity", "bytes", "capacity bytes", "lookup hits", "onboard hits", "spilled"):
            t.add_column(col, justify="left" if col == "tier" else "right")
        for tier in sorted(c["tiers"], key=lambda x: TIER_ORDER.index(x) if x in TIER_ORDER else 9):
            d = c["tiers"][tier]
            if "blocks" not in d:
                continue
            t.add_row(tier, str(d["blocks"]), str(d.get("capacity_blocks", "-")), human_bytes(d.get("used_bytes", 0)),
                      human_bytes(d.get("capacity_bytes", 0)), _pct(d.get("lookups_hit_rate")),
                      _pct(d.get("onboards_hit_rate")), str(d.get("spilled", 0)))
        parts.append(t)
        t = Table(title=f"{name}: transfers", title_justify="left")
        for col in ("direction", "blocks", "bytes", "GB/s", "jobs", "p50 ms", "p99 ms", "failed"):
            t.add_column(col, justify="left" if col == "direction" else "right")
        for pair, d in sorted(c["transfers"].items()):
            gbps = d.get("gbps")
            t.add_row(pair, str(d.get("blocks", 0)), human_bytes(d.get("bytes", 0)),
                      "-" if gbps is None else f"{gbps:.2f}", str(d.get("jobs", 0)), _ms(d.get("p50_s")),
                      _ms(d.get("p99_s")), str(d.get("failed", 0)))
        parts.append(t)
        errs = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sorted(c["errors"].items()))
        parts.append(Text(f"{name}: {errs}"))
    return Group(*parts)


def top(
    url: Annotated[
        Optional[str], typer.Option("--url", help="A cache's exporter: http://HOST:PORT/metrics (default 127.0.0.1).")
    ] = None,
    root: Annotated[
        Optional[Path], typer.Option("--root", help="A file-tier root: the stats its cache saves there.")
    ] = None,
    interval: Annotated[
        float, typer.Option("--interval", "-n", help="Seconds between frames.", min=0.1, max=3600)
    ] = 2.0,
    frames: Annotated[int, typer.Option("--frames", help="Frames to show, then exit (0: until Ctrl-C).", min=0)] = 0,
    cache: Annotated[Optional[str], typer.Option("--cache", help="Only the cache with this label.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line per frame instead of tables.")] = False,
) -> None:
    """A live view of running caches: per tier blocks, bytes and hit rates, per direction
    blocks, bytes, GB/s since the last frame and p50/p99 job latency, and the error counters.
    Reads a Prometheus exporter (--url, needs prometheus-client) or the stats a cache saves in
    its root every few seconds (--root)."""
    if (url is None) == (root is None):
        fail("give either --url (a cache's metrics exporter) or --root (a file-tier root)")
    try:
        require_prometheus_client()
    except MissingDependencyError as exc:
        fail(str(exc))
    if url is not None and "://" not in url:
        url = f"http://{url}"
    if url is not None:
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018 - a bad port raises here
        except ValueError as exc:
            fail(f"--url {url!r} is not a URL ({exc}); give http://HOST:PORT/metrics")
        if parts.path in ("", "/"):
            url = url.rstrip("/") + "/metrics"
    source = url or str(root)

    def read() -> tuple[dict, str]:
        note = ""
        try:
            if url is not None:
                fams = scrape_url(url)
            else:
                fams, age = read_root(root)
                note = "" if age is None else f" (saved {age:.0f} s ago)"
        except urllib.error.URLError as exc:
            fail(f"cannot read {source}: {exc.reason}")
        except OSError as exc:
            fail(f"cannot read {source}: {exc.strerror or exc}")
        except (LookupError, ValueError) as exc:
            fail(f"{source}: {exc}")
        view = frame(fams)
        if cache is not None:
            view = {k: v for k, v in view.items() if k == cache}
        return view, note

    con = Console()
    if not con.is_terminal:
        con = Console(width=max(con.width, 120))
    prev, prev_t, shown = None, 0.0, 0
    live = None
    if con.is_terminal and not as_json and frames != 1:
        live = Live(console=con, auto_refresh=False, screen=False)
        live.start()
    try:
        while True:
            view, note = read()
            now = time.monotonic()
            add_rates(view, prev, now - prev_t)
            prev, prev_t = view, now
            shown += 1
            if as_json:
                typer.echo(json.dumps({"source": source, "time": time.time(), "caches": view}))
            elif live is not None:
                live.update(render(view, source, note), refresh=True)
            else:
                con.print(render(view, source, note))
            if frames and shown >= frames:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        return
    finally:
        if live is not None:
            live.stop()
