"""Rule ``moe``: Router → Permute → GroupedLinear → Activate → GroupedLinear → Unpermute as
the MoE layer's path (:class:`moekit.nn.MoELayer`): fused top-k routing, permute, the fused
grouped MLP with each row's prob applied in the activation, and an unweighted unpermute.

A chain that weights by the probs at the unpermute instead (``Unpermute(weighted=True)``
after an unscaled activation) gets the same result this way as long as fc2 has no bias
(``fc2(p·a) = p·fc2(a)``), and saves the weighted combine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moekit.fusion.op import Decline, FusedOp, Params
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
    """The window as :class:`moekit.nn.MoELayer` runs it, under autograd: the router's
    :meth:`~moekit.fusion.Router.route`, then :func:`moekit.nn.moe.routed_experts` with
    :func:`moekit.ops.grouped_mlp` as the experts. The routing and dispatch extras stay
    inside it."""

    makes_extras = False

    def __init__(self, ops, use_probs: bool) -> None:
        super().__init__(ops)
        self.use_probs = use_probs

    def autograd_forward(self, x: torch.Tensor, extras: dict, params: Sequence[Params]) -> tuple:
        router, permute, _, act, _, _ = self.ops
        fc1, fc2 = params[2], params[4]
        y, probs, indices = router.route(x, params[0]["weight"])  # y: x with the losses on

        def experts(rows, offsets, row_probs):
            return grouped_mlp(
                rows, offsets, fc1["weight"], fc2["weight"], row_probs,
                activation=act.activation, glu_interleave=act.glu_interleave,
                b1=fc1.get("bias"), b2=fc2.get("bias"),
            )  # fmt: skip

        route = RouterOutput(probs, indices, router.last_counts, None, None)
        out = routed_experts(
            y, route, experts, num_experts=permute.num_experts, dispatch=permute.dispatch,
            scale_by_probs=self.use_probs,
        )  # fmt: skip
        return out, None


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
