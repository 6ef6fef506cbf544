"""Waiting for :class:`~tiercache.rowstore.RowStore` jobs from several threads at once.

A row store reports finished jobs through :meth:`RowStore.finished` (every job, to whoever
calls) and wakes waiters through its ``on_finish`` hook. :class:`RowJobs` is that hook plus a
table of results, so that each caller waits for its own job only (with the GIL released) and
gets its own :class:`~tiercache.rowstore.RowJobResult`: what the engine integrations need, where
an engine's threads (a load on the engine's thread, stores on a writer thread; SGLang's prefetch
and backup threads) use one store.
"""

from __future__ import annotations

import itertools
import threading


class RowJobs:
    """Submit and wait for jobs of one row store.

    Create it first, pass :meth:`finished_hook` as the store's ``on_finish``, then
    :meth:`attach` the store.

    Args:
        help: :meth:`wait` first runs the job's queued I/O in the waiting thread
            (:meth:`RowStore.help <tiercache.rowstore.RowStore.help>`): for callers that wait
            for each job as soon as they submit it.
    """

    def __init__(self, help: bool = False) -> None:
        self.help = help
        self.store = None
        self._ids = itertools.count(1)
        self._events: dict[int, threading.Event] = {}
        self._results: dict = {}
        self._lock = threading.Lock()

    def attach(self, store) -> None:
        """The row store whose jobs these are."""
        self.store = store

    def finished_hook(self, job_id) -> None:
        """The store's ``on_finish``: wakes the job's waiter (an I/O thread calls it)."""
        ev = self._events.get(job_id)
        if ev is not None:
            ev.set()

    def submit(self, fn, keys: list[bytes], rows, **kwargs) -> int:
        """``fn(keys, rows, job_id=..., **kwargs)`` (the store's ``submit_store`` or
        ``submit_load``; ``kwargs``: e.g. their ``pieces``); returns the job's id for
        :meth:`wait`. Errors of ``fn`` propagate (nothing submitted)."""
        jid = next(self._ids)
        self._events[jid] = threading.Event()
        try:
            fn(keys, rows, job_id=jid, **kwargs)
        except BaseException:
            self._events.pop(jid, None)
            raise
        return jid

    def wait(self, jid: int):
        """Wait (GIL released) for job ``jid``; its :class:`~tiercache.rowstore.RowJobResult`.
        With ``help``, the job's I/O that no thread has started runs here first."""
        if self.help:
            self.store.help(jid)
        self._events[jid].wait()
        with self._lock:
            for r in self.store.finished():
                self._results[r.job_id] = r
            del self._events[jid]
            return self._results.pop(jid)
