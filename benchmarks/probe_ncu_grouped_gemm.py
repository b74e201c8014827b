"""Hardware counters of one grouped GEMM call, moekit against torch._grouped_mm (run under ncu).

    ncu --clock-control none --kernel-name regex:'ragged|cutlass|gemm|Gemm' \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,... \
        python benchmarks/probe_ncu_grouped_gemm.py --shape qwen3_30b_a3b --pass fc1_fwd

Each contender is called twice (a warm call, then the profiled one; ncu sees both). Routing:
the benchmark's skewed gamma draw (seed 0), or uniform. Prints the ideal DRAM bytes of the
pass (every operand read once, the output written once) to compare with dram__bytes_*.
"""

from __future__ import annotations

import argparse
import math

import torch
from benchmark_grouped_gemm import SHAPES, routing_counts

from moekit.ops import grouped_mm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3_30b_a3b")
    ap.add_argument(
        "--pass",
        dest="pass_",
        default="fc1_fwd",
        choices=["fc1_fwd", "fc2_fwd", "fc1_dgrad", "fc1_wgrad_bf16"],
    )
    ap.add_argument("--uniform", action="store_true")
    ap.add_argument("--only", choices=["moekit", "torch"], default=None)
    args = ap.parse_args()
    name, T, E, H, F = next(s for s in SHAPES if s[0] == args.shape)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    counts = routing_counts(T, E, not args.uniform, gen)
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    dt = torch.bfloat16
    x = torch.randn(T, H, device="cuda", dtype=dt)
    h = torch.randn(T, F, device="cuda", dtype=dt)
    dy = torch.randn(T, 2 * F, device="cuda", dtype=dt)
    w1 = torch.randn(E, 2 * F, H, device="cuda", dtype=dt) / math.sqrt(H)
    w2 = torch.randn(E, H, F, device="cuda", dtype=dt) / math.sqrt(F)
    a, b, ragged_k = {
        "fc1_fwd": (x, w1.transpose(1, 2), False),
        "fc2_fwd": (h, w2.transpose(1, 2), False),
        "fc1_dgrad": (dy, w1, False),
        "fc1_wgrad_bf16": (dy.t(), x, True),
    }[args.pass_]
    if ragged_k:
        M, N = a.shape[0], b.shape[1]
        flops = 2 * T * M * N
        ideal = (a.numel() + b.numel() + E * M * N) * 2
    else:
        K, N = b.shape[1], b.shape[2]
        flops = 2 * T * K * N
        ideal = (a.numel() + b.numel() + T * N) * 2
    print(
        f"{name} {args.pass_} T={T} E={E} H={H} F={F} routing="
        f"{'uniform' if args.uniform else 'skewed'}: {flops / 1e9:.1f} GFLOP, "
        f"ideal DRAM bytes {ideal / 1e6:.1f} MB"
    )
    for who in ("moekit", "torch"):
        if args.only and who != args.only:
            continue
        fn = (
            (lambda: grouped_mm(a, b, offs))
            if who == "moekit"
            else (lambda: torch._grouped_mm(a, b, offs=offs))
        )
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        print(f"{who}: done")


if __name__ == "__main__":
    main()
