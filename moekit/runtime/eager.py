"""Whether a call runs in plain eager mode, where ops may skip the dispatcher (ops/custom_op.py)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["plain_eager"]

_PLAIN = (torch.Tensor, nn.Parameter)


def plain_eager(args: tuple) -> bool:
    """True when nothing between a caller and an op's implementation needs the dispatcher:
    no ``torch.compile`` tracing, no functorch transform (vmap, grad), no dispatch mode
    (``FakeTensorMode``, tracing, functionalisation) and no tensor subclass among ``args``.

    ``torch.compiler.is_compiling()`` comes first: Dynamo folds it to True, so it never
    traces the checks after it."""
    if torch.compiler.is_compiling():
        return False
    if torch._C._are_functorch_transforms_active() or torch._C._len_torch_dispatch_stack():
        return False
    return all(a.__class__ in _PLAIN for a in args if isinstance(a, torch.Tensor))
