"""Probe: a warp-specialised ping-pong ragged-M grouped GEMM written in Gluon, timed against
moekit's Triton kernel and torch._grouped_mm on the grouped-GEMM issue's skewed shapes.

Design (forward layout only: a [T, K] row-major, w [E, N, K] nn.Linear layout, bf16):
one program per SM with three partitions. A one-warp producer walks the program's tiles and
streams A/B k-slices through a shared S-stage ring with TMA. Two consumer warpgroups take the
program's tiles alternately (ping-pong): while one runs its epilogue (fp32 → bf16, shared memory,
TMA store), the other's wgmmas keep the tensor cores busy. Each consumer tile is BM × BN with
BM = 64 or 128, so an expert's partial last tile wastes at most BM - 1 rows.

The C store goes through moekit's 3-D ragged-row descriptor ([T, BM, N], strides [N, N, 1]) so
the TMA engine drops rows past the expert's end. Rows < BM of experts that end before row BM
are not handled (the probe checks rows >= 128 only).

python benchmarks/probe_gluon_pingpong.py             # on the GPU: check + time
python benchmarks/probe_gluon_pingpong.py --compile   # on any machine: compile for sm_90 only
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _load_tables(cum_ptr, off_ptr, E, BLOCK_E: gl.constexpr, WARPS: gl.constexpr):
    """cum [E+1] m-tile prefix (cum[0] = 0) and off [E+1] row prefix, held in registers by every
    warp of the partition (the layout covers WARPS x BLOCK_E, so warps hold copies)."""
    layout: gl.constexpr = gl.BlockedLayout([BLOCK_E // 32], [32], [WARPS], [0])
    idx = gl.arange(0, BLOCK_E, layout=layout)
    cum = gl.load(cum_ptr + idx, mask=idx <= E, other=2147483647)
    off = gl.load(off_ptr + idx, mask=idx <= E, other=2147483647)
    return idx, cum, off


@gluon.jit
def _tile(t, idx, cum, off, num_m, num_n, BM: gl.constexpr, GROUP_M: gl.constexpr):
    """Global tile t → (expert, first row, expert's end row, n-tile), from register tables."""
    per_group = GROUP_M * num_n
    group = t // per_group
    first_m = group * GROUP_M
    gsize = gl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (t % per_group) % gsize
    pid_n = (t % per_group) // gsize
    before = cum <= pid_m  # entries 0..e (cum is non-decreasing, cum[0] = 0)
    e = gl.sum(before.to(gl.int32), axis=0) - 1
    tiles_before = gl.max(gl.where(before, cum, 0), axis=0)
    start = gl.max(gl.where(idx <= e, off, 0), axis=0)
    end = gl.min(gl.where(idx > e, off, 2147483647), axis=0)
    row = start + (pid_m - tiles_before) * BM
    return e, row, end, pid_n


@gluon.jit
def _program_share(cum_ptr, E, N, K, BN: gl.constexpr, BK: gl.constexpr):
    """What every partition needs to walk this program's tiles: (program, programs, m-tiles,
    n-tiles, tiles, k-steps per tile); the m-tile count is cum_ptr[E]."""
    num_n = gl.cdiv(N, BN)
    num_m = gl.load(cum_ptr + E)
    return (gl.program_id(0), gl.num_programs(0), num_m, num_n, num_m * num_n, gl.cdiv(K, BK))


@gluon.jit
def _producer(
    a_desc,
    w_desc,
    ready,
    empty,
    a_bufs,
    b_bufs,
    cum_ptr,
    off_ptr,
    E,
    N,
    K,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    S: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_E: gl.constexpr,
):
    pid, G, num_m, num_n, num_tiles, k_tiles = _program_share(cum_ptr, E, N, K, BN, BK)
    idx, cum, off = _load_tables(cum_ptr, off_ptr, E, BLOCK_E, 1)
    p = 0
    for t in range(pid, num_tiles, G):
        e, row, _end, pid_n = _tile(t, idx, cum, off, num_m, num_n, BM, GROUP_M)
        brow = e * N + pid_n * BN
        for kk in range(k_tiles):
            s = p % S
            ph = (p // S) & 1
            mbarrier.wait(empty.index(s), ph ^ 1)
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [row, kk * BK], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(
                w_desc, [brow, kk * BK], ready.index(s), b_bufs.index(s)
            )
            p += 1


@gluon.jit
def _consumer(
    wg: gl.constexpr,
    c_desc,
    c_ptr,
    ready,
    empty,
    turn,
    a_bufs,
    b_bufs,
    c_smem,
    cum_ptr,
    off_ptr,
    E,
    N,
    K,
    C_REG: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    S: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_E: gl.constexpr,
    INSTR_N: gl.constexpr,
):
    pid, G, num_m, num_n, num_tiles, k_tiles = _program_share(cum_ptr, E, N, K, BN, BK)
    dtype: gl.constexpr = c_desc.dtype
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, INSTR_N, 16]
    )
    c_2d_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2
    )
    idx, cum, off = _load_tables(cum_ptr, off_ptr, E, BLOCK_E, 4)
    i = wg
    for t in range(pid + wg * G, num_tiles, 2 * G):
        _e, row, end, pid_n = _tile(t, idx, cum, off, num_m, num_n, BM, GROUP_M)
        m = i // 2  # this warpgroup's tile count so far
        # Mainloops alternate: start tile i once the other warpgroup has issued tile i - 1's
        # last MMA. Besides ordering the tensor-core work, this keeps every ring wait less than
        # one ring cycle ahead of the producer (mbarrier waits are by phase parity).
        if wg == 0:
            mbarrier.wait(turn.index(0), (m + 1) & 1, pred=m > 0)
        else:
            mbarrier.wait(turn.index(1), m & 1)
        acc = gl.zeros([BM, BN], gl.float32, mma_layout)
        p = i * k_tiles
        for kk in range(k_tiles):
            s = p % S
            ph = (p // S) & 1
            mbarrier.wait(ready.index(s), ph)
            acc = warpgroup_mma(
                a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True
            )
            acc = warpgroup_mma_wait(1, deps=(acc,))
            mbarrier.arrive(empty.index((p + S - 1) % S), pred=kk > 0)
            p += 1
        mbarrier.arrive(turn.index(1 - wg))
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((p + S - 1) % S))
        if C_REG:
            # masked stores straight from the accumulator registers: no shared memory, so the
            # ring can take more stages; the other warpgroup's mainloop hides the slow stores
            rows = row + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_layout))
            cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma_layout))
            ptrs = c_ptr + rows[:, None].to(gl.int64) * N + cols[None, :]
            gl.store(ptrs, acc.to(dtype), mask=(rows[:, None] < end) & (cols[None, :] < N))
        else:
            j = gl.maximum(gl.minimum(row, end - BM), 0)
            c_2d = c_smem._reinterpret(dtype, [BM, BN], c_2d_layout)
            tma.store_wait(0)
            c_2d.store(acc.to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [j, row - j, pid_n * BN], c_smem)
        i += 2
    tma.store_wait(0)


@gluon.jit
def pingpong_ragged_m_kernel(
    a_desc,
    w_desc,
    c_desc,
    c_ptr,
    cum_ptr,
    off_ptr,
    E,
    N,
    K,
    C_REG: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    S: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_E: gl.constexpr,
    INSTR_N: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [S, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [S, BN, BK], w_desc.layout)
    C_ROWS: gl.constexpr = 8 if C_REG else BM  # a placeholder buffer when C_REG
    c0 = gl.allocate_shared_memory(dtype, [1, C_ROWS, BN], c_desc.layout)
    c1 = gl.allocate_shared_memory(dtype, [1, C_ROWS, BN], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    for s in gl.static_range(S):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    0,
                    c_desc,
                    c_ptr,
                    ready,
                    empty,
                    turn,
                    a_bufs,
                    b_bufs,
                    c0,
                    cum_ptr,
                    off_ptr,
                    E,
                    N,
                    K,
                    C_REG,
                    BM,
                    BN,
                    BK,
                    S,
                    GROUP_M,
                    BLOCK_E,
                    INSTR_N,
                ),
            ),
            (
                _consumer,
                (
                    1,
                    c_desc,
                    c_ptr,
                    ready,
                    empty,
                    turn,
                    a_bufs,
                    b_bufs,
                    c1,
                    cum_ptr,
                    off_ptr,
                    E,
                    N,
                    K,
                    C_REG,
                    BM,
                    BN,
                    BK,
                    S,
                    GROUP_M,
                    BLOCK_E,
                    INSTR_N,
                ),
            ),
            (
                _producer,
                (
                    a_desc,
                    w_desc,
                    ready,
                    empty,
                    a_bufs,
                    b_bufs,
                    cum_ptr,
                    off_ptr,
                    E,
                    N,
                    K,
                    BM,
                    BN,
                    BK,
                    S,
                    GROUP_M,
                    BLOCK_E,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


def _layouts(BM, BN, BK):
    a = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    b = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    c = gl.NVMMASharedLayout.get_default_for([1, BM, BN], gl.bfloat16)
    return a, b, c


def _instr_n(BM, BN):
    return min(BN, 256)


def pingpong_grouped_mm(
    a, w, offsets, BM=64, BN=256, BK=64, S=4, GROUP_M=8, regs=(232, 40), c_reg=False
):
    T, K = a.shape
    E, N, _ = w.shape
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    cum = torch.zeros(E + 1, dtype=torch.int32, device=a.device)
    cum[1:] = torch.cumsum((counts + BM - 1) // BM, 0)
    off = torch.zeros(E + 1, dtype=torch.int32, device=a.device)
    off[1:] = offsets
    c = torch.zeros(T, N, dtype=a.dtype, device=a.device)
    la, lb, lc = _layouts(BM, BN, BK)
    a_desc = TensorDescriptor.from_tensor(a, [BM, BK], la)
    w_desc = TensorDescriptor.from_tensor(w.reshape(E * N, K), [BN, BK], lb)
    c_desc = TensorDescriptor(c, [T, BM, N], [N, N, 1], [1, BM, BN], lc)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    # default partition gets maxnreg's share less the workers': 4 + 4 + 1 (→ 4) warps
    maxnreg = (regs[0] * 128 * 2 + regs[1] * 128) // (12 * 32) // 8 * 8
    pingpong_ragged_m_kernel[(sms,)](
        a_desc,
        w_desc,
        c_desc,
        c,
        cum,
        off,
        E,
        N,
        K,
        c_reg,
        BM,
        BN,
        BK,
        S,
        GROUP_M,
        max(32, triton.next_power_of_2(E + 1)),
        _instr_n(BM, BN),
        regs[0],
        regs[1],
        num_warps=4,
        maxnreg=maxnreg,
    )
    return c


def compile_only(configs):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = pingpong_ragged_m_kernel
    for BM, BN, BK, S, c_reg in configs:
        la, lb, lc = _layouts(BM, BN, BK)
        sig = {
            "a_desc": f"tensordesc<bf16[{BM}, {BK}],{la!r}>",
            "w_desc": f"tensordesc<bf16[{BN}, {BK}],{lb!r}>",
            "c_desc": f"tensordesc<bf16[1, {BM}, {BN}],{lc!r}>",
            "c_ptr": "*bf16",
            "cum_ptr": "*i32",
            "off_ptr": "*i32",
            "E": "i32",
            "N": "i32",
            "K": "i32",
        }
        consts = dict(
            C_REG=c_reg,
            BM=BM,
            BN=BN,
            BK=BK,
            S=S,
            GROUP_M=8,
            BLOCK_E=128,
            INSTR_N=_instr_n(BM, BN),
            CONSUMER_REGS=232,
            PRODUCER_REGS=40,
        )
        for k in consts:
            sig[k] = "constexpr"
        src = GluonASTSource(
            fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}
        )
        try:
            out = triton.compile(
                src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=168)
            )
            print(
                "ok",
                (BM, BN, BK, S, c_reg),
                "smem",
                out.metadata.shared,
                "regs?",
                getattr(out, "n_regs", None),
            )
        except Exception:
            import traceback

            traceback.print_exc()
            print("FAIL", (BM, BN, BK, S))


CASES = [  # name, T, E, K, N  (fc1: K=H, N=2F; fc2: K=F, N=H)
    ("te_seed fc1", 66560, 20, 2048, 1024),
    ("te_seed fc2", 66560, 20, 512, 2048),
    ("qwen3 fc1", 65536, 128, 2048, 1536),
    ("qwen3 fc2", 65536, 128, 768, 2048),
    ("olmoe fc1", 32768, 64, 2048, 2048),
    ("olmoe fc2", 32768, 64, 1024, 2048),
    ("deepseek fc1", 32768, 32, 7168, 4096),
    ("deepseek fc2", 32768, 32, 2048, 7168),
    ("gpt_oss fc1", 32768, 128, 2880, 5760),
]


def debug() -> None:
    torch.manual_seed(0)
    for BM, BN, BK, S, c_reg in [
        (64, 256, 64, 4, False),
        (64, 256, 64, 5, True),
        (128, 128, 64, 6, True),
    ]:
        for T, E, K, N, counts in [
            (1024, 2, 256, 256, [512, 512]),
            (1024, 4, 256, 512, [300, 0, 200, 524]),
            (8192, 5, 2048, 1024, [3000, 0, 1200, 17, 3975]),
        ]:
            offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).cuda()
            a = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * 0.05
            out = pingpong_grouped_mm(a, w, offsets, BM, BN, BK, S, c_reg=c_reg)
            torch.cuda.synchronize()
            ref = torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)
            err = (out[128:].float() - ref[128:].float()).abs().max().item()
            err_all = (out.float() - ref.float()).abs().max().item()
            print((BM, BN, BK, S, c_reg), (T, E, K, N), "err", err, "all rows", err_all, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--debug", action="store_true")
    args = ap.parse_args()
    if args.debug:
        debug()
        return
    configs = [
        (64, 256, 64, 4, False),
        (128, 128, 64, 5, False),
        (64, 256, 64, 5, True),
        (128, 128, 64, 6, True),
    ]
    if args.compile:
        compile_only(configs)
        return
    sys.path.insert(0, "benchmarks")
    from benchmark_grouped_gemm import bench, dense_peak_tflops, routing_counts

    from moekit.ops import grouped_mm

    peak = dense_peak_tflops(torch.bfloat16)
    print(f"dense peak {peak:.0f} TFLOP/s")
    rows = []
    for name, T, E, K, N in CASES[:4] if args.quick else CASES:
        gen = torch.Generator().manual_seed(0)
        counts = routing_counts(T, E, True, gen)
        offsets = torch.cumsum(counts, 0).to(torch.int32).cuda()
        a = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * 0.05
        flops = 2 * T * N * K
        ref = torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)
        row = {"case": name}
        for label, fn in (
            ("torch", lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)),
            ("moekit", lambda: grouped_mm(a, w.transpose(-2, -1), offsets)),
        ):
            row[label] = flops / bench(fn) / 1e9
        for cfg in configs:
            BM, BN, BK, S, c_reg = cfg
            key = f"{BM}x{BN}{'r' if c_reg else 't'}"
            try:
                out = pingpong_grouped_mm(a, w, offsets, BM, BN, BK, S, c_reg=c_reg)
                err = (out[128:].float() - ref[128:].float()).abs().max().item()
                tf = (
                    flops
                    / bench(lambda: pingpong_grouped_mm(a, w, offsets, BM, BN, BK, S, c_reg=c_reg))
                    / 1e9
                )
                row[key] = tf
                row["err"] = max(row.get("err", 0.0), err)
            except Exception as exc:
                print(name, cfg, "FAILED", str(exc)[-800:])
        rows.append(row)
        print(row, flush=True)
    keys = [f"{c[0]}x{c[1]}{'r' if c[4] else 't'}" for c in configs]
    print(
        f"\n{'case':14s} {'torch':>7s} {'moekit':>7s} "
        + " ".join(f"{k:>10s}" for k in keys)
        + "  max err"
    )
    for r in rows:
        print(
            f"{r['case']:14s} {r['torch']:7.1f} {r['moekit']:7.1f} "
            + " ".join(f"{r.get(k, 0):10.1f}" for k in keys)
            + f"  {r.get('err', -1):.3g}"
        )


if __name__ == "__main__":
    main()
