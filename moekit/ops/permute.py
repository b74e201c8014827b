"""Token permute / unpermute for MoE layers: public ops, the ``Dispatch`` metadata, autograd.

Dimension letters: T tokens, k experts per token, E experts, R permuted rows, H hidden.

``permute`` copies each token's hidden vector to one row per chosen expert, grouped by expert
(tokens in their original order inside an expert), optionally padding every expert's segment to a
multiple of ``align`` rows in the same pass. ``unpermute`` sums each token's k rows back, weighted
by the routing probs. Both are differentiable w.r.t. the activations and the probs. The CUDA path
never reads anything back to the host (unless ``out_rows="exact"`` is asked for), so a whole MoE
block can be captured in a CUDA graph. See docs/permute.md.

Wrapping (:mod:`moekit.runtime.op`): the row copies are the kernel ops of
:mod:`moekit.ops.permute_rows` (the metadata is ``moekit::routing_metadata``, in
:mod:`moekit.ops.routing`). The autograd Functions call only those and torch ops, so the ops
trace under ``torch.compile``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from moekit.config import debug_checks
from moekit.kernels.permute import QUANT_BLOCK
from moekit.ops.permute_rows import gather, scatter, scatter_fp8
from moekit.ops.quantize import Fp8Recipe, Fp8Tensor, quantize_fp8, stand_in
from moekit.ops.routing import (
    capacity_drop,
    expert_capacity,
    max_rows,
    routing_map_to_indices,
    routing_metadata,
    row_tokens,
    slot_values,
    sort_chunks_row_map,
)
from moekit.ops.validation import (
    FLOAT_DTYPES,
    check_dim_size,
    check_dtype,
    check_expert_ids,
    check_ndim,
    check_same_device,
    check_tensor,
    values_on_host,
)
from moekit.runtime.op import function_apply, needs_grad, refuse_double_backward

__all__ = [
    "SUPPORTED_ALIGNS",
    "Dispatch",
    "DispatchConfig",
    "permute",
    "permuted_rows",
    "sort_chunks_by_index",
    "unpermute",
]

SUPPORTED_ALIGNS = (8, 16, 32, 64, 128)
# Expert ids: the metadata kernels widen any of these before comparing against E.
_INDEX_DTYPES = (torch.int32, torch.int64, torch.int16, torch.uint8)


@dataclass(frozen=True)
class Dispatch:
    """Tokens permuted into expert order, and everything needed to undo it. All tensors live on
    the device of ``hidden``; the ints are static (they decide shapes, never read from a tensor).

    Example: T = 3 tokens, k = 2, E = 3, ``indices = [[2, 0], [0, 1], [2, 0]]``, ``align = 2``::

        tokens_per_expert = [3, 1, 2]          # expert 0 gets tokens 0, 1, 2; expert 1 token 1 …
        counts            = [4, 2, 2]          # padded up to a multiple of align
        offsets           = [4, 6, 8]          # cumulative ends: expert e owns rows
                                               #   [offsets[e] - counts[e], offsets[e])
        row_index         = [[6, 0], [1, 4], [7, 2]]   # row of token t's slot s
        hidden rows       = [x0, x1, x2, 0, x1, 0, x0, x2, 0 …]   # zero padding and tail
        num_rows          = T·k + min(E, T·k)·(align − 1) = 6 + 3 = 9

    With ``out_rows`` = 7 instead, the first 7 rows are kept: token 2's slot 0 (row 7) is
    dropped (``row_index[2, 0] = −1``), ``tokens_per_expert = [3, 1, 1]``, ``offsets = [4, 6,
    7]``, ``counts = [4, 2, 1]`` and ``dropless`` is False.

    ``offsets`` is exactly the ``offs`` argument of ``moekit.ops.grouped_mm`` (and of
    ``torch._grouped_mm``); rows past ``offsets[-1]`` are zero.
    """

    # [R, H] rows grouped by expert; padding and tail rows are zero (an Fp8Tensor with FP8)
    hidden: torch.Tensor | Fp8Tensor
    probs: torch.Tensor | None  # [R] prob of each row (dtype of the probs given), 0 for padding
    # [E] int32 rows of expert e's segment: ceil(tokens_per_expert[e] / align)·align, or fewer
    # for a segment cut at num_rows
    counts: torch.Tensor
    offsets: torch.Tensor  # [E] int32 cumsum(counts): end row of each segment, <= num_rows
    tokens_per_expert: torch.Tensor  # [E] int32 unpadded rows of each expert (after any drops)
    row_index: torch.Tensor  # [T, k] int32 row holding token t's slot s; −1 = dropped
    num_tokens: int  # T
    topk: int  # k
    num_experts: int  # E
    align: int | None  # segment alignment in rows, None = packed
    num_rows: int  # R, static upper bound of the rows used (= hidden.shape[0])
    # every slot got a row: no capacity drops, no routing_map with < k experts, no out_rows
    # below the rows the routing may need
    dropless: bool
    # rows each expert keeps under capacity_factor (ceil(cf·T·k/E), rounded up to align), the
    # segment length every expert is padded to; None without a capacity limit
    capacity: int | None = None


@dataclass(frozen=True)
class DispatchConfig:
    """How a layer dispatches its tokens to the experts (``MoELayer(dispatch=)``), checked
    once here; :func:`permute`'s options of the same names.

    capacity_factor: keep at most ``C = ceil(cf·T·k/E)`` tokens per expert (rounded up to
        ``align``), dropping the lowest probs (:func:`moekit.ops.routing.expert_capacity`);
        None: dropless.
    align: pad each expert's rows to a multiple of this (one of 8, 16, 32, 64, 128; e.g. the
        block of an FP8 GEMM); None: packed.
    recompute_rows: the experts' backward gathers their input rows from the tokens again
        (:func:`permuted_rows`) instead of the forward keeping them for the weight gradient:
        one [R, H] tensor less held from forward to backward (R = T·k rows), one more
        permute-sized copy in backward. bf16/fp16/fp32 rows only (FP8 rows already come from
        the tokens).
    """

    capacity_factor: float | None = None
    align: int | None = None
    recompute_rows: bool = False

    def __post_init__(self) -> None:
        _check_align(self.align)
        if not isinstance(self.recompute_rows, bool):
            raise TypeError(
                f"recompute_rows must be a bool, got {type(self.recompute_rows).__name__}"
            )
        if self.capacity_factor is not None:
            expert_capacity(self.capacity_factor, 1, 1, 1, 1)  # its checks of the factor


def _rowmajor(t: torch.Tensor) -> torch.Tensor:
    # Incoming gradients may be expanded or strided; the kernels need unit stride along H.
    return t if t.stride(-1) == 1 else t.contiguous()


def _permute_rows(hidden, probs, row_index, offsets, tokens_per_expert, num_rows, align, tail_lo):
    vals_dtype = probs.dtype if probs is not None else hidden.dtype
    return scatter(
        hidden, row_index, offsets, tokens_per_expert, probs, None, None, num_rows, align,
        tail_lo, vals_dtype,
    )  # fmt: skip


class _PermuteFn(torch.autograd.Function):
    """hidden [T, H] → rows [R, H], probs [T, k] → row probs [R] (empty without probs).
    Also serves sort_chunks_by_index (k = 1, no offsets)."""

    @staticmethod
    def forward(
        ctx, hidden, probs, row_index, offsets, tokens_per_expert, num_rows, align, tail_lo
    ):
        ctx.set_materialize_grads(False)
        # Routing metadata, not an activation: held on ctx rather than saved, so that the
        # gradients of a dispatch's rows and of its probs may be taken in separate backward
        # passes (saved tensors are freed by the first).
        ctx.row_index = row_index
        ctx.hidden_meta = (tuple(hidden.shape), hidden.dtype)
        return _permute_rows(
            hidden, probs, row_index, offsets, tokens_per_expert, num_rows, align, tail_lo
        )

    @staticmethod
    def backward(ctx, grad_out, grad_probs):
        return (*_permute_grads(ctx, grad_out, grad_probs), None, None, None, None, None, None)


def _permute_grads(ctx, grad_out, grad_probs) -> tuple:
    """(grad of the tokens [T, H], grad of the slot probs [T, k]) of a permute's backward:
    permute's adjoint is the unweighted combine; dprobs rides along in the same pass."""
    refuse_double_backward("permute")
    row_index = ctx.row_index
    need_h, need_p = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not need_p or grad_probs is None:
        grad_probs = None
    else:
        grad_probs = grad_probs.contiguous()  # the gather reads it by row index
    grad_hidden = grad_slot = None
    if need_h and grad_out is not None:
        grad_hidden, vals = gather(
            _rowmajor(grad_out), row_index, None, grad_probs, [row_index.shape[0]]
        )
        grad_slot = vals if grad_probs is not None else None
    else:
        if need_h:
            shape, dtype = ctx.hidden_meta
            grad_hidden = torch.zeros(shape, dtype=dtype, device=row_index.device)
        if grad_probs is not None:
            grad_slot = slot_values(grad_probs, row_index)
    return grad_hidden, grad_slot


def _permute_fp8_rows(hidden, probs, row_index, offsets, tpe, num_rows, align, tail_lo, payload):
    """(data, scale, row probs) of an FP8 permute: ``hidden`` quantized on the way (payload
    None, or the pow2 flag) or an Fp8Tensor's (data, scale) moved as they are."""
    if not isinstance(payload, tuple):
        return scatter_fp8(hidden, row_index, offsets, tpe, probs, num_rows, align, tail_lo,
                           payload)  # fmt: skip
    data, scale = payload
    vals_dtype = probs.dtype if probs is not None else scale.dtype
    bytes_, vals = scatter(
        data.view(torch.uint8), row_index, offsets, tpe, probs, None, None, num_rows, align,
        tail_lo, vals_dtype,
    )  # fmt: skip
    scales, _ = scatter(scale, row_index, offsets, tpe, None, None, None, num_rows, align,
                        tail_lo, scale.dtype)  # fmt: skip
    return bytes_.view(torch.float8_e4m3fn), scales, vals


class _PermuteFp8Fn(torch.autograd.Function):
    """hidden [T, H] (bf16 tokens, or the anchor of their Fp8Tensor) → (the rows' anchor
    [R, H], row probs [R], e4m3 rows, their scales): the gradient reaching the rows' anchor
    is summed back to the tokens as in a bf16 permute."""

    @staticmethod
    def forward(ctx, hidden, probs, row_index, offsets, tpe, num_rows, align, tail_lo, payload):
        ctx.set_materialize_grads(False)
        ctx.row_index = row_index
        ctx.hidden_meta = (tuple(hidden.shape), hidden.dtype)
        data, scale, vals = _permute_fp8_rows(
            hidden, probs, row_index, offsets, tpe, num_rows, align, tail_lo, payload
        )
        ctx.mark_non_differentiable(data, scale)
        return stand_in(hidden, (num_rows, hidden.shape[1])), vals, data, scale

    @staticmethod
    def backward(ctx, grad_rows, grad_probs, _data, _scale):
        return (*_permute_grads(ctx, grad_rows, grad_probs), *(None,) * 7)


class _UnpermuteFn(torch.autograd.Function):
    """rows [R, H] (and row probs [R]) → tokens [T, H]."""

    @staticmethod
    def forward(
        ctx, expert_out, row_probs, row_index, offsets, tokens_per_expert, align, tail_lo, lead
    ):
        ctx.set_materialize_grads(False)
        need_dprobs = row_probs is not None and ctx.needs_input_grad[1]
        ctx.save_for_backward(
            row_index, offsets, tokens_per_expert, row_probs, expert_out if need_dprobs else None
        )
        ctx.static = (expert_out.shape[0], align, tail_lo)
        ctx.probs_dtype = row_probs.dtype if row_probs is not None else expert_out.dtype
        out, _ = gather(expert_out, row_index, row_probs, None, lead)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if grad_out is None:
            return None, None, None, None, None, None, None, None
        refuse_double_backward("unpermute")
        row_index, offsets, tokens_per_expert, row_probs, expert_out = ctx.saved_tensors
        num_rows, align, tail_lo = ctx.static
        grad_out = _rowmajor(grad_out)
        if grad_out.dim() != 2:
            grad_out = grad_out.reshape(row_index.shape[0], grad_out.shape[-1])
        # Rows no slot maps to (padding, tail, dropped) get zero gradient from the zero-fills.
        grad_rows, grad_row_probs = scatter(
            grad_out, row_index, offsets, tokens_per_expert, None, row_probs,
            expert_out, num_rows, align, tail_lo, ctx.probs_dtype,
        )  # fmt: skip
        grad_row_probs = grad_row_probs if expert_out is not None else None
        return grad_rows, grad_row_probs, None, None, None, None, None, None


_apply_permute = function_apply(_PermuteFn)
_apply_permute_fp8 = function_apply(_PermuteFp8Fn)
_apply_unpermute = function_apply(_UnpermuteFn)


def _check_int(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return value


def _check_hidden(name: str, t: object) -> torch.Tensor:
    t = check_tensor(name, t)
    check_ndim(name, t, 2, "[T, H]")
    check_dtype(name, t, FLOAT_DTYPES)
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(
            f"{name} must have unit stride along H (rows may be strided), got strides "
            f"{tuple(t.stride())}; call .contiguous() first"
        )
    return t


def _check_vector(
    name: str, t: object, shape_hint: str, dtypes: tuple[torch.dtype, ...], x: torch.Tensor
) -> torch.Tensor:
    """t: a 1-D tensor (``shape_hint``) of one of ``dtypes`` on x's device."""
    t = check_tensor(name, t)
    check_ndim(name, t, 1, shape_hint)
    check_dtype(name, t, dtypes)
    check_same_device(name, t, "x", x)
    return t


def _check_align(align: object) -> int:
    if align is None:
        return 1
    if isinstance(align, bool) or not isinstance(align, int) or align not in SUPPORTED_ALIGNS:
        raise ValueError(f"align must be None or one of {SUPPORTED_ALIGNS}, got {align!r}")
    return align


def _check_probs(probs: object, shape: tuple[int, int], what: str, hidden: torch.Tensor):
    """probs: a float tensor on hidden's device of ``shape`` (``what`` says where it comes from)."""
    probs = check_tensor("probs", probs)
    check_ndim("probs", probs, 2, what)
    if tuple(probs.shape) != shape:
        raise ValueError(f"probs must have the shape {what} = {shape}, got {tuple(probs.shape)}")
    check_dtype("probs", probs, FLOAT_DTYPES)
    check_same_device("probs", probs, "hidden", hidden)
    return probs


def _assert_on_device(ok: torch.Tensor, msg: str, bad: torch.Tensor | None = None) -> None:
    """Raise ``msg`` if ``ok`` is False: on CUDA (and while tracing) a device-side assert that
    surfaces at the next synchronisation (never forcing one here), on CPU a ValueError now."""
    if not values_on_host(ok):
        torch._assert_async(ok, msg)
    elif not bool(ok):
        raise ValueError(msg if bad is None else f"{msg}: e.g. {bad[:4].tolist()}")


def _slots_from_routing_map(hidden, routing_map, probs, num_experts, topk, validate):
    """(indices [T, k], probs [T, k] or None, E, k) of a [T, E] routing map."""
    T = hidden.shape[0]
    routing_map = check_tensor("routing_map", routing_map)
    check_ndim("routing_map", routing_map, 2, "[T, E]")
    check_dim_size("routing_map", routing_map, 0, T, "hidden.shape[0] (T)")
    check_same_device("routing_map", routing_map, "hidden", hidden)
    if routing_map.dtype.is_floating_point or routing_map.dtype.is_complex:
        raise TypeError(f"routing_map must be bool or int, got {routing_map.dtype}")
    E = routing_map.shape[1]
    if num_experts is not None and _check_int("num_experts", num_experts, 1) != E:
        raise ValueError(f"num_experts = {num_experts} disagrees with routing_map.shape[1] = {E}")
    _check_int("routing_map.shape[1] (E)", E, 1)
    k = E if topk is None else _check_int("topk", topk, 1)
    if k > E:
        raise ValueError(f"topk must be <= E = {E}, got {k}")
    if probs is not None:
        probs = _check_probs(probs, (T, E), "[T, E] (with routing_map)", hidden)
    if validate:
        ok = ((routing_map != 0).sum(dim=1) <= k).all()
        _assert_on_device(ok, f"routing_map routes some token to more than topk = {k} experts")
    indices, probs = routing_map_to_indices(routing_map, probs, k)
    return indices, probs, E, k


def _slots_from_indices(hidden, indices, probs, num_experts, topk, validate):
    """(indices [T, k], probs [T, k] or None, E, k), checked."""
    if indices is None:
        raise ValueError("indices ([T, k] expert ids) or routing_map ([T, E]) is required")
    if num_experts is None:
        raise ValueError("num_experts is required with indices (E, the number of experts)")
    E = _check_int("num_experts", num_experts, 1)
    if topk is not None:
        raise ValueError("topk is only used with routing_map; k is indices.shape[1]")
    indices = check_tensor("indices", indices)
    check_ndim("indices", indices, 2, "[T, k]")
    check_dim_size("indices", indices, 0, hidden.shape[0], "hidden.shape[0] (T)")
    check_dtype("indices", indices, _INDEX_DTYPES)
    check_same_device("indices", indices, "hidden", hidden)
    k = _check_int("indices.shape[1] (k)", indices.shape[1], 1)
    if probs is not None:
        probs = _check_probs(probs, tuple(indices.shape), "of indices [T, k]", hidden)
    check_expert_ids(indices, E, device_check=validate)
    return indices, probs, E, k


def _drop_past_capacity(idx, probs, E: int, capacity: int) -> torch.Tensor:
    """idx with the slots past ``capacity`` per expert set to −1, the lowest probs first (no
    probs: the later tokens)."""
    drop_probs = probs.detach() if probs is not None else torch.zeros(idx.shape, device=idx.device)
    return capacity_drop(idx, drop_probs, E, capacity)


def _check_permute_input(
    hidden: object, fp8: object, validate: object
) -> tuple[torch.Tensor, Fp8Tensor | None]:
    """(a [T, H] tensor to check the routing against, the Fp8Tensor given as hidden)."""
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
    if fp8 is not None and not isinstance(fp8, Fp8Recipe):
        raise TypeError(f"fp8 must be a moekit.ops.Fp8Recipe or None, got {type(fp8).__name__}")
    if not isinstance(hidden, Fp8Tensor):
        return _check_hidden("hidden", hidden), None
    if hidden.axis != "row" or hidden.transposed or hidden.data.dim() != 2:
        raise ValueError(
            "an FP8 hidden must be a [T, H] Fp8Tensor quantized along H (quantize_fp8(x, "
            f"axis='row')), got {hidden.data.dim()}-D, axis={hidden.axis!r}, "
            f"transposed={hidden.transposed}"
        )
    return hidden.data, hidden


def _permute_fp8(
    hidden: torch.Tensor | Fp8Tensor, recipe: Fp8Recipe | None, probs, copy: tuple
) -> tuple[Fp8Tensor, torch.Tensor]:
    """(rows [R, H] as an Fp8Tensor, row probs [R]) of permute with FP8 rows (``copy``: the
    row map, offsets, tokens per expert, R, align, tail_lo)."""
    if isinstance(hidden, torch.Tensor) and recipe.row_block is None:  # rowwise: quantize first
        hidden = quantize_fp8(hidden, block=None, pow2_scale=recipe.pow2_scale)
    if isinstance(hidden, Fp8Tensor):
        grad_src = hidden.anchor_or_stand_in()
        payload, block = (hidden.data, hidden.scale), hidden.block
        source, source_rows = hidden.source, hidden.source_rows
    else:
        grad_src, payload, block = hidden, recipe.pow2_scale, QUANT_BLOCK
        source, source_rows = hidden.detach(), None
    row_index, num_rows = copy[0], copy[3]
    rows = None
    if source is not None and torch.is_grad_enabled():  # for a weight gradient's operand only
        rows = row_tokens(row_index, num_rows)  # each row's token, to requantize from the source
        if source_rows is not None:
            rows = torch.where(rows >= 0, source_rows[rows.clamp(min=0).long()], -1).int()
    if needs_grad(grad_src, probs):
        anchor, vals, data, scale = _apply_permute_fp8(grad_src, probs, *copy, payload)
    else:
        (data, scale, vals), anchor = _permute_fp8_rows(grad_src, probs, *copy, payload), None
    source = source if rows is not None else None  # kept only with the row map it needs
    out = Fp8Tensor(data, scale, "row", block, anchor=anchor, source=source, source_rows=rows)
    return out, vals


def _row_bound(idx, probs, E, align, out_rows, capacity_factor, may_drop, fp8) -> tuple:
    """(slots after capacity drops, R, whether slots may be dropped, capacity or None)."""
    T, k = idx.shape
    if capacity_factor is not None:
        if out_rows is not None:
            raise ValueError("capacity_factor and out_rows are exclusive (both decide R)")
        capacity = expert_capacity(capacity_factor, T, k, E, align)
        return _drop_past_capacity(idx, probs, E, capacity), E * capacity, True, capacity
    if out_rows is None or (isinstance(out_rows, str) and out_rows == "exact"):
        num_rows = max_rows(T, k, E, align)
        if fp8:  # whole 128-row blocks: the FP8 weight gradient stores the rows token-contiguous
            num_rows = -(-num_rows // QUANT_BLOCK) * QUANT_BLOCK
        return idx, num_rows, may_drop, None
    num_rows = _check_int("out_rows", out_rows, 0)
    return idx, num_rows, may_drop or num_rows < max_rows(T, k, E, align), None


def _tail_lo(dropless: bool, slots: int, num_rows: int) -> int:
    # With every slot kept, offsets[-1] >= T·k, so the tail zero-fill can skip the rows below.
    return min(slots, num_rows) if dropless else 0


def permute(
    hidden: torch.Tensor,  # [T, H] bf16/fp16/fp32
    indices: torch.Tensor | None = None,  # [T, k] int: expert of each slot
    probs: torch.Tensor | None = None,  # [T, k] float (or [T, E] with routing_map)
    *,
    num_experts: int | None = None,  # E (taken from routing_map when given)
    routing_map: torch.Tensor | None = None,  # [T, E] bool/int, instead of indices
    topk: int | None = None,  # k with routing_map: max experts per token (default E)
    align: int | None = None,  # None or 8/16/32/64/128 rows per segment start
    out_rows: int | Literal["exact"] | None = None,  # R override
    capacity_factor: float | None = None,  # keep ceil(cf·T·k/E) rows per expert
    validate: bool = False,
    zero_tail: bool = True,
    fp8: Fp8Recipe | None = None,  # quantize the rows to e4m3 on the way
) -> Dispatch:
    """Copy each token's hidden vector to one row per chosen expert, grouped by expert.

    Args:
        hidden: ``[T, H]`` activations, bf16/fp16/fp32, unit stride along H; or an
            :class:`~moekit.ops.Fp8Tensor` of them quantized along H (``axis="row"``), whose
            e4m3 rows and scales are moved as they are.
        indices: ``[T, k]`` expert ids (any int dtype), the router's top-k; ``−1`` marks a
            slot routed to no expert (as capacity drops and expert parallelism's non-local
            slots are): it gets no row and zeros back from ``unpermute`` (permute cannot see
            it without a sync, so ``dropless`` stays True and on a GPU the rows from
            ``offsets[-1]`` up to T·k may be left unwritten; moekit's grouped ops never read
            past ``offsets[-1]``). Other ids outside
            ``[0, E)`` raise ``ValueError`` on CPU tensors; on a GPU they are undefined
            behaviour (in practice the slot is dropped) unless ``validate=True`` checks them.
        probs: ``[T, k]`` routing weights (``[T, E]`` with ``routing_map``); carried along as
            ``Dispatch.probs`` so ``unpermute`` can weight by them; gradients flow back to it.
        num_experts: E; required with ``indices``.
        routing_map: ``[T, E]`` bool/int map (TransformerEngine's convention) instead of
            ``indices``; each token's first ``topk`` routed experts are taken, ascending id.
        align: pad each expert's segment to a multiple of ``align`` rows (FP8/FP4 GEMMs).
            R becomes the static bound ``T·k + min(E, T·k)·(align − 1)``.
        out_rows: an int R, or ``"exact"`` for R = offsets[-1], which reads one int back to the
            host (a sync). An R below what the routing needs drops rows the way
            TransformerEngine's ``num_out_tokens`` does: the first R rows of the expert-sorted
            (padded) order are kept, the slots whose row would be ``>= R`` are dropped, and
            ``dropless`` is False whenever R is below the static bound above.
        capacity_factor: keep at most ``C = ceil(cf·T·k/E)`` rows per expert (rounded up to
            ``align``), dropping the lowest probs first; R = E·C.
        validate: check index ranges on the device (``torch._assert_async``: no host sync; the
            error surfaces at the next synchronisation). ``MOEKIT_DEBUG=1`` turns it on for
            every call.
        zero_tail: False leaves the rows past ``offsets[-1]`` unwritten (padding rows inside
            segments are still zeroed), for a caller whose R is a loose bound and whose
            consumers read only the rows ``offsets`` covers (expert parallelism's receive side).
        fp8: an :class:`~moekit.ops.Fp8Recipe`: write the rows in e4m3 with their scales,
            each token quantized once (blockwise: in the copy itself, 1×128 along H); the FP8
            experts take them as they are (``align=128`` for their weight gradient).

    Dropped slots get ``row_index = −1``, no row, and zeros back from ``unpermute``.

    Returns:
        A :class:`Dispatch`; ``dispatch.hidden`` is ``[R, H]`` in hidden's dtype, or an
        :class:`~moekit.ops.Fp8Tensor` of the rows with ``fp8`` or an FP8 ``hidden``
        (padding rows zero, with zero scales; gradients reach the tokens through its anchor).
    """
    hidden, quantized = _check_permute_input(hidden, fp8, validate)
    validate = validate or debug_checks()
    if routing_map is not None:
        if indices is not None:
            raise ValueError("pass either indices or routing_map, not both")
        slots = _slots_from_routing_map(hidden, routing_map, probs, num_experts, topk, validate)
    else:
        slots = _slots_from_indices(hidden, indices, probs, num_experts, topk, validate)
    idx, probs, E, k = slots
    a = _check_align(align)
    T = hidden.shape[0]
    # A routing map may give a token fewer than topk experts: those slots are dropped.
    may_drop = routing_map is not None
    exact = isinstance(out_rows, str) and out_rows == "exact"
    idx, num_rows, may_drop, capacity = _row_bound(
        idx, probs, E, a, out_rows, capacity_factor, may_drop, fp8 or quantized is not None
    )
    row_index, tokens_per_expert, counts, offsets = routing_metadata(idx, E, a, num_rows)
    if exact:
        num_rows = int(offsets[-1])  # the one host sync, asked for by the caller
    if probs is not None and not probs.is_contiguous():
        probs = probs.contiguous()  # [T, k]: metadata-sized
    copy = (row_index, offsets, tokens_per_expert, num_rows, a,
            _tail_lo(not may_drop, T * k, num_rows) if zero_tail else num_rows)  # fmt: skip
    if quantized is not None or fp8 is not None:
        out, out_probs = _permute_fp8(quantized or hidden, fp8, probs, copy)
    else:
        apply = _apply_permute if needs_grad(hidden, probs) else _permute_rows
        out, out_probs = apply(hidden, probs, *copy)
    return Dispatch(
        hidden=out, probs=out_probs if probs is not None else None, counts=counts,
        offsets=offsets, tokens_per_expert=tokens_per_expert, row_index=row_index,
        num_tokens=T, topk=k, num_experts=E, align=None if a == 1 else a, num_rows=num_rows,
        dropless=not may_drop, capacity=capacity,
    )  # fmt: skip


def permuted_rows(hidden: torch.Tensor, dispatch: Dispatch) -> torch.Tensor:
    """``dispatch.hidden`` gathered again from ``hidden``, the tokens :func:`permute` made it
    from: the same rows bit for bit (zero padding and tail), outside autograd. ``dispatch`` may
    have ``hidden=None`` (its routing metadata is what is read)."""
    d = dispatch
    copy = (d.row_index, d.offsets, d.tokens_per_expert, d.num_rows, d.align or 1,
            _tail_lo(d.dropless, d.num_tokens * d.topk, d.num_rows))  # fmt: skip
    rows, _ = _permute_rows(hidden.detach(), None, *copy)
    return rows


def unpermute(
    expert_out: torch.Tensor,  # [R, H'] bf16/fp16/fp32, rows in dispatch order
    dispatch: Dispatch,
    *,
    weighted: bool = True,
    shape: Sequence[int] | None = None,
    zero_tail: bool = True,
) -> torch.Tensor:
    """Sum each token's k rows back in token order: ``out[t] = Σ_s p[t, s]·expert_out[r(t, s)]``.

    Accumulates in fp32 and returns ``[T, H']`` in expert_out's dtype. Padding rows and dropped
    slots contribute nothing. ``weighted`` multiplies by ``dispatch.probs`` (which must exist);
    gradients flow to ``expert_out`` and to ``dispatch.probs`` (hence to the permute's probs).

    ``shape``: return the tokens in this shape instead, ``[..., H']`` with T tokens in its
    leading dimensions (e.g. the ``[B, S, H]`` the tokens came from). The result is a tensor
    of its own, not a view of a ``[T, H']`` one, so in-place ops on it (a residual ``y += x``)
    and FSDP2's output hooks work as on any layer's output.

    ``zero_tail``: False leaves the gradient's rows past ``offsets[-1]`` unwritten in backward
    (see :func:`permute`).
    """
    expert_out = _check_hidden("expert_out", expert_out)
    if not isinstance(dispatch, Dispatch):
        raise TypeError(
            f"dispatch must be a Dispatch (from permute), got {type(dispatch).__name__}"
        )
    check_dim_size("expert_out", expert_out, 0, dispatch.num_rows, "dispatch.num_rows (R)")
    check_same_device("expert_out", expert_out, "dispatch.hidden", dispatch.hidden)
    if weighted and dispatch.probs is None:
        raise ValueError(
            "unpermute(weighted=True) needs dispatch.probs: pass probs to permute, or "
            "weighted=False"
        )
    lead = _token_shape(shape, dispatch.num_tokens, expert_out.shape[1])
    if not needs_grad(expert_out, dispatch.probs if weighted else None):
        row_probs = dispatch.probs if weighted else None
        return gather(expert_out, dispatch.row_index, row_probs, None, lead)[0]
    slots = dispatch.num_tokens * dispatch.topk
    return _apply_unpermute(
        expert_out, dispatch.probs if weighted else None, dispatch.row_index, dispatch.offsets,
        dispatch.tokens_per_expert, dispatch.align or 1,
        # Gradient rows that no slot maps to (padding, tail) must come back zero, unless the
        # caller never reads the tail.
        _tail_lo(dispatch.dropless, slots, dispatch.num_rows) if zero_tail else dispatch.num_rows,
        lead,
    )  # fmt: skip


def _token_shape(shape: object, T: int, H: int) -> list[int]:
    """unpermute's ``shape`` argument checked: the leading dimensions, of T elements."""
    if shape is None:
        return [T]
    dims = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else None
    if (
        not dims
        or any(
            isinstance(d, bool)
            or not isinstance(d, (int, torch.SymInt))
            or (isinstance(d, int) and d < 0)
            for d in dims
        )
        or dims[-1] != H
        or math.prod(dims[:-1]) != T
    ):
        raise ValueError(
            f"shape must be a [..., H' = {H}] shape holding the dispatch's T = {T} tokens in "
            f"its leading dimensions, got {shape!r}"
        )
    return list(dims[:-1])


def sort_chunks_by_index(
    x: torch.Tensor,  # [N, H] rows in chunks, e.g. [rank][expert] after an all-to-all
    split_sizes: torch.Tensor,  # [C] int, device: rows of each chunk (Σ ≤ N)
    sorted_index: torch.Tensor,  # [C] int, device: output chunk j is input chunk sorted_index[j]
    probs: torch.Tensor | None = None,  # [N] float, reordered alongside
    *,
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reorder row chunks, e.g. from ``[rank][expert]`` to ``[expert][rank]`` after an
    expert-parallel all-to-all, with sizes that stay on the device.

    Rows past ``split_sizes.sum()`` keep their place. Returns ``(x_sorted [N, H],
    probs_sorted [N] or None)``; differentiable w.r.t. x and probs. No host sync.

    ``split_sizes`` must be non-negative with a sum ≤ N, and ``sorted_index`` a permutation of
    ``range(C)``; otherwise the result is undefined (rows lost or repeated) unless ``validate``
    checks them (on CUDA a device-side assert at the next synchronisation, never forcing one;
    on CPU a ValueError now).
    """
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
    validate = validate or debug_checks()
    x = _check_hidden("x", x)
    N = x.shape[0]
    split_sizes = _check_vector("split_sizes", split_sizes, "[C]", _INDEX_DTYPES, x)
    sorted_index = _check_vector("sorted_index", sorted_index, "[C]", _INDEX_DTYPES, x)
    check_dim_size("sorted_index", sorted_index, 0, split_sizes.shape[0], "len(split_sizes)")
    if probs is not None:
        probs = _check_vector("probs", probs, "[N]", FLOAT_DTYPES, x)
        check_dim_size("probs", probs, 0, N, "x.shape[0] (N)")
        probs = probs.contiguous().view(N, 1)
    if validate:
        C = split_sizes.shape[0]
        sizes, index = split_sizes.long(), sorted_index.long()
        _assert_on_device(
            (sizes >= 0).all() & (sizes.sum() <= N),
            f"split_sizes must be >= 0 with a sum <= x.shape[0] = {N}",
        )
        in_range = (index >= 0) & (index < C)
        _assert_on_device(
            in_range.all(), f"sorted_index must hold chunk ids in [0, {C})", index[~in_range]
        )
        hits = torch.zeros(C, dtype=torch.long, device=index.device)
        hits.index_add_(0, index.clamp(0, max(C - 1, 0)), torch.ones_like(index))
        _assert_on_device((hits == 1).all(), "sorted_index must be a permutation of range(C)")
    row_map = sort_chunks_row_map(split_sizes, sorted_index, N).view(N, 1)
    # A permutation of all N rows: no padding, no tail (tail_lo = N), so no offsets.
    out, out_probs = _apply_permute(x, probs, row_map, None, None, N, 1, N)
    return out, out_probs if probs is not None else None
