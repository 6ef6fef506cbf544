"""``tiercache purge``: delete files tiercache wrote under a root, and nothing else."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import Progress

from tiercache.errors import InvalidKeyError
from tiercache.files import QUARANTINE, is_root, lock_holder, survey
from tiercache.keys import key_from_text

from .common import EXIT_USAGE, fail, human_bytes, parse_duration, resolve_root


def purge(
    root: Annotated[Optional[Path], typer.Option(help="The file-tier root (default: the config's).")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="Take the root from this config.")] = None,
    pool: Annotated[Optional[list[str]], typer.Option(help="Only this pool's files (repeatable).")] = None,
    keys: Annotated[Optional[list[str]], typer.Option("--keys", help="Only these keys: decimal ints or x<hex> (repeatable).")] = None,
    older_than: Annotated[Optional[str], typer.Option("--older-than", help="Only files not modified for this long (30m, 7d).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be deleted; delete nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete block files (and temporary leftovers and quarantined files, when no filter is
    given) from a tiercache root. Refuses a directory without tiercache's marker and a root that
    another process has open. Asks before deleting unless --yes."""
    root = resolve_root(root, config)
    if not root.is_dir():
        fail(f"root {str(root)!r} does not exist or is not a directory")
    if not is_root(root):
        fail(f"refusing to purge {str(root)!r}: no .tiercache-root marker, so tiercache did not create it")
    holder = lock_holder(root)
    if holder is not None:
        fail(f"refusing to purge {str(root)!r}: in use by process {holder}; close that cache first")
    try:
        wanted_keys = {key_from_text(k) for k in keys} if keys else None
    except InvalidKeyError as exc:
        fail(str(exc))
    cutoff = time.time() - parse_duration(older_than) if older_than else None
    sv = survey(root)
    chosen = [e for e in sv.blocks
              if (not pool or e.pool in pool) and (wanted_keys is None or e.key in wanted_keys)
              and (cutoff is None or e.mtime < cutoff)]
    targets = [root / e.name for e in chosen]
    sizes = [e.size for e in chosen]
    if not pool and wanted_keys is None:  # a whole-root purge also clears leftovers
        for e in sv.temporary:
            if cutoff is None or e.mtime < cutoff:
                targets.append(root / e.name)
                sizes.append(e.size)
        for e in sv.quarantined:
            if cutoff is None or e.mtime < cutoff:
                targets.append(root / QUARANTINE / e.name)
                sizes.append(e.size)
    total = sum(sizes)
    if not targets:
        typer.echo(f"nothing to purge in {root}")
        return
    if dry_run:
        for t in targets:
            typer.echo(f"would delete {t}")
        typer.echo(f"would delete {len(targets)} file(s), {human_bytes(total)}")
        return
    if not yes and not typer.confirm(f"delete {len(targets)} file(s), {human_bytes(total)}, from {root}?"):
        typer.echo("nothing deleted")
        raise typer.Exit(EXIT_USAGE)
    removed, freed = 0, 0
    with Progress(transient=True, disable=len(targets) < 1000) as progress:
        task = progress.add_task("purging", total=len(targets))
        for t, size in zip(targets, sizes):
            try:
                os.unlink(t)
                removed += 1
                freed += size
            except FileNotFoundError:
                pass
            progress.advance(task)
    typer.echo(f"deleted {removed} file(s), {human_bytes(freed)}, from {root}")
