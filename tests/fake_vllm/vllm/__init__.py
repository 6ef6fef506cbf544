"""A stand-in for vLLM's offline API (``LLM``, ``SamplingParams``), for the CPU test of
``tiercache bench vllm-serve``'s orchestration (tests/test_bench_serve.py): tokens are a
function of the prompt, TTFTs shrink with the tokens a connector would have served, and the
prompt-token counters by source follow a simple model of the tiers (a prefix seen before is a
connector hit when a connector is configured, else recomputed). Like vLLM's, a request's
chunks reach a tier's files only on a later engine step (the next request's, or ``llm_engine.step``
while the scheduler ``has_requests``): another process over the same root sees them only then."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

__version__ = "0.0.fake"
_SEEN: set[bytes] = set()


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, detokenize=True):
        self.max_tokens = max_tokens


class LLM:
    def __init__(self, model, kv_transfer_config=None, **kw):
        self.connector = kv_transfer_config is not None
        extra = (getattr(kv_transfer_config, "kw", None) or {}).get("kv_connector_extra_config") or {}
        tiers = extra.get("secondary_tiers") or [extra]  # an offloading spec's tiers, or a connector's own keys
        root = tiers[0].get("root") or tiers[0].get("root_dir")
        self.files = Path(root) / "fake-stored.txt" if root else None
        if self.files:
            self.files.parent.mkdir(parents=True, exist_ok=True)
        self.pending: list[bytes] = []  # heads computed, their chunks not yet in the files
        if extra.get("piece_blocks"):  # as the real connector's worker warns in its engine's log
            print(f"tiercache: fake engine: pieces of {extra['piece_blocks']} blocks", file=sys.stderr)
        sched = SimpleNamespace(has_requests=lambda: bool(self.pending))
        self.llm_engine = SimpleNamespace(step=self._step, engine_core=SimpleNamespace(
            engine_core=SimpleNamespace(scheduler=sched)))
        self.counts = {"local_compute": 0.0, "local_cache_hit": 0.0, "external_kv_transfer": 0.0}
        crash = os.environ.get("FAKE_VLLM_CRASH")
        if crash and crash in json.dumps(getattr(kv_transfer_config, "kw", {}) or {}):
            raise RuntimeError("fake engine asked to fail")

    def generate(self, prompts, sp, use_tqdm=True):
        ids = prompts[0]["prompt_token_ids"]
        head = hashlib.sha256(repr(ids[:-256] if len(ids) > 256 else ids).encode()).digest()
        self._step()
        stored = set(bytes.fromhex(h) for h in self.files.read_text().split()) if self.files and self.files.exists() else set()
        hit = self.connector and (head in _SEEN or head in stored)
        _SEEN.add(head)
        if self.files and not hit:
            self.pending.append(head)
        cached = (len(ids) - 256) if hit else 0
        self.counts["external_kv_transfer"] += cached
        self.counts["local_compute"] += len(ids) - cached
        time.sleep(0.001)
        toks = [int.from_bytes(hashlib.sha256(repr(ids).encode()).digest()[i:i + 2], "little") for i in range(sp.max_tokens)]
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=toks)], num_cached_tokens=cached,
                                metrics=SimpleNamespace(first_token_latency=0.001 + (len(ids) - cached) * 1e-6))]

    def reset_prefix_cache(self, reset_running_requests=False):
        self.reset_calls = getattr(self, "reset_calls", 0) + 1
        return True

    def get_metrics(self):
        return [SimpleNamespace(name="vllm:prompt_tokens_by_source", labels={"source": k}, value=v)
                for k, v in self.counts.items()]

    def _step(self):
        if self.pending and self.files:
            with open(self.files, "a") as f:
                f.write("".join(h.hex() + "\n" for h in self.pending))
        self.pending.clear()
        return []
