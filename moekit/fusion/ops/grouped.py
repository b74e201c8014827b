"""``GroupedLinear`` basic op: E per-expert linear layers over expert-sorted rows."""

from __future__ import annotations

import math

import torch
from torch import nn

from moekit.fusion.op import BasicOp, OpContext
from moekit.fusion.ops.linear import accumulate_weight_grad
from moekit.ops.grouped_gemm import grouped_mm, segment_sum_rows
from moekit.ops.grouped_linear import check_features, grouped_linear
from moekit.reference.grouped_gemm import grouped_mm_ragged_m_ref

__all__ = ["GroupedLinear"]


class GroupedLinear(BasicOp):
    """``y[rows of e] = x[rows of e] @ weight[e]ᵀ (+ bias[e])``, ``weight [E, out, in]``.

    Extra input ``offsets [E]`` (cumulative end offsets, as in :func:`moekit.ops.grouped_mm`).
    in_features and out_features must span multiples of 16 bytes (as for
    :class:`moekit.nn.GroupedLinear`). An fp32 ``weight.main_grad`` receives the weight
    gradient in place. Context: ``x``, ``offsets``.
    """

    extra_inputs = ("offsets",)

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, v in (
            ("num_experts", num_experts), ("in_features", in_features),
            ("out_features", out_features),
        ):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        check_features(in_features, out_features, dtype or torch.get_default_dtype())
        self.num_experts, self.in_features, self.out_features = (
            num_experts, in_features, out_features,
        )  # fmt: skip
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features, **kw)) if bias else None
        bound = 1.0 / math.sqrt(in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def op_forward(self, ctx: OpContext, x: torch.Tensor, extras: dict) -> tuple:
        offsets = extras["offsets"]
        ctx.x, ctx.offsets = x, offsets
        return grouped_linear(x, self.weight, offsets, self.bias), None

    def op_backward(self, ctx: OpContext, dy: torch.Tensor, grads: dict) -> tuple:
        x, offsets, w = ctx.x, ctx.offsets, self.weight
        dy = dy.to(x.dtype).contiguous()
        dx = grouped_mm(dy, w, offsets) if ctx.needs_input_grad else None
        dw = None
        if w.requires_grad:
            mg = getattr(w, "main_grad", None)
            if mg is not None:
                grouped_mm(dy.t(), x, offsets, out=mg, accumulate=True)
            else:
                dw = accumulate_weight_grad(w, grouped_mm(dy.t(), x, offsets))
        if self.bias is None:
            return dx, {}, (dw,)
        db = segment_sum_rows(dy, offsets).to(self.bias.dtype) if self.bias.requires_grad else None
        return dx, {}, (dw, db)

    def reference(self, x: torch.Tensor, extras: dict) -> tuple:
        w = self.weight.transpose(1, 2)
        y = grouped_mm_ragged_m_ref(x, w, extras["offsets"], x.dtype, self.bias)
        if not y.requires_grad and torch.is_grad_enabled():  # no row owned: zero gradients
            y = y + 0 * (x.sum() + w.sum()).to(y.dtype)
        return y, {}

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}"
        )
