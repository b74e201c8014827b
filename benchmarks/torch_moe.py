"""The torch-native MoE layer that moekit is compared with: what a user writes today around
``torch._grouped_mm`` (no moekit import anywhere in this file).

router: ``F.linear`` → softmax / sigmoid → (bias, group limit) → ``topk``; dispatch:
``argsort`` + ``index_select``; experts: ``torch._grouped_mm`` (a loop on CPU or off bf16);
combine: ``index_add_`` (counts too: ``bincount`` would sync). EP: ``all_to_all_single``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def torch_topk_routing(logits: torch.Tensor, k: int, score: str = "softmax",
                       expert_bias: torch.Tensor | None = None, num_groups: int | None = None,
                       topk_groups: int | None = None, normalize: bool = True,
                       scaling: float = 1.0):  # fmt: skip
    """Of logits [T, E]: (probs [T, k] fp32, indices [T, k], counts [E] int32, scores [T, E])."""
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
    return p * scaling, idx, _counts(idx, E), s


def _counts(idx: torch.Tensor, E: int) -> torch.Tensor:
    flat = idx.flatten()
    counts = torch.zeros(E, dtype=torch.int32, device=idx.device)
    return counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))


def torch_grouped_swiglu(x, offsets, w1, w2, probs):
    """Expert MLP over rows grouped by expert: fc1 (``w1 [E, 2F, H]``, [gate | up]), SwiGLU
    scaled by ``probs [R]``, fc2 (``w2 [E, H, F]``); ``offsets [E]`` cumulative row ends."""
    if x.is_cuda and x.dtype == torch.bfloat16:  # torch._grouped_mm's dtype
        mm = lambda a, w: torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)
    else:
        ends = offsets.tolist()
        bounds = list(zip([0, *ends], ends))
        mm = lambda a, w: torch.cat([a[s:e] @ w[i].t() for i, (s, e) in enumerate(bounds)])
    gate, up = mm(x, w1).chunk(2, dim=-1)
    return mm((F.silu(gate.float()) * up.float() * probs[:, None]).to(x.dtype), w2)


def torch_permute(x, idx, probs, E: int, counts=None):
    """Argsort dispatch: (rows [T·k, H] by expert, offsets [E] int32, row probs, source token)."""
    order = torch.argsort(idx.flatten(), stable=True)
    offsets = (_counts(idx, E) if counts is None else counts).cumsum(0, dtype=torch.int32)
    token = order // idx.shape[1]
    return x.index_select(0, token), offsets, probs.flatten()[order], token


def torch_unpermute(y, token, tokens: int):
    """``index_add_`` combine: the rows of each token summed back into [tokens, H]."""
    return y.new_zeros(tokens, y.shape[1]).index_add_(0, token, y)


def torch_moe_block(x, idx, probs, w1, w2, E: int, counts=None):
    """:func:`torch_permute` → :func:`torch_grouped_swiglu` → :func:`torch_unpermute`."""
    rows, offsets, row_probs, token = torch_permute(x, idx, probs, E, counts)
    y = torch_grouped_swiglu(rows, offsets, w1, w2, row_probs)
    return torch_unpermute(y.to(x.dtype), token, x.shape[0])


def _route(x, router_weight, k: int, coeff: float, route_kwargs: dict):
    """The router: (probs, indices, counts, Switch load-balancing loss × ``coeff`` or None)."""
    probs, idx, counts, s = torch_topk_routing(F.linear(x, router_weight), k, **route_kwargs)
    T, E = s.shape
    s = s / s.sum(-1, keepdim=True).clamp_min(1e-20)
    aux = coeff * E / (k * T * T) * (counts.float() * s.sum(0)).sum() if coeff > 0 else None
    return probs, idx, counts, aux


def torch_moe(x, router_weight, w1, w2, k: int, aux_loss_coeff: float = 0.0, **route_kwargs):
    """The whole layer over ``x [T, H]``: (y [T, H], aux loss scalar or None)."""
    probs, idx, counts, aux = _route(x, router_weight, k, aux_loss_coeff, route_kwargs)
    return torch_moe_block(x, idx, probs, w1, w2, router_weight.shape[0], counts), aux


def loop_moe(x, router_weight, w1, w2, k: int, aux_loss_coeff: float = 0.0, **route_kwargs):
    """The same layer with a Python loop over experts (``nonzero`` per expert: a host sync
    each), the way simple model code runs its experts."""
    probs, idx, _, aux = _route(x, router_weight, k, aux_loss_coeff, route_kwargs)
    y = torch.zeros_like(x)
    for e in range(router_weight.shape[0]):
        t, j = torch.nonzero(idx == e, as_tuple=True)
        if t.numel():
            gate, up = F.linear(x[t], w1[e]).chunk(2, dim=-1)
            h = (F.silu(gate) * up * probs[t, j, None].to(x.dtype)).to(x.dtype)
            y.index_add_(0, t, F.linear(h, w2[e]))
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
    W, El = group.size(), router_weight.shape[0] // group.size()
    probs, idx, counts, aux = _route(x, router_weight, k, aux_loss_coeff, route_kwargs)
    order = torch.argsort(idx.flatten(), stable=True)
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
    return torch.zeros_like(x).index_add_(0, token, back.to(x.dtype)), aux


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
