"""``grouped_linear_fp8``: the expert linear layer ``y = x·w[e]ᵀ`` in blockwise FP8, with autograd.

Forward: x quantized 1×128, the weight 128×128 (its FP8 copy made once per weight version and
reused by every micro-batch), :func:`moekit.ops.fp8_gemm.grouped_mm_fp8`. Backward: dy quantized
1×128 for the dgrad against the weight's transposed copy (the same blocks and scales), and
dy and x quantized 128×1 along the tokens, each from its higher-precision source, for the
wgrad (:func:`moekit.ops.fp8_gemm.grouped_mm_fp8_wgrad`), which goes into ``w.main_grad`` (fp32)
when it exists. Every expert's rows must start and end at multiples of 128 for the wgrad.
"""

from __future__ import annotations

import torch

from moekit.ops.fp8_gemm import grouped_mm_fp8, grouped_mm_fp8_wgrad
from moekit.ops.quantize import Fp8Tensor, quantize_fp8
from moekit.runtime.op import refuse_double_backward
from moekit.runtime.state import STATE

__all__ = ["fp8_weight", "grouped_linear_fp8"]


def fp8_weight(w: torch.Tensor) -> tuple[Fp8Tensor, Fp8Tensor]:
    """(w quantized 128×128, its transpose): made on the first call and again whenever w has
    changed since (its version counter moves with every in-place update, such as an
    optimizer step), so the micro-batches of one step share one copy."""
    version = (w._version, w.data_ptr())
    entry = STATE.fp8_weights.get(w)
    if entry is None or entry[0] != version:
        wq = quantize_fp8(w.detach(), axis="both")
        entry = STATE.fp8_weights[w] = (version, wq, wq.t())
    return entry[1], entry[2]


class _GroupedLinearFp8Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets, out_dtype):
        wq, wqt = fp8_weight(w)
        y = grouped_mm_fp8(quantize_fp8(x), wq, offsets, out_dtype=out_dtype)
        xt = quantize_fp8(x, axis="col", transpose=True) if ctx.needs_input_grad[1] else None
        ctx.fp8 = (wqt, xt)  # FP8 copies, not autograd inputs
        ctx.x_dtype = x.dtype
        ctx.w = w  # for its main_grad
        ctx.save_for_backward(offsets)
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("grouped_linear_fp8")
        (offsets,) = ctx.saved_tensors
        wqt, xt = ctx.fp8
        ctx.fp8 = None
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = grouped_mm_fp8(quantize_fp8(dy), wqt, offsets, out_dtype=ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dyt = quantize_fp8(dy, axis="col", transpose=True)
            main_grad = getattr(ctx.w, "main_grad", None)
            if main_grad is not None:
                grouped_mm_fp8_wgrad(dyt, xt, offsets, out=main_grad, accumulate=True)
            else:
                dw = grouped_mm_fp8_wgrad(dyt, xt, offsets).to(ctx.w.dtype)
        return dx, dw, None, None


def grouped_linear_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-expert ``x[rows of e] @ weight[e]ᵀ`` in blockwise FP8, differentiable in x and weight.

    Args:
        x: [T, K] rows grouped by expert (bf16, fp16 or fp32).
        weight: [E, N, K] (nn.Linear layout). With an fp32 ``weight.main_grad`` the weight
            gradient is added there (and ``.grad`` stays None).
        offsets: [E] int32/int64 cumulative row ends on x's device; with a gradient for the
            weight each a multiple of 128 (``permute(align=128)``).
        out_dtype: the output's dtype (default x's).

    Returns:
        [T, N]. Errors against the unquantized product are the recipe's (docs/fp8.md).
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        raise ValueError(
            f"weight must be a 3-D [E, N, K] tensor, got {getattr(weight, 'shape', weight)}"
        )
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != weight.shape[2]:
        raise ValueError(
            f"x must be [T, K = weight.shape[2] = {weight.shape[2]}], got "
            f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
        )
    return _GroupedLinearFp8Fn.apply(x, weight, offsets, out_dtype or x.dtype)
