"""The exception hierarchy of tiercache.

Every error tiercache raises on purpose derives from :class:`TierCacheError`. Each class also
derives from the built-in exception a Python programmer would expect (``ValueError`` for bad
values, ``LookupError`` for missing keys, ``OSError``-like failures are wrapped in
:class:`TransferError` with the original as ``__cause__``), so ``except ValueError`` keeps
working. Messages name the bad value and the valid range.
"""

from __future__ import annotations


class TierCacheError(Exception):
    """Root of every error raised by tiercache."""


class ConfigError(TierCacheError, ValueError):
    """A configuration (TOML file or keyword arguments) is malformed or out of range."""


class UnknownPoolError(TierCacheError, LookupError):
    """A pool name that the cache does not have."""

    def __str__(self) -> str:  # LookupError would repr() the message
        return str(self.args[0]) if self.args else ""


class ArrayMismatchError(TierCacheError, ValueError):
    """A caller's array has the wrong shape, dtype, device, or memory layout for its pool."""


class InvalidKeyError(TierCacheError, ValueError):
    """A key that is neither a non-negative int below 2**63 nor 1..64 bytes."""


class KeyNotFoundError(TierCacheError, LookupError):
    """A key that is not stored (in any tier, or in the tier that was named)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SlotRangeError(TierCacheError, IndexError):
    """A slot id outside ``[0, num_slots)`` of its tier, or repeated where slots must differ."""


class TierUnavailableError(TierCacheError, ValueError):
    """A tier that this cache does not have (no GPU for ``device``, no root for ``file``)."""


class TierFullError(TierCacheError, RuntimeError):
    """A tier has no room and nothing in it may be moved (every block pinned or in use)."""


class PinnedBlockError(TierCacheError, RuntimeError):
    """An operation would move or drop a pinned block."""


class RootError(TierCacheError, OSError):
    """The file-tier root is missing, not a directory, not writable, or not tiercache's own."""


class IOPathError(TierCacheError, RuntimeError):
    """The I/O path that the configuration asks for (``gds``, ``compat``) cannot run here."""


class TransferError(TierCacheError, RuntimeError):
    """A copy between tiers failed. The source copy of every block is still valid and
    registered; ``failed_keys`` lists the blocks whose copy did not complete."""

    def __init__(self, message: str, failed_keys: list | tuple = ()) -> None:
        super().__init__(message)
        self.failed_keys = list(failed_keys)


class SpillError(TransferError):
    """Room could not be made in a tier for a call's blocks: copying the tier's least recently
    used blocks (``victims``) down failed. The victims stay where they were, valid and
    registered; ``failed_keys`` lists the call's blocks that were therefore not stored, moved
    or replaced (a replaced key keeps its earlier bytes); ``reason`` says why, without them."""

    def __init__(self, message: str, failed_keys: list | tuple = (), victims: list | tuple = (),
                 reason: str | None = None) -> None:
        super().__init__(message, failed_keys)
        self.victims = list(victims)
        self.reason = message if reason is None else reason


class TornReadError(TransferError):
    """A read of a block failed its checksum, but its file verifies when read again: the
    destination changed while the block was read into it (a caller writing into a buffer of
    a load in flight). The block stays stored and its file is kept."""


class CorruptBlockError(TierCacheError, ValueError):
    """A block file whose header, geometry, size or checksum does not verify."""


class ClosedError(TierCacheError, RuntimeError):
    """The cache was used after :meth:`TierCache.close`."""


class MissingDependencyError(TierCacheError, ImportError):
    """An optional package a feature needs is not installed (the message names the extra to
    install, e.g. ``pip install 'tiercache[metrics]'``)."""
