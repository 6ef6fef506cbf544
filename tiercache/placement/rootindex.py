"""The saved index of a root's file slots: what an open starts from, kept true to the directory.

A cache's file tier and a :class:`~tiercache.RowStore` (the engines' storage
tier) both hold their block files' keys in a :class:`~tiercache.placement.compactslots.CompactSlots`.
:class:`RootIndex` fills it at open from ``<root>/.tiercache-index``
(:mod:`tiercache.files.indexfile`) without reading a header, or from a scan of every file where
there is no usable index (one log line says why), saves it (:meth:`RootIndex.checkpoint`), and
reconciles in a thread the subdirectories that changed since it was saved: files it does not
know are checked and adopted, keys whose files are gone are dropped. The directory stays the
truth; every read still checks its file's header and XXH3.

What a user of the index adds (the cache's partial host blocks) comes through the hook methods
:meth:`RootIndex.loaded_meta`, :meth:`RootIndex.found_meta`, :meth:`RootIndex.meta_to_save` and
:meth:`RootIndex.forgotten`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from tiercache.errors import RootError, TierFullError
from tiercache.files import (
    SUBDIRS,
    FileTier,
    IndexUnusable,
    SavedIndex,
    ScanResult,
    changed_dirs,
    dir_times,
    load_index,
    save_index,
)
from tiercache.keys import Key
from tiercache.placement.compactslots import CompactSlots, key_hash

log = logging.getLogger("tiercache")


class RootIndex:
    """The saved index of ``file_tier``'s root, loaded into ``slots``.

    Args:
        file_tier: the file tier (its root, pools, slot count and scans).
        slots: the index in memory (the file tier's slots).
        counters: where ``evicted_blocks``, ``quarantined_files``, ``adopted_blocks`` and
            ``dropped_blocks`` are counted.
        contains: whether a key is held already (not to be adopted); default: in ``slots``.
        accepts: which keys this index may hold (a RowStore's: content keys only); default all.
        make_room: ``make_room(n, protect)`` frees ``n`` slots for adopted blocks, sparing the
            keys ``protect`` (default: nothing to free).
        busy: whether a key is being written now (a RowStore's stores in flight): never
            dropped by a reconciliation; default none.
        checkpoint_interval_s: seconds between index checkpoints (``[file] index_checkpoint_s``).
    """

    def __init__(self, file_tier: FileTier | None, slots: CompactSlots | None, counters: Counter,
                 contains: Callable[[Key], bool] | None = None, accepts: Callable[[Key], bool] | None = None,
                 make_room: Callable[[int, set], None] | None = None, checkpoint_interval_s: float = 60.0,
                 busy: Callable[[Key], bool] | None = None) -> None:
        self.file_tier = file_tier
        self._slots = slots
        self.counters = counters
        self.contains = contains or (lambda k: self.slots.find(k) >= 0)
        self.accepts = accepts or (lambda k: True)
        self.busy = busy or (lambda k: False)
        self.shared = file_tier is not None and file_tier.shared
        #: ``make_room(n, protect)`` frees ``n`` slots (for adopted blocks)
        self.make_room: Callable[[int, set], None] = make_room or (lambda n, protect: None)
        #: the open's scan (:meth:`rebuild`)
        self.scan: ScanResult | None = None
        #: seconds between index checkpoints (taken at the next call: :meth:`checkpoint`)
        self.checkpoint_interval_s = float(checkpoint_interval_s)
        self.checkpoint_at = float("inf")
        self._reconciling: tuple[threading.Event, dict] | None = None
        self._stop_reconcile = threading.Event()
        #: subdirectories whose reconciliation has not been applied (saved as untrusted)
        self._untrusted: set[str] = set()

    @property
    def slots(self) -> CompactSlots:
        """The index in memory."""
        return self._slots

    def tend(self) -> None:
        """Between the user's calls (its lock held): apply a finished reconciliation, save a
        checkpoint when one is due."""
        if self._reconciling is not None:
            self.apply_reconciled()
        if time.monotonic() >= self.checkpoint_at:
            self.checkpoint()

    # -- hooks (a user's own per-block metadata) ----------------------------------------------
    def loaded_meta(self, saved: dict[str, int]) -> None:
        """The saved index's per-block metadata (``positions``: key text -> mask), at open."""

    def found_meta(self, key: Key, meta: dict) -> None:
        """A scanned or adopted block's header ``extra``."""

    def meta_to_save(self) -> dict[str, int]:
        """The per-block metadata to save with the index (key text -> mask)."""
        return {}

    def forgotten(self, key: Key) -> None:
        """``key`` was dropped from the index (its files were gone)."""

    def rebuild(self) -> ScanResult:
        """Open the root's blocks: from its saved index when there is a usable one (the
        subdirectories changed since it was saved are reconciled in the background:
        :meth:`reconcile`), else from a scan of every file (then saved as the index). Bad
        files are quarantined by the scan. Returns the scan (``from_index`` when the saved
        index was used; its counts fill in as the reconciliation ends)."""
        ft = self.file_tier
        ts = self.slots
        try:
            saved = load_index(ft.dir, tuple(ft.pools.values()))
        except (IndexUnusable, ValueError, KeyError, TypeError) as exc:  # ValueError etc.: bad JSON fields
            log.warning("tiercache: index of %s unusable (%s): rebuilt from the directory", ft.root, exc)
            saved = None
        if saved is None:
            return self._rebuild_by_scan()
        n = len(saved)
        keep = slice(None)
        cap = ts.num_slots
        if n > cap:  # fewer slots than saved blocks: the most recent stay
            order = np.argsort(saved.tick, kind="stable")
            drop, kept = order[: n - cap], np.sort(order[n - cap:])
            tmp = CompactSlots("file", n)
            tmp.load(saved.klen, saved.kval, saved.hash, saved.tick, saved.group, saved.arena, saved.clock)
            gone = [tmp.key_of(int(s)) for s in drop]
            if not self.shared:
                ft.delete(gone)
                self.counters["evicted_blocks"] += len(gone)
            keep = kept
        klen, kval, hsh, tick, group = (a[keep] for a in (saved.klen, saved.kval, saved.hash, saved.tick, saved.group))
        ts.load(klen, kval, hsh, tick, group, saved.arena, saved.clock)
        self.loaded_meta(saved.positions)
        self.scan = ScanResult(from_index=True, removed_tmp=ft.remove_top_temporaries())
        self.checkpoint_at = time.monotonic() + self.checkpoint_interval_s
        changed = changed_dirs(ft.dir, saved.dir_times)
        if changed:
            self._start_reconcile(changed)
        return self.scan

    def _rebuild_by_scan(self) -> ScanResult:
        ft = self.file_tier
        scan = ft.scan()
        blocks = [(k, t) for k, t in scan.blocks if self.accepts(k)]
        extra = len(blocks) - self.slots.num_slots
        if extra > 0:  # more files than slots: keep the most recent (a shared root's sweeps delete)
            if not self.shared:
                ft.delete([k for k, _ in blocks[:extra]])
                self.counters["evicted_blocks"] += extra
            blocks = blocks[extra:]
        self.slots.add([k for k, _ in blocks])
        for k, meta in scan.extra.items():
            self.found_meta(k, meta)
        self.counters["quarantined_files"] += len(scan.quarantined)
        if scan.quarantined or scan.removed_tmp:
            log.warning("tiercache: reopened %s: %d block(s), %d temporary file(s) removed, %d file(s) quarantined",
                        ft.root, len(blocks), scan.removed_tmp, len(scan.quarantined))
        self.scan = scan
        self.checkpoint()
        return scan

    # -- the saved index -------------------------------------------------------------------
    def checkpoint(self, closing: bool = False) -> None:
        """Save the file tier's index in the root (:mod:`tiercache.files.indexfile`), between
        the cache's calls or at close. A failure is logged; the previous index stays (the
        directory is the truth either way).

        The subdirectories' times are saved as trusted (the next open lists none whose time
        has not moved) only by the close of an exclusive root (``closing``): only then is the
        listing of every subdirectory exactly the index's blocks. While the cache runs, free
        files (:mod:`tiercache.files.openfiles`) hold temporary names, and on a shared root
        other processes' files are not in this index: a checkpoint then marks every
        subdirectory for the next open's reconciliation, which removes what a crash left. At
        that close a subdirectory whose count of block files is not the index's is not
        trusted either (:meth:`_counted`)."""
        ft = self.file_tier
        if ft is None:
            return
        self.apply_reconciled()
        times = dir_times(ft.dir)  # before the entries: a later change moves a time
        if not closing or self.shared:
            times = dict.fromkeys(times)
        for d in self._untrusted:  # not reconciled (yet): the next open lists them again
            times[d] = None
        ts = self.slots
        klen, kval, hsh, tick, group, arena, clock = ts.export()
        if closing and not self.shared:
            self._counted(times, group)
        try:
            save_index(ft.dir, tuple(ft.pools.values()),
                       SavedIndex(klen, kval, hsh, tick, group, arena, clock, self.meta_to_save(), times),
                       fsync=ft.fsync != "none")
        except OSError as exc:
            log.warning("tiercache: could not save the index of %s: %s", ft.root, exc)
        self.checkpoint_at = time.monotonic() + self.checkpoint_interval_s

    def _counted(self, times: dict[str, int | None], group: np.ndarray) -> None:
        """At an exclusive root's close: a subdirectory whose number of block files differs
        from what the index holds there (files added or removed behind the cache's back while
        it ran) is saved untrusted, so that the next open lists it again. One listing of
        names, no stat (0.5 s for a million files, warm)."""
        ft = self.file_tier
        want = np.bincount(np.asarray(group, np.int64), minlength=len(SUBDIRS)) * len(ft.pools)
        for i, name in enumerate(SUBDIRS):
            if times.get(name) is None:
                continue
            try:
                sub = ft.dir.subdir(name)
                with sub.scandir() as it:
                    have = sum(1 for e in it if e.name.startswith("block_"))
            except (OSError, RootError):
                have = -1
            if have != want[i]:
                times[name] = None

    def _start_reconcile(self, dirs: list[str]) -> None:
        """List ``dirs`` in a thread: files the index does not know are checked (header,
        size) and adopted, the index's keys with no file there are dropped, temporary files
        of dead writers removed and bad files quarantined. The results wait for
        :meth:`apply_reconciled` (the cache's thread)."""
        ft, ts = self.file_tier, self.slots
        done, stop = threading.Event(), threading.Event()
        out: dict = {}

        def run() -> None:
            try:
                total, gone = ScanResult(), []
                for d in dirs:
                    if stop.is_set():
                        raise RuntimeError("stopped: the cache closed first")
                    slots, ticks, hashes = ts.in_group(int(d, 16))
                    res = ft.scan([d], known=lambda k: ts.find(k) >= 0)
                    # an incomplete block (a file of one pool gone: an eviction a crash cut short)
                    # cannot be served: dropped like a block whose files are all gone
                    here = {key_hash(k) for k in res.known} | {key_hash(k) for k, _ in res.blocks}
                    gone += [
                        (s, t) for s, t, h in zip(slots.tolist(), ticks.tolist(), hashes.tolist()) if h not in here
                    ]
                    total.blocks += res.blocks
                    total.known += res.known
                    total.incomplete += res.incomplete
                    total.quarantined += res.quarantined
                    total.foreign += res.foreign
                    total.extra.update(res.extra)
                    total.removed_tmp += res.removed_tmp
                out["scan"], out["gone"] = total, gone
            except BaseException as exc:  # logged when applied; the index keeps what it had
                out["error"] = exc
            finally:
                done.set()

        self._reconciling = (done, out)
        self._stop_reconcile = stop
        self._untrusted = set(dirs)
        threading.Thread(target=run, name="tiercache-reconcile", daemon=True).start()

    def _all_files_there(self, key: Key) -> bool:
        """Every pool's file of ``key`` is in the root now (one ``lstat`` each)."""
        ft = self.file_tier
        return all(ft.path(key, pool).lstat() is not None for pool in ft.pools)

    def stop(self) -> None:
        """The cache is closing: stop a reconciliation still running (at the next
        subdirectory; its subdirectories stay untrusted in the index) and wait for it."""
        if self._reconciling is not None:
            self._stop_reconcile.set()
            self._reconciling[0].wait()

    @property
    def reconciling(self) -> bool:
        """A reconciliation started at open is running or waits to be applied."""
        return self._reconciling is not None

    def apply_reconciled(self, timeout: float | None = 0.0) -> bool:
        """Apply a finished reconciliation (in the cache's thread): adopt the blocks it found
        that no tier holds (their files still there), drop the keys whose files were gone
        (unless written or read since). Waits up to ``timeout`` seconds (None: until it ends).
        Returns True when none is running any more."""
        if self._reconciling is None:
            return True
        done, out = self._reconciling
        if not done.wait(timeout):
            return False
        self._reconciling = None
        if "error" in out:
            log.warning("tiercache: reconciling the index of %s failed: %s", self.file_tier.root, out["error"])
            return True
        ft, ts, scan = self.file_tier, self.slots, out["scan"]
        self._untrusted = set()
        dropped = []
        for s, t in out["gone"]:
            if ts.tick_of(s) == t and s in ts.key_at:  # unchanged since the listing
                k = ts.key_at[s]
                # a write the listing came too early for: its key entered the index before its
                # files were published (still in flight, or done and not yet settled), so
                # dropping it would delete an acknowledged block
                if self.busy(k) or self._all_files_there(k):
                    continue
                ts.remove([k])
                dropped.append(k)
                self.forgotten(k)
        if dropped and not self.shared:  # what a cut eviction left of them (shared: the sweeps')
            ft.delete(dropped)
        adopt = [(k, m) for k, m in scan.blocks if self.accepts(k) and not self.contains(k)
                 and ft.path(k, next(iter(ft.pools))).lstat() is not None]
        if len(adopt) > ts.free_count:
            # the newest that the tier can hold at all (a shared root may hold more blocks than
            # this process's slots: other processes' files); room made for them where blocks may
            # leave (pinned ones may not: then only what is free is adopted)
            adopt.sort(key=lambda km: km[1])
            adopt = adopt[max(0, len(adopt) - ts.num_slots):]
            try:
                self.make_room(len(adopt) - ts.free_count, set())
            except TierFullError:
                pass
            adopt = adopt[max(0, len(adopt) - ts.free_count):]
        ts.add([k for k, _ in adopt])
        for k, _ in adopt:
            self.found_meta(k, scan.extra.get(k, {}))
        self.counters["quarantined_files"] += len(scan.quarantined)
        self.counters["adopted_blocks"] += len(adopt)
        self.counters["dropped_blocks"] += len(dropped)
        sc = self.scan
        sc.blocks, sc.quarantined = adopt, scan.quarantined
        sc.removed_tmp += scan.removed_tmp
        sc.incomplete, sc.foreign, sc.dropped = scan.incomplete, scan.foreign, dropped  # not known: a key per block
        if adopt or dropped or scan.quarantined or scan.removed_tmp:
            log.warning("tiercache: reconciled the index of %s: %d block(s) adopted, %d dropped (files gone), "
                        "%d temporary file(s) removed, %d file(s) quarantined", ft.root, len(adopt), len(dropped),
                        scan.removed_tmp, len(scan.quarantined))
        return True
