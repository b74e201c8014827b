"""The permute kernels directly, at sizes that cross their internal block boundaries.

Runs in Triton's interpreter (TRITON_INTERPRET=1) or on CUDA; skipped otherwise.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moekit.config import interpret_mode
from moekit.kernels import permute as kern
from moekit.ops.routing import max_rows, routing_metadata_torch
from moekit.reference import permute as ref
from moekit.tuning import permute as tuning

pytestmark = [
    pytest.mark.skipif(
        not (interpret_mode() or torch.cuda.is_available()),
        reason="needs TRITON_INTERPRET=1 or a CUDA GPU",
    ),
    pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning"),
]

DEVICE = "cpu" if interpret_mode() else "cuda"


def _metadata(indices, E, align, out_rows=None, config=None):
    """The three metadata launches into fresh buffers: (row_index, tpe, counts, offsets)."""
    T, k = indices.shape
    config = config or tuning.meta_config(indices.numel())
    if out_rows is None:
        out_rows = max_rows(T, k, E, align)
    outs = (
        torch.empty(indices.shape, dtype=torch.int32, device=indices.device),
        *(torch.empty(E, dtype=torch.int32, device=indices.device) for _ in range(3)),
        torch.empty(
            kern.metadata_scratch_numel(indices.numel(), E, config),
            dtype=torch.int32,
            device=indices.device,
        ),
    )
    kern.routing_metadata(indices.contiguous(), E, align, out_rows, config, outs)
    return outs[:4]


def _scatter(x, row_index, R, offsets, tpe, *, align=1, tail_lo=0, config=None, **kw):
    """scatter_rows into fresh buffers: (out [R, H], out_vals [R] or None)."""
    k, H = row_index.shape[1], x.shape[1]
    has_vals = kw.get("slot_vals") is not None or kw.get("dot_src") is not None
    out = torch.empty(R, H, dtype=x.dtype, device=x.device)
    out_vals = torch.empty(R, device=x.device) if has_vals else None
    config = config or tuning.copy_config("scatter", k, H, dot=kw.get("dot_src") is not None)
    kern.scatter_rows(
        x, row_index, offsets, tpe, out, out_vals, config, align=align, tail_lo=tail_lo, **kw
    )
    return out, out_vals


def _gather(src, row_index, *, config=None, row_vals=None, **kw):
    """gather_rows into fresh buffers: (out [T, H], out_vals [T, k] or None)."""
    T, k = row_index.shape
    out = torch.empty(T, src.shape[1], dtype=src.dtype, device=src.device)
    out_vals = torch.empty(T, k, device=src.device) if row_vals is not None else None
    config = config or tuning.copy_config("gather", k, src.shape[1])
    kern.gather_rows(src, row_index, out, config, row_vals=row_vals, out_vals=out_vals, **kw)
    return out, out_vals


def _assert_equal(got, want) -> None:
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Routing metadata
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "T,k,E,align",
    [
        (300, 4, 6, 1),  # 1200 pairs: five 256-pair blocks, the last one partly masked
        (130, 16, 3, 8),  # k = 16, few experts: long runs of one expert across blocks
        (70, 2, 1000, 16),  # E near the 1024 cap of the tests: the histogram's widest bins
        (40, 3, 1, 128),  # E = 1: every pair in one segment
        (1, 1, 5, 16),  # one pair: a block of 256 with 255 masked positions
    ],
)
def test_routing_metadata_kernel(T, k, E, align):
    # The counting sort against the torch version, masked slots in every block.
    indices = torch.randint(0, E, (T, k), device=DEVICE)
    indices[::7, 0] = -1  # masked slots (they sort after every expert)
    _assert_equal(_metadata(indices, E, align), routing_metadata_torch(indices, E, align))


def test_routing_metadata_both_default_configs():
    # Each metadata config a default reaches (few large blocks; many single-warp blocks, used
    # from 2^16 pairs on) gives the same result, here on a small N with dropped slots.
    indices = torch.randint(-1, 13, (200, 3), device=DEVICE)
    want = routing_metadata_torch(indices, 13, 16)
    for n in (600, tuning.SMALL_BLOCKS_MIN_PAIRS):
        _assert_equal(_metadata(indices, 13, 16, config=tuning.meta_config(n)), want)


def test_routing_metadata_scan_loop_and_int32_indices():
    # The scan walks the blocks in steps of scan_block_b (it loops only past 2^19 pairs with the
    # defaults); a step of 2 makes it loop here, with a running prefix carried across steps.
    # int32 indices and out-of-range experts on both sides (−1 and E) are dropped slots.
    indices = torch.randint(-1, 10, (700, 2), device=DEVICE, dtype=torch.int32)  # 6 blocks
    config = dataclasses.replace(tuning.meta_config(indices.numel()), scan_block_b=2)
    got = _metadata(indices, 9, 16, config=config)
    _assert_equal(got, routing_metadata_torch(indices, 9, 16))


@pytest.mark.parametrize("align", [1, 16])
def test_routing_metadata_out_rows(align):
    # Issue 23 defect 8: with out_rows below the rows needed, the kernels drop every slot whose
    # row would be >= R and report what was kept, exactly as the torch version does.
    indices = torch.randint(0, 5, (300, 2), device=DEVICE)
    needed = max_rows(300, 2, 5, align)
    for R in (0, 7, 300, needed // 2 + 3, needed - 1):
        got = _metadata(indices, 5, align, out_rows=R)
        _assert_equal(got, routing_metadata_torch(indices, 5, align, R))
        assert bool((got[0] < R).all()) and int(got[3][-1]) <= R


# ------------------------------------------------------------------------------------------------
# Row copies
# ------------------------------------------------------------------------------------------------


def test_scatter_weighted_dot_and_gather_vals():
    # The unpermute backward flags (WEIGHTED, DOT) and the permute backward flag (GATHER_VALS).
    T, k, E, H, align = 21, 3, 4, 48, 8
    indices = torch.randint(0, E, (T, k), device=DEVICE)
    row_index, tpe, _, offsets = _metadata(indices, E, align)
    R = max_rows(T, k, E, align)
    x = torch.randn(T, H, device=DEVICE)
    row_w = torch.rand(R, device=DEVICE)
    dot_src = torch.randn(R, H, device=DEVICE)
    out, dots = _scatter(
        x, row_index, R, offsets, tpe, align=align, tail_lo=T * k, row_weight=row_w,
        dot_src=dot_src,
    )  # fmt: skip
    want, want_dots = ref.scatter_rows_torch(x, row_index, R, row_weight=row_w, dot_src=dot_src)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(dots, want_dots)

    vals = torch.randn(R, device=DEVICE)
    summed, gathered = _gather(out, row_index, row_vals=vals)
    torch.testing.assert_close(summed, ref.gather_rows_torch(out, row_index))
    torch.testing.assert_close(gathered, vals[row_index.long()])


# (kind, k, H, dot): one case per branch of tuning.copy_config
COPY_BRANCHES = [
    ("gather", 2, 1100, False),  # the [k, BLOCK_H] tile
    ("gather", 4, 1100, False),  # loop over k into a 1-D accumulator
    ("scatter", 2, 1100, False),  # loop over k, evict-first stores
    ("scatter", 3, 4104, False),  # the tile (H past the loop_k bound)
    ("scatter", 4, 1100, True),  # the dot with 4 warps
    ("scatter", 3, 1100, True),  # the dot on the tile
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("kind,k,H,dot", COPY_BRANCHES)
def test_every_default_copy_config(kind, k, H, dot, dtype):
    # Every config the defaults reach gives the reference result with the flag sets the ops
    # use: T odd, H with a partial last chunk, dropped slots and padding rows.
    T, E, align = 7, 5, 8
    indices = torch.randint(0, E, (T, k), device=DEVICE)
    indices[::4, 1] = -1
    row_index, tpe, _, offsets = _metadata(indices, E, align)
    R = max_rows(T, k, E, align)
    x = torch.randn(T, H, device=DEVICE).to(dtype)
    src = torch.randn(R, H, device=DEVICE).to(dtype)
    row_w = torch.rand(R, device=DEVICE)
    if kind == "scatter" and not dot:  # permute forward: rows and probs, padding zeroed
        slot_vals = torch.rand(T, k, device=DEVICE)
        got = _scatter(x, row_index, R, offsets, tpe, align=align, slot_vals=slot_vals)
        _assert_equal(got, ref.scatter_rows_torch(x, row_index, R, slot_vals))
    elif kind == "scatter":  # unpermute backward: weighted rows, the prob gradient as a dot
        out, dots = _scatter(
            x, row_index, R, offsets, tpe, align=align, row_weight=row_w, dot_src=src
        )
        want, want_dots = ref.scatter_rows_torch(x, row_index, R, row_weight=row_w, dot_src=src)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        torch.testing.assert_close(dots, want_dots, rtol=1e-4, atol=1e-3)
    else:  # unpermute forward (weighted), permute backward (probs' gradient alongside)
        out, _ = _gather(src, row_index, row_weight=row_w)
        want = ref.gather_rows_torch(src, row_index, row_w)
        torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)
        out, vals = _gather(src, row_index, row_vals=row_w)
        torch.testing.assert_close(out, ref.gather_rows_torch(src, row_index), rtol=2e-3, atol=2e-3)
        keep = row_index >= 0
        want_vals = torch.where(keep, row_w[torch.where(keep, row_index, 0).long()], 0.0)
        torch.testing.assert_close(vals, want_vals, rtol=0, atol=0)


def test_scatter_respects_num_rows():
    # Rows at or past R are never written, whatever row_index says.
    T, k, E, H = 8, 2, 2, 16
    indices = torch.zeros(T, k, dtype=torch.long, device=DEVICE)
    row_index, tpe, _, offsets = _metadata(indices, E, 1)
    out, _ = _scatter(torch.ones(T, H, device=DEVICE), row_index, 5, offsets, tpe)
    assert out.shape == (5, H) and bool((out == 1).all())


GUARD = 64  # rows after the output, which no launch may touch


def _guarded_out(R: int, H: int, dtype=torch.float32):
    """An [R, H] output at the head of a larger buffer whose last GUARD rows hold a sentinel."""
    buf = torch.full((R + GUARD, H), 7.0, dtype=dtype, device=DEVICE)
    return buf, buf[:R]


@pytest.mark.parametrize("align", [8, 32])
def test_dropping_permute_never_writes_past_r(align):
    # Issue 23 defect 8: with align and out_rows below the rows needed, the padding zero-fill
    # must stop at R (uncut offsets would send it past the output): guard rows stay intact.
    T, k, E, H = 40, 2, 6, 16
    indices = torch.randint(0, E, (T, k), device=DEVICE)
    R = max_rows(T, k, E, align) // 2
    row_index, tpe, _, offsets = _metadata(indices, E, align, out_rows=R)
    buf, out = _guarded_out(R, H)
    vals_buf = torch.full((R + GUARD,), 7.0, device=DEVICE)
    x, probs = torch.randn(T, H, device=DEVICE), torch.rand(T, k, device=DEVICE)
    config = tuning.copy_config("scatter", k, H)
    kern.scatter_rows(
        x, row_index, offsets, tpe, out, vals_buf[:R], config, slot_vals=probs, align=align
    )
    assert bool((buf[R:] == 7).all()) and bool((vals_buf[R:] == 7).all())
    want, want_vals = ref.scatter_rows_torch(x, row_index, R, probs)
    _assert_equal((out, vals_buf[:R]), (want, want_vals))


@pytest.mark.parametrize("align", [1, 16, 128])
def test_scatter_bounds_zero_fill_by_r(align):
    # The kernel itself bounds its zero-fills by R: handed segments that run past the output
    # (metadata of the uncut routing), it still writes nothing at or past R.
    T, k, E, H = 30, 2, 3, 16
    indices = torch.randint(0, E, (T, k), device=DEVICE)
    row_index, tpe, _, offsets = _metadata(indices, E, align)  # nothing cut
    R = int(offsets[-1]) - 5
    buf, out = _guarded_out(R, H)
    x = torch.randn(T, H, device=DEVICE)
    kern.scatter_rows(
        x, row_index, offsets, tpe, out, None, tuning.copy_config("scatter", k, H), align=align
    )
    assert bool((buf[R:] == 7).all())
    _assert_equal((out,), (ref.scatter_rows_torch(x, row_index, R)[0],))


@pytest.mark.parametrize("bad", [3, 5, -1])  # in [C, C_PAD), past C_PAD, negative
def test_chunk_row_map_never_writes_past_its_scratch(bad):
    """An unchecked sorted_index that is no permutation gives an undefined row map, but the
    kernel writes nothing outside its [2·C] scratch (ids were once clamped to the padded
    block, not to C)."""
    C = 3
    sizes = torch.tensor([2, 2, 2], dtype=torch.int32, device=DEVICE)
    index = torch.tensor([0, 1, bad], dtype=torch.int32, device=DEVICE)
    guarded = torch.full((2 * C + 8,), -7, dtype=torch.int64, device=DEVICE)
    out = torch.empty(6, dtype=torch.int32, device=DEVICE)
    kern.sort_chunks_row_map(sizes, index, out, guarded[: 2 * C])
    assert (guarded[2 * C :] == -7).all()
    # a permutation still gives the reordered rows
    index = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEVICE)
    kern.sort_chunks_row_map(sizes, index, out, guarded[: 2 * C])
    assert out.tolist() == [2, 3, 4, 5, 0, 1]
