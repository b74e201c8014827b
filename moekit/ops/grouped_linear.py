"""``grouped_linear``: y = x @ weight[e]^T (+ bias[e]) per expert segment, with a weight gradient
that lands directly in the [E, N, K] layout or accumulates into an fp32 ``main_grad``."""

from __future__ import annotations

import torch

from moekit.ops import validation as v
from moekit.ops.autocast import autocast_dtype, autocast_on, autocast_tensors, autocast_weight
from moekit.ops.grouped_gemm import input_and_bias_grads, ragged_k, ragged_k_out, ragged_m
from moekit.runtime.op import function_apply, refuse_double_backward

__all__ = ["check_features", "grouped_linear"]


class _GroupedLinearFn(torch.autograd.Function):
    """``master``: None, or the higher-precision weight that ``weight`` is a per-call cast of
    (autocast): its gradient comes out of the wgrad kernel in its dtype directly."""

    @staticmethod
    def forward(ctx, x, weight, offsets, bias, main_grad, master):
        ctx.save_for_backward(x, weight, offsets)
        ctx.master_dtype = None if master is None else master.dtype
        # main_grad is mutated by every micro-batch's backward, so it cannot go through
        # save_for_backward (whose version check would fire); it is only written, never read.
        ctx.main_grad = main_grad
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return ragged_m(x, weight.transpose(1, 2), offsets, bias, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward("grouped_linear")
        x, weight, offsets = ctx.saved_tensors
        grad = grad.to(x.dtype)
        dx, dbias = input_and_bias_grads(ctx, grad, weight, offsets, x.dtype)
        dw = None
        if ctx.needs_input_grad[1]:
            if ctx.main_grad is not None:
                ragged_k_out(grad.t(), x, offsets, ctx.main_grad, True)
            else:
                dw = ragged_k(grad.t(), x, offsets, ctx.master_dtype or weight.dtype)  # [E, N, K]
        if ctx.master_dtype is not None:
            return dx, None, None, dbias, None, dw
        return dx, dw, None, dbias, None, None


_apply_grouped_linear = function_apply(_GroupedLinearFn)


def check_features(in_features: int, out_features: int, dtype: torch.dtype) -> None:
    """The grouped GEMM reads rows through TMA: in_features and out_features must each span a
    multiple of 16 bytes of ``dtype``."""
    v.check_byte_aligned("in_features", in_features, dtype, "in_features")
    v.check_byte_aligned("out_features", out_features, dtype, "out_features")


def _check_inputs(x, weight, offsets, bias, main_grad):
    x = v.check_tensor("x", x)
    weight = v.check_tensor("weight", weight)
    v.check_ndim("weight", weight, 3, "[num_experts, out_features, in_features]")
    E, N, K = weight.shape
    v.check_ndim("x", x, 2, f"[T, in_features = {K}]")
    v.check_dtype("x", x, v.FLOAT_DTYPES)
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    v.check_same_device("weight", weight, "x", x)
    if x.shape[1] != K:
        raise ValueError(
            f"x.shape[1] must equal in_features = {K} (weight.shape[2]), got x of shape "
            f"{tuple(x.shape)}"
        )
    check_features(K, N, x.dtype)
    v.check_interpretable("x", x)
    offsets = v.check_offsets(offsets, E, "x", x, "num_experts = weight.shape[0]")
    v.check_offsets_values(offsets, x.shape[0], rows_what="x.shape[0] (T)")
    if bias is not None:
        bias = v.check_tensor("bias", bias)
        if tuple(bias.shape) != (E, N):
            raise ValueError(
                f"bias must have shape (num_experts, out_features) = {(E, N)}, got "
                f"{tuple(bias.shape)}"
            )
        v.check_same_device("bias", bias, "x", x)
        v.check_dtype("bias", bias, v.FLOAT_DTYPES)
        if bias.stride(1) != 1:
            raise ValueError(f"bias must have unit stride along out_features, got {bias.stride()}")
    if main_grad is not None:
        main_grad = v.check_tensor("main_grad", main_grad)
        v.check_dtype("main_grad", main_grad, (torch.float32,))
        if main_grad.shape != weight.shape or main_grad.device != weight.device:
            raise ValueError(
                f"main_grad must match weight's shape {tuple(weight.shape)} on {weight.device}, "
                f"got {tuple(main_grad.shape)} on {main_grad.device}"
            )
    return x, weight, offsets, bias, main_grad


def grouped_linear(
    x: torch.Tensor,  # [T, in_features] rows grouped by expert
    weight: torch.Tensor,  # [num_experts, out_features, in_features] (nn.Linear per expert)
    offsets: torch.Tensor,  # [num_experts] int32/int64 cumulative end offsets
    bias: torch.Tensor | None = None,  # [num_experts, out_features]
    main_grad: torch.Tensor | None = None,  # fp32, weight's shape
) -> torch.Tensor:  # [T, out_features]
    """Per-expert linear layer over expert-sorted rows, forward and backward in grouped GEMMs.

    in_features and out_features must each span a multiple of 16 bytes (8 elements for
    bf16/fp16, 4 for fp32) on every path. Rows past ``offsets[-1]`` give zeros. With
    ``main_grad`` (Megatron's gradient-accumulation fusion) the weight gradient is added into
    it in place by the wgrad kernel and ``weight.grad`` is left untouched (None).

    Inside a ``torch.autocast`` region, x, weight and bias are first cast to its dtype (as
    ``F.linear`` does; the weight's gradient then reaches ``.grad`` in the weight's dtype, not
    ``main_grad``), unless in_features or out_features would not span a multiple of 16 bytes
    in it (the call then keeps its own dtype). A higher-precision weight that needs a gradient
    is cast outside autograd, and the wgrad kernel writes its gradient in its dtype directly
    (no gradient in the region's dtype for autograd to cast again).
    """
    if isinstance(x, torch.Tensor) and autocast_on(x.device.type):
        cast_weight, master = weight, None
        if isinstance(weight, torch.Tensor) and weight.dim() == 3:
            aligned = (weight.shape[1], weight.shape[2])
            x, bias = autocast_tensors(x.device.type, (x, bias), aligned)
            dtype = autocast_dtype(x.device.type, *aligned)
            cast_weight, master = autocast_weight(weight, dtype)
        if cast_weight is not weight:
            main_grad = None  # the gradient reaches the weight itself, not its main_grad
        with torch.autocast(x.device.type, enabled=False):  # the op's own torch calls as-is
            if master is not None:
                checked = _check_inputs(x, cast_weight, offsets, bias, None)
                return _apply_grouped_linear(*checked, master)
            return grouped_linear(x, cast_weight, offsets, bias, main_grad)
    return _apply_grouped_linear(*_check_inputs(x, weight, offsets, bias, main_grad), None)
