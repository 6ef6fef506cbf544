"""The file-tier root: a trust boundary that no operation crosses.

``<root>/.tiercache-root`` (JSON with the format version) marks a directory as tiercache's own;
a non-empty directory without it is refused, so tiercache never writes into, or purges,
somebody else's files. ``<root>/.tiercache-root.lock`` is ``flock``-ed exclusively by the
process that opens the root for writing, for as long as it has it open; the kernel drops the
lock when that process dies (even by SIGKILL), so a crash never leaves a root locked. Several
processes (ranks) work side by side in separate roots, for example ``root/rank0``,
``root/rank1``.

The trust model (docs/sharing.md, "Trust model"): the root's *path* is named by the operator
and trusted; what is *inside* the root is not. A :class:`RootDir` holds a directory descriptor
of the root, and every operation on its contents (open, create, rename, unlink, stat, listing,
the ``quarantine/`` folder) goes through that descriptor (``openat``-style ``dir_fd``) with
``O_NOFOLLOW``, on plain names without a ``/``: a symbolic link, a directory or a device node
planted under one of tiercache's names is refused, never followed out of the root. The block
files' subdirectories (``00`` .. ``3f``, :data:`~tiercache.files.blockfile.SUBDIRS`) are
opened the same way, with ``O_NOFOLLOW | O_DIRECTORY``, and their descriptors held: a symlink
in place of one refuses its blocks, never leads out. By default
the root must also belong to this user and be writable by nobody else (``check_root_owner``):
block checksums (XXH3-64) detect corruption, not forgery, so whoever can write the root can
plant blocks.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import stat
import threading
import time
from pathlib import Path
from typing import Protocol

from tiercache.errors import RootError
from tiercache.files.blockfile import (
    BOOT_TAG,
    FORMAT_VERSION,
    SUBDIRS,
    block_location,
    is_temporary_name,
    parse_filename,
)
from tiercache.keys import Key

MARKER = ".tiercache-root"
LOCK = ".tiercache-root.lock"
INDEX = ".tiercache-index"  # the saved index (files/indexfile.py)
ARRAY = ".tiercache-array"  # a root array's record (files/rootarray.py)
ARRAY_LOCK = ".tiercache-array.lock"  # held while a root array's records are read or made
LAYOUT = ".tiercache-layout"  # what the blocks' bytes mean, where an integration records it (claim_layout)
QUARANTINE = "quarantine"
DIR_MODE = 0o700
FILE_MODE = 0o600
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class NotRegularFileError(OSError):
    """A name in the root that is not a regular file (a symlink, directory, device or FIFO)."""


class RootLike(Protocol):
    """What own files are written into: a :class:`RootDir`, or a root array (its home
    member's)."""

    def child(self, name: str) -> RootPath:
        """``name`` inside the root."""
        ...


class RootPath(os.PathLike):
    """One name inside an open root: the root's directory descriptor and a plain name.

    ``os.fspath`` gives the whole path (for messages and libraries that open by path, which
    should open :meth:`proc_path` of a descriptor from :meth:`open` instead).
    """

    __slots__ = ("dir_fd", "name", "_full", "_parent")

    def __init__(self, dir_fd: int | None, name: str, full: str | None, parent: str | None = None) -> None:
        self.dir_fd = dir_fd
        self.name = name
        self._full = full  # or None: ``parent`` and ``name`` joined when first asked (most paths never are)
        self._parent = parent

    @property
    def full(self) -> str:
        if self._full is None:
            self._full = os.path.join(self._parent, self.name)
        return self._full

    @classmethod
    def of(cls, path: os.PathLike | str) -> RootPath:
        """``path`` as a :class:`RootPath` (a plain path keeps ``dir_fd`` None: relative to the
        working directory, still without following a symlink in its last component)."""
        if isinstance(path, RootPath):
            return path
        return cls(None, os.fspath(path), os.fspath(path))

    def __fspath__(self) -> str:
        return self.full

    def __str__(self) -> str:
        return self.full

    def __repr__(self) -> str:
        return f"RootPath({self.full!r})"

    def with_name(self, name: str) -> RootPath:
        """A sibling: ``name`` in the same directory."""
        if self.dir_fd is None:
            return RootPath(None, str(Path(self.full).with_name(name)), str(Path(self.full).with_name(name)))
        return RootPath(self.dir_fd, name, None, os.path.dirname(self.full))

    def open(self, flags: int, mode: int = FILE_MODE, regular: bool = True) -> int:
        """``openat`` with ``O_NOFOLLOW``; with ``regular``, anything but a regular file is
        refused (:class:`NotRegularFileError`; a FIFO never blocks the open).

        Raises:
            NotRegularFileError, FileNotFoundError, OSError.
        """
        try:
            fd = os.open(self.name, flags | _NOFOLLOW | (os.O_NONBLOCK if regular else 0), mode, dir_fd=self.dir_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise NotRegularFileError(exc.errno, f"{self}: not a regular file (a symlink or directory)") from None
            raise
        if regular:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise NotRegularFileError(errno.EINVAL, f"{self}: not a regular file")
            os.set_blocking(fd, True)
        return fd

    def lstat(self) -> os.stat_result | None:
        """The name's own status (a symlink is not followed), or None when it is gone."""
        try:
            return os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def lstat_strict(self) -> os.stat_result:
        """The name's own status (a symlink is not followed).

        Raises:
            FileNotFoundError: the name is gone.
        """
        return os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)

    def is_file(self) -> bool:
        """A regular file (not a symlink to one)."""
        st = self.lstat()
        return st is not None and stat.S_ISREG(st.st_mode)

    def unlink(self) -> bool:
        """Remove the name (a symlink is removed, not its target). Returns False when it was
        gone.

        Raises:
            NotRegularFileError: the name is a directory (left in place).
        """
        try:
            os.unlink(self.name, dir_fd=self.dir_fd)
        except FileNotFoundError:
            return False
        except (IsADirectoryError, PermissionError) as exc:
            st = self.lstat()
            if st is not None and stat.S_ISDIR(st.st_mode):
                raise NotRegularFileError(
                    errno.EISDIR, f"{self}: a directory, not a block file; left in place"
                ) from None
            raise exc
        return True

    def rename(self, dst: RootPath) -> None:
        """Rename (atomically replacing ``dst``) within or between open directories; links
        are moved as links."""
        os.replace(self.name, dst.name, src_dir_fd=self.dir_fd, dst_dir_fd=dst.dir_fd)


def proc_path(fd: int) -> str:
    """A path that names the open file ``fd`` itself (``/proc/self/fd/N``), for libraries
    that open by path (kvikio): they reach the very file tiercache opened with ``O_NOFOLLOW``."""
    return f"/proc/self/fd/{fd}"


class RootDir:
    """An open root directory: the descriptor every operation on its contents goes through.

    Args:
        path: the root (the operator's path: symlinks in it are followed once, here).
        check_owner: refuse a root owned by another user or writable by group or others.

    Raises:
        RootError: no such directory, not a directory, or (``check_owner``) owned by another
            user or writable by others.
    """

    def __init__(self, path: os.PathLike | str, check_owner: bool = True) -> None:
        self.path = Path(path)
        self._text = str(self.path)
        self._subdirs: dict[str, RootDir] = {}
        self._subdir_lock = threading.Lock()
        self.fd = -1
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise RootError(f"file-tier root {str(self.path)!r} does not exist") from None
        except NotADirectoryError:
            raise RootError(f"file-tier root {str(self.path)!r} exists and is not a directory") from None
        except OSError as exc:
            raise RootError(f"cannot open file-tier root {str(self.path)!r}: {exc.strerror}") from None
        if check_owner:
            try:
                check_owner_and_mode(os.fstat(self.fd), str(self.path))
            except RootError:
                self.close()
                raise

    @property
    def members(self) -> tuple[RootDir, ...]:
        """The roots this one is made of: itself (a root array has several:
        :class:`~tiercache.files.rootarray.RootArray`)."""
        return (self,)

    def child(self, name: str) -> RootPath:
        """``name`` (a plain name, no ``/``) inside this directory."""
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"{name!r} is not a plain file name")
        return RootPath(self.fd, name, None, self._text)

    def scandir(self):
        """Entries of the directory (``entry.path`` is the plain name; use :meth:`child`)."""
        return os.scandir(self.fd)

    def subdir(self, name: str, create: bool = False) -> RootDir | None:
        """The sub-directory ``name`` (mode 0700 when created), opened without following a
        symlink; None when it does not exist and ``create`` is False.

        Raises:
            RootError: ``name`` exists but is a symlink or not a directory.
        """
        sub = self._subdirs.get(name)
        if sub is not None:
            return sub
        with self._subdir_lock:
            if name in self._subdirs:
                return self._subdirs[name]
            if create:
                try:
                    os.mkdir(name, DIR_MODE, dir_fd=self.fd)
                except FileExistsError:
                    pass
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=self.fd)
            except FileNotFoundError:
                return None
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise RootError(f"{self.path / name} is a symlink or not a directory; tiercache keeps its own "
                                    f"files there: remove it") from None
                if exc.errno in (errno.EACCES, errno.EPERM):
                    raise RootError(f"{self.path / name}: permission denied (mode {_mode_of(self.fd, name)}); "
                                    "tiercache needs to read and enter its root's directories: give the root's "
                                    "user access (chmod 700) or use another root") from None
                raise
            sub = RootDir.__new__(RootDir)
            sub.path, sub.fd, sub._subdirs, sub._subdir_lock = self.path / name, fd, {}, threading.Lock()
            sub._text = str(sub.path)
            self._subdirs[name] = sub
            return sub

    def block_dirs(self, create: bool = False) -> list[RootDir]:
        """The block files' subdirectories that exist (all of them, created mode 0700 where
        missing, with ``create``), opened as :meth:`subdir` opens them.

        Raises:
            RootError: one of them is a symlink or not a directory.
        """
        return [d for d in (self.subdir(name, create) for name in SUBDIRS) if d is not None]

    def block_path(self, key: Key, pool: str) -> RootPath:
        """The file of ``key`` in ``pool``: ``<subdir>/block_{key}_pool_{pool}.bin`` (the
        subdirectory created if missing).

        Raises:
            RootError: the subdirectory is a symlink or not a directory.
        """
        sub, name = block_location(key, pool)
        d = self._subdirs.get(sub) or self.subdir(sub, create=True)
        return RootPath(d.fd, name, None, d._text)

    def quarantine(self, path: RootPath) -> str | None:
        """Move ``path`` (a file, symlink or directory in this root or one of its
        subdirectories) into ``quarantine/``, under its own name or, when that is taken,
        ``name.1``, ``name.2``...: an earlier quarantined entry is evidence too and is never
        replaced. Returns the name it got there, or None when ``path`` was already gone.

        Raises:
            RootError: ``quarantine/`` is a symlink or not a directory.
            OSError: the move itself failed (e.g. permissions).
        """
        qdir = self.subdir(QUARANTINE, create=True)
        name, n = path.name, 0
        while qdir.child(name).lstat() is not None:
            n += 1
            name = f"{path.name}.{n}"
        try:
            path.rename(qdir.child(name))
        except FileNotFoundError:
            return None
        return name

    def close(self) -> None:
        for sub in self._subdirs.values():
            sub.close()
        self._subdirs = {}
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RootDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_owner_and_mode(st: os.stat_result, where: str) -> None:
    """Raises:
        RootError: the directory belongs to another user, or group or others may write it."""
    uid = os.geteuid()
    if st.st_uid != uid:
        raise RootError(f"file-tier root {where!r} belongs to uid {st.st_uid}, not this user (uid {uid}): anyone who "
                        "can write a root can plant blocks; use a root of your own, or set check_root_owner = false")
    if st.st_mode & 0o022:
        raise RootError(
            f"file-tier root {where!r} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}):"
            f" anyone who can write a root can plant blocks; chmod 700 it, or set check_root_owner = false"
        )


def _read_small(p: RootPath, limit: int = 4096) -> bytes:
    fd = p.open(os.O_RDONLY)
    try:
        return os.pread(fd, limit, 0)
    finally:
        os.close(fd)


def is_root(path: os.PathLike | str) -> bool:
    """True when ``path`` carries tiercache's marker (a regular file, not a symlink)."""
    try:
        st = os.stat(Path(path) / MARKER, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode)


def check_marker(root: RootDir) -> None:
    """Check the marker's format version.

    Raises:
        RootError: unreadable marker (or not a regular file) or another format version.
    """
    try:
        fmt = json.loads(_read_small(root.child(MARKER))).get("format")
    except (OSError, ValueError, AttributeError):
        raise RootError(f"file-tier root {str(root.path)!r} has an unreadable marker {MARKER}") from None
    if fmt != FORMAT_VERSION:
        raise RootError(f"file-tier root {str(root.path)!r} has format {fmt!r}; this tiercache reads {FORMAT_VERSION}")


def write_atomic(root: RootLike, name: str, data: bytes, fsync: bool = False) -> None:
    """Create or replace ``name`` in ``root`` with ``data``: a new temporary file (``O_EXCL``,
    no symlink followed; with ``fsync`` flushed to the device), then a rename over ``name``.

    Raises:
        OSError: the temporary file is removed and ``name`` is untouched.
    """
    tmp = root.child(f"{TMP_OWN}{name.lstrip('.')}-{next(_own_ids)}.{os.getpid()}.{BOOT_TAG}")
    fd = tmp.open(os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_TRUNC)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        tmp.rename(root.child(name))
    except BaseException:
        tmp.unlink()
        raise


def _mode_of(dir_fd: int, name: str) -> str:
    """``name``'s permission bits in octal (``?`` when even that cannot be read)."""
    try:
        return oct(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode & 0o7777)
    except OSError:
        return "?"


def claim_layout(path: os.PathLike | str, record: dict) -> bool:
    """Record in root ``path`` what its blocks' bytes mean, or check the record there.

    ``record`` (JSON-able) carries a ``"signature"`` string: an engine integration's
    description of the memory layout its blocks hold (the vLLM connector: its KV cache
    tensors' shapes and memory order). The first record made stays (``<root>/.tiercache-layout``,
    made by an atomic link: of two processes making one at once, one wins and the other is
    checked against it); a process whose signature differs is refused, so engines whose
    blocks mean different bytes never read each other's files. Returns True where this call
    made the record (a root of files written before records existed is adopted so).

    Raises:
        ConfigError: the root's record has another signature (both are named).
        RootError: the record cannot be read or written.
    """
    from tiercache.errors import ConfigError

    text = json.dumps(record, sort_keys=True).encode()
    root = RootDir(path, check_owner=False)
    try:
        for _ in range(3):
            try:
                have = json.loads(_read_small(root.child(LAYOUT), 1 << 16))
            except FileNotFoundError:
                tmp = root.child(f"{TMP_OWN}{LAYOUT.lstrip('.')}-{next(_own_ids)}.{os.getpid()}.{BOOT_TAG}")
                fd = tmp.open(os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                try:
                    os.write(fd, text)
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
                try:
                    os.link(tmp.name, LAYOUT, src_dir_fd=root.fd, dst_dir_fd=root.fd, follow_symlinks=False)
                    return True
                except FileExistsError:
                    continue  # another process made it first: checked against theirs
                finally:
                    tmp.unlink()
            except (OSError, ValueError) as exc:
                raise RootError(f"{str(root.path)!r}: unreadable layout record {LAYOUT}: {exc}") from None
            if not isinstance(have, dict) or have.get("signature") != record.get("signature"):
                theirs = have.get("describe", have) if isinstance(have, dict) else have
                raise ConfigError(
                    f"{str(root.path)!r} holds blocks of another memory layout than this process's: its record "
                    f"{LAYOUT} says {theirs!r}, this process has {record.get('describe', record)!r}. Use another "
                    "root, set what chose the layout (the attention backend, the KV cache layout) as the other "
                    "process has it, or free the root (tiercache purge --root)")
            return False
        raise RootError(f"{str(root.path)!r}: the layout record {LAYOUT} appears and vanishes")
    finally:
        root.close()


#: prefix of tiercache's own temporary files other than block files' (marker, stats)
TMP_OWN = ".tmp.own."
#: a counter in those names: two threads of one process may write one name at once
_own_ids = itertools.count()


def open_root(path: os.PathLike | str, check_owner: bool = True) -> RootDir:
    """Create ``path`` (mode 0700) with its marker, or check an existing one; returns it open.

    Raises:
        RootError: ``path`` is not a directory, cannot be created or written, is a non-empty
            directory without tiercache's marker, or fails the owner check.
    """
    path = Path(path)
    if os.path.lexists(path) and not path.is_dir():
        raise RootError(f"file-tier root {str(path)!r} exists and is not a directory")
    try:
        path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    except OSError as exc:
        raise RootError(f"cannot create file-tier root {str(path)!r}: {exc.strerror}") from None
    root = RootDir(path, check_owner)
    try:
        if not os.access(path, os.W_OK | os.X_OK):
            raise RootError(f"file-tier root {str(path)!r} is not writable by this user")
        marker = root.child(MARKER).lstat()
        if marker is None:
            with root.scandir() as it:
                # only tiercache's own names (a marker being written by another process opening
                # the same new root at this moment, its lock files): ours too
                foreign = any(classify(e.name) not in ("own", "temporary") for e in it)
            if foreign:
                # another process opening the same new root may have finished meanwhile: its
                # marker came first, then its block subdirectories
                marker = root.child(MARKER).lstat()
                if marker is None:
                    raise RootError(
                        f"refusing to use {str(path)!r} as a file-tier root: it is not empty and has no "
                        f"{MARKER} marker (not created by tiercache); give an empty or new directory")
        if marker is not None:
            if not stat.S_ISREG(marker.st_mode):
                raise RootError(f"file-tier root {str(path)!r}: its marker {MARKER} is not a regular file "
                                "(a symlink?); refusing the root")
            check_marker(root)
            return root
        try:
            write_atomic(root, MARKER, json.dumps({"format": FORMAT_VERSION, "created": time.time()}).encode())
        except OSError as exc:
            raise RootError(f"cannot write marker in file-tier root {str(path)!r}: {exc.strerror}") from None
    except BaseException:
        root.close()
        raise
    return root


class RootLock:
    """A ``flock`` on ``<root>/.tiercache-root.lock``, held until :meth:`release`: exclusive
    (one process writes the root; its pid is written into the lock file) or shared (any number
    of processes in ``[file] sharing = "shared"``; none in exclusive mode meanwhile).

    The lock file is opened without following a symlink and must be a regular file with one
    link (so it is never a way to truncate a file elsewhere).

    Args:
        root: the root (an open :class:`RootDir`, or its path).
        shared: take the shared lock.

    Raises:
        RootError: the lock is held in a conflicting mode (the exclusive holder's pid is named
            when known), or the lock's name is taken by something else than a regular file.
    """

    def __init__(self, root: RootDir | os.PathLike | str, shared: bool = False) -> None:
        own = not isinstance(root, RootDir)
        rd = RootDir(root, check_owner=False) if own else root
        self.path = rd.path / LOCK
        self.shared = shared
        try:
            try:
                self.fd = rd.child(LOCK).open(os.O_RDWR | os.O_CREAT)
            except NotRegularFileError:
                raise RootError(f"{self.path} is not a regular file (a symlink?): refusing the root") from None
            except PermissionError:
                raise RootError(f"{self.path}: permission denied (mode {_mode_of(rd.fd, LOCK)}); the root's lock "
                                "must be readable and writable by its user (chmod 600)") from None
            if os.fstat(self.fd).st_nlink != 1:
                os.close(self.fd)
                raise RootError(f"{self.path} has other hard links: refusing the root")
        finally:
            if own:
                rd.close()
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip()
            os.close(self.fd)
            where = str(self.path.parent)
            if shared:
                raise RootError(f"file-tier root {where!r} is in use by pid {holder or 'unknown'} in exclusive mode; "
                                "shared mode needs every process on it to open it with sharing = \"shared\"") from None
            if not holder:
                raise RootError(f"file-tier root {where!r} is in use by processes in shared mode; open it with "
                                "[file] sharing = \"shared\" too, or give this process its own root") from None
            if holder == str(os.getpid()):
                raise RootError(
                    f"file-tier root {where!r} is in use: already open in this process (exclusive mode): close "
                    'that cache first, use one cache for it, or open both with [file] sharing = "shared"'
                ) from None
            raise RootError(
                f"file-tier root {where!r} is in use by another process (pid {holder}); one process writes a root "
                "at a time in exclusive mode: give each process (rank) its own root, e.g. root/rank0, or open "
                "them all with [file] sharing = \"shared\""
            ) from None
        if shared:
            # holders of the shared lock leave no pid (there are many): clear a former exclusive holder's
            if os.fstat(self.fd).st_size:
                os.ftruncate(self.fd, 0)
        else:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def lock_holder(root: os.PathLike | str) -> str | None:
    """Who holds ``root``'s lock: the pid (as text) of the exclusive holder, ``"shared"`` when
    processes hold it in shared mode, or None when it is free (or the lock's name is not a
    regular file: no tiercache process can hold it)."""
    try:
        fd = RootPath.of(Path(root) / LOCK).open(os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 64, 0).decode(errors="replace").strip() or "shared"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


#: a cache's saved stats (``tiercache inspect``, ``tiercache top --root``)
STATS = ".tiercache-root.stats.json"


def classify(name: str) -> str:
    """``block`` (a canonical block file name), ``temporary`` (one of tiercache's temporary
    file names), ``own`` (marker, lock, stats, quarantine dir) or ``foreign``. Names only: the
    callers check that the name is a regular file."""
    if is_temporary_name(name):
        return "temporary"
    if name in (MARKER, LOCK, STATS, QUARANTINE, INDEX, ARRAY, ARRAY_LOCK, LAYOUT):
        return "own"
    return "block" if parse_filename(name) is not None else "foreign"


def write_stats(root: RootLike, stats: dict) -> None:
    """Save a cache's ``stats`` (with this pid and the time) as ``<root>/`` :data:`STATS`,
    atomically; best effort: an OSError leaves the old file."""
    snap = {**stats, "pid": os.getpid(), "time": time.time()}
    try:
        write_atomic(root, STATS, json.dumps(snap).encode())
    except OSError:
        pass
