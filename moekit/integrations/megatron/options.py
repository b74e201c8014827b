"""What a Megatron-Core ``TransformerConfig`` asks of the experts, in moekit's terms, or a clear
error naming the option moekit's experts do not run."""

from __future__ import annotations

import dataclasses

import torch.nn.functional as F
from megatron.core.activations import squared_relu
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.transformer.transformer_config import TransformerConfig

from moekit.activations import Activation

__all__ = ["ExpertsOptions", "experts_options"]

QUICK_GELU_ALPHA = 1.702  # megatron.core's quick_gelu: x * sigmoid(1.702 x)


@dataclasses.dataclass(frozen=True)
class ExpertsOptions:
    """The experts of one MoE layer: per-rank sizes and the math moekit runs for them."""

    hidden_size: int
    ffn_hidden_size: int  # this expert-tensor-parallel rank's share of moe_ffn_hidden_size
    activation: Activation
    bias: bool
    probs_on_input: bool  # moe_apply_probs_on_input: x * prob before fc1, the activation unscaled
    recompute_activation: bool  # "moe_act" in recompute_modules (selective recompute)


def _activation(config: TransformerConfig) -> Activation:
    fn, gated = config.activation_func, config.gated_linear_unit
    clamp = getattr(config, "activation_func_clamp_value", None)
    offset = getattr(config, "glu_linear_offset", 0.0) or 0.0
    if gated and fn is quick_gelu and clamp is not None:
        return Activation("clamped_swiglu", limit=float(clamp), alpha=QUICK_GELU_ALPHA,
                          offset=float(offset))  # fmt: skip
    if clamp is None and offset == 0.0:
        names = {F.silu: "swiglu", F.gelu: "geglu"} if gated else {
            F.silu: "silu", F.gelu: "gelu", squared_relu: "relu2"}  # fmt: skip
        if fn in names:
            return Activation(names[fn])
    name = getattr(fn, "__name__", repr(fn))
    raise ValueError(
        "moekit's Megatron experts run gated silu/gelu (SwiGLU, GeGLU), gated quick_gelu with "
        "activation_func_clamp_value (gpt-oss's clamped SwiGLU), and ungated silu, gelu and "
        f"squared_relu; got activation_func={name}, gated_linear_unit={gated}, "
        f"activation_func_clamp_value={clamp}, glu_linear_offset={offset}"
    )


def _decline(config: TransformerConfig) -> None:
    """Options whose semantics moekit's experts do not have."""
    unsupported = {
        "fp8": "Megatron's FP8 recipes run through TransformerEngine; moekit's experts run in "
        "the parameters' dtype",
        "fp4": "moekit has no FP4",
        "moe_latent_size": "moekit's experts project from and to hidden_size",
        "delay_wgrad_compute": "moekit computes weight gradients in the backward pass",
    }
    for option, why in unsupported.items():
        value = getattr(config, option, None)
        if value not in (None, False):
            raise ValueError(f"config.{option}={value!r} is not supported: {why}")
    offload = set(getattr(config, "offload_modules", None) or ())
    if getattr(config, "fine_grained_activation_offloading", False) and offload & {
        "expert_fc1", "moe_act"}:  # fmt: skip
        raise ValueError(
            "config.offload_modules with 'expert_fc1' or 'moe_act' is not supported: moekit's "
            "fused MLP keeps its own saved tensors"
        )
    if config.moe_apply_probs_on_input and config.moe_router_topk != 1:
        raise ValueError(
            "config.moe_apply_probs_on_input needs moe_router_topk=1 (as in Megatron's own "
            f"experts), got moe_router_topk={config.moe_router_topk}"
        )


def experts_options(config: TransformerConfig, expert_tp_size: int) -> ExpertsOptions:
    """The experts' options from ``config``, with ``moe_ffn_hidden_size`` split over
    ``expert_tp_size`` ranks (Megatron's expert tensor parallelism: fc1 by output columns, fc2
    by input columns, the partial outputs reduced by the token dispatcher)."""
    _decline(config)
    ffn = config.moe_ffn_hidden_size
    if ffn % expert_tp_size:
        raise ValueError(
            f"config.moe_ffn_hidden_size ({ffn}) must divide by the expert tensor-parallel "
            f"size ({expert_tp_size})"
        )
    recompute = config.recompute_granularity == "selective" and "moe_act" in (
        config.recompute_modules or ()
    )
    return ExpertsOptions(
        hidden_size=config.hidden_size,
        ffn_hidden_size=ffn // expert_tp_size,
        activation=_activation(config),
        bias=bool(config.add_bias_linear),
        probs_on_input=bool(config.moe_apply_probs_on_input),
        recompute_activation=recompute,
    )
