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

Timing: every measurement is a CUDA graph of many calls (so Python launch overhead is not timed),
cycling through enough copies of the inputs to exceed L2; the median over replays is reported.
Writes permute_bench.json and permute_bench.png under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from moekit.kernels.permute import routing_metadata
from moekit.ops.permute import permute, unpermute
from moekit.reference import permute as ref

DEVICE = "cuda"
L2_BYTES = 50 * 2**20  # H100 L2; inputs are rotated until a round of calls touches 4× this.


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


def bench_us(fns: list, rep_ms: float) -> float:
    """Median time per call (µs) of a CUDA graph cycling through ``fns``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # compile kernels and warm allocators outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    def graph_of(n):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(n):
                fns[i % len(fns)]()
        return g

    def replay_ms(g):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    g = graph_of(len(fns))
    g.replay()
    est = min(replay_ms(g) for _ in range(3)) / len(fns)
    del g
    n = max(len(fns), min(2000, int(rep_ms / max(est, 1e-3))))
    n = -(-n // len(fns)) * len(fns)
    g = graph_of(n)
    g.replay()
    times = [replay_ms(g) / n for _ in range(5)]
    del g
    return statistics.median(times) * 1e3


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


def measure_config(T, H, E, k, align, rep_ms, dtype=torch.bfloat16):
    """µs of every (op, pass, impl) for one shape, plus the bytes each pass must move."""
    b = torch.empty((), dtype=dtype).element_size()
    tk = T * k
    R = tk + (min(E, tk) * (align - 1) if align else 0)
    n_rot = max(1, min(4, math.ceil(4 * L2_BYTES / ((T + R) * H * b))))
    sets = []
    for _ in range(n_rot):
        idx, probs = routing(T, E, k)
        hidden = torch.randn(T, H, device=DEVICE, dtype=dtype, requires_grad=True)
        sets.append((idx, probs.requires_grad_(True), hidden))
    meta = tk * (8 + 4 + 4 + 4) + R * 4  # indices, row_index, probs in/out
    bytes_ = {
        ("permute", "fwd"): (T + R) * H * b + meta,
        ("permute", "bwd"): (tk + T) * H * b + meta,
        ("unpermute", "fwd"): (tk + T) * H * b + meta,
        ("unpermute", "bwd"): (T + tk + R) * H * b + meta,
    }
    res = {}

    def run(label, make_permute, make_unpermute):
        """make_permute(set) -> (state, fwd outputs); make_unpermute(state) -> y."""
        fwd_p = [lambda s=s: make_permute(s) for s in sets]
        res[("permute", "fwd", label)] = bench_us(fwd_p, rep_ms)
        states = [make_permute(s) for s in sets]
        grads = [(torch.randn_like(st["rows"]), torch.randn_like(st["probs"])) for st in states]
        bwd_p = [
            lambda s=s, st=st, g=g: torch.autograd.grad(
                (st["rows"], st["probs"]), (s[2], s[1]), g, retain_graph=True
            )
            for s, st, g in zip(sets, states, grads)
        ]
        res[("permute", "bwd", label)] = bench_us(bwd_p, rep_ms)
        del bwd_p, grads
        eouts = [torch.randn_like(st["rows"]).requires_grad_(True) for st in states]
        fwd_u = [lambda st=st, eo=eo: make_unpermute(st, eo) for st, eo in zip(states, eouts)]
        res[("unpermute", "fwd", label)] = bench_us(fwd_u, rep_ms)
        ys = [make_unpermute(st, eo) for st, eo in zip(states, eouts)]
        gys = [torch.randn_like(y) for y in ys]
        bwd_u = [
            lambda st=st, eo=eo, y=y, gy=gy: torch.autograd.grad(
                y, (eo, st["probs"]), gy, retain_graph=True
            )
            for st, eo, y, gy in zip(states, eouts, ys, gys)
        ]
        res[("unpermute", "bwd", label)] = bench_us(bwd_u, rep_ms)

    def ours_p(s, a=align):
        d = permute(s[2], s[0], s[1], num_experts=E, align=a)
        return {"rows": d.hidden, "probs": d.probs, "d": d}

    run("ours", ours_p, lambda st, eo: unpermute(eo, st["d"]))

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
            d = st["d"]
            packed = eo.index_select(0, st["dst"])
            # Unpad the probs too, so their gradient also crosses the separate pass.
            d2 = dataclasses.replace(d, probs=st["probs"].index_select(0, st["dst"]))
            return unpermute(packed, d2)

        run("sep-pad", sep_p, sep_u)
    return res, bytes_, R


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out", help="directory for JSON and PNG")
    ap.add_argument("--quick", action="store_true", help="a reduced grid (a few shapes)")
    ap.add_argument("--rep-ms", type=float, default=5.0, help="GPU time per measurement")
    ap.add_argument("--skip-check", action="store_true", help="skip the correctness pass")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    t_start = time.time()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")

    failures = []
    if not args.skip_check:
        print("correctness (bf16 vs reference):")
        failures = check_correctness()

    copy_gbs = copy_bandwidth(args.rep_ms)
    print(f"copy bandwidth: {copy_gbs:.0f} GB/s (1 GiB device-to-device, read + write)")

    idx, _ = routing(65536, 256, 8)
    meta_us = {
        a: bench_us([lambda a=a: routing_metadata(idx, 256, a)], args.rep_ms) for a in (1, 128)
    }
    print(
        f"metadata T=65536 E=256 k=8: {meta_us[1]:.1f} µs (align 128: {meta_us[128]:.1f} µs), "
        "target ≤ 30 µs"
    )

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
    rows = []
    header = (
        f"{'T':>6} {'H':>5} {'E':>4} {'k':>2} {'align':>5} {'op':>9} {'pass':>4} "
        f"{'ours µs':>9} {'GB/s':>6} {'%copy':>6} {'torch µs':>9} {'×torch':>7} "
        f"{'sep-pad µs':>10} {'pad ovh%':>8}"
    )
    print(header)
    no_align = {}
    for T, H, (E, k), align in grid:
        res, bytes_, R = measure_config(T, H, E, k, align, args.rep_ms)
        for op, ps in itertools.product(("permute", "unpermute"), ("fwd", "bwd")):
            ours = res[(op, ps, "ours")]
            base = res[(op, ps, "torch")]
            sep = res.get((op, ps, "sep-pad"))
            gbs = bytes_[(op, ps)] / (ours * 1e-6) / 1e9
            key = (T, H, E, k, op, ps)
            if align is None:
                no_align[key] = ours
            ovh = (ours / no_align[key] - 1) * 100 if align and key in no_align else None
            row = {
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
                "pct_copy": 100 * gbs / copy_gbs,
                "torch_us": base,
                "speedup": base / ours,
                "sep_pad_us": sep,
                "pad_overhead_pct": ovh,
                "bytes": bytes_[(op, ps)],
            }
            rows.append(row)
            print(
                f"{T:>6} {H:>5} {E:>4} {k:>2} {align or '-':>5} {op:>9} {ps:>4} "
                f"{ours:>9.1f} {gbs:>6.0f} {row['pct_copy']:>5.0f}% {base:>9.1f} "
                f"{base / ours:>6.1f}× {'' if sep is None else f'{sep:.1f}':>10} "
                f"{'' if ovh is None else f'{ovh:+.1f}':>8}",
                flush=True,
            )
        torch.cuda.empty_cache()

    big = [r for r in rows if r["T"] * r["k"] >= 32768 and r["H"] >= 2048]
    summary = {
        "copy_gbs": copy_gbs,
        "metadata_us": meta_us[1],
        "metadata_align128_us": meta_us[128],
        "min_pct_copy_big": min((r["pct_copy"] for r in big), default=None),
        "min_speedup": min(r["speedup"] for r in rows),
        "max_pad_overhead_pct": max(
            (r["pad_overhead_pct"] for r in rows if r["pad_overhead_pct"] is not None),
            default=None,
        ),
        "correctness_failures": failures,
        "seconds": time.time() - t_start,
    }
    print("\nsummary (targets: ≥80% copy BW where T·k ≥ 32K and H ≥ 2048; ≥3× torch;")
    print("         padding ≤ 5% over no padding; metadata ≤ 30 µs)")
    for key, val in summary.items():
        print(f"  {key}: {val if not isinstance(val, float) else round(val, 2)}")
    (out_dir / "permute_bench.json").write_text(
        json.dumps(
            {"device": torch.cuda.get_device_name(), "summary": summary, "rows": rows}, indent=1
        )
    )
    plot(rows, copy_gbs, out_dir / "permute_bench.png")
    print(f"wrote {out_dir / 'permute_bench.json'} and {out_dir / 'permute_bench.png'}")
    return 1 if failures else 0


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
