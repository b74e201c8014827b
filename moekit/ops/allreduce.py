"""Tensor-parallel all-reduce fused with residual add and RMSNorm.

In a tensor-parallel block the row-parallel projection leaves a partial sum ``x`` on every rank;
the next step is ``residual_out = all_reduce(x) + residual`` and ``normed = RMSNorm(residual_out)``.
:func:`allreduce_add_rmsnorm` does all three in one kernel per rank that reads the peers' copies
of ``x`` straight from symmetric memory (:mod:`moekit.kernels.allreduce`); :func:`allreduce_add`
and :func:`allreduce` run through the same machinery.

Algorithms (``algo=``):
  - ``"one_shot"``: every rank reads all peers (lowest latency, small messages);
  - ``"two_shot"``: reduce-scatter + all-gather inside one kernel (large messages, W ≥ 4);
  - ``"lamport"``: like one_shot without the barrier: every rank pushes its rows into sentinel-
    filled slots of every peer and readers spin on the data itself (bf16/fp16, messages up to the
    pool's Lamport slot; other calls asking for it take one_shot with a one-time warning);
  - ``"lamport_two_shot"``: two_shot's data movement (push reduce-scatter, push all-gather) with
    Lamport slots instead of barriers (bf16/fp16, up to W/2 Lamport slots; else two_shot);
  - ``"nccl"``: ``torch.distributed.all_reduce`` then the local fused add + RMSNorm kernel;
  - ``"reference"``: all_gather + fp32 sum in rank order (the oracle; any backend);
  - ``"auto"``: by message size, world size and dtype among the above
    (:func:`moekit.tuning.allreduce.auto_algo`); CPU tensors take the reference.
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

Wrapping: the collective is one kernel op (``moekit::allreduce_add_rmsnorm``, see
:mod:`moekit.runtime.op`) that takes the group by name, since a custom op cannot take a
ProcessGroup; inside it everything that depends only on the call's shape, dtype, device, group
and algo (the algorithm ``auto`` picks, the fallback decision, the pool's workspace, the launch
shape) is resolved once into a cached launch plan, and the kernel launch is replayed
(:func:`moekit.runtime.replay.replayed`). Plans are keyed on the pool generation, so a replaced
pool (:func:`~moekit.distributed.symmetric_pool.set_pool`) gets new ones, and are dropped when
the thresholds change (:func:`set_auto_thresholds`); ``MOEKIT_AR_*`` variables are read when a
plan is built (``MOEKIT_AR_LAMPORT_SLOT_KB`` sets the workspace layout: change it only before
the first call).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from moekit.config import lamport_slot_bytes
from moekit.distributed.env import group_from_name
from moekit.distributed.symmetric_pool import SymmetricPool, get_pool, pool_generation
from moekit.kernels import allreduce as kernels
from moekit.ops.rmsnorm import (
    add_rmsnorm,
    add_rmsnorm_backward,
    add_rmsnorm_forward,
    rows,
    validate_norm_inputs,
)
from moekit.reference.allreduce import gather_allreduce_ref
from moekit.runtime.cache import cached
from moekit.runtime.device import num_sms
from moekit.runtime.op import function_apply, kernel_op, needs_grad, refuse_double_backward
from moekit.runtime.replay import replayed, tensor_key
from moekit.runtime.state import warn_once
from moekit.tuning import allreduce as tuning
from moekit.tuning.allreduce import auto_algo, set_auto_thresholds

__all__ = [
    "ALGOS",
    "DEFAULT_LAMPORT_SLOT_BYTES",
    "allreduce",
    "allreduce_add",
    "allreduce_add_rmsnorm",
    "allreduce_add_rmsnorm_op",
    "auto_algo",
    "set_auto_thresholds",
    "workspace_of",
]

ALGOS = ("auto", *kernels.ALGOS, "nccl", "reference")
_LAMPORT_FALLBACK = {"lamport": "one_shot", "lamport_two_shot": "two_shot"}
# One Lamport slot holds one rank's x of a lamport call: 256 tokens × 7168 bf16.
DEFAULT_LAMPORT_SLOT_BYTES = 4 << 20


def _warn_once(key: str, message: str) -> None:
    warn_once(("allreduce", key), message, stacklevel=2)


def workspace_of(pool: SymmetricPool) -> kernels.Workspace | None:
    """The all-reduce's workspace in ``pool``: where its halves and Lamport slots lie, and
    which calls fit them (None when the pool is too small for it)."""
    slot = lamport_slot_bytes(DEFAULT_LAMPORT_SLOT_BYTES)
    return kernels.workspace(pool.nbytes, pool.world_size, slot)


def _lamport_fits(pool: SymmetricPool, x: torch.Tensor, algo: str) -> bool:
    space = workspace_of(pool)
    T, H = x.shape
    return (
        pool.available
        and space is not None
        and space.lamport_fits(T, H, x.element_size(), algo, pool.world_size)
    )


def _symm_unusable(pool: SymmetricPool, x: torch.Tensor, algo: str) -> tuple[str, str]:
    """("", "") when the symmetric kernel can run this call with ``algo``, else (warning key,
    reason). Lamport's slots are checked by the caller (:func:`_lamport_fits`)."""
    T, H = x.shape
    e = x.element_size()
    space = workspace_of(pool)
    if not pool.available:
        return "unavailable", f"symmetric memory unavailable: {pool.reason}"
    if space is None:
        return "small", (
            f"the pool's {pool.nbytes} B cannot hold the all-reduce's {kernels.SIGNAL_BYTES} B "
            "of barrier flags (raise MOEKIT_SYMM_POOL_MB or pass a larger SymmetricPool)"
        )
    if H > kernels.MAX_FUSED_H:
        return "wide", f"H = {H} > {kernels.MAX_FUSED_H}, the widest row the fused kernels hold"
    if (H * e) % 16:
        return "align", f"rows of H = {H} × {e} B are not a multiple of 16 bytes"
    if not space.fits(T, H, e, algo, pool.world_size):
        need = kernels.workspace_bytes(T, H, e, algo, pool.world_size)
        return "small", (
            f"needs {need} B of symmetric memory (two halves of T·H·e), the pool has "
            f"{2 * space.half_bytes} B for them (raise MOEKIT_SYMM_POOL_MB or pass a larger "
            "SymmetricPool)"
        )
    return "", ""


def _pick_symm(group: dist.ProcessGroup, algo: str, x: torch.Tensor) -> str:
    """``algo`` (``auto`` or a symmetric one) resolved against the group's pool: the algorithm
    itself, ``auto``'s pick, a Lamport request's plain twin, or ``nccl`` (warned once)."""
    world = dist.get_world_size(group)
    name = group.group_name
    if world > kernels.MAX_WORLD:
        _warn_once(
            f"world:{name}",
            f"allreduce: falling back to NCCL (group size {world} > {kernels.MAX_WORLD} ranks "
            "the symmetric kernels support)",
        )
        return "nccl"
    pool = get_pool(group)
    nbytes = x.numel() * x.element_size()
    if algo == "auto":
        algo = auto_algo(nbytes, world, x.element_size() == 2)
        if algo in _LAMPORT_FALLBACK and not _lamport_fits(pool, x, algo):
            algo = _LAMPORT_FALLBACK[algo]
    elif algo in _LAMPORT_FALLBACK and pool.available and not _lamport_fits(pool, x, algo):
        plain = _LAMPORT_FALLBACK[algo]
        space = workspace_of(pool)
        slot = space.lamport_slot_bytes if space is not None else 0
        _warn_once(
            f"{algo}:{x.dtype}:{nbytes}",
            f"allreduce: algo={algo!r} needs bf16/fp16 and a message that fits the pool's "
            f"Lamport slots ({world} × {slot} B); got {x.dtype}, {nbytes} B: using {plain}",
        )
        algo = plain
    if algo in kernels.ALGOS:
        key, why = _symm_unusable(pool, x, algo)
        if key:
            _warn_once(f"{key}:{name}", f"allreduce: falling back to NCCL ({why})")
            return "nccl"
    return algo


def _pick_algo(group: dist.ProcessGroup, algo: str, x: torch.Tensor) -> str:
    """The algorithm a call of [T, H] ``x`` runs (collective on the group's first call: it
    creates the group's symmetric pool)."""
    if x.is_cuda:
        return _pick_symm(group, algo, x) if algo == "auto" or algo in kernels.ALGOS else algo
    if algo in kernels.ALGOS:
        _warn_once(
            "cpu",
            f"allreduce: algo={algo!r} needs CUDA symmetric memory; CPU tensors use "
            "torch.distributed.all_reduce ('nccl' path) instead",
        )
        return "nccl"
    return "reference" if algo == "auto" else algo


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How calls of one static configuration run: ``kind`` is ``"nccl"``, ``"reference"`` or one
    of the symmetric kernel's algorithms, whose launch facts follow."""

    kind: str
    rank: int = 0
    space: kernels.Workspace | None = None
    config: tuning.AllreduceConfig | None = None
    peer_bases: torch.Tensor | None = None  # the pool's
    epochs: torch.Tensor | None = None  # the pool's


def _build_plan(group_name: str, algo: str, x: torch.Tensor) -> _Plan:
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        raise ValueError(
            f"x must be on the current CUDA device cuda:{torch.cuda.current_device()} "
            f"(the group's device), got {x.device}"
        )
    group = group_from_name(group_name)
    algo = _pick_algo(group, algo, x)
    if algo not in kernels.ALGOS:
        return _Plan(algo)
    pool = get_pool(group)
    T, H = x.shape
    max_programs = min(num_sms(x), kernels.MAX_BLOCKS)
    config = tuning.allreduce_config(algo, T, H, pool.world_size, max_programs)
    return _Plan(algo, pool.rank, workspace_of(pool), config, pool.peer_bases, pool.epochs)


def _plan(group_name: str, algo: str, x: torch.Tensor) -> _Plan:
    # Keyed on the pool generation: a created or replaced pool moves the addresses. (The call
    # that creates a pool builds its plan once more on the next call, under the new generation.)
    T, H = x.shape
    key = (tuning.PLAN_CACHE_KIND, pool_generation(), group_name, algo, T, H, x.dtype, x.device)
    return cached(key, lambda: _build_plan(group_name, algo, x))


def _run_symm(plan: _Plan, x, residual, weight, eps: float, need_rstd: bool):
    T = x.shape[0]
    ro = torch.empty_like(x)
    y = torch.empty_like(x) if weight is not None else None
    rstd = None
    if need_rstd and weight is not None:
        rstd = torch.empty(T, dtype=torch.float32, device=x.device)
    if T > 0:
        roles = (x, residual, weight, ro, y, rstd, plan.peer_bases, plan.epochs)
        key = None
        if x.is_cuda:
            static = (plan.kind, plan.rank, plan.space, plan.config, eps)
            key = ("allreduce_add_rmsnorm", *static, *map(tensor_key, roles))

        def body() -> None:
            kernels.fused_allreduce(
                x, residual, weight, ro, y, rstd, plan.peer_bases, plan.epochs, eps,
                rank=plan.rank, algo=plan.kind, space=plan.space, config=plan.config,
            )  # fmt: skip

        replayed(key, roles, body)
    return y, ro, rstd


def _run_nccl(group_name: str, x, residual, weight, eps: float, need_rstd: bool):
    """``torch.distributed.all_reduce`` (NCCL on GPUs, gloo on CPU) + the local fused epilogue."""
    summed = x.clone()
    dist.all_reduce(summed, group=group_from_name(group_name))
    if weight is None:
        if residual is not None:
            summed.add_(residual)
        return None, summed, None
    normed, ro, rstd = add_rmsnorm_forward(summed, residual, weight, eps, need_rstd)
    return normed, (ro if residual is not None else summed), rstd


def _run_reference(group_name: str, x, residual, weight, eps: float, need_rstd: bool):
    normed, ro = gather_allreduce_ref(x, residual, weight, eps, group_from_name(group_name))
    rstd = None
    if need_rstd and weight is not None:
        rstd = torch.rsqrt(ro.float().pow(2).mean(-1) + eps)
    return normed, ro, rstd


def _allreduce_fake(x, residual, weight, eps, group_name, algo, need_rstd):
    T, H = x.shape
    has_norm = weight is not None
    rstd = x.new_empty(T if need_rstd and has_norm else 0, dtype=torch.float32)
    return x.new_empty(T if has_norm else 0, H), x.new_empty(T, H), rstd


@kernel_op("allreduce_add_rmsnorm", fake=_allreduce_fake)
def allreduce_add_rmsnorm_op(
    x: torch.Tensor,  # [T, H] partial sum on this rank, contiguous
    residual: torch.Tensor | None,  # [T, H]
    weight: torch.Tensor | None,  # [H]
    eps: float,
    group_name: str,  # the group's ``group_name`` (resolved inside: see the module docstring)
    algo: str,  # one of ALGOS
    need_rstd: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(normed ([0, H] without weight), residual_out, rstd ([0] unless need_rstd and weight))``;
    residual_out is the all-reduce itself when there is neither residual nor weight. Inputs
    already validated; collective over the group."""
    plan = _plan(group_name, algo, x)
    if plan.kind == "nccl":
        y, ro, rstd = _run_nccl(group_name, x, residual, weight, eps, need_rstd)
    elif plan.kind == "reference":
        y, ro, rstd = _run_reference(group_name, x, residual, weight, eps, need_rstd)
    else:
        y, ro, rstd = _run_symm(plan, x, residual, weight, eps, need_rstd)
    y = y if y is not None else x.new_empty(0, x.shape[1])
    return y, ro, (rstd if rstd is not None else x.new_empty(0, dtype=torch.float32))


class _AllreduceAddRMSNormFn(torch.autograd.Function):
    """Forward: the collective + epilogue. Backward: identity through the all-reduce
    (row-parallel semantics), local add + RMSNorm backward. Outputs ``(normed, residual_out)``
    with a weight, ``residual_out`` alone without one. Takes and returns [..., H] tensors (see
    ``_AddRMSNormFn`` in :mod:`moekit.ops.rmsnorm` for why the flattening happens inside)."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, group_name, algo):
        has_weight = weight is not None
        normed, ro, rstd = allreduce_add_rmsnorm_op(
            rows(x), rows(residual), weight, eps, group_name, algo, has_weight
        )
        ctx.has_residual = residual is not None
        ctx.has_weight = has_weight
        if not has_weight:
            return ro.view(x.shape)
        ctx.save_for_backward(ro, weight, rstd)
        return normed.view(x.shape), ro.view(x.shape)

    @staticmethod
    def backward(ctx, *grads):
        refuse_double_backward("allreduce_add_rmsnorm")
        if not ctx.has_weight:
            (d_ro,) = grads
            return d_ro, (d_ro if ctx.has_residual else None), None, None, None, None
        d_normed, d_ro = grads
        ro, weight, rstd = ctx.saved_tensors
        d_ro = None if d_ro is None else rows(d_ro.contiguous())
        dx, dw = add_rmsnorm_backward(rows(d_normed.contiguous()), d_ro, ro, weight, rstd)
        dx = dx.view(d_normed.shape)
        return dx, (dx if ctx.has_residual else None), dw, None, None, None


_apply_allreduce = function_apply(_AllreduceAddRMSNormFn)


def _resolve_group(group: object) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "group: torch.distributed is not initialised "
            "(call moekit.distributed.init_distributed())"
        )
    if group is None:
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    return group


def _call(
    x: torch.Tensor,  # [..., H] validated
    residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
    group: object, algo: object,  # checked here
) -> tuple[torch.Tensor | None, torch.Tensor] | None:  # fmt: skip
    """Run the op; returns ``(normed | None, residual_out)`` in x's shape, or None for a group of
    one (the caller does the local op)."""
    if not isinstance(algo, str) or algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    group = _resolve_group(group)
    if dist.get_world_size(group) == 1:
        return None
    if needs_grad(x, residual, weight):
        out = _apply_allreduce(x, residual, weight, eps, group.group_name, algo)
        return out if weight is not None else (None, out)
    normed, ro, _ = allreduce_add_rmsnorm_op(
        rows(x), rows(residual), weight, eps, group.group_name, algo, False
    )
    return (None if weight is None else normed.view(x.shape)), ro.view(x.shape)


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
    ``algo``: ``"auto" | "one_shot" | "two_shot" | "lamport" | "lamport_two_shot" | "nccl" |
    "reference"`` (module docstring).
    Backward: identity through the all-reduce, local add + RMSNorm backward.
    """
    x, residual, weight = validate_norm_inputs(x, residual, weight, eps, residual_required=True)
    out = _call(x, residual, weight, float(eps), group, algo)
    if out is None:
        return add_rmsnorm(x, residual, weight, eps)
    return out


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
    out = _call(x, residual, None, 0.0, group, algo)
    if out is None:
        return x + residual  # torch rounds the fp32 sum once, like the kernels
    return out[1]


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
    out = _call(x, None, None, 0.0, group, algo)
    if out is None:
        return x
    return out[1]
