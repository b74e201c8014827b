"""The FP8 kernels build for Hopper (sm_90) and run on its FP8 tensor cores: compiled on the CPU
with Triton's own compiler for an sm_90 target, down to a cubin (no GPU needed), and the PTX
read for e4m3 ``wgmma`` instructions (the blockwise and rowwise forward, the wgrad); the
quantization kernels just compile; every kernel's shared memory fits Hopper's. Catches what
Triton's interpreter cannot: an FP8 dot whose operand layouts Hopper does not take, or a kernel
that does not lower at all.

Runs in a subprocess: under ``TRITON_INTERPRET=1`` the kernels are interpreter functions."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os
    import re
    import subprocess
    import tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from moekit.kernels import fp8, fp8_mlp, grouped_gemm
    from moekit.tuning.fp8 import ACT_BWD_TILE, ACT_TILE, TWO_WAY_TILE, rowwise_quantize_config
    from moekit.tuning.grouped_gemm import FP8_ROWWISE_RAGGED_M as rw

    def build(fn, pointers, consts, **options):
        sig = {}
        for p in fn.params:
            if p.is_constexpr:
                sig[p.name] = "constexpr"
                consts.setdefault(p.name, p.default)
            else:
                sig[p.name] = pointers.get(p.name, "i32")
        src = ASTSource(fn, signature=sig, constexprs=consts)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        # Hopper's shared memory per block: 227 KiB
        assert kernel.metadata.shared <= 227 * 1024, (fn.__name__, kernel.metadata.shared)
        return sorted(set(re.findall(r"wgmma\\.mma_async\\S*", kernel.asm["ptx"])))

    def spill_bytes(fn, pointers, consts, **options):
        # spill stores of the kernel's sm_90a code, by the ptxas Triton bundles
        sig = {p.name: "constexpr" if p.is_constexpr else pointers.get(p.name, "i32")
               for p in fn.params}
        for p in fn.params:
            if p.is_constexpr:
                consts.setdefault(p.name, p.default)
        src = ASTSource(fn, signature=sig, constexprs=consts)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
        info = subprocess.run([ptxas, "-v", "-arch=sm_90a", f.name, "-o", os.devnull],
                              capture_output=True, text=True).stderr
        return int(re.search(r"(\\d+) bytes spill stores", info).group(1))

    f8, f32 = "*fp8e4nv", "*fp32"
    gemm = dict(a_ptr=f8, b_ptr=f8, c_ptr="*bf16", bias_ptr="*bf16", offsets_ptr="*i32",
                sa_ptr=f32, sb_ptr=f32)
    meta = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, BLOCK_E=16, GROUP_M=8, NUM_PROGRAMS=132,
                FLATTEN=False, WARP_SPEC=False, EPI_SUBTILE=False, EXPERT_GROUPS=False,
                HAS_BIAS=False, B_K_MAJOR=True, SCALE_MODE=grouped_gemm.SCALE_BLOCKWISE)
    for c_tma in (False, True):
        print("forward", c_tma, build(grouped_gemm._grouped_mm_ragged_m_kernel, gemm,
                                      dict(meta, C_TMA=c_tma), num_warps=8, num_stages=3))
    # rowwise: the launch config moekit takes (fp8_ragged_m_config(None))
    rowwise = dict(meta, SCALE_MODE=grouped_gemm.SCALE_ROWWISE, C_TMA=rw.c_tma,
                   BLOCK_M=rw.block_m, BLOCK_N=rw.block_n, BLOCK_K=rw.block_k,
                   FLATTEN=rw.flatten, EXPERT_GROUPS=rw.expert_groups, GROUP_M=rw.group_m)
    print("rowwise", build(grouped_gemm._grouped_mm_ragged_m_kernel, gemm, rowwise,
                           num_warps=rw.num_warps, num_stages=rw.num_stages))
    wgrad = dict(a_ptr=f8, b_ptr=f8, sa_ptr=f32, sb_ptr=f32, c_ptr=f32, offsets_ptr="*i32")
    print("wgrad", build(grouped_gemm._fp8_wgrad_kernel, wgrad,
                         dict(ACCUMULATE=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128,
                              BLOCK_E=16, NUM_PROGRAMS=132), num_warps=8, num_stages=3))
    quant = dict(x_ptr="*bf16", q_ptr="*u8", s_ptr=f32)
    for per_row, per_col in ((True, False), (False, True), (False, False)):
        build(fp8._quantize_fp8_kernel, quant, dict(BLOCK_M=64, BLOCK_K=128, PER_ROW=per_row,
              PER_COL=per_col, POW2=False), num_warps=8)
    cfg = rowwise_quantize_config("row", 7168)  # one: the configs differ in tile sides only
    build(fp8._quantize_fp8_rowwise_kernel, quant, dict(BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
          POW2=True), num_warps=cfg.num_warps)
    two_ways = dict(x_ptr="*bf16", q_ptr="*u8", s_ptr=f32, qt_ptr="*u8", st_ptr=f32)
    tw = dict(POW2=False, BLOCK_M=TWO_WAY_TILE.block_m, BLOCK_K=TWO_WAY_TILE.block_n,
              CHUNK=TWO_WAY_TILE.chunk)
    assert spill_bytes(fp8._quantize_fp8_two_ways_kernel, two_ways, tw,
                       num_warps=TWO_WAY_TILE.num_warps) == 0
    print("quantize ok")
    act = dict(h_ptr="*bf16", da_ptr="*bf16", probs_ptr="*bf16", offsets_ptr="*i32",
               q_ptr="*u8", s_ptr=f32, qt_ptr="*u8", st_ptr=f32, part_ptr=f32)
    meta = dict(GATED=True, ACT=0, LIMIT=7.0, ALPHA=1.702, OFFSET=1.0, HAS_PROBS=True,
                POW2=False)
    tile = lambda cfg: dict(meta, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CHUNK=cfg.chunk)
    print("activation spills",
          spill_bytes(fp8_mlp._act_fp8_kernel, act, tile(ACT_TILE),
                      num_warps=ACT_TILE.num_warps),
          spill_bytes(fp8_mlp._act_bwd_fp8_kernel, act, tile(ACT_BWD_TILE),
                      num_warps=ACT_BWD_TILE.num_warps))
    """
)


def test_fp8_kernels_build_for_hopper_with_fp8_tensor_cores():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    fp8_mma = "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"
    lines = out.stdout.splitlines()
    assert [line for line in lines if line.startswith("forward")] == [
        f"forward {c_tma} ['{fp8_mma}']" for c_tma in (False, True)
    ]
    assert f"rowwise ['{fp8_mma}']" in lines, lines
    assert f"wgrad ['{fp8_mma}']" in lines and "quantize ok" in lines
    # the MLP's activation kernels keep their tiles in registers (spills made them 20x slower)
    assert "activation spills 0 0" in lines, lines
