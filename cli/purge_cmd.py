"""``tiercache purge``: delete files tiercache wrote under a root, and nothing else.

What is ours: block files under their canonical names whose header is tiercache's and names the
same key and pool (corrupt data included), tiercache's temporary files, and regular files in a
real ``quarantine/`` directory. Deletion goes through the root's directory descriptor and never
follows a symlink; the root's lock is held for the whole purge, so no cache opens it meanwhile.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import Progress

from tiercache.errors import InvalidKeyError, RootError
from tiercache.settings import default
from tiercache.files import INDEX, QUARANTINE, RootDir, RootLock, is_root, lock_holder, native_status, tmp_abandoned
from tiercache.rootops import (DELETE, FileEntry, RootCheck, RootSurvey, entry_path, gc_paused, own_entries, quick_gil_handoff,
                               survey, unlink_all)
from tiercache.geometry import POOL_NAME_RE
from tiercache.keys import key_from_text

from .common import array_members, fail, human_bytes, not_a_root, parse_duration, resolve_root

TMP_MAX_AGE_S = default("sharing", "tmp_max_age_s")  # the one default (tiercache.settings)
#: purge's default threads: a million files purged in 34.7 s on 8 threads, 29.6 s on 32
#: (CPU machine, ext4 mounted with discard; docs/performance.md)
PURGE_THREADS = 32


def purge(
    root: Annotated[Optional[Path], typer.Option(help="The file-tier root (default: the config's).")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="Take the root from this config.")] = None,
    pool: Annotated[Optional[list[str]], typer.Option(help="Only this pool's files (repeatable).")] = None,
    keys: Annotated[Optional[list[str]], typer.Option("--keys", help="Only these keys: decimal ints or x\\<hex> (repeatable).")] = None,
    older_than: Annotated[Optional[str], typer.Option("--older-than", help="Only files not modified for this long (30m, 7d).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be deleted; delete nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    threads: Annotated[int, typer.Option(help="Threads checking headers and deleting files (unlinks wait on the file system's journal: more threads than verify's).", min=1, max=256)] = PURGE_THREADS,
    force: Annotated[bool, typer.Option("--force", help="Purge a root that processes use in shared mode: their open files stay readable to them, the rest reads as evicted; only abandoned temporary files go.")] = False,
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
        typer.echo(f"no block file of pool(s) {', '.join(absent)} in {root}"
                   + (f" (its block files are of pool(s) {', '.join(sorted(seen))})" if seen else " (it holds no block file)"))


def _purge_root(root: Path, pool, wanted_keys, cutoff, dry_run: bool, yes: bool, threads: int, force: bool) -> set[str]:
    """Purge one root (one member of an array); returns the pools its block files are of."""
    holder = lock_holder(root)
    shared = holder == "shared"
    if shared and not force:
        fail(f"refusing to purge {str(root)!r}: in use by processes in shared mode; --force deletes their block "
             "files anyway (a file one of them has open stays readable to it; the others read as evicted)")
    if holder is not None and not shared:
        fail(f"refusing to purge {str(root)!r}: in use by process {holder}; close that cache first")
    try:
        rd = RootDir(root, check_owner=False)
    except RootError as exc:
        fail(str(exc))
    try:
        # held while deleting: no cache opens the root meanwhile (shared: no exclusive one)
        lock = RootLock(rd, shared=shared)
    except RootError as exc:
        rd.close()
        fail(f"refusing to purge {str(root)!r}: {exc}")
    try:
        return _purge(rd, pool, wanted_keys, cutoff, dry_run, yes, shared, threads)
    finally:
        lock.release()
        rd.close()


def _purge(rd: RootDir, pools, wanted_keys, cutoff, dry_run: bool, yes: bool, shared: bool = False,
           threads: int = PURGE_THREADS) -> set[str]:
    """Purge ``rd``: asks first unless ``yes``; returns the pools its block files are of."""
    root = rd.path
    # the native header reads learn each file's size; --older-than needs every file's mtime
    stat_sizes = cutoff is not None or not native_status()[0]
    whole_root = not pools and wanted_keys is None

    def wanted(entries: list[FileEntry]) -> list[FileEntry]:
        return [e for e in entries if (not pools or e.pool in pools) and (wanted_keys is None or e.key in wanted_keys)
                and (cutoff is None or e.mtime < cutoff)]

    if yes and not dry_run:  # no question to ask: check and delete as the root is listed
        return _purge_now(rd, wanted, stat_sizes, whole_root, cutoff, shared, threads)
    sv = survey(root, sizes=stat_sizes)
    seen = {e.pool for e in sv.blocks}
    chosen = wanted(sv.blocks)
    leftovers, leftover_sizes = _leftovers(rd, sv, cutoff, shared) if whole_root else ([], [])
    own = own_entries(rd, chosen, threads)
    targets = [entry_path(rd, e) for e in own] + leftovers
    sizes = [e.size for e in own] + leftover_sizes
    skipped = len(chosen) - len(own)
    for problem in sv.problems:
        typer.echo(f"left alone: {problem}")
    _left_alone(skipped)
    total = sum(sizes)
    if not targets:
        typer.echo(f"nothing to purge in {root}")
        return seen
    if dry_run:
        for t in targets:
            typer.echo(f"would delete {t}")
        typer.echo(f"would delete {len(targets)} file(s), {human_bytes(total)}")
        return seen
    if not yes:
        try:
            ok = typer.confirm(f"delete {len(targets)} file(s), {human_bytes(total)}, from {root}?")
        except (typer.Abort, EOFError):  # no answer (no terminal, end of input)
            fail("nothing deleted: purge asks before deleting and got no answer (add --yes to skip the question)")
        if not ok:  # a deliberate no is not an error
            typer.echo(f"nothing deleted from {root}")
            return seen
    removed, freed = 0, 0
    if whole_root and cutoff is None:  # nothing left for the saved index to list
        rd.child(INDEX).unlink()
    with Progress(transient=True, disable=len(targets) < 1000) as progress:
        task = progress.add_task("purging", total=len(targets))
        gone = unlink_all(targets, threads, on_done=lambda n: progress.advance(task, n))
    for ok, size in zip(gone, sizes):
        removed += ok
        freed += size if ok else 0
    typer.echo(f"deleted {removed} file(s), {human_bytes(freed)}, from {root}")
    return seen


def _leftovers(rd: RootDir, sv: RootSurvey, cutoff, shared: bool) -> tuple[list, list[int]]:
    """What a whole-root purge clears beside block files: tiercache's temporary files (in
    shared mode only abandoned ones) and quarantined files; their paths and sizes."""
    paths, sizes = [], []
    now = time.time()
    for e in sv.temporary:
        if shared and not tmp_abandoned(e.name, now - e.mtime, TMP_MAX_AGE_S):
            continue  # a live writer's (shared mode)
        if cutoff is None or e.mtime < cutoff:
            paths.append(entry_path(rd, e))
            sizes.append(e.size)
    qdir = rd.subdir(QUARANTINE) if not sv.problems else None
    for e in sv.quarantined if qdir is not None else ():
        if cutoff is None or e.mtime < cutoff:
            paths.append(qdir.child(e.name))
            sizes.append(e.size)
    return paths, sizes


def _purge_now(rd: RootDir, wanted, stat_sizes: bool, whole_root: bool, cutoff, shared: bool, threads: int) -> set[str]:
    """``purge --yes``: each subdirectory's chosen files are checked and deleted
    (:class:`RootCheck`, ``delete``) while the next is filed; then the leftovers."""
    chosen = 0
    drop_index = whole_root and cutoff is None
    seen: set[str] = set()

    def add(entries: list[FileEntry]) -> None:
        nonlocal chosen
        seen.update(e.pool for e in entries)
        mine = wanted(entries)
        if mine and drop_index and not chosen:
            rd.child(INDEX).unlink()  # before any block goes: nothing left for the saved index to list
        chosen += len(mine)
        check.add(mine)

    with gc_paused(), quick_gil_handoff(), Progress(transient=True) as progress, \
            RootCheck(rd, DELETE, threads, on_done=lambda n: progress.advance(task, n)) as check:
        task = progress.add_task("purging", total=None)
        sv = survey(rd.path, sizes=stat_sizes, on_blocks=add)
        leftovers, leftover_sizes = _leftovers(rd, sv, cutoff, shared) if whole_root else ([], [])
        progress.update(task, total=chosen + len(leftovers))
        gone, skipped = check.results()
        done = unlink_all(leftovers, threads, on_done=lambda n: progress.advance(task, n))
    for problem in sv.problems:
        typer.echo(f"left alone: {problem}")
    _left_alone(skipped)
    if not chosen and not leftovers:
        typer.echo(f"nothing to purge in {rd.path}")
        return seen
    freed = sum(e.size for e in gone) + sum(size for ok, size in zip(done, leftover_sizes) if ok)
    typer.echo(f"deleted {len(gone) + sum(done)} file(s), {human_bytes(freed)}, from {rd.path}")
    return seen


def _left_alone(skipped: int) -> None:
    if skipped:
        typer.echo(f"left alone: {skipped} file(s) under block names that tiercache did not write (no tiercache "
                   "header naming that key and pool)")
