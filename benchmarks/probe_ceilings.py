"""Probe: how far the ≥ 1.15× target is from what cuBLAS reaches on waste-free versions of a pass.

For each pass of the fine-grained benchmark shapes, timed in the same interleaved rounds:
  * torch._grouped_mm and moekit on the benchmark's kind of skewed routing (seed 0);
  * both on uniform routing (T / E rows per expert);
  * cuBLAS on a version of the product with no ragged tiles: ragged M as one dense
    torch.mm [T, K] @ [K, N]; ragged K (wgrad) as torch.bmm over E uniform experts
    ([E, M, T/E] @ [E, T/E, N]), the short-K batched GEMM the fine-grained wgrads are;
  * for ragged M, the rows a 128-row tile computes on the skewed routing over the rows it
    keeps (every expert's last tile runs to a multiple of 128): dense / that factor is what a
    kernel at the dense rate with 128-row tiles would reach on the skewed routing.

    python benchmarks/probe_ceilings.py [--shapes qwen3_30b_a3b olmoe] [--rounds 2]

The last table prints, per pass, 1.15 × torch (the target), moekit, and those references.
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, "benchmarks")
from benchmark_grouped_gemm import SHAPES, bench, routing_counts, skewed_routing

from moekit.ops import grouped_mm

BLOCK_M = 128


def computed_rows(counts: torch.Tensor) -> int:
    return int((torch.div(counts + BLOCK_M - 1, BLOCK_M, rounding_mode="floor") * BLOCK_M).sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--shapes", nargs="*", default=["te_seed", "qwen3_30b_a3b", "olmoe", "gpt_oss_like"]
    )
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    dt = torch.bfloat16
    table = []
    for name, T, E, H, F in SHAPES:
        if name not in args.shapes:
            continue
        torch.manual_seed(0)
        skew = skewed_routing(T, E, 0)  # the benchmark's draw 0
        uni = routing_counts(T, E, False, torch.Generator())
        offs = {r: torch.cumsum(c, 0).to(torch.int32).cuda() for r, c in (("s", skew), ("u", uni))}
        waste = computed_rows(skew) / T
        for pname, K, N in (("fc1_fwd", H, 2 * F), ("fc2_fwd", F, H), ("fc1_dgrad", 2 * F, H)):
            a = torch.randn(T, K, device="cuda", dtype=dt)
            # as the benchmark: fc1/fc2 take the transposed view of an [E, N, K] weight
            if pname == "fc1_dgrad":
                w = torch.randn(E, K, N, device="cuda", dtype=dt) * 0.05
            else:
                w = (torch.randn(E, N, K, device="cuda", dtype=dt) * 0.05).transpose(1, 2)
            dense_b = w[0]
            fns = {
                "torch_s": lambda: torch._grouped_mm(a, w, offs=offs["s"]),
                "moekit_s": lambda: grouped_mm(a, w, offs["s"]),
                "torch_u": lambda: torch._grouped_mm(a, w, offs=offs["u"]),
                "moekit_u": lambda: grouped_mm(a, w, offs["u"]),
                "cublas_dense": lambda: torch.mm(a, dense_b),
            }
            tf = _time(fns, 2 * T * K * N, args.rounds)
            tf["dense_at_128_row_tiles"] = tf["cublas_dense"] / waste
            table.append((name, pname, waste, tf))
            print(table[-1], flush=True)
        # wgrad, bf16 out: dW1 [E, 2F, H] = dy^T @ x per expert
        M, N = 2 * F, H
        dy = torch.randn(T, M, device="cuda", dtype=dt)
        x = torch.randn(T, N, device="cuda", dtype=dt)
        per = T // E
        dyb = dy[: per * E].reshape(E, per, M).transpose(1, 2)  # [E, M, per], a strided view
        xb = x[: per * E].reshape(E, per, N)
        fns = {
            "torch_s": lambda: torch._grouped_mm(dy.t(), x, offs=offs["s"]),
            "moekit_s": lambda: grouped_mm(dy.t(), x, offs["s"]),
            "torch_u": lambda: torch._grouped_mm(dy.t(), x, offs=offs["u"]),
            "moekit_u": lambda: grouped_mm(dy.t(), x, offs["u"]),
            "cublas_bmm_uniform": lambda: torch.bmm(dyb, xb),
            "cublas_dense": lambda: torch.mm(dy.t(), x),
        }
        tf = _time(fns, 2 * T * M * N, args.rounds)
        table.append((name, "wgrad_bf16", 1.0, tf))
        print(table[-1], flush=True)

    cols = [
        "torch_s", "moekit_s", "torch_u", "moekit_u", "cublas_dense", "dense_at_128_row_tiles",
        "cublas_bmm_uniform",
    ]  # fmt: skip
    print("\nTFLOP/s (s: skewed routing, u: uniform); target = 1.15 x torch_s")
    print(f"{'shape':14s} {'pass':10s} {'waste':>5s} {'target':>6s} " + " ".join(
        f"{c[:12]:>12s}" for c in cols
    ))  # fmt: skip
    for name, pname, waste, tf in table:
        print(
            f"{name[:14]:14s} {pname:10s} {waste:5.3f} {1.15 * tf['torch_s']:6.0f} "
            + " ".join(f"{tf.get(c, float('nan')):12.0f}" for c in cols)
        )


def _time(fns: dict, flops: int, rounds: int) -> dict:
    """Each function's best median over interleaved rounds (order reversed every other round),
    as TFLOP/s."""
    best = dict.fromkeys(fns, float("inf"))
    names = list(fns)
    for r in range(rounds):
        for k in names if r % 2 == 0 else reversed(names):
            best[k] = min(best[k], bench(fns[k]))
    return {k: flops / ms / 1e9 for k, ms in best.items()}


if __name__ == "__main__":
    main()
