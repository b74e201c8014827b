"""Every public op under ``torch.compile(fullgraph=True)``, forward and backward.

fullgraph=True fails on any graph break, so these prove that the ops' autograd Functions trace
into one graph with moekit's kernel ops as opaque nodes. CPU: the ``aot_eager`` backend (Dynamo
and AOTAutograd without code generation; the reference path, or the kernels in the interpreter
under TRITON_INTERPRET=1). GPU (``-m gpu``): the default inductor backend on bf16 inputs.
Results and gradients must match the eager call.
"""

from __future__ import annotations

import pytest
import torch

import moekit
from moekit.ops import (
    add_rmsnorm,
    grouped_linear,
    grouped_mlp,
    grouped_mm,
    permute,
    rmsnorm,
    sort_chunks_by_index,
    topk_routing,
    unpermute,
)


def _setups(device: str, dtype: torch.dtype):
    """name → (function, inputs needing grad) of every public op."""
    counts = [40, 0, 24, 64] if device == "cuda" else [5, 0, 11, 8]
    E, T = len(counts), sum(counts)
    H, F, N = (256, 128, 128) if device == "cuda" else (16, 16, 24)
    off = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)

    def p(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype).requires_grad_()

    x, b, w = p(T, H), p(E, H, N, scale=H**-0.5), p(E, N, H, scale=H**-0.5)
    w1, w2 = p(E, 2 * F, H, scale=H**-0.5), p(E, H, F, scale=F**-0.5)
    probs = torch.rand(T, device=device, requires_grad=True)
    dy = p(T, N)
    tokens, k = 12, 2
    idx = torch.stack([torch.randperm(E, device=device)[:k] for _ in range(tokens)])
    hid, tprobs = p(tokens, H), torch.rand(tokens, k, device=device, requires_grad=True)
    nw = p(H)
    sizes = torch.tensor([3, 5, 4], device=device)
    order = torch.tensor([2, 0, 1], device=device)

    def moe(h, pr):
        d = permute(h, idx, pr, num_experts=E)
        return unpermute(d.hidden * 2, d)

    return {
        "grouped_mm_ragged_m": (lambda x, b: grouped_mm(x, b, off), (x, b)),
        "grouped_mm_ragged_k": (lambda dy, x: grouped_mm(dy.t(), x, off), (dy, x)),
        "grouped_linear": (lambda x, w: grouped_linear(x, w, off), (x, w)),
        "grouped_mlp": (lambda x, w1, w2, p: grouped_mlp(x, off, w1, w2, p), (x, w1, w2, probs)),
        "permute_unpermute": (moe, (hid, tprobs)),
        "sort_chunks_by_index": (lambda h: sort_chunks_by_index(h, sizes, order)[0], (hid,)),
        "rmsnorm": (lambda h, w: rmsnorm(h, w), (hid, nw)),
        "topk_routing": (
            lambda lg: topk_routing(lg, 2, num_groups=2, topk_groups=1)[0],
            (p(T, 8),),
        ),
        "add_rmsnorm": (lambda h, r, w: torch.cat(add_rmsnorm(h, r, w)), (hid, hid * 1, nw)),
    }


NAMES = list(_setups("cpu", torch.float32))


def _check(name: str, device: str, dtype: torch.dtype, backend: str) -> None:
    torch._dynamo.reset()
    fn, inputs = _setups(device, dtype)[name]
    inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in inputs)
    eager = fn(*inputs)
    dy = torch.randn_like(eager)
    want = torch.autograd.grad(eager, inputs, dy)
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    got_out = compiled(*inputs)
    got = torch.autograd.grad(got_out, inputs, dy)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_out, eager, **tol)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)


@pytest.mark.parametrize("name", NAMES)
def test_fullgraph_on_cpu(name):
    _check(name, "cpu", torch.float32, "aot_eager")


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_gpu_fullgraph_inductor(name):
    _check(name, "cuda", torch.bfloat16, "inductor")


@pytest.mark.gpu
def test_gpu_fullgraph_modules():
    torch._dynamo.reset()
    mlp = moekit.nn.GroupedMLP(4, 256, 128, device="cuda", dtype=torch.bfloat16)
    off = torch.tensor([40, 80, 80, 128], device="cuda", dtype=torch.int32)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(mlp, fullgraph=True)
    compiled(x, off).float().square().sum().backward()
    assert x.grad is not None and mlp.fc1_weight.grad is not None
