"""TokenAppend (kernels/kv_append.cu): a decode step's new tokens into a tail block and a ring
buffer, with the tail's earlier tokens, in one launch. The bytes must equal PyTorch's three
copies for strided new tokens (as attention projections hand them over), every split of old
and new tokens, aligned (16-byte) and unaligned rows; nothing outside the written tokens
changes."""

from __future__ import annotations

import numpy as np
import pytest

from tiercache.errors import ConfigError


def _setup(torch, rng, B, H, D, tpb, nb, R, L, dtype):
    k = B * H
    rows = R * k * nb
    kv = torch.from_numpy(rng.integers(-1000, 1000, size=(2, rows + L * k, tpb, D)).astype(np.float32)).to(
        dtype=dtype, device="cuda")
    ring = kv[:, :rows].view(2, R, B, H, nb * tpb, D)
    tail = kv[:, rows:].view(2, L, B, H, tpb, D)
    return kv, ring, tail


@pytest.mark.gpu
@pytest.mark.parametrize("D,dtype", [(64, "bfloat16"), (3, "float16")])  # 16-byte rows, then 6-byte rows
def test_append_matches_three_copies(rng, D, dtype):
    torch = pytest.importorskip("torch")
    from tiercache.copypaths import TokenAppend
    from tiercache.memory import as_cupy_stream

    dt = getattr(torch, dtype)
    B, H, tpb, nb, R, L = int(rng.integers(1, 3)), int(rng.integers(1, 5)), 16, 3, 2, 3
    k, cap = B * H, nb * tpb
    kv, ring, tail = _setup(torch, rng, B, H, D, tpb, nb, R, L, dt)
    isz = kv.element_size()
    row = D * isz
    rows = R * k * nb
    ap = TokenAppend(kv.data_ptr(), kv.stride(0) * isz, H, k, row, cap * row, tpb * row)
    stream = as_cupy_stream(torch.cuda.current_stream())
    for _ in range(12):
        layer, slot = int(rng.integers(L)), int(rng.integers(R))
        q = int(rng.integers(1, 4))
        nfull = int(rng.integers(0, nb))
        base = nfull * tpb
        split = int(rng.integers(0, tpb - q + 1))
        s, end = base + split, base + split + q
        # new tokens as a projection hands them over: [B, q, H, D] transposed to [B, H, q, D]
        new_k = torch.randn(B, q, H, D, device="cuda").to(dt).transpose(1, 2)
        new_v = torch.randn(B, q, H, D, device="cuda").to(dt).transpose(1, 2)
        want = kv.clone()
        wr = want[:, :rows].view(2, R, B, H, cap, D)[:, slot]
        wt = want[:, rows:].view(2, L, B, H, tpb, D)[:, layer]
        wt[0].narrow(2, split, q).copy_(new_k)
        wt[1].narrow(2, split, q).copy_(new_v)
        wr.narrow(3, base, end - base).copy_(wt.narrow(3, 0, end - base))
        ks, vs = new_k.stride(), new_v.stride()
        ap(stream, new_k.data_ptr(), tuple(x * isz for x in ks[:3]), new_v.data_ptr(), tuple(x * isz for x in vs[:3]),
           (rows + layer * k) * tpb * row, slot * k * cap * row, base, s - base, end - base)
        torch.cuda.synchronize()
        assert torch.equal(kv.view(torch.uint8 if isz == 1 else torch.int16),
                           want.view(torch.uint8 if isz == 1 else torch.int16)), (layer, slot, q, base, split)


def test_bad_geometry_is_refused():
    from tiercache.copypaths import TokenAppend

    with pytest.raises(ConfigError, match="heads = 0"):
        TokenAppend(0, 0, 0, 1, 2, 2, 2)
    with pytest.raises(ConfigError, match="multiple of heads"):
        TokenAppend(0, 0, 3, 4, 2, 2, 2)
