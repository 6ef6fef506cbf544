"""Pool geometry: the shape and dtype of one block of a pool, and KV-cache helpers."""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from tiercache.dtypes import ITEMSIZE, canonical_dtype
from tiercache.errors import ConfigError

POOL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", re.ASCII)
#: the largest block of one pool (bytes): far above any KV block, far below an overflow
MAX_BLOCK_NBYTES = 1 << 36

#: axis names of the TensorRT-LLM-style KV block layout
KV_LAYOUT_LAYER_MAJOR = ("num_layers", "kv_factor", "num_kv_heads", "tokens_per_block", "head_dim")
#: axis names of a token-major KV block layout
KV_LAYOUT_TOKEN_MAJOR = ("tokens_per_block", "num_layers", "kv_factor", "num_kv_heads", "head_dim")
KV_LAYOUTS = {"layer_major": KV_LAYOUT_LAYER_MAJOR, "token_major": KV_LAYOUT_TOKEN_MAJOR}


@dataclass(frozen=True)
class PoolSpec:
    """One pool: every block of the pool has shape ``block_shape`` and element type ``dtype``.

    Attributes:
        name: pool name, 1..64 characters of ``[A-Za-z0-9_.-]`` starting alphanumeric; it
            appears in block file names.
        block_shape: shape of one block, in elements (not including the slot axis).
        dtype: canonical dtype name (see :mod:`tiercache.dtypes`).
        token_axis: index in ``block_shape`` of the token axis, or None when the pool is not
            a KV cache (partial copies need it).
        layout: ``"layer_major"``, ``"token_major"`` or None for a plain pool.

    Raises:
        ConfigError: bad name, a shape that is not a non-empty list of positive integers (a
            float, bool or string dimension included), a block over :data:`MAX_BLOCK_NBYTES`,
            unknown dtype.
    """

    name: str
    block_shape: tuple[int, ...]
    dtype: str
    token_axis: int | None = None
    layout: str | None = None
    block_nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not POOL_NAME_RE.fullmatch(self.name):
            raise ConfigError(
                f"invalid pool name {self.name!r}: use 1-64 characters of [A-Za-z0-9_.-], "
                "starting with a letter or digit"
            )
        dims = self.block_shape
        if isinstance(dims, (str, bytes)) or not hasattr(dims, "__iter__") or not all(
                isinstance(d, numbers.Integral) and not isinstance(d, (bool, np.bool_)) for d in dims):
            raise ConfigError(
                f"pool {self.name!r}: block_shape {self.block_shape!r} must be a list of "
                "positive integers"
            )
        shape = tuple(int(d) for d in dims)
        if not shape or any(d <= 0 for d in shape):
            raise ConfigError(
                f"pool {self.name!r}: block_shape {self.block_shape!r} must be a non-empty "
                "list of positive integers"
            )
        object.__setattr__(self, "block_shape", shape)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if self.token_axis is not None and not 0 <= self.token_axis < len(shape):
            raise ConfigError(
                f"pool {self.name!r}: token_axis {self.token_axis} outside [0, {len(shape)})"
            )
        nbytes = math.prod(shape) * ITEMSIZE[self.dtype]
        if nbytes > MAX_BLOCK_NBYTES:
            raise ConfigError(
                f"pool {self.name!r}: a block of shape {list(shape)} {self.dtype} is {nbytes} bytes; "
                f"blocks may have at most {MAX_BLOCK_NBYTES} bytes (64 GiB)"
            )
        object.__setattr__(self, "block_nbytes", nbytes)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return ITEMSIZE[self.dtype]

    @property
    def tokens_per_block(self) -> int | None:
        """Tokens per block for KV pools, else None."""
        return None if self.token_axis is None else self.block_shape[self.token_axis]

    @classmethod
    def kv(
        cls,
        name: str,
        *,
        num_layers: int,
        kv_factor: int,
        num_kv_heads: int,
        tokens_per_block: int,
        head_dim: int,
        dtype: object = "bfloat16",
        layout: str = "layer_major",
    ) -> PoolSpec:
        """A KV-cache pool.

        ``layout="layer_major"`` gives blocks of shape
        ``[num_layers, kv_factor, num_kv_heads, tokens_per_block, head_dim]`` (the layout of
        TensorRT-LLM's block pools); ``"token_major"`` gives
        ``[tokens_per_block, num_layers, kv_factor, num_kv_heads, head_dim]``. ``kv_factor``
        is 2 for separate K and V, 1 for an MLA latent cache.

        Raises:
            ConfigError: a non-positive dimension or an unknown layout.
        """
        dims = dict(
            num_layers=num_layers,
            kv_factor=kv_factor,
            num_kv_heads=num_kv_heads,
            tokens_per_block=tokens_per_block,
            head_dim=head_dim,
        )
        for key, value in dims.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"pool {name!r}: {key} = {value!r} must be a positive integer")
        if layout not in KV_LAYOUTS:
            raise ConfigError(
                f"pool {name!r}: layout {layout!r} unknown; valid: {', '.join(KV_LAYOUTS)}"
            )
        axes = KV_LAYOUTS[layout]
        return cls(
            name=name,
            block_shape=tuple(dims[a] for a in axes),
            dtype=cast(str, dtype),  # canonicalized by __post_init__
            token_axis=axes.index("tokens_per_block"),
            layout=layout,
        )

    def describe(self) -> dict:
        """A JSON-ready description (name, shape, dtype, bytes per block, layout)."""
        return {
            "name": self.name,
            "block_shape": list(self.block_shape),
            "dtype": self.dtype,
            "block_nbytes": self.block_nbytes,
            "layout": self.layout,
            "token_axis": self.token_axis,
        }
