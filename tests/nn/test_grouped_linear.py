"""GroupedLinear, the module over grouped_mm: ``torch.compile(fullgraph=True)`` through the layer
gives the eager gradients (GPU only, ``-m gpu``; bf16 at a real shape). The op itself, grouped_mm,
is tested in tests/ops/test_grouped_gemm.py, whose helpers this file reuses.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_grouped_gemm import _rel, offsets_from_counts


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph_grouped_linear():
    from moekit.nn import GroupedLinear

    T, E, K, N = 2048, 4, 256, 512
    layer = GroupedLinear(E, K, N, device="cuda", dtype=torch.bfloat16)
    offsets = offsets_from_counts([500, 0, 1000, 548], "cuda")
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step(x, offsets):
        return layer(x, offsets).float().square().sum()

    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(x, offsets)
    loss.backward()
    gx, gw = x.grad.clone(), layer.weight.grad.clone()
    x.grad = None
    layer.weight.grad = None
    step(x, offsets).backward()
    assert _rel(gx, x.grad) < 1e-2 and _rel(gw, layer.weight.grad) < 1e-2
