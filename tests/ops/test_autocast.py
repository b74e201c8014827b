"""moekit's GEMM ops and MoELayer under ``torch.autocast``: fp32 inputs and weights run in the
region's dtype, as ``F.linear`` does, with the same values and gradients as the same call made
outside the region on tensors cast beforehand; the fp32 weights get fp32 gradients.

CPU: float16 regions (Triton's interpreter refuses bf16 GEMMs). GPU: bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from moekit.config import interpret_mode
from moekit.nn import MoELayer
from moekit.ops import RouterConfig, grouped_linear, grouped_mlp, grouped_mm


def _case(device: str, R=24, E=3, H=16, F=8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(R, H, generator=g)
    w1 = torch.randn(E, 2 * F, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, F, generator=g) * F**-0.5
    b = torch.randn(E, 2 * F, generator=g)
    probs = torch.rand(R, generator=g)
    offsets = torch.tensor([5, 5, R - 3], dtype=torch.int32)  # an empty expert, a tail
    leaves = [t.to(device).requires_grad_() for t in (x, w1, w2, b, probs)]
    return (*leaves, offsets.to(device))


def _calls(x, w1, w2, b, probs, offsets):
    """Each op on these tensors (every output depends on x, w1 and, where used, w2/b)."""
    return {
        "grouped_mm_ragged_m": lambda: grouped_mm(x, w1.transpose(1, 2), offsets, bias=b),
        "grouped_mm_ragged_k": lambda: grouped_mm(x.t(), x, offsets),
        "grouped_linear": lambda: grouped_linear(x, w1, offsets, b),
        "grouped_mlp": lambda: grouped_mlp(x, offsets, w1, w2, probs),
    }


def _check_ops(device: str, dtype: torch.dtype, tol: float) -> None:
    leaves = _case(device)
    x, w1, w2, b, probs, offsets = leaves
    for name in _calls(*leaves):
        with torch.autocast(device, dtype=dtype):
            got = _calls(*leaves)[name]()
        assert got.dtype == dtype, name
        g = torch.randn(got.shape, device=device).to(dtype)
        got_grads = torch.autograd.grad(got, (x, w1), g, allow_unused=True)
        # the same call outside the region, on tensors cast beforehand
        cast = [t.to(dtype) for t in (x, w1, w2, b)] + [probs, offsets]
        want = _calls(*cast)[name]()
        want_grads = torch.autograd.grad(want, cast[:2], g, allow_unused=True)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
        for got_g, want_g, leaf in zip(got_grads, want_grads, (x, w1)):
            if want_g is None:  # w1 in the ragged-K form
                assert got_g is None, name
                continue
            assert got_g.dtype == leaf.dtype == torch.float32, name
            torch.testing.assert_close(got_g, want_g.float(), rtol=tol, atol=tol, msg=name)


def test_ops_run_in_the_autocast_dtype():
    _check_ops("cpu", torch.float16, 1e-3)


def test_weights_already_in_the_autocast_dtype_keep_main_grad():
    x, w1, *_, offsets = _case("cpu")
    w = w1.detach().half().requires_grad_()
    w.main_grad = torch.zeros(w.shape)
    with torch.autocast("cpu", dtype=torch.float16):
        y = grouped_linear(x, w, offsets, None, w.main_grad)
    y.float().sum().backward()
    assert w.grad is None and w.main_grad.abs().sum() > 0


def _check_layer(device: str, dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    kw = dict(router=RouterConfig(aux_loss_coeff=0.1), shared_expert_ffn_size=8, device=device)
    layer = MoELayer(16, 8, 4, 2, **kw)
    low = MoELayer(16, 8, 4, 2, **kw).to(dtype)
    low.load_state_dict(layer.state_dict())
    x = torch.randn(2, 9, 16, device=device)
    g = torch.randn(2, 9, 16, device=device).to(dtype)
    xa, xb = x.clone().requires_grad_(), x.to(dtype).requires_grad_()
    with torch.autocast(device, dtype=dtype):
        y = layer(xa)
    assert y.dtype == dtype and layer.experts.fc1_weight.dtype == torch.float32
    y.backward(g)
    want = low(xb)
    want.backward(g)
    torch.testing.assert_close(y, want, rtol=tol, atol=tol)
    torch.testing.assert_close(xa.grad, xb.grad.float(), rtol=tol, atol=tol)
    for (name, p), q in zip(layer.named_parameters(), low.parameters()):
        assert p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, q.grad.float(), rtol=tol, atol=tol, msg=name)


def test_moe_layer_under_autocast():
    _check_layer("cpu", torch.float16, 2e-3)


def _check_fused_mlp_weight_grads(device: str, dtype: torch.dtype) -> None:
    """The fused grouped MLP writes fp32 weights' gradients in fp32 itself (not in the
    region's dtype, cast by autograd): values a half-precision gradient cannot hold, equal to
    the same call on pre-cast weights within that dtype's rounding."""
    x, w1, w2, _, probs, offsets = _case(device, R=40, H=32, F=16)
    with torch.autocast(device, dtype=dtype):
        y = grouped_mlp(x, offsets, w1, w2, probs)
    g = torch.randn(y.shape, device=device).to(dtype)
    got = torch.autograd.grad(y, (x, w1, w2, probs), g)
    cast = [t.detach().to(dtype).requires_grad_() for t in (x, w1, w2)]
    want = torch.autograd.grad(grouped_mlp(cast[0], offsets, *cast[1:], probs), cast, g)
    for name, a, b in zip(("w1", "w2"), got[1:3], want[1:3]):
        assert a.dtype == torch.float32, name
        assert not torch.equal(a, a.to(dtype).float()), f"{name}'s gradient went through {dtype}"
        torch.testing.assert_close(a.to(dtype), b, msg=name)
    torch.testing.assert_close(got[0], want[0].float(), rtol=0, atol=0)


def _check_linear_weight_grad(device: str, dtype: torch.dtype) -> None:
    """The same for grouped_linear's wgrad (and its bias gradient through the usual cast)."""
    x, w1, _, b, _, offsets = _case(device, R=40, H=32, F=16)
    with torch.autocast(device, dtype=dtype):
        y = grouped_linear(x, w1, offsets, b)
    g = torch.randn(y.shape, device=device).to(dtype)
    got = torch.autograd.grad(y, (x, w1, b), g)
    cast = [t.detach().to(dtype).requires_grad_() for t in (x, w1, b)]
    want = torch.autograd.grad(grouped_linear(cast[0], cast[1], offsets, cast[2]), cast, g)
    assert all(t.dtype == torch.float32 for t in got)
    assert not torch.equal(got[1], got[1].to(dtype).float()), f"dW went through {dtype}"
    torch.testing.assert_close(got[1].to(dtype), want[1])
    for a, w in ((got[0], want[0]), (got[2], want[2])):
        torch.testing.assert_close(a, w.float(), rtol=0, atol=0)


def _check_mm_weight_grad(device: str, dtype: torch.dtype) -> None:
    """The same for grouped_mm's ragged-M b (a transposed view of an fp32 weight)."""
    x, w1, _, b, _, offsets = _case(device, R=40, H=32, F=16)
    with torch.autocast(device, dtype=dtype):
        y = grouped_mm(x, w1.transpose(1, 2), offsets, bias=b)
    g = torch.randn(y.shape, device=device).to(dtype)
    got = torch.autograd.grad(y, (x, w1, b), g)
    cast = [t.detach().to(dtype).requires_grad_() for t in (x, w1, b)]
    want = torch.autograd.grad(
        grouped_mm(cast[0], cast[1].transpose(1, 2), offsets, bias=cast[2]), cast, g
    )
    assert all(t.dtype == torch.float32 for t in got)
    assert not torch.equal(got[1], got[1].to(dtype).float()), f"dW went through {dtype}"
    torch.testing.assert_close(got[1].to(dtype), want[1])
    for a, w in ((got[0], want[0]), (got[2], want[2])):
        torch.testing.assert_close(a, w.float(), rtol=0, atol=0)


def test_grouped_mm_writes_fp32_weight_gradients_directly():
    _check_mm_weight_grad("cpu", torch.float16)


def test_grouped_linear_writes_fp32_weight_gradients_directly():
    _check_linear_weight_grad("cpu", torch.float16)


@pytest.mark.skipif(not interpret_mode(), reason="the fused MLP on CPU needs TRITON_INTERPRET=1")
def test_fused_mlp_writes_fp32_weight_gradients_directly():
    _check_fused_mlp_weight_grads("cpu", torch.float16)


def test_mixed_or_frozen_weights_cast_through_autograd():
    """Weights of two dtypes, or that need no gradient, take the differentiable casts."""
    x, w1, w2, _, probs, offsets = _case("cpu")
    for a, b in ((w1, w2.detach().half()), (w1.detach(), w2.detach())):
        with torch.autocast("cpu", dtype=torch.float16):
            y = grouped_mlp(x, offsets, a, b, probs)
        want = grouped_mlp(x.half(), offsets, a.half(), b.half(), probs)
        torch.testing.assert_close(y, want, rtol=0, atol=0)
        y.float().sum().backward()
        assert x.grad is not None and (a.grad is not None) == a.requires_grad
        x.grad = a.grad = None


@pytest.mark.gpu
def test_gpu_ops_and_layer_under_bf16_autocast():
    _check_ops("cuda", torch.bfloat16, 1e-2)
    _check_layer("cuda", torch.bfloat16, 2e-2)
    _check_fused_mlp_weight_grads("cuda", torch.bfloat16)
    _check_linear_weight_grad("cuda", torch.bfloat16)
    _check_mm_weight_grad("cuda", torch.bfloat16)


def test_sizes_misaligned_in_the_autocast_dtype_keep_their_dtype():
    # 12 fp32 elements span 48 bytes; 12 fp16 ones 24, not a 16-byte multiple: no cast
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 12, generator=g)
    w1 = torch.randn(2, 8, 12, generator=g)
    w2 = torch.randn(2, 12, 4, generator=g)
    offsets = torch.tensor([4, 10], dtype=torch.int32)
    calls = (
        lambda: grouped_linear(x, w1, offsets),
        lambda: grouped_mlp(x, offsets, w1, w2),
        lambda: grouped_mm(x, w1.transpose(1, 2), offsets),
    )
    for call in calls:
        with torch.autocast("cpu", dtype=torch.float16):
            got = call()
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, call(), rtol=0, atol=0)


def test_out_form_is_left_alone():
    # as torch.mm(out=): autocast does not touch the out= form (nor its own torch calls)
    x, w1, *_, offsets = _case("cpu")
    x, w1 = x.detach(), w1.detach()
    want = grouped_mm(x, w1.transpose(1, 2), offsets)
    out = torch.zeros_like(want)
    with torch.autocast("cpu", dtype=torch.float16):
        grouped_mm(x, w1.transpose(1, 2), offsets, out=out)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("weight_grad", [True, False])
def test_accumulate_without_out_is_refused_under_autocast(weight_grad):
    # as outside a region; a weight that needs a gradient takes the cast-outside-autograd
    # path, which once dropped the flag and returned a fresh product
    x, w1, *_, offsets = _case("cpu")
    w1.requires_grad_(weight_grad)
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(ValueError, match="out="):
        grouped_mm(x.detach(), w1.transpose(1, 2), offsets, accumulate=True)


def test_compiled_ops_under_autocast_match_eager():
    """torch.compile(fullgraph=True) of the ops under autocast: values and fp32 gradients as
    in eager (where fp32 weights are cast outside autograd)."""
    x, w1, w2, _, probs, offsets = _case("cpu", R=40, H=32, F=16)

    def fn(x, w1, w2, probs):
        with torch.autocast("cpu", dtype=torch.float16):
            h = grouped_linear(x, w1[:, :32], offsets)
            return grouped_mlp(h, offsets, w1, w2, probs)

    leaves = (x, w1, w2, probs)
    want = fn(*leaves)
    want_grads = torch.autograd.grad(want.float().sum(), leaves)
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(*leaves)
    got_grads = torch.autograd.grad(got.float().sum(), leaves)
    torch.testing.assert_close(got, want)
    for a, w in zip(got_grads, want_grads):  # within half-precision rounding
        assert a.dtype == w.dtype == torch.float32
        assert float((a - w).norm() / w.norm()) < 1e-3
