#!/usr/bin/env bash
# Expert parallelism on every local GPU: the torchrun checks, the training example (TRAIN=1), then
# benchmark_moe_layer.py at EP 1, the largest EP and 2 (scaling against this machine's EP 1 run).
#   bash benchmarks/run_moe_ep.sh bench_out      (MOEKIT_EP_CHECK_STEPS=0 skips the checks;
#   BENCH_EPS="4" EP1_JSON=... times one EP size against an earlier EP 1 file; BENCH_ARGS are
#   passed to every EP > 1 run, e.g. "--ep-chunks 4")
# NVLink multicast is forbidden on the test machines: keep these three set in every launch.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${1:-bench_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# the GPUs this process may use (CUDA_VISIBLE_DEVICES honoured, unlike nvidia-smi's list)
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
RUN="$PY -m torch.distributed.run --standalone"
nvidia-smi topo -m | head -8
if [ "${MOEKIT_EP_CHECK_STEPS:-1000}" != 0 ]; then
  timeout "${CHECK_S:-300}" $RUN --nproc_per_node="$NGPU" tests/distributed/gpu_moe_ep_check.py \
    > "$OUT/ep_check.log" 2>&1
  echo "checks: exit $?"; grep -E "^ok|PASSED|Error|error|assert" "$OUT/ep_check.log" | head -20
fi
if [ -n "${TRAIN:-}" ]; then  # the training example: 1 GPU, EP NGPU, and EP NGPU → EP 2
  R=$(mktemp -d)
  T="examples/train_moe.py --config mid --steps ${TRAIN_STEPS:-300} --no-progress"
  CUDA_VISIBLE_DEVICES=0 timeout 150 $PY $T --out "$R/mid-1gpu" | tail -1
  timeout 150 $RUN --nproc_per_node="$NGPU" $T --ep "$NGPU" --out "$R/mid-ep$NGPU" 2>&1 | tail -1
  timeout 150 $RUN --nproc_per_node="$NGPU" $T --ep "$NGPU" --out "$R/resharded" \
    --stop-after $(( ${TRAIN_STEPS:-300} / 2 )) 2>&1 | tail -1
  timeout 150 $RUN --nproc_per_node=2 $T --ep 2 --resume --out "$R/resharded" 2>&1 | tail -1
  $PY examples/compare_runs.py "$R/mid-1gpu" "$R/mid-ep$NGPU" "$R/resharded" \
    --json "$OUT/training_ep.json"
  cp "$R/mid-ep$NGPU/loss_curve.png" "$OUT/training_ep.png"
fi
BENCH=benchmarks/benchmark_moe_layer.py
for W in ${BENCH_EPS:-1 $NGPU 2}; do  # BENCH_EPS=none: no benchmark
  [ "$W" != none ] && [ "$W" -le "$NGPU" ] || continue
  if [ "$W" = 1 ]; then
    CUDA_VISIBLE_DEVICES=0 timeout "${BENCH_S:-300}" $PY $BENCH --ep 1 --out "$OUT" 2>&1 | tail -4
  else
    timeout "${BENCH_S:-300}" $RUN --nproc_per_node="$W" $BENCH --ep "$W" --out "$OUT" \
      --ep-baseline "${EP1_JSON:-$OUT/moe_layer_ep1.json}" ${BENCH_ARGS:-} 2>&1 \
      | grep -v '^{' | tail -6
  fi
done
