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
    import tempfile

    work, temp = tmp_path / "cwd", tmp_path / "tmp"
    work.mkdir()
    temp.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    printed = []
    for _ in range(2):  # a second run prints what the first did (nothing of the first is reused)
        out: list = []
        exec(compile(code, "README.md (The API)", "exec"), {"print": lambda *a: out.append(a)})
        printed.append([a for a in out if isinstance(a[0], dict) and set(a[0]) <= {"device", "host", "file"}])
    assert printed[0] == printed[1] and printed[0], printed
    assert not list(work.iterdir())  # nothing left in the working directory
    assert len([p for p in temp.iterdir() if (p / ".tiercache-root").is_file()]) == 2


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


def _stage_rows(text: str) -> list[tuple[str, str]]:
    """``(stage, path)`` of each row of a main-job table (the columns before the numbers)."""
    import re

    rows = []
    for line in text.splitlines():
        m = re.match(r"^  (\S.*?\S)\s{2,}(\S.*?\S)\s{2,}\d+\s", line)
        if m and m.group(1) != "stage":
            rows.append((m.group(1), m.group(2)))
    return rows


def test_readme_sample_of_the_main_job_matches_a_real_run(tmp_path):
    """The README's sample of `tiercache bench` shows the stages and paths the job prints on a
    machine without a GPU (the numbers are that machine's and may differ)."""
    import re

    from tiercache.cuda import cuda_status

    if cuda_status().available:
        pytest.skip("the README's sample is of a machine without a GPU (this one has a device tier)")
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    sample = re.search(r"```\n(tiercache main job: .*?)```", readme, re.S).group(1)
    run = subprocess.run([sys.executable, "-m", "tiercache.cli", "bench", "--blocks", "32", "--root",
                          str(tmp_path / "root")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert _stage_rows(sample) and _stage_rows(run.stdout) == _stage_rows(sample), run.stdout
    for line in ("tiercache main job: ", "  tiers: ", "  I/O path: POSIX", "  verify (tiers): ", "  result: OK"):
        assert line in sample and line in run.stdout, line
