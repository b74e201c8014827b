"""Where grouped_mlp's eager forward + backward host time goes: cProfile of calls enqueued
behind a GPU sleep (so no launch ever waits for the GPU), cumulative times of moekit's
functions, and the host µs of the pieces timed alone.

    PYTHONPATH=. python experiments/mlp_host.py
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from benchmark_small_shapes import make_case, make_steps
from common import sleep_cycles_per_ms

from moekit.ops import grouped_mlp


def covered_loop(fn, calls, cycles, prof=None, per_batch=20):
    total = 0.0
    for _ in range(calls // per_batch):
        torch.cuda._sleep(int(50 * cycles))
        if prof:
            prof.enable()
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn()
        total += time.perf_counter() - t0
        if prof:
            prof.disable()
        torch.cuda.synchronize()
    return total / calls * 1e6


def main() -> None:
    cycles = sleep_cycles_per_ms()
    c = make_case(2048, 2, 8, 1024, 1024, "cuda", torch.bfloat16, seed=0)
    steps = make_steps(c, "mlp")
    x, offs, w1, w2, p = c["x"], c["offsets"], c["w1"], c["w2"], c["row_probs"]
    xg, w1g, w2g, pg = (t.detach().requires_grad_() for t in (x, w1, w2, p))
    y = grouped_mlp(xg, offs, w1g, w2g, pg)
    pieces = {
        "fwd no grad": lambda: grouped_mlp(x, offs, w1, w2, p),
        "fwd with grad": lambda: grouped_mlp(xg, offs, w1g, w2g, pg),
        "bwd only (retain)": lambda: torch.autograd.grad(
            y, (xg, w1g, w2g, pg), c["dy"], retain_graph=True
        ),
        "fwd+bwd": steps["moekit"],
        "torch fwd+bwd": steps["torch"],
        "floor fwd+bwd": steps["autograd_floor"],
        "torch.empty x8": lambda: [torch.empty(4096, 1024, device="cuda") for _ in range(8)],
    }
    for fn in pieces.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    for rnd in range(2):
        for name, fn in pieces.items():
            print(f"round {rnd} {name:20} {covered_loop(fn, 200, cycles):7.1f} µs")
    torch.autograd.set_multithreading_enabled(False)
    for name in ("bwd only (retain)", "fwd+bwd", "torch fwd+bwd", "floor fwd+bwd"):
        print(f"caller thread {name:20} {covered_loop(pieces[name], 200, cycles):7.1f} µs")
    torch.autograd.set_multithreading_enabled(True)
    prof = cProfile.Profile()
    covered_loop(steps["moekit"], 400, cycles, prof)
    pstats.Stats(prof).sort_stats("cumulative").print_stats("moekit|autograd|built-in", 40)


if __name__ == "__main__":
    main()
