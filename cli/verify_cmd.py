"""``tiercache verify``: check every block file's header, size and checksum."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import Progress

from tiercache.errors import RootError
from tiercache.rootops import is_root, verify_root

from .common import EXIT_FINDING, array_members, fail, not_a_root, resolve_root


def verify(
    root: Annotated[Optional[Path], typer.Option(help="The file-tier root (default: the config's).")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="Take the root from this config.")] = None,
    quarantine: Annotated[
        bool, typer.Option("--quarantine", help="Move bad files to quarantine/ (needs the root free).")
    ] = False,
    threads: Annotated[
        int,
        typer.Option(
            help="Threads submitting chunks of files to the native I/O engine (and its C threads).", min=1, max=256
        ),
    ] = 8,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Check every block file (a regular file, header, name, exact size, XXH3-64 checksum of the
    data). Exit code 1 if any is bad, listing them. Nothing is followed through a symlink;
    with --quarantine bad files move into the root's own quarantine/ (never out of the root).
    A member of a root array: every member is checked, each with its own quarantine/."""
    root = resolve_root(root, config)
    if not root.is_dir():
        fail(f"root {str(root)!r} does not exist or is not a directory")
    if not is_root(root):
        fail(not_a_root(root))
    members = array_members(root)
    reports = [_verify_root(m, quarantine, threads, as_json) for m in members]
    if as_json:
        if len(reports) == 1:
            typer.echo(json.dumps(reports[0], indent=2))
        else:
            typer.echo(json.dumps({"root": str(root), "roots": reports, "checked": sum(r["checked"] for r in reports),
                                   "bad": [b for r in reports for b in r["bad"]]}, indent=2))
    elif len(reports) > 1:
        typer.echo(f"checked {sum(r['checked'] for r in reports)} block file(s) in {len(reports)} roots of the array: "
                   f"{sum(len(r['bad']) for r in reports)} bad")
    if any(r["bad"] for r in reports):
        raise typer.Exit(EXIT_FINDING)


def _verify_root(root: Path, quarantine: bool, threads: int, as_json: bool) -> dict:
    """Verify one root (one member of an array: :func:`tiercache.rootops.verify_root`); prints
    its lines unless ``as_json``; returns its JSON report."""
    try:
        with Progress(transient=True, disable=as_json) as progress:
            task = progress.add_task("verifying", total=None)
            report = verify_root(root, quarantine, threads, on_total=lambda n: progress.update(task, total=n),
                                 on_done=lambda n: progress.advance(task, n))
    except RootError as exc:
        fail(str(exc))
    if not as_json:
        for b in report["bad"]:
            typer.echo(f"BAD {b['problem']}")
        for line in report["not_quarantined"]:
            typer.echo(f"LEFT {line}")
        moved, changed = report["quarantined"], report["changed_while_checked"]
        typer.echo(f"checked {report['checked']} block file(s) in {root}: {len(report['bad'])} bad"
                   + (f", {moved} moved to quarantine/" if moved else "")
                   + (f"; {changed} removed or replaced while checked (not bad)" if changed else ""))
    return report
