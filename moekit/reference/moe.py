"""A Mixture-of-Experts FFN block as a per-expert loop in plain PyTorch (fp32): the oracle of
``moekit.nn.MoELayer``. It routes with :func:`moekit.reference.router.topk_routing_ref` and
applies capacity drops the way ``moekit.ops.permute`` does (per expert, the highest probs kept,
ties to the earlier token)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moekit.activations import apply_activation, resolve_activation
from moekit.reference.router import topk_routing_ref

__all__ = ["moe_layer_ref"]


def _capacity_keep(probs, idx, num_experts, capacity_factor, align) -> torch.Tensor:
    T, k = idx.shape
    cap = math.ceil(capacity_factor * T * k / num_experts)
    cap = -(-cap // (align or 1)) * (align or 1)
    keep = torch.zeros_like(idx, dtype=torch.bool)
    for e in range(num_experts):
        t, s = torch.nonzero(idx == e, as_tuple=True)
        order = torch.sort(probs[t, s], descending=True, stable=True).indices[:cap]
        keep[t[order], s[order]] = True
    return keep


def moe_layer_ref(
    x: torch.Tensor,  # [..., H]
    router_weight: torch.Tensor,  # [E, H]
    w1: torch.Tensor,  # [E, 2F or F, H]
    w2: torch.Tensor,  # [E, H, F]
    k: int,
    *,
    activation: str = "swiglu",
    route_kwargs: dict | None = None,  # topk_routing's keyword arguments
    capacity_factor: float | None = None,
    align: int | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,  # (fc1 [2F', H], fc2 [H, F'])
    logits: torch.Tensor | None = None,  # [T, E]: route with these (default: fp32 x @ W^T)
) -> torch.Tensor:  # x's shape, fp32
    kw = dict(route_kwargs or {})
    H = x.shape[-1]
    tokens = x.reshape(-1, H).float()
    if logits is None:
        logits = F.linear(tokens, router_weight.float())
    probs, idx = topk_routing_ref(logits, k, **kw)
    E = router_weight.shape[0]
    keep = torch.ones_like(idx, dtype=torch.bool)
    if capacity_factor is not None:
        keep = _capacity_keep(probs, idx, E, capacity_factor, align)
    act = resolve_activation(activation)
    out = torch.zeros_like(tokens)
    for e in range(E):
        t, s = torch.nonzero((idx == e) & keep, as_tuple=True)
        if t.numel():
            h = apply_activation(tokens[t] @ w1[e].float().t(), act, None) * probs[t, s, None]
            out.index_add_(0, t, h @ w2[e].float().t())
    if shared is not None:
        fc1, fc2 = shared
        out = out + apply_activation(tokens @ fc1.float().t(), act, None) @ fc2.float().t()
    return out.view(x.shape)
