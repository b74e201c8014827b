"""Pure-PyTorch twins of ``moekit.kernels.permute``: the test oracle and the CPU path.

Everything here is differentiable through ordinary torch ops, so on the CPU path autograd needs
no hand-written backward. Dimension letters: T tokens, k experts per token, E experts, R permuted
rows, H hidden.
"""

from __future__ import annotations

import torch


def routing_metadata_torch(
    indices: torch.Tensor,  # [T, k] int; outside [0, E) = dropped slot
    num_experts: int,
    align: int,  # 1 = no padding
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin of ``routing_metadata``: a stable sort of the (token, slot) pairs by expert.

    Returns int32 ``row_index [T, k]`` (−1 for dropped slots), ``tokens_per_expert [E]``,
    ``counts [E]`` (padded up to a multiple of ``align``) and ``offsets [E]`` (cumulative ends).
    """
    E = num_experts
    flat = indices.reshape(-1).long()
    valid = (flat >= 0) & (flat < E)
    # Dropped pairs sort after every expert; the stable sort keeps token order inside an expert.
    key = torch.where(valid, flat, torch.full_like(flat, E))
    order = torch.sort(key, stable=True).indices
    # scatter_add rather than bincount: bincount reads its max back to the host on CUDA.
    tokens_per_expert = torch.zeros(E + 1, dtype=torch.long, device=flat.device)
    tokens_per_expert = tokens_per_expert.scatter_add_(0, key, torch.ones_like(key))[:E]
    counts = (tokens_per_expert + align - 1) // align * align
    offsets = torch.cumsum(counts, 0)
    starts = offsets - counts
    first_of = torch.cumsum(tokens_per_expert, 0) - tokens_per_expert  # in the sorted order
    sorted_e = key[order]
    pos = torch.arange(flat.numel(), device=flat.device)
    sorted_valid = sorted_e < E
    se = sorted_e.clamp(max=E - 1)
    sorted_row = torch.where(sorted_valid, starts[se] + pos - first_of[se], -1)
    row_index = torch.empty_like(flat)
    row_index[order] = sorted_row
    return (
        row_index.view(indices.shape).to(torch.int32),
        tokens_per_expert.to(torch.int32),
        counts.to(torch.int32),
        offsets.to(torch.int32),
    )


def scatter_rows_torch(
    x: torch.Tensor,  # [T, H]
    row_index: torch.Tensor,  # [T, k] int, −1 = dropped
    num_rows: int,  # R
    slot_vals: torch.Tensor | None = None,  # [T, k]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Twin of the permute copy: ``out[row_index[t, s]] = x[t]``; all other rows zero.

    Returns ``out [R, H]`` and, with ``slot_vals``, ``out_vals [R]`` (0 for unwritten rows).
    """
    T, H = x.shape
    k = row_index.shape[1]
    rows = row_index.reshape(-1).long()
    keep = (rows >= 0) & (rows < num_rows)
    src = torch.arange(T, device=x.device).repeat_interleave(k)
    out = x.new_zeros((num_rows, H)).index_put((rows[keep],), x[src[keep]])
    out_vals = None
    if slot_vals is not None:
        vals = slot_vals.reshape(-1)
        out_vals = vals.new_zeros(num_rows).index_put((rows[keep],), vals[keep])
    return out, out_vals


def gather_rows_torch(
    src: torch.Tensor,  # [R, H]
    row_index: torch.Tensor,  # [T, k] int, −1 = dropped
    row_weight: torch.Tensor | None = None,  # [R]
) -> torch.Tensor:
    """Twin of the unpermute copy: ``out[t] = Σ_s src[r_s] · row_weight[r_s]`` over kept slots,
    accumulated in fp32 and returned in src's dtype ([T, H])."""
    R = src.shape[0]
    rows = row_index.long()
    keep = (rows >= 0) & (rows < R)
    safe = torch.where(keep, rows, 0)
    y = src[safe].float()  # [T, k, H]
    w = keep.float()
    if row_weight is not None:
        w = w * row_weight[safe].float()
    return (y * w.unsqueeze(-1)).sum(dim=1).to(src.dtype)


def capacity_drop_torch(
    indices: torch.Tensor,  # [T, k] int
    probs: torch.Tensor,  # [T, k] float
    num_experts: int,
    capacity: int,
) -> torch.Tensor:
    """Masks (sets to −1) the slots beyond ``capacity`` per expert, dropping the lowest probs
    first; ties keep the earlier token. Sync-free and static-shaped, so it also serves the CUDA
    path. Returns ``indices [T, k]`` (int64) with dropped slots at −1."""
    E = num_experts
    flat = indices.reshape(-1).long()
    valid = (flat >= 0) & (flat < E)
    key_e = torch.where(valid, flat, torch.full_like(flat, E))
    # Two stable sorts: by prob descending, then by expert → per expert, highest prob first.
    by_prob = torch.sort(probs.reshape(-1).float(), descending=True, stable=True).indices
    by_expert = by_prob[torch.sort(key_e[by_prob], stable=True).indices]
    sorted_e = key_e[by_expert]
    tokens_per_expert = torch.zeros(E + 1, dtype=torch.long, device=flat.device)
    tokens_per_expert.scatter_add_(0, sorted_e, torch.ones_like(sorted_e))
    first_of = torch.cumsum(tokens_per_expert, 0) - tokens_per_expert
    rank_sorted = torch.arange(flat.numel(), device=flat.device) - first_of[sorted_e]
    rank = torch.empty_like(rank_sorted)
    rank[by_expert] = rank_sorted
    keep = valid & (rank < capacity)
    return torch.where(keep, flat, -1).view(indices.shape)


def routing_map_to_indices_torch(
    routing_map: torch.Tensor,  # [T, E] bool/int, nonzero = routed
    probs: torch.Tensor | None,  # [T, E] float
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first ``topk`` routed experts of each token (ascending expert id) as ``indices [T, k]``
    (−1 where a token has fewer), and their probs ``[T, k]`` (0 there). Sync-free."""
    routed = routing_map != 0
    # Stable sort of "not routed" puts the routed experts first, in ascending id.
    order = torch.sort((~routed).to(torch.int8), dim=1, stable=True).indices[:, :topk]
    hit = torch.gather(routed, 1, order)
    indices = torch.where(hit, order, -1)
    slot_probs = None
    if probs is not None:
        slot_probs = torch.where(hit, torch.gather(probs, 1, order), 0)
    return indices, slot_probs


def sort_chunks_row_map_torch(
    split_sizes: torch.Tensor,  # [C] int, rows of each input chunk
    sorted_index: torch.Tensor,  # [C] int, output chunk j is input chunk sorted_index[j]
    num_rows: int,  # N, rows of x (≥ Σ split_sizes; the rows past the sum stay in place)
) -> torch.Tensor:
    """Destination row of each input row when the chunks are reordered (``[N]`` int32). Sync-free:
    a few small launches over C plus one searchsorted over N."""
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


def permute_composed_torch(
    hidden: torch.Tensor,  # [T, H]
    indices: torch.Tensor,  # [T, k]
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The textbook composition (argsort + index_select), for benchmarks and as a second oracle.
    Returns ``permuted [T·k, H]`` and ``sorted_slots [T·k]`` (flat slot of each row)."""
    k = indices.shape[1]
    order = torch.argsort(indices.reshape(-1), stable=True)
    return hidden.index_select(0, order // k), order


def unpermute_composed_torch(
    permuted: torch.Tensor,  # [T·k, H]
    sorted_slots: torch.Tensor,  # [T·k]
    probs: torch.Tensor | None,  # [T, k]
    num_tokens: int,
) -> torch.Tensor:
    """index_add_-based combine matching ``permute_composed_torch`` ([T, H], fp32 accumulation)."""
    k = sorted_slots.numel() // max(num_tokens, 1)
    y = permuted.float()
    if probs is not None:
        y = y * probs.reshape(-1)[sorted_slots].float().unsqueeze(1)
    out = torch.zeros((num_tokens, permuted.shape[1]), dtype=torch.float32, device=permuted.device)
    out.index_add_(0, sorted_slots // max(k, 1), y)
    return out.to(permuted.dtype)
