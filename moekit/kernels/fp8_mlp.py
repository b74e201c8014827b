"""The FP8 expert MLP's activation kernels: elementwise over the pre-activation h, each writing
its result quantized twice, so the activation output and its gradient never exist in bf16.

* ``act_fp8``:      a = act(h) · probs  → e4m3 1×128 along F (fc2's forward operand) and 128×1
                    along the tokens, stored [F, R] (fc2's weight-gradient operand).
* ``act_bwd_fp8``:  dh = act'(h) · (da · probs) → e4m3 1×128 along 2F (fc1's dgrad operand)
                    and 128×1 along the tokens, stored [2F, R] (fc1's wgrad operand); and the
                    per-tile partials of dprobs = Σ_f da · act(h).

One program per [128, 128] tile of [R, F]: 128 rows (a token block of one expert: every
expert's rows start and end at multiples of 128) by 128 activation columns (a gated h holds
the tile's gate and up columns, a 128-column block each), walked in chunks of whole rows (so
the 1×128 row scales come from within a chunk and only the 128×1 column scales need a
reduction over the tile). Rows past the last expert's end give zeros. The math of act and act' is
:mod:`moekit.kernels.grouped_mlp`'s, the quantization :mod:`moekit.kernels.fp8`'s.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moekit.activations import Activation
from moekit.kernels.fp8 import (
    col_amax_step,
    e4m3_scale,
    store_fp8_cols,
    store_fp8_rows,
)
from moekit.kernels.grouped_mlp import ACT_CODES, act_bwd, act_fwd, gate_cols
from moekit.runtime.replay import launch
from moekit.tuning.fp8 import TileWalkConfig

__all__ = ["Fp8Out", "act_bwd_fp8", "act_fp8"]


class Fp8Out(NamedTuple):
    """A tensor's two quantized copies, as the kernels write them."""

    q: torch.Tensor  # [R, C] uint8: e4m3 bytes, 1×128 blocks along C
    s: torch.Tensor  # [R, C/128] fp32
    qt: torch.Tensor  # [C, R] uint8: e4m3 bytes, 128×1 blocks along R
    st: torch.Tensor  # [R/128, C] fp32


@triton.jit
def _chunk_rows(pid_m, c, R, end, probs_ptr, HAS_PROBS: tl.constexpr, CHUNK: tl.constexpr,
                BLOCK_M: tl.constexpr):  # fmt: skip
    """(rows, rows before the last expert's end, rows inside the tensor, the rows as int64
    [CHUNK, 1], their probs) of row chunk ``c`` of the 128-row block ``pid_m``."""
    rows = pid_m * BLOCK_M + c * CHUNK + tl.arange(0, CHUNK)
    row_ok = rows < end
    p = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32) if HAS_PROBS else 1.0
    return rows, row_ok, rows < R, rows.to(tl.int64)[:, None], p


@triton.jit
def _load_h(h_rows, f0, g0, F, I, row_ok, GATED: tl.constexpr, BLOCK_N: tl.constexpr):
    """(activation columns f, gate columns g, mask, gate values, up values) of a chunk of h's
    rows: the up columns I after the gate ones; an ungated h's values twice."""
    f = f0 + tl.arange(0, BLOCK_N)
    g = g0 + tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (f < F)[None, :]
    hg = tl.load(h_rows + g[None, :], mask=mask, other=0.0).to(tl.float32)
    hu = hg
    if GATED:
        hu = tl.load(h_rows + (g + I)[None, :], mask=mask, other=0.0).to(tl.float32)
    return f, g, mask, hg, hu


@triton.jit
def _act_chunk(
    h_rows, p, f0, g0, F, I, row_ok, GATED: tl.constexpr, ACT: tl.constexpr,
    LIMIT: tl.constexpr, ALPHA: tl.constexpr, OFFSET: tl.constexpr, HAS_PROBS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """(act(h) · p [CHUNK, BLOCK_N], its columns f, their mask) of a chunk of rows over the
    activation columns from f0, whose gate columns start at g0 (one GLU block)."""
    f, _, mask, hg, hu = _load_h(h_rows, f0, g0, F, I, row_ok, GATED, BLOCK_N)
    out = act_fwd(hg, hu, ACT, LIMIT, ALPHA, OFFSET)
    if HAS_PROBS:
        out = out * p[:, None]
    return tl.where(mask, out, 0.0), f, mask


@triton.jit
def _act_fp8_kernel(
    h_ptr, probs_ptr, offsets_ptr,  # in: h [R, W1], probs [R] (HAS_PROBS), offsets [E]
    q_ptr, s_ptr, qt_ptr, st_ptr,  # out: a as Fp8Out (C = F)
    R, F, E, I,  # sizes; I: the GLU interleave (F for [gate | up] halves)
    stride_h, stride_q, stride_s, stride_qt, stride_st,  # strides
    GATED: tl.constexpr, ACT: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
    OFFSET: tl.constexpr, HAS_PROBS: tl.constexpr, POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """a = act(h) · probs for the rows before offsets[E-1] (zeros after), quantized twice.
    The tile is walked twice in chunks of CHUNK whole rows (its values recomputed, not held,
    which would spill registers): the first walk writes the 1×128 copy, whose row scales lie
    within a chunk, and keeps an elementwise running max; one reduction over its rows gives
    the column scales, and the second walk writes the transposed 128×1 copy. The walks are
    runtime loops, not unrolled: unrolled, the compiler merges the second walk's loads with
    the first's and holds every chunk's values again."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    end = tl.load(offsets_ptr + E - 1)
    f0 = pid_n * BLOCK_N
    g0 = gate_cols(f0, I) if GATED else f0
    cmax = tl.zeros((CHUNK, BLOCK_N), dtype=tl.float32)
    for c in range(BLOCK_M // CHUNK):
        rows, row_ok, in_r, r64, p = _chunk_rows(pid_m, c, R, end, probs_ptr, HAS_PROBS, CHUNK,
                                                 BLOCK_M)  # fmt: skip
        out, f, mask = _act_chunk(h_ptr + r64 * stride_h, p, f0, g0, F, I, row_ok, GATED, ACT,
                                  LIMIT, ALPHA, OFFSET, HAS_PROBS, BLOCK_N)  # fmt: skip
        stored = in_r[:, None] & (f < F)[None, :]
        store_fp8_rows(q_ptr, s_ptr, out, rows, f, mask, stored, in_r, stride_q, stride_s, pid_n,
                    POW2)  # fmt: skip
        cmax = col_amax_step(cmax, out, mask)
    scale, inv = e4m3_scale(tl.max(cmax, axis=0), POW2)
    cols = f0 + tl.arange(0, BLOCK_N)
    tl.store(st_ptr + pid_m * stride_st + cols, scale, mask=cols < F)
    for c in range(BLOCK_M // CHUNK):
        rows, row_ok, in_r, r64, p = _chunk_rows(pid_m, c, R, end, probs_ptr, HAS_PROBS, CHUNK,
                                                 BLOCK_M)  # fmt: skip
        out, f, mask = _act_chunk(h_ptr + r64 * stride_h, p, f0, g0, F, I, row_ok, GATED, ACT,
                                  LIMIT, ALPHA, OFFSET, HAS_PROBS, BLOCK_N)  # fmt: skip
        store_fp8_cols(qt_ptr, out, f, rows, in_r[:, None] & (f < F)[None, :], inv, stride_qt)


@triton.jit
def _act_bwd_chunk(
    h_rows, da_rows, p, f0, g0, F, I, row_ok, GATED: tl.constexpr, ACT: tl.constexpr,
    LIMIT: tl.constexpr, ALPHA: tl.constexpr, OFFSET: tl.constexpr, HAS_PROBS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """(da · act(h), dg, du, f, gate columns, mask) of a chunk of rows, zeros outside the mask
    (act(0) = 0 and its gradients too, for every activation)."""
    f, g, mask, hg, hu = _load_h(h_rows, f0, g0, F, I, row_ok, GATED, BLOCK_N)
    da = tl.load(da_rows + f[None, :], mask=mask, other=0.0).to(tl.float32)
    d = da * p[:, None] if HAS_PROBS else da
    act, dg, du = act_bwd(hg, hu, d, ACT, LIMIT, ALPHA, OFFSET)
    return da * act, dg, du, f, g, mask


@triton.jit
def _act_bwd_fp8_kernel(
    h_ptr, da_ptr, probs_ptr, offsets_ptr,  # in: h [R, W1], da [R, F], probs [R], offsets [E]
    q_ptr, s_ptr, qt_ptr, st_ptr,  # out: dh as Fp8Out (C = W1)
    part_ptr,  # out: [F / BLOCK_N, R] fp32 dprobs partials (HAS_PROBS)
    R, F, E, I,  # sizes
    stride_h, stride_da, stride_q, stride_s, stride_qt, stride_st, stride_part,  # strides
    GATED: tl.constexpr, ACT: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
    OFFSET: tl.constexpr, HAS_PROBS: tl.constexpr, POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """dh = act'(h) · (da · probs) (gate and up columns of a gated h), quantized twice;
    part[pid_n, r] = Σ over the tile's columns of da · act(h). Zeros past offsets[E-1]. Two
    walks over row chunks, as in ``_act_fp8_kernel``."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    end = tl.load(offsets_ptr + E - 1)
    f0 = pid_n * BLOCK_N
    g0 = gate_cols(f0, I) if GATED else f0
    g_max = tl.zeros((CHUNK, BLOCK_N), dtype=tl.float32)
    u_max = tl.zeros((CHUNK, BLOCK_N), dtype=tl.float32)
    for c in range(BLOCK_M // CHUNK):
        rows, row_ok, in_r, r64, p = _chunk_rows(pid_m, c, R, end, probs_ptr, HAS_PROBS, CHUNK,
                                                 BLOCK_M)  # fmt: skip
        dp, dg, du, f, g, mask = _act_bwd_chunk(
            h_ptr + r64 * stride_h, da_ptr + r64 * stride_da, p, f0, g0, F, I, row_ok, GATED,
            ACT, LIMIT, ALPHA, OFFSET, HAS_PROBS, BLOCK_N,
        )  # fmt: skip
        stored = in_r[:, None] & (f < F)[None, :]
        store_fp8_rows(q_ptr, s_ptr, dg, rows, g, mask, stored, in_r, stride_q, stride_s,
                    g0 // BLOCK_N, POW2)  # fmt: skip
        g_max = col_amax_step(g_max, dg, mask)
        if GATED:
            store_fp8_rows(q_ptr, s_ptr, du, rows, g + I, mask, stored, in_r, stride_q, stride_s,
                        (g0 + I) // BLOCK_N, POW2)  # fmt: skip
            u_max = col_amax_step(u_max, du, mask)
        if HAS_PROBS:
            tl.store(part_ptr + pid_n * stride_part + rows, tl.sum(dp, axis=1), mask=in_r)
    g_scale, g_inv = e4m3_scale(tl.max(g_max, axis=0), POW2)
    u_scale, u_inv = e4m3_scale(tl.max(u_max, axis=0), POW2)
    cols = f0 + tl.arange(0, BLOCK_N)
    gc = gate_cols(cols, I) if GATED else cols
    tl.store(st_ptr + pid_m * stride_st + gc, g_scale, mask=cols < F)
    if GATED:
        tl.store(st_ptr + pid_m * stride_st + gc + I, u_scale, mask=cols < F)
    for c in range(BLOCK_M // CHUNK):
        rows, row_ok, in_r, r64, p = _chunk_rows(pid_m, c, R, end, probs_ptr, HAS_PROBS, CHUNK,
                                                 BLOCK_M)  # fmt: skip
        dp, dg, du, f, g, mask = _act_bwd_chunk(
            h_ptr + r64 * stride_h, da_ptr + r64 * stride_da, p, f0, g0, F, I, row_ok, GATED,
            ACT, LIMIT, ALPHA, OFFSET, HAS_PROBS, BLOCK_N,
        )  # fmt: skip
        stored = in_r[:, None] & (f < F)[None, :]
        store_fp8_cols(qt_ptr, dg, g, rows, stored, g_inv, stride_qt)
        if GATED:
            store_fp8_cols(qt_ptr, du, g + I, rows, stored, u_inv, stride_qt)


def _act_meta(act: Activation, interleave: int | None, F: int) -> dict:
    return dict(
        GATED=act.gated, ACT=ACT_CODES[act.name], LIMIT=act.limit, ALPHA=act.alpha,
        OFFSET=act.offset,
    ), interleave or F  # fmt: skip


def act_fp8(
    h: torch.Tensor,  # [R, W1] pre-activation, unit stride along W1
    probs: torch.Tensor | None,  # [R]
    offsets: torch.Tensor,  # [E] int32, multiples of 128
    out: Fp8Out,  # a [R, F]
    act: Activation,
    interleave: int | None,
    pow2: bool,
    cfg: TileWalkConfig,
) -> None:
    """a = act(h) · probs, written quantized into ``out`` (see the module docstring)."""
    R, F = out.q.shape
    meta, I = _act_meta(act, interleave, F)
    grid = (triton.cdiv(R, cfg.block_m), triton.cdiv(F, cfg.block_n))
    launch(
        _act_fp8_kernel, grid,
        h, probs if probs is not None else h, offsets, *out,
        R, F, offsets.shape[0], I,
        h.stride(0), out.q.stride(0), out.s.stride(0), out.qt.stride(0), out.st.stride(0),
        HAS_PROBS=probs is not None, POW2=pow2, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        CHUNK=cfg.chunk, num_warps=cfg.num_warps, **meta,
    )  # fmt: skip


def act_bwd_fp8(
    h: torch.Tensor,  # [R, W1] saved pre-activation
    da: torch.Tensor,  # [R, F] gradient of the activation output
    probs: torch.Tensor | None,  # [R]
    offsets: torch.Tensor,  # [E] int32, multiples of 128
    out: Fp8Out,  # dh [R, W1]
    part: torch.Tensor | None,  # [F / 128, R] fp32, with probs
    act: Activation,
    interleave: int | None,
    pow2: bool,
    cfg: TileWalkConfig,
) -> None:
    """dh = act'(h) · (da · probs) quantized into ``out``; dprobs partials into ``part``."""
    R, F = da.shape
    meta, I = _act_meta(act, interleave, F)
    grid = (triton.cdiv(R, cfg.block_m), triton.cdiv(F, cfg.block_n))
    dummy = da
    launch(
        _act_bwd_fp8_kernel, grid,
        h, da, probs if probs is not None else dummy, offsets, *out,
        part if part is not None else dummy,
        R, F, offsets.shape[0], I,
        h.stride(0), da.stride(0), out.q.stride(0), out.s.stride(0), out.qt.stride(0),
        out.st.stride(0), part.stride(0) if part is not None else 0,
        HAS_PROBS=probs is not None, POW2=pow2, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        CHUNK=cfg.chunk, num_warps=cfg.num_warps, **meta,
    )  # fmt: skip
