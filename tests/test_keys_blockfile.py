"""Keys, file names and the block-file header format."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache import CorruptBlockError, InvalidKeyError, PoolSpec
from tiercache.files.blockfile import (
    DATA_OFFSET,
    block_filename,
    check_header,
    checksum,
    decode_header,
    encode_header,
    file_size,
    parse_filename,
)
from tiercache.keys import normalize_key, normalize_keys

keys = st.one_of(st.integers(0, 2**63 - 1), st.binary(min_size=1, max_size=64))
pool_names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,20}", fullmatch=True)


@given(keys, pool_names)
def test_filename_round_trip(key, pool):
    name = block_filename(key, pool)
    assert parse_filename(name) == (key, pool)
    assert name.startswith("block_") and name.endswith(".bin")


@given(keys, st.integers(0, 2**64 - 1))
def test_header_round_trip(key, value):
    pool = PoolSpec("p", (3, 5), "bfloat16")
    head = encode_header(key, pool, value)
    assert len(head) == DATA_OFFSET
    h = decode_header(head)
    assert (h.key, h.pool, h.dtype, h.block_shape, h.nbytes, h.checksum) == (key, "p", "bfloat16", (3, 5), 30, value)
    check_header(h, key, pool, "x")


def test_header_corruption_detected(rng):
    pool = PoolSpec("p", (16,), "float32")
    head = bytearray(encode_header(7, pool, 123))
    for pos in (0, 9, 20, 30, 40):  # magic, version, hash, metadata
        bad = bytearray(head)
        bad[pos] ^= 0xFF
        with pytest.raises(CorruptBlockError):
            decode_header(bytes(bad))
    with pytest.raises(CorruptBlockError, match="truncated"):
        decode_header(bytes(head[:10]))
    h = decode_header(bytes(head))
    with pytest.raises(CorruptBlockError, match="wrong geometry: block_shape"):
        check_header(h, 7, PoolSpec("p", (8, 2), "float32"), "f")
    with pytest.raises(CorruptBlockError, match="key 7"):
        check_header(h, 8, pool, "f")


def test_file_size_aligned():
    assert file_size(1) == 8192 and file_size(4096) == 8192 and file_size(4097) == 12288


def test_checksum_sees_one_bit(rng):
    data = rng.integers(0, 256, 10000, dtype=np.uint8)
    c = checksum(data)
    data[int(rng.integers(0, 10000))] ^= 1 << int(rng.integers(0, 8))
    assert checksum(data) != c


@pytest.mark.parametrize("bad", [-1, 2**63, True, 1.5, "7", b"", b"x" * 65, None])
def test_invalid_keys(bad):
    with pytest.raises(InvalidKeyError):
        normalize_key(bad)


def test_keys_normalized_and_duplicates_rejected():
    assert normalize_keys(np.array([3, 4], dtype=np.int32)) == [3, 4]
    assert normalize_keys(5) == [5] and normalize_keys(b"ab") == [b"ab"]
    with pytest.raises(InvalidKeyError, match="appears twice"):
        normalize_keys([1, 2, 1])


@settings(max_examples=200)
@given(key=st.one_of(st.integers(0, 2**63 - 1), st.binary(min_size=1, max_size=64)),
       checksum_value=st.integers(0, 2**64 - 1), extra=st.sampled_from([None, {"positions": 5}]),
       flip=st.one_of(st.none(), st.integers(0, 400)), dtype=st.sampled_from(["float16", "bfloat16", "uint8"]))
def test_header_checksum_agrees_with_the_full_decode(key, checksum_value, extra, flip, dtype):
    """The fast header check returns exactly what decode_header + check_header give, and
    refuses (CorruptBlockError) every header they refuse: a flipped byte anywhere in the header
    or its metadata, another key, another pool geometry."""
    from tiercache.files.blockfile import header_checksum

    pool = PoolSpec.kv("kv", num_layers=2, kv_factor=2, num_kv_heads=2, tokens_per_block=8, head_dim=16, dtype=dtype)
    head = bytearray(encode_header(key, pool, checksum_value, extra))
    if flip is not None:
        head[flip] ^= 0x41
    try:
        want = decode_header(bytes(head), "f")
        check_header(want, key, pool, "f")
    except CorruptBlockError:
        with pytest.raises(CorruptBlockError):
            header_checksum(head, key, pool, "f")
    else:
        assert header_checksum(head, key, pool, "f") == want.checksum
    other = PoolSpec("kv", (pool.block_nbytes,), "uint8")
    with pytest.raises(CorruptBlockError):
        header_checksum(bytes(encode_header(key, pool, checksum_value, extra)), key, other, "f")
    wrong_key = (key + 1) if isinstance(key, int) and key < 2**63 - 1 else b"other-key"
    with pytest.raises(CorruptBlockError):
        header_checksum(bytes(encode_header(key, pool, checksum_value, extra)), wrong_key, pool, "f")
