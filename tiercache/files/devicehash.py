"""Block checksums computed where the data is: XXH3-64 of rows of device memory.

A block file's header carries the XXH3-64 (seed 0) of its data. Where a block's bytes are in
VRAM (read there by kvikio/GDS, or sent up from pinned staging before their check), copying
them back to the host only to hash them costs a PCIe round trip and a core's time per block:
about 0.45 ms of CPU per 2 MiB block on the H200 test machine (docs/performance/vllm.md, "A load
taken apart"). ``kernels/xxh3.cu`` computes the same function on the GPU, bit-exact with the xxhash
library for inputs of more than :data:`LONG_FORM_MIN` - 1 bytes (XXH3's long form, which every
block of a KV cache is); shorter inputs, and rows not on 8-byte boundaries, stay with the host
(:func:`applies`).

Algorithm: XXH3 by Yann Collet (https://github.com/Cyan4973/xxHash), split for a GPU as the
kernel's comment says. The secret is the library's own default (``XXH3_generateSecret_fromSeed``
with seed 0, from the ``xxhash`` package's extension), checked at first use against the
library's hash of a probe.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

#: the shortest input XXH3-64 hashes by its long form (the only form the kernel has), bytes
LONG_FORM_MIN = 241
_BLOCK = 1024  # bytes per block of the default secret's 16 stripes
_WARPS = 8  # warps per thread block of the per-block sums
_MAX_GRID_Y = 65535


@functools.cache
def default_secret() -> bytes | None:
    """XXH3's default 192-byte secret, from the xxhash library in the ``xxhash`` package
    (``XXH3_generateSecret_fromSeed(seed=0)``); None where that library does not export it or
    the secret does not reproduce its hash of a probe."""
    try:
        import xxhash
        import xxhash._xxhash as ext

        lib = ctypes.CDLL(ext.__file__)
        gen, with_secret = lib.XXH3_generateSecret_fromSeed, lib.XXH3_64bits_withSecret
    except (ImportError, OSError, AttributeError):
        return None
    buf = ctypes.create_string_buffer(192)
    gen.argtypes, gen.restype = [ctypes.c_void_p, ctypes.c_uint64], None
    gen(buf, 0)
    secret = buf.raw
    with_secret.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
    with_secret.restype = ctypes.c_uint64
    probe = bytes(range(256)) * 3
    if with_secret(probe, len(probe), secret, len(secret)) != xxhash.xxh3_64_intdigest(probe):
        return None
    return secret


def applies(nbytes: int, address: int = 0, pitch: int = 0) -> bool:
    """Whether rows of ``nbytes`` bytes starting at device ``address``, ``pitch`` bytes apart,
    can be hashed on the GPU: the long form (``nbytes >= LONG_FORM_MIN``), 8-byte aligned
    rows, and the library's secret at hand."""
    return nbytes >= LONG_FORM_MIN and address % 8 == 0 and pitch % 8 == 0 and default_secret() is not None


class DeviceHasher:
    """XXH3-64 of rows of device memory on device ``device_id`` (the kernels compile on
    first use).

    Raises:
        RuntimeError: the xxhash library's secret is not available (see :func:`applies`).
    """

    def __init__(self, device_id: int = 0) -> None:
        import cupy

        from tiercache.kernels.loader import get_kernel

        secret = default_secret()
        if secret is None:
            raise RuntimeError("XXH3's default secret is not available from the xxhash package")
        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            self.secret = cupy.asarray(np.frombuffer(secret, dtype=np.uint8))
            self._blocks = get_kernel("xxh3.cu", "tc_xxh3_blocks", device_id)
            self._finish = get_kernel("xxh3.cu", "tc_xxh3_finish", device_id)

    def hash_rows(self, rows, out, stream=None) -> None:
        """Enqueue ``out[i] = XXH3-64(rows[i])`` on ``stream`` (a CuPy stream; None: the
        current one); returns at once.

        Args:
            rows: device bytes ``[n, row_bytes]`` (CuPy ``uint8``, or anything ``cupy.asarray``
                takes without a copy, such as a CUDA tensor), rows contiguous, 8-byte aligned,
                ``row_bytes >= LONG_FORM_MIN``; the row pitch may exceed ``row_bytes``.
            out: device ``[n]`` of 64-bit words (``uint64`` or ``int64``) the checksums go to.

        Raises:
            ValueError: rows that :func:`applies` refuses, or ``out`` of the wrong size.
        """
        import cupy

        rows = cupy.asarray(rows)
        out = cupy.asarray(out)
        if rows.ndim != 2 or rows.dtype != cupy.uint8 or rows.strides[1] != 1:
            raise ValueError(f"rows of shape {rows.shape}, dtype {rows.dtype}: give [n, row_bytes] uint8 rows")
        n, nbytes = rows.shape
        pitch = rows.strides[0] if n > 1 else nbytes + (-nbytes % 8)
        if not applies(nbytes, rows.data.ptr, pitch):
            raise ValueError(f"rows of {nbytes} bytes at {rows.data.ptr:#x}, {pitch} bytes apart: the GPU hashes "
                             f"rows of at least {LONG_FORM_MIN} bytes on 8-byte boundaries")
        if out.shape != (n,) or out.itemsize != 8:
            raise ValueError(f"out of shape {out.shape} and dtype {out.dtype}: give [{n}] 64-bit words")
        if n == 0:
            return
        nblocks = (nbytes - 1) // _BLOCK
        stream = stream if stream is not None else cupy.cuda.get_current_stream()
        with cupy.cuda.Device(self.device_id), stream:
            part = cupy.empty(max(1, n * nblocks * 8), dtype=cupy.uint64)  # the stream's own pool memory
            splits = max(1, -(-nblocks // (_WARPS * 4)))
            for r0 in range(0, n, _MAX_GRID_Y):
                m = min(_MAX_GRID_Y, n - r0)
                base = rows.data.ptr + r0 * pitch
                sums = part.data.ptr + r0 * nblocks * 64
                if nblocks:
                    self._blocks((splits, m), (_WARPS * 32,), (np.uint64(base), np.int64(pitch), np.int64(nblocks),
                                                               self.secret, np.uint64(sums)), stream=stream)
                self._finish((m,), (256,), (np.uint64(base), np.int64(pitch), np.int64(nbytes), np.int64(nblocks),
                                            self.secret, np.uint64(sums), np.uint64(out.data.ptr + r0 * 8)),
                             stream=stream)


_hashers: dict[int, DeviceHasher] = {}
_hashers_lock = threading.Lock()


def hasher(device_id: int = 0) -> DeviceHasher:
    """The process's :class:`DeviceHasher` of ``device_id`` (made once)."""
    with _hashers_lock:
        h = _hashers.get(device_id)
        if h is None:
            h = _hashers[device_id] = DeviceHasher(device_id)
        return h


def device_checksums(rows, stream=None) -> np.ndarray:
    """XXH3-64 of each row of device ``rows`` (as :meth:`DeviceHasher.hash_rows` takes them),
    computed on the GPU and returned once done: ``uint64 [n]``."""
    import cupy

    rows = cupy.asarray(rows)
    out = cupy.empty(rows.shape[0], dtype=cupy.uint64)
    stream = stream if stream is not None else cupy.cuda.get_current_stream()
    hasher(rows.device.id).hash_rows(rows, out, stream)
    host = np.empty(rows.shape[0], dtype=np.uint64)
    out.get(stream=stream, out=host)
    stream.synchronize()
    return host
