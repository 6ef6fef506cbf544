"""The engine's own KV-cache tensors, registered as the device tier without copying.

An engine allocates its KV cache once and addresses it by block id. :class:`DevicePools`
wraps those tensors (PyTorch, CuPy, anything with ``__cuda_array_interface__`` or DLPack) as
tiercache pools: each tensor ``[num_blocks, *block_shape]`` is one pool, its leading axis the
engine's block ids (the device slots). Nothing is copied; tiercache reads and writes the
engine's memory in place.

Layouts used in the field have helpers:

=================  =====================================================  ====================
helper             tensors (per pool)                                     layers
=================  =====================================================  ====================
:meth:`vllm`       one per layer ``[num_blocks, 2, block_size, heads, d]``  one pool per layer
:meth:`trtllm`     one ``[num_blocks, layers, kv_factor, heads, tpb, d]``   a slice of each block
:meth:`fastdeploy` K and V per layer ``[num_blocks, heads, block_size, d]`` two pools per layer
:meth:`mla`        one per layer ``[num_blocks, block_size, latent_dim]``   one pool per layer
=================  =====================================================  ====================

A *layer* is what layer-wise onboarding completes at once: whole blocks of some pools, or
(for one pool holding all layers, TensorRT-LLM style) the ``i``-th of ``num_layers`` equal
slices of every block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tiercache.dtypes import canonical_dtype
from tiercache.errors import ArrayMismatchError, ConfigError
from tiercache.geometry import PoolSpec
from tiercache.memory import MemoryTier

#: registered tensors must start on this boundary (bytes): 16-byte vector copies and cuFile
ALIGNMENT = 16


@dataclass(frozen=True)
class LayerPart:
    """One piece of a layer: part ``index`` of ``parts`` equal slices of each block of
    ``pool`` (``parts == 1``: whole blocks). ``spec`` is the geometry of one piece (its token
    axis drives partial copies)."""

    pool: str
    parts: int
    index: int
    spec: PoolSpec


@dataclass
class _Registered:
    spec: PoolSpec
    raw: object  # uint8 [num_blocks, block_nbytes], CuPy (device) or NumPy (host)
    tensor: object  # the caller's object, kept alive


def _torch_info(t, name: str):
    dtype = _dtype(t.dtype, name)
    if not t.is_contiguous():
        raise ArrayMismatchError(f"pool {name!r}: tensor with strides {tuple(t.stride())} is not contiguous; "
                                 "register a contiguous tensor (each block must be one run of bytes)")
    where = t.device.index if t.is_cuda else None
    if t.device.type not in ("cuda", "cpu"):
        raise ArrayMismatchError(f"pool {name!r}: tensor on {t.device}; only CUDA (or CPU) tensors can be registered")
    return tuple(t.shape), dtype, int(t.data_ptr()), where


def _dtype(dtype, name: str) -> str:
    try:
        return canonical_dtype(dtype)
    except ConfigError as exc:
        raise ArrayMismatchError(f"pool {name!r}: {exc} (packed sub-byte types cannot be split into tokens)") from None


def _cupy_info(a, name: str):
    if not a.flags.c_contiguous:
        raise ArrayMismatchError(f"pool {name!r}: array with strides {a.strides} is not C-contiguous")
    return tuple(a.shape), _dtype(a.dtype, name), int(a.data.ptr), a.device.id


def _cai_info(obj, name: str, dtype):
    cai = obj.__cuda_array_interface__
    shape = tuple(int(x) for x in cai["shape"])
    try:
        np_dtype = np.dtype(cai["typestr"])
    except TypeError:
        np_dtype = None
    dt = _dtype(dtype if dtype is not None else np_dtype if np_dtype is not None and np_dtype.kind != "V"
                else cai["typestr"], name)
    strides = cai.get("strides")
    if strides is not None:
        from tiercache.dtypes import ITEMSIZE

        want, acc = [], ITEMSIZE[dt]
        for d in reversed(shape):
            want.append(acc)
            acc *= d
        if tuple(strides) != tuple(reversed(want)):
            raise ArrayMismatchError(f"pool {name!r}: strides {tuple(strides)} are not C-contiguous")
    ptr = int(cai["data"][0])
    import cupy

    dev = cupy.cuda.runtime.pointerGetAttributes(ptr).device if ptr else None
    return shape, dt, ptr, dev


def _host_info(a, name: str):
    a = np.asarray(a)
    if not a.flags.c_contiguous:
        raise ArrayMismatchError(f"pool {name!r}: array with strides {a.strides} is not C-contiguous")
    return tuple(a.shape), _dtype(a.dtype, name), int(a.ctypes.data), None


def _is_torch(obj) -> bool:
    return type(obj).__module__.split(".")[0] == "torch"


def _register(name: str, obj, token_axis: int | None, device_id: int | None, host_ok: bool, dtype) -> _Registered:
    on_device = True
    if _is_torch(obj):
        shape, dt, ptr, dev = _torch_info(obj, name)
        on_device = dev is not None
    elif type(obj).__module__.split(".")[0] == "cupy":
        shape, dt, ptr, dev = _cupy_info(obj, name)
    elif hasattr(obj, "__cuda_array_interface__"):
        shape, dt, ptr, dev = _cai_info(obj, name, dtype)
    elif isinstance(obj, np.ndarray) or hasattr(obj, "__array_interface__"):
        shape, dt, ptr, dev = _host_info(obj, name)
        on_device = False
    elif hasattr(obj, "__dlpack__"):
        import cupy

        obj = cupy.from_dlpack(obj)
        shape, dt, ptr, dev = _cupy_info(obj, name)
    else:
        raise ArrayMismatchError(f"pool {name!r}: {type(obj).__name__} is not a tensor (PyTorch, CuPy, "
                                 "__cuda_array_interface__ or DLPack)")
    if dtype is not None and canonical_dtype(dtype) != dt:
        raise ArrayMismatchError(f"pool {name!r}: tensor dtype {dt} differs from the dtype given ({dtype})")
    if not on_device and not host_ok:
        raise ArrayMismatchError(f"pool {name!r}: tensor is in host memory; register CUDA tensors "
                                 "(host_ok=True registers host memory, for CPU engines)")
    if on_device and device_id is not None and dev != device_id:
        raise ArrayMismatchError(f"pool {name!r}: tensor is on CUDA device {dev}; expected device {device_id}")
    if len(shape) < 2 or any(d <= 0 for d in shape):
        raise ArrayMismatchError(f"pool {name!r}: shape {shape} must be [num_blocks, *block_shape] with every "
                                 "dimension >= 1")
    if ptr % ALIGNMENT:
        raise ArrayMismatchError(f"pool {name!r}: data at address {ptr:#x} is not aligned to {ALIGNMENT} bytes; "
                                 "register a tensor that starts on a 16-byte boundary (e.g. .clone())")
    try:
        spec = PoolSpec(name, shape[1:], dt, token_axis=token_axis)
    except ConfigError as exc:
        raise ArrayMismatchError(str(exc)) from None
    nbytes = shape[0] * spec.block_nbytes
    if on_device:
        import cupy

        mem = cupy.cuda.UnownedMemory(ptr, nbytes, obj, device_id=dev)
        raw = cupy.ndarray((shape[0], spec.block_nbytes), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
    else:
        import ctypes

        buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
        raw = np.frombuffer(buf, dtype=np.uint8).reshape(shape[0], spec.block_nbytes)
    return _Registered(spec, raw, obj)


class DevicePools:
    """Engine tensors registered as pools (see the module docstring).

    Args:
        tensors: ``{pool_name: tensor}``, each ``[num_blocks, *block_shape]``, C-contiguous,
            16-byte aligned, on ``device_id``; every tensor has the same ``num_blocks``.
        token_axis: the token axis inside ``block_shape`` (int for every pool, a mapping per
            pool, or None: no partial copies).
        layers: pools that form each layer, in layer order (default: one layer per pool, in
            the order given), or
        layer_axis: ``0`` to slice every block of every pool into ``block_shape[0]`` layers
            (one pool holding all layers, TensorRT-LLM style).
        device_id: CUDA device the tensors must be on (None: CuPy's current device).
        host_ok: accept host memory too (CPU engines, tests).
        dtype: element type, where the tensor does not say (``__cuda_array_interface__``
            has no bfloat16).

    Raises:
        ArrayMismatchError: a tensor of the wrong kind, dtype, shape, layout, device or
            alignment, or tensors that disagree on ``num_blocks``.
        ConfigError: a bad pool name or layer list.
    """

    def __init__(self, tensors: Mapping[str, object], *, token_axis: int | Mapping[str, int | None] | None = None,
                 layers: Sequence[Sequence[str]] | None = None, layer_axis: int | None = None,
                 device_id: int | None = None, host_ok: bool = False, dtype=None) -> None:
        if not tensors:
            raise ConfigError("register at least one tensor")
        from tiercache.cuda import cuda_status

        if device_id is None and cuda_status().available:
            import cupy

            device_id = cupy.cuda.Device().id
        self.device_id = device_id
        axes = token_axis if isinstance(token_axis, Mapping) else {n: token_axis for n in tensors}
        self._pools = {n: _register(n, t, axes.get(n), device_id, host_ok, dtype) for n, t in tensors.items()}
        counts = {n: r.raw.shape[0] for n, r in self._pools.items()}
        if len(set(counts.values())) != 1:
            raise ArrayMismatchError(f"tensors disagree on num_blocks (axis 0): {counts}")
        self.num_blocks = next(iter(counts.values()))
        self.on_device = not isinstance(next(iter(self._pools.values())).raw, np.ndarray)
        if any(isinstance(r.raw, np.ndarray) == self.on_device for r in self._pools.values()):
            raise ArrayMismatchError("tensors mix host and device memory")
        self.layers = self._layers(layers, layer_axis)

    def _layers(self, layers, layer_axis) -> list[list[LayerPart]]:
        if layer_axis is not None:
            if layer_axis != 0 or layers is not None:
                raise ConfigError(f"layer_axis = {layer_axis!r}: only 0 (the leading block axis), without layers")
            counts = {n: r.spec.block_shape[0] for n, r in self._pools.items()}
            if len(set(counts.values())) != 1 or any(len(r.spec.block_shape) < 2 for r in self._pools.values()):
                raise ArrayMismatchError(f"layer_axis=0 needs blocks of >= 2 axes with one layer count: {counts}")
            n = next(iter(counts.values()))
            return [[LayerPart(p, n, i, _part_spec(r.spec)) for p, r in self._pools.items()] for i in range(n)]
        groups = [[p] for p in self._pools] if layers is None else [list(g) for g in layers]
        named = [p for g in groups for p in g]
        if sorted(named) != sorted(self._pools) or not all(groups):
            raise ConfigError(f"layers {groups} must name every pool ({', '.join(self._pools)}) exactly once")
        return [[LayerPart(p, 1, 0, self._pools[p].spec) for p in g] for g in groups]

    # -- field layouts ------------------------------------------------------------------------
    @classmethod
    def vllm(cls, kv_caches: Sequence, prefix: str = "layer", **kw) -> DevicePools:
        """vLLM-style per-layer tensors ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
        (K and V in axis 1): pools ``layer.0 ...``, one per layer, token axis 1."""
        _need_ndim(kv_caches, 5, "vllm", "[num_blocks, 2, block_size, num_kv_heads, head_dim]")
        bad = [i for i, t in enumerate(kv_caches) if tuple(t.shape)[1] != 2]
        if bad:
            raise ArrayMismatchError(f"vllm: tensor {bad[0]} has shape {tuple(kv_caches[bad[0]].shape)}; axis 1 "
                                     "must be 2 (K and V)")
        return cls({f"{prefix}.{i}": t for i, t in enumerate(kv_caches)}, token_axis=1, **kw)

    @classmethod
    def trtllm(cls, pool, name: str = "kv", **kw) -> DevicePools:
        """A TensorRT-LLM-style pool ``[num_blocks, num_layers, kv_factor, num_kv_heads,
        tokens_per_block, head_dim]``: one pool; layer ``i`` is slice ``i`` of every block."""
        _need_ndim([pool], 6, "trtllm", "[num_blocks, num_layers, kv_factor, num_kv_heads, tokens_per_block, head_dim]")
        return cls({name: pool}, token_axis=3, layer_axis=0, **kw)

    @classmethod
    def fastdeploy(cls, k_caches: Sequence, v_caches: Sequence, **kw) -> DevicePools:
        """FastDeploy-style separate K and V per layer, each ``[num_blocks, num_kv_heads,
        block_size, head_dim]``: pools ``k.i`` and ``v.i``; layer ``i`` is both."""
        _need_ndim([*k_caches, *v_caches], 4, "fastdeploy", "[num_blocks, num_kv_heads, block_size, head_dim]")
        if len(k_caches) != len(v_caches):
            raise ArrayMismatchError(f"{len(k_caches)} K tensors but {len(v_caches)} V tensors")
        tensors = {}
        for i, (k, v) in enumerate(zip(k_caches, v_caches)):
            tensors[f"k.{i}"], tensors[f"v.{i}"] = k, v
        return cls(tensors, token_axis=1, layers=[[f"k.{i}", f"v.{i}"] for i in range(len(k_caches))], **kw)

    @classmethod
    def mla(cls, caches: Sequence, prefix: str = "layer", **kw) -> DevicePools:
        """An MLA latent cache (kv_factor 1), per layer ``[num_blocks, block_size, latent_dim]``
        (DeepSeek style: compressed KV and rope key in one row): token axis 0."""
        _need_ndim(caches, 3, "mla", "[num_blocks, block_size, latent_dim]")
        return cls({f"{prefix}.{i}": t for i, t in enumerate(caches)}, token_axis=0, **kw)

    # -- what the cache uses -------------------------------------------------------------------
    @property
    def specs(self) -> tuple[PoolSpec, ...]:
        """Geometry of one device block of each pool."""
        return tuple(r.spec for r in self._pools.values())

    def tensor(self, pool: str):
        """The tensor registered as ``pool`` (the caller's own object)."""
        return self._pools[pool].tensor

    def raw(self, pool: str):
        """``uint8 [num_blocks, block_nbytes]`` view of ``pool`` (CuPy or NumPy; no copy)."""
        return self._pools[pool].raw

    def host_specs(self, k: int) -> tuple[PoolSpec, ...]:
        """Geometry of a host/file block holding ``k`` device blocks of each pool: the device
        block itself for ``k == 1``, else shape ``[k, *block_shape]`` (no token axis)."""
        if k == 1:
            return self.specs
        return tuple(PoolSpec(s.name, (k, *s.block_shape), s.dtype) for s in self.specs)

    def memory_tier(self) -> MemoryTier:
        """The device tier over these tensors."""
        return MemoryTier("device", self.num_blocks, self.specs, {n: r.raw for n, r in self._pools.items()},
                          on_device=self.on_device, pinned=False, owners=[r.tensor for r in self._pools.values()])

    @property
    def is_torch(self) -> bool:
        """True when the tensors are PyTorch tensors (their current stream is the default)."""
        return _is_torch(next(iter(self._pools.values())).tensor)

    def __repr__(self) -> str:
        return (f"<DevicePools {len(self._pools)} pools x {self.num_blocks} blocks, {len(self.layers)} layers, "
                f"{'device' if self.on_device else 'host'}>")


def _part_spec(spec: PoolSpec) -> PoolSpec:
    t = spec.token_axis
    return PoolSpec(spec.name, spec.block_shape[1:], spec.dtype, token_axis=None if t in (None, 0) else t - 1)


def _need_ndim(tensors: Sequence, ndim: int, helper: str, layout: str) -> None:
    if not tensors:
        raise ArrayMismatchError(f"{helper}: no tensors given")
    for i, t in enumerate(tensors):
        shape = tuple(getattr(t, "shape", ()))
        if len(shape) != ndim:
            raise ArrayMismatchError(f"{helper}: tensor {i} has shape {shape}; expected {layout}")
