"""Expert parallelism for ``MoELayer``: rank r of the W ranks of ``ep_group`` holds experts
``[r·E/W, (r+1)·E/W)``; every rank routes its own tokens, each token travels once to every rank
that holds one of its experts (``moekit.ops.expert_exchange``), the owner runs its experts over
the slots that are its own, sums them per token and sends one row per token back, where the
rows from its owners are summed.

Dropless and capacity-limited calls take the same path: a capacity limit drops the slots past
``C = ceil(cf·T·k/E)`` per expert on each source rank before anything moves, so only kept
slots cross the wire and the owner computes no padding. With the symmetric exchange nothing is
read back to the host and a step can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.distributed as dist

from moekit.ops.expert_exchange import BACKENDS, ExpertExchange, symmetric_unsupported
from moekit.ops.permute import permute, unpermute
from moekit.ops.routing import capacity_drop, max_rows

__all__ = ["ExpertParallelConfig", "ExpertParallelRouting"]


@dataclasses.dataclass(frozen=True)
class ExpertParallelConfig:
    """How ``MoELayer(ep_group=...)`` exchanges its tokens.

    backend: ``"symmetric"`` (Triton kernels over peer-to-peer symmetric memory: no host sync,
        CUDA-graph capturable; GPUs of one host, at most 8 ranks), ``"all_to_all"``
        (``torch.distributed.all_to_all_single``: NCCL or gloo, one host sync per call) or
        ``"auto"``: symmetric where it can run, else all-to-all.
    max_tokens: the most tokens any rank passes in one call (the same on every rank): the
        symmetric exchange's static bound, which sizes its buffers (about
        ``(W + 1)·max_tokens·H`` elements per rank) and the received rows. None: the largest
        token count of the first call over the ranks (one all-reduce read back, once); a later
        call with more tokens raises ValueError, so set it when token counts vary.
    rows_factor: bound the expert rows an owner runs over (its activations' memory) at
        ``rows_factor·max_tokens·k``, i.e. this many times an even share. None: the worst
        case ``W·max_tokens·min(k, E/W)``, which can never be exceeded (dropless) but allocates
        W times an even share. A call that routes more rows to one rank than the bound fails
        with a device-side assert (never a silent drop).
    """

    backend: Literal["auto", "symmetric", "all_to_all"] = "auto"
    max_tokens: int | None = None
    rows_factor: float | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be a positive int or None, got {self.max_tokens!r}")
        if self.rows_factor is not None and not (
            isinstance(self.rows_factor, (int, float)) and 0 < self.rows_factor < math.inf
        ):
            raise ValueError(f"rows_factor must be a finite float > 0, got {self.rows_factor!r}")


class ExpertParallelRouting:
    """The expert-parallel part of one ``MoELayer``: exchange, local experts, exchange back."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int, config: ExpertParallelConfig):
        W = group.size()
        if num_experts % W:
            raise ValueError(
                f"num_experts = {num_experts} must be divisible by the ep_group size {W}"
            )
        self.group, self.num_experts, self.config = group, num_experts, config
        self.experts_local = num_experts // W
        self.max_tokens = config.max_tokens
        self.last_exchange: ExpertExchange | None = None

    def _agreed_max_tokens(self, T: int, device: torch.device) -> int:
        """max_tokens: the config's, or the first call's largest T over the ranks (once)."""
        if self.max_tokens is None:
            t = torch.tensor([T], device=device, dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            self.max_tokens = int(t)  # the one host read, at set-up
        return self.max_tokens

    def _rows_bound(self, received: int, k: int, align: int, capacity: int | None) -> int:
        """Static bound of the expert rows on this rank (see ExpertParallelConfig)."""
        El, W = self.experts_local, self.group.size()
        rows = max_rows(received, min(k, El), El, align)
        if capacity is not None:  # at most C per expert from each source, plus padding
            rows = min(rows, El * W * capacity + El * (align - 1))
        if self.config.rows_factor is not None:
            share = math.ceil(self.config.rows_factor * self.max_tokens * k)
            rows = min(rows, share + El * (align - 1))
        return rows

    def __call__(
        self,
        tokens: torch.Tensor,  # [T, H]
        indices: torch.Tensor,  # [T, k] global expert ids
        probs: torch.Tensor,  # [T, k]
        experts: Callable[..., torch.Tensor],  # (rows [R, H], offsets [E_local], probs [R])
        *,
        align: int | None = None,
        capacity_factor: float | None = None,
        shape: Sequence[int] | None = None,
    ) -> torch.Tensor:  # [T, H] (or ``shape``)
        T, k = indices.shape
        a = align or 1
        backend = self.config.backend
        if backend == "auto" and symmetric_unsupported(tokens, self.group.size()):
            backend = "all_to_all"  # decided alike on every rank: no bound to agree on
        max_tokens = T if backend == "all_to_all" else self._agreed_max_tokens(T, tokens.device)
        capacity = None  # the most rows any source keeps per expert, where known statically
        if capacity_factor is not None:

            def rows_per_expert(tokens: int) -> int:  # ceil(cf·T·k/E), up to a multiple of align
                return -(-math.ceil(capacity_factor * tokens * k / self.num_experts) // a) * a

            indices = capacity_drop(indices, probs.detach(), self.num_experts, rows_per_expert(T))
            if backend != "all_to_all":  # max_tokens bounds every rank's T, hence its capacity
                capacity = rows_per_expert(max_tokens)
        ex = ExpertExchange(indices, self.num_experts, self.group, max_tokens, backend)
        self.last_exchange = ex
        rows, row_probs, ids = ex.dispatch(tokens, probs)
        bound = self._rows_bound(rows.shape[0], k, a, capacity)
        d = permute(
            rows, ids, row_probs, num_experts=self.experts_local, align=align, out_rows=bound,
            zero_tail=False,
        )  # fmt: skip
        if self.config.rows_factor is not None:
            torch._assert_async(
                d.tokens_per_expert.sum() == (ids >= 0).sum(),
                "MoELayer: more expert rows reached this rank than ExpertParallelConfig."
                "rows_factor allows",
            )
        y = experts(d.hidden, d.offsets, d.probs.to(tokens.dtype), zero_tail=False)
        part = unpermute(y, d, weighted=False, zero_tail=False)  # one row per received token
        out = ex.combine(part)
        return out if shape is None or tuple(shape) == tuple(out.shape) else out.view(shape)
