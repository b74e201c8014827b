"""Rule ``grouped_mlp``: GroupedLinear → Activate → GroupedLinear as the fused grouped MLP
(:func:`moekit.ops.grouped_mlp`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moekit.fusion.op import Decline, FusedOp, Params
from moekit.fusion.ops.activation import Activate
from moekit.fusion.ops.grouped import GroupedLinear
from moekit.fusion.plan import Facts
from moekit.fusion.registry import register_fusion
from moekit.ops.grouped_mlp import fused_unsupported, grouped_mlp

__all__ = ["FusedGroupedMLP", "grouped_mlp_rule"]


def chain_mismatch(fc1: GroupedLinear, act: Activate, fc2: GroupedLinear) -> str | None:
    """Why fc1 → act → fc2 is not one expert MLP (None when it is)."""
    width = fc2.in_features * (2 if act.activation.gated else 1)
    if fc1.num_experts != fc2.num_experts:
        return f"fc1 has {fc1.num_experts} experts, fc2 {fc2.num_experts}"
    if fc1.out_features != width or fc2.out_features != fc1.in_features:
        return (
            f"widths do not chain: fc1 {fc1.in_features}→{fc1.out_features}, "
            f"{act.activation.name}, fc2 {fc2.in_features}→{fc2.out_features}"
        )
    return None


def mlp_unsupported(facts: Facts, fc1: GroupedLinear, act: Activate, fc2: GroupedLinear):
    """Why the fused kernels cannot run this MLP for calls with ``facts`` (None if they can)."""
    reason = chain_mismatch(fc1, act, fc2)
    if reason:
        return reason
    if not facts.triton:
        return "needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU)"
    if facts.ndim != 2:
        return f"the rows must be [R, H], got a {facts.ndim}-d input"
    w1, w2 = facts.dtype_of(fc1.weight), facts.dtype_of(fc2.weight)
    if w1 != facts.dtype or w2 != facts.dtype:
        return f"weights are {w1}/{w2}, the input {facts.dtype}"
    if facts.device.type == "cpu" and facts.dtype == torch.bfloat16:
        return "bfloat16 under Triton's interpreter (its tl.dot is wrong there)"
    probe = torch.empty(0, dtype=facts.dtype, device=facts.device)
    return fused_unsupported(probe, fc2.in_features, act.glu_interleave)


class FusedGroupedMLP(FusedOp):
    """The window as :func:`moekit.ops.grouped_mlp`, the fused grouped MLP with its own
    autograd: two launches forward (fc1 with the activation and prob scale in its epilogue,
    fc2), five backward."""

    # grouped_mlp casts x, the weights and biases inside an autocast region as the chain would,
    # and writes fp32 weights' gradients in fp32 from its fp32 accumulators
    autocast_native = True

    def autograd_forward(self, x: torch.Tensor, extras: dict, params: Sequence[Params]) -> tuple:
        (fc1, _, fc2), act = params, self.ops[1]
        y = grouped_mlp(
            x, extras["offsets"], fc1["weight"], fc2["weight"], act.scale_of(x, extras),
            activation=act.activation, glu_interleave=act.glu_interleave, b1=fc1.get("bias"),
            b2=fc2.get("bias"),
        )  # fmt: skip
        return y, None


@register_fusion(name="grouped_mlp", pattern=(GroupedLinear, Activate, GroupedLinear))
def grouped_mlp_rule(ops, facts: Facts):
    """The fused grouped MLP wherever the kernels cover the configuration."""
    reason = mlp_unsupported(facts, *ops)
    if reason:
        return Decline(reason)
    return FusedGroupedMLP(ops)
