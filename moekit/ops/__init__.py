"""Public functional ops: validate inputs, dispatch to the Triton kernel or the reference."""

from moekit.ops.allreduce import (
    allreduce,
    allreduce_add,
    allreduce_add_rmsnorm,
    auto_algo,
    set_auto_thresholds,
)
from moekit.ops.fp8_linear import grouped_linear_fp8
from moekit.ops.fp8_mlp import grouped_mlp_fp8
from moekit.ops.grouped_gemm import grouped_mm
from moekit.ops.grouped_linear import grouped_linear
from moekit.ops.grouped_mlp import grouped_mlp
from moekit.ops.permute import (
    Dispatch,
    DispatchConfig,
    permute,
    sort_chunks_by_index,
    unpermute,
)
from moekit.ops.quantize import Fp8Recipe, Fp8Tensor, quantize_fp8
from moekit.ops.rmsnorm import add_rmsnorm, rmsnorm
from moekit.ops.router import RouterConfig, topk_routing
from moekit.ops.router_losses import load_balancing_loss, router_z_loss

__all__ = [
    "Dispatch",
    "DispatchConfig",
    "Fp8Recipe",
    "Fp8Tensor",
    "RouterConfig",
    "add_rmsnorm",
    "allreduce",
    "allreduce_add",
    "allreduce_add_rmsnorm",
    "auto_algo",
    "grouped_linear",
    "grouped_linear_fp8",
    "grouped_mlp",
    "grouped_mlp_fp8",
    "grouped_mm",
    "load_balancing_loss",
    "permute",
    "quantize_fp8",
    "rmsnorm",
    "router_z_loss",
    "set_auto_thresholds",
    "sort_chunks_by_index",
    "topk_routing",
    "unpermute",
]
