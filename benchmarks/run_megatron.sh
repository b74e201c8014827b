#!/usr/bin/env bash
# The Megatron-Core backend: its GPU tests (a tiny GPT-MoE against SequentialMLP), its CPU
# tests against the installed megatron-core, benchmark_megatron.py, and the example's training
# run on one GPU; with several GPUs also the expert-parallel check (EP = every GPU against
# EP 1) and benchmark_megatron.py --ep; a compact table last.
#   bash benchmarks/run_megatron.sh bench_out     (TESTS=0 / BENCH=0 / EXAMPLE=0 / EP=0 skip parts)
# megatron-core from wheels in .whl/ when there are any (the GPU image has none installed).
set -uo pipefail
# NVLink multicast is forbidden on the test machines: keep these three set in every launch.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
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
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "${EP:-1}" != 0 ] && [ "$NGPU" -ge 2 ]; then
  RUN="$PY -m torch.distributed.run --standalone --nproc_per_node=$NGPU"
  timeout "${CHECK_S:-240}" $RUN tests/integrations/gpu_megatron_ep_check.py \
    > "$OUT/megatron_ep_check.log" 2>&1
  echo "EP check: exit $?"; grep -E "^ok|Error|assert" "$OUT/megatron_ep_check.log" | head -12
  timeout "${BENCH_S:-300}" $RUN benchmarks/benchmark_megatron.py --ep --out "$OUT" 2>&1 \
    | grep -v -i warn | tail -8
fi
