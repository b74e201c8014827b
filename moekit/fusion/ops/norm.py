"""``RMSNorm`` and ``LayerNorm`` basic ops over the last dim."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moekit.fusion.op import BasicOp, OpContext, Params
from moekit.nn.rmsnorm import RMSNorm as RMSNormModule
from moekit.ops.rmsnorm import add_rmsnorm_backward, add_rmsnorm_forward, validate_norm_inputs

__all__ = ["LayerNorm", "RMSNorm"]


def _check_hidden(hidden_size: object) -> int:
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
        raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
    return hidden_size


def rows(t: torch.Tensor) -> torch.Tensor:
    """``t [..., H]`` as contiguous ``[T, H]`` rows (a view when it already is contiguous)."""
    if t.dim() == 2 and t.is_contiguous():
        return t
    return t.reshape(-1, t.shape[-1]) if t.is_contiguous() else t.contiguous().view(-1, t.shape[-1])


class RMSNorm(BasicOp, RMSNormModule):
    """``y = x · rsqrt(mean(x²) + eps) · weight`` (fp32 inside; moekit's kernel on the GPU): a
    :class:`moekit.nn.RMSNorm` (same arguments and parameter) as a basic op.

    Context: ``x`` (the input as ``[T, H]`` rows) and ``rstd [T]`` fp32."""

    def op_forward(self, ctx: OpContext, x: torch.Tensor, extras: dict, params: Params) -> tuple:
        x2, w = rows(x), params["weight"]
        validate_norm_inputs(x2, None, w, self.eps)
        y, _, rstd = add_rmsnorm_forward(x2, None, w, self.eps, True)
        ctx.x, ctx.rstd = x2, rstd
        return y.view(x.shape), None

    def op_backward(self, ctx: OpContext, dy: torch.Tensor, grads: dict, params: Params) -> tuple:
        return self.backward_with_residual(ctx, dy, None, params)

    def backward_with_residual(
        self, ctx: OpContext, dy: torch.Tensor, d_residual: torch.Tensor | None, params: Params
    ) -> tuple:
        """The backward, plus the gradient ``d_residual`` of the norm's input taken elsewhere
        (e.g. a residual stream) added into dx in the same kernel."""
        if d_residual is not None and d_residual.dtype != dy.dtype:
            d_residual = d_residual.to(dy.dtype)
        d2 = None if d_residual is None else rows(d_residual)
        w = params["weight"]
        dx, dw = add_rmsnorm_backward(rows(dy), d2, ctx.x, w, ctx.rstd)
        if dx.shape != dy.shape:
            dx = dx.view(dy.shape)
        return dx, {}, {"weight": dw if w.requires_grad else None}

    def reference(self, x: torch.Tensor, extras: dict) -> tuple:
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return y.to(x.dtype), {}


class LayerNorm(BasicOp):
    """``torch.nn.functional.layer_norm`` over the last dim (``weight``, optional ``bias``).

    Context: ``x`` (the input)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = _check_hidden(hidden_size)
        self.eps = float(eps)
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(hidden_size, **kw))
        self.bias = nn.Parameter(torch.zeros(hidden_size, **kw)) if bias else None

    def reset_parameters(self) -> None:
        """Weight ones, bias zeros (its initialisation)."""
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _norm(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        w, b = params["weight"], params.get("bias")
        return F.layer_norm(x, (self.hidden_size,), w, b, self.eps)

    def op_forward(self, ctx: OpContext, x: torch.Tensor, extras: dict, params: Params) -> tuple:
        ctx.x = x
        return self._norm(x, params), None

    def op_backward(self, ctx: OpContext, dy: torch.Tensor, grads: dict, params: Params) -> tuple:
        # the parameters given may be casts (autocast): differentiate with respect to them
        wrt = {k: p for k, p in params.items() if p is not None and p.requires_grad}
        with torch.enable_grad():
            xl = ctx.x.detach().requires_grad_()
            got = torch.autograd.grad(self._norm(xl, params), [xl, *wrt.values()], dy)
        return got[0], {}, dict(zip(wrt, got[1:]))

    def reference(self, x: torch.Tensor, extras: dict) -> tuple:
        xf = x.float()
        w = self.weight.float()
        b = None if self.bias is None else self.bias.float()
        return F.layer_norm(xf, (self.hidden_size,), w, b, self.eps).to(x.dtype), {}

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, bias={self.bias is not None}"
