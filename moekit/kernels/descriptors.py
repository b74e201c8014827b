"""Plain device-side TMA descriptors shared by the grouped-GEMM kernels (``@triton.jit``
helpers): one row-major matrix, or a stack of them (one per expert). The last dim has unit
stride, as TMA requires. Row-bounded ragged descriptors are :mod:`moekit.kernels.ragged`'s.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["matrix_desc", "stacked_desc"]


@triton.jit
def matrix_desc(ptr, R, C, stride, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Descriptor over a row-major [R, C] matrix (row stride ``stride``), [BLOCK_R, BLOCK_C]
    blocks."""
    return tl.make_tensor_descriptor(
        ptr, shape=[R, C], strides=[stride, 1], block_shape=[BLOCK_R, BLOCK_C]
    )


@triton.jit
def stacked_desc(ptr, S, R, C, stride_s, stride_r, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Descriptor over S row-major [R, C] matrices (an expert's weight or output each),
    [1, BLOCK_R, BLOCK_C] blocks of one matrix."""
    return tl.make_tensor_descriptor(
        ptr, shape=[S, R, C], strides=[stride_s, stride_r, 1], block_shape=[1, BLOCK_R, BLOCK_C]
    )
