"""A second structure for the FP8 MLP's activation kernels, against the package's, before
building it in: each 128×128 tile walked in chunks of whole rows instead of columns.

    PYTHONPATH=. python experiments/fp8_act_rows_probe.py           # GPU: bytes, µs, GB/s
    TRITON_INTERPRET=1 PYTHONPATH=. python experiments/fp8_act_rows_probe.py --check   # CPU

The package's kernels (``moekit.kernels.fp8_mlp``) walk a tile in 16-column chunks: each chunk
reduces its 128 rows per column (a cross-warp reduction) and stores its rows' bytes 16 to a
row. Here a chunk is ``RC`` whole rows: the row scales (1×128) come from within the chunk and
its bytes go out 128 to a row in the first walk, while the column maxima only accumulate
elementwise; one reduction over the rows ends the walk, and the second walk writes the
token-wise (128×1) copy. Same math, same bytes (the dprobs partials sum in another order).
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial

import torch
import triton
import triton.language as tl

from moekit.activations import resolve_activation
from moekit.kernels.fp8 import e4m3_bytes, e4m3_scale, row_amax
from moekit.kernels.fp8_mlp import Fp8Out, _act_bwd_chunk, _act_chunk, act_bwd_fp8, act_fp8
from moekit.kernels.grouped_mlp import ACT_CODES, gate_cols
from moekit.tuning.fp8 import ACT_TILE


@triton.jit
def _rows(pid_m, c, R, end, probs_ptr, HAS_PROBS: tl.constexpr, RC: tl.constexpr,
          BLOCK_M: tl.constexpr):  # fmt: skip
    """(rows, rows before the last expert's end, rows inside the tensor, the rows as int64
    [RC, 1], their probs) of row chunk c of a 128-row block."""
    rows = pid_m * BLOCK_M + c * RC + tl.arange(0, RC)
    row_ok = rows < end
    p = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32) if HAS_PROBS else 1.0
    return rows, row_ok, rows < R, rows.to(tl.int64)[:, None], p


@triton.jit
def _store_rows(q_ptr, s_ptr, v, rows, cols, mask, stored, in_r, stride_q, stride_s, block,
                POW2: tl.constexpr):  # fmt: skip
    """v's 1×128 quantization (v zero outside ``mask``): scales of the rows ``in_r``, bytes
    where ``stored``."""
    scale, inv = e4m3_scale(row_amax(v, mask), POW2)
    tl.store(s_ptr + rows.to(tl.int64) * stride_s + block, scale, mask=in_r)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_q + cols[None, :],
             e4m3_bytes(v, inv[:, None]), mask=stored)  # fmt: skip


@triton.jit
def _col_max(cmax, v, mask):
    return tl.maximum(cmax, tl.where(mask & (v == v), tl.abs(v), 0.0))


@triton.jit
def _store_cols(qt_ptr, v, cols, rows, mask, inv, stride_qt):
    tl.store(qt_ptr + cols.to(tl.int64)[None, :] * stride_qt + rows[:, None],
             e4m3_bytes(v, inv[None, :]), mask=mask)  # fmt: skip


@triton.jit
def _act_rows_kernel(
    h_ptr, probs_ptr, offsets_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, R, F, E, I,
    stride_h, stride_q, stride_s, stride_qt, stride_st,
    GATED: tl.constexpr, ACT: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
    OFFSET: tl.constexpr, HAS_PROBS: tl.constexpr, POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RC: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    end = tl.load(offsets_ptr + E - 1)
    f0 = pid_n * BLOCK_N
    g0 = gate_cols(f0, I) if GATED else f0
    cmax = tl.zeros((RC, BLOCK_N), dtype=tl.float32)
    for c in range(BLOCK_M // RC):
        rows, row_ok, in_r, r64, p = _rows(pid_m, c, R, end, probs_ptr, HAS_PROBS, RC, BLOCK_M)
        out, f, mask = _act_chunk(h_ptr + r64 * stride_h, p, f0, g0, F,
                                  I, row_ok, GATED, ACT, LIMIT, ALPHA, OFFSET, HAS_PROBS,
                                  BLOCK_N)  # fmt: skip
        stored = in_r[:, None] & (f < F)[None, :]
        _store_rows(q_ptr, s_ptr, out, rows, f, mask, stored, in_r, stride_q, stride_s, pid_n,
                    POW2)  # fmt: skip
        cmax = _col_max(cmax, out, mask)
    scale, inv = e4m3_scale(tl.max(cmax, axis=0), POW2)
    cols = f0 + tl.arange(0, BLOCK_N)
    tl.store(st_ptr + pid_m * stride_st + cols, scale, mask=cols < F)
    for c in range(BLOCK_M // RC):
        rows, row_ok, in_r, r64, p = _rows(pid_m, c, R, end, probs_ptr, HAS_PROBS, RC, BLOCK_M)
        out, f, mask = _act_chunk(h_ptr + r64 * stride_h, p, f0, g0, F,
                                  I, row_ok, GATED, ACT, LIMIT, ALPHA, OFFSET, HAS_PROBS,
                                  BLOCK_N)  # fmt: skip
        _store_cols(qt_ptr, out, f, rows, in_r[:, None] & (f < F)[None, :], inv, stride_qt)


@triton.jit
def _act_bwd_rows_kernel(
    h_ptr, da_ptr, probs_ptr, offsets_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, part_ptr, R, F, E, I,
    stride_h, stride_da, stride_q, stride_s, stride_qt, stride_st, stride_part,
    GATED: tl.constexpr, ACT: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
    OFFSET: tl.constexpr, HAS_PROBS: tl.constexpr, POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RC: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    end = tl.load(offsets_ptr + E - 1)
    f0 = pid_n * BLOCK_N
    g0 = gate_cols(f0, I) if GATED else f0
    gmax = tl.zeros((RC, BLOCK_N), dtype=tl.float32)
    umax = tl.zeros((RC, BLOCK_N), dtype=tl.float32)
    for c in range(BLOCK_M // RC):
        rows, row_ok, in_r, r64, p = _rows(pid_m, c, R, end, probs_ptr, HAS_PROBS, RC, BLOCK_M)
        dp, dg, du, f, g, mask = _act_bwd_chunk(
            h_ptr + r64 * stride_h, da_ptr + r64 * stride_da, p, f0, g0, F, I, row_ok, GATED,
            ACT, LIMIT, ALPHA, OFFSET, HAS_PROBS, BLOCK_N,
        )  # fmt: skip
        stored = in_r[:, None] & (f < F)[None, :]
        _store_rows(q_ptr, s_ptr, dg, rows, g, mask, stored, in_r, stride_q, stride_s,
                    g0 // BLOCK_N, POW2)  # fmt: skip
        gmax = _col_max(gmax, dg, mask)
        if GATED:
            _store_rows(q_ptr, s_ptr, du, rows, g + I, mask, stored, in_r, stride_q, stride_s,
                        (g0 + I) // BLOCK_N, POW2)  # fmt: skip
            umax = _col_max(umax, du, mask)
        if HAS_PROBS:
            tl.store(part_ptr + pid_n * stride_part + rows, tl.sum(dp, axis=1), mask=in_r)
    g_scale, g_inv = e4m3_scale(tl.max(gmax, axis=0), POW2)
    u_scale, u_inv = e4m3_scale(tl.max(umax, axis=0), POW2)
    cols = f0 + tl.arange(0, BLOCK_N)
    gc = gate_cols(cols, I) if GATED else cols
    tl.store(st_ptr + pid_m * stride_st + gc, g_scale, mask=cols < F)
    if GATED:
        tl.store(st_ptr + pid_m * stride_st + gc + I, u_scale, mask=cols < F)
    for c in range(BLOCK_M // RC):
        rows, row_ok, in_r, r64, p = _rows(pid_m, c, R, end, probs_ptr, HAS_PROBS, RC, BLOCK_M)
        dp, dg, du, f, g, mask = _act_bwd_chunk(
            h_ptr + r64 * stride_h, da_ptr + r64 * stride_da, p, f0, g0, F, I, row_ok, GATED,
            ACT, LIMIT, ALPHA, OFFSET, HAS_PROBS, BLOCK_N,
        )  # fmt: skip
        stored = in_r[:, None] & (f < F)[None, :]
        _store_cols(qt_ptr, dg, g, rows, stored, g_inv, stride_qt)
        if GATED:
            _store_cols(qt_ptr, du, g + I, rows, stored, u_inv, stride_qt)


def _meta(act):
    return dict(GATED=act.gated, ACT=ACT_CODES[act.name], LIMIT=act.limit, ALPHA=act.alpha,
                OFFSET=act.offset)  # fmt: skip


def act_rows(h, probs, offsets, out: Fp8Out, act, rc: int, warps: int) -> None:
    R, F = out.q.shape
    grid = (triton.cdiv(R, 128), triton.cdiv(F, 128))
    _act_rows_kernel[grid](
        h, probs, offsets, *out, R, F, offsets.shape[0], F, h.stride(0), out.q.stride(0),
        out.s.stride(0), out.qt.stride(0), out.st.stride(0), HAS_PROBS=True, POW2=False,
        BLOCK_M=128, BLOCK_N=128, RC=rc, num_warps=warps, **_meta(act),
    )  # fmt: skip


def act_bwd_rows(h, da, probs, offsets, out: Fp8Out, part, act, rc: int, warps: int) -> None:
    R, F = da.shape
    grid = (triton.cdiv(R, 128), triton.cdiv(F, 128))
    _act_bwd_rows_kernel[grid](
        h, da, probs, offsets, *out, part, R, F, offsets.shape[0], F, h.stride(0), da.stride(0),
        out.q.stride(0), out.s.stride(0), out.qt.stride(0), out.st.stride(0), part.stride(0),
        HAS_PROBS=True, POW2=False, BLOCK_M=128, BLOCK_N=128, RC=rc, num_warps=warps,
        **_meta(act),
    )  # fmt: skip


def _out(R: int, C: int, device) -> Fp8Out:
    u8, f32 = dict(dtype=torch.uint8, device=device), dict(dtype=torch.float32, device=device)
    return Fp8Out(torch.zeros(R, C, **u8), torch.zeros(R, C // 128, **f32),
                  torch.zeros(C, R, **u8), torch.zeros(R // 128, C, **f32))  # fmt: skip


def _same(got: Fp8Out, want: Fp8Out, blocks: int) -> bool:
    """Bytes and scales equal; the token-wise scales only of the row blocks before the last
    expert's end (the package kernel leaves the others unwritten)."""
    rows = torch.equal(got.q, want.q) and torch.equal(got.s, want.s)
    return rows and torch.equal(got.qt, want.qt) and torch.equal(got.st[:blocks], want.st[:blocks])


def compare(R, E, F, device, rc, warps, bench=None) -> dict:
    """Both structures on one shape: equal outputs, and (``bench``) their µs and GB/s."""
    act = resolve_activation("swiglu")
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(R, 2 * F, device=device, dtype=torch.bfloat16, generator=g)
    da = torch.randn(R, F, device=device, dtype=torch.bfloat16, generator=g)
    probs = torch.rand(R, device=device, generator=g)
    ends = torch.arange(1, E + 1, device=device, dtype=torch.int32) * (R // E // 128) * 128
    blocks = int(ends[-1]) // 128
    ref_f, got_f = _out(R, F, device), _out(R, F, device)
    ref_b, got_b = _out(R, 2 * F, device), _out(R, 2 * F, device)
    pr, pg = torch.zeros(F // 128, R, device=device), torch.zeros(F // 128, R, device=device)
    fwd_ref = partial(act_fp8, h, probs, ends, ref_f, act, None, False, ACT_TILE)
    bwd_ref = partial(act_bwd_fp8, h, da, probs, ends, ref_b, pr, act, None, False, ACT_TILE)
    fwd_new = partial(act_rows, h, probs, ends, got_f, act, rc, warps)
    bwd_new = partial(act_bwd_rows, h, da, probs, ends, got_b, pg, act, rc, warps)
    for fn in (fwd_ref, bwd_ref, fwd_new, bwd_new):
        fn()
    row = {"R": R, "F": F, "rc": rc, "warps": warps, "fwd_same": _same(got_f, ref_f, blocks),
           "bwd_same": _same(got_b, ref_b, blocks),
           "part_err": float((pg - pr).abs().max() / pr.abs().max().clamp_min(1e-30))}  # fmt: skip
    if bench is not None:
        fwd_bytes = R * 2 * F * 2 + R * 4 + 2 * R * F * (1 + 4 / 128)
        bwd_bytes = R * 2 * F * 2 + R * F * 2 + R * 4 + 2 * R * 2 * F * (1 + 4 / 128) + 4 * R
        cases = (("fwd_pkg", fwd_ref, fwd_bytes), ("fwd_rows", fwd_new, fwd_bytes),
                 ("bwd_pkg", bwd_ref, bwd_bytes), ("bwd_rows", bwd_new, bwd_bytes))  # fmt: skip
        for name, fn, nbytes in cases:
            us = bench(fn) * 1e3
            row[f"{name}_us"], row[f"{name}_gbs"] = round(us, 1), round(nbytes / us / 1e3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="small shapes only (CPU interpreter)")
    args = ap.parse_args()
    if args.check:
        for R, rc in ((512, 16), (640, 32)):  # 640: a row block past the last expert's end
            print(compare(R, 2, 256, "cpu", rc, 4))
        return
    from tabulate import tabulate
    from triton.testing import do_bench

    rows = []
    for (R, E, F), (rc, warps) in itertools.product(
        [(131072, 128, 768), (16384, 8, 14336)], [(16, 4), (16, 8), (32, 8), (32, 16), (64, 16)]
    ):
        rows.append(compare(R, E, F, "cuda", rc, warps, do_bench))
        print(rows[-1], flush=True)
    print(tabulate([list(r.values()) for r in rows], headers=list(rows[0])))


if __name__ == "__main__":
    main()
