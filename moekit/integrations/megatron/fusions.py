"""Megatron-Core's fused permute and fused router, served by moekit instead of TransformerEngine.

Megatron-Core runs its token dispatcher's permute, unpermute and chunk sort
(``moe_permute_fusion``) and its router's top-k and aux-loss scores (``moe_router_fusion``)
through functions of ``megatron.core.transformer.moe.moe_utils`` that TransformerEngine
provides and that are None without it. :func:`moekit_fusions` puts moekit's ops there, with
TransformerEngine's contracts, and turns the config's two flags on; on exit both are as they
were. Where Megatron's own (unfused) math differs from what moekit's kernels compute, it
declines with a ``ValueError`` naming the option, before anything is changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import NamedTuple

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.transformer_config import TransformerConfig

from moekit.config import debug_checks
from moekit.ops import Dispatch, permute, sort_chunks_by_index, topk_routing, unpermute
from moekit.ops.routing import routing_map_to_indices

__all__ = ["moekit_fusions"]


class RowMap(NamedTuple):
    """What the fused permute hands Megatron as its ``row_id_map``, for the unpermute: the
    routing metadata (its rows and probs dropped, so the map holds no [R, H] tensor) and the
    expert of each of a token's k slots."""

    dispatch: Dispatch
    experts: torch.Tensor  # [T, k] int, −1 for a slot routed nowhere


def _permute(tokens, routing_map, num_out_tokens, probs, topk: int):
    """(rows [R, H], their probs [R] or None, RowMap): TransformerEngine's mask permute, each
    expert's tokens in token order, R = ``num_out_tokens`` (the first R rows of that order)."""
    T, E = routing_map.shape
    _check_slots(routing_map, topk)
    indices, slot_probs = routing_map_to_indices(routing_map, probs, topk)
    rows = T * topk if num_out_tokens is None else int(num_out_tokens)
    d = permute(tokens, indices, slot_probs, num_experts=E, out_rows=rows)
    kept = dataclasses.replace(d, hidden=d.hidden.new_empty(0), probs=None)
    return d.hidden, d.probs, RowMap(kept, indices)


def _check_slots(routing_map: torch.Tensor, topk: int) -> None:
    """A token routed to more than ``topk`` experts would lose slots: a ValueError on the CPU,
    a device-side assert under ``MOEKIT_DEBUG=1`` on a GPU (no host sync)."""
    on_cpu = routing_map.device.type == "cpu"
    if not on_cpu and not debug_checks():
        return
    over = ((routing_map != 0).sum(dim=1) > topk).any()
    msg = f"the routing map sends a token to more than moe_router_topk = {topk} experts"
    if on_cpu and bool(over):
        raise ValueError(msg)
    if not on_cpu:
        torch._assert_async(~over, msg)


def _fused_permute(tokens, routing_map, num_out_tokens=None, *, topk: int):
    rows, _, row_map = _permute(tokens, routing_map, num_out_tokens, None, topk)
    return rows, row_map


def _fused_permute_with_probs(tokens, probs, routing_map, num_out_tokens=None, *, topk: int):
    return _permute(tokens, routing_map, num_out_tokens, probs, topk)


def _unpermute(permuted_tokens, row_id_map: RowMap, merging_probs=None, restore_shape=None,
               pad_offsets=None):  # fmt: skip
    """tokens [T, H]: each token's rows summed back, weighted by ``merging_probs [T, E]`` at
    their experts when given; in fp32, returned in the rows' dtype."""
    if pad_offsets is not None:  # only from TransformerEngine's own permute-and-pad
        raise ValueError("moekit's fused unpermute takes no pad_offsets")
    d, experts = row_id_map
    shape = None if restore_shape is None else (*restore_shape[:-1], permuted_tokens.shape[-1])
    if merging_probs is None:
        return unpermute(permuted_tokens, d, weighted=False, shape=shape)
    slot = merging_probs.gather(1, experts.clamp(min=0).long())  # [T, k]; −1 slots have no row
    rows = d.row_index.reshape(-1).long()
    rows = torch.where(rows >= 0, rows, d.num_rows)  # slots without a row: one spare entry
    row_probs = slot.new_zeros(d.num_rows + 1).scatter(0, rows, slot.reshape(-1))
    return unpermute(permuted_tokens, dataclasses.replace(d, probs=row_probs[:-1]), shape=shape)


def _sort_chunks(x, split_sizes, sorted_idxs):
    out, _ = sort_chunks_by_index(x, split_sizes.to(x.device), sorted_idxs.to(x.device))
    return out


def _sort_chunks_with_probs(x, probs, split_sizes, sorted_idxs):
    return sort_chunks_by_index(x, split_sizes.to(x.device), sorted_idxs.to(x.device), probs)


def _topk(logits, topk, use_pre_softmax=False, num_groups=None, group_topk=None,
          scaling_factor=None, score_function="softmax", expert_bias=None):  # fmt: skip
    """(probs [T, E] in the logits' dtype, routing map [T, E] bool): Megatron's top-k routing
    by moekit's fused router kernel."""
    _check_routing(score_function, use_pre_softmax, group_topk, topk, expert_bias is not None)
    softmax = score_function == "softmax"
    probs, idx = topk_routing(
        logits, topk, score=score_function, expert_bias=expert_bias,
        num_groups=num_groups if group_topk else None, topk_groups=group_topk or None,
        normalize=not use_pre_softmax if softmax else topk > 1, scaling=scaling_factor or 1.0,
    )  # fmt: skip
    idx = idx.long()
    dense = torch.zeros_like(logits).scatter(1, idx, probs.to(logits.dtype))
    return dense, torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)


def _aux_loss_scores(logits, topk, score_function):
    """(routing map [T, E], scores [T, E] fp32) for the aux losses: Megatron's own math."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    idx = torch.topk(scores, k=topk, dim=1).indices
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True), scores


def _aux_loss(probs, tokens_per_expert, total_num_tokens, topk, num_experts, coeff):
    """The switch load-balancing loss, Megatron's formula."""
    per_expert = probs.sum(dim=0) * tokens_per_expert
    return per_expert.sum() * (num_experts * coeff / (topk * total_num_tokens * total_num_tokens))


def _check_routing(score: str, pre_softmax: bool, group_topk, topk: int, bias: bool) -> None:
    """The ValueError for a routing whose Megatron math moekit's router kernel does not do."""
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"moekit's fused router takes moe_router_score_function softmax or "
                         f"sigmoid, got {score!r}")  # fmt: skip
    if score == "softmax" and bias:
        raise ValueError("moe_router_enable_expert_bias with the softmax score: Megatron's "
                         "own router ignores the bias there; use sigmoid")  # fmt: skip
    if group_topk:
        if score == "softmax" and not pre_softmax:
            raise ValueError("group-limited routing (moe_router_group_topk) under softmax needs "
                             "moe_router_pre_softmax=True: Megatron scores the groups on the "
                             "logits otherwise, moekit on the softmax")  # fmt: skip
        if topk != 2 * group_topk:
            raise ValueError(f"group-limited routing scores a group by its top "
                             f"moe_router_topk / moe_router_group_topk experts in Megatron, by "
                             f"its top 2 in moekit: needs moe_router_topk = 2 * group_topk = "
                             f"{2 * group_topk}, got {topk}")  # fmt: skip


def _check_permute(config: TransformerConfig) -> None:
    if getattr(config, "moe_router_padding_for_quantization", False):
        raise ValueError("moekit's fused permute does not take "
                         "moe_router_padding_for_quantization (it routes a token to more "
                         "than moe_router_topk experts)")  # fmt: skip
    graphs = getattr(config, "cuda_graph_impl", "none") not in (None, "none")
    if graphs or getattr(config, "enable_cuda_graph", False):
        raise ValueError("moekit's fused permute does not run under Megatron's CUDA graphs "
                         "(cuda_graph_impl / enable_cuda_graph): its row map is not a "
                         "tensor")  # fmt: skip
    if config.moe_token_dispatcher_type not in ("alltoall", "allgather"):
        raise ValueError(f"moekit's fused permute serves the alltoall and allgather "
                         f"dispatchers, got moe_token_dispatcher_type = "
                         f"{config.moe_token_dispatcher_type!r}")  # fmt: skip


def _installed(config: TransformerConfig, permute_on: bool, router_on: bool) -> dict:
    """The moe_utils functions to install: TransformerEngine's names, moekit's ops."""
    topk = config.moe_router_topk
    funcs: dict = {}
    if permute_on:
        _check_permute(config)
        # Padded to capacity, each expert takes its top-capacity tokens: a token may be routed
        # to more than moe_router_topk experts, up to all of them.
        slots = config.num_moe_experts if config.moe_pad_expert_input_to_capacity else topk
        funcs.update(
            fused_permute=functools.partial(_fused_permute, topk=slots),
            fused_permute_with_probs=functools.partial(_fused_permute_with_probs, topk=slots),
            fused_unpermute=_unpermute, fused_sort_chunks_by_index=_sort_chunks,
            fused_sort_chunks_by_index_with_probs=_sort_chunks_with_probs,
        )  # fmt: skip
    if router_on:
        group_topk = config.moe_router_group_topk
        _check_routing(config.moe_router_score_function, config.moe_router_pre_softmax,
                       group_topk, topk, config.moe_router_enable_expert_bias)  # fmt: skip
        funcs.update(fused_topk_with_score_function=_topk,
                     fused_compute_score_for_moe_aux_loss=_aux_loss_scores,
                     fused_moe_aux_loss=_aux_loss)  # fmt: skip
    return funcs


def _ours(fn: object) -> bool:
    """Whether ``fn`` is one of the functions this module installs."""
    return getattr(getattr(fn, "func", fn), "__module__", None) == __name__


@contextlib.contextmanager
def moekit_fusions(
    config: TransformerConfig, *, permute: bool = True, router: bool = True
) -> Iterator[TransformerConfig]:
    """Within this block, Megatron-Core's fused permute (``permute``) and fused router
    (``router``) run moekit's ops, and ``config.moe_permute_fusion`` / ``moe_router_fusion``
    are on. Build the model inside the block (Megatron's dispatchers read the flags when they
    are made, too) and train inside it; on exit the functions and the flags are restored.

    The permute is TransformerEngine's mask permute: each expert's tokens in token order, R =
    ``num_out_tokens`` rows; the unpermute sums in fp32. The router is moekit's
    :func:`~moekit.ops.topk_routing` (softmax, or sigmoid with the expert bias; pre-softmax,
    group-limited routing with two experts per group's score, the top-k scaling factor); the
    aux-loss scores and the switch loss are Megatron's own formulas. Options whose Megatron
    math differs raise a ``ValueError`` naming them. Not re-entrant.

    Yields ``config``."""
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"config must be a megatron.core TransformerConfig, got "
                        f"{type(config).__name__}")  # fmt: skip
    funcs = _installed(config, permute, router)
    if any(_ours(getattr(moe_utils, name, None)) for name in funcs):
        raise RuntimeError("moekit_fusions is already active: it is not re-entrant")
    flags = {"moe_permute_fusion": permute, "moe_router_fusion": router}
    saved = {name: getattr(moe_utils, name, None) for name in (*funcs, "HAVE_TE")}
    saved_flags = {name: getattr(config, name) for name, on in flags.items() if on}
    try:
        for name, fn in funcs.items():
            setattr(moe_utils, name, fn)
        moe_utils.HAVE_TE = True  # Megatron checks it before the functions
        for name in saved_flags:
            setattr(config, name, True)
        yield config
    finally:
        for name, value in saved.items():
            setattr(moe_utils, name, value)
        for name, value in saved_flags.items():
            setattr(config, name, value)
