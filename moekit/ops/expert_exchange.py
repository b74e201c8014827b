"""Expert-parallel token exchange: each token goes once to every rank that holds one of its
experts (dispatch), and the owners' results come back summed (combine); both differentiable.

Dimension letters: T tokens on this rank, k experts per token, E experts, W ranks, E_local =
E / W experts per rank (rank r holds ``[r·E_local, (r+1)·E_local)``), H hidden.

Two backends with the same results (:mod:`moekit.reference.exchange` is their oracle):

* ``"symmetric"``: Triton kernels that read peers' memory over NVLink from a symmetric pool
  (:mod:`moekit.kernels.exchange`). Every size stays on the device: no host sync, CUDA-graph
  capturable. The received tokens fill a static bound of ``W·max_tokens`` rows; rows past the
  real count are left unwritten (their ids are −1, so they route nowhere).
* ``"all_to_all"``: ``torch.distributed.all_to_all_single`` (NCCL, gloo), which takes its split
  sizes on the host: one host sync per call. The received tensors have exactly the real rows.
  It runs where the symmetric one cannot: CPU tensors, no symmetric memory, ranks on several
  hosts, more than 8 ranks.

A token travels once per destination rank, not once per slot: with k = 8 experts over 4 ranks a
token reaches about 3.6 ranks, so the bytes on the wire fall by more than half against
exchanging the k permuted rows.

FP8 (:meth:`ExpertExchange.dispatch_fp8`): tokens quantized along H travel as their e4m3 bytes
and fp32 scales packed into one row of bytes (H + 4·⌈H/128⌉, padded to 16 bytes: about half a
bf16 row), in the same regions and kernels; their gradient comes back in bf16 as dispatch's
does, and the combine stays in the rows' dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.distributed as dist

from moekit.distributed.symmetric_pool import get_pool
from moekit.kernels import exchange as kernels
from moekit.ops.quantize import Fp8Tensor, stand_in
from moekit.ops.routing import routing_metadata
from moekit.ops.validation import FLOAT_DTYPES, check_dtype, check_ndim, check_tensor
from moekit.runtime.device import num_sms, use_triton
from moekit.tuning.exchange import pull_config

__all__ = [
    "BACKENDS",
    "ExchangeRoutes",
    "ExpertExchange",
    "exchange_routes",
    "pool_use",
    "symmetric_unsupported",
]

BACKENDS = ("auto", "symmetric", "all_to_all")
POOL_USE = "expert_exchange"  # the symmetric pool's name (apart from the all-reduce's)


def pool_use(channel: int) -> str:
    """The name of the symmetric pool of exchange ``channel``: exchanges in flight at the same
    time (the chunks of one layer call) each have their own buffer and barrier epochs."""
    return POOL_USE if channel == 0 else f"{POOL_USE}/{channel}"


@dataclasses.dataclass(frozen=True)
class ExchangeRoutes:
    """Where this rank's tokens go. Example: W = 2, E_local = 2, T = 3, k = 2,
    ``indices = [[0, 3], [1, 0], [2, -1]]``: token 0 goes to ranks 0 and 1, token 1 to rank 0,
    token 2 to rank 1, so ``sends = [2, 2]``, ``lists = [0, 1, 0, 2, ·…]`` (ranks 0's tokens,
    then rank 1's) and ``rank_index = [[0, 2], [1, -1], [-1, 3]]``."""

    rank_index: torch.Tensor  # [T, W] int32: token t's place in `lists` for rank d; −1 = not sent
    lists: torch.Tensor  # [T·W + 1] int32: token ids by destination rank (Σ sends of them used)
    sends: torch.Tensor  # [W] int32: tokens sent to each rank


def exchange_routes(
    indices: torch.Tensor,  # [T, k] global expert ids; < 0 = dropped slot
    experts_local: int,
    world: int,
) -> ExchangeRoutes:
    """The routes of ``indices`` (no host sync: a counting sort of the (token, rank) pairs)."""
    T = indices.shape[0]
    dev = indices.device
    dest = torch.where(indices >= 0, indices.long() // experts_local, world)
    hit = torch.zeros(T, world + 1, dtype=torch.bool, device=dev).scatter_(1, dest, True)
    ranks = torch.arange(world, device=dev, dtype=torch.int32)
    by_rank = torch.where(hit[:, :world], ranks, -1)  # [T, W]: d where token t goes to d
    rank_index, sends, _, _ = routing_metadata(by_rank, world, 1)
    place = torch.where(rank_index >= 0, rank_index, T * world).flatten().long()
    tokens = torch.arange(T, device=dev, dtype=torch.int32).repeat_interleave(world)
    lists = torch.zeros(T * world + 1, dtype=torch.int32, device=dev).scatter_(0, place, tokens)
    return ExchangeRoutes(rank_index, lists, sends)


def symmetric_unsupported(x: torch.Tensor, world: int) -> str:
    """Why the symmetric backend cannot exchange tokens like ``x`` among ``world`` ranks, from
    facts every rank shares (device kind, sizes); "" when nothing rules it out (the pool may
    still be unavailable: see :class:`ExpertExchange`)."""
    if not use_triton(x):
        return "x is not on a device the Triton kernels run on"
    if world > kernels.MAX_WORLD:
        return f"more than {kernels.MAX_WORLD} ranks"
    if x.dim() != 2 or (x.shape[1] * x.element_size()) % 16:
        return f"rows of x do not span a multiple of 16 bytes ({tuple(x.shape)}, {x.dtype})"
    return ""


def _check(x: object, indices: object, probs: object) -> tuple:
    x = check_tensor("x", x)
    check_ndim("x", x, 2, "[T, H]")
    check_dtype("x", x, FLOAT_DTYPES)
    indices = check_tensor("indices", indices)
    check_ndim("indices", indices, 2, "[T, k]")
    if indices.dtype.is_floating_point or indices.shape[0] != x.shape[0]:
        raise ValueError(
            f"indices must be an integer [T = {x.shape[0]}, k] tensor, got {indices.dtype} "
            f"{tuple(indices.shape)}"
        )
    probs = check_tensor("probs", probs)
    check_dtype("probs", probs, FLOAT_DTYPES)
    if probs.shape != indices.shape:
        raise ValueError(f"probs must have indices' shape {tuple(indices.shape)}, got "
                         f"{tuple(probs.shape)}")  # fmt: skip
    for name, t in (("indices", indices), ("probs", probs)):
        if t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
    return x if x.stride(-1) == 1 else x.contiguous(), indices, probs


class ExpertExchange:
    """One layer call's exchange of the tokens of ``x`` among the ranks of ``group``.

    Args:
        indices: [T, k] global expert ids of each token's slots (< 0: a dropped slot).
        num_experts: E, a multiple of W.
        group: the expert-parallel process group (W ranks).
        max_tokens: the most tokens any rank passes (every rank passes the same value): the
            symmetric backend's static bound; the all-to-all backend does not use it.
        backend: ``"symmetric"``, ``"all_to_all"`` or ``"auto"`` (symmetric where it can run).
        channel: which symmetric pool the exchange uses (:func:`pool_use`); exchanges that may
            be in flight at once need different channels, every rank using the same one for
            the same exchange.

    :meth:`dispatch` then :meth:`combine`, once each, in that order, on every rank of the group.
    """

    def __init__(
        self,
        indices: torch.Tensor,
        num_experts: int,
        group: dist.ProcessGroup,
        max_tokens: int,
        backend: Literal["auto", "symmetric", "all_to_all"] = "auto",
        channel: int = 0,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        W = group.size()
        if num_experts % W:
            raise ValueError(f"num_experts = {num_experts} must be divisible by the group size {W}")
        self.group, self.W, self.rank = group, W, group.rank()
        self.E_local = num_experts // W
        self.indices = indices
        self.num_tokens = indices.shape[0]
        self.max_tokens = max_tokens
        if self.num_tokens > self.max_tokens:
            raise ValueError(
                f"this rank passes {self.num_tokens} tokens, more than max_tokens = "
                f"{max_tokens} (the exchange's static bound): raise it"
            )
        self.routes = exchange_routes(indices, self.E_local, W)
        self.backend, self.channel = backend, channel
        self._pool = self._layout = None
        self.table: torch.Tensor | None = None  # [W, W] cnt[source, destination] (symmetric)
        self._splits: tuple[list[int], list[int]] | None = None  # (send, recv) (all_to_all)

    # -- backend choice ------------------------------------------------------------------------

    def _symmetric_reason(self, x: torch.Tensor) -> str:
        """Why the symmetric backend cannot run this call ("" when it can); the same on every
        rank (collective: may create the pool)."""
        reason = symmetric_unsupported(x, self.W)
        if reason:
            return reason
        k = self.indices.shape[1]
        layout = kernels.exchange_layout(self.W, self.max_tokens, x.shape[1], x.element_size(), k)
        pool = get_pool(self.group, use=pool_use(self.channel), min_bytes=layout.nbytes)
        if not pool.available:
            return pool.reason
        if pool.device.type != x.device.type or pool.nbytes < layout.nbytes:
            return f"the pool on {pool.device} ({pool.nbytes} bytes) does not serve this call"
        self._pool, self._layout = pool, layout
        return ""

    def _choose(self, x: torch.Tensor) -> None:
        if self.backend == "all_to_all":
            return
        reason = self._symmetric_reason(x)
        if not reason:
            self.backend = "symmetric"
        elif self.backend == "symmetric":
            raise ValueError(f"the symmetric exchange cannot run this call: {reason}")
        else:
            self.backend = "all_to_all"

    # -- the two passes ------------------------------------------------------------------------

    @property
    def bound(self) -> int:
        """Rows of the received tensors (symmetric: W·max_tokens; all-to-all: the exact count,
        known after :meth:`dispatch`)."""
        if self.backend == "symmetric":
            return self.W * self.max_tokens
        return sum(self._splits[1]) if self._splits is not None else 0

    def dispatch(
        self,
        x: torch.Tensor,  # [T, H]
        probs: torch.Tensor,  # [T, k]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tokens this rank's experts need: ``(rows [N, H], probs [N, k] fp32, ids [N, k]
        int32)``, sources in rank order, each source's tokens in ascending order; ids are local
        (``id − rank·E_local``), −1 (prob 0) for slots of other ranks' experts and for rows past
        the real count. Differentiable in x and probs."""
        x, _, probs = _check(x, self.indices, probs)
        self._choose(x)
        if self.backend == "symmetric":
            return _SymmetricDispatch.apply(x, probs, self)
        return self._all_to_all_dispatch(x, probs)

    def dispatch_fp8(
        self,
        xq: Fp8Tensor,  # [T, H] quantized along H (quantize_fp8(x))
        probs: torch.Tensor,  # [T, k]
    ) -> tuple[Fp8Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`dispatch` for quantized tokens: ``(rows [N, H] as an Fp8Tensor, probs, ids)``,
        the rows' e4m3 bytes and scales moved as they are (no second rounding); the gradient
        of the received rows (through their anchor) goes back to the tokens (through xq's)."""
        if not isinstance(xq, Fp8Tensor) or xq.axis != "row" or xq.transposed or xq.data.dim() != 2:
            raise ValueError("xq must be a [T, H] Fp8Tensor quantized along H (quantize_fp8(x))")
        anchor = xq.anchor_or_stand_in()
        _, _, probs = _check(anchor, self.indices, probs)
        self._choose(anchor)  # the regions sized for rows of x's dtype: room for the packed
        packed = _pack(xq)
        if self.backend == "symmetric":
            rows, p, ids, got = _Fp8SymmetricDispatch.apply(anchor, probs, packed, self)
        else:
            rows, p, ids, got = self._all_to_all_dispatch_fp8(anchor, probs, packed)
        data, scale = _unpack(got, xq.shape[1], xq.scale.shape[1])
        return Fp8Tensor(data, scale, "row", xq.block, anchor=rows), p, ids

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """``y [N, H]``: a row per received token (as :meth:`dispatch` gave them) → ``[T, H]``,
        each token's rows from its owners summed (fp32, rank order; zeros for a token sent
        nowhere). Differentiable in y."""
        y = check_tensor("y", y)
        check_ndim("y", y, 2, "[N, H]")
        if y.shape[0] != self.bound:
            raise ValueError(f"y must have the {self.bound} rows dispatch gave, got {y.shape[0]}")
        y = y if y.stride(-1) == 1 else y.contiguous()
        if self.backend == "symmetric":
            return _SymmetricCombine.apply(y, self)
        return self._all_to_all_combine(y)

    # -- symmetric backend -----------------------------------------------------------------------

    def _region(self, offset: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        n = rows * cols * dtype.itemsize
        return self._pool.buffer[offset : offset + n].view(dtype).view(rows, cols)

    def _barrier(self, with_counts: bool = False) -> None:
        pool = self._pool
        if with_counts:
            self.table = torch.empty(self.W, self.W, dtype=torch.int32, device=pool.buffer.device)
            kernels.exchange_barrier(
                pool.peer_bases, pool.epochs, self.rank, self.routes.sends, self.table
            )
        else:
            kernels.exchange_barrier(pool.peer_bases, pool.epochs, self.rank)

    def _stage_lists(self) -> None:
        lay, n = self._layout, self.num_tokens * self.W
        self._region(lay.lists, 1, n, torch.int32)[0].copy_(self.routes.lists[:n])

    def _pull_tokens(self, x_dtype, H: int, meta: bool, like: torch.Tensor) -> tuple:
        """Barrier-wrapped read of what the peers staged in their x (and x_meta) regions."""
        bound, k = self.bound, self.indices.shape[1]
        out = like.new_empty(bound, H, dtype=x_dtype)
        ids = like.new_empty(bound, k, dtype=torch.int32) if meta else None
        probs = like.new_empty(bound, k, dtype=torch.float32) if meta else None
        pool = self._pool
        kernels.pull_tokens(
            pool.peer_bases, self.table, self._layout, self.rank, out, ids, probs, self.E_local,
            num_sms(like), pull_config("tokens", H, out.element_size()),
        )  # fmt: skip
        self._barrier()
        return out, ids, probs

    def _pull_sum(self, rows: torch.Tensor, meta: torch.Tensor | None) -> tuple:
        """Stage ``rows`` (and ``meta``) in the y regions, then read back every token's sum."""
        lay, pool, bound = self._layout, self._pool, self.bound
        H, sms, e = rows.shape[1], num_sms(rows), rows.element_size()
        copy = pull_config("copy", H, e)
        kernels.copy_rows(rows, self._region(lay.y, bound, H, rows.dtype), self.table, self.rank,
                          sms, copy)  # fmt: skip
        if meta is not None:
            dst = self._region(lay.y_meta, bound, meta.shape[1], torch.float32)
            kernels.copy_rows(meta.float(), dst, self.table, self.rank, sms, copy)
        self._barrier()
        T = self.num_tokens
        out = rows.new_empty(T, H)
        meta_out = None if meta is None else rows.new_empty(T, meta.shape[1], dtype=torch.float32)
        kernels.pull_sum(
            pool.peer_bases, self.table, lay, self.rank, self.routes.rank_index, out, meta_out,
            sms, pull_config("sum", H, e),
        )  # fmt: skip
        self._barrier()
        return out, meta_out

    def _stage_tokens(self, x: torch.Tensor, probs: torch.Tensor | None) -> None:
        """x (and its slots' global ids and probs) and the lists into this rank's regions."""
        lay, T, k = self._layout, self.num_tokens, self.indices.shape[1]
        self._region(lay.x, T, x.shape[1], x.dtype).copy_(x)
        if probs is not None:
            meta = self._region(lay.x_meta, T, 2 * k, torch.int32)
            meta[:, :k].copy_(self.indices)
            meta[:, k:].copy_(probs.detach().float().view(torch.int32))
        self._stage_lists()

    # -- all-to-all backend ----------------------------------------------------------------------

    def _host_splits(self) -> tuple[list[int], list[int]]:
        if self._splits is None:
            send = self.routes.sends.to(torch.int64)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.group)
            both = torch.stack([send, recv]).tolist()  # the one host sync of this backend
            self._splits = (both[0], both[1])
        return self._splits

    def _all_to_all_dispatch(self, x: torch.Tensor, probs: torch.Tensor) -> tuple:
        send, recv = self._host_splits()
        tok = self.routes.lists[: sum(send)].long()
        args = (recv, send, self.group)
        rows = _AllToAll.apply(x.index_select(0, tok), *args)
        p = _AllToAll.apply(probs.index_select(0, tok).float(), *args)
        ids = _AllToAll.apply(self.indices.index_select(0, tok).to(torch.int64), *args)
        lo = self.rank * self.E_local
        local = (ids >= lo) & (ids < lo + self.E_local)
        ids = torch.where(local, ids - lo, -1).to(torch.int32)
        return rows, torch.where(local, p, 0.0), ids

    def _all_to_all_dispatch_fp8(self, anchor, probs, packed) -> tuple:
        send, recv = self._host_splits()
        tok = self.routes.lists[: sum(send)].long()
        got = packed.new_empty(sum(recv), packed.shape[1])
        dist.all_to_all_single(got, packed.index_select(0, tok), recv, send, group=self.group)
        rows = _AllToAllAnchor.apply(anchor, tok, recv, send, self.group)
        p = _AllToAll.apply(probs.index_select(0, tok).float(), recv, send, self.group)
        ids = _AllToAll.apply(self.indices.index_select(0, tok).to(torch.int64), recv, send,
                              self.group)  # fmt: skip
        lo = self.rank * self.E_local
        local = (ids >= lo) & (ids < lo + self.E_local)
        ids = torch.where(local, ids - lo, -1).to(torch.int32)
        return rows, torch.where(local, p, 0.0), ids, got

    def _all_to_all_combine(self, y: torch.Tensor) -> torch.Tensor:
        send, recv = self._host_splits()
        back = _AllToAll.apply(y, send, recv, self.group)
        tok = self.routes.lists[: sum(send)].long()
        out = y.new_zeros(self.num_tokens, y.shape[1], dtype=torch.float32)
        return out.index_add(0, tok, back.float()).to(y.dtype)


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` to every rank by ``in_splits``; the rows from every rank, ``out_splits``
    of them, in rank order. Backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _pack(xq: Fp8Tensor) -> torch.Tensor:
    """[T, H] e4m3 rows and their [T, nb] fp32 scales as one [T, P] uint8 tensor, P = H + 4·nb
    rounded up to 16 bytes (the exchange's kernels read 16-byte aligned rows)."""
    T, H = xq.shape
    nb = xq.scale.shape[1]
    width = -(-(H + 4 * nb) // 16) * 16
    packed = xq.data.new_empty(T, width, dtype=torch.uint8)
    packed[:, :H].copy_(xq.data.view(torch.uint8))
    packed[:, H : H + 4 * nb].copy_(xq.scale.contiguous().view(torch.uint8))
    return packed


def _unpack(packed: torch.Tensor, H: int, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows [N, H], fp32 scales [N, nb]) as views of packed rows [N, P]."""
    return packed[:, :H].view(torch.float8_e4m3fn), packed[:, H : H + 4 * nb].view(torch.float32)


class _AllToAllAnchor(torch.autograd.Function):
    """The anchor of the rows a quantized dispatch received: forward a stand-in of their shape
    (the bytes move outside autograd), backward their bf16 gradient sent back and summed into
    the tokens it came from."""

    @staticmethod
    def forward(ctx, anchor, tok, recv, send, group):
        ctx.meta = (tok, recv, send, group, tuple(anchor.shape))
        return stand_in(anchor, (sum(recv), anchor.shape[1]))

    @staticmethod
    def backward(ctx, grad):
        tok, recv, send, group, shape = ctx.meta
        back = grad.new_empty(sum(send), grad.shape[1])
        dist.all_to_all_single(back, grad.contiguous(), send, recv, group=group)
        out = grad.new_zeros(shape, dtype=torch.float32)
        return out.index_add(0, tok, back.float()).to(grad.dtype), None, None, None, None


def _dispatch_grads(ctx, grad_rows, grad_probs) -> tuple:
    """(the tokens' gradient, the probs') of a symmetric dispatch: the combine's read."""
    ex = ctx.ex
    want_p = ctx.needs_input_grad[1]
    if want_p:  # a slot's prob reached this rank as 0 unless its expert is here
        (ids,) = ctx.saved_tensors
        grad_probs = torch.where(ids >= 0, grad_probs, 0.0)
    gx, gp = ex._pull_sum(grad_rows, grad_probs if want_p else None)
    return gx, gp.to(ctx.probs_dtype) if want_p else None


class _SymmetricDispatch(torch.autograd.Function):
    """x [T, H], probs [T, k] → received (rows, probs, ids); backward sums the rows' and probs'
    gradients back to their tokens (the combine's read)."""

    @staticmethod
    def forward(ctx, x, probs, ex: ExpertExchange):
        ctx.ex, ctx.probs_dtype = ex, probs.dtype
        ex._stage_tokens(x, probs)
        ex._barrier(with_counts=True)  # also: every rank has staged its tokens
        rows, ids, p = ex._pull_tokens(x.dtype, x.shape[1], True, x)
        ctx.mark_non_differentiable(ids)
        ctx.save_for_backward(ids)
        return rows, p, ids

    @staticmethod
    def backward(ctx, grad_rows, grad_probs, _):
        return (*_dispatch_grads(ctx, grad_rows, grad_probs), None)


class _Fp8SymmetricDispatch(torch.autograd.Function):
    """The tokens' anchor [T, H], probs, their packed e4m3 rows [T, P] → (the received rows'
    anchor [N, H], probs, ids, packed rows [N, P]); backward as :class:`_SymmetricDispatch`'s
    (the rows' gradient in the tokens' dtype)."""

    @staticmethod
    def forward(ctx, x_anchor, probs, packed, ex: ExpertExchange):
        ctx.set_materialize_grads(False)
        ctx.ex, ctx.probs_dtype = ex, probs.dtype
        ctx.rows_meta = (x_anchor.shape[1], x_anchor.dtype)
        ex._stage_tokens(packed, probs)
        ex._barrier(with_counts=True)
        got, ids, p = ex._pull_tokens(torch.uint8, packed.shape[1], True, packed)
        ctx.mark_non_differentiable(ids, got)
        ctx.save_for_backward(ids)
        return stand_in(x_anchor, (got.shape[0], x_anchor.shape[1])), p, ids, got

    @staticmethod
    def backward(ctx, grad_rows, grad_probs, _ids, _got):
        H, dtype = ctx.rows_meta
        if grad_rows is None:  # the rows took no part in the loss (their probs may have)
            grad_rows = torch.zeros(ctx.ex.bound, H, dtype=dtype, device=grad_probs.device)
        if grad_probs is None and ctx.needs_input_grad[1]:
            grad_probs = torch.zeros(ctx.ex.bound, ctx.ex.indices.shape[1],
                                     device=grad_rows.device)  # fmt: skip
        return (*_dispatch_grads(ctx, grad_rows, grad_probs), None, None)


class _SymmetricCombine(torch.autograd.Function):
    """Rows [bound, H] per received token → [T, H] sums; backward sends each token's gradient
    to its owners again (the dispatch's read)."""

    @staticmethod
    def forward(ctx, y, ex: ExpertExchange):
        ctx.ex = ex
        return ex._pull_sum(y, None)[0]

    @staticmethod
    def backward(ctx, grad):
        ex = ctx.ex
        grad = grad if grad.stride(-1) == 1 else grad.contiguous()
        ex._stage_tokens(grad, None)
        ex._barrier()
        return ex._pull_tokens(grad.dtype, grad.shape[1], False, grad)[0], None
