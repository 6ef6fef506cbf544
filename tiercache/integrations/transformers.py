"""A Hugging Face ``transformers`` KV cache whose keys and values live in tiercache blocks:
pinned host memory, then files, with a few layers' worth of VRAM.

    from tiercache.integrations.transformers import TieredCache

    cache = TieredCache(model, max_cache_len=32768)                         # host tier
    cache = TieredCache(model, max_cache_len=32768, host_bytes=1 << 30,
                        root="/mnt/nvme/kv")                                 # host, then files
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
    cache.close()

How it works. Tokens are grouped in blocks of ``tokens_per_block``; one tiercache key holds
one layer's K and V for one token block, every sequence of the batch and every KV head (a host
block of ``batch * num_kv_heads`` device blocks of ``[tokens_per_block, head_dim]``, pools
``k`` and ``v``). VRAM holds a ring of ``ring_layers`` layer buffers ``[batch, heads,
max_cache_len, head_dim]`` (K and V). Each layer's last, partial block (its *tail*) lives in
pinned host memory that the append kernel reads and writes across the bus (``tails="host"``,
the default on a GPU: no VRAM per layer) or in VRAM (``tails="device"``: one block per
layer, and no bus traffic for it). For every layer of every forward pass:

1. the layer's full blocks were onboarded into a ring buffer ``ring_layers - 1`` layers
   earlier, after the compute queued before it on the device (the attention that last read
   that buffer); the current stream now waits on its event (no host-side wait). With the
   whole KV cache in the host tier that onboard is an exclusive prepared onboard
   (:meth:`~tiercache.TierCache.prepare_onboard`), planned once per (layer, buffer) and
   block count (during the prefill for the first decode step) and replayed outside the slot
   ledger: every access to the ring is ordered on the compute stream;
2. the tail and the new tokens are copied in behind them (a decode step's in one kernel
   launch, :class:`~tiercache.copypaths.TokenAppend`, which also writes the new tokens to
   the tail), and the attention gets views of the buffer (no concatenation, no allocation);
3. blocks the new tokens complete are offloaded from the ring buffer to the host tier
   (:meth:`~tiercache.TierCache.offload_slots`, ordered after the copies on the stream); the
   compute stream orders the buffer's next onboard after that offload;
4. once the attention that reads the buffer is queued, the onboard into it of the layer
   ``ring_layers`` ahead (wrapping into the next forward pass) is queued behind it: from a
   forward pre-hook on the attention's ``o_proj`` when the cache was given the model, else
   at the next layer's ``update``.

Cold blocks spill from the host tier to block files under ``root`` (least recently used
first) and come back through it. The KV bytes never change on the way, so the attention sees
the same keys and values as with ``DynamicCache``.

What it does not do (each a :class:`~tiercache.errors.ConfigError` or
:class:`UnsupportedCacheOperation` naming it): sliding-window, chunked or linear-attention
layers; beam search (``reorder_cache``), cropping (assisted decoding), batch reshaping; more
than ``max_cache_len`` tokens; ``batch * num_kv_heads > 64``.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import numpy as np

from tiercache.errors import ConfigError, MissingDependencyError, TierCacheError

try:
    import torch
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as exc:  # pragma: no cover - exercised where transformers is missing
    raise MissingDependencyError(
        "tiercache.integrations.transformers needs torch and transformers: pip install 'tiercache[hf]'") from exc

__all__ = ["TieredCache", "UnsupportedCacheOperation"]

#: most device blocks a host block may hold (``blocks_per_host_block``)
MAX_POSITIONS = 64

# the current stream's raw handle without building a torch.cuda.Stream (the private call
# torch.cuda.current_stream itself makes; absent from CPU-only builds)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class UnsupportedCacheOperation(TierCacheError, NotImplementedError):
    """A ``Cache`` operation :class:`TieredCache` does not implement (beam search, cropping)."""


def _unsupported(what: str):
    def method(self, *args, **kwargs):
        raise UnsupportedCacheOperation(f"TieredCache does not support {what}; use DynamicCache for it")
    method.__doc__ = f"Not supported: raises :class:`UnsupportedCacheOperation` ({what})."
    return method


class _Layer(CacheLayerMixin):
    """One layer's view of a :class:`TieredCache` (what ``Cache``'s generic methods query)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: TieredCache, index: int) -> None:
        super().__init__()
        self._owner = weakref.proxy(owner)
        self.index = index

    def lazy_initialization(self, key_states, value_states) -> None:
        self._owner._initialize(key_states)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        return self._owner.update(key_states, value_states, self.index)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._owner._lengths[self.index]

    def get_max_length(self) -> int:
        return self._owner.max_cache_len

    def reset(self) -> None:
        self._owner._lengths[self.index] = 0

    offload = prefetch = lambda self: None  # noqa: E731 - the tiers do this
    reorder_cache = _unsupported("beam search (reorder_cache)")
    crop = _unsupported("cropping the cache (assisted decoding)")
    batch_repeat_interleave = _unsupported("batch_repeat_interleave")
    batch_select_indices = _unsupported("batch_select_indices")


class TieredCache(Cache):
    """A ``transformers`` ``Cache`` that keeps the KV cache in tiercache's host tier and files,
    streaming each layer back into a small VRAM ring during every forward pass (see the module
    docstring).

    Args:
        config: the model, or its config (``model.config``; its text config is used): layer
            count, KV heads, ``head_dim``; every layer must be full attention. Given the
            model, the cache hooks each attention's ``o_proj`` (a forward pre-hook, removed
            by :meth:`close`) and queues the onboard into the ring buffer an attention read
            right behind that attention, instead of at the next layer's ``update``: the copy
            then has almost ``ring_layers`` layers' time to land, not ``ring_layers - 1``.
            ``attention_hooks`` counts the hooks (0 with a config, or a model whose
            attention has no ``o_proj``: the onboards then go at the next ``update``).
        max_cache_len: most tokens per sequence (prompt and generated), > 0.
        tokens_per_block: tokens per block (one file per block and pool), 1..65536.
        host_bytes: bytes of pinned host memory for the host tier (default: the whole KV
            cache of ``max_cache_len`` tokens). Below that, ``root`` is required and holds
            the rest. Blocks come back through the host tier, so it should hold at least
            ``ring_layers`` layers' blocks to keep the onboards of the layers in flight
            apart (less works, in pieces, with host-side waits).
        root: directory of the file tier (None: host tier only). Its blocks are this cache's
            scratch space: they are deleted when the cache starts and when it closes.
        ring_layers: layer buffers in VRAM (2..num_layers): the onboard of a layer is queued
            after the attention ``ring_layers`` layers before it (with the model's hooks) or
            ``ring_layers - 1`` layers before its own attention (without).
        tails: where each layer's last, partial block lives: ``"host"`` (pinned host memory;
            every step the append kernel reads the tail's tokens across the bus, on average
            ``tokens_per_block / 2`` tokens per layer, and writes the new ones) or
            ``"device"`` (VRAM: ``num_layers`` blocks more of it). ``"host"`` applies on a
            GPU where the append kernel loads; elsewhere the tails live with the ring
            (``stats()["tail_memory"]`` says which).
        **options: other :class:`~tiercache.config.CacheConfig` fields (``fsync`` defaults
            to ``"none"`` here: a KV cache need not survive the process; ``io_threads``,
            ``io_engine``, ``direct_io``...).

    The tier cache is created on the first ``update`` (batch size, dtype and device come from
    the model), sized from ``max_cache_len`` and the batch: ``K + V`` bytes per block are
    ``2 * batch * num_kv_heads * tokens_per_block * head_dim * itemsize``.

    Raises:
        ConfigError: a model with non-full-attention layers, sizes out of range, a host tier
            too small without ``root``.
        MissingDependencyError: torch or transformers missing (at import).
    """

    def __init__(self, config, max_cache_len: int, *, tokens_per_block: int = 1024, host_bytes: int | None = None,
                 root=None, ring_layers: int = 2, tails: str = "host", **options) -> None:
        model = None
        if isinstance(config, torch.nn.Module):
            model, config = config, config.config
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.num_layers = int(text.num_hidden_layers)
        layer_types = getattr(text, "layer_types", None)
        other = sorted({t for t in (layer_types or []) if t != "full_attention"})
        if other or getattr(text, "sliding_window", None) is not None and layer_types is None:
            raise ConfigError(f"TieredCache supports full-attention layers only; this model has "
                              f"{other or ['sliding_attention']} layers (use DynamicCache for them)")
        for name, value, lo, hi in (("max_cache_len", max_cache_len, 1, 1 << 24),
                                    ("tokens_per_block", tokens_per_block, 1, 65536),
                                    ("ring_layers", ring_layers, 2, max(2, self.num_layers))):
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ConfigError(f"{name} = {value!r} must be an integer in [{lo}, {hi}]")
        if tails not in ("host", "device"):
            raise ConfigError(f"tails = {tails!r} must be 'host' (pinned host memory) or 'device' (VRAM)")
        if host_bytes is not None and (isinstance(host_bytes, bool) or not isinstance(host_bytes, int)
                                       or host_bytes <= 0):
            raise ConfigError(f"host_bytes = {host_bytes!r} must be a positive integer (bytes)")
        self._max_len = max_cache_len
        self.tokens_per_block = tokens_per_block
        self.blocks_per_layer = -(-max_cache_len // tokens_per_block)
        self.ring_layers = ring_layers
        self.tails = tails
        self.host_bytes = host_bytes
        self.root = root
        self.options = {"fsync": "none", **options}
        self.tiers: Any = None  # the TierCache, from the first update
        self._lengths = [0] * self.num_layers
        self._finalizer: weakref.finalize | None = None
        self.update_seconds = 0.0  # host time spent in update() (all layers, all steps)
        self._after: tuple[int, int] | None = None  # (update, layer) whose buffer's next onboard is still to queue
        super().__init__(layers=[_Layer(self, i) for i in range(self.num_layers)])
        hooks = _attention_hooks(model, self) if model is not None else []
        self.attention_hooks = len(hooks)
        self._unhook = weakref.finalize(self, _remove_hooks, hooks)

    @property
    def max_cache_len(self) -> int:
        """Most tokens per sequence this cache holds."""
        return self._max_len

    # -- setup ---------------------------------------------------------------------------------
    def _initialize(self, key_states) -> None:
        """Create the VRAM ring, the tails and the tier cache for ``key_states``' batch,
        heads, head_dim, dtype and device."""
        if self.tiers is not None:
            return
        from tiercache.cache import TierCache
        from tiercache.enginetensors import DevicePools

        B, H, _, D = key_states.shape
        self.batch, self.heads, self.head_dim = B, H, D
        self.dtype, self.device = key_states.dtype, key_states.device
        k = B * H
        if k > MAX_POSITIONS:
            raise ConfigError(f"batch {B} x {H} KV heads = {k} device blocks per host block; at most {MAX_POSITIONS} "
                              "(use a smaller batch)")
        R, nb, tpb = self.ring_layers, self.blocks_per_layer, self.tokens_per_block
        cap = nb * tpb
        kw = dict(dtype=self.dtype, device=self.device)
        # one tensor holds K and V (pools "k" and "v" are its halves), so that one copy moves
        # both: ring buffer r of either is [B, H, cap, D]; device block (r, b, h, j) is tokens
        # j*tpb.. of (b, h): row ((r * B + b) * H + h) * nb + j of the flat [R * B * H * nb, tpb, D]
        rows = R * k * nb
        L = self.num_layers
        self._kv = torch.empty(2, rows, tpb, D, **kw)
        self._ring = {"k": self._kv[0], "v": self._kv[1]}
        self._ids = np.arange(rows, dtype=np.int64).reshape(R, k, nb)
        block_bytes = 2 * k * tpb * D * key_states.element_size()
        need = self.num_layers * nb
        host_slots = need if self.host_bytes is None else self.host_bytes // block_bytes
        if host_slots < need and self.root is None:
            raise ConfigError(f"host_bytes = {self.host_bytes} holds {host_slots} blocks of {block_bytes} bytes; "
                              f"{self.max_cache_len} tokens x {self.num_layers} layers need {need} "
                              f"({need * block_bytes} bytes): give more "
                              "host_bytes, or root= for a file tier")
        if host_slots < 1:
            raise ConfigError(f"host_bytes = {self.host_bytes} holds no block of {block_bytes} bytes")
        from tiercache.copypaths import TokenAppend

        on_gpu = self.device.type == "cuda"
        use_kernel = on_gpu and TokenAppend.usable()
        # each layer's tail: [2, L, B, H, tpb, D] (K and V), in pinned host memory that the
        # append kernel reaches through its unified address, or beside the ring
        self.tail_memory = "host" if self.tails == "host" and use_kernel else "device"
        tail_shape = (2, L, B, H, tpb, D)
        self._tail_owner = None
        if self.tail_memory == "host":
            from tiercache.memory import alloc_host

            arr, self._tail_owner = alloc_host(int(np.prod(tail_shape)) * key_states.element_size(), pinned=True)
            tails = torch.from_numpy(arr).view(self.dtype).view(tail_shape)
        else:
            tails = torch.empty(tail_shape, **kw)
        self._tail_bytes = tails.numel() * tails.element_size()
        pools = DevicePools(self._ring, token_axis=0, layers=[["k", "v"]], host_ok=not on_gpu,
                            device_id=self.device.index if on_gpu else None)
        file_slots = need if self.root is not None else 0
        opts = {"metrics_registry": "none", "metrics_snapshot_s": 0, **self.options}
        self.tiers = TierCache.for_engine(pools, host_slots=min(host_slots, need), file_slots=file_slots,
                                          blocks_per_host_block=k, root=self.root, **opts)
        if file_slots:  # the root is scratch space: a previous run's blocks go
            self.tiers.evict(self.tiers.keys("file"))
        self._plans: dict[tuple[int, int], tuple[int, Any]] = {}
        self._finalizer = weakref.finalize(self, _close, self.tiers, self._plans,
                                           (self.device, self._tail_owner) if self._tail_owner else None)
        self.block_bytes = block_bytes
        self._views = list(self._kv[:, :rows].view(2, R, B, H, cap, D).unbind(1))  # ring buffer r: [2, B, H, cap, D]
        self._tails = list(tails.unbind(1))  # layer i's tail: [2, B, H, tpb, D]
        self._out: dict[int, tuple] = {}  # ring buffer -> (tokens, K view, V view) last returned
        self._append = None  # token writes in one kernel launch (GPU)
        if use_kernel:
            isz = key_states.element_size()
            row = D * isz
            self._isz = isz
            self._append = TokenAppend(self._kv.data_ptr(), self._kv.stride(0) * isz, H, k, row, cap * row,
                                       tpb * row, self.device.index or 0, tails=tails.data_ptr(),
                                       tail_pool_stride=tails.stride(0) * isz)
            self._tail_off = [i * k * tpb * row for i in range(L)]
            self._ring_off = [r * k * cap * row for r in range(R)]
        self._cs = (None, None)  # (PyTorch stream handle, its CuPy wrapper): the compute stream
        self._pending: dict[int, tuple] = {}
        self._updates = 0
        self._key0 = 0
        # the host tier holds every block: each (layer, ring buffer) onboard is planned once
        # per block count (TierCache.prepare_onboard) and only launched per step
        self._prepare = host_slots >= need
        self._offloads: dict[int, object] = {}  # ring buffer -> its last offload job

    def _keys(self, layer: int, j0: int, j1: int) -> list[int]:
        base = self._key0 + layer * self.blocks_per_layer
        return list(range(base + j0, base + j1))

    def _dev(self, slot: int, j0: int, j1: int) -> np.ndarray:
        return np.ascontiguousarray(self._ids[slot, :, j0:j1].T)

    def _stream(self):
        """The compute stream (PyTorch's current stream) as a CuPy stream, for the tier
        cache's device-side waits (None for host tensors). Wrapped once per stream."""
        if self.device.type != "cuda":
            return None
        raw = _raw_stream(self.device.index) if _raw_stream is not None else \
            torch.cuda.current_stream(self.device).cuda_stream
        if raw != self._cs[0]:
            from tiercache.memory import as_cupy_stream

            self._cs = (raw, as_cupy_stream(int(raw)))
        return self._cs[1]

    def _plan(self, layer: int, nfull: int, slot: int):
        """The prepared onboard of ``layer``'s first ``nfull`` blocks into ring buffer
        ``slot`` (planned again when a block was added since the last one)."""
        n, plan = self._plans.get((layer, slot), (0, None))
        if n != nfull:  # a block more since the last plan (every tokens_per_block tokens)
            if plan is not None:
                plan.release()
            # exclusive: the ring is this cache's alone and every access to it is ordered
            # on the compute stream (offloads that read it are waited for before the next
            # launch into it), so launches after the first skip the slot ledger
            plan = self.tiers.prepare_onboard(self._keys(layer, 0, nfull), self._dev(slot, 0, nfull),
                                              layerwise=True, exclusive=True)
            self._plans[layer, slot] = (nfull, plan)
        return plan

    def _onboard(self, layer: int, nfull: int, slot: int, stream):
        """Queue the onboard of ``layer``'s first ``nfull`` blocks into ring buffer ``slot``;
        it starts after the compute queued so far on ``stream``."""
        if self._prepare:
            return self._plan(layer, nfull, slot).launch(stream)
        return self.tiers.onboard_slots(self._keys(layer, 0, nfull), self._dev(slot, 0, nfull), layerwise=True,
                                        stream=stream)

    def _release_plans(self) -> None:
        _release(self._plans)

    # -- the Cache interface -------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Store ``key_states``/``value_states`` ``[batch, kv_heads, q, head_dim]`` of layer
        ``layer_idx`` and return that layer's keys and values so far, ``[batch, kv_heads,
        length, head_dim]`` views of a VRAM ring buffer, valid until the next
        ``ring_layers - 1`` updates.

        Raises:
            ConfigError: more than ``max_cache_len`` tokens, or a batch/heads/dtype/device
                other than the first update's.
            TransferError: a block failed to move (its source copy stays valid).
        """
        t0 = time.perf_counter()
        try:
            return self._update(key_states, value_states, layer_idx)
        finally:
            self.update_seconds += time.perf_counter() - t0

    def _update(self, key_states, value_states, layer_idx: int):
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        if tuple(key_states.shape[:2]) != (self.batch, self.heads) or key_states.shape[3] != self.head_dim \
                or key_states.dtype != self.dtype or key_states.device != self.device:
            raise ConfigError(f"layer {layer_idx}: key states {tuple(key_states.shape)} {key_states.dtype} on "
                              f"{key_states.device}; this cache holds [{self.batch}, {self.heads}, *, {self.head_dim}] "
                              f"{self.dtype} on {self.device}")
        s, q, tpb, R = self._lengths[layer_idx], key_states.shape[2], self.tokens_per_block, self.ring_layers
        end = s + q
        if end > self.max_cache_len:
            raise ConfigError(f"layer {layer_idx}: {end} tokens exceed max_cache_len = {self.max_cache_len}")
        g = self._updates
        self._updates += 1
        slot = g % R
        nfull = s // tpb
        pending = self._pending.pop(g, None)
        for stale in [x for x in self._pending if x < g]:
            del self._pending[stale]
        stream = self._stream()
        if nfull:
            if pending is not None and pending[:2] == (layer_idx, nfull):
                handle = pending[2]
            else:  # not the order the prefetch expected: onboard now (still only a device-side wait)
                handle = self._onboard(layer_idx, nfull, slot, stream)
            handle.wait(stream)
        ring = self._views[slot]  # [2, B, H, tokens, D]: K and V
        last = self._offloads.pop(slot, None)
        if last is not None:  # the buffer's last offload read it: write after it (device-side)
            self.tiers.make_stream_wait(stream, jobs=[last])
        base = nfull * tpb
        done = end // tpb
        decode = end <= base + tpb
        if decode:  # the new tokens stay in the last block: through the tail
            self._append_tokens(stream, layer_idx, slot, base, s - base, key_states, value_states)
        else:  # they fill blocks (prefill): straight into the ring, the rest into the tail
            if s > base:
                self._append_tokens(stream, layer_idx, slot, base, s - base)
            ring[0].narrow(2, s, q).copy_(key_states)
            ring[1].narrow(2, s, q).copy_(value_states)
            start = done * tpb  # > s: the tail starts afresh at the first block these tokens leave partial
            if end > start:
                self._append_tokens(stream, layer_idx, slot, start, 0, key_states.narrow(2, start - s, end - start),
                                    value_states.narrow(2, start - s, end - start))
        if done > nfull:  # blocks completed: offload them from the ring (the tail starts afresh)
            self._offloads[slot] = self.tiers.offload_slots(self._keys(layer_idx, nfull, done),
                                                            self._dev(slot, nfull, done), to="host", stream=stream)
            if self._prepare and not decode:  # plan the next step's onboard now: a prefill keeps the GPU
                self._plan(layer_idx, done, (g + self.num_layers) % R)  # busy, the host has time
        self._lengths[layer_idx] = end
        if self._after is not None:  # no hook launched the last layer's onboard after its attention: now
            self._launch_after(stream)
        self._after = (g, layer_idx)
        out = self._out.get(slot)
        if out is None or out[0] != end:  # every layer of a step returns the same views of its buffer
            out = self._out[slot] = (end, ring[0].narrow(2, 0, end), ring[1].narrow(2, 0, end))
        return out[1], out[2]

    def _append_tokens(self, stream, layer: int, slot: int, base: int, split: int, keys=None, values=None) -> None:
        """Ring buffer ``slot``'s tokens ``base .. base + split`` get ``layer``'s tail tokens
        ``0 .. split``; then ``keys``/``values`` ``[batch, heads, q, head_dim]`` (if given) go
        to ring tokens ``base + split ..`` and to tail tokens ``split ..``: one kernel launch on
        a GPU, tensor copies elsewhere."""
        n = split + (keys.shape[2] if keys is not None else 0)
        ap = self._append
        if ap is not None and (keys is None or keys.stride(3) == 1 and values.stride(3) == 1):
            i = self._isz
            kp = vp = 0
            kst = vst = (0, 0, 0)
            if keys is not None:
                ks, vs = keys.stride(), values.stride()
                kp, kst = keys.data_ptr(), (ks[0] * i, ks[1] * i, ks[2] * i)
                vp, vst = values.data_ptr(), (vs[0] * i, vs[1] * i, vs[2] * i)
            ap(stream, kp, kst, vp, vst, self._tail_off[layer], self._ring_off[slot], base, split, n)
            return
        ring, tail = self._views[slot], self._tails[layer]
        if self._tail_owner is not None:
            # host tails that the CPU copies from and to here (a strided head_dim only): after
            # the kernels queued on them
            torch.cuda.current_stream(self.device).synchronize()
        if keys is not None:
            tail[0].narrow(2, split, n - split).copy_(keys)
            tail[1].narrow(2, split, n - split).copy_(values)
        ring.narrow(3, base, n).copy_(tail.narrow(3, 0, n))

    def _launch_after(self, stream) -> None:
        """Queue the onboard into the ring buffer the last updated layer's attention reads
        (update ``g``: buffer ``g % ring_layers``) of the layer that takes it next (update
        ``g + ring_layers``, wrapping into the next forward pass), after the compute queued
        so far on ``stream``: right after that attention (from the ``o_proj`` hook) or, when
        no hook ran, at the end of the next update."""
        assert self._after is not None  # callers check
        g, layer_idx = self._after
        self._after = None
        R = self.ring_layers
        ahead = (layer_idx + R) % self.num_layers
        n_ahead = self._lengths[ahead] // self.tokens_per_block
        if n_ahead:
            to = g % R
            last = self._offloads.pop(to, None)
            if last is not None:  # an offload still reads that buffer: the onboard into it comes after
                self.tiers.make_stream_wait(stream, jobs=[last])
            self._pending[g + R] = (ahead, n_ahead, self._onboard(ahead, n_ahead, to, stream))

    def _attention_done(self, layer_idx: int) -> None:
        """The ``o_proj`` pre-hook of layer ``layer_idx``: its attention is queued; the onboard
        of the layer ``ring_layers`` ahead goes into its buffer now."""
        after = self._after
        if after is not None and after[1] == layer_idx:
            self._launch_after(self._stream())

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens stored for layer ``layer_idx``."""
        return self._lengths[layer_idx] if 0 <= layer_idx < self.num_layers else 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """``max_cache_len``."""
        return self.max_cache_len

    def reset(self) -> None:
        """Forget every token (the blocks are dropped from every tier)."""
        self._lengths = [0] * self.num_layers
        if self.tiers is not None:
            self.tiers.engine.synchronize()
            self._pending.clear()
            self._after = None
            self._offloads.clear()
            self._release_plans()
            self._key0 += self.num_layers * self.blocks_per_layer  # fresh keys; the old ones go
            for tier in ("host", "file"):
                if tier in self.tiers.tiers:
                    self.tiers.evict(self.tiers.keys(tier))

    reorder_cache = _unsupported("beam search (reorder_cache)")
    crop = _unsupported("cropping the cache (assisted decoding)")
    batch_repeat_interleave = _unsupported("batch_repeat_interleave")
    batch_select_indices = _unsupported("batch_select_indices")

    # -- introspection and lifetime ------------------------------------------------------------
    @property
    def vram_bytes(self) -> int:
        """Bytes of VRAM this cache holds (the ring, and the tails with ``tail_memory ==
        "device"``; 0 before the first update)."""
        if self.tiers is None:
            return 0
        return self._kv.numel() * self._kv.element_size() + (self._tail_bytes if self._tail_owner is None else 0)

    def stats(self) -> dict:
        """The tier cache's :meth:`~tiercache.TierCache.stats` plus ``"vram_bytes"``,
        ``"block_bytes"``, ``"tokens"`` (per layer), ``"update_seconds"`` (host time spent in
        :meth:`update`, every layer and step: the cost this cache adds to a forward pass on
        the host), ``"prepared"`` (whether onboards are planned once and launched per step:
        when the host tier holds the whole KV cache), ``"attention_hooks"``, ``"tail_memory"``
        (``"host"``: the tails in pinned host memory; ``"device"``: with the ring) and
        ``"tail_bytes"``; ``{}`` before the first update."""
        if self.tiers is None:
            return {}
        return {**self.tiers.stats(), "vram_bytes": self.vram_bytes, "block_bytes": self.block_bytes,
                "tokens": list(self._lengths), "update_seconds": self.update_seconds, "prepared": self._prepare,
                "attention_hooks": self.attention_hooks, "tail_memory": self.tail_memory,
                "tail_bytes": self._tail_bytes}

    def close(self) -> None:
        """Wait for transfers in flight, delete the file tier's blocks and close the tier cache
        (idempotent; also done when the cache is garbage-collected)."""
        self._unhook()
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _attention_hooks(model, cache: TieredCache) -> list:
    """Forward pre-hooks on the ``o_proj`` of every attention module of ``model`` with a
    ``layer_idx`` (Llama, Qwen2, Mistral and most decoder models): when one runs, that
    layer's attention is queued, so the onboard into the ring buffer it read can be queued
    behind it (:meth:`TieredCache._attention_done`). The hooks hold the cache weakly."""
    ref = weakref.ref(cache)
    handles = []
    for module in model.modules():
        index, proj = getattr(module, "layer_idx", None), getattr(module, "o_proj", None)
        if isinstance(index, int) and 0 <= index < cache.num_layers and isinstance(proj, torch.nn.Module):
            def hook(_module, _args, index=index):
                owner = ref()
                if owner is not None and owner._after is not None:
                    owner._attention_done(index)
            handles.append(proj.register_forward_pre_hook(hook))
    return handles


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def _release(plans: dict) -> None:
    for _, plan in plans.values():
        plan.release()
    plans.clear()


def _close(tiers, plans: dict, host_tails=None) -> None:
    try:
        _release(plans)  # their pins would refuse the eviction below
        tiers.engine.synchronize()
        if "file" in tiers.tiers:
            tiers.evict(tiers.keys("file"))
    finally:
        tiers.close()
        if host_tails is not None:  # (device, owner): kernels queued on the compute stream may still
            torch.cuda.synchronize(host_tails[0])  # write the tails; the owner goes after this


def kv_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """K and V bytes one token takes over every layer of ``config`` (``2 * layers *
    kv_heads * head_dim * dtype_bytes``)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * dtype_bytes

