"""moekit.fusion on the GPU (marker ``gpu``): every single-GPU rule in bf16, fused and unfused,
against the fp32 reference chain; a fused chain's training step with no host sync and in a
CUDA graph."""

from __future__ import annotations

import copy

import pytest
import torch

import moekit.fusion as mf
from moekit.ops import RouterConfig
from tests._cuda_step import replays_like_eager, sync_free_capture

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _run(fn, inputs, params, seed=1):
    """Outputs and gradients (inputs, then params) of one forward + backward of ``fn``."""
    for t in (*inputs, *params):
        t.grad = None
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    outs = [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]
    g = torch.Generator(device=outs[0].device).manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, device=o.device, generator=g)).sum() for o in outs)
    loss.backward()
    grads = [t.grad for t in (*inputs, *params) if t.requires_grad]
    return [o.detach() for o in outs], grads


def _check(seq, inputs, rule, out_tol=2e-2, grad_tol=3e-2):
    """bf16 fused and unfused runs against the fp32 reference chain."""
    ref_seq = copy.deepcopy(seq).float()
    ref_in = [t.detach().float().requires_grad_(t.requires_grad) if t.is_floating_point() else t
              for t in inputs]  # fmt: skip
    want = _run(ref_seq.reference, ref_in, list(ref_seq.parameters()))
    assert rule in seq.plan(inputs[0]).fused("forward") + seq.plan(inputs[0]).fused("backward")
    fused = _run(seq, inputs, list(seq.parameters()))
    with mf.fusions(disable=["all"]):
        assert not seq.plan(inputs[0]).fused("forward")
        unfused = _run(seq, inputs, list(seq.parameters()))
    for got in (fused, unfused):
        for a, b in zip(got[0], want[0]):
            assert _rel(a, b) < out_tol
        assert len(got[1]) == len(want[1])
        for a, b in zip(got[1], want[1]):
            assert _rel(a, b) < grad_tol


def _offsets(counts):
    return torch.tensor(counts, device=DEV).cumsum(0).to(torch.int32)


@pytest.mark.parametrize(
    "counts,rows",
    [
        ([300, 0, 212, 500], 1012),  # an idle expert
        ([0, 0, 777, 0], 800),  # everything in one expert, rows past offsets[-1]
        ([1, 0, 0, 0], 1),  # a single row
    ],
)
@pytest.mark.parametrize("act", [mf.ScaledSwiGLU, mf.SwiGLU, mf.GeGLU])
def test_grouped_mlp_rule(counts, rows, act):
    E, H, F = 4, 256, 192
    seq = mf.Sequential(
        mf.GroupedLinear(E, H, 2 * F, device=DEV, dtype=torch.bfloat16), act(),
        mf.GroupedLinear(E, F, H, device=DEV, dtype=torch.bfloat16),
    )  # fmt: skip
    x = torch.randn(rows, H, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    inputs = [x, _offsets(counts)]
    if act is mf.ScaledSwiGLU:
        inputs.append(torch.rand(rows, device=DEV, dtype=torch.bfloat16, requires_grad=True))
    _check(seq, inputs, "grouped_mlp")


@pytest.mark.parametrize("shape", [(1000, 1024), (4, 50, 768)])
def test_add_rmsnorm_rules(shape):
    H = shape[-1]
    seq = mf.Sequential(
        mf.Linear(H, H, device=DEV, dtype=torch.bfloat16), mf.AddExtraInput(),
        mf.MakeExtraOutput(), mf.RMSNorm(H, device=DEV, dtype=torch.bfloat16),
    )  # fmt: skip
    x = torch.randn(*shape, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(*shape, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    _check(seq, [x, r], "add_rmsnorm")
    assert seq.plan(x).fused("backward") == ["add_rmsnorm"]
    # forward unfused, backward fused by rmsnorm_residual_grad alone
    ref_seq = copy.deepcopy(seq).float()
    ref_in = [t.detach().float().requires_grad_() for t in (x, r)]
    want = _run(ref_seq.reference, ref_in, list(ref_seq.parameters()))
    with mf.fusions(disable=["add_rmsnorm"]):
        assert seq.plan(x).fused("backward") == ["rmsnorm_residual_grad"]
        got = _run(seq, [x, r], list(seq.parameters()))
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert _rel(a, b) < 3e-2


@pytest.mark.parametrize("weighted", [False, True])
def test_moe_rule(weighted):
    T, H, E, k, F = 512, 256, 8, 2, 128
    bf = {"device": DEV, "dtype": torch.bfloat16}
    seq = mf.Sequential(
        mf.Router(H, E, k, RouterConfig(aux_loss_coeff=1e-2), **bf), mf.Permute(E),
        mf.GroupedLinear(E, H, 2 * F, **bf), mf.SwiGLU() if weighted else mf.ScaledSwiGLU(),
        mf.GroupedLinear(E, F, H, **bf), mf.Unpermute(weighted=weighted),
    )  # fmt: skip
    x = torch.randn(T, H, **bf, requires_grad=True)
    # The router's top-k on bf16 logits picks differently from fp32 logits at near-ties, so the
    # reference routes with the same weights in bf16 ...
    fused = _run(seq, [x], list(seq.parameters()))
    with mf.fusions(disable=["all"]):
        unfused = _run(seq, [x], list(seq.parameters()))
    assert "moe" in seq.plan(x).fused("forward")
    for a, b in zip(fused[0] + fused[1], unfused[0] + unfused[1]):
        assert _rel(a, b) < 2e-2
    # ... and the reference chain (plain per-op autograd) with the same bf16 parameters
    ref = _run(seq.reference, [x], list(seq.parameters()))
    for a, b in zip(fused[0] + fused[1], ref[0] + ref[1]):
        assert _rel(a, b) < 3e-2


@pytest.mark.parametrize("chain", ["grouped_mlp", "add_rmsnorm"])
def test_step_is_sync_free_and_capturable(chain):
    bf = {"device": DEV, "dtype": torch.bfloat16}
    if chain == "grouped_mlp":
        E, H, F, R = 8, 256, 128, 2048
        seq = mf.Sequential(
            mf.GroupedLinear(E, H, 2 * F, **bf), mf.ScaledSwiGLU(), mf.GroupedLinear(E, F, H, **bf)
        )
        x = torch.randn(R, H, **bf, requires_grad=True)
        extras = [_offsets([300, 0, 700, 48, 500, 100, 200, 200]),
                  torch.rand(R, **bf, requires_grad=True)]  # fmt: skip
    else:
        H, T = 1024, 512
        seq = mf.Sequential(mf.AddExtraInput(), mf.MakeExtraOutput(), mf.RMSNorm(H, **bf))
        x = torch.randn(T, H, **bf, requires_grad=True)
        extras = [torch.randn(T, H, **bf, requires_grad=True)]
    dy = torch.randn(x.shape, **bf)
    params = list(seq.parameters())

    def step():
        for t in (x, *params):
            t.grad = None
        out = seq(x, *extras)
        y = out[0] if isinstance(out, tuple) else out
        y.backward(dy)
        return [t.grad for t in (x, *params)]

    replays_like_eager(step, (x, dy))


def test_fp32_chain_under_autocast_runs_the_fused_mlp_in_bf16():
    """An fp32 grouped-MLP chain under bf16 autocast: the parameters are cast per call, the
    fused rule applies, and the result is the bf16-converted chain's, gradients in fp32; the
    step is sync-free and capturable."""
    E, H, F, R = 8, 256, 128, 2048
    f32 = {"device": DEV, "dtype": torch.float32}
    seq = mf.Sequential(
        mf.GroupedLinear(E, H, 2 * F, **f32), mf.ScaledSwiGLU(), mf.GroupedLinear(E, F, H, **f32)
    )
    bf16 = copy.deepcopy(seq).bfloat16()
    x = torch.randn(R, H, **f32, requires_grad=True)
    offsets = _offsets([300, 0, 700, 48, 500, 100, 200, 200])
    probs = torch.rand(R, **f32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert "grouped_mlp" in seq.plan(x).fused("forward")
        got = _run(lambda x: seq(x, offsets, probs), [x], list(seq.parameters()))
    want = _run(lambda x: bf16(x.bfloat16(), offsets, probs), [x], list(bf16.parameters()))
    assert got[0][0].dtype == torch.bfloat16
    *same, dw1, dw2 = got[0] + got[1]  # x's gradient, then the two weights'
    for a, b in zip(same, want[0] + want[1][:1]):
        assert _rel(a, b) < 1e-6
    # the weights' gradients are written in fp32 from fp32 accumulators, not rounded to bf16
    for a, b in ((dw1, want[1][1]), (dw2, want[1][2])):
        assert a.dtype == torch.float32 and not torch.equal(a, a.bfloat16().float())
        assert _rel(a, b) < 1e-2

    def step():
        for t in (x, *seq.parameters()):
            t.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = seq(x, offsets, probs)
        y.float().sum().backward()
        return [t.grad for t in (x, *seq.parameters())]

    graph, static = sync_free_capture(step)
    graph.replay()
    for a, b in zip(static, step()):
        assert _rel(a, b) < 1e-2
