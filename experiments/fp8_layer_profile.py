"""Where an FP8 MoE layer step's GPU time goes: the kernels of one forward + backward of the
FP8 layer and of the bf16 layer (align 128) on the same weights, by total CUDA time.

    PYTHONPATH=. python experiments/fp8_layer_profile.py [--shape qwen3_30b_a3b]
"""

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "benchmarks")
from benchmark_moe_layer import SHAPES, make_layer

from moekit import Fp8Recipe
from moekit.nn import DispatchConfig, MoELayer
from moekit.ops.router import RouterConfig

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="qwen3_30b_a3b")
ap.add_argument("--rows", type=int, default=22)
args = ap.parse_args()
T, E, k, H, Fd, opts, _ = SHAPES[args.shape]
layer, x, dy = make_layer(T, E, k, H, Fd, opts, "cuda", torch.bfloat16, seed=0)
layer.dispatch = DispatchConfig(align=128)
fp8 = MoELayer(
    H,
    Fd,
    E,
    k,
    router=RouterConfig(aux_loss_coeff=1e-2, **opts),
    fp8=Fp8Recipe(),
    device="meta",
    dtype=torch.bfloat16,
)
fp8.router = layer.router
fp8.experts.fc1_weight, fp8.experts.fc2_weight = layer.experts.fc1_weight, layer.experts.fc2_weight
ins = [x, layer.router.weight, layer.experts.fc1_weight, layer.experts.fc2_weight]
for name, m in (("fp8", fp8), ("bf16", layer)):
    step = lambda m=m: torch.autograd.grad(m(x), ins, dy)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(f"== {name} {args.shape}")
    print(
        prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70
        )
    )
