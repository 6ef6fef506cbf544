#!/bin/bash
# Run ON the GPU test machine from the project root, with .whl carried (see tools/fetch-wheels.sh):
# installs the wheels and the project (no network there), runs the whole test suite (GPU tests
# included), then the main job, leaving logs and JSON in $OUT. Extra benchmark commands can be
# passed as arguments; each runs after the tests, its output in $OUT/extra-N.log.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PWD/.tools:$PATH
# huge pages for the host tier (host_huge_pages = "auto" takes them) and for the GPU tests that
# need them: HUGEPAGES=0 runs everything on 4 KiB pages
if [ -w /proc/sys/vm/nr_hugepages ]; then echo "${HUGEPAGES:-1536}" > /proc/sys/vm/nr_hugepages; fi
grep -E "HugePages_(Total|Free)" /proc/meminfo | tr '\n' ' '; echo
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import kvikio, kvikio.defaults as d; print('kvikio', kvikio.__version__, 'compat preferred:', d.is_compat_mode_preferred())"
rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-tests} 2>&1 | tee "$OUT/tests.log"
  rc=${PIPESTATUS[0]}
  echo "tests exit: $rc"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  tiercache bench 2>&1 | tee "$OUT/bench.txt"
  echo "bench exit: ${PIPESTATUS[0]}"
  tiercache bench --output-format json > "$OUT/bench.json" 2> "$OUT/bench-json.err"
  echo "bench json exit: $?"
fi
n=0
for cmd in "$@"; do
  n=$((n + 1))
  echo "== extra $n: $cmd"
  bash -c "$cmd" 2>&1 | tee "$OUT/extra-$n.log"
done
exit $rc
