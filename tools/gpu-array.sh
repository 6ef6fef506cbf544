#!/bin/bash
# Run ON the GPU test machine from the project root (root; .whl and .tools carried): N RAM-backed
# loop devices (tools/loop-array.sh) and `tiercache bench array` over them, JSON and log in $OUT.
#   bash tools/gpu-array.sh NAME N [tiercache bench array options...]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
name=${1:?usage: gpu-array.sh NAME N [options]}; n=${2:?usage: gpu-array.sh NAME N [options]}; shift 2
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PWD/.tools:$PATH TIERCACHE_FIO=$PWD/.tools/fio
if ! command -v tiercache >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
fi
roots=()
for m in $(bash tools/loop-array.sh up "$n" "${LOOP_SIZE:-6G}" /mnt/tcarray); do roots+=(--root "$m"); done
nproc; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
tiercache bench array "${roots[@]}" --output-format json "$@" > "$OUT/$name.json" 2> "$OUT/$name.err"
rc=$?
python3 - "$OUT/$name.json" <<'PY' || tail -30 "$OUT/$name.err"
import json, sys
from tiercache.bench.bencharray import format_array
print(format_array(json.load(open(sys.argv[1]))))
PY
echo "bench exit: $rc"
