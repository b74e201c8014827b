"""The FP8 expert MLP (``grouped_mlp_fp8``) and the FP8 dispatch (``permute(..., fp8=)``): the op
against its fake-quantized fp32 oracle (``moekit.reference.fp8_mlp``: the same quantization
points), forward and every gradient; against the unquantized layer within the recipe's own
error; the edge cases (an expert without rows, one expert with every row, a single token, the
zero tail past the last expert) and bad input. On the CPU the op runs its reference path; under
``TRITON_INTERPRET=1`` the FP8 kernels run in Triton's interpreter."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import moekit
from moekit.activations import Activation, apply_activation
from moekit.config import interpret_mode
from moekit.ops import permute
from moekit.ops.fp8_mlp import grouped_mlp_fp8
from moekit.ops.quantize import Fp8Recipe, quantize_fp8
from moekit.reference.fp8_mlp import grouped_mlp_fp8_ref

H, F = 128, 128
# The layer's dtype. Triton's interpreter converts fp32 to bf16 by truncation, not to nearest
# (the GPU rounds to nearest, as torch does), so there the bf16 rounding of h, a, da and dh
# would drift from the oracle's; in fp32 every intermediate is exact on both.
DTYPE = torch.float32 if interpret_mode() else torch.bfloat16


def _layer(counts, act="swiglu", seed=0):
    torch.manual_seed(seed)
    E = len(counts)
    R = sum(counts) + 128  # a zero tail past the last expert
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(R, H).to(DTYPE)
    x[offsets[-1] :] = 0
    gated = Activation(act).gated
    w1 = (torch.randn(E, (2 if gated else 1) * F, H) / H**0.5).to(DTYPE)
    w2 = (torch.randn(E, H, F) / F**0.5).to(DTYPE)
    probs = torch.rand(R).to(DTYPE)
    return x, offsets, w1, w2, probs


def _grads(x, offsets, w1, w2, probs, dy, act="swiglu"):
    x, w1, w2, probs = (t.detach().clone().requires_grad_() for t in (x, w1, w2, probs))
    y = grouped_mlp_fp8(x, offsets, w1, w2, probs, activation=act)
    y.backward(dy)
    return y.detach(), x.grad, w1.grad, w2.grad, probs.grad


def _close(got, want, rel, what):
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= rel * scale + 1e-6, f"{what}: max error {err:.3g} against a scale of {scale:.3g}"


@pytest.mark.parametrize(
    "counts",
    [[128, 0, 256], [0, 384, 0], [128]],
    ids=["an empty expert", "one expert with every row", "a single expert block"],
)
@pytest.mark.parametrize("act", ["swiglu", "relu2"])
def test_equals_the_fake_quantized_oracle(counts, act):
    x, offsets, w1, w2, probs = _layer(counts, act)
    dy = torch.randn(x.shape).to(DTYPE)
    got = _grads(x, offsets, w1, w2, probs, dy, act)
    want = grouped_mlp_fp8_ref(x, offsets, w1, w2, probs, dy, Activation(act), dtype=DTYPE)
    # Only fp32 summation order and the bf16 roundings of h, a, da, dh differ (a value on a
    # rounding edge may land one e4m3 step apart after that): 1% of each result's scale.
    for name, g, w in zip(("y", "dx", "dw1", "dw2", "dprobs"), got, want, strict=True):
        _close(g, w, 1e-2, name)
    assert not got[0][offsets[-1] :].any() and not got[1][offsets[-1] :].any(), "zero tail"


def test_error_against_the_unquantized_layer_is_the_recipes():
    # The FP8 layer's error against the same layer in fp32 without quantization is the recipe's
    # own: at most that of the oracle (which quantizes at the same points) plus bf16 rounding.
    counts = [256, 128]
    x, offsets, w1, w2, probs = _layer(counts, seed=1)
    dy = torch.randn(x.shape).to(DTYPE)
    got = _grads(x, offsets, w1, w2, probs, dy)
    fake = grouped_mlp_fp8_ref(x, offsets, w1, w2, probs, dy, Activation("swiglu"), dtype=DTYPE)
    exact = _unquantized(x, offsets, w1, w2, probs, dy)
    for name, g, f, e in zip(("y", "dx", "dw1", "dw2", "dprobs"), got, fake, exact, strict=True):
        recipe = (f - e).abs().max().item()
        err = (g.float() - e).abs().max().item()
        assert err <= 1.25 * recipe + 2**-7 * e.abs().max().item(), (name, err, recipe)
        assert recipe <= 0.15 * e.abs().max().item(), f"{name}: the recipe's error is e4m3's"


def _unquantized(x, offsets, w1, w2, probs, dy):
    x, w1, w2, probs = (t.detach().float().requires_grad_() for t in (x, w1, w2, probs))
    bounds = [0, *offsets.tolist()]
    y = torch.zeros(x.shape)
    for e in range(len(bounds) - 1):
        s, t = bounds[e], bounds[e + 1]
        h = x[s:t] @ w1[e].t()
        a = apply_activation(h, Activation("swiglu"), None) * probs[s:t, None]
        y[s:t] = a @ w2[e].t()
    y.backward(dy.float())
    return y.detach(), x.grad, w1.grad, w2.grad, probs.grad


def test_fp8_dispatch_feeds_the_mlp_and_trains_the_tokens():
    # permute(fp8=) quantizes each token once; the rows' gradient reaches the tokens through
    # the anchor, and the weight gradient quantizes the rows along the tokens from the tokens
    # (no second rounding): the same as quantizing the permuted bf16 rows.
    torch.manual_seed(2)
    T, E, k = 100, 3, 2
    x = torch.randn(T, H).to(DTYPE).requires_grad_()
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    p = torch.rand(T, k).to(DTYPE).requires_grad_()
    _, _, w1, w2, _ = _layer([128] * E)
    w1, w2 = w1.requires_grad_(), w2.requires_grad_()
    d = permute(x, ids, p, num_experts=E, align=128, fp8=Fp8Recipe())
    assert d.hidden.anchor is not None and d.hidden.source_rows is not None
    y = grouped_mlp_fp8(d.hidden, d.offsets, w1, w2, d.probs)
    dy = torch.randn(y.shape).to(DTYPE)
    y.backward(dy)
    # the same through bf16 permuted rows
    x2, p2 = x.detach().clone().requires_grad_(), p.detach().clone().requires_grad_()
    w1b, w2b = w1.detach().clone().requires_grad_(), w2.detach().clone().requires_grad_()
    d2 = permute(x2, ids, p2, num_experts=E, align=128, out_rows=d.num_rows)
    y2 = grouped_mlp_fp8(d2.hidden, d2.offsets, w1b, w2b, d2.probs)
    y2.backward(dy)
    for name, a, b in (("y", y, y2), ("dx", x.grad, x2.grad), ("dw1", w1.grad, w1b.grad),
                       ("dw2", w2.grad, w2b.grad), ("dprobs", p.grad, p2.grad)):  # fmt: skip
        _close(a, b, 1e-6, name)


def test_an_f_off_the_block_runs_the_composition_and_says_so():
    # F = 96: fc1's epilogue cannot quantize whole 1×128 blocks, so fc1, the activation (in
    # fp32, rounded to the layer's dtype) and fc2 run one after another, with a warning
    torch.manual_seed(3)
    counts, Fs = [128, 256], 96
    R = sum(counts)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(R, H).to(DTYPE)
    w1 = (torch.randn(2, 2 * Fs, H) / H**0.5).to(DTYPE)
    w2 = (torch.randn(2, H, Fs) / Fs**0.5).to(DTYPE)
    probs = torch.rand(R).to(DTYPE)
    dy = torch.randn(R, H).to(DTYPE)
    moekit.clear_state()  # the warning is given once per process state
    with pytest.warns(RuntimeWarning, match="F = 96 is not a multiple of 128"):
        got = _grads(x, offsets, w1, w2, probs, dy)
    want = grouped_mlp_fp8_ref(x, offsets, w1, w2, probs, dy, Activation("swiglu"), dtype=DTYPE,
                               composed=True)  # fmt: skip
    for name, g, w in zip(("y", "dx", "dw1", "dw2", "dprobs"), got, want, strict=True):
        _close(g, w, 1e-2, name)


def test_the_backward_keeps_no_copy_of_the_rows():
    # The weight gradient quantizes the rows along the tokens from the tokens again: between
    # forward and backward the rows' e4m3 copy is not held (it would cost R·H bytes)
    torch.manual_seed(4)
    T, E, k = 64, 2, 2
    x = torch.randn(T, H).to(DTYPE).requires_grad_()
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    _, _, w1, w2, _ = _layer([128] * E)
    w1.requires_grad_()
    d = permute(x, ids, torch.rand(T, k), num_experts=E, align=128, fp8=Fp8Recipe())
    rows = weakref.ref(d.hidden.data)
    y = grouped_mlp_fp8(d.hidden, d.offsets, w1, w2, d.probs.to(DTYPE))
    del d
    gc.collect()
    assert rows() is None
    y.backward(torch.randn(y.shape).to(DTYPE))
    assert x.grad is not None and w1.grad is not None


def test_main_grad_and_no_grad():
    x, offsets, w1, w2, probs = _layer([128, 128])
    w1.main_grad = torch.ones(w1.shape)
    w1.requires_grad_()
    dy = torch.randn(x.shape).to(DTYPE)
    grouped_mlp_fp8(x, offsets, w1, w2, probs).backward(dy)
    want = grouped_mlp_fp8_ref(x, offsets, w1, w2, probs, dy, Activation("swiglu"), dtype=DTYPE)
    assert w1.grad is None
    _close(w1.main_grad - 1, want[2], 1e-2, "main_grad")
    with torch.no_grad():
        y = grouped_mlp_fp8(x, offsets, w1, w2, probs)
    _close(y, want[0], 1e-2, "y without grad")


def test_bad_input():
    x, offsets, w1, w2, probs = _layer([128])
    with pytest.raises(ValueError, match="multiple of 16"):
        grouped_mlp_fp8(x[:, :120], offsets, w1[:, :, :120], w2[:, :120], probs)
    with pytest.raises(ValueError, match=r"w1\.shape"):
        grouped_mlp_fp8(x, offsets, w1[:, :64], w2, probs)
    with pytest.raises(TypeError, match="recipe must be"):
        grouped_mlp_fp8(x, offsets, w1, w2, probs, recipe="blockwise")
    with pytest.raises(ValueError, match=r"probs\.shape"):
        grouped_mlp_fp8(x, offsets, w1, w2, probs[:5])
    xq = quantize_fp8(x, axis="col")
    with pytest.raises(ValueError, match="quantized with axis='row'"):
        grouped_mlp_fp8(xq, offsets, w1, w2, probs)
