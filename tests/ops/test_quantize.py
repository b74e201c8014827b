"""Blockwise and rowwise e4m3 quantization: the kernels (Triton's interpreter on CPU, the GPU with
``-m gpu``) against the reference bit for bit, the recipe's error bound, the edge cases (partial
blocks, a single element, zero blocks, NaN and inf, non-contiguous input, empty input), bad
input, and the :class:`Fp8Recipe` option's checks."""

from __future__ import annotations

import pytest
import torch

from moekit.config import interpret_mode
from moekit.ops.quantize import Fp8Recipe, Fp8Tensor, quantize_fp8, quantize_fp8_two_ways
from moekit.reference.fp8 import quantize_fp8_ref, round_e4m3, scale_shape
from tests._cuda_step import sync_free_capture

interp = pytest.mark.skipif(
    not interpret_mode(), reason="the kernel on CPU needs TRITON_INTERPRET=1"
)

# (shape, axis, block): whole and partial blocks, a single element, batched weights
CASES = [
    ((70, 300), "row", 128),  # K not a multiple of the block: a partial last block
    ((3, 5, 40), "row", 16),  # leading dims flattened into rows
    ((1, 7), "row", 128),  # one row, one partial block
    ((200, 130), "col", 128),  # token-wise blocks (wgrad operands), M partial
    ((2, 65, 33), "col", 32),
    ((3, 200, 130), "both", 128),  # per-expert weights [E, N, K], both sides partial
    ((1, 1), "both", 16),  # a single element
    # rowwise (block=None): one scale per whole row / column, the kernel looping over it twice
    ((70, 300), "row", None),  # two steps along K, the last one partial
    ((3, 5, 40), "row", None),  # leading dims flattened into rows
    ((2, 300, 33), "col", None),  # per column of a batch of weights: two steps along M
    ((1, 1), "row", None),  # a single element
]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits (signed zeros included), any NaN equal to any NaN."""
    a, b = a.cpu(), b.cpu()
    nan = a.float().isnan() & b.float().isnan()
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    else:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return bool(((a == b) | nan).all())


def _check(x: torch.Tensor, axis: str, block: int, pow2: bool) -> Fp8Tensor:
    q = quantize_fp8(x, axis=axis, block=block, pow2_scale=pow2)
    data, scale = quantize_fp8_ref(x.cpu(), axis, block, pow2)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == x.shape
    assert q.scale.dtype == torch.float32
    assert tuple(q.scale.shape) == scale_shape(x.shape, axis, block)
    assert _same(q.data, data), "data differs from the reference"
    assert _same(q.scale, scale), "scales differ from the reference"
    return q


def _error_within_recipe(x: torch.Tensor, q: Fp8Tensor) -> None:
    """e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most 2^-4 of
    itself, and a value below e4m3's smallest normal (2^-6 · scale) by at most half the
    subnormal spacing, 2^-10 · scale."""
    ones = torch.ones(q.shape, device=q.device).to(torch.float8_e4m3fn)
    scale = Fp8Tensor(ones, q.scale, q.axis, q.block).dequantize()  # each element's scale
    bound = torch.maximum(x.float().abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
    assert ((q.dequantize() - x.float()).abs() <= bound).all()


@interp
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}{c[2]}-{'x'.join(map(str, c[0]))}")
def test_kernel_equals_reference(case, pow2):
    shape, axis, block = case
    torch.manual_seed(0)
    x = torch.randn(*shape) * 10
    q = _check(x, axis, block, pow2)
    _error_within_recipe(x, q)
    if pow2:
        m = q.scale.view(torch.int32) & 0x7FFFFF
        assert (m == 0).all(), "pow2 scales are powers of two"


@interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes_and_strides(dtype):
    # bf16 loads are fine in the interpreter (only its tl.dot on bf16 is wrong)
    x = (torch.randn(300, 96) * 3).to(dtype)
    _check(x.t(), "row", 128, False)  # non-contiguous (a transposed view)
    _check(x[::2], "col", 64, False)  # every other row
    _check(x, "both", 32, True)
    _check(x.t(), "row", None, False)  # rowwise, the transposed view read as it is
    _check(x[::2], "col", None, True)


@interp
@pytest.mark.parametrize("block", [128, None], ids=["blockwise", "rowwise"])
def test_zero_blocks_nan_and_inf(block):
    # rowwise the block is the whole row: one inf entry turns its whole row to zeros and NaN
    # (a non-finite loss), where blockwise loses only the entry's 128 block
    x = torch.randn(4, 300)
    x[0] = 0.0  # an all-zero block: scale 1, data 0
    x[1, 3] = float("nan")  # left out of its block's amax, quantized to NaN
    x[2, 130] = float("inf")  # its block's scale is inf: finite entries 0, the inf NaN
    q = _check(x, "row", block, False)

    def block_of(col):  # (scale index, columns) of column col's block
        if block is None:
            return 0, slice(None)
        return col // 128, slice(col // 128 * 128, (col // 128 + 1) * 128)

    assert (q.scale[0] == 1).all() and (q.data[0].float() == 0).all()
    kb, cols = block_of(3)
    assert q.data[1, 3].float().isnan() and q.scale[1, kb].isfinite()
    assert q.data[1, cols].float().isnan().sum() == 1
    kb, cols = block_of(130)
    assert q.scale[2, kb] == float("inf") and q.data[2, 130].float().isnan()
    assert (q.data[2, cols].float().nan_to_num(0.0) == 0).all()


@interp
def test_empty_input():
    for axis in ("row", "col", "both"):
        q = _check(torch.randn(0, 64), axis, 32, False)
        assert q.data.numel() == 0
    # rowwise over empty rows / columns: one scale per row or column still, that of a zero block
    for shape, axis in (((0, 64), "row"), ((4, 0), "row"), ((0, 64), "col"), ((3, 0, 8), "col")):
        q = _check(torch.randn(shape), axis, None, False)
        assert (q.scale == 1).all() and q.block is None


def test_cpu_reference_path_matches_the_recipe():
    # Without the interpreter CPU tensors run the reference: the recipe's bound holds there too
    x = torch.randn(3, 96, 160) * 5
    for axis, block in (("row", 128), ("col", 128), ("both", 128), ("row", None), ("col", None)):
        _error_within_recipe(x, quantize_fp8(x, axis=axis, block=block))


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        ({"axis": "rows"}, ValueError, "axis must be one of"),
        ({"block": 100}, ValueError, "block must be one of"),
        ({"block": True}, ValueError, "block must be one of"),
        ({"axis": "both", "block": None}, ValueError, "block=None .* applies to axis='row' or"),
        ({"pow2_scale": 1}, TypeError, "pow2_scale must be a bool"),
    ],
)
def test_bad_options(kwargs, err, match):
    with pytest.raises(err, match=match):
        quantize_fp8(torch.randn(4, 128), **kwargs)


def test_bad_input():
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        quantize_fp8([1.0, 2.0])
    with pytest.raises(TypeError, match="x must have dtype"):
        quantize_fp8(torch.ones(4, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., M, K\] for axis='col'"):
        quantize_fp8(torch.randn(128), axis="col")
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., K\]"):
        quantize_fp8(torch.tensor(1.0))


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [False, True])
def test_gpu_kernel_equals_reference(pow2):
    torch.manual_seed(0)
    for shape, axis, block in [*CASES, ((4096, 7168), "row", 128), ((4096, 7168), "col", 128),
                               ((8, 4096, 2048), "both", 128), ((2048, 28672), "row", None),
                               ((8, 4096, 2048), "col", None)]:  # fmt: skip
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(*shape, device="cuda") * 10).to(dtype)
            _error_within_recipe(x, _check(x, axis, block, pow2))
            x.view(-1)[0] = float("nan")
            _check(x, axis, block, pow2)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [128, None])
def test_gpu_sync_free_and_graph_capturable(block):
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    want = quantize_fp8(x, block=block)
    graph, got = sync_free_capture(lambda: quantize_fp8(x, block=block))
    graph.replay()
    torch.cuda.synchronize()
    assert _same(got.data, want.data) and torch.equal(got.scale, want.scale)


def test_reference_rounds_to_nearest_even():
    # The oracle's own rounding against the nearest e4m3 value found by search in float64,
    # including the ties (midpoints between neighbours) and values whose rounding carries into
    # the next binade, where torch's CPU float8 cast and Triton's interpreter go wrong.
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([(torch.rand(100_000, dtype=torch.float64) * 2 - 1) * 448, mids, -mids])
    x = x.float()
    i = torch.searchsorted(grid, x.double()).clamp(1, len(grid) - 1)
    lo, hi = grid[i - 1], grid[i]
    d_lo, d_hi = (x.double() - lo).abs(), (hi - x.double()).abs()
    lo_even = (lo.float().to(torch.float8_e4m3fn).view(torch.uint8) & 1) == 0
    want = torch.where((d_lo < d_hi) | ((d_lo == d_hi) & lo_even), lo, hi)
    assert torch.equal(round_e4m3(x).double(), want)
    assert torch.equal(
        round_e4m3(torch.tensor([183.99998, -30.999998])), torch.tensor([176.0, -30.0])
    )


@interp
@pytest.mark.parametrize("axis, block", [("col", 128), ("both", 128), ("col", None)])
def test_transposed_output(axis, block):
    # the same quantization, stored [.., K, M] in the same pass (col, None: a rowwise weight's
    # dgrad operand, data [E, K, N] with one scale per k)
    x = torch.randn(2, 200, 96) * 4
    q = quantize_fp8(x, axis=axis, block=block)
    qt = quantize_fp8(x, axis=axis, block=block, transpose=True)
    assert qt.transposed and qt.shape == x.shape and qt.data.shape == (2, 96, 200)
    assert qt.data.is_contiguous() and _same(qt.data.transpose(-2, -1), q.data)
    assert torch.equal(qt.scale, q.scale) and torch.equal(qt.dequantize(), q.dequantize())
    with pytest.raises(ValueError, match="transpose applies to axis='col' or 'both'"):
        quantize_fp8(x, transpose=True)


@pytest.mark.parametrize("axis", ["row", "col", "both"])
def test_rows_quantize_a_gathered_tensor(axis):
    # rows[m] picks x's row (−1: a zero row), quantized as if gathered first
    x = torch.randn(50, 200) * 3
    rows = torch.tensor([4, -1, 49, 0, 0, -1, 17] * 30, dtype=torch.int32)
    got = quantize_fp8(x, axis=axis, rows=rows, transpose=axis != "row")
    gathered = torch.where((rows >= 0)[:, None], x[rows.clamp(min=0).long()], 0.0)
    want = quantize_fp8(gathered, axis=axis, transpose=axis != "row")
    assert _same(got.data, want.data) and _same(got.scale, want.scale)


def test_the_anchor_passes_the_gradient_straight_through():
    x = torch.randn(6, 64, requires_grad=True)
    q = quantize_fp8(x)
    assert q.anchor.shape == x.shape and q.anchor.stride() == (0, 0), "no storage of its own"
    g = torch.randn(6, 64)
    (q.anchor * g).sum().backward()
    assert torch.equal(x.grad, g)
    assert quantize_fp8(x.detach()).anchor is None


def test_fp8_recipe_checks_its_fields():
    assert Fp8Recipe() == Fp8Recipe("blockwise", False)
    assert {Fp8Recipe("rowwise"): 1}.get(Fp8Recipe("rowwise", True)) is None  # a cache key
    with pytest.raises(ValueError, match=r"Fp8Recipe\.scaling must be one of .*got 'row'"):
        Fp8Recipe("row")
    with pytest.raises(TypeError, match=r"Fp8Recipe\.scaling must be a str, got int"):
        Fp8Recipe(1)
    with pytest.raises(TypeError, match=r"Fp8Recipe\.pow2_scale must be a bool, got int"):
        Fp8Recipe(pow2_scale=1)


def _every_e4m3_value(device: str) -> None:
    """Every finite e4m3 value, the midpoints between neighbours (ties to even) and both signs,
    in rows whose amax is 448 (scale 1): the kernel's bytes, assembled from fp32 bits, equal
    the reference's."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique()
    vals = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])
    vals = torch.cat([vals, -vals])
    rows = -(-vals.numel() // 127)
    body = torch.nn.functional.pad(vals, (0, rows * 127 - vals.numel())).view(rows, 127)
    x = torch.cat([torch.full((rows, 1), 448.0), body], dim=1).to(device)
    for axis, t in (("row", x), ("col", x.t())):  # the column kernel's layout too
        q = _check(t, axis, 128, False)
        assert (q.scale == 1).all()


@interp
def test_kernel_bytes_for_every_e4m3_value_and_midpoint():
    _every_e4m3_value("cpu")


@pytest.mark.gpu
def test_gpu_kernel_bytes_for_every_e4m3_value_and_midpoint():
    _every_e4m3_value("cuda")


def _check_two_ways(x: torch.Tensor, pow2: bool) -> None:
    """quantize_fp8_two_ways: the row copy and its .col equal quantize_fp8's two calls, bit for
    bit (the reference's on CPU)."""
    q = quantize_fp8_two_ways(x, pow2_scale=pow2)
    row = quantize_fp8(x, pow2_scale=pow2)
    col = quantize_fp8(x, axis="col", transpose=True, pow2_scale=pow2)
    assert q.axis == "row" and q.block == 128 and q.col.axis == "col" and q.col.transposed
    assert q.data.shape == x.shape and q.col.data.shape == (x.shape[1], x.shape[0])
    for got, want in ((q.data, row.data), (q.scale, row.scale), (q.col.data, col.data),
                      (q.col.scale, col.scale)):  # fmt: skip
        assert got.shape == want.shape and _same(got, want)


@interp
@pytest.mark.parametrize("pow2", [False, True])
# whole tiles; M and K partial; one row; one column; a zero block; non-contiguous
@pytest.mark.parametrize("shape", [(256, 256), (200, 300), (1, 130), (129, 1), (0, 128)])
def test_two_ways_equals_the_two_quantizations(shape, pow2):
    torch.manual_seed(1)
    x = torch.randn(*shape) * 10
    if x.numel():
        x[:, :1] = 0.0
    _check_two_ways(x, pow2)
    _check_two_ways(torch.randn(shape[1], shape[0]).t() * 3, pow2)


def test_two_ways_bad_input():
    with pytest.raises(ValueError, match=r"x must be \[M, K\], got shape \(2, 3, 4\)"):
        quantize_fp8_two_ways(torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match="pow2_scale must be a bool, got int"):
        quantize_fp8_two_ways(torch.randn(4, 4), pow2_scale=1)
    with pytest.raises(TypeError, match=r"x must have dtype in .*, got int32"):
        quantize_fp8_two_ways(torch.randn(4, 4).to(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [False, True])
def test_gpu_two_ways_equals_the_two_quantizations(pow2):
    torch.manual_seed(0)
    for shape in [(131072, 2048), (200, 300), (1, 130), (16384, 4096)]:
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(*shape, device="cuda") * 10).to(dtype)
            x.view(-1)[0] = float("nan")
            _check_two_ways(x, pow2)
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    want = quantize_fp8_two_ways(x)
    graph, got = sync_free_capture(lambda: quantize_fp8_two_ways(x))
    graph.replay()
    torch.cuda.synchronize()
    assert _same(got.data, want.data) and _same(got.col.data, want.col.data)
