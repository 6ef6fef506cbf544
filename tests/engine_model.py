"""A randomized workload for the transfer engine, checked against a NumPy mirror of every tier.

Every operation is applied to the engine (asynchronously, nothing waited) and to the mirror
(immediately, in submission order). Since the engine orders conflicting copies per slot, the
tiers must equal the mirror whenever they are read back through the engine.
"""

from __future__ import annotations

import numpy as np

from tiercache.copypaths import segments_for


class Mirror:
    """Expected bytes of every slot of every tier, per pool (``uint8 [slots, block_nbytes]``)."""

    def __init__(self, engine, rng: np.random.Generator) -> None:
        self.engine = engine
        self.rng = rng
        self.pools = list(engine.pools.values())
        self.tiers = {}
        for name, t in engine.tiers.items():
            self.tiers[name] = {p.name: rng.integers(0, 256, size=(t.num_slots, p.block_nbytes), dtype=np.uint8)
                                for p in self.pools}
        self.ops = 0

    def upload_all(self) -> None:
        """Write the mirror's initial random bytes into every tier through the engine."""
        for name, t in self.engine.tiers.items():
            slots = np.arange(t.num_slots)
            keys = [int(s) for s in slots] if name == "file" else None
            self.engine.copy("caller", slots, name, slots, keys=keys, src_arrays=self.tiers[name]).wait()

    def _apply(self, src, s, dst, d, num_tokens) -> None:
        for p in self.pools:
            seg = segments_for(p, num_tokens)
            sv = self.tiers[src][p.name].reshape(-1, seg.segs, seg.seg_stride)
            dv = self.tiers[dst][p.name].reshape(-1, seg.segs, seg.seg_stride)
            dv[d, :, : seg.seg_bytes] = sv[s, :, : seg.seg_bytes]

    def random_op(self) -> None:
        names = list(self.engine.tiers)
        src, dst = self.rng.choice(names), self.rng.choice(names)
        ns, nd = self.engine.tiers[src].num_slots, self.engine.tiers[dst].num_slots
        n = int(self.rng.integers(1, min(ns, nd, 12) + 1))
        s = self.rng.choice(ns, size=n, replace=True)
        if src == dst:  # a slot must not be both read and written in one batch
            d = self.rng.choice(np.setdiff1d(np.arange(nd), s), size=min(n, nd - np.unique(s).size), replace=False)
            s = s[: d.size]
            if d.size == 0:
                return
        else:
            d = self.rng.choice(nd, size=n, replace=False)
        num_tokens = None
        kv = all(p.token_axis is not None for p in self.pools)
        if "file" not in (src, dst) and kv and self.rng.random() < 0.4:
            tpb = self.pools[0].tokens_per_block
            num_tokens = int(self.rng.integers(0, tpb + 2))
        if self.rng.random() < 0.1:  # new data from the caller (a put)
            data = {
                p.name: self.rng.integers(0, 256, size=(d.size, p.block_nbytes), dtype=np.uint8) for p in self.pools
            }
            keys = [int(x) for x in d] if dst == "file" else None
            self.engine.copy("caller", np.arange(d.size), dst, d, keys=keys, src_arrays=data)
            for p in self.pools:
                self.tiers[dst][p.name][d] = data[p.name]
        else:
            keys = [int(x) for x in (s if src == "file" else d)] if "file" in (src, dst) else None
            if src == "file" and dst == "file":
                return
            self.engine.copy(src, s, dst, d, keys=keys, num_tokens=num_tokens)
            self._apply(src, s, dst, d, num_tokens)
        self.ops += 1

    def check(self) -> int:
        """Read every tier back through the engine; returns the number of mismatched blocks."""
        bad = 0
        for name, t in self.engine.tiers.items():
            slots = np.arange(t.num_slots)
            out = {p.name: np.empty((t.num_slots, p.block_nbytes), np.uint8) for p in self.pools}
            keys = [int(x) for x in slots] if name == "file" else None
            self.engine.copy(name, slots, "caller", slots, keys=keys, dst_arrays=out).wait()
            for p in self.pools:
                bad += int((out[p.name] != self.tiers[name][p.name]).any(axis=1).sum())
        return bad
