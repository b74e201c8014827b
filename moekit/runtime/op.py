"""The op base: how every moekit op is built, the same way.

1. **Validate** the arguments (clear errors, ``moekit.ops.validation``).
2. **Plan**: what validation decided for one static configuration (shapes, strides, dtypes,
   devices, options) is cached under :func:`call_key` by :func:`planned`, so later calls of
   that configuration skip validation. A plan whose layouts the kernels read as given gets a
   ``uid``, which keys its launch replay (:mod:`moekit.runtime.replay`, the one launch path).
3. **Kernel ops** (:func:`kernel_op`): the non-differentiable work (kernels launched or the
   reference run) registered as a ``torch.library`` custom op ``moekit::<name>`` with a fake
   implementation, so ``torch.compile(fullgraph=True)``, ``FakeTensorMode`` and other tracers
   see one opaque node with known output shapes.
4. **The autograd Function** of the op, whose ``forward`` and ``backward`` call kernel ops and
   nothing else that touches tensors' memory, applied through :func:`function_apply`. Dynamo
   traces such a Function into the graph, kernel ops and all.

The host-time mechanism on top of the plain path is one: in plain eager mode
(:func:`moekit.runtime.eager.plain_eager`: no compile tracing, no functorch transform, no
dispatch mode, no tensor subclass) a kernel op calls its implementation directly instead of
going through the dispatcher, ``function_apply`` calls the C++ ``Function.apply`` directly
instead of its Python wrapper, and the kernel ops replay their recorded launches. Each skips
only what plain eager mode does not need. ``dispatcher_only()`` forces the normal path, which
the tests compare every op against.

Each shortcut checks :func:`eager_shortcut` on its own arguments. An op that has checked it
once for the whole call (all its tensors) may take the shortcuts without asking again:
``kernel_op(...).impl`` is the implementation and ``function_apply(...).direct`` the C++
apply.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from moekit.runtime.cache import cached
from moekit.runtime.eager import plain_eager
from moekit.runtime.state import STATE

__all__ = [
    "call_key",
    "dispatcher_only",
    "eager_shortcut",
    "function_apply",
    "kernel_op",
    "needs_grad",
    "planned",
    "refuse_double_backward",
]

P = TypeVar("P")


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


def call_key(op: str, tensors: Sequence[torch.Tensor | None], options: tuple) -> tuple | None:
    """The plan key of a CUDA call: the op, each tensor's static facts (shape, strides, dtype,
    device, whether it requires a gradient; None stays None) and the non-tensor ``options``.
    None for a call on CPU tensors (validated every time: its values are checked on the host
    anyway) and for an argument that is not a tensor (the full checks then say what is wrong).
    Runs on every call: a plain loop."""
    try:
        if not tensors[0].is_cuda:
            return None
        facts: list[Any] = [op]
        for t in tensors:
            if t is None:
                facts.append(None)
            else:
                facts.append((t.shape, t.stride(), t.dtype, t.device, t.requires_grad))
        facts.extend(options)
        return tuple(facts)
    except AttributeError:
        return None


def planned(key: tuple | None, build: Callable[[], P], ready: Callable[[], bool]) -> P:
    """The plan of a call: ``build()`` validates and decides (a frozen dataclass with a ``uid``
    field), cached under ``key`` (from :func:`call_key`; None: not cached). A cached plan whose
    inputs' layouts the kernels read as given (``ready()``) gets a ``uid`` of its own, which
    keys its launch replay; otherwise ``uid`` stays 0 and the launches check layouts per call.
    Not cached while ``torch.compile`` traces (each trace validates afresh)."""
    if key is None or torch.compiler.is_compiling():
        return build()

    def make() -> P:
        plan = build()
        return dataclasses.replace(plan, uid=next(STATE.uids)) if ready() else plan

    try:
        return cached(key, make)
    except TypeError:
        try:
            hash(key)
        except TypeError:  # an unhashable option: the full checks say what is wrong
            return build()
        raise
