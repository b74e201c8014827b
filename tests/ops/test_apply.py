import pytest
import torch

from moekit.ops._apply import direct_apply


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k: float):
        ctx.k = k
        return x * k

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


class _WithSetupContext(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g


def test_direct_apply_matches_apply_forward_and_backward():
    x = torch.randn(5, 3, requires_grad=True)
    y = direct_apply(_Scale)(x, 2.5)
    assert y.grad_fn is not None and type(y.grad_fn).__name__ == "_ScaleBackward"
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(y, x.detach() * 2.5)
    torch.testing.assert_close(g, torch.full_like(x, 2.5))


def test_direct_apply_takes_the_normal_path_under_functorch():
    # Under a functorch transform the normal Function.apply runs, which refuses a Function
    # without setup_context: proof that the transform did not reach the C++ apply directly.
    scale = direct_apply(_Scale)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: scale(t, 2.0).sum())(torch.randn(3))


def test_direct_apply_refuses_setup_context_functions():
    with pytest.raises(TypeError, match="setup_context"):
        direct_apply(_WithSetupContext)
