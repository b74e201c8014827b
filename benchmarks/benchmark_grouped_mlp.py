"""Grouped MLP benchmark: moekit's fused grouped_mlp against torch._grouped_mm + autograd.

    python benchmarks/benchmark_grouped_mlp.py --quick --out bench_out   # no loop baseline
    python benchmarks/benchmark_grouped_mlp.py --out bench_out           # adds the loop baseline
    python benchmarks/benchmark_grouped_mlp.py --smoke --out /tmp/smoke  # tiny shapes, CPU or GPU

The op is a gated (SwiGLU) expert MLP over expert-sorted rows, forward + backward:
    y = fc2(silu(x @ w1[e, :F]^T) * (x @ w1[e, F:]^T) * probs)   per expert segment e
with x [R, H] bf16, offsets [E] int32 cumulative row ends (on the device), w1 [E, 2F, H],
w2 [E, H, F], probs [R] fp32; gradients flow to x, w1, w2 and probs. FLOPs of forward + backward
are counted as exactly 18·R·H·F (three GEMMs of 2·R·H·2F or 2·R·F·H each way).

What one run measures, in this order:
1. The dense bf16 peak of this GPU in this run (torch.mm 8192³); the "floor" of a shape is its
   FLOPs / that peak. Measured again at the end of the run (the clock drifts).
2. Host overhead at a CPU-bound shape (E=8, H=1024, F=1024, R=4096, uniform routing), the
   TransformerEngine way: a long ``torch.cuda._sleep`` is enqueued first so the host never waits
   on the GPU, then N=50 forward + backward calls (in batches of 25 behind a sleep each, to stay
   under the GPU's launch-queue depth) are timed with ``time.perf_counter`` and no
   synchronisation; µs per call = elapsed / N; the contenders take turns over 3 rounds and each
   keeps its best (the host's speed drifts). Kernel launches per call at
   this shape are counted afterwards with torch.profiler. If the sleep ended before the last call was
   enqueued (the op synchronised with the GPU, or the sleep was too short) the number is flagged.
   Each contender is timed twice per round: with autograd's default, which runs the backward of
   CUDA tensors on its per-device thread while the caller waits, and with
   ``torch.autograd.set_multithreading_enabled(False)``, which runs it on the caller's thread.
   Targets: moekit ≤ 0.5 × torch and ≤ 100 µs.
3. For every shape (skewed gamma routing, at least one idle expert), GPU time of forward +
   backward, median of ``triton.testing.do_bench``, contenders timed in alternating rounds (best
   of 2 rounds each) so no side gets the cooler GPU:
     moekit            grouped_mlp(..., recompute_activation=False)
     moekit_recompute  grouped_mlp(..., recompute_activation=True)
     torch_grouped_mm  torch._grouped_mm → silu·up·probs (→ bf16) → torch._grouped_mm, autograd
     loop              per-expert F.linear over host-known bounds (skipped by --quick)
   Every contender runs ``torch.autograd.grad(y, (x, w1, w2, probs), dy)`` (no .grad
   accumulation). Also the peak memory of one forward + backward above what was allocated before
   it (MiB, gradients included), the memory a forward keeps alive for its backward, the GPU time
   of each kernel of moekit and torch_grouped_mm (torch.profiler), and on the first shape the
   CUDA kernel launches (memset/memcpy included) of one forward + backward.
4. CUDA-graph replay at the host-overhead shape: one forward + backward (autograd.grad on static
   inputs) captured per contender, then host µs per replay (same sleep method) and GPU µs per
   replay (do_bench of replay). Then the forward through ``torch.cuda.make_graphed_callables``
   used like an eager op (inputs copied into the static ones, forward and backward graphs
   replayed through autograd): host µs per forward + backward. Last, because a failed capture
   can leave CUDA state (the RNG) unusable; a contender whose capture fails gets NaN.

Every contender of every shape is wrapped: a failure (out of memory, an unsupported case) prints
its error and records NaN. ``--budget-s`` stops starting new shapes once the run has lasted that
long (the skipped shapes are listed); the outputs are still written. Progress lines are printed as
results come in and grouped_mlp.json is rewritten after every shape; grouped_mlp.png (TFLOP/s per
shape and contender with the peak dashed; host µs per call) is written at the end.

--smoke runs tiny shapes (R=64, E=4, H=32, F=16) end to end to check the plumbing. Without CUDA
it times with time.perf_counter, uses the differentiable reference grouped GEMM in place of
torch._grouped_mm, and skips the profiler, CUDA graphs, peak memory and the GPU sleep.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import math
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F
import triton
from common import (
    GROUPED_MLP_SHAPES,
    AutogradFloor,
    DensePeak,
    bench_ms,
    error_line,
    host_ms,
    host_us_per_call,
    interleaved_rounds,
    pyplot,
    routing_counts,
    save_figure,
    sleep_cycles_per_ms,
    write_json,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run from a checkout

from moekit.ops import grouped_mlp
from moekit.reference.grouped_gemm import grouped_mm_ragged_m_ref

SHAPES = GROUPED_MLP_SHAPES  # name, R (routed rows), E, H, F
SMOKE_SHAPES = [("smoke_a", 64, 4, 32, 16), ("smoke_b", 96, 3, 64, 32)]
HOST_SHAPE = ("host_cpu_bound", 2048 * 2, 8, 1024, 1024)
SMOKE_HOST_SHAPE = ("smoke_host", 64, 4, 32, 16)

CONTENDERS = ["moekit", "moekit_recompute", "torch_grouped_mm", "loop"]
LABELS = {
    "moekit": "moekit",
    "moekit_recompute": "moekit (recompute act.)",
    "torch_grouped_mm": "torch._grouped_mm + autograd",
    "loop": "per-expert F.linear loop",
}
DTYPE = torch.bfloat16
NAN = float("nan")


def log(*args) -> None:
    print(*args, flush=True)


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


class Timer:
    """GPU: median of triton's do_bench (ms). CPU (smoke): median of a few perf_counter calls."""

    def __init__(self, cuda: bool, quick: bool):
        self.cuda = cuda
        self.warmup, self.rep = (10, 60) if quick else (25, 200)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, fn) -> float:
        if self.cuda:
            return bench_ms(fn, warmup=self.warmup, rep=self.rep)
        return host_ms(fn, calls=3, warm=1)


def dense_peak_tflops(timer: Timer, device: str) -> float:
    """Fresh operands every call: nothing of the peak's stays allocated while shapes run."""
    return DensePeak(DTYPE, device, 8192 if timer.cuda else 512, timer.ms).tflops()


# ------------------------------------------------------------------------------------------------
# Inputs and contenders
# ------------------------------------------------------------------------------------------------


def make_inputs(R, E, H, Fd, skewed, device, seed):
    """Routing counts (host), offsets [E] int32 and the leaves x, w1, w2, probs on the device
    (made there: a host randn of Mixtral's w1 takes seconds), plus the output gradient dy."""
    torch.manual_seed(seed)
    counts = routing_counts(R, E, skewed, torch.Generator().manual_seed(seed))
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape, dtype=DTYPE: torch.randn(*shape, device=device, dtype=dtype, generator=g)
    x = rand(R, H).requires_grad_(True)
    w1 = (rand(E, 2 * Fd, H) / math.sqrt(H)).requires_grad_(True)
    w2 = (rand(E, H, Fd) / math.sqrt(Fd)).requires_grad_(True)
    probs = torch.rand(R, device=device, generator=g).requires_grad_(True)
    dy = rand(R, H)
    return counts, offsets, x, w1, w2, probs, dy


def make_steps(counts, offsets, x, w1, w2, probs, dy, names):
    """name -> zero-argument callable doing one forward + backward (autograd.grad; returns the
    gradients of x, w1, w2, probs)."""
    cuda = x.is_cuda
    host_counts = counts.tolist()  # host-known bounds, computed once outside any timing
    live = [e for e, c in enumerate(host_counts) if c > 0]
    inputs = (x, w1, w2, probs)

    if cuda:
        gmm = lambda a, b: torch._grouped_mm(a, b, offs=offsets)
    else:  # torch._grouped_mm is CUDA-only; the reference is differentiable
        gmm = lambda a, b: grouped_mm_ragged_m_ref(a, b, offsets, a.dtype)

    def moekit():
        return grouped_mlp(x, offsets, w1, w2, probs, recompute_activation=False)

    def moekit_recompute():
        return grouped_mlp(x, offsets, w1, w2, probs, recompute_activation=True)

    def torch_grouped_mm():
        h = gmm(x, w1.transpose(1, 2))
        g, u = h.chunk(2, -1)
        a = (F.silu(g) * u * probs[:, None]).to(x.dtype)  # bf16 · fp32 probs → fp32 → bf16
        return gmm(a, w2.transpose(1, 2))

    def loop():
        # split / unbind (not slicing) so autograd's backward is one cat / stack, not E
        # full-size zero-filled gradients summed.
        xs, ps = x.split(host_counts), probs.split(host_counts)
        w1s, w2s = w1.unbind(0), w2.unbind(0)
        outs = []
        for e in live:
            g, u = F.linear(xs[e], w1s[e]).chunk(2, -1)
            a = (F.silu(g) * u * ps[e][:, None]).to(x.dtype)
            outs.append(F.linear(a, w2s[e]))
        return torch.cat(outs)

    fwd = {
        "moekit": moekit,
        "moekit_recompute": moekit_recompute,
        "torch_grouped_mm": torch_grouped_mm,
        "loop": loop,
    }

    def moekit_of(x_, o_, w1_, w2_, p_):
        return grouped_mlp(x_, o_, w1_, w2_, p_)

    def moekit_recompute_of(x_, o_, w1_, w2_, p_):
        return grouped_mlp(x_, o_, w1_, w2_, p_, recompute_activation=True)

    def torch_grouped_mm_of(x_, o_, w1_, w2_, p_):
        h = torch._grouped_mm(x_, w1_.transpose(1, 2), offs=o_)
        g, u = h.chunk(2, -1)
        a = (F.silu(g) * u * p_[:, None]).to(x_.dtype)
        return torch._grouped_mm(a, w2_.transpose(1, 2), offs=o_)

    fwd_of = {  # the forward as a function of its inputs (for make_graphed_callables; CUDA)
        "moekit": moekit_of,
        "moekit_recompute": moekit_recompute_of,
        "torch_grouped_mm": torch_grouped_mm_of,
        "loop": None,
    }
    steps = {}
    for n in names:
        steps[n] = lambda f=fwd[n]: torch.autograd.grad(f(), inputs, dy)
        steps[n].fwd = fwd[n]  # forward alone: what it keeps for backward (saved_mib)
        steps[n].fwd_of = fwd_of[n]
    return steps


def peak_mib(step, timer: Timer) -> float:
    """MiB allocated at the peak of one forward + backward above what was allocated before."""
    if not timer.cuda:
        return NAN
    timer.sync()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = step()
    timer.sync()
    peak = torch.cuda.max_memory_allocated() - before
    del grads
    return peak / 2**20


def saved_mib(step, timer: Timer) -> float:
    """MiB a forward keeps alive for its backward (activations saved plus the output): what a
    model holds per layer between its forward and backward passes."""
    if not timer.cuda:
        return NAN
    timer.sync()
    before = torch.cuda.memory_allocated()
    y = step.fwd()
    timer.sync()
    held = torch.cuda.memory_allocated() - before
    del y
    return held / 2**20


def count_launches(step) -> tuple[int, list[tuple[str, int]]]:
    """CUDA kernel launches (memset / memcpy included) of one forward + backward."""
    from torch.profiler import ProfilerActivity, profile

    step()  # warm: compilation and autotuning stay out of the count
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        grads = step()
        torch.cuda.synchronize()
    del grads
    names = [evt.name for evt in prof.events() if evt.device_type == torch.autograd.DeviceType.CUDA]
    return len(names), collections.Counter(names).most_common()


def kernel_times(step) -> list[tuple[str, float]]:
    """GPU µs of each kernel of one (already warm) forward + backward, in launch order, from
    the profiler's device-side timestamps: where the time of a contender goes."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        grads = step()
        torch.cuda.synchronize()
    del grads
    evts = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    evts.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us()) for e in evts]


def _short_kernel_name(name: str) -> str:
    for cut in ("<", "("):
        name = name.split(cut)[0]
    return name[-48:]


# ------------------------------------------------------------------------------------------------
# Shapes
# ------------------------------------------------------------------------------------------------


def run_shape(name, R, E, H, Fd, names, timer, peak, device, seed, profile_launches):
    counts, offsets, x, w1, w2, probs, dy = make_inputs(R, E, H, Fd, True, device, seed)
    flops = 18 * R * H * Fd
    row = {
        "shape": name, "R": R, "E": E, "H": H, "F": Fd, "flops": flops,
        "routing": "skewed", "idle_experts": int((counts == 0).sum()),
        "max_rows_per_expert": int(counts.max()), "min_rows_per_expert": int(counts.min()),
        "floor_ms": flops / (peak * 1e9), "errors": {},
    }  # fmt: skip
    for c in CONTENDERS:
        row[f"{c}_ms"] = row[f"{c}_tflops"] = row[f"{c}_pct_peak"] = row[f"{c}_peak_mib"] = NAN
        row[f"{c}_saved_mib"] = NAN
    steps = make_steps(counts, offsets, x, w1, w2, probs, dy, names)

    def fail(c, where, exc):
        row["errors"][c] = f"{where}: {error_line(exc)}"
        log(f"  {name} {c} {where} FAILED: {error_line(exc)}")
        steps.pop(c, None)
        with contextlib.suppress(Exception):
            timer.sync()
        if timer.cuda:
            torch.cuda.empty_cache()

    # One warm call each (compiles and autotunes, catches unsupported cases), then peak memory.
    for c in list(steps):
        try:
            t0 = time.perf_counter()
            steps[c]()
            timer.sync()
            warm_s = time.perf_counter() - t0
            row[f"{c}_peak_mib"] = peak_mib(steps[c], timer)
            row[f"{c}_saved_mib"] = saved_mib(steps[c], timer)
            log(
                f"  {name} {c}: first call {warm_s:.1f} s, peak {row[f'{c}_peak_mib']:.0f} MiB,"
                f" kept for backward {row[f'{c}_saved_mib']:.0f} MiB"
            )
        except Exception as exc:  # e.g. out of memory, a case the fused path does not take yet
            fail(c, "warm", exc)

    # Alternating rounds, best median per contender (no side gets the cooler GPU).
    best, _ = interleaved_rounds(
        dict(steps), 2, timer.ms, on_error=lambda c, exc: fail(c, "timing", exc)
    )
    for c, ms in best.items():
        tf = flops / ms / 1e9
        row.update({f"{c}_ms": ms, f"{c}_tflops": tf, f"{c}_pct_peak": 100 * tf / peak})
    row["ratio_vs_torch"] = row["torch_grouped_mm_ms"] / row["moekit_ms"]
    row["ratio_recompute_vs_torch"] = row["torch_grouped_mm_ms"] / row["moekit_recompute_ms"]
    log(
        f"  {name}: "
        + "  ".join(f"{c} {row[f'{c}_ms']:.3f} ms ({row[f'{c}_tflops']:.0f} TF/s)" for c in names)
        + f"  ratio {row['ratio_vs_torch']:.2f} (recompute {row['ratio_recompute_vs_torch']:.2f})"
        + f"  floor {row['floor_ms']:.3f} ms"
    )

    if timer.cuda:  # per-kernel GPU time: which kernel of which contender costs what
        row["kernel_us"] = {}
        for c in ("moekit", "torch_grouped_mm"):
            if c not in steps:
                continue
            try:
                ks = kernel_times(steps[c])
                row["kernel_us"][c] = ks
                log(
                    f"  kernels {c} ({sum(t for _, t in ks):.0f} µs): "
                    + ", ".join(f"{_short_kernel_name(n)} {t:.0f}" for n, t in ks)
                )
            except Exception as exc:
                log(f"  kernel times {c} FAILED: {error_line(exc)}")

    launches = None
    if profile_launches and timer.cuda:
        launches = {}
        for c in ("moekit", "moekit_recompute", "torch_grouped_mm"):
            if c not in steps:
                continue
            try:
                n, kernels = count_launches(steps[c])
                launches[c] = {"shape": name, "count": n, "kernels": kernels}
                log(f"  launches per fwd+bwd ({name}) {c}: {n}")
                if c == "moekit":
                    for kname, k in kernels:
                        log(f"      {k:3d} × {kname[:150]}")
            except Exception as exc:
                launches[c] = {"shape": name, "count": None, "error": error_line(exc)}
                log(f"  launches {c} FAILED: {error_line(exc)}")
    return row, launches


# ------------------------------------------------------------------------------------------------
# Host overhead and CUDA graphs
# ------------------------------------------------------------------------------------------------


HOST_ROUNDS = 3
# (autograd multithreading, key suffix): autograd's default runs a CUDA graph's backward on
# its per-device thread while the caller waits; torch.autograd.set_multithreading_enabled(False)
# (thread-local) runs it on the caller's thread, which saves the hand-off between the two.
HOST_MODES = ((True, ""), (False, "_caller_thread"))


FLOOR = "autograd_floor"


def run_host(shape, names, timer, device, n, cycles_per_ms):
    """Eager host µs per forward + backward at the CPU-bound shape (and its launch counts), and
    the same for ``AutogradFloor`` (row FLOOR), which launches nothing."""
    name, R, E, H, Fd = shape
    counts, offsets, x, w1, w2, probs, dy = make_inputs(R, E, H, Fd, False, device, 1234)
    steps = make_steps(counts, offsets, x, w1, w2, probs, dy, names)

    steps[FLOOR] = lambda: torch.autograd.grad(
        AutogradFloor.apply(x, offsets, w1, w2, probs), (x, w1, w2, probs), dy
    )
    names = [*names, FLOOR]
    res = {"shape": name, "R": R, "E": E, "H": H, "F": Fd, "calls": n, "errors": {}}
    for c in names:
        res[f"{c}_eager_gpu_us"], res[f"{c}_launches"] = NAN, None
        for _, suffix in HOST_MODES:
            res[f"{c}_host_us{suffix}"], res[f"{c}_host_covered{suffix}"] = NAN, None
    # The contenders take turns, three rounds, each keeping its best: a host's speed drifts
    # over a minute, which back-to-back blocks would charge to whichever contender ran during
    # a slow spell.
    for _ in range(HOST_ROUNDS):
        for c in names:
            for multithreaded, suffix in HOST_MODES:
                if c in res["errors"]:
                    continue
                try:
                    # Thread-local: with False, autograd runs backward on this thread.
                    with torch.autograd.set_multithreading_enabled(multithreaded):
                        us, covered = host_us_per_call(steps[c], n, cycles_per_ms, passes=1)
                except Exception as exc:
                    res["errors"][c] = error_line(exc)
                    log(f"  host {c} FAILED: {error_line(exc)}")
                    with contextlib.suppress(Exception):
                        timer.sync()
                    continue
                prev = (bool(res[f"{c}_host_covered{suffix}"]), -res[f"{c}_host_us{suffix}"])
                if res[f"{c}_host_covered{suffix}"] is None or (covered, -us) > prev:
                    res[f"{c}_host_us{suffix}"] = us
                    res[f"{c}_host_covered{suffix}"] = covered
    for c in names:
        if c in res["errors"]:
            continue
        res[f"{c}_eager_gpu_us"] = 1e3 * timer.ms(steps[c]) if timer.cuda else NAN
        flag = "" if res[f"{c}_host_covered"] else "  (GPU went idle during a batch: host waited)"
        gpu = f", GPU {res[f'{c}_eager_gpu_us']:.1f} µs" if timer.cuda else ""
        log(
            f"  host {c}: {res[f'{c}_host_us']:.1f} µs/call eager"
            f" ({res[f'{c}_host_us_caller_thread']:.1f} with backward on the caller's thread)"
            f"{gpu}{flag}"
        )
    if timer.cuda:  # after all the host timings: the profiler must not perturb them
        for c in names:
            with contextlib.suppress(Exception):
                res[f"{c}_launches"] = count_launches(steps[c])[0]
        log("  launches per fwd+bwd: " + ", ".join(f"{c} {res[f'{c}_launches']}" for c in names))
    for _, suffix in HOST_MODES:
        m = res.get(f"moekit_host_us{suffix}", NAN)
        t = res.get(f"torch_grouped_mm_host_us{suffix}", NAN)
        res[f"host_ratio_moekit_vs_torch{suffix}"] = m / t
    return res


def run_graphs(names, timer, res, n, cycles_per_ms):
    """CUDA-graph replay of one forward + backward per contender: host and GPU µs per replay."""
    R, E, H, Fd = res["R"], res["E"], res["H"], res["F"]
    # All random inputs before any capture: a failed capture can leave the CUDA RNG unusable.
    counts, offsets, x, w1, w2, probs, dy = make_inputs(R, E, H, Fd, False, "cuda", 1234)
    steps = make_steps(counts, offsets, x, w1, w2, probs, dy, names)
    # torch first: a failed moekit capture must not cost the baseline its numbers.
    order = sorted(names, key=lambda c: c != "torch_grouped_mm")
    for c in order:
        res[f"{c}_graph_host_us"] = res[f"{c}_graph_gpu_us"] = NAN
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm on a side stream, as the PyTorch docs say
                for _ in range(3):
                    steps[c]()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_grads = steps[c]()  # the graph's static outputs
            graph.replay()
            torch.cuda.synchronize()
            us, covered = host_us_per_call(graph.replay, n, cycles_per_ms)
            res[f"{c}_graph_host_us"] = us
            res[f"{c}_graph_host_covered"] = covered
            res[f"{c}_graph_gpu_us"] = 1e3 * timer.ms(graph.replay)
            log(
                f"  graph {c}: host {us:.1f} µs/replay, GPU {res[f'{c}_graph_gpu_us']:.1f} µs"
                + ("" if covered else "  (GPU went idle during the loop)")
            )
            del graph, static_grads
        except Exception as exc:
            _graph_failed(res, f"{c}_graph", f"graph {c}", exc)
        _release_cached_memory()
    # The same forward through torch.cuda.make_graphed_callables, used like an eager op: each
    # call copies its inputs into the graph's static ones and replays the forward graph, and
    # its backward (through autograd) replays the backward graph.
    for c in order:
        res[f"{c}_graphed_host_us"] = NAN
        if steps[c].fwd_of is None:
            continue
        try:
            graphed = torch.cuda.make_graphed_callables(
                steps[c].fwd_of, (x, offsets, w1, w2, probs)
            )
            ins = (x, w1, w2, probs)

            def step(g=graphed, ins=ins):
                return torch.autograd.grad(g(x, offsets, w1, w2, probs), ins, dy)

            us, covered = host_us_per_call(step, n, cycles_per_ms)
            res[f"{c}_graphed_host_us"] = us
            log(
                f"  make_graphed_callables {c}: host {us:.1f} µs per forward + backward"
                + ("" if covered else "  (GPU went idle during the loop)")
            )
            del graphed
        except Exception as exc:
            _graph_failed(res, f"{c}_graphed", f"make_graphed_callables {c}", exc)
        _release_cached_memory()


def _graph_failed(res, key: str, label: str, exc: BaseException) -> None:
    res["errors"][key] = error_line(exc)
    log(f"  {label} FAILED: {error_line(exc)}")
    with contextlib.suppress(Exception):
        torch.cuda.synchronize()


def _release_cached_memory() -> None:
    gc.collect()
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------


def _f(v, spec=".3f", width=8) -> str:
    return f"{'-' if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec):>{width}}"


def shape_table(rows) -> list[str]:
    lines = [
        f"{'shape':16s} {'moekit':>8s} {'recomp':>8s} {'torch':>8s} {'loop':>8s} {'floor':>8s}"
        f" | {'TF/s m':>6s} {'rc':>6s} {'torch':>6s} {'%pk m':>6s} | {'ratio':>6s} {'rc':>6s}"
        f" | {'MiB m':>7s} {'rc':>7s} {'torch':>7s} {'loop':>7s}"
        f" | {'kept m':>7s} {'rc':>7s} {'torch':>7s}",
        f"{'':16s} {'(ms, fwd+bwd GPU time, median)':^44s} |"
        f"{'':36s}|{'':31s}| (MiB kept from forward for backward)",
    ]
    for r in rows:
        lines.append(
            f"{r['shape']:16s} {_f(r['moekit_ms'])} {_f(r['moekit_recompute_ms'])}"
            f" {_f(r['torch_grouped_mm_ms'])} {_f(r['loop_ms'])} {_f(r['floor_ms'])}"
            f" | {_f(r['moekit_tflops'], '.0f', 6)} {_f(r['moekit_recompute_tflops'], '.0f', 6)}"
            f" {_f(r['torch_grouped_mm_tflops'], '.0f', 6)} {_f(r['moekit_pct_peak'], '.1f', 6)}"
            f" | {_f(r['ratio_vs_torch'], '.2f', 6)} {_f(r['ratio_recompute_vs_torch'], '.2f', 6)}"
            f" | {_f(r['moekit_peak_mib'], '.0f', 7)} {_f(r['moekit_recompute_peak_mib'], '.0f', 7)}"
            f" {_f(r['torch_grouped_mm_peak_mib'], '.0f', 7)} {_f(r['loop_peak_mib'], '.0f', 7)}"
            f" | {_f(r.get('moekit_saved_mib'), '.0f', 7)}"
            f" {_f(r.get('moekit_recompute_saved_mib'), '.0f', 7)}"
            f" {_f(r.get('torch_grouped_mm_saved_mib'), '.0f', 7)}"
        )
    lines.append(
        "  ratio = torch_grouped_mm ms / moekit ms (> 1: moekit faster); floor = FLOPs / peak"
    )
    return lines


def host_table(host, names) -> list[str]:
    if not host:
        return ["host overhead: not measured"]
    lines = [
        f"host overhead, {host['shape']} (R={host['R']} E={host['E']} H={host['H']} F={host['F']},"
        f" {host['calls']} calls"
        + (", in batches behind a GPU sleep):" if host.get("moekit_launches") else "):"),
        f"  {'contender':18s} {'launches':>8s} {'eager host µs':>13s} {'caller-thread':>13s}"
        f" {'eager GPU µs':>12s} {'graph host µs':>13s} {'graph GPU µs':>12s}"
        f" {'graphed callable host µs':>24s}",
    ]
    for c in [*names, FLOOR] if f"{FLOOR}_host_us" in host else names:
        flag = "" if host.get(f"{c}_host_covered", True) is not False else "  (host waited on GPU)"
        lines.append(
            f"  {c:18s} {_f(host.get(f'{c}_launches'), 'd', 8)} {_f(host.get(f'{c}_host_us'), '.1f', 13)}"
            f" {_f(host.get(f'{c}_host_us_caller_thread'), '.1f', 13)}"
            f" {_f(host.get(f'{c}_eager_gpu_us'), '.1f', 12)}"
            f" {_f(host.get(f'{c}_graph_host_us'), '.1f', 13)}"
            f" {_f(host.get(f'{c}_graph_gpu_us'), '.1f', 12)}"
            f" {_f(host.get(f'{c}_graphed_host_us'), '.1f', 24)}{flag}"
        )
    lines += [
        f"  moekit / torch eager host time: {_f(host.get('host_ratio_moekit_vs_torch'), '.2f', 0)}"
        f" (target ≤ 0.5); moekit {_f(host.get('moekit_host_us'), '.1f', 0)} µs (target ≤ 100)",
        "  with backward on the caller's thread (set_multithreading_enabled(False)): "
        f"{_f(host.get('host_ratio_moekit_vs_torch_caller_thread'), '.2f', 0)};"
        f" moekit {_f(host.get('moekit_host_us_caller_thread'), '.1f', 0)} µs",
        f"  {FLOOR}: one custom autograd Function with these inputs and outputs, no kernels"
        " (the floor of any such op on this host)",
    ]
    return lines


def plot(rows, host, names, peak, path) -> None:
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(
        1, 2, figsize=(max(12, 2.2 * len(rows) + 6), 5), gridspec_kw={"width_ratios": [2, 1]}
    )
    xs = list(range(len(rows)))
    w = 0.8 / max(1, len(names))
    for i, c in enumerate(names):
        vals = [r[f"{c}_tflops"] for r in rows]
        ax.bar(
            [x + (i - (len(names) - 1) / 2) * w for x in xs],
            vals,
            w,
            label=LABELS[c],
            color=f"C{i}",
        )
    ax.axhline(peak, color="k", ls="--", lw=1, label=f"dense torch.mm peak {peak:.3g}")
    if not rows:
        ax.text(0.5, 0.5, "no shape measured", ha="center", transform=ax.transAxes)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{r['shape']}\nR={r['R']} E={r['E']}\nH={r['H']} F={r['F']}" for r in rows],
                       fontsize=7)  # fmt: skip
    ax.set_ylabel("TFLOP/s, forward + backward (18·R·H·F), bf16")
    ax.set_title("GPU throughput (skewed routing)")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)

    kinds = [("host_us", "eager, host"), ("host_us_caller_thread", "eager, host, bwd on caller"),
             ("graph_host_us", "graph replay, host"), ("graphed_host_us", "make_graphed_callables, host"),
             ("graph_gpu_us", "graph replay, GPU")]  # fmt: skip
    hx = list(range(len(names)))
    wk = 0.8 / len(kinds)
    for i, (key, label) in enumerate(kinds):
        vals = [host.get(f"{c}_{key}", NAN) if host else NAN for c in names]
        ax2.bar(
            [x + (i - (len(kinds) - 1) / 2) * wk for x in hx], vals, wk, label=label, color=f"C{i}"
        )
    ax2.axhline(100, color="gray", ls=":", lw=1, label="100 µs target")
    ax2.set_xticks(hx)
    ax2.set_xticklabels([LABELS[c] for c in names], rotation=20, ha="right", fontsize=7)
    ax2.set_ylabel("µs per forward + backward")
    title = f"host overhead ({host['shape']})" if host else "host overhead (not measured)"
    ax2.set_title(title)
    ax2.legend(fontsize=7)
    ax2.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out", help="directory for grouped_mlp.json / .png")
    ap.add_argument("--quick", action="store_true", help="skip the loop baseline, fewer reps")
    ap.add_argument("--shapes", default=None, help="comma list of shape names (default: all)")
    ap.add_argument(
        "--budget-s", type=float, default=None,
        help="start no new shape past this many seconds (default 150 with --quick, 900 without)",
    )  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, end to end (CPU or GPU)")
    ap.add_argument(
        "--host-cpus", default=None,
        help="comma list of CPU ids to pin the process to; threads started later inherit it "
        "(e.g. 2: the caller and autograd's device thread share one core; see docs)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.host_cpus:
        # Threads started from here on (autograd's device thread among them) inherit the mask.
        os.sched_setaffinity(0, {int(c) for c in args.host_cpus.split(",")})

    t_start = time.time()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        wanted = [s for s in args.shapes.split(",") if s]
        unknown = set(wanted) - {s[0] for s in shapes}
        if unknown:
            ap.error(f"unknown shapes {sorted(unknown)}; known: {[s[0] for s in shapes]}")
        shapes = [s for s in shapes if s[0] in wanted]
    budget = args.budget_s if args.budget_s is not None else (150.0 if args.quick else 900.0)
    names = [c for c in CONTENDERS if not (args.quick and c == "loop")]
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "grouped_mlp.json")
    png_path = os.path.join(args.out, "grouped_mlp.png")
    torch.manual_seed(0)
    timer = Timer(cuda, args.quick or args.smoke)
    dev_name = (
        torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or 'unknown'})"
    )

    peak = dense_peak_tflops(timer, device)
    log(
        f"device: {dev_name}  torch {torch.__version__}  triton {triton.__version__}\n"
        f"dense bf16 peak (torch.mm {'8192' if cuda else '512'}^3): {peak:.0f} TFLOP/s"
    )
    state = {
        "device": dev_name, "torch": torch.__version__, "triton": triton.__version__,
        "args": vars(args), "contenders": names, "peak_tflops": [peak],
        "flops_formula": "18*R*H*F (gated MLP, forward + backward)",
        "timing": "median of triton.testing.do_bench (L2 flushed), best of 2 alternating rounds"
        if cuda else "median of 3 perf_counter calls (CPU smoke)",
        "rows": [], "host": None, "launches": None, "skipped_shapes": [],
    }  # fmt: skip

    # Host overhead (eager) first: a small shape, and the numbers with targets.
    n_calls = 10 if args.smoke else 50
    cycles_per_ms = None
    pinned = f", pinned to CPUs {args.host_cpus}" if args.host_cpus else ""
    log(f"\nhost overhead (eager{pinned}):")
    try:
        if cuda:
            cycles_per_ms = sleep_cycles_per_ms()
            log(f"  torch.cuda._sleep: {cycles_per_ms / 1e6:.2f} G cycles per second")
        host_shape = SMOKE_HOST_SHAPE if args.smoke else HOST_SHAPE
        state["host"] = run_host(host_shape, names, timer, device, n_calls, cycles_per_ms)
        state["host"]["cpus"] = sorted(os.sched_getaffinity(0))
    except Exception as exc:
        log(f"  host overhead FAILED: {error_line(exc)}")
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    write_json(json_path, state, nan_as_null=True)

    log("\nshapes (forward + backward, skewed routing):")
    for i, (name, R, E, H, Fd) in enumerate(shapes):
        elapsed = time.time() - t_start
        if elapsed > budget:
            state["skipped_shapes"].append(name)
            log(f"  {name}: skipped ({elapsed:.0f} s > --budget-s {budget:.0f})")
            continue
        t0 = time.time()
        log(f"  [{i + 1}/{len(shapes)}] {name} R={R} E={E} H={H} F={Fd}")
        try:
            row, launches = run_shape(
                name, R, E, H, Fd, names, timer, peak, device, seed=i,
                profile_launches=state["launches"] is None,
            )  # fmt: skip
            row["seconds"] = time.time() - t0
            state["rows"].append(row)
            if launches is not None:
                state["launches"] = launches
        except Exception as exc:  # e.g. out of memory building the inputs
            log(f"  {name} FAILED: {error_line(exc)}")
            state.setdefault("failed_shapes", {})[name] = error_line(exc)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        state["seconds"] = time.time() - t_start
        write_json(json_path, state, nan_as_null=True)
        log(f"  {name}: {time.time() - t0:.1f} s (run so far {time.time() - t_start:.0f} s)")

    if cuda:
        try:
            state["peak_tflops"].append(dense_peak_tflops(timer, device))
        except Exception as exc:
            log(f"peak (end of run) FAILED: {error_line(exc)}")
        if state["host"] is not None:
            log("\nCUDA-graph replay (host-overhead shape):")
            run_graphs(names, timer, state["host"], n_calls, cycles_per_ms)
    state["seconds"] = time.time() - t_start
    write_json(json_path, state, nan_as_null=True)

    try:
        plot(state["rows"], state["host"], names, peak, png_path)
    except Exception as exc:
        log(f"plot FAILED: {error_line(exc)}")

    log(
        f"\n{dev_name}; dense bf16 peak, start / end of run: "
        + " / ".join(f"{p:.0f}" for p in state["peak_tflops"])
        + " TFLOP/s"
    )
    if state["launches"]:
        log(
            "kernel launches per fwd+bwd ("
            + next(iter(state["launches"].values()))["shape"]
            + "): "
            + ", ".join(f"{c} {v['count']}" for c, v in state["launches"].items())
        )
    if state["skipped_shapes"]:
        log(f"skipped past the {budget:.0f} s budget: {', '.join(state['skipped_shapes'])}")
    log("\n".join(host_table(state["host"], names)))
    log("\n".join(shape_table(state["rows"])))
    log(f"wrote {json_path} and {png_path} ({state['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
