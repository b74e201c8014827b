"""``topk_routing``: an MoE router's top-k selection after its logits GEMM, with autograd.

Scores (softmax or sigmoid of the logits), optional aux-loss-free bias for selection only,
optional group-limited selection (DeepSeek-V3), normalised and scaled probs, and the number of
tokens routed to each expert, in one kernel; the logits gradient in one more. The semantics
are :mod:`moekit.reference.router`'s. CUDA tensors run :mod:`moekit.kernels.router`; CPU
tensors the reference, or the kernels in Triton's interpreter under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch

from moekit.kernels import router as kernels
from moekit.ops.validation import FLOAT_DTYPES, check_dtype, check_ndim, check_tensor
from moekit.reference.router import topk_routing_backward_ref, topk_routing_ref
from moekit.runtime.device import use_triton
from moekit.runtime.op import function_apply, kernel_op, refuse_double_backward
from moekit.runtime.replay import replayed, tensor_key
from moekit.tuning.router import router_config

__all__ = ["MAX_EXPERTS", "MAX_TOPK", "RouterConfig", "route", "topk_routing"]

MAX_EXPERTS = 2048  # one token's scores sit in registers
MAX_TOPK = 64  # the kernels unroll one selection round per slot
SCORES = ("softmax", "sigmoid")


def _forward_fake(logits, expert_bias, k, score, num_groups, topk_groups, normalize, scaling):
    T, E = logits.shape
    f = logits.new_empty(T, k, dtype=torch.float32)
    return f, logits.new_empty(T, k, dtype=torch.int32), logits.new_empty(E, dtype=torch.int32)


@kernel_op("topk_routing_forward", fake=_forward_fake)
def _forward(
    logits: torch.Tensor,  # [T, E], unit stride along E
    expert_bias: torch.Tensor | None,  # [E] fp32
    k: int,
    score: str,
    num_groups: int,  # 0: no groups
    topk_groups: int,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs [T, k] fp32, indices [T, k] int32, counts [E] int32)."""
    T, E = logits.shape
    groups = (num_groups or None, topk_groups or None)
    if not use_triton(logits):
        with torch.no_grad():
            p, i = topk_routing_ref(logits, k, score, expert_bias, *groups, normalize, scaling)
        return p, i, torch.bincount(i.flatten().long(), minlength=E).to(torch.int32)
    probs = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(T, k, dtype=torch.int32, device=logits.device)
    if T == 0:
        return probs, indices, torch.zeros(E, dtype=torch.int32, device=logits.device)
    counts = torch.empty(E, dtype=torch.int32, device=logits.device)  # zeroed by the kernels
    key = None
    if logits.is_cuda:
        key = (
            "topk_routing", tensor_key(logits), expert_bias is None, k, score, num_groups,
            topk_groups, normalize, scaling,
        )  # fmt: skip

    def body() -> None:
        kernels.topk_routing_fwd(
            logits, expert_bias, probs, indices, counts, score, *groups, normalize,
            scaling, router_config(E),
        )  # fmt: skip

    replayed(key, (logits, expert_bias, probs, indices, counts), body)
    return probs, indices, counts


@kernel_op("topk_routing_backward", fake=lambda g, logits, *rest: torch.empty_like(logits))
def _backward(
    grad_probs: torch.Tensor,  # [T, k] contiguous
    logits: torch.Tensor,  # [T, E], unit stride along E
    indices: torch.Tensor,  # [T, k] int32
    score: str,
    normalize: bool,
    scaling: float,
) -> torch.Tensor:  # d logits [T, E], logits' dtype
    if not use_triton(logits):
        dl = topk_routing_backward_ref(grad_probs, logits, indices, score, normalize, scaling)
        return dl.to(logits.dtype)
    dlogits = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if logits.shape[0] > 0:
        key = None
        if logits.is_cuda:
            key = ("topk_routing_bwd", tensor_key(logits), indices.shape, score, normalize, scaling)

        def body() -> None:
            kernels.topk_routing_bwd(
                logits, indices, grad_probs, dlogits, score, normalize, scaling,
                router_config(logits.shape[1]),
            )  # fmt: skip

        replayed(key, (logits, indices, grad_probs, dlogits), body)
    return dlogits


class _RoutingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, expert_bias, k, score, num_groups, topk_groups, normalize, scaling):
        probs, indices, counts = _forward(
            logits, expert_bias, k, score, num_groups, topk_groups, normalize, scaling
        )
        ctx.save_for_backward(logits, indices)
        ctx.static = (score, normalize, scaling)
        ctx.mark_non_differentiable(indices, counts)
        return probs, indices, counts

    @staticmethod
    def backward(ctx, grad_probs, _grad_indices, _grad_counts):
        logits, indices = ctx.saved_tensors
        if grad_probs is None:
            return (None,) * 8
        refuse_double_backward("topk_routing")
        dlogits = _backward(grad_probs.contiguous(), logits, indices, *ctx.static)
        return dlogits, None, None, None, None, None, None, None


_apply = function_apply(_RoutingFn)


def _check_groups(num_groups: object, topk_groups: object, E: int, k: int) -> tuple[int, int]:
    if num_groups is None and topk_groups is None:
        return 0, 0
    if not isinstance(num_groups, int) or not isinstance(topk_groups, int):
        raise TypeError(
            "num_groups and topk_groups must both be ints (or both None), got "
            f"{num_groups!r} and {topk_groups!r}"
        )
    if num_groups < 1 or E % num_groups or E // num_groups < 2:
        raise ValueError(
            f"num_groups must divide E = {E} into groups of at least 2 experts (a group's score "
            f"is the sum of its two best), got {num_groups}"
        )
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(
            f"topk_groups must be in [1, num_groups = {num_groups}], got {topk_groups}"
        )
    if k > topk_groups * (E // num_groups):
        raise ValueError(
            f"k = {k} exceeds the {topk_groups * (E // num_groups)} experts of the topk_groups = "
            f"{topk_groups} groups a token may use"
        )
    return num_groups, topk_groups


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """How a router picks and weighs each token's k experts, and the losses it adds; the
    options of :func:`topk_routing`, :class:`moekit.nn.TopKRouter` and
    :class:`moekit.nn.MoELayer` (``router=``), checked once here (those that depend on E when
    a router is built: :meth:`groups`).

    score: ``"softmax"`` or ``"sigmoid"`` of the logits.
    num_groups, topk_groups: group-limited selection (DeepSeek-V3): the experts form
        ``num_groups`` contiguous groups, only the ``topk_groups`` best are eligible; both or
        neither.
    normalize: divide the selected probs by their sum. scaling: then multiply by this.
    expert_bias: an fp32 bias per expert that steers selection only (aux-loss-free
        balancing, ``TopKRouter.update_expert_bias``).
    aux_loss_coeff, z_loss_coeff: the load-balancing and z losses' coefficients (0: off).
    """

    score: Literal["softmax", "sigmoid"] = "softmax"
    num_groups: int | None = None
    topk_groups: int | None = None
    normalize: bool = True
    scaling: float = 1.0
    expert_bias: bool = False
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0

    def __post_init__(self) -> None:
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")
        for name in ("normalize", "expert_bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if isinstance(self.scaling, bool) or not isinstance(self.scaling, (int, float)):
            raise TypeError(f"scaling must be a float, got {type(self.scaling).__name__}")
        for name in ("aux_loss_coeff", "z_loss_coeff"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"{name} must be a finite float >= 0, got {v!r}")
        g, tg = self.num_groups, self.topk_groups
        if (g is None) != (tg is None) or not all(
            v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (g, tg)
        ):
            raise TypeError(
                f"num_groups and topk_groups must both be ints (or both None), got {g!r} and {tg!r}"
            )

    def routing_kwargs(self) -> dict:
        """The selection options as :func:`topk_routing`'s keyword arguments."""
        return dict(score=self.score, num_groups=self.num_groups, topk_groups=self.topk_groups,
                    normalize=self.normalize, scaling=self.scaling)  # fmt: skip

    def groups(self, num_experts: int, k: int) -> tuple[int, int]:
        """The checks that depend on E and k (raise ValueError), without running anything
        (a module may be built on the meta device); ``(num_groups, topk_groups)`` as ints,
        ``(0, 0)`` without groups."""
        E = num_experts
        if isinstance(E, bool) or not isinstance(E, int) or not 1 <= E <= MAX_EXPERTS:
            raise ValueError(f"the number of experts E must be in [1, {MAX_EXPERTS}], got {E!r}")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= min(E, MAX_TOPK):
            raise ValueError(f"k must be an int in [1, min(E = {E}, {MAX_TOPK})], got {k!r}")
        return _check_groups(self.num_groups, self.topk_groups, E, k)


def _check(logits, k, config: RouterConfig, expert_bias):
    logits = check_tensor("logits", logits)
    check_ndim("logits", logits, 2, "[T, E] (tokens, experts)")
    check_dtype("logits", logits, FLOAT_DTYPES)
    E = logits.shape[1]
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"logits.shape[1] (E) must be in [1, {MAX_EXPERTS}], got {E}")
    groups = config.groups(E, k)
    if expert_bias is not None:
        expert_bias = check_tensor("expert_bias", expert_bias)
        if expert_bias.shape != (E,) or expert_bias.dtype != torch.float32:
            raise ValueError(
                f"expert_bias must be a float32 [{E}] tensor, got {expert_bias.dtype} "
                f"{tuple(expert_bias.shape)}"
            )
        if expert_bias.device != logits.device:
            raise ValueError(
                f"expert_bias must be on logits' device {logits.device}, got {expert_bias.device}"
            )
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if expert_bias is not None and not expert_bias.is_contiguous():
        expert_bias = expert_bias.contiguous()
    return logits, expert_bias, groups


def route(
    logits: torch.Tensor,  # [T, E]
    k: int,
    config: RouterConfig,
    expert_bias: torch.Tensor | None = None,  # [E] fp32, selection only
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`topk_routing` with its options as a :class:`RouterConfig` (the loss
    coefficients are not used here), also returning ``counts [E]`` int32: the tokens routed to
    each expert, counted on the device (for load-balancing losses and bias updates)."""
    logits, expert_bias, (g, tg) = _check(logits, k, config, expert_bias)
    c = config
    return _apply(logits, expert_bias, k, c.score, g, tg, c.normalize, float(c.scaling))


def topk_routing(
    logits: torch.Tensor,  # [T, E] bf16/fp16/fp32, the router's output
    k: int,
    *,
    score: str = "softmax",
    expert_bias: torch.Tensor | None = None,  # [E] fp32, selection only
    num_groups: int | None = None,
    topk_groups: int | None = None,
    normalize: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k experts and their routing probabilities.

    ``s = softmax(logits.float())`` or ``sigmoid(logits.float())``; experts are selected by
    ``s + expert_bias`` (the bias affects selection only, never the probs). With ``num_groups``
    the experts form that many contiguous groups, a group's score is the sum of its two highest
    selection scores, and only the ``topk_groups`` best groups are eligible. ``probs`` are ``s``
    at the selected experts, divided by their sum with ``normalize`` (sigmoid: sum + 1e-20),
    times ``scaling``. Ties go to the lower expert id. NaN logits still give in-range,
    distinct indices (a NaN score ranks lowest); with softmax the token's probs are all NaN,
    with sigmoid only a selected NaN expert's prob is (and, with ``normalize``, the token's).

    Args:
        logits: [T, E], E ≤ 2048; gradients flow back to it through ``probs``.
        k: experts per token, 1 ≤ k ≤ min(E, 64).

    Returns:
        ``probs [T, k]`` float32 and ``indices [T, k]`` int32 (descending selection score).
    """
    config = RouterConfig(
        score=score, num_groups=num_groups, topk_groups=topk_groups, normalize=normalize,
        scaling=scaling,
    )  # fmt: skip
    probs, indices, _ = route(logits, k, config, expert_bias)
    return probs, indices
