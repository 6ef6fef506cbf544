"""The file-tier root: tiercache's marker and the lock that keeps one writer per root.

``<root>/.tiercache-root`` (JSON with the format version) marks a directory as tiercache's own;
a non-empty directory without it is refused, so tiercache never writes into, or purges,
somebody else's files. ``<root>/.tiercache-root.lock`` is ``flock``-ed exclusively by the
process that opens the root for writing, for as long as it has it open; the kernel drops the
lock when that process dies (even by SIGKILL), so a crash never leaves a root locked. Several
processes (ranks) work side by side in separate roots, for example ``root/rank0``,
``root/rank1``.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

from tiercache.errors import RootError
from tiercache.files.blockfile import FORMAT_VERSION

MARKER = ".tiercache-root"
LOCK = ".tiercache-root.lock"
QUARANTINE = "quarantine"
DIR_MODE = 0o700


def is_root(path: Path) -> bool:
    """True when ``path`` carries tiercache's marker."""
    return (path / MARKER).is_file()


def check_marker(root: Path) -> None:
    """Check the marker's format version.

    Raises:
        RootError: unreadable marker or another format version.
    """
    try:
        fmt = json.loads((root / MARKER).read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        raise RootError(f"file-tier root {str(root)!r} has an unreadable marker {MARKER}") from None
    if fmt != FORMAT_VERSION:
        raise RootError(f"file-tier root {str(root)!r} has format {fmt!r}; this tiercache reads {FORMAT_VERSION}")


def open_root(root: Path) -> None:
    """Create ``root`` (mode 0700) with its marker, or check an existing one.

    Raises:
        RootError: ``root`` is not a directory, cannot be created or written, or is a
            non-empty directory without tiercache's marker.
    """
    if root.exists() and not root.is_dir():
        raise RootError(f"file-tier root {str(root)!r} exists and is not a directory")
    try:
        root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    except OSError as exc:
        raise RootError(f"cannot create file-tier root {str(root)!r}: {exc.strerror}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise RootError(f"file-tier root {str(root)!r} is not writable by this user")
    if is_root(root):
        check_marker(root)
        return
    if any(root.iterdir()):
        raise RootError(
            f"refusing to use {str(root)!r} as a file-tier root: it is not empty and has no "
            f"{MARKER} marker (not created by tiercache); give an empty or new directory"
        )
    tmp = root / f".{MARKER}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps({"format": FORMAT_VERSION, "created": time.time()}))
        os.replace(tmp, root / MARKER)
    except OSError as exc:
        raise RootError(f"cannot write marker in file-tier root {str(root)!r}: {exc.strerror}") from None


class RootLock:
    """An exclusive ``flock`` on ``<root>/.tiercache-root.lock``, held until :meth:`release`.

    Raises:
        RootError: another process holds it (its pid is named when known).
    """

    def __init__(self, root: Path) -> None:
        self.path = root / LOCK
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise RootError(
                f"file-tier root {str(root)!r} is in use by another process (pid {holder}); one process "
                "writes a root at a time: give each process (rank) its own root, e.g. root/rank0"
            ) from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def lock_holder(root: Path) -> str | None:
    """The pid (as text) of the process holding ``root``'s lock, or None when it is free."""
    path = root / LOCK
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
