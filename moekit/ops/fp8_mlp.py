"""``grouped_mlp_fp8``: the expert MLP fc1 → (prob-scaled) activation → fc2 with both GEMMs in
blockwise FP8.

Quantization points, forward: the rows (1×128, usually done by ``permute(..., fp8=)``), both
weights (128×128, cached per weight version), the activation output (1×128 for fc2, and 128×1
along the tokens for fc2's weight gradient). Backward: the output gradient of each GEMM (1×128
for its dgrad, 128×1 along the tokens for its wgrad), and the rows again along the tokens,
straight from their tokens. Everything outside the two GEMMs stays in the caller's precision.

Where F is a multiple of 128 (and so the GLU interleave), the activation and its gradient are
one kernel each (:mod:`moekit.kernels.fp8_mlp`): the activation output a = act(h) · probs,
and in backward dh, are computed in fp32 from the saved bf16 pre-activation h and written only
quantized, each both ways, so neither exists in bf16. (Quantizing a in fc1's GEMM epilogue
instead measured 1.8x slower on an H200 at the Qwen3-30B-A3B layer: the two extra outputs of
the 128x128 tiles cost the GEMM more than a separate pass over h.) Other sizes run the
composition of :func:`~moekit.ops.fp8_linear.grouped_linear_fp8` and the activation in fp32
(a and dh then rounded to x's dtype before they are quantized), with a one-time warning.
"""

from __future__ import annotations

import torch

from moekit.activations import GATED, Activation, apply_activation, resolve_activation
from moekit.kernels import fp8_mlp as act_kernels
from moekit.kernels import grouped_mlp as mlp_kernels
from moekit.kernels.fp8_mlp import Fp8Out
from moekit.ops import validation as v
from moekit.ops.fp8_gemm import grouped_mm_fp8, grouped_mm_fp8_wgrad
from moekit.ops.fp8_linear import fp8_weight, grouped_linear_fp8, wgrad_operand
from moekit.ops.quantize import Fp8Recipe, Fp8Tensor, quantize_fp8, stand_in
from moekit.reference.fp8 import quantize_fp8_ref
from moekit.runtime.device import use_triton
from moekit.runtime.op import kernel_op, refuse_double_backward
from moekit.runtime.replay import replayed, tensor_key
from moekit.runtime.state import memoized, warn_once
from moekit.tuning.fp8 import ACT_BWD_TILE, ACT_TILE

__all__ = ["grouped_mlp_fp8"]

BLOCK = 128  # the recipe's block


@memoized
def _activation(name: str, limit: float, alpha: float, offset: float) -> Activation:
    return Activation(name, limit=limit, alpha=alpha, offset=offset)


def _activation_grads(h, probs, da, act, interleave) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dh in h's dtype, dprobs or None) of a = act(h) · probs, in fp32 from h."""
    with torch.enable_grad():
        hf = h.detach().float().requires_grad_()
        a = apply_activation(hf, act, interleave)
    d = da.float() if probs is None else da.float() * probs.float()[:, None]
    (dh,) = torch.autograd.grad(a, hf, d)
    dprobs = None if probs is None else (da.float() * a.detach()).sum(dim=1).to(probs.dtype)
    return dh.to(h.dtype), dprobs


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
        dh, dprobs = _activation_grads(h, probs, da, *ctx.act)
        return dh, dprobs if ctx.needs_input_grad[1] else None, None, None


def _act_fake(h, probs, offsets, act_name, act_consts, interleave, pow2):
    R, W1 = h.shape
    F = W1 // 2 if act_name in GATED else W1
    e4m3, f32 = dict(dtype=torch.float8_e4m3fn), dict(dtype=torch.float32)
    return (h.new_empty(R, F, **e4m3), h.new_empty(R, F // BLOCK, **f32),
            h.new_empty(F, R, **e4m3), h.new_empty(R // BLOCK, F, **f32))  # fmt: skip


def _rows_past_end(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x with its rows past offsets[-1] zeroed (the reference path: offsets on the host)."""
    keep = torch.arange(x.shape[0], device=x.device) < offsets[-1]
    return torch.where(keep[:, None], x, 0.0)


def _both_ways(t: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, ...]:
    """The reference's two quantizations of fp32 t [R, C]: 1×128 and 128×1 (stored [C, R])."""
    q, s = quantize_fp8_ref(t, "row", BLOCK, pow2)
    qt, st = quantize_fp8_ref(t, "col", BLOCK, pow2)
    return q, s, qt.t().contiguous(), st


@kernel_op("grouped_mlp_fp8_act", fake=_act_fake)
def _act(
    h: torch.Tensor,  # [R, W1] pre-activation
    probs: torch.Tensor | None,  # [R]
    offsets: torch.Tensor,  # [E] int32, multiples of 128
    act_name: str,
    act_consts: list[float],  # the activation's limit, alpha, offset
    interleave: int,  # 0: [gate | up] halves
    pow2: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a [R, F] e4m3, its 1×128 scales, aT [F, R] e4m3, its 128×1 scales) of a = act(h) ·
    probs, computed in fp32 and quantized from it; zeros past offsets[-1]."""
    act = _activation(act_name, *act_consts)
    if not use_triton(h):
        a = apply_activation(h.float(), act, interleave or None)
        a = a * probs.float()[:, None] if probs is not None else a
        return _both_ways(_rows_past_end(a, offsets), pow2)
    outs = _act_fake(h, probs, offsets, act_name, act_consts, interleave, pow2)
    out = Fp8Out(outs[0].view(torch.uint8), outs[1], outs[2].view(torch.uint8), outs[3])
    key = None
    if h.is_cuda:
        key = ("grouped_mlp_fp8_act", act, interleave, pow2,
               *map(tensor_key, (h, probs, offsets)))  # fmt: skip
    replayed(
        key, (h, probs, offsets, *outs),
        lambda: act_kernels.act_fp8(h, probs, offsets, out, act, interleave or None, pow2,
                                    ACT_TILE),
    )  # fmt: skip
    return outs


def _act_bwd_fake(h, da, probs, offsets, act_name, act_consts, interleave, pow2):
    R, W1 = h.shape
    e4m3, f32 = dict(dtype=torch.float8_e4m3fn), dict(dtype=torch.float32)
    dp = probs.new_empty(R) if probs is not None else h.new_empty(0, dtype=torch.float32)
    return (h.new_empty(R, W1, **e4m3), h.new_empty(R, W1 // BLOCK, **f32),
            h.new_empty(W1, R, **e4m3), h.new_empty(R // BLOCK, W1, **f32), dp)  # fmt: skip


@kernel_op("grouped_mlp_fp8_act_bwd", fake=_act_bwd_fake, none_outputs=True)
def _act_bwd(
    h: torch.Tensor,  # [R, W1] saved pre-activation
    da: torch.Tensor,  # [R, F] gradient of the activation output
    probs: torch.Tensor | None,  # [R]
    offsets: torch.Tensor,  # [E] int32, multiples of 128
    act_name: str,
    act_consts: list[float],
    interleave: int,
    pow2: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh [R, W1] e4m3, its 1×128 scales, dhT [W1, R] e4m3, its 128×1 scales, dprobs [R]) of
    a = act(h) · probs, dh computed in fp32 and quantized from it; zeros past offsets[-1].
    dprobs is None without probs (an empty tensor through the dispatcher)."""
    act = _activation(act_name, *act_consts)
    if not use_triton(h):
        with torch.enable_grad():
            hf = h.detach().float().requires_grad_()
            a = apply_activation(hf, act, interleave or None)
        d = da.float() if probs is None else da.float() * probs.float()[:, None]
        (dh,) = torch.autograd.grad(a, hf, d)
        dp = None
        if probs is not None:
            dp = _rows_past_end((da.float() * a.detach()).sum(1, keepdim=True), offsets)
            dp = dp[:, 0].to(probs.dtype)
        return (*_both_ways(_rows_past_end(dh, offsets), pow2), dp)
    *outs, dp = _act_bwd_fake(h, da, probs, offsets, act_name, act_consts, interleave, pow2)
    dp = dp if probs is not None else None
    out = Fp8Out(outs[0].view(torch.uint8), outs[1], outs[2].view(torch.uint8), outs[3])
    part = None
    if probs is not None:
        part = torch.empty(da.shape[1] // BLOCK, da.shape[0], device=da.device)
    key = None
    if h.is_cuda:
        key = ("grouped_mlp_fp8_act_bwd", act, interleave, pow2,
               *map(tensor_key, (h, da, probs, offsets)))  # fmt: skip

    def body() -> None:
        act_kernels.act_bwd_fp8(h, da, probs, offsets, out, part, act, interleave or None, pow2,
                                ACT_BWD_TILE)  # fmt: skip
        if part is not None:
            mlp_kernels.segment_colsum(part, None, dp.view(1, -1))

    replayed(key, (h, da, probs, offsets, *outs, dp, part), body)
    return (*outs, dp)


class _Fc1Fp8Fn(torch.autograd.Function):
    """rows (their anchor; the Fp8Tensor rides along) → (a's anchor, a e4m3, its scales, aT,
    its scales): fc1 in FP8, then the activation quantized twice in one kernel."""

    @staticmethod
    def forward(ctx, x_anchor, w1, probs, xq, offsets, act, interleave, recipe):
        ctx.set_materialize_grads(False)
        w1q, ctx.w1t = fp8_weight(w1, recipe)
        pow2 = recipe.pow2_scale
        h = grouped_mm_fp8(xq, w1q, offsets, out_dtype=x_anchor.dtype)
        a, sa, at, sat = _act(h, probs, offsets, act.name, [act.limit, act.alpha, act.offset],
                              interleave or 0, pow2)  # fmt: skip
        ctx.save_for_backward(h, probs, offsets)
        ctx.xt = wgrad_operand(xq, pow2) if ctx.needs_input_grad[1] else None
        ctx.meta = (act, interleave, x_anchor.dtype, w1, pow2)
        ctx.mark_non_differentiable(a, sa, at, sat)
        return stand_in(x_anchor, a.shape), a, sa, at, sat

    @staticmethod
    def backward(ctx, da, *_quantized):
        refuse_double_backward("grouped_mlp_fp8")
        h, probs, offsets = ctx.saved_tensors
        act, interleave, x_dtype, w1, pow2 = ctx.meta
        dhq, dhs, dht, dhts, dprobs = _act_bwd(
            h, da.contiguous(), probs, offsets, act.name, [act.limit, act.alpha, act.offset],
            interleave or 0, pow2,
        )  # fmt: skip
        dx = dw1 = None
        if ctx.needs_input_grad[0]:
            dhq_t = Fp8Tensor(dhq, dhs, "row", BLOCK)
            dx = grouped_mm_fp8(dhq_t, ctx.w1t, offsets, out_dtype=x_dtype)
        if ctx.needs_input_grad[1]:
            dh_tokens = Fp8Tensor(dht, dhts, "col", BLOCK, transposed=True)
            main_grad = getattr(w1, "main_grad", None)
            if main_grad is not None:
                grouped_mm_fp8_wgrad(dh_tokens, ctx.xt(), offsets, out=main_grad,
                                     accumulate=True)  # fmt: skip
            else:
                dw1 = grouped_mm_fp8_wgrad(dh_tokens, ctx.xt(), offsets, out_dtype=w1.dtype)
        ctx.w1t = ctx.xt = None
        dprobs = (
            dprobs if ctx.needs_input_grad[2] and dprobs is not None and dprobs.numel() else None
        )
        return dx, dw1, dprobs, None, None, None, None, None


def _fc1_act(xq, offsets, w1, probs, act, interleave, recipe) -> Fp8Tensor:
    """a = act(fc1(x)) · probs as an Fp8Tensor (1×128, with its 128×1 copy along the tokens)."""
    anchor = xq.anchor_or_stand_in()
    if xq.scale.stride(-1) != 1 or not xq.data.is_contiguous():
        raise ValueError("x must be a contiguous Fp8Tensor (as quantize_fp8 and permute give)")
    a_anchor, a, sa, at, sat = _Fc1Fp8Fn.apply(
        anchor, w1, probs, xq, offsets, act, interleave, recipe
    )
    col = Fp8Tensor(at, sat, "col", BLOCK, transposed=True)
    return Fp8Tensor(a, sa, "row", BLOCK, anchor=a_anchor, col=col)


def _check_args(x, offsets, w1, w2, probs, act, glu_interleave, recipe) -> torch.Tensor:
    """The rows' tensor (x, or an Fp8Tensor's data) of a checked call."""
    if not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"recipe must be a moekit.ops.Fp8Recipe, got {type(recipe).__name__}")
    block = recipe.row_block
    if isinstance(x, Fp8Tensor) and (x.axis != "row" or x.block != block or x.transposed):
        raise ValueError(
            f"x must be an Fp8Tensor quantized with axis='row', block={block} (the "
            f"{recipe.scaling} recipe's: quantize_fp8(x), permute(..., fp8=)), got "
            f"axis={x.axis!r}, block={x.block}"
        )
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
    return rows


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
            R a multiple of 128 (``permute(fp8=)`` pads to it) for the activation kernels.
        offsets: [E] int32/int64 cumulative row ends, each a multiple of 128
            (``permute(align=128)``): the weight gradients and the activation kernels work on
            128-row blocks of one expert.
        w1: [E, 2F, H] (gated; ``[:F]`` gate rows) or [E, F, H]; w2: [E, H, F]. H and F must
            be multiples of 16; fp32 ``main_grad`` attributes receive the weight gradients.
        probs: optional [R] routing probabilities scaling each row's activation output.
        activation, glu_interleave: as for :func:`moekit.ops.grouped_mlp`.
        recipe: an :class:`~moekit.ops.Fp8Recipe` (None: blockwise). Rowwise runs fc1, the
            activation and fc2 one after another (the activation kernels quantize 1×128
            blocks).

    Returns:
        [R, H] in x's dtype (an Fp8Tensor's source dtype); rows past ``offsets[-1]`` are zero.
        Differentiable in x, w1, w2 and probs.
    """
    act = resolve_activation(activation)
    recipe = recipe if recipe is not None else Fp8Recipe()
    rows = _check_args(x, offsets, w1, w2, probs, act, glu_interleave, recipe)
    dtype = x.orig_dtype if isinstance(x, Fp8Tensor) else x.dtype
    F_ = w2.shape[2]
    unfused = _unfused_reason(rows.shape[0], F_, glu_interleave, recipe)
    if unfused is None:
        xq = x if isinstance(x, Fp8Tensor) else quantize_fp8(x, pow2_scale=recipe.pow2_scale)
        v.check_offsets_values(offsets, rows.shape[0], rows_what="x.shape[0] (R)")
        a = _fc1_act(xq, offsets.contiguous(), w1, probs, act, glu_interleave, recipe)
        return grouped_linear_fp8(a, w2, offsets, out_dtype=dtype, recipe=recipe)
    if recipe.scaling == "blockwise":
        warn_once(
            ("grouped_mlp_fp8", unfused),
            f"moekit.grouped_mlp_fp8: the FP8 activation kernels cannot run this ({unfused}); "
            "running fc1, the activation in fp32 and fc2 one after another",
        )
    h = grouped_linear_fp8(x, w1, offsets, out_dtype=dtype, recipe=recipe)
    a = _ScaledActivationFn.apply(h, probs, act, glu_interleave)
    return grouped_linear_fp8(a, w2, offsets, out_dtype=dtype, recipe=recipe)


def _unfused_reason(R: int, F_: int, interleave: int | None, recipe: Fp8Recipe) -> str | None:
    """Why the activation kernels cannot run (None if they can): their tiles are 128×128
    blocks of the blockwise recipe (the rowwise one always runs the composition)."""
    if recipe.scaling != "blockwise":
        return "the rowwise recipe"
    if F_ % BLOCK:
        return f"F = {F_} is not a multiple of {BLOCK}"
    if interleave is not None and interleave % BLOCK:
        return f"glu_interleave = {interleave} is not a multiple of {BLOCK}"
    if R % BLOCK:
        return f"the rows R = {R} are not a multiple of {BLOCK}"
    return None
