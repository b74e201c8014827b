"""The benchmark harness: routings, timers, the case loop, the table, the JSON and the PNG.

Each ``benchmark_<area>.py`` imports this as ``bc`` (which puts the checkout on sys.path), states
its contenders (name -> zero-argument callable) and calls :func:`parser`, :func:`run_cases`,
:func:`measure`, :func:`ratios`, :func:`finish`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.utils.benchmark
import triton.testing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
Row = dict[str, Any]


# --- Routings ---
def routing_counts(T: int, E: int, skewed: bool, gen: torch.Generator | None) -> torch.Tensor:
    """Rows per expert [E] int64 summing to T: uniform, or skewed (gamma shares from torch's
    global RNG, and one idle expert drawn from ``gen`` unless it is None)."""
    if not skewed:
        counts = torch.full((E,), T // E, dtype=torch.int64)
        counts[: T - int(counts.sum())] += 1
        return counts
    share = torch.distributions.Gamma(0.6, 1.0).sample((E,))
    if gen is not None:  # at least one idle expert
        share[torch.randint(E, (1,), generator=gen)] = 0.0
    counts = torch.floor(share / share.sum() * T).to(torch.int64)
    counts[torch.argmax(counts)] += T - int(counts.sum())
    return counts


def skewed_routing(T: int, E: int, draw: int) -> torch.Tensor:
    """Skewed routing number ``draw``, seeded by ``draw`` alone (the caller's RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(draw)
        return routing_counts(T, E, True, torch.Generator().manual_seed(draw))


def topk_routing(T: int, E: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts of random scores per token: ``indices [T, k]``, renormalised ``probs``."""
    probs, idx = torch.randn(T, E, device=device).softmax(-1).topk(k, dim=-1)
    return idx, probs / probs.sum(-1, keepdim=True)


# --- Timers ---
def repeat(fn: Callable, n: int) -> None:
    for _ in range(n):
        fn()


def bench_ms(fn: Callable, warmup: float = 25, rep: float = 100) -> float:
    """GPU ms per call: the median of ``triton.testing.do_bench`` (L2 flushed before each call)."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def host_ms(fn: Callable, calls: int = 3, warm: int = 1) -> float:
    """The CPU stand-in for :func:`bench_ms` (--smoke: checks the plumbing)."""
    repeat(fn, warm)
    return torch.utils.benchmark.Timer("fn()", globals={"fn": fn}).timeit(calls).median * 1e3


def eager_timer(cuda: bool, warmup: float = 25, rep: float = 100,
                unit: float = 1.0) -> Callable[[Callable], float]:  # fmt: skip
    """ms (× ``unit``) per call: :func:`bench_ms` on the GPU, :func:`host_ms` on the CPU."""
    return lambda fn: (bench_ms(fn, warmup=warmup, rep=rep) if cuda else host_ms(fn)) * unit


def event_ms(fn: Callable, calls: int, warmup: int = 0) -> list[float]:
    """GPU ms of each of ``calls`` calls between CUDA events (after ``warmup`` untimed calls)."""
    repeat(fn, warmup)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(calls)]  # fmt: skip
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def fixed_count_ms(fn: Callable, warmup: int = 10, calls: int = 50) -> float:
    """The median of :func:`event_ms`: a fixed count, for collectives (no L2 flush)."""
    return statistics.median(event_ms(fn, calls, warmup))


def mean_ms(fn: Callable, calls: int, cuda: bool, warmup: int = 0) -> float:
    """ms per call over ``calls`` back-to-back calls: CUDA events, or the host clock off CUDA."""
    return statistics.fmean(event_ms(fn, calls, warmup)) if cuda else host_ms(fn, calls, warmup)


def over_ranks(v: float, op: str = "MAX") -> float:
    """``v`` reduced over the ranks (MAX, SUM, or AVG as SUM / world size)."""
    t = torch.tensor([v], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "AVG" else getattr(dist.ReduceOp, op))
    return float(t) / (dist.get_world_size() if op == "AVG" else 1)


def copy_gb_per_s(device) -> float:
    """Device-to-device copy rate of a 1 GiB buffer: GB/s read + written (``bench_ms``)."""
    src = torch.empty(2**29, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / bench_ms(partial(dst.copy_, src), 5, 30) / 1e6


def capture(fn: Callable, calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of ``fn`` (warmed on a side stream), replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        repeat(fn, 3)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        repeat(fn, calls)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_us(fn: Callable, calls: int = 20, fixed_count: bool = False, replays: int = 10) -> float:
    """GPU µs per call replayed from a CUDA graph of ``calls`` calls (by ``bench_ms``, or
    ``replays`` replays by :func:`fixed_count_ms` for collectives)."""
    graph = capture(fn, calls)
    if fixed_count:
        return fixed_count_ms(graph.replay, warmup=3, calls=replays) * 1e3 / calls
    return bench_ms(graph.replay, warmup=10, rep=50) * 1e3 / calls


def cuda_profile(fn: Callable, calls=1, before: Callable | None = None, cpu=True, warm=True):
    """torch.profiler over ``calls`` calls of ``fn`` (each after ``before``), after a ``warm``
    call; ``cpu``: the host's activities too."""
    from torch.profiler import ProfilerActivity, profile

    repeat(fn, int(warm))
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cpu else [ProfilerActivity.CUDA]
    with profile(activities=acts) as prof:
        for _ in range(calls):
            if before is not None:
                before()
            fn()
        torch.cuda.synchronize()
    return prof


def count_launches(fn: Callable) -> int:
    """CUDA kernel launches (memset / memcpy included) of one call."""
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in cuda_profile(fn).events())


def kernel_times(fn: Callable) -> list[tuple[str, int, float]]:
    """(name, calls, summed GPU µs) of each kernel of one profiled call."""
    return [(e.key, e.count, e.device_time_total)
            for e in cuda_profile(fn, cpu=False).key_averages()]  # fmt: skip


def sleep_cycles_per_ms(cycles: int = 100_000_000) -> float:
    """Calibrate torch.cuda._sleep: cycles per ms of GPU time."""
    torch.cuda._sleep(1000)  # the first launch's cost stays out
    return cycles / event_ms(lambda: torch.cuda._sleep(cycles), 1)[0]


def _synchronized_ms(*fns: Callable) -> float:
    """Host + GPU ms of one call of each of ``fns`` (mean of 3): sizes the GPU sleep."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        for fn in fns:
            fn()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / 3 * 1e3


def _sleep_then(k: int, upper_ms: float, cycles_per_ms: float, scale: float = 1.0):
    """Enqueue a GPU sleep long enough for ``k`` calls, and an event that ends with it."""
    torch.cuda._sleep(int((10 + 2 * k * upper_ms) * scale * cycles_per_ms))
    slept = torch.cuda.Event()
    slept.record()
    return slept


def host_us_per_call(fn: Callable, n: int, cycles_per_ms: float | None, per_batch: int = 25,
                     passes: int = 2, fixed_count: bool = False) -> tuple[float, bool]:  # fmt: skip
    """(Host µs per call, covered): the median over batches of ``per_batch`` calls (under the
    launch queue depth), each behind a GPU sleep so the host never waits; covered: the GPU never
    went idle. ``fixed_count``: no retry, no early stop (collectives)."""
    repeat(fn, 5)  # warm: the caching allocator holds every block the loop needs
    if cycles_per_ms is None:  # CPU: everything runs on the host anyway
        return host_ms(fn, n, warm=0) * 1e3, True
    upper_ms = _synchronized_ms(fn)
    per_call_us, covered_all = [], True
    attempts = 1 if fixed_count else 2  # a second, longer sleep if the first ran out
    for _ in range(passes):
        done = 0
        while done < n:
            k = min(per_batch, n - done)
            for attempt in range(attempts):
                slept = _sleep_then(k, upper_ms, cycles_per_ms, 4**attempt)
                t0 = time.perf_counter()
                repeat(fn, k)
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


class PairedGap(NamedTuple):  # covered: False if a batch ran past its GPU sleep even on retries
    gap_us: float  # median over the pairs of (fn_a − fn_b)
    gaps_us: list[float]  # every pair's gap
    covered: bool
    b_us: float  # median of fn_b's own times


def paired_host_gaps_us(fn_a: Callable, fn_b: Callable, pairs: int, cycles_per_ms: float,
                        per_batch: int = 8, fixed_count: bool = False,
                        clocks=(time.perf_counter, time.process_time)) -> tuple:  # fmt: skip
    """Host µs of a call of ``fn_a`` minus one of ``fn_b``, one :class:`PairedGap` per clock: the
    median over ``pairs`` adjacent pairs behind a GPU sleep (a slow stretch of the host hits both
    alike). ``time.process_time``: the CPU time of every thread, none of the time off the CPU."""
    repeat(lambda: (fn_a(), fn_b()), 5)
    upper_ms = _synchronized_ms(fn_a, fn_b)
    n = len(clocks)
    gaps, b_times = [[] for _ in range(n)], [[] for _ in range(n)]
    done, misses, covered_all = 0, 0, True
    while done < pairs:
        k = min(per_batch, pairs - done)
        slept = _sleep_then(k + 1, upper_ms, cycles_per_ms)
        fn_a()  # untimed: the first calls after a synchronisation run slower (a cold host)
        fn_b()
        batch = []
        for i in range(k):  # adjacent pairs, the order within a pair alternating
            a_first = (done + i) % 2 == 0
            first, second = (fn_a, fn_b) if a_first else (fn_b, fn_a)
            t0 = [c() for c in clocks]
            first()
            t1 = [c() for c in clocks]
            second()
            batch.append((a_first, t0, t1, [c() for c in clocks]))
        covered = not slept.query()
        torch.cuda.synchronize()
        if not (covered or fixed_count or misses >= 3):
            misses += 1  # the host waited on the GPU in this batch: measure it again
            continue
        for a_first, t0, t1, t2 in batch:
            for j in range(n):
                one, two = (t1[j] - t0[j]) * 1e6, (t2[j] - t1[j]) * 1e6
                a_us, b_us = (one, two) if a_first else (two, one)
                gaps[j].append(a_us - b_us)
                b_times[j].append(b_us)
        done, covered_all = done + k, covered_all and covered
    return tuple(PairedGap(statistics.median(g), g, covered_all, statistics.median(b))
                 for g, b in zip(gaps, b_times))  # fmt: skip


class AutogradFloor(torch.autograd.Function):
    """One custom autograd op with the grouped MLP's signature and no kernels: the host floor
    (Function.apply, the engine's backward, allocations) under any such op."""

    @staticmethod
    def forward(ctx, x, offsets, w1, w2, probs):
        ctx.saved_inputs = (x, w1, w2, probs)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        x, w1, w2, p = map(torch.empty_like, ctx.saved_inputs)
        return x, None, w1, w2, p


class DensePeak:
    """The dense ceiling: torch.mm TFLOP/s at n³ (:meth:`mm` can join the contenders' rounds)."""

    def __init__(self, dtype=torch.bfloat16, device="cuda", n: int = 8192, time_fn=bench_ms):
        self.n, self.time_fn = n, time_fn
        self.a, self.b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        self.mm = partial(torch.mm, self.a, self.b)

    def tflops(self, ms: float | None = None) -> float:
        """TFLOP/s at ``ms`` per product, timing one now when ``ms`` is None."""
        return 2 * self.n**3 / (self.time_fn(self.mm) if ms is None else ms) / 1e9


def peak_mib(step: Callable, cuda: bool = True) -> float:
    """MiB allocated at the peak of one call above what was allocated before it."""
    if not cuda:
        return math.nan
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()  # its outputs are freed at once: the peak is already counted
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


# --- Cases, the table and the outputs ---
log = partial(print, flush=True)


def error_line(exc: BaseException, limit: int = 240) -> str:
    """The exception's type and first line, for progress lines and the JSON's error fields."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:limit]


def parser(doc: str, quick: str | None = None, smoke: bool = True) -> argparse.ArgumentParser:
    """The flags every script shares: --out, and --quick (help ``quick``) / --smoke."""
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    ap.add_argument("--out", default="bench_out", help="directory for the JSON and PNG")
    if quick:
        ap.add_argument("--quick", action="store_true", help=quick)
    if smoke:
        ap.add_argument("--smoke", action="store_true", help="tiny shapes, end to end (CPU too)")
    return ap


def pick(shapes, wanted: str | Sequence[str] | None) -> list:
    """Entries of ``shapes`` (a dict, or tuples led by a name) named in ``wanted`` (None: all)."""
    wanted = [wanted] if isinstance(wanted, str) else wanted or ()
    names = {n for w in wanted for n in w.split(",")}
    items = shapes.items() if isinstance(shapes, dict) else shapes
    return [s for s in items if not names or s[0] in names]


def device_name(cuda: bool) -> str:
    return torch.cuda.get_device_name() if cuda else "cpu"


def meta(cuda: bool, **extra) -> Row:
    """The run's device and torch version, with ``extra``."""
    return {"device": device_name(cuda), "torch": torch.__version__, **extra}


def release_memory() -> None:
    """Drop the cached blocks of the case that just ran (no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def per_shape(fn: Callable, shapes, *args, **kw) -> list[tuple[str, Callable]]:
    """:func:`run_cases`' cases: ``fn(name, spec, *args, **kw)`` per (name, spec) of ``shapes``."""
    items = shapes.items() if isinstance(shapes, dict) else shapes
    return [(name, partial(fn, name, spec, *args, **kw)) for name, spec in items]


def run_cases(cases: Iterable[tuple[str, Callable]], budget_s: float | None = None,
              after: Callable[[list[Row]], None] | None = None) -> tuple[list, list, dict]:  # fmt: skip
    """Run each case (name -> callable giving its row or rows): (rows, skipped past ``budget_s``,
    failed name -> error); ``after(rows)`` after every case (a run cut short keeps its rows)."""
    rows, skipped, failed, t_start = [], [], {}, time.time()
    for name, run in cases:
        if budget_s is not None and time.time() - t_start > budget_s:
            skipped.append(name)
            log(f"  {name}: skipped (past the {budget_s:.0f} s budget)")
            continue
        t0 = time.time()
        try:
            out = run()
            rows += out if isinstance(out, list) else [out]
            log(f"  {name}: {time.time() - t0:.1f} s")
        except Exception as exc:  # e.g. out of memory: one case must not lose the table
            failed[name] = error_line(exc)
            log(f"  {name} FAILED: {failed[name]}")
        release_memory()
        if after is not None:
            after(rows)
    return rows, skipped, failed


def table(rows: Sequence[Row], columns: Sequence, floatfmt: str = ".2f") -> str:
    """``tabulate`` of ``rows``: a column is a key, or (header, key or row -> value)."""
    from tabulate import tabulate

    cols = [(c, c) if isinstance(c, str) else c for c in columns]
    gets = [g if callable(g) else (lambda r, k=g: r.get(k)) for _, g in cols]
    body = [[_nan_to_null(get(r)) for get in gets] for r in rows]
    return tabulate(body, [h for h, _ in cols], floatfmt=floatfmt, missingval="-")


def _nan_to_null(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _nan_to_null(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_nan_to_null(x) for x in v]
    return v


def write_json(path, data) -> None:
    """``data`` as indented JSON (NaN and inf as null), replacing ``path`` only once complete."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(f"{path}.tmp", "w") as f:
        json.dump(_nan_to_null(data), f, indent=1)
    os.replace(f"{path}.tmp", path)


@dataclass
class Panel:
    """One axes of a figure. ``kind`` "bar": ``series`` name -> one value per ``labels`` entry;
    "line" / "scatter": name -> (xs, ys). ``hlines``: label -> y of a dashed reference."""

    series: dict[str, Any]
    ylabel: str
    labels: Sequence[str] = ()
    kind: str = "bar"
    title: str = ""
    xlabel: str = ""
    hlines: dict[str, float] = field(default_factory=dict)
    logx: bool = False
    logy: bool = False


def _draw(ax, p: Panel) -> None:
    if p.kind == "bar":
        width = 0.8 / max(1, len(p.series))
        for j, (name, vals) in enumerate(p.series.items()):
            xs = [i - 0.4 + (j + 0.5) * width for i in range(len(p.labels))]
            ax.bar(xs, [math.nan if v is None else v for v in vals], width, label=name)
        ax.set_xticks(range(len(p.labels)), p.labels, rotation=30, ha="right", fontsize=6)
    for name, (xs, ys) in p.series.items() if p.kind != "bar" else ():
        if p.kind == "line":
            ax.plot(xs, ys, marker="o", ms=3, lw=1.2, label=name)
        else:
            ax.scatter(xs, ys, s=12, label=name)
    for j, (name, y) in enumerate(p.hlines.items()):
        ax.axhline(y, color="k" if j == 0 else "gray", ls="--", lw=1, label=name)
    plotted = any(len(v if p.kind == "bar" else v[0]) for v in p.series.values())
    logs = {f"{a}scale": "log" for a, on in (("x", p.logx), ("y", p.logy)) if on and plotted}
    ax.set(ylabel=p.ylabel, xlabel=p.xlabel, title=p.title, **logs)  # no log axis of no points
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def write_png(path, panels: Sequence[Panel], title: str = "") -> None:
    """The panels side by side: a matplotlib Figure, no pyplot (no backend, nothing to close)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max([6.0] + [0.5 * len(p.labels) + 4 for p in panels]) * len(panels), 5))
    for ax, p in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        _draw(ax, p)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --- The generic loop: contenders × timers × rounds, ratios, and the run's outputs ---
def measure(fns: dict[str, Callable], timers: dict, rounds: int = 1, row: Row | None = None,
            keep: Callable = min, rotate: bool = False, warm: bool = False) -> Row:  # fmt: skip
    """Every contender under every timer (after one untimed call each with ``warm``), ``rounds``
    rounds taken in turns (the order rotating each round with ``rotate``): ``row[f"{c}_{t}"]`` =
    ``keep`` of the rounds' figures and, over several rounds, ``row[f"{c}_{t}_rounds"]``. A
    contender that raises gets NaN and ``row[f"{c}_error"]``; the others go on."""
    for fn in fns.values() if warm else ():
        fn()  # compile, tune, warm the allocator
    row = {} if row is None else row
    per = {(c, t): [] for c in fns for t in timers}
    names = list(fns)
    for r in range(rounds):
        k = r % len(names) if rotate else 0
        for c in names[k:] + names[:k]:
            for t, time_fn in timers.items():
                if f"{c}_error" in row:
                    break
                try:
                    per[c, t].append(time_fn(fns[c]))
                except Exception as exc:  # e.g. out of memory, a layout a baseline refuses
                    row[f"{c}_error"] = error_line(exc)
                    log(f"    {c} FAILED: {row[f'{c}_error']}")
    for (c, t), vals in per.items():
        row[f"{c}_{t}"] = keep(vals) if vals else math.nan
        if rounds > 1:
            row[f"{c}_{t}_rounds"] = vals
    return row


def ratios(row: Row, timer: str, pairs: dict[str, tuple[str, str]]) -> Row:
    """``row[name]`` = a's figure / b's for each ``name: (a, b)``: the median of the ratios
    within a round where both have every round's figure, else the ratio of the kept figures."""
    for name, (a, b) in pairs.items():
        ra, rb = row.get(f"{a}_{timer}_rounds"), row.get(f"{b}_{timer}_rounds")
        if ra and rb and len(ra) == len(rb):
            row[name] = statistics.median(x / y for x, y in zip(ra, rb))
        else:
            row[name] = row.get(f"{a}_{timer}", math.nan) / row.get(f"{b}_{timer}", math.nan)
    return row


def without_rounds(row: Row) -> Row:
    """``row`` less the per-round lists of :func:`measure`."""
    return {k: v for k, v in row.items() if not k.endswith("_rounds")}


def bars(rows: Sequence[Row], series: dict[str, str], ylabel: str, label: str = "shape",
         **kw) -> Panel:  # fmt: skip
    """A bar panel: one bar per ``series`` label (-> row key) for each row, named by ``label``."""
    return Panel({s: [r.get(k, math.nan) for r in rows] for s, k in series.items()}, ylabel,
                 [str(r[label]) for r in rows], **kw)  # fmt: skip


def finish(out: str, stem: str, data: dict, columns: Sequence, panels=(), title="",
           floatfmt: str = ".3g", rows_key: str = "rows") -> None:  # fmt: skip
    """Write ``<stem>.json`` and ``<stem>.png`` (a note if the plot fails); print the table."""
    write_json(os.path.join(out, f"{stem}.json"), data)
    try:
        if panels:
            write_png(os.path.join(out, f"{stem}.png"), panels, title)
    except Exception as exc:
        log(f"no {stem}.png: {error_line(exc)}")
    log(table(data[rows_key], columns, floatfmt))
    log(f"wrote {out}/{stem}.json")
