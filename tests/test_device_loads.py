"""A row store's loads straight into device memory (``RowStore(..., device=0)`` and
``submit_load(..., device_rows=...)``): what the vLLM connector's loads take where GDS is
available (and with ``io_mode = "compat"``, kvikio's compatibility mode). On a GPU: random
blocks come back byte-exact into random device rows by every path (GDS where the machine has
it, kvikio compat, tiercache's POSIX reads through pinned staging); a flipped byte, a truncated
file and a deleted file each fail their block alone, zero its device row and (corrupt ones) are
quarantined; the store reports the path it took. On the CPU: the errors of a device load asked
of a store that cannot take it."""

from __future__ import annotations

import numpy as np
import pytest

from tiercache import KeyState, RowStore
from tiercache.bench.benchvllmserve import damage_file
from tiercache.errors import ConfigError, CorruptBlockError, IOPathError
from tiercache.files import select_io_path

ROW = 3 * 4096


def _paths():
    """The device paths this machine can run (GDS only where the cuFile driver reports it)."""
    out = ["posix"]
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return out
    out.append("compat")
    try:
        if select_io_path("auto").name == "gds":
            out.append("gds")
    except Exception:
        pass
    return out


def _load(st: RowStore, keys, rows, dev):
    jid = st.submit_load(keys, rows, device_rows=dev)
    st.drain()
    return next(r for r in st.finished() if r.job_id == jid)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["posix", "compat", "gds"])
def test_blocks_load_byte_exact_into_device_rows_and_a_bad_file_fails_its_block_alone(tmp_path, rng, mode):
    if mode not in _paths():
        pytest.skip(f"io_mode {mode!r} cannot run on this machine ({select_io_path('auto').reason})")
    import cupy

    n = 12
    rows = rng.integers(0, 256, (n, ROW), dtype=np.uint8)
    keys = [bytes(k) for k in {rng.bytes(int(rng.integers(1, 40))) for _ in range(n)}]
    while len(keys) < n:
        keys.append(rng.bytes(20))
    keys = keys[:n]
    root = tmp_path / "r"
    # open_files=0: no descriptor held from the stores (through one, a deleted file's verified
    # bytes would still be served, rightly, and the deletion would not show)
    with RowStore(rows, root, capacity_blocks=64, fsync="none", open_files=0, device=0, io_mode=mode) as st:
        assert st.device_path is not None and st.device_path.name == mode
        assert st.stats()["io_path"]["name"] == mode
        st.submit_store(keys, list(range(n)))
        st.drain()
        assert all(r.success for r in st.finished())
        dev = cupy.full((n + 4, ROW), 7, dtype=cupy.uint8)
        where = rng.permutation(n + 4)[:n].tolist()
        res = _load(st, keys, where, dev)
        assert res.success, res.failed
        got = cupy.asnumpy(dev)
        for i in range(n):
            assert np.array_equal(got[where[i]], rows[i]), f"block {i} differs in device row {where[i]}"
        bad = rng.permutation(n)[:3].tolist()
        for how, i in zip(("flip", "truncate", "delete"), bad):
            damage_file(next(root.glob(f"*/block_x{keys[i].hex()}_pool_*.bin")), how)
        dev.fill(7)
        res = _load(st, keys, where, dev)
        assert set(res.failed) == {keys[i] for i in bad}
        assert isinstance(res.failed[keys[bad[0]]], CorruptBlockError)
        assert isinstance(res.failed[keys[bad[1]]], CorruptBlockError)
        assert isinstance(res.failed[keys[bad[2]]], FileNotFoundError)
        got = cupy.asnumpy(dev)
        for i in range(n):
            if i in bad:
                assert not got[where[i]].any(), "a failed block's device row must be zeroed"
                assert st.state(keys[i]) is KeyState.ABSENT
            else:
                assert np.array_equal(got[where[i]], rows[i])
        assert len(list((root / "quarantine").iterdir())) == 2
        moved = {(t["src"], t["dst"], t["path"]): t["blocks"] for t in st.stats()["transfers"]}
        assert moved[("file", "device", mode)] == 2 * n - 3, moved


def test_device_rows_need_a_store_made_for_them(tmp_path, rng):
    rows = rng.integers(0, 256, (2, ROW), dtype=np.uint8)
    with RowStore(rows, tmp_path / "r", capacity_blocks=4, fsync="none") as st:
        assert st.device_path is None
        with pytest.raises(ConfigError, match="without a device"):
            st.submit_load([b"k"], [0], device_rows=np.zeros((1, ROW), np.uint8))


def test_an_explicit_device_path_that_cannot_run_is_refused(tmp_path, rng, monkeypatch):
    from tiercache import cuda as cuda_mod
    from tiercache.files import devicepath

    monkeypatch.setattr(devicepath, "cuda_status", lambda: cuda_mod.CudaStatus(False, "no GPU in this test", False))
    rows = rng.integers(0, 256, (2, ROW), dtype=np.uint8)
    for mode in ("gds", "compat"):
        with pytest.raises(IOPathError, match=f"io_mode = '{mode}'"):
            RowStore(rows, tmp_path / mode, capacity_blocks=4, fsync="none", device=0, io_mode=mode)
    with RowStore(rows, tmp_path / "auto", capacity_blocks=4, fsync="none", device=0) as st:
        assert st.device_path.name == "posix" and "no GPU in this test" in st.device_path.reason
