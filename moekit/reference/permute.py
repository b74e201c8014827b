"""Pure-PyTorch twins of the permute copy kernels: the test oracle and the CPU path's copies.

Everything here is differentiable through ordinary torch ops, so tests get reference gradients
from autograd. The routing helpers (metadata, capacity drop, routing map, chunk sort) live in
:mod:`moekit.ops.routing`, since the CUDA path uses them too. Dimension letters: T tokens,
k experts per token, E experts, R permuted rows, H hidden.
"""

from __future__ import annotations

import torch

__all__ = [
    "gather_rows_torch",
    "permute_composed_torch",
    "scatter_rows_torch",
    "unpermute_composed_torch",
]


def scatter_rows_torch(
    x: torch.Tensor,  # [T, H]
    row_index: torch.Tensor,  # [T, k] int, −1 = dropped
    num_rows: int,  # R
    slot_vals: torch.Tensor | None = None,  # [T, k]
    row_weight: torch.Tensor | None = None,  # [R]
    dot_src: torch.Tensor | None = None,  # [R, H]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Twin of the scatter kernel: ``out[r] = x[t] · row_weight[r]`` for each slot (t, s) with
    ``r = row_index[t, s]`` in ``[0, R)``; all other rows zero.

    Returns ``out [R, H]`` and ``out_vals [R]`` (0 for unwritten rows) with ``slot_vals``
    (``out_vals[r] = slot_vals[t, s]``) or ``dot_src`` (``out_vals[r] = Σ_h x[t, h] ·
    dot_src[r, h]`` in fp32), else None. Weighted rows and dots are computed in fp32.
    """
    T, H = x.shape
    k = row_index.shape[1]
    rows = row_index.reshape(-1).long()
    keep = (rows >= 0) & (rows < num_rows)
    src = torch.arange(T, device=x.device).repeat_interleave(k)[keep]
    dst = rows[keep]
    vals = x[src]
    if row_weight is not None:
        vals = (vals.float() * row_weight[dst].float()[:, None]).to(x.dtype)
    out = x.new_zeros((num_rows, H)).index_put((dst,), vals)
    out_vals = None
    if slot_vals is not None:
        flat = slot_vals.reshape(-1)
        out_vals = flat.new_zeros(num_rows).index_put((dst,), flat[keep])
    elif dot_src is not None:
        dots = (x[src].float() * dot_src[dst].float()).sum(-1)
        out_vals = dots.new_zeros(num_rows).index_put((dst,), dots)
    return out, out_vals


def gather_rows_torch(
    src: torch.Tensor,  # [R, H]
    row_index: torch.Tensor,  # [T, k] int, −1 = dropped
    row_weight: torch.Tensor | None = None,  # [R]
) -> torch.Tensor:
    """Twin of the gather kernel: ``out[t] = Σ_s src[r_s] · row_weight[r_s]`` over the slots
    with ``r_s`` in ``[0, R)``, accumulated in fp32 and returned in src's dtype ([T, H])."""
    R = src.shape[0]
    if R == 0:  # every slot dropped (nothing to index, even row 0)
        return src.new_zeros(row_index.shape[0], src.shape[1])
    rows = row_index.long()
    keep = (rows >= 0) & (rows < R)
    safe = torch.where(keep, rows, 0)
    y = src[safe].float()  # [T, k, H]
    w = keep.float()
    if row_weight is not None:
        w = w * row_weight[safe].float()
    return (y * w.unsqueeze(-1)).sum(dim=1).to(src.dtype)


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
