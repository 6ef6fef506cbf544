#!/bin/bash
# The files of one SGLang release's wheel (pure Python: its sources, its JIT kernels' headers),
# without its dependency set: enough for SGLang's HiCache storage code (the backend factory,
# the host pools, the cache controller's page paths), which tiercache's HiCache backend is
# tested against on the CPU. README.md, "Quick start", runs tests/test_sglang_storage.py against
# 0.5.10.post1 this way (CI too), beside the installed 0.5.23, with tests/stubs on the path for
# the GPU kernel package that release imports at load (sgl_kernel).   usage: bash tools/sglang-sources.sh VERSION DIR
set -euo pipefail
V=${1:?usage: sglang-sources.sh VERSION DIR}; D=${2:?usage: sglang-sources.sh VERSION DIR}
[ -f "$D/sglang/_version.py" ] && grep -q "'$V'" "$D/sglang/_version.py" 2>/dev/null && { echo "sglang $V sources already in $D"; exit 0; }
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: -d "$W" "sglang==$V"
rm -rf "$D"; mkdir -p "$D"
python3 - "$W"/sglang-"$V"-*.whl "$D" <<'PY'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
PY
echo "sglang $V sources in $D ($(du -sh "$D" | cut -f1))"
