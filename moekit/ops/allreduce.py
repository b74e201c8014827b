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
  - ``"auto"``: by message size, world size and dtype among the above (see :func:`auto_algo`);
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

Host cost: everything that depends only on the call's shape, dtypes, device, group and algo (the
algorithm ``auto`` picks, the fallback decision, the pool, the grid, the compiled kernel) is
resolved once into a cached launch plan; a repeated call validates its inputs, looks the plan up,
allocates its outputs and makes one kernel launch. Without autograd (no input requires grad, or
``torch.no_grad()``) the ``autograd.Function`` is skipped too. Plans are dropped when a pool is
replaced (:func:`~moekit.distributed.symmetric_pool.set_pool`) or the thresholds change
(:func:`set_auto_thresholds`); ``MOEKIT_AR_*`` environment variables are read when a plan is built.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekit.config import env_kib
from moekit.distributed import symmetric_pool as _sp
from moekit.distributed.symmetric_pool import SymmetricPool, get_pool
from moekit.kernels import allreduce as _kar
from moekit.kernels import rmsnorm as _krn
from moekit.kernels._runtime import device_sms
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

ALGOS = ("auto", "one_shot", "two_shot", "lamport", "lamport_two_shot", "nccl", "reference")
_SYMM_ALGOS = ("one_shot", "two_shot", "lamport", "lamport_two_shot")
_LAMPORT_FALLBACK = {"lamport": "one_shot", "lamport_two_shot": "two_shot"}

# ----------------------------------------------------------------------------------------------
# algorithm selection
# ----------------------------------------------------------------------------------------------

# Defaults from the H200 measurements (docs/allreduce_rmsnorm.md, bf16, CUDA graphs of
# back-to-back calls). W = 2: lamport up to 512 KiB, lamport_two_shot up to 4 MiB (where it fits
# the Lamport slots), one_shot up to 8 MiB, two_shot above. W = 4: lamport_two_shot up to 8 MiB
# (it beat lamport even at one token), one_shot up to 1 MiB for what Lamport cannot take (fp32,
# messages beyond the slots), two_shot above. NCCL + add + norm was slower than the best of these
# at every measured size, so NCCL is never picked by default. Other world sizes (no Lamport
# default) use the cost model: one_shot moves (W−1)·N bytes into each GPU, two_shot 2(W−1)/W·N
# plus one more barrier; with ≈ 3 µs per extra barrier and ≈ 450 GB/s NVLink ingress, two_shot
# wins above N ≈ 3e-6 · 450e9 / ((W−1)(1 − 2/W)) (≈ 0.26 MB for W = 8). Tune with
# set_auto_thresholds() or the MOEKIT_AR_*_MAX_KB variables (the benchmark prints suggestions).
_MEASURED_ONE_SHOT_MAX = {2: 8 << 20, 4: 1 << 20}
_MEASURED_LAMPORT_MAX: dict[int, float] = {2: 512 << 10, 4: 0}
_MEASURED_LAMPORT_TWO_SHOT_MAX: dict[int, float] = {2: 4 << 20, 4: 8 << 20}
_BARRIER_S = 3e-6
_NVLINK_BPS = 450e9
_overrides: dict[str, int | None] = {
    "one_shot_max": None,
    "two_shot_max": None,
    "lamport_max": None,
    "lamport_two_shot_max": None,
}


def set_auto_thresholds(
    one_shot_max_bytes: int | None = None,
    two_shot_max_bytes: int | None = None,
    lamport_max_bytes: int | None = None,
    lamport_two_shot_max_bytes: int | None = None,
) -> None:
    """Override ``auto``. For bf16/fp16: lamport up to ``lamport_max_bytes``, then
    lamport_two_shot up to ``lamport_two_shot_max_bytes`` (each only where the message fits the
    pool's Lamport slots); then, for every dtype: one_shot up to ``one_shot_max_bytes``, two_shot
    up to ``two_shot_max_bytes``, NCCL above. ``None`` restores the default / environment.
    Drops the cached launch plans, so the next call of every shape re-decides."""
    _overrides["one_shot_max"] = one_shot_max_bytes
    _overrides["two_shot_max"] = two_shot_max_bytes
    _overrides["lamport_max"] = lamport_max_bytes
    _overrides["lamport_two_shot_max"] = lamport_two_shot_max_bytes
    _plans.clear()


def _threshold(name: str, env: str, measured: dict[int, float], world_size: int) -> float:
    value = _overrides[name]
    if value is None:
        value = env_kib(env)
    if value is None:
        value = measured.get(world_size, 0)
    return value


def auto_algo(nbytes: int, world_size: int, sixteen_bit: bool = False) -> str:
    """The algorithm ``auto`` picks for a message of ``nbytes`` (T·H·element size);
    ``sixteen_bit``: bf16/fp16, so the Lamport algorithms are candidates (the op still checks
    that the message fits the pool's Lamport slots and takes the plain twin otherwise)."""
    if sixteen_bit:
        lam = _threshold(
            "lamport_max", "MOEKIT_AR_LAMPORT_MAX_KB", _MEASURED_LAMPORT_MAX, world_size
        )
        lam2 = _threshold(
            "lamport_two_shot_max",
            "MOEKIT_AR_LAMPORT_TWO_SHOT_MAX_KB",
            _MEASURED_LAMPORT_TWO_SHOT_MAX,
            world_size,
        )
        if nbytes <= lam:
            return "lamport"
        if nbytes <= lam2:
            return "lamport_two_shot"
    one_max = _overrides["one_shot_max"]
    if one_max is None:
        one_max = env_kib("MOEKIT_AR_ONE_SHOT_MAX_KB")
    if one_max is None:
        one_max = _MEASURED_ONE_SHOT_MAX.get(world_size)
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
        warnings.warn(message, RuntimeWarning, stacklevel=5)


def _symm_unusable(
    pool: SymmetricPool, T: int, H: int, element_size: int, algo: str
) -> tuple[str, str]:
    """("", "") when the symmetric kernels can run this call with ``algo``, else (warning key,
    reason). Lamport's slots are checked by the caller (``pool.lamport_fits``)."""
    if not pool.available:
        return "unavailable", f"symmetric memory unavailable: {pool.reason}"
    if H > _kar.MAX_FUSED_H:
        return "wide", f"H = {H} > {_kar.MAX_FUSED_H}, the widest row the fused kernels hold"
    if (H * element_size) % 16:
        return "align", f"rows of H = {H} × {element_size} B are not a multiple of 16 bytes"
    need = _kar.workspace_bytes(T, H, element_size, algo, pool.world_size)
    if not pool.fits(need):  # 0 for the Lamport algorithms (they use their own slots)
        return "small", (
            f"needs {need} B of symmetric memory (two halves of T·H·e), the pool has "
            f"{pool.capacity} B (raise MOEKIT_SYMM_POOL_MB or pass a larger SymmetricPool)"
        )
    return "", ""


# ----------------------------------------------------------------------------------------------
# launch plans: everything that depends only on (shape, dtypes, device, group, algo), built once
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """How calls of one static configuration run (see :func:`_build_plan`)."""

    kind: str  # "local" (group of one) | "symm" | "nccl" | "reference"
    group: dist.ProcessGroup
    need_rstd: bool
    kernel: _kar.FusedAllreducePlan | None = None  # kind == "symm"
    triton_epilogue: bool = False  # kind == "nccl": local fused add + norm kernel vs reference

    def run(
        self,
        x: torch.Tensor,  # [T, H]
        residual: torch.Tensor | None,  # [T, H]
        weight: torch.Tensor | None,  # [H]
        eps: float,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """``(normed | None, residual_out, rstd | None)``; residual_out is the all-reduce itself
        when there is neither residual nor weight."""
        if self.kind == "symm":
            return self.kernel(x, residual, weight, eps)
        if self.kind == "reference":
            normed, ro = gather_allreduce_ref(x, residual, weight, eps, self.group)
            rstd = _rstd_of(ro, eps) if (self.need_rstd and weight is not None) else None
            return normed, ro, rstd
        # "nccl": torch.distributed.all_reduce (NCCL on GPUs, gloo on CPU) + local fused epilogue
        summed = x.clone()
        dist.all_reduce(summed, group=self.group)
        if weight is None:
            if residual is not None:
                summed.add_(residual)
            return None, summed, None
        if self.triton_epilogue:
            return _krn.add_rmsnorm_fwd(summed, residual, weight, eps, store_rstd=self.need_rstd)
        return add_rmsnorm_ref(summed, residual, weight, eps)


_plans: dict[tuple, _Plan] = {}
_plans_generation = [-1]  # the pool generation the cached plans were built against


def _rstd_of(ro: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(ro.float().pow(2).mean(-1) + eps)


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


def _build_plan(
    group: object,
    algo: object,
    T: int,
    H: int,
    x: torch.Tensor,
    has_residual: bool,
    weight: torch.Tensor | None,
    need_rstd: bool,
) -> _Plan:
    """Validate the group and algo, decide the path (one warning per fallback reason), build the
    kernel plan. Collective on the group's first call (creates its symmetric pool)."""
    if not isinstance(algo, str) or algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    group = _resolve_group(group)
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        raise ValueError(
            f"x must be on the current CUDA device cuda:{torch.cuda.current_device()} "
            f"(the group's device), got {x.device}"
        )
    world = dist.get_world_size(group)
    if world == 1:
        return _Plan("local", group, need_rstd)
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
        nbytes = T * H * x.element_size()
        if algo == "auto":
            algo = auto_algo(nbytes, world, x.element_size() == 2)
            if algo in _LAMPORT_FALLBACK and not pool.lamport_fits(T, H, x.dtype, algo):
                algo = _LAMPORT_FALLBACK[algo]
        elif (
            algo in _LAMPORT_FALLBACK
            and pool.available
            and not pool.lamport_fits(T, H, x.dtype, algo)
        ):
            plain = _LAMPORT_FALLBACK[algo]
            _warn_once(
                f"{algo}:{x.dtype}:{nbytes}",
                f"allreduce: algo={algo!r} needs bf16/fp16 and a message that fits the "
                f"pool's Lamport slots ({pool.world_size} × {pool.lamport_slot_bytes} B); "
                f"got {x.dtype}, {nbytes} B: using {plain}",
            )
            algo = plain
        if algo in _SYMM_ALGOS:
            key, why = _symm_unusable(pool, T, H, x.element_size(), algo)
            if key:
                _warn_once(
                    f"{key}:{getattr(group, 'group_name', id(group))}",
                    f"allreduce: falling back to NCCL ({why})",
                )
                algo = "nccl"
            else:
                kernel = _kar.FusedAllreducePlan(
                    T=T,
                    H=H,
                    dtype=x.dtype,
                    device=x.device,
                    has_residual=has_residual,
                    has_norm=weight is not None,
                    store_rstd=need_rstd,
                    peer_bases=pool.peer_bases,
                    ctl=pool.epochs,
                    rank=pool.rank,
                    algo=algo,
                    max_programs=min(device_sms(x), _kar.MAX_BLOCKS),
                    half_bytes=pool.half_bytes,
                    lamport_off=pool.lamport_offset,
                    lamport_slot_bytes=pool.lamport_slot_bytes,
                )
                return _Plan("symm", group, need_rstd, kernel=kernel)
    if algo == "reference":
        return _Plan("reference", group, need_rstd)
    return _Plan("nccl", group, need_rstd, triton_epilogue=use_triton(x))


def _get_plan(
    group: object,
    algo: object,
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    need_rstd: bool,
) -> _Plan:
    gen = _sp._generation
    if gen != _plans_generation[0]:  # a pool was created or replaced: addresses may have moved
        _plans.clear()
        _plans_generation[0] = gen
    T, H = x.shape
    key = (
        group, algo, T, H, x.dtype, x.device, residual is not None,
        None if weight is None else weight.dtype, need_rstd,
    )  # fmt: skip
    try:
        plan = _plans.get(key)
    except TypeError:  # unhashable group / algo: let _build_plan report it
        plan = None
        key = None
    if plan is None:
        plan = _build_plan(group, algo, T, H, x, residual is not None, weight, need_rstd)
        if key is not None:
            _plans[key] = plan
    elif not dist.is_initialized():
        _plans.clear()
        return _get_plan(group, algo, x, residual, weight, need_rstd)
    return plan


# ----------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------


class _AllreduceAddRMSNormFn(torch.autograd.Function):
    """Forward: the collective + epilogue. Backward: identity through the all-reduce
    (row-parallel semantics), local add + RMSNorm backward."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, plan):
        normed, ro, rstd = plan.run(x, residual, weight, eps)
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
            return d_ro, (d_ro if ctx.has_residual else None), None, None, None
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
        return dx, (dx if ctx.has_residual else None), dw, None, None


# ----------------------------------------------------------------------------------------------
# public ops
# ----------------------------------------------------------------------------------------------


def _needs_grad(*ts: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _call(
    x: torch.Tensor,  # [..., H] validated
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    group: object,
    algo: object,
) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """Run the op; returns ``(normed | None, residual_out)`` in x's shape, or None for a group of
    one (the caller does the local op)."""
    shape = x.shape
    flat = x.dim() != 2
    if flat:
        H = shape[-1]
        x = x.view(-1, H)
        residual = None if residual is None else residual.view(-1, H)
    need_grad = _needs_grad(x, residual, weight)
    plan = _get_plan(group, algo, x, residual, weight, need_grad)
    if plan.kind == "local":
        return None
    if need_grad:
        out = _AllreduceAddRMSNormFn.apply(x, residual, weight, eps, plan)
        normed, ro = out if weight is not None else (None, out)
    else:
        normed, ro, _ = plan.run(x, residual, weight, eps)
    if flat:
        ro = ro.view(shape)
        normed = None if normed is None else normed.view(shape)
    return normed, ro


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
