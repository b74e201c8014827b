"""The TMA kernels touch no address outside their tensors (GPU).

Each operand lives at the very start (or end) of a mapping with unmapped address space around
it (tests/_guarded_cuda.py), so any access outside the tensor faults. A row-bounded descriptor
whose base lies before the tensor faults this way (the TMA unit touches that page), as it would
on CUDA-graph replay wherever the graph's pool puts a tensor at the start of a fresh mapping.
Routings include experts that end within the first tile (the pointer paths that replace the
row-bounded descriptor there), empty experts and rows past offsets[-1].
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton

from moekit.activations import apply_activation, resolve_activation
from moekit.kernels import grouped_gemm as K
from moekit.kernels import grouped_mlp as MLP
from moekit.reference.grouped_gemm import grouped_mm_ragged_k_ref, grouped_mm_ragged_m_ref
from moekit.tuning import grouped_gemm as tuning
from moekit.tuning import grouped_mlp as mlp_tuning

COUNTS = [5, 0, 20, 700, 64, 129, 0, 1, 300]
TAIL = 3  # rows past offsets[-1]


@pytest.fixture(scope="module")
def guarded():
    from tests._guarded_cuda import GuardedBuffer

    bufs = []

    def make(shape, dtype, at_end=False):
        buf = GuardedBuffer(4 << 20)
        bufs.append(buf)
        t = buf.tensor(shape, dtype, at_end=at_end)
        t.copy_(torch.randn(shape, dtype=torch.float32, device="cuda").to(dtype))
        return t

    yield make
    for b in bufs:
        b.free()


def _offsets():
    return torch.tensor(COUNTS).cumsum(0).to(torch.int32).cuda()


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("at_end", [False, True])
def test_gpu_ragged_m_operands_at_mapping_edges(guarded, at_end):
    T, K_, N = sum(COUNTS) + TAIL, 256, 520
    offsets = _offsets()
    a = guarded((T, K_), torch.bfloat16, at_end)
    b = torch.randn(len(COUNTS), K_, N, dtype=torch.bfloat16, device="cuda") / 16
    out = guarded((T, N), torch.bfloat16, at_end)
    ref = grouped_mm_ragged_m_ref(a.float(), b.float(), offsets, torch.float32)
    # a_bounded: A read through a row-bounded box too
    cands = tuning.RAGGED_M_CANDIDATES
    for cfg in [*cands, *(dataclasses.replace(c, a_bounded=True) for c in cands)]:
        out.fill_(float("nan"))
        K.grouped_mm_ragged_m(a, b, offsets, out, None, cfg)
        torch.cuda.synchronize()
        assert _rel(out, ref) < 2e-2, cfg
        assert torch.all(out[sum(COUNTS) :] == 0), cfg


@pytest.mark.gpu
@pytest.mark.parametrize("at_end", [False, True])
def test_gpu_ragged_k_operands_at_mapping_edges(guarded, at_end):
    T, M, N = sum(COUNTS) + TAIL, 400, 520
    offsets = _offsets()
    dy = guarded((T, M), torch.bfloat16, at_end)
    x = guarded((T, N), torch.bfloat16, at_end)
    ref = grouped_mm_ragged_k_ref(dy.t().float(), x.float(), offsets, torch.float32)
    for cfg in tuning.RAGGED_K_CANDIDATES:
        for accumulate in (False, True):
            if accumulate:
                out = torch.randn(len(COUNTS), M, N, device="cuda")
                want = ref + out
            else:
                out = torch.full((len(COUNTS), M, N), float("nan"), device="cuda")
                out = out.to(torch.bfloat16)
                want = ref
            try:
                K.grouped_mm_ragged_k(dy.t(), x, offsets, out, accumulate, config=cfg)
            except triton.runtime.errors.OutOfResources:
                continue  # fp32 C tiles some static configs cannot fit (see the configs test)
            torch.cuda.synchronize()
            assert _rel(out, want) < 2e-2, (cfg, accumulate)


@pytest.mark.gpu
@pytest.mark.parametrize("gated, interleave", [(True, None), (True, 32), (False, None)])
@pytest.mark.parametrize("wide", [False, True], ids=["recompute", "wide_tiles"])
def test_gpu_dact_operands_at_mapping_edges(guarded, gated, interleave, wide):
    """The default config with the recomputed activation stored, and the wide-tile default of
    many rows (without it)."""
    R, H, F = sum(COUNTS) + TAIL, 256, 384
    W1 = 2 * F if gated else F
    act = resolve_activation("swiglu" if gated else "gelu")
    offsets = _offsets()
    dy = guarded((R, H), torch.bfloat16)
    h = guarded((R, W1), torch.bfloat16)
    dh = guarded((R, W1), torch.bfloat16)
    a_re = None if wide else guarded((R, F), torch.bfloat16, at_end=True)
    w2 = torch.randn(len(COUNTS), H, F, dtype=torch.bfloat16, device="cuda") / 16
    probs = torch.rand(R, device="cuda")
    part = torch.empty(mlp_tuning.dact_partial_rows(F, interleave), R, device="cuda")
    dh.fill_(float("nan"))
    rows = mlp_tuning.DACT_WIDE_MIN_ROWS if wide else R
    cfg = mlp_tuning.dact_candidates(interleave, rows, F, store_a=a_re is not None)[0]
    MLP.grouped_mlp_dact(dy, w2, offsets, h, probs, dh, a_re, part, act, interleave, cfg)
    torch.cuda.synchronize()

    routed = sum(COUNTS)
    hf = h.float().requires_grad_()
    out = apply_activation(hf, act, interleave)
    da = grouped_mm_ragged_m_ref(dy.float(), w2.float(), offsets, torch.float32)
    (dh_ref,) = torch.autograd.grad(out, hf, da * probs[:, None])
    assert _rel(dh[:routed], dh_ref[:routed]) < 2e-2
    if a_re is not None:
        a_ref = out.detach() * probs[:, None]
        assert _rel(a_re[:routed], a_ref[:routed]) < 2e-2


def test_tma_rows_copies_a_contiguous_tensor_at_a_misaligned_address():
    """``contiguous()`` returns a contiguous tensor itself, whatever its address: tma_rows must
    copy one whose base is not 16-byte aligned (TMA faults on it), and keep aligned ones."""
    from moekit.runtime.tma import tma_rows

    buf = torch.arange(8 * 16 + 1, dtype=torch.float16)
    misaligned = buf[1:].view(8, 16)
    assert misaligned.is_contiguous() and misaligned.data_ptr() % 16
    copy = tma_rows(misaligned)
    assert copy.data_ptr() % 16 == 0 and torch.equal(copy, misaligned)
    aligned = buf[:-1].view(8, 16)
    assert tma_rows(aligned) is aligned
