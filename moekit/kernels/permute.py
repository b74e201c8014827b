"""Token permute / unpermute kernels: routing metadata, row scatter, row gather.

Dimension letters: T tokens, k experts per token, E experts, R permuted rows, H hidden.

Routing metadata is a stable counting sort of the N = T·k (token, slot) pairs by expert, done in
three launches and no host sync. Blocks of ``BLOCK_N`` pairs (256 to 1024, so that there are about
512 blocks), B blocks:

1. ``_routing_hist_kernel``   per block, the histogram over experts → ``block_counts[B, E]``.
2. ``_routing_scan_kernel``   per group of 8 experts, the exclusive prefix over blocks
                              → ``block_offsets[B, E]`` and ``tokens_per_expert[E]``.
3. ``_routing_rows_kernel``   per block, a bitonic ``tl.sort`` of the keys ``(e << log2 BLOCK_N)
                              | n`` (stable: the key carries the position), then the pair at sorted
                              position j goes to ``start[e] + block_offsets[b, e] + j − first[e]``
                              (``first`` = exclusive prefix of the block's histogram, ``start`` =
                              padded exclusive prefix over experts, recomputed by every program:
                              ``E`` is small); program 0 also writes ``counts`` and ``offsets``.

The rank needs O(log² BLOCK_N) compare-exchanges per pair (about 330 instructions a pair on sm_90),
not the O(SUB) of a pairwise ``[SUB, SUB]`` comparison. Pair indices are int32 (N < 2^31: the row
map is int32); ``[B, E]`` offsets are int64.
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

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from moekit.kernels._replay import launch as _launch

# Experts per program of the scan, and blocks per step of its loop (one step up to 512 blocks).
_SCAN_BLOCK_E = 8
_SCAN_BLOCK_B = 512
# Rows per zero-fill program of the tail, and rows per inner step.
_TAIL_ROWS = 64  # rows per tail zero-fill program
_PAD_CHUNK = 16  # rows per padding zero-fill program (with a known bound, align − 1)
# Elements per [k, BLOCK_H] tile of the copy kernels.
_TILE_ELEMS = 8192


# ------------------------------------------------------------------------------------------------
# Routing metadata
# ------------------------------------------------------------------------------------------------


@triton.jit
def _routing_hist_kernel(
    # pointers
    idx_ptr,  # [N] expert of each (token, slot) pair, N = T·k; outside [0, E) = dropped
    block_counts_ptr,  # [B, E] int32 out
    # sizes
    N,
    E,
    # meta
    BLOCK_N: tl.constexpr,
    E_PAD: tl.constexpr,
):
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
    # pointers
    block_counts_ptr,  # [B, E] int32
    block_offsets_ptr,  # [B, E] int32 out: exclusive prefix over b
    tokens_per_expert_ptr,  # [E] int32 out: total over b
    # sizes
    E,
    num_blocks,
    # meta
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """block_offsets[b, e] = Σ_{b' < b} block_counts[b', e];  tokens_per_expert[e] = Σ_b …"""
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
    tl.store(tokens_per_expert_ptr + ex, running, mask=e_mask)


@triton.jit
def _routing_rows_kernel(
    # pointers
    idx_ptr,  # [N] expert of each pair
    block_counts_ptr,  # [B, E] int32
    block_offsets_ptr,  # [B, E] int32
    tokens_per_expert_ptr,  # [E] int32
    row_index_ptr,  # [N] int32 out: destination row, −1 when dropped
    counts_ptr,  # [E] int32 out: rows per expert, padded to ALIGN
    offsets_ptr,  # [E] int32 out: cumulative end offsets of the padded segments
    # sizes
    N,
    E,
    # meta
    ALIGN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    POS_BITS: tl.constexpr,  # log2(BLOCK_N)
    E_PAD: tl.constexpr,
):
    """Sort the block's keys ``(e << POS_BITS) | n`` (dropped pairs get e = E, so they sort
    last); the pair at sorted position j goes to
        row = start[e] + block_offsets[b, e] + (j − first[e]),
    with first[e] = Σ_{e' < e} block_counts[b, e'] (where e's run starts in the sorted block)
    and start[e] = Σ_{e' < e} ceil(tokens_per_expert[e'] / ALIGN)·ALIGN.
    The sort key carries n, so ties keep token order: the sort is stable."""
    b = tl.program_id(0)
    ex = tl.arange(0, E_PAD)
    e_mask = ex < E
    tpe = tl.load(tokens_per_expert_ptr + ex, mask=e_mask, other=0)
    padded = (tpe + (ALIGN - 1)) // ALIGN * ALIGN
    ends = tl.cumsum(padded, axis=0)
    if b == 0:
        tl.store(counts_ptr + ex, padded, mask=e_mask)
        tl.store(offsets_ptr + ex, ends, mask=e_mask)
    row0 = b.to(tl.int64) * E
    cnt = tl.load(block_counts_ptr + row0 + ex, mask=e_mask, other=0)
    pre = tl.load(block_offsets_ptr + row0 + ex, mask=e_mask, other=0)
    # row of sorted position j = base[e] + j
    base = (ends - padded) + pre - (tl.cumsum(cnt, axis=0) - cnt)

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
    tl.store(row_index_ptr + n_sorted, tl.where(e_sorted < E, row, -1), mask=n_sorted < N)


def _meta_block(n: int) -> int:
    """Pairs per metadata block: enough blocks to fill the GPU (~512), 256 to 1024 pairs each."""
    return min(max(triton.next_power_of_2(triton.cdiv(max(n, 1), 512)), 256), 1024)


@dataclass(frozen=True)
class MetaConfig:
    """Launch configuration of the three metadata kernels (``_meta_config`` picks it;
    ``meta_config_candidates`` lists the ones benchmarks/sweep_permute_kernels.py times)."""

    block_n: int  # pairs per block (a power of two), B = ceil(N / block_n) blocks
    hist_warps: int = 4
    rows_warps: int = 4
    scan_block_e: int = _SCAN_BLOCK_E  # experts per scan program
    scan_block_b: int | None = None  # blocks per scan step (None: up to _SCAN_BLOCK_B)


def _meta_config(n: int) -> MetaConfig:
    """Metadata launch configuration for N = T·k pairs.

    256-pair blocks on one warp (no barriers in the sort, ~4× the blocks for the scan) took the
    metadata at T=65536, E=256, k=8 from 34.9 to 19.6 µs on an H100 (the sweep's
    "bn256-w1-scan-e4-b2048"); small N keeps the older ~512-block default.
    """
    if n >= 1 << 16:
        return MetaConfig(
            block_n=256, hist_warps=1, rows_warps=1, scan_block_e=4, scan_block_b=2048
        )
    return MetaConfig(block_n=_meta_block(n))


# name → fields that differ from the ~512-block base (block_n 1024 at N = 2^19); "default" (what
# _meta_config picks) is listed first by meta_config_candidates.
_META_CANDIDATES = {
    "bn-auto": {},
    "rows-w2": {"rows_warps": 2},
    "rows-w8": {"rows_warps": 8},
    "scan-e4": {"scan_block_e": 4},
    "bn512": {"block_n": 512},
    "bn512-rows-w2-scan-e4": {"block_n": 512, "rows_warps": 2, "scan_block_e": 4},
    "bn512-w1-scan-e4": {"block_n": 512, "rows_warps": 1, "hist_warps": 1, "scan_block_e": 4,
                         "scan_block_b": 1024},
    "bn256": {"block_n": 256},
    "bn256-rows-w2-scan-e4": {"block_n": 256, "rows_warps": 2, "scan_block_e": 4},
    "bn256-w1-scan-e4-b2048": {"block_n": 256, "rows_warps": 1, "hist_warps": 1,
                               "scan_block_e": 4, "scan_block_b": 2048},
    "bn256-w1-scan-e2-b2048": {"block_n": 256, "rows_warps": 1, "hist_warps": 1,
                               "scan_block_e": 2, "scan_block_b": 2048},
    "bn128-w1-scan-e4-b4096": {"block_n": 128, "rows_warps": 1, "hist_warps": 1,
                               "scan_block_e": 4, "scan_block_b": 4096},
    "bn2048-rows-w8": {"block_n": 2048, "rows_warps": 8, "hist_warps": 8},
}  # fmt: skip


def meta_config_candidates(n: int) -> dict[str, MetaConfig]:
    """Named metadata configurations for N = T·k pairs, the default first; each is valid for any N
    (the tests run every one)."""
    base = MetaConfig(block_n=_meta_block(n))
    out = {"default": _meta_config(n)}
    for name, fields in _META_CANDIDATES.items():
        cfg = replace(base, **fields)
        if cfg not in out.values():
            out[name] = cfg
    return out


def routing_metadata_launches(
    indices: torch.Tensor,  # [T, k] int32/int64, contiguous
    num_experts: int,
    align: int,  # 1 = no padding
    *,
    config: MetaConfig | None = None,  # None: _meta_config(T·k)
    out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], list]:
    """``routing_metadata`` split into its launches, for benchmarks that time each one.

    Allocates the outputs (or takes ``out = (row_index [T, k], tokens_per_expert [E],
    counts [E], offsets [E], scratch [metadata_scratch_numel(T·k, E)])``, all int32) and returns
    them with ``[(name, launch)]``; calling every ``launch`` in order fills the outputs (each
    may be re-run: it only reads what the earlier ones wrote).
    """
    device = indices.device
    n = indices.numel()
    E = num_experts
    cfg = config or _meta_config(n)
    block_n = cfg.block_n
    pos_bits = block_n.bit_length() - 1
    if n >= 2**31:
        raise ValueError(f"routing_metadata needs T·k < 2^31 (int32 rows), got {n}")
    max_experts = (1 << (32 - pos_bits)) - 2  # the sort key packs (e ≤ E, position) in 32 bits
    if num_experts > max_experts:
        raise ValueError(f"routing_metadata supports up to {max_experts} experts, got {E}")
    num_blocks = max(triton.cdiv(n, block_n), 1)
    # tl.histogram wants a power-of-two bin count of at least a warp.
    e_pad = max(triton.next_power_of_2(E), 32)
    if out is None:
        out = (
            torch.empty(indices.shape, dtype=torch.int32, device=device),
            *(torch.empty(E, dtype=torch.int32, device=device) for _ in range(3)),
            torch.empty(2 * num_blocks * E, dtype=torch.int32, device=device),
        )
    row_index, tokens_per_expert, counts, offsets, scratch = out
    # [B, E] block counts and their exclusive prefix, in one scratch buffer
    block_counts = scratch[: num_blocks * E].view(num_blocks, E)
    block_offsets = scratch[num_blocks * E : 2 * num_blocks * E].view(num_blocks, E)
    flat = indices.reshape(-1)
    scan_block_b = min(triton.next_power_of_2(num_blocks), cfg.scan_block_b or _SCAN_BLOCK_B)
    scan_block_e = cfg.scan_block_e

    def hist():
        _launch(
            _routing_hist_kernel, (num_blocks,),
            flat, block_counts, n, E, BLOCK_N=block_n, E_PAD=e_pad, num_warps=cfg.hist_warps,
        )  # fmt: skip

    def scan():
        _launch(
            _routing_scan_kernel,
            (triton.cdiv(E, scan_block_e),),
            block_counts,
            block_offsets,
            tokens_per_expert,
            E,
            num_blocks,
            BLOCK_E=scan_block_e,
            BLOCK_B=scan_block_b,
            num_warps=8 if scan_block_b * scan_block_e >= 2048 else 4,
        )

    def rows():
        _launch(
            _routing_rows_kernel,
            (num_blocks,),
            flat,
            block_counts,
            block_offsets,
            tokens_per_expert,
            row_index,
            counts,
            offsets,
            n,
            E,
            ALIGN=align,
            BLOCK_N=block_n,
            POS_BITS=pos_bits,
            E_PAD=e_pad,
            num_warps=cfg.rows_warps,
        )

    outputs = (row_index, tokens_per_expert, counts, offsets)
    return outputs, [("hist", hist), ("scan", scan), ("rows", rows)]


def metadata_scratch_numel(n: int, num_experts: int, config: MetaConfig | None = None) -> int:
    """int32 elements of the metadata's scratch (``out[4]``) for N = T·k pairs."""
    cfg = config or _meta_config(n)
    return 2 * max(triton.cdiv(n, cfg.block_n), 1) * num_experts


def routing_metadata(
    indices: torch.Tensor,  # [T, k] int32/int64, contiguous
    num_experts: int,
    align: int,  # 1 = no padding
    *,
    config: MetaConfig | None = None,  # None: _meta_config(T·k)
    out: tuple[torch.Tensor, ...] | None = None,  # see routing_metadata_launches
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable counting sort of the (token, slot) pairs by expert, on device, in three launches.

    Returns ``row_index [T, k]``, ``tokens_per_expert [E]``, ``counts [E]`` (padded) and
    ``offsets [E]`` (cumulative end offsets of the padded segments), all int32.
    """
    outputs, launches = routing_metadata_launches(
        indices, num_experts, align, config=config, out=out
    )
    for _, run in launches:
        run()
    return outputs


# ------------------------------------------------------------------------------------------------
# Row copies
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CopyConfig:
    """Tile configuration of a copy kernel (``_scatter_rows_kernel`` / ``_gather_rows_kernel``).

    ``_copy_config`` picks one per launch; ``copy_config_candidates`` lists the ones the sweep
    (benchmarks/sweep_permute_kernels.py) times.
    """

    block_h: int  # H elements per step (a power of two)
    num_warps: int
    # False: each step is a [K_PAD, BLOCK_H] tile of the token's k rows (reduced over k by
    # tl.sum in the gather, a broadcast store in the scatter). True: a static loop over the k
    # slots, one [BLOCK_H] row each (the gather accumulates into a 1-D fp32 vector: no
    # cross-thread reduction; the scatter loads x once per step and stores it k times).
    loop_k: bool = False
    tokens_per_program: int = 1  # tokens one program handles, one after the other
    split_h: bool = False  # gather only: one program per (tokens, BLOCK_H chunk), grid [·, H/BH]
    # Streams touched once (rows read by the gather, rows written by both, the dot rows and, with
    # loop_k, x in the scatter) are marked evict_first, so they do not push reused lines out of L2.
    evict_first: bool = False


def _fit_block_h(block_h: int, H: int) -> int:
    """``block_h`` capped at H's next power of two; halved (down to 256) while that leaves a
    mostly-masked last chunk (H = 7168 → 1024, not 4096)."""
    block_h = min(block_h, triton.next_power_of_2(max(H, 1)))
    while block_h > 256 and H % block_h and H % block_h < block_h // 2:
        block_h //= 2
    return block_h


def _tile_config(k: int, H: int) -> CopyConfig:
    """A [K_PAD, BLOCK_H] tile of about _TILE_ELEMS elements, 8 warps from 4096 elements up."""
    k_pad = triton.next_power_of_2(max(k, 1))
    block_h = _fit_block_h(max(_TILE_ELEMS // k_pad, 64), H)
    return CopyConfig(block_h=block_h, num_warps=8 if k_pad * block_h >= 4096 else 4)


def _copy_config(kind: str, k: int, H: int, dot: bool = False) -> CopyConfig:
    """The configuration of a ``kind`` ("scatter" or "gather") launch; ``dot``: the scatter of
    unpermute's backward (weighted rows and the prob-gradient dot).

    From the sweep on an H100 (benchmarks/sweep_permute_kernels.py, T ∈ {4096, 65536},
    H ∈ {2048, 4096, 7168}): at k = 8 the gather's [8, BLOCK_H] tile reduces across warps
    through shared memory and reached 66-77% of copy bandwidth, while a loop over the k rows
    into a 1-D fp32 accumulator (loop_k, 2048-wide, 4 warps) reached the copy rate (1.6-1.8×);
    the weighted scatter gains 5-25% from 4 warps at k = 8; the plain scatter at k = 2 and
    H ≤ 4096 gains up to 16% from loop_k with evict-first stores. Elsewhere the tile is best.
    """
    tile = _tile_config(k, H)
    if kind == "gather":
        if k >= 4:
            return CopyConfig(block_h=_fit_block_h(2048, H), num_warps=4, loop_k=True)
        return tile
    if dot:
        return replace(tile, num_warps=4) if k >= 4 else tile
    if k <= 2 and H <= 4096:
        return CopyConfig(block_h=_fit_block_h(2048, H), num_warps=8, loop_k=True, evict_first=True)
    return tile


# Candidates per kernel: name, loop_k, block_h (None: the default's; "half": half of it), num_warps
# (None: the default's), tokens_per_program, split_h, evict_first. block_h is fitted to H.
_CANDIDATES = {
    "gather": [
        ("tile",                 False, None,   None, 1, False, False),
        ("tile+evict",           False, None,   None, 1, False, True),
        ("tile/2-w4",            False, "half", 4,    1, False, False),
        ("loopk-512w2",          True,  512,    2,    1, False, False),
        ("loopk-1024w4",         True,  1024,   4,    1, False, False),
        ("loopk-1024w4+evict",   True,  1024,   4,    1, False, True),
        ("loopk-1024w4-tpp2",    True,  1024,   4,    2, False, False),
        ("loopk-1024w4-splith",  True,  1024,   4,    1, True,  False),
        ("loopk-2048w4",         True,  2048,   4,    1, False, False),
        ("loopk-2048w8+evict",   True,  2048,   8,    1, False, True),
    ],
    "scatter": [
        ("tile",                 False, None,   None, 1, False, False),
        ("tile+evict",           False, None,   None, 1, False, True),
        ("tile-w4",              False, None,   4,    1, False, False),
        ("tile-tpp2",            False, None,   None, 2, False, False),
        ("loopk-512w2",          True,  512,    2,    1, False, False),
        ("loopk-1024w4",         True,  1024,   4,    1, False, False),
        ("loopk-1024w4+evict",   True,  1024,   4,    1, False, True),
        ("loopk-1024w4-tpp2",    True,  1024,   4,    2, False, False),
        ("loopk-2048w4",         True,  2048,   4,    1, False, False),
        ("loopk-2048w8+evict",   True,  2048,   8,    1, False, True),
    ],
}  # fmt: skip


def copy_config_candidates(kind: str, k: int, H: int, dot: bool = False) -> dict[str, CopyConfig]:
    """Named configurations of a ``kind`` ("scatter" / "gather") launch for k slots and width H,
    the current default (``_copy_config``) first. Each is valid for any k and H (the tests run
    every one); benchmarks/sweep_permute_kernels.py times them."""
    tile = _tile_config(k, H)
    out = {"default": _copy_config(kind, k, H, dot=kind == "scatter" and dot)}
    for name, loop_k, bh, warps, tpp, split_h, evict in _CANDIDATES[kind]:
        if bh is None:
            bh = tile.block_h
        elif bh == "half":
            bh = max(tile.block_h // 2, 64)
        cfg = CopyConfig(
            block_h=_fit_block_h(bh, H),
            num_warps=warps or tile.num_warps,
            loop_k=loop_k,
            tokens_per_program=tpp,
            split_h=split_h,
            evict_first=evict,
        )
        if cfg not in out.values():  # the default is one of them, or two fit H alike
            out[name] = cfg
    return out


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
def _scatter_token(
    t,  # int64 token
    x_ptr,
    row_index_ptr,
    slot_vals_ptr,
    row_w_ptr,
    dot_ptr,
    out_ptr,
    out_vals_ptr,
    H,
    R,
    stride_x_t,
    stride_dot_r,
    stride_out_r,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    COPY_VALS: tl.constexpr,
    WEIGHTED: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    LOOP_K: tl.constexpr,
    EVICT: tl.constexpr,  # eviction policy of the one-use streams: "evict_first" or ""
):
    """One token of ``_scatter_rows_kernel``: x[t] to its k rows (see there)."""
    hx = tl.arange(0, BLOCK_H)
    kx = tl.arange(0, K_PAD)
    k_mask = kx < K
    rows = tl.load(row_index_ptr + t * K + kx, mask=k_mask, other=-1).to(tl.int64)
    r_mask = (rows >= 0) & (rows < R)
    if DOT:
        acc = tl.zeros((K_PAD,), dtype=tl.float32)
    if LOOP_K:
        for h0 in range(0, H, BLOCK_H):
            h = h0 + hx
            h_mask = h < H
            x = tl.load(x_ptr + t * stride_x_t + h, mask=h_mask, other=0.0, eviction_policy=EVICT)
            for s in tl.static_range(K):
                r = tl.load(row_index_ptr + t * K + s).to(tl.int64)
                ok = (r >= 0) & (r < R)
                mask = h_mask & ok
                if WEIGHTED:
                    w = tl.load(row_w_ptr + r, mask=ok, other=0.0).to(tl.float32)
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
            w = tl.load(row_w_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
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
                d = tl.load(
                    dot_ptr + rows[:, None] * stride_dot_r + h[None, :],
                    mask=mask,
                    other=0.0,
                    eviction_policy=EVICT,
                )
                acc += tl.sum(d.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if COPY_VALS:
        v = tl.load(slot_vals_ptr + t * K + kx, mask=k_mask, other=0.0)
        tl.store(out_vals_ptr + rows, v, mask=r_mask)
    if DOT:
        tl.store(out_vals_ptr + rows, acc, mask=r_mask)


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
    PAD_PROGRAMS: tl.constexpr,  # E·PAD_SPLIT programs zeroing expert padding rows, or 0
    PAD_SPLIT: tl.constexpr,  # programs per expert's padding (PAD_CHUNK rows each), or 1: all
    PAD_CHUNK: tl.constexpr,
    TAIL_PROGRAMS,  # programs zeroing rows [offsets[E-1], R), TAIL_ROWS each from tail_lo
    TAIL_ROWS: tl.constexpr,
    ZR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    LOOP_K: tl.constexpr,  # CopyConfig.loop_k
    TPP: tl.constexpr,  # tokens per program
    EVICT: tl.constexpr,  # "evict_first" or ""
):
    """Token programs (TPP tokens each):  for each slot s with r = row_index[t, s] in [0, R):
        out[r] = x[t] · (row_w[r] if WEIGHTED else 1)
        out_vals[r] = slot_vals[t, s]                       (COPY_VALS)
        out_vals[r] = Σ_h x[t, h] · dot[r, h]  (fp32)        (DOT)
    Before them: PAD_PROGRAMS programs zeroing rows [start_e + tokens_per_expert[e], end_e) of
    expert e (PAD_SPLIT per expert, PAD_CHUNK rows each), then TAIL_PROGRAMS zeroing rows
    [offsets[E-1], R), TAIL_ROWS rows each from ``tail_lo``."""
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
        _zero_rows(out_ptr, out_vals_ptr, lo, hi, H, stride_out_r, HAS_VALS, ZR, BLOCK_H)
    elif pid < PAD_PROGRAMS + TAIL_PROGRAMS:
        lo = tail_lo + (pid - PAD_PROGRAMS).to(tl.int64) * TAIL_ROWS
        hi = tl.minimum(lo + TAIL_ROWS, R)
        tail_start = tl.load(offsets_ptr + E - 1).to(tl.int64)
        lo = tl.maximum(lo, tail_start)
        if lo < hi:
            _zero_rows(out_ptr, out_vals_ptr, lo, hi, H, stride_out_r, HAS_VALS, ZR, BLOCK_H)
    else:
        for i in tl.static_range(TPP):
            t = (pid - PAD_PROGRAMS - TAIL_PROGRAMS).to(tl.int64) * TPP + i
            if t < T:
                _scatter_token(
                    t,
                    x_ptr,
                    row_index_ptr,
                    slot_vals_ptr,
                    row_w_ptr,
                    dot_ptr,
                    out_ptr,
                    out_vals_ptr,
                    H,
                    R,
                    stride_x_t,
                    stride_dot_r,
                    stride_out_r,
                    K,
                    K_PAD,
                    COPY_VALS,
                    WEIGHTED,
                    DOT,
                    BLOCK_H,
                    LOOP_K,
                    EVICT,
                )


@triton.jit
def _gather_token(
    t,  # int64 token
    h_lo,  # H range of this program: [h_lo, h_hi)
    h_hi,
    src_ptr,
    row_index_ptr,
    row_w_ptr,
    out_ptr,
    R,
    stride_src_r,
    stride_out_t,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    LOOP_K: tl.constexpr,
    EVICT: tl.constexpr,
):
    """One token (and H range) of ``_gather_rows_kernel`` (see there), without out_vals."""
    hx = tl.arange(0, BLOCK_H)
    kx = tl.arange(0, K_PAD)
    k_mask = kx < K
    rows = tl.load(row_index_ptr + t * K + kx, mask=k_mask, other=-1).to(tl.int64)
    r_mask = (rows >= 0) & (rows < R)
    if LOOP_K:
        for h0 in range(h_lo, h_hi, BLOCK_H):
            h = h0 + hx
            h_mask = h < h_hi
            acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
            for s in tl.static_range(K):
                r = tl.load(row_index_ptr + t * K + s).to(tl.int64)
                ok = (r >= 0) & (r < R)
                y = tl.load(
                    src_ptr + r * stride_src_r + h,
                    mask=h_mask & ok,
                    other=0.0,
                    eviction_policy=EVICT,
                ).to(tl.float32)
                if WEIGHTED:
                    y = y * tl.load(row_w_ptr + r, mask=ok, other=0.0).to(tl.float32)
                acc += y
            tl.store(
                out_ptr + t * stride_out_t + h,
                acc.to(out_ptr.dtype.element_ty),
                mask=h_mask,
                eviction_policy=EVICT,
            )
    else:
        if WEIGHTED:
            w = tl.load(row_w_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
        src_rows = src_ptr + rows[:, None] * stride_src_r
        for h0 in range(h_lo, h_hi, BLOCK_H):
            h = h0 + hx
            h_mask = h < h_hi
            y = tl.load(
                src_rows + h[None, :],
                mask=r_mask[:, None] & h_mask[None, :],
                other=0.0,
                eviction_policy=EVICT,
            )
            y = y.to(tl.float32)
            if WEIGHTED:
                y = y * w[:, None]
            acc = tl.sum(y, axis=0)
            tl.store(
                out_ptr + t * stride_out_t + h,
                acc.to(out_ptr.dtype.element_ty),
                mask=h_mask,
                eviction_policy=EVICT,
            )


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
    T,
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
    LOOP_K: tl.constexpr,  # CopyConfig.loop_k
    TPP: tl.constexpr,  # tokens per program
    SPLIT_H: tl.constexpr,  # axis 1 of the grid walks the BLOCK_H chunks of H
    EVICT: tl.constexpr,  # "evict_first" or ""
):
    """out[t] = Σ_s src[r_s] · (row_w[r_s] if WEIGHTED else 1), accumulated in fp32, over the slots
    with r_s = row_index[t, s] in [0, R);  out_vals[t, s] = row_vals[r_s] (0 when dropped)."""
    pid = tl.program_id(0)
    if SPLIT_H:
        h_lo = tl.program_id(1) * BLOCK_H
        h_hi = tl.minimum(h_lo + BLOCK_H, H)
    else:
        h_lo = 0
        h_hi = H
    kx = tl.arange(0, K_PAD)
    k_mask = kx < K
    for i in tl.static_range(TPP):
        t = pid.to(tl.int64) * TPP + i
        if t < T:
            if GATHER_VALS:  # noqa: SIM102 (a static branch around a runtime one)
                if tl.program_id(1) == 0:  # once per token, also when H is split
                    rows = tl.load(row_index_ptr + t * K + kx, mask=k_mask, other=-1)
                    r_mask = (rows >= 0) & (rows < R)
                    v = tl.load(row_vals_ptr + rows.to(tl.int64), mask=r_mask, other=0.0)
                    tl.store(out_vals_ptr + t * K + kx, v, mask=k_mask)
            _gather_token(
                t,
                h_lo,
                h_hi,
                src_ptr,
                row_index_ptr,
                row_w_ptr,
                out_ptr,
                R,
                stride_src_r,
                stride_out_t,
                K,
                K_PAD,
                WEIGHTED,
                BLOCK_H,
                LOOP_K,
                EVICT,
            )


def _evict(config: CopyConfig) -> str:
    return "evict_first" if config.evict_first else ""


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
    pad_rows: int | None = None,
    tail_lo: int = 0,
    config: CopyConfig | None = None,  # None: _copy_config("scatter", k, H)
    out: torch.Tensor | None = None,  # [R, H] preallocated (unit stride along H)
    out_vals: torch.Tensor | None = None,  # [R] preallocated (with slot_vals or dot_src)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Write each token's row to its k destinations (reading it once); zero padding and tail rows.

    ``zero_padding`` False skips the zero-fill when every row is known to be written (no
    padding, nothing dropped, R = T·k). ``pad_programs`` False skips the per-expert padding
    programs (no alignment); ``pad_rows`` (align − 1) bounds each expert's padding so that it is
    zeroed by several short programs (None: one program per expert, any length). ``tail_lo`` is
    a static lower bound of ``offsets[E-1]``.
    Returns ``out [R, H]`` (dtype of x) and ``out_vals [R]`` (or None).
    """
    T, H = x.shape
    k = row_index.shape[1]
    E = offsets.numel()
    R = num_rows
    if out is None:
        out = torch.empty((R, H), dtype=x.dtype, device=x.device)
    has_vals = slot_vals is not None or dot_src is not None
    if has_vals and out_vals is None:
        out_vals = torch.empty(R, dtype=out_vals_dtype or torch.float32, device=x.device)
    elif not has_vals:
        out_vals = None
    cfg = config or _copy_config("scatter", k, H, dot=dot_src is not None)
    zr = max(_TILE_ELEMS // cfg.block_h, 1)
    pad_split = triton.cdiv(pad_rows, _PAD_CHUNK) if pad_rows else 1
    pad_n = E * pad_split if (zero_padding and pad_programs) else 0
    tail_n = triton.cdiv(max(R - tail_lo, 0), _TAIL_ROWS) if zero_padding else 0
    grid = (triton.cdiv(T, cfg.tokens_per_program) + pad_n + tail_n,)
    if grid[0] == 0:
        return out, out_vals
    dummy = out  # never dereferenced when its flag is off
    _launch(
        _scatter_rows_kernel,
        grid,
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
        K_PAD=triton.next_power_of_2(max(k, 1)),
        COPY_VALS=slot_vals is not None,
        WEIGHTED=row_weight is not None,
        DOT=dot_src is not None,
        HAS_VALS=has_vals,
        PAD_PROGRAMS=pad_n,
        PAD_SPLIT=pad_split,
        PAD_CHUNK=_PAD_CHUNK,
        TAIL_PROGRAMS=tail_n,
        TAIL_ROWS=_TAIL_ROWS,
        ZR=zr,
        BLOCK_H=cfg.block_h,
        LOOP_K=cfg.loop_k,
        TPP=cfg.tokens_per_program,
        EVICT=_evict(cfg),
        num_warps=cfg.num_warps,
    )
    return out, out_vals


def gather_rows(
    src: torch.Tensor,  # [R, H]
    row_index: torch.Tensor,  # [T, k] int32
    *,
    row_weight: torch.Tensor | None = None,  # [R]
    row_vals: torch.Tensor | None = None,  # [R] → out_vals [T, k]
    out_dtype: torch.dtype | None = None,
    config: CopyConfig | None = None,  # None: _copy_config("gather", k, H)
    out: torch.Tensor | None = None,  # [T, H] preallocated (unit stride along H)
    out_vals: torch.Tensor | None = None,  # [T, k] preallocated (with row_vals)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sum each token's k rows in fp32 (weighted by ``row_weight`` when given).

    Returns ``out [T, H]`` (``out_dtype`` or src's dtype) and ``out_vals [T, k]`` (or None),
    ``out_vals[t, s] = row_vals[row_index[t, s]]``, 0 for dropped slots.
    """
    R, H = src.shape
    T, k = row_index.shape
    if out is None:
        out = torch.empty((T, H), dtype=out_dtype or src.dtype, device=src.device)
    if row_vals is not None and out_vals is None:
        out_vals = torch.empty((T, k), dtype=row_vals.dtype, device=src.device)
    elif row_vals is None:
        out_vals = None
    if T == 0:
        return out, out_vals
    cfg = config or _copy_config("gather", k, H)
    grid = (
        triton.cdiv(T, cfg.tokens_per_program),
        triton.cdiv(max(H, 1), cfg.block_h) if cfg.split_h else 1,
    )
    dummy = out
    _launch(
        _gather_rows_kernel,
        grid,
        src,
        row_index,
        row_weight if row_weight is not None else dummy,
        row_vals if row_vals is not None else dummy,
        out,
        out_vals if out_vals is not None else dummy,
        T,
        H,
        R,
        src.stride(0),
        out.stride(0),
        K=k,
        K_PAD=triton.next_power_of_2(max(k, 1)),
        WEIGHTED=row_weight is not None,
        GATHER_VALS=row_vals is not None,
        BLOCK_H=cfg.block_h,
        LOOP_K=cfg.loop_k,
        TPP=cfg.tokens_per_program,
        SPLIT_H=cfg.split_h,
        EVICT=_evict(cfg),
        num_warps=cfg.num_warps,
    )
    return out, out_vals
