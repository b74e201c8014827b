"""Inclusive host µs per grouped_mlp forward + backward spent in each moekit function, from
timing wrappers, with calls enqueued behind a GPU sleep (no launch waits for the GPU).

    PYTHONPATH=. python experiments/mlp_host_breakdown.py
"""

from __future__ import annotations

import collections
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from benchmark_small_shapes import make_case, make_steps
from common import sleep_cycles_per_ms

import moekit.ops  # noqa: F401 - the package imports its modules

custom_op = sys.modules["moekit.runtime.op"]
gm = sys.modules["moekit.ops.grouped_mlp"]  # (moekit.ops.grouped_mlp is the function)
replay = sys.modules["moekit.runtime.replay"]

TOTAL: dict[str, float] = collections.defaultdict(float)
COUNT: dict[str, int] = collections.defaultdict(int)


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTAL[name] += time.perf_counter_ns() - t0
            COUNT[name] += 1

    return wrapper


def main() -> None:
    cycles = sleep_cycles_per_ms()
    c = make_case(2048, 2, 8, 1024, 1024, "cuda", torch.bfloat16, seed=0)
    step = make_steps(c, "mlp")["moekit"]
    for _ in range(5):
        step()
    # wrap after warm-up (plans and replays exist)
    gm.grouped_mlp = timed("grouped_mlp", gm.grouped_mlp)
    gm._plan = timed("_plan", gm._plan)
    gm._apply_grouped_mlp = timed("function_apply", gm._apply_grouped_mlp)
    gm._forward = timed("_forward (kernel op)", gm._forward)
    gm._backward = timed("_backward (kernel op)", gm._backward)
    gm._run_backward = timed("_run_backward", gm._run_backward)
    gm._tma_layouts = timed("_tma_layouts", gm._tma_layouts)
    gm._released = timed("_released", gm._released)
    gm._release = timed("_release", gm._release)
    gm._Backward.__init__ = timed("_Backward.__init__", gm._Backward.__init__)
    gm._Backward.one_segment = timed("one_segment", gm._Backward.one_segment)
    gm.replayed = timed("replayed", gm.replayed)
    replay.LaunchReplay.run = timed("LaunchReplay.run", replay.LaunchReplay.run)
    custom_op.plain_eager = timed("plain_eager", custom_op.plain_eager)
    gm.plain_eager = timed("plain_eager", gm.plain_eager)
    orig_bwd = gm._GroupedMLPFn.backward
    gm._GroupedMLPFn.backward = staticmethod(timed("Function.backward", orig_bwd))
    x, offs, w1, w2, p = c["x"], c["offsets"], c["w1"], c["w2"], c["row_probs"]
    ins = tuple(t.detach().requires_grad_() for t in (x, w1, w2, p))

    def fwd_bwd():
        y = gm.grouped_mlp(ins[0], offs, ins[1], ins[2], ins[3])
        return torch.autograd.grad(y, ins, c["dy"])

    for _ in range(5):
        fwd_bwd()
    torch.cuda.synchronize()
    TOTAL.clear()
    COUNT.clear()
    n, wall = 0, 0.0
    for _ in range(10):
        torch.cuda._sleep(int(60 * cycles))
        t0 = time.perf_counter()
        for _ in range(20):
            fwd_bwd()
        wall += time.perf_counter() - t0
        n += 20
        torch.cuda.synchronize()
    print(f"fwd+bwd wall per call: {wall / n * 1e6:.1f} µs (with wrappers)")
    for name in ("torch", "autograd_floor"):
        f = make_steps(c, "mlp")[name]
        for _ in range(5):
            f()
        torch.cuda.synchronize()
        tot = 0.0
        for _ in range(10):
            torch.cuda._sleep(int(60 * cycles))
            t0 = time.perf_counter()
            for _ in range(20):
                f()
            tot += time.perf_counter() - t0
            torch.cuda.synchronize()
        print(f"{name} fwd+bwd: {tot / 200 * 1e6:.1f} µs")
    for name, ns in sorted(TOTAL.items(), key=lambda kv: -kv[1]):
        print(f"  {name:24} {ns / n / 1e3:7.1f} µs per fwd+bwd  ({COUNT[name] / n:.0f} calls)")


if __name__ == "__main__":
    main()
