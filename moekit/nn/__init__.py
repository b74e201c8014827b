"""Thin modules that own parameters and call moekit.ops."""

from moekit.nn.grouped_linear import GroupedLinear

__all__ = ["GroupedLinear"]
