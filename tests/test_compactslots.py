"""CompactSlots (the file tier's slots in arrays) against TierSlots (dicts), operation by
operation on random keys: the same membership, slots held, least recently used order and
free counts, through merges of the sorted array and compactions of the key arena."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_keys

from tiercache.errors import SlotRangeError, TierFullError
from tiercache.files.blockfile import block_subdir_index
from tiercache.keys import key_hash
from tiercache.placement import CompactSlots, TierSlots, compactslots


def _pick(rng, pool, m):
    return [pool[i] for i in rng.choice(len(pool), size=min(m, len(pool)), replace=False)]


@pytest.mark.parametrize("num_slots", [1, 7, 300, 5000])
@pytest.mark.parametrize("kind", ["mixed", "bytes", "int"])  # keys of one kind: added as arrays
def test_compact_slots_behave_as_tier_slots(rng, monkeypatch, num_slots, kind):
    monkeypatch.setattr(compactslots, "ARENA_SLACK", 256)  # compact the key arena often
    monkeypatch.setattr(compactslots, "MERGE_MIN", 64)  # merge the recent keys often
    a, b = CompactSlots("file", num_slots, group=block_subdir_index), TierSlots("file", num_slots)
    extra = ([b"\x00", b"\x00" * 64] if kind != "int" else []) + ([0, 2**63 - 1] if kind != "bytes" else [])
    pool = random_keys(rng, 2 * num_slots + 3, kind) + extra
    for step in range(400):
        op = rng.random()
        if op < 0.4:
            new = [k for k in _pick(rng, pool, int(rng.integers(1, 60))) if k not in b][: b.free_count]
            freed, fresh = list(a._freed), a._next  # slots reused most recently freed first, then new ones
            want = (freed[::-1] + list(range(fresh, fresh + len(new))))[:len(new)]
            clock = a._clock
            slots = a.add(new)
            b.add(new)
            assert slots == want, step
            assert [a.slot_of[k] for k in new] == slots and all(a.key_at[s] == k for k, s in zip(new, slots))
            assert [a.tick_of(s) for s in slots] == list(range(clock, clock + len(new)))
            for k, s in zip(new, slots):
                assert a._hash[s] == key_hash(k) and a._group[s] == block_subdir_index(k)
        elif op < 0.6:
            gone = _pick(rng, pool, int(rng.integers(1, 60)))
            a.remove(gone)
            b.remove(gone)
        elif op < 0.8:
            used = _pick(rng, pool, int(rng.integers(1, 60)))
            a.touch(used)
            b.touch(used)
        else:
            m = int(rng.integers(0, len(b) + 1))
            assert [k for _, k in zip(range(m), a.lru)] == [k for _, k in zip(range(m), b.lru)], step
        assert len(a) == len(b) and a.free_count == b.free_count
        for k in _pick(rng, pool, 20):
            assert (k in a) == (k in b) and (a.slot_of.get(k, -1) >= 0) == (k in b)
        # batched lookups: mixed keys, int keys alone (checked as arrays), and a removed key's
        # hash still in the sorted array until the next merge
        probe = _pick(rng, pool, 30)
        for batch in (probe, [k for k in probe if isinstance(k, int)]):
            assert a.find_many(batch).tolist() == [a.find(k) for k in batch], step
            assert (a.find_many(batch) >= 0).tolist() == (b.find_many(batch) >= 0).tolist()
            assert b.find_many(batch).tolist() == [b.slot_of.get(k, -1) for k in batch]
    assert list(a.lru) == list(b.lru)
    held = [a.slot_of[k] for k in b.slot_of]
    assert len(set(held)) == len(held) and all(0 <= s < num_slots for s in held)
    assert sorted(held) == a.used_slots().tolist()
    assert set(a.keys()) == set(b.slot_of)


def test_compact_slots_errors_name_the_slot_and_the_tier(rng):
    a = CompactSlots("file", 4)
    keys = random_keys(rng, 5, "mixed")
    a.claim(keys[:2], [3, 1])
    assert a.slot_of[keys[0]] == 3 and 1 in a.key_at and 0 not in a.key_at
    with pytest.raises(SlotRangeError, match="file slot 4 outside"):
        a.claim([keys[2]], [4])
    with pytest.raises(SlotRangeError, match="file slot 1 already holds"):
        a.claim([keys[2]], [1])
    assert sorted(a.add(keys[2:4])) == [0, 2]  # the slots skipped by claim are free
    with pytest.raises(TierFullError, match="1 slots wanted, 0 free"):
        a.add(keys[4:])
    with pytest.raises(KeyError):
        a.slot_of[keys[4]]


def test_lookups_from_another_thread_see_no_torn_state(rng):
    """``key in slots`` runs without a lock (vLLM's lookups); while one thread adds, removes
    and merges, a reader asking about keys that never leave gets True every time."""
    import threading

    a = CompactSlots("file", 20000)
    stay = random_keys(rng, 500, "bytes")
    a.add(stay)
    churn = random_keys(rng, 15000, "mixed")
    wrong, stop = [], threading.Event()

    def read():
        while not stop.is_set():
            wrong.extend(k for k in stay if k not in a)

    t = threading.Thread(target=read)
    t.start()
    for i in range(0, len(churn), 500):
        a.add(churn[i:i + 500])
        a.remove(churn[max(0, i - 1000):i - 500])
    stop.set()
    t.join()
    assert not wrong and np.all([k in a for k in stay])
