"""The vLLM connector's worker alone (tiercache/integrations/vllmconnector.py), without an engine:
how fast a prefix goes from block files into paged GPU KV caches, and where the time goes.

Builds one model geometry's KV caches on the GPU (FlashAttention's ``[2, blocks, block_size,
kv_heads, head_dim]`` per layer), stores ``--blocks`` random blocks into ``ROOT`` through the
worker, then loads them into other blocks ``--runs`` times and checks every byte. Per setting
(``--set key=value,...``, repeatable: each is one configuration of ``kv_connector_extra_config``),
prints the load's GB/s and the worker's own split of its time (waiting for reads, for a slab's
previous upload, submitting, issuing uploads).

    python3 benchmarks/connector_load.py /dev/shm/cl --model llama-3.1-8b --blocks 512 \\
        --set io_threads=16 --set io_threads=16,io_engine=threads

``--set io_mode=compat`` (or ``gds``) measures the loads that kvikio reads straight into device
slabs. vLLM need not be installed: the worker uses none of it, and where it is missing empty
stand-ins for its connector base classes let the connector's module import.

``--reads-only`` skips the uploads (what the reads alone take); every load's process CPU per
block (user, system; the C threads' included) is reported beside its time.

``--gil-threads N`` (with ``--gil-duty F``): N Python threads that hold the GIL a fraction F of
each millisecond while the loads run, as other threads of an engine's process may: whether a
load's issuing on the engine's thread suffers from them, and what ``load_switch_s`` and
``scatter_tables=load`` give back (docs/performance/vllm.md, "A load inside the engine against
the worker alone").

``--stores``: a prompt's stores behind a forward pass's stand-in (``--forward-ms`` of matmuls on
the engine's stream) instead: the host time of ``after_forward``, the GPU time it adds to the
engine's stream, when the blocks are free and when their files are written, and the process's
CPU per block from the plan to the files written (``--set verify_on=host`` against the default:
the stores' checksums made by the C threads or on the GPU), per run; ``--profile`` adds a
cProfile of one.

Reproduces docs/vllm.md, "The direct path: status" and "Checksums on the GPU", and
docs/performance/vllm.md, "A load taken apart".
"""

from __future__ import annotations

import argparse
import enum
import importlib.util
import json
import os
import shutil
import statistics
import sys
import time
import types
from pathlib import Path

import torch


def _stand_in_for_vllm() -> None:
    """The worker uses nothing of vLLM; the connector's module imports vLLM's connector base
    classes. Where vLLM is not installed (a GPU machine without it), empty classes of those
    names stand in, so that the worker alone can be measured there."""
    try:
        if importlib.util.find_spec("vllm") is not None:
            return
    except ValueError:
        return
    names = ["vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
             "vllm.distributed.kv_transfer.kv_connector.v1", "vllm.distributed.kv_transfer.kv_connector.v1.base"]
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    base = sys.modules[names[-1]]
    base.KVConnectorBase_V1 = type("KVConnectorBase_V1", (), {})  # type: ignore[attr-defined]
    base.KVConnectorMetadata = type("KVConnectorMetadata", (), {})  # type: ignore[attr-defined]
    base.KVConnectorRole = enum.Enum("KVConnectorRole", "SCHEDULER WORKER")  # type: ignore[attr-defined]


_stand_in_for_vllm()

from tiercache.integrations.vllmconnector import BlockTransfer, ConnectorWorker, parse_config  # noqa: E402
from tiercache.resources import models_dir  # noqa: E402


def _value(v: str):
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def _caches(model: str, blocks: int, layout: str = "flash") -> tuple[dict, int]:
    """The model geometry's KV caches on the GPU, ``2 * blocks + 8`` blocks of random bytes per
    layer, and that block count. ``layout``: ``flash`` ([2, blocks, block_size, heads,
    head_dim]) or ``packed`` (vLLM 0.26's FlashAttention: [blocks, heads, block_size, 2 *
    head_dim] over memory ordered [blocks, block_size, heads, 2 * head_dim])."""
    cfg = json.loads((models_dir() / f"{model}.json").read_text())
    layers, heads, bs = cfg["num_hidden_layers"], cfg["num_key_value_heads"], 16
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    nb = 2 * blocks + 8
    shape = (2, nb, bs, heads, hd) if layout == "flash" else (nb, bs, heads, 2 * hd)
    caches = {f"layers.{i}": torch.empty(shape, dtype=torch.float16, device="cuda") for i in range(layers)}
    for t in caches.values():
        t.view(torch.int16).random_(-30000, 30000)
    if layout == "packed":
        caches = {k: t.permute(0, 2, 1, 3) for k, t in caches.items()}
    return caches, nb


def _by_block(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A view of one layer's cache ``t`` (from :func:`_caches`) with the block axis first."""
    return t if layout == "packed" else t.transpose(0, 1)


def _worker(root: str, extra: dict) -> ConnectorWorker:
    """A fresh worker over ``root``: one directory, or several separated by commas (a root array)."""
    roots = root.split(",")
    for r in roots:
        shutil.rmtree(r, ignore_errors=True)
    settings = parse_config({"root": roots if len(roots) > 1 else roots[0], "fsync": "none", **extra})
    return ConnectorWorker(settings, [Path(r) for r in roots])


def run(root: str, model: str, blocks: int, runs: int, extra: dict, profile: bool = False,
        reads_only: bool = False, layout: str = "flash") -> dict:
    """Loads of ``blocks`` stored blocks, ``runs`` times: GB/s, the worker's split and the
    process's CPU per block (user and system, us; the C threads' included). ``reads_only``:
    the uploads are skipped (what the reads alone take; no bytes to check then)."""
    caches, nb = _caches(model, blocks, layout)
    w = _worker(root, extra)
    w.register(caches, nb)
    if reads_only:  # nothing goes up: no checksum of the GPU's to compare either
        w._upload = types.MethodType(lambda self, slab, ids: None, w)
        w._hash_slab = types.MethodType(lambda self, n, out: None, w)
        w._check_sums = types.MethodType(lambda self, t, failed_from, *check: failed_from, w)
    keys = [os.urandom(16) for _ in range(blocks)]
    src = list(range(blocks))
    w.plan_stores([BlockTransfer("s", keys, src)])
    w.after_forward()
    while w.get_finished({"s"})[0] is None:
        time.sleep(0.001)
    assert w.drain(120), "the stores did not finish"
    times, cpu = [], []
    for r in range(runs):
        dst = list(range(blocks + 8, 2 * blocks + 8))
        for t in caches.values():
            _by_block(t, layout)[blocks + 8:].zero_()
        torch.cuda.synchronize()
        before = dict(w.counters)
        prof = None
        if profile and r == runs - 1:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        c0, t0 = os.times(), time.perf_counter()
        w.load([BlockTransfer(f"l{r}", keys, dst)])
        times.append(time.perf_counter() - t0)
        c1 = os.times()
        cpu.append(((c1.user - c0.user) / blocks * 1e6, (c1.system - c0.system) / blocks * 1e6))
        if prof is not None:
            import io
            import pstats

            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(22)
            print(buf.getvalue(), flush=True)
        got = w.get_finished(set())[1]
        assert got == {f"l{r}"} and not w.load_errors(), (got, w.load_errors())
        for t in caches.values() if not reads_only else ():
            b = _by_block(t, layout)
            assert torch.equal(b[:blocks].view(torch.int16), b[blocks + 8:].view(torch.int16)), "bytes differ"
        split = {k: (w.counters[k] - before.get(k, 0)) / 1e3 for k in
                 ("read_wait_us", "slab_wait_us", "submit_us", "upload_issue_us",
                                                   "h2d_issue_us", "scatter_issue_us")}
    w.close()
    med = statistics.median(times)
    return {"settings": extra, "gbps": blocks * w.row_bytes / med / 1e9, "ms": med * 1e3,
            "ms_runs": [round(x * 1e3, 1) for x in times], "last_split_ms": split, "piece": w.piece,
            "load_slabs": w.load_slabs, "engine": w.store.ft.engine, "copies": w.copy_path,
            "regions_per_block": len(w.views),
            "load_path": w.load_path.name, "reads_only": reads_only, "checksums": w.verify_where,
            "gpu_checked_blocks": w.counters["gpu_checked_blocks"],
            "cpu_us_per_block": {"user": statistics.median(c[0] for c in cpu),
                                 "sys": statistics.median(c[1] for c in cpu)}}


class _GilHolders:
    """``n`` daemon threads, each holding the GIL (pure Python work) ``duty`` of every
    millisecond and sleeping the rest, until :meth:`stop`."""

    def __init__(self, n: int, duty: float) -> None:
        import threading

        self.stopping = False
        self.threads = [threading.Thread(target=self._run, args=(duty,), daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, duty: float) -> None:
        while not self.stopping:
            end = time.perf_counter() + duty * 1e-3
            while time.perf_counter() < end:
                sum(range(200))
            time.sleep((1 - duty) * 1e-3)

    def stop(self) -> None:
        self.stopping = True
        for t in self.threads:
            t.join()


def _busy(ms: float, kernels: int = 0) -> None:
    """About ``ms`` milliseconds of matmuls on the current stream (a forward pass's stand-in),
    then ``kernels`` small kernels queued behind them (an eager forward pass's launch queue)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t[0].record()
    a @ a
    t[1].record()
    t[1].synchronize()
    for _ in range(max(1, int(ms / max(t[0].elapsed_time(t[1]), 0.01)))):
        a @ a
    x = torch.zeros(256, device="cuda")
    for _ in range(kernels):
        x.add_(1)


def stores(root: str, model: str, blocks: int, runs: int, extra: dict, forward_ms: float, profile: bool,
           kernels: int = 0, layout: str = "flash") -> dict:
    """A prompt's stores behind a forward pass: ``blocks`` blocks planned, ``forward_ms`` of work
    queued on the engine's stream, then ``after_forward`` (vLLM's ``wait_for_save``). Reports its
    host time, the GPU time it adds to the engine's stream after the forward pass, and when the
    blocks are free (``get_finished``) from the forward pass's end; the last run's blocks are
    loaded back and compared."""
    caches, nb = _caches(model, blocks, layout)
    w = _worker(root, extra)
    w.register(caches, nb)
    rows, keys = [], []
    prof = None
    for r in range(runs):
        keys = [os.urandom(16) for _ in range(blocks)]
        torch.cuda.synchronize()
        _busy(forward_ms, kernels)
        fwd_end = torch.cuda.Event(enable_timing=True)
        fwd_end.record()
        if profile and r == runs - 1:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        c0, t0 = os.times(), time.perf_counter()
        w.plan_stores([BlockTransfer(f"s{r}", keys, list(range(blocks)))])
        w.after_forward()
        host = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
        after = torch.cuda.Event(enable_timing=True)
        after.record()
        fwd_end.synchronize()
        t_fwd = time.perf_counter()
        while w.get_finished({f"s{r}"})[0] is None:
            time.sleep(0.0005)
        freed = time.perf_counter() - t_fwd
        after.synchronize()
        assert w.drain(120), "the stores did not finish"
        written = time.perf_counter() - t_fwd
        c1 = os.times()
        rows.append({"after_forward_host_ms": host * 1e3, "stream_added_ms": fwd_end.elapsed_time(after),
                     "freed_after_forward_ms": freed * 1e3, "written_after_forward_ms": written * 1e3,
                     # the process's CPU from the plan to the files written (the C threads' included)
                     "cpu_user_us_per_block": (c1.user - c0.user) / blocks * 1e6,
                     "cpu_sys_us_per_block": (c1.system - c0.system) / blocks * 1e6})
    want = [_by_block(t, layout)[:blocks].clone() for t in caches.values()]
    dst = list(range(blocks + 8, 2 * blocks + 8))
    w.load([BlockTransfer("check", keys, dst)])
    assert not w.load_errors()
    for t, x in zip(caches.values(), want):
        assert torch.equal(_by_block(t, layout)[blocks + 8:].view(torch.int16), x.view(torch.int16)), "bytes differ"
    counters = dict(w.counters)
    w.close()
    out = {"settings": extra, "forward_ms": forward_ms, "kernels": kernels, "blocks": blocks, "runs": rows,
           "store_checksums": w.store_sums_where,
           "median": {k: statistics.median(x[k] for x in rows) for k in rows[0]}, "counters": counters}
    if prof is not None:
        import io
        import pstats

        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(18)
        out["profile"] = buf.getvalue()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="a directory, or several separated by commas (a root array)")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (seconds)")
    ap.add_argument("--set", action="append", default=[], help="key=value,... of kv_connector_extra_config")
    ap.add_argument("--stores", action="store_true", help="the stores behind a forward pass instead of loads")
    ap.add_argument("--forward-ms", type=float, default=200.0, help="the forward pass's stand-in (--stores)")
    ap.add_argument("--profile", action="store_true", help="cProfile of the last load (or store)")
    ap.add_argument("--reads-only", action="store_true", help="skip the uploads: what the reads alone take")
    ap.add_argument("--kernels", type=int, default=0, help="small kernels queued behind the forward (--stores)")
    ap.add_argument("--gil-threads", type=int, default=0, help="Python threads holding the GIL during the loads")
    ap.add_argument("--gil-duty", type=float, default=0.5, help="the fraction of each ms they hold it (--gil-threads)")
    ap.add_argument("--layout", choices=("flash", "packed"), default="flash",
                    help="the caches' layout: [2, blocks, ...] or vLLM 0.26's FlashAttention (see _caches)")
    a = ap.parse_args()
    if a.switch_interval:
        sys.setswitchinterval(a.switch_interval)
    for spec in a.set or [""]:
        extra = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
        extra = {k: _value(v) for k, v in extra.items()}
        if a.stores:
            out = stores(a.root, a.model, a.blocks, a.runs, extra, a.forward_ms, a.profile, a.kernels, a.layout)
            print(out.pop("profile", ""), flush=True)
        else:
            holders = _GilHolders(a.gil_threads, a.gil_duty) if a.gil_threads else None
            try:
                out = run(a.root, a.model, a.blocks, a.runs, extra, a.profile, a.reads_only, a.layout)
            finally:
                if holders is not None:
                    holders.stop()
            out["gil_threads"], out["gil_duty"] = a.gil_threads, a.gil_duty
        out["layout"] = a.layout
        print(out, flush=True)


if __name__ == "__main__":
    main()
