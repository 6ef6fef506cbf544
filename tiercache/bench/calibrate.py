"""Calibrate the copy-path thresholds on this machine.

The engine picks a path per batch by size: scattered blocks of at least ``batch_min_bytes`` go
to the copy engines (``cuMemcpyBatchAsync``), smaller ones to an SM kernel (the bulk kernel on
sm_90+, else the gather/scatter kernel); runs of consecutive slots of at least
``memcpy_min_bytes`` go to one ``cudaMemcpyAsync`` each. The defaults come from an H100 test machine on
PCIe Gen5 (docs/performance/copies.md). The crossovers move with the GPU, the link and the driver, so
:func:`calibrate` measures both paths on this machine and picks each threshold where the copy
engines reach the SM kernel.

Method: scattered blocks of each size (random slots on both sides), and runs of 16 KiB blocks of
each run length (consecutive on both sides), host -> device and device -> host, ``total`` bytes
per request, each method's samples taken in turn with the other's (CUDA events, medians). A
threshold is the smallest measured size from which, at that size and every larger one, the copy
engines move at least ``tolerance`` of what the SM kernel moves in both directions: at equal
speed the copy engines win, because they leave every SM to compute. (A lone block that the
batched copy takes is never sent to ``cudaMemcpyAsync`` as a run of one, whatever
``memcpy_min_bytes`` says: see :func:`tiercache.copypaths.copyplan.memcpy_runs`.)
"""

from __future__ import annotations

import numpy as np

from tiercache.errors import ConfigError, TierUnavailableError

KiB, MiB = 1024, 1 << 20
BLOCK_SIZES = (16 * KiB, 32 * KiB, 64 * KiB, 128 * KiB, 256 * KiB, 512 * KiB, 1 * MiB, 2 * MiB)
RUN_BYTES = (128 * KiB, 256 * KiB, 512 * KiB, 1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB)
RUN_BLOCK = 16 * KiB
# the config keys each kind of measurement sets
KEYS = {"blocks": "batch_min_bytes", "runs": "memcpy_min_bytes"}


def crossover(rows: list[dict], kind: str, tolerance: float) -> tuple[int, bool]:
    """The threshold for ``kind`` (``blocks`` or ``runs``) from measured rows.

    Args:
        rows: dicts with ``kind``, ``bytes`` (block size or run length), ``direction``
            (``h2d``/``d2h``), ``sm_gbps`` and ``ce_gbps``.
        kind: which rows to use.
        tolerance: the share of the SM kernel's bandwidth the copy engines must reach, in
            (0, 2].

    Returns:
        ``(bytes, reached)``: the smallest measured size from which the copy engines keep up at
        every larger size in both directions, and True; or, where they never do, twice the
        largest size measured and False.

    Raises:
        ConfigError: ``tolerance`` out of range, or no rows of ``kind``.
    """
    if not 0 < tolerance <= 2:
        raise ConfigError(f"tolerance = {tolerance!r} must be in (0, 2]")
    mine = [r for r in rows if r["kind"] == kind]
    if not mine:
        raise ConfigError(f"no measurements of kind {kind!r}")
    sizes = sorted({r["bytes"] for r in mine})
    wins = {s: all(r["ce_gbps"] >= tolerance * r["sm_gbps"] for r in mine if r["bytes"] == s) for s in sizes}
    best = None
    for s in reversed(sizes):  # walk down while the copy engines keep winning
        if not wins[s]:
            break
        best = s
    if best is None:
        return 2 * sizes[-1], False
    return best, True


def measure(device_id: int = 0, copy_kernel_sms: int | None = 8, total: int = 128 * MiB, reps: int = 5,
            block_sizes=BLOCK_SIZES, run_bytes=RUN_BYTES, seed: int = 0, log=print) -> list[dict]:
    """Both paths' bandwidth on this GPU (see the module docstring). Returns rows of ``kind``,
    ``bytes``, ``direction``, ``sm_path``, ``sm_gbps``, ``ce_path``, ``ce_gbps``, ``ratio``
    (copy engines over SM kernel).

    Raises:
        TierUnavailableError: no usable GPU.
    """
    from tiercache.cuda import cuda_status

    st = cuda_status()
    if not st.available:
        raise TierUnavailableError(f"calibration needs a GPU: {st.reason}")
    import cupy

    from tiercache.bench.timing import host_device_buffers, scattered_slots, time_many
    from tiercache.copypaths import CopyLauncher, Segments

    rng = np.random.default_rng(seed)
    la = CopyLauncher(device_id, max_sms=copy_kernel_sms)
    sm = "bulk" if la.bulk_available else "kernel"
    rows = []
    cases = [("blocks", b, b) for b in block_sizes if la.batch.available]
    cases += [("runs", r, RUN_BLOCK) for r in run_bytes]
    with cupy.cuda.Device(device_id):
        stream = cupy.cuda.Stream(non_blocking=True)
        for kind, size, block in cases:
            n = max(total // block, 2 * max(1, size // block))
            host, _owner, dev = host_device_buffers(n, block, device_id)
            if kind == "blocks":
                hs, ds, ce = scattered_slots(rng, n), scattered_slots(rng, n), "batch"
            else:  # runs of size // block consecutive slots, the runs in random order on both sides
                per = size // block
                starts = rng.permutation(n // per) * per
                hs = (starts[:, None] + np.arange(per)).reshape(-1)
                ds = (rng.permutation(n // per)[:, None] * per + np.arange(per)).reshape(-1)
                ce = "memcpy"
            seg = Segments(1, block, block)
            moved = hs.size * block
            for direction in ("h2d", "d2h"):
                src, s, dst, d = (host, hs, dev, ds) if direction == "h2d" else (dev, ds, host, hs)
                t = time_many({"sm": lambda: la.launch(src, s, dst, d, seg, stream, force=sm),
                                "ce": lambda: la.launch(src, s, dst, d, seg, stream, force=ce)},
                               stream, reps, back_to_back=4)
                row = {"kind": kind, "bytes": size, "direction": direction, "sm_path": sm,
                       "sm_gbps": moved / t["sm"] / 1e9, "ce_path": ce, "ce_gbps": moved / t["ce"] / 1e9}
                row["ratio"] = row["ce_gbps"] / row["sm_gbps"]
                rows.append(row)
                log(f"  {kind:>6} {size // KiB:>6} KiB {direction}: {sm} {row['sm_gbps']:.1f} GB/s, "
                    f"{ce} {row['ce_gbps']:.1f} GB/s ({row['ratio']:.0%})")
            del host, dev, _owner
    return rows


def calibrate(device_id: int = 0, copy_kernel_sms: int | None = 8, tolerance: float = 0.97, quick: bool = False,
              log=print) -> dict:
    """Measure (:func:`measure`) and pick ``batch_min_bytes`` and ``memcpy_min_bytes`` for this
    machine. Returns a JSON-ready report: ``rows``, ``transfer`` (the chosen values),
    ``reached`` (per key: whether the copy engines caught up within the sizes measured),
    ``tolerance``.

    Raises:
        TierUnavailableError: no usable GPU.
        ConfigError: ``tolerance`` out of (0, 2].
    """
    if not 0 < tolerance <= 2:
        raise ConfigError(f"tolerance = {tolerance!r} must be in (0, 2]")
    rows = measure(device_id, copy_kernel_sms, total=32 * MiB if quick else 128 * MiB, reps=3 if quick else 5, log=log)
    rep = {"job": "calibrate", "device_id": device_id, "copy_kernel_sms": copy_kernel_sms, "tolerance": tolerance,
           "rows": rows, "transfer": {}, "reached": {}}
    for kind, key in KEYS.items():
        if any(r["kind"] == kind for r in rows):
            value, reached = crossover(rows, kind, tolerance)
            rep["transfer"][key], rep["reached"][key] = value, reached
    return rep


def format_calibration(rep: dict) -> str:
    """The measurements as a table, then the ``[transfer]`` lines to put in a config."""
    out = [f"copy-path calibration (copy engines win from {rep['tolerance']:.0%} of the SM kernel)", "",
           f"  {'kind':>6} {'bytes':>10} {'dir':>4} {'SM path':>8} {'GB/s':>7} {'CE path':>8} {'GB/s':>7} {'CE/SM':>6}"]
    for r in rep["rows"]:
        size = f"{r['bytes'] // MiB} MiB" if r["bytes"] >= MiB else f"{r['bytes'] // KiB} KiB"
        out.append(f"  {r['kind']:>6} {size:>10} {r['direction']:>4} {r['sm_path']:>8} {r['sm_gbps']:>7.1f} "
                   f"{r['ce_path']:>8} {r['ce_gbps']:>7.1f} {r['ratio']:>6.0%}")
    out += ["", "[transfer]"]
    for key, value in rep["transfer"].items():
        note = "" if rep["reached"][key] else "  # the copy engines never caught up in the sizes measured"
        out.append(f"{key} = {value}{note}")
    return "\n".join(out)
