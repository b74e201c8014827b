"""moekit's GEMM ops and MoELayer under ``torch.autocast``: fp32 inputs and weights run in the
region's dtype, as ``F.linear`` does, with the same values and gradients as the same call made
outside the region on tensors cast beforehand; the fp32 weights get fp32 gradients.

CPU: float16 regions (Triton's interpreter refuses bf16 GEMMs). GPU: bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from moekit.nn import MoELayer
from moekit.ops import grouped_linear, grouped_mlp, grouped_mm


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
    kw = dict(aux_loss_coeff=0.1, shared_expert_ffn_size=8, device=device)
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


@pytest.mark.gpu
def test_gpu_ops_and_layer_under_bf16_autocast():
    _check_ops("cuda", torch.bfloat16, 1e-2)
    _check_layer("cuda", torch.bfloat16, 2e-2)


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
