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
  Each stacked parameter is one ``ShardedTensorFactory`` whose data is the parameter: Megatron's
  optimizers map their state to sharded tensors by parameter, so the optimizer state (Adam's
  moments, the fp32 master copy) is split expert by expert the same way and loads across
  backends too; a distributed checkpoint loads back as stacked tensors, which
  ``load_grouped`` takes beside the per-expert keys.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
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
    """``nn.Module._load_from_state_dict`` for the TEGroupedMLP layout (each expert's tensor
    copied into its slice of the stacked parameter) or the stacked tensors a distributed
    checkpoint loads (``linear_fc1.weight`` [E, 2F, H]...)."""
    expected = grouped_tensors(experts)
    stacked = {k: p for k, p in _params(experts).items() if p is not None}
    for name, param in stacked.items():
        if prefix + name in state_dict:  # the whole stacked tensor: its experts' entries
            expected = {k: v for k, v in expected.items() if not _is_expert_of(k, name)}
            expected[name] = param
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


def _is_expert_of(key: str, name: str) -> bool:
    """Whether ``key`` is one expert's entry (``linear_fc1.weight3``) of parameter ``name``."""
    return key.startswith(name) and key[len(name) :].isdigit()


def sharded_experts(experts, prefix: str, sharded_offsets: tuple, metadata: dict | None) -> dict:
    """The sharded state dict (see the module docstring): a factory per stacked parameter, at
    ``prefix + "linear_fc1.weight"``..., and the linears' extra-state objects."""
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    per_expert = [_expert_sharded(experts, i, prefix, sharded_offsets, metadata)
                  for i in range(experts.num_local_experts)]  # fmt: skip
    out = {}
    for name, param in _params(experts).items():
        if param is not None:  # one factory per stacked parameter
            templates = [sd.pop(name) for sd in per_expert]
            key = f"{prefix}experts.{name}"  # SequentialMLP's, every expert's in one
            out[prefix + name] = _stacked_factory(experts, name, key, param, templates)
    for i, sd in enumerate(per_expert):
        out.update({f"{prefix}{name}{i}": obj for name, obj in sd.items()})
    return out


def _expert_sharded(experts, i: int, prefix: str, sharded_offsets: tuple, metadata: dict) -> dict:
    """Local expert ``i``'s sharded tensors as ``SequentialMLP``'s expert ``i`` gives them,
    keyed ``"linear_fc1.weight"``... (and ``"linear_fc1._extra_state"``...)."""
    E = experts.num_local_experts
    num_global, first = experts.ep_group.size() * E, experts.ep_group.rank() * E
    singleton = metadata.get("singleton_local_shards", False)
    if singleton:
        sh_prefix, offsets = f"{prefix}experts.{first + i}.", tuple(sharded_offsets)
    else:
        expert_axis = (len(sharded_offsets), first + i, num_global)
        sh_prefix, offsets = f"{prefix}experts.", (*sharded_offsets, expert_axis)
    params = _params(experts)
    out = {}
    for fc, tp_axes in _TP_AXES.items():
        tensors = {"_extra_state": None}
        tensors.update({kind: params[f"{fc}.{kind}"][i] for kind in ("weight", "bias")
                        if params[f"{fc}.{kind}"] is not None})  # fmt: skip
        sd = make_sharded_tensors_for_checkpoint(
            tensors, f"{sh_prefix}{fc}.", tp_axes, offsets, tp_group=experts.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )  # fmt: skip
        for kind in tensors:
            sh = sd[f"{sh_prefix}{fc}.{kind}"]
            sh.replica_id = (*sh.replica_id[:2], experts.dp_group.rank())
            if kind != "_extra_state" and fc == "linear_fc1" and experts.options.activation.gated:
                sh = apply_swiglu_sharded_factory(sh, offsets, singleton)
            out[f"{fc}.{kind}"] = sh
    return out


def _stacked_factory(
    experts, name: str, key: str, param: torch.Tensor, templates: list
) -> ShardedTensorFactory:
    """The factory of the stacked [E, ...] parameter ``name``, under ``SequentialMLP``'s
    sharded key ``key`` (``…experts.experts.linear_fc1.weight``). Its ``data`` is the parameter
    itself, which is how Megatron's optimizers find the parameter's entry. ``build`` gives, for
    whatever tensor of the parameter's shape it is handed (the parameter, or an optimizer state
    of it) and the key it is handed (Megatron renames keys: the layer number taken out, an
    optimizer's prefix put in front), one sharded tensor per expert laid out as ``templates``
    (from the parameter's own slices); ``merge`` stacks what was loaded back."""
    first = experts.ep_group.rank() * experts.num_local_experts
    singleton = templates[0].key != key  # singleton_local_shards: one key per expert

    def build(build_key: str, data: torch.Tensor, replica_id, flattened_range) -> list:
        if flattened_range is not None:
            raise ValueError(
                f"{build_key}: moekit's experts cannot be saved in a flattened optimizer format "
                "(the distributed optimizer's 'fully_sharded_model_space'); save with "
                "metadata={'distrib_optim_sharding_type': 'fully_reshardable'} or "
                "'dp_reshardable'"
            )
        head = build_key[: len(build_key) - len(f"experts.{name}")]
        keys = [f"{head}experts.{first + i}.{name}" if singleton else build_key
                for i in range(len(templates))]  # fmt: skip
        return [_expert_entry(t, k, data[i], replica_id)
                for i, (t, k) in enumerate(zip(templates, keys, strict=True))]  # fmt: skip

    def merge(loaded: list) -> torch.Tensor:
        return torch.stack([torch.cat(x) if isinstance(x, list) else x for x in loaded])

    return ShardedTensorFactory(key, param, build, merge, templates[0].replica_id)


def _expert_entry(template, key: str, data: torch.Tensor, replica_id):
    """``template`` (one expert's sharded tensor, or the SwiGLU factory of its gate and up
    halves) over ``data`` under ``key``, built."""
    if isinstance(template, ShardedTensorFactory):
        return replace(template, key=key, data=data, replica_id=replica_id).build()
    return replace(template, key=key, data=data, dtype=data.dtype, replica_id=replica_id)


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
