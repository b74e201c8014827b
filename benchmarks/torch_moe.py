"""The torch-native MoE layer that moekit is compared with: what a user writes today around
``torch._grouped_mm`` (no moekit import anywhere in this file).

router: ``F.linear`` logits → softmax / sigmoid → (bias, group limit) → ``topk`` → gather and
normalise; dispatch: ``argsort`` of the expert ids + ``index_select``; experts:
``torch._grouped_mm`` fc1 → SwiGLU scaled by the probs → ``torch._grouped_mm`` fc2; combine:
``index_add_``. Counts come from an ``index_add_`` (``torch.bincount`` would read the largest id
back to the host). On CPU, and for dtypes other than bf16, the grouped GEMMs become a
per-expert loop. The expert-parallel form exchanges rows with ``all_to_all_single`` (host split sizes) and regroups them by local expert
with a second argsort.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def torch_topk_routing(
    logits: torch.Tensor,  # [T, E]
    k: int,
    score: str = "softmax",
    expert_bias: torch.Tensor | None = None,
    num_groups: int | None = None,
    topk_groups: int | None = None,
    normalize: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs [T, k] fp32, indices [T, k] int64, counts [E] int32, scores [T, E] fp32)."""
    s = logits.float().softmax(-1) if score == "softmax" else logits.float().sigmoid()
    sel = s.detach() if expert_bias is None else s.detach() + expert_bias
    T, E = s.shape
    if num_groups is not None:
        group_score = sel.view(T, num_groups, -1).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_groups, dim=-1).indices, True)
        sel = sel.masked_fill(~keep.repeat_interleave(E // num_groups, dim=1), float("-inf"))
    idx = sel.topk(k, dim=-1).indices
    p = s.gather(1, idx)
    if normalize:
        p = p / (p.sum(-1, keepdim=True) + (1e-20 if score == "sigmoid" else 0.0))
    flat = idx.flatten()
    counts = torch.zeros(E, dtype=torch.int32, device=logits.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return p * scaling, idx, counts, s


def torch_grouped_swiglu(x, offsets, w1, w2, probs):
    """Expert MLP over rows grouped by expert: fc1 (``w1 [E, 2F, H]``, [gate | up]), SwiGLU
    scaled by ``probs [R]``, fc2 (``w2 [E, H, F]``); ``offsets [E]`` cumulative row ends."""
    grouped = x.is_cuda and x.dtype == torch.bfloat16  # torch._grouped_mm's dtype
    if grouped:
        h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets)
    else:
        ends = offsets.tolist()
        bounds = list(zip([0, *ends], ends))
        h = torch.cat([x[a:b] @ w1[e].t() for e, (a, b) in enumerate(bounds)])
    gate, up = h.chunk(2, dim=-1)
    a = (F.silu(gate.float()) * up.float() * probs[:, None]).to(x.dtype)
    if grouped:
        return torch._grouped_mm(a, w2.transpose(-2, -1), offs=offsets)
    return torch.cat([a[s:e] @ w2[i].t() for i, (s, e) in enumerate(bounds)])


def torch_permute(x, idx, probs, E: int, counts=None):
    """Argsort dispatch: (rows [T·k, H] grouped by expert, offsets [E] int32, their probs
    [T·k], token [T·k] int64: each row's source token)."""
    k = idx.shape[1]
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    if counts is None:
        counts = torch.zeros(E, dtype=torch.int32, device=x.device)
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)
    token = order // k
    return x.index_select(0, token), offsets, probs.flatten()[order], token


def torch_unpermute(y, token, tokens: int):
    """``index_add_`` combine: the rows of each token summed back into [tokens, H]."""
    return y.new_zeros(tokens, y.shape[1]).index_add_(0, token, y)


def torch_moe_block(x, idx, probs, w1, w2, E: int, counts=None):
    """:func:`torch_permute` → :func:`torch_grouped_swiglu` → :func:`torch_unpermute`."""
    rows, offsets, row_probs, token = torch_permute(x, idx, probs, E, counts)
    y = torch_grouped_swiglu(rows, offsets, w1, w2, row_probs)
    return torch_unpermute(y.to(x.dtype), token, x.shape[0])


def _aux_loss(scores, counts, k: int, coeff: float) -> torch.Tensor:
    """Switch load-balancing loss on the normalised scores, times ``coeff``."""
    T, E = scores.shape
    s = scores / scores.sum(-1, keepdim=True).clamp_min(1e-20)
    return coeff * E / (k * T * T) * (counts.float() * s.sum(0)).sum()


def torch_moe(x, router_weight, w1, w2, k: int, aux_loss_coeff: float = 0.0, **route_kwargs):
    """The whole layer over ``x [T, H]``: (y [T, H], aux loss scalar or None)."""
    logits = F.linear(x, router_weight)
    probs, idx, counts, s = torch_topk_routing(logits, k, **route_kwargs)
    y = torch_moe_block(x, idx, probs, w1, w2, router_weight.shape[0], counts)
    aux = _aux_loss(s, counts, k, aux_loss_coeff) if aux_loss_coeff > 0 else None
    return y, aux


def loop_moe(x, router_weight, w1, w2, k: int, aux_loss_coeff: float = 0.0, **route_kwargs):
    """The same layer with a Python loop over experts (``nonzero`` per expert: a host sync
    each), the way simple model code runs its experts."""
    logits = F.linear(x, router_weight)
    probs, idx, counts, s = torch_topk_routing(logits, k, **route_kwargs)
    y = torch.zeros_like(x)
    for e in range(router_weight.shape[0]):
        t, j = torch.nonzero(idx == e, as_tuple=True)
        if t.numel():
            gate, up = F.linear(x[t], w1[e]).chunk(2, dim=-1)
            h = (F.silu(gate) * up * probs[t, j, None].to(x.dtype)).to(x.dtype)
            y.index_add_(0, t, F.linear(h, w2[e]))
    aux = _aux_loss(s, counts, k, aux_loss_coeff) if aux_loss_coeff > 0 else None
    return y, aux


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.args = (in_splits, out_splits, group)
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, *ctx.args), None, None, None


def torch_ep_moe(x, router_weight, w1, w2, k: int, group, aux_loss_coeff=0.0, **route_kwargs):
    """Expert-parallel torch-native layer: this rank holds ``w1, w2`` of experts
    ``[r·E/W, (r+1)·E/W)``; rows go to their experts' ranks with ``all_to_all_single``."""
    E = router_weight.shape[0]
    W = group.size()
    El = E // W
    logits = F.linear(x, router_weight)
    probs, idx, counts, s = torch_topk_routing(logits, k, **route_kwargs)
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    token = order // k
    rows, p = x.index_select(0, token), probs.flatten()[order]
    send = counts.view(W, El).to(torch.int64)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()  # host sync
    rows = _AllToAll.apply(rows, recv_splits, send_splits, group)
    p = _AllToAll.apply(p[:, None], recv_splits, send_splits, group)[:, 0]
    # regroup [rank][expert] → [expert][rank]: a stable argsort of each row's local expert
    local = torch.arange(El, device=x.device).repeat(W)
    expert_of_row = local.repeat_interleave(recv.flatten(), output_size=sum(recv_splits))
    regroup = torch.argsort(expert_of_row, stable=True)
    offsets = recv.sum(0).cumsum(0).to(torch.int32)
    out = torch_grouped_swiglu(rows[regroup], offsets, w1, w2, p[regroup])
    back = torch.empty_like(out).index_copy(0, regroup, out)
    back = _AllToAll.apply(back, send_splits, recv_splits, group)
    y = torch.zeros_like(x).index_add_(0, token, back.to(x.dtype))
    aux = _aux_loss(s, counts, k, aux_loss_coeff) if aux_loss_coeff > 0 else None
    return y, aux


class _WithLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, loss):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), device=grad.device)


def with_loss(y: torch.Tensor, loss: torch.Tensor | None) -> torch.Tensor:
    """``y`` with ``loss`` back-propagated alongside it (gradient 1), Megatron-style."""
    return y if loss is None else _WithLoss.apply(y, loss)
