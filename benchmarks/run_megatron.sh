#!/usr/bin/env bash
# The Megatron-Core backend on one GPU: its GPU tests (a tiny GPT-MoE against SequentialMLP),
# its CPU tests against the installed megatron-core, benchmark_megatron.py, and the example's
# training run; a compact table last.
#   bash benchmarks/run_megatron.sh bench_out     (TESTS=0 / BENCH=0 / EXAMPLE=0 skip parts)
# megatron-core from wheels in .whl/ when there are any (the GPU image has none installed).
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${1:-bench_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/megatron_core-*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/megatron_core-*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY -c "import megatron.core, torch; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__)"
if [ "${TESTS:-1}" != 0 ]; then
  # one process per file: each sets up its own Megatron parallel state (GPU: NCCL, CPU: gloo)
  for t in test_megatron_gpu test_megatron test_megatron_fusions; do
    timeout "${TEST_S:-240}" $PY -m pytest -q -p no:cacheprovider -W ignore \
      "tests/integrations/$t.py" > "$OUT/$t.log" 2>&1
    echo "$t: exit $?"; grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/$t.log" | tail -12
  done
fi
if [ "${EXAMPLE:-1}" != 0 ]; then
  timeout "${EXAMPLE_S:-120}" $PY examples/train_megatron_moe.py --steps "${STEPS:-300}" 2>&1 \
    | grep -v -i warn | tail -8
fi
if [ "${BENCH:-1}" != 0 ]; then
  timeout "${BENCH_S:-300}" $PY benchmarks/benchmark_megatron.py --out "$OUT" ${MEGATRON_ARGS:-} \
    2>&1 | grep -v -i warn | tail -12
fi
