"""The pure-PyTorch permute copy twins against loop-by-loop oracles.

The helpers here (routings, the naive dispatch) are shared with tests/ops/test_permute.py and
tests/ops/test_routing.py.
"""

from __future__ import annotations

import math

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


def naive_dispatch(
    indices: torch.Tensor, E: int, align: int, out_rows: int | None = None
) -> dict[str, torch.Tensor]:
    """Row of every (token, slot), by walking experts then tokens then slots in plain Python.

    With ``out_rows``, TransformerEngine's drop order: a row at or past it is dropped (−1), the
    segments are cut there and ``tokens_per_expert`` counts the rows kept."""
    T, k = indices.shape
    limit = math.inf if out_rows is None else out_rows
    row_index = torch.full((T, k), -1, dtype=torch.int32)
    tpe, counts, offsets = [], [], []
    start = 0
    for e in range(E):
        n = kept = 0
        for t in range(T):
            for s in range(k):
                if int(indices[t, s]) == e:
                    if start + n < limit:
                        row_index[t, s] = start + n
                        kept += 1
                    n += 1
        end = start + math.ceil(n / align) * align
        tpe.append(kept)
        counts.append(min(end, limit) - min(start, limit))
        offsets.append(min(end, limit))
        start = end
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


def _rows(T: int, E: int, k: int, align: int) -> tuple[torch.Tensor, int]:
    """row_index of a random routing (a few slots dropped) and R, from the loop oracle."""
    indices, _ = make_routing(T, E, k)
    indices[::3, 0] = -1
    R = T * k + min(E, T * k) * (align - 1)
    return naive_dispatch(indices, E, align)["row_index"], R


def test_scatter_gather_roundtrip():
    # The permute / unpermute twins undo each other; rows no slot names stay zero.
    T, E, k, H = 11, 5, 2, 8
    indices, probs = make_routing(T, E, k)
    row_index = naive_dispatch(indices, E, 8)["row_index"]
    R = T * k + min(E, T * k) * 7
    x = torch.randn(T, H)
    out, out_probs = ref.scatter_rows_torch(x, row_index, R, probs)
    used = torch.zeros(R, dtype=torch.bool)
    used[row_index.reshape(-1).long()] = True
    assert not out[~used].any() and not out_probs[~used].any()
    torch.testing.assert_close(out[row_index.long()], x[:, None].expand(T, k, H))
    back = ref.gather_rows_torch(out, row_index, out_probs)
    torch.testing.assert_close(back, x)  # probs sum to one per token


def test_scatter_weighted_and_dot_match_loop():
    # The unpermute-backward form of the scatter twin (rows scaled, the dot per row) against a
    # loop; dropped slots (−1) and rows at or past R write nothing.
    T, E, k, H, align = 9, 3, 2, 8, 8
    row_index, R = _rows(T, E, k, align)
    row_index[1, 1] = R  # a row past the output: must be ignored, not written
    x, w, dot = torch.randn(T, H), torch.rand(R), torch.randn(R, H)
    out, vals = ref.scatter_rows_torch(x, row_index, R, row_weight=w, dot_src=dot)
    want, want_vals = torch.zeros(R, H), torch.zeros(R)
    for t in range(T):
        for s in range(k):
            r = int(row_index[t, s])
            if 0 <= r < R:
                want[r] = x[t] * w[r]
                want_vals[r] = (x[t] * dot[r]).sum()
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(vals, want_vals)


def test_gather_weighted_matches_loop():
    # The unpermute twin: fp32 sum of each token's kept rows, weighted.
    T, E, k, H, align = 9, 3, 3, 8, 8
    row_index, R = _rows(T, E, k, align)
    src, w = torch.randn(R, H), torch.rand(R)
    want = torch.zeros(T, H)
    for t in range(T):
        for s in range(k):
            r = int(row_index[t, s])
            if r >= 0:
                want[t] += src[r] * w[r]
    torch.testing.assert_close(ref.gather_rows_torch(src, row_index, w), want)


def test_composed_baseline_matches():
    # The benchmarks' textbook baseline agrees with the twins (dropless, no padding).
    T, E, k, H = 13, 4, 2, 8
    indices, probs = make_routing(T, E, k)
    x = torch.randn(T, H)
    permuted, slots = ref.permute_composed_torch(x, indices, E)
    row_index = naive_dispatch(indices, E, 1)["row_index"]
    ours, _ = ref.scatter_rows_torch(x, row_index, T * k)
    torch.testing.assert_close(permuted, ours)
    torch.testing.assert_close(ref.unpermute_composed_torch(permuted, slots, probs, T), x)
