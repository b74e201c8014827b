"""``GroupedLinear`` basic op: E per-expert linear layers over expert-sorted rows."""

from __future__ import annotations

import torch

from moekit.fusion.op import BasicOp, OpContext, Params
from moekit.nn.grouped_linear import GroupedLinear as GroupedLinearModule
from moekit.ops.grouped_gemm import grouped_mm, segment_sum_rows
from moekit.ops.grouped_linear import grouped_linear
from moekit.reference.grouped_gemm import grouped_mm_ragged_m_ref

__all__ = ["GroupedLinear"]


class GroupedLinear(BasicOp, GroupedLinearModule):
    """``y[rows of e] = x[rows of e] @ weight[e]ᵀ (+ bias[e])``, ``weight [E, out, in]``: a
    :class:`moekit.nn.GroupedLinear` (same arguments, parameters and initialisation) as a
    basic op.

    Extra input ``offsets [E]`` (cumulative end offsets, as in :func:`moekit.ops.grouped_mm`).
    in_features and out_features must span multiples of 16 bytes. An fp32 ``weight.main_grad``
    receives the weight gradient in place. Context: ``x``, ``offsets``.
    """

    extra_inputs = ("offsets",)

    def op_forward(self, ctx: OpContext, x: torch.Tensor, extras: dict, params: Params) -> tuple:
        offsets = extras["offsets"]
        ctx.x, ctx.offsets = x, offsets
        return grouped_linear(x, params["weight"], offsets, params.get("bias")), None

    def op_backward(self, ctx: OpContext, dy: torch.Tensor, grads: dict, params: Params) -> tuple:
        x, offsets, w, b = ctx.x, ctx.offsets, params["weight"], params.get("bias")
        dy = dy.to(x.dtype).contiguous()
        dx = grouped_mm(dy, w, offsets) if ctx.needs_input_grad else None
        dw = db = None
        if w.requires_grad:
            mg = getattr(w, "main_grad", None)
            if mg is not None:
                grouped_mm(dy.t(), x, offsets, out=mg, accumulate=True)
            else:
                dw = grouped_mm(dy.t(), x, offsets)
        if b is not None and b.requires_grad:
            db = segment_sum_rows(dy, offsets).to(b.dtype)
        return dx, {}, {"weight": dw, "bias": db}

    def reference(self, x: torch.Tensor, extras: dict) -> tuple:
        w = self.weight.transpose(1, 2)
        y = grouped_mm_ragged_m_ref(x, w, extras["offsets"], x.dtype, self.bias)
        if not y.requires_grad and torch.is_grad_enabled():  # no row owned: zero gradients
            y = y + 0 * (x.sum() + w.sum()).to(y.dtype)
        return y, {}
