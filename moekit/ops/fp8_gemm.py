"""The FP8 (e4m3) grouped GEMMs: :func:`grouped_mm_fp8` (ragged M: the forward and, through the
weight's transposed copy, the dgrad of an expert layer) and :func:`grouped_mm_fp8_wgrad` (ragged
over the tokens: the weight gradient into fp32).

Operands are :class:`~moekit.ops.quantize.Fp8Tensor` from :func:`~moekit.ops.quantize.quantize_fp8`.
Blockwise operands are promoted to fp32 once per 128 of the contracted dimension; rowwise ones
(:func:`grouped_mm_fp8` only) are summed over the whole K and scaled once per output element.
CUDA tensors run :mod:`moekit.kernels.grouped_gemm`; CPU tensors the references
(:mod:`moekit.reference.fp8`), or the kernels in Triton's interpreter with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from moekit.config import debug_checks
from moekit.kernels.grouped_gemm import grouped_mm_fp8_wgrad as wgrad_kernel
from moekit.kernels.grouped_gemm import grouped_mm_ragged_m
from moekit.ops.quantize import Fp8Tensor
from moekit.ops.validation import (
    FLOAT_DTYPES,
    check_fp8_device,
    check_offsets,
    check_offsets_values,
)
from moekit.reference.fp8 import (
    grouped_mm_fp8_ref,
    grouped_mm_fp8_rowwise_ref,
    grouped_mm_fp8_wgrad_ref,
)
from moekit.runtime.device import use_triton
from moekit.runtime.op import kernel_op
from moekit.runtime.replay import replayed, tensor_key
from moekit.tuning.grouped_gemm import fp8_ragged_m_config

__all__ = ["grouped_mm_fp8", "grouped_mm_fp8_wgrad"]


def _ragged_m_fp8_fake(a, sa, b, sb, offsets, block, out_dtype):
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)


@kernel_op("grouped_mm_fp8_ragged_m", fake=_ragged_m_fp8_fake)
def _ragged_m_fp8(
    a: torch.Tensor,  # [T, K] e4m3
    sa: torch.Tensor,  # [T, ⌈K/B⌉] fp32 (rowwise: [T, 1])
    b: torch.Tensor,  # [E, N, K] e4m3
    sb: torch.Tensor,  # [E, ⌈N/B⌉, ⌈K/B⌉] fp32 (rowwise: [E, N, 1])
    offsets: torch.Tensor,  # [E]
    block: int | None,  # None: rowwise
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The product of a checked call: the kernel, or the reference on the CPU."""
    if not use_triton(a):
        if block is None:
            return grouped_mm_fp8_rowwise_ref(a, sa, b, sb, offsets, out_dtype)
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
            lambda: grouped_mm_ragged_m(
                a, bt, offsets, out, None, cfg, scales=(sa, sb), rowwise=block is None
            ),
        )  # fmt: skip
    return out


def _check_operands(a: object, b: object) -> bool:
    """Whether checked FP8 operands of :func:`grouped_mm_fp8` are rowwise (else blockwise):
    ``a`` fixes the recipe and ``b`` must follow it."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, Fp8Tensor):
            raise TypeError(f"{name} must be an Fp8Tensor (quantize_fp8), got {type(t).__name__}")
    if a.axis != "row" or a.block not in (128, None) or a.transposed or a.data.dim() != 2:
        raise ValueError(
            "a must be a 2-D Fp8Tensor quantized with axis='row' and block=128 (blockwise) or "
            f"block=None (rowwise), got {a.data.dim()}-D, axis={a.axis!r}, block={a.block}, "
            f"transposed={a.transposed}"
        )
    rowwise = a.block is None
    if rowwise:  # one scale per output channel: w's rows, or the columns of w's dgrad copy
        ok = (b.axis, b.block, b.transposed) in (("row", None, False), ("col", None, True))
        want = (
            "axis='row', block=None (the forward's weight) or axis='col', block=None, "
            "transpose=True (the dgrad's), as a is rowwise (block=None)"
        )
    else:
        ok = (b.axis, b.block, b.transposed) == ("both", 128, False)
        want = "axis='both', block=128, as a is blockwise (block=128)"
    if not ok or b.data.dim() != 3:
        raise ValueError(
            f"b must be a 3-D Fp8Tensor quantized with {want}; got {b.data.dim()}-D, "
            f"axis={b.axis!r}, block={b.block}, transposed={b.transposed}"
        )
    return rowwise


def grouped_mm_fp8(
    a: Fp8Tensor,
    b: Fp8Tensor,
    offsets: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """FP8 grouped GEMM, ragged M (the forward and dgrad of an expert layer): ``y[rows of e] =
    a[rows of e] @ b[e]ᵀ``, blockwise (promoted to fp32 once per 128 of K) or rowwise (the
    whole K summed, then scaled once: ``acc · sa[row] · sb[e, col]``), as ``a`` is quantized.

    Args:
        a: rows [T, K] quantized with ``axis="row"``: ``block=128`` (blockwise, 1×128 blocks)
            or ``block=None`` (rowwise, one scale per row).
        b: the experts' weights [E, N, K] (nn.Linear layout, ``b.data`` with unit stride
            along K) quantized for a's recipe: blockwise ``axis="both"`` (128×128 blocks);
            rowwise ``axis="row", block=None`` (one scale per output channel). For the dgrad
            ``dx = dy · w`` (contracting over N) b is w's copy with one scale per input
            channel, stored [E, K, N]: blockwise ``wq.t()`` of the forward's copy, rowwise
            ``quantize_fp8(w, axis="col", block=None, transpose=True)`` (from w itself).
        offsets: [E] int32/int64 cumulative end offsets on a's device; rows past
            ``offsets[-1]`` give zeros.
        out_dtype: bfloat16, float16 or float32.

    Returns:
        [T, N] in ``out_dtype`` (N = ``b.data.shape[1]``). Not differentiable:
        :func:`moekit.ops.fp8_linear.grouped_linear_fp8` is the layer with autograd.
    """
    rowwise = _check_operands(a, b)
    (T, K), (E, N, Kb) = a.data.shape, b.data.shape  # b as the GEMM reads it: [E, N, K]
    if Kb != K:
        raise ValueError(f"b.data.shape[2] must equal K = a.shape[1] = {K}, got {Kb}")
    if b.data.stride(2) != 1:
        raise ValueError(f"b.data must have unit stride along K, got strides {b.data.stride()}")
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    for name, size, width in (
        ("K (a.shape[1])", K, 1),
        ("N (b.data.shape[1])", N, out_dtype.itemsize),
    ):
        if size * width % 16:
            raise ValueError(f"{name} must span a multiple of 16 bytes, got {size}")
    offsets = check_offsets(offsets, E, "a.data", a.data, "b.shape[0]")
    check_offsets_values(offsets, T, rows_what="a.shape[0] (T)")
    if b.device != a.device:
        raise ValueError(f"b must be on a's device {a.device}, got {b.device}")
    check_fp8_device("a", a.data)
    sa, sb = a.scale.contiguous(), b.scale.contiguous()
    if rowwise:  # [E, N, 1] or, for the dgrad's copy, [E, 1, N]: one scale per output channel
        sb = sb.view(E, N, 1)
    block = None if rowwise else 128
    return _ragged_m_fp8(a.data, sa, b.data, sb, offsets.contiguous(), block, out_dtype)


@kernel_op(
    "grouped_mm_fp8_wgrad",
    fake=lambda a, sa, b, sb, offsets, block, out, accumulate: None,
    mutates_args=("out",),
)
def _wgrad_fp8(
    a: torch.Tensor,  # [M, T] e4m3
    sa: torch.Tensor,  # [⌈T/B⌉, M]
    b: torch.Tensor,  # [N, T] e4m3
    sb: torch.Tensor,  # [⌈T/B⌉, N]
    offsets: torch.Tensor,  # [E]
    block: int,
    out: torch.Tensor,  # [E, M, N] fp32
    accumulate: bool,
) -> None:
    """``out`` (+)= the product of a checked call: the kernel, or the reference on the CPU."""
    if not use_triton(a):
        got = grouped_mm_fp8_wgrad_ref(a, sa, b, sb, offsets, block)
        if accumulate:
            out.add_(got)
        else:
            out.copy_(got)  # rounded once to out's dtype
        return
    cfg = fp8_ragged_m_config(block)
    key = None
    if a.is_cuda:
        key = ("grouped_mm_fp8_wgrad", block, accumulate,
               *map(tensor_key, (a, sa, b, sb, offsets, out)))  # fmt: skip
    replayed(
        key, (a, sa, b, sb, offsets, out),
        lambda: wgrad_kernel(a, b, sa, sb, offsets, out, accumulate, cfg),
    )  # fmt: skip


def _check_wgrad_operand(name: str, t: object) -> None:
    if not isinstance(t, Fp8Tensor):
        raise TypeError(f"{name} must be an Fp8Tensor (quantize_fp8), got {type(t).__name__}")
    if t.axis != "col" or not t.transposed or t.block != 128 or t.data.dim() != 2:
        raise ValueError(
            f"{name} must be a 2-D Fp8Tensor from quantize_fp8(..., axis='col', "
            f"transpose=True) with block=128, got {t.data.dim()}-D, axis={t.axis!r}, "
            f"transposed={t.transposed}, block={t.block}"
        )


def _check_token_blocks(offsets: torch.Tensor, T: int) -> None:
    """Every expert's tokens must start and end at multiples of 128 (``permute(align=128)``
    gives that): on the host for CPU offsets, on the device under MOEKIT_DEBUG=1."""
    if offsets.device.type == "cpu":
        bad = (offsets % 128 != 0).nonzero()
        if bad.numel():
            e = int(bad[0, 0])
            raise ValueError(
                f"offsets must be multiples of 128 (each expert's tokens in whole 128-token "
                f"blocks, e.g. permute(align=128)), got offsets[{e}] = {int(offsets[e])}"
            )
    elif debug_checks():
        torch._assert_async((offsets % 128 == 0).all(), "offsets must be multiples of 128")


def grouped_mm_fp8_wgrad(
    a: Fp8Tensor,
    b: Fp8Tensor,
    offsets: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Blockwise FP8 weight gradient, ragged over the tokens: ``c[e] = aᵀ[tokens of e] @
    b[tokens of e]`` in fp32, promoted once per 128 tokens.

    Args:
        a: the output gradient dy [T, M] and b: the layer's input x [T, N], each quantized
            with ``quantize_fp8(..., axis="col", transpose=True)`` (128×1 blocks along the
            tokens, stored [M, T] / [N, T]).
        offsets: [E] cumulative token ends, each a multiple of 128 (checked on the host for
            CPU offsets, under MOEKIT_DEBUG=1 on the device; otherwise undefined but
            memory-safe); tokens past ``offsets[-1]`` take no part.
        out: [E, M, N] fp32 to write (or, with ``accumulate``, add) into, e.g. an expert
            weight's ``main_grad`` viewed as [E, M, N]; an expert without tokens leaves it as
            it is when accumulating.
        out_dtype: the dtype of the result when ``out`` is not given (fp32, or the weight's:
            the fp32 sums are rounded once, as they are stored).

    Returns:
        [E, M, N] (``out`` when given). For y = x·wᵀ with w [E, M, N] this is dw.
    """
    _check_wgrad_operand("a", a)
    _check_wgrad_operand("b", b)
    (T, M), (Tb, N) = a.shape, b.shape
    if Tb != T:
        raise ValueError(f"b must have a's {T} tokens (shape[0]), got {Tb}")
    for name, size in (("T (a.shape[0])", T), ("M (a.shape[1])", M), ("N (b.shape[1])", N)):
        if size % 16:
            raise ValueError(f"{name} must be a multiple of 16, got {size}")
    offsets = check_offsets(offsets, None, "a.data", a.data, None)
    check_offsets_values(offsets, T, rows_what="the tokens T (a.shape[0])")
    _check_token_blocks(offsets, T)
    E = offsets.shape[0]
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out= (the tensor to accumulate into)")
        if out_dtype not in FLOAT_DTYPES:
            raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
        out = torch.empty(E, M, N, dtype=out_dtype, device=a.device)
    elif out.shape != (E, M, N) or out.dtype != torch.float32 or out.stride(2) != 1:
        raise ValueError(
            f"out must be an fp32 [{E}, {M}, {N}] tensor with unit stride along N, got "
            f"{out.dtype} {tuple(out.shape)} strides {out.stride()}"
        )
    check_fp8_device("a", a.data)
    _wgrad_fp8(
        a.data, a.scale.contiguous(), b.data, b.scale.contiguous(), offsets.contiguous(), 128,
        out, bool(accumulate),
    )  # fmt: skip
    return out
