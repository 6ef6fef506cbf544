"""Where a request's time to first token goes inside a vLLM engine: timestamps of the engine's
own steps, taken in one run (``tiercache bench vllm-serve --stages``).

:class:`StageTrace` wraps methods of vLLM's scheduler, model runner, offloading connector and
tiers (those that exist in the running release; a missing one is left out) and records, per
call, ``(stage, start, end, info)`` in ``time.perf_counter`` seconds. With requests served one at
a time, every event between a request's submission and its first token is that request's, and
:func:`breakdown` splits the interval:

- ``lookup_ms``: the connector's scheduler-side lookups (``get_num_new_matched_tokens``), summed;
- ``before_read_ms``: from submission to the first read a secondary tier was given;
- ``read_ms``: from the first read submitted to the last one reported done (the files into
  vLLM's CPU tier: reads and the CPU-tier copy, which both tiers do in one pass into the CPU
  tier's rows);
- ``read_to_upload_ms``: from the last read done to the first upload submitted (scheduler steps
  between the promotion and the GPU load);
- ``upload_ms``: from the first CPU -> GPU load submitted to the last one reported done;
- ``after_upload_ms``: from the last upload done to the first token, of which ``prefill_ms`` is
  the forward work (the worker's ``execute_model`` and ``sample_tokens``) of the step with the
  most scheduled tokens, the suffix's prefill;
- ``load_ms``: tiercache's connector's synchronous loads on the engine thread (the reads, and
  the uploads issued behind them), summed, and ``after_load_ms``: from the last one's end to
  the first token;
- ``steps``: scheduler steps in the interval, and ``idle_forward_ms``: the other forward passes;
- ``timeline``: the events in order, where at most :data:`TIMELINE_EVENTS`;
- ``store_gather_ms``: the connector's gathers of stores after forward passes (host time, summed),
  ``blocks_freed_ms``: from submission to the last step that freed an earlier request's blocks
  (their stores gathered, or, since the connector frees them at the finish, released), and
  ``store_writes``: store slabs whose files were finished meanwhile.

A stage that did not happen (a recompute, a prefix from the CPU tier) is None.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable

#: (module, class, method, stage): what is wrapped, where it exists
TARGETS: tuple[tuple[str, str, str, str], ...] = (
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "step"),
    ("vllm.v1.worker.gpu_worker", "Worker", "execute_model", "forward"),  # either model runner, v1 or v2
    ("vllm.v1.worker.gpu_worker", "Worker", "sample_tokens", "forward"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler", "OffloadingConnectorScheduler",
     "get_num_new_matched_tokens", "lookup"),
    ("vllm.v1.kv_offload.tiering.fs.manager", "FileSystemTierManager", "submit_load", "read_submit"),
    ("vllm.v1.kv_offload.tiering.fs.manager", "FileSystemTierManager", "get_finished_jobs", "read_done"),
    ("tiercache.integrations.vllm", "TierCacheTier", "submit_load", "read_submit"),
    ("tiercache.integrations.vllm", "TierCacheTier", "get_finished_jobs", "read_done"),
    ("vllm.v1.kv_offload.cpu.gpu_worker", "CPUOffloadingWorker", "submit_load", "upload_submit"),
    ("vllm.v1.kv_offload.cpu.gpu_worker", "CPUOffloadingWorker", "get_finished", "upload_done"),
    ("tiercache.integrations.vllmconnector", "ConnectorScheduler", "get_num_new_matched_tokens", "lookup"),
    ("tiercache.integrations.vllmconnector", "ConnectorWorker", "_load", "load"),
    ("tiercache.integrations.vllmconnector", "ConnectorWorker", "after_forward", "store_gather"),
    ("tiercache.integrations.vllmconnector", "ConnectorWorker", "get_finished", "blocks_freed"),
    ("tiercache.integrations.vllmconnector", "ConnectorWorker", "_release", "blocks_freed"),
    ("tiercache.integrations.vllmconnector", "ConnectorWorker", "_finish_write", "store_write"),
)


class StageTrace:
    """Timestamps of the engine's stages (see the module's doc). :meth:`install` wraps the
    :data:`TARGETS` that import; :attr:`installed` names them; :attr:`events` holds
    ``(stage, start_s, end_s, info)``, appended under a lock (the tiers' threads call some)."""

    def __init__(self, targets=TARGETS) -> None:
        self.targets = targets
        self.events: list[tuple[str, float, float, dict]] = []
        self.installed: list[str] = []
        self._lock = threading.Lock()
        self._load_jobs: set = set()
        self._tier_loads: set = set()

    def install(self) -> StageTrace:
        for module, cls_name, method, stage in self.targets:
            try:
                cls = getattr(importlib.import_module(module), cls_name)
                real = getattr(cls, method)
            except (ImportError, AttributeError):
                continue
            setattr(cls, method, self._wrap(real, stage))
            self.installed.append(f"{cls_name}.{method}")
        return self

    def _record(self, stage: str, t0: float, t1: float, info: dict) -> None:
        with self._lock:
            self.events.append((stage, t0, t1, info))

    def _wrap(self, real: Callable, stage: str) -> Callable:
        trace = self

        def wrapped(obj, *args, **kwargs):
            t0 = time.perf_counter()
            out = real(obj, *args, **kwargs)
            if stage in ("read_done", "upload_done"):
                out = list(out)  # a generator, on some releases: drained once, here
            info = trace._info(stage, args, kwargs, out)
            if info is not None:
                trace._record(stage, t0, time.perf_counter(), info)
            return out

        wrapped.__wrapped__ = real
        return wrapped

    def _info(self, stage: str, args, kwargs, out) -> dict | None:
        """What an event records (None: nothing worth an event, such as a poll that found
        nothing finished)."""
        if stage == "step":
            return {"tokens": int(getattr(out, "total_num_scheduled_tokens", 0) or 0)}
        if stage == "lookup":
            return {"result": repr(out)[:40]}
        if stage == "load":
            return {"keys": len(getattr(args[0], "keys", ()) or ())}
        if stage == "read_submit":
            job = args[0] if args else kwargs.get("job_metadata")
            with self._lock:
                self._tier_loads.add(getattr(job, "job_id", None))
            return {"keys": len(getattr(job, "keys", ()) or ())}
        if stage == "read_done":
            with self._lock:
                done = [r for r in out if getattr(r, "job_id", None) in self._tier_loads]
            return {"jobs": len(done)} if done else None
        if stage == "upload_submit":
            job_id = args[0] if args else kwargs.get("job_id")
            with self._lock:
                self._load_jobs.add(job_id)
            return {"job": job_id}
        if stage == "blocks_freed":  # an event only where blocks were freed
            if isinstance(out, tuple):  # get_finished: (sending, recving)
                return {"requests": len(out[0])} if out[0] else None
            return {"requests": len(args[0])} if args and args[0] else None  # _release: the requests

        if stage == "upload_done":
            with self._lock:
                done = [r for r in out if getattr(r, "job_id", None) in self._load_jobs]
            return {"jobs": len(done)} if done else None
        return {}

    def mark(self) -> int:
        """The number of events so far (where the next request's begin)."""
        with self._lock:
            return len(self.events)

    def since(self, mark: int) -> list[tuple[str, float, float, dict]]:
        with self._lock:
            return list(self.events[mark:])


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


#: the most events a request's ``timeline`` keeps (more: none; vLLM's fs tier polls for many steps)
TIMELINE_EVENTS = 48


def breakdown(events: list[tuple[str, float, float, dict]], submitted: float, first_token: float) -> dict:
    """Split ``[submitted, first_token]`` (perf_counter seconds) into the stages of the module's
    doc, from the ``events`` recorded meanwhile. Returns milliseconds (None: no such stage)."""
    ev = [e for e in events if submitted <= e[1] <= first_token]

    def times(stage: str, which: int) -> list[float]:
        return [e[which] for e in ev if e[0] == stage]

    reads_in, reads_out = times("read_submit", 1), times("read_done", 2)
    ups_in, ups_out = times("upload_submit", 1), times("upload_done", 2)
    forwards = [e for e in ev if e[0] == "forward"]
    steps = [e for e in ev if e[0] == "step"]
    prefill: list = []  # the forward work of the step with the most tokens (until the next step)
    if steps and forwards:
        biggest = max(steps, key=lambda e: e[3].get("tokens", 0))
        later = [e[1] for e in steps if e[1] > biggest[1]]
        end = min(later) if later else first_token
        prefill = [f for f in forwards if biggest[2] <= f[1] <= end]
    elif forwards:
        prefill = forwards[-1:]
    first_read, last_read = (min(reads_in), max(reads_out)) if reads_in and reads_out else (None, None)
    first_up, last_up = (min(ups_in), max(ups_out)) if ups_in and ups_out else (None, None)
    return {
        "ttft_ms": _ms(first_token - submitted),
        "lookup_ms": _ms(sum(e[2] - e[1] for e in ev if e[0] == "lookup")),
        "lookups": sum(1 for e in ev if e[0] == "lookup"),
        "before_read_ms": _ms(first_read - submitted) if first_read is not None else None,
        "read_ms": _ms(last_read - first_read) if first_read is not None else None,
        "read_chunks": sum(e[3].get("keys", 0) for e in ev if e[0] == "read_submit"),
        "read_to_upload_ms": _ms(first_up - last_read) if first_up is not None and last_read is not None else None,
        "upload_ms": _ms(last_up - first_up) if first_up is not None else None,
        "after_upload_ms": _ms(first_token - last_up) if last_up is not None else None,
        "prefill_ms": _ms(sum(f[2] - f[1] for f in prefill)) if prefill else None,
        "load_ms": _ms(sum(e[2] - e[1] for e in ev if e[0] == "load")) if times("load", 1) else None,
        "after_load_ms": _ms(first_token - max(times("load", 2))) if times("load", 2) else None,
        "steps": len(steps),
        "step_tokens": [e[3].get("tokens", 0) for e in steps],
        "idle_forward_ms": _ms(sum(f[2] - f[1] for f in forwards if not any(f is p for p in prefill))),
        "store_gather_ms": _ms(sum(e[2] - e[1] for e in ev if e[0] == "store_gather")) if times("store_gather", 1)
        else None,
        "blocks_freed_ms": _ms(max(times("blocks_freed", 2)) - submitted) if times("blocks_freed", 2) else None,
        "store_writes": sum(1 for e in ev if e[0] == "store_write"),
        # the events themselves, where few (a repeat from the connector: about 20): [stage,
        # start, end (ms from submission), tokens or keys], to see where a step's time went
        "timeline": [[e[0], _ms(e[1] - submitted), _ms(e[2] - submitted),
                      e[3].get("tokens", e[3].get("keys"))] for e in ev] if len(ev) <= TIMELINE_EVENTS else None,
    }


__all__ = ["StageTrace", "TARGETS", "breakdown"]
