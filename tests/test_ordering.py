"""The slot ledger (tiercache.transfer.ordering) against a plain model of it: random sequences
of recorded jobs (GPU and threaded readers, overlapping and repeated slots, several tiers), and
after each one every query the engine makes: the jobs to wait for, the readers a new reader
covers, the pending writers and all pending jobs of a set of slots."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.transfer.ordering import SlotLedger

CAP = {"device": 6, "host": 5}
slots = st.sampled_from(sorted(CAP)).flatmap(
    lambda t: st.tuples(st.just(t), st.lists(st.integers(0, CAP[t] - 1), max_size=6)))
step = st.tuples(slots, slots, st.booleans())


class Model:
    """What the ledger must answer, kept per slot in dicts."""

    def __init__(self) -> None:
        self.w = {t: {} for t in CAP}
        self.rg = {t: {} for t in CAP}
        self.rt = {t: {} for t in CAP}

    def record(self, jid, src, s, dst, d, gpu) -> None:
        for x in s:
            (self.rg if gpu else self.rt)[src][x] = jid
        for x in d:
            self.w[dst][x] = jid
            self.rg[dst].pop(x, None)
            self.rt[dst].pop(x, None)

    @staticmethod
    def ids(table, s) -> list[int]:
        return sorted({table[x] for x in s if x in table})

    def dependencies(self, src, s, dst, d):
        return self.ids(self.w[src], s), sorted(set(self.ids(self.w[dst], d)) | set(self.ids(self.rg[dst], d))
                                                | set(self.ids(self.rt[dst], d)))


@settings(max_examples=300, deadline=None)
@given(st.lists(step, min_size=1, max_size=25), st.lists(slots, min_size=1, max_size=4))
def test_the_ledger_answers_what_the_model_does(steps, queries):
    ledger, model = SlotLedger(CAP), Model()
    for jid, ((src, s), (dst, d), gpu) in enumerate(steps, start=1):
        sa, da = np.array(s, dtype=np.int64), np.array(d, dtype=np.int64)
        assert list(map(sorted, ledger.dependencies(src, sa, dst, da))) == list(model.dependencies(src, s, dst, d))
        ledger.record(SimpleNamespace(id=jid), src, sa, dst, da, gpu)
        model.record(jid, src, s, dst, d, gpu)
        for tier, q in queries:
            qa = np.array(q, dtype=np.int64)
            assert sorted(ledger.pending_writers(tier, qa)) == model.ids(model.w[tier], q)
            assert sorted(ledger.previous_readers(tier, qa, gpu=True)) == model.ids(model.rg[tier], q)
            assert sorted(ledger.previous_readers(tier, qa, gpu=False)) == model.ids(model.rt[tier], q)
            everything = set(model.ids(model.w[tier], q)) | set(model.ids(model.rg[tier], q)) \
                | set(model.ids(model.rt[tier], q))
            assert ledger.pending_all(tier, qa) == sorted(everything)
