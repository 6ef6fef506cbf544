"""The file tier's I/O threads: reads that nothing waits for go ahead of queued writes.

A serving engine loads a prefix while the chunks of the requests before it are still being
written: with one first-in-first-out queue, the load waits behind every write queued before it
(measured in ``tiercache bench vllm-tier``'s "load while storing" row). Here a pool of
threads serves two first-in-first-out queues:

- the **read queue**: reads without dependencies (a task there never blocks on another task);
- the **ordered queue**: writes, reads that wait for earlier jobs, and background tasks
  (evictions' deletions), in the order they were submitted.

Most threads take from the read queue first; a quarter of them (at least one where there are
four or more) take from the ordered queue first, so writes keep going while reads keep coming.
(vLLM's ``fs`` tier splits its threads the same way, load-first and store-first; the rule
below for which task may wait in which queue is ours.)

No deadlock: only ordered-queue tasks can block, and only on tasks submitted before them. The
earliest unfinished ordered task depends only on finished ordered tasks and on reads; a read
it depends on was queued before it, so every read-first thread that since took an ordered task
found the read queue empty, i.e. took that read first or after it was taken. Threads start
on demand, up to ``threads``.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future
from typing import Callable, Iterable, Iterator

#: one thread in this many prefers the ordered queue (writes) over reads
WRITE_FIRST_EVERY = 4


class IOThreads:
    """A pool of ``threads`` I/O threads over a read queue and an ordered queue (module
    docstring).

    Args:
        threads: the most threads, 1..256 (started as work comes).
        name: the threads' name prefix.

    Raises:
        ValueError: ``threads`` out of range.
    """

    def __init__(self, threads: int, name: str = "tiercache-io") -> None:
        if not 1 <= threads <= 256:
            raise ValueError(f"I/O threads = {threads} must be in [1, 256]")
        self.max_threads = threads
        self._name = name
        self._reads: collections.deque = collections.deque()
        self._ordered: collections.deque = collections.deque()
        self._cv = threading.Condition(threading.Lock())
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._stop = False

    def submit(self, fn: Callable, *args, read: bool = False) -> Future:
        """Run ``fn(*args)`` on an I/O thread; returns its future. ``read=True``: a read that
        waits for no other task (it may go ahead of queued writes); otherwise the task keeps
        its place among the ordered tasks.

        Raises:
            RuntimeError: after :meth:`shutdown`.
        """
        fut: Future = Future()
        with self._cv:
            if self._stop:
                raise RuntimeError("the file tier's I/O threads are shut down")
            (self._reads if read else self._ordered).append((fut, fn, args))
            if self._idle:
                self._cv.notify()  # wakes one waiting thread (it counts as idle until it runs)
            if len(self._reads) + len(self._ordered) > self._idle and len(self._threads) < self.max_threads:
                self._start()
        return fut

    def run_here(self, fut: Future) -> bool:
        """Run the task of ``fut`` in the calling thread if it is still queued and first in its
        queue (so no task queued before it starts after it): what a caller that would
        otherwise sleep until the task is done does instead (:meth:`Outcome.help
        <tiercache.files.blockbatch.Outcome.help>`), saving two thread hand-offs per request.
        Returns whether it ran the task here (False: a thread has it, or it waits its turn)."""
        with self._cv:
            for q in (self._reads, self._ordered):
                if q and q[0][0] is fut:
                    _, fn, args = q.popleft()
                    break
            else:
                return False
        self._run(fut, fn, args)
        return True

    def map(self, fn: Callable, items: Iterable) -> Iterator:
        """``fn(item)`` of each item on the threads as reads; yields the results in order
        (re-raises the first error met)."""
        futures = [self.submit(fn, item, read=True) for item in items]
        return (f.result() for f in futures)

    def _start(self) -> None:
        i = len(self._threads)
        write_first = self.max_threads >= WRITE_FIRST_EVERY and i % WRITE_FIRST_EVERY == WRITE_FIRST_EVERY - 1
        t = threading.Thread(target=self._work, args=(write_first,), name=f"{self._name}_{i}", daemon=True)
        self._threads.append(t)
        t.start()

    def _work(self, write_first: bool) -> None:
        first, second = (self._ordered, self._reads) if write_first else (self._reads, self._ordered)
        while True:
            with self._cv:
                while not first and not second and not self._stop:
                    self._idle += 1
                    self._cv.wait()
                    self._idle -= 1
                if first:
                    fut, fn, args = first.popleft()
                elif second:
                    fut, fn, args = second.popleft()
                else:
                    return
            self._run(fut, fn, args)

    @staticmethod
    def _run(fut: Future, fn: Callable, args: tuple) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the future's owner
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def pending(self) -> tuple[int, int]:
        """Tasks queued and not started: (reads, ordered)."""
        with self._cv:
            return len(self._reads), len(self._ordered)

    def shutdown(self, wait: bool = True) -> None:
        """Run what is queued, then stop the threads (``wait``: join them)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
            threads = list(self._threads)
        if wait:
            for t in threads:
                if t is not threading.current_thread():
                    t.join()
