"""``tiercache bench vllm-serve``.

On the CPU, its orchestration (engine processes per mode, the shared pair, restart, the kill,
the report) over a stand-in for vLLM's offline API (tests/fake_vllm). On a GPU with vLLM, the
seconds-long real version: a tiny random-weight Llama, recompute against vLLM's ``fs`` tier and
TierCacheTier, tokens compared and every file verified.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiercache import ConfigError
from tiercache.bench.benchvllmserve import MODES, format_serve_report, model_config, run_serve_bench, workload

FAKE = Path(__file__).with_name("fake_vllm")


def test_model_geometries_are_the_published_ones():
    name, cfg = model_config("llama-3.1-8b")
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["hidden_size"]) == (32, 8, 4096)
    _, q = model_config("qwen2.5-32b")
    assert (q["num_hidden_layers"], q["num_key_value_heads"], q["intermediate_size"]) == (64, 8, 27648)
    with pytest.raises(ConfigError, match="no such model.*llama-3.1-8b"):
        model_config("llama-9")


def test_workload_repeats_each_prefix_with_new_suffixes():
    reqs = workload(5, 1000, prefixes=3, prefix_tokens=64, suffix_tokens=16, rounds=3)
    assert [(r["prefix"], r["round"]) for r in reqs] == [(p, r) for r in range(3) for p in range(3)]
    for r in reqs:
        assert r["ids"][:64] == reqs[r["prefix"]]["ids"][:64] and len(r["ids"]) == 80
    assert len({tuple(r["ids"][64:]) for r in reqs}) == len(reqs)


@pytest.mark.slow
def test_orchestration_over_a_stand_in_engine(tmp_path, monkeypatch):
    """Every mode's engine process runs; the shared pair's second process runs the repeats; the
    restarted processes run the repeats; the killed engine's successor runs every request; the
    report has each mode's row and the stand-in's connector hits show as connector tokens."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")]))
    rep = run_serve_bench(tmp_path, model="tiny-llama", prefixes=3, prefix_tokens=512, suffix_tokens=256, rounds=2,
                          max_tokens=4, kill9=True, fio=False, seed=11)
    assert set(rep["modes"]) == set(MODES) | {"fs+restart", "tiercache+restart", "connector+restart", "tiercache+kill9",
                                              "connector+kill9"}
    for mode in MODES:
        m = rep["modes"][mode]
        assert m["requests"] == 6 and m["compared"] == 6, mode
        assert m.get("same_tokens_as_recompute", 6) == 6  # the stand-in's tokens depend on the prompt only
        if mode != "recompute":
            assert [r["same_as_recompute"] for r in m["per_request"]] == [True] * 6, mode
    assert rep["modes"]["recompute"]["repeat_connector_tokens"] == 0
    # the bound's GPU-hit TTFT: the median of five prefix hits in recompute's process; each file
    # mode times five of its own after its rounds
    assert len(rep["gpu_hit_ttft_samples_s"]) == 5 and rep["gpu_hit_ttft_s"] == sorted(rep["gpu_hit_ttft_samples_s"])[2]
    for mode in ("fs", "tiercache", "connector"):
        assert len(rep["modes"][mode]["gpu_hit_after_ttft_samples_s"]) == 5, mode
    assert rep["modes"]["fs"]["repeat_connector_tokens"] == 3 * 512  # each repeat's prefix, once seen
    assert rep["modes"]["tiercache+restart"]["requests"] == 3
    # the shared pair's second engine finds every prefix in the first one's files: the first one
    # drained its last request's stores before it went idle
    assert rep["modes"]["tiercache-shared"]["repeat_connector_tokens"] == 3 * 512
    assert rep["modes"]["connector-shared"]["repeat_connector_tokens"] == 3 * 512
    assert rep["modes"]["tiercache+restart"]["repeat_connector_tokens"] == 3 * 512
    assert rep["modes"]["fs"]["served_repeats"] == 3 and rep["modes"]["recompute"]["served_repeats"] == 0
    assert set(rep["tiercache_over_fs_served_speed"]) == {"p50", "p99"}
    for mode in ("tiercache+kill9", "connector+kill9"):
        assert rep["modes"][mode]["requests"] == 6 and "SIGKILL" in rep["modes"][mode]["kill_detail"]
    assert rep["ok"] and rep["break_even_gbps"] > 0
    text = format_serve_report(rep)
    assert "tiercache-shared" in text and "break" not in text or "beats it above" in text
    assert not list(tmp_path.glob("vllm-serve-*"))  # the work directory is removed without --keep


def test_connector_variants_run_beside_the_connector_with_their_own_settings_and_roots(tmp_path, monkeypatch):
    """``connector_variants``: each is one more connector mode right after ``connector``
    (``connector~1``, ...), its engine given the run's settings with the variant's over them, on a
    root of its own; its row gives its speed over fs and over the connector; a variant that
    names a root (or a run that sets one) is refused."""
    import json

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")]))
    variants = [{"piece_blocks": 4}, {"load_switch_s": 0.0002, "io_threads": 8}]
    rep = run_serve_bench(tmp_path, model="tiny-llama", modes=("recompute", "fs", "connector"), prefixes=2,
                          prefix_tokens=64, suffix_tokens=16, rounds=2, max_tokens=2, restart=False, fio=False,
                          seed=5, cpu_tier_prefixes=1.25, keep=True, connector_settings={"io_engine": "threads"},
                          connector_variants=variants)
    assert list(rep["modes"]) == ["recompute", "fs", "connector", "connector~1", "connector~2"]
    specs = {}
    for f in Path(rep["work"]).glob("spec-*.json"):
        spec = json.loads(f.read_text())
        specs[spec["mode"]] = (spec["kv_transfer"] or {}).get("kv_connector_extra_config", {})
    assert specs["connector"]["io_engine"] == "threads" and "piece_blocks" not in specs["connector"]
    assert specs["connector~1"]["piece_blocks"] == 4 and specs["connector~1"]["io_engine"] == "threads"
    assert specs["connector~2"]["load_switch_s"] == 0.0002 and specs["connector~2"]["io_threads"] == 8
    assert len({specs[m]["root"] for m in ("connector", "connector~1", "connector~2")}) == 3
    for name in ("connector~1", "connector~2"):
        m = rep["modes"][name]
        assert m["requests"] == 4 and m.get("same_tokens_as_recompute", 4) == 4
        assert m["over_fs_speed"] > 0 and m["over_connector_speed"] > 0
    # tiercache's own lines of each engine's log are in its mode's report, and only its own
    assert rep["modes"]["connector~1"]["tiercache_log"] == ["tiercache: fake engine: pieces of 4 blocks"]
    assert "tiercache_log" not in rep["modes"]["connector~2"]
    assert rep["connector_variants"] == {"connector~1": variants[0], "connector~2": variants[1]}
    assert "connector~1 (piece_blocks=4): repeat TTFT p50 speed over connector" in format_serve_report(rep)
    for bad in ({"root": "/x"}, {}):
        with pytest.raises(ConfigError, match="connector variant connector~1"):
            run_serve_bench(tmp_path, modes=("connector",), prefixes=2, cpu_tier_prefixes=1.25,
                            connector_variants=[bad])
    with pytest.raises(ConfigError, match="no --connector-set root either"):
        run_serve_bench(tmp_path, modes=("connector",), prefixes=2, cpu_tier_prefixes=1.25,
                        connector_settings={"root": "/x"}, connector_variants=[{"piece_blocks": 4}])


def test_a_failing_engine_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_VLLM_CRASH", "TierCacheTier")
    with pytest.raises(
        ConfigError, match="(?s)the tiercache engine exited 1; its log ends:.*fake engine asked to fail"
    ):
        run_serve_bench(tmp_path, model="tiny-llama", modes=("recompute", "tiercache"), prefixes=2, prefix_tokens=64,
                        suffix_tokens=256, rounds=1, restart=False, fio=False, cpu_tier_prefixes=1.25)
    with pytest.raises(ConfigError, match=r"cpu_tier_prefixes=2.0 must be in \[0.1, 2\)"):
        run_serve_bench(tmp_path, prefixes=2)
    with pytest.raises(ConfigError, match="mode 'disk'; valid: recompute"):
        run_serve_bench(tmp_path, modes=("disk",))


def _real_vllm() -> bool:
    return subprocess.run([sys.executable, "-c", "import vllm, torch; assert torch.cuda.is_available()"],
                          capture_output=True).returncode == 0


@pytest.mark.gpu
def test_tiny_model_in_a_real_vllm_tokens_match_and_files_verify(tmp_path):
    """The seconds-long real version: recompute, vLLM's fs tier and TierCacheTier on one prefix
    asked twice. Cold requests compute the same thing in every mode (same tokens as recompute);
    repeats load the same KV bytes from either tier's files (same tokens as the fs tier's); the
    tiercache root verifies clean."""
    if not _real_vllm():
        pytest.skip("needs vLLM with a GPU build")
    rep = run_serve_bench(tmp_path, model="tiny-llama", modes=("recompute", "fs", "tiercache"), prefixes=2,
                          prefix_tokens=2048, suffix_tokens=64, rounds=2, max_tokens=4, restart=False, fio=False,
                          gpu_util=0.3, seed=3, cpu_tier_prefixes=1.25)
    tc, fs = rep["modes"]["tiercache"], rep["modes"]["fs"]
    # a repeat's prefix comes from files (the last blocks may still be in the GPU's prefix cache)
    assert tc["repeat_file_tokens"] + tc["repeat_gpu_tokens"] >= 2 * 2048 and tc["repeat_file_tokens"] >= 2 * 1024, tc
    assert tc["same_tokens_as_fs"] == tc["compared"] == 4
    assert rep["ok"] and tc["verify"] and all(v["bad"] == 0 and v["checked"] > 0 for v in tc["verify"])
    assert fs["repeat_file_tokens"] > 0


@pytest.mark.gpu
def test_tiny_model_through_the_connector_equals_recompute_even_with_damaged_files(tmp_path):
    """tiercache's own path (TierCacheConnector) in a real vLLM: repeats load their prefixes from
    files straight into the GPU's blocks and give recompute's tokens; then, with a byte flipped in
    one block file, one truncated and one deleted before the repeats, every request still gives
    recompute's tokens (those blocks are recomputed) and what is left verifies."""
    if not _real_vllm():
        pytest.skip("needs vLLM with a GPU build")
    kw = dict(model="tiny-llama", prefixes=2, prefix_tokens=2048, suffix_tokens=64, rounds=2, max_tokens=4,
              restart=False, fio=False, gpu_util=0.3, seed=3, cpu_tier_prefixes=1.25)
    rep = run_serve_bench(tmp_path / "a", modes=("recompute", "connector"), **kw)
    cn = rep["modes"]["connector"]
    assert cn["repeat_file_tokens"] >= 2 * 1024, cn
    assert cn["same_tokens_as_recompute"] == cn["compared"] == 4
    assert rep["ok"] and cn["verify"] and all(v["bad"] == 0 and v["checked"] > 0 for v in cn["verify"])
    rep = run_serve_bench(tmp_path / "b", modes=("recompute", "connector"), damage=5, **kw)
    cn = rep["modes"]["connector"]
    assert len(cn["damaged"]) == 3 and cn["same_tokens_as_recompute"] == cn["compared"] == 4, cn
    # a damaged file that a repeat read went to quarantine; one no repeat needed is still there, bad
    assert sum(v["bad"] for v in cn["verify"]) <= 2


class _Out:
    def __init__(self, tokens):
        self.total_num_scheduled_tokens = tokens


class _Result:
    def __init__(self, job_id):
        self.job_id = job_id


class _Job:
    def __init__(self, job_id, keys):
        self.job_id, self.keys = job_id, keys


class _Engine:
    """Stand-ins for the wrapped vLLM classes, each method taking a known time."""

    def schedule(self, tokens):
        time.sleep(0.001)
        return _Out(tokens)

    def execute_model(self, seconds):
        time.sleep(seconds)

    def lookup(self):
        time.sleep(0.002)
        return 0

    def submit_read(self, job):
        pass

    def reads_done(self, ids):
        return (_Result(i) for i in ids)  # a generator, as some releases return

    def submit_upload(self, job_id, src, dst):
        pass

    def uploads_done(self, ids):
        return [_Result(i) for i in ids]


def test_blocks_freed_is_traced_from_finished_sending_and_from_the_connectors_release():
    """The connector frees a finished request's blocks at once and releases its stores the next
    step (``ConnectorWorker._release``); the trace counts those requests, as it counts
    ``get_finished``'s finished_sending, and records nothing where nothing was freed."""
    from tiercache.bench.stagetrace import TARGETS, StageTrace

    assert ("tiercache.integrations.vllmconnector", "ConnectorWorker", "_release", "blocks_freed") in TARGETS
    from tiercache.integrations.vllmconnector import ConnectorWorker

    assert callable(getattr(ConnectorWorker, "_release", None))
    trace = StageTrace(())
    assert trace._info("blocks_freed", ({"r1", "r2"},), {}, None) == {"requests": 2}
    assert trace._info("blocks_freed", (set(),), {}, None) is None
    assert trace._info("blocks_freed", ({"r1"},), {}, ({"r1"}, None)) == {"requests": 1}
    assert trace._info("blocks_freed", (set(),), {}, (None, {"r9"})) is None


def test_stage_trace_splits_a_requests_time_into_the_engines_stages():
    import time as _t

    from tiercache.bench.stagetrace import StageTrace, breakdown

    targets = tuple((__name__, "_Engine", m, s) for m, s in (
        ("schedule", "step"), ("execute_model", "forward"), ("lookup", "lookup"), ("submit_read", "read_submit"),
        ("reads_done", "read_done"), ("submit_upload", "upload_submit"), ("uploads_done", "upload_done")))
    targets += (("no.such.module", "X", "y", "step"), (__name__, "_Engine", "no_such_method", "step"))
    real = {m: getattr(_Engine, m) for _, _, m, _ in targets[:7]}
    trace = StageTrace(targets).install()
    try:
        assert len(trace.installed) == 7
        e = _Engine()
        mark, t0 = trace.mark(), _t.perf_counter()
        e.lookup()
        e.schedule(0)
        e.submit_read(_Job(7, ["a", "b", "c"]))
        _t.sleep(0.02)
        assert list(e.reads_done([])) == []          # a poll that found nothing: no event
        assert [r.job_id for r in e.reads_done([7])] == [7]
        e.schedule(0)
        e.execute_model(0.001)
        _t.sleep(0.01)
        e.submit_upload(3, None, None)
        _t.sleep(0.005)
        n = trace.mark()
        assert [r.job_id for r in e.uploads_done([99])] == [99] and trace.mark() == n  # a store's completion: no event
        e.uploads_done([3])
        e.schedule(256)
        e.execute_model(0.03)
        t1 = _t.perf_counter()
        st = breakdown(trace.since(mark), t0, t1)
    finally:
        for m, f in real.items():
            setattr(_Engine, m, f)
    assert st["lookups"] == 1 and 1.5 <= st["lookup_ms"] <= 50
    assert st["read_chunks"] == 3 and 19 <= st["read_ms"] <= 200
    assert 10 <= st["read_to_upload_ms"] <= 200 and 4 <= st["upload_ms"] <= 200
    assert 29 <= st["prefill_ms"] <= 300 and st["prefill_ms"] <= st["after_upload_ms"]
    assert st["steps"] == 3 and st["step_tokens"] == [0, 0, 256] and st["idle_forward_ms"] < st["prefill_ms"]
    assert abs(st["ttft_ms"] - (t1 - t0) * 1e3) < 1e-3
    assert [e[0] for e in st["timeline"]] == ["lookup", "step", "read_submit", "read_done", "step", "forward",
                                              "upload_submit", "upload_done", "step", "forward"]
    assert [e[3] for e in st["timeline"] if e[0] in ("step", "read_submit")] == [0, 3, 0, 256]
    starts = [e[1] for e in st["timeline"]]
    assert starts == sorted(starts) and all(0 <= e[1] <= e[2] <= st["ttft_ms"] for e in st["timeline"])
    many = breakdown([("step", 1.0 + i * 1e-3, 1.0 + i * 1e-3, {"tokens": 0}) for i in range(49)], 0.9, 1.25)
    assert many["timeline"] is None and many["steps"] == 49  # too many events to keep
    # a recompute: no reads, no upload
    only = breakdown([("step", 1.0, 1.001, {"tokens": 8448}), ("forward", 1.002, 1.2, {})], 0.9, 1.25)
    assert only["read_ms"] is None and only["upload_ms"] is None and abs(only["prefill_ms"] - 198) < 1e-6
    assert only["store_gather_ms"] is None and only["blocks_freed_ms"] is None and only["store_writes"] == 0
    # the connector's stores: gathers summed, the last freeing of blocks from submission, writes counted
    cold = breakdown([("blocks_freed", 0.95, 0.96, {"requests": 1}), ("store_write", 0.97, 0.99, {}),
                      ("step", 1.0, 1.001, {"tokens": 8448}), ("store_gather", 1.21, 1.215, {}),
                      ("store_gather", 1.22, 1.223, {}), ("store_write", 1.23, 1.24, {})], 0.9, 1.25)
    assert abs(cold["store_gather_ms"] - 8) < 1e-6 and abs(cold["blocks_freed_ms"] - 60) < 1e-6
    assert cold["store_writes"] == 2
