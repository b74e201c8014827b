"""Probe: how moekit's ragged-M candidates and torch._grouped_mm fare across routing draws.

The grouped-GEMM benchmark draws one skewed (gamma) routing per run; the autotuner then picks
a config on that routing. This probe draws several routings per shape and times every
ragged-M candidate and torch._grouped_mm on each, to see how much the ratio to torch moves
with the routing alone and whether one candidate is best throughout.

python benchmarks/probe_ragged_m_routings.py [--draws 6] [--shapes deepseek_v3_ep8 ...]
    [--cands 0,7,10] [--rounds 2] [--group-m 8,16,32,4] [--vary a_bounded=0,1]

--rounds times the candidates in that many alternating-order rounds and keeps each one's best
(the GPU's clock drifts as it heats). --group-m times the default config (candidate 0) with each
of these GROUP_M values instead of the candidate list; --vary FIELD=V1,V2 the shape's default
config with each value of one GemmConfig field (outputs checked bit-identical to the first).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

sys.path.insert(0, "benchmarks")
from benchmark_grouped_gemm import SHAPES, bench, routing_counts

from moekit.kernels import grouped_gemm as G


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=6)
    ap.add_argument(
        "--first-draw", type=int, default=0, help="draw seeds start here (new routings)"
    )
    ap.add_argument("--shapes", nargs="*", default=["deepseek_v3_ep8"])
    ap.add_argument("--passes", nargs="*", default=["fc1_fwd", "fc2_fwd", "fc1_dgrad"])
    ap.add_argument("--cands", default="", help="comma list of candidate indices (all)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--group-m", default="", help="comma list: the default config with each")
    ap.add_argument(
        "--vary", default="", help="FIELD=V1,V2,...: the shape's default config with each value"
    )
    args = ap.parse_args()
    cands = G._candidates("m", torch.bfloat16)
    if args.cands:
        cands = tuple(cands[int(i)] for i in args.cands.split(","))
    if args.group_m:
        cands = tuple(
            dataclasses.replace(cands[0], group_m=int(g)) for g in args.group_m.split(",")
        )
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
            if args.vary:
                cands = _varied(G._ragged_m_candidates(torch.bfloat16, T, E, K, N)[0], args.vary)
            # draw -1: the random skewed routing the autotuner adds to the call's own
            draws = range(args.first_draw, args.first_draw + args.draws)
            for draw in (-1, *draws):
                if draw < 0:
                    like = torch.zeros(1, device="cuda", dtype=torch.int32)
                    offsets = G._random_skewed_offsets(T, E, like)
                    counts = offsets.diff(prepend=offsets[:1] * 0).cpu()
                else:
                    torch.manual_seed(1000 + draw)
                    counts = routing_counts(T, E, True, torch.Generator().manual_seed(draw))
                    offsets = torch.cumsum(counts, 0).to(torch.int32).cuda()
                torch_tf = flops / bench(lambda: torch._grouped_mm(a, b, offs=offsets)) / 1e9
                tfs = [0.0] * len(cands)
                for r in range(args.rounds):
                    order = range(len(cands)) if r % 2 == 0 else reversed(range(len(cands)))
                    for i in order:
                        try:
                            ms = bench(
                                lambda c=cands[i]: G.grouped_mm_ragged_m(
                                    a, b, offsets, out, config=c
                                )
                            )
                            tfs[i] = max(tfs[i], flops / ms / 1e9)
                        except Exception as exc:  # a candidate may not build
                            print("candidate failed", cands[i], str(exc)[:120])
                # Variants of one config compute the same sums in the same order: bit-identical.
                ref = G.grouped_mm_ragged_m(a, b, offsets, out, config=cands[0]).clone()
                for c in cands[1:] if args.vary or args.group_m else ():
                    if not torch.equal(G.grouped_mm_ragged_m(a, b, offsets, out, config=c), ref):
                        print("MISMATCH against candidate 0:", c, flush=True)
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
    print_tuning_policies(table)


def _varied(base, spec: str) -> tuple:
    """``base`` with field FIELD set to each of V1, V2, ... (``spec`` = "FIELD=V1,V2")."""
    field, values = spec.split("=")
    kind = type(getattr(base, field))
    parse = (lambda v: v.lower() in ("1", "true")) if kind is bool else kind
    return tuple(dataclasses.replace(base, **{field: parse(v)}) for v in values.split(","))


def _pick(policy: str, tfs_d: list[float], other: list[float] | None) -> int:
    """The candidate a tuning policy keeps after timing every candidate on routing d."""
    best_on_d = max(range(len(tfs_d)), key=tfs_d.__getitem__)
    if policy == "default" or (policy == "tuner" and other is None):
        return 0
    if policy == "own" or other is None:
        return best_on_d
    # "tuner" (_pick_config with routing_robust_tuning, keep_default_within=0.05): least total
    # time on d and the other routing, kept only if > 5% faster than the default on both
    cost = [1 / max(x, 1e-9) + 1 / max(y, 1e-9) for x, y in zip(tfs_d, other)]
    best = min(range(len(cost)), key=cost.__getitem__)
    beats = tfs_d[best] > 1.05 * tfs_d[0] and other[best] > 1.05 * other[0]
    return best if beats else 0


def print_tuning_policies(table) -> None:
    """The autotuner times candidates on one routing (the first call's) and keeps its choice
    for every later routing. For each tuning draw d and each later draw d' != d: the chosen
    candidate's TFLOP/s on d' as a fraction of the best candidate on d' (and its ratio to
    torch there). Policies: "own" picks the fastest on d alone (the tuner before session 10);
    "tuner" is today's rule (see _pick); "default" never tunes (candidate 0)."""
    print("\ntuning policy | shape pass | mean frac of best | min frac | min ratio vs torch")
    keys = sorted({(n, w) for n, w, *_ in table})
    summary = {}
    for policy in ("own", "tuner", "default"):
        for name, which in keys:
            rows = {d: (t, tfs) for n, w, d, _, _, _, t, tfs in table if (n, w) == (name, which)}
            other = rows.get(-1, (None, None))[1]
            fracs, ratios = [], []
            for d, (_, tfs_d) in rows.items():
                if d < 0:
                    continue
                pick = _pick(policy, tfs_d, other)
                for d2, (torch_tf, tfs2) in rows.items():
                    if d2 < 0 or d2 == d:
                        continue
                    fracs.append(tfs2[pick] / max(tfs2))
                    ratios.append(tfs2[pick] / torch_tf)
            if fracs:
                summary.setdefault(policy, []).append((fracs, ratios))
                print(
                    f"{policy:8s} | {name[:8]} {which} | {sum(fracs) / len(fracs):.3f} | "
                    f"{min(fracs):.3f} | {min(ratios):.3f}"
                )
    print("\npolicy | mean frac of best | min frac | cases below torch | mean ratio vs torch")
    for policy, cells in summary.items():
        fr = [f for fs, _ in cells for f in fs]
        ra = [r for _, rs in cells for r in rs]
        print(
            f"{policy:8s} | {sum(fr) / len(fr):.4f} | {min(fr):.3f} | "
            f"{sum(r < 1 for r in ra)} of {len(ra)} | {sum(ra) / len(ra):.3f}"
        )


if __name__ == "__main__":
    main()
