"""``verify`` of one root, its rules in one place (``tiercache verify`` prints what it returns).

Every block file is checked: a regular file under its canonical name, its header, its exact
size and the XXH3-64 of its data (:class:`~tiercache.rootops.check.RootCheck`, native chunks,
each subdirectory's files checked while the next is listed). Also bad: names that look like
block files but are not canonical (the cache ignores them), entries under block names that are
not regular files, and problems of the root's layout (a symlinked subdirectory). A file found
bad is checked once more as it is now: one removed or replaced by a good file meanwhile (a
shared root in use) is not bad, and only one still bad and still the same inode may move to
the root's own ``quarantine/``. Nothing is followed through a symlink.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from tiercache.files import QUARANTINE, RootDir, RootLock, classify, lock_holder, native_status
from tiercache.rootops.check import VERIFY, RootCheck, quick_gil_handoff, recheck
from tiercache.rootops.inventory import entry_path, gc_paused, survey

#: names that look like block files (what a canonical name is not is said by parse_filename)
LOOKS_LIKE_BLOCK = re.compile(r"block_.*_pool_.*\.bin")


def verify_root(root: Path, quarantine: bool = False, threads: int = 8,
                on_total: Callable[[int], None] | None = None,
                on_done: Callable[[int], None] | None = None) -> dict:
    """Verify one root (one member of a root array; module docstring).

    Args:
        root: the root's directory.
        quarantine: move bad files into the root's ``quarantine/`` (the root's lock is taken:
            shared beside processes using the root in shared mode, else exclusive).
        threads: threads submitting chunks of files to the native engine.
        on_total: called with the number of files to check once it is known.
        on_done: called with each count of files checked (progress).

    Returns:
        ``{"root", "checked", "bad": [{"file", "problem"}], "quarantined", "not_quarantined":
        [str], "changed_while_checked", "survey_s", "seconds", "bytes"}``.

    Raises:
        RootError: the root cannot be opened, or (``quarantine``) its lock cannot be taken or
            its ``quarantine/`` is not a real directory.
    """
    lock = None
    rd = RootDir(root, check_owner=False)
    try:
        if quarantine:  # shared mode: beside the processes using the root (moving a bad file is safe)
            lock = RootLock(rd, shared=lock_holder(root) == "shared")
            rd.subdir(QUARANTINE, create=True)  # a symlink there is refused before anything moves
        t0 = time.perf_counter()
        with gc_paused(), quick_gil_handoff(), RootCheck(rd, VERIFY, threads, on_done=on_done) as check:
            # the native reads learn each file's size
            sv = survey(root, sizes=not native_status()[0], on_blocks=check.add)
            t1 = time.perf_counter()
            # names that should be blocks but are symlinks, directories...: bad too
            strays = [e for e in sv.foreign if classify(e.name) == "block"]
            check.add(strays)
            files = sv.blocks + strays
            if on_total is not None:
                on_total(len(files))
            found = check.results()
        t2 = time.perf_counter()
        bad: list[tuple[str, str, object]] = [
            (e.relpath, f"{e.relpath}: not a canonical block file name (one spelling per key, ASCII digits): the cache "
                        "ignores it, so it is a stray copy or junk", entry_path(rd, e))
            for e in sv.foreign if classify(e.name) == "foreign" and LOOKS_LIKE_BLOCK.match(e.name)]
        bad += [(problem.split(" ", 1)[0], problem, None) for problem in sv.problems]  # e.g. a symlinked subdirectory
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
            for _, _, path in bad:
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
    return {"root": str(root), "checked": len(files), "bad": [{"file": n, "problem": p} for n, p, _ in bad],
            "quarantined": moved, "not_quarantined": unmoved, "changed_while_checked": changed,
            "survey_s": t1 - t0, "seconds": t2 - t0, "bytes": sum(max(e.size, 0) for e in sv.blocks)}
