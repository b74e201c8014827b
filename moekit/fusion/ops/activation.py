"""MLP activation basic ops (``SwiGLU``, ``ScaledSwiGLU``, ``GeGLU`` … and the general
``Activate``), computed in fp32 like the fused grouped MLP's epilogue."""

from __future__ import annotations

import torch

from moekit.activations import Activation, apply_activation, resolve_activation
from moekit.fusion.op import BasicOp, OpContext, Params

__all__ = ["Activate", "GeGLU", "ScaledGeGLU", "ScaledSwiGLU", "SwiGLU"]


def _activate(h, probs, act: Activation, interleave: int | None, dtype) -> torch.Tensor:
    a = apply_activation(h.float(), act, interleave)
    if probs is not None:
        a = a * probs.float().unsqueeze(-1)
    return a.to(dtype)


class Activate(BasicOp):
    """``y = act(h)`` over the last dim (``moekit.Activation`` names: gated ones halve it),
    times ``extras["probs"]`` (shape ``h.shape[:-1]``, gradient included) when ``scaled``.
    ``glu_interleave`` is the gate/up layout of gated activations (see
    :mod:`moekit.activations`). Context: ``h`` (the input) and ``probs``."""

    def __init__(
        self,
        activation: str | Activation = "swiglu",
        *,
        scaled: bool = False,
        glu_interleave: int | None = None,
    ) -> None:
        super().__init__()
        self.activation = resolve_activation(activation)
        if glu_interleave is not None and (
            not self.activation.gated or isinstance(glu_interleave, bool)
            or not isinstance(glu_interleave, int) or glu_interleave <= 0
        ):  # fmt: skip
            raise ValueError(
                "glu_interleave must be a positive int and needs a gated activation, got "
                f"{glu_interleave!r} with {self.activation.name!r}"
            )
        self.scaled = bool(scaled)
        self.glu_interleave = glu_interleave
        self.extra_inputs = ("probs",) if self.scaled else ()

    def scale_of(self, h: torch.Tensor, extras: dict) -> torch.Tensor | None:
        """The probs scaling rows like ``h`` (checked), or None when not ``scaled``."""
        if not self.scaled:
            return None
        p = extras["probs"]
        if not isinstance(p, torch.Tensor) or p.shape != h.shape[:-1]:
            got = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(
                f"{type(self).__name__}: extra input 'probs' must have shape "
                f"{tuple(h.shape[:-1])} (the input's rows), got {got}"
            )
        return p

    def _check(self, h: torch.Tensor) -> None:
        n = h.shape[-1]
        inter = self.glu_interleave
        if self.activation.gated and (n % 2 or (inter is not None and (n // 2) % inter)):
            raise ValueError(
                f"{type(self).__name__}: a gated activation needs an even last dim"
                f"{' whose half divides by glu_interleave' if inter else ''}, got {n}"
            )

    def op_forward(self, ctx: OpContext, x: torch.Tensor, extras: dict, params: Params) -> tuple:
        self._check(x)
        probs = self.scale_of(x, extras)
        ctx.h, ctx.probs = x, probs
        return _activate(x, probs, self.activation, self.glu_interleave, x.dtype), None

    def op_backward(self, ctx: OpContext, dy: torch.Tensor, grads: dict, params: Params) -> tuple:
        h, probs = ctx.h, ctx.probs
        with torch.enable_grad():
            hl = h.detach().requires_grad_()
            pl = None if probs is None else probs.detach().requires_grad_()
            a = _activate(hl, pl, self.activation, self.glu_interleave, torch.float32)
            wrt = [hl] if pl is None else [hl, pl]
            got = torch.autograd.grad(a, wrt, dy.float())
        dh = got[0].to(h.dtype)
        return dh, ({"probs": got[1].to(probs.dtype)} if pl is not None else {}), {}

    def reference(self, x: torch.Tensor, extras: dict) -> tuple:
        probs = self.scale_of(x, extras)
        return _activate(x, probs, self.activation, self.glu_interleave, x.dtype), {}

    def extra_repr(self) -> str:
        inter = f", glu_interleave={self.glu_interleave}" if self.glu_interleave else ""
        return f"{self.activation.name!r}, scaled={self.scaled}{inter}"


class SwiGLU(Activate):
    """``silu(gate) * up`` (see :class:`Activate`)."""

    def __init__(self, *, glu_interleave: int | None = None) -> None:
        super().__init__("swiglu", glu_interleave=glu_interleave)


class ScaledSwiGLU(Activate):
    """``silu(gate) * up * probs``: the MoE expert activation with the routing prob of each
    row folded in (extra input ``probs``; see :class:`Activate`)."""

    def __init__(self, *, glu_interleave: int | None = None) -> None:
        super().__init__("swiglu", scaled=True, glu_interleave=glu_interleave)


class GeGLU(Activate):
    """``gelu(gate) * up`` (see :class:`Activate`)."""

    def __init__(self, *, glu_interleave: int | None = None) -> None:
        super().__init__("geglu", glu_interleave=glu_interleave)


class ScaledGeGLU(Activate):
    """``gelu(gate) * up * probs`` (see :class:`ScaledSwiGLU`)."""

    def __init__(self, *, glu_interleave: int | None = None) -> None:
        super().__init__("geglu", scaled=True, glu_interleave=glu_interleave)
