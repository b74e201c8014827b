"""Sync-free routing helpers of the permute ops, on every path (CUDA, interpreter, CPU).

Dimension letters: T tokens, k experts per token, E experts, R permuted rows.

Nothing here reads a tensor back to the host: every size is static, so a whole MoE block can be
captured in a CUDA graph. :func:`routing_metadata` runs the Triton counting sort on CUDA (and in
Triton's interpreter) and :func:`routing_metadata_torch` on CPU; both give the same result.
"""

from __future__ import annotations

import math

import torch

from moekit.kernels import permute as kernels
from moekit.runtime.device import use_triton
from moekit.runtime.op import eager_shortcut, kernel_op
from moekit.runtime.replay import replayed, tensor_key
from moekit.tuning.permute import meta_config

__all__ = [
    "capacity_drop",
    "expert_capacity",
    "max_rows",
    "routing_map_to_indices",
    "routing_metadata",
    "routing_metadata_torch",
    "row_tokens",
    "slot_values",
    "sort_chunks_row_map",
    "sort_chunks_row_map_torch",
]


def max_rows(num_tokens: int, topk: int, num_experts: int, align: int) -> int:
    """The rows a routing can need: T·k, plus up to ``align − 1`` padding rows for each expert
    that has a row (at most min(E, T·k) of them)."""
    slots = num_tokens * topk
    return slots + min(num_experts, slots) * (align - 1)


def expert_capacity(capacity_factor: object, num_tokens: int, topk: int, num_experts: int,
                    align: int) -> int:  # fmt: skip
    """Rows each expert keeps under ``capacity_factor``: ``C = ceil(cf·T·k/E)``, rounded up to
    a multiple of ``align``. Raises TypeError/ValueError for a capacity_factor that is not a
    finite float > 0."""
    cf = capacity_factor
    if isinstance(cf, bool) or not isinstance(cf, (int, float)):
        raise TypeError(f"capacity_factor must be a float, got {type(cf).__name__}")
    if not 0 < cf < math.inf:
        raise ValueError(f"capacity_factor must be a finite float > 0, got {cf}")
    capacity = math.ceil(cf * num_tokens * topk / num_experts)
    return -(-capacity // align) * align


def routing_metadata_torch(
    indices: torch.Tensor,  # [T, k] int; outside [0, E) = dropped slot
    num_experts: int,
    align: int,  # 1 = no padding
    out_rows: int | None = None,  # R: rows at or past it are dropped; None: max_rows
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The metadata in plain torch ops (the CPU path): see :func:`routing_metadata`."""
    E = num_experts
    if out_rows is None:
        out_rows = max_rows(indices.shape[0], indices.shape[1], E, align)
    flat = indices.reshape(-1).long()
    valid = (flat >= 0) & (flat < E)
    # Dropped pairs sort after every expert; the stable sort keeps token order inside an expert.
    key = torch.where(valid, flat, torch.full_like(flat, E))
    order = torch.sort(key, stable=True).indices
    # scatter_add rather than bincount: bincount reads its max back to the host on CUDA.
    totals = torch.zeros(E + 1, dtype=torch.long, device=flat.device)
    totals = totals.scatter_add_(0, key, torch.ones_like(key))[:E]
    padded = (totals + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    first_of = torch.cumsum(totals, 0) - totals  # where each expert starts in the sorted order
    sorted_e = key[order]
    se = sorted_e.clamp(max=E - 1)
    sorted_row = starts[se] + torch.arange(flat.numel(), device=flat.device) - first_of[se]
    sorted_row = torch.where((sorted_e < E) & (sorted_row < out_rows), sorted_row, -1)
    row_index = torch.empty_like(flat).index_put_((order,), sorted_row)
    # What the first R rows hold: segments cut at R, and the real rows among them.
    kept_ends = ends.clamp(max=out_rows)
    kept = torch.minimum(totals, out_rows - starts).clamp(min=0)
    return (
        row_index.view(indices.shape).to(torch.int32),
        kept.to(torch.int32),
        (kept_ends - starts.clamp(max=out_rows)).to(torch.int32),
        kept_ends.to(torch.int32),
    )


def _metadata_fake(indices, num_experts, align, out_rows, one_buffer):
    e = indices.new_empty(num_experts, dtype=torch.int32)
    return indices.new_empty(indices.shape, dtype=torch.int32), e, e.clone(), e.clone()


@kernel_op("routing_metadata", fake=_metadata_fake)
def _metadata(
    indices: torch.Tensor,  # [T, k] contiguous
    num_experts: int,
    align: int,
    out_rows: int,
    one_buffer: bool,  # views of one allocation (a custom op's outputs may not alias)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if not use_triton(indices):
        return routing_metadata_torch(indices, num_experts, align, out_rows)
    dev, E, n = indices.device, num_experts, indices.numel()
    config = meta_config(n)
    # The counting sort packs (expert id up to E, position in its block) into 32-bit keys.
    max_experts = (1 << (32 - (config.block_n.bit_length() - 1))) - 2
    if num_experts > max_experts:
        raise ValueError(f"num_experts must be at most {max_experts}, got {num_experts}")
    sizes = (n, E, E, E, kernels.metadata_scratch_numel(n, E, config))
    if one_buffer:
        # One allocation for the five int32 buffers (each costs host time on every call),
        # each at a 16-byte boundary as the kernels (and their launch replay) expect.
        pieces = [c for s in sizes for c in (s, -s % 4)]  # each buffer, then its padding
        buffer = torch.empty(sum(pieces), dtype=torch.int32, device=dev)
        row_index, tokens_per_expert, counts, offsets, scratch = buffer.split(pieces)[::2]
    else:
        row_index, tokens_per_expert, counts, offsets, scratch = (
            torch.empty(s, dtype=torch.int32, device=dev) for s in sizes
        )
    row_index = row_index.view(indices.shape)
    outs = (row_index, tokens_per_expert, counts, offsets, scratch)
    key = None
    if indices.is_cuda:
        key = ("routing_metadata", tensor_key(indices), E, align, out_rows)

    def body() -> None:
        kernels.routing_metadata(indices, E, align, out_rows, config, outs)

    replayed(key, (indices, row_index, tokens_per_expert, counts, offsets, scratch), body)
    return row_index, tokens_per_expert, counts, offsets


def routing_metadata(
    indices: torch.Tensor,  # [T, k] integer expert ids
    num_experts: int,
    align: int,  # 1 = no padding
    out_rows: int | None = None,  # R; None: max_rows (nothing dropped)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each (token, slot) pair goes when the pairs are grouped by expert: a stable sort
    (tokens keep their order inside an expert), every expert's segment padded to a multiple of
    ``align`` rows.

    Rows at or past ``out_rows`` are dropped in TransformerEngine's order: the first R rows of
    the expert-sorted, padded order are kept. Returns, all int32 on the device of ``indices``:

    * ``row_index [T, k]``: the row of each pair; −1 for a dropped pair (an id outside
      ``[0, E)``, or a row at or past R);
    * ``tokens_per_expert [E]``: rows kept per expert, without padding;
    * ``counts [E]``: rows of each expert's segment, padding included; a multiple of ``align``
      except for a segment cut at R;
    * ``offsets [E]``: cumulative end offsets of the segments (``cumsum(counts)``), at most R.
    """
    n = indices.numel()
    if n >= 2**31:
        raise ValueError(f"indices must hold fewer than 2^31 slots (int32 rows), got T·k = {n}")
    if out_rows is None:
        T, k = indices.shape
        out_rows = max_rows(T, k, num_experts, align)
    if not indices.is_contiguous():
        indices = indices.contiguous()  # [T, k] ints: metadata-sized, not an activation copy
    if eager_shortcut((indices,)):
        return _metadata.impl(indices, num_experts, align, out_rows, True)
    return _metadata(indices, num_experts, align, out_rows, False)


def capacity_drop(
    indices: torch.Tensor,  # [T, k] int
    probs: torch.Tensor,  # [T, k] float
    num_experts: int,
    capacity: int,
) -> torch.Tensor:
    """Masks (sets to −1) the slots beyond ``capacity`` per expert, dropping the lowest probs
    first; ties keep the earlier token. Returns ``indices [T, k]`` (int64)."""
    E = num_experts
    flat = indices.reshape(-1).long()
    valid = (flat >= 0) & (flat < E)
    key_e = torch.where(valid, flat, torch.full_like(flat, E))
    # Two stable sorts: by prob descending, then by expert → per expert, highest prob first.
    by_prob = torch.sort(probs.reshape(-1).float(), descending=True, stable=True).indices
    by_expert = by_prob[torch.sort(key_e[by_prob], stable=True).indices]
    sorted_e = key_e[by_expert]
    totals = torch.zeros(E + 1, dtype=torch.long, device=flat.device)
    totals.scatter_add_(0, sorted_e, torch.ones_like(sorted_e))
    first_of = torch.cumsum(totals, 0) - totals
    rank_sorted = torch.arange(flat.numel(), device=flat.device) - first_of[sorted_e]
    rank = torch.empty_like(rank_sorted).index_put_((by_expert,), rank_sorted)
    keep = valid & (rank < capacity)
    return torch.where(keep, flat, -1).view(indices.shape)


def routing_map_to_indices(
    routing_map: torch.Tensor,  # [T, E] bool/int, nonzero = routed
    probs: torch.Tensor | None,  # [T, E] float
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first ``topk`` routed experts of each token (ascending expert id) as ``indices [T, k]``
    (−1 where a token has fewer), and their probs ``[T, k]`` (0 there)."""
    routed = routing_map != 0
    # Stable sort of "not routed" puts the routed experts first, in ascending id.
    order = torch.sort((~routed).to(torch.int8), dim=1, stable=True).indices[:, :topk]
    hit = torch.gather(routed, 1, order)
    indices = torch.where(hit, order, -1)
    slot_probs = None
    if probs is not None:
        slot_probs = torch.where(hit, torch.gather(probs, 1, order), 0)
    return indices, slot_probs


def sort_chunks_row_map(
    split_sizes: torch.Tensor,  # [C] int, rows of each input chunk
    sorted_index: torch.Tensor,  # [C] int, output chunk j is input chunk sorted_index[j]
    num_rows: int,  # N, rows of x (≥ Σ split_sizes; the rows past the sum stay in place)
) -> torch.Tensor:
    """Destination row of each input row when the chunks are reordered (``[N]`` int32): two
    Triton launches on CUDA (and in Triton's interpreter), a few torch ops on the CPU."""
    if split_sizes.numel() == 0 or not use_triton(split_sizes):
        return sort_chunks_row_map_torch(split_sizes, sorted_index, num_rows)
    sizes = split_sizes if split_sizes.is_contiguous() else split_sizes.contiguous()
    index = sorted_index if sorted_index.is_contiguous() else sorted_index.contiguous()
    if eager_shortcut((sizes, index)):
        return _chunk_row_map.impl(sizes, index, num_rows)
    return _chunk_row_map(sizes, index, num_rows)


def _chunk_row_map_fake(split_sizes, sorted_index, num_rows):
    return split_sizes.new_empty(num_rows, dtype=torch.int32)


@kernel_op("sort_chunks_row_map", fake=_chunk_row_map_fake)
def _chunk_row_map(
    split_sizes: torch.Tensor,  # [C] int, contiguous, C ≥ 1
    sorted_index: torch.Tensor,  # [C] int, contiguous
    num_rows: int,
) -> torch.Tensor:
    C, dev = split_sizes.numel(), split_sizes.device
    out = torch.empty(num_rows, dtype=torch.int32, device=dev)
    scratch = torch.empty(2 * C, dtype=torch.int64, device=dev)
    key = None
    if split_sizes.is_cuda:
        key = ("sort_chunks_row_map", tensor_key(split_sizes), tensor_key(sorted_index), num_rows)

    def body() -> None:
        kernels.sort_chunks_row_map(split_sizes, sorted_index, out, scratch)

    replayed(key, (split_sizes, sorted_index, out, scratch), body)
    return out


def sort_chunks_row_map_torch(
    split_sizes: torch.Tensor, sorted_index: torch.Tensor, num_rows: int
) -> torch.Tensor:
    """:func:`sort_chunks_row_map` in torch ops (the CPU path and the kernels' oracle)."""
    sizes = split_sizes.long()
    C = sizes.numel()
    src_end = torch.cumsum(sizes, 0)
    src_start = src_end - sizes
    sorted_sizes = sizes[sorted_index.long()]
    dst_start_sorted = torch.cumsum(sorted_sizes, 0) - sorted_sizes
    dst_start = torch.empty_like(dst_start_sorted).index_put_(
        (sorted_index.long(),), dst_start_sorted
    )
    n = torch.arange(num_rows, device=sizes.device)
    if C == 0:
        return n.to(torch.int32)
    chunk = torch.searchsorted(src_end, n, right=True)
    inside = chunk < C
    c = chunk.clamp(max=C - 1)
    row = torch.where(inside, dst_start[c] + n - src_start[c], n)
    return row.to(torch.int32)


def slot_values(row_vals: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
    """``[T, k] = row_vals[row_index]``, 0 for dropped slots: a row's value back at the slot it
    came from. Like the kernels, any row outside ``[0, R)`` counts as dropped."""
    if row_vals.shape[0] == 0:  # no rows: every slot dropped
        return row_vals.new_zeros(row_index.shape)
    keep = (row_index >= 0) & (row_index < row_vals.shape[0])
    vals = row_vals[torch.where(keep, row_index, 0).long()]
    return torch.where(keep, vals, torch.zeros_like(vals))


def row_tokens(row_index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The token of every permuted row: [R] int32, −1 for the rows no slot maps to (padding,
    tail). The inverse of ``row_index`` [T, k] (−1 = dropped), sync-free: every dropped slot
    writes into one spare entry past R."""
    T, k = row_index.shape
    flat = row_index.reshape(-1).long()
    dest = torch.where((flat >= 0) & (flat < num_rows), flat, num_rows)
    tokens = torch.arange(T * k, device=row_index.device, dtype=torch.int32).div_(
        max(k, 1), rounding_mode="floor"
    )
    out = torch.full((num_rows + 1,), -1, dtype=torch.int32, device=row_index.device)
    return out.scatter_(0, dest, tokens)[:num_rows]
