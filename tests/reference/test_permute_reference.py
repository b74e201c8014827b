"""The pure-PyTorch permute twins against a loop-by-loop oracle.

The helpers here (routings, the naive dispatch) are shared with tests/ops/test_permute.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from moekit.reference import permute as ref

# ------------------------------------------------------------------------------------------------
# Shared helpers
# ------------------------------------------------------------------------------------------------


def make_routing(T: int, E: int, k: int, kind: str = "random") -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing ``(indices [T, k] int64, probs [T, k] fp32, rows summing to 1)``."""
    scores = torch.randn(T, E)
    if kind == "one_expert":
        scores[:, E // 2] += 100.0  # every token's first choice is the same expert
    elif kind == "skewed":
        scores[:, : (E + 1) // 2] -= 100.0  # the lower half of the experts gets no token
    probs, indices = scores.softmax(-1).topk(k, dim=-1)
    probs = probs / probs.sum(-1, keepdim=True)
    if kind == "shuffled":
        # Slot order should not matter; scramble it.
        perm = torch.argsort(torch.rand(T, k), dim=1)
        indices, probs = indices.gather(1, perm), probs.gather(1, perm)
    return indices, probs


def naive_dispatch(indices: torch.Tensor, E: int, align: int) -> dict[str, torch.Tensor]:
    """Row of every (token, slot), by walking experts then tokens then slots in plain Python."""
    T, k = indices.shape
    row_index = torch.full((T, k), -1, dtype=torch.int32)
    tpe, counts, offsets = [], [], []
    r = 0
    for e in range(E):
        n = 0
        for t in range(T):
            for s in range(k):
                if int(indices[t, s]) == e:
                    row_index[t, s] = r + n
                    n += 1
        padded = math.ceil(n / align) * align
        r += padded
        tpe.append(n)
        counts.append(padded)
        offsets.append(r)
    as_t = lambda v: torch.tensor(v, dtype=torch.int32)
    return {
        "row_index": row_index,
        "tokens_per_expert": as_t(tpe),
        "counts": as_t(counts),
        "offsets": as_t(offsets),
    }


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------

CASES = [
    # (T, E, k, kind): why
    (16, 4, 2, "random"),  # the common case
    (23, 7, 3, "shuffled"),  # prime E, odd T, slot order scrambled
    (12, 6, 6, "random"),  # k = E: every token to every expert
    (9, 5, 2, "one_expert"),  # one expert gets every token
    (10, 8, 1, "skewed"),  # half the experts get nothing
    (1, 3, 2, "random"),  # a single token
    (0, 4, 2, "random"),  # no tokens at all
]


@pytest.mark.parametrize("T,E,k,kind", CASES)
@pytest.mark.parametrize("align", [1, 8, 16])
def test_routing_metadata_matches_naive(T, E, k, kind, align):
    indices, _ = make_routing(T, E, k, kind) if T else (torch.zeros(0, k, dtype=torch.long), None)
    got = ref.routing_metadata_torch(indices, E, align)
    want = naive_dispatch(indices, E, align)
    for name, g in zip(("row_index", "tokens_per_expert", "counts", "offsets"), got):
        assert g.dtype == torch.int32, name
        torch.testing.assert_close(g, want[name], rtol=0, atol=0, msg=name)


def test_routing_metadata_drops_out_of_range_slots():
    # −1 marks a masked slot (capacity, routing_map); it must get no row and shift nothing.
    indices = torch.tensor([[0, -1], [1, 0], [5, 1]])
    row_index, tpe, _, offsets = ref.routing_metadata_torch(indices, 2, 1)
    assert row_index.tolist() == [[0, -1], [2, 1], [-1, 3]]
    assert tpe.tolist() == [2, 2] and offsets.tolist() == [2, 4]


def test_scatter_gather_roundtrip():
    T, E, k, H = 11, 5, 2, 8
    indices, probs = make_routing(T, E, k)
    row_index, *_ = ref.routing_metadata_torch(indices, E, 8)
    R = T * k + min(E, T * k) * 7
    x = torch.randn(T, H)
    out, out_probs = ref.scatter_rows_torch(x, row_index, R, probs)
    # Every row not named in row_index is zero, and its prob too.
    used = torch.zeros(R, dtype=torch.bool)
    used[row_index.reshape(-1).long()] = True
    assert not out[~used].any() and not out_probs[~used].any()
    torch.testing.assert_close(out[row_index.long()], x[:, None].expand(T, k, H))
    back = ref.gather_rows_torch(out, row_index, out_probs)
    torch.testing.assert_close(back, x)  # probs sum to one per token


def test_capacity_drop_keeps_highest_probs_in_token_order():
    indices = torch.tensor([[0], [0], [0], [1]])
    probs = torch.tensor([[0.1], [0.9], [0.5], [0.2]])
    kept = ref.capacity_drop_torch(indices, probs, 2, capacity=2)
    assert kept.view(-1).tolist() == [-1, 0, 0, 1]
    # Ties keep the earlier token.
    kept = ref.capacity_drop_torch(indices, torch.ones(4, 1), 2, capacity=1)
    assert kept.view(-1).tolist() == [0, -1, -1, 1]


def test_routing_map_to_indices():
    routing_map = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
    probs = torch.arange(12, dtype=torch.float32).view(3, 4)
    indices, slot_probs = ref.routing_map_to_indices_torch(routing_map, probs, 2)
    assert indices.tolist() == [[0, 2], [3, -1], [-1, -1]]
    assert slot_probs.tolist() == [[0.0, 2.0], [7.0, 0.0], [0.0, 0.0]]


def test_sort_chunks_row_map():
    sizes = torch.tensor([2, 0, 3, 1])
    order = torch.tensor([2, 0, 3, 1])
    row_map = ref.sort_chunks_row_map_torch(sizes, order, 8)
    # chunks: A=[0,1] B=[] C=[2,3,4] D=[5]; output C A D B, rows 6 and 7 stay.
    assert row_map.tolist() == [3, 4, 0, 1, 2, 5, 6, 7]


def test_composed_baseline_matches():
    T, E, k, H = 13, 4, 2, 8
    indices, probs = make_routing(T, E, k)
    x = torch.randn(T, H)
    permuted, slots = ref.permute_composed_torch(x, indices, E)
    row_index, *_ = ref.routing_metadata_torch(indices, E, 1)
    ours, _ = ref.scatter_rows_torch(x, row_index, T * k)
    torch.testing.assert_close(permuted, ours)
    torch.testing.assert_close(ref.unpermute_composed_torch(permuted, slots, probs, T), x)
