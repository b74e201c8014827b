"""``grouped_linear_fp8``: the expert linear layer ``y = x·w[e]ᵀ`` in FP8, with autograd, under a
:class:`~moekit.ops.quantize.Fp8Recipe`.

Blockwise (the default): x quantized 1×128, the weight 128×128, and for the dgrad dy 1×128
against the weight's transposed copy (the same blocks and scales). Rowwise: x and dy one scale
per row, the weight one scale per output channel for the forward and, for the dgrad (which
contracts over N), one per input channel, a second copy quantized from the weight itself.
The weight's FP8 copies are made once per weight version and recipe and reused by every
micro-batch (:func:`fp8_weight`). Under both recipes the weight gradient's operands, dy and x,
are quantized 128×1 along the tokens, each from its higher-precision source, for
:func:`moekit.ops.fp8_gemm.grouped_mm_fp8_wgrad`, which goes into ``w.main_grad`` (fp32) when
it exists. Every expert's rows must start and end at multiples of 128 for the wgrad.
"""

from __future__ import annotations

import torch

from moekit.ops.fp8_gemm import grouped_mm_fp8, grouped_mm_fp8_wgrad
from moekit.ops.quantize import Fp8Recipe, Fp8Tensor, quantize_fp8
from moekit.runtime.op import refuse_double_backward
from moekit.runtime.state import STATE

__all__ = ["fp8_weight", "grouped_linear_fp8"]

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


def _quantize_rows(t: torch.Tensor, recipe: Fp8Recipe) -> Fp8Tensor:
    """Activations or output gradients [T, K] as the forward / dgrad GEMM's a operand."""
    block = None if recipe.scaling == "rowwise" else 128
    return quantize_fp8(t, block=block, pow2_scale=recipe.pow2_scale)


def _quantize_tokens(t: torch.Tensor, recipe: Fp8Recipe) -> Fp8Tensor:
    """[T, K] as a wgrad operand: 128×1 blocks along the tokens, stored [K, T] (both recipes)."""
    return quantize_fp8(t, axis="col", transpose=True, pow2_scale=recipe.pow2_scale)


class _GroupedLinearFp8Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets, out_dtype, recipe):
        wq, wq_dgrad = fp8_weight(w, recipe)
        y = grouped_mm_fp8(_quantize_rows(x, recipe), wq, offsets, out_dtype=out_dtype)
        xt = _quantize_tokens(x, recipe) if ctx.needs_input_grad[1] else None
        ctx.fp8 = (wq_dgrad, xt)  # FP8 copies, not autograd inputs
        ctx.x_dtype, ctx.recipe = x.dtype, recipe
        ctx.w = w  # for its main_grad
        ctx.save_for_backward(offsets)
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("grouped_linear_fp8")
        (offsets,) = ctx.saved_tensors
        wq_dgrad, xt = ctx.fp8
        ctx.fp8 = None
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dyq = _quantize_rows(dy, ctx.recipe)
            dx = grouped_mm_fp8(dyq, wq_dgrad, offsets, out_dtype=ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dyt = _quantize_tokens(dy, ctx.recipe)
            main_grad = getattr(ctx.w, "main_grad", None)
            if main_grad is not None:
                grouped_mm_fp8_wgrad(dyt, xt, offsets, out=main_grad, accumulate=True)
            else:
                dw = grouped_mm_fp8_wgrad(dyt, xt, offsets).to(ctx.w.dtype)
        return dx, dw, None, None, None


def grouped_linear_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    recipe: Fp8Recipe | None = None,
) -> torch.Tensor:
    """Per-expert ``x[rows of e] @ weight[e]ᵀ`` in FP8, differentiable in x and weight.

    Args:
        x: [T, K] rows grouped by expert (bf16, fp16 or fp32).
        weight: [E, N, K] (nn.Linear layout). With an fp32 ``weight.main_grad`` the weight
            gradient is added there (and ``.grad`` stays None).
        offsets: [E] int32/int64 cumulative row ends on x's device; with a gradient for the
            weight each a multiple of 128 (``permute(align=128)``).
        out_dtype: the output's dtype (default x's).
        recipe: how the operands are scaled (:class:`~moekit.ops.quantize.Fp8Recipe`; None:
            ``Fp8Recipe()``, blockwise).

    Returns:
        [T, N]. Errors against the unquantized product are the recipe's (docs/fp8.md).
    """
    if recipe is not None and not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"recipe must be an Fp8Recipe or None, got {type(recipe).__name__}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        raise ValueError(
            f"weight must be a 3-D [E, N, K] tensor, got {getattr(weight, 'shape', weight)}"
        )
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != weight.shape[2]:
        raise ValueError(
            f"x must be [T, K = weight.shape[2] = {weight.shape[2]}], got "
            f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
        )
    recipe = recipe or BLOCKWISE
    return _GroupedLinearFp8Fn.apply(x, weight, offsets, out_dtype or x.dtype, recipe)
