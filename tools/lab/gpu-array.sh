#!/bin/bash
# Run ON the GPU test machine from the project root (root; .whl and .tools carried): N RAM-backed
# loop devices (tools/loop-array.sh) and `tiercache bench array` over them, JSON and log in $OUT.
#   bash tools/lab/gpu-array.sh NAME N [tiercache bench array options...]
# LOOP_FS=xfs: XFS instead of ext4 (mkfs.xfs from the machine, else .tools/xfs/ with its two
# libraries), mounted under /mnt/tc$LOOP_FS so both can be up at once.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
name=${1:?usage: gpu-array.sh NAME N [options]}; n=${2:?usage: gpu-array.sh NAME N [options]}; shift 2
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PWD/.tools:$PATH TIERCACHE_FIO=$PWD/.tools/fio
if ! command -v tiercache >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
fi
if [ "${LOOP_FS:-ext4}" = xfs ] && ! command -v mkfs.xfs >/dev/null && [ -x .tools/xfs/mkfs.xfs ]; then
  export PATH=$PWD/.tools/xfs:$PATH LD_LIBRARY_PATH=$PWD/.tools/xfs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
roots=()
for m in $(bash tools/loop-array.sh up "$n" "${LOOP_SIZE:-6G}" "/mnt/tc${LOOP_FS:-ext4}"); do roots+=(--root "$m"); done
nproc; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
tiercache bench array "${roots[@]}" --output-format json "$@" > "$OUT/$name.json" 2> "$OUT/$name.err"
rc=$?
python3 - "$OUT/$name.json" <<'PY' || tail -30 "$OUT/$name.err"
import json, sys
from tiercache.bench.bencharray import format_array
print(format_array(json.load(open(sys.argv[1]))))
PY
echo "bench exit: $rc"
