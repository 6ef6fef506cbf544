"""``tiercache verify``: check every block file's header, size and checksum."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import Progress

from tiercache.errors import RootError
from tiercache.files import QUARANTINE, RootDir, RootLock, classify, is_root, lock_holder, native_status
from tiercache.rootops import VERIFY, RootCheck, entry_path, gc_paused, quick_gil_handoff, recheck, survey

from .common import EXIT_FINDING, array_members, fail, not_a_root, resolve_root

#: names that look like block files (what a canonical name is not is said by parse_filename)
LOOKS_LIKE_BLOCK = re.compile(r"block_.*_pool_.*\.bin")


def verify(
    root: Annotated[Optional[Path], typer.Option(help="The file-tier root (default: the config's).")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="Take the root from this config.")] = None,
    quarantine: Annotated[bool, typer.Option("--quarantine", help="Move bad files to quarantine/ (needs the root free).")] = False,
    threads: Annotated[int, typer.Option(help="Threads submitting chunks of files to the native I/O engine (and its C threads).", min=1, max=256)] = 8,
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
    """Verify one root (one member of an array); prints its lines unless ``as_json``; returns
    its JSON report."""
    lock = None
    try:
        rd = RootDir(root, check_owner=False)
        if quarantine:  # shared mode: beside the processes using the root (moving a bad file is safe)
            lock = RootLock(rd, shared=lock_holder(root) == "shared")
            rd.subdir(QUARANTINE, create=True)  # a symlink there is refused before anything moves
    except RootError as exc:
        fail(str(exc))
    try:
        t0 = time.perf_counter()
        with gc_paused(), quick_gil_handoff(), Progress(transient=True, disable=as_json) as progress, \
                RootCheck(rd, VERIFY, threads, on_done=lambda n: progress.advance(task, n)) as check:
            task = progress.add_task("verifying", total=None)
            # each subdirectory's files are checked while the next is listed; the native reads
            # learn each file's size
            sv = survey(root, sizes=not native_status()[0], on_blocks=check.add)
            t1 = time.perf_counter()
            # names that should be blocks but are symlinks, directories...: bad too
            strays = [e for e in sv.foreign if classify(e.name) == "block"]
            check.add(strays)
            files = sv.blocks + strays
            progress.update(task, total=len(files))
            found = check.results()
        t2 = time.perf_counter()
        bad: list[tuple[str, str, object]] = [
            (e.relpath, f"{e.relpath}: not a canonical block file name (one spelling per key, ASCII digits): the cache "
                        "ignores it, so it is a stray copy or junk", entry_path(rd, e))
            for e in sv.foreign if classify(e.name) == "foreign" and LOOKS_LIKE_BLOCK.match(e.name)]
        bad += [(problem.split(" ", 1)[0], problem, None) for problem in sv.problems]  # e.g. a symlinked subdirectory
        # each bad file once more as it is now: one that vanished or was replaced by a good one
        # (a shared root in use) is not bad; only one still bad and still the same inode may move
        changed, unmoved = 0, []
        for e, _ in found:
            again = recheck(rd, e)
            if again.problem is None:
                changed += 1
            elif again.same_file:
                bad.append((e.name, again.problem, entry_path(rd, e)))
            else:
                bad.append((e.name, again.problem, None))
                if quarantine:
                    unmoved.append(f"{e.relpath}: not moved to quarantine/ (replaced while it was checked)")
        moved = 0
        if quarantine and bad:
            for name, _, path in bad:
                if path is None:
                    continue
                try:
                    moved += rd.quarantine(path) is not None
                except OSError as exc:
                    unmoved.append(f"{path.name}: not moved to quarantine/ ({exc.strerror or exc})")
    finally:
        if lock is not None:
            lock.release()
        rd.close()
    report = {"root": str(root), "checked": len(files), "bad": [{"file": n, "problem": p} for n, p, _ in bad],
              "quarantined": moved, "not_quarantined": unmoved, "changed_while_checked": changed,
              "survey_s": t1 - t0, "seconds": t2 - t0, "bytes": sum(max(e.size, 0) for e in sv.blocks)}
    if not as_json:
        for _, problem, _ in bad:
            typer.echo(f"BAD {problem}")
        for line in unmoved:
            typer.echo(f"LEFT {line}")
        typer.echo(f"checked {len(files)} block file(s) in {root}: {len(bad)} bad"
                   + (f", {moved} moved to quarantine/" if moved else "")
                   + (f"; {changed} removed or replaced while checked (not bad)" if changed else ""))
    return report

