"""grouped_mlp against the reference composition, forward and every gradient.

On CPU with TRITON_INTERPRET=1 (``make test``) the fused kernels run in Triton's interpreter
(fp32/fp16: its bf16 dot is wrong); without it the CPU path is the unfused reference
composition. ``-m gpu`` runs bf16 at real shapes and the replayed kernel launches. The
GroupedMLP module's tests (no-sync, CUDA-graph replay, launch count) are in
tests/nn/test_grouped_mlp.py.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from moekit import Activation
from moekit.config import interpret_mode
from moekit.ops import grouped_mlp
from moekit.reference.grouped_mlp import grouped_mlp_ref
from moekit.runtime.device import use_triton
from moekit.runtime.state import STATE

GATED = ("swiglu", "geglu", "clamped_swiglu")
ALL = (*GATED, "relu2", "gelu", "silu")
# a small clamp limit so gpt-oss's clamps are active on unit-scale data
CLAMPED = Activation("clamped_swiglu", limit=0.75, alpha=1.702, offset=1.0)


def _offsets(counts, device="cpu"):
    return torch.cumsum(torch.tensor(counts), 0).to(device=device, dtype=torch.int32)


def _make(R, E, H, F, act, dtype=torch.float32, device="cpu", probs=True, bias=False):
    gated = Activation(act).gated if isinstance(act, str) else act.gated
    W1 = 2 * F if gated else F
    x = torch.randn(R, H, device=device).to(dtype).requires_grad_()
    w1 = (torch.randn(E, W1, H, device=device) / H**0.5).to(dtype).requires_grad_()
    w2 = (torch.randn(E, H, F, device=device) / F**0.5).to(dtype).requires_grad_()
    p = torch.rand(R, device=device, requires_grad=True) if probs else None
    b1 = (0.2 * torch.randn(E, W1, device=device)).to(dtype).requires_grad_() if bias else None
    b2 = (0.2 * torch.randn(E, H, device=device)).to(dtype).requires_grad_() if bias else None
    return x, w1, w2, p, b1, b2


def _rel(a, b):
    if b.numel() == 0:
        return 0.0
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def _check(counts, H, F, act, *, inter=None, probs=True, bias=False, rec=False,
           dtype=torch.float32, R=None, tol=None, device="cpu"):  # fmt: skip
    E = len(counts)
    R = sum(counts) if R is None else R
    x, w1, w2, p, b1, b2 = _make(R, E, H, F, act, dtype, device, probs, bias)
    offsets = _offsets(counts, device)
    kw = dict(activation=act, glu_interleave=inter, b1=b1, b2=b2)
    y = grouped_mlp(x, offsets, w1, w2, p, recompute_activation=rec, **kw)
    y_ref = grouped_mlp_ref(x, offsets, w1, w2, p, **kw)
    tol = tol or (2e-3 if dtype == torch.float16 else 1e-5)
    assert y.shape == (R, H) and y.dtype == dtype
    assert _rel(y, y_ref) < tol, _rel(y, y_ref)
    inputs = [t for t in (x, w1, w2, p, b1, b2) if t is not None]
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, inputs, dy)
    if y_ref.requires_grad:
        ref = torch.autograd.grad(y_ref, inputs, dy, allow_unused=True, materialize_grads=True)
    else:  # no rows reach any expert: the reference output is a constant
        ref = [torch.zeros_like(t) for t in inputs]
    names = [
        n
        for n, t in zip(["x", "w1", "w2", "probs", "b1", "b2"], (x, w1, w2, p, b1, b2))
        if t is not None
    ]
    for name, g, r in zip(names, got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert _rel(g, r) < tol * 4, (name, _rel(g, r))
    return y, got


@pytest.mark.parametrize("act", ALL)
@pytest.mark.parametrize("probs", [True, False])
def test_every_activation_matches_reference(act, probs):
    act = CLAMPED if act == "clamped_swiglu" else act
    _check([13, 0, 29, 6], 32, 48, act, probs=probs)


@pytest.mark.parametrize("act", GATED)
def test_interleaved_gate_up_layout(act):
    act = CLAMPED if act == "clamped_swiglu" else act
    _check([9, 22, 0, 17], 32, 64, act, inter=16)
    _check([9, 22, 0, 17], 32, 64, act, inter=32, dtype=torch.float16)


@pytest.fixture(params=["one", "three"])
def segments(request, monkeypatch):
    """Backward's launches as one segment (small problems) or as three (large ones, which free
    h and the activation before allocating the gradients): forced by the size threshold."""
    if request.param == "three":
        _always_three_segments(monkeypatch)
    return request.param


def _always_three_segments(monkeypatch):
    module = _plans_module()
    monkeypatch.setattr(module, "ONE_SEGMENT_MAX_BYTES", -1)
    # not even the first backward of a configuration on the GPU (which compiles in one segment)
    monkeypatch.setattr(module._Backward, "first_of_its_configuration", lambda self: False)


@pytest.mark.parametrize("rec", [False, True])
def test_bias_and_recompute(rec, segments):
    _check([20, 0, 37, 10], 32, 48, "swiglu", bias=True, rec=rec)
    _check([5, 40, 3], 16, 32, "gelu", bias=True, rec=rec, dtype=torch.float16)


def test_recompute_gives_identical_gradients():
    counts = [17, 0, 30]
    x, w1, w2, p, _, _ = _make(sum(counts), 3, 32, 48, "swiglu")
    off = _offsets(counts)
    dy = torch.randn(sum(counts), 32)
    g0 = torch.autograd.grad(grouped_mlp(x, off, w1, w2, p), (x, w1, w2, p), dy)
    g1 = torch.autograd.grad(
        grouped_mlp(x, off, w1, w2, p, recompute_activation=True), (x, w1, w2, p), dy
    )
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_routing_edge_cases():
    _check([0, 0, 40, 0], 32, 32, "swiglu")  # one expert with everything
    _check([1], 16, 16, "silu")  # a single token, E = 1
    _check([0, 0, 0], 16, 32, "swiglu", bias=True, R=12)  # every expert empty
    _check([7, 3], 16, 24, "swiglu", R=15)  # rows past offsets[-1]: zero output, zero grads
    _check([33, 31], 16, 40, "geglu")  # F not a multiple of the tile


def test_rows_past_offsets_are_zero_with_zero_grads():
    y, (dx, _, _, dp) = _check([5, 6], 16, 32, "swiglu", R=20)
    assert torch.all(y[11:] == 0) and torch.all(dx[11:] == 0) and torch.all(dp[11:] == 0)


def test_inference_under_no_grad():
    x, w1, w2, p, b1, b2 = _make(30, 3, 16, 32, "geglu", bias=True)
    off = _offsets([10, 0, 20])
    with torch.no_grad():
        y = grouped_mlp(x, off, w1, w2, p, activation="geglu", b1=b1, b2=b2)
    assert not y.requires_grad
    ref = grouped_mlp_ref(x, off, w1, w2, p, activation="geglu", b1=b1, b2=b2)
    assert _rel(y, ref) < 1e-5


def test_zero_rows():
    x, w1, w2, p, b1, b2 = _make(0, 3, 16, 16, "swiglu", bias=True)
    y = grouped_mlp(x, _offsets([0, 0, 0]), w1, w2, p, b1=b1, b2=b2)
    assert y.shape == (0, 16)
    grads = torch.autograd.grad(y.sum(), (x, w1, w2, p, b1, b2))
    assert all(torch.all(g == 0) for g in grads)


def test_noncontiguous_inputs():
    counts = [10, 0, 14]
    R, E, H, F = 24, 3, 32, 16
    base = torch.randn(R, 2 * H)
    x = base[:, ::2].requires_grad_()  # strided rows
    w1 = (torch.randn(E, H, 2 * F) / H**0.5).transpose(1, 2).requires_grad_()  # H not unit
    w2 = (torch.randn(E, H, F) / F**0.5).requires_grad_()
    p = torch.rand(2 * R)[::2].requires_grad_()
    off = _offsets(counts)
    y = grouped_mlp(x, off, w1, w2, p)
    y_ref = grouped_mlp_ref(x, off, w1, w2, p)
    assert _rel(y, y_ref) < 1e-5
    g = torch.autograd.grad(y.sum(), (x, w1, w2, p))
    r = torch.autograd.grad(y_ref.sum(), (x, w1, w2, p))
    assert all(_rel(a, b) < 1e-4 for a, b in zip(g, r))


@pytest.mark.parametrize("rec", [False, True])
def test_backward_twice_through_one_graph(rec, segments):
    # Regression: backward frees the saved activations once consumed (memory); a second
    # backward through the same graph (retain_graph=True) used to raise on the kernel path
    # while the reference path worked. It now recomputes them and gives the same gradients.
    x, w1, w2, p, _, _ = _make(20, 2, 16, 16, "swiglu")
    off = _offsets([8, 12])
    y = grouped_mlp(x, off, w1, w2, p, recompute_activation=rec)
    dy = torch.randn_like(y)
    first = torch.autograd.grad(y, (x, w1, w2, p), dy, retain_graph=True)
    second = torch.autograd.grad(y, (x, w1, w2, p), dy)
    ref = torch.autograd.grad(grouped_mlp_ref(x, off, w1, w2, p), (x, w1, w2, p), dy)
    for a, b, r in zip(first, second, ref):
        assert _rel(a, r) < 1e-4 and _rel(b, r) < 1e-4


def test_main_grad_accumulates_in_place(segments):
    counts = [12, 0, 20]
    x, w1, w2, p, _, _ = _make(sum(counts), 3, 32, 16, "swiglu")
    off = _offsets(counts)
    dy = torch.randn(sum(counts), 32)
    r1, r2 = torch.autograd.grad(grouped_mlp_ref(x, off, w1, w2, p), (w1, w2), dy)
    w1.main_grad = torch.full(w1.shape, 0.5)
    w2.main_grad = torch.full(w2.shape, -1.0)
    grouped_mlp(x, off, w1, w2, p).backward(dy)
    assert w1.grad is None and w2.grad is None
    assert _rel(w1.main_grad, r1 + 0.5) < 1e-5 and _rel(w2.main_grad, r2 - 1.0) < 1e-5
    assert torch.all(w1.main_grad[1] == 0.5)  # the empty expert's slice is untouched


def test_frozen_weight_with_main_grad_is_left_alone(segments):
    # w1 does not require grad (frozen) but still carries a main_grad buffer: backward must not
    # accumulate into it, and the other gradients stay right.
    counts = [9, 0, 14]
    x, w1, w2, p, _, _ = _make(sum(counts), 3, 32, 16, "swiglu")
    w1.requires_grad_(False)
    off = _offsets(counts)
    dy = torch.randn(sum(counts), 32)
    ref = torch.autograd.grad(grouped_mlp_ref(x, off, w1, w2, p), (x, w2, p), dy)
    w1.main_grad = torch.full(w1.shape, 0.25)
    got = torch.autograd.grad(grouped_mlp(x, off, w1, w2, p), (x, w2, p), dy)
    assert torch.all(w1.main_grad == 0.25)
    for g, r in zip(got, ref):
        assert _rel(g, r) < 1e-5


class _Tap(torch.autograd.Function):
    """Identity whose backward notes the address of the gradient it receives."""

    @staticmethod
    def forward(ctx, t, seen):
        ctx.seen = seen
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        ctx.seen.append(g.data_ptr())
        return g, None


class _Fresh(torch.autograd.Function):
    """Identity whose backward hands on a fresh gradient (as unpermute's does), noting its
    address."""

    @staticmethod
    def forward(ctx, t, seen):
        ctx.seen = seen
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        out = g * 1.0
        ctx.seen.append(out.data_ptr())
        return out, None


def _mlp_between_taps(hook=None):
    counts = [14, 0, 25, 9]
    x, w1, w2, p, _, _ = _make(sum(counts), 4, 32, 48, "swiglu")
    off = _offsets(counts)
    into, given = [], []
    y = grouped_mlp(_Tap.apply(x, into), off, w1, w2, p)
    if hook is not None:
        y.register_hook(hook)
    dz = torch.randn_like(y)
    (_Fresh.apply(y, given) * dz).sum().backward()
    ref = torch.autograd.grad(grouped_mlp_ref(x, off, w1, w2, p), (x, w1, w2, p), dz)
    for got, r in zip((x.grad, w1.grad, w2.grad, p.grad), ref):
        assert _rel(got, r) < 1e-4
    return x, dz, into[0] == given[0]


def test_dx_takes_the_memory_of_a_gradient_nothing_else_holds(segments):
    # Memory: when the incoming gradient is dead after fc2's backward (nothing else holds it),
    # the large-problem backward writes dx into it instead of holding two [R, H] gradients.
    x, _, reused = _mlp_between_taps()
    assert reused == (segments == "three" and use_triton(x))


def test_a_gradient_held_elsewhere_is_never_overwritten(segments):
    kept = []
    _, dz, reused = _mlp_between_taps(hook=kept.append)
    assert not reused
    torch.testing.assert_close(kept[0], dz, rtol=0, atol=0)


def test_fallback_for_unaligned_f_and_interleave_warns_once(interpret, monkeypatch):
    if not interpret:
        pytest.skip("the fallback is a property of the fused (Triton) path")
    monkeypatch.setattr(STATE, "warned", set())
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _check([6, 0, 9], 16, 10, "swiglu", bias=True)  # F = 10: fp32 rows of 40 bytes
        _check([6, 0, 9], 16, 10, "swiglu", inter=5)
        _check([6, 0, 9], 16, 10, "relu2")
        _check([6, 9], 16, 32, "swiglu", inter=8)  # interleave below the smallest tile
        _check([6, 9], 16, 32, "swiglu", inter=8)
    msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 2, msgs  # one per distinct reason
    assert "F = 10" in msgs[0] and "glu_interleave = 8" in msgs[1]


def test_bad_input_errors():
    x, w1, w2, p, _, _ = _make(10, 2, 16, 8, "swiglu")
    off = _offsets([4, 6])
    with pytest.raises(ValueError, match=r"w1.shape\[1\] must be 2 \* F = 16"):
        grouped_mlp(x, off, w1[:, :12], w2, p)
    with pytest.raises(ValueError, match="must be even"):
        grouped_mlp(x, off, w1[:, :15], w2, p)
    with pytest.raises(ValueError, match=r"must equal F = w2.shape\[2\] = 8"):
        grouped_mlp(x, off, w1, w2, p, activation="relu2")
    for bad in (3, True):
        with pytest.raises(ValueError, match="glu_interleave must be a positive integer"):
            grouped_mlp(x, off, w1, w2, p, glu_interleave=bad)
    for name in ("alpha", "offset"):
        with pytest.raises(ValueError, match=f"activation {name} must be finite"):
            Activation("clamped_swiglu", **{name: float("nan")})
    with pytest.raises(ValueError, match="gated"):
        grouped_mlp(x, off, w1[:, :8], w2, p, activation="gelu", glu_interleave=4)
    with pytest.raises(ValueError, match=r"probs must have shape \(10,\)"):
        grouped_mlp(x, off, w1, w2, p[:9])
    with pytest.raises(TypeError, match="w2 must have x's dtype"):
        grouped_mlp(x, off, w1, w2.double(), p)
    with pytest.raises(ValueError, match="activation must be one of"):
        grouped_mlp(x, off, w1, w2, p, activation="swish")
    with pytest.raises(ValueError, match="same E experts"):
        grouped_mlp(x, off, w1, w2[:1], p)
    with pytest.raises(ValueError, match="offsets has 3 entries"):
        grouped_mlp(x, _offsets([4, 6, 0]), w1, w2, p)
    with pytest.raises(ValueError, match=r"b2 must have shape \(2, 16\)"):
        grouped_mlp(x, off, w1, w2, p, b2=torch.zeros(2, 8))
    w1.main_grad = torch.zeros(3)
    with pytest.raises(ValueError, match=r"w1\.main_grad must be an fp32 tensor"):
        grouped_mlp(x, off, w1, w2, p)


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------


def _skewed(R, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    share = torch.distributions.Gamma(0.6, 1.0).sample((E,))
    share[torch.randint(E, (1,), generator=g)] = 0
    counts = torch.floor(share / share.sum() * R).long()
    counts[counts.argmax()] += R - counts.sum()
    return counts.tolist()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "act,inter,bias,rec",
    [("swiglu", None, False, False), ("swiglu", None, True, True), ("geglu", 64, False, False),
     ("clamped_swiglu", None, True, False), ("relu2", None, False, True),
     ("silu", None, False, False)],
)  # fmt: skip
def test_gpu_bf16_real_shapes(act, inter, bias, rec):
    counts = _skewed(8192, 16)
    _check(counts, 1024, 768, act, inter=inter, bias=bias, rec=rec, dtype=torch.bfloat16,
           device="cuda", tol=2e-2)  # fmt: skip


def _plans_module():
    return importlib.import_module("moekit.ops.grouped_mlp")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "act,inter,bias,rec,probs",
    [("swiglu", None, False, False, True), ("geglu", 64, True, True, True),
     ("relu2", None, False, False, False), ("clamped_swiglu", None, True, False, False)],
)  # fmt: skip
def test_gpu_replayed_launches_match_reference(act, inter, bias, rec, probs, segments):
    """From the third call of one static configuration on, the op replays its recorded
    launches with only the pointers swapped: every call, on fresh tensors and a fresh routing,
    must still match the reference, and the replays must actually be in use."""
    from moekit.runtime.cache import cache_clear, cache_entries

    cache_clear("replay")
    R, E = 4096, 8
    for seed in range(5):
        counts = _skewed(R, E, seed) if seed != 3 else [0] * (E - 1) + [R]
        _check(counts, 512, 256, act, inter=inter, bias=bias, rec=rec, probs=probs,
               dtype=torch.bfloat16, device="cuda", tol=2e-2)  # fmt: skip
    replays = cache_entries("replay")
    fwd = [r for k, r in replays.items() if k[1] == "mlp_fwd"]
    segments_of = ("all", "dact", "wgrad2", "fc1")
    bwd = {
        next(e for e in k if e in segments_of): r for k, r in replays.items() if k[1] == "mlp_bwd"
    }
    assert len(fwd) == 1 and fwd[0].ready
    assert set(bwd) == ({"all"} if segments == "one" else {"dact", "wgrad2", "fc1"})
    assert all(r.ready for r in bwd.values())


@pytest.mark.gpu
def test_gpu_first_backward_of_a_configuration_runs_one_segment(monkeypatch):
    """A problem large enough for three backward segments runs one on the first backward of
    its configuration (its kernels then compile side by side), three afterwards; both give the
    same gradients."""
    module = _plans_module()
    monkeypatch.setattr(module, "ONE_SEGMENT_MAX_BYTES", -1)  # every call large enough
    ran = []
    for name in ("one_segment", "three_segments"):
        run = getattr(module._Backward, name)
        monkeypatch.setattr(
            module._Backward, name, lambda self, run=run, name=name: (ran.append(name), run(self))
        )
    counts = [301, 0, 517, 213]  # a configuration no other test runs
    x, w1, w2, p, _, _ = _make(sum(counts), 4, 256, 384, "swiglu", torch.bfloat16, "cuda")
    off = _offsets(counts, "cuda")
    dy = torch.randn(sum(counts), 256, device="cuda", dtype=torch.bfloat16)
    first, second = (
        torch.autograd.grad(grouped_mlp(x, off, w1, w2, p), (x, w1, w2, p), dy) for _ in range(2)
    )
    assert ran == ["one_segment", "three_segments"]
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
def test_gpu_first_forward_compiles_the_backward_ahead():
    """The first forward of a configuration starts its backward's compilations in the
    background: once they are done, the backward compiles nothing more, and its gradients are
    right. (Under MOEKIT_AUTOTUNE=1 compile-ahead steps aside: skipped then.)"""
    from triton import knobs

    from moekit.config import autotune_enabled
    from moekit.runtime import replay

    if autotune_enabled():
        pytest.skip("compile-ahead steps aside while autotuning")
    counts = [77, 0, 190, 5, 33]  # a configuration no other test runs
    x, w1, w2, p, _, _ = _make(sum(counts), 5, 192, 320, "swiglu", torch.bfloat16, "cuda")
    off = _offsets(counts, "cuda")
    dy = torch.randn(sum(counts), 192, device="cuda", dtype=torch.bfloat16)
    y = grouped_mlp(x, off, w1, w2, p)
    replay._finisher().submit(lambda: None).result()  # the background jobs are finalised
    compiled = []
    previous = knobs.compilation.listener
    knobs.compilation.listener = lambda src, *args, **kwargs: compiled.append(src.name)
    try:
        grads = torch.autograd.grad(y, (x, w1, w2, p), dy)
    finally:
        knobs.compilation.listener = previous
    assert compiled == []
    y_ref = grouped_mlp_ref(x, off, w1, w2, p)
    for got, want in zip(grads, torch.autograd.grad(y_ref, (x, w1, w2, p), dy)):
        assert _rel(got, want) < 3e-2


@pytest.mark.gpu
def test_gpu_replay_with_main_grad_and_misaligned_probs():
    """main_grad accumulation through replayed launches, and a probs view whose pointer is
    not 16-byte aligned (the replay must step aside: Triton assumed alignment when recording)."""
    R, E, H, F = 2048, 4, 256, 128
    x, w1, w2, _, _, _ = _make(R, E, H, F, "swiglu", torch.bfloat16, "cuda")
    w1.main_grad = torch.zeros(w1.shape, device="cuda")
    w2.main_grad = torch.zeros(w2.shape, device="cuda")
    want1 = torch.zeros_like(w1.main_grad)
    want2 = torch.zeros_like(w2.main_grad)
    for step in range(5):
        base = torch.rand(R + 1, device="cuda")
        p = (base[1:] if step == 4 else base[:R]).detach().requires_grad_()
        off = _offsets(_skewed(R, E, step), "cuda")
        dy = torch.randn(R, H, device="cuda", dtype=torch.bfloat16)
        y = grouped_mlp(x, off, w1, w2, p)
        gx, gp = torch.autograd.grad(y, (x, p), dy)
        y_ref = grouped_mlp_ref(x, off, w1, w2, p)
        rx, rp, r1, r2 = torch.autograd.grad(y_ref, (x, p, w1, w2), dy)
        want1 += r1.float()
        want2 += r2.float()
        assert _rel(y, y_ref) < 2e-2 and _rel(gx, rx) < 3e-2 and _rel(gp, rp) < 3e-2
        assert w1.grad is None and w2.grad is None
    assert _rel(w1.main_grad, want1) < 3e-2 and _rel(w2.main_grad, want2) < 3e-2


def _gradients_in_asked_dtypes(device: str, dtype: torch.dtype, R: int, H: int, F: int) -> None:
    """One configuration whose backward writes the weights' gradients in x's dtype (weights in
    it) or in fp32 (fp32 weights cast under autocast, which the backward writes in their dtype
    itself), alternated, three calls each (run, recorded, replayed on the GPU): every call gets
    its weights' dtype, with the values of the first call of its kind within rounding, and dx
    and dprobs unchanged."""
    E = 4
    x, w1, w2, p, b1, b2 = _make(R, E, H, F, "swiglu", dtype, device, bias=True)
    offsets = _offsets(_skewed(R, E), device)
    dy = torch.randn(R, H, device=device).to(dtype)
    masters = [w.detach().float().requires_grad_() for w in (w1, w2)]
    want: dict[bool, tuple] = {}
    for fp32 in (False, True, False, True):
        for _ in range(3):
            ws = masters if fp32 else (w1, w2)
            region = torch.autocast(device, dtype=dtype, enabled=fp32)
            with region:
                y = grouped_mlp(x, offsets, *ws, p, b1=b1, b2=b2)
            got = torch.autograd.grad(y, (x, p, *ws), dy)
            want.setdefault(fp32, got)
            assert [g.dtype for g in got[2:]] == [torch.float32 if fp32 else dtype] * 2
            for i in (0, 1):
                torch.testing.assert_close(got[i], want[False][i], rtol=0, atol=0)
            for i in (2, 3):
                assert _rel(got[i], want[fp32][i]) < 1e-2, (fp32, i, _rel(got[i], want[fp32][i]))
    for i in (2, 3):  # the fp32 gradients are the half-precision ones before their rounding
        assert _rel(want[True][i], want[False][i].float()) < 1e-2


@pytest.mark.skipif(not interpret_mode(), reason="the fused kernels on CPU need TRITON_INTERPRET=1")
def test_gradients_in_asked_dtypes():
    _gradients_in_asked_dtypes("cpu", torch.float16, 40, 32, 16)


@pytest.mark.gpu
def test_gpu_gradients_in_asked_dtypes_are_part_of_the_replayed_configuration():
    """A launch sequence recorded for one set of gradient dtypes must not replay into the
    buffers of another (kernels compiled for bf16 stores writing fp32 gradients)."""
    _gradients_in_asked_dtypes("cuda", torch.bfloat16, 1024, 256, 128)


@pytest.mark.gpu
def test_gpu_backward_peak_holds_one_row_gradient():
    """permute → grouped_mlp → unpermute at a size that runs three backward segments: dx takes
    the memory of unpermute's row gradient, so the backward's peak is one [R, H] gradient
    lower than when something else (here a hook) keeps that gradient alive."""
    from moekit.ops import permute, unpermute

    T, k, E, H, F = 4096, 8, 16, 2048, 768
    tokens = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _, w1, w2, _, _, _ = _make(16, E, H, F, "swiglu", torch.bfloat16, "cuda")
    ids = torch.randint(0, E, (T, k), device="cuda")
    probs = torch.rand(T, k, device="cuda").softmax(-1)

    def backward_peak(keep_grad: bool) -> int:
        d = permute(tokens, ids, probs, num_experts=E)
        rows = grouped_mlp(d.hidden, d.offsets, w1, w2, d.probs.to(torch.bfloat16))
        kept = []
        if keep_grad:
            rows.register_hook(kept.append)
        out = unpermute(rows, d, weighted=False)
        dout = torch.randn_like(out)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        out.backward(dout)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start

    backward_peak(False)  # tune and compile first
    owned, kept = backward_peak(False), backward_peak(True)
    row_grad = T * k * H * 2
    assert kept - owned >= 0.9 * row_grad, (owned, kept, row_grad)
