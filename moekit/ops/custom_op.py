"""How every moekit op is wrapped: kernel ops under an autograd Function.

1. **Kernel ops** (:func:`kernel_op`): the non-differentiable work of an op (validation done,
   kernels launched or the reference run) registered as a ``torch.library`` custom op
   ``moekit::<name>`` with a fake implementation, so ``torch.compile(fullgraph=True)``,
   ``FakeTensorMode`` and other tracers see one opaque node with known output shapes.
2. **The autograd Function** of the op, whose ``forward`` and ``backward`` call kernel ops and
   nothing else that touches tensors' memory, applied through :func:`function_apply`. Dynamo
   traces such a Function into the graph, kernel ops and all.

Host time: in plain eager mode (``moekit.runtime.eager.plain_eager``: no compile tracing, no
functorch transform, no dispatch mode, no tensor subclass) a kernel op calls its
implementation directly instead of going through the dispatcher, and ``function_apply`` calls
the C++ ``Function.apply`` directly instead of its Python wrapper (which checks for
``setup_context``, asks whether functorch transforms are active and rebuilds the argument
tuple). Both shortcuts skip only what plain eager mode does not need; everything else takes
the normal path. ``dispatcher_only()`` forces the normal path, which the tests compare against.

Each shortcut checks :func:`eager_shortcut` on its own arguments. An op that has checked it
once for the whole call (all its tensors) may take the shortcuts without asking again:
``kernel_op(...).impl`` is the implementation and ``function_apply(...).direct`` the C++
apply.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence

import torch

from moekit.runtime.eager import plain_eager
from moekit.runtime.state import STATE

__all__ = [
    "dispatcher_only",
    "eager_shortcut",
    "function_apply",
    "kernel_op",
    "needs_grad",
    "refuse_double_backward",
]


@contextlib.contextmanager
def dispatcher_only() -> Iterator[None]:
    """Within this block every kernel op goes through the dispatcher and every Function through
    ``Function.apply`` (the path the eager shortcuts are tested against)."""
    STATE.dispatcher_only = True
    try:
        yield
    finally:
        STATE.dispatcher_only = False


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will want gradients of any of ``tensors`` (else an op may run its kernel
    ops without its autograd Function). Runs on every call: a loop, not a generator."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # noqa: SIM110
        if t is not None and t.requires_grad:
            return True
    return False


def refuse_double_backward(op: str) -> None:
    """Raise in a Function's ``backward`` that runs under ``create_graph=True`` (autograd runs a
    backward with grad mode on only then): moekit's backward kernels are not differentiable,
    and a higher-order gradient through them would silently miss their terms. Under
    ``torch.compile`` tracing the compiler owns the backward and this does nothing."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(
            f"moekit.ops.{op} does not support a double backward (create_graph=True): its "
            "backward kernels are not differentiable"
        )


def eager_shortcut(args: tuple) -> bool:
    """Whether a call with these arguments may take the eager shortcuts (plain eager mode, and
    not inside ``dispatcher_only()``)."""
    return not STATE.dispatcher_only and plain_eager(args)


def kernel_op(
    name: str, *, fake: Callable, mutates_args: Sequence[str] = (), none_outputs: bool = False
) -> Callable[[Callable], Callable]:
    """Decorator: register ``impl`` as the custom op ``moekit::<name>`` (its schema inferred from
    the type hints) with the fake implementation ``fake``; returns the function to call.

    The returned function runs ``impl`` directly in plain eager mode and the custom op
    otherwise; ``.op`` is the custom op itself, ``.impl`` the implementation.

    ``none_outputs``: ``impl`` returns a tuple in which outputs it did not compute may be None;
    the direct call passes them on as None, and the custom op (whose outputs must all be
    tensors) returns an empty tensor in their place, so callers treat an empty tensor like
    None."""

    def register(impl: Callable) -> Callable:
        registered = impl
        if none_outputs:

            @functools.wraps(impl)
            def registered(*args, **kwargs):
                device = next(a.device for a in args if isinstance(a, torch.Tensor))
                outs = impl(*args, **kwargs)
                return tuple(torch.empty(0, device=device) if o is None else o for o in outs)

        op = torch.library.custom_op(
            f"moekit::{name}", registered, mutates_args=tuple(mutates_args)
        )
        op.register_fake(fake)

        @functools.wraps(impl)
        def call(*args, **kwargs):  # keyword arguments: non-tensor options only
            if STATE.dispatcher_only or not plain_eager(args):
                return op(*args, **kwargs)
            return impl(*args, **kwargs)

        call.op = op
        call.impl = impl
        return call

    return register


def function_apply(fn: type[torch.autograd.Function]) -> Callable:
    """``fn.apply`` with the Python wrapper skipped in plain eager mode (``.direct``: the C++
    apply itself).

    Only for Functions defined the classic way (``forward(ctx, ...)``, no ``setup_context``)."""
    if torch.autograd.function._is_setup_context_defined(fn.setup_context):
        raise TypeError(f"{fn.__name__} defines setup_context: use {fn.__name__}.apply")
    c_apply = super(torch.autograd.Function, fn).apply

    def apply(*args):
        if STATE.dispatcher_only or not plain_eager(args):
            return fn.apply(*args)
        return c_apply(*args)

    apply.direct = c_apply
    return apply
