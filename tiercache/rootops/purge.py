"""``purge`` of one root, its rules in one place (``tiercache purge`` asks, shows progress and
prints what these return).

What is the cache's to delete: block files under their canonical names whose header is
tiercache's and names the same key and pool (corrupt data included), tiercache's temporary
files (on a root in shared use only abandoned ones: a live writer's stay), and regular files
in a real ``quarantine/``. A selection by pool, key or age takes block files only. Deletion
goes through the root's directory descriptors and never follows a symlink. The root's lock is
held for the whole purge (:func:`locked_for_purge`): no cache opens the root meanwhile; a root
that processes use in shared mode is purged only when forced (a file one of them has open
stays readable to it; the others read as evicted). A whole-root purge removes the saved index
before the first block goes: nothing is left for it to list; and, after the blocks, the
record of what they meant (``.tiercache-layout``): the next engine records its own.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tiercache.errors import RootError
from tiercache.files import INDEX, LAYOUT, QUARANTINE, RootDir, RootLock, lock_holder, native_status, tmp_abandoned
from tiercache.keys import Key
from tiercache.rootops.check import DELETE, RootCheck, own_entries, quick_gil_handoff, unlink_all
from tiercache.rootops.inventory import FileEntry, RootSurvey, entry_path, gc_paused, survey
from tiercache.settings import default

#: temporary files older than this are abandoned (a shared root's purge takes only those)
TMP_MAX_AGE_S = default("sharing", "tmp_max_age_s")


@dataclass(frozen=True)
class Selection:
    """What a purge takes: block files of ``pools`` (None: every pool), of ``keys`` (None:
    every key), not modified since ``cutoff`` (seconds since the epoch; None: any age). With
    neither pools nor keys it is a whole-root purge: leftovers too (temporary and quarantined
    files, the saved index)."""

    pools: frozenset[str] | None = None
    keys: frozenset[Key] | None = None
    cutoff: float | None = None

    @property
    def whole_root(self) -> bool:
        return not self.pools and self.keys is None

    def wanted(self, entries: list[FileEntry]) -> list[FileEntry]:
        """The block files of ``entries`` this selection takes."""
        return [e for e in entries if (not self.pools or e.pool in self.pools)
                and (self.keys is None or e.key in self.keys) and (self.cutoff is None or e.mtime < self.cutoff)]

    @property
    def stat_sizes(self) -> bool:
        """Whether the survey must stat every file: an age cutoff needs each file's time, and
        without the native engine nothing else learns its size."""
        return self.cutoff is not None or not native_status()[0]


@contextlib.contextmanager
def locked_for_purge(root: Path, force: bool = False) -> Iterator[tuple[RootDir, bool]]:
    """The root open and locked for a purge: ``(root directory, shared)``, ``shared`` where
    processes use it in shared mode (then the lock is shared, beside them).

    Raises:
        RootError: the root is in use by a process (exclusively, or in shared mode without
            ``force``), or cannot be opened or locked; the message names why.
    """
    holder = lock_holder(root)
    shared = holder == "shared"
    if shared and not force:
        raise RootError(f"refusing to purge {str(root)!r}: in use by processes in shared mode; --force deletes their "
                        "block files anyway (a file one of them has open stays readable to it; the others read as "
                        "evicted)")
    if holder is not None and not shared:
        raise RootError(f"refusing to purge {str(root)!r}: in use by process {holder}; close that cache first")
    rd = RootDir(root, check_owner=False)
    try:
        # held while deleting: no cache opens the root meanwhile (shared: no exclusive one)
        lock = RootLock(rd, shared=shared)
    except RootError as exc:
        rd.close()
        raise RootError(f"refusing to purge {str(root)!r}: {exc}") from None
    try:
        yield rd, shared
    finally:
        lock.release()
        rd.close()


def leftovers(rd: RootDir, sv: RootSurvey, cutoff: float | None, shared: bool) -> tuple[list, list[int]]:
    """What a whole-root purge clears beside block files: tiercache's temporary files (in
    shared mode only abandoned ones) and quarantined files (where ``quarantine/`` is a real
    directory); their paths and sizes."""
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


@dataclass
class PurgePlan:
    """A purge listed before anything is deleted: the files (``targets``) and their sizes in
    bytes, block files under block names the cache did not write (``skipped``: left alone),
    the survey's ``problems`` (left alone), and the pools the root's block files are of."""

    targets: list = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    skipped: int = 0
    problems: list[str] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)


def plan_purge(rd: RootDir, sel: Selection, shared: bool, threads: int) -> PurgePlan:
    """List what a purge of ``rd`` would delete (every chosen block file's header checked:
    only the cache's own files are listed)."""
    sv = survey(rd.path, sizes=sel.stat_sizes)
    chosen = sel.wanted(sv.blocks)
    extra, extra_sizes = leftovers(rd, sv, sel.cutoff, shared) if sel.whole_root else ([], [])
    own = own_entries(rd, chosen, threads)
    return PurgePlan([entry_path(rd, e) for e in own] + extra, [e.size for e in own] + extra_sizes,
                     len(chosen) - len(own), list(sv.problems), {e.pool for e in sv.blocks})


def execute_plan(rd: RootDir, plan: PurgePlan, sel: Selection, threads: int,
                 on_done: Callable[[int], None] | None = None) -> tuple[int, int]:
    """Delete a plan's files; ``(files deleted, bytes freed)``. A whole-root purge of any age
    removes the saved index first."""
    if sel.whole_root and sel.cutoff is None:  # nothing left for the saved index to list
        rd.child(INDEX).unlink()
    gone = unlink_all(plan.targets, threads, on_done=on_done)
    return sum(gone), sum(size for ok, size in zip(gone, plan.sizes) if ok)


@dataclass
class PurgeResult:
    """What :func:`purge_now` did: files deleted and bytes freed, block files left alone
    (``skipped``: not the cache's), the survey's ``problems``, whether anything was chosen
    (``found``), and the pools the root's block files are of."""

    deleted: int = 0
    freed: int = 0
    skipped: int = 0
    problems: list[str] = field(default_factory=list)
    found: bool = False
    seen: set[str] = field(default_factory=set)


def purge_now(rd: RootDir, sel: Selection, shared: bool, threads: int,
              on_total: Callable[[int], None] | None = None,
              on_done: Callable[[int], None] | None = None) -> PurgeResult:
    """Purge without listing first: each subdirectory's chosen files are checked and deleted
    (:class:`~tiercache.rootops.check.RootCheck`, ``DELETE``) while the next is listed; then
    the leftovers. ``on_total`` gets the number of files once known, ``on_done`` each count
    deleted."""
    chosen = 0
    drop_index = sel.whole_root and sel.cutoff is None
    out = PurgeResult()

    def add(entries: list[FileEntry]) -> None:
        nonlocal chosen
        out.seen.update(e.pool for e in entries)
        mine = sel.wanted(entries)
        if mine and drop_index and not chosen:
            rd.child(INDEX).unlink()  # before any block goes: nothing left for the saved index to list
        chosen += len(mine)
        check.add(mine)

    with gc_paused(), quick_gil_handoff(), RootCheck(rd, DELETE, threads, on_done=on_done) as check:
        sv = survey(rd.path, sizes=sel.stat_sizes, on_blocks=add)
        extra, extra_sizes = leftovers(rd, sv, sel.cutoff, shared) if sel.whole_root else ([], [])
        if on_total is not None:
            on_total(chosen + len(extra))
        gone, out.skipped = check.results()
        done = unlink_all(extra, threads, on_done=on_done)
    if drop_index:  # no block left for the layout record to describe: the next engine records its own
        rd.child(LAYOUT).unlink()
    out.problems = list(sv.problems)
    out.found = bool(chosen or extra)
    out.deleted = len(gone) + sum(done)
    out.freed = sum(e.size for e in gone) + sum(size for ok, size in zip(done, extra_sizes) if ok)
    return out
