"""Row-parallel linear layer whose output all-reduce is fused with residual add + RMSNorm.

Megatron's row-parallel layout: the full weight ``W [out, in]`` is split along ``in`` over the
tensor-parallel group; rank ``r`` holds ``W[:, r·in/W : (r+1)·in/W]`` and receives the matching
slice of the input (the output of a column-parallel layer, "input is parallel"). Each rank computes
a partial product; the sum over ranks is the layer's output. Here that sum is fused with the
residual add and the next RMSNorm (:func:`moekit.ops.allreduce_add_rmsnorm`).

Autograd: the all-reduce's backward is the identity (the incoming gradient is already replicated
on every rank), so the input gradient ``dx_local = dy · W_local`` and the weight gradient
``dW_local = dyᵀ · x_local`` are local; the norm weight's gradient is identical on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moekit.nn.rmsnorm import RMSNorm
from moekit.ops.allreduce import ALGOS, allreduce, allreduce_add, allreduce_add_rmsnorm
from moekit.ops.rmsnorm import add_rmsnorm


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_localᵀ)`` (+ residual)(→ RMSNorm), no bias.

    Args:
        in_features: full (unsharded) input width; must divide by the group size.
        out_features: output width H.
        group: tensor-parallel process group (default: world).
        norm: optional :class:`RMSNorm` over ``out_features`` fused after the all-reduce.
        algo: all-reduce algorithm (see :func:`moekit.ops.allreduce_add_rmsnorm`).

    ``forward(x_local [..., in/W], residual [..., H] | None)`` returns
      - with ``norm`` and ``residual``: ``(normed, residual_out)``;
      - with ``residual`` only: ``residual_out``;
      - otherwise the all-reduced output (normalised if ``norm`` is given).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: dist.ProcessGroup | None = None,
        norm: RMSNorm | None = None,
        algo: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                "group must be a torch.distributed.ProcessGroup or None, got "
                f"{type(group).__name__}"
            )
        if not isinstance(algo, str) or algo not in ALGOS:
            raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        if in_features % world:
            raise ValueError(
                f"in_features = {in_features} must be divisible by the group size {world}"
            )
        if norm is not None and norm.hidden_size != out_features:
            raise ValueError(
                f"norm.hidden_size must equal out_features = {out_features}, got {norm.hidden_size}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.in_per_rank = in_features // world
        self.group = group
        self.rank = rank
        self.world_size = world
        self.algo = algo
        self.norm = norm
        self.weight = nn.Parameter(
            torch.empty(out_features, self.in_per_rank, device=device, dtype=dtype)
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation of the full [out, in] weight, then this rank's columns:
        the bound follows the full fan-in (not the shard's), and ranks seeded alike hold
        different slices of one matrix rather than copies of one shard."""
        w = self.weight
        full = torch.empty(self.out_features, self.in_features, device=w.device, dtype=w.dtype)
        nn.init.kaiming_uniform_(full, a=5**0.5)
        lo = self.rank * self.in_per_rank
        mine = full[:, lo : lo + self.in_per_rank]
        if hasattr(w, "device_mesh") and hasattr(w, "placements"):  # sharded (FSDP2 DTensor)
            from torch.distributed.tensor import distribute_tensor

            mine = distribute_tensor(mine, w.device_mesh, w.placements)
        with torch.no_grad():
            w.copy_(mine)

    def _local(self) -> bool:
        """True when the layer runs on one process without torch.distributed (built and called
        without an initialised process group): the all-reduce is then the identity."""
        if dist.is_initialized():
            if self.world_size != dist.get_world_size(self.group):
                raise ValueError(
                    f"RowParallelLinear was built for a group of {self.world_size} rank(s), "
                    f"the group now has {dist.get_world_size(self.group)}: build it after "
                    "init_process_group"
                )
            return False
        return True

    @torch.no_grad()
    def load_full_weight(self, full: torch.Tensor) -> None:
        """Copy this rank's column slice of the unsharded weight ``full [out, in]``."""
        if full.shape != (self.out_features, self.in_features):
            raise ValueError(
                f"full must have shape {(self.out_features, self.in_features)}, "
                f"got {tuple(full.shape)}"
            )
        lo = self.rank * self.in_per_rank
        self.weight.copy_(full[:, lo : lo + self.in_per_rank])

    def forward(
        self,
        x: torch.Tensor,  # [..., in/W] this rank's input slice
        residual: torch.Tensor | None = None,  # [..., H]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.shape[-1] != self.in_per_rank:
            raise ValueError(
                f"x.shape[-1] must equal in_features / world = {self.in_per_rank}, "
                f"got {x.shape[-1]}"
            )
        partial = F.linear(x, self.weight)  # [..., H]
        if self._local():
            if self.norm is not None:
                if residual is None:
                    return self.norm(partial)
                return add_rmsnorm(partial, residual, self.norm.weight, eps=self.norm.eps)
            return partial if residual is None else partial + residual
        if self.norm is not None:
            if residual is None:
                summed = allreduce(partial, group=self.group, algo=self.algo)
                return self.norm(summed)
            return allreduce_add_rmsnorm(
                partial,
                residual,
                self.norm.weight,
                eps=self.norm.eps,
                group=self.group,
                algo=self.algo,
            )
        if residual is not None:
            return allreduce_add(partial, residual, group=self.group, algo=self.algo)
        return allreduce(partial, group=self.group, algo=self.algo)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (÷{self.world_size}), "
            f"out_features={self.out_features}, "
            f"algo={self.algo!r}"
        )
