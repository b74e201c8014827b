"""Probe: static, dynamic and routing-chosen ragged-K (wgrad) schedules, timed side by side.

A ragged-K config either deals its tiles round-robin (with ``flatten``, one pipelined loop over
all of a program's K steps), takes them from an atomic counter (``dynamic``), or, with both set,
picks one of the two on the device from the routing (``_ragged_k_static_deal_fits``). One
sweep times each config once, in sequence, and this H100's clock drifts by more than the
differences in question; here the configs are timed in interleaved rounds (order rotated each
round) and the median per config is kept. For each config with both flags the probe also
reports which schedule the routing took: it starts the tile counter past the last tile, so a
dynamic run computes nothing (and re-zeroes the counter) while a static one never reads it.

python benchmarks/probe_ragged_k_schedules.py [--shapes te_seed ...] [--rounds 5]
    [--out-dtype bf16|fp32] [--json path]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

sys.path.insert(0, "benchmarks")
from benchmark_grouped_gemm import SHAPES, bench, dense_peak_tflops, routing_counts

from moekit.kernels import grouped_gemm as G
from moekit.kernels._runtime import tile_counter


def schedule_taken(cfg, dy, x, offs, out) -> str:
    """Which schedule a ``flatten`` + ``dynamic`` config runs on this routing."""
    counter = tile_counter(dy.device)
    counter.fill_(0)
    counter[0] = 1 << 30  # past every tile: a dynamic run takes none
    out.fill_(float("nan"))
    G.grouped_mm_ragged_k(dy.t(), x, offs, out, False, config=cfg)
    torch.cuda.synchronize()
    taken = "dynamic" if int(counter[0]) == 0 else "static"
    assert (taken == "dynamic") == bool(torch.isnan(out).all()), "mixed schedules"
    counter.fill_(0)
    return taken


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["te_seed"])
    ap.add_argument("--routings", nargs="*", default=["uniform", "skewed"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out-dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dtype = torch.bfloat16
    fp32 = args.out_dtype == "fp32"
    cands = [c for c in G._candidates("k", dtype) if c.block_n == 256]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    peak = dense_peak_tflops(dtype)
    print(f"{torch.cuda.get_device_name()}  dense peak {peak:.0f} TFLOP/s  out {args.out_dtype}")
    rows = []
    for name, T, E, H, F in SHAPES:
        if name not in args.shapes:
            continue
        for routing in args.routings:
            counts = routing_counts(T, E, routing == "skewed", gen)
            offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
            x = torch.randn(T, H, device="cuda", dtype=dtype)
            dy = torch.randn(T, 2 * F, device="cuda", dtype=dtype)
            out = torch.zeros(E, 2 * F, H, device="cuda", dtype=torch.float32 if fp32 else dtype)
            flops = 2 * T * H * 2 * F
            fns = {"torch._grouped_mm": lambda: torch._grouped_mm(dy.t(), x, offs=offs)}
            if fp32:
                fns["torch._grouped_mm"] = lambda: out.add_(torch._grouped_mm(dy.t(), x, offs=offs))
            taken = {}
            for cfg in cands:
                fns[str(cfg)] = lambda c=cfg: G.grouped_mm_ragged_k(
                    dy.t(), x, offs, out, fp32, config=c
                )
                try:
                    fns[str(cfg)]()  # compile; configs that do not fit are left out
                except Exception as exc:  # report and go on
                    print(f"  skip {cfg}: {type(exc).__name__}")
                    del fns[str(cfg)]
                    continue
                if cfg.flatten and cfg.dynamic and not fp32:
                    taken[str(cfg)] = schedule_taken(cfg, dy, x, offs, out.to(dtype))
            times = {k: [] for k in fns}
            keys = list(fns)
            for r in range(args.rounds):
                for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
                    times[k].append(bench(fns[k]))
            base = statistics.median(times["torch._grouped_mm"])
            for k in keys:
                ms = statistics.median(times[k])
                row = {"shape": name, "routing": routing, "out": args.out_dtype, "config": k,
                       "tflops": flops / ms / 1e9, "ratio_vs_torch": base / ms,
                       "spread_pct": 100 * (max(times[k]) - min(times[k])) / ms,
                       "schedule": taken.get(k, "")}  # fmt: skip
                rows.append(row)
                short = k.replace(
                    "GemmConfig(block_m=128, block_n=256, block_k=64, group_m=8, ", ""
                )
                print(
                    f"{name:10s} {routing:8s} {row['tflops']:6.0f} TF/s  x{row['ratio_vs_torch']:.3f}"
                    f"  ±{row['spread_pct']:4.1f}%  {row['schedule']:8s} {short[:150]}"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "peak": peak, "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
