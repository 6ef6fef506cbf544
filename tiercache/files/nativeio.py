"""The native I/O engine: batches of block-file operations run by a pool of C threads.

``kernels/blockio.c`` (built once per machine with the C compiler, loaded with :mod:`ctypes`)
reads, writes or renames the files of a whole request in one call: each file is opened,
read or written with one vectored call (header page and data), optionally flushed, closed
and renamed by the pool's threads, outside the GIL. Python keeps one call per request, and
per file only what it must (the header's bytes and the XXH3-64 checksum).

Why: with one Python thread per file (the ``python`` engine), 64 KiB random reads stopped at
about a fifth of fio on the same disk; the same open/preadv/close loop in C threads reaches
fio (docs/experiments/files.md, "File tier against fio").

Engines (``[file] io_engine``; fio's ``ioengine`` names where they match):

==========  ================================================================================
auto        ``io_uring`` where a ring can be set up here, else ``threads``, else ``python``
            where the C library cannot be built (logged once)
io_uring    the thread that runs a chunk queues its files' opens, reads/writes and flushes on
            its own io_uring ring (raw system calls, no liburing): the files of a chunk are
            in flight together with no thread switch per file
threads     the C pool's threads each run whole files with blocking syscalls (psync-like)
python      one Python task per block on tiercache's I/O threads (``posix_io``)
==========  ================================================================================
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import functools
import os
import threading

import numpy as np

from tiercache.arrays import host_address
from tiercache.errors import ConfigError
from tiercache.settings import IO_ENGINES

READ, WRITE, RENAME, HASHONLY, UNLINK = 0, 1, 2, 3, 4
DIRECT, FDATASYNC, PUBLISH, KEEP, EXCHANGE, KEEP_DIRECT, HASH, CHECK, MAKEHEAD = 1, 2, 4, 8, 16, 32, 64, 128, 256
#: an ``UNLINK`` of an evicted file whose descriptor is held: renamed to its final name (a
#: free file's temporary name) where the name still holds ``Ops.kept_ino``; ``got`` 1 then
RECYCLE = 512
#: an ``UNLINK`` whose ``Ops.fd`` (the deleted file's unused descriptor) is closed after it
DROP_FD = 1024
#: with ``CHECK``: check the header and size only, and give the header's data checksum in
#: ``Ops.hash`` (the caller compares it, e.g. on the GPU: :mod:`tiercache.files.devicehash`);
#: with ``MAKEHEAD``: the header takes the data checksum the caller put in ``Ops.hash``, and the
#: data is not hashed
SUMONLY = 2048
#: ``Ops.kept_flags`` bits: the kept descriptor is O_DIRECT / O_RDWR
KEPT_DIRECT, KEPT_RDWR = 1, 2
#: an operation's error code: the name is a symlink, directory, FIFO or other non-regular file
NOT_REGULAR = -1
HEADER_BYTES = 4096


class _Batch(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32), ("dir_fd", ctypes.c_int32), ("names", ctypes.c_void_p),
        ("name_off", ctypes.c_void_p), ("final_off", ctypes.c_void_p), ("flags", ctypes.c_void_p),
        ("head", ctypes.c_void_p), ("data", ctypes.c_void_p), ("data_len", ctypes.c_void_p),
        ("file_len", ctypes.c_void_p), ("err", ctypes.c_void_p), ("got", ctypes.c_void_p), ("fd", ctypes.c_void_p),
        ("dirs", ctypes.c_void_p), ("hash", ctypes.c_void_p),
        ("expect", ctypes.c_void_p), ("expect_len", ctypes.c_void_p), ("nbytes", ctypes.c_void_p),
        ("verdict", ctypes.c_void_p), ("kept_ino", ctypes.c_void_p), ("kept_size", ctypes.c_void_p),
        ("kept_flags", ctypes.c_void_p), ("seg_first", ctypes.c_void_p), ("seg_ptr", ctypes.c_void_p),
        ("seg_len", ctypes.c_void_p), ("span_off", ctypes.c_void_p),
    ]


@functools.cache
def _xxh3_address() -> int | None:
    """The address of ``XXH3_64bits`` in the ``xxhash`` package's extension (the same
    function :func:`tiercache.files.blockfile.checksum` calls), or None where it is not
    exported."""
    try:
        import xxhash._xxhash as ext

        lib = ctypes.CDLL(ext.__file__)
    except (ImportError, OSError):
        return None
    # the dispatching entry picks the CPU's widest vector unit (AVX-512 or AVX2 where present:
    # 10.4 against 7.8 GB/s from memory on the CPU machine); the plain one is SSE2
    fn = getattr(lib, "XXH3_64bits_dispatch", None) or getattr(lib, "XXH3_64bits", None)
    if fn is None:
        return None
    fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_size_t]
    probe = b"tiercache"
    import xxhash

    if fn(probe, len(probe)) != xxhash.xxh3_64_intdigest(probe):
        return None
    return ctypes.cast(fn, ctypes.c_void_p).value


@functools.cache
def _xxh3_stream() -> tuple[int, ...] | None:
    """The addresses of XXH3-64's streaming functions in the same extension (create, reset,
    update, digest, free: a block in pieces, :attr:`Ops.seg_first`), checked against the
    one-shot digest of two pieces; None where they are not exported."""
    try:
        import xxhash._xxhash as ext

        lib = ctypes.CDLL(ext.__file__)
        fns = [getattr(lib, n) for n in ("XXH3_createState", "XXH3_64bits_reset", "XXH3_64bits_update",
                                         "XXH3_64bits_digest", "XXH3_freeState")]
    except (ImportError, OSError, AttributeError):
        return None
    create, reset, update, digest, free = fns
    create.restype, digest.restype = ctypes.c_void_p, ctypes.c_uint64
    reset.argtypes, free.argtypes, digest.argtypes = [ctypes.c_void_p], [ctypes.c_void_p], [ctypes.c_void_p]
    update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    import xxhash

    st = create()
    if not st:
        return None
    try:
        reset(st)
        for part in (b"tier", b"cache"):
            update(st, part, len(part))
        if digest(st) != xxhash.xxh3_64_intdigest(b"tiercache"):
            return None
    finally:
        free(st)
    return tuple(ctypes.cast(f, ctypes.c_void_p).value or 0 for f in fns)


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library or None, why)."""
    try:
        from tiercache.kernels.hostlib import HostLibError, load
    except ImportError as exc:  # pragma: no cover - a broken install
        return None, f"tiercache.kernels is missing ({exc})"
    try:
        lib = load("blockio.c")
    except HostLibError as exc:
        return None, str(exc)
    lib.tc_pool_create.restype = ctypes.c_void_p
    lib.tc_pool_create.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.tc_pool_uring.argtypes = [ctypes.c_void_p]
    lib.tc_pool_destroy.argtypes = [ctypes.c_void_p]
    lib.tc_pool_threads.argtypes = [ctypes.c_void_p]
    lib.tc_run.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Batch), ctypes.c_int]
    lib.tc_set_fault.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    lib.tc_set_uring_meta.argtypes = [ctypes.c_int]
    lib.tc_set_hash.argtypes = [ctypes.c_void_p]
    lib.tc_block_names.restype = ctypes.c_int64
    lib.tc_block_names.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.tc_int_block_names.restype = ctypes.c_int64
    lib.tc_int_block_names.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.tc_set_hash(_xxh3_address())
    lib.tc_set_hash_stream.argtypes = [ctypes.c_void_p] * 5
    stream = _xxh3_stream()
    if stream is not None:
        lib.tc_set_hash_stream(*stream)
    return lib, "kernels/blockio.c built and loaded"


def native_hash() -> bool:
    """Whether the native engine computes XXH3-64 itself (``HASH`` reads, ``HASHONLY``
    batches): the ``xxhash`` extension exports ``XXH3_64bits``."""
    return _library()[0] is not None and _xxh3_address() is not None


def native_pieces() -> bool:
    """Whether the native engine reads and writes blocks in pieces (:attr:`Ops.seg_first`):
    :func:`native_hash` and XXH3-64's streaming functions in the ``xxhash`` extension."""
    return native_hash() and _xxh3_stream() is not None


def native_status() -> tuple[bool, str]:
    """(whether the native engine can run in this process, why / why not)."""
    lib, why = _library()
    return lib is not None, why


@functools.cache
def uring_status() -> tuple[bool, str]:
    """(whether io_uring rings can be set up in this process, why / why not)."""
    lib, why = _library()
    if lib is None:
        return False, why
    pool = lib.tc_pool_create(0, 1)
    try:
        if lib.tc_pool_uring(pool):
            return True, "io_uring rings set up"
    finally:
        lib.tc_pool_destroy(pool)
    return False, "io_uring unavailable (old kernel, seccomp filter or kernel.io_uring_disabled)"


#: C threads per root (device) of a file tier on the ``threads`` engine, at the least: a request
#: of 32 blocks has its files in flight on as many threads, across every member of a root array
#: (fio needed 32-128 I/Os in flight to reach four RAM-backed devices' best)
NATIVE_THREADS_PER_ROOT = 16


def native_threads(engine: str, io_threads: int, roots: int) -> int:
    """The C threads of a file tier's native engine: ``io_threads``, and on the ``threads``
    engine at least :data:`NATIVE_THREADS_PER_ROOT` per root (at most 256). Idle threads
    wait on a condition variable; the ``io_uring`` engine's threads only compute checksums."""
    if engine != "threads":
        return io_threads
    return min(256, max(io_threads, NATIVE_THREADS_PER_ROOT * roots))


def choose_engine(mode: str) -> tuple[str, str]:
    """The engine ``mode`` (one of :data:`IO_ENGINES`) gives here: ``(name, reason)``.

    Raises:
        ConfigError: an unknown mode, or an engine that cannot run here.
    """
    if mode not in IO_ENGINES:
        raise ConfigError(f"io_engine = {mode!r}; valid: {', '.join(IO_ENGINES)}")
    if mode == "python":
        return "python", "io_engine = python"
    ok, why = native_status()
    if not ok:
        if mode != "auto":
            raise ConfigError(f"io_engine = {mode!r} but the native I/O library cannot be built: {why}; "
                              "install a C compiler or use io_engine = 'auto' or 'python'")
        return "python", f"native I/O unavailable ({why})"
    if mode == "threads":
        return "threads", "io_engine = threads"
    if mode == "auto":
        # the C threads spread a request's files and their checks over cores; a ring runs them
        # on the thread that drives it: one 32-block request of 256 KiB blocks read 3.6x and
        # wrote 3.4x faster on the threads on an H200 machine with 16 cores (tmpfs, 2026-11-27;
        # benchmarks/request_python.py), and with four requests in flight they were even
        return "threads", "io_engine = auto: the C threads"
    ring, why = uring_status()
    if ring:
        return "io_uring", why
    raise ConfigError(f"io_engine = 'io_uring' but {why}; use io_engine = 'auto' or 'threads'")


def block_names(keys: list, pool: str, fanout: int) -> tuple[ctypes.Array, np.ndarray, np.ndarray]:
    """The file names of ``keys`` in ``pool``, made in C (``tc_block_names`` for bytes keys,
    ``tc_int_block_names`` for int keys; the same names as
    :func:`~tiercache.files.blockfile.block_location`, which spells them for a request that
    mixes the two): ``(blob, offsets, subdirs)``, the NUL-terminated names back to back in
    ``blob``, ``offsets`` (``int64 [n]``) where each starts, and ``subdirs`` (``int32 [n]``)
    each key's subdirectory number (XXH3-64 of its text modulo ``fanout``). One call per
    request instead of a key's text, hash and name in Python per block.

    Raises:
        ConfigError: the native library or its XXH3-64 is unavailable.
        ValueError: a bytes key that is not 1..64 bytes, an int key outside ``[0, 2**63)``.
    """
    lib, why = _library()
    if lib is None:
        raise ConfigError(f"native I/O unavailable: {why}")
    n = len(keys)
    p = pool.encode()
    offs = np.empty(n, np.int64)
    subs = np.empty(n, np.int32)
    kinds = {type(k) for k in keys}
    if kinds == {int}:
        ints = np.array(keys, np.int64) if all(0 <= k < 1 << 63 for k in keys) else None
        if ints is None:
            raise ValueError(f"int block key outside [0, 2**63) among {keys[:4]!r}")
        cap = n * (20 + 18 + len(p))
        blob = ctypes.create_string_buffer(max(cap, 1))
        got = lib.tc_int_block_names(ints.ctypes.data, n, p, fanout, blob, cap, offs.ctypes.data, subs.ctypes.data)
    elif kinds <= {bytes}:
        key_off = np.zeros(n + 1, np.int64)
        np.cumsum(np.fromiter(map(len, keys), np.int64, n), out=key_off[1:])
        cap = int(2 * key_off[-1]) + n * (18 + len(p))
        blob = ctypes.create_string_buffer(max(cap, 1))
        got = lib.tc_block_names(b"".join(keys), key_off.ctypes.data, n, p, fanout, blob, cap, offs.ctypes.data,
                                 subs.ctypes.data)
    else:  # a mix of int and bytes keys: spelled in Python
        import xxhash

        from tiercache.files.blockfile import block_filename
        from tiercache.keys import key_text

        texts = [key_text(k) for k in keys]
        raw = [block_filename(k, pool).encode() + b"\0" for k in keys]
        blob = ctypes.create_string_buffer(b"".join(raw), max(sum(map(len, raw)), 1))
        offs[0], offs[1:] = 0, np.cumsum(np.fromiter(map(len, raw[:-1]), np.int64, n - 1))
        subs[:] = [xxhash.xxh3_64_intdigest(t.encode()) % fanout for t in texts]
        return blob, offs, subs
    if got < 0:
        if not native_hash():
            raise ConfigError("native block names need the xxhash extension's XXH3_64bits")
        bad = next((k for k in keys if isinstance(k, bytes) and not 1 <= len(k) <= 64), None)
        raise ValueError(f"block key {bad!r}: keys are 1..64 bytes")
    return blob, offs, subs


def uring_meta() -> bool:
    """Whether io_uring rings here publish (rename) and unlink files themselves
    (``IORING_OP_RENAMEAT`` / ``IORING_OP_UNLINKAT``, Linux 5.11+): then the ``io_uring``
    engine's writes publish on the ring, and its rename and unlink batches (group commits,
    evictions, purges) run there, in parallel in the kernel, rather than as system calls."""
    lib, _ = _library()
    return bool(lib is not None and lib.tc_uring_meta())


def set_uring_meta(on: bool) -> None:
    """Turn renames and unlinks on io_uring (:func:`uring_meta`) on or off for the process (on by
    default; off: direct system calls, as on kernels before 5.11). For A/B measurements and
    tests of both paths."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(why)
    lib.tc_set_uring_meta(int(on))


def set_fault(kind: int, match: str, err: int, times: int = -1) -> None:
    """Test hook (fault injection in ``kernels/blockio.c``): operations of ``kind``
    (:data:`READ`, :data:`WRITE` or :data:`RENAME`) on a file whose name contains ``match``
    fail with errno ``err`` after the file is opened, ``times`` times (-1: until
    :func:`clear_faults`); a :data:`RENAME` rule also fails a write's own publication of a
    file whose final name contains ``match``. Up to 16 rules."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(why)
    lib.tc_set_fault(kind, match.encode(), err, times)


def clear_faults() -> None:
    """Remove every rule of :func:`set_fault`."""
    lib, _ = _library()
    if lib is not None:
        lib.tc_set_fault(-1, b"", 0, 0)


class Ops:
    """One batch being built: per operation a name (and final name), flags, a header page,
    a data pointer and lengths, a descriptor (:attr:`fd`, -1: open the name; see
    ``kernels/blockio.c`` on ``KEEP`` and ``EXCHANGE``), the directory of its names
    (:attr:`dirs`, a descriptor; unset: the batch's ``dir_fd``) and the XXH3-64 of its data
    (:attr:`hash`: ``HASH`` reads, ``HASHONLY`` batches). Header pages live in :attr:`heads`
    (``uint8 [n, 4096]``, page-aligned).

    ``MAKEHEAD`` writes make each header page in C: the usual header of the key in the
    final name, with :attr:`expect` after the key and the data's XXH3-64 (also left in
    :attr:`hash`). ``CHECK`` reads (:meth:`expect_usual`) also compare each header with the usual header of
    the key in the operation's name: :attr:`expect` (addresses of the metadata text after the
    key), :attr:`expect_len`, :attr:`nbytes` (the block's bytes) and, out, :attr:`verdict`
    (1: header, size and data checksum all match; 0: not judged, or not matching)."""

    def __init__(self, n: int, heads: np.ndarray) -> None:
        self.n = n
        self.names: list[bytes] = []
        self.finals: list[bytes] = []
        #: names made in C (:func:`block_names`): the blob and each name's offset, used instead
        #: of :attr:`names` when set (reads)
        self.name_blob: ctypes.Array | None = None
        self.name_off: np.ndarray | None = None
        #: with them, each name's block subdirectory by number (``int32``)
        self.subs: np.ndarray | None = None
        self.flags = np.zeros(n, np.int32)
        self.data = np.zeros(n, np.uint64)
        self.data_len = np.zeros(n, np.int64)
        self.file_len = np.zeros(n, np.int64)
        self.heads = heads
        self.err = np.zeros(n, np.int32)
        self.got = np.zeros(n, np.int64)
        self.fd = np.full(n, -1, np.int32)
        self.dirs: np.ndarray | None = None
        self.hash = np.zeros(n, np.uint64)
        self.expect: np.ndarray | None = None
        self.expect_len: np.ndarray | None = None
        self.nbytes: np.ndarray | None = None
        self.verdict: np.ndarray | None = None
        #: out, per descriptor kept by ``KEEP``: inode number, size in bytes, ``KEPT_DIRECT`` |
        #: ``KEPT_RDWR`` (the native engine describes it: no ``fstat``/``fcntl`` in Python)
        self.kept_ino = np.zeros(n, np.int64)
        self.kept_size = np.zeros(n, np.int64)
        self.kept_flags = np.zeros(n, np.int32)
        #: a block in pieces (:meth:`set_pieces`): operation ``i``'s data is pieces
        #: ``seg_first[i] .. seg_first[i + 1] - 1`` (``seg_ptr`` addresses, ``seg_len`` bytes),
        #: read into and written from in place; None: each operation's :attr:`data`
        self.seg_first: np.ndarray | None = None
        self.seg_ptr: np.ndarray | None = None
        self.seg_len: np.ndarray | None = None
        #: span reads (``int64``; None: whole blocks): operation ``i`` reads its header page and
        #: :attr:`data_len` ``[i]`` bytes of its data from data byte ``span_off[i]`` on
        self.span_off: np.ndarray | None = None

    def set_pieces(self, addresses: np.ndarray, piece_bytes: int) -> None:
        """Operation ``i``'s data is ``addresses[i, j]`` (``[n, k]``, ``j`` in order) of
        ``piece_bytes`` bytes each (needs :func:`native_pieces`)."""
        n, k = addresses.shape
        self.seg_first = np.arange(0, n * k + 1, k, dtype=np.int64)
        self.seg_ptr = np.ascontiguousarray(addresses, dtype=np.uint64).reshape(-1)
        self.seg_len = np.full(n * k, piece_bytes, np.int64)
        self.data[:] = self.seg_ptr[::k]

    def expect_usual(self) -> None:
        """Give this batch the arrays of ``CHECK`` reads (zeroed: no operation checked until
        its flag, expect address and length are set)."""
        n = self.n
        self.expect = np.zeros(n, np.uint64)
        self.expect_len = np.zeros(n, np.int32)
        self.nbytes = np.zeros(n, np.int64)
        self.verdict = np.zeros(n, np.int32)


def error_for(code: int, where: str) -> OSError:
    """The exception of an operation's error code (errno or :data:`NOT_REGULAR`)."""
    from tiercache.files.rootdir import NotRegularFileError

    if code == NOT_REGULAR:
        return NotRegularFileError(errno_mod.EINVAL, f"{where}: not a regular file (a symlink, directory or FIFO)")
    exc_type = FileNotFoundError if code == errno_mod.ENOENT else OSError
    return exc_type(code, os.strerror(code), where)


class NativeIO:
    """A pool of ``threads`` C threads running batches of block-file operations (reads and
    writes on the calling thread's io_uring ring with ``uring``).

    Args:
        threads: worker threads (the calling thread helps too), 1..256.
        uring: run reads and writes on io_uring (where rings can be set up).

    Raises:
        ConfigError: the native library cannot be built or loaded here.
    """

    def __init__(self, threads: int, uring: bool = False) -> None:
        lib, why = _library()
        if lib is None:
            raise ConfigError(f"native I/O unavailable: {why}")
        self._lib = lib
        self._pool = lib.tc_pool_create(threads, int(uring))
        if not self._pool:
            raise MemoryError("tc_pool_create failed")
        self.threads = lib.tc_pool_threads(self._pool)
        self.uring = bool(lib.tc_pool_uring(self._pool))
        self._local = threading.local()
        self._closed = False

    def heads(self, n: int) -> np.ndarray:
        """This thread's page-aligned header pages, ``uint8 [n, 4096]`` (reused per thread:
        valid until the thread's next call)."""
        buf = getattr(self._local, "heads", None)
        if buf is None or buf.shape[0] < n:
            raw = np.empty((max(n, 64) + 1) * HEADER_BYTES, np.uint8)
            start = -raw.ctypes.data % HEADER_BYTES
            buf = raw[start:start + max(n, 64) * HEADER_BYTES].reshape(-1, HEADER_BYTES)
            self._local.heads = buf
        return buf[:n]

    def run(self, kind: int, dir_fd: int, ops: Ops) -> int:
        """Run ``ops`` (kind :data:`READ`, :data:`WRITE`, :data:`RENAME`, :data:`HASHONLY`
        or :data:`UNLINK`) in the directory ``dir_fd`` (or each operation's :attr:`Ops.dirs`); fills
        ``ops.err``, ``ops.got``, (``KEEP``) ``ops.fd``, (``HASH``, ``HASHONLY``)
        ``ops.hash`` and (``CHECK``) ``ops.verdict``. Returns the number that failed."""
        if self._closed:
            raise RuntimeError("NativeIO is closed")
        n = ops.n
        if n == 0:
            return 0
        if ops.name_blob is not None and ops.name_off is not None:
            blob, offs, final_off = ops.name_blob, ops.name_off, None
        else:
            names = ops.names + ops.finals
            lens = np.fromiter((len(s) + 1 for s in names), np.int64, len(names))
            offs = np.zeros(len(names), np.int64)
            np.cumsum(lens[:-1], out=offs[1:])
            blob = ctypes.create_string_buffer(b"\0".join(names) + b"\0")
            final_off = offs[n:] if ops.finals else None
        # addresses through the buffer protocol (host_address): ``.ctypes.data`` costs 2.4 us
        # each on the CPU test machine, and a batch passes seventeen
        head_ptr = host_address(ops.heads) + np.arange(n, dtype=np.uint64) * np.uint64(ops.heads.strides[0])
        b = _Batch(kind, dir_fd, ctypes.addressof(blob), host_address(offs),
                   host_address(final_off) if final_off is not None else None, host_address(ops.flags),
                   host_address(head_ptr), host_address(ops.data), host_address(ops.data_len),
                   host_address(ops.file_len), host_address(ops.err), host_address(ops.got), host_address(ops.fd),
                   host_address(ops.dirs) if ops.dirs is not None else None, host_address(ops.hash),
                   *((host_address(a) if a is not None else None)
                     for a in (ops.expect, ops.expect_len, ops.nbytes, ops.verdict,
                               ops.kept_ino, ops.kept_size, ops.kept_flags, ops.seg_first, ops.seg_ptr, ops.seg_len,
                               ops.span_off)))
        return self._lib.tc_run(self._pool, ctypes.byref(b), n)  # the GIL is released meanwhile

    def close(self) -> None:
        """Stop the threads (after the batches in flight)."""
        if not self._closed:
            self._closed = True
            self._lib.tc_pool_destroy(self._pool)
