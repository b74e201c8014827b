"""Rule ``allreduce_add_rmsnorm``: AllReduce → AddExtraInput → MakeExtraOutput → RMSNorm as
moekit's fused all-reduce + residual add + RMSNorm (one kernel over symmetric memory, or NCCL +
the local kernel; see :func:`moekit.ops.allreduce_add_rmsnorm`). The backward of the window is
the identity through the all-reduce and the local norm backward with the residual stream's
gradient added in the same kernel. Both passes run the same window, so a chain whose other
steps have autograd forms (a row-parallel Linear) runs :func:`moekit.ops.allreduce_add_rmsnorm`
itself, without the pipeline's autograd node."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moekit.fusion.op import Decline, FusedOp, OpContext
from moekit.fusion.ops.comm import AllReduce
from moekit.fusion.ops.extras import AddExtraInput, MakeExtraOutput
from moekit.fusion.ops.norm import RMSNorm, rows
from moekit.fusion.plan import Facts
from moekit.fusion.registry import register_fusion
from moekit.ops.allreduce import allreduce_add_rmsnorm, allreduce_add_rmsnorm_op
from moekit.ops.rmsnorm import validate_norm_inputs

__all__ = ["FusedAllReduceAddRMSNorm"]


class FusedAllReduceAddRMSNorm(FusedOp):
    """Leaves RMSNorm's context (``residual_out`` and ``rstd``)."""

    def __init__(self, ops, group: dist.ProcessGroup) -> None:
        super().__init__(ops)
        self.group_name = group.group_name

    def fuser_forward(self, ctxs: list[OpContext], x: torch.Tensor, extras: dict) -> tuple:
        ar, add, make, norm = self.ops
        r = add.other(x, extras)
        x2, r2 = rows(x), rows(r)
        validate_norm_inputs(x2, r2, norm.weight, norm.eps)
        y, ro, rstd = allreduce_add_rmsnorm_op(
            x2, r2, norm.weight, norm.eps, self.group_name, ar.algo, True
        )
        ctxs[3].x, ctxs[3].rstd = ro, rstd
        return y.view(x.shape), {make.name: ro.view(x.shape)}

    def fuser_backward(self, ctxs: list[OpContext], dy: torch.Tensor, grads: dict) -> tuple:
        # the all-reduce's backward is the identity (row-parallel semantics), and the add
        # passes the sum's gradient to both of its inputs
        _, add, make, norm = self.ops
        dx, _, params = norm.backward_with_residual(ctxs[3], dy, grads.get(make.name))
        return dx, {add.name: dx}, ((), (), (), params)

    def autograd_forward(self, x: torch.Tensor, extras: dict) -> tuple:
        ar, add, make, norm = self.ops
        r = add.other(x, extras)
        # the kernels read contiguous rows (a copy, with its gradient, where they are not)
        if not x.is_contiguous():
            x = x.contiguous()
        if not r.is_contiguous():
            r = r.contiguous()
        y, ro = allreduce_add_rmsnorm(x, r, norm.weight, eps=norm.eps, group=ar.group, algo=ar.algo)
        return y, {make.name: ro}


@register_fusion(
    name="allreduce_add_rmsnorm",
    pattern=(AllReduce, AddExtraInput, MakeExtraOutput, RMSNorm),
)
def allreduce_add_rmsnorm_rule(ops, facts: Facts):
    if not (dist.is_available() and dist.is_initialized()):
        return Decline("torch.distributed is not initialised")
    group = ops[0].group if ops[0].group is not None else dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return Decline("a group of one rank (the all-reduce is the identity)")
    return FusedAllReduceAddRMSNorm(ops, group)
