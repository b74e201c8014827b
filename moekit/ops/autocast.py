"""``torch.autocast`` for moekit's GEMM ops.

Inside an autocast region torch runs its matmuls (``F.linear``, ``torch.mm``) in the region's
lower-precision dtype, casting fp32 inputs and weights on the way in; gradients flow back
through the casts to the fp32 parameters. moekit's GEMM ops (``grouped_mm``,
``grouped_linear``, ``grouped_mlp``) follow the same rule, so a model trained with autocast
and fp32 weights runs its experts in bf16/fp16 like the rest of the model, instead of in fp32
(slow) or raising on mixed dtypes.
"""

from __future__ import annotations

import torch

__all__ = ["autocast_dtype", "autocast_tensors"]


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` runs matmuls in on this device type; None outside a region."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def autocast_tensors(device_type: str, *tensors: torch.Tensor | None) -> tuple:
    """``tensors`` as an autocast matmul takes them: inside a region, every floating-point one
    except fp64 (autocast leaves double alone) cast to the region's dtype (a differentiable
    ``.to``); outside, unchanged. None entries stay None."""
    dtype = autocast_dtype(device_type)
    if dtype is None:
        return tensors
    return tuple(
        t.to(dtype)
        if isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and t.dtype not in (dtype, torch.float64)
        else t
        for t in tensors
    )
