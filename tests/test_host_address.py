"""tiercache.arrays.host_address: the address the native batches are given for each host
buffer, through the buffer protocol where it can, must be the array's own first byte for every
kind of buffer the file tier takes (writable or read-only, sliced, empty, memoryview); and
tiercache.arrays.prefault maps a buffer by touching one byte a page and nothing else."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tiercache.arrays import aligned_empty, host_address


def _reference(arr) -> int:
    return np.asarray(arr).__array_interface__["data"][0]


@given(rows=st.integers(1, 8), cols=st.integers(1, 4096), row=st.integers(0, 7), writable=st.booleans(),
       as_memoryview=st.booleans())
def test_the_address_is_the_first_byte_of_the_buffer(rows, cols, row, writable, as_memoryview):
    base = np.arange(rows * cols, dtype=np.uint8).reshape(rows, cols)
    view = base[row % rows]
    if not writable:
        view = view.copy()
        view.flags.writeable = False
    buf = memoryview(view) if as_memoryview else view
    assert host_address(buf) == _reference(view)
    assert host_address(base) == _reference(base)


def test_empty_read_only_and_aligned_arrays_fall_back_or_agree():
    empty = np.empty(0, np.uint8)
    assert host_address(empty) == _reference(empty)
    ro = np.frombuffer(b"x" * 4096, np.uint8)  # read-only: the array interface answers
    assert host_address(ro) == _reference(ro)
    rows = aligned_empty(4 * 8192).reshape(4, 8192)
    assert [host_address(r) for r in rows] == [_reference(rows) + 8192 * i for i in range(4)]
    assert host_address(rows) % 4096 == 0
    ints = np.zeros((3, 5), np.int64)[1]  # not uint8: still its first byte
    assert host_address(ints) == _reference(ints)


def test_prefault_touches_one_byte_a_page_and_keeps_the_rest():
    """prefault writes a zero at every page's first byte (2-D and 1-D, any length) and leaves
    every other byte as it was; it returns the same array."""
    from tiercache.arrays import prefault

    rng = np.random.default_rng()
    for shape in [(3, 8192), (5 * 4096 + 7,), (1, 100)]:
        arr = aligned_empty(int(np.prod(shape))).reshape(shape)
        arr[...] = rng.integers(1, 256, shape, dtype=np.uint8)
        before = arr.copy().reshape(-1)
        assert prefault(arr) is arr
        flat = arr.reshape(-1)
        touched = np.zeros(flat.size, bool)
        touched[::4096] = True
        assert not flat[touched].any() and np.array_equal(flat[~touched], before[~touched])
