"""tiercache.sm_carveout against a stand-in for PyTorch's carve-out hooks (CPU)."""

import sys
import types

import pytest

from tiercache import ConfigError, TierUnavailableError, sm_carveout


def fake_torch(with_carveout=True):
    state = {"carveout": 3, "blas": "cublas", "calls": []}

    def set_carve(v):
        state["calls"].append(("carveout", v))
        state["carveout"] = v

    def blas(backend=None):
        if backend is not None:
            state["calls"].append(("blas", backend))
            state["blas"] = backend
        return state["blas"]

    c = types.SimpleNamespace()
    if with_carveout:
        c._set_sm_carveout_experimental = set_carve
        c._get_sm_carveout_experimental = lambda: state["carveout"]
    torch = types.SimpleNamespace(_C=c, __version__="9.9-test",
                                  backends=types.SimpleNamespace(cuda=types.SimpleNamespace(preferred_blas_library=blas)))
    return torch, state


def test_sets_and_restores(monkeypatch):
    torch, state = fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    with sm_carveout(8):
        assert state["carveout"] == 8 and state["blas"] == "cublaslt"
    assert state["carveout"] == 3 and state["blas"] == "cublas"


def test_restores_after_an_error(monkeypatch):
    torch, state = fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    with pytest.raises(KeyError):
        with sm_carveout(4):
            raise KeyError("inside")
    assert state["carveout"] == 3 and state["blas"] == "cublas"


def test_zero_means_no_carveout(monkeypatch):
    torch, state = fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    with sm_carveout(0):
        assert state["carveout"] is None


@pytest.mark.parametrize("bad", [-1, 1025, 2.0, True, "8"])
def test_bad_counts(bad):
    with pytest.raises(ConfigError, match=r"must be an integer in 0\.\.1024") as ei:
        with sm_carveout(bad):
            pass
    assert repr(bad) in str(ei.value)


def test_torch_without_carveout(monkeypatch):
    torch, state = fake_torch(with_carveout=False)
    monkeypatch.setitem(sys.modules, "torch", torch)
    with pytest.raises(TierUnavailableError, match="9.9-test has no SM carve-out"):
        with sm_carveout(8):
            pass
    assert state["calls"] == []
