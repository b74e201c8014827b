"""moekit.ops.permute / unpermute / sort_chunks_by_index against the PyTorch reference.

On CPU with TRITON_INTERPRET=1 the ops run the Triton kernels in the interpreter (small shapes);
`pytest -m gpu` runs the real shapes on CUDA, including sync-freedom and CUDA-graph replay.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moekit.config import interpret_mode
from moekit.ops import routing
from moekit.ops.permute import Dispatch, permute, sort_chunks_by_index, unpermute
from moekit.reference import permute as ref
from moekit.runtime.cache import cache_clear, cache_entries
from moekit.runtime.op import dispatcher_only
from tests.reference.test_permute_reference import CASES, make_routing, naive_dispatch

# The interpreter's scalar conversions warn under numpy >= 1.25; noise, not a finding.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

H_ODD = 40  # a multiple of 8 but not of 16: exercises the masked tail of a BLOCK_H chunk


def _routing(T, E, k, kind="random", device="cpu"):
    if T == 0:
        return torch.zeros(0, k, dtype=torch.long, device=device), torch.zeros(0, k, device=device)
    indices, probs = make_routing(T, E, k, kind)
    return indices.to(device), probs.to(device)


def _ref_dispatch(hidden, indices, probs, E, align, num_rows):
    """Reference forward: (row_index, tpe, counts, offsets, permuted, permuted_probs)."""
    meta = routing.routing_metadata_torch(indices, E, align or 1, num_rows)
    out, out_probs = ref.scatter_rows_torch(hidden, meta[0], num_rows, probs)
    return (*meta, out, out_probs)


def _check_invariants(d: Dispatch, hidden: torch.Tensor, indices: torch.Tensor) -> None:
    """Structure every dispatch must have, whatever the routing."""
    T, k = indices.shape
    E, R = d.num_experts, d.num_rows
    a = d.align or 1
    assert d.hidden.shape == (R, hidden.shape[1]) and d.hidden.dtype == hidden.dtype
    assert d.offsets.dtype == torch.int32 and d.counts.dtype == torch.int32
    counts, offsets, tpe = d.counts.long(), d.offsets.long(), d.tokens_per_expert.long()
    assert int(tpe.sum()) == int((d.row_index >= 0).sum())
    if d.dropless:
        assert int(tpe.sum()) == T * k and d.capacity is None
    if d.capacity is not None:  # every expert keeps at most its capacity, in whole segments
        assert d.num_rows == E * d.capacity and bool((tpe <= d.capacity).all())
    assert torch.equal(offsets, torch.cumsum(counts, 0))
    starts = offsets - counts
    assert bool((starts % a == 0).all()) and bool((counts % a == 0).all())
    assert bool((counts >= tpe).all()) and bool((counts - tpe < a).all())
    assert int(offsets[-1]) <= R
    # Undo ∘ do: every kept slot's row holds its token, inside its expert's segment, in order.
    rows = d.row_index.long()
    kept = rows >= 0
    tok = torch.arange(T)[:, None].expand(T, k)
    assert torch.equal(d.hidden[rows[kept]], hidden[tok[kept]])
    e = indices.long()[kept]
    assert bool((rows[kept] >= starts[e]).all()) and bool((rows[kept] < starts[e] + tpe[e]).all())
    assert rows[kept].unique().numel() == rows[kept].numel()
    # Rows that no slot names (padding and the tail) are zero, probs too.
    used = torch.zeros(R, dtype=torch.bool)
    used[rows[kept]] = True
    assert not d.hidden[~used].any()
    if d.probs is not None:
        assert not d.probs[~used].any()
    for ex in range(E):  # tokens keep their original order inside an expert
        r = rows[kept][e == ex]
        assert torch.equal(r, r.sort().values)


# ------------------------------------------------------------------------------------------------
# Forward against the reference
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,E,k,kind", CASES)
@pytest.mark.parametrize("align", [None, 16])
def test_permute_unpermute_match_reference(T, E, k, kind, align):
    # Every Dispatch field and both ops against the reference, over the routing corner cases.
    indices, probs = _routing(T, E, k, kind)
    hidden = torch.randn(T, H_ODD)
    d = permute(hidden, indices, probs, num_experts=E, align=align)
    R = T * k + (min(E, T * k) * (align - 1) if align else 0)
    assert d.num_rows == R and (d.num_tokens, d.topk, d.num_experts, d.align) == (T, k, E, align)
    want = _ref_dispatch(hidden, indices, probs, E, align, R)
    got = (d.row_index, d.tokens_per_expert, d.counts, d.offsets, d.hidden, d.probs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    _check_invariants(d, hidden, indices)
    oracle = naive_dispatch(indices, E, align or 1)
    assert torch.equal(d.row_index, oracle["row_index"])
    # Weighted combine of the untouched rows gives the tokens back (probs sum to one).
    expert_out = torch.randn_like(d.hidden)
    y = unpermute(expert_out, d)
    torch.testing.assert_close(y, ref.gather_rows_torch(expert_out, d.row_index, d.probs))
    torch.testing.assert_close(unpermute(d.hidden, d), hidden)
    y0 = unpermute(expert_out, d, weighted=False)
    torch.testing.assert_close(y0, ref.gather_rows_torch(expert_out, d.row_index))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes(dtype):
    # Each supported float dtype keeps its dtype through permute and unpermute.
    T, E, k = 19, 6, 2
    indices, probs = _routing(T, E, k)
    hidden = torch.randn(T, H_ODD).to(dtype)
    d = permute(hidden, indices, probs.to(dtype), num_experts=E, align=8)
    assert d.hidden.dtype == dtype and d.probs.dtype == dtype
    _check_invariants(d, hidden, indices)
    y = unpermute(d.hidden, d)
    assert y.dtype == dtype
    want = ref.gather_rows_torch(d.hidden, d.row_index, d.probs)
    torch.testing.assert_close(y, want)


@pytest.mark.parametrize("align", [8, 32, 64, 128])
def test_every_align(align):
    # Prime E and few tokens: most segments are mostly padding, some experts are empty.
    T, E, k = 10, 11, 2
    indices, probs = _routing(T, E, k)
    hidden = torch.randn(T, 16)
    d = permute(hidden, indices, probs, num_experts=E, align=align)
    assert d.num_rows == T * k + min(E, T * k) * (align - 1)
    _check_invariants(d, hidden, indices)


def test_out_rows():
    # out_rows="exact" (one sync) and a caller bound above the rows needed both keep every slot.
    T, E, k = 12, 5, 2
    indices, probs = _routing(T, E, k)
    hidden = torch.randn(T, 16)
    d = permute(hidden, indices, probs, num_experts=E, align=8, out_rows="exact")
    assert d.num_rows == int(d.offsets[-1])
    _check_invariants(d, hidden, indices)
    # A caller-known bound larger than needed: the tail is zero.
    d2 = permute(hidden, indices, probs, num_experts=E, out_rows=T * k + 8)
    assert d2.num_rows == T * k + 8
    _check_invariants(d2, hidden, indices)
    torch.testing.assert_close(unpermute(d2.hidden, d2), hidden)


@pytest.mark.parametrize("align", [None, 8])
def test_capacity_factor(align):
    # Capacity drops the lowest probs per expert; dropped slots give zeros back.
    T, E, k = 24, 4, 2
    indices, probs = _routing(T, E, k, "one_expert")  # overflows the favourite expert
    hidden = torch.randn(T, 16)
    d = permute(hidden, indices, probs, num_experts=E, align=align, capacity_factor=1.0)
    a = align or 1
    capacity = -(-(T * k // E) // a) * a
    assert d.num_rows == E * capacity and not d.dropless
    assert d.capacity == capacity == routing.expert_capacity(1.0, T, k, E, a)
    assert bool((d.tokens_per_expert <= capacity).all())
    _check_invariants(d, hidden, indices)
    kept_idx = routing.capacity_drop(indices, probs, E, capacity)
    assert torch.equal(d.row_index >= 0, kept_idx >= 0)
    # Every dropped slot is one whose prob is lower than all kept slots of its expert.
    for e in range(E):
        mine = indices == e
        kept_p, dropped_p = probs[mine & (d.row_index >= 0)], probs[mine & (d.row_index < 0)]
        if dropped_p.numel():
            assert float(dropped_p.max()) <= float(kept_p.min())
    # A token whose slots were all dropped gets zeros back.
    y = unpermute(d.hidden, d)
    gone = (d.row_index < 0).all(dim=1)
    assert not y[gone].any()
    want = (hidden[:, None] * (probs * (d.row_index >= 0))[..., None]).sum(1)
    torch.testing.assert_close(y, want)


def test_routing_map():
    # TransformerEngine's [T, E] routing map gives the rows of the equivalent indices.
    T, E, k = 14, 6, 3
    indices, probs = _routing(T, E, k)
    hidden = torch.randn(T, 16)
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, indices, True)
    full_probs = torch.zeros(T, E).scatter_(1, indices, probs)
    d = permute(hidden, probs=full_probs, routing_map=routing_map, topk=k, align=8)
    base = permute(hidden, indices, probs, num_experts=E, align=8)
    # Same rows as the indices path (slot order inside a token does not matter).
    for name in ("hidden", "probs", "counts", "offsets", "tokens_per_expert"):
        torch.testing.assert_close(getattr(d, name), getattr(base, name), rtol=0, atol=0)
    # Tokens with fewer experts than topk (here: none for token 0, one for token 1).
    routing_map[0] = False
    routing_map[1] = False
    routing_map[1, 2] = True
    d = permute(hidden, probs=full_probs, routing_map=routing_map.int(), topk=k)
    assert d.num_rows == T * k and not d.dropless
    assert int(d.tokens_per_expert.sum()) == int(routing_map.sum())
    y = unpermute(d.hidden, d, weighted=False)
    torch.testing.assert_close(y, hidden * routing_map.sum(1, keepdim=True).float())


# ------------------------------------------------------------------------------------------------
# Gradients
# ------------------------------------------------------------------------------------------------


def _moe_like(hidden, indices, probs, E, align, w, **kw):
    d = permute(hidden, indices, probs, num_experts=E, align=align, **kw)
    return unpermute(d.hidden @ w, d), d


@pytest.mark.parametrize("align,capacity", [(None, None), (16, None), (8, 0.75)])
def test_gradients_match_reference(align, capacity):
    # The hand-written backward of both ops against autograd through the reference twins.
    T, E, k, H = 17, 5, 3, 24
    indices, probs = _routing(T, E, k, "shuffled")
    hidden = torch.randn(T, H, requires_grad=True)
    probs.requires_grad_(True)
    w = torch.randn(H, H, requires_grad=True)
    y, d = _moe_like(hidden, indices, probs, E, align, w, capacity_factor=capacity)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (hidden, probs, w), g)

    idx = indices
    if capacity is not None:
        idx = routing.capacity_drop(indices, probs.detach(), E, d.num_rows // E)
    row_index, *_, ph, pp = _ref_dispatch(hidden, idx, probs, E, align, d.num_rows)
    y_ref = ref.gather_rows_torch(ph @ w, row_index, pp)
    want = torch.autograd.grad(y_ref, (hidden, probs, w), g)
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_gradients_unweighted_and_partial():
    # Backward with only some inputs needing grad (and the unweighted combine).
    T, E, k, H = 9, 4, 2, 16
    indices, probs = _routing(T, E, k)
    hidden = torch.randn(T, H, requires_grad=True)
    d = permute(hidden, indices, probs, num_experts=E, align=8)  # probs need no grad
    y = unpermute(d.hidden * 2, d, weighted=False)
    (gh,) = torch.autograd.grad(y.sum(), (hidden,))
    torch.testing.assert_close(gh, torch.full_like(hidden, 2.0 * k))
    # Only probs need grad: dprobs[t, s] = <grad_y[t], expert_out[row]>.
    probs = probs.clone().requires_grad_(True)
    x = torch.randn(T, H)
    d = permute(x, indices, probs, num_experts=E)
    expert_out = torch.randn_like(d.hidden)
    g = torch.randn(T, H)
    (gp,) = torch.autograd.grad(unpermute(expert_out, d), (probs,), g)
    want = (expert_out[d.row_index.long()] * g[:, None]).sum(-1)
    torch.testing.assert_close(gp, want)


# ------------------------------------------------------------------------------------------------
# sort_chunks_by_index
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_probs", [False, True])
def test_sort_chunks_by_index(with_probs):
    # The [rank][expert] → [expert][rank] reorder after an all-to-all, forward and backward.
    ranks, experts, H = 3, 4, 16
    sizes = torch.randint(0, 4, (ranks * experts,))
    sizes[1] = 0  # an empty chunk
    N = int(sizes.sum()) + 3  # rows past the chunks stay in place
    # [rank][expert] → [expert][rank]
    order = torch.arange(ranks * experts).view(ranks, experts).t().reshape(-1)
    x = torch.randn(N, H, requires_grad=True)
    probs = torch.rand(N, requires_grad=True) if with_probs else None
    out, out_probs = sort_chunks_by_index(x, sizes, order, probs)
    chunks = list(x.detach().split([*sizes.tolist(), 3]))
    want = torch.cat([chunks[i] for i in order.tolist()] + [chunks[-1]])
    assert torch.equal(out, want)
    if with_probs:
        pc = list(probs.detach().split([*sizes.tolist(), 3]))
        assert torch.equal(out_probs, torch.cat([pc[i] for i in order.tolist()] + [pc[-1]]))
    else:
        assert out_probs is None
    g = torch.randn_like(out)
    loss = (out * g).sum() + ((out_probs * torch.arange(N)).sum() if with_probs else 0)
    grads = torch.autograd.grad(loss, (x, probs) if with_probs else (x,))
    row_map = routing.sort_chunks_row_map(sizes, order, N).long()
    torch.testing.assert_close(grads[0], g[row_map])
    if with_probs:
        torch.testing.assert_close(grads[1], row_map.float())


@pytest.mark.parametrize(
    ("sizes", "extra", "dtype"),
    [
        ([5], 0, torch.int64),  # one chunk
        ([3, 0, 4], 2, torch.int32),  # an empty chunk, rows past the chunks
        ([0, 0, 0], 4, torch.int64),  # every chunk empty
        ("skewed_300", 7, torch.int32),  # C not a power of two, many chunks
        ("skewed_1024", 0, torch.int64),
    ],
)
def test_sort_chunks_row_map_kernel_matches_torch(sizes, extra, dtype):
    """The two-launch row map (Triton, interpreter on CPU) equals the torch one."""
    if not interpret_mode():
        pytest.skip("the row-map kernels on CPU need TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(0)
    if isinstance(sizes, str):
        C = int(sizes.split("_")[1])
        t = torch.randint(0, 6, (C,), generator=g) * (torch.rand(C, generator=g) < 0.7)
    else:
        t, C = torch.tensor(sizes), len(sizes)
    t = t.to(dtype)
    order = torch.randperm(C, generator=g).to(dtype)
    N = int(t.sum()) + extra
    got = routing.sort_chunks_row_map(t, order, N)
    want = routing.sort_chunks_row_map_torch(t, order, N)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert torch.equal(got.sort().values, torch.arange(N, dtype=torch.int32))  # a permutation


# ------------------------------------------------------------------------------------------------
# Token dropping with out_rows below the rows the routing needs (TransformerEngine's order)
# ------------------------------------------------------------------------------------------------


def _check_out_rows_drop(T, H, E, k, align, R, device="cpu"):
    """permute → linear → unpermute with R rows: the Dispatch fields against the loop oracle,
    forward values and the hidden / probs / weight gradients against pure torch."""
    indices, probs = _routing(T, E, k, "one_expert", device)
    hidden = torch.randn(T, H, device=device, requires_grad=True)
    probs.requires_grad_(True)
    w = torch.randn(H, H, device=device, requires_grad=True)
    d = permute(hidden, indices, probs, num_experts=E, align=align, out_rows=R)
    want = naive_dispatch(indices.cpu(), E, align or 1, out_rows=R)
    for name, w_field in want.items():
        torch.testing.assert_close(getattr(d, name).cpu(), w_field, rtol=0, atol=0, msg=name)
    assert d.num_rows == R and d.hidden.shape == (R, H) and not d.dropless
    keep = d.row_index >= 0
    last_row = int(naive_dispatch(indices.cpu(), E, align or 1)["row_index"].max())
    assert bool(keep.all()) == (last_row < R)  # the cut drops exactly the rows at or past R
    # Kept slots hold their token and prob; every other row is zero.
    rows = d.row_index.long()[keep]
    tok = torch.arange(T, device=device)[:, None].expand(T, k)[keep]
    want_hidden = torch.zeros(R, H, device=device).index_put((rows,), hidden.detach()[tok])
    want_probs = torch.zeros(R, device=device).index_put((rows,), probs.detach()[keep])
    torch.testing.assert_close(d.hidden, want_hidden, rtol=0, atol=0)
    torch.testing.assert_close(d.probs, want_probs, rtol=0, atol=0)
    # A dropped slot contributes nothing: y[t] = Σ_kept p[t, s] · (hidden[t] @ w).
    y = unpermute(d.hidden @ w, d)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (hidden, probs, w), g)
    y_ref = (probs * keep).sum(1, keepdim=True) * (hidden @ w)
    want_grads = torch.autograd.grad(y_ref, (hidden, probs, w), g)
    # cuBLAS may sum the GEMMs of [R, H] and [T, H] rows in different orders
    tol = {"rtol": 1e-4, "atol": 1e-3} if device == "cuda" else {}
    torch.testing.assert_close(y, y_ref, **tol)
    for a, b in zip(got, want_grads):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("align", [None, 16])
def test_out_rows_below_needed_drops_in_te_order(align):
    # Issue 23 defect 8: out_rows below the rows needed keeps the first R rows of the expert
    # order and marks the rest dropped, so no gather indexes at or past R and no zero-fill
    # writes past the output.
    T, E, k, H = 14, 4, 2, 16
    needed = routing.max_rows(T, k, E, align or 1)
    # cuts well inside, near the end (on the last rows or in padding), just below the bound
    for R in (T * k // 2, T * k - 1, needed - 1):
        _check_out_rows_drop(T, H, E, k, align, R)


def test_out_rows_at_or_above_bound_stays_dropless():
    # An out_rows at the static bound drops nothing: dropless stays True and the tail is zero.
    T, E, k = 12, 5, 2
    indices, probs = _routing(T, E, k)
    hidden = torch.randn(T, 16)
    d = permute(hidden, indices, probs, num_experts=E, align=8, out_rows=T * k + 5 * 7 + 3)
    assert d.dropless and bool((d.row_index >= 0).all())
    _check_invariants(d, hidden, indices)


# ------------------------------------------------------------------------------------------------
# Wrapping: dispatcher path and torch.compile
# ------------------------------------------------------------------------------------------------


def _moe_step(hidden, indices, probs, w, E):
    d = permute(hidden, indices, probs, num_experts=E, align=8, out_rows=20)
    y = unpermute(d.hidden @ w, d)
    sizes = torch.full((4,), 3, device=y.device)
    order = torch.tensor([2, 0, 3, 1], device=y.device)
    z, pz = sort_chunks_by_index(y, sizes, order, probs[:, 0].contiguous())
    return z * pz[:, None]


def _moe_inputs(T=12, E=4, k=2, H=16):
    indices, probs = _routing(T, E, k)
    hidden = torch.randn(T, H, requires_grad=True)
    w = torch.randn(H, H, requires_grad=True)
    return hidden, indices, probs.requires_grad_(True), w, E


def _value_and_grads(fn, hidden, indices, probs, w, E):
    out = fn(hidden, indices, probs, w, E)
    grads = torch.autograd.grad(out, (hidden, probs, w), torch.ones_like(out))
    return out, *grads


@pytest.mark.parametrize("align", [None, 16])
def test_no_grad_runs_without_autograd_nodes_and_matches(align):
    """Under no_grad (generation) permute and unpermute skip their autograd Functions: the
    same rows, probs and combine as with autograd on."""
    T, E, k, H = 23, 6, 3, 32
    indices, probs = _routing(T, E, k)
    hidden = torch.randn(T, H, requires_grad=True)
    probs.requires_grad_()
    d = permute(hidden, indices, probs, num_experts=E, align=align)
    y = unpermute(d.hidden * 2.0, d)
    with torch.no_grad():
        d0 = permute(hidden, indices, probs, num_experts=E, align=align)
        y0 = unpermute(d0.hidden * 2.0, d0)
    assert d0.hidden.grad_fn is None and d0.probs.grad_fn is None and y0.grad_fn is None
    torch.testing.assert_close(d0.hidden, d.hidden, rtol=0, atol=0)
    torch.testing.assert_close(d0.probs, d.probs, rtol=0, atol=0)
    torch.testing.assert_close(y0, y.detach(), rtol=0, atol=0)


def test_dispatcher_path_matches_eager_shortcut():
    # The kernel ops and Functions through the dispatcher (what tracers see) give what the
    # plain-eager shortcut gives.
    args = _moe_inputs()
    want = _value_and_grads(_moe_step, *args)
    with dispatcher_only():
        got = _value_and_grads(_moe_step, *args)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_compile_fullgraph_traces_forward_and_backward():
    # permute, unpermute and sort_chunks_by_index trace as one graph (no graph break) with their
    # backward, and the compiled step matches eager.
    args = _moe_inputs()
    want = _value_and_grads(_moe_step, *args)
    torch._dynamo.reset()
    compiled = torch.compile(_moe_step, fullgraph=True, backend="aot_eager")
    got = _value_and_grads(compiled, *args)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------


def test_bad_input_errors():
    # Bad input raises errors that name the argument, before any kernel runs.
    T, E, k = 6, 4, 2
    indices, probs = _routing(T, E, k)
    h = torch.randn(T, 16)
    with pytest.raises(ValueError, match="num_experts is required"):
        permute(h, indices, probs)
    with pytest.raises(ValueError, match=r"indices\.shape\[0\]"):
        permute(h[:5], indices, probs, num_experts=E)
    with pytest.raises(ValueError, match="probs must have the shape of indices"):
        permute(h, indices, probs[:, :1], num_experts=E)
    with pytest.raises(TypeError, match="indices must have dtype"):
        permute(h, indices.float(), probs, num_experts=E)
    with pytest.raises(TypeError, match="probs must have dtype"):
        permute(h, indices, indices, num_experts=E)
    with pytest.raises(TypeError, match="hidden must have dtype"):
        permute(h.long(), indices, probs, num_experts=E)
    with pytest.raises(ValueError, match="hidden must be 2-D"):
        permute(h[None], indices, probs, num_experts=E)
    with pytest.raises(ValueError, match="unit stride"):
        permute(h.t().contiguous().t(), indices, probs, num_experts=E)
    for bad in (7, 256, 0, 1, True, 16.0):
        with pytest.raises(ValueError, match="align must be None or one of"):
            permute(h, indices, probs, num_experts=E, align=bad)
    with pytest.raises(ValueError, match="num_experts must be >= 1"):
        permute(h, indices, probs, num_experts=0)
    with pytest.raises(ValueError, match="indices or routing_map"):
        permute(h, indices, probs, num_experts=E, routing_map=torch.ones(T, E, dtype=torch.bool))
    for cf in (0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="capacity_factor must be a finite float > 0"):
            permute(h, indices, probs, num_experts=E, capacity_factor=cf)
    # Ids >= E or < -1 are refused on CPU tensors with or without validate (test_expert_ids_*).
    d = permute(h, indices, num_experts=E)
    with pytest.raises(ValueError, match=r"needs dispatch\.probs"):
        unpermute(d.hidden, d)
    with pytest.raises(ValueError, match=r"dispatch\.num_rows"):
        unpermute(d.hidden[:-1], d, weighted=False)
    with pytest.raises(TypeError, match="dispatch must be a Dispatch"):
        unpermute(d.hidden, (d.hidden, d.offsets))
    with pytest.raises(ValueError, match=r"sorted_index\.shape\[0\]"):
        sort_chunks_by_index(h, torch.tensor([3, 3]), torch.tensor([1, 0, 2]))


# ------------------------------------------------------------------------------------------------
# GPU: real shapes, sync-freedom, CUDA graphs, device-side validation
# ------------------------------------------------------------------------------------------------

GPU_SHAPES = [
    # (T, H, E, k)
    (4096, 2048, 64, 8),
    (2048, 7168, 256, 8),
    (1000, 1024, 8, 2),  # T not a multiple of any block size
    (333, 1032, 13, 4),  # prime E, H = 8 · odd
    (1, 2048, 128, 8),
]


def _gpu_routing(T, E, k):
    indices, probs = make_routing(T, E, k, "shuffled")
    return indices.cuda(), probs.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,E,k", GPU_SHAPES)
@pytest.mark.parametrize("align", [None, 16, 128])
def test_gpu_matches_reference(T, H, E, k, align):
    # The real shapes on CUDA (bf16), forward and backward, against the reference.
    _gpu_check(T, H, E, k, align)


@pytest.mark.gpu
@pytest.mark.parametrize("align", [None, 128])
def test_gpu_replayed_launches_match_reference(align):
    """From the third call of one static configuration on, permute / unpermute replay their
    recorded launches with only the pointers swapped (moekit/runtime/replay.py): every call,
    on fresh tensors and a fresh routing, must still match the reference, and the replays must
    actually be in use."""
    cache_clear("replay")
    for _ in range(5):
        _gpu_check(1000, 1024, 8, 2, align)
    kinds = {key[1] for key, rep in cache_entries("replay").items() if rep.ready}
    assert kinds == {"routing_metadata", "permute_scatter", "permute_gather"}, kinds


def _gpu_check(T, H, E, k, align):
    indices, probs = _gpu_routing(T, E, k)
    hidden = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs.requires_grad_(True)
    d = permute(hidden, indices, probs, num_experts=E, align=align)
    want = _ref_dispatch(hidden.detach(), indices, probs.detach(), E, align, d.num_rows)
    got = (d.row_index, d.tokens_per_expert, d.counts, d.offsets, d.hidden, d.probs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    expert_out = torch.randn_like(d.hidden).requires_grad_(True)
    y = unpermute(expert_out, d)
    g = torch.randn_like(y)
    gp, geo = torch.autograd.grad(y, (probs, expert_out), g)
    # Reference in fp32 from the same bf16 values; our error is bf16 rounding of the result.
    eo32 = expert_out.detach().float().requires_grad_(True)
    p32 = probs.detach().clone().requires_grad_(True)
    _, pp = ref.scatter_rows_torch(hidden.detach().float(), want[0], d.num_rows, p32)
    y_ref = ref.gather_rows_torch(eo32, want[0], pp)
    torch.testing.assert_close(y.float(), y_ref, rtol=1e-2, atol=1e-2)
    gp_ref, geo_ref = torch.autograd.grad(y_ref, (p32, eo32), g.float())
    torch.testing.assert_close(gp.float(), gp_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(geo.float(), geo_ref, rtol=1e-2, atol=1e-2)
    # Permute's backward: the unweighted combine of d.hidden sends k copies of g to each token.
    (gh,) = torch.autograd.grad(unpermute(d.hidden, d, weighted=False), (hidden,), g)
    torch.testing.assert_close(gh.float(), k * g.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "T,E,k",
    [
        (20000, 1024, 16),  # E = 1024: the histogram's widest bins, 313 blocks of 1024 pairs
        (70000, 256, 8),  # 560000 pairs: 547 blocks, past one 512-block step of the scan
        (3, 256, 8),  # fewer pairs than experts: one mostly-masked block
    ],
)
def test_gpu_metadata_large(T, E, k):
    # The counting sort against the torch version at sizes the interpreter cannot reach, with
    # and without rows cut at out_rows.
    indices, _ = _gpu_routing(T, E, k)
    for align in (1, 128):
        needed = routing.max_rows(T, k, E, align)
        for R in (needed, needed // 3):
            got = routing.routing_metadata(indices, E, align, out_rows=R)
            want = routing.routing_metadata_torch(indices, E, align, R)
            for g, w in zip(got, want):
                assert torch.equal(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("align", [None, 16, 128])
def test_gpu_out_rows_below_needed_drops_in_te_order(align):
    # Issue 23 defect 8 on the GPU, where a row at or past R in the probs-gradient gather is a
    # device-side assert and a padding write past R corrupts memory: the CPU test's checks.
    T, E, k, H = 1000, 8, 2, 1024
    needed = routing.max_rows(T, k, E, align or 1)
    for R in (T * k // 2, needed - 1):
        _check_out_rows_drop(T, H, E, k, align, R, device="cuda")
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_gpu_no_host_sync():
    # No op reads back to the host: what makes a whole MoE block CUDA-graph capturable.
    T, H, E, k = 4096, 2048, 64, 8
    indices, probs = _gpu_routing(T, E, k)
    hidden = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs.requires_grad_(True)
    permute(hidden, indices, probs, num_experts=E, align=16)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kws = ({}, {"align": 16}, {"capacity_factor": 1.25}, {"validate": True},
               {"out_rows": T * k // 2}, {"align": 16, "out_rows": T * k // 2})  # fmt: skip
        for kw in kws:
            d = permute(hidden, indices, probs, num_experts=E, **kw)
            y = unpermute(d.hidden * 2, d)
            y.backward(torch.ones_like(y))
        routing_map = torch.zeros(T, E, dtype=torch.bool, device="cuda").scatter_(1, indices, True)
        permute(hidden, routing_map=routing_map, topk=k, align=128)
        sizes = torch.full((16,), T // 16, device="cuda")
        order = torch.arange(16, device="cuda").view(4, 4).t().reshape(-1)
        out, _ = sort_chunks_by_index(hidden, sizes, order)
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("align", [None, 128])
def test_gpu_cuda_graph_replay_new_routing(align):
    # A captured step replayed on a new routing gives what eager gives.
    T, H, E, k = 2048, 1024, 32, 4
    s_idx, s_probs = _gpu_routing(T, E, k)
    s_hidden = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    s_grad = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def step():
        h = s_hidden.detach().requires_grad_(True)
        p = s_probs.detach().requires_grad_(True)
        d = permute(h, s_idx, p, num_experts=E, align=align)
        y = unpermute(d.hidden.float().mul(1.5).to(d.hidden.dtype), d)
        gh, gp = torch.autograd.grad(y, (h, p), s_grad)
        return y, gh, gp, d.hidden

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for _ in range(2):  # a new routing every replay
        new_idx, new_probs = _gpu_routing(T, E, k)
        s_idx.copy_(new_idx)
        s_probs.copy_(new_probs)
        s_hidden.normal_()
        graph.replay()
        eager = step()
        for a, b in zip(static_out, eager):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_validate_detects_bad_indices_without_sync():
    # A device-side assert poisons the CUDA context, so it runs in its own process. The assert is
    # asynchronous: it may surface at the final synchronize, or already at a later kernel launch
    # inside permute (Triton's launcher reports the sticky error). Either way is a detection;
    # what must not happen is a host sync inside permute, or a clean exit.
    script = textwrap.dedent(
        """
        import torch
        from moekit.ops.permute import permute
        idx = torch.randint(0, 8, (64, 2), device="cuda")
        idx[5, 1] = 8
        h = torch.randn(64, 128, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            permute(h, idx, num_experts=8, validate=True)  # must not sync
        finally:
            torch.cuda.set_sync_debug_mode(0)
        print("launched", flush=True)
        torch.cuda.synchronize()
        print("not detected", flush=True)
        """
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=300
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "not detected" not in output, output
    # A host sync inside permute would raise this under sync debug mode "error".
    assert "called a synchronizing CUDA operation" not in output, output
    # The device-side assert fired with our message (the kernel prints it to stderr), or at least
    # the CUDA runtime reported the assert.
    assert "expert ids in [0, num_experts = 8)" in output or "device-side assert" in output, output


@pytest.mark.gpu
def test_gpu_validate_and_debug_pass_minus_one_without_sync(monkeypatch):
    # -1 (a dropped slot, as expert parallelism passes non-local slots) passes the device check
    T, E, k = 64, 8, 2
    idx, probs = _gpu_routing(T, E, k)
    idx[5, 1] = -1
    h = torch.randn(T, 128, device="cuda")
    want = permute(h, idx, probs, num_experts=E)
    torch.cuda.synchronize()
    for validate, debug in ((True, "0"), (False, "1")):
        monkeypatch.setenv("MOEKIT_DEBUG", debug)
        torch.cuda.set_sync_debug_mode("error")
        try:
            d = permute(h, idx, probs, num_experts=E, validate=validate)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        assert int(d.row_index[5, 1]) == -1
        assert torch.equal(d.offsets, want.offsets) and torch.equal(d.row_index, want.row_index)


def test_rows_and_probs_gradients_in_separate_backward_passes():
    # The permute node is reached from both dispatch.hidden and dispatch.probs; their gradients
    # may be taken in two backward passes (the routing metadata is not freed by the first).
    T, H, E, k = 9, 16, 4, 2
    hidden = torch.randn(T, H, requires_grad=True)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    probs = torch.rand(T, k, requires_grad=True)
    d = permute(hidden, idx, probs, num_experts=E)
    expert_out = torch.randn_like(d.hidden, requires_grad=True)
    (gp,) = torch.autograd.grad(unpermute(expert_out, d), (probs,), torch.ones(T, H))
    (gh,) = torch.autograd.grad(unpermute(d.hidden, d, weighted=False), (hidden,), torch.ones(T, H))
    torch.testing.assert_close(gh, torch.full((T, H), float(k)))
    row = d.row_index.long()
    torch.testing.assert_close(gp, expert_out.detach()[row].sum(-1))


def test_no_rows_at_all_drops_every_slot():
    """out_rows=0 (allowed): unpermute gives zeros and zero gradients."""
    T, E, k = 5, 3, 2
    indices, probs = _routing(T, E, k)
    h = torch.randn(T, 8, requires_grad=True)
    probs = probs.clone().requires_grad_()
    d = permute(h, indices, probs, num_experts=E, out_rows=0)
    assert d.hidden.shape == (0, 8) and torch.all(d.row_index == -1)
    y = unpermute(d.hidden * 2, d)
    assert torch.equal(y, torch.zeros(T, 8))
    y.sum().backward()
    assert torch.equal(h.grad, torch.zeros_like(h))
    assert torch.equal(probs.grad, torch.zeros_like(probs))


def test_sort_chunks_by_index_validate():
    x = torch.randn(10, 8)
    bad = [
        ([6, 6], [1, 0], "split_sizes must be >= 0 with a sum <="),
        ([-1, 3], [1, 0], "split_sizes must be >= 0"),
        ([3, 3], [0, 0], "sorted_index must be a permutation"),
        ([3, 3], [1, 2], r"sorted_index must hold chunk ids in \[0, 2\)"),
    ]
    for sizes, index, match in bad:
        with pytest.raises(ValueError, match=match):
            sort_chunks_by_index(x, torch.tensor(sizes), torch.tensor(index), validate=True)
    want, _ = sort_chunks_by_index(x, torch.tensor([3, 4]), torch.tensor([1, 0]))
    got, _ = sort_chunks_by_index(x, torch.tensor([3, 4]), torch.tensor([1, 0]), validate=True)
    assert torch.equal(got, want)
    assert torch.equal(got[:4], x[3:7]) and torch.equal(got[4:7], x[:3])
    with pytest.raises(TypeError, match="validate must be a bool"):
        sort_chunks_by_index(x, torch.tensor([3, 4]), torch.tensor([1, 0]), validate=1)


# ------------------------------------------------------------------------------------------------
# Expert ids out of range: refused on the host for CPU tensors (the interpreter's included), on
# the device (torch._assert_async) under validate=True / MOEKIT_DEBUG=1; -1 is a dropped slot
# ------------------------------------------------------------------------------------------------


def _ids_case(value, dtype=torch.int64):
    T, E, k = 6, 4, 2
    indices, probs = _routing(T, E, k)
    indices = indices.clone()
    indices[3, 1] = value
    return torch.randn(T, 16), indices.to(dtype), probs, E


@pytest.mark.parametrize("validate", [False, True])
@pytest.mark.parametrize("value", [4, 9, -2])
def test_expert_ids_out_of_range_raise_on_cpu(value, validate):
    h, bad, probs, E = _ids_case(value)
    match = rf"indices must hold expert ids in \[0, num_experts = 4\) .*indices\[3, 1\] = {value}"
    with pytest.raises(ValueError, match=match):
        permute(h, bad, probs, num_experts=E, validate=validate)


def test_expert_ids_uint8_compared_as_numbers():
    h, bad, probs, E = _ids_case(255, torch.uint8)  # not read as -1
    with pytest.raises(ValueError, match=r"indices\[3, 1\] = 255"):
        permute(h, bad, probs, num_experts=E)


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("validate", [False, True])
def test_expert_id_minus_one_is_a_dropped_slot(validate, debug, monkeypatch):
    monkeypatch.setenv("MOEKIT_DEBUG", "1" if debug else "0")
    h, ids, probs, E = _ids_case(-1)
    d = permute(h, ids, probs, num_experts=E, validate=validate)
    assert int(d.row_index[3, 1]) == -1
    assert int(d.tokens_per_expert.sum()) == ids.numel() - 1
    y = unpermute(d.hidden, d, weighted=False)
    torch.testing.assert_close(y[3], h[3])  # only slot 0 of token 3 came back


def _device_side_checks(monkeypatch):
    """Make the checks take their GPU branch (torch._assert_async) on CPU tensors, where a
    failed assert raises RuntimeError at once."""
    import moekit.ops.validation as validation

    monkeypatch.setattr(validation, "values_on_host", lambda t: False)


@pytest.mark.parametrize("value", [4, -2])
def test_expert_ids_device_side_check_under_validate(value, monkeypatch):
    _device_side_checks(monkeypatch)
    h, bad, probs, E = _ids_case(value)
    with pytest.raises(RuntimeError, match=r"indices must hold expert ids in \[0, num_experts"):
        permute(h, bad, probs, num_experts=E, validate=True)
    permute(h, bad, probs, num_experts=E)  # a GPU's hot path checks nothing (no launch, no sync)
    monkeypatch.setenv("MOEKIT_DEBUG", "1")
    with pytest.raises(RuntimeError, match=r"indices must hold expert ids in \[0, num_experts"):
        permute(h, bad, probs, num_experts=E)  # MOEKIT_DEBUG=1: as validate=True
    _, ok, _, _ = _ids_case(-1)
    permute(h, ok, probs, num_experts=E, validate=True)  # -1 passes the device check too


def test_expert_ids_device_side_check_reads_nothing_on_the_host(monkeypatch):
    from moekit.ops.validation import check_expert_ids

    _device_side_checks(monkeypatch)
    _, bad, _, _ = _ids_case(7, torch.int32)
    for attr in ("__bool__", "item", "tolist"):  # the host reads that would sync a GPU
        monkeypatch.setattr(torch.Tensor, attr, lambda *a, **k: pytest.fail("host read"))
    check_expert_ids(bad, 4, device_check=False)
    with pytest.raises(RuntimeError, match="indices must hold expert ids"):
        check_expert_ids(bad, 4, device_check=True)


def test_debug_env_turns_on_sort_chunks_validation(monkeypatch):
    x = torch.randn(10, 8)
    sizes, index = torch.tensor([3, 3]), torch.tensor([0, 0])
    sort_chunks_by_index(x, sizes, index)  # undefined result, no check
    monkeypatch.setenv("MOEKIT_DEBUG", "1")
    with pytest.raises(ValueError, match="sorted_index must be a permutation"):
        sort_chunks_by_index(x, sizes, index)


def _check_unpermute_shape(device: str, dtype: torch.dtype, H: int) -> None:
    """unpermute(shape=[B, S, H]) equals the [T, H] result reshaped, forward and backward, with
    and without autograd; the result is a tensor of its own (in-place ops allowed)."""
    B, S, E, k = 3, 5, 4, 2
    indices, probs = _routing(B * S, E, k, device=device)
    hidden = torch.randn(B * S, H, device=device, dtype=dtype)
    probs = probs.clone().requires_grad_()
    d = permute(hidden, indices, probs, num_experts=E)
    expert_out = torch.randn_like(d.hidden).requires_grad_()
    flat = unpermute(expert_out, d)
    shaped = unpermute(expert_out, d, shape=(B, S, H))
    assert shaped.shape == (B, S, H) and not shaped._is_view()
    torch.testing.assert_close(shaped, flat.view(B, S, H), rtol=0, atol=0)
    g = torch.randn(B, S, H, device=device, dtype=dtype)
    # (retain_graph: every pass reaches the permute's node through the probs)
    want = torch.autograd.grad(flat, (expert_out, probs), g.view(B * S, H), retain_graph=True)
    got = torch.autograd.grad(shaped, (expert_out, probs), g, retain_graph=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # an expanded (stride-0) gradient, as from .sum()
    shaped_sum = unpermute(expert_out, d, shape=(B, S, H)).sum()
    (ge,) = torch.autograd.grad(shaped_sum, (expert_out,), retain_graph=True)
    (gw,) = torch.autograd.grad(flat.sum(), (expert_out,), retain_graph=True)
    torch.testing.assert_close(ge, gw, rtol=0, atol=0)
    y = unpermute(expert_out, d, shape=[B, S, H])
    y += 1.0  # a residual added in place: allowed on the op's own output
    y.sum().backward()
    with torch.no_grad():
        nograd = unpermute(expert_out, d, shape=torch.Size([S, B, H]))
    assert not nograd._is_view()
    torch.testing.assert_close(nograd, flat.detach().view(S, B, H), rtol=0, atol=0)


def test_unpermute_shape():
    _check_unpermute_shape("cpu", torch.float32, 24)


def test_unpermute_shape_errors():
    indices, probs = _routing(6, 4, 2)
    d = permute(torch.randn(6, 8), indices, probs, num_experts=4)
    for bad in [(2, 2, 8), (6, 4), (3, 2), (), "6,8", (2, 3.0, 8), (-2, -3, 8)]:
        with pytest.raises(ValueError, match=r"shape must be a \[\.\.\., H' = 8\] shape"):
            unpermute(d.hidden, d, shape=bad)


@pytest.mark.gpu
def test_gpu_unpermute_shape():
    _check_unpermute_shape("cuda", torch.bfloat16, 512)
