"""Checkpoint layouts of :class:`~moekit.integrations.megatron.MoekitExperts`.

* The state dict (``model.state_dict()``, ``torch.save``) has TransformerEngine's
  ``TEGroupedMLP`` keys: ``linear_fc1.weight<i>`` [2F, H], ``linear_fc2.weight<i>`` [H, F], and
  ``linear_fc1.bias<i>`` / ``linear_fc2.bias<i>`` with biases, i the local expert. A
  ``SequentialMLP`` state dict (``local_experts.<i>.linear_fc1.weight``...) converts either way
  with :func:`sequential_to_grouped` and :func:`grouped_to_sequential`.
* The sharded state dict (``megatron.core.dist_checkpointing``) is ``SequentialMLP``'s, tensor
  by tensor: the same keys (``<layer>.experts.experts.linear_fc1.weight``), global shapes,
  per-expert offsets, tensor-parallel splits (fc1's [gate | up] halves split separately, as
  Megatron's SwiGLU factory does) and replica ids, so a distributed checkpoint saved with either
  backend (or with ``TEGroupedMLP``, whose sharded keys are the same) loads into the other.
"""

from __future__ import annotations

import re

import torch
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)

__all__ = ["grouped_to_sequential", "sequential_to_grouped"]

_SEQUENTIAL = re.compile(
    r"^(?P<head>.*)local_experts\.(?P<i>\d+)\.(?P<fc>linear_fc[12])\.(?P<kind>weight|bias|_extra_state)$"
)
_GROUPED = re.compile(r"^(?P<head>.*)(?P<fc>linear_fc[12])\.(?P<kind>weight|bias)(?P<i>\d+)$")
_SEQUENTIAL_KEY = "{head}local_experts.{i}.{fc}.{kind}"
_GROUPED_KEY = "{head}{fc}.{kind}{i}"
# the tensor-parallel dim of each linear's tensors (fc1 column-parallel, fc2 row-parallel, its
# bias replicated), as Megatron's ColumnParallelLinear / RowParallelLinear shard them
_TP_AXES = {"linear_fc1": {"weight": 0, "bias": 0}, "linear_fc2": {"weight": 1}}


def _params(experts) -> dict[str, torch.Tensor | None]:
    return {"linear_fc1.weight": experts.fc1_weight, "linear_fc2.weight": experts.fc2_weight,
            "linear_fc1.bias": experts.fc1_bias, "linear_fc2.bias": experts.fc2_bias}  # fmt: skip


def grouped_tensors(experts) -> dict[str, torch.Tensor]:
    """``{"linear_fc1.weight<i>": fc1_weight[i], ...}``: views of the experts' parameters."""
    return {f"{name}{i}": p[i] for name, p in _params(experts).items() if p is not None
            for i in range(experts.num_local_experts)}  # fmt: skip


def load_grouped(experts, state_dict, prefix, strict, missing_keys, unexpected_keys, error_msgs):
    """``nn.Module._load_from_state_dict`` for the TEGroupedMLP layout: each expert's tensor
    copied into its slice of the stacked parameter."""
    expected = grouped_tensors(experts)
    with torch.no_grad():
        for key, dst in expected.items():
            src = state_dict.get(prefix + key)
            if src is None:
                missing_keys.append(prefix + key)
            elif tuple(src.shape) != tuple(dst.shape):
                error_msgs.append(
                    f"size mismatch for {prefix + key}: copying a param with shape "
                    f"{tuple(src.shape)}, the parameter in the current model is {tuple(dst.shape)}"
                )
            else:
                dst.copy_(src)
    if strict:
        for key in state_dict:
            rest = key[len(prefix) :]
            if key.startswith(prefix) and rest not in expected and "_extra_state" not in rest:
                unexpected_keys.append(key)


def sharded_experts(experts, prefix: str, sharded_offsets: tuple, metadata: dict | None) -> dict:
    """The sharded state dict (see the module docstring), keyed by the state dict's keys."""
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    singleton = metadata.get("singleton_local_shards", False)
    E = experts.num_local_experts
    num_global, first = experts.ep_group.size() * E, experts.ep_group.rank() * E
    gated = experts.options.activation.gated
    params = _params(experts)
    out = {}
    for i in range(E):
        if singleton:
            sh_prefix, offsets = f"{prefix}experts.{first + i}.", tuple(sharded_offsets)
        else:
            expert_axis = (len(sharded_offsets), first + i, num_global)
            sh_prefix, offsets = f"{prefix}experts.", (*sharded_offsets, expert_axis)
        for fc, tp_axes in _TP_AXES.items():
            tensors = {"_extra_state": None}
            tensors.update({kind: params[f"{fc}.{kind}"][i] for kind in ("weight", "bias")
                            if params[f"{fc}.{kind}"] is not None})  # fmt: skip
            sd = make_sharded_tensors_for_checkpoint(
                tensors, f"{sh_prefix}{fc}.", tp_axes, offsets, tp_group=experts.tp_group,
                dp_cp_group=metadata["dp_cp_group"],
            )  # fmt: skip
            for kind in ("weight", "bias"):
                key = f"{sh_prefix}{fc}.{kind}"
                if gated and fc == "linear_fc1" and key in sd:
                    sd[key] = apply_swiglu_sharded_factory(sd[key], offsets, singleton)
            for key, sh in sd.items():
                sh.replica_id = (*sh.replica_id[:2], experts.dp_group.rank())
                out[f"{prefix}{fc}.{key[len(sh_prefix) + len(fc) + 1 :]}{i}"] = sh
    return out


def _rename(state_dict: dict, pattern: re.Pattern, entries) -> dict:
    """``state_dict`` with each key ``pattern`` matches replaced by ``entries(match, value)``."""
    out = {}
    for key, value in state_dict.items():
        m = pattern.match(key)
        out.update(entries(m.groupdict(), value) if m else {key: value})
    return out


def sequential_to_grouped(state_dict: dict) -> dict:
    """A state dict with ``SequentialMLP`` experts (``…local_experts.<i>.linear_fc1.weight``)
    in the ``TEGroupedMLP`` / moekit layout (``…linear_fc1.weight<i>``); the linears'
    ``_extra_state`` entries dropped, every other entry as it is."""

    def entries(g: dict, value) -> dict:
        return {} if g["kind"] == "_extra_state" else {_GROUPED_KEY.format(**g): value}

    return _rename(state_dict, _SEQUENTIAL, entries)


def grouped_to_sequential(state_dict: dict) -> dict:
    """The inverse of :func:`sequential_to_grouped`, with the ``_extra_state`` entries (None)
    that ``SequentialMLP``'s linears expect under strict loading."""

    def entries(g: dict, value) -> dict:
        extra = _SEQUENTIAL_KEY.format(**{**g, "kind": "_extra_state"})
        return {_SEQUENTIAL_KEY.format(**g): value, extra: None}

    return _rename(state_dict, _GROUPED, entries)
