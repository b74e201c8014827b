"""``grouped_linear``: y = x @ weight[e]^T (+ bias[e]) per expert segment, with a weight gradient
that lands directly in the [E, N, K] layout or accumulates into an fp32 ``main_grad``."""

from __future__ import annotations

import torch

from moekit.ops._apply import direct_apply
from moekit.ops._validate import check_dtype, check_ndim, check_tensor
from moekit.ops.grouped_gemm import (
    _ragged_k_op,
    _ragged_k_out_op,
    _ragged_m_op,
    check_ragged_m_inputs,
    segment_sum_rows,
)

__all__ = ["grouped_linear"]


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offsets, bias, main_grad):
        ctx.save_for_backward(x, weight, offsets)
        # main_grad is mutated by every micro-batch's backward, so it cannot go through
        # save_for_backward (whose version check would fire); it is only written, never read.
        ctx.main_grad = main_grad
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return _ragged_m_op(x, weight.transpose(1, 2), offsets, bias, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, offsets = ctx.saved_tensors
        grad = grad.to(x.dtype)
        dx = dw = dbias = None
        if ctx.needs_input_grad[0]:
            dx = _ragged_m_op(grad, weight, offsets, None, x.dtype)  # [T, N] @ [E, N, K]
        if ctx.needs_input_grad[1]:
            if ctx.main_grad is not None:
                _ragged_k_out_op(grad.t(), x, offsets, ctx.main_grad, True)
            else:
                dw = _ragged_k_op(grad.t(), x, offsets, weight.dtype)  # [E, N, K]
        if ctx.bias_dtype is not None and ctx.needs_input_grad[3]:
            dbias = segment_sum_rows(grad, offsets).to(ctx.bias_dtype)
        return dx, dw, None, dbias, None


_apply_grouped_linear = direct_apply(_GroupedLinearFn)


def grouped_linear(
    x: torch.Tensor,  # [T, K] rows grouped by expert
    weight: torch.Tensor,  # [E, N, K] (nn.Linear layout per expert)
    offsets: torch.Tensor,  # [E] int32/int64 cumulative end offsets
    bias: torch.Tensor | None = None,  # [E, N]
    main_grad: torch.Tensor | None = None,  # [E, N, K] fp32
) -> torch.Tensor:  # [T, N]
    """Per-expert linear layer over expert-sorted rows, forward and backward in grouped GEMMs.

    With ``main_grad`` (Megatron's gradient-accumulation fusion) the weight gradient is added
    into it in place by the wgrad kernel and ``weight.grad`` is left untouched (None).
    """
    x = check_tensor("x", x)
    weight = check_tensor("weight", weight)
    check_ndim("x", x, 2, "[T, in_features]")
    check_ndim("weight", weight, 3, "[E, out_features, in_features]")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    offsets, bias = check_ragged_m_inputs(x, weight.transpose(1, 2), offsets, bias, x.dtype)
    if main_grad is not None:
        main_grad = check_tensor("main_grad", main_grad)
        check_dtype("main_grad", main_grad, (torch.float32,))
        if main_grad.shape != weight.shape or main_grad.device != weight.device:
            raise ValueError(
                f"main_grad must match weight's shape {tuple(weight.shape)} on {weight.device}, "
                f"got {tuple(main_grad.shape)} on {main_grad.device}"
            )
    return _apply_grouped_linear(x, weight, offsets, bias, main_grad)
