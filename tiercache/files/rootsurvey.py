"""Read-only views of a file-tier root, for the CLI (``inspect``, ``purge``, ``verify``): what is
in it, and whether each block file verifies on its own (no configuration needed: a block file
describes itself).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from tiercache.errors import CorruptBlockError
from tiercache.files.blockfile import DATA_OFFSET, TMP_PREFIX, checksum, decode_header, parse_filename
from tiercache.files.rootdir import MARKER, QUARANTINE, is_root, lock_holder
from tiercache.keys import Key

STATS = ".tiercache-root.stats.json"


@dataclass
class FileEntry:
    """One file in a root: its name, size (bytes) and modification time (seconds since epoch);
    ``key`` and ``pool`` for block files."""

    name: str
    size: int
    mtime: float
    key: Key | None = None
    pool: str | None = None


@dataclass
class RootSurvey:
    """Everything in a root, by kind."""

    root: Path
    marked: bool
    lock_holder: str | None
    blocks: list[FileEntry] = field(default_factory=list)
    temporary: list[FileEntry] = field(default_factory=list)
    quarantined: list[FileEntry] = field(default_factory=list)
    foreign: list[FileEntry] = field(default_factory=list)
    stats: dict | None = None

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
            "foreign": [e.name for e in self.foreign], "live_stats": self.stats,
        }


def classify(name: str) -> str:
    """``block``, ``temporary``, ``own`` (marker, lock, stats, quarantine dir) or ``foreign``."""
    if name.startswith(TMP_PREFIX):
        return "temporary"
    if name.startswith(MARKER) or name == QUARANTINE:
        return "own"
    return "block" if parse_filename(name) is not None else "foreign"


def _entry(path: Path) -> FileEntry:
    st = path.stat()
    parsed = parse_filename(path.name)
    return FileEntry(path.name, st.st_size, st.st_mtime, *(parsed or (None, None)))


def survey(root: Path) -> RootSurvey:
    """List ``root`` without changing anything.

    Raises:
        FileNotFoundError / NotADirectoryError: no such directory.
    """
    root = Path(root)
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory")
    sv = RootSurvey(root, is_root(root), lock_holder(root) if is_root(root) else None)
    for entry in os.scandir(root):
        kind = classify(entry.name)
        if kind == "own":
            continue
        if kind == "foreign" or not entry.is_file():
            sv.foreign.append(FileEntry(entry.name, 0, 0.0))
            continue
        getattr(sv, "blocks" if kind == "block" else "temporary").append(_entry(Path(entry.path)))
    qdir = root / QUARANTINE
    if qdir.is_dir():
        sv.quarantined = [_entry(p) for p in qdir.iterdir() if p.is_file()]
    try:
        sv.stats = json.loads((root / STATS).read_text())
    except (OSError, ValueError):
        sv.stats = None
    sv.blocks.sort(key=lambda e: e.name)
    return sv


def verify_file(path: Path) -> str | None:
    """Check one block file against itself: header, name, size and data checksum. Returns the
    problem, or None when it verifies."""
    parsed = parse_filename(path.name)
    try:
        with open(path, "rb") as f:
            head = f.read(DATA_OFFSET)
            header = decode_header(head, path.name)
            if parsed is None or (header.key, header.pool) != parsed:
                return f"{path.name}: header names key/pool {header.key!r}/{header.pool!r}, not its file name"
            data = f.read(header.nbytes)
    except CorruptBlockError as exc:
        return str(exc)
    except OSError as exc:
        return f"{path.name}: unreadable ({exc.strerror})"
    if len(data) < header.nbytes:
        return f"{path.name}: truncated ({len(data)} of {header.nbytes} data bytes)"
    if checksum(data) != header.checksum:
        return f"{path.name}: data checksum mismatch"
    return None


def write_stats(root: Path, stats: dict) -> None:
    """Save a cache's ``stats`` (with this pid and the time) as ``<root>/`` :data:`STATS`,
    atomically (temporary file, rename); best effort: an OSError leaves the old file."""
    snap = {**stats, "pid": os.getpid(), "time": time.time()}
    tmp = root / f".tmp.stats.{os.getpid()}"
    try:
        tmp.write_text(json.dumps(snap))
        os.replace(tmp, root / STATS)
    except OSError:
        pass
