"""Where the blockwise FP8 weight gradient (ragged over tokens, a promotion per 128 tokens) can
land in Triton 3.6, against moekit's bf16 ragged-K GEMM of the same run.

    PYTHONPATH=. python experiments/fp8_wgrad_probe.py

Variants of one persistent kernel (c[e] = a[:, tokens of e] @ b[:, tokens of e]ᵀ, both e4m3
[M, T] / [N, T], scales [T/128, M] / [T/128, N]):
  0  no scales: the tensor-core ceiling of the structure;
  1  ``acc += dot · (sa ⊗ sb)`` per 128 tokens (moekit's kernel);
  2  two token blocks per step, both products promoted in one add;
  3  the promotion of block k issued after block k+1's dot (a lag of one).
Each with pointer or TMA stores of a bf16 result, over a few tiles. TFLOP/s, do_bench medians;
the error of variants 1–3 against the fp32 product of the dequantized operands.
"""

from __future__ import annotations

import itertools
from functools import partial

import torch
import triton
import triton.language as tl
from tabulate import tabulate
from triton.testing import do_bench

from moekit.ops.grouped_gemm import ragged_k
from moekit.runtime.device import ensure_scratch_allocator, num_sms

SHAPES = {  # tokens (rows), E, M (the gradient's rows), N: fc1's wgrad [2F, H], fc2's [H, F]
    "qwen3 fc1": (65536, 128, 1536, 2048), "qwen3 fc2": (65536, 128, 2048, 768),
    "dsv3 fc1": (65536, 32, 4096, 7168), "mixtral fc1": (16384, 8, 28672, 4096),
}  # fmt: skip
TILES = [(128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (256, 128, 8, 3)]


@triton.jit
def _promote(acc, p, sa_ptr, sb_ptr, t0, rows, cols, M, N, BK: tl.constexpr):
    sa = tl.load(sa_ptr + (t0 // BK) * M + rows, mask=rows < M, other=0.0)
    sb = tl.load(sb_ptr + (t0 // BK) * N + cols, mask=cols < N, other=0.0)
    return acc + p * sa[:, None] * sb[None, :]


@triton.jit
def _wgrad(
    a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, offs_ptr, M, N, T, E,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, MODE: tl.constexpr, TMA_C: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_expert = num_m * num_n
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, T], [T, 1], [BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, [N, T], [T, 1], [BN, BK])
    c_desc = tl.make_tensor_descriptor(c_ptr, [E * M, N], [N, 1], [BM, BN])
    offs_e = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + offs_e, mask=offs_e < E, other=0)
    starts = tl.load(offs_ptr + offs_e - 1, mask=(offs_e < E) & (offs_e > 0), other=0)
    for tile in tl.range(pid, E * per_expert, NUM_PROGRAMS):
        e = tile // per_expert
        off_m = (tile % per_expert) // num_n * BM
        off_n = (tile % per_expert) % num_n * BN
        start = tl.sum(tl.where(offs_e == e, starts, 0), axis=0)
        end = tl.sum(tl.where(offs_e == e, ends, 0), axis=0)
        nk = (end - start) // BK
        rows = off_m + tl.arange(0, BM)
        cols = off_n + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if MODE == 0:
            for ki in range(nk):
                t0 = start + ki * BK
                acc = tl.dot(a_desc.load([off_m, t0]), b_desc.load([off_n, t0]).T, acc)
        elif MODE == 1:
            for ki in range(nk):
                t0 = start + ki * BK
                p = tl.dot(a_desc.load([off_m, t0]), b_desc.load([off_n, t0]).T)
                acc = _promote(acc, p, sa_ptr, sb_ptr, t0, rows, cols, M, N, BK)
        elif MODE == 2:
            for kj in range(nk // 2):
                t0 = start + 2 * kj * BK
                p0 = tl.dot(a_desc.load([off_m, t0]), b_desc.load([off_n, t0]).T)
                p1 = tl.dot(a_desc.load([off_m, t0 + BK]), b_desc.load([off_n, t0 + BK]).T)
                acc = _promote(acc, p0, sa_ptr, sb_ptr, t0, rows, cols, M, N, BK)
                acc = _promote(acc, p1, sa_ptr, sb_ptr, t0 + BK, rows, cols, M, N, BK)
            if nk % 2 == 1:
                t0 = end - BK
                p = tl.dot(a_desc.load([off_m, t0]), b_desc.load([off_n, t0]).T)
                acc = _promote(acc, p, sa_ptr, sb_ptr, t0, rows, cols, M, N, BK)
        else:
            prev = tl.zeros((BM, BN), dtype=tl.float32)
            t_prev = start
            for ki in range(nk):
                t0 = start + ki * BK
                p = tl.dot(a_desc.load([off_m, t0]), b_desc.load([off_n, t0]).T)
                acc = _promote(acc, prev, sa_ptr, sb_ptr, t_prev, rows, cols, M, N, BK)
                prev = p
                t_prev = t0
            acc = _promote(acc, prev, sa_ptr, sb_ptr, t_prev, rows, cols, M, N, BK)
        if TMA_C:
            c_desc.store([e * M + off_m, off_n], acc.to(tl.bfloat16))
        else:
            ptrs = c_ptr + (e * M + rows)[:, None].to(tl.int64) * N + cols[None, :]
            tl.store(ptrs, acc.to(tl.bfloat16), mask=(rows[:, None] < M) & (cols[None, :] < N))


def _run(a, b, sa, sb, c, offs, E, tile, mode, tma_c):
    bm, bn, warps, stages = tile
    ensure_scratch_allocator()
    programs = num_sms(a)
    _wgrad[(programs,)](
        a, b, sa, sb, c, offs, a.shape[0], b.shape[0], a.shape[1], E,
        BM=bm, BN=bn, BK=128, BLOCK_E=max(16, triton.next_power_of_2(E)), NUM_PROGRAMS=programs,
        MODE=mode, TMA_C=tma_c, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def main() -> None:
    rows = []
    for name, shape in SHAPES.items():
        rows += _shape_rows(name, *shape)
    print(tabulate(rows, headers=["shape", "mode", "tile bm,bn,warps,stages", "tma c",
                                  "TFLOP/s", "× bf16", "rel err e0"]))  # fmt: skip


def _shape_rows(name: str, T: int, E: int, M: int, N: int) -> list:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    af = torch.randn(M, T, device="cuda", generator=g)
    bf = torch.randn(N, T, device="cuda", generator=g)
    a, b = af.to(torch.float8_e4m3fn), bf.to(torch.float8_e4m3fn)
    sa = torch.rand(T // 128, M, device="cuda", generator=g) + 0.5
    sb = torch.rand(T // 128, N, device="cuda", generator=g) + 0.5
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (T // E)
    flops = 2 * T * M * N
    dy = torch.randn(T, M, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(T, N, device="cuda", dtype=torch.bfloat16, generator=g)
    bf16 = do_bench(lambda: ragged_k(dy.t(), x, offs, torch.bfloat16))
    rows.append([name, "moekit bf16", "-", "-", round(flops / bf16 / 1e9), 1.0, "-"])
    # fp32 reference of the dequantized operands, one expert (the first)
    n0 = T // E
    ad = a[:, :n0].float() * sa[: n0 // 128].repeat_interleave(128, 0).t()
    bd = b[:, :n0].float() * sb[: n0 // 128].repeat_interleave(128, 0).t()
    want = ad @ bd.t()
    for mode, tile, tma_c in itertools.product(range(4), TILES, (False, True)):
        c = torch.empty(E, M, N, device="cuda", dtype=torch.bfloat16)
        try:
            ms = do_bench(partial(_run, a, b, sa, sb, c, offs, E, tile, mode, tma_c))
        except Exception as exc:  # a tile the compiler refuses (shared memory)
            rows.append([name, mode, tile, tma_c, type(exc).__name__, "-", "-"])
            continue
        err = "-"
        if mode:
            err = f"{((c[0].float() - want).abs().max() / want.abs().max()).item():.1e}"
        rows.append([name, mode, tile, tma_c, round(flops / ms / 1e9),
                     round(bf16 / ms, 2), err])  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
