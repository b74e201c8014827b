"""``torch.autocast`` for moekit's GEMM ops.

Inside an autocast region torch runs its matmuls (``F.linear``, ``torch.mm``) in the region's
lower-precision dtype, casting fp32 inputs and weights on the way in; gradients flow back
through the casts to the fp32 parameters. moekit's GEMM ops (``grouped_mm``,
``grouped_linear``, ``grouped_mlp``) follow the same rule, so a model trained with autocast
and fp32 weights runs its experts in bf16/fp16 like the rest of the model, instead of in fp32
(slow) or raising on mixed dtypes. One difference: moekit's GEMMs need rows of 16-byte
multiples, so a call whose sizes would not be in the region's dtype keeps its own dtype.
"""

from __future__ import annotations

import torch

__all__ = ["autocast_dtype", "autocast_on", "autocast_tensors", "autocast_weight"]


# Device types torch.autocast knows (``torch.is_autocast_enabled`` raises for others, e.g.
# meta). A fixed set rather than ``torch.amp.is_autocast_available``, which Dynamo cannot
# trace in every torch this runs on.
_AUTOCAST_DEVICE_TYPES = frozenset(
    ("cpu", "cuda", "xpu", "hpu", "mps", "mtia", "maia", "xla", "ipu", "privateuseone")
)


# One C call that answers "no region for any device type", the common case on every op call,
# for a fraction of the per-device query's cost.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def autocast_on(device_type: str) -> bool:
    """Whether an autocast region is active for this device type (False for device types
    autocast does not know, e.g. meta)."""
    if _any_autocast is not None and not torch.compiler.is_compiling() and not _any_autocast():
        return False
    return device_type in _AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device_type)


def autocast_dtype(device_type: str, *sizes: int) -> torch.dtype | None:
    """The dtype ``torch.autocast`` runs matmuls in on this device type; None outside a region,
    or where one of ``sizes`` (the GEMM's row widths) would not span a multiple of 16 bytes in
    that dtype."""
    if not autocast_on(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    width = torch.finfo(dtype).bits // 8
    for n in sizes:
        if (n * width) % 16:
            return None
    return dtype


def autocast_tensors(device_type: str, tensors: tuple, sizes: tuple = ()) -> tuple:
    """``tensors`` as an autocast matmul takes them: inside a region (and with ``sizes``
    aligned in its dtype, see :func:`autocast_dtype`), every floating-point one except fp64
    (autocast leaves double alone) cast to the region's dtype (a differentiable ``.to``);
    otherwise unchanged. None entries stay None."""
    dtype = autocast_dtype(device_type, *sizes)
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


def autocast_weight(
    weight: torch.Tensor, dtype: torch.dtype | None, master: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(tensor to compute with, master)`` for a weight in a region running in ``dtype``
    (None: no cast, e.g. sizes that break the 16-byte rule in it). Weights in that dtype, of
    fp64 or not floating stay as they are. One that needs a gradient is, with ``master``, cast
    outside autograd and returned as its own ``master``: the op then writes its gradient in
    the weight's dtype itself (one rounding, no half-precision gradient for autograd to cast
    again). Without ``master``, and while compiling (traced graphs fuse the cast themselves),
    it goes through a differentiable cast; without a gradient wanted, a detached one."""
    if dtype is None or not weight.is_floating_point() or weight.dtype in (dtype, torch.float64):
        return weight, None
    if not (weight.requires_grad and torch.is_grad_enabled()):
        return weight.detach().to(dtype), None
    if not master or torch.compiler.is_compiling():
        return weight.to(dtype), None
    return weight.detach().to(dtype).requires_grad_(), weight
