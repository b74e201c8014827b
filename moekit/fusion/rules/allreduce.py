"""Rule ``allreduce_add_rmsnorm``: AllReduce → AddExtraInput → MakeExtraOutput → RMSNorm as
moekit's fused all-reduce + residual add + RMSNorm (one kernel over symmetric memory, or NCCL +
the local kernel; see :func:`moekit.ops.allreduce_add_rmsnorm`). The backward of the window is
the identity through the all-reduce and the local norm backward with the residual stream's
gradient added in the same kernel. After a row-parallel Linear (``F.linear``) the block runs
as a user would write it by hand."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from moekit.fusion.op import Decline, FusedOp, Params
from moekit.fusion.ops.comm import AllReduce
from moekit.fusion.ops.extras import AddExtraInput, MakeExtraOutput
from moekit.fusion.ops.norm import RMSNorm
from moekit.fusion.plan import Facts
from moekit.fusion.registry import register_fusion
from moekit.ops.allreduce import allreduce_add_rmsnorm

__all__ = ["FusedAllReduceAddRMSNorm"]


class FusedAllReduceAddRMSNorm(FusedOp):
    """The window as :func:`moekit.ops.allreduce_add_rmsnorm`, forward and backward."""

    def autograd_forward(self, x: torch.Tensor, extras: dict, params: Sequence[Params]) -> tuple:
        ar, add, make, norm = self.ops
        r = add.other(x, extras)
        # the kernels read contiguous rows (a copy, with its gradient, where they are not)
        if not x.is_contiguous():
            x = x.contiguous()
        if not r.is_contiguous():
            r = r.contiguous()
        w = params[3]["weight"]
        y, ro = allreduce_add_rmsnorm(x, r, w, eps=norm.eps, group=ar.group, algo=ar.algo)
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
    return FusedAllReduceAddRMSNorm(ops)
