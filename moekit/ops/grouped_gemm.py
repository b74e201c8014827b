"""``grouped_mm``: one GEMM launch for all experts, with the semantics of ``torch._grouped_mm``.

Two forms, chosen by the operands' ranks:

* 2-D × 3-D, ragged M (forward, dgrad): a [T, K] @ b [E, K, N] → [T, N]; rows
  offsets[e-1]:offsets[e] of ``a`` use ``b[e]``; rows past offsets[-1] are zero.
* 2-D × 2-D, ragged K (weight gradient): a [M, T] @ b [T, N] → [E, M, N]; expert e contracts
  over columns offsets[e-1]:offsets[e]; an expert with no columns gives zeros.

CUDA tensors run the Triton kernels (moekit.kernels.grouped_gemm); CPU tensors run the
reference, or the kernels in Triton's interpreter when ``TRITON_INTERPRET=1``. Each form is a
``torch.library`` custom op so ``torch.compile(fullgraph=True)`` treats it as one opaque node.
"""

from __future__ import annotations

import torch

from moekit.kernels import grouped_gemm as _kernels
from moekit.ops._dispatch import use_triton
from moekit.ops._validate import (
    check_byte_aligned,
    check_dim_size,
    check_dtype,
    check_ndim,
    check_same_device,
    check_tensor,
)
from moekit.reference.grouped_gemm import grouped_mm_ragged_k_ref, grouped_mm_ragged_m_ref

__all__ = ["grouped_mm"]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------------------------
# layout preparation for the TMA kernels
# --------------------------------------------------------------------------------------------


def _tma_ok(t: torch.Tensor, unit_dim: int) -> bool:
    """TMA needs one unit-stride dim, 16-byte aligned other strides and a 16-byte aligned base."""
    size = t.element_size()
    if t.stride(unit_dim) != 1 and t.shape[unit_dim] > 1:
        return False
    others = [s for d, s in enumerate(t.stride()) if d != unit_dim % t.dim() and t.shape[d] > 1]
    return t.data_ptr() % 16 == 0 and all((s * size) % 16 == 0 for s in others)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    # Only strided views the TMA engine cannot address (e.g. a[:, ::2]) are copied.
    return t if _tma_ok(t, -1) else t.contiguous()


def _either_major(t: torch.Tensor, dims: tuple[int, int], fallback: int) -> torch.Tensor:
    """Keep ``t`` if either of ``dims`` has unit stride with aligned other strides (the kernels
    read both), e.g. ``weight.transpose(-2, -1)`` without a copy; otherwise copy it so that
    ``fallback`` (a dim whose size is 16-byte aligned by validation) becomes the unit-stride dim.
    """
    if _tma_ok(t, dims[1]) or _tma_ok(t, dims[0]):
        return t
    return t.movedim(fallback, -1).contiguous().movedim(-1, fallback)


# --------------------------------------------------------------------------------------------
# custom ops
# --------------------------------------------------------------------------------------------


def _run_ragged_m(a, b, offsets, bias, out) -> None:
    if a.shape[0] == 0:
        return
    if use_triton(a):
        _kernels.grouped_mm_ragged_m(_row_major(a), _either_major(b, (1, 2), 2), offsets, out, bias)
    else:
        out.copy_(grouped_mm_ragged_m_ref(a, b, offsets, out.dtype, bias))


def _run_ragged_k(a, b, offsets, out, accumulate: bool) -> None:
    if a.shape[1] == 0:  # T = 0: every expert is empty
        if not accumulate:
            out.zero_()
        return
    if use_triton(a):
        # The kernel reads both operands as rows of T: a as the transposed view of a row-major
        # [T, M] (how dy.t() arrives in wgrad) and b row-major [T, N]; other layouts are copied.
        a_rows = a.t() if _tma_ok(a.t(), -1) else a.t().contiguous()
        _kernels.grouped_mm_ragged_k(a_rows.t(), _row_major(b), offsets, out, accumulate)
    else:
        res = grouped_mm_ragged_k_ref(a, b, offsets, out.dtype)
        if accumulate:
            out.add_(res)
        else:
            out.copy_(res)


@torch.library.custom_op("moekit::grouped_mm_ragged_m", mutates_args=())
def _ragged_m_op(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    out = torch.empty(a.shape[0], b.shape[2], dtype=out_dtype, device=a.device)
    _run_ragged_m(a, b, offsets, bias, out)
    return out


@_ragged_m_op.register_fake
def _(a, b, offsets, bias, out_dtype):
    return a.new_empty(a.shape[0], b.shape[2], dtype=out_dtype)


@torch.library.custom_op("moekit::grouped_mm_ragged_m_out", mutates_args=("out",))
def _ragged_m_out_op(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    _run_ragged_m(a, b, offsets, bias, out)


@_ragged_m_out_op.register_fake
def _(a, b, offsets, bias, out):
    return None


@torch.library.custom_op("moekit::grouped_mm_ragged_k", mutates_args=())
def _ragged_k_op(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    out = torch.empty(offsets.shape[0], a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    _run_ragged_k(a, b, offsets, out, accumulate=False)
    return out


@_ragged_k_op.register_fake
def _(a, b, offsets, out_dtype):
    return a.new_empty(offsets.shape[0], a.shape[0], b.shape[1], dtype=out_dtype)


@torch.library.custom_op("moekit::grouped_mm_ragged_k_out", mutates_args=("out",))
def _ragged_k_out_op(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, accumulate: bool
) -> None:
    _run_ragged_k(a, b, offsets, out, accumulate)


@_ragged_k_out_op.register_fake
def _(a, b, offsets, out, accumulate):
    return None


# --------------------------------------------------------------------------------------------
# autograd: dgrad is ragged-M with the transposed weight, wgrad is ragged-K
# --------------------------------------------------------------------------------------------


def segment_sum_rows(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-expert sum of the rows of x [T, N] → [E, N] in fp32, without a host sync."""
    rows = torch.arange(x.shape[0], device=x.device, dtype=offsets.dtype)
    expert = torch.searchsorted(offsets, rows, right=True)  # E for rows past offsets[-1]
    out = torch.zeros(offsets.shape[0] + 1, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, expert, x.float())[:-1]


def _ragged_m_setup(ctx, inputs, output):
    a, b, offsets, bias, _ = inputs
    ctx.save_for_backward(a, b, offsets)
    ctx.has_bias = bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _ragged_m_backward(ctx, grad):
    a, b, offsets = ctx.saved_tensors
    grad = grad.to(a.dtype)
    da = db = dbias = None
    if ctx.needs_input_grad[0]:
        da = _ragged_m_op(grad, b.transpose(1, 2), offsets, None, a.dtype)
    if ctx.needs_input_grad[1]:
        db = _ragged_k_op(a.t(), grad, offsets, b.dtype)
    if ctx.has_bias and ctx.needs_input_grad[3]:
        dbias = segment_sum_rows(grad, offsets).to(ctx.bias_dtype)
    return da, db, None, dbias, None


_ragged_m_op.register_autograd(_ragged_m_backward, setup_context=_ragged_m_setup)


def _ragged_k_setup(ctx, inputs, output):
    a, b, offsets, _ = inputs
    ctx.save_for_backward(a, b, offsets)


def _ragged_k_backward(ctx, grad):
    # c[e] = a[:, Se] @ b[Se]  ⇒  da[:, Se] = grad[e] @ b[Se]^T,  db[Se] = a[:, Se]^T @ grad[e]
    a, b, offsets = ctx.saved_tensors
    grad = grad.to(a.dtype)
    da = db = None
    if ctx.needs_input_grad[0]:
        da = _ragged_m_op(b, grad.transpose(1, 2), offsets, None, a.dtype).t()
    if ctx.needs_input_grad[1]:
        db = _ragged_m_op(a.t(), grad, offsets, None, b.dtype)
    return da, db, None, None


_ragged_k_op.register_autograd(_ragged_k_backward, setup_context=_ragged_k_setup)


# --------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------


def _check_offsets(offsets: object, num_groups: int | None, ref: torch.Tensor) -> torch.Tensor:
    offsets = check_tensor("offsets", offsets)
    check_ndim("offsets", offsets, 1, "[E] (cumulative end offsets)")
    check_dtype("offsets", offsets, _INDEX_DTYPES)
    check_same_device("offsets", offsets, "a", ref)
    if offsets.shape[0] == 0:
        raise ValueError("offsets must hold at least one expert, got shape (0,)")
    if num_groups is not None and offsets.shape[0] != num_groups:
        raise ValueError(
            f"offsets has {offsets.shape[0]} entries but b holds E = {num_groups} experts "
            f"(b.shape[0]); they must match"
        )
    return offsets


def _validate_offsets_values(offsets: torch.Tensor, total: int) -> None:
    # Reads offsets on the host: only under validate=True, never in the hot path.
    vals = offsets.tolist()
    prev = 0
    for e, v in enumerate(vals):
        if v < prev:
            raise ValueError(
                f"offsets must be non-decreasing and start at >= 0; offsets[{e}] = {v} < {prev}"
            )
        prev = v
    if prev > total:
        raise ValueError(f"offsets[-1] = {prev} exceeds the ragged dimension's size {total}")


def check_ragged_m_inputs(
    a: torch.Tensor, b: torch.Tensor, offsets: object, bias: object, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shape/dtype/device/alignment checks of the ragged-M form; returns (offsets, bias)."""
    K = a.shape[1]
    E, _, N = b.shape
    check_dim_size("b", b, 1, K, "a.shape[1] (K)")
    offsets = _check_offsets(offsets, E, a)
    check_byte_aligned("a", K, a.dtype, "K (a.shape[1])")
    check_byte_aligned("b", N, b.dtype, "N (b.shape[2])")
    check_byte_aligned("out", N, out_dtype, "N (b.shape[2])")
    if bias is not None:
        bias = check_tensor("bias", bias)
        check_ndim("bias", bias, 2, "[E, N]")
        check_dim_size("bias", bias, 0, E, "E")
        check_dim_size("bias", bias, 1, N, "N")
        check_same_device("bias", bias, "a", a)
        check_dtype("bias", bias, _FLOAT_DTYPES)
        if bias.stride(1) != 1:
            raise ValueError(f"bias must have unit stride along N, got strides {bias.stride()}")
    return offsets, bias


def grouped_mm(
    a: torch.Tensor,  # [T, K] (ragged M) or [M, T] (ragged K); bf16/fp16/fp32
    b: torch.Tensor,  # [E, K, N] (ragged M) or [T, N] (ragged K); a's dtype
    offsets: torch.Tensor,  # [E] int32/int64 cumulative end offsets, on a's device
    *,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,  # [T, N] or [E, M, N]
    accumulate: bool = False,
    bias: torch.Tensor | None = None,  # [E, N], ragged-M only
    validate: bool = False,
) -> torch.Tensor:
    """Grouped matrix product over experts in one launch (see the module docstring for forms).

    Args:
        a, b: operands with fp32 accumulation; any strides (``b`` as ``weight.transpose(-2, -1)``
            of an [E, N, K] weight is read in place). K and N (ragged M), or M and N (ragged K),
            must span a multiple of 16 bytes (8 elements for bf16/fp16, 4 for fp32).
        offsets: cumulative end offsets; ``offsets[-1]`` may be below the ragged size (rows past
            it are zero in ragged-M outputs). Never read on the host unless ``validate=True``.
        out_dtype: output dtype, default ``a.dtype``; ``torch.float32`` is allowed with 16-bit
            inputs in both forms (torch._grouped_mm refuses it for ragged K).
        out: write into this tensor instead of allocating (no autograd).
        accumulate: ragged K only, with ``out``: ``out += result`` in place (a Megatron-style
            fp32 ``main_grad``); experts with no columns leave ``out`` untouched.
        bias: per-expert bias added to each row (ragged M only).
        validate: also check that offsets are non-decreasing and within range. This reads
            offsets on the host (a device sync), so it is off by default; with malformed
            offsets and ``validate=False`` the result is undefined (but memory-safe).

    Returns:
        [T, N] (ragged M) or [E, M, N] (ragged K); ``out`` itself when given.
    """
    a = check_tensor("a", a)
    b = check_tensor("b", b)
    check_dtype("a", a, _FLOAT_DTYPES)
    if b.dtype != a.dtype:
        raise TypeError(f"b must have a's dtype {a.dtype}, got {b.dtype}")
    check_same_device("b", b, "a", a)
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else a.dtype
    if out_dtype not in _FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of bfloat16, float16, float32, got {out_dtype}")
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out= (the tensor to accumulate into)")

    if a.dim() == 2 and b.dim() == 3:  # ragged M
        T, N = a.shape[0], b.shape[2]
        offsets, bias = check_ragged_m_inputs(a, b, offsets, bias, out_dtype)
        if accumulate:
            raise ValueError("accumulate=True is supported for the ragged-K form (2-D × 2-D) only")
        if validate:
            _validate_offsets_values(offsets, T)
        if out is None:
            return _ragged_m_op(a, b, offsets, bias, out_dtype)
        out = check_tensor("out", out)
        if tuple(out.shape) != (T, N) or out.dtype != out_dtype or out.device != a.device:
            raise ValueError(
                f"out must be a [{T}, {N}] {out_dtype} tensor on {a.device}, got "
                f"{tuple(out.shape)} {out.dtype} on {out.device}"
            )
        if not out.is_contiguous():
            raise ValueError(
                f"out must be contiguous for the ragged-M form, got strides {out.stride()}"
            )
        _check_no_grad(a, b, bias)
        _ragged_m_out_op(a, b, offsets, bias, out)
        return out

    if a.dim() == 2 and b.dim() == 2:  # ragged K
        M, T = a.shape
        check_dim_size("b", b, 0, T, "a.shape[1] (T, the ragged dimension)")
        N = b.shape[1]
        offsets = _check_offsets(offsets, None, a)
        E = offsets.shape[0]
        check_byte_aligned("a", M, a.dtype, "M (a.shape[0])")
        check_byte_aligned("b", N, b.dtype, "N (b.shape[1])")
        if bias is not None:
            raise ValueError("bias is supported for the ragged-M form (2-D × 3-D) only")
        if validate:
            _validate_offsets_values(offsets, T)
        if out is None:
            return _ragged_k_op(a, b, offsets, out_dtype)
        out = check_tensor("out", out)
        if tuple(out.shape) != (E, M, N) or out.dtype != out_dtype or out.device != a.device:
            raise ValueError(
                f"out must be an [{E}, {M}, {N}] {out_dtype} tensor on {a.device}, got "
                f"{tuple(out.shape)} {out.dtype} on {out.device}"
            )
        _check_no_grad(a, b, None)
        _ragged_k_out_op(a, b, offsets, out, accumulate)
        return out

    raise ValueError(
        "grouped_mm takes a 2-D a with a 3-D b (ragged M: [T, K] x [E, K, N]) or a 2-D b "
        f"(ragged K: [M, T] x [T, N]); got a {tuple(a.shape)} and b {tuple(b.shape)}"
    )


def _check_no_grad(*tensors: torch.Tensor | None) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise ValueError("out= does not support autograd; call grouped_mm without out= instead")
