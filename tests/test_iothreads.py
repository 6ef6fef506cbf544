"""The file tier's I/O threads: reads that wait for nothing go ahead of queued writes, ordered
tasks keep their order, tasks that wait on earlier tasks never deadlock, errors reach futures."""

from __future__ import annotations

import random
import threading
import time

import pytest

from tiercache.files.iothreads import IOThreads


def test_a_read_goes_ahead_of_queued_writes():
    pool = IOThreads(1)
    gate = threading.Event()
    order: list[str] = []
    pool.submit(gate.wait)  # the one thread is busy
    for i in range(5):
        pool.submit(order.append, f"w{i}")
    r = pool.submit(order.append, "r", read=True)
    gate.set()
    r.result(5)
    pool.shutdown()
    assert order == ["r", "w0", "w1", "w2", "w3", "w4"]


def test_write_first_threads_keep_writes_moving_under_a_stream_of_reads():
    pool = IOThreads(4)  # three read-first threads, one write-first
    stop = threading.Event()

    def busy_read():
        time.sleep(0.002)

    def feeder():
        while not stop.is_set():
            if sum(pool.pending()) < 64:
                pool.submit(busy_read, read=True)
            time.sleep(0.0005)

    t = threading.Thread(target=feeder)
    t.start()
    try:
        time.sleep(0.05)
        writes = [pool.submit(time.sleep, 0.001) for _ in range(20)]
        for w in writes:
            w.result(10)  # would time out if reads starved every write
    finally:
        stop.set()
        t.join()
        pool.shutdown()


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 8])
def test_tasks_that_wait_on_earlier_tasks_finish(threads):
    """Random chains: each ordered task waits on random earlier tasks (reads or ordered, as a
    write waits for the load still reading its row); reads wait on nothing. All finish, and an
    ordered task never starts before the ordered tasks queued ahead of it started."""
    rng = random.Random(threads)
    pool = IOThreads(threads)
    done: list[threading.Event] = []
    started: list[int] = []
    lock = threading.Lock()
    futures = []
    for i in range(400):
        ev = threading.Event()
        done.append(ev)
        if rng.random() < 0.5:
            def read(ev=ev):
                time.sleep(rng.random() * 0.0005)
                ev.set()
            futures.append(pool.submit(read, read=True))
        else:
            deps = [done[j] for j in rng.sample(range(i), min(i, 3))] if i else []

            def ordered(ev=ev, deps=deps, i=i):
                with lock:
                    started.append(i)
                for d in deps:
                    assert d.wait(5), "deadlock"
                ev.set()
            futures.append(pool.submit(ordered))
    for f in futures:
        f.result(30)
    pool.shutdown()
    if threads == 1:  # (with more, two threads may note their starts in either order)
        assert started == sorted(started)


def test_errors_reach_the_future_and_shutdown_runs_what_is_queued():
    pool = IOThreads(2)
    bad = pool.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        bad.result(5)
    seen: list[int] = []
    for i in range(50):
        pool.submit(seen.append, i, read=i % 2 == 0)
    assert list(pool.map(lambda x: x * 2, range(10))) == list(range(0, 20, 2))
    pool.shutdown()
    assert sorted(seen) == list(range(50))
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(print)
    with pytest.raises(ValueError, match=r"I/O threads = 0 must be in \[1, 256\]"):
        IOThreads(0)


def test_a_waiter_runs_its_own_task_only_when_it_is_first_in_its_queue():
    """run_here: a queued task first in its queue runs in the calling thread (result or error
    on its future); one behind another queued task, or one a thread already took, is left to
    the threads, so ordered tasks still start in the order they were queued."""
    pool = IOThreads(1)
    gate, busy = threading.Event(), threading.Event()
    pool.submit(lambda: (busy.set(), gate.wait(5)))  # the one thread is held
    assert busy.wait(5)
    ran_in: list[tuple[str, str]] = []

    def note(tag):
        ran_in.append((tag, threading.current_thread().name))
        return tag

    first = pool.submit(note, "first")
    second = pool.submit(note, "second")
    read = pool.submit(note, "read", read=True)
    assert not pool.run_here(second)  # "first" is queued ahead of it
    assert pool.run_here(read) and read.result(0) == "read"
    assert pool.run_here(first) and first.result(0) == "first"
    assert pool.run_here(second) and second.result(0) == "second"
    bad = pool.submit(lambda: 1 / 0)
    assert pool.run_here(bad)
    with pytest.raises(ZeroDivisionError):
        bad.result(0)
    me = threading.current_thread().name
    assert ran_in == [("read", me), ("first", me), ("second", me)]
    gate.set()
    taken = pool.submit(time.sleep, 0.05)
    time.sleep(0.02)  # the idle thread has it by now
    assert not pool.run_here(taken)
    taken.result(5)
    assert not pool.run_here(taken)  # done: nothing to run
    pool.shutdown()


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_waiters_helping_keep_chains_of_waits_finishing(threads):
    """Random chains as above, each waited for by one of several caller threads that first
    tries to run it itself: every task runs exactly once, none deadlocks."""
    rng = random.Random(threads)
    pool = IOThreads(threads)
    done = [threading.Event() for _ in range(300)]
    runs = [0] * 300
    futures = []
    for i in range(300):
        deps = [done[j] for j in rng.sample(range(i), min(i, 2))] if i and rng.random() < 0.5 else []

        def task(i=i, deps=deps):
            runs[i] += 1
            for d in deps:
                assert d.wait(5), "deadlock"
            done[i].set()
        futures.append(pool.submit(task, read=not deps))

    def waiter(mine):
        for f in mine:
            pool.run_here(f)
            f.result(30)
    callers = [threading.Thread(target=waiter, args=(futures[k::3],)) for k in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(60)
    pool.shutdown()
    assert runs == [1] * 300 and all(f.done() and f.exception() is None for f in futures)
