"""All-reduce (+ residual add)(+ RMSNorm) over symmetric memory: one Triton kernel per rank.

Every rank owns one symmetric buffer (:class:`moekit.distributed.SymmetricPool`), mapped into every
peer's address space. The kernels receive ``peer_bases[W]`` (int64, device), the address of each
rank's buffer as seen from this GPU, cast them with ``tl.pointer_type`` and read the peers' data
directly over NVLink. No multicast (``multimem``) instruction is used anywhere.

Buffer layout (bytes, identical on every rank; ``D = DATA_OFFSET``, ``S`` = half size)::

    [0, SIGNAL_BYTES)    signal: int32 flags[NUM_CHANNELS][MAX_BLOCKS][MAX_WORLD]
    [D, D + S)           half 0: every rank's copy of its own x [T, H]   (even launch epochs)
    [D + S, D + 2·S)     half 1: the same                                 (odd launch epochs)

``S = half_bytes(capacity)``; a call needs ``T·H·e ≤ S`` (:func:`workspace_bytes` = 2·T·H·e).

Launch epoch: each rank keeps ``ctl[2]`` int32 on the device (``[0]`` the epoch of the last
launch, ``[1]`` an arrival counter). Every program of a launch reads ``E = ctl[0] + 1`` at its
start; the last program to finish (counted with one atomic) writes ``ctl[0] = E`` and resets the
counter, so all programs of a launch agree on ``E`` and consecutive launches (eager, or CUDA-graph
replays) advance it by one with no reset and no host involvement. Every rank makes the same calls,
so ``E`` is the same on every rank for the same call.

Double buffering (why one barrier is enough): launch ``E`` uses data half ``E & 1`` and flag
channels ``2·(E & 1) + k``. A rank starts launch ``E + 2`` (which overwrites half ``E & 1``) only
after its launch ``E + 1`` finished, which needed every peer's launch ``E + 1`` to reach its first
barrier, which on each peer comes after its launch ``E`` — and so all of its reads of half
``E & 1`` — completed. So no exit barrier is needed. The same argument bounds how far a peer can
run ahead (one launch), and that launch writes the other channels, so the barrier's equality test
on a flag can never miss its value.

Barrier ``_sync_peers``: program ``b`` of rank ``r`` stores ``E`` into ``flags[ch][b][r]`` of every
peer (``atom.exch.release.sys``) and spins on its own ``flags[ch][b][0..W)`` (acquire, system
scope) until all equal ``E``. Only program ``b`` of each rank is paired (no grid-wide barrier):
every program reads exactly the rows its namesakes on the peers staged.

one_shot (latency): stage x → own half; barrier; every rank reads row t from all W buffers, sums in
fp32 in rank order (so all ranks get identical bits), adds the residual, rounds, normalises, writes
its outputs. One barrier per launch.

two_shot (bandwidth): rows are split into W chunks of C = ⌈T/W⌉; rank q owns chunk q. Stage x;
barrier; reduce-scatter: each rank reduces its own chunk from all W buffers, adds the residual and
writes the rounded residual_out **in place** over its own staged rows of that chunk (no peer reads
them: peers read only their own chunks from this buffer); barrier; all-gather: every rank copies
every chunk from its owner's half and normalises every row locally (same code on the same bits →
identical outputs). Two barriers per launch.

Programs are persistent (grid ≤ SM count, ≤ MAX_BLOCKS) so that every program of every rank is
co-resident.

Launch cost: :class:`FusedAllreducePlan` holds everything static about a call (grid, constexprs,
the compiled kernel once it exists) and re-launches the compiled kernel directly, skipping Triton's
per-call argument binding and cache lookup (the ops cache one plan per shape/dtype/group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs as _knobs

from moekit.config import interpret_mode
from moekit.kernels.rmsnorm import block_h, num_warps_for

# ----------------------------------------------------------------------------------------------
# constants (the buffer layout above)
# ----------------------------------------------------------------------------------------------
MAX_WORLD = 8  # ranks in one NVLink domain that the flag layout has room for
MAX_BLOCKS = 256  # programs per launch that the flag layout has room for
NUM_CHANNELS = 4  # 2 barriers per launch × 2 epoch parities
SIGNAL_BYTES = NUM_CHANNELS * MAX_BLOCKS * MAX_WORLD * 4
DATA_OFFSET = SIGNAL_BYTES  # 32 KiB, 128-byte aligned
CTL_WORDS = 2  # ctl[0] launch epoch, ctl[1] arrival counter (int32, local to each rank)
MAX_FUSED_H = 16384  # widest row the cross-rank kernels keep in registers
EPOCH_MASK = 0x3FFFFFFF  # epochs wrap inside int32; equality (not ≥) keeps the wrap safe
HALF_ALIGN = 256  # bytes; keeps the second half 16-element aligned for every dtype

# the same numbers as constexpr, for use inside @triton.jit functions
_MAX_WORLD = tl.constexpr(MAX_WORLD)
_MAX_BLOCKS = tl.constexpr(MAX_BLOCKS)
_DATA_OFFSET = tl.constexpr(DATA_OFFSET)
_EPOCH_MASK = tl.constexpr(EPOCH_MASK)

ALGOS = ("one_shot", "two_shot")


def half_bytes(capacity: int) -> int:
    """Bytes of one of the two data halves of a pool whose data region has ``capacity`` bytes."""
    return (capacity // 2) // HALF_ALIGN * HALF_ALIGN


def workspace_bytes(T: int, H: int, element_size: int, algo: str) -> int:
    """Bytes of the pool's data region a call needs (both halves; the signal region is extra).

    Both algorithms stage ``x`` into one half (two_shot writes its reduced chunk in place).
    ``algo`` is accepted for symmetry with older layouts and does not change the answer.
    """
    del algo
    n = T * H * element_size
    return 2 * ((n + HALF_ALIGN - 1) // HALF_ALIGN * HALF_ALIGN)


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _sync_peers(
    peer_bases_ptr,  # [W] int64: address of each rank's symmetric buffer
    rank,
    channel,  # flag channel of this barrier (runtime: depends on the epoch's parity)
    epoch,
    WORLD: tl.constexpr,
    WORLD_P2: tl.constexpr,
):
    """Barrier between program ``pid`` of every rank (release/acquire at system scope).

    Every thread's earlier global accesses are ordered before the release by the CTA barrier; the
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
def _data_ptr(peer_bases_ptr, r, half_off, dtype: tl.constexpr):
    """Typed pointer to this launch's half of rank ``r``'s data region (``half_off`` bytes into
    it). 16-byte aligned: the launcher requires H · element size to be a multiple of 16 and the
    halves start at multiples of HALF_ALIGN, so every row starts aligned."""
    base = (tl.load(peer_bases_ptr + r) + _DATA_OFFSET + half_off).to(tl.pointer_type(dtype))
    return tl.multiple_of(base, 16)


@triton.jit
def _sum_peers(
    peer_bases_ptr,
    half_off,
    offset,  # element offset of the row inside a half (int64)
    cols,
    mask,
    dtype: tl.constexpr,
    WORLD: tl.constexpr,
):
    """fp32 Σ_r buf_r[offset + cols] in rank order 0…W−1 (the order every rank uses)."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for r in tl.static_range(WORLD):
        src = _data_ptr(peer_bases_ptr, r, half_off, dtype) + offset
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
def _advance_epoch(ctl_ptr, epoch):
    """The last program of the launch to arrive publishes ``epoch`` for the next launch (every
    program has read ``ctl[0]`` before it arrives, so none can see the new value)."""
    arrived = tl.atomic_add(ctl_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        tl.store(ctl_ptr + 1, 0)
        tl.store(ctl_ptr, epoch)


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
    ctl_ptr,  # [CTL_WORDS] int32: launch epoch, arrival counter (local)
    # sizes
    T,
    H,
    rows_per_rank,  # C = ⌈T / W⌉ (two_shot)
    rank,
    half_bytes,  # bytes between the two data halves
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
    epoch = (tl.load(ctl_ptr, volatile=True) + 1) & _EPOCH_MASK
    parity = epoch & 1
    channel = parity * 2
    half_off = parity.to(tl.int64) * half_bytes
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    H64 = H.to(tl.int64)
    own_in = _data_ptr(peer_bases_ptr, rank, half_off, dtype)
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
        _sync_peers(peer_bases_ptr, rank, channel, epoch, WORLD, WORLD_P2)
        for row in range(pid, T, num_progs):
            r64 = tl.cast(row, tl.int64)
            if HAS_RESIDUAL:  # issued before the peer loads: overlaps their latency
                res = tl.load(res_ptr + r64 * stride_res_t + cols, mask=cmask, other=0.0)
            acc = _sum_peers(peer_bases_ptr, half_off, r64 * H64, cols, cmask, dtype, WORLD)
            if HAS_RESIDUAL:
                acc += res.to(tl.float32)
            v = acc.to(dtype)
            tl.store(ro_ptr + r64 * stride_ro_t + cols, v, mask=cmask)
            if HAS_NORM:
                _norm_store(
                    v, w, r64, cols, cmask, True, y_ptr, rstd_ptr, stride_y_t, H, eps, STORE_RSTD
                )
    else:
        # stage: this program's local index i of every rank's chunk
        for i in range(pid, rows_per_rank, num_progs):
            for q in tl.static_range(WORLD):
                r64 = tl.cast(q * rows_per_rank + i, tl.int64)
                m = cmask & (r64 < T)
                v = tl.load(x_ptr + r64 * stride_x_t + cols, mask=m)
                tl.store(own_in + r64 * H64 + cols, v, mask=m)
        _sync_peers(peer_bases_ptr, rank, channel, epoch, WORLD, WORLD_P2)
        # reduce-scatter: the rows of the own chunk, written back in place (rounded)
        for i in range(pid, rows_per_rank, num_progs):
            r64 = tl.cast(rank * rows_per_rank + i, tl.int64)
            m = cmask & (r64 < T)
            if HAS_RESIDUAL:
                res = tl.load(res_ptr + r64 * stride_res_t + cols, mask=m, other=0.0)
            acc = _sum_peers(peer_bases_ptr, half_off, r64 * H64, cols, m, dtype, WORLD)
            if HAS_RESIDUAL:
                acc += res.to(tl.float32)
            tl.store(own_in + r64 * H64 + cols, acc.to(dtype), mask=m)
        _sync_peers(peer_bases_ptr, rank, channel + 1, epoch, WORLD, WORLD_P2)
        # all-gather + local norm of every row
        for i in range(pid, rows_per_rank, num_progs):
            for q in tl.static_range(WORLD):
                r64 = tl.cast(q * rows_per_rank + i, tl.int64)
                rmask = r64 < T
                m = cmask & rmask
                src = _data_ptr(peer_bases_ptr, q, half_off, dtype)
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
    _advance_epoch(ctl_ptr, epoch)


# ----------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------


def _grid_size(T: int, world: int, algo: str, max_programs: int) -> int:
    work = triton.cdiv(T, world) if algo == "two_shot" else T
    return max(1, min(work, max_programs, MAX_BLOCKS))


class FusedAllreducePlan:
    """Everything static about one call shape of :func:`_allreduce_fused_kernel`, and its launch.

    Built once per (T, H, dtypes, flags, pool) by the ops and reused: ``plan(x, residual, weight,
    eps)`` allocates the outputs and launches. After the first launch the compiled kernel is kept
    and re-launched directly (Triton's launcher, the same arguments Triton itself passes), which
    skips the per-call argument binding, specialisation and cache lookup of ``kernel[grid](...)``.
    The specialisation Triton would pick depends only on the static values held here and on the
    16-byte alignment of the input pointers, which is part of the cache key of the compiled kernel.
    Under ``TRITON_INTERPRET=1`` (or with Triton launch hooks installed) every launch takes the
    ordinary ``kernel[grid](...)`` path.
    """

    __slots__ = (  # noqa: RUF023 (grouped by meaning)
        "T", "H", "dtype", "device", "has_residual", "has_norm", "store_rstd", "two_shot",
        "grid", "peer_bases", "ctl", "_static", "_meta", "_num_warps", "_compiled", "_direct",
    )  # fmt: skip

    def __init__(
        self,
        *,
        T: int,
        H: int,
        dtype: torch.dtype,  # x's dtype
        device: torch.device,
        has_residual: bool,
        has_norm: bool,
        store_rstd: bool,
        peer_bases: torch.Tensor,  # [W] int64 on device
        ctl: torch.Tensor,  # [≥ CTL_WORDS] int32 on device (the pool's epochs)
        rank: int,
        algo: str,  # "one_shot" | "two_shot"
        max_programs: int,
        half_bytes: int,  # bytes between the pool's two data halves
    ) -> None:
        world = peer_bases.numel()
        self.T, self.H, self.dtype, self.device = T, H, dtype, device
        self.has_residual, self.has_norm = has_residual, has_norm
        self.store_rstd = store_rstd and has_norm
        self.two_shot = algo == "two_shot"
        self.grid = _grid_size(T, world, algo, max_programs)
        self.peer_bases, self.ctl = peer_bases, ctl
        BLOCK_H = block_h(H)
        # (T, H, rows_per_rank, rank, half_bytes) and the strides of contiguous [T, H] tensors
        self._static = (T, H, triton.cdiv(T, world), rank, half_bytes)
        self._meta = (world, triton.next_power_of_2(world), BLOCK_H, self.two_shot,
                      has_residual, has_norm, self.store_rstd)  # fmt: skip
        self._num_warps = num_warps_for(BLOCK_H)
        self._compiled: dict[int, object] = {}  # input-alignment bits → CompiledKernel
        self._direct = device.type == "cuda" and not interpret_mode()

    def __call__(
        self,
        x: torch.Tensor,  # [T, H] contiguous
        residual: torch.Tensor | None,  # [T, H] contiguous, or None
        weight: torch.Tensor | None,  # [H], or None
        eps: float,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        T, H = self.T, self.H
        ro = torch.empty((T, H), dtype=self.dtype, device=self.device)
        y = torch.empty((T, H), dtype=self.dtype, device=self.device) if self.has_norm else None
        rstd = (
            torch.empty((T,), dtype=torch.float32, device=self.device) if self.store_rstd else None
        )
        if T == 0:
            return y, ro, rstd
        res = residual if residual is not None else x
        w = weight if weight is not None else x
        args = (
            x, res, w, ro,
            y if y is not None else ro,
            rstd if rstd is not None else ro,
            self.peer_bases, self.ctl,
            *self._static, eps,
            H, H if residual is not None else 0, H, H if y is not None else 0,
            *self._meta,
        )  # fmt: skip
        if not self._direct:
            self._launch_jit(args)
            return y, ro, rstd
        # Triton specialises pointers on 16-byte alignment; outputs and pool tensors are aligned
        key = (
            (x.data_ptr() & 15 == 0)
            | (res.data_ptr() & 15 == 0) << 1
            | (w.data_ptr() & 15 == 0) << 2
        )
        ck = self._compiled.get(key)
        hooks = _knobs.runtime
        if ck is None or hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls:
            ck = self._launch_jit(args)
            if ck is not None and all(hasattr(ck, a) for a in ("function", "packed_metadata")):
                self._compiled[key] = ck
            return y, ro, rstd
        stream = _current_stream(self.device.index)
        ck.run(self.grid, 1, 1, stream, ck.function, ck.packed_metadata, None,
               hooks.launch_enter_hook, hooks.launch_exit_hook, *args)  # fmt: skip
        return y, ro, rstd

    def _launch_jit(self, args: tuple) -> object:
        n_meta = len(self._meta)
        return _allreduce_fused_kernel[(self.grid,)](
            *args[:-n_meta],
            WORLD=self._meta[0],
            WORLD_P2=self._meta[1],
            BLOCK_H=self._meta[2],
            TWO_SHOT=self._meta[3],
            HAS_RESIDUAL=self._meta[4],
            HAS_NORM=self._meta[5],
            STORE_RSTD=self._meta[6],
            num_warps=self._num_warps,
        )


def _current_stream(device_index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device_index)


def allreduce_fused(
    x: torch.Tensor,  # [T, H] bf16 / fp16 / fp32, contiguous
    residual: torch.Tensor | None,  # [T, H] like x, or None
    weight: torch.Tensor | None,  # [H] (x's dtype or fp32), or None for no norm
    eps: float,
    *,
    peer_bases: torch.Tensor,  # [W] int64 on x's device
    epochs: torch.Tensor,  # [≥ CTL_WORDS] int32 on x's device (launch epoch, arrival counter)
    rank: int,
    algo: str,  # "one_shot" | "two_shot"
    max_programs: int,
    half_bytes: int,  # bytes between the two data halves (:func:`half_bytes` of the capacity)
    store_rstd: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """One-off launch (builds a :class:`FusedAllreducePlan` and calls it).

    Returns ``(normed | None, residual_out, rstd | None)``. Without ``residual`` and ``weight``
    this is a plain all-reduce (``residual_out`` = Σ_r x_r). ``T·H·e`` must fit in ``half_bytes``;
    the caller checks.
    """
    T, H = x.shape
    plan = FusedAllreducePlan(
        T=T, H=H, dtype=x.dtype, device=x.device, has_residual=residual is not None,
        has_norm=weight is not None, store_rstd=store_rstd, peer_bases=peer_bases, ctl=epochs,
        rank=rank, algo=algo, max_programs=max_programs, half_bytes=half_bytes,
    )  # fmt: skip
    return plan(x, residual, weight, eps)
