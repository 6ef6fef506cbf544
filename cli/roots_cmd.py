"""``tiercache roots``: show a root array, add roots to it, take roots out of it.

A root array (``[file] roots = [...]``, one root per device) places each block by a hash of its
key; which member holds which of the 64 block subdirectories is recorded in every member.
Changing the members moves blocks, so it is a command of its own, run while no cache has the
roots open: ``add`` moves an even share of the blocks onto the new roots, ``remove`` moves a
member's blocks to the others (``--forget``: a member whose device is gone, its blocks lost).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import Progress

from tiercache.errors import RootError
from tiercache.rootops import is_root, member_states, reshape, subdir_owner, survey

from .common import EXIT_FINDING, fail, human_bytes, not_a_root

roots_app = typer.Typer(help="Root arrays: several roots (one per device) as one file tier.", no_args_is_help=True)


def _current(roots: list[Path], forget: Sequence[Path] = ()) -> list[Path]:
    """The members to work on: those given, or (one given) every member its record names that
    proves its membership by its own record (members that are missing are left to the change,
    which says whether it needs them); a member that does not prove it stops the command."""
    if len(roots) != 1:
        return roots
    try:
        _, states = member_states(roots[0])
    except RootError as exc:
        fail(str(exc))
    gone = {os.path.realpath(p) for p in forget}
    bad = [s for s in states if s.state == "unproven" and os.path.realpath(s.path) not in gone]
    if bad:
        fail(f"the record of {str(roots[0])!r} names member(s) that do not prove their membership: "
             + "; ".join(f"{s.path} ({s.why})" for s in bad)
             + ". Nothing was changed: give the members' paths yourself")
    return [s.path for s in states if s.present and os.path.realpath(s.path) not in gone]


def _root_or_fail(root: Path) -> None:
    if not root.is_dir():
        fail(f"root {str(root)!r} does not exist or is not a directory")
    if not is_root(root):
        fail(not_a_root(root))


@roots_app.command("show")
def show(
    root: Annotated[Path, typer.Argument(help="A root, or any member of a root array.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The array's members (the home first), the block subdirectories each holds, and their
    blocks; a member that is missing, or whose own record does not name the array, is shown as
    such and not looked into."""
    _root_or_fail(root)
    try:
        rec, states = member_states(root)
    except RootError as exc:
        fail(str(exc))
    rows = []
    for m in states:
        row: dict = {"root": str(m.path), "present": m.present, "state": m.state}
        if m.why:
            row["why"] = m.why
        if m.leaving:
            row["leaving"] = True
        if m.present:
            sv = survey(m.path).as_dict()
            row.update(
                subdirs=sum(subdir_owner(m.path).values()), blocks=sv["blocks"], bytes=sv["block_files"]["bytes"]
            )
        rows.append(row)
    out = {"array": rec.array_id if rec else None, "generation": rec.generation if rec else None,
           "changing": bool(rec and rec.moving), "members": rows}
    if as_json:
        typer.echo(json.dumps(out, indent=2))
    else:
        _print_show(out, rec is not None)
    if any(not r["present"] for r in rows):
        raise typer.Exit(EXIT_FINDING)


def _print_show(out: dict, array: bool) -> None:
    rows = out["members"]
    typer.echo(f"{'root array ' + out['array'][:12] if array else 'plain root'}: {len(rows)} root(s)"
               + (" (a change of members was interrupted: run it again to finish it)" if out["changing"] else ""))
    for r in rows:
        if r["present"]:
            typer.echo(f"  {r['root']}: {r['subdirs']} subdirectories, {r['blocks']} blocks, {human_bytes(r['bytes'])}"
                       + (" (leaving)" if r.get("leaving") else ""))
        else:
            typer.echo(f"  {r['root']}: {r['state'].upper()} ({r['why']})")


def _run(roots: list[Path], add=(), drop=(), forget=(), check_owner: bool = True) -> None:
    with Progress(transient=True) as progress:
        task = progress.add_task("moving block files", total=None)
        try:
            res = reshape(roots, add=add, drop=drop, forget=forget, check_owner=check_owner,
                          progress=lambda n: progress.update(task, completed=n))
        except RootError as exc:
            fail(str(exc))
    if res.finished:
        typer.echo("finished a change of members that had been interrupted")
    for note in res.already:
        typer.echo(f"already so: {note}")
    typer.echo(f"roots before: {', '.join(res.before)}")
    typer.echo(f"roots now:    {', '.join(res.after)}")
    typer.echo(
        f"moved {res.files_moved} file(s), {human_bytes(res.bytes_moved)}, in {res.subdirs_moved} "
        "subdirectories" + (f"; forgotten (their blocks lost): {', '.join(res.forgotten)}" if res.forgotten else "")
    )


@roots_app.command("add")
def add(
    roots: Annotated[
        list[Path],
        typer.Argument(
            help="The array's members (or one of them: the rest as its record names them), or one plain root to "
                 "make an array of."
        ),
    ],
    new: Annotated[
        list[Path], typer.Option("--new", help="A new root (an empty or new directory, on its own device); repeatable.")
    ],
    check_owner: Annotated[bool, typer.Option(help="Refuse roots another user owns or others may write.")] = True,
) -> None:
    """Add roots: each new root gets an even share of the 64 block subdirectories, and the
    blocks in them move there (a rename, or a flushed copy then the source's unlink). A new
    root must be an existing directory (empty, or a root of tiercache's without blocks): make
    it first, on its own device. Needs every root free (no cache open); an interrupted run is
    finished by running it again."""
    absent = [str(p) for p in new if not p.is_dir()]
    if absent:
        fail(f"new root(s) {', '.join(absent)} do not exist or are not directories: make each (mkdir, on its own "
             "device) and run the command again; nothing was changed")
    _run(_current(roots), add=new, check_owner=check_owner)


@roots_app.command("remove")
def remove(
    roots: Annotated[list[Path], typer.Argument(help="The array's members (or one of them).")],
    drop: Annotated[
        Optional[list[Path]],
        typer.Option("--drop", help="A member to take out; its blocks move to the others; repeatable."),
    ] = None,
    forget: Annotated[
        Optional[list[Path]],
        typer.Option(
            "--forget", help="A member whose device is gone: taken out WITHOUT its blocks (they are lost); repeatable."
        ),
    ] = None,
    check_owner: Annotated[bool, typer.Option(help="Refuse roots another user owns or others may write.")] = True,
) -> None:
    """Take members out of a root array: the blocks of a --drop member move to the remaining
    members; a --forget member (its device gone) is dropped with its blocks. Needs every root
    free; an interrupted run is finished by running it again."""
    if not drop and not forget:
        fail("name the members to take out with --drop (blocks move) or --forget (device gone, blocks lost)")
    gone = {os.path.realpath(f) for f in forget or ()}
    given = [r for r in roots if os.path.realpath(r) not in gone]
    if not given:
        fail("name at least one member that stays in the array")
    _run(_current(given, forget or ()), drop=drop or (), forget=forget or (), check_owner=check_owner)
