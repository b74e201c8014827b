"""FP8, blockwise and rowwise: quantization against the copy rate, the grouped GEMM against bf16
and torch.

    python benchmarks/benchmark_fp8.py --out bench_out [--smoke]

Quantization of an MoE layer's bf16 tensors, blockwise (1×128, 128×1 for wgrad, 128×128
weights) and rowwise: moekit against the same math in eager torch, GB/s moved against the copy
rate. Grouped GEMM (each layer's fc1), TFLOP/s: FP8 blockwise and rowwise, bf16, and torch's
rowwise ``_scaled_grouped_mm``; ceiling: dense FP8 ``_scaled_mm`` at 8192³. do_bench medians.
"""

from __future__ import annotations

import math
from functools import partial

import common as bc
import torch

from moekit.ops import grouped_mm, quantize_fp8
from moekit.ops.fp8_gemm import grouped_mm_fp8
from moekit.reference.fp8 import quantize_fp8_ref, scale_shape

# name: (shape, axis, block, transpose); block None: rowwise
SHAPES = {
    "qwen3 x [65536, 2048] row": ((65536, 2048), "row", 128, False),
    "qwen3 dy [65536, 2048] col": ((65536, 2048), "col", 128, False),
    "qwen3 w1 [128, 1536, 2048] both": ((128, 1536, 2048), "both", 128, False),
    "dsv3 x [32768, 7168] row": ((32768, 7168), "row", 128, False),
    "dsv3 dy [32768, 7168] col": ((32768, 7168), "col", 128, False),
    "dsv3 w1 [32, 4096, 7168] both": ((32, 4096, 7168), "both", 128, False),
    "qwen3 x [65536, 2048] rowwise": ((65536, 2048), "row", None, False),
    "qwen3 w1 [128, 1536, 2048] rowwise": ((128, 1536, 2048), "row", None, False),
    "qwen3 w1 dgrad [128, 2048, 1536] rowwise": ((128, 1536, 2048), "col", None, True),
    "dsv3 x [32768, 7168] rowwise": ((32768, 7168), "row", None, False),
    "mixtral w1 dgrad [8, 4096, 28672] rowwise": ((8, 28672, 4096), "col", None, True),
    "mixtral dy [16384, 28672] rowwise": ((16384, 28672), "row", None, False)}  # fmt: skip
SMOKE_SHAPES = {
    "smoke row": ((96, 160), "row", 128, False), "smoke both": ((2, 96, 160), "both", 128, False),
    "smoke rowwise": ((96, 160), "row", None, False),
    "smoke rowwise dgrad": ((2, 96, 160), "col", None, True)}  # fmt: skip
GEMM_SHAPES = {  # name: (rows, E, K, N)
    "qwen3_30b_a3b fc1": (65536, 128, 2048, 1536), "olmoe fc1": (32768, 64, 2048, 2048),
    "deepseek_v3_ep8 fc1": (32768, 32, 7168, 4096), "mixtral fc1": (16384, 8, 4096, 28672),
}  # fmt: skip
GEMM_SMOKE = {"smoke gemm": (256, 2, 256, 128)}


def run_shape(name: str, spec: tuple, cuda: bool, device, copy_gbs: float) -> dict:
    shape, axis, block, transpose = spec
    x = torch.randn(*shape, device=device, dtype=torch.bfloat16 if cuda else torch.float32)

    def torch_math():  # the reference in eager torch, transposed copy included
        data, scale = quantize_fp8_ref(x, axis, block, False)
        return (data.transpose(-2, -1).contiguous() if transpose else data), scale

    fns = {"moekit": lambda: quantize_fp8(x, axis=axis, block=block, transpose=transpose),
           "torch": torch_math}  # fmt: skip
    got, (data, scale) = fns["moekit"](), quantize_fp8_ref(x.cpu(), axis, block, False)
    got_data = got.data.transpose(-2, -1) if transpose else got.data
    same = got_data.cpu().view(torch.uint8).equal(data.view(torch.uint8))  # bits, -0 too
    if not (same and got.scale.cpu().equal(scale)):  # the oracle: the reference on the CPU
        raise AssertionError(f"{name}: moekit differs from the reference")
    res = {"shape": name, "axis": axis, "block": block or "rowwise"}
    bc.measure(fns, {"us": bc.eager_timer(cuda, warmup=10, rep=50, unit=1e3)}, 1, res)
    nbytes = x.numel() * (x.element_size() + 1) + 4 * math.prod(scale_shape(x.shape, axis, block))
    for c in fns:
        res[f"{c}_gbs"] = nbytes / res[f"{c}_us"] / 1e3
    res["copy_gbs"] = copy_gbs
    res["of_copy"] = res["moekit_gbs"] / copy_gbs if cuda else math.nan
    return bc.ratios(res, "us", {"speedup_vs_torch": ("torch", "moekit")})


def run_gemm(name: str, spec: tuple, cuda: bool, device, dense_tflops: float) -> dict:
    T, E, K, N = spec
    offsets = torch.full((E,), T // E, device=device).cumsum(0).to(torch.int32)
    dt = torch.bfloat16 if cuda else torch.float32
    x, w = torch.randn(T, K, device=device, dtype=dt), torch.randn(E, N, K, device=device, dtype=dt)
    xq, wq = quantize_fp8(x), quantize_fp8(w, axis="both")
    xr, wr = quantize_fp8(x, block=None), quantize_fp8(w, block=None)  # per row, per channel
    fns = {"fp8": lambda: grouped_mm_fp8(xq, wq, offsets),
           "rowwise": lambda: grouped_mm_fp8(xr, wr, offsets),
           "bf16": lambda: grouped_mm(x, w.transpose(1, 2), offsets)}  # fmt: skip
    res = {"shape": name, "T": T, "E": E, "K": K, "N": N, "dense_fp8_tflops": dense_tflops}
    if cuda:  # torch's rowwise FP8 grouped GEMM on the same operands and scales
        sx, sw = xr.scale.view(T), wr.scale.view(E, N)
        fns["torch_fp8"] = partial(torch._scaled_grouped_mm, xr.data, wr.data.transpose(1, 2),
                                   sx, sw, offs=offsets, out_dtype=torch.bfloat16)  # fmt: skip
        ours, theirs = fns["rowwise"]().float(), fns["torch_fp8"]().float()
        res["rowwise_vs_torch"] = ((ours - theirs).norm() / theirs.norm()).item()
    bc.measure(fns, {"ms": bc.eager_timer(cuda)}, 1, res, warm=True)
    for c in ("fp8", "rowwise", "bf16", "torch_fp8"):
        res[f"{c}_tflops"] = 2 * T * K * N / res.get(f"{c}_ms", math.nan) / 1e9
    return bc.ratios(res, "ms", {
        "x_bf16": ("bf16", "fp8"), "x_torch_fp8": ("torch_fp8", "fp8"),
        "rowwise_x_bf16": ("bf16", "rowwise"), "rowwise_x_torch_fp8": ("torch_fp8", "rowwise"),
        "rowwise_x_blockwise": ("fp8", "rowwise")})  # fmt: skip


def dense_fp8_tflops(n: int = 8192) -> float:
    """The ceiling: dense FP8 rowwise ``torch._scaled_mm`` at n³."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    ms = bc.bench_ms(lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16))
    return 2 * n**3 / ms / 1e9


GEMM_COLUMNS = [
    "shape", ("blockwise TF/s", "fp8_tflops"), ("rowwise TF/s", "rowwise_tflops"),
    ("bf16 TF/s", "bf16_tflops"), ("torch rowwise TF/s", "torch_fp8_tflops"),
    ("blockwise × bf16", "x_bf16"), ("rowwise × bf16", "rowwise_x_bf16"),
    ("rowwise × torch", "rowwise_x_torch_fp8"), ("dense fp8 TF/s", "dense_fp8_tflops")]  # fmt: skip

COLUMNS = [
    "shape", ("block", "block"), ("moekit µs", "moekit_us"), ("torch µs", "torch_us"), ("× torch", "speedup_vs_torch"),
    ("moekit GB/s", "moekit_gbs"), ("copy GB/s", "copy_gbs"), ("of copy", "of_copy")]  # fmt: skip


def main() -> None:
    args = bc.parser(__doc__).parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    copy_gbs = bc.copy_gb_per_s(device) if cuda else math.nan
    bc.log(f"device copy: {copy_gbs:.0f} GB/s")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    rows, _, failed = bc.run_cases(bc.per_shape(run_shape, shapes, cuda, device, copy_gbs))
    dense = dense_fp8_tflops() if cuda else math.nan
    bc.log(f"dense FP8 rowwise _scaled_mm: {dense:.0f} TFLOP/s")
    gemm_shapes = GEMM_SMOKE if args.smoke else GEMM_SHAPES
    gemm, _, failed_gemm = bc.run_cases(bc.per_shape(run_gemm, gemm_shapes, cuda, device, dense))
    meta = bc.meta(cuda, copy_gb_per_s=copy_gbs, failed={**failed, **failed_gemm})
    series = {"moekit": "moekit_gbs", "torch": "torch_gbs", "copy": "copy_gbs"}
    panels = [bc.bars(rows, series, "GB/s moved (x read, e4m3 + scales written)"),
              bc.bars(gemm, {"moekit fp8 blockwise": "fp8_tflops",
                             "moekit fp8 rowwise": "rowwise_tflops", "moekit bf16": "bf16_tflops",
                             "torch fp8 rowwise": "torch_fp8_tflops",
                             "dense fp8": "dense_fp8_tflops"}, "TFLOP/s")]  # fmt: skip
    data = {"meta": meta, "rows": rows, "gemm": gemm}
    bc.finish(args.out, "fp8", data, COLUMNS, panels, "", ".2f")
    bc.log(bc.table(gemm, GEMM_COLUMNS, ".2f"))


if __name__ == "__main__":
    main()
