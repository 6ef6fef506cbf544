"""Shared fixtures: random pools, random keys, random bytes (never zeros), GPU skipping."""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from tiercache import CacheConfig, PoolSpec
from tiercache.cuda import cuda_status
from tiercache.files import SUBDIRS

_SUBDIR_NAMES = frozenset(SUBDIRS)

# PyTorch's deterministic mode (tests/test_hf_integration.py's GPU leg) needs cuBLAS's workspace
# setting before the process's first cuBLAS call
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

# no wall-clock deadlines: CI machines and the first draw after imports can be slow
settings.register_profile("tiercache", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("tiercache")


def bpath(root, key, pool: str) -> Path:
    """A block file's path under a root: ``<root>/<subdir>/block_{key}_pool_{pool}.bin``."""
    from tiercache.files import block_relpath

    return Path(root) / block_relpath(key, pool)


def files(root, pattern: str = "*") -> list[Path]:
    """Files matching ``pattern`` in a root and in its block subdirectories."""
    root = Path(root)
    return sorted(p for p in [*root.glob(pattern), *root.glob(f"[0-9a-f][0-9a-f]/{pattern}")] if not p.is_dir()
                  or p.is_symlink() or p.parent != root or p.name not in _SUBDIR_NAMES)


def names(root, prefix: str = "") -> list[str]:
    """Names (no directory) of the files starting with ``prefix`` in a root and in its block
    subdirectories."""
    return sorted(p.name for p in files(root, prefix + "*"))


def require_integration(module: str):
    """``module`` (an integration's library: vllm, torch, transformers), imported. Where it is
    missing the calling test module is skipped, except under ``TIERCACHE_REQUIRE_INTEGRATIONS=1``
    (CI), where its absence is an error: integration tests must run there, not skip. With
    ``TIERCACHE_EXPECT_VLLM=X`` (or ``_SGLANG``), a vllm (sglang) whose version is not X is an error (the run against
    another release's sources must not test the installed one)."""
    if os.environ.get("TIERCACHE_REQUIRE_INTEGRATIONS") == "1":
        import importlib

        mod = importlib.import_module(module)
    else:
        mod = pytest.importorskip(module)
    for name in ("vllm", "sglang"):  # the runs against another release's sources
        want = os.environ.get(f"TIERCACHE_EXPECT_{name.upper()}")
        if module == name and want and mod.__version__ != want:
            raise RuntimeError(f"TIERCACHE_EXPECT_{name.upper()}={want} but {name} {mod.__version__} was imported "
                               f"from {mod.__file__}")
    return mod


def pytest_collection_modifyitems(config, items):
    if cuda_status().available:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {cuda_status().reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu),
                        pytest.param("torch", marks=pytest.mark.gpu)])
def backend(request) -> str:
    """The array library of engine tensors (tests/layouts.py): NumPy "device" tensors on the
    CPU; CuPy and PyTorch CUDA tensors on a GPU."""
    if request.param == "torch":
        pytest.importorskip("torch")
    return request.param


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test, printed on failure (``TIERCACHE_TEST_SEED`` replays one)."""
    s = int(os.environ.get("TIERCACHE_TEST_SEED") or secrets.randbits(32))
    request.node.user_properties.append(("seed", s))
    print(f"seed={s}")
    return s


@pytest.fixture
def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


def random_kv_pool(rng: np.random.Generator, name: str = "kv", dtype: str = "float16") -> PoolSpec:
    """A small KV pool of random geometry."""
    return PoolSpec.kv(
        name,
        num_layers=int(rng.integers(1, 4)),
        kv_factor=int(rng.integers(1, 3)),
        num_kv_heads=int(rng.integers(1, 4)),
        tokens_per_block=int(rng.choice([4, 8, 16])),
        head_dim=int(rng.choice([8, 16, 64])),
        dtype=dtype,
    )


def random_blocks(rng: np.random.Generator, pool: PoolSpec, n: int) -> np.ndarray:
    """``n`` blocks of random bytes as raw ``uint8`` ``(n, block_nbytes)``; no all-zero block."""
    data = rng.integers(1, 256, size=(n, pool.block_nbytes), dtype=np.uint8)
    return data


def random_keys(rng: np.random.Generator, n: int, kind: str = "mixed") -> list:
    """``n`` distinct random keys: ints, bytes (content hashes), or a mix."""
    ints = [int(k) for k in rng.choice(1 << 62, size=n, replace=False)]
    if kind == "int":
        return ints
    hashes = [rng.bytes(int(rng.integers(8, 33))) for _ in range(n)]
    if kind == "bytes":
        return hashes
    return [h if i % 2 else k for i, (k, h) in enumerate(zip(ints, hashes))]


@pytest.fixture
def make_config(tmp_path, rng):
    """Build a CacheConfig with two random pools under a fresh root."""

    def make(**kw) -> CacheConfig:
        pools = kw.pop("pools", None) or (
            random_kv_pool(rng, "kv"),
            PoolSpec("act", (int(rng.integers(100, 3000)),), "float32"),
        )
        base = dict(pools=pools, device_slots=0, host_slots=8, file_slots=64, root=tmp_path / "root", fsync="none")
        base.update(kw)
        return CacheConfig(**base)

    return make


def _engines() -> list[str]:
    from tiercache.files import native_status, uring_status

    out = ["python"]
    if native_status()[0]:
        out.append("threads")
        if uring_status()[0]:
            out.append("io_uring")
    return out


#: the file I/O engines that run here (the native ones where kernels/blockio.c builds)
ENGINES = _engines()


@pytest.fixture(params=ENGINES)
def io_engine(request):
    """Each file I/O engine that runs here, in turn."""
    return request.param


class _WriteFaults:
    """Writes of chosen keys' block files fail with an errno: the python engine's
    ``posix_io.write_block`` raises; native engines use the C library's fault injection
    (after the temporary file is opened, so its cleanup runs)."""

    def __init__(self, monkeypatch) -> None:
        self.mp = monkeypatch

    def arm(self, engine: str, keys, err: int = errno.ENOSPC) -> None:
        from tiercache.files import block_filename, nativeio, posix_io

        keys = set(keys)
        if engine == "python":
            real = posix_io.write_block

            def failing(final, key, pool, data, *args):
                if key in keys:
                    raise OSError(err, os.strerror(err))
                return real(final, key, pool, data, *args)

            self.mp.setattr(posix_io, "write_block", failing)
            return
        for k in keys:
            nativeio.set_fault(nativeio.WRITE, block_filename(k, "")[: -len(".bin")], err)

    def disarm(self) -> None:
        self.mp.undo()
        if ENGINES != ["python"]:
            from tiercache.files import nativeio

            nativeio.clear_faults()


@pytest.fixture
def fail_writes(monkeypatch):
    """A :class:`_WriteFaults` (every fault removed at the end of the test)."""
    faults = _WriteFaults(monkeypatch)
    yield faults
    faults.disarm()


def drop_index(root) -> None:
    """Delete a root's saved index, so that the next open scans every file (what a root
    written before the index, or one whose index is unusable, gets)."""
    (Path(root) / ".tiercache-index").unlink(missing_ok=True)
