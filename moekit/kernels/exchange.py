"""Expert-parallel token exchange over symmetric memory: Triton kernels that read peers' buffers.

W ranks of one NVLink domain each own one buffer of a symmetric pool
(:class:`moekit.distributed.SymmetricPool`); every kernel gets ``peer_bases[W]`` (int64 device
addresses of every rank's buffer, as mapped here) and reads peers' memory directly. No
multicast instruction is used. Every size stays on the device, so nothing is read back to the
host and the exchange can be captured in a CUDA graph.

The exchange moves **tokens, not slots**: a token with several experts on one rank crosses
NVLink once. Notation: rank s sends ``cnt[s, d]`` tokens to rank d (the tokens with at least one
of their k experts on d), ``cnt`` being the ``[W, W]`` count table every rank holds after
:func:`exchange_barrier` (``with_counts``).

Buffer layout (bytes, identical on every rank; :class:`ExchangeLayout`)::

    [0, 64)           flags: int32[MAX_WORLD]: peer p writes its barrier epoch to flags[p]
    [64, 320)         table: int32[MAX_WORLD][MAX_WORLD]: peer s writes its counts to row s
    [DATA, ...)       x      [T_max, H]      tokens staged by their own rank (or dy in backward)
                      x_meta [T_max, 2k]     int32: each token's k global expert ids, k prob bits
                      lists  [W · T_max]     int32: token ids sent to each rank, by destination
                      y      [W · T_max, H]  rows an owner returns (or dx in backward)
                      y_meta [W · T_max, k]  fp32: prob gradients an owner returns

Two data kernels, each the adjoint of the other:

* :func:`pull_tokens` (dispatch): owner r builds ``recv[i]`` for ``i < N_r = Σ_s cnt[s, r]``,
  sources in rank order, each source's tokens in ascending order, by reading token
  ``lists_s[start_s(r) + j]`` from ``x`` of rank s. With meta it also reads the token's ids
  (made local: ``id − r·E_local`` for the owner's experts, −1 otherwise) and probs (0 where not
  local); rows ``[N_r, bound)`` get ids −1 and probs 0 (they route nowhere).
* :func:`pull_sum` (combine): rank s computes ``out[t] = Σ_d y_d[pos_d(t)]`` in fp32, ranks in
  order (deterministic), over the owners d that token t went to; ``pos_d(t)`` is where owner d
  holds it. Tokens sent nowhere get zeros.

Synchronisation (:func:`exchange_barrier`): one program stores its epoch into ``flags[rank]``
of every peer (release, system scope) and spins on its own flags (acquire) until every peer's
epoch is at least its own. Epochs come from ``ctl[0]`` (the pool's ``epochs``, local to each
rank, advanced by this kernel only), so they agree on every rank that makes the same calls; a
peer is never more than one barrier ahead, so ``≥`` never misses. A pull runs between two
barriers: the first says every rank has staged what the pull reads, the second that every
pull is done, so the next staging may overwrite it. The counts travel inside the first barrier
of a dispatch: each rank writes its row of the table into every peer before its release.
Launches go through :func:`moekit.runtime.replay.launch`.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from moekit.runtime.intmath import cdiv, next_power_of_2
from moekit.runtime.replay import launch
from moekit.tuning.exchange import PullConfig

__all__ = [
    "MAX_WORLD",
    "ExchangeLayout",
    "copy_rows",
    "exchange_barrier",
    "exchange_layout",
    "pull_sum",
    "pull_tokens",
]

MAX_WORLD = 8  # ranks of one NVLink domain that the flag and table layout have room for
FLAGS_OFFSET = 0
TABLE_OFFSET = 64
DATA_OFFSET = 512
REGION_ALIGN = 256  # bytes: every region starts 16-byte (vector) aligned

_MAX_WORLD = tl.constexpr(MAX_WORLD)
_FLAGS_OFFSET = tl.constexpr(FLAGS_OFFSET)
_TABLE_OFFSET = tl.constexpr(TABLE_OFFSET)


def _aligned(n: int) -> int:
    return -(-n // REGION_ALIGN) * REGION_ALIGN


@dataclasses.dataclass(frozen=True)
class ExchangeLayout:
    """Byte offsets of the regions of one exchange shape (see the module docstring)."""

    x: int
    x_meta: int
    lists: int
    y: int
    y_meta: int
    nbytes: int  # bytes the buffer needs


def exchange_layout(world: int, max_tokens: int, H: int, element_size: int, k: int):
    """The layout for W ranks of at most ``max_tokens`` tokens of width H each, k slots."""
    sizes = (
        max_tokens * H * element_size,  # x
        max_tokens * 2 * k * 4,  # x_meta
        world * max_tokens * 4,  # lists
        world * max_tokens * H * element_size,  # y
        world * max_tokens * k * 4,  # y_meta
    )
    offsets, at = [], DATA_OFFSET
    for n in sizes:
        offsets.append(at)
        at = _aligned(at + n)
    return ExchangeLayout(*offsets, nbytes=at)


@triton.jit
def _exchange_barrier_kernel(
    peer_bases_ptr,  # [W] int64: address of each rank's buffer
    ctl_ptr,  # [1+] int32, local: the epoch of the last barrier
    counts_ptr,  # [W] int32: tokens this rank sends to each rank (WITH_COUNTS)
    table_out_ptr,  # [W, W] int32 out: every rank's counts (WITH_COUNTS)
    rank,
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr, WITH_COUNTS: tl.constexpr,
):  # fmt: skip
    peers = tl.arange(0, WORLD_P2)
    valid = peers < WORLD
    epoch = tl.load(ctl_ptr) + 1
    bases = tl.load(peer_bases_ptr + peers, mask=valid, other=0)
    if WITH_COUNTS:
        mine = tl.load(counts_ptr + peers, mask=valid, other=0)
        for p in tl.static_range(WORLD):
            base = tl.load(peer_bases_ptr + p)
            row = (base + _TABLE_OFFSET).to(tl.pointer_type(tl.int32)) + rank * _MAX_WORLD
            tl.store(row + peers, mine, mask=valid)
    # Every thread's stores above are ordered before the release by the CTA barrier.
    tl.debug_barrier()
    remote = (bases + _FLAGS_OFFSET).to(tl.pointer_type(tl.int32)) + rank
    tl.atomic_xchg(remote, tl.zeros([WORLD_P2], dtype=tl.int32) + epoch, mask=valid,
                   sem="release", scope="sys")  # fmt: skip
    own = tl.load(peer_bases_ptr + rank)
    flags = (own + _FLAGS_OFFSET).to(tl.pointer_type(tl.int32)) + peers
    zero = tl.zeros([WORLD_P2], dtype=tl.int32)
    seen = tl.atomic_add(flags, zero, mask=valid, sem="acquire", scope="sys")
    # epochs only grow (a peer is at most one barrier ahead): wrapped difference >= 0
    pending = tl.sum(((seen - epoch < 0) & valid).to(tl.int32), axis=0)
    while pending > 0:
        seen = tl.atomic_add(flags, zero, mask=valid, sem="acquire", scope="sys")
        pending = tl.sum(((seen - epoch < 0) & valid).to(tl.int32), axis=0)
    tl.debug_barrier()
    if WITH_COUNTS:
        src = (own + _TABLE_OFFSET).to(tl.pointer_type(tl.int32))
        m2 = valid[:, None] & valid[None, :]
        table = tl.load(src + peers[:, None] * _MAX_WORLD + peers[None, :], mask=m2, other=0,
                        volatile=True)  # fmt: skip
        tl.store(table_out_ptr + peers[:, None] * WORLD + peers[None, :], table, mask=m2)
    tl.store(ctl_ptr, epoch)


@triton.jit
def _pick(values, index, lanes):
    """values[index] per element of ``index`` (values: a [WORLD_P2] vector)."""
    return tl.sum(tl.where(index[:, None] == lanes[None, :], values[None, :], 0), axis=1)


@triton.jit
def _pull_tokens_kernel(
    peer_bases_ptr, table_ptr,  # [W] int64; [W, W] int32 cnt[source, destination]
    out_ptr,  # [bound, H] out: the received tokens
    ids_ptr, probs_ptr,  # [bound, K] int32 / fp32 out (HAS_META)
    rank, H, bound, experts_local, stride_out,
    x_off, meta_off, lists_off,  # byte offsets of the regions in every rank's buffer
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr, K: tl.constexpr, K_P2: tl.constexpr,
    HAS_META: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):  # fmt: skip
    """recv[i] = x_s[lists_s[start_s + j]] for the i-th token from source s (its j-th)."""
    dtype = out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    lanes = tl.arange(0, WORLD_P2)
    lane_ok = lanes < WORLD
    from_each = tl.load(table_ptr + lanes * WORLD + rank, mask=lane_ok, other=0)  # cnt[s, r]
    recv_end = tl.cumsum(from_each, axis=0)
    recv_start = recv_end - from_each
    n_recv = tl.sum(from_each, axis=0)
    # where the list for this rank starts on each source: Σ_{d < rank} cnt[s, d]
    before = lane_ok[:, None] & (lanes < rank)[None, :]
    tbl = tl.load(table_ptr + lanes[:, None] * WORLD + lanes[None, :], mask=before, other=0)
    list_start = tl.sum(tbl, axis=1)
    bases = tl.load(peer_bases_ptr + lanes, mask=lane_ok, other=0)
    cols0 = tl.arange(0, BLOCK_H)
    for b in range(pid, tl.cdiv(bound, BLOCK_R), NUM_PROGRAMS):
        rows = b * BLOCK_R + tl.arange(0, BLOCK_R)
        real = rows < n_recv
        src = tl.sum(((rows[:, None] >= recv_end[None, :]) & lane_ok[None, :]).to(tl.int32), 1)
        src = tl.minimum(src, WORLD - 1)
        base = _pick(bases, src, lanes)
        j = rows - _pick(recv_start, src, lanes) + _pick(list_start, src, lanes)
        tok_ptr = (base + lists_off).to(tl.pointer_type(tl.int32)) + j
        tok = tl.load(tok_ptr, mask=real, other=0).to(tl.int64)
        row_ptr = tl.multiple_of((base + x_off).to(tl.pointer_type(dtype)) + tok * H, 16)
        out_rows = out_ptr + rows.to(tl.int64)[:, None] * stride_out
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + cols0
            m = real[:, None] & (cols < H)[None, :]
            v = tl.load(row_ptr[:, None] + cols[None, :], mask=m)
            tl.store(out_rows + cols[None, :], v, mask=m)
        if HAS_META:
            kk = tl.arange(0, K_P2)
            km = kk < K
            in_bound = (rows < bound)[:, None] & km[None, :]
            mrow = (base + meta_off).to(tl.pointer_type(tl.int32)) + tok * (2 * K)
            mm = real[:, None] & km[None, :]
            ids = tl.load(mrow[:, None] + kk[None, :], mask=mm, other=-1)
            pbits = tl.load(mrow[:, None] + K + kk[None, :], mask=mm, other=0)
            lo = rank * experts_local
            local = mm & (ids >= lo) & (ids < lo + experts_local)
            at = rows.to(tl.int64)[:, None] * K + kk[None, :]
            tl.store(ids_ptr + at, tl.where(local, ids - lo, -1), mask=in_bound)
            probs = tl.where(local, pbits, 0).to(tl.float32, bitcast=True)
            tl.store(probs_ptr + at, probs, mask=in_bound)


@triton.jit
def _owner_row(peer_bases_ptr, row_index_ptr, rows, rmask, shift, d, lanes,
               WORLD: tl.constexpr):  # fmt: skip
    """(sent, base, pos) of owner d for each row of a pull_sum block: whether the token went to
    d, d's buffer address and pos_d(t), the token's row among what d received."""
    ri = tl.load(row_index_ptr + rows.to(tl.int64) * WORLD + d, mask=rmask, other=-1)
    sent = ri >= 0
    pos = (ri + tl.sum(tl.where(lanes == d, shift, 0), axis=0)).to(tl.int64)
    return sent, tl.load(peer_bases_ptr + d), pos


@triton.jit
def _pull_sum_kernel(
    peer_bases_ptr, table_ptr,  # [W] int64; [W, W] int32 cnt[source, destination]
    row_index_ptr,  # [T, W] int32: place of token t in this rank's list for rank d (−1: not sent)
    out_ptr,  # [T, H] out
    meta_out_ptr,  # [T, K] fp32 out (HAS_META)
    rank, T, H, stride_out, y_off, meta_off,
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr, K: tl.constexpr, K_P2: tl.constexpr,
    HAS_META: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):  # fmt: skip
    """out[t] = Σ_d y_d[pos_d(t)], pos_d(t) = row_index[t, d] − Σ_{d' < d} cnt[rank, d']
    + Σ_{s < rank} cnt[s, d] (the token's place among what owner d received)."""
    dtype = out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    lanes = tl.arange(0, WORLD_P2)
    lane_ok = lanes < WORLD
    mine = tl.load(table_ptr + rank * WORLD + lanes, mask=lane_ok, other=0)  # cnt[rank, d]
    before_me = (lanes < rank)[:, None] & lane_ok[None, :]
    col = tl.load(table_ptr + lanes[:, None] * WORLD + lanes[None, :], mask=before_me, other=0)
    shift = tl.sum(col, axis=0) - (tl.cumsum(mine, axis=0) - mine)
    cols0 = tl.arange(0, BLOCK_H)
    for b in range(pid, tl.cdiv(T, BLOCK_R), NUM_PROGRAMS):
        rows = b * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < T
        out_rows = out_ptr + rows.to(tl.int64)[:, None] * stride_out
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + cols0
            cm = cols < H
            acc = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
            for d in tl.static_range(WORLD):
                ok, base, pos = _owner_row(peer_bases_ptr, row_index_ptr, rows, rmask, shift, d,
                                           lanes, WORLD)  # fmt: skip
                row_ptr = tl.multiple_of((base + y_off).to(tl.pointer_type(dtype)) + pos * H, 16)
                v = tl.load(row_ptr[:, None] + cols[None, :], mask=ok[:, None] & cm[None, :],
                            other=0.0)  # fmt: skip
                acc += v.to(tl.float32)
            tl.store(out_rows + cols[None, :], acc.to(dtype), mask=rmask[:, None] & cm[None, :])
        if HAS_META:
            kk = tl.arange(0, K_P2)
            km = kk < K
            acc_m = tl.zeros((BLOCK_R, K_P2), dtype=tl.float32)
            for d in tl.static_range(WORLD):
                ok, base, pos = _owner_row(peer_bases_ptr, row_index_ptr, rows, rmask, shift, d,
                                           lanes, WORLD)  # fmt: skip
                mrow = (base + meta_off).to(tl.pointer_type(tl.float32)) + pos * K
                acc_m += tl.load(mrow[:, None] + kk[None, :], mask=ok[:, None] & km[None, :],
                                 other=0.0)  # fmt: skip
            at = rows.to(tl.int64)[:, None] * K + kk[None, :]
            tl.store(meta_out_ptr + at, acc_m, mask=rmask[:, None] & km[None, :])


@triton.jit
def _copy_rows_kernel(
    src_ptr, dst_ptr,  # [*, N] rows: src with stride_src, dst contiguous
    table_ptr,  # [W, W] int32: the rows to copy are n = Σ_s cnt[s, rank]
    rank, N, stride_src,
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):  # fmt: skip
    """dst[i] = src[i] for the i < n rows this rank received (n on the device)."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, WORLD_P2)
    n = tl.sum(tl.load(table_ptr + lanes * WORLD + rank, mask=lanes < WORLD, other=0), axis=0)
    cols0 = tl.arange(0, BLOCK_N)
    for b in range(pid, tl.cdiv(n, BLOCK_R), NUM_PROGRAMS):
        rows = (b * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        rmask = rows < n
        for c0 in range(0, N, BLOCK_N):
            cols = c0 + cols0
            m = rmask[:, None] & (cols < N)[None, :]
            v = tl.load(src_ptr + rows[:, None] * stride_src + cols[None, :], mask=m)
            tl.store(dst_ptr + rows[:, None] * N + cols[None, :], v, mask=m)


def _world(peer_bases: torch.Tensor) -> tuple[int, int]:
    W = peer_bases.shape[0]
    return W, max(next_power_of_2(W), 2)


def exchange_barrier(
    peer_bases: torch.Tensor,  # [W] int64
    ctl: torch.Tensor,  # [1+] int32, local
    rank: int,
    counts: torch.Tensor | None = None,  # [W] int32: tokens this rank sends to each rank
    table: torch.Tensor | None = None,  # [W, W] int32 out (with counts)
) -> None:
    """Barrier of every rank of the pool; with ``counts``, also their all-gather into ``table``
    (see the module docstring)."""
    W, W2 = _world(peer_bases)
    with_counts = counts is not None
    launch(
        _exchange_barrier_kernel, (1,),
        peer_bases, ctl, counts if with_counts else ctl, table if with_counts else ctl, rank,
        WORLD=W, WORLD_P2=W2, WITH_COUNTS=with_counts, num_warps=1,
    )  # fmt: skip


def _grid(n_blocks: int, sms: int, config: PullConfig) -> int:
    return max(1, min(n_blocks, sms * config.programs_per_sm))


def _pull_launch(
    peer_bases: torch.Tensor,
    out: torch.Tensor,  # [rows, H]: the pull's output rows
    slots: torch.Tensor | None,  # [rows, K]: its per-slot metadata output, if any
    sms: int,
    config: PullConfig,
) -> tuple[int, dict]:
    """(grid, meta) of a pull: the launch arguments that pull_tokens and pull_sum share."""
    W, W2 = _world(peer_bases)
    K = slots.shape[1] if slots is not None else 1
    grid = _grid(cdiv(out.shape[0], config.block_r), sms, config)
    meta = dict(
        WORLD=W, WORLD_P2=W2, K=K, K_P2=max(next_power_of_2(K), 2), HAS_META=slots is not None,
        BLOCK_R=config.block_r, BLOCK_H=config.block_h, NUM_PROGRAMS=grid, num_warps=4,
    )  # fmt: skip
    return grid, meta


def pull_tokens(
    peer_bases: torch.Tensor,
    table: torch.Tensor,  # [W, W] int32
    layout: ExchangeLayout,
    rank: int,
    out: torch.Tensor,  # [bound, H], unit stride along H
    ids: torch.Tensor | None,  # [bound, K] int32 out
    probs: torch.Tensor | None,  # [bound, K] fp32 out
    experts_local: int,
    sms: int,  # streaming multiprocessors of the device
    config: PullConfig,
) -> None:
    """The dispatch read (see the module docstring); ``ids``/``probs`` None: rows only."""
    bound, H = out.shape
    grid, meta = _pull_launch(peer_bases, out, ids, sms, config)
    launch(
        _pull_tokens_kernel, (grid,),
        peer_bases, table, out, ids if ids is not None else table,
        probs if probs is not None else table,
        rank, H, bound, experts_local, out.stride(0),
        layout.x, layout.x_meta, layout.lists,
        **meta,
    )  # fmt: skip


def pull_sum(
    peer_bases: torch.Tensor,
    table: torch.Tensor,  # [W, W] int32
    layout: ExchangeLayout,
    rank: int,
    row_index: torch.Tensor,  # [T, W] int32, contiguous
    out: torch.Tensor,  # [T, H], unit stride along H
    meta_out: torch.Tensor | None,  # [T, K] fp32 out
    sms: int,
    config: PullConfig,
) -> None:
    """The combine read (see the module docstring); ``meta_out`` None: rows only."""
    T, H = out.shape
    grid, meta = _pull_launch(peer_bases, out, meta_out, sms, config)
    launch(
        _pull_sum_kernel, (grid,),
        peer_bases, table, row_index, out, meta_out if meta_out is not None else table,
        rank, T, H, out.stride(0), layout.y, layout.y_meta,
        **meta,
    )  # fmt: skip


def copy_rows(
    src: torch.Tensor,  # [bound, N], unit stride along N
    dst: torch.Tensor,  # [bound, N] contiguous (a view of the pool)
    table: torch.Tensor,  # [W, W] int32
    rank: int,
    sms: int,
    config: PullConfig,
) -> None:
    """dst[:n] = src[:n] for the n rows this rank received (read from the table)."""
    W = table.shape[0]
    bound, N = src.shape
    block_r, block_n = config.block_r, min(config.block_h, next_power_of_2(N))
    grid = _grid(cdiv(bound, block_r), sms, config)
    launch(
        _copy_rows_kernel, (grid,),
        src, dst, table, rank, N, src.stride(0),
        WORLD=W, WORLD_P2=max(next_power_of_2(W), 2), BLOCK_R=block_r, BLOCK_N=block_n,
        NUM_PROGRAMS=grid, num_warps=4,
    )  # fmt: skip
