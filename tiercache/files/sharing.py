"""What a root shared by many processes (``[file] sharing = "shared"``) needs from the file
system: who wrote a temporary file and whether it is provably abandoned, whether another
process has published a block, and the root's usage as a whole.

Temporary block files are named ``.tmp.<final>.<pid>.<tag><counter>`` (:func:`tmp_name`), where
``tag`` is :data:`BOOT_TAG`, 8 hex digits of this machine's boot id and PID namespace (the
root's own index, stats and marker files: ``.tmp.own.<name>.<pid>.<tag>``): on the same machine,
boot and PID namespace a writer is provably gone when its pid is, and a file from another
machine, boot or container (whose pids this process cannot see) is abandoned only once it is
older than a limit (a live writer renames its temporary file within
seconds; one older than the limit loses it, and its write then fails cleanly: never a torn
block). Names without a tag (older releases) fall under the age limit.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import stat

from tiercache.files.blockfile import BOOT_TAG, TMP_PREFIX, file_size
from tiercache.files.rootdir import RootDir
from tiercache.geometry import PoolSpec
from tiercache.keys import Key

_tmp_ids = itertools.count(secrets.randbits(32))
_TMP_OWNER = re.compile(r"\.tmp\.block_[A-Za-z0-9_.-]+\.bin\.([0-9]+)\.([0-9a-f]+)", re.ASCII)
#: the root's own temporary files (index, stats, marker): ``.tmp.own.<name>.<pid>[.<tag>]``
_TMP_OWN_OWNER = re.compile(r"\.tmp\.own\.[A-Za-z0-9_.-]+?\.([0-9]+)(?:\.([0-9a-f]{8}))?", re.ASCII)


#: this process's pid (``os.getpid`` is a system call; one per written file showed in traces),
#: renewed in a forked child
_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))


def tmp_name(final_name: str) -> str:
    """A fresh temporary name for a file to be renamed over ``final_name``:
    ``.tmp.<final>.<pid>.<boot tag><counter>`` (a counter per process, ``O_EXCL`` guards the rest)."""
    return f"{TMP_PREFIX}{final_name}.{_pid[0]}.{BOOT_TAG}{next(_tmp_ids):x}"


def tmp_owner(name: str) -> tuple[int, str | None] | None:
    """``(pid, boot tag or None)`` of a temporary file's writer (a block file's, or the root's
    index, stats or marker file's); None for other names."""
    m = _TMP_OWNER.fullmatch(name)
    if m is not None:
        hexpart = m.group(2)
        return int(m.group(1)), (hexpart[:8] if len(hexpart) > 8 else None)
    m = _TMP_OWN_OWNER.fullmatch(name)
    return None if m is None else (int(m.group(1)), m.group(2))


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (a zombie counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def tmp_abandoned(name: str, age_s: float, max_age_s: float) -> bool:
    """Whether a temporary file may be removed while other processes use the root: written on
    this machine and boot, in this PID namespace, by a pid that no longer exists, or older than
    ``max_age_s`` (seconds) whoever wrote it (another machine, boot or container: its pid is not
    ours to check). Names that are not tiercache's temporary files: never."""
    owner = tmp_owner(name)
    if owner is None:
        return False
    pid, tag = owner
    if age_s > max_age_s:
        return True
    return tag == BOOT_TAG and not pid_alive(pid)


def published(root: RootDir, key: Key, pools: dict[str, PoolSpec]) -> float | None:
    """The newest modification time (seconds since the epoch) of ``key``'s files when every
    pool's file is published (a regular file of the exact size); None otherwise. No file is
    opened or followed."""
    newest = 0.0
    for name, pool in pools.items():
        path = root.block_path(key, name)
        try:
            st = os.stat(path.name, dir_fd=path.dir_fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_size != file_size(pool.block_nbytes):
            return None
        newest = max(newest, st.st_mtime)
    return newest
