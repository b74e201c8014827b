"""Pure-PyTorch twin of :mod:`moekit.kernels.rmsnorm`: the test oracle and the CPU path.

Same rounding points as the kernel: ``residual_out`` is rounded to the input dtype once, and the
norm reads that rounded value in fp32.
"""

from __future__ import annotations

import torch


def add_rmsnorm_ref(
    x: torch.Tensor,  # [..., H] bf16 / fp16 / fp32
    residual: torch.Tensor | None,  # [..., H] like x, or None
    weight: torch.Tensor,  # [H]
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(normed [..., H], residual_out [..., H], rstd [...] fp32)``.

    ``residual_out = round(x + residual)`` (``x`` itself without a residual),
    ``normed = round(residual_out · rsqrt(mean(residual_out²) + eps) · weight)``.
    Differentiable with torch autograd (used as the gradient oracle).
    """
    if residual is not None:
        ro = (x.float() + residual.float()).to(x.dtype)
    else:
        ro = x
    rf = ro.float()
    rstd = torch.rsqrt(rf.pow(2).mean(-1) + eps)
    normed = (rf * rstd.unsqueeze(-1) * weight.float()).to(x.dtype)
    return normed, ro, rstd


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``round(x · rsqrt(mean(x²) + eps) · weight)`` over the last dim, fp32 inside."""
    return add_rmsnorm_ref(x, None, weight, eps)[0]


def add_rmsnorm_bwd_ref(
    d_normed: torch.Tensor,  # [T, H]
    d_residual_out: torch.Tensor | None,  # [T, H] or None
    residual_out: torch.Tensor,  # [T, H] the norm's (rounded) input
    weight: torch.Tensor,  # [H]
    rstd: torch.Tensor,  # [T] fp32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of the backward kernel: ``(d_residual_out_total [T, H], dw [H])``.

    ``dr = rstd·(g − r̂·mean(g·r̂)) + d_residual_out`` with ``g = dy·w``, ``r̂ = r·rstd``;
    ``dw = Σ_t dy·r̂``. ``dr`` is the gradient of both x and residual.
    """
    r = residual_out.float()
    rs = rstd.unsqueeze(-1)
    r_hat = r * rs
    dy = d_normed.float()
    g = dy * weight.float()
    dr = rs * (g - r_hat * (g * r_hat).mean(-1, keepdim=True))
    if d_residual_out is not None:
        dr = dr + d_residual_out.float()
    dw = (dy * r_hat).sum(0)
    return dr.to(d_normed.dtype), dw.to(weight.dtype)
