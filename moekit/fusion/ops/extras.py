"""Basic ops that join the main tensor with a named extra: ``AddExtraInput`` and
``MakeExtraOutput`` (e.g. the residual stream around a norm)."""

from __future__ import annotations

import torch

from moekit.fusion.op import BasicOp, OpContext, Params

__all__ = ["AddExtraInput", "MakeExtraOutput"]


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name must be an identifier string, got {name!r}")
    return name


class AddExtraInput(BasicOp):
    """``y = x + extras[name]`` (same shape and dtype). Context: nothing."""

    def __init__(self, name: str = "residual") -> None:
        super().__init__()
        self.name = _check_name(name)
        self.extra_inputs = self.autocast_extras = (self.name,)

    def other(self, x: torch.Tensor, extras: dict) -> torch.Tensor:
        """The extra input, checked against the main tensor."""
        r = extras[self.name]
        if not isinstance(r, torch.Tensor) or r.shape != x.shape or r.dtype != x.dtype:
            got = (tuple(r.shape), r.dtype) if isinstance(r, torch.Tensor) else type(r).__name__
            raise ValueError(
                f"AddExtraInput: extra input {self.name!r} must match the main tensor "
                f"{tuple(x.shape)} {x.dtype}, got {got}"
            )
        return r

    def op_forward(self, ctx: OpContext, x: torch.Tensor, extras: dict, params: Params) -> tuple:
        return x + self.other(x, extras), None

    def op_backward(self, ctx: OpContext, dy: torch.Tensor, grads: dict, params: Params) -> tuple:
        return dy, {self.name: dy}, {}

    def reference(self, x: torch.Tensor, extras: dict) -> tuple:
        return x + extras[self.name], {}

    def extra_repr(self) -> str:
        return repr(self.name)


class MakeExtraOutput(BasicOp):
    """``y = x`` and ``extras[name] = x`` (its gradient adds to ``x``'s). Context: nothing."""

    def __init__(self, name: str = "residual_out") -> None:
        super().__init__()
        self.name = _check_name(name)
        self.extra_outputs = (self.name,)

    def op_forward(self, ctx: OpContext, x: torch.Tensor, extras: dict, params: Params) -> tuple:
        return x, {self.name: x}

    def op_backward(self, ctx: OpContext, dy: torch.Tensor, grads: dict, params: Params) -> tuple:
        g = grads.get(self.name)
        return (dy if g is None else dy + g), {}, {}

    def reference(self, x: torch.Tensor, extras: dict) -> tuple:
        return x, {self.name: x}

    def extra_repr(self) -> str:
        return repr(self.name)
