"""Router losses: the switch load-balancing loss and the router z-loss (plain PyTorch, no host
sync: the expert counts are a device scatter, never read back)."""

from __future__ import annotations

import math

import torch

from moekit.ops.validation import FLOAT_DTYPES, INDEX_DTYPES, check_dtype, check_ndim, check_tensor

# plain PyTorch: float64 too; computed in at least fp32
LOSS_DTYPES = (*FLOAT_DTYPES, torch.float64)


def _acc(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _check_2d(
    name: str, t: object, shape_hint: str, dtypes: tuple[torch.dtype, ...]
) -> torch.Tensor:
    """t: a 2-D tensor (``shape_hint``) of one of ``dtypes``."""
    t = check_tensor(name, t)
    check_ndim(name, t, 2, shape_hint)
    check_dtype(name, t, dtypes)
    return t


__all__ = ["attach_loss", "check_grad_scale", "load_balancing_loss", "router_z_loss"]


def load_balancing_loss(
    scores: torch.Tensor,  # [T, E] router scores (e.g. softmax of the logits)
    indices: torch.Tensor,  # [T, k] selected experts
) -> torch.Tensor:  # scalar, fp32 (fp64 for fp64 scores)
    """Switch Transformer / Megatron load-balancing loss:
    ``E / (k·T²) · Σ_e count_e · Σ_t scores[t, e]``, where ``count_e`` is the number of tokens
    routed to expert e. It is 1.0 when tokens and scores are spread evenly; gradients flow to
    ``scores`` only."""
    scores = _check_2d("scores", scores, "[T, E]", LOSS_DTYPES)
    indices = _check_2d("indices", indices, "[T, k]", INDEX_DTYPES)
    T, E = scores.shape
    if indices.shape[0] != T:
        raise ValueError(
            f"indices.shape[0] must equal T = scores.shape[0] = {T}, got {indices.shape[0]}"
        )
    if indices.device != scores.device:
        raise ValueError(f"indices must be on scores' device {scores.device}, got {indices.device}")
    k = indices.shape[1]
    if T == 0 or k == 0:
        return _acc(scores).sum() * 0.0
    flat = indices.reshape(-1).long()
    acc = _acc(scores)
    counts = torch.zeros(E, dtype=acc.dtype, device=scores.device)
    counts.scatter_add_(0, flat, torch.ones(flat.shape, dtype=acc.dtype, device=scores.device))
    return (counts * acc.sum(0)).sum() * (E / (k * T * T))


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:  # scalar, fp32 (fp64 for fp64)
    """ST-MoE router z-loss: ``mean_t logsumexp(logits[t])²`` (keeps the logits small)."""
    logits = _check_2d("logits", logits, "[T, E]", LOSS_DTYPES)
    if logits.shape[0] == 0:
        return _acc(logits).sum() * 0.0
    return torch.logsumexp(_acc(logits), dim=-1).square().mean()


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output, loss, grad_scale):
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        ctx.grad_scale = grad_scale  # a tensor is read at backward time (e.g. a loss scaler's)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        shape, dtype, device = ctx.loss_meta
        scale = ctx.grad_scale
        if isinstance(scale, torch.Tensor):
            grad_loss = scale.to(device=device, dtype=dtype).expand(shape).clone()
        else:
            grad_loss = torch.full(shape, scale, dtype=dtype, device=device)
        return grad_output, grad_loss, None


def check_grad_scale(name: str, grad_scale: object) -> float | torch.Tensor:
    """``grad_scale`` as :func:`attach_loss` takes it: a finite float >= 0, or a one-element
    floating-point tensor (read when the backward runs, never on the host)."""
    if isinstance(grad_scale, torch.Tensor):
        if grad_scale.numel() != 1 or not grad_scale.is_floating_point():
            raise TypeError(
                f"{name} must be a float or a one-element floating-point tensor, got a "
                f"{grad_scale.dtype} tensor of shape {tuple(grad_scale.shape)}"
            )
        return grad_scale.reshape(())
    if isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)):
        raise TypeError(f"{name} must be a float or a tensor, got {type(grad_scale).__name__}")
    if not math.isfinite(grad_scale) or grad_scale < 0:
        raise ValueError(f"{name} must be a finite float >= 0, got {grad_scale!r}")
    return float(grad_scale)


def attach_loss(
    output: torch.Tensor, loss: torch.Tensor, grad_scale: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """``output`` unchanged (a view of it), with ``loss`` riding along in autograd: a backward
    through the returned tensor also back-propagates ``loss`` with gradient ``grad_scale``, so
    an auxiliary loss trains its parameters without the caller adding it to the objective (the
    way Megatron's MoE layers apply theirs). ``grad_scale`` is the factor the caller's own loss
    gets before its backward (1/N when accumulating N micro-batches, a loss scaler's scale), so
    that the auxiliary loss keeps its weight; a tensor is read when the backward runs. The
    returned view must not be modified in place: attach the loss to a tensor that is consumed,
    not returned. Returns ``output`` itself when ``loss`` needs no gradient."""
    if not (torch.is_grad_enabled() and loss.requires_grad):
        return output
    return _AttachLoss.apply(output, loss, check_grad_scale("grad_scale", grad_scale))
