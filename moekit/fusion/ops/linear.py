"""``Linear`` (optionally tensor-parallel) and ``Bias`` basic ops."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moekit.fusion.op import BasicOp, OpContext, Params

__all__ = ["Bias", "Linear"]

MODES = (None, "column", "row")


def _group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def accumulate_weight_grad(w: torch.Tensor, dw: torch.Tensor) -> torch.Tensor | None:
    """``dw`` as the gradient of ``w``, or added into ``w.main_grad`` (fp32) when it has one."""
    mg = getattr(w, "main_grad", None)
    if mg is None:
        return dw
    mg.add_(dw)
    return None


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Bias-gradient sums accumulate in fp32 (fp64 for fp64 gradients)."""
    return torch.promote_types(t.dtype, torch.float32)


class Linear(BasicOp):
    """``y = x @ weightᵀ (+ bias)`` over the last dim of ``x [..., in]``.

    ``mode=None``: ``weight [out, in]``. Tensor-parallel over ``group`` (W ranks, Megatron's
    layouts): ``mode="column"``: this rank holds ``out/W`` rows of the weight, ``x`` is
    replicated and the output is this rank's slice; the input gradient is all-reduced over the
    group. ``mode="row"``: this rank holds ``in/W`` columns, ``x`` is this rank's slice of the
    input and the output is a partial sum (follow it with :class:`AllReduce`; a bias goes
    after that, as :class:`Bias`).

    Context: ``x`` (the input).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        mode: str | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        world, _ = _group_size_rank(group) if mode else (1, 0)
        if mode == "row" and bias:
            raise ValueError("a row-parallel Linear has no bias: add Bias after the AllReduce")
        split = {"column": out_features, "row": in_features}.get(mode or "", 0)
        if split % world:
            what = "out_features" if mode == "column" else "in_features"
            raise ValueError(f"{what} = {split} must be divisible by the group size {world}")
        self.in_features, self.out_features, self.mode, self.group = (
            in_features, out_features, mode, group,
        )  # fmt: skip
        local_out = out_features // world if mode == "column" else out_features
        local_in = in_features // world if mode == "row" else in_features
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(local_out, local_in, **kw))
        self.bias = nn.Parameter(torch.empty(local_out, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``torch.nn.Linear``'s initialisation applied to this rank's shard as if it were the
        whole weight (as the constructor does; e.g. after building on the meta device and
        ``to_empty``). In ``mode="row"`` the bound therefore comes from the shard's
        ``in_features / W`` (``moekit.nn.RowParallelLinear`` instead initialises the full
        weight and takes its columns)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def _linear(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        w = params["weight"]
        if x.shape[-1] != w.shape[1]:
            raise ValueError(
                f"Linear: x.shape[-1] must be {w.shape[1]} (in_features"
                f"{'/W' if self.mode == 'row' else ''}), got {x.shape[-1]}"
            )
        return F.linear(x, w, params.get("bias"))

    def op_forward(self, ctx: OpContext, x: torch.Tensor, extras: dict, params: Params) -> tuple:
        ctx.x = x
        return self._linear(x, params), None

    def op_backward(self, ctx: OpContext, dy: torch.Tensor, grads: dict, params: Params) -> tuple:
        x, w, b = ctx.x, params["weight"], params.get("bias")
        dx = None
        if ctx.needs_input_grad:
            dx = dy @ w
            if self.mode == "column" and _group_size_rank(self.group)[0] > 1:
                dist.all_reduce(dx, group=self.group)
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dw = accumulate_weight_grad(w, dy2.t() @ x2) if w.requires_grad else None
        db = None
        if b is not None and b.requires_grad:
            db = dy2.sum(0, dtype=_acc_dtype(dy2)).to(b.dtype)
        return dx, {}, {"weight": dw, "bias": db}

    def autograd_forward(self, x: torch.Tensor, extras: dict, params: Params) -> tuple:
        return self._linear(x, params), None

    def autograd_ready(self, params: Params) -> bool:
        # F.linear's own backward: no tensor-parallel reduction of dx (a row-parallel Linear's
        # backward is local), no main_grad
        if getattr(params["weight"], "main_grad", None) is not None:
            return False
        return self.mode != "column" or _group_size_rank(self.group)[0] == 1

    def reference(self, x: torch.Tensor, extras: dict) -> tuple:
        if self.mode == "column" and _group_size_rank(self.group)[0] > 1:
            x = _ColumnInputRef.apply(x, self.group)
        return F.linear(x, self.weight, self.bias), {}

    def extra_repr(self) -> str:
        mode = f", mode={self.mode!r}" if self.mode else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}{mode}"
        )


class _ColumnInputRef(torch.autograd.Function):
    """The input of a column-parallel layer: identity forward, all-reduced gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class Bias(BasicOp):
    """``y = x + bias`` over the last dim (``bias [features]``). Context: nothing."""

    def __init__(
        self,
        features: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if isinstance(features, bool) or not isinstance(features, int) or features < 1:
            raise ValueError(f"features must be a positive int, got {features!r}")
        self.bias = nn.Parameter(torch.zeros(features, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        """Zeros (its initialisation)."""
        nn.init.zeros_(self.bias)

    def op_forward(self, ctx: OpContext, x: torch.Tensor, extras: dict, params: Params) -> tuple:
        return x + params["bias"], None

    def op_backward(self, ctx: OpContext, dy: torch.Tensor, grads: dict, params: Params) -> tuple:
        b, db = params["bias"], None
        if b.requires_grad:
            db = dy.reshape(-1, dy.shape[-1]).sum(0, dtype=_acc_dtype(dy)).to(b.dtype)
        return dy, {}, {"bias": db}

    def reference(self, x: torch.Tensor, extras: dict) -> tuple:
        return x + self.bias, {}
