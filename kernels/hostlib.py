"""Building and loading tiercache's host C code (``kernels/*.c``) with the system C compiler.

A source is compiled once per machine into a shared library under the cache directory
(``$TIERCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/tiercache``, else ``~/.cache/tiercache``),
named by the hash of its source, so an edited source is rebuilt and processes that share the
cache directory share the build. The library is loaded with :mod:`ctypes` (whose foreign
calls release the GIL). Like CuPy's kernel cache, nothing is built at install time.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
CFLAGS = ("-O2", "-std=gnu11", "-shared", "-fPIC", "-pthread", "-Wall")


class HostLibError(RuntimeError):
    """A host C source cannot be built or loaded here (no C compiler, a compile error)."""


def cache_dir() -> Path:
    """Where built host libraries are kept."""
    env = os.environ.get("TIERCACHE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tiercache"


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc``, ``gcc`` or ``clang`` on PATH."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"])
    return next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)


def build(source: str) -> Path:
    """Compile ``kernels/<source>`` (once per source hash) and return the library's path.

    Raises:
        HostLibError: no C compiler, or the source does not compile (the compiler's message).
    """
    src = KERNEL_DIR / source
    text = src.read_bytes()
    digest = hashlib.sha256(text + " ".join(CFLAGS).encode() + platform.machine().encode()).hexdigest()[:16]
    out = cache_dir() / f"{src.stem}-{digest}.so"
    if out.exists():
        return out
    cc = compiler()
    if cc is None:
        raise HostLibError("no C compiler (cc, gcc or clang) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{src.stem}-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *CFLAGS, "-o", tmp, str(src)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise HostLibError(f"{cc} failed on {src.name}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent builders publish the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def load(source: str) -> ctypes.CDLL:
    """The built library of ``kernels/<source>``, loaded once per process.

    Raises:
        HostLibError: see :func:`build`, or the library cannot be loaded.
    """
    path = build(source)
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        raise HostLibError(f"cannot load {path}: {exc}") from None
