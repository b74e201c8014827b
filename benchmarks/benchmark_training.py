"""The training example with moekit and with the torch-native baseline: tokens/s and loss parity.

    python benchmarks/benchmark_training.py --out bench_out [--config mid] [--steps 300]

``examples/train_moe.py`` from one seed: moekit bf16, torch_moe.py bf16 and fp32 (each after a
few untimed steps). Parity: the moekit-vs-torch gap of the 25-step moving-average loss is no
larger than torch's bf16-vs-fp32 gap.
"""

from __future__ import annotations

import os
import statistics
import sys

import common as bc

VARIANTS = {"moekit_bf16": ("moekit", "bfloat16"), "torch_bf16": ("torch", "bfloat16"),
            "torch_fp32": ("torch", "float32")}  # name: (baseline, dtype)  # fmt: skip
WINDOW = 25
TOKENS_PER_S_TARGET = 1.5


def moving_average(xs: list[float], w: int = WINDOW) -> list[float]:
    return [statistics.fmean(xs[i - w : i]) for i in range(w, len(xs) + 1)]


def run_variant(example, name: str, args) -> dict:
    baseline, dtype = VARIANTS[name]
    batch = [] if args.batch is None else ["--batch", str(args.batch)]
    flags = ["--config", args.config, "--baseline", baseline, "--dtype", dtype, "--seed", "0",
             "--no-progress", *batch]  # fmt: skip
    scratch = os.path.join(args.out, "runs", name)
    example.main([*flags, "--steps", str(args.warmup_steps), "--out", scratch + "-warmup"])
    return example.main([*flags, "--steps", str(args.steps), "--out", scratch])


def compare(runs: dict, res: dict) -> list[str]:
    """The tokens/s ratio and the loss gaps against the bf16 noise bound, into ``res``."""
    avg = lambda name: moving_average(runs[name]["losses"])
    lines, gap = [], lambda a, b: max(abs(x - y) for x, y in zip(avg(a), avg(b)))
    if {"moekit_bf16", "torch_bf16"} <= runs.keys():
        m, t = runs["moekit_bf16"], runs["torch_bf16"]
        res["tokens_per_s_ratio"] = m["tokens_per_s"] / t["tokens_per_s"]
        res["gap_moekit_vs_torch"] = gap("moekit_bf16", "torch_bf16")
        lines.append(f"moekit / torch tokens/s: {res['tokens_per_s_ratio']:.2f} (target >= "
                     f"{TOKENS_PER_S_TARGET})\nmax |moving-average gap| moekit vs torch (bf16): "
                     f"{res['gap_moekit_vs_torch']:.4f} nats/byte")  # fmt: skip
    if {"torch_fp32", "torch_bf16"} <= runs.keys():
        res["gap_bf16_vs_fp32"] = gap("torch_bf16", "torch_fp32")
        lines.append(f"max |moving-average gap| torch bf16 vs fp32 (the bound): "
                     f"{res['gap_bf16_vs_fp32']:.4f} nats/byte")  # fmt: skip
    if "gap_moekit_vs_torch" in res and "gap_bf16_vs_fp32" in res:
        res["parity"] = res["gap_moekit_vs_torch"] <= res["gap_bf16_vs_fp32"]
        lines.append(f"parity (moekit gap <= bf16 noise): {res['parity']}")
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
