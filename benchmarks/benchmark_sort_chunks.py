"""``sort_chunks_by_index`` forward + backward against torch compositions and the copy floor.

    python benchmarks/benchmark_sort_chunks.py --out bench_out
    python benchmarks/benchmark_sort_chunks.py --smoke --out /tmp/smoke   # tiny, CPU or GPU

After an expert-parallel all-to-all a rank holds its rows as ``[source rank][local expert]``
chunks; ``sort_chunks_by_index`` regroups them ``[local expert][source rank]`` (rows and their
probs), with chunk sizes that stay on the device. Shapes: the rows one rank of an EP8 group
receives for the Qwen3-30B-A3B, DeepSeek-V3 and Mixtral layers (T tokens per rank × top-k,
C = 8 ranks × local experts), skewed chunk sizes, and a decode-sized case. Contenders, each
forward (rows and probs) + ``torch.autograd.grad`` of both:

  moekit        moekit.ops.sort_chunks_by_index
  torch index   the same reorder in device-only torch ops: each output row's source row from
                ``searchsorted`` over the chunk ends, then ``index_select`` (no host sync)
  torch split   Megatron-Core's form: ``torch.split`` by host split sizes, reorder, ``cat``
                (the sizes read back to the host: one sync per call)

Timing: median of ``triton.testing.do_bench`` (L2 flushed, back-to-back eager calls) and a
CUDA graph of 20 calls (not for ``torch split``, whose host read-back cannot be captured). The
floor is the bytes that must move (rows read and written, forward and backward, bf16; the probs
in fp32) at the device copy rate measured in the same run. Writes sort_chunks.json and a PNG.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
from common import (
    bench_ms,
    copy_gb_per_s,
    error_line,
    graph_us,
    host_ms,
    pyplot,
    save_figure,
    write_json,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run from a checkout

from moekit.ops import sort_chunks_by_index

# name: (rows N, hidden H, ranks, local experts)
SHAPES = {
    "qwen3_30b_a3b_ep8": (131072, 2048, 8, 16),
    "deepseek_v3_ep8": (65536, 7168, 8, 32),
    "mixtral_ep8": (16384, 4096, 8, 1),
    "decode_qwen3_ep8": (512, 2048, 8, 16),
}
SMOKE_SHAPES = {"smoke": (96, 32, 2, 3)}


def chunk_case(N, H, ranks, local, device, dtype, seed=0):
    """Rows ``[N, H]``, probs ``[N]``, skewed chunk sizes ``[ranks·local]`` summing to N, and
    the ``[expert][rank]`` order of the ``[rank][expert]`` chunks."""
    g = torch.Generator().manual_seed(seed)
    C = ranks * local
    share = torch.distributions.Gamma(0.6, 1.0).sample((C,))
    sizes = torch.floor(share / share.sum() * N).to(torch.int64)
    sizes[torch.argmax(sizes)] += N - int(sizes.sum())
    order = torch.arange(C).view(ranks, local).t().reshape(-1)
    x = torch.randn(N, H, generator=g).to(device, dtype).requires_grad_()
    probs = torch.rand(N, generator=g).to(device).requires_grad_()
    return x, probs, sizes.to(device), order.to(device)


def torch_index_sort(x, probs, sizes, order):
    """Device-only torch: source row of every output row, then a gather."""
    ends = sizes.cumsum(0)
    in_starts = ends - sizes
    out_sizes = sizes[order]
    out_ends = out_sizes.cumsum(0)
    rows = torch.arange(x.shape[0], device=x.device)
    j = torch.searchsorted(out_ends, rows, right=True).clamp_max(sizes.shape[0] - 1)
    src = in_starts[order][j] + rows - (out_ends - out_sizes)[j]
    src = torch.where(rows < out_ends[-1], src, rows)  # rows past the chunks stay in place
    return x.index_select(0, src), probs.index_select(0, src)


def torch_split_sort(x, probs, sizes, order):
    """Megatron-Core's form: host split sizes, reorder, concatenate."""
    split = sizes.tolist()
    rest = x.shape[0] - sum(split)
    xs, ps = x.split([*split, rest]), probs.split([*split, rest])
    idx = [*order.tolist(), len(split)]
    return torch.cat([xs[i] for i in idx]), torch.cat([ps[i] for i in idx])


def steps(x, probs, sizes, order) -> dict:
    dy = torch.randn_like(x)
    dp = torch.randn_like(probs)

    def step(fn):
        def run():
            y, p = fn(x, probs, sizes, order)
            return torch.autograd.grad([y, p], [x, probs], [dy, dp])

        return run

    return {
        "moekit": step(lambda *a: sort_chunks_by_index(a[0], a[2], a[3], a[1])),
        "torch_index": step(torch_index_sort),
        "torch_split": step(torch_split_sort),
    }


def check(fns: dict) -> None:
    """Every contender gives moekit's rows, probs and gradients."""
    want = [fns["moekit"]()]
    for name in ("torch_index", "torch_split"):
        for a, b in zip(fns[name](), want[0]):
            if not torch.equal(a, b):
                raise AssertionError(f"{name} differs from moekit")


def run_shape(name, spec, cuda, device, dtype, copy_gbs) -> dict:
    N, H, ranks, local = spec
    x, probs, sizes, order = chunk_case(N, H, ranks, local, device, dtype)
    fns = steps(x, probs, sizes, order)
    check(fns)
    res = {"shape": name, "N": N, "H": H, "chunks": ranks * local}
    time_fn = (lambda f: bench_ms(f, warmup=10, rep=50)) if cuda else host_ms
    for c, fn in fns.items():
        try:
            res[f"{c}_us"] = time_fn(fn) * 1e3
        except Exception as exc:
            res[f"{c}_us"], res[f"{c}_error"] = math.nan, error_line(exc)
        if cuda and c != "torch_split":
            res[f"{c}_graph_us"] = graph_us(fn)
    nbytes = 2 * (2 * N * H * x.element_size() + 2 * N * 4)  # forward and backward
    res["floor_us"] = nbytes / copy_gbs / 1e3 if cuda else math.nan
    res["speedup_vs_index"] = res["torch_index_us"] / res["moekit_us"]
    res["speedup_vs_split"] = res["torch_split_us"] / res["moekit_us"]
    return res


def table(rows) -> list[str]:
    head = (
        f"{'shape':<20}{'N':>8}{'H':>6}{'C':>5}{'moekit µs':>11}{'index µs':>10}{'split µs':>10}"
        f"{'× index':>9}{'× split':>9}{'graph m/i':>13}{'floor µs':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        graph = f"{r.get('moekit_graph_us', math.nan):.0f}/{r.get('torch_index_graph_us', math.nan):.0f}"
        lines.append(
            f"{r['shape']:<20}{r['N']:>8}{r['H']:>6}{r['chunks']:>5}{r['moekit_us']:>11.1f}"
            f"{r['torch_index_us']:>10.1f}{r['torch_split_us']:>10.1f}"
            f"{r['speedup_vs_index']:>9.2f}{r['speedup_vs_split']:>9.2f}{graph:>13}"
            f"{r['floor_us']:>10.1f}"
        )
    return lines


def plot(rows, path) -> None:
    try:
        plt = pyplot()
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(rows))
    for j, (label, key) in enumerate(
        (("moekit", "moekit_us"), ("torch index", "torch_index_us"),
         ("torch split", "torch_split_us"), ("copy floor", "floor_us"))
    ):  # fmt: skip
        ax.bar([i - 0.3 + 0.2 * j for i in xs], [r[key] for r in rows], 0.2, label=label)
    ax.set_yscale("log")
    ax.set_xticks(list(xs), [r["shape"] for r in rows], rotation=15)
    ax.set_ylabel("µs per forward + backward")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU too")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    copy_gbs = copy_gb_per_s(device) if cuda else math.nan
    print(f"device copy: {copy_gbs:.0f} GB/s", flush=True)
    rows = []
    for name, spec in (SMOKE_SHAPES if args.smoke else SHAPES).items():
        rows.append(run_shape(name, spec, cuda, device, dtype, copy_gbs))
    meta = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "dtype": str(dtype), "copy_gb_per_s": copy_gbs,
    }  # fmt: skip
    write_json(os.path.join(args.out, "sort_chunks.json"), {"meta": meta, "rows": rows},
               nan_as_null=True)  # fmt: skip
    plot(rows, os.path.join(args.out, "sort_chunks.png"))
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
