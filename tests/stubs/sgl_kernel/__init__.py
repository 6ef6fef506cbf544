"""A stand-in for SGLang's GPU kernel package (``sgl_kernel``), for runs of SGLang's storage
code against an older release's sources (tools/sglang-sources.sh): those releases import
``sgl_kernel`` and ``sgl_kernel.kvcacheio`` when their pools load (more names on a machine with
CUDA), and the storage paths under test never call them. Every name is a function that raises
if called."""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is a GPU kernel: not on this stand-in")

    return missing
