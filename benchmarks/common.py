"""The benchmark harness: routings, timers, the table, the JSON and the PNG.

Each ``benchmark_<area>.py`` states its cases and contenders (name -> zero-argument callable:
ours, the baselines, the ceiling), then calls :func:`parser`, :func:`run_cases`,
:func:`measure` (contenders × timers × rounds), :func:`ratios` and :func:`finish` (table,
``<stem>.json``, ``<stem>.png`` of :class:`Panel` s). Scripts import it as ``common``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.utils.benchmark
import triton.testing

Row = dict[str, Any]
Contenders = dict[str, Callable[[], Any]]


# --- Routings ---
def routing_counts(T: int, E: int, skewed: bool, gen: torch.Generator) -> torch.Tensor:
    """Rows per expert [E] int64 summing to T: uniform, or skewed (gamma shares from torch's
    global RNG, and one idle expert drawn from ``gen``)."""
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
    """Skewed routing number ``draw``, seeded by ``draw`` alone (the caller's RNG untouched), so
    a shape's routings do not depend on what ran before."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(draw)
        return routing_counts(T, E, True, torch.Generator().manual_seed(draw))


def topk_routing(T: int, E: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts of random scores per token: ``indices [T, k]``, renormalised ``probs``."""
    scores = torch.randn(T, E, device=device)
    probs, idx = scores.softmax(-1).topk(k, dim=-1)
    return idx, probs / probs.sum(-1, keepdim=True)


# --- Timers ---
def bench_ms(fn: Callable, warmup: float = 25, rep: float = 100) -> float:
    """GPU ms per call: the median of ``triton.testing.do_bench`` (L2 flushed before each call)."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def host_ms(fn: Callable, calls: int = 3, warm: int = 1) -> float:
    """The CPU stand-in for :func:`bench_ms` in --smoke runs: ``torch.utils.benchmark.Timer``
    over ``calls`` calls after ``warm`` untimed ones. It checks the plumbing, nothing more."""
    for _ in range(warm):
        fn()
    timer = torch.utils.benchmark.Timer(stmt="fn()", globals={"fn": fn})
    return timer.timeit(calls).median * 1e3


def eager_timer(cuda: bool, warmup: float = 25, rep: float = 100) -> Callable[[Callable], float]:
    """ms per call: :func:`bench_ms` on the GPU, :func:`host_ms` on the CPU."""
    return (lambda fn: bench_ms(fn, warmup=warmup, rep=rep)) if cuda else host_ms


def fixed_count_ms(fn: Callable, warmup: int = 10, calls: int = 50) -> float:
    """GPU ms per call: the median over ``calls`` calls between CUDA events. A fixed count, for
    calls that hold a collective (every rank must make as many). No L2 flush."""
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


def capture(fn: Callable, calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of ``fn`` (warmed on a side stream, as the PyTorch docs
    say), replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_us(fn: Callable, calls: int = 20, fixed_count: bool = False, replays: int = 10) -> float:
    """GPU µs per call of ``fn`` replayed from a CUDA graph of ``calls`` calls (replays timed by
    ``bench_ms``, or ``replays`` of them by :func:`fixed_count_ms` for calls that hold a
    collective)."""
    graph = capture(fn, calls)
    if fixed_count:
        return fixed_count_ms(graph.replay, warmup=3, calls=replays) * 1e3 / calls
    return bench_ms(graph.replay, warmup=10, rep=50) * 1e3 / calls


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


def host_us_per_call(
    fn: Callable,
    n: int,
    cycles_per_ms: float | None,
    per_batch: int = 25,
    passes: int = 2,
    fixed_count: bool = False,
) -> tuple[float, bool]:
    """Host µs per call: ``n`` calls in batches of ``per_batch``, each batch enqueued behind a
    GPU sleep (so the host never waits) and timed without synchronisation, ``passes`` times; the
    median over batches (an OS preemption shows as an outlier, not a shift). Batches stay under
    the GPU's launch-queue depth. ``covered`` is False when the GPU went idle inside a batch.
    ``fixed_count``: no retry and no early stop (same call count on every rank)."""
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
                slept = _sleep_then(k, upper_ms, cycles_per_ms, 4**attempt)
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
    b_us: float  # median of fn_b's own times


def _timed_pairs(fn_a, fn_b, k: int, first_index: int, clocks) -> list[tuple]:
    """``k`` adjacent pairs, the order within a pair alternating: (a_first, t0, t1, t2)."""
    batch = []
    for i in range(k):
        a_first = (first_index + i) % 2 == 0
        first, second = (fn_a, fn_b) if a_first else (fn_b, fn_a)
        t0 = [c() for c in clocks]
        first()
        t1 = [c() for c in clocks]
        second()
        batch.append((a_first, t0, t1, [c() for c in clocks]))
    return batch


def paired_host_gaps_us(
    fn_a: Callable,
    fn_b: Callable,
    pairs: int,
    cycles_per_ms: float,
    per_batch: int = 8,
    fixed_count: bool = False,
    clocks: Sequence[Callable[[], float]] = (time.perf_counter, time.process_time),
) -> tuple[PairedGap, ...]:
    """Host µs of one call of ``fn_a`` minus one of ``fn_b``, one :class:`PairedGap` per clock:
    the median over ``pairs`` adjacent pairs, each call timed alone behind a GPU sleep. A slow
    stretch of the host hits both calls of a pair alike. ``time.process_time`` counts the CPU
    time of every thread of the process and none of the time spent off the CPU."""
    for _ in range(5):
        fn_a()
        fn_b()
    upper_ms = _synchronized_ms(fn_a, fn_b)
    n = len(clocks)
    gaps: list[list[float]] = [[] for _ in range(n)]
    b_times: list[list[float]] = [[] for _ in range(n)]
    done, misses, covered_all = 0, 0, True
    while done < pairs:
        k = min(per_batch, pairs - done)
        slept = _sleep_then(k + 1, upper_ms, cycles_per_ms)
        fn_a()  # untimed: the first calls after a synchronisation run slower (a cold host)
        fn_b()
        batch = _timed_pairs(fn_a, fn_b, k, done, clocks)
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
        x, w1, w2, p = ctx.saved_inputs
        return (
            torch.empty_like(x), None, torch.empty_like(w1), torch.empty_like(w2),
            torch.empty_like(p),
        )  # fmt: skip


class DensePeak:
    """The dense ceiling: TFLOP/s of ``torch.mm`` of two random n × n matrices (:meth:`mm` can
    join the contenders' rounds, to compare at the same clock)."""

    def __init__(self, dtype=torch.bfloat16, device="cuda", n: int = 8192, time_fn=bench_ms):
        self.n, self.time_fn = n, time_fn
        self.a = torch.randn(n, n, device=device, dtype=dtype)
        self.b = torch.randn(n, n, device=device, dtype=dtype)

    def mm(self) -> torch.Tensor:
        return torch.mm(self.a, self.b)

    def tflops(self, ms: float | None = None) -> float:
        """TFLOP/s at ``ms`` per product, timing one now when ``ms`` is None."""
        return 2 * self.n**3 / (self.time_fn(self.mm) if ms is None else ms) / 1e9


def peak_mib(step: Callable, cuda: bool) -> float:
    """MiB allocated at the peak of one call above what was allocated before it."""
    if not cuda:
        return math.nan
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20


# --- Cases, the table and the outputs ---
def log(*args) -> None:
    print(*args, flush=True)


def error_line(exc: BaseException, limit: int = 240) -> str:
    """The exception's type and first line, for progress lines and the JSON's error fields."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:limit]


def parser(doc: str, quick: str | None = None, smoke: bool = True) -> argparse.ArgumentParser:
    """The flags every script shares: --out, and --quick (help ``quick``) / --smoke."""
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    ap.add_argument("--out", default="bench_out", help="directory for the JSON and PNG")
    if quick:
        ap.add_argument("--quick", action="store_true", help=quick)
    if smoke:
        ap.add_argument("--smoke", action="store_true", help="tiny shapes, end to end (CPU too)")
    return ap


def device_name(cuda: bool) -> str:
    return torch.cuda.get_device_name() if cuda else "cpu"


def release_memory() -> None:
    """Drop the cached blocks of the case that just ran (no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_cases(
    cases: Iterable[tuple[str, Callable[[], Row | list[Row]]]],
    budget_s: float | None = None,
    after: Callable[[list[Row]], None] | None = None,
) -> tuple[list[Row], list[str], dict[str, str]]:
    """Run each case (name -> callable giving its row or rows): (rows, skipped past
    ``budget_s`` from the first case's start, failed name -> error). ``after(rows)`` is called
    after every case (e.g. to rewrite the JSON): a run cut short keeps what it measured."""
    rows: list[Row] = []
    skipped: list[str] = []
    failed: dict[str, str] = {}
    t_start = time.time()
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


Column = str | tuple[str, str | Callable[[Row], Any]]


def table(rows: Sequence[Row], columns: Sequence[Column], floatfmt: str = ".2f") -> str:
    """``tabulate`` of ``rows``: a column is a key, or (header, key or row -> value)."""
    from tabulate import tabulate

    heads, cells = [], []
    for col in columns:
        head, get = (col, col) if isinstance(col, str) else col
        heads.append(head)
        cells.append(get if callable(get) else (lambda r, k=get: r.get(k)))
    body = [[_cell(get(r)) for get in cells] for r in rows]
    return tabulate(body, heads, floatfmt=floatfmt, missingval="-")


def _cell(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


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
    ax.set(ylabel=p.ylabel, xlabel=p.xlabel, title=p.title)
    plotted = any(len(v if p.kind == "bar" else v[0]) for v in p.series.values())
    if p.logx and plotted:  # a log axis of no points fails at savefig
        ax.set_xscale("log")
    if p.logy and plotted:
        ax.set_yscale("log")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def write_png(path, panels: Sequence[Panel], title: str = "") -> None:
    """The panels side by side, with matplotlib's file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = max([6.0] + [0.5 * len(p.labels) + 4 for p in panels])
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), 5), squeeze=False)
    for ax, p in zip(axes[0], panels):
        _draw(ax, p)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save(out: str, stem: str, data: dict, panels: Sequence[Panel] = (), title: str = "") -> None:
    """``<out>/<stem>.json`` (NaN as null) and, with ``panels``, ``<out>/<stem>.png`` (skipped
    with a note where matplotlib is missing or the plot fails: the JSON is what counts)."""
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, f"{stem}.json"), data)
    if not panels:
        return
    try:
        write_png(os.path.join(out, f"{stem}.png"), panels, title)
    except Exception as exc:
        log(f"no {stem}.png: {error_line(exc)}")


# --- The generic loop: contenders × timers × rounds, ratios, and the run's outputs ---
def measure(fns: Contenders, timers: dict[str, Callable], rounds: int = 1, row: Row | None = None,
            keep: Callable = min, rotate: bool = False) -> Row:  # fmt: skip
    """Every contender under every timer, ``rounds`` rounds taken in turns (the order rotating
    each round with ``rotate``): ``row[f"{c}_{t}"]`` = ``keep`` of the rounds' figures and, over
    several rounds, ``row[f"{c}_{t}_rounds"]``. A contender that raises gets NaN and
    ``row[f"{c}_error"]``; the others go on."""
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


def bars(rows: Sequence[Row], series: dict[str, str], ylabel: str, label: str = "shape",
         **kw) -> Panel:  # fmt: skip
    """A bar panel: one bar per ``series`` label (-> row key) for each row, named by ``label``."""
    return Panel({s: [r.get(k, math.nan) for r in rows] for s, k in series.items()}, ylabel,
                 [str(r[label]) for r in rows], **kw)  # fmt: skip


def finish(out: str, stem: str, data: dict, columns: Sequence[Column], panels=(), title="",
           floatfmt: str = ".3g", rows_key: str = "rows") -> None:  # fmt: skip
    """Write ``<stem>.json`` (+ ``.png`` of ``panels``) and print ``data[rows_key]``'s table."""
    save(out, stem, data, panels, title)
    log(table(data[rows_key], columns, floatfmt))
    log(f"wrote {out}/{stem}.json")
