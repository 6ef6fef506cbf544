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
import fcntl
import json
import os
import re
import stat
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tiercache.errors import RootError
from tiercache.files.blockfile import SUBDIRS, block_location, parse_filename
from tiercache.files.rootdir import ARRAY, ARRAY_LOCK, FILE_MODE, RootDir, RootPath, is_root, open_root, write_atomic
from tiercache.keys import Key
from tiercache.settings import MAX_ROOTS

_FORMAT = 1
_SUBDIR_SET = frozenset(SUBDIRS)
_ID = re.compile(r"[0-9a-f]{32}")

Members = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ArrayRecord:
    """One member's ``.tiercache-array``.

    Attributes:
        array_id: the array's id (32 hex digits).
        member: this member's id (32 hex digits).
        members: ``(id, path)`` of every member, the home first (absolute paths as they were
            when the record was written: for messages, and where ``tiercache`` commands given
            one member look for the others, which must prove membership: :func:`member_states`).
        table: per subdirectory (in :data:`SUBDIRS` order), the index in ``members`` of its root.
        generation: counts the writes of the members' records.
        moving: while members change (``reshape``): ``(members, table)`` as they were before.
        gone: while members change: the ids of the members taken out without their blocks
            (``--forget``: their devices are gone).
    """

    array_id: str
    member: str
    members: Members
    table: tuple[int, ...]
    generation: int
    moving: tuple[Members, tuple[int, ...]] | None = None
    gone: tuple[str, ...] = ()

    def encode(self) -> bytes:
        out = {"format": _FORMAT, "array": self.array_id, "member": self.member,
               "members": [list(m) for m in self.members], "table": list(self.table), "generation": self.generation}
        if self.moving is not None:
            out["moving"] = {"members": [list(m) for m in self.moving[0]], "table": list(self.moving[1]),
                             "gone": list(self.gone)}
        return json.dumps(out).encode()

    @classmethod
    def decode(cls, data: bytes, where: str) -> ArrayRecord:
        """The record in ``data`` (read from ``where``), checked field by field: its contents
        are as untrusted as any file in a root.

        Raises:
            RootError: not a record of this format (naming what is wrong).
        """
        try:
            d = json.loads(data)
            if not isinstance(d, dict):
                raise ValueError(f"a JSON {type(d).__name__}, not an object")
            if d.get("format") != _FORMAT:
                raise ValueError(f"format {d.get('format')!r}")
            members = _members(d.get("members"))
            table = _table(d.get("table"), len(members))
            moving, gone = None, ()
            if d.get("moving") is not None:
                mv = d["moving"]
                if not isinstance(mv, dict):
                    raise ValueError("moving is not an object")
                before = _members(mv.get("members"))
                moving = (before, _table(mv.get("table"), len(before)))
                gone = tuple(_id(g, "gone member id") for g in _list(mv.get("gone", []), "gone"))
                if not set(gone) <= {i for i, _ in before}:
                    raise ValueError("a gone member that was not a member")
            gen = d.get("generation")
            if not isinstance(gen, int) or isinstance(gen, bool) or gen < 0:
                raise ValueError(f"generation {gen!r}")
            rec = cls(_id(d.get("array"), "array id"), _id(d.get("member"), "member id"), members, table, gen,
                      moving, gone)
        except (ValueError, TypeError, RecursionError) as exc:
            raise RootError(f"{where}/{ARRAY} is unreadable ({exc}): the root array's record is damaged") from None
        if rec.member not in {i for i, _ in rec.all_members()}:
            raise RootError(f"{where}/{ARRAY}: this member's id is not among the array's members")
        return rec

    def with_member(self, member: str) -> ArrayRecord:
        return ArrayRecord(self.array_id, member, self.members, self.table, self.generation, self.moving, self.gone)

    def paths(self) -> list[str]:
        return [p for _, p in self.members]

    def all_members(self) -> Members:
        """The members, then those of a change under way that are leaving (``moving``)."""
        ids = {i for i, _ in self.members}
        return self.members + tuple(m for m in (self.moving[0] if self.moving else ()) if m[0] not in ids)


def _list(v, what: str) -> list:
    if not isinstance(v, list):
        raise ValueError(f"{what} is not a list")
    return v


def _id(v, what: str) -> str:
    if not isinstance(v, str) or not _ID.fullmatch(v):
        raise ValueError(f"{what} {v!r} is not 32 hex digits")
    return v


def _members(v) -> Members:
    out = []
    for m in _list(v, "members"):
        if not (isinstance(m, list) and len(m) == 2 and isinstance(m[1], str)):
            raise ValueError(f"member {m!r} is not [id, path]")
        if not m[1] or "\0" in m[1]:
            raise ValueError(f"member path {m[1]!r}")
        out.append((_id(m[0], "member id"), m[1]))
    if not 1 <= len(out) <= MAX_ROOTS:
        raise ValueError(f"{len(out)} members (1 .. {MAX_ROOTS})")
    if len({i for i, _ in out}) != len(out):
        raise ValueError("a member id listed twice")
    return tuple(out)


def _table(v, n: int) -> tuple[int, ...]:
    t = _list(v, "table")
    if len(t) != len(SUBDIRS) or any(not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < n for x in t):
        raise ValueError(f"its table does not give each of the {len(SUBDIRS)} subdirectories a member")
    return tuple(t)


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
    _fsync_dir(rd)


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
def _array_lock(dirs: Sequence[RootDir]):
    """The exclusive lock on :data:`ARRAY_LOCK` of every root in ``dirs``, taken in the order of
    their (device, inode): the processes that open or change the same roots at once, under any
    spelling of their paths (symlinks, ``..``) and in any order, read and make the records one at
    a time, and never deadlock."""
    order = sorted(dirs, key=lambda d: (lambda st: (st.st_dev, st.st_ino))(os.fstat(d.fd)))
    fds: list[int] = []
    try:
        for d in order:
            fds.append(d.child(ARRAY_LOCK).open(os.O_RDWR | os.O_CREAT, FILE_MODE))
            fcntl.flock(fds[-1], fcntl.LOCK_EX)
        yield
    finally:
        for fd in reversed(fds):
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


def _cmd(paths: Iterable[os.PathLike | str]) -> str:
    return " ".join(str(p) for p in paths)


def new_members(dirs: Sequence[RootDir]) -> Members:
    """Fresh member ids for ``dirs``, with their absolute paths (what records hold)."""
    return tuple((uuid.uuid4().hex, os.path.abspath(d.path)) for d in dirs)


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
                members = new_members(dirs)
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
            f"to finish it (members recorded: {', '.join(p for _, p in some.all_members())})")
    by_id = {r.member: d for d, r in zip(dirs, recs)}
    missing = [p for mid, p in some.members if mid not in by_id]
    if missing:
        raise RootError(
            f"root(s) {', '.join(missing)} of the root array are missing from the roots given "
            f"({_cmd(d.path for d in dirs)}):"
            f" their blocks would be lost. List every member, or take a member out with `tiercache roots remove "
            f"{_cmd(some.paths())} --drop ROOT` (its blocks move to the others; --forget for a device that is gone)"
        )
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


@dataclass(frozen=True)
class MemberState:
    """One member of a root array, as a member's record names it, and whether it is there.

    Attributes:
        id: the member's id ("" for a plain root).
        path: where it is: the root asked about, or the path its record names.
        state: ``"here"`` (the root asked about), ``"proven"`` (a tiercache root whose own
            record names this array and this member id), ``"missing"`` (nothing at that path)
            or ``"unproven"`` (something else is there: ``why``).
        leaving: a member of an interrupted change that the change takes out.
        why: for ``"unproven"`` and ``"missing"``, what was found.
    """

    id: str
    path: Path
    state: str
    leaving: bool = False
    why: str = ""

    @property
    def present(self) -> bool:
        return self.state in ("here", "proven")


def member_states(root: os.PathLike | str) -> tuple[ArrayRecord | None, list[MemberState]]:
    """The record of ``root`` and every member of its array (the home first; during an
    interrupted change, the members that it takes out last), each checked where the record
    says it is: a path in a record is trusted only once that directory's own record names the
    same array and member id, so a crafted record never leads a command outside its array.
    Reads only.

    Raises:
        RootError: ``root`` is not a directory, or its record is unreadable.
    """
    rec = record_of(root)
    if rec is None:
        return None, [MemberState("", Path(root), "here")]
    after = {mid for mid, _ in rec.members}
    here = os.path.realpath(root)
    out = []
    for mid, p in rec.all_members():
        leaving = mid not in after
        if mid == rec.member:
            out.append(MemberState(mid, Path(root), "here", leaving))
            continue
        state, why = _prove(rec, mid, p, here)
        out.append(MemberState(mid, Path(p), state, leaving, why))
    return rec, out


def _prove(rec: ArrayRecord, mid: str, path: str, here: str) -> tuple[str, str]:
    """``(state, why)`` of the member ``mid`` that ``rec`` places at ``path`` (see :class:`MemberState`)."""
    if not os.path.isabs(path):
        return "unproven", "the record gives a relative path"
    if os.path.realpath(path) == here:
        return "unproven", "the record names the root itself under another member id"
    if not os.path.lexists(path):
        return "missing", "nothing at that path"
    if not is_root(path):
        return "unproven", "not a tiercache root (no .tiercache-root marker; an empty mount point?)"
    try:
        other = record_of(path)
    except RootError as exc:
        return "unproven", str(exc)
    if other is None:
        return "unproven", "a plain root, with no record of this array"
    if other.array_id != rec.array_id:
        return "unproven", "its record is of another root array"
    if other.member != mid:
        return "unproven", "its record names another member"
    return "proven", ""


def members_of(root: os.PathLike | str) -> list[Path]:
    """The member roots of the array that ``root`` belongs to, the home first (and, during an
    interrupted change, those it takes out), each proven by its own record
    (:func:`member_states`); ``[root]`` for a plain root. Reads only.

    Raises:
        RootError: the record is unreadable, or a member is missing or does not prove its
            membership (naming it and why).
    """
    _, states = member_states(root)
    bad = [s for s in states if not s.present]
    if bad:
        raise RootError(
            f"{str(root)!r} is a member of a root array whose member(s) "
            + "; ".join(f"{s.path} ({s.why})" for s in bad)
            + " cannot be reached or do not prove their membership: nothing was read or changed there. Mount "
            "the missing devices, or take them out with `tiercache roots remove "
            f"{root} --forget ROOT` (their blocks are lost)")
    return [s.path for s in states]


def subdir_owner(root: os.PathLike | str) -> dict[str, bool]:
    """Per block subdirectory, whether ``root`` holds it in its array (all True for a plain root)."""
    rec = record_of(root)
    if rec is None:
        return {n: True for n in SUBDIRS}
    ids = [mid for mid, _ in rec.members]
    if rec.member not in ids:  # leaving, in an interrupted change
        return {n: False for n in SUBDIRS}
    me = ids.index(rec.member)
    return {n: rec.table[i] == me for i, n in enumerate(SUBDIRS)}


def _fsync_dir(d: RootDir) -> None:
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=d.fd)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["ARRAY", "ARRAY_LOCK", "ArrayRecord", "MemberState", "RootArray", "balanced_table", "member_states",
           "members_of", "open_roots", "read_record", "record_of", "subdir_owner"]
