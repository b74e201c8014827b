"""moekit.fusion.Sequential under torch.compile (CPU, the aot_eager backend): a chain that is
one fused op, or of steps that each have an autograd form, runs those traceable forms, so it
compiles into one graph (``fullgraph=True``); a chain through the pipeline's autograd node
compiles with graph breaks. Forward and backward match eager."""

from __future__ import annotations

import pytest
import torch

import moekit.fusion as mf
from moekit.config import interpret_mode

H = 32


def _outputs_and_grads(fn, inputs):
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(0)
    sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs).backward()
    return [o.detach() for o in outs], [t.grad.clone() for t in inputs]


def _compare(seq, inputs, fullgraph):
    want = _outputs_and_grads(seq, inputs)
    torch._dynamo.reset()
    got = _outputs_and_grads(torch.compile(seq, fullgraph=fullgraph, backend="aot_eager"), inputs)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(a, b)


def test_add_rmsnorm_chain_compiles_into_one_graph():
    seq = mf.Sequential(mf.AddExtraInput(), mf.MakeExtraOutput(), mf.RMSNorm(H))
    inputs = [torch.randn(8, H, requires_grad=True), torch.randn(8, H, requires_grad=True)]
    assert seq.plan(inputs[0]).fused("backward") == ["add_rmsnorm"]
    _compare(seq, inputs, fullgraph=True)


@pytest.mark.skipif(not interpret_mode(), reason="the fused MLP on CPU needs TRITON_INTERPRET=1")
def test_grouped_mlp_chain_compiles_into_one_graph():
    seq = mf.Sequential(mf.GroupedLinear(3, H, 64), mf.ScaledSwiGLU(), mf.GroupedLinear(3, 32, H))
    x, probs = torch.randn(20, H, requires_grad=True), torch.rand(20, requires_grad=True)
    offsets = torch.tensor([7, 7, 20], dtype=torch.int32)
    want = _outputs_and_grads(lambda x, p: seq(x, offsets, p), [x, probs])
    torch._dynamo.reset()
    compiled = torch.compile(seq, fullgraph=True, backend="aot_eager")
    got = _outputs_and_grads(lambda x, p: compiled(x, offsets, p), [x, probs])
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(a, b)


def test_linear_add_rmsnorm_chain_compiles_into_one_graph():
    """Two steps with autograd forms (F.linear, then add_rmsnorm): no pipeline node."""
    seq = mf.Sequential(mf.Linear(H, H), mf.AddExtraInput(), mf.MakeExtraOutput(), mf.RMSNorm(H))
    inputs = [torch.randn(8, H, requires_grad=True), torch.randn(8, H, requires_grad=True)]
    assert len(seq.plan(inputs[0]).forward) == 2
    _compare(seq, inputs, fullgraph=True)


def test_pipeline_chain_compiles_with_graph_breaks():
    seq = mf.Sequential(mf.Linear(H, H), mf.AddExtraInput(), mf.MakeExtraOutput(), mf.RMSNorm(H))
    inputs = [torch.randn(8, H, requires_grad=True), torch.randn(8, H, requires_grad=True)]
    with mf.fusions(disable=["add_rmsnorm"]):  # basic ops without autograd forms: the pipeline
        assert len(seq.plan(inputs[0]).forward) == 4
        _compare(seq, inputs, fullgraph=False)


def test_fp32_chain_under_autocast_compiles_into_one_graph():
    """The per-call parameter casts of an autocast region trace too."""
    seq = mf.Sequential(mf.Linear(H, H), mf.AddExtraInput(), mf.MakeExtraOutput(), mf.RMSNorm(H))
    inputs = [torch.randn(8, H, requires_grad=True), torch.randn(8, H, requires_grad=True)]

    def under_autocast(fn):
        def call(*args):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(*args)

        return call

    want = _outputs_and_grads(under_autocast(seq), inputs)
    want_w = seq[0].weight.grad.clone()
    seq.zero_grad()
    assert want[0][0].dtype == torch.bfloat16
    torch._dynamo.reset()
    compiled = torch.compile(seq, fullgraph=True, backend="aot_eager")
    got = _outputs_and_grads(under_autocast(compiled), inputs)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(seq[0].weight.grad, want_w)
