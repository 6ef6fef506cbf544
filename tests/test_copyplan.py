"""Copy planning: runs against a per-block reference."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tiercache.copyplan import contiguous_runs


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=60))
def test_runs_cover_pairs_exactly(pairs):
    src = [a for a, _ in pairs]
    dst = [b for _, b in pairs]
    runs = contiguous_runs(src, dst)
    expanded = [(a + i, b + i) for a, b, n in zip(runs.src, runs.dst, runs.length) for i in range(n)]
    assert expanded == list(zip(src, dst))
    # maximal: two adjacent runs never continue each other
    for i in range(len(runs.src) - 1):
        end_s = runs.src[i] + runs.length[i]
        end_d = runs.dst[i] + runs.length[i]
        assert not (end_s == runs.src[i + 1] and end_d == runs.dst[i + 1])


def test_consecutive_batch_is_one_run():
    runs = contiguous_runs(np.arange(10, 500), np.arange(1000, 1490))
    assert runs.length.tolist() == [490]
