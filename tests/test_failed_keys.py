"""``TransferError.failed_keys`` names exactly the call's keys that were not stored.

When room cannot be made for a call's blocks (spilling the tier's least recently used blocks to
the tier below fails, e.g. the disk is full), the error is a :class:`SpillError` whose
``failed_keys`` are the call's keys, never the victims' (which stay where they were), and every
block keeps the bytes it had: replaced keys their earlier version, victims theirs.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_keys
from helpers import assert_bytes, put_random

from tiercache import SpillError, TierCache, TransferError


def _data(cache, n, rng):
    return {p.name: rng.integers(1, 256, size=(n, p.block_nbytes), dtype=np.uint8) for p in cache.config.pools}


def test_replacing_keys_onto_a_full_disk_names_those_keys(make_config, rng, io_engine, fail_writes):
    """The case that was reported: host tier of 8 full of unflushed keys, 20 keys stored earlier
    in files only, the disk full: replacing the 20 names the 20, and all 28 keep their bytes."""
    cfg = make_config(host_slots=8, io_engine=io_engine)
    with TierCache(cfg) as c:
        old = put_random(c, list(range(10, 30)), rng, tier="file")
        held = put_random(c, list(range(100, 108)), rng)
        fail_writes.arm(io_engine, range(100, 108))
        with pytest.raises(TransferError) as ei:
            c.put(list(range(10, 30)), _data(c, 20, rng))
        assert sorted(ei.value.failed_keys) == list(range(10, 30))
        assert "No space left" in str(ei.value)
        fail_writes.disarm()
        assert_bytes(c, {**old, **held})
        assert all(set(c.lookup(k)) == {"host"} for k in range(100, 108))


@pytest.mark.parametrize("n", [1, 3, 20])
def test_new_keys_that_find_no_room_are_the_failed_ones(make_config, rng, io_engine, fail_writes, n):
    """A put of n new keys (streamed through the host tier when n > 8) onto a full disk:
    failed_keys is every one of them that was not stored; the victims keep their bytes."""
    cfg = make_config(host_slots=8, io_engine=io_engine)
    with TierCache(cfg) as c:
        victims = random_keys(rng, 8, "int")
        held = put_random(c, victims, rng)
        fail_writes.arm(io_engine, victims)
        new = [k for k in random_keys(rng, 3 * n + 8, "int") if k not in held][:n]
        with pytest.raises(SpillError) if n <= 8 else pytest.raises(TransferError) as ei:
            c.put(new, _data(c, n, rng))
        stored = [k for k in new if k in c]
        assert sorted(ei.value.failed_keys, key=repr) == sorted(set(new) - set(stored), key=repr)
        assert not stored  # every piece needed a spill of the victims
        fail_writes.disarm()
        assert_bytes(c, held)


def test_a_spill_error_reports_the_victims_it_could_not_move(make_config, rng, io_engine, fail_writes):
    cfg = make_config(host_slots=2, io_engine=io_engine)
    with TierCache(cfg) as c:
        held = put_random(c, [1, 2], rng)
        fail_writes.arm(io_engine, [1, 2])
        with pytest.raises(SpillError) as ei:
            put_random(c, [3], rng)
        err = ei.value
        assert err.failed_keys == [3] and len(err.victims) == 1 and err.victims[0] in (1, 2)
        assert "1 block(s) not stored: 3: no room in the host tier" in str(err)
        fail_writes.disarm()
        assert_bytes(c, held)
        put_random(c, [3], rng)  # the cache keeps working
        assert 3 in c
