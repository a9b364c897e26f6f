#!/usr/bin/env bash
# One device call: GPU tests, then the layer benchmark. Usage (on the GPU machine, repo root):
#   bash benchmarks/device_check.sh [pytest -k expr] [bench args...]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
K=${1:-}; shift || true
if [ "$K" != "skip" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/test_gpu.py} ${K:+-k "$K"} 2>&1 | tee "$OUT/gpu_tests.log"
fi
if [ $# -gt 0 ]; then
  timeout ${BENCH_TIMEOUT:-400} python3 -m minimax_ops bench "$@" 2>&1 | tee "$OUT/bench.log"
fi
