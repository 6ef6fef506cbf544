"""Native code of tiercache: CUDA kernels (``kernels/*.cu``, loaded with CuPy ``RawModule``
by :mod:`.loader`) and host C (``kernels/blockio.c``, the file tier's batched I/O engine, built
with the system C compiler and loaded with ctypes by :mod:`.hostlib`)."""
