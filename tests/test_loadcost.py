"""Load or recompute (tiercache/integrations/loadcost.py): the rates come from the engine's own
steps and loads, a slow storage makes prefixes recompute, one in PROBE_EVERY still loads, fast
storage always loads, and nothing is skipped before both rates are measured."""

from __future__ import annotations

import pytest

from tiercache.integrations.loadcost import MIN_LOAD_BLOCKS, MIN_STEP_TOKENS, PROBE_EVERY, WARMUP_LOADS, LoadCost


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _load(cost: LoadCost, clock: Clock, load_s: float, blocks: int, tokens: int = 4096) -> None:
    """A step issuing a load of ``blocks`` blocks that is reported done ``load_s`` later."""
    cost.step(tokens, {"r": blocks})
    clock.t += load_s
    cost.output()
    cost.loaded("r")
    cost.step(0, {})


def _measure(cost: LoadCost, clock: Clock, step_s: float, tokens: int, load_s: float, blocks: int) -> None:
    """A prefill step of ``tokens`` whose output comes back ``step_s`` later (synchronous
    scheduling), then the warm-up loads (a tenth of ``load_s`` each: they measure nothing)
    and a load of ``blocks`` blocks that is reported done ``load_s`` later."""
    cost.step(tokens, {})
    clock.t += step_s
    cost.output()
    for _ in range(WARMUP_LOADS - cost.warmups):
        _load(cost, clock, load_s / 10, blocks, tokens)
    _load(cost, clock, load_s, blocks, tokens)


def test_slow_storage_recomputes_and_still_probes():
    clock = Clock()
    cost = LoadCost(16, "faster", clock)
    assert cost.should_load(512)  # nothing measured yet
    # prefill 25 us/token (400 us per 16-token block); loads 1 ms per block: recompute wins
    _measure(cost, clock, 0.025 * 2048 / 1000, 2048, 0.512, 512)
    assert cost.prefill_s_per_token == pytest.approx(25e-6) and cost.load_s_per_block == pytest.approx(1e-3)
    decisions = [cost.should_load(512) for _ in range(2 * PROBE_EVERY)]
    assert decisions.count(True) == 2 and decisions[PROBE_EVERY - 1] and decisions[-1]
    assert cost.stats()["recomputed_prefixes"] == 2 * PROBE_EVERY - 2


def test_fast_storage_and_the_always_policy_load():
    clock = Clock()
    cost = LoadCost(16, "faster", clock)
    _measure(cost, clock, 0.05, 2048, 0.05, 512)  # 24 us/token against 98 us/block: loading wins
    assert all(cost.should_load(512) for _ in range(50))
    slow = LoadCost(16, "always", clock)
    _measure(slow, clock, 0.05, 2048, 5.0, 512)
    assert all(slow.should_load(512) for _ in range(50)) and slow.skipped == 0


def test_small_idle_or_loading_steps_do_not_measure_the_prefill():
    clock = Clock()
    cost = LoadCost(16, "faster", clock)
    assert LoadCost(16).policy == "always"
    cost.step(MIN_STEP_TOKENS - 1, {})  # a decode step
    clock.t += 1.0
    cost.output()
    cost.step(4096, {"a": 4})  # a step with a load: its time is the load's, not the prefill's
    clock.t += 1.0
    cost.output()
    cost.step(4096, {})
    clock.t += 60.0  # an output that never came back in time (an idle or stalled engine)
    cost.output()
    assert cost.prefill_s_per_token is None
    cost.step(4096, {})
    clock.t += 0.1
    cost.output()
    assert cost.prefill_s_per_token == pytest.approx(0.1 / 4096)
    cost.forget("a")
    cost.loaded("a")  # a request that finished before its load was reported measures nothing
    assert cost.load_s_per_block is None
    cost.step(0, {"small": MIN_LOAD_BLOCKS - 1})
    clock.t += 1.0
    cost.loaded("small")  # the step around a small load is most of its time: not a rate
    assert cost.load_s_per_block is None


def test_with_async_scheduling_a_prefill_is_timed_to_its_own_output_not_the_next_scheduling():
    """vLLM's async scheduling schedules step N+1 while step N runs on the GPU, and step N's
    output comes back after that: the interval between schedulings is the host's pace. A
    prefill step is timed from its scheduling to its own output."""
    clock = Clock()
    cost = LoadCost(16, "faster", clock, pipeline_depth=2)
    cost.step(8448, {})  # the prefill, 0.2 s on the GPU
    clock.t += 0.001
    cost.output()  # the previous step's output: not this prefill's
    cost.step(1, {})  # the next step, scheduled 2 ms after the prefill's
    clock.t += 0.001
    assert cost.prefill_s_per_token is None
    clock.t += 0.198
    cost.output()  # the prefill's output
    assert cost.prefill_s_per_token == pytest.approx(0.2 / 8448)
    sync = LoadCost(16, "faster", clock)  # depth 1: the first output after the step is its own
    sync.step(8448, {})
    clock.t += 0.2
    sync.output()
    assert sync.prefill_s_per_token == pytest.approx(0.2 / 8448)


def test_the_first_load_measures_nothing_and_does_not_make_prefixes_recompute():
    """The first load pays one-time costs and runs beside the cold round's stores: a first load
    slower than recomputing (an H200 run on four RAM-backed devices: 229 ms for a prefix that
    later loaded in 94) must not turn every later prefix into a recompute."""
    clock = Clock()
    cost = LoadCost(16, "faster", clock)
    cost.step(2048, {})
    clock.t += 0.025 * 2048 / 1000  # 25 us/token: 400 us per block
    cost.output()
    _load(cost, clock, 512 * 1e-3, 512)  # 1 ms per block: slower than recomputing
    assert cost.load_s_per_block is None and cost.warmups == WARMUP_LOADS
    assert all(cost.should_load(512) for _ in range(3 * PROBE_EVERY)) and cost.skipped == 0
    _load(cost, clock, 512 * 0.2e-3, 512)  # then 0.2 ms per block
    assert cost.load_s_per_block == pytest.approx(0.2e-3)
    assert all(cost.should_load(512) for _ in range(3 * PROBE_EVERY))
    _load(cost, clock, 512 * 5e-3, 512)  # a storage that became slow is still seen
    assert not cost.should_load(512)


def test_a_workers_measure_of_a_load_counts_after_the_warm_up_and_above_the_minimum():
    cost = LoadCost(16, "faster")
    cost.measured(0.5, MIN_LOAD_BLOCKS - 1)  # too small to say anything
    assert cost.warmups == 0 and cost.load_s_per_block is None
    cost.measured(0.5, 100)  # the warm-up
    assert cost.warmups == 1 and cost.load_s_per_block is None
    cost.measured(0.2, 100)
    assert cost.load_s_per_block == pytest.approx(0.002)
    cost.measured(0.0, 100)  # no time: nothing measured
    assert cost.load_s_per_block == pytest.approx(0.002)
