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
from tiercache.copypaths import copy_kernel_status
from tiercache.cuda import cuda_status
from tiercache.errors import RootError, TierCacheError
from tiercache.rootops import RootDir, index_summary, member_states, select_io_path, subdir_owner, survey

from .common import DEFAULT_CONFIG, fail, human_bytes, roots_inside


def inspect(
    config: Annotated[
        Optional[Path], typer.Option("--config", "-c", help="TOML config (default: configs/default.toml).")
    ] = None,
    root: Annotated[Optional[Path], typer.Option(help="A file-tier root to look at (overrides the config's).")] = None,
    scan: Annotated[
        bool,
        typer.Option(
            "--scan",
            help="List every block file, however many (default: a root whose saved index holds more than 100000 "
                 "blocks is counted from the index).",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show the pools and their geometry, slots and bytes per tier, the I/O path this machine
    would use and why, and the contents of the file-tier root: block files per pool, bytes,
    temporary leftovers, quarantined and foreign files, the process holding it, and the
    counters the last cache using it saved. A root whose saved index holds more than
    100000 blocks is counted from that index (its blocks as of its last save: quick on tens
    of millions of files) unless --scan. A member of a root array: each member's share too."""
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
    launcher, what = copy_kernel_status()
    out["copy_kernels"] = {"available": launcher is not None, "reason": what}
    if root.exists():
        summary = None if scan else _index_summary(root)
        try:
            sv = survey(root, subdirs=summary is None)
        except OSError as exc:
            fail(f"cannot read {root}: {exc}")
        out["root"] = sv.as_dict()
        if summary is not None:
            _from_index(out["root"], summary)
        if not out["root"]["tiercache_root"]:
            out["root"]["roots_inside"] = [str(p) for p in roots_inside(root)]
        else:
            out["array"] = _array(root)
    else:
        out["root"] = {"root": str(root), "missing": True}
    if as_json:
        typer.echo(json.dumps(out, indent=2, default=str))
        return
    _print(out)


#: a root whose saved index holds more blocks than this is counted from the index (unless --scan)
SCAN_MAX_BLOCKS = 100_000


def _index_summary(root: Path) -> dict | None:
    """The saved index's counts when the root is big enough to use them, else None."""
    try:
        with RootDir(root, check_owner=False) as rd:
            summary = index_summary(rd)
    except (RootError, OSError):
        return None
    return summary if summary is not None and summary["blocks"] > SCAN_MAX_BLOCKS else None


def _array(root: Path) -> list[dict] | None:
    """Per member of ``root``'s root array (None for a plain root): its path, the block
    subdirectories it holds, its blocks and bytes (a survey of each member)."""
    try:
        _, states = member_states(root)
    except RootError:
        return None
    if len(states) == 1:
        return None
    out = []
    for m in states:  # a member that does not prove its membership is not looked into
        row: dict = {"root": str(m.path), "missing": not m.present}
        if m.present:
            sv = survey(m.path).as_dict()
            row.update(subdirs=sum(subdir_owner(m.path).values()), blocks=sv["blocks"],
                       bytes=sv["block_files"]["bytes"], temporary=sv["temporary"]["files"],
                       quarantined=sv["quarantined"]["files"])
        else:
            row.update(state=m.state, why=m.why)
        out.append(row)
    return out


def _from_index(r: dict, summary: dict) -> None:
    """Fill a survey's block counts (of the root's top only) from the index ``summary``."""
    n = summary["blocks"]
    r["pools"] = {name: {"files": n, "bytes": n * size} for name, _, _, size in summary["pools"]}
    r["blocks"] = n
    r["block_files"] = {"files": n * len(summary["pools"]), "bytes": n * sum(p[3] for p in summary["pools"])}
    r["from_index"] = summary


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
    ck = out["copy_kernels"]
    if ck["available"]:
        con.print(f"copy kernels: [bold]{ck['reason']}[/bold]")
    elif ck["reason"] != out["cuda"]:  # CUDA works, the kernels do not (else the line above says why)
        con.print(f"copy kernels: [bold]unavailable[/bold] ({ck['reason']}): no device tier; the vLLM "
                  "connector copies through torch")
    r = out["root"]
    if r.get("missing"):
        con.print(f"root {r['root']}: does not exist yet")
        return
    con.print(
        f"root {r['root']}: "
        f"{'tiercache root' if r['tiercache_root'] else '[red]not a tiercache root (no marker)[/red]'}"
        f"{', in use by pid ' + r['locked_by_pid'] if r['locked_by_pid'] else ', not in use'}"
    )
    if r.get("roots_inside"):
        con.print("tiercache roots inside it (inspect each with --root): " + ", ".join(r["roots_inside"]))
    t = Table(title="file tier contents", title_justify="left")
    for col in ("what", "files", "bytes"):
        t.add_column(col)
    for pool, d in sorted(r["pools"].items()):
        t.add_row(f"pool {pool}", str(d["files"]), human_bytes(d["bytes"]))
    t.add_row("blocks (keys)", str(r["blocks"]), human_bytes(r["block_files"]["bytes"]))
    ix = r.get("from_index")
    if ix:
        t.caption = (f"blocks counted from the saved index, written {time.time() - ix['written']:.0f} s ago "
                     + ("at a clean close" if ix["clean"] else "by a checkpoint or a shared root's cache (blocks "
                                                              "written since are not counted)")
                     + "; temporary files counted at the top only; --scan lists every file")
    t.add_row("temporary leftovers", str(r["temporary"]["files"]), human_bytes(r["temporary"]["bytes"]))
    t.add_row("quarantined", str(r["quarantined"]["files"]), human_bytes(r["quarantined"]["bytes"]))
    t.add_row("foreign", str(len(r["foreign"])), "")
    con.print(t)
    if out.get("array"):
        t = Table(title=f"root array: {len(out['array'])} roots", title_justify="left")
        for col in ("root", "subdirectories", "blocks", "bytes", "temporary", "quarantined"):
            t.add_column(col)
        for m in out["array"]:
            if m["missing"]:
                t.add_row(m["root"], f"[red]{m.get('state', 'missing')}[/red]: {m.get('why', '')}", "", "", "", "")
            else:
                t.add_row(m["root"], str(m["subdirs"]), str(m["blocks"]), human_bytes(m["bytes"]), str(m["temporary"]),
                          str(m["quarantined"]))
        con.print(t)
    st = r.get("live_stats")
    if st:
        age = time.time() - st.get("time", time.time())
        counters = ", ".join(f"{k} {v}" for k, v in sorted(st.get("counters", {}).items()))
        con.print(f"last saved by pid {st.get('pid')} {age:.0f} s ago: {counters or 'no counters'}")
