"""FP8 (e4m3) quantization: :func:`quantize_fp8`, the :class:`Fp8Tensor` it returns and the
:class:`Fp8Recipe` that names how the FP8 layers scale their operands.

Blockwise, the recipe of DeepSeek-V3 and TransformerEngine's ``Float8BlockScaling``: one fp32
scale per block of 1×128 (activations and output gradients, ``axis="row"``), 128×1 along the
token dimension (the weight gradient's operands, ``axis="col"``) or 128×128 (weights,
``axis="both"``). Rowwise (``block=None``), the recipe of torch's and torchao's FP8 GEMMs: one
scale per whole row (activations, output gradients, and a weight's output channels) or per whole
column (a weight's input channels, for its dgrad). The math and its edge cases (zero blocks,
NaN, inf): :mod:`moekit.reference.fp8`.

CUDA tensors run :mod:`moekit.kernels.fp8` (compute capability 8.9 or newer); CPU tensors the
reference, or the kernel in Triton's interpreter with ``TRITON_INTERPRET=1``.

Autograd: an FP8 tensor cannot carry a bf16 gradient, so a quantized tensor takes part in the
graph through its ``anchor``, a stand-in of the source's shape and dtype without storage of its
own. moekit's FP8 ops take the anchor as their differentiable input and return the gradient of
the quantized values for it, which flows on to the source unchanged (the straight-through
estimator, as every FP8 training recipe uses it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

import torch

from moekit.kernels import fp8 as kernels
from moekit.ops.validation import FLOAT_DTYPES, check_dtype, check_fp8_device, check_tensor
from moekit.reference.fp8 import dequantize_fp8_ref, quantize_fp8_ref, scale_shape
from moekit.runtime.device import use_triton
from moekit.runtime.op import kernel_op
from moekit.runtime.replay import replayed, tensor_key
from moekit.tuning.fp8 import TWO_WAY_TILE, quantize_config, rowwise_quantize_config

__all__ = [
    "AXES",
    "BLOCKS",
    "SCALINGS",
    "Fp8Recipe",
    "Fp8Tensor",
    "quantize_fp8",
    "quantize_fp8_two_ways",
    "requantize_fp8",
    "stand_in",
]

AXES = ("row", "col", "both")
BLOCKS = (16, 32, 64, 128)  # sides the kernel's tiles take; 128 is the recipe's
SCALINGS = ("blockwise", "rowwise")


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How an FP8 layer quantizes its operands (docs/fp8.md).

    ``scaling``: ``"blockwise"`` (activations and output gradients 1×128, weights 128×128,
    the GEMMs promoting to fp32 once per 128 of K) or ``"rowwise"`` (one scale per row of the
    activations and output gradients and per output channel of the weights, the whole K
    summed in the tensor cores and scaled once). The weight gradient's operands are 128×1
    blocks along the tokens under both.
    ``pow2_scale``: every scale rounded up to a power of two.
    """

    scaling: Literal["blockwise", "rowwise"] = "blockwise"
    pow2_scale: bool = False

    @property
    def row_block(self) -> int | None:
        """The ``block`` of ``quantize_fp8`` for activations and output gradients under this
        recipe: 128 (blockwise), None (rowwise: the whole row)."""
        return None if self.scaling == "rowwise" else 128

    def __post_init__(self) -> None:
        if not isinstance(self.scaling, str):
            raise TypeError(f"Fp8Recipe.scaling must be a str, got {type(self.scaling).__name__}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"Fp8Recipe.scaling must be one of {SCALINGS}, got {self.scaling!r}")
        if not isinstance(self.pow2_scale, bool):
            raise TypeError(
                f"Fp8Recipe.pow2_scale must be a bool, got {type(self.pow2_scale).__name__}"
            )


@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
    """A tensor quantized to e4m3: ``x ≈ data · scale``, each scale spread over its block.

    ``data``: e4m3 (``torch.float8_e4m3fn``), the shape of the source (its last two dims
    swapped when ``transposed``).
    ``scale``: fp32 dequantization factors (a block's amax / 448, or the next power of two up),
    of shape row [..., ⌈K/B⌉], col [..., ⌈M/B⌉, K], both [..., ⌈M/B⌉, ⌈K/B⌉] for x
    [..., M, K] and ``block`` B; rowwise (``block`` None) row [..., 1], col [..., 1, K].
    """

    data: torch.Tensor
    scale: torch.Tensor
    axis: str  # "row" (1×B blocks), "col" (B×1 along dim -2) or "both" (B×B)
    block: int | None  # None: rowwise, the block spans the whole row (or column)
    # data stored transposed in its last two dims ([..., K, M], contiguous): the layout a GEMM
    # that contracts over M wants (the wgrad's operands, M the tokens); scale as for x
    transposed: bool = False
    # The quantized values in the autograd graph (see the module docstring): a zero-stride
    # tensor of x's shape and its source's dtype; None when x's gradient is not wanted.
    anchor: torch.Tensor | None = None
    # Where the values came from, to quantize them again along another axis without a second
    # rounding (requantize_fp8): x = source, or x[m] = source[source_rows[m]] (zeros for −1).
    source: torch.Tensor | None = None
    source_rows: torch.Tensor | None = None  # [M] int32
    # The same values quantized along the tokens (axis="col", stored transposed) by the kernel
    # that made them, from the same fp32 values: what a weight gradient takes of them.
    col: Fp8Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        """The shape of the quantized tensor x (``data``'s, transposed back)."""
        if self.transposed:
            return torch.Size((*self.data.shape[:-2], self.data.shape[-1], self.data.shape[-2]))
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def orig_dtype(self) -> torch.dtype:
        """The dtype the values were quantized from (bf16 when that is not known)."""
        for t in (self.anchor, self.source):
            if t is not None:
                return t.dtype
        return torch.bfloat16

    def anchor_or_stand_in(self) -> torch.Tensor:
        """The anchor, or for a tensor whose gradient is not wanted a stand-in like it (x's
        shape, ``orig_dtype``, no storage): what an FP8 op's Function takes as its input."""
        if self.anchor is not None:
            return self.anchor
        return torch.empty((), dtype=self.orig_dtype, device=self.device).expand(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data · scale`` (computed in fp32) in ``dtype``."""
        data = self.data.transpose(-2, -1) if self.transposed else self.data
        return dequantize_fp8_ref(data, self.scale, self.axis, self.block).to(dtype)

    def t(self) -> Fp8Tensor:
        """The transpose of the last two dims, stored contiguous (e.g. a weight [E, N, K] as
        [E, K, N], the operand of its dgrad). Only for B×B blocks, whose scales transpose
        with the data: no second quantization, the same values. (A rowwise weight's dgrad
        operand has its scales along the other dim: ``quantize_fp8(w, axis="col",
        block=None, transpose=True)``.)"""
        if self.axis != "both" or self.transposed:
            raise ValueError(
                "only an Fp8Tensor with axis='both' stored untransposed transposes as it is, got "
                f"axis={self.axis!r}, transposed={self.transposed} (a rowwise weight's dgrad "
                "operand: quantize_fp8(w, axis='col', block=None, transpose=True))"
            )
        data = self.data.transpose(-2, -1).contiguous()
        scale = self.scale.transpose(-2, -1).contiguous()
        return Fp8Tensor(data, scale, "both", self.block)


def stand_in(like: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A zero tensor of ``shape`` in like's dtype and device without storage of its own (one
    element expanded): the anchor an FP8 op returns for its quantized output."""
    return like.new_zeros(()).expand(*shape)


def _gathered(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """x, or its rows x[rows[m]] (zeros for −1) as a new tensor: the reference path."""
    if rows is None:
        return x
    rows = rows.long()
    return torch.where((rows >= 0)[:, None], x[rows.clamp(min=0)], 0.0).to(x.dtype)


def _quantize_fake(x, rows, axis, block, pow2_scale, transpose):
    shape = x.shape if rows is None else (rows.shape[0], x.shape[1])
    data_shape = (*shape[:-2], shape[-1], shape[-2]) if transpose else shape
    data = x.new_empty(data_shape, dtype=torch.float8_e4m3fn)
    return data, x.new_empty(scale_shape(shape, axis, block), dtype=torch.float32)


@kernel_op("quantize_fp8", fake=_quantize_fake)
def _quantize(
    x: torch.Tensor, rows: torch.Tensor | None, axis: str, block: int | None, pow2_scale: bool,
    transpose: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(data, scale) of a checked call (of x's rows ``rows`` when given)."""
    if not use_triton(x):
        data, scale = quantize_fp8_ref(_gathered(x, rows), axis, block, pow2_scale)
        return (data.transpose(-2, -1).contiguous() if transpose else data), scale
    data, scale = _quantize_fake(x, rows, axis, block, pow2_scale, transpose)
    shape = x.shape if rows is None else (rows.shape[0], x.shape[1])
    # [B, M, K]: for row blocks every row in M (a tile takes several), else the batch in B
    if axis == "row":
        b, M, K = 1, math.prod(shape[:-1]), shape[-1]
    else:
        b, M, K = math.prod(shape[:-2]), shape[-2], shape[-1]
    x3 = x.unsqueeze(0) if rows is not None else x.reshape(b, M, K)
    d3 = data.view(torch.uint8)
    d3 = d3.view(b, K, M).transpose(1, 2) if transpose else d3.view(b, M, K)
    s3 = scale.view(b, M if axis == "row" else scale.shape[-2], scale.shape[-1])
    per_row, per_col = axis == "row", axis == "col"
    if block is None:  # one scale per line: a row of x3 (row), a column (col)
        cfg = rowwise_quantize_config(axis, K if per_row else M)
        run = lambda: kernels.quantize_fp8_rowwise(x3, d3, s3, per_row, pow2_scale, cfg)
    else:
        cfg = quantize_config(axis, block)
        run = lambda: kernels.quantize_fp8(x3, d3, s3, per_row, per_col, pow2_scale, cfg, rows)
    key = None
    if x.is_cuda:
        # d3's strides tell a transposed output apart
        key = ("quantize_fp8", axis, block, pow2_scale, rows is not None,
               *map(tensor_key, (x3, d3, s3)))  # fmt: skip
    if d3.numel():
        replayed(key, (x3, d3, s3, rows), run)
    elif scale.numel():  # rowwise, over empty rows or columns: the scale of a zero block
        scale.fill_(1.0)
    return data, scale


def _two_ways_fake(x, pow2_scale):
    M, K = x.shape
    e4m3, f32 = dict(dtype=torch.float8_e4m3fn), dict(dtype=torch.float32)
    s_row, s_col = scale_shape((M, K), "row", 128), scale_shape((M, K), "col", 128)
    return (x.new_empty(M, K, **e4m3), x.new_empty(s_row, **f32), x.new_empty(K, M, **e4m3),
            x.new_empty(s_col, **f32))  # fmt: skip


@kernel_op("quantize_fp8_two_ways", fake=_two_ways_fake)
def _quantize_two_ways(
    x: torch.Tensor, pow2_scale: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data [M, K], scale, dataT [K, M], scaleT) of x [M, K] quantized 1×128 and 128×1."""
    if not use_triton(x):
        q, s = quantize_fp8_ref(x, "row", 128, pow2_scale)
        qt, st = quantize_fp8_ref(x, "col", 128, pow2_scale)
        return q, s, qt.t().contiguous(), st
    outs = _two_ways_fake(x, pow2_scale)
    q, s, qt, st = outs
    key = ("quantize_fp8_two_ways", pow2_scale, tensor_key(x)) if x.is_cuda else None
    if x.numel():
        u8 = torch.uint8
        run = lambda: kernels.quantize_fp8_two_ways(
            x, q.view(u8), s, qt.view(u8), st, pow2_scale, TWO_WAY_TILE)  # fmt: skip
        replayed(key, (x, *outs), run)
    return outs


def quantize_fp8_two_ways(x: torch.Tensor, *, pow2_scale: bool = False) -> Fp8Tensor:
    """``quantize_fp8(x)`` (1×128 blocks) whose ``.col`` is ``quantize_fp8(x, axis="col",
    transpose=True)`` (128×1 blocks, stored [K, M]), both from one read of x [M, K] and the
    same bytes: an output gradient's dgrad and weight-gradient operands. Not differentiable
    (no anchor): for backward passes."""
    x = check_tensor("x", x)
    check_dtype("x", x, FLOAT_DTYPES)
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    if not isinstance(pow2_scale, bool):
        raise TypeError(f"pow2_scale must be a bool, got {type(pow2_scale).__name__}")
    check_fp8_device("x", x)
    q, s, qt, st = _quantize_two_ways(x.detach(), pow2_scale)
    col = Fp8Tensor(qt, st, "col", 128, transposed=True, source=x.detach())
    return Fp8Tensor(q, s, "row", 128, source=x.detach(), col=col)


class _QuantizeFn(torch.autograd.Function):
    """x → (its anchor, data, scale): the gradient reaching the anchor goes to x as it is."""

    @staticmethod
    def forward(ctx, x, rows, axis, block, pow2_scale, transpose):
        ctx.set_materialize_grads(False)
        data, scale = _quantize(x.detach(), rows, axis, block, pow2_scale, transpose)
        ctx.mark_non_differentiable(data, scale)
        shape = x.shape if rows is None else (rows.shape[0], x.shape[1])
        return stand_in(x, shape), data, scale

    @staticmethod
    def backward(ctx, grad, _data, _scale):
        return grad, None, None, None, None, None


def quantize_fp8(
    x: torch.Tensor,
    *,
    axis: str = "row",
    block: int | None = 128,
    pow2_scale: bool = False,
    transpose: bool = False,
    rows: torch.Tensor | None = None,
) -> Fp8Tensor:
    """Quantize ``x`` to e4m3 with one fp32 scale per block (blockwise) or per whole row or
    column (rowwise, ``block=None``).

    Args:
        x: [..., K] for ``axis="row"`` (1×``block`` blocks along K), [..., M, K] for ``"col"``
            (``block``×1 blocks along M) and ``"both"`` (``block``×``block``, e.g. a weight
            [E, N, K]); bf16, fp16 or fp32, any strides. Edge blocks may be partial.
        axis: which blocks, as above.
        block: the block side, one of 16, 32, 64, 128 (the blockwise recipe's); or None for
            ``"row"`` and ``"col"``: the block spans the whole dimension (rowwise), scale
            [..., 1] (row: per row, e.g. activations [T, K], or a weight [E, N, K]'s output
            channels) or [..., 1, K] (col: per column, e.g. a weight's input channels).
        pow2_scale: round each scale up to a power of two (dequantization then only shifts
            exponents; the values lose up to one bit of range use).
        transpose: store ``data`` transposed in its last two dims (``"col"`` and ``"both"``):
            [..., K, M] contiguous, in the same pass (the FP8 wgrad's operands, and with
            ``block=None`` a rowwise weight's dgrad operand: data [E, K, N], scale [E, 1, K]).
        rows: [M] int32/int64 on x's device, with x [S, K] and a block: quantize the [M, K]
            tensor whose row m is ``x[rows[m]]`` (a zero row for −1) in the same pass, e.g.
            permuted rows straight from their tokens. Ids outside [−1, S) are undefined
            behaviour.

    Returns:
        :class:`Fp8Tensor` with ``data`` (e4m3) and ``scale`` (fp32), and an ``anchor`` when
        x requires a gradient (the gradient of the quantized values passes straight to x).
    """
    x = check_tensor("x", x)
    check_dtype("x", x, FLOAT_DTYPES)
    if axis not in AXES:
        raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
    need = 1 if axis == "row" else 2
    if x.dim() < need:
        shape = "[..., K]" if need == 1 else "[..., M, K]"
        raise ValueError(f"x must be {shape} for axis={axis!r}, got shape {tuple(x.shape)}")
    if block is None:
        if axis == "both":
            raise ValueError(
                "block=None (one scale per whole row or column) applies to axis='row' or "
                "'col', got axis='both'"
            )
    elif isinstance(block, bool) or block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS} or None, got {block!r}")
    for name, flag in (("pow2_scale", pow2_scale), ("transpose", transpose)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if transpose and axis == "row":
        raise ValueError("transpose applies to axis='col' or 'both', got axis='row'")
    if rows is not None:
        if block is None:
            raise ValueError("rows= gathers for blockwise quantization: give a block, not None")
        rows = _check_rows(rows, x)
    check_fp8_device("x", x)
    args = (rows, axis, block, pow2_scale, transpose)
    if torch.is_grad_enabled() and x.requires_grad:
        anchor, data, scale = _QuantizeFn.apply(x, *args)
    else:
        (data, scale), anchor = _quantize(x.detach(), *args), None
    return Fp8Tensor(data, scale, axis, block, transpose, anchor, x.detach(), rows)


def _check_rows(rows: object, x: torch.Tensor) -> torch.Tensor:
    rows = check_tensor("rows", rows)
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"rows must be a 1-D int32/int64 tensor, got {rows.dtype} {tuple(rows.shape)}"
        )
    if x.dim() != 2:
        raise ValueError(f"x must be [S, K] with rows, got shape {tuple(x.shape)}")
    if rows.device != x.device:
        raise ValueError(f"rows must be on x's device {x.device}, got {rows.device}")
    return rows.contiguous()


def requantize_fp8(
    t: Fp8Tensor,
    *,
    axis: str,
    transpose: bool = False,
    block: int = 128,
    pow2_scale: bool = False,
) -> Fp8Tensor:
    """The values of ``t`` quantized along ``axis`` in blocks of ``block`` instead, e.g. an
    activation quantized along its rows for its forward GEMM, needed 128×1 along the tokens by
    its weight gradient.

    The copy the producing kernel made (``t.col``), else from ``t.source`` (and
    ``t.source_rows``) when t kept them: one rounding, as if quantized from the start.
    Otherwise from ``t.dequantize()``: a second rounding, whose error the docs (docs/fp8.md)
    bound. Not differentiable (the result has no anchor)."""
    if t.col is not None and axis == "col" and transpose and block == t.col.block:
        return t.col
    src = t.source if t.source is not None else t.dequantize()
    rows = t.source_rows if t.source is not None else None
    with torch.no_grad():
        return quantize_fp8(src, axis=axis, block=block, pow2_scale=pow2_scale,
                            transpose=transpose, rows=rows)  # fmt: skip
