"""KV-cache tensors in the layouts engines use, filled with random bytes, for the engine-pool
tests (NumPy on the CPU, CuPy or PyTorch on a GPU)."""

from __future__ import annotations

import math

import numpy as np

from tiercache.enginetensors import DevicePools

LAYOUTS = ("vllm", "trtllm", "fastdeploy", "mla")


def _shapes(layout: str, nb: int, L: int, bs: int, h: int, d: int) -> list[tuple]:
    if layout == "vllm":
        return [(nb, 2, bs, h, d)] * L
    if layout == "trtllm":
        return [(nb, L, 2, h, bs, d)]
    if layout == "fastdeploy":
        return [(nb, h, bs, d)] * (2 * L)
    if layout == "mla":
        return [(nb, bs, d)] * L
    raise ValueError(layout)


def _random(rng, shape, backend: str, dtype: str = "float16"):
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    raw = rng.integers(1, 256, size=nbytes, dtype=np.uint8)
    if backend == "numpy":
        return raw.view(dtype).reshape(shape)
    if backend == "cupy":
        import cupy

        return cupy.asarray(raw).view(dtype).reshape(shape)
    import torch

    t = torch.from_numpy(raw).cuda().view(getattr(torch, dtype))
    return t.reshape(shape)


def make_pools(layout: str, rng, backend: str = "numpy", nb: int = 24, L: int = 3, bs: int = 8, h: int = 2,
               d: int = 16) -> DevicePools:
    """Random engine tensors of ``layout`` registered as :class:`DevicePools`."""
    ts = [_random(rng, s, backend) for s in _shapes(layout, nb, L, bs, h, d)]
    kw = {"host_ok": True} if backend == "numpy" else {}
    if layout == "vllm":
        return DevicePools.vllm(ts, **kw)
    if layout == "trtllm":
        return DevicePools.trtllm(ts[0], **kw)
    if layout == "fastdeploy":
        return DevicePools.fastdeploy(ts[:L], ts[L:], **kw)
    return DevicePools.mla(ts, **kw)


def raw_host(pools: DevicePools, name: str) -> np.ndarray:
    """A host copy of pool ``name``'s bytes, ``uint8 [num_blocks, block_nbytes]``."""
    r = pools.raw(name)
    return r.copy() if isinstance(r, np.ndarray) else r.get()


def snapshot(pools: DevicePools) -> dict[str, np.ndarray]:
    return {s.name: raw_host(pools, s.name) for s in pools.specs}


def scramble(pools: DevicePools, rng) -> None:
    """Overwrite every block of every pool with new random bytes."""
    for s in pools.specs:
        r = pools.raw(s.name)
        new = rng.integers(1, 256, size=r.shape, dtype=np.uint8)
        if isinstance(r, np.ndarray):
            r[...] = new
        else:
            import cupy

            r[...] = cupy.asarray(new)


def expected_partial(before: np.ndarray, src_block: np.ndarray, spec, num_tokens: int) -> np.ndarray:
    """``before`` (one block, raw bytes) with its first ``num_tokens`` tokens from ``src_block``."""
    ta = spec.token_axis
    outer = math.prod(spec.block_shape[:ta])
    tpb = spec.block_shape[ta]
    inner = math.prod(spec.block_shape[ta + 1:]) * spec.itemsize
    out = before.copy().reshape(outer, tpb, inner)
    out[:, :num_tokens] = src_block.reshape(outer, tpb, inner)[:, :num_tokens]
    return out.reshape(-1)
