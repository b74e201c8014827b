"""DRAM traffic and time of several ragged-K (wgrad, bf16 out) configs.

    ncu --clock-control none -k regex:ragged_k --metrics dram__bytes_read.sum,... \
        python benchmarks/probe_ncu_ragged_k_configs.py --shapes qwen3_30b_a3b
    python benchmarks/probe_ncu_ragged_k_configs.py --time --rounds 4 --shapes ...

Without --time each config runs twice (warm, then profiled) on the benchmark's skewed routing
(seed 0), in the order printed; ncu lists the launches in the same order. With --time the
configs and torch._grouped_mm are timed in interleaved rounds (order reversed every other
round, best median kept) and the outputs checked equal to the first config's.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from benchmark_grouped_gemm import SHAPES, bench, routing_counts

from moekit.kernels import grouped_gemm as G


def configs() -> list[G.GemmConfig]:
    base = G._RAGGED_K_DEFAULT_16
    static = dataclasses.replace(base, dynamic=False)  # flattened static deal
    return [
        base,
        static,
        dataclasses.replace(static, num_stages=4),
        dataclasses.replace(base, flatten=False),  # dynamic schedule
        # pointer stores from registers: no shared-memory C buffer (so no wait for the TMA
        # store to drain it between the sub-tiled halves), which leaves room for 4 stages
        dataclasses.replace(static, c_tma=False, epilogue_subtile=False, num_stages=4),
        dataclasses.replace(base, c_tma=False, epilogue_subtile=False, num_stages=4),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["qwen3_30b_a3b"])
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    cfgs = configs()
    for i, cfg in enumerate(cfgs):
        print(i, cfg, flush=True)
    for name, T, E, H, F in SHAPES:
        if name not in args.shapes:
            continue
        torch.manual_seed(0)
        counts = routing_counts(T, E, True, torch.Generator().manual_seed(0))
        offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(T, 2 * F, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(E, 2 * F, H, device="cuda", dtype=torch.bfloat16)
        print(f"{name}: ideal DRAM bytes read {(x.numel() + dy.numel()) * 2 / 1e6:.1f} MB, "
              f"written {out.numel() * 2 / 1e6:.1f} MB")  # fmt: skip

        def run(cfg):
            return G.grouped_mm_ragged_k(dy.t(), x, offs, out, False, config=cfg)

        if not args.time:
            for cfg in cfgs:
                for _ in range(2):
                    run(cfg)
                torch.cuda.synchronize()
            continue
        ref = run(cfgs[0]).clone()
        for cfg in cfgs[1:]:
            if not torch.equal(run(cfg), ref):
                print("MISMATCH", cfg, flush=True)
        flops = 2 * T * 2 * F * H
        fns = [lambda c=c: run(c) for c in cfgs]
        fns.append(lambda: torch._grouped_mm(dy.t(), x, offs=offs))
        best = [float("inf")] * len(fns)
        for r in range(args.rounds):
            order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
            for i in order:
                best[i] = min(best[i], bench(fns[i]))
        tf = [flops / ms / 1e9 for ms in best]
        print(f"{name} TFLOP/s per config, torch last: " + " ".join(f"{t:.0f}" for t in tf))
        print(f"{name} ratio vs torch: " + " ".join(f"{t / tf[-1]:.3f}" for t in tf[:-1]))


if __name__ == "__main__":
    main()
