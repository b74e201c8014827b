"""The oracle of the FP8 expert MLP (``moekit.ops.fp8_mlp.grouped_mlp_fp8``): the same math in
fp32 with the same quantization points, each a fake quantization (quantize, dequantize), and
the GEMMs' forward and backward written out by hand (only the activation's elementwise
derivative comes from autograd, in fp32).

Quantization points (blockwise recipe; "row" = 1×128 along the last dim, "col" = 128×1 along
the tokens, "both" = 128×128)::

    forward    x → row,  w1 → both,  h = x·w1ᵀ → bf16,  a = act(h)·p in fp32 → row and col,
               w2 → both,  y = a·w2ᵀ
    backward   dy → row (dgrad) and col (wgrad),  da = dy·w2 → bf16,
               dh = act'(h)·(da·p) in fp32 → row (dgrad) and col (wgrad),  x → col,
               dx = dh·w1,  dW2[e] = dyᵀ·a,  dW1[e] = dhᵀ·x,  dp = Σ_f da·act(h)

``composed=True``: the composition that runs where F is not a multiple of 128, which rounds a
and dh to the layer's dtype before quantizing them.
"""

from __future__ import annotations

import itertools

import torch

from moekit.activations import Activation, apply_activation
from moekit.reference.fp8 import dequantize_fp8_ref, quantize_fp8_ref

__all__ = ["fake_quantize", "grouped_mlp_fp8_ref"]


def fake_quantize(x: torch.Tensor, axis: str, block: int = 128) -> torch.Tensor:
    """x quantized to e4m3 blockwise and dequantized, in fp32."""
    return dequantize_fp8_ref(*quantize_fp8_ref(x, axis, block, False), axis, block)


def _rows_times(a, w, bounds, R) -> torch.Tensor:
    """[R, N] fp32: a[rows of e] @ w[e] ([E, K, N] per expert), zero rows past the last."""
    out = torch.zeros(R, w.shape[2], device=a.device)
    for e, (s, t) in enumerate(itertools.pairwise(bounds)):
        out[s:t] = a[s:t] @ w[e]
    return out


def _wgrad(g, x, bounds) -> torch.Tensor:
    """[E, N, K] fp32: g[rows of e]ᵀ @ x[rows of e]."""
    return torch.stack([g[s:t].t() @ x[s:t] for s, t in itertools.pairwise(bounds)])


def grouped_mlp_fp8_ref(
    x: torch.Tensor,  # [R, H]
    offsets: torch.Tensor,  # [E] cumulative row ends, multiples of 128
    w1: torch.Tensor,  # [E, 2F or F, H]
    w2: torch.Tensor,  # [E, H, F]
    probs: torch.Tensor | None,  # [R]
    dy: torch.Tensor,  # [R, H] the output's gradient
    act: Activation,
    interleave: int | None = None,
    dtype: torch.dtype = torch.bfloat16,  # the layer's dtype (h, da are rounded to it)
    composed: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(y, dx, dw1, dw2, dprobs or None) of the FP8 MLP, all fp32 (y, dx: [R, H])."""
    R = x.shape[0]
    bounds = [0, *offsets.tolist()]
    x, dy = x.float(), dy.float()
    w1q, w2q = fake_quantize(w1.float(), "both"), fake_quantize(w2.float(), "both")
    h = _rows_times(fake_quantize(x, "row"), w1q.transpose(1, 2), bounds, R).to(dtype).float()
    act_h = apply_activation(h, act, interleave)
    p = probs.float()[:, None] if probs is not None else torch.ones(R, 1, device=x.device)
    a = act_h * p
    if composed:
        a = a.to(dtype).float()
    y = _rows_times(fake_quantize(a, "row"), w2q.transpose(1, 2), bounds, R)

    da = _rows_times(fake_quantize(dy, "row"), w2q, bounds, R).to(dtype).float()
    dw2 = _wgrad(fake_quantize(dy, "col"), fake_quantize(a, "col"), bounds)
    with torch.enable_grad():
        hh = h.clone().requires_grad_()
        (dh,) = torch.autograd.grad(apply_activation(hh, act, interleave), hh, da * p)
    if composed:
        dh = dh.to(dtype).float()
    dx = _rows_times(fake_quantize(dh, "row"), w1q, bounds, R)
    dw1 = _wgrad(fake_quantize(dh, "col"), fake_quantize(x, "col"), bounds)
    dprobs = (da * act_h).sum(dim=1) if probs is not None else None
    return y, dx, dw1, dw2, dprobs
