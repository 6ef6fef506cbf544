#!/bin/bash
# Download (here, with network) the wheels an offline GPU test machine lacks into .whl/ (ignored
# by git): kvikio and what it needs, for Python 3.12 on x86_64 Linux. Such a machine already has
# everything else tiercache uses (numpy, typer, aiofiles, xxhash, CuPy, PyTorch...): carrying
# those replaces working packages there (a newer typer needs pydantic, which it may lack).
# EXTRA="pkg==ver other==ver" adds more.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
plat=()
for p in manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_34 manylinux2014 manylinux1; do
  plat+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d .whl \
  kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 'rapids-logger==0.3.*' \
  ${EXTRA:-}
# one version of each package: two stop the whole install there
ls .whl | sed -E 's/-[0-9].*//' | sort | uniq -d | while read -r dup; do echo "duplicate wheels for $dup: remove all but one" >&2; done
du -sh .whl
