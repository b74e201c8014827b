"""Where an FP8 grouped GEMM in Triton 3.6 can land on this GPU, before building one into moekit.

    python experiments/fp8_gemm_probe.py [--quick]

Ceilings of the same run: dense bf16 ``torch.mm`` and FP8 rowwise ``torch._scaled_mm`` at 8192³;
per MoE shape (rows already padded to 128 per expert, as ``permute(align=128)`` leaves them):
``torch._grouped_mm`` bf16, ``torch._scaled_grouped_mm`` rowwise FP8, and a plain persistent
Triton FP8 ragged-M kernel in variants: no scales (the tensor-core ceiling of the kernel's
structure), the blockwise recipe with a promotion per 128 of K (``acc += dot · sa · sb``), and
the same with two K blocks per step. TFLOP/s, do_bench medians.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

SHAPES = [  # name, rows, E, K, N (fc1 of the layer: N = 2F)
    ("qwen3_30b_a3b", 65536, 128, 2048, 1536), ("olmoe", 32768, 64, 2048, 2048),
    ("deepseek_v3_ep8", 32768, 32, 7168, 4096), ("mixtral", 16384, 8, 4096, 28672),
]  # fmt: skip


@triton.jit
def _fp8_gmm(
    a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, offs_ptr,
    T, N, K, E, stride_sb_e, stride_sb_n,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr,
    MODE: tl.constexpr, NUM_PROGRAMS: tl.constexpr, GROUP_M: tl.constexpr, WS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(T, BM), tl.cdiv(N, BN)
    a_desc = tl.make_tensor_descriptor(a_ptr, [T, K], [K, 1], [BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, [E * N, K], [K, 1], [BN, BK])
    c_desc = tl.make_tensor_descriptor(c_ptr, [T, N], [N, 1], [BM, BN])
    ends = tl.load(offs_ptr + tl.arange(0, BLOCK_E), mask=tl.arange(0, BLOCK_E) < E, other=2**30)
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(pid, num_m * num_n, NUM_PROGRAMS, flatten=True, warp_specialize=WS):
        per_group = GROUP_M * num_n
        first_m = (tile // per_group) * GROUP_M
        size = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % size
        pid_n = (tile % per_group) // size
        off_m, off_n = pid_m * BM, pid_n * BN
        e = tl.minimum(tl.sum((ends <= off_m).to(tl.int32), axis=0), E - 1)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        rows = off_m + tl.arange(0, BM)
        if MODE == 0:  # no scales
            for ki in range(k_tiles):
                a = a_desc.load([off_m, ki * BK])
                b = b_desc.load([e * N + off_n, ki * BK])
                acc = tl.dot(a, b.T, acc)
        else:  # promote every 128 of K, STEP blocks of K per loop step (MODE = STEP)
            sb_at = sb_ptr + e * stride_sb_e + (off_n // 128) * stride_sb_n  # BN <= 128
            for kj in range(k_tiles // MODE):
                for u in tl.static_range(MODE):
                    ki = kj * MODE + u
                    a = a_desc.load([off_m, ki * BK])
                    b = b_desc.load([e * N + off_n, ki * BK])
                    s = tl.load(sa_ptr + rows * k_tiles + ki) * tl.load(sb_at + ki)
                    acc += tl.dot(a, b.T) * s[:, None]
        c_desc.store([off_m, off_n], acc.to(tl.bfloat16))


def _alloc(size, align, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def run_kernel(a, b, sa, sb, offs, E, cfg, mode):
    T, K = a.shape
    N = b.shape[0] // E
    c = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
    BM, BN, warps, stages, ws = cfg
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    triton.set_allocator(_alloc)
    _fp8_gmm[(sms,)](
        a, b, sa, sb, c, offs, T, N, K, E, sb.stride(0), sb.stride(1), BM=BM, BN=BN, BK=128,
        BLOCK_E=triton.next_power_of_2(E), MODE=mode, NUM_PROGRAMS=sms, GROUP_M=8, WS=ws,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return c


def shape_rates(T: int, E: int, K: int, N: int, cfgs: list) -> dict[str, float]:
    """ms of each contender at one shape (uniform routing, 128-row segments)."""
    f8 = torch.float8_e4m3fn
    offs = torch.full((E,), T // E, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    res = {"torch bf16": do_bench(lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs))}
    x8, w8 = x.to(f8), w.to(f8)
    sx, sw = torch.ones(T, device="cuda"), torch.ones(E, N, device="cuda")
    try:
        res["torch fp8 rowwise"] = do_bench(
            lambda: torch._scaled_grouped_mm(
                x8, w8.transpose(1, 2), sx, sw, offs=offs, out_dtype=torch.bfloat16
            )
        )
    except Exception as err:  # a probe: report and go on
        print("  _scaled_grouped_mm:", type(err).__name__, str(err)[:120])
    sa = torch.rand(T, K // 128, device="cuda") + 0.5
    sb = torch.rand(E, triton.cdiv(N, 128), K // 128, device="cuda") + 0.5
    bflat = w8.reshape(E * N, K)
    ref = None
    for cfg, mode in itertools.product(cfgs, (0, 1, 2, 4)):
        key = f"triton mode{mode} {cfg}"
        try:
            out = run_kernel(x8, bflat, sa, sb, offs, E, cfg, mode)
            if mode:
                ref = out if ref is None else ref
                assert torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=1e-2), key
            res[key] = do_bench(
                lambda cfg=cfg, mode=mode: run_kernel(x8, bflat, sa, sb, offs, E, cfg, mode)
            )
        except Exception as err:
            print(f"  {key}: {type(err).__name__} {str(err)[:60]}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    f8 = torch.float8_e4m3fn
    n = 8192
    a16, b16 = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    a8, b8 = a16.to(f8), b16.to(f8).t()
    one_a, one_b = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    dense = {
        "bf16 mm": do_bench(lambda: torch.mm(a16, b16)),
        "fp8 rowwise _scaled_mm": do_bench(
            lambda: torch._scaled_mm(a8, b8, one_a, one_b, out_dtype=torch.bfloat16)
        ),
    }
    for k, ms in dense.items():
        print(f"dense {k}: {2 * n**3 / ms / 1e9:.0f} TFLOP/s")
    cfgs = [(128, 128, 8, 4, False), (128, 128, 8, 3, True), (128, 128, 8, 2, True),
            (128, 128, 8, 4, True), (128, 128, 4, 3, True), (64, 128, 4, 3, True)]  # fmt: skip
    if args.quick:
        cfgs = cfgs[:2]
    for name, T, E, K, N in SHAPES:
        res = shape_rates(T, E, K, N, cfgs)
        print(f"{name} rows {T} E {E} K {K} N {N}")
        for k, ms in sorted(res.items(), key=lambda kv: kv[1]):
            print(f"  {k:<48} {2 * T * K * N / ms / 1e9:7.0f} TFLOP/s")


if __name__ == "__main__":
    main()
