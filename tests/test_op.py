"""The op base (moekit.runtime.op): the eager shortcuts give what the normal
path gives, and every op's shortcut path matches its dispatcher path (values and gradients)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from moekit.ops import grouped_linear, grouped_mlp, grouped_mm
from moekit.runtime.eager import owned_gradient
from moekit.runtime.op import dispatcher_only, function_apply, kernel_op


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


_calls: list[str] = []


@kernel_op("test_twice", fake=lambda x: torch.empty_like(x))
def _twice(x: torch.Tensor) -> torch.Tensor:
    _calls.append("impl")
    return x * 2


def test_function_apply_matches_apply_forward_and_backward():
    x = torch.randn(5, 3, requires_grad=True)
    y = function_apply(_Scale)(x, 2.5)
    assert y.grad_fn is not None and type(y.grad_fn).__name__ == "_ScaleBackward"
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(y, x.detach() * 2.5)
    torch.testing.assert_close(g, torch.full_like(x, 2.5))


def test_function_apply_takes_the_normal_path_under_functorch():
    # Under a functorch transform the normal Function.apply runs, which refuses a Function
    # without setup_context: proof that the transform did not reach the C++ apply directly.
    scale = function_apply(_Scale)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: scale(t, 2.0).sum())(torch.randn(3))


def test_function_apply_refuses_setup_context_functions():
    with pytest.raises(TypeError, match="setup_context"):
        function_apply(_WithSetupContext)


def test_kernel_op_is_a_custom_op_with_a_fake_implementation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(4)
    torch.testing.assert_close(_twice(x), x * 2)
    assert torch.ops.moekit.test_twice.default is not None
    with FakeTensorMode():  # a dispatch mode: the custom op (and its fake) runs, not impl
        _calls.clear()
        out = _twice(torch.empty(7))
        assert out.shape == (7,) and _calls == []
    with dispatcher_only():  # the normal path still reaches the implementation
        _calls.clear()
        torch.testing.assert_close(_twice(x), x * 2)
        assert _calls == ["impl"]


def _offsets(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def _grads(fn, inputs):
    out = fn(*inputs)
    dy = torch.randn_like(out)
    return (out, *torch.autograd.grad(out, inputs, dy)), dy


def _both_paths(fn, inputs):
    torch.manual_seed(0)
    eager, _ = _grads(fn, inputs)
    torch.manual_seed(0)
    with dispatcher_only():
        normal, _ = _grads(fn, inputs)
    for a, b in zip(eager, normal):
        torch.testing.assert_close(a, b)


def test_every_op_matches_its_dispatcher_path():
    # Each public op through the eager shortcuts and through the dispatcher, same results
    # (on CPU: the reference path, or the kernels in the interpreter under TRITON_INTERPRET=1).
    counts = [5, 0, 11]
    off = _offsets(counts)
    T, E, K, N = sum(counts), len(counts), 16, 24
    a = torch.randn(T, K, requires_grad=True)
    b = torch.randn(E, K, N, requires_grad=True)
    _both_paths(lambda a, b: grouped_mm(a, b, off), (a, b))
    dy = torch.randn(T, N, requires_grad=True)
    _both_paths(lambda d, a: grouped_mm(d.t(), a, off), (dy, a))
    w = torch.randn(E, N, K, requires_grad=True)
    _both_paths(lambda x, w: grouped_linear(x, w, off), (a, w))
    w1 = torch.randn(E, 2 * 16, K, requires_grad=True)
    w2 = torch.randn(E, K, 16, requires_grad=True)
    p = torch.rand(T, requires_grad=True)
    _both_paths(lambda x, w1, w2, p: grouped_mlp(x, off, w1, w2, p), (a, w1, w2, p))


class _Probe(torch.autograd.Function):
    """Notes whether the gradient its backward receives is owned by nothing else."""

    seen: ClassVar[list[bool]] = []

    @staticmethod
    def forward(ctx, t):
        return t * 2

    @staticmethod
    def backward(ctx, g):
        _Probe.seen.append(owned_gradient(g))
        return g * 2


def _fresh(y, w):
    (y * w).sum().backward()


def _hook_returns_new(y, w):
    y.register_hook(lambda g: g * 1)
    (y * w).sum().backward()


def _hook_keeps(y, w):
    kept = []
    y.register_hook(kept.append)
    (y * w).sum().backward()


def _shared_with_leaf(y, w):
    (y + w).backward(torch.ones_like(w))


def _callers_tensor(y, w):
    y.backward(w.detach())


def _post_hook(y, w):
    y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: None)
    (y * w).sum().backward()


def _expanded(y, w):
    y.sum().backward()


OWNERSHIP_CASES = {
    _fresh: True,
    _hook_returns_new: True,
    _hook_keeps: False,
    _shared_with_leaf: False,
    _callers_tensor: False,
    _post_hook: False,
    _expanded: False,
}


@pytest.mark.parametrize("run", list(OWNERSHIP_CASES), ids=lambda f: f.__name__)
def test_owned_gradient_only_when_nothing_else_holds_it(run):
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    _Probe.seen.clear()
    run(_Probe.apply(x), w)
    assert _Probe.seen == [OWNERSHIP_CASES[run]]


def _double_backward_cases():
    from moekit.ops import add_rmsnorm, permute, topk_routing, unpermute

    g = torch.Generator().manual_seed(0)
    T, E, H, F = 6, 3, 8, 4
    offsets = torch.tensor([2, 2, 6], dtype=torch.int32)
    idx = torch.tensor([[0, 2], [1, 2], [0, 1], [2, 0], [1, 0], [2, 1]])
    probs = torch.rand(T, 2, generator=g)

    def leaf(*shape):
        return torch.randn(*shape, generator=g).requires_grad_()

    def mm():
        a, b = leaf(T, H), leaf(E, H, F)
        return grouped_mm(a, b, offsets), (a, b)

    def wgrad():
        a, b = leaf(H, T), leaf(T, F)
        return grouped_mm(a, b, offsets), (a, b)

    def mlp():
        x, w1, w2, p = leaf(T, H), leaf(E, 2 * F, H), leaf(E, H, F), leaf(T)
        return grouped_mlp(x, offsets, w1, w2, p), (x, w1, w2, p)

    def linear():
        x, w = leaf(T, H), leaf(E, F, H)
        return grouped_linear(x, w, offsets), (x, w)

    def norm():
        x, r, w = leaf(T, H), leaf(T, H), leaf(H)
        return add_rmsnorm(x, r, w)[0], (x, r, w)

    def perm():
        x, p = leaf(T, H), probs.clone().requires_grad_()
        d = permute(x, indices=idx, probs=p, num_experts=E)
        return d.hidden, (x,)

    def unperm():
        y = leaf(T * 2, H)
        d = permute(torch.randn(T, H, generator=g), indices=idx, probs=probs, num_experts=E)
        return unpermute(y, d, weighted=False), (y,)

    def route():
        logits = leaf(T, E)
        return topk_routing(logits, 2)[0], (logits,)

    return {
        "grouped_mm": mm, "grouped_mm_wgrad": wgrad, "grouped_mlp": mlp,
        "grouped_linear": linear, "add_rmsnorm": norm, "permute": perm, "unpermute": unperm,
        "topk_routing": route,
    }  # fmt: skip


@pytest.mark.parametrize("op", list(_double_backward_cases()))
def test_double_backward_raises_instead_of_missing_terms(op):
    """Backward kernels are not differentiable: create_graph=True raises (naming the op), never
    returns a gradient whose own gradient silently lacks their terms; a plain backward works."""
    out, leaves = _double_backward_cases()[op]()
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.square().sum(), leaves, create_graph=True)
    out, leaves = _double_backward_cases()[op]()
    grads = torch.autograd.grad(out.square().sum(), leaves)
    assert all(gr is not None and torch.isfinite(gr).all() for gr in grads)
