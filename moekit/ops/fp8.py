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
from moekit.kernels.grouped_gemm import grouped_mm_ragged_m
from moekit.ops.validation import (
    FLOAT_DTYPES,
    check_dtype,
    check_fp8_device,
    check_offsets,
    check_offsets_values,
    check_tensor,
)
from moekit.reference.fp8 import (
    dequantize_fp8_ref,
    grouped_mm_fp8_ref,
    quantize_fp8_ref,
    scale_shape,
)
from moekit.runtime.device import use_triton
from moekit.runtime.op import kernel_op
from moekit.runtime.replay import replayed, tensor_key
from moekit.tuning.fp8 import quantize_config
from moekit.tuning.grouped_gemm import fp8_ragged_m_config

__all__ = ["AXES", "BLOCKS", "Fp8Tensor", "grouped_mm_fp8", "quantize_fp8"]

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

    def t(self) -> Fp8Tensor:
        """The transpose of the last two dims, stored contiguous (e.g. a weight [E, N, K] as
        [E, K, N], the operand of its dgrad). Only for B×B blocks, whose scales transpose
        with the data: no second quantization, the same values."""
        if self.axis != "both":
            raise ValueError(
                f"only an Fp8Tensor with axis='both' transposes as it is, got axis={self.axis!r}"
            )
        data = self.data.transpose(-2, -1).contiguous()
        return Fp8Tensor(data, self.scale.transpose(-2, -1).contiguous(), "both", self.block)


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


def _ragged_m_fp8_fake(a, sa, b, sb, offsets, block, out_dtype):
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)


@kernel_op("grouped_mm_fp8_ragged_m", fake=_ragged_m_fp8_fake)
def _ragged_m_fp8(
    a: torch.Tensor,  # [T, K] e4m3
    sa: torch.Tensor,  # [T, ⌈K/B⌉] fp32
    b: torch.Tensor,  # [E, N, K] e4m3
    sb: torch.Tensor,  # [E, ⌈N/B⌉, ⌈K/B⌉] fp32
    offsets: torch.Tensor,  # [E]
    block: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The product of a checked call: the kernel, or the reference on the CPU."""
    if not use_triton(a):
        return grouped_mm_fp8_ref(a, sa, b, sb, offsets, block, out_dtype)
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    if a.shape[0]:
        bt = b.transpose(1, 2)  # [E, K, N] with unit stride along K: the kernel's K-major b
        cfg = fp8_ragged_m_config(block)
        key = None
        if a.is_cuda:
            key = ("grouped_mm_fp8", block, *map(tensor_key, (a, sa, bt, sb, offsets, out)))
        replayed(
            key, (a, sa, bt, sb, offsets, out),
            lambda: grouped_mm_ragged_m(a, bt, offsets, out, None, cfg, scales=(sa, sb)),
        )  # fmt: skip
    return out


def grouped_mm_fp8(
    a: Fp8Tensor,
    b: Fp8Tensor,
    offsets: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Blockwise FP8 grouped GEMM, ragged M (the forward of an expert layer): ``y[rows of e] =
    a[rows of e] @ b[e]ᵀ``, promoted to fp32 once per block of K.

    Args:
        a: rows [T, K] quantized with ``axis="row"`` (1×128 blocks).
        b: the experts' weights [E, N, K] (nn.Linear layout) quantized with ``axis="both"``
            (128×128 blocks), ``b.data`` with unit stride along K.
        offsets: [E] int32/int64 cumulative end offsets on a's device; rows past
            ``offsets[-1]`` give zeros.
        out_dtype: bfloat16, float16 or float32.

    Returns:
        [T, N] in ``out_dtype``. No autograd yet. The dgrad of y = x·wᵀ is this product too,
        of the output gradient (quantized 1×128) and ``b.t()``; the wgrad is not built.
    """
    for name, t, axis, ndim in (("a", a, "row", 2), ("b", b, "both", 3)):
        if not isinstance(t, Fp8Tensor):
            raise TypeError(f"{name} must be an Fp8Tensor (quantize_fp8), got {type(t).__name__}")
        if t.axis != axis or t.block != 128 or t.data.dim() != ndim:
            raise ValueError(
                f"{name} must be a {ndim}-D Fp8Tensor quantized with axis={axis!r}, block=128, "
                f"got {t.data.dim()}-D, axis={t.axis!r}, block={t.block}"
            )
    (T, K), (E, N, Kb) = a.shape, b.shape
    if Kb != K:
        raise ValueError(f"b.shape[2] must equal K = a.shape[1] = {K}, got {Kb}")
    if b.data.stride(2) != 1:
        raise ValueError(f"b.data must have unit stride along K, got strides {b.data.stride()}")
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    for name, size, width in (("K (a.shape[1])", K, 1), ("N (b.shape[1])", N, out_dtype.itemsize)):
        if size * width % 16:
            raise ValueError(f"{name} must span a multiple of 16 bytes, got {size}")
    offsets = check_offsets(offsets, E, "a.data", a.data, "b.shape[0]")
    check_offsets_values(offsets, T, rows_what="a.shape[0] (T)")
    if b.device != a.device:
        raise ValueError(f"b must be on a's device {a.device}, got {b.device}")
    check_fp8_device("a", a.data)
    sa, sb = a.scale.contiguous(), b.scale.contiguous()
    return _ragged_m_fp8(a.data, sa, b.data, sb, offsets.contiguous(), 128, out_dtype)
