"""Tensor-parallel all-reduce fused with residual add and RMSNorm.

In a tensor-parallel block the row-parallel projection leaves a partial sum ``x`` on every rank;
the next step is ``residual_out = all_reduce(x) + residual`` and ``normed = RMSNorm(residual_out)``.
:func:`allreduce_add_rmsnorm` does all three in one kernel per rank that reads the peers' copies
of ``x`` straight from symmetric memory (:mod:`moekit.kernels.allreduce`); :func:`allreduce_add`
and :func:`allreduce` run through the same machinery.

Algorithms (``algo=``):
  - ``"one_shot"``: every rank reads all peers (lowest latency, small messages);
  - ``"two_shot"``: reduce-scatter + all-gather inside one kernel (large messages, W ≥ 4);
  - ``"nccl"``: ``torch.distributed.all_reduce`` then the local fused add + RMSNorm kernel;
  - ``"reference"``: all_gather + fp32 sum in rank order (the oracle; any backend);
  - ``"auto"``: one_shot / two_shot / nccl by message size and world size (see :func:`auto_algo`);
    CPU tensors take the reference.
When symmetric memory is unavailable or the call does not fit the pool, one_shot/two_shot fall
back to ``"nccl"`` with a one-time warning.

Numerics: fp32 accumulation, summed in rank order 0…W−1 and rounded once, so every rank gets
bit-identical outputs (the NCCL path relies on NCCL's identical results on all ranks).

Autograd (Megatron row-parallel semantics): the forward all-reduce sums partial products of a
row-parallel linear; the gradient flowing back into it is already the full, replicated gradient of
the sum on every rank, so the all-reduce's backward is the **identity** (no communication). The
add + RMSNorm backward is local (fused kernel): ``dx = d_residual = dr`` and ``dweight`` is the
local weight gradient, identical on every rank because the normalised activations are replicated.
If the weight is not replicated (sequence parallel), reduce its gradient yourself.

Group of size 1: no communication, just the local add + RMSNorm.
No host synchronisation on the CUDA path; the pool is created (collectively) on the first call,
which must therefore happen before CUDA-graph capture.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist

from moekit.config import env_kib
from moekit.distributed.symmetric_pool import SymmetricPool, get_pool
from moekit.kernels import allreduce as _kar
from moekit.kernels import rmsnorm as _krn
from moekit.ops._dispatch import use_triton
from moekit.ops.rmsnorm import add_rmsnorm, validate_norm_inputs
from moekit.reference.allreduce import gather_allreduce_ref
from moekit.reference.rmsnorm import add_rmsnorm_bwd_ref, add_rmsnorm_ref

__all__ = [
    "allreduce",
    "allreduce_add",
    "allreduce_add_rmsnorm",
    "auto_algo",
    "set_auto_thresholds",
]

ALGOS = ("auto", "one_shot", "two_shot", "nccl", "reference")
_SYMM_ALGOS = ("one_shot", "two_shot")

# ----------------------------------------------------------------------------------------------
# algorithm selection
# ----------------------------------------------------------------------------------------------

# Cost model behind the default: one_shot moves (W−1)·N bytes into each GPU, two_shot 2(W−1)/W·N
# plus one more barrier. With ≈ 3 µs per extra barrier and ≈ 450 GB/s NVLink ingress per H100/H200,
# two_shot wins above N ≈ 3e-6 · 450e9 / ((W−1)(1 − 2/W)): never for W = 2, ≈ 0.9 MB for W = 4,
# ≈ 0.26 MB for W = 8. Above ``two_shot_max`` NCCL is used. Tune with set_auto_thresholds() or
# MOEKIT_AR_ONE_SHOT_MAX_KB / MOEKIT_AR_TWO_SHOT_MAX_KB (the benchmark prints suggested values).
_BARRIER_S = 3e-6
_NVLINK_BPS = 450e9
_overrides: dict[str, int | None] = {"one_shot_max": None, "two_shot_max": None}


def set_auto_thresholds(
    one_shot_max_bytes: int | None = None, two_shot_max_bytes: int | None = None
) -> None:
    """Override ``auto``: one_shot up to ``one_shot_max_bytes``, two_shot up to
    ``two_shot_max_bytes``, NCCL above (``None`` restores the default / environment)."""
    _overrides["one_shot_max"] = one_shot_max_bytes
    _overrides["two_shot_max"] = two_shot_max_bytes


def auto_algo(nbytes: int, world_size: int) -> str:
    """The algorithm ``auto`` picks for a message of ``nbytes`` (T·H·element size)."""
    one_max = _overrides["one_shot_max"]
    if one_max is None:
        one_max = env_kib("MOEKIT_AR_ONE_SHOT_MAX_KB")
    if one_max is None:
        gain = (world_size - 1) * (1.0 - 2.0 / world_size)
        one_max = math.inf if gain <= 0 else _BARRIER_S * _NVLINK_BPS / gain
    two_max = _overrides["two_shot_max"]
    if two_max is None:
        two_max = env_kib("MOEKIT_AR_TWO_SHOT_MAX_KB")
    if two_max is None:
        two_max = math.inf
    if nbytes <= one_max:
        return "one_shot"
    if nbytes <= two_max:
        return "two_shot"
    return "nccl"


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _symm_unusable(pool: SymmetricPool, x: torch.Tensor, algo: str) -> tuple[str, str]:
    """("", "") when the symmetric kernels can run this call, else (warning key, reason)."""
    T, H = x.shape
    if not pool.available:
        return "unavailable", f"symmetric memory unavailable: {pool.reason}"
    if H > _kar.MAX_FUSED_H:
        return "wide", f"H = {H} > {_kar.MAX_FUSED_H}, the widest row the fused kernels hold"
    if (H * x.element_size()) % 16:
        return "align", f"rows of H = {H} × {x.element_size()} B are not a multiple of 16 bytes"
    need = _kar.workspace_bytes(T, H, x.element_size(), algo)
    if not pool.fits(need):
        return "small", (
            f"{algo} needs {need} B of symmetric memory, the pool has {pool.capacity} B "
            "(raise MOEKIT_SYMM_POOL_MB or pass a larger SymmetricPool)"
        )
    return "", ""


# ----------------------------------------------------------------------------------------------
# forward paths (no autograd)
# ----------------------------------------------------------------------------------------------


def _rstd_of(ro: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(ro.float().pow(2).mean(-1) + eps)


def _forward(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H]
    weight: torch.Tensor | None,  # [H]
    eps: float,
    group: dist.ProcessGroup,
    algo: str,
    need_rstd: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Returns ``(normed | None, residual_out, rstd | None)``; residual_out is the all-reduce
    itself when there is neither residual nor weight."""
    world = dist.get_world_size(group)
    if not x.is_cuda:
        if algo in _SYMM_ALGOS:
            _warn_once(
                "cpu",
                f"allreduce: algo={algo!r} needs CUDA symmetric memory; CPU tensors use "
                "torch.distributed.all_reduce ('nccl' path) instead",
            )
            algo = "nccl"
        elif algo == "auto":
            algo = "reference"
    if algo == "auto" or algo in _SYMM_ALGOS:
        pool = get_pool(group)
        if algo == "auto":
            algo = auto_algo(x.numel() * x.element_size(), world)
        if algo in _SYMM_ALGOS:
            key, why = _symm_unusable(pool, x, algo)
            if key:
                _warn_once(
                    f"{key}:{getattr(group, 'group_name', id(group))}",
                    f"allreduce: falling back to NCCL ({why})",
                )
                algo = "nccl"
            else:
                return _kar.allreduce_fused(
                    x,
                    residual,
                    weight,
                    eps,
                    peer_bases=pool.peer_bases,
                    epochs=pool.epochs,
                    rank=pool.rank,
                    algo=algo,
                    max_programs=_max_programs(x),
                    store_rstd=need_rstd,
                )
    if algo == "reference":
        normed, ro = gather_allreduce_ref(x, residual, weight, eps, group)
        rstd = _rstd_of(ro, eps) if (need_rstd and weight is not None) else None
        return normed, ro, rstd
    # "nccl": torch.distributed.all_reduce (NCCL on GPUs, gloo on CPU) + local fused epilogue
    summed = x.clone()
    dist.all_reduce(summed, group=group)
    if weight is None:
        if residual is not None:
            summed.add_(residual)
        return None, summed, None
    if use_triton(x):
        return _krn.add_rmsnorm_fwd(summed, residual, weight, eps, store_rstd=need_rstd)
    normed, ro, rstd = add_rmsnorm_ref(summed, residual, weight, eps)
    return normed, ro, rstd


def _max_programs(x: torch.Tensor) -> int:
    from moekit.kernels._runtime import device_sms

    return min(device_sms(x), _kar.MAX_BLOCKS)


class _AllreduceAddRMSNormFn(torch.autograd.Function):
    """Forward: the collective + epilogue. Backward: identity through the all-reduce
    (row-parallel semantics), local add + RMSNorm backward."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, group, algo, need_rstd):
        normed, ro, rstd = _forward(x, residual, weight, eps, group, algo, need_rstd)
        ctx.has_residual = residual is not None
        ctx.has_weight = weight is not None
        if weight is not None:
            ctx.save_for_backward(ro, weight, rstd)
            return normed, ro
        return ro

    @staticmethod
    def backward(ctx, *grads):
        if not ctx.has_weight:
            (d_ro,) = grads
            return d_ro, (d_ro if ctx.has_residual else None), None, None, None, None, None
        d_normed, d_ro = grads
        ro, weight, rstd = ctx.saved_tensors
        if d_normed is None:
            d_normed = torch.zeros_like(ro)
        d_normed = d_normed.contiguous()
        d_ro = None if d_ro is None else d_ro.contiguous()
        if use_triton(ro):
            dx, dw = _krn.add_rmsnorm_bwd(d_normed, d_ro, ro, weight, rstd)
        else:
            dx, dw = add_rmsnorm_bwd_ref(d_normed, d_ro, ro, weight, rstd)
        return dx, (dx if ctx.has_residual else None), dw, None, None, None, None


# ----------------------------------------------------------------------------------------------
# public ops
# ----------------------------------------------------------------------------------------------


def _check_group_and_algo(group: object, algo: object, x: torch.Tensor) -> dist.ProcessGroup:
    if not isinstance(algo, str) or algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "group: torch.distributed is not initialised "
            "(call moekit.distributed.init_distributed())"
        )
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        raise ValueError(
            f"x must be on the current CUDA device cuda:{torch.cuda.current_device()} "
            f"(the group's device), got {x.device}"
        )
    return group


def _needs_grad(*ts: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def allreduce_add_rmsnorm(
    x: torch.Tensor,  # [..., H] partial sum on this rank, bf16 / fp16 / fp32, contiguous
    residual: torch.Tensor,  # [..., H] like x (replicated on every rank)
    weight: torch.Tensor,  # [H] RMSNorm weight, x's dtype or fp32
    *,
    eps: float = 1e-6,
    group: dist.ProcessGroup | None = None,
    algo: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual_out = all_reduce(x) + residual``; ``normed = RMSNorm(residual_out) · weight``.

    Returns ``(normed [..., H], residual_out [..., H])`` in x's dtype, bit-identical on every rank.
    ``algo``: ``"auto" | "one_shot" | "two_shot" | "nccl" | "reference"`` (module docstring).
    Backward: identity through the all-reduce, local add + RMSNorm backward.
    """
    x, residual, weight = validate_norm_inputs(x, residual, weight, eps, residual_required=True)
    group = _check_group_and_algo(group, algo, x)
    if dist.get_world_size(group) == 1:
        return add_rmsnorm(x, residual, weight, eps)
    shape = x.shape
    H = shape[-1]
    normed, ro = _AllreduceAddRMSNormFn.apply(
        x.view(-1, H),
        residual.view(-1, H),
        weight,
        float(eps),
        group,
        algo,
        _needs_grad(x, residual, weight),
    )
    return normed.view(shape), ro.view(shape)


def allreduce_add(
    x: torch.Tensor,  # [..., H] partial sum on this rank
    residual: torch.Tensor,  # [..., H] like x
    *,
    group: dist.ProcessGroup | None = None,
    algo: str = "auto",
) -> torch.Tensor:
    """``all_reduce(x) + residual`` (fp32 accumulation, one rounding); returns ``[..., H]``."""
    x, residual, _ = validate_norm_inputs(
        x, residual, None, 0.0, residual_required=True, weight_required=False
    )
    group = _check_group_and_algo(group, algo, x)
    if dist.get_world_size(group) == 1:
        return x + residual  # torch rounds the fp32 sum once, like the kernels
    shape = x.shape
    H = shape[-1]
    ro = _AllreduceAddRMSNormFn.apply(
        x.view(-1, H), residual.view(-1, H), None, 0.0, group, algo, False
    )
    return ro.view(shape)


def allreduce(
    x: torch.Tensor,  # [..., H] partial sum on this rank
    *,
    group: dist.ProcessGroup | None = None,
    algo: str = "auto",
) -> torch.Tensor:
    """Sum of ``x`` over the group (fp32 accumulation in rank order, one rounding); ``[..., H]``.

    Backward is the identity (row-parallel semantics). A group of size 1 returns ``x``.
    """
    x, _, _ = validate_norm_inputs(x, None, None, 0.0, weight_required=False)
    group = _check_group_and_algo(group, algo, x)
    if dist.get_world_size(group) == 1:
        return x
    shape = x.shape
    H = shape[-1]
    ro = _AllreduceAddRMSNormFn.apply(x.view(-1, H), None, None, 0.0, group, algo, False)
    return ro.view(shape)
