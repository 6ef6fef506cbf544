"""``tiercache roots``: show a root array, add roots to it, take roots out of it.

A root array (``[file] roots = [...]``, one root per device) places each block by a hash of its
key; which member holds which of the 64 block subdirectories is recorded in every member.
Changing the members moves blocks, so it is a command of its own, run while no cache has the
roots open: ``add`` moves an even share of the blocks onto the new roots, ``remove`` moves a
member's blocks to the others (``--forget``: a member whose device is gone, its blocks lost).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import Progress

from tiercache.errors import RootError
from tiercache.files import members_of, record_of, reshape, subdir_owner
from tiercache.rootops import survey

from .common import fail, human_bytes

roots_app = typer.Typer(help="Root arrays: several roots (one per device) as one file tier.", no_args_is_help=True)


def _current(roots: list[Path]) -> list[Path]:
    """The members to work on: those given, or (one given) every member its record names."""
    if len(roots) == 1:
        try:
            return members_of(roots[0])
        except RootError as exc:
            fail(str(exc))
    return roots


@roots_app.command("show")
def show(
    root: Annotated[Path, typer.Argument(help="A root, or any member of a root array.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The array's members (the home first), the block subdirectories each holds, and their blocks."""
    try:
        members = members_of(root)
        rec = record_of(root)
    except RootError as exc:
        fail(str(exc))
    rows = []
    for m in members:
        row: dict = {"root": str(m), "present": m.is_dir()}
        if row["present"]:
            sv = survey(m).as_dict()
            row.update(subdirs=sum(subdir_owner(m).values()), blocks=sv["blocks"], bytes=sv["block_files"]["bytes"])
        rows.append(row)
    out = {"array": rec.array_id if rec else None, "generation": rec.generation if rec else None,
           "changing": bool(rec and rec.moving), "members": rows}
    if as_json:
        typer.echo(json.dumps(out, indent=2))
        return
    typer.echo(f"{'root array ' + out['array'][:12] if rec else 'plain root'}: {len(rows)} root(s)"
               + (" (a change of members was interrupted: run it again to finish it)" if out["changing"] else ""))
    for r in rows:
        if not r["present"]:
            typer.echo(f"  {r['root']}: MISSING")
        else:
            typer.echo(f"  {r['root']}: {r['subdirs']} subdirectories, {r['blocks']} blocks, {human_bytes(r['bytes'])}")


def _run(roots: list[Path], add=(), drop=(), forget=(), check_owner: bool = True) -> None:
    with Progress(transient=True) as progress:
        task = progress.add_task("moving block files", total=None)
        try:
            res = reshape(roots, add=add, drop=drop, forget=forget, check_owner=check_owner,
                          progress=lambda n: progress.update(task, completed=n))
        except (RootError, OSError) as exc:
            fail(str(exc))
    typer.echo(f"roots before: {', '.join(res.before)}")
    typer.echo(f"roots now:    {', '.join(res.after)}")
    typer.echo(f"moved {res.files_moved} file(s), {human_bytes(res.bytes_moved)}, in {res.subdirs_moved} "
               "subdirectories" + (f"; forgotten (their blocks lost): {', '.join(res.forgotten)}" if res.forgotten else ""))


@roots_app.command("add")
def add(
    roots: Annotated[list[Path], typer.Argument(help="The array's members (or one of them: the rest as its record names them), or one plain root to make an array of.")],
    new: Annotated[list[Path], typer.Option("--new", help="A new root (an empty or new directory, on its own device); repeatable.")],
    check_owner: Annotated[bool, typer.Option(help="Refuse roots another user owns or others may write.")] = True,
) -> None:
    """Add roots: each new root gets an even share of the 64 block subdirectories, and the
    blocks in them move there (a rename, or a flushed copy then the source's unlink). Needs
    every root free (no cache open); an interrupted run is finished by running it again."""
    _run(_current(roots), add=new, check_owner=check_owner)


@roots_app.command("remove")
def remove(
    roots: Annotated[list[Path], typer.Argument(help="The array's members (or one of them).")],
    drop: Annotated[Optional[list[Path]], typer.Option("--drop", help="A member to take out; its blocks move to the others; repeatable.")] = None,
    forget: Annotated[Optional[list[Path]], typer.Option("--forget", help="A member whose device is gone: taken out WITHOUT its blocks (they are lost); repeatable.")] = None,
    check_owner: Annotated[bool, typer.Option(help="Refuse roots another user owns or others may write.")] = True,
) -> None:
    """Take members out of a root array: the blocks of a --drop member move to the remaining
    members; a --forget member (its device gone) is dropped with its blocks. Needs every root
    free; an interrupted run is finished by running it again."""
    if not drop and not forget:
        fail("name the members to take out with --drop (blocks move) or --forget (device gone, blocks lost)")
    given = [r for r in roots if str(r) not in {str(f) for f in forget or ()}]
    current = _current(given) if given else []
    current = [m for m in current if str(m) not in {str(f) for f in forget or ()}]
    _run(current, drop=drop or (), forget=forget or (), check_owner=check_owner)
