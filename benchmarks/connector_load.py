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

Reproduces docs/vllm.md, "The direct path: status".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

from tiercache.integrations.vllmconnector import BlockTransfer, ConnectorWorker, parse_config
from tiercache.resources import models_dir


def _value(v: str):
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def run(root: str, model: str, blocks: int, runs: int, extra: dict) -> dict:
    cfg = json.loads((models_dir() / f"{model}.json").read_text())
    layers, heads, bs = cfg["num_hidden_layers"], cfg["num_key_value_heads"], 16
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    nb = 2 * blocks + 8
    caches = {f"layers.{i}": torch.empty((2, nb, bs, heads, hd), dtype=torch.float16, device="cuda")
              for i in range(layers)}
    for t in caches.values():
        t.view(torch.int16).random_(-30000, 30000)
    shutil.rmtree(root, ignore_errors=True)
    settings = parse_config({"root": root, "fsync": "none", **extra})
    w = ConnectorWorker(settings, [Path(root)])
    w.register(caches, nb)
    keys = [os.urandom(16) for _ in range(blocks)]
    src = list(range(blocks))
    w.plan_stores([BlockTransfer("s", keys, src)])
    w.after_forward()
    while w.get_finished({"s"})[0] is None:
        time.sleep(0.001)
    assert w.drain(120), "the stores did not finish"
    times = []
    for r in range(runs):
        dst = list(range(blocks + 8, 2 * blocks + 8))
        for t in caches.values():
            t[:, blocks + 8:].zero_()
        torch.cuda.synchronize()
        before = dict(w.counters)
        t0 = time.perf_counter()
        w.load([BlockTransfer(f"l{r}", keys, dst)])
        times.append(time.perf_counter() - t0)
        got = w.get_finished(set())[1]
        assert got == {f"l{r}"} and not w.load_errors(), (got, w.load_errors())
        for t in caches.values():
            assert torch.equal(t[:, :blocks].view(torch.int16), t[:, blocks + 8:].view(torch.int16)), "bytes differ"
        split = {k: (w.counters[k] - before.get(k, 0)) / 1e3 for k in
                 ("read_wait_us", "slab_wait_us", "submit_us", "upload_issue_us",
                                                   "h2d_issue_us", "scatter_issue_us")}
    w.close()
    med = statistics.median(times)
    return {"settings": extra, "gbps": blocks * w.row_bytes / med / 1e9, "ms": med * 1e3,
            "ms_runs": [round(x * 1e3, 1) for x in times], "last_split_ms": split, "piece": w.piece,
            "load_slabs": w.load_slabs, "engine": w.store.ft.engine, "copies": w.copy_path}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (seconds)")
    ap.add_argument("--set", action="append", default=[], help="key=value,... of kv_connector_extra_config")
    a = ap.parse_args()
    if a.switch_interval:
        import sys

        sys.setswitchinterval(a.switch_interval)
    for spec in a.set or [""]:
        extra = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
        out = run(a.root, a.model, a.blocks, a.runs, {k: _value(v) for k, v in extra.items()})
        print(out, flush=True)


if __name__ == "__main__":
    main()
