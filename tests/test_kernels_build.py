"""Every CUDA source in kernels/ compiles with the CUDA compiler of this machine (sm_80, sm_90),
so a kernel that does not build fails CI even without a GPU."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tiercache.kernels.loader import kernel_sources

NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)


def test_there_are_kernels():
    names = [p.name for p in kernel_sources()]
    assert "copy_blocks.cu" in names


@pytest.mark.skipif(NVCC is None and os.environ.get("TIERCACHE_REQUIRE_NVCC") != "1",
                    reason="nvcc not installed (set TIERCACHE_REQUIRE_NVCC=1 to make this a failure)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", kernel_sources(), ids=lambda p: p.name)
def test_kernel_compiles(tmp_path, source, arch):
    assert NVCC is not None, "nvcc is required (TIERCACHE_REQUIRE_NVCC=1)"
    out = tmp_path / f"{source.stem}.{arch}.cubin"
    res = subprocess.run([NVCC, "-std=c++17", f"-arch={arch}", "--cubin", "-Werror", "all-warnings",
                          "-o", str(out), str(source)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert out.stat().st_size > 0


def test_copy_bench_without_gpu_is_a_clean_error(monkeypatch):
    from typer.testing import CliRunner

    from tiercache import cuda
    from tiercache.cli import app

    monkeypatch.setenv("TIERCACHE_DISABLE_CUDA", "1")
    cuda.cuda_status.cache_clear()
    try:
        res = CliRunner().invoke(app, ["bench", "copy"])
    finally:
        cuda.cuda_status.cache_clear()
    assert res.exit_code == 2 and "needs a GPU" in res.output and "Traceback" not in res.output
