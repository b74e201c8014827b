"""FP8 blockwise quantization: moekit's kernel against the torch composition and the copy rate.

    python benchmarks/benchmark_fp8.py --out bench_out [--smoke]

Per tensor of an MoE layer (activations and output gradients 1×128 along the hidden size, the
wgrad operands 128×1 along the tokens, the experts' weights 128×128), bf16 in: moekit's
``quantize_fp8`` and the same math in eager torch (the reference), do_bench medians, in GB/s
of bytes that must move (read x, write the e4m3 data and the scales) against this run's device
copy rate (the ceiling). The FP8 grouped GEMM is not built yet: its ceiling figures are in
docs/fp8.md (experiments/fp8_gemm_probe.py).
"""

from __future__ import annotations

import math
from functools import partial

import common as bc
import torch

from moekit.ops import quantize_fp8
from moekit.reference.fp8 import quantize_fp8_ref, scale_shape

# name: (shape, axis)
SHAPES = {
    "qwen3 x [65536, 2048] row": ((65536, 2048), "row"),
    "qwen3 dy [65536, 2048] col": ((65536, 2048), "col"),
    "qwen3 w1 [128, 1536, 2048] both": ((128, 1536, 2048), "both"),
    "dsv3 x [32768, 7168] row": ((32768, 7168), "row"),
    "dsv3 dy [32768, 7168] col": ((32768, 7168), "col"),
    "dsv3 w1 [32, 4096, 7168] both": ((32, 4096, 7168), "both"),
}
SMOKE_SHAPES = {"smoke row": ((96, 160), "row"), "smoke both": ((2, 96, 160), "both")}


def run_shape(name: str, spec: tuple, cuda: bool, device, copy_gbs: float) -> dict:
    shape, axis = spec
    x = torch.randn(*shape, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    fns = {"moekit": lambda: quantize_fp8(x, axis=axis),
           "torch": lambda: quantize_fp8_ref(x, axis, 128, False)}  # fmt: skip
    got, (data, scale) = fns["moekit"](), quantize_fp8_ref(x.cpu(), axis, 128, False)
    same = got.data.cpu().view(torch.uint8).equal(data.view(torch.uint8))  # bits, -0 too
    if not (same and got.scale.cpu().equal(scale)):  # the oracle: the reference on the CPU
        raise AssertionError(f"{name}: moekit differs from the reference")
    res = {"shape": name, "axis": axis}
    bc.measure(fns, {"us": lambda f: bc.eager_timer(cuda, warmup=10, rep=50)(f) * 1e3}, 1, res)
    nbytes = x.numel() * (x.element_size() + 1) + 4 * math.prod(scale_shape(x.shape, axis, 128))
    for c in fns:
        res[f"{c}_gbs"] = nbytes / res[f"{c}_us"] / 1e3
    res["copy_gbs"] = copy_gbs
    res["of_copy"] = res["moekit_gbs"] / copy_gbs if cuda else math.nan
    return bc.ratios(res, "us", {"speedup_vs_torch": ("torch", "moekit")})


COLUMNS = [
    "shape", ("moekit µs", "moekit_us"), ("torch µs", "torch_us"), ("× torch", "speedup_vs_torch"),
    ("moekit GB/s", "moekit_gbs"), ("copy GB/s", "copy_gbs"), ("of copy", "of_copy"),
]  # fmt: skip


def main() -> None:
    args = bc.parser(__doc__).parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    copy_gbs = bc.copy_gb_per_s(device) if cuda else math.nan
    bc.log(f"device copy: {copy_gbs:.0f} GB/s")
    shapes = (SMOKE_SHAPES if args.smoke else SHAPES).items()
    rows, _, failed = bc.run_cases((n, partial(run_shape, n, s, cuda, device, copy_gbs))
                                   for n, s in shapes)  # fmt: skip
    meta = bc.meta(cuda, copy_gb_per_s=copy_gbs, failed=failed)
    series = {"moekit": "moekit_gbs", "torch": "torch_gbs", "copy": "copy_gbs"}
    panel = bc.bars(rows, series, "GB/s moved (x read, e4m3 + scales written)")
    bc.finish(args.out, "fp8", {"meta": meta, "rows": rows}, COLUMNS, [panel], "", ".2f")


if __name__ == "__main__":
    main()
