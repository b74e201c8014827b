"""``MoELayer``: a Mixture-of-Experts FFN block built from moekit's ops.

router (logits GEMM + fused top-k) → permute → fused grouped expert MLP (probs applied inside
the activation) → unpermute (+ an optional dense shared expert), with the router's losses
attached to the routing probs so that they train the router without the caller adding them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from moekit.activations import apply_activation, resolve_activation
from moekit.nn.expert_parallel import ExpertParallelConfig, ExpertParallelRouting
from moekit.nn.grouped_mlp import GroupedMLP
from moekit.nn.router import RouterOutput, TopKRouter
from moekit.ops.autocast import autocast_on, autocast_tensors
from moekit.ops.permute import Dispatch, DispatchConfig, permute, permuted_rows, unpermute
from moekit.ops.quantize import Fp8Recipe, Fp8Tensor
from moekit.ops.router import RouterConfig

__all__ = ["MoELayer", "SharedExpert", "routed_experts"]


def routed_experts(
    tokens: torch.Tensor,  # [T, H]
    route: RouterOutput,
    experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    *,
    num_experts: int,
    dispatch: DispatchConfig | None = None,  # None: dropless, packed
    scale_by_probs: bool = True,
    shape: Sequence[int] | None = None,
    fp8: Fp8Recipe | None = None,
) -> torch.Tensor:  # [T, H'] (or ``shape``)
    """The routed part of an MoE layer on one device: permute the tokens by ``route``, run
    ``experts(rows [R, H], offsets [E], row_probs [R] | None) -> [R, H']`` (the probs, in the
    rows' dtype, are applied inside the experts' activation), and sum each token's rows back
    unweighted, into a tensor of ``shape`` if given (``moekit.ops.unpermute``). Differentiable
    in the tokens, the route's probs and whatever ``experts`` uses. With ``fp8`` the rows are
    quantized in the permute and reach ``experts`` as an :class:`~moekit.ops.Fp8Tensor`."""
    dispatch = dispatch or DispatchConfig()
    d = permute(
        tokens, route.indices, route.probs, num_experts=num_experts, align=dispatch.align,
        capacity_factor=dispatch.capacity_factor, fp8=fp8,
    )  # fmt: skip
    quantized = isinstance(d.hidden, Fp8Tensor)
    dtype = d.hidden.orig_dtype if quantized else d.hidden.dtype
    probs = d.probs.to(dtype) if scale_by_probs else None
    regather = dispatch.recompute_rows and not quantized
    with _rows_regathered(tokens, d) if regather else contextlib.nullcontext():
        out = experts(d.hidden, d.offsets, probs)
    return unpermute(out, d, weighted=False, shape=shape)


def _layer_dispatch(dispatch: object, expert_parallel: bool, fp8: object) -> DispatchConfig:
    """The layer's dispatch options, checked against what the layer runs: FP8's weight
    gradients take 128-row segments; recompute_rows needs rows permuted here in bf16/fp16/fp32."""
    if dispatch is not None and not isinstance(dispatch, DispatchConfig):
        raise TypeError(
            f"dispatch must be a moekit.nn.DispatchConfig, got {type(dispatch).__name__}"
        )
    dispatch = dispatch or DispatchConfig()
    if dispatch.recompute_rows and (expert_parallel or fp8 is not None):
        raise ValueError(
            "dispatch.recompute_rows needs a single-device bf16/fp16/fp32 layer: with "
            "ep_group the rows come from the exchange, with fp8 they are already taken "
            "from the tokens"
        )
    if fp8 is None:
        return dispatch
    if dispatch.align not in (None, 128):
        raise ValueError(
            "fp8 needs dispatch.align None or 128 (the FP8 weight gradients work on "
            f"128-row blocks), got {dispatch.align}"
        )
    return dataclasses.replace(dispatch, align=128)


class _RegatherRows:
    """What autograd saves in place of a dispatch's rows under :func:`_rows_regathered`."""


@contextlib.contextmanager
def _rows_regathered(tokens: torch.Tensor, d: Dispatch) -> Iterator[None]:
    """Autograd, inside, saves ``d.hidden`` (the permuted rows) as a note to gather them again
    from ``tokens`` when the backward unpacks them (``DispatchConfig.recompute_rows``). Nothing
    here holds the rows themselves: a weak reference tells them apart while they are saved."""
    rows = weakref.ref(d.hidden)
    meta, source = dataclasses.replace(d, hidden=None, probs=None), tokens.detach()

    def pack(t: torch.Tensor) -> object:
        return _RegatherRows if t is rows() else t

    def unpack(packed: object) -> torch.Tensor:
        return permuted_rows(source, meta) if packed is _RegatherRows else packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


class SharedExpert(nn.Module):
    """A dense expert every token goes through: ``fc2(act(fc1(x)))`` with the layer's
    activation (``fc1 [2F or F, H]``, ``fc2 [H, F]``, nn.Linear layout)."""

    def __init__(self, hidden_size, ffn_hidden_size, activation, device=None, dtype=None):
        super().__init__()
        self.activation = resolve_activation(activation)
        rows = 2 * ffn_hidden_size if self.activation.gated else ffn_hidden_size
        self.fc1 = nn.Linear(hidden_size, rows, bias=False, device=device, dtype=dtype)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(apply_activation(self.fc1(x), self.activation, None))


class MoELayer(nn.Module):
    """Top-k routed experts over the tokens of ``x [..., H]``; returns the same shape.

    Args:
        hidden_size, ffn_hidden_size: H and each expert's width F.
        num_experts, k: E experts, k per token.
        activation: the experts' activation (``moekit.nn.GroupedMLP``).
        router: the router's options (:class:`moekit.ops.RouterConfig`: score, groups,
            normalisation, expert bias, aux and z loss coefficients); None: its defaults.
        shared_expert_ffn_size: width of a dense shared expert added to every token's output
            (0: none).
        dispatch: the capacity limit and row alignment
            (:class:`moekit.ops.DispatchConfig`); None: dropless and packed.
        ep_group: expert parallelism over this ``torch.distributed`` group of W ranks: rank r
            holds experts ``[r·E/W, (r+1)·E/W)`` (E must divide by W); each token travels once
            to every rank holding one of its experts and its result comes back summed. On GPUs
            of one host the exchange reads peers' memory directly (symmetric memory): no host
            sync, dropless or not, and CUDA-graph capturable; elsewhere it takes
            ``all_to_all_single`` and one host sync per call (``ep_config``). Ranks may pass
            different token counts. The router is replicated: keep its weights equal across
            ranks.
        ep_config: :class:`~moekit.nn.ExpertParallelConfig` (backend, static bounds).
        fp8: an :class:`~moekit.ops.Fp8Recipe`: the routed experts train in FP8 (docs/fp8.md):
            the tokens are quantized once, in the permute, and both expert GEMMs of every pass
            run in e4m3 with fp32 scales; the router, its losses, the combine and the shared
            expert stay in the layer's dtype, and the weights stay in theirs. With ``ep_group``
            the tokens travel in e4m3 (about half the bytes) and their results come back in
            the layer's dtype. Needs ``dispatch.align`` None or 128 (it becomes 128: the weight
            gradients work on 128-row blocks) and sizes that are multiples of 16.

    The aux and z losses enter the backward by themselves, with gradient
    :attr:`aux_loss_grad_scale` (default 1.0: set it to your loss's scale factor, e.g. 1/N for
    N accumulated micro-batches).

    After a forward, ``last_counts [E]`` holds the tokens this rank routed to each expert (on
    the device), e.g. for ``router.update_expert_bias(counts)`` once summed over the ranks that
    share the router (``torch.distributed.all_reduce``), and ``last_aux_loss`` /
    ``last_z_loss`` the losses it added to the backward (detached scalars on the device, already
    times their coefficients; None when off), for logging: reading one with ``.item()`` is the
    caller's host sync, not the layer's.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        k: int,
        *,
        activation: str = "swiglu",
        router: RouterConfig | None = None,
        shared_expert_ffn_size: int = 0,
        dispatch: DispatchConfig | None = None,
        ep_group: object | None = None,
        ep_config: ExpertParallelConfig | None = None,
        fp8: Fp8Recipe | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        if router is not None and not isinstance(router, RouterConfig):
            raise TypeError(f"router must be a moekit.nn.RouterConfig, got {type(router).__name__}")
        self.router = TopKRouter(hidden_size, num_experts, k, router, **kw)
        local = num_experts
        self.ep = None
        if ep_group is not None:
            if ep_config is not None and not isinstance(ep_config, ExpertParallelConfig):
                raise TypeError(
                    f"ep_config must be an ExpertParallelConfig, got {type(ep_config).__name__}"
                )
            self.ep = ExpertParallelRouting(
                ep_group, num_experts, ep_config or ExpertParallelConfig()
            )
            local = num_experts // ep_group.size()
        elif ep_config is not None:
            raise ValueError("ep_config needs ep_group")
        self.ep_group = ep_group
        self.experts = GroupedMLP(local, hidden_size, ffn_hidden_size, activation, fp8=fp8, **kw)
        self.fp8 = fp8
        self.shared_expert = None
        if shared_expert_ffn_size:
            self.shared_expert = SharedExpert(hidden_size, shared_expert_ffn_size, activation, **kw)
        self.num_experts, self.k = num_experts, k
        self.dispatch = _layer_dispatch(dispatch, self.ep is not None, fp8)
        self.last_counts: torch.Tensor | None = None
        self.last_aux_loss: torch.Tensor | None = None
        self.last_z_loss: torch.Tensor | None = None

    @property
    def aux_loss_grad_scale(self) -> float | torch.Tensor:
        """The router's :attr:`~moekit.nn.TopKRouter.aux_loss_grad_scale`: the gradient the aux
        and z losses enter the backward with."""
        return self.router.aux_loss_grad_scale

    @aux_loss_grad_scale.setter
    def aux_loss_grad_scale(self, value: float | torch.Tensor) -> None:
        self.router.aux_loss_grad_scale = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.router.weight
        H = weight.shape[1]
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != H:
            raise ValueError(
                f"x must be a [..., hidden_size = {H}] tensor (at least 1-D), got "
                f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
            )
        tokens = x.reshape(-1, H)
        if tokens.stride(-1) != 1:  # e.g. a transposed [T, H] view: permute reads unit-stride rows
            tokens = tokens.contiguous()
        if autocast_on(tokens.device.type):
            # the experts would cast their rows anyway (k per token): cast the tokens once
            (tokens,) = autocast_tensors(tokens.device.type, (tokens,), (H,))
        elif x.dtype != weight.dtype:
            raise TypeError(
                f"MoELayer got x of dtype {x.dtype}, but its parameters are {weight.dtype}: "
                "outside torch.autocast the layer computes in its parameters' dtype. Run it "
                f"inside torch.autocast('{x.device.type}', dtype=...) (mixed precision), or "
                f"convert one to the other: layer.to({x.dtype}) or x.to({weight.dtype})"
            )
        r = self.router(tokens)
        self.last_counts = r.counts
        self.last_aux_loss = None if r.aux_loss is None else r.aux_loss.detach()
        self.last_z_loss = None if r.z_loss is None else r.z_loss.detach()
        # On the probs, which every routed row's output depends on, rather than on the
        # returned tensor: the caller may then add a residual to that in place.
        r = dataclasses.replace(r, probs=self.router.attach_losses(r.probs, r))
        if self.ep_group is None:
            y = routed_experts(
                tokens, r, self.experts, num_experts=self.num_experts, dispatch=self.dispatch,
                shape=x.shape, fp8=self.fp8,
            )  # fmt: skip
        else:
            y = self.ep(tokens, r.indices, r.probs, self.experts, self.dispatch, shape=x.shape,
                        fp8=self.fp8)  # fmt: skip
        if self.shared_expert is not None:
            y = y + self.shared_expert(tokens).view(x.shape)
        # y is a tensor of its own in x's shape, not a view: in-place ops on it and FSDP2's
        # output hooks behave as on any layer's output.
        return y
