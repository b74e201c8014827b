"""``TopKRouter``: the router of an MoE layer (logits GEMM + fused top-k + its losses)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from moekit.ops.router import RouterConfig, route
from moekit.ops.router_losses import (
    attach_loss,
    check_grad_scale,
    load_balancing_loss,
    router_z_loss,
)

__all__ = ["RouterOutput", "TopKRouter"]


@dataclasses.dataclass
class RouterOutput:
    probs: torch.Tensor  # [T, k] float32
    indices: torch.Tensor  # [T, k] int32
    counts: torch.Tensor  # [E] int32 tokens routed to each expert
    aux_loss: torch.Tensor | None  # scalar, already times aux_loss_coeff (None when off)
    z_loss: torch.Tensor | None  # scalar, already times z_loss_coeff (None when off)


class TopKRouter(nn.Module):
    """``weight [E, H]``; ``forward(x [T, H])`` → :class:`RouterOutput`.

    The logits ``x @ weight^T`` go through :func:`moekit.ops.topk_routing` with the options of
    ``config`` (:class:`moekit.ops.RouterConfig`). With ``config.expert_bias`` an fp32 buffer
    ``expert_bias [E]`` steers selection only and :meth:`update_expert_bias` adjusts it
    (aux-loss-free balancing). The load-balancing loss (``aux_loss_coeff``) is computed on the
    normalised scores of all experts, the z-loss (``z_loss_coeff``) on the logits; both are
    returned, scaled, for the layer to apply.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        k: int,
        config: RouterConfig | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("num_experts", num_experts), ("k", k)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if k > num_experts:
            raise ValueError(f"k must be at most num_experts = {num_experts}, got {k}")
        config = RouterConfig() if config is None else config
        if not isinstance(config, RouterConfig):
            raise TypeError(f"config must be a RouterConfig, got {type(config).__name__}")
        self.num_experts, self.k, self.config = num_experts, k, config
        self.aux_loss_coeff, self.z_loss_coeff = config.aux_loss_coeff, config.z_loss_coeff
        # the checks that need E, running nothing: construction may be on the meta device
        config.groups(num_experts, k)
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, device=device, dtype=dtype)
        )
        if config.expert_bias:
            self.register_buffer(
                "expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device)
            )
        else:
            self.expert_bias = None
        self._aux_loss_grad_scale: float | torch.Tensor = 1.0
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """weight ~ N(0, 1/hidden_size); the expert bias (if any) zero."""
        nn.init.normal_(self.weight, std=self.weight.shape[1] ** -0.5)
        if self.expert_bias is not None:
            with torch.no_grad():
                self.expert_bias.zero_()

    @property
    def aux_loss_grad_scale(self) -> float | torch.Tensor:
        """The gradient with which the layer that applies this router's losses (``MoELayer``,
        the fusion ``Router`` op) enters them into the backward; default 1.0. Set it to the
        factor the training loss is multiplied by before its backward, so that the losses keep
        their coefficients' weight: ``1 / N`` when the loss is divided over N accumulated
        micro-batches, or a loss scaler's scale (a float, or a one-element tensor read when the
        backward runs)."""
        return self._aux_loss_grad_scale

    @aux_loss_grad_scale.setter
    def aux_loss_grad_scale(self, value: float | torch.Tensor) -> None:
        self._aux_loss_grad_scale = check_grad_scale("aux_loss_grad_scale", value)

    def _apply(self, fn, recurse=True):
        # Module casts (.to(bf16), .half()) would round expert_bias, whose small per-step
        # updates need fp32: it follows the device only.
        bias = self._buffers.get("expert_bias")
        super()._apply(fn, recurse)
        if bias is not None:
            moved = self._buffers["expert_bias"]
            if moved.dtype != torch.float32:
                self._buffers["expert_bias"] = bias.to(device=moved.device)
        return self

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> RouterOutput:
        """x [T, H] → the routing of its T tokens. ``weight``: the [E, H] tensor to compute with
        instead of the registered one (a per-call cast or an unsharded copy; moekit.fusion)."""
        weight = self.weight if weight is None else weight
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != weight.shape[1]:
            raise ValueError(
                f"x must be a [T, hidden_size = {weight.shape[1]}] tensor, got "
                f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
            )
        logits = F.linear(x, weight)
        probs, indices, counts = route(logits, self.k, self.config, self.expert_bias)
        aux = z = None
        if self.aux_loss_coeff > 0:
            s = logits.float()
            s = s.softmax(-1) if self.config.score == "softmax" else s.sigmoid()
            s = s / s.sum(-1, keepdim=True).clamp_min(1e-20)
            aux = self.aux_loss_coeff * load_balancing_loss(s, indices)
        if self.z_loss_coeff > 0:
            z = self.z_loss_coeff * router_z_loss(logits)
        return RouterOutput(probs, indices, counts, aux, z)

    def attach_losses(self, t: torch.Tensor, out: RouterOutput) -> torch.Tensor:
        """``t`` with ``out``'s aux and z losses riding along in autograd (gradient
        :attr:`aux_loss_grad_scale`), for a layer that applies them itself; ``t`` when both are
        off. Attach them to a tensor the layer consumes (:func:`moekit.ops.attach_loss`)."""
        losses = [loss for loss in (out.aux_loss, out.z_loss) if loss is not None]
        if not losses:
            return t
        return attach_loss(t, sum(losses), self._aux_loss_grad_scale)

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing: raise the bias of experts that got fewer tokens than the
        mean of ``counts [E]`` and lower it for those that got more, by ``rate`` each. With
        data or expert parallelism, pass the counts summed over the ranks that share this
        router, so that the replicated bias moves the same way on each."""
        if self.expert_bias is None:
            raise RuntimeError("update_expert_bias needs TopKRouter(..., expert_bias=True)")
        c = counts.to(self.expert_bias.device, torch.float32)
        if c.shape != self.expert_bias.shape:
            raise ValueError(f"counts must have shape ({self.num_experts},), got {tuple(c.shape)}")
        self.expert_bias += rate * torch.sign(c.mean() - c)
