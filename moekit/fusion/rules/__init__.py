"""moekit's built-in fusion rules (registered on import)."""

from moekit.fusion.rules import allreduce, grouped_mlp, moe, rmsnorm

__all__ = ["allreduce", "grouped_mlp", "moe", "rmsnorm"]
