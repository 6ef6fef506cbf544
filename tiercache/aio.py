"""asyncio front end: ``await`` forms of the cache's calls that never block the event loop.

Each call runs on a worker thread (the cache's work is CPU copies, CUDA calls and file I/O,
which the cache already spreads over its own I/O threads). A cancelled ``await`` returns at once,
but the call it started runs to completion on its thread under the cache's lock, so the cache
is always left consistent: a cancelled onboard either completed (the blocks are in the tier) or
never started; it is never half done. Callers that must know can look the keys up afterwards.

File I/O on the hot paths uses tiercache's worker pool, not ``aiofiles``: reading block files
through aiofiles was measured slower (``tiercache bench file``, docs/performance/files.md),
since aiofiles hands every open/read/close to a thread of its own.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

from tiercache.cache import TierCache


class AsyncTierCache:
    """``await``-able wrapper of a :class:`~tiercache.TierCache`.

    Args:
        cache: the cache (owned by the caller; :meth:`aclose` closes it).
        max_workers: threads running cache calls (calls serialize on the cache's lock anyway;
            more threads only let reads of different calls queue without blocking the loop).

    Every method takes the same arguments and raises the same errors as the cache's.
    """

    def __init__(self, cache: TierCache, max_workers: int = 2) -> None:
        self.cache = cache
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="tiercache-aio")

    async def _run(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def put(self, keys, data, tier=None):
        return await self._run(self.cache.put, keys, data, tier)

    async def get(self, keys, pool=None, out=None):
        return await self._run(self.cache.get, keys, pool, out)

    async def offload(self, keys, to=None, keep=False):
        return await self._run(self.cache.offload, keys, to, keep)

    async def onboard(self, keys, to=None):
        return await self._run(self.cache.onboard, keys, to)

    async def flush(self, keys=None):
        return await self._run(self.cache.flush, keys)

    async def evict(self, keys, tier=None):
        return await self._run(self.cache.evict, keys, tier)

    async def offload_slots(self, keys, device_slots, to=None, *, num_tokens=None, stream=None):
        """Await :meth:`TierCache.offload_slots` until the bytes are in place. ``stream``
        defaults to the engine's current stream *in the calling thread* (PyTorch's current
        stream is per thread). A cancelled await leaves the copy running to completion; the
        keys are then registered with their bytes."""
        stream = self.cache.engine_stream(stream)
        job = await self._run(self.cache.offload_slots, keys, device_slots, to, num_tokens=num_tokens, stream=stream)
        if job is not None:
            await self._run(job.wait)
        return job

    async def onboard_slots(self, keys, device_slots, *, layerwise=False, num_tokens=None, stream=None):
        """Await :meth:`TierCache.onboard_slots`; returns its
        :class:`~tiercache.enginetensors.layerwise.OnboardHandle` once every layer has landed (use
        :meth:`wait_layer` on a handle from the cache itself to await layers one by one)."""
        stream = self.cache.engine_stream(stream)
        handle = await self._run(self.cache.onboard_slots, keys, device_slots, layerwise=layerwise,
                                 num_tokens=num_tokens, stream=stream)
        await self._run(handle.synchronize)
        return handle

    async def prepare_onboard(self, keys, device_slots, *, layerwise=False, num_tokens=None, stream=None,
                              exclusive=False):
        """Await :meth:`TierCache.prepare_onboard` (it may read file-only keys into the host
        tier); returns the :class:`~tiercache.enginetensors.prepared.PreparedOnboard`, whose
        ``launch`` never blocks. ``stream`` defaults to the engine's current stream in the
        calling thread."""
        stream = self.cache.engine_stream(stream)
        return await self._run(self.cache.prepare_onboard, keys, device_slots, layerwise=layerwise,
                               num_tokens=num_tokens, stream=stream, exclusive=exclusive)

    async def wait_layer(self, handle, layer: int) -> None:
        """Await layer ``layer`` of an :class:`~tiercache.enginetensors.layerwise.OnboardHandle` (host-side;
        the engine's stream can instead wait on the device with ``handle.wait_layer``)."""
        await self._run(handle.synchronize_layer, layer)

    async def wait_job(self, job, timeout: float | None = None):
        """Await an engine :class:`~tiercache.transfer.jobs.Job` (result, or TransferError)."""
        return await self._run(job.wait, timeout)

    def lookup(self, key):
        """Non-blocking (in-memory index only)."""
        return self.cache.lookup(key)

    def stats(self) -> dict:
        return self.cache.stats()

    async def aclose(self) -> None:
        """Close the cache (waiting for its transfers) and the worker threads."""
        await self._run(self.cache.close)
        self._pool.shutdown(wait=True)

    async def __aenter__(self) -> AsyncTierCache:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
