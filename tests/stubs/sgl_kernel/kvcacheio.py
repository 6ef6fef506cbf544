"""``sgl_kernel.kvcacheio``'s names, each raising if called (see the package's doc)."""


def __getattr__(name: str):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.kvcacheio.{name} is a GPU kernel: not on this stand-in")

    return missing
