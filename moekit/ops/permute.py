"""Token permute / unpermute for MoE layers: public ops, the ``Dispatch`` metadata, autograd.

Dimension letters: T tokens, k experts per token, E experts, R permuted rows, H hidden.

``permute`` copies each token's hidden vector to one row per chosen expert, grouped by expert
(tokens in their original order inside an expert), optionally padding every expert's segment to a
multiple of ``align`` rows in the same pass. ``unpermute`` sums each token's k rows back, weighted
by the routing probs. Both are differentiable w.r.t. the activations and the probs. The CUDA path
never reads anything back to the host (unless ``out_rows="exact"`` is asked for), so a whole MoE
block can be captured in a CUDA graph. See docs/permute.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from moekit.kernels import permute as _k
from moekit.ops._dispatch import use_triton
from moekit.ops._launch_cache import replayed, sig
from moekit.ops._validate import (
    check_dim_size,
    check_dtype,
    check_ndim,
    check_same_device,
    check_tensor,
)
from moekit.reference import permute as _ref

__all__ = ["SUPPORTED_ALIGNS", "Dispatch", "permute", "sort_chunks_by_index", "unpermute"]

SUPPORTED_ALIGNS = (8, 16, 32, 64, 128)
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
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

    ``offsets`` is exactly the ``offs`` argument of ``moekit.ops.grouped_mm`` (and of
    ``torch._grouped_mm``); rows past ``offsets[-1]`` are zero.
    """

    hidden: torch.Tensor  # [R, H] rows grouped by expert; padding and tail rows are zero
    probs: torch.Tensor | None  # [R] prob of each row (dtype of the probs given), 0 for padding
    counts: torch.Tensor  # [E] int32 rows of expert e = ceil(tokens_per_expert[e] / align)·align
    offsets: torch.Tensor  # [E] int32 cumsum(counts): end row of each expert's segment
    tokens_per_expert: torch.Tensor  # [E] int32 unpadded rows of each expert (after any drops)
    row_index: torch.Tensor  # [T, k] int32 row holding token t's slot s; −1 = dropped
    num_tokens: int  # T
    topk: int  # k
    num_experts: int  # E
    align: int | None  # segment alignment in rows, None = packed
    num_rows: int  # R, static upper bound of the rows used (= hidden.shape[0])
    dropless: bool  # every slot got a row (no capacity drops, no routing_map with < k experts)


# ------------------------------------------------------------------------------------------------
# Autograd
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """What the copy kernels need besides the tensors: static sizes and which zero-fills run."""

    row_index: torch.Tensor  # [T, k] int32
    offsets: torch.Tensor  # [E] int32
    tokens_per_expert: torch.Tensor  # [E] int32
    num_rows: int  # R
    pad_programs: bool  # aligned segments: zero each expert's padding rows
    pad_rows: int  # at most this many padding rows per expert (align − 1)
    tail_lo: int  # static lower bound of offsets[-1]; rows [offsets[-1], R) are zeroed


def _scatter(
    layout: _Layout,
    x: torch.Tensor,
    *,
    slot_vals: torch.Tensor | None = None,
    row_weight: torch.Tensor | None = None,
    dot_src: torch.Tensor | None = None,
    out_vals_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    R, H = layout.num_rows, x.shape[1]
    out = torch.empty((R, H), dtype=x.dtype, device=x.device)
    has_vals = slot_vals is not None or dot_src is not None
    vals_dtype = out_vals_dtype or torch.float32
    out_vals = torch.empty(R, dtype=vals_dtype, device=x.device) if has_vals else None

    def launches():
        _k.scatter_rows(
            x, layout.row_index, R, layout.offsets, layout.tokens_per_expert,
            slot_vals=slot_vals, row_weight=row_weight, dot_src=dot_src,
            out_vals_dtype=vals_dtype, pad_programs=layout.pad_programs,
            pad_rows=layout.pad_rows, tail_lo=layout.tail_lo, out=out, out_vals=out_vals,
        )  # fmt: skip

    key = None
    if x.is_cuda:
        key = (
            "scatter", sig(x), sig(layout.row_index), sig(layout.offsets), R, sig(slot_vals),
            sig(row_weight), sig(dot_src), vals_dtype, layout.pad_programs, layout.pad_rows,
            layout.tail_lo,
        )  # fmt: skip
    roles = (
        x, layout.row_index, layout.offsets, layout.tokens_per_expert, slot_vals, row_weight,
        dot_src, out, out_vals,
    )  # fmt: skip
    replayed(key, roles, launches)
    return out, out_vals


def _gather(
    src: torch.Tensor,
    row_index: torch.Tensor,
    *,
    row_weight: torch.Tensor | None = None,
    row_vals: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    T, k = row_index.shape
    out = torch.empty((T, src.shape[1]), dtype=src.dtype, device=src.device)
    out_vals = None
    if row_vals is not None:
        out_vals = torch.empty((T, k), dtype=row_vals.dtype, device=src.device)

    def launches():
        _k.gather_rows(
            src, row_index, row_weight=row_weight, row_vals=row_vals, out=out, out_vals=out_vals
        )

    key = None
    if src.is_cuda:
        key = ("gather", sig(src), sig(row_index), sig(row_weight), sig(row_vals))
    replayed(key, (src, row_index, row_weight, row_vals, out, out_vals), launches)
    return out, out_vals


def _routing_metadata(idx: torch.Tensor, E: int, align: int) -> tuple[torch.Tensor, ...]:
    """The three metadata launches into buffers of ours (so that they can be replayed)."""
    dev = idx.device
    row_index = torch.empty(idx.shape, dtype=torch.int32, device=dev)
    tokens_per_expert = torch.empty(E, dtype=torch.int32, device=dev)
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    offsets = torch.empty(E, dtype=torch.int32, device=dev)
    scratch = torch.empty(_k.metadata_scratch_numel(idx.numel(), E), dtype=torch.int32, device=dev)
    outs = (row_index, tokens_per_expert, counts, offsets, scratch)
    key = ("meta", sig(idx), E, align) if idx.is_cuda else None
    replayed(key, (idx, *outs), lambda: _k.routing_metadata(idx, E, align, out=outs))
    return row_index, tokens_per_expert, counts, offsets


def _rowmajor(t: torch.Tensor) -> torch.Tensor:
    # Incoming gradients may be expanded or strided; the kernels need unit stride along H.
    return t if t.stride(-1) == 1 else t.contiguous()


class _PermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, probs, layout: _Layout):
        ctx.set_materialize_grads(False)
        ctx.layout = layout
        ctx.hidden_meta = (hidden.shape, hidden.dtype, hidden.device)
        return _scatter(
            layout,
            hidden,
            slot_vals=probs,
            out_vals_dtype=None if probs is None else probs.dtype,
        )

    @staticmethod
    def backward(ctx, grad_out, grad_probs):
        layout: _Layout = ctx.layout
        need_h, need_p = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = grad_slot = None
        if need_h and grad_out is not None:
            # Permute's adjoint is the unweighted combine; dprobs rides along in the same pass.
            grad_hidden, grad_slot = _gather(
                _rowmajor(grad_out),
                layout.row_index,
                row_vals=grad_probs if need_p else None,
            )
        elif need_h:
            shape, dtype, device = ctx.hidden_meta
            grad_hidden = torch.zeros(shape, dtype=dtype, device=device)
        if need_p and grad_probs is not None and grad_slot is None:
            grad_slot = _gather_slots(grad_probs, layout.row_index)
        return grad_hidden, grad_slot, None


def _gather_slots(row_vals: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
    """[T, k] = row_vals[row_index], 0 for dropped slots (tiny; plain torch)."""
    keep = row_index >= 0
    vals = row_vals[torch.where(keep, row_index, 0).long()]
    return torch.where(keep, vals, torch.zeros_like(vals))


class _UnpermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, row_probs, layout: _Layout):
        ctx.set_materialize_grads(False)
        ctx.layout = layout
        ctx.weighted = row_probs is not None
        need_dprobs = row_probs is not None and ctx.needs_input_grad[1]
        ctx.save_for_backward(row_probs, expert_out if need_dprobs else None)
        out, _ = _gather(expert_out, layout.row_index, row_weight=row_probs)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        layout: _Layout = ctx.layout
        row_probs, expert_out = ctx.saved_tensors
        if grad_out is None:
            return None, None, None
        need_p = ctx.weighted and ctx.needs_input_grad[1]
        grad_rows, grad_row_probs = _scatter(
            layout,
            _rowmajor(grad_out),
            row_weight=row_probs,
            dot_src=expert_out if need_p else None,
            out_vals_dtype=row_probs.dtype if need_p else None,
        )
        return grad_rows, grad_row_probs, None


class _SortChunksFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, layout: _Layout):
        ctx.set_materialize_grads(False)
        ctx.layout = layout
        ctx.x_meta = (x.shape, x.dtype, x.device)
        return _scatter(
            layout,
            x,
            slot_vals=None if probs is None else probs.view(-1, 1),
            out_vals_dtype=None if probs is None else probs.dtype,
        )

    @staticmethod
    def backward(ctx, grad_out, grad_probs):
        layout: _Layout = ctx.layout
        need_x, need_p = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_p = None
        if need_x:
            if grad_out is None:
                grad_out = torch.zeros(ctx.x_meta[0], dtype=ctx.x_meta[1], device=ctx.x_meta[2])
            grad_x, grad_p = _gather(
                _rowmajor(grad_out),
                layout.row_index,
                row_vals=grad_probs if need_p else None,
            )
        if need_p and grad_probs is not None and grad_p is None:
            grad_p = _gather_slots(grad_probs, layout.row_index)
        return grad_x, None if grad_p is None else grad_p.view(-1), None


# ------------------------------------------------------------------------------------------------
# Validation helpers
# ------------------------------------------------------------------------------------------------


def _check_int(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return value


def _check_hidden(name: str, t: object) -> torch.Tensor:
    t = check_tensor(name, t)
    check_ndim(name, t, 2, "[T, H]")
    check_dtype(name, t, _FLOAT_DTYPES)
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(
            f"{name} must have unit stride along H (rows may be strided), got strides "
            f"{tuple(t.stride())}; call .contiguous() first"
        )
    return t


def _check_align(align: object) -> int:
    if align is None:
        return 1
    if isinstance(align, bool) or not isinstance(align, int) or align not in SUPPORTED_ALIGNS:
        raise ValueError(f"align must be None or one of {SUPPORTED_ALIGNS}, got {align!r}")
    return align


def _assert_indices_in_range(indices: torch.Tensor, num_experts: int, what: str) -> None:
    ok = ((indices >= 0) & (indices < num_experts)).all()
    msg = f"{what} has entries outside [0, num_experts={num_experts})"
    if indices.is_cuda:
        # Device-side check: raises at the next synchronisation, never forces one here.
        torch._assert_async(ok, msg)
    elif not bool(ok):
        bad = indices[(indices < 0) | (indices >= num_experts)]
        raise ValueError(f"{msg}: e.g. {bad[:4].tolist()}")


# ------------------------------------------------------------------------------------------------
# Public ops
# ------------------------------------------------------------------------------------------------


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
) -> Dispatch:
    """Copy each token's hidden vector to one row per chosen expert, grouped by expert.

    Args:
        hidden: ``[T, H]`` activations, bf16/fp16/fp32, unit stride along H.
        indices: ``[T, k]`` expert ids (any int dtype), the router's top-k. Ids outside
            ``[0, E)`` are undefined behaviour (in practice the slot is dropped) unless
            ``validate=True``, which checks on the device without a host sync.
        probs: ``[T, k]`` routing weights (``[T, E]`` with ``routing_map``); carried along as
            ``Dispatch.probs`` so ``unpermute`` can weight by them; gradients flow back to it.
        num_experts: E; required with ``indices``.
        routing_map: ``[T, E]`` bool/int map (TransformerEngine's convention) instead of
            ``indices``; each token's first ``topk`` routed experts are taken, ascending id.
        align: pad each expert's segment to a multiple of ``align`` rows (FP8/FP4 GEMMs).
            R becomes the static bound ``T·k + min(E, T·k)·(align − 1)``.
        out_rows: an int R (rows past it are dropped: size it with care), or ``"exact"`` for
            R = offsets[-1], which reads one int back to the host (a sync).
        capacity_factor: keep at most ``C = ceil(cf·T·k/E)`` rows per expert (rounded up to
            ``align``), dropping the lowest probs first; R = E·C. Dropped slots get zeros back from
            ``unpermute``.
        validate: check index ranges on the device (``torch._assert_async``: no host sync; the
            error surfaces at the next synchronisation).

    Returns:
        A :class:`Dispatch`; ``dispatch.hidden`` is ``[R, H]`` in hidden's dtype.
    """
    hidden = _check_hidden("hidden", hidden)
    T = hidden.shape[0]
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
    if routing_map is not None:
        if indices is not None:
            raise ValueError("pass either indices or routing_map, not both")
        routing_map = check_tensor("routing_map", routing_map)
        check_ndim("routing_map", routing_map, 2, "[T, E]")
        check_dim_size("routing_map", routing_map, 0, T, "hidden.shape[0] (T)")
        check_same_device("routing_map", routing_map, "hidden", hidden)
        if routing_map.dtype.is_floating_point or routing_map.dtype.is_complex:
            raise TypeError(f"routing_map must be bool or int, got {routing_map.dtype}")
        E = routing_map.shape[1]
        if num_experts is not None and _check_int("num_experts", num_experts, 1) != E:
            raise ValueError(
                f"num_experts = {num_experts} disagrees with routing_map.shape[1] = {E}"
            )
        _check_int("routing_map.shape[1] (E)", E, 1)
        k = E if topk is None else _check_int("topk", topk, 1)
        if k > E:
            raise ValueError(f"topk must be <= E = {E}, got {k}")
        if probs is not None:
            probs = check_tensor("probs", probs)
            check_ndim("probs", probs, 2, "[T, E] (with routing_map)")
            check_dim_size("probs", probs, 0, T, "hidden.shape[0] (T)")
            check_dim_size("probs", probs, 1, E, "routing_map.shape[1] (E)")
            check_dtype("probs", probs, _FLOAT_DTYPES)
            check_same_device("probs", probs, "hidden", hidden)
        if validate:
            per_token = (routing_map != 0).sum(dim=1)
            ok = (per_token <= k).all()
            msg = f"routing_map routes some token to more than topk = {k} experts"
            if routing_map.is_cuda:
                torch._assert_async(ok, msg)
            elif not bool(ok):
                raise ValueError(msg)
        idx, probs = _ref.routing_map_to_indices_torch(routing_map, probs, k)
        may_drop = True
    else:
        if indices is None:
            raise ValueError("indices ([T, k] expert ids) or routing_map ([T, E]) is required")
        if num_experts is None:
            raise ValueError("num_experts is required with indices (E, the number of experts)")
        E = _check_int("num_experts", num_experts, 1)
        if topk is not None:
            raise ValueError("topk is only used with routing_map; k is indices.shape[1]")
        idx = check_tensor("indices", indices)
        check_ndim("indices", idx, 2, "[T, k]")
        check_dim_size("indices", idx, 0, T, "hidden.shape[0] (T)")
        check_dtype("indices", idx, _INDEX_DTYPES)
        check_same_device("indices", idx, "hidden", hidden)
        k = idx.shape[1]
        _check_int("indices.shape[1] (k)", k, 1)
        if probs is not None:
            probs = check_tensor("probs", probs)
            check_ndim("probs", probs, 2, "[T, k]")
            if tuple(probs.shape) != (T, k):
                raise ValueError(
                    f"probs must have the shape of indices (T, k) = {(T, k)}, got "
                    f"{tuple(probs.shape)}"
                )
            check_dtype("probs", probs, _FLOAT_DTYPES)
            check_same_device("probs", probs, "hidden", hidden)
        if validate:
            _assert_indices_in_range(idx, E, "indices")
        may_drop = False
    a = _check_align(align)

    if capacity_factor is not None:
        if out_rows is not None:
            raise ValueError("capacity_factor and out_rows are exclusive (both decide R)")
        if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
            raise TypeError(
                f"capacity_factor must be a float, got {type(capacity_factor).__name__}"
            )
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        capacity = math.ceil(capacity_factor * T * k / E)
        capacity = -(-capacity // a) * a
        drop_probs = probs if probs is not None else torch.zeros(idx.shape, device=idx.device)
        idx = _ref.capacity_drop_torch(idx, drop_probs.detach(), E, capacity)
        num_rows = E * capacity
        may_drop = True
    else:
        num_rows = T * k + min(E, T * k) * (a - 1)

    if not idx.is_contiguous():
        idx = idx.contiguous()  # [T, k] ints: metadata-sized, not an activation copy
    if probs is not None and not probs.is_contiguous():
        probs = probs.contiguous()  # [T, k]: metadata-sized

    triton_path = use_triton(hidden)
    meta_fn = _routing_metadata if triton_path else _ref.routing_metadata_torch
    row_index, tokens_per_expert, counts, offsets = meta_fn(idx, E, a)

    if out_rows is not None:
        if out_rows == "exact":
            num_rows = int(offsets[-1])  # the one host sync, asked for by the caller
        else:
            num_rows = _check_int("out_rows", out_rows, 0)
            if validate:
                msg = f"out_rows = {num_rows} is smaller than the rows needed (offsets[-1])"
                if offsets.is_cuda:
                    torch._assert_async(offsets[-1] <= num_rows, msg)
                elif int(offsets[-1]) > num_rows:
                    raise ValueError(f"{msg} = {int(offsets[-1])}")

    if triton_path:
        layout = _Layout(
            row_index=row_index,
            offsets=offsets,
            tokens_per_expert=tokens_per_expert,
            num_rows=num_rows,
            pad_programs=a > 1,
            pad_rows=a - 1,
            tail_lo=_tail_lo(not may_drop, T * k, num_rows),
        )
        out, out_probs = _PermuteFn.apply(hidden, probs, layout)
    else:
        out, out_probs = _ref.scatter_rows_torch(hidden, row_index, num_rows, probs)

    return Dispatch(
        hidden=out,
        probs=out_probs,
        counts=counts,
        offsets=offsets,
        tokens_per_expert=tokens_per_expert,
        row_index=row_index,
        num_tokens=T,
        topk=k,
        num_experts=E,
        align=None if a == 1 else a,
        num_rows=num_rows,
        dropless=not may_drop,
    )


def _tail_lo(dropless: bool, slots: int, num_rows: int) -> int:
    # With every slot kept, offsets[-1] >= T·k, so the tail zero-fill can skip the rows below.
    return min(slots, num_rows) if dropless else 0


def unpermute(
    expert_out: torch.Tensor,  # [R, H'] bf16/fp16/fp32, rows in dispatch order
    dispatch: Dispatch,
    *,
    weighted: bool = True,
) -> torch.Tensor:
    """Sum each token's k rows back in token order: ``out[t] = Σ_s p[t, s]·expert_out[r(t, s)]``.

    Accumulates in fp32 and returns ``[T, H']`` in expert_out's dtype. Padding rows and dropped
    slots contribute nothing. ``weighted`` multiplies by ``dispatch.probs`` (which must exist);
    gradients flow to ``expert_out`` and to ``dispatch.probs`` (hence to the permute's probs).
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
    row_probs = dispatch.probs if weighted else None
    if not use_triton(expert_out):
        return _ref.gather_rows_torch(expert_out, dispatch.row_index, row_probs)
    layout = _Layout(
        row_index=dispatch.row_index,
        offsets=dispatch.offsets,
        tokens_per_expert=dispatch.tokens_per_expert,
        num_rows=dispatch.num_rows,
        pad_programs=dispatch.align is not None,
        pad_rows=(dispatch.align or 1) - 1,
        # Gradient rows that no slot maps to (padding, tail) must come back zero.
        tail_lo=_tail_lo(dispatch.dropless, dispatch.num_tokens * dispatch.topk, dispatch.num_rows),
    )
    return _UnpermuteFn.apply(expert_out, row_probs, layout)


def sort_chunks_by_index(
    x: torch.Tensor,  # [N, H] rows in chunks, e.g. [rank][expert] after an all-to-all
    split_sizes: torch.Tensor,  # [C] int, device: rows of each chunk (Σ ≤ N)
    sorted_index: torch.Tensor,  # [C] int, device: output chunk j is input chunk sorted_index[j]
    probs: torch.Tensor | None = None,  # [N] float, reordered alongside
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reorder row chunks, e.g. from ``[rank][expert]`` to ``[expert][rank]`` after an
    expert-parallel all-to-all, with sizes that stay on the device.

    Rows past ``split_sizes.sum()`` keep their place. Returns ``(x_sorted [N, H],
    probs_sorted [N] or None)``; differentiable w.r.t. x and probs. No host sync.
    """
    x = _check_hidden("x", x)
    N = x.shape[0]
    split_sizes = check_tensor("split_sizes", split_sizes)
    sorted_index = check_tensor("sorted_index", sorted_index)
    check_ndim("split_sizes", split_sizes, 1, "[C]")
    check_ndim("sorted_index", sorted_index, 1, "[C]")
    check_dtype("split_sizes", split_sizes, _INDEX_DTYPES)
    check_dtype("sorted_index", sorted_index, _INDEX_DTYPES)
    check_dim_size("sorted_index", sorted_index, 0, split_sizes.shape[0], "len(split_sizes)")
    check_same_device("split_sizes", split_sizes, "x", x)
    check_same_device("sorted_index", sorted_index, "x", x)
    if probs is not None:
        probs = check_tensor("probs", probs)
        check_ndim("probs", probs, 1, "[N]")
        check_dim_size("probs", probs, 0, N, "x.shape[0] (N)")
        check_dtype("probs", probs, _FLOAT_DTYPES)
        check_same_device("probs", probs, "x", x)
        if not probs.is_contiguous():
            probs = probs.contiguous()
    row_map = _ref.sort_chunks_row_map_torch(split_sizes, sorted_index, N).view(N, 1)
    if not use_triton(x):
        out, out_probs = _ref.scatter_rows_torch(
            x, row_map, N, None if probs is None else probs.view(N, 1)
        )
        return out, out_probs
    layout = _Layout(
        row_index=row_map,
        # No padding and no tail (a permutation of all N rows), so these are never read.
        offsets=row_map.view(-1),
        tokens_per_expert=row_map.view(-1),
        num_rows=N,
        pad_programs=False,
        pad_rows=0,
        tail_lo=N,  # a permutation of all N rows: nothing to zero
    )
    out, out_probs = _SortChunksFn.apply(x, probs, layout)
    return out, out_probs
