"""The FP8 GEMMs (blockwise and rowwise) and the FP8 expert linear layer: the kernels (Triton's
interpreter on CPU, the GPU with ``-m gpu``) against their references, the error against the
unquantized product within the recipe's own (fake-quantized) error, the rowwise recipe's error
against blockwise's on data with outliers, the edge cases (empty experts, one expert with every
row, partial blocks, a single token, no rows) and bad input."""

from __future__ import annotations

import itertools

import pytest
import torch

from moekit.config import interpret_mode
from moekit.ops.quantize import Fp8Recipe, Fp8Tensor, quantize_fp8
from moekit.reference.fp8 import quantize_fp8_ref
from tests._cuda_step import sync_free_capture

interp = pytest.mark.skipif(
    not interpret_mode(), reason="the kernels on CPU need TRITON_INTERPRET=1"
)


# --- the FP8 grouped GEMM (ragged M, forward) ------------------------------------------------


def _ref_quantize(t, *, axis="row", block=128, pow2_scale=False, transpose=False) -> Fp8Tensor:
    """``quantize_fp8``'s result made by the reference: the same bits (test_quantize.py) without
    the interpreter's time, for the operands that a test's expected values come from."""
    data, scale = quantize_fp8_ref(t.detach(), axis, block, pow2_scale)
    data = data.transpose(-2, -1).contiguous() if transpose else data
    return Fp8Tensor(data, scale, axis, block, transpose)


def _quantized(x, w, rowwise, quantize=quantize_fp8):
    """x [T, K] and w [E, N, K] quantized as the forward of a recipe takes them."""
    if rowwise:  # per row, per output channel
        return quantize(x, block=None), quantize(w, block=None)
    return quantize(x), quantize(w, axis="both")  # 1x128, 128x128


def _experts(counts, T, K, N, device="cpu", rowwise=False):
    """Rows [T, K] and weights [E, N, K] (nn.Linear layout), quantized, with their offsets."""
    offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    x = torch.randn(T, K, device=device)
    w = torch.randn(len(counts), N, K, device=device) / K**0.5
    return x, w, *_quantized(x, w, rowwise), offsets


def _reference(a, b, offsets, out_dtype):
    """grouped_mm_fp8's reference for a's recipe (b as the GEMM reads it: [E, N, K])."""
    from moekit.reference.fp8 import grouped_mm_fp8_ref, grouped_mm_fp8_rowwise_ref

    ad, sa, bd, sb, offsets = (t.cpu() for t in (a.data, a.scale, b.data, b.scale, offsets))
    if a.block is None:
        sb = sb.reshape(*bd.shape[:2], 1)  # [E, N, 1], or the dgrad copy's [E, 1, N]
        return grouped_mm_fp8_rowwise_ref(ad, sa, bd, sb, offsets, out_dtype)
    return grouped_mm_fp8_ref(ad, sa, bd, sb, offsets, 128, out_dtype)


def _product(x, w, counts) -> torch.Tensor:
    """fp32 grouped product of x [T, K] and w [E, N, K] over the rows of each expert."""
    out, start = torch.zeros(x.shape[0], w.shape[1], device=x.device), 0
    for e, c in enumerate(counts):
        out[start : start + c] = x[start : start + c].float() @ w[e].float().t()
        start += c
    return out


def _check_gemm(counts, T, K, N, out_dtype=torch.float32, device="cpu", tol=0.0, rowwise=False):
    from moekit.ops.fp8_gemm import grouped_mm_fp8

    x, w, a, b, offsets = _experts(counts, T, K, N, device, rowwise)
    y = grouped_mm_fp8(a, b, offsets, out_dtype=out_dtype)
    ref = _reference(a, b, offsets, out_dtype)
    assert y.dtype == out_dtype and y.shape == (T, N)
    if not T:
        return
    err = (y.float().cpu() - ref.float()).abs().max().item()
    assert err <= tol * ref.float().abs().max().item(), f"kernel vs reference: {err}"
    # against the unquantized product the error is the recipe's own: that of the product of
    # the dequantized operands (fake quantization), plus fp32 and output rounding
    exact = _product(x, w, counts).cpu()
    fake = _product(a.dequantize(), b.dequantize(), counts).cpu()
    recipe = (fake - exact).abs().max().item()
    rounding = exact.abs().max().item() * (2**-8 if out_dtype != torch.float32 else 1e-5)
    assert (y.float().cpu() - exact).abs().max().item() <= 1.01 * recipe + rounding
    assert not y[sum(counts) :].any(), "rows past offsets[-1] are zero"


RECIPES = pytest.mark.parametrize("rowwise", [False, True], ids=["blockwise", "rowwise"])


@interp
@RECIPES
@pytest.mark.parametrize(
    "counts, T, K, N",
    [
        ([100, 0, 170], 300, 256, 192),  # an empty expert, tiles across experts, a zero tail
        ([0, 257, 0], 257, 128, 128),  # one expert with every row
        ([3, 1, 2], 6, 144, 80),  # K and N not multiples of 128: partial blocks
        ([1], 1, 128, 64),  # a single token
        ([0, 0], 0, 128, 64),  # no rows at all
    ],
)
def test_gemm_kernel_equals_reference(counts, T, K, N, rowwise):
    # Triton's interpreter runs e4m3 tl.dot exactly: the kernel equals its recipe's reference
    # (fp32 rounding: the sums may run in another order)
    _check_gemm(counts, T, K, N, tol=1e-6, rowwise=rowwise)


@interp
def test_gemm_dgrad_through_the_transposed_weight():
    # dx = dy @ w[e] per expert: the same kernel on dy (1x128 along N) and w.t(), whose
    # 128x128 scales transpose with the data (no second quantization: equal values)
    from moekit.ops.fp8_gemm import grouped_mm_fp8

    counts, T, K, N = [70, 0, 130], 200, 256, 384
    _, w, _, wq, offsets = _experts(counts, T, K, N)
    dy = torch.randn(T, N)
    wt = wq.t()
    assert wt.shape == (3, K, N) and torch.equal(wt.dequantize(), wq.dequantize().transpose(1, 2))
    dx = grouped_mm_fp8(quantize_fp8(dy), wt, offsets, out_dtype=torch.float32)
    fake = _product(quantize_fp8(dy).dequantize(), wt.dequantize(), counts)
    exact = _product(dy, w.transpose(1, 2), counts)
    assert (dx - exact).abs().max() <= 1.01 * (fake - exact).abs().max() + 1e-5
    with pytest.raises(ValueError, match="only an Fp8Tensor with axis='both'"):
        quantize_fp8(dy).t()


@interp
def test_rowwise_gemm_dgrad_through_the_per_input_channel_copy():
    # dx = dy @ w[e] contracts over N: dy per row (over N) and w with one scale per input
    # channel k (over N), quantized from w itself and stored [E, K, N]; the same kernel
    from moekit.ops.fp8_gemm import grouped_mm_fp8

    counts, T, K, N = [70, 0, 130], 200, 144, 256
    _, w, _, _, offsets = _experts(counts, T, K, N, rowwise=True)
    dy = torch.randn(T, N)
    dyq = quantize_fp8(dy, block=None)
    wd = quantize_fp8(w, axis="col", block=None, transpose=True)
    assert wd.data.shape == (3, K, N) and wd.scale.shape == (3, 1, K) and wd.shape == w.shape
    dx = grouped_mm_fp8(dyq, wd, offsets, out_dtype=torch.float32)
    assert (dx - _reference(dyq, wd, offsets, torch.float32)).abs().max() <= 1e-6 * dx.abs().max()
    fake = _product(dyq.dequantize(), wd.dequantize().transpose(1, 2), counts)
    exact = _product(dy, w.transpose(1, 2), counts)
    assert (dx - exact).abs().max() <= 1.01 * (fake - exact).abs().max() + 1e-5
    with pytest.raises(ValueError, match=r"weight's dgrad operand: quantize_fp8\(w, axis='col'"):
        quantize_fp8(w, block=None).t()


@RECIPES
def test_gemm_bf16_output(rowwise):
    # On the CPU the reference itself; under the interpreter the kernel, whose bf16 rounding
    # may land one bf16 step (2^-7 relative) away (the interpreter truncates fp32 -> bf16)
    _check_gemm([5, 0, 9], 16, 256, 64, out_dtype=torch.bfloat16, tol=2**-7, rowwise=rowwise)


def test_rowwise_error_against_blockwise_with_outliers():
    # The relation docs/fp8.md states. e4m3 rounds each value to 3 mantissa bits wherever it
    # lies within 2^-6..448 of its block's scale, so a block's outlier costs its other entries
    # nothing until it is beyond 448 / 2^-6 = 2^14.8 times them; past that they fall to
    # subnormals and zero. Blockwise confines that to the outlier's 128 block, rowwise spreads
    # it over the whole row. Here each row has two outliers of size A in the first 128 block,
    # channels the weight reads nothing from, so the exact product does not depend on A and
    # the error is the rest of the row's quantization. The recipe's math: the references.
    torch.manual_seed(0)
    T, K, N = 64, 512, 128
    offsets = torch.tensor([T], dtype=torch.int32)
    x0, w = torch.randn(T, K), torch.randn(1, N, K) / K**0.5
    w[..., :128] = 0.0
    exact = x0.double() @ w[0].double().t()
    errors = {}
    for log2a in (None, 12, 16, 18, 20):
        x = x0.clone()
        if log2a is not None:
            x[:, 5] = 2.0**log2a * torch.randn(T).sign()
            x[:, 77] = 2.0**log2a
        for rowwise in (False, True):
            y = _reference(*_quantized(x, w, rowwise, _ref_quantize), offsets, torch.float32)
            errors[log2a, rowwise] = ((y.double() - exact).norm() / exact.norm()).item()
            if not rowwise and log2a is not None:  # the other blocks, as without the outliers
                assert errors[log2a, False] == errors[None, False]
    within_range = [errors[a, True] / errors[a, False] for a in (None, 12)]
    assert max(within_range) <= 1.1, within_range  # the same e4m3 rounding: about equal
    beyond = [errors[a, True] for a in (16, 18, 20)]
    assert errors[16, True] > 2 * errors[16, False] and beyond == sorted(beyond), errors


def test_gemm_bad_input():
    from moekit.ops.fp8_gemm import grouped_mm_fp8

    x, w, a, b, offsets = _experts([4, 4], 8, 128, 64)
    with pytest.raises(TypeError, match="a must be an Fp8Tensor"):
        grouped_mm_fp8(x, b, offsets)
    with pytest.raises(ValueError, match="b must be a 3-D Fp8Tensor quantized with axis='both'"):
        grouped_mm_fp8(a, quantize_fp8(w), offsets)
    with pytest.raises(ValueError, match=r"b.data.shape\[2\] must equal K"):
        grouped_mm_fp8(a, quantize_fp8(w[..., :64], axis="both"), offsets)
    with pytest.raises(TypeError, match="out_dtype must be"):
        grouped_mm_fp8(a, b, offsets, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="offsets"):
        grouped_mm_fp8(a, b, torch.tensor([4, 9], dtype=torch.int32))  # ends past T
    # the recipes of a and b must match: a fixes it, the error names b and what it needs
    ar, br = _quantized(x, w, rowwise=True)
    with pytest.raises(ValueError, match=r"b must be .* axis='row', block=None .* a is rowwise"):
        grouped_mm_fp8(ar, b, offsets)
    with pytest.raises(ValueError, match=r"b must be .* axis='both', block=128, as a is blockw"):
        grouped_mm_fp8(a, br, offsets)
    with pytest.raises(ValueError, match=r"b must be .* transpose=True"):  # col, untransposed
        grouped_mm_fp8(ar, quantize_fp8(w, axis="col", block=None), offsets)
    with pytest.raises(ValueError, match="a must be a 2-D Fp8Tensor quantized with axis='row'"):
        grouped_mm_fp8(quantize_fp8(x, axis="col", block=None), br, offsets)


@pytest.mark.gpu
def test_gpu_gemm_matches_reference_within_promotion_rounding():
    # The tensor cores sum each block of K in their own FP8 accumulator (narrower than fp32),
    # which the per-block promotion bounds: a relative 1e-3 of the output's scale
    torch.manual_seed(0)
    _check_gemm([500, 0, 1700, 3, 845], 3072, 2048, 1536, device="cuda", tol=1e-3)
    _check_gemm([64] * 16, 1100, 7168, 256, torch.bfloat16, device="cuda", tol=1e-2)


@pytest.mark.gpu
def test_gpu_rowwise_gemm_matches_reference_within_accumulation_rounding():
    # The whole K accumulates in the tensor cores' FP8 sums (Triton's default on sm_90, as
    # torch's use_fast_accum), which carry fewer bits than fp32: a looser bound than blockwise's
    torch.manual_seed(0)
    _check_gemm([500, 0, 1700, 3, 845], 3072, 2048, 1536, device="cuda", tol=1e-2, rowwise=True)
    _check_gemm([64] * 16, 1100, 7168, 256, torch.bfloat16, device="cuda", tol=2e-2, rowwise=True)


@pytest.mark.gpu
@RECIPES
def test_gpu_gemm_sync_free_and_graph_capturable(rowwise):
    from moekit.ops.fp8_gemm import grouped_mm_fp8

    _, _, a, b, offsets = _experts([700, 300, 24], 1024, 512, 256, "cuda", rowwise)
    want = grouped_mm_fp8(a, b, offsets)
    graph, got = sync_free_capture(lambda: grouped_mm_fp8(a, b, offsets))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


# --- the FP8 weight gradient (ragged over the tokens) ----------------------------------------


def _check_wgrad(counts, T, M, N, device="cpu", tol=0.0):
    from moekit.ops.fp8_gemm import grouped_mm_fp8_wgrad
    from moekit.reference.fp8 import grouped_mm_fp8_wgrad_ref

    offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    dy, x = torch.randn(T, M, device=device), torch.randn(T, N, device=device)
    a = quantize_fp8(dy, axis="col", transpose=True)
    b = quantize_fp8(x, axis="col", transpose=True)
    dw = grouped_mm_fp8_wgrad(a, b, offsets)
    ad, sa, bd, sb = (t.cpu() for t in (a.data, a.scale, b.data, b.scale))
    ref = grouped_mm_fp8_wgrad_ref(ad, sa, bd, sb, offsets.cpu(), 128)
    assert (dw.cpu() - ref).abs().max() <= tol * ref.abs().max()
    bounds = [0, *torch.tensor(counts).cumsum(0).tolist()]

    def per_expert(p, q):
        return torch.stack([p[s:e].t() @ q[s:e] for s, e in itertools.pairwise(bounds)]).cpu()

    exact = per_expert(dy, x)
    recipe = (per_expert(a.dequantize(), b.dequantize()) - exact).abs().max()
    assert (dw.cpu() - exact).abs().max() <= 1.01 * recipe + 1e-4
    main_grad = torch.full_like(dw, 2.0)  # accumulating: an expert without tokens stays 2
    grouped_mm_fp8_wgrad(a, b, offsets, out=main_grad, accumulate=True)
    assert torch.allclose(main_grad, dw + 2.0, rtol=1e-6, atol=1e-5)


@interp
@pytest.mark.parametrize(
    "counts, T, M, N",
    [
        ([128, 0, 256, 128], 640, 192, 144),  # an empty expert, tokens past offsets[-1]
        ([0, 384, 0], 384, 64, 96),  # one expert with every token
    ],
)
def test_wgrad_kernel_equals_reference(counts, T, M, N):
    _check_wgrad(counts, T, M, N, tol=1e-6)  # the interpreter's e4m3 tl.dot is exact


def test_wgrad_cpu_reference_path():
    _check_wgrad([128, 128], 256, 32, 48)


def test_wgrad_bad_input():
    from moekit.ops.fp8_gemm import grouped_mm_fp8_wgrad

    dy, x = torch.randn(256, 32), torch.randn(256, 48)
    a = quantize_fp8(dy, axis="col", transpose=True)
    b = quantize_fp8(x, axis="col", transpose=True)
    offsets = torch.tensor([128, 256], dtype=torch.int32)
    with pytest.raises(ValueError, match="transpose=True"):
        grouped_mm_fp8_wgrad(quantize_fp8(dy, axis="col"), b, offsets)
    with pytest.raises(ValueError, match="multiples of 128"):
        grouped_mm_fp8_wgrad(a, b, torch.tensor([100, 256], dtype=torch.int32))
    with pytest.raises(ValueError, match="b must have a's 256 tokens"):
        grouped_mm_fp8_wgrad(a, quantize_fp8(x[:128], axis="col", transpose=True), offsets)
    with pytest.raises(ValueError, match=r"out must be an fp32 \[2, 32, 48\]"):
        grouped_mm_fp8_wgrad(a, b, offsets, out=torch.zeros(2, 32, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="accumulate=True needs out="):
        grouped_mm_fp8_wgrad(a, b, offsets, accumulate=True)


@pytest.mark.gpu
def test_gpu_wgrad_matches_reference_within_promotion_rounding():
    torch.manual_seed(0)
    _check_wgrad([1024, 0, 2048, 128, 896], 4352, 1536, 2048, device="cuda", tol=1e-3)


# --- the FP8 grouped linear layer: autograd and the weight cache -----------------------------


def _linear_case(counts, K, N, main_grad=False):
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    T = sum(counts) + 128  # rows past offsets[-1] too
    x = torch.randn(T, K, requires_grad=True)
    w = (torch.randn(len(counts), N, K) / K**0.5).requires_grad_()
    if main_grad:
        w.main_grad = torch.zeros(w.shape)
    return x, w, offsets


@interp
@pytest.mark.parametrize(
    "recipe, main_grad",
    [(None, False), (None, True), (Fp8Recipe("rowwise", pow2_scale=True), False)],
    ids=["blockwise", "blockwise-main_grad", "rowwise-pow2"],
)
def test_grouped_linear_fp8_forward_and_backward(recipe, main_grad):
    # Each pass equals its recipe's reference on the quantized operands the recipe names.
    # Blockwise: y from x (1x128) and w (128x128); dx from dy (1x128) and w's transpose.
    # Rowwise: y from x and w per row / output channel; dx from dy per row and w per input
    # channel. Both: dw from dy and x quantized 128x1 along the tokens, each quantization from
    # its own high-precision source, every scale a power of two with pow2_scale
    from moekit.ops.fp8_linear import grouped_linear_fp8
    from moekit.reference.fp8 import grouped_mm_fp8_wgrad_ref

    x, w, offsets = _linear_case([128, 0, 256], 256, 192, main_grad)
    rowwise, pow2 = recipe is not None, recipe is not None and recipe.pow2_scale
    if rowwise:  # a non-contiguous input, read as it is
        x = x.detach().t().contiguous().t().requires_grad_()
    y = grouped_linear_fp8(x, w, offsets, recipe=recipe)
    dy = torch.randn_like(y)
    y.backward(dy)
    block = None if rowwise else 128
    xq, dyq = (_ref_quantize(t, block=block, pow2_scale=pow2) for t in (x, dy))
    if rowwise:
        wq = _ref_quantize(w, block=None, pow2_scale=pow2)
        wd = _ref_quantize(w, axis="col", block=None, pow2_scale=pow2, transpose=True)
    else:
        wq = _ref_quantize(w, axis="both")
        wd = wq.t()
    tol = dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y, _reference(xq, wq, offsets, y.dtype), **tol)
    torch.testing.assert_close(x.grad, _reference(dyq, wd, offsets, x.dtype), **tol)
    dyt, xt = (_ref_quantize(t, axis="col", transpose=True, pow2_scale=pow2) for t in (dy, x))
    want_dw = grouped_mm_fp8_wgrad_ref(dyt.data, dyt.scale, xt.data, xt.scale, offsets, 128)
    got_dw = w.main_grad if main_grad else w.grad
    torch.testing.assert_close(got_dw, want_dw, **tol)
    assert (w.grad is None) == main_grad


def test_fp8_weight_cache_follows_the_weight_version_and_recipe():
    from moekit.ops.fp8_linear import fp8_weight

    w = torch.randn(2, 128, 128, requires_grad=True)
    first = fp8_weight(w)
    assert fp8_weight(w)[0] is first[0]  # the same copy while w is unchanged
    assert fp8_weight(w, Fp8Recipe())[0] is first[0]  # None is the default recipe
    rowwise = fp8_weight(w, Fp8Recipe("rowwise"))  # a copy of its own, beside the blockwise one
    assert rowwise[0].block is None and rowwise[1].axis == "col" and rowwise[1].transposed
    assert fp8_weight(w)[0] is first[0] and fp8_weight(w, Fp8Recipe("rowwise"))[1] is rowwise[1]
    assert fp8_weight(w, Fp8Recipe(pow2_scale=True))[0] is not first[0]
    with torch.no_grad():
        w.mul_(2.0)  # an optimizer step: in place, the version moves
    second = fp8_weight(w)
    assert second[0] is not first[0]
    torch.testing.assert_close(second[0].dequantize(), 2 * first[0].dequantize())
    assert torch.equal(second[1].data, second[0].t().data)
    from moekit.runtime.state import STATE

    assert len(STATE.fp8_weights[w]) == 1  # the older version's copies went
    with pytest.raises(TypeError, match="recipe must be an Fp8Recipe or None, got str"):
        from moekit.ops.fp8_linear import grouped_linear_fp8

        grouped_linear_fp8(torch.randn(4, 128), w, torch.tensor([4]), recipe="rowwise")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [None, Fp8Recipe("rowwise")], ids=["blockwise", "rowwise"])
def test_gpu_grouped_linear_fp8_step_sync_free_and_captured(recipe):
    from moekit.ops.fp8_linear import grouped_linear_fp8

    torch.manual_seed(0)
    counts, K, N = [1024, 0, 512, 2048], 2048, 1536
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts), K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(4, N, K, device="cuda") / K**0.5).to(torch.bfloat16).requires_grad_()
    w.main_grad = torch.zeros(w.shape, device="cuda")

    def step():
        y = grouped_linear_fp8(x, w, offsets, recipe=recipe)
        y.backward(torch.ones_like(y))

    graph, _ = sync_free_capture(step)  # three warm-up steps and one checked step
    graph.replay()  # a fifth
    torch.cuda.synchronize()
    xf, bounds = x.detach().float(), [0, 1024, 1024, 1536]
    dw = torch.stack([xf[s : s + c].sum(0).expand(N, K) for s, c in zip(bounds, counts)])
    rel = (w.main_grad / 5 - dw).norm() / dw.norm()
    assert rel < 0.05, rel  # dy of ones: dw[e] is the column sums of x's rows of e
    wf = w.detach().float()
    dx = torch.cat([wf[e].sum(0).expand(c, K) for e, c in enumerate(counts)])
    rel = (x.grad.float() / 5 - dx).norm() / dx.norm()
    assert rel < 0.05, rel  # and dx[t] the column sums of its expert's weight
