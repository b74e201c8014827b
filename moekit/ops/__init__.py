"""Public functional ops: validate inputs, dispatch to the Triton kernel or the reference."""

from moekit.ops.grouped_gemm import grouped_mm
from moekit.ops.grouped_linear import grouped_linear
from moekit.ops.permute import Dispatch, permute, sort_chunks_by_index, unpermute

__all__ = ["Dispatch", "grouped_linear", "grouped_mm", "permute", "sort_chunks_by_index", "unpermute"]
