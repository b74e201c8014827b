"""topk_routing vs the pure-PyTorch reference (forward, counts, gradients), its documented edge
behaviour (ties, NaN logits) and its input checks.

CPU tests run the Triton kernels in the interpreter under ``make test``; GPU tests (``-m gpu``)
run them at real router shapes."""

from __future__ import annotations

import pytest
import torch

from moekit.ops import topk_routing
from moekit.ops.router import RouterConfig, route
from moekit.reference.router import topk_routing_backward_ref, topk_routing_ref

# (name, T, E, k, num_groups, topk_groups)
CASES = [
    ("plain", 37, 16, 4, None, None),
    ("k1", 9, 8, 1, None, None),
    ("k_equals_E", 6, 8, 8, None, None),
    ("groups", 21, 32, 6, 8, 3),
    ("one_token", 1, 12, 2, None, None),
    ("E_not_power_of_two", 17, 20, 3, 5, 2),
]


def _check(T, E, k, groups, score, normalize, bias, dtype=torch.float32, device="cpu"):
    logits = torch.randn(T, E, device=device).to(dtype).requires_grad_()
    ref_logits = logits.detach().clone().requires_grad_()
    cfg = RouterConfig(
        score=score, num_groups=groups[0], topk_groups=groups[1], normalize=normalize,
        scaling=2.5,
    )  # fmt: skip
    probs, idx, counts = route(logits, k, cfg, bias)
    ref_p, ref_i = topk_routing_ref(ref_logits, k, score, bias, *groups, normalize, 2.5)
    assert probs.dtype == torch.float32 and idx.dtype == torch.int32
    assert torch.equal(idx, ref_i)
    torch.testing.assert_close(probs, ref_p, rtol=1e-5, atol=1e-6)
    assert torch.equal(counts, torch.bincount(ref_i.flatten().long(), minlength=E).int())
    g = torch.randn_like(probs)
    (dl,) = torch.autograd.grad(probs, logits, g)
    (ref_dl,) = torch.autograd.grad(ref_p, ref_logits, g)
    assert dl.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(dl.float(), ref_dl.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case, score, normalize):
    _, T, E, k, g, tg = case
    _check(T, E, k, (g, tg), score, normalize, None)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_expert_bias_steers_selection_only(score):
    T, E, k = 25, 16, 3
    bias = torch.zeros(E)
    bias[5] = 10.0  # every token picks expert 5 first
    _check(T, E, k, (None, None), score, True, bias)
    logits = torch.randn(T, E)
    probs, idx = topk_routing(logits, k, score=score, expert_bias=bias)
    assert torch.all(idx[:, 0] == 5)
    s = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
    raw = s.gather(1, idx.long())  # probs come from the scores, not the biased selection
    torch.testing.assert_close(probs, raw / raw.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)


def test_fp16_logits_and_strided_input():
    _check(19, 16, 2, (None, None), "softmax", True, None, dtype=torch.float16)
    big = torch.randn(30, 40)
    logits = big[::2, 3:35]  # strided rows, offset columns
    probs, idx = topk_routing(logits, 4)
    ref_p, ref_i = topk_routing_ref(logits, 4)
    assert torch.equal(idx, ref_i)
    torch.testing.assert_close(probs, ref_p)
    t = torch.randn(16, 10).t()  # unit stride along T, not E: copied
    assert torch.equal(topk_routing(t, 2)[1], topk_routing_ref(t, 2)[1])


def test_ties_go_to_the_lower_expert_id():
    logits = torch.zeros(3, 8)
    logits[1, [2, 6]] = 1.0
    _, idx = topk_routing(logits, 3)
    assert idx[0].tolist() == [0, 1, 2]
    assert idx[1].tolist() == [2, 6, 0]


def test_nan_logits_give_nan_probs_and_in_range_distinct_indices():
    logits = torch.randn(4, 8)
    logits[1] = float("nan")
    logits[2, 3] = float("nan")
    probs, idx = topk_routing(logits, 4)
    assert torch.all((idx >= 0) & (idx < 8))
    assert all(len(set(row)) == 4 for row in idx.tolist())
    assert torch.isnan(probs[1]).all()
    assert not torch.isnan(probs[0]).any() and not torch.isnan(probs[3]).any()
    _ref_p, ref_i = topk_routing_ref(logits, 4)
    assert torch.equal(idx, ref_i)


def test_nan_logit_under_sigmoid_is_ranked_last():
    logits = torch.randn(2, 4)
    logits[1, 2] = float("nan")
    probs, idx = topk_routing(logits, 2, score="sigmoid")
    assert 2 not in idx[1].tolist() and torch.isfinite(probs).all()  # not selected: unseen
    probs, idx = topk_routing(logits, 4, score="sigmoid", normalize=False)
    assert idx[1, 3] == 2 and torch.isnan(probs[1, 3]) and torch.isfinite(probs[1, :3]).all()
    probs, _ = topk_routing(logits, 4, score="sigmoid")
    assert torch.isnan(probs[1]).all() and torch.isfinite(probs[0]).all()


def test_empty_batch():
    logits = torch.randn(0, 8, requires_grad=True)
    probs, idx, counts = route(logits, 2, RouterConfig())
    assert probs.shape == (0, 2) and idx.shape == (0, 2) and counts.sum() == 0
    probs.sum().backward()
    assert logits.grad.shape == (0, 8)


def test_analytic_backward_matches_autograd_of_the_reference():
    for score in ("softmax", "sigmoid"):
        for normalize in (True, False):
            logits = torch.randn(11, 12, dtype=torch.float64, requires_grad=True)
            p, i = topk_routing_ref(logits, 3, score, None, 4, 2, normalize, 1.7)
            g = torch.randn_like(p)
            (auto,) = torch.autograd.grad(p, logits, g)
            analytic = topk_routing_backward_ref(g, logits.detach(), i, score, normalize, 1.7)
            torch.testing.assert_close(analytic, auto.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(logits=torch.randn(4)), ValueError, "logits must be 2-D"),
        (dict(logits=torch.randint(0, 3, (4, 8))), TypeError, "logits must have dtype"),
        (dict(k=9), ValueError, r"k must be an int in \[1, min\(E = 8"),
        (dict(k=0), ValueError, "k must be"),
        (dict(k=2.0), ValueError, "k must be"),
        (dict(score="relu"), ValueError, "score must be one of"),
        (dict(expert_bias=torch.zeros(7)), ValueError, "expert_bias must be a float32 \\[8\\]"),
        (dict(expert_bias=torch.zeros(8, dtype=torch.float64)), ValueError, "float32"),
        (dict(num_groups=3, topk_groups=1), ValueError, "num_groups must divide E = 8"),
        (dict(num_groups=8, topk_groups=1), ValueError, "groups of at least 2"),
        (dict(num_groups=4, topk_groups=5), ValueError, "topk_groups must be in"),
        (dict(num_groups=4, topk_groups=None), TypeError, "must both be ints"),
        (dict(num_groups=4, topk_groups=1, k=3), ValueError, "k = 3 exceeds the 2 experts"),
        (dict(normalize=1), TypeError, "normalize must be a bool"),
        (dict(scaling="2"), TypeError, "scaling must be a float"),
        (dict(logits=torch.randn(4, 4096)), ValueError, r"E\) must be in \[1, 2048\]"),
    ],
)
def test_bad_input_raises_clear_error(kwargs, exc, match):
    args = dict(logits=torch.randn(4, 8), k=2)
    args.update(kwargs)
    logits, k = args.pop("logits"), args.pop("k")
    with pytest.raises(exc, match=match):
        topk_routing(logits, k, **args)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "T, E, k, groups, score, bias",
    [
        (16384, 128, 8, (None, None), "softmax", False),  # Qwen3-30B-A3B
        (8192, 64, 8, (None, None), "softmax", False),  # OLMoE
        (8192, 256, 8, (8, 4), "sigmoid", True),  # DeepSeek-V3 (full expert set)
        (8192, 8, 2, (None, None), "softmax", False),  # Mixtral
        (3, 7, 7, (None, None), "sigmoid", False),
    ],
)
def test_gpu_matches_reference(T, E, k, groups, score, bias):
    b = torch.randn(E, device="cuda") * 0.01 if bias else None
    for dtype in (torch.float32, torch.bfloat16):
        _check(T, E, k, groups, score, True, b, dtype=dtype, device="cuda")


@pytest.mark.gpu
def test_gpu_no_host_sync_and_cuda_graph():
    logits = torch.randn(4096, 64, device="cuda", requires_grad=True)
    for _ in range(2):
        p, _, _ = route(logits, 8, RouterConfig())
        p.sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        p, _i, _c = route(logits, 8, RouterConfig())
        p.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    static = torch.randn(4096, 64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        route(static, 8, RouterConfig())
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _gp, gi, gc = route(static, 8, RouterConfig())
    static.copy_(torch.randn_like(static))
    graph.replay()
    _ref_p, ref_i = topk_routing_ref(static, 8)
    assert torch.equal(gi, ref_i)
    assert torch.equal(gc, torch.bincount(ref_i.flatten().long(), minlength=64).int())
