"""MoE routing as basic ops: ``Router`` → ``Permute`` → (expert ops) → ``Unpermute``.

Extras they exchange: ``routing_probs [T, k]`` and ``routing_indices [T, k]`` (Router →
Permute); ``offsets [E]``, ``probs [R]`` (each row's routing prob) and ``dispatch`` (the
:class:`moekit.ops.Dispatch`) from Permute to the expert ops and Unpermute.

Their backward is autograd over the differentiable ops they run (each op's own tested
Function), recorded at forward time (:class:`moekit.fusion.op.RecordedGraph`).
"""

from __future__ import annotations

import dataclasses

import torch

from moekit.fusion.op import BasicOp, OpContext, Params, RecordedGraph
from moekit.nn.router import TopKRouter
from moekit.ops.permute import Dispatch, DispatchConfig, permute, unpermute

__all__ = ["Permute", "Router", "Unpermute"]


class Router(BasicOp, TopKRouter):
    """A :class:`moekit.nn.TopKRouter` as a basic op (same arguments and parameters): the
    main tensor ``x [T, H]`` passes through unchanged; it makes ``routing_probs`` and
    ``routing_indices`` ``[T, k]``. Its aux and z losses (when on) ride on the main output's
    gradient, scaled by ``aux_loss_grad_scale``, as in :class:`moekit.nn.MoELayer`.
    ``last_counts [E]``: the last call's tokens per expert. Context: ``graph``."""

    extra_outputs = ("routing_probs", "routing_indices")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hidden_size = self.weight.shape[1]
        self.last_counts: torch.Tensor | None = None

    def route(
        self, x: torch.Tensor, weight: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x with the router's losses attached, probs, indices), differentiable:
        :meth:`moekit.nn.TopKRouter.forward` on ``weight``, the tensor a call computes with
        (default: the registered weight)."""
        out = TopKRouter.forward(self, x, weight)
        self.last_counts = out.counts
        return self.attach_losses(x.view_as(x), out), out.probs, out.indices

    def op_forward(self, ctx: OpContext, x: torch.Tensor, extras: dict, params: Params) -> tuple:
        w = params["weight"]
        ctx.graph = RecordedGraph(lambda x: self.route(x, w), (x,), (w,), ctx.saving)
        y, probs, indices = ctx.graph.outputs
        return y, {"routing_probs": probs, "routing_indices": indices}

    def op_backward(self, ctx: OpContext, dy: torch.Tensor, grads: dict, params: Params) -> tuple:
        (dx,), (dw,) = ctx.graph.backward((dy, grads.get("routing_probs"), None))
        return dx, {}, {"weight": dw}

    def reference(self, x: torch.Tensor, extras: dict) -> tuple:
        y, probs, indices = self.route(x)
        return y, {"routing_probs": probs, "routing_indices": indices}


class Permute(BasicOp):
    """:func:`moekit.ops.permute` of the main tensor ``[T, H]`` by the router's choice
    (extras ``routing_probs``, ``routing_indices``) into expert-sorted rows ``[R, H]``; makes
    ``offsets``, ``probs`` and ``dispatch``. Context: ``graph``."""

    extra_inputs = ("routing_probs", "routing_indices")
    extra_outputs = ("offsets", "probs", "dispatch")

    def __init__(
        self, num_experts: int, *, align: int | None = None, capacity_factor: float | None = None
    ) -> None:
        super().__init__()
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        self.num_experts = num_experts
        self.dispatch = DispatchConfig(capacity_factor, align)

    def permute(self, x, probs, indices) -> Dispatch:
        return permute(
            x, indices, probs, num_experts=self.num_experts, align=self.dispatch.align,
            capacity_factor=self.dispatch.capacity_factor,
        )  # fmt: skip

    def op_forward(self, ctx: OpContext, x: torch.Tensor, extras: dict, params: Params) -> tuple:
        indices = extras["routing_indices"]
        box: list[Dispatch] = []

        def run(x, probs):
            box.append(self.permute(x, probs, indices))
            return box[0].hidden, box[0].probs

        ctx.graph = RecordedGraph(run, (x, extras["routing_probs"]), (), ctx.saving)
        d = box[0]
        return d.hidden, {"offsets": d.offsets, "probs": d.probs, "dispatch": d}

    def op_backward(self, ctx: OpContext, dy: torch.Tensor, grads: dict, params: Params) -> tuple:
        (dx, dprobs), _ = ctx.graph.backward((dy, grads.get("probs")))
        return dx, {"routing_probs": dprobs}, {}

    def reference(self, x: torch.Tensor, extras: dict) -> tuple:
        d = self.permute(x, extras["routing_probs"], extras["routing_indices"])
        return d.hidden, {"offsets": d.offsets, "probs": d.probs, "dispatch": d}

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, align={self.dispatch.align}, "
            f"capacity_factor={self.dispatch.capacity_factor}"
        )


class Unpermute(BasicOp):
    """:func:`moekit.ops.unpermute`: sums each token's rows ``[R, H']`` back to ``[T, H']``
    (extra ``dispatch``); ``weighted=True`` multiplies by the rows' ``probs`` (extra, with
    its gradient). Context: ``graph``."""

    def __init__(self, *, weighted: bool = False) -> None:
        super().__init__()
        self.weighted = bool(weighted)
        self.extra_inputs = ("dispatch", "probs") if self.weighted else ("dispatch",)

    def _dispatch(self, extras: dict) -> Dispatch:
        d = extras["dispatch"]
        if not isinstance(d, Dispatch):
            raise TypeError(
                f"Unpermute: extra input 'dispatch' must be a Dispatch, got {type(d).__name__}"
            )
        return d

    def op_forward(self, ctx: OpContext, x: torch.Tensor, extras: dict, params: Params) -> tuple:
        d = self._dispatch(extras)

        def run(x, probs):
            dd = dataclasses.replace(d, probs=probs) if self.weighted else d
            return (unpermute(x, dd, weighted=self.weighted),)

        probs = extras["probs"] if self.weighted else None
        ctx.graph = RecordedGraph(run, (x, probs), (), ctx.saving)
        return ctx.graph.outputs[0], None

    def op_backward(self, ctx: OpContext, dy: torch.Tensor, grads: dict, params: Params) -> tuple:
        (dx, dprobs), _ = ctx.graph.backward((dy,))
        return dx, ({"probs": dprobs} if self.weighted else {}), {}

    def reference(self, x: torch.Tensor, extras: dict) -> tuple:
        d = self._dispatch(extras)
        if self.weighted:
            d = dataclasses.replace(d, probs=extras["probs"])
        return unpermute(x, d, weighted=self.weighted), {}

    def extra_repr(self) -> str:
        return f"weighted={self.weighted}"
