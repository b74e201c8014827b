"""Top-k routing after the router's logits GEMM: scores, (group-limited, biased) expert
selection, normalised probs and per-expert counts in one kernel; the logits gradient in one.

The math is :mod:`moekit.reference.router`'s. Each program takes ``BLOCK_T`` tokens with all E
logits in registers. Selection is k rounds of a row-wise argmax (ties to the lower expert id),
each taking its expert out with −inf; scores are clamped to at least ``LOWEST_SCORE`` first (NaN
too), so an expert not yet taken always outranks a taken one and every token gets k distinct
experts in [0, E).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekit.runtime.intmath import cdiv, next_power_of_2
from moekit.runtime.replay import launch
from moekit.tuning.router import RouterConfig

__all__ = ["LOWEST_SCORE", "SIGMOID_EPS", "topk_routing_bwd", "topk_routing_fwd"]

# Selection scores are clamped to at least this (NaN included), so that an expert not yet taken
# always outranks one already taken: every token gets k distinct, in-range experts.
LOWEST_SCORE = -3.0e38
# Added to the sum of the selected sigmoid scores before normalising (as DeepSeek-V3 does).
SIGMOID_EPS = 1e-20


@triton.jit
def _tile_scores(logits_ptr, T, E, stride_l, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                 SIGMOID: tl.constexpr):  # fmt: skip
    """The program's [BLOCK_T, BLOCK_E] tile of scores (0 outside [T, E)): returns
    (rows, cols, rmask, cmask, mask, scores)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    rmask, cmask = rows < T, cols < E
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(
        logits_ptr + rows[:, None].to(tl.int64) * stride_l + cols[None, :],
        mask=mask, other=float("-inf"),
    ).to(tl.float32)  # fmt: skip
    x = tl.where(rows[:, None] < T, x, 0.0)  # rows past T: finite (never stored)
    if SIGMOID:
        s = tl.sigmoid(x)
    else:
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        s = e / tl.sum(e, axis=1)[:, None]
    return rows, cols, rmask, cmask, mask, tl.where(mask, s, 0.0)


@triton.jit
def _group_limit(
    sel, cols, cmask, LOWEST, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
    NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr,
):  # fmt: skip
    """sel with experts outside each token's TOPK_GROUPS best groups set to LOWEST; a group's
    score is the sum of its two highest sel."""
    grp = cols // GROUP_SIZE
    gidx = tl.arange(0, BLOCK_G)
    gscore = tl.full([BLOCK_T, BLOCK_G], float("-inf"), tl.float32)
    for g in tl.static_range(NUM_GROUPS):
        v = tl.where((grp == g)[None, :], sel, float("-inf"))
        first = tl.argmax(v, axis=1)
        m1 = tl.max(v, axis=1)
        m2 = tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), v), axis=1)
        gscore = tl.where(gidx[None, :] == g, tl.maximum(m1 + m2, LOWEST)[:, None], gscore)
    keep = tl.zeros([BLOCK_T, cols.shape[0]], dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUPS):
        best = tl.argmax(gscore, axis=1)
        keep = keep | (grp[None, :] == best[:, None])
        gscore = tl.where(gidx[None, :] == best[:, None], float("-inf"), gscore)
    return tl.where(keep | ~cmask[None, :], sel, LOWEST)


@triton.jit
def _zero_counts_kernel(counts_ptr, E, BLOCK_E: tl.constexpr):
    cols = tl.arange(0, BLOCK_E)
    tl.store(counts_ptr + cols, tl.zeros([BLOCK_E], dtype=tl.int32), mask=cols < E)


@triton.jit
def _topk_routing_fwd_kernel(
    logits_ptr, bias_ptr,  # in: [T, E] (unit stride along E), [E] fp32
    probs_ptr, idx_ptr, counts_ptr,  # out: [T, K] fp32, [T, K] int32, [E] int32 (added to)
    T, E, stride_l, scaling,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
    NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, LOWEST: tl.constexpr, EPS: tl.constexpr,
):  # fmt: skip
    rows, cols, rmask, cmask, _, s = _tile_scores(
        logits_ptr, T, E, stride_l, BLOCK_T, BLOCK_E, SIGMOID
    )
    sel = s
    if HAS_BIAS:
        sel = sel + tl.load(bias_ptr + cols, mask=cmask, other=0.0)[None, :]
    sel = tl.where(sel != sel, LOWEST, tl.maximum(sel, LOWEST))
    if NUM_GROUPS > 0:
        sel = _group_limit(
            sel, cols, cmask, LOWEST, BLOCK_T, BLOCK_G, NUM_GROUPS, TOPK_GROUPS, GROUP_SIZE
        )
    sel = tl.where(cmask[None, :], sel, float("-inf"))  # padding is never taken
    kcols = tl.arange(0, BLOCK_K)
    pk = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    ik = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    taken = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.argmax(sel, axis=1)
        hit = cols[None, :] == best[:, None]
        pk = tl.where(kcols[None, :] == j, tl.sum(tl.where(hit, s, 0.0), axis=1)[:, None], pk)
        ik = tl.where(kcols[None, :] == j, best[:, None], ik)
        sel = tl.where(hit, float("-inf"), sel)
        taken += hit.to(tl.int32)
    # one atomic per expert and program: per-token atomics on E addresses serialise
    per_expert = tl.sum(tl.where(rmask[:, None], taken, 0), axis=0)
    tl.atomic_add(counts_ptr + cols, per_expert, mask=cmask & (per_expert > 0))
    if NORMALIZE:
        pk = pk / (tl.sum(pk, axis=1) + EPS)[:, None]
    pk = pk * scaling
    kmask = rmask[:, None] & (kcols < K)[None, :]
    offs = rows[:, None].to(tl.int64) * K + kcols[None, :]
    tl.store(probs_ptr + offs, pk, mask=kmask)
    tl.store(idx_ptr + offs, ik, mask=kmask)


@triton.jit
def _topk_routing_bwd_kernel(
    logits_ptr, idx_ptr, grad_ptr,  # in: [T, E], [T, K] int32, [T, K] (d probs)
    dlogits_ptr,  # out: [T, E] (unit stride along E)
    T, E, stride_l, stride_dl, scaling,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    SIGMOID: tl.constexpr, NORMALIZE: tl.constexpr, EPS: tl.constexpr,
):  # fmt: skip
    rows, cols, rmask, _, mask, s = _tile_scores(
        logits_ptr, T, E, stride_l, BLOCK_T, BLOCK_E, SIGMOID
    )
    kcols = tl.arange(0, BLOCK_K)
    kmask = rmask[:, None] & (kcols < K)[None, :]
    offs = rows[:, None].to(tl.int64) * K + kcols[None, :]
    idx = tl.load(idx_ptr + offs, mask=kmask, other=0)
    g = tl.load(grad_ptr + offs, mask=kmask, other=0.0).to(tl.float32)
    sk = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(K):
        ij = tl.sum(tl.where(kcols[None, :] == j, idx, 0), axis=1)
        skj = tl.sum(tl.where(cols[None, :] == ij[:, None], s, 0.0), axis=1)
        sk = tl.where(kcols[None, :] == j, skj[:, None], sk)
    if NORMALIZE:
        S = tl.sum(sk, axis=1) + EPS
        dot = tl.sum(g * sk, axis=1) / S
        dsk = (scaling / S)[:, None] * (g - dot[:, None])
    else:
        dsk = scaling * g
    ds = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for j in tl.static_range(K):
        ij = tl.sum(tl.where(kcols[None, :] == j, idx, 0), axis=1)
        dj = tl.sum(tl.where(kcols[None, :] == j, dsk, 0.0), axis=1)
        ds = tl.where(cols[None, :] == ij[:, None], ds + dj[:, None], ds)
    if SIGMOID:
        dl = ds * s * (1.0 - s)
    else:
        dl = s * (ds - tl.sum(s * ds, axis=1)[:, None])
    ptrs = dlogits_ptr + rows[:, None].to(tl.int64) * stride_dl + cols[None, :]
    tl.store(ptrs, dl.to(dlogits_ptr.dtype.element_ty), mask=mask)


def _routing_launch(
    T: int, k: int, score: str, normalize: bool, config: RouterConfig
) -> tuple[tuple[int], dict]:
    """(grid, meta) that the forward and backward routing launches share."""
    sigmoid = score == "sigmoid"
    meta = dict(
        K=k, BLOCK_T=config.block_t, BLOCK_E=config.block_e, BLOCK_K=next_power_of_2(k),
        SIGMOID=sigmoid, NORMALIZE=normalize, EPS=SIGMOID_EPS if sigmoid else 0.0,
        num_warps=config.num_warps,
    )  # fmt: skip
    return (cdiv(T, config.block_t),), meta


def topk_routing_fwd(
    logits: torch.Tensor,  # [T, E], unit stride along E
    expert_bias: torch.Tensor | None,  # [E] fp32 contiguous
    probs: torch.Tensor,  # [T, k] fp32 out
    indices: torch.Tensor,  # [T, k] int32 out
    counts: torch.Tensor,  # [E] int32 out, contiguous
    score: str,
    num_groups: int | None,
    topk_groups: int | None,
    normalize: bool,
    scaling: float,
    config: RouterConfig,
) -> None:
    T, E = logits.shape
    k = probs.shape[1]
    groups = num_groups or 0
    # The routing programs add their selections to counts: zero it first, with a launch of our
    # own that is replayed with the routing launch (torch.zeros would go through the dispatcher
    # on every call).
    launch(_zero_counts_kernel, (1,), counts, E, BLOCK_E=config.block_e, num_warps=1)
    grid, meta = _routing_launch(T, k, score, normalize, config)
    launch(
        _topk_routing_fwd_kernel, grid,
        logits, expert_bias if expert_bias is not None else logits, probs, indices, counts,
        T, E, logits.stride(0), float(scaling),
        HAS_BIAS=expert_bias is not None, NUM_GROUPS=groups, TOPK_GROUPS=topk_groups or 0,
        GROUP_SIZE=E // groups if groups else 1, BLOCK_G=next_power_of_2(max(groups, 1)),
        LOWEST=LOWEST_SCORE, **meta,
    )  # fmt: skip


def topk_routing_bwd(
    logits: torch.Tensor,  # [T, E], unit stride along E
    indices: torch.Tensor,  # [T, k] int32 contiguous
    grad_probs: torch.Tensor,  # [T, k] contiguous
    dlogits: torch.Tensor,  # [T, E] out, unit stride along E
    score: str,
    normalize: bool,
    scaling: float,
    config: RouterConfig,
) -> None:
    T, E = logits.shape
    grid, meta = _routing_launch(T, indices.shape[1], score, normalize, config)
    launch(
        _topk_routing_bwd_kernel, grid,
        logits, indices, grad_probs, dlogits, T, E, logits.stride(0), dlogits.stride(0),
        float(scaling), **meta,
    )  # fmt: skip
