#!/bin/bash
# The installed package is whole: build the wheel, install it into a fresh venv (its dependencies
# from the package index), and from a directory outside the source tree run every command's
# --help, a model lookup of `tiercache bench vllm-serve`, and the main job.
#   usage: bash tools/check-wheel.sh          (CI runs it: .ci/run)
set -euo pipefail
cd "$(dirname "$0")/.."
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
python3 -m pip wheel -q --no-deps -w "$W/dist" . 2>&1 | grep -v "^WARNING: Running pip as" || true
python3 -m venv "$W/venv"
"$W/venv/bin/python" -m pip install -q "$W"/dist/tiercache-*.whl 2>&1 | grep -v "^WARNING: Running pip as" || true
cd "$W"
"$W/venv/bin/python" - <<'PY'
import subprocess, sys, typer
from tiercache.cli.app import app
from tiercache.bench.benchvllmserve import model_config
from tiercache.resources import default_config, models_dir

exe = [sys.executable, "-m", "tiercache.cli"]
def walk(cmd, path):
    yield path
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from walk(sub, path + [name])
paths = list(walk(typer.main.get_command(app), []))
for p in paths:
    r = subprocess.run(exe + p + ["--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "Usage" in r.stdout, (p, r.stdout[-500:], r.stderr[-500:])
assert default_config().is_file() and "site-packages" in str(default_config()), default_config()
names = sorted(x.stem for x in models_dir().glob("*.json"))
assert "llama-3.1-8b" in names and model_config("llama-3.1-8b")[1]["num_hidden_layers"] == 32, names
print(f"installed wheel: {len(paths)} commands' --help, models {', '.join(names)}")
PY
"$W/venv/bin/tiercache" bench --blocks 64 --root "$W/root" | tail -3
