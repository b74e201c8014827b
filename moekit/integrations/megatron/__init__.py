"""Megatron-Core backend: moekit's fused grouped MLP as the experts of ``megatron.core``'s
MoELayer, without TransformerEngine, on Megatron's own parallelism (needs
``pip install 'moekit[megatron]'``; docs/megatron.md).

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from moekit.integrations.megatron import with_moekit_experts

    spec = with_moekit_experts(get_gpt_layer_local_spec(num_experts=64, moe_grouped_gemm=True))
    model = GPTModel(config, transformer_layer_spec=spec, ...)

    with moekit_fusions(config):  # Megatron's fused permute and router, by moekit (opt-in)
        model = GPTModel(config, transformer_layer_spec=spec, ...)
        train(model)
"""

try:
    import megatron.core  # noqa: F401
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "moekit.integrations.megatron needs megatron-core: pip install 'moekit[megatron]'"
    ) from exc

from moekit.integrations.megatron.checkpoint import grouped_to_sequential, sequential_to_grouped
from moekit.integrations.megatron.experts import MoekitExperts
from moekit.integrations.megatron.fusions import moekit_fusions
from moekit.integrations.megatron.spec import with_moekit_experts

__all__ = [
    "MoekitExperts",
    "grouped_to_sequential",
    "moekit_fusions",
    "sequential_to_grouped",
    "with_moekit_experts",
]
