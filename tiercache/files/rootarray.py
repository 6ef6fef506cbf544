"""Several roots as one file tier: a root array, one root per device.

A block's files go to its subdirectory (:func:`~tiercache.files.blockfile.block_subdir`: one of
64, by the key's hash); the array's *table* gives each of the 64 subdirectories to one member
root. Every member is a whole root (marker, lock, ``quarantine/``, the 64 subdirectories) and
holds ``.tiercache-array``: the array's id, this member's id, every member's id (and its path
when the record was written, for messages) and the table, with a generation number. Members are
known by their ids, so the roots may be listed in any order and mount points may change; the
first member of the record (the *home*) holds the array's saved index and stats.

What an open refuses, never guesses (:func:`open_roots`):

- a member missing from the list (its blocks would look lost): the error names its recorded
  path; ``tiercache roots remove`` takes it out explicitly (moving its blocks, or ``--forget``
  for a device that is gone);
- a root that is not a member (a new device): ``tiercache roots add`` moves a share of the
  blocks onto it first;
- a single root, or several plain roots, that already hold blocks and no record;
- members whose records disagree, or an interrupted change of members (run the same
  ``tiercache roots add/remove`` again: it finishes).

Fresh roots (no blocks, no records) listed together become an array at their first open: the
table deals the subdirectories out in turn (``i % n``), so each member holds 64/n of them.
Adding or removing members moves the fewest subdirectories that even the shares out again
(:func:`balanced_table`), under an exclusive lock of every member (:func:`reshape`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tiercache.errors import RootError
from tiercache.files.blockfile import SUBDIRS, block_location, is_temporary_name, parse_filename
from tiercache.files.rootdir import (ARRAY, ARRAY_LOCK, FILE_MODE, INDEX, STATS, RootDir, RootLock, RootPath,
                                    open_root, write_atomic)
from tiercache.keys import Key

from tiercache.settings import MAX_ROOTS

_FORMAT = 1
_SUBDIR_SET = frozenset(SUBDIRS)


@dataclass(frozen=True)
class ArrayRecord:
    """One member's ``.tiercache-array``.

    Attributes:
        array_id: the array's id (hex).
        member: this member's id (hex).
        members: ``(id, path)`` of every member, the home first (the paths as they were when
            the record was written: for messages).
        table: per subdirectory (in :data:`SUBDIRS` order), the index in ``members`` of its root.
        generation: counts the writes of the members' records.
        moving: while members change (``reshape``): ``(members, table)`` as they were before.
    """

    array_id: str
    member: str
    members: tuple[tuple[str, str], ...]
    table: tuple[int, ...]
    generation: int
    moving: tuple[tuple[tuple[str, str], ...], tuple[int, ...]] | None = None

    def encode(self) -> bytes:
        out = {"format": _FORMAT, "array": self.array_id, "member": self.member,
               "members": [list(m) for m in self.members], "table": list(self.table), "generation": self.generation}
        if self.moving is not None:
            out["moving"] = {"members": [list(m) for m in self.moving[0]], "table": list(self.moving[1])}
        return json.dumps(out).encode()

    @classmethod
    def decode(cls, data: bytes, where: str) -> ArrayRecord:
        try:
            d = json.loads(data)
            if d.get("format") != _FORMAT:
                raise ValueError(f"format {d.get('format')!r}")
            members = tuple((str(i), str(p)) for i, p in d["members"])
            table = tuple(int(t) for t in d["table"])
            moving = None
            if d.get("moving"):
                moving = (tuple((str(i), str(p)) for i, p in d["moving"]["members"]),
                          tuple(int(t) for t in d["moving"]["table"]))
            rec = cls(str(d["array"]), str(d["member"]), members, table, int(d["generation"]), moving)
        except (ValueError, KeyError, TypeError) as exc:
            raise RootError(f"{where}/{ARRAY} is unreadable ({exc}): the root array's record is damaged") from None
        if len(table) != len(SUBDIRS) or any(not 0 <= t < len(members) for t in table):
            raise RootError(f"{where}/{ARRAY}: its table does not give each of the {len(SUBDIRS)} subdirectories a member")
        if rec.member not in {i for i, _ in members}:
            raise RootError(f"{where}/{ARRAY}: this member's id is not among the array's members")
        return rec

    def with_member(self, member: str) -> ArrayRecord:
        return ArrayRecord(self.array_id, member, self.members, self.table, self.generation, self.moving)

    def paths(self) -> list[str]:
        return [p for _, p in self.members]


def read_record(rd: RootDir) -> ArrayRecord | None:
    """``rd``'s array record, or None when it has none.

    Raises:
        RootError: the record is not a regular file or cannot be read.
    """
    p = rd.child(ARRAY)
    st = p.lstat()
    if st is None:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise RootError(f"{p} is not a regular file (a symlink?): refusing the root")
    fd = p.open(os.O_RDONLY)
    try:
        data = os.pread(fd, 1 << 20, 0)
    finally:
        os.close(fd)
    return ArrayRecord.decode(data, str(rd.path))


def write_record(rd: RootDir, rec: ArrayRecord) -> None:
    """Replace ``rd``'s array record atomically and durably."""
    write_atomic(rd, ARRAY, rec.encode(), fsync=True)
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=rd.fd)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def balanced_table(old: Sequence[int], n_old: int, keep: Sequence[int], n_new: int) -> tuple[int, ...]:
    """A table over ``n_new`` members that moves the fewest subdirectories from ``old``.

    Args:
        old: the current table (member index per subdirectory, ``0 <= t < n_old``).
        keep: for each current member, its index among the new members, or -1 when it leaves.
        n_new: members after the change (the new ones are the indexes no current member maps to).

    Returns:
        The new table: each member holds ``64 // n_new`` or one more subdirectory; the members
        that held the most keep the extra ones; the subdirectories that move are those a leaving
        member held and the surplus of the members above their share (their last ones).
    """
    size = len(old)
    counts = [0] * n_new
    held: list[list[int]] = [[] for _ in range(n_new)]
    pool: list[int] = []
    for i, t in enumerate(old):
        m = keep[t]
        if m < 0:
            pool.append(i)
        else:
            held[m].append(i)
            counts[m] += 1
    base, extra = divmod(size, n_new)
    order = sorted(range(n_new), key=lambda m: (-counts[m], m))
    target = [base] * n_new
    for m in order[:extra]:
        target[m] += 1
    for m in range(n_new):
        while len(held[m]) > target[m]:
            pool.append(held[m].pop())
    pool.sort()
    new = [-1] * size
    for m in range(n_new):
        for i in held[m]:
            new[i] = m
    for m in range(n_new):
        while len(held[m]) < target[m]:
            i = pool.pop(0)
            held[m].append(i)
            new[i] = m
    return tuple(new)


class RootArray:
    """Open member roots as one root: what :class:`~tiercache.files.rootdir.RootDir` offers the
    file tier, with each block subdirectory in its member (names outside the 64 subdirectories,
    such as the saved index, stats and the top of the root, are the home's).

    Args:
        members: the open members, in the record's order (the home first).
        record: the array's record.
    """

    def __init__(self, members: list[RootDir], record: ArrayRecord) -> None:
        self.members = tuple(members)
        self.record = record
        self.home = members[0]
        self.path = self.home.path
        self.fd = self.home.fd
        self._owner = {name: members[record.table[i]] for i, name in enumerate(SUBDIRS)}

    def owner(self, subdir: str) -> RootDir:
        """The member that holds the block subdirectory ``subdir`` (the home for other names)."""
        return self._owner.get(subdir, self.home)

    def child(self, name: str) -> RootPath:
        return self.owner(name).child(name)

    def scandir(self):
        return self.home.scandir()

    def subdir(self, name: str, create: bool = False) -> RootDir | None:
        return self.owner(name).subdir(name, create)

    def block_dirs(self, create: bool = False) -> list[RootDir]:
        return [d for d in (self.subdir(name, create) for name in SUBDIRS) if d is not None]

    def block_path(self, key: Key, pool: str) -> RootPath:
        sub, name = block_location(key, pool)
        d = self._owner[sub].subdir(sub, create=True)
        return RootPath(d.fd, name, None, d._text)

    def quarantine(self, path: RootPath) -> str | None:
        """Into the ``quarantine/`` of the member that holds ``path`` (never across devices)."""
        parent = os.path.basename(os.path.dirname(os.fspath(path)))
        return self.owner(parent).quarantine(path)

    def close(self) -> None:
        for m in self.members:
            m.close()

    def __enter__(self) -> RootArray:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def _array_lock(dirs: list[RootDir]):
    """The exclusive lock on :data:`ARRAY_LOCK` of the member whose path sorts first: the
    processes that open the same roots at once read and make the records one at a time."""
    first = min(dirs, key=lambda d: str(d.path))
    fd = first.child(ARRAY_LOCK).open(os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def holds_blocks(rd: RootDir) -> bool:
    """Whether ``rd`` has a block file in its top or in a block subdirectory (names only)."""
    def any_block(d: RootDir | None) -> bool:
        if d is None:
            return False
        with d.scandir() as it:
            return any(parse_filename(e.name) is not None for e in it)
    return any_block(rd) or any(any_block(rd.subdir(n)) for n in SUBDIRS)


def _paths(roots: Sequence[os.PathLike | str]) -> list[Path]:
    paths = [Path(r) for r in roots]
    if not paths:
        raise RootError("no roots given")
    if len(paths) > MAX_ROOTS:
        raise RootError(f"{len(paths)} roots given; an array holds at most {MAX_ROOTS}")
    real = [os.path.realpath(p) for p in paths]
    dup = next((p for i, p in enumerate(paths) if real[i] in real[:i]), None)
    if dup is not None:
        raise RootError(f"root {str(dup)!r} is listed twice (or two paths name one directory)")
    return paths


def _cmd(paths: Sequence[os.PathLike | str]) -> str:
    return " ".join(str(p) for p in paths)


def open_roots(roots: Sequence[os.PathLike | str], check_owner: bool = True) -> RootDir | RootArray:
    """Open the file tier's roots: one plain root (a :class:`RootDir`, as
    :func:`~tiercache.files.rootdir.open_root` opens it) or an array of them.

    Raises:
        RootError: see :func:`~tiercache.files.rootdir.open_root` for each root; and what the
            module's doc lists (members missing or not in the array, roots with blocks and no
            record, records that disagree, an interrupted change of members), each naming the
            roots concerned and the command that fixes it.
    """
    paths = _paths(roots)
    dirs: list[RootDir] = []
    try:
        for p in paths:
            dirs.append(open_root(p, check_owner))
        with _array_lock(dirs):
            recs = [read_record(d) for d in dirs]
            if all(r is None for r in recs):
                if len(dirs) == 1:
                    return dirs[0]
                full = [str(d.path) for d in dirs if holds_blocks(d)]
                if full:
                    raise RootError(
                        f"root(s) {', '.join(full)} hold blocks and are not part of a root array: make the array "
                        f"with `tiercache roots add {_cmd(full)} --new ...` (it moves a share of the blocks onto each "
                        "new root); nothing was changed")
                array_id = uuid.uuid4().hex
                members = tuple((uuid.uuid4().hex, str(d.path)) for d in dirs)
                table = tuple(i % len(dirs) for i in range(len(SUBDIRS)))
                for d, (mid, _) in zip(dirs, members):
                    write_record(d, ArrayRecord(array_id, mid, members, table, 1))
                return RootArray(dirs, ArrayRecord(array_id, members[0][0], members, table, 1))
            return _assemble(dirs, recs)
    except BaseException:
        for d in dirs:
            d.close()
        raise


def _assemble(dirs: list[RootDir], recs: list[ArrayRecord | None]) -> RootDir | RootArray:
    some = next(r for r in recs if r is not None)
    plain = [str(d.path) for d, r in zip(dirs, recs) if r is None]
    other = [str(d.path) for d, r in zip(dirs, recs) if r is not None and r.array_id != some.array_id]
    if plain or other:
        raise RootError(
            f"root(s) {', '.join(plain + other)} are not members of the root array of {dirs[recs.index(some)].path} "
            f"(members: {', '.join(some.paths())}): add a new root with `tiercache roots add {_cmd(some.paths())} "
            f"--new ROOT`, or list only the array's members")
    gens = {(r.generation, r.moving is not None) for r in recs}
    if any(r.moving is not None for r in recs) or len(gens) > 1:
        raise RootError(
            f"a change of the root array's members was interrupted (records of generations "
            f"{sorted(g for g, _ in gens)}): run the same `tiercache roots add` or `tiercache roots remove` again "
            f"to finish it (members recorded: {', '.join(some.paths())})")
    by_id = {r.member: d for d, r in zip(dirs, recs)}
    missing = [p for mid, p in some.members if mid not in by_id]
    if missing:
        raise RootError(
            f"root(s) {', '.join(missing)} of the root array are missing from the roots given ({_cmd(d.path for d in dirs)}):"
            f" their blocks would be lost. List every member, or take a member out with `tiercache roots remove "
            f"{_cmd(some.paths())} --drop ROOT` (its blocks move to the others; --forget for a device that is gone)")
    if len(some.members) == 1:
        return by_id[some.members[0][0]]
    return RootArray([by_id[mid] for mid, _ in some.members], some)


def record_of(root: os.PathLike | str) -> ArrayRecord | None:
    """The array record of the root at ``root`` (None for a plain root). Reads only.

    Raises:
        RootError: no such directory, or the record is unreadable.
    """
    with RootDir(root, check_owner=False) as rd:
        return read_record(rd)


def members_of(root: os.PathLike | str) -> list[Path]:
    """The member roots of the array that ``root`` belongs to, the home first, as their
    records name them (``[root]`` for a plain root). Reads only.

    Raises:
        RootError: the record is unreadable.
    """
    rec = record_of(root)
    if rec is None:
        return [Path(root)]
    return [Path(p) if mid != rec.member else Path(root) for mid, p in rec.members]


def subdir_owner(root: os.PathLike | str) -> dict[str, bool]:
    """Per block subdirectory, whether ``root`` holds it in its array (all True for a plain root)."""
    rec = record_of(root)
    if rec is None:
        return {n: True for n in SUBDIRS}
    me = [mid for mid, _ in rec.members].index(rec.member)
    return {n: rec.table[i] == me for i, n in enumerate(SUBDIRS)}


# -- changing the members --------------------------------------------------------------------

def _move_file(src: RootDir, dst: RootDir, name: str) -> None:
    """``src/name`` -> ``dst/name``: a rename on one filesystem, else a copy to a temporary
    name in ``dst`` (flushed), a rename over ``name``, then the unlink of the source."""
    s, d = src.child(name), dst.child(name)
    try:
        s.rename(d)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    tmp = dst.child(f".tmp.own.move.{name}.{os.getpid()}")
    fin = s.open(os.O_RDONLY)
    try:
        fout = tmp.open(os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            size = os.fstat(fin).st_size
            off = 0
            while off < size:
                n = os.copy_file_range(fin, fout, size - off, off, off)
                if n == 0:
                    break
                off += n
            os.fdatasync(fout)
        finally:
            os.close(fout)
    finally:
        os.close(fin)
    tmp.rename(d)
    s.unlink()


def _fsync_dir(d: RootDir) -> None:
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=d.fd)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class ReshapeResult:
    """What :func:`reshape` did: members before and after (paths), subdirectories and files moved."""

    before: list[str]
    after: list[str]
    subdirs_moved: int = 0
    files_moved: int = 0
    bytes_moved: int = 0
    forgotten: list[str] | None = None


def reshape(roots: Sequence[os.PathLike | str], add: Sequence[os.PathLike | str] = (),
            drop: Sequence[os.PathLike | str] = (), forget: Sequence[os.PathLike | str] = (),
            check_owner: bool = True, progress: Callable[[int], None] | None = None) -> ReshapeResult:
    """Add roots to, or take roots out of, the array of ``roots`` (or make an array of a plain
    root): the blocks of every subdirectory that changes hands move to their new member.

    Crash-safe and idempotent: every member's record says first that a change is under way (with
    the table before it), then the files move (a rename, or a copy flushed before the source is
    removed: a block is always whole in one place or the other), then the records get the new
    table; an open in between is refused, and the same call again finishes the change.

    Args:
        roots: the array's current members (all of them; any order), or one plain root.
        add: new roots (empty, or new directories).
        drop: members to take out; their blocks move to the others.
        forget: members whose device is gone: taken out without their blocks (those are lost;
            the only way tiercache drops blocks on purpose).
        progress: called with the number of files moved so far.

    Raises:
        RootError: a root in use (every member is locked exclusively meanwhile), a new root that
            holds blocks or another array's record, a member missing, nothing left.
    """
    want_forget = [str(Path(p)) for p in forget]
    present = [p for p in _paths(list(roots) + list(add)) if str(p) not in want_forget]
    dirs: list[RootDir] = []
    locks: list[RootLock] = []
    try:
        for p in present:
            dirs.append(open_root(p, check_owner))
        for d in dirs:
            locks.append(RootLock(d))
        with _array_lock(dirs):
            return _reshape_locked(dirs, [str(Path(p)) for p in add], [str(Path(p)) for p in drop], want_forget,
                                   progress)
    finally:
        for lk in locks:
            lk.release()
        for d in dirs:
            d.close()


def _reshape_locked(dirs: list[RootDir], add: list[str], drop: list[str], forget: list[str],
                    progress: Callable[[int], None] | None) -> ReshapeResult:
    by_path = {str(d.path): d for d in dirs}
    recs = {str(d.path): read_record(d) for d in dirs}
    current = [p for p in by_path if p not in add]
    newest = max((r for r in recs.values() if r is not None), key=lambda r: r.generation, default=None)
    if newest is not None and newest.moving is not None:  # finish the interrupted change first
        before_members, before_table = newest.moving
        by_id = _ids(by_path, recs, newest)
        result = ReshapeResult([p for _, p in before_members], newest.paths())
        _finish(newest, by_id, before_members, before_table, newest.members, newest.table, result, progress)
        return result
    if newest is not None and any(r is not None and r.array_id == newest.array_id and
                                  (r.generation, r.moving) != (newest.generation, None) for r in recs.values()):
        # the last change wrote its final records to some members only: finish its last step
        by_id = _ids(by_path, recs, newest)
        _final_records(newest, by_id)
        return ReshapeResult(newest.paths(), newest.paths())
    for p in add:
        if recs[p] is not None:
            raise RootError(f"new root {p!r} already belongs to a root array; give an empty directory")
        if holds_blocks(by_path[p]):
            raise RootError(f"new root {p!r} holds blocks of its own; give an empty directory")
    if newest is None:  # a plain root becoming an array
        if len(current) != 1:
            raise RootError(f"give one plain root to make an array of (got {', '.join(current)})")
        mid = uuid.uuid4().hex
        rec = ArrayRecord(uuid.uuid4().hex, mid, ((mid, current[0]),), (0,) * len(SUBDIRS), 0)
        recs[current[0]] = rec
    else:
        rec = newest
    by_id = {r.member: by_path[p] for p, r in recs.items() if r is not None and r.array_id == rec.array_id}
    id_of = {str(by_id[mid].path): mid for mid in by_id}
    members = list(rec.members)
    missing = [p for mid, p in members if mid not in by_id and p not in forget]
    if missing:
        raise RootError(f"root(s) {', '.join(missing)} of the array are not reachable: give their paths, or name them "
                        "with --forget if their devices are gone (their blocks are lost)")
    gone_ids = {mid for mid, p in members if p in forget and mid not in by_id} | {
        id_of[p] for p in forget if p in id_of}
    drop_ids = {id_of[p] for p in drop if p in id_of}
    unknown = [p for p in drop if p not in id_of]
    if unknown:
        raise RootError(f"root(s) {', '.join(unknown)} are not members of this array (members: {', '.join(rec.paths())})")
    kept = [(mid, str(by_id[mid].path)) for mid, _ in members if mid not in gone_ids and mid not in drop_ids]
    new_members = tuple(kept + [(uuid.uuid4().hex, p) for p in add])
    if not new_members:
        raise RootError("an array needs at least one root: nothing would be left")
    index_of = {mid: i for i, (mid, _) in enumerate(new_members)}
    keep = [index_of.get(mid, -1) for mid, _ in members]
    table = balanced_table(rec.table, len(members), keep, len(new_members))
    for mid, p in new_members[len(kept):]:
        by_id[mid] = by_path[p]
    result = ReshapeResult(rec.paths(), [p for _, p in new_members],
                           forgotten=[p for mid, p in members if mid in gone_ids])
    moving_rec = ArrayRecord(rec.array_id, "", new_members, table, rec.generation + 1, (tuple(members), rec.table))
    for mid in {m for m, _ in members} | set(index_of):
        if mid in by_id and mid not in gone_ids:
            write_record(by_id[mid], moving_rec.with_member(mid))
    _finish(moving_rec, by_id, tuple(members), rec.table, new_members, table, result, progress, gone=gone_ids)
    return result


def _ids(by_path: dict[str, RootDir], recs: dict[str, ArrayRecord | None], rec: ArrayRecord) -> dict[str, RootDir]:
    return {r.member: by_path[p] for p, r in recs.items() if r is not None and r.array_id == rec.array_id}


def _finish(rec: ArrayRecord, by_id: dict[str, RootDir], before_members, before_table, after_members, after_table,
            result: ReshapeResult, progress, gone: set[str] = frozenset()) -> None:
    missing = [p for mid, p in after_members if mid not in by_id]
    if missing:
        raise RootError(f"root(s) {', '.join(missing)} of the array are not reachable: give their paths")
    for i, name in enumerate(SUBDIRS):
        src_id, dst_id = before_members[before_table[i]][0], after_members[after_table[i]][0]
        if src_id == dst_id:
            continue
        result.subdirs_moved += 1
        src = by_id.get(src_id)
        if src is None or src_id in gone:
            continue
        s = src.subdir(name)
        if s is None:
            continue
        dst = by_id[dst_id].subdir(name, create=True)
        with s.scandir() as it:
            names = [e.name for e in it if e.is_file(follow_symlinks=False)]
        for n in names:
            if is_temporary_name(n):
                s.child(n).unlink()
                continue
            size = s.child(n).lstat()
            _move_file(s, dst, n)
            result.files_moved += 1
            result.bytes_moved += size.st_size if size is not None else 0
            if progress is not None:
                progress(result.files_moved)
        _fsync_dir(dst)
        _fsync_dir(s)
    _final_records(ArrayRecord(rec.array_id, "", tuple(after_members), tuple(after_table), rec.generation + 1), by_id)


def _final_records(final: ArrayRecord, by_id: dict[str, RootDir]) -> None:
    """The last step of a change: the members' records get ``final``; members taken out lose
    theirs (plain, empty roots again); one member left is a plain root."""
    after_ids = {mid for mid, _ in final.members}
    for mid, _ in final.members:
        d = by_id[mid]
        for name in (INDEX, STATS):  # the next open rebuilds the index (the home may have changed)
            d.child(name).unlink()
        write_record(d, final.with_member(mid))
    for mid, d in by_id.items():
        if mid not in after_ids:
            for name in (INDEX, STATS, ARRAY):
                d.child(name).unlink()
    if len(final.members) == 1:
        by_id[final.members[0][0]].child(ARRAY).unlink()


__all__ = ["ARRAY", "ARRAY_LOCK", "ArrayRecord", "ReshapeResult", "RootArray", "balanced_table", "members_of",
           "open_roots", "read_record", "record_of", "reshape", "subdir_owner"]
