"""Pure-PyTorch grouped MLP: the oracle of ``moekit.ops.grouped_mlp`` and its CPU path.

Built from the reference grouped GEMM and activations, differentiated by autograd.
"""

from __future__ import annotations

import torch

from moekit.activations import Activation, apply_activation, resolve_activation
from moekit.reference.grouped_gemm import grouped_mm_ragged_m_ref


def grouped_mlp_ref(
    x: torch.Tensor,  # [R, H] expert-sorted rows
    offsets: torch.Tensor,  # [E] cumulative end offsets
    w1: torch.Tensor,  # [E, 2F, H] gated, [E, F, H] otherwise
    w2: torch.Tensor,  # [E, H, F]
    probs: torch.Tensor | None = None,  # [R]
    *,
    activation: str | Activation = "swiglu",
    glu_interleave: int | None = None,
    b1: torch.Tensor | None = None,  # [E, 2F] / [E, F]
    b2: torch.Tensor | None = None,  # [E, H]
) -> torch.Tensor:  # [R, H]; rows past offsets[-1] are zero
    """y = fc2(act(fc1(x)) * probs) per expert segment, in x's dtype with fp32 math."""
    act = resolve_activation(activation)
    h = grouped_mm_ragged_m_ref(x, w1.transpose(1, 2), offsets, torch.float32, b1)
    a = apply_activation(h, act, glu_interleave)  # fp32
    if probs is not None:
        a = a * probs.float()[:, None]
    a = a.to(x.dtype)
    return grouped_mm_ragged_m_ref(a, w2.transpose(1, 2), offsets, x.dtype, b2)
