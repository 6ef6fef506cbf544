#!/bin/bash
# Download (here, with network) the wheels the GPU test machine lacks into .whl/: kvikio and what
# it needs (../shared/device/fetch-wheels.sh). The machine already has everything else tiercache
# uses (numpy, typer, aiofiles, xxhash, CuPy, PyTorch...): carrying those replaces working
# packages there (a newer typer needs pydantic, which it lacks). EXTRA="pkg==ver" adds more.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ../shared/device/fetch-wheels.sh
