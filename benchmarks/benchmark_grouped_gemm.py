"""Grouped GEMM: moekit's grouped_mm against torch._grouped_mm and a per-expert loop.

    python benchmarks/benchmark_grouped_gemm.py --out bench_out [--quick] [--draws 3] [--shapes ...]

Per MoE shape and pass (fc1, fc2, dgrad: ragged M; wgrad: ragged K, fp32 main_grad and bf16):
do_bench median, best of 3 rounds in turns with the dense torch.mm 8192³ ceiling (same clock).
Skewed draws (and uniform for the first shape); targets on the geometric mean over --draws.
"""

from __future__ import annotations

import math
import statistics

import common as bc
import torch

from moekit.ops import grouped_mm
from moekit.tuning.grouped_gemm import tuned_configs

SHAPES = [  # name, T routed rows, E experts, H hidden, F expert width (real MoE layers)
    ("te_seed", 66560, 20, 2048, 512), ("qwen3_30b_a3b", 65536, 128, 2048, 768),
    ("olmoe", 32768, 64, 2048, 1024), ("deepseek_v3_ep8", 32768, 32, 7168, 2048),
    ("mixtral", 16384, 8, 4096, 14336), ("gpt_oss_like", 32768, 128, 2880, 2880)]  # fmt: skip


def passes(T, E, H, F, counts, dtype) -> dict:
    """pass -> (FLOPs, moekit, torch, loop) on random operands of one routing."""
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    bounds = [0, *torch.cumsum(counts, 0).tolist()]
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=dtype)
    x, h, dy = rnd(T, H), rnd(T, F), rnd(T, 2 * F)
    w1, w2 = rnd(E, 2 * F, H) / math.sqrt(H), rnd(E, H, F) / math.sqrt(F)
    main_grad = torch.zeros(E, 2 * F, H, device="cuda", dtype=torch.float32)
    main_grad_t = torch.zeros_like(main_grad)

    def loop_m(a, b):  # per-expert torch.mm over host-known slices (b: [E, K, N])
        out = torch.empty(a.shape[0], b.shape[2], device="cuda", dtype=dtype)
        for e in range(E):
            if bounds[e + 1] > bounds[e]:
                torch.mm(a[bounds[e] : bounds[e + 1]], b[e], out=out[bounds[e] : bounds[e + 1]])
        return out

    def loop_k(a, b):
        out = torch.empty(E, a.shape[0], b.shape[1], device="cuda", dtype=dtype)
        for e in range(E):
            torch.mm(a[:, bounds[e] : bounds[e + 1]], b[bounds[e] : bounds[e + 1]], out=out[e])
        return out

    w1t, w2t, dyt = w1.transpose(1, 2), w2.transpose(1, 2), dy.t()
    ragged_m = {"fc1_fwd": (x, w1t, 4 * T * H * F), "fc2_fwd": (h, w2t, 2 * T * F * H),
                "fc1_dgrad": (dy, w1, 4 * T * F * H)}  # fmt: skip
    out = {p: (fl, lambda a=a, b=b: grouped_mm(a, b, offs),
               lambda a=a, b=b: torch._grouped_mm(a, b, offs=offs), lambda a=a, b=b: loop_m(a, b))
           for p, (a, b, fl) in ragged_m.items()}  # fmt: skip
    # torch refuses an fp32 out: its equivalent is a bf16 out added into main_grad
    out["fc1_wgrad_fp32"] = (4 * T * F * H,
                             lambda: grouped_mm(dyt, x, offs, out=main_grad, accumulate=True),
                             lambda: main_grad_t.add_(torch._grouped_mm(dyt, x, offs=offs)),
                             lambda: main_grad_t.add_(loop_k(dyt, x)))  # fmt: skip
    out["fc1_wgrad_bf16"] = (4 * T * F * H, lambda: grouped_mm(dyt, x, offs),
                             lambda: torch._grouped_mm(dyt, x, offs=offs),
                             lambda: loop_k(dyt, x))  # fmt: skip
    return out


def run_case(name, T, E, H, F, counts, draw, peak, quick, dense: bc.DensePeak) -> list[dict]:
    """Every pass of one shape on one routing (``draw`` None: uniform counts): one row each."""
    rows = []
    for pname, (flops, ours, theirs, loop) in passes(T, E, H, F, counts, torch.bfloat16).items():
        # the dense peak in the same rounds (% of peak at one clock); a layout torch refuses: NaN
        fns = {"dense": dense.mm, "moekit": ours, "torch": theirs,
               **({} if quick else {"loop": loop})}  # fmt: skip
        r = {"shape": name, "routing": "uniform" if draw is None else "skewed", "draw": draw,
             "T": T, "E": E, "H": H, "F": F, "pass": pname, "loop_ms": math.nan}  # fmt: skip
        bc.measure(fns, {"ms": bc.bench_ms}, 3, r)
        pass_peak = dense.tflops(r.pop("dense_ms"))
        r.update({f"{c}_tflops": flops / r[f"{c}_ms"] / 1e9 for c in ("moekit", "torch", "loop")})
        r.update(ratio_vs_torch=r["torch_ms"] / r["moekit_ms"], floor_ms=flops / (peak * 1e9),
                 ratio_per_round=[t / o for o, t in zip(r["moekit_ms_rounds"], r["torch_ms_rounds"])],
                 pass_peak_tflops=pass_peak)  # fmt: skip
        for c in ("moekit", "torch"):
            r[f"{c}_pct_peak"] = 100 * r[f"{c}_tflops"] / peak
            r[f"{c}_pct_pass_peak"] = 100 * r[f"{c}_tflops"] / pass_peak
        rows.append(bc.without_rounds(r))
    return rows


_AVERAGED = (
    "moekit_tflops", "torch_tflops", "loop_tflops", "moekit_pct_peak", "torch_pct_peak",
    "pass_peak_tflops", "moekit_pct_pass_peak", "torch_pct_pass_peak")  # fmt: skip


def aggregate_draws(rows: list[dict]) -> list[dict]:
    """One cell per (shape, routing, pass): draws averaged, the ratio their geometric mean."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["shape"], r["routing"], r["pass"]), []).append(r)
    cells = []
    for rs in groups.values():
        if len(rs) == 1:
            cells.append(dict(rs[0]))
            continue
        ratios = [r["ratio_vs_torch"] for r in rs]
        cell = {k: v for k, v in rs[0].items() if k not in ("draw", "ratio_per_round")}
        cell.update({k: statistics.fmean(r[k] for r in rs) for k in _AVERAGED})
        cell.update(draw=f"mean of {len(rs)}", ratio_vs_torch=statistics.geometric_mean(ratios),
                    ratio_per_draw=ratios)  # fmt: skip
        cells.append(cell)
    return cells


def target_summary(rows: list[dict]) -> list[str]:
    """The performance targets, read off this run's cells (one per shape, routing and pass)."""
    out = ["", "targets:"]
    below = [r for r in rows if r["ratio_vs_torch"] < 1.0]
    out.append(f"  ratio < 1.0: {len(below)} of {len(rows)} " + _cells(below))
    for key, what in (("torch_pct_peak", "the start-of-run peak"),
                      ("torch_pct_pass_peak", "the peak timed in the pass's rounds")):  # fmt: skip
        room = [r for r in rows if r[key] < 80.0]
        short = [r for r in room if r["ratio_vs_torch"] < 1.15]
        out.append(f"  torch < 80% of {what}: {len(room)} cells; below 1.15x: {len(short)} "
                   + _cells(short))  # fmt: skip
    for r in rows:
        goal = {"fc1_fwd": 620, "fc1_wgrad_fp32": 580}.get(r["pass"])
        if r["shape"] == "te_seed" and r["routing"] == "skewed" and goal:
            out.append(f"  te_seed skewed {r['pass']}: {r['moekit_tflops']:.0f} (>= {goal})")
    return out


def _cells(rows: list[dict]) -> str:
    return " ".join(f"{r['shape']}/{r['routing'][:4]}/{r['pass']}={r['ratio_vs_torch']:.2f} "
                    f"({'draws' if 'ratio_per_draw' in r else 'rounds'} {_spread(r)})"
                    for r in rows)  # fmt: skip


def _spread(row: dict) -> str:
    """Lowest-highest ratio over the draws of an averaged cell, else over the pass's rounds."""
    ratios = row.get("ratio_per_draw") or row.get("ratio_per_round") or [float("nan")]
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


COLUMNS = [
    "shape", ("route", "routing"), "draw", "pass", ("moekit", "moekit_tflops"),
    ("torch", "torch_tflops"), ("ratio", "ratio_vs_torch"), ("loop", "loop_tflops"),
    ("%peak", "moekit_pct_peak"), ("t%peak", "torch_pct_peak"), ("pk_pass", "pass_peak_tflops"),
    ("t%pass", "torch_pct_pass_peak"), ("range", _spread)]  # fmt: skip


def main() -> None:
    ap = bc.parser(__doc__, quick="skip the per-expert loop baseline", smoke=False)
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--draws", type=int, default=1, help="skewed routings per shape (0 .. N-1)")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    dense = bc.DensePeak(torch.bfloat16)
    peak = dense.tflops()
    print(f"device: {torch.cuda.get_device_name()}  dense bf16 peak (torch.mm 8192^3): "
          f"{peak:.0f} TFLOP/s")  # fmt: skip
    rows = []
    for i, (name, T, E, H, F) in enumerate(bc.pick(SHAPES, args.shapes)):
        for draw in ([None] if i == 0 and name == SHAPES[0][0] else []) + list(range(args.draws)):
            counts = bc.routing_counts(T, E, False, gen) if draw is None else bc.skewed_routing(T, E, draw)  # fmt: skip
            rows += run_case(name, T, E, H, F, counts, draw, peak, args.quick, dense)
    peak2, cells = dense.tflops(), aggregate_draws(rows)
    configs = {str(k): str(v) for k, v in tuned_configs().items()}
    series = {lbl: [r[k] for r in cells] for lbl, k in (("moekit", "moekit_tflops"),
              ("torch._grouped_mm", "torch_tflops"), ("per-expert torch.mm", "loop_tflops"))}  # fmt: skip
    panel = bc.Panel(series, "TFLOP/s (bf16)", [f"{r['shape']} {r['routing'][:4]} {r['pass']}"
                     for r in cells], hlines={f"dense torch.mm peak {peak:.0f}": peak})  # fmt: skip
    bc.log("\nautotuned configs:\n" + "\n".join(f"  {k} -> {v}" for k, v in configs.items()))
    bc.log(f"\npeak before/after: {peak:.0f} / {peak2:.0f} TFLOP/s (TFLOP/s columns below)")
    data = {"device": torch.cuda.get_device_name(), "peak_tflops": [peak, peak2],
            "draws": args.draws, "rows": rows, "cells": cells, "configs": configs}  # fmt: skip
    bc.finish(args.out, "grouped_gemm", data, COLUMNS, [panel], floatfmt=".1f")
    if args.draws > 1:
        bc.log(f"\nmean over {args.draws} skewed draws (ratio: geometric mean):")
        bc.log(bc.table(cells, COLUMNS, ".1f"))
    bc.log("\n".join(target_summary(cells)))


if __name__ == "__main__":
    main()
