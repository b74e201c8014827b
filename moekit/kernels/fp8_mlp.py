"""The FP8 expert MLP's activation kernels: elementwise over the pre-activation h, each writing
its result quantized twice, so the activation output and its gradient never exist in bf16.

* ``act_fp8``:      a = act(h) · probs  → e4m3 1×128 along F (fc2's forward operand) and 128×1
                    along the tokens, stored [F, R] (fc2's weight-gradient operand).
* ``act_bwd_fp8``:  dh = act'(h) · (da · probs) → e4m3 1×128 along 2F (fc1's dgrad operand)
                    and 128×1 along the tokens, stored [2F, R] (fc1's wgrad operand); and the
                    per-tile partials of dprobs = Σ_f da · act(h).

One program per [128, 128] tile of [R, F]: 128 rows (a token block of one expert: every
expert's rows start and end at multiples of 128) by 128 activation columns (a gated h holds
the tile's gate and up columns, a 128-column block each). Rows past the last expert's end
give zeros. The math of act and act' is :mod:`moekit.kernels.grouped_mlp`'s, the quantization
:mod:`moekit.kernels.fp8`'s.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moekit.activations import Activation
from moekit.kernels.fp8 import store_fp8_tile
from moekit.kernels.grouped_mlp import ACT_CODES, act_bwd, act_fwd, gate_cols
from moekit.runtime.replay import launch
from moekit.tuning.fp8 import QuantizeConfig

__all__ = ["Fp8Out", "act_bwd_fp8", "act_fp8"]


class Fp8Out(NamedTuple):
    """A tensor's two quantized copies, as the kernels write them."""

    q: torch.Tensor  # [R, C] uint8: e4m3 bytes, 1×128 blocks along C
    s: torch.Tensor  # [R, C/128] fp32
    qt: torch.Tensor  # [C, R] uint8: e4m3 bytes, 128×1 blocks along R
    st: torch.Tensor  # [R/128, C] fp32


@triton.jit
def _tile(pid_m, pid_n, R, F, I, end, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr):  # fmt: skip
    """(rows, f, row_ok, f_ok, gate columns, up columns) of tile (pid_m, pid_n). The tile's
    columns lie in one GLU block, so its gate (and up) columns are contiguous from a scalar
    start: vector loads and stores."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    f0 = pid_n * BLOCK_N
    f = f0 + tl.arange(0, BLOCK_N)
    g0 = gate_cols(f0, I) if GATED else f0
    g = g0 + tl.arange(0, BLOCK_N)
    return rows, f, rows < end, f < F, g, g + I if GATED else g


@triton.jit
def _act_fp8_kernel(
    h_ptr, probs_ptr, offsets_ptr,  # in: h [R, W1], probs [R] (HAS_PROBS), offsets [E]
    q_ptr, s_ptr, qt_ptr, st_ptr,  # out: a as Fp8Out (C = F)
    R, F, E, I,  # sizes; I: the GLU interleave (F for [gate | up] halves)
    stride_h, stride_q, stride_s, stride_qt, stride_st,  # strides
    GATED: tl.constexpr, ACT: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
    OFFSET: tl.constexpr, HAS_PROBS: tl.constexpr, POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """a = act(h) · probs for the rows before offsets[E-1] (zeros after), quantized twice."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    end = tl.load(offsets_ptr + E - 1)
    rows, f, row_ok, f_ok, gc, uc = _tile(pid_m, pid_n, R, F, I, end, GATED, BLOCK_M, BLOCK_N)
    mask = row_ok[:, None] & f_ok[None, :]
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    hg = tl.load(h_rows + gc[None, :], mask=mask, other=0.0).to(tl.float32)
    hu = tl.load(h_rows + uc[None, :], mask=mask, other=0.0).to(tl.float32) if GATED else hg
    out = act_fwd(hg, hu, ACT, LIMIT, ALPHA, OFFSET)
    if HAS_PROBS:
        out = out * tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out = tl.where(mask, out, 0.0)
    store_fp8_tile(
        out, rows, f, rows < R, f_ok, pid_m * BLOCK_M, pid_n, q_ptr, s_ptr, qt_ptr, st_ptr,
        stride_q, stride_s, stride_qt, stride_st, POW2, BLOCK_M,
    )  # fmt: skip


@triton.jit
def _act_bwd_fp8_kernel(
    h_ptr, da_ptr, probs_ptr, offsets_ptr,  # in: h [R, W1], da [R, F], probs [R], offsets [E]
    q_ptr, s_ptr, qt_ptr, st_ptr,  # out: dh as Fp8Out (C = W1)
    part_ptr,  # out: [F / BLOCK_N, R] fp32 dprobs partials (HAS_PROBS)
    R, F, E, I,  # sizes
    stride_h, stride_da, stride_q, stride_s, stride_qt, stride_st, stride_part,  # strides
    GATED: tl.constexpr, ACT: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
    OFFSET: tl.constexpr, HAS_PROBS: tl.constexpr, POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dh = act'(h) · (da · probs) (gate and up columns of a gated h), quantized twice;
    part[pid_n, r] = Σ over the tile's columns of da · act(h). Zeros past offsets[E-1]."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    end = tl.load(offsets_ptr + E - 1)
    rows, f, row_ok, f_ok, gc, uc = _tile(pid_m, pid_n, R, F, I, end, GATED, BLOCK_M, BLOCK_N)
    mask = row_ok[:, None] & f_ok[None, :]
    r64 = rows.to(tl.int64)
    hg = tl.load(h_ptr + r64[:, None] * stride_h + gc[None, :], mask=mask, other=0.0)
    hg = hg.to(tl.float32)
    if GATED:
        hu = tl.load(h_ptr + r64[:, None] * stride_h + uc[None, :], mask=mask, other=0.0)
        hu = hu.to(tl.float32)
    else:
        hu = hg
    da = tl.load(da_ptr + r64[:, None] * stride_da + f[None, :], mask=mask, other=0.0)
    da = da.to(tl.float32)
    d = da
    if HAS_PROBS:
        d = da * tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    act, dg, du = act_bwd(hg, hu, d, ACT, LIMIT, ALPHA, OFFSET)
    all_rows = rows < R
    off_m = pid_m * BLOCK_M
    g_block = (gate_cols(pid_n * BLOCK_N, I) if GATED else pid_n * BLOCK_N) // BLOCK_N
    store_fp8_tile(
        tl.where(mask, dg, 0.0), rows, gc, all_rows, f_ok, off_m, g_block, q_ptr,
        s_ptr, qt_ptr, st_ptr, stride_q, stride_s, stride_qt, stride_st, POW2, BLOCK_M,
    )  # fmt: skip
    if GATED:
        u_block = g_block + I // BLOCK_N
        store_fp8_tile(
            tl.where(mask, du, 0.0), rows, uc, all_rows, f_ok, off_m, u_block, q_ptr,
            s_ptr, qt_ptr, st_ptr, stride_q, stride_s, stride_qt, stride_st, POW2, BLOCK_M,
        )  # fmt: skip
    if HAS_PROBS:
        part = tl.sum(tl.where(mask, da * act, 0.0), axis=1)
        tl.store(part_ptr + pid_n * stride_part + rows, part, mask=all_rows)


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
    cfg: QuantizeConfig,  # the tile: block_m = block_k = 128
) -> None:
    """a = act(h) · probs, written quantized into ``out`` (see the module docstring)."""
    R, F = out.q.shape
    meta, I = _act_meta(act, interleave, F)
    grid = (triton.cdiv(R, cfg.block_m), triton.cdiv(F, cfg.block_k))
    launch(
        _act_fp8_kernel, grid,
        h, probs if probs is not None else h, offsets, *out,
        R, F, offsets.shape[0], I,
        h.stride(0), out.q.stride(0), out.s.stride(0), out.qt.stride(0), out.st.stride(0),
        HAS_PROBS=probs is not None, POW2=pow2, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_k,
        num_warps=cfg.num_warps, **meta,
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
    cfg: QuantizeConfig,
) -> None:
    """dh = act'(h) · (da · probs) quantized into ``out``; dprobs partials into ``part``."""
    R, F = da.shape
    meta, I = _act_meta(act, interleave, F)
    grid = (triton.cdiv(R, cfg.block_m), triton.cdiv(F, cfg.block_k))
    dummy = da
    launch(
        _act_bwd_fp8_kernel, grid,
        h, da, probs if probs is not None else dummy, offsets, *out,
        part if part is not None else dummy,
        R, F, offsets.shape[0], I,
        h.stride(0), da.stride(0), out.q.stride(0), out.s.stride(0), out.qt.stride(0),
        out.st.stride(0), part.stride(0) if part is not None else 0,
        HAS_PROBS=probs is not None, POW2=pow2, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_k,
        num_warps=cfg.num_warps, **meta,
    )  # fmt: skip
