"""TokenAppend (kernels/kv_append.cu): a decode step's new tokens into a tail block and a ring
buffer, with the tail's earlier tokens, in one launch. The bytes must equal PyTorch's three
copies for strided new tokens (as attention projections hand them over), every split of old
and new tokens, aligned (16-byte) and unaligned rows, tails in VRAM (the ring's allocation)
and in pinned host memory (their own); nothing outside the written tokens changes."""

from __future__ import annotations

import numpy as np
import pytest

from tiercache.errors import ConfigError


def _setup(torch, rng, B, H, D, tpb, nb, R, L, dtype, tails):
    """The ring (and, for ``tails="device"``, the tails after it) in one VRAM tensor ``kv``;
    host tails in their own pinned allocation, viewed as a CPU tensor."""
    k = B * H
    rows = R * k * nb
    extra = L * k if tails == "device" else 0
    kv = torch.from_numpy(rng.integers(-1000, 1000, size=(2, rows + extra, tpb, D)).astype(np.float32)).to(
        dtype=dtype, device="cuda")
    if tails == "device":
        return kv, kv[:, rows:].view(2, L, B, H, tpb, D), None
    from tiercache.memory import alloc_host

    fill = torch.from_numpy(rng.integers(-1000, 1000, size=(2, L, B, H, tpb, D)).astype(np.float32)).to(dtype)
    arr, owner = alloc_host(fill.numel() * fill.element_size(), pinned=True)
    tail = torch.from_numpy(arr).view(dtype).view(fill.shape)
    tail.copy_(fill)
    return kv, tail, owner


def _bits(t, torch):
    return t.view(torch.uint8 if t.element_size() == 1 else torch.int16)


@pytest.mark.gpu
@pytest.mark.parametrize("tails", ["device", "host"])
@pytest.mark.parametrize("D,dtype", [(64, "bfloat16"), (3, "float16")])  # 16-byte rows, then 6-byte rows
def test_append_matches_three_copies(rng, D, dtype, tails):
    torch = pytest.importorskip("torch")
    from tiercache.copypaths import TokenAppend
    from tiercache.memory import as_cupy_stream

    dt = getattr(torch, dtype)
    B, H, tpb, nb, R, L = int(rng.integers(1, 3)), int(rng.integers(1, 5)), 16, 3, 2, 3
    k, cap = B * H, nb * tpb
    kv, tail, _owner = _setup(torch, rng, B, H, D, tpb, nb, R, L, dt, tails)
    isz = kv.element_size()
    row = D * isz
    rows = R * k * nb
    if tails == "device":
        ap = TokenAppend(kv.data_ptr(), kv.stride(0) * isz, H, k, row, cap * row, tpb * row)
        tail_base = rows * tpb * row  # the tails follow the ring in each pool
    else:
        ap = TokenAppend(kv.data_ptr(), kv.stride(0) * isz, H, k, row, cap * row, tpb * row, tails=tail.data_ptr(),
                         tail_pool_stride=tail.stride(0) * isz)
        tail_base = 0
    stream = as_cupy_stream(torch.cuda.current_stream())
    for _ in range(12):
        layer, slot = int(rng.integers(L)), int(rng.integers(R))
        q = int(rng.integers(0, 4))  # 0: the tail's tokens only (a prefill's partial block)
        nfull = int(rng.integers(0, nb))
        base = nfull * tpb
        split = int(rng.integers(0 if q else 1, tpb - q + 1))
        s, end = base + split, base + split + q
        # new tokens as a projection hands them over: [B, q, H, D] transposed to [B, H, q, D]
        new_k = torch.randn(B, max(q, 1), H, D, device="cuda").to(dt).transpose(1, 2)
        new_v = torch.randn(B, max(q, 1), H, D, device="cuda").to(dt).transpose(1, 2)
        want_ring = kv[:, :rows].clone().view(2, R, B, H, cap, D)
        want_tail = tail.clone()
        wr, wt = want_ring[:, slot], want_tail[:, layer]
        wt[0].narrow(2, split, q).copy_(new_k[:, :, :q])
        wt[1].narrow(2, split, q).copy_(new_v[:, :, :q])
        wr.narrow(3, base, end - base).copy_(wt.narrow(3, 0, end - base))
        ks, vs = new_k.stride(), new_v.stride()
        ap(stream, new_k.data_ptr(), tuple(x * isz for x in ks[:3]), new_v.data_ptr(), tuple(x * isz for x in vs[:3]),
           tail_base + layer * k * tpb * row, slot * k * cap * row, base, s - base, end - base)
        torch.cuda.synchronize()
        where = (tails, layer, slot, q, base, split)
        assert torch.equal(_bits(kv[:, :rows], torch), _bits(want_ring.view(2, rows, tpb, D), torch)), where
        assert torch.equal(_bits(tail, torch), _bits(want_tail, torch)), where


def test_bad_geometry_is_refused():
    from tiercache.copypaths import TokenAppend

    with pytest.raises(ConfigError, match="heads = 0"):
        TokenAppend(0, 0, 0, 1, 2, 2, 2)
    with pytest.raises(ConfigError, match="multiple of heads"):
        TokenAppend(0, 0, 3, 4, 2, 2, 2)
