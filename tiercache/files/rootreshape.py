"""Changing a root array's members: :func:`reshape` (``tiercache roots add|remove``).

The blocks of every subdirectory that changes hands move to their new member. A change is
crash-safe, and the same call again always finishes it, wherever it was interrupted:

1. every member's record says first that a change is under way (``moving``: the members and
   table before it, and the members forgotten); the new members' records are written first,
   so a member that already says "moving" implies that every new member does too;
2. the files move: a rename, or across file systems a copy to a temporary name, flushed, a
   rename over the final name, then the unlink of the source (a block is always whole in one
   place or the other);
3. the records get the new table; members taken out lose theirs (plain, empty roots again),
   and an array of one member becomes a plain root.

An open in between is refused. A rerun reads the records of every root it is given (and of
the members the records name and prove, :func:`~tiercache.files.rootarray.member_states`,
where the CLI is given one member), finishes the interrupted change, and then applies what of
the request is still to do: a root already added, or already taken out, is left as it is.
Roots named by the operator but without a record yet (a plain root being made an array, a new
root whose record was not written yet) are recognized by their recorded path. Every member
stays locked exclusively throughout, and the tiercache temporary files in the members (left by
a killed change) are deleted under that lock.
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tiercache.errors import RootError
from tiercache.files.blockfile import SUBDIRS, is_temporary_name
from tiercache.files.rootarray import (
    ArrayRecord,
    Members,
    _array_lock,
    _cmd,
    _fsync_dir,
    balanced_table,
    holds_blocks,
    new_members,
    read_record,
    write_record,
)
from tiercache.files.rootdir import ARRAY, FILE_MODE, INDEX, STATS, TMP_OWN, RootDir, RootLock, is_root, open_root
from tiercache.settings import MAX_ROOTS

#: errors of ``copy_file_range`` that a plain read and write gets past (EXDEV: two file systems,
#: Linux 5.19 and later; the others: file systems or kernels without it)
_NO_RANGE = frozenset({errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM})
_COPY_CHUNK = 1 << 20


@dataclass
class ReshapeResult:
    """What :func:`reshape` did: members before and after (paths), subdirectories, files and
    bytes moved; ``forgotten``: members taken out without their blocks; ``finished``: an
    interrupted change it finished first; ``already``: what was asked and already so."""

    before: list[str]
    after: list[str]
    subdirs_moved: int = 0
    files_moved: int = 0
    bytes_moved: int = 0
    forgotten: list[str] | None = None
    finished: bool = False
    already: list[str] = field(default_factory=list)


def reshape(roots: Sequence[os.PathLike | str], add: Sequence[os.PathLike | str] = (),
            drop: Sequence[os.PathLike | str] = (), forget: Sequence[os.PathLike | str] = (),
            check_owner: bool = True, progress: Callable[[int], None] | None = None) -> ReshapeResult:
    """Add roots to, or take roots out of, the array of ``roots`` (or make an array of a plain
    root, or a plain root of an array of one): see the module's doc.

    Args:
        roots: the array's members (any order; all of them that are reachable), or one plain root.
        add: new roots (empty or new directories; created when missing).
        drop: members to take out; their blocks move to the others.
        forget: members whose device is gone: taken out without their blocks (those are lost;
            the only way tiercache drops blocks on purpose). Never opened.
        progress: called with the number of files moved so far.

    Raises:
        RootError: a root in use (every member is locked exclusively meanwhile), a new root that
            holds blocks or another array's record, a member that cannot be reached, a root to
            drop that is not a member and holds blocks, nothing left; and any failure of the
            file system while blocks move (no space, I/O error), after which every block is
            still whole in its old or its new place and the same call finishes the change.
    """
    forget_p = [os.path.abspath(p) for p in forget]
    forget_r = {os.path.realpath(p) for p in forget_p}
    named: list[str] = []
    seen: set[str] = set()
    for p in [*roots, *add, *drop]:
        a = os.path.abspath(p)
        r = os.path.realpath(a)
        if r not in seen and r not in forget_r:
            seen.add(r)
            named.append(a)
    if not named:
        raise RootError("no roots given")
    if len(named) > MAX_ROOTS:
        raise RootError(f"{len(named)} roots given; an array holds at most {MAX_ROOTS}")
    creatable = {os.path.realpath(os.path.abspath(p)) for p in [*roots, *add]}
    dirs: list[RootDir] = []
    locks: list[RootLock] = []
    try:
        for p in named:
            if os.path.realpath(p) in creatable:
                dirs.append(open_root(p, check_owner))
            elif is_root(p):  # a root to drop that no other list names: never created
                dirs.append(RootDir(p, check_owner))
        for d in dirs:
            locks.append(RootLock(d))
        with _array_lock(dirs):
            return _Change(dirs, add, drop, forget_p, progress).run()
    except OSError as exc:
        raise RootError(f"changing the root array's members stopped: {exc}. Every block is whole in its old or its "
                        "new place; fix the cause (free space, a device error) and run the same command again to "
                        "finish the change") from exc
    finally:
        for lk in locks:
            lk.release()
        for d in dirs:
            d.close()


def _real(p: os.PathLike | str) -> str:
    return os.path.realpath(p)


class _Change:
    """One :func:`reshape` call, under the locks of every root it was given."""

    def __init__(self, dirs: list[RootDir], add, drop, forget: list[str], progress) -> None:
        self.dirs = dirs
        self.by_real = {_real(d.path): d for d in dirs}
        self.add = [_real(p) for p in add]
        self.drop = [_real(p) for p in drop]
        self.forget = {_real(p) for p in forget}
        self.forget_paths = forget
        self.progress = progress
        self.result = ReshapeResult([], [])

    # -- the call ----------------------------------------------------------------------------
    def run(self) -> ReshapeResult:
        for d in self.dirs:
            _clear_temporaries(d)
        for _ in range(2):
            recs = {k: read_record(d) for k, d in self.by_real.items()}
            newest = self._newest(recs)
            if newest is not None and (newest.moving is not None or any(
                    r is not None and r.array_id == newest.array_id and r.with_member("") != newest.with_member("")
                    for r in recs.values())):
                self._finish(newest, recs)
                self.result.finished = True
                continue
            self._request(newest, recs)
            return self.result
        raise RootError("the root array's records changed while it was being changed: run the command again")

    def _newest(self, recs: dict[str, ArrayRecord | None]) -> ArrayRecord | None:
        ours = [r for r in recs.values() if r is not None]
        if not ours:
            return None
        newest = max(ours, key=lambda r: (r.generation, r.moving is not None))
        other = [k for k, r in recs.items() if r is not None and r.array_id != newest.array_id]
        if other:
            what = "new root(s)" if all(k in self.add for k in other) else "root(s)"
            raise RootError(f"{what} {', '.join(str(self.by_real[k].path) for k in other)} belong to another root "
                            f"array than {', '.join(newest.paths())}: give roots of one array, and new roots that "
                            "are empty directories")
        return newest

    def _identify(self, rec: ArrayRecord, recs: dict[str, ArrayRecord | None], members: Members) -> dict[str, RootDir]:
        """Member id -> the given root that is it: by its record, else (a root with no record
        yet) by the path the record gives it."""
        by_id = {r.member: self.by_real[k] for k, r in recs.items() if r is not None and r.array_id == rec.array_id}
        for mid, p in members:
            d = self.by_real.get(_real(p))
            if mid not in by_id and d is not None and recs[_real(p)] is None:
                by_id[mid] = d
        return by_id

    # -- an interrupted change -----------------------------------------------------------------
    def _finish(self, rec: ArrayRecord, recs: dict[str, ArrayRecord | None]) -> None:
        before, before_table = rec.moving if rec.moving is not None else (rec.members, rec.table)
        by_id = self._identify(rec, recs, before + rec.members)
        gone = set(rec.gone) | {mid for mid, p in before if mid not in by_id and _real(p) in self.forget}
        if not self.result.before:
            self.result.before = [p for _, p in before]
        missing = [p for mid, p in rec.members if mid not in by_id]
        unreached = [p for i, (mid, p) in enumerate(before) if mid not in by_id and mid not in gone
                     and any(t == i and rec.members[rec.table[s]][0] != mid for s, t in enumerate(before_table))]
        if missing or unreached:
            raise RootError(
                f"an interrupted change of the root array's members needs root(s) {', '.join(missing + unreached)}, "
                f"which were not given or cannot be reached: give them too (members before the change: "
                f"{_cmd(p for _, p in before)}; after: {_cmd(rec.paths())}), or name a member whose device is gone "
                "with --forget (its blocks are lost)")
        if rec.moving is not None:
            moving = ArrayRecord(rec.array_id, "", rec.members, rec.table, rec.generation, rec.moving,
                                 tuple(sorted(gone)))
            self._write_moving(moving, by_id, before, gone)
            self._move(before, before_table, rec.members, rec.table, by_id, gone)
        final = ArrayRecord(rec.array_id, "", rec.members, rec.table,
                            rec.generation + (1 if rec.moving is not None else 0))
        _final_records(final, by_id)
        self.result.after = rec.paths()
        self.result.forgotten = sorted({p for mid, p in before if mid in gone} | set(self.result.forgotten or ()))

    # -- the request ---------------------------------------------------------------------------
    def _request(self, rec: ArrayRecord | None, recs: dict[str, ArrayRecord | None]) -> None:
        if rec is None:  # plain roots only
            current = [k for k in self.by_real if k not in self.add and k not in self.drop]
            if len(current) != 1:
                raise RootError(f"give one plain root to make an array of, or an array's members (got "
                                f"{_cmd(str(self.by_real[k].path) for k in current) or 'none'})")
            d = self.by_real[current[0]]
            members: Members = ((uuid.uuid4().hex, os.path.abspath(d.path)),)
            table = (0,) * len(SUBDIRS)
            by_id = {members[0][0]: d}
            array_id, generation = uuid.uuid4().hex, 0
        else:
            members, table, by_id = rec.members, rec.table, self._identify(rec, recs, rec.members)
            array_id, generation = rec.array_id, rec.generation
        member_of = {_real(p): mid for mid, p in members}
        member_of.update({_real(d.path): mid for mid, d in by_id.items()})
        if not self.result.before:
            self.result.before = [p for _, p in members]
        adds = []
        for k in self.add:
            if k in member_of:
                self.result.already.append(f"{self.by_real[k].path} is a member already")
            elif recs.get(k) is not None:
                raise RootError(f"new root {str(self.by_real[k].path)!r} already belongs to a root array; give an "
                                "empty directory")
            elif holds_blocks(self.by_real[k]):
                raise RootError(f"new root {str(self.by_real[k].path)!r} holds blocks of its own; give an empty "
                                "directory")
            else:
                adds.append(self.by_real[k])
        drops = set()
        for k in self.drop:
            if k in member_of:
                drops.add(member_of[k])
            elif k not in self.by_real or holds_blocks(self.by_real[k]):
                what = "holds blocks" if k in self.by_real else "is not a tiercache root"
                raise RootError(f"root {k} is not a member of this array (members: "
                                f"{', '.join(p for _, p in members)}) and {what}: nothing was changed")
            else:  # a plain, empty root of tiercache's: what a member taken out becomes
                self.result.already.append(f"{k} is not a member (taken out already)")
        gone = {mid for mid, p in members if _real(p) in self.forget and mid not in by_id}
        gone |= {member_of[k] for k in self.forget if k in member_of}
        for p in self.forget_paths:
            if _real(p) not in member_of:
                self.result.already.append(f"{p} is not a member (taken out already)")
        unreached = [p for mid, p in members if mid not in by_id and mid not in gone]
        if unreached:
            raise RootError(f"root(s) {', '.join(unreached)} of the array are not reachable: give their paths, or "
                            "name them with --forget if their devices are gone (their blocks are lost)")
        if not adds and not drops and not gone:
            self.result.after = [p for _, p in members]
            return
        kept = tuple((mid, os.path.abspath(by_id[mid].path)) for mid, _ in members
                     if mid not in gone and mid not in drops)
        added = new_members(adds)
        after = kept + added
        if not after:
            raise RootError("an array needs at least one root: nothing would be left")
        index_of = {mid: i for i, (mid, _) in enumerate(after)}
        new_table = balanced_table(table, len(members), [index_of.get(mid, -1) for mid, _ in members], len(after))
        by_id.update({mid: d for (mid, _), d in zip(added, adds)})
        moving = ArrayRecord(array_id, "", after, new_table, generation + 1, (members, table), tuple(sorted(gone)))
        self._write_moving(moving, by_id, members, gone)
        self._move(members, table, after, new_table, by_id, gone)
        _final_records(ArrayRecord(array_id, "", after, new_table, generation + 2), by_id)
        self.result.after = [p for _, p in after]
        self.result.forgotten = [p for mid, p in members if mid in gone]

    # -- steps -------------------------------------------------------------------------------
    @staticmethod
    def _write_moving(moving: ArrayRecord, by_id: dict[str, RootDir], before: Members, gone: set[str]) -> None:
        """Every reachable member's record says "moving": the new members' first, so that an old
        member's "moving" record implies every new member's."""
        old = {mid for mid, _ in before}
        order = [mid for mid, _ in moving.members if mid not in old] + [mid for mid, _ in before]
        for mid in order:
            d = by_id.get(mid)
            if d is None or mid in gone:
                continue
            want = moving.with_member(mid)
            if read_record(d) != want:
                write_record(d, want)

    def _move(self, before: Members, before_table, after: Members, after_table, by_id: dict[str, RootDir],
              gone: set[str]) -> None:
        res = self.result
        for i, name in enumerate(SUBDIRS):
            src_id, dst_id = before[before_table[i]][0], after[after_table[i]][0]
            if src_id == dst_id:
                continue
            res.subdirs_moved += 1
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
                st = s.child(n).lstat()
                _move_file(s, dst, n)
                res.files_moved += 1
                res.bytes_moved += st.st_size if st is not None else 0
                if self.progress is not None:
                    self.progress(res.files_moved)
            _fsync_dir(dst)
            _fsync_dir(s)


def _final_records(final: ArrayRecord, by_id: dict[str, RootDir]) -> None:
    """The last step of a change: the members' records get ``final``; members taken out lose
    theirs (plain, empty roots again); one member left is a plain root."""
    after_ids = {mid for mid, _ in final.members}
    for mid, _ in final.members:
        d = by_id[mid]
        for name in (INDEX, STATS):  # the next open rebuilds the index (the home may have changed)
            d.child(name).unlink()
        if read_record(d) != final.with_member(mid):
            write_record(d, final.with_member(mid))
    for mid, d in by_id.items():
        if mid not in after_ids:
            for name in (INDEX, STATS, ARRAY):
                d.child(name).unlink()
            _fsync_dir(d)
    if len(final.members) == 1:
        home = by_id[final.members[0][0]]
        home.child(ARRAY).unlink()
        _fsync_dir(home)


def _clear_temporaries(d: RootDir) -> None:
    """Delete tiercache's temporary files in ``d`` and its block subdirectories (``d`` is
    locked exclusively: no writer is alive; a killed change leaves a record's or a copy's)."""
    for sub in [d] + d.block_dirs():
        with sub.scandir() as it:
            names = [e.name for e in it if is_temporary_name(e.name) and e.is_file(follow_symlinks=False)]
        for n in names:
            sub.child(n).unlink()


def _move_file(src: RootDir, dst: RootDir, name: str) -> None:
    """``src/name`` -> ``dst/name``: a rename on one file system, else a copy to a temporary
    name in ``dst`` (flushed), a rename over ``name``, then the unlink of the source. A failed
    copy leaves no temporary file and the source in place.

    Raises:
        OSError: the rename, the copy (e.g. ENOSPC) or the flush failed.
    """
    s, d = src.child(name), dst.child(name)
    try:
        s.rename(d)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    tmp = dst.child(f"{TMP_OWN}move.{name}.{os.getpid()}")
    try:
        fin = s.open(os.O_RDONLY)
        try:
            fout = tmp.open(os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
            try:
                _copy(fin, fout, os.fstat(fin).st_size)
                os.fdatasync(fout)
            finally:
                os.close(fout)
        finally:
            os.close(fin)
        tmp.rename(d)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    s.unlink()


def _copy(fin: int, fout: int, size: int) -> None:
    """Copy ``size`` bytes of ``fin`` to ``fout`` (both from offset 0): ``copy_file_range``,
    else (two file systems it does not span) reads and writes of 1 MiB."""
    off = 0
    try:
        while off < size:
            n = os.copy_file_range(fin, fout, size - off, off, off)
            if n == 0:
                return
            off += n
        return
    except OSError as exc:
        if exc.errno not in _NO_RANGE or off:
            raise
    while off < size:
        buf = os.pread(fin, min(_COPY_CHUNK, size - off), off)
        if not buf:
            return
        view = memoryview(buf)
        while view:
            n = os.pwrite(fout, view, off)
            off += n
            view = view[n:]


__all__ = ["ReshapeResult", "reshape"]
