"""The training example with moekit and with the torch-native baseline: tokens/s and
convergence parity.

    python benchmarks/benchmark_training.py --out bench_out [--config mid] [--steps 300]

Runs ``examples/train_moe.py`` from the same seed (same initial weights, same batches) three
times: moekit in bf16, the torch-native MoE (``benchmarks/torch_moe.py``) in bf16, and the
torch-native MoE in fp32. The bf16-vs-fp32 gap of the baseline is the bf16 noise the moekit
curve is held to: parity means the moekit-vs-torch gap (both bf16) is no larger. Gaps are
measured on 25-step moving averages of the training loss, after the first 25 steps. Every
variant first runs a few steps untimed, so compilation and autotuning stay out of tokens/s.

``--batch`` overrides the configuration's sequences per step. Writes training.json and
training.png (the loss curves on one plot) under --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys

import torch
from common import pyplot, save_figure, write_json

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "train_moe.py")
VARIANTS = {  # name: (baseline, dtype)
    "moekit_bf16": ("moekit", "bfloat16"),
    "torch_bf16": ("torch", "bfloat16"),
    "torch_fp32": ("torch", "float32"),
}
WINDOW = 25
TOKENS_PER_S_TARGET = 1.5


def load_example():
    spec = importlib.util.spec_from_file_location("train_moe", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_moe"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def moving_average(xs: list[float], w: int = WINDOW) -> list[float]:
    return [statistics.fmean(xs[i - w : i]) for i in range(w, len(xs) + 1)]


def max_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(moving_average(a), moving_average(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--config", default="mid")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default: config)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    example = load_example()
    runs = {}
    for name in args.variants:
        baseline, dtype = VARIANTS[name]
        common = ["--config", args.config, "--baseline", baseline, "--dtype", dtype, "--seed", "0",
                  "--no-progress"]  # fmt: skip
        if args.batch is not None:
            common += ["--batch", str(args.batch)]
        scratch = os.path.join(args.out, "runs", name)
        example.main([*common, "--steps", str(args.warmup_steps), "--out", scratch + "-warmup"])
        runs[name] = example.main([*common, "--steps", str(args.steps), "--out", scratch])
        print(f"{name}: {runs[name]['tokens_per_s']:,.0f} tokens/s", flush=True)
    res = {"config": args.config, "steps": args.steps, "window": WINDOW, "runs": runs,
           "batch": runs[args.variants[0]]["batch"]}  # fmt: skip
    device = runs[args.variants[0]]["device"]
    res["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    lines = [f"{args.config}, batch {res['batch']}, {args.steps} steps, {res['device']}"]
    lines.append(
        f"{'variant':<13}{'tokens/s':>12}{'(steady)':>12}{'final loss':>12}{'val loss':>10}"
    )
    for name, r in runs.items():
        last = statistics.fmean(r["losses"][-WINDOW:])
        steady = r["tokens_per_s_after_first_steps"]
        lines.append(
            f"{name:<13}{r['tokens_per_s']:>12,.0f}{steady:>12,.0f}{last:>12.4f}"
            f"{r['val_loss']:>10.4f}"
        )
    if {"moekit_bf16", "torch_bf16"} <= runs.keys():
        m, t = runs["moekit_bf16"], runs["torch_bf16"]
        res["tokens_per_s_ratio"] = m["tokens_per_s"] / t["tokens_per_s"]
        steady = "tokens_per_s_after_first_steps"
        res["steady_tokens_per_s_ratio"] = m[steady] / t[steady]
        res["gap_moekit_vs_torch"] = max_gap(m["losses"], t["losses"])
        lines.append(
            f"moekit / torch tokens/s: {res['tokens_per_s_ratio']:.2f}, after the first "
            f"steps {res['steady_tokens_per_s_ratio']:.2f} (target >= {TOKENS_PER_S_TARGET})"
        )
        lines.append(f"max |moving-average gap| moekit vs torch (bf16): "
                     f"{res['gap_moekit_vs_torch']:.4f} nats/byte")  # fmt: skip
    if {"torch_fp32", "torch_bf16"} <= runs.keys():
        res["gap_bf16_vs_fp32"] = max_gap(
            runs["torch_bf16"]["losses"], runs["torch_fp32"]["losses"]
        )
        lines.append(f"max |moving-average gap| torch bf16 vs fp32 (the bound): "
                     f"{res['gap_bf16_vs_fp32']:.4f} nats/byte")  # fmt: skip
        if "gap_moekit_vs_torch" in res:
            res["parity"] = res["gap_moekit_vs_torch"] <= res["gap_bf16_vs_fp32"]
            lines.append(f"parity (moekit gap <= bf16 noise): {res['parity']}")
    write_json(os.path.join(args.out, "training.json"), res)
    try:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name, r in runs.items():
            ax.plot(range(WINDOW, len(r["losses"]) + 1), moving_average(r["losses"]), lw=1.2,
                    label=f"{name} ({r['tokens_per_s']:,.0f} tok/s)")  # fmt: skip
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss, {WINDOW}-step moving average (nats/byte)")
        ax.set_title(f"train_moe.py --config {args.config}, same seed ({res['device']})")
        ax.legend()
        save_figure(fig, os.path.join(args.out, "training.png"))
    except ImportError:
        pass
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
