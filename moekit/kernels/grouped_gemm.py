"""Grouped GEMM for Mixture-of-Experts: every expert in one persistent launch.

Two forms, both with fp32 accumulation, TMA tensor descriptors and an on-device tile scheduler:

* ragged M (forward, dgrad):  c[T, N] = a[T, K] @ b[e][K, N] for the rows of expert e
* ragged K (weight gradient): c[e][M, N] = a[M, Te] @ b[Te, N] over the columns of expert e

``offsets`` [E] holds cumulative end offsets (the ``torch._grouped_mm`` convention) and is read
only on the device: the grid is one program per SM and every tile's expert is derived in the
kernel from ``offsets``, so nothing is synchronised with the host and launches are graph-capturable.

Ragged-M scheduler. Expert e owns rows [start_e, end_e) and ceil(count_e / BLOCK_M) m-tiles; the
kernel loads all E offsets as one vector, takes an inclusive cumsum of the m-tile counts, and maps
a global m-tile index g to its expert by counting cumsum entries <= g. A tile that starts inside an
expert may run past its end into the next expert's rows: those accumulator rows are never stored
(the partial tile stores through a descriptor whose row bound is end_e), so reading them is
harmless. Rows in [offsets[-1], T) are zero-filled by the same launch.

Ragged-K scheduler. Tiles are (expert, m-tile, n-tile), a static count, ranked by decreasing expert
row count (an in-kernel sort). Each tile loads through descriptors whose T-extent is end_e, so the
TMA engine zero-fills the K tail and no other expert's rows leak into the sum. Programs either
take tiles round-robin or (``GemmConfig.dynamic``) from a self-resetting atomic counter, which
balances skewed routings. With ``GemmConfig.flatten`` a program runs all K steps of its static
share as one pipelined loop, so its next tile's loads are in flight during this tile's epilogue.
With both, the kernel picks one of the two from the routing, on the device.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import triton
import triton.language as tl

from moekit.config import autotune_enabled, interpret_mode
from moekit.kernels._replay import launch as _launch
from moekit.kernels._runtime import device_sms, ensure_scratch_allocator, tile_counter


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    # Fuse the tile and K loops, overlapping a tile's epilogue with the next tile's loads:
    # Triton's loop flattening in ragged M; in ragged K (whose K loop length varies by
    # expert, which Triton cannot flatten) a hand-fused loop over the static deal of tiles.
    flatten: bool = False
    c_tma: bool = True  # TMA store (or TMA reduce-add) of C vs masked st.global
    warp_specialize: bool = False  # producer/consumer warps for the tile loop
    ctas_per_sm: int = 1  # 2: two co-resident programs overlap each other's prologue/epilogue
    # TMA epilogue in two [BM, BN/2] halves: half the epilogue's shared memory, which leaves
    # room for one more pipeline stage (or an fp32 C tile) at BN = 256.
    epilogue_subtile: bool = False
    # Ragged K only: programs take tiles from an atomic counter (greedy, longest expert first)
    # instead of a static round-robin deal, which skewed expert sizes leave unbalanced.
    dynamic: bool = False
    # Ragged M only: swizzle tiles within each expert rather than over the global m-tile
    # index, so concurrently running tiles share one expert's weights (see _ragged_m_tile).
    expert_groups: bool = False
    # Ragged M only: load A through a descriptor bounded at the tile's expert end, so the rows
    # of the next expert in an expert's last tile (never stored) are not read but zero-filled.
    a_bounded: bool = False


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _swizzle_tile(tile, num_m, num_n, GROUP_M: tl.constexpr):
    # Neighbouring tiles share a band of GROUP_M row tiles, so concurrently running programs
    # reuse each other's A and B tiles through L2.
    per_group = GROUP_M * num_n
    group = tile // per_group
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_size
    pid_n = (tile % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def _ragged_rows_desc(ptr, T, C, stride, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Descriptor over a row-major [T, C] matrix whose row bound is chosen per access.

    A plain descriptor clips rows at T only. This one is 3-D, [T, BLOCK_R, C] with strides
    [stride, stride, 1] and base ``ptr``, so element (j, i, c) is row j + i. Rows
    [r, r + BLOCK_R) bounded at ``end`` are accessed at ``_ragged_rows_at(r, end, BLOCK_R)``
    = (min(r, end - BLOCK_R), r - that): the TMA engine's own bound check (i < BLOCK_R) then
    clips exactly the rows >= end, so loads past an expert's end read zeros and stores past it
    are dropped, and one descriptor per program serves every expert.

    The base must be ``ptr`` itself: the TMA unit touches the page of a descriptor's base
    address even when no element there is accessed, and an earlier form whose base lay
    (T + BLOCK_R) rows before the tensor faulted (illegal address) wherever that page was
    unmapped. The price is the precondition end >= BLOCK_R (else j would be negative and the
    whole box out of bounds): experts ending within the first BLOCK_R rows take pointer paths
    (_store_rows after the ragged-M main loop, _ragged_k_small, the dact kernel's second loop).
    """
    return tl.make_tensor_descriptor(
        ptr,
        shape=[tl.maximum(T, 1), BLOCK_R, C],
        strides=[stride, stride, 1],
        block_shape=[1, BLOCK_R, BLOCK_C],
    )


@triton.jit
def _ragged_rows_at(r, end, BLOCK_R: tl.constexpr):
    """(j, i) coordinates of rows [r, r + BLOCK_R) bounded at ``end`` in a
    ``_ragged_rows_desc`` (needs end >= BLOCK_R; see there)."""
    j = tl.minimum(r, end - BLOCK_R)
    return j, r - j


@triton.jit
def _split_columns(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BM, BN] → its left and right [BM, BN/2] halves (for the sub-tiled epilogue)."""
    halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
    return tl.split(halves)


@triton.jit
def _expert_bounds(offsets_ptr, E, T, BLOCK_E: tl.constexpr):
    """Each expert's row range [starts, ends) as [BLOCK_E] vectors, from cumulative end offsets.

    Clamped to 0 <= start <= end <= T, so malformed offsets (documented as undefined without
    validate=True) cannot address memory outside the operands. Padding lanes (>= E) get an empty
    range at the largest end.
    """
    offs_e = tl.arange(0, BLOCK_E)
    in_e = offs_e < E
    ends = tl.load(offsets_ptr + offs_e, mask=in_e, other=0).to(tl.int32)
    ends = tl.minimum(tl.maximum(ends, 0), T)
    ends = tl.where(in_e, ends, tl.max(ends, axis=0))
    starts = tl.load(offsets_ptr + offs_e - 1, mask=in_e & (offs_e > 0), other=0).to(tl.int32)
    starts = tl.where(in_e, tl.minimum(tl.maximum(starts, 0), ends), ends)
    return offs_e, in_e, starts, ends


@triton.jit
def _ragged_m_schedule(offsets_ptr, E, T, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Per-expert m-tile counts for a ragged-M launch: (offs_e, starts, ends, m_tiles,
    cum_m_tiles, total_m). Expert e owns ceil(count_e / BLOCK_M) m-tiles."""
    offs_e, _, starts, ends = _expert_bounds(offsets_ptr, E, T, BLOCK_E)
    m_tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M  # 0 on padding lanes
    cum_m_tiles = tl.cumsum(m_tiles, axis=0)  # inclusive
    total_m = tl.sum(m_tiles, axis=0)
    return offs_e, starts, ends, m_tiles, cum_m_tiles, total_m


@triton.jit
def _ragged_m_tile(
    tile, offs_e, starts, ends, m_tiles, cum_m_tiles, total_m, num_n,
    BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, EXPERT_GROUPS: tl.constexpr = False,
):  # fmt: skip
    """Tile index → (expert, first row, expert's end row, n-tile).

    Default: the GROUP_M swizzle runs over the global m-tile index g, and g belongs to the
    expert whose inclusive m-tile cumsum first exceeds g; a band of GROUP_M m-tiles may then
    span two or three experts, whose weights are all streamed at once. EXPERT_GROUPS: each
    expert's tiles are contiguous in the schedule and the swizzle runs within the expert, so a
    band's m-tiles share one expert's weight tiles."""
    if EXPERT_GROUPS:
        e = tl.sum((cum_m_tiles * num_n <= tile).to(tl.int32), axis=0)
        m_before = tl.sum(tl.where(offs_e < e, m_tiles, 0), axis=0)
        m_e = tl.sum(tl.where(offs_e == e, m_tiles, 0), axis=0)
        m_local, pid_n = _swizzle_tile(tile - m_before * num_n, m_e, num_n, GROUP_M)
    else:
        g_m, pid_n = _swizzle_tile(tile, total_m, num_n, GROUP_M)
        e = tl.sum((cum_m_tiles <= g_m).to(tl.int32), axis=0)
        m_before = tl.sum(tl.where(offs_e < e, m_tiles, 0), axis=0)
        m_local = g_m - m_before
    row_start = tl.sum(tl.where(offs_e == e, starts, 0), axis=0)
    row_end = tl.sum(tl.where(offs_e == e, ends, 0), axis=0)
    return e, row_start + m_local * BLOCK_M, row_end, pid_n


@triton.jit
def _split_small_experts(ends, m_tiles, BLOCK_M: tl.constexpr):
    """Split a ragged-M schedule's m-tiles into the main loop's and those of experts ending
    within the first BLOCK_M rows (which a _ragged_rows_desc cannot bound: pointer paths).
    Returns (main_m, cum_main, total_main, small_m, cum_small, total_small)."""
    small = ends < BLOCK_M
    main_m = tl.where(small, 0, m_tiles)
    small_m = tl.where(small, m_tiles, 0)
    return (
        main_m, tl.cumsum(main_m, axis=0), tl.sum(main_m, axis=0),
        small_m, tl.cumsum(small_m, axis=0), tl.sum(small_m, axis=0),
    )  # fmt: skip


@triton.jit
def _next_deal_start(pid, dealt, NUM_PROGRAMS: tl.constexpr):
    """First tile of a follow-on tile loop for program ``pid`` when ``dealt`` tiles were dealt
    round-robin before it: the deal continues where the last one stopped instead of restarting
    at program 0, which would give the first programs one tile more in each loop."""
    return (pid - dealt % NUM_PROGRAMS + NUM_PROGRAMS) % NUM_PROGRAMS


@triton.jit
def _store_c_tile(desc, p, q, off_n, c, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  EPI_SUBTILE: tl.constexpr):  # fmt: skip
    """TMA store of a [BM, BN] C tile at (p, q, off_n) of a 3-D descriptor, as two [BM, BN/2]
    halves with EPI_SUBTILE (the descriptor's block is then half as wide)."""
    if EPI_SUBTILE:
        c0, c1 = _split_columns(c, BLOCK_M, BLOCK_N)
        desc.store([p, q, off_n], c0.reshape(1, BLOCK_M, BLOCK_N // 2))
        desc.store([p, q, off_n + BLOCK_N // 2], c1.reshape(1, BLOCK_M, BLOCK_N // 2))
    else:
        desc.store([p, q, off_n], c.reshape(1, BLOCK_M, BLOCK_N))


@triton.jit
def _ragged_m_acc(
    a_desc, b_desc, bias_ptr, e, off_m, off_n, N, k_tiles, stride_bias_e,
    B_K_MAJOR: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    row_end=0, A_BOUNDED: tl.constexpr = False,
):  # fmt: skip
    """fp32 [BM, BN] tile of a[off_m:] @ b[e][:, off_n:] (+ bias[e]) for the ragged-M GEMM.
    A_BOUNDED: ``a_desc`` is a _ragged_rows_desc and rows >= row_end load as zeros."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if A_BOUNDED:
        a_j, a_i = _ragged_rows_at(off_m, row_end, BLOCK_M)
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
        acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        cols = off_n + tl.arange(0, BLOCK_N)
        bias = tl.load(bias_ptr + e * stride_bias_e + cols, mask=cols < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    return acc


@triton.jit
def _store_rows(c_ptr, c, off_m, off_n, row_end, N, stride_c_t,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Pointer store of a [BM, BN] tile of a row-major C, rows bounded at row_end."""
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_c_t + cols[None, :]
    tl.store(c_ptrs, c, mask=(rows[:, None] < row_end) & (cols[None, :] < N))


@triton.jit
def _grouped_mm_ragged_m_kernel(
    # pointers
    a_ptr,  # [T, K]
    b_ptr,  # [E, K, N] (any two unit-stride layouts, see B_K_MAJOR)
    c_ptr,  # [T, N]
    bias_ptr,  # [E, N] or dummy
    offsets_ptr,  # [E] cumulative end offsets
    # sizes
    T,
    N,
    K,
    E,
    # strides
    stride_a_t,
    stride_b_e,
    stride_b_k,
    stride_b_n,
    stride_c_t,
    stride_bias_e,
    # meta
    B_K_MAJOR: tl.constexpr,  # b[e] stored [N, K] (an nn.Linear weight viewed transposed)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr,
    C_TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    EPI_SUBTILE: tl.constexpr,
    EXPERT_GROUPS: tl.constexpr,
    A_BOUNDED: tl.constexpr = False,
):
    dtype = c_ptr.dtype.element_ty
    pid = tl.program_id(0)
    EPI_N: tl.constexpr = BLOCK_N // 2 if EPI_SUBTILE else BLOCK_N

    offs_e, starts, ends, m_tiles, _, _ = _ragged_m_schedule(offsets_ptr, E, T, BLOCK_M, BLOCK_E)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)

    a_desc = tl.make_tensor_descriptor(
        a_ptr, shape=[T, K], strides=[stride_a_t, 1], block_shape=[BLOCK_M, BLOCK_K]
    )
    if B_K_MAJOR:
        b_desc = tl.make_tensor_descriptor(
            b_ptr,
            shape=[E, N, K],
            strides=[stride_b_e, stride_b_n, 1],
            block_shape=[1, BLOCK_N, BLOCK_K],
        )
    else:
        b_desc = tl.make_tensor_descriptor(
            b_ptr,
            shape=[E, K, N],
            strides=[stride_b_e, stride_b_k, 1],
            block_shape=[1, BLOCK_K, BLOCK_N],
        )
    c_desc = tl.make_tensor_descriptor(
        c_ptr, shape=[T, N], strides=[stride_c_t, 1], block_shape=[BLOCK_M, BLOCK_N]
    )
    c_ragged = _ragged_rows_desc(c_ptr, T, N, stride_c_t, BLOCK_M, EPI_N)
    a_main = a_desc
    if A_BOUNDED:
        a_main = _ragged_rows_desc(a_ptr, T, K, stride_a_t, BLOCK_M, BLOCK_K)

    # Experts ending within the first BLOCK_M rows cannot be bounded by c_ragged (see
    # _ragged_rows_desc). Their tiles (one m-tile each) leave the main loop's schedule and
    # are done after it with pointer stores: a data-dependent branch inside the loop would
    # break Triton's loop flattening (FuseNestedLoops), and the TMA engine rejects a store
    # at a negative coordinate (illegal instruction).
    main_m, cum_main, total_main, small_m, cum_small, total_small = _split_small_experts(
        ends, m_tiles, BLOCK_M
    )
    for tile in tl.range(
        pid, total_main * num_n, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPEC
    ):
        e, off_m, row_end, pid_n = _ragged_m_tile(
            tile, offs_e, starts, ends, main_m, cum_main, total_main, num_n, BLOCK_M, GROUP_M,
            EXPERT_GROUPS,
        )  # fmt: skip
        off_n = pid_n * BLOCK_N
        acc = _ragged_m_acc(
            a_main, b_desc, bias_ptr, e, off_m, off_n, N, k_tiles, stride_bias_e, B_K_MAJOR,
            HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, row_end, A_BOUNDED,
        )  # fmt: skip
        if C_TMA:
            # Bounded at the expert's end: the next expert's rows belong to another program.
            j, i = _ragged_rows_at(off_m, row_end, BLOCK_M)
            _store_c_tile(c_ragged, j, i, off_n, acc.to(dtype), BLOCK_M, BLOCK_N, EPI_SUBTILE)
        else:
            _store_rows(c_ptr, acc.to(dtype), off_m, off_n, row_end, N, stride_c_t,
                        BLOCK_M, BLOCK_N)  # fmt: skip

    small_start = _next_deal_start(pid, total_main * num_n, NUM_PROGRAMS)
    for tile in tl.range(small_start, total_small * num_n, NUM_PROGRAMS):
        e, off_m, row_end, pid_n = _ragged_m_tile(
            tile, offs_e, starts, ends, small_m, cum_small, total_small, num_n, BLOCK_M, 1
        )
        off_n = pid_n * BLOCK_N
        acc = _ragged_m_acc(
            a_desc, b_desc, bias_ptr, e, off_m, off_n, N, k_tiles, stride_bias_e, B_K_MAJOR,
            HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        _store_rows(c_ptr, acc.to(dtype), off_m, off_n, row_end, N, stride_c_t,
                    BLOCK_M, BLOCK_N)  # fmt: skip

    # Rows past offsets[-1] belong to no expert: zero them here rather than in a memset launch.
    tail_start = tl.max(ends, axis=0)
    tail_tiles = tl.cdiv(T - tail_start, BLOCK_M) * num_n
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=dtype)
    tail_first = _next_deal_start(pid, (total_main + total_small) * num_n, NUM_PROGRAMS)
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
    pid_m, pid_n = _swizzle_tile(tile % per_expert, num_m, num_n, GROUP_M)
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
                    c0, c1 = _split_columns(acc, BLOCK_M, BLOCK_N)
                    c_desc.atomic_add([e, off_m, off_n], c0.reshape(1, BLOCK_M, EPI_N))
                    c_desc.atomic_add([e, off_m, off_n + EPI_N], c1.reshape(1, BLOCK_M, EPI_N))
                else:
                    c_desc.atomic_add([e, off_m, off_n], acc.reshape(1, BLOCK_M, BLOCK_N))
        else:
            _store_c_tile(c_desc, e, off_m, off_n, acc.to(dtype), BLOCK_M, BLOCK_N, EPI_SUBTILE)
    else:
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        c_ptrs = (
            c_ptr
            + e.to(tl.int64) * stride_c_e
            + rows[:, None] * stride_c_m
            + cols[None, :] * stride_c_n
        )
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
    _ragged_rows_desc cannot bound): one masked pointer-load step over rows [start, end)."""
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
        j, i = _ragged_rows_at(start + ki * BLOCK_K, end, BLOCK_K)
        a = tl.trans(a_desc.load([j, i, off_m]).reshape(BLOCK_K, BLOCK_M))
        b = b_desc.load([j, i, off_n]).reshape(BLOCK_K, BLOCK_N)
        acc = tl.dot(a, b, acc)
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
    ours = (first + per_expert - pid + NUM_PROGRAMS - 1) // NUM_PROGRAMS - (
        first - pid + NUM_PROGRAMS - 1
    ) // NUM_PROGRAMS
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
        j, i = _ragged_rows_at(start + ki * BLOCK_K, end, BLOCK_K)
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
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if end < BLOCK_K:
            acc = _ragged_k_small(
                a_ptr, b_ptr, stride_a_t, stride_b_t, off_m, off_n, start, end, M, N,
                BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
        _ragged_k_epilogue(
            acc, e, off_m, off_n, start, end, c_desc, c_ptr, M, N, stride_c_e,
            stride_c_m, stride_c_n, ACCUMULATE, BLOCK_M, BLOCK_N, C_TMA, EPI_SUBTILE, EPI_N,
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
    tile's epilogue): 7-8% on the uniform TE-seed wgrad in one sweep, 2-4% in interleaved
    rounds (docs/grouped_gemm.md, sessions 11 and 12)."""
    steps = tl.where(in_e, tl.cdiv(counts_by_rank, BLOCK_K), 0)
    cost = tl.where(steps > 0, steps + 1, 0).to(tl.int64)  # sums of costs * tiles: int64
    first = offs_e * per_expert
    # tiles [first, first + per_expert) of each rank, those congruent to 0 mod NUM_PROGRAMS
    ours = (first + per_expert + NUM_PROGRAMS - 1) // NUM_PROGRAMS - (
        first + NUM_PROGRAMS - 1
    ) // NUM_PROGRAMS
    static_makespan = tl.sum(ours * cost, axis=0)
    greedy_makespan = tl.maximum(
        tl.cdiv(tl.sum(cost, axis=0) * per_expert, NUM_PROGRAMS), tl.max(cost, axis=0)
    )
    return static_makespan * 100 <= greedy_makespan * SLACK_PCT


@triton.jit
def _grouped_mm_ragged_k_kernel(
    # pointers
    a_ptr,  # [T, M] row-major: the operand is its transposed view a[M, T]
    b_ptr,  # [T, N] row-major
    c_ptr,  # [E, M, N]
    offsets_ptr,  # [E] cumulative end offsets along T
    counter_ptr,  # int32 [2] zeroed work counter (DYNAMIC only)
    # sizes
    M,
    N,
    T,
    E,
    # strides
    stride_a_t,
    stride_b_t,
    stride_c_e,
    stride_c_m,
    stride_c_n,
    # meta
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr,
    C_TMA: tl.constexpr,  # c has unit stride along N: bulk async store / reduce-add
    WARP_SPEC: tl.constexpr,
    EPI_SUBTILE: tl.constexpr,
    DYNAMIC: tl.constexpr,  # tiles taken from an atomic counter instead of a round-robin deal
    STATIC_SLACK_PCT: tl.constexpr,  # DYNAMIC and FLATTEN: see _ragged_k_static_deal_fits
):
    pid = tl.program_id(0)
    EPI_N: tl.constexpr = BLOCK_N // 2 if EPI_SUBTILE else BLOCK_N
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_expert = num_m * num_n
    num_tiles = E * per_expert
    # Row-bounded descriptors: the K loop of expert e reads rows [start, end) and the TMA
    # engine zero-fills the K tail, so no other expert's rows leak into the sum.
    a_desc = _ragged_rows_desc(a_ptr, T, M, stride_a_t, BLOCK_K, BLOCK_M)
    b_desc = _ragged_rows_desc(b_ptr, T, N, stride_b_t, BLOCK_K, BLOCK_N)

    # A tile's cost is proportional to its expert's row count, so with skewed routing a
    # round-robin deal leaves some programs with several long tiles at the end. Dealing the
    # experts' tiles in order of decreasing count (longest first) keeps the tail short. The
    # order comes from an in-kernel sort of (count << 20 | expert): no host sync. Experts
    # ending within the first BLOCK_K rows (one cheap pointer-load step, see _ragged_k_small)
    # sort with the empty ones, as count 0.
    offs_e, in_e, starts, ends = _expert_bounds(offsets_ptr, E, T, BLOCK_E)
    counts = tl.where(in_e, tl.where(ends >= BLOCK_K, ends - starts, 0), -1)  # padding last
    ranked = tl.sort((counts.to(tl.int64) << 20) | offs_e.to(tl.int64), descending=True)
    order = (ranked & 0xFFFFF).to(tl.int32)  # expert id by rank

    if C_TMA:
        c_desc = tl.make_tensor_descriptor(
            c_ptr,
            shape=[E, M, N],
            strides=[stride_c_e, stride_c_m, 1],
            block_shape=[1, BLOCK_M, EPI_N],
        )
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


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------

# Ragged K with ``dynamic`` and ``flatten`` both set: the static deal runs when its estimated
# makespan is within this percentage of the greedy one's (see _ragged_k_static_deal_fits).
STATIC_DEAL_SLACK_PCT = 106

_INTERPRET_CONFIG = GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1, flatten=False)

# Candidates for autotuning; the first is the heuristic default (ragged K: the default depends
# on the output dtype, see _ragged_k_candidates). Shared memory per stage is
# (BM + BN) * BK * 2 bytes, plus the BM * BN epilogue tile, which bounds the stage count.
# The ragged-M default where experts are small and K short (see _ragged_m_candidates): the
# sub-tiled epilogue leaves room for a fourth stage. In an Nsight Compute profile of the Qwen3
# fc1 GEMM the 3-stage config's warps mostly waited for operand tiles (docs/grouped_gemm.md,
# session 13).
_RAGGED_M_FINE_GRAINED = GemmConfig(
    128, 256, 64, num_warps=8, num_stages=4, epilogue_subtile=True, flatten=True,
    expert_groups=True,
)  # fmt: skip
# Average rows per expert up to which ragged-M configs load A bounded at each expert's end
# (see _ragged_m_candidates).
_A_BOUNDED_MAX_ROWS_PER_EXPERT = 512
# Outside the fine-grained default, K and N from which ragged-M configs swizzle over bands of
# 16 m-tiles instead of 8 (see _ragged_m_candidates).
_WIDE_BAND_MIN_K_N = 2048
_WIDE_BAND_GROUP_M = 16
_RAGGED_M_CANDIDATES_16 = (
    # The default (but see _ragged_m_candidates): expert bands with the flattened loop. Over
    # three gamma routings of each benchmark shape it was within 2.2% of the per-routing best
    # on average and never below torch._grouped_mm, where the config tuned on another routing
    # averaged 2.8% below the best and fell below torch in 6-12 of 108 cases
    # (docs/grouped_gemm.md, session 10).
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, flatten=True, expert_groups=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, flatten=True),
    # Sub-tiled epilogue: 32 KB instead of 64 KB, so a fourth stage fits (224 KB in all).
    GemmConfig(128, 256, 64, num_warps=8, num_stages=4, epilogue_subtile=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=4, epilogue_subtile=True, flatten=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=4, c_tma=False),
    GemmConfig(64, 256, 64, num_warps=4, num_stages=4),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, warp_specialize=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, expert_groups=True),
    _RAGGED_M_FINE_GRAINED,
)
_RAGGED_K_CANDIDATES_16 = (
    GemmConfig(128, 128, 64, num_warps=8, num_stages=4),
    # 128 x 256 with a sub-tiled epilogue: the fp32 C tile halves (64 KB) fit beside 3 stages.
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, epilogue_subtile=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, epilogue_subtile=True, dynamic=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, c_tma=False),
    # fp32 out: the static form exceeds shared memory (the autotuner skips it); the dynamic
    # form compiles with Triton 3.6 (598 TFLOP/s on the TE-seed fp32 wgrad in the sweep).
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, dynamic=True),
    # One loop over all of a program's K steps (see _ragged_k_flat_loop): the next tile's
    # loads overlap this one's epilogue, worth ~10% where experts have few rows each.
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, flatten=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, epilogue_subtile=True, flatten=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=4, epilogue_subtile=True, flatten=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, c_tma=False, flatten=True),
    # Both: the routing picks the flattened static deal or the dynamic schedule on the device
    # (see _ragged_k_static_deal_fits), so one config serves uniform and skewed routings.
    GemmConfig(
        128, 256, 64, num_warps=8, num_stages=3, epilogue_subtile=True, flatten=True, dynamic=True
    ),
    GemmConfig(
        128, 256, 64, num_warps=8, num_stages=4, epilogue_subtile=True, flatten=True, dynamic=True
    ),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, c_tma=False, flatten=True, dynamic=True),
)
_CANDIDATES_32 = (
    GemmConfig(128, 128, 32, num_warps=8, num_stages=3),
    GemmConfig(128, 64, 32, num_warps=4, num_stages=4),
)

_tuned: dict[tuple, GemmConfig] = {}


# Ragged-K defaults (no tuning, or CUDA-graph capture), by output dtype. Over the six benchmark
# shapes' wgrads (uniform and skewed TE seed, skewed others; H100, interleaved rounds) the
# routing-chosen schedule was the fastest or within 5% of it with a 16-bit output
# (docs/grouped_gemm.md, session 12). With fp32 out the flattened static loop is slow (420
# against 546-584 TFLOP/s on the uniform TE seed: the reduce-add of main_grad), so the
# dynamic schedule serves there.
_RAGGED_K_DEFAULT_16 = GemmConfig(
    128, 256, 64, num_warps=8, num_stages=3, epilogue_subtile=True, flatten=True, dynamic=True
)
_RAGGED_K_DEFAULT_FP32_OUT = GemmConfig(
    128, 256, 64, num_warps=8, num_stages=3, epilogue_subtile=True, dynamic=True
)


def _candidates(kind: str, dtype: torch.dtype) -> tuple[GemmConfig, ...]:
    if dtype == torch.float32:
        return _CANDIDATES_32
    return _RAGGED_M_CANDIDATES_16 if kind == "m" else _RAGGED_K_CANDIDATES_16


def _ragged_m_candidates(
    dtype: torch.dtype, T: int, E: int, K: int, N: int
) -> tuple[GemmConfig, ...]:
    """The ragged-M candidates for this static shape, its default first.

    With ≤ 1024 rows per expert on average and K ≤ 2048, the 4-stage sub-tiled config leads.
    Over 3-6 routings per pass (H100, interleaved rounds) it was on average 0.1-8.1% faster
    than the 3-stage one on the Qwen3 and OLMoE passes and 1.9% on DeepSeek's fc2, and
    0.5-5.3% slower on most passes with larger experts or a longer K (TE seed fc1 and dgrad,
    Mixtral, DeepSeek fc1 and dgrad, gpt-oss fc1 and dgrad).

    With ≤ 512 rows per expert on average (at most four m-tiles), every candidate loads A
    bounded at the expert's end (``a_bounded``): there the rows past an expert's end in its
    last tile are an eighth or more of the rows computed (Qwen3 and OLMoE 13%, gpt-oss 30% at
    the benchmark's routings), and loading them as zeros was 1.3% faster on average over 54
    cases of those three shapes (44 faster; docs/grouped_gemm.md, session 15).

    Where the fine-grained config does not lead and K, N ≥ 2048, every candidate swizzles over
    bands of 16 m-tiles (an expert's band then covers 16 m-tiles × 132 / 16 n-tiles, which
    holds less of A and B in L2 at once than 8 × 16.5 where experts have that many tiles).
    Against GROUP_M 8, on the DeepSeek-V3, Mixtral and gpt-oss passes this selects, three
    probes on disjoint routings gave +1.0, +0.6 and +0.1% on average (33, 63 and 36 cases;
    within the noise of single cases). On the TE seed, whose fc1 has 4 n-tiles, it was 0.9%
    slower; the rule leaves it out (docs/grouped_gemm.md, sessions 14 and 16)."""
    cands = _candidates("m", dtype)
    if dtype == torch.float32:
        return cands
    fine_grained = T <= 1024 * E and K <= 2048
    if fine_grained:
        cands = (_RAGGED_M_FINE_GRAINED, *(c for c in cands if c != _RAGGED_M_FINE_GRAINED))
    elif K >= _WIDE_BAND_MIN_K_N and N >= _WIDE_BAND_MIN_K_N:
        cands = tuple(dataclasses.replace(c, group_m=_WIDE_BAND_GROUP_M) for c in cands)
    if T <= _A_BOUNDED_MAX_ROWS_PER_EXPERT * E:
        cands = tuple(dataclasses.replace(c, a_bounded=True) for c in cands)
    return cands


def _ragged_k_candidates(dtype: torch.dtype, out_dtype: torch.dtype) -> tuple[GemmConfig, ...]:
    """The ragged-K candidates with the default for this output dtype first."""
    if dtype == torch.float32:
        return _CANDIDATES_32
    first = _RAGGED_K_DEFAULT_FP32_OUT if out_dtype == torch.float32 else _RAGGED_K_DEFAULT_16
    return (first, *(c for c in _RAGGED_K_CANDIDATES_16 if c != first))


def _pick_config(
    kind: str,
    key: tuple,
    dtype: torch.dtype,
    device: torch.device,
    launch,
    candidates: tuple[GemmConfig, ...] | None = None,
    interpret_config: GemmConfig = _INTERPRET_CONFIG,
    keep_default_within: float = 0.0,
) -> GemmConfig:
    """Heuristic config, or the fastest candidate timed once per static key (never the ragged
    dimension) when autotuning is on and we are not inside CUDA-graph capture.

    ``launch(cfg)`` runs a candidate; a tuple of such callables (one per routing, see
    ``routing_robust_tuning``) times each separately and ranks candidates by total time.
    ``keep_default_within``: another candidate replaces the heuristic default only if it is
    faster by more than this fraction on every one of them (the choice then serves routings
    the tuner never saw; see docs/grouped_gemm.md, session 10)."""
    if interpret_mode() or device.type != "cuda":
        return interpret_config
    full_key = (kind, dtype, *key)
    cfg = _tuned.get(full_key)
    if cfg is not None:
        return cfg
    if candidates is None:
        candidates = _candidates(kind, dtype)
    if not autotune_enabled() or torch.cuda.is_current_stream_capturing():
        return candidates[0]
    launches = launch if isinstance(launch, tuple) else (launch,)
    # Two rounds over the candidates, each keeping its best median per launch: a GPU's clock
    # drifts as it heats up, which would otherwise favour whichever candidates run first.
    times: dict[GemmConfig, list[float]] = {}
    for round_ in range(2):
        order = candidates if round_ == 0 else tuple(reversed(candidates))
        for cand in order:
            if round_ and cand not in times:
                continue  # pruned in the first round
            try:
                ms = [
                    triton.testing.do_bench(lambda c=cand, f=f: f(c), warmup=5, rep=20)
                    for f in launches
                ]
            except triton.runtime.errors.OutOfResources:
                if cand is candidates[0]:
                    raise
                continue  # e.g. an fp32 C tile that does not fit in shared memory
            except Exception as exc:  # compiler errors come in several types
                # A candidate this compiler cannot build (a failing pass) is pruned, visibly;
                # the heuristic default is never pruned.
                if cand is candidates[0]:
                    raise
                warnings.warn(
                    f"moekit: grouped GEMM config {cand} skipped: {str(exc)[:200]}", stacklevel=3
                )
                continue
            prev = times.get(cand, [float("inf")] * len(ms))
            times[cand] = [min(x, y) for x, y in zip(ms, prev)]
    best = min(times, key=lambda c: sum(times[c]))
    default = candidates[0]
    margin = 1 + keep_default_within
    if best is not default and not all(b * margin < d for b, d in zip(times[best], times[default])):
        best = default
    _tuned[full_key] = best
    return best


def tuned_configs() -> dict[tuple, GemmConfig]:
    """The autotuner's choices so far, keyed by (form, dtype, static sizes, layout)."""
    return dict(_tuned)


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------


def _tma_compatible(t: torch.Tensor, unit_dim: int) -> bool:
    size = t.element_size()
    others = [st for d, st in enumerate(t.stride()) if d != unit_dim % t.dim()]
    return (
        t.stride(unit_dim) == 1
        and t.data_ptr() % 16 == 0
        and all(st * size % 16 == 0 for st in others)
    )


def grouped_mm_ragged_m(
    a: torch.Tensor,  # [T, K], unit stride along K
    b: torch.Tensor,  # [E, K, N], unit stride along K or N
    offsets: torch.Tensor,  # [E] int32/int64
    out: torch.Tensor,  # [T, N], unit stride along N
    bias: torch.Tensor | None = None,  # [E, N], contiguous rows
    config: GemmConfig | None = None,
) -> torch.Tensor:
    ensure_scratch_allocator()
    T, K = a.shape
    E, _, N = b.shape
    b_k_major = b.stride(1) == 1 and b.stride(2) != 1
    sms = device_sms(a)

    def launch(cfg: GemmConfig, offs: torch.Tensor = offsets) -> None:
        grid = sms * cfg.ctas_per_sm
        _launch(
            _grouped_mm_ragged_m_kernel, (grid,),
            a, b, out, bias if bias is not None else out, offs,
            T, N, K, E,
            a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
            bias.stride(0) if bias is not None else 0,
            B_K_MAJOR=b_k_major,
            HAS_BIAS=bias is not None,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            BLOCK_E=max(triton.next_power_of_2(E), 16),
            GROUP_M=cfg.group_m,
            NUM_PROGRAMS=grid,
            FLATTEN=cfg.flatten,
            C_TMA=cfg.c_tma,
            WARP_SPEC=cfg.warp_specialize,
            EPI_SUBTILE=cfg.epilogue_subtile,
            EXPERT_GROUPS=cfg.expert_groups,
            A_BOUNDED=cfg.a_bounded,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip

    if config is None:
        key = (N, K, E, b_k_major, bias is not None)
        tune = routing_robust_tuning(launch, T, E, offsets)
        config = _pick_config(
            "m", key, a.dtype, a.device, tune, _ragged_m_candidates(a.dtype, T, E, K, N),
            keep_default_within=0.05,
        )  # fmt: skip
    launch(config)
    return out


def routing_robust_tuning(launch, T: int, E: int, offsets: torch.Tensor) -> tuple:
    """The launches a ragged-M autotuner times, for ``_pick_config``: ``launch(cfg)`` on this
    call's routing and ``launch(cfg, offs)`` on a fixed random skewed one
    (``_random_skewed_offsets``).

    The tuning key leaves the routing out, so the choice serves every later routing; timed on
    the first call's routing alone, a candidate that happens to suit it can be kept although
    it runs ~20% slower on others (a DeepSeek-V3 fc1 case in benchmarks/
    probe_ragged_m_routings.py). Every launch rewrites all of its outputs, so the call's own
    final launch leaves them correct."""
    other: list[torch.Tensor] = []

    def on_other(cfg: GemmConfig):
        if not other:
            other.append(_random_skewed_offsets(T, E, offsets))
        return launch(cfg, offs=other[0])

    return (launch, on_other)


def _skewed_offsets(T: int, E: int, like: torch.Tensor) -> torch.Tensor:
    """Cumulative ends of a Zipf-like routing of T rows over E experts (expert e gets a share
    proportional to 1 / (e + 1); the largest takes 1/H_E of the rows: 28% at E = 20)."""
    # Built on the device: no host-to-device copy (and so no sync) during tuning.
    share = 1.0 / torch.arange(1, E + 1, dtype=torch.float64, device=like.device)
    return _ends_from_shares(share, T, like)


def _ends_from_shares(share: torch.Tensor, T: int, like: torch.Tensor) -> torch.Tensor:
    """Cumulative end offsets (``like``'s dtype) of T rows split in proportion to ``share``."""
    ends = torch.floor(torch.cumsum(share, 0) / share.sum() * T)
    ends[-1:].fill_(T)  # a fill kernel: `ends[-1] = T` would copy a host scalar (a sync)
    return ends.to(like.dtype)


def _random_skewed_offsets(T: int, E: int, like: torch.Tensor) -> torch.Tensor:
    """Cumulative ends of a random skewed routing of T rows over E experts, the same for
    every call with these sizes: shares -log(u) * v^(1/0.6) for uniform u, v (close to
    gamma(0.6) draws, a common model of MoE routing skew) from a generator of its own, so that
    the caller's random state is untouched. Large and small experts come in random order."""
    g = torch.Generator(device=like.device)
    g.manual_seed(E)
    u = torch.rand(2, E, generator=g, device=like.device, dtype=torch.float64)
    share = -torch.log1p(-u[0]) * u[1] ** (1 / 0.6)
    return _ends_from_shares(share, T, like)


def grouped_mm_ragged_k(
    a: torch.Tensor,  # [M, T], unit stride along M (the transposed view of a [T, M] matrix)
    b: torch.Tensor,  # [T, N], unit stride along N
    offsets: torch.Tensor,  # [E] int32/int64
    out: torch.Tensor,  # [E, M, N], any strides
    accumulate: bool = False,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    ensure_scratch_allocator()
    M, T = a.shape
    N = b.shape[1]
    E = offsets.shape[0]
    sms = device_sms(a)

    def launch(
        cfg: GemmConfig,
        target: torch.Tensor = out,
        acc: bool = accumulate,
        offs: torch.Tensor = offsets,
    ) -> None:
        # TMA epilogue: unit stride along N, aligned strides, and a reduce-add only in fp32
        # (the interpreter has no TMA reduce, so there the accumulate path uses ld/st).
        c_tma = (
            cfg.c_tma
            and _tma_compatible(target, -1)
            and not (acc and (target.dtype != torch.float32 or interpret_mode()))
        )
        grid = sms * cfg.ctas_per_sm
        _launch(
            _grouped_mm_ragged_k_kernel, (grid,),
            a, b, target, offs, tile_counter(a.device) if cfg.dynamic else offs,
            M, N, T, E,
            a.stride(1), b.stride(0),
            target.stride(0), target.stride(1), target.stride(2),
            ACCUMULATE=acc,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            BLOCK_E=max(triton.next_power_of_2(E), 16),
            GROUP_M=cfg.group_m,
            NUM_PROGRAMS=grid,
            FLATTEN=cfg.flatten,
            C_TMA=c_tma,
            WARP_SPEC=cfg.warp_specialize,
            EPI_SUBTILE=cfg.epilogue_subtile,
            DYNAMIC=cfg.dynamic,
            STATIC_SLACK_PCT=STATIC_DEAL_SLACK_PCT,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip

    if config is None:
        # Tuning writes into a scratch buffer so an accumulating call adds exactly once.
        # The key leaves the routing out, so the choice must serve any routing: each candidate
        # is timed on this call's offsets and on a skewed routing, where tile costs differ
        # most between experts (and a static deal of tiles is least balanced).
        scratch = {}

        def tune_launch(cfg: GemmConfig) -> None:
            if "t" not in scratch:
                scratch["t"] = torch.empty_like(out)
                scratch["skewed"] = _skewed_offsets(T, E, offsets)
            launch(cfg, scratch["t"], accumulate)
            launch(cfg, scratch["t"], accumulate, scratch["skewed"])

        key = (M, N, E, out.dtype, accumulate)
        candidates = _ragged_k_candidates(a.dtype, out.dtype)
        # As for ragged M, a candidate replaces the default only if more than 5% faster (here
        # over both routings together): the tuner's short timings (20 ms per candidate) move
        # by more than the margins between the top configs, and the 16-bit default was within
        # 5% of the best on every routing measured (docs/grouped_gemm.md, session 12).
        config = _pick_config(
            "k", key, a.dtype, a.device, tune_launch, candidates, keep_default_within=0.05
        )
    launch(config)
    return out
