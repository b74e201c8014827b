"""Every fused grouped-MLP tile config the autotuner may pick computes the same result, and the
defaults follow their shape rules.

GPU: each fc1 and dact candidate (gated, with and without a GLU interleave; dact with and
without the recomputed activation) against the reference, with empty experts, experts shorter
than a tile and rows past offsets[-1]. CPU: which config leads for which shape.
"""

from __future__ import annotations

import pytest
import torch
import triton

from moekit.activations import apply_activation, resolve_activation
from moekit.kernels import grouped_mlp as MLP
from moekit.reference.grouped_gemm import grouped_mm_ragged_m_ref
from moekit.runtime.intmath import cdiv
from moekit.tuning import grouped_mlp as tuning

COUNTS = [0, 1, 63, 129, 0, 700, 256, 3]
TAIL = 5
H, F = 256, 512


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()


def _case(device="cuda", dtype=torch.bfloat16):  # fp32 runs as TF32: bf16-like tolerances
    E, R = len(COUNTS), sum(COUNTS) + TAIL
    offsets = torch.tensor(COUNTS).cumsum(0).to(torch.int32).to(device)
    return {
        "offsets": offsets, "R": R, "routed": sum(COUNTS),
        "x": torch.randn(R, H, device=device).to(dtype),
        "w1": (torch.randn(E, 2 * F, H, device=device) / H**0.5).to(dtype),
        "w2": (torch.randn(E, H, F, device=device) / F**0.5).to(dtype),
        "dy": torch.randn(R, H, device=device).to(dtype),
        "h": torch.randn(R, 2 * F, device=device).to(dtype),
        "probs": torch.rand(R, device=device),
    }  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleave", [None, 64])
def test_gpu_every_fc1_candidate(interleave, dtype):
    c = _case(dtype=dtype)
    act = resolve_activation("swiglu")
    routed = c["routed"]
    h_ref = grouped_mm_ragged_m_ref(
        c["x"].float(), c["w1"].float().transpose(1, 2), c["offsets"], torch.float32
    )
    a_ref = apply_activation(h_ref, act, interleave) * c["probs"][:, None]
    for cfg in tuning.fc1_candidates(True, interleave, dtype):
        h = torch.full((c["R"], 2 * F), float("nan"), device="cuda", dtype=dtype)
        a = torch.full((c["R"], F), float("nan"), device="cuda", dtype=dtype)
        MLP.grouped_mlp_fc1(
            c["x"], c["w1"], c["offsets"], a, h, c["probs"], None, act, interleave, cfg
        )
        assert _rel(h[:routed], h_ref[:routed]) < 2e-2, cfg
        assert _rel(a[:routed], a_ref[:routed]) < 2e-2, cfg


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleave", [None, 64])
@pytest.mark.parametrize("store_a", [False, True])
def test_gpu_every_dact_candidate(interleave, store_a, dtype):
    c = _case(dtype=dtype)
    act = resolve_activation("swiglu")
    routed, R = c["routed"], c["R"]
    hf = c["h"].float().requires_grad_()
    out = apply_activation(hf, act, interleave)
    da = grouped_mm_ragged_m_ref(c["dy"].float(), c["w2"].float(), c["offsets"], torch.float32)
    (dh_ref,) = torch.autograd.grad(out, hf, da * c["probs"][:, None])
    dp_ref = (da * out.detach()).sum(1)
    a_ref = out.detach() * c["probs"][:, None]
    part = torch.empty(tuning.dact_partial_rows(F, interleave), R, device="cuda")
    default = tuning.dact_candidates(interleave, R, F, store_a, dtype)[0]
    for cfg in tuning.dact_candidates(interleave, R, F, store_a, dtype):
        dh = torch.full((R, 2 * F), float("nan"), device="cuda", dtype=dtype)
        a = torch.full((R, F), float("nan"), device="cuda", dtype=dtype)
        try:
            used = MLP.grouped_mlp_dact(
                c["dy"], c["w2"], c["offsets"], c["h"], c["probs"], dh, a if store_a else None,
                part, act, interleave, cfg,
            )  # fmt: skip
        except triton.runtime.errors.OutOfResources:
            # The wide tile does not fit with the activation store too (the autotuner skips it
            # the same way); the default always fits.
            assert store_a and cfg != default and cfg.block_n == 256, f"{cfg} does not fit"
            continue
        assert used.shape[0] == cdiv(F, cfg.block_n)
        assert _rel(dh[:routed], dh_ref[:routed]) < 2e-2, cfg
        assert _rel(used.sum(0)[:routed], dp_ref[:routed]) < 2e-2, cfg
        assert torch.all(used[:, routed:] == 0), f"{cfg}: tail partials not zero"
        if store_a:
            assert _rel(a[:routed], a_ref[:routed]) < 2e-2, cfg


@pytest.mark.parametrize(
    "rows, F_, store_a, wide",
    [
        (131072, 768, False, True),  # Qwen3-30B-A3B's layer: many rows, small F
        (65536, 2048, False, True),
        (32768, 4096, False, True),
        (131072, 768, True, False),  # the recomputed activation is stored too
        (16384, 14336, False, False),  # Mixtral: F too wide
        (32767, 1024, False, False),  # too few rows
        (8, 768, False, False),  # a decode step
    ],
)
def test_dact_default_by_shape(rows, F_, store_a, wide):
    cands = tuning.dact_candidates(None, rows, F_, store_a)
    assert (cands[0].block_n == 256) == wide
    assert len(set(cands)) == len(cands)
    # every routing of a shape may meet any candidate once tuned: the partials fit them all
    others = tuning.dact_candidates(None, rows, F_, not store_a)
    assert set(cands) == set(others)
    need = max(cdiv(F_, c.block_n) for c in cands)
    assert tuning.dact_partial_rows(F_, None) >= need


def test_dact_candidates_fit_the_glu_interleave():
    for cfg in tuning.dact_candidates(32, 1 << 20, 1024, False):
        assert 32 % cfg.block_n == 0


def test_fp32_candidates_are_their_own():
    """fp32 operands take 32-deep K tiles (the 16-bit tiles' stages do not fit in shared
    memory), whatever the shape."""
    for cands in (
        tuning.fc1_candidates(True, None, torch.float32),
        tuning.dact_candidates(None, 1 << 20, 768, False, torch.float32),
        tuning.dact_candidates(None, 8, 768, True, torch.float32),
    ):
        assert all(c.block_k == 32 for c in cands)
    assert tuning.fc1_candidates(True, None)[0].block_k == 64
