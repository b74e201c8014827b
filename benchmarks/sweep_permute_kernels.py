"""Sweep the permute kernels' launch configurations on one GPU: the copy kernels, then metadata.

    python benchmarks/sweep_permute_kernels.py --out sweep_out          # < 3 min on an H100
    python benchmarks/sweep_permute_kernels.py --out sweep_out --sections meta
    python benchmarks/sweep_permute_kernels.py --smoke --out /tmp/sweep  # tiny, CPU or GPU

Copy kernels. For T ∈ {65536, 4096}, H ∈ {2048, 4096, 7168}, k ∈ {8, 2} (E = 64 for k = 8, E = 8
for k = 2; random top-k routing, no padding; the metadata is computed once, outside timing), the
launchers of moekit/kernels/permute.py are run the way the ops run them:

    scatter/permute_fwd    scatter_rows(x, slot_vals=probs)                    permute forward
    scatter/unpermute_bwd  scatter_rows(dy, row_weight=p, dot_src=expert_out)  unpermute backward
    gather/unpermute_fwd   gather_rows(expert_out, row_weight=p)               unpermute forward
    gather/permute_bwd     gather_rows(d_rows, row_vals=d_probs)               permute backward

with every configuration of ``copy_config_candidates`` (the current default first). Each candidate
is first checked once against the default's output (copies and scales bit-exact; fp32 sums within
rounding); a mismatch is reported and the candidate skipped. Then it is timed.

Metadata. For T=65536, E=256, k=8 every ``meta_config_candidates`` variant is checked against the
default's outputs (exactly), then each launch (hist, scan, rows) and the three together are timed.

Timing: a CUDA graph of back-to-back calls (warmed up eagerly on a side stream first), replayed
5 times, median replay / calls per graph. Copy cells cycle through enough input copies (and keep
as many outputs alive) that every call reads and writes at least 200 MB of distinct memory
(4× the 50 MB L2), and a graph holds ≥ ~2 ms of work. GB/s = bytes that must move / time;
%copy compares with a 1 GiB device-to-device copy (read + write) timed the same way in this run.
``--budget-s`` (default 170) stops starting new shapes; the table is printed last, JSON to --out.
--smoke: tiny shapes and four candidates per kernel (spread over the list); on the CPU (kernels in Triton's interpreter
under TRITON_INTERPRET=1) it times one perf_counter call: a plumbing check, not a measurement.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from moekit.kernels import permute as kern

L2_BYTES = 50 * 2**20
MIN_ROTATION_BYTES = 4 * L2_BYTES
GRAPH_WORK_US = 2000.0  # aim for at least this much work per graph replay
EST_GBS = 3000.0  # bandwidth used only to size the graphs
REPLAYS = 5
MAX_COPIES = 8

USES = (
    "scatter/permute_fwd",
    "scatter/unpermute_bwd",
    "gather/unpermute_fwd",
    "gather/permute_bwd",
)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


class Timer:
    """CUDA graphs of back-to-back calls on a GPU; one perf_counter call on the CPU (smoke)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def us(self, fns: list, n_calls: int, ring: int = 0) -> float:
        """Median µs per call: a graph of ``n_calls`` calls cycling through ``fns``; the last
        ``ring`` outputs stay alive during capture, so consecutive calls write distinct memory."""
        if not self.cuda:
            t0 = time.perf_counter()
            fns[0]()
            return (time.perf_counter() - t0) * 1e6
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (allocator, compilation)
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        kept: list = [None] * ring
        with torch.cuda.graph(graph):
            for i in range(n_calls):
                out = fns[i % len(fns)]()
                if ring:
                    kept[i % ring] = out
        del kept, out
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(REPLAYS):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / n_calls)
        del graph
        torch.cuda.empty_cache()  # the graph's private pool (outputs of up to ~8 GB) goes back
        return statistics.median(times)


def _graph_calls(nbytes: int, copies: int) -> int:
    """Calls per graph: ≥ GRAPH_WORK_US of work at EST_GBS, a multiple of ``copies``, ≤ 64."""
    est_us = nbytes / (EST_GBS * 1e3)
    calls = min(max(math.ceil(GRAPH_WORK_US / max(est_us, 1e-3)), 1), 64)
    return max(copies, math.ceil(calls / copies) * copies)


def _copies(nbytes: int) -> int:
    return min(max(math.ceil(MIN_ROTATION_BYTES / max(nbytes, 1)), 1), MAX_COPIES)


def copy_reference(timer: Timer, device, nbytes: int) -> float:
    """GB/s of a device-to-device copy of ``nbytes`` (read + write)."""
    src = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    us = timer.us([lambda: dst.copy_(src)], n_calls=4)
    return 2 * nbytes / (us * 1e-6) / 1e9


# ------------------------------------------------------------------------------------------------
# Copy kernels
# ------------------------------------------------------------------------------------------------


def _pick(names: list[str], most: int) -> list[str]:
    """All names, or ``most`` of them spread over the list (the default, names[0], included)."""
    if len(names) <= most:
        return names
    step = math.ceil(len(names) / most)
    return names[::step]


def _check(got, want, exact: bool) -> str | None:
    """None when ``got`` matches ``want`` (tuples of tensors or None), else the mismatch."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g is None and w is None:
            continue
        try:
            if exact:
                torch.testing.assert_close(g, w, rtol=0, atol=0)
            elif g.dtype == torch.float32:  # fp32 sums over H in another order
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-3)
            else:  # fp32 sums rounded to bf16/fp16: one ulp apart at most
                torch.testing.assert_close(g, w, rtol=1.6e-2, atol=1e-2)
        except AssertionError as exc:
            return f"output {i}: {_first_line(exc)}"
    return None


def sweep_shape(timer, device, T, H, k, E, copy_gbs, max_candidates, dtype=torch.bfloat16):
    """Every use of the copy launchers at one shape, every candidate: {use: result dict}."""
    b = torch.empty((), dtype=dtype).element_size()
    scores = torch.randn(T, E, device=device)
    probs, idx = scores.softmax(-1).topk(k, dim=-1)
    row_index, tpe, _, offsets = kern.routing_metadata(idx, E, 1)
    R = T * k
    row_p = torch.rand(R, device=device)  # row probs (unpermute) / their gradient (permute bwd)
    meta = T * k * 4  # row_index
    n_x = _copies(T * H * b)
    n_src = _copies(R * H * b)
    xs = [torch.randn(T, H, device=device, dtype=dtype) for _ in range(n_x)]
    srcs = [torch.randn(R, H, device=device, dtype=dtype) for _ in range(n_src)]

    def scatter_fwd(i, cfg):
        return kern.scatter_rows(
            xs[i % n_x], row_index, R, offsets, tpe, slot_vals=probs,
            out_vals_dtype=probs.dtype, pad_programs=False, tail_lo=R, config=cfg,
        )  # fmt: skip

    def scatter_bwd(i, cfg):
        return kern.scatter_rows(
            xs[i % n_x], row_index, R, offsets, tpe, row_weight=row_p, dot_src=srcs[i % n_src],
            out_vals_dtype=row_p.dtype, pad_programs=False, tail_lo=R, config=cfg,
        )  # fmt: skip

    def gather_fwd(i, cfg):
        return kern.gather_rows(srcs[i % n_src], row_index, row_weight=row_p, config=cfg)

    def gather_bwd(i, cfg):
        return kern.gather_rows(srcs[i % n_src], row_index, row_vals=row_p, config=cfg)

    uses = {
        # name: (launch, kind, bytes that must move, copies cycled, exact outputs)
        "scatter/permute_fwd": (scatter_fwd, "scatter", T * H * b + R * H * b + T * k * 4 + R * 4
                                + meta, n_x, True),
        "scatter/unpermute_bwd": (scatter_bwd, "scatter", T * H * b + 2 * R * H * b + 2 * R * 4
                                  + meta, max(n_x, n_src), False),
        "gather/unpermute_fwd": (gather_fwd, "gather", R * H * b + T * H * b + R * 4 + meta,
                                 n_src, False),
        "gather/permute_bwd": (gather_bwd, "gather", R * H * b + T * H * b + R * 4 + T * k * 4
                               + meta, n_src, False),
    }  # fmt: skip
    results = {}
    for use, (launch, kind, nbytes, copies, exact) in uses.items():
        cands = kern.copy_config_candidates(kind, k, H, dot=use == "scatter/unpermute_bwd")
        names = _pick(list(cands), max_candidates)
        want = launch(0, cands["default"])
        cells, errors = {}, {}
        for name in names:
            cfg = cands[name]
            try:
                if name != "default":
                    bad = _check(launch(0, cfg), want, exact)
                    if bad:
                        errors[name] = f"mismatch: {bad}"
                        print(f"    {use} {name}: MISMATCH {bad}", flush=True)
                        continue
                fns = [lambda i=i, cfg=cfg: launch(i, cfg) for i in range(copies)]
                ring = copies if copies > 1 else 0
                us = timer.us(fns, _graph_calls(nbytes, copies), ring=ring)
                gbs = nbytes / (us * 1e-6) / 1e9
                cells[name] = {"us": us, "gbs": gbs, "pct_copy": 100 * gbs / copy_gbs}
            except Exception as exc:  # one failing candidate must not lose the sweep
                errors[name] = _first_line(exc)
                print(f"    {use} {name}: FAILED {errors[name]}", flush=True)
                if timer.cuda:
                    torch.cuda.synchronize()
        del want
        best = min(cells, key=lambda n: cells[n]["us"]) if cells else None
        results[use] = {
            "bytes": nbytes,
            "configs": {n: repr(cands[n]) for n in names},
            "cells": cells,
            "errors": errors,
            "best": best,
            "default": cells.get("default"),
        }
    return results


# ------------------------------------------------------------------------------------------------
# Metadata
# ------------------------------------------------------------------------------------------------


def sweep_metadata(timer, device, T, E, k, max_candidates, n_calls=20):
    """Every metadata variant: µs of hist, scan, rows and of the three together."""
    scores = torch.randn(T, E, device=device)
    _, idx = scores.topk(k, dim=-1)
    cands = kern.meta_config_candidates(T * k)
    want = kern.routing_metadata(idx, E, 1, config=cands["default"])
    out, errors = {}, {}
    for name in _pick(list(cands), max_candidates):
        cfg = cands[name]
        try:
            outputs, launches = kern.routing_metadata_launches(idx, E, 1, config=cfg)
            for _, launch in launches:
                launch()
            bad = _check(outputs, want, exact=True)
            if bad:
                errors[name] = f"mismatch: {bad}"
                print(f"    metadata {name}: MISMATCH {bad}", flush=True)
                continue
            cell = {"config": repr(cfg)}
            for lname, launch in launches:  # each re-run reads what the earlier launches wrote
                cell[lname] = timer.us([launch], n_calls)

            def all3(launches=launches):
                for _, launch in launches:
                    launch()

            cell["all"] = timer.us([all3], n_calls)
            out[name] = cell
        except Exception as exc:
            errors[name] = _first_line(exc)
            print(f"    metadata {name}: FAILED {errors[name]}", flush=True)
            if timer.cuda:
                torch.cuda.synchronize()
    return {"T": T, "E": E, "k": k, "variants": out, "errors": errors}


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def print_copy_table(rows):
    print(
        f"{'T':>6} {'H':>5} {'k':>2} {'use':<22} {'MB':>7} {'default GB/s':>12} {'%copy':>5} "
        f"{'best config':<22} {'best GB/s':>9} {'%copy':>5} {'×default':>8}"
    )
    for r in rows:
        for use in USES:
            res = r["uses"].get(use)
            if res is None:
                continue
            d = res["default"] or {}
            best = res["cells"].get(res["best"], {}) if res["best"] else {}
            gain = d["us"] / best["us"] if d.get("us") and best.get("us") else None
            print(
                f"{r['T']:>6} {r['H']:>5} {r['k']:>2} {use:<22} {res['bytes'] / 1e6:>7.0f} "
                f"{_fmt(d.get('gbs'), '.0f'):>12} {_fmt(d.get('pct_copy'), '.0f'):>4}% "
                f"{res['best'] or '-':<22} {_fmt(best.get('gbs'), '.0f'):>9} "
                f"{_fmt(best.get('pct_copy'), '.0f'):>4}% {_fmt(gain, '.2f'):>7}×"
            )
            bad = {**res["errors"]}
            if bad:
                print(f"{'':>16} skipped: " + "; ".join(f"{n}: {e}" for n, e in bad.items()))


def print_meta_table(meta):
    if not meta:
        return
    print(f"\nmetadata T={meta['T']} E={meta['E']} k={meta['k']} (µs per launch, CUDA graph)")
    print(f"{'variant':<24} {'hist':>6} {'scan':>6} {'rows':>6} {'sum':>6} {'all':>6}  config")
    for name, c in meta["variants"].items():
        total = sum(c[n] for n in ("hist", "scan", "rows"))
        print(
            f"{name:<24} {c['hist']:>6.1f} {c['scan']:>6.1f} {c['rows']:>6.1f} {total:>6.1f} "
            f"{c['all']:>6.1f}  {c['config']}"
        )
    for name, err in meta["errors"].items():
        print(f"{name:<24} skipped: {err}")


def summarize_candidates(rows) -> dict:
    """Per use: each candidate's geometric-mean speed over the default across the shapes where
    both ran (> 1: faster), and the shapes it won."""
    out = {}
    for use in USES:
        ratios, wins = {}, {}
        for r in rows:
            res = r["uses"].get(use)
            if not res or not res["default"]:
                continue
            for name, cell in res["cells"].items():
                ratios.setdefault(name, []).append(res["default"]["us"] / cell["us"])
            if res["best"]:
                wins.setdefault(res["best"], []).append(f"T={r['T']} H={r['H']} k={r['k']}")
        out[use] = {
            name: {
                "geomean_speedup": math.exp(statistics.fmean(math.log(v) for v in vals)),
                "shapes": len(vals),
                "won": wins.get(name, []),
            }
            for name, vals in ratios.items()
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="sweep_out", help="directory for permute_sweep.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 4 candidates (CPU or GPU)")
    ap.add_argument("--sections", default="copy,meta", help="comma list of: copy, meta")
    ap.add_argument("--budget-s", type=float, default=170.0, help="stop starting new shapes")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    timer = Timer(cuda)
    sections = set(args.sections.split(","))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    t_start = time.time()
    dev_name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device: {dev_name}  torch {torch.__version__}", flush=True)

    copy_gbs = copy_reference(timer, device, 2**20 if args.smoke else 2**30)
    print(f"copy bandwidth: {copy_gbs:.0f} GB/s (device-to-device, read + write)", flush=True)

    max_cand = 4 if args.smoke else 100
    meta = None
    if "meta" in sections:
        mT, mE, mk = (64, 16, 2) if args.smoke else (65536, 256, 8)
        print(f"metadata T={mT} E={mE} k={mk}:", flush=True)
        meta = sweep_metadata(timer, device, mT, mE, mk, max_cand)

    if args.smoke:
        shapes = [(16, 64, 2), (12, 96, 8)]
    else:  # the GPU-bound shapes first: they matter most if the budget runs out
        shapes = list(itertools.product([65536, 4096], [7168, 4096, 2048], [8, 2]))
    rows, skipped = [], []
    if "copy" in sections:
        for i, (T, H, k) in enumerate(shapes):
            name = f"T={T} H={H} k={k}"
            if time.time() - t_start > args.budget_s:
                skipped.append(name)
                continue
            t0 = time.time()
            E = 64 if k == 8 else 8
            try:
                uses = sweep_shape(timer, device, T, H, k, E, copy_gbs, max_cand)
            except Exception as exc:  # e.g. out of memory while building the inputs
                print(f"  [{i + 1}/{len(shapes)}] {name}: FAILED {_first_line(exc)}", flush=True)
                rows.append({"T": T, "H": H, "k": k, "E": E, "uses": {}, "error": str(exc)})
                continue
            finally:
                if cuda:
                    torch.cuda.empty_cache()
            rows.append({"T": T, "H": H, "k": k, "E": E, "uses": uses})
            best = ", ".join(
                f"{use} {_fmt((res['default'] or {}).get('pct_copy'), '.0f')}%→{res['best']} "
                f"{_fmt(res['cells'].get(res['best'], {}).get('pct_copy'), '.0f')}%"
                for use, res in uses.items()
            )
            print(f"  [{i + 1}/{len(shapes)}] {name}: {time.time() - t0:.1f} s; {best}", flush=True)

    summary = summarize_candidates(rows)
    (out_dir / "permute_sweep.json").write_text(
        json.dumps(
            {
                "device": dev_name,
                "copy_gbs": copy_gbs,
                "copy": rows,
                "copy_summary": summary,
                "metadata": meta,
                "skipped": skipped,
                "seconds": time.time() - t_start,
            },
            indent=1,
        )
    )
    print()
    if rows:
        print(f"copy kernels (copy bandwidth {copy_gbs:.0f} GB/s; µs per call from CUDA graphs)")
        print_copy_table(rows)
        print("\ncandidates, geometric-mean speed over the default (shapes won):")
        for use, cands in summary.items():
            ranked = sorted(cands.items(), key=lambda kv: -kv[1]["geomean_speedup"])
            print(
                f"  {use:<22} "
                + ", ".join(
                    f"{n} {v['geomean_speedup']:.2f}×({len(v['won'])})" for n, v in ranked[:5]
                )
            )
    print_meta_table(meta)
    if skipped:
        print(f"skipped {len(skipped)} shapes past the {args.budget_s:.0f} s budget: {skipped}")
    print(f"wrote {out_dir / 'permute_sweep.json'} ({time.time() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
