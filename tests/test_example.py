"""The Hugging Face example runs and generates identical tokens with and without tiercache
(where PyTorch and transformers are installed; on the GPU machine, or on the CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_kv_offload.py"


def test_hf_example_tokens_identical(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    run = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "12", "--root", str(tmp_path / "root")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "identical tokens: yes" in run.stdout
    assert "MiB written to files" in run.stdout


def test_readme_api_snippet_runs_as_written(tmp_path, monkeypatch):
    """The README's API example runs unchanged (on the CPU here, where it uses host and file
    tiers; with a GPU on the GPU machine)."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## The API"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md (The API)", "exec"), {})
    assert (tmp_path / "tiercache-demo" / ".tiercache-root").is_file()


@pytest.mark.parametrize("files", [False, True])
def test_tiered_cache_example(tmp_path, files):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    script = EXAMPLE.parent / "hf_tiered_cache.py"
    run = subprocess.run([sys.executable, str(script), "--new", "12", *(["--root", str(tmp_path)] if files else [])],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "identical tokens: yes" in run.stdout
    moved = float(run.stdout.split("files -> host ")[1].split(" MiB")[0])
    assert (moved > 0) == files
