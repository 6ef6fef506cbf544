"""``tiercache purge``: delete files tiercache wrote under a root, and nothing else.

What is ours: block files under their canonical names whose header is tiercache's and names the
same key and pool (corrupt data included), tiercache's temporary files, and regular files in a
real ``quarantine/`` directory. Deletion goes through the root's directory descriptor and never
follows a symlink; the root's lock is held for the whole purge, so no cache opens it meanwhile.
Those rules live in :mod:`tiercache.rootops.purge`; this command parses, asks and prints.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import Progress

from tiercache.errors import InvalidKeyError, RootError
from tiercache.geometry import POOL_NAME_RE
from tiercache.keys import key_from_text
from tiercache.rootops import Selection, execute_plan, is_root, locked_for_purge, plan_purge, purge_now

from .common import array_members, fail, human_bytes, not_a_root, parse_duration, resolve_root

#: purge's default threads: a million files purged in 34.7 s on 8 threads, 29.6 s on 32
#: (CPU machine, ext4 mounted with discard; docs/performance/scale.md)
PURGE_THREADS = 32


def purge(
    root: Annotated[Optional[Path], typer.Option(help="The file-tier root (default: the config's).")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="Take the root from this config.")] = None,
    pool: Annotated[Optional[list[str]], typer.Option(help="Only this pool's files (repeatable).")] = None,
    keys: Annotated[
        Optional[list[str]], typer.Option("--keys", help="Only these keys: decimal ints or x\\<hex> (repeatable).")
    ] = None,
    older_than: Annotated[
        Optional[str], typer.Option("--older-than", help="Only files not modified for this long (30m, 7d).")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be deleted; delete nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    threads: Annotated[
        int,
        typer.Option(
            help="Threads checking headers and deleting files (unlinks wait on the file system's journal: more "
                 "threads than verify's).",
            min=1,
            max=256,
        ),
    ] = PURGE_THREADS,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Purge a root that processes use in shared mode: their open files stay readable to them, the "
                 "rest reads as evicted; only abandoned temporary files go.",
        ),
    ] = False,
) -> None:
    """Delete block files (and temporary leftovers and quarantined files, when no filter is
    given) from a tiercache root: only files tiercache wrote (a block file's header must name
    its key and pool), never through a symlink. Refuses a directory without tiercache's marker
    and a root that another process has open, and holds the root's lock while it deletes. Asks
    before deleting unless --yes. A member of a root array: every member is purged in turn."""
    root = resolve_root(root, config)
    if not root.is_dir():
        fail(f"root {str(root)!r} does not exist or is not a directory")
    if not is_root(root):
        fail(f"refusing to purge: {not_a_root(root)}; nothing was deleted")
    bad = [name for name in pool or () if not POOL_NAME_RE.fullmatch(name)]
    if bad:
        fail(f"--pool {bad[0]!r} is not a pool name (1-64 characters of [A-Za-z0-9_.-], starting alphanumeric)")
    try:
        wanted_keys = {key_from_text(k) for k in keys} if keys else None
    except InvalidKeyError as exc:
        fail(str(exc))
    cutoff = time.time() - parse_duration(older_than) if older_than else None
    seen: set[str] = set()
    for member in array_members(root):  # a root array: each member in turn
        seen |= _purge_root(member, pool, wanted_keys, cutoff, dry_run, yes, threads, force)
    absent = [p for p in pool or () if p not in seen]
    if absent:
        typer.echo(
            f"no block file of pool(s) {', '.join(absent)} in {root}"
            + (f" (its block files are of pool(s) {', '.join(sorted(seen))})" if seen else " (it holds no block file)")
        )


def _purge_root(root: Path, pool, wanted_keys, cutoff, dry_run: bool, yes: bool, threads: int, force: bool) -> set[str]:
    """Purge one root (one member of an array: :mod:`tiercache.rootops.purge`'s rules); asks
    first unless ``yes``; returns the pools its block files are of."""
    sel = Selection(frozenset(pool) if pool else None, frozenset(wanted_keys) if wanted_keys is not None else None,
                    cutoff)
    try:
        with locked_for_purge(root, force) as (rd, shared):
            if yes and not dry_run:  # no question to ask: check and delete as the root is listed
                return _purge_now(rd, sel, shared, threads)
            return _purge_planned(rd, sel, shared, dry_run, yes, threads)
    except RootError as exc:
        fail(str(exc))


def _purge_planned(rd, sel: Selection, shared: bool, dry_run: bool, yes: bool, threads: int) -> set[str]:
    """List, then (unless ``dry_run``) ask and delete."""
    root = rd.path
    plan = plan_purge(rd, sel, shared, threads)
    for problem in plan.problems:
        typer.echo(f"left alone: {problem}")
    _left_alone(plan.skipped)
    total = sum(plan.sizes)
    if not plan.targets:
        typer.echo(f"nothing to purge in {root}")
        return plan.seen
    if dry_run:
        for t in plan.targets:
            typer.echo(f"would delete {t}")
        typer.echo(f"would delete {len(plan.targets)} file(s), {human_bytes(total)}")
        return plan.seen
    if not yes:
        try:
            ok = typer.confirm(f"delete {len(plan.targets)} file(s), {human_bytes(total)}, from {root}?")
        except (typer.Abort, EOFError):  # no answer (no terminal, end of input)
            fail("nothing deleted: purge asks before deleting and got no answer (add --yes to skip the question)")
        if not ok:  # a deliberate no is not an error
            typer.echo(f"nothing deleted from {root}")
            return plan.seen
    with Progress(transient=True, disable=len(plan.targets) < 1000) as progress:
        task = progress.add_task("purging", total=len(plan.targets))
        removed, freed = execute_plan(rd, plan, sel, threads, on_done=lambda n: progress.advance(task, n))
    typer.echo(f"deleted {removed} file(s), {human_bytes(freed)}, from {root}")
    return plan.seen


def _purge_now(rd, sel: Selection, shared: bool, threads: int) -> set[str]:
    """``purge --yes``: :func:`~tiercache.rootops.purge_now` with a progress bar."""
    with Progress(transient=True) as progress:
        task = progress.add_task("purging", total=None)
        res = purge_now(rd, sel, shared, threads, on_total=lambda n: progress.update(task, total=n),
                        on_done=lambda n: progress.advance(task, n))
    for problem in res.problems:
        typer.echo(f"left alone: {problem}")
    _left_alone(res.skipped)
    if not res.found:
        typer.echo(f"nothing to purge in {rd.path}")
        return res.seen
    typer.echo(f"deleted {res.deleted} file(s), {human_bytes(res.freed)}, from {rd.path}")
    return res.seen


def _left_alone(skipped: int) -> None:
    if skipped:
        typer.echo(f"left alone: {skipped} file(s) under block names that tiercache did not write (no tiercache "
                   "header naming that key and pool)")
