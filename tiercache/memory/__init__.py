"""Memory: pinned host allocation and the memory tiers' arrays, with the CUDA plumbing every
copy uses.

- :mod:`.hostmem`: pinned host memory (reserved huge pages registered with CUDA, else
  ``cudaHostAlloc``; page-aligned ``mmap`` without CUDA);
- :mod:`.memory_tier`: the device tier (CuPy ``uint8 [slots, block_nbytes]`` per pool) and the
  host tier (NumPy views of pinned memory);
- :mod:`.streams`: CUDA streams from any library's handle, stream and event pools;
- :mod:`.memcopy`: ``cudaMemcpy`` helpers (device pointers, synchronous copies).

Depends on the foundation modules only (errors, dtypes, geometry, cuda).
"""

from .hostmem import HUGE_PAGE_MODES, PAGE, alloc_host, free_huge_pages, huge_page_bytes, is_pinned
from .memcopy import MEMCPY_DEFAULT, copy_many_sync, copy_sync, data_ptr
from .memory_tier import MemoryTier, make_device_tier, make_host_tier
from .recycled import recycled_empty
from .streams import EventPool, StreamPool, as_cupy_stream, copy_stream

__all__ = [
    "EventPool", "HUGE_PAGE_MODES", "MEMCPY_DEFAULT", "MemoryTier", "PAGE", "StreamPool",
    "alloc_host", "as_cupy_stream", "copy_many_sync", "copy_stream", "copy_sync", "data_ptr", "free_huge_pages",
    "huge_page_bytes", "is_pinned", "make_device_tier", "make_host_tier", "recycled_empty",
]
