"""Rule ``grouped_mlp``: GroupedLinear → Activate → GroupedLinear as the fused grouped MLP
(:func:`moekit.ops.grouped_mlp_forward` / :func:`moekit.ops.grouped_mlp_backward`)."""

from __future__ import annotations

import torch

from moekit.fusion.op import Decline, FusedOp, OpContext, grad_dtype
from moekit.fusion.ops.activation import Activate
from moekit.fusion.ops.grouped import GroupedLinear
from moekit.fusion.plan import Facts
from moekit.fusion.registry import register_fusion
from moekit.ops.grouped_mlp import (
    grouped_mlp,
    grouped_mlp_backward,
    grouped_mlp_forward,
    grouped_mlp_plan,
    grouped_mlp_unsupported,
)

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
    if fc1.weight.dtype != facts.dtype or fc2.weight.dtype != facts.dtype:
        return f"weights are {fc1.weight.dtype}/{fc2.weight.dtype}, the input {facts.dtype}"
    if facts.device.type == "cpu" and facts.dtype == torch.bfloat16:
        return "bfloat16 under Triton's interpreter (its tl.dot is wrong there)"
    probe = torch.empty(0, dtype=facts.dtype, device=facts.device)
    return grouped_mlp_unsupported(probe, fc2.in_features, act.glu_interleave)


class FusedGroupedMLP(FusedOp):
    """Forward: two launches (fc1 with the activation and prob scale in its epilogue, fc2),
    leaving the three ops' contexts as their own forwards would. Backward: the fused grouped
    MLP backward (five launches). A chain of just these three ops calls
    :func:`moekit.ops.grouped_mlp` itself (``autograd_forward``)."""

    autocast_native = True  # grouped_mlp casts x, the weights and biases as the chain would

    def __init__(self, ops, store_h: bool) -> None:
        super().__init__(ops)
        self.store_h = store_h

    def fuser_forward(self, ctxs: list[OpContext], x: torch.Tensor, extras: dict) -> tuple:
        fc1, act, fc2 = self.ops
        offsets = extras["offsets"]
        probs = act.scale_of(x, extras)
        kw = {"activation": act.activation, "glu_interleave": act.glu_interleave}
        plan = grouped_mlp_plan(
            x, offsets, fc1.weight, fc2.weight, probs, b1=fc1.bias, b2=fc2.bias, **kw
        )
        y, h, a = grouped_mlp_forward(
            x, offsets, fc1.weight, fc2.weight, probs, b1=fc1.bias, b2=fc2.bias,
            store_h=self.store_h, plan=plan, **kw,
        )  # fmt: skip
        ctxs[0].x, ctxs[0].offsets, ctxs[0].mlp_plan = x, offsets, plan
        ctxs[1].h, ctxs[1].probs = h, probs
        ctxs[2].x, ctxs[2].offsets = a, offsets
        return y, None

    def autograd_forward(self, x: torch.Tensor, extras: dict) -> tuple:
        fc1, act, fc2 = self.ops
        y = grouped_mlp(
            x, extras["offsets"], fc1.weight, fc2.weight, act.scale_of(x, extras),
            activation=act.activation, glu_interleave=act.glu_interleave, b1=fc1.bias,
            b2=fc2.bias,
        )  # fmt: skip
        return y, None

    def fuser_backward(self, ctxs: list[OpContext], dy: torch.Tensor, grads: dict) -> tuple:
        fc1, act, fc2 = self.ops
        x, offsets = ctxs[0].x, ctxs[0].offsets
        h, probs, a = ctxs[1].h, ctxs[1].probs, ctxs[2].x
        b1, b2 = fc1.bias, fc2.bias
        needs = (
            ctxs[0].needs_input_grad, fc1.weight.requires_grad, fc2.weight.requires_grad,
            probs is not None, b1 is not None and b1.requires_grad,
            b2 is not None and b2.requires_grad,
        )  # fmt: skip
        # the parameters' own dtype where these are per-call casts (autocast), if one for all
        w_dtype = grad_dtype(fc1.weight)
        b_dtypes = {grad_dtype(b) for b in (b1, b2) if b is not None}
        dx, dw1, dw2, dp, db1, db2 = grouped_mlp_backward(
            dy, x, offsets, fc1.weight, fc2.weight, probs, h, a, activation=act.activation,
            glu_interleave=act.glu_interleave, b1=b1, b2=b2, needs=needs,
            plan=getattr(ctxs[0], "mlp_plan", None),
            weight_grad_dtype=w_dtype if grad_dtype(fc2.weight) == w_dtype else None,
            bias_grad_dtype=b_dtypes.pop() if len(b_dtypes) == 1 else None,
        )  # fmt: skip
        params = ((dw1,) if b1 is None else (dw1, db1), (), (dw2,) if b2 is None else (dw2, db2))
        return dx, ({"probs": dp} if probs is not None else {}), params


@register_fusion(name="grouped_mlp", pattern=(GroupedLinear, Activate, GroupedLinear))
def grouped_mlp_rule(ops, facts: Facts):
    """The fused grouped MLP wherever the kernels cover the configuration."""
    reason = mlp_unsupported(facts, *ops)
    if reason:
        return Decline(reason)
    return FusedGroupedMLP(ops, store_h=facts.requires_grad)
