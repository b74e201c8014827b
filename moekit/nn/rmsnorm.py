"""RMSNorm module (optionally fused with the residual add) over :mod:`moekit.ops.rmsnorm`."""

from __future__ import annotations

import torch
from torch import nn

from moekit.ops.rmsnorm import add_rmsnorm


class RMSNorm(nn.Module):
    """``y = x · rsqrt(mean(x²) + eps) · weight`` over the last dim (fp32 inside).

    ``forward(x)`` returns ``y``; ``forward(x, residual)`` returns ``(y, residual_out)`` with
    ``residual_out = x + residual`` fused into the same kernel.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        """weight = 1 (e.g. after ``to_empty`` of a module built on the meta device)."""
        nn.init.ones_(self.weight)

    def forward(
        self,
        x: torch.Tensor,  # [..., H]
        residual: torch.Tensor | None = None,  # [..., H]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        normed, ro = add_rmsnorm(x, residual, self.weight, self.eps)
        return normed if residual is None else (normed, ro)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
