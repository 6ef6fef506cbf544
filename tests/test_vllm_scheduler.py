"""The connector under vLLM's own scheduler, on the CPU (tests/vllm_engine_sim.py): vLLM's
KV cache manager hands out the blocks, its prefix cache and its load-failure handling run,
and every slot a request reads must hold what the model wrote for its token."""

import random
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).parent))

from vllm_engine_sim import BLOCK_SIZE, SimEngine  # noqa: E402

from tiercache.bench.benchvllmserve import damage_file  # noqa: E402
from tiercache.errors import ConfigError  # noqa: E402
from tiercache.integrations.vllmconnector import block_key  # noqa: E402


@pytest.fixture(autouse=True)
def _hash_seed(monkeypatch):
    """vLLM's block hashes agree across engines only with PYTHONHASHSEED set (docs/vllm.md).
    The simulated runner keeps its own bookkeeping, as vLLM's V1 model runner does (what
    synchronous loads need: the V2 runner test below)."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(n)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_restarted_engine_loads_a_stored_prefix_into_the_blocks_vllm_gives(tmp_path, async_scheduling):
    """``load_mode = "auto"``: with vLLM scheduling synchronously the load runs in the step that
    computes the suffix (no step of waiting); with its async scheduling the request waits in
    WAITING_FOR_REMOTE_KVS for the load's step and the one scheduled before its report."""
    rng = random.Random()
    prompt = _prompt(rng, 5 * BLOCK_SIZE + 3)
    a = SimEngine(tmp_path, tmp_path / "root", num_blocks=40)
    a.add("a", prompt)
    a.run(lambda: "a" in a.finished)
    assert a.steps == [{"a": len(prompt)}, {"a": 1}]
    assert a.worker._worker.drain(10)
    a.close()
    b = SimEngine(tmp_path, tmp_path / "root", num_blocks=40, async_scheduling=async_scheduling)
    suffix = _prompt(rng, 4)
    b.add("b", prompt[:5 * BLOCK_SIZE] + suffix)
    b.run(lambda: "b" in b.first_token_step)
    assert b.steps[:b.first_token_step["b"] + 1] == [{}] * (2 * async_scheduling) + [{"b": len(suffix)}]
    assert b.check_blocks("b", 5 * BLOCK_SIZE + len(suffix)) == 84
    b.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_finished_requests_blocks_go_to_the_next_request_at_once_and_its_files_hold_its_bytes(
        tmp_path, async_scheduling):
    """Eight blocks (seven usable): a request of six blocks, then another of six. The first
    one's blocks are freed at its finish, so the second is scheduled in the very next step,
    while a slow writer still holds the only store slab: two of the first request's five
    blocks were gathered, the three still queued are skipped, and the second request's
    forward pass overwrites the blocks. A restarted engine loads exactly the two, with the
    first request's bytes, and computes the rest."""
    rng = random.Random()
    first, second = _prompt(rng, 5 * BLOCK_SIZE + 3), _prompt(rng, 5 * BLOCK_SIZE + 3)
    a = SimEngine(tmp_path, tmp_path / "root", num_blocks=8, async_scheduling=async_scheduling,
                  store_gathers="engine")
    w = a.worker._worker
    gate = threading.Event()
    real = w.store.submit_store

    def held(*args, **kwargs):  # the writer is slow: the slab stays busy
        gate.wait(10)
        return real(*args, **kwargs)

    w.store.submit_store = held
    with w._lock:
        w._free_slabs = w._free_slabs[:1]
    a.add("r1", first)
    a.add("r2", second)
    a.run(lambda: "r1" in a.first_token_step)
    r1_blocks = set(a.block_ids("r1"))
    a.run(lambda: "r2" in a.first_token_step)
    assert len(r1_blocks & set(a.block_ids("r2"))) >= 5  # r2 runs in r1's blocks
    last = max(i for i, st in enumerate(a.steps) if "r1" in st)
    # no step waits for r1's blocks (async scheduling schedules one step before r1's end is known)
    assert a.steps[last + 1:a.first_token_step["r2"] + 1] == [{}] * async_scheduling + [{"r2": len(second)}]
    assert w.counters["released_skipped_blocks"] == 3 and w.counters["released_requests"] == 1
    assert a.check_blocks("r2", len(second)) == len(second)  # in blocks r1 had
    a.run(lambda: "r2" in a.finished)
    gate.set()
    assert w.drain(10)
    a.close()
    c = SimEngine(tmp_path, tmp_path / "root", num_blocks=40)
    c.add("c", first[:5 * BLOCK_SIZE] + [1, 2])
    c.run(lambda: "c" in c.first_token_step)
    assert c.steps == [{"c": 3 * BLOCK_SIZE + 2}]  # two blocks from files (in the step), the rest computed
    assert c.check_blocks("c", 5 * BLOCK_SIZE + 2)
    c.close()


def _reference(tmp_path, prompt: list[int], max_tokens: int, async_scheduling: bool) -> list[int]:
    """The tokens a fresh engine (nothing on disk: every token computed) gives for ``prompt``."""
    r = SimEngine(tmp_path, tmp_path / "reference-root", num_blocks=40, async_scheduling=async_scheduling)
    r.add("ref", prompt, max_tokens)
    r.run(lambda: "ref" in r.finished)
    r.close()
    return r.emitted["ref"]


def _store_prompt(tmp_path, prompt: list[int]) -> dict:
    """One engine on ``tmp_path / "root"`` computes ``prompt`` and stores its full blocks;
    returns its worker's layout record."""
    a = SimEngine(tmp_path, tmp_path / "root", num_blocks=40)
    a.add("a", prompt)
    a.run(lambda: "a" in a.finished)
    assert a.worker._worker.drain(10)
    layout = a.worker._worker.layout
    a.close()
    return layout


def _stored_prefix(tmp_path, rng, async_scheduling: bool) -> tuple[list[int], list[int]]:
    """A six-block prefix stored under ``tmp_path / "root"`` by one engine; returns (that prefix
    with a 5-token suffix, a recompute's 4 tokens for it)."""
    prompt = _prompt(rng, 6 * BLOCK_SIZE + 1)
    asked = prompt[:6 * BLOCK_SIZE] + _prompt(rng, 5)
    want = _reference(tmp_path, asked, 4, async_scheduling)
    _store_prompt(tmp_path, prompt)
    return asked, want


def _damage_third_block(tmp_path, engine: SimEngine, rid: str, damage: str) -> None:
    """Damage (``damage_file``) the file of request ``rid``'s third block under ``tmp_path / "root"``."""
    third = block_key(engine.scheduler.requests[rid].block_hashes[2]).hex()
    (path,) = (tmp_path / "root").glob(f"*/*/block_x{third}_pool_*.bin")
    damage_file(path, damage)


@pytest.mark.parametrize("loads", ["sync", "async", "layer-wise"])
@pytest.mark.parametrize("damage", [None, "flip", "truncate", "delete"])
def test_tokens_from_files_equal_recomputes_and_a_damaged_file_is_recomputed(tmp_path, damage, loads):
    """A prefix stored by one engine, its third block's file damaged (or not), asked again by a
    restarted engine with a new suffix: vLLM's own load-failure handling (``kv_load_failure_policy
    = "recompute"``, which the connector sets) recomputes from the damaged block on, every slot
    holds the model's bytes, and the tokens equal a recompute's, with vLLM's scheduler in either
    mode. ``layer-wise`` (``layer_groups = 2``): each group's span of every file is read and sent
    up in ``wait_for_layer_load`` before its first layer computes, in the step that computes the
    suffix; a damaged file is found by its span reads or by the whole block's checksum at the
    step's end, and vLLM drops that step's output."""
    async_scheduling = loads == "async"
    asked, want = _stored_prefix(tmp_path, random.Random(), async_scheduling)
    b = SimEngine(tmp_path, tmp_path / "root", num_blocks=40, async_scheduling=async_scheduling,
                  **({"layer_groups": 2} if loads == "layer-wise" else {}))
    w = b.worker._worker
    assert (w.layer_groups is not None and len(w.layer_groups) == 2) is (loads == "layer-wise")
    b.add("b", asked, 4)
    if damage is not None:
        _damage_third_block(tmp_path, b, "b", damage)
    b.run(lambda: "b" in b.first_token_step)
    assert b.check_blocks("b", len(asked)) == len(asked)
    # the step that gave the first token computed the suffix (six blocks loaded), or, after the
    # failed load, everything from the damaged third block on
    computed = b.steps[b.first_token_step["b"]]["b"]
    assert computed == (5 if damage is None else 4 * BLOCK_SIZE + 5)
    if not async_scheduling:  # loaded in the step that computes the suffix: no step of waiting
        assert b.first_token_step["b"] == (0 if damage is None else 1)
    b.run(lambda: "b" in b.finished)
    assert b.emitted["b"] == want and len(want) == 4
    assert w.counters["layerwise_loads"] == (loads == "layer-wise")
    assert w.counters["loaded_blocks"] == (6 if damage is None else 2)
    b.close()


def test_load_mode_async_waits_a_step_and_sync_is_refused_with_vllms_async_scheduling(tmp_path):
    rng = random.Random()
    asked, want = _stored_prefix(tmp_path, rng, False)
    b = SimEngine(tmp_path, tmp_path / "root", num_blocks=40, load_mode="async")
    b.add("b", asked, 4)
    b.run(lambda: "b" in b.finished)
    assert b.steps[:b.first_token_step["b"] + 1] == [{}, {"b": 5}] and b.emitted["b"] == want
    b.close()
    with pytest.raises(ConfigError, match="'load_mode' = 'sync' needs vLLM's async scheduling off"):
        SimEngine(tmp_path, tmp_path / "root", num_blocks=40, async_scheduling=True, load_mode="sync")


def test_why_sync_loads_are_refused_with_async_scheduling_a_failed_one_gives_wrong_tokens(tmp_path):
    """What ``load_mode`` guards against, in vLLM itself: with its async scheduling, the step
    after a synchronous load is scheduled before the load's failure is known, from a token
    sampled over the damaged blocks, and vLLM gives that request's tokens out. Should a vLLM
    release fix this, this test fails, and ``sync`` may be allowed there."""
    rng = random.Random()
    asked, want = _stored_prefix(tmp_path, rng, True)
    b = SimEngine(tmp_path, tmp_path / "root", num_blocks=40, async_scheduling=True)
    b.scheduler.connector.sched.sync_loads = True  # what the check refuses
    b.add("b", asked, 4)
    _damage_third_block(tmp_path, b, "b", "flip")
    b.run(lambda: "b" in b.finished)
    assert len(b.emitted["b"]) == 4 and b.emitted["b"] != want
    b.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_under_vllms_scheduler_keeps_every_token_equal(tmp_path, async_scheduling):
    """Two requests that outgrow nine blocks: vLLM preempts one (its blocks freed at once, its
    stores still queued gathered first), resumes it, and both give a lone engine's tokens; the
    files written verify and a third engine loads them exact."""
    rng = random.Random()
    prompts = {"x": _prompt(rng, 3 * BLOCK_SIZE + 5), "y": _prompt(rng, 3 * BLOCK_SIZE + 7)}
    want = {rid: _reference(tmp_path / rid, p, 40, async_scheduling) for rid, p in prompts.items()}
    e = SimEngine(tmp_path, tmp_path / "root", num_blocks=10, async_scheduling=async_scheduling)
    for rid, p in prompts.items():
        e.add(rid, p, 40)
    e.run(lambda: set(prompts) <= e.finished, 400)
    assert e.preempted and {rid: e.emitted[rid] for rid in prompts} == want
    assert e.worker._worker.drain(10) and e.worker._worker.counters["stored_blocks"] == 6
    e.close()
    c = SimEngine(tmp_path, tmp_path / "root", num_blocks=40)
    c.add("c", prompts["y"][:3 * BLOCK_SIZE] + [4])
    c.run(lambda: "c" in c.first_token_step)
    assert c.steps == [{"c": 1}] and c.check_blocks("c", 3 * BLOCK_SIZE + 1)
    c.close()


def test_two_live_engines_on_a_shared_root_serve_each_others_prefixes(tmp_path, monkeypatch):
    """Two engines up at once on one root (``sharing = "shared"``): what one stores, the other
    finds at its next lookup that misses (a listing at most every ``RESCAN_S``), loads exact,
    and answers with a recompute's tokens."""
    from tiercache.integrations.vllmconnector import ConnectorScheduler

    monkeypatch.setattr(ConnectorScheduler, "RESCAN_S", 0.0)
    rng = random.Random()
    prompt = _prompt(rng, 4 * BLOCK_SIZE + 2)
    asked = prompt[:4 * BLOCK_SIZE] + [11, 12, 13]
    want = _reference(tmp_path, asked, 3, False)
    a = SimEngine(tmp_path, tmp_path / "root", num_blocks=40, sharing="shared")
    b = SimEngine(tmp_path, tmp_path / "root", num_blocks=40, sharing="shared")
    a.add("a", prompt)
    a.run(lambda: "a" in a.finished)
    assert a.worker._worker.drain(10)
    b.add("b", asked, 3)
    b.run(lambda: "b" in b.finished)
    assert b.steps[0] == {"b": 3} and b.emitted["b"] == want  # four blocks from a's files
    a.close()
    b.close()


def test_the_connectors_counters_reach_vllms_log_line_and_prometheus(tmp_path):
    """A worker's counter deltas go out with each step (``get_kv_connector_stats``), vLLM's
    scheduler passes them to its stats, and vLLM's own ``KVConnectorLogging`` and
    ``KVConnectorProm`` turn them into its "KV Transfer metrics" line and the Prometheus
    counters ``vllm:tiercache_connector_*_total``."""
    import functools

    import prometheus_client
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm

    rng = random.Random()
    asked, _ = _stored_prefix(tmp_path, rng, False)
    b = SimEngine(tmp_path, tmp_path / "root", num_blocks=40)
    b.add("b", asked, 4)
    b.run(lambda: "b" in b.finished)
    assert b.connector_stats, "no stats reached vLLM's scheduler"
    summed: dict = {}
    for d in b.connector_stats:
        for k, v in d.items():
            summed[k] = summed.get(k, 0) + v
    assert summed["loaded_blocks"] == 6 and summed["load_calls"] == 1 and summed["load_seconds"] > 0
    assert "stored_blocks" not in summed and "load_error_blocks" not in summed  # nothing new to store
    lines: list[str] = []
    logging_ = KVConnectorLogging(b.config.kv_transfer_config)
    for d in b.connector_stats:
        logging_.observe(d)
    logging_.log(lambda fmt, *args: lines.append(fmt % args))
    assert lines and "loaded_blocks=6" in lines[0] and "load_calls=1" in lines[0]
    registry = prometheus_client.CollectorRegistry()

    class Prom(KVConnectorProm):
        _counter_cls = functools.partial(prometheus_client.Counter, registry=registry)

    prom = Prom(b.config, ["model_name", "engine"], {0: ["tiny", "0"]})
    for d in b.connector_stats:
        prom.observe(d, 0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:tiercache_connector_loaded_blocks_total", labels) == 6
    assert registry.get_sample_value("vllm:tiercache_connector_load_error_blocks_total", labels) == 0
    b.close()


def test_synchronous_loads_are_timed_by_their_workers_not_by_the_step_that_computes_them(tmp_path):
    """``load_policy = "faster"`` weighs a load against recomputing it. A synchronous load's
    request is computed in the load's own step, so the rate comes from the workers' measure
    of the load (its stats), not from the step's scheduling to its output."""
    rng = random.Random()
    prompts = [_prompt(rng, 70 * BLOCK_SIZE + 1) for _ in range(2)]
    a = SimEngine(tmp_path, tmp_path / "root", num_blocks=200)
    for i, p in enumerate(prompts):
        a.add(f"a{i}", p, 1)
    a.run(lambda: {"a0", "a1"} <= a.finished)
    assert a.worker._worker.drain(30)
    a.close()
    b = SimEngine(tmp_path, tmp_path / "root", num_blocks=200)
    cost = b.scheduler.connector.sched.cost
    for i, p in enumerate(prompts):  # the first load warms up, the second measures
        b.add(f"b{i}", p[:70 * BLOCK_SIZE] + [i + 1], 1)
        b.run(lambda i=i: f"b{i}" in b.finished)
    last = b.connector_stats[-1] if "loaded_blocks" in b.connector_stats[-1] else next(
        d for d in reversed(b.connector_stats) if "loaded_blocks" in d)
    assert last["loaded_blocks"] == 70 and cost.warmups == 1
    assert cost.load_s_per_block == pytest.approx(last["load_seconds"] / 70)
    assert not cost._loads  # nothing left waiting for a report that never comes
    b.close()


@pytest.mark.parametrize("rank", ["this-rank", "another-rank"])
def test_blocks_computed_over_a_failed_synchronous_load_never_reach_a_later_request(tmp_path, monkeypatch, rank):
    """A synchronous load fails at the third of six stored blocks, in the step whose forward
    pass also computes three more full blocks of the prompt over the bad ones (vLLM discards
    that output and recomputes from the third block). Those three blocks' bytes are wrong: the
    worker whose load failed never stores them, and where another rank's load failed (with
    tensor parallelism every rank computes over it; ``another-rank`` writes them here) the next
    step tells every worker to delete them. The recompute stores the blocks again from the
    third on, and a restarted engine loads all nine exact, with a recompute's tokens."""
    from tiercache.integrations.vllmconnector import ConnectorWorker

    if rank == "another-rank":  # this worker's own load did not fail: it writes what it computed
        monkeypatch.setattr(ConnectorWorker, "_drop_failed_stores", lambda self: self._failed_sync.clear())
    rng = random.Random()
    prompt = _prompt(rng, 6 * BLOCK_SIZE + 1)
    _store_prompt(tmp_path, prompt)
    asked = prompt[:6 * BLOCK_SIZE] + _prompt(rng, 3 * BLOCK_SIZE + 5)
    b = SimEngine(tmp_path, tmp_path / "root", num_blocks=40)
    b.add("b", asked, 2)
    _damage_third_block(tmp_path, b, "b", "flip")
    b.run(lambda: "b" in b.finished)
    assert b.steps[:2] == [{"b": 3 * BLOCK_SIZE + 5}, {"b": 7 * BLOCK_SIZE + 5}]  # loaded, then recomputed
    w = b.worker._worker
    assert w.drain(10)
    if rank == "this-rank":
        assert w.counters["stores_dropped_blocks"] == 3 and not w.counters["discarded_blocks"]
    else:
        assert w.counters["discarded_blocks"] + w.counters["stores_dropped_blocks"] == 3
    b.close()
    later = asked[:9 * BLOCK_SIZE] + _prompt(rng, 3)
    want = _reference(tmp_path, later, 3, False)
    c = SimEngine(tmp_path, tmp_path / "root", num_blocks=40)
    c.add("c", later, 3)
    c.run(lambda: "c" in c.first_token_step)
    assert c.steps[0] == {"c": 3}  # nine blocks from files
    assert c.check_blocks("c", len(later))
    c.run(lambda: "c" in c.finished)
    assert c.emitted["c"] == want
    c.close()


def test_engines_whose_caches_lay_blocks_out_otherwise_never_share_a_directory(tmp_path):
    """Two engines of one configuration (one directory digest) whose KV caches order a block's
    bytes differently in memory (an auto-selected attention backend can): the first records its
    layout in the directory, the second is refused at start with both layouts named, never
    served the first one's bytes. An engine of the second layout alone stores and loads exact."""
    from tiercache.integrations.vllmconnector import kv_layout

    rng = random.Random()
    prompt = _prompt(rng, 3 * BLOCK_SIZE + 1)
    nhd = _store_prompt(tmp_path, prompt)
    with pytest.raises(ConfigError, match=r"another memory layout.*order \[0, 1, 2, 3, 4\].*order \[0, 1, 3, 2, 4\]"):
        SimEngine(tmp_path, tmp_path / "root", num_blocks=40, layout="HND")
    for name in ("hnd-a", "hnd-b"):  # the second one loads what the first stored
        e = SimEngine(tmp_path, tmp_path / "hnd-root", num_blocks=40, layout="HND")
        e.add(name, prompt[:3 * BLOCK_SIZE] + [5, 6])
        e.run(lambda: name in e.first_token_step)
        assert e.check_blocks(name, 3 * BLOCK_SIZE + 2)
        loaded = e.steps[0] == {name: 2}
        e.run(lambda: name in e.finished)
        assert e.worker._worker.drain(10)
        hnd = e.worker._worker.layout
        e.close()
    assert loaded and hnd["signature"] != nhd["signature"]
    assert kv_layout(e.caches, 40) == hnd  # a function of the tensors alone


def test_a_layer_wise_load_whose_layers_vllm_never_waits_for_is_recomputed_and_loads_turn_whole(tmp_path,
                                                                                                  monkeypatch):
    """A model whose attention layers vLLM does not wrap never calls ``wait_for_layer_load``:
    the groups then land after the forward pass read the blocks, so the connector reports the
    whole load failed (vLLM recomputes it: the tokens stay a recompute's) and loads whole
    blocks from then on."""
    from tiercache.integrations.vllmconnector import TierCacheConnector

    rng = random.Random()
    asked, want = _stored_prefix(tmp_path, rng, False)
    monkeypatch.setattr(TierCacheConnector, "wait_for_layer_load", lambda self, name: None)
    b = SimEngine(tmp_path, tmp_path / "root", num_blocks=40, layer_groups=2)
    w = b.worker._worker
    b.add("b", asked, 4)
    b.run(lambda: "b" in b.finished)
    assert b.emitted["b"] == want and b.steps[:2] == [{"b": 5}, {"b": 6 * BLOCK_SIZE + 5}]
    assert w.counters["layerwise_unwaited_loads"] == 1 and w.layer_groups is None
    b.add("c", asked[:6 * BLOCK_SIZE] + [3, 4], 2)  # a whole-block load now
    b.run(lambda: "c" in b.first_token_step)
    assert b.steps[-1] == {"c": 2} and b.check_blocks("c", 6 * BLOCK_SIZE + 2)
    b.close()


def test_layer_groups_need_synchronous_loads(tmp_path):
    with pytest.raises(ConfigError, match="'layer_groups' needs synchronous loads"):
        SimEngine(tmp_path, tmp_path / "root", num_blocks=40, async_scheduling=True, layer_groups=2)
    with pytest.raises(ConfigError, match="'layer_groups' = 1"):
        SimEngine(tmp_path, tmp_path / "root", num_blocks=40, layer_groups=1)


def test_on_vllms_v2_model_runner_loads_are_asynchronous_and_sync_is_refused(tmp_path, monkeypatch):
    """vLLM's V2 model runner recomputes a failed synchronous load from the wrong offset
    (vllm-project/vllm#49250: wrong tokens, seen with this connector on an H200): there
    ``auto`` loads asynchronously even with vLLM scheduling synchronously, and ``sync`` and
    ``layer_groups`` are refused, naming the issue."""
    from vllm.config import VllmConfig

    rng = random.Random()
    asked, want = _stored_prefix(tmp_path, rng, False)
    # what the connector reads of the runner (vLLM's own check of a V2 runner wants Triton and a GPU)
    monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(lambda self: True))
    monkeypatch.setattr(VllmConfig, "_validate_v2_model_runner", lambda self: None, raising=False)
    b = SimEngine(tmp_path, tmp_path / "root", num_blocks=40)
    assert b.config.use_v2_model_runner and not b.scheduler.connector.sched.sync_loads
    b.add("b", asked, 4)
    b.run(lambda: "b" in b.finished)
    assert b.steps[:b.first_token_step["b"] + 1] == [{}, {"b": 5}] and b.emitted["b"] == want
    b.close()
    for extra in ({"load_mode": "sync"}, {"layer_groups": 2}):
        with pytest.raises(ConfigError, match="VLLM_USE_V2_MODEL_RUNNER=0.*49250"):
            SimEngine(tmp_path, tmp_path / "root", num_blocks=40, **extra)
