"""tiercache's KV connector for vLLM (tiercache/integrations/vllmconnector.py) on the CPU: both
roles built through vLLM's own ``KVConnectorBase_V1``, driven step by step as vLLM's scheduler
and worker drive them, with CPU tensors in vLLM's KV cache layouts standing for the GPU's.

Stored blocks come back byte-exact into other blocks of a restarted engine; a corrupt, truncated
or deleted file is a load error from that block on (vLLM recomputes) and leaves the index; a
finished request's blocks are held until its stores are gathered into pinned staging, and a
load of a block whose file is still being written waits for it; lookups leave at least one token
to compute; a load is done within one step (in ``start_load_kv``, received in the same step).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from types import SimpleNamespace

import pytest
from conftest import require_integration

vllm = require_integration("vllm")
torch = pytest.importorskip("torch")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from tiercache.bench.benchvllmserve import damage_file  # noqa: E402
from tiercache.errors import ConfigError  # noqa: E402
from tiercache.integrations.vllmconnector import (  # noqa: E402
    TierCacheConnector,
    block_key,
    block_views,
    layout_digest,
    parse_config,
    rank_roots,
)
from tiercache.rootops import verify_root  # noqa: E402

BS, LAYERS, HEADS, HD, NB = 16, 4, 2, 8, 64


class _Model:
    model, dtype = "org/tiny-llama", "float16"

    def get_num_layers(self, pc):
        return LAYERS

    def get_num_kv_heads(self, pc):
        return HEADS

    def get_head_size(self):
        return HD


def _config(root, async_scheduling=True, **extra):
    ktc = SimpleNamespace(kv_connector_extra_config={"root": str(root), "fsync": "none", "staging_bytes": 1 << 20,
                                                     "piece_blocks": 2, **extra},
                          kv_load_failure_policy="fail")
    return SimpleNamespace(model_config=_Model(), cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto"),
                           scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
                           kv_transfer_config=ktc)


def _caches(layout: str = "flash", device: str = "cpu") -> dict:
    """Random per-layer KV caches: FlashAttention's [2, NB, BS, H, D], [NB, 2, BS, H, D], or
    (``packed``) vLLM 0.26's [NB, H, BS, 2 * D] over memory ordered [NB, BS, H, 2 * D]."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    shape = {"flash": (2, NB, BS, HEADS, HD), "paged": (NB, 2, BS, HEADS, HD),
             "packed": (NB, BS, HEADS, 2 * HD)}[layout]

    def one() -> torch.Tensor:
        t = torch.randint(-30000, 30000, shape, generator=g, dtype=torch.int16).view(torch.float16).to(device)
        return t.permute(0, 2, 1, 3) if layout == "packed" else t

    return {f"model.layers.{i}.attn": one() for i in range(LAYERS)}


def _block_bytes(t: torch.Tensor, b: int) -> list[bytes]:
    """Block ``b``'s bytes of one layer's cache ``t`` (on the CPU) in memory order: K and V
    apart ([2, NB, ...], [NB, 2, ...]) or one part ([NB, H, BS, 2 * D] over [NB, BS, H, 2 * D])."""
    if t.dim() == 4:
        return [t[b].permute(1, 0, 2).contiguous().view(torch.uint8).numpy().tobytes()]
    kv = (t[0, b], t[1, b]) if t.shape[0] == 2 else (t[b, 0], t[b, 1])
    return [x.contiguous().view(torch.uint8).numpy().tobytes() for x in kv]


@pytest.fixture(params=["cpu", "cpu-engine", pytest.param("cuda", marks=pytest.mark.gpu),
                        pytest.param("cuda-side", marks=pytest.mark.gpu),
                        pytest.param("cuda-engine", marks=pytest.mark.gpu),
                        pytest.param("cuda-compat", marks=pytest.mark.gpu),
                        pytest.param("cuda-hostsum", marks=pytest.mark.gpu),
                        pytest.param("cuda-planned", marks=pytest.mark.gpu),
                        pytest.param("cuda-torch", marks=pytest.mark.gpu)])
def device(request):
    """Where the KV caches live: the CPU (torch's copies), or a GPU (the pinned staging, the
    copy kernels and events, checksums compared on the GPU; on the current stream, or
    ``-side``: on side streams; or ``-compat``: loads read by kvikio straight into device
    slabs, in its compatibility mode, the path GDS takes; or ``-hostsum``: checksums compared
    by the native engine's threads as each file is read; or ``-planned``: a load's scatters from
    tables planned per load, ``scatter_tables = "load"``; or ``-torch``: torch's copies, the
    fallback where the project's kernels are unavailable); stores gathered by the connector's
    gatherer thread, or (``-engine``) on the engine's thread."""
    if request.param == "cuda-compat":
        pytest.importorskip("kvikio")
    return request.param


class _Engine:
    """One engine: the scheduler-side and worker-side connectors over one set of KV caches."""

    def __init__(self, root, layout="flash", device="cpu", **extra) -> None:
        if device == "cuda-side":
            device, extra = "cuda", {"copy_streams": "side", **extra}
        if device.endswith("-engine"):
            device, extra = device.removesuffix("-engine"), {"store_gathers": "engine", **extra}
        if device == "cuda-compat":
            device, extra = "cuda", {"io_mode": "compat", **extra}
        if device == "cuda-hostsum":
            device, extra = "cuda", {"verify_on": "host", **extra}
        if device == "cuda-planned":
            device, extra = "cuda", {"scatter_tables": "load", **extra}
        if device == "cuda-torch":
            device, extra = "cuda", {"copy_kernel": "torch", **extra}
        cfg = _config(root, **extra)
        kvc = SimpleNamespace(num_blocks=NB)
        self.sched = TierCacheConnector(cfg, KVConnectorRole.SCHEDULER, kvc)
        self.worker = TierCacheConnector(cfg, KVConnectorRole.WORKER, kvc)
        self.config = cfg
        self.caches = _caches(layout, device)
        self.worker.register_kv_caches(self.caches)

    def block(self, b: int) -> list[bytes]:
        """Every layer's K and V bytes of block ``b``."""
        out = []
        if self.caches[next(iter(self.caches))].is_cuda:
            torch.cuda.synchronize()
        for t in (c.cpu() for c in self.caches.values()):
            out += _block_bytes(t, b)
        return out

    def step(self, new=(), out=None, preempted=()):
        """One scheduler step (``new``: (request, block ids, computed, scheduled) tuples) and
        the worker's part of it; returns the worker's (sending, recving, errors) once ``wait``
        holds, polling as vLLM's steps do."""
        so = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=(ids,), num_computed_tokens=c)
                                for r, ids, c, _ in new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                  resumed_req_ids=set()),
            num_scheduled_tokens={r.request_id: n for r, _, _, n in new}, preempted_req_ids=set(preempted))
        meta = self.sched.build_connector_meta(so)
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        return meta

    def poll(self, finished=(), want_send=(), want_recv=(), timeout=20.0):
        sent, recvd, errors = set(), set(), set()
        deadline = time.monotonic() + timeout
        fin = set(finished)
        while True:  # at least once
            s, r = self.worker.get_finished(fin)
            fin = set()
            sent |= s or set()
            recvd |= r or set()
            errors |= self.worker.get_block_ids_with_load_errors()
            if set(want_send) <= sent and set(want_recv) <= recvd or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        self.sched.update_connector_output(SimpleNamespace(
            finished_sending=sent, finished_recving=recvd, invalid_block_ids=errors,
            kv_connector_worker_meta=self.worker.build_connector_worker_meta()))
        return sent, recvd, errors

    def close(self):
        self.worker.shutdown()


def _request(rid, hashes, tokens):
    return SimpleNamespace(request_id=rid, block_hashes=list(hashes), num_prompt_tokens=tokens)


def _blocks(ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def _store(engine, rid, hashes, tokens, ids):
    """Compute a request's prompt into ``ids`` (the caches' random bytes stand for it) and
    store it; returns its blocks' bytes."""
    req = _request(rid, hashes, tokens)
    assert engine.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    engine.sched.update_state_after_alloc(req, _blocks(ids), 0)
    meta = engine.step(new=[(req, ids, 0, tokens)])
    assert [len(t.keys) for t in meta.stores] == [tokens // BS] and not meta.loads
    assert engine.sched.request_finished(req, ids) == (False, None)  # freed at once
    assert engine.step().released == [rid]  # the next step: its gathers are issued first
    w = engine.worker._worker
    assert not any(e[0] == rid for e in w._gathers) and w.counters["released_skipped_blocks"] == 0
    sent, _, _ = engine.poll(finished={rid})
    assert not sent  # vLLM no longer knows it: no finished_sending
    return [engine.block(b) for b in ids[:tokens // BS]]


@pytest.mark.parametrize("layout", ["flash", "paged", "packed"])
def test_blocks_stored_by_one_engine_load_byte_exact_into_another(tmp_path, rng, device, layout):
    hashes = [rng.bytes(32) for _ in range(6)]
    a = _Engine(tmp_path, layout, device)
    want = _store(a, "r1", hashes, 5 * BS + 3, list(range(10, 16)))
    assert a.config.kv_transfer_config.kv_load_failure_policy == "recompute"
    a.close()
    # the files' checksums (made on the GPU for the stores where it can) are the host library's
    w = a.worker._worker
    assert (w.store_hasher is not None) is (device not in ("cpu", "cpu-engine", "cuda-hostsum"))
    assert w.counters["gpu_summed_store_blocks"] == (5 if w.store_hasher is not None else 0), dict(w.counters)
    assert not w.counters["store_sums_unused_blocks"], dict(w.counters)
    d = w.describe()  # what the bench reports of each engine's worker
    assert d["regions_per_block"] == (2 * LAYERS if layout == "flash" else LAYERS)  # K and V apart, or together
    assert d["row_bytes"] == w.row_bytes and d["store_slabs"] >= 2
    assert d["scatter_tables"] == ("load" if device == "cuda-planned" else "piece")
    # on a GPU, the gathers are the project's kernels (one per piece and region size), unless told
    # to take torch's copies (one per region and piece)
    kernel = device.startswith("cuda") and device != "cuda-torch"
    assert d["copies"].startswith("torch") is not kernel, d["copies"]
    kernels = sum(v for k, v in w.counters.items() if k.startswith("segment_copies_") and k != "segment_copies_torch")
    assert bool(kernels) is kernel and bool(w.counters["segment_copies_torch"]) is (device == "cuda-torch"), \
        dict(w.counters)
    (root,) = [p for p in tmp_path.iterdir() if p.name.endswith("_c_r0")]
    report = verify_root(root)
    assert report["checked"] == 5 and not report["bad"]
    b = _Engine(tmp_path, layout, device)  # a restarted engine: the index comes from the files
    req = _request("r2", hashes[:5] + [rng.bytes(32)], 6 * BS + 1)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (5 * BS, True)
    ids = [40, 7, 33, 2, 61, 5, 6]
    b.sched.update_state_after_alloc(req, _blocks(ids), 5 * BS)
    meta = b.step(new=[(req, ids, 5 * BS, BS + 1)])
    assert [(t.req_id, t.block_ids) for t in meta.loads] == [("r2", ids[:5])]
    # loaded within the step: in place when start_load_kv returns, received in the same step
    assert [b.block(x) for x in ids[:5]] == want
    _, recvd, errors = b.poll(want_recv={"r2"}, timeout=0)
    assert recvd == {"r2"} and not errors
    # a prompt of whole blocks leaves its last block to compute; a local hit is not loaded again
    req = _request("r3", hashes[:5], 5 * BS)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (4 * BS, True)
    assert b.sched.get_num_new_matched_tokens(req, 2 * BS) == (2 * BS, True)
    b.close()


def test_where_reading_is_slower_than_recomputing_prefixes_are_recomputed(tmp_path, rng):
    """load_policy 'faster' (the default): once the engine's own steps and loads say reading a
    block takes longer than computing it, lookups answer no hit (one in PROBE_EVERY still
    loads); 'always' keeps loading."""
    from tiercache.integrations.loadcost import PROBE_EVERY

    assert parse_config({"root": "/x"})["load_policy"] == "faster"
    hashes = [rng.bytes(32) for _ in range(4)]
    a = _Engine(tmp_path)
    _store(a, "r1", hashes, 4 * BS, [1, 2, 3, 4])
    a.close()
    for policy, hits in (("faster", 1), ("always", PROBE_EVERY)):
        e = _Engine(tmp_path, load_policy=policy)
        cost = e.sched._sched.cost
        cost.load_s_per_block, cost.prefill_s_per_token = 1e-3, 25e-6  # 1 ms a block against 0.4 ms
        got = [e.sched.get_num_new_matched_tokens(_request(f"q{i}", hashes, 4 * BS + 1), 0)
               for i in range(PROBE_EVERY)]
        assert got.count((4 * BS, True)) == hits and got.count((0, False)) == PROBE_EVERY - hits, policy
        e.close()
    with pytest.raises(ConfigError, match="load_policy"):
        parse_config({"root": "/x", "load_policy": "sometimes"})


def test_a_request_looked_up_again_while_it_waits_is_one_decision(tmp_path, rng):
    """vLLM looks a waiting request up again at every step it cannot schedule it (three times
    per repeat in an H200 run): the policy is asked once per request, so its probes come one
    prefix in PROBE_EVERY, not one lookup in PROBE_EVERY, and a request does not flip between a
    hit and none while it waits."""
    from tiercache.integrations.loadcost import PROBE_EVERY

    hashes = [rng.bytes(32) for _ in range(4)]
    a = _Engine(tmp_path)
    _store(a, "r1", hashes, 4 * BS, [1, 2, 3, 4])
    a.close()
    e = _Engine(tmp_path)
    cost = e.sched._sched.cost
    cost.load_s_per_block, cost.prefill_s_per_token = 1e-3, 25e-6  # recomputing wins
    answers = []
    for i in range(PROBE_EVERY - 1):
        req = _request(f"q{i}", hashes, 4 * BS + 1)
        answers.append({e.sched.get_num_new_matched_tokens(req, 0) for _ in range(3)})
    assert all(a == {(0, False)} for a in answers) and cost.skipped == PROBE_EVERY - 1
    req = _request("probe", hashes, 4 * BS + 1)
    assert {e.sched.get_num_new_matched_tokens(req, 0) for _ in range(3)} == {(4 * BS, True)}
    assert cost.probes == 1
    e.close()


def test_two_live_engines_on_a_shared_root_hit_each_others_blocks(tmp_path, rng, monkeypatch):
    """Both engines up before either stores: B's index is listed at its start, empty; after A
    stores, B's lookup misses, lists the root again (at most every RESCAN_S) and loads A's
    blocks byte-exact. On an exclusive root a second engine is refused."""
    from tiercache.errors import TierCacheError
    from tiercache.integrations.vllmconnector import ConnectorScheduler

    monkeypatch.setattr(ConnectorScheduler, "RESCAN_S", 0.0)
    hashes = [rng.bytes(32) for _ in range(4)]
    a = _Engine(tmp_path, sharing="shared")
    b = _Engine(tmp_path, sharing="shared")
    req = _request("rb", hashes, 4 * BS + 1)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    want = _store(a, "ra", hashes, 4 * BS, [3, 9, 12, 20])
    assert a.worker._worker.drain(30.0)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (4 * BS, True)
    ids = [50, 1, 44, 8, 30]
    b.sched.update_state_after_alloc(req, _blocks(ids), 4 * BS)
    b.step(new=[(req, ids, 4 * BS, 1)])
    _, recvd, errors = b.poll(want_recv={"rb"})
    assert recvd == {"rb"} and not errors
    assert [b.block(x) for x in ids[:4]] == want
    a.close()
    b.close()
    c = _Engine(tmp_path / "excl")
    with pytest.raises(TierCacheError):
        _Engine(tmp_path / "excl")
    c.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_file_is_a_load_error_from_its_block_on(tmp_path, rng, damage, device):
    hashes = [rng.bytes(32) for _ in range(5)]
    a = _Engine(tmp_path, device=device)
    want = _store(a, "r1", hashes, 5 * BS, list(range(5)))
    a.close()
    (root,) = [p for p in tmp_path.iterdir() if p.name.endswith("_c_r0")]
    damage_file(next(root.glob(f"*/block_x{hashes[2].hex()}_pool_*.bin")), damage)
    b = _Engine(tmp_path, device=device)
    req = _request("r2", hashes, 5 * BS + 1)
    matched = b.sched.get_num_new_matched_tokens(req, 0)
    if damage == "delete":
        assert matched == (2 * BS, True)  # the listing at start no longer has it
        return b.close()
    assert matched == (5 * BS, True)
    ids = [20, 21, 22, 23, 24, 25]
    b.sched.update_state_after_alloc(req, _blocks(ids), 5 * BS)
    b.step(new=[(req, ids, 5 * BS, 1)])
    _, recvd, errors = b.poll(want_recv={"r2"}, timeout=0)
    assert recvd == {"r2"} and errors == {22, 23, 24}
    assert [b.block(x) for x in ids[:2]] == want[:2]  # the blocks before it loaded exact
    w = b.worker._worker
    # a flipped data byte passes the header's check: on the GPU path the kernel's checksum finds it
    assert w.counters["gpu_checksum_mismatches"] == (damage == "flip" and w.hasher is not None)
    again = _request("r3", hashes, 5 * BS + 1)
    assert b.sched.get_num_new_matched_tokens(again, 0) == (2 * BS, True)  # the bad key left the index
    b.close()
    assert list(root.glob("quarantine/*"))


def test_a_long_prefix_cycles_the_load_slabs_and_comes_back_exact(tmp_path, rng, device):
    """More pieces than load slabs (and, on a GPU, than device store slabs): each slab is read
    again only once its last piece is up, and a device slab takes the next gather only once
    its copy to the host is done. ``load_switch_s``: Python's switch interval while the load
    runs, and Python's own again after it."""
    import sys

    n = NB // 2 - 1
    hashes = [rng.bytes(32) for _ in range(n + 1)]
    a = _Engine(tmp_path, device=device, piece_blocks=3, load_switch_s=0.0003)
    w = a.worker._worker
    seen, own, land = [], sys.getswitchinterval(), w._land
    w._land = lambda *args: seen.append(sys.getswitchinterval()) or land(*args)
    w.load_slabs, w._slab_events = 2, [None, None]  # two slabs of 3 blocks for 31 blocks
    if w.cuda:
        w.dev_store, w._dev_events = w.dev_store[:2], [None, None]  # two device store slabs
    want = _store(a, "r1", hashes, n * BS, list(range(n)))
    ids = list(rng.permutation(range(n, NB))[:n + 1])
    req = _request("r2", hashes, (n + 1) * BS)
    assert a.sched.get_num_new_matched_tokens(req, 0) == (n * BS, True)
    a.sched.update_state_after_alloc(req, _blocks(ids), n * BS)
    a.step(new=[(req, ids, n * BS, BS)])
    assert [a.block(x) for x in ids[:n]] == want
    assert w.counters["loaded_blocks"] == n and not a.worker.get_block_ids_with_load_errors()
    assert w.counters[f"loads_{w.load_path.name}"] == 1  # the path it took, reported
    assert seen and set(seen) == {0.0003} and sys.getswitchinterval() == own
    # where the checksums were compared: the GPU for the pinned path's pieces unless told otherwise
    assert (w.hasher is not None) is (device in ("cuda", "cuda-side", "cuda-engine", "cuda-planned", "cuda-torch"))
    assert w.counters["gpu_checked_blocks"] == (n if w.hasher is not None else 0)
    if device == "cuda-compat":  # read by kvikio into a ring of device slabs, not pinned staging
        assert w.load_path.name == "compat" and w.device_reads and w.dev_loads.shape[0] == w.DEVICE_LOAD_SLABS
    assert w.counters["planned_scatter_pieces"] == (-(-n // 3) if device == "cuda-planned" else 0)
    a.close()


def test_a_loads_scatters_planned_in_groups_are_the_pieces_own(tmp_path, rng, monkeypatch):
    """``scatter_tables = "load"``: each piece's launches carry exactly the segments the
    per-piece scatter builds (the worker's ``_segments``); a group's plan is made at its first
    piece and released once, after its last; a load the launcher will not plan is scattered
    piece by piece, asked once."""
    from types import SimpleNamespace

    import numpy as np

    from tiercache.copypaths.segmentplan import plan_layout
    from tiercache.integrations.vllmconnector import _ScatterPlans

    e = _Engine(tmp_path, device="cpu")
    real = e.worker._worker
    events: list = []

    class Plan:
        def __init__(self, copies):
            self.copies = copies
            plan_layout(copies, 7)  # the copies are well formed

        def launch(self, j, stream):
            events.append(("launch", self.copies[j]))

        def done(self, stream):
            events.append(("done",))

    refuse = [False]
    launcher = SimpleNamespace(SM_SLOTS=7, plan_segments=lambda copies, cs, force: (
        events.append(("plan", len(copies))) or (None if refuse[0] else Plan(copies))))
    w = SimpleNamespace(piece=8, views=real.views, size_groups=real.size_groups, launcher=launcher, _force=None,
                        dev_load=SimpleNamespace(data_ptr=lambda: 1 << 30), _segments=real._segments,
                        _cupy=lambda stream: "cs", stream="s", counters={"planned_scatter_pieces": 0})
    ids = [int(x) for x in rng.permutation(NB)[:61]]  # 8 pieces, the last of 5 blocks
    monkeypatch.setattr(_ScatterPlans, "GROUP_BYTES", 3 * (16 * len(real.views) * 8 + 8 * 8))  # 3 pieces a group
    plans = _ScatterPlans(w, SimpleNamespace(block_ids=ids))
    assert plans.group == 3 and plans.pieces == 8
    for k in range(8):
        assert plans.launch(k)
    plans.close()
    assert w.counters["planned_scatter_pieces"] == 8
    assert [x[0] for x in events] == ["plan"] + ["launch"] * 3 + ["done", "plan"] + ["launch"] * 3 + \
        ["done", "plan"] + ["launch"] * 2 + ["done"]
    launched = [x[1] for x in events if x[0] == "launch"]
    want = [(pages, staged, int(size)) for k in range(8) for size, pages, staged in
            real._segments(1 << 30, ids[8 * k:8 * (k + 1)])]
    assert len(launched) == len(want) == 8 * len(real.size_groups)
    for got, exp in zip(launched, want):
        assert np.array_equal(got[0], exp[0]) and np.array_equal(got[1], exp[1]) and got[2] == exp[2]
    events.clear()
    refuse[0] = True
    plans = _ScatterPlans(w, SimpleNamespace(block_ids=ids))
    assert [plans.launch(k) for k in range(8)] == [False] * 8 and events == [("plan", 3 * len(real.size_groups))]
    e.close()


def test_a_load_waits_for_a_store_of_the_same_blocks_still_being_written(tmp_path, rng, device):
    """Blocks are freed at their request's finish, gathered into staging before the next step,
    before their files are written; a request that hits them at once waits for the writes, and
    loads them exact."""
    hashes = [rng.bytes(32) for _ in range(4)]
    a = _Engine(tmp_path, device=device)
    w = a.worker._worker
    real = w.store.submit_store
    gate = threading.Event()

    def held(*args, **kwargs):  # the writer waits until the test opens the gate
        gate.wait(30)
        return real(*args, **kwargs)

    w.store.submit_store = held
    want = _store(a, "r1", hashes, 4 * BS, [3, 9, 27, 81 % NB])  # returns once gathered
    assert w._writing and not gate.is_set()  # freed while no file was written yet
    req = _request("r2", hashes, 4 * BS + 5)
    assert a.sched.get_num_new_matched_tokens(req, 0) == (4 * BS, True)
    ids = [50, 51, 52, 53, 54]
    a.sched.update_state_after_alloc(req, _blocks(ids), 4 * BS)
    threading.Timer(0.2, gate.set).start()  # the writes go on while the load waits for them
    a.step(new=[(req, ids, 4 * BS, 5)])
    assert [a.block(x) for x in ids[:4]] == want
    assert not a.worker.get_block_ids_with_load_errors() and not w._writing
    assert w.drain(5) and w.counters["stored_blocks"] == 4
    a.close()


def test_stores_are_skipped_not_held_when_the_writes_fall_behind(tmp_path, rng, device):
    hashes = [rng.bytes(32) for _ in range(5)]
    a = _Engine(tmp_path, device=device)
    w = a.worker._worker
    w.max_queued = 4
    req = _request("r1", hashes, 5 * BS)
    a.sched.update_state_after_alloc(req, _blocks(range(5)), 0)
    meta = a.step(new=[(req, list(range(5)), 0, 5 * BS)])
    assert [len(t.keys) for t in meta.stores] == [5]
    assert a.sched.request_finished(req, list(range(5))) == (False, None)  # freed at once
    assert a.step().released == ["r1"]
    sent, _, _ = a.poll(finished={"r1"})
    assert not sent and not w._had_stores
    assert w.counters["stores_skipped_blocks"] == 5 and w.store.drain(10) and len(w.store) == 0
    # the workers' report took the skipped blocks out of the scheduler's index: no load of absent files
    assert a.sched.get_num_new_matched_tokens(_request("r2", hashes, 5 * BS + 1), 0) == (0, False)
    a.close()


def _six_blocks_behind_a_slow_writer(tmp_path, rng, device):
    """An engine whose writer holds its only store slab (of 2 blocks) until the returned gate
    is set, and request r1's 6 blocks (ids 7-12) computed and planned: 2 gathered, 4 waiting.
    Returns (engine, worker, gate, hashes, request, ids, the blocks' bytes)."""
    hashes = [rng.bytes(32) for _ in range(6)]
    a = _Engine(tmp_path, device=device, piece_blocks=2)
    w = a.worker._worker
    gate = threading.Event()
    real = w.store.submit_store

    def held(*args, **kwargs):  # the writer is slow: slabs stay busy
        gate.wait(10)
        return real(*args, **kwargs)

    w.store.submit_store = held
    with w._lock:
        w._free_slabs = w._free_slabs[:1]  # one slab of 2 blocks for 6 blocks
    req = _request("r1", hashes, 6 * BS)
    ids = [7, 8, 9, 10, 11, 12]
    a.sched.update_state_after_alloc(req, _blocks(ids), 0)
    a.step(new=[(req, ids, 0, 6 * BS)])
    want = [a.block(b) for b in ids]
    deadline = time.monotonic() + 10  # the gatherer thread issues the first piece on its own time
    while w._queued["r1"] != 4 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert len(w._gathers) == 1 and w._queued["r1"] == 4  # 2 gathered, 4 waiting
    return a, w, gate, hashes, req, ids, want


def test_a_preempted_requests_queued_stores_are_gathered_before_its_blocks_change(tmp_path, rng, device):
    """vLLM frees a preempted request's blocks at once (no request_finished): its stores still
    waiting for a store slab are gathered before the next forward pass may overwrite them, and
    what is stored is what the blocks held."""
    a, w, gate, hashes, req, ids, want = _six_blocks_behind_a_slow_writer(tmp_path, rng, device)
    threading.Timer(0.3, gate.set).start()
    a.step(preempted={"r1"})  # the next step: r1 was preempted, its blocks are free
    assert not w._gathers and w.counters["preemption_flush_us"] > 0
    for t in a.caches.values():  # the blocks are reused by another request
        t[:, 7:13].zero_() if t.shape[0] == 2 else t[7:13].zero_()
    a.close()
    b = _Engine(tmp_path, device=device)
    req = _request("r2", hashes, 6 * BS + 1)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (6 * BS, True)
    new_ids = [30, 31, 32, 33, 34, 35, 36]
    b.sched.update_state_after_alloc(req, _blocks(new_ids), 6 * BS)
    b.step(new=[(req, new_ids, 6 * BS, 1)])
    assert [b.block(x) for x in new_ids[:6]] == want
    b.close()


def test_a_finished_requests_blocks_are_freed_at_once_and_never_gathered_after_they_change(tmp_path, rng, device):
    """A finished request's blocks are freed at once (request_finished: no hold) while its
    stores wait for a store slab behind a slow writer: the next step gathers what a free slab
    takes, skips the rest without waiting for the writer, and the forward pass that reuses
    the blocks comes after the gathers. Files hold the bytes the blocks held, or are absent."""
    a, w, gate, hashes, req, ids, want = _six_blocks_behind_a_slow_writer(tmp_path, rng, device)
    assert a.sched.request_finished(req, ids) == (False, None)
    t0 = time.monotonic()
    meta = a.step()  # the next step, while the writer still holds the only slab
    assert meta.released == ["r1"] and time.monotonic() - t0 < 5  # not a wait for the writer
    assert not w._gathers and w.counters["released_skipped_blocks"] == 4
    for t in a.caches.values():  # the blocks are reused by another request
        t[:, 7:13].zero_() if t.shape[0] == 2 else t[7:13].zero_()
    sent, _, _ = a.poll(finished={"r1"})
    assert not sent  # and the report of the skipped four reached the scheduler's index:
    assert a.sched.get_num_new_matched_tokens(_request("r3", hashes, 6 * BS + 1), 0) == (2 * BS, True)
    gate.set()
    a.close()
    b = _Engine(tmp_path, device=device)
    req = _request("r2", hashes, 6 * BS + 1)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (2 * BS, True)  # the gathered two only
    new_ids = [30, 31, 32, 33, 34, 35, 36]
    b.sched.update_state_after_alloc(req, _blocks(new_ids), 2 * BS)
    b.step(new=[(req, new_ids, 2 * BS, 4 * BS + 1)])
    assert [b.block(x) for x in new_ids[:2]] == want[:2]
    b.close()


def test_a_store_that_fails_to_be_written_leaves_the_schedulers_index(tmp_path, rng):
    """A block whose file write failed is reported by its worker (build_connector_worker_meta,
    merged over ranks by union) and the scheduler stops offering it, whether the report comes
    before or after the request's stores ended."""
    from tiercache.integrations.vllmconnector import TierCacheWorkerMetadata

    one, two = TierCacheWorkerMetadata(frozenset({b"a"})), TierCacheWorkerMetadata(frozenset({b"b"}))
    assert one.aggregate(two).unstored == {b"a", b"b"} and one.aggregate(None).unstored == {b"a"}
    for early in (False, True):
        hashes = [rng.bytes(32) for _ in range(4)]
        a = _Engine(tmp_path / str(early))
        w = a.worker._worker
        assert a.worker.build_connector_worker_meta() is None  # nothing to report
        real = w._wait
        bad = block_key(hashes[2])

        def failing(jid, real=real, bad=bad, h=hashes[2]):  # the write of block 2 fails (its file is removed)
            res = real(jid)
            for p in (tmp_path / str(early)).glob(f"*_c_r0/*/block_x{h.hex()}_pool_*.bin"):
                p.unlink()  # this job wrote it
                res.failed[bad] = OSError("no space left on device")
            return res

        w._wait = failing
        req = _request("r1", hashes, 4 * BS)
        a.sched.update_state_after_alloc(req, _blocks([1, 2, 3, 4]), 0)
        a.step(new=[(req, [1, 2, 3, 4], 0, 4 * BS)])
        assert w.drain(10) and w.counters["store_failed_blocks"] == 1
        if early:  # the report comes while the request still runs: its end must not list the block
            a.poll()
        assert a.sched.request_finished(req, [1, 2, 3, 4]) == (False, None)
        a.step()
        a.poll(finished={"r1"})
        assert a.sched.get_num_new_matched_tokens(_request("r2", hashes, 4 * BS + 1), 0) == (2 * BS, True)
        a.close()


def test_block_views_split_each_layout_into_contiguous_block_pages():
    for layout, regions in (("flash", 2), ("paged", 1), ("packed", 1)):
        t = next(iter(_caches(layout).values()))
        views = block_views(t, NB)
        assert len(views) == regions and all(v.shape == (NB, 2 * BS * HEADS * HD * 2 // regions) for v in views)
        for b in (0, 17, NB - 1):
            assert b"".join(v[b].numpy().tobytes() for v in views) == b"".join(_block_bytes(t, b)), (layout, b)
    # a part dense in memory in another order than its axes' (vLLM 0.26's FlashAttention) is one
    # region, not one per token and head; one with a gap is split along its outermost axis
    packed = next(iter(_caches("packed").values()))
    assert not packed[0].is_contiguous() and len(block_views(packed, NB)) == 1
    gappy = torch.zeros((NB, BS, HEADS + 1, 2 * HD), dtype=torch.float16)[:, :, :HEADS].permute(0, 2, 1, 3)
    views = block_views(gappy, NB)
    assert len(views) == BS and {v.shape[1] for v in views} == {HEADS * 2 * HD * 2}
    mla = torch.zeros((NB, BS, 96), dtype=torch.float16)
    assert [v.shape for v in block_views(mla, NB)] == [(NB, BS * 96 * 2)]
    with pytest.raises(ConfigError, match="no axis of 64 blocks"):
        block_views(torch.zeros((3, 5)), NB)


def test_the_config_is_checked():
    with pytest.raises(ConfigError, match="unknown config key.*'rooot'.*valid keys"):
        parse_config({"rooot": "/x"})
    with pytest.raises(ConfigError, match="'root'"):
        parse_config({})
    with pytest.raises(ConfigError, match="piece_blocks"):
        parse_config({"root": "/x", "piece_blocks": 0})
    with pytest.raises(ConfigError, match="copy_streams.*valid: compute, side"):
        parse_config({"root": "/x", "copy_streams": "both"})
    with pytest.raises(ConfigError, match="copy_kernel.*valid: auto, kernel, torch"):
        parse_config({"root": "/x", "copy_kernel": "fast"})
    with pytest.raises(ConfigError, match="fsync"):
        parse_config({"root": "/x", "fsync": "sometimes"})
    with pytest.raises(ConfigError, match="io_mode.*'dma'"):
        parse_config({"root": "/x", "io_mode": "dma"})
    assert parse_config({"root": "/x"})["io_mode"] == "auto"
    with pytest.raises(ConfigError, match="load_mode.*'eager'.*valid: auto, async, sync"):
        parse_config({"root": "/x", "load_mode": "eager"})
    assert parse_config({"root": "/x"})["load_mode"] == "auto"
    with pytest.raises(ConfigError, match="verify_on.*'gpu'.*valid: auto, host, device"):
        parse_config({"root": "/x", "verify_on": "gpu"})
    with pytest.raises(ConfigError, match="scatter_tables.*'all'.*valid: piece, load"):
        parse_config({"root": "/x", "scatter_tables": "all"})
    for bad in (-0.001, 0.5, "fast", True):
        with pytest.raises(ConfigError, match="load_switch_s.*valid: 0 .* or seconds up to 0.1"):
            parse_config({"root": "/x", "load_switch_s": bad})
    assert parse_config({"root": "/x", "load_switch_s": 0.0002})["load_switch_s"] == 0.0002
    assert parse_config({"root": ["/a", "/b"]})["root"] == ["/a", "/b"]
    assert [p.name for p in rank_roots(["/a"], "d1g", "org/Llama-3.1 8B/", 1)] == ["Llama-3.1-8B_d1g_c_r1"]


def test_engines_whose_kv_layouts_may_differ_keep_their_files_apart(tmp_path, monkeypatch):
    """A file holds the KV cache's bytes in memory order, so what decides that order is in the
    directory's digest: another vLLM release, attention backend or ``VLLM_KV_CACHE_LAYOUT``
    never reads these files (it would read K and V in another order, with good checksums)."""
    import vllm

    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
    cfg = _config(tmp_path)
    base = layout_digest(cfg)
    assert layout_digest(_config(tmp_path / "other")) == base  # the root is not part of it
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "HND")
    assert layout_digest(cfg) != base
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT")
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASHINFER")
    assert layout_digest(cfg) != base
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND")
    monkeypatch.setattr(vllm, "__version__", "0.0.1")
    assert layout_digest(cfg) != base


def test_the_documented_config_lines_parse():
    """Every ``--kv-transfer-config`` line for the connector in the README and docs/vllm.md is
    JSON that names this module and class, and its extra config passes parse_config."""
    import json
    import re
    from pathlib import Path

    top = Path(__file__).resolve().parents[1]
    found = 0
    for doc in ("README.md", "docs/vllm.md"):
        for line in re.findall(r"--kv-transfer-config '(\{.*\})'", (top / doc).read_text()):
            cfg = json.loads(line)
            if cfg["kv_connector"] != "TierCacheConnector":
                continue
            found += 1
            assert cfg["kv_connector_module_path"] == TierCacheConnector.__module__
            assert cfg["kv_load_failure_policy"] == "recompute"
            parse_config(cfg["kv_connector_extra_config"])
    assert found >= 2


def test_a_call_for_the_other_side_is_a_clear_error(tmp_path):
    """vLLM builds one connector per role; a worker-side call on the scheduler's (or the reverse)
    names the mix-up instead of failing on None."""
    cfg = _config(tmp_path)
    kvc = SimpleNamespace(num_blocks=NB)
    sched = TierCacheConnector(cfg, KVConnectorRole.SCHEDULER, kvc)
    with pytest.raises(ConfigError, match="worker-side call on a scheduler-side connector"):
        sched.get_block_ids_with_load_errors()
    worker = TierCacheConnector(cfg, KVConnectorRole.WORKER, kvc)
    with pytest.raises(ConfigError, match="scheduler-side call on a worker-side connector"):
        worker.request_finished(SimpleNamespace(request_id="r"), [])


def test_checksums_on_the_gpu_asked_where_there_is_none_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="verify_on = 'device' cannot run here: CPU tensors"):
        _Engine(tmp_path, device="cpu", verify_on="device")
    e = _Engine(tmp_path / "b", device="cpu", verify_on="auto")
    assert e.worker._worker.hasher is None and e.worker._worker.verify_where == "on the host (CPU tensors)"
    assert e.worker._worker.store_hasher is None
    assert e.worker._worker.store_sums_where == "on the host (CPU tensors)"
    e.close()


def _vllm_layer_caches(layers: int, heads: int, head_size: int) -> dict[str, list[torch.Tensor]]:
    """Per-layer KV caches as the installed vLLM lays them out, by layout name: vLLM 0.33's
    own views (``create_kv_cache_views``) for every ``KVCacheLayout``, or (vLLM 0.26, whose
    layout is the attention backend's) FlashAttention's logical ``[blocks, heads, tokens,
    2 * head_size]`` permuted by its stride orders for NHD and HND, as its model runner does."""
    try:
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheTensor,
            compute_layout_strides,
            create_kv_cache_views,
        )
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:
        out = {}
        for name, order in (("NHD", (0, 2, 1, 3)), ("HND", (0, 1, 2, 3))):
            shape = (NB, heads, BS, 2 * head_size)
            inv = [order.index(i) for i in range(4)]
            out[name] = [torch.randint(-30000, 30000, tuple(shape[i] for i in order), dtype=torch.int16)
                         .view(torch.float16).permute(*inv) for _ in range(layers)]
        return out
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=head_size, dtype=torch.float16)
    names = [f"model.layers.{i}.attn" for i in range(layers)]
    out = {}
    for layout in KVCacheLayout:
        strides = compute_layout_strides(spec, NB, layers, layout)
        size = layers * NB * spec.page_size_bytes
        raw = torch.randint(-128, 128, (size,), dtype=torch.int8)
        t = KVCacheTensor(size=size, layers=names, layer_stride=strides[0], block_stride=strides[1])
        out[layout.name] = create_kv_cache_views(raw, spec, NB, layout, t)
    return out


def test_block_views_take_each_of_vllms_kv_cache_layouts_in_few_regions():
    """Every layout the installed vLLM can give its KV caches: a block's part of a layer comes
    out as one region wherever it is one range of memory (the copy kernels' segment tables stay
    small; vLLM 0.26 and 0.33's default FlashAttention layout, logically ``[blocks, heads,
    tokens, ...]`` over ``[blocks, tokens, heads, ...]``, was 4096 regions of 512 B a Llama-8B
    block before), else one per head; the regions hold exactly the part's bytes in memory
    order, and no two blocks' regions overlap."""
    heads, hd = 2, 8
    seen = {}
    for name, caches in _vllm_layer_caches(3, heads, hd).items():
        for t in caches:
            views = block_views(t, NB)
            block_dim = [i for i, s in enumerate(t.shape) if s == NB][0]
            part0 = t.select(block_dim, 0)
            by_address = sorted(range(part0.dim()), key=lambda i: -part0.stride(i))
            one_range = part0.permute(*by_address).is_contiguous()
            assert len(views) == (1 if one_range else heads), (name, len(views))
            seen[name] = len(views)
            for b in (0, 5, NB - 1):
                part = t.select(block_dim, b)
                want = part.permute(*by_address).contiguous().view(torch.uint8).numpy().tobytes()
                assert b"".join(v[b].numpy().tobytes() for v in views) == want, (name, b)
            spans = sorted((v.data_ptr() + b * v.stride(0), v.shape[1]) for v in views for b in range(NB))
            assert all(a + n <= c for (a, n), (c, _) in zip(spans, spans[1:])), name
    assert 1 in seen.values(), seen  # the default layouts are among them


def test_a_worker_names_the_directories_of_its_model_it_does_not_read(tmp_path, caplog):
    """Files under another digest (another vLLM release or layout, or a connector before files
    held memory order) are never read; the worker names their directories at start, with the
    command that frees them, and nothing else beside them."""
    cfg = _config(tmp_path)
    (mine,) = rank_roots([str(tmp_path)], layout_digest(cfg), cfg.model_config.model, 0)
    old = tmp_path / mine.name.replace(layout_digest(cfg), "0123456789ab")
    for d in (old, tmp_path / mine.name.replace("_c_r0", "_c_r1"), tmp_path / ("x" + mine.name)):
        d.mkdir()
    with caplog.at_level(logging.WARNING, logger="tiercache"):
        e = _Engine(tmp_path)
    said = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
    assert len(said) == 1 and str(old) in said[0] and "tiercache purge" in said[0], said
    assert "_c_r1" not in said[0] and str(tmp_path / ("x" + mine.name)) not in said[0]
    e.close()
    caplog.clear()
    shutil.rmtree(old)
    with caplog.at_level(logging.WARNING, logger="tiercache"):
        _Engine(tmp_path).close()
    assert not [r for r in caplog.records if "does not read" in r.getMessage()]


def test_the_connectors_stats_are_deltas_summed_over_ranks():
    from tiercache.integrations.vllmconnstats import TierCacheConnectorStats, deltas

    last: dict = {}
    assert deltas({"loaded_blocks": 5, "load_us": 2_500_000, "write_us": 7}, last) == {
        "loaded_blocks": 5, "load_seconds": 2.5}  # write_us is not exported
    assert deltas({"loaded_blocks": 5, "load_us": 2_500_000}, last) == {}  # nothing grew
    assert deltas({"loaded_blocks": 8, "load_us": 2_500_000}, last) == {"loaded_blocks": 3}
    one, two = TierCacheConnectorStats(data={"loaded_blocks": 3}), TierCacheConnectorStats(
        data={"loaded_blocks": 4, "load_seconds": 0.25})
    both = one.aggregate(two)
    assert both.data == {"loaded_blocks": 7, "load_seconds": 0.25} and one.data == {"loaded_blocks": 3}
    assert both.reduce() == {"load_seconds": 0.25, "loaded_blocks": 7} and not both.is_empty()
    both.reset()
    assert both.is_empty() and TierCacheConnectorStats(data={"loaded_blocks": 0}).is_empty()


@pytest.mark.parametrize("slabs", [8, 2], ids=["slabs-enough", "slabs-cycle"])
@pytest.mark.parametrize("damage", [None, "flip"])
@pytest.mark.parametrize("layout", ["flash", "packed"])
@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_layer_wise_load_lands_each_group_when_its_first_layer_waits(tmp_path, rng, where, layout, damage, slabs):
    """``layer_groups = 2`` (synchronous loads): ``start_load_kv`` only starts the reads; each
    ``wait_for_layer_load`` lands its group's span of every block (the later group's layers
    still hold the engine's own bytes), and the step's end checks every block whole (on the
    GPU there): all exact, or, a data byte flipped in the third block's file, a load error from
    that block on and the file quarantined. ``slabs-cycle``: two load slabs for three pieces of
    blocks, so a group's third piece is read into the columns of its first only once that one
    is up (a read before it gave every block of a 512-block load wrong bytes on an H200)."""
    hashes = [rng.bytes(32) for _ in range(6)]
    a = _Engine(tmp_path, layout, where)
    want = _store(a, "r1", hashes, 5 * BS + 3, list(range(10, 16)))
    a.close()
    b = _Engine(tmp_path, layout, where, async_scheduling=False, layer_groups=2)
    w = b.worker._worker
    w.load_slabs = slabs
    assert w.layer_groups is not None and [len(r) for r in w.layer_groups.regions] == [
        (2 if layout == "flash" else 1) * LAYERS // 2] * 2
    if damage:
        (path,) = tmp_path.glob(f"*/*/block_x{block_key(hashes[2]).hex()}_pool_*.bin")
        damage_file(path, damage)
    req = _request("r2", hashes[:5] + [rng.bytes(32)], 6 * BS + 1)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (5 * BS, False)  # synchronous: loaded in the step
    ids = [40, 7, 33, 2, 61, 5, 6]
    b.sched.update_state_after_alloc(req, _blocks(ids), 5 * BS)
    before = [b.block(x) for x in ids[:5]]
    new = [SimpleNamespace(req_id="r2", block_ids=(ids,), num_computed_tokens=5 * BS)]
    so = SimpleNamespace(scheduled_new_reqs=new,
                         scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                               resumed_req_ids=set()),
                         num_scheduled_tokens={"r2": BS + 1}, preempted_req_ids=set())
    meta = b.sched.build_connector_meta(so)
    assert meta.sync_loads and [t.block_ids for t in meta.loads] == [ids[:5]]
    b.worker.bind_connector_metadata(meta)
    b.worker.start_load_kv(None)
    parts = len(want[0]) // LAYERS  # a block's parts per layer (K and V, or one)
    names = list(b.caches)
    for layer, name in enumerate(names):
        b.worker.wait_for_layer_load(name)
        landed = 2 if layer >= LAYERS // 2 else 1  # groups in place
        for x, old, new in zip(ids[:5], before, want):
            got = b.block(x)
            cut = parts * LAYERS * landed // 2
            if x != ids[2] or not damage:
                assert got[:cut] == new[:cut] and got[cut:] == old[cut:], (layer, x)
    b.worker.wait_for_save()
    errors = b.worker.get_block_ids_with_load_errors()
    b.worker.clear_connector_metadata()
    if damage:
        assert errors == set(ids[2:5]) and w.counters["loaded_blocks"] == 2
        assert [b.block(x) for x in ids[:2]] == want[:2]
        assert list(tmp_path.glob("*/quarantine/block_*"))
    else:
        assert not errors and [b.block(x) for x in ids[:5]] == want and w.counters["loaded_blocks"] == 5
    assert w.counters["layerwise_loads"] == 1
    if where == "cuda":
        assert w.counters["gpu_checked_blocks"] == 5 and w.counters["gpu_checksum_mismatches"] == (1 if damage else 0)
    b.close()
