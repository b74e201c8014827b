"""MoELayer(fp8=): the FP8 layer against the same dataflow with the fake-quantized expert oracle
(``moekit.reference.fp8_mlp``) in place of the FP8 experts, forward and every gradient (the
router's included), and against the unquantized layer within the recipe's error; capacity drops,
idle experts, a shared expert, a single token; what it refuses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moekit.config import interpret_mode
from moekit.nn import DispatchConfig, MoELayer, routed_experts
from moekit.ops import Fp8Recipe
from moekit.reference.fp8_mlp import grouped_mlp_fp8_ref
from moekit.reference.moe import moe_layer_ref

# fp32 under Triton's interpreter, whose fp32 → bf16 conversion truncates (see test_fp8_mlp)
DTYPE = torch.float32 if interpret_mode() else torch.bfloat16
H, F, E, K = 128, 128, 4, 2


class _OracleExperts(torch.autograd.Function):
    """The fake-quantized FP8 MLP as an autograd node: its forward and its hand-written
    backward from ``grouped_mlp_fp8_ref``."""

    @staticmethod
    def forward(ctx, x, offsets, w1, w2, probs, act):
        ctx.save_for_backward(x, offsets, w1, w2, probs)
        ctx.act = act
        y = grouped_mlp_fp8_ref(x, offsets, w1, w2, probs, torch.zeros_like(x), act, dtype=DTYPE)
        return y[0].to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, offsets, w1, w2, probs = ctx.saved_tensors
        _, dx, dw1, dw2, dp = grouped_mlp_fp8_ref(
            x, offsets, w1, w2, probs, dy, ctx.act, dtype=DTYPE
        )
        return dx.to(x.dtype), None, dw1.to(w1.dtype), dw2.to(w2.dtype), dp.to(probs.dtype), None


def _oracle(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    tokens = x.reshape(-1, x.shape[-1])
    r = layer.router(tokens)
    r = dataclasses.replace(r, probs=layer.router.attach_losses(r.probs, r))
    ex = layer.experts

    def experts(rows, offsets, probs):
        return _OracleExperts.apply(rows, offsets, ex.fc1_weight, ex.fc2_weight, probs,
                                    ex.activation)  # fmt: skip

    y = routed_experts(tokens, r, experts, num_experts=layer.num_experts, dispatch=layer.dispatch,
                       shape=x.shape)  # fmt: skip
    if layer.shared_expert is not None:
        y = y + layer.shared_expert(tokens).view(x.shape)
    return y


CASES = [
    ("plain", 24, dict()),
    ("shared expert", 24, dict(shared_expert_ffn_size=64)),
    ("capacity drops", 24, dict(dispatch=DispatchConfig(capacity_factor=0.5))),
    ("a single token: idle experts", 1, dict()),
    ("relu2", 24, dict(activation="relu2")),
]


@pytest.mark.parametrize("name, T, kwargs", CASES, ids=[c[0] for c in CASES])
def test_equals_the_dataflow_with_the_oracle_experts(name, T, kwargs):
    torch.manual_seed(0)
    layer = MoELayer(H, F, E, K, fp8=Fp8Recipe(), dtype=DTYPE, **kwargs)
    assert layer.dispatch.align == 128
    x = torch.randn(T, H, dtype=DTYPE, requires_grad=True)
    y = layer(x)
    xr = x.detach().clone().requires_grad_()
    ref = _oracle(layer, xr)
    params = list(layer.parameters())
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *params], g)
    want = torch.autograd.grad(ref, [xr, *params], g)
    for what, a, b in zip(("y", "dx", *(n for n, _ in layer.named_parameters())),
                          (y, *got), (ref, *want), strict=True):  # fmt: skip
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 1e-2 * b.float().abs().max().item() + 1e-6, (what, err)


def test_error_against_the_unquantized_layer_is_the_recipes():
    # Against the same layer without quantization (the per-expert fp32 loop) the FP8 layer errs
    # by the recipe's own error, that of the fake-quantized dataflow: e4m3 keeps 3 mantissa
    # bits, and the four quantized operands of each GEMM chain leave a few percent in relative
    # L2 norm.
    torch.manual_seed(1)
    layer = MoELayer(H, F, E, K, fp8=Fp8Recipe(), dtype=torch.float32)
    r, ex = layer.router, layer.experts
    params = [r.weight, ex.fc1_weight, ex.fc2_weight]
    x = torch.randn(64, H)
    g = torch.randn(64, H)

    def run(fn):
        xx = x.clone().requires_grad_()
        y = fn(xx)
        return (y, *torch.autograd.grad(y, [xx, *params], g))

    got, fake = run(layer), run(lambda t: _oracle(layer, t))
    exact = run(lambda t: moe_layer_ref(t, r.weight, ex.fc1_weight, ex.fc2_weight, K,
                                        route_kwargs=r.config.routing_kwargs()))  # fmt: skip
    for what, a, f, e in zip(("y", "dx", "router", "w1", "w2"), got, fake, exact, strict=True):
        recipe = ((f - e).norm() / e.norm()).item()
        assert ((a - e).norm() / e.norm()).item() <= 1.05 * recipe + 1e-4, what
        assert recipe < 0.1, (what, recipe)


def test_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="align None or 128"):
        MoELayer(H, F, E, K, fp8=Fp8Recipe(), dispatch=DispatchConfig(align=64))
    with pytest.raises(ValueError, match="multiple of 16"):
        MoELayer(120, F, E, K, fp8=Fp8Recipe())
    with pytest.raises(TypeError, match="Fp8Recipe"):
        MoELayer(H, F, E, K, fp8="e4m3")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [{}, dict(dispatch=DispatchConfig(capacity_factor=1.0))],
                         ids=["dropless", "capacity"])  # fmt: skip
def test_gpu_equals_the_oracle_dataflow(opts):
    # bf16 on the GPU: the kernels against the oracle's dataflow (its torch ops on the GPU too)
    torch.manual_seed(0)
    layer = MoELayer(512, 256, 8, 2, fp8=Fp8Recipe(), shared_expert_ffn_size=128, device="cuda",
                     dtype=torch.bfloat16, **opts)  # fmt: skip
    x = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    xr = x.detach().clone().requires_grad_()
    ref = _oracle(layer, xr)
    g = torch.randn_like(y)
    params = list(layer.parameters())
    got = torch.autograd.grad(y, [x, *params], g)
    want = torch.autograd.grad(ref, [xr, *params], g)
    assert _rel(y, ref) < 1e-2
    for name, a, b in zip(["x", *dict(layer.named_parameters())], got, want, strict=True):
        assert _rel(a, b) < 2e-2, name


@pytest.mark.gpu
def test_gpu_fp8_layer_step_has_no_host_sync_and_captures_in_a_cuda_graph():
    from tests._cuda_step import replays_like_eager

    layer = MoELayer(512, 256, 16, 4, fp8=Fp8Recipe(), shared_expert_ffn_size=128,
                     device="cuda", dtype=torch.bfloat16)  # fmt: skip
    params = list(layer.parameters())
    x = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)

    replays_like_eager(lambda: torch.autograd.grad(layer(x), [x, *params], g), (x, g))
