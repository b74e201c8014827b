"""Router losses and attach_loss vs their definitions, with gradients."""

from __future__ import annotations

import pytest
import torch

from moekit.ops import load_balancing_loss, router_z_loss
from moekit.ops.router_losses import attach_loss


def _lb_by_loops(scores, indices):
    T, E = scores.shape
    k = indices.shape[1]
    total = 0.0
    for e in range(E):
        count = int((indices == e).sum())
        total += count * float(scores[:, e].sum())
    return E / (k * T * T) * total


def test_load_balancing_loss_matches_definition_and_is_one_when_balanced():
    scores = torch.rand(13, 6, dtype=torch.float64).softmax(-1).requires_grad_()
    idx = torch.randint(0, 6, (13, 2))
    loss = load_balancing_loss(scores, idx)
    assert abs(float(loss) - _lb_by_loops(scores.detach(), idx)) < 1e-6
    (g,) = torch.autograd.grad(loss, scores)
    counts = torch.bincount(idx.flatten(), minlength=6).double()
    torch.testing.assert_close(g.double(), (6 / (2 * 13 * 13) * counts).expand(13, 6))
    T, E = 8, 4
    even = torch.full((T, E), 1.0 / E)
    idx = torch.tensor([[e % E, (e + 1) % E] for e in range(T)])
    assert abs(float(load_balancing_loss(even, idx)) - 1.0) < 1e-6


def test_router_z_loss_matches_definition():
    logits = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    ref = torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(router_z_loss(logits).double(), ref)
    assert torch.autograd.gradcheck(lambda x: router_z_loss(x).double(), (logits,))


def test_losses_of_an_empty_batch_are_zero():
    assert float(load_balancing_loss(torch.rand(0, 4), torch.zeros(0, 2, dtype=torch.long))) == 0
    assert float(router_z_loss(torch.randn(0, 4))) == 0


@pytest.mark.parametrize(
    "scores, indices, match",
    [
        (torch.rand(4), torch.zeros(4, 2, dtype=torch.long), "scores must be 2-D"),
        (torch.rand(4, 3), torch.zeros(5, 2, dtype=torch.long), r"indices.shape\[0\] must equal"),
        (torch.rand(4, 3), torch.zeros(4, 2), "indices must have dtype"),
    ],
)
def test_load_balancing_loss_bad_input(scores, indices, match):
    with pytest.raises((TypeError, ValueError), match=match):
        load_balancing_loss(scores, indices)


def test_attach_loss_backpropagates_the_loss_once():
    w = torch.tensor(3.0, requires_grad=True)
    x = torch.randn(4, requires_grad=True)
    out = attach_loss(x * 2, w * w)
    out.sum().backward()
    assert float(w.grad) == 6.0  # d(w²)/dw, with the loss never added by the caller
    torch.testing.assert_close(x.grad, torch.full((4,), 2.0))
    with torch.no_grad():
        y = torch.randn(3)
        assert attach_loss(y, w * w) is y
