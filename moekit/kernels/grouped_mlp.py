"""Fused grouped-MLP kernels: GEMMs whose epilogues apply the activation and its derivative.

Two persistent ragged-M kernels (same on-device scheduler as ``grouped_gemm``):

* ``fc1``:   h = x @ w1[e]^T (+ b1[e]);  a = act(h) * probs   — stores h (for backward) and a.
  For gated activations each tile holds the gate and up columns of the same F-range in two
  accumulators (two B loads, one A load), so the GLU is a pure register epilogue.
* ``dact``:  da = dy @ w2[e];  dh = d act(h) (da * probs);  dprobs = sum_f da * act(h)
  — the fc2 dgrad with the activation backward in its epilogue; with recompute it also
  re-materialises a = act(h) * probs for the fc2 weight gradient.

Plus two small reductions: ``segment_colsum`` (bias gradients, per-expert column sums) and the
sum of the dact kernel's per-n-tile dprobs partials (deterministic: no atomics).

w1's gate/up layout is addressed through a 5-D descriptor view [E, F / I, 2, I, H] of the
[E, 2F, H] weight: I = F for "[gate | up]" halves, I = glu_interleave otherwise. A tile of
BLOCK_N F-columns reads rows [f % I, f % I + BLOCK_N) of chunk f // I, half 0 (gate) or 1
(up); BLOCK_N must divide I (or I = F, where the TMA bound clips the tail at F).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekit.activations import Activation
from moekit.config import interpret_mode
from moekit.kernels.descriptors import matrix_desc, stacked_desc
from moekit.kernels.grouped_gemm import persistent_launch
from moekit.kernels.ragged import (
    next_deal_start,
    ragged_m_schedule,
    ragged_m_tile,
    ragged_rows_at,
    ragged_rows_desc,
    split_small_experts,
)
from moekit.runtime.intmath import cdiv
from moekit.runtime.replay import launch
from moekit.tuning.grouped_gemm import GemmConfig

__all__ = [
    "ACT_CODES",
    "act_bwd",
    "act_fwd",
    "gate_cols",
    "grouped_mlp_dact",
    "grouped_mlp_fc1",
    "segment_colsum",
]

# activation codes (constexpr ACT); names as in moekit.activations
ACT_CODES = {"swiglu": 0, "geglu": 1, "clamped_swiglu": 2, "relu2": 3, "gelu": 4, "silu": 5}


@triton.jit
def _gelu_and_grad(x):
    # exact (erf) GELU and its derivative, like torch.nn.functional.gelu's default
    cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
    pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
    return x * cdf, cdf + x * pdf


@triton.jit
def _silu_and_grad(x, alpha):
    s = tl.sigmoid(alpha * x)
    return x * s, s + alpha * x * s * (1.0 - s)


@triton.jit
def act_fwd(g, u, ACT: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
             OFFSET: tl.constexpr):  # fmt: skip
    """act(g, u) in fp32; ungated activations ignore u."""
    out, _, _ = act_bwd(g, u, g, ACT, LIMIT, ALPHA, OFFSET)  # the gradients are dead code
    return out


@triton.jit
def act_bwd(g, u, d, ACT: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
             OFFSET: tl.constexpr):  # fmt: skip
    """(act(g, u), d/dg, d/du) for an upstream gradient d, all fp32."""
    if ACT == 0:
        s, ds = _silu_and_grad(g, 1.0)
        out = s * u
        dg = d * u * ds
        du = d * s
    elif ACT == 1:
        s, ds = _gelu_and_grad(g)
        out = s * u
        dg = d * u * ds
        du = d * s
    elif ACT == 2:
        # clamp's gradient passes where the input is inside the closed interval (torch's rule)
        gc = tl.minimum(g, LIMIT)
        uc = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        s, ds = _silu_and_grad(gc, ALPHA)
        out = s * (uc + OFFSET)
        dg = tl.where(g <= LIMIT, d * (uc + OFFSET) * ds, 0.0)
        du = tl.where((u >= -LIMIT) & (u <= LIMIT), d * s, 0.0)
    elif ACT == 3:
        r = tl.maximum(g, 0.0)
        out = r * r
        dg = d * 2.0 * r
        du = dg
    elif ACT == 4:
        out, ds = _gelu_and_grad(g)
        dg = d * ds
        du = dg
    else:
        out, ds = _silu_and_grad(g, 1.0)
        dg = d * ds
        du = dg
    return out, dg, du


@triton.jit
def gate_cols(f, I):
    # column of gate unit f in a [.., 2F] gated tensor; its up column is I further on
    return (f // I) * 2 * I + f % I


@triton.jit
def _ragged_glu_desc(ptr, R, F, I, stride, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """Descriptor over a gated [R, 2F] pre-activation (or its gradient) that clips rows at a
    per-access expert end (the ``ragged_rows_desc`` trick, same coordinates and the same
    precondition end >= BLOCK_M) and columns at each GLU block.

    5-D: [R, BLOCK_M, F / I, 2, I] with strides [stride, stride, 2I, I, 1] and base ``ptr``. The
    gate columns of F-units [f, f + C) are block (f // I, 0, f % I), the up columns
    (f // I, 1, f % I); with halves (I = F) the TMA bound clips a tile's tail at F instead of
    spilling into the up half. (Ungated tensors [R, F] use the 3-D ``ragged_rows_desc``.)
    """
    return tl.make_tensor_descriptor(
        ptr, shape=[tl.maximum(R, 1), BLOCK_M, F // I, 2, I],
        strides=[stride, stride, 2 * I, I, 1], block_shape=[1, BLOCK_M, 1, 1, BLOCK_C],
    )  # fmt: skip


@triton.jit
def _grouped_mlp_fc1_kernel(
    x_ptr, w1_ptr,  # in: [R, H], [E, W1, H] with W1 = 2F (gated) or F, unit stride along H
    h_ptr, a_ptr,  # out: [R, W1] pre-activation (if STORE_H), [R, F] activation
    probs_ptr, b1_ptr, offsets_ptr,  # [R] (if HAS_PROBS), [E, W1] (if HAS_BIAS), [E]
    R, H, F, E, I,  # sizes
    stride_x, stride_w1_e, stride_w1_r, stride_h, stride_a, stride_b1,  # strides
    GATED: tl.constexpr, ACT: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,  # meta
    OFFSET: tl.constexpr, HAS_PROBS: tl.constexpr, HAS_BIAS: tl.constexpr,
    STORE_H: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr,
):  # fmt: skip
    dtype = a_ptr.dtype.element_ty
    pid = tl.program_id(0)
    offs_e, starts, ends, m_tiles, cum_m_tiles, total_m = ragged_m_schedule(
        offsets_ptr, E, R, BLOCK_M, BLOCK_E
    )
    num_n = tl.cdiv(F, BLOCK_N)
    k_tiles = tl.cdiv(H, BLOCK_K)
    x_desc = matrix_desc(x_ptr, R, H, stride_x, BLOCK_M, BLOCK_K)
    if GATED:
        w_desc = tl.make_tensor_descriptor(
            w1_ptr, shape=[E, F // I, 2, I, H],
            strides=[stride_w1_e, 2 * I * stride_w1_r, I * stride_w1_r, stride_w1_r, 1],
            block_shape=[1, 1, 1, BLOCK_N, BLOCK_K],
        )  # fmt: skip
    else:
        w_desc = stacked_desc(w1_ptr, E, F, H, stride_w1_e, stride_w1_r, BLOCK_N, BLOCK_K)

    for tile in tl.range(pid, total_m * num_n, NUM_PROGRAMS, flatten=FLATTEN):
        e, off_m, row_end, pid_n = ragged_m_tile(
            tile, offs_e, starts, ends, m_tiles, cum_m_tiles, total_m, num_n, BLOCK_M, GROUP_M
        )
        off_f = pid_n * BLOCK_N
        chunk = off_f // I
        within = off_f % I
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            xa = x_desc.load([off_m, off_k])
            if GATED:
                wg = w_desc.load([e, chunk, 0, within, off_k]).reshape(BLOCK_N, BLOCK_K)
                wu = w_desc.load([e, chunk, 1, within, off_k]).reshape(BLOCK_N, BLOCK_K)
                acc_g = tl.dot(xa, tl.trans(wg), acc_g)
                acc_u = tl.dot(xa, tl.trans(wu), acc_u)
            else:
                wg = w_desc.load([e, off_f, off_k]).reshape(BLOCK_N, BLOCK_K)
                acc_g = tl.dot(xa, tl.trans(wg), acc_g)

        rows = off_m + tl.arange(0, BLOCK_M)
        f = off_f + tl.arange(0, BLOCK_N)
        row_ok = rows < row_end
        mask = row_ok[:, None] & (f < F)[None, :]
        if GATED:
            gcol = gate_cols(f, I)
        else:
            gcol = f
        if HAS_BIAS:
            bias_row = b1_ptr + e.to(tl.int64) * stride_b1
            acc_g += tl.load(bias_row + gcol, mask=f < F, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_u += tl.load(bias_row + gcol + I, mask=f < F, other=0.0).to(tl.float32)[None, :]
        if STORE_H:
            h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
            tl.store(h_rows + gcol[None, :], acc_g.to(dtype), mask=mask)
            if GATED:
                tl.store(h_rows + (gcol + I)[None, :], acc_u.to(dtype), mask=mask)
        out = act_fwd(acc_g, acc_u, ACT, LIMIT, ALPHA, OFFSET)
        if HAS_PROBS:
            p = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            out = out * p[:, None]
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_a + f[None, :]
        tl.store(a_ptrs, out.to(dtype), mask=mask)


@triton.jit
def _dact_epilogue(
    acc, off_m, row_end, off_f, F, I, h_desc, dh_desc, a_desc, h_ptr, dh_ptr, a_ptr,
    stride_h, stride_dh, stride_a, probs_ptr,
    GATED: tl.constexpr, ACT: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
    OFFSET: tl.constexpr, HAS_PROBS: tl.constexpr, STORE_A: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BY_TMA: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_C] slice of the dact epilogue; returns its dprobs partial [BLOCK_M].

    Rows past the expert's end load h = 0 and are dropped by the stores; columns past F load
    h = 0 and da = 0 (w2 is clipped at F). act(0) = 0 for every activation, so neither adds to
    the dprobs partial: no masks needed. ``BY_TMA`` False (experts ending within the first
    BLOCK_M rows, which the row-bounded descriptors cannot bound) loads and stores through
    masked pointers instead.
    """
    dtype = dh_desc.dtype
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_f + tl.arange(0, BLOCK_C)
    j, i = ragged_rows_at(off_m, row_end, BLOCK_M)
    fb = off_f // I
    fi = off_f % I
    mask = (rows < row_end)[:, None] & (cols < F)[None, :]
    if GATED:
        gcol = gate_cols(cols, I)
    else:
        gcol = cols
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    if BY_TMA:
        if GATED:
            hg = h_desc.load([j, i, fb, 0, fi]).reshape(BLOCK_M, BLOCK_C).to(tl.float32)
            hu = h_desc.load([j, i, fb, 1, fi]).reshape(BLOCK_M, BLOCK_C).to(tl.float32)
        else:
            hg = h_desc.load([j, i, off_f]).reshape(BLOCK_M, BLOCK_C).to(tl.float32)
            hu = hg
    else:
        hg = tl.load(h_rows + gcol[None, :], mask=mask, other=0.0).to(tl.float32)
        if GATED:
            hu = tl.load(h_rows + (gcol + I)[None, :], mask=mask, other=0.0).to(tl.float32)
        else:
            hu = hg
    if HAS_PROBS:
        p = tl.load(probs_ptr + rows, mask=rows < row_end, other=0.0).to(tl.float32)
        d = acc * p[:, None]
    else:
        d = acc
    act, dg, du = act_bwd(hg, hu, d, ACT, LIMIT, ALPHA, OFFSET)
    if BY_TMA:
        if GATED:
            dh_desc.store([j, i, fb, 0, fi], dg.to(dtype).reshape(1, BLOCK_M, 1, 1, BLOCK_C))
            dh_desc.store([j, i, fb, 1, fi], du.to(dtype).reshape(1, BLOCK_M, 1, 1, BLOCK_C))
        else:
            dh_desc.store([j, i, off_f], dg.to(dtype).reshape(1, BLOCK_M, BLOCK_C))
    else:
        dh_rows = dh_ptr + rows.to(tl.int64)[:, None] * stride_dh
        tl.store(dh_rows + gcol[None, :], dg.to(dtype), mask=mask)
        if GATED:
            tl.store(dh_rows + (gcol + I)[None, :], du.to(dtype), mask=mask)
    part = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if HAS_PROBS:
        part = tl.sum(acc * act, axis=1)
        if STORE_A:
            act = act * p[:, None]
    if STORE_A:
        if BY_TMA:
            a_desc.store([j, i, off_f], act.to(dtype).reshape(1, BLOCK_M, BLOCK_C))
        else:
            a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_a + cols[None, :]
            tl.store(a_ptrs, act.to(dtype), mask=mask)
    return part


@triton.jit
def _dact_tile(
    e, off_m, row_end, pid_n, dy_desc, w_desc, F, I, k_tiles, h_desc, dh_desc, a_desc,
    h_ptr, dh_ptr, a_ptr, stride_h, stride_dh, stride_a, probs_ptr, dprobs_part_ptr,
    stride_part, GATED: tl.constexpr, ACT: tl.constexpr, LIMIT: tl.constexpr,
    ALPHA: tl.constexpr, OFFSET: tl.constexpr, HAS_PROBS: tl.constexpr, STORE_A: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SUBTILE: tl.constexpr, BY_TMA: tl.constexpr,
):  # fmt: skip
    """One (m-tile, F-tile) of the dact kernel: dy @ w2[e] and the fused epilogue."""
    EPI_N: tl.constexpr = BLOCK_N // 2 if SUBTILE else BLOCK_N
    off_f = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k_tiles):
        off_k = ki * BLOCK_K
        g = dy_desc.load([off_m, off_k])
        w = w_desc.load([e, off_k, off_f]).reshape(BLOCK_K, BLOCK_N)
        acc = tl.dot(g, w, acc)

    if SUBTILE:
        acc0, acc1 = tl.split(acc.reshape(BLOCK_M, 2, EPI_N).permute(0, 2, 1))
        part = _dact_epilogue(
            acc0, off_m, row_end, off_f, F, I, h_desc, dh_desc, a_desc, h_ptr, dh_ptr, a_ptr,
            stride_h, stride_dh, stride_a, probs_ptr,
            GATED, ACT, LIMIT, ALPHA, OFFSET, HAS_PROBS, STORE_A, BLOCK_M, EPI_N, BY_TMA,
        )  # fmt: skip
        part += _dact_epilogue(
            acc1, off_m, row_end, off_f + EPI_N, F, I, h_desc, dh_desc, a_desc, h_ptr,
            dh_ptr, a_ptr, stride_h, stride_dh, stride_a, probs_ptr,
            GATED, ACT, LIMIT, ALPHA, OFFSET, HAS_PROBS, STORE_A, BLOCK_M, EPI_N, BY_TMA,
        )  # fmt: skip
    else:
        part = _dact_epilogue(
            acc, off_m, row_end, off_f, F, I, h_desc, dh_desc, a_desc, h_ptr, dh_ptr, a_ptr,
            stride_h, stride_dh, stride_a, probs_ptr,
            GATED, ACT, LIMIT, ALPHA, OFFSET, HAS_PROBS, STORE_A, BLOCK_M, EPI_N, BY_TMA,
        )  # fmt: skip
    if HAS_PROBS:
        rows = off_m + tl.arange(0, BLOCK_M)
        tl.store(dprobs_part_ptr + pid_n * stride_part + rows, part, mask=rows < row_end)


@triton.jit
def _grouped_mlp_dact_kernel(
    # in: dy [R, H], w2 [E, H, F] (unit stride along F), h [R, W1] saved pre-activation,
    # probs [R] (if HAS_PROBS)
    dy_ptr, w2_ptr, h_ptr, probs_ptr,
    # out: dh [R, W1]; dprobs_part [num_n, R] fp32, one partial per F-tile (if HAS_PROBS);
    # a [R, F], the recomputed act(h) * probs (if STORE_A)
    dh_ptr, dprobs_part_ptr, a_ptr,
    offsets_ptr,  # [E]
    R, H, F, E, I,  # sizes
    stride_dy, stride_w2_e, stride_w2_h, stride_h, stride_dh, stride_part, stride_a,  # strides
    GATED: tl.constexpr, ACT: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,  # meta
    OFFSET: tl.constexpr, HAS_PROBS: tl.constexpr, STORE_A: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr, SUBTILE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_e, starts, ends, m_tiles, _, _ = ragged_m_schedule(offsets_ptr, E, R, BLOCK_M, BLOCK_E)
    num_n = tl.cdiv(F, BLOCK_N)
    k_tiles = tl.cdiv(H, BLOCK_K)
    dy_desc = matrix_desc(dy_ptr, R, H, stride_dy, BLOCK_M, BLOCK_K)
    w_desc = stacked_desc(w2_ptr, E, H, F, stride_w2_e, stride_w2_h, BLOCK_K, BLOCK_N)
    # The epilogue works on column slices of EPI_N (two halves with SUBTILE: fewer live
    # registers), through TMA: bulk h loads and dh / a stores clipped at the expert's end.
    EPI_N: tl.constexpr = BLOCK_N // 2 if SUBTILE else BLOCK_N
    if GATED:
        h_desc = _ragged_glu_desc(h_ptr, R, F, I, stride_h, BLOCK_M, EPI_N)
        dh_desc = _ragged_glu_desc(dh_ptr, R, F, I, stride_dh, BLOCK_M, EPI_N)
    else:
        h_desc = ragged_rows_desc(h_ptr, R, F, stride_h, BLOCK_M, EPI_N)
        dh_desc = ragged_rows_desc(dh_ptr, R, F, stride_dh, BLOCK_M, EPI_N)
    a_desc = ragged_rows_desc(a_ptr, R, F, stride_a, BLOCK_M, EPI_N)

    # Experts ending within the first BLOCK_M rows cannot be bounded by the row-bounded
    # descriptors: their tiles (one m-tile each) run after the main loop with pointer loads
    # and stores, keeping the main loop's epilogue free of data-dependent branches.
    main_m, cum_main, total_main, small_m, cum_small, total_small = split_small_experts(
        ends, m_tiles, BLOCK_M
    )
    for tile in tl.range(pid, total_main * num_n, NUM_PROGRAMS, flatten=FLATTEN):
        e, off_m, row_end, pid_n = ragged_m_tile(
            tile, offs_e, starts, ends, main_m, cum_main, total_main, num_n, BLOCK_M, GROUP_M
        )
        _dact_tile(
            e, off_m, row_end, pid_n, dy_desc, w_desc, F, I, k_tiles, h_desc, dh_desc, a_desc,
            h_ptr, dh_ptr, a_ptr, stride_h, stride_dh, stride_a, probs_ptr, dprobs_part_ptr,
            stride_part, GATED, ACT, LIMIT, ALPHA, OFFSET, HAS_PROBS, STORE_A, BLOCK_M,
            BLOCK_N, BLOCK_K, SUBTILE, True,
        )  # fmt: skip
    small_start = next_deal_start(pid, total_main * num_n, NUM_PROGRAMS)
    for tile in tl.range(small_start, total_small * num_n, NUM_PROGRAMS):
        e, off_m, row_end, pid_n = ragged_m_tile(
            tile, offs_e, starts, ends, small_m, cum_small, total_small, num_n, BLOCK_M, 1
        )
        _dact_tile(
            e, off_m, row_end, pid_n, dy_desc, w_desc, F, I, k_tiles, h_desc, dh_desc, a_desc,
            h_ptr, dh_ptr, a_ptr, stride_h, stride_dh, stride_a, probs_ptr, dprobs_part_ptr,
            stride_part, GATED, ACT, LIMIT, ALPHA, OFFSET, HAS_PROBS, STORE_A, BLOCK_M,
            BLOCK_N, BLOCK_K, SUBTILE, False,
        )  # fmt: skip

    if HAS_PROBS:
        # Rows past offsets[-1] belong to no expert: their partials are zero (prob grad 0).
        tail_start = tl.max(ends, axis=0)
        zeros = tl.zeros((BLOCK_M,), dtype=tl.float32)
        tail_tiles = tl.cdiv(R - tail_start, BLOCK_M) * num_n
        tail_first = next_deal_start(pid, (total_main + total_small) * num_n, NUM_PROGRAMS)
        for tile in tl.range(tail_first, tail_tiles, NUM_PROGRAMS):
            rows = tail_start + (tile // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
            tl.store(dprobs_part_ptr + (tile % num_n) * stride_part + rows, zeros, mask=rows < R)


@triton.jit
def _segment_colsum_kernel(
    x_ptr, out_ptr,  # [T, N]; out [S, N]: column sums of each segment, in out's dtype
    offsets_ptr,  # [S] cumulative end offsets (if HAS_OFFSETS; else one segment [0, T))
    T, N, stride_x, stride_out,
    HAS_OFFSETS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # One program per (segment, column block): a deterministic fp32 sum, no atomics, no memset.
    seg = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_OFFSETS:
        end = tl.minimum(tl.maximum(tl.load(offsets_ptr + seg).to(tl.int32), 0), T)
        start = tl.where(seg > 0, tl.load(offsets_ptr + seg - 1, mask=seg > 0, other=0), 0)
        start = tl.minimum(tl.maximum(start.to(tl.int32), 0), end)
    else:
        start = 0
        end = T
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :]
        acc += tl.load(ptrs, mask=(rows < end)[:, None] & (cols < N)[None, :],
                       other=0.0).to(tl.float32)  # fmt: skip
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + seg * stride_out + cols, total.to(out_ptr.dtype.element_ty), mask=cols < N)


def grouped_mlp_fc1(
    x: torch.Tensor,  # [R, H], TMA-ready rows
    w1: torch.Tensor,  # [E, W1, H], TMA-ready rows
    offsets: torch.Tensor,  # [E], contiguous
    a_out: torch.Tensor,  # [R, F] contiguous rows
    h_out: torch.Tensor | None,  # [R, W1] or None (do not store the pre-activation)
    probs: torch.Tensor | None,  # [R]
    b1: torch.Tensor | None,  # [E, W1] unit stride along W1
    act: Activation,
    interleave: int | None,  # None = [gate | up] halves
    config: GemmConfig,
) -> None:
    """a = act(x @ w1[e]^T + b1[e]) * probs per expert segment; h (pre-activation) if asked."""
    R, H = x.shape
    E = w1.shape[0]
    F = a_out.shape[1]
    grid, meta = persistent_launch(config, E, x)
    dummy = a_out
    launch(
        _grouped_mlp_fc1_kernel, grid,
        x, w1, h_out if h_out is not None else dummy, a_out,
        probs if probs is not None else dummy, b1 if b1 is not None else dummy, offsets,
        R, H, F, E, interleave or F,
        x.stride(0), w1.stride(0), w1.stride(1),
        h_out.stride(0) if h_out is not None else 0, a_out.stride(0),
        b1.stride(0) if b1 is not None else 0,
        GATED=act.gated, ACT=ACT_CODES[act.name], LIMIT=act.limit, ALPHA=act.alpha,
        OFFSET=act.offset, HAS_PROBS=probs is not None, HAS_BIAS=b1 is not None,
        STORE_H=h_out is not None, **meta,
    )  # fmt: skip


def grouped_mlp_dact(
    dy: torch.Tensor,  # [R, H], TMA-ready rows
    w2: torch.Tensor,  # [E, H, F], TMA-ready rows
    offsets: torch.Tensor,  # [E], contiguous
    h: torch.Tensor,  # [R, W1] saved pre-activation
    probs: torch.Tensor | None,  # [R]
    dh_out: torch.Tensor,  # [R, W1]
    a_out: torch.Tensor | None,  # [R, F]: recomputed act(h) * probs, or None
    part_out: torch.Tensor | None,  # [>= cdiv(F, BLOCK_N), R] fp32, with probs
    act: Activation,
    interleave: int | None,
    config: GemmConfig,
) -> torch.Tensor | None:
    """dh = act'(h) · ((dy @ w2[e]) * probs).

    With probs, also writes the per-F-tile partials of dprobs (Σ over the tile's columns of
    da · act(h)) into the first ``cdiv(F, BLOCK_N)`` rows of ``part_out`` and returns that view
    (sum its rows for dprobs); the caller allocates ``part_out`` so that every buffer of the
    op's launches is its own. Returns None without probs.
    """
    R, H = dy.shape
    E, _, F = w2.shape
    grid, meta = persistent_launch(config, E, dy)
    num_n = cdiv(F, config.block_n)
    part = part_out[:num_n] if probs is not None else None
    launch(
        _grouped_mlp_dact_kernel, grid,
        dy, w2, h, probs if probs is not None else dh_out, dh_out,
        part if part is not None else dh_out, a_out if a_out is not None else dh_out,
        offsets,
        R, H, F, E, interleave or F,
        dy.stride(0), w2.stride(0), w2.stride(1), h.stride(0), dh_out.stride(0),
        part.stride(0) if part is not None else 0,
        a_out.stride(0) if a_out is not None else F,  # a valid (unused) descriptor stride
        GATED=act.gated, ACT=ACT_CODES[act.name], LIMIT=act.limit, ALPHA=act.alpha,
        OFFSET=act.offset, HAS_PROBS=probs is not None, STORE_A=a_out is not None,
        SUBTILE=config.block_n >= 32, **meta,
    )  # fmt: skip
    return part


def segment_colsum(
    x: torch.Tensor,  # [T, N], unit stride along N
    offsets: torch.Tensor | None,  # [S] cumulative end offsets, or None for one segment
    out: torch.Tensor,  # [S, N] (S = 1 without offsets), unit stride along N
) -> torch.Tensor:
    """Column sums of each row segment of x, accumulated in fp32, written in out's dtype."""
    T, N = x.shape
    S = out.shape[0]
    block_n = 32 if interpret_mode() else 256
    grid = (S, cdiv(N, block_n))
    launch(
        _segment_colsum_kernel, grid,
        x, out, offsets if offsets is not None else out,
        T, N, x.stride(0), out.stride(0),
        HAS_OFFSETS=offsets is not None, BLOCK_R=16, BLOCK_N=block_n,
    )  # fmt: skip
    return out
