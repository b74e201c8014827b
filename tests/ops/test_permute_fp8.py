"""permute(..., fp8=): each token quantized once in the row copy (Triton's interpreter on CPU, the
GPU with ``-m gpu``) equals quantizing the bf16 permuted rows (the reference), bit for bit, with
zero bytes and zero scales in the padding; an Fp8Tensor's rows and scales move as they are;
gradients reach the tokens and the probs; the rows quantize again along the tokens straight from
the tokens (``requantize_fp8``, ``quantize_fp8(rows=)``)."""

from __future__ import annotations

import pytest
import torch

from moekit.ops import Fp8Recipe, permute
from moekit.ops.quantize import quantize_fp8, requantize_fp8
from moekit.reference.fp8 import quantize_fp8_ref
from moekit.reference.permute import gather_rows_torch

CASES = [  # (T, H, E, k, options): why
    (37, 300, 5, 2, dict(align=128)),  # H not a multiple of 128: a partial last block
    (64, 256, 4, 2, dict(align=128, capacity_factor=0.5)),  # capacity drops
    (1, 128, 8, 2, dict(align=128)),  # a single token, most experts idle
    (50, 128, 3, 3, dict()),  # packed rows (no padding), every expert per token
]


def _routing(T, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if T > 3:
        ids[3, 0] = -1  # a slot routed to no expert
    return ids, torch.rand(T, k, generator=g)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-H{c[1]}-E{c[2]}-k{c[3]}")
def test_quantized_rows_equal_quantizing_the_permuted_rows(case, pow2):
    T, H, E, k, opts = case
    ids, p = _routing(T, E, k, seed=T)
    x = torch.randn(T, H) * 4
    d = permute(x, ids, p, num_experts=E, fp8=Fp8Recipe(pow2_scale=pow2), **opts)
    rows = {} if "capacity_factor" in opts else dict(out_rows=d.num_rows)
    ref = permute(x, ids, p, num_experts=E, **rows, **opts)
    assert d.num_rows % 128 == 0 and torch.equal(d.offsets, ref.offsets)
    q = d.hidden
    data, scale = quantize_fp8_ref(ref.hidden, "row", 128, pow2)
    written = torch.zeros(d.num_rows, dtype=torch.bool)
    written[d.row_index[d.row_index >= 0].long()] = True
    assert torch.equal(_bytes(q.data)[written], _bytes(data)[written])
    assert torch.equal(q.scale[written], scale[written])
    assert torch.equal(d.probs[written], ref.probs[written])
    # every other row is zero, but those between offsets[-1] and T·k a −1 slot may leave
    # unwritten without padding (permute's documented contract)
    zeroed = ~written
    if not opts.get("align"):
        zeroed[int(d.offsets[-1]) : T * k] = False
    assert not _bytes(q.data)[zeroed].any() and not q.scale[zeroed].any(), "zero padding"


def test_gradients_reach_the_tokens_and_the_probs():
    T, H, E, k = 40, 256, 4, 2
    ids, p = _routing(T, E, k, seed=1)
    x = torch.randn(T, H, requires_grad=True)
    p.requires_grad_()
    d = permute(x, ids, p, num_experts=E, align=128, fp8=Fp8Recipe())
    g, gp = torch.randn(d.num_rows, H), torch.randn(d.num_rows)
    ((d.hidden.anchor * g).sum() + (d.probs * gp).sum()).backward()
    assert torch.allclose(x.grad, gather_rows_torch(g, d.row_index))
    valid = d.row_index >= 0
    want = torch.where(valid, gp[d.row_index.clamp(min=0).long()], 0.0)
    assert torch.allclose(p.grad, want)


def test_an_fp8_tensor_moves_with_its_scales():
    T, H, E, k = 33, 384, 3, 2
    ids, p = _routing(T, E, k, seed=2)
    x = torch.randn(T, H, requires_grad=True)
    fused = permute(x, ids, p, num_experts=E, align=128, fp8=Fp8Recipe())
    moved = permute(quantize_fp8(x), ids, p, num_experts=E, align=128)
    assert torch.equal(_bytes(moved.hidden.data), _bytes(fused.hidden.data))
    assert torch.equal(moved.hidden.scale, fused.hidden.scale)
    g = torch.randn(moved.num_rows, H)
    (moved.hidden.anchor * g).sum().backward()
    assert torch.allclose(x.grad, gather_rows_torch(g, moved.row_index))


def test_probs_train_through_rows_that_need_no_gradient():
    # tokens quantized without a gradient, probs with one: the rows keep the tokens' dtype
    T, H, E, k = 20, 128, 2, 2
    ids, p = _routing(T, E, k, seed=5)
    p.requires_grad_()
    x = torch.randn(T, H).to(torch.bfloat16)
    d = permute(quantize_fp8(x), ids, p, num_experts=E, align=128)
    assert d.hidden.orig_dtype == torch.bfloat16 and d.hidden.anchor.dtype == torch.bfloat16
    d.probs.sum().backward()
    assert torch.equal(p.grad, (d.row_index >= 0).float())


def test_rows_quantize_along_the_tokens_from_the_tokens():
    # no second rounding: the same as quantizing the bf16 permuted rows along the tokens
    T, H, E, k = 70, 256, 3, 2
    ids, p = _routing(T, E, k, seed=3)
    x = torch.randn(T, H).to(torch.bfloat16)
    d = permute(x, ids, p, num_experts=E, align=128, fp8=Fp8Recipe())
    ref = permute(x, ids, p, num_experts=E, align=128, out_rows=d.num_rows)
    got = requantize_fp8(d.hidden, axis="col", transpose=True)
    want = quantize_fp8(ref.hidden, axis="col", transpose=True)
    assert got.data.shape == (H, d.num_rows)
    assert torch.equal(_bytes(got.data), _bytes(want.data)) and torch.equal(got.scale, want.scale)


def test_bad_input():
    x, ids = torch.randn(8, 128), torch.zeros(8, 1, dtype=torch.int64)
    with pytest.raises(TypeError, match="fp8 must be"):
        permute(x, ids, num_experts=2, fp8="e4m3")
    with pytest.raises(ValueError, match="quantized along H"):
        permute(quantize_fp8(x, axis="col"), ids, num_experts=2)
    with pytest.raises(ValueError, match="rows must be a 1-D"):
        quantize_fp8(x, axis="col", rows=torch.zeros(2, 2, dtype=torch.int32))


@pytest.mark.gpu
def test_gpu_quantized_rows_equal_the_reference():
    T, H, E, k = 4096, 2048, 64, 8
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).cuda()
    p = torch.rand(T, k, device="cuda")
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    d = permute(x, ids, p, num_experts=E, align=128, fp8=Fp8Recipe())
    ref = permute(x, ids, p, num_experts=E, align=128, out_rows=d.num_rows)
    data, scale = quantize_fp8_ref(ref.hidden.cpu(), "row", 128, False)
    written = torch.zeros(d.num_rows, dtype=torch.bool)
    written[d.row_index[d.row_index >= 0].long().cpu()] = True  # padding rows: zero scales
    assert torch.equal(_bytes(d.hidden.data).cpu()[written], _bytes(data)[written])
    assert torch.equal(d.hidden.scale.cpu()[written], scale[written])
    assert not d.hidden.scale.cpu()[~written].any()
    got = requantize_fp8(d.hidden, axis="col", transpose=True)
    want = quantize_fp8(ref.hidden, axis="col", transpose=True)
    assert torch.equal(_bytes(got.data), _bytes(want.data)) and torch.equal(got.scale, want.scale)
