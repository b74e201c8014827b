"""``grouped_mm``: one GEMM launch for all experts, with the semantics of ``torch._grouped_mm``.

Two forms, chosen by the operands' ranks:

* 2-D × 3-D, ragged M (forward, dgrad): a [T, K] @ b [E, K, N] → [T, N]; rows
  offsets[e-1]:offsets[e] of ``a`` use ``b[e]``; rows past offsets[-1] are zero.
* 2-D × 2-D, ragged K (weight gradient): a [M, T] @ b [T, N] → [E, M, N]; expert e contracts
  over columns offsets[e-1]:offsets[e]; an expert with no columns gives zeros.

CUDA tensors run the Triton kernels (:mod:`moekit.kernels.grouped_gemm`); CPU tensors run the
reference, or the kernels in Triton's interpreter when moekit is imported with
``TRITON_INTERPRET=1``. The kernel ops below (also used by ``grouped_linear``) are
``torch.library`` custom ops (:mod:`moekit.runtime.op`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from moekit.config import debug_checks
from moekit.kernels import grouped_gemm as kernels
from moekit.ops.autocast import autocast_dtype, autocast_on, autocast_tensors, autocast_weight
from moekit.ops.validation import (
    FLOAT_DTYPES,
    check_byte_aligned,
    check_dim_size,
    check_dtype,
    check_interpretable,
    check_ndim,
    check_offsets,
    check_offsets_values,
    check_same_device,
    check_tensor,
)
from moekit.reference.grouped_gemm import grouped_mm_ragged_k_ref, grouped_mm_ragged_m_ref
from moekit.runtime.device import num_sms, use_triton
from moekit.runtime.op import (
    call_key,
    function_apply,
    kernel_op,
    needs_grad,
    planned,
    refuse_double_backward,
)
from moekit.runtime.replay import replayed, tensor_key
from moekit.runtime.tma import aligned_copy, tma_ready, tma_rows, tma_strides
from moekit.tuning import grouped_gemm as tuning

__all__ = [
    "grouped_mm",
    "input_and_bias_grads",
    "launch_ragged_k",
    "launch_ragged_m",
    "ragged_k",
    "ragged_k_out",
    "ragged_m",
    "ragged_m_out",
    "segment_sum_rows",
    "weight_layout",
]


def weight_layout(b: torch.Tensor) -> torch.Tensor:
    """b [E, K, N] as the kernel reads it: with unit stride along N or along K (e.g. the
    ``weight.transpose(-2, -1)`` view of an [E, N, K] weight, read without a copy); other
    layouts are copied to unit stride along N (N is 16-byte aligned by validation)."""
    if tma_ready(b, 2) or tma_ready(b, 1):
        return b
    return aligned_copy(b)


def launch_ragged_m(a, b, offsets, bias, out, zero_tail: bool = True) -> None:
    """Choose the config (tuning on a first call) and launch the ragged-M kernel; operands
    already TMA-ready (``a``, ``out`` rows; ``b`` via :func:`weight_layout`), offsets
    contiguous. ``zero_tail`` False leaves the rows past offsets[-1] unwritten."""
    T, K = a.shape
    E, _, N = b.shape

    def launch(cfg: tuning.GemmConfig, offsets: torch.Tensor = offsets) -> None:
        kernels.grouped_mm_ragged_m(a, b, offsets, out, bias, cfg, zero_tail)

    key = (N, K, E, b.stride(1) == 1 and b.stride(2) != 1, bias is not None)
    cands = tuning.ragged_m_candidates(a.dtype, T, E, K, N, num_sms(a))
    cfg = tuning.choose_config(
        "m", key, a.dtype, a.device, cands,
        lambda: tuning.routing_robust_launches(launch, T, E, offsets),
    )  # fmt: skip
    launch(cfg)


def launch_ragged_k(a, b, offsets, out, accumulate: bool) -> None:
    """Choose the config and launch the ragged-K kernel; ``a`` the transposed view of
    TMA-ready rows, ``b`` TMA-ready rows, offsets contiguous."""
    M, N, E = a.shape[0], b.shape[1], offsets.shape[0]

    def tuning_launches():
        # Timed into a scratch output, so that an accumulating call adds exactly once, on this
        # call's routing and on a skewed one (where a static deal is least balanced).
        scratch = torch.empty_like(out)
        skewed = tuning.skewed_offsets(a.shape[1], E, offsets)
        return tuple(
            lambda cfg, o=o: kernels.grouped_mm_ragged_k(a, b, o, scratch, accumulate, cfg)
            for o in (offsets, skewed)
        )

    key = (M, N, E, out.dtype, accumulate)
    cands = tuning.ragged_k_candidates(a.dtype, out.dtype)
    cfg = tuning.choose_config("k", key, a.dtype, a.device, cands, tuning_launches)
    kernels.grouped_mm_ragged_k(a, b, offsets, out, accumulate, cfg)


def _launch_ragged_m(a, b, offsets, bias, out, plan_uid: int) -> None:
    if plan_uid and not (a.data_ptr() | b.data_ptr()) & 15:
        # the plan's layouts are the kernel's and the bases are aligned: nothing to copy
        key = ("grouped_mm_m", plan_uid)
    else:
        a, b = tma_rows(a), weight_layout(b)
        offsets = offsets if offsets.is_contiguous() else offsets.contiguous()
        key = ("grouped_mm_m", *map(tensor_key, (a, b, offsets, bias, out)))
    key = key if a.is_cuda else None
    replayed(key, (a, b, offsets, bias, out), lambda: launch_ragged_m(a, b, offsets, bias, out))


def _launch_ragged_k(a, b, offsets, out, accumulate: bool, plan_uid: int) -> None:
    if plan_uid and not (a.data_ptr() | b.data_ptr()) & 15:
        key = ("grouped_mm_k", plan_uid)
    else:
        # The kernel reads both operands as rows of T: a as the transposed view of a row-major
        # [T, M] (how dy.t() arrives in wgrad) and b row-major [T, N]; other layouts are copied.
        a, b = tma_rows(a.t()).t(), tma_rows(b)
        offsets = offsets if offsets.is_contiguous() else offsets.contiguous()
        key = ("grouped_mm_k", *map(tensor_key, (a, b, offsets, out)), accumulate)
    key = key if a.is_cuda else None
    replayed(key, (a, b, offsets, out), lambda: launch_ragged_k(a, b, offsets, out, accumulate))


def _run_ragged_m(a, b, offsets, bias, out, plan_uid: int = 0) -> None:
    if a.shape[0] == 0:
        return
    if use_triton(a):
        _launch_ragged_m(a, b, offsets, bias, out, plan_uid)
    else:
        out.copy_(grouped_mm_ragged_m_ref(a, b, offsets, out.dtype, bias))


def _run_ragged_k(a, b, offsets, out, accumulate: bool, plan_uid: int = 0) -> None:
    if a.shape[1] == 0:  # T = 0: every expert is empty
        if not accumulate:
            out.zero_()
        return
    if use_triton(a):
        _launch_ragged_k(a, b, offsets, out, accumulate, plan_uid)
    elif accumulate:
        out.add_(grouped_mm_ragged_k_ref(a, b, offsets, out.dtype))
    else:
        out.copy_(grouped_mm_ragged_k_ref(a, b, offsets, out.dtype))


def _ragged_m_fake(a, b, offsets, bias, out_dtype, plan_uid=0):
    return a.new_empty(a.shape[0], b.shape[2], dtype=out_dtype)


@kernel_op("grouped_mm_ragged_m", fake=_ragged_m_fake)
def ragged_m(
    a: torch.Tensor,  # [T, K]
    b: torch.Tensor,  # [E, K, N]
    offsets: torch.Tensor,  # [E]
    bias: torch.Tensor | None,  # [E, N]
    out_dtype: torch.dtype,
    plan_uid: int = 0,  # a validated plan whose layouts the kernel reads as given (0: none)
) -> torch.Tensor:  # [T, N]
    """Ragged-M grouped GEMM into a new tensor (inputs already validated)."""
    out = torch.empty(a.shape[0], b.shape[2], dtype=out_dtype, device=a.device)
    _run_ragged_m(a, b, offsets, bias, out, plan_uid)
    return out


@kernel_op(
    "grouped_mm_ragged_m_out", fake=lambda a, b, offsets, bias, out: None, mutates_args=("out",)
)
def ragged_m_out(
    a: torch.Tensor,  # [T, K]
    b: torch.Tensor,  # [E, K, N]
    offsets: torch.Tensor,  # [E]
    bias: torch.Tensor | None,  # [E, N]
    out: torch.Tensor,  # [T, N] contiguous
) -> None:
    """Ragged-M grouped GEMM into ``out``."""
    _run_ragged_m(a, b, offsets, bias, out)


def _ragged_k_fake(a, b, offsets, out_dtype, plan_uid=0):
    return a.new_empty(offsets.shape[0], a.shape[0], b.shape[1], dtype=out_dtype)


@kernel_op("grouped_mm_ragged_k", fake=_ragged_k_fake)
def ragged_k(
    a: torch.Tensor,  # [M, T]
    b: torch.Tensor,  # [T, N]
    offsets: torch.Tensor,  # [E]
    out_dtype: torch.dtype,
    plan_uid: int = 0,  # as in ragged_m
) -> torch.Tensor:  # [E, M, N]
    """Ragged-K grouped GEMM into a new tensor."""
    out = torch.empty(offsets.shape[0], a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    _run_ragged_k(a, b, offsets, out, False, plan_uid)
    return out


@kernel_op(
    "grouped_mm_ragged_k_out",
    fake=lambda a, b, offsets, out, accumulate: None,
    mutates_args=("out",),
)
def ragged_k_out(
    a: torch.Tensor,  # [M, T]
    b: torch.Tensor,  # [T, N]
    offsets: torch.Tensor,  # [E]
    out: torch.Tensor,  # [E, M, N], any strides
    accumulate: bool,
) -> None:
    """Ragged-K grouped GEMM into ``out`` (``out +=`` with ``accumulate``)."""
    _run_ragged_k(a, b, offsets, out, accumulate)


def segment_sum_rows(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-expert sum of the rows of x [T, N] → [E, N] in fp32, without a host sync."""
    rows = torch.arange(x.shape[0], device=x.device, dtype=offsets.dtype)
    expert = torch.searchsorted(offsets.contiguous(), rows, right=True)  # E past offsets[-1]
    out = torch.zeros(offsets.shape[0] + 1, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, expert, x.float())[:-1]


def input_and_bias_grads(ctx, grad, b_t, offsets, dtype) -> tuple:
    """The input and bias gradients of a ragged-M product y = a @ b[e] (+ bias[e]) inside an
    autograd Function whose inputs 0 and 3 are a and bias: da = grad @ b[e]^T (``b_t`` is
    b [E, K, N] viewed [E, N, K]) and the per-expert row sums of grad."""
    da = dbias = None
    if ctx.needs_input_grad[0]:
        da = ragged_m(grad, b_t, offsets, None, dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[3]:
        dbias = segment_sum_rows(grad, offsets).to(ctx.bias_dtype)
    return da, dbias


class _RaggedMFn(torch.autograd.Function):
    """``master``: None, or the higher-precision ``b`` that ``b`` is a per-call cast of
    (autocast): its gradient comes out of the wgrad kernel in its dtype directly."""

    @staticmethod
    def forward(ctx, a, b, offsets, bias, out_dtype, plan_uid, master=None):
        ctx.save_for_backward(a, b, offsets)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.master_dtype = None if master is None else master.dtype
        return ragged_m(a, b, offsets, bias, out_dtype, plan_uid)

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward("grouped_mm")
        a, b, offsets = ctx.saved_tensors
        grad = grad.to(a.dtype)
        da, dbias = input_and_bias_grads(ctx, grad, b.transpose(1, 2), offsets, a.dtype)
        db = None
        if ctx.needs_input_grad[1]:
            db = ragged_k(a.t(), grad, offsets, ctx.master_dtype or b.dtype)
        if ctx.master_dtype is not None:
            return da, None, None, dbias, None, None, db
        return da, db, None, dbias, None, None, None


class _RaggedKFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, offsets, out_dtype, plan_uid):
        ctx.save_for_backward(a, b, offsets)
        return ragged_k(a, b, offsets, out_dtype, plan_uid)

    @staticmethod
    def backward(ctx, grad):
        # c[e] = a[:, Se] @ b[Se]  ⇒  da[:, Se] = grad[e] @ b[Se]^T,  db[Se] = a[:, Se]^T @ grad[e]
        refuse_double_backward("grouped_mm")
        a, b, offsets = ctx.saved_tensors
        grad = grad.to(a.dtype)
        da = db = None
        if ctx.needs_input_grad[0]:
            da = ragged_m(b, grad.transpose(1, 2), offsets, None, a.dtype).t()
        if ctx.needs_input_grad[1]:
            db = ragged_m(a.t(), grad, offsets, None, b.dtype)
        return da, db, None, None, None


_apply_ragged_m = function_apply(_RaggedMFn)
_apply_ragged_k = function_apply(_RaggedKFn)


# ------------------------------------------------------------------------------------------------
# Plans: a call's validation, done once per static configuration
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    ragged_m: bool
    out_dtype: torch.dtype
    uid: int = 0  # see moekit.runtime.op.planned


def _kernel_layouts(a, b, offsets, ragged_m: bool) -> bool:
    """Whether the kernel reads these operands as they are (TMA-ready rows, contiguous
    offsets), so that a plan's uid may key their launch replay."""
    if ragged_m:
        ready = tma_strides(a) and (tma_strides(b, 2) or tma_strides(b, 1))
    else:
        ready = tma_strides(a.t()) and tma_strides(b)
    return ready and offsets.is_contiguous()


def _run_plan(plan: _Plan, a, b, offsets, bias, master=None) -> torch.Tensor:
    """The product of a validated call; through the autograd Function only when a gradient
    is wanted (``master``: see _RaggedMFn)."""
    grad = needs_grad(a, b, bias)
    if plan.ragged_m:
        if master is not None and grad:
            return _apply_ragged_m(a, b, offsets, bias, plan.out_dtype, plan.uid, master)
        run = _apply_ragged_m if grad else ragged_m
        return run(a, b, offsets, bias, plan.out_dtype, plan.uid)
    run = _apply_ragged_k if grad else ragged_k
    return run(a, b, offsets, plan.out_dtype, plan.uid)


def check_ragged_m_inputs(
    a: torch.Tensor, b: torch.Tensor, offsets: object, bias: object, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shape/dtype/device/alignment checks of the ragged-M form; returns (offsets, bias)."""
    K = a.shape[1]
    E, _, N = b.shape
    check_dim_size("b", b, 1, K, "a.shape[1] (K)")
    offsets = check_offsets(offsets, E, "a", a, "b.shape[0]")
    check_byte_aligned("a", K, a.dtype, "K (a.shape[1])")
    check_byte_aligned("b", N, b.dtype, "N (b.shape[2])")
    check_byte_aligned("out", N, out_dtype, "N (b.shape[2])")
    if bias is not None:
        bias = check_tensor("bias", bias)
        check_ndim("bias", bias, 2, "[E, N]")
        check_dim_size("bias", bias, 0, E, "E")
        check_dim_size("bias", bias, 1, N, "N")
        check_same_device("bias", bias, "a", a)
        check_dtype("bias", bias, FLOAT_DTYPES)
        if bias.stride(1) != 1:
            raise ValueError(f"bias must have unit stride along N, got strides {bias.stride()}")
    return offsets, bias


def _check_out(out: object, shape: tuple[int, ...], dtype: torch.dtype, a: torch.Tensor) -> None:
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != a.device:
        raise ValueError(
            f"out must be a {list(shape)} {dtype} tensor on {a.device}, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )


def _check_no_grad(*tensors: torch.Tensor | None) -> None:
    if needs_grad(*tensors):
        raise ValueError("out= does not support autograd; call grouped_mm without out= instead")


_RAGGED_M_FORM = (
    "the ragged-M form (chosen because b is 3-D): a [T, K] @ b [E, K, N] -> [T, N], rows "
    "offsets[e-1]:offsets[e] of a times expert e's b[e]"
)
_RAGGED_K_FORM = (
    "the ragged-K form (chosen because b is 2-D): a [M, T] @ b [T, N] -> [E, M, N], the "
    "weight-gradient form, where expert e contracts over columns offsets[e-1]:offsets[e] of a "
    "and those rows of b; for per-expert weights pass b as [E, K, N] (ragged M), and for one "
    "weight shared by every row use a plain a @ b"
)


@contextlib.contextmanager
def _in_form(form: str, a: torch.Tensor, b: torch.Tensor):
    """Adds to a check's ValueError/TypeError which grouped form grouped_mm took from the
    operands' ranks and the shapes that form expects, for a caller who meant another."""
    try:
        yield
    except (ValueError, TypeError) as e:
        raise type(e)(
            f"{e}; grouped_mm took {form}; got a {tuple(a.shape)} and b {tuple(b.shape)}"
        ) from None


def _grouped_mm_ragged_m(a, b, offsets, out_dtype, out, accumulate, bias, validate):
    T, N = a.shape[0], b.shape[2]
    with _in_form(_RAGGED_M_FORM, a, b):
        offsets, bias = check_ragged_m_inputs(a, b, offsets, bias, out_dtype)
        if accumulate:
            raise ValueError("accumulate=True is supported for the ragged-K form (2-D × 2-D) only")
        check_offsets_values(offsets, T, rows_what="a.shape[0] (T)", device_check=validate)
        if out is not None:
            _check_out(out, (T, N), out_dtype, a)
            if not out.is_contiguous():
                raise ValueError(
                    f"out must be contiguous for the ragged-M form, got strides {out.stride()}"
                )
    if out is None:
        return _Plan(True, out_dtype)
    _check_no_grad(a, b, bias)
    if tma_ready(out):
        ragged_m_out(a, b, offsets, bias, out)
    else:  # the kernel's TMA store needs a 16-byte aligned base: write a fresh buffer, copy
        fresh = torch.empty_like(out)  # out is contiguous; a fresh block is aligned
        ragged_m_out(a, b, offsets, bias, fresh)
        out.copy_(fresh)
    return out


def _grouped_mm_ragged_k(a, b, offsets, out_dtype, out, accumulate, bias, validate):
    M, T = a.shape
    N = b.shape[1]
    with _in_form(_RAGGED_K_FORM, a, b):
        check_dim_size("b", b, 0, T, "a.shape[1] (T, the ragged dimension)")
        offsets = check_offsets(offsets, None, "a", a, None)
        check_byte_aligned("a", M, a.dtype, "M (a.shape[0])")
        check_byte_aligned("b", N, b.dtype, "N (b.shape[1])")
        if bias is not None:
            raise ValueError("bias is supported for the ragged-M form (2-D × 3-D) only")
        check_offsets_values(
            offsets, T, rows_what="a.shape[1] (T, the ragged dimension)", device_check=validate
        )
        if out is not None:
            _check_out(out, (offsets.shape[0], M, N), out_dtype, a)
    if out is None:
        return _Plan(False, out_dtype)
    _check_no_grad(a, b, None)
    ragged_k_out(a, b, offsets, out, accumulate)
    return out


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
            must span a multiple of 16 bytes (8 elements for bf16/fp16, 4 for fp32) on every
            path. Under Triton's interpreter, bf16 is refused (its ``tl.dot`` is wrong there).
        offsets: cumulative end offsets, any stride; ``offsets[-1]`` may be below the ragged
            size (rows past it are zero in ragged-M outputs). Offsets that decrease or end
            past the ragged size raise (see ``validate``); CUDA offsets are never read on the
            host.
        out_dtype: output dtype, default ``out.dtype`` with ``out``, else ``a.dtype``;
            ``torch.float32`` is allowed with 16-bit inputs in both forms (torch._grouped_mm
            refuses it for ragged K).
        out: write into this tensor instead of allocating (no autograd).
        accumulate: ragged K only, with ``out``: ``out += result`` in place (a Megatron-style
            fp32 ``main_grad``); experts with no columns leave ``out`` untouched.
        bias: per-expert bias added to each row (ragged M only).
        validate: on a GPU, also check that offsets are non-decreasing and end at most at
            the ragged size, on the device (``torch._assert_async``: no host sync; a failure
            surfaces as a device-side assert at the next synchronisation). Off by default
            (``MOEKIT_DEBUG=1`` turns it on for every call); with malformed offsets and no
            check the result is undefined (but memory-safe). CPU tensors are always checked,
            on the host (``ValueError``).

    Returns:
        [T, N] (ragged M) or [E, M, N] (ragged K); ``out`` itself when given.

    Inside a ``torch.autocast`` region and without ``out`` (as ``torch.mm``, whose ``out=``
    form autocast leaves alone), a, b and bias are first cast to its dtype, which then is the
    default ``out_dtype``; unless the aligned sizes above would not span a multiple of 16
    bytes in it, which keeps the call in its own dtype. A higher-precision ragged-M ``b`` (a
    weight) that needs a gradient is cast outside autograd, and the wgrad kernel writes its
    gradient in its dtype directly (no gradient in the region's dtype for autograd to cast
    again).
    """
    if isinstance(a, torch.Tensor) and autocast_on(a.device.type):
        master = None
        if out is None and isinstance(b, torch.Tensor) and a.dim() == 2:
            aligned = (a.shape[1] if b.dim() == 3 else a.shape[0], b.shape[-1])
            a, bias = autocast_tensors(a.device.type, (a, bias), aligned)
            dtype = autocast_dtype(a.device.type, *aligned)
            # ragged K: b is an activation, not a weight: a differentiable cast
            b, master = autocast_weight(b, dtype, master=b.dim() == 3)
        with torch.autocast(a.device.type, enabled=False):  # the op's own torch calls as-is
            if master is not None:
                return _grouped_mm(
                    a, b, offsets, out_dtype, None, accumulate, bias, validate, master
                )
            return grouped_mm(
                a, b, offsets, out_dtype=out_dtype, out=out, accumulate=accumulate, bias=bias,
                validate=validate,
            )  # fmt: skip
    return _grouped_mm(a, b, offsets, out_dtype, out, accumulate, bias, validate, None)


def _grouped_mm(a, b, offsets, out_dtype, out, accumulate, bias, validate, master):
    """grouped_mm outside autocast; ``master``: see _RaggedMFn (ragged M, no ``out``)."""
    if validate is False and debug_checks():  # MOEKIT_DEBUG=1: validate every call
        validate = True
    if out is None and validate is False and accumulate is False:
        key = call_key("grouped_mm", (a, b, offsets, bias), (out_dtype,))
        plan = planned(
            key,
            lambda: _checked(a, b, offsets, out_dtype, None, False, bias, False),
            lambda: _kernel_layouts(a, b, offsets, b.dim() == 3),
        )
        return _run_plan(plan, a, b, offsets, bias, master)
    done = _checked(a, b, offsets, out_dtype, out, accumulate, bias, validate)
    return _run_plan(done, a, b, offsets, bias, master) if out is None else done


def _checked(a, b, offsets, out_dtype, out, accumulate, bias, validate):
    """Every check of a call; the plan of a call without ``out``, else the product in ``out``."""
    a = check_tensor("a", a)
    b = check_tensor("b", b)
    if a.dim() != 2 or b.dim() not in (2, 3):
        name, shape = ("a", a.shape) if a.dim() != 2 else ("b", b.shape)
        raise ValueError(
            f"{name} has shape {tuple(shape)}: grouped_mm takes a 2-D a with a 3-D b (ragged "
            "M: a [T, K] x b [E, K, N]) or a 2-D b (ragged K: a [M, T] x b [T, N]); got a "
            f"{tuple(a.shape)} and b {tuple(b.shape)}"
        )
    check_dtype("a", a, FLOAT_DTYPES)
    if b.dtype != a.dtype:
        raise TypeError(f"b must have a's dtype {a.dtype}, got {b.dtype}")
    check_same_device("b", b, "a", a)
    check_interpretable("a", a)
    if out is not None:
        out = check_tensor("out", out)
    for name, flag in (("accumulate", accumulate), ("validate", validate)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else a.dtype
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of bfloat16, float16, float32, got {out_dtype}")
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out= (the tensor to accumulate into)")
    if b.dim() == 3:
        return _grouped_mm_ragged_m(a, b, offsets, out_dtype, out, accumulate, bias, validate)
    return _grouped_mm_ragged_k(a, b, offsets, out_dtype, out, accumulate, bias, validate)
