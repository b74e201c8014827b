"""moekit.ops.routing: the sync-free routing helpers against loop-by-loop oracles.

``routing_metadata`` runs the Triton counting sort under TRITON_INTERPRET=1 (and on CUDA) and
``routing_metadata_torch`` otherwise; both are checked here, on every path.
"""

from __future__ import annotations

import pytest
import torch

from moekit.ops import routing
from tests.reference.test_permute_reference import CASES, make_routing, naive_dispatch

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

FIELDS = ("row_index", "tokens_per_expert", "counts", "offsets")


def _check(got, want) -> None:
    for name, g in zip(FIELDS, got):
        assert g.dtype == torch.int32, name
        torch.testing.assert_close(g, want[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("T,E,k,kind", CASES)
@pytest.mark.parametrize("align", [1, 8, 16])
def test_routing_metadata_matches_naive(T, E, k, kind, align):
    # The stable, padded sort by expert, on the op's own path and on the torch one.
    indices, _ = make_routing(T, E, k, kind) if T else (torch.zeros(0, k, dtype=torch.long), None)
    want = naive_dispatch(indices, E, align)
    _check(routing.routing_metadata(indices, E, align), want)
    _check(routing.routing_metadata_torch(indices, E, align), want)


@pytest.mark.parametrize("align", [1, 8])
def test_routing_metadata_out_rows_drops_in_te_order(align):
    # Issue 23 defect 8: rows at or past out_rows are dropped (row −1) in TransformerEngine's
    # order and the counts describe what was kept; cuts land inside real rows, inside padding,
    # on a segment boundary, at 0, and past the rows needed (nothing dropped).
    T, E, k = 13, 4, 2
    indices, _ = make_routing(T, E, k, "one_expert")
    indices[5, 1] = -1  # a masked slot as well
    full = naive_dispatch(indices, E, align)
    ends = full["offsets"].tolist()
    needed = ends[-1]
    for R in sorted({0, 1, ends[0] - 1, ends[0], ends[0] + 1, needed - 3, needed, needed + 5}):
        if R < 0:
            continue
        want = naive_dispatch(indices, E, align, out_rows=R)
        _check(routing.routing_metadata(indices, E, align, out_rows=R), want)
        _check(routing.routing_metadata_torch(indices, E, align, R), want)
        assert int(want["offsets"][-1]) <= R


def test_routing_metadata_drops_out_of_range_slots():
    # −1 marks a masked slot (capacity, routing_map); it must get no row and shift nothing.
    indices = torch.tensor([[0, -1], [1, 0], [5, 1]])
    row_index, tpe, _, offsets = routing.routing_metadata(indices, 2, 1)
    assert row_index.tolist() == [[0, -1], [2, 1], [-1, 3]]
    assert tpe.tolist() == [2, 2] and offsets.tolist() == [2, 4]


def test_routing_metadata_rejects_too_many_slots():
    # The row map is int32: more slots than that must be refused, not wrapped.
    big = torch.zeros(1, dtype=torch.int32).expand(2**31, 1)
    with pytest.raises(ValueError, match="fewer than 2"):
        routing.routing_metadata(big, 4, 1)


def test_capacity_drop_keeps_highest_probs_in_token_order():
    # Capacity drops the lowest probs of an expert first; ties keep the earlier token.
    indices = torch.tensor([[0], [0], [0], [1]])
    probs = torch.tensor([[0.1], [0.9], [0.5], [0.2]])
    kept = routing.capacity_drop(indices, probs, 2, capacity=2)
    assert kept.view(-1).tolist() == [-1, 0, 0, 1]
    kept = routing.capacity_drop(indices, torch.ones(4, 1), 2, capacity=1)
    assert kept.view(-1).tolist() == [0, -1, -1, 1]


def test_routing_map_to_indices():
    # First topk routed experts in ascending id; −1 (prob 0) where a token has fewer.
    routing_map = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
    probs = torch.arange(12, dtype=torch.float32).view(3, 4)
    indices, slot_probs = routing.routing_map_to_indices(routing_map, probs, 2)
    assert indices.tolist() == [[0, 2], [3, -1], [-1, -1]]
    assert slot_probs.tolist() == [[0.0, 2.0], [7.0, 0.0], [0.0, 0.0]]


def test_sort_chunks_row_map():
    # Chunks A=[0,1] B=[] C=[2,3,4] D=[5] reordered C A D B; rows past the chunks stay.
    sizes = torch.tensor([2, 0, 3, 1])
    order = torch.tensor([2, 0, 3, 1])
    row_map = routing.sort_chunks_row_map(sizes, order, 8)
    assert row_map.tolist() == [3, 4, 0, 1, 2, 5, 6, 7]


def test_slot_values_treats_rows_past_r_as_dropped():
    # Issue 23 defect 8: the probs-gradient gather must never index at or past R, whatever
    # row_index holds (−1 and R both give 0).
    row_vals = torch.tensor([1.0, 2.0, 3.0])
    row_index = torch.tensor([[2, -1], [3, 0]], dtype=torch.int32)
    assert routing.slot_values(row_vals, row_index).tolist() == [[3.0, 0.0], [0.0, 1.0]]
