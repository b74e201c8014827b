"""``grouped_linear_fp8``: the expert linear layer ``y = x·w[e]ᵀ`` in blockwise FP8, with autograd.

Forward: x quantized 1×128 (or given quantized, e.g. by ``permute(..., fp8=)``), the weight
128×128 (its FP8 copy made once per weight version and reused by every micro-batch),
:func:`moekit.ops.fp8_gemm.grouped_mm_fp8`. Backward: dy quantized 1×128 for the dgrad against
the weight's transposed copy (the same blocks and scales), and dy and x quantized 128×1 along
the tokens, each from its higher-precision source, for the wgrad
(:func:`moekit.ops.fp8_gemm.grouped_mm_fp8_wgrad`), which goes into ``w.main_grad`` (fp32) when
it exists. Every expert's rows must start and end at multiples of 128 for the wgrad.

What the wgrad keeps of x: rows permuted from tokens (an Fp8Tensor with ``source_rows``) are
quantized along the tokens in the backward straight from the tokens, which stay alive anyway;
any other x is quantized along the tokens in the forward and only those e4m3 bytes are kept.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moekit.ops.fp8_gemm import grouped_mm_fp8, grouped_mm_fp8_wgrad
from moekit.ops.quantize import Fp8Tensor, quantize_fp8, requantize_fp8
from moekit.runtime.op import refuse_double_backward
from moekit.runtime.state import STATE

__all__ = ["fp8_weight", "grouped_linear_fp8", "wgrad_operand"]


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


def wgrad_operand(xq: Fp8Tensor) -> Callable[[], Fp8Tensor]:
    """x quantized 128×1 along the tokens, stored [K, T], for the backward: later from the
    tokens for permuted rows, now (keeping only the e4m3 bytes) otherwise."""
    if xq.col is not None:
        return lambda: xq.col
    if xq.source is not None and xq.source_rows is not None:
        return lambda: requantize_fp8(xq, axis="col", transpose=True)
    xt = requantize_fp8(xq, axis="col", transpose=True)
    return lambda: xt


class _GroupedLinearFp8Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_anchor, w, xq, offsets, out_dtype):
        wq, wqt = fp8_weight(w)
        y = grouped_mm_fp8(xq, wq, offsets, out_dtype=out_dtype)
        ctx.wqt = wqt
        ctx.xt = wgrad_operand(xq) if ctx.needs_input_grad[1] else None
        ctx.x_dtype = x_anchor.dtype
        ctx.w = w  # for its main_grad
        ctx.save_for_backward(offsets)
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("grouped_linear_fp8")
        (offsets,) = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = grouped_mm_fp8(quantize_fp8(dy.detach()), ctx.wqt, offsets, out_dtype=ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dyt = quantize_fp8(dy.detach(), axis="col", transpose=True)
            xt = ctx.xt()
            main_grad = getattr(ctx.w, "main_grad", None)
            if main_grad is not None:
                grouped_mm_fp8_wgrad(dyt, xt, offsets, out=main_grad, accumulate=True)
            else:
                dw = grouped_mm_fp8_wgrad(dyt, xt, offsets).to(ctx.w.dtype)
        ctx.wqt = ctx.xt = None
        return dx, dw, None, None, None


def grouped_linear_fp8(
    x: torch.Tensor | Fp8Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-expert ``x[rows of e] @ weight[e]ᵀ`` in blockwise FP8, differentiable in x and weight.

    Args:
        x: [T, K] rows grouped by expert (bf16, fp16 or fp32), or an Fp8Tensor of them
            quantized 1×128 (``quantize_fp8(x)``, ``permute(..., fp8=)``), differentiable
            through its anchor.
        weight: [E, N, K] (nn.Linear layout). With an fp32 ``weight.main_grad`` the weight
            gradient is added there (and ``.grad`` stays None).
        offsets: [E] int32/int64 cumulative row ends on x's device; with a gradient for the
            weight each a multiple of 128 (``permute(align=128)``).
        out_dtype: the output's dtype (default x's, an Fp8Tensor's source's).

    Returns:
        [T, N]. Errors against the unquantized product are the recipe's (docs/fp8.md).
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        raise ValueError(
            f"weight must be a 3-D [E, N, K] tensor, got {getattr(weight, 'shape', weight)}"
        )
    xq = x if isinstance(x, Fp8Tensor) else None
    shape = xq.shape if xq is not None else getattr(x, "shape", None)
    if shape is None or len(shape) != 2 or shape[1] != weight.shape[2]:
        raise ValueError(
            f"x must be [T, K = weight.shape[2] = {weight.shape[2]}], got "
            f"{tuple(shape) if shape is not None else type(x).__name__}"
        )
    if xq is None:
        xq = quantize_fp8(x)
    anchor = xq.anchor
    if anchor is None:  # x needs no gradient: a stand-in of its shape for the Function
        anchor = torch.empty((), dtype=xq.orig_dtype, device=xq.device).expand(xq.shape)
    return _GroupedLinearFp8Fn.apply(anchor, weight, xq, offsets, out_dtype or anchor.dtype)
