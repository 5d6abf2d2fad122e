#!/usr/bin/env bash
# One check for a machine with a GPU, within 8 minutes; it runs on the CPU too (what needs CUDA is
# skipped and the table says "not tested"):
#   1. the CUDA tests (the Monitor's and the LM loop's no-host-sync tests, the on-device curvature
#      tests: always skipped on the CPU), by pytest with a junit report;
#   2. the paper-profile GPT with the Monitor (benchmarks/gpu_check.py): step time every=1 and
#      memory="sketch" against off (target <= x1.05), host syncs per step (target 0), the Monitor's
#      memory (sketch target <= 5% of the parameter bytes);
# and writes one table, gpu_check.md in OUT (default: a temporary folder), printed at the end.
#   usage: benchmarks/gpu_check.sh [OUT]      (PYTHON=... to choose the interpreter)
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT="${1:-$(mktemp -d)}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
# the tests that need CUDA (skipped without it) and the no-host-sync ones
timeout 300 "$PY" -m pytest -q -p no:cacheprovider --junitxml="$OUT/cuda_tests.xml" \
  tests/test_telemetry.py tests/test_lm.py tests/test_curvature.py tests/test_sketch.py \
  -k "on_cuda or synchronise_with_the_host" > "$OUT/cuda_tests.log" 2>&1
echo "pytest (CUDA tests): exit $? after $(( $(date +%s) - start )) s; log: $OUT/cuda_tests.log"
timeout 240 "$PY" benchmarks/gpu_check.py --junit "$OUT/cuda_tests.xml" --out "$OUT/gpu_check.md"
rc=$?
echo "gpu_check.py: exit $rc; total $(( $(date +%s) - start )) s; table: $OUT/gpu_check.md"
exit $rc
