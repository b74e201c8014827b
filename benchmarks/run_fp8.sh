#!/usr/bin/env bash
# FP8 on one GPU: the GPU tests of every FP8 op and of the bf16 kernels they share code with,
# then benchmark_fp8.py and benchmark_moe_layer.py --fp8; a compact table last.
#   bash benchmarks/run_fp8.sh bench_out     (TESTS=0 skips the tests, BENCH=0 the benchmarks)
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${1:-bench_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${TESTS:-1}" != 0 ]; then
  FP8_TESTS="tests/ops/test_quantize.py tests/ops/test_fp8_gemm.py tests/ops/test_permute_fp8.py
    tests/ops/test_fp8_mlp.py tests/nn/test_moe_fp8.py"
  SHARED="tests/ops/test_grouped_gemm.py tests/ops/test_grouped_mlp.py tests/ops/test_permute.py
    tests/nn/test_moe.py"
  timeout "${TEST_S:-420}" $PY -m pytest -q -m gpu -p no:cacheprovider $FP8_TESTS $SHARED \
    > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests: exit $?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu_tests.log" | tail -25
fi
if [ "${BENCH:-1}" != 0 ]; then
  timeout "${BENCH_S:-300}" $PY benchmarks/benchmark_fp8.py --out "$OUT" 2>&1 | tail -30
  timeout "${BENCH_S:-300}" $PY benchmarks/benchmark_moe_layer.py --fp8 --quick --out "$OUT" \
    ${MOE_ARGS:-} 2>&1 | tail -8
fi
