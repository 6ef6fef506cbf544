"""CUDA kernels of tiercache (``kernels/*.cu``) and their loader (CuPy ``RawModule``)."""
