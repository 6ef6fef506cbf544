"""SMs kept free of compute for copy kernels: PyTorch's SM carve-out for cuBLASLt GEMMs.

A large GEMM (cuBLAS's persistent kernels on Hopper) puts one CTA on every SM for its whole
run. A copy kernel launched beside it then either waits for SMs (and, once it holds some, makes
the next GEMM wait for them) or shares SMs with the GEMM's CTAs, which slows the GEMM far more
than its share (40-60% on an H100, docs/performance/copies.md). Serving engines solve the same
problem for communication kernels by asking cuBLASLt to size its GEMMs for fewer SMs
(``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET``, PyTorch's experimental "SM carve-out"); copy
kernels confined to the SMs left over (tiercache's ``carveout_sms``) then run beside them.
Measured on an H100 with 4-8 SMs carved out of an 8192^3 bf16 GEMM: scattered 16 KiB host ->
device transfers at 86-92% of a contiguous copy beside it, the GEMM 0.4-5.5% slower than its
carved time alone; the carve-out itself cost the GEMM 0-10% depending on the machine
(docs/performance/copies.md).
"""

from __future__ import annotations

from contextlib import contextmanager

from tiercache.errors import ConfigError, TierUnavailableError


@contextmanager
def sm_carveout(sms: int):
    """Within the ``with`` block, PyTorch's cuBLASLt GEMMs (and its other carve-out-aware
    kernels) target ``multiprocessors - sms`` SMs, leaving ``sms`` SMs to copies. It also
    selects cuBLASLt as PyTorch's BLAS backend (plain cuBLAS ignores the carve-out). Both are
    process-wide PyTorch settings and are restored on exit. Give the cache the same number as
    ``carveout_sms``.

    Uses ``torch._C._set_sm_carveout_experimental`` (PyTorch 2.6+), which PyTorch marks
    experimental.

    Args:
        sms: SMs to keep free, 0..1024 (0: no carve-out).

    Raises:
        ConfigError: ``sms`` is not an integer in 0..1024.
        TierUnavailableError: PyTorch is missing or has no SM carve-out.
    """
    if isinstance(sms, bool) or not isinstance(sms, int) or not 0 <= sms <= 1024:
        raise ConfigError(f"sms = {sms!r} must be an integer in 0..1024")
    try:
        import torch
    except ImportError as exc:
        raise TierUnavailableError(f"sm_carveout needs PyTorch: {exc}") from exc
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    getter = getattr(torch._C, "_get_sm_carveout_experimental", None)
    if setter is None or getter is None:
        raise TierUnavailableError(
            f"PyTorch {getattr(torch, '__version__', '?')} has no SM carve-out "
            "(torch._C._set_sm_carveout_experimental, PyTorch 2.6+)")
    blas = torch.backends.cuda.preferred_blas_library
    prev, prev_lib = getter(), blas()
    setter(sms or None)
    blas("cublaslt")
    try:
        yield
    finally:
        setter(prev)
        blas(prev_lib)
