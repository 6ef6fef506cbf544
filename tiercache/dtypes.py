"""Element types that pools can hold, by name.

Blocks are moved as raw bytes, so tiercache only needs each dtype's name and size. NumPy lacks
bfloat16 and the fp8 types; where the ``ml_dtypes`` package is installed, :func:`numpy_dtype`
returns its types so that host views carry the real dtype, otherwise callers get raw bytes.
"""

from __future__ import annotations

import numpy as np

from tiercache.errors import ConfigError

#: itemsize in bytes of every supported dtype, by canonical name
ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
}

_ALIASES = {
    "fp64": "float64",
    "double": "float64",
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def canonical_dtype(dtype: object) -> str:
    """Return the canonical name of ``dtype``.

    Accepts names (``"bf16"``, ``"bfloat16"``), NumPy/CuPy dtypes, and PyTorch dtypes
    (``torch.bfloat16`` is read from its string ``"torch.bfloat16"``).

    Raises:
        ConfigError: the dtype is not one of :data:`ITEMSIZE`.
    """
    try:  # a dtype seen before: one lookup (this runs on every put and get)
        return _CANONICAL[dtype]
    except (KeyError, TypeError):
        pass
    if isinstance(dtype, str):
        name = dtype
    elif isinstance(dtype, np.dtype):
        name = dtype.name
    elif isinstance(dtype, type) and issubclass(dtype, np.generic):
        name = np.dtype(dtype).name
    else:
        name = str(dtype)
    name = name.strip().lower().removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in ITEMSIZE:
        raise ConfigError(
            f"unsupported dtype {dtype!r}; valid dtypes: {', '.join(sorted(ITEMSIZE))} "
            f"(aliases: {', '.join(sorted(_ALIASES))})"
        )
    if len(_CANONICAL) < 256:
        _CANONICAL[dtype] = name
    return name


#: dtypes (names, NumPy, CuPy and PyTorch dtypes) already named by :func:`canonical_dtype`
_CANONICAL: dict = {}


def numpy_dtype(name: str) -> np.dtype | None:
    """The NumPy dtype for canonical ``name``, or None where NumPy cannot represent it
    (bfloat16 and fp8 without ``ml_dtypes``)."""
    try:
        return np.dtype(name)
    except TypeError:
        pass
    try:
        import ml_dtypes  # noqa: F401  (registers bfloat16, float8_* with NumPy)
    except ImportError:
        return None
    try:
        return np.dtype(name)
    except TypeError:
        return None
