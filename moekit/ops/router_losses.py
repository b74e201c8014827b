"""Router losses: the switch load-balancing loss and the router z-loss (plain PyTorch, no host
sync: the expert counts are a device scatter, never read back)."""

from __future__ import annotations

import torch

from moekit.ops.validation import FLOAT_DTYPES, INDEX_DTYPES, check_dtype, check_ndim, check_tensor

# plain PyTorch: float64 too; computed in at least fp32
LOSS_DTYPES = (*FLOAT_DTYPES, torch.float64)


def _acc(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


__all__ = ["attach_loss", "load_balancing_loss", "router_z_loss"]


def load_balancing_loss(
    scores: torch.Tensor,  # [T, E] router scores (e.g. softmax of the logits)
    indices: torch.Tensor,  # [T, k] selected experts
) -> torch.Tensor:  # scalar, fp32 (fp64 for fp64 scores)
    """Switch Transformer / Megatron load-balancing loss:
    ``E / (k·T²) · Σ_e count_e · Σ_t scores[t, e]``, where ``count_e`` is the number of tokens
    routed to expert e. It is 1.0 when tokens and scores are spread evenly; gradients flow to
    ``scores`` only."""
    scores = check_tensor("scores", scores)
    indices = check_tensor("indices", indices)
    check_ndim("scores", scores, 2, "[T, E]")
    check_ndim("indices", indices, 2, "[T, k]")
    check_dtype("scores", scores, LOSS_DTYPES)
    check_dtype("indices", indices, INDEX_DTYPES)
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
    logits = check_tensor("logits", logits)
    check_ndim("logits", logits, 2, "[T, E]")
    check_dtype("logits", logits, LOSS_DTYPES)
    if logits.shape[0] == 0:
        return _acc(logits).sum() * 0.0
    return torch.logsumexp(_acc(logits), dim=-1).square().mean()


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output, loss):
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        shape, dtype, device = ctx.loss_meta
        return grad_output, torch.ones(shape, dtype=dtype, device=device)


def attach_loss(output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``output`` unchanged, with ``loss`` riding along in autograd: a backward through the
    returned tensor also back-propagates ``loss`` (with gradient 1), so an auxiliary loss
    trains its parameters without the caller adding it to the objective (the way Megatron's
    MoE layers apply theirs). Returns ``output`` itself when ``loss`` needs no gradient."""
    if not (torch.is_grad_enabled() and loss.requires_grad):
        return output
    return _AttachLoss.apply(output, loss)
