"""Rule ``moe``: Router → Permute → GroupedLinear → Activate → GroupedLinear → Unpermute as
the MoE layer's path (:class:`moekit.nn.MoELayer`): fused top-k routing, permute, the fused
grouped MLP with each row's prob applied in the activation, and an unweighted unpermute.

A chain that weights by the probs at the unpermute instead (``Unpermute(weighted=True)``
after an unscaled activation) gets the same result this way as long as fc2 has no bias
(``fc2(p·a) = p·fc2(a)``), and saves the weighted combine.
"""

from __future__ import annotations

import torch

from moekit.fusion.op import Decline, FusedOp, OpContext, RecordedGraph
from moekit.fusion.ops.activation import Activate
from moekit.fusion.ops.grouped import GroupedLinear
from moekit.fusion.ops.moe import Permute, Router, Unpermute
from moekit.fusion.plan import Facts
from moekit.fusion.registry import register_fusion
from moekit.fusion.rules.grouped_mlp import mlp_unsupported
from moekit.nn.moe import routed_experts
from moekit.nn.router import RouterOutput
from moekit.ops.grouped_mlp import grouped_mlp

__all__ = ["FusedMoE"]


class FusedMoE(FusedOp):
    """Runs both passes of its window; its state is the recorded graph in the first context.
    A chain of just these six ops runs :meth:`run` under autograd itself (``autograd_forward``),
    as :class:`moekit.nn.MoELayer` does. The routing and dispatch extras stay inside it."""

    makes_extras = False

    def __init__(self, ops, use_probs: bool) -> None:
        super().__init__(ops)
        self.use_probs = use_probs

    def run(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        router, permute, fc1, act, fc2, _ = self.ops
        y, probs, indices = router.route(x)  # y: x with the router's losses attached

        def experts(rows, offsets, row_probs):
            return grouped_mlp(
                rows, offsets, fc1.weight, fc2.weight, row_probs, activation=act.activation,
                glu_interleave=act.glu_interleave, b1=fc1.bias, b2=fc2.bias,
            )  # fmt: skip

        route = RouterOutput(probs, indices, router.last_counts, None, None)
        out = routed_experts(
            y, route, experts, num_experts=permute.num_experts, dispatch=permute.dispatch,
            scale_by_probs=self.use_probs,
        )  # fmt: skip
        return (out,)

    def autograd_forward(self, x: torch.Tensor, extras: dict) -> tuple:
        return self.run(x)[0], None

    def fuser_forward(self, ctxs: list[OpContext], x: torch.Tensor, extras: dict) -> tuple:
        params = [p for op in self.ops for p in op.parameters()]
        ctxs[0].graph = RecordedGraph(self.run, (x,), params, ctxs[0].saving)
        return ctxs[0].graph.outputs[0], None

    def fuser_backward(self, ctxs: list[OpContext], dy: torch.Tensor, grads: dict) -> tuple:
        (dx,), pgrads = ctxs[0].graph.backward((dy,))
        per_op, i = [], 0
        for op in self.ops:
            n = len(list(op.parameters()))
            per_op.append(pgrads[i : i + n])
            i += n
        return dx, {}, per_op


@register_fusion(
    name="moe",
    pattern=(Router, Permute, GroupedLinear, Activate, GroupedLinear, Unpermute),
    priority=10,
)
def moe_rule(ops, facts: Facts):
    router, permute, fc1, act, fc2, unperm = ops
    if act.scaled and unperm.weighted:
        return Decline("the probs scale both the activation and the unpermute")
    if unperm.weighted and fc2.bias is not None:
        return Decline("fc2 has a bias: the unpermute's weights cannot move into the activation")
    if router.num_experts != permute.num_experts or fc1.num_experts != permute.num_experts:
        return Decline(
            f"expert counts differ: router {router.num_experts}, permute "
            f"{permute.num_experts}, experts {fc1.num_experts}"
        )
    reason = mlp_unsupported(facts, fc1, act, fc2)
    if reason:
        return Decline(reason)
    return FusedMoE(ops, use_probs=act.scaled or unperm.weighted)
