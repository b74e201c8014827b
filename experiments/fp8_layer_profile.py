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

# fc1 with the activation: the GEMM's epilogue quantizing it (one kernel) against the FP8 GEMM
# writing bf16 h and the activation kernel quantizing from it (two), on this shape's rows
import triton  # noqa: E402

from moekit.ops import fp8_mlp, permute  # noqa: E402
from moekit.ops.fp8_gemm import grouped_mm_fp8  # noqa: E402
from moekit.ops.fp8_linear import fp8_weight  # noqa: E402

with torch.no_grad():
    r = layer.router(x)
    d = permute(x, r.indices, r.probs, num_experts=E, align=128, fp8=Fp8Recipe())
    w1q, _ = fp8_weight(layer.experts.fc1_weight)
    p = d.probs.to(torch.bfloat16)
    consts = [7.0, 1.702, 1.0]
    xq = d.hidden

    def fused():
        return fp8_mlp._fc1(
            xq.data,
            xq.scale,
            w1q.data,
            w1q.scale,
            d.offsets,
            p,
            "swiglu",
            consts,
            0,
            False,
            torch.bfloat16,
        )

    def two_kernels():
        h = grouped_mm_fp8(xq, w1q, d.offsets)
        return fp8_mlp._act(h, p, d.offsets, "swiglu", consts, 0, False)

    for name, fn in (("fused epilogue", fused), ("gemm + act kernel", two_kernels)):
        print(f"fc1 + act, {name}: {triton.testing.do_bench(fn, warmup=10, rep=50):.3f} ms")
