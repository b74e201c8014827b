"""Fused residual add + RMSNorm (local, one device), with autograd.

``add_rmsnorm(x, residual, weight)`` returns ``(normed, residual_out)`` with
``residual_out = x + residual`` (rounded once to the input dtype) and
``normed = residual_out · rsqrt(mean(residual_out²) + eps) · weight``; fp32 inside.
CUDA tensors run :mod:`moekit.kernels.rmsnorm`; CPU tensors the reference (or the kernel in
Triton's interpreter with ``TRITON_INTERPRET=1``). The forward and backward are kernel ops
(:mod:`moekit.runtime.op`), also used by the all-reduce ops.
"""

from __future__ import annotations

import torch

from moekit.kernels import rmsnorm as kernels
from moekit.ops.validation import FLOAT_DTYPES, check_dtype, check_same_device, check_tensor
from moekit.reference.rmsnorm import add_rmsnorm_bwd_ref, add_rmsnorm_ref
from moekit.runtime.device import num_sms, use_triton
from moekit.runtime.op import function_apply, kernel_op, needs_grad, refuse_double_backward
from moekit.runtime.replay import replayed, tensor_key
from moekit.tuning.allreduce import rmsnorm_bwd_grid, row_num_warps

__all__ = [
    "add_rmsnorm",
    "add_rmsnorm_backward",
    "add_rmsnorm_forward",
    "rmsnorm",
    "rows",
    "validate_norm_inputs",
]


def validate_norm_inputs(
    x: object,
    residual: object,
    weight: object,
    eps: object,
    *,
    residual_required: bool = False,
    weight_required: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Checks shared by the local and the cross-rank ops; raises TypeError/ValueError naming the
    argument, the expectation and what was given."""
    x = check_tensor("x", x)
    check_dtype("x", x, FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dim [..., H], got shape {tuple(x.shape)}")
    H = x.shape[-1]
    if H == 0:
        raise ValueError(
            f"x must have a hidden size H = x.shape[-1] >= 1, got shape {tuple(x.shape)}"
        )
    x_dtype = str(x.dtype).replace("torch.", "")
    if residual is None and residual_required:
        raise TypeError("residual must be a torch.Tensor, got None")
    if residual is not None:
        residual = check_tensor("residual", residual)
        if residual.dtype != x.dtype:
            got = str(residual.dtype).replace("torch.", "")
            raise TypeError(f"residual must have x's dtype {x_dtype}, got {got}")
        if residual.shape != x.shape:
            raise ValueError(
                f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
            )
        check_same_device("residual", residual, "x", x)
    if weight is None and weight_required:
        raise TypeError("weight must be a torch.Tensor, got None")
    if weight is not None:
        weight = check_tensor("weight", weight)
        if weight.dtype not in (x.dtype, torch.float32):
            got = str(weight.dtype).replace("torch.", "")
            allowed = x_dtype if x.dtype == torch.float32 else f"{x_dtype} or float32"
            raise TypeError(f"weight must have x's dtype ({allowed}), got {got}")
        if weight.shape != (H,):
            raise ValueError(f"weight must have shape (H,) = ({H},), got {tuple(weight.shape)}")
        check_same_device("weight", weight, "x", x)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        if t is not None and not t.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous (no silent copies), got strides {tuple(t.stride())}"
            )
    return x, residual, weight


def _forward_fake(x, residual, weight, eps, store_rstd):
    T, H = x.shape
    ro = x.new_empty(T if residual is not None else 0, H)
    return x.new_empty(T, H), ro, x.new_empty(T if store_rstd else 0, dtype=torch.float32)


def _launch_forward(x, residual, weight, y, ro, rstd, eps: float) -> None:
    roles = (x, residual, weight, y, ro, rstd)
    key = ("add_rmsnorm_fwd", eps, *map(tensor_key, roles)) if x.is_cuda else None
    warps = row_num_warps(x.shape[1])

    def body() -> None:
        kernels.add_rmsnorm_fwd(x, residual, weight, y, ro, rstd, eps, warps)

    replayed(key, roles, body)


@kernel_op("add_rmsnorm_forward", fake=_forward_fake)
def add_rmsnorm_forward(
    x: torch.Tensor,  # [T, H] contiguous
    residual: torch.Tensor | None,  # [T, H] like x
    weight: torch.Tensor,  # [H]
    eps: float,
    store_rstd: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(normed [T, H], residual_out [T, H] ([0, H] without a residual: it is x), rstd [T]
    fp32 ([0] unless ``store_rstd``))``; inputs already validated."""
    T, H = x.shape
    if not use_triton(x):
        normed, ro, rstd = add_rmsnorm_ref(x, residual, weight, eps)
        ro = ro if residual is not None else x.new_empty(0, H)
        return normed, ro, (rstd if store_rstd else rstd.new_empty(0))
    y = torch.empty_like(x)
    ro = torch.empty_like(x) if residual is not None else None
    rstd = torch.empty(T if store_rstd else 0, dtype=torch.float32, device=x.device)
    if T > 0:
        _launch_forward(x, residual, weight, y, ro, rstd if store_rstd else None, eps)
    return y, (ro if ro is not None else x.new_empty(0, H)), rstd


def _backward_fake(dy, d_residual_out, residual_out, weight, rstd):
    return torch.empty_like(dy), torch.empty_like(weight)


def _launch_backward(dy, d_ro, ro, weight, rstd, dx) -> torch.Tensor:
    T, H = ro.shape
    grid = rmsnorm_bwd_grid(T, num_sms(dy))
    dw_part = torch.empty(grid, H, dtype=torch.float32, device=dy.device)
    roles = (dy, d_ro, ro, weight, rstd, dx, dw_part)
    key = ("add_rmsnorm_bwd", *map(tensor_key, roles)) if dy.is_cuda else None
    warps = row_num_warps(H)

    def body() -> None:
        kernels.add_rmsnorm_bwd(dy, d_ro, ro, weight, rstd, dx, dw_part, warps)

    replayed(key, roles, body)
    return dw_part.sum(0)


@kernel_op("add_rmsnorm_backward", fake=_backward_fake)
def add_rmsnorm_backward(
    dy: torch.Tensor,  # [T, H] contiguous: grad of normed
    d_residual_out: torch.Tensor | None,  # [T, H] contiguous: grad of residual_out
    residual_out: torch.Tensor,  # [T, H] the norm's input, saved by the forward
    weight: torch.Tensor,  # [H]
    rstd: torch.Tensor,  # [T] fp32, saved by the forward
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx [T, H] in dy's dtype, dw [H] in weight's dtype)``; ``dx`` is also the gradient of
    the residual (the add routes it to both inputs)."""
    if not use_triton(dy):
        return add_rmsnorm_bwd_ref(dy, d_residual_out, residual_out, weight, rstd)
    dx = torch.empty_like(dy)
    if dy.shape[0] == 0:
        return dx, torch.zeros_like(weight)
    dw = _launch_backward(dy, d_residual_out, residual_out, weight, rstd, dx)
    return dx, dw.to(weight.dtype)


def rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` [..., H] as [T, H] rows (a view)."""
    return None if t is None else t.view(-1, t.shape[-1])


class _AddRMSNormFn(torch.autograd.Function):
    """Outputs ``(normed, residual_out)`` with a residual, ``normed`` alone without one (the
    caller returns x itself as residual_out then, and autograd routes its gradient).

    Takes and returns [..., H] tensors and flattens them inside: the one gradient ``dx`` of x
    and of the residual then reaches autograd as one tensor, which gives each input's ``.grad``
    its own storage, where two views of it (made outside) would be stolen by both and share it.
    """

    @staticmethod
    def forward(ctx, x, residual, weight, eps):  # x/residual: [..., H]
        normed, ro, rstd = add_rmsnorm_forward(rows(x), rows(residual), weight, eps, True)
        ctx.has_residual = residual is not None
        ctx.save_for_backward(ro if residual is not None else rows(x), weight, rstd)
        # Outputs in x's shape that are not views (detach() of the reshaped rows; it shares
        # their version counter): an output view of a tensor made here would be a view for
        # autograd, which FSDP2's output hooks warn about and in-place ops on it would trip.
        if x.dim() != 2:  # 2-D: the rows themselves
            normed = normed.view(x.shape).detach()
            ro = ro.view(x.shape).detach() if residual is not None else ro
        return normed if residual is None else (normed, ro)

    @staticmethod
    def backward(ctx, d_normed, d_ro=None):
        refuse_double_backward("add_rmsnorm")
        ro, weight, rstd = ctx.saved_tensors
        shape = d_normed.shape
        d_ro = None if d_ro is None else rows(d_ro.contiguous())
        dx, dw = add_rmsnorm_backward(rows(d_normed.contiguous()), d_ro, ro, weight, rstd)
        dx = dx.view(shape)
        return dx, (dx if ctx.has_residual else None), dw, None


_apply_add_rmsnorm = function_apply(_AddRMSNormFn)


def add_rmsnorm(
    x: torch.Tensor,  # [..., H] bf16 / fp16 / fp32, contiguous
    residual: torch.Tensor | None,  # [..., H] like x, or None
    weight: torch.Tensor,  # [H], x's dtype or fp32
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``residual_out = x + residual``; ``normed = RMSNorm(residual_out) · weight``.

    Returns ``(normed [..., H], residual_out [..., H])`` in x's dtype; without a residual,
    ``residual_out`` is ``x``. Differentiable in x, residual and weight: the gradient of
    ``residual_out`` and the norm's gradient are summed and routed to both x and residual.
    """
    x, residual, weight = validate_norm_inputs(x, residual, weight, eps)
    if not needs_grad(x, residual, weight):
        normed, ro, _ = add_rmsnorm_forward(rows(x), rows(residual), weight, float(eps), False)
        normed, ro = normed.view(x.shape), (ro.view(x.shape) if residual is not None else x)
    elif residual is None:
        normed, ro = _apply_add_rmsnorm(x, None, weight, float(eps)), x
    else:
        normed, ro = _apply_add_rmsnorm(x, residual, weight, float(eps))
    return normed, ro


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x · rsqrt(mean(x²) + eps) · weight`` over the last dim; x: [..., H], weight: [H]."""
    return add_rmsnorm(x, None, weight, eps)[0]
