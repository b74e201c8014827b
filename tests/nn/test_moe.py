"""MoELayer vs the per-expert-loop oracle (same weights), forward and backward, with shared
experts, capacity drops, alignment and group-limited sigmoid routing; the router's losses
reach the router without the caller adding them."""

from __future__ import annotations

import pytest
import torch

from moekit.nn import MoELayer
from moekit.reference.moe import moe_layer_ref

CONFIGS = [
    ("plain", dict()),
    ("shared_expert", dict(shared_ffn_hidden_size=16)),
    ("capacity_drops", dict(capacity_factor=0.6)),
    ("aligned", dict(align=8)),
    ("deepseek_like", dict(score="sigmoid", num_groups=4, topk_groups=2, scaling=2.0)),
    ("unnormalised_geglu", dict(normalize=False, activation="geglu")),
]


def _ref(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    sh = layer.shared
    r = layer.router
    return moe_layer_ref(
        x, r.weight, layer.experts.fc1_weight, layer.experts.fc2_weight, layer.k,
        activation=layer.experts.activation.name,
        route_kwargs=dict(r.route_kwargs, expert_bias=r.expert_bias),
        capacity_factor=layer.capacity_factor, align=layer.align,
        shared=None if sh is None else (sh.fc1.weight, sh.fc2.weight),
    )  # fmt: skip


@pytest.mark.parametrize("name, kwargs", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_matches_per_expert_loop(name, kwargs):
    torch.manual_seed(0)
    layer = MoELayer(32, 24, 8, 2, **kwargs)
    x = torch.randn(3, 7, 32, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape
    xr = x.detach().clone().requires_grad_()
    ref = _ref(layer, xr)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)
    g = torch.randn_like(y)
    params = [p for p in layer.parameters()]
    grads = torch.autograd.grad(y, [x, *params], g)
    ref_grads = torch.autograd.grad(ref, [xr, *params], g)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert int(layer.last_counts.sum()) == 3 * 7 * 2


def test_router_losses_train_the_router_without_being_added():
    torch.manual_seed(1)
    layer = MoELayer(16, 8, 4, 2, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    x = torch.randn(10, 16)
    y = layer(x)
    y.sum().backward()
    with_losses = layer.router.weight.grad.clone()
    layer.zero_grad()
    plain = MoELayer(16, 8, 4, 2)
    plain.load_state_dict(layer.state_dict())
    plain(x).sum().backward()
    out = layer.router(x)
    (extra,) = torch.autograd.grad(out.aux_loss + out.z_loss, layer.router.weight)
    torch.testing.assert_close(with_losses, plain.router.weight.grad + extra)


def test_expert_bias_update_from_last_counts():
    layer = MoELayer(16, 8, 4, 1, expert_bias=True)
    layer(torch.randn(12, 16))
    layer.router.update_expert_bias(layer.last_counts, rate=0.1)
    assert layer.router.expert_bias.abs().max() > 0


def test_bad_input():
    layer = MoELayer(16, 8, 4, 2)
    with pytest.raises(ValueError, match=r"hidden_size = 16"):
        layer(torch.randn(5, 12))
    with pytest.raises(ValueError, match="k must be at most num_experts"):
        MoELayer(16, 8, 4, 5)
    with pytest.raises(ValueError, match="num_groups must divide"):
        MoELayer(16, 8, 6, 2, num_groups=4, topk_groups=1)
