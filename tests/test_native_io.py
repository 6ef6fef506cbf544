"""The file tier's I/O engines (io_uring, C threads, python): exact bytes round-tripped with
random data and keys, each engine reading what another wrote, faults mid-batch, hostile names,
concurrency, and the choice of engine."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
from conftest import ENGINES, bpath, names, random_keys

from tiercache import ConfigError, CorruptBlockError, PoolSpec
from tiercache.files import FileTier, IOPath, block_filename, choose_engine, nativeio
from tiercache.files.blockbatch import MAX_CHUNK_FILES, BlockBatches
from tiercache.settings import sections

NATIVE = [e for e in ENGINES if e != "python"]
needs_native = pytest.mark.skipif(not NATIVE, reason="no C compiler: the native engines cannot be built here")


def _pools(rng):
    # one page-aligned pool (O_DIRECT) and one odd-sized pool (buffered, padded file)
    return (PoolSpec("kv", (4096 * int(rng.integers(1, 5)),), "uint8"),
            PoolSpec("act", (int(rng.integers(100, 5000)),), "float32"))


def _tier(root, pools, engine, **kw):
    kw.setdefault("io_threads", 4)
    kw.setdefault("direct_io", False)
    s = sections(root=root, io_engine=engine, **kw)
    return FileTier(pools, 4096, IOPath("posix", "test"), s["file"], s["sharing"])


def _free_names(ft):
    return ft.open_files.free_names() if ft.open_files is not None else []


def _data(rng, pools, n):
    return {p.name: rng.integers(0, 256, (n, p.block_nbytes), dtype=np.uint8) for p in pools}


def _written(tmp_path, rng, engine, n, **kw):
    """A tier of random pools holding ``n`` random blocks: ``(pools, keys, data, tier, root)``."""
    pools = _pools(rng)
    keys = random_keys(rng, n)
    data = _data(rng, pools, n)
    root = tmp_path / "root"
    ft = _tier(root, pools, engine, **kw)
    assert not any(ft.write(_items(keys, data)).values())
    return pools, keys, data, ft, root


def _items(keys, arrays):
    return [(k, {name: arr[i] for name, arr in arrays.items()}) for i, k in enumerate(keys)]


@pytest.mark.parametrize("fsync", ["none", "data", "data+dir"])
@pytest.mark.parametrize("direct", [True, False])
def test_round_trip_exact_bytes(tmp_path, rng, io_engine, fsync, direct):
    pools = _pools(rng)
    n = int(rng.integers(1, 3 * MAX_CHUNK_FILES))  # one chunk to several
    keys = random_keys(rng, n)
    data = _data(rng, pools, n)
    ft = _tier(tmp_path / "root", pools, io_engine, fsync=fsync, direct_io=direct)
    assert ft.engine == io_engine
    assert not any(ft.write(_items(keys, data)).values())
    out = {p.name: np.zeros((n, p.block_nbytes), np.uint8) for p in pools}
    order = rng.permutation(n)
    errs = ft.read(_items([keys[i] for i in order], {k: v[order] for k, v in out.items()}))
    assert not any(errs.values())
    # read through views of the permuted rows: read again into the caller's own rows
    errs = ft.read(_items(keys, out))
    assert not any(errs.values())
    for name in data:
        assert np.array_equal(out[name], data[name])
    assert not [p for p in names(tmp_path / "root") if p.startswith(".tmp.")]
    sizes = {os.path.getsize(bpath(tmp_path / "root", k, p.name)) % 4096 for k in keys for p in pools}
    assert sizes == {0}
    ft.close()


@pytest.mark.parametrize("writer", ENGINES)
def test_every_engine_reads_what_another_wrote(tmp_path, rng, writer):
    pools = _pools(rng)
    keys = random_keys(rng, 12)
    data = _data(rng, pools, 12)
    ft = _tier(tmp_path / "root", pools, writer, fsync="data")
    assert not any(ft.write(_items(keys, data)).values())
    ft.close()
    for reader in ENGINES:
        ft = _tier(tmp_path / "root", pools, reader)
        assert len(ft.scan().blocks) == 12
        out = {p.name: np.zeros((12, p.block_nbytes), np.uint8) for p in pools}
        assert not any(ft.read(_items(keys, out)).values()), reader
        for name in data:
            assert np.array_equal(out[name], data[name]), (writer, reader)
        ft.close()


@pytest.mark.parametrize("bs", [8192, 512 << 10])
def test_bad_files_fail_only_their_block(tmp_path, rng, io_engine, bs):
    """With no held descriptors (``open_files=0``) every read looks at the name again, so a
    file deleted or replaced behind the tier fails its block (held descriptors: below).
    512 KiB blocks: a request's checksums are computed by the C threads in parallel (writes'
    and reads' alike, from 2 MiB of data), 8 KiB ones by the thread that runs the request."""
    pools = (PoolSpec("kv", (bs,), "uint8"),)
    keys = list(range(10))
    data = _data(rng, pools, 10)
    root = tmp_path / "root"
    ft = _tier(root, pools, io_engine, fsync="none", open_files=0)
    assert not any(ft.write(_items(keys, data)).values())
    name = {k: bpath(root, k, "kv") for k in keys}
    with open(name[1], "r+b") as f:  # a flipped data byte
        f.seek(4096 + int(rng.integers(0, bs)))
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    os.truncate(name[2], 4096 + 100)  # torn
    name[3].unlink()  # missing
    name[4].unlink()
    os.symlink(name[5], name[4])  # a symlink to a valid file
    name[6].unlink()
    os.mkfifo(name[6])  # a FIFO never blocks the read
    name[7].unlink()
    name[7].mkdir()  # a directory
    with open(name[8], "r+b") as f:  # the header names another key
        f.seek(24)
        f.write(b'{"key":"9",')
    out = {"kv": np.zeros((10, bs), np.uint8)}
    errs = ft.read(_items(keys, out))
    assert {k for k, e in errs.items() if e is None} == {0, 5, 9}
    for k in (1, 2, 4, 6, 7, 8):
        assert isinstance(errs[k], CorruptBlockError), (k, errs[k])
    assert "checksum mismatch" in str(errs[1]) and "truncated" in str(errs[2])
    assert isinstance(errs[3], FileNotFoundError)
    for k in (0, 5, 9):
        assert np.array_equal(out["kv"][k], data["kv"][k])
    ft.close()


@needs_native
@pytest.mark.parametrize("engine", NATIVE)
def test_read_fault_mid_batch(tmp_path, rng, engine):
    pools, keys, data, ft, _ = _written(tmp_path, rng, engine, 40, fsync="none")
    doomed = keys[int(rng.integers(0, 40))]
    nativeio.set_fault(nativeio.READ, block_filename(doomed, "act"), errno.EIO, times=1)
    try:
        out = {p.name: np.zeros((40, p.block_nbytes), np.uint8) for p in pools}
        errs = ft.read(_items(keys, out))
    finally:
        nativeio.clear_faults()
    assert {k for k, e in errs.items() if e} == {doomed}
    assert isinstance(errs[doomed], OSError) and errs[doomed].errno == errno.EIO
    ok = [i for i, k in enumerate(keys) if k != doomed]
    for name in data:
        assert np.array_equal(out[name][ok], data[name][ok])
    ft.close()


@needs_native
@pytest.mark.parametrize("engine", NATIVE)
@pytest.mark.parametrize("fsync", ["none", "data"])
def test_write_fault_leaves_nothing_of_the_block(tmp_path, rng, engine, fsync):
    pools, keys, _old, ft, root = _written(tmp_path, rng, engine, 20, fsync=fsync)
    new = _data(rng, pools, 20)
    doomed = keys[int(rng.integers(0, 20))]
    nativeio.set_fault(nativeio.WRITE, block_filename(doomed, "kv")[:-4], errno.ENOSPC)
    try:
        errs = ft.write(_items(keys, new))
    finally:
        nativeio.clear_faults()
    assert {k for k, e in errs.items() if e} == {doomed}
    assert errs[doomed].errno == errno.ENOSPC
    # the only temporary files are the free files the tier keeps (replaced blocks' files)
    assert sorted(p for p in names(root) if p.startswith(".tmp.")) == sorted(_free_names(ft))
    # no half-written block: neither pool's file of the failed key is left
    assert not [p for p in names(root) if p.startswith(block_filename(doomed, "")[:-4])]
    ok = [i for i, k in enumerate(keys) if k != doomed]
    out = {p.name: np.zeros((len(ok), p.block_nbytes), np.uint8) for p in pools}
    errs = ft.read(_items([keys[i] for i in ok], out))
    assert not any(errs.values())
    for name in new:  # the other blocks hold the new bytes (the read used to fill copies, unchecked)
        assert np.array_equal(out[name], new[name][ok])
    ft.close()
    assert not [p for p in names(root) if p.startswith(".tmp.")]  # free files go with the tier


@pytest.fixture(params=[True, False], ids=["ring-renames", "syscall-renames"])
def uring_meta(request):
    """Renames and unlinks on io_uring (where the kernel has them) or as system calls; the
    io_uring engine takes either path, the other engines ignore the setting."""
    if NATIVE:
        nativeio.set_uring_meta(request.param)
    yield request.param
    if NATIVE:
        nativeio.set_uring_meta(True)


@needs_native
@pytest.mark.parametrize("engine", NATIVE)
@pytest.mark.parametrize("fsync", ["none", "data"])  # the write's own publication, the group commit's
def test_rename_fault_unpublishes_the_block(tmp_path, rng, engine, fsync, uring_meta):
    pools = _pools(rng)
    n = int(rng.integers(6, 40))
    keys = random_keys(rng, n)
    data = _data(rng, pools, n)
    root = tmp_path / "root"
    ft = _tier(root, pools, engine, fsync=fsync)
    doomed, blocked = (keys[int(i)] for i in rng.choice(n, 2, replace=False))
    # the kernel's own refusal: a non-empty directory under a final name cannot be replaced
    (bpath(root, blocked, "kv") / "x").mkdir(parents=True)
    nativeio.set_fault(nativeio.RENAME, block_filename(doomed, "act"), errno.EIO)
    try:
        errs = ft.write(_items(keys, data))
    finally:
        nativeio.clear_faults()
    assert {k for k, e in errs.items() if e} == {doomed, blocked}
    assert errs[doomed].errno == errno.EIO
    assert bpath(root, blocked, "kv").is_dir()
    assert not [p for p in names(root) if p.startswith(".tmp.") or p.startswith(block_filename(doomed, "")[:-4])
                or p == block_filename(blocked, "act")]
    ok = [i for i, k in enumerate(keys) if k not in (doomed, blocked)]
    out = {p.name: np.zeros((len(ok), p.block_nbytes), np.uint8) for p in pools}
    assert not any(ft.read(_items([keys[i] for i in ok], out)).values())
    for name in data:
        assert np.array_equal(out[name], data[name][ok])
    ft.close()


@needs_native
@pytest.mark.parametrize("engine", NATIVE)
def test_deletes_and_evictions_remove_exactly_their_files(tmp_path, rng, engine, uring_meta, caplog):
    """A batch of unlinks (deletes; evictions that recycle files as free ones): every named file
    goes, a missing one is no error, a directory under a block's name stays (a warning), and the
    blocks not named keep their bytes."""
    pools, keys, data, ft, root = _written(tmp_path, rng, engine, 48, fsync="none")
    gone, evicted, kept = keys[:16], keys[16:32], keys[32:]
    ghost = random_keys(rng, 1)[0]  # never written
    dir_key = random_keys(rng, 1)[0]
    bpath(root, dir_key, "kv").mkdir(parents=True)
    ft.delete(gone + [ghost, dir_key])
    assert "a directory, not a block file" in caplog.text
    assert bpath(root, dir_key, "kv").is_dir()
    assert ft.evict(evicted) == evicted
    left = {n for n in names(root) if not n.startswith(".tmp.")}
    for k in gone + evicted:
        assert not {block_filename(k, p.name) for p in pools} & left
    assert {block_filename(k, p.name) for k in kept for p in pools} <= left
    out = {p.name: np.zeros((len(kept), p.block_nbytes), np.uint8) for p in pools}
    assert not any(ft.read(_items(kept, out)).values())
    for name in data:
        assert np.array_equal(out[name], data[name][32:])
    # the evicted blocks' files may live on as free files: a new write reuses them, exact bytes
    new = _data(rng, pools, 16)
    fresh = random_keys(rng, 16)
    assert not any(ft.write(_items(fresh, new)).values())
    out = {p.name: np.zeros((16, p.block_nbytes), np.uint8) for p in pools}
    assert not any(ft.read(_items(fresh, out)).values())
    for name in new:
        assert np.array_equal(out[name], new[name])
    ft.close()


RING_CHILD = r"""
import sys, numpy as np
sys.path.insert(0, sys.argv[3])
import test_native_io as t
from conftest import random_keys
from tiercache.files import nativeio
nativeio.set_uring_meta(sys.argv[2] == "on")
rng = np.random.default_rng(int(sys.argv[4]))
pools = t._pools(rng)
keys = random_keys(rng, 40)
data = t._data(rng, pools, 40)
ft = t._tier(sys.argv[1], pools, "io_uring", fsync="none", open_files=0)
assert not any(ft.write(t._items(keys, data)).values())
out = {p.name: np.zeros((40, p.block_nbytes), np.uint8) for p in pools}
assert not any(ft.read(t._items(keys, out)).values())
assert all(np.array_equal(out[n], data[n]) for n in data)
ft.delete(keys)
assert not t.names(sys.argv[1], "block_")
ft.close()
print("ok")
"""


@pytest.mark.skipif("io_uring" not in NATIVE or not nativeio.uring_meta(),
                    reason="io_uring here cannot rename and unlink (a kernel before 5.11, or no io_uring)")
@pytest.mark.parametrize("meta", ["on", "off"])
def test_the_ring_publishes_and_unlinks_without_system_calls(tmp_path, rng, meta):
    """Under strace: with renames on the ring, publishing 40 blocks of two pools and deleting
    them makes no rename or unlink system call on a block's file (they are io_uring requests);
    with them off, every one is a system call. The bytes are checked in the child."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (.ci/run installs it)")
    log = tmp_path / "strace.txt"
    cmd = ["strace", "-f", "-qq", "-o", str(log), "-e", "trace=rename,renameat,renameat2,unlink,unlinkat",
           sys.executable, "-c", RING_CHILD, str(tmp_path / "root"), meta, str(Path(__file__).parent),
           str(int(rng.integers(1 << 30)))]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
    calls = [line for line in log.read_text().splitlines() if "block_" in line]
    renames = [c for c in calls if "rename" in c]
    unlinks = [c for c in calls if "unlink" in c]
    if meta == "on":
        assert not renames and not unlinks, calls[:5]
    else:
        assert len(renames) == 80 and len(unlinks) == 80, (len(renames), len(unlinks))


def test_concurrent_requests(tmp_path, rng, io_engine):
    pools = _pools(rng)
    n = 96
    keys = random_keys(rng, n)
    data = _data(rng, pools, n)
    ft = _tier(tmp_path / "root", pools, io_engine, fsync="data", io_threads=8)
    errors: list = []

    def worker(part):
        try:
            idx = list(part)
            items = _items([keys[i] for i in idx], {k: v[idx] for k, v in data.items()})
            assert not any(ft.write(items).values())
            out = {p.name: np.zeros((len(idx), p.block_nbytes), np.uint8) for p in pools}
            for _ in range(3):
                assert not any(ft.read(_items([keys[i] for i in idx], out)).values())
                for name in data:
                    assert np.array_equal(out[name], data[name][idx])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(range(s, n, 6),)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    ft.close()


def test_chunks_cover_every_block_once_in_order(rng):
    for _ in range(50):
        n = int(rng.integers(1, 400))
        pools = int(rng.integers(1, 40))
        items = [(i, {f"p{j}": np.zeros(8, np.uint8) for j in range(pools)}) for i in range(n)]
        chunks = BlockBatches.chunks(items)
        assert [i for c in chunks for i in c] == list(range(n))
        for c in chunks:  # whole blocks; a chunk is over the file cap only when one block is
            assert len(c) * pools <= max(MAX_CHUNK_FILES, pools)
        if pools == 1:  # as few chunks as the cap allows (host buffers: no staging bound)
            assert len(chunks) == -(-n // MAX_CHUNK_FILES)
    assert len(BlockBatches.chunks([(i, {"p": np.zeros(8, np.uint8)}) for i in range(32)])) == 1


def test_engine_choice():
    with pytest.raises(ConfigError, match="io_engine = 'bogus'; valid: auto, io_uring, threads, python"):
        choose_engine("bogus")
    assert choose_engine("python")[0] == "python"
    # auto: the C threads wherever the native library builds (they beat a ring for a request
    # on its own: kernels/blockio.c's files and checks spread over cores), else python
    assert choose_engine("auto")[0] == ("threads" if "threads" in ENGINES else "python")
    if "io_uring" in ENGINES:
        assert choose_engine("io_uring")[0] == "io_uring"


def test_no_compiler_falls_back_to_python(monkeypatch, tmp_path):
    from tiercache.kernels import hostlib

    nativeio._library.cache_clear()
    nativeio.uring_status.cache_clear()
    monkeypatch.setenv("TIERCACHE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    hostlib.load.cache_clear()
    try:
        name, why = choose_engine("auto")
        assert name == "python" and "no C compiler" in why
        with pytest.raises(ConfigError, match="io_engine = 'threads' but the native I/O library cannot be built"):
            choose_engine("threads")
    finally:
        nativeio._library.cache_clear()
        nativeio.uring_status.cache_clear()
        hostlib.load.cache_clear()


def test_compile_error_is_reported(monkeypatch, tmp_path):
    from tiercache.kernels import hostlib

    monkeypatch.setenv("TIERCACHE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(hostlib, "KERNEL_DIR", tmp_path)
    (tmp_path / "broken.c").write_text("int f( {")
    if hostlib.compiler() is None:
        pytest.skip("no C compiler")
    with pytest.raises(hostlib.HostLibError, match="failed on broken.c"):
        hostlib.build("broken.c")
    assert not list((tmp_path / "cache").glob("*.so"))


def test_ci_builds_the_native_engine():
    """Where a C compiler exists (CI has one), the native library must build: a compile
    error must not hide behind the python fallback."""
    from tiercache.kernels import hostlib

    if hostlib.compiler() is None:
        pytest.skip("no C compiler")
    assert nativeio.native_status()[0], nativeio.native_status()[1]


@needs_native
@pytest.mark.parametrize("bs", [4096 * 3, 512 << 10])
def test_native_headers_are_the_bytes_encode_header_makes(tmp_path, rng, bs):
    """Writes make the usual header in the C threads (``MAKEHEAD``; in parallel from 2 MiB of
    a request's data): every byte of the header page must be what ``encode_header`` makes, for
    int and bytes keys of every length, and another engine must read the blocks back."""
    from tiercache.files import checksum
    from tiercache.files.blockfile import encode_header

    pools = (PoolSpec("kv", (bs,), "uint8"), PoolSpec("act", (int(rng.integers(100, 5000)),), "float32"))
    keys = random_keys(rng, 8, "mixed") + [0, (1 << 63) - 1, b"\x00", bytes(range(64))]
    data = _data(rng, pools, len(keys))
    for engine in NATIVE:
        root = tmp_path / engine
        ft = _tier(root, pools, engine)
        assert not any(ft.write(_items(keys, data)).values())
        for i, k in enumerate(keys):
            for p in pools:
                head = bpath(root, k, p.name).read_bytes()[:4096]
                assert head == encode_header(k, p, checksum(data[p.name][i])), (engine, k, p.name)
        ft.close()
        reader = _tier(root, pools, "python")
        out = {p.name: np.zeros_like(data[p.name]) for p in pools}
        assert not any(reader.read(_items(keys, out)).values())
        for name in data:
            assert np.array_equal(out[name], data[name])
        reader.close()


@needs_native
@pytest.mark.parametrize("engine", NATIVE)
@pytest.mark.parametrize("fsync", ["none", "data"])
def test_unaligned_host_buffers_still_take_o_direct_through_staging(tmp_path, rng, engine, fsync, monkeypatch):
    """NumPy arrays start 16 bytes into a page: with ``direct_io`` their blocks go through the
    thread's staging buffer, so every read and write is O_DIRECT (no page cache for a later
    O_DIRECT read to flush first), bytes exact both ways, and a block whose file fails its
    checks leaves the caller's buffer as it was (nothing is copied out of staging for it)."""
    from tiercache.bench.formatlimit import direct_io_works

    if not direct_io_works(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    bs = 4096 * int(rng.integers(1, 9))
    pools = (PoolSpec("kv", (bs,), "uint8"),)
    n = int(rng.integers(8, 2 * MAX_CHUNK_FILES))
    keys = random_keys(rng, n)

    def unaligned(rows):  # rows of `bs` bytes starting 16 bytes past a page boundary
        raw = np.empty(rows * bs + 8192, np.uint8)
        start = -raw.ctypes.data % 4096 + 16
        return raw[start:start + rows * bs].reshape(rows, bs)

    src = unaligned(n)
    src[:] = rng.integers(0, 256, src.shape, dtype=np.uint8)
    seen: list[tuple[int, np.ndarray]] = []
    run = nativeio.NativeIO.run

    def spy(self, kind, dir_fd, ops):
        if kind in (nativeio.READ, nativeio.WRITE):
            seen.append((kind, ops.flags.copy()))
        return run(self, kind, dir_fd, ops)

    monkeypatch.setattr(nativeio.NativeIO, "run", spy)
    ft = _tier(tmp_path / "root", pools, engine, direct_io=True, fsync=fsync)  # data: a group commit
    assert not any(ft.write(_items(keys, {"kv": src})).values())
    bad = keys[int(rng.integers(0, n))]
    with open(bpath(tmp_path / "root", bad, "kv"), "r+b") as f:  # a flipped data byte
        f.seek(4096 + int(rng.integers(0, bs)))
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    out = unaligned(n)
    out[:] = 7
    errs = ft.read(_items(keys, {"kv": out}))
    assert {k for k, e in errs.items() if e is not None} == {bad}
    for i, k in enumerate(keys):
        assert np.array_equal(out[i], src[i] if k != bad else np.full(bs, 7, np.uint8)), k
    assert {kind for kind, _ in seen} == {nativeio.READ, nativeio.WRITE}
    assert all((flags & nativeio.DIRECT).all() for _, flags in seen)
    ft.close()
