"""A cheaper ``Function.apply`` for ops whose host time matters.

``torch.autograd.Function.apply`` is a Python classmethod that, before reaching the C++ apply,
checks for ``setup_context``, asks whether functorch transforms are active and rebuilds the
argument tuple through ``unwrap_dead_wrappers``. For an op with ten arguments that wrapper is
about 40% of ``apply``'s host time (2.5 of 6.2 µs on a workstation CPU; several times that on
the lent GPU hosts). Outside functorch transforms and ``torch.compile`` tracing, the op calls
the C++ apply directly; inside them it takes the normal path, which they rely on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["direct_apply"]


def direct_apply(fn: type[torch.autograd.Function]) -> Callable:
    """``fn.apply`` that skips the Python wrapper when no transform or tracer needs it.

    Only for Functions defined the classic way (``forward(ctx, ...)``, no ``setup_context``)
    whose tensor arguments are plain tensors (not escaped functorch wrappers).
    """
    if torch.autograd.function._is_setup_context_defined(fn.setup_context):
        raise TypeError(f"{fn.__name__} defines setup_context: use {fn.__name__}.apply")
    c_apply = super(torch.autograd.Function, fn).apply
    transforms_active = torch._C._are_functorch_transforms_active
    compiling = torch.compiler.is_compiling

    def apply(*args):
        if transforms_active() or compiling():
            return fn.apply(*args)
        return c_apply(*args)

    return apply
