"""Block keys: non-negative ints (block ids) or bytes (content hashes)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import cast

import xxhash

from tiercache.errors import InvalidKeyError

Key = int | bytes
MAX_INT_KEY = (1 << 63) - 1
MAX_BYTES_KEY = 64


def normalize_key(key: object) -> Key:
    """Return ``key`` as an ``int`` or ``bytes``.

    Accepted: Python and NumPy integers in ``[0, 2**63)``; ``bytes``/``bytearray``/
    ``memoryview`` of 1..64 bytes.

    Raises:
        InvalidKeyError: any other value.
    """
    if type(key) is int and 0 <= key <= MAX_INT_KEY:  # the common case, before the ABC checks
        return key
    if isinstance(key, bool):
        raise InvalidKeyError(f"key {key!r} is a bool; keys are ints in [0, 2**63) or 1..64 bytes")
    if isinstance(key, numbers.Integral):
        k = int(key)
        if not 0 <= k <= MAX_INT_KEY:
            raise InvalidKeyError(f"int key {k} outside [0, 2**63)")
        return k
    if isinstance(key, (bytes, bytearray, memoryview)):
        b = bytes(key)
        if not 1 <= len(b) <= MAX_BYTES_KEY:
            raise InvalidKeyError(f"bytes key of length {len(b)} outside [1, {MAX_BYTES_KEY}]")
        return b
    raise InvalidKeyError(
        f"key {key!r} of type {type(key).__name__}; keys are ints in [0, 2**63) or 1..64 bytes"
    )


def normalize_keys(keys: object) -> list[Key]:
    """A list of normalized keys from one key or an iterable of keys (NumPy arrays too).

    Raises:
        InvalidKeyError: a bad key, or the same key twice in one batch.
    """
    if isinstance(keys, (bytes, bytearray, memoryview, numbers.Integral)):
        items: Iterable = [keys]
    else:
        try:
            items = list(cast(Iterable, keys))
        except TypeError:
            raise InvalidKeyError(f"keys {keys!r} are neither a key nor an iterable of keys") from None
    out = [normalize_key(k) for k in items]
    if len(set(out)) != len(out):
        seen: set = set()
        dup = next(k for k in out if k in seen or _added(seen, k))
        raise InvalidKeyError(f"key {key_text(dup)} appears twice in one batch")
    return out


def key_text(key: Key) -> str:
    """The key as it appears in file names: decimal for ints, ``x`` + hex for bytes."""
    return str(key) if isinstance(key, int) else "x" + key.hex()


def format_keys(keys: list[Key], limit: int = 5) -> str:
    """The first ``limit`` keys as text (:func:`key_text`), with the count when there are more:
    what error messages name."""
    text = ", ".join(key_text(k) for k in keys[:limit])
    return text + (f", ... ({len(keys)} keys)" if len(keys) > limit else "")


def key_from_text(text: str) -> Key:
    """Inverse of :func:`key_text`: ASCII decimal digits (an int key) or ``x`` and an even
    number of hex digits (a bytes key). Leading zeros and upper-case hex are accepted here (the
    CLI's ``--keys``); block file names use only :func:`key_text`'s spelling.

    Raises:
        InvalidKeyError: not a key text, or a key out of range (named with the range).
    """
    if text.startswith("x") and text[1:].isascii():
        try:
            raw = bytes.fromhex(text[1:])
        except ValueError:
            raw = None
        if raw is not None and " " not in text:
            if not 1 <= len(raw) <= MAX_BYTES_KEY:
                raise InvalidKeyError(f"bytes key {text!r} has {len(raw)} bytes; bytes keys have 1..{MAX_BYTES_KEY}")
            return raw
    elif text.isascii() and text.isdigit():
        k = int(text)
        if k > MAX_INT_KEY:
            raise InvalidKeyError(f"int key {text} out of range: int keys are in [0, 2**63) (at most {MAX_INT_KEY})")
        return k
    raise InvalidKeyError(f"{text!r} is not a key text (decimal int or x<hex>)")


_MASK64 = (1 << 64) - 1
#: odd: multiplying by it is a bijection on 64-bit ints
KEY_HASH_GOLDEN = 0x9E3779B97F4A7C15


def key_hash(key: Key) -> int:
    """64-bit hash of a key: a bijective mix of an int key (``key * KEY_HASH_GOLDEN mod
    2**64``), XXH3-64 of a bytes key. What the file tier's index sorts and saves."""
    if isinstance(key, int):
        return (key * KEY_HASH_GOLDEN) & _MASK64
    return xxhash.xxh3_64_intdigest(key)


def _added(seen: set, k: Key) -> bool:
    """Add ``k`` to ``seen``; False (for a search that stops at the first key seen twice)."""
    seen.add(k)
    return False
