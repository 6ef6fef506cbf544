"""Read-only views of a file-tier root, for the CLI (``inspect``, ``purge``, ``verify``): what is
in it, and whether each block file verifies on its own (no configuration needed: a block file
describes itself).

Like the file tier, the survey goes through the root's directory descriptor and follows no
symlink: a symlink, directory or device under a block's name is listed as foreign, and a
``quarantine`` that is not a real directory is never looked into.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tiercache.errors import CorruptBlockError, RootError
from tiercache.files import (
    DATA_OFFSET,
    QUARANTINE,
    STATS,
    SUBDIRS,
    RootDir,
    RootPath,
    block_subdir,
    classify,
    decode_header,
    is_root,
    is_temporary_name,
    lock_holder,
    parse_filename,
    verify_file,  # noqa: F401 (rootops names it too: check.py, the package face)
)
from tiercache.keys import Key


@dataclass(slots=True)
class FileEntry:
    """One file in a root: its name, size (bytes) and modification time (seconds since epoch);
    ``key`` and ``pool`` for block files; ``dir``: the block subdirectory it is in (``""``:
    the root itself, as block files of the flat layout of earlier versions are)."""

    name: str
    size: int
    mtime: float
    key: Key | None = None
    pool: str | None = None
    dir: str = ""
    #: the inode number the listing gave (0: unknown): reading files in this order reads the
    #: file system's inode tables in order
    ino: int = 0

    @property
    def relpath(self) -> str:
        """The path relative to the root."""
        return f"{self.dir}/{self.name}" if self.dir else self.name


def entry_path(root: RootDir, e: FileEntry) -> RootPath:
    """The file of a surveyed entry, through the root's (or its subdirectory's) descriptor."""
    return (root.subdir(e.dir) if e.dir else root).child(e.name)


@dataclass
class RootSurvey:
    """Everything in a root, by kind. ``foreign`` lists what tiercache did not write (names
    that are not canonical block names, blocks' names taken by symlinks or directories);
    ``problems`` says what the survey could not look into (``quarantine`` a symlink)."""

    root: Path
    marked: bool
    lock_holder: str | None
    blocks: list[FileEntry] = field(default_factory=list)
    temporary: list[FileEntry] = field(default_factory=list)
    quarantined: list[FileEntry] = field(default_factory=list)
    foreign: list[FileEntry] = field(default_factory=list)
    stats: dict | None = None
    problems: list[str] = field(default_factory=list)

    def by_pool(self) -> dict[str, dict]:
        """``{pool: {"files": n, "bytes": b}}`` of the block files."""
        out: dict[str, dict] = {}
        for e in self.blocks:
            d = out.setdefault(e.pool, {"files": 0, "bytes": 0})
            d["files"] += 1
            d["bytes"] += e.size
        return out

    def as_dict(self) -> dict:
        def total(entries):
            return {"files": len(entries), "bytes": sum(e.size for e in entries)}

        return {
            "root": str(self.root), "tiercache_root": self.marked, "locked_by_pid": self.lock_holder,
            "block_files": total(self.blocks), "blocks": len({e.key for e in self.blocks}),
            "pools": self.by_pool(), "temporary": total(self.temporary), "quarantined": total(self.quarantined),
            "foreign": [e.relpath for e in self.foreign], "problems": self.problems, "live_stats": self.stats,
        }


def _entries(d: RootDir, stat_blocks: bool = True) -> list[tuple[os.DirEntry, bool, int, float]]:
    """Each entry as ``(entry, regular file, size, mtime)``; entries that vanished while
    listed are left out. With ``stat_blocks`` False, names that look like block files are
    not stat'ed (the listing's file type says whether they are regular files; size -1)."""
    with d.scandir() as it:
        listing = list(it)
    out = []
    for e in listing:
        try:
            if not stat_blocks and e.name.startswith("block_"):
                out.append((e, e.is_file(follow_symlinks=False), -1, 0.0))
            else:
                st = e.stat(follow_symlinks=False)
                out.append((e, stat.S_ISREG(st.st_mode), st.st_size, st.st_mtime))
        except OSError:
            pass
    return out


def _file_entry(e: os.DirEntry, size: int, mtime: float, sub: str = "") -> FileEntry:
    parsed = parse_filename(e.name)
    return FileEntry(e.name, size, mtime, *(parsed or (None, None)), dir=sub)


def _add(sv: RootSurvey, e: os.DirEntry, regular: bool, size: int, mtime: float, sub: str) -> None:
    """File one entry of the root (``sub`` ``""``) or of a block subdirectory under its kind
    (the name parsed once: this runs per file of a root of millions)."""
    name = e.name
    parsed = parse_filename(name)
    if parsed is not None:
        kind = "block"
    elif is_temporary_name(name):
        kind = "temporary"
    else:
        kind = classify(name)
    if kind == "own" and not sub:
        return
    misplaced = kind == "block" and sub and block_subdir(parsed[0]) != sub
    if kind in ("foreign", "own") or misplaced or not regular:
        sv.foreign.append(FileEntry(name, 0, 0.0, dir=sub))
        return
    if kind == "block":
        sv.blocks.append(FileEntry(name, size, mtime, *parsed, dir=sub, ino=e.inode()))
    else:
        sv.temporary.append(FileEntry(name, size, mtime, dir=sub))


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for the block (back on after, if it was): a
    survey of a million files makes as many objects, and the collections they set off took a
    third of its time (docs/performance/scale.md). Nothing made meanwhile is cyclic garbage."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def survey(root: Path, sizes: bool = True, subdirs: bool = True,
           on_blocks: Callable[[list[FileEntry]], None] | None = None) -> RootSurvey:
    """List ``root`` without changing anything (and without following a symlink inside it).

    Args:
        sizes: stat every block file for its size and mtime. False lists names and file
            types only (``FileEntry.size`` -1, ``mtime`` 0): a root of a million blocks
            lists in about a quarter of the time (docs/performance/scale.md); ``verify`` and
            ``purge`` learn sizes as they open the files.
        subdirs: list the block subdirectories; False lists the root itself and quarantine/
            only (``inspect`` of a root of millions, whose blocks its saved index counts).
        on_blocks: called with the block files of the root itself and then of each
            subdirectory as soon as that directory is listed (``verify`` and ``purge`` start
            checking them while the next one is listed: :class:`~tiercache.rootops.check.RootCheck`).

    Raises:
        NotADirectoryError: no such directory.
    """
    root = Path(root)
    try:
        d = RootDir(root, check_owner=False)
    except RootError as exc:
        raise NotADirectoryError(str(exc)) from None
    with d, gc_paused():
        sv = RootSurvey(root, is_root(root), lock_holder(root) if is_root(root) else None)
        for e, regular, size, mtime in _entries(d, sizes):
            if not (e.name in _SUBDIRS and e.is_dir(follow_symlinks=False)):
                _add(sv, e, regular, size, mtime, "")
        listed = len(sv.blocks)
        if on_blocks is not None and listed:
            on_blocks(sv.blocks[:listed])
        listings = []  # every subdirectory listed before any is filed (see below)
        for name in SUBDIRS if subdirs else ():
            try:
                sub = d.subdir(name)
            except RootError as exc:  # a symlink in place of a block subdirectory: not looked into
                sv.problems.append(str(exc))
                sv.foreign.append(FileEntry(name, 0, 0.0))
                continue
            listings.append((name, _entries(sub, sizes) if sub is not None else []))
        # with on_blocks, the checks of one subdirectory's files run while the next is filed
        # (Python); the directories' own reads come first, not queued behind those checks'
        for name, listing in listings:
            for e, regular, size, mtime in listing:
                _add(sv, e, regular, size, mtime, name)
            listing.clear()
            if on_blocks is not None and len(sv.blocks) > listed:
                on_blocks(sv.blocks[listed:])
            listed = len(sv.blocks)
        try:
            q = d.subdir(QUARANTINE)
        except RootError as exc:
            q = None
            sv.problems.append(str(exc))
        if q is not None:
            sv.quarantined = [_file_entry(e, size, mtime) for e, regular, size, mtime in _entries(q) if regular]
        try:
            sv.stats = json.loads(_read_regular(d.child(STATS)))
        except (OSError, ValueError):
            sv.stats = None
    sv.blocks.sort(key=lambda e: e.name)
    return sv


_SUBDIRS = frozenset(SUBDIRS)


def _read_regular(p: RootPath, limit: int = 1 << 20) -> bytes:
    fd = p.open(os.O_RDONLY)
    try:
        return os.pread(fd, limit, 0)
    finally:
        os.close(fd)


def is_own_block_file(path: RootPath) -> bool:
    """True when ``path`` is a regular file whose header is tiercache's and names the same key
    and pool as its file name: what ``purge`` may delete (corrupt data included)."""
    parsed = parse_filename(path.name)
    if parsed is None:
        return False
    try:
        fd = path.open(os.O_RDONLY)
    except OSError:
        return False
    try:
        header = decode_header(os.pread(fd, DATA_OFFSET, 0), path.name)
    except (CorruptBlockError, OSError):
        return False
    finally:
        os.close(fd)
    return (header.key, header.pool) == parsed
