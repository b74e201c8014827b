"""Expert parallelism for ``MoELayer``: rank r of the W ranks of ``ep_group`` holds experts
``[r·E/W, (r+1)·E/W)``; every rank routes its own tokens, each token travels once to every rank
that holds one of its experts (``moekit.ops.expert_exchange``), the owner runs its experts over
the slots that are its own, sums them per token and sends one row per token back, where the
rows from its owners are summed.

Dropless and capacity-limited calls take the same path: a capacity limit drops the slots past
``C = ceil(cf·T·k/E)`` per expert on each source rank before anything moves, so only kept
slots cross the wire and the owner computes no padding. With the symmetric exchange nothing is
read back to the host and a step can be captured in a CUDA graph.

Overlap: a call may split its tokens into chunks, each exchanged on its own (its own symmetric
buffer). The exchanges run on a side stream, the experts on the caller's, so chunk i+1's
dispatch runs while chunk i's experts compute and chunk i's combine while chunk i+1's do. The
backward follows the same streams (autograd runs each op's backward on its forward's stream),
so the gradients' exchanges overlap the experts' backward GEMMs the same way. Each token's
result is the same as unchunked; the weight gradients are summed over the chunks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.distributed as dist

from moekit.ops.expert_exchange import BACKENDS, ExpertExchange, symmetric_unsupported
from moekit.ops.permute import DispatchConfig, permute, unpermute
from moekit.ops.quantize import Fp8Recipe, Fp8Tensor, quantize_fp8
from moekit.ops.routing import capacity_drop, expert_capacity, max_rows

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
    chunks: how many pieces a call's tokens are exchanged in, so that the exchange of one
        overlaps the experts of another (see the module docstring). Each chunk runs the
        experts' GEMMs over all their weights again and gives a weight gradient of its own,
        so a chunk costs about three reads and a read-modify-write of the local experts'
        weights: it pays only where the exchange it hides takes longer. None: one chunk (no
        overlap; on 2 × H200 two chunks were slower at both benchmark shapes, see
        docs/moe_layer.md). The bounds above (max_tokens, rows_factor) hold per chunk of
        ``ceil(max_tokens / chunks)`` tokens.
    """

    backend: Literal["auto", "symmetric", "all_to_all"] = "auto"
    max_tokens: int | None = None
    rows_factor: float | None = None
    chunks: int | None = None

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
        if self.chunks is not None and (
            isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1
        ):
            raise ValueError(f"chunks must be a positive int or None, got {self.chunks!r}")


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
        self.last_exchanges: list[ExpertExchange] = []
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}

    def _agreed_max_tokens(self, T: int, device: torch.device) -> int:
        """max_tokens: the config's, or the first call's largest T over the ranks (once)."""
        if self.max_tokens is None:
            t = torch.tensor([T], device=device, dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            self.max_tokens = int(t)  # the one host read, at set-up
        return self.max_tokens

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device)
        return self._side_streams[device]

    def _rows_bound(self, received: int, k: int, align: int, capacity: int | None,
                    max_tokens: int, fp8: bool) -> int:  # fmt: skip
        """Static bound of the expert rows on this rank (see ExpertParallelConfig); for FP8
        experts whole 128-row blocks."""
        El, W = self.experts_local, self.group.size()
        rows = max_rows(received, min(k, El), El, align)
        if capacity is not None:  # at most C per expert from each source, plus padding
            rows = min(rows, El * W * capacity + El * (align - 1))
        if self.config.rows_factor is not None:
            share = math.ceil(self.config.rows_factor * max_tokens * k)
            rows = min(rows, share + El * (align - 1))
        return -(-rows // 128) * 128 if fp8 else rows

    def _local_experts(
        self, received: tuple, *, experts: Callable, bound_args: tuple, align: int | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:  # fmt: skip
        """This rank's experts over the received tokens: one summed row per token."""
        rows, row_probs, ids = received
        fp8 = isinstance(rows, Fp8Tensor)
        bound = self._rows_bound(rows.shape[0], ids.shape[1], align or 1, *bound_args, fp8)
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
        y = experts(d.hidden, d.offsets, d.probs.to(dtype), zero_tail=False)
        return unpermute(y, d, weighted=False, zero_tail=False)

    def __call__(
        self,
        tokens: torch.Tensor,  # [T, H]
        indices: torch.Tensor,  # [T, k] global expert ids
        probs: torch.Tensor,  # [T, k]
        experts: Callable[..., torch.Tensor],  # (rows [R, H], offsets [E_local], probs [R])
        dispatch: DispatchConfig,
        *,
        shape: Sequence[int] | None = None,
        fp8: Fp8Recipe | None = None,  # the tokens travel quantized (ExpertExchange.dispatch_fp8)
    ) -> torch.Tensor:  # [T, H] (or ``shape``)
        T, k = indices.shape
        align, capacity_factor = dispatch.align, dispatch.capacity_factor
        a = align or 1
        backend = self.config.backend
        if backend == "auto" and symmetric_unsupported(tokens, self.group.size()):
            backend = "all_to_all"  # decided alike on every rank: no bound to agree on
        max_tokens = T if backend == "all_to_all" else self._agreed_max_tokens(T, tokens.device)
        capacity = None  # the most rows any source keeps per expert, where known statically
        if capacity_factor is not None:
            E = self.num_experts
            kept = expert_capacity(capacity_factor, T, k, E, a)
            indices = capacity_drop(indices, probs.detach(), E, kept)
            if backend != "all_to_all":  # max_tokens bounds every rank's T, hence its capacity
                capacity = expert_capacity(capacity_factor, max_tokens, k, E, a)
        chunks = self.config.chunks or 1
        chunk_max = -(-max_tokens // chunks)  # every rank's chunks are at most this long
        step = -(-T // chunks)
        spans = [(min(i * step, T), min((i + 1) * step, T)) for i in range(chunks)]
        local = functools.partial(
            self._local_experts, experts=experts, bound_args=(capacity, chunk_max), align=align,
            dtype=tokens.dtype,
        )  # fmt: skip
        outs = self._exchange_chunks(
            tokens, indices, probs, local, spans, (chunk_max, backend, fp8)
        )
        out = outs[0] if chunks == 1 else torch.cat(outs)
        return out if shape is None or tuple(shape) == tuple(out.shape) else out.view(shape)

    def _exchange_chunks(self, tokens, indices, probs, local, spans, how) -> list:
        """Dispatch every chunk, run ``local`` on each as it arrives, combine each: exchanges on
        the side stream (when there are several chunks on a GPU), experts on the caller's.
        ``how``: (the chunks' token bound, the backend, the FP8 recipe or None)."""
        chunk_max, backend, fp8 = how
        side = self._side_stream(tokens.device) if len(spans) > 1 and tokens.is_cuda else None
        main = torch.cuda.current_stream(tokens.device) if side is not None else None

        def on_side():
            return contextlib.nullcontext() if side is None else torch.cuda.stream(side)

        def hand_over(tensors, consumer, producer):  # producer's results to consumer's stream
            if side is not None:
                consumer.wait_stream(producer)
                for t in tensors:
                    t.record_stream(consumer)

        hand_over((tokens, indices, probs), side, main)
        self.last_exchanges, received = [], []
        for i, (lo, hi) in enumerate(spans):  # every dispatch first: they wait on nothing
            with on_side():
                ex = ExpertExchange(
                    indices[lo:hi], self.num_experts, self.group, chunk_max, backend, channel=i
                )
                if fp8 is None:
                    received.append(ex.dispatch(tokens[lo:hi], probs[lo:hi]))
                else:  # each token quantized once, on its source rank
                    xq = quantize_fp8(tokens[lo:hi], block=fp8.row_block,
                                      pow2_scale=fp8.pow2_scale)  # fmt: skip
                    received.append(ex.dispatch_fp8(xq, probs[lo:hi]))
                done = None if side is None else side.record_event()
            self.last_exchanges.append(ex)
            received[-1] = (received[-1], done)
        outs = []
        for ex, (got, done) in zip(self.last_exchanges, received):
            if side is not None:  # this chunk's tokens only, not the later dispatches
                main.wait_event(done)
                for t in got:
                    (t.data if isinstance(t, Fp8Tensor) else t).record_stream(main)
            part = local(got)
            hand_over((part,), side, main)
            with on_side():
                outs.append(ex.combine(part))
        hand_over(outs, main, side)
        return outs
