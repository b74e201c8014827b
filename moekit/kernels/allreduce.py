"""All-reduce (+ residual add)(+ RMSNorm) over symmetric memory: one Triton kernel per rank.

Every rank owns one symmetric buffer (:class:`moekit.distributed.SymmetricPool`), mapped into every
peer's address space. The kernels receive ``peer_bases[W]`` (int64, device), the address of each
rank's buffer as seen from this GPU, cast them with ``tl.pointer_type`` and read the peers' data
directly over NVLink. No multicast (``multimem``) instruction is used anywhere.

Buffer layout (bytes, identical on every rank)::

    [0, SIGNAL_BYTES)              signal: int32 flags[NUM_CHANNELS][MAX_BLOCKS][MAX_WORLD]
    [D, D + T·H·e)                 "in":  every rank's copy of its own x     (both algos)
    [D + T·H·e, D + 2·T·H·e)       "out": reduced residual_out of owned rows (two_shot)

with ``D = DATA_OFFSET`` and ``e`` the element size.

Synchronisation (``_sync_peers``): program ``b`` of rank ``r`` stores ``epoch`` into
``flags[ch][b][r]`` of every peer (``atom.exch.release.sys``) and spins on its own
``flags[ch][b][0..W)`` (``ld.acquire.sys``) until all equal ``epoch``. The epoch is a per-program
counter kept on the device (``epochs[MAX_BLOCKS]``, local to each rank): each launch reads it,
uses ``epoch + 1`` and writes it back, so repeated calls and CUDA-graph replays never need a reset
and never see a stale flag. Every rank launches the same grid for the same call, so program ``b``'s
counters stay equal across ranks. Each barrier of a launch uses its own channel, which makes the
equality test safe: a peer can be at most one barrier ahead, and that barrier writes another
channel.

one_shot (latency): stage x → own "in"; barrier 0; every rank reads row t from all W buffers,
sums in fp32 in rank order (so all ranks get identical bits), adds the residual, rounds, normalises,
writes its outputs; barrier 1 (peers are done reading "in" before the next call overwrites it).

two_shot (bandwidth): rows are split into W chunks of C = ⌈T/W⌉; rank q owns chunk q. Stage x;
barrier 0; reduce-scatter: each rank reduces its own chunk from all W buffers, adds the residual and
writes the rounded residual_out to its "out"; barrier 1; all-gather: every rank copies all chunks
from the owners' "out" and normalises every row locally (same code on the same bits → identical
outputs); barrier 2.

Programs are persistent (grid ≤ SM count) so that every program of every rank is co-resident; a
barrier only pairs program ``b`` of each rank, never waits on the whole grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekit.kernels.rmsnorm import block_h, num_warps_for

# ----------------------------------------------------------------------------------------------
# constants (the buffer layout above)
# ----------------------------------------------------------------------------------------------
MAX_WORLD = 8  # ranks in one NVLink domain that the flag layout has room for
MAX_BLOCKS = 256  # programs per launch that the flag layout has room for
NUM_CHANNELS = 4  # barriers per launch (two_shot uses 3)
SIGNAL_BYTES = NUM_CHANNELS * MAX_BLOCKS * MAX_WORLD * 4
DATA_OFFSET = SIGNAL_BYTES  # 32 KiB, 128-byte aligned
MAX_FUSED_H = 16384  # widest row the cross-rank kernels keep in registers
EPOCH_MASK = 0x3FFFFFFF  # epochs wrap inside int32; equality (not ≥) keeps the wrap safe

# the same numbers as constexpr, for use inside @triton.jit functions
_MAX_WORLD = tl.constexpr(MAX_WORLD)
_MAX_BLOCKS = tl.constexpr(MAX_BLOCKS)
_DATA_OFFSET = tl.constexpr(DATA_OFFSET)
_EPOCH_MASK = tl.constexpr(EPOCH_MASK)

ALGOS = ("one_shot", "two_shot")


def workspace_bytes(T: int, H: int, element_size: int, algo: str) -> int:
    """Bytes of the pool's data region a call needs (the signal region is extra)."""
    return T * H * element_size * (2 if algo == "two_shot" else 1)


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _sync_peers(
    peer_bases_ptr,  # [W] int64: address of each rank's symmetric buffer
    rank,
    channel: tl.constexpr,
    epoch,
    WORLD: tl.constexpr,
    WORLD_P2: tl.constexpr,
):
    """Barrier between program ``pid`` of every rank (release/acquire at system scope).

    Every thread's earlier global stores are ordered before the release by the CTA barrier; the
    trailing CTA barrier orders the acquire before every thread's later loads.
    """
    pid = tl.program_id(0)
    tl.debug_barrier()
    peers = tl.arange(0, WORLD_P2)
    valid = peers < WORLD
    slot = (channel * _MAX_BLOCKS + pid) * _MAX_WORLD
    bases = tl.load(peer_bases_ptr + peers, mask=valid, other=0)
    remote = bases.to(tl.pointer_type(tl.int32)) + slot + rank  # flags[ch][pid][rank] on each peer
    value = tl.zeros([WORLD_P2], dtype=tl.int32) + epoch
    tl.atomic_xchg(remote, value, mask=valid, sem="release", scope="sys")
    own = tl.load(peer_bases_ptr + rank).to(tl.pointer_type(tl.int32)) + slot + peers
    zero = tl.zeros([WORLD_P2], dtype=tl.int32)
    seen = tl.atomic_add(own, zero, mask=valid, sem="acquire", scope="sys")
    pending = tl.sum(((seen != epoch) & valid).to(tl.int32), axis=0)
    while pending > 0:
        seen = tl.atomic_add(own, zero, mask=valid, sem="acquire", scope="sys")
        pending = tl.sum(((seen != epoch) & valid).to(tl.int32), axis=0)
    tl.debug_barrier()


@triton.jit
def _data_ptr(peer_bases_ptr, r, dtype: tl.constexpr):
    """Typed pointer to rank ``r``'s data region (16-byte aligned: the launcher requires
    H · element size to be a multiple of 16, so every row and region starts aligned)."""
    base = (tl.load(peer_bases_ptr + r) + _DATA_OFFSET).to(tl.pointer_type(dtype))
    return tl.multiple_of(base, 16)


@triton.jit
def _sum_peers(
    peer_bases_ptr,
    offset,  # element offset of the row inside a data region (int64)
    cols,
    mask,
    dtype: tl.constexpr,
    WORLD: tl.constexpr,
):
    """fp32 Σ_r buf_r[offset + cols] in rank order 0…W−1 (the order every rank uses)."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for r in tl.static_range(WORLD):
        src = _data_ptr(peer_bases_ptr, r, dtype) + offset
        acc += tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _norm_store(
    v,  # [BLOCK_H] rounded residual_out, input dtype
    w,  # [BLOCK_H] fp32 weight
    row,  # int64
    cols,
    cmask,
    rmask,  # scalar: row < T
    y_ptr,
    rstd_ptr,
    stride_y_t,
    H,
    eps,
    STORE_RSTD: tl.constexpr,
):
    """y = round(v · rsqrt(mean(v²) + eps) · w); same math as the local rmsnorm kernel."""
    vf = v.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(vf * vf, axis=0) / H + eps)
    tl.store(y_ptr + row * stride_y_t + cols, (vf * rstd * w).to(v.dtype), mask=cmask & rmask)
    if STORE_RSTD:
        tl.store(rstd_ptr + row, rstd, mask=rmask)


@triton.jit
def _allreduce_fused_kernel(
    # pointers
    x_ptr,  # [T, H] this rank's partial sum
    res_ptr,  # [T, H] residual (unused unless HAS_RESIDUAL)
    w_ptr,  # [H] norm weight (unused unless HAS_NORM)
    ro_ptr,  # [T, H] out: Σ_r x_r (+ residual)
    y_ptr,  # [T, H] out: RMSNorm(ro) · w (unused unless HAS_NORM)
    rstd_ptr,  # [T] fp32 out (unused unless STORE_RSTD)
    peer_bases_ptr,  # [W] int64 symmetric-buffer addresses
    epoch_ptr,  # [MAX_BLOCKS] int32 per-program epoch counters (local)
    # sizes
    T,
    H,
    rows_per_rank,  # C = ⌈T / W⌉ (two_shot)
    rank,
    eps,
    # strides (elements)
    stride_x_t,
    stride_res_t,
    stride_ro_t,
    stride_y_t,
    # meta
    WORLD: tl.constexpr,
    WORLD_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TWO_SHOT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_NORM: tl.constexpr,
    STORE_RSTD: tl.constexpr,
):
    """ro = round(Σ_r x_r + residual) (fp32 sum in rank order); y = RMSNorm(ro) · w."""
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    epoch = (tl.load(epoch_ptr + pid) + 1) & _EPOCH_MASK
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    H64 = H.to(tl.int64)
    own_in = _data_ptr(peer_bases_ptr, rank, dtype)
    if HAS_NORM:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        w = tl.zeros([BLOCK_H], dtype=tl.float32)

    if not TWO_SHOT:
        # stage this program's rows of x into the own buffer
        for row in range(pid, T, num_progs):
            r64 = tl.cast(row, tl.int64)
            v = tl.load(x_ptr + r64 * stride_x_t + cols, mask=cmask)
            tl.store(own_in + r64 * H64 + cols, v, mask=cmask)
        _sync_peers(peer_bases_ptr, rank, 0, epoch, WORLD, WORLD_P2)
        for row in range(pid, T, num_progs):
            r64 = tl.cast(row, tl.int64)
            acc = _sum_peers(peer_bases_ptr, r64 * H64, cols, cmask, dtype, WORLD)
            if HAS_RESIDUAL:
                acc += tl.load(res_ptr + r64 * stride_res_t + cols, mask=cmask, other=0.0).to(
                    tl.float32
                )
            v = acc.to(dtype)
            tl.store(ro_ptr + r64 * stride_ro_t + cols, v, mask=cmask)
            if HAS_NORM:
                _norm_store(
                    v, w, r64, cols, cmask, True, y_ptr, rstd_ptr, stride_y_t, H, eps, STORE_RSTD
                )
        _sync_peers(peer_bases_ptr, rank, 1, epoch, WORLD, WORLD_P2)
    else:
        own_out = own_in + H64 * T
        # stage: this program's local index i of every rank's chunk
        for i in range(pid, rows_per_rank, num_progs):
            for q in tl.static_range(WORLD):
                r64 = tl.cast(q * rows_per_rank + i, tl.int64)
                m = cmask & (r64 < T)
                v = tl.load(x_ptr + r64 * stride_x_t + cols, mask=m)
                tl.store(own_in + r64 * H64 + cols, v, mask=m)
        _sync_peers(peer_bases_ptr, rank, 0, epoch, WORLD, WORLD_P2)
        # reduce-scatter: the rows of the own chunk
        for i in range(pid, rows_per_rank, num_progs):
            r64 = tl.cast(rank * rows_per_rank + i, tl.int64)
            m = cmask & (r64 < T)
            acc = _sum_peers(peer_bases_ptr, r64 * H64, cols, m, dtype, WORLD)
            if HAS_RESIDUAL:
                acc += tl.load(res_ptr + r64 * stride_res_t + cols, mask=m, other=0.0).to(
                    tl.float32
                )
            tl.store(own_out + r64 * H64 + cols, acc.to(dtype), mask=m)
        _sync_peers(peer_bases_ptr, rank, 1, epoch, WORLD, WORLD_P2)
        # all-gather + local norm of every row
        for i in range(pid, rows_per_rank, num_progs):
            for q in tl.static_range(WORLD):
                r64 = tl.cast(q * rows_per_rank + i, tl.int64)
                rmask = r64 < T
                m = cmask & rmask
                src = _data_ptr(peer_bases_ptr, q, dtype) + H64 * T
                v = tl.load(src + r64 * H64 + cols, mask=m, other=0.0)
                tl.store(ro_ptr + r64 * stride_ro_t + cols, v, mask=m)
                if HAS_NORM:
                    _norm_store(
                        v,
                        w,
                        r64,
                        cols,
                        cmask,
                        rmask,
                        y_ptr,
                        rstd_ptr,
                        stride_y_t,
                        H,
                        eps,
                        STORE_RSTD,
                    )
        _sync_peers(peer_bases_ptr, rank, 2, epoch, WORLD, WORLD_P2)
    tl.store(epoch_ptr + pid, epoch)


# ----------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------


def allreduce_fused(
    x: torch.Tensor,  # [T, H] bf16 / fp16 / fp32, unit column stride
    residual: torch.Tensor | None,  # [T, H] like x, or None
    weight: torch.Tensor | None,  # [H] (x's dtype or fp32), or None for no norm
    eps: float,
    *,
    peer_bases: torch.Tensor,  # [W] int64 on x's device
    epochs: torch.Tensor,  # [MAX_BLOCKS] int32 on x's device
    rank: int,
    algo: str,  # "one_shot" | "two_shot"
    max_programs: int,
    store_rstd: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Launch the fused kernel. Returns ``(normed | None, residual_out, rstd | None)``.

    Without ``residual`` and ``weight`` this is a plain all-reduce (``residual_out`` = Σ_r x_r).
    The pool's data region must hold :func:`workspace_bytes` bytes; the caller checks.
    """
    T, H = x.shape
    world = peer_bases.numel()
    ro = torch.empty_like(x)
    y = torch.empty_like(x) if weight is not None else None
    rstd = (
        torch.empty(T, dtype=torch.float32, device=x.device)
        if (store_rstd and weight is not None)
        else None
    )
    if T == 0:
        return y, ro, rstd
    two_shot = algo == "two_shot"
    rows_per_rank = triton.cdiv(T, world)
    work = rows_per_rank if two_shot else T
    grid = max(1, min(work, max_programs, MAX_BLOCKS))
    BLOCK_H = block_h(H)
    _allreduce_fused_kernel[(grid,)](
        x,
        residual if residual is not None else x,
        weight if weight is not None else x,
        ro,
        y if y is not None else ro,
        rstd if rstd is not None else ro,
        peer_bases,
        epochs,
        T,
        H,
        rows_per_rank,
        rank,
        eps,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        ro.stride(0),
        y.stride(0) if y is not None else 0,
        WORLD=world,
        WORLD_P2=triton.next_power_of_2(world),
        BLOCK_H=BLOCK_H,
        TWO_SHOT=two_shot,
        HAS_RESIDUAL=residual is not None,
        HAS_NORM=weight is not None,
        STORE_RSTD=rstd is not None,
        num_warps=num_warps_for(BLOCK_H),
    )
    return y, ro, rstd
