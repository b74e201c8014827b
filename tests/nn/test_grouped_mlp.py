"""GroupedMLP, the module over grouped_mlp: forward against the reference composition, main_grad
accumulation and repr on CPU (the fused kernels in Triton's interpreter under ``make test``);
``-m gpu`` checks a bf16 layer's step for no host sync, CUDA-graph replay with new routing and
the kernel launch count. The op itself is tested in tests/ops/test_grouped_mlp.py, whose
helpers this file reuses.
"""

from __future__ import annotations

import pytest
import torch

from moekit.nn import GroupedMLP
from moekit.reference.grouped_mlp import grouped_mlp_ref
from tests.ops.test_grouped_mlp import _offsets, _rel, _skewed


def test_module_matches_op_and_keeps_main_grad():
    torch.manual_seed(1)
    layer = GroupedMLP(4, 32, 16, activation="geglu", glu_interleave=16, bias=True)
    x = torch.randn(30, 32, requires_grad=True)
    off = _offsets([10, 0, 15, 5])
    p = torch.rand(30)
    y = layer(x, off, p)
    y_ref = grouped_mlp_ref(
        x, off, layer.fc1_weight, layer.fc2_weight, p, activation="geglu", glu_interleave=16,
        b1=layer.fc1_bias, b2=layer.fc2_bias,
    )  # fmt: skip
    assert _rel(y, y_ref) < 1e-5
    layer.fc1_weight.main_grad = torch.zeros_like(layer.fc1_weight, dtype=torch.float32)
    layer(x, off, p).sum().backward()
    assert layer.fc1_weight.grad is None and layer.fc1_weight.main_grad.abs().sum() > 0
    assert layer.fc2_weight.grad is not None
    assert "geglu" in repr(layer)


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------


def _gpu_layer(R=4096, E=8, H=512, F=256):
    layer = GroupedMLP(E, H, F, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(R, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    p = torch.rand(R, device="cuda", requires_grad=True)
    off = _offsets(_skewed(R, E), "cuda")
    dy = torch.randn(R, H, device="cuda", dtype=torch.bfloat16)
    params = [x, p, *layer.parameters()]
    for _ in range(2):  # compile (and autotune) outside the checked regions
        torch.autograd.grad(layer(x, off, p), params, dy)
    torch.cuda.synchronize()
    return layer, x, p, off, dy, params


@pytest.mark.gpu
def test_gpu_no_host_sync():
    layer, x, p, off, dy, params = _gpu_layer()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = layer(x, off, p)
        y.backward(dy)
        layer.recompute_activation = True
        torch.autograd.grad(layer(x, off, p), params, dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay_with_new_routing():
    layer, x, p, off, dy, params = _gpu_layer()
    R, E = x.shape[0], layer.num_experts
    static_off = off.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.autograd.grad(layer(x, static_off, p), params, dy)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = layer(x, static_off, p)
        static_grads = torch.autograd.grad(static_y, params, dy)
    for counts in (_skewed(R, E, 1), [0] * (E - 1) + [R], [R // 3] + [0] * (E - 1)):
        new = _offsets(counts, "cuda")
        static_off.copy_(new)
        graph.replay()
        y_ref = grouped_mlp_ref(x, new, layer.fc1_weight, layer.fc2_weight, p)
        refs = torch.autograd.grad(y_ref, params, dy)
        assert _rel(static_y, y_ref) < 2e-2
        for g, r in zip(static_grads, refs):
            assert _rel(g, r) < 3e-2


@pytest.mark.gpu
def test_gpu_make_graphed_callables():
    """The layer through torch.cuda.make_graphed_callables (how Megatron/TE users graph a
    layer): replays on fresh inputs and routings give the reference's output and gradients."""
    torch.manual_seed(0)
    R, E, H, F = 2048, 8, 512, 256
    layer = GroupedMLP(E, H, F, device="cuda", dtype=torch.bfloat16)

    def inputs(counts):
        x = torch.randn(R, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        p = torch.rand(R, device="cuda", requires_grad=True)
        return x, _offsets(counts, "cuda"), p

    graphed = torch.cuda.make_graphed_callables(layer, inputs(_skewed(R, E)))
    for counts in (_skewed(R, E, 1), [0] * (E - 1) + [R], [R // 3] + [0] * (E - 1)):
        x, off, p = inputs(counts)
        dy = torch.randn(R, H, device="cuda", dtype=torch.bfloat16)
        for w in layer.parameters():
            w.grad = None
        y = graphed(x, off, p)
        y.backward(dy)
        y_ref = grouped_mlp_ref(x, off, layer.fc1_weight, layer.fc2_weight, p)
        rx, rp, r1, r2 = torch.autograd.grad(y_ref, (x, p, layer.fc1_weight, layer.fc2_weight), dy)
        assert _rel(y, y_ref) < 2e-2
        for got, want in ((x.grad, rx), (p.grad, rp), (layer.fc1_weight.grad, r1),
                          (layer.fc2_weight.grad, r2)):  # fmt: skip
            assert _rel(got, want) < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_launch_count_at_most_10(bias):
    from torch.profiler import ProfilerActivity, profile

    layer, x, p, off, dy, params = _gpu_layer()
    if bias:
        layer = GroupedMLP(8, 512, 256, bias=True, device="cuda", dtype=torch.bfloat16)
        params = [x, p, *layer.parameters()]
        torch.autograd.grad(layer(x, off, p), params, dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(layer(x, off, p), params, dy)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) <= 10, kernels
