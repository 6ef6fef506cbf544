"""``tiercache inspect``: pools, tiers, the I/O path this machine would take, and what a root holds."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from tiercache.config import load_config
from tiercache.cuda import cuda_status
from tiercache.errors import TierCacheError
from tiercache.files import select_io_path, survey

from .common import DEFAULT_CONFIG, fail, human_bytes, roots_inside


def inspect(
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="TOML config (default: configs/default.toml).")] = None,
    root: Annotated[Optional[Path], typer.Option(help="A file-tier root to look at (overrides the config's).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show the pools and their geometry, slots and bytes per tier, the I/O path this machine
    would use and why, and the contents of the file-tier root: block files per pool, bytes,
    temporary leftovers, quarantined and foreign files, the process holding it, and the
    counters the last cache using it saved."""
    cfg = None
    if config is not None or root is None:
        try:
            cfg = load_config(config or DEFAULT_CONFIG, root=root)
        except TierCacheError as exc:
            fail(str(exc))
    root = root or cfg.root
    out: dict = {}
    if cfg is not None:
        out["config"] = cfg.describe()
        try:
            path = select_io_path(cfg.io_mode)
            out["io_path"] = {"name": path.name, "label": path.label, "reason": path.reason}
        except TierCacheError as exc:
            out["io_path"] = {"name": None, "label": "unavailable", "reason": str(exc)}
    out["cuda"] = cuda_status().reason
    if root.exists():
        try:
            sv = survey(root)
        except OSError as exc:
            fail(f"cannot read {root}: {exc}")
        out["root"] = sv.as_dict()
        if not out["root"]["tiercache_root"]:
            out["root"]["roots_inside"] = [str(p) for p in roots_inside(root)]
    else:
        out["root"] = {"root": str(root), "missing": True}
    if as_json:
        typer.echo(json.dumps(out, indent=2, default=str))
        return
    _print(out)


def _print(out: dict) -> None:
    con = Console()
    if "config" in out:
        c = out["config"]
        t = Table(title="pools", title_justify="left")
        for col in ("pool", "block shape", "dtype", "bytes/block", "layout"):
            t.add_column(col)
        for p in c["pools"]:
            t.add_row(p["name"], str(p["block_shape"]), p["dtype"], human_bytes(p["block_nbytes"]), str(p["layout"]))
        con.print(t)
        t = Table(title="tiers (configured)", title_justify="left")
        for col in ("tier", "slots", "capacity"):
            t.add_column(col)
        for name in ("device", "host", "file"):
            n = c[f"{name}_slots"]
            t.add_row(name, str(n), human_bytes(n * c["block_nbytes"]))
        con.print(t)
        io = out["io_path"]
        con.print(f"I/O path here: [bold]{io['label']}[/bold] ({io['reason']})")
    con.print(f"CUDA: {out['cuda']}")
    r = out["root"]
    if r.get("missing"):
        con.print(f"root {r['root']}: does not exist yet")
        return
    con.print(f"root {r['root']}: {'tiercache root' if r['tiercache_root'] else '[red]not a tiercache root (no marker)[/red]'}"
              f"{', in use by pid ' + r['locked_by_pid'] if r['locked_by_pid'] else ', not in use'}")
    if r.get("roots_inside"):
        con.print("tiercache roots inside it (inspect each with --root): " + ", ".join(r["roots_inside"]))
    t = Table(title="file tier contents", title_justify="left")
    for col in ("what", "files", "bytes"):
        t.add_column(col)
    for pool, d in sorted(r["pools"].items()):
        t.add_row(f"pool {pool}", str(d["files"]), human_bytes(d["bytes"]))
    t.add_row("blocks (keys)", str(r["blocks"]), human_bytes(r["block_files"]["bytes"]))
    t.add_row("temporary leftovers", str(r["temporary"]["files"]), human_bytes(r["temporary"]["bytes"]))
    t.add_row("quarantined", str(r["quarantined"]["files"]), human_bytes(r["quarantined"]["bytes"]))
    t.add_row("foreign", str(len(r["foreign"])), "")
    con.print(t)
    st = r.get("live_stats")
    if st:
        age = time.time() - st.get("time", time.time())
        counters = ", ".join(f"{k} {v}" for k, v in sorted(st.get("counters", {}).items()))
        con.print(f"last saved by pid {st.get('pid')} {age:.0f} s ago: {counters or 'no counters'}")
