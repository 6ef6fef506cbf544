#!/bin/bash
# Run ON the GPU machine from the project root: vLLM 0.26 end to end (tiercache bench
# vllm-serve). Copied over: .vllm-gpu/p2 (vLLM 0.26.0's wheel, split in two pieces; the first,
# .vllm-gpu/p1/part.00, copied to /tmp/stage beforehand), .whl (tools/fetch-wheels.sh), .tools/fio.
#   bash tools/lab/gpu-serve.sh setup               install vLLM, kvikio and the project (idempotent)
#   bash tools/lab/gpu-serve.sh tests [PYTEST ARGS] the vLLM tests there (default: serve GPU test, tier tests)
#   bash tools/lab/gpu-serve.sh bench NAME ARGS...  tiercache bench vllm-serve ARGS (JSON in $OUT/NAME.json)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/vsite:/tmp/site PATH=/tmp/site/bin:$PATH TIERCACHE_FIO=$PWD/.tools/fio
case "${1:-}" in
setup)
  bash .vllm-gpu/p2/install.sh || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  df -h . /var/tmp /tmp /dev/shm | sed 1d
  python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>&1 | tail -1 ;;
tests)
  shift
  python3 -m pytest -q -p no:cacheprovider -rs "${@:-tests/test_bench_serve.py}" 2>&1 | tee "$OUT/tests-$(date +%s).log" | tail -40 ;;
bench)
  name=$2; shift 2
  tiercache bench vllm-serve --output-format json "$@" > "$OUT/$name.json" 2> "$OUT/$name.err"
  rc=$?
  python3 - "$OUT/$name.json" <<'PY' || tail -30 "$OUT/$name.err"
import json, sys
from tiercache.bench.benchvllmserve import format_serve_report
for rep in json.load(open(sys.argv[1]))["runs"]:
    print(format_serve_report(rep))
PY
  echo "bench exit: $rc" ;;
*) echo "usage: gpu-serve.sh setup|tests|bench NAME ARGS" >&2; exit 2 ;;
esac
