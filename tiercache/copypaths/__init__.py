"""Copy paths: how one batch of block copies between two memory endpoints runs on the GPU.

- :mod:`.segments`: which bytes of each block move (whole blocks or the first tokens);
- :mod:`.copyplan`: runs of consecutive slots, the per-run ``cudaMemcpyAsync`` choice;
- :mod:`.copykernels`: :class:`CopyLauncher`, the path per batch (memcpy runs, the driver's
  batched copy, the TMA bulk kernel, the gather/scatter kernel, the staged path);
- :mod:`.batchcopy`: ``cuMemcpyBatchAsync`` over several streams;
- :mod:`.stagedcopy`: copy engines for PCIe, the gather/scatter kernel for the VRAM hop;
- :mod:`.uploadring`: a pinned ring for launch tables;
- :mod:`.driverlaunch`: kernel launches, memsets and copies through the driver with their
  arguments packed once (what prepared launches replay);
- :mod:`.tokenappend`: new K/V tokens into a tail block and a ring buffer in one launch (a
  layer-streaming KV cache's decode step).

Depends on :mod:`tiercache.memory` and the foundation; knows nothing of keys, tiers or files.
"""

from .batchcopy import BatchCopy
from .copykernels import CopyLauncher, PreparedLaunch, copy_kernel_status
from .copyplan import contiguous_runs, memcpy_runs
from .segments import Segments, segments_for
from .stagedcopy import StagedCopier, run_starts
from .tokenappend import TokenAppend
from .uploadring import UploadRing

__all__ = [
    "BatchCopy",
    "CopyLauncher",
    "PreparedLaunch",
    "Segments",
    "StagedCopier",
    "TokenAppend",
    "UploadRing",
    "contiguous_runs",
    "copy_kernel_status",
    "memcpy_runs",
    "run_starts",
    "segments_for",
]
