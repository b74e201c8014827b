"""The ragged tile scheduler shared by every grouped-GEMM kernel (``@triton.jit`` helpers).

Experts own contiguous row ranges given by cumulative end offsets (``offsets`` [E], the
``torch._grouped_mm`` convention), read only on the device:

* Ragged M (forward, dgrad): expert e owns rows [start_e, end_e) and ceil(count_e / BLOCK_M)
  m-tiles. A program loads all E offsets as one vector, takes an inclusive cumsum of the
  m-tile counts and maps a global m-tile index g to its expert by counting cumsum entries <= g.
  A tile that starts inside an expert may run past its end into the next expert's rows; those
  accumulator rows are never stored (the tile stores through a descriptor bounded at end_e).
* Row-bounded descriptors (:func:`ragged_rows_desc`): one TMA descriptor per program whose row
  bound is chosen per access, so loads past an expert's end read zeros and stores past it are
  dropped. Experts ending within the first BLOCK rows cannot be bounded this way and take
  pointer paths (:func:`split_small_experts`, :func:`store_rows`).
* Persistent programs deal tiles round-robin; a follow-on loop continues the deal where the
  previous one stopped (:func:`next_deal_start`).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "expert_bounds",
    "next_deal_start",
    "ragged_m_schedule",
    "ragged_m_tile",
    "ragged_rows_at",
    "ragged_rows_desc",
    "split_columns",
    "split_small_experts",
    "store_c_tile",
    "store_rows",
    "swizzle_tile",
]


@triton.jit
def swizzle_tile(tile, num_m, num_n, GROUP_M: tl.constexpr):
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
def ragged_rows_desc(ptr, T, C, stride, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Descriptor over a row-major [T, C] matrix whose row bound is chosen per access.

    A plain descriptor clips rows at T only. This one is 3-D, [T, BLOCK_R, C] with strides
    [stride, stride, 1] and base ``ptr``, so element (j, i, c) is row j + i. Rows
    [r, r + BLOCK_R) bounded at ``end`` are accessed at ``ragged_rows_at(r, end, BLOCK_R)``
    = (min(r, end - BLOCK_R), r - that): the TMA engine's own bound check (i < BLOCK_R) then
    clips exactly the rows >= end, so loads past an expert's end read zeros and stores past it
    are dropped, and one descriptor per program serves every expert.

    The base must be ``ptr`` itself: the TMA unit touches the page of a descriptor's base
    address even when no element there is accessed, so a base before the tensor can fault
    where that page is unmapped. The price is the precondition end >= BLOCK_R (else j would
    be negative and the whole box out of bounds): experts ending within the first BLOCK_R rows
    take pointer paths (store_rows after the ragged-M main loop, the ragged-K small-expert
    step, the dact kernel's second loop).
    """
    return tl.make_tensor_descriptor(
        ptr,
        shape=[tl.maximum(T, 1), BLOCK_R, C],
        strides=[stride, stride, 1],
        block_shape=[1, BLOCK_R, BLOCK_C],
    )


@triton.jit
def ragged_rows_at(r, end, BLOCK_R: tl.constexpr):
    """(j, i) coordinates of rows [r, r + BLOCK_R) bounded at ``end`` in a
    ``ragged_rows_desc`` (needs end >= BLOCK_R; see there)."""
    j = tl.minimum(r, end - BLOCK_R)
    return j, r - j


@triton.jit
def split_columns(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BM, BN] → its left and right [BM, BN/2] halves (for the sub-tiled epilogue)."""
    halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
    return tl.split(halves)


@triton.jit
def expert_bounds(offsets_ptr, E, T, BLOCK_E: tl.constexpr):
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
def ragged_m_schedule(offsets_ptr, E, T, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Per-expert m-tile counts for a ragged-M launch: (offs_e, starts, ends, m_tiles,
    cum_m_tiles, total_m). Expert e owns ceil(count_e / BLOCK_M) m-tiles."""
    offs_e, _, starts, ends = expert_bounds(offsets_ptr, E, T, BLOCK_E)
    m_tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M  # 0 on padding lanes
    cum_m_tiles = tl.cumsum(m_tiles, axis=0)  # inclusive
    total_m = tl.sum(m_tiles, axis=0)
    return offs_e, starts, ends, m_tiles, cum_m_tiles, total_m


@triton.jit
def ragged_m_tile(
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
        m_local, pid_n = swizzle_tile(tile - m_before * num_n, m_e, num_n, GROUP_M)
    else:
        g_m, pid_n = swizzle_tile(tile, total_m, num_n, GROUP_M)
        e = tl.sum((cum_m_tiles <= g_m).to(tl.int32), axis=0)
        m_before = tl.sum(tl.where(offs_e < e, m_tiles, 0), axis=0)
        m_local = g_m - m_before
    row_start = tl.sum(tl.where(offs_e == e, starts, 0), axis=0)
    row_end = tl.sum(tl.where(offs_e == e, ends, 0), axis=0)
    return e, row_start + m_local * BLOCK_M, row_end, pid_n


@triton.jit
def split_small_experts(ends, m_tiles, BLOCK_M: tl.constexpr):
    """Split a ragged-M schedule's m-tiles into the main loop's and those of experts ending
    within the first BLOCK_M rows (which a ragged_rows_desc cannot bound: pointer paths).
    Returns (main_m, cum_main, total_main, small_m, cum_small, total_small)."""
    small = ends < BLOCK_M
    main_m = tl.where(small, 0, m_tiles)
    small_m = tl.where(small, m_tiles, 0)
    return (
        main_m, tl.cumsum(main_m, axis=0), tl.sum(main_m, axis=0),
        small_m, tl.cumsum(small_m, axis=0), tl.sum(small_m, axis=0),
    )  # fmt: skip


@triton.jit
def next_deal_start(pid, dealt, NUM_PROGRAMS: tl.constexpr):
    """First tile of a follow-on tile loop for program ``pid`` when ``dealt`` tiles were dealt
    round-robin before it: the deal continues where the last one stopped instead of restarting
    at program 0, which would give the first programs one tile more in each loop."""
    return (pid - dealt % NUM_PROGRAMS + NUM_PROGRAMS) % NUM_PROGRAMS


@triton.jit
def store_c_tile(desc, p, q, off_n, c, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  EPI_SUBTILE: tl.constexpr):  # fmt: skip
    """TMA store of a [BM, BN] C tile at (p, q, off_n) of a 3-D descriptor, as two [BM, BN/2]
    halves with EPI_SUBTILE (the descriptor's block is then half as wide)."""
    if EPI_SUBTILE:
        c0, c1 = split_columns(c, BLOCK_M, BLOCK_N)
        desc.store([p, q, off_n], c0.reshape(1, BLOCK_M, BLOCK_N // 2))
        desc.store([p, q, off_n + BLOCK_N // 2], c1.reshape(1, BLOCK_M, BLOCK_N // 2))
    else:
        desc.store([p, q, off_n], c.reshape(1, BLOCK_M, BLOCK_N))


@triton.jit
def store_rows(c_ptr, c, off_m, off_n, row_end, N, stride_c_t,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Pointer store of a [BM, BN] tile of a row-major C, rows bounded at row_end."""
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_c_t + cols[None, :]
    tl.store(c_ptrs, c, mask=(rows[:, None] < row_end) & (cols[None, :] < N))
