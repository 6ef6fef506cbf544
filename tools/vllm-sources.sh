#!/bin/bash
# The Python sources of one vLLM release, without its compiled extensions or dependency set:
# enough for vLLM's KV-offloading code (the tiering managers, the spec factory, FileMapper),
# which is what tiercache's vLLM tier is tested against on the CPU. README.md, "Quick start",
# runs tests/test_vllm_tier.py against 0.26.0's sources this way (CI too), beside the installed
# 0.33.0.   usage: bash tools/vllm-sources.sh VERSION DIR
set -euo pipefail
V=${1:?usage: vllm-sources.sh VERSION DIR}; D=${2:?usage: vllm-sources.sh VERSION DIR}
[ -f "$D/vllm/version.py" ] && grep -q "$V" "$D/vllm/version.py" 2>/dev/null && { echo "vllm $V sources already in $D"; exit 0; }
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$W" "vllm==$V"
rm -rf "$D"; mkdir -p "$D"
python3 - "$W"/vllm-"$V"-*.whl "$D" <<'PY'
import sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    z.extractall(out, [n for n in z.namelist() if n.endswith(".py") or n.endswith(".json") or ".dist-info/" in n])
PY
echo "vllm $V sources in $D ($(du -sh "$D" | cut -f1))"
