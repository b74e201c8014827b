"""Token permute / unpermute: correctness, then bandwidth against a plain copy.

    python benchmarks/benchmark_permute.py --out bench_out [--quick] [--budget-s 500] [--smoke]

Checks bf16 results against the reference, then times fwd and bwd per (T, H, E, k, align) of
ours, torch (argsort + index_select / index_add_, + a pad pass when aligned), sep-pad (unaligned
moekit + that pad pass), and the routing metadata. Eager: do_bench (bwd = fwd+bwd − fwd); GPU:
summed profiler durations after an L2 flush, median of GPU_CALLS. Ceiling: a device copy.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import sys
import time
from functools import partial
from operator import itemgetter

import common as bc
import torch
import triton
import triton.language as tl

from moekit.ops import permute, unpermute
from moekit.ops.routing import routing_metadata, routing_metadata_torch
from moekit.reference import permute as ref

DEVICE = "cuda"  # "cpu" for --smoke without a GPU (set in main)
GPU_CALLS = 10  # profiled calls per GPU time (median)
REP_MS = 5.0  # do_bench: warm-up ms, and 4× this of timed calls
SETTLE_S = 0.3  # wait after reserving fresh device memory (see settle_fresh_memory)
SETTLE_CALL_S = 0.05  # the same after each measurement's warm calls (longer than the slow window)
FLUSH_MARKER = "_l2_flush_kernel"
_flush_bufs: list[torch.Tensor] = []


def bench_us(fn) -> float:
    """Eager µs per call: triton's do_bench median (on the CPU, --smoke: one host call)."""
    if DEVICE != "cuda":
        return bc.host_ms(fn, calls=1, warm=0) * 1e3
    fn()  # whatever the call allocates is reserved, then settles (settle_fresh_memory)
    torch.cuda.synchronize()
    time.sleep(SETTLE_CALL_S)
    return bc.bench_ms(fn, warmup=REP_MS, rep=4 * REP_MS) * 1e3


def settle_fresh_memory(nbytes: int) -> None:
    """Reserve ``nbytes`` in the caching allocator and wait: for a short while after a cudaMalloc
    of a few GB every kernel runs slower; the config's allocations are carved from this segment."""
    if DEVICE != "cuda" or nbytes <= 0:
        return
    free = int(torch.cuda.mem_get_info()[0] * 0.9)
    torch.empty(min(nbytes, free), dtype=torch.uint8, device=DEVICE)  # freed: stays reserved
    torch.cuda.synchronize()
    time.sleep(SETTLE_S)


@triton.jit
def _l2_flush_kernel(buf_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out[pid] = Σ buf[block pid]: reads the buffer (clean lines, nothing to write back)."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + pid, tl.sum(tl.load(buf_ptr + offs, mask=offs < n, other=0), axis=0))


def flush_l2() -> None:
    """Evict the inputs of the previous call from L2 by reading 256 MB (one marker kernel)."""
    if not _flush_bufs:
        n = 64 * 2**20
        _flush_bufs[:] = [torch.ones(n, dtype=torch.int32, device=DEVICE),
                          torch.empty(n // 4096, dtype=torch.int32, device=DEVICE)]  # fmt: skip
    buf, out = _flush_bufs
    _l2_flush_kernel[(out.numel(),)](buf, out, buf.numel(), BLOCK=4096, num_warps=8)


def per_call_us(events: list[tuple[str, float, float]], marker: str = FLUSH_MARKER) -> list[float]:
    """Per call, the summed durations of device activities ``(name, start µs, end µs)`` between
    two ``marker`` events (the markers and what precedes the first one excluded)."""
    calls: list[float] = []
    for name, start, end in sorted(events, key=lambda ev: ev[1]):
        if marker in name:
            calls.append(0.0)
        elif calls:
            calls[-1] += end - start
    return calls


def gpu_us(fn, n: int = GPU_CALLS) -> float | None:
    """Median over ``n`` calls, each after an L2 flush, of a call's summed CUDA durations."""
    if DEVICE != "cuda":
        return None
    for _ in range(2):  # warm: compilation stays out of the profile
        fn()
    torch.cuda.synchronize()
    time.sleep(SETTLE_CALL_S)  # out of the slow window of what the warm calls allocated
    flush_l2()
    events = bc.cuda_profile(fn, n, before=flush_l2, warm=False).events()
    calls = per_call_us([(e.name, e.time_range.start, e.time_range.end) for e in events
                         if e.device_type == torch.autograd.DeviceType.CUDA
                         and not e.name.startswith("[")])  # fmt: skip
    if len(calls) != n:
        raise RuntimeError(f"profiler saw {len(calls)} flush markers for {n} calls")
    return statistics.median(calls)


def pad_rows(x: torch.Tensor, tokens_per_expert: torch.Tensor, align: int, num_rows: int):
    """The separate, sync-free pad pass: (rows copied into zeros ``[num_rows, H]``, dst rows)."""
    tpe = tokens_per_expert.long()
    ends = torch.cumsum(tpe, 0)
    padded = (tpe + align - 1) // align * align
    shift = (torch.cumsum(padded, 0) - padded) - (ends - tpe)
    rows = torch.arange(x.shape[0], device=x.device)
    dst = rows + shift[torch.searchsorted(ends, rows, right=True).clamp(max=tpe.numel() - 1)]
    return x.new_zeros((num_rows, x.shape[1])).index_copy(0, dst, x), dst


def torch_permute(hidden, indices, probs, E, align, num_rows):
    """argsort + index_select (+ pad pass). Returns (rows, row_probs, order, pad_dst)."""
    k, flat = indices.shape[1], indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows, row_probs = hidden.index_select(0, order // k), probs.reshape(-1).index_select(0, order)
    if align is None:
        return rows, row_probs, order, None
    tpe = torch.zeros(E, dtype=torch.long, device=flat.device)
    tpe.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.long))
    rows, dst = pad_rows(rows, tpe, align, num_rows)
    return rows, row_probs.new_zeros(num_rows).index_copy(0, dst, row_probs), order, dst


def torch_unpermute(rows, row_probs, order, pad_dst, T, k):
    """(unpad pass +) index_add_ of the weighted rows."""
    if pad_dst is not None:
        rows, row_probs = rows.index_select(0, pad_dst), row_probs.index_select(0, pad_dst)
    weighted = rows * row_probs.to(rows.dtype)[:, None]
    return rows.new_zeros((T, rows.shape[1])).index_add(0, order // k, weighted)


def check_shape(T, H, E, k, align) -> None:
    """bf16 forward and gradients of one shape against the reference (raises on a mismatch)."""
    idx, probs = bc.topk_routing(T, E, k, DEVICE)
    hidden = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    probs.requires_grad_(True)
    d = permute(hidden, idx, probs, num_experts=E, align=align)
    meta = routing_metadata_torch(idx, E, align or 1)
    want = (*meta, *ref.scatter_rows_torch(hidden.detach(), meta[0], d.num_rows, probs.detach()))
    got = {"row_index": d.row_index, "tpe": d.tokens_per_expert, "counts": d.counts,
           "offsets": d.offsets, "rows": d.hidden, "probs": d.probs}  # fmt: skip
    for (label, g), w in zip(got.items(), want):
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


def contenders(T, E, k, align, R) -> dict:
    """label -> (permute(idx, probs, hidden) -> state with "rows" [R, H] and "probs" [R],
    unpermute(state, expert_out) -> y [T, H], GPU-timed)."""

    def sep_p(idx, probs, hidden):
        d = permute(hidden, idx, probs, num_experts=E)
        rows, dst = pad_rows(d.hidden, d.tokens_per_expert, align, R)
        return {"rows": rows, "probs": d.probs.new_zeros(R).index_copy(0, dst, d.probs),
                "d": d, "dst": dst}  # fmt: skip

    def sep_u(st, eo):  # unpad the probs too: their gradient also crosses the separate pass
        d2 = dataclasses.replace(st["d"], probs=st["probs"].index_select(0, st["dst"]))
        return unpermute(eo.index_select(0, st["dst"]), d2)

    def ours_p(idx, probs, hidden):
        d = permute(hidden, idx, probs, num_experts=E, align=align)
        return {"rows": d.hidden, "probs": d.probs, "d": d}

    torch_p = lambda i, p, h: dict(zip(("rows", "probs", "order", "dst"),
                                       torch_permute(h, i, p, E, align, R)))  # fmt: skip
    ours_u = lambda st, eo: unpermute(eo, dataclasses.replace(st["d"], probs=st["probs"]))
    torch_u = lambda st, eo: torch_unpermute(eo, st["probs"], st["order"], st["dst"], T, k)
    return {"ours": (ours_p, ours_u, True), "torch": (torch_p, torch_u, True),
            **({"sep-pad": (sep_p, sep_u, False)} if align else {})}  # fmt: skip


def time_op(res, gres, key, fwd, graph, gpu: bool) -> None:
    """``fwd()`` runs the forward; ``graph()`` a forward giving (outputs, inputs, grads).
    Eager backward = (fwd + bwd) − fwd; GPU backward = autograd.grad alone."""
    res[(*key, "fwd")] = bench_us(fwd)
    both = bench_us(lambda: torch.autograd.grad(*graph()))
    res[(*key, "bwd")] = max(both - res[(*key, "fwd")], 1e-3)
    if gpu and DEVICE == "cuda":
        gres[(*key, "fwd")] = gpu_us(fwd)
        outs, ins, grads = graph()
        gres[(*key, "bwd")] = gpu_us(
            lambda: torch.autograd.grad(outs, ins, grads, retain_graph=True)
        )


def measure_impl(res, gres, label, make_p, make_u, s, gpu: bool) -> None:
    """Permute then unpermute (on detached permute outputs: expert_out and the row probs are the
    leaves) of one contender, on the input set ``s`` = (indices, probs, hidden)."""
    st, rows_probs = make_p(*s), itemgetter("rows", "probs")
    g = tuple(map(torch.randn_like, rows_probs(st)))
    p_graph = lambda: (rows_probs(make_p(*s)), (s[2], s[1]), g)
    time_op(res, gres, ("permute", label), lambda: make_p(*s), p_graph, gpu)
    st = {**st, "probs": st["probs"].detach().requires_grad_(True)}
    eo = torch.randn_like(st.pop("rows")).requires_grad_(True)
    gy = torch.randn(s[2].shape, device=DEVICE, dtype=s[2].dtype)
    u_graph = lambda: ((make_u(st, eo),), (eo, st["probs"]), (gy,))
    time_op(res, gres, ("unpermute", label), lambda: make_u(st, eo), u_graph, gpu)


def measure_config(cfg, copy, no_align, cell_errors) -> list[dict]:
    """Rows (op × pass) of one config: µs, GB/s, % of the copy rate, ×torch, pad overhead."""
    _r = lambda a, b: a / b if a and b else None
    T, H, E, k, align = cfg
    tk, b = T * k, 2
    R = tk + (min(E, tk) * (align - 1) if align else 0)
    settle_fresh_memory((5 * R + 6 * T) * H * b + (64 << 20))  # one settled segment for all
    idx, probs = bc.topk_routing(T, E, k, DEVICE)  # one input set, made before any timing
    hidden = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    s = (idx, probs.requires_grad_(True), hidden)
    meta = tk * (8 + 4 + 4 + 4) + R * 4  # indices, row_index, probs in/out
    nbytes = {("permute", "fwd"): T + R, ("permute", "bwd"): tk + T,
              ("unpermute", "fwd"): tk + T, ("unpermute", "bwd"): T + tk + R}  # fmt: skip
    res, gres, errors = {}, {}, {}
    for label, (make_p, make_u, gpu) in contenders(T, E, k, align, R).items():
        try:
            measure_impl(res, gres, label, make_p, make_u, s, gpu)
        except Exception as exc:  # one failing contender must not lose the table
            errors[label] = bc.error_line(exc)
            bc.log(f"    FAIL {label}: {errors[label]}")
    if errors:
        cell_errors[str(cfg)] = errors
    rows = []
    for op, ps in itertools.product(("permute", "unpermute"), ("fwd", "bwd")):
        ours, ours_g = res.get((op, "ours", ps)), gres.get((op, "ours", ps))
        n = nbytes[(op, ps)] * H * b + meta
        gbs, gbs_g = _r(n / 1e3, ours), _r(n / 1e3, ours_g)
        if align is None:
            no_align[(T, H, E, k, op, ps)] = (ours, ours_g)
        ref_e, ref_g = no_align.get((T, H, E, k, op, ps), (None, None)) if align else (None,) * 2
        rows.append({
            "T": T, "H": H, "E": E, "k": k, "align": align, "R": R, "op": op, "pass": ps,
            "bytes": n, "ours_us": ours, "gpu_us": ours_g, "gbs": gbs, "gbs_gpu": gbs_g,
            "pct_copy": _r(100 * (gbs or 0), copy[0]), "pct_copy_gpu": _r(100 * (gbs_g or 0), copy[1]),
            "torch_us": res.get((op, "torch", ps)), "torch_gpu_us": gres.get((op, "torch", ps)),
            "speedup": _r(res.get((op, "torch", ps)), ours),
            "speedup_gpu": _r(gres.get((op, "torch", ps)), ours_g),
            "sep_pad_us": res.get((op, "sep-pad", ps)),
            "pad_overhead_pct": (ours / ref_e - 1) * 100 if ours and ref_e else None,
            "pad_overhead_pct_gpu": (ours_g / ref_g - 1) * 100 if ours_g and ref_g else None,
        })  # fmt: skip
    return rows


def summarize(rows, copy, meta_us, meta_gpu) -> dict:
    """The headline figures, on GPU time and eager time ("big": T·k ≥ 32K, H ≥ 2048)."""
    big = [r for r in rows if r["T"] * r["k"] >= 32768 and r["H"] >= 2048]
    vals = lambda key, sel: [r[key] for r in sel if r[key] is not None]
    out = {"copy_gbs": copy[0], "copy_gbs_gpu": copy[1]}
    for sfx, meta in (("_gpu", meta_gpu), ("", meta_us)):
        out.update({
            f"min_pct_copy_big{sfx}": min(vals(f"pct_copy{sfx}", big), default=None),
            f"min_speedup{sfx}": min(vals(f"speedup{sfx}", rows), default=None),
            f"max_pad_overhead_pct{sfx}": max(vals(f"pad_overhead_pct{sfx}", rows), default=None),
            f"metadata{sfx}_us": meta.get(1), f"metadata_align128{sfx}_us": meta.get(128),
        })  # fmt: skip
    return out


def panels(rows: list[dict], copy: tuple) -> list[bc.Panel]:
    """% of copy bandwidth (eager, GPU time) and speed-up over torch, against T·k·H."""
    series = sorted({(r["op"], r["pass"]) for r in rows})
    pts = lambda key: {f"{op} {ps}": tuple(zip(*[(r["T"] * r["k"] * r["H"], r[key]) for r in rows
                       if (r["op"], r["pass"]) == (op, ps) and r[key]])) or ((), ())
                       for op, ps in series}  # fmt: skip
    key = "speedup_gpu" if any(r["speedup_gpu"] for r in rows) else "speedup"
    kw = dict(kind="scatter", xlabel="T·k·H", logx=True)
    return [bc.Panel(pts("pct_copy"), f"% of copy BW, eager ({copy[0]} GB/s)", **kw),
            bc.Panel(pts("pct_copy_gpu"), f"% of copy BW, GPU time ({copy[1]} GB/s)", **kw),
            bc.Panel(pts(key), f"speed-up over torch-composed ({key})", logy=True, **kw)]  # fmt: skip


def grid(smoke: bool, quick: bool) -> list[tuple]:
    """(T, H, E, k, align) of every config."""
    axes = (([16], [32], [(4, 2)], [None, 16]) if smoke else
            ([16384], [4096], [(8, 2), (256, 8)], [None, 128]) if quick else
            ([4096, 16384, 65536], [2048, 4096, 7168], [(8, 2), (64, 8), (128, 8), (256, 8)],
             [None, 16, 128]))  # fmt: skip
    return [(T, H, E, k, a) for T, H, (E, k), a in itertools.product(*axes)]


def main(argv=None) -> int:
    global DEVICE
    ap = bc.parser(__doc__, quick="a reduced grid (a few shapes)")
    ap.add_argument("--budget-s", type=float, default=None, help="default 100 quick, 300 full")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    checks = ([(24, 48, 8, 2, 16), (16, 32, 4, 3, None)] if args.smoke else
              [(4096, 2048, 64, 8, 16), (16384, 7168, 256, 8, 128), (65536, 2048, 8, 2, None)])  # fmt: skip
    _, _, failures = bc.run_cases([(str(c), lambda c=c: check_shape(*c) or []) for c in checks])
    nbytes = 2**22 if args.smoke else 2**30  # the ceiling: a device copy, GB/s read + written
    src = torch.randn(nbytes // 2, device=DEVICE, dtype=torch.bfloat16)
    cp = partial(torch.Tensor.copy_, torch.empty_like(src), src)  # dst.copy_(src)
    settle_fresh_memory(1)
    copy = tuple(round(2 * nbytes / us / 1e3) if us else None
                 for us in (bench_us(cp), gpu_us(cp)))  # fmt: skip
    del src, cp  # free the buffers
    mT, mE, mk = (64, 8, 2) if args.smoke else (65536, 256, 8)
    idx, _ = bc.topk_routing(mT, mE, mk, DEVICE)
    meta_us = {a: bench_us(lambda a=a: routing_metadata(idx, mE, a)) for a in (1, 128)}
    meta_gpu = {a: gpu_us(lambda a=a: routing_metadata(idx, mE, a)) for a in (1, 128)}
    bc.log(f"copy {copy} GB/s (eager, GPU); metadata T={mT} E={mE} k={mk} µs (align 1, 128): "
           f"eager {meta_us}, GPU {meta_gpu} (target ≤ 30)")  # fmt: skip
    no_align, cell_errors = {}, {}
    cases = [("T={} H={} E={} k={} align={}".format(*c), partial(measure_config, c, copy, no_align,
              cell_errors)) for c in grid(args.smoke, args.quick)]  # fmt: skip
    budget = args.budget_s or (100.0 if args.quick or args.smoke else 300.0)
    rows, skipped, failed = bc.run_cases(cases, budget)
    summary = summarize(rows, copy, meta_us, meta_gpu)
    summary.update(correctness_failures=failures, failed_cells={**cell_errors, **failed},
                   skipped_configs=skipped)  # fmt: skip
    bc.log(summary)
    cols = ["T", "H", "E", "k", "align", "op", "pass", "ours_us", "gpu_us", "gbs", "pct_copy",
            "pct_copy_gpu", "torch_us", "speedup", "speedup_gpu", "sep_pad_us",
            "pad_overhead_pct", "pad_overhead_pct_gpu"]  # fmt: skip
    data = {"device": bc.device_name(DEVICE == "cuda"), "summary": summary, "rows": rows}
    bc.finish(args.out, "permute_bench", data, cols, panels(rows, copy),
              "moekit permute / unpermute (bf16)", ".1f")  # fmt: skip
    return 1 if failures or cell_errors or failed else 0


if __name__ == "__main__":
    sys.exit(main())
