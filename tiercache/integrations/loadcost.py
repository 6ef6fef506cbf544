"""Load or recompute: whether reading a prefix's blocks from files beats computing them again,
from rates measured while the engine runs.

A prefix of ``n`` blocks costs ``n * load_s_per_block`` to load (the storage, measured from the
engine's own loads: from the step that issued a load to the output that reported it) and about
``n * tokens_per_block * prefill_s_per_token`` to recompute (measured from the engine's steps
that computed at least :data:`MIN_STEP_TOKENS` tokens and loaded nothing: from the step's
scheduling to its output reaching the scheduler, :meth:`LoadCost.output`. With vLLM's async
scheduling the next step is scheduled before a step's output comes back, so a step's output is
the first one after the step that follows it: ``pipeline_depth`` 2. The interval between two
schedulings measured the host's pace there, not the GPU's, once nothing on the engine's thread
waited for the GPU.) On fast storage a
load wins by a wide margin; on a disk slower than the model's break-even speed (for
Llama-3.1-8B on an H200, about 5 GB/s: docs/vllm.md) recomputing is faster, and a load there
also holds up every request in the engine's step. The linear prefill estimate undercounts long
prefixes (attention grows with the prefix), which leans toward loading.

The engine's first :data:`WARMUP_LOADS` loads of at least :data:`MIN_LOAD_BLOCKS` blocks do not
measure the storage: they pay what only a first load pays, and they run while the cold round's
stores are still being written (on four RAM-backed ext4 devices, with ``fsync = "data"``, an
H200 run's first load took 229 ms for 1 GiB, where the same storage read it in 94 ms later; that
one measurement made every later prefix recompute). Until both rates are measured, every prefix
loads; while recomputing wins, every :data:`PROBE_EVERY`-th prefix loads anyway, so that a
storage that got faster (or an engine that got busier) is seen.
"""

from __future__ import annotations

import collections
import time

#: steps that computed fewer tokens than this do not measure the prefill rate (decode steps)
MIN_STEP_TOKENS = 512
#: a step interval longer than this (seconds) is an idle engine, not a step
MAX_STEP_S = 10.0
#: while recomputing wins, one prefix in this many is loaded anyway (to measure again)
PROBE_EVERY = 16
#: loads of fewer blocks do not measure the storage (the step around a load adds a fixed time
#: that small loads would spread over too few blocks)
MIN_LOAD_BLOCKS = 64
#: the first loads (of at least MIN_LOAD_BLOCKS blocks) measure nothing: warm-up
WARMUP_LOADS = 1
#: weight of a new measurement in the moving averages
ALPHA = 0.3
#: policies: ``always`` load what is on disk; ``faster``: load only where it beats recomputing
POLICIES = ("always", "faster")


class LoadCost:
    """The rates and the decision (see the module's doc).

    Args:
        tokens_per_block: tokens in one block.
        policy: one of :data:`POLICIES`.
        clock: seconds, monotonic (tests give their own).
        pipeline_depth: steps scheduled before a step's output comes back, that step included
            (1: synchronous scheduling; 2: vLLM's async scheduling).
    """

    def __init__(self, tokens_per_block: int, policy: str = "always", clock=time.monotonic,
                 pipeline_depth: int = 1) -> None:
        self.tokens_per_block = int(tokens_per_block)
        self.depth = max(1, int(pipeline_depth))
        self.policy = policy
        self.clock = clock
        self.load_s_per_block: float | None = None
        self.prefill_s_per_token: float | None = None
        self.skipped = 0  # prefixes recomputed because loading was slower
        self.probes = 0
        self.warmups = 0  # loads not measured (WARMUP_LOADS)
        self._step_no = 0
        self._open: collections.deque = collections.deque()  # (step, scheduled at, tokens) of prefill steps
        self._loads: dict[str, tuple[float, int]] = {}

    @staticmethod
    def _avg(old: float | None, new: float) -> float:
        return new if old is None else (1 - ALPHA) * old + ALPHA * new

    def step(self, tokens: int, loads: dict[str, int]) -> None:
        """A step was scheduled: ``tokens`` tokens to compute, ``loads`` (request -> blocks)
        issued in it. A step of at least :data:`MIN_STEP_TOKENS` tokens and no load measures
        the prefill once its output comes back (:meth:`output`)."""
        now = self.clock()
        self._step_no += 1
        if tokens >= MIN_STEP_TOKENS and not loads:
            self._open.append((self._step_no, now, int(tokens)))
        for rid, blocks in loads.items():
            self._loads[rid] = (now, int(blocks))

    def output(self) -> None:
        """A step's output reached the scheduler (vLLM's ``update_connector_output``): it ends
        the prefill steps scheduled ``pipeline_depth - 1`` or more steps before the latest."""
        now = self.clock()
        while self._open and self._open[0][0] + self.depth - 1 <= self._step_no:
            _, t, tokens = self._open.popleft()
            dt = now - t
            if 0 < dt < MAX_STEP_S:
                self.prefill_s_per_token = self._avg(self.prefill_s_per_token, dt / tokens)

    def loaded(self, req_id: str) -> None:
        """Request ``req_id``'s load was reported done: measures the storage (from the load
        after the first :data:`WARMUP_LOADS`)."""
        t = self._loads.pop(req_id, None)
        if t is not None:
            self.measured(self.clock() - t[0], t[1])

    def measured(self, seconds: float, blocks: int) -> None:
        """A load's own duration as its worker measured it (``seconds`` for ``blocks`` blocks,
        both summed over ranks): the rate of a synchronous load, which costs its request no
        step of waiting, so the time from its scheduling to its output would count the
        request's prefill too. Loads under :data:`MIN_LOAD_BLOCKS` blocks measure nothing, and
        the first :data:`WARMUP_LOADS` only warm up."""
        if blocks < MIN_LOAD_BLOCKS or seconds <= 0:
            return
        if self.warmups < WARMUP_LOADS:
            self.warmups += 1
        else:
            self.load_s_per_block = self._avg(self.load_s_per_block, seconds / blocks)

    def forget(self, req_id: str) -> None:
        self._loads.pop(req_id, None)

    def should_load(self, blocks: int) -> bool:
        """Whether to load a prefix of ``blocks`` blocks found on disk (False: recompute it)."""
        if self.policy == "always" or blocks <= 0 or self.load_s_per_block is None \
                or self.prefill_s_per_token is None:
            return True
        if self.load_s_per_block <= self.tokens_per_block * self.prefill_s_per_token:
            return True
        self.skipped += 1
        if self.skipped % PROBE_EVERY == 0:
            self.probes += 1
            return True
        return False

    def stats(self) -> dict:
        """The rates (seconds) and the counts."""
        return {"load_s_per_block": self.load_s_per_block, "prefill_s_per_token": self.prefill_s_per_token,
                "recomputed_prefixes": self.skipped - self.probes, "probes": self.probes, "policy": self.policy}
