"""tiercache: a tiered block cache for GPU programs (VRAM -> pinned DRAM -> NVMe files).

Quick start::

    import numpy as np
    from tiercache import TierCache, CacheConfig, PoolSpec

    pool = PoolSpec.kv("kv", num_layers=32, kv_factor=2, num_kv_heads=8,
                       tokens_per_block=16, head_dim=128, dtype="float16")
    cfg = CacheConfig(pools=(pool,), device_slots=64, host_slots=128, file_slots=1024,
                      root="/mnt/nvme/tiercache")
    with TierCache(cfg) as cache:
        cache.put([1, 2], np.random.rand(2, *pool.block_shape).astype("float16"))
        cache.offload([1, 2], to="file")
        slots = cache.onboard([1, 2])          # device slots (host slots without a GPU)
"""

from tiercache.aio import AsyncTierCache
from tiercache.cache import TierCache
from tiercache.config import CacheConfig, load_config
from tiercache.enginetensors import DevicePools
from tiercache.errors import (
    ArrayMismatchError,
    ClosedError,
    ConfigError,
    CorruptBlockError,
    InvalidKeyError,
    IOPathError,
    KeyNotFoundError,
    MissingDependencyError,
    PinnedBlockError,
    RootError,
    SlotRangeError,
    SpillError,
    TierCacheError,
    TierFullError,
    TierUnavailableError,
    TornReadError,
    TransferError,
    UnknownPoolError,
)
from tiercache.files import BlockPieces
from tiercache.geometry import PoolSpec
from tiercache.rowstore import KeyState, RowJobResult, RowStore
from tiercache.transfer import sm_carveout

try:  # the one version: pyproject.toml's, as installed
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    __version__ = _version("tiercache")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "TierCache",
    "AsyncTierCache",
    "DevicePools",
    "RowStore",
    "BlockPieces",
    "RowJobResult",
    "KeyState",
    "CacheConfig",
    "PoolSpec",
    "load_config",
    "sm_carveout",
    "TierCacheError",
    "ArrayMismatchError",
    "ClosedError",
    "ConfigError",
    "CorruptBlockError",
    "InvalidKeyError",
    "IOPathError",
    "KeyNotFoundError",
    "MissingDependencyError",
    "PinnedBlockError",
    "RootError",
    "SlotRangeError",
    "TierFullError",
    "TornReadError",
    "TierUnavailableError",
    "SpillError",
    "TransferError",
    "UnknownPoolError",
]
