"""Probe: does a 192 x 256 tile (a 128-row and a 64-row dot sharing each B tile) beat 128 x 256?
And how far is the grouped kernel from a dense one on the same product?

Triton block shapes are powers of two, and 256 x 256 spills on sm_90 (the fp32 accumulator
alone is 128 registers per thread at 512 threads). Two dots, [128, BK] @ [BK, 256] and
[64, BK] @ [BK, 256], give a 192-row tile with one B load per k-step: 56 KB of operands per
6.3 MFLOP against 48 KB per 4.2 MFLOP, and a third fewer barrier waits and loop steps per
FLOP. On the H100 (session 16) it built to 249 registers without spills and 188 KB of shared
memory with 3 stages (the tile loop must not be flattened: with flatten=True ptxas
serialises the wgmmas), and ran 0.92-0.98x the 128 x 256 kernel.

Dense persistent matmuls (A [M, K] row-major, B [N, K] row-major, C [M, N] bf16) against
torch.mm, and moekit's ragged-M kernel on E experts of M / E rows each (uniform routing,
whole tiles) against torch._grouped_mm, interleaved rounds, TFLOP/s:

    python benchmarks/probe_tall_tile.py [--rounds 3] [--ab]

--ab times only the grouped kernel with expert bands (its default) and with global bands.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import triton
import triton.language as tl

from moekit.kernels import grouped_gemm as G
from moekit.kernels._runtime import ensure_scratch_allocator


@triton.jit
def _mm_one(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr, NUM_SMS: tl.constexpr, FLAT: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [BN, BK])
    c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [N, 1], [BM, BN])
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_SMS, flatten=FLAT):
        pm, pn = G._swizzle_tile(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(tl.cdiv(K, BK)):
            acc = tl.dot(a_desc.load([pm * BM, k * BK]), b_desc.load([pn * BN, k * BK]).T, acc)
        c_desc.store([pm * BM, pn * BN], acc.to(tl.bfloat16))


@triton.jit
def _mm_two(a_ptr, b_ptr, c_ptr, M, N, K, BN: tl.constexpr, BK: tl.constexpr,
            NUM_SMS: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    BM: tl.constexpr = 128
    BM2: tl.constexpr = 64
    TM: tl.constexpr = BM + BM2
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BM, BK])
    a2_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BM2, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [BN, BK])
    c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [N, 1], [BM2, BN // 2])
    tiles_m = tl.cdiv(M, TM)
    tiles_n = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_SMS):
        pm, pn = G._swizzle_tile(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc2 = tl.zeros((BM2, BN), dtype=tl.float32)
        for k in range(tl.cdiv(K, BK)):
            b = b_desc.load([pn * BN, k * BK]).T
            acc = tl.dot(a_desc.load([pm * TM, k * BK]), b, acc)
            acc2 = tl.dot(a2_desc.load([pm * TM + BM, k * BK]), b, acc2)
        # one [64, 128] staging shape for all six stores keeps the epilogue's shared memory small
        r0, r1 = acc.reshape(2, BM2, BN).permute(1, 2, 0).split()
        for part in tl.static_range(3):
            if part == 0:
                rows = r0
            elif part == 1:
                rows = r1
            else:
                rows = acc2
            h0, h1 = rows.reshape(BM2, 2, BN // 2).permute(0, 2, 1).split()
            c_desc.store([pm * TM + part * BM2, pn * BN], h0.to(tl.bfloat16))
            c_desc.store([pm * TM + part * BM2, pn * BN + BN // 2], h1.to(tl.bfloat16))


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def run_one(a, b, c, flat, stages=3, group_m=8):
    M, K = a.shape
    N = b.shape[0]
    _mm_one[(_sms(),)](a, b, c, M, N, K, 128, 256, 64, _sms(), flat, group_m, num_warps=8,
                       num_stages=stages)  # fmt: skip


def run_two(a, b, c, stages=3, group_m=8):
    M, K = a.shape
    N = b.shape[0]
    _mm_two[(_sms(),)](a, b, c, M, N, K, 256, 64, _sms(), group_m, num_warps=8, num_stages=stages)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--ab", action="store_true", help="only the grouped kernel, expert vs global bands"
    )
    args = ap.parse_args()
    ensure_scratch_allocator()
    shapes = [  # (name, M, N, K, E: the same product as a uniformly routed grouped GEMM)
        ("dense 8192^3", 8192, 8192, 8192, 1),
        ("deepseek fc1 dense", 32768, 4096, 7168, 32),
        ("deepseek dgrad dense", 32768, 7168, 4096, 32),
        ("mixtral fc1 dense", 16384, 28672, 4096, 8),
        ("qwen3 fc1 dense", 65536, 1536, 2048, 128),
        ("te fc1 dense", 66560, 1024, 2048, 20),
    ]
    rows = []
    for name, M, N, K, E in shapes:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        ref = a @ b.T
        c = torch.empty_like(ref)
        kernels = {
            "128x256 flat": lambda: run_one(a, b, c, True),
            "128x256": lambda: run_one(a, b, c, False),
            "192x256": lambda: run_two(a, b, c),
        }
        for label, fn in kernels.items():  # correctness first
            c.zero_()
            fn()
            err = (c.float() - ref.float()).abs().max().item()
            assert err < 1.0, (name, label, err)
        # The grouped kernel on E experts of M / E rows each (uniform, no partial tiles) with
        # every expert's weight equal to b: the same tiles as the dense kernels, so the
        # difference is the grouped kernel's own overhead (scheduler, 3-D descriptors, bands).
        w = b.expand(E, N, K).contiguous()
        offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (M // E)
        cfg = G._ragged_m_candidates(torch.bfloat16, M, E, K, N)[0]
        kernels["grouped default"] = lambda: G.grouped_mm_ragged_m(
            a, w.transpose(1, 2), offs, c, config=cfg
        )
        kernels["grouped global bands"] = lambda: G.grouped_mm_ragged_m(
            a, w.transpose(1, 2), offs, c, config=dataclasses.replace(cfg, expert_groups=False)
        )
        c.zero_()
        kernels["grouped default"]()
        assert (c.float() - ref.float()).abs().max().item() < 1.0
        contenders = {
            "torch.mm": lambda: torch.mm(a, b.T),
            "torch grouped": lambda: torch._grouped_mm(a, w.transpose(1, 2), offs=offs),
            **kernels,
        }
        if args.ab:
            contenders = {k: v for k, v in contenders.items() if k.startswith("grouped")}
        best = {k: 0.0 for k in contenders}
        runs = {k: [] for k in contenders}
        flops = 2.0 * M * N * K
        for r in range(args.rounds):
            order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
            for label in order:
                ms = triton.testing.do_bench(contenders[label], warmup=25, rep=100)
                runs[label].append(flops / ms / 1e9)
                best[label] = max(best[label], flops / ms / 1e9)
        rows.append((name, best))
        print(name, " ".join(f"{k}={v:.0f}" for k, v in best.items()), flush=True)
        if args.ab:
            x, y = runs["grouped default"], runs["grouped global bands"]
            print("  per round, global / expert bands:", [f"{q / p:.3f}" for p, q in zip(x, y)])
            continue
    if args.ab:
        return
    print("\nshape | " + " | ".join(rows[0][1]) + " | 192/128 | grouped/dense flat")
    for name, best in rows:
        print(f"{name} | " + " | ".join(f"{v:.0f}" for v in best.values())
              + f" | {best['192x256'] / max(best['128x256 flat'], best['128x256']):.3f}"
              + f" | {best['grouped default'] / best['128x256 flat']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
