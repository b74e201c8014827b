"""Grouped GEMM for Mixture-of-Experts: every expert in one persistent launch.

Two forms, both with fp32 accumulation, TMA tensor descriptors and an on-device tile scheduler:

* ragged M (forward, dgrad):  c[T, N] = a[T, K] @ b[e][K, N] for the rows of expert e
* ragged K (weight gradient): c[e][M, N] = a[M, Te] @ b[Te, N] over the columns of expert e

``offsets`` [E] holds cumulative end offsets (the ``torch._grouped_mm`` convention) and is read
only on the device: the grid is one program per SM and every tile's expert is derived in the
kernel from ``offsets``, so nothing is synchronised with the host and launches are graph-capturable.

Ragged M uses the shared scheduler of :mod:`moekit.kernels.ragged`; rows in [offsets[-1], T)
are zero-filled by the same launch.

Ragged-K scheduler. Tiles are (expert, m-tile, n-tile), a static count, ranked by decreasing expert
row count (an in-kernel sort). Each tile loads through descriptors whose T-extent is end_e, so the
TMA engine zero-fills the K tail and no other expert's rows leak into the sum. Programs either
take tiles round-robin or (``GemmConfig.dynamic``) from a self-resetting atomic counter, which
balances skewed routings. With ``GemmConfig.flatten`` a program runs all K steps of its static
share as one pipelined loop, so its next tile's loads are in flight during this tile's epilogue.
With both, the kernel picks one of the two from the routing, on the device.

The launchers take a :class:`~moekit.tuning.grouped_gemm.GemmConfig`; choosing it is
:mod:`moekit.tuning.grouped_gemm`'s job.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekit.config import interpret_mode
from moekit.kernels.descriptors import matrix_desc, stacked_desc
from moekit.kernels.ragged import (
    expert_bounds,
    next_deal_start,
    ragged_m_schedule,
    ragged_m_tile,
    ragged_rows_at,
    ragged_rows_desc,
    split_columns,
    split_small_experts,
    store_c_tile,
    store_rows,
    swizzle_tile,
)
from moekit.runtime.device import ensure_scratch_allocator, num_sms, tile_counter
from moekit.runtime.intmath import next_power_of_2
from moekit.runtime.replay import launch
from moekit.runtime.tma import tma_ready
from moekit.tuning.grouped_gemm import GemmConfig

__all__ = [
    "SCALE_BLOCKWISE",
    "SCALE_NONE",
    "SCALE_ROWWISE",
    "grouped_mm_fp8_wgrad",
    "grouped_mm_ragged_k",
    "grouped_mm_ragged_m",
    "persistent_launch",
]

# SCALE_MODE of the ragged-M kernel (see _ragged_m_acc)
SCALE_NONE = 0  # bf16 / fp16 / fp32 operands
SCALE_BLOCKWISE = 1  # FP8, promoted to fp32 once per BLOCK_K of K
SCALE_ROWWISE = 2  # FP8, scaled once per output element
_SCALE_NONE = tl.constexpr(SCALE_NONE)
_SCALE_BLOCKWISE = tl.constexpr(SCALE_BLOCKWISE)
_SCALE_ROWWISE = tl.constexpr(SCALE_ROWWISE)


@triton.jit
def _ragged_m_acc(
    a_desc, b_desc, bias_ptr, e, off_m, off_n, N, k_tiles, stride_bias_e,
    B_K_MAJOR: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    row_end=0, A_BOUNDED: tl.constexpr = False,
    sa_ptr=None, sb_ptr=None, T=0, stride_sa_t=0, stride_sb_e=0, stride_sb_n=0,
    SCALE_MODE: tl.constexpr = SCALE_NONE,
):  # fmt: skip
    """fp32 [BM, BN] tile of a[off_m:] @ b[e][:, off_n:] (+ bias[e]) for the ragged-M GEMM.
    A_BOUNDED: ``a_desc`` is a ragged_rows_desc and rows >= row_end load as zeros.

    SCALE_MODE (FP8: a and b e4m3, b[e] stored [N, K]; fp32 scales):

    * SCALE_BLOCKWISE: one scale per 1×BLOCK_K block of a's rows (``sa`` [T, ⌈K/BK⌉]) and per
      BLOCK_K×BLOCK_K block of b[e] (``sb`` [E, ⌈N/BK⌉, ⌈K/BK⌉]); each block of K is promoted
      to fp32 on its own, ``acc += dot(a_k, b_k) · (sa_k · sb_k)``, so no long K accumulates
      in the tensor cores' reduced-precision FP8 sums. Needs BLOCK_N ≤ BLOCK_K (one b scale
      per tile and K block).
    * SCALE_ROWWISE: one scale per row of a (``sa`` [T, 1]) and per output channel of b[e]
      (``sb`` [E, N, 1]): the whole K accumulates in the tensor cores as in the unscaled
      GEMM, scaled once at the end, ``acc · sa[rows] · sb[e, cols]``."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if A_BOUNDED:
        a_j, a_i = ragged_rows_at(off_m, row_end, BLOCK_M)
    if SCALE_MODE != _SCALE_NONE:
        rows = off_m + tl.arange(0, BLOCK_M)
        sa_rows = sa_ptr + rows.to(tl.int64) * stride_sa_t
    if SCALE_MODE == _SCALE_BLOCKWISE:
        sb_tile = sb_ptr + e.to(tl.int64) * stride_sb_e + (off_n // BLOCK_K) * stride_sb_n
    for ki in range(k_tiles):
        off_k = ki * BLOCK_K
        if A_BOUNDED:
            a = a_desc.load([a_j, a_i, off_k]).reshape(BLOCK_M, BLOCK_K)
        else:
            a = a_desc.load([off_m, off_k])
        if B_K_MAJOR:
            b = tl.trans(b_desc.load([e, off_n, off_k]).reshape(BLOCK_N, BLOCK_K))
        else:
            b = b_desc.load([e, off_k, off_n]).reshape(BLOCK_K, BLOCK_N)
        if SCALE_MODE == _SCALE_BLOCKWISE:
            s = tl.load(sa_rows + ki, mask=rows < T, other=0.0) * tl.load(sb_tile + ki)
            acc += tl.dot(a, b) * s[:, None]
        else:
            acc = tl.dot(a, b, acc)
    if SCALE_MODE == _SCALE_ROWWISE:
        cols = off_n + tl.arange(0, BLOCK_N)
        sa = tl.load(sa_rows, mask=rows < T, other=0.0)
        sb = tl.load(sb_ptr + e.to(tl.int64) * stride_sb_e + cols * stride_sb_n, mask=cols < N,
                     other=0.0)  # fmt: skip
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        cols = off_n + tl.arange(0, BLOCK_N)
        bias = tl.load(bias_ptr + e * stride_bias_e + cols, mask=cols < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    return acc


@triton.jit
def _grouped_mm_ragged_m_kernel(
    # pointers: a [T, K], b [E, K, N] (any two unit-stride layouts, see B_K_MAJOR), c [T, N],
    # bias [E, N] or dummy, offsets [E] cumulative end offsets
    a_ptr, b_ptr, c_ptr, bias_ptr, offsets_ptr,
    T, N, K, E,  # sizes
    stride_a_t, stride_b_e, stride_b_k, stride_b_n, stride_c_t, stride_bias_e,  # strides
    # meta; B_K_MAJOR: b[e] stored [N, K] (an nn.Linear weight viewed transposed)
    B_K_MAJOR: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr, C_TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr, EPI_SUBTILE: tl.constexpr, EXPERT_GROUPS: tl.constexpr,
    A_BOUNDED: tl.constexpr = False, ZERO_TAIL: tl.constexpr = True,
    # FP8 (see _ragged_m_acc): fp32 scales sa [T, ⌈K/BK⌉] and sb [E, ⌈N/BK⌉, ⌈K/BK⌉]
    # (SCALE_BLOCKWISE) or sa [T, 1] and sb [E, N, 1] (SCALE_ROWWISE)
    sa_ptr=None, sb_ptr=None, stride_sa_t=0, stride_sb_e=0, stride_sb_n=0,
    SCALE_MODE: tl.constexpr = SCALE_NONE,
):  # fmt: skip
    dtype = c_ptr.dtype.element_ty
    pid = tl.program_id(0)
    EPI_N: tl.constexpr = BLOCK_N // 2 if EPI_SUBTILE else BLOCK_N

    offs_e, starts, ends, m_tiles, _, _ = ragged_m_schedule(offsets_ptr, E, T, BLOCK_M, BLOCK_E)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)

    a_desc = matrix_desc(a_ptr, T, K, stride_a_t, BLOCK_M, BLOCK_K)
    if B_K_MAJOR:
        b_desc = stacked_desc(b_ptr, E, N, K, stride_b_e, stride_b_n, BLOCK_N, BLOCK_K)
    else:
        b_desc = stacked_desc(b_ptr, E, K, N, stride_b_e, stride_b_k, BLOCK_K, BLOCK_N)
    c_desc = matrix_desc(c_ptr, T, N, stride_c_t, BLOCK_M, BLOCK_N)
    c_ragged = ragged_rows_desc(c_ptr, T, N, stride_c_t, BLOCK_M, EPI_N)
    a_main = a_desc
    if A_BOUNDED:
        a_main = ragged_rows_desc(a_ptr, T, K, stride_a_t, BLOCK_M, BLOCK_K)

    # Experts ending within the first BLOCK_M rows cannot be bounded by c_ragged (see
    # ragged_rows_desc). Their tiles (one m-tile each) leave the main loop's schedule and
    # are done after it with pointer stores: a data-dependent branch inside the loop would
    # break Triton's loop flattening (FuseNestedLoops), and the TMA engine rejects a store
    # at a negative coordinate (illegal instruction).
    main_m, cum_main, total_main, small_m, cum_small, total_small = split_small_experts(
        ends, m_tiles, BLOCK_M
    )
    for tile in tl.range(
        pid, total_main * num_n, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPEC
    ):
        e, off_m, row_end, pid_n = ragged_m_tile(
            tile, offs_e, starts, ends, main_m, cum_main, total_main, num_n, BLOCK_M, GROUP_M,
            EXPERT_GROUPS,
        )  # fmt: skip
        off_n = pid_n * BLOCK_N
        acc = _ragged_m_acc(
            a_main, b_desc, bias_ptr, e, off_m, off_n, N, k_tiles, stride_bias_e, B_K_MAJOR,
            HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, row_end, A_BOUNDED,
            sa_ptr, sb_ptr, T, stride_sa_t, stride_sb_e, stride_sb_n, SCALE_MODE,
        )  # fmt: skip
        if C_TMA:
            # Bounded at the expert's end: the next expert's rows belong to another program.
            j, i = ragged_rows_at(off_m, row_end, BLOCK_M)
            store_c_tile(c_ragged, j, i, off_n, acc.to(dtype), BLOCK_M, BLOCK_N, EPI_SUBTILE)
        else:
            store_rows(c_ptr, acc.to(dtype), off_m, off_n, row_end, N, stride_c_t,
                        BLOCK_M, BLOCK_N)  # fmt: skip

    small_start = next_deal_start(pid, total_main * num_n, NUM_PROGRAMS)
    for tile in tl.range(small_start, total_small * num_n, NUM_PROGRAMS):
        e, off_m, row_end, pid_n = ragged_m_tile(
            tile, offs_e, starts, ends, small_m, cum_small, total_small, num_n, BLOCK_M, 1
        )
        off_n = pid_n * BLOCK_N
        acc = _ragged_m_acc(
            a_desc, b_desc, bias_ptr, e, off_m, off_n, N, k_tiles, stride_bias_e, B_K_MAJOR,
            HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, 0, False,
            sa_ptr, sb_ptr, T, stride_sa_t, stride_sb_e, stride_sb_n, SCALE_MODE,
        )  # fmt: skip
        store_rows(c_ptr, acc.to(dtype), off_m, off_n, row_end, N, stride_c_t,
                    BLOCK_M, BLOCK_N)  # fmt: skip

    if ZERO_TAIL:
        # Rows past offsets[-1] belong to no expert: zero them here rather than in a memset.
        tail_start = tl.max(ends, axis=0)
        tail_tiles = tl.cdiv(T - tail_start, BLOCK_M) * num_n
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=dtype)
        tail_first = next_deal_start(pid, (total_main + total_small) * num_n, NUM_PROGRAMS)
        for tile in tl.range(tail_first, tail_tiles, NUM_PROGRAMS):
            c_desc.store([tail_start + (tile // num_n) * BLOCK_M, (tile % num_n) * BLOCK_N], zeros)


@triton.jit
def _ragged_k_locate(
    tile, order, offs_e, starts, ends, num_m, num_n, per_expert,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Tile index → (expert, first row of C, first column of C, expert's [start, end) along T).
    Tiles are ranked by expert (decreasing row count), then swizzled within the expert."""
    rank = tile // per_expert
    e = tl.sum(tl.where(offs_e == rank, order, 0), axis=0)
    pid_m, pid_n = swizzle_tile(tile % per_expert, num_m, num_n, GROUP_M)
    start = tl.sum(tl.where(offs_e == e, starts, 0), axis=0)
    end = tl.sum(tl.where(offs_e == e, ends, 0), axis=0)
    return e, pid_m * BLOCK_M, pid_n * BLOCK_N, start, end


@triton.jit
def _ragged_k_epilogue(
    acc, e, off_m, off_n, start, end, c_desc, c_ptr, M, N, stride_c_e, stride_c_m, stride_c_n,
    ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    C_TMA: tl.constexpr, EPI_SUBTILE: tl.constexpr, EPI_N: tl.constexpr,
):  # fmt: skip
    """Store (or add into an accumulating C) one finished [BM, BN] tile of expert e."""
    dtype = c_ptr.dtype.element_ty
    if C_TMA:
        # Bulk async store / reduce-add: the SM moves on to the next tile while the copy
        # engine drains this one, which is what hides main_grad's read-modify-write.
        if ACCUMULATE:
            if end > start:  # an expert with no columns leaves the accumulator untouched
                if EPI_SUBTILE:
                    c0, c1 = split_columns(acc, BLOCK_M, BLOCK_N)
                    c_desc.atomic_add([e, off_m, off_n], c0.reshape(1, BLOCK_M, EPI_N))
                    c_desc.atomic_add([e, off_m, off_n + EPI_N], c1.reshape(1, BLOCK_M, EPI_N))
                else:
                    c_desc.atomic_add([e, off_m, off_n], acc.reshape(1, BLOCK_M, BLOCK_N))
        else:
            store_c_tile(c_desc, e, off_m, off_n, acc.to(dtype), BLOCK_M, BLOCK_N, EPI_SUBTILE)
    else:
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        c_ptrs = (c_ptr + e.to(tl.int64) * stride_c_e + rows[:, None] * stride_c_m
                  + cols[None, :] * stride_c_n)  # fmt: skip
        if ACCUMULATE:
            if end > start:
                acc += tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
                tl.store(c_ptrs, acc.to(dtype), mask=mask)
        else:
            tl.store(c_ptrs, acc.to(dtype), mask=mask)


@triton.jit
def _ragged_k_small(
    a_ptr, b_ptr, stride_a_t, stride_b_t, off_m, off_n, start, end, M, N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """[BM, BN] partial product of an expert that ends within the first BLOCK_K rows (which a
    ragged_rows_desc cannot bound): one masked pointer-load step over rows [start, end)."""
    ks = tl.arange(0, BLOCK_K)
    k_in = (ks >= start) & (ks < end)
    am = off_m + tl.arange(0, BLOCK_M)
    bn = off_n + tl.arange(0, BLOCK_N)
    a = tl.load(
        a_ptr + ks[:, None] * stride_a_t + am[None, :],
        mask=k_in[:, None] & (am < M)[None, :], other=0.0,
    )  # fmt: skip
    b = tl.load(
        b_ptr + ks[:, None] * stride_b_t + bn[None, :],
        mask=k_in[:, None] & (bn < N)[None, :], other=0.0,
    )  # fmt: skip
    return tl.dot(tl.trans(a), b)


@triton.jit
def _ragged_k_finish(
    acc, e, off_m, off_n, start, end, a_ptr, b_ptr, c_desc, c_ptr, M, N,
    stride_a_t, stride_b_t, stride_c_e, stride_c_m, stride_c_n,
    ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, C_TMA: tl.constexpr, EPI_SUBTILE: tl.constexpr, EPI_N: tl.constexpr,
):  # fmt: skip
    """Store one finished tile: ``acc`` (its K steps through the descriptors; zeros if none),
    or, for an expert ending within the first BLOCK_K rows, _ragged_k_small's product."""
    if end < BLOCK_K:
        acc = _ragged_k_small(
            a_ptr, b_ptr, stride_a_t, stride_b_t, off_m, off_n, start, end, M, N,
            BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
    _ragged_k_epilogue(
        acc, e, off_m, off_n, start, end, c_desc, c_ptr, M, N, stride_c_e, stride_c_m,
        stride_c_n, ACCUMULATE, BLOCK_M, BLOCK_N, C_TMA, EPI_SUBTILE, EPI_N,
    )  # fmt: skip


@triton.jit
def _ragged_k_tile(
    tile, a_desc, b_desc, c_desc, a_ptr, b_ptr, c_ptr, order, offs_e, starts, ends, M, N,
    num_m, num_n, per_expert, stride_a_t, stride_b_t, stride_c_e, stride_c_m, stride_c_n,
    ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, C_TMA: tl.constexpr,
    EPI_SUBTILE: tl.constexpr, EPI_N: tl.constexpr,
):  # fmt: skip
    """One (expert, m-tile, n-tile) of the ragged-K GEMM: tile ranks experts by decreasing count."""
    e, off_m, off_n, start, end = _ragged_k_locate(
        tile, order, offs_e, starts, ends, num_m, num_n, per_expert, BLOCK_M, BLOCK_N, GROUP_M
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_steps = tl.where(end >= BLOCK_K, tl.cdiv(end - start, BLOCK_K), 0)
    for ki in range(k_steps):
        j, i = ragged_rows_at(start + ki * BLOCK_K, end, BLOCK_K)
        a = tl.trans(a_desc.load([j, i, off_m]).reshape(BLOCK_K, BLOCK_M))
        b = b_desc.load([j, i, off_n]).reshape(BLOCK_K, BLOCK_N)
        acc = tl.dot(a, b, acc)
    _ragged_k_finish(
        acc, e, off_m, off_n, start, end, a_ptr, b_ptr, c_desc, c_ptr, M, N, stride_a_t,
        stride_b_t, stride_c_e, stride_c_m, stride_c_n, ACCUMULATE, BLOCK_M, BLOCK_N, BLOCK_K,
        C_TMA, EPI_SUBTILE, EPI_N,
    )  # fmt: skip


@triton.jit
def _ragged_k_flat_loop(
    pid, a_desc, b_desc, c_desc, a_ptr, b_ptr, c_ptr, order, counts_by_rank, offs_e, in_e,
    starts, ends, M, N, num_m, num_n, per_expert, num_tiles, stride_a_t, stride_b_t,
    stride_c_e, stride_c_m, stride_c_n,
    ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    C_TMA: tl.constexpr, EPI_SUBTILE: tl.constexpr, EPI_N: tl.constexpr,
):  # fmt: skip
    """This program's round-robin share of tiles as one loop over all of its K steps.

    Triton's own loop flattening needs inner bounds invariant to the tile loop, which a
    ragged K is not, so without this every tile restarts the load pipeline: its first loads
    wait a full memory latency and the previous tile's epilogue overlaps nothing. Fused by
    hand, the pipeliner issues the next tile's first loads while this one finishes and stores.

    Experts with no rows rank last, so their tiles follow all the others; they take no K step
    and are zero-filled after the loop, or left untouched when accumulating. Experts that end
    within the first BLOCK_K rows (which the row-bounded descriptors cannot bound) rank among
    them (``counts_by_rank`` is 0 there) and are computed after the loop from pointer loads.
    """
    # counts_by_rank [BLOCK_E]: lane r holds the row count of the expert of rank r. Rank r
    # owns tiles [r * per_expert, (r + 1) * per_expert), of which those congruent to pid
    # modulo NUM_PROGRAMS are ours.
    steps_by_rank = tl.where(in_e, tl.cdiv(counts_by_rank, BLOCK_K), 0)
    first = offs_e * per_expert
    ours = ((first + per_expert - pid + NUM_PROGRAMS - 1) // NUM_PROGRAMS
            - (first - pid + NUM_PROGRAMS - 1) // NUM_PROGRAMS)  # fmt: skip
    total_steps = tl.sum(ours * steps_by_rank, axis=0)

    tile = pid - NUM_PROGRAMS
    ki = -1
    k_steps = 0
    e = 0
    off_m = 0
    off_n = 0
    start = 0
    end = 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(total_steps):
        ki = tl.where(ki == k_steps - 1, 0, ki + 1)
        if ki == 0:
            tile += NUM_PROGRAMS
            e, off_m, off_n, start, end = _ragged_k_locate(
                tile, order, offs_e, starts, ends, num_m, num_n, per_expert,
                BLOCK_M, BLOCK_N, GROUP_M,
            )  # fmt: skip
            k_steps = tl.cdiv(end - start, BLOCK_K)
        j, i = ragged_rows_at(start + ki * BLOCK_K, end, BLOCK_K)
        a = tl.trans(a_desc.load([j, i, off_m]).reshape(BLOCK_K, BLOCK_M))
        b = b_desc.load([j, i, off_n]).reshape(BLOCK_K, BLOCK_N)
        acc = tl.dot(a, b, acc)
        if ki == k_steps - 1:
            _ragged_k_epilogue(
                acc, e, off_m, off_n, start, end, c_desc, c_ptr, M, N, stride_c_e,
                stride_c_m, stride_c_n, ACCUMULATE, BLOCK_M, BLOCK_N, C_TMA, EPI_SUBTILE, EPI_N,
            )  # fmt: skip
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    # The ranks with no K step: experts with no rows (zero-filled; untouched when
    # accumulating) and those ending within the first BLOCK_K rows (pointer loads).
    first_empty = tl.sum((steps_by_rank > 0).to(tl.int32), axis=0) * per_expert
    first_ours = pid + tl.cdiv(tl.maximum(first_empty - pid, 0), NUM_PROGRAMS) * NUM_PROGRAMS
    for tile in range(first_ours, num_tiles, NUM_PROGRAMS):
        e, off_m, off_n, start, end = _ragged_k_locate(
            tile, order, offs_e, starts, ends, num_m, num_n, per_expert,
            BLOCK_M, BLOCK_N, GROUP_M,
        )  # fmt: skip
        _ragged_k_finish(
            tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), e, off_m, off_n, start, end,
            a_ptr, b_ptr, c_desc, c_ptr, M, N, stride_a_t, stride_b_t, stride_c_e, stride_c_m,
            stride_c_n, ACCUMULATE, BLOCK_M, BLOCK_N, BLOCK_K, C_TMA, EPI_SUBTILE, EPI_N,
        )  # fmt: skip


@triton.jit
def _ragged_k_dynamic_loop(
    counter_ptr, a_desc, b_desc, c_desc, a_ptr, b_ptr, c_ptr, order, offs_e, starts, ends,
    M, N, num_m, num_n, per_expert, num_tiles, stride_a_t, stride_b_t, stride_c_e, stride_c_m,
    stride_c_n,
    ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    C_TMA: tl.constexpr, EPI_SUBTILE: tl.constexpr, EPI_N: tl.constexpr,
):  # fmt: skip
    """Greedy list scheduling: a program takes the next tile (in decreasing-cost order) when
    it is free, so long tiles never pile up on the programs a round-robin deal gives them to.
    The next index is taken at the start of a tile, hiding the atomic's latency."""
    tile = tl.atomic_add(counter_ptr, 1, sem="relaxed")
    while tile < num_tiles:
        next_tile = tl.atomic_add(counter_ptr, 1, sem="relaxed")
        _ragged_k_tile(
            tile, a_desc, b_desc, c_desc, a_ptr, b_ptr, c_ptr, order, offs_e, starts, ends,
            M, N, num_m, num_n, per_expert, stride_a_t, stride_b_t, stride_c_e, stride_c_m,
            stride_c_n,
            ACCUMULATE, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, C_TMA, EPI_SUBTILE, EPI_N,
        )  # fmt: skip
        tile = next_tile
    # The last program out re-zeroes the counter for the next launch on this stream.
    if tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel") == NUM_PROGRAMS - 1:
        tl.store(counter_ptr, 0)
        tl.store(counter_ptr + 1, 0)


@triton.jit
def _ragged_k_static_deal_fits(
    counts_by_rank, in_e, offs_e, per_expert,
    NUM_PROGRAMS: tl.constexpr, BLOCK_K: tl.constexpr, SLACK_PCT: tl.constexpr,
):  # fmt: skip
    """Whether the flattened round-robin deal finishes within SLACK_PCT % of the greedy one.

    Costs are K steps plus one per tile (its epilogue and pipeline turn-around). Tiles are
    ranked by decreasing cost and dealt round-robin, so program 0 takes the costliest tile of
    every round and carries the static deal's longest load. The greedy (dynamic) schedule
    ends near the mean load, and never before the costliest tile. The slack is what the
    flattened loop gains per step over the dynamic one (its next tile's loads overlap this
    tile's epilogue; ``GemmConfig.static_slack_pct``)."""
    steps = tl.where(in_e, tl.cdiv(counts_by_rank, BLOCK_K), 0)
    cost = tl.where(steps > 0, steps + 1, 0).to(tl.int64)  # sums of costs * tiles: int64
    first = offs_e * per_expert
    # tiles [first, first + per_expert) of each rank, those congruent to 0 mod NUM_PROGRAMS
    ours = ((first + per_expert + NUM_PROGRAMS - 1) // NUM_PROGRAMS
            - (first + NUM_PROGRAMS - 1) // NUM_PROGRAMS)  # fmt: skip
    static_makespan = tl.sum(ours * cost, axis=0)
    greedy_makespan = tl.maximum(
        tl.cdiv(tl.sum(cost, axis=0) * per_expert, NUM_PROGRAMS), tl.max(cost, axis=0)
    )
    return static_makespan * 100 <= greedy_makespan * SLACK_PCT


@triton.jit
def _grouped_mm_ragged_k_kernel(
    # pointers: a [T, M] row-major (the operand is its transposed view a[M, T]), b [T, N]
    # row-major, c [E, M, N], offsets [E] cumulative ends along T, counter int32 [2] (DYNAMIC)
    a_ptr, b_ptr, c_ptr, offsets_ptr, counter_ptr,
    M, N, T, E,  # sizes
    stride_a_t, stride_b_t, stride_c_e, stride_c_m, stride_c_n,  # strides
    ACCUMULATE: tl.constexpr,  # meta
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
    C_TMA: tl.constexpr,  # c has unit stride along N: bulk async store / reduce-add
    WARP_SPEC: tl.constexpr, EPI_SUBTILE: tl.constexpr,
    DYNAMIC: tl.constexpr,  # tiles taken from an atomic counter instead of a round-robin deal
    STATIC_SLACK_PCT: tl.constexpr,  # DYNAMIC and FLATTEN: see _ragged_k_static_deal_fits
):  # fmt: skip
    pid = tl.program_id(0)
    EPI_N: tl.constexpr = BLOCK_N // 2 if EPI_SUBTILE else BLOCK_N
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_expert = num_m * num_n
    num_tiles = E * per_expert
    # Row-bounded descriptors: the K loop of expert e reads rows [start, end) and the TMA
    # engine zero-fills the K tail, so no other expert's rows leak into the sum.
    a_desc = ragged_rows_desc(a_ptr, T, M, stride_a_t, BLOCK_K, BLOCK_M)
    b_desc = ragged_rows_desc(b_ptr, T, N, stride_b_t, BLOCK_K, BLOCK_N)

    # A tile's cost is proportional to its expert's row count, so with skewed routing a
    # round-robin deal leaves some programs with several long tiles at the end. Dealing the
    # experts' tiles in order of decreasing count (longest first) keeps the tail short. The
    # order comes from an in-kernel sort of (count << 20 | expert): no host sync. Experts
    # ending within the first BLOCK_K rows (one cheap pointer-load step, see _ragged_k_small)
    # sort with the empty ones, as count 0.
    offs_e, in_e, starts, ends = expert_bounds(offsets_ptr, E, T, BLOCK_E)
    counts = tl.where(in_e, tl.where(ends >= BLOCK_K, ends - starts, 0), -1)  # padding last
    ranked = tl.sort((counts.to(tl.int64) << 20) | offs_e.to(tl.int64), descending=True)
    order = (ranked & 0xFFFFF).to(tl.int32)  # expert id by rank

    if C_TMA:
        c_desc = stacked_desc(c_ptr, E, M, N, stride_c_e, stride_c_m, BLOCK_M, EPI_N)
    else:
        c_desc = a_desc  # unused placeholder: the epilogue stores through pointers

    counts_by_rank = (ranked >> 20).to(tl.int32)
    run_static_deal = FLATTEN
    if DYNAMIC and FLATTEN:
        # Both schedules compiled; the routing picks one on the device (the same choice in
        # every program, from the same offsets): the flattened static deal where it is
        # balanced, the dynamic one where skew would leave a static deal's programs uneven.
        run_static_deal = _ragged_k_static_deal_fits(
            counts_by_rank, in_e, offs_e, per_expert, NUM_PROGRAMS, BLOCK_K, STATIC_SLACK_PCT
        )
    if run_static_deal:
        _ragged_k_flat_loop(
            pid, a_desc, b_desc, c_desc, a_ptr, b_ptr, c_ptr, order,
            counts_by_rank, offs_e, in_e, starts, ends, M, N, num_m, num_n,
            per_expert, num_tiles, stride_a_t, stride_b_t, stride_c_e, stride_c_m, stride_c_n,
            ACCUMULATE, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS,
            C_TMA, EPI_SUBTILE, EPI_N,
        )  # fmt: skip
    elif DYNAMIC:
        _ragged_k_dynamic_loop(
            counter_ptr, a_desc, b_desc, c_desc, a_ptr, b_ptr, c_ptr, order, offs_e,
            starts, ends, M, N, num_m, num_n, per_expert, num_tiles, stride_a_t,
            stride_b_t, stride_c_e, stride_c_m, stride_c_n,
            ACCUMULATE, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS,
            C_TMA, EPI_SUBTILE, EPI_N,
        )  # fmt: skip
    else:
        for tile in tl.range(pid, num_tiles, NUM_PROGRAMS, warp_specialize=WARP_SPEC):
            _ragged_k_tile(
                tile, a_desc, b_desc, c_desc, a_ptr, b_ptr, c_ptr, order, offs_e, starts, ends,
                M, N, num_m, num_n, per_expert, stride_a_t, stride_b_t, stride_c_e, stride_c_m,
                stride_c_n,
                ACCUMULATE, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, C_TMA, EPI_SUBTILE, EPI_N,
            )  # fmt: skip


def persistent_launch(
    config: GemmConfig, num_experts: int, x: torch.Tensor
) -> tuple[tuple[int], dict]:
    """(grid, meta) of a persistent grouped-GEMM kernel (here and in
    :mod:`moekit.kernels.grouped_mlp`): one program per SM of x's device, and the
    meta-parameters it takes from its config. Readies the device-side descriptors' allocator."""
    ensure_scratch_allocator()
    programs = num_sms(x)
    meta = dict(
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        BLOCK_E=max(next_power_of_2(num_experts), 16), GROUP_M=config.group_m,
        NUM_PROGRAMS=programs, FLATTEN=config.flatten,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return (programs,), meta


def grouped_mm_ragged_m(
    a: torch.Tensor,  # [T, K], TMA-ready rows
    b: torch.Tensor,  # [E, K, N], unit stride along K or N
    offsets: torch.Tensor,  # [E] int32/int64, contiguous
    out: torch.Tensor,  # [T, N], TMA-ready rows
    bias: torch.Tensor | None,  # [E, N], unit stride along N
    config: GemmConfig,
    zero_tail: bool = True,  # False: rows past offsets[-1] are left as they are
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # FP8: (sa, sb), see below
    rowwise: bool = False,  # FP8 scales per row and output channel, else blockwise
) -> None:
    """out[rows of e] = a[rows of e] @ b[e] (+ bias[e]); rows past offsets[-1] zeroed.

    FP8 (``scales`` given): a and b are e4m3, b[e] stored [N, K] (unit stride along K), and
    the fp32 scales have unit stride along their last dim. Blockwise: sa [T, ⌈K/BK⌉] and sb
    [E, ⌈N/BK⌉, ⌈K/BK⌉], ``config.block_n`` ≤ ``config.block_k`` = the scale block.
    ``rowwise``: sa [T, 1] and sb [E, N, 1], any config."""
    T, K = a.shape
    E, _, N = b.shape
    grid, meta = persistent_launch(config, E, a)
    fp8 = {}
    if scales is not None:
        sa, sb = scales
        fp8 = dict(sa_ptr=sa, sb_ptr=sb, stride_sa_t=sa.stride(0), stride_sb_e=sb.stride(0),
                   stride_sb_n=sb.stride(1),
                   SCALE_MODE=SCALE_ROWWISE if rowwise else SCALE_BLOCKWISE)  # fmt: skip
    launch(
        _grouped_mm_ragged_m_kernel, grid,
        a, b, out, bias if bias is not None else out, offsets,
        T, N, K, E,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        bias.stride(0) if bias is not None else 0,
        B_K_MAJOR=b.stride(1) == 1 and b.stride(2) != 1, HAS_BIAS=bias is not None,
        C_TMA=config.c_tma, WARP_SPEC=config.warp_specialize,
        EPI_SUBTILE=config.epilogue_subtile, EXPERT_GROUPS=config.expert_groups,
        A_BOUNDED=config.a_bounded, ZERO_TAIL=zero_tail, **fp8, **meta,
    )  # fmt: skip


def grouped_mm_ragged_k(
    a: torch.Tensor,  # [M, T], the transposed view of a TMA-ready row-major [T, M]
    b: torch.Tensor,  # [T, N], TMA-ready rows
    offsets: torch.Tensor,  # [E] int32/int64, contiguous
    out: torch.Tensor,  # [E, M, N], any strides
    accumulate: bool,  # out += result (experts with no columns leave out untouched)
    config: GemmConfig,
) -> None:
    """out[e] (+)= a[:, cols of e] @ b[cols of e]; experts with no columns give zeros."""
    M, T = a.shape
    N = b.shape[1]
    E = offsets.shape[0]
    grid, meta = persistent_launch(config, E, a)
    # TMA epilogue: unit stride along N, aligned strides, and a reduce-add only in fp32 (the
    # interpreter has no TMA reduce, so there an accumulating launch uses loads and stores).
    c_tma = (
        config.c_tma
        and tma_ready(out, -1)
        and not (accumulate and (out.dtype != torch.float32 or interpret_mode()))
    )
    launch(
        _grouped_mm_ragged_k_kernel, grid,
        a, b, out, offsets, tile_counter(a.device) if config.dynamic else offsets,
        M, N, T, E,
        a.stride(1), b.stride(0), out.stride(0), out.stride(1), out.stride(2),
        ACCUMULATE=accumulate, C_TMA=c_tma, WARP_SPEC=config.warp_specialize,
        EPI_SUBTILE=config.epilogue_subtile, DYNAMIC=config.dynamic,
        STATIC_SLACK_PCT=config.static_slack_pct, **meta,
    )  # fmt: skip


@triton.jit
def _fp8_wgrad_kernel(
    # pointers: a [M, T] and b [N, T] e4m3 (T contiguous: the tokens), sa [⌈T/BK⌉, M] and
    # sb [⌈T/BK⌉, N] fp32 (one scale per BK tokens and column), c [E, M, N] fp32, offsets [E]
    a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, offsets_ptr,
    M, N, T, E,  # sizes
    stride_a_m, stride_b_n, stride_sa_t, stride_sb_t, stride_c_e, stride_c_m,  # strides
    ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # meta
    BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
):  # fmt: skip
    """c[e] (+)= Σ over expert e's token blocks k of (a_k @ b_kᵀ) · (sa_k ⊗ sb_k): the FP8
    weight gradient, one fp32 promotion per BLOCK_K tokens. Every expert's tokens start and end
    at multiples of BLOCK_K (the caller's contract), so a block never spans two experts and
    plain descriptors serve. Persistent over (expert, m-tile, n-tile)."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_expert = num_m * num_n
    offs_e, _, starts, ends = expert_bounds(offsets_ptr, E, T, BLOCK_E)
    a_desc = matrix_desc(a_ptr, M, T, stride_a_m, BLOCK_M, BLOCK_K)
    b_desc = matrix_desc(b_ptr, N, T, stride_b_n, BLOCK_N, BLOCK_K)
    for tile in tl.range(pid, E * per_expert, NUM_PROGRAMS):
        e = tile // per_expert
        off_m = (tile % per_expert) // num_n * BLOCK_M
        off_n = (tile % per_expert) % num_n * BLOCK_N
        start = tl.sum(tl.where(offs_e == e, starts, 0), axis=0)
        end = tl.sum(tl.where(offs_e == e, ends, 0), axis=0)
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range((end - start) // BLOCK_K):
            t0 = start + ki * BLOCK_K
            a = a_desc.load([off_m, t0])
            b = b_desc.load([off_n, t0])
            sa = tl.load(sa_ptr + (t0 // BLOCK_K) * stride_sa_t + rows, mask=rows < M, other=0.0)
            sb = tl.load(sb_ptr + (t0 // BLOCK_K) * stride_sb_t + cols, mask=cols < N, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
        c_ptrs = (c_ptr + e.to(tl.int64) * stride_c_e + rows[:, None] * stride_c_m
                  + cols[None, :])  # fmt: skip
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        if ACCUMULATE:
            if end > start:  # an expert with no tokens leaves the accumulator untouched
                tl.store(c_ptrs, acc + tl.load(c_ptrs, mask=mask, other=0.0), mask=mask)
        else:
            tl.store(c_ptrs, acc, mask=mask)


def grouped_mm_fp8_wgrad(
    a: torch.Tensor,  # [M, T] e4m3, unit stride along T
    b: torch.Tensor,  # [N, T] e4m3, unit stride along T
    sa: torch.Tensor,  # [⌈T/BK⌉, M] fp32, unit stride along M
    sb: torch.Tensor,  # [⌈T/BK⌉, N] fp32, unit stride along N
    offsets: torch.Tensor,  # [E] int32/int64, contiguous, multiples of config.block_k
    out: torch.Tensor,  # [E, M, N] fp32, unit stride along N
    accumulate: bool,
    config: GemmConfig,
) -> None:
    """out[e] (+)= a[:, tokens of e] @ b[:, tokens of e]ᵀ, blockwise FP8 (see the kernel)."""
    M, T = a.shape
    N, E = b.shape[0], offsets.shape[0]
    grid, meta = persistent_launch(config, E, a)
    meta = {k: v for k, v in meta.items() if k not in ("GROUP_M", "FLATTEN")}  # not used here
    launch(
        _fp8_wgrad_kernel, grid,
        a, b, sa, sb, out, offsets,
        M, N, T, E,
        a.stride(0), b.stride(0), sa.stride(0), sb.stride(0), out.stride(0), out.stride(1),
        ACCUMULATE=accumulate, **meta,
    )  # fmt: skip
