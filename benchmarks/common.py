"""What the benchmarks share: MoE shapes, routings, timing, the dense bf16 peak and output files.

The benchmark scripts import it by name (``from common import ...``), which works when they are
run as ``python benchmarks/benchmark_<area>.py`` (Python puts the script's folder on sys.path).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import triton.testing

# Expert layers of real MoE models: E (experts), H (hidden size), F (expert width; fc1 produces
# 2F for the gated activation).
MOE_LAYERS = {
    "te_seed": (20, 2048, 512),
    "qwen3_30b_a3b": (128, 2048, 768),
    "olmoe": (64, 2048, 1024),
    "deepseek_v3_ep8": (32, 7168, 2048),
    "mixtral": (8, 4096, 14336),
    "gpt_oss_like": (128, 2880, 2880),
}


def moe_shapes(rows: dict[str, int]) -> list[tuple[str, int, int, int, int]]:
    """``(name, T, E, H, F)`` for each layer of ``rows`` (name -> T, the rows routed to experts,
    i.e. tokens × top-k), in its order."""
    return [(name, T, *MOE_LAYERS[name]) for name, T in rows.items()]


GROUPED_GEMM_SHAPES = moe_shapes(
    {"te_seed": 66560, "qwen3_30b_a3b": 65536, "olmoe": 32768, "deepseek_v3_ep8": 32768,
     "mixtral": 16384, "gpt_oss_like": 32768}
)  # fmt: skip
GROUPED_MLP_SHAPES = moe_shapes(
    {"te_seed": 66560, "qwen3_30b_a3b": 262144, "olmoe": 65536, "deepseek_v3_ep8": 32768,
     "mixtral": 16384}
)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Routings
# ------------------------------------------------------------------------------------------------


def routing_counts(T: int, E: int, skewed: bool, gen: torch.Generator) -> torch.Tensor:
    """Rows per expert [E] int64 summing to T: uniform, or skewed (gamma-distributed shares,
    so some experts get few rows, and at least one expert gets none). The skewed shares come
    from torch's global RNG, the idle expert from ``gen``."""
    if not skewed:
        counts = torch.full((E,), T // E, dtype=torch.int64)
        counts[: T - int(counts.sum())] += 1
        return counts
    share = torch.distributions.Gamma(0.6, 1.0).sample((E,))
    share[torch.randint(E, (1,), generator=gen)] = 0.0  # at least one idle expert
    counts = torch.floor(share / share.sum() * T).to(torch.int64)
    counts[torch.argmax(counts)] += T - int(counts.sum())
    return counts


def skewed_routing(T: int, E: int, draw: int) -> torch.Tensor:
    """Skewed routing number ``draw`` of a shape: seeded by ``draw`` alone, so a shape's routings
    do not depend on what ran before, and the caller's random state is left as it was. Draw 0 is
    ``routing_counts(T, E, True, Generator().manual_seed(0))`` right after ``manual_seed(0)``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(draw)
        return routing_counts(T, E, True, torch.Generator().manual_seed(draw))


def topk_routing(T: int, E: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token routing as a router produces it: the top-k experts of random scores per token,
    ``indices [T, k]`` int64 and their renormalised softmax ``probs [T, k]`` (global RNG)."""
    scores = torch.randn(T, E, device=device)
    probs, idx = scores.softmax(-1).topk(k, dim=-1)
    return idx, probs / probs.sum(-1, keepdim=True)


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


def bench_ms(fn: Callable, warmup: float = 25, rep: float = 100) -> float:
    """GPU ms per call of ``fn``: the median of ``triton.testing.do_bench``, which flushes L2
    before every call (``warmup`` and ``rep`` are its time budgets in ms)."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def fixed_count_ms(fn: Callable, warmup: int = 10, calls: int = 50) -> float:
    """GPU ms per call of ``fn``: the median over ``calls`` calls, each between two CUDA events,
    after ``warmup`` calls. A fixed number of calls, unlike :func:`bench_ms` (whose count
    depends on a first timing): calls that hold a collective must be made as often on every
    rank, or the ranks wait on each other for ever. No L2 flush."""
    for _ in range(warmup):
        fn()
    events = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def copy_gb_per_s(device) -> float:
    """Device-to-device copy rate of a 1 GiB buffer: GB/s read + written (``bench_ms``)."""
    src = torch.empty(2**29, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), warmup=5, rep=30)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def host_ms(fn: Callable, calls: int = 3, warm: int = 1) -> float:
    """The CPU stand-in for :func:`bench_ms` in --smoke runs without CUDA: the median ms of
    ``calls`` calls after ``warm`` untimed ones. It checks the plumbing; it measures nothing."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_us(fn, calls: int = 20, fixed_count: bool = False) -> float:
    """GPU µs per call of ``fn`` replayed from a CUDA graph of ``calls`` calls.
    ``fixed_count``: replay a fixed number of times (calls that hold a collective, see
    :func:`fixed_count_ms`)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    if fixed_count:
        return fixed_count_ms(graph.replay, warmup=3, calls=10) * 1e3 / calls
    return bench_ms(graph.replay, warmup=10, rep=50) * 1e3 / calls


def interleaved_rounds(
    fns: dict[str, Callable],
    rounds: int,
    time_fn: Callable[[Callable], float] = bench_ms,
    on_error: Callable[[str, Exception], None] | None = None,
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Time every callable of ``fns`` in turn, ``rounds`` times over, with ``time_fn``.

    The GPU's clock drifts over a long run (heat, power): timing the contenders in alternating
    rounds and keeping each one's best gives none of them the cooler GPU. Returns each one's best
    time and its time in every round it ran. A callable that raises is passed to
    ``on_error(name, exc)`` (raised again without one), gets NaN as its best and is not called
    again."""
    best = {name: math.inf for name in fns}
    per_round: dict[str, list[float]] = {name: [] for name in fns}
    failed: set[str] = set()
    for _ in range(rounds):
        for name, fn in fns.items():
            if name in failed:
                continue
            try:
                ms = time_fn(fn)
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(name, exc)
                failed.add(name)
                best[name] = math.nan
                continue
            best[name] = min(best[name], ms)
            per_round[name].append(ms)
    return best, per_round


def sleep_cycles_per_ms() -> float:
    """Calibrate torch.cuda._sleep: cycles per ms of GPU time."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 100_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / start.elapsed_time(end)


def _synchronized_ms(*fns: Callable) -> float:
    """ms of host + GPU time of one call of each of ``fns`` in turn, synchronised after each
    turn (mean of 3): an upper bound that sizes the GPU sleep the host-time loops hide behind."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        for fn in fns:
            fn()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / 3 * 1e3


def host_us_per_call(
    fn,
    n: int,
    cycles_per_ms: float | None,
    per_batch: int = 25,
    passes: int = 2,
    fixed_count: bool = False,
) -> tuple[float, bool]:
    """Host µs per call of ``fn``: n calls, in batches of ``per_batch`` each enqueued behind a GPU
    sleep and timed with no synchronisation inside, ``passes`` times over; the median over the
    batches of their µs per call. The median rather than the mean: a batch that the OS
    preempted or that a cyclic garbage collection fell into (tens of µs against calls of 20)
    shows as an outlier, not as a shift of every figure. Batches keep the pending launches
    under the GPU's launch-queue depth (about a thousand), past which a launch blocks until the
    GPU drains: a batch of the torch composition, the contender with the most launches per
    call, stays below it.
    Returns (µs, covered): covered is False when the GPU went idle before a batch's last call was
    enqueued (the op synchronised, or the sleep was too short), so the host waited on the GPU.
    ``fixed_count``: no retry and no early stop, so every rank makes the same number of calls
    (for calls that hold a collective)."""
    for _ in range(5):  # warm: the caching allocator holds every block the loop needs
        fn()
    if cycles_per_ms is None:  # CPU: everything runs on the host anyway
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6, True
    upper_ms = _synchronized_ms(fn)
    per_call_us, covered_all = [], True
    attempts = 1 if fixed_count else 2  # a second, longer sleep if the first ran out
    for _ in range(passes):
        done = 0
        while done < n:
            k = min(per_batch, n - done)
            for attempt in range(attempts):
                sleep_ms = (10 + 2 * k * upper_ms) * 4**attempt
                torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
                slept = torch.cuda.Event()
                slept.record()
                t0 = time.perf_counter()
                for _ in range(k):
                    fn()
                dt = time.perf_counter() - t0
                covered = not slept.query()  # the sleep still runs: the host never waited
                torch.cuda.synchronize()
                if covered:
                    break
            if not covered:
                attempts = 1  # even a 4x sleep ran out: fn synchronises, stop retrying
            per_call_us.append(dt / k * 1e6)
            covered_all, done = covered_all and covered, done + k
        if not covered_all and not fixed_count:
            break
    return statistics.median(per_call_us), covered_all


class PairedGap(NamedTuple):
    gap_us: float  # median over the pairs of (fn_a − fn_b)
    gaps_us: list[float]  # every pair's gap
    covered: bool  # False: a batch ran past its GPU sleep even on retries
    a_us: float  # median of fn_a's own times
    b_us: float  # median of fn_b's own times


def paired_host_gaps_us(
    fn_a: Callable,
    fn_b: Callable,
    pairs: int,
    cycles_per_ms: float,
    per_batch: int = 8,
    fixed_count: bool = False,
    clocks: Sequence[Callable[[], float]] = (time.perf_counter, time.process_time),
) -> tuple[PairedGap, ...]:
    """Host µs of one call of ``fn_a`` minus one call of ``fn_b``, one :class:`PairedGap` per
    clock in ``clocks`` (seconds; each read at the same three points of a pair): the median
    over ``pairs`` pairs of adjacent calls, each call timed alone while the GPU is kept busy
    (``per_batch`` pairs behind one GPU sleep, the order within a pair alternating). A slow
    stretch of the host (another tenant, a garbage collection) then hits both calls of a pair
    alike, where timing each contender in its own batches lets it land on one of them: the
    difference of two medians moves by far more than the gap itself. ``covered`` is False when
    a batch ran past its GPU sleep even on retries, so the host waited on the GPU in it.
    ``fixed_count``: no retries (the same number of calls on every rank, for calls that hold a
    collective). ``time.process_time`` counts the CPU time of every thread of the process (the
    autograd engine's device threads run a CUDA backward) and none of the time the process was
    off the CPU or waiting, which wall-clock pairs on a shared host pick up as a spread of
    hundreds of µs."""
    for _ in range(5):
        fn_a()
        fn_b()
    upper_ms = _synchronized_ms(fn_a, fn_b)
    n = len(clocks)
    gaps: list[list[float]] = [[] for _ in range(n)]
    a_times: list[list[float]] = [[] for _ in range(n)]
    b_times: list[list[float]] = [[] for _ in range(n)]
    done, misses, covered_all = 0, 0, True

    def read() -> list[float]:
        return [c() for c in clocks]

    while done < pairs:
        k = min(per_batch, pairs - done)
        torch.cuda._sleep(int((10 + 2 * (k + 1) * upper_ms) * cycles_per_ms))
        slept = torch.cuda.Event()
        slept.record()
        # untimed: the first calls after a synchronisation run slower (a cold host), and the
        # first pair of every batch would put that on the same contender
        fn_a()
        fn_b()
        batch = []
        for i in range(k):
            a_first = (done + i) % 2 == 0
            first, second = (fn_a, fn_b) if a_first else (fn_b, fn_a)
            t0 = read()
            first()
            t1 = read()
            second()
            t2 = read()
            batch.append((a_first, t0, t1, t2))
        covered = not slept.query()
        torch.cuda.synchronize()
        # not covered: the host waited on the GPU in this batch, measure it again
        if covered or fixed_count or misses >= 3:
            for a_first, t0, t1, t2 in batch:
                for j in range(n):
                    one, two = (t1[j] - t0[j]) * 1e6, (t2[j] - t1[j]) * 1e6
                    a_us, b_us = (one, two) if a_first else (two, one)
                    gaps[j].append(a_us - b_us)
                    a_times[j].append(a_us)
                    b_times[j].append(b_us)
            done += k
            covered_all = covered_all and covered
        else:
            misses += 1
    return tuple(
        PairedGap(
            statistics.median(gaps[j]),
            gaps[j],
            covered_all,
            statistics.median(a_times[j]),
            statistics.median(b_times[j]),
        )
        for j in range(n)
    )


class AutogradFloor(torch.autograd.Function):
    """One custom autograd op with the grouped MLP's inputs and outputs and no kernels: y
    allocated forward, dx, dw1, dw2, dprobs backward. Its host time is what any custom op of
    this signature pays for Function.apply, the engine's backward and the allocations, before
    it launches anything: the floor under moekit's host time on the same machine."""

    @staticmethod
    def forward(ctx, x, offsets, w1, w2, probs):
        ctx.saved_inputs = (x, w1, w2, probs)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        x, w1, w2, p = ctx.saved_inputs
        return (
            torch.empty_like(x), None, torch.empty_like(w1), torch.empty_like(w2),
            torch.empty_like(p),
        )  # fmt: skip


class DensePeak:
    """The dense reference: TFLOP/s of ``torch.mm`` of two random n × n matrices.

    The clock drifts under sustained load, so a benchmark times it at the start and the end of
    its run, and may time it again among the contenders' rounds (:meth:`mm` is the callable) to
    compare them with the peak at the same clock."""

    def __init__(
        self,
        dtype: torch.dtype = torch.bfloat16,
        device="cuda",
        n: int = 8192,
        time_fn: Callable[[Callable], float] = bench_ms,
    ) -> None:
        self.n, self.time_fn = n, time_fn
        self.a = torch.randn(n, n, device=device, dtype=dtype)
        self.b = torch.randn(n, n, device=device, dtype=dtype)

    def mm(self) -> torch.Tensor:
        return torch.mm(self.a, self.b)

    def ms(self) -> float:
        return self.time_fn(self.mm)

    def tflops(self, ms: float | None = None) -> float:
        """TFLOP/s at ``ms`` per product, timing one now when ``ms`` is None."""
        return 2 * self.n**3 / (self.ms() if ms is None else ms) / 1e9


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------


def error_line(exc: BaseException, limit: int = 240) -> str:
    """The exception's type and first line, for progress lines and the JSON's error fields."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:limit]


def _nan_to_null(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _nan_to_null(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_nan_to_null(x) for x in v]
    return v


def write_json(path, data, nan_as_null: bool = False) -> None:
    """Write ``data`` as indented JSON, replacing ``path`` only once the file is complete (a
    benchmark rewrites it as results come in). ``nan_as_null``: NaN and inf become null, which
    strict JSON readers accept; otherwise they are written as Python's json writes them."""
    path = os.fspath(path)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_nan_to_null(data) if nan_as_null else data, f, indent=1)
    os.replace(tmp, path)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (raises ImportError without matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
