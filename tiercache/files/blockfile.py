"""The on-disk format of one block of one pool: ``<dd>/block_{key}_pool_{pool}.bin``.

Block files live in :data:`FANOUT` subdirectories of the root, ``00`` to ``3f``: a block's
is two lower-case hex digits of the XXH3-64 of its key's text (:func:`block_subdir`; every
pool's file of a block is in the same one). One directory for every file serialized the
file system's work on it: creating, renaming and removing files in one ext4 directory
measured 0.8-1.05 GB/s for 256 KiB files from 32 threads where 8 or more directories gave
1.4-1.6 (a probe on the CPU machine when the subdirectories came in, 2026-11-24; their effect
on the file tier against fio: docs/performance/files.md). 64 leaves a file system's
free-space and directory work spread over as many directories while each still holds
recycled files to reuse (:mod:`tiercache.files.openfiles`: a free file is reused only in
its own directory, since a rename between directories takes the file system's
cross-directory lock).

Layout (all offsets in bytes)::

    0      magic  b"TCBLOCK\\0"                         8 bytes
    8      format version (little-endian u32)           4
    12     length L of the metadata (u32)               4
    16     xxh3-64 of the metadata (u64)                8
    24     metadata, UTF-8 JSON, L bytes: key, pool, dtype, block_shape, nbytes,
           checksum algorithm and value of the data
    ...    zero padding
    4096   the block's bytes (``nbytes``), zero-padded to a multiple of 4096

The data starts on a 4 KiB boundary and the file length is a multiple of 4 KiB, so O_DIRECT
and cuFile (GDS) move it without bounce copies. The checksum is xxHash's XXH3-64 (the
``xxhash`` package) of the block's bytes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import socket
import struct
from dataclasses import dataclass, field

import xxhash

from tiercache.errors import CorruptBlockError
from tiercache.geometry import PoolSpec
from tiercache.keys import Key, key_from_text, key_text

MAGIC = b"TCBLOCK\0"
FORMAT_VERSION = 1
DATA_OFFSET = 4096
ALIGN = 4096
CHECKSUM_ALGO = "xxh3_64"
_PREFIX = struct.Struct("<8sIIQ")
#: a block file's name: ASCII only, one spelling per key (no leading zeros, lower-case hex)
FILE_RE = re.compile(r"block_(0|[1-9][0-9]*|x(?:[0-9a-f]{2})+)_pool_([A-Za-z0-9][A-Za-z0-9_.-]*)\.bin", re.ASCII)
TMP_PREFIX = ".tmp."
#: temporary files tiercache writes: a block file's (``.tmp.<name>.<pid>.<hex>``) or its own
#: marker, index and stats files' (``.tmp.own.<name>.<pid>.<tag>``; without the tag, and
#: ``.tmp.stats.<pid>``, from before)
TMP_RE = re.compile(r"\.tmp\.(?:(block_[A-Za-z0-9_.-]+\.bin)\.[0-9]+\.[0-9a-f]+|own\.[A-Za-z0-9_.-]+\.[0-9]+"
                    r"(?:\.[0-9a-f]{8})?|stats\.[0-9]+)", re.ASCII)


def _boot_tag() -> str:
    ident = b""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as fh:
            ident = fh.read().strip()
    except OSError:  # not Linux: the host name and the boot time stand in
        ident = socket.gethostname().encode() + str(int(os.stat("/").st_ctime)).encode()
    try:  # a pid means something only in its own PID namespace (containers share the boot id)
        ident += b":pidns:" + str(os.stat("/proc/self/ns/pid").st_ino).encode()
    except OSError:
        pass
    return hashlib.blake2b(ident, digest_size=4).hexdigest()


#: this machine, boot and PID namespace, as 8 hex digits: temporary file names carry it beside
#: their writer's pid, whose liveness is only checked where the tag is the checker's own
BOOT_TAG = _boot_tag()


#: subdirectories of a root that hold its block files
FANOUT = 64
#: their names, ``00`` .. ``3f``
SUBDIRS = tuple(f"{i:02x}" for i in range(FANOUT))


def block_subdir_index(key: Key) -> int:
    """The number of ``key``'s subdirectory: ``XXH3-64(key text) % FANOUT``."""
    return xxhash.xxh3_64_intdigest(key_text(key).encode()) % FANOUT


def block_subdir(key: Key) -> str:
    """The subdirectory of ``key``'s block files: :func:`block_subdir_index` as two lower-case
    hex digits."""
    return SUBDIRS[block_subdir_index(key)]


def block_relpath(key: Key, pool: str) -> str:
    """``<dd>/block_{key}_pool_{pool}.bin``: a block file's path relative to its root."""
    return f"{block_subdir(key)}/{block_filename(key, pool)}"


def block_location(key: Key, pool: str) -> tuple[str, str]:
    """``(subdirectory, file name)`` of ``key``'s file in ``pool`` (:func:`block_subdir`,
    :func:`block_filename`) with the key's text made once: what every read and write asks."""
    text = key_text(key)
    return SUBDIRS[xxhash.xxh3_64_intdigest(text.encode()) % FANOUT], f"block_{text}_pool_{pool}.bin"


def block_filename(key: Key, pool: str) -> str:
    """``block_{key}_pool_{pool}.bin`` (int keys in decimal, bytes keys as ``x<hex>``)."""
    return f"block_{key_text(key)}_pool_{pool}.bin"


def parse_filename(name: str) -> tuple[Key, str] | None:
    """``(key, pool)`` for a block file name in its one canonical spelling (the name
    :func:`block_filename` gives), or None for any other name (``block_012_...``, non-ASCII
    digits, a trailing newline, an int key past ``2**63 - 1``)."""
    m = FILE_RE.fullmatch(name)
    if not m:
        return None
    try:
        key = key_from_text(m.group(1))
    except ValueError:
        return None
    return (key, m.group(2)) if block_filename(key, m.group(2)) == name else None


def is_temporary_name(name: str) -> bool:
    """True for the names of tiercache's temporary files (:data:`TMP_RE`), whose block part,
    if any, is a canonical block file name."""
    m = TMP_RE.fullmatch(name)
    return m is not None and (m.group(1) is None or parse_filename(m.group(1)) is not None)


def align_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return (n + align - 1) // align * align


def file_size(nbytes: int) -> int:
    """Length in bytes of the file of a block of ``nbytes`` bytes."""
    return DATA_OFFSET + align_up(nbytes)


def checksum(buf) -> int:
    """XXH3-64 of ``buf`` (any object exposing the buffer protocol)."""
    return xxhash.xxh3_64_intdigest(buf)


@dataclass(frozen=True)
class BlockHeader:
    """What a block file says about itself."""

    key: Key
    pool: str
    dtype: str
    block_shape: tuple[int, ...]
    nbytes: int
    checksum: int
    version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)  # what the cache stores beside the bytes


def encode_header(key: Key, pool: PoolSpec, data_checksum: int, extra: dict | None = None) -> bytes:
    """The 4096-byte header of a block of ``pool`` with key ``key``; ``extra`` (JSON-ready)
    is kept with it (e.g. which device blocks a larger host block holds)."""
    if extra:
        meta = json.dumps(
            {
                "extra": extra,
                "key": key_text(key),
                "pool": pool.name,
                "dtype": pool.dtype,
                "block_shape": list(pool.block_shape),
                "nbytes": pool.block_nbytes,
                "checksum_algo": CHECKSUM_ALGO,
                "checksum": f"{data_checksum:016x}",
            },
            separators=(",", ":"),
        ).encode()
    else:  # the same JSON, from the pool's cached text (no json.dumps per block)
        meta = _meta_head(key, pool) + f"{data_checksum:016x}".encode() + b'"}'
    head = pack_metadata(MAGIC, FORMAT_VERSION, meta)
    if len(head) > DATA_OFFSET:
        raise CorruptBlockError(f"block header of {len(head)} bytes exceeds {DATA_OFFSET}")
    return head + bytes(DATA_OFFSET - len(head))


def pack_metadata(magic: bytes, version: int, meta: bytes) -> bytes:
    """The prefix :func:`checked_metadata` reads, followed by ``meta``."""
    return _PREFIX.pack(magic, version, len(meta), xxhash.xxh3_64_intdigest(meta)) + meta


def checked_metadata(buf, magic: bytes, version: int, limit: int, what: str) -> tuple[int, bytes, int]:
    """The prefix shared by tiercache's checksummed files (block files, the saved index):
    8-byte magic, u32 format version, u32 metadata length, u64 XXH3-64 of the metadata, then
    the metadata, ending within the first ``limit`` bytes. Returns ``(version, metadata,
    offset just past it)``.

    Raises:
        ValueError: truncated, another magic (``what`` names the expected file), another
            version, a length out of range, or metadata that does not match its hash.
    """
    if len(buf) < _PREFIX.size:
        raise ValueError(f"header truncated ({len(buf)} bytes)")
    got, got_version, meta_len, meta_hash = _PREFIX.unpack_from(buf)
    if got != magic:
        raise ValueError(f"not a tiercache {what} (bad magic {got!r})")
    if got_version != version:
        raise ValueError(f"format version {got_version}, this tiercache reads {version}")
    end = _PREFIX.size + meta_len
    if end > min(len(buf), limit):
        raise ValueError(f"header metadata length {meta_len} out of range")
    meta = bytes(buf[_PREFIX.size:end])
    if xxhash.xxh3_64_intdigest(meta) != meta_hash:
        raise ValueError("header metadata checksum mismatch (torn or corrupt header)")
    return got_version, meta, end


def decode_header(buf: bytes, where: str = "block file") -> BlockHeader:
    """Parse and check a header read from the start of a block file.

    Raises:
        CorruptBlockError: short read, wrong magic, unknown version, metadata that does not
            match its hash or is not the expected JSON.
    """
    try:
        version, meta, _ = checked_metadata(buf, MAGIC, FORMAT_VERSION, DATA_OFFSET, "block file")
    except ValueError as exc:
        raise CorruptBlockError(f"{where}: {exc}") from None
    try:
        d = json.loads(meta)
        return BlockHeader(
            key=key_from_text(d["key"]),
            pool=str(d["pool"]),
            dtype=str(d["dtype"]),
            block_shape=tuple(int(x) for x in d["block_shape"]),
            nbytes=int(d["nbytes"]),
            checksum=int(d["checksum"], 16),
            version=version,
            extra=dict(d.get("extra") or {}),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptBlockError(f"{where}: malformed header metadata ({exc})") from None


@functools.lru_cache(maxsize=256)
def _meta_tail(name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> bytes:
    """The metadata that :func:`encode_header` writes after a key for this geometry, up to the
    checksum's hex digits."""
    return json.dumps({"pool": name, "dtype": dtype, "block_shape": list(shape), "nbytes": nbytes,
                       "checksum_algo": CHECKSUM_ALGO, "checksum": ""}, separators=(",", ":"))[1:-2].encode()


def usual_header_tail(pool: PoolSpec) -> bytes:
    """The metadata text :func:`encode_header` writes for a block of ``pool`` (no ``extra``)
    after ``{"key":"<key text>",``, up to the checksum's 16 hex digits (which are followed by
    ``"}``): what the native checks of ``verify`` and ``purge`` compare (``kernels/blockio.c``,
    ``CHECK`` reads)."""
    return _meta_tail(pool.name, pool.dtype, pool.block_shape, pool.block_nbytes)


def _meta_head(key: Key, pool: PoolSpec) -> bytes:
    """What :func:`encode_header` writes as metadata before the checksum's hex digits (no
    ``extra``): ``{"key":"...","pool":...,"checksum":"``."""
    return b'{"key":"' + key_text(key).encode() + b'",' + usual_header_tail(pool)


def header_checksum(buf, key: Key, pool: PoolSpec, where: str) -> int:
    """The data checksum of a block file's header ``buf`` (its first :data:`DATA_OFFSET`
    bytes), checked to be a tiercache header of ``key`` in ``pool`` with the pool's geometry.

    The usual header (no ``extra``) is checked by comparing its bytes with the ones
    :func:`encode_header` writes for ``key`` and ``pool`` (byte equality: every field equal),
    with no JSON parse; any other header goes through :func:`decode_header` and
    :func:`check_header`, which also name what is wrong.

    Raises:
        CorruptBlockError: as :func:`decode_header` and :func:`check_header`.
    """
    if len(buf) >= _PREFIX.size:
        magic, version, meta_len, meta_hash = _PREFIX.unpack_from(buf)
        head = _meta_head(key, pool)
        end = _PREFIX.size + meta_len
        if (magic == MAGIC and version == FORMAT_VERSION and meta_len == len(head) + 18 and end <= len(buf)):
            meta = bytes(buf[_PREFIX.size:end])
            digits = meta[len(head):-2]
            if (meta.startswith(head) and meta.endswith(b'"}') and _HEX16.fullmatch(digits)
                    and xxhash.xxh3_64_intdigest(meta) == meta_hash):
                return int(digits, 16)
    header = decode_header(bytes(buf), where)
    check_header(header, key, pool, where)
    return header.checksum


_HEX16 = re.compile(rb"[0-9a-f]{16}")


def check_header(header: BlockHeader, key: Key, pool: PoolSpec, where: str) -> None:
    """Check that a header belongs to ``key`` in ``pool`` with the pool's geometry.

    Raises:
        CorruptBlockError: key, pool, dtype, shape or size differ.
    """
    expected = (key, pool.name, pool.dtype, pool.block_shape, pool.block_nbytes)
    got = (header.key, header.pool, header.dtype, header.block_shape, header.nbytes)
    if got != expected:
        names = ("key", "pool", "dtype", "block_shape", "nbytes")
        diffs = [f"{n} {g!r} (expected {e!r})" for n, g, e in zip(names, got, expected) if g != e]
        raise CorruptBlockError(f"{where}: wrong geometry: {', '.join(diffs)}")
