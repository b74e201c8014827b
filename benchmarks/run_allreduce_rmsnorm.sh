#!/usr/bin/env bash
# Correctness checks + timing grid for the fused all-reduce + add + RMSNorm, on every local GPU.
#   bash benchmarks/run_allreduce_rmsnorm.sh --out results/   (extra args go to the benchmark)
# NVLink multicast is forbidden on the test machines: keep these three set in every launch.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
# the GPUs this process may use (CUDA_VISIBLE_DEVICES honoured, unlike nvidia-smi's list)
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
  benchmarks/benchmark_allreduce_rmsnorm.py "$@"
