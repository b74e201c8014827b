"""Every grouped-GEMM tile config the autotuner may pick computes the same result.

The autotuner times candidate configs and keeps the fastest, so a config that is wrong in some
corner (the pointer-store epilogue, warp specialisation, a transposed weight) would only show up
on the shapes where it wins. GPU: every real candidate, with counts around the tile edges.
"""

from __future__ import annotations

import pytest
import torch

from moekit.kernels import grouped_gemm as K
from moekit.reference.grouped_gemm import grouped_mm_ragged_m_ref


def _offsets(counts, device):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def _check(cfg, counts, K_, N, dtype, device, *, k_major, bias, tail_rows=3):
    E = len(counts)
    T = sum(counts) + tail_rows  # rows past offsets[-1] must come out zero
    offsets = _offsets(counts, device)
    a = torch.randn(T, K_, dtype=dtype, device=device)
    if k_major:  # an nn.Linear-style [E, N, K] weight viewed as [E, K, N]
        b = (torch.randn(E, N, K_, dtype=dtype, device=device) / K_**0.5).transpose(1, 2)
    else:
        b = torch.randn(E, K_, N, dtype=dtype, device=device) / K_**0.5
    bias_t = torch.randn(E, N, dtype=dtype, device=device) if bias else None
    out = torch.full((T, N), float("nan"), dtype=dtype, device=device)
    K.grouped_mm_ragged_m(a, b, offsets, out, bias_t, config=cfg)
    ref = grouped_mm_ragged_m_ref(a.float(), b.float(), offsets, torch.float32)
    if bias:
        rows = torch.repeat_interleave(
            torch.arange(E, device=device), offsets.diff(prepend=offsets[:1] * 0).long()
        )
        ref[: sum(counts)] += bias_t.float()[rows]
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert not torch.isnan(out).any(), f"{cfg}: rows left unwritten"
    err = (out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)
    assert err < tol, f"{cfg}: relative error {err:.2e}"
    assert torch.all(out[sum(counts) :] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("k_major", [False, True])
def test_gpu_every_ragged_m_candidate(k_major):
    counts = [0, 1, 63, 64, 65, 127, 128, 129, 200, 777, 0, 3000]
    for cfg in K._candidates("m", torch.bfloat16):
        _check(cfg, counts, 1024, 768, torch.bfloat16, "cuda", k_major=k_major, bias=k_major)
