"""Pinned host memory on huge pages (``MAP_HUGETLB`` + ``cudaHostRegister``) under every copy
path, whole blocks and the first tokens of KV blocks, and a cache whose host tier lives there.

Needs reserved huge pages (``sysctl vm.nr_hugepages``; tools/lab/gpu-check.sh reserves them on the
GPU test machine): skips without them.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_keys
from helpers import assert_bytes, partial_round_trip

from tiercache import PoolSpec, TierCache
from tiercache.memory import alloc_host, free_huge_pages, huge_page_bytes

pytestmark = pytest.mark.gpu


def _huge(nbytes: int):
    page = huge_page_bytes()
    if page == 0 or free_huge_pages() * page < nbytes + page:
        pytest.skip(f"needs {nbytes} bytes of free huge pages; {free_huge_pages()} free")
    arr, owner = alloc_host(nbytes, pinned=True, huge_pages="on")
    assert owner.source == "hugetlb+cudaHostRegister" and owner.pinned and arr.ctypes.data % page == 0
    return arr, owner


@pytest.mark.parametrize("force", ["memcpy", "batch", "bulk", "kernel", "staged"])
def test_whole_blocks_every_path(rng, force):
    """Random scattered 16 KiB blocks host -> device -> host through one path: exact bytes."""
    import cupy

    from tiercache.copypaths import CopyLauncher, Segments
    from tiercache.memory import is_pinned

    row, n = 16 << 10, 96
    src, _o1 = _huge(n * row)
    back, _o2 = _huge(n * row)
    assert is_pinned(src) and is_pinned(back)
    src, back = src.reshape(n, row), back.reshape(n, row)
    src[:] = rng.integers(1, 256, size=src.shape, dtype=np.uint8)
    back[:] = 0
    la = CopyLauncher(0, max_sms=4)
    if force == "bulk" and not la.bulk_available or force == "batch" and not la.batch.available:
        pytest.skip(f"{force} copies need compute capability 9.0 / CUDA 12.8")
    dev = cupy.zeros((n, row), cupy.uint8)
    # host side in runs (the staged path copies runs), device side scattered
    h = (rng.permutation(n // 8)[:, None] * 8 + np.arange(8)).reshape(-1) if force in ("staged", "memcpy") \
        else rng.permutation(n)
    d, h2 = rng.permutation(n), rng.permutation(n)
    if force == "memcpy":
        d, h2 = h.copy(), h.copy()  # runs on both sides
    st = cupy.cuda.Stream(non_blocking=True)
    p1 = la.launch(src, h, dev, d, Segments(1, row, row), st, force=force)
    p2 = la.launch(dev, d, back, h2, Segments(1, row, row), st, force=force)
    st.synchronize()
    assert np.array_equal(back[h2], src[h])
    assert {p1, p2} == {force}


@pytest.mark.parametrize("num_tokens", [1, 5, 16])
def test_first_tokens_match_numpy(rng, num_tokens):
    """The first ``num_tokens`` of layer-major KV blocks host -> device and back through the
    launcher's own choice: those bytes copied, every other byte untouched."""

    from tiercache.copypaths import CopyLauncher, segments_for

    pool = PoolSpec.kv("kv", num_layers=4, kv_factor=2, num_kv_heads=4, tokens_per_block=16, head_dim=64,
                       dtype="bfloat16")
    row, n = pool.block_nbytes, 40
    seg = segments_for(pool, num_tokens)
    src, _o1 = _huge(n * row)
    back, _o2 = _huge(n * row)
    partial_round_trip(CopyLauncher(0, max_sms=4), seg, src.reshape(n, row), back.reshape(n, row), rng, 31)


def test_cache_host_tier_on_huge_pages(make_config, rng):
    """device -> host -> file -> host -> device with the host tier on huge pages: exact bytes."""
    import cupy

    cfg = make_config(device_slots=8, host_slots=8, file_slots=32, host_huge_pages="on")
    _huge(sum(p.block_nbytes for p in cfg.pools) * 8 + 2 * len(cfg.pools) * huge_page_bytes())
    with TierCache(cfg) as c:
        assert c.stats()["tiers"]["host"]["page_bytes"] == [huge_page_bytes()]
        keys = random_keys(rng, 8)
        data = {p.name: cupy.asarray(rng.integers(1, 256, size=(8, p.block_nbytes), dtype=np.uint8)) for p in cfg.pools}
        c.put(keys, data)
        exp = {k: {p: data[p][i].get() for p in data} for i, k in enumerate(keys)}
        c.offload(keys, to="host")
        c.offload(keys[:5], to="file")
        c.onboard(keys, to="device")
        assert_bytes(c, exp)
