"""Thin modules that own parameters and call moekit.ops."""

from moekit.nn.expert_parallel import ExpertParallelConfig
from moekit.nn.grouped_linear import GroupedLinear
from moekit.nn.grouped_mlp import GroupedMLP
from moekit.nn.moe import MoELayer, SharedExpert, routed_experts
from moekit.nn.rmsnorm import RMSNorm
from moekit.nn.router import RouterOutput, TopKRouter
from moekit.nn.row_parallel_linear import RowParallelLinear
from moekit.ops.permute import DispatchConfig
from moekit.ops.router import RouterConfig

__all__ = [
    "DispatchConfig",
    "ExpertParallelConfig",
    "GroupedLinear",
    "GroupedMLP",
    "MoELayer",
    "RMSNorm",
    "RouterConfig",
    "RouterOutput",
    "RowParallelLinear",
    "SharedExpert",
    "TopKRouter",
    "routed_experts",
]
