"""Token permute / unpermute kernels: routing metadata, row scatter, row gather.

Dimension letters: T tokens, k experts per token, E experts, R permuted rows, H hidden.

Routing metadata is a stable counting sort of the T·k (token, slot) pairs by expert, done in three
launches and no host sync:

1. ``_routing_hist_kernel``   per block of ``BLOCK_N`` pairs, the histogram over experts
                              → ``block_counts[E, B]``.
2. ``_routing_scan_kernel``   per expert, the exclusive prefix over blocks
                              → ``block_offsets[E, B]`` and ``tokens_per_expert[E]``.
3. ``_routing_rows_kernel``   per block, each pair's destination row ``start[e] +
                              block_offsets[e, b] + rank among earlier pairs of e in b``,
                              with ``start`` the padded exclusive prefix over experts (every program
                              recomputes it: ``E`` is small); program 0 also writes ``counts`` and
                              ``offsets``.

Ranks follow the flat (token-major) order, so the tokens of one expert keep their original order.
A pair whose expert is outside ``[0, E)`` (a masked slot, −1) gets row −1 and is skipped by the
copy kernels: an out-of-range index is never turned into an out-of-bounds write.

The copies are one program per token (``row_index[t, :]`` gives its k rows):

* ``_scatter_rows_kernel``  reads ``x[t]`` once and writes it to its k rows (permute forward;
  unpermute backward with the rows scaled by their prob and the prob gradient as a fused dot).
  Extra programs after the T token programs zero the padding rows of each expert and the unused
  tail ``[offsets[E-1], R)``, so padding costs no separate pass.
* ``_gather_rows_kernel``   sums the k rows of a token in fp32, optionally weighted
  (unpermute forward; permute backward, with the prob gradient gathered alongside).

Row offsets are int64 (``R·H`` passes 2^31 at real sizes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Pairs per metadata block and per rank sub-chunk. A pair's rank inside a sub-chunk comes from an
# [SUB, SUB] comparison, and the running per-expert count carries it across sub-chunks.
_META_BLOCK_N = 512
_META_SUB = 128
# Experts and blocks per program of the scan.
_SCAN_BLOCK_E = 8
_SCAN_BLOCK_B = 256
# Rows per zero-fill program of the tail, and rows per inner step.
_TAIL_ROWS = 512
# Elements per [k, BLOCK_H] tile of the copy kernels.
_TILE_ELEMS = 8192


# ------------------------------------------------------------------------------------------------
# Routing metadata
# ------------------------------------------------------------------------------------------------


@triton.jit
def _routing_hist_kernel(
    # pointers
    idx_ptr,  # [N] expert of each (token, slot) pair, N = T·k; outside [0, E) = dropped
    block_counts_ptr,  # [E, B] int32 out
    # sizes
    N,
    E,
    num_blocks,
    # meta
    BLOCK_N: tl.constexpr,
    E_PAD: tl.constexpr,
):
    """block_counts[e, b] = #{n in block b : idx[n] == e}."""
    b = tl.program_id(0)
    offs = b.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.load(idx_ptr + offs, mask=offs < N, other=-1).to(tl.int32)
    valid = (e >= 0) & (e < E)
    hist = tl.histogram(tl.where(valid, e, 0), E_PAD, mask=valid)
    ex = tl.arange(0, E_PAD)
    tl.store(block_counts_ptr + ex.to(tl.int64) * num_blocks + b, hist, mask=ex < E)


@triton.jit
def _routing_scan_kernel(
    # pointers
    block_counts_ptr,  # [E, B] int32
    block_offsets_ptr,  # [E, B] int32 out: exclusive prefix over b
    tokens_per_expert_ptr,  # [E] int32 out: total over b
    # sizes
    E,
    num_blocks,
    # meta
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """block_offsets[e, b] = Σ_{b' < b} block_counts[e, b'];  tokens_per_expert[e] = Σ_b …"""
    pid = tl.program_id(0)
    ex = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = ex < E
    running = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for b0 in range(0, num_blocks, BLOCK_B):
        bx = b0 + tl.arange(0, BLOCK_B)
        mask = e_mask[:, None] & (bx < num_blocks)[None, :]
        ptrs = ex[:, None].to(tl.int64) * num_blocks + bx[None, :]
        c = tl.load(block_counts_ptr + ptrs, mask=mask, other=0)
        incl = tl.cumsum(c, axis=1)
        tl.store(block_offsets_ptr + ptrs, incl - c + running[:, None], mask=mask)
        running += tl.sum(c, axis=1)
    tl.store(tokens_per_expert_ptr + ex, running, mask=e_mask)


@triton.jit
def _routing_rows_kernel(
    # pointers
    idx_ptr,  # [N] expert of each pair
    block_offsets_ptr,  # [E, B] int32
    tokens_per_expert_ptr,  # [E] int32
    row_index_ptr,  # [N] int32 out: destination row, −1 when dropped
    counts_ptr,  # [E] int32 out: rows per expert, padded to ALIGN
    offsets_ptr,  # [E] int32 out: cumulative end offsets of the padded segments
    # sizes
    N,
    E,
    num_blocks,
    # meta
    ALIGN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB: tl.constexpr,
    E_PAD: tl.constexpr,
):
    """row[n] = start[e] + block_offsets[e, b] + #{n' in b, n' < n : idx[n'] == e},  e = idx[n],
    start[e] = Σ_{e' < e} ceil(tokens_per_expert[e'] / ALIGN)·ALIGN."""
    b = tl.program_id(0)
    ex = tl.arange(0, E_PAD)
    tpe = tl.load(tokens_per_expert_ptr + ex, mask=ex < E, other=0)
    padded = (tpe + (ALIGN - 1)) // ALIGN * ALIGN
    ends = tl.cumsum(padded, axis=0)
    if b == 0:
        tl.store(counts_ptr + ex, padded, mask=ex < E)
        tl.store(offsets_ptr + ex, ends, mask=ex < E)
    blk = tl.load(block_offsets_ptr + ex.to(tl.int64) * num_blocks + b, mask=ex < E, other=0)
    # Next free row of each expert for this block; advanced after every sub-chunk.
    base = ends - padded + blk

    ii = tl.arange(0, SUB)
    earlier = ii[None, :] < ii[:, None]  # [SUB, SUB]: column j precedes row i
    for j in range(0, BLOCK_N, SUB):
        offs = b.to(tl.int64) * BLOCK_N + j + ii
        e = tl.load(idx_ptr + offs, mask=offs < N, other=-1).to(tl.int32)
        valid = (e >= 0) & (e < E)
        e_safe = tl.where(valid, e, 0)
        same = (e[:, None] == e[None, :]) & earlier & valid[None, :]
        rank = tl.sum(same.to(tl.int32), axis=1)
        row = tl.gather(base, e_safe, 0) + rank
        tl.store(row_index_ptr + offs, tl.where(valid, row, -1), mask=offs < N)
        base += tl.histogram(e_safe, E_PAD, mask=valid)


def routing_metadata(
    indices: torch.Tensor,  # [T, k] int32/int64, contiguous
    num_experts: int,
    align: int,  # 1 = no padding
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable counting sort of the (token, slot) pairs by expert, on device, in three launches.

    Returns ``row_index [T, k]``, ``tokens_per_expert [E]``, ``counts [E]`` (padded) and
    ``offsets [E]`` (cumulative end offsets of the padded segments), all int32.
    """
    device = indices.device
    n = indices.numel()
    E = num_experts
    num_blocks = max(triton.cdiv(n, _META_BLOCK_N), 1)
    # tl.histogram wants a power-of-two bin count of at least a warp.
    e_pad = max(triton.next_power_of_2(E), 32)
    block_counts = torch.empty((E, num_blocks), dtype=torch.int32, device=device)
    block_offsets = torch.empty_like(block_counts)
    tokens_per_expert = torch.empty(E, dtype=torch.int32, device=device)
    counts = torch.empty(E, dtype=torch.int32, device=device)
    offsets = torch.empty(E, dtype=torch.int32, device=device)
    row_index = torch.empty(indices.shape, dtype=torch.int32, device=device)
    flat = indices.reshape(-1)

    _routing_hist_kernel[(num_blocks,)](
        flat, block_counts, n, E, num_blocks, BLOCK_N=_META_BLOCK_N, E_PAD=e_pad, num_warps=4
    )
    _routing_scan_kernel[(triton.cdiv(E, _SCAN_BLOCK_E),)](
        block_counts,
        block_offsets,
        tokens_per_expert,
        E,
        num_blocks,
        BLOCK_E=_SCAN_BLOCK_E,
        BLOCK_B=_SCAN_BLOCK_B,
        num_warps=4,
    )
    _routing_rows_kernel[(num_blocks,)](
        flat,
        block_offsets,
        tokens_per_expert,
        row_index,
        counts,
        offsets,
        n,
        E,
        num_blocks,
        ALIGN=align,
        BLOCK_N=_META_BLOCK_N,
        SUB=_META_SUB,
        E_PAD=e_pad,
        num_warps=4,
    )
    return row_index, tokens_per_expert, counts, offsets


# ------------------------------------------------------------------------------------------------
# Row copies
# ------------------------------------------------------------------------------------------------


@triton.jit
def _zero_rows(
    out_ptr,
    out_vals_ptr,
    row_lo,  # first row to zero (int64 scalar)
    row_hi,  # one past the last row to zero
    H,
    stride_out_r,
    HAS_VALS: tl.constexpr,
    ZR: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[row_lo:row_hi, :] = 0 and out_vals[row_lo:row_hi] = 0, ZR rows at a time."""
    hx = tl.arange(0, BLOCK_H)
    for r0 in range(row_lo, row_hi, ZR):
        rows = r0 + tl.arange(0, ZR)
        r_mask = rows < row_hi
        if HAS_VALS:
            tl.store(out_vals_ptr + rows, tl.zeros((ZR,), dtype=tl.float32), mask=r_mask)
        zeros = tl.zeros((ZR, BLOCK_H), dtype=out_ptr.dtype.element_ty)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + hx
            ptrs = out_ptr + rows[:, None] * stride_out_r + h[None, :]
            tl.store(ptrs, zeros, mask=r_mask[:, None] & (h < H)[None, :])


@triton.jit
def _scatter_rows_kernel(
    # pointers
    x_ptr,  # [T, H] source rows: hidden (permute fwd) or grad of the combined output
    row_index_ptr,  # [T, K] int32 destination row of each slot, −1 = dropped
    slot_vals_ptr,  # [T, K] per-slot values copied to out_vals (COPY_VALS)
    row_w_ptr,  # [R] per-row scale (WEIGHTED)
    dot_ptr,  # [R, H] rows dotted with x[t] into out_vals (DOT)
    out_ptr,  # [R, H] out
    out_vals_ptr,  # [R] out (COPY_VALS or DOT)
    offsets_ptr,  # [E] int32 end offsets of the padded segments
    tokens_per_expert_ptr,  # [E] int32 unpadded rows per expert
    # sizes
    T,
    H,
    R,
    E,
    tail_lo,  # static lower bound of offsets[E-1]: tail programs start there
    # strides
    stride_x_t,
    stride_dot_r,
    stride_out_r,
    # meta
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    COPY_VALS: tl.constexpr,
    WEIGHTED: tl.constexpr,
    DOT: tl.constexpr,
    HAS_VALS: tl.constexpr,  # COPY_VALS or DOT: out_vals exists and its padding is zeroed too
    PAD_PROGRAMS: tl.constexpr,  # E programs zeroing the padding rows of each expert, or 0
    TAIL_ROWS: tl.constexpr,
    ZR: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Token programs t < T:  for each slot s with r = row_index[t, s] in [0, R):
        out[r] = x[t] · (row_w[r] if WEIGHTED else 1)
        out_vals[r] = slot_vals[t, s]                       (COPY_VALS)
        out_vals[r] = Σ_h x[t, h] · dot[r, h]  (fp32)        (DOT)
    Then PAD_PROGRAMS programs zeroing rows [start_e + tokens_per_expert[e], end_e) of expert e,
    then tail programs zeroing rows [offsets[E-1], R), TAIL_ROWS rows each from ``tail_lo``."""
    pid = tl.program_id(0)
    hx = tl.arange(0, BLOCK_H)
    if pid < T:
        t = pid.to(tl.int64)
        kx = tl.arange(0, K_PAD)
        k_mask = kx < K
        rows = tl.load(row_index_ptr + t * K + kx, mask=k_mask, other=-1).to(tl.int64)
        r_mask = (rows >= 0) & (rows < R)
        if WEIGHTED:
            w = tl.load(row_w_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
        if DOT:
            acc = tl.zeros((K_PAD,), dtype=tl.float32)
        out_rows = out_ptr + rows[:, None] * stride_out_r
        for h0 in range(0, H, BLOCK_H):
            h = h0 + hx
            h_mask = h < H
            x = tl.load(x_ptr + t * stride_x_t + h, mask=h_mask, other=0.0)
            mask = r_mask[:, None] & h_mask[None, :]
            if WEIGHTED:
                y = (x.to(tl.float32)[None, :] * w[:, None]).to(out_ptr.dtype.element_ty)
            else:
                y = tl.broadcast_to(x[None, :], (K_PAD, BLOCK_H))
            tl.store(out_rows + h[None, :], y, mask=mask)
            if DOT:
                d = tl.load(
                    dot_ptr + rows[:, None] * stride_dot_r + h[None, :], mask=mask, other=0.0
                )
                acc += tl.sum(d.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        if COPY_VALS:
            v = tl.load(slot_vals_ptr + t * K + kx, mask=k_mask, other=0.0)
            tl.store(out_vals_ptr + rows, v, mask=r_mask)
        if DOT:
            tl.store(out_vals_ptr + rows, acc, mask=r_mask)
    elif pid < T + PAD_PROGRAMS:
        e = pid - T
        end = tl.load(offsets_ptr + e).to(tl.int64)
        start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
        used = tl.load(tokens_per_expert_ptr + e).to(tl.int64)
        _zero_rows(
            out_ptr,
            out_vals_ptr,
            start + used,
            end,
            H,
            stride_out_r,
            HAS_VALS,
            ZR,
            BLOCK_H,
        )
    else:
        lo = tail_lo + (pid - T - PAD_PROGRAMS).to(tl.int64) * TAIL_ROWS
        hi = tl.minimum(lo + TAIL_ROWS, R)
        tail_start = tl.load(offsets_ptr + E - 1).to(tl.int64)
        lo = tl.maximum(lo, tail_start)
        if lo < hi:
            _zero_rows(out_ptr, out_vals_ptr, lo, hi, H, stride_out_r, HAS_VALS, ZR, BLOCK_H)


@triton.jit
def _gather_rows_kernel(
    # pointers
    src_ptr,  # [R, H] rows to combine
    row_index_ptr,  # [T, K] int32 row of each slot, −1 = dropped
    row_w_ptr,  # [R] per-row weight (WEIGHTED)
    row_vals_ptr,  # [R] per-row values gathered to out_vals (GATHER_VALS)
    out_ptr,  # [T, H] out
    out_vals_ptr,  # [T, K] out (GATHER_VALS)
    # sizes
    H,
    R,
    # strides
    stride_src_r,
    stride_out_t,
    # meta
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    WEIGHTED: tl.constexpr,
    GATHER_VALS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[t] = Σ_s src[r_s] · (row_w[r_s] if WEIGHTED else 1), accumulated in fp32, over the slots
    with r_s = row_index[t, s] in [0, R);  out_vals[t, s] = row_vals[r_s] (0 when dropped)."""
    t = tl.program_id(0).to(tl.int64)
    kx = tl.arange(0, K_PAD)
    k_mask = kx < K
    rows = tl.load(row_index_ptr + t * K + kx, mask=k_mask, other=-1).to(tl.int64)
    r_mask = (rows >= 0) & (rows < R)
    if WEIGHTED:
        w = tl.load(row_w_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
    if GATHER_VALS:
        v = tl.load(row_vals_ptr + rows, mask=r_mask, other=0.0)
        tl.store(out_vals_ptr + t * K + kx, v, mask=k_mask)
    src_rows = src_ptr + rows[:, None] * stride_src_r
    hx = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + hx
        h_mask = h < H
        y = tl.load(src_rows + h[None, :], mask=r_mask[:, None] & h_mask[None, :], other=0.0)
        y = y.to(tl.float32)
        if WEIGHTED:
            y = y * w[:, None]
        acc = tl.sum(y, axis=0)
        tl.store(out_ptr + t * stride_out_t + h, acc.to(out_ptr.dtype.element_ty), mask=h_mask)


def _copy_config(k: int, H: int) -> tuple[int, int, int]:
    """(K_PAD, BLOCK_H, num_warps) for a [K_PAD, BLOCK_H] tile of about _TILE_ELEMS elements."""
    k_pad = triton.next_power_of_2(max(k, 1))
    block_h = min(triton.next_power_of_2(max(H, 1)), max(_TILE_ELEMS // k_pad, 64))
    # Split H evenly rather than leave a mostly-masked last chunk (H = 7168 → 1024, not 4096).
    while block_h > 256 and H % block_h and H % block_h < block_h // 2:
        block_h //= 2
    num_warps = 8 if k_pad * block_h >= 4096 else 4
    return k_pad, block_h, num_warps


def scatter_rows(
    x: torch.Tensor,  # [T, H]
    row_index: torch.Tensor,  # [T, k] int32
    num_rows: int,  # R
    offsets: torch.Tensor,  # [E] int32
    tokens_per_expert: torch.Tensor,  # [E] int32
    *,
    slot_vals: torch.Tensor | None = None,  # [T, k] → out_vals[R]
    row_weight: torch.Tensor | None = None,  # [R] scale of each written row
    dot_src: torch.Tensor | None = None,  # [R, H] → out_vals[R] = rowwise dot with x[t]
    out_vals_dtype: torch.dtype | None = None,
    zero_padding: bool = True,
    pad_programs: bool = True,
    tail_lo: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Write each token's row to its k destinations (reading it once); zero padding and tail rows.

    ``zero_padding`` False skips the zero-fill when every row is known to be written (no
    padding, nothing dropped, R = T·k). ``pad_programs`` False skips the per-expert padding
    programs (no alignment). ``tail_lo`` is a static lower bound of ``offsets[E-1]``.
    Returns ``out [R, H]`` (dtype of x) and ``out_vals [R]`` (or None).
    """
    T, H = x.shape
    k = row_index.shape[1]
    E = offsets.numel()
    R = num_rows
    out = torch.empty((R, H), dtype=x.dtype, device=x.device)
    has_vals = slot_vals is not None or dot_src is not None
    out_vals = (
        torch.empty(R, dtype=out_vals_dtype or torch.float32, device=x.device) if has_vals else None
    )
    k_pad, block_h, num_warps = _copy_config(k, H)
    zr = max(_TILE_ELEMS // block_h, 1)
    pad_n = E if (zero_padding and pad_programs) else 0
    tail_n = triton.cdiv(max(R - tail_lo, 0), _TAIL_ROWS) if zero_padding else 0
    grid = (T + pad_n + tail_n,)
    if grid[0] == 0:
        return out, out_vals
    dummy = out  # never dereferenced when its flag is off
    _scatter_rows_kernel[grid](
        x,
        row_index,
        slot_vals if slot_vals is not None else dummy,
        row_weight if row_weight is not None else dummy,
        dot_src if dot_src is not None else dummy,
        out,
        out_vals if out_vals is not None else dummy,
        offsets,
        tokens_per_expert,
        T,
        H,
        R,
        E,
        tail_lo,
        x.stride(0),
        dot_src.stride(0) if dot_src is not None else 0,
        out.stride(0),
        K=k,
        K_PAD=k_pad,
        COPY_VALS=slot_vals is not None,
        WEIGHTED=row_weight is not None,
        DOT=dot_src is not None,
        HAS_VALS=has_vals,
        PAD_PROGRAMS=pad_n,
        TAIL_ROWS=_TAIL_ROWS,
        ZR=zr,
        BLOCK_H=block_h,
        num_warps=num_warps,
    )
    return out, out_vals


def gather_rows(
    src: torch.Tensor,  # [R, H]
    row_index: torch.Tensor,  # [T, k] int32
    *,
    row_weight: torch.Tensor | None = None,  # [R]
    row_vals: torch.Tensor | None = None,  # [R] → out_vals [T, k]
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sum each token's k rows in fp32 (weighted by ``row_weight`` when given).

    Returns ``out [T, H]`` (``out_dtype`` or src's dtype) and ``out_vals [T, k]`` (or None),
    ``out_vals[t, s] = row_vals[row_index[t, s]]``, 0 for dropped slots.
    """
    R, H = src.shape
    T, k = row_index.shape
    out = torch.empty((T, H), dtype=out_dtype or src.dtype, device=src.device)
    out_vals = (
        torch.empty((T, k), dtype=row_vals.dtype, device=src.device)
        if row_vals is not None
        else None
    )
    if T == 0:
        return out, out_vals
    k_pad, block_h, num_warps = _copy_config(k, H)
    dummy = out
    _gather_rows_kernel[(T,)](
        src,
        row_index,
        row_weight if row_weight is not None else dummy,
        row_vals if row_vals is not None else dummy,
        out,
        out_vals if out_vals is not None else dummy,
        H,
        R,
        src.stride(0),
        out.stride(0),
        K=k,
        K_PAD=k_pad,
        WEIGHTED=row_weight is not None,
        GATHER_VALS=row_vals is not None,
        BLOCK_H=block_h,
        num_warps=num_warps,
    )
    return out, out_vals
