"""Grouped GEMM benchmark: moekit vs torch._grouped_mm vs a per-expert torch.mm loop.

For each MoE shape (T routed rows, E experts, H hidden, F expert width) and each pass
  fc1 fwd  x[T,H]  @ w1[e]^T [H,2F]     (ragged M, b = weight.transpose view)
  fc2 fwd  h[T,F]  @ w2[e]^T [F,H]      (ragged M)
  dgrad    dy[T,2F] @ w1[e] [2F,H]      (ragged M, b row-major)
  wgrad    dy^T[2F,T] @ x[T,H] → [E,2F,H], fp32 out and bf16 out (ragged K)
it prints TFLOP/s, the ratio to torch._grouped_mm, and the % of the dense bf16 peak measured in
the same run (torch.mm 8192³ on random data: at the start and end of the run, and in each
pass's alternating rounds, so that torch's % of peak compares the two at the same clock; the
summary at the end checks the issue's targets against both). Routing counts come from a skewed gamma draw (some
experts get few or no rows); the first shape is also run with uniform counts.

With --draws N each shape runs N skewed routings (draws 0 .. N-1, each from its own seed, so a
shape's routings do not depend on which other shapes run). A single draw moves the torch /
moekit ratio of the fine-grained passes by up to ±8% (benchmarks/probe_ragged_m_routings.py),
so the summary then reads the targets off each cell's geometric-mean ratio over the draws,
with the per-draw range beside it.

    python benchmarks/benchmark_grouped_gemm.py --out bench_out [--quick] [--draws 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from moekit.kernels import grouped_gemm as K
from moekit.kernels.grouped_gemm import tuned_configs
from moekit.ops import grouped_mm

SHAPES = [  # name, T, E, H, F
    ("te_seed", 66560, 20, 2048, 512),
    ("qwen3_30b_a3b", 65536, 128, 2048, 768),
    ("olmoe", 32768, 64, 2048, 1024),
    ("deepseek_v3_ep8", 32768, 32, 7168, 2048),
    ("mixtral", 16384, 8, 4096, 14336),
    ("gpt_oss_like", 32768, 128, 2880, 2880),
]


def routing_counts(T: int, E: int, skewed: bool, gen: torch.Generator) -> torch.Tensor:
    if not skewed:
        counts = torch.full((E,), T // E, dtype=torch.int64)
        counts[: T - int(counts.sum())] += 1
        return counts
    share = torch.distributions.Gamma(0.6, 1.0).sample((E,))
    share[torch.randint(E, (1,), generator=gen)] = 0.0  # at least one idle expert
    counts = torch.floor(share / share.sum() * T).to(torch.int64)
    counts[torch.argmax(counts)] += T - int(counts.sum())
    return counts


def skewed_routing(T: int, E: int, draw: int) -> torch.Tensor:
    """Skewed routing number ``draw`` of a shape: the same counts whatever ran before (the
    caller's random state is left as it was). Draw 0 is the routing the benchmark drew for its
    first skewed shape (the TE seed) before draws were numbered."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(draw)
        return routing_counts(T, E, True, torch.Generator().manual_seed(draw))


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


class DensePeak:
    """The dense bf16 reference: torch.mm of two 8192 x 8192 matrices, TFLOP/s.

    The H100 here slows down under sustained load (the start-of-run figure has been 5-20%
    above the end-of-run one), so besides the start and end of the run each pass times it in
    the same alternating rounds as the contenders: its % of peak then compares the two at the
    same clock."""

    N = 8192

    def __init__(self, dtype: torch.dtype) -> None:
        self.a = torch.randn(self.N, self.N, device="cuda", dtype=dtype)
        self.b = torch.randn(self.N, self.N, device="cuda", dtype=dtype)

    def ms(self) -> float:
        return bench(lambda: torch.mm(self.a, self.b))

    def tflops(self, ms: float | None = None) -> float:
        return 2 * self.N**3 / (self.ms() if ms is None else ms) / 1e9


def dense_peak_tflops(dtype: torch.dtype) -> float:
    return DensePeak(dtype).tflops()


def run_case(name, T, E, H, F, counts, draw, dtype, peak, quick, dense: DensePeak):
    """Every pass of one shape on one routing (``draw`` None: uniform counts)."""
    skewed = draw is not None
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    host_bounds = [0, *torch.cumsum(counts, 0).tolist()]
    x = torch.randn(T, H, device="cuda", dtype=dtype)
    h = torch.randn(T, F, device="cuda", dtype=dtype)
    dy = torch.randn(T, 2 * F, device="cuda", dtype=dtype)
    w1 = torch.randn(E, 2 * F, H, device="cuda", dtype=dtype) / math.sqrt(H)
    w2 = torch.randn(E, H, F, device="cuda", dtype=dtype) / math.sqrt(F)
    main_grad = torch.zeros(E, 2 * F, H, device="cuda", dtype=torch.float32)
    main_grad_t = torch.zeros_like(main_grad)

    def loop_m(a, b):  # per-expert torch.mm over host-known slices (b: [E, K, N])
        out = torch.empty(a.shape[0], b.shape[2], device="cuda", dtype=dtype)
        for e in range(E):
            s, t = host_bounds[e], host_bounds[e + 1]
            if t > s:
                torch.mm(a[s:t], b[e], out=out[s:t])
        return out

    def loop_k(a, b):
        out = torch.empty(E, a.shape[0], b.shape[1], device="cuda", dtype=dtype)
        for e in range(E):
            s, t = host_bounds[e], host_bounds[e + 1]
            torch.mm(a[:, s:t], b[s:t], out=out[e])
        return out

    passes = {
        "fc1_fwd": (2 * T * H * 2 * F, lambda: grouped_mm(x, w1.transpose(1, 2), offs),
                    lambda: torch._grouped_mm(x, w1.transpose(1, 2), offs=offs),
                    lambda: loop_m(x, w1.transpose(1, 2))),
        "fc2_fwd": (2 * T * F * H, lambda: grouped_mm(h, w2.transpose(1, 2), offs),
                    lambda: torch._grouped_mm(h, w2.transpose(1, 2), offs=offs),
                    lambda: loop_m(h, w2.transpose(1, 2))),
        "fc1_dgrad": (2 * T * 2 * F * H, lambda: grouped_mm(dy, w1, offs),
                      lambda: torch._grouped_mm(dy, w1, offs=offs),
                      lambda: loop_m(dy, w1)),
        "fc1_wgrad_fp32": (2 * T * 2 * F * H,
                           lambda: grouped_mm(dy.t(), x, offs, out=main_grad, accumulate=True),
                           # torch refuses fp32 out: its equivalent is bf16 out + add into main_grad
                           lambda: main_grad_t.add_(torch._grouped_mm(dy.t(), x, offs=offs)),
                           lambda: main_grad_t.add_(loop_k(dy.t(), x))),
        "fc1_wgrad_bf16": (2 * T * 2 * F * H, lambda: grouped_mm(dy.t(), x, offs),
                           lambda: torch._grouped_mm(dy.t(), x, offs=offs),
                           lambda: loop_k(dy.t(), x)),
    }  # fmt: skip
    rows = []
    for pname, (flops, ours, theirs, loop) in passes.items():
        # The GPU's clock drifts over a long run (thermal/power): time the contenders in
        # alternating rounds and keep each one's best median, so no side gets the cooler GPU.
        # Each round's torch / moekit ratio (the two timed back to back) is kept as well: its
        # spread shows how much of a cell's margin is the GPU's clock of the moment.
        t_ours = t_torch = t_loop = t_dense = float("inf")
        round_ratios = []
        for _ in range(3):
            t_dense = min(t_dense, dense.ms())
            ms_ours = bench(ours)
            t_ours = min(t_ours, ms_ours)
            try:
                ms_torch = bench(theirs)
                t_torch = min(t_torch, ms_torch)
                round_ratios.append(ms_torch / ms_ours)
            except Exception as exc:  # torch._grouped_mm refuses some layouts; report it
                print(f"  torch._grouped_mm {name}/{pname}: {type(exc).__name__}: {exc}"[:200])
                t_torch = float("nan")
            t_loop = float("nan") if quick else min(t_loop, bench(loop))
        tf = lambda ms: flops / ms / 1e9
        pass_peak = dense.tflops(t_dense)
        rows.append(
            {
                "shape": name,
                "routing": "skewed" if skewed else "uniform",
                "draw": draw,
                "T": T, "E": E, "H": H, "F": F,
                "pass": pname,
                "moekit_ms": t_ours,
                "torch_ms": t_torch,
                "loop_ms": t_loop,
                "moekit_tflops": tf(t_ours),
                "torch_tflops": tf(t_torch),
                "loop_tflops": tf(t_loop),
                "ratio_vs_torch": t_torch / t_ours,
                "ratio_per_round": round_ratios,
                "moekit_pct_peak": 100 * tf(t_ours) / peak,
                "torch_pct_peak": 100 * tf(t_torch) / peak,
                "floor_ms": flops / (peak * 1e9),
                "pass_peak_tflops": pass_peak,
                "moekit_pct_pass_peak": 100 * tf(t_ours) / pass_peak,
                "torch_pct_pass_peak": 100 * tf(t_torch) / pass_peak,
            }
        )  # fmt: skip
    return rows


G = K.GemmConfig
# Configs under evaluation (not autotune candidates): `--sweep-set trial` times them after the
# autotuner's candidates. The last trials were no better on the H100
# (docs/results/grouped_gemm_sweep2_h100.json): BLOCK_K = 128 with two stages (half the K steps
# of the short-K passes) was slower everywhere (Qwen3 fc2 442 vs 505, OLMoE wgrad bf16 375 vs
# 479 TFLOP/s); two co-resident 128 x 128 programs per SM for bf16 wgrad tied the best static
# config (Qwen3 451 vs 467, OLMoE 479 vs 478); so did warp-specialised 128 x 256 sub-tiled
# configs (Qwen3 wgrad bf16 476 vs 478, dgrad 546 vs 571, below the best elsewhere); 256 x 128
# ragged-K tiles were slower (Qwen3 bf16 wgrad 454 vs 473, DeepSeek 581 vs 607). The
# hand-fused (flattened) ragged-K loop was a trial in session 6 and is now a candidate; around
# it (grouped_gemm_sweep3_h100.json, run session6-b, bf16 wgrad) BLOCK_K = 128 with two stages
# was slower (Qwen3 421 vs 537), GROUP_M 4 / 16 within noise (Qwen3 523 / 526, OLMoE 551 / 534
# vs 541), 256 x 128 tiles slower (Qwen3 498, DeepSeek 567 vs 638).
TRIAL_CONFIGS = {
    "m": (),
    "k": (),
}


def sweep_configs(kind: str, dtype: torch.dtype, which: str) -> tuple:
    if which == "trial":
        return K._candidates(kind, dtype) + TRIAL_CONFIGS[kind]
    return K._candidates(kind, dtype)


def sweep(names, dtype, peak, gen, which="candidates", passes=None, skewed=True) -> list[dict]:
    """Time every candidate tile config explicitly (the autotuner's search, made visible),
    with torch._grouped_mm on the same operands for reference (skewed or uniform routing)."""
    rows = []
    for name, T, E, H, F in SHAPES:
        if name not in names:
            continue
        counts = routing_counts(T, E, skewed, gen)
        offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
        x = torch.randn(T, H, device="cuda", dtype=dtype)
        h = torch.randn(T, F, device="cuda", dtype=dtype)
        dy = torch.randn(T, 2 * F, device="cuda", dtype=dtype)
        w1 = torch.randn(E, 2 * F, H, device="cuda", dtype=dtype)
        w2 = torch.randn(E, H, F, device="cuda", dtype=dtype)
        o1 = torch.empty(T, 2 * F, device="cuda", dtype=dtype)
        o2 = torch.empty(T, H, device="cuda", dtype=dtype)
        og = torch.zeros(E, 2 * F, H, device="cuda", dtype=torch.float32)
        og16 = torch.zeros(E, 2 * F, H, device="cuda", dtype=dtype)
        cases = {
            "fc1_fwd": ("m", 2 * T * H * 2 * F, lambda c: K.grouped_mm_ragged_m(x, w1.transpose(1, 2), offs, o1, config=c),
                        lambda: torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)),
            "fc2_fwd": ("m", 2 * T * H * F, lambda c: K.grouped_mm_ragged_m(h, w2.transpose(1, 2), offs, o2, config=c),
                        lambda: torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)),
            "fc1_dgrad": ("m", 2 * T * H * 2 * F, lambda c: K.grouped_mm_ragged_m(dy, w1, offs, o2, config=c),
                          lambda: torch._grouped_mm(dy, w1, offs=offs)),
            "wgrad_fp32": ("k", 2 * T * H * 2 * F, lambda c: K.grouped_mm_ragged_k(dy.t(), x, offs, og, True, config=c),
                           lambda: og.add_(torch._grouped_mm(dy.t(), x, offs=offs))),
            "wgrad_bf16": ("k", 2 * T * H * 2 * F, lambda c: K.grouped_mm_ragged_k(dy.t(), x, offs, og16, False, config=c),
                           lambda: torch._grouped_mm(dy.t(), x, offs=offs)),
        }  # fmt: skip
        for pname, (kind, flops, fn, torch_fn) in cases.items():
            if passes and pname not in passes:
                continue
            tf_torch = flops / bench(torch_fn) / 1e9
            rows.append({"shape": name, "pass": pname, "config": "torch._grouped_mm",
                         "tflops": tf_torch})  # fmt: skip
            print(f"sweep {name:16s} {pname:11s} {tf_torch:6.0f} TF/s  torch._grouped_mm")
            out = {"fc1_fwd": o1, "fc2_fwd": o2, "fc1_dgrad": o2, "wgrad_fp32": og,
                   "wgrad_bf16": og16}[pname]  # fmt: skip
            reference = None
            for cfg in sweep_configs(kind, dtype, which):
                err = float("nan")
                try:
                    out.zero_()  # one call from zero: the same result for every config
                    fn(cfg)
                    if reference is None:
                        reference = out.clone()
                    err = (out.float() - reference.float()).abs().max().item()
                    ms = bench(lambda: fn(cfg))
                    tf = flops / ms / 1e9
                except Exception as exc:  # report compile failures per config, keep sweeping
                    tf, ms = float("nan"), float("nan")
                    print(f"  {name} {pname} {cfg}: {type(exc).__name__} {str(exc)[:120]}")
                rows.append({"shape": name, "pass": pname, "config": str(cfg), "tflops": tf,
                             "max_abs_diff_vs_first": err})  # fmt: skip
                print(
                    f"sweep {name:16s} {pname:11s} {tf:6.0f} TF/s ({100 * tf / peak:5.1f}%) "
                    f"diff {err:.2e}  {cfg}"
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--quick", action="store_true", help="skip the per-expert loop baseline")
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    parser.add_argument(
        "--draws", type=int, default=1, help="skewed routings per shape (draws 0 .. N-1)"
    )
    parser.add_argument(
        "--sweep", default="", help="comma list of shapes whose tile configs to sweep"
    )
    parser.add_argument(
        "--sweep-set",
        choices=("candidates", "trial"),
        default="candidates",
        help="candidates: the autotuner's lists; trial: those and TRIAL_CONFIGS",
    )
    parser.add_argument("--sweep-passes", default="", help="comma list of passes to sweep (all)")
    parser.add_argument(
        "--sweep-uniform", action="store_true", help="sweep on uniform routing (default: skewed)"
    )
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    dense = DensePeak(dtype)
    peak = dense.tflops()
    print(
        f"device: {torch.cuda.get_device_name()}  dense bf16 peak (torch.mm 8192^3): {peak:.0f} TFLOP/s"
    )

    if args.sweep:
        passes = set(args.sweep_passes.split(",")) if args.sweep_passes else None
        sweep_rows = sweep(
            set(args.sweep.split(",")), dtype, peak, gen, args.sweep_set, passes,
            skewed=not args.sweep_uniform,
        )  # fmt: skip
        with open(os.path.join(args.out, "grouped_gemm_sweep.json"), "w") as f:
            json.dump(sweep_rows, f, indent=1)
    wanted = set(args.shapes.split(",")) if args.shapes else set()
    rows = []
    for i, (name, T, E, H, F) in enumerate(SHAPES):
        if name not in wanted:
            continue
        draws = ([None] if i == 0 else []) + list(range(args.draws))
        for draw in draws:
            if draw is None:
                counts = routing_counts(T, E, False, gen)
            else:
                counts = skewed_routing(T, E, draw)
            rows += run_case(name, T, E, H, F, counts, draw, dtype, peak, args.quick, dense)
    peak2 = dense.tflops()
    cells = aggregate_draws(rows)

    lines = _table(rows)
    if args.draws > 1:
        lines += ["", f"mean over {args.draws} skewed draws (ratio: geometric mean):"]
        lines += _table(cells)
    lines += target_summary(cells)
    configs = {str(k): str(v) for k, v in tuned_configs().items()}
    with open(os.path.join(args.out, "grouped_gemm.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "peak_tflops": [peak, peak2],
                   "draws": args.draws, "rows": rows, "cells": cells,
                   "configs": configs}, f, indent=1)  # fmt: skip
    _plot(cells, peak, os.path.join(args.out, "grouped_gemm.png"))
    print("\nautotuned configs:")
    for k, v in configs.items():
        print(" ", k, "->", v)
    print(f"\npeak before/after: {peak:.0f} / {peak2:.0f} TFLOP/s (TFLOP/s columns below)")
    print("\n".join(lines))


def _table(rows: list[dict]) -> list[str]:
    """One line per row; the last column is the ratio's range over the draws of a cell
    averaged over draws, else over the pass's rounds."""
    hdr = (
        f"{'shape':16s} {'route':7s} {'draw':>4s} {'pass':15s} {'moekit':>7s} {'torch':>7s} "
        f"{'ratio':>6s} {'loop':>7s} {'%peak':>6s} {'t%peak':>6s} {'pk_pass':>7s} "
        f"{'t%pass':>6s} {'range':>9s}"
    )
    lines = [hdr]
    for r in rows:
        draw = "-" if r.get("draw") is None else str(r["draw"])
        lines.append(
            f"{r['shape']:16s} {r['routing']:7s} {draw:>4s} {r['pass']:15s} "
            f"{r['moekit_tflops']:7.0f} {r['torch_tflops']:7.0f} {r['ratio_vs_torch']:6.2f} "
            f"{r['loop_tflops']:7.0f} {r['moekit_pct_peak']:6.1f} {r['torch_pct_peak']:6.1f} "
            f"{r['pass_peak_tflops']:7.0f} {r['torch_pct_pass_peak']:6.1f} "
            f"{_spread(r)}"
        )
    return lines


_AVERAGED = (
    "moekit_tflops", "torch_tflops", "loop_tflops", "moekit_pct_peak", "torch_pct_peak",
    "pass_peak_tflops", "moekit_pct_pass_peak", "torch_pct_pass_peak",
)  # fmt: skip


def aggregate_draws(rows: list[dict]) -> list[dict]:
    """One cell per (shape, routing, pass): TFLOP/s and % of peak averaged over the draws,
    the torch / moekit ratio as the geometric mean of the draws' ratios, and the draws'
    ratios in ``ratio_per_draw``. A cell of one draw keeps its row's figures."""
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
        cell.update({k: sum(r[k] for r in rs) / len(rs) for k in _AVERAGED})
        cell["draw"] = f"mean of {len(rs)}"
        cell["ratio_vs_torch"] = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        cell["ratio_per_draw"] = ratios
        cells.append(cell)
    return cells


def target_summary(rows: list[dict]) -> list[str]:
    """The issue's targets, read off this run's cells (one per shape, routing and pass)."""
    out = ["", "targets:"]
    below = [r for r in rows if r["ratio_vs_torch"] < 1.0]
    out.append(f"  ratio < 1.0: {len(below)} of {len(rows)} " + _cells(below))
    for key, what in (
        ("torch_pct_peak", "the start-of-run peak"),
        ("torch_pct_pass_peak", "the peak timed in the pass's rounds"),
    ):
        room = [r for r in rows if r[key] < 80.0]
        short = [r for r in room if r["ratio_vs_torch"] < 1.15]
        out.append(
            f"  torch < 80% of {what}: {len(room)} cells; below 1.15x: {len(short)} "
            + _cells(short)
        )
    for r in rows:
        if r["shape"] == "te_seed" and r["routing"] == "skewed":
            goal = {"fc1_fwd": 620, "fc1_wgrad_fp32": 580}.get(r["pass"])
            if goal:
                out.append(f"  te_seed skewed {r['pass']}: {r['moekit_tflops']:.0f} (>= {goal})")
    return out


def _cells(rows: list[dict]) -> str:
    return " ".join(
        f"{r['shape']}/{r['routing'][:4]}/{r['pass']}={r['ratio_vs_torch']:.2f}"
        f" ({'draws' if 'ratio_per_draw' in r else 'rounds'} {_spread(r)})"
        for r in rows
    )


def _spread(row: dict) -> str:
    """Lowest-highest torch / moekit ratio over the draws of a cell averaged over draws, else
    over the pass's rounds."""
    ratios = row.get("ratio_per_draw") or row.get("ratio_per_round") or [float("nan")]
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def _plot(rows, peak, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    labels = [f"{r['shape']}\n{r['routing'][:4]} {r['pass']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(10, len(rows) * 0.55), 5))
    w = 0.27
    ax.bar([x - w for x in xs], [r["moekit_tflops"] for r in rows], w, label="moekit")
    ax.bar(list(xs), [r["torch_tflops"] for r in rows], w, label="torch._grouped_mm")
    ax.bar([x + w for x in xs], [r["loop_tflops"] for r in rows], w, label="per-expert torch.mm")
    ax.axhline(peak, color="k", ls="--", lw=1, label=f"dense torch.mm peak {peak:.0f}")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=90, fontsize=6)
    ax.set_ylabel("TFLOP/s (bf16)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
