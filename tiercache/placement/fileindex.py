"""What the placement knows of the file tier beyond slots: the index rebuilt from a root's
files when a cache opens, and which positions of partial host blocks hold device blocks.

A host block may hold ``k`` device blocks (``blocks_per_host_block``); when an engine offloads
fewer than ``k`` of them, the positions it filled are kept here and in the block files' headers
(``extra.positions``), so that an onboard of a position never written is refused, after a
restart too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from tiercache.errors import InvalidKeyError, KeyNotFoundError
from tiercache.files import (FileTier, IndexUnusable, SavedIndex, ScanResult, changed_dirs, dir_times, load_index,
                             save_index)
from tiercache.keys import Key, key_from_text, key_text
from tiercache.placement.compactslots import CompactSlots, key_hash
from tiercache.placement.policy import Placement

log = logging.getLogger("tiercache")


class FileIndex:
    """The file tier's index and the positions of partial host blocks.

    Args:
        file_tier: the cache's file tier, or None (positions are then kept in memory only).
        placement: where every key sits.
        blocks_per_host_block: ``k``, device blocks per host block (positions are bits
            ``0 .. k-1``).
        counters: the cache's counters (``evicted_blocks``, ``quarantined_files``).
    """

    def __init__(self, file_tier: FileTier | None, placement: Placement, blocks_per_host_block: int,
                 counters: Counter) -> None:
        self.file_tier = file_tier
        self.placement = placement
        self.k = blocks_per_host_block
        self.counters = counters
        self.shared = file_tier is not None and file_tier.shared
        #: shared mode: key -> time.monotonic() until which it is known to be in no file
        self._absent: dict[Key, float] = {}
        self.negative_ttl_s = 1.0
        self.sweep_interval_s = 1.0
        self._last_sweep = 0.0
        #: shared mode: key -> time.monotonic() of this process's last refresh of its use time
        self._touched: dict[Key, float] = {}
        #: ``make_room(n, protect)`` frees ``n`` file-tier slots (set by the cache: the mover's)
        self.make_room: Callable[[int, set], None] = lambda n, protect: None
        #: shared mode: complete blocks in the root at the last sweep (None before one)
        self.on_disk_blocks: int | None = None
        #: key -> bit mask of the positions its host block holds, for partial host blocks only
        self.positions: dict[Key, int] = {}
        #: the open's scan (:meth:`rebuild`)
        self.scan: ScanResult | None = None
        #: seconds between index checkpoints (taken at the next call: :meth:`checkpoint`)
        self.checkpoint_interval_s = 60.0
        self.checkpoint_at = float("inf")
        self._reconciling: tuple[threading.Event, dict] | None = None
        self._stop_reconcile = threading.Event()
        #: subdirectories whose reconciliation has not been applied (saved as untrusted)
        self._untrusted: set[str] = set()

    def rebuild(self) -> ScanResult:
        """Open the root's blocks: from its saved index when there is a usable one (the
        subdirectories changed since it was saved are reconciled in the background:
        :meth:`reconcile`), else from a scan of every file (then saved as the index). Bad
        files are quarantined by the scan. Returns the scan (``from_index`` when the saved
        index was used; its counts fill in as the reconciliation ends)."""
        ft = self.file_tier
        ts = self.placement.tiers["file"]
        try:
            saved = load_index(ft.dir, tuple(ft.pools.values()))
        except (IndexUnusable, ValueError, KeyError, TypeError) as exc:  # ValueError etc.: bad JSON fields
            log.warning("tiercache: index of %s unusable (%s): rebuilt from the directory", ft.root, exc)
            saved = None
        if saved is None:
            return self._rebuild_by_scan()
        n = len(saved)
        keep = slice(None)
        if n > ft.num_slots:  # fewer slots than saved blocks: the most recent stay
            order = np.argsort(saved.tick, kind="stable")
            drop, kept = order[: n - ft.num_slots], np.sort(order[n - ft.num_slots:])
            tmp = CompactSlots("file", n)
            tmp.load(saved.klen, saved.kval, saved.hash, saved.tick, saved.group, saved.arena, saved.clock)
            gone = [tmp.key_of(int(s)) for s in drop]
            if not self.shared:
                ft.delete(gone)
                self.counters["evicted_blocks"] += len(gone)
            keep = kept
        klen, kval, hsh, tick, group = (a[keep] for a in (saved.klen, saved.kval, saved.hash, saved.tick, saved.group))
        ts.load(klen, kval, hsh, tick, group, saved.arena, saved.clock)
        if self.k > 1:
            for text, mask in saved.positions.items():
                k = key_from_text(text)
                if k in ts:
                    self.positions[k] = mask
                    ft.block_meta[k] = {"positions": mask}
        self.scan = ScanResult(from_index=True, removed_tmp=ft.remove_top_temporaries())
        self.checkpoint_at = time.monotonic() + self.checkpoint_interval_s
        changed = changed_dirs(ft.dir, saved.dir_times)
        if changed:
            self._start_reconcile(changed)
        return self.scan

    def _rebuild_by_scan(self) -> ScanResult:
        ft = self.file_tier
        scan = ft.scan()
        blocks = scan.blocks
        extra = len(blocks) - ft.num_slots
        if extra > 0:  # more files than slots: keep the most recent (a shared root's sweeps delete)
            if not self.shared:
                ft.delete([k for k, _ in blocks[:extra]])
                self.counters["evicted_blocks"] += extra
            blocks = blocks[extra:]
        self.placement.tiers["file"].add([k for k, _ in blocks])
        for k, meta in scan.extra.items():
            if "positions" in meta and self.k > 1:
                self.positions[k] = int(meta["positions"])
                ft.block_meta[k] = {"positions": int(meta["positions"])}
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
        subdirectory for the next open's reconciliation, which removes what a crash left."""
        ft = self.file_tier
        if ft is None:
            return
        self.apply_reconciled()
        times = dir_times(ft.dir)  # before the entries: a later change moves a time
        if not closing or self.shared:
            times = dict.fromkeys(times)
        for d in self._untrusted:  # not reconciled (yet): the next open lists them again
            times[d] = None
        ts = self.placement.tiers["file"]
        klen, kval, hsh, tick, group, arena, clock = ts.export()
        positions = {key_text(k): m for k, m in self.positions.items() if k in ts}
        try:
            save_index(ft.dir, tuple(ft.pools.values()),
                       SavedIndex(klen, kval, hsh, tick, group, arena, clock, positions, times),
                       fsync=ft.fsync != "none")
        except OSError as exc:
            log.warning("tiercache: could not save the index of %s: %s", ft.root, exc)
        self.checkpoint_at = time.monotonic() + self.checkpoint_interval_s

    def _start_reconcile(self, dirs: list[str]) -> None:
        """List ``dirs`` in a thread: files the index does not know are checked (header,
        size) and adopted, the index's keys with no file there are dropped, temporary files
        of dead writers removed and bad files quarantined. The results wait for
        :meth:`apply_reconciled` (the cache's thread)."""
        ft, ts = self.file_tier, self.placement.tiers["file"]
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
                    here = {key_hash(k) for k in res.known + res.incomplete} | {key_hash(k) for k, _ in res.blocks}
                    gone += [(s, t) for s, t, h in zip(slots.tolist(), ticks.tolist(), hashes.tolist()) if h not in here]
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
        ft, ts, scan = self.file_tier, self.placement.tiers["file"], out["scan"]
        self._untrusted = set()
        dropped = []
        for s, t in out["gone"]:
            if ts.tick_of(s) == t and s in ts.key_at:  # unchanged since the listing: really gone
                k = ts.key_at[s]
                ts.remove([k])
                dropped.append(k)
                self.forget_positions([k])
        adopt = [(k, m) for k, m in scan.blocks if not self.placement.contains(k)
                 and ft.path(k, next(iter(ft.pools))).lstat() is not None]
        room = ts.free_count
        if len(adopt) > room:
            adopt.sort(key=lambda km: km[1])
            self.make_room(len(adopt) - room, set())
            adopt = adopt[len(adopt) - ts.free_count:]
        ts.add([k for k, _ in adopt])
        for k, _ in adopt:
            meta = scan.extra.get(k, {})
            if "positions" in meta and self.k > 1:
                self.positions[k] = int(meta["positions"])
                ft.block_meta[k] = {"positions": int(meta["positions"])}
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

    # -- shared roots ----------------------------------------------------------------------
    def check_writable(self, keys: list[Key]) -> None:
        """Shared mode takes content keys only.

        Raises:
            InvalidKeyError: an integer key in shared mode (named).
        """
        if self.shared:
            ints = [k for k in keys if isinstance(k, int)]
            if ints:
                raise InvalidKeyError(
                    f"key {key_text(ints[0])} is an integer: a shared root takes content keys (bytes, e.g. a prefix "
                    "hash), which name the same bytes in every process; integer keys name one process's slots")

    def discover(self, keys: list[Key]) -> list[Key]:
        """Shared mode: register in the file tier those of ``keys`` that no tier holds but
        whose files another process has published since (a miss is not looked for again for
        ``negative_ttl_s``), making room with :attr:`make_room`. Returns the keys found."""
        if not self.shared:
            return []
        now = time.monotonic()
        todo = [k for k in dict.fromkeys(keys) if isinstance(k, bytes) and not self.placement.contains(k)
                and self._absent.get(k, 0.0) <= now]
        if not todo:
            return []
        found = self.file_tier.probe(todo)
        for k in set(todo) - set(found):
            self._absent[k] = now + self.negative_ttl_s
        if len(self._absent) > 65536:  # forget expired entries now and then
            self._absent = {k: t for k, t in self._absent.items() if t > now}
        if found:
            self.make_room(len(found), set(keys))
            self.placement.tiers["file"].add(found)
            self.counters["discovered_blocks"] += len(found)
            if self.k > 1:
                self._discover_positions(found)
        return found

    def _discover_positions(self, keys: list[Key]) -> None:
        """The positions of discovered partial host blocks, from their files' headers (a
        block whose header says nothing holds all ``k``)."""
        for k in keys:
            mask = self.file_tier.header_extra(k).get("positions")
            if mask is not None:
                self.positions[k] = int(mask)
                self.file_tier.block_meta[k] = {"positions": int(mask)}

    def after_read(self, keys: list[Key]) -> None:
        """Shared mode, after ``keys`` were read from files: refresh their use time in the
        root (:meth:`FileTier.touch <tiercache.files.FileTier.touch>`), so that the root's
        sweeps delete the least recently used blocks, not the oldest published; at most once
        per key every ``max(1, min_age_s)`` seconds per process."""
        if not self.shared or not keys:
            return
        now = time.monotonic()
        every = max(1.0, self.file_tier.min_age_s)
        todo = [k for k in keys if now - self._touched.get(k, -every) >= every]
        if not todo:
            return
        self.file_tier.touch(todo)
        for k in todo:
            self._touched[k] = now
        if len(self._touched) > 65536:  # forget old entries now and then
            self._touched = {k: t for k, t in self._touched.items() if now - t < every}

    def after_write(self, keep: set = frozenset()) -> None:
        """Shared mode, after file writes: at most every ``sweep_interval_s``, hold the root
        as a whole to the file tier's capacity (:meth:`FileTier.sweep
        <tiercache.files.FileTier.sweep>`; neither pinned keys nor ``keep`` are deleted) and
        forget the blocks deleted."""
        if not self.shared or time.monotonic() - self._last_sweep < self.sweep_interval_s:
            return
        self._last_sweep = time.monotonic()
        gone, self.on_disk_blocks = self.file_tier.sweep(self.placement.tiers["file"].num_slots,
                                                         set(self.placement.pins) | set(keep))
        self.placement.tiers["file"].remove(gone)
        self.counters["evicted_blocks"] += len(gone)

    def forget_positions(self, keys: list[Key]) -> None:
        """``keys``' host blocks are now whole (or gone): no partial-position record."""
        if self.positions:
            for k in keys:
                self.positions.pop(k, None)
                if self.file_tier is not None:
                    self.file_tier.block_meta.pop(k, None)

    def record_positions(self, keys: list[Key], masks: list[int]) -> None:
        """After an offload: key ``keys[i]``'s host block holds the positions of ``masks[i]``."""
        if self.k == 1:
            return
        full = (1 << self.k) - 1
        self.forget_positions([k for k, m in zip(keys, masks) if m == full])
        for k, m in zip(keys, masks):
            if m != full:
                self.positions[k] = m
                if self.file_tier is not None:
                    self.file_tier.block_meta[k] = {"positions": m}

    def check_positions(self, keys: list[Key], masks: list[int]) -> None:
        """Before an onboard of positions ``masks[i]`` of ``keys[i]``.

        Raises:
            KeyNotFoundError: a position its host block never held (named, with those it holds).
        """
        if self.k == 1 or not self.positions:
            return
        for k, m in zip(keys, masks):
            have = self.positions.get(k)
            if have is not None and m & ~have:
                missing = [j for j in range(self.k) if (m & ~have) >> j & 1]
                raise KeyNotFoundError(f"key {key_text(k)}: position(s) {missing} of its host block were never "
                                       f"offloaded (it holds positions {[j for j in range(self.k) if have >> j & 1]})")
