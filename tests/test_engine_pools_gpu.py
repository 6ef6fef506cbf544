"""Engine tensors on the GPU: PyTorch's current stream is honoured by offload_slots and
onboard_slots (no race when the engine writes a block and offloads it at once, or reads a
block right after onboarding it), and layer-wise completions. Each race is shown to be real
by a control run that skips the synchronization and sees stale bytes."""

from __future__ import annotations

import numpy as np
import pytest

from tiercache import TierCache
from tiercache.enginetensors import DevicePools

pytestmark = pytest.mark.gpu

SPIN = 40_000_000  # GPU cycles (~20-30 ms) of torch.cuda._sleep: long enough for a race to show


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def _caches(torch, layers=2, nb=32):
    return [torch.zeros((nb, 2, 16, 4, 64), dtype=torch.bfloat16, device="cuda") for _ in range(layers)]


def _host_bytes(c, key, pool="layer.0"):
    slot = int(c.slots([key], tier="host")[0])
    return c.host_array(pool, typed=False)[slot].copy()


def _dev_bytes(t):
    return t.contiguous().view(-1).view(__import__("torch").uint8).cpu().numpy()


def test_offload_waits_for_torch_current_stream(torch, tmp_path):
    caches = _caches(torch)
    pools = DevicePools.vllm(caches)
    side = torch.cuda.Stream()
    stale = 0
    with TierCache.for_engine(pools, host_slots=16, root=tmp_path / "r", fsync="none") as c:
        with torch.cuda.stream(side):  # the engine computes on a stream of its own
            for trial in range(1, 4):
                torch.cuda._sleep(SPIN)
                for t in caches:
                    t[3].fill_(float(trial))
                c.offload_slots([trial], [3], wait=True)  # default stream: torch's current one (side)
                side.synchronize()
                assert np.array_equal(_host_bytes(c, trial), _dev_bytes(caches[0][3]))
            # control: the same offload ordered after an idle stream reads the block too early
            torch.cuda._sleep(SPIN)
            for t in caches:
                t[3].fill_(9.0)
            c.offload_slots([99], [3], stream=torch.cuda.Stream(), wait=True)
            side.synchronize()
            stale = not np.array_equal(_host_bytes(c, 99), _dev_bytes(caches[0][3]))
    assert stale, "the control race did not show: the test could not detect a missing stream wait"


def test_onboard_is_visible_to_torch_current_stream(torch, tmp_path):
    caches = _caches(torch)
    pools = DevicePools.vllm(caches)
    for t in caches:
        t[5].fill_(3.0)
    with TierCache.for_engine(pools, host_slots=16, root=tmp_path / "r", fsync="none") as c:
        c.offload_slots([1], [5], wait=True)
        c.engine.debug_delay_ns = 20_000_000  # each copy starts 20 ms late
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            c.onboard_slots([1], [7])  # side waits for it on the device
            seen = caches[0][7].float().sum()
            h = c.onboard_slots([1], [8], layerwise=True)  # control: no wait
            early = caches[0][8].float().sum()
            h.wait_layer(0)
            late0 = caches[0][8].float().sum()
            h.wait_layer(1)
            late1 = caches[1][8].float().sum()
        side.synchronize()
        c.engine.debug_delay_ns = 0
        full = float(caches[0][5].float().sum())
        assert float(seen) == full
        assert float(late0) == full and float(late1) == full
        assert float(early) != full, "the control race did not show"


def test_layer_events_complete_in_order(torch, tmp_path):
    caches = _caches(torch, layers=6, nb=64)
    pools = DevicePools.vllm(caches)
    with TierCache.for_engine(pools, host_slots=64, root=tmp_path / "r", fsync="none") as c:
        c.offload_slots(list(range(40)), list(range(40)), wait=True)
        h = c.onboard_slots(list(range(40)), list(range(24, 64)), layerwise=True)
        assert h.num_layers == 6
        h.synchronize_layer(2)
        assert all(h.layer_done(i) for i in range(3))
        h.synchronize()
        r = h.job.result()
        assert r.direction == "onboard" and r.nbytes == 40 * sum(s.block_nbytes for s in pools.specs)
        with pytest.raises(IndexError):
            h.wait_layer(6)
