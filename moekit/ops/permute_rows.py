"""The row-copy kernel ops of permute / unpermute: ``moekit::permute_scatter`` (each token to its
k rows; with FP8, quantized once on the way, ``moekit::permute_scatter_fp8``) and
``moekit::permute_gather`` (each token's k rows summed back). Each picks the Triton kernels or
the PyTorch reference by device; launches replay by their static facts.

Dimension letters: T tokens, k experts per token, E experts, R permuted rows, H hidden.
"""

from __future__ import annotations

import torch

from moekit.kernels import permute as kernels
from moekit.ops.routing import slot_values
from moekit.reference.fp8 import quantize_fp8_ref
from moekit.reference.permute import gather_rows_torch, scatter_rows_torch
from moekit.runtime.device import use_triton
from moekit.runtime.op import kernel_op
from moekit.runtime.replay import replayed, tensor_key
from moekit.tuning.permute import copy_config

__all__ = ["gather", "scatter", "scatter_fp8"]


def _dtype(t: torch.Tensor | None) -> torch.dtype | None:
    return None if t is None else t.dtype


def _scatter_fake(
    x, row_index, offsets, tpe, slot_vals, row_weight, dot_src, R, align, tail_lo, dt
):
    has_vals = slot_vals is not None or dot_src is not None
    return x.new_empty(R, x.shape[1]), x.new_empty(R if has_vals else 0, dtype=dt)


@kernel_op("permute_scatter", fake=_scatter_fake)
def scatter(
    x: torch.Tensor,  # [T, H] unit stride along H
    row_index: torch.Tensor,  # [T, k] int32 contiguous
    offsets: torch.Tensor | None,  # [E] int32 (None: every row is written)
    tokens_per_expert: torch.Tensor | None,  # [E] int32 (None likewise)
    slot_vals: torch.Tensor | None,  # [T, k] contiguous → vals
    row_weight: torch.Tensor | None,  # [R] contiguous: rows scaled by it
    dot_src: torch.Tensor | None,  # [R, H] → vals[r] = <x[t], dot_src[r]>
    num_rows: int,  # R
    align: int,  # padding rows of each segment are zeroed
    tail_lo: int,  # static lower bound of offsets[-1]
    vals_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # rows [R, H], vals [R] (or [0] without vals)
    """Each token's row to its k rows; padding and tail rows zero (``scatter_rows_torch``)."""
    has_vals = slot_vals is not None or dot_src is not None
    if not use_triton(x):
        out, vals = scatter_rows_torch(x, row_index, num_rows, slot_vals, row_weight, dot_src)
        return out, vals.to(vals_dtype) if has_vals else x.new_empty(0, dtype=vals_dtype)
    H = x.shape[1]
    out = torch.empty(num_rows, H, dtype=x.dtype, device=x.device)
    vals = torch.empty(num_rows if has_vals else 0, dtype=vals_dtype, device=x.device)
    out_vals = vals if has_vals else None
    roles = (
        x, row_index, offsets, tokens_per_expert, slot_vals, row_weight, dot_src, out, out_vals,
    )  # fmt: skip
    key = None
    if x.is_cuda:
        # The other tensors are contiguous with shapes set by these (and the outputs fresh):
        # their dtypes and presence complete the key.
        key = (
            "permute_scatter", align, tail_lo, num_rows, vals_dtype, tensor_key(x),
            row_index.shape, None if offsets is None else offsets.shape,
            _dtype(slot_vals), _dtype(row_weight), tensor_key(dot_src),
        )  # fmt: skip

    def body() -> None:  # not run when the launches are replayed: config choice included
        config = copy_config("scatter", row_index.shape[1], H, dot=dot_src is not None)
        kernels.scatter_rows(
            x, row_index, offsets, tokens_per_expert, out, out_vals, config,
            slot_vals=slot_vals, row_weight=row_weight, dot_src=dot_src, align=align,
            tail_lo=tail_lo,
        )  # fmt: skip

    replayed(key, roles, body)
    return out, vals


def _gather_fake(src, row_index, row_weight, row_vals, lead):
    T, k = row_index.shape
    out = src.new_empty(*lead, src.shape[1])
    if row_vals is None:
        return out, src.new_empty(0)
    return out, row_vals.new_empty(T, k)


@kernel_op("permute_gather", fake=_gather_fake)
def gather(
    src: torch.Tensor,  # [R, H] unit stride along H
    row_index: torch.Tensor,  # [T, k] int32 contiguous
    row_weight: torch.Tensor | None,  # [R] contiguous
    row_vals: torch.Tensor | None,  # [R] contiguous → vals
    lead: list[int],  # out's leading shape, of T elements ([T] for [T, H])
) -> tuple[torch.Tensor, torch.Tensor]:  # out [*lead, H], vals [T, k] (or [0] without row_vals)
    """Sum of each token's k rows in fp32, weighted by ``row_weight``; ``vals[t, s] =
    row_vals[row_index[t, s]]`` (0 where dropped). ``out`` is allocated in the shape
    ``[*lead, H]`` (a tensor of its own, not a view: callers may hand it out as is)."""
    T, k = row_index.shape
    H = src.shape[1]
    if not use_triton(src):
        vals = slot_values(row_vals, row_index) if row_vals is not None else src.new_empty(0)
        rows = gather_rows_torch(src, row_index, row_weight)
        if len(lead) == 1:
            return rows, vals
        out = src.new_empty(*lead, H)
        out.view(T, H).copy_(rows)
        return out, vals
    full = torch.empty(*lead, H, dtype=src.dtype, device=src.device)
    out = full.view(T, H)
    vals = src.new_empty(0) if row_vals is None else row_vals.new_empty(T, k)
    out_vals = vals if row_vals is not None else None
    roles = (src, row_index, row_weight, row_vals, out, out_vals)
    key = None
    if src.is_cuda:  # as in scatter: the rest is contiguous, shaped by these
        key = (
            "permute_gather", tensor_key(src), row_index.shape, _dtype(row_weight),
            _dtype(row_vals),
        )  # fmt: skip

    def body() -> None:
        config = copy_config("gather", k, src.shape[1])
        kernels.gather_rows(
            src, row_index, out, config, row_weight=row_weight, row_vals=row_vals, out_vals=out_vals
        )

    replayed(key, roles, body)
    return full, vals


def _scatter_fp8_fake(x, row_index, offsets, tokens_per_expert, slot_vals, R, align, tail_lo, pow2):
    data = x.new_empty(R, x.shape[1], dtype=torch.float8_e4m3fn)
    scale = x.new_empty(R, -(-x.shape[1] // kernels.QUANT_BLOCK), dtype=torch.float32)
    if slot_vals is None:
        return data, scale, x.new_empty(0)
    return data, scale, slot_vals.new_empty(R)


@kernel_op("permute_scatter_fp8", fake=_scatter_fp8_fake)
def scatter_fp8(
    x: torch.Tensor,  # [T, H] unit stride along H
    row_index: torch.Tensor,  # [T, k] int32 contiguous
    offsets: torch.Tensor,  # [E] int32
    tokens_per_expert: torch.Tensor,  # [E] int32
    slot_vals: torch.Tensor | None,  # [T, k] contiguous → vals
    num_rows: int,  # R
    align: int,  # padding rows of each segment are zeroed
    tail_lo: int,  # static lower bound of offsets[-1]
    pow2: bool,  # power-of-two scales
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # data [R, H] e4m3, scale, vals [R] or [0]
    """Each token quantized 1×128 once (``quantize_fp8``'s math) and written to its k rows:
    e4m3 data [R, H], fp32 scales [R, ⌈H/128⌉]; padding and tail rows get zero bytes and zero
    scales."""
    if not use_triton(x):
        q, s = quantize_fp8_ref(x, "row", kernels.QUANT_BLOCK, pow2)
        data, vals = scatter_rows_torch(q.view(torch.uint8), row_index, num_rows, slot_vals)
        scale, _ = scatter_rows_torch(s, row_index, num_rows)
        return data.view(torch.float8_e4m3fn), scale, vals if vals is not None else x.new_empty(0)
    data, scale, vals = _scatter_fp8_fake(
        x, row_index, offsets, tokens_per_expert, slot_vals, num_rows, align, tail_lo, pow2
    )
    out = data.view(torch.uint8)
    out_vals = vals if slot_vals is not None else None
    roles = (x, row_index, offsets, tokens_per_expert, slot_vals, out, scale, out_vals)
    key = None
    if x.is_cuda:  # as in scatter: the rest is contiguous, shaped by these
        key = ("permute_scatter_fp8", align, tail_lo, num_rows, pow2, tensor_key(x),
               row_index.shape, offsets.shape, _dtype(slot_vals))  # fmt: skip

    def body() -> None:
        config = copy_config("scatter", row_index.shape[1], x.shape[1])
        kernels.scatter_rows(
            x, row_index, offsets, tokens_per_expert, out, out_vals, config,
            slot_vals=slot_vals, align=align, tail_lo=tail_lo, scale=scale, pow2=pow2,
        )  # fmt: skip

    replayed(key, roles, body)
    return data, scale, vals
