"""Token permute / unpermute on one GPU: correctness check, then bandwidth against a plain copy.

    python benchmarks/benchmark_permute.py --out bench_out [--quick] [--rep-ms 5]
    python benchmarks/benchmark_permute.py --smoke --out /tmp/smoke   # tiny shapes, CPU or GPU

1. Correctness: bf16 at real shapes against the PyTorch reference (forward and gradients).
2. Copy bandwidth of this GPU in this run: a 1 GiB device-to-device copy, read + write bytes.
3. Routing metadata alone for T=65536, E=256, k=8 (target ≤ 30 µs).
4. For every (T, H, E, k, align) of the grid, forward and backward of permute and unpermute:
   - ours: the moekit op (permute forward includes its metadata launches);
   - torch: argsort + index_select / index_add_, with a separate pad / unpad pass when aligned;
   - sep-pad: moekit without align plus the same separate pad / unpad pass.
   GB/s counts the bytes that must move (permute: read T·H, write R·H; unpermute: read T·k·H
   rows, write T·H; backward likewise, plus the prob-gradient's extra read of T·k·H; plus the
   metadata), and "%copy" compares with step 2.

Two times per cell:
- eager (what a user sees, host overhead included): ``triton.testing.do_bench``, median; it
  flushes L2 before each call. Backward = median(forward + backward) − median(forward), where
  forward + backward runs the forward and then ``torch.autograd.grad`` in the same timed call.
- GPU: the summed durations of every CUDA kernel, memset and memcpy one call launches (metadata
  kernels included), from ``torch.profiler``; the median over ``GPU_CALLS`` profiled calls, each
  preceded by an L2 flush (a read of 256 MB by ``_l2_flush_kernel``, whose own duration is
  excluded and which separates the calls in the trace). Idle gaps between kernels do not count,
  so for small, host-bound cells this is far below the eager time. Backward = the kernels of
  ``torch.autograd.grad`` alone, on a forward done before the profiled region
  (``retain_graph=True``, so every profiled call runs the same backward).
The copy bandwidth, the metadata and every cell of ours and torch get both; sep-pad only the
eager time. Targets are evaluated on both times.
All random inputs are made before any timing, never inside a timed call. A cell that fails is
reported and skipped, never the whole table.
Writes permute_bench.json and permute_bench.png under --out; ``--budget-s`` bounds the grid's
wall time (configs past it are listed as skipped).

--smoke runs tiny shapes end to end to check the plumbing; without CUDA it runs on the CPU (the
kernels in Triton's interpreter under TRITON_INTERPRET=1, else the reference), times with
time.perf_counter and has no GPU times.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from common import bench_ms, error_line, host_ms, pyplot, save_figure, topk_routing, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from moekit.ops import permute, unpermute
from moekit.ops.routing import routing_metadata, routing_metadata_torch
from moekit.reference import permute as ref

DEVICE = "cuda"  # "cpu" for --smoke without a GPU (set in main)
GPU_CALLS = 10  # profiled calls per GPU time (median)
L2_FLUSH_BYTES = 256 * 2**20


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


def _cuda() -> bool:
    return DEVICE == "cuda"


def bench_us(fns: list, rep_ms: float) -> float:
    """Median µs per call of ``fns`` (cycled through), timed eagerly by triton's do_bench
    (on the CPU, --smoke: one perf_counter call, a plumbing check, not a measurement)."""
    it = itertools.cycle(fns)

    def fn():
        return next(it)()

    if not _cuda():
        return host_ms(fn, calls=1, warm=0) * 1e3
    for f in fns:  # whatever the calls allocate is reserved, then settles (settle_fresh_memory)
        f()
    torch.cuda.synchronize()
    time.sleep(SETTLE_CALL_S)
    return bench_ms(fn, warmup=max(5.0, rep_ms), rep=max(20.0, 4 * rep_ms)) * 1e3


SETTLE_S = 0.3  # wait after reserving fresh device memory (see settle_fresh_memory)
SETTLE_CALL_S = 0.05  # the same after each measurement's warm calls (longer than the slow window)


def settle_fresh_memory(nbytes: int) -> None:
    """Reserve ``nbytes`` of device memory through the caching allocator, free it back to the
    cache, and wait ``SETTLE_S`` before any timing.

    For a short while after a cudaMalloc of a few GB, every kernel on the GPU runs measurably
    slower, memory-bound copies most (the cause is not established: background work of the
    driver on new physical memory competing for DRAM bandwidth would fit). The grid empties the
    cache between configurations, so each configuration's first calls would allocate (and be
    timed) in that window; a training step reuses cached blocks and never is. A settled segment
    that the configuration's allocations are carved from, and a short wait after each
    measurement's warm calls (for what goes beyond the segment), keep every contender's timings
    to the steady state."""
    if not _cuda() or nbytes <= 0:
        return
    free, _ = torch.cuda.mem_get_info()
    nbytes = min(nbytes, int(free * 0.9))
    block = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    del block  # stays reserved in the allocator's cache, split for later allocations
    torch.cuda.synchronize()
    time.sleep(SETTLE_S)


@triton.jit
def _l2_flush_kernel(buf_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out[pid] = Σ buf[block pid]: reads the buffer (clean lines, nothing to write back)."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(buf_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + pid, tl.sum(x, axis=0))


FLUSH_MARKER = "_l2_flush_kernel"
_FLUSH_BLOCK = 4096
_flush_bufs: list[torch.Tensor] = []


def flush_l2() -> None:
    """Evict the inputs of the previous call from L2 by reading 256 MB (one marker kernel)."""
    if not _flush_bufs:
        n = L2_FLUSH_BYTES // 4
        buf = torch.ones(n, dtype=torch.int32, device=DEVICE)
        _flush_bufs[:] = [buf, torch.empty(triton.cdiv(n, _FLUSH_BLOCK), dtype=torch.int32,
                                           device=DEVICE)]  # fmt: skip
    buf, out = _flush_bufs
    _l2_flush_kernel[(out.numel(),)](buf, out, buf.numel(), BLOCK=_FLUSH_BLOCK, num_warps=8)


def per_call_us(events: list[tuple[str, float, float]], marker: str = FLUSH_MARKER) -> list[float]:
    """Split device activities ``(name, start µs, end µs)`` into calls: every call is preceded by
    one ``marker`` event; a call's time is the summed duration of the other events up to the next
    marker (the marker's own duration excluded; events before the first marker are ignored)."""
    calls: list[float] = []
    for name, start, end in sorted(events, key=lambda ev: ev[1]):
        if marker in name:
            calls.append(0.0)
        elif calls:
            calls[-1] += end - start
    return calls


def gpu_us(fns: list, n: int = GPU_CALLS) -> float | None:
    """Median over ``n`` calls (cycling through ``fns``) of the summed CUDA kernel / memset /
    memcpy durations of one call, from torch.profiler; None off CUDA."""
    if not _cuda():
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    it = itertools.cycle(fns)
    for _ in range(2):  # warm: compilation stays out of the profile
        next(it)()
    torch.cuda.synchronize()
    time.sleep(SETTLE_CALL_S)  # out of the slow window of what the warm calls allocated
    flush_l2()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            flush_l2()
            next(it)()
        torch.cuda.synchronize()
    events = [
        (evt.name, evt.time_range.start, evt.time_range.end)
        for evt in prof.events()
        if evt.device_type == DeviceType.CUDA and not evt.name.startswith("[")
    ]
    calls = per_call_us(events)
    if len(calls) != n:
        raise RuntimeError(f"profiler saw {len(calls)} flush markers for {n} calls")
    return statistics.median(calls)


def gpu_bwd_us(make_graph) -> float | None:
    """GPU µs of ``torch.autograd.grad`` alone: ``make_graph()`` runs a forward (not profiled)
    and returns ``(outputs, inputs, grad_outputs)``; the backward is profiled ``GPU_CALLS``
    times on that one graph (retain_graph=True)."""
    if not _cuda():
        return None
    outs, ins, grads = make_graph()
    return gpu_us([lambda: torch.autograd.grad(outs, ins, grads, retain_graph=True)])


def copy_bandwidth(rep_ms: float, nbytes: int = 2**30) -> tuple[float, float | None]:
    """GB/s (eager, GPU time) of a device-to-device copy of ``nbytes`` (read + write)."""
    src = torch.randn(nbytes // 2, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    if _cuda():
        torch.cuda.synchronize()
        time.sleep(SETTLE_S)  # out of the slow window after fresh allocations (settle_fresh_memory)
    fns = [lambda: dst.copy_(src)]
    us = bench_us(fns, rep_ms)
    g_us = gpu_us(fns)
    return 2 * nbytes / (us * 1e-6) / 1e9, (2 * nbytes / (g_us * 1e-6) / 1e9 if g_us else None)


# ------------------------------------------------------------------------------------------------
# Baselines
# ------------------------------------------------------------------------------------------------


def pad_rows(x: torch.Tensor, tokens_per_expert: torch.Tensor, align: int, num_rows: int):
    """The separate padding pass (sync-free): a zero-filled ``[num_rows, H]`` buffer with the
    packed rows copied to their padded positions. Returns (padded, dst [R_packed])."""
    tpe = tokens_per_expert.long()
    ends = torch.cumsum(tpe, 0)
    padded = (tpe + align - 1) // align * align
    shift = (torch.cumsum(padded, 0) - padded) - (ends - tpe)
    rows = torch.arange(x.shape[0], device=x.device)
    e = torch.searchsorted(ends, rows, right=True).clamp(max=tpe.numel() - 1)
    dst = rows + shift[e]
    return x.new_zeros((num_rows, x.shape[1])).index_copy(0, dst, x), dst


def torch_permute(hidden, indices, probs, E, align, num_rows):
    """argsort + index_select (+ pad pass). Returns (rows, row_probs, order, pad_dst)."""
    k = indices.shape[1]
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = hidden.index_select(0, order // k)
    row_probs = probs.reshape(-1).index_select(0, order)
    if align is None:
        return rows, row_probs, order, None
    tpe = torch.zeros(E, dtype=torch.long, device=flat.device)
    tpe.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.long))
    rows, dst = pad_rows(rows, tpe, align, num_rows)
    row_probs = row_probs.new_zeros(num_rows).index_copy(0, dst, row_probs)
    return rows, row_probs, order, dst


def torch_unpermute(rows, row_probs, order, pad_dst, T, k):
    """(unpad pass +) index_add_ of the weighted rows."""
    if pad_dst is not None:
        rows = rows.index_select(0, pad_dst)
        row_probs = row_probs.index_select(0, pad_dst)
    weighted = rows * row_probs.to(rows.dtype)[:, None]
    out = rows.new_zeros((T, rows.shape[1]))
    return out.index_add(0, order // k, weighted)


# ------------------------------------------------------------------------------------------------
# Correctness
# ------------------------------------------------------------------------------------------------


CHECK_SHAPES = [(4096, 2048, 64, 8, 16), (16384, 7168, 256, 8, 128), (65536, 2048, 8, 2, None)]
SMOKE_CHECK_SHAPES = [(24, 48, 8, 2, 16), (16, 32, 4, 3, None)]


def check_correctness(shapes=CHECK_SHAPES) -> list[str]:
    """bf16 forward and gradients against the reference; returns the failures."""
    failures = []
    for T, H, E, k, align in shapes:
        name = f"T={T} H={H} E={E} k={k} align={align}"
        try:
            idx, probs = topk_routing(T, E, k, DEVICE)
            hidden = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
            probs.requires_grad_(True)
            d = permute(hidden, idx, probs, num_experts=E, align=align)
            meta = routing_metadata_torch(idx, E, align or 1)
            ph, pp = ref.scatter_rows_torch(hidden.detach(), meta[0], d.num_rows, probs.detach())
            got = (d.row_index, d.tokens_per_expert, d.counts, d.offsets, d.hidden, d.probs)
            for label, g, w in zip(
                ("row_index", "tpe", "counts", "offsets", "rows", "probs"), got, (*meta, ph, pp)
            ):
                if not torch.equal(g, w):
                    raise AssertionError(f"permute {label} differs")
            eo = torch.randn_like(d.hidden, requires_grad=True)
            y = unpermute(eo, d)
            gy = torch.randn_like(y)
            gp, geo = torch.autograd.grad(y, (probs, eo), gy)
            eo32 = eo.detach().float().requires_grad_(True)
            p32 = probs.detach().clone().requires_grad_(True)
            _, pp32 = ref.scatter_rows_torch(hidden.detach().float(), meta[0], d.num_rows, p32)
            y_ref = ref.gather_rows_torch(eo32, meta[0], pp32)
            gp_ref, geo_ref = torch.autograd.grad(y_ref, (p32, eo32), gy.float())
            torch.testing.assert_close(y.float(), y_ref, rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(gp.float(), gp_ref, rtol=2e-2, atol=5e-2)
            torch.testing.assert_close(geo.float(), geo_ref, rtol=1e-2, atol=1e-2)
            (gh,) = torch.autograd.grad(unpermute(d.hidden, d, weighted=False), (hidden,), gy)
            torch.testing.assert_close(gh.float(), k * gy.float(), rtol=2e-2, atol=5e-2)
            print(f"  ok    {name}")
        except Exception as exc:  # report every failing shape, then keep benchmarking
            failures.append(f"{name}: {exc}")
            print(f"  FAIL  {name}: {exc}")
    return failures


# ------------------------------------------------------------------------------------------------
# Grid
# ------------------------------------------------------------------------------------------------


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def measure_config(T, H, E, k, align, rep_ms, dtype=torch.bfloat16):
    """Eager µs and GPU µs of every (op, pass, impl) for one shape, the bytes each pass must
    move, R, and the errors of the cells that failed (their µs are missing)."""
    b = torch.empty((), dtype=dtype).element_size()
    tk = T * k
    R = tk + (min(E, tk) * (align - 1) if align else 0)
    # The configuration's tensors (inputs, outputs, gradients, the baselines' buffers) are
    # carved from one settled segment of five [R, H] and six [T, H] buffers. Ours are timed
    # first; later passes may go beyond the segment at the largest shapes (the grid prints the
    # peak reserved memory), which the short wait after each measurement's warm calls covers.
    settle_fresh_memory((5 * R + 6 * T) * H * b + (64 << 20))
    # One input set, made before any timing (both timers flush L2 before every call).
    idx, probs = topk_routing(T, E, k, DEVICE)
    hidden = torch.randn(T, H, device=DEVICE, dtype=dtype, requires_grad=True)
    sets = [(idx, probs.requires_grad_(True), hidden)]
    meta = tk * (8 + 4 + 4 + 4) + R * 4  # indices, row_index, probs in/out
    bytes_ = {
        ("permute", "fwd"): (T + R) * H * b + meta,
        ("permute", "bwd"): (tk + T) * H * b + meta,
        ("unpermute", "fwd"): (tk + T) * H * b + meta,
        ("unpermute", "bwd"): (T + tk + R) * H * b + meta,
    }
    res, gres, errors = {}, {}, {}

    def attempt(key, what):
        try:
            return what()
        except Exception as exc:  # one failing cell must not lose the table
            errors[key] = error_line(exc)
            print(f"    FAIL {key}: {errors[key]}", flush=True)
            with contextlib.suppress(Exception):
                if _cuda():
                    torch.cuda.synchronize()
            return None

    def cell(key, fns, gpu):
        us = attempt(key, lambda: bench_us(fns, rep_ms))
        if us is not None:
            res[key] = us
        if gpu and _cuda():
            g = attempt(("gpu", *key), lambda: gpu_us(fns))
            if g is not None:
                gres[key] = g

    def gpu_bwd_cell(key, make_graph):
        if _cuda():
            g = attempt(("gpu", *key), lambda: gpu_bwd_us(make_graph))
            if g is not None:
                gres[key] = g

    def bwd_of(op, label):
        both, fwd = res.get((op, "fwdbwd", label)), res.get((op, "fwd", label))
        if both is not None and fwd is not None:
            res[(op, "bwd", label)] = max(both - fwd, 1e-3)

    def run(label, make_permute, make_unpermute, gpu=True):
        """make_permute(set) -> state dict with "rows" [R, H] and "probs" [R];
        make_unpermute(state, expert_out) -> y [T, H]. Eager backward = (fwd + bwd) − fwd;
        GPU backward = autograd.grad alone."""
        cell(("permute", "fwd", label), [lambda s=s: make_permute(s) for s in sets], gpu)
        try:
            states = [make_permute(s) for s in sets]
        except Exception as exc:
            errors[("permute", "state", label)] = error_line(exc)
            print(f"    FAIL {label} permute: {error_line(exc)}", flush=True)
            return
        grads = [(torch.randn_like(st["rows"]), torch.randn_like(st["probs"])) for st in states]

        def p_fwdbwd(s, g):
            st = make_permute(s)
            return torch.autograd.grad((st["rows"], st["probs"]), (s[2], s[1]), g)

        cell(
            ("permute", "fwdbwd", label),
            [lambda s=s, g=g: p_fwdbwd(s, g) for s, g in zip(sets, grads)],
            gpu=False,
        )
        bwd_of("permute", label)
        if gpu:

            def p_graph(g=grads[0]):
                st = make_permute(sets[0])
                return (st["rows"], st["probs"]), (sets[0][2], sets[0][1]), g

            gpu_bwd_cell(("permute", "bwd", label), p_graph)
        del grads
        # Unpermute on detached permute outputs: expert_out and the row probs are the leaves.
        states = [{**st, "probs": _leaf(st["probs"])} for st in states]
        eouts = [_leaf(torch.randn_like(st["rows"])) for st in states]
        for st in states:
            del st["rows"]  # only the leaves above are needed from here on
        cell(
            ("unpermute", "fwd", label),
            [lambda st=st, eo=eo: make_unpermute(st, eo) for st, eo in zip(states, eouts)],
            gpu,
        )
        gys = [torch.randn(T, H, device=DEVICE, dtype=dtype) for _ in states]

        def u_fwdbwd(st, eo, gy):
            y = make_unpermute(st, eo)
            return torch.autograd.grad(y, (eo, st["probs"]), gy)

        cell(
            ("unpermute", "fwdbwd", label),
            [
                lambda st=st, eo=eo, gy=gy: u_fwdbwd(st, eo, gy)
                for st, eo, gy in zip(states, eouts, gys)
            ],
            gpu=False,
        )
        bwd_of("unpermute", label)
        if gpu:

            def u_graph():
                st, eo = states[0], eouts[0]
                return (make_unpermute(st, eo),), (eo, st["probs"]), (gys[0],)

            gpu_bwd_cell(("unpermute", "bwd", label), u_graph)

    def ours_p(s, a=align):
        d = permute(s[2], s[0], s[1], num_experts=E, align=a)
        return {"rows": d.hidden, "probs": d.probs, "d": d}

    def ours_u(st, eo):
        return unpermute(eo, dataclasses.replace(st["d"], probs=st["probs"]))

    run("ours", ours_p, ours_u)

    def torch_p(s):
        rows, rp, order, dst = torch_permute(s[2], s[0], s[1], E, align, R)
        return {"rows": rows, "probs": rp, "order": order, "dst": dst}

    run(
        "torch",
        torch_p,
        lambda st, eo: torch_unpermute(eo, st["probs"], st["order"], st["dst"], T, k),
    )
    if align:

        def sep_p(s):
            d = permute(s[2], s[0], s[1], num_experts=E)
            rows, dst = pad_rows(d.hidden, d.tokens_per_expert, align, R)
            probs = d.probs.new_zeros(R).index_copy(0, dst, d.probs)
            return {"rows": rows, "probs": probs, "d": d, "dst": dst}

        def sep_u(st, eo):
            packed = eo.index_select(0, st["dst"])
            # Unpad the probs too, so their gradient also crosses the separate pass.
            d2 = dataclasses.replace(st["d"], probs=st["probs"].index_select(0, st["dst"]))
            return unpermute(packed, d2)

        run("sep-pad", sep_p, sep_u, gpu=False)
    return res, gres, bytes_, R, errors


META_SHAPE = (65536, 256, 8)  # T, E, k of the metadata target
SMOKE_META_SHAPE = (64, 8, 2)


def time_metadata(rep_ms: float, T=65536, E=256, k=8) -> tuple[dict, dict]:
    """Eager µs and GPU µs of the routing metadata alone (align 1 and 128)."""
    out, gout = {}, {}
    idx, _ = topk_routing(T, E, k, DEVICE)
    for a in (1, 128):
        fns = [lambda a=a: routing_metadata(idx, E, a)]
        try:
            out[f"all_align{a}"] = bench_us(fns, rep_ms)
            gout[f"all_align{a}"] = gpu_us(fns)
        except Exception as exc:
            print(f"  metadata align={a} FAILED: {error_line(exc)}", flush=True)
    return out, gout


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def print_table(rows):
    print(
        f"{'T':>6} {'H':>5} {'E':>4} {'k':>2} {'align':>5} {'op':>9} {'pass':>4} "
        f"{'ours µs':>8} {'GPU µs':>8} {'GB/s':>5} {'GB/s(GPU)':>9} {'%copy':>5} "
        f"{'%copy(GPU)':>10} {'torch µs':>8} {'×torch':>6} {'×torch(GPU)':>11} "
        f"{'sep-pad µs':>10} {'pad ovh%':>8} {'pad ovh%(GPU)':>13}"
    )
    for r in rows:
        print(
            f"{r['T']:>6} {r['H']:>5} {r['E']:>4} {r['k']:>2} {r['align'] or '-':>5} "
            f"{r['op']:>9} {r['pass']:>4} {_fmt(r['ours_us'], '.1f'):>8} "
            f"{_fmt(r['gpu_us'], '.1f'):>8} {_fmt(r['gbs'], '.0f'):>5} "
            f"{_fmt(r['gbs_gpu'], '.0f'):>9} {_fmt(r['pct_copy'], '.0f'):>4}% "
            f"{_fmt(r['pct_copy_gpu'], '.0f'):>9}% {_fmt(r['torch_us'], '.1f'):>8} "
            f"{_fmt(r['speedup'], '.1f'):>5}× {_fmt(r['speedup_gpu'], '.1f'):>10}× "
            f"{_fmt(r['sep_pad_us'], '.1f'):>10} {_fmt(r['pad_overhead_pct'], '+.1f'):>8} "
            f"{_fmt(r['pad_overhead_pct_gpu'], '+.1f'):>13}"
        )
    print(
        "  ours µs / torch µs / sep-pad µs: eager triton do_bench median (bwd = fwd+bwd − fwd);\n"
        "  GPU µs: summed kernel durations of one call (torch.profiler, median of "
        f"{GPU_CALLS}; bwd = autograd.grad alone)"
    )


def _ratio(a, b):
    return a / b if a and b else None


def make_rows(T, H, E, k, align, R, res, gres, bytes_, copy_gbs, copy_gbs_gpu, no_align):
    """Table rows (one per op and pass) of one config; ``no_align`` collects the unaligned
    (eager, GPU) µs of ours to compute the padding overhead of the aligned configs."""
    rows = []
    for op, ps in itertools.product(("permute", "unpermute"), ("fwd", "bwd")):
        ours, ours_g = res.get((op, ps, "ours")), gres.get((op, ps, "ours"))
        base, base_g = res.get((op, ps, "torch")), gres.get((op, ps, "torch"))
        nbytes = bytes_[(op, ps)]
        gbs = nbytes / (ours * 1e-6) / 1e9 if ours else None
        gbs_g = nbytes / (ours_g * 1e-6) / 1e9 if ours_g else None
        key = (T, H, E, k, op, ps)
        if align is None:
            no_align[key] = (ours, ours_g, nbytes)
        ref_e, ref_g, ref_bytes = no_align.get(key, (None, None, None)) if align else (None,) * 3
        rows.append(
            {
                "T": T,
                "H": H,
                "E": E,
                "k": k,
                "align": align,
                "R": R,
                "op": op,
                "pass": ps,
                "bytes": nbytes,
                "ours_us": ours,
                "gbs": gbs,
                "pct_copy": 100 * gbs / copy_gbs if gbs and copy_gbs else None,
                "gpu_us": ours_g,
                "gbs_gpu": gbs_g,
                "pct_copy_gpu": 100 * gbs_g / copy_gbs_gpu if gbs_g and copy_gbs_gpu else None,
                "torch_us": base,
                "torch_gpu_us": base_g,
                "speedup": _ratio(base, ours),
                "speedup_gpu": _ratio(base_g, ours_g),
                "sep_pad_us": res.get((op, ps, "sep-pad")),
                "pad_overhead_pct": (ours / ref_e - 1) * 100 if ours and ref_e else None,
                "pad_overhead_pct_gpu": (ours_g / ref_g - 1) * 100 if ours_g and ref_g else None,
                # Beyond what the padding rows' own bytes cost at the unpadded rate: GPU time per
                # byte that must move, padded over unpadded (the target's bound where padding
                # adds more than 5% of the rows, which must be written as zeros).
                "pad_excess_pct_gpu": (
                    ((ours_g / nbytes) / (ref_g / ref_bytes) - 1) * 100
                    if ours_g and ref_g
                    else None
                ),
            }
        )
    return rows


TARGET_PCT_COPY = 80.0
TARGET_SPEEDUP = 3.0
TARGET_PAD_PCT = 5.0
TARGET_META_US = 30.0


def summarize(rows, copy, meta_us, meta_gpu, big_rule) -> dict:
    """Figures and target verdicts, on GPU time and on eager time."""

    def vals(key, sel):
        return [r[key] for r in sel if r[key] is not None]

    big = [r for r in rows if big_rule(r)]
    out = {"copy_gbs": copy[0], "copy_gbs_gpu": copy[1]}
    targets = {}
    for tag, sfx, meta in (("gpu", "_gpu", meta_gpu), ("eager", "", meta_us)):
        fig = {
            f"min_pct_copy_big{sfx}": min(vals(f"pct_copy{sfx}", big), default=None),
            f"min_speedup{sfx}": min(vals(f"speedup{sfx}", rows), default=None),
            f"max_pad_overhead_pct{sfx}": max(vals(f"pad_overhead_pct{sfx}", rows), default=None),
            f"max_pad_overhead_pct_big{sfx}": max(
                vals(f"pad_overhead_pct{sfx}", big), default=None
            ),
            f"pad_cells_within_5pct{sfx}": (
                sum(v <= TARGET_PAD_PCT for v in vals(f"pad_overhead_pct{sfx}", rows)),
                len(vals(f"pad_overhead_pct{sfx}", rows)),
            ),
            f"metadata{sfx}_us": meta.get("all_align1"),
            f"metadata_align128{sfx}_us": meta.get("all_align128"),
        }
        out.update(fig)

        def ok(v, good):
            return None if v is None else bool(good(v))

        targets[tag] = {
            "pct_copy_big >= 80": ok(fig[f"min_pct_copy_big{sfx}"], lambda v: v >= TARGET_PCT_COPY),
            "speedup >= 3": ok(fig[f"min_speedup{sfx}"], lambda v: v >= TARGET_SPEEDUP),
            "pad_overhead <= 5%": ok(
                fig[f"max_pad_overhead_pct{sfx}"], lambda v: v <= TARGET_PAD_PCT
            ),
            "pad_overhead_big <= 5%": ok(
                fig[f"max_pad_overhead_pct_big{sfx}"], lambda v: v <= TARGET_PAD_PCT
            ),
            "metadata <= 30 us": ok(fig[f"metadata{sfx}_us"], lambda v: v <= TARGET_META_US),
        }
    excess = vals("pad_excess_pct_gpu", rows)
    out["max_pad_excess_pct_gpu"] = max(excess, default=None)
    out["pad_cells_excess_within_5pct_gpu"] = (
        sum(v <= TARGET_PAD_PCT for v in excess),
        len(excess),
    )
    out["pct_copy_big_cells_gpu"] = (
        sum(v >= TARGET_PCT_COPY for v in vals("pct_copy_gpu", big)),
        len(vals("pct_copy_gpu", big)),
    )
    out["targets"] = targets
    return out


def main(argv=None) -> int:
    global DEVICE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out", help="directory for JSON and PNG")
    ap.add_argument("--quick", action="store_true", help="a reduced grid (a few shapes)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, end to end (CPU or GPU)")
    ap.add_argument("--rep-ms", type=float, default=5.0, help="GPU time per measurement")
    ap.add_argument("--skip-check", action="store_true", help="skip the correctness pass")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-time budget (default 100 quick, 300 full)",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        if not args.smoke:
            print("needs a CUDA GPU (or --smoke)", file=sys.stderr)
            return 2
        DEVICE = "cpu"
    else:
        DEVICE = "cuda"
    budget = args.budget_s or (100.0 if args.quick or args.smoke else 300.0)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    t_start = time.time()
    dev_name = torch.cuda.get_device_name() if _cuda() else "cpu"
    print(f"device: {dev_name}  torch {torch.__version__}", flush=True)

    failures = []
    if not args.skip_check:
        print("correctness (bf16 vs reference):", flush=True)
        failures = check_correctness(SMOKE_CHECK_SHAPES if args.smoke else CHECK_SHAPES)

    copy = (None, None)
    try:
        copy = copy_bandwidth(args.rep_ms, 2**22 if args.smoke else 2**30)
        print(
            f"copy bandwidth: {copy[0]:.0f} GB/s eager, {_fmt(copy[1], '.0f')} GB/s GPU time "
            "(device-to-device, read + write)"
        )
    except Exception as exc:
        print(f"copy bandwidth FAILED: {error_line(exc)}")
    if _cuda():
        torch.cuda.empty_cache()

    mT, mE, mk = SMOKE_META_SHAPE if args.smoke else META_SHAPE
    meta_us, meta_gpu = time_metadata(args.rep_ms, mT, mE, mk)

    def meta_desc(d):
        return (
            f"{_fmt(d.get('all_align1'), '.1f')} µs (align 128: "
            f"{_fmt(d.get('all_align128'), '.1f')} µs)"
        )

    meta_line = (
        f"metadata T={mT} E={mE} k={mk}: GPU {meta_desc(meta_gpu)}; eager {meta_desc(meta_us)};"
        " target ≤ 30 µs"
    )
    print(meta_line, flush=True)

    if args.smoke:
        grid = list(itertools.product([16], [32], [(4, 2)], [None, 16]))
    elif args.quick:
        grid = list(itertools.product([16384], [4096], [(8, 2), (256, 8)], [None, 128]))
    else:
        grid = list(
            itertools.product(
                [4096, 16384, 65536],
                [2048, 4096, 7168],
                [(8, 2), (64, 8), (128, 8), (256, 8)],
                [None, 16, 128],
            )
        )
    rows, cell_errors, skipped = [], {}, []
    no_align = {}
    for i, (T, H, (E, k), align) in enumerate(grid):
        name = f"T={T} H={H} E={E} k={k} align={align}"
        if time.time() - t_start > budget:
            skipped.append(name)
            continue
        t0 = time.time()
        if _cuda():
            torch.cuda.reset_peak_memory_stats()
        try:
            res, gres, bytes_, R, errors = measure_config(T, H, E, k, align, args.rep_ms)
        except Exception as exc:  # e.g. out of memory while building the inputs
            cell_errors[name] = {"config": error_line(exc)}
            print(f"  [{i + 1}/{len(grid)}] {name}: FAILED {error_line(exc)}", flush=True)
            if _cuda():
                torch.cuda.empty_cache()
            continue
        if errors:
            cell_errors[name] = {"/".join(key): msg for key, msg in errors.items()}
        rows += make_rows(T, H, E, k, align, R, res, gres, bytes_, copy[0], copy[1], no_align)
        peak = (
            f", peak reserved {torch.cuda.max_memory_reserved() / 2**30:.1f} GiB" if _cuda() else ""
        )
        print(f"  [{i + 1}/{len(grid)}] {name}: {time.time() - t0:.1f} s{peak}", flush=True)
        del res, gres
        if _cuda():
            torch.cuda.empty_cache()

    def big_rule(r):
        return r["T"] * r["k"] >= 32768 and r["H"] >= 2048

    summary = summarize(rows, copy, meta_us, meta_gpu, big_rule)
    summary.update(
        {
            "correctness_failures": failures,
            "failed_cells": cell_errors,
            "skipped_configs": skipped,
            "timing": {
                "eager": "triton.testing.do_bench median (bwd = fwd+bwd - fwd)",
                "gpu": f"summed CUDA kernel/memset/memcpy durations of one call, torch.profiler,"
                f" median of {GPU_CALLS} (bwd = autograd.grad alone)",
            },
            "seconds": time.time() - t_start,
        }
    )
    print()
    print_table(rows)
    print(meta_line)
    if skipped:
        print(f"skipped {len(skipped)} configs past the {budget:.0f} s budget (--budget-s)")
    print("\nsummary (targets: ≥80% copy BW where T·k ≥ 32K and H ≥ 2048; ≥3× torch;")
    print("         padding ≤ 5% over no padding; metadata ≤ 30 µs)")
    for key, val in summary.items():
        if key == "targets":
            continue
        print(f"  {key}: {val if not isinstance(val, float) else round(val, 2)}")
    for tag, verdicts in summary["targets"].items():
        line = ", ".join(
            f"{name} {'-' if v is None else ('PASS' if v else 'FAIL')}"
            for name, v in verdicts.items()
        )
        print(f"  targets on {tag} time: {line}")
    write_json(
        out_dir / "permute_bench.json", {"device": dev_name, "summary": summary, "rows": rows}
    )
    try:
        plot(rows, copy, out_dir / "permute_bench.png")
        print(f"wrote {out_dir / 'permute_bench.json'} and {out_dir / 'permute_bench.png'}")
    except Exception as exc:
        print(f"wrote {out_dir / 'permute_bench.json'}; plot FAILED: {error_line(exc)}")
    return 1 if failures or cell_errors else 0


def plot(rows, copy, path):
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(20, 5))
    series = sorted({(r["op"], r["pass"]) for r in rows})
    panels = (
        (axes[0], "pct_copy", f"% of copy BW, eager ({_fmt(copy[0], '.0f')} GB/s)"),
        (axes[1], "pct_copy_gpu", f"% of copy BW, GPU time ({_fmt(copy[1], '.0f')} GB/s)"),
    )
    for op, ps in series:
        sel = [r for r in rows if (r["op"], r["pass"]) == (op, ps)]
        for ax, key, _ in panels:
            pts = [(r["T"] * r["k"] * r["H"], r[key]) for r in sel if r[key]]
            if pts:
                ax.scatter(*zip(*pts), s=12, label=f"{op} {ps}")
        key = "speedup_gpu" if any(r["speedup_gpu"] for r in sel) else "speedup"
        pts = [(r["T"] * r["k"] * r["H"], r[key]) for r in sel if r[key]]
        if pts:
            axes[2].scatter(*zip(*pts), s=12, label=f"{op} {ps} ({key})")
    for ax, _, label in panels:
        ax.axhline(TARGET_PCT_COPY, color="gray", ls="--", lw=1)
        ax.set(xscale="log", xlabel="T·k·H", ylabel=label)
    axes[2].axhline(TARGET_SPEEDUP, color="gray", ls="--", lw=1)
    axes[2].set(xscale="log", yscale="log", xlabel="T·k·H", ylabel="speed-up over torch-composed")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("moekit permute / unpermute (bf16)")
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
