"""MoELayer vs the per-expert-loop oracle (same weights), forward and backward, with shared
experts, capacity drops, alignment and group-limited sigmoid routing; the router's losses
reach the router without the caller adding them."""

from __future__ import annotations

import pytest
import torch

from moekit.nn import DispatchConfig, MoELayer, TopKRouter
from moekit.ops import RouterConfig
from moekit.reference.moe import moe_layer_ref
from tests._cuda_step import replays_like_eager

CONFIGS = [
    ("plain", dict()),
    ("shared_expert", dict(shared_expert_ffn_size=16)),
    ("capacity_drops", dict(dispatch=DispatchConfig(capacity_factor=0.6))),
    ("aligned", dict(dispatch=DispatchConfig(align=8))),
    (
        "deepseek_like",
        dict(router=RouterConfig("sigmoid", num_groups=4, topk_groups=2, scaling=2.0)),
    ),
    ("unnormalised_geglu", dict(router=RouterConfig(normalize=False), activation="geglu")),
]


def _ref(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    sh = layer.shared_expert
    r = layer.router
    return moe_layer_ref(
        x, r.weight, layer.experts.fc1_weight, layer.experts.fc2_weight, layer.k,
        activation=layer.experts.activation.name,
        route_kwargs=dict(r.config.routing_kwargs(), expert_bias=r.expert_bias),
        capacity_factor=layer.dispatch.capacity_factor, align=layer.dispatch.align,
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
    layer = MoELayer(16, 8, 4, 2, router=RouterConfig(aux_loss_coeff=0.1, z_loss_coeff=0.01))
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
    # the values it added are readable for logging, detached; None where a loss is off
    torch.testing.assert_close(layer.last_aux_loss, out.aux_loss.detach())
    torch.testing.assert_close(layer.last_z_loss, out.z_loss.detach())
    assert not layer.last_aux_loss.requires_grad and plain.last_aux_loss is None
    assert plain.last_z_loss is None


def test_aux_loss_grad_scale_scales_the_losses_gradient():
    torch.manual_seed(2)
    layer = MoELayer(16, 8, 4, 2, router=RouterConfig(aux_loss_coeff=0.1, z_loss_coeff=0.01))
    x = torch.randn(10, 16)
    layer(x).sum().backward()
    unscaled = layer.router.weight.grad.clone()
    # the training loss multiplied by s before backward: with the scale set alike, every
    # gradient is s times the unscaled one, the losses' included
    for s in (0.25, torch.tensor(8.0)):
        layer.zero_grad()
        layer.aux_loss_grad_scale = s
        (layer(x).sum() * s).backward()
        torch.testing.assert_close(layer.router.weight.grad, unscaled * s)
    layer.zero_grad()
    layer.aux_loss_grad_scale = 0.0  # the losses off in the backward, the objective's gradient on
    layer(x).sum().backward()
    plain = MoELayer(16, 8, 4, 2)
    plain.load_state_dict(layer.state_dict())
    plain(x).sum().backward()
    torch.testing.assert_close(layer.router.weight.grad, plain.router.weight.grad)
    for bad, err in ((-1.0, ValueError), (float("nan"), ValueError), (torch.ones(2), TypeError),
                     ("1", TypeError)):  # fmt: skip
        with pytest.raises(err, match="aux_loss_grad_scale"):
            layer.aux_loss_grad_scale = bad


def test_output_takes_an_in_place_residual_with_losses_on():
    torch.manual_seed(3)
    layer = MoELayer(16, 8, 4, 2, router=RouterConfig(aux_loss_coeff=0.1, z_loss_coeff=0.01))
    x = torch.randn(10, 16, requires_grad=True)
    y = layer(x)
    y += x
    y.sum().backward()
    want = layer.router.weight.grad.clone()
    layer.zero_grad()
    (layer(x) + x).sum().backward()
    torch.testing.assert_close(layer.router.weight.grad, want)


@pytest.mark.parametrize("shared", [0, 8])
def test_output_in_the_input_shape_is_not_a_view(shared):
    # A view output would lose FSDP2's pre-backward hook under an in-place op on it.
    torch.manual_seed(3)
    layer = MoELayer(16, 8, 4, 2, shared_expert_ffn_size=shared)
    for shape in ((10, 16), (2, 5, 16), (2, 1, 5, 16)):
        x = torch.randn(shape, requires_grad=True)
        y = layer(x)
        assert y.shape == shape and not y._is_view()
        torch.testing.assert_close(y.reshape(10, 16), layer(x.detach().reshape(10, 16)))
        y += x
        y.sum().backward()


@pytest.mark.parametrize("strict", [False, True])
def test_export_with_a_dynamic_batch(strict):
    torch.manual_seed(6)
    layer = MoELayer(16, 8, 4, 2)
    x = torch.randn(3, 6, 16)
    batch = torch.export.Dim.AUTO
    exported = torch.export.export(layer, (x,), dynamic_shapes=({0: batch},), strict=strict)
    x2 = torch.randn(5, 6, 16)
    torch.testing.assert_close(exported.module()(x2), layer(x2))


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_same_gradients(reentrant):
    """torch.utils.checkpoint over the layer (losses on, shared expert): the recomputed forward
    adds the router's losses once, as the plain layer does."""
    torch.manual_seed(5)
    kw = dict(router=RouterConfig(aux_loss_coeff=0.1, z_loss_coeff=0.01), shared_expert_ffn_size=8)
    plain = MoELayer(16, 8, 4, 2, **kw)
    ckpt = MoELayer(16, 8, 4, 2, **kw)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(2, 7, 16)
    g = torch.randn(2, 7, 16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    plain(xa).backward(g)
    y = torch.utils.checkpoint.checkpoint(ckpt, xb, use_reentrant=reentrant)
    y.backward(g)
    torch.testing.assert_close(xb.grad, xa.grad)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


@pytest.mark.parametrize(
    "dispatch", [DispatchConfig(), DispatchConfig(capacity_factor=0.6), DispatchConfig(align=8)],
    ids=["dropless", "capacity_drops", "aligned"],
)  # fmt: skip
def test_recompute_rows_gives_the_same_gradients_and_frees_the_rows(
    dispatch, interpret, monkeypatch
):
    """DispatchConfig(recompute_rows=True): the experts' backward gathers their input rows
    again, bit for bit, so every gradient equals the plain layer's exactly. Where the fused
    experts run (the interpreter here, the GPU there) the rows are not held from forward to
    backward, as they are without the option, and they are gathered once in the backward; the
    unfused CPU path saves per-expert views of the rows, which stay as they are."""
    import dataclasses
    import gc
    import weakref

    import moekit.nn.moe as moe_module

    regathers = []
    real = moe_module.permuted_rows
    monkeypatch.setattr(moe_module, "permuted_rows", lambda *a: regathers.append(1) or real(*a))
    torch.manual_seed(6)
    kw = dict(router=RouterConfig(aux_loss_coeff=0.1), shared_expert_ffn_size=8)
    plain = MoELayer(32, 24, 8, 2, dispatch=dispatch, **kw)
    regather = MoELayer(32, 24, 8, 2, dispatch=dataclasses.replace(dispatch, recompute_rows=True),
                        **kw)  # fmt: skip
    regather.load_state_dict(plain.state_dict())
    x, g = torch.randn(5, 7, 32), torch.randn(5, 7, 32)
    grads, alive = [], []
    for layer in (plain, regather):
        seen = []  # a weak reference to the experts' input rows

        def keep(_module, args, seen=seen):
            seen.append(weakref.ref(args[0]))

        handle = layer.experts.register_forward_pre_hook(keep)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        gc.collect()
        alive.append(seen[0]() is not None)
        y.backward(g)
        handle.remove()
        grads.append([xi.grad, *(p.grad for p in layer.parameters())])
    for got, want in zip(grads[1], grads[0]):
        assert torch.equal(got, want)
    if interpret:
        assert alive == [True, False] and len(regathers) == 1


def test_recompute_rows_declines_what_it_cannot_run():
    with pytest.raises(TypeError, match="recompute_rows must be a bool, got int"):
        DispatchConfig(recompute_rows=1)
    with pytest.raises(ValueError, match="recompute_rows needs a single-device bf16"):
        MoELayer(32, 32, 8, 2, dispatch=DispatchConfig(recompute_rows=True),
                 fp8=__import__("moekit").Fp8Recipe())  # fmt: skip


def test_non_contiguous_input():
    torch.manual_seed(4)
    layer = MoELayer(16, 8, 4, 2)
    for x in (torch.randn(16, 6).t(), torch.randn(6, 32)[:, ::2]):
        torch.testing.assert_close(layer(x), layer(x.contiguous()))


def test_expert_bias_stays_fp32_through_module_casts():
    layer = MoELayer(16, 8, 4, 2, router=RouterConfig(expert_bias=True))
    layer.router.update_expert_bias(torch.tensor([10, 0, 5, 5]), rate=1e-3)
    before = layer.router.expert_bias.clone()
    layer.to(torch.bfloat16)
    assert layer.router.weight.dtype == torch.bfloat16
    assert layer.router.expert_bias.dtype == torch.float32
    assert torch.equal(layer.router.expert_bias, before)  # not rounded through bf16
    layer.half()  # (fp16 for the call: Triton's interpreter refuses bf16)
    assert layer.router.expert_bias.dtype == torch.float32
    assert layer(torch.randn(5, 16, dtype=torch.float16)).dtype == torch.float16


def test_names_of_the_layers_parts():
    layer = MoELayer(16, 8, 4, 2, shared_expert_ffn_size=12)
    assert isinstance(layer.router, TopKRouter)
    assert layer.experts.fc1_weight.shape == (4, 16, 16)  # [E, 2F, H], gate | up
    assert layer.experts.fc2_weight.shape == (4, 16, 8)  # [E, H, F]
    assert layer.shared_expert is not None
    assert MoELayer(16, 8, 4, 2).shared_expert is None


def test_expert_bias_update_from_last_counts():
    layer = MoELayer(16, 8, 4, 1, router=RouterConfig(expert_bias=True))
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
        MoELayer(16, 8, 6, 2, router=RouterConfig(num_groups=4, topk_groups=1))
    for name in ("aux_loss_coeff", "z_loss_coeff"):
        with pytest.raises(ValueError, match=name):
            RouterConfig(**{name: float("nan")})
    with pytest.raises(TypeError, match=r"router must be a moekit\.nn\.RouterConfig"):
        MoELayer(16, 8, 4, 2, router={"score": "sigmoid"})
    with pytest.raises(TypeError, match=r"dispatch must be a moekit\.nn\.DispatchConfig"):
        MoELayer(16, 8, 4, 2, dispatch={"align": 8})
    with pytest.raises(ValueError, match="align must be None or one of"):
        DispatchConfig(align=12)
    with pytest.raises(ValueError, match="capacity_factor must be a finite float > 0"):
        DispatchConfig(capacity_factor=0.0)
    with pytest.raises(ValueError, match=r"x must be a \[\.\.\., hidden_size = 16\] .*got \(\)"):
        layer(torch.tensor(1.0))  # 0-d


@pytest.mark.parametrize(
    "layer_dtype, x_dtype", [(torch.float32, torch.float16), (torch.float16, torch.float32)]
)
def test_input_dtype_other_than_the_parameters_outside_autocast(layer_dtype, x_dtype):
    layer = MoELayer(16, 8, 4, 2, dtype=layer_dtype)
    x = torch.randn(5, 16, dtype=x_dtype)
    match = (
        rf"MoELayer got x of dtype {x_dtype}, but its parameters are {layer_dtype}.*"
        rf"torch\.autocast.*layer\.to\({x_dtype}\)"
    )
    with pytest.raises(TypeError, match=match):
        layer(x)
    # Inside an autocast region for x's device type the layer casts, as before.
    with torch.autocast("cpu", dtype=torch.float16):
        y = layer(x)
    assert y.dtype == torch.float16 and y.shape == x.shape
    layer_low = MoELayer(16, 8, 4, 2, dtype=torch.float16)
    layer_low.load_state_dict(layer.state_dict())
    torch.testing.assert_close(y, layer_low(x.half()), rtol=2e-3, atol=2e-3)


DSV3_LIKE = dict(
    router=RouterConfig("sigmoid", num_groups=8, topk_groups=4, expert_bias=True, scaling=2.5)
)
GPU_CASES = [
    ("olmoe_like", 2048, 64, 8, 2048, 1024, {}),
    ("deepseek_like", 1024, 32, 8, 1024, 512, DSV3_LIKE),
    ("mixtral_like_shared", 512, 8, 2, 1024, 2048, dict(shared_expert_ffn_size=256)),
    ("capacity_drops", 1000, 16, 4, 512, 256, dict(dispatch=DispatchConfig(capacity_factor=0.8))),
    ("aligned_skew", 777, 16, 2, 256, 128, dict(dispatch=DispatchConfig(align=16))),
    ("one_token", 1, 8, 2, 64, 32, {}),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.gpu
@pytest.mark.parametrize("name, T, E, k, H, Fd, opts", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_matches_per_expert_loop(name, T, E, k, H, Fd, opts):
    """bf16 layer (Triton path) vs the fp32 per-expert loop, routed by the same bf16 logits
    (fp32 logits would route near-tied tokens differently)."""
    layer = MoELayer(H, Fd, E, k, device="cuda", dtype=torch.bfloat16, **opts)
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.normal_(0, 0.01)
    if name == "aligned_skew":  # most tokens to expert 0, some experts idle
        with torch.no_grad():
            layer.router.weight[0] += 0.5
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    params = [p for p in layer.parameters()]
    grads = torch.autograd.grad(y, [x, *params], g)
    leaves = [t.detach().clone().requires_grad_() for t in (x, *params)]
    xr, wr, w1, w2, *shared = leaves
    r = layer.router
    ref = moe_layer_ref(
        xr, wr, w1, w2, k, activation=layer.experts.activation.name,
        route_kwargs=dict(r.config.routing_kwargs(), expert_bias=r.expert_bias),
        capacity_factor=layer.dispatch.capacity_factor, align=layer.dispatch.align,
        shared=tuple(shared) or None, logits=torch.nn.functional.linear(xr, wr),
    )  # fmt: skip
    ref_grads = torch.autograd.grad(ref, leaves, g.float())
    assert _rel(y, ref) < 2e-2
    for p, got, want in zip(["x", *dict(layer.named_parameters())], grads, ref_grads):
        assert _rel(got, want) < 3e-2, p


@pytest.mark.gpu
@pytest.mark.parametrize(
    "opts",
    [{}, dict(dispatch=DispatchConfig(1.0, align=16)), "autocast",
     dict(dispatch=DispatchConfig(recompute_rows=True))],
    ids=["dropless", "capacity", "fp32_under_autocast", "recompute_rows"],
)  # fmt: skip
def test_gpu_layer_step_has_no_host_sync_and_captures_in_a_cuda_graph(opts):
    autocast = opts == "autocast"
    dtype = torch.float32 if autocast else torch.bfloat16
    layer = MoELayer(
        512, 256, 16, 4, router=RouterConfig(aux_loss_coeff=1e-2, z_loss_coeff=1e-3),
        shared_expert_ffn_size=128,
        device="cuda", dtype=dtype, **({} if autocast else opts),
    )  # fmt: skip
    params = list(layer.parameters())
    x = torch.randn(384, 512, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn_like(x)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
        return torch.autograd.grad(y, [x, *params], g.to(y.dtype))

    replays_like_eager(step, (x, g))


@pytest.mark.gpu
def test_gpu_recompute_rows_holds_one_rows_tensor_less():
    """Between forward and backward, the layer with recompute_rows holds about one [R, H]
    tensor less (R = T·k rows) than the plain layer, and its gradients are the same bits."""
    import dataclasses

    T, E, k, H, F = 4096, 16, 4, 1024, 512
    plain = MoELayer(H, F, E, k, device="cuda", dtype=torch.bfloat16)
    dispatch = dataclasses.replace(plain.dispatch, recompute_rows=True)
    regather = MoELayer(H, F, E, k, device="cuda", dtype=torch.bfloat16, dispatch=dispatch)
    regather.load_state_dict(plain.state_dict())
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    held, grads = [], []
    for layer in (plain, regather):
        xi = x.clone().requires_grad_()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = layer(xi)
        held.append(torch.cuda.memory_allocated() - before)
        y.backward(torch.ones_like(y))
        grads.append([xi.grad, *(p.grad for p in layer.parameters())])
        del y
    assert held[0] - held[1] >= 0.9 * T * k * H * 2, held
    for got, want in zip(grads[1], grads[0]):
        assert torch.equal(got, want)
