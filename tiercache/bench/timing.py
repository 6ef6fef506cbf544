"""Timing helpers shared by the benchmarks: CUDA-event medians of enqueued work, scattered slot
orders, and pinned host / device buffers of random bytes."""

from __future__ import annotations

import statistics

import numpy as np

from tiercache.memory import alloc_host


def time_one(fn, stream, reps: int, warmup: int = 2, back_to_back: int = 1) -> float:
    """Median seconds of one ``fn()`` enqueued on ``stream``, by CUDA events.

    With ``back_to_back = k > 1`` each sample enqueues ``fn()`` k times between the two events
    and divides by k: the steady-state time of a stream of requests, where the host prepares
    request i+1 while request i runs (what an engine submitting every step sees); with 1, the
    time from an idle stream, host-side preparation included."""
    return time_many({"fn": fn}, stream, reps, warmup, back_to_back)["fn"]


def time_many(fns: dict, stream, reps: int, warmup: int = 2, back_to_back: int = 1) -> dict:
    """:func:`time_one` of each of ``fns`` (name -> callable), their samples taken in turn (one of
    each per repetition), so that the machine's drift over the measurement (the contiguous
    baseline moved by up to 4% between consecutive measurements on the H100 test machines) reaches
    every method alike. Returns name -> median seconds."""
    import cupy

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    stream.synchronize()
    times: dict = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record(stream)
            for _ in range(back_to_back):
                fn()
            b.record(stream)
            b.synchronize()
            times[name].append(cupy.cuda.get_elapsed_time(a, b) / 1e3 / back_to_back)
    return {name: statistics.median(t) for name, t in times.items()}


def scattered_slots(rng: np.random.Generator, n: int) -> np.ndarray:
    """A permutation of ``range(n)`` with no two consecutive values adjacent (no runs)."""
    while True:
        p = rng.permutation(n)
        if n < 3 or not (np.abs(np.diff(p)) == 1).any():
            return p
        bad = np.flatnonzero(np.abs(np.diff(p)) == 1)
        for i in bad:  # break runs by swapping with a random far element
            j = int(rng.integers(0, n))
            p[i + 1], p[j] = p[j], p[i + 1]
        if not (np.abs(np.diff(p)) == 1).any():
            return p


def host_device_buffers(n: int, block: int, device_id: int, host_rows: int | None = None, huge_pages: str = "auto"):
    """``(host, owner, dev)``: ``host_rows`` (default ``n``) rows of ``block`` random bytes in
    pinned memory (huge pages as the host tier would get them by default), ``n`` rows in VRAM."""
    import cupy

    rows = host_rows or n
    host, owner = alloc_host(rows * block, pinned=True, huge_pages=huge_pages)
    host = host.reshape(rows, block)
    host[:] = np.random.default_rng(0).integers(0, 256, size=(rows, block), dtype=np.uint8)
    with cupy.cuda.Device(device_id):
        dev = cupy.empty((n, block), dtype=cupy.uint8)
    return host, owner, dev
