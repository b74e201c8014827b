# ruff: noqa: B023
"""Ragged-M configs for few rows per expert (decode, short prefill): GPU µs of candidate tile
shapes against the default and torch._grouped_mm, at the small-shape benchmark's shapes.

    PYTHONPATH=. python experiments/small_m_configs.py
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from benchmark_small_shapes import SHAPES, make_case
from common import bench_ms

from moekit.kernels.grouped_gemm import grouped_mm_ragged_m
from moekit.tuning.grouped_gemm import GemmConfig, ragged_m_candidates

SMALL = [
    GemmConfig(64, 64, 128, num_warps=4, num_stages=4),
    GemmConfig(64, 128, 128, num_warps=4, num_stages=4),
    GemmConfig(64, 64, 64, num_warps=4, num_stages=6),
    GemmConfig(64, 128, 64, num_warps=4, num_stages=5),
    GemmConfig(64, 256, 64, num_warps=4, num_stages=4),
    GemmConfig(128, 64, 64, num_warps=4, num_stages=5),
    GemmConfig(128, 128, 64, num_warps=8, num_stages=4),
]


def main() -> None:
    rows = []
    for i, (name, tokens, k, E, H, Fd) in enumerate(SHAPES):
        c = make_case(tokens, k, E, H, Fd, "cuda", torch.bfloat16, seed=i)
        for which, a, b in (
            ("fc1", c["x"], c["w1"].transpose(-2, -1)),
            ("dgrad", c["dh"], c["w1"]),
        ):
            T, K = a.shape
            N = b.shape[2]
            out = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
            offs = c["offsets"]
            default = ragged_m_candidates(torch.bfloat16, T, E, K, N)[0]
            flags = dict(a_bounded=default.a_bounded)
            res = {"torch": bench_ms(lambda: torch._grouped_mm(a, b, offs=offs)) * 1e3}
            for j, cfg in enumerate([default, *SMALL]):
                cfg = cfg if j == 0 else dataclasses.replace(cfg, **flags)
                try:
                    res[f"c{j}"] = (
                        bench_ms(lambda cfg=cfg: grouped_mm_ragged_m(a, b, offs, out, None, cfg))
                        * 1e3
                    )
                except Exception as exc:
                    res[f"c{j}"] = float("nan")
                    print(name, which, j, type(exc).__name__, str(exc)[:100])
            best = min((v, kk) for kk, v in res.items() if kk != "torch" and v == v)
            rows.append((name, which, T, E, K, N, res, best))
            print(
                f"{name:18} {which:6} T={T:5} E={E:3} K={K:5} N={N:5} torch {res['torch']:6.1f} "
                + " ".join(f"{kk}:{v:6.1f}" for kk, v in res.items() if kk != "torch")
                + f"  best {best[1]} {best[0]:.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
