"""TopKRouter: routing and losses vs a plain-PyTorch composition, bias updates, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moekit.nn import TopKRouter
from moekit.ops import RouterConfig
from moekit.reference.router import topk_routing_ref


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_router_matches_composition(score):
    r = TopKRouter(32, 8, 2, RouterConfig(score=score, aux_loss_coeff=0.01, z_loss_coeff=0.001))
    x = torch.randn(20, 32, requires_grad=True)
    out = r(x)
    logits = F.linear(x, r.weight)
    p, i = topk_routing_ref(logits, 2, score)
    assert torch.equal(out.indices, i)
    torch.testing.assert_close(out.probs, p)
    assert torch.equal(out.counts, torch.bincount(i.flatten().long(), minlength=8).int())
    s = logits.float().softmax(-1) if score == "softmax" else logits.float().sigmoid()
    s = s / s.sum(-1, keepdim=True)
    counts = torch.bincount(i.flatten().long(), minlength=8).float()
    aux = 0.01 * 8 / (2 * 20 * 20) * (counts * s.sum(0)).sum()
    torch.testing.assert_close(out.aux_loss, aux)
    torch.testing.assert_close(out.z_loss, 0.001 * torch.logsumexp(logits, -1).square().mean())
    (out.probs.sum() + out.aux_loss + out.z_loss).backward()
    assert r.weight.grad is not None and x.grad is not None


def test_losses_off_by_default_and_expert_bias():
    r = TopKRouter(16, 4, 1, RouterConfig(expert_bias=True))
    out = r(torch.randn(6, 16))
    assert out.aux_loss is None and out.z_loss is None
    assert r.expert_bias.dtype == torch.float32 and torch.all(r.expert_bias == 0)
    r.update_expert_bias(torch.tensor([5, 1, 0, 2]), rate=0.5)  # mean 2
    assert r.expert_bias.tolist() == [-0.5, 0.5, 0.5, 0.0]
    r.expert_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
    assert torch.all(r(torch.randn(6, 16)).indices[:, 0] == 2)  # the bias steers selection


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(k=5), "k must be at most num_experts"),
        (dict(num_groups=3, topk_groups=1), "num_groups must divide"),
        (dict(score="tanh"), "score must be one of"),
        (dict(aux_loss_coeff=-1.0), "aux_loss_coeff must be"),
        (dict(hidden_size=0), "hidden_size must be a positive int"),
    ],
)
def test_bad_configuration(kwargs, match):
    args = dict(hidden_size=16, num_experts=4, k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        n, E, k = args.pop("hidden_size"), args.pop("num_experts"), args.pop("k")
        TopKRouter(n, E, k, RouterConfig(**args))


def test_hidden_size_mismatch_and_bias_update_without_bias():
    r = TopKRouter(16, 4, 2)
    with pytest.raises(ValueError, match=r"\[T, hidden_size = 16\]"):
        r(torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="expert_bias=True"):
        r.update_expert_bias(torch.zeros(4))
