"""GPU clock and power samples through NVML (``nvidia-ml-py``, optional), for benchmarks that
need to tell a slowdown caused by sharing the GPU from one caused by the board's power limit."""

from __future__ import annotations

import statistics
import threading
import time

#: NVML clock-event reason bit: the software power cap is holding the clocks down
POWER_CAP_BIT = 0x4


class ClockSampler:
    """Samples (host seconds, SM MHz, board watts, clock-event reason bits) of GPU ``index``
    every ``period`` seconds on a daemon thread until :meth:`close`. ``available`` is False
    (and :meth:`window` returns ``{}``) when NVML cannot be loaded."""

    def __init__(self, index: int = 0, period: float = 0.002) -> None:
        self.samples: list = []
        self.period = period
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nv, self._h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # noqa: BLE001  no NVML: no samples
            self._nv = None
            return
        self._reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        threading.Thread(target=self._run, daemon=True).start()

    @property
    def available(self) -> bool:
        return self._nv is not None

    def _run(self) -> None:
        nv, h = self._nv, self._h
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                                 nv.nvmlDeviceGetPowerUsage(h) / 1e3, self._reasons(h)))
            self._stop.wait(self.period)

    def window(self, t0: float, t1: float) -> dict:
        """Means over the samples taken between host times ``t0`` and ``t1`` (``time.perf_counter``):
        ``sm_mhz``, ``watts``, ``power_capped`` (share of samples with the power cap active)."""
        w = [x for x in self.samples if t0 <= x[0] <= t1]
        if not w:
            return {}
        return {"sm_mhz": round(statistics.mean(x[1] for x in w)), "watts": round(statistics.mean(x[2] for x in w)),
                "power_capped": round(sum(1 for x in w if x[3] & POWER_CAP_BIT) / len(w), 2)}

    def close(self) -> None:
        self._stop.set()
