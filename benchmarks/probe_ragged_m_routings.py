"""Probe: how moekit's ragged-M candidates and torch._grouped_mm fare across routing draws.

The grouped-GEMM benchmark draws one skewed (gamma) routing per run; the autotuner then picks
a config on that routing. This probe draws several routings per shape and times every
ragged-M candidate and torch._grouped_mm on each, to see how much the ratio to torch moves
with the routing alone and whether one candidate is best throughout.

python benchmarks/probe_ragged_m_routings.py [--draws 6] [--shapes deepseek_v3_ep8 ...]
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, "benchmarks")
from benchmark_grouped_gemm import SHAPES, bench, routing_counts

from moekit.kernels import grouped_gemm as G


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=6)
    ap.add_argument("--shapes", nargs="*", default=["deepseek_v3_ep8"])
    ap.add_argument("--passes", nargs="*", default=["fc1_fwd", "fc2_fwd", "fc1_dgrad"])
    args = ap.parse_args()
    cands = G._candidates("m", torch.bfloat16)
    table = []
    for name, T, E, H, F in SHAPES:
        if name not in args.shapes:
            continue
        for which in args.passes:
            # (K, N, weight [E, N, K] used as b = w^T, or [E, K, N] used as is for dgrad)
            K, N = {"fc1_fwd": (H, 2 * F), "fc2_fwd": (F, H), "fc1_dgrad": (2 * F, H)}[which]
            a = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            if which == "fc1_dgrad":
                b = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16) * 0.05
            else:
                b = (torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * 0.05).transpose(
                    -2, -1
                )
            out = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
            flops = 2 * T * N * K
            for draw in range(args.draws):
                torch.manual_seed(1000 + draw)
                counts = routing_counts(T, E, True, torch.Generator().manual_seed(draw))
                offsets = torch.cumsum(counts, 0).to(torch.int32).cuda()
                torch_tf = flops / bench(lambda: torch._grouped_mm(a, b, offs=offsets)) / 1e9
                tfs = []
                for cfg in cands:
                    try:
                        ms = bench(
                            lambda c=cfg: G.grouped_mm_ragged_m(a, b, offsets, out, config=c)
                        )
                        tfs.append(flops / ms / 1e9)
                    except Exception as exc:  # a candidate may not build
                        print("candidate failed", cfg, str(exc)[:120])
                        tfs.append(0.0)
                top = sorted(counts.tolist(), reverse=True)[:3]
                idle = int((counts == 0).sum())
                small = int(((counts > 0) & (counts < 128)).sum())
                table.append((name, which, draw, top, idle, small, torch_tf, tfs))
                print(table[-1][:7], [round(x) for x in tfs], flush=True)
    print(
        "\nshape pass draw | top-3 counts | idle small | torch | best moekit (cand) | ratio | per candidate"
    )
    for name, which, draw, top, idle, small, torch_tf, tfs in table:
        best = max(range(len(tfs)), key=tfs.__getitem__)
        print(
            f"{name[:8]} {which} {draw} | {top} | {idle} {small} | {torch_tf:6.1f} | "
            f"{tfs[best]:6.1f} ({best}) | {tfs[best] / torch_tf:5.3f} | "
            + " ".join(f"{x:5.0f}" for x in tfs)
        )
    for i, c in enumerate(cands):
        print(i, c)


if __name__ == "__main__":
    main()
