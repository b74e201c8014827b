"""Summarise an ncu report for run_ncu_grouped_gemm.sh: per kernel, the tensor-pipe and
warp-stall metrics of the raw page, and the SASS instructions with the most stall samples.

    python benchmarks/ncu_report_summary.py REPORT.ncu-rep [--top 20]
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import subprocess


def _csv(args: list[str]) -> list[list[str]]:
    text = subprocess.run(["ncu", *args], capture_output=True, text=True).stdout
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    return list(csv.reader(io.StringIO("\n".join(lines))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("report")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    rows = _csv(["-i", args.report, "--page", "raw", "--csv"])
    if rows:
        head, units, data = rows[0], rows[1], rows[2:]
        want = re.compile(r"pipe_tensor.*pct_of_peak|warp_issue_stalled_.*per_warp_active\.pct")
        for r in data:
            name = r[head.index("Kernel Name")][:60]
            print(f"kernel {name}")
            picks = [(h, v, u) for h, v, u in zip(head, r, units) if want.search(h)]
            picks = [p for p in picks if p[1] not in ("", "0", "n/a")]
            for h, v, u in sorted(picks, key=lambda p: -_num(p[1]))[:14]:
                print(f"  {h:90s} {v:>10s} {u}")
    src = _csv(["-i", args.report, "--page", "source", "--csv", "--print-source", "sass"])
    if not src:
        return
    # One block per kernel: a "Kernel Name" row, then the column header, then instructions.
    at = next((i for i, r in enumerate(src) if any("Stall Sampling (All" in h for h in r)), None)
    if at is None:
        print("source page: no stall-sampling column; first rows:", src[:3])
        return
    head = src[at]
    data = []
    for r in src[at + 1 :]:
        if r and r[0] == "Kernel Name":
            break  # the next kernel's block: the first kernel's profile is enough
        data.append(r)
    col = next((i for i, h in enumerate(head) if "Stall Sampling (All" in h), None)
    text = next((i for i, h in enumerate(head) if h in ("Source", "Sass")), 1)
    total = sum(_num(r[col]) for r in data if len(r) > col)
    print(f"stall samples: {total:.0f}; top instructions")
    for r in sorted(data, key=lambda r: -_num(r[col]) if len(r) > col else 0)[: args.top]:
        print(f"  {100 * _num(r[col]) / max(total, 1):5.1f}%  {r[text][:100]}")


def _num(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


if __name__ == "__main__":
    main()
