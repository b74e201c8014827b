"""Pure-PyTorch twins of :mod:`moekit.kernels.allreduce`: the test oracle and the CPU path.

The symmetric-memory kernels sum the ranks' contributions in fp32 **in rank order 0…W−1** and
round once, so every rank produces the same bits. :func:`allreduce_sum_ref` does exactly that on a
list of shards; :func:`gather_allreduce_ref` does it across a process group through
``all_gather`` (any backend, gloo included), which makes it the reference path of the ops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from moekit.reference.rmsnorm import add_rmsnorm_ref


def allreduce_sum_ref(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ_r shards[r] in fp32, in list (rank) order, rounded once to the shards' dtype.

    shards: W tensors of identical shape [..., H] and dtype.
    """
    acc = shards[0].float()
    for s in shards[1:]:
        acc = acc + s.float()
    return acc.to(shards[0].dtype)


def allreduce_add_rmsnorm_shards_ref(
    shards: Sequence[torch.Tensor],  # W × [..., H]
    residual: torch.Tensor | None,  # [..., H]
    weight: torch.Tensor | None,  # [H] or None (no norm)
    eps: float = 1e-6,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``residual_out = round(Σ_r shards[r] + residual)`` with one rounding (fp32 sum in rank
    order, then the residual in fp32), ``normed = RMSNorm(residual_out) · weight``.

    Returns ``(normed or None, residual_out)``.
    """
    acc = shards[0].float()
    for s in shards[1:]:
        acc = acc + s.float()
    if residual is not None:
        acc = acc + residual.float()
    ro = acc.to(shards[0].dtype)
    if weight is None:
        return None, ro
    normed, _, _ = add_rmsnorm_ref(ro, None, weight, eps)
    return normed, ro


def gather_shards(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """All ranks' ``x`` in rank order (``all_gather``; works with gloo and NCCL)."""
    world = dist.get_world_size(group)
    shards = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(shards, x.contiguous(), group=group)
    return shards


def gather_allreduce_ref(
    x: torch.Tensor,  # [..., H]
    residual: torch.Tensor | None,  # [..., H]
    weight: torch.Tensor | None,  # [H]
    eps: float = 1e-6,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Distributed reference: gather every rank's ``x`` and reduce in rank order (bit-identical on
    every rank). Returns ``(normed or None, residual_out)``; without a residual and a weight,
    ``residual_out`` is the plain all-reduce."""
    return allreduce_add_rmsnorm_shards_ref(gather_shards(x, group), residual, weight, eps)
