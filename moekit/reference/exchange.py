"""Pure-PyTorch oracle of the expert-parallel token exchange (``moekit.ops.expert_exchange``),
over every rank's tensors at once.

W ranks, E = W·E_local experts, rank r holding experts ``[r·E_local, (r+1)·E_local)``. A token
goes once to every rank that holds at least one of its k experts; owner r receives the tokens
of source 0, then source 1, …, each source's in ascending token order, with the token's ids made
local (``id − r·E_local``, −1 for experts elsewhere or dropped slots) and its probs (0 where the
id is −1). The combine returns to each token the sum of what its owners computed for it.
"""

from __future__ import annotations

import torch

__all__ = ["combine_ref", "dispatch_ref", "token_destinations"]


def token_destinations(
    indices: torch.Tensor,  # [T, k] global expert ids; < 0 = dropped slot
    experts_local: int,
    world: int,
) -> torch.Tensor:  # [T, W] bool
    """Whether token t has a slot on rank d."""
    dest = torch.where(indices >= 0, indices.long() // experts_local, -1)
    return (dest[:, :, None] == torch.arange(world, device=indices.device)).any(dim=1)


def dispatch_ref(
    xs: list[torch.Tensor],  # per rank [T_s, H]
    indices: list[torch.Tensor],  # per rank [T_s, k]
    probs: list[torch.Tensor],  # per rank [T_s, k]
    experts_local: int,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per owner r: (tokens [N_r, H], local ids [N_r, k] int32, probs [N_r, k] fp32)."""
    W = len(xs)
    out = []
    for r in range(W):
        rows, ids, ps = [], [], []
        lo = r * experts_local
        for s in range(W):
            sent = token_destinations(indices[s], experts_local, W)[:, r]
            idx = indices[s][sent].long()
            local = (idx >= lo) & (idx < lo + experts_local)
            rows.append(xs[s][sent])
            ids.append(torch.where(local, idx - lo, -1).to(torch.int32))
            ps.append(torch.where(local, probs[s][sent].float(), 0.0))
        out.append((torch.cat(rows), torch.cat(ids), torch.cat(ps)))
    return out


def combine_ref(
    parts: list[torch.Tensor],  # per owner r: [N_r, H] in the order dispatch_ref received
    indices: list[torch.Tensor],  # per rank [T_s, k]
    experts_local: int,
) -> list[torch.Tensor]:
    """Per source s: [T_s, H], token t's rows from its owners summed in fp32 in rank order."""
    W = len(parts)
    dests = [token_destinations(i, experts_local, W) for i in indices]
    outs = []
    for s in range(W):
        acc = torch.zeros(indices[s].shape[0], parts[0].shape[1], dtype=torch.float32)
        for d in range(W):
            # owner d's rows from source s follow those of sources 0 … s-1
            start = sum(int(dests[q][:, d].sum()) for q in range(s))
            sent = dests[s][:, d]
            block = parts[d][start : start + int(sent.sum())].float()
            acc[sent] += block
        outs.append(acc.to(parts[0].dtype))
    return outs
