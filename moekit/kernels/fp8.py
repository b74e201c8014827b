"""Blockwise and rowwise e4m3 quantization (the math: :mod:`moekit.reference.fp8`).

Blockwise: one program quantizes one [BLOCK_M, BLOCK_K] tile of a [B, M, K] tensor and writes
its scales: per row of the tile (``axis="row"``: 1×BLOCK_K blocks), per column (``"col"``:
BLOCK_M×1) or one for the tile (``"both"``: BLOCK_M×BLOCK_K), the block size being the tile's
side.

Rowwise (one scale per whole row, up to K = 28672 and more): a row does not fit one tile, so a
program takes BLOCK_M whole rows and reads them twice, stepping BLOCK_K along K: the amax
first, then the quantization with the row's scale. Per whole column (``"col"``) is the same
kernel on the transposed views. A program's rows are kept short enough (the config) that the
second read finds them in L2.

Two ways (``quantize_fp8_two_ways``): one read of a [M, K] tensor writes both its 1×128 copy
and its 128×1 copy stored transposed (an output gradient's dgrad and wgrad operands), each
128×128 tile walked in chunks of whole rows as the FP8 MLP's activation kernels do.

Rounding to e4m3 is done in fp32 arithmetic first (round to nearest even at the value's e4m3
spacing), so the conversion itself only meets representable values: Triton's CPU interpreter
loses the carry when a conversion rounds up into the next binade, and exact values sidestep
that on every path. The bytes are written through a uint8 view, NaN as e4m3's 0x7F.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekit.runtime.replay import launch
from moekit.tuning.fp8 import QuantizeConfig, TileWalkConfig

__all__ = [
    "col_amax_step",
    "e4m3_bytes",
    "e4m3_scale",
    "quantize_fp8",
    "quantize_fp8_rowwise",
    "quantize_fp8_two_ways",
    "row_amax",
    "store_fp8_cols",
    "store_fp8_rows",
]


@triton.jit
def _e4m3_byte(q):
    """The e4m3 byte of q (fp32, |q| ≤ 448), rounded to nearest, ties to even: the spacing is
    2^(e - 3) in a binade 2^e with e ≥ -6, and 2^-9 below (subnormals). The magnitude is
    rounded in fp32 (scaled by the spacing's inverse, a power of two: exact), then its byte
    assembled from its fp32 bits with integer arithmetic, the sign bit set by hand (-0
    included). No value passes through an FP8 type: ptxas 12.9, which Triton 3.6 uses on
    Hopper, miscompiles FP8 conversions feeding a transposed store (triton-lang/triton#11111),
    and Triton's interpreter loses the carry into the next binade in the conversion."""
    bits = q.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF  # biased fp32 exponent
    ulp_exp = tl.maximum(exp, 127 - 6) - 3  # the spacing's biased exponent
    ulp = (ulp_exp << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((254 - ulp_exp) << 23).to(tl.float32, bitcast=True)
    t = tl.abs(q) * inv_ulp  # exact: a power of two
    r = ((t + 12582912.0) - 12582912.0) * ulp  # 1.5·2^23: fp32 adds round to an integer
    r_bits = r.to(tl.int32, bitcast=True)
    r_exp = (r_bits >> 23) & 0xFF
    normal = ((r_exp - 120) << 3) | ((r_bits >> 20) & 0x7)  # e4m3's exponent bias is 7
    subnormal = (r * 512.0).to(tl.int32)  # below 2^-6: a multiple of 2^-9, exactly
    mag = tl.where(r_exp >= 121, normal, subnormal)
    return (mag | tl.where(bits < 0, 0x80, 0)).to(tl.uint8)


@triton.jit
def e4m3_scale(amax, POW2: tl.constexpr):
    """(scale, inverse) of blocks of absolute maximum ``amax`` (fp32): the dequantization
    factor amax / 448 and the quantization factor 448 / amax, IEEE divisions, (1, 1) for an
    all-zero block; with POW2 the scale rounded up to a power of two and its exact inverse
    (:func:`moekit.reference.fp8.scale_and_inverse`)."""
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    if POW2:
        sb = scale.to(tl.int32, bitcast=True)
        up = (sb & 0x7F800000) + (1 << 23)
        sb = tl.where((sb & 0x7FFFFF) != 0, up, sb)
        scale = sb.to(tl.float32, bitcast=True)
        inf = (sb & 0x7F800000) == 0x7F800000
        inv = tl.where(inf, 0.0, ((254 << 23) - sb).to(tl.float32, bitcast=True))
    else:
        inv = tl.where(amax > 0, tl.math.div_rn(448.0, amax), 1.0)
    return scale, inv


@triton.jit
def e4m3_bytes(x, inv):
    """The e4m3 bytes (uint8) of fp32 ``x · inv``, clamped to ±448; NaN (a NaN entry, or
    inf · 0) as e4m3's NaN byte 0x7F."""
    q = x * inv
    return tl.where(q == q, _e4m3_byte(tl.clamp(q, -448.0, 448.0)), 0x7F)


@triton.jit
def row_amax(v, mask):
    """max |v| over each row of the [BM, C] tile, NaN and entries outside ``mask`` left out."""
    return tl.max(tl.where(mask & (v == v), tl.abs(v), 0.0), axis=1)


@triton.jit
def store_fp8_rows(q_ptr, s_ptr, v, rows, cols, mask, stored, in_r, stride_q, stride_s, block,
                POW2: tl.constexpr):  # fmt: skip
    """The 1×128 quantization of the chunk ``v`` (zero outside ``mask``): the scales of the
    rows ``in_r`` into column ``block`` of s, the bytes where ``stored``."""
    scale, inv = e4m3_scale(row_amax(v, mask), POW2)
    tl.store(s_ptr + rows.to(tl.int64) * stride_s + block, scale, mask=in_r)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_q + cols[None, :],
             e4m3_bytes(v, inv[:, None]), mask=stored)  # fmt: skip


@triton.jit
def col_amax_step(cmax, v, mask):
    """The elementwise running max |v| of the chunks (NaN and entries outside ``mask`` left
    out); one reduction over its rows after the walk gives the columns' amax."""
    return tl.maximum(cmax, tl.where(mask & (v == v), tl.abs(v), 0.0))


@triton.jit
def store_fp8_cols(qt_ptr, v, cols, rows, mask, inv, stride_qt):
    """The chunk ``v``'s bytes at the columns' inverse scales ``inv``, transposed: qt[cols,
    rows], the tokens contiguous."""
    tl.store(qt_ptr + cols.to(tl.int64)[None, :] * stride_qt + rows[:, None],
             e4m3_bytes(v, inv[None, :]), mask=mask)  # fmt: skip


@triton.jit
def _quantize_fp8_kernel(
    x_ptr, q_ptr, s_ptr,  # pointers: x [B, M, K], q [B, M, K] uint8 (e4m3 bytes), s fp32
    rows_ptr,  # GATHER: [M] int32, row m of the quantized tensor is x row rows[m] (−1: zeros)
    M, K,  # sizes
    stride_x_b, stride_x_m, stride_x_k,  # strides (elements)
    stride_q_b, stride_q_m, stride_q_k,
    stride_s_b, stride_s_m, stride_s_k,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,  # meta: the tile
    PER_ROW: tl.constexpr, PER_COL: tl.constexpr,  # a scale per tile row / per tile column
    POW2: tl.constexpr,  # scales rounded up to powers of two
    GATHER: tl.constexpr = False,
):  # fmt: skip
    """scale = amax/448 over each block (NaN left out, 1 for an all-zero block); q = e4m3(x ·
    448/amax). The scale of row m, tile column kb lives at s[b, m, kb] (PER_ROW); of tile row mb,
    column k at s[b, mb, k] (PER_COL); of the tile at s[b, mb, kb]."""
    pid_m, pid_k, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    if GATHER:  # e.g. permuted rows quantized along the tokens straight from the tokens
        src = tl.load(rows_ptr + rows, mask=rows < M, other=-1).to(tl.int64)
        xp = x_ptr + src[:, None] * stride_x_m + cols[None, :] * stride_x_k
        x = tl.load(xp, mask=mask & (src >= 0)[:, None], other=0.0).to(tl.float32)
    else:
        xp = x_ptr + b * stride_x_b + rows[:, None] * stride_x_m + cols[None, :] * stride_x_k
        x = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    mag = tl.where(x == x, tl.abs(x), 0.0)
    if not PER_ROW:  # one scale per column or per tile: reduce over the rows
        mag = tl.max(mag, axis=0, keep_dims=True)  # [1, BLOCK_K]
    if not PER_COL:
        mag = tl.max(mag, axis=1, keep_dims=True)  # [BLOCK_M or 1, 1]
    scale, inv = e4m3_scale(mag, POW2)
    byte = e4m3_bytes(x, inv)
    qp = q_ptr + b * stride_q_b + rows[:, None] * stride_q_m + cols[None, :] * stride_q_k
    tl.store(qp, byte, mask=mask)
    sp = s_ptr + b * stride_s_b
    if PER_ROW:
        sp += rows[:, None] * stride_s_m + pid_k * stride_s_k
        smask = rows[:, None] < M
    elif PER_COL:
        sp += pid_m * stride_s_m + cols[None, :] * stride_s_k
        smask = cols[None, :] < K
    else:  # a [1, 1] block of pointers, the shape of the tile's one scale
        sp += pid_m * stride_s_m + pid_k * stride_s_k + tl.zeros([1, 1], dtype=tl.int64)
        smask = None
    tl.store(sp, scale, mask=smask)


def quantize_fp8(
    x: torch.Tensor,  # [B, M, K] bf16 / fp16 / fp32, any strides ([1, S, K] with rows)
    data: torch.Tensor,  # [B, M, K] uint8 view of the e4m3 output
    scale: torch.Tensor,  # [B, M, ⌈K/BK⌉] per row, [B, ⌈M/BM⌉, K] per col, else [B, ⌈M/BM⌉, ⌈K/BK⌉]
    per_row: bool,
    per_col: bool,
    pow2: bool,
    cfg: QuantizeConfig,
    rows: torch.Tensor | None = None,  # [M] int32: quantize x[0, rows[m]] as row m (−1: zeros)
) -> None:
    """Launch the quantization of x into ``data`` and ``scale`` (tile sides from ``cfg``)."""
    B, M, K = data.shape
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(K, cfg.block_k), B)
    launch(
        _quantize_fp8_kernel, grid, x, data, scale, rows if rows is not None else scale, M, K,
        *x.stride(), *data.stride(), *scale.stride(), BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
        PER_ROW=per_row, PER_COL=per_col, POW2=pow2, GATHER=rows is not None,
        num_warps=cfg.num_warps,
    )  # fmt: skip


@triton.jit
def _quantize_fp8_rowwise_kernel(
    x_ptr, q_ptr, s_ptr,  # pointers: x [B, M, K], q [B, M, K] uint8 (e4m3 bytes), s [B, M] fp32
    M, K,  # sizes
    stride_x_b, stride_x_m, stride_x_k,  # strides (elements)
    stride_q_b, stride_q_m, stride_q_k,
    stride_s_b, stride_s_m,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,  # meta: rows per program, K per step
    POW2: tl.constexpr,  # scales rounded up to powers of two
):  # fmt: skip
    """scale[b, m] = amax/448 over the whole row x[b, m, :] (NaN left out, 1 for an all-zero
    or empty row); q = e4m3(x · 448 / amax). Two passes over the program's BLOCK_M rows."""
    pid_m, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_in = rows[:, None] < M
    x_rows = x_ptr + b * stride_x_b + rows[:, None] * stride_x_m
    q_rows = q_ptr + b * stride_q_b + rows[:, None] * stride_q_m
    mag = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    k_steps = tl.cdiv(K, BLOCK_K)
    for ki in range(k_steps):
        cols = ki * BLOCK_K + tl.arange(0, BLOCK_K).to(tl.int64)  # times a stride: int64
        mask = row_in & (cols[None, :] < K)
        x = tl.load(x_rows + cols[None, :] * stride_x_k, mask=mask, other=0.0).to(tl.float32)
        x_mag = tl.where(x == x, tl.abs(x), 0.0)
        mag = tl.maximum(mag, tl.max(x_mag, axis=1, keep_dims=True))
    scale, inv = e4m3_scale(mag, POW2)  # [BLOCK_M, 1]
    for ki in range(k_steps):
        cols = ki * BLOCK_K + tl.arange(0, BLOCK_K).to(tl.int64)
        mask = row_in & (cols[None, :] < K)
        x = tl.load(x_rows + cols[None, :] * stride_x_k, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_rows + cols[None, :] * stride_q_k, e4m3_bytes(x, inv), mask=mask)
    tl.store(s_ptr + b * stride_s_b + rows[:, None] * stride_s_m, scale, mask=row_in)


def quantize_fp8_rowwise(
    x: torch.Tensor,  # [B, M, K] bf16 / fp16 / fp32, any strides
    data: torch.Tensor,  # [B, M, K] uint8 view of the e4m3 output
    scale: torch.Tensor,  # [B, M, 1] per row, [B, 1, K] per column
    per_row: bool,  # one scale per whole row, else per whole column
    pow2: bool,
    cfg: QuantizeConfig,
) -> None:
    """Launch the rowwise quantization of x into ``data`` and ``scale``: a per-column scale is
    the per-row one of the transposed views. ``cfg``'s block_m counts the lines (rows, or
    columns) of a program and its block_k the step along them."""
    if not per_row:
        x, data, scale = (t.transpose(1, 2) for t in (x, data, scale))
    B, M, K = x.shape
    grid = (triton.cdiv(M, cfg.block_m), B)
    launch(
        _quantize_fp8_rowwise_kernel, grid, x, data, scale, M, K, *x.stride(), *data.stride(),
        scale.stride(0), scale.stride(1), BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, POW2=pow2,
        num_warps=cfg.num_warps,
    )  # fmt: skip


@triton.jit
def _x_chunk(x_ptr, pid_m, c, cols, M, K, stride_x_m, stride_x_k, CHUNK: tl.constexpr,
             BLOCK_M: tl.constexpr):  # fmt: skip
    """(rows, mask, fp32 values, zero outside the mask) of row chunk ``c`` of the BLOCK_M-row
    block ``pid_m`` of x [M, K], at the columns ``cols``."""
    rows = pid_m * BLOCK_M + c * CHUNK + tl.arange(0, CHUNK)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    xp = x_ptr + rows.to(tl.int64)[:, None] * stride_x_m + cols[None, :] * stride_x_k
    return rows, mask, tl.load(xp, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _quantize_fp8_two_ways_kernel(
    x_ptr,  # in: x [M, K]
    q_ptr, s_ptr, qt_ptr, st_ptr,  # out: q [M, K] u8 + s [M, K/128]; qt [K, M] u8 + st [M/128, K]
    M, K,  # sizes
    stride_x_m, stride_x_k, stride_q, stride_s, stride_qt, stride_st,  # strides (elements)
    POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """x quantized 1×BLOCK_K (q, s) and BLOCK_M×1 stored transposed (qt, st) from one read of
    each [BLOCK_M, BLOCK_K] tile, walked twice in chunks of CHUNK whole rows: the first walk
    writes the row copy (its scales lie within a chunk) and keeps a running max per element,
    reduced once to the column scales; the second writes the transposed copy. Entries past M
    or K are zeros and are not stored."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    col_in = cols < K
    cmax = tl.zeros((CHUNK, BLOCK_K), dtype=tl.float32)
    for c in range(BLOCK_M // CHUNK):
        rows, mask, x = _x_chunk(x_ptr, pid_m, c, cols, M, K, stride_x_m, stride_x_k, CHUNK,
                                 BLOCK_M)  # fmt: skip
        store_fp8_rows(q_ptr, s_ptr, x, rows, cols, mask, mask, rows < M, stride_q, stride_s,
                       pid_k, POW2)  # fmt: skip
        cmax = col_amax_step(cmax, x, mask)
    scale, inv = e4m3_scale(tl.max(cmax, axis=0), POW2)
    tl.store(st_ptr + pid_m * stride_st + cols, scale, mask=col_in)
    for c in range(BLOCK_M // CHUNK):
        rows, mask, x = _x_chunk(x_ptr, pid_m, c, cols, M, K, stride_x_m, stride_x_k, CHUNK,
                                 BLOCK_M)  # fmt: skip
        store_fp8_cols(qt_ptr, x, cols, rows, mask, inv, stride_qt)


def quantize_fp8_two_ways(
    x: torch.Tensor,  # [M, K] bf16 / fp16 / fp32, any strides
    q: torch.Tensor,  # [M, K] uint8 view of the row copy's e4m3 bytes
    s: torch.Tensor,  # [M, ⌈K/128⌉] fp32
    qt: torch.Tensor,  # [K, M] uint8 view of the transposed copy's bytes
    st: torch.Tensor,  # [⌈M/128⌉, K] fp32
    pow2: bool,
    cfg: TileWalkConfig,
) -> None:
    """Launch x's 1×128 and 128×1 (transposed) quantizations in one pass."""
    M, K = x.shape
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(K, cfg.block_n))
    launch(
        _quantize_fp8_two_ways_kernel, grid, x, q, s, qt, st, M, K, *x.stride(), q.stride(0),
        s.stride(0), qt.stride(0), st.stride(0), POW2=pow2, BLOCK_M=cfg.block_m,
        BLOCK_K=cfg.block_n, CHUNK=cfg.chunk, num_warps=cfg.num_warps,
    )  # fmt: skip
