"""Whether a call runs in plain eager mode, where ops may skip the dispatcher (ops/custom_op.py)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["plain_eager"]

# Argument types that need no closer look (a tensor subclass is not among them).
_SIMPLE = frozenset(
    (torch.Tensor, nn.Parameter, type(None), int, float, bool, str, tuple, list, torch.dtype)
)


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
    # a loop, not all(...): a generator costs more than the checks on a hot path
    for a in args:  # noqa: SIM110
        if type(a) not in _SIMPLE and isinstance(a, torch.Tensor):
            return False
    return True
