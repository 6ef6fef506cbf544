"""vLLM's own tiering code, driven on the CPU as its scheduler drives it.

:func:`build` makes the spec vLLM's ``OffloadingConnector`` makes from an ``OffloadingConfig``
(``TierCacheTieringSpec`` by ``spec_module_path``, or vLLM's ``TieringOffloadingSpec`` with the
tier's ``module_path``), on whichever vLLM is installed (0.26 or 0.33; what differs is in
``tiercache.integrations.vllmcompat``); ``spec.get_manager()`` then builds vLLM's real ``TieringOffloadingManager``
over a real ``CPUPrimaryTierOffloadingManager`` (its ``SharedOffloadRegion`` in /dev/shm) and
loads the tier through ``SecondaryTierFactory``. :class:`Engine` plays the scheduler and the
GPU worker: it stores chunks (bytes written into the primary rows, as the worker's GPU -> CPU
copy would), steps, and promotes chunks back, returning their bytes.

Also run as a script by the multi-process tests: ``python vllm_harness.py MODE ROOT ...``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
import uuid

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from tiercache.integrations import vllmcompat as compat

MODULE = "tiercache.integrations.vllm"

if os.environ.get("TIERCACHE_EXPECT_VLLM"):  # this file's child processes check it too (conftest)
    import vllm

    if vllm.__version__ != os.environ["TIERCACHE_EXPECT_VLLM"]:
        raise RuntimeError(f"TIERCACHE_EXPECT_VLLM={os.environ['TIERCACHE_EXPECT_VLLM']} but vllm "
                           f"{vllm.__version__} was imported from {vllm.__file__}")


#: this test run's tag in engine ids (its child processes inherit it): vLLM's CPU tier maps
#: ``/dev/shm/vllm_offload_<engine id>.mmap``, which a killed process leaves behind
RUN = os.environ.setdefault("TIERCACHE_TEST_RUN", uuid.uuid4().hex[:8])


def remove_shared_regions() -> int:
    """Delete the CPU tiers' shared-memory files of this test run; returns how many."""
    import glob

    n = 0
    for path in glob.glob(f"/dev/shm/vllm_offload_tc-test-{RUN}-*.mmap"):
        try:
            os.unlink(path)
            n += 1
        except OSError:
            pass
    return n


def offloading_config(tier: dict, row_bytes: int = 64 << 10, primary_chunks: int = 16, events: bool = False,
                      model: str = "org/tiny-model", rank: int = 0, world_size: int = 1, route: str = "spec"):
    """vLLM's normalized config for one KV-cache group of rows of ``row_bytes`` and a CPU
    primary tier of ``primary_chunks`` chunks, with ``tier`` (TierCacheTier's keys) below it.

    ``route``: how the connector's config names the tier: ``"spec"`` (``TierCacheTieringSpec``
    by ``spec_module_path``, every release) or ``"module_path"`` (vLLM's own
    ``TieringOffloadingSpec`` and the tier's ``module_path``)."""
    extra = {"cpu_bytes_to_use": primary_chunks * row_bytes,
             "secondary_tiers": [{"type": "TierCacheTier", **tier}]}
    if route == "spec":
        extra.update(spec_name="TierCacheTieringSpec", spec_module_path=MODULE)
    else:
        extra.update(spec_name="TieringOffloadingSpec")
        extra["secondary_tiers"][0]["module_path"] = MODULE
    return compat.offloading_config(
        row_bytes=row_bytes,
        extra_config=extra,
        engine_id=f"tc-test-{RUN}-{uuid.uuid4().hex[:12]}",
        model=model,
        layer_names=("model.layers.0.attn",),
        events=events,
        rank=rank,
        world_size=world_size,
    )


def build(tier: dict, **kw):
    """``(spec, manager)``: the spec vLLM's connector makes from the config (through its
    ``OffloadingSpecFactory``) and its real manager, with TierCacheTier below the CPU tier."""
    spec = OffloadingSpecFactory.create_spec(offloading_config(tier, **kw))
    return spec, spec.get_manager()


def chunk_bytes(key: bytes, n: int) -> np.ndarray:
    """The bytes a test stores under ``key``: random, a function of the key."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def new_keys(rng: np.random.Generator, n: int, group: int = 0) -> list[bytes]:
    return [make_offload_key(rng.bytes(32), group) for _ in range(n)]


class Engine:
    """The scheduler's and the worker's side of vLLM's offloading, over one manager."""

    def __init__(self, manager) -> None:
        self.m = manager
        # the manager's lock where it has one (0.33: a tier-poll thread shares it); 0.26's manager
        # is called from the scheduler's thread only, so a lock of our own orders our calls
        self.lock = getattr(manager, "lock", None) or threading.RLock()
        self.tier = manager.secondary_tiers[0]
        self.rows = np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        self.row_bytes = self.rows.shape[1]
        self._req = 0

    def ctx(self) -> ReqContext:
        self._req += 1
        ctx = ReqContext(req_id=f"req-{self._req}")
        with self.lock:
            self.m.on_new_request(ctx)
        return ctx

    def step(self) -> None:
        with self.lock:
            self.m.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def store(self, keys: list[bytes], data=None, ctx: ReqContext | None = None, drain: bool = True) -> list[bytes]:
        """Offload ``keys`` into the primary tier (their bytes written into its rows, as the
        GPU -> CPU copy would), which cascades them to the tier; returns the keys the primary
        tier took."""
        ctx = ctx or self.ctx()
        with self.lock:
            out = self.m.prepare_store(keys, ctx)
            stored = list(out.keys_to_store) if out is not None else []
            for k, c in zip(stored, compat.job_rows(out.store_spec) if stored else ()):
                self.rows[c] = chunk_bytes(k, self.row_bytes) if data is None else data[k]
            if stored:
                self.m.complete_store(stored, ctx, True)
            self.m.on_request_finished(ctx)
        self.step()
        if drain:
            self.settle()
        return stored

    def settle(self) -> None:
        """Wait for the tier's jobs and let the manager take their results."""
        self.tier.drain_jobs()
        with self.lock:
            self.m._process_finished_jobs()
        self.step()

    def flush_primary(self, n: int | None = None) -> None:
        """Push every chunk out of the CPU tier by storing ``n`` (its size) fresh chunks."""
        rng = np.random.default_rng()
        for k in new_keys(rng, n or self.rows.shape[0]):
            self.store([k])

    def promote(self, keys: list[bytes], timeout: float = 20.0) -> dict[bytes, np.ndarray | None]:
        """Look ``keys`` up as requests would (in requests of at most half the CPU tier) until
        each is HIT (then read its primary row, as the CPU -> GPU copy would) or MISS (None)."""
        per = max(1, self.rows.shape[0] // 2)
        out: dict[bytes, np.ndarray | None] = {}
        for i in range(0, len(keys), per):
            out.update(self._promote(keys[i:i + per], timeout))
        return out

    def _promote(self, keys: list[bytes], timeout: float) -> dict[bytes, np.ndarray | None]:
        ctx = self.ctx()
        out: dict[bytes, np.ndarray | None] = {}
        deadline = time.monotonic() + timeout
        while len(out) < len(keys):
            with self.lock:
                for k in keys:
                    if k in out:
                        continue
                    r = self.m.lookup(k, ctx)
                    if r is LookupResult.HIT:
                        spec = self.m.prepare_load([k], ctx)
                        out[k] = self.rows[compat.job_rows(spec)[0]].copy()
                        self.m.complete_load([k], ctx)
                    elif r is LookupResult.MISS:
                        out[k] = None
            self.step()
            self.tier.drain_jobs()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(keys) - len(out)} key(s) still pending after {timeout} s")
            time.sleep(0.002)
        with self.lock:
            self.m.on_request_finished(ctx)
        return out

    def lookups(self, keys: list[bytes]) -> list[LookupResult]:
        ctx = ReqContext(req_id="peek")
        with self.lock:
            return [self.tier.lookup(k, ctx) for k in keys]


def _child(mode: str, root: str, out: str, seed: int, n: int, sharing: str) -> None:
    """A process of the multi-process tests: ``store`` (store ``n`` keys of ``seed``, then write
    their hex to ``out`` and wait for stdin to close), ``churn`` (store keys forever, appending
    each acknowledged key to ``out``)."""
    spec, m = build({"root": root, "sharing": sharing, "capacity_blocks": n, "min_age_s": 0.0}, primary_chunks=8)
    eng = Engine(m)
    rng = np.random.default_rng(seed)
    if mode == "store":
        keys = new_keys(rng, n)
        for i in range(0, n, 4):
            eng.store(keys[i:i + 4])
        with open(out, "w") as f:
            json.dump([k.hex() for k in keys], f)
        sys.stdin.read()
        m.shutdown()
        return
    with open(out, "a") as f:  # churn: killed by the test; a key is acknowledged once the tier says HIT
        while True:
            keys = new_keys(rng, 4)
            eng.store(keys)
            done = [k for k, r in zip(keys, eng.lookups(keys)) if r is LookupResult.HIT]
            f.write("".join(k.hex() + "\n" for k in done))
            f.flush()


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
