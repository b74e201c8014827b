"""Where the host time of a grouped_mlp forward+backward goes (CUDA only).

Times each layer of the call stack with the GPU kept busy by ``torch.cuda._sleep`` (so the host
never waits on it), then prints a cProfile of whole calls sorted by own time.

    python benchmarks/profile_grouped_mlp_host.py [CPU ids to pin to, e.g. 2]
"""

from __future__ import annotations

import cProfile
import importlib
import os
import pstats
import sys
import time

import torch
import triton
import triton.language as tl
from benchmark_grouped_mlp import sleep_cycles_per_ms

from moekit.kernels import grouped_gemm as G
from moekit.kernels import grouped_mlp as M
from moekit.ops import grouped_mlp

# the module (moekit.ops.grouped_mlp the attribute is the function)
mlp_op = importlib.import_module("moekit.ops.grouped_mlp")


@triton.jit
def _noop_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


class _AutogradFloor(torch.autograd.Function):
    """No kernels: one output allocation forward, one gradient allocation per input backward.
    What any custom autograd op pays for Function.apply and the backward engine's hand-off."""

    @staticmethod
    def forward(ctx, x, w1, w2, p):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        return torch.empty_like(g), None, None, None


def host_us(fn, n: int, cycles_per_ms: float) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(400 * cycles_per_ms))  # 400 ms of GPU work ahead of the host
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / n * 1e6


def print_host_profile(fn, cycles_per_ms: float, sleep_ms: int, sorts, calls: int = 30) -> None:
    """cProfile of ``calls`` calls of ``fn`` behind ``sleep_ms`` of GPU work: for each (sort key
    "tottime" or "cumtime", rows) in ``sorts``, the top functions in µs per call of ``fn``
    (cProfile's own overhead included, so read them as shares, not absolute costs)."""
    torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, ncalls, tottime, cumtime, ..)
    for key, rows in sorts:
        col = 2 if key == "tottime" else 3
        print(f"  by {key}: µs per call   own   cumulative   calls per call   function")
        ranked = sorted(stats.items(), key=lambda kv: -kv[1][col])[:rows]
        for (file, line, name), (_, nc, tt, ct, _) in ranked:
            where = f"{os.path.basename(file)}:{line}({name})" if line else name
            print(
                f"  {1e6 * tt / calls:24.1f} {1e6 * ct / calls:12.1f} {nc / calls:16.1f}   {where}"
            )


def main() -> None:
    if len(sys.argv) > 1:  # CPU ids to pin to, e.g. "2" (threads started later inherit it)
        os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(",")})
    cpm = sleep_cycles_per_ms()

    R, E, H, F = 4096, 8, 1024, 1024
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(R, H, device=dev, dtype=dt, requires_grad=True)
    w1 = (torch.randn(E, 2 * F, H, device=dev, dtype=dt) / 32).requires_grad_()
    w2 = (torch.randn(E, H, F, device=dev, dtype=dt) / 32).requires_grad_()
    p = torch.rand(R, device=dev, requires_grad=True)
    off = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * (R // E)
    dy = torch.randn(R, H, device=dev, dtype=dt)
    ins = (x, w1, w2, p)
    a = torch.empty(R, F, device=dev, dtype=dt)
    h = torch.empty(R, 2 * F, device=dev, dtype=dt)
    y = torch.empty(R, H, device=dev, dtype=dt)
    buf = torch.zeros(1024, device=dev)

    def torch_composition():  # the benchmark's contender (a)
        hh = torch._grouped_mm(x, w1.transpose(1, 2), offs=off)
        g, u = hh.chunk(2, -1)
        return torch._grouped_mm(
            (torch.nn.functional.silu(g) * u * p[:, None]).to(dt), w2.transpose(1, 2), offs=off
        )

    def on_this_thread(fn):
        # Backward on the calling thread instead of autograd's CUDA device thread.
        def run():
            with torch.autograd.set_multithreading_enabled(False):
                return fn()

        return run

    def fwd_then_direct_backward():
        # The backward body called on this thread: no hand-off to autograd's device thread.
        out = grouped_mlp(x, off, w1, w2, p)
        return type(out.grad_fn)._forward_cls.backward(out.grad_fn, dy)

    def with_std_apply(fn):
        # The same call through torch.autograd.Function.apply's Python wrapper instead of
        # moekit.ops._apply.direct_apply (what the op did before session 14).
        def run():
            fast = mlp_op._apply_grouped_mlp
            mlp_op._apply_grouped_mlp = mlp_op._GroupedMLPFn.apply
            try:
                return fn()
            finally:
                mlp_op._apply_grouped_mlp = fast

        return run

    fwd_bwd = lambda: torch.autograd.grad(grouped_mlp(x, off, w1, w2, p), ins, dy)
    rows = {
        "fwd+bwd (autograd.grad)": fwd_bwd,
        "fwd+bwd, Function.apply": with_std_apply(fwd_bwd),
        "fwd+bwd, bwd on this thread, Function.apply": on_this_thread(with_std_apply(fwd_bwd)),
        "fwd+bwd, bwd on this thread": on_this_thread(
            lambda: torch.autograd.grad(grouped_mlp(x, off, w1, w2, p), ins, dy)
        ),
        "(a) fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(torch_composition(), ins, dy),
        "(a) fwd+bwd, bwd on this thread": on_this_thread(
            lambda: torch.autograd.grad(torch_composition(), ins, dy)
        ),
        "fwd + backward body, direct": fwd_then_direct_backward,
        "forward only": lambda: grouped_mlp(x, off, w1, w2, p),
        "autograd floor (no kernels)": lambda: torch.autograd.grad(
            _AutogradFloor.apply(x, w1, w2, p), (x,), dy
        ),
        "floor, bwd on this thread": on_this_thread(
            lambda: torch.autograd.grad(_AutogradFloor.apply(x, w1, w2, p), (x,), dy)
        ),
        "forward, no grad": lambda: grouped_mlp(x.detach(), off, w1.detach(), w2.detach(), p),
        "fc1 launcher (Triton path)": lambda: M.grouped_mlp_fc1(
            x, w1, off, a, h, p, None, "swiglu", True, None
        ),
        "ragged_m launcher (Triton path)": lambda: G.grouped_mm_ragged_m(
            a, w2.transpose(1, 2), off, y
        ),
        "noop triton kernel": lambda: _noop_kernel[(1,)](buf, 1000, BLOCK=1024),
        "torch.empty": lambda: torch.empty(R, F, device=dev, dtype=dt),
        "torch add": lambda: buf.add(1.0),
    }
    print(f"host µs per call (GPU kept busy), R={R} E={E} H={H} F={F}")
    for rnd in range(2):  # twice: the lent hosts' speed drifts
        print(f" round {rnd + 1}")
        for name, fn in rows.items():
            with torch.no_grad() if "launcher" in name else torch.enable_grad():
                print(f"  {name:32s} {host_us(fn, 30, cpm):8.1f}")

    # With backward on this thread cProfile sees the backward's Python too.
    print_host_profile(
        rows["fwd+bwd, bwd on this thread"], cpm, 800, (("tottime", 35), ("cumtime", 30))
    )


if __name__ == "__main__":
    main()
