"""Token permute / unpermute on one GPU: correctness check, then bandwidth against a plain copy.

    python benchmarks/benchmark_permute.py --out bench_out [--quick] [--rep-ms 5]

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

Timing: every cell is timed eagerly with ``triton.testing.do_bench`` (median; it flushes L2
before each call, so the inputs are not cached). No CUDA graphs: capturing autograd's backward
is fragile and a failed capture leaves the CUDA RNG unusable for the rest of the run.
Backward = median(forward + backward) − median(forward), where forward + backward runs the
forward and then ``torch.autograd.grad`` in the same timed call; the torch baselines likewise.
All random inputs are made before any timing, never inside a timed call. A cell that fails is
reported and skipped, never the whole table.
The metadata is also timed launch by launch (hist, scan, rows).
Writes permute_bench.json and permute_bench.png under --out; ``--budget-s`` bounds the grid's
wall time (configs past it are listed as skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from moekit.kernels.permute import routing_metadata, routing_metadata_launches
from moekit.ops.permute import permute, unpermute
from moekit.reference import permute as ref

DEVICE = "cuda"


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def bench_us(fns: list, rep_ms: float) -> float:
    """Median µs per call of ``fns`` (cycled through), timed eagerly by triton's do_bench."""
    it = itertools.cycle(fns)

    def fn():
        return next(it)()

    ms = triton.testing.do_bench(
        fn, warmup=max(5.0, rep_ms), rep=max(20.0, 4 * rep_ms), return_mode="median"
    )
    return ms * 1e3


def copy_bandwidth(rep_ms: float) -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write)."""
    n = 2**30 // 2
    src = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    us = bench_us([lambda: dst.copy_(src)], rep_ms)
    return 2 * 2**30 / (us * 1e-6) / 1e9


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


def check_correctness(shapes=CHECK_SHAPES) -> list[str]:
    """bf16 forward and gradients against the reference; returns the failures."""
    failures = []
    for T, H, E, k, align in shapes:
        name = f"T={T} H={H} E={E} k={k} align={align}"
        try:
            idx, probs = routing(T, E, k)
            hidden = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
            probs.requires_grad_(True)
            d = permute(hidden, idx, probs, num_experts=E, align=align)
            meta = ref.routing_metadata_torch(idx, E, align or 1)
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


def routing(T, E, k):
    scores = torch.randn(T, E, device=DEVICE)
    probs, idx = scores.softmax(-1).topk(k, dim=-1)
    return idx, probs / probs.sum(-1, keepdim=True)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def measure_config(T, H, E, k, align, rep_ms, dtype=torch.bfloat16):
    """µs of every (op, pass, impl) for one shape, the bytes each pass must move, R, and the
    errors of the cells that failed (their µs are missing)."""
    b = torch.empty((), dtype=dtype).element_size()
    tk = T * k
    R = tk + (min(E, tk) * (align - 1) if align else 0)
    # One input set, made before any timing: do_bench flushes L2 before every call.
    idx, probs = routing(T, E, k)
    hidden = torch.randn(T, H, device=DEVICE, dtype=dtype, requires_grad=True)
    sets = [(idx, probs.requires_grad_(True), hidden)]
    meta = tk * (8 + 4 + 4 + 4) + R * 4  # indices, row_index, probs in/out
    bytes_ = {
        ("permute", "fwd"): (T + R) * H * b + meta,
        ("permute", "bwd"): (tk + T) * H * b + meta,
        ("unpermute", "fwd"): (tk + T) * H * b + meta,
        ("unpermute", "bwd"): (T + tk + R) * H * b + meta,
    }
    res, errors = {}, {}

    def cell(key, fns):
        try:
            res[key] = bench_us(fns, rep_ms)
        except Exception as exc:  # one failing cell must not lose the table
            errors[key] = _first_line(exc)
            print(f"    FAIL {key}: {errors[key]}", flush=True)
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()

    def bwd_of(op, label):
        both, fwd = res.get((op, "fwdbwd", label)), res.get((op, "fwd", label))
        if both is not None and fwd is not None:
            res[(op, "bwd", label)] = max(both - fwd, 1e-3)

    def run(label, make_permute, make_unpermute):
        """make_permute(set) -> state dict with "rows" [R, H] and "probs" [R];
        make_unpermute(state, expert_out) -> y [T, H]. Backward = (fwd + bwd) − fwd."""
        cell(("permute", "fwd", label), [lambda s=s: make_permute(s) for s in sets])
        try:
            states = [make_permute(s) for s in sets]
        except Exception as exc:
            errors[("permute", "state", label)] = _first_line(exc)
            print(f"    FAIL {label} permute: {_first_line(exc)}", flush=True)
            return
        grads = [(torch.randn_like(st["rows"]), torch.randn_like(st["probs"])) for st in states]

        def p_fwdbwd(s, g):
            st = make_permute(s)
            return torch.autograd.grad((st["rows"], st["probs"]), (s[2], s[1]), g)

        cell(
            ("permute", "fwdbwd", label),
            [lambda s=s, g=g: p_fwdbwd(s, g) for s, g in zip(sets, grads)],
        )
        bwd_of("permute", label)
        del grads
        # Unpermute on detached permute outputs: expert_out and the row probs are the leaves.
        states = [{**st, "probs": _leaf(st["probs"])} for st in states]
        eouts = [_leaf(torch.randn_like(st["rows"])) for st in states]
        for st in states:
            del st["rows"]  # only the leaves above are needed from here on
        cell(
            ("unpermute", "fwd", label),
            [lambda st=st, eo=eo: make_unpermute(st, eo) for st, eo in zip(states, eouts)],
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
        )
        bwd_of("unpermute", label)

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

        run("sep-pad", sep_p, sep_u)
    return res, bytes_, R, errors


def time_metadata(rep_ms: float, T=65536, E=256, k=8) -> dict:
    """µs of the whole metadata (align 1 and 128) and of each of its launches (align 128)."""
    out = {}
    idx, _ = routing(T, E, k)
    for a in (1, 128):
        try:
            out[f"all_align{a}"] = bench_us([lambda a=a: routing_metadata(idx, E, a)], rep_ms)
        except Exception as exc:
            print(f"  metadata align={a} FAILED: {_first_line(exc)}", flush=True)
    try:
        _, launches = routing_metadata_launches(idx, E, 128)
        for _name, launch in launches:  # in order: each reads what the previous one wrote
            launch()
        for name, launch in launches:
            out[name] = bench_us([launch], rep_ms)
    except Exception as exc:
        print(f"  metadata launches FAILED: {_first_line(exc)}", flush=True)
    return out


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def print_table(rows):
    print(
        f"{'T':>6} {'H':>5} {'E':>4} {'k':>2} {'align':>5} {'op':>9} {'pass':>4} "
        f"{'ours µs':>9} {'GB/s':>6} {'%copy':>6} {'torch µs':>9} {'×torch':>7} "
        f"{'sep-pad µs':>10} {'pad ovh%':>8}"
    )
    for r in rows:
        print(
            f"{r['T']:>6} {r['H']:>5} {r['E']:>4} {r['k']:>2} {r['align'] or '-':>5} "
            f"{r['op']:>9} {r['pass']:>4} {_fmt(r['ours_us'], '.1f'):>9} "
            f"{_fmt(r['gbs'], '.0f'):>6} {_fmt(r['pct_copy'], '.0f'):>5}% "
            f"{_fmt(r['torch_us'], '.1f'):>9} {_fmt(r['speedup'], '.1f'):>6}× "
            f"{_fmt(r['sep_pad_us'], '.1f'):>10} {_fmt(r['pad_overhead_pct'], '+.1f'):>8}"
        )
    print("  (all cells timed eagerly with triton do_bench, median; bwd = fwd+bwd − fwd)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out", help="directory for JSON and PNG")
    ap.add_argument("--quick", action="store_true", help="a reduced grid (a few shapes)")
    ap.add_argument("--rep-ms", type=float, default=5.0, help="GPU time per measurement")
    ap.add_argument("--skip-check", action="store_true", help="skip the correctness pass")
    ap.add_argument(
        "--budget-s", type=float, default=None, help="wall-time budget (default 80 quick, 220 full)"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    budget = args.budget_s or (80.0 if args.quick else 220.0)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    t_start = time.time()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)

    failures = []
    if not args.skip_check:
        print("correctness (bf16 vs reference):", flush=True)
        failures = check_correctness()

    copy_gbs = None
    try:
        copy_gbs = copy_bandwidth(args.rep_ms)
        print(f"copy bandwidth: {copy_gbs:.0f} GB/s (1 GiB device-to-device, read + write)")
    except Exception as exc:
        print(f"copy bandwidth FAILED: {_first_line(exc)}")
    torch.cuda.empty_cache()

    meta_us = time_metadata(args.rep_ms)
    meta_line = (
        f"metadata T=65536 E=256 k=8: {_fmt(meta_us.get('all_align1'), '.1f')} µs "
        f"(align 128: {_fmt(meta_us.get('all_align128'), '.1f')} µs; launches alone: "
        + ", ".join(f"{n} {_fmt(meta_us.get(n), '.1f')}" for n in ("hist", "scan", "rows"))
        + " µs), target ≤ 30 µs"
    )
    print(meta_line, flush=True)

    if args.quick:
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
        try:
            res, bytes_, R, errors = measure_config(T, H, E, k, align, args.rep_ms)
        except Exception as exc:  # e.g. out of memory while building the inputs
            cell_errors[name] = {"config": _first_line(exc)}
            print(f"  [{i + 1}/{len(grid)}] {name}: FAILED {_first_line(exc)}", flush=True)
            torch.cuda.empty_cache()
            continue
        if errors:
            cell_errors[name] = {"/".join(key): msg for key, msg in errors.items()}
        for op, ps in itertools.product(("permute", "unpermute"), ("fwd", "bwd")):
            ours = res.get((op, ps, "ours"))
            base = res.get((op, ps, "torch"))
            sep = res.get((op, ps, "sep-pad"))
            gbs = bytes_[(op, ps)] / (ours * 1e-6) / 1e9 if ours else None
            key = (T, H, E, k, op, ps)
            if align is None and ours is not None:
                no_align[key] = ours
            ovh = (
                (ours / no_align[key] - 1) * 100
                if align and ours is not None and key in no_align
                else None
            )
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
                    "ours_us": ours,
                    "gbs": gbs,
                    "pct_copy": 100 * gbs / copy_gbs if gbs and copy_gbs else None,
                    "torch_us": base,
                    "speedup": base / ours if base and ours else None,
                    "sep_pad_us": sep,
                    "pad_overhead_pct": ovh,
                    "bytes": bytes_[(op, ps)],
                }
            )
        print(f"  [{i + 1}/{len(grid)}] {name}: {time.time() - t0:.1f} s", flush=True)
        del res
        torch.cuda.empty_cache()

    def vals(key, sel=rows):
        return [r[key] for r in sel if r[key] is not None]

    big = [r for r in rows if r["T"] * r["k"] >= 32768 and r["H"] >= 2048]
    summary = {
        "copy_gbs": copy_gbs,
        "metadata_us": meta_us.get("all_align1"),
        "metadata_align128_us": meta_us.get("all_align128"),
        "metadata_launch_us": {n: meta_us.get(n) for n in ("hist", "scan", "rows")},
        "min_pct_copy_big": min(vals("pct_copy", big), default=None),
        "min_speedup": min(vals("speedup"), default=None),
        "max_pad_overhead_pct": max(vals("pad_overhead_pct"), default=None),
        "correctness_failures": failures,
        "failed_cells": cell_errors,
        "skipped_configs": skipped,
        "timing": "eager triton.testing.do_bench, median",
        "seconds": time.time() - t_start,
    }
    print()
    print_table(rows)
    print(meta_line)
    if skipped:
        print(f"skipped {len(skipped)} configs past the {budget:.0f} s budget (--budget-s)")
    print("\nsummary (targets: ≥80% copy BW where T·k ≥ 32K and H ≥ 2048; ≥3× torch;")
    print("         padding ≤ 5% over no padding; metadata ≤ 30 µs)")
    for key, val in summary.items():
        print(f"  {key}: {val if not isinstance(val, float) else round(val, 2)}")
    (out_dir / "permute_bench.json").write_text(
        json.dumps(
            {"device": torch.cuda.get_device_name(), "summary": summary, "rows": rows}, indent=1
        )
    )
    try:
        plot(
            [r for r in rows if r["pct_copy"] and r["speedup"]],
            copy_gbs,
            out_dir / "permute_bench.png",
        )
        print(f"wrote {out_dir / 'permute_bench.json'} and {out_dir / 'permute_bench.png'}")
    except Exception as exc:
        print(f"wrote {out_dir / 'permute_bench.json'}; plot FAILED: {_first_line(exc)}")
    return 1 if failures or cell_errors else 0


def plot(rows, copy_gbs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    series = sorted({(r["op"], r["pass"]) for r in rows})
    for op, ps in series:
        sel = [r for r in rows if (r["op"], r["pass"]) == (op, ps)]
        x = [r["T"] * r["k"] * r["H"] for r in sel]
        axes[0].scatter(x, [r["pct_copy"] for r in sel], s=12, label=f"{op} {ps}")
        axes[1].scatter(x, [r["speedup"] for r in sel], s=12, label=f"{op} {ps}")
    axes[0].axhline(80, color="gray", ls="--", lw=1)
    axes[0].set(xscale="log", xlabel="T·k·H", ylabel=f"% of copy BW ({copy_gbs:.0f} GB/s)")
    axes[1].axhline(3, color="gray", ls="--", lw=1)
    axes[1].set(xscale="log", yscale="log", xlabel="T·k·H", ylabel="speed-up over torch-composed")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("moekit permute / unpermute (bf16)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
