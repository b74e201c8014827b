"""Where moekit's host time goes: cProfile of eager calls at a host-bound shape.

PYTHONPATH=. python experiments/host_profile.py [--calls 2000] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from benchmark_small_shapes import make_case, make_steps

from moekit.runtime.cache import cache_entries


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--top", type=int, default=22)
    p.add_argument("--passes", nargs="*", default=["mm_fc1", "mm_wgrad", "mlp", "block"])
    p.add_argument("--shape", nargs=5, type=int, default=[2048, 2, 8, 1024, 1024])
    args = p.parse_args()
    case = make_case(*args.shape, "cuda", torch.bfloat16, seed=0)
    for which in args.passes:
        fn = make_steps(case, which)["moekit"]
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"\n===== {which}: per call µs (cProfile-inflated) =====")
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(args.top)
    for key, rep in cache_entries("replay").items():
        print(key[:2], "ready" if rep.ready else "not ready", "disabled" if rep.disabled else "")


if __name__ == "__main__":
    main()
