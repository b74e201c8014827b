"""Fused residual add + RMSNorm (local, one device), with autograd.

``add_rmsnorm(x, residual, weight)`` returns ``(normed, residual_out)`` with
``residual_out = x + residual`` (rounded once to the input dtype) and
``normed = residual_out · rsqrt(mean(residual_out²) + eps) · weight``; fp32 inside.
CUDA tensors run :mod:`moekit.kernels.rmsnorm`; CPU tensors the reference (or the kernel in
Triton's interpreter with ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

from moekit.kernels import rmsnorm as _k
from moekit.ops._dispatch import use_triton
from moekit.ops._validate import check_dtype, check_same_device, check_tensor
from moekit.reference.rmsnorm import add_rmsnorm_ref

__all__ = ["add_rmsnorm", "rmsnorm"]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
    if residual is None and residual_required:
        raise TypeError("residual must be a torch.Tensor, got None")
    if residual is not None:
        residual = check_tensor("residual", residual)
        if residual.dtype != x.dtype:
            raise TypeError(
                f"residual must have x's dtype {str(x.dtype).replace('torch.', '')}, "
                f"got {str(residual.dtype).replace('torch.', '')}"
            )
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
            raise TypeError(
                f"weight must have x's dtype {str(x.dtype).replace('torch.', '')} or float32, "
                f"got {str(weight.dtype).replace('torch.', '')}"
            )
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


class _AddRMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):  # x/residual: [T, H]
        normed, ro, rstd = _k.add_rmsnorm_fwd(x, residual, weight, eps)
        ctx.save_for_backward(ro, weight, rstd)
        ctx.has_residual = residual is not None
        if residual is None:
            return normed, ro.view_as(ro)
        return normed, ro

    @staticmethod
    def backward(ctx, d_normed, d_ro):
        ro, weight, rstd = ctx.saved_tensors
        if d_normed is None:
            d_normed = torch.zeros_like(ro)
        dx, dw = _k.add_rmsnorm_bwd(d_normed.contiguous(), _maybe(d_ro), ro, weight, rstd)
        return dx, (dx if ctx.has_residual else None), dw, None


def _maybe(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


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
    shape = x.shape
    x2 = x.view(-1, shape[-1])
    r2 = residual.view(-1, shape[-1]) if residual is not None else None
    if not use_triton(x):
        normed, ro, _ = add_rmsnorm_ref(x2, r2, weight, float(eps))
    else:
        normed, ro = _AddRMSNormFn.apply(x2, r2, weight, float(eps))
    return normed.view(shape), ro.view(shape)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x · rsqrt(mean(x²) + eps) · weight`` over the last dim; x: [..., H], weight: [H]."""
    return add_rmsnorm(x, None, weight, eps)[0]
