"""``grouped_mlp_fp8``: the expert MLP fc1 → (prob-scaled) activation → fc2 with both GEMMs in
blockwise FP8 (:func:`moekit.ops.fp8_linear.grouped_linear_fp8`).

Quantization points, forward: the rows (1×128, usually done by ``permute(..., fp8=)``), both
weights (128×128, cached per weight version), the activation output (1×128 for fc2, and 128×1
along the tokens for fc2's weight gradient, both from the same fp32 values). Backward: the
output gradient of each GEMM (1×128 for its dgrad, 128×1 along the tokens for its wgrad), and
the rows again along the tokens, straight from their tokens. The activation and its backward
run in fp32 from the bf16 pre-activation h, which is all they keep. The router, the combine
and everything outside the two GEMMs stay in the caller's precision.
"""

from __future__ import annotations

import torch

from moekit.activations import Activation, apply_activation, resolve_activation
from moekit.ops import validation as v
from moekit.ops.fp8_linear import grouped_linear_fp8
from moekit.ops.quantize import Fp8Recipe, Fp8Tensor
from moekit.runtime.op import refuse_double_backward

__all__ = ["grouped_mlp_fp8"]


class _ScaledActivationFn(torch.autograd.Function):
    """a = act(h) · probs in fp32, returned in h's dtype; keeps only h and probs."""

    @staticmethod
    def forward(ctx, h, probs, act, interleave):
        ctx.save_for_backward(h, probs)
        ctx.act = (act, interleave)
        a = apply_activation(h.float(), act, interleave)
        return (a * probs.float()[:, None] if probs is not None else a).to(h.dtype)

    @staticmethod
    def backward(ctx, da):
        refuse_double_backward("grouped_mlp_fp8")
        h, probs = ctx.saved_tensors
        act, interleave = ctx.act
        with torch.enable_grad():
            hf = h.detach().float().requires_grad_()
            a = apply_activation(hf, act, interleave)
        d = da.float() if probs is None else da.float() * probs.float()[:, None]
        (dh,) = torch.autograd.grad(a, hf, d)
        dprobs = None
        if probs is not None and ctx.needs_input_grad[1]:
            dprobs = (da.float() * a.detach()).sum(dim=1).to(probs.dtype)
        return dh.to(h.dtype), dprobs, None, None


def grouped_mlp_fp8(
    x: torch.Tensor | Fp8Tensor,
    offsets: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    probs: torch.Tensor | None = None,
    *,
    activation: str | Activation = "swiglu",
    glu_interleave: int | None = None,
    recipe: Fp8Recipe | None = None,
) -> torch.Tensor:
    """Expert MLP over expert-sorted rows, ``y = fc2(act(fc1(x)) · probs)``, both GEMMs in FP8.

    Args:
        x: [R, H] rows grouped by expert: bf16/fp16/fp32, or an Fp8Tensor of them quantized
            1×128 (``permute(..., fp8=)``: quantized once, differentiable through its anchor).
        offsets: [E] int32/int64 cumulative row ends, each a multiple of 128 when a weight
            needs a gradient (``permute(align=128)``).
        w1: [E, 2F, H] (gated; ``[:F]`` gate rows) or [E, F, H]; w2: [E, H, F]. H and F must
            be multiples of 16; fp32 ``main_grad`` attributes receive the weight gradients.
        probs: optional [R] routing probabilities scaling each row's activation output.
        activation, glu_interleave: as for :func:`moekit.ops.grouped_mlp`.
        recipe: an :class:`~moekit.ops.Fp8Recipe` (None: blockwise).

    Returns:
        [R, H] in x's dtype (an Fp8Tensor's source dtype); rows past ``offsets[-1]`` are zero.
        Differentiable in x, w1, w2 and probs.
    """
    act = resolve_activation(activation)
    recipe = recipe or Fp8Recipe()
    if not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"recipe must be a moekit.ops.Fp8Recipe, got {type(recipe).__name__}")
    if recipe.scaling != "blockwise":
        raise ValueError(f"grouped_mlp_fp8 runs the blockwise recipe, got {recipe.scaling!r}")
    rows = x.data if isinstance(x, Fp8Tensor) else v.check_tensor("x", x)
    v.check_ndim("x", rows, 2, "[R, H]")
    v.check_mlp_weights(rows, w1, w2, act, same_dtype=False)
    v.check_interleave(glu_interleave, act, w2.shape[2])
    for name, size in (("H (x.shape[1])", rows.shape[1]), ("F (w2.shape[2])", w2.shape[2])):
        if size % 16:
            raise ValueError(f"{name} must be a multiple of 16 for the FP8 GEMMs, got {size}")
    if probs is not None:
        probs = v.check_tensor("probs", probs)
        v.check_ndim("probs", probs, 1, "[R]")
        v.check_dim_size("probs", probs, 0, rows.shape[0], "x.shape[0] (R)")
    dtype = x.orig_dtype if isinstance(x, Fp8Tensor) else x.dtype
    h = grouped_linear_fp8(x, w1, offsets, out_dtype=dtype)
    a = _ScaledActivationFn.apply(h, probs, act, glu_interleave)
    return grouped_linear_fp8(a, w2, offsets, out_dtype=dtype)
