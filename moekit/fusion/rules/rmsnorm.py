"""Rules around RMSNorm and the residual stream.

- ``add_rmsnorm``: AddExtraInput → MakeExtraOutput → RMSNorm as one kernel that adds the
  residual, writes the sum and normalises it, and one backward kernel.
- ``rmsnorm_residual_grad`` (backward only): MakeExtraOutput → RMSNorm's backward with the
  residual stream's gradient added in the same kernel, wherever the forward did not fuse the
  window both ways (``add_rmsnorm`` turned off, or a forward-only rule there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moekit.fusion.op import FusedOp, OpContext, Params
from moekit.fusion.ops.extras import AddExtraInput, MakeExtraOutput
from moekit.fusion.ops.norm import RMSNorm
from moekit.fusion.plan import Facts
from moekit.fusion.registry import register_fusion
from moekit.ops.rmsnorm import add_rmsnorm

__all__ = ["FusedAddRMSNorm", "FusedRMSNormResidualGrad"]


class FusedAddRMSNorm(FusedOp):
    """``residual_out = x + residual``; ``y = RMSNorm(residual_out)`` as
    :func:`moekit.ops.add_rmsnorm`: one kernel, and one more for the backward (the residual
    stream's gradient added into dx there)."""

    def autograd_forward(self, x: torch.Tensor, extras: dict, params: Sequence[Params]) -> tuple:
        add, make, norm = self.ops
        r = extras[add.name]
        if not isinstance(r, torch.Tensor) or r.shape != x.shape or r.dtype != x.dtype:
            r = add.other(x, extras)  # raises, naming the extra
        # the kernels read contiguous rows (a copy, with its gradient, where they are not)
        if not x.is_contiguous():
            x = x.contiguous()
        if not r.is_contiguous():
            r = r.contiguous()
        y, ro = add_rmsnorm(x, r, params[2]["weight"], norm.eps)
        return y, {make.name: ro}


class FusedRMSNormResidualGrad(FusedOp):
    """RMSNorm's backward with the gradient of the residual stream (MakeExtraOutput's extra)
    added into dx inside the kernel."""

    def fuser_backward(
        self, ctxs: list[OpContext], dy: torch.Tensor, grads: dict, params: Sequence[Params]
    ) -> tuple:
        make, norm = self.ops
        dx, _, own = norm.backward_with_residual(ctxs[1], dy, grads.get(make.name), params[1])
        return dx, {}, ({}, own)


@register_fusion(name="add_rmsnorm", pattern=(AddExtraInput, MakeExtraOutput, RMSNorm))
def add_rmsnorm_rule(ops, facts: Facts):
    return FusedAddRMSNorm(ops)


@register_fusion(
    name="rmsnorm_residual_grad", pattern=(MakeExtraOutput, RMSNorm), passes=("backward",)
)
def rmsnorm_residual_grad_rule(ops, facts: Facts):
    return FusedRMSNormResidualGrad(ops)
