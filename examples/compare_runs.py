"""Compare finished runs of the training example: the largest gap of their smoothed training
losses, their validation losses and tokens/s per GPU.

    python examples/compare_runs.py runs/mid-moekit runs/mid-moekit-ep4 [--json out.json]

The first run is the reference (e.g. one GPU); each other run is compared with it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_moe_plot import SMOOTH, label, moving_average


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run folders (each with losses.json)")
    p.add_argument("--json", default=None, help="also write the comparison here")
    args = p.parse_args()
    runs = []
    for folder in args.runs:
        with open(os.path.join(folder, "losses.json")) as f:
            runs.append((folder, json.load(f)))
    ref_name, ref = runs[0]
    ref_avg = moving_average(ref["losses"], SMOOTH)
    rows = []
    for name, r in runs:
        avg = moving_average(r["losses"], SMOOTH)
        gap = max((abs(a - b) for a, b in zip(avg, ref_avg)), default=float("nan"))
        rows.append({
            "run": os.path.basename(name.rstrip("/")), "label": label(r),
            "steps": len(r["losses"]), "val_loss": r["val_loss"],
            "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
            "per_gpu_vs_reference": r["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"],
            "max_gap_smoothed_loss": gap, "last_loss": r["losses"][-1],
        })  # fmt: skip
    for row in rows:
        print(f"{row['run']:<14} {row['label']:<30} val {row['val_loss']:.4f}  smoothed-loss gap "
              f"{row['max_gap_smoothed_loss']:.4f}  {row['tokens_per_s_per_gpu']:,.0f} tok/s/GPU "
              f"({row['per_gpu_vs_reference']:.2f}x)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"reference": ref_name, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
