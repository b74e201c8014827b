"""FP8 (e4m3) blockwise quantization: :func:`quantize_fp8` and the :class:`Fp8Tensor` it returns.

The recipe of DeepSeek-V3 and TransformerEngine's ``Float8BlockScaling``: one fp32 scale per
block of 1×128 (activations and output gradients, ``axis="row"``), 128×1 along the token
dimension (the weight gradient's operands, ``axis="col"``) or 128×128 (weights,
``axis="both"``). The math and its edge cases (zero blocks, NaN, inf): :mod:`moekit.reference.fp8`.

CUDA tensors run :mod:`moekit.kernels.fp8` (compute capability 8.9 or newer); CPU tensors the
reference, or the kernel in Triton's interpreter with ``TRITON_INTERPRET=1``. Quantization is not
differentiable: the FP8 GEMMs quantize inside their own autograd Functions.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from moekit.kernels import fp8 as kernels
from moekit.ops.validation import FLOAT_DTYPES, check_dtype, check_fp8_device, check_tensor
from moekit.reference.fp8 import dequantize_fp8_ref, quantize_fp8_ref, scale_shape
from moekit.runtime.device import use_triton
from moekit.runtime.op import kernel_op
from moekit.runtime.replay import replayed, tensor_key
from moekit.tuning.fp8 import quantize_config

__all__ = ["AXES", "BLOCKS", "Fp8Tensor", "quantize_fp8"]

AXES = ("row", "col", "both")
BLOCKS = (16, 32, 64, 128)  # sides the kernel's tiles take; 128 is the recipe's


@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
    """A tensor quantized blockwise to e4m3: ``x ≈ data · scale``, each scale spread over its
    block.

    ``data``: e4m3 (``torch.float8_e4m3fn``), the shape of the source.
    ``scale``: fp32 dequantization factors (a block's amax / 448, or the next power of two up),
    of shape row [..., ⌈K/B⌉], col [..., ⌈M/B⌉, K], both [..., ⌈M/B⌉, ⌈K/B⌉] for data
    [..., M, K] and ``block`` B.
    """

    data: torch.Tensor
    scale: torch.Tensor
    axis: str  # "row" (1×B blocks), "col" (B×1 along dim -2) or "both" (B×B)
    block: int

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data · scale`` (computed in fp32) in ``dtype``."""
        return dequantize_fp8_ref(self.data, self.scale, self.axis, self.block).to(dtype)


def _quantize_fake(x, axis, block, pow2_scale):
    data = x.new_empty(x.shape, dtype=torch.float8_e4m3fn)
    return data, x.new_empty(scale_shape(x.shape, axis, block), dtype=torch.float32)


@kernel_op("quantize_fp8", fake=_quantize_fake)
def _quantize(
    x: torch.Tensor, axis: str, block: int, pow2_scale: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scale) of a checked call."""
    if not use_triton(x):
        return quantize_fp8_ref(x, axis, block, pow2_scale)
    data, scale = _quantize_fake(x, axis, block, pow2_scale)
    # [B, M, K]: for row blocks every row in M (a tile takes several), else the batch in B
    lead = math.prod(x.shape[:-1] if axis == "row" else x.shape[:-2])
    x3 = x.reshape(1, lead, x.shape[-1]) if axis == "row" else x.reshape(lead, *x.shape[-2:])
    d3 = data.view(torch.uint8).view(x3.shape)
    s3 = scale.view(x3.shape[0], x3.shape[1] if axis == "row" else scale.shape[-2], scale.shape[-1])
    cfg = quantize_config(axis, block)
    per_row, per_col = axis == "row", axis == "col"
    key = None
    if x.is_cuda:
        key = ("quantize_fp8", axis, block, pow2_scale, *map(tensor_key, (x3, d3, s3)))
    if x3.numel():
        replayed(
            key, (x3, d3, s3),
            lambda: kernels.quantize_fp8(x3, d3, s3, per_row, per_col, pow2_scale, cfg),
        )  # fmt: skip
    return data, scale


def quantize_fp8(
    x: torch.Tensor,
    *,
    axis: str = "row",
    block: int = 128,
    pow2_scale: bool = False,
) -> Fp8Tensor:
    """Quantize ``x`` blockwise to e4m3 with one fp32 scale per block.

    Args:
        x: [..., K] for ``axis="row"`` (1×``block`` blocks along K), [..., M, K] for ``"col"``
            (``block``×1 blocks along M) and ``"both"`` (``block``×``block``, e.g. a weight
            [E, N, K]); bf16, fp16 or fp32, any strides. Edge blocks may be partial.
        axis: which blocks, as above.
        block: the block side, one of 16, 32, 64, 128 (the recipe's).
        pow2_scale: round each scale up to a power of two (dequantization then only shifts
            exponents; the values lose up to one bit of range use).

    Returns:
        :class:`Fp8Tensor` with ``data`` (x's shape, e4m3) and ``scale`` (fp32). Not
        differentiable (x's gradient is not tracked through it).
    """
    x = check_tensor("x", x)
    check_dtype("x", x, FLOAT_DTYPES)
    if axis not in AXES:
        raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
    need = 1 if axis == "row" else 2
    if x.dim() < need:
        shape = "[..., K]" if need == 1 else "[..., M, K]"
        raise ValueError(f"x must be {shape} for axis={axis!r}, got shape {tuple(x.shape)}")
    if isinstance(block, bool) or block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS}, got {block!r}")
    if not isinstance(pow2_scale, bool):
        raise TypeError(f"pow2_scale must be a bool, got {type(pow2_scale).__name__}")
    check_fp8_device("x", x)
    data, scale = _quantize(x.detach(), axis, block, pow2_scale)
    return Fp8Tensor(data, scale, axis, block)
