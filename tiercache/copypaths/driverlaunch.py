"""Kernel launches, memsets and copies issued straight through the CUDA driver (``libcuda``,
via ctypes) with their arguments packed once: the calls a prepared launch
(:class:`~tiercache.copypaths.copykernels.PreparedLaunch`) replays on every run.

A CuPy ``RawKernel`` call converts and packs its arguments on every launch (about 30 us for
the bulk kernel's eleven NumPy scalars on the H100 machine's host); a :class:`KernelCall`
packs them when it is built and then costs one ``cuLaunchKernel``. The kernels are CuPy's
own (the ``CUfunction`` of a compiled ``RawKernel``), so their attributes (dynamic shared
memory, carveout) carry over.
"""

from __future__ import annotations

import ctypes

import numpy as np

from tiercache.errors import TransferError

CUDA_ERROR_INVALID_CONTEXT = 201

_CTYPE = {np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.int64): ctypes.c_int64,
          np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32}


class _Driver:
    """The few driver entry points used here (None where ``libcuda.so.1`` is missing)."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            self.lib = None
            return
        self.lib = lib
        vp, u32, sz = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t
        lib.cuLaunchKernel.argtypes = [vp, u32, u32, u32, u32, u32, u32, u32, vp, vp, vp]
        lib.cuMemsetD8Async.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, sz, vp]
        lib.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, sz, vp]
        lib.cuMemcpy2DAsync_v2.argtypes = [ctypes.POINTER(_Memcpy2D), vp]
        for fn in (lib.cuLaunchKernel, lib.cuMemsetD8Async, lib.cuMemcpyAsync, lib.cuMemcpy2DAsync_v2):
            fn.restype = ctypes.c_int
        # CUDA 13's signature (no failIdx); older drivers only have the 12.8 one: 2-D copies
        # then go one call each
        self.batch3d = getattr(lib, "cuMemcpy3DBatchAsync_v2", None)
        if self.batch3d is not None:
            self.batch3d.argtypes = [sz, ctypes.c_void_p, ctypes.c_ulonglong, vp]
            self.batch3d.restype = ctypes.c_int


class _Memcpy2D(ctypes.Structure):
    """The driver's ``CUDA_MEMCPY2D``."""

    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
                ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


CU_MEMORYTYPE_UNIFIED = 4


class _Operand(ctypes.Structure):
    """``CUmemcpy3DOperand`` of type pointer: address, row length and layer height in bytes
    (elements of a pointer operand are bytes), a location hint (unused here); the union's
    other member (an array and a 3-D offset) has the same 32 bytes."""

    _fields_ = [("type", ctypes.c_int), ("ptr", ctypes.c_uint64), ("rowLength", ctypes.c_size_t),
                ("layerHeight", ctypes.c_size_t), ("locType", ctypes.c_int), ("locId", ctypes.c_int)]


class _BatchOp(ctypes.Structure):
    """``CUDA_MEMCPY3D_BATCH_OP``."""

    _fields_ = [("src", _Operand), ("dst", _Operand), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t),
                ("depth", ctypes.c_size_t), ("srcAccessOrder", ctypes.c_int), ("flags", ctypes.c_uint)]


CU_MEMCPY_OPERAND_TYPE_POINTER = 1
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1


_DRIVER: _Driver | None = None


def driver() -> _Driver:
    """The loaded driver (loaded once)."""
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER


def available() -> bool:
    """True when ``libcuda.so.1`` loads (direct driver calls can be built)."""
    return driver().lib is not None


def _check(rc: int, what: str, retry) -> None:
    if rc == CUDA_ERROR_INVALID_CONTEXT:  # a thread that never touched the runtime: make its context current
        import cupy

        cupy.cuda.runtime.free(0)
        rc = retry()
    if rc != 0:
        raise TransferError(f"{what} failed with CUresult {rc}")


class KernelCall:
    """One kernel launch with fixed arguments, issued by calling it with a CuPy stream.

    Args:
        kernel: a compiled CuPy ``RawKernel`` (its ``kernel.ptr`` is the ``CUfunction``).
        grid, block: launch dimensions (1 to 3 ints each).
        args: the kernel's arguments as NumPy scalars (``uint64``, ``int64``, ``int32``,
            ``uint32``), in order.
        shared_mem: dynamic shared memory, bytes.

    Raises:
        TypeError: an argument of another type.
    """

    def __init__(self, kernel, grid, block, args: tuple, shared_mem: int = 0) -> None:
        vals = []
        for a in args:
            ct = _CTYPE.get(a.dtype) if isinstance(a, np.generic) else None
            if ct is None:
                raise TypeError(f"kernel argument {a!r} of type {type(a).__name__}: expected a NumPy "
                                "uint64, int64, int32 or uint32 scalar")
            vals.append(ct(int(a)))
        self._lib = driver().lib
        self._f = int(kernel.kernel.ptr)
        g = (tuple(grid) + (1, 1))[:3]
        b = (tuple(block) + (1, 1))[:3]
        self._dims = (*(int(x) for x in g), *(int(x) for x in b), int(shared_mem))
        self._vals = vals  # kept alive: the parameter array points at them
        self._params = (ctypes.c_void_p * len(vals))(*(ctypes.addressof(v) for v in vals))
        self.args = tuple(args)

    def set(self, index: int, value: int) -> None:
        """Change argument ``index`` for the launches that follow (its type stays)."""
        self._vals[index].value = value

    def set_grid(self, x: int) -> None:
        """Change the grid's x dimension for the launches that follow."""
        self._dims = (int(x), *self._dims[1:])

    def __call__(self, stream) -> None:
        """Enqueue the launch on CuPy ``stream``.

        Raises:
            TransferError: the driver refused it (its CUresult).
        """
        launch = self._lib.cuLaunchKernel
        f, dims, params, st = self._f, self._dims, self._params, stream.ptr
        rc = launch(f, *dims, st, params, None)
        if rc:
            _check(rc, "cuLaunchKernel", lambda: launch(f, *dims, st, params, None))


class MemsetCall:
    """``cuMemsetD8Async`` of ``nbytes`` zero bytes at device address ``ptr``."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self._lib = driver().lib
        self.ptr, self.nbytes = int(ptr), int(nbytes)

    def __call__(self, stream) -> None:
        fn, p, n, st = self._lib.cuMemsetD8Async, self.ptr, self.nbytes, stream.ptr
        rc = fn(p, 0, n, st)
        if rc:
            _check(rc, "cuMemsetD8Async", lambda: fn(p, 0, n, st))


class MemcpyCall:
    """``cuMemcpyAsync`` of ``nbytes`` from ``src`` to ``dst`` (unified addresses: device or
    pinned host)."""

    def __init__(self, dst: int, src: int, nbytes: int) -> None:
        self._lib = driver().lib
        self.dst, self.src, self.nbytes = int(dst), int(src), int(nbytes)

    def __call__(self, stream) -> None:
        fn, d, s, n, st = self._lib.cuMemcpyAsync, self.dst, self.src, self.nbytes, stream.ptr
        rc = fn(d, s, n, st)
        if rc:
            _check(rc, "cuMemcpyAsync", lambda: fn(d, s, n, st))


class Memcpy2DCall:
    """``cuMemcpy2DAsync`` of ``height`` rows of ``width`` bytes: row ``i`` from ``src + i *
    src_pitch`` to ``dst + i * dst_pitch`` (unified addresses: device or pinned host; pitches
    >= ``width``). The copy engines take it whole: one call moves a strided run of blocks."""

    def __init__(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int) -> None:
        if min(dst_pitch, src_pitch) < width or width < 1 or height < 1:
            raise ValueError(f"2-D copy of {height} x {width} bytes with pitches {src_pitch} and {dst_pitch}")
        self._lib = driver().lib
        self.dst, self.src, self.width, self.height = int(dst), int(src), int(width), int(height)
        self.nbytes = self.width * self.height
        self._p = _Memcpy2D(srcMemoryType=CU_MEMORYTYPE_UNIFIED, srcDevice=int(src), srcPitch=int(src_pitch),
                            dstMemoryType=CU_MEMORYTYPE_UNIFIED, dstDevice=int(dst), dstPitch=int(dst_pitch),
                            WidthInBytes=int(width), Height=int(height))
        self._ref = ctypes.byref(self._p)

    def __call__(self, stream) -> None:
        fn, p, st = self._lib.cuMemcpy2DAsync_v2, self._ref, stream.ptr
        rc = fn(p, st)
        if rc:
            _check(rc, "cuMemcpy2DAsync", lambda: fn(p, st))


class Memcpy2DBatch:
    """Several 2-D copies (:class:`Memcpy2DCall`'s arguments) in one ``cuMemcpy3DBatchAsync``
    call where the driver has it (CUDA 13), else one ``cuMemcpy2DAsync`` each: the host cost
    of a prepared launch then stays one driver call however many strided runs it has.

    Args:
        copies: ``(dst, dst_pitch, src, src_pitch, width, height)`` tuples (bytes; unified
            addresses).
    """

    def __init__(self, copies: list) -> None:
        self.copies = [Memcpy2DCall(*c) for c in copies]
        self.nbytes = sum(c.nbytes for c in self.copies)
        self._fn = driver().batch3d if copies else None
        if self._fn is not None:
            ops = (_BatchOp * len(copies))()
            for op, (dst, dp, src, sp, width, height) in zip(ops, copies):
                op.src = _Operand(CU_MEMCPY_OPERAND_TYPE_POINTER, int(src), int(sp), int(height), 0, 0)
                op.dst = _Operand(CU_MEMCPY_OPERAND_TYPE_POINTER, int(dst), int(dp), int(height), 0, 0)
                op.width, op.height, op.depth = int(width), int(height), 1
                op.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
            self._ops, self._n, self._p = ops, len(copies), ctypes.addressof(ops)

    def __call__(self, stream) -> None:
        if self._fn is None:
            for c in self.copies:
                c(stream)
            return
        fn, n, p, st = self._fn, self._n, self._p, stream.ptr
        rc = fn(n, p, 0, st)
        if rc:
            _check(rc, "cuMemcpy3DBatchAsync", lambda: fn(n, p, 0, st))
