"""Host time of one load piece's segment tables in the vLLM connector, by how a block's part of
a layer is cut into regions: what each scatter (and gather) call builds on the engine's thread
before its kernel launch (docs/performance/vllm.md, "A load inside the engine against the
worker alone").

A model geometry's per-layer KV caches on the CPU (only addresses are used), in vLLM 0.26's
FlashAttention layout (logically ``[blocks, kv_heads, block_size, 2 * head_dim]`` over memory
ordered ``[blocks, block_size, kv_heads, 2 * head_dim]``) or ``[2, blocks, ...]``. Regions come
from the connector's ``block_views`` (a part dense in memory is one region) and, as the
baseline, from the rule it replaced (split along the logical axes until each part is
contiguous). Per rule: regions per block, a 32-block piece's table bytes and the median host
time of its addresses and table (``plan_layout``, the planner's own layout), in ms.
Needs no GPU; imports the connector module (vLLM installed).

    python3 benchmarks/segment_tables.py --model llama-3.1-8b --layout packed
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from tiercache.copypaths.copykernels import CopyLauncher
from tiercache.copypaths.segmentplan import plan_layout
from tiercache.integrations.vllmconnector import block_views
from tiercache.resources import models_dir


def logical_views(t: torch.Tensor) -> list[tuple[int, int, int]]:
    """The former rule, block axis first: ``(address, bytes between blocks, bytes)`` per part
    after splitting along logical axis 1 until each block's part is contiguous."""
    parts = [t]
    while not all(p[0].is_contiguous() and p.stride(0) >= p[0].numel() for p in parts):
        parts = [q for p in parts for q in p.unbind(1)]
    es = t.element_size()
    return [(p.data_ptr(), p.stride(0) * es, p[0].numel() * es) for p in parts]


def connector_views(t: torch.Tensor, nb: int) -> list[tuple[int, int, int]]:
    return [(v.data_ptr(), v.stride(0), v.shape[1]) for v in block_views(t, nb)]


def piece_ms(regions: list[tuple[int, int, int]], piece: int, runs: int) -> tuple[float, int]:
    """Median ms to build a piece's addresses (pages and staging rows, as the connector's
    ``_segments`` does) and its table; and the table's bytes."""
    ptrs, strides, sizes = (np.array(c, dtype=np.int64) for c in zip(*regions))
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    row = int(sizes.sum())
    ids = np.arange(100, 100 + piece, dtype=np.int64)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        copies = []
        for size in np.unique(sizes):
            sel = np.flatnonzero(sizes == size)
            pages = (ptrs[sel][None, :] + ids[:, None] * strides[sel][None, :]).ravel()
            staged = (np.arange(piece, dtype=np.int64)[:, None] * row + offs[sel][None, :]).ravel()
            copies.append((pages, staged, int(size)))
        table, _ = plan_layout(copies, CopyLauncher.SM_SLOTS)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, int(table.nbytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--layout", choices=("packed", "flash"), default="packed")
    ap.add_argument("--piece", type=int, default=32, help="blocks per piece")
    ap.add_argument("--runs", type=int, default=30)
    a = ap.parse_args()
    cfg = json.loads((models_dir() / f"{a.model}.json").read_text())
    layers, heads, bs = cfg["num_hidden_layers"], cfg["num_key_value_heads"], 16
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    nb = a.piece + 200
    if a.layout == "packed":
        caches = [torch.empty((nb, bs, heads, 2 * hd), dtype=torch.float16).permute(0, 2, 1, 3)
                  for _ in range(layers)]
    else:
        caches = [torch.empty((2, nb, bs, heads, hd), dtype=torch.float16) for _ in range(layers)]
    for name, cut in (("logical axes (before)", lambda t: logical_views(t.movedim(1, 0) if t.shape[0] == 2 else t)),
                      ("block_views", lambda t: connector_views(t, nb))):
        regions = [r for t in caches for r in cut(t)]
        ms, nbytes = piece_ms(regions, a.piece, a.runs)
        print(json.dumps({"model": a.model, "layout": a.layout, "rule": name, "regions_per_block": len(regions),
                          "region_bytes": sorted({r[2] for r in regions}), "piece_blocks": a.piece,
                          "table_bytes": nbytes, "host_ms_per_piece": round(ms, 3)}))


if __name__ == "__main__":
    main()
