"""Tensor-parallel collectives as basic ops: ``AllReduce``, ``ReduceScatter``, ``AllGather``
(over ``torch.distributed``; the latter two split and join along the first dim)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moekit.fusion.op import BasicOp, OpContext, Params
from moekit.ops.allreduce import ALGOS, allreduce

__all__ = ["AllGather", "AllReduce", "ReduceScatter"]


def _world(group: dist.ProcessGroup | None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "group: torch.distributed is not initialised "
            "(call moekit.distributed.init_distributed())"
        )
    return dist.get_world_size(group)


class AllReduce(BasicOp):
    """Sum of ``x`` over ``group`` (moekit's all-reduce, ``algo`` as in
    :func:`moekit.ops.allreduce`); backward is the identity (row-parallel semantics).
    Context: nothing."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, algo: str = "auto") -> None:
        super().__init__()
        if algo not in ALGOS:
            raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
        self.group, self.algo = group, algo

    def op_forward(self, ctx: OpContext, x: torch.Tensor, extras: dict, params: Params) -> tuple:
        return allreduce(x.contiguous(), group=self.group, algo=self.algo), None

    def op_backward(self, ctx: OpContext, dy: torch.Tensor, grads: dict, params: Params) -> tuple:
        return dy, {}, {}

    def reference(self, x: torch.Tensor, extras: dict) -> tuple:
        if _world(self.group) == 1:
            return x, {}
        return _AllReduceRef.apply(x, self.group), {}

    def extra_repr(self) -> str:
        return f"algo={self.algo!r}"


class _AllReduceRef(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.float().contiguous()
        dist.all_reduce(out, group=group)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None


def _scatter(x: torch.Tensor, group) -> torch.Tensor:
    W = _world(group)
    if x.shape[0] % W:
        raise ValueError(
            f"ReduceScatter: x.shape[0] = {x.shape[0]} must be divisible by the group size {W}"
        )
    out = x.new_empty(x.shape[0] // W, *x.shape[1:])
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    W = _world(group)
    out = x.new_empty(x.shape[0] * W, *x.shape[1:])
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


class _FirstDimCollective(BasicOp):
    """A collective along the first dim whose backward is its adjoint: subclasses set
    ``_collective`` (forward) and ``_adjoint`` (backward), both ``(x, group) -> tensor``."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group

    def op_forward(self, ctx: OpContext, x: torch.Tensor, extras: dict, params: Params) -> tuple:
        return self._collective(x, self.group), None

    def op_backward(self, ctx: OpContext, dy: torch.Tensor, grads: dict, params: Params) -> tuple:
        return self._adjoint(dy, self.group), {}, {}

    def reference(self, x: torch.Tensor, extras: dict) -> tuple:
        return _AdjointRef.apply(x, self.group, self._collective, self._adjoint), {}


class ReduceScatter(_FirstDimCollective):
    """Sum over ``group``, each rank keeping its 1/W slice of the first dim (sequence
    parallelism); backward all-gathers. Context: nothing."""

    _collective = staticmethod(_scatter)
    _adjoint = staticmethod(_gather)


class AllGather(_FirstDimCollective):
    """Concatenate every rank's ``x`` along the first dim; backward reduce-scatters.
    Context: nothing."""

    _collective = staticmethod(_gather)
    _adjoint = staticmethod(_scatter)


class _AdjointRef(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, collective, adjoint):
        ctx.group, ctx.adjoint = group, adjoint
        return collective(x, group)

    @staticmethod
    def backward(ctx, g):
        return ctx.adjoint(g, ctx.group), None, None, None
