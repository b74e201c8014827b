"""``sort_chunks_by_index`` forward + backward against torch compositions and the copy floor.

    python benchmarks/benchmark_sort_chunks.py --out bench_out [--smoke]

An EP8 rank's ``[rank][local expert]`` chunks (skewed) by ``[expert][rank]``, against torch
index (searchsorted + index_select) and torch split (Megatron-Core's: host sizes, cat): do_bench
and a CUDA graph of 20 calls; floor: the bytes moved at the device copy rate.
"""

from __future__ import annotations

import math

import common as bc
import torch

from moekit.ops import sort_chunks_by_index

# name: (rows N, hidden H, ranks, local experts)
SHAPES = {"qwen3_30b_a3b_ep8": (131072, 2048, 8, 16), "deepseek_v3_ep8": (65536, 7168, 8, 32),
          "mixtral_ep8": (16384, 4096, 8, 1), "decode_qwen3_ep8": (512, 2048, 8, 16)}  # fmt: skip
SMOKE_SHAPES = {"smoke": (96, 32, 2, 3)}


def chunk_case(N: int, H: int, ranks: int, local: int, device, dtype, seed: int = 0):
    """Rows, probs, skewed chunk sizes summing to N, and the [expert][rank] chunk order."""
    g = torch.Generator().manual_seed(seed)
    sizes = bc.routing_counts(N, ranks * local, True, None)  # no idle chunk
    order = torch.arange(ranks * local).view(ranks, local).t().reshape(-1)
    x = torch.randn(N, H, generator=g).to(device, dtype).requires_grad_()
    probs = torch.rand(N, generator=g).to(device).requires_grad_()
    return x, probs, sizes.to(device), order.to(device)


def torch_index_sort(x, probs, sizes, order):
    """Device-only torch: source row of every output row, then a gather."""
    in_starts = sizes.cumsum(0) - sizes
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


def run_shape(name: str, spec: tuple, cuda: bool, device, dtype, copy_gbs: float) -> dict:
    N, H, ranks, local = spec
    x, probs, sizes, order = chunk_case(N, H, ranks, local, device, dtype)
    dy, dp = torch.randn_like(x), torch.randn_like(probs)
    step = lambda fn: lambda: torch.autograd.grad(fn(x, probs, sizes, order), [x, probs], [dy, dp])
    fns = {"moekit": step(lambda x, p, s, o: sort_chunks_by_index(x, s, o, p)),
           "torch_index": step(torch_index_sort), "torch_split": step(torch_split_sort)}  # fmt: skip
    want = fns["moekit"]()  # every contender gives moekit's rows, probs and gradients
    for c in ("torch_index", "torch_split"):
        if not all(torch.equal(a, b) for a, b in zip(fns[c](), want)):
            raise AssertionError(f"{c} differs from moekit")
    res = {"shape": name, "N": N, "H": H, "chunks": ranks * local}
    bc.measure(fns, {"us": bc.eager_timer(cuda, warmup=10, rep=50, unit=1e3)}, 1, res)
    if cuda:  # torch split's read-back cannot be captured
        bc.measure({c: fns[c] for c in list(fns)[:2]}, {"graph_us": bc.graph_us}, 1, res)
    nbytes = 2 * (2 * N * H * x.element_size() + 2 * N * 4)  # forward and backward
    res["floor_us"] = nbytes / copy_gbs / 1e3 if cuda else math.nan
    return bc.ratios(res, "us", {"speedup_vs_index": ("torch_index", "moekit"),
                                 "speedup_vs_split": ("torch_split", "moekit")})  # fmt: skip


COLUMNS = [
    "shape", "N", "H", ("C", "chunks"), ("moekit µs", "moekit_us"), ("index µs", "torch_index_us"),
    ("split µs", "torch_split_us"), ("× index", "speedup_vs_index"),
    ("× split", "speedup_vs_split"), ("graph moekit", "moekit_graph_us"),
    ("graph index", "torch_index_graph_us"), ("floor µs", "floor_us")]  # fmt: skip


def main() -> None:
    args = bc.parser(__doc__).parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    copy_gbs = bc.copy_gb_per_s(device) if cuda else math.nan
    bc.log(f"device copy: {copy_gbs:.0f} GB/s")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    rows, _, failed = bc.run_cases(bc.per_shape(run_shape, shapes, cuda, device, dtype, copy_gbs))
    meta = bc.meta(cuda, dtype=str(dtype), copy_gb_per_s=copy_gbs, failed=failed)
    series = {"moekit": "moekit_us", "torch index": "torch_index_us",
              "torch split": "torch_split_us", "copy floor": "floor_us"}  # fmt: skip
    panel = bc.bars(rows, series, "µs per forward + backward", logy=True)
    bc.finish(args.out, "sort_chunks", {"meta": meta, "rows": rows}, COLUMNS, [panel], "", ".1f")


if __name__ == "__main__":
    main()
