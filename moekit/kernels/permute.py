"""Token permute / unpermute kernels: routing metadata, row scatter, row gather.

Dimension letters: T tokens, k experts per token, E experts, R permuted rows, H hidden.

Routing metadata is a stable counting sort of the N = T·k (token, slot) pairs by expert, done in
three launches and no host sync, over B blocks of ``BLOCK_N`` pairs:

1. ``_routing_hist_kernel``   per block, the histogram over experts → ``block_counts[B, E]``.
2. ``_routing_scan_kernel``   per group of experts, the exclusive prefix over blocks
                              → ``block_offsets[B, E]`` and the per-expert ``totals[E]``.
3. ``_routing_rows_kernel``   per block, a bitonic ``tl.sort`` of the keys ``(e << log2 BLOCK_N)
                              | n`` (stable: the key carries the position), then the pair at sorted
                              position j goes to ``start[e] + block_offsets[b, e] + j − first[e]``
                              (``first`` = exclusive prefix of the block's histogram, ``start`` =
                              padded exclusive prefix over experts, recomputed by every program:
                              ``E`` is small); program 0 also writes ``tokens_per_expert``,
                              ``counts`` and ``offsets``.

The rank needs O(log² BLOCK_N) compare-exchanges per pair, not the O(BLOCK_N) of a pairwise
comparison. Pair indices are int32 (N < 2^31: the row map is int32); ``[B, E]`` offsets are int64.
Ranks follow the flat (token-major) order, so the tokens of one expert keep their original order.
A pair whose expert is outside ``[0, E)`` (a masked slot, −1) gets row −1 and is skipped by the
copy kernels: an out-of-range index is never turned into an out-of-bounds write.

Rows at or past R (``out_rows``) are dropped, in TransformerEngine's order: the first R rows of
the expert-sorted, padded order are kept, every pair whose row would be ``>= R`` gets row −1, and
``tokens_per_expert`` / ``counts`` / ``offsets`` describe the rows kept (``offsets`` clamped at R).

The copies are one program per token (``row_index[t, :]`` gives its k rows):

* ``_scatter_rows_kernel``  reads ``x[t]`` once and writes it to its k rows (permute forward;
  unpermute backward with the rows scaled by their prob and the prob gradient as a fused dot).
  Extra programs before the T token programs zero the padding rows of each expert and the unused
  tail ``[offsets[E-1], R)``, so padding costs no separate pass. No write lands at or past R.
* ``_gather_rows_kernel``   sums the k rows of a token in fp32, optionally weighted
  (unpermute forward; permute backward, with the prob gradient gathered alongside).

``sort_chunks_row_map`` (the row map of ``sort_chunks_by_index``) is two launches: one program
turns the C chunk sizes into their input end offsets and each chunk's row shift (destination
start − source start, scattered by ``sorted_index``), then one program per block of rows finds
each row's chunk by a binary search over the end offsets.

Row offsets are int64 (``R·H`` passes 2^31 at real sizes). The launchers take their config
(:mod:`moekit.tuning.permute` chooses it) and preallocated outputs; inputs are validated by the
ops.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from moekit.kernels.fp8 import e4m3_bytes, e4m3_scale
from moekit.runtime.intmath import cdiv, next_power_of_2
from moekit.runtime.replay import launch
from moekit.tuning.permute import CopyConfig, MetaConfig

__all__ = [
    "QUANT_BLOCK",
    "gather_rows",
    "metadata_blocks",
    "metadata_scratch_numel",
    "routing_metadata",
    "scatter_rows",
    "sort_chunks_row_map",
]

# Rows per zero-fill program of the tail, and of an expert's padding (its bound is align − 1).
_TAIL_ROWS = 64
_PAD_CHUNK = 16
QUANT_BLOCK = 128  # the FP8 recipe's 1×128 activation blocks


@triton.jit
def _routing_hist_kernel(
    idx_ptr,  # [N] expert of each (token, slot) pair, N = T·k; outside [0, E) = dropped
    block_counts_ptr,  # [B, E] int32 out
    N, E,  # sizes
    BLOCK_N: tl.constexpr, E_PAD: tl.constexpr,  # meta
):  # fmt: skip
    """block_counts[b, e] = #{n in block b : idx[n] == e}."""
    b = tl.program_id(0)
    offs = b * BLOCK_N + tl.arange(0, BLOCK_N)  # int32: N = T·k < 2^31 (row_index is int32)
    # Widen before comparing: uint8 / int16 ids against E ≥ 256 must not wrap, int64 ids past
    # 2^31 must not alias a valid expert. (``other`` of a uint8 load is 255, hence ``offs < N``.)
    in_range = offs < N
    e = tl.load(idx_ptr + offs, mask=in_range, other=0).to(tl.int64)
    valid = in_range & (e >= 0) & (e < E)
    hist = tl.histogram(tl.where(valid, e, 0).to(tl.int32), E_PAD, mask=valid)
    ex = tl.arange(0, E_PAD)
    tl.store(block_counts_ptr + b.to(tl.int64) * E + ex, hist, mask=ex < E)


@triton.jit
def _routing_scan_kernel(
    block_counts_ptr, block_offsets_ptr, totals_ptr,  # int32 [B, E] in, [B, E] out, [E] out
    E, num_blocks,  # sizes
    BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,  # meta
):  # fmt: skip
    """block_offsets[b, e] = Σ_{b' < b} block_counts[b', e];  totals[e] = Σ_b block_counts[b, e]."""
    pid = tl.program_id(0)
    ex = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = ex < E
    running = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for b0 in range(0, num_blocks, BLOCK_B):
        bx = b0 + tl.arange(0, BLOCK_B)
        mask = (bx < num_blocks)[:, None] & e_mask[None, :]
        ptrs = bx[:, None].to(tl.int64) * E + ex[None, :]
        c = tl.load(block_counts_ptr + ptrs, mask=mask, other=0)
        incl = tl.cumsum(c, axis=0)
        tl.store(block_offsets_ptr + ptrs, incl - c + running[None, :], mask=mask)
        running += tl.sum(c, axis=0)
    tl.store(totals_ptr + ex, running, mask=e_mask)


@triton.jit
def _routing_rows_kernel(
    # in: idx [N] expert of each pair; int32 block_counts, block_offsets [B, E], totals [E]
    idx_ptr, block_counts_ptr, block_offsets_ptr, totals_ptr,
    # int32 out: row_index [N] (−1 = dropped); per expert [E]: tokens_per_expert (rows kept,
    # unpadded), counts (padded to ALIGN), offsets (cumulative ends); all clamped at R
    row_index_ptr, tokens_per_expert_ptr, counts_ptr, offsets_ptr,
    N, E, R,  # sizes; a pair whose row is >= R is dropped
    # meta; POS_BITS = log2(BLOCK_N)
    ALIGN: tl.constexpr, BLOCK_N: tl.constexpr, POS_BITS: tl.constexpr, E_PAD: tl.constexpr,
):  # fmt: skip
    """Sort the block's keys ``(e << POS_BITS) | n`` (dropped pairs get e = E, so they sort
    last); the pair at sorted position j goes to
        row = start[e] + block_offsets[b, e] + (j − first[e]),
    with first[e] = Σ_{e' < e} block_counts[b, e'] (where e's run starts in the sorted block)
    and start[e] = Σ_{e' < e} ceil(totals[e'] / ALIGN)·ALIGN; it is dropped (−1) when
    row >= R. The sort key carries n, so ties keep token order: the sort is stable."""
    b = tl.program_id(0)
    ex = tl.arange(0, E_PAD)
    e_mask = ex < E
    tpe = tl.load(totals_ptr + ex, mask=e_mask, other=0)
    padded = (tpe + (ALIGN - 1)) // ALIGN * ALIGN
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    if b == 0:
        # What the first R rows hold: segments cut at R, and the real rows among them.
        kept_ends = tl.minimum(ends, R)
        kept = tl.maximum(tl.minimum(tpe, R - starts), 0)
        tl.store(tokens_per_expert_ptr + ex, kept, mask=e_mask)
        tl.store(counts_ptr + ex, kept_ends - tl.minimum(starts, R), mask=e_mask)
        tl.store(offsets_ptr + ex, kept_ends, mask=e_mask)
    row0 = b.to(tl.int64) * E
    cnt = tl.load(block_counts_ptr + row0 + ex, mask=e_mask, other=0)
    pre = tl.load(block_offsets_ptr + row0 + ex, mask=e_mask, other=0)
    # row of sorted position j = base[e] + j
    base = starts + pre - (tl.cumsum(cnt, axis=0) - cnt)

    jj = tl.arange(0, BLOCK_N)
    offs = b * BLOCK_N + jj  # int32: N < 2^31
    in_range = offs < N
    e = tl.load(idx_ptr + offs, mask=in_range, other=0).to(tl.int64)  # widened: see hist
    valid = in_range & (e >= 0) & (e < E)
    key = tl.where(valid, e, E).to(tl.uint32)
    kv = tl.sort((key << POS_BITS) | jj.to(tl.uint32), 0)
    e_sorted = (kv >> POS_BITS).to(tl.int32)
    n_sorted = b * BLOCK_N + (kv & (BLOCK_N - 1)).to(tl.int32)
    row = tl.gather(base, tl.minimum(e_sorted, E_PAD - 1), 0) + jj
    keep = (e_sorted < E) & (row < R)
    tl.store(row_index_ptr + n_sorted, tl.where(keep, row, -1), mask=n_sorted < N)


def metadata_blocks(n: int, config: MetaConfig) -> int:
    """Blocks of the metadata launches for N = T·k pairs (at least one)."""
    return max(cdiv(n, config.block_n), 1)


def metadata_scratch_numel(n: int, num_experts: int, config: MetaConfig) -> int:
    """int32 elements of the metadata's scratch for N = T·k pairs: the [B, E] block counts,
    their [B, E] prefix and the [E] totals."""
    return (2 * metadata_blocks(n, config) + 1) * num_experts


def routing_metadata(
    indices: torch.Tensor,  # [T, k] integer expert ids, contiguous
    num_experts: int,
    align: int,  # 1 = no padding
    out_rows: int,  # R: rows at or past it are dropped
    config: MetaConfig,
    out: tuple[torch.Tensor, ...],  # row_index [T, k], tokens_per_expert, counts, offsets, scratch
) -> None:
    """Stable counting sort of the (token, slot) pairs by expert, on device, in three launches.

    Fills (all int32) ``row_index [T, k]`` (−1 where dropped), ``tokens_per_expert [E]`` (rows
    kept), ``counts [E]`` (padded), ``offsets [E]`` (cumulative end offsets, at most R), using
    ``scratch [metadata_scratch_numel(T·k, E, config)]``.
    """
    row_index, tokens_per_expert, counts, offsets, scratch = out
    n, E = indices.numel(), num_experts
    num_blocks = metadata_blocks(n, config)
    # tl.histogram wants a power-of-two bin count of at least a warp.
    e_pad = max(next_power_of_2(E), 32)
    block_counts = scratch[: num_blocks * E].view(num_blocks, E)
    block_offsets = scratch[num_blocks * E : 2 * num_blocks * E].view(num_blocks, E)
    totals = scratch[2 * num_blocks * E : (2 * num_blocks + 1) * E]
    flat = indices.reshape(-1)
    block_n = config.block_n
    launch(
        _routing_hist_kernel, (num_blocks,),
        flat, block_counts, n, E, BLOCK_N=block_n, E_PAD=e_pad, num_warps=config.hist_warps,
    )  # fmt: skip
    launch(
        _routing_scan_kernel, (cdiv(E, config.scan_block_e),),
        block_counts, block_offsets, totals, E, num_blocks,
        BLOCK_E=config.scan_block_e, BLOCK_B=config.scan_block_b, num_warps=config.scan_warps,
    )  # fmt: skip
    launch(
        _routing_rows_kernel, (num_blocks,),
        flat, block_counts, block_offsets, totals, row_index, tokens_per_expert, counts, offsets,
        n, E, out_rows,
        ALIGN=align, BLOCK_N=block_n, POS_BITS=block_n.bit_length() - 1, E_PAD=e_pad,
        num_warps=config.rows_warps,
    )  # fmt: skip


@triton.jit
def _chunk_shift_kernel(
    sizes_ptr,  # [C] int: rows of each input chunk
    index_ptr,  # [C] int: output chunk j is input chunk index[j]
    src_end_ptr,  # [C] int64 out: cumulative end offsets of the input chunks
    shift_ptr,  # [C] int64 out: destination start − source start of each input chunk
    C,
    C_PAD: tl.constexpr,
):
    c = tl.arange(0, C_PAD)
    m = c < C
    sizes = tl.load(sizes_ptr + c, mask=m, other=0).to(tl.int64)
    src_end = tl.cumsum(sizes, 0)
    idx = tl.load(index_ptr + c, mask=m, other=0).to(tl.int32)
    # An id outside [0, C) (an index that is no permutation, unchecked) reads chunk 0 and
    # writes nothing: the row map is then undefined, but nothing past shift is written.
    ok = m & (idx >= 0) & (idx < C)
    idx = tl.where(ok, idx, 0)
    moved = tl.gather(sizes, idx, 0)  # sizes in output order
    dst_start = tl.cumsum(moved, 0) - moved
    src_start = tl.gather(src_end - sizes, idx, 0)
    tl.store(src_end_ptr + c, src_end, mask=m)
    tl.store(shift_ptr + idx, dst_start - src_start, mask=ok)


@triton.jit
def _chunk_rows_kernel(
    src_end_ptr,  # [C] int64
    shift_ptr,  # [C] int64
    out_ptr,  # [N] int32: destination row of each input row
    N,
    C,
    STEPS: tl.constexpr,  # binary-search steps: C.bit_length()
    BLOCK: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = n < N
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = tl.full([BLOCK], C, dtype=tl.int32)
    for _ in tl.static_range(STEPS):  # lo = the number of chunks ending at or before n
        active = lo < hi
        mid = (lo + hi) // 2
        end = tl.load(src_end_ptr + mid, mask=active & m, other=0)
        right = active & (end <= n)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    inside = m & (lo < C)  # rows past the last chunk keep their place
    shift = tl.load(shift_ptr + lo, mask=inside, other=0)
    tl.store(out_ptr + n, (n + shift).to(tl.int32), mask=m)


_CHUNK_ROWS_BLOCK = 1024


def sort_chunks_row_map(
    split_sizes: torch.Tensor,  # [C] int, contiguous
    sorted_index: torch.Tensor,  # [C] int, contiguous
    out: torch.Tensor,  # [N] int32
    scratch: torch.Tensor,  # [2·C] int64
) -> None:
    """The destination row of each of the N rows when the chunks are reordered (see
    ``moekit.ops.sort_chunks_by_index``), in two launches; C ≥ 1."""
    C, N = split_sizes.numel(), out.numel()
    src_end, shift = scratch[:C], scratch[C:]
    launch(
        _chunk_shift_kernel, (1,), split_sizes, sorted_index, src_end, shift, C,
        C_PAD=max(next_power_of_2(C), 2), num_warps=4,
    )  # fmt: skip
    launch(
        _chunk_rows_kernel, (max(cdiv(N, _CHUNK_ROWS_BLOCK), 1),), src_end, shift, out, N, C,
        STEPS=C.bit_length(), BLOCK=_CHUNK_ROWS_BLOCK, num_warps=4,
    )  # fmt: skip


@triton.jit
def _zero_rows(
    out_ptr, out_vals_ptr, row_lo, row_hi, H, stride_out_r,  # row_lo: int64
    HAS_VALS: tl.constexpr, ZR: tl.constexpr, BLOCK_H: tl.constexpr,
    scale_ptr=None, stride_scale_r=0, NB=0, QUANT: tl.constexpr = False,
):  # fmt: skip
    """out[row_lo:row_hi, :] = 0 and out_vals[row_lo:row_hi] = 0, ZR rows at a time (QUANT:
    the rows' NB scales too)."""
    hx = tl.arange(0, BLOCK_H)
    for r0 in range(row_lo, row_hi, ZR):
        rows = r0 + tl.arange(0, ZR)
        r_mask = rows < row_hi
        if HAS_VALS:
            tl.store(out_vals_ptr + rows, tl.zeros((ZR,), dtype=tl.float32), mask=r_mask)
        if QUANT:
            for b0 in range(0, NB, BLOCK_H):
                b = b0 + hx
                ptrs = scale_ptr + rows[:, None] * stride_scale_r + b[None, :]
                tl.store(ptrs, tl.zeros((ZR, BLOCK_H), dtype=tl.float32),
                         mask=r_mask[:, None] & (b < NB)[None, :])  # fmt: skip
        zeros = tl.zeros((ZR, BLOCK_H), dtype=out_ptr.dtype.element_ty)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + hx
            ptrs = out_ptr + rows[:, None] * stride_out_r + h[None, :]
            tl.store(ptrs, zeros, mask=r_mask[:, None] & (h < H)[None, :])


@triton.jit
def _row_weight(row_w_ptr, rows, mask):
    """row_w[rows] in fp32 (0 where masked)."""
    return tl.load(row_w_ptr + rows, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _token_rows(row_index_ptr, t, R, K: tl.constexpr, K_PAD: tl.constexpr):
    """Token t's k rows on K_PAD lanes: (kx, k_mask, rows, r_mask). rows is int64 (−1 past k);
    r_mask: the row is in [0, R) (a dropped slot's −1 is not)."""
    kx = tl.arange(0, K_PAD)
    k_mask = kx < K
    rows = tl.load(row_index_ptr + t * K + kx, mask=k_mask, other=-1).to(tl.int64)
    return kx, k_mask, rows, (rows >= 0) & (rows < R)


@triton.jit
def _slot_row(row_index_ptr, t, s, R, K: tl.constexpr):
    """Row of slot s of token t (int64) and whether it is in [0, R)."""
    r = tl.load(row_index_ptr + t * K + s).to(tl.int64)
    return r, (r >= 0) & (r < R)


@triton.jit
def _scatter_token(
    t,  # int64 token
    x_ptr, row_index_ptr, slot_vals_ptr, row_w_ptr, dot_ptr, out_ptr, out_vals_ptr,
    H, R, stride_x_t, stride_dot_r, stride_out_r,
    K: tl.constexpr, K_PAD: tl.constexpr,
    COPY_VALS: tl.constexpr, WEIGHTED: tl.constexpr, DOT: tl.constexpr,
    BLOCK_H: tl.constexpr, LOOP_K: tl.constexpr,
    EVICT: tl.constexpr,  # eviction policy of the one-use streams: "evict_first" or ""
):  # fmt: skip
    """One token of ``_scatter_rows_kernel``: x[t] to its k rows (see there)."""
    hx = tl.arange(0, BLOCK_H)
    kx, k_mask, rows, r_mask = _token_rows(row_index_ptr, t, R, K, K_PAD)
    if DOT:
        acc = tl.zeros((K_PAD,), dtype=tl.float32)
    if LOOP_K:
        for h0 in range(0, H, BLOCK_H):
            h = h0 + hx
            h_mask = h < H
            x = tl.load(x_ptr + t * stride_x_t + h, mask=h_mask, other=0.0, eviction_policy=EVICT)
            for s in tl.static_range(K):
                r, ok = _slot_row(row_index_ptr, t, s, R, K)
                mask = h_mask & ok
                if WEIGHTED:
                    w = _row_weight(row_w_ptr, r, ok)
                    y = (x.to(tl.float32) * w).to(out_ptr.dtype.element_ty)
                else:
                    y = x
                tl.store(out_ptr + r * stride_out_r + h, y, mask=mask, eviction_policy=EVICT)
                if DOT:
                    d = tl.load(
                        dot_ptr + r * stride_dot_r + h, mask=mask, other=0.0, eviction_policy=EVICT
                    )
                    part = tl.sum(d.to(tl.float32) * x.to(tl.float32), axis=0)
                    acc = tl.where(kx == s, acc + part, acc)
    else:
        if WEIGHTED:
            w = _row_weight(row_w_ptr, rows, r_mask)
        out_rows = out_ptr + rows[:, None] * stride_out_r
        for h0 in range(0, H, BLOCK_H):
            h = h0 + hx
            h_mask = h < H
            # x is read by several threads (the broadcast over k): never marked evict_first.
            x = tl.load(x_ptr + t * stride_x_t + h, mask=h_mask, other=0.0)
            mask = r_mask[:, None] & h_mask[None, :]
            if WEIGHTED:
                y = (x.to(tl.float32)[None, :] * w[:, None]).to(out_ptr.dtype.element_ty)
            else:
                y = tl.broadcast_to(x[None, :], (K_PAD, BLOCK_H))
            tl.store(out_rows + h[None, :], y, mask=mask, eviction_policy=EVICT)
            if DOT:
                d = tl.load(dot_ptr + rows[:, None] * stride_dot_r + h[None, :], mask=mask,
                            other=0.0, eviction_policy=EVICT)  # fmt: skip
                acc += tl.sum(d.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if COPY_VALS:
        v = tl.load(slot_vals_ptr + t * K + kx, mask=k_mask, other=0.0)
        tl.store(out_vals_ptr + rows, v, mask=r_mask)
    if DOT:
        tl.store(out_vals_ptr + rows, acc, mask=r_mask)


@triton.jit
def _scatter_token_fp8(
    t, x_ptr, row_index_ptr, slot_vals_ptr, out_ptr, out_vals_ptr, scale_ptr, H, R, NB,
    stride_x_t, stride_out_r, stride_scale_r, K: tl.constexpr, K_PAD: tl.constexpr,
    COPY_VALS: tl.constexpr, BLOCK_H: tl.constexpr, QBLOCK: tl.constexpr, POW2: tl.constexpr,
):  # fmt: skip
    """One token of ``_scatter_rows_kernel`` with QUANT: x[t] quantized once per 1×QBLOCK
    block (e4m3 bytes and the block's scale, as :mod:`moekit.kernels.fp8` computes them), then
    written to its k rows; its slot values (COPY_VALS) to theirs."""
    G: tl.constexpr = BLOCK_H // QBLOCK
    hx = tl.arange(0, BLOCK_H)
    gx = tl.arange(0, G)
    kx, k_mask, rows, r_mask = _token_rows(row_index_ptr, t, R, K, K_PAD)
    out_rows = out_ptr + rows[:, None] * stride_out_r
    scale_rows = scale_ptr + rows[:, None] * stride_scale_r
    for h0 in range(0, H, BLOCK_H):
        h = h0 + hx
        h_mask = h < H
        x = tl.load(x_ptr + t * stride_x_t + h, mask=h_mask, other=0.0).to(tl.float32)
        xg = tl.reshape(x, (G, QBLOCK))
        amax = tl.max(tl.where(xg == xg, tl.abs(xg), 0.0), axis=1)
        scale, inv = e4m3_scale(amax, POW2)  # [G]
        byte = tl.reshape(e4m3_bytes(xg, inv[:, None]), (BLOCK_H,))
        y = tl.broadcast_to(byte[None, :], (K_PAD, BLOCK_H))
        tl.store(out_rows + h[None, :], y, mask=r_mask[:, None] & h_mask[None, :])
        b = h0 // QBLOCK + gx
        tl.store(scale_rows + b[None, :], tl.broadcast_to(scale[None, :], (K_PAD, G)),
                 mask=r_mask[:, None] & (b < NB)[None, :])  # fmt: skip
    if COPY_VALS:
        v = tl.load(slot_vals_ptr + t * K + kx, mask=k_mask, other=0.0)
        tl.store(out_vals_ptr + rows, v, mask=r_mask)


@triton.jit
def _scatter_rows_kernel(
    # pointers: x [T, H] (hidden, or grad of the combined output), row_index [T, K] int32
    # (−1 = dropped), slot_vals [T, K] (COPY_VALS), row_w [R] (WEIGHTED), dot [R, H] (DOT)
    x_ptr, row_index_ptr, slot_vals_ptr, row_w_ptr, dot_ptr,
    out_ptr, out_vals_ptr,  # out: [R, H], [R] (COPY_VALS or DOT)
    # int32 [E]: end offsets of the padded segments (at most R), unpadded rows per expert
    offsets_ptr, tokens_per_expert_ptr,
    T, H, R, E, tail_lo,  # sizes; tail_lo: static lower bound of offsets[E-1]
    stride_x_t, stride_dot_r, stride_out_r,  # strides
    # meta; HAS_VALS: out_vals exists (COPY_VALS or DOT) and its padding is zeroed too
    K: tl.constexpr, K_PAD: tl.constexpr,
    COPY_VALS: tl.constexpr, WEIGHTED: tl.constexpr, DOT: tl.constexpr, HAS_VALS: tl.constexpr,
    # zero-fill programs (see below); PAD_SPLIT 1: one program zeroes an expert's padding
    PAD_PROGRAMS: tl.constexpr, PAD_SPLIT: tl.constexpr, PAD_CHUNK: tl.constexpr,
    TAIL_PROGRAMS, TAIL_ROWS: tl.constexpr, ZR: tl.constexpr,
    BLOCK_H: tl.constexpr, LOOP_K: tl.constexpr, EVICT: tl.constexpr,  # CopyConfig
    # QUANT: out holds e4m3 bytes and scale [R, NB] fp32 one scale per 1×QBLOCK block
    scale_ptr=None, stride_scale_r=0, NB=0,
    QUANT: tl.constexpr = False, QBLOCK: tl.constexpr = 128, POW2: tl.constexpr = False,
):  # fmt: skip
    """Token programs:  for each slot s of token t with r = row_index[t, s] in [0, R):
        out[r] = x[t] · (row_w[r] if WEIGHTED else 1)   (QUANT: e4m3(x[t]), scale[r])
        out_vals[r] = slot_vals[t, s]                       (COPY_VALS)
        out_vals[r] = Σ_h x[t, h] · dot[r, h]  (fp32)        (DOT)
    Before them: PAD_PROGRAMS programs zeroing rows [start_e + tokens_per_expert[e], end_e) of
    expert e (PAD_SPLIT per expert, PAD_CHUNK rows each), then TAIL_PROGRAMS zeroing rows
    [offsets[E-1], R), TAIL_ROWS rows each from ``tail_lo``. Every zeroed row is below R."""
    # Zero-fill programs come first, so that they start with the first wave and never trail the
    # copies as a one-SM tail; each zeroes at most PAD_CHUNK / TAIL_ROWS rows.
    pid = tl.program_id(0)
    if pid < PAD_PROGRAMS:
        e = pid // PAD_SPLIT
        end = tl.load(offsets_ptr + e).to(tl.int64)
        start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
        lo = start + tl.load(tokens_per_expert_ptr + e).to(tl.int64)
        if PAD_SPLIT > 1:
            lo += (pid % PAD_SPLIT) * PAD_CHUNK
            hi = tl.minimum(lo + PAD_CHUNK, end)
        else:
            hi = end
        # The metadata keeps offsets within R; the bound here keeps a caller's larger offsets
        # from turning into writes past the output.
        hi = tl.minimum(hi, R)
        _zero_rows(out_ptr, out_vals_ptr, lo, hi, H, stride_out_r, HAS_VALS, ZR, BLOCK_H,
                   scale_ptr, stride_scale_r, NB, QUANT)  # fmt: skip
    elif pid < PAD_PROGRAMS + TAIL_PROGRAMS:
        lo = tail_lo + (pid - PAD_PROGRAMS).to(tl.int64) * TAIL_ROWS
        hi = tl.minimum(lo + TAIL_ROWS, R)
        tail_start = tl.load(offsets_ptr + E - 1).to(tl.int64)
        lo = tl.maximum(lo, tail_start)
        if lo < hi:
            _zero_rows(out_ptr, out_vals_ptr, lo, hi, H, stride_out_r, HAS_VALS, ZR, BLOCK_H,
                       scale_ptr, stride_scale_r, NB, QUANT)  # fmt: skip
    elif QUANT:
        t = (pid - PAD_PROGRAMS - TAIL_PROGRAMS).to(tl.int64)
        _scatter_token_fp8(
            t, x_ptr, row_index_ptr, slot_vals_ptr, out_ptr, out_vals_ptr, scale_ptr, H, R, NB,
            stride_x_t, stride_out_r, stride_scale_r, K, K_PAD, COPY_VALS, BLOCK_H, QBLOCK,
            POW2,
        )  # fmt: skip
    else:
        t = (pid - PAD_PROGRAMS - TAIL_PROGRAMS).to(tl.int64)
        _scatter_token(
            t, x_ptr, row_index_ptr, slot_vals_ptr, row_w_ptr, dot_ptr, out_ptr, out_vals_ptr,
            H, R, stride_x_t, stride_dot_r, stride_out_r,
            K, K_PAD, COPY_VALS, WEIGHTED, DOT, BLOCK_H, LOOP_K, EVICT,
        )  # fmt: skip


@triton.jit
def _gather_rows_kernel(
    # pointers: src [R, H] rows to combine, row_index [T, K] int32 (−1 = dropped),
    # row_w [R] (WEIGHTED), row_vals [R] (GATHER_VALS)
    src_ptr, row_index_ptr, row_w_ptr, row_vals_ptr,
    out_ptr, out_vals_ptr,  # out: [T, H], [T, K] (GATHER_VALS)
    H, R,  # sizes
    stride_src_r, stride_out_t,  # strides
    K: tl.constexpr, K_PAD: tl.constexpr, WEIGHTED: tl.constexpr, GATHER_VALS: tl.constexpr,
    BLOCK_H: tl.constexpr, LOOP_K: tl.constexpr, EVICT: tl.constexpr,  # CopyConfig
):  # fmt: skip
    """out[t] = Σ_s src[r_s] · (row_w[r_s] if WEIGHTED else 1), accumulated in fp32, over the
    slots with r_s = row_index[t, s] in [0, R);  out_vals[t, s] = row_vals[r_s] (0 when
    dropped). One program per token."""
    t = tl.program_id(0).to(tl.int64)
    hx = tl.arange(0, BLOCK_H)
    kx, k_mask, rows, r_mask = _token_rows(row_index_ptr, t, R, K, K_PAD)
    if GATHER_VALS:
        v = tl.load(row_vals_ptr + rows, mask=r_mask, other=0.0)
        tl.store(out_vals_ptr + t * K + kx, v, mask=k_mask)
    if LOOP_K:
        for h0 in range(0, H, BLOCK_H):
            h = h0 + hx
            h_mask = h < H
            acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
            for s in tl.static_range(K):
                r, ok = _slot_row(row_index_ptr, t, s, R, K)
                y = tl.load(src_ptr + r * stride_src_r + h, mask=h_mask & ok, other=0.0,
                            eviction_policy=EVICT).to(tl.float32)  # fmt: skip
                if WEIGHTED:
                    y = y * _row_weight(row_w_ptr, r, ok)
                acc += y
            tl.store(out_ptr + t * stride_out_t + h, acc.to(out_ptr.dtype.element_ty),
                     mask=h_mask, eviction_policy=EVICT)  # fmt: skip
    else:
        src_rows = src_ptr + rows[:, None] * stride_src_r
        if WEIGHTED:
            w = _row_weight(row_w_ptr, rows, r_mask)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + hx
            h_mask = h < H
            y = tl.load(src_rows + h[None, :], mask=r_mask[:, None] & h_mask[None, :], other=0.0,
                        eviction_policy=EVICT)  # fmt: skip
            y = y.to(tl.float32)
            if WEIGHTED:
                y = y * w[:, None]
            acc = tl.sum(y, axis=0)
            tl.store(out_ptr + t * stride_out_t + h, acc.to(out_ptr.dtype.element_ty),
                     mask=h_mask, eviction_policy=EVICT)  # fmt: skip


def _evict(config: CopyConfig) -> str:
    return "evict_first" if config.evict_first else ""


def scatter_rows(
    x: torch.Tensor,  # [T, H], unit stride along H
    row_index: torch.Tensor,  # [T, k] int32, contiguous
    offsets: torch.Tensor | None,  # [E] int32 (None: no padding and no tail to zero)
    tokens_per_expert: torch.Tensor | None,  # [E] int32 (None likewise)
    out: torch.Tensor,  # [R, H] unit stride along H
    out_vals: torch.Tensor | None,  # [R] (with slot_vals or dot_src)
    config: CopyConfig,
    *,
    slot_vals: torch.Tensor | None = None,  # [T, k] → out_vals[R]
    row_weight: torch.Tensor | None = None,  # [R] scale of each written row
    dot_src: torch.Tensor | None = None,  # [R, H] → out_vals[R] = rowwise dot with x[t]
    align: int = 1,  # segments padded to this many rows: their padding rows are zeroed
    tail_lo: int = 0,  # static lower bound of offsets[E-1]; rows [offsets[E-1], R) are zeroed
    scale: torch.Tensor | None = None,  # [R, ⌈H/128⌉] fp32: quantize, out the uint8 bytes
    pow2: bool = False,  # with scale: power-of-two scales
) -> None:
    """Write each token's row to its k destinations (reading it once); zero padding and tail rows.

    With ``scale``, the rows are written quantized to e4m3 (``out`` a uint8 view) with one
    scale per 1×128 block, each token quantized once; padding and tail rows get zero bytes and
    zero scales. ``offsets`` and ``tokens_per_expert`` may be None only with ``align == 1`` and
    ``tail_lo >= R`` (every row is written, e.g. a permutation).
    """
    T, H = x.shape
    k = row_index.shape[1]
    R = out.shape[0]
    E = offsets.numel() if offsets is not None else 0
    pad_split = cdiv(align - 1, _PAD_CHUNK) if align > 1 else 1
    pad_n = E * pad_split if align > 1 else 0
    tail_n = cdiv(max(R - tail_lo, 0), _TAIL_ROWS)
    grid = (T + pad_n + tail_n,)
    if grid[0] == 0:
        return
    dummy = out  # never dereferenced when its flag is off
    fp8 = {}
    if scale is not None:  # whole 1×128 blocks per step
        block_h = max(config.block_h, QUANT_BLOCK)
        fp8 = dict(scale_ptr=scale, stride_scale_r=scale.stride(0), NB=scale.shape[1],
                   QUANT=True, QBLOCK=QUANT_BLOCK, POW2=pow2)  # fmt: skip
        config = dataclasses.replace(config, block_h=block_h)
    launch(
        _scatter_rows_kernel, grid,
        x, row_index,
        *(t if t is not None else dummy for t in (slot_vals, row_weight, dot_src, out)),
        *(t if t is not None else dummy for t in (out_vals, offsets, tokens_per_expert)),
        T, H, R, E, tail_lo,
        x.stride(0), dot_src.stride(0) if dot_src is not None else 0, out.stride(0),
        K=k, K_PAD=next_power_of_2(max(k, 1)),
        COPY_VALS=slot_vals is not None, WEIGHTED=row_weight is not None,
        DOT=dot_src is not None, HAS_VALS=out_vals is not None,
        PAD_PROGRAMS=pad_n, PAD_SPLIT=pad_split, PAD_CHUNK=_PAD_CHUNK,
        TAIL_PROGRAMS=tail_n, TAIL_ROWS=_TAIL_ROWS, ZR=config.zero_rows,
        BLOCK_H=config.block_h, LOOP_K=config.loop_k, EVICT=_evict(config),
        num_warps=config.num_warps, **fp8,
    )  # fmt: skip


def gather_rows(
    src: torch.Tensor,  # [R, H], unit stride along H
    row_index: torch.Tensor,  # [T, k] int32, contiguous
    out: torch.Tensor,  # [T, H] unit stride along H
    config: CopyConfig,
    *,
    row_weight: torch.Tensor | None = None,  # [R]
    row_vals: torch.Tensor | None = None,  # [R] → out_vals [T, k]
    out_vals: torch.Tensor | None = None,  # [T, k] (with row_vals)
) -> None:
    """Sum each token's k rows in fp32 (weighted by ``row_weight`` when given) into ``out``;
    ``out_vals[t, s] = row_vals[row_index[t, s]]``, 0 for dropped slots."""
    R, H = src.shape
    T, k = row_index.shape
    if T == 0:
        return
    dummy = out  # never dereferenced when its flag is off
    launch(
        _gather_rows_kernel, (T,),
        src, row_index,
        *(t if t is not None else dummy for t in (row_weight, row_vals, out, out_vals)),
        H, R, src.stride(0), out.stride(0),
        K=k, K_PAD=next_power_of_2(max(k, 1)),
        WEIGHTED=row_weight is not None, GATHER_VALS=row_vals is not None,
        BLOCK_H=config.block_h, LOOP_K=config.loop_k, EVICT=_evict(config),
        num_warps=config.num_warps,
    )  # fmt: skip
