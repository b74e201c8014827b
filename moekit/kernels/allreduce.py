"""All-reduce (+ residual add)(+ RMSNorm) over symmetric memory: one Triton kernel per rank.

Every rank owns one buffer of a symmetric pool (:class:`moekit.distributed.SymmetricPool`),
mapped into every peer's address space. The kernel receives ``peer_bases[W]`` (int64, device),
the address of each rank's buffer as seen from this GPU, casts them with ``tl.pointer_type`` and
reads or writes the peers' memory directly over NVLink. No multicast (``multimem``) instruction
is used anywhere.

Workspace layout inside each pool buffer (bytes, identical on every rank, :class:`Workspace`;
``D = DATA_OFFSET``, ``S`` = half size, ``P`` = Lamport slot size)::

    [0, SIGNAL_BYTES)    signal: int32 flags[NUM_CHANNELS][MAX_BLOCKS][MAX_WORLD]
    [D, D + S)           half 0: every rank's copy of its own x [T, H]   (even launch epochs)
    [D + S, D + 2·S)     half 1: the same                                 (odd launch epochs)
    [L, L + 2·W·P)       Lamport region: slots[2 parities][W ranks][P bytes]

The pool's buffer starts zeroed, which is the initial state of every region: flags below the
first epoch, and every Lamport element empty (the sentinel is +0.0, all bits zero). A call needs
``T·H·e ≤ S`` (:func:`workspace_bytes` = 2·T·H·e); lamport needs ``T·H·e ≤ P`` and
lamport_two_shot ``2·W·⌈T/W⌉·H·e ≤ W·P`` (:meth:`Workspace.lamport_fits`).

Launch epoch: each rank keeps ``ctl[2]`` int32 on the device (the pool's ``epochs``: ``[0]`` the
epoch of the last launch, ``[1]`` an arrival counter). Every program of a launch reads
``E = ctl[0] + 1`` at its start; the last program to finish (counted with one atomic) writes
``ctl[0] = E`` and resets the counter, so all programs of a launch agree on ``E`` and consecutive
launches (eager, or CUDA-graph replays) advance it by one with no reset and no host involvement.
Every rank makes the same calls, so ``E`` is the same on every rank for the same call.

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

two_shot (bandwidth): rows are split into W chunks of C = ⌈T/W⌉; rank q owns chunk q. Scatter:
rank r writes row i of chunk q straight into rank q's half at row r·C + i (slot r; remote stores,
no staging copy of x); barrier; reduce: each rank sums the W slots of its own half (local reads, in
rank order), adds the residual and writes the rounded residual_out into its own slot (row
rank·C + i, already consumed); barrier; all-gather: every rank reads chunk q from rank q's half
(row q·C + i) and normalises every row locally (same code on the same bits → identical outputs).
Two barriers per launch.

lamport (latency, 16-bit dtypes): no barrier at all. Every element of the Lamport region is the
sentinel +0.0 (bits 0) between launches. Rank r writes its rows of x, with ±0.0 replaced by -0.0
(same value in the sum), straight into slot r of every rank's region (remote stores); each rank
then reads its own W slots of the same rows, spinning while any element is still the sentinel,
sums in rank order, adds the residual, normalises, and puts the sentinel back in the slots it
read. Data arrival is the synchronisation: one one-way NVLink trip instead of a barrier round
trip plus remote reads. Slots alternate with the epoch parity: a peer can run at most one launch
ahead (its launch cannot finish without this rank's data for it), so the slots a rank clears
during launch E are next written by launch E + 2, which starts only after launch E here has
finished. fp32 has no spare bit pattern that every input could avoid, so it stays on one_shot.

Programs are persistent (grid ≤ SM count, ≤ MAX_BLOCKS) so that every program of every rank is
co-resident. Launch shapes are chosen in :mod:`moekit.tuning.allreduce`; launches go through
:func:`moekit.runtime.replay.launch`.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from moekit.kernels.rmsnorm import block_h
from moekit.runtime.intmath import cdiv, next_power_of_2
from moekit.runtime.replay import launch
from moekit.tuning.allreduce import LAMPORT_ALGOS, TWO_SHOT_ALGOS, AllreduceConfig

__all__ = [
    "ALGOS",
    "CTL_WORDS",
    "LAMPORT_SENTINEL_BITS",
    "MAX_BLOCKS",
    "MAX_FUSED_H",
    "MAX_WORLD",
    "SIGNAL_BYTES",
    "Workspace",
    "fused_allreduce",
    "workspace",
    "workspace_bytes",
]

# Constants of the workspace layout above.
MAX_WORLD = 8  # ranks in one NVLink domain that the flag layout has room for
MAX_BLOCKS = 256  # programs per launch that the flag layout has room for
NUM_CHANNELS = 4  # 2 barriers per launch × 2 epoch parities
SIGNAL_BYTES = NUM_CHANNELS * MAX_BLOCKS * MAX_WORLD * 4
DATA_OFFSET = SIGNAL_BYTES  # 32 KiB, 128-byte aligned
CTL_WORDS = 2  # ctl[0] launch epoch, ctl[1] arrival counter (int32, local to each rank)
MAX_FUSED_H = 16384  # widest row the cross-rank kernels keep in registers
EPOCH_MASK = 0x3FFFFFFF  # epochs wrap inside int32; equality (not ≥) keeps the wrap safe
HALF_ALIGN = 256  # bytes; keeps the second half 16-element aligned for every dtype
LAMPORT_ALIGN = 256  # bytes; Lamport slots start aligned like the halves
LAMPORT_SENTINEL_BITS = 0  # int16 view of bf16/fp16 +0.0: "not written yet" (a zeroed buffer)
NEG_ZERO_BITS = -32768  # int16 view of bf16/fp16 -0.0 (0x8000), sent in place of ±0.0

# the same numbers as constexpr, for use inside @triton.jit functions
_MAX_WORLD = tl.constexpr(MAX_WORLD)
_MAX_BLOCKS = tl.constexpr(MAX_BLOCKS)
_DATA_OFFSET = tl.constexpr(DATA_OFFSET)
_EPOCH_MASK = tl.constexpr(EPOCH_MASK)
_LAMPORT_SENTINEL_BITS = tl.constexpr(LAMPORT_SENTINEL_BITS)
_NEG_ZERO_BITS = tl.constexpr(NEG_ZERO_BITS)

ALGOS = ("one_shot", "two_shot", "lamport", "lamport_two_shot")


def workspace_bytes(T: int, H: int, element_size: int, algo: str, world: int = 1) -> int:
    """Bytes of the data halves a call needs (both halves; the signal region is extra).

    one_shot stages ``x`` into one half; two_shot scatters it into the owners' halves in ``world``
    slots of ⌈T / world⌉ rows (and writes its reduced chunk in place); lamport uses its own slots.
    """
    rows = T
    if algo == "two_shot":
        rows = -(-T // world) * world
    elif algo in LAMPORT_ALGOS:
        rows = 0
    n = rows * H * element_size
    return 2 * ((n + HALF_ALIGN - 1) // HALF_ALIGN * HALF_ALIGN)


@dataclasses.dataclass(frozen=True)
class Workspace:
    """Where the all-reduce's regions lie in every rank's pool buffer (see the module docstring)."""

    half_bytes: int  # bytes of each data half (the most one call can stage)
    lamport_offset: int  # byte offset of the Lamport region
    lamport_slot_bytes: int  # bytes of one Lamport slot; 0: no Lamport region

    def fits(self, T: int, H: int, element_size: int, algo: str, world: int) -> bool:
        """Whether a one_shot / two_shot call's data fits a half (always for lamport)."""
        return workspace_bytes(T, H, element_size, algo, world) // 2 <= self.half_bytes

    def lamport_fits(self, T: int, H: int, element_size: int, algo: str, world: int) -> bool:
        """Whether a ``lamport`` / ``lamport_two_shot`` call fits the slots (16-bit only):
        one-shot needs T·H·e per slot; two-shot 2·W·⌈T/W⌉·H·e in all (scatter + gather)."""
        if element_size != 2:
            return False
        if algo == "lamport":
            return T * H * element_size <= self.lamport_slot_bytes
        return 2 * world * (-(-T // world)) * H * element_size <= world * self.lamport_slot_bytes


def workspace(nbytes: int, world: int, lamport_slot_bytes: int) -> Workspace | None:
    """The workspace in a pool buffer of ``nbytes``: the signal region, the Lamport region of
    ``2·world`` slots of ``lamport_slot_bytes`` (rounded down to LAMPORT_ALIGN; none when the
    buffer has no room for it), and two halves of what remains. None when the buffer cannot
    even hold the signal region."""
    if nbytes < SIGNAL_BYTES:
        return None
    slot = max(lamport_slot_bytes, 0) // LAMPORT_ALIGN * LAMPORT_ALIGN
    if SIGNAL_BYTES + 2 * world * slot > nbytes:
        slot = 0
    half = (nbytes - SIGNAL_BYTES - 2 * world * slot) // 2 // HALF_ALIGN * HALF_ALIGN
    return Workspace(half, DATA_OFFSET + 2 * half, slot)


@triton.jit
def _sync_peers(
    peer_bases_ptr,  # [W] int64: address of each rank's symmetric buffer
    rank, channel, epoch,  # channel: this barrier's flag channel (depends on the epoch's parity)
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
):  # fmt: skip
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
    peer_bases_ptr, half_off,
    offset,  # element offset of the row inside a half (int64)
    cols, mask, dtype: tl.constexpr, WORLD: tl.constexpr,
):  # fmt: skip
    """fp32 Σ_r buf_r[offset + cols] in rank order 0…W−1 (the order every rank uses)."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for r in tl.static_range(WORLD):
        src = _data_ptr(peer_bases_ptr, r, half_off, dtype) + offset
        acc += tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _lamport_slot(peer_bases_ptr, r, byte_off, dtype: tl.constexpr):
    """Typed pointer ``byte_off`` bytes into rank ``r``'s buffer (a Lamport slot; 16-byte
    aligned like the halves)."""
    base = (tl.load(peer_bases_ptr + r) + byte_off).to(tl.pointer_type(dtype))
    return tl.multiple_of(base, 16)


@triton.jit
def _lamport_gather(
    own_slots,  # byte offset of the first slot in the own buffer (int64)
    own_base,  # int64 address of the own buffer
    slot_stride,  # bytes between consecutive slots
    offset,  # element offset of the row inside a slot (int64)
    cols, mask, dtype: tl.constexpr, SLOTS: tl.constexpr,
):  # fmt: skip
    """(fp32 Σ_r slot_r[offset + cols] over r = 0…SLOTS−1 in order, number of elements still
    holding the sentinel). Volatile loads: peers write these slots over NVLink behind the L1."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    empty = tl.zeros(cols.shape, dtype=tl.int32)
    for r in tl.static_range(SLOTS):
        src = (own_base + own_slots + r * slot_stride).to(tl.pointer_type(dtype))
        src = tl.multiple_of(src, 16) + offset
        v = tl.load(src + cols, mask=mask, other=0.0, volatile=True)
        empty += ((v.to(tl.int16, bitcast=True) == _LAMPORT_SENTINEL_BITS) & mask).to(tl.int32)
        acc += v.to(tl.float32)
    return acc, tl.sum(empty, axis=0)


@triton.jit
def _lamport_wait_sum(own_slots, own_base, slot_stride, offset, cols, mask, dtype: tl.constexpr,
                      SLOTS: tl.constexpr):  # fmt: skip
    """Spin until SLOTS rows have landed, sum them in order (fp32), put the sentinel back (the
    next launch writing these rows is launch E + 2, which starts after this one finished)."""
    acc, pending = _lamport_gather(
        own_slots, own_base, slot_stride, offset, cols, mask, dtype, SLOTS
    )
    while pending > 0:  # some row has not fully landed yet: read all of them again
        acc, pending = _lamport_gather(
            own_slots, own_base, slot_stride, offset, cols, mask, dtype, SLOTS
        )
    empty_row = tl.full(cols.shape, _LAMPORT_SENTINEL_BITS, tl.int16).to(dtype, bitcast=True)
    for r in tl.static_range(SLOTS):
        dst = (own_base + own_slots + r * slot_stride).to(tl.pointer_type(dtype))
        tl.store(tl.multiple_of(dst, 16) + offset + cols, empty_row, mask=mask)
    return acc


@triton.jit
def _not_sentinel(v):
    """+0.0 (all bits zero) marks an empty Lamport element: send -0.0 instead (the same value
    in every sum, since the readers' fp32 accumulators start at +0.0)."""
    neg_zero = tl.full(v.shape, _NEG_ZERO_BITS, tl.int16).to(v.dtype, bitcast=True)
    return tl.where(v == 0, neg_zero, v)


@triton.jit
def _norm_store(
    v, w,  # [BLOCK_H]: rounded residual_out in the input dtype, fp32 weight
    row, cols, cmask, rmask,  # row: int64; rmask: scalar row < T
    y_ptr, rstd_ptr, stride_y_t, H, eps, STORE_RSTD: tl.constexpr,
):  # fmt: skip
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
    # in: x [T, H] this rank's partial sum, residual [T, H] (HAS_RESIDUAL), w [H] (HAS_NORM)
    x_ptr, res_ptr, w_ptr,
    # out: ro [T, H] = Σ_r x_r (+ residual), y [T, H] = RMSNorm(ro) · w (HAS_NORM),
    # rstd [T] fp32 (STORE_RSTD)
    ro_ptr, y_ptr, rstd_ptr,
    # [W] int64 symmetric-buffer addresses; int32 [CTL_WORDS]: launch epoch, arrival counter
    peer_bases_ptr, ctl_ptr,
    T, H, rows_per_rank, rank,  # sizes; rows_per_rank: C = ⌈T / W⌉ (two_shot)
    # bytes: between the two data halves; to the Lamport region; of one Lamport slot
    half_bytes, lamport_off, slot_bytes,
    eps,
    stride_x_t, stride_res_t, stride_ro_t, stride_y_t,  # strides (elements)
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr, BLOCK_H: tl.constexpr,  # meta
    TWO_SHOT: tl.constexpr, LAMPORT: tl.constexpr,
    SPLIT: tl.constexpr,  # lamport: column pieces per row in the push phases
    GATHER_TILE: tl.constexpr,  # two_shot: gather all W rows of an index as one [W, H] tile
    HAS_RESIDUAL: tl.constexpr, HAS_NORM: tl.constexpr, STORE_RSTD: tl.constexpr,
):  # fmt: skip
    """ro = round(Σ_r x_r + residual) (fp32 sum in rank order); y = RMSNorm(ro) · w."""
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    BLOCK_S: tl.constexpr = BLOCK_H // SPLIT
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

    if LAMPORT:
        tl.static_assert(dtype.primitive_bitwidth == 16, "lamport needs a 16-bit dtype")
        own_base = tl.load(peer_bases_ptr + rank)
        slots = lamport_off + (parity * WORLD).to(tl.int64) * slot_bytes  # this launch's region
        if not TWO_SHOT:
            # one-shot: row t of rank r goes to slot r of every rank; each rank sums its W slots
            # (pushed in column pieces: SPLIT× more programs share the remote stores)
            for u in range(pid, T * SPLIT, num_progs):
                r64 = tl.cast(u // SPLIT, tl.int64)
                cs = (u % SPLIT) * BLOCK_S + tl.arange(0, BLOCK_S)
                ms = cs < H
                v = _not_sentinel(tl.load(x_ptr + r64 * stride_x_t + cs, mask=ms, other=0.0))
                for q in tl.static_range(WORLD):
                    dst = _lamport_slot(peer_bases_ptr, q, slots + rank * slot_bytes, dtype)
                    tl.store(dst + r64 * H64 + cs, v, mask=ms)
            for row in range(pid, T, num_progs):
                r64 = tl.cast(row, tl.int64)
                if HAS_RESIDUAL:
                    res = tl.load(res_ptr + r64 * stride_res_t + cols, mask=cmask, other=0.0)
                acc = _lamport_wait_sum(slots, own_base, slot_bytes, r64 * H64, cols, cmask,
                                        dtype, WORLD)  # fmt: skip
                if HAS_RESIDUAL:
                    acc += res.to(tl.float32)
                v = acc.to(dtype)
                tl.store(ro_ptr + r64 * stride_ro_t + cols, v, mask=cmask)
                if HAS_NORM:
                    _norm_store(v, w, r64, cols, cmask, True, y_ptr, rstd_ptr, stride_y_t, H,
                                eps, STORE_RSTD)  # fmt: skip
        else:
            # two-shot: rows [r·C + i] of a region are rank r's share of this rank's chunk
            # (scatter), rows [W·C + q·C + i] the reduced chunk q from its owner (gather)
            C64 = tl.cast(rows_per_rank, tl.int64)
            chunk_bytes = C64 * H64 * dtype.primitive_bitwidth // 8
            gather = slots + WORLD * chunk_bytes
            # scatter and reduce work in column pieces (no norm there): SPLIT× more programs
            for u in range(pid, rows_per_rank * SPLIT, num_progs):
                i = u // SPLIT
                cs = (u % SPLIT) * BLOCK_S + tl.arange(0, BLOCK_S)
                for q in tl.static_range(WORLD):
                    r64 = tl.cast(q * rows_per_rank + i, tl.int64)
                    m = (cs < H) & (r64 < T)
                    v = _not_sentinel(tl.load(x_ptr + r64 * stride_x_t + cs, mask=m, other=0.0))
                    dst = _lamport_slot(peer_bases_ptr, q, slots, dtype)
                    tl.store(dst + (rank * C64 + i) * H64 + cs, v, mask=m)
            for u in range(pid, rows_per_rank * SPLIT, num_progs):
                i = u // SPLIT
                cs = (u % SPLIT) * BLOCK_S + tl.arange(0, BLOCK_S)
                r64 = tl.cast(rank * rows_per_rank + i, tl.int64)
                m = (cs < H) & (r64 < T)
                if HAS_RESIDUAL:
                    res = tl.load(res_ptr + r64 * stride_res_t + cs, mask=m, other=0.0)
                acc = _lamport_wait_sum(slots, own_base, chunk_bytes, i * H64, cs, m, dtype,
                                        WORLD)  # fmt: skip
                if HAS_RESIDUAL:
                    acc += res.to(tl.float32)
                v = _not_sentinel(acc.to(dtype))
                for q in tl.static_range(WORLD):
                    dst = _lamport_slot(peer_bases_ptr, q, gather, dtype)
                    tl.store(dst + (rank * C64 + i) * H64 + cs, v, mask=m)
            # gather + norm, whole rows. With SPLIT > 1 (GPU only: every program co-resident)
            # the rows are dealt over the whole grid; with SPLIT == 1 program p handles the rows
            # that program p of every owner reduced, so the interpreter, which runs programs one
            # after another, never waits on a program that has not run yet.
            n_units = T if SPLIT > 1 else rows_per_rank
            for u in range(pid, n_units, num_progs):
                for k in tl.static_range(1 if SPLIT > 1 else WORLD):
                    if SPLIT > 1:
                        q = u // rows_per_rank
                        i = u % rows_per_rank
                    else:
                        q = k
                        i = u
                    r64 = tl.cast(q * rows_per_rank + i, tl.int64)
                    rmask = r64 < T
                    m = cmask & rmask
                    acc = _lamport_wait_sum(gather + q * chunk_bytes, own_base, 0, i * H64, cols,
                                            m, dtype, 1)  # fmt: skip
                    v = acc.to(dtype)
                    tl.store(ro_ptr + r64 * stride_ro_t + cols, v, mask=m)
                    if HAS_NORM:
                        _norm_store(v, w, r64, cols, cmask, rmask, y_ptr, rstd_ptr, stride_y_t,
                                    H, eps, STORE_RSTD)  # fmt: skip
    elif not TWO_SHOT:
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
        C64 = tl.cast(rows_per_rank, tl.int64)
        # scatter: row i of chunk q goes straight into slot `rank` of rank q's half (row
        # rank·C + i there): the reduce below then reads only local memory, and x is not first
        # copied into the own buffer
        for i in range(pid, rows_per_rank, num_progs):
            for q in tl.static_range(WORLD):
                r64 = tl.cast(q * rows_per_rank + i, tl.int64)
                m = cmask & (r64 < T)
                v = tl.load(x_ptr + r64 * stride_x_t + cols, mask=m)
                dst = _data_ptr(peer_bases_ptr, q, half_off, dtype)
                tl.store(dst + (rank * C64 + i) * H64 + cols, v, mask=m)
        _sync_peers(peer_bases_ptr, rank, channel, epoch, WORLD, WORLD_P2)
        # reduce-scatter: the rows of the own chunk, written back in place (rounded)
        for i in range(pid, rows_per_rank, num_progs):
            r64 = tl.cast(rank * rows_per_rank + i, tl.int64)
            m = cmask & (r64 < T)
            if HAS_RESIDUAL:
                res = tl.load(res_ptr + r64 * stride_res_t + cols, mask=m, other=0.0)
            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
            for r in tl.static_range(WORLD):  # Σ_r slot r, row i of the own half, in rank order
                src = own_in + (r * C64 + i) * H64
                acc += tl.load(src + cols, mask=m, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                acc += res.to(tl.float32)
            # (row rank·C + i is slot `rank`, this rank's own, already summed)
            tl.store(own_in + r64 * H64 + cols, acc.to(dtype), mask=m)
        _sync_peers(peer_bases_ptr, rank, channel + 1, epoch, WORLD, WORLD_P2)
        # all-gather + local norm of every row
        if GATHER_TILE:
            # one [W, H] tile per step: the W rows (W − 1 of them remote) are all in flight
            # before the norm's row reductions, which a row-by-row loop would serialise (no load
            # can move across the CTA barrier inside a reduction)
            qs = tl.arange(0, WORLD_P2)
            qmask = qs < WORLD
            bases = tl.load(peer_bases_ptr + qs, mask=qmask, other=0)
            srcs = tl.multiple_of((bases + _DATA_OFFSET + half_off).to(tl.pointer_type(dtype)), 16)
            for i in range(pid, rows_per_rank, num_progs):
                rows = qs.to(tl.int64) * C64 + i
                rmask2 = qmask & (rows < T)
                m2 = rmask2[:, None] & cmask[None, :]
                v = tl.load(srcs[:, None] + rows[:, None] * H64 + cols[None, :], mask=m2, other=0.0)
                tl.store(ro_ptr + rows[:, None] * stride_ro_t + cols[None, :], v, mask=m2)
                if HAS_NORM:
                    vf = v.to(tl.float32)
                    rstd = tl.math.rsqrt(tl.sum(vf * vf, axis=1) / H + eps)
                    y = (vf * rstd[:, None] * w[None, :]).to(dtype)
                    tl.store(y_ptr + rows[:, None] * stride_y_t + cols[None, :], y, mask=m2)
                    if STORE_RSTD:
                        tl.store(rstd_ptr + rows, rstd, mask=rmask2)
        else:
            for i in range(pid, rows_per_rank, num_progs):
                for q in tl.static_range(WORLD):
                    r64 = tl.cast(q * rows_per_rank + i, tl.int64)
                    rmask = r64 < T
                    m = cmask & rmask
                    src = _data_ptr(peer_bases_ptr, q, half_off, dtype)
                    v = tl.load(src + r64 * H64 + cols, mask=m, other=0.0)
                    tl.store(ro_ptr + r64 * stride_ro_t + cols, v, mask=m)
                    if HAS_NORM:
                        _norm_store(v, w, r64, cols, cmask, rmask, y_ptr, rstd_ptr, stride_y_t,
                                    H, eps, STORE_RSTD)  # fmt: skip
    _advance_epoch(ctl_ptr, epoch)


def fused_allreduce(
    x: torch.Tensor,  # [T, H], T > 0, unit column stride
    residual: torch.Tensor | None,  # [T, H] like x, or None
    weight: torch.Tensor | None,  # [H] (x's dtype or fp32), or None for no norm
    ro: torch.Tensor,  # [T, H] out: Σ_r x_r (+ residual)
    y: torch.Tensor | None,  # [T, H] out: RMSNorm(ro) · weight (with weight)
    rstd: torch.Tensor | None,  # [T] fp32 out, or None
    peer_bases: torch.Tensor,  # [W] int64: every rank's pool buffer, as seen from this GPU
    epochs: torch.Tensor,  # [≥ CTL_WORDS] int32: this rank's launch epoch, arrival counter
    eps: float,
    *,
    rank: int,
    algo: str,  # one of ALGOS
    space: Workspace,
    config: AllreduceConfig,
) -> None:
    """Launch the fused kernel: ``ro = round(Σ_r x_r + residual)`` (fp32 sum in rank order),
    ``y = RMSNorm(ro) · weight``. Every rank of ``peer_bases`` must make the same call."""
    T, H = x.shape
    world = peer_bases.numel()
    launch(
        _allreduce_fused_kernel, (config.grid,),
        x, residual if residual is not None else x, weight if weight is not None else x, ro,
        y if y is not None else ro, rstd if rstd is not None else ro, peer_bases, epochs,
        T, H, cdiv(T, world), rank, space.half_bytes, space.lamport_offset,
        space.lamport_slot_bytes, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0, ro.stride(0),
        y.stride(0) if y is not None else 0,
        WORLD=world, WORLD_P2=next_power_of_2(world), BLOCK_H=block_h(H),
        TWO_SHOT=algo in TWO_SHOT_ALGOS, LAMPORT=algo in LAMPORT_ALGOS,
        SPLIT=config.split, GATHER_TILE=config.gather_tile,
        HAS_RESIDUAL=residual is not None, HAS_NORM=weight is not None,
        STORE_RSTD=rstd is not None,
        num_warps=config.num_warps,
    )  # fmt: skip
