"""Rules around RMSNorm and the residual stream.

- ``add_rmsnorm``: AddExtraInput → MakeExtraOutput → RMSNorm as one kernel that adds the
  residual, writes the sum and normalises it, and one backward kernel.
- ``rmsnorm_residual_grad`` (backward only): MakeExtraOutput → RMSNorm's backward with the
  residual stream's gradient added in the same kernel, wherever the forward fused otherwise
  (e.g. ``allreduce_add_rmsnorm``).
"""

from __future__ import annotations

import torch

from moekit.fusion.op import FusedOp, OpContext
from moekit.fusion.ops.extras import AddExtraInput, MakeExtraOutput
from moekit.fusion.ops.norm import RMSNorm, rows
from moekit.fusion.plan import Facts
from moekit.fusion.registry import register_fusion
from moekit.ops.rmsnorm import add_rmsnorm, add_rmsnorm_forward, validate_norm_inputs

__all__ = ["FusedAddRMSNorm", "FusedRMSNormResidualGrad"]


class FusedAddRMSNorm(FusedOp):
    """``residual_out = x + residual``; ``y = RMSNorm(residual_out)`` in one kernel, and the
    backward in one more (the residual stream's gradient added into dx there). The forward
    leaves RMSNorm's context (its input ``residual_out`` and ``rstd``). A chain of just these
    three ops calls :func:`moekit.ops.add_rmsnorm` itself (``autograd_forward``)."""

    def _residual(self, x: torch.Tensor, extras: dict) -> torch.Tensor:
        add = self.ops[0]
        r = extras[add.name]
        if not isinstance(r, torch.Tensor) or r.shape != x.shape or r.dtype != x.dtype:
            r = add.other(x, extras)  # raises, naming the extra
        return r

    def fuser_forward(self, ctxs: list[OpContext], x: torch.Tensor, extras: dict) -> tuple:
        _, make, norm = self.ops
        x2, r2 = rows(x), rows(self._residual(x, extras))
        validate_norm_inputs(x2, r2, norm.weight, norm.eps)
        y, ro, rstd = add_rmsnorm_forward(x2, r2, norm.weight, norm.eps, True)
        ctxs[2].x, ctxs[2].rstd = ro, rstd
        return y.view(x.shape), {make.name: ro.view(x.shape)}

    def fuser_backward(self, ctxs: list[OpContext], dy: torch.Tensor, grads: dict) -> tuple:
        add, make, norm = self.ops
        dx, _, params = norm.backward_with_residual(ctxs[2], dy, grads.get(make.name))
        return dx, {add.name: dx}, ((), (), params)

    def autograd_forward(self, x: torch.Tensor, extras: dict) -> tuple:
        _, make, norm = self.ops
        r = self._residual(x, extras)
        # the kernels read contiguous rows (a copy, with its gradient, where they are not)
        if not x.is_contiguous():
            x = x.contiguous()
        if not r.is_contiguous():
            r = r.contiguous()
        y, ro = add_rmsnorm(x, r, norm.weight, norm.eps)
        return y, {make.name: ro}


class FusedRMSNormResidualGrad(FusedOp):
    """RMSNorm's backward with the gradient of the residual stream (MakeExtraOutput's extra)
    added into dx inside the kernel."""

    def fuser_backward(self, ctxs: list[OpContext], dy: torch.Tensor, grads: dict) -> tuple:
        make, norm = self.ops
        dx, _, params = norm.backward_with_residual(ctxs[1], dy, grads.get(make.name))
        return dx, {}, ((), params)


@register_fusion(name="add_rmsnorm", pattern=(AddExtraInput, MakeExtraOutput, RMSNorm))
def add_rmsnorm_rule(ops, facts: Facts):
    return FusedAddRMSNorm(ops)


@register_fusion(
    name="rmsnorm_residual_grad", pattern=(MakeExtraOutput, RMSNorm), passes=("backward",)
)
def rmsnorm_residual_grad_rule(ops, facts: Facts):
    return FusedRMSNormResidualGrad(ops)
