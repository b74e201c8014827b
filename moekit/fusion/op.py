"""The pieces a fusion pipeline is made of: basic ops, fused ops, and per-call contexts.

A **basic op** owns its parameters and knows its own forward and backward. Besides the main
tensor that flows from op to op, it may read *extra inputs* and make *extra outputs*, by name
(``offsets``, ``probs``, ``residual`` …); :class:`moekit.fusion.Sequential` wires names made by
one op to the ops after it that read them.

A **fused op** stands in for a window of adjacent basic ops in one pass (forward or backward)
and owns no parameters: it reads those of the basic ops it replaces. The contract that lets
the forward and the backward fuse differently is the per-op :class:`OpContext`: whatever runs
an op's forward (the op itself or a fused op) leaves in that op's context what the op's own
backward reads (documented on each basic op), and whatever runs its backward reads it from
there. A fused op that runs both passes of its window (``passes`` with both) may instead keep
its own state in the first context of the window.

**Parameters are handed in.** Every method that computes takes ``params``: the tensors this
call computes with, by the names the op registers them under (``params["weight"]``; a
parameter that is None, such as an absent bias, maps to None). They are the registered
parameters, or what stands for them in this call: their casts inside a ``torch.autocast``
region, FSDP2's unsharded parameters, a ``torch.func.functional_call``'s tensors. An op never
reads ``self.weight`` to compute (only its :meth:`BasicOp.reference` does).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["BasicOp", "Decline", "FusedOp", "OpContext", "Params", "RecordedGraph"]

Extras = dict[str, Any]
# One op's parameters for one call: registered name -> tensor (None for a None parameter).
Params = Mapping[str, Any]


class OpContext:
    """What one basic op's forward left for its backward in one call (attributes named by
    the op), plus ``needs_input_grad``: whether the gradient of the op's main input is wanted,
    and ``saving``: whether a backward will run at all."""

    __slots__ = ("__dict__", "needs_input_grad", "saving")

    def __init__(self, saving: bool = True) -> None:
        self.needs_input_grad = True
        self.saving = saving  # False: no backward will run (no gradient wanted)


class BasicOp(nn.Module):
    """One step of a :class:`moekit.fusion.Sequential`; owns its parameters.

    Subclasses set ``extra_inputs`` / ``extra_outputs`` (names; may depend on constructor
    arguments) and implement:

    - ``op_forward(ctx, x, extras, params) -> (y, outputs)``: ``extras`` maps every extra name
      made so far (and the caller's extra inputs) to its value; ``outputs`` maps each of this
      op's ``extra_outputs`` to a value. Runs without autograd recording; saves in ``ctx``
      what ``op_backward`` reads.
    - ``op_backward(ctx, dy, grads, params) -> (dx, input_grads, param_grads)``: ``grads``
      maps extra names to the gradient accumulated for them so far (absent: none);
      ``input_grads`` maps this op's differentiable extra inputs to their gradients;
      ``param_grads`` maps parameter names to their gradients (absent or None: none, e.g. it
      went to ``main_grad``). ``params`` are the tensors the forward computed with.
    - ``reference(x, extras) -> (y, outputs)``: the same function in plain differentiable
      PyTorch on the registered parameters (the tests' oracle).

    Optionally, like a fused op, ``autograd_forward(x, extras, params) -> (y, outputs)``: the
    op through differentiable torch or moekit ops, which a chain runs under autograd instead
    of ``op_forward`` / ``op_backward`` wherever ``autograd_ready(params)`` says so for the
    call (see :class:`FusedOp`).

    ``autocast_extras``: the extra inputs that must have the chain's working dtype, like the
    tensor they meet (e.g. a residual added to it): a chain inside a ``torch.autocast``
    region casts them to the region's dtype, whatever their shape.
    """

    extra_inputs: tuple[str, ...] = ()
    extra_outputs: tuple[str, ...] = ()
    autocast_extras: tuple[str, ...] = ()
    autograd_forward: Callable[[torch.Tensor, Extras, Params], tuple] | None = None

    def autograd_ready(self, params: Params) -> bool:
        """Whether ``autograd_forward`` computes what ``op_forward`` / ``op_backward`` would
        for a call with these parameters (checked on every call that would run it)."""
        return True

    def op_forward(self, ctx: OpContext, x: torch.Tensor, extras: Extras, params: Params) -> tuple:
        raise NotImplementedError

    def op_backward(self, ctx: OpContext, dy: torch.Tensor, grads: Extras, params: Params) -> tuple:
        raise NotImplementedError

    def reference(self, x: torch.Tensor, extras: Extras) -> tuple:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, *extra_inputs: Any) -> Any:
        raise TypeError(
            f"{type(self).__name__} is a basic op: run it inside moekit.fusion.Sequential"
        )


class FusedOp:
    """Stands in for ``ops`` (a window of basic ops) in one or both passes; owns no
    parameters. ``params`` holds one :data:`Params` per op of the window. Implement:

    - ``fuser_forward(ctxs, x, extras, params) -> (y, outputs)``: ``ctxs`` are the window's
      contexts (fill each as its op's forward would); ``outputs`` holds every extra the
      window's ops make (or None with ``makes_extras = False``).
    - ``fuser_backward(ctxs, dy, grads, params) -> (dx, input_grads, param_grads)``:
      ``input_grads`` for the differentiable extras the window reads from outside it;
      ``param_grads`` one mapping per op of the window, as that op's ``op_backward`` returns.
    - or, for both passes, ``autograd_forward(x, extras, params) -> (y, outputs)``: the window
      through differentiable ops (moekit's ops, with their own autograd Functions), which the
      chain runs under autograd: its host time is those ops' own.
    """

    autograd_forward: Callable[[torch.Tensor, Extras, Sequence[Params]], tuple] | None = None
    # True where ``autograd_forward``, run inside a ``torch.autocast`` region on the registered
    # parameters, computes what it computes on the parameters cast to the region's dtype
    # outside one (it runs moekit's autocast-aware ops, which cast the weights themselves and
    # write fp32 weights' gradients in fp32): a chain runs it so.
    autocast_native: bool = False
    # False for a fused op whose ``outputs`` leave out the extras its window's ops make (they
    # stay inside it): the planner then uses it only where no later op reads those extras and
    # the chain does not return them, and records a decline otherwise.
    makes_extras: bool = True

    def __init__(self, ops: Sequence[BasicOp]) -> None:
        self.ops = tuple(ops)

    def fuser_forward(
        self, ctxs: list[OpContext], x: torch.Tensor, extras: Extras, params: Sequence[Params]
    ) -> tuple:
        raise NotImplementedError

    def fuser_backward(
        self, ctxs: list[OpContext], dy: torch.Tensor, grads: Extras, params: Sequence[Params]
    ) -> tuple:
        raise NotImplementedError


class Decline(str):
    """What a rule returns when it does not apply to a window: the reason, in words."""


def add_grad(grads: Extras, name: str, g: torch.Tensor | None) -> None:
    """Accumulate ``g`` into ``grads[name]``."""
    if g is None:
        return
    old = grads.get(name)
    grads[name] = g if old is None else old + g


class RecordedGraph:
    """A backward by autograd for ops whose forward is a composition of differentiable ops:
    the forward runs ``fn`` under ``enable_grad`` on detached copies of its tensor inputs and
    keeps the graph; :meth:`backward` differentiates it. ``params`` (the call's parameter
    tensors, which ``fn`` uses as they are) are reached by the graph itself. ``record=False``
    (no backward will run) runs ``fn`` without recording."""

    __slots__ = ("inputs", "outputs", "params")

    def __init__(
        self,
        fn: Callable[..., tuple],
        inputs: Sequence[torch.Tensor | None],
        params: Sequence[torch.Tensor],
        record: bool = True,
    ) -> None:
        if not record:  # no backward will run: no graph
            self.inputs, self.params = tuple(inputs), ()
            with torch.no_grad():
                self.outputs = tuple(fn(*inputs))
            return
        with torch.enable_grad():
            self.inputs = tuple(
                None if t is None else t.detach().requires_grad_(t.is_floating_point())
                for t in inputs
            )
            self.outputs = tuple(fn(*self.inputs))
        self.params = tuple(params)

    def backward(self, grads: Sequence[torch.Tensor | None]) -> tuple[tuple, tuple]:
        """(input grads, param grads) given the gradients of the outputs (None: none)."""
        outs, gs = [], []
        for o, g in zip(self.outputs, grads):
            if g is not None and isinstance(o, torch.Tensor) and o.requires_grad:
                outs.append(o)
                gs.append(g if g.dtype == o.dtype else g.to(o.dtype))
        wrt = [t for t in (*self.inputs, *self.params) if t is not None and t.requires_grad]
        found: Mapping[int, torch.Tensor | None] = {}
        if outs and wrt:
            got = torch.autograd.grad(outs, wrt, gs, allow_unused=True)
            found = {id(t): g for t, g in zip(wrt, got)}
        ins = tuple(None if t is None else found.get(id(t)) for t in self.inputs)
        return ins, tuple(found.get(id(p)) for p in self.params)
