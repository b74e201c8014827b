"""Expert-parallel token exchange for ``MoELayer``: tokens travel to the rank that holds their
expert with an all-to-all over ``torch.distributed``, are regrouped by local expert, and come
back the same way (all differentiable).

The row counts travel on the device (an all-to-all of ``tokens_per_expert``), but
``all_to_all_single`` needs its split sizes on the host: reading them is the one host sync of
this path (docs/DESIGN.md). Experts are split evenly: rank r holds experts
``[r·E/W, (r+1)·E/W)``, so a dispatch's expert order is already grouped by destination rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moekit.ops.permute import sort_chunks_by_index

__all__ = ["ExpertExchange"]


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` to every rank by ``in_splits``; the rows from every rank, ``out_splits``
    of them, in rank order. Backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class ExpertExchange:
    """One layer call's exchange: ``send`` takes a dispatch's rows (grouped by global expert)
    to the expert owners, grouped by local expert; ``receive`` brings the expert outputs back
    in the dispatch's row order."""

    def __init__(self, tokens_per_expert: torch.Tensor, group: dist.ProcessGroup) -> None:
        W = group.size()
        E_local = tokens_per_expert.numel() // W
        send = tokens_per_expert.view(W, E_local).to(torch.int64)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)  # rows from each rank, per local expert
        self.group, self.W, self.E_local = group, W, E_local
        self.recv_counts = recv  # [W, E_local]
        # the one host sync: all_to_all_single takes host split sizes
        self.send_splits = send.sum(1).tolist()
        self.recv_splits = recv.sum(1).tolist()
        chunks = torch.arange(W * E_local, device=recv.device)
        self.to_expert_major = chunks.view(W, E_local).t().flatten()
        self.to_rank_major = chunks.view(E_local, W).t().flatten()

    def send(self, rows: torch.Tensor, probs: torch.Tensor) -> tuple:
        """(rows, probs, offsets) on the expert owner: grouped by local expert, with
        cumulative end offsets [E_local]."""
        n = sum(self.send_splits)
        args = (self.recv_splits, self.send_splits, self.group)
        rows = _AllToAll.apply(rows[:n], *args)
        probs = _AllToAll.apply(probs[:n].unsqueeze(1), *args).squeeze(1)
        rows, probs = sort_chunks_by_index(
            rows, self.recv_counts.flatten(), self.to_expert_major, probs
        )
        offsets = self.recv_counts.sum(0).cumsum(0).to(torch.int32)
        return rows, probs, offsets

    def receive(self, out: torch.Tensor) -> torch.Tensor:
        """Expert outputs (grouped by local expert) back to the ranks their tokens came from,
        in the order ``send`` took them."""
        out, _ = sort_chunks_by_index(out, self.recv_counts.t().flatten(), self.to_rank_major)
        return _AllToAll.apply(out, self.send_splits, self.recv_splits, self.group)
