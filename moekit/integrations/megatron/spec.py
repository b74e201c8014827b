"""``with_moekit_experts``: a Megatron-Core layer spec with moekit's experts in its MoE layers."""

from __future__ import annotations

import copy
import dataclasses
import functools

from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from moekit.integrations.megatron.experts import MoekitExperts

__all__ = ["with_moekit_experts"]


def _moe_submodules(node: object, found: list, seen: set) -> None:
    """Every ``MoESubmodules`` reachable from a spec: through ``ModuleSpec.submodules``, a
    ``functools.partial``'s ``submodules`` (the builders of newer Megatron-Core), dataclass
    fields (``TransformerLayerSubmodules``) and lists (a block's ``layer_specs``)."""
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, MoESubmodules):
        found.append(node)
    elif isinstance(node, ModuleSpec):
        _moe_submodules(node.submodules, found, seen)
    elif isinstance(node, functools.partial):
        _moe_submodules(node.keywords.get("submodules"), found, seen)
    elif isinstance(node, (list, tuple)):
        for item in node:
            _moe_submodules(item, found, seen)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            _moe_submodules(getattr(node, field.name), found, seen)


def with_moekit_experts(spec: object, experts: type = MoekitExperts) -> object:
    """A copy of ``spec`` (a layer spec such as ``get_gpt_layer_local_spec(num_experts=...)``'s
    or a TransformerEngine one, a block spec's submodules, or an MoE spec) whose MoE layers build
    :class:`MoekitExperts` for their experts; the router, the token dispatcher and the shared
    experts stay Megatron's. Works with the ``ModuleSpec`` experts of megatron-core 0.16 and
    the builder callables of later releases. ``experts``: the class to build, MoekitExperts
    or a subclass of it."""
    if not (isinstance(experts, type) and issubclass(experts, MoekitExperts)):
        raise TypeError(f"experts must be MoekitExperts or a subclass of it, got {experts!r}")
    spec = copy.deepcopy(spec)
    found: list[MoESubmodules] = []
    _moe_submodules(spec, found, set())
    if not found:
        raise ValueError(
            "with_moekit_experts found no MoE layer in the spec: build it with num_experts set "
            "(e.g. get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=True))"
        )
    for moe in found:
        moe.experts = (
            ModuleSpec(module=experts) if isinstance(moe.experts, ModuleSpec) else experts
        )  # fmt: skip
    return spec
