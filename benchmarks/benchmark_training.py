"""The training example with moekit and with the torch-native baseline: tokens/s and loss parity.

    python benchmarks/benchmark_training.py --out bench_out [--config mid] [--steps 300]
    python benchmarks/benchmark_training.py --out bench_out --steps 1000 \
        --variants moekit_fp8 moekit_bf16 moekit_fp32          # FP8 against bf16

``examples/train_moe.py`` from one seed (each variant after a few untimed steps): moekit in
bf16, in FP8 (``--fp8``) and in fp32, torch_moe.py in bf16 and fp32. Parity: the gap of the
25-step moving-average loss of moekit bf16 to torch bf16, and of moekit FP8 to moekit bf16, is
no larger than the bf16-vs-fp32 gap of the same layer (moekit's where it ran, else torch's).
"""

from __future__ import annotations

import os
import statistics
import sys

import common as bc

VARIANTS = {"moekit_bf16": ["--dtype", "bfloat16"], "moekit_fp8": ["--dtype", "bfloat16", "--fp8"],
            "moekit_fp32": ["--dtype", "float32"],
            "torch_bf16": ["--baseline", "torch", "--dtype", "bfloat16"],
            "torch_fp32": ["--baseline", "torch", "--dtype", "float32"]}  # fmt: skip
# (a variant, the one it is held against, what the ratio of their tokens/s is called)
PAIRS = [("moekit_bf16", "torch_bf16", "moekit / torch"), ("moekit_fp8", "moekit_bf16",
         "moekit FP8 / bf16")]  # fmt: skip
WINDOW = 25


def moving_average(xs: list[float], w: int = WINDOW) -> list[float]:
    return [statistics.fmean(xs[i - w : i]) for i in range(w, len(xs) + 1)]


def run_variant(example, name: str, args) -> dict:
    batch = [] if args.batch is None else ["--batch", str(args.batch)]
    flags = ["--config", args.config, *VARIANTS[name], "--seed", "0", "--no-progress", *batch]
    scratch = os.path.join(args.out, "runs", name)
    example.main([*flags, "--steps", str(args.warmup_steps), "--out", scratch + "-warmup"])
    return example.main([*flags, "--steps", str(args.steps), "--out", scratch])


def compare(runs: dict, res: dict) -> list[str]:
    """The tokens/s ratios and the loss gaps against the bf16 noise bound, into ``res``."""
    avg = lambda name: moving_average(runs[name]["losses"])
    gap = lambda a, b: max(abs(x - y) for x, y in zip(avg(a), avg(b)))
    lines = []
    for fp32 in ("moekit_fp32", "torch_fp32"):
        if "gap_bf16_vs_fp32" not in res and {fp32, fp32.replace("fp32", "bf16")} <= runs.keys():
            res["gap_bf16_vs_fp32"] = gap(fp32.replace("fp32", "bf16"), fp32)
            lines.append(f"max |moving-average gap| {fp32.split('_')[0]} bf16 vs fp32 (the "
                         f"bound): {res['gap_bf16_vs_fp32']:.4f} nats/byte")  # fmt: skip
    for ours, theirs, ratio in PAIRS:
        if {ours, theirs} <= runs.keys():
            r = res[f"tokens_per_s_{ours}_over_{theirs}"] = (
                runs[ours]["tokens_per_s"] / runs[theirs]["tokens_per_s"])  # fmt: skip
            g = res[f"gap_{ours}_vs_{theirs}"] = gap(ours, theirs)
            lines.append(f"{ratio} tokens/s: {r:.2f}; max |moving-average gap| {ours} vs "
                         f"{theirs}: {g:.4f} nats/byte")  # fmt: skip
            if "gap_bf16_vs_fp32" in res:
                res[f"parity_{ours}"] = g <= res["gap_bf16_vs_fp32"]
                lines.append(f"parity ({ours} gap <= bf16 noise): {res[f'parity_{ours}']}")
    return lines


def main() -> None:
    ap = bc.parser(__doc__, smoke=False)
    ap.add_argument("--config", default="mid")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default: config)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(bc.REPO, "examples"))
    import train_moe as example

    runs = {}
    for name in args.variants:
        runs[name] = run_variant(example, name, args)
        bc.log(f"{name}: {runs[name]['tokens_per_s']:,.0f} tokens/s")
    first = runs[args.variants[0]]
    res = {"config": args.config, "steps": args.steps, "window": WINDOW, "runs": runs,
           "batch": first["batch"], "device": bc.device_name(first["device"] == "cuda"),
           "rows": [{"variant": n, "last": statistics.fmean(r["losses"][-WINDOW:]),
                     **{k: r.get(k) for k in ("tokens_per_s", "val_loss")}}
                    for n, r in runs.items()]}  # fmt: skip
    lines = compare(runs, res)
    curves = {f"{n} ({r['tokens_per_s']:,.0f} tok/s)":
              (range(WINDOW, len(r["losses"]) + 1), moving_average(r["losses"]))
              for n, r in runs.items()}  # fmt: skip
    panel = bc.Panel(curves, f"training loss, {WINDOW}-step moving average (nats/byte)",
                     kind="line", xlabel="step",
                     title=f"train_moe.py --config {args.config}, same seed ({res['device']})")  # fmt: skip
    bc.log(f"{args.config}, batch {res['batch']}, {args.steps} steps, {res['device']}")
    cols = ["variant", ("tokens/s", "tokens_per_s"), ("final loss", "last"),
            ("val loss", "val_loss")]  # fmt: skip
    bc.finish(args.out, "training", res, cols, [panel], floatfmt=".4f")
    bc.log("\n".join(lines))


if __name__ == "__main__":
    main()
