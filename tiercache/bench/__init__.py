"""Benchmarks and calibration: ``tiercache bench`` jobs and ``tiercache calibrate``.

Each job measures the library through its public (or documented internal) APIs against a
baseline in the same run:

- :mod:`.mainjob`: the default job (a cache's every stage, verified bytes);
- :mod:`.benchcopy`, :mod:`.benchoverlap`: host <-> device copies against a contiguous
  ``cudaMemcpyAsync``, alone and beside a bf16 GEMM (:mod:`.gpumon` samples clocks);
- :mod:`.benchfile`: block files against raw I/O on the same directory;
- :mod:`.benchlayerwise`: layer-wise onboarding into engine tensors;
- :mod:`.benchshared`: N processes on one shared root against one;
- :mod:`.benchscale`: a root of millions of block files: open, memory, lookups, verify, purge;
- :mod:`.benchvllmtier`: vLLM's storage tier against vLLM's fs tier through vLLM's interface;
- :mod:`.benchvllmserve`: a real vLLM engine on the GPU, TierCacheTier against vLLM's own tiers and recompute;
- :mod:`.benchhf`: transformers generate with its caches and TieredCache;
- :mod:`.fiospec`, :mod:`.fiorun`: fio-style jobs through the transfer engine;
- :mod:`.calibrate`: where the copy engines overtake the SM kernels on this GPU;
- :mod:`.timing`, :mod:`.stagestats`: CUDA-event timing and per-stage statistics.

Nothing in the library imports this package; the CLI does.
"""
