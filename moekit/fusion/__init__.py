"""Op fusion: chains of basic ops (:class:`Sequential`) that run fused kernels wherever a
registered rule applies, and fall back visibly where none does (:meth:`Sequential.plan`).
See docs/fusion.md."""

from moekit.fusion import rules
from moekit.fusion.op import BasicOp, Decline, FusedOp, OpContext, RecordedGraph
from moekit.fusion.ops import (
    Activate,
    AddExtraInput,
    AllGather,
    AllReduce,
    Bias,
    GeGLU,
    GroupedLinear,
    LayerNorm,
    Linear,
    MakeExtraOutput,
    Permute,
    ReduceScatter,
    RMSNorm,
    Router,
    ScaledGeGLU,
    ScaledSwiGLU,
    SwiGLU,
    Unpermute,
)
from moekit.fusion.plan import Facts, Plan
from moekit.fusion.registry import (
    fusions,
    register_fusion,
    registered_rules,
    unregister_fusion,
)
from moekit.fusion.sequential import Sequential

__all__ = [
    "Activate",
    "AddExtraInput",
    "AllGather",
    "AllReduce",
    "BasicOp",
    "Bias",
    "Decline",
    "Facts",
    "FusedOp",
    "GeGLU",
    "GroupedLinear",
    "LayerNorm",
    "Linear",
    "MakeExtraOutput",
    "OpContext",
    "Permute",
    "Plan",
    "RMSNorm",
    "RecordedGraph",
    "ReduceScatter",
    "Router",
    "ScaledGeGLU",
    "ScaledSwiGLU",
    "Sequential",
    "SwiGLU",
    "Unpermute",
    "fusions",
    "register_fusion",
    "registered_rules",
    "rules",
    "unregister_fusion",
]
