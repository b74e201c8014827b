"""``grouped_linear_fp8``: the expert linear layer ``y = x·w[e]ᵀ`` in FP8, with autograd, under a
:class:`~moekit.ops.quantize.Fp8Recipe`.

Blockwise (the default): x quantized 1×128, the weight 128×128, and for the dgrad dy 1×128
against the weight's transposed copy (the same blocks and scales). Rowwise: x and dy one scale
per row, the weight one scale per output channel for the forward and, for the dgrad (which
contracts over N), one per input channel, a second copy quantized from the weight itself.
The weight's FP8 copies are made once per weight version and recipe and reused by every
micro-batch (:func:`fp8_weight`). x may come quantized already (``permute(..., fp8=)``).
Under both recipes the weight gradient's operands, dy and x, are quantized 128×1 along the
tokens, each from its higher-precision source, for
:func:`moekit.ops.fp8_gemm.grouped_mm_fp8_wgrad`, which goes into ``w.main_grad`` (fp32) when
it exists. Every expert's rows must start and end at multiples of 128 for the wgrad.

What the wgrad keeps of x: a token-wise copy its producer made (``Fp8Tensor.col``); rows
permuted from tokens (``source_rows``) are quantized along the tokens in the backward straight
from the tokens, which stay alive anyway; any other x is quantized along the tokens in the
forward and only those e4m3 bytes are kept.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moekit.ops.fp8_gemm import grouped_mm_fp8, grouped_mm_fp8_wgrad
from moekit.ops.quantize import (
    Fp8Recipe,
    Fp8Tensor,
    quantize_fp8,
    quantize_fp8_two_ways,
    requantize_fp8,
)
from moekit.runtime.op import refuse_double_backward
from moekit.runtime.state import STATE

__all__ = ["fp8_weight", "grouped_linear_fp8", "wgrad_operand"]

BLOCKWISE = Fp8Recipe()


def _quantize_weight(w: torch.Tensor, recipe: Fp8Recipe) -> tuple[Fp8Tensor, Fp8Tensor]:
    """(forward operand [E, N, K], dgrad operand stored [E, K, N]) of w under ``recipe``."""
    pow2 = recipe.pow2_scale
    if recipe.scaling == "rowwise":  # per output channel; per input channel, from w itself
        fwd = quantize_fp8(w, axis="row", block=None, pow2_scale=pow2)
        return fwd, quantize_fp8(w, axis="col", block=None, pow2_scale=pow2, transpose=True)
    wq = quantize_fp8(w, axis="both", pow2_scale=pow2)
    return wq, wq.t()


def fp8_weight(w: torch.Tensor, recipe: Fp8Recipe | None = None) -> tuple[Fp8Tensor, Fp8Tensor]:
    """(w quantized for the forward, its dgrad operand) under ``recipe`` (None: blockwise):
    128×128 and its transpose, or rowwise per output channel and per input channel (stored
    [E, K, N]). Made on the first call and again whenever w has changed since (its version
    counter moves with every in-place update, such as an optimizer step), so the
    micro-batches of one step share one copy; each recipe keeps its own."""
    recipe = recipe or BLOCKWISE
    version = (w._version, w.data_ptr())
    copies = STATE.fp8_weights.get(w, {})
    entry = copies.get(recipe)
    if entry is None or entry[0] != version:
        # copies of an older version go, whatever their recipe: none would serve again
        copies = {r: c for r, c in copies.items() if c[0] == version}
        entry = copies[recipe] = (version, *_quantize_weight(w.detach(), recipe))
        STATE.fp8_weights[w] = copies
    return entry[1], entry[2]


def wgrad_operand(xq: Fp8Tensor, pow2_scale: bool = False) -> Callable[[], Fp8Tensor]:
    """x quantized 128×1 along the tokens, stored [K, T], for the backward: the producer's copy,
    later from the tokens for permuted rows, now (keeping only the e4m3 bytes) otherwise. The
    closure holds only what the backward needs, never x's own e4m3 rows."""
    if xq.col is not None:
        col = xq.col
        return lambda: col
    if xq.source is not None and xq.source_rows is not None:
        source, rows = xq.source, xq.source_rows
        return lambda: quantize_fp8(
            source, axis="col", transpose=True, pow2_scale=pow2_scale, rows=rows
        )
    xt = requantize_fp8(xq, axis="col", transpose=True, pow2_scale=pow2_scale)
    return lambda: xt


def _quantize_rows(t: torch.Tensor, recipe: Fp8Recipe) -> Fp8Tensor:
    """Activations or output gradients [T, K] as the forward / dgrad GEMM's a operand."""
    return quantize_fp8(t, block=recipe.row_block, pow2_scale=recipe.pow2_scale)


def _quantize_tokens(t: torch.Tensor, recipe: Fp8Recipe) -> Fp8Tensor:
    """[T, K] as a wgrad operand: 128×1 blocks along the tokens, stored [K, T] (both recipes)."""
    return quantize_fp8(t, axis="col", transpose=True, pow2_scale=recipe.pow2_scale)


class _GroupedLinearFp8Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_anchor, w, xq, offsets, out_dtype, recipe):
        wq, ctx.wq_dgrad = fp8_weight(w, recipe)
        y = grouped_mm_fp8(xq, wq, offsets, out_dtype=out_dtype)
        ctx.xt = wgrad_operand(xq, recipe.pow2_scale) if ctx.needs_input_grad[1] else None
        ctx.x_dtype, ctx.recipe = x_anchor.dtype, recipe
        ctx.w = w  # for its main_grad
        ctx.save_for_backward(offsets)
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("grouped_linear_fp8")
        (offsets,) = ctx.saved_tensors
        dx = dw = None
        dy = dy.detach()
        dyq = dyt = None
        if all(ctx.needs_input_grad[:2]) and ctx.recipe.row_block == 128:  # one read of dy
            dyq = quantize_fp8_two_ways(dy, pow2_scale=ctx.recipe.pow2_scale)
            dyt = dyq.col
        if ctx.needs_input_grad[0]:
            dyq = dyq if dyq is not None else _quantize_rows(dy, ctx.recipe)
            dx = grouped_mm_fp8(dyq, ctx.wq_dgrad, offsets, out_dtype=ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dyt = dyt if dyt is not None else _quantize_tokens(dy, ctx.recipe)
            xt = ctx.xt()
            main_grad = getattr(ctx.w, "main_grad", None)
            if main_grad is not None:
                grouped_mm_fp8_wgrad(dyt, xt, offsets, out=main_grad, accumulate=True)
            else:
                dw = grouped_mm_fp8_wgrad(dyt, xt, offsets, out_dtype=ctx.w.dtype)
        ctx.wq_dgrad = ctx.xt = None
        return dx, dw, None, None, None, None


def grouped_linear_fp8(
    x: torch.Tensor | Fp8Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    recipe: Fp8Recipe | None = None,
) -> torch.Tensor:
    """Per-expert ``x[rows of e] @ weight[e]ᵀ`` in FP8, differentiable in x and weight.

    Args:
        x: [T, K] rows grouped by expert (bf16, fp16 or fp32), or an Fp8Tensor of them
            quantized 1×128 (``quantize_fp8(x)``, ``permute(..., fp8=)``), differentiable
            through its anchor.
        weight: [E, N, K] (nn.Linear layout). With an fp32 ``weight.main_grad`` the weight
            gradient is added there (and ``.grad`` stays None).
        offsets: [E] int32/int64 cumulative row ends on x's device; with a gradient for the
            weight each a multiple of 128 (``permute(align=128)``).
        out_dtype: the output's dtype (default x's, an Fp8Tensor's source's).
        recipe: how the operands are scaled (:class:`~moekit.ops.quantize.Fp8Recipe`; None:
            ``Fp8Recipe()``, blockwise); a quantized x must follow it.

    Returns:
        [T, N]. Errors against the unquantized product are the recipe's (docs/fp8.md).
    """
    if recipe is not None and not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"recipe must be an Fp8Recipe or None, got {type(recipe).__name__}")
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
    recipe = recipe or BLOCKWISE
    if xq is None:
        xq = _quantize_rows(x, recipe)
    elif xq.block != recipe.row_block or xq.axis != "row":
        raise ValueError(
            f"x must be quantized along its rows as the {recipe.scaling} recipe does, got "
            f"axis={xq.axis!r}, block={xq.block}"
        )
    anchor = xq.anchor_or_stand_in()
    out_dtype = out_dtype or anchor.dtype
    return _GroupedLinearFp8Fn.apply(anchor, weight, xq, offsets, out_dtype, recipe)
