"""Expert-parallel token exchange for ``MoELayer``: tokens travel to the rank that holds their
expert with an all-to-all over ``torch.distributed``, are regrouped by local expert, and come
back the same way (all differentiable).

Dropless (``ExpertExchange``), the row counts travel on the device (an all-to-all of
``tokens_per_expert``), but ``all_to_all_single`` needs its split sizes on the host: reading
them is the one host sync of that path (docs/DESIGN.md). With a capacity limit
(``CapacityExchange``) every expert's rows fill a fixed block, so all sizes are static and
nothing is read back. Experts are split evenly: rank r holds experts
``[r·E/W, (r+1)·E/W)``, so a dispatch's expert order is already grouped by destination rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moekit.ops.permute import sort_chunks_by_index

__all__ = ["CapacityExchange", "ExpertExchange", "check_same_tokens"]


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` to every rank by ``in_splits``; the rows from every rank, ``out_splits``
    of them, in rank order (None: equal splits). Backward sends the gradients back the same
    way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        rows = x.shape[0] if out_splits is None else sum(out_splits)
        out = x.new_empty(rows, *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(
            grad.shape[0] if in_splits is None else sum(in_splits), *grad.shape[1:]
        )
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


class CapacityExchange:
    """The sync-free exchange of a capacity-limited dispatch (``permute(...,
    capacity_factor=cf)``): every expert's rows are laid into a fixed block of C rows (zero
    padding, prob 0), so each rank sends every other rank exactly ``E_local·C`` rows and all
    sizes are static — no host sync, and a step can be captured in a CUDA graph. Every rank
    must pass the same number of tokens (C derives from it). The expert owner runs its experts
    over ``W·C`` rows each (the padding rows give zero output)."""

    def __init__(self, dispatch_counts: torch.Tensor, offsets: torch.Tensor, capacity: int,
                 num_rows: int, group: dist.ProcessGroup) -> None:  # fmt: skip
        W = group.size()
        E = dispatch_counts.numel()
        self.group, self.W, self.E_local, self.C = group, W, E // W, capacity
        # the fixed slot of each packed row: expert e's j-th row goes to e·C + j; rows past
        # the last expert's segment (the unused tail) go to a scratch slot E·C
        rows = torch.arange(num_rows, device=offsets.device)
        expert = torch.searchsorted(offsets.to(torch.int64), rows, right=True)
        starts = offsets.to(torch.int64) - dispatch_counts.to(torch.int64)
        e = expert.clamp_max(E - 1)
        slot = e * capacity + rows - starts[e]
        self.slot = torch.where(expert < E, slot, torch.full_like(slot, E * capacity))
        self.local_offsets = torch.arange(
            1, self.E_local + 1, device=offsets.device, dtype=torch.int32
        ) * (W * capacity)

    def _to_slots(self, x: torch.Tensor) -> torch.Tensor:
        E_C = self.W * self.E_local * self.C
        out = x.new_zeros(E_C + 1, *x.shape[1:]).index_copy(0, self.slot, x)
        return out[:E_C]

    def _swap(self, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """[a, b, C, ...] → [b, a, C, ...] (flattened rows)."""
        return x.view(a, b, self.C, *x.shape[1:]).transpose(0, 1).reshape(x.shape)

    def send(self, rows: torch.Tensor, probs: torch.Tensor) -> tuple:
        """(rows, probs, offsets) on the expert owner, grouped by local expert: expert i's
        block holds ``W·C`` rows, C from each rank in rank order."""
        W, El = self.W, self.E_local
        rows = _AllToAll.apply(self._to_slots(rows), None, None, self.group)
        probs = _AllToAll.apply(self._to_slots(probs.unsqueeze(1)), None, None, self.group)
        rows = self._swap(rows, W, El)  # [rank][expert] → [expert][rank]
        probs = self._swap(probs, W, El).squeeze(1)
        return rows, probs, self.local_offsets

    def receive(self, out: torch.Tensor) -> torch.Tensor:
        """Expert outputs back to their ranks, in the packed row order of the dispatch."""
        out = _AllToAll.apply(self._swap(out, self.E_local, self.W), None, None, self.group)
        return out.index_select(0, self.slot.clamp_max(out.shape[0] - 1))


def check_same_tokens(
    num_tokens: int, device: torch.device, group: dist.ProcessGroup, *, on_host: bool = True
) -> None:
    """Check that every rank of ``group`` passes ``num_tokens`` (the capacity exchange's static
    sizes need equal token counts): one all-reduce. ``on_host`` reads its result (one host
    sync) and raises ValueError; otherwise a device-side assert fails the next
    synchronisation instead (no host sync). Ranks must call it on the same calls, in either
    mode, for the collectives to match."""
    # [T, -T] built by fills on the device: a host list would be a copy that synchronises
    # (and cannot be captured in a CUDA graph)
    t = torch.full((2,), num_tokens, device=device, dtype=torch.int64)
    t[1:].neg_()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if not on_host:
        torch._assert_async(t[0] == -t[1], "MoELayer: token counts differ across ep_group ranks")
        return
    lo, hi = -int(t[1]), int(t[0])
    if lo != hi:
        raise ValueError(
            f"MoELayer with ep_group and capacity_factor needs the same number of tokens on "
            f"every rank; this rank has {num_tokens}, the ranks range from {lo} to {hi}"
        )
