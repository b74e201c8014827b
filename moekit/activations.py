"""MLP activations: the public ``Activation`` type and the PyTorch definition of each.

The definitions below are what the fused kernels compute; they also run the unfused paths
(CPU, and configurations the fused kernels do not cover) and serve as the tests' oracle.

Gated activations (``swiglu``, ``geglu``, ``clamped_swiglu``) read a pre-activation of width 2F
holding a gate half and an up half and return width F; the others map width F to width F.

Gate/up layout of a gated pre-activation ``h`` [R, 2F] (and of the fc1 weight's rows):

* ``glu_interleave=None``: ``h[:, :F]`` is the gate, ``h[:, F:]`` the up projection
  (Megatron-Core / TransformerEngine "[gate | up]").
* ``glu_interleave=I``: blocks of I columns alternate gate, up, gate, up, ... so gate column f
  sits at ``(f // I) * 2I + f % I`` and its up column I further on. I must divide F.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

GATED = ("swiglu", "geglu", "clamped_swiglu")
UNGATED = ("relu2", "gelu", "silu")
ACTIVATIONS = GATED + UNGATED


@dataclasses.dataclass(frozen=True)
class Activation:
    """An activation and its constants.

    ``clamped_swiglu`` is gpt-oss's: ``g = min(g, limit)``, ``u = clamp(u, -limit, limit)``,
    ``out = g * sigmoid(alpha * g) * (u + offset)``. ``gelu``/``geglu`` use the exact (erf) GELU,
    like ``torch.nn.functional.gelu``'s default.
    """

    name: str
    limit: float = 7.0
    alpha: float = 1.702
    offset: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.name!r}")
        if not (self.limit > 0 and math.isfinite(self.limit)):
            raise ValueError(f"activation limit must be positive and finite, got {self.limit}")
        for name in ("alpha", "offset"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"activation {name} must be finite, got {getattr(self, name)}")

    @property
    def gated(self) -> bool:
        return self.name in GATED


def resolve_activation(activation: str | Activation) -> Activation:
    """An ``Activation`` from its name (default constants) or itself."""
    if isinstance(activation, Activation):
        return activation
    if isinstance(activation, str):
        return Activation(activation)
    raise TypeError(
        f"activation must be a str or moekit Activation, got {type(activation).__name__}"
    )


def split_gate_up(h: torch.Tensor, interleave: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up halves [..., F] of a gated pre-activation [..., 2F] in either layout."""
    two_f = h.shape[-1]
    if interleave is None:
        return h[..., : two_f // 2], h[..., two_f // 2 :]
    blocks = h.unflatten(-1, (two_f // (2 * interleave), 2, interleave))
    return blocks[..., 0, :].flatten(-2), blocks[..., 1, :].flatten(-2)


def apply_activation(h: torch.Tensor, act: Activation, interleave: int | None) -> torch.Tensor:
    """act(h) in h's dtype, computed in fp32: [R, 2F] → [R, F] (gated) or [R, F] → [R, F]."""
    x = h.float()
    if act.gated:
        g, u = split_gate_up(x, interleave)
        if act.name == "swiglu":
            out = F.silu(g) * u
        elif act.name == "geglu":
            out = F.gelu(g) * u
        else:
            g = g.clamp(max=act.limit)
            u = u.clamp(-act.limit, act.limit)
            out = g * torch.sigmoid(act.alpha * g) * (u + act.offset)
    elif act.name == "relu2":
        out = F.relu(x).square()
    elif act.name == "gelu":
        out = F.gelu(x)
    else:
        out = F.silu(x)
    return out.to(h.dtype)
