"""moekit's basic ops."""

from moekit.fusion.ops.activation import Activate, GeGLU, ScaledGeGLU, ScaledSwiGLU, SwiGLU
from moekit.fusion.ops.comm import AllGather, AllReduce, ReduceScatter
from moekit.fusion.ops.extras import AddExtraInput, MakeExtraOutput
from moekit.fusion.ops.grouped import GroupedLinear
from moekit.fusion.ops.linear import Bias, Linear
from moekit.fusion.ops.moe import Permute, Router, Unpermute
from moekit.fusion.ops.norm import LayerNorm, RMSNorm

__all__ = [
    "Activate",
    "AddExtraInput",
    "AllGather",
    "AllReduce",
    "Bias",
    "GeGLU",
    "GroupedLinear",
    "LayerNorm",
    "Linear",
    "MakeExtraOutput",
    "Permute",
    "RMSNorm",
    "ReduceScatter",
    "Router",
    "ScaledGeGLU",
    "ScaledSwiGLU",
    "SwiGLU",
    "Unpermute",
]
