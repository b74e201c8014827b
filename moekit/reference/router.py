"""Pure-PyTorch top-k routing: the oracle of ``moekit.ops.topk_routing`` and its CPU path.

Per token ``t`` (fp32 throughout)::

    s[t]    = softmax(logits[t]) or sigmoid(logits[t])          # scores [E]
    sel[t]  = s[t] + expert_bias                                 # selection only
    groups  (num_groups G): group g's score is the sum of its two highest sel; experts outside
            the topk_groups best groups are not eligible
    idx[t]  = the k eligible experts of highest sel, in descending order; ties go to the lower
            expert id; NaN counts as the lowest possible score
    p[t, j] = s[t, idx[t, j]]  (/ Σ_j s[t, idx[t, j]] with normalize; + 1e-20 for sigmoid)
              · scaling
"""

from __future__ import annotations

import torch

from moekit.kernels.router import LOWEST_SCORE, SIGMOID_EPS

__all__ = ["topk_routing_backward_ref", "topk_routing_ref"]


def _scores(logits: torch.Tensor, score: str) -> torch.Tensor:
    x = logits.float()
    return torch.softmax(x, dim=-1) if score == "softmax" else torch.sigmoid(x)


def _ranked(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim, ties to the lower index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def _selection(s, expert_bias, num_groups, topk_groups) -> torch.Tensor:
    sel = s if expert_bias is None else s + expert_bias.float()
    sel = torch.nan_to_num(sel, nan=LOWEST_SCORE).clamp_min(LOWEST_SCORE)
    if num_groups is None:
        return sel
    T, E = sel.shape
    grouped = sel.view(T, num_groups, E // num_groups)
    top2 = torch.sort(grouped, dim=-1, descending=True).values[..., :2]
    group_score = top2.sum(-1).clamp_min(LOWEST_SCORE)
    kept = torch.zeros(T, num_groups, dtype=torch.bool, device=sel.device)
    kept.scatter_(1, _ranked(group_score, topk_groups), True)
    eligible = kept.repeat_interleave(E // num_groups, dim=1)
    return torch.where(eligible, sel, torch.full_like(sel, LOWEST_SCORE))


def topk_routing_ref(
    logits: torch.Tensor,  # [T, E]
    k: int,
    score: str = "softmax",
    expert_bias: torch.Tensor | None = None,  # [E]
    num_groups: int | None = None,
    topk_groups: int | None = None,
    normalize: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, k] fp32, indices [T, k] int32); differentiable in ``logits``."""
    s = _scores(logits, score)
    with torch.no_grad():
        idx = _ranked(_selection(s, expert_bias, num_groups, topk_groups), k)
    p = s.gather(1, idx)
    if normalize:
        p = p / (p.sum(-1, keepdim=True) + (SIGMOID_EPS if score == "sigmoid" else 0.0))
    return p * scaling, idx.to(torch.int32)


def topk_routing_backward_ref(
    grad_probs: torch.Tensor,  # [T, k]
    logits: torch.Tensor,  # [T, E]
    indices: torch.Tensor,  # [T, k]
    score: str,
    normalize: bool,
    scaling: float,
) -> torch.Tensor:
    """d loss / d logits [T, E] (fp32) from d loss / d probs, written out analytically (the
    kernel's formula; tests check it against autograd of :func:`topk_routing_ref`).

    With q_j = s_j / S (S = Σ_j s_j, + eps for sigmoid): ds_j = c·g_j without normalize and
    (c / S)·(g_j − Σ_m g_m q_m) with it; softmax: dl = s·(ds − Σ s·ds), sigmoid:
    dl = ds·s·(1 − s); ds is zero at experts not selected."""
    s = _scores(logits, score)
    idx = indices.long()
    g = grad_probs.float()
    sk = s.gather(1, idx)
    if normalize:
        S = sk.sum(-1, keepdim=True) + (SIGMOID_EPS if score == "sigmoid" else 0.0)
        ds_k = scaling / S * (g - (g * sk / S).sum(-1, keepdim=True))
    else:
        ds_k = scaling * g
    ds = torch.zeros_like(s).scatter_add_(1, idx, ds_k)
    if score == "softmax":
        return s * (ds - (s * ds).sum(-1, keepdim=True))
    return ds * s * (1 - s)
