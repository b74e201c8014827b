"""How far the FP8 MLP's activation kernels sit from the copy rate, over their tile configs.

    PYTHONPATH=. python experiments/fp8_act_sweep.py

Per shape (the layer's permuted rows, align 128) and config: forward and backward µs, the
bytes each must move (reads of h, da, probs; writes of both e4m3 copies and their scales) as
GB/s, and whether its bytes equal the default configs'. The copy rate of the same run is the
ceiling. A row per config as it is measured, one table last.
"""

from __future__ import annotations

import dataclasses
import itertools
from functools import partial

import torch
from tabulate import tabulate
from triton.testing import do_bench

from moekit.activations import resolve_activation
from moekit.kernels.fp8_mlp import Fp8Out, act_bwd_fp8, act_fp8
from moekit.tuning.fp8 import ACT_BWD_TILE, ACT_TILE

SHAPES = {"qwen3": (65536, 128, 768), "mixtral": (16384, 8, 14336)}
CONFIGS = [  # rows per chunk × warps
    dataclasses.replace(ACT_TILE, chunk=c, num_warps=w)
    for c, w in itertools.product((16, 32, 64), (4, 8, 16))
]


def _out(R: int, C: int) -> Fp8Out:
    u8 = dict(dtype=torch.uint8, device="cuda")
    f32 = dict(dtype=torch.float32, device="cuda")
    return Fp8Out(torch.empty(R, C, **u8), torch.empty(R, C // 128, **f32),
                  torch.empty(C, R, **u8), torch.empty(R // 128, C, **f32))  # fmt: skip


def main() -> None:
    act = resolve_activation("swiglu")
    x = torch.empty(1 << 28, dtype=torch.bfloat16, device="cuda")
    copy = 2 * x.numel() * 2 / do_bench(lambda: x.clone(), rep=200) / 1e6
    rows = []
    for name, shape in SHAPES.items():
        rows += _shape_rows(name, *shape, act)
    print(f"copy {copy:.0f} GB/s")
    print(tabulate(rows, headers=["shape", "chunk", "warps", "fwd µs", "fwd GB/s", "bwd µs",
                                  "bwd GB/s", "same bytes"]))  # fmt: skip


def _shape_rows(name: str, R: int, E: int, F: int, act) -> list:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(R, 2 * F, device="cuda", dtype=torch.bfloat16, generator=g)
    da = torch.randn(R, F, device="cuda", dtype=torch.bfloat16, generator=g)
    probs = torch.rand(R, device="cuda", generator=g)
    offsets = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (R // E)
    fwd_bytes = R * 2 * F * 2 + R * 4 + 2 * R * F * (1 + 4 / 128)
    bwd_bytes = R * 2 * F * 2 + R * F * 2 + R * 4 + 2 * R * 2 * F * (1 + 4 / 128) + 4 * R
    ref_f, ref_b = _out(R, F), _out(R, 2 * F)
    part = torch.empty(F // 128, R, device="cuda")
    act_fp8(h, probs, offsets, ref_f, act, None, False, ACT_TILE)
    act_bwd_fp8(h, da, probs, offsets, ref_b, part, act, None, False, ACT_BWD_TILE)
    ref_part = part.clone()
    for cfg in CONFIGS:
        of, ob = _out(R, F), _out(R, 2 * F)
        try:
            tf = do_bench(partial(act_fp8, h, probs, offsets, of, act, None, False, cfg))
            tb = do_bench(partial(act_bwd_fp8, h, da, probs, offsets, ob, part, act, None, False,
                                  cfg))  # fmt: skip
        except Exception as exc:  # a config the compiler refuses (shared memory, registers)
            err = type(exc).__name__
            rows.append([name, cfg.chunk, cfg.num_warps, "-", "-", "-", "-", err])
            continue
        same = (
            all(torch.equal(a, b) for a, b in zip(of, ref_f))
            and all(torch.equal(a, b) for a, b in zip(ob, ref_b))
            and torch.equal(part, ref_part)
        )
        rows.append([name, cfg.chunk, cfg.num_warps, round(tf * 1e3, 1),
                     round(fwd_bytes / tf / 1e6), round(tb * 1e3, 1),
                     round(bwd_bytes / tb / 1e6), same])  # fmt: skip
        print(*rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
