"""The permute kernels directly, at sizes that cross their internal block boundaries.

Runs in Triton's interpreter (TRITON_INTERPRET=1) or on CUDA; skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch

from moekit.config import interpret_mode
from moekit.kernels import permute as kern
from moekit.reference import permute as ref

pytestmark = [
    pytest.mark.skipif(
        not (interpret_mode() or torch.cuda.is_available()),
        reason="needs TRITON_INTERPRET=1 or a CUDA GPU",
    ),
    pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning"),
]

DEVICE = "cpu" if interpret_mode() else "cuda"


@pytest.mark.parametrize(
    "T,k,E,align",
    [
        (300, 4, 6, 1),  # 1200 pairs: three metadata blocks, several rank sub-chunks each
        (130, 16, 3, 8),  # k = 16, few experts: long runs of one expert across blocks
        (70, 2, 1000, 16),  # E near the 1024 cap of the tests: the histogram's widest bins
        (40, 3, 1, 128),  # E = 1: every pair in one segment
    ],
)
def test_routing_metadata_kernel(T, k, E, align):
    indices = torch.randint(0, E, (T, k), device=DEVICE)
    indices[::7, 0] = -1  # masked slots in every block
    got = kern.routing_metadata(indices, E, align)
    want = ref.routing_metadata_torch(indices, E, align)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_scatter_weighted_dot_and_gather_vals():
    # The unpermute backward flags (WEIGHTED, DOT) and the permute backward flag (GATHER_VALS).
    T, k, E, H, align = 21, 3, 4, 48, 8
    indices = torch.randint(0, E, (T, k), device=DEVICE)
    row_index, tpe, _, offsets = kern.routing_metadata(indices, E, align)
    R = T * k + min(E, T * k) * (align - 1)
    x = torch.randn(T, H, device=DEVICE)
    row_w = torch.rand(R, device=DEVICE)
    dot_src = torch.randn(R, H, device=DEVICE)
    out, dots = kern.scatter_rows(
        x, row_index, R, offsets, tpe, row_weight=row_w, dot_src=dot_src, tail_lo=T * k
    )
    rows = row_index.long()
    want = torch.zeros(R, H, device=DEVICE)
    want[rows.reshape(-1)] = (x[:, None] * row_w[rows][..., None]).reshape(-1, H)
    torch.testing.assert_close(out, want)
    want_dots = torch.zeros(R, device=DEVICE)
    want_dots[rows.reshape(-1)] = (x[:, None] * dot_src[rows]).sum(-1).reshape(-1)
    torch.testing.assert_close(dots, want_dots)

    vals = torch.randn(R, device=DEVICE)
    summed, gathered = kern.gather_rows(out, row_index, row_vals=vals)
    torch.testing.assert_close(summed, ref.gather_rows_torch(out, row_index))
    torch.testing.assert_close(gathered, vals[rows])


def test_scatter_respects_num_rows():
    # Rows at or past R are never written, whatever row_index says (out_rows set too small).
    T, k, E, H = 8, 2, 2, 16
    indices = torch.zeros(T, k, dtype=torch.long, device=DEVICE)
    row_index, tpe, _, offsets = kern.routing_metadata(indices, E, 1)
    out, _ = kern.scatter_rows(torch.ones(T, H, device=DEVICE), row_index, 5, offsets, tpe)
    assert out.shape == (5, H) and bool((out == 1).all())
