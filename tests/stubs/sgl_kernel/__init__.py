"""A stand-in for SGLang's GPU kernel package (``sgl_kernel``), for the CPU run of
tests/test_sglang_storage.py against an older SGLang release's sources (tools/sglang-sources.sh):
those releases import ``sgl_kernel.kvcacheio`` when their host pools load, and the storage paths
under test never call it. Every name is a function that raises if called."""
